// Cases that depend on privilege, run inside a user namespace so that they run the same whether
// the suite runs as root or not (tests/in_namespace.sh):
//   namespace-root: mapped to root of a user and mount namespace, where mounting a small tmpfs
//                   is allowed: a disk that fills up, a read-only file system;
//   namespace-user: mapped to an ordinary user, whom file permissions do stop: files that
//                   cannot be read, directories that cannot be written;
//   namespace-net:  root of a user and network namespace, whose loopback takes any address:
//                   many IPv6 sources in one /64.
// Outside their namespace (xdfs_tests run by hand) these suites are skipped, and say so.
#include <doctest/doctest.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "support.hpp"
#include "xdfs/xdfs.hpp"

namespace fs = std::filesystem;
using xdfs::errc;

namespace {

bool in_namespace(const char* kind) {
  const char* k = std::getenv("XDFS_IN_NAMESPACE");
  return k && std::string(k) == kind;
}

// A small tmpfs mounted for the test; unmounted at scope exit. Inside its namespace this must work.
class SmallFs {
public:
  SmallFs(const std::string& where, const char* options) : where_(where) {
    ::mkdir(where.c_str(), 0755);
    mounted_ = ::mount("tmpfs", where.c_str(), "tmpfs", 0, options) == 0;
    REQUIRE_MESSAGE(mounted_, "mount a tmpfs at " << where << ": " << std::strerror(errno));
  }
  ~SmallFs() {
    if (mounted_) ::umount2(where_.c_str(), MNT_DETACH);
  }
  void remount_readonly() {
    REQUIRE(::mount(nullptr, where_.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) == 0);
  }

private:
  std::string where_;
  bool mounted_ = false;
};

std::string url(std::uint16_t port, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(port) + "/" + path;
}

}  // namespace

TEST_SUITE("namespace-root") {

TEST_CASE("a disk that is full or fills up, a read-only file system: named errors, nothing partial, old file kept" *
          doctest::skip(!in_namespace("root"))) {
  REQUIRE(::geteuid() == 0);
  xt::TempDir root, local;
  SmallFs small(root / "small", "size=1m");
  SmallFs ro(root / "ro", "size=1m");
  SmallFs mine(local / "small", "size=1m");
  ro.remount_readonly();
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  const xdfs::Endpoint ep{"127.0.0.1", srv.port()};
  xt::write_random_file(local / "f", 4 << 20, 21);
  xdfs::TransferOptions opt;
  opt.channels = 4;
  opt.block_size = 64 * 1024;
  bool remote = false;
  std::string what;

  // Too big for what is free: refused before a byte is written.
  CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "small/f", opt); }, &remote, &what) == errc::disk_full);
  CHECK(remote);
  CHECK(what.find("do not fit") != std::string::npos);
  CHECK(xt::list_dir(root / "small").empty());

  CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "ro/f", opt); }, &remote) == errc::permission_denied);
  CHECK(remote);

  xt::write_random_file(root / "big", 4 << 20, 22);
  xt::write_file(local / "small/big", "old");
  CHECK(xt::error_of([&] { xdfs::download(ep, "big", local / "small/big", opt); }, &remote, &what) == errc::disk_full);
  CHECK_FALSE(remote);
  CHECK(what.find("do not fit") != std::string::npos);
  CHECK(xt::read_file(local / "small/big") == "old");
  CHECK(xt::list_dir(local / "small") == std::vector<std::string>{"big"});
}

TEST_CASE("a disk that fills up in the middle of an upload (a server with a size limit of its own)" *
          doctest::skip(!in_namespace("root"))) {
  xt::TempDir root, local;
  SmallFs small(root / "small", "size=1m");
  xt::write_file(root / "small/keep", "an existing file");
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  cfg.max_file_size = std::uint64_t(1) << 30;  // its own limit: the free space is not looked at
  xt::InProcessServer srv(cfg);
  xt::write_random_file(local / "f", 4 << 20, 23);
  xdfs::TransferOptions opt;
  opt.channels = 4;
  opt.block_size = 64 * 1024;
  bool remote = false;
  std::string what;
  CHECK(xt::error_of([&] { xdfs::upload(local / "f", {"127.0.0.1", srv.port()}, "small/keep", opt); }, &remote,
                     &what) == errc::disk_full);
  CHECK(remote);
  CHECK(what.find("No space left on device") != std::string::npos);
  CHECK(xt::read_file(root / "small/keep") == "an existing file");
  CHECK(xt::list_dir(root / "small") == std::vector<std::string>{"keep"});
  CHECK(srv.wait_for_log("status=error: disk full"));
}

}  // TEST_SUITE

