// A relay place's forwarder: sends the place's file on, as it grows, to the first of its hops
// that takes it whole, and goes where the master's RELINKs send it next.
#pragma once

#include <functional>
#include <memory>
#include <string>

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

/// relay() itself; with `pack` (its manifest digest), the file is a pack (pack.hpp) that each
/// host writes out into its directory at the end, if its copy has that digest.
RelayResult relay_file(const std::string& local, const std::vector<RelayTarget>& targets, const TransferOptions& options,
                       const std::function<void(const std::vector<RelayHost>&)>& progress,
                       const manifest::Digest* pack);

}  // namespace xdfs::relay_detail
