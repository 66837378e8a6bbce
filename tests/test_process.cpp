// xdfsd and xduc as real processes: the user's view, exit codes, one-line errors, --json,
// and a clean stop on SIGTERM that leaves no half-written file under a final name.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>
#include <string>

#include "support.hpp"
#include "xdfs/xdfs.hpp"
// xduc's URL parser, tested directly (examples/cli.cpp is built into the tests too).
#include "cli.hpp"

using xdfs::Mode;
using xdfs::wire::ChannelEvent;

namespace {

std::string url(const xt::XdfsdProcess& d, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(d.port()) + "/" + path;
}

bool one_line(const std::string& s) { return !s.empty() && s.find('\n') == s.size() - 1; }

// One "xduc: bad argument: ..." line naming `what`, and exit status 2.
bool bad_argument(const xt::RunResult& r, const std::string& what) {
  return r.status == 2 && one_line(r.err) && r.err.rfind("xduc: bad argument: ", 0) == 0 &&
         r.err.find(what) != std::string::npos;
}

// --progress json: the objects among the lines of standard error, each checked whole.
struct ProgressLine {
  std::uint64_t files, files_total, bytes, bytes_total;
  bool totals_final, final;
};
std::vector<ProgressLine> progress_lines(const std::string& err) {
  static const std::regex form(
      R"(\{"files":(\d+),"files_total":(\d+),"bytes":(\d+),"bytes_total":(\d+),"totals_final":(true|false),)"
      R"("bytes_per_second":\d+,"eta_seconds":(\d+|null),"seconds":\d+\.\d{3},"final":(true|false)\})");
  std::vector<ProgressLine> v;
  std::istringstream in(err);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] != '{') continue;
    std::smatch m;
    REQUIRE_MESSAGE(std::regex_match(line, m, form), line);
    v.push_back({std::stoull(m[1]), std::stoull(m[2]), std::stoull(m[3]), std::stoull(m[4]), m[5] == "true",
                 m[7] == "true"});
  }
  return v;
}

bool ipv6_loopback() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

TEST_SUITE("process") {

TEST_CASE("xduc uploads and downloads through xdfsd with -p 4, --json and a session log") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  xt::write_random_file(local / "data", (5 << 20) + 123, 11);
  // A known-hosts file of its own: an earlier test's server on the same port (they all have
  // the suite's key) would have pinned this one already, and the notice below not be given.
  auto up = xt::xduc({"-p", "4", "--block-size", "256K", "--json", "--known-hosts", local / "known_hosts", local / "data",
                      url(d, "data")});
  REQUIRE_MESSAGE(up.status == 0, up.err);
  CHECK(xt::files_equal(local / "data", root / "data"));
  CHECK(up.out.find("\"bytes\":5243003") != std::string::npos);
  CHECK(up.out.find("\"channels\":4") != std::string::npos);
  CHECK(up.out.find("\"direction\":\"upload\"") != std::string::npos);
  // The set-up (all channels secured and accepted) is a part of the whole session time.
  std::smatch m;
  REQUIRE(std::regex_search(up.out, m, std::regex("\"seconds\":([0-9.]+),.*\"setup_seconds\":([0-9.]+)")));
  CHECK(std::stod(m[2]) > 0);
  CHECK(std::stod(m[2]) <= std::stod(m[1]));
  CHECK(up.err.find('\r') == std::string::npos);  // not a terminal: no progress line
  CHECK(up.err.find("pinned") != std::string::npos);  // first contact: the server key is pinned, with a notice

  auto down = xt::xduc({"-q", "-p", "4", "--tcp-window", "1M", url(d, "data"), local / "back"});
  REQUIRE_MESSAGE(down.status == 0, down.err);
  CHECK(xt::files_equal(local / "data", local / "back"));

  auto to_stdout = xt::xduc({"-q", url(d, "data"), "-"});
  REQUIRE(to_stdout.status == 0);
  CHECK(to_stdout.out == xt::read_file(local / "data"));

  CHECK(d.wait_for_log("mode=upload path=data channels=4 bytes=5243003"));
  CHECK(d.wait_for_log("mode=download path=data channels=4 bytes=5243003"));
  CHECK(d.log().find("status=ok") != std::string::npos);
}

