// One session, many operations: reusable channels, mode switching, per-transfer keys, and what
// a peer that breaks the session's rules gets. Real xdfsd and xduc processes, real sockets.
#include <doctest/doctest.h>
#include <fcntl.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/use_future.hpp>
#include <sys/stat.h>

#include <csignal>
#include <regex>
#include <set>
#include <string>
#include <thread>

#include "support.hpp"
#include "xdfs/xdfs.hpp"
#include "xdfs/detail/path_fsm.hpp"

using xdfs::errc;
using xdfs::Mode;
using xdfs::wire::ChannelEvent;

namespace {

std::string url(const xt::XdfsdProcess& d, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(d.port()) + "/" + path;
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

xdfs::TransferOptions options(unsigned channels) {
  xdfs::TransferOptions o;
  o.channels = channels;
  o.block_size = 64 * 1024;
  return o;
}

void make_dir(const std::string& p) { REQUIRE(::mkdir(p.c_str(), 0755) == 0); }

// A table's own graph: every row's source state is reachable from idle, final states have no
// rows, one row per (state, event), and both final states are reached.
template <class Rows>
void check_graph(const Rows& rows) {
  using State = std::remove_cvref_t<decltype(rows[0].from)>;
  std::set<State> reached{State::idle};
  for (bool grew = true; grew;) {
    grew = false;
    for (const auto& t : rows)
      if (reached.count(t.from) && reached.insert(t.to).second) grew = true;
  }
  for (const auto& t : rows) {
    CHECK(reached.count(t.from) == 1);
    CHECK(t.from != State::done);
    CHECK(t.from != State::failed);
    std::size_t same = 0;
    for (const auto& u : rows) same += u.from == t.from && u.on == t.on;
    CHECK(same == 1);
  }
  CHECK(reached.count(State::done) == 1);
  CHECK(reached.count(State::failed) == 1);
}

}  // namespace

TEST_SUITE("session") {

TEST_CASE("xduc copies several sources up and down over one session, a tree among them") {
  xt::TempDir root, local, back;
  xt::XdfsdProcess d(root.path());
  xt::write_random_file(local / "a.bin", (3 << 20) + 5, 1);
  xt::write_random_file(local / "b.bin", 0, 2);
  xt::write_random_file(local / "c.bin", 700000, 3);
  make_dir(local / "photos");
  make_dir(local / "photos/2026");
  xt::write_random_file(local / "photos/2026/x.jpg", 123456, 4);
  xt::write_random_file(local / "photos/y.jpg", 99, 5);
  make_dir(root / "in");
  auto up = xt::xduc({"-q", "-r", "-p", "4", "--json", local / "a.bin", local / "b.bin", local / "photos",
                      local / "c.bin", url(d, "in/")});
  REQUIRE_MESSAGE(up.status == 0, up.err);
  CHECK(xt::files_equal(local / "a.bin", root / "in/a.bin"));
  CHECK(xt::files_equal(local / "b.bin", root / "in/b.bin"));
  CHECK(xt::files_equal(local / "c.bin", root / "in/c.bin"));
  CHECK(xt::files_equal(local / "photos/2026/x.jpg", root / "in/photos/2026/x.jpg"));
  CHECK(xt::files_equal(local / "photos/y.jpg", root / "in/photos/y.jpg"));
  CHECK(up.out.find("\"sources\":4,\"files\":5,\"trees\":1") != std::string::npos);
  // One session: one start line with its first operation, the others as operations of it.
  REQUIRE(d.wait_for_log("ops=4"));
  CHECK(count(d.log(), " start peer=") == 1);
  CHECK(count(d.log(), " start op=") == 3);
  CHECK(d.log().find("op 2 end peer=") != std::string::npos);  // the tree, in path mode
  CHECK(d.log().find("mode=path") != std::string::npos);

  // Downloads likewise, the sources from a file (and a directory among them with -r).
  xt::write_file(local / "list", "# what to fetch\n" + url(d, "in/a.bin") + "\n\n" + url(d, "in/c.bin") + "\n" +
                                     url(d, "in/photos") + "\n" + url(d, "in/b.bin") + "\n");
  auto down = xt::xduc({"-q", "-r", "-p", "3", "--files-from", local / "list", back.path()});
  REQUIRE_MESSAGE(down.status == 0, down.err);
  CHECK(xt::files_equal(local / "a.bin", back / "a.bin"));
  CHECK(xt::files_equal(local / "b.bin", back / "b.bin"));
  CHECK(xt::files_equal(local / "c.bin", back / "c.bin"));
  CHECK(xt::files_equal(local / "photos/2026/x.jpg", back / "photos/2026/x.jpg"));
  xt::check_no_partials(back.path());
  xt::check_no_partials(root.path());
}

// Mode bits and mtime (ns) of a path, not following a symlink.
std::pair<unsigned, std::int64_t> attrs(const std::string& p) {
  struct stat st {};
  REQUIRE_MESSAGE(::lstat(p.c_str(), &st) == 0, p);
  return {static_cast<unsigned>(st.st_mode & 07777), std::int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

void set_attrs(const std::string& p, unsigned mode, std::int64_t sec) {
  REQUIRE(::chmod(p.c_str(), mode) == 0);
  const timespec ts[2] = {{sec, 250000000}, {sec, 250000000}};
  REQUIRE(::utimensat(AT_FDCWD, p.c_str(), ts, 0) == 0);
}

TEST_CASE("a tree's large files travel as xFTSM transfers on the tree's session, with modes and mtimes as in path mode") {
  xt::TempDir root, local, back;
  xt::XdfsdProcess d(root.path());
  const std::string t = local / "t";
  make_dir(t);
  make_dir(t + "/sub");
  make_dir(t + "/sub/deep");
  xt::write_random_file(t + "/big.bin", (3 << 20) + 11, 1);     // large, at the top
  xt::write_random_file(t + "/sub/big2.bin", 2 << 20, 2);       // large, in a subdirectory
  xt::write_random_file(t + "/sub/small.txt", 1000, 3);
  xt::write_random_file(t + "/sub/deep/tiny", 10, 4);
  REQUIRE(::symlink("small.txt", (t + "/sub/link").c_str()) == 0);
  set_attrs(t + "/big.bin", 0755, 1500000000);
  set_attrs(t + "/sub/big2.bin", 0640, 1500000100);
  set_attrs(t + "/sub/small.txt", 0600, 1500000200);
  set_attrs(t + "/sub/deep/tiny", 0644, 1500000300);
  // Directories last: writing into them moved their mtimes.
  set_attrs(t + "/sub/deep", 0555, 1500000400);  // no write: made writable, its mode set at the end
  set_attrs(t + "/sub", 0750, 1500000500);
  set_attrs(t, 0751, 1500000600);
  const std::vector<std::string> entries{"big.bin", "sub/big2.bin", "sub/small.txt", "sub/deep/tiny", "sub/deep", "sub", ""};
  auto same_tree = [&](const std::string& a, const std::string& b) {
    for (const auto& e : entries) {
      CAPTURE(e);
      const std::string pa = e.empty() ? a : a + "/" + e, pb = e.empty() ? b : b + "/" + e;
      if (e.find(".bin") != std::string::npos || e.find("tiny") != std::string::npos || e.find("txt") != std::string::npos)
        CHECK(xt::files_equal(pa, pb));
      CHECK(attrs(pa) == attrs(pb));
    }
    CHECK(xt::read_file(b + "/sub/small.txt") == xt::read_file(a + "/sub/small.txt"));
  };

  auto up = xt::xduc({"-q", "-r", "-p", "3", "--block-size", "64K", "--large-file", "1M", "--json", t, url(d, "")});
  REQUIRE_MESSAGE(up.status == 0, up.err);
  CHECK(up.out.find("\"files\":4,") != std::string::npos);
  CHECK(up.out.find("\"large_files\":2,\"large_bytes\":" + std::to_string((3 << 20) + 11 + (2 << 20))) !=
        std::string::npos);
  same_tree(t, root / "t");
  // One session: the path part, a transfer for each large file, the directories' attributes.
  REQUIRE(d.wait_for_log("ops=4"));
  CHECK(count(d.log(), " start peer=") == 1);
  CHECK(count(d.log(), " start op=") == 3);
  CHECK(std::regex_search(d.log(), std::regex("start op=1 peer=\\S+ mode=upload path=t/big.bin ")));
  CHECK(std::regex_search(d.log(), std::regex("start op=2 peer=\\S+ mode=upload path=t/sub/big2.bin ")));
  CHECK(std::regex_search(d.log(), std::regex("start op=3 peer=\\S+ mode=path ")));
  xt::check_no_partials(root.path());

  auto down = xt::xduc({"-q", "-r", "-p", "2", "--large-file", "1M", "--json", url(d, "t"), back.path()});
  REQUIRE_MESSAGE(down.status == 0, down.err);
  CHECK(down.out.find("\"large_files\":2,") != std::string::npos);
  same_tree(t, back / "t");
  xt::check_no_partials(back.path());

  // --large-file 0: all in path mode, the same tree.
  xt::TempDir again;
  auto path_only = xt::xduc({"-q", "-r", "--large-file", "0", "--json", url(d, "t"), again.path()});
  REQUIRE_MESSAGE(path_only.status == 0, path_only.err);
  CHECK(path_only.out.find("\"large_files\":0,") != std::string::npos);
  same_tree(t, again / "t");
  for (const auto& p : {t, root / "t", back / "t", again / "t"}) ::chmod((p + "/sub/deep").c_str(), 0755);
}

TEST_CASE("set_attrs sets the mode only of what the session made, in any of its operations; mtimes always") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  xt::write_file(root / "theirs", "x");
  REQUIRE(::chmod((root / "theirs").c_str(), 0600) == 0);
  REQUIRE(::mkdir((root / "other").c_str(), 0700) == 0);
  xt::write_random_file(local / "f", 100000, 1);
  auto o = options(2);
  xdfs::Session s({"127.0.0.1", d.port()}, o);
  xdfs::upload(s, local / "f", "mine", o);  // an xFTSM operation of the session makes "mine"
  xdfs::RemoteFs fs(s);
  // A directory the session made, removed, and another moved onto its name: not the session's.
  fs->mkdir("d", false);
  fs->remove("d", false);
  fs->rename("other", "d");
  std::vector<xdfs::pathm::Entry> v(3);
  v[0].path = "mine";
  v[1].path = "theirs";
  v[2].path = "d";
  for (auto& e : v) {
    e.mode = 04757;  // set-user-ID never, the rest only on what the session made
    e.mtime_ns = 1400000000LL * 1000000000;
  }
  xdfs::pathm::TreeResult r;
  fs->set_attrs("", v, r);
  fs.close();
  s.close();
  CHECK(r.failures.empty());
  using A = std::pair<unsigned, std::int64_t>;
  CHECK(attrs(root / "mine") == A{0757 & ~xdfs::files::process_umask(), v[0].mtime_ns});
  CHECK(attrs(root / "theirs") == A{0600, v[1].mtime_ns});
  CHECK(attrs(root / "d") == A{0700, v[2].mtime_ns});
}

TEST_CASE("a tree download whose server dies during its large files names each one not copied, and finishes the rest") {
  xt::TempDir root, local;
  auto d = std::make_unique<xt::XdfsdProcess>(root.path());
  make_dir(root / "t");
  make_dir(root / "t/sub");
  xt::write_random_file(root / "t/sub/small", 1000, 1);
  xt::write_random_file(root / "t/a.big", 64 << 20, 2);
  xt::write_random_file(root / "t/b.big", 64 << 20, 3);
  REQUIRE(::chmod((root / "t/sub").c_str(), 0750) == 0);
  auto o = options(1);
  xdfs::Session s({"127.0.0.1", d->port()}, o);
  // The server goes as soon as the first large file's transfer starts.
  std::thread killer([&] {
    if (d->wait_for_log("start op=1 ", 30000)) ::kill(d->pid(), SIGKILL);
  });
  xdfs::pathm::TreeOptions tree;
  tree.large_file = 1 << 20;
  std::vector<xdfs::pathm::TreeFailure> failures;
  try {
    xdfs::download_tree(s, "t", local / "t", tree, o);
  } catch (const xdfs::pathm::TreeError& e) {
    failures = e.result().failures;
    CHECK(e.result().files + failures.size() == 3);
  }
  killer.join();
  CHECK(!s.usable());
  s.close();
  // Each large file is either whole here or named; the one after the lost transfer as not copied.
  REQUIRE(!failures.empty());
  std::set<std::string> named;
  for (const auto& f : failures) named.insert(f.path);
  CHECK(named.size() == failures.size());
  for (const std::string big : {"a.big", "b.big"})
    if (!named.count(big)) CHECK(xt::files_equal(root / ("t/" + big), local / ("t/" + big)));
  for (const auto& f : failures) CHECK((f.path == "a.big" || f.path == "b.big"));
  if (failures.size() == 2) CHECK(failures[1].message == "not copied: the session ended");
  CHECK(xt::files_equal(root / "t/sub/small", local / "t/sub/small"));
  // The directories' attributes were still set here (no session needed for that).
  CHECK(attrs(local / "t/sub") == attrs(root / "t/sub"));
  xt::check_no_partials(local.path());
}

TEST_CASE("a large file of a tree that cannot be copied is named; the rest of the tree is copied") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  const std::string t = local / "t";
  make_dir(t);
  xt::write_random_file(t + "/a.bin", 2 << 20, 1);
  xt::write_random_file(t + "/b.bin", 2 << 20, 2);
  xt::write_random_file(t + "/small", 100, 3);
  // At the server, a directory stands where a.bin goes: its transfer is refused, b.bin still goes.
  make_dir(root / "t");
  make_dir(root / "t/a.bin");
  auto up = xt::xduc({"-r", "--large-file", "1M", "--json", t, url(d, "")});
  CHECK(up.status == 1);
  CHECK(up.err.find("a.bin") != std::string::npos);
  CHECK(up.out.find("\"failed\":1,") != std::string::npos);
  CHECK(xt::files_equal(t + "/b.bin", root / "t/b.bin"));
  CHECK(xt::files_equal(t + "/small", root / "t/small"));
  xt::check_no_partials(root.path());
}

TEST_CASE("a source that fails is reported and the others still travel on the same session") {
  xt::TempDir root, local, back;
  xt::XdfsdProcess d(root.path());
  xt::write_random_file(root / "one", 100000, 1);
  xt::write_random_file(root / "three", 200000, 3);
  make_dir(root / "dir");
  auto r = xt::xduc({"-q", "-p", "2", url(d, "one"), url(d, "missing"), url(d, "dir"), url(d, "three"), back.path()});
  CHECK(r.status == 1);
  CHECK(r.err.find("missing: no such file (server)") != std::string::npos);
  CHECK(r.err.find("dir: is a directory (server)") != std::string::npos);
  CHECK(xt::files_equal(root / "one", back / "one"));
  CHECK(xt::files_equal(root / "three", back / "three"));
  CHECK_FALSE(xt::exists(back / "missing"));
  xt::check_no_partials(back.path());
  // The refusals left the session ready: one session did it all.
  REQUIRE(d.wait_for_log("ops=4"));
  CHECK(count(d.log(), " start peer=") == 1);
  CHECK(d.log().find("refused operation 1 mode=download path=missing") != std::string::npos);
}

TEST_CASE("a failure says what to do next and where: a missing file gives up, a server gone mid-transfer reconnects") {
  xt::TempDir root, local;
  auto d = std::make_unique<xt::XdfsdProcess>(root.path());
  xt::write_random_file(root / "big", 256 << 20, 5);
  auto o = options(2);
  xdfs::Session s({"127.0.0.1", d->port()}, o);
  try {
    xdfs::download(s, "nope", local / "nope", o);
    FAIL("a missing file was downloaded");
  } catch (const xdfs::TransferError& e) {
    CHECK(e.code() == errc::no_such_file);
    CHECK(e.remote());
    CHECK(e.recovery() == xdfs::Recovery::give_up);
  }
  REQUIRE(s.usable());
  // The server goes while the file streams in: the error names the channel that saw it go.
  std::thread killer([&] {
    if (d->wait_for_log("start op=1 ", 30000)) ::kill(d->pid(), SIGKILL);
  });
  try {
    xdfs::download(s, "big", local / "big", o);
    FAIL("the download outlived its server");
  } catch (const xdfs::TransferError& e) {
    CHECK_MESSAGE(e.code() == errc::peer_aborted, e.what());
    CHECK(e.recovery() == xdfs::Recovery::reconnect);
    REQUIRE(e.channel().has_value());
    CHECK(e.channel()->value() < 2u);
    CHECK_MESSAGE(std::regex_search(e.context(), std::regex("^channel [01] (closed|reset) by the server( during the negotiation)?$")), e.context());
    // And which operation it ended.
    CHECK_MESSAGE((e.operation() == "download 'big'" || e.operation() == "negotiation of operation 1"), e.operation());
  }
  killer.join();
  CHECK_FALSE(s.usable());
  s.close();
  CHECK_FALSE(xt::exists(local / "big"));
  xt::check_no_partials(local.path());
  // xduc --json gives programs the same: the code, its class and the side, one object per failure.
  d = std::make_unique<xt::XdfsdProcess>(root.path());
  auto r = xt::xduc({"-q", "--json", "-p", "2", url(*d, "nope"), url(*d, "big"), local.path()});
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.out.find("\"errors\":[{\"source\":\"" + url(*d, "nope") +
                           "\",\"code\":\"no such file\",\"recovery\":\"give-up\",\"remote\":true,") != std::string::npos,
                r.out);
  CHECK(xt::files_equal(root / "big", local / "big"));
}

TEST_CASE("the library: one session carries uploads, downloads and path operations, switching modes") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  auto o = options(4);
  for (auto protect : {xdfs::xsec::Protect::clear, xdfs::xsec::Protect::integrity, xdfs::xsec::Protect::private_}) {
    CAPTURE(static_cast<int>(protect));
    o.protect = protect;
    xdfs::Session s({"127.0.0.1", d.port()}, o);
    xt::write_random_file(local / "f", 1 << 20, 7);
    auto r1 = xdfs::upload(s, local / "f", "f", o);
    CHECK(r1.bytes == 1u << 20);
    CHECK(s.transfer() == 0);
    {
      xdfs::RemoteFs fs(s);
      CHECK(fs->stat("f").size == 1u << 20);
      fs->rename("f", "g");
    }
    CHECK(s.transfer() == 1);
    // The same file up again under the old name: a second transfer, new keys (the same offsets
    // as before, never the same nonce under the same key).
    xdfs::upload(s, local / "f", "f", o);
    CHECK(s.transfer() == 2);
    ::unlink((local / "g").c_str());
    xdfs::download(s, "g", local / "g", o);
    CHECK(xt::files_equal(local / "f", local / "g"));
    CHECK(xt::files_equal(local / "f", root / "f"));
    // A refused operation leaves the session usable.
    CHECK(xt::error_of([&] { xdfs::download(s, "nope", local / "nope", o); }) == errc::no_such_file);
    CHECK(s.usable());
    xdfs::download(s, "f", local / "f2", o);
    CHECK(xt::files_equal(local / "f", local / "f2"));
    s.close();
    ::unlink((local / "f2").c_str());
    ::unlink((root / "g").c_str());
    ::unlink((root / "f").c_str());
  }
  CHECK(d.wait_for_log("ops=6"));
}

