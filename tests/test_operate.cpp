// xdfsd as operators run it (real processes): --version, the config file and --check-config,
// SIGHUP reloads, readiness told to systemd, the metrics endpoint, JSON log lines.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <regex>
#include <string>
#include <thread>

#include "support.hpp"
#include "xdfs/wire.hpp"

TEST_SUITE_BEGIN("operate");

namespace {

std::string url(const xt::XdfsdProcess& d, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(d.port()) + "/" + path;
}

xt::RunResult xdfsd(const std::vector<std::string>& args) { return xt::run(XDFSD_PATH, args, 30000); }

// One line on stderr, nothing else.
bool one_line(const std::string& err) { return !err.empty() && err.find('\n') == err.size() - 1; }

// GET path from 127.0.0.1:port over plain HTTP/1.1: the status line's code and the body.
std::pair<int, std::string> http_get(std::uint16_t port, const std::string& path, const std::string& method = "GET") {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  const std::string req = method + " " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  REQUIRE(::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));
  std::string resp;
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10000) <= 0) break;
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    resp.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  std::smatch m;
  if (!std::regex_search(resp, m, std::regex("^HTTP/1\\.[01] ([0-9]{3})"))) return {0, resp};
  const auto body = resp.find("\r\n\r\n");
  return {std::stoi(m[1]), body == std::string::npos ? std::string() : resp.substr(body + 4)};
}

// A counter's or gauge's value in an exposition (-1 if absent).
double sample(const std::string& text, const std::string& name) {
  const auto at = text.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size() + 2));
}

std::uint16_t metrics_port(xt::XdfsdProcess& d) {
  REQUIRE(d.wait_for_log("metrics at http://127.0.0.1:"));
  std::smatch m;
  const std::string log = d.log();
  REQUIRE(std::regex_search(log, m, std::regex("metrics at http://127\\.0\\.0\\.1:([0-9]+)/metrics")));
  return static_cast<std::uint16_t>(std::stoi(m[1]));
}

}  // namespace

TEST_CASE("xdfsd --version names the release and the protocol; --help exits 0") {
  auto v = xdfsd({"--version"});
  CHECK(v.status == 0);
  CHECK(std::regex_match(v.out, std::regex("xdfsd [0-9]+\\.[0-9]+\\.[0-9]+ \\(xDFS protocol " +
                                           std::to_string(xdfs::protocol_version) + "\\)\n")));
  auto h = xdfsd({"--help"});
  CHECK(h.status == 0);
  for (const char* opt : {"--config", "--check-config", "--metrics", "--log-format", "--max-sessions", "--no-zero-copy"})
    CHECK_MESSAGE(h.out.find(opt) != std::string::npos, opt);
}

