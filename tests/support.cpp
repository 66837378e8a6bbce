#include "support.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <doctest/doctest.h>

#include "xdfs/xdfs.hpp"

extern char** environ;

namespace xt {

TempDir::TempDir() {
  char tmpl[] = "/tmp/xdfs-test-XXXXXX";
  if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

namespace {
struct SplitMix {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};
}  // namespace

std::vector<std::uint8_t> random_bytes(std::size_t size, std::uint64_t seed) {
  std::vector<std::uint8_t> v(size);
  SplitMix r{seed};
  std::size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    auto x = r.next();
    std::memcpy(&v[i], &x, 8);
  }
  auto x = r.next();
  for (; i < size; ++i, x >>= 8) v[i] = static_cast<std::uint8_t>(x);
  return v;
}

void write_random_file(const std::string& path, std::uint64_t size, std::uint64_t seed) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const std::size_t chunk = 1 << 20;
  std::uint64_t left = size;
  std::uint64_t k = 0;
  while (left > 0) {
    auto n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, left));
    auto v = random_bytes(n, seed * 1000003 + k++);
    f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(n));
    left -= n;
  }
  if (!f) throw std::runtime_error("cannot write " + path);
}

void write_file(const std::string& path, const std::string& content) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << content;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool files_equal(const std::string& a, const std::string& b) {
  std::ifstream fa(a, std::ios::binary), fb(b, std::ios::binary);
  if (!fa || !fb) return false;
  std::vector<char> ba(1 << 20), bb(1 << 20);
  while (true) {
    fa.read(ba.data(), static_cast<std::streamsize>(ba.size()));
    fb.read(bb.data(), static_cast<std::streamsize>(bb.size()));
    if (fa.gcount() != fb.gcount()) return false;
    if (std::memcmp(ba.data(), bb.data(), static_cast<std::size_t>(fa.gcount())) != 0) return false;
    if (!fa || !fb) return !fa && !fb;
  }
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

InProcessServer::InProcessServer(xdfs::ServerConfig cfg) {
  cfg.listen = "127.0.0.1:0";
  cfg.log = [this](const std::string& line) {
    std::lock_guard<std::mutex> g(mu_);
    log_.push_back(line);
    grew_.notify_all();
  };
  server_ = std::make_unique<xdfs::Server>(cfg, xdfs::runtime::session_factory(xdfs::standard_modes()));
  port_ = server_->port();
  thread_ = std::thread([this] { server_->run(); });
}

InProcessServer::~InProcessServer() {
  server_->stop();
  thread_.join();
}

bool InProcessServer::wait_for_log(const std::string& text, int timeout_ms) {
  return wait_for_log_lines(text, 1, timeout_ms) >= 1;
}

std::size_t InProcessServer::wait_for_log_lines(const std::string& text, std::size_t want, int timeout_ms) {
  std::unique_lock<std::mutex> g(mu_);
  auto count = [&] {
    return static_cast<std::size_t>(
        std::count_if(log_.begin(), log_.end(), [&](const std::string& l) { return l.find(text) != std::string::npos; }));
  };
  grew_.wait_for(g, std::chrono::milliseconds(timeout_ms), [&] { return count() >= want; });
  return count();
}

std::vector<std::string> InProcessServer::log_lines() {
  std::lock_guard<std::mutex> g(mu_);
  return log_;
}

XdfsdProcess::XdfsdProcess(const std::string& root, std::vector<std::string> extra, std::vector<std::string> wrapper) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  std::vector<std::string> args = wrapper;
  args.insert(args.end(), {XDFSD_PATH, "--root", root});
  // 127.0.0.1:0 unless the test gives its own --listen (xdfsd takes one).
  if (std::find(extra.begin(), extra.end(), "--listen") == extra.end()) args.insert(args.end(), {"--listen", "127.0.0.1:0"});
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  if (posix_spawnp(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0)
    throw std::runtime_error("cannot start xdfsd");
  posix_spawn_file_actions_destroy(&fa);
  ::close(pipefd[1]);
  err_fd_ = pipefd[0];
  reader_ = std::thread([this] {
    char buf[4096];
    while (true) {
      ssize_t n = ::read(err_fd_, buf, sizeof buf);
      if (n <= 0) break;
      std::lock_guard<std::mutex> g(mu_);
      log_.append(buf, static_cast<std::size_t>(n));
      grew_.notify_all();
    }
  });
  if (!wait_for_log("listening on ")) throw std::runtime_error("xdfsd did not start: " + log());
  auto text = log();
  // listening on HOST:PORT (an IPv6 host in brackets)
  const auto at = text.find("listening on ") + 13;
  const auto address = text.substr(at, text.find_first_of(" \n", at) - at);
  port_ = static_cast<std::uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
}

XdfsdProcess::~XdfsdProcess() {
  if (exit_status_ < 0) stop(SIGKILL);
  if (reader_.joinable()) reader_.join();
  if (err_fd_ >= 0) ::close(err_fd_);
}

bool XdfsdProcess::alive() {
  if (exit_status_ >= 0) return false;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return false;
  }
  return true;
}

