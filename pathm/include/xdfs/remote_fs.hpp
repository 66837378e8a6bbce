// Remote file operations and directory trees over a session (path mode, xPathM).
//
//   xdfs::RemoteFs fs({"server", 7721}, opt);
//   fs->mkdir("incoming/run7", true);
//   fs->upload_tree("results/", "incoming/run7", {});
//   fs.close();
//
// or as one operation of a session that carries others before and after it:
//
//   xdfs::Session s({"server", 7721}, opt);
//   xdfs::upload(s, "big.iso", "incoming/", opt);   // xFTSM
//   { xdfs::RemoteFs fs(s); fs->stat("incoming/big.iso"); }
//   s.close();
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "xdfs/pathm/path_client.hpp"
#include "xdfs/session.hpp"

namespace xdfs {

/// A path-mode operation: remote file operations and whole directory trees over n channels,
/// many requests outstanding at once.
///
/// The constructor starts the operation (and, with an endpoint, opens a session of its own);
/// every call then blocks until its answer (or throws xdfs::Error). Paths are relative to the
/// server's root. Calls are serialized; between them a background thread sends keep-alives
/// (SessionOptions::keep_alive), so an idle RemoteFs stays connected until close().
class RemoteFs {
public:
  /// A session of its own.
  explicit RemoteFs(const Endpoint& server, const SessionOptions& options = {});
  /// A path operation of `session` (opened by this if it is not yet); the session stays the
  /// caller's and, once this is closed, carries the next operation.
  explicit RemoteFs(Session& session);
  ~RemoteFs();
  RemoteFs(const RemoteFs&) = delete;
  RemoteFs& operator=(const RemoteFs&) = delete;
  pathm::PathClient* operator->();
  pathm::PathClient& client();
  /// Ends the path operation cleanly (and the session, if it is this one's own). Also done by
  /// the destructor.
  void close();

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace pathm {

/// Copies one file of a tree on the session as a file transfer of its own (xFTSM: xdfs::upload
/// or xdfs::download) and returns its bytes: from the local path to the remote one (upload) or
/// from the remote path to the local one (download). Throws TransferError; one that leaves the
/// session usable fails that file only.
using CopyFile = std::function<std::uint64_t(const std::string& from, const std::string& to)>;

/// A tree copy as operations of `session`: a path operation for the directories, symlinks and
/// files under o.large_file bytes; then `copy` for each larger file, each its own transfer;
/// then the directories' attributes (upload: one more path operation; download: here), since
/// the large files changed their mtimes. Throws TreeError, with everything else copied, when
/// entries could not be copied; other failures throw xdfs::Error. xdfs::upload_tree and
/// xdfs::download_tree (xdfs/xdfs.hpp) give `copy` as xFTSM.
TreeResult upload_tree(Session& session, const std::string& local, const std::string& remote, const TreeOptions& o,
                       const CopyFile& copy);
TreeResult download_tree(Session& session, const std::string& remote, const std::string& local,
                         const TreeOptions& o, const CopyFile& copy);

}  // namespace pathm

}  // namespace xdfs
