// Path mode (xPathM): remote path operations and directory trees, against a real server (in
// process, or a real xdfsd driven by a real xduc), on real files and loopback sockets.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <dirent.h>
#include <atomic>
#include <filesystem>
#include <map>
#include <set>
#include <thread>

#include "support.hpp"
#include "xdfs/xdfs.hpp"
#include "xdfs/files.hpp"
#include "xdfs/pathm/fsops.hpp"
#include "xdfs/pathm/messages.hpp"
#include "xdfs/xdfs.hpp"

using xdfs::errc;
namespace pm = xdfs::pathm;
namespace fs = std::filesystem;

namespace {

// Everything about an entry a tree copy must keep, keyed by path below the tree's root.
struct Seen {
  char type = '?';
  unsigned mode = 0;
  std::uint64_t size = 0;
  std::int64_t mtime = 0;
  std::string content;  // file bytes, or symlink target
  bool operator==(const Seen&) const = default;
};

std::map<std::string, Seen> snapshot(const std::string& root, bool with_dir_mtimes = true) {
  std::map<std::string, Seen> out;
  std::vector<std::string> todo{""};
  while (!todo.empty()) {
    const std::string rel = todo.back();
    todo.pop_back();
    DIR* d = ::opendir((root + "/" + rel).c_str());
    REQUIRE(d != nullptr);
    while (auto* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n == "." || n == "..") continue;
      const std::string r = rel.empty() ? n : rel + "/" + n;
      const std::string full = root + "/" + r;
      struct stat st {};
      REQUIRE(::lstat(full.c_str(), &st) == 0);
      Seen s;
      s.mode = st.st_mode & 07777;
      s.mtime = st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
      if (S_ISDIR(st.st_mode)) {
        s.type = 'd';
        if (!with_dir_mtimes) s.mtime = 0;
        todo.push_back(r);
      } else if (S_ISLNK(st.st_mode)) {
        s.type = 'l';
        s.content = fs::read_symlink(full).string();
      } else if (S_ISREG(st.st_mode)) {
        s.type = 'f';
        s.size = static_cast<std::uint64_t>(st.st_size);
        s.content = xt::read_file(full);
      }
      out[r] = s;
    }
    ::closedir(d);
  }
  return out;
}

void set_mtime(const std::string& path, std::int64_t ns) {
  const timespec ts[2] = {{ns / 1000000000, ns % 1000000000}, {ns / 1000000000, ns % 1000000000}};
  REQUIRE(::utimensat(AT_FDCWD, path.c_str(), ts, AT_SYMLINK_NOFOLLOW) == 0);
}

// The tree the issue asks for: nested and empty directories, 0-byte files, symlinks, non-ASCII
// names, one directory of `many` files, and files large enough to be split into chunks.
void make_tree(const std::string& t, int many) {
  for (const char* d : {"a", "a/b", "a/b/c", "empty", "a/empty2", "ünïcødé", "many"})
    REQUIRE(::mkdir((t + "/" + d).c_str(), 0755) == 0);
  xt::write_file(t + "/zero", "");
  xt::write_file(t + "/a/b/c/zero2", "");
  xt::write_file(t + "/a/hello.txt", "hello\n");
  xt::write_file(t + "/ünïcødé/日本語 テキスト.txt", "konnichiwa");
  xt::write_random_file(t + "/a/b/large", (3 << 20) + 4321, 7);   // four chunks of 1 MiB
  xt::write_random_file(t + "/a/medium", 300000, 8);              // one chunk, larger than a small file
  for (int i = 0; i < many; ++i) xt::write_random_file(t + "/many/f" + std::to_string(i), (i * 37) % 3000, i);
  REQUIRE(::symlink("a/hello.txt", (t + "/link").c_str()) == 0);
  REQUIRE(::symlink("../nowhere", (t + "/a/dangling").c_str()) == 0);
  ::chmod((t + "/a/hello.txt").c_str(), 0600);
  ::chmod((t + "/a/medium").c_str(), 0755);
  ::chmod((t + "/a/b").c_str(), 0750);
  ::chmod((t + "/empty").c_str(), 0700);
  std::int64_t ns = 1600000000123456789LL;
  for (auto& e : fs::recursive_directory_iterator(t)) {
    ns += 1000000007;
    set_mtime(e.path().string(), ns);
  }
  // Directories last: setting their children's times does not touch them, but be explicit.
  for (const char* d : {"a", "a/b", "a/b/c", "empty", "a/empty2", "ünïcødé", "many"}) set_mtime(t + "/" + d, ns += 3);
}

std::string url(std::uint16_t port, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(port) + "/" + path;
}

std::size_t count_files(const std::string& dir) {
  std::size_t n = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
    if (it->is_regular_file(ec)) ++n;
  return n;
}

// The code of the xdfs::Error fn throws (errc::ok if none).
errc code_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const xdfs::Error& e) {
    return e.code();
  }
  return errc::ok;
}

// xduc as a child process with its output discarded (to be killed by the test); -1 on failure.
pid_t spawn_xduc(const std::vector<std::string>& args) {
  std::vector<char*> argv{const_cast<char*>(XDUC_PATH)};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::dup2(null, 2);
    ::execv(XDUC_PATH, argv.data());
    ::_exit(127);
  }
  return pid;
}

void check_no_temp_files(const std::string& dir) {
  for (auto& e : fs::recursive_directory_iterator(dir))
    CHECK_MESSAGE(e.path().filename().string().find(".xdfs-") == std::string::npos, e.path().string());
}

// What our encoder cannot write and a hostile peer's can: the second byte of `text` (found in the
// encoded message) becomes a NUL. False if the text is not there.
bool nul_inside(pm::Encoded& enc, const std::string& text) {
  auto raw = enc.bytes();
  auto at = std::search(raw.begin(), raw.end(), text.begin(), text.end());
  if (at == raw.end()) return false;
  at[1] = 0;
  return true;
}

}  // namespace