TEST_CASE("async: transfers chained from their completions on the caller's loop; failures complete through them") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  auto o = options(4);
  xt::write_random_file(local / "a", 1 << 20, 3);
  xt::write_random_file(local / "b", (3 << 20) + 1, 4);
  xdfs::Session s({"127.0.0.1", d.port()}, o);
  std::vector<std::string> steps;
  auto code = [](std::exception_ptr e, bool* remote) {
    return xt::error_of([&] { std::rethrow_exception(e); }, remote);
  };
  // A local file that cannot be read: the completion runs on the loop, not inside the call, and
  // the session has not even connected.
  xdfs::async_upload(s, local / "missing", "x", o, [&](std::exception_ptr e, xdfs::TransferResult) {
    bool remote = true;
    CHECK(code(e, &remote) == errc::no_such_file);
    CHECK_FALSE(remote);
    CHECK_FALSE(s.opened());
    steps.push_back("missing");
    xdfs::async_upload(s, local / "a", "in/", o, [&](std::exception_ptr e, xdfs::TransferResult r) {
      REQUIRE_FALSE(e);
      CHECK(r.bytes == 1u << 20);
      CHECK(r.channels == 4);
      steps.push_back("a");
      xdfs::async_upload(s, local / "b", "b", o, [&](std::exception_ptr e, xdfs::TransferResult r) {
        REQUIRE_FALSE(e);
        CHECK(r.bytes == (3u << 20) + 1);
        steps.push_back("b");
        // The server refuses this one: the session stays for the next.
        xdfs::async_download(s, "nope", local / "nope", o, [&](std::exception_ptr e, xdfs::TransferResult) {
          bool remote = false;
          CHECK(code(e, &remote) == errc::no_such_file);
          CHECK(remote);
          CHECK(s.usable());
          steps.push_back("nope");
          xdfs::async_download(s, "b", local / "b2", o, [&](std::exception_ptr e, xdfs::TransferResult r) {
            REQUIRE_FALSE(e);
            CHECK(r.bytes == (3u << 20) + 1);
            steps.push_back("b2");
          });
        });
      });
    });
  });
  CHECK(steps.empty());
  CHECK(::mkdir((root / "in").c_str(), 0755) == 0);
  s.io().run();
  CHECK(steps == std::vector<std::string>{"missing", "a", "b", "nope", "b2"});
  CHECK(xt::files_equal(local / "a", root / "in/a"));
  CHECK(xt::files_equal(local / "b", root / "b"));
  CHECK(xt::files_equal(local / "b", local / "b2"));
  CHECK(s.operations() == 4);
  s.close();
  CHECK(d.wait_for_log("ops=4"));
}

