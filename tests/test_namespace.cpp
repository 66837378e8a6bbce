// Cases that depend on privilege, run inside a user namespace so that they run the same whether
// the suite runs as root or not (tests/in_namespace.sh):
//   namespace-root: mapped to root of a user and mount namespace, where mounting a small tmpfs
//                   is allowed: a disk that fills up, a read-only file system;
//   namespace-user: mapped to an ordinary user, whom file permissions do stop: files that
//                   cannot be read, directories that cannot be written.
// Outside their namespace (xdfs_tests run by hand) these suites are skipped, and say so.
#include <doctest/doctest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "support.hpp"
#include "xdfs/client.hpp"

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
