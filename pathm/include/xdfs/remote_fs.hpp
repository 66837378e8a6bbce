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

/// How a RemoteFs moves one file as a transfer of its own on its session: path mode knows no
/// other mode, so the caller gives them; xdfs::file_transfers(options) (xdfs/xdfs.hpp) gives
/// xFTSM's. Each returns the bytes moved and throws TransferError.
struct FileTransfers {
  std::function<std::uint64_t(Session&, const std::string& local, const std::string& remote)> upload;
  std::function<std::uint64_t(Session&, const std::string& remote, const std::string& local)> download;
};

/// A path-mode operation: remote file operations and whole directory trees over n channels,
/// many requests outstanding at once.
///
/// The constructor starts the operation (and, with an endpoint, opens a session of its own);
/// every call then blocks until its answer (or throws xdfs::Error). Paths are relative to the
/// server's root. Calls are serialized; between them a background thread sends keep-alives
/// (SessionOptions::keep_alive), so an idle RemoteFs stays connected until close().
///
/// upload() and download() move one file as a transfer of its own on the same session (with
/// the FileTransfers given): the path operation ends first, and the next path call starts a new
/// one on the same channels.
class RemoteFs {
public:
  /// A session of its own.
  explicit RemoteFs(const Endpoint& server, const SessionOptions& options = {}, FileTransfers transfers = {});
  /// A path operation of `session` (opened by this if it is not yet); the session stays the
  /// caller's and, once this is closed, carries the next operation.
  explicit RemoteFs(Session& session, FileTransfers transfers = {});
  ~RemoteFs();
  RemoteFs(const RemoteFs&) = delete;
  RemoteFs& operator=(const RemoteFs&) = delete;
  /// The path client (starting the next path operation if a file transfer ended the last one).
  pathm::PathClient* operator->();
  pathm::PathClient& client();
  /// Sends the local regular file `local` to `remote` as a file transfer of its own on this
  /// session; returns its bytes. A refusal (no such directory, ...) throws and leaves this
  /// usable; errc::not_supported without FileTransfers.
  std::uint64_t upload(const std::string& local, const std::string& remote);
  /// Fetches `remote` into `local` (written under a temporary name, renamed into place whole).
  std::uint64_t download(const std::string& remote, const std::string& local);
  /// The session the path operation runs on (its own, or the one it was given): its io() is the
  /// loop that a caller of the client's async_ calls runs (restart() it after a blocking call).
  Session& session() noexcept;
  /// Whether the last failure of a path call was the server's (it answered with an error); never
  /// starts anything, so a catch handler may ask.
  bool remote_error() const noexcept;
  /// Ends the path operation cleanly (and the session, if it is this one's own); throws the
  /// operation's failure if it did not end cleanly. Also done by the destructor (which does not throw).
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
