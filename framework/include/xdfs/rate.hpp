// Rate limits: a byte budget over time that any number of channels and sessions take from.
//
// A limiter keeps a virtual timeline: each reservation of n bytes occupies n / rate seconds of
// it, starting where the previous one ended (or now, if the line has fallen behind). The caller
// waits until its reservation has ended, less a short burst allowance, then sends or reads. Over
// any spell, what passes is at most rate x spell plus the burst.
// Thread-safe (a compare-and-swap), so one limiter serves a whole server.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace xdfs {

class RateLimiter {
public:
  using Clock = std::chrono::steady_clock;
  /// bytes_per_second 0: no limit. The burst is what may pass at once after an idle spell
  /// (default: 20 ms worth).
  explicit RateLimiter(std::uint64_t bytes_per_second = 0,
                       std::chrono::nanoseconds burst = std::chrono::milliseconds(20)) noexcept;
  RateLimiter(const RateLimiter&) = delete;
  RateLimiter& operator=(const RateLimiter&) = delete;

  bool limited() const noexcept { return rate_ != 0; }
  std::uint64_t rate() const noexcept { return rate_; }
  /// Reserves n bytes; how long to wait before they go (zero: at once).
  Clock::duration take(std::uint64_t n, Clock::time_point now = Clock::now()) noexcept;

private:
  std::uint64_t rate_;
  std::int64_t burst_ns_;
  std::atomic<std::int64_t> line_ns_;  // where the timeline's last reservation ends
};

}  // namespace xdfs
