// Streams: uploads whose size is known only at their end (wire::Negotiation::open_ended), from
// standard input, a pipe or a FIFO. Real xduc and xdfsd processes, standard input a real pipe
// (sh's), and hand-made frames from a raw client for what a correct client never sends.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/wire.hpp"

using xdfs::Mode;
using xdfs::errc;
using xdfs::wire::ChannelEvent;

namespace {

std::string url(std::uint16_t port, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(port) + "/" + path;
}

// sh -c "COMMAND | xduc ARGS": xduc's standard input is a pipe.
xt::RunResult xduc_from(const std::string& command, const std::vector<std::string>& args, int timeout_ms = 300000) {
  std::string line = command + " | '" + XDUC_PATH + "'";
  for (const auto& a : args) line += " '" + a + "'";
  return xt::run("/bin/sh", {"-c", line}, timeout_ms);
}

std::string json_string(const xt::RunResult& r, const std::string& key) {
  const auto at = r.out.find("\"" + key + "\":\"");
  REQUIRE_MESSAGE(at != std::string::npos, r.out << r.err);
  const auto from = at + key.size() + 4;
  return r.out.substr(from, r.out.find('"', from) - from);
}

std::uint64_t json_number(const xt::RunResult& r, const std::string& key) {
  const auto at = r.out.find("\"" + key + "\":");
  REQUIRE_MESSAGE(at != std::string::npos, r.out << r.err);
  return std::stoull(r.out.substr(at + key.size() + 3));
}

std::string digest_of(const std::string& path, std::uint32_t bs = 1 << 20) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  struct stat st {};
  REQUIRE(::fstat(fd, &st) == 0);
  const auto r = xdfs::manifest::of_file(fd, static_cast<std::uint64_t>(st.st_size), bs);
  ::close(fd);
  REQUIRE(r.code == errc::ok);
  return xdfs::manifest::hex(r.digest);
}

}  // namespace

