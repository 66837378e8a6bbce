// A server-wide memory budget: every buffer that holds bytes for a peer (rings, path-mode
// requests and replies) is reserved here before it is allocated, so that the sum never grows
// past the limit however many sessions ask at once.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <optional>
#include <utility>

namespace xdfs {

class MemoryBudget {
public:
  explicit MemoryBudget(std::size_t limit) noexcept : limit_(limit) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  std::size_t limit() const noexcept { return limit_; }
  std::size_t used() const noexcept { return used_.load(std::memory_order_relaxed); }
  /// The most that was ever in use at once.
  std::size_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }

  /// Takes n bytes if they fit; never blocks.
  bool try_reserve(std::size_t n) noexcept;
  /// Waits up to `wait` for n bytes to fit; false if they did not, or once *stop is set. A
  /// request larger than the whole limit never fits.
  bool reserve(std::size_t n, std::chrono::milliseconds wait, const std::atomic<bool>* stop = nullptr);
  void release(std::size_t n) noexcept;
  /// Wakes every waiter (so that one whose stop flag was set returns at once).
  void wake_all() noexcept;

private:
  const std::size_t limit_;
  std::atomic<std::size_t> used_{0};
  std::atomic<std::size_t> peak_{0};
  std::mutex mu_;  // only for waiters
  std::condition_variable freed_;
};

/// Bytes taken from a budget, given back when this goes (or by reset()).
class Reservation {
public:
  Reservation() = default;
  Reservation(MemoryBudget* b, std::size_t n) noexcept : budget_(b), bytes_(n) {}
  ~Reservation() { reset(); }
  Reservation(Reservation&& o) noexcept : budget_(std::exchange(o.budget_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  Reservation& operator=(Reservation&& o) noexcept {
    if (this != &o) {
      reset();
      budget_ = std::exchange(o.budget_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  /// n bytes from b if they fit now; with no budget (a client), always.
  static std::optional<Reservation> take(MemoryBudget* b, std::size_t n) noexcept {
    if (!b) return Reservation(nullptr, n);
    if (!b->try_reserve(n)) return std::nullopt;
    return Reservation(b, n);
  }
  std::size_t bytes() const noexcept { return bytes_; }
  /// Gives back what is held beyond n (a reply smaller than its estimate).
  void shrink_to(std::size_t n) noexcept {
    if (n >= bytes_) return;
    if (budget_) budget_->release(bytes_ - n);
    bytes_ = n;
  }
  void reset() noexcept {
    if (budget_ && bytes_) budget_->release(bytes_);
    budget_ = nullptr;
    bytes_ = 0;
  }

private:
  MemoryBudget* budget_ = nullptr;
  std::size_t bytes_ = 0;
};

/// The default server memory limit: a quarter of the machine's memory, at most 2 GiB.
std::size_t default_memory_limit() noexcept;

}  // namespace xdfs
