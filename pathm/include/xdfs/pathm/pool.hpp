// A bounded set of worker threads for file-system work, so that creating, writing, closing and
// renaming many small files runs beside the network thread instead of behind it.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace xdfs::pathm {

class WorkPool {
public:
  /// on_error hears what a job threw (on the worker's thread); the worker goes on with the next.
  explicit WorkPool(unsigned threads, std::function<void(const std::string&)> on_error = {});
  /// Stops taking jobs, drops those not started and joins the threads.
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  void submit(std::function<void()> job);
  /// Drops queued jobs and joins the threads (idempotent); running jobs finish first.
  void stop();

private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
  std::function<void(const std::string&)> on_error_;
};

}  // namespace xdfs::pathm
