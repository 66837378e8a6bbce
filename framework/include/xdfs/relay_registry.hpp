// Relay chains on the server: the places in chains that masters registered here (Mode::relay),
// each under its ticket, for the uploads that feed them and the forwarders that read from them.
//
// A master registers a host's place over its own authenticated session: the file (path in the
// master's root, size, mtime), a fresh random ticket, and the hops the host forwards to. An
// upload that carries the ticket feeds that place: the master's own, or one from the xdfsd
// upstream, which holds the ticket only because the master gave it in that host's plan. Such
// an upload writes the master's file with the master's rights, whoever sends it; it may choose
// nothing (path, size and mtime are the place's). Every block is verified before it is written,
// so what lies below `written` can be forwarded as it is.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <list>
#include <string>
#include <thread>
#include <vector>

#include "xdfs/error.hpp"
#include "xdfs/files.hpp"
#include "xdfs/piod.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xsec.hpp"

namespace xdfs::runtime {

using RelayTicket = std::array<std::uint8_t, 32>;

/// The digests of the blocks a place received, by block, as its source gave them.
class RelayDigests final : public piod::DigestLog {
public:
  /// Room for the digests of `blocks` blocks, taken once (the place's, as its memory budget
  /// counts them: growing by doubling would take up to three times that); false if there is none.
  bool size_for(std::uint64_t blocks) noexcept {
    std::lock_guard lock(m_);
    try {
      digests_.reserve(blocks);
      have_.reserve(blocks);
      return true;
    } catch (...) {
      return false;
    }
  }
  /// A block past that room is not kept: the forwarder hashes it itself.
  void put(std::uint64_t block, const manifest::Digest& d) noexcept override {
    std::lock_guard lock(m_);
    if (block >= digests_.capacity() || block >= have_.capacity()) return;
    if (block >= have_.size()) {  // within the room taken: no allocation, nothing thrown
      have_.resize(block + 1, false);
      digests_.resize(block + 1);
    }
    digests_[block] = d;
    have_[block] = true;
  }
  bool get(std::uint64_t block, manifest::Digest& d) const noexcept override {
    std::lock_guard lock(m_);
    if (block >= have_.size() || !have_[block]) return false;
    d = digests_[block];
    return true;
  }

private:
  mutable std::mutex m_;
  std::vector<manifest::Digest> digests_;
  std::vector<bool> have_;
};

/// One host's place in one chain. Shared by the master's relay operation (which made it), the
/// uploads that feed it and its forwarder, on their own threads: the atomics are read anywhere,
/// the rest is under `m`.
struct RelaySlot {
  // Fixed once registered.
  wire::RelayPlan plan;
  std::string path;              ///< relative to root
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;
  std::uint32_t block_size = 0;
  unsigned channels = 1;         ///< n of the sessions it opens downstream (the master's)
  xsec::Key32 master{};          ///< whose rights the uploads write with
  std::string master_fingerprint;
  files::Fd root;                ///< the master's root (its key's subdirectory), O_PATH

  /// Bytes of the file written here with every block checked (Sink::written).
  std::atomic<std::uint64_t> written{0};
  /// The master gave this host up because its copy is in doubt: what it verified is not kept.
  std::atomic<bool> discard{false};
  /// Bytes the current hop downstream has acknowledged.
  std::atomic<std::uint64_t> forwarded{0};
  /// The hop of plan.next it forwards to now (plan.next.size(): none).
  std::atomic<std::uint32_t> next{0};
  /// Set to stop the forwarder and refuse further uploads (the relay operation ended).
  std::atomic<bool> cancel{false};
  /// Set to drop the hop the forwarder feeds now (a RELINK came): it starts again with the
  /// new hops.
  std::atomic<bool> hop_cancel{false};
  std::atomic<bool> forwarding{false};
  RelayDigests digests;