TEST_SUITE("pathm") {

TEST_CASE("copy_exact copies a range in the kernel (copy_file_range or splice) or through a buffer; put_copy from a short source leaves nothing") {
  xt::TempDir d;
  xt::write_random_file(d / "src", 3 << 20, 7);
  const std::string src = xt::read_file(d / "src");
  // Same file system (the kernel copies), and from tmpfs to this one where /dev/shm is one
  // (copy_file_range refuses across file systems of different kinds: splice through a pipe
  // copies; the buffer only tells a short source's end).
  std::vector<std::string> from{d / "src"};
  if (fs::is_directory("/dev/shm")) {
    char shm[] = "/dev/shm/xdfs-copy-XXXXXX";
    const int f = ::mkstemp(shm);
    REQUIRE(f >= 0);
    ::close(f);
    fs::copy_file(d / "src", shm, fs::copy_options::overwrite_existing);
    from.push_back(shm);
  }
  for (const auto& path : from) {
    CAPTURE(path);
    xdfs::files::Fd in(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    xdfs::files::Fd out(::open((d / "dst").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    REQUIRE(in);
    REQUIRE(out);
    REQUIRE(pm::copy_exact(in.get(), 1000, out.get(), 5, (2 << 20) + 3, "src", "dst"));
    CHECK(xt::read_file(d / "dst") == std::string(5, '\0') + src.substr(1000, (2 << 20) + 3));
    // Past the source's end: a size mismatch, whichever way it copies.
    const auto s = pm::copy_exact(in.get(), (3 << 20) - 10, out.get(), 0, 100, "src", "dst");
    CHECK(s.code == errc::size_mismatch);
    CHECK(pm::copy_exact(in.get(), 0, out.get(), std::uint64_t(1) << 63, 1, "src", "dst").code == errc::bad_argument);
    if (path != d / "src") fs::remove(path);
  }
  {
    // Not into an appending descriptor (its writes would not land where told), not over itself.
    xdfs::files::Fd app(::open((d / "app").c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
    xdfs::files::Fd in(::open((d / "src").c_str(), O_RDONLY | O_CLOEXEC));
    CHECK(pm::copy_exact(in.get(), 0, app.get(), 0, 10, "src", "app").code == errc::bad_argument);
    xdfs::files::Fd self(::open((d / "src").c_str(), O_RDWR | O_CLOEXEC));
    CHECK(pm::copy_exact(self.get(), 0, self.get(), 100, 1000, "src", "src").code == errc::bad_argument);
    CHECK(pm::copy_exact(self.get(), 0, self.get(), 1000, 1000, "src", "src"));
    CHECK(xt::read_file(d / "src") == src.substr(0, 1000) + src.substr(0, 1000) + src.substr(2000));
  }
  // A whole file from the pack-like source, and one the source cannot fill: nothing under its
  // name, no temporary file.
  fs::create_directory(d / "tree");
  xdfs::files::Fd root(::open((d / "tree").c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  xdfs::files::Fd in(::open((d / "src").c_str(), O_RDONLY | O_CLOEXEC));
  pm::TreeWriter w(root.get(), "t", false, 65536);
  pm::Entry e;
  e.path = "a/b";
  e.mode = 0640;
  e.mtime_ns = 1'600'000'000'000'000'000;
  e.size = 70000;
  REQUIRE(w.put_copy(e, in.get(), 12345));
  CHECK(xt::read_file(d / "tree/a/b") == src.substr(12345, 70000));
  struct stat st {};
  REQUIRE(::stat((d / "tree/a/b").c_str(), &st) == 0);
  CHECK(st.st_mtim.tv_sec == 1'600'000'000);
  e.path = "a/c";
  CHECK(w.put_copy(e, in.get(), (3 << 20) - 100).code == errc::size_mismatch);
  CHECK(!fs::exists(d / "tree/a/c"));
  CHECK(std::distance(fs::directory_iterator(d / "tree/a"), fs::directory_iterator{}) == 1);
  e.path = "../x";
  CHECK(!w.put_copy(e, in.get(), 0));
  CHECK(!fs::exists(d / "x"));
}

TEST_CASE("path messages round trip and hostile ones are refused") {
  pm::Request r;
  r.id = 77;
  r.op = pm::Op::put;
  r.path = "dir";
  std::vector<std::uint8_t> bytes{1, 2, 3, 4, 5};
  pm::Entry e;
  e.path = "dir/ü";
  e.size = 5;
  e.mode = 0640;
  e.mtime_ns = -5;
  e.data = bytes;
  r.entries.push_back(e);
  auto enc = pm::encode(r);
  auto back = pm::decode_request(enc.bytes());
  REQUIRE(back.has_value());
  CHECK(back->id == 77);
  CHECK(back->op == pm::Op::put);
  REQUIRE(back->entries.size() == 1);
  CHECK(back->entries[0].path == "dir/ü");
  CHECK(back->entries[0].mtime_ns == -5);
  CHECK(std::vector<std::uint8_t>(back->entries[0].data.begin(), back->entries[0].data.end()) == bytes);

  // Built in place: the same message, no flattening.
  auto w = pm::Writer::request(78, pm::Op::put, 2, 10);
  auto d0 = w.set(0, e, 5);
  std::copy(bytes.begin(), bytes.end(), d0.begin());
  e.path = "other";
  w.set(1, e, 0);
  auto built = w.finish();
  auto b2 = pm::decode_request(built.bytes());
  REQUIRE(b2.has_value());
  CHECK(b2->id == 78);
  REQUIRE(b2->entries.size() == 2);
  CHECK(b2->entries[0].data.size() == 5);
  CHECK(b2->entries[0].data[4] == 5);
  CHECK(b2->entries[1].path == "other");

  std::string why;
  std::vector<std::uint64_t> junk(16, 0xFFFFFFFFFFFFFFFFull);
  CHECK_FALSE(pm::decode_request({reinterpret_cast<std::uint8_t*>(junk.data()), 128}, &why).has_value());
  CHECK_FALSE(why.empty());
  CHECK_FALSE(pm::decode_request({reinterpret_cast<std::uint8_t*>(junk.data()), 13}, &why).has_value());
  pm::Request big;
  big.entries.resize(pm::max_entries + 1);
  auto many = pm::encode(big);
  CHECK_FALSE(pm::decode_request(many.bytes(), &why).has_value());
  CHECK(why.find("entries") != std::string::npos);
  pm::Request nul;
  nul.path = "a\x01b";
  auto withnul = pm::encode(nul);
  REQUIRE(nul_inside(withnul, nul.path));
  CHECK_FALSE(pm::decode_request(withnul.bytes(), &why).has_value());
  CHECK(why.find("NUL") != std::string::npos);

  // An entry's failure travels with it; its message is bounded, and a NUL in it is refused.
  pm::Reply failed;
  failed.entries.resize(2);
  failed.entries[1].code = errc::is_directory;
  failed.entries[1].message = "x\x01y" + std::string(5000, 'm');
  auto fenc = pm::encode(failed);
  auto fback = pm::decode_reply(fenc.bytes(), &why);
  REQUIRE(fback.has_value());
  CHECK(fback->entries[0].code == errc::ok);
  CHECK(fback->entries[1].code == errc::is_directory);
  // Cut to 4096 bytes when sent, then shown escaped when received: one printable line.
  CHECK(fback->entries[1].message.rfind("x\\x01ym", 0) == 0);
  CHECK(fback->entries[1].message.size() == 4096 + 3);
  REQUIRE(nul_inside(fenc, "x\x01y"));
  CHECK_FALSE(pm::decode_reply(fenc.bytes(), &why).has_value());
  CHECK(why.find("entry message contains a NUL") != std::string::npos);
  // A code this side does not know is a protocol error, never "ok".
  pm::Reply unknown;
  unknown.entries.resize(1);
  unknown.entries[0].code = static_cast<errc>(250);
  unknown.entries[0].message = "?";
  auto uback = pm::decode_reply(pm::encode(unknown).bytes(), &why);
  REQUIRE(uback.has_value());
  CHECK(uback->entries[0].code == errc::protocol_error);
}

TEST_CASE("stat, list, mkdir, remove, rename and checksum on a server") {
  xt::TempDir root;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  xdfs::TransferOptions o;
  o.channels = 3;
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()}, o);
  auto& c = rfs.client();

  c.mkdir("x/y/z", true);
  CHECK(fs::is_directory(root / "x/y/z"));
  CHECK(code_of([&] { c.mkdir("x/y/z", false); }) == errc::io_error);
  CHECK(code_of([&] { c.mkdir("nope/deeper", false); }) == errc::no_such_file);
  xt::write_random_file(root / "x/data", 2500000, 3);
  auto e = c.stat("x/data");
  CHECK(e.type == pm::Type::file);
  CHECK(e.size == 2500000);
  CHECK(c.stat("x/").type == pm::Type::directory);
  CHECK(c.stat(".").type == pm::Type::directory);
  CHECK(code_of([&] { c.stat("missing"); }) == errc::no_such_file);

  std::set<std::string> names;
  c.list("x", false, [&](std::vector<pm::Entry>& chunk) {
    for (auto& x : chunk) names.insert(x.path);
  });
  CHECK(names == std::set<std::string>{"data", "y"});
  names.clear();
  c.list("x", true, [&](std::vector<pm::Entry>& chunk) {
    for (auto& x : chunk) names.insert(x.path);
  });
  CHECK(names == std::set<std::string>{"data", "y", "y/z"});
  CHECK(code_of([&] { c.list("x/data", false, [](auto&) {}); }) == errc::not_regular_file);

  // The SHA-256 of the whole file and of a range agree with a local computation.
  auto local = xt::read_file(root / "x/data");
  xt::TempDir tmp;
  xt::write_file(tmp / "whole", local);
  xt::write_file(tmp / "part", local.substr(1000, 5000));
  auto sum = [&](const std::string& p) {
    auto r = xt::run("/usr/bin/sha256sum", {p});
    return r.out.substr(0, 64);
  };
  CHECK(c.checksum("x/data") == sum(tmp / "whole"));
  CHECK(c.checksum("x/data", 1000, 5000) == sum(tmp / "part"));
  CHECK(code_of([&] { c.checksum("x"); }) == errc::is_directory);

  c.rename("x/data", "x/y/moved");
  CHECK(xt::exists(root / "x/y/moved"));
  CHECK_FALSE(xt::exists(root / "x/data"));
  CHECK(code_of([&] { c.remove("x", false); }) == errc::is_directory);
  c.remove("x/y/moved", false);
  CHECK_FALSE(xt::exists(root / "x/y/moved"));
  c.remove("x", true);
  CHECK_FALSE(xt::exists(root / "x"));
  CHECK(code_of([&] { c.remove(".", true); }) == errc::permission_denied);
  CHECK(code_of([&] { c.remove("x", true); }) == errc::no_such_file);
  rfs.close();
  CHECK(srv.wait_for_log("mode=path"));
  CHECK(srv.wait_for_log("status=ok"));
}

TEST_CASE("a path escape is refused in every operation, and the server keeps serving") {
  xt::TempDir root, outside, local;
  xt::write_file(outside / "secret", "outside the root");
  ::mkdir((root / "in").c_str(), 0755);
  xt::write_file(root / "in/f", "inside");
  REQUIRE(::symlink(outside.path().c_str(), (root / "out").c_str()) == 0);
  ::mkdir((local / "tree").c_str(), 0755);
  xt::write_file(local / "tree/f", "x");
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  xdfs::TransferOptions o;
  o.channels = 2;
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()}, o);
  auto& c = rfs.client();
  auto escape = [](const std::function<void()>& fn) { return code_of(fn) == errc::path_escape; };
  auto nothing = [](auto&) {};
  for (const std::string bad : {"../x", "/etc", "in/../../x", "out/secret", "out/new"}) {
    CAPTURE(bad);
    CHECK(escape([&] { c.stat(bad); }));
    CHECK(escape([&] { c.list(bad, false, nothing); }));
    CHECK(escape([&] { c.list(bad, true, nothing); }));
    CHECK(escape([&] { c.mkdir(bad, false); }));
    CHECK(escape([&] { c.mkdir(bad + "/deeper", true); }));
    CHECK(escape([&] { c.remove(bad, true); }));
    CHECK(escape([&] { c.rename("in/f", bad); }));
    CHECK(escape([&] { c.rename(bad, "in/g"); }));
    CHECK(escape([&] { c.checksum(bad); }));
    pm::Entry e;
    e.path = bad;
    e.size = 1;
    static const std::uint8_t one = 'x';
    e.data = {&one, 1};
    CHECK(escape([&] { c.put({e}); }));
    e.type = pm::Type::directory;
    e.size = 0;
    e.data = {};
    CHECK(escape([&] { c.put({e}); }));
    e.type = pm::Type::symlink;
    e.target = "/etc/passwd";
    CHECK(escape([&] { c.put({e}); }));
    CHECK(escape([&] { c.upload_tree(local / "tree", bad, {}); }));
    CHECK(escape([&] { c.download_tree(bad, local / "back", {}); }));
  }
  // Nothing appeared outside, the target of the symlink is untouched.
  CHECK(xt::list_dir(outside.path()) == std::vector<std::string>{"secret"});
  CHECK(xt::read_file(outside / "secret") == "outside the root");
  CHECK_FALSE(xt::exists(local / "back"));
  // A symlink inside the root pointing out is itself a name in the root: it may be stat'ed.
  CHECK(c.stat("out").type == pm::Type::symlink);
  // And the session still works.
  c.upload_tree(local / "tree", "in/tree", {});
  CHECK(xt::read_file(root / "in/tree/f") == "x");
  rfs.close();
}

TEST_CASE("a tree goes up and comes back identical: content, type, mode, mtime") {
  xt::TempDir root, local;
  const std::string src = local / "src";
  ::mkdir(src.c_str(), 0755);
  make_tree(src, 10000);
  xt::XdfsdProcess d(root.path());
  auto up = xt::xduc({"-p", "4", "-r", "--json", src + "/", url(d.port(), "tree")});
  REQUIRE_MESSAGE(up.status == 0, up.err);
  CHECK(up.out.find("\"files\":10006") != std::string::npos);
  CHECK(up.out.find("\"symlinks\":2") != std::string::npos);
  const auto want = snapshot(src);
  CHECK(want.size() == 10015);
  const auto there = snapshot(root / "tree");
  CHECK(there.size() == want.size());
  for (const auto& [p, s] : want) {
    CAPTURE(p);
    auto it = there.find(p);
    REQUIRE(it != there.end());
    CHECK(it->second == s);
  }
  // Files are batched: far fewer requests than files.
  auto pos = up.out.find("\"requests\":");
  REQUIRE(pos != std::string::npos);
  CHECK(std::stoul(up.out.substr(pos + 11)) < 1000);

  // Without the trailing slash the directory itself is copied into DST.
  auto down = xt::xduc({"-q", "-p", "3", "-r", url(d.port(), "tree"), local / "back"});
  REQUIRE_MESSAGE(down.status == 0, down.err);
  const auto back = snapshot(local / "back/tree");
  CHECK(back.size() == want.size());
  for (const auto& [p, s] : want) {
    CAPTURE(p);
    auto it = back.find(p);
    REQUIRE(it != back.end());
    CHECK(it->second == s);
  }
  check_no_temp_files(root.path());
  check_no_temp_files(local / "back");
  CHECK(d.wait_for_log("mode=path"));
}

TEST_CASE("many large files split into small chunks over many channels, both ways") {
  // The first chunks of one file often reach two server workers at once: only one may create it.
  xt::TempDir root, local;
  const std::string src = local / "src";
  ::mkdir(src.c_str(), 0755);
  for (int i = 0; i < 24; ++i) xt::write_random_file(src + "/big" + std::to_string(i), (1 << 20) + i * 4099, 500 + i);
  xt::XdfsdProcess d(root.path());
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    const std::string dst = "up" + std::to_string(round);
    auto up = xt::xduc({"-q", "-p", "8", "--block-size", "16K", "-r", src + "/", url(d.port(), dst)});
    REQUIRE_MESSAGE(up.status == 0, up.err);
    CHECK(snapshot(root / dst) == snapshot(src));
    auto down = xt::xduc({"-q", "-p", "8", "--block-size", "16K", "-r", url(d.port(), dst + "/"), local / ("down" + std::to_string(round))});
    REQUIRE_MESSAGE(down.status == 0, down.err);
    CHECK(snapshot(local / ("down" + std::to_string(round))) == snapshot(src));
  }
  check_no_temp_files(root.path());
}

TEST_CASE("large files in progress: at most 256 per session; one given up frees its place and is refused after") {
  xt::TempDir root;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  xdfs::TransferOptions o;
  o.block_size = 4096;
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()}, o);
  const auto chunk = xt::random_bytes(4096, 12);
  auto first_chunk = [&](std::uint64_t id) {
    pm::Entry e;
    e.path = "f" + std::to_string(id);
    e.size = 2 * 4096;
    e.file_id = id;
    e.data = chunk;
    return e;
  };
  for (std::uint64_t id = 1; id <= 256; ++id) rfs->put({first_chunk(id)});
  CHECK(code_of([&] { rfs->put({first_chunk(257)}); }) == errc::limit_exceeded);
  // The client gives one up (it could not read the rest): its place goes to the next file, and
  // a late chunk of it is refused rather than starting it again.
  pm::Entry gone = first_chunk(1);
  gone.code = errc::io_error;
  gone.data = {};
  rfs->put({gone});
  rfs->put({first_chunk(257)});
  auto late = first_chunk(1);
  late.offset = 4096;
  CHECK(code_of([&] { rfs->put({late}); }) == errc::io_error);
  for (const auto& name : xt::list_dir(root.path()))  // nothing whole yet: temporary files only
    CHECK_MESSAGE(name.find(".xdfs-") != std::string::npos, name);
  rfs.close();
  CHECK(srv.wait_for_log("mode=path"));
  check_no_temp_files(root.path());
}

TEST_CASE("large files in progress: chunks apart are tracked up to a bound over all the files; past it that file fails, "
          "the others go on") {
  xt::TempDir d;
  xdfs::files::Fd root(::open(d.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  // Chunks of one byte: a peer's worst case, a run apart per byte it sends.
  pm::TreeWriter w(root.get(), "t", false, 1);
  const std::uint64_t half = pm::TreeWriter::max_runs_apart / 2;
  static const std::uint8_t byte = 'x';
  auto chunk = [](const std::string& path, std::uint64_t id, std::uint64_t size, std::uint64_t at) {
    pm::Entry e;
    e.path = path;
    e.size = size;
    e.mode = 0644;
    e.file_id = id;
    e.offset = at;
    e.data = {&byte, 1};
    return e;
  };
  // Every other byte of two files: as many runs apart as the bound allows, half each.
  std::size_t failed = 0;
  for (std::uint64_t i = 0; i < half; ++i) {
    failed += !w.put(chunk("a", 1, 2 * half, 2 * i));
    failed += !w.put(chunk("b", 2, 2 * half + 2, 2 * i));
  }
  REQUIRE(failed == 0);
  // One more run apart: that file fails, naming the cause; its temporary file goes, and its late
  // chunks are refused.
  const auto past = w.put(chunk("b", 2, 2 * half + 2, 2 * half));
  CHECK(past.code == errc::limit_exceeded);
  CHECK(past.message.find("more than 65536 runs apart") != std::string::npos);
  CHECK(past.message.find("'b'") != std::string::npos);
  CHECK(w.open_files() == 1);
  CHECK(w.put(chunk("b", 2, 2 * half + 2, 1)).code == errc::io_error);
  // The other completes (its runs merge as its gaps fill), byte for byte.
  for (std::uint64_t i = 0; i < half; ++i) failed += !w.put(chunk("a", 1, 2 * half, 2 * i + 1));
  CHECK(failed == 0);
  CHECK(w.open_files() == 0);
  CHECK(xt::read_file(d / "a") == std::string(2 * half, 'x'));
  CHECK(xt::list_dir(d.path()) == std::vector<std::string>{"a"});
}

TEST_CASE("a tree copy cut in the middle and re-run with --sync ends identical, moving only what is missing") {
  xt::TempDir root, local;
  const std::string src = local / "src";
  ::mkdir(src.c_str(), 0755);
  for (int dir = 0; dir < 20; ++dir) {
    const std::string dd = src + "/d" + std::to_string(dir);
    ::mkdir(dd.c_str(), 0755);
    for (int i = 0; i < 200; ++i) xt::write_random_file(dd + "/f" + std::to_string(i), 40000 + i, dir * 1000 + i);
  }
  xt::write_random_file(src + "/big", 48 << 20, 99);
  const std::size_t total = 20 * 200 + 1;
  xt::XdfsdProcess d(root.path());

  // Start a copy as a real process; once files are arriving, stop it where it is (SIGSTOP), then
  // kill it. Stopped, it sends nothing more: what reaches the server is at most the requests it
  // had in flight (its window, 32 MiB), far less than the 208 MB of the tree, so the copy is
  // always cut, however fast the machine.
  const pid_t pid = spawn_xduc({"-q", "-p", "2", "--workers", "1", "-r", src + "/", url(d.port(), "copy")});
  REQUIRE(pid >= 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (count_files(root / "copy") < 50 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // polling a directory: no event to wait on
  ::kill(pid, SIGSTOP);
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(d.wait_for_log("peer aborted"));
  const std::size_t got = count_files(root / "copy");
  INFO("files there after the cut: " << got);
  CHECK(got < total);
  // What is there under a real name is whole: a file arrives complete or not at all.
  std::size_t whole = 0;
  for (auto& e : fs::recursive_directory_iterator(root / "copy")) {
    if (!e.is_regular_file()) continue;
    const auto name = e.path().filename().string();
    if (name.find(".xdfs-") != std::string::npos) continue;  // a temporary file, swept by the server
    const auto rel = fs::relative(e.path(), root / "copy").string();
    CHECK_MESSAGE(xt::files_equal(src + "/" + rel, e.path().string()), rel);
    ++whole;
  }
  CHECK(whole >= 50);

  auto again = xt::xduc({"-p", "2", "--sync", "-r", "--json", src + "/", url(d.port(), "copy")});
  REQUIRE_MESSAGE(again.status == 0, again.err);
  CHECK(snapshot(root / "copy") == snapshot(src));
  check_no_temp_files(root / "copy");
  // Only what was missing moved.
  auto pos = again.out.find("\"skipped\":");
  REQUIRE(pos != std::string::npos);
  CHECK(std::stoul(again.out.substr(pos + 10)) >= 40);

  // A third run finds everything in place; --checksum compares content and agrees.
  auto third = xt::xduc({"--sync", "--checksum", "-r", "--json", src + "/", url(d.port(), "copy")});
  REQUIRE_MESSAGE(third.status == 0, third.err);
  CHECK(third.out.find("\"files\":0,") != std::string::npos);
  // A changed file with the same size and mtime is found by --checksum only.
  {
    auto before = xt::read_file(root / "copy/d3/f7");
    struct stat st {};
    ::stat((root / "copy/d3/f7").c_str(), &st);
    before[100] = static_cast<char>(before[100] ^ 1);
    xt::write_file(root / "copy/d3/f7", before);
    set_mtime(root / "copy/d3/f7", st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec);
  }
  auto quick = xt::xduc({"--sync", "-r", "--json", src + "/", url(d.port(), "copy")});
  CHECK(quick.out.find("\"files\":0,") != std::string::npos);
  auto deep = xt::xduc({"--sync", "--checksum", "-r", "--json", src + "/", url(d.port(), "copy")});
  CHECK(deep.out.find("\"files\":1,") != std::string::npos);
  CHECK(xt::files_equal(src + "/d3/f7", root / "copy/d3/f7"));
}

TEST_CASE("--sync judges a download's destination beneath it: a symbolic link there does not make a file outside look copied") {
  // The destination has a link 'a' to a directory outside it, holding 'f' as the server has
  // 'a/f' (same size and time). Followed, it would count as up to date and be skipped, and
  // what is skipped tells the server about files outside the destination.
  xt::TempDir root, local, outside;
  ::mkdir((root / "t").c_str(), 0755);
  ::mkdir((root / "t/a").c_str(), 0755);
  xt::write_file(root / "t/a/f", "same bytes");
  xt::write_file(outside / "f", "same bytes");
  struct stat st {};
  REQUIRE(::stat((root / "t/a/f").c_str(), &st) == 0);
  set_mtime(outside / "f", st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec);
  const std::string back = local / "back";
  ::mkdir(back.c_str(), 0755);
  REQUIRE(::symlink(outside.path().c_str(), (back + "/a").c_str()) == 0);
  xt::XdfsdProcess d(root.path());
  auto r = xt::xduc({"--sync", "-r", "--json", url(d.port(), "t/"), back});
  INFO(r.out << r.err);
  CHECK(r.status == 1);  // 'a' is not a directory here: a/f is not copied either way
  CHECK(r.out.find("\"skipped\":0") != std::string::npos);
  CHECK(xt::read_file(outside / "f") == "same bytes");
  CHECK(xt::list_dir(outside.path()) == std::vector<std::string>{"f"});
}

TEST_CASE("a tree copy goes on past entries it cannot copy, names each one, and fails at the end") {
  xt::TempDir root, local;
  const std::string src = local / "src";
  fs::create_directories(src + "/a");
  fs::create_directories(src + "/d");
  fs::create_directories(src + "/ok/deeper");
  xt::write_random_file(src + "/a/f1", 100, 1);
  xt::write_random_file(src + "/a/f2", 200, 2);       // the server has a directory there
  xt::write_random_file(src + "/d/f3", 300, 3);       // d is a file on the server: f3 cannot go in
  xt::write_random_file(src + "/big", 5000000, 4);    // large (chunks), the server has a directory there
  xt::write_random_file(src + "/big2", 3000000, 5);   // large, fine
  for (int i = 0; i < 50; ++i) xt::write_random_file(src + "/ok/deeper/g" + std::to_string(i), 1000 + i, 10 + i);
  fs::create_directories(root / "t/a/f2");
  fs::create_directories(root / "t/big");
  xt::write_random_file(root / "t/d", 7, 6);
  xt::XdfsdProcess d(root.path());

  auto up = xt::xduc({"-p", "3", "--block-size", "1M", "-r", "--json", src + "/", url(d.port(), "t")});
  CHECK(up.status == 1);
  INFO(up.err);
  for (const char* name : {"'t/a/f2'", "'t/big'", "'t/d'", "d/f3"})
    CHECK_MESSAGE(up.err.find(name) != std::string::npos, name);
  CHECK(up.err.find(" (server): ") != std::string::npos);
  CHECK(up.out.find("\"failed\":4") != std::string::npos);
  CHECK(up.out.find("\"files\":52") != std::string::npos);  // a/f1, big2 and the 50 under ok/
  // Everything else arrived whole, and what was there before is untouched.
  CHECK(xt::files_equal(src + "/a/f1", root / "t/a/f1"));
  CHECK(xt::files_equal(src + "/big2", root / "t/big2"));
  for (int i = 0; i < 50; ++i) CHECK(xt::files_equal(src + "/ok/deeper/g" + std::to_string(i), root / ("t/ok/deeper/g" + std::to_string(i))));
  CHECK(fs::is_directory(root / "t/a/f2"));
  CHECK(fs::is_empty(root / "t/a/f2"));
  CHECK(fs::is_directory(root / "t/big"));
  CHECK(fs::file_size(root / "t/d") == 7);
  check_no_temp_files(root.path());
  CHECK(d.wait_for_log("mode=path"));
  CHECK(d.log().find("status=ok") != std::string::npos);  // the session itself went well

  // Downloading: what cannot be made locally is named, the rest arrives.
  const std::string back = local / "back";
  fs::create_directories(back + "/a/f1");
  fs::create_directories(back + "/big2");
  auto down = xt::xduc({"-q", "-p", "2", "--block-size", "1M", "-r", url(d.port(), "t/"), back});
  CHECK(down.status == 1);
  INFO(down.err);
  CHECK(down.err.find("a/f1") != std::string::npos);
  CHECK(down.err.find("big2") != std::string::npos);
  CHECK(down.err.find("2 not copied") != std::string::npos);
  for (int i = 0; i < 50; ++i) CHECK(xt::files_equal(src + "/ok/deeper/g" + std::to_string(i), back + "/ok/deeper/g" + std::to_string(i)));
  CHECK(fs::is_directory(back + "/a/f1"));
  check_no_temp_files(back);

  // The library reports the same through TreeError, with everything that was copied.
  xdfs::RemoteFs rfs({"127.0.0.1", d.port()});
  try {
    rfs->upload_tree(src, "t", {});
    FAIL("upload_tree did not report the entries it could not copy");
  } catch (const pm::TreeError& e) {
    CHECK(e.result().failures.size() == 4);
    CHECK(e.result().files == 52);
    CHECK(std::string(e.what()).find("4 entries were not copied") != std::string::npos);
  }
  rfs.close();
}

TEST_CASE("remove -r: wide directories go in batches; a tree nested deeper than 128 levels is refused, not walked") {
  // A recursive remove holds a descriptor and a batch of names per level it is in: a tree a
  // client nested arbitrarily deep (renames can) must not take a descriptor per level.
  xt::TempDir root;
  auto nest = [](std::string at, int levels) {
    for (int i = 0; i < levels; ++i) {
      at += "/d";
      REQUIRE(::mkdir(at.c_str(), 0755) == 0);
    }
    return at;
  };
  const std::string wide = root / "wide";
  ::mkdir(wide.c_str(), 0755);
  for (int i = 0; i < 1000; ++i) xt::write_file(wide + "/f" + std::to_string(i), "x");
  ::mkdir((wide + "/sub").c_str(), 0755);
  for (int i = 0; i < 600; ++i) xt::write_file(wide + "/sub/g" + std::to_string(i), "y");
  ::mkdir((root / "ok").c_str(), 0755);
  xt::write_file(nest(root / "ok", 127) + "/leaf", "z");
  ::mkdir((root / "deep").c_str(), 0755);
  xt::write_file(nest(root / "deep", 200) + "/leaf", "z");
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()});
  auto& c = rfs.client();
  c.remove("wide", true);
  CHECK_FALSE(fs::exists(root / "wide"));
  c.remove("ok", true);
  CHECK_FALSE(fs::exists(root / "ok"));
  try {
    c.remove("deep", true);
    FAIL("a tree 200 levels deep was walked");
  } catch (const xdfs::Error& e) {
    CHECK(e.code() == errc::limit_exceeded);
    CHECK(std::string(e.what()).find("'deep' is nested more than 128 levels deep") != std::string::npos);
  }
  CHECK(fs::exists(root / "deep"));
  rfs.close();
}

TEST_CASE("a download killed in the middle leaves temporary files that the next run removes, or a partial file it continues") {
  // The big file in path mode (chunks), and as an xFTSM transfer of its own after the path part.
  for (const char* large : {"0", "64M"}) {
  CAPTURE(large);
  xt::TempDir root, local;
  fs::create_directories(root / "t/sub");
  xt::write_random_file(root / "t/big", 256 << 20, 7);
  for (int i = 0; i < 20; ++i) xt::write_random_file(root / ("t/sub/f" + std::to_string(i)), 5000 + i, i);
  xt::XdfsdProcess d(root.path());
  const std::string back = local / "back";
  auto temps = [&] {
    std::vector<std::string> out;
    std::error_code ec;
    for (auto& e : fs::recursive_directory_iterator(back, ec))
      if (e.path().filename().string().find(".xdfs-dl-") != std::string::npos ||
          e.path().filename().string().find(".xdfs-partial") != std::string::npos ||
          e.path().filename().string().find(".xdfs-resume") != std::string::npos)
        out.push_back(e.path().string());
    return out;
  };
  // In path mode a temporary file; as a transfer of its own, a resumable partial file.
  auto big_in_progress = [&] {
    for (const auto& t : temps())
      if (fs::path(t).filename().string().rfind(".big.xdfs-dl-", 0) == 0 ||
          fs::path(t).filename().string() == ".big.xdfs-partial")
        return true;
    return false;
  };
  // Small chunks over one channel: the big file is in progress long enough to be cut.
  const pid_t pid = spawn_xduc({"-q", "--block-size", "64K", "--large-file", large, "-r", url(d.port(), "t/"), back});
  REQUIRE(pid >= 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!big_in_progress() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const auto left = temps();
  INFO("left behind: " << left.size());
  REQUIRE_MESSAGE(!left.empty(), "the download was not caught with a file in progress");
  // A temporary file of a live writer (this test process) is not touched.
  const std::string live = back + "/.other.xdfs-dl-" + std::to_string(::getpid()) + "-0123abcd.part";
  xt::write_file(live, "in progress");

  auto again = xt::xduc({"--sync", "--large-file", large, "-r", url(d.port(), "t/"), back});
  REQUIRE_MESSAGE(again.status == 0, again.err);
  // A temporary file goes; a transfer's partial file is continued where it was (and goes once whole).
  if (std::string(large) == "0") CHECK(again.err.find("left by an interrupted download") != std::string::npos);
  std::string now_left;
  for (const auto& t : temps()) now_left += t + " ";
  CHECK_MESSAGE(temps() == std::vector<std::string>{live}, now_left);
  CHECK(xt::files_equal(root / "t/big", back + "/big"));
  for (int i = 0; i < 20; ++i) CHECK(xt::files_equal(root / ("t/sub/f" + std::to_string(i)), back + "/sub/f" + std::to_string(i)));
  }
}

TEST_CASE("a listing of 100,000 entries arrives in chunks") {
  xt::TempDir root;
  const std::string dir = root / "huge";
  ::mkdir(dir.c_str(), 0755);
  for (int i = 0; i < 100000; ++i) {
    int fd = ::open((dir + "/entry-" + std::to_string(i)).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    REQUIRE(fd >= 0);
    ::close(fd);
  }
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()});
  std::set<std::string> names;
  std::size_t biggest = 0;
  const auto chunks = rfs->list("huge", false, [&](std::vector<pm::Entry>& chunk) {
    biggest = std::max(biggest, chunk.size());
    for (auto& e : chunk) names.insert(e.path);
  });
  CHECK(names.size() == 100000);
  CHECK(names.count("entry-99999") == 1);
  CHECK(chunks >= 100000 / 256);
  CHECK(biggest <= 256);
  rfs.close();

  // And through xduc: one line per entry.
  xt::XdfsdProcess d(root.path());
  auto ls = xt::xduc({"ls", url(d.port(), "huge")});
  REQUIRE(ls.status == 0);
  CHECK(std::count(ls.out.begin(), ls.out.end(), '\n') == 100000);
}

TEST_CASE("xduc path commands: output, one-line errors, exit codes; a read-only key cannot write") {
  xt::TempDir root, local, state;
  xt::write_file(root / "file", "some bytes");
  xt::XdfsdProcess d(root.path());
  auto ok = [](const xt::RunResult& r) { return r.status == 0; };
  auto one_line_error = [](const xt::RunResult& r, const std::string& text) {
    return r.status == 1 && std::count(r.err.begin(), r.err.end(), '\n') == 1 && r.err.find(text) != std::string::npos;
  };
  CHECK(ok(xt::xduc({"mkdir", "--parents", url(d.port(), "p/q")})));
  CHECK(fs::is_directory(root / "p/q"));
  auto st = xt::xduc({"stat", url(d.port(), "file")});
  CHECK(st.out.find(" 10 ") != std::string::npos);
  CHECK(st.out.find("file") != std::string::npos);
  auto ls = xt::xduc({"ls", "--json", url(d.port(), "")});
  CHECK(ls.out.find("\"path\":\"file\",\"type\":\"file\",\"size\":10") != std::string::npos);
  CHECK(ls.out.find("\"path\":\"p\",\"type\":\"directory\"") != std::string::npos);
  auto sum = xt::xduc({"sum", "--sha256", url(d.port(), "file")});
  xt::write_file(local / "file", "some bytes");
  CHECK(sum.out.substr(0, 64) == xt::run("/usr/bin/sha256sum", {local / "file"}).out.substr(0, 64));
  // Without --sha256: the manifest digest, the same as for the local copy.
  CHECK(xt::xduc({"sum", url(d.port(), "file")}).out.substr(0, 64) == xt::xduc({"sum", local / "file"}).out.substr(0, 64));
  CHECK(ok(xt::xduc({"mv", url(d.port(), "file"), "p/q/file"})));
  CHECK(xt::exists(root / "p/q/file"));
  CHECK(one_line_error(xt::xduc({"rm", url(d.port(), "p")}), "is a directory"));
  CHECK(one_line_error(xt::xduc({"rm", url(d.port(), "nothing")}), "no such file (server)"));
  CHECK(one_line_error(xt::xduc({"stat", url(d.port(), "../up")}), "path escape"));
  CHECK(one_line_error(xt::xduc({"-r", local / "file", url(d.port(), "t")}), "not a directory"));
  CHECK(xt::xduc({"ls"}).status == 2);
  // Bad values of the path-mode options: exit 2 with a line naming the option.
  auto bad_arg = [](const xt::RunResult& r, const std::string& text) {
    return r.status == 2 && std::count(r.err.begin(), r.err.end(), '\n') == 1 && r.err.find(text) != std::string::npos;
  };
  CHECK(bad_arg(xt::xduc({"-r", "--workers", "0", local.path(), url(d.port(), "t")}), "--workers"));
  CHECK(bad_arg(xt::xduc({"-r", "--workers", "lots", local.path(), url(d.port(), "t")}), "--workers"));
  CHECK(bad_arg(xt::xduc({"-r", "--checksum", local.path(), url(d.port(), "t")}), "--checksum goes with --sync"));
  CHECK(bad_arg(xt::xduc({"--sync", local / "file", url(d.port(), "t")}), "go with -r"));
  CHECK(bad_arg(xt::xduc({"mv", url(d.port(), "p")}), "mv takes"));
  CHECK(bad_arg(xt::xduc({"stat", "not-a-url"}), "not an xdfs:// URL"));
  CHECK(bad_arg(xt::xduc({"stat", "xdfs://alice@127.0.0.1/x"}), "names a user ('alice@'): xDFS knows clients by their keys"));
  CHECK(bad_arg(xt::xduc({local / "file", "xdfs://a@b@127.0.0.1/x"}), "names a user ('a@b@')"));
  CHECK(bad_arg(xt::run(XDFSD_PATH, {"--root", root.path(), "--path-workers", "0"}), "--path-workers"));
  CHECK(ok(xt::xduc({"rm", "-r", url(d.port(), "p")})));
  CHECK_FALSE(xt::exists(root / "p"));

  // A read-only key lists and downloads trees but cannot change anything.
  ::mkdir((root / "pub").c_str(), 0755);
  xt::write_file(root / "pub/a", "A");
  auto reader = xdfs::xsec::load_or_create_key(local / "reader");
  xt::write_file(state / "authorized_keys", xdfs::xsec::format_public(reader.public_key) + " ro\n");
  xt::XdfsdProcess ro(root.path(), {"--authorized-keys", state / "authorized_keys"});
  const std::string id = local / "reader";
  CHECK(ok(xt::xduc({"--identity", id, "-q", "-r", url(ro.port(), "pub/"), local / "pubcopy"})));
  CHECK(xt::read_file(local / "pubcopy/a") == "A");
  CHECK(one_line_error(xt::xduc({"--identity", id, "mkdir", url(ro.port(), "new")}), "read-only"));
  CHECK(one_line_error(xt::xduc({"--identity", id, "rm", url(ro.port(), "pub/a")}), "read-only"));
  CHECK(one_line_error(xt::xduc({"--identity", id, "-q", "-r", local / "pubcopy", url(ro.port(), "pub2")}), "read-only"));
  CHECK(one_line_error(xt::xduc({"--identity", id, "mv", url(ro.port(), "pub/a"), "pub/b"}), "read-only"));
  {
    xdfs::TransferOptions o;
    o.identity_file = id;
    xdfs::RemoteFs rfs({"127.0.0.1", ro.port()}, o);
    pm::Entry e;
    e.path = "pub/put";
    e.size = 1;
    static const std::uint8_t one = 'x';
    e.data = {&one, 1};
    CHECK(code_of([&] { rfs->put({e}); }) == errc::permission_denied);
    rfs.close();
  }
  CHECK(xt::exists(root / "pub/a"));
  CHECK_FALSE(xt::exists(root / "pub/b"));
  CHECK_FALSE(xt::exists(root / "pub/put"));
  CHECK_FALSE(xt::exists(root / "new"));
}

TEST_CASE("a tree copy cancelled through RemoteFs stops, says so on both sides, and leaves no temporary file") {
  xt::TempDir root, local;
  fs::create_directories(local / "t");
  for (int i = 0; i < 8; ++i) xt::write_random_file(local / ("t/big" + std::to_string(i)), 8 << 20, 40 + i);
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  std::atomic<bool> cancel{false};
  xdfs::TransferOptions o;
  o.cancel = &cancel;
  o.channels = 2;
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()}, o);
  pm::TreeOptions t;
  t.progress = [&](const pm::TreeProgress& p) {
    if (p.bytes > 0) cancel = true;
  };
  CHECK(code_of([&] { rfs->upload_tree(local / "t", "t", t); }) == errc::cancelled);
  CHECK(srv.wait_for_log("status=error: cancelled: cancelled by the user"));
  CHECK(srv.wait_for_log("mode=path"));
  check_no_temp_files(root.path());
  // Not all of it went.
  CHECK(count_files(root / "t") < 8);
}

TEST_CASE("a tree copy's progress counts against its totals: the walk's up, the listing's down, large files among them") {
  xt::TempDir root, local;
  fs::create_directories(local / "t/sub");
  std::uint64_t bytes = 0;
  for (int i = 0; i < 30; ++i) {
    xt::write_random_file(local / ("t/sub/f" + std::to_string(i)), 3000 + i, i);
    bytes += 3000 + i;
  }
  xt::write_random_file(local / "t/big", (2 << 20) + 1, 99);  // a transfer of its own
  bytes += (2 << 20) + 1;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  xdfs::TransferOptions o;
  o.channels = 2;
  pm::TreeOptions t;
  t.large_file = 1 << 20;
  t.batch_bytes = 16 << 10;  // many batches: many calls
  std::vector<pm::TreeProgress> seen;
  t.progress = [&](const pm::TreeProgress& p) { seen.push_back(p); };
  auto check = [&](const char* way) {
    CAPTURE(way);
    REQUIRE(seen.size() > 2);
    bool whole = false;  // the totals were final once
    for (const auto& p : seen) {
      // Nothing moves before the totals are whole; once whole they stay, and nothing passes them.
      if (p.files || p.bytes) CHECK(p.totals_final);
      if (whole) CHECK(p.totals_final);
      whole = whole || p.totals_final;
      if (p.totals_final) {
        CHECK(p.files_total == 31);
        CHECK(p.bytes_total == bytes);
      }
      CHECK(p.files <= p.files_total);
      CHECK(p.bytes <= p.bytes_total);
    }
    CHECK(seen.back().files == 31);
    CHECK(seen.back().bytes == bytes);
    seen.clear();
  };
  {
    xdfs::Session s({"127.0.0.1", srv.port()}, o);
    const auto r = xdfs::upload_tree(s, local / "t", "t", t, o);
    CHECK(r.large_files == 1);
    s.close();
  }
  check("upload");
  {
    xdfs::Session s({"127.0.0.1", srv.port()}, o);
    const auto r = xdfs::download_tree(s, "t", local / "back", t, o);
    CHECK(r.large_files == 1);
    s.close();
  }
  check("download");
  // With sync nothing is left to copy: the totals end at zero, not at what was listed.
  {
    t.sync = true;
    xdfs::Session s({"127.0.0.1", srv.port()}, o);
    xdfs::upload_tree(s, local / "t", "t", t, o);
    s.close();
    REQUIRE(!seen.empty());
    CHECK(seen.front().files_total > 0);  // as walked
    CHECK(seen.back().totals_final);
    CHECK(seen.back().files_total == 0);
    CHECK(seen.back().bytes_total == 0);
  }
}

TEST_CASE("a destination directory swapped for a symlink out of the tree during a download: nothing lands outside") {
  xt::TempDir root, local, outside;
  fs::create_directories(root / "t/sub");
  for (int i = 0; i < 200; ++i) xt::write_random_file(root / ("t/sub/f" + std::to_string(i)), 20000, i);
  xt::write_random_file(root / "t/big", 16 << 20, 7);  // first in the plan: the swap happens while it moves
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()});
  pm::TreeOptions t;
  t.batch_bytes = 64 << 10;  // many small batches for sub/, after the swap
  bool swapped = false;
  t.progress = [&](const pm::TreeProgress& p) {
    if (swapped || p.bytes == 0) return;
    swapped = true;
    // sub/ exists by now (directories are made first): it becomes a symlink to `outside`.
    fs::rename(local / "back/sub", local / "back/sub.real");
    fs::create_directory_symlink(outside.path(), local / "back/sub");
  };
  try {
    rfs->download_tree("t", local / "back", t);
  } catch (const xdfs::Error&) {
    // Whether the files under sub/ failed or went elsewhere is the test; both end a copy.
  }
  rfs.close();
  REQUIRE(swapped);
  CHECK(xt::list_dir(outside.path()).empty());
  CHECK(fs::is_symlink(local / "back/sub"));
}

