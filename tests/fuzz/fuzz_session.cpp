// libFuzzer harness for a whole server session: the real xFTSM and path modes (the handler
// xdfsd runs: the framework session over the standard modes), given authenticated channels whose keys a handshake
// would have produced, then fed an arbitrary sequence of frames: sealed so that they pass the
// MACs (the fuzzer reaches the logic behind them), or corrupted on purpose, or not frames at all.
//
// Input: a config byte (mode, protection, two channels), a file size, a block-size byte, then
// records [channel][event][flags][length u16][offset u64][payload...]. Flags: 1 corrupt the tag,
// 2 write the payload raw (no framing), 4 build a well-formed path request from the payload,
// 8 build a well-formed next operation from the payload (a NEGO: mode, path, size, transfer
// number), after which blocks are sealed with that transfer's key: one input runs a session
// through several operations, switching modes, as a client that keeps its channels does.
//
// Oracles, after the client side has closed: the session reports its end exactly once (within a
// bound: it never freezes), no temporary file is left under the root, nothing appears beside the
// root, no mode with set-user-ID or set-group-ID bits is made, and the memory budget is whole again.
#include <dirent.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xdfs/budget.hpp"
#include "xdfs/rate.hpp"
#include "xdfs/files.hpp"
#include "xdfs/pathm/messages.hpp"
#include "xdfs/server.hpp"
#include "xdfs/relay_registry.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xdfs.hpp"
#include "xdfs/xsec.hpp"