namespace {
// Waits for pid within timeout_ms; kills it then. The exit status, 128+signal, or -2 if killed.
int wait_bounded(pid_t pid, int timeout_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  int status = 0;
  while (true) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (r < 0) return -1;
    if (std::chrono::steady_clock::now() >= until) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -2;
    }
    // Polling the child's exit: no event to wait on without a signal handler in the test.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}
}  // namespace

int XdfsdProcess::stop(int sig, int timeout_ms) {
  if (exit_status_ >= 0) return exit_status_;
  ::kill(pid_, sig);
  exit_status_ = wait_bounded(pid_, sig == SIGKILL ? 30000 : timeout_ms);
  if (exit_status_ == -2) exit_status_ = 128 + SIGKILL, killed_ = true;
  if (reader_.joinable()) reader_.join();
  return killed_ ? -2 : exit_status_;
}

std::string XdfsdProcess::log() {
  std::lock_guard<std::mutex> g(mu_);
  return log_;
}

bool XdfsdProcess::wait_for_log(const std::string& text, int timeout_ms) {
  // The reader thread signals every time xdfsd writes.
  std::unique_lock<std::mutex> g(mu_);
  return grew_.wait_for(g, std::chrono::milliseconds(timeout_ms),
                        [&] { return log_.find(text) != std::string::npos; });
}

RunResult run(const std::string& program, const std::vector<std::string>& args, int timeout_ms,
              std::atomic<pid_t>* pid_out) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  std::vector<std::string> all{program};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, err[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  pid_t pid = -1;
  if (posix_spawn(&pid, program.c_str(), &fa, nullptr, argv.data(), environ) != 0)
    throw std::runtime_error("cannot run " + program);
  posix_spawn_file_actions_destroy(&fa);
  if (pid_out) pid_out->store(pid);
  ::close(out[1]);
  ::close(err[1]);
  RunResult r;
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  int open = 2;
  char buf[65536];
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool killed = false;
  while (open > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0 && !killed) {
      ::kill(pid, SIGKILL);  // over its time: its pipes close as it dies
      killed = true;
    }
    ::poll(fds, 2, killed ? 1000 : static_cast<int>(std::max<long>(1, left.count())));
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
      } else {
        (i == 0 ? r.out : r.err).append(buf, static_cast<std::size_t>(n));
      }
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (pid_out) pid_out->store(-1);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

RunResult xduc(const std::vector<std::string>& args, int timeout_ms, std::atomic<pid_t>* pid) {
  return run(XDUC_PATH, args, timeout_ms, pid);
}

