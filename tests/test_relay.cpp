// Relay places against hostile ticket holders, in process (the chains themselves run on the
// namespace test bed: tests/relay/chain.py).
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <functional>

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>

#include <chrono>
#include <random>
#include <thread>

#include "forward.hpp"
#include "pack.hpp"
#include "support.hpp"
#include "xdfs/relay.hpp"
#include "xdfs/relay_registry.hpp"
#include "xdfs/xdfs.hpp"

namespace w = xdfs::wire;

namespace {

xdfs::ServerConfig relay_config(const xt::TempDir& root) {
  xdfs::ServerConfig c;
  c.root = root.path();
  c.idle_timeout = std::chrono::milliseconds(20000);
  return c;
}

// The master's side: registers a place for `path` (size bytes) and returns its ticket; the
// session stays open (the place lasts as long as it).
std::array<std::uint8_t, 32> register_place(xdfs::Session& master, const std::string& path, std::uint64_t size) {
  w::Negotiation n;
  n.mode = xdfs::Mode::relay;
  n.remote_path = path;
  n.file_size = size;
  n.source_mtime_ns = 1234;
  xdfs::xsec::random_fill(n.relay_plan.ticket);
  (void)master.begin(n);
  return n.relay_plan.ticket;
}

}  // namespace

TEST_SUITE("badinput") {

TEST_CASE("relay: a ticket holder writes the place's file and nothing else, with a key the server does not know") {
  xt::TempDir root, local;
  xt::InProcessServer srv(relay_config(root));
  const std::uint64_t size = 3 * 65536 + 17;
  xt::write_random_file(local / "src", size, 7);
  xt::write_file(root / "victim", "the master's other file");
  xdfs::SessionOptions so;
  so.block_size = 65536;
  so.protect = xdfs::xsec::Protect::clear;
  xdfs::Session master({"127.0.0.1", srv.port()}, so);
  const auto ticket = register_place(master, "placed", size);

  // A stranger's key, holding the ticket (as an upstream xdfsd would).
  const auto stranger = xdfs::xsec::KeyPair::generate();
  xdfs::TransferOptions opt;
  opt.block_size = so.block_size;
  opt.protect = so.protect;
  opt.identity_secret = stranger.secret;
  opt.relay_ticket.assign(ticket.begin(), ticket.end());
  opt.relay_size = size;
  opt.relay_mtime_ns = 1234;

  SUBCASE("without a ticket the stranger is refused") {
    auto plain = opt;
    plain.relay_ticket.clear();
    CHECK(xt::error_of([&] { (void)xdfs::upload(local / "src", {"127.0.0.1", srv.port()}, "x", plain); }) ==
          xdfs::errc::auth_failed);
  }
  SUBCASE("a wrong ticket is refused") {
    auto wrong = opt;
    wrong.relay_ticket.assign(32, 0x5a);
    CHECK(xt::error_of([&] { (void)xdfs::upload(local / "src", {"127.0.0.1", srv.port()}, "x", wrong); }) ==
          xdfs::errc::auth_failed);
  }
  SUBCASE("the upload lands under the place's name, whatever name it asked for") {
    // The file is whole already: its size and mtime are the place's (the source's own differ).
    std::atomic<std::uint64_t> all{size};
    opt.available = &all;
    auto r = xdfs::upload(local / "src", {"127.0.0.1", srv.port()}, "../../etc/elsewhere", opt);
    CHECK(r.bytes == size);
    CHECK(xt::files_equal(local / "src", root / "placed"));
    CHECK_FALSE(xt::exists(root / "elsewhere"));
  }
  SUBCASE("the session it opened carries nothing after that upload") {
    std::atomic<std::uint64_t> all{size};
    opt.available = &all;
    xdfs::Session s({"127.0.0.1", srv.port()}, opt);
    (void)xdfs::upload(s, local / "src", "placed", opt);
    auto later = opt;
    later.relay_ticket.clear();
    later.available = nullptr;
    std::string what;
    CHECK(xt::error_of([&] { (void)xdfs::download(s, "victim", local / "got", later); }, nullptr, &what) ==
          xdfs::errc::permission_denied);
    CHECK(what.find("nothing else") != std::string::npos);
    CHECK(xt::error_of([&] { (void)xdfs::upload(s, local / "src", "victim", later); }) == xdfs::errc::permission_denied);
    CHECK(xt::read_file(root / "victim") == "the master's other file");
    CHECK_FALSE(xt::exists(local / "got"));
    s.close();
  }
  master.close();
}

TEST_CASE("relay: a plan naming a hop that is not a relay peer, at that address, is refused with its cause") {
  xt::TempDir root, state;
  auto cfg = relay_config(root);
  const auto peer = xdfs::xsec::KeyPair::generate();
  cfg.relay_peers = state / "relay_peers";
  xt::write_file(cfg.relay_peers, xdfs::xsec::format_public(peer.public_key) + " 10.1.2.3:7721\n");
  xt::InProcessServer srv(cfg);
  xdfs::SessionOptions so;
  so.protect = xdfs::xsec::Protect::clear;
  for (const std::string& address : {std::string("10.9.9.9:7721"), std::string("10.1.2.3:7721")}) {
    CAPTURE(address);
    xdfs::Session master({"127.0.0.1", srv.port()}, so);
    w::Negotiation n;
    n.mode = xdfs::Mode::relay;
    n.remote_path = "f";
    n.file_size = 10;
    xdfs::xsec::random_fill(n.relay_plan.ticket);
    w::RelayHop hop;
    hop.address = address;
    hop.server_key = address == "10.1.2.3:7721" ? xdfs::xsec::KeyPair::generate().public_key : peer.public_key;
    n.relay_plan.next.push_back(hop);
    std::string what;
    CHECK(xt::error_of([&] { (void)master.begin(n); }, nullptr, &what) == xdfs::errc::permission_denied);
    CHECK(what.find("relay peers") != std::string::npos);
    master.close();
  }
}

TEST_CASE("relay: xduc's bad chain arguments exit 2 with one line naming the cause") {
  xt::TempDir dir;
  xt::write_random_file(dir / "f", 10, 1);
  xt::write_file(dir / "hosts", "xdfs://127.0.0.1:1/in/\nnot-a-url\n");
  xt::write_file(dir / "empty", "# nobody\n");
  const std::string a = "xdfs://127.0.0.1:1/in/", b = "xdfs://127.0.0.1:2/in/";
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  for (const auto& c : std::vector<Case>{
           {{dir.path(), a, b}, "is a directory (-r copies trees)"},
           {{dir / "f", "/dev/null", a, b}, "not a regular file or a directory"},
           {{dir / "f", dir / "missing", a, b}, "No such file"},
           {{"xdfs://127.0.0.1:3/x", a, b}, "both remote"},
           {{"--chains", "0", dir / "f", a, b}, "--chains takes"},
           {{"--chain-min", "0", dir / "f", a, b}, "--chain-min takes"},
           {{"-r", "--sync", dir.path(), a, b}, "--sync does not go with several hosts"},
           {{"-", a, b}, "not standard input"},
           {{"--hosts", dir / "nope", dir / "f"}, "--hosts"},
           {{"--hosts", dir / "hosts", dir / "f"}, "not-a-url"},
           {{"--hosts", dir / "empty", dir / "f"}, "names no host"},
       }) {
    CAPTURE(c.says);
    auto r = xt::xduc(c.args);
    CHECK(r.status == 2);
    CHECK(r.err.find(c.says) != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
}

TEST_CASE("pull: xduc get's bad arguments exit 2 with one line naming the cause, and leave DST alone") {
  xt::TempDir dir;
  xt::write_file(dir / "keep", "kept");
  const std::string url = "xdfs://127.0.0.1:1/f";
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  for (const auto& c : std::vector<Case>{
           {{"get", "--listen", "nonsense", url, dir.path()}, "--listen takes"},
           {{"get", "--listen", "localhost:7722", url, dir.path()}, "--listen takes"},
           {{"get", "--listen", "127.0.0.1:99999", url, dir.path()}, "--listen takes"},
           {{"get", "--listen", "[::1", url, dir.path()}, "--listen takes"},
           {{"get", "--listen", "127.0.0.1", url, dir.path()}, "--listen takes"},
           {{"get", "--server-log", dir / "no/such/dir/log", url, dir.path()}, "--server-log"},
           {{"--listen", "0.0.0.0:0", dir / "keep", url}, "--listen goes with get"},
           {{"--server-log", dir / "log", dir / "keep", url}, "--server-log goes with get"},
           {{"get", "--memory-stage", dir / "no/such", url, dir.path()}, "--memory-stage takes"},
           {{"get", "--memory-stage", dir / "keep", url, dir.path()}, "--memory-stage takes"},
           {{"get", url}, "get takes"},
           {{"get", dir / "keep", dir.path()}, "get takes"},
           {{"get", url, "xdfs://127.0.0.1:2/x"}, "get takes"},
       }) {
    CAPTURE(c.says);
    auto r = xt::xduc(c.args);
    CHECK(r.status == 2);
    CHECK(r.err.find(c.says) != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
  // A directory given for the memory stage that is not on a tmpfs (where DIR is not on one).
  if (struct statfs fs {}; ::statfs(dir.path().c_str(), &fs) == 0 && fs.f_type != TMPFS_MAGIC) {
    auto r = xt::xduc({"get", "--memory-stage", dir.path(), url, dir.path()});
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.err.find("not on a tmpfs") != std::string::npos, r.err);
  }
  CHECK(xt::read_file(dir / "keep") == "kept");
  CHECK(!std::filesystem::exists(dir / "log"));
}

TEST_CASE("relay: a malformed relay peers line is refused, naming the file and the line") {
  xt::TempDir root, state;
  auto cfg = relay_config(root);
  cfg.relay_peers = state / "relay_peers";
  const auto peer = xdfs::xsec::KeyPair::generate();
  // A key without an address: the server could not know where it may connect.
  xt::write_file(cfg.relay_peers, "# peers\n" + xdfs::xsec::format_public(peer.public_key) + "\n");
  xt::InProcessServer srv(cfg);
  xdfs::SessionOptions so;
  so.protect = xdfs::xsec::Protect::clear;
  xdfs::Session master({"127.0.0.1", srv.port()}, so);
  w::Negotiation n;
  n.mode = xdfs::Mode::relay;
  n.remote_path = "f";
  n.file_size = 10;
  xdfs::xsec::random_fill(n.relay_plan.ticket);
  w::RelayHop hop;
  hop.address = "10.1.2.3:7721";
  hop.server_key = peer.public_key;
  n.relay_plan.next.push_back(hop);
  std::string what;
  CHECK(xt::error_of([&] { (void)master.begin(n); }, nullptr, &what) == xdfs::errc::permission_denied);
  CHECK(what.find(cfg.relay_peers + ":2") != std::string::npos);
  CHECK(what.find("HOST:PORT") != std::string::npos);
  master.close();
}

}  // TEST_SUITE("badinput")

// A pack (relay/src/pack.hpp), as a master writes it, and as a hostile one might.
namespace {

struct PackBytes {
  std::string bytes;
  void entry(const std::string& path, std::uint32_t mode, std::int64_t mtime, std::uint64_t size, const std::string& data,
             std::uint16_t path_len_override = 0) {
    auto le = [&](std::uint64_t v, int n) {
      for (int i = 0; i < n; ++i) bytes.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    };
    le(path_len_override ? path_len_override : path.size(), 2);
    bytes += path;
    le(mode, 4);
    le(static_cast<std::uint64_t>(mtime), 8);
    le(size, 8);
    bytes += data;
  }
};

// Writes the pack out into ROOT/in, as a host does with a pack placed at in/.xdfs-pack-...
xdfs::relay_detail::Unpacked unpack_bytes(const std::string& root, const std::string& pack, std::uint64_t max_file = 0,
                                          unsigned max_version = 2) {
  xt::TempDir scratch;
  xt::write_file(scratch / "pack", pack);
  xdfs::files::Fd fd(::open((scratch / "pack").c_str(), O_RDONLY | O_CLOEXEC));
  xdfs::files::Fd r(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  xdfs::pathm::TreeWriter writer(r.get(), "test", false, 65536, 1, 022, max_file);
  return xdfs::relay_detail::unpack(fd.get(), pack.size(), writer, "in", max_file, nullptr, max_version);
}

// Damages a good pack a thousand ways: each fails or writes inside ROOT/in, never crashes.
void run_damaged(const std::string& good) {
  std::mt19937_64 rng(42);
  for (int round = 0; round < 1000; ++round) {
    std::string bad = good;
    for (int k = 0; k < 4; ++k) bad[rng() % bad.size()] = static_cast<char>(rng());
    if (rng() % 4 == 0) bad.resize(rng() % bad.size());
    xt::TempDir top;
    std::filesystem::create_directories(top / "root/in");
    (void)unpack_bytes(top / "root", bad);
    std::size_t outside = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(top.path()))
      outside += e.path().string().rfind((top / "root/in").c_str(), 0) != 0 && e.path() != top / "root";
    CHECK(outside == 0);
  }
}

// Asks the master at `port` for the set "set" as a pulling host does, the negotiation shaped by
// `shape` (its place is never registered: nobody listens at its port; the answers are what counts).
xdfs::errc ask_set(std::uint16_t port, const xdfs::SessionOptions& so, const std::function<void(w::Negotiation&)>& shape,
                   w::NegotiationReply* got, std::string* what) {
  return xt::error_of(
      [&] {
        xdfs::Session s({"127.0.0.1", port}, so);
        w::Negotiation n;
        n.mode = xdfs::Mode::pull;
        n.remote_path = "set";
        n.block_size = so.block_size;
        n.pull_port = 9;
        n.pull_name = ".xdfs-set-0";
        n.pull_set = true;
        n.pull_parts = true;
        shape(n);
        *got = s.begin(n);
        s.close();
      },
      nullptr, what);
}

}  // namespace

TEST_SUITE("badinput") {

using PackedFiles = std::vector<std::tuple<std::string, std::string, std::uint32_t>>;

// Packs SRC's files (from, path in the pack, mode), each with the same mtime, into `pack`.
void pack_files(int pack, const xt::TempDir& src, const PackedFiles& files) {
  bool first = true;
  for (const auto& [from, to, mode] : files) {
    xdfs::files::Fd in(::open((src / from).c_str(), O_RDONLY | O_CLOEXEC));
    const auto size = std::filesystem::file_size(src / from);
    REQUIRE(xdfs::relay_detail::pack_append(pack, first, {to, mode, 1'500'000'000'000'000'123, size}, in.get()));
    first = false;
  }
}

TEST_CASE("relay packs: what a master packs is written out whole, with modes and mtimes") {
  xt::TempDir src, root;
  xt::write_random_file(src / "a", 70000, 1);
  xt::write_file(src / "b", "");
  xt::write_random_file(src / "c", 12, 2);
  xt::TempDir scratch;
  xdfs::files::Fd pack(::open((scratch / "pack").c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  const PackedFiles files{{"a", "x/y/a", 0640}, {"b", "b", 0600}, {"c", "x/c", 0755}};
  pack_files(pack.get(), src, files);
  pack.reset();
  std::filesystem::create_directory(root / "in");
  const auto u = unpack_bytes(root.path(), xt::read_file(scratch / "pack"));
  CHECK_MESSAGE(u.code == xdfs::errc::ok, u.message);
  CHECK(u.files == 3);
  for (const auto& [from, to, mode] : files) {
    CAPTURE(to);
    CHECK(xt::files_equal(src / from, root / ("in/" + to)));
    struct stat st {};
    REQUIRE(::stat((root / ("in/" + to)).c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == (mode & ~022u));
    CHECK(st.st_mtim.tv_sec == 1'500'000'000);
  }
}

TEST_CASE("relay packs: an entry's header is read between its offset and the end given, and nowhere else") {
  namespace rd = xdfs::relay_detail;
  xt::TempDir src, scratch;
  xt::write_random_file(src / "a", 12, 1);
  xt::write_random_file(src / "b", 5, 2);
  xdfs::files::Fd pack(::open((scratch / "pack").c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  pack_files(pack.get(), src, {{"a", "a", 0644}, {"b", "b", 0644}});
  const std::uint64_t size = std::filesystem::file_size(scratch / "pack");
  rd::PackHeadBuffer buf{};
  const auto first = rd::read_pack_head(pack.get(), rd::pack_magic.size(), size, buf);
  REQUIRE(first.read == rd::PackHead::ok);
  CHECK(first.path == "a");
  CHECK(first.size == 12);
  const std::uint64_t second = first.data + first.size;
  const auto b = rd::read_pack_head(pack.get(), second, size, buf);
  REQUIRE(b.read == rd::PackHead::ok);
  CHECK(b.path == "b");
  CHECK(b.data + b.size == size);
  // Fewer bytes than a header, a path past the end, an offset past the end: nothing read there.
  CHECK(rd::read_pack_head(pack.get(), second, second + 10, buf).read == rd::PackHead::short_head);
  CHECK(rd::read_pack_head(pack.get(), second, b.data - 1, buf).read == rd::PackHead::short_path);
  CHECK(rd::read_pack_head(pack.get(), second, second - 1, buf).read == rd::PackHead::short_head);
  // A file shorter than the end it was given: a read that failed, not a header cut short.
  CHECK(rd::read_pack_head(pack.get(), size, size + 100, buf).read == rd::PackHead::io);
}

TEST_CASE("relay packs: the files a host copied out while the pack arrived are renamed into place, the others "
          "copied") {
  xt::TempDir src, root, scratch, early;
  xt::write_random_file(src / "a", 70000, 1);
  xt::write_random_file(src / "c", 12, 2);
  xdfs::files::Fd pack(::open((scratch / "pack").c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  const PackedFiles files{{"a", "x/y/a", 0640}, {"c", "x/c", 0755}};
  pack_files(pack.get(), src, files);
  // a's bytes start after the magic and its entry's header; its copy is told apart from the
  // pack's by its bytes (as the master's digest would not let happen: here it shows which went).
  const std::uint64_t a_at = xdfs::relay_detail::pack_magic.size() + xdfs::relay_detail::pack_entry_size(5, 0);
  const auto pack_size = static_cast<std::uint64_t>(::lseek(pack.get(), 0, SEEK_END));
  xt::write_random_file(early / std::to_string(a_at), 70000, 9);
  const std::string copied = xt::read_file(early / std::to_string(a_at));
  xdfs::files::Fd r(::open(root.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  xdfs::files::Fd e(::open(early.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  // The pack unpacked into root/in, with the copies in `early` that end at or below `upto`.
  auto unpack_upto = [&](std::uint64_t upto) {
    xdfs::pathm::TreeWriter writer(r.get(), "test", false, 65536, 1, 022);
    const xdfs::relay_detail::Prestaged pre{e.get(), upto};
    return xdfs::relay_detail::unpack(pack.get(), pack_size, writer, "in", 0, nullptr, 1, &pre);
  };
  SUBCASE("renamed, up to where it got") {
    const auto u = unpack_upto(a_at + 70000);
    REQUIRE_MESSAGE(u.code == xdfs::errc::ok, u.message);
    CHECK(u.files == 2);
    CHECK(u.prestaged == 1);
    CHECK(xt::read_file(root / "in/x/y/a") == copied);
    CHECK(!std::filesystem::exists(early / std::to_string(a_at)));
    CHECK(xt::files_equal(src / "c", root / "in/x/c"));
    struct stat st {};
    REQUIRE(::stat((root / "in/x/y/a").c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0640);
    CHECK(st.st_mtim.tv_sec == 1'500'000'000);
  }
  SUBCASE("not past where it got") {
    const auto u = unpack_upto(a_at + 69999);
    REQUIRE_MESSAGE(u.code == xdfs::errc::ok, u.message);
    CHECK(u.prestaged == 0);
    CHECK(xt::files_equal(src / "a", root / "in/x/y/a"));
  }
  SUBCASE("a copy of another size, or none, is made again from the pack") {
    ::truncate((early / std::to_string(a_at)).c_str(), 100);
    for (int round = 0; round < 2; ++round) {
      CAPTURE(round);
      if (round == 1) std::filesystem::remove(early / std::to_string(a_at));
      const auto u = unpack_upto(a_at + 70000);
      REQUIRE_MESSAGE(u.code == xdfs::errc::ok, u.message);
      CHECK(u.prestaged == 0);
      CHECK(xt::files_equal(src / "a", root / "in/x/y/a"));
    }
  }
}

TEST_CASE("relay packs of version 2: a set's directories and symlinks come out as packed, the directories' modes "
          "left to the caller") {
  xt::TempDir src, root, scratch;
  xt::write_random_file(src / "f", 5000, 4);
  xdfs::files::Fd pack(::open((scratch / "pack").c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  using T = xdfs::pathm::Type;
  using E = xdfs::relay_detail::PackEntry;
  REQUIRE(xdfs::relay_detail::pack_append(pack.get(), true, E{"d", 0555, 1'400'000'000'000'000'000, 0, T::directory, {}},
                                          -1, 2));
  REQUIRE(xdfs::relay_detail::pack_append(pack.get(), false, E{"d/e", 0700, 0, 0, T::directory, {}}, -1, 2));
  REQUIRE(xdfs::relay_detail::pack_append(pack.get(), false, E{"d/l", 0777, 0, 4, T::symlink, "../f"}, -1, 2));
  {
    xdfs::files::Fd in(::open((src / "f").c_str(), O_RDONLY | O_CLOEXEC));
    REQUIRE(xdfs::relay_detail::pack_append(pack.get(), false, E{"d/e/f", 0640, 0, 5000, T::file, {}}, in.get(), 2));
  }
  // (Version 1 holds files only; a target must be the entry's bytes.)
  CHECK_FALSE(xdfs::relay_detail::pack_append(pack.get(), false, E{"x", 0755, 0, 0, T::directory, {}}, -1, 1));
  CHECK_FALSE(xdfs::relay_detail::pack_append(pack.get(), false, E{"x", 0777, 0, 3, T::symlink, "../f"}, -1, 2));
  pack.reset();
  std::filesystem::create_directory(root / "in");
  const auto bytes = xt::read_file(scratch / "pack");
  CHECK(bytes.rfind(std::string(xdfs::relay_detail::pack_magic_2), 0) == 0);
  const auto u = unpack_bytes(root.path(), bytes);
  CHECK_MESSAGE(u.code == xdfs::errc::ok, u.message);
  CHECK(u.files == 1);
  CHECK(u.links == 1);
  REQUIRE(u.dirs.size() == 2);
  CHECK(u.dirs[0].path == "in/d");
  CHECK(u.dirs[0].mode == 0555);
  CHECK(u.dirs[0].mtime_ns == 1'400'000'000'000'000'000);
  CHECK(u.dirs[1].path == "in/d/e");
  CHECK(std::filesystem::is_directory(root / "in/d/e"));
  CHECK(std::filesystem::read_symlink(root / "in/d/l") == "../f");
  CHECK(xt::files_equal(src / "f", root / "in/d/e/f"));
  struct stat st {};
  REQUIRE(::stat((root / "in/d").c_str(), &st) == 0);
  CHECK((st.st_mode & 0700) == 0700);  // (writable while it fills: its own mode comes last)
  SUBCASE("where only files are taken (a relay's pack, a set's part past the first): refused whole") {
    xt::TempDir other;
    std::filesystem::create_directory(other / "in");
    const auto v1 = unpack_bytes(other.path(), bytes, 0, 1);
    CHECK(v1.code == xdfs::errc::protocol_error);
    CHECK(v1.message.find("version 2") != std::string::npos);
    CHECK(std::filesystem::is_empty(other / "in"));
  }
}

TEST_CASE("relay packs: a hostile pack fails naming its cause, and writes nothing outside its directory") {
  const std::string magic(xdfs::relay_detail::pack_magic);
  struct Case {
    std::string name, pack, says;
  };
  std::vector<Case> cases;
  auto with = [&](const std::string& name, const std::string& says, auto&& build) {
    PackBytes p;
    p.bytes = magic;
    build(p);
    cases.push_back({name, p.bytes, says});
  };
  cases.push_back({"not a pack", "xdfs-pack 9\nxxxxxxxx", "not a pack"});
  cases.push_back({"empty", "", "not a pack"});
  with("a path up and out", "'..'", [](PackBytes& p) { p.entry("../../escaped", 0644, 0, 3, "abc"); });
  with("an absolute path", "absolute", [](PackBytes& p) { p.entry("/tmp/escaped", 0644, 0, 3, "abc"); });
  with("a size past the end", "past the pack's end", [](PackBytes& p) { p.entry("f", 0644, 0, 1000, "abc"); });
  with("a size of 2^63", "past the pack's end", [](PackBytes& p) { p.entry("f", 0644, 0, std::uint64_t(1) << 63, "abc"); });
  with("an empty path", "path of 0 bytes", [](PackBytes& p) { p.entry("", 0644, 0, 0, ""); });
  with("a path longer than what is left", "path of 60000 bytes", [](PackBytes& p) { p.entry("f", 0644, 0, 0, "", 60000); });
  with("setuid", "permission bits", [](PackBytes& p) { p.entry("f", 04755, 0, 1, "x"); });
  with("an entry cut short", "cut short", [](PackBytes& p) {
    p.entry("ok", 0644, 0, 2, "ok");
    p.bytes += "\x05";
  });
  with("a NUL in a path", "NUL", [](PackBytes& p) { p.entry(std::string("a\0b", 3), 0644, 0, 1, "x"); });
  with("a good file, then a bad one", "'..'", [](PackBytes& p) {
    p.entry("first", 0644, 0, 5, "first");
    p.entry("../second", 0644, 0, 6, "second");
  });
  with("more than 20000 files", "more than 20000 files", [](PackBytes& p) {
    for (int i = 0; i <= 20000; ++i) p.entry("f" + std::to_string(i), 0644, 0, 0, "");
  });
  with("a kind in a pack of version 1", "permission bits", [](PackBytes& p) { p.entry("d", S_IFDIR | 0755, 0, 0, ""); });
  // Version 2: the kind in the mode's file-type bits.
  const std::string magic2(xdfs::relay_detail::pack_magic_2);
  auto with2 = [&](const std::string& name, const std::string& says, auto&& build) {
    PackBytes p;
    p.bytes = magic2;
    p.entry("d", S_IFDIR | 0755, 0, 0, "");  // (a good entry first: nothing is written unless all are)
    build(p);
    cases.push_back({name, p.bytes, says});
  };
  with2("a directory with bytes", "a directory with bytes", [](PackBytes& p) { p.entry("e", S_IFDIR | 0755, 0, 3, "abc"); });
  with2("a symlink without a target", "target of 0 bytes", [](PackBytes& p) { p.entry("l", S_IFLNK | 0777, 0, 0, ""); });
  with2("a symlink's target past 4096 bytes", "target of 5000 bytes",
        [](PackBytes& p) { p.entry("l", S_IFLNK | 0777, 0, 5000, std::string(5000, 'a')); });
  with2("a NUL in a symlink's target", "NUL", [](PackBytes& p) { p.entry("l", S_IFLNK | 0777, 0, 3, std::string("a\0b", 3)); });
  with2("a FIFO", "neither a file, a directory nor a symlink", [](PackBytes& p) { p.entry("p", S_IFIFO | 0644, 0, 0, ""); });
  with2("no kind", "neither a file, a directory nor a symlink", [](PackBytes& p) { p.entry("f", 0644, 0, 1, "x"); });
  with2("setuid", "permission bits", [](PackBytes& p) { p.entry("f", S_IFREG | 04755, 0, 1, "x"); });
  with2("a symlink's path up and out", "'..'", [](PackBytes& p) { p.entry("../l", S_IFLNK | 0777, 0, 4, "/etc"); });
  with2("a path twice", "'d' twice", [](PackBytes& p) { p.entry("d", S_IFREG | 0644, 0, 1, "x"); });
  with2("a file beneath the pack's symlink", "beneath the pack's file or symlink 'l'", [](PackBytes& p) {
    p.entry("l", S_IFLNK | 0777, 0, 1, "d");
    p.entry("l/f", S_IFREG | 0644, 0, 1, "x");
  });
  with2("a symlink above what the pack holds", "beneath the pack's file or symlink 'd/e'", [](PackBytes& p) {
    p.entry("d/e/f", S_IFREG | 0644, 0, 1, "x");
    p.entry("d/e-", S_IFREG | 0644, 0, 1, "x");
    p.entry("d/e", S_IFLNK | 0777, 0, 4, "/etc");
  });
  with2("a directory beneath the pack's file", "beneath the pack's file or symlink 'f'", [](PackBytes& p) {
    p.entry("f", S_IFREG | 0644, 0, 1, "x");
    p.entry("f/g", S_IFDIR | 0755, 0, 0, "");
  });
  with2("a '.' component", "an empty or '.' component", [](PackBytes& p) { p.entry("d/./f", S_IFREG | 0644, 0, 1, "x"); });
  with2("an empty component", "an empty or '.' component", [](PackBytes& p) { p.entry("d//f", S_IFREG | 0644, 0, 1, "x"); });
  with2("a trailing slash", "an empty or '.' component", [](PackBytes& p) { p.entry("e/", S_IFDIR | 0755, 0, 0, ""); });
  with2("more than 20000 entries", "more than 20000 entries", [](PackBytes& p) {
    for (int i = 0; i < 20000; ++i) p.entry("d" + std::to_string(i), S_IFDIR | 0755, 0, 0, "");
  });
  for (const auto& c : cases) {
    CAPTURE(c.name);
    xt::TempDir top;
    std::filesystem::create_directories(top / "root/in");
    const auto u = unpack_bytes(top / "root", c.pack);
    CHECK(u.code != xdfs::errc::ok);
    CHECK(u.files == 0);  // the whole pack is checked before anything is written
    CHECK(std::filesystem::is_empty(top / "root/in"));
    CHECK_MESSAGE(u.message.find(c.says) != std::string::npos, u.message);
    CHECK(u.message.find('\n') == std::string::npos);
    std::size_t outside = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(top.path()))
      outside += e.path().string().rfind((top / "root").c_str(), 0) != 0;
    CHECK(outside == 0);
    CHECK_FALSE(xt::exists("/tmp/escaped"));
  }
  SUBCASE("a file over the server's size limit") {
    xt::TempDir root;
    std::filesystem::create_directory(root / "in");
    PackBytes p;
    p.bytes = magic;
    p.entry("big", 0644, 0, 100, std::string(100, 'x'));
    const auto u = unpack_bytes(root.path(), p.bytes, 50);
    CHECK(u.code == xdfs::errc::limit_exceeded);
    CHECK_FALSE(xt::exists(root / "in/big"));
  }
  SUBCASE("a thousand damaged packs: each fails or writes inside, never crashes") {
    PackBytes good;
    good.bytes = magic;
    for (int i = 0; i < 8; ++i) good.entry("d" + std::to_string(i % 3) + "/f" + std::to_string(i), 0644, 0, 40, std::string(40, 'a' + i));
    run_damaged(good.bytes);
  }
  SUBCASE("a thousand damaged packs of version 2 (symlinks out of the root among them): the same") {
    PackBytes good;
    good.bytes = magic2;
    good.entry("d0", S_IFDIR | 0755, 0, 0, "");
    good.entry("d0/up", S_IFLNK | 0777, 0, 8, "../../..");
    good.entry("d1", S_IFLNK | 0777, 0, 4, "/tmp");
    for (int i = 0; i < 6; ++i) good.entry("d" + std::to_string(i % 2) + "/f" + std::to_string(i), S_IFREG | 0644, 0, 40, std::string(40, 'a' + i));
    run_damaged(good.bytes);
  }
}

TEST_CASE("relay packs: a pack place under any name but a pack's is refused (a pack is removed once written out)") {
  xt::TempDir root;
  xt::write_file(root / "victim", "the user's file");
  xt::InProcessServer srv(relay_config(root));
  xdfs::SessionOptions so;
  so.protect = xdfs::xsec::Protect::clear;
  xdfs::Session master({"127.0.0.1", srv.port()}, so);
  w::Negotiation n;
  n.mode = xdfs::Mode::relay;
  n.remote_path = "victim";
  n.file_size = 10;
  n.relay_plan.pack = true;
  xdfs::xsec::random_fill(n.relay_plan.ticket);
  std::string what;
  CHECK(xt::error_of([&] { (void)master.begin(n); }, nullptr, &what) == xdfs::errc::bad_argument);
  CHECK(what.find(".xdfs-pack-") != std::string::npos);
  CHECK(xt::read_file(root / "victim") == "the user's file");
  master.close();
}

}  // TEST_SUITE("badinput")

TEST_SUITE("badinput") {

TEST_CASE("relay packs: a host writes out only the pack whose digest the master gave") {
  xt::TempDir root, local;
  std::filesystem::create_directory(root / "in");
  xt::InProcessServer srv(relay_config(root));
  xt::write_random_file(local / "a", 1000, 3);
  {
    xdfs::files::Fd pack(::open((local / "pack").c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    xdfs::files::Fd in(::open((local / "a").c_str(), O_RDONLY | O_CLOEXEC));
    REQUIRE(xdfs::relay_detail::pack_append(pack.get(), true, {"sub/a", 0644, 0, 1000}, in.get()));
  }
  xdfs::TransferOptions opt;
  opt.protect = xdfs::xsec::Protect::clear;
  opt.block_size = 65536;
  const std::vector<xdfs::RelayTarget> to{{{"127.0.0.1", srv.port()}, "in/.xdfs-pack-0123456789abcdef"}};
  SUBCASE("the master's own: written out, and the pack removed") {
    xdfs::files::Fd fd(::open((local / "pack").c_str(), O_RDONLY | O_CLOEXEC));
    const auto d = xdfs::manifest::of_file(fd.get(), std::filesystem::file_size(local / "pack"), opt.block_size);
    REQUIRE(d.code == xdfs::errc::ok);
    const auto r = xdfs::relay_detail::relay_file(local / "pack", to, opt, {}, &d.digest);
    REQUIRE(r.hosts.size() == 1);
    CHECK_MESSAGE(r.hosts[0].ok, r.hosts[0].message);
    CHECK(xt::files_equal(local / "a", root / "in/sub/a"));
  }
  SUBCASE("any other digest (an upstream's pack): nothing written, the host failed naming it") {
    xdfs::manifest::Digest other{};
    other.fill(0x11);
    const auto r = xdfs::relay_detail::relay_file(local / "pack", to, opt, {}, &other);
    REQUIRE(r.hosts.size() == 1);
    CHECK_FALSE(r.hosts[0].ok);
    CHECK_MESSAGE(r.hosts[0].message.find("not the one the master gave") != std::string::npos, r.hosts[0].message);
    CHECK_FALSE(xt::exists(root / "in/sub/a"));
  }
  std::size_t packs = 0;
  for (const auto& e : std::filesystem::directory_iterator(root / "in"))
    packs += e.path().filename().string().rfind(".xdfs-pack-", 0) == 0;
  CHECK(packs == 0);
}

}  // TEST_SUITE("badinput")

TEST_SUITE("badinput") {

TEST_CASE("pull sets: a set larger than a pack is dealt into parts; a part is given only from the plan its host began with") {
  xt::TempDir root;
  std::filesystem::create_directories(root / "set/sub");
  {  // a file over a pack's 16 MiB (sparse) and a small one: two parts
    xdfs::files::Fd f(::open((root / "set/big.bin").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
    REQUIRE(f);
    REQUIRE(::ftruncate(f.get(), (17 << 20) + 3) == 0);
  }
  xt::write_file(root / "set/sub/small", "seven b");
  xdfs::SessionOptions so;
  so.channels = 1;
  so.block_size = 1 << 18;
  so.protect = xdfs::xsec::Protect::clear;
  auto cfg = relay_config(root);
  xt::InProcessServer srv(cfg);
  auto ask = [&](bool parts, std::uint32_t part, std::vector<std::uint8_t> plan, w::NegotiationReply* got,
                 std::string* what) {
    return ask_set(
        srv.port(), so,
        [&](w::Negotiation& n) {
          n.pull_name = ".xdfs-set-" + std::to_string(part);
          n.pull_parts = parts;
          n.pull_part = part;
          n.pull_plan = std::move(plan);
        },
        got, what);
  };
  w::NegotiationReply first, second;
  std::string what;
  // A host that takes a set only as one pack (an older xduc): refused, saying why.
  CHECK(ask(false, 0, {}, &first, &what) == xdfs::errc::not_supported);
  CHECK(what.find("2 parts") != std::string::npos);
  CHECK(what.find("upgrade") != std::string::npos);
  // The first part: the pack of the small files (packs come first); the reply names the plan.
  REQUIRE(ask(true, 0, {}, &first, &what) == xdfs::errc::ok);
  CHECK(first.set_parts == 2);
  CHECK(first.set_plan.size() == 32);
  CHECK(first.set_path.empty());
  const std::uint64_t pack = xdfs::relay_detail::pack_magic.size() + 22 + std::string("sub/small").size() + 7;
  CHECK(first.file_size == pack);
  CHECK(first.set_bytes == pack + (17u << 20) + 3);
  // The second, with that plan: the large file, alone, under its path in the set.
  REQUIRE(ask(true, 1, first.set_plan, &second, &what) == xdfs::errc::ok);
  CHECK(second.set_path == "big.bin");
  CHECK(second.file_size == (17u << 20) + 3);
  CHECK(second.set_plan == first.set_plan);
  // Another plan's part, or a part the set does not have: refused, the host told to pull again.
  auto other = first.set_plan;
  other[0] ^= 1;
  CHECK(ask(true, 1, other, &second, &what) == xdfs::errc::size_mismatch);
  CHECK(what.find("changed") != std::string::npos);
  CHECK(ask(true, 2, first.set_plan, &second, &what) == xdfs::errc::size_mismatch);
  CHECK(what.find("2 parts now, none numbered 2") != std::string::npos);
  // The set changes (a file added): the old plan's later parts are refused.
  xt::write_file(root / "set/new", "x");
  CHECK(ask(true, 1, first.set_plan, &second, &what) == xdfs::errc::size_mismatch);
  CHECK(what.find("changed") != std::string::npos);
}

TEST_CASE("pull sets with their directories and symlinks: in part 0, within a pack; the plan is another") {
  xt::TempDir root;
  std::filesystem::create_directories(root / "set/sub/empty");
  xt::write_file(root / "set/sub/small", "seven b");
  std::filesystem::create_symlink("sub/small", root / "set/link");
  xdfs::SessionOptions so;
  so.channels = 1;
  so.block_size = 1 << 18;
  so.protect = xdfs::xsec::Protect::clear;
  auto cfg = relay_config(root);
  cfg.pull_pack_size = 64 << 10;
  xt::InProcessServer srv(cfg);
  auto ask = [&](bool links, w::NegotiationReply* got, std::string* what) {
    return ask_set(srv.port(), so, [&](w::Negotiation& n) { n.pull_links = links; }, got, what);
  };
  w::NegotiationReply files, all;
  std::string what;
  REQUIRE(ask(false, &files, &what) == xdfs::errc::ok);
  REQUIRE(ask(true, &all, &what) == xdfs::errc::ok);
  const auto entry = [](std::string_view path, std::uint64_t size) { return 22 + path.size() + size; };
  CHECK(files.file_size == xdfs::relay_detail::pack_magic.size() + entry("sub/small", 7));
  CHECK(all.file_size == xdfs::relay_detail::pack_magic.size() + entry("link", 9) + entry("sub", 0) +
                             entry("sub/empty", 0) + entry("sub/small", 7));
  CHECK(all.set_parts == 1);
  CHECK(all.set_plan != files.set_plan);  // (hosts of either kind never share a chain)
  // More of them than a pack holds: refused, saying so.
  for (int i = 0; i < 20; ++i)
    std::filesystem::create_symlink(std::string(4000, 'a' + i % 26), root / ("set/l" + std::to_string(i)));
  std::this_thread::sleep_for(std::chrono::milliseconds(2100));  // (a plan is kept 2 s)
  CHECK(ask(true, &all, &what) == xdfs::errc::not_supported);
  CHECK(what.find("directories and symlinks take") != std::string::npos);
  CHECK(what.find("--pull-pack-size") != std::string::npos);
  CHECK(ask(false, &files, &what) == xdfs::errc::ok);  // (to a host that takes only files, it is as before)
}

TEST_CASE("relay places keep their blocks' digests in the room taken once for the place, and past it none") {
  // The room is what the memory budget counted for the place; growing by doubling would take up
  // to three times that. A block past it is not kept (its forwarder hashes it itself).
  xdfs::runtime::RelayDigests digests;
  REQUIRE(digests.size_for(5));
  xdfs::manifest::Digest d{}, got{};
  for (std::uint64_t b = 0; b < 5; ++b) {
    d[0] = static_cast<std::uint8_t>(b + 1);
    digests.put(b, d);
  }
  digests.put(5, d);
  digests.put(std::uint64_t(1) << 40, d);
  for (std::uint64_t b = 0; b < 5; ++b) {
    REQUIRE(digests.get(b, got));
    CHECK(got[0] == b + 1);
  }
  CHECK_FALSE(digests.get(5, got));
  CHECK_FALSE(digests.get(std::uint64_t(1) << 40, got));
  // A place with no room taken keeps nothing, and asking for more than memory holds says so.
  xdfs::runtime::RelayDigests none;
  none.put(0, d);
  CHECK_FALSE(none.get(0, got));
  CHECK_FALSE(none.size_for(std::uint64_t(1) << 60));
}

TEST_CASE("pull: chains running at once are capped, a key's by its sessions and a server's by its max_sessions; "
          "one that ends makes room") {
  using namespace std::chrono_literals;
  xt::TempDir root;
  for (const char* name : {"a", "b", "c"}) xt::write_random_file(root / name, 1 << 20, 7);
  // Where each host's own server should be: a socket that takes the master's registrations and
  // never answers, so that each chain waits out its host's registration (3 s) after the session
  // that started it has ended.
  struct Silent {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    std::uint16_t port = 0;
    std::vector<xdfs::files::Fd> held;
    Silent() {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      socklen_t len = sizeof a;
      REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
      REQUIRE(::listen(fd, 64) == 0);
      REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
      port = ntohs(a.sin_port);
    }
    ~Silent() { ::close(fd); }
    bool registered(int timeout_ms) {  // one more registration arrived
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, timeout_ms) <= 0) return false;
      held.emplace_back(::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC));
      return static_cast<bool>(held.back());
    }
  } silent;
  auto ask = [&](std::uint16_t port, const std::string& path, std::uint32_t block, bool registers, std::string* what) {
    return xt::error_of(
        [&] {
          xdfs::SessionOptions so;
          so.channels = 1;
          so.block_size = block;
          so.protect = xdfs::xsec::Protect::clear;
          xdfs::Session s({"127.0.0.1", port}, so);
          w::Negotiation n;
          n.mode = xdfs::Mode::pull;
          n.remote_path = path;
          n.pull_port = silent.port;
          n.pull_name = path;
          (void)s.begin(n);
          // (Closed once its chain has taken it: a host whose session ends first is not registered.)
          if (registers) REQUIRE(silent.registered(10000));
          s.close();
        },
        nullptr, what);
  };
  // (Sessions that ended are gone before the next asks: the cap is on chains, not sessions.)
  auto settled = [](xt::InProcessServer& srv) {
    for (int i = 0; i < 500 && srv.server().active_sessions() > 0; ++i) std::this_thread::sleep_for(10ms);
    return srv.server().active_sessions() == 0;
  };
  auto cfg = relay_config(root);
  std::string scope;
  SUBCASE("per key") {
    cfg.max_sessions_per_key = 2;
    scope = "of this key";
  }
  SUBCASE("per server") {
    cfg.max_sessions = 2;
    scope = "are running on this server";
  }
  xt::InProcessServer srv(cfg);
  // Two chains, each outliving its session: another file, or the same with another block size
  // (another chain), is refused while they run, saying why; the same file joins its chain. All
  // within the 3 s the first chain outlives its session by (tried again if the machine stalled).
  bool judged = false;
  for (int attempt = 0; attempt < 3 && !judged; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(4s);  // (the chains of the last attempt end)
    std::string what, other, again;
    REQUIRE(ask(srv.port(), "a", 1 << 18, true, &what) == xdfs::errc::ok);
    const auto t0 = std::chrono::steady_clock::now();
    REQUIRE(settled(srv));
    REQUIRE(ask(srv.port(), "b", 1 << 18, true, &what) == xdfs::errc::ok);
    REQUIRE(settled(srv));
    const auto c = ask(srv.port(), "c", 1 << 18, false, &what);
    REQUIRE(settled(srv));
    const auto a_other = ask(srv.port(), "a", 1 << 17, false, &other);
    REQUIRE(settled(srv));
    const auto a_again = ask(srv.port(), "a", 1 << 18, false, &again);
    REQUIRE(settled(srv));
    if (std::chrono::steady_clock::now() - t0 > 2500ms) continue;
    judged = true;
    CHECK(c == xdfs::errc::limit_exceeded);
    CHECK_MESSAGE(what.find("2 pull chains " + scope) != std::string::npos, what);
    CHECK(a_other == xdfs::errc::limit_exceeded);
    CHECK(a_again == xdfs::errc::ok);
  }
  REQUIRE(judged);
  // Once their hosts' registrations have timed out, the chains end and make room.
  bool room = false;
  std::string what;
  for (int i = 0; i < 100 && !room; ++i) {
    std::this_thread::sleep_for(200ms);
    REQUIRE(settled(srv));
    room = ask(srv.port(), "c", 1 << 18, false, &what) == xdfs::errc::ok;
  }
  CHECK_MESSAGE(room, what);
}

}  // TEST_SUITE("badinput")
