// Everything a program that moves files with xDFS needs, in one include: the client API for
// files (xFTSM) and remote paths (xPathM) over sessions, and the server with its standard modes.
#pragma once

#include "xdfs/client.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/pathm/server_mode.hpp"
#include "xdfs/relay.hpp"
#include "xdfs/remote_fs.hpp"
#include "xdfs/server.hpp"
#include "xdfs/session.hpp"
#include "xdfs/xftsm/server_mode.hpp"

#include <string>

namespace xdfs {

/// The modes xdfsd offers: file upload and download (xFTSM), path operations (xPathM), places
/// in relay chains (one file to many hosts) and pulls routed into chains (many hosts asking).
inline runtime::Modes standard_modes() {
  auto modes = xftsm::server_modes();
  modes.push_back(pathm::server_mode());
  modes.push_back(relay_mode::server_mode());
  modes.push_back(relay_mode::pull_mode());
  return modes;
}

/// xFTSM as a RemoteFs's file transfers (RemoteFs::upload, RemoteFs::download), with the
/// transfer's own options of `transfer` (ring, fsync, progress).
inline FileTransfers file_transfers(const TransferOptions& transfer = {}) {
  return {[transfer](Session& s, const std::string& local, const std::string& remote) {
            return upload(s, local, remote, transfer).bytes;
          },
          [transfer](Session& s, const std::string& remote, const std::string& local) {
            return download(s, remote, local, transfer).bytes;
          }};
}

/// A directory tree copied over `session`: path mode for its directories, symlinks and small
/// files, and each file of at least tree.large_file bytes as an xFTSM transfer of its own
/// (blocks sealed and written on disk threads, as a single file moves) with `transfer`'s own
/// options. See pathm::upload_tree for what it throws.
inline pathm::TreeResult upload_tree(Session& session, const std::string& local, const std::string& remote,
                                     const pathm::TreeOptions& tree, const TransferOptions& transfer = {}) {
  return pathm::upload_tree(session, local, remote, tree, [&](const std::string& from, const std::string& to) {
    return upload(session, from, to, transfer).bytes;
  });
}
inline pathm::TreeResult download_tree(Session& session, const std::string& remote, const std::string& local,
                                       const pathm::TreeOptions& tree, const TransferOptions& transfer = {}) {
  return pathm::download_tree(session, remote, local, tree, [&](const std::string& from, const std::string& to) {
    return download(session, from, to, transfer).bytes;
  });
}

}  // namespace xdfs
