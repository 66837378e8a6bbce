// Loopback transfers through an in-process server with the library client: every size edge,
// n = 1, 4 and 16, both directions, byte for byte; and the errors a client must see.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/mount.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <latch>
#include <mutex>
#include <set>
#include <thread>

#include "support.hpp"
#include "xdfs/xdfs.hpp"
#include "xdfs/pathm/messages.hpp"
#include "xdfs/detail/xftsm_engine.hpp"
#include "xdfs/xsec.hpp"

namespace {

// One channel over loopback: the engine's end in `channels`, a raw peer socket in `peer`.
struct Loopback {
  boost::asio::io_context ctx;
  boost::asio::ip::tcp::acceptor acceptor{ctx, {boost::asio::ip::make_address("127.0.0.1"), 0}};
  boost::asio::ip::tcp::socket peer{ctx};
  xdfs::xdsi::ChannelList channels;
  explicit Loopback(std::uint32_t index = 0) {
    peer.connect(acceptor.local_endpoint());
    channels.push_back(std::make_unique<xdfs::xdsi::Channel>(acceptor.accept(), index));
  }
};

// A server's upload machine on `rows`, its one channel joined: where the receiving engine starts.
xdfs::xftsm::Machine joined_upload(std::span<const xdfs::xftsm::Transition> rows) {
  xdfs::xftsm::Machine m(xdfs::xftsm::Role::server_upload, rows);
  REQUIRE(m.fire(xdfs::xftsm::TransferEvent::channel_joined));
  REQUIRE(m.fire(xdfs::xftsm::TransferEvent::all_joined));
  return m;
}

xdfs::ServerConfig config_for(const xt::TempDir& root) {
  xdfs::ServerConfig c;
  c.root = root.path();
  c.max_channels = 32;
  c.join_timeout = std::chrono::milliseconds(5000);
  return c;
}

// What a client's debug lines say, kept for a check.
struct DebugLines {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& l) {
      std::lock_guard lock(mu);
      lines.push_back(l);
    };
  }
  bool has(const std::string& text) {
    std::lock_guard lock(mu);
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(text) != std::string::npos; });
  }
  void clear() {
    std::lock_guard lock(mu);
    lines.clear();
  }
};

// Uploads local/name (size bytes) to the server as name, then downloads it to local/name.back:
// both ends hold it byte for byte. What each direction reported, for further checks.
std::pair<xdfs::TransferResult, xdfs::TransferResult> round_trip(xt::InProcessServer& srv, const xt::TempDir& root,
                                                                 const xt::TempDir& local, const std::string& name,
                                                                 std::uint64_t size, const xdfs::TransferOptions& opt) {
  auto up = xdfs::upload(local / name, {"127.0.0.1", srv.port()}, name, opt);
  CHECK(up.bytes == size);
  CHECK(xt::files_equal(local / name, root / name));
  auto down = xdfs::download({"127.0.0.1", srv.port()}, name, local / (name + ".back"), opt);
  CHECK(down.bytes == size);
  CHECK(xt::files_equal(local / name, local / (name + ".back")));
  return {up, down};
}

// Temporary files left beside the final names would mean a failure path forgot to clean up.


}  // namespace

TEST_SUITE("transfer") {

TEST_CASE("edge sizes move byte for byte in both directions with n = 1, 4, 16") {
  xt::TempDir root, local;
  xt::InProcessServer srv(config_for(root));
  const std::uint32_t bs = 64 * 1024;
  for (std::uint64_t size : {std::uint64_t(0), std::uint64_t(1), std::uint64_t(bs - 1), std::uint64_t(bs),
                             std::uint64_t(bs + 1), std::uint64_t(7 * bs + 3)}) {
    for (unsigned n : {1u, 4u, 16u}) {
      CAPTURE(size);
      CAPTURE(n);
      const std::string name = fmt::format("f{}_{}", size, n);
      xt::write_random_file(local / name, size, size * 31 + n);
      xdfs::TransferOptions opt;
      opt.channels = n;
      opt.block_size = bs;
      opt.ring_bytes = 8 * bs;
      round_trip(srv, root, local, name, size, opt);
    }
  }
  xt::check_no_partials(root.path());
  xt::check_no_partials(local.path());
}

TEST_CASE("64 MiB of random bytes with n = 1, 4, 16, both directions") {
  xt::TempDir root, local;
  xt::InProcessServer srv(config_for(root));
  xt::write_random_file(local / "big", 64ull << 20, 7);
  for (unsigned n : {1u, 4u, 16u}) {
    CAPTURE(n);
    xdfs::TransferOptions opt;
    opt.channels = n;
    auto up = xdfs::upload(local / "big", {"127.0.0.1", srv.port()}, "big", opt);
    CHECK(up.channels == n);
    REQUIRE(xt::files_equal(local / "big", root / "big"));
    ::unlink((local / "big.back").c_str());
    xdfs::download({"127.0.0.1", srv.port()}, "big", local / "big.back", opt);
    REQUIRE(xt::files_equal(local / "big", local / "big.back"));
  }
}

TEST_CASE("two sessions at once each get their own file, and really do overlap") {
  xt::TempDir root, local;
  xt::InProcessServer srv(config_for(root));
  xt::write_random_file(local / "a", 24ull << 20, 1);
  xt::write_random_file(local / "b", 24ull << 20, 2);
  // Each session, once it has moved some bytes and not all, waits (bounded) until the other one
  // has too: both are then in the middle of their transfers at the same time.
  std::mutex mu;
  std::condition_variable cv;
  bool mid[2] = {false, false};
  bool overlapped[2] = {false, false};
  auto run = [&](int me, const std::string& name, std::string& error) {
    xdfs::TransferOptions opt;
    opt.channels = 4;
    opt.block_size = 256 * 1024;
    opt.progress_interval = std::chrono::milliseconds(1);
    opt.progress = [&, me](const xdfs::Progress& p) {
      if (p.bytes == 0 || p.bytes >= p.total || mid[me]) return;
      std::unique_lock lk(mu);
      mid[me] = true;
      cv.notify_all();
      overlapped[me] = cv.wait_for(lk, std::chrono::seconds(20), [&] { return mid[1 - me]; });
    };
    try {
      xdfs::upload(local / name, {"127.0.0.1", srv.port()}, name, opt);
    } catch (const std::exception& e) {
      error = e.what();  // never out of a thread: a throw there would end the whole test run
    }
  };
  std::string ea, eb;
  std::thread ta([&] { run(0, "a", ea); });
  std::thread tb([&] { run(1, "b", eb); });
  ta.join();
  tb.join();
  CHECK_MESSAGE(ea.empty(), ea);
  CHECK_MESSAGE(eb.empty(), eb);
  CHECK(overlapped[0]);
  CHECK(overlapped[1]);
  CHECK(xt::files_equal(local / "a", root / "a"));
  CHECK(xt::files_equal(local / "b", root / "b"));
}

TEST_CASE("destinations: a directory takes the remote name; /dev/null and a FIFO are written in place") {
  xt::TempDir root, local;
  xt::InProcessServer srv(config_for(root));
  xt::write_random_file(root / "src.bin", 3 * (1 << 20) + 17, 3);
  xdfs::TransferOptions opt;
  opt.channels = 4;
  opt.block_size = 64 * 1024;
  ::mkdir((local / "dir").c_str(), 0755);
  xdfs::download({"127.0.0.1", srv.port()}, "src.bin", local / "dir", opt);
  CHECK(xt::files_equal(root / "src.bin", local / "dir/src.bin"));

  auto r = xdfs::download({"127.0.0.1", srv.port()}, "src.bin", "/dev/null", opt);
  CHECK(r.bytes == 3 * (1 << 20) + 17);
  struct stat st {};
  REQUIRE(::stat("/dev/null", &st) == 0);
  CHECK(S_ISCHR(st.st_mode));  // never replaced by a regular file

  // A FIFO sees the bytes strictly in order although blocks arrive over 4 channels.
  REQUIRE(::mkfifo((local / "fifo").c_str(), 0600) == 0);
  std::string got;
  std::thread reader([&] {
    int fd = ::open((local / "fifo").c_str(), O_RDONLY);
    char buf[65536];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof buf)) > 0) got.append(buf, static_cast<std::size_t>(n));
    ::close(fd);
  });
  xdfs::download({"127.0.0.1", srv.port()}, "src.bin", local / "fifo", opt);
  reader.join();
  CHECK(got == xt::read_file(root / "src.bin"));
}

