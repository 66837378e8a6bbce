#include "xdfs/pathm/pool.hpp"

namespace xdfs::pathm {

WorkPool::WorkPool(unsigned threads, std::function<void(const std::string&)> on_error)
    : on_error_(std::move(on_error)) {
  if (threads == 0) threads = 1;
  try {
    for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
  } catch (...) {
    stop();  // the threads already made are joined before the failure goes on
    throw;
  }
}

WorkPool::~WorkPool() { stop(); }

void WorkPool::submit(std::function<void()> job) {
  {
    std::lock_guard lk(mu_);
    if (stopping_) return;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void WorkPool::stop() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
    jobs_.clear();
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

void WorkPool::run() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [this] { return stopping_ || !jobs_.empty(); });
      if (stopping_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    // A job that throws fails what it was doing, never the process.
    try {
      job();
    } catch (const std::exception& e) {
      if (on_error_) on_error_(e.what());
    } catch (...) {
      if (on_error_) on_error_("unknown exception");
    }
  }
}

}  // namespace xdfs::pathm