TEST_CASE("xduc -p 8 moves a 1 GiB random file up and down byte-identically") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  xt::write_random_file(local / "gig", 1ull << 30, 1234);
  auto up = xt::xduc({"-q", "-p", "8", local / "gig", url(d, "gig")});
  REQUIRE_MESSAGE(up.status == 0, up.err);
  CHECK(xt::files_equal(local / "gig", root / "gig"));
  ::unlink((root / "gig.back").c_str());
  auto down = xt::xduc({"-q", "-p", "8", url(d, "gig"), local / "gig.back"});
  REQUIRE_MESSAGE(down.status == 0, down.err);
  CHECK(xt::files_equal(local / "gig", local / "gig.back"));
}

TEST_CASE("--block-workers: digests, seals and opening spread over that many helpers on each side, byte-exact; out of range refused") {
  xt::TempDir root, local;
  xt::write_random_file(local / "data", (3 << 20) + 4321, 17);
  for (const char* workers : {"0", "1", "3"}) {
    CAPTURE(workers);
    xt::XdfsdProcess d(root.path(), {"--block-workers", workers, "--debug"});
    const std::string w = workers;
    const std::string lanes = w == "0"   ? "block work on the disk thread alone"
                              : w == "1" ? "block work on 2 lanes (the disk thread and 1 helper)"
                                         : "block work on 4 lanes (the disk thread and 3 helpers)";
    for (const char* protect : {"private", "integrity", "clear"}) {
      CAPTURE(protect);
      ::unlink((root / "data").c_str());
      ::unlink((local / "back").c_str());
      // 64 KiB blocks: a group of many blocks for the lanes to share.
      auto up = xt::xduc({"-q", "-p", "2", "--block-size", "64K", "--protect", protect, "--block-workers", workers,
                          "--debug", local / "data", url(d, "data")});
      REQUIRE_MESSAGE(up.status == 0, up.err);
      CHECK(xt::files_equal(local / "data", root / "data"));
      CHECK(up.err.find(lanes + ": digests") != std::string::npos);
      auto down = xt::xduc({"-q", "-p", "2", "--block-size", "64K", "--protect", protect, "--block-workers", workers,
                            "--debug", url(d, "data"), local / "back"});
      REQUIRE_MESSAGE(down.status == 0, down.err);
      CHECK(xt::files_equal(local / "data", local / "back"));
      CHECK(down.err.find(lanes) != std::string::npos);
    }
    CHECK(d.wait_for_log(lanes + ": opening and digest checks"));
    CHECK(d.wait_for_log(lanes + ": digests and seals"));
  }
  auto one_line = [](const xt::RunResult& r, const std::string& text) {
    return r.status == 2 && std::count(r.err.begin(), r.err.end(), '\n') == 1 && r.err.find(text) != std::string::npos;
  };
  CHECK(one_line(xt::run(XDFSD_PATH, {"--root", root.path(), "--block-workers", "8"}), "--block-workers"));
  CHECK(one_line(xt::xduc({"--block-workers", "many", local / "data", "xdfs://127.0.0.1:1/x"}), "--block-workers"));
}

TEST_CASE("xduc --debug and xdfsd --debug say whether blocks go by sendfile: to a peer on this host only with --loopback-sendfile; --no-zero-copy on either side turns it off") {
  xt::TempDir root, local;
  xt::write_random_file(local / "data", (4 << 20) + 9, 17);
  const std::vector<std::string> clear = {"--protect", "clear", "--no-verify"};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.begin(), clear.begin(), clear.end());
    return xt::xduc(args);
  };
  {
    // By default a peer on this host is sent blocks read first, both ways.
    xt::XdfsdProcess d(root.path(), {"--debug"});
    auto up = with({"--debug", local / "data", url(d, "plain")});
    REQUIRE_MESSAGE(up.status == 0, up.err);
    CHECK(xt::files_equal(local / "data", root / "plain"));
    CHECK_MESSAGE(up.err.find("xduc: debug: zero copy off: the peer is on this host") != std::string::npos, up.err);
    CHECK(up.err.find("by sendfile") == std::string::npos);
    auto down = with({"-q", url(d, "plain"), local / "plain"});
    REQUIRE_MESSAGE(down.status == 0, down.err);
    CHECK(xt::files_equal(local / "data", local / "plain"));
    CHECK(d.wait_for_log("debug: zero copy off: the peer is on this host"));
    CHECK(d.log().find("by sendfile") == std::string::npos);
  }
  {
    xt::XdfsdProcess d(root.path(), {"--debug", "--loopback-sendfile"});
    auto up = with({"--debug", "--loopback-sendfile", "-p", "2", local / "data", url(d, "data")});
    REQUIRE_MESSAGE(up.status == 0, up.err);
    CHECK(xt::files_equal(local / "data", root / "data"));
    CHECK_MESSAGE(up.err.find("xduc: debug: zero copy: 4194313 bytes by sendfile") != std::string::npos, up.err);
    auto down = with({"-q", url(d, "data"), local / "back"});
    REQUIRE_MESSAGE(down.status == 0, down.err);
    CHECK(xt::files_equal(local / "data", local / "back"));
    CHECK(d.wait_for_log("debug: zero copy: 4194313 bytes by sendfile"));
    up = with({"--debug", "--loopback-sendfile", "--no-zero-copy", local / "data", url(d, "again")});
    REQUIRE_MESSAGE(up.status == 0, up.err);
    CHECK(xt::files_equal(local / "data", root / "again"));
    CHECK(up.err.find("xduc: debug: zero copy off: switched off by a setting") != std::string::npos);
    CHECK(up.err.find("by sendfile") == std::string::npos);
  }
  xt::XdfsdProcess d(root.path(), {"--debug", "--loopback-sendfile", "--no-zero-copy"});
  ::unlink((local / "back").c_str());
  auto down = with({"-q", url(d, "data"), local / "back"});
  REQUIRE_MESSAGE(down.status == 0, down.err);
  CHECK(xt::files_equal(local / "data", local / "back"));
  CHECK(d.wait_for_log("debug: zero copy off: switched off by a setting"));
  CHECK(d.log().find("by sendfile") == std::string::npos);
}