TEST_CASE("an upload replaces an existing file only when complete") {
  xt::TempDir root, local;
  xt::InProcessServer srv(config_for(root));
  xt::write_file(root / "target", "old contents");
  xt::write_random_file(local / "new", 1 << 20, 4);
  xdfs::upload(local / "new", {"127.0.0.1", srv.port()}, "target", {});
  CHECK(xt::files_equal(local / "new", root / "target"));
  xt::check_no_partials(root.path());
}

TEST_CASE("a failed download leaves an existing destination untouched and no partial file") {
  xt::TempDir root, local;
  xt::InProcessServer srv(config_for(root));
  xt::write_file(local / "keep", "precious");
  bool remote = false;
  CHECK(xt::error_of([&] { xdfs::download({"127.0.0.1", srv.port()}, "missing", local / "keep", {}); }, &remote) ==
        xdfs::errc::no_such_file);
  CHECK(remote);
  CHECK(xt::read_file(local / "keep") == "precious");
  xt::check_no_partials(local.path());
}

TEST_CASE("errors reach the client with their cause") {
  xt::TempDir root, local;
  auto cfg = config_for(root);
  cfg.max_channels = 8;
  cfg.max_block_size = 1 << 20;
  xt::InProcessServer srv(cfg);
  xt::write_random_file(local / "f", 1000, 5);
  ::mkdir((root / "sub").c_str(), 0755);
  REQUIRE(::symlink("/etc", (root / "etc").c_str()) == 0);
  REQUIRE(::symlink("/etc/passwd", (root / "passwd").c_str()) == 0);
  const xdfs::Endpoint ep{"127.0.0.1", srv.port()};
  bool remote = false;

  SUBCASE("no such remote file") {
    CHECK(xt::error_of([&] { xdfs::download(ep, "nope", local / "x", {}); }, &remote) == xdfs::errc::no_such_file);
    CHECK(remote);
  }
  SUBCASE("'..' escape, absolute path and symlink escape are refused in both directions") {
    for (const char* p : {"../f", "sub/../../f", "/etc/passwd", "etc/passwd", "passwd"}) {
      CAPTURE(p);
      CHECK(xt::error_of([&] { xdfs::download(ep, p, local / "x", {}); }) == xdfs::errc::path_escape);
      CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, p, {}); }) == xdfs::errc::path_escape);
    }
    CHECK_FALSE(xt::exists(local / "x"));
  }
  SUBCASE("upload onto a directory, download of a directory") {
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "sub", {}); }) == xdfs::errc::is_directory);
    CHECK(xt::error_of([&] { xdfs::download(ep, "sub", local / "x", {}); }) == xdfs::errc::is_directory);
  }
  SUBCASE("upload into a missing directory") {
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "no/such/dir/f", {}); }) == xdfs::errc::no_such_file);
  }
  SUBCASE("too many channels, too large a block") {
    xdfs::TransferOptions o;
    o.channels = 9;
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "f", o); }, &remote) == xdfs::errc::limit_exceeded);
    CHECK(remote);
    o.channels = 1;
    o.block_size = 4 << 20;
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "f", o); }) == xdfs::errc::bad_argument);
  }
  SUBCASE("bad local arguments fail before any connection") {
    xdfs::TransferOptions o;
    o.channels = 0;
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "f", o); }) == xdfs::errc::bad_argument);
    CHECK(xt::error_of([&] { xdfs::upload(local / "missing", ep, "f", {}); }) == xdfs::errc::no_such_file);
    CHECK(xt::error_of([&] { xdfs::upload(local.path(), ep, "f", {}); }) == xdfs::errc::is_directory);
    CHECK(xt::error_of([&] { xdfs::download(ep, "f", local / "no/such/dir/x", {}); }) == xdfs::errc::no_such_file);
  }
  SUBCASE("connection refused") {
    // A port held bound and never listening: nobody else can take it while the test runs, and
    // a connection to it is refused.
    int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", {"127.0.0.1", ntohs(a.sin_port)}, "f", {}); }) ==
          xdfs::errc::connection_refused);
    ::close(s);
  }
  xt::check_no_partials(root.path());
  // After every refusal the server still serves.
  xdfs::upload(local / "f", ep, "ok", {});
  CHECK(xt::files_equal(local / "f", root / "ok"));
}

TEST_CASE("cancelling a transfer removes the partial file on both sides") {
  xt::TempDir root, local;
  xt::InProcessServer srv(config_for(root));
  xt::write_random_file(local / "big", 64ull << 20, 9);
  std::atomic<bool> cancel{false};
  xdfs::TransferOptions opt;
  opt.cancel = &cancel;
  opt.progress_interval = std::chrono::milliseconds(1);
  opt.progress = [&](const xdfs::Progress& p) {
    if (p.bytes > 0) cancel = true;
  };
  opt.block_size = 64 * 1024;
  opt.ring_bytes = 256 * 1024;
  CHECK(xt::error_of([&] { xdfs::upload(local / "big", {"127.0.0.1", srv.port()}, "big", opt); }) == xdfs::errc::cancelled);
  // The server learns of it through the exception header and drops its partial file.
  CHECK(srv.wait_for_log("status=error: cancelled"));
  CHECK_FALSE(xt::exists(root / "big"));
  xt::check_no_partials(root.path());

  // A download, likewise: the client's partial file goes, an existing destination stays.
  xt::write_random_file(root / "down", 64ull << 20, 10);
  xt::write_file(local / "down", "the old one");
  cancel = false;
  CHECK(xt::error_of([&] { xdfs::download({"127.0.0.1", srv.port()}, "down", local / "down", opt); }) ==
        xdfs::errc::cancelled);
  CHECK(xt::read_file(local / "down") == "the old one");
  xt::check_no_partials(local.path());
  CHECK(srv.wait_for_log("mode=download path=down"));
}

TEST_CASE("a source file that shrinks while it is sent: the upload fails, naming it, and no file appears") {
  xt::TempDir root, local;
  xt::InProcessServer srv(config_for(root));
  // Read into memory (private; clear with digests), and sent by sendfile (clear without): then
  // nothing reads the file but sendfile, which must see the end itself.
  struct Case {
    xdfs::xsec::Protect protect;
    bool verify;
  };
  for (const Case& c : {Case{xdfs::xsec::Protect::private_, true}, Case{xdfs::xsec::Protect::clear, false},
                        Case{xdfs::xsec::Protect::clear, true}}) {
    CAPTURE(c.verify);
    CAPTURE(static_cast<int>(c.protect));
    xt::write_random_file(local / "f", 32ull << 20, 11);
    DebugLines dbg;
    xdfs::TransferOptions opt;
    opt.protect = c.protect;
    opt.verify = c.verify;
    opt.block_size = 64 * 1024;
    opt.ring_bytes = 256 * 1024;  // the reader stays close behind the network
    opt.loopback_sendfile = true;
    opt.progress_interval = std::chrono::milliseconds(1);
    opt.debug = dbg.sink();
    bool cut = false;
    opt.progress = [&](const xdfs::Progress& p) {
      if (!cut && p.bytes > 0) {
        cut = true;
        REQUIRE(::truncate((local / "f").c_str(), 1 << 20) == 0);
      }
    };
    // Sent by sendfile, the file may shrink while a frame is half out: then that channel
    // closes (nothing may follow half a block) and the server may hear only that. Read first,
    // it shrinks before a frame begins, and the server hears why.
    const bool mid_frame_possible = c.protect == xdfs::xsec::Protect::clear && !c.verify;
    const std::string reason = mid_frame_possible ? "status=error: " : "status=error: size mismatch";
    const auto told_before = srv.wait_for_log_lines(reason, 0);
    std::string what;
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", {"127.0.0.1", srv.port()}, "f", opt); }, nullptr, &what) ==
          xdfs::errc::size_mismatch);
    CHECK_MESSAGE(what.find("source file shrank to") != std::string::npos, what);
    CHECK(srv.wait_for_log_lines(reason, told_before + 1) == told_before + 1);
    CHECK(dbg.has(c.protect != xdfs::xsec::Protect::clear ? "zero copy off: blocks are sealed"
                  : c.verify                                ? "zero copy off: each block is read to make its digest"
                                                            : "zero copy: file data goes to the sockets by sendfile"));
    CHECK_FALSE(xt::exists(root / "f"));
    xt::check_no_partials(root.path());
  }
}