TEST_CASE("xdfsd --check-config: a valid file passes; a bad value, an unknown key, bad TOML and a missing root each fail in one line") {
  xt::TempDir dir;
  xt::write_file(dir / "good.toml",
                 "# a comment\nroot = \"" + dir.path() + "\"\nmax-sessions = 8\nidle-timeout = 30\n"
                 "disable-mode = [\"relay\", \"path\"]\nfsync = true\nno-zero-copy = true\nmax-rate = \"100M\"\n");
  auto ok = xdfsd({"--config", dir / "good.toml", "--check-config"});
  CHECK_MESSAGE(ok.status == 0, ok.err);
  CHECK(ok.out.find("valid") != std::string::npos);

  struct Bad {
    std::string file, expect;
  };
  for (const Bad& b : {
           Bad{"max-sessions = 0\n", "--max-sessions takes a number from 1 to 100000"},
           Bad{"max-sesions = 8\n", "line 2: 'max-sesions' is not a setting of xdfsd"},
           Bad{"max-sessions = \n", "line 2"},
           Bad{"max-sessions = 1.5\n", "'max-sessions' takes a string, a whole number or true/false"},
           Bad{"listen = [\"a\", \"b\"]\n", "'listen' takes one value, not an array"},
           Bad{"config = \"/etc/x\"\n", "'config' goes on the command line only"},
           Bad{"disable-mode = [\"uplaod\"]\n", "--disable-mode takes upload, download, path, relay or pull"},
           Bad{"log-format = \"xml\"\n", "--log-format"},
           Bad{"max-rate = \"1K\"\n", "--max-rate of 1024 bytes per second takes more than 15 s per block"},
           Bad{"pull-pack-size = \"129M\"\n", "--pull-pack-size takes a size from 64K to 128M"},
           Bad{"pull-pack-size = \"32K\"\n", "--pull-pack-size takes a size from 64K to 128M"},
           Bad{"loopback-sendfile = \"maybe\"\n", "--loopback-sendfile = maybe"},
       }) {
    CAPTURE(b.file);
    xt::write_file(dir / "bad.toml", "root = \"" + dir.path() + "\"\n" + b.file);
    auto r = xdfsd({"--config", dir / "bad.toml", "--check-config"});
    CHECK(r.status == 2);
    CHECK(one_line(r.err));
    CHECK_MESSAGE(r.err.find(b.expect) != std::string::npos, r.err);
  }
  // The file's root is not there.
  xt::write_file(dir / "noroot.toml", "root = \"" + dir.path() + "/missing\"\n");
  auto r = xdfsd({"--config", dir / "noroot.toml", "--check-config"});
  CHECK(r.status == 2);
  CHECK(one_line(r.err));
  CHECK(r.err.find("missing': No such file or directory") != std::string::npos);
  // A file that is not there, and a bad value on the command line.
  r = xdfsd({"--config", dir / "nope.toml", "--check-config"});
  CHECK(r.status == 2);
  CHECK(r.err.find("nope.toml") != std::string::npos);
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);  // would hang a reader
  r = xdfsd({"--config", dir / "fifo", "--check-config"});
  CHECK(r.status == 2);
  CHECK(one_line(r.err));
  CHECK(r.err.find("is not a regular file") != std::string::npos);
  r = xdfsd({"--root", dir.path(), "--max-channels", "x"});
  CHECK(r.status == 2);
  CHECK(one_line(r.err));
  CHECK(r.err.find("--max-channels takes a number") != std::string::npos);
  // Given twice, an option takes its last value (scripts add to command lines); --disable-mode
  // adds up.
  r = xdfsd({"--root", "/nonexistent", "--root", dir.path(), "--max-sessions", "0", "--max-sessions", "3",
             "--disable-mode", "relay", "--disable-mode", "path", "--check-config"});
  CHECK_MESSAGE(r.status == 0, r.err);
    r = xdfsd({"--root", dir.path(), "--no-such-option"});
  CHECK(r.status == 2);
  CHECK(one_line(r.err));
  CHECK(r.err.find("--no-such-option") != std::string::npos);
}

TEST_CASE("xdfsd --config: the file's settings apply and the command line overrides them") {
  xt::TempDir root, local, dir;
  xt::write_random_file(local / "f", 300000, 3);
  xt::write_random_file(root / "g", 200000, 4);
  // Uploads off, blocks of at most 64K; the command line raises the block limit.
  xt::write_file(dir / "x.toml", "root = \"/nonexistent\"\nmax-block-size = \"64K\"\ndisable-mode = [\"upload\"]\n");
  {
    xt::XdfsdProcess d(root.path(), {"--config", dir / "x.toml"});
    auto up = xt::xduc({"-q", "--block-size", "64K", local / "f", url(d, "f")});
    CHECK(up.status != 0);
    CHECK(up.err.find("disabled") != std::string::npos);
    auto big = xt::xduc({"-q", "--block-size", "1M", url(d, "g"), local / "g1"});
    CHECK(big.status != 0);
    CHECK(big.err.find("block size") != std::string::npos);
    auto down = xt::xduc({"-q", "--block-size", "64K", url(d, "g"), local / "g2"});
    CHECK_MESSAGE(down.status == 0, down.err);
    CHECK(xt::files_equal(root / "g", local / "g2"));
  }
  // The command line raises the block limit; its --disable-mode adds to the file's list, never
  // turns back on what the file disabled.
  xt::XdfsdProcess d(root.path(), {"--config", dir / "x.toml", "--max-block-size", "1M", "--disable-mode", "path"});
  auto big = xt::xduc({"-q", "--block-size", "1M", url(d, "g"), local / "g3"});
  CHECK_MESSAGE(big.status == 0, big.err);
  auto up = xt::xduc({"-q", local / "f", url(d, "f")});
  CHECK(up.status != 0);
  CHECK(up.err.find("disabled") != std::string::npos);
  auto ls = xt::xduc({"ls", url(d, "")});
  CHECK(ls.status != 0);
  CHECK(ls.err.find("disabled") != std::string::npos);
}