TEST_SUITE("namespace-user") {

TEST_CASE("files that cannot be read and directories that cannot be written, as an ordinary user" *
          doctest::skip(!in_namespace("user"))) {
  REQUIRE(::geteuid() != 0);
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  // A single file the client cannot read.
  xt::write_file(local / "secret", "x");
  REQUIRE(::chmod((local / "secret").c_str(), 0) == 0);
  auto r = xt::xduc({"-q", local / "secret", url(d.port(), "secret")});
  CHECK(r.status == 1);
  CHECK(r.err.find("permission denied") != std::string::npos);
  CHECK(r.err.find("'" + local / "secret" + "'") != std::string::npos);
  CHECK_FALSE(xt::exists(root / "secret"));

  // A server directory it may not write into.
  fs::create_directories(root / "locked");
  REQUIRE(::chmod((root / "locked").c_str(), 0555) == 0);
  xt::write_file(local / "ok", "y");
  r = xt::xduc({"-q", local / "ok", url(d.port(), "locked/ok")});
  CHECK(r.status == 1);
  CHECK(r.err.find("permission denied (server)") != std::string::npos);
  ::chmod((root / "locked").c_str(), 0755);
}

TEST_CASE("permission denied partway through a tree: the rest is copied, each one left out is named" *
          doctest::skip(!in_namespace("user"))) {
  xt::TempDir root, local;
  fs::create_directories(local / "t/open");
  fs::create_directories(local / "t/shut");
  for (int i = 0; i < 10; ++i) xt::write_random_file(local / ("t/open/f" + std::to_string(i)), 5000 + i, i);
  xt::write_random_file(local / "t/open/big", 3 << 20, 50);
  xt::write_file(local / "t/shut/inside", "z");
  xt::write_file(local / "t/open/unreadable", "u");
  xt::write_random_file(local / "t/unreadable-big", 3 << 20, 51);
  REQUIRE(::chmod((local / "t/open/unreadable").c_str(), 0) == 0);
  REQUIRE(::chmod((local / "t/unreadable-big").c_str(), 0) == 0);
  REQUIRE(::chmod((local / "t/shut").c_str(), 0) == 0);
  xt::XdfsdProcess d(root.path());
  auto r = xt::xduc({"-q", "-r", "--json", local / "t", url(d.port(), "")});
  ::chmod((local / "t/shut").c_str(), 0755);
  INFO(r.err);
  CHECK(r.status == 1);
  CHECK(r.err.find("open/unreadable") != std::string::npos);
  CHECK(r.err.find("unreadable-big") != std::string::npos);
  CHECK(r.err.find("permission denied") != std::string::npos);
  for (int i = 0; i < 10; ++i)
    CHECK(xt::files_equal(local / ("t/open/f" + std::to_string(i)), root / ("t/open/f" + std::to_string(i))));
  CHECK(xt::files_equal(local / "t/open/big", root / "t/open/big"));
  CHECK(r.err.find("'shut': Permission denied") != std::string::npos);  // the directory it could not read
  CHECK(r.out.find("\"failed\":3") != std::string::npos);
  CHECK_FALSE(xt::exists(root / "t/open/unreadable"));
  CHECK_FALSE(xt::exists(root / "t/unreadable-big"));
  ::chmod((root / "t/shut").c_str(), 0755);  // made as its source was: with no permissions
  for (auto& e : fs::recursive_directory_iterator(root.path()))
    CHECK_MESSAGE(e.path().filename().string().find(".xdfs-") == std::string::npos, e.path().string());
}

}  // TEST_SUITE