TEST_CASE("a client killed while xdfsd sends to it by sendfile fails its session only: no SIGPIPE ends the server") {
  xt::TempDir root, local;
  xt::write_random_file(root / "big", 256ull << 20, 5);
  xt::XdfsdProcess d(root.path(), {"--debug", "--loopback-sendfile"});
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    // A slow reader: the server's socket buffers fill, and its sends wait for room.
    std::atomic<pid_t> pid{0};
    std::thread client([&] {
      xt::xduc({"-q", "--protect", "clear", "--no-verify", "-p", "2", "--limit-rate", "4M", url(d, "big"),
                local / "big"},
               60000, &pid);
    });
    REQUIRE(d.wait_for_log("zero copy: file data goes to the sockets by sendfile"));
    ::usleep(500 * 1000);
    REQUIRE(pid.load() > 0);
    ::kill(pid.load(), SIGKILL);  // its sockets reset with data unread
    client.join();
    ::usleep(300 * 1000);
    REQUIRE(d.alive());
  }
  auto r = xt::xduc({"-q", "--protect", "clear", "--no-verify", url(d, "big"), local / "whole"});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(xt::files_equal(root / "big", local / "whole"));
}

TEST_CASE("past the file size limit (RLIMIT_FSIZE) a transfer fails with one line naming it; no SIGXFSZ ends xdfsd or xduc") {
  xt::TempDir root, local;
  xt::write_random_file(local / "big", 4u << 20, 61);
  xt::write_random_file(root / "big", 4u << 20, 62);
  xt::write_random_file(local / "small", 256u << 10, 63);
  const std::string limit = "--fsize=" + std::to_string(1u << 20);
  xt::XdfsdProcess d(root.path(), {}, {"prlimit", limit, "--"});
  // By splice (clear, no digests) and by the disk writer (private), each into a file the limit
  // stops at 1 MiB.
  for (const bool splice : {true, false}) {
    CAPTURE(splice);
    std::vector<std::string> args{"-q", "--retries", "0"};
    if (splice) args.insert(args.end(), {"--protect", "clear", "--no-verify"});
    args.insert(args.end(), {local / "big", url(d, "big" + std::to_string(splice))});
    auto r = xt::xduc(args, 60000);
    CHECK(r.status == 1);
    CHECK_MESSAGE(r.err.find("File too large") != std::string::npos, r.err);
    CHECK(one_line(r.err));
    REQUIRE(d.alive());
    CHECK(!xt::exists(root / ("big" + std::to_string(splice))));
  }
  // The server goes on serving: a file within the limit arrives whole.
  auto ok = xt::xduc({"-q", local / "small", url(d, "small")});
  REQUIRE_MESSAGE(ok.status == 0, ok.err);
  CHECK(xt::files_equal(local / "small", root / "small"));
  // xduc under the limit, downloading: the same one line, an exit status, no signal; nothing
  // under the final name.
  for (const bool splice : {true, false}) {
    CAPTURE(splice);
    std::vector<std::string> args{limit, "--", XDUC_PATH, "-q", "--retries", "0"};
    if (splice) args.insert(args.end(), {"--protect", "clear", "--no-verify"});
    args.insert(args.end(), {url(d, "big"), local / "down"});
    auto r = xt::run("/usr/bin/prlimit", args, 60000);
    CHECK(r.status == 1);
    CHECK_MESSAGE(r.err.find("File too large") != std::string::npos, r.err);
    CHECK(one_line(r.err));
    CHECK(!xt::exists(local / "down"));
  }
}

