#include "xdfs/metrics.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cassert>

namespace xdfs {

const std::vector<Metrics::Family>& Metrics::families() {
  static const std::vector<Family> all{
      {"xdfs_sessions_started_total", "counter", "Sessions admitted, by the mode of their first operation."},
      {"xdfs_sessions_ended_total", "counter", "Sessions ended, by mode and outcome (ok or the error code)."},
      {"xdfs_operations_total", "counter", "Operations of sessions ended, by mode and outcome."},
      {"xdfs_transfer_bytes_total", "counter",
       "Bytes moved by ended operations, by mode and direction (in: to this server, out: from it)."},
      {"xdfs_errors_total", "counter",
       "Failed or refused operations by error class (what a client should do: retry, reconnect, give_up)."},
      {"xdfs_rejected_connections_total", "counter",
       "Connections refused before a session took them, by cause (the error sent, or evicted_pending)."},
      {"xdfs_path_operations_total", "counter", "Path-mode requests received, by kind."},
      {"xdfs_reloads_total", "counter", "Configuration reloads (SIGHUP), by result."},
      {"xdfs_sessions_active", "gauge", "Sessions running now."},
      {"xdfs_channels_active", "gauge", "Channels of the running sessions."},
      {"xdfs_connections_pending", "gauge", "Connections not authenticated yet."},
      {"xdfs_memory_budget_bytes", "gauge", "The sessions' memory budget: its limit and what is in use."},
      {"xdfs_uptime_seconds", "gauge", "Seconds since the server started."},
  };
  return all;
}

std::string Metrics::key(const Labels& labels) {
  std::string k;
  for (const auto& [name, value] : labels) {
    if (!k.empty()) k += ',';
    k += name;
    k += "=\"";
    // The code's own words ("no such file", "give-up") as identifiers: no_such_file, give_up.
    for (char c : value) k += (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ? c : (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : '_';
    k += '"';
  }
  return k;
}

void Metrics::add(std::string_view family, const Labels& labels, std::uint64_t n) noexcept {
  const auto& f = families();
  assert(std::any_of(f.begin(), f.end(), [&](const Family& x) { return x.name == family && x.type == "counter"; }));
  (void)f;
  try {
    const std::string k = key(labels);
    std::lock_guard lk(mu_);
    auto it = counters_.find(family);
    if (it == counters_.end()) it = counters_.emplace(std::string(family), std::map<std::string, std::uint64_t>{}).first;
    it->second[k] += n;
  } catch (...) {
  }
}

std::uint64_t Metrics::value(std::string_view family, const Labels& labels) const {
  std::lock_guard lk(mu_);
  auto it = counters_.find(family);
  if (it == counters_.end()) return 0;
  auto v = it->second.find(key(labels));
  return v == it->second.end() ? 0 : v->second;
}

std::string Metrics::render(const std::vector<Gauge>& gauges) const {
  std::string out;
  std::lock_guard lk(mu_);
  for (const auto& f : families()) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", f.name, f.help, f.name, f.type);
    if (f.type == "counter") {
      auto it = counters_.find(f.name);
      if (it == counters_.end() || it->second.empty()) continue;
      for (const auto& [labels, n] : it->second) out += fmt::format("{}{{{}}} {}\n", f.name, labels, n);
      continue;
    }
    for (const auto& g : gauges)
      if (g.family == f.name)
        out += g.labels.empty() ? fmt::format("{} {}\n", f.name, g.value)
                                : fmt::format("{}{{{}}} {}\n", f.name, key(g.labels), g.value);
  }
  return out;
}

}  // namespace xdfs