TEST_CASE("zero copy: clear-mode blocks without digests go from the page cache by sendfile and into the file by splice, byte for byte, both ways") {
  xt::TempDir root, local;
  auto cfg = config_for(root);
  cfg.debug = true;
  cfg.loopback_sendfile = true;
  xt::InProcessServer srv(cfg);
  const std::uint32_t bs = 64 * 1024;
  DebugLines dbg;
  for (bool verify : {true, false}) {
    for (std::uint64_t size : {std::uint64_t(0), std::uint64_t(1), std::uint64_t(bs - 1), std::uint64_t(bs),
                               std::uint64_t(7 * bs + 3), std::uint64_t(8u << 20)}) {
      for (unsigned n : {1u, 4u}) {
        CAPTURE(verify);
        CAPTURE(size);
        CAPTURE(n);
        const std::string name = fmt::format("z{}_{}_{}", size, n, verify);
        xt::write_random_file(local / name, size, size * 7 + n);
        xdfs::TransferOptions opt;
        opt.protect = xdfs::xsec::Protect::clear;
        opt.verify = verify;
        opt.channels = n;
        opt.block_size = bs;
        opt.ring_bytes = 8 * bs;
        opt.loopback_sendfile = true;
        opt.debug = dbg.sink();
        dbg.clear();
        const auto [up, down] = round_trip(srv, root, local, name, size, opt);
        CHECK(up.digest == down.digest);
        if (verify) {
          // What is hashed is what is sent: each block is read, and goes from memory.
          CHECK(dbg.has("zero copy off: each block is read to make its digest"));
          CHECK_FALSE(dbg.has("bytes by sendfile"));
        } else {
          // Every byte went by sendfile: none through the pool. And into the files at both
          // ends by splice, none read into a slot.
          CHECK(dbg.has(fmt::format("zero copy: {} bytes by sendfile", size)));
          CHECK(srv.wait_for_log(fmt::format("debug: zero copy: {} bytes by sendfile", size)));
          CHECK(dbg.has("zero copy in: payloads go from the sockets into the file by splice"));
          CHECK(dbg.has(fmt::format("zero copy in: {} bytes by splice", size)));
          CHECK(srv.wait_for_log(fmt::format("debug: zero copy in: {} bytes by splice", size)));
        }
      }
    }
  }
  xt::check_no_partials(root.path());
  xt::check_no_partials(local.path());
}

TEST_CASE("zero copy in: blocks spliced whole reach the disk thread in batches without a stall, at every pool size, channel count and both ways") {
  xt::TempDir root, local;
  auto cfg = config_for(root);
  xt::InProcessServer srv(cfg);
  const std::uint32_t bs = 64 * 1024;
  const std::uint64_t size = 40ull * bs + 5;
  for (const std::uint32_t slots : {7u, 8u, 9u, 12u, 33u}) {
    for (const unsigned n : {1u, 3u, 8u}) {
      CAPTURE(slots);
      CAPTURE(n);
      const std::string name = fmt::format("b{}_{}", slots, n);
      xt::write_random_file(local / name, size, slots * 10 + n);
      xdfs::TransferOptions opt;
      opt.protect = xdfs::xsec::Protect::clear;
      opt.verify = false;
      opt.channels = n;
      opt.block_size = bs;
      opt.ring_bytes = std::uint64_t(slots) * bs;
      const auto [up, down] = round_trip(srv, root, local, name, size, opt);
      CHECK(up.digest == down.digest);
    }
  }
  xt::check_no_partials(root.path());
  xt::check_no_partials(local.path());
}

TEST_CASE("zero copy: a peer on this host is sent blocks read first, both ways, unless loopback_sendfile says otherwise; splice still takes them in") {
  xt::TempDir root, local;
  auto cfg = config_for(root);
  cfg.debug = true;
  xt::InProcessServer srv(cfg);
  const std::uint64_t size = (5u << 20) + 77;
  xt::write_random_file(local / "f", size, 31);
  DebugLines dbg;
  xdfs::TransferOptions opt;
  opt.protect = xdfs::xsec::Protect::clear;
  opt.verify = false;
  opt.channels = 2;
  opt.block_size = 256 * 1024;
  opt.debug = dbg.sink();
  const std::string why = "zero copy off: the peer is on this host";
  xdfs::upload(local / "f", {"127.0.0.1", srv.port()}, "f", opt);
  CHECK(xt::files_equal(local / "f", root / "f"));
  CHECK(dbg.has(why));
  CHECK_FALSE(dbg.has("bytes by sendfile"));
  CHECK(srv.wait_for_log(fmt::format("debug: zero copy in: {} bytes by splice", size)));
  dbg.clear();
  xdfs::download({"127.0.0.1", srv.port()}, "f", local / "back", opt);
  CHECK(xt::files_equal(local / "f", local / "back"));
  CHECK(srv.wait_for_log(why));
  CHECK(srv.wait_for_log_lines("bytes by sendfile", 1, 2000) == 0);  // nor later
  CHECK(dbg.has(fmt::format("zero copy in: {} bytes by splice", size)));
  // The client's own setting sends its upload by sendfile; the server's stays as it was.
  opt.loopback_sendfile = true;
  dbg.clear();
  xdfs::upload(local / "f", {"127.0.0.1", srv.port()}, "f2", opt);
  CHECK(xt::files_equal(local / "f", root / "f2"));
  CHECK(dbg.has(fmt::format("zero copy: {} bytes by sendfile", size)));
  CHECK_FALSE(dbg.has(why));
  xt::check_no_partials(root.path());
  xt::check_no_partials(local.path());
}

TEST_CASE("XDSI: unmapped gives an IPv4 address mapped into IPv6 as the IPv4 one, and any other as it is") {
  namespace asio = boost::asio;
  const auto u = xdfs::xdsi::unmapped(asio::ip::make_address("::ffff:10.1.2.3"));
  CHECK(u.is_v4());
  CHECK(u == asio::ip::make_address("10.1.2.3"));
  for (const char* a : {"10.1.2.3", "::1", "fd00::ffff:a01:203", "::a01:203"}) {
    CAPTURE(a);
    CHECK(xdfs::xdsi::unmapped(asio::ip::make_address(a)) == asio::ip::make_address(a));
  }
}

TEST_CASE("XDSI: splice pipes hold a whole 1 MiB block while the process's stay within a quarter of the per-user pipe page limit; then 256 KiB") {
  std::size_t max = 0, soft = 0;
  std::ifstream("/proc/sys/fs/pipe-max-size") >> max;
  std::ifstream("/proc/sys/fs/pipe-user-pages-soft") >> soft;
  CAPTURE(max);
  CAPTURE(soft);
  const bool privileged = ::geteuid() == 0;
  const std::size_t budget = soft == 0 ? SIZE_MAX : soft * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) / 4;
  const std::size_t before = xdfs::xdsi::splice_pipe_bytes_held();
  // Threads that each make their pipe and keep it until all have one: more 1 MiB ones than the
  // budget has room for, where it is finite and not too large to try here.
  const std::size_t n = budget / (1u << 20) + 4 <= 256 ? budget / (1u << 20) + 4 : 8;
  std::vector<std::size_t> got(n);
  {
    std::latch all(static_cast<std::ptrdiff_t>(n));
    std::vector<std::thread> ts;
    for (std::size_t i = 0; i < n; ++i)
      ts.emplace_back([&, i] {
        got[i] = xdfs::xdsi::splice_pipe_bytes();
        CHECK(xdfs::xdsi::splice_pipe_bytes() == got[i]);  // one a thread: the same pipe again
        all.arrive_and_wait();
      });
    for (auto& t : ts) t.join();
  }
  std::size_t large = 0, held = before;
  for (const auto g : got) {
    CAPTURE(g);
    if (privileged || max >= (1u << 20)) {
      // In order of making, unknown: count instead. A large one only within the budget.
      CHECK((g == (1u << 20) || g == (256u << 10)));
    } else {
      CHECK(g >= 64u * 1024);
      CHECK(g <= (256u << 10));
    }
    large += g == (1u << 20);
    held += g;
  }
  if (privileged || max >= (1u << 20)) {
    // Every thread that found room took 1 MiB, and no more did: a pipe only adds to what is
    // held, so once the room is gone it stays gone until they end.
    const std::size_t room = budget == SIZE_MAX ? n : (budget - std::min(budget, before)) / (1u << 20);
    CHECK(large == std::min(n, room));
  }
  // Each pipe went with its thread.
  CHECK(xdfs::xdsi::splice_pipe_bytes_held() == before);
  CHECK(held > before);
}

TEST_CASE("XDSI: peer_on_this_host is true over loopback (IPv4, IPv6 where there is one) and false unconnected") {
  namespace asio = boost::asio;
  using tcp = asio::ip::tcp;
  asio::io_context io;
  for (const char* host : {"127.0.0.1", "127.0.0.2", "::1"}) {
    CAPTURE(host);
    boost::system::error_code ec;
    tcp::acceptor acc(io);
    const tcp::endpoint at(asio::ip::make_address(host), 0);
    acc.open(at.protocol(), ec);
    if (!ec) acc.bind(at, ec);
    if (ec && at.address().is_v6()) continue;  // no IPv6 loopback here
    REQUIRE_FALSE(ec);
    acc.listen();
    tcp::socket near(io);
    near.connect(acc.local_endpoint());
    tcp::socket far = acc.accept();
    xdfs::xdsi::Channel a(std::move(near), 0), b(std::move(far), 1);
    CHECK(a.peer_on_this_host());
    CHECK(b.peer_on_this_host());
  }
  xdfs::xdsi::Channel unconnected(tcp::socket(io), 0);
  CHECK_FALSE(unconnected.peer_on_this_host());
}