TEST_SUITE("process") {

TEST_CASE("xduc - uploads 1 GiB of standard input (a pipe): it arrives identical, with the digest of its content") {
  xt::TempDir root, local;
  const std::uint64_t size = 1ull << 30;
  xt::write_random_file(local / "src", size, 61);
  xt::XdfsdProcess d(root.path());
  auto r = xduc_from("cat '" + local / "src" + "'", {"-q", "--json", "-p", "4", "-", url(d.port(), "in/big")}, 600000);
  // "in" does not exist: refused, nothing made.
  CHECK(r.status == 1);
  CHECK(r.err.find("no such file") != std::string::npos);
  ::mkdir((root / "in").c_str(), 0755);
  r = xduc_from("cat '" + local / "src" + "'", {"-q", "--json", "-p", "4", "-", url(d.port(), "in/big")}, 600000);
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(xt::files_equal(local / "src", root / "in/big"));
  CHECK(json_number(r, "bytes") == size);
  // The digest both ends agreed on is the documented one of the content (docs/manifest.md), as
  // xduc sum gives it for the local file and for the server's copy.
  const std::string want = digest_of(local / "src");
  CHECK(json_string(r, "digest") == want);
  CHECK(json_string(r, "digest_algorithm") == xdfs::manifest::algorithm);
  auto sum = xt::xduc({"sum", url(d.port(), "in/big")});
  CHECK(sum.out.rfind(want, 0) == 0);
  xt::check_no_partials(root.path());
}

TEST_CASE("streams of every shape arrive whole in every protection mode: empty, short, whole blocks, a FIFO, slow writers") {
  xt::TempDir root, local;
  xt::write_random_file(local / "src", 5 * 65536 + 17, 62);
  xt::XdfsdProcess d(root.path());
  const std::string src = local / "src";
  for (const char* protect : {"clear", "integrity", "private"})
    for (const char* verify : {"", "--no-verify"})
      for (std::uint64_t n : {std::uint64_t(0), std::uint64_t(1), std::uint64_t(65536), std::uint64_t(4 * 65536),
                              std::uint64_t(5 * 65536 + 17)}) {
        CAPTURE(protect);
        CAPTURE(verify);
        CAPTURE(n);
        std::vector<std::string> args{"-q", "--json", "-p", "3", "--block-size", "64K", "--protect", protect};
        if (*verify) args.push_back(verify);
        args.insert(args.end(), {"-", url(d.port(), "s")});
        auto r = xduc_from("head -c " + std::to_string(n) + " '" + src + "'", args);
        REQUIRE_MESSAGE(r.status == 0, r.err);
        CHECK(json_number(r, "bytes") == n);
        xt::write_file(local / "want", xt::read_file(src).substr(0, n));
        CHECK(xt::files_equal(local / "want", root / "s"));
        if (!*verify) CHECK(json_string(r, "digest") == digest_of(local / "want", 65536));
      }
  // A writer that pauses: what it gave arrives, whatever the pauses.
  auto r = xduc_from("(printf abc; sleep 1; printf def)", {"-q", "-", url(d.port(), "slow")});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(xt::read_file(root / "slow") == "abcdef");
  // Standard input that is a regular file goes as that file does, from its start; read partly
  // already, it is a stream of the rest.
  r = xt::run("/bin/sh", {"-c", "'" + std::string(XDUC_PATH) + "' -q - '" + url(d.port(), "whole") + "' < '" + src + "'"});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(xt::files_equal(src, root / "whole"));
  r = xt::run("/bin/sh", {"-c", "{ dd bs=100 count=1 of=/dev/null 2>/dev/null; '" + std::string(XDUC_PATH) +
                                    "' -q - '" + url(d.port(), "rest") + "'; } < '" + src + "'"});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(xt::read_file(root / "rest") == xt::read_file(src).substr(100));
  // A writer silent for longer than the server's idle timeout: the client says it is alive.
  {
    xt::XdfsdProcess strict(root.path(), {"--idle-timeout", "2"});
    r = xduc_from("(printf abc; sleep 5; printf def)", {"-q", "-", url(strict.port(), "patient")});
    REQUIRE_MESSAGE(r.status == 0, r.err);
    CHECK(xt::read_file(root / "patient") == "abcdef");
  }
  // A FIFO named as SRC is a stream too, its name the remote one; xduc waits for its writer.
  REQUIRE(::mkfifo((local / "fifo").c_str(), 0600) == 0);
  r = xt::run("/bin/sh", {"-c", "(sleep 1; cat '" + src + "' > '" + local / "fifo" + "') & '" + XDUC_PATH + "' -q '" +
                                    local / "fifo" + "' '" + url(d.port(), "") + "'; s=$?; wait; exit $s"});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(xt::files_equal(src, root / "fifo"));
  xt::check_no_partials(root.path());
}

TEST_CASE("a stream beyond the server's --max-file-size fails naming the limit, leaving no file and the old one whole; bad uses exit 2") {
  xt::TempDir root, local;
  xt::write_random_file(local / "src", 6 << 20, 63);
  xt::XdfsdProcess d(root.path(), {"--max-file-size", "4M"});
  xt::write_file(root / "keep", "the old content");
  auto r = xduc_from("cat '" + local / "src" + "'", {"-q", "-p", "2", "-", url(d.port(), "keep")});
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.err.find("limit exceeded (server): the stream is longer than the 4194304 bytes this server takes for it") !=
                    std::string::npos,
                r.err);
  CHECK(r.err.find("retry") == std::string::npos);
  CHECK(xt::read_file(root / "keep") == "the old content");
  CHECK(d.wait_for_log("status=error: limit exceeded"));
  xt::check_no_partials(root.path());
  // Exactly the limit is fine.
  r = xduc_from("head -c 4194304 '" + local / "src" + "'", {"-q", "-", url(d.port(), "four")});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(xt::read_file(root / "four").size() == 4194304);

  struct Bad {
    std::vector<std::string> args;
    const char* words;
  };
  for (const auto& b : {Bad{{"-", url(d.port(), "")}, "needs a remote file name"},
                        Bad{{"-", url(d.port(), "dir/")}, "needs a remote file name"},
                        Bad{{"-", local / "src", url(d.port(), "dir/")}, "uploaded alone"},
                        Bad{{"-r", "-", url(d.port(), "x")}, "uploaded alone"}}) {
    auto e = xduc_from("echo hi", b.args);
    CHECK(e.status == 2);
    CHECK_MESSAGE(e.err.find(b.words) != std::string::npos, e.err);
  }
}