namespace {

namespace xs = xdfs::xsec;
namespace w = xdfs::wire;
namespace pm = xdfs::pathm;
namespace fsys = std::filesystem;

struct Reader {
  const std::uint8_t* p;
  std::size_t n;
  std::uint8_t u8() { return n ? (--n, *p++) : 0; }
  std::uint64_t u(int bytes) {
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= std::uint64_t(u8()) << (8 * i);
    return v;
  }
  std::vector<std::uint8_t> take(std::size_t k) {
    k = std::min(k, n);
    std::vector<std::uint8_t> out(p, p + k);
    p += k;
    n -= k;
    return out;
  }
};

// Removes a tree whatever modes an input gave its directories (as a user, not only as root).
void wipe(const std::string& path) {
  std::error_code ec;
  if (!fsys::is_directory(fsys::symlink_status(path, ec))) {
    fsys::remove(path, ec);
    return;
  }
  ::chmod(path.c_str(), 0700);
  for (const auto& e : fsys::directory_iterator(path, ec)) wipe(e.path().string());
  fsys::remove(path, ec);
}

// The root: a small tree made afresh for every input (the session may change anything in it),
// removed when the run ends.
const std::string& base() {
  static const struct Dir {
    std::string path;
    Dir() {
      char tmpl[] = "/dev/shm/xdfs-fuzz-session-XXXXXX";
      const char* d = ::mkdtemp(tmpl);
      if (!d) std::abort();
      path = d;
    }
    ~Dir() { wipe(path); }
  } dir;
  return dir.path;
}

void make_root(const std::string& root) {
  wipe(root);
  fsys::create_directories(root + "/d/e");
  auto put = [](const std::string& p, std::size_t n) {
    int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    std::vector<char> b(n, 'x');
    if (n) [[maybe_unused]] auto r = ::write(fd, b.data(), n);
    ::close(fd);
  };
  put(root + "/f", 100);
  put(root + "/big", 40000);
  put(root + "/d/g", 5000);
  [[maybe_unused]] int r = ::symlink("/etc", (root + "/out").c_str());
}

const char* const names[] = {"", ".", "f", "big", "d", "d/g", "d/e", "new", "d/new", "out", "out/passwd",
                             "../x", "/etc/x", "d/../f", "a/b/c", "f/x", "new/deeper/file"};

std::string pick_name(Reader& r) {
  std::string s = names[r.u8() % (sizeof names / sizeof names[0])];
  if (r.u8() % 4 == 0) {
    auto extra = r.take(r.u8() % 8);
    s.append(extra.begin(), extra.end());
  }
  return s;
}

// A path request with fields from the input: reaches the operations behind the decoder.
std::vector<std::uint8_t> make_request(Reader r) {
  pm::Request q;
  q.id = r.u(2);
  q.op = static_cast<pm::Op>(r.u8() % 9);
  q.path = pick_name(r);
  q.to = pick_name(r);
  q.recursive = r.u8() & 1;
  q.offset = r.u(r.u8() % 9);
  q.length = r.u(r.u8() % 9);
  q.mode = static_cast<std::uint32_t>(r.u(2));
  std::vector<std::vector<std::uint8_t>> keep;
  const unsigned entries = r.u8() % 5;
  for (unsigned i = 0; i < entries; ++i) {
    pm::Entry e;
    e.path = pick_name(r);
    e.type = static_cast<pm::Type>(r.u8() % 4);
    e.size = r.u(r.u8() % 9);
    e.mode = static_cast<std::uint32_t>(r.u(2));
    e.mtime_ns = static_cast<std::int64_t>(r.u(8));
    e.target = pick_name(r);
    e.offset = r.u(r.u8() % 9);
    e.file_id = r.u8() % 3;
    keep.push_back(r.take(r.u(2) % 9000));
    e.data = keep.back();
    if (r.u8() % 8 == 0) e.code = static_cast<xdfs::errc>(r.u8() % 30);
    q.entries.push_back(std::move(e));
  }
  auto enc = pm::encode(q);
  auto b = enc.bytes();
  return {b.begin(), b.end()};
}

// A next operation's negotiation with fields from the input (the session's own parameters, or
// not, as the input says).
w::Negotiation make_operation(Reader r, std::uint32_t n, std::uint32_t block) {
  w::Negotiation g;
  g.mode = static_cast<xdfs::Mode>(r.u8() % 4);
  g.remote_path = pick_name(r);
  g.channel_count = r.u8() % 8 == 0 ? n + 1 : n;
  g.block_size = r.u8() % 8 == 0 ? block * 2 : block;
  g.file_size = r.u(r.u8() % 9);
  g.window = 4ull * block;
  g.transfer = r.u8() % 6;
  const std::uint8_t flags = r.u8();
  if (flags % 4 == 0) g.extended_flags = w::flag_memory;
  if (flags & 4) g.extended_flags |= w::flag_manifest;
  // A resumed download (the server hashes the prefix) or an upload asked to start over.
  if (flags & 8) g.resume_offset = std::min<std::uint64_t>(g.file_size, std::uint64_t(block) * (r.u8() % 4));
  if (flags & 16) g.source_mtime_ns = static_cast<std::int64_t>(r.u(8));
  g.fresh = (flags & 32) != 0;
  // A stream (what the decoder lets through is an upload without a size; the rest it refuses).
  g.open_ended = (flags & 64) != 0;
  if (g.open_ended && (flags & 128)) {
    g.mode = xdfs::Mode::upload;
    g.file_size = g.resume_offset = 0;
  }
  return g;
}

bool has_temp_files(const std::string& root) {
  std::error_code ec;
  for (auto it = fsys::recursive_directory_iterator(root, fsys::directory_options::none, ec);
       !ec && it != fsys::recursive_directory_iterator(); it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (name.find(".xdfs-") != std::string::npos && name.size() > 5 && name.substr(name.size() - 5) == ".part")
      return true;
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0 && (st.st_mode & (S_ISUID | S_ISGID)) && !S_ISDIR(st.st_mode)) return true;
  }
  return false;
}

