#include "xdfs/rate.hpp"

#include <algorithm>

namespace xdfs {

RateLimiter::RateLimiter(std::uint64_t bytes_per_second, std::chrono::nanoseconds burst) noexcept
    : rate_(bytes_per_second), burst_ns_(burst.count()), line_ns_(INT64_MIN / 2) {}

RateLimiter::Clock::duration RateLimiter::take(std::uint64_t n, Clock::time_point now) noexcept {
  if (rate_ == 0) return Clock::duration::zero();
  const std::int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
  // n / rate seconds, in ns, without overflow: n is at most a block plus its tag (2^27) here,
  // and 128-bit arithmetic keeps any n exact.
  __extension__ using u128 = unsigned __int128;  // (GCC's and Clang's; -Wpedantic knows no such type)
  const auto cost = static_cast<std::int64_t>(std::min<u128>((static_cast<u128>(n) * 1000000000u) / rate_, INT64_MAX / 4));
  // The bytes are paid for when their reservation ends: they go once the line, with them on
  // it, is no more than the burst ahead of now.
  // The line never runs more than an hour ahead (cost is capped the same way), so no sum
  // overflows however many reservations pile up; a limit that slow fails on idle timeouts first.
  constexpr std::int64_t horizon = std::int64_t(3600) * 1000000000;
  std::int64_t line = line_ns_.load(std::memory_order_relaxed);
  std::int64_t end = 0;
  do {
    end = std::min(std::max(line, now_ns) + std::min(cost, horizon), now_ns + horizon);
  } while (!line_ns_.compare_exchange_weak(line, end, std::memory_order_relaxed));
  const std::int64_t wait = end - now_ns - burst_ns_;
  return wait > 0 ? std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(wait))
                  : Clock::duration::zero();
}

}  // namespace xdfs
