// xdfsd --metrics HOST:PORT: the server's counters over HTTP for Prometheus to scrape.
#pragma once

#include <functional>
#include <memory>
#include <string>

namespace xdfs::cli {

/// Serves GET /metrics (the text `render` returns at that moment) on its own thread with its own
/// event loop, until destroyed. Anything else gets 404 or 405. Its costs are bounded whatever a
/// client sends: 16 connections at once (more wait in the kernel's backlog), a request of at most
/// 8 KiB without a body, 5 s to send it, one request per connection.
class MetricsEndpoint {
public:
  /// Binds HOST:PORT (port 0: a free one); throws xdfs::Error (bad_argument) if it cannot.
  MetricsEndpoint(const std::string& host_port, std::function<std::string()> render);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;
  /// HOST:PORT as bound.
  std::string where() const;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace xdfs::cli