TEST_CASE("zero copy falls back to reading blocks, saying why: a setting, sealed blocks, a FIFO") {
  xt::TempDir root, local;
  auto cfg = config_for(root);
  cfg.debug = true;
  cfg.zero_copy = false;
  xt::InProcessServer srv(cfg);
  xt::write_random_file(local / "f", (3u << 20) + 5, 21);
  DebugLines dbg;
  xdfs::TransferOptions opt;
  opt.block_size = 64 * 1024;
  opt.debug = dbg.sink();
  struct Case {
    xdfs::xsec::Protect protect;
    bool zero_copy;
    const char* why;
  };
  for (const Case& c : {Case{xdfs::xsec::Protect::clear, false, "zero copy off: switched off by a setting"},
                        Case{xdfs::xsec::Protect::integrity, true, "zero copy off: blocks are sealed"},
                        Case{xdfs::xsec::Protect::private_, true, "zero copy off: blocks are sealed"}}) {
    CAPTURE(c.why);
    opt.protect = c.protect;
    opt.zero_copy = c.zero_copy;
    dbg.clear();
    xdfs::upload(local / "f", {"127.0.0.1", srv.port()}, "f", opt);
    CHECK(xt::files_equal(local / "f", root / "f"));
    CHECK(dbg.has(c.why));
    CHECK_FALSE(dbg.has("bytes by sendfile"));
  }
  // The server's own setting: a clear download is read into memory, not sent by sendfile.
  opt.protect = xdfs::xsec::Protect::clear;
  opt.zero_copy = true;
  xdfs::download({"127.0.0.1", srv.port()}, "f", local / "back", opt);
  CHECK(xt::files_equal(local / "f", local / "back"));
  CHECK(srv.wait_for_log("debug: zero copy off: switched off by a setting"));
  // A FIFO is a stream: read, not sent from a file.
  REQUIRE(::mkfifo((local / "fifo").c_str(), 0600) == 0);
  std::thread writer([&] {
    int fd = ::open((local / "fifo").c_str(), O_WRONLY);
    const std::string data = xt::read_file(local / "f");
    std::size_t at = 0;
    while (fd >= 0 && at < data.size()) {
      const ssize_t w = ::write(fd, data.data() + at, data.size() - at);
      if (w <= 0) break;
      at += static_cast<std::size_t>(w);
    }
    if (fd >= 0) ::close(fd);
  });
  dbg.clear();
  xdfs::upload(local / "fifo", {"127.0.0.1", srv.port()}, "from-fifo", opt);
  writer.join();
  CHECK(xt::files_equal(local / "f", root / "from-fifo"));
  CHECK(dbg.has("zero copy off: a stream"));
  xt::check_no_partials(root.path());
}

TEST_CASE("zero copy in: a receiver that discards (memory mode, /dev/null) takes clear blocks without digests by splice, and says why not otherwise") {
  xt::TempDir root, local;
  auto cfg = config_for(root);
  cfg.debug = true;
  cfg.allow_memory_mode = true;
  xt::InProcessServer srv(cfg);
  const std::uint32_t bs = 64 * 1024;
  DebugLines dbg;
  xdfs::TransferOptions opt;
  opt.protect = xdfs::xsec::Protect::clear;
  opt.verify = false;
  opt.block_size = bs;
  opt.ring_bytes = 8 * bs;
  opt.debug = dbg.sink();
  // Every payload byte skipped by splice, and the frames after them (more blocks, the EOFRs,
  // whose MACs count the skipped frames too) read as they were sent: the transfers complete.
  for (std::uint64_t size : {std::uint64_t(1), std::uint64_t(bs), std::uint64_t(7 * bs + 3), std::uint64_t(8u << 20)}) {
    for (unsigned n : {1u, 4u}) {
      CAPTURE(size);
      CAPTURE(n);
      opt.channels = n;
      opt.memory = true;
      opt.memory_size = size;
      dbg.clear();
      CHECK(xdfs::download({"127.0.0.1", srv.port()}, "m", "/dev/null", opt).bytes == size);
      CHECK(dbg.has(fmt::format("zero copy in: {} bytes by splice", size)));
      CHECK(xdfs::upload("/dev/zero", {"127.0.0.1", srv.port()}, "m", opt).bytes == size);
      CHECK(srv.wait_for_log(fmt::format("debug: zero copy in: {} bytes by splice", size)));
      // A file's blocks to /dev/null: skipped the same way.
      opt.memory = false;
      const std::string name = fmt::format("n{}_{}", size, n);
      xt::write_random_file(root / name, size, size + n);
      dbg.clear();
      CHECK(xdfs::download({"127.0.0.1", srv.port()}, name, "/dev/null", opt).bytes == size);
      CHECK(dbg.has(fmt::format("zero copy in: {} bytes by splice", size)));
    }
  }
  // Where the bytes are needed, they are read, and the debug line says why.
  opt.channels = 2;
  opt.memory = false;
  xt::write_random_file(root / "f", (3u << 20) + 5, 31);
  struct Case {
    xdfs::xsec::Protect protect;
    bool verify;
    bool zero_copy;
    const char* to;
    const char* why;
  };
  for (const Case& c : {Case{xdfs::xsec::Protect::clear, false, false, "/dev/null", "zero copy in off: switched off by a setting"},
                        Case{xdfs::xsec::Protect::clear, true, true, "/dev/null", "zero copy in off: blocks carry digests to check"},
                        Case{xdfs::xsec::Protect::private_, false, true, "/dev/null", "zero copy in off: blocks are sealed"},
                        Case{xdfs::xsec::Protect::integrity, false, true, "/dev/null", "zero copy in off: blocks are sealed"},
                        Case{xdfs::xsec::Protect::clear, false, false, "file", "zero copy in off: switched off by a setting"},
                        Case{xdfs::xsec::Protect::clear, true, true, "file", "zero copy in off: blocks carry digests to check"},
                        Case{xdfs::xsec::Protect::private_, false, true, "file", "zero copy in off: blocks are sealed"},
                        Case{xdfs::xsec::Protect::clear, false, true, "fifo", "zero copy in off: the sink takes its bytes in order"}}) {
    CAPTURE(c.why);
    CAPTURE(c.to);
    opt.protect = c.protect;
    opt.verify = c.verify;
    opt.zero_copy = c.zero_copy;
    dbg.clear();
    const std::string to_name(c.to);
    const auto to = to_name == "file" ? (local / "back") : to_name == "fifo" ? (local / "fifo") : std::string(c.to);
    std::string from_fifo;
    std::thread reader;
    if (to_name == "fifo") {
      REQUIRE(::mkfifo(to.c_str(), 0600) == 0);
      reader = std::thread([&] {
        const int fd = ::open(to.c_str(), O_RDONLY | O_CLOEXEC);
        char buf[65536];
        for (ssize_t r; fd >= 0 && (r = ::read(fd, buf, sizeof buf)) > 0;) from_fifo.append(buf, static_cast<std::size_t>(r));
        if (fd >= 0) ::close(fd);
      });
    }
    CHECK(xdfs::download({"127.0.0.1", srv.port()}, "f", to, opt).bytes == (3u << 20) + 5);
    if (reader.joinable()) {
      reader.join();
      CHECK(from_fifo == xt::read_file(root / "f"));
      ::unlink(to.c_str());
    }
    CHECK(dbg.has(c.why));
    CHECK_FALSE(dbg.has("bytes by splice"));
    if (to_name == "file") CHECK(xt::files_equal(root / "f", local / "back"));
  }
}

namespace {
// Installs, on the calling thread only (and so on the processes it starts from now on), a
// system call filter under which splice(2) into a file (one with an output offset) fails with
// EINVAL, as on a file system that takes no splice, unless it moves exactly `allowed` bytes.
// False where this build does not know its architecture's filter number.
bool refuse_file_splices(std::uint32_t allowed) {
#if defined(__x86_64__)
  constexpr std::uint32_t arch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
  constexpr std::uint32_t arch = AUDIT_ARCH_AARCH64;
#else
  return false;
#endif
  const auto at = [](std::size_t arg, bool high) {
    return static_cast<std::uint32_t>(offsetof(seccomp_data, args) + arg * 8 + (high ? 4 : 0));
  };
  sock_filter f[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, arch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_splice, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, at(3, false)),  // off_out: none for a pipe or /dev/null
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 2),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, at(3, true)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 3, 0),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, at(4, false)),  // len
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, allowed, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EINVAL),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof f / sizeof f[0]), f};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

