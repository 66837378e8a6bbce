#include "forward.hpp"

#include <fcntl.h>

#include <fmt/core.h>

#include <array>
#include <chrono>
#include <optional>
#include <cstdlib>
#include <thread>

#include "xdfs/text.hpp"

namespace xdfs::relay_detail {

using runtime::RelaySlot;

namespace {

// Refusals worth a second try at the same hop: its place is still fed by the upstream it is
// leaving (a RELINK moved this one in front of it a moment ago).
bool busy(const TransferError& e) { return e.code() == errc::limit_exceeded && e.remote(); }

}  // namespace

void forward(const std::shared_ptr<RelaySlot>& slot, TransferOptions base,
             const std::function<void(const std::string&)>& log) {
  // The file is there once the first upload began (a later one may begin it again, if the
  // first verified nothing): each attempt reads it through a descriptor of its own.
  auto open_file = [&]() -> files::Fd {
    while (!slot->cancel.load()) {
      {
        std::lock_guard lock(slot->m);
        if (slot->file) return files::Fd(::fcntl(slot->file.get(), F_DUPFD_CLOEXEC, 3));
      }
      // Each hop of a chain waits here for the one before it: a short poll keeps a small
      // file's time through k hosts near k round trips.
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return files::Fd();
  };
  // Test hook: a damaged copy ("forge": damaged with digests to match, as a hostile host would).
  const char* hook = std::getenv("XDFS_TEST_RELAY_CORRUPT");
  const std::uint8_t corrupt = !hook ? 0 : std::string_view(hook) == "forge" ? 2 : 1;
  std::optional<std::array<std::uint8_t, 32>> delivered;  // the ticket of the hop that has it whole
  while (!slot->cancel.load()) {
    std::vector<wire::RelayHop> hops;
    std::uint64_t generation;
    {
      std::lock_guard lock(slot->m);
      hops = slot->next_hops;
      generation = slot->relinks;
      slot->hop_cancel.store(false);
      // Its first hop has it whole from us already: nothing to do for these hops.
      if (!hops.empty() && delivered && hops[0].ticket == *delivered) hops.clear();
      slot->forward_done = hops.empty();
    }
    slot->forwarding.store(!hops.empty());
    bool moved = false;
    for (std::uint32_t i = 0; i < hops.size() && !slot->cancel.load() && !moved; ++i) {
      slot->next.store(i);
      slot->forwarded.store(0);
      const auto& hop = hops[i];
      TransferOptions o = base;
      o.server_key = hop.server_key;
      o.cancel = &slot->hop_cancel;
      o.verify = true;
      o.resume = true;
      o.relay_ticket.assign(hop.ticket.begin(), hop.ticket.end());
      o.available = &slot->written;
      o.relay_digests = &slot->digests;
      o.relay_test_corrupt = corrupt;
      o.relay_size = slot->size;
      o.relay_mtime_ns = slot->mtime_ns;
      auto shown = o.progress;
      o.progress = [slot, shown](const Progress& p) {
        slot->forwarded.store(p.bytes);
        if (shown) shown(p);
      };
      errc code = errc::internal;
      std::string why;
      for (unsigned attempt = 0;; ++attempt) {
        try {
          Endpoint ep;
          if (!xdsi::parse_host_port(hop.address, 7721, ep.host, ep.port))
            throw TransferError(errc::bad_argument, "bad address", false);
          files::Fd fd = open_file();
          if (!fd) throw TransferError(errc::cancelled, "cancelled", false);
          auto r = upload("/proc/self/fd/" + std::to_string(fd.get()), ep, "relay", o);
          slot->forwarded.store(slot->size);
          std::lock_guard lock(slot->m);
          slot->sent += r.bytes - r.resumed_from;
          slot->sent_digest = r.digest;
          slot->delivered = true;
          delivered = hop.ticket;
          code = errc::ok;
          break;
        } catch (const TransferError& e) {
          code = e.code();
          why = e.what();
          if (busy(e) && attempt < 30 && !slot->hop_cancel.load()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            continue;
          }
        } catch (const std::exception& e) {
          code = errc::internal;
          why = e.what();
        }
        break;
      }
      if (code == errc::ok) break;
      {
        std::lock_guard lock(slot->m);
        moved = slot->relinks != generation;
      }
      if (moved || slot->cancel.load()) break;
      log(fmt::format("relay of '{}': passing over {} ({}): {}", text::escape(slot->path), text::escape(hop.address),
                      to_string(code), text::escape(why)));
      std::lock_guard lock(slot->m);
      if (slot->skipped.size() < wire::max_relay_hops) slot->skipped.push_back({i, code, why});
    }
    slot->forwarding.store(false);
    {
      std::lock_guard lock(slot->m);
      if (slot->relinks != generation) continue;
      slot->forward_done = true;
    }
    slot->next.store(static_cast<std::uint32_t>(hops.size()));
    // Done with these hops: wait for the master to send it somewhere else, or to end it.
    while (!slot->cancel.load()) {
      {
        std::lock_guard lock(slot->m);
        if (slot->relinks != generation) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the release joins this thread
    }
  }
  slot->forwarding.store(false);
}

}  // namespace xdfs::relay_detail