TEST_CASE("async: completion tokens; another thread runs the loop, use_future waits and rethrows") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  auto o = options(2);
  xt::write_random_file(local / "f", 5 << 20, 9);
  xdfs::Session s({"127.0.0.1", d.port()}, o);
  auto work = boost::asio::make_work_guard(s.io());
  std::thread loop([&] { s.io().run(); });
  auto up = xdfs::async_upload(s, local / "f", "f", o, boost::asio::use_future);
  CHECK(up.get().bytes == 5u << 20);
  CHECK(xt::files_equal(local / "f", root / "f"));
  auto missing = xdfs::async_download(s, "nope", local / "nope", o, boost::asio::use_future);
  bool remote = false;
  CHECK(xt::error_of([&] { missing.get(); }, &remote) == errc::no_such_file);
  CHECK(remote);
  // The session's own negotiation, asynchronously: a second operation while one is being
  // negotiated is refused through its completion.
  xdfs::wire::Negotiation n;
  n.mode = Mode::download;
  n.remote_path = "f";
  n.window = 1u << 20;
  auto first = s.async_begin(n, boost::asio::use_future);
  auto second = s.async_begin(n, boost::asio::use_future);
  CHECK(xt::error_of([&] { second.get(); }) == errc::bad_argument);
  CHECK(first.get().file_size == 5u << 20);
  // An accepted download that the caller does not run: ending it fails the session.
  boost::asio::post(s.io(), [&] { s.end_operation(false); });
  auto after = xdfs::async_upload(s, local / "f", "g", o, boost::asio::use_future);
  CHECK(xt::error_of([&] { after.get(); }) == errc::session_ended);
  work.reset();
  loop.join();
  s.close();
}