TEST_CASE("a stream whose server goes away is not retried: what it read is gone") {
  xt::TempDir root, local;
  xt::write_random_file(local / "src", 1 << 20, 64);
  auto d = std::make_unique<xt::XdfsdProcess>(root.path());
  const auto port = d->port();
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    d->stop(SIGKILL);
  });
  auto r = xduc_from("(cat '" + local / "src" + "'; sleep 4)", {"-q", "--retries", "3", "-", url(port, "gone")});
  killer.join();
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.err.find("retry") == std::string::npos, r.err);
  CHECK_FALSE(xt::exists(root / "gone"));
}

TEST_CASE("xdfsd --allow-fifo: a stream uploaded to a FIFO reaches its reader whole, with its digest; no reader, or one that leaves, fails only that transfer") {
  xt::TempDir root, local;
  const std::string src = local / "src";
  xt::write_random_file(src, 8 << 20, 65);
  REQUIRE(::mkfifo((root / "pipe").c_str(), 0600) == 0);
  xt::XdfsdProcess d(root.path(), {"--allow-fifo"});
  // The reader: opens the FIFO, then reads up to `limit` bytes (all, by default) and closes it.
  auto reader = [&](std::string& got, std::size_t limit) {
    const int fd = ::open((root / "pipe").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    REQUIRE(fd >= 0);
    return std::thread([fd, &got, limit] {
      char buf[65536];
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (got.size() < limit && std::chrono::steady_clock::now() < until) {
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 100) <= 0) continue;
        const ssize_t r = ::read(fd, buf, std::min(sizeof buf, limit - got.size()));
        if (r == 0) break;  // every writer closed it
        if (r > 0) got.append(buf, static_cast<std::size_t>(r));
      }
      ::close(fd);
    });
  };
  std::string got;
  auto t = reader(got, SIZE_MAX);
  auto r = xduc_from("cat '" + src + "'", {"-q", "--json", "-p", "3", "-", url(d.port(), "pipe")});
  t.join();
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(got == xt::read_file(src));
  CHECK(json_string(r, "digest") == digest_of(src));
  struct stat st {};
  REQUIRE(::lstat((root / "pipe").c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));
  // Nobody reads it: refused, naming why.
  r = xduc_from("echo hi", {"-q", "-", url(d.port(), "pipe")});
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.err.find("'pipe' is a FIFO that nobody reads") != std::string::npos, r.err);
  // The reader leaves after 64 KiB: that upload fails (EPIPE, not a signal), xdfsd serves on.
  got.clear();
  t = reader(got, 65536);
  r = xduc_from("cat '" + src + "'", {"-q", "-", url(d.port(), "pipe")});
  t.join();
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.err.find("Broken pipe") != std::string::npos, r.err);
  REQUIRE(d.alive());
  xt::check_serving(d.port(), root.path(), local.path());
  REQUIRE(::lstat((root / "pipe").c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));

  // One upload at a time: a second one while the first writes is refused, naming why.
  got.clear();
  t = reader(got, SIZE_MAX);
  // (The first upload's log line is there already: wait for this one's.)
  const std::string writing = "writing into the FIFO 'pipe'";
  auto times_logged = [&] {
    const std::string log = d.log();
    std::size_t n = 0;
    for (auto at = log.find(writing); at != std::string::npos; at = log.find(writing, at + 1)) ++n;
    return n;
  };
  const std::size_t before = times_logged();
  std::thread first([&] { r = xduc_from("(cat '" + src + "'; sleep 3)", {"-q", "-", url(d.port(), "pipe")}); });
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
       times_logged() == before && std::chrono::steady_clock::now() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(times_logged() == before + 1);  // (the thread is joined below whatever happens)
  auto second = xduc_from("echo hi", {"-q", "-", url(d.port(), "pipe")});
  first.join();
  t.join();
  CHECK(r.status == 0);
  CHECK(got == xt::read_file(src));
  CHECK(second.status == 1);
  CHECK_MESSAGE(second.err.find("'pipe' is a FIFO another upload is writing into") != std::string::npos, second.err);
}