RawChannel::RawChannel(std::uint16_t port, const std::string& source_ip)
    : RawPeer(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
  if (!source_ip.empty()) {
    sockaddr_in from{};
    from.sin_family = AF_INET;
    ::inet_pton(AF_INET, source_ip.c_str(), &from.sin_addr);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0) throw std::runtime_error("bind " + source_ip);
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("connect failed");
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

RawPeer::~RawPeer() {
  if (fd_ >= 0) ::close(fd_);
}

void RawPeer::send_bytes(const void* data, std::size_t n) {
  auto p = static_cast<const char*>(data);
  sent_.insert(sent_.end(), reinterpret_cast<const std::uint8_t*>(p), reinterpret_cast<const std::uint8_t*>(p) + n);
  if (trickle) {
    for (std::size_t i = 0; i < n; ++i)
      if (::send(fd_, p + i, 1, MSG_NOSIGNAL) != 1) return;
    return;
  }
  auto send_all = [this](const char* q, std::size_t m) {
    while (m > 0) {
      ssize_t w = ::send(fd_, q, m, MSG_NOSIGNAL);
      if (w <= 0) return;  // the server may already have closed on us; the test reads the reason
      q += w;
      m -= static_cast<std::size_t>(w);
    }
  };
  if (urgent_before && *urgent_before < n) {
    const std::size_t at = *urgent_before;
    urgent_before.reset();
    send_all(p, at);
    (void)::send(fd_, "!", 1, MSG_OOB | MSG_NOSIGNAL);
    p += at;
    n -= at;
  }
  if (pause_after && *pause_after < n) {
    const std::size_t at = *pause_after;
    pause_after.reset();
    send_all(p, at);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    p += at;
    n -= at;
  }
  send_all(p, n);
}

void RawChannel::send_preamble(std::uint16_t version) {
  auto p = xdfs::wire::encode_preamble(version);
  send_bytes(p.data(), p.size());
}

void RawPeer::send_frame(const xdfs::wire::FrameHeader& h, const std::vector<std::uint8_t>& payload, bool corrupt_tag) {
  auto hb = xdfs::wire::encode(h);
  std::vector<std::uint8_t> body = payload;
  std::uint8_t tag[16];
  std::size_t tag_len = 0;
  if (guard_) {
    tag_len = guard_->tag_bytes(h.event);
    guard_->seal(hb, body, tag);
    if (corrupt_tag && tag_len) tag[5] ^= 0x20;
  }
  // One send per frame, as a real client's gathered write: a frame split over several small
  // sends would wait for acknowledgements and arrive later than its neighbours.
  std::vector<std::uint8_t> frame(hb.begin(), hb.end());
  frame.insert(frame.end(), body.begin(), body.end());
  frame.insert(frame.end(), tag, tag + tag_len);
  send_bytes(frame);
}

void RawPeer::send_block(xdfs::wire::ChannelEvent event, std::uint64_t offset, const std::vector<std::uint8_t>& data,
                         bool corrupt_tag) {
  std::vector<std::uint8_t> body = data;
  if (manifest) {
    const auto d = xdfs::manifest::BlockHasher().digest(data.data(), data.size());
    body.insert(body.end(), d.begin(), d.end());
  }
  if (blocks_) {
    const auto covered = body.size();
    body.resize(covered + blocks_->tag_size().value());
    blocks_->seal(body.data(), xdfs::DataLength(static_cast<std::uint32_t>(covered)), xdfs::FileOffset(offset));
  }
  xdfs::wire::FrameHeader h;
  h.event = event;
  h.offset = offset;
  h.length = static_cast<std::uint32_t>(body.size());
  send_frame(h, body, corrupt_tag);
}

void RawChannel::send_opening(const xdfs::wire::Opening& o) {
  auto payload = xdfs::wire::encode(o);
  xdfs::wire::FrameHeader h;
  h.event = xdfs::wire::ChannelEvent::nego;
  h.length = static_cast<std::uint32_t>(payload.size());
  auto pre = xdfs::wire::encode_preamble();
  auto hb = xdfs::wire::encode(h);
  opening_.assign(pre.begin(), pre.end());
  opening_.insert(opening_.end(), hb.begin(), hb.end());
  opening_.insert(opening_.end(), payload.begin(), payload.end());
  send_bytes(opening_);
}

void RawPeer::protect_with(const xdfs::wire::Opening& o, const xdfs::xsec::Key32& send, const xdfs::xsec::Key32& recv,
                           const xdfs::xsec::Key32& secret, bool blocks_client_to_server) {
  const auto mode = static_cast<xdfs::xsec::Protect>(o.protect);
  const auto cipher = static_cast<xdfs::xsec::Cipher>(o.cipher);
  guard_ = std::make_unique<xdfs::xsec::FrameProtector>(mode, cipher, send, recv);
  if (mode != xdfs::xsec::Protect::clear)
    blocks_ = std::make_unique<xdfs::xsec::BlockCrypto>(mode, cipher,
                                                        xdfs::xsec::data_key(secret, blocks_client_to_server, 0));
}

bool RawChannel::establish(const Hello& hello, const xdfs::xsec::KeyPair* id, int confirm_ms) {
  const auto self = id ? *id : test_identity();
  send_opening(hello.opening);
  xdfs::xsec::NoiseXX noise(true, self, opening_);
  xdfs::wire::FrameHeader h;
  h.event = xdfs::wire::ChannelEvent::handshake;
  auto m1 = noise.write_message_1();
  h.length = static_cast<std::uint32_t>(m1.size());
  send_frame(h, m1);
  auto m2 = read_frame();
  if (!m2 || m2->first.event != xdfs::wire::ChannelEvent::handshake || !noise.read_message_2(m2->second)) return false;
  server_key_ = noise.remote_static();
  auto m3 = noise.write_message_3(xdfs::wire::encode(hello.nego));
  manifest = (hello.nego.extended_flags & xdfs::wire::flag_manifest) != 0;
  h.length = static_cast<std::uint32_t>(m3.size());
  send_frame(h, m3);
  auto keys = noise.split();
  secret_ = keys.session_secret;
  protect_with(hello.opening, keys.send, keys.recv, secret_, true);
  // The server's confirmation; a refusal is kept for whoever reads next.
  auto confirm = read_frame(confirm_ms);
  if (confirm && confirm->first.event != xdfs::wire::ChannelEvent::handshake) held_ = std::move(confirm);
  return true;
}

bool RawChannel::join(const Hello& hello, std::uint32_t index, const xdfs::xsec::Key32& secret) {
  auto o = hello.opening;
  o.channel_index = index;
  o.join = true;
  o.join_nonce = random_bytes(32, index * 7919 + 17);
  send_opening(o);
  auto answer = read_frame();
  if (!answer || answer->first.event != xdfs::wire::ChannelEvent::handshake || answer->second.size() != 64) return false;
  std::span<const std::uint8_t> sn(answer->second.data(), 32);
  auto keys = xdfs::xsec::derive_join_keys(secret, o.join_nonce, sn, opening_);
  if (!xdfs::xsec::equal_constant_time(xdfs::xsec::join_proof(keys, "server", o.join_nonce, sn),
                                       std::span<const std::uint8_t>(answer->second.data() + 32, 32)))
    return false;
  auto proof = xdfs::xsec::join_proof(keys, "client", o.join_nonce, sn);
  xdfs::wire::FrameHeader h;
  h.event = xdfs::wire::ChannelEvent::handshake;
  h.length = 32;
  send_frame(h, std::vector<std::uint8_t>(proof.begin(), proof.end()));
  secret_ = secret;
  protect_with(hello.opening, keys.client_to_server, keys.server_to_client, secret, true);
  return true;
}

void check_serving(std::uint16_t port, const std::string& root, const std::string& local) {
  write_random_file(local + "/probe", 300000, 99);
  const std::string url = "xdfs://127.0.0.1:" + std::to_string(port) + "/probe";
  auto up = xduc({"-q", "-p", "3", local + "/probe", url}, 60000);
  CHECK_MESSAGE(up.status == 0, up.err);
  CHECK(files_equal(local + "/probe", root + "/probe"));
  ::unlink((local + "/probe.back").c_str());
  auto down = xduc({"-q", "-p", "2", url, local + "/probe.back"}, 60000);
  CHECK_MESSAGE(down.status == 0, down.err);
  CHECK(files_equal(local + "/probe", local + "/probe.back"));
}

namespace {
std::uint64_t status_kib(pid_t pid, const char* field) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  const std::size_t len = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, len, field) == 0) return std::stoull(line.substr(len));
  return 0;
}
}  // namespace