namespace {

// Brings this network namespace's loopback up and gives it fd00::1 .. fd00::count, /64 (those
// it has already stay).
void loopback_with_v6(int count) {
  const int s4 = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  REQUIRE(s4 >= 0);
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  REQUIRE(::ioctl(s4, SIOCGIFFLAGS, &ifr) == 0);
  ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
  REQUIRE_MESSAGE(::ioctl(s4, SIOCSIFFLAGS, &ifr) == 0, "lo up: " << std::strerror(errno));
  ::close(s4);
  const int s6 = ::socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  REQUIRE(s6 >= 0);
  for (int i = 1; i <= count; ++i) {
    struct {
      in6_addr addr;
      std::uint32_t prefixlen;
      int ifindex;
    } req{};  // the kernel's struct in6_ifreq
    REQUIRE(::inet_pton(AF_INET6, fmt::format("fd00::{:x}", i).c_str(), &req.addr) == 1);
    req.prefixlen = 64;
    req.ifindex = static_cast<int>(::if_nametoindex("lo"));
    // An earlier case in this namespace may have added it already.
    REQUIRE_MESSAGE((::ioctl(s6, SIOCSIFADDR, &req) == 0 || errno == EEXIST), "add fd00::" << i << ": " << std::strerror(errno));
  }
  ::close(s6);
}

// A TCP connection from `from` to [fd00::1]:port that sends nothing.
int stalled_from(const std::string& from, std::uint16_t port) {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in6 src{};
  src.sin6_family = AF_INET6;
  REQUIRE(::inet_pton(AF_INET6, from.c_str(), &src.sin6_addr) == 1);
  REQUIRE_MESSAGE(::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) == 0, "bind " << from << ": " << std::strerror(errno));
  sockaddr_in6 dst{};
  dst.sin6_family = AF_INET6;
  dst.sin6_port = htons(port);
  REQUIRE(::inet_pton(AF_INET6, "fd00::1", &dst.sin6_addr) == 1);
  REQUIRE_MESSAGE(::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) == 0, "connect: " << std::strerror(errno));
  return fd;
}

// True if the peer closed fd within timeout_ms.
bool closed_by_peer(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) != 1) return false;
  char c;
  return ::recv(fd, &c, 1, 0) <= 0;
}

}  // namespace

TEST_SUITE("namespace-net") {

TEST_CASE("pending connections from one IPv6 /64 count as one source, whatever address each uses" *
          doctest::skip(!in_namespace("net"))) {
  loopback_with_v6(40);
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {"--listen", "[fd00::1]:0", "--handshake-timeout", "30", "--max-pending-per-address", "10"});
  std::vector<int> flood;
  for (int i = 2; i <= 31; ++i) flood.push_back(stalled_from(fmt::format("fd00::{:x}", i), d.port()));
  // Thirty addresses of one /64: the first twenty were dropped as the later ones came.
  CHECK(closed_by_peer(flood.front(), 10000));
  CHECK(d.wait_for_log("connections from fd00::/64 are pending, its limit"));
  CHECK_FALSE(closed_by_peer(flood.back(), 200));
  for (int fd : flood) ::close(fd);
  // A real client from another address of it still gets in.
  xt::write_random_file(local / "g", 1 << 20, 6);
  auto ok = xt::xduc({"-q", "-p", "4", local / "g", "xdfs://[fd00::1]:" + std::to_string(d.port()) + "/g"}, 60000);
  CHECK_MESSAGE(ok.status == 0, ok.err);
  CHECK(xt::files_equal(local / "g", root / "g"));
}

TEST_CASE("a peer at another of this host's interfaces' addresses (not loopback, not this end's own) is on this host; once removed, it is not" *
          doctest::skip(!in_namespace("net"))) {
  loopback_with_v6(3);
  namespace asio = boost::asio;
  using tcp = asio::ip::tcp;
  asio::io_context io;
  tcp::acceptor acc(io, tcp::endpoint(asio::ip::make_address("fd00::1"), 0));
  const int fd = stalled_from("fd00::3", acc.local_endpoint().port());
  tcp::socket near(io, tcp::v6(), fd);
  xdfs::xdsi::Channel a(std::move(near), 0), b(acc.accept(), 1);
  REQUIRE(a.socket().local_endpoint().address() != a.socket().remote_endpoint().address());
  CHECK(a.peer_on_this_host());
  CHECK(b.peer_on_this_host());
  // Such an address, once gone, is another host's as far as this one can tell.
  {
    const int s6 = ::socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    REQUIRE(s6 >= 0);
    struct {
      in6_addr addr;
      std::uint32_t prefixlen;
      int ifindex;
    } req{};
    REQUIRE(::inet_pton(AF_INET6, "fd00::3", &req.addr) == 1);
    req.prefixlen = 64;
    req.ifindex = static_cast<int>(::if_nametoindex("lo"));
    REQUIRE_MESSAGE(::ioctl(s6, SIOCDIFADDR, &req) == 0, "remove fd00::3: " << std::strerror(errno));
    ::close(s6);
  }
  CHECK_FALSE(b.peer_on_this_host());
}

}  // TEST_SUITE