TEST_CASE("what went into a FIFO or out of one, or to standard output, is not tried again when the session is cut") {
  using V = xt::Relay::Verdict;
  using D = xt::Relay::Dir;
  xt::TempDir root, local;
  const std::string src = local / "src";
  xt::write_random_file(src, 8 << 20, 66);
  xt::write_random_file(root / "f", 8 << 20, 67);
  REQUIRE(::mkfifo((root / "pipe").c_str(), 0600) == 0);
  xt::XdfsdProcess d(root.path(), {"--allow-fifo"});
  // A reader that drains the FIFO for as long as the test runs.
  const int fifo = ::open((root / "pipe").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  REQUIRE(fifo >= 0);
  std::atomic<bool> done{false};
  std::thread drain([&] {
    char buf[65536];
    while (!done.load()) {
      pollfd p{fifo, POLLIN, 0};
      if (::poll(&p, 1, 50) > 0) (void)::read(fifo, buf, sizeof buf);
    }
  });
  const std::vector<std::string> common{"-q", "-p", "2", "--protect", "clear", "--block-size", "256K", "--retries", "3"};
  struct Case {
    const char* name;
    D data;
    std::function<xt::RunResult(const std::string& relay_url)> run;
  };
  const std::vector<Case> cases{
      {"a file uploaded into a FIFO", D::up,
       [&](const std::string& u) {
         auto a = common;
         a.insert(a.end(), {src, u + "/pipe"});
         return xt::xduc(a);
       }},
      {"a download to standard output", D::down,
       [&](const std::string& u) {
         std::string line = "'" + std::string(XDUC_PATH) + "'";
         for (const auto& x : common) line += " '" + x + "'";
         return xt::run("/bin/sh", {"-c", line + " '" + u + "/f' - > /dev/null"});
       }},
      {"a stream from a FIFO", D::up,
       [&](const std::string& u) {
         REQUIRE(::mkfifo((local / "in").c_str(), 0600) == 0);
         std::string line = "(cat '" + src + "' > '" + local / "in" + "') & '" + XDUC_PATH + "'";
         for (const auto& x : common) line += " '" + x + "'";
         return xt::run("/bin/sh", {"-c", line + " '" + local / "in" + "' '" + u + "/streamed'; s=$?; wait; exit $s"});
       }},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    xt::Relay relay(d.port(), xdfs::xsec::Protect::clear);
    std::atomic<bool> cut{false};
    relay.hook = [&](const xt::Relay::Seen& f) {
      if (f.conn == 1 && f.dir == c.data && f.data_index == 5 && !cut.exchange(true)) return V::cut;
      return V::pass;
    };
    auto r = c.run("xdfs://127.0.0.1:" + std::to_string(relay.port()));
    CHECK(cut.load());
    CHECK(r.status == 1);
    CHECK_MESSAGE(r.err.find("retry") == std::string::npos, r.err);
  }
  done = true;
  drain.join();
  ::close(fifo);
  CHECK_FALSE(xt::exists(root / "streamed"));
}

}  // TEST_SUITE("process")