TEST_CASE("SIGHUP reloads the config file: limits change for new sessions, a broken file keeps the running settings") {
  xt::TempDir root, local, dir;
  xt::write_random_file(root / "g", 500000, 5);
  xt::write_file(dir / "x.toml", "max-channels = 2\n");
  xt::XdfsdProcess d(root.path(), {"--config", dir / "x.toml"});
  auto four = [&](const std::string& name) { return xt::xduc({"-q", "-p", "4", url(d, "g"), local / name}); };
  auto r = four("a");
  CHECK(r.status != 0);
  CHECK(r.err.find("channels") != std::string::npos);

  xt::write_file(dir / "x.toml", "max-channels = 8\nlisten = \"127.0.0.1:1\"\n");
  REQUIRE(::kill(d.pid(), SIGHUP) == 0);
  REQUIRE(d.wait_for_log("SIGHUP: reloaded: max-channels 2 -> 8"));
  // The command line's --listen still wins over the file's, and nothing that needs a restart
  // changes: the server says so only for what differs.
  CHECK(d.log().find("need a restart: listen") == std::string::npos);
  r = four("b");
  CHECK_MESSAGE(r.status == 0, r.err);
  CHECK(xt::files_equal(root / "g", local / "b"));

  xt::write_file(dir / "x.toml", "max-channels = 2\nmemory-limit = \"64M\"\n");
  REQUIRE(::kill(d.pid(), SIGHUP) == 0);
  REQUIRE(d.wait_for_log("not applied, these need a restart: memory-limit"));
  CHECK(d.log().find("max-channels 8 -> 2") != std::string::npos);

  // Keys a client could reach (inside the root) are refused at a reload as at a start: nothing
  // of that reload applies.
  xt::write_file(dir / "x.toml", "max-channels = 8\nauthorized-keys = \"" + root.path() + "/keys\"\n");
  REQUIRE(::kill(d.pid(), SIGHUP) == 0);
  REQUIRE(d.wait_for_log("lies inside the served root"));
  const std::string log = d.log();
  CHECK(log.find("max-channels 2 -> 8") == log.rfind("max-channels 2 -> 8"));  // only the first reload's

  xt::write_file(dir / "x.toml", "max-channels = [\n");
  REQUIRE(::kill(d.pid(), SIGHUP) == 0);
  REQUIRE(d.wait_for_log("SIGHUP: reload failed, the running settings stay"));
  r = xt::xduc({"-q", "-p", "2", url(d, "g"), local / "c"});
  CHECK_MESSAGE(r.status == 0, r.err);
  CHECK(four("d").status != 0);  // still 2
  CHECK(d.stop(SIGTERM) == 0);
}

TEST_CASE("xdfsd tells systemd it is ready, reloading and stopping (sd_notify on $NOTIFY_SOCKET)") {
  xt::TempDir root, dir;
  const std::string sock = dir / "notify";
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  REQUIRE(sock.size() < sizeof sa.sun_path);
  std::copy(sock.begin(), sock.end(), sa.sun_path);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  auto next = [fd] {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10000) <= 0) return std::string("(nothing)");
    char buf[512];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("(error)");
  };
  xt::write_file(dir / "x.toml", "max-sessions = 4\n");
  ::setenv("NOTIFY_SOCKET", sock.c_str(), 1);
  std::optional<xt::XdfsdProcess> d;
  d.emplace(root.path(), std::vector<std::string>{"--config", dir / "x.toml"});
  ::unsetenv("NOTIFY_SOCKET");
  CHECK(next() == "READY=1");
  REQUIRE(::kill(d->pid(), SIGHUP) == 0);
  CHECK(next().rfind("RELOADING=1\nMONOTONIC_USEC=", 0) == 0);
  CHECK(next() == "READY=1");
  CHECK(d->stop(SIGTERM) == 0);
  CHECK(next() == "STOPPING=1");
  ::close(fd);
}