TEST_CASE("set-user-ID and set-group-ID bits never travel, either way") {
  xt::TempDir root, local;
  fs::create_directories(local / "t");
  xt::write_file(local / "t/suid", "#!/bin/sh\n");
  xt::write_file(local / "t/sgid", "#!/bin/sh\n");
  REQUIRE(::chmod((local / "t/suid").c_str(), 04755) == 0);
  REQUIRE(::chmod((local / "t/sgid").c_str(), 02755) == 0);
  xt::XdfsdProcess d(root.path());
  REQUIRE(xt::xduc({"-q", "-r", local / "t", url(d.port(), "")}).status == 0);
  struct stat st {};
  const mode_t mask = xdfs::files::process_umask();
  REQUIRE(::stat((root / "t/suid").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == (0755 & ~mask));
  REQUIRE(::stat((root / "t/sgid").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == (0755 & ~mask));
  // And back: the server's own set-user-ID file comes down without the bit.
  REQUIRE(::chmod((root / "t/suid").c_str(), 04755) == 0);
  REQUIRE(xt::xduc({"-q", "-r", url(d.port(), "t"), local / "back"}).status == 0);
  REQUIRE(::stat((local / "back/t/suid").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == (0755 & ~mask));
}

TEST_CASE("a key confined with subdir= sees only its directory in path mode too") {
  xt::TempDir root, local, state;
  fs::create_directories(root / "pub/in");
  xt::write_file(root / "pub/in/a", "A");
  xt::write_file(root / "secret", "not for this key");
  REQUIRE(::symlink("../secret", (root / "pub/leak").c_str()) == 0);
  xt::write_file(state / "authorized_keys",
                 xdfs::xsec::format_public(xt::test_identity().public_key) + " rw subdir=pub\n");
  xt::XdfsdProcess d(root.path(), {"--authorized-keys", state / "authorized_keys"});
  auto ls = xt::xduc({"ls", url(d.port(), "")});
  REQUIRE(ls.status == 0);
  CHECK(ls.out.find(" in") != std::string::npos);
  CHECK(ls.out.find(" secret\n") == std::string::npos);  // only the link that points at it is there
  CHECK(ls.out.find("leak -> ../secret") != std::string::npos);
  CHECK(xt::xduc({"stat", url(d.port(), "../secret")}).err.find("path escape") != std::string::npos);
  CHECK(xt::xduc({"sum", url(d.port(), "leak")}).err.find("path escape") != std::string::npos);
  CHECK(xt::xduc({"-q", url(d.port(), "leak"), local / "x"}).err.find("path escape") != std::string::npos);
  fs::create_directories(local / "t");
  xt::write_file(local / "t/up", "U");
  REQUIRE(xt::xduc({"-q", "-r", local / "t", url(d.port(), "")}).status == 0);
  CHECK(xt::read_file(root / "pub/t/up") == "U");  // its "" is the root's pub
  CHECK_FALSE(xt::exists(root / "t"));
  CHECK(xt::read_file(root / "secret") == "not for this key");
}

TEST_CASE("a directory swapped for a symlink out of the root while requests race through it: nothing outside "
          "is read or written") {
  xt::TempDir root, outside;
  fs::create_directories(root / "d");
  xt::write_file(root / "d/f", "inside");
  xt::write_file(outside / "f", "OUTSIDE");
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  const auto sha = [](const std::string& p) { return xt::run("/usr/bin/sha256sum", {p}).out.substr(0, 64); };
  const std::string in_sum = sha(root / "d/f"), out_sum = sha(outside / "f");
  std::atomic<bool> stop{false};
  std::atomic<int> swaps{0};
  // d flips between the real directory and a symlink to `outside`, as fast as it can.
  std::thread swapper([&] {
    const std::string d = root / "d", real = root / "d.real", link = root / "d.link";
    ::symlink(outside.path().c_str(), link.c_str());
    while (!stop) {
      ::rename(d.c_str(), real.c_str());
      ::rename(link.c_str(), d.c_str());  // d is the symlink now
      ::rename(d.c_str(), link.c_str());
      ::rename(real.c_str(), d.c_str());  // and the directory again
      ++swaps;
    }
  });
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()});
  int inside = 0, refused = 0, other = 0;
  for (int i = 0; i < 300; ++i) {
    try {
      const auto sum = rfs->checksum("d/f");
      CHECK(sum != out_sum);
      if (sum == in_sum) ++inside;
      pm::Entry e;
      e.path = "d/new" + std::to_string(i);
      e.size = 1;
      static const std::uint8_t one = 'n';
      e.data = {&one, 1};
      rfs->put({e});
    } catch (const xdfs::Error& e) {
      if (e.code() == errc::path_escape || e.code() == errc::no_such_file) ++refused;
      else ++other;
    }
  }
  stop = true;
  swapper.join();
  rfs.close();
  MESSAGE("checksums inside: " << inside << ", refused: " << refused << ", swaps: " << swaps.load());
  CHECK(other == 0);
  CHECK(swaps > 0);
  // Nothing was written outside, and what was read was never the outside file.
  CHECK(xt::list_dir(outside.path()) == std::vector<std::string>{"f"});
  CHECK(xt::read_file(outside / "f") == "OUTSIDE");
}

TEST_CASE("bad path frames end that session with a reason; other sessions go on") {
  xt::TempDir root;
  xt::write_file(root / "f", "data");
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  SUBCASE("garbage in an xPathM payload") {
    xt::RawChannel raw(srv.port());
    REQUIRE(raw.establish(xt::make_hello(xdfs::Mode::path, ".", 1)));
    auto reply = raw.read_frame();
    REQUIRE(reply.has_value());
    CHECK(reply->first.event == xdfs::wire::ChannelEvent::nego_reply);
    xdfs::wire::FrameHeader h;
    h.event = xdfs::wire::ChannelEvent::xpathm;
    h.length = 64;
    raw.send_frame(h, std::vector<std::uint8_t>(64, 0xEE));
    auto ex = raw.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::protocol_error);
    CHECK(ex->message.find("bad path request") != std::string::npos);
  }
  SUBCASE("an xPathM frame larger than the session allows") {
    xt::RawChannel raw(srv.port());
    REQUIRE(raw.establish(xt::make_hello(xdfs::Mode::path, ".", 1)));
    REQUIRE(raw.read_frame().has_value());
    xdfs::wire::FrameHeader h;
    h.event = xdfs::wire::ChannelEvent::xpathm;
    h.length = 40u << 20;
    auto bytes = xdfs::wire::encode(h);
    raw.send_bytes(bytes.data(), bytes.size());  // the header alone: the server must not wait for 40 MiB
    auto ex = raw.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::protocol_error);
  }
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()});
  CHECK(rfs->stat("f").size == 4);
  rfs.close();
}