TEST_SUITE("badinput") {

TEST_CASE("a hostile stream: a short block not at the end, blocks past it, an EOFR that disagrees, a negotiation with a size") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {"--idle-timeout", "2", "--max-file-size", "1M"});
  const std::uint32_t bs = 64 * 1024;
  auto start_stream = [&](xt::RawChannel& c) {
    auto n = xt::make_hello(Mode::upload, "victim", 1, 0);
    n.nego.open_ended = true;
    REQUIRE(c.establish(n));
    auto reply = c.read_frame();
    REQUIRE(reply.has_value());
    REQUIRE(reply->first.event == ChannelEvent::nego_reply);
  };
  const auto block = xt::upload_block;
  auto expect = [&](xt::RawChannel& c, errc code, const std::string& words) {
    auto ex = c.read_exception();
    REQUIRE_MESSAGE(ex.has_value(), "no exception header; xdfsd log:\n" << d.log());
    CHECK(ex->code == code);
    CHECK_MESSAGE(ex->message.find(words) != std::string::npos, ex->message);
  };
  SUBCASE("a short block, then a block after it") {
    xt::RawChannel c(d.port());
    start_stream(c);
    c.send_frame(block(0, 100), xt::random_bytes(100, 1));
    c.send_frame(block(bs, bs), xt::random_bytes(bs, 2));
    expect(c, errc::protocol_error, "bad block on channel 0: offset 65536 length 65536 in a stream: the stream ends at 100");
  }
  SUBCASE("a short block before blocks that came already") {
    xt::RawChannel c(d.port());
    start_stream(c);
    c.send_frame(block(bs, bs), xt::random_bytes(bs, 2));
    c.send_frame(block(0, 100), xt::random_bytes(100, 1));
    expect(c, errc::protocol_error, "a short block before blocks that came already");
  }
  SUBCASE("an EOFR that ends the stream before its blocks") {
    xt::RawChannel c(d.port());
    start_stream(c);
    c.send_frame(block(0, bs), xt::random_bytes(bs, 2));
    c.send_frame(block(bs, bs), xt::random_bytes(bs, 3));
    c.send_frame(xt::eofr_header(bs));
    expect(c, errc::protocol_error, "EOFR on channel 0 ends the stream at 65536");
  }
  SUBCASE("an EOFR that claims more than came") {
    xt::RawChannel c(d.port());
    start_stream(c);
    c.send_frame(block(0, bs), xt::random_bytes(bs, 2));
    c.send_frame(xt::eofr_header(3 * bs));
    expect(c, errc::size_mismatch, "sender ended after 65536 of 196608 bytes");
  }
  SUBCASE("blocks beyond the server's limit, and an EOFR beyond it") {
    xt::RawChannel c(d.port());
    start_stream(c);
    c.send_frame(block(1 << 20, bs), xt::random_bytes(bs, 2));
    expect(c, errc::limit_exceeded, "the stream is longer than the 1048576 bytes this server takes for it");
    xt::RawChannel c2(d.port());
    start_stream(c2);
    c2.send_frame(xt::eofr_header(std::uint64_t(1) << 61));
    expect(c2, errc::limit_exceeded, "the stream is longer than the 1048576 bytes this server takes for it");
  }
  SUBCASE("an open-ended negotiation that declares a size, or is a download") {
    auto n = xt::make_hello(Mode::upload, "victim", 1, 10);
    n.nego.open_ended = true;
    std::string why;
    CHECK_FALSE(xdfs::wire::decode_negotiation(xdfs::wire::encode(n.nego), &why));
    CHECK(why == "an open-ended upload declares a size");
    n.nego.file_size = 0;
    n.nego.mode = Mode::download;
    CHECK_FALSE(xdfs::wire::decode_negotiation(xdfs::wire::encode(n.nego), &why));
    CHECK(why == "only an upload is open-ended");
  }
  REQUIRE(d.alive());
  xt::check_serving(d.port(), root.path(), local.path());
  xt::check_no_partials(root.path());
  CHECK_FALSE(xt::exists(root / "victim"));
}

}  // TEST_SUITE("badinput")