// An xdfsd whose file splices refuse as refuse_file_splices(allowed) says (the filter stays on
// a thread of its own, which ends once xdfsd has started).
std::unique_ptr<xt::XdfsdProcess> xdfsd_refusing_splices(const std::string& root, std::uint32_t allowed,
                                                          std::vector<std::string> args) {
  std::unique_ptr<xt::XdfsdProcess> d;
  bool filtered = false;
  std::thread([&] {
    filtered = refuse_file_splices(allowed);
    if (filtered) d = std::make_unique<xt::XdfsdProcess>(root, std::move(args));
  }).join();
  return d;
}
}  // namespace

TEST_CASE("zero copy in: where the file stops taking splices, the rest of the block and every block after it are read and written; nothing is lost") {
  const std::uint32_t bs = 64 * 1024;
  SUBCASE("from the first block: an upload of many blocks over 4 channels") {
    xt::TempDir root, local;
    auto d = xdfsd_refusing_splices(root.path(), 0xffffffffu, {"--debug"});
    REQUIRE(d);
    const std::uint64_t size = (3u << 20) + 5;
    xt::write_random_file(local / "f", size, 41);
    xdfs::TransferOptions opt;
    opt.protect = xdfs::xsec::Protect::clear;
    opt.verify = false;
    opt.channels = 4;
    opt.block_size = bs;
    CHECK(xdfs::upload(local / "f", {"127.0.0.1", d->port()}, "f", opt).bytes == size);
    CHECK(xt::files_equal(local / "f", root / "f"));
    CHECK_MESSAGE(d->wait_for_log("debug: zero copy in: 0 bytes by splice; read instead from then on: the file does not take "
                                  "splice: Invalid argument"),
                  d->log());
    xt::check_no_partials(root.path());
  }
  SUBCASE("in the middle of a block: its first bytes are in the file, the rest comes from its slot") {
    // The filter lets exactly 1000 bytes go into the file at a time: the block's first 1000
    // bytes come alone and go by splice, the next 3000 are refused in the pipe and read back.
    xt::TempDir root;
    auto d = xdfsd_refusing_splices(root.path(), 1000, {"--debug", "--idle-timeout", "600"});
    REQUIRE(d);
    const std::uint64_t size = 4000;
    auto h = xt::make_hello(xdfs::Mode::upload, "f", 1, size);
    xt::RawChannel c(d->port());
    REQUIRE(c.establish(h));
    auto reply = c.read_frame();
    REQUIRE(reply.has_value());
    REQUIRE(reply->first.event == xdfs::wire::ChannelEvent::nego_reply);
    REQUIRE(d->wait_for_log("zero copy in: payloads go from the sockets into the file by splice"));
    std::vector<std::uint8_t> data(size);
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>(i * 7 + 3);
    c.pause_after = xdfs::wire::frame_header_size + 1000;
    c.send_block(xdfs::wire::ChannelEvent::xftsmu, 0, data);
    c.send_frame(xt::eofr_header(size));
    auto done = c.read_frame();
    while (done && done->first.event == xdfs::wire::ChannelEvent::ack) done = c.read_frame();
    REQUIRE_MESSAGE(done.has_value(), d->log());
    CHECK(done->first.event == xdfs::wire::ChannelEvent::eofr);
    CHECK(done->first.offset == size);
    CHECK(xt::read_file(root / "f") == std::string(data.begin(), data.end()));
    CHECK_MESSAGE(d->wait_for_log("debug: zero copy in: 1000 bytes by splice; read instead from then on: the file does "
                                  "not take splice: Invalid argument"),
                  d->log());
    REQUIRE(d->alive());
  }
}

TEST_CASE("zero copy in: urgent data in the middle of a block does not stall the splice; the stream around it arrives whole") {
  // splice(2) from a TCP socket stops at the urgent mark and then finds nothing, however long
  // it waits: a peer could hold the channel until the idle timeout. The receiver reads past
  // the mark instead (recv leaves the out-of-band byte out of the stream) and the upload
  // completes, every byte before the mark and after that payload skipped by splice.
  xt::TempDir root;
  xt::XdfsdProcess d(root.path(), {"--allow-memory-mode", "--debug", "--idle-timeout", "600"});
  const std::uint32_t bs = 64 * 1024;
  const std::uint64_t size = 3 * bs;
  auto h = xt::make_hello(xdfs::Mode::upload, "m", 1, size);
  h.nego.extended_flags = xdfs::wire::flag_memory;
  xt::RawChannel c(d.port());
  REQUIRE(c.establish(h));
  auto reply = c.read_frame();
  REQUIRE(reply.has_value());
  REQUIRE(reply->first.event == xdfs::wire::ChannelEvent::nego_reply);
  REQUIRE(d.wait_for_log("zero copy in: payloads go from the sockets into /dev/null by splice"));
  const std::size_t mark = bs / 2 + 7;  // into the second block's payload
  for (std::uint64_t off = 0; off < size; off += bs) {
    if (off == bs) {
      // The first block is in and skipped: the second's bytes up to the mark come alone.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      c.urgent_before = xdfs::wire::frame_header_size + mark;
    }
    c.send_block(xdfs::wire::ChannelEvent::xftsmu, off, std::vector<std::uint8_t>(bs, static_cast<std::uint8_t>(off >> 16)));
  }
  xdfs::wire::FrameHeader eofr;
  eofr.event = xdfs::wire::ChannelEvent::eofr;
  c.send_frame(eofr);  // its MAC counts the skipped frames: one byte too many or too few breaks it
  auto done = c.read_frame();
  while (done && done->first.event == xdfs::wire::ChannelEvent::ack) done = c.read_frame();
  REQUIRE_MESSAGE(done.has_value(), d.log());
  CHECK(done->first.event == xdfs::wire::ChannelEvent::eofr);
  CHECK(done->first.offset == size);
  // Read instead from the mark to the end of that payload; spliced before and after it.
  CHECK_MESSAGE(d.wait_for_log(fmt::format("debug: zero copy in: {} bytes by splice", size - (bs - mark))), d.log());
  REQUIRE(d.alive());
}

TEST_CASE("frames that arrive a byte at a time are put together: an upload and a path request") {
  xt::TempDir root;
  xt::XdfsdProcess d(root.path());
  const std::uint32_t bs = 64 * 1024;
  const auto data = xt::random_bytes(2 * bs + 77, 12);
  auto h = xt::make_hello(xdfs::Mode::upload, "slow", 1, data.size());
  h.opening.protect = 2;  // private: every frame tagged and encrypted, the blocks too
  xt::RawChannel c(d.port());
  c.trickle = true;  // every byte its own send (and, with TCP_NODELAY, its own segment)
  REQUIRE(c.establish(h));
  auto reply = c.read_frame();
  REQUIRE(reply.has_value());
  REQUIRE(reply->first.event == xdfs::wire::ChannelEvent::nego_reply);
  for (std::uint64_t off = 0; off < data.size(); off += bs)
    c.send_block(xdfs::wire::ChannelEvent::xftsmu, off,
                 std::vector<std::uint8_t>(data.begin() + static_cast<long>(off),
                                           data.begin() + static_cast<long>(std::min<std::uint64_t>(off + bs, data.size()))));
  xdfs::wire::FrameHeader eofr;
  eofr.event = xdfs::wire::ChannelEvent::eofr;
  c.send_frame(eofr);
  auto done = c.read_frame();
  while (done && done->first.event == xdfs::wire::ChannelEvent::ack) done = c.read_frame();
  REQUIRE(done.has_value());
  // The server's EOFR: the file is committed and the channel stays for the next operation.
  CHECK(done->first.event == xdfs::wire::ChannelEvent::eofr);
  CHECK(done->first.offset == data.size());
  CHECK(xt::read_file(root / "slow") == std::string(data.begin(), data.end()));

  xt::RawChannel p(d.port());
  p.trickle = true;
  auto ph = xt::make_hello(xdfs::Mode::path, ".", 1);
  REQUIRE(p.establish(ph));
  REQUIRE(p.read_frame().has_value());
  xdfs::pathm::Request r;
  r.id = 5;
  r.op = xdfs::pathm::Op::stat;
  r.path = "slow";
  auto enc = xdfs::pathm::encode(r);
  xdfs::wire::FrameHeader fh;
  fh.event = xdfs::wire::ChannelEvent::xpathm;
  fh.length = static_cast<std::uint32_t>(enc.size);
  auto b = enc.bytes();
  p.send_frame(fh, std::vector<std::uint8_t>(b.begin(), b.end()));
  auto answer = p.read_frame();
  REQUIRE(answer.has_value());
  REQUIRE(answer->first.event == xdfs::wire::ChannelEvent::xpathm);
  std::vector<std::uint64_t> words((answer->second.size() + 7) / 8);
  std::memcpy(words.data(), answer->second.data(), answer->second.size());
  auto rep = xdfs::pathm::decode_reply({reinterpret_cast<const std::uint8_t*>(words.data()), answer->second.size()});
  REQUIRE(rep.has_value());
  CHECK(rep->id == 5);
  REQUIRE(rep->entries.size() == 1);
  CHECK(rep->entries[0].size == data.size());
}

}  // TEST_SUITE