TEST_CASE("xdfsd whose log reader has gone (stderr a pipe nobody reads) goes on serving: no SIGPIPE ends it") {
  xt::TempDir root, local;
  xt::write_random_file(local / "f", 100000, 64);
  // Its stderr goes through dd, which passes on the first 400 bytes (the listening line
  // among them) and exits: every line after that is written to a pipe with no reader.
  xt::XdfsdProcess d(root.path(), {}, {"bash", "-c", "exec \"$@\" 2> >(dd bs=1 count=400 status=none >&2)", "bash"});
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    auto r = xt::xduc({"-q", local / "f", url(d, "f" + std::to_string(i))});
    CHECK_MESSAGE(r.status == 0, r.err);
    CHECK(xt::files_equal(local / "f", root / ("f" + std::to_string(i))));
    REQUIRE(d.alive());
  }
  CHECK(d.stop(SIGTERM) == 0);
}

TEST_CASE("xduc failures exit non-zero with one line naming the cause") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  xt::write_file(local / "f", "hello");

  auto r = xt::xduc({"-q", url(d, "missing"), local / "x"});
  CHECK(r.status == 1);
  CHECK(one_line(r.err));
  CHECK(r.err.find("no such file (server)") != std::string::npos);

  // With --json, programs get the same failure with its class on standard output.
  r = xt::xduc({"-q", "--json", url(d, "missing"), local / "x"});
  CHECK(r.status == 1);
  CHECK(one_line(r.err));
  CHECK_MESSAGE(r.out.rfind("{\"error\":{\"code\":\"no such file\",\"recovery\":\"give-up\",\"remote\":true,", 0) == 0, r.out);

  r = xt::xduc({local / "f", url(d, "../f")});
  CHECK(r.status == 1);
  CHECK(r.err.find("path escapes the server root") != std::string::npos);

  r = xt::xduc({"-p", "0", local / "f", url(d, "f")});
  CHECK(r.status == 2);
  CHECK(one_line(r.err));
  CHECK(r.err.find("bad argument") != std::string::npos);

  r = xt::xduc({"--block-size", "3X", local / "f", url(d, "f")});
  CHECK(r.status == 2);
  CHECK(r.err.find("--block-size") != std::string::npos);

  r = xt::xduc({local / "f", local / "g"});
  CHECK(r.status == 2);
  CHECK(r.err.find("xdfs:// URL") != std::string::npos);

  r = xt::xduc({local / "f", "xdfs://127.0.0.1:notaport/f"});
  CHECK(r.status == 2);
  CHECK(r.err.find("HOST[:PORT]") != std::string::npos);

  r = xt::xduc({local / "missing", url(d, "f")});
  CHECK(r.status == 1);
  CHECK(r.err.find("no such file") != std::string::npos);

  // (A file that cannot be read: see the namespace-user suite, which runs as an ordinary user.)

  d.stop(SIGTERM);
  r = xt::xduc({url(d, "f"), local / "x"});
  CHECK(r.status == 1);
  CHECK(one_line(r.err));
  CHECK(r.err.find("connection refused") != std::string::npos);
  r = xt::xduc({"--json", url(d, "f"), local / "x"});
  CHECK(r.out.find("\"code\":\"connection refused\",\"recovery\":\"reconnect\",\"remote\":false") != std::string::npos);
  CHECK_MESSAGE(r.out.find("\"operation\":\"session set-up\"}") != std::string::npos, r.out);
}