// A hang shows every thread, not only the one libFuzzer's timeout prints (the one waiting): an
// input still running after 20 s (the timeout is 30; XDFS_FUZZ_HANG_MS changes it) has gdb print
// all stacks to stderr once, between the markers run.sh shows.
std::atomic<std::int64_t> input_started_ms{0};

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void watch_for_hangs() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // gdb, a child, may attach (Yama)
    const char* env = std::getenv("XDFS_FUZZ_HANG_MS");  // to try the watch itself
    const std::int64_t after = env ? std::atoll(env) : 20000;
    std::thread([after] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(std::min<std::int64_t>(after, 1000)));
        const auto started = input_started_ms.load();
        if (started == 0 || now_ms() - started < after) continue;
        std::fprintf(stderr, "== all threads of an input running for 20 s ==\n");
        const std::string cmd = "gdb -batch -nx -p " + std::to_string(::getpid()) +
                                " -ex 'thread apply all bt 30' 1>&2 2>/dev/null </dev/null";
        [[maybe_unused]] int r = std::system(cmd.c_str());
        std::fprintf(stderr, "== end of threads ==\n");
        return;
      }
    }).detach();
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 10) return 0;
  watch_for_hangs();
  input_started_ms = now_ms();
  struct Done {
    ~Done() { input_started_ms = 0; }
  } done;
  Reader in{data, size};
  const std::uint8_t cfg = in.u8();
  const std::uint64_t raw_size = in.u(8);
  const std::uint64_t file_size = raw_size % (std::uint64_t(1) << (in.u8() % 63 + 1));
  const std::uint32_t block = 4096u << (in.u8() % 4);
  const int kind = cfg & 3;  // upload, download, path, upload to memory
  const auto protect = static_cast<xs::Protect>((cfg >> 2) % 3);
  const std::uint32_t n = (cfg & 0x20) ? 2 : 1;

  const std::string root = base() + "/root";
  make_root(root);
  xdfs::files::Fd root_fd(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));

  xdfs::MemoryBudget budget(64u << 20);
  xdfs::RateLimiter total_rate;  // unlimited: the fuzzer's sessions must not wait on a clock
  int reports = 0;
  std::vector<int> mine;
  {
  boost::asio::io_context io{1};
  xdfs::ServerConfig config;
  config.root = root;
  config.ring_bytes = 8 * block;
  config.path_workers = 1;
  config.allow_memory_mode = true;
  config.idle_timeout = std::chrono::milliseconds(60000);
  config.join_timeout = std::chrono::milliseconds(60000);
  xdfs::runtime::RelayRegistry relays(xs::KeyPair::generate());
  xdfs::runtime::SessionEnv env{io, config, root_fd.get(), xdfs::SessionId::random(), "fuzz", "sfuzz0000-00000000",
                                w::Opening{}, w::Negotiation{}, xdfs::runtime::Client{}, xs::Key32{}, budget, total_rate,
                                &relays,
                                [&](xdfs::SessionReport) { ++reports; }, [](const std::string&) {}};
  env.opening.protect = static_cast<std::uint8_t>(protect);
  env.nego.channel_count = n;
  env.nego.mode = kind == 1 ? xdfs::Mode::download : kind == 2 ? xdfs::Mode::path : xdfs::Mode::upload;
  env.nego.remote_path = kind == 1 ? "big" : kind == 2 ? "." : "up";
  env.nego.block_size = block;
  env.nego.file_size = file_size;
  env.nego.window = 4ull * block;
  if (kind == 3) env.nego.extended_flags = w::flag_memory;
  if (cfg & 0x40) env.nego.extended_flags |= w::flag_manifest;  // resumable uploads, digests
  // An upload of a stream: its size comes with its last block or its EOFRs.
  if ((cfg & 0x80) && env.nego.mode == xdfs::Mode::upload) {
    env.nego.open_ended = true;
    env.nego.file_size = 0;
  }
  env.session_secret[0] = 7;

  // The client's ends of the channels, keyed as a handshake would have keyed them.
  std::vector<std::unique_ptr<xs::FrameProtector>> seal;
  const auto block_protect = protect == xs::Protect::clear ? xs::Protect::integrity : protect;
  auto blocks = std::make_unique<xs::BlockCrypto>(block_protect, xs::Cipher::aes256gcm,
                                                  xs::data_key(env.session_secret, true, 0));
  {
    auto handler = xdfs::runtime::session_factory(xdfs::standard_modes())(env);
    for (std::uint32_t i = 0; i < n; ++i) {
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) != 0) std::abort();
      xs::Key32 c2s{}, s2c{};
      c2s[0] = static_cast<std::uint8_t>(1 + i);
      s2c[0] = static_cast<std::uint8_t>(100 + i);
      boost::asio::ip::tcp::socket s(io);
      s.assign(boost::asio::ip::tcp::v4(), sv[1]);
      auto ch = std::make_unique<xdfs::xdsi::Channel>(std::move(s), i);
      ch->protect(std::make_unique<xs::FrameProtector>(protect, xs::Cipher::aes256gcm, s2c, c2s));
      handler->add_channel(std::move(ch));
      mine.push_back(sv[0]);
      seal.push_back(std::make_unique<xs::FrameProtector>(protect, xs::Cipher::aes256gcm, c2s, s2c));
    }
    // Runs the session's loop until nothing has happened for a while (its disk thread and
    // workers post back to it), draining what it sends so that it never blocks on us.
    auto settle = [&](int quiet_rounds) {
      int quiet = 0;
      for (int round = 0; round < 20000 && quiet < quiet_rounds && reports == 0; ++round) {
        io.restart();
        bool busy = io.poll() > 0;
        char sink[65536];
        for (int fd : mine)
          while (::recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0) busy = true;
        quiet = busy ? 0 : quiet + 1;
        if (!busy) std::this_thread::yield();
      }
    };
    auto write_all = [&](int fd, const std::vector<std::uint8_t>& b) {
      std::size_t done = 0;
      for (int spins = 0; done < b.size() && spins < 100000; ++spins) {
        const ssize_t k = ::send(fd, b.data() + done, b.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
          done += static_cast<std::size_t>(k);
          continue;
        }
        if (k < 0 && errno != EAGAIN) return;  // the session closed it
        settle(2);  // let the session read
        if (reports) return;
      }
    };
    settle(3);
    while (in.n >= 4 && reports == 0) {
      const std::uint32_t c = in.u8() % n;
      const auto ev_raw = in.u8();
      const std::uint8_t flags = in.u8();
      const std::uint16_t len = static_cast<std::uint16_t>(in.u(2));
      const std::uint64_t off = in.u(8);
      std::vector<std::uint8_t> payload = in.take(len);
      if (flags & 2) {  // not a frame at all
        write_all(mine[c], payload);
        continue;
      }
      w::FrameHeader h;
      h.event = static_cast<w::ChannelEvent>(w::is_known(ev_raw) ? ev_raw : (ev_raw % 13) + 1);
      h.offset = off;
      if (flags & 4) payload = make_request(Reader{payload.data(), payload.size()});
      if (flags & 8) {
        const auto g = make_operation(Reader{payload.data(), payload.size()}, n, block);
        h.event = w::ChannelEvent::nego;
        payload = w::encode(g);
        blocks = std::make_unique<xs::BlockCrypto>(block_protect, xs::Cipher::aes256gcm,
                                                   xs::data_key(env.session_secret, true, g.transfer));
      }
      if ((h.event == w::ChannelEvent::xftsmu || h.event == w::ChannelEvent::xftsmd) && protect != xs::Protect::clear) {
        const auto body = payload.size();
        payload.resize(body + blocks->tag_size().value());
        blocks->seal(payload.data(), xdfs::DataLength(static_cast<std::uint32_t>(body)), xdfs::FileOffset(off));
      }
      h.length = static_cast<std::uint32_t>(payload.size());
      auto hb = w::encode(h);
      std::uint8_t tag[16];
      const std::size_t tag_len = seal[c]->tag_bytes(h.event);
      seal[c]->seal(hb, payload, tag);
      if (flags & 1) tag[0] ^= 1;
      std::vector<std::uint8_t> frame(hb.begin(), hb.end());
      frame.insert(frame.end(), payload.begin(), payload.end());
      frame.insert(frame.end(), tag, tag + tag_len);
      write_all(mine[c], frame);
      settle(2);
    }
    settle(20);
    // The client goes: whatever state the session is in, it must end, say so once, and clean up.
    for (int fd : mine) ::shutdown(fd, SHUT_RDWR);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (reports == 0 && std::chrono::steady_clock::now() < until) {
      io.run_for(std::chrono::milliseconds(5));
      io.restart();
    }
    if (reports == 0) __builtin_trap();  // frozen: the session outlived its client
    handler.reset();                     // joins its disk thread and workers
  }
  }  // the loop goes last, with what was still queued on it (as a server's session does)
  for (int fd : mine) ::close(fd);
  if (reports != 1) __builtin_trap();
  if (budget.used() != 0) __builtin_trap();  // a reservation outlived the session
  if (has_temp_files(root)) __builtin_trap();
  // Nothing beside the root: every path stayed beneath it.
  std::size_t beside = 0;
  for ([[maybe_unused]] auto& e : fsys::directory_iterator(base())) ++beside;
  if (beside != 1) __builtin_trap();
  return 0;
}
