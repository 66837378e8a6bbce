#include "xdfs/budget.hpp"

#include <unistd.h>

#include <algorithm>

namespace xdfs {

bool MemoryBudget::try_reserve(std::size_t n) noexcept {
  std::size_t cur = used_.load(std::memory_order_relaxed);
  do {
    if (n > limit_ || cur > limit_ - n) return false;
  } while (!used_.compare_exchange_weak(cur, cur + n, std::memory_order_relaxed));
  std::size_t p = peak_.load(std::memory_order_relaxed);
  while (cur + n > p && !peak_.compare_exchange_weak(p, cur + n, std::memory_order_relaxed)) {
  }
  return true;
}

bool MemoryBudget::reserve(std::size_t n, std::chrono::milliseconds wait, const std::atomic<bool>* stop) {
  if (try_reserve(n)) return true;
  if (n > limit_) return false;
  const auto until = std::chrono::steady_clock::now() + wait;
  std::unique_lock lk(mu_);
  while (true) {
    if (stop && stop->load()) return false;
    if (try_reserve(n)) return true;
    // Woken by every release; the timeout also bounds a missed wake-up between the try and
    // the wait (release does not take the mutex on its fast path).
    if (freed_.wait_until(lk, std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(50))) ==
            std::cv_status::timeout &&
        std::chrono::steady_clock::now() >= until)
      return try_reserve(n);
  }
}

void MemoryBudget::release(std::size_t n) noexcept {
  used_.fetch_sub(n, std::memory_order_relaxed);
  freed_.notify_all();
}

void MemoryBudget::wake_all() noexcept { freed_.notify_all(); }

std::size_t default_memory_limit() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  const std::size_t two_gib = std::size_t(2) << 30;
  if (pages <= 0 || page <= 0) return two_gib;
  return std::min(two_gib, static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 4);
}

}  // namespace xdfs
