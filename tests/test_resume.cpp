// Resume (files.hpp: resumable partial files and their records; the engines' start offset):
// the record's format and how a bad one is discarded, then real xduc and xdfsd processes killed
// with SIGKILL half-way through a 1 GiB transfer each way and the same command run again.
//
// What a rerun moves is read from xduc --json (bytes_sent, resumed_from); how long anything
// takes is never asserted.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"
#include "xdfs/files.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xdfs.hpp"

namespace {

namespace files = xdfs::files;

std::string url(std::uint16_t port, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(port) + "/" + path;
}

std::uint64_t json_number(const xt::RunResult& r, const std::string& key) {
  const auto at = r.out.find("\"" + key + "\":");
  REQUIRE_MESSAGE(at != std::string::npos, r.out << r.err);
  return std::stoull(r.out.substr(at + key.size() + 3));
}

std::uint64_t size_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
}

// Runs `args` through xduc and kills it with SIGKILL (or calls `kill_other`) once `partial`
// holds at least `at` bytes. The first run is rate-limited so that "half-way" is a moment a
// poll can catch on any machine.
xt::RunResult run_and_cut(const std::vector<std::string>& args, const std::string& partial, std::uint64_t at,
                          const std::function<void()>& kill_other = nullptr) {
  std::atomic<pid_t> pid{-1};
  xt::RunResult r;
  std::thread t([&] { r = xt::xduc(args, 120000, &pid); });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (size_of(partial) < at && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (kill_other) {
    kill_other();
  } else if (const pid_t p = pid.load(); p > 0) {
    ::kill(p, SIGKILL);
  }
  t.join();
  return r;
}

bool exists(const std::string& p) { return ::access(p.c_str(), F_OK) == 0; }

// Damages one byte of a file where it stands.
void flip_byte(const std::string& path, off_t at, char mask = 1) {
  const int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  char c = 0;
  REQUIRE(::pread(fd, &c, 1, at) == 1);
  c ^= mask;
  REQUIRE(::pwrite(fd, &c, 1, at) == 1);
  ::close(fd);
}

}  // namespace