TEST_CASE("async path calls: many outstanding on the caller's loop; a refusal and a stalled server complete each") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  xt::write_random_file(root / "f", (3 << 20) + 5, 11);
  auto o = options(3);
  o.keep_alive = std::chrono::milliseconds(0);  // this test runs the loop itself
  o.idle_timeout = std::chrono::milliseconds(1500);
  xdfs::RemoteFs fs({"127.0.0.1", d.port()}, o);
  auto& c = fs.client();
  const std::string whole = c.checksum("f");  // blocking, the same engine
  std::vector<std::string> got;
  auto code = [](std::exception_ptr e, bool* remote) {
    return e ? xt::error_of([&] { std::rethrow_exception(e); }, remote) : errc::ok;
  };
  c.async_stat("f", [&](std::exception_ptr e, xdfs::pathm::Entry en) {
    REQUIRE_FALSE(e);
    CHECK(en.size == (3u << 20) + 5);
    got.push_back("stat");
  });
  c.async_mkdir("d/e", true, [&](std::exception_ptr e) {
    REQUIRE_FALSE(e);
    got.push_back("mkdir");
    c.async_rename("d/e", "d/g", [&](std::exception_ptr e) {
      CHECK_FALSE(e);
      got.push_back("rename");
    });
  });
  c.async_checksum("f", 0, 0, [&](std::exception_ptr e, std::string sum) {
    REQUIRE_FALSE(e);
    CHECK(sum == whole);
    got.push_back("checksum");
  });
  c.async_stat("nope", [&](std::exception_ptr e, xdfs::pathm::Entry) {
    bool remote = false;
    CHECK(code(e, &remote) == errc::no_such_file);
    CHECK(remote);
    got.push_back("nope");
  });
  std::set<std::string> names;
  c.async_list(
      ".", false, [&](std::vector<xdfs::pathm::Entry>& chunk) { for (auto& e : chunk) names.insert(e.path); },
      [&](std::exception_ptr e, std::size_t chunks) {
        REQUIRE_FALSE(e);
        CHECK(chunks >= 1);
        got.push_back("list");
      });
  CHECK(got.empty());  // nothing completes inside the calls
  // The path operation always has a read waiting on each channel (the server may speak at any
  // time): the loop runs until the completions are in, not until it runs out of work.
  auto& io = fs.session().io();
  io.restart();
  while (got.size() < 6 && io.run_one()) {
  }
  std::sort(got.begin(), got.end());
  CHECK(got == std::vector<std::string>{"checksum", "list", "mkdir", "nope", "rename", "stat"});
  CHECK(names.count("f") == 1);
  struct stat sb {};
  CHECK(::stat((root / "d/g").c_str(), &sb) == 0);
  CHECK(S_ISDIR(sb.st_mode));
  // A server that stops answering: every call still waiting completes with the timeout.
  REQUIRE(::kill(d.pid(), SIGSTOP) == 0);
  // kill() returns before every thread of the server has stopped: wait until it has, or a
  // busy machine lets it answer the first calls.
  REQUIRE(xt::wait_stopped(d.pid()));
  int timeouts = 0;
  int completed = 0;
  for (int k = 0; k < 3; ++k)
    c.async_stat("f", [&](std::exception_ptr e, xdfs::pathm::Entry) {
      ++completed;
      timeouts += code(e, nullptr) == errc::timeout;
    });
  io.restart();
  while (completed < 3 && io.run_one()) {
  }
  ::kill(d.pid(), SIGCONT);
  CHECK(completed == 3);
  CHECK(timeouts == 3);
  // And a call after the failure completes with it at once.
  bool after = false;
  c.async_stat("f", [&](std::exception_ptr e, xdfs::pathm::Entry) { after = code(e, nullptr) == errc::timeout; });
  io.restart();
  while (!after && io.run_one()) {
  }
  CHECK(after);
  CHECK_THROWS_AS(fs.close(), xdfs::Error);
}