TEST_CASE("xduc's command line: --version, --help, one-line errors naming the option, subcommands' options") {
  auto v = xt::xduc({"--version"});
  CHECK(v.status == 0);
  CHECK(v.err.empty());
  CHECK_MESSAGE(std::regex_match(v.out, std::regex("xduc \\S+ \\(xDFS protocol " + std::to_string(xdfs::protocol_version) +
                                                   "\\)\n")),
                v.out);

  auto h = xt::xduc({"--help"});
  CHECK(h.status == 0);
  // Every option and every command with its own, and the paragraphs that explain them.
  for (const char* words : {"-p,--parallel N", "-r,--recursive", "--progress MODE", "--version", "To many hosts:",
                            "usage: xduc get", "--listen HOST:PORT", "usage: xduc sum", "--sha256", "%XX in PATH"})
    CHECK_MESSAGE(h.out.find(words) != std::string::npos, words);
  auto ls_help = xt::xduc({"ls", "--help"});
  CHECK(ls_help.status == 0);
  CHECK(ls_help.out.rfind("usage: xduc ls", 0) == 0);
  CHECK(ls_help.out.find("--chains") == std::string::npos);

  const std::string u = "xdfs://127.0.0.1:1/f";
  // Bad values, before or after the positionals.
  CHECK(bad_argument(xt::xduc({"--parallel", "0", "/dev/null", u}), "--parallel takes a channel count from 1 to 4096"));
  CHECK(bad_argument(xt::xduc({"/dev/null", u, "-p", "lots"}), "--parallel takes"));
  CHECK(bad_argument(xt::xduc({"/dev/null", u, "--progress", "sometimes"}), "--progress takes line, json or none"));
  CHECK(bad_argument(xt::xduc({"--tcp-window", "1K", "/dev/null", u}), "--tcp-window takes a size from 4K to 1G"));
  CHECK(bad_argument(xt::xduc({"get", "--listen", "here", u, "/tmp"}), "--listen takes"));
  // CLI11's own: an unknown option, a missing value, an option of another command.
  CHECK(bad_argument(xt::xduc({"--bogus", "/dev/null", u}), "--bogus"));
  CHECK(bad_argument(xt::xduc({"/dev/null", u, "--block-size"}), "--block-size"));
  CHECK(bad_argument(xt::xduc({"--parents", "mkdir", u}), "--parents goes with mkdir"));
  CHECK(bad_argument(xt::xduc({"keygen", "extra"}), "keygen takes no arguments"));
  // A name from the terminal is shown escaped.
  auto esc = xt::xduc({"--bogus\x1b[2J", "/dev/null", u});
  CHECK(esc.status == 2);
  CHECK(esc.err.find('\x1b') == std::string::npos);
}

TEST_CASE("xduc's subcommand names are commands only first: later they are paths") {
  xt::TempDir root;
  xt::write_file(root / "a", "a");
  xt::XdfsdProcess d(root.path());
  auto r = xt::xduc({"-q", "mv", url(d, "a"), "ls"});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(xt::read_file(root / "ls") == "a");
  r = xt::xduc({"stat", url(d, "ls"), "--json"});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(r.out.find("\"path\":\"ls\"") != std::string::npos);
  // After a SRC, "stat" is a local DST: a copy between two local paths.
  CHECK(bad_argument(xt::xduc({"-q", "/dev/null", "stat"}), "are both local"));
}

TEST_CASE("xduc -r --progress json: an object a second on stderr, the last one final with the tree's files and bytes") {
  xt::TempDir root, local;
  std::filesystem::create_directories(local / "t/sub");
  std::uint64_t bytes = 0;
  for (int i = 0; i < 20; ++i) {
    xt::write_random_file(local / ("t/sub/s" + std::to_string(i)), 1000 + i, i);
    bytes += 1000 + i;
  }
  // Two large files that go as transfers of their own, at 2 MiB/s: the copy takes over a second.
  for (int i = 0; i < 2; ++i) {
    xt::write_random_file(local / ("t/big" + std::to_string(i)), (5 << 19) + i, 50 + i);
    bytes += (5 << 19) + i;
  }
  xt::XdfsdProcess d(root.path());
  auto check = [&](const xt::RunResult& r, const char* way) {
    CAPTURE(way);
    REQUIRE_MESSAGE(r.status == 0, r.err);
    const auto lines = progress_lines(r.err);
    REQUIRE(lines.size() >= 2);
    std::uint64_t before = 0;
    for (std::size_t k = 0; k + 1 < lines.size(); ++k) {
      const auto& p = lines[k];
      CHECK(!p.final);
      CHECK(p.bytes >= before);
      before = p.bytes;
      if (p.totals_final) {
        CHECK(p.files_total == 22);
        CHECK(p.bytes_total == bytes);
      }
      CHECK(p.files <= p.files_total);
      CHECK(p.bytes <= p.bytes_total);
    }
    const auto& last = lines.back();
    CHECK(last.final);
    CHECK(last.totals_final);
    CHECK(last.files == 22);
    CHECK(last.files_total == 22);
    CHECK(last.bytes == bytes);
    CHECK(last.bytes_total == bytes);
  };
  check(xt::xduc({"-q", "-r", "--progress", "json", "--large-file", "1M", "--limit-rate", "2M", local / "t",
                  url(d, "")}),
        "upload");
  check(xt::xduc({"-q", "-r", "--progress", "json", "--large-file", "1M", "--limit-rate", "2M", url(d, "t"),
                  local / "back"}),
        "download");
  CHECK(xt::files_equal(local / "t/big1", local / "back/t/big1"));

  // A single file: the same object, from its transfer.
  auto one = xt::xduc({"-q", "--progress", "json", local / "t/big0", url(d, "one")});
  REQUIRE_MESSAGE(one.status == 0, one.err);
  const auto lines = progress_lines(one.err);
  REQUIRE(!lines.empty());
  CHECK(lines.back().final);
  CHECK(lines.back().files == 1);
  CHECK(lines.back().bytes == (5u << 19));
  // -q alone: no progress at all.
  auto quiet = xt::xduc({"-q", local / "t/big0", url(d, "two")});
  CHECK(quiet.err.empty());
}