TEST_SUITE("manifest") {

TEST_CASE("a resume record reads back as written; truncated, corrupt, foreign or impossible ones are refused, saying why") {
  files::ResumeRecord r{{"xdfs://h:7721/some/file", 10u << 20, 1234567890123456789, 1 << 20}, 3u << 20};
  const auto bytes = files::encode_record(r);
  auto back = files::decode_record(bytes);
  REQUIRE(back);
  CHECK(back->key == r.key);
  CHECK(back->prefix == r.prefix);

  std::string why;
  for (std::size_t cut : {std::size_t(0), std::size_t(10), bytes.size() - 1}) {
    CHECK_FALSE(files::decode_record(std::span(bytes.data(), cut), &why));
    CHECK(why == "it is truncated");
  }
  auto flipped = bytes;
  flipped[45] ^= 1;  // inside the prefix
  CHECK_FALSE(files::decode_record(flipped, &why));
  CHECK(why.find("checksum") != std::string::npos);
  auto other = bytes;
  other[0] = 'y';
  CHECK_FALSE(files::decode_record(other, &why));
  CHECK(why == "it is not a resume record");
  auto longer = bytes;
  longer.push_back(0);
  CHECK_FALSE(files::decode_record(longer, &why));
  // Well-formed, but not whole blocks of the file it names: never trusted.
  files::ResumeRecord odd = r;
  odd.prefix = (3u << 20) + 1;
  CHECK_FALSE(files::decode_record(files::encode_record(odd), &why));
  CHECK(why.find("whole blocks") != std::string::npos);
  odd.prefix = r.key.size + (1u << 20);
  CHECK_FALSE(files::decode_record(files::encode_record(odd), &why));
}

TEST_CASE("a partial file's record that does not check out is discarded with a notice and the partial starts over") {
  xt::TempDir dir;
  auto open = [&](std::optional<files::ResumeRecord>& found, std::string& notice, files::PendingFile& f) {
    bool busy = true;
    notice.clear();
    REQUIRE(files::PendingFile::open_resumable(files::Fd(::open(dir.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC)),
                                               "f", f, found, notice, busy));
    REQUIRE_FALSE(busy);
  };
  std::optional<files::ResumeRecord> found;
  std::string notice;
  {
    files::PendingFile f;
    open(found, notice, f);
    CHECK_FALSE(found);
    CHECK(notice.empty());
    f.set_key({"src", 8192, 5, 4096});
    REQUIRE(::pwrite(f.fd(), std::string(8192, 'a').data(), 8192, 0) == 8192);
    f.save(4096);
    CHECK(f.saved() == 4096);
    CHECK(f.keep());  // left for the next attempt
  }
  CHECK(exists(dir / ".f.xdfs-partial"));
  CHECK(exists(dir / ".f.xdfs-resume"));
  {
    files::PendingFile f;
    open(found, notice, f);
    REQUIRE(found);
    CHECK(found->prefix == 4096);
    CHECK(found->key == files::ResumeKey{"src", 8192, 5, 4096});
    // A second transfer to the same name while this one holds it writes a temporary file.
    files::PendingFile g;
    std::optional<files::ResumeRecord> g_found;
    std::string g_notice;
    bool busy = false;
    REQUIRE(files::PendingFile::open_resumable(files::Fd(::open(dir.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC)),
                                               "f", g, g_found, g_notice, busy));
    CHECK(busy);
    CHECK(f.keep());
  }
  // Corrupt the record: discarded, said so, and the partial file is emptied.
  {
    flip_byte(dir / ".f.xdfs-resume", 40, 0x10);
    files::PendingFile f;
    open(found, notice, f);
    CHECK_FALSE(found);
    CHECK(notice.find("is discarded: its checksum does not match") != std::string::npos);
    CHECK(size_of(dir / ".f.xdfs-partial") == 0);
    // The record is a placeholder now (a partial file always has one), counting nothing.
    const auto text = xt::read_file(dir / ".f.xdfs-resume");
    const auto placeholder = files::decode_record(std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
    REQUIRE(placeholder);
    CHECK(placeholder->prefix == 0);
    // Nothing recorded: nothing kept.
    CHECK_FALSE(f.keep());
  }
  CHECK_FALSE(exists(dir / ".f.xdfs-partial"));
  CHECK_FALSE(exists(dir / ".f.xdfs-resume"));
  // A record counting more than its partial file holds is not believed either.
  {
    files::PendingFile f;
    open(found, notice, f);
    f.set_key({"src", 1 << 20, 5, 4096});
    REQUIRE(::pwrite(f.fd(), std::string(8192, 'a').data(), 8192, 0) == 8192);
    f.save(8192);
    CHECK(f.saved() == 8192);
    REQUIRE(f.keep());
    REQUIRE(::truncate((dir / ".f.xdfs-partial").c_str(), 4096) == 0);
    files::PendingFile again;
    open(found, notice, again);
    CHECK_FALSE(found);
    CHECK(notice.find("it counts 8192 bytes, its partial file has 4096") != std::string::npos);
    again.discard();
  }
  CHECK(xt::list_dir(dir.path()).empty());
  // A file named like a partial file but without a record is someone's own: left as it is,
  // and the transfer writes a temporary file instead.
  xt::write_file(dir / ".g.xdfs-partial", "mine");
  {
    files::PendingFile g;
    bool busy = false;
    REQUIRE(files::PendingFile::open_resumable(files::Fd(::open(dir.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC)),
                                               "g", g, found, notice, busy));
    CHECK(busy);
  }
  CHECK(xt::read_file(dir / ".g.xdfs-partial") == "mine");
  // Long names alike in their first 200 bytes get partial files of their own, within NAME_MAX.
  const std::string a(230, 'a'), b = std::string(229, 'a') + "b";
  CHECK(files::partial_name(a) != files::partial_name(b));
  CHECK(files::record_name(a) != files::record_name(b));
  CHECK(files::record_name(b).size() + 4 <= 255);  // with ".tmp"
  CHECK(files::partial_name("short") == ".short.xdfs-partial");
}

TEST_CASE("a negotiation resuming beyond the file, and xdfsd --partial-expiry out of range, are refused naming the cause") {
  xdfs::wire::Negotiation n;
  n.mode = xdfs::Mode::download;
  n.remote_path = "f";
  n.file_size = 1 << 20;
  n.resume_offset = (1 << 20) + 4096;
  std::string why;
  CHECK_FALSE(xdfs::wire::decode_negotiation(xdfs::wire::encode(n), &why));
  CHECK(why.find("resume offset 1052672 is beyond the file size 1048576") != std::string::npos);
  n.resume_offset = 1 << 20;
  CHECK(xdfs::wire::decode_negotiation(xdfs::wire::encode(n)));
  for (const char* bad : {"x", "-1", "31536001"}) {
    auto r = xt::run(XDFSD_PATH, {"--root", "/tmp", "--partial-expiry", bad});
    CHECK(r.status == 2);
    CHECK(r.err.find("--partial-expiry") != std::string::npos);
  }
}

}  // TEST_SUITE("manifest")

TEST_SUITE("process") {

TEST_CASE("kill -9 of the client, then of the server, half-way through 1 GiB each way: the same command finishes it, moving the rest") {
  xt::TempDir root, local;
  const std::uint64_t size = 1ull << 30;
  xt::write_random_file(local / "src", size, 41);
  auto d = std::make_unique<xt::XdfsdProcess>(root.path());
  const std::string port = std::to_string(d->port());
  // A restarted server listens where the first one did: a client resumes from the same server.
  auto restart = [&] {
    d->stop(SIGKILL);
    d = std::make_unique<xt::XdfsdProcess>(root.path(), std::vector<std::string>{"--listen", "127.0.0.1:" + port});
  };
  // The first run does not retry by itself (xduc's --retries would finish it: see the relay case).
  const std::vector<std::string> first{"-q", "--json", "-p", "2", "--limit-rate", "256M", "--retries", "0"};
  auto again = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"-q", "--json", "-p", "2"});
    auto r = xt::xduc(args);
    REQUIRE_MESSAGE(r.status == 0, r.err);
    CHECK(json_number(r, "bytes") == size);
    // At most 55% of the file crosses the network the second time.
    INFO(r.out);
    CHECK(json_number(r, "bytes_sent") <= size * 55 / 100);
    CHECK(json_number(r, "resumed_from") + json_number(r, "bytes_sent") == size);
    return r;
  };
  struct Case {
    const char* name;
    bool upload;
    bool kill_server;
  };
  for (const Case c : {Case{"upload, client killed", true, false}, Case{"upload, server killed", true, true},
                       Case{"download, client killed", false, false}, Case{"download, server killed", false, true}}) {
    CAPTURE(c.name);
    const std::string remote = c.upload ? std::string("up") + (c.kill_server ? "s" : "c") : "src-on-server";
    if (!c.upload && !exists(root / remote)) REQUIRE(::link((local / "src").c_str(), (root / remote).c_str()) == 0);
    const std::string dst = c.upload ? url(d->port(), remote) : std::string(local / "down");
    const std::string src = c.upload ? std::string(local / "src") : url(d->port(), remote);
    const std::string partial = c.upload ? root / ("." + remote + ".xdfs-partial") : local / ".down.xdfs-partial";
    std::vector<std::string> args = first;
    args.insert(args.end(), {src, dst});
    auto cut = run_and_cut(args, partial, size / 2, c.kill_server ? std::function<void()>(restart) : nullptr);
    CHECK(cut.status != 0);
    // Never under the final name; the partial file and its record stay.
    CHECK_FALSE(exists(c.upload ? root / remote : local / "down"));
    CHECK(exists(partial));
    auto r = again({src, dst});
    CHECK(xt::files_equal(local / "src", c.upload ? root / remote : local / "down"));
    CHECK_FALSE(exists(partial));
    CHECK(r.out.find("\"digest\":\"") != std::string::npos);
    if (!c.upload) ::unlink((local / "down").c_str());
    if (c.upload) ::unlink((root / remote).c_str());
  }
}