TEST_CASE("an idle RemoteFs keeps its session with keep-alives; without them the server ends it") {
  xt::TempDir root;
  xt::write_random_file(root / "f", 10, 1);
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  cfg.idle_timeout = std::chrono::milliseconds(1000);
  xt::InProcessServer srv(cfg);
  xdfs::TransferOptions o;
  o.keep_alive = std::chrono::milliseconds(250);
  xdfs::RemoteFs kept({"127.0.0.1", srv.port()}, o);
  o.keep_alive = std::chrono::milliseconds(0);
  xdfs::RemoteFs idle({"127.0.0.1", srv.port()}, o);
  CHECK(kept->stat("f").size == 10);
  CHECK(idle->stat("f").size == 10);
  // Both sit idle; the server ends the one without keep-alives after its idle timeout (a second)
  // and says so in its log. By then the other has been idle as long: it is still there.
  REQUIRE(srv.wait_for_log("timed out: no progress", 10000));
  CHECK(kept->stat("f").size == 10);
  std::string why;
  try {
    idle->stat("f");
  } catch (const xdfs::Error& e) {
    why = e.what();
  }
  INFO(why);
  CHECK(why.find("no progress for 1000 ms") != std::string::npos);
  kept.close();
  CHECK(srv.wait_for_log("mode=path", 5000));
}