TEST_CASE("xduc over IPv6: xdfs://[::1]:PORT/... up and down, a name with %20 in it") {
  if (!ipv6_loopback()) {
    MESSAGE("skipped: this host has no IPv6 loopback");
    return;
  }
  xt::TempDir root, local;
  xt::write_random_file(local / "f", (2 << 20) + 7, 21);
  xt::XdfsdProcess d(root.path(), {"--listen", "[::1]:0"});
  const std::string base = "xdfs://[::1]:" + std::to_string(d.port()) + "/";
  auto up = xt::xduc({"-q", "-p", "2", local / "f", base + "in%20v6"});
  REQUIRE_MESSAGE(up.status == 0, up.err);
  CHECK(xt::files_equal(local / "f", root / "in v6"));
  auto down = xt::xduc({"-q", "-p", "2", base + "in%20v6", local / "back"});
  REQUIRE_MESSAGE(down.status == 0, down.err);
  CHECK(xt::files_equal(local / "f", local / "back"));
}

TEST_CASE("xdfs:// URLs: a user is refused, IPv6 in brackets, %XX decoded, a malformed escape or a NUL refused") {
  using xdfs::cli::parse_url;
  std::string why;
  auto u = parse_url("xdfs://host/dir/f", why);
  REQUIRE(u);
  CHECK(u->host == "host");
  CHECK(u->port == 7721);
  CHECK(u->path == "dir/f");

  u = parse_url("xdfs://[::1]:7000/a/b", why);
  REQUIRE(u);
  CHECK(u->host == "::1");
  CHECK(u->port == 7000);
  CHECK(u->path == "a/b");
  u = parse_url("xdfs://[2001:db8::5]/x", why);
  REQUIRE(u);
  CHECK(u->host == "2001:db8::5");
  CHECK(u->port == 7721);
  u = parse_url("xdfs://[fe80::1%25eth0]:9/x", why);
  REQUIRE(u);
  CHECK(u->host == "fe80::1%eth0");
  CHECK_FALSE(parse_url("xdfs://::1/x", why));  // an IPv6 address without its brackets
  CHECK(why.find("goes in brackets") != std::string::npos);
  CHECK_FALSE(parse_url("xdfs://[::1/x", why));
  CHECK_FALSE(parse_url("xdfs://[::1]x/y", why));
  CHECK_FALSE(parse_url("xdfs://host:65536/x", why));

  u = parse_url("xdfs://host/a%20b%25c%2Fd%e2%82%AC", why);
  REQUIRE(u);
  CHECK(u->path == "a b%c/d\xe2\x82\xac");
  u = parse_url("xdfs://host/%2Fetc", why);  // as xdfs://host//etc: relative to the root
  REQUIRE(u);
  CHECK(u->path == "etc");
  for (const char* broken : {"xdfs://host/a%", "xdfs://host/a%2", "xdfs://host/a%zz", "xdfs://host/%g0"}) {
    CAPTURE(broken);
    CHECK_FALSE(parse_url(broken, why));
    CHECK(why.find("not a %XX escape") != std::string::npos);
  }
  CHECK_FALSE(parse_url("xdfs://host/a%00b", why));
  CHECK(why.find("NUL") != std::string::npos);

  CHECK_FALSE(parse_url("xdfs://alice@host/x", why));
  CHECK(why.find("names a user ('alice@')") != std::string::npos);
  CHECK_FALSE(parse_url("xdfs://[::1]@host/x", why));
  // What the user typed comes back escaped, in one line.
  CHECK_FALSE(parse_url("xdfs://host/a%zz\n\x1b[2J", why));
  CHECK(why.find('\n') == std::string::npos);
  CHECK(why.find('\x1b') == std::string::npos);

  // format_url writes what parse_url reads back, byte for byte.
  for (auto [host, path] : std::vector<std::pair<std::string, std::string>>{
           {"host", "plain/name"}, {"::1", "a b%c\nd\x7f"}, {"fe80::1%eth0", "x"}, {"10.0.0.1", ""}}) {
    const auto text = xdfs::cli::format_url(host, 7722, path);
    CAPTURE(text);
    CHECK(text.find_first_of(" \n\x7f") == std::string::npos);
    u = parse_url(text, why);
    REQUIRE_MESSAGE(u, why);
    CHECK(u->host == host);
    CHECK(u->port == 7722);
    CHECK(u->path == path);
  }
}