TEST_CASE("a partial copy is checked, not trusted: a changed source starts over with a notice, a corrupt partial fails the digest and goes") {
  xt::TempDir root, local;
  const std::uint64_t size = 64ull << 20;
  xt::write_random_file(root / "f", size, 42);
  xt::XdfsdProcess d(root.path());
  const std::vector<std::string> slow{"--json", "--block-size", "256K", "--limit-rate", "32M"};
  auto cut_download = [&] {
    std::vector<std::string> args = slow;
    args.insert(args.end(), {url(d.port(), "f"), local / "f"});
    auto r = run_and_cut(args, local / ".f.xdfs-partial", size * 3 / 4);
    REQUIRE(r.status != 0);
    REQUIRE(exists(local / ".f.xdfs-resume"));
  };
  // The source changes (its mtime): the server sends all of it, the client says why.
  cut_download();
  struct timespec later[2] = {{0, UTIME_OMIT}, {1700000000, 0}};
  REQUIRE(::utimensat(AT_FDCWD, (root / "f").c_str(), later, 0) == 0);
  auto r = xt::xduc({"--json", "--block-size", "256K", url(d.port(), "f"), local / "f"});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(r.err.find("the source changed since '.f.xdfs-partial' began: starting over") != std::string::npos);
  CHECK(json_number(r, "resumed_from") == 0);
  CHECK(xt::files_equal(root / "f", local / "f"));
  ::unlink((local / "f").c_str());

  // The partial copy is damaged where its record says it is good: the whole-file digests
  // differ, the transfer fails naming that, the partial goes, and the next run is whole (with
  // retries, as by default, that next run is xduc's own).
  cut_download();
  flip_byte(local / ".f.xdfs-partial", 1000);
  auto bad = xt::xduc({"--json", "--retries", "0", "--block-size", "256K", url(d.port(), "f"), local / "f"});
  CHECK(bad.status == 1);
  CHECK(bad.err.find("whole-file digest differs") != std::string::npos);
  CHECK_FALSE(exists(local / "f"));
  CHECK_FALSE(exists(local / ".f.xdfs-partial"));
  CHECK_FALSE(exists(local / ".f.xdfs-resume"));
  r = xt::xduc({"--json", "--block-size", "256K", url(d.port(), "f"), local / "f"});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(json_number(r, "resumed_from") == 0);
  CHECK(xt::files_equal(root / "f", local / "f"));

  // --no-resume: an interrupted download leaves nothing.
  std::vector<std::string> args = slow;
  args.insert(args.end(), {"--no-resume", url(d.port(), "f"), local / "g"});
  std::atomic<pid_t> pid{-1};
  std::thread t([&] { (void)xt::xduc(args, 60000, &pid); });
  while (pid.load() <= 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  ::kill(pid.load(), SIGINT);
  t.join();
  CHECK_FALSE(exists(local / ".g.xdfs-partial"));
}

TEST_CASE("an upload's partial file at the server: a server that claims blocks it lost cannot make the client skip them; old ones are swept") {
  xt::TempDir root, local;
  const std::uint64_t size = 64ull << 20;
  xt::write_random_file(local / "f", size, 43);
  {
    xt::XdfsdProcess d(root.path());
    std::vector<std::string> args{"--json", "--block-size", "256K", "--limit-rate", "32M", local / "f", url(d.port(), "f")};
    auto cut = run_and_cut(args, root / ".f.xdfs-partial", size / 2);
    REQUIRE(cut.status != 0);
    REQUIRE(d.wait_for_log("status=error"));
    REQUIRE(exists(root / ".f.xdfs-resume"));
    // The server's partial is damaged inside what its record counts: its claim is
    // proved false by the whole-file digest, the client fails, the server drops the partial.
    flip_byte(root / ".f.xdfs-partial", 4096);
    auto bad = xt::xduc({"--json", "--retries", "0", "--block-size", "256K", local / "f", url(d.port(), "f")});
    CHECK(bad.status == 1);
    CHECK(bad.err.find("whole-file digest differs") != std::string::npos);
    CHECK_FALSE(exists(root / "f"));
    CHECK(d.wait_for_log("whole-file digest differs"));
    CHECK_FALSE(exists(root / ".f.xdfs-partial"));
    auto r = xt::xduc({"--json", "--block-size", "256K", local / "f", url(d.port(), "f")});
    REQUIRE_MESSAGE(r.status == 0, r.err);
    CHECK(json_number(r, "resumed_from") == 0);
    CHECK(xt::files_equal(local / "f", root / "f"));

    // Another interrupted one, then a corrupt record: discarded with a notice in the log.
    args.back() = url(d.port(), "g");
    REQUIRE(run_and_cut(args, root / ".g.xdfs-partial", size / 2).status != 0);
    REQUIRE(d.wait_for_log("path=g channels=1 bytes="));
    REQUIRE(::truncate((root / ".g.xdfs-resume").c_str(), 20) == 0);
    r = xt::xduc({"--json", "--block-size", "256K", local / "f", url(d.port(), "g")});
    REQUIRE_MESSAGE(r.status == 0, r.err);
    CHECK(json_number(r, "resumed_from") == 0);
    CHECK(d.wait_for_log("the resume record '.g.xdfs-resume' is discarded: it is truncated"));
  }
  // Expiry: a partial file nothing has written for longer than --partial-expiry is swept when
  // the server starts.
  xt::write_file(root / ".old.xdfs-partial", "stale");
  xt::write_file(root / ".old.xdfs-resume", "stale");
  xt::write_file(root / ".new.xdfs-partial", "fresh");
  struct timespec old[2] = {{0, UTIME_OMIT}, {1600000000, 0}};
  REQUIRE(::utimensat(AT_FDCWD, (root / ".old.xdfs-partial").c_str(), old, 0) == 0);
  REQUIRE(::utimensat(AT_FDCWD, (root / ".old.xdfs-resume").c_str(), old, 0) == 0);
  xt::XdfsdProcess d(root.path(), {"--partial-expiry", "3600"});
  CHECK(d.wait_for_log("removed 1 partial upload not resumed for 3600 s"));
  CHECK_FALSE(exists(root / ".old.xdfs-partial"));
  CHECK_FALSE(exists(root / ".old.xdfs-resume"));
  CHECK(exists(root / ".new.xdfs-partial"));
}

TEST_CASE("xduc --retries: a channel cut mid-transfer is survived without user action, each retry said and counted") {
  using V = xt::Relay::Verdict;
  using D = xt::Relay::Dir;
  xt::TempDir root, local;
  const std::uint64_t size = 64ull << 20;
  xt::write_random_file(root / "f", size, 44);
  xt::write_random_file(local / "src", size, 45);
  xt::XdfsdProcess d(root.path());
  for (const D data : {D::down, D::up}) {
    CAPTURE(data == D::down ? "download" : "upload");
    xt::Relay relay(d.port(), xdfs::xsec::Protect::clear);
    std::atomic<bool> cut{false};
    // Channel 1 of the first session is cut after 40 of its blocks; later sessions pass.
    relay.hook = [&](const xt::Relay::Seen& f) {
      if (f.conn == 1 && f.dir == data && f.data_index == 40 && !cut.exchange(true)) return V::cut;
      return V::pass;
    };
    const std::string remote = "xdfs://127.0.0.1:" + std::to_string(relay.port()) + (data == D::down ? "/f" : "/up");
    auto r = xt::xduc({"--json", "-p", "3", "--protect", "clear", "--block-size", "256K",
                       data == D::down ? remote : std::string(local / "src"),
                       data == D::down ? std::string(local / "f") : remote});
    REQUIRE_MESSAGE(r.status == 0, r.err);
    CHECK(cut.load());
    CHECK(r.err.find("xduc: retry 1 of 5 in ") != std::string::npos);
    CHECK(json_number(r, "retries") == 1);
    // It went on from what was verified before the cut, not from byte 0.
    CHECK(json_number(r, "resumed_from") > 0);
    CHECK(xt::files_equal(data == D::down ? root / "f" : local / "src", data == D::down ? local / "f" : root / "up"));
  }
  // Not every failure is worth another try: a missing file fails at once, and --retries 0
  // makes a cut channel fail the copy.
  auto missing = xt::xduc({"--json", url(d.port(), "missing"), local / "m"});
  CHECK(missing.status == 1);
  CHECK(missing.err.find("retry") == std::string::npos);
  // Nor is a session that never opened: a listener that hangs up on the client's opening.
  {
    const int lst = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(lst, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
    REQUIRE(::listen(lst, 8) == 0);
    socklen_t len = sizeof sa;
    REQUIRE(::getsockname(lst, reinterpret_cast<sockaddr*>(&sa), &len) == 0);
    std::thread hang_up([lst] {
      const int c = ::accept(lst, nullptr, nullptr);
      char buf[64];
      if (c >= 0 && ::recv(c, buf, sizeof buf, 0) >= 0) ::close(c);
    });
    auto r = xt::xduc({local / "src", "xdfs://127.0.0.1:" + std::to_string(ntohs(sa.sin_port)) + "/x"}, 20000);
    hang_up.join();
    ::close(lst);
    CHECK(r.status == 1);
    CHECK(r.err.find("retry") == std::string::npos);
  }
  xt::Relay relay(d.port(), xdfs::xsec::Protect::clear);
  relay.hook = [&](const xt::Relay::Seen& f) {
    return f.conn == 0 && f.dir == D::down && f.data_index == 10 ? V::cut : V::pass;
  };
  auto once = xt::xduc({"--retries", "0", "--protect", "clear", "--block-size", "256K",
                        "xdfs://127.0.0.1:" + std::to_string(relay.port()) + "/f", local / "g"});
  CHECK(once.status == 1);
  CHECK(once.err.find("retry") == std::string::npos);
  auto bad = xt::xduc({"--retries", "x", local / "src", url(d.port(), "z")});
  CHECK(bad.status == 2);
  CHECK(bad.err.find("--retries") != std::string::npos);
}

TEST_CASE("xduc --retries: several sources, and a tree, go on in a new session after a channel is cut") {
  using V = xt::Relay::Verdict;
  using D = xt::Relay::Dir;
  xt::TempDir root, local;
  const std::uint64_t size = 8ull << 20;
  ::mkdir((local / "tree").c_str(), 0755);
  for (const char* f : {"a", "b", "c"}) xt::write_random_file(local / (std::string("tree/") + f), size, 46 + f[0]);
  xt::XdfsdProcess d(root.path());
  const std::vector<std::string> common{"--json", "-p", "2", "--protect", "clear", "--block-size", "256K"};
  for (const bool tree : {false, true}) {
    CAPTURE(tree);
    xt::Relay relay(d.port(), xdfs::xsec::Protect::clear);
    std::atomic<bool> cut{false};
    // Channel 1 of the first session is cut at its 40th block: in the second or third file.
    relay.hook = [&](const xt::Relay::Seen& f) {
      if (f.conn == 1 && f.dir == D::up && f.data_index == 40 && !cut.exchange(true)) return V::cut;
      return V::pass;
    };
    const std::string to = "xdfs://127.0.0.1:" + std::to_string(relay.port()) + "/" + (tree ? "t" : "m") + "/";
    ::mkdir((root / (tree ? "t" : "m")).c_str(), 0755);
    auto args = common;
    if (tree)
      args.insert(args.end(), {"-r", "--large-file", "1M", local / "tree/", to});
    else
      args.insert(args.end(), {local / "tree/a", local / "tree/b", local / "tree/c", to});
    auto r = xt::xduc(args);
    REQUIRE_MESSAGE(r.status == 0, r.err);
    CHECK(cut.load());
    CHECK_MESSAGE(r.err.find("xduc: retry 1 of 5 in ") != std::string::npos, r.err);
    CHECK(json_number(r, "retries") == 1);
    for (const char* f : {"a", "b", "c"})
      CHECK(xt::files_equal(local / (std::string("tree/") + f), root / (std::string(tree ? "t/" : "m/") + f)));
    xt::check_no_partials(root.path());
  }
}

}  // TEST_SUITE("process")

TEST_SUITE("badinput") {

TEST_CASE("a download resuming at an offset that is not whole blocks before the end is refused naming it; a changed file resumes at 0") {
  using xdfs::wire::ChannelEvent;
  xt::TempDir root, local;
  const std::uint32_t bs = 64 * 1024;
  xt::write_random_file(root / "f", 4 * bs + 10, 47);
  struct stat st {};
  REQUIRE(::stat((root / "f").c_str(), &st) == 0);
  xt::XdfsdProcess d(root.path());
  // A client that says it holds `offset` bytes of f as it was (its size and mtime, or others).
  auto ask = [&](std::uint64_t offset, bool manifest, std::int64_t mtime) {
    auto c = std::make_unique<xt::RawChannel>(d.port());
    auto h = xt::make_hello(xdfs::Mode::download, "f", 1, 4 * bs + 10);
    if (manifest) h.nego.extended_flags |= xdfs::wire::flag_manifest;
    h.nego.window = 8 * bs;
    h.nego.resume_offset = offset;
    h.nego.source_mtime_ns = mtime;
    REQUIRE(c->establish(h));
    return c;
  };
  const std::int64_t mtime = files::mtime_ns(st);
  for (const std::uint64_t offset : {std::uint64_t(100), std::uint64_t(bs + 1), std::uint64_t(4 * bs + 10)}) {
    CAPTURE(offset);
    auto c = ask(offset, true, mtime);
    auto ex = c->read_exception();
    REQUIRE_MESSAGE(ex.has_value(), d.log());
    CHECK(ex->code == xdfs::errc::bad_argument);
    CHECK(ex->refused);
    CHECK_MESSAGE(ex->message.find("resume offset " + std::to_string(offset) +
                                   " is not whole blocks before the end of the file") != std::string::npos,
                  ex->message);
  }
  {
    auto c = ask(bs, false, mtime);
    auto ex = c->read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->message.find("a resumed download needs the content manifest") != std::string::npos);
  }
  // The file is not the one the client began from: the server sends all of it (resume offset 0).
  for (const std::int64_t other : {mtime + 1, std::int64_t(0)}) {
    auto c = ask(bs, true, other);
    auto reply = c->read_frame();
    REQUIRE(reply.has_value());
    REQUIRE(reply->first.event == ChannelEvent::nego_reply);
    auto r = xdfs::wire::decode_reply(reply->second);
    REQUIRE(r.has_value());
    CHECK(r->resume_offset == 0);
    CHECK(r->file_size == 4 * bs + 10);
  }
  // Whole blocks of the same file: the reply resumes there.
  auto c = ask(2 * bs, true, mtime);
  auto reply = c->read_frame();
  REQUIRE(reply.has_value());
  REQUIRE(reply->first.event == ChannelEvent::nego_reply);
  auto r = xdfs::wire::decode_reply(reply->second);
  REQUIRE(r.has_value());
  CHECK(r->resume_offset == 2 * bs);
  CHECK(r->mtime_ns == mtime);
  c.reset();
  REQUIRE(d.alive());
  xt::check_serving(d.port(), root.path(), local.path());
}

}  // TEST_SUITE("badinput")