TEST_CASE("a client that asks for file bytes and never reads them is not read either, then timed out") {
  xt::TempDir root;
  xt::write_random_file(root / "big", 2 << 20, 5);
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  cfg.idle_timeout = std::chrono::milliseconds(1500);
  xt::InProcessServer srv(cfg);
  xt::RawChannel raw(srv.port());
  auto nego = xt::make_hello(xdfs::Mode::path, ".", 1);
  nego.nego.block_size = 1 << 20;  // a get may return up to two blocks
  REQUIRE(raw.establish(nego));
  REQUIRE(raw.read_frame().has_value());  // the negotiation reply; nothing is read after it
  for (std::uint64_t i = 1; i <= 200; ++i) {  // 400 MiB of replies if the server answered them all
    pm::Request r;
    r.id = i;
    r.op = pm::Op::get;
    pm::Entry e;
    e.path = "big";
    e.size = 2 << 20;
    r.entries.push_back(e);
    auto enc = pm::encode(r);
    xdfs::wire::FrameHeader h;
    h.event = xdfs::wire::ChannelEvent::xpathm;
    h.length = static_cast<std::uint32_t>(enc.size);
    auto b = enc.bytes();
    raw.send_frame(h, std::vector<std::uint8_t>(b.begin(), b.end()));
  }
  REQUIRE(srv.wait_for_log("timed out: no progress", 15000));
  std::uint64_t bytes = 0;
  for (auto& l : srv.log_lines()) {
    auto at = l.find(" bytes=");
    if (l.find("mode=path") != std::string::npos && at != std::string::npos) bytes = std::stoull(l.substr(at + 7));
  }
  INFO("bytes read for replies: " << bytes);
  CHECK(bytes < (100u << 20));
  CHECK(bytes > 0);
  // Others are served meanwhile and after.
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()});
  CHECK(rfs->stat("big").size == (2u << 20));
  rfs.close();
}