TEST_CASE("xdfsd refuses bad arguments in one line") {
  auto r = xt::run(XDFSD_PATH, {});
  CHECK(r.status == 2);
  CHECK(r.err.find("--root") != std::string::npos);
  r = xt::run(XDFSD_PATH, {"--root", "/nonexistent-xdfs-root"});
  CHECK(r.status == 1);
  CHECK(r.err.find("no such file") != std::string::npos);
  r = xt::run(XDFSD_PATH, {"--root", "/tmp", "--listen", "not-an-address"});
  CHECK(r.status == 2);
  r = xt::run(XDFSD_PATH, {"--root", "/tmp", "--max-channels", "0"});
  CHECK(r.status == 2);
}

TEST_CASE("SIGTERM mid-upload: xdfsd exits cleanly and leaves no file under the final name") {
  xt::TempDir root;
  ::mkdir((root / "in").c_str(), 0755);
  xt::XdfsdProcess d(root.path());
  const std::uint32_t bs = 64 * 1024;
  xt::RawChannel c(d.port());
  REQUIRE(c.establish(xt::make_hello(Mode::upload, "in/file", 1, 16 * bs)));
  auto reply = c.read_frame();
  REQUIRE(reply.has_value());
  REQUIRE(reply->first.event == ChannelEvent::nego_reply);
  xdfs::wire::FrameHeader h;
  h.event = ChannelEvent::xftsmu;
  h.length = bs;
  c.send_frame(h, xt::random_bytes(bs, 3));
  REQUIRE(d.wait_for_log("start peer="));
  // The temporary file exists while the transfer runs: the stop must remove it.
  const auto names = xt::list_dir(root / "in");
  REQUIRE(names.size() == 1);
  CHECK(names[0].find(".file.xdfs-") == 0);
  CHECK(names[0].find(".part") != std::string::npos);
  CHECK(d.stop(SIGTERM) == 0);
  CHECK(d.log().find("status=error: server shutting down") != std::string::npos);
  CHECK(d.log().find("stopped") != std::string::npos);
  auto ex = c.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->code == xdfs::errc::shutting_down);
  CHECK(xt::list_dir(root / "in").empty());
}

TEST_CASE("SIGTERM during a download and during a path session: each client hears it, xdfsd exits 0") {
  xt::TempDir root, local;
  xt::write_random_file(root / "big", 4 << 20, 3);
  xt::XdfsdProcess d(root.path());
  auto down = xt::make_hello(Mode::download, "big", 1);
  down.nego.window = 2 * 64 * 1024;  // two blocks, then the server waits for an acknowledgement
  xt::RawChannel c(d.port());
  REQUIRE(c.establish(down));
  auto reply = c.read_frame();
  REQUIRE(reply.has_value());
  REQUIRE(reply->first.event == ChannelEvent::nego_reply);
  xdfs::RemoteFs rfs({"127.0.0.1", d.port()});
  CHECK(rfs->stat("big").size == (4u << 20));
  REQUIRE(d.wait_for_log("mode=path"));
  CHECK(d.stop(SIGTERM) == 0);
  CHECK(d.log().find("mode=download path=big channels=1 bytes=0") != std::string::npos);
  auto ex = c.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->code == xdfs::errc::shutting_down);
  try {
    rfs->stat("big");
    FAIL("a path session outlived its server");
  } catch (const xdfs::Error& e) {
    CHECK(e.code() == xdfs::errc::shutting_down);
  }
}