TEST_CASE("async path calls still waiting when the path operation ends get their replies first") {
  xt::TempDir root;
  xt::XdfsdProcess d(root.path());
  xt::write_random_file(root / "f", 1000, 5);
  auto o = options(2);
  o.keep_alive = std::chrono::milliseconds(0);
  xdfs::RemoteFs fs({"127.0.0.1", d.port()}, o);
  int answered = 0;
  for (int k = 0; k < 8; ++k)
    fs.client().async_stat("f", [&](std::exception_ptr e, xdfs::pathm::Entry en) { answered += !e && en.size == 1000; });
  auto& io = fs.session().io();
  io.restart();
  io.poll();  // the requests leave; their replies have not been read
  fs.close();  // ends cleanly: the replies come before our EOFRs
  CHECK(answered == 8);
}

TEST_CASE("RemoteFs: single files go up and down as transfers of their own between path calls, on one session") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  auto o = options(3);
  xt::write_random_file(local / "f", (2 << 20) + 3, 9);
  {
    xdfs::RemoteFs fs({"127.0.0.1", d.port()}, o, xdfs::file_transfers(o));
    fs->mkdir("in", false);
    CHECK(fs.upload(local / "f", "in/f") == (2u << 20) + 3);
    CHECK(fs->stat("in/f").size == (2u << 20) + 3);  // a new path operation on the same channels
    fs->rename("in/f", "in/g");
    CHECK(fs.download("in/g", local / "g") == (2u << 20) + 3);
    // A refused transfer leaves it usable.
    CHECK(xt::error_of([&] { fs.download("in/nope", local / "nope"); }) == errc::no_such_file);
    CHECK(fs->stat("in/g").type == xdfs::pathm::Type::file);
    fs.close();
    CHECK(xt::error_of([&] { fs->stat("in"); }) == errc::state_violation);
  }
  CHECK(xt::files_equal(local / "f", local / "g"));
  CHECK(xt::files_equal(local / "f", root / "in/g"));
  // One session: path, upload, path (started again at once), download, path, refused download, path.
  REQUIRE(d.wait_for_log("ops=7"));
  CHECK(count(d.log(), " start peer=") == 1);
  // Without file transfers, upload says so.
  xdfs::RemoteFs plain({"127.0.0.1", d.port()}, o);
  CHECK(xt::error_of([&] { plain.upload(local / "f", "x"); }) == errc::not_supported);
  plain.close();
}

