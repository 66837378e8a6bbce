// One file to many hosts through a pipelined chain of xdfsd servers (the relay mode).
//
//   std::vector<xdfs::RelayTarget> hosts{{{"h1", 7721}, "in/"}, {{"h2", 7721}, "in/"}};
//   auto r = xdfs::relay("big.iso", hosts, opt);
//   for (auto& h : r.hosts) if (!h.ok) ...
//
// The caller is the chain's master. It registers each host's place over a session of its own
// (Mode::relay: the file, a fresh ticket, and the hosts that come after it), then uploads the
// file once, to the first host that answers. Each host verifies every block, writes it and
// forwards it as soon as it is written to the first of its successors that answers, with the
// ticket the master registered there; so the file crosses the source's link about once and the
// k-th host finishes about k blocks after the first. Every host reports its verified bytes to
// the master once a second; a host that dies is passed over by its predecessor, and its
// successor goes on from the bytes it verified (the upload resumes). A host's copy counts only
// when its whole-file digest equals the source's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "xdfs/client.hpp"
#include "xdfs/pathm/path_client.hpp"
#include "xdfs/server.hpp"

namespace xdfs {

struct RelayTarget {
  Endpoint server;
  std::string path;  ///< on that server; ending in '/' (or empty): the file's own name in that directory
};

/// One host's part, as its reports (and the sessions to it) told it.
struct RelayHost {
  RelayTarget target;
  bool ok = false;               ///< whole there, its digest the source's
  errc code = errc::ok;          ///< otherwise why
  std::string message;
  std::uint64_t verified = 0;    ///< bytes verified there
  double seconds = 0;            ///< from the start until it was whole (or gave up)
  std::string digest;            ///< hex, as that host computed it
  bool final = false;            ///< its last report came
};

struct RelayResult {
  std::vector<RelayHost> hosts;  ///< in the order given
  std::uint64_t size = 0;
  double seconds = 0;            ///< until the last host was done
  std::string digest;            ///< the source's whole-file digest (hex)
  std::uint64_t source_bytes = 0;  ///< bytes the source sent (over all its uploads)
  std::vector<std::string> notes;  ///< what the master changed on the way (a host moved, passed over), one line each
  std::size_t failed() const noexcept {
    std::size_t n = 0;
    for (const auto& h : hosts) n += !h.ok;
    return n;
  }
};

/// Sends the regular file `local` to every target through a relay chain in the given order.
/// `options` are the sessions' (channels, block size, protection, identity) and the upload's;
/// verify must be on. `progress`, if set, is called about every 200 ms with the hosts as they
/// stand. Throws TransferError only when nothing could start (no such file, ...); a host that
/// fails is reported in the result, and the others go on.
RelayResult relay(const std::string& local, const std::vector<RelayTarget>& targets, const TransferOptions& options,
                  const std::function<void(const std::vector<RelayHost>&)>& progress = {});

/// How relay_set() moves several sources.
struct RelaySetOptions {
  /// Chains fed by the source at once, the hosts dealt among them in turn: as many as the
  /// source's link is times faster than a host's (each chain sends every byte once more from
  /// the source).
  unsigned chains = 1;
  /// Files in their chains at once, and their bytes (one file at least): a chain's setup (a
  /// session to every host) overlaps the files before it. Each file holds two sessions of this
  /// key at its chain's first host (its place and the source's upload), one at the others: six
  /// stay within xdfsd's default of 16 sessions a key.
  unsigned files_at_once = 6;
  std::uint64_t bytes_at_once = std::uint64_t(64) << 20;
  /// A tree's files smaller than this go to each host in path mode with the tree's directories
  /// and symlinks, where a chain's setup would cost more than their bytes (at least 1: empty
  /// files never go through a chain).
  std::uint64_t chain_threshold = std::uint64_t(1) << 20;
  bool recursive = false;     ///< directories among the sources are trees (else refused)
  pathm::TreeOptions tree;    ///< the trees' path parts (follow, workers, ...)
};

/// Sends files and trees to every target. Each target's path is a directory (the sources go in
/// it by their names, a tree ending in '/' as its contents, as `xduc -r` does), except for one
/// file alone, which goes where relay() puts it. Every file of at least set.chain_threshold
/// bytes (every file named as a source) goes through relay chains, several files at a time
/// (files_at_once, bytes_at_once), each in `set.chains` chains; a tree's directories, symlinks
/// and smaller files go to each host in path mode first, and the attributes of its large files
/// and directories are set on each host last. A host that fails a part is left out of the parts after it; its
/// RelayHost says which file and why. The result's size is the set's bytes; its digest (and
/// each host's) only for one file.
RelayResult relay_set(const std::vector<std::string>& sources, const std::vector<RelayTarget>& targets,
                      const TransferOptions& options, const RelaySetOptions& set = {},
                      const std::function<void(const std::vector<RelayHost>&)>& progress = {});

/// How pull() takes part.
struct PullOptions {
  /// Where this host's own server listens for the host that feeds it (the master connects to
  /// the address this host's session comes from, at this port; port 0 picks a free one).
  std::string listen = "0.0.0.0:0";
  /// Sessions to the master, the first and each after one ended without the whole file (XGet's
  /// 20 retries, each through the master).
  unsigned tries = 21;
  /// Called about every 200 ms with the bytes verified here so far.
  std::function<void(std::uint64_t verified, std::uint64_t size)> progress;
  /// This host's server's log lines (its place, the uploads that feed it), escaped; none if unset.
  std::function<void(const std::string&)> log;
  /// `remote` is a directory: its regular files (a set, at most 20000) travel in parts, packs
  /// of the small files and each file over 16 MiB alone, each part through a chain of its own
  /// (a session to the master each, one after another), and go into `local`, a directory,
  /// each part once it is whole. A set that changes on the master meanwhile fails
  /// the pull (size_mismatch): pulled again, it is the set as it is now.
  bool set = false;
  /// A memory file system (tmpfs) where a set's parts of up to 128 MiB wait while they arrive
  /// and feed the hosts after this one (two parts at most at once), so that their bytes reach
  /// the disk once, as the set's files. Empty, not a tmpfs, or with less than 512 MiB free at
  /// the start: beside `local`; a part that would leave less than 128 MiB there: beside `local`.
  std::string memory_stage = "/dev/shm";
};

struct PullResult {
  std::string local;        ///< where the file is now
  std::uint64_t size = 0;
  double seconds = 0;       ///< from the first session until the master let this host go
  unsigned tries = 0;       ///< sessions to the master
  std::uint64_t files = 0;  ///< a set's files written
  std::uint64_t early_files = 0;  ///< of those: copied out of their pack while it arrived
};

/// Asks the xdfsd `master` for its file `remote` and takes part in that file's chain until
/// the master lets this host go: this host's own server (with this client's key, admitting only
/// the master) takes its place at the chain's end, is fed by the host before it, verifies every
/// block, writes it and feeds the hosts routed after it, and stays while the master says a host
/// after it needs it. `local` is a file or an existing directory (the file's own name in it).
/// Lost sessions to the master are tried again (PullOptions::tries); what was verified is kept
/// and goes on. Throws TransferError when the file cannot be had (its cause), with nothing left
/// under its name.
PullResult pull(const Endpoint& master, const std::string& remote, const std::string& local,
                const TransferOptions& options, const PullOptions& pull = {});

namespace relay_mode {
/// The server's side: a master's relay operation (register, forward, report).
runtime::ModeEntry server_mode();
/// The server's side of a pull: the host joins the file's chain, which this server runs.
runtime::ModeEntry pull_mode();
}  // namespace relay_mode

}  // namespace xdfs