TEST_SUITE("transfer") {

TEST_CASE("memory-to-memory mode moves bytes without touching a file, only where allowed") {
  xt::TempDir root;
  auto cfg = config_for(root);
  xdfs::TransferOptions opt;
  opt.memory = true;
  opt.memory_size = (48ull << 20) + 5;
  opt.channels = 4;
  {
    xt::InProcessServer refusing(cfg);
    CHECK(xt::error_of([&] { xdfs::upload("/dev/zero", {"127.0.0.1", refusing.port()}, "m", opt); }) ==
          xdfs::errc::bad_argument);
  }
  cfg.allow_memory_mode = true;
  xt::InProcessServer srv(cfg);
  auto up = xdfs::upload("/dev/zero", {"127.0.0.1", srv.port()}, "m", opt);
  CHECK(up.bytes == opt.memory_size);
  auto down = xdfs::download({"127.0.0.1", srv.port()}, "m", "/dev/null", opt);
  CHECK(down.bytes == opt.memory_size);
  CHECK(xt::list_dir(root.path()).empty());
  CHECK(srv.wait_for_log("mode=download path=m channels=4 bytes=50331653"));
}

TEST_CASE("a memory source sends clear blocks from the zero page, not from its slots; sealed blocks from their slots") {
  xt::TempDir root;
  auto cfg = config_for(root);
  cfg.debug = true;
  cfg.allow_memory_mode = true;
  xt::InProcessServer srv(cfg);
  const std::uint32_t bs = 64 * 1024;
  DebugLines dbg;
  xdfs::TransferOptions opt;
  opt.block_size = bs;
  opt.ring_bytes = 8 * bs;
  opt.memory = true;
  opt.debug = dbg.sink();
  for (auto protect : {xdfs::xsec::Protect::clear, xdfs::xsec::Protect::integrity, xdfs::xsec::Protect::private_}) {
    for (std::uint64_t size : {std::uint64_t(1), std::uint64_t(bs), std::uint64_t(7 * bs + 3), std::uint64_t(3u << 20)}) {
      for (unsigned n : {1u, 4u}) {
        CAPTURE(xdfs::xsec::to_string(protect));
        CAPTURE(size);
        CAPTURE(n);
        opt.protect = protect;
        opt.channels = n;
        opt.memory_size = size;
        // Sealed blocks are sealed in their slots: none from the zero page.
        const std::string said =
            fmt::format("memory source: {} bytes from the zero page", protect == xdfs::xsec::Protect::clear ? size : 0);
        dbg.clear();
        CHECK(xdfs::upload("/dev/zero", {"127.0.0.1", srv.port()}, "m", opt).bytes == size);
        CHECK_MESSAGE(dbg.has(said), said);
        // The server's sender says it after the client has all it needs: a bounded wait.
        const std::size_t before = srv.wait_for_log_lines(said, 0);
        CHECK(xdfs::download({"127.0.0.1", srv.port()}, "m", "/dev/null", opt).bytes == size);
        CHECK_MESSAGE(srv.wait_for_log_lines(said, before + 1) == before + 1, said);
      }
    }
  }
}

TEST_CASE("XDSI: send_zeros puts the header and that many zero bytes on the wire; a sealed event is refused") {
  namespace asio = boost::asio;
  Loopback lb;
  auto& ch = *lb.channels[0];
  xdfs::wire::FrameHeader h;
  h.event = xdfs::wire::ChannelEvent::xftsmu;
  for (std::uint32_t len : {0u, 1u, 4096u, (3u << 20) + 5}) {
    CAPTURE(len);
    h.length = len;
    h.offset = 7ull * len;
    // Filled with something else first: what is read must be the header, then len zeros.
    std::vector<std::uint8_t> got(xdfs::wire::frame_header_size + len, 0xa5);
    boost::system::error_code sent = asio::error::would_block, arrived = asio::error::would_block;
    asio::async_read(lb.peer, asio::buffer(got), [&](const boost::system::error_code& ec, std::size_t) { arrived = ec; });
    const auto before = ch.zero_page_bytes();
    REQUIRE(xdfs::xdsi::Channel::zeros_available(len));
    ch.send_zeros(h, [&](const boost::system::error_code& ec) { sent = ec; });
    lb.ctx.restart();
    lb.ctx.run_for(std::chrono::seconds(30));
    REQUIRE_FALSE(arrived);
    CHECK_FALSE(sent);
    CHECK(ch.zero_page_bytes() - before == len);
    const auto head = xdfs::wire::decode(std::span<const std::uint8_t, xdfs::wire::frame_header_size>(got.data(), xdfs::wire::frame_header_size));
    REQUIRE(head.has_value());
    CHECK(head->event == h.event);
    CHECK(head->length == len);
    CHECK(head->offset == h.offset);
    CHECK(std::all_of(got.begin() + xdfs::wire::frame_header_size, got.end(), [](std::uint8_t b) { return b == 0; }));
  }
  // On a channel whose data frames are sealed the zero page cannot be encrypted in place.
  xdfs::xsec::Key32 a{}, b{};
  a[0] = 1;
  b[0] = 2;
  ch.protect(std::make_unique<xdfs::xsec::FrameProtector>(xdfs::xsec::Protect::private_, xdfs::xsec::Cipher::aes256gcm, a, b));
  h.length = 16;
  CHECK_THROWS_AS(ch.send_zeros(h, [](const boost::system::error_code&) {}), std::logic_error);
  CHECK_FALSE(ch.sending());
}

TEST_CASE("a failing receiver's disk thread is stopped before its host closes the file") {
  // The engine in process, over a real loopback channel, writing to a real file through a disk
  // that takes 20 ms per write. The peer sends 16 blocks that are written one by one (no two are
  // contiguous), then hangs up: the transfer fails with blocks still queued. Its host then closes
  // the file, and the descriptor is free for any other session's file: the disk thread must not
  // write after that moment.
  namespace asio = boost::asio;
  using asio::ip::tcp;
  using namespace xdfs::xftsm;
  constexpr std::uint32_t bs = 65536;
  constexpr std::uint32_t blocks = 16;

  struct Host final : TransferHost {
    std::atomic<bool> told{false};
    xdfs::errc code = xdfs::errc::ok;
    xdfs::Failure failure;
    void finished(const xdfs::Failure& f) override {
      code = f.code;
      failure = f;
      told = true;
    }
  } host;
  struct SlowIo final : xdfs::piod::DiskIo {
    const std::atomic<bool>* told = nullptr;
    std::atomic<int> calls{0}, late{0};
    ssize_t pwritev(int fd, const iovec* iov, int n, off_t off) override {
      ++calls;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (told->load()) ++late;
      return ::pwritev(fd, iov, n, off);
    }
  } io;
  io.told = &host.told;

  xt::TempDir dir;
  const int fd = ::open((dir / "part").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  Loopback lb;
  auto& ctx = lb.ctx;
  auto& peer = lb.peer;
  auto& channels = lb.channels;
  Machine machine = joined_upload(table(Role::server_upload));
  TransferParams p;
  p.block_size = bs;
  p.file_size = std::uint64_t(2) * blocks * bs;
  p.slots = blocks;
  {
    Receiver receiver(ctx, machine, channels, host, p, xdfs::piod::Sink{fd, true, false, nullptr, &io});
    receiver.start();
    std::thread sender([&] {
      const std::vector<std::uint8_t> payload(bs, 0x5a);
      for (std::uint32_t i = 0; i < blocks; ++i) {
        xdfs::wire::FrameHeader h;
        h.event = xdfs::wire::ChannelEvent::xftsmu;
        h.length = bs;
        h.offset = std::uint64_t(i) * 2 * bs;
        const auto head = xdfs::wire::encode(h);
        boost::system::error_code ec;
        asio::write(peer, std::array{asio::buffer(head), asio::buffer(payload)}, ec);
        if (ec) return;
      }
      // Hang up once the disk thread is inside a write (bounded): the failure must catch it
      // there, with blocks still queued, not before its first write began.
      for (int i = 0; i < 1000 && io.calls.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      boost::system::error_code ec;
      peer.shutdown(tcp::socket::shutdown_send, ec);
    });
    for (int i = 0; i < 1000 && !host.told; ++i) ctx.run_for(std::chrono::milliseconds(10));
    sender.join();
    REQUIRE(host.told);
    CHECK(host.code == xdfs::errc::peer_aborted);
    // Where and how: the channel the sender left, which nothing can be told any more.
    CHECK(host.failure.channel == xdfs::ChannelIndex(0));
    CHECK(host.failure.peer_gone);
    CHECK(host.failure.message == "channel 0 closed by the client");
    CHECK(machine.state() == State::failed);
  }
  ::close(fd);
  CHECK(io.calls >= 1);
  CHECK(io.late == 0);
}

TEST_CASE("a receiver without digests fails a peer that spreads its blocks into more runs apart than a manifest lets wait") {
  // Every other block of a large file, without a manifest: each is a run of its own. The
  // receiver keeps as many runs as a manifest lets blocks wait (64Ki for a small pool), and
  // fails the transfer at the next, naming it, instead of growing its record of them.
  namespace asio = boost::asio;
  using asio::ip::tcp;
  using namespace xdfs::xftsm;
  constexpr std::uint32_t bs = xdfs::wire::min_block_size;
  std::uint64_t allowed = 65536;
  std::size_t set = 0;
  SUBCASE("the engine's own bound") {}
  SUBCASE("the bound a server set (what its budget had room for)") { allowed = set = 1000; }
  struct Host final : TransferHost {
    std::atomic<bool> told{false};
    xdfs::Failure failure;
    void finished(const xdfs::Failure& f) override {
      failure = f;
      told = true;
    }
  } host;
  Loopback lb;
  auto& peer = lb.peer;
  Machine machine = joined_upload(table(Role::server_upload));
  TransferParams p;
  p.block_size = bs;
  p.file_size = 2 * (allowed + 4) * bs;
  p.slots = 8;
  p.max_apart = set;
  Receiver receiver(lb.ctx, machine, lb.channels, host, p, xdfs::piod::Sink{-1, true, true});
  receiver.start();
  std::atomic<std::uint64_t> sent{0};
  std::thread sender([&] {
    const std::vector<std::uint8_t> payload(bs, 0x5a);
    for (std::uint64_t i = 0; i < allowed + 4; ++i) {
      xdfs::wire::FrameHeader h;
      h.event = xdfs::wire::ChannelEvent::xftsmu;
      h.length = bs;
      h.offset = 2 * i * bs;
      const auto head = xdfs::wire::encode(h);
      boost::system::error_code ec;
      asio::write(peer, std::array{asio::buffer(head), asio::buffer(payload)}, ec);
      if (ec) return;
      ++sent;
    }
  });
  for (int i = 0; i < 6000 && !host.told; ++i) lb.ctx.run_for(std::chrono::milliseconds(10));
  ::shutdown(peer.native_handle(), SHUT_RDWR);  // the sender's writes end, whatever the receiver does
  sender.join();
  REQUIRE(host.told);
  CHECK(host.failure.code == xdfs::errc::protocol_error);
  CHECK_MESSAGE(host.failure.message.find(fmt::format("blocks arrive in more than {} runs apart", allowed)) != std::string::npos,
                host.failure.message);
  CHECK(host.failure.offset == xdfs::FileOffset(2 * allowed * bs));  // the first block past them
  CHECK(sent.load() >= allowed + 1);
  CHECK(machine.state() == State::failed);
}

TEST_CASE("XDSI names what ended a read in one place: the code, the channel, whether the peer is gone") {
  using xdfs::errc;
  namespace asio = boost::asio;
  using asio::ip::tcp;
  Loopback lb(3);
  auto& ctx = lb.ctx;
  auto& peer = lb.peer;
  auto& ch = *lb.channels[0];
  auto read = [&] {
    boost::system::error_code got;
    bool called = false;
    ch.async_read_header([&](const boost::system::error_code& ec, const xdfs::wire::FrameHeader&) {
      got = ec;
      called = true;
    });
    ctx.restart();
    ctx.run();
    REQUIRE(called);
    return got;
  };
  // A header that does not decode: the peer's fault, but it is still there to be told.
  const std::vector<std::uint8_t> garbage(xdfs::wire::frame_header_size, 0xff);
  asio::write(peer, asio::buffer(garbage));
  auto f = ch.failure(read(), "server");
  CHECK(f.code == errc::protocol_error);
  CHECK(f.channel == xdfs::ChannelIndex(3));
  CHECK_FALSE(f.peer_gone);
  CHECK_FALSE(f.from_peer);
  CHECK_MESSAGE(f.message.rfind("channel 3: server sent ", 0) == 0, f.message);
  CHECK(f.recovery() == xdfs::Recovery::give_up);
  // The peer closes: gone, nothing can be told; a new connection may do better.
  peer.close();
  f = ch.failure(read(), "server");
  CHECK(f.code == errc::peer_aborted);
  CHECK(f.channel == xdfs::ChannelIndex(3));
  CHECK(f.peer_gone);
  CHECK(f.from_peer);
  CHECK(f.message == "channel 3 closed by the server");
  CHECK(f.recovery() == xdfs::Recovery::reconnect);
  // As the public API throws it: the code's name heads the text, the channel travels along.
  const xdfs::Error e(f);
  CHECK(std::string(e.what()) == "peer aborted: channel 3 closed by the server");
  CHECK(e.channel() == xdfs::ChannelIndex(3));
  CHECK_FALSE(e.offset().has_value());
}

TEST_CASE("XDSI: a payload read waits to be woken until a quarter MiB or the payload's rest is there, and leaves the socket waking at one byte") {
  namespace asio = boost::asio;
  using xdfs::xdsi::detail::LowWater;
  // Linux holds a mark to half the largest receive buffer.
  std::size_t rmem_max = 0;
  {
    std::ifstream f("/proc/sys/net/ipv4/tcp_rmem");
    std::size_t lo = 0, def = 0;
    f >> lo >> def >> rmem_max;
    REQUIRE(rmem_max > 0);
  }
  const int quarter = static_cast<int>(std::min(LowWater::default_wake, rmem_max / 2));
  const std::size_t n = (1u << 20) + 5, early = 8 * 1024;
  const auto data = xt::random_bytes(n, 41);
  for (const bool skip : {false, true}) {
    CAPTURE(skip);  // read into a buffer, or by splice into /dev/null
    Loopback lb;
    auto& ctx = lb.ctx;
    auto& ch = *lb.channels[0];
    const int fd = ch.socket().native_handle();
    auto mark = [&] {
      int v = 0;
      socklen_t len = sizeof v;
      REQUIRE(::getsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, &len) == 0);
      return v;
    };
    auto queued = [&] {
      int v = 0;
      REQUIRE(::ioctl(fd, FIONREAD, &v) == 0);
      return static_cast<std::size_t>(v);
    };
    // Runs the loop until `until` holds, at most 10 s.
    auto run_until = [&](auto until) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!until() && std::chrono::steady_clock::now() < deadline) {
        ctx.restart();
        ctx.run_one_for(std::chrono::milliseconds(10));
      }
      return until();
    };
    std::vector<std::uint8_t> dst(n);
    bool done = false;
    boost::system::error_code got;
    auto finish = [&](const boost::system::error_code& ec) {
      got = ec;
      done = true;
    };
    auto start = [&](std::size_t bytes) {
      done = false;
      if (skip)
        ch.async_skip_payload(bytes, finish);
      else
        ch.async_read_payload(std::span(dst).first(bytes), finish);
    };
    // Nothing there yet: the read waits for a quarter MiB. A few KiB (one segment, well inside
    // a fresh connection's window) do not wake it.
    start(n);
    CHECK(mark() == quarter);
    asio::write(lb.peer, asio::buffer(data.data(), early));
    CHECK(run_until([&] { return queued() == early; }));
    ctx.restart();
    ctx.poll();
    CHECK_FALSE(done);
    CHECK(queued() == early);
    // The rest: taken as it comes, whole.
    std::thread writer([&] { asio::write(lb.peer, asio::buffer(data.data() + early, n - early)); });
    const bool ended = run_until([&] { return done; });
    writer.join();
    REQUIRE(ended);
    CHECK_FALSE(got);
    if (!skip) CHECK(dst == data);
    CHECK(queued() == 0);
    // Back at one byte: a parked channel's wait (the session's, between operations) wakes at
    // the next operation's first byte.
    CHECK(mark() == 1);
    const std::uint8_t one = 7;
    asio::write(lb.peer, asio::buffer(&one, 1));
    bool woke = false;
    ch.socket().async_wait(asio::ip::tcp::socket::wait_read, [&](const boost::system::error_code& ec) { woke = !ec; });
    CHECK(run_until([&] { return woke; }));
    std::uint8_t b = 0;
    REQUIRE(::recv(fd, &b, 1, 0) == 1);
    // A payload under a quarter MiB: the read waits for all of it; under 16 KiB, for any byte.
    for (const std::size_t size : {std::size_t(100 * 1024), std::size_t(10 * 1024)}) {
      CAPTURE(size);
      start(size);
      CHECK(mark() == (size >= LowWater::floor ? static_cast<int>(size) : 1));
      asio::write(lb.peer, asio::buffer(data.data(), size));
      REQUIRE(run_until([&] { return done; }));
      CHECK_FALSE(got);
      if (!skip) CHECK(std::equal(data.begin(), data.begin() + static_cast<long>(size), dst.begin()));
      CHECK(mark() == 1);
    }
    // A read cancelled while it waits puts the mark back too.
    start(n);
    CHECK(mark() == quarter);
    ch.socket().cancel();
    REQUIRE(run_until([&] { return done; }));
    CHECK(got == asio::error::operation_aborted);
    CHECK(mark() == 1);
  }
  // A TCP window that is set bounds the wake to a quarter of the window the kernel granted.
  Loopback lb;
  auto& ch = *lb.channels[0];
  const int fd = ch.socket().native_handle();
  xdfs::xdsi::SocketOptions o;
  o.tcp_window = 256 * 1024;
  REQUIRE_FALSE(xdfs::xdsi::apply(ch, o));
  int granted = 0;
  socklen_t len = sizeof granted;
  REQUIRE(::getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &granted, &len) == 0);
  const std::size_t wake = std::min<std::size_t>(o.tcp_window, static_cast<std::size_t>(granted) / 2) / 4;
  CHECK(ch.payload_wake() == wake);
  std::vector<std::uint8_t> dst(n);
  ch.async_read_payload(dst, [](const boost::system::error_code&) {});
  int v = 0;
  len = sizeof v;
  REQUIRE(::getsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, &len) == 0);
  CHECK(v == static_cast<int>(wake));
  ch.close();
  lb.ctx.restart();
  lb.ctx.poll();
}