TEST_CASE("RemoteFs: idle after a transfer it stays connected; once its session ended, each call says so") {
  xt::TempDir root, local;
  auto d = std::make_unique<xt::XdfsdProcess>(root.path(), std::vector<std::string>{"--idle-timeout", "1"});
  auto o = options(2);
  o.keep_alive = std::chrono::milliseconds(200);
  xt::write_random_file(local / "f", 100000, 4);
  xdfs::Session session({"127.0.0.1", d->port()}, o);
  xdfs::RemoteFs fs(session, xdfs::file_transfers(o));
  CHECK(fs.upload(local / "f", "f") == 100000u);
  // Longer than the server waits for a session that does nothing: the keep-alives hold it.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  CHECK(fs->stat("f").size == 100000u);
  CHECK(fs.download("f", local / "g") == 100000u);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  CHECK(fs->stat("f").size == 100000u);
  // The server goes: every later call fails with the session's end (a new session may do
  // better), never with a usage error and never by hanging.
  ::kill(d->pid(), SIGKILL);
  for (int i = 0; i < 3; ++i) {
    try {
      if (i == 1)
        fs.upload(local / "f", "h");
      else
        fs->stat("f");
      FAIL("a call outlived the server");
    } catch (const xdfs::Error& e) {
      CAPTURE(i);
      // What the server's going did, then that the session is over.
      CHECK_MESSAGE(e.code() == (i < 2 ? errc::peer_aborted : errc::session_ended), e.what());
      CHECK(e.recovery() == xdfs::Recovery::reconnect);
    }
  }
  CHECK(xt::error_of([&] { xdfs::upload(session, local / "f", "h", o); }) == errc::session_ended);
  CHECK_FALSE(fs.remote_error());
  CHECK_NOTHROW(fs.close());
  session.close();
}

TEST_CASE("a session's set-up is paid once: later operations take no handshake; 256 channels join a default xdfsd") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  // 256 channels against the default limits: 64 connections still proving themselves per
  // source address. The client joins a few at a time, so none pushes another out.
  auto o = options(256);
  xt::write_random_file(local / "f", 4096, 1);
  xdfs::Session s({"127.0.0.1", d.port()}, o);
  auto first = xdfs::upload(s, local / "f", "f", o);
  CHECK(first.channels == 256);
  CHECK(s.setup_seconds() > 0);
  for (int i = 0; i < 5; ++i) xdfs::upload(s, local / "f", "f" + std::to_string(i), o);
  s.close();
  // Every channel connected and authenticated once: the server saw 256, not 6 x 256.
  REQUIRE(d.wait_for_log("ops=6"));
  CHECK(count(d.log(), " start peer=") == 1);
}

TEST_CASE("per-transfer keys: no (key, nonce) pair repeats across transfers and directions") {
  // A block's nonce is its offset; its key is the transfer's and direction's. Over many
  // transfers of the same offsets both ways, every (key, nonce) pair is distinct.
  xdfs::xsec::Key32 secret{};
  secret[3] = 9;
  std::set<std::pair<xdfs::xsec::Key32, std::uint64_t>> seen;
  std::size_t uses = 0;
  for (std::uint64_t transfer = 0; transfer < 64; ++transfer)
    for (bool c2s : {true, false}) {
      const auto key = xdfs::xsec::data_key(secret, c2s, transfer);
      for (std::uint64_t offset = 0; offset < (8u << 20); offset += 1u << 20) {
        seen.insert({key, offset});
        ++uses;
      }
    }
  CHECK(seen.size() == uses);
  // And sealing the same bytes at the same offset in two transfers gives different tags.
  std::vector<std::uint8_t> a(4096 + 16, 1), b(4096 + 16, 1);
  xdfs::xsec::BlockCrypto t0(xdfs::xsec::Protect::private_, xdfs::xsec::Cipher::aes256gcm,
                             xdfs::xsec::data_key(secret, true, 0));
  xdfs::xsec::BlockCrypto t1(xdfs::xsec::Protect::private_, xdfs::xsec::Cipher::aes256gcm,
                             xdfs::xsec::data_key(secret, true, 1));
  const xdfs::DataLength len(4096);
  const xdfs::FileOffset at(0);
  t0.seal(a.data(), len, at);
  t1.seal(b.data(), len, at);
  CHECK(a != b);
  // The receiver of transfer 1 refuses a block sealed for transfer 0 (a replay across transfers).
  CHECK_FALSE(t1.open(a.data(), len, at));
}

}  // TEST_SUITE("session")

namespace {

// A raw client's next operation: its negotiation as a NEGO frame on a channel.
void send_nego(xt::RawPeer& c, const xdfs::wire::Negotiation& n) {
  auto payload = xdfs::wire::encode(n);
  xdfs::wire::FrameHeader h;
  h.event = ChannelEvent::nego;
  h.length = static_cast<std::uint32_t>(payload.size());
  c.send_frame(h, payload);
}

void send_eofr(xt::RawPeer& c, std::uint64_t size) {
  xdfs::wire::FrameHeader h;
  h.event = ChannelEvent::eofr;
  h.offset = size;
  c.send_frame(h);
}

// Reads until the server's answer to an operation's negotiation on this channel.
std::optional<xt::Frame> answer(xt::RawPeer& c) { return c.read_frame(); }

// Sends a whole small upload's blocks and EOFR on one channel, then reads until the server's EOFR.
bool upload_on(xt::RawPeer& c, const std::vector<std::uint8_t>& data, std::uint32_t bs) {
  for (std::uint64_t off = 0; off < data.size(); off += bs)
    c.send_block(ChannelEvent::xftsmu, off,
                 std::vector<std::uint8_t>(data.begin() + static_cast<long>(off),
                                           data.begin() + static_cast<long>(std::min<std::uint64_t>(off + bs, data.size()))));
  send_eofr(c, data.size());
  for (auto f = c.read_frame(); f; f = c.read_frame())
    if (f->first.event == ChannelEvent::eofr) return f->first.offset == data.size();
    else if (f->first.event != ChannelEvent::ack) return false;
  return false;
}

}  // namespace

