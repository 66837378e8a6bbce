// A relay place's forwarder: sends the place's file on, as it grows, to the first of its hops
// that takes it whole, and goes where the master's RELINKs send it next.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xdfs/client.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/relay.hpp"
#include "xdfs/relay_registry.hpp"

namespace xdfs::relay_detail {

/// Runs on a thread of its own until slot->cancel. `base` carries what every session downstream
/// shares (identity, protection, channels, block size, timeouts); the rest comes from the slot.
/// `digest`, if set, receives the whole-file digest of each upload that ended well.
void forward(const std::shared_ptr<runtime::RelaySlot>& slot, TransferOptions base,
             const std::function<void(const std::string&)>& log);

/// The last name of a path ("a/b/" -> "b"): what a file is called in a target's directory.
std::string base_name(std::string path);

/// A host that asks to join a running chain (a pulling host), shared between the chain and
/// the pull operation that asked for it.
struct Member {
  RelayTarget target;             ///< its own server (the address its session came from) and file
  xsec::Key32 key{};              ///< that server's key: the key its session proved
  std::atomic<bool> gone{false};  ///< its session ended: out of the chain, never routed to again
  std::mutex m;
  bool final = false;             ///< the chain is done with it; `host` says how
  RelayHost host;
};

/// Hosts joining a chain while it runs (pull mode). Each joins at the end of the chain, fed by
/// the host before it from whatever that one has; a host whole and needed by nobody after it is
/// released (its Member final), the chain's last one only after lingering for later joiners as
/// long as its own copy took (at least 1 s, at most `linger_max`), and longer while `awaited`
/// says a host is still to come. The chain ends once nobody is in it or joining; then it sets
/// `closed` and takes no more.
struct Joins {
  std::mutex m;
  std::vector<std::shared_ptr<Member>> arriving;  ///< taken by the chain
  bool closed = false;
  std::chrono::milliseconds linger_max{30000};
  /// Whether a host is still to come (a set's host that has not asked for this part yet, while
  /// it pulls the set's others): the chain's last host then lingers on, up to `linger_max`
  /// after it was whole, however short its own copy was. Called without `m`. Empty: nobody.
  std::function<bool()> awaited;
  /// Its last host lingers only while `awaited` (or a host joining) says so: a set's part past
  /// the first, which only hosts already pulling the set ask for (a host new to the set asks
  /// for part 0 first, and becomes awaited for the next parts then).
  bool only_awaited = false;
  unsigned max_tries = 20;        ///< registrations of one host (its first and its rejoins)
  std::function<void(const std::string&)> log;  ///< the chain's notes as they happen (escaped)
  /// Set by the chain while it runs (and cleared under `m` before it goes): wakes it. Call it
  /// holding `m`.
  std::function<void()> wake;
};

/// relay() itself; with `pack` (its manifest digest), the file is a pack (pack.hpp) that each
/// host writes out into its directory at the end, if its copy has that digest. With `joins`,
/// hosts also join as the chain runs (targets may be empty), and it ends when the joins do.
RelayResult relay_file(const std::string& local, const std::vector<RelayTarget>& targets, const TransferOptions& options,
                       const std::function<void(const std::vector<RelayHost>&)>& progress,
                       const manifest::Digest* pack, Joins* joins = nullptr);

}  // namespace xdfs::relay_detail
