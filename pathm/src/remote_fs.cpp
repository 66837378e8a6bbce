#include "xdfs/remote_fs.hpp"

#include <condition_variable>
#include <mutex>
#include <thread>

namespace xdfs {

struct RemoteFs::Impl {
  std::unique_ptr<Session> own;
  Session* session = nullptr;
  std::unique_ptr<pathm::PathClient> client;
  // Keep-alives between calls.
  std::thread keeper;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;

  void start() {
    wire::Negotiation n;
    n.mode = Mode::path;
    n.remote_path = ".";
    const auto reply = session->begin(n);
    const auto& opt = session->options();
    try {
      client = std::make_unique<pathm::PathClient>(session->io(), session->channels(), reply.block_size, opt.cancel,
                                               opt.idle_timeout);
      if (opt.keep_alive.count() > 0) start_keeper(opt.keep_alive);
    } catch (...) {
      // The session closes its channels while the client (whose reads they hold) still exists.
      session->end_operation(false);
      client.reset();
      throw;
    }
  }

  void start_keeper(std::chrono::milliseconds every) {
    {
      keeper = std::thread([this, every] {
        std::unique_lock lk(mu);
        while (!cv.wait_for(lk, every, [this] { return stopping; })) {
          lk.unlock();
          client->keep_alive();
          lk.lock();
        }
      });
    }
  }

  void stop_keeper() {
    {
      std::lock_guard lk(mu);
      stopping = true;
    }
    cv.notify_all();
    if (keeper.joinable()) keeper.join();
  }
};

RemoteFs::RemoteFs(const Endpoint& server, const SessionOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->own = std::make_unique<Session>(server, options);
  impl_->session = impl_->own.get();
  impl_->start();
}

RemoteFs::RemoteFs(Session& session) : impl_(std::make_unique<Impl>()) {
  impl_->session = &session;
  impl_->start();
}

RemoteFs::~RemoteFs() {
  try {
    close();
  } catch (...) {
  }
}

pathm::PathClient* RemoteFs::operator->() { return impl_->client.get(); }
pathm::PathClient& RemoteFs::client() { return *impl_->client; }

void RemoteFs::close() {
  if (!impl_->client) return;
  impl_->stop_keeper();
  bool ok = false;
  try {
    ok = impl_->client->close();
  } catch (...) {
    // A handler threw while the operation ended: the session is over (below).
  }
  // The session takes its channels back (or closes them) while the client still exists: what
  // the loop still holds for it runs first.
  impl_->session->end_operation(ok);
  impl_->client.reset();
  if (impl_->own) impl_->own->close();
}

}  // namespace xdfs