TEST_SUITE("session") {

TEST_CASE("bad input: a new operation while a transfer runs is refused naming state and event; earlier work stays") {
  xt::TempDir root;
  xt::XdfsdProcess d(root.path());
  const auto a = xt::random_bytes(100000, 1);
  auto h = xt::make_hello(Mode::upload, "a", 1, a.size());
  xt::RawChannel c(d.port());
  REQUIRE(c.establish(h));
  REQUIRE(answer(c)->first.event == ChannelEvent::nego_reply);
  REQUIRE(upload_on(c, a, h.nego.block_size));
  // Operation 1: an upload of b, cut after one block by a switch to path mode.
  auto n = h.nego;
  n.transfer = 1;
  n.remote_path = "b";
  n.file_size = 300000;
  send_nego(c, n);
  REQUIRE(answer(c)->first.event == ChannelEvent::nego_reply);
  c.send_block(ChannelEvent::xftsmu, 0, std::vector<std::uint8_t>(h.nego.block_size, 7));
  auto sw = h.nego;
  sw.transfer = 2;
  sw.mode = Mode::path;
  sw.remote_path = ".";
  send_nego(c, sw);
  auto ex = c.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->code == errc::protocol_error);
  CHECK(ex->message.find("unexpected NEGO on channel 0 in state transferring") != std::string::npos);
  CHECK(c.wait_closed());
  CHECK(xt::read_file(root / "a") == std::string(a.begin(), a.end()));
  CHECK_FALSE(xt::exists(root / "b"));
  xt::check_no_partials(root.path());
  CHECK(d.wait_for_log("status=error: protocol error"));
}

TEST_CASE("bad input: EOFR on fewer than n channels, then a new operation, fails the session; earlier work stays") {
  xt::TempDir root;
  xt::XdfsdProcess d(root.path());
  const std::uint32_t bs = 64 * 1024;
  const auto a = xt::random_bytes(4 * bs, 2);
  auto h = xt::make_hello(Mode::upload, "a", 2, a.size());
  xt::RawChannel c0(d.port()), c1(d.port());
  REQUIRE(c0.establish(h));
  REQUIRE(c1.join(h, 1, c0.session_secret()));
  REQUIRE(answer(c0)->first.event == ChannelEvent::nego_reply);
  REQUIRE(answer(c1)->first.event == ChannelEvent::nego_reply);
  // Operation 0 in two halves, one per channel.
  std::vector<std::uint8_t> first(a.begin(), a.begin() + 2 * bs), second(a.begin() + 2 * bs, a.end());
  c0.send_block(ChannelEvent::xftsmu, 0, std::vector<std::uint8_t>(a.begin(), a.begin() + bs));
  c0.send_block(ChannelEvent::xftsmu, bs, std::vector<std::uint8_t>(a.begin() + bs, a.begin() + 2 * bs));
  c1.send_block(ChannelEvent::xftsmu, 2 * bs, std::vector<std::uint8_t>(a.begin() + 2 * bs, a.begin() + 3 * bs));
  c1.send_block(ChannelEvent::xftsmu, 3 * bs, std::vector<std::uint8_t>(a.begin() + 3 * bs, a.end()));
  send_eofr(c0, a.size());
  send_eofr(c1, a.size());
  for (auto* c : {&c0, &c1}) {
    auto f = c->read_frame();
    while (f && f->first.event == ChannelEvent::ack) f = c->read_frame();
    REQUIRE(f.has_value());
    CHECK(f->first.event == ChannelEvent::eofr);
  }
  // Operation 1: blocks on both, EOFR on channel 0 only, then the next operation on both.
  auto n = h.nego;
  n.transfer = 1;
  n.remote_path = "b";
  n.file_size = 2 * bs;
  send_nego(c0, n);
  send_nego(c1, n);
  REQUIRE(answer(c0)->first.event == ChannelEvent::nego_reply);
  REQUIRE(answer(c1)->first.event == ChannelEvent::nego_reply);
  c0.send_block(ChannelEvent::xftsmu, 0, std::vector<std::uint8_t>(bs, 1));
  c1.send_block(ChannelEvent::xftsmu, bs, std::vector<std::uint8_t>(bs, 2));
  send_eofr(c0, 2 * bs);
  n.transfer = 2;
  n.remote_path = "c";
  send_nego(c0, n);
  send_nego(c1, n);
  auto ex = c1.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->message.find("unexpected NEGO on channel 1 in state transferring") != std::string::npos);
  CHECK(xt::read_file(root / "a") == std::string(a.begin(), a.end()));
  CHECK_FALSE(xt::exists(root / "b"));
  CHECK_FALSE(xt::exists(root / "c"));
  xt::check_no_partials(root.path());
}

TEST_CASE("bad input: a reused transfer number and a disabled mode are refused; the session goes on") {
  xt::TempDir root;
  xt::XdfsdProcess d(root.path(), {"--disable-mode", "path"});
  const auto a = xt::random_bytes(70000, 3);
  auto h = xt::make_hello(Mode::upload, "a", 1, a.size());
  xt::RawChannel c(d.port());
  REQUIRE(c.establish(h));
  REQUIRE(answer(c)->first.event == ChannelEvent::nego_reply);
  REQUIRE(upload_on(c, a, h.nego.block_size));
  auto n = h.nego;
  n.remote_path = "again";  // transfer 0 once more: its keys and nonces were used
  send_nego(c, n);
  auto ex = c.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->refused);
  CHECK(ex->message.find("NEGO of operation 0 refused in state ready: transfer number 0 is not above the last one") !=
        std::string::npos);
  n.transfer = 5;
  n.mode = Mode::path;
  n.remote_path = ".";
  send_nego(c, n);
  ex = c.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->refused);
  CHECK(ex->code == errc::not_supported);
  CHECK(ex->message.find("mode path is disabled on this server") != std::string::npos);
  // Still a session: the next upload goes through.
  n.transfer = 6;
  n.mode = Mode::upload;
  n.remote_path = "b";
  send_nego(c, n);
  REQUIRE(answer(c)->first.event == ChannelEvent::nego_reply);
  REQUIRE(upload_on(c, a, h.nego.block_size));
  CHECK(xt::read_file(root / "b") == std::string(a.begin(), a.end()));
  CHECK_FALSE(xt::exists(root / "again"));
  // A client's path session is refused from the start, with the reason.
  xt::TempDir local;
  auto r = xt::xduc({"-q", "ls", url(d, "")});
  CHECK(r.status == 1);
  CHECK(r.err.find("not supported (server)") != std::string::npos);
  CHECK(r.err.find("mode path is disabled on this server") != std::string::npos);
}

}  // TEST_SUITE("session")