  std::mutex m;
  /// Uploads that fed it, and files it was given, so far (changed under m): while it is 1, what
  /// is below `written` is the file's for good (a later upload into the same file writes again
  /// from its own resume point, which may be below `written`).
  std::atomic<std::uint64_t> feeds{0};
  bool feeding = false;          ///< an upload writes it now
  bool whole = false;            ///< committed under its name, the digest agreed
  bool committed = false;        ///< an upload into it made it whole under its name, with the plan's digest
  bool forward_done = false;     ///< the forwarder ended (delivered, or every hop skipped)
  bool delivered = false;        ///< a hop downstream has the whole file
  std::vector<std::uint8_t> digest;
  std::uint64_t sent = 0;        ///< bytes the forwarder's uploads moved (resumed parts not counted)
  std::string sent_digest;       ///< hex: the whole-file digest of its last upload that ended well
  files::Fd file;                ///< the file the uploads write, for the forwarder (read only)
  std::vector<wire::RelayHop> next_hops;  ///< where the forwarder goes (the plan's, then RELINKs')
  std::uint64_t relinks = 0;          ///< changes of hops or file: the forwarder starts over when it moves
  std::uint64_t relinks_heard = 0;    ///< RELINKs from the master (for its reports)
  std::vector<std::uint8_t> upstream; ///< the key of who fed it last
  errc upstream_code = errc::ok;      ///< how the last upload into it failed (ok: it did not)
  std::string upstream_message;
  std::vector<wire::RelayReport::Skip> skipped;
};

/// The server's registered places, by ticket (thread-safe).
class RelayRegistry {
public:
  /// The server's own key: the forwarders open their sessions downstream with it.
  explicit RelayRegistry(const xsec::KeyPair& server) : server_(server) {}
  ~RelayRegistry() { stop_chains(); }
  RelayRegistry(const RelayRegistry&) = delete;
  RelayRegistry& operator=(const RelayRegistry&) = delete;
  const xsec::KeyPair& server_key() const noexcept { return server_; }

  /// Chains this server runs as their master (pull mode) stop with it: `stopping` is their
  /// cancel; the server joins their threads once its sessions are gone (stop_chains()).
  std::atomic<bool> stopping{false};
  /// Runs `body` on a thread of the server's (those that ended are joined now).
  template <class F>
  void run_chain(F body) {
    std::lock_guard lock(m_);
    for (auto it = chains_.begin(); it != chains_.end();) {
      if (it->second->load()) {
        it->first.join();
        it = chains_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    // The list's node first: a thread that runs is never destroyed joinable (that would end the
    // process), and what its body throws ends only the body.
    auto& slot = chains_.emplace_back(std::thread{}, done);
    try {
      slot.first = std::thread([body = std::move(body), done]() mutable {
        try {
          body();
        } catch (...) {
        }
        done->store(true);
      });
    } catch (...) {
      chains_.pop_back();
      throw;
    }
  }
  void stop_chains() {
    stopping.store(true);
    std::list<std::pair<std::thread, std::shared_ptr<std::atomic<bool>>>> v;
    {
      std::lock_guard lock(m_);
      v.swap(chains_);
    }
    for (auto& [t, done] : v)
      if (t.joinable()) t.join();
  }

  /// False if the ticket is taken already.
  bool add(const std::shared_ptr<RelaySlot>& s) {
    std::lock_guard lock(m_);
    return slots_.emplace(s->plan.ticket, s).second;
  }
  void remove(const RelayTicket& t) {
    std::lock_guard lock(m_);
    slots_.erase(t);
  }
  std::shared_ptr<RelaySlot> find(std::span<const std::uint8_t> ticket) const {
    if (ticket.size() != RelayTicket{}.size()) return nullptr;
    RelayTicket t{};
    std::copy(ticket.begin(), ticket.end(), t.begin());
    std::lock_guard lock(m_);
    auto it = slots_.find(t);
    return it == slots_.end() ? nullptr : it->second;
  }
  /// The place registered for `path` (relative to the root) that is still running, if any.
  std::shared_ptr<RelaySlot> find_path(const std::string& path) const {
    std::lock_guard lock(m_);
    for (const auto& [t, s] : slots_)
      if (s->path == path && !s->cancel.load()) return s;
    return nullptr;
  }
  std::size_t size() const {
    std::lock_guard lock(m_);
    return slots_.size();
  }

private:
  xsec::KeyPair server_;
  mutable std::mutex m_;
  std::map<RelayTicket, std::shared_ptr<RelaySlot>> slots_;
  std::list<std::pair<std::thread, std::shared_ptr<std::atomic<bool>>>> chains_;
};

}  // namespace xdfs::runtime
