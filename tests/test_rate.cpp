// Rate limits (framework/include/xdfs/rate.hpp): the limiter's arithmetic on a clock the test
// drives, then xduc --limit-rate and xdfsd --max-rate / --max-total-rate on real transfers.
//
// Real transfers are only checked for not going faster than the limit (plus 5%): a busy machine
// can always make them slower. How close they come to it is measured in perf/rate.py.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"
#include "xdfs/rate.hpp"
#include "xdfs/xdfs.hpp"

using namespace std::chrono_literals;
using Clock = xdfs::RateLimiter::Clock;

namespace {

std::string url(std::uint16_t port, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(port) + "/" + path;
}

// bytes / seconds of an xduc --json summary.
double rate_of(const xt::RunResult& r) {
  const auto b = r.out.find("\"bytes\":");
  const auto s = r.out.find("\"seconds\":");
  REQUIRE_MESSAGE((b != std::string::npos && s != std::string::npos), r.out << r.err);
  return std::stod(r.out.substr(b + 8)) / std::stod(r.out.substr(s + 10));
}

}  // namespace

TEST_SUITE("wire") {

TEST_CASE("a rate limiter spaces reservations by their size over the rate, lets a burst through, and never banks idle time") {
  const auto t0 = Clock::time_point(100s);
  xdfs::RateLimiter r(1000, 0ns);  // 1000 bytes per second, no burst
  CHECK(r.take(500, t0) == 500ms);    // paid when its reservation ends
  CHECK(r.take(500, t0) == 1000ms);
  CHECK(r.take(1000, t0 + 1s) == 1000ms);
  // Ten idle seconds later: no credit piled up, the next 500 bytes wait their own time.
  CHECK(r.take(500, t0 + 12s) == 500ms);

  xdfs::RateLimiter b(1000, 200ms);  // a burst of 200 bytes' worth
  CHECK(b.take(100, t0) == Clock::duration::zero());
  CHECK(b.take(100, t0) == Clock::duration::zero());
  CHECK(b.take(100, t0) == 100ms);

  xdfs::RateLimiter none;
  CHECK_FALSE(none.limited());
  CHECK(none.take(std::uint64_t(1) << 40, t0) == Clock::duration::zero());
  // Sizes far beyond a block do not overflow.
  xdfs::RateLimiter slow(1);
  CHECK(slow.take(std::uint64_t(1) << 40, t0) > Clock::duration::zero());
}

TEST_CASE("a rate limiter shared by threads hands out exactly rate bytes per second in total") {
  const auto t0 = Clock::time_point(1000s);
  xdfs::RateLimiter r(1 << 20, 0ns);
  std::atomic<Clock::duration> last{Clock::duration::zero()};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 256; ++i) {
        const auto w = r.take(4096, t0);
        auto seen = last.load();
        while (w > seen && !last.compare_exchange_weak(seen, w)) {
        }
      }
    });
  for (auto& t : ts) t.join();
  // 4 x 256 x 4 KiB = 4 MiB at 1 MiB/s: the last reservation ends 4 s on, none later.
  CHECK(last.load() == 4s);
}

}  // TEST_SUITE("wire")

TEST_SUITE("process") {

TEST_CASE("rate limits: xduc --limit-rate and xdfsd --max-rate and --max-total-rate are never exceeded; bad values exit 2") {
  xt::TempDir root, local;
  const std::uint64_t mib = 1 << 20;
  xt::write_random_file(local / "f", 6 * mib, 3);
  for (const char* bad : {"0", "garbage", "100X", "1023"}) {
    auto r = xt::xduc({"--limit-rate", bad, local / "f", "xdfs://127.0.0.1:1/f"});
    CHECK(r.status == 2);
    CHECK(r.err.find("--limit-rate") != std::string::npos);
    auto s = xt::run(XDFSD_PATH, {"--root", "/tmp", "--max-total-rate", bad});
    CHECK(s.status == 2);
    CHECK(s.err.find("--max-total-rate") != std::string::npos);
  }
  // A rate at which one block would take longer than 15 s: the idle timeouts would end it.
  auto slow = xt::xduc({"--limit-rate", "64K", local / "f", "xdfs://127.0.0.1:1/f"});
  CHECK(slow.status == 2);
  CHECK(slow.err.find("--limit-rate of 65536 bytes per second takes more than 15 s per block") != std::string::npos);
  auto slow_server = xt::run(XDFSD_PATH, {"--root", "/tmp", "--max-rate", "1M"});
  CHECK(slow_server.status == 2);
  CHECK(slow_server.err.find("--max-rate of 1048576 bytes per second takes more than 15 s per block") != std::string::npos);
  {
    xt::XdfsdProcess d(root.path());
    auto up = xt::xduc({"-q", "--json", "-p", "3", "--limit-rate", "2M", local / "f", url(d.port(), "up")});
    REQUIRE_MESSAGE(up.status == 0, up.err);
    CHECK(rate_of(up) <= 1.05 * 2 * mib);
    auto down = xt::xduc({"-q", "--json", "-p", "2", "--limit-rate", "2M", url(d.port(), "up"), local / "back"});
    REQUIRE_MESSAGE(down.status == 0, down.err);
    CHECK(rate_of(down) <= 1.05 * 2 * mib);
    CHECK(xt::files_equal(local / "f", local / "back"));
  }
  {
    // Per session on the server, both ways.
    xt::XdfsdProcess d(root.path(), {"--max-rate", "2M"});
    auto up = xt::xduc({"-q", "--json", "-p", "4", local / "f", url(d.port(), "up2")});
    REQUIRE_MESSAGE(up.status == 0, up.err);
    CHECK(rate_of(up) <= 1.05 * 2 * mib);
    auto down = xt::xduc({"-q", "--json", "-p", "4", url(d.port(), "up2"), "/dev/null"});
    REQUIRE_MESSAGE(down.status == 0, down.err);
    CHECK(rate_of(down) <= 1.05 * 2 * mib);
  }
  {
    // Server-wide: two sessions at once share it.
    xt::XdfsdProcess d(root.path(), {"--max-total-rate", "4M"});
    const auto t0 = std::chrono::steady_clock::now();
    xt::RunResult a, b;
    std::thread other([&] { b = xt::xduc({"-q", "--json", "-p", "2", local / "f", url(d.port(), "b")}); });
    a = xt::xduc({"-q", "--json", "-p", "2", local / "f", url(d.port(), "a")});
    other.join();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    REQUIRE_MESSAGE(a.status == 0, a.err);
    REQUIRE_MESSAGE(b.status == 0, b.err);
    CHECK(12.0 * mib / secs <= 1.05 * 4 * mib);
    CHECK(xt::files_equal(local / "f", root / "a"));
    CHECK(xt::files_equal(local / "f", root / "b"));
  }
}

}  // TEST_SUITE("process")