TEST_CASE("a client that asks for a long listing and never reads it is timed out; the listing stops") {
  xt::TempDir root;
  // About 2.5 MB of listing, far beyond the socket buffers this session gets.
  const std::string dir = root / "many";
  ::mkdir(dir.c_str(), 0755);
  const std::string pad(80, 'n');
  for (int i = 0; i < 20000; ++i) xt::write_file(dir + "/" + pad + std::to_string(i), "");
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  cfg.idle_timeout = std::chrono::milliseconds(1500);
  xt::InProcessServer srv(cfg);
  xt::RawChannel raw(srv.port());
  const int small = 16 << 10;
  ::setsockopt(raw.fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  auto nego = xt::make_hello(xdfs::Mode::path, ".", 1);
  nego.nego.tcp_window = 64 << 10;  // the server's socket buffers for this session
  REQUIRE(raw.establish(nego));
  REQUIRE(raw.read_frame().has_value());  // the negotiation reply; nothing is read after it
  pm::Request r;
  r.id = 1;
  r.op = pm::Op::list;
  r.path = "many";
  r.recursive = true;
  auto enc = pm::encode(r);
  xdfs::wire::FrameHeader h;
  h.event = xdfs::wire::ChannelEvent::xpathm;
  h.length = static_cast<std::uint32_t>(enc.size);
  auto b = enc.bytes();
  raw.send_frame(h, std::vector<std::uint8_t>(b.begin(), b.end()));
  // The listing's worker waits for its chunks to be read; the session does not wait with it.
  CHECK(srv.wait_for_log("timed out: no progress", 20000));
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()});
  CHECK(rfs->stat("many").type == pm::Type::directory);
  rfs.close();
}

}  // TEST_SUITE