bool wait_stopped(pid_t pid, int timeout_ms) {
  // Every thread's state in /proc/PID/task/TID/stat is 'T' once the group stop is complete.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  while (std::chrono::steady_clock::now() < until) {
    bool all = true, any = false;
    std::error_code ec;
    for (const auto& t : std::filesystem::directory_iterator(tasks, ec)) {
      std::ifstream in(t.path() / "stat");
      std::string line;
      std::getline(in, line);
      const auto paren = line.rfind(')');
      if (paren == std::string::npos || paren + 2 >= line.size()) continue;
      any = true;
      if (line[paren + 2] != 'T' && line[paren + 2] != 't') all = false;
    }
    if (any && all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

std::uint64_t rss_kib(pid_t pid) { return status_kib(pid, "VmRSS:"); }
std::uint64_t peak_rss_kib(pid_t pid) { return status_kib(pid, "VmHWM:"); }

double cpu_seconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto close = all.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return 0;
  std::istringstream in(all.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; in >> field; ++i)
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

void check_no_partials(const std::string& dir) {
  for (auto& name : list_dir(dir)) {
    INFO("left behind: " << name);
    CHECK(name.find(".part") == std::string::npos);
  }
}

xdfs::errc error_of(const std::function<void()>& fn, bool* remote, std::string* what) {
  try {
    fn();
  } catch (const xdfs::TransferError& e) {
    if (remote) *remote = e.remote();
    if (what) *what = e.what();
    return e.code();
  }
  return xdfs::errc::ok;
}

xdfs::xsec::KeyPair test_identity() {
  return xdfs::xsec::load_key(xdfs::xsec::default_config_dir() + "/id_x25519");
}

void RawPeer::shutdown_write() { ::shutdown(fd_, SHUT_WR); }

bool RawPeer::read_exact(void* dst, std::size_t n, int timeout_ms) {
  auto p = static_cast<char*>(dst);
  while (n > 0) {
    pollfd pfd{fd_, POLLIN, 0};
    if (::poll(&pfd, 1, timeout_ms) <= 0) return false;
    ssize_t r = ::recv(fd_, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

std::optional<Frame> RawPeer::read_frame(int timeout_ms) {
  if (held_) return std::exchange(held_, std::nullopt);
  xdfs::wire::HeaderBytes hb{};
  if (!read_exact(hb.data(), hb.size(), timeout_ms)) return std::nullopt;
  auto h = xdfs::wire::decode(std::span<const std::uint8_t, xdfs::wire::frame_header_size>(hb));
  if (!h) return std::nullopt;
  std::vector<std::uint8_t> payload(h->length);
  if (!payload.empty() && !read_exact(payload.data(), payload.size(), timeout_ms)) return std::nullopt;
  if (guard_) {
    std::uint8_t tag[16];
    const auto n = guard_->tag_bytes(h->event);
    if (n && !read_exact(tag, n, timeout_ms)) return std::nullopt;
    if (!guard_->open(hb, payload, tag)) return std::nullopt;
  }
  return std::make_pair(*h, std::move(payload));
}

std::optional<xdfs::wire::ExceptionHeader> RawPeer::read_exception(int timeout_ms) {
  while (auto f = read_frame(timeout_ms)) {
    if (f->first.event == xdfs::wire::ChannelEvent::exception) return xdfs::wire::decode_exception(f->second);
  }
  return std::nullopt;
}

bool RawPeer::wait_closed(int timeout_ms) {
  char buf[65536];
  while (true) {
    pollfd pfd{fd_, POLLIN, 0};
    if (::poll(&pfd, 1, timeout_ms) <= 0) return false;
    ssize_t r = ::recv(fd_, buf, sizeof buf, 0);
    if (r <= 0) return true;
  }
}

RawServer::RawServer() : key_(xdfs::xsec::KeyPair::generate()) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listen_fd_, 16) != 0)
    throw std::runtime_error("RawServer: cannot listen");
  socklen_t len = sizeof a;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
  port_ = ntohs(a.sin_port);
}

RawServer::~RawServer() { ::close(listen_fd_); }

void RawServer::Conn::key(const xdfs::xsec::Key32& send, const xdfs::xsec::Key32& recv) {
  // A server seals the blocks of a download: the server-to-client block key.
  protect_with(hello.opening, send, recv, secret, false);
}

void RawServer::Conn::send_reply(const xdfs::wire::NegotiationReply& r) {
  auto payload = xdfs::wire::encode(r);
  xdfs::wire::FrameHeader h;
  h.event = xdfs::wire::ChannelEvent::nego_reply;
  h.length = static_cast<std::uint32_t>(payload.size());
  send_frame(h, payload);
}

std::unique_ptr<RawServer::Conn> RawServer::accept(int timeout_ms) {
  pollfd pfd{listen_fd_, POLLIN, 0};
  if (::poll(&pfd, 1, timeout_ms) <= 0) return nullptr;
  const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return nullptr;
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  auto c = std::make_unique<Conn>(fd, Hello{});
  // The opening: preamble, NEGO frame header, payload.
  std::vector<std::uint8_t> opening(xdfs::wire::preamble_size + xdfs::wire::frame_header_size);
  auto read = [&](void* dst, std::size_t n) { return c->read_exact(dst, n, timeout_ms); };
  if (!read(opening.data(), opening.size())) return nullptr;
  auto h = xdfs::wire::decode(std::span<const std::uint8_t, 24>(opening.data() + 8, 24));
  if (!h || h->event != xdfs::wire::ChannelEvent::nego || h->length > xdfs::wire::max_opening_payload) return nullptr;
  opening.resize(32 + h->length);
  if (!read(opening.data() + 32, h->length)) return nullptr;
  auto o = xdfs::wire::decode_opening(std::span<const std::uint8_t>(opening.data() + 32, h->length));
  if (!o || o->join) return nullptr;
  c->hello.opening = *o;
  xdfs::xsec::NoiseXX noise(false, key_, opening);
  auto m1 = c->read_frame(timeout_ms);
  if (!m1 || !noise.read_message_1(m1->second)) return nullptr;
  auto m2 = noise.write_message_2();
  xdfs::wire::FrameHeader hh;
  hh.event = xdfs::wire::ChannelEvent::handshake;
  hh.length = static_cast<std::uint32_t>(m2.size());
  c->send_frame(hh, m2);
  auto m3 = c->read_frame(timeout_ms);
  std::vector<std::uint8_t> payload;
  if (!m3 || !noise.read_message_3(m3->second, &payload)) return nullptr;
  auto nego = xdfs::wire::decode_negotiation(payload);
  if (!nego) return nullptr;
  c->hello.nego = *nego;
  c->manifest = (nego->extended_flags & xdfs::wire::flag_manifest) != 0;
  auto keys = noise.split();
  c->secret = keys.session_secret;
  c->key(keys.send, keys.recv);
  hh.length = 0;
  c->send_frame(hh);  // the confirmation: the session exists
  return c;
}

xdfs::wire::FrameHeader upload_block(std::uint64_t offset, std::uint32_t length) {
  xdfs::wire::FrameHeader h;
  h.event = xdfs::wire::ChannelEvent::xftsmu;
  h.offset = offset;
  h.length = length;
  return h;
}

xdfs::wire::FrameHeader eofr_header(std::uint64_t offset) {
  xdfs::wire::FrameHeader h;
  h.event = xdfs::wire::ChannelEvent::eofr;
  h.offset = offset;
  return h;
}

Hello make_hello(xdfs::Mode mode, const std::string& path, std::uint32_t n, std::uint64_t file_size) {
  Hello g;
  g.opening.session = xdfs::SessionId::random();
  g.opening.channel_index = 0;
  // Raw tests speak the protocol by hand: clear mode keeps data frames as plain blocks (control
  // frames are still authenticated).
  g.opening.protect = 0;
  g.nego.channel_count = n;
  g.nego.mode = mode;
  g.nego.remote_path = path;
  g.nego.block_size = 64 * 1024;
  g.nego.file_size = file_size;
  g.nego.window = 16 * 64 * 1024;
  return g;
}

}  // namespace xt

namespace xt {
namespace {

bool read_all(int fd, void* dst, std::size_t n) {
  auto p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

bool write_all(int fd, const void* src, std::size_t n) {
  auto p = static_cast<const char*>(src);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

int connect_loopback(std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

Relay::Relay(std::uint16_t target, xdfs::xsec::Protect mode) : target_(target), mode_(mode) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::listen(listen_fd_, 64);
  socklen_t len = sizeof a;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
  port_ = ntohs(a.sin_port);
  acceptor_ = std::thread([this] {
    while (!stop_) {
      int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      std::lock_guard<std::mutex> g(mu_);
      fds_.push_back(c);
      const std::size_t conn = workers_.size();
      workers_.emplace_back([this, c, conn] { serve(c, conn); });
    }
  });
}

Relay::~Relay() {
  stop_ = true;
  ::shutdown(listen_fd_, SHUT_RDWR);
  ::close(listen_fd_);
  acceptor_.join();
  {
    std::lock_guard<std::mutex> g(mu_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
  }
  for (auto& t : workers_) t.join();
  for (int fd : fds_) ::close(fd);
}

std::vector<std::uint8_t> Relay::bytes(Dir d) {
  std::lock_guard<std::mutex> g(mu_);
  return d == Dir::up ? up_ : down_;
}

void Relay::record(Dir d, const std::uint8_t* p, std::size_t n) {
  std::lock_guard<std::mutex> g(mu_);
  auto& v = d == Dir::up ? up_ : down_;
  v.insert(v.end(), p, p + n);
}

// Frames one way. Handshake frames travel in the clear until the side's last one: the client's
// message 3 (or a join's proof), the server's message 2 (or a join's answer); after it every
// frame carries a tag (except data frames in clear mode).
void Relay::pump(Dir dir, std::size_t conn, int from, int to, bool join) {
  std::size_t data_index = 0;
  std::size_t clear_handshakes = dir == Dir::down ? 1 : (join ? 1 : 2);
  std::vector<std::uint8_t> held;
  while (true) {
    xdfs::wire::HeaderBytes hb{};
    if (!read_all(from, hb.data(), hb.size())) break;
    auto h = xdfs::wire::decode(std::span<const std::uint8_t, 24>(hb));
    if (!h) break;
    const bool data = h->event == xdfs::wire::ChannelEvent::xftsmu || h->event == xdfs::wire::ChannelEvent::xftsmd;
    const bool keyed = clear_handshakes == 0;
    std::size_t tag = 0;
    if (keyed) tag = (mode_ == xdfs::xsec::Protect::clear && data) ? 0 : 16;
    const bool clear_handshake = !keyed && h->event == xdfs::wire::ChannelEvent::handshake;
    if (clear_handshake) --clear_handshakes;
    std::vector<std::uint8_t> frame(hb.begin(), hb.end());
    frame.resize(24 + h->length + tag);
    if (!read_all(from, frame.data() + 24, h->length + tag)) break;
    if (clear_handshake && dir == Dir::up && rewrite_client_handshake)
      rewrite_client_handshake((join ? 1 : 2) - clear_handshakes - 1, frame);
    record(dir, frame.data(), frame.size());
    Verdict v = Verdict::pass;
    if (hook && keyed) v = hook(Seen{dir, conn, *h, data ? data_index : SIZE_MAX});
    if (data) ++data_index;
    if (v == Verdict::cut) break;
    if (v == Verdict::drop) continue;
    if (v == Verdict::flip_payload_bit && h->length > 0) frame[24 + h->length / 2] ^= 0x10;
    if (v == Verdict::flip_header_bit) frame[8] ^= 0x01;  // lowest bit of the offset field
    if (v == Verdict::swap_with_next) {
      held = std::move(frame);
      continue;
    }
    if (!write_all(to, frame.data(), frame.size())) break;
    if (v == Verdict::duplicate) write_all(to, frame.data(), frame.size());
    if (!held.empty()) {
      write_all(to, held.data(), held.size());
      held.clear();
    }
  }
  ::shutdown(to, SHUT_WR);
  ::shutdown(from, SHUT_RD);
}

void Relay::serve(int client, std::size_t conn) {
  int server = connect_loopback(target_);
  if (server < 0) return;
  {
    std::lock_guard<std::mutex> g(mu_);
    fds_.push_back(server);
  }
  // The opening (preamble + NEGO frame) may be rewritten; it says whether this channel joins.
  std::vector<std::uint8_t> opening(8 + 24);
  bool join = false;
  if (read_all(client, opening.data(), opening.size())) {
    auto h = xdfs::wire::decode(std::span<const std::uint8_t, 24>(opening.data() + 8, 24));
    if (h && h->length <= xdfs::wire::max_opening_payload) {
      opening.resize(32 + h->length);
      if (read_all(client, opening.data() + 32, h->length)) {
        if (auto o = xdfs::wire::decode_opening(std::span<const std::uint8_t>(opening.data() + 32, h->length)))
          join = o->join;
        if (rewrite_opening) rewrite_opening(opening);
        record(Dir::up, opening.data(), opening.size());
        write_all(server, opening.data(), opening.size());
        std::thread up([this, conn, client, server, join] { pump(Dir::up, conn, client, server, join); });
        pump(Dir::down, conn, server, client, join);
        up.join();
      }
    }
  }
  ::shutdown(client, SHUT_RDWR);
  ::shutdown(server, SHUT_RDWR);
}

}  // namespace xt