TEST_CASE("xdfsd --metrics serves Prometheus text whose counters move with sessions, refusals and path operations") {
  xt::TempDir root, local;
  xt::write_random_file(local / "f", 1000000, 6);
  xt::XdfsdProcess d(root.path(), {"--metrics", "127.0.0.1:0"});
  const auto port = metrics_port(d);
  auto [code, before] = http_get(port, "/metrics");
  REQUIRE(code == 200);
  CHECK(before.find("# TYPE xdfs_sessions_started_total counter") != std::string::npos);
  CHECK(sample(before, "xdfs_sessions_active") == 0);
  CHECK(sample(before, "xdfs_memory_budget_bytes{state=\"limit\"}") > 0);

  REQUIRE(xt::xduc({"-q", "-p", "2", local / "f", url(d, "f")}).status == 0);
  REQUIRE(xt::xduc({"-q", url(d, "f"), local / "back"}).status == 0);
  REQUIRE(xt::xduc({"ls", url(d, "")}).status == 0);
  CHECK(xt::xduc({"-q", url(d, "missing"), local / "m"}).status != 0);
  // In one session: a file, then one that is not there (an operation refused inside the session).
  xt::TempDir two;
  CHECK(xt::xduc({"-q", url(d, "f"), url(d, "missing"), two.path()}).status != 0);
  // Not a client at all: refused at its opening.
  {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(d.port());
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
    const std::string junk(64, 'x');
    (void)::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    char b[256];
    pollfd p{fd, POLLIN, 0};
    while (::poll(&p, 1, 5000) > 0 && ::read(fd, b, sizeof b) > 0) {
    }
    ::close(fd);
  }
  // The end lines are logged as the sessions' threads finish: wait for the last.
  std::string after;
  for (int i = 0; i < 100; ++i) {
    after = http_get(port, "/metrics").second;
    if (sample(after, "xdfs_sessions_ended_total{mode=\"path\",outcome=\"ok\"}") >= 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK(sample(after, "xdfs_sessions_started_total{mode=\"upload\"}") == 1);
  CHECK(sample(after, "xdfs_sessions_ended_total{mode=\"upload\",outcome=\"ok\"}") == 1);
  CHECK(sample(after, "xdfs_sessions_ended_total{mode=\"download\",outcome=\"ok\"}") == 1);
  // The missing file: alone, the session's first operation; then refused inside a session.
  CHECK(sample(after, "xdfs_sessions_started_total{mode=\"download\"}") == 3);
  CHECK(sample(after, "xdfs_operations_total{mode=\"download\",outcome=\"no_such_file\"}") == 2);
  CHECK(sample(after, "xdfs_operations_total{mode=\"download\",outcome=\"ok\"}") == 2);
  CHECK(sample(after, "xdfs_errors_total{class=\"give_up\"}") == 2);
  CHECK(sample(after, "xdfs_transfer_bytes_total{mode=\"upload\",direction=\"in\"}") == 1000000);
  CHECK(sample(after, "xdfs_transfer_bytes_total{mode=\"download\",direction=\"out\"}") == 2000000);
  CHECK(sample(after, "xdfs_path_operations_total{op=\"stat\"}") >= 1);
  CHECK(sample(after, "xdfs_rejected_connections_total{cause=\"protocol_error\"}") == 1);
    CHECK(sample(after, "xdfs_uptime_seconds") > 0);

  // Only GET /metrics: the rest is refused, and a request too large for the endpoint is dropped
  // without harm to the next scrape.
  CHECK(http_get(port, "/other").first == 404);
  CHECK(http_get(port, "/metrics", "DELETE").first == 405);
  CHECK(http_get(port, "/metrics?" + std::string(20000, 'a')).first != 200);
  CHECK(http_get(port, "/metrics").first == 200);
  CHECK(d.stop(SIGTERM) == 0);
}

TEST_CASE("xdfsd --log-format json writes one JSON object a line, escaped") {
  xt::TempDir root, local;
  xt::write_random_file(local / "f", 1000, 7);
  xt::XdfsdProcess d(root.path(), {"--log-format", "json"});
  // A name with a quote, a backslash and an escape character: it reaches the log escaped.
  const std::string odd = "a\"b\\c\x1b[31md";
  xt::write_random_file(local / odd, 1000, 8);
  REQUIRE(xt::xduc({"-q", local / odd, url(d, "x")}).status == 0);
  CHECK(xt::xduc({"-q", url(d, "no\"such\x1b"), local / "m"}).status != 0);
  REQUIRE(d.wait_for_log("no such file"));
  d.stop(SIGTERM);
  const std::string log = d.log();
  std::size_t lines = 0;
  const std::regex object(R"(\{"time":"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z","program":"xdfsd","message":"([^"\\\x00-\x1f]|\\["\\u]|\\u[0-9a-f]{4})*"\})");
  for (std::size_t at = 0, nl; (nl = log.find('\n', at)) != std::string::npos; at = nl + 1) {
    const std::string line = log.substr(at, nl - at);
    CHECK_MESSAGE(std::regex_match(line, object), line);
    ++lines;
  }
  CHECK(lines >= 4);
  CHECK(log.find('\x1b') == std::string::npos);
}

TEST_SUITE_END();
