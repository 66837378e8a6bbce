// A server's counters for monitoring, rendered in Prometheus' text exposition format.
//
// Counters only grow; each has a family name and a set of label values fixed by the code
// (a mode, an error code, a path operation: never a string a peer chose, so a peer can neither
// inject into the exposition nor grow the set without bound). Label values are written as
// identifiers: lower case, anything but letters and digits as '_' ("no such file": no_such_file). Thread-safe: the listener, the
// session threads and path-mode workers count into one instance; a scrape takes a snapshot.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace xdfs {

class Metrics {
public:
  using Labels = std::vector<std::pair<std::string_view, std::string_view>>;

  /// Adds n to the counter `family{labels}` (family: one of families()). Never throws: a count
  /// that cannot be kept (no memory) is lost, never a thread.
  void add(std::string_view family, const Labels& labels, std::uint64_t n = 1) noexcept;
  /// The counter's value now (0 if never counted).
  std::uint64_t value(std::string_view family, const Labels& labels) const;

  /// A gauge's sample for render(): a value the caller reads at scrape time.
  struct Gauge {
    std::string_view family;
    Labels labels;
    double value = 0;
  };
  /// Every counter and the given gauges in the text format (version 0.0.4): # HELP and # TYPE
  /// for each family (a scraper sees them all from the start), then its samples.
  std::string render(const std::vector<Gauge>& gauges) const;

  struct Family {
    std::string_view name;
    std::string_view type;  // "counter" or "gauge"
    std::string_view help;
  };
  static const std::vector<Family>& families();

private:
  static std::string key(const Labels& labels);
  mutable std::mutex mu_;
  std::map<std::string, std::map<std::string, std::uint64_t>, std::less<>> counters_;  // family -> labels -> n
};

}  // namespace xdfs
