// Loopback transfers through an in-process server with the library client: every size edge,
// n = 1, 4 and 16, both directions, byte for byte; and the errors a client must see.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <thread>

#include "support.hpp"
#include "xdfs/client.hpp"

namespace {

xdfs::ServerConfig config_for(const xt::TempDir& root) {
  xdfs::ServerConfig c;
  c.root = root.path();
  c.max_channels = 32;
  c.join_timeout = std::chrono::milliseconds(5000);
  return c;
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
      auto up = xdfs::upload(local / name, {"127.0.0.1", srv.port()}, name, opt);
      CHECK(up.bytes == size);
      CHECK(xt::files_equal(local / name, root / name));
      auto down = xdfs::download({"127.0.0.1", srv.port()}, name, local / (name + ".back"), opt);
      CHECK(down.bytes == size);
      CHECK(xt::files_equal(local / name, local / (name + ".back")));
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

TEST_CASE("two sessions at once each get their own file") {
  xt::TempDir root, local;
  xt::InProcessServer srv(config_for(root));
  xt::write_random_file(local / "a", 24ull << 20, 1);
  xt::write_random_file(local / "b", 24ull << 20, 2);
  xdfs::TransferOptions opt;
  opt.channels = 4;
  opt.block_size = 256 * 1024;
  std::atomic<int> ok{0};
  std::thread ta([&] {
    xdfs::upload(local / "a", {"127.0.0.1", srv.port()}, "a", opt);
    ++ok;
  });
  std::thread tb([&] {
    xdfs::upload(local / "b", {"127.0.0.1", srv.port()}, "b", opt);
    ++ok;
  });
  ta.join();
  tb.join();
  CHECK(ok == 2);
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
    // A port that was just free: bind, read it, close.
    int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
    ::close(s);
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", {"127.0.0.1", ntohs(a.sin_port)}, "f", {}); }) ==
          xdfs::errc::connection_refused);
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
}

}  // TEST_SUITE

namespace {

// A small tmpfs mounted for the test (root only); unmounted at scope exit.
class SmallFs {
public:
  SmallFs(const std::string& where, const char* options) : where_(where) {
    ::mkdir(where.c_str(), 0755);
    mounted_ = ::mount("tmpfs", where.c_str(), "tmpfs", 0, options) == 0;
  }
  ~SmallFs() {
    if (mounted_) ::umount2(where_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  void remount_readonly() { ::mount(nullptr, where_.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr); }

private:
  std::string where_;
  bool mounted_ = false;
};

}  // namespace

TEST_SUITE("transfer") {

TEST_CASE("disk full and read-only file systems: named errors, nothing partial left, old file kept") {
  xt::TempDir root, local;
  SmallFs small(root / "small", "size=1m");
  SmallFs ro(root / "ro", "size=1m");
  SmallFs mine(local / "small", "size=1m");
  if (!small.mounted() || !ro.mounted() || !mine.mounted()) {
    MESSAGE("skipped: mounting a tmpfs needs root");
    return;
  }
  ro.remount_readonly();
  xt::InProcessServer srv(config_for(root));
  const xdfs::Endpoint ep{"127.0.0.1", srv.port()};
  xt::write_random_file(local / "f", 4 << 20, 21);
  xdfs::TransferOptions opt;
  opt.channels = 4;
  opt.block_size = 64 * 1024;
  bool remote = false;

  CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "small/f", opt); }, &remote) == xdfs::errc::disk_full);
  CHECK(remote);
  CHECK(xt::list_dir(root / "small").empty());

  CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "ro/f", opt); }, &remote) == xdfs::errc::permission_denied);
  CHECK(remote);

  xt::write_random_file(root / "big", 4 << 20, 22);
  xt::write_file(local / "small/big", "old");
  CHECK(xt::error_of([&] { xdfs::download(ep, "big", local / "small/big", opt); }, &remote) == xdfs::errc::disk_full);
  CHECK_FALSE(remote);
  CHECK(xt::read_file(local / "small/big") == "old");
  CHECK(xt::list_dir(local / "small") == std::vector<std::string>{"big"});
  // The server saw the client's exception and ended the session.
  CHECK(srv.wait_for_log("status=error: disk full"));
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

}  // TEST_SUITE