TEST_CASE("xduc interrupted by SIGINT exits 130 with one line, and the server drops the partial file") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {"--allow-memory-mode"});
  xt::write_random_file(local / "f", 1, 1);
  // A memory-mode upload of a terabyte: it runs until it is told to stop.
  int out[2];
  REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 2);
    ::execl(XDUC_PATH, XDUC_PATH, "-q", "--memory", "1024G", local.path().c_str(),
            ("xdfs://127.0.0.1:" + std::to_string(d.port()) + "/m").c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  REQUIRE(d.wait_for_log("mode=upload path=m"));
  ::kill(pid, SIGINT);
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::string err;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(out[0], buf, sizeof buf)) > 0) err.append(buf, static_cast<std::size_t>(n));
  ::close(out[0]);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 130);
  CHECK(one_line(err));
  CHECK(err.find("cancelled") != std::string::npos);
  CHECK(d.wait_for_log("path=m channels=1"));
  CHECK(d.wait_for_log("status=error: cancelled"));
}

// How many calls of one system call xduc makes (all its threads), uploading from memory with
// `args` to a memory-mode xdfsd, counted on the real process by strace (scripts/install-deps.sh
// installs it).
static int traced_upload_calls(const std::string& syscall, std::vector<std::string> args) {
  REQUIRE_MESSAGE(xt::run("/usr/bin/strace", {"-f", "-qq", "-o", "/dev/null", "true"}, 30000).status == 0,
                  "strace cannot trace here");
  xt::TempDir root, tmp;
  xt::XdfsdProcess d(root.path(), {"--allow-memory-mode"});
  const auto trace = tmp / (syscall + ".strace");
  std::vector<std::string> argv{"-f", "-qq", "-e", "trace=" + syscall, "-e", "signal=none", "-o", trace, XDUC_PATH, "-q"};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"/dev/zero", "xdfs://127.0.0.1:" + std::to_string(d.port()) + "/m"});
  auto r = xt::run("/usr/bin/strace", argv);
  REQUIRE_MESSAGE(r.status == 0, r.err);
  std::ifstream in(trace);
  std::string line;
  int calls = 0;
  while (std::getline(in, line))
    if (line.find(syscall + "(") != std::string::npos) ++calls;
  return calls;
}

// A frame leaves in as few system calls as the socket takes: asio's composed write on its own
// hands the kernel 64 KiB at a time (16 sendmsg calls and as many turns of the loop per MiB).
// With the socket's buffer as Linux tunes it on loopback a 1 MiB block leaves in one call,
// rarely a few; the bound is half the old floor, so that a slow machine's partial writes do not
// fail it.
TEST_CASE("xduc's memory-mode uploads send a block in a few sendmsg calls, not one per 64 KiB") {
  constexpr int mib = 64;
  for (const std::string protect : {"clear", "private"}) {
    CAPTURE(protect);
    const int calls = traced_upload_calls("sendmsg", {"--protect", protect, "--memory", std::to_string(mib) + "M"});
    CAPTURE(calls);
    CHECK(calls >= mib / 16);  // the trace is there: at least a call per 16 MiB
    CHECK(calls < 8 * mib);
  }
}

// A sender hands each sent block's slot back to its disk thread, and woke that thread for every
// one: a futex wake, the thread's futex wait, and its eventfd round trip back, per block. Now it
// wakes it once a quarter of the pool is back (or when few blocks are left to send). A clear
// memory-mode upload: before, 1.9 futex calls a block.
TEST_CASE("xduc's memory-mode upload wakes its disk thread once for several blocks, not once a block") {
  constexpr int blocks = 256;  // 1 MiB each
  const int calls = traced_upload_calls(
      "futex", {"--protect", "clear", "--block-size", "1M", "--memory", std::to_string(blocks) + "M"});
  CAPTURE(calls);
  CHECK(calls < blocks / 2);
}

TEST_CASE("the embedding example runs a server and a client in one process") {
  xt::TempDir root, local;
  xt::write_random_file(local / "e", 1 << 20, 8);
  auto r = xt::run(EMBED_PATH, {root.path(), local / "e"});
  CHECK_MESSAGE(r.status == 0, r.err);
  CHECK(r.out.find("uploaded 1048576 bytes") != std::string::npos);
  CHECK(xt::files_equal(local / "e", root / "e"));
}

}  // TEST_SUITE