TEST_CASE("every error code has a class that says what a caller does next") {
  using xdfs::errc;
  using xdfs::Recovery;
  std::set<std::string> names;
  for (std::uint32_t v = 0; v <= static_cast<std::uint32_t>(xdfs::last_errc); ++v) {
    const auto c = static_cast<errc>(v);
    CAPTURE(xdfs::to_string(c));
    names.insert(xdfs::to_string(xdfs::recovery(c)));
  }
  CHECK(names == std::set<std::string>{"retry", "reconnect", "give-up"});
  // Not retried: a refused key, a missing file, a full disk, a path outside the root, a bad argument.
  for (auto c : {errc::auth_failed, errc::no_such_file, errc::disk_full, errc::path_escape, errc::bad_argument,
                 errc::permission_denied, errc::not_supported, errc::cancelled, errc::ok})
    CHECK(xdfs::recovery(c) == Recovery::give_up);
  // A new session may do better: the connection went, was refused (a restart), or carried a bad frame.
  for (auto c : {errc::peer_aborted, errc::connection_refused, errc::connection_failed, errc::timeout,
                 errc::shutting_down, errc::integrity_error})
    CHECK(xdfs::recovery(c) == Recovery::reconnect);
  // The server was busy, or the file changed under the sender: the same request later.
  CHECK(xdfs::recovery(errc::limit_exceeded) == Recovery::retry);
  CHECK(xdfs::recovery(errc::size_mismatch) == Recovery::retry);
}