#include "xdfs/detail/session_fsm.hpp"

TEST_SUITE("session") {

TEST_CASE("the session tables: every row is reachable from idle, final states have no rows, and a refused event is named") {
  namespace sf = xdfs::session_fsm;
  for (auto side : {sf::Side::server, sf::Side::client}) {
    CAPTURE(sf::to_string(side));
    check_graph(sf::table(side));
  }
  sf::Machine m(sf::Side::server);
  CHECK(m.fire(sf::SessionEvent::channel_joined) == sf::SessionAction::register_session);
  CHECK(m.fire(sf::SessionEvent::all_joined) == sf::SessionAction::start_operation);
  CHECK(m.fire(sf::SessionEvent::operation_ended) == sf::SessionAction::await_next);
  CHECK_FALSE(m.fire(sf::SessionEvent::operation_ended).has_value());  // nothing runs in ready
  CHECK(m.why() == "session-server: event operation_ended is not allowed in state ready");
  CHECK(m.state() == sf::State::ready);
  CHECK(m.fire(sf::SessionEvent::operation_asked) == sf::SessionAction::start_operation);
  CHECK(m.fire(sf::SessionEvent::operation_refused) == sf::SessionAction::refuse_operation);
  CHECK(m.fire(sf::SessionEvent::end_asked) == sf::SessionAction::finish);
  CHECK(m.finished());
}

TEST_CASE("the path tables: every row reachable, every live state can fail, an EOFR out of turn is named") {
  namespace pm = xdfs::pathm;
  for (auto side : {pm::PathSide::client, pm::PathSide::server}) {
    CAPTURE(pm::to_string(side));
    const auto rows = pm::table(side);
    check_graph(rows);
    std::set<pm::PathState> live;
    for (const auto& t : rows)
      if (t.from != pm::PathState::idle) live.insert(t.from);
    // Every live state has the four ways to fail, each to failed with abort.
    for (auto st : live)
      for (auto e : {pm::PathEvent::peer_exception, pm::PathEvent::local_error, pm::PathEvent::channel_lost,
                     pm::PathEvent::timeout}) {
        std::size_t n = 0;
        for (const auto& t : rows)
          n += t.from == st && t.on == e && t.to == pm::PathState::failed && t.action == pm::PathAction::abort;
        CHECK_MESSAGE(n == 1, pm::to_string(st) << " " << pm::to_string(e));
      }
  }
  // The client: requests and replies, then the end; the server's EOFR before the client ended
  // is not in the table.
  pm::PathMachine c(pm::PathSide::client);
  CHECK(c.fire(pm::PathEvent::accepted) == pm::PathAction::serve);
  CHECK(c.fire(pm::PathEvent::request) == pm::PathAction::send_request);
  CHECK(c.fire(pm::PathEvent::reply) == pm::PathAction::deliver_reply);
  CHECK_FALSE(c.fire(pm::PathEvent::committed).has_value());
  CHECK(c.why() == "client-path: event committed is not allowed in state serving");
  CHECK(c.fire(pm::PathEvent::end_asked) == pm::PathAction::send_eofr);
  CHECK_FALSE(c.fire(pm::PathEvent::request).has_value());  // no request after the end
  CHECK(c.fire(pm::PathEvent::committed) == pm::PathAction::finish);
  CHECK(c.state() == pm::PathState::done);
  // The server: a request after every channel ended is not in the table.
  pm::PathMachine sv(pm::PathSide::server);
  CHECK(sv.fire(pm::PathEvent::accepted) == pm::PathAction::serve);
  CHECK(sv.fire(pm::PathEvent::request) == pm::PathAction::execute);
  CHECK(sv.fire(pm::PathEvent::all_ended) == pm::PathAction::none);
  CHECK_FALSE(sv.fire(pm::PathEvent::request).has_value());
  CHECK(sv.why() == "server-path: event request is not allowed in state ending");
  CHECK(sv.fire(pm::PathEvent::replied) == pm::PathAction::none);
  CHECK(sv.fire(pm::PathEvent::all_answered) == pm::PathAction::send_eofr);
  CHECK(sv.fire(pm::PathEvent::committed) == pm::PathAction::finish);
  CHECK(sv.finished());
}

}  // TEST_SUITE("session")

TEST_SUITE("session") {

TEST_CASE("bad input: after a refused first operation, the session's own parameters still cannot change") {
  // A refusal leaves the session ready; the next NEGO must still keep the block size, channel
  // count, window and flags the server admitted (a block size of 0 once divided by zero).
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  auto h = xt::make_hello(Mode::download, "missing", 1);
  xt::RawChannel c(d.port());
  REQUIRE(c.establish(h));
  auto ex = c.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->refused);
  CHECK(ex->code == errc::no_such_file);
  for (int k = 0; k < 3; ++k) {
    auto n = h.nego;
    n.transfer = 1 + static_cast<std::uint64_t>(k);
    n.remote_path = "x";
    n.mode = Mode::upload;
    n.file_size = 10;
    if (k == 0) n.block_size = 0;
    if (k == 1) n.extended_flags = xdfs::wire::flag_memory;  // this server does not allow memory mode
    if (k == 2) n.block_size = 0xffffffc0u;
    send_nego(c, n);
    ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->refused);
    CHECK_MESSAGE(ex->message.find("are the session's and cannot change") != std::string::npos, ex->message);
  }
  // A transfer number used by a refused operation is used.
  auto n = h.nego;
  n.transfer = 3;
  n.remote_path = "y";
  send_nego(c, n);
  ex = c.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->message.find("transfer number 3 is not above the last one (3)") != std::string::npos);
  CHECK(d.alive());
  xt::check_serving(d.port(), root.path(), local.path());
}

}  // TEST_SUITE("session")