TEST_CASE("the receiving engine runs the action its table answers, not a flag: change a row, the behaviour follows") {
  namespace asio = boost::asio;
  using asio::ip::tcp;
  using namespace xdfs::xftsm;
  using xdfs::wire::ChannelEvent;
  constexpr std::uint32_t bs = 65536;
  constexpr std::uint32_t blocks = 4;
  struct Host final : TransferHost {
    bool committed = false, told = false;
    xdfs::errc code = xdfs::errc::ok;
    xdfs::files::Status commit() override {
      committed = true;
      return xdfs::files::Status::ok();
    }
    void finished(const xdfs::Failure& f) override {
      told = true;
      code = f.code;
    }
  };
  struct Outcome {
    bool committed = false;
    State state = State::idle;
    std::vector<ChannelEvent> heard;  // what the sender got back, in order
  };
  // Four blocks and EOFR from a raw sender on one channel, into a memory sink; then what the
  // receiver did: committed or not, its state, the frames it sent back.
  auto run = [&](std::span<const Transition> rows) {
    Loopback lb;
    auto& ctx = lb.ctx;
    auto& peer = lb.peer;
    auto& channels = lb.channels;
    Machine machine = joined_upload(rows);
    TransferParams p;
    p.block_size = bs;
    p.file_size = std::uint64_t(blocks) * bs;
    p.slots = blocks;
    p.idle_timeout = std::chrono::milliseconds(60000);
    Host host;
    Outcome out;
    {
      Receiver receiver(ctx, machine, channels, host, p, xdfs::piod::Sink{-1, true, true});
      receiver.start();
      const std::vector<std::uint8_t> payload(bs, 0x33);
      for (std::uint32_t i = 0; i < blocks; ++i) {
        xdfs::wire::FrameHeader h;
        h.event = ChannelEvent::xftsmu;
        h.length = bs;
        h.offset = std::uint64_t(i) * bs;
        const auto head = xdfs::wire::encode(h);
        asio::write(peer, std::array{asio::buffer(head), asio::buffer(payload)});
      }
      xdfs::wire::FrameHeader e;
      e.event = ChannelEvent::eofr;
      e.offset = p.file_size;
      asio::write(peer, asio::buffer(xdfs::wire::encode(e)));
      // Until the receiver is done or has nothing more to do.
      for (int i = 0; i < 200 && !machine.finished(); ++i) ctx.run_for(std::chrono::milliseconds(10));
      out.committed = host.committed;
      out.state = machine.state();
      // A receiver that finished sent EOFR last: read up to it (loopback may deliver it a moment
      // after the write completed). One that did not finish had two seconds: read what is there.
      const bool until_eofr = machine.finished();
      peer.non_blocking(!until_eofr);
      std::array<std::uint8_t, xdfs::wire::frame_header_size> hb{};
      boost::system::error_code ec;
      while (asio::read(peer, asio::buffer(hb), ec) == hb.size() && !ec) {
        auto h = xdfs::wire::decode(hb, nullptr);
        REQUIRE(h);
        REQUIRE(h->length == 0);
        out.heard.push_back(h->event);
        if (until_eofr && h->event == ChannelEvent::eofr) break;
      }
    }
    return out;
  };
  const auto real = table(Role::server_upload);
  // As the table is: ACKs as blocks are written, commit, EOFR, done.
  auto o = run(real);
  CHECK(o.committed);
  CHECK(o.state == State::done);
  REQUIRE(!o.heard.empty());
  CHECK(o.heard.back() == ChannelEvent::eofr);
  CHECK(std::count(o.heard.begin(), o.heard.end(), ChannelEvent::ack) >= 1);
  // One row changed at a time.
  auto changed = [&](TransferEvent on, TransferAction action) {
    std::vector<Transition> rows(real.begin(), real.end());
    bool found = false;
    for (auto& r : rows)
      if (r.from == State::transferring && r.on == on) {
        r.action = action;
        found = true;
      }
    REQUIRE(found);
    return rows;
  };
  // block_written answers none: nothing acknowledges, yet the file still commits.
  auto rows = changed(TransferEvent::block_written, TransferAction::none);
  o = run(rows);
  CHECK(o.committed);
  CHECK(o.state == State::done);
  CHECK(std::count(o.heard.begin(), o.heard.end(), ChannelEvent::ack) == 0);
  CHECK(o.heard == std::vector<ChannelEvent>{ChannelEvent::eofr});
  // all_received answers none: every byte is in, but nothing commits and no EOFR confirms.
  rows = changed(TransferEvent::all_received, TransferAction::none);
  o = run(rows);
  CHECK_FALSE(o.committed);
  CHECK(o.state == State::draining);
  CHECK(std::count(o.heard.begin(), o.heard.end(), ChannelEvent::eofr) == 0);
}

}  // TEST_SUITE
