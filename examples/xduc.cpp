// xduc: copy a file or a directory tree to or from an xdfsd over n parallel channels, and
// work on remote paths (ls, stat, mkdir, rm, mv, sum).
//
// Its options are defined once (CLI11): the help, the checks of their values and the subcommands
// all come from that one definition.
#include <CLI/CLI.hpp>
#include <boost/asio/ip/address.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <chrono>
#include <condition_variable>
#include <ctime>
#include <map>
#include <mutex>
#include <optional>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <string>
#include <random>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "xdfs/xdfs.hpp"
#include "xdfs/text.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xdsi.hpp"

namespace {

std::atomic<bool> g_cancel{false};

void on_signal(int) { g_cancel.store(true); }

// What the user gave is escaped too: a file name with an escape sequence is shown, not acted on.
[[noreturn]] void bad(const std::string& why) {
  fmt::print(stderr, "xduc: bad argument: {}\n", xdfs::text::escape(why));
  std::exit(2);
}

// --progress: how a copy shows how far it is.
enum class Show { none, line, json };

// A copy's progress on standard error, drawn by a thread of its own: a line that redraws itself
// every 200 ms (people), or a JSON object a line every second (programs). The copy only stores
// its counters (set), so the threads that move the data do no more per block than that.
class ProgressReport {
public:
  struct Counts {
    std::uint64_t files = 0, files_total = 0, bytes = 0, bytes_total = 0;
    bool totals_final = false;  ///< else the totals are what is known so far (a listing coming in, a stream)
  };

  explicit ProgressReport(Show show) : show_(show) {}
  ProgressReport(const ProgressReport&) = delete;
  ~ProgressReport() { stop(); }
  Show show() const { return show_; }

  // A copy starts; `files`: its line counts files (a tree, several sources), else it is one file's.
  void begin(bool files) {
    if (show_ == Show::none) return;
    stop();
    with_files_ = files;
    store({});
    told_ = false;
    t0_ = std::chrono::steady_clock::now();
    stopping_ = false;
    thread_ = std::thread([this] { run(); });
  }
  void set(const Counts& c) {
    store(c);
    told_.store(true, std::memory_order_relaxed);
  }
  Counts counts() const {
    return {files_.load(std::memory_order_relaxed), files_total_.load(std::memory_order_relaxed),
            bytes_.load(std::memory_order_relaxed), bytes_total_.load(std::memory_order_relaxed),
            totals_final_.load(std::memory_order_relaxed)};
  }
  // A line of its own on standard error: the progress line, if one is drawn, ends first.
  void say(const std::string& line) {
    std::lock_guard lk(out_mu_);
    end_line();
    fmt::print(stderr, "{}\n", line);
  }
  // The copy is over, whole or not: its last counts (given, or the last stored) once more, as the
  // line's last state or as the JSON object with "final":true.
  void finish(std::optional<Counts> last = std::nullopt) {
    if (!thread_.joinable()) return;
    stop();
    if (last) store(*last);
    std::lock_guard lk(out_mu_);
    draw(true);
    end_line();
  }

private:
  void store(const Counts& c) {
    files_.store(c.files, std::memory_order_relaxed);
    files_total_.store(c.files_total, std::memory_order_relaxed);
    bytes_.store(c.bytes, std::memory_order_relaxed);
    bytes_total_.store(c.bytes_total, std::memory_order_relaxed);
    totals_final_.store(c.totals_final, std::memory_order_relaxed);
  }
  void stop() {
    {
      std::lock_guard lk(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void run() {
    const auto every = std::chrono::milliseconds(show_ == Show::json ? 1000 : 200);
    std::unique_lock lk(mu_);
    while (!cv_.wait_for(lk, every, [this] { return stopping_; })) {
      lk.unlock();
      // A line only once the copy told something (not "0 B" while the session opens); JSON
      // every second regardless, for a program that waits on it.
      if (show_ == Show::json || told_.load(std::memory_order_relaxed)) {
        std::lock_guard out(out_mu_);
        draw(false);
      }
      lk.lock();
    }
  }
  void end_line() {
    if (line_shown_) fmt::print(stderr, "\n");
    line_shown_ = false;
  }
  void draw(bool final) {
    const Counts c = counts();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    const double rate = secs > 0 ? static_cast<double>(c.bytes) / secs : 0;
    std::optional<std::uint64_t> eta;
    if (final) eta = 0;
    else if (c.totals_final && rate > 0 && c.bytes_total >= c.bytes)
      eta = static_cast<std::uint64_t>(static_cast<double>(c.bytes_total - c.bytes) / rate);
    if (show_ == Show::json) {
      fmt::print(stderr,
                 "{{\"files\":{},\"files_total\":{},\"bytes\":{},\"bytes_total\":{},\"totals_final\":{},"
                 "\"bytes_per_second\":{:.0f},\"eta_seconds\":{},\"seconds\":{:.3f},\"final\":{}}}\n",
                 c.files, c.files_total, c.bytes, c.bytes_total, c.totals_final, rate,
                 eta ? std::to_string(*eta) : "null", secs, final);
      std::fflush(stderr);
      return;
    }
    auto human = [](std::uint64_t b) { return xdfs::cli::human_bytes(static_cast<double>(b)); };
    std::string text;
    if (with_files_) text = fmt::format("{}/{}{} files  ", c.files, c.files_total, c.totals_final ? "" : "+");
    if (!c.totals_final) {  // a listing still coming in, or a stream (its size is known at its end)
      text += fmt::format("{:>10}{}  {:>10}/s", human(c.bytes),
                          with_files_ ? " / " + human(c.bytes_total) + "+" : std::string(), human(rate));
    } else {
      const double pct =
          c.bytes_total ? 100.0 * static_cast<double>(c.bytes) / static_cast<double>(c.bytes_total) : 100.0;
      text += fmt::format("{:>10} / {:<10} {:5.1f}%  {:>10}/s  ETA {}", human(c.bytes), human(c.bytes_total), pct,
                          human(rate), eta ? fmt::format("{}:{:02}", *eta / 60, *eta % 60) : "--:--");
    }
    fmt::print(stderr, "\r{}   ", text);
    line_shown_ = true;
  }

  const Show show_;
  bool with_files_ = false;
  std::chrono::steady_clock::time_point t0_;
  std::atomic<std::uint64_t> files_{0}, files_total_{0}, bytes_{0}, bytes_total_{0};
  std::atomic<bool> totals_final_{false};
  std::atomic<bool> told_{false};  // set() was called since begin()
  std::mutex mu_;      // stopping_, with cv_
  std::mutex out_mu_;  // standard error, and line_shown_
  std::condition_variable cv_;
  bool stopping_ = false;
  bool line_shown_ = false;
  std::thread thread_;
};

// Feeds a ProgressReport from a copy's callbacks: a tree's counts, a file transfer's bytes (a
// single file, or a tree's large file on top of the tree's), after what the command's earlier
// sources moved. All on the copy's thread (the one running the session).
struct ProgressFeed {
  explicit ProgressFeed(ProgressReport& r) : report(r) {}
  ProgressReport& report;
  ProgressReport::Counts before;  // earlier sources, or earlier sessions of this one
  ProgressReport::Counts now;     // this source, as last told
  bool last = true;               // no source after this one: the totals are the command's
  bool in_tree = false;           // a file transfer is a large file of this source's tree

  void tree(const xdfs::pathm::TreeProgress& p) {
    now = {p.files, p.files_total, p.bytes, p.bytes_total, p.totals_final};
    show(now);
  }
  void file(const xdfs::Progress& p) {
    if (!in_tree) now = {0, 1, p.bytes, p.total, !p.stream};
    auto c = now;
    if (in_tree) c.bytes += p.bytes;
    show(c);
  }
  void show(ProgressReport::Counts c) const { report.set(plus(c)); }
  ProgressReport::Counts plus(ProgressReport::Counts c) const {
    c.files += before.files;
    c.files_total += before.files_total;
    c.bytes += before.bytes;
    c.bytes_total += before.bytes_total;
    c.totals_final = c.totals_final && last;
    return c;
  }
  // A single file of several sources is whole.
  void file_done(std::uint64_t bytes) { now = {1, 1, bytes, bytes, true}; }
  // This source (or its session) is over: what it did counts as done, and as its totals.
  void next() {
    before = plus({now.files, now.files, now.bytes, now.bytes, true});
    now = {};
    report.set(before);
  }
};

std::string format_time(std::int64_t ns) {
  std::time_t t = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

using xdfs::cli::json_escape;

char type_char(xdfs::pathm::Type t) {
  switch (t) {
    case xdfs::pathm::Type::file: return '-';
    case xdfs::pathm::Type::directory: return 'd';
    case xdfs::pathm::Type::symlink: return 'l';
    default: return '?';
  }
}

// Names and targets come from the server: shown escaped (a name with a newline or an escape
// sequence is shown as \n or \x1b, never acted on by the terminal).
std::string shown(const std::string& s) { return xdfs::text::escape(s); }

void print_entry(const xdfs::pathm::Entry& e, bool json) {
  if (json) {
    fmt::print("{{\"path\":\"{}\",\"type\":\"{}\",\"size\":{},\"mode\":\"{:04o}\",\"mtime_ns\":{}{}}}\n",
               json_escape(shown(e.path)), xdfs::pathm::to_string(e.type), e.size, e.mode, e.mtime_ns,
               e.type == xdfs::pathm::Type::symlink ? ",\"target\":\"" + json_escape(shown(e.target)) + "\"" : "");
    return;
  }
  fmt::print("{} {:04o} {:>12} {} {}{}\n", type_char(e.type), e.mode, e.size, format_time(e.mtime_ns), shown(e.path),
             e.type == xdfs::pathm::Type::symlink ? " -> " + shown(e.target) : "");
}

std::string base_name(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  auto s = p.rfind('/');
  return s == std::string::npos ? p : p.substr(s + 1);
}

std::string join_path(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

// A failure for programs: its code, its class (what to do next: retry, reconnect, give-up), the
// side that hit it, and where (channel, offset) when known.
std::string json_error(xdfs::errc code, const std::string& message, bool remote, const std::string& operation = {},
                       std::optional<xdfs::ChannelIndex> channel = {}, std::optional<xdfs::FileOffset> offset = {}) {
  std::string s = fmt::format("{{\"code\":\"{}\",\"recovery\":\"{}\",\"remote\":{},\"message\":\"{}\"",
                              xdfs::to_string(code), xdfs::to_string(xdfs::recovery(code)), remote,
                              json_escape(shown(message)));
  if (!operation.empty()) s += ",\"operation\":\"" + json_escape(shown(operation)) + "\"";
  if (channel) s += fmt::format(",\"channel\":{}", channel->value());
  if (offset) s += fmt::format(",\"offset\":{}", offset->value());
  return s + "}";
}

std::string json_error(const xdfs::Error& e, bool remote) {
  return json_error(e.code(), e.context(), remote, e.operation(), e.channel(), e.offset());
}

// The one line on standard error; with --json also {"error":{...}} on standard output.
int report_error(const xdfs::Error& e, bool remote, bool json = false) {
  fmt::print(stderr, "xduc: {}{}: {}\n", xdfs::to_string(e.code()), remote ? " (server)" : "", shown(e.context()));
  if (json) fmt::print("{{\"error\":{}}}\n", json_error(e, remote));
  if (e.code() == xdfs::errc::cancelled) return 130;
  return e.code() == xdfs::errc::bad_argument ? 2 : 1;
}


// SRCs from a file, one a line ("-": standard input); empty lines and # comments are skipped.
bool read_sources(const std::string& file, std::vector<std::string>& out, std::string& why,
                  const char* option = "--files-from") {
  std::FILE* f = file == "-" ? stdin : std::fopen(file.c_str(), "r");
  if (!f) {
    why = std::string(option) + " '" + shown(file) + "': " + std::strerror(errno);
    return false;
  }
  char* line = nullptr;
  std::size_t cap = 0;
  ssize_t n;
  std::size_t count = 0;
  while ((n = ::getline(&line, &cap, f)) >= 0) {
    std::string s(line, static_cast<std::size_t>(n));
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    if (s.empty() || s[0] == '#') continue;
    if (++count > 10'000'000) {
      why = std::string(option) + " '" + shown(file) + "' names more than 10 million entries";
      break;
    }
    out.push_back(std::move(s));
  }
  std::free(line);
  if (f != stdin) std::fclose(f);
  return why.empty();
}

// One file to many hosts through a chain of their xdfsd servers: a line per host (as mcp),
// the failed ones listed in a file that --hosts takes back.
int copy_to_hosts(const std::vector<std::string>& srcs, const std::vector<std::string>& urls, xdfs::TransferOptions opt,
                  const xdfs::RelaySetOptions& set, const std::string& failed_file, bool quiet, bool json, bool line) {
  std::vector<xdfs::RelayTarget> targets;
  for (const auto& u : urls) {
    std::string why;
    auto url = xdfs::cli::parse_url(u, why);
    if (!url) bad(why);
    targets.push_back({{url->host, url->port}, url->path});
  }
  const bool tty = line;  // (--progress json does not apply: a host's line is its report)
  auto last = std::chrono::steady_clock::now();
  auto progress = [&](const std::vector<xdfs::RelayHost>& hosts) {
    if (!tty) return;
    auto now = std::chrono::steady_clock::now();
    if (now - last < std::chrono::milliseconds(200)) return;
    last = now;
    std::size_t whole = 0, failed = 0;
    std::optional<std::uint64_t> least;
    for (const auto& h : hosts) {
      if (h.final && h.code == xdfs::errc::ok) ++whole;
      else if (h.final) ++failed;
      else least = std::min(least.value_or(h.verified), h.verified);
    }
    fmt::print(stderr, "\r{} of {} hosts whole{}, slowest at {}   ", whole, hosts.size(),
               failed ? fmt::format(", {} failed", failed) : std::string(),
               xdfs::cli::human_bytes(static_cast<double>(least.value_or(0))));
  };
  xdfs::RelayResult r;
  try {
    r = xdfs::relay_set(srcs, targets, opt, set, progress);
  } catch (const xdfs::TransferError& e) {
    if (tty) fmt::print(stderr, "\n");
    return report_error(e, e.remote(), json);
  }
  if (tty) fmt::print(stderr, "\n");
  // As --hosts reads it back.
  auto where = [](const xdfs::RelayHost& h) {
    return xdfs::cli::format_url(h.target.server.host, h.target.server.port, h.target.path);
  };
  std::string hosts_json;
  std::vector<std::string> failed;
  for (const auto& h : r.hosts) {
    const double rate = h.seconds > 0 ? static_cast<double>(h.verified) / h.seconds : 0;
    if (h.ok) {
      if (!quiet && !json)
        fmt::print(stderr, "xduc: {}  ok  {} in {:.2f} s ({}/s)\n", shown(where(h)),
                   xdfs::cli::human_bytes(static_cast<double>(h.verified)), h.seconds, xdfs::cli::human_bytes(rate));
    } else {
      failed.push_back(where(h));
      fmt::print(stderr, "xduc: {}  FAILED  {}: {}\n", shown(where(h)), xdfs::to_string(h.code), shown(h.message));
    }
    if (json)
      hosts_json += fmt::format("{}{{\"host\":{},\"ok\":{},\"bytes\":{},\"seconds\":{:.6f},\"bytes_per_second\":{:.0f},"
                                "\"digest\":\"{}\"{}}}",
                                hosts_json.empty() ? "" : ",", "\"" + json_escape(shown(where(h))) + "\"", h.ok ? "true" : "false", h.verified,
                                h.seconds, rate, h.digest,
                                h.ok ? std::string()
                                     : fmt::format(",\"error\":{{\"code\":\"{}\",\"message\":{}}}",
                                                   xdfs::to_string(h.code), "\"" + json_escape(shown(h.message)) + "\""));
  }
  std::string notes_json;
  for (const auto& n : r.notes) {
    notes_json += (notes_json.empty() ? "\"" : ",\"") + json_escape(shown(n)) + "\"";
    if (!quiet && !json) fmt::print(stderr, "xduc: {}\n", shown(n));
  }
  if (!failed.empty()) {
    std::FILE* f = std::fopen(failed_file.c_str(), "w");
    if (f) {
      for (const auto& u : failed) fmt::print(f, "{}\n", u);
      std::fclose(f);
      fmt::print(stderr, "xduc: {} of {} hosts failed; they are listed in {} (give it back with --hosts)\n",
                 failed.size(), r.hosts.size(), shown(failed_file));
    } else {
      fmt::print(stderr, "xduc: {} of {} hosts failed; cannot list them in {}: {}\n", failed.size(), r.hosts.size(),
                 shown(failed_file), std::strerror(errno));
    }
  } else if (!quiet && !json) {
    fmt::print(stderr, "xduc: {} to {} hosts in {:.2f} s, {} sent from here\n",
               xdfs::cli::human_bytes(static_cast<double>(r.size)), r.hosts.size(), r.seconds,
               xdfs::cli::human_bytes(static_cast<double>(r.source_bytes)));
  }
  if (json)
    fmt::print("{{\"direction\":\"relay\",\"sources\":{},\"chains\":{},\"bytes\":{},\"seconds\":{:.6f},"
               "\"source_bytes\":{},\"channels\":{},"
               "\"block_size\":{},\"digest_algorithm\":\"{}\",\"digest\":\"{}\",\"failed\":{},\"hosts\":[{}],"
               "\"notes\":[{}]}}\n",
               srcs.size(), set.chains, r.size, r.seconds, r.source_bytes, opt.channels, opt.block_size,
               xdfs::manifest::algorithm, r.digest,
               failed.size(), hosts_json, notes_json);
  if (g_cancel.load()) return 130;
  return failed.empty() ? 0 : 1;
}

// xduc sum FILE...: the manifest digest of local files (every one a local path).
int sum_local(const std::vector<std::string>& paths, std::uint32_t block_size, bool plain_sha256) {
  if (plain_sha256) bad("--sha256 is for remote files (sha256sum does local ones)");
  int status = 0;
  for (const auto& p : paths) {
    if (xdfs::cli::is_url(p)) bad("sum takes local files or xdfs:// URLs, not both");
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    struct stat sb {};
    std::string why;
    if (fd < 0 || ::fstat(fd, &sb) != 0) {
      why = std::strerror(errno);
    } else if (!S_ISREG(sb.st_mode)) {
      why = "not a regular file";
    } else {
      const auto r = xdfs::manifest::of_file(fd, static_cast<std::uint64_t>(sb.st_size), block_size, &g_cancel);
      if (r.code == xdfs::errc::ok) fmt::print("{}  {}\n", xdfs::manifest::hex(r.digest), shown(p));
      else why = r.message;
    }
    if (fd >= 0) ::close(fd);
    if (!why.empty()) {
      fmt::print(stderr, "xduc: '{}': {}\n", shown(p), shown(why));
      status = 1;
    }
  }
  return status;
}

// Whether a copy that failed with e is worth another session, retry `tried + 1` of `retries`:
// a lost session is (the copy resumes where it was); what the error's class says to give up on
// (a refusal, a missing file, a full disk, a protocol error) is not, nor a session that never
// opened at the first try (the server unreachable, or gone during the set-up): that is said at
// once. Once a session was lost, a server that refuses while it restarts is waited for.
bool worth_retrying(const xdfs::TransferError& e, unsigned tried, unsigned retries) {
  const bool never_opened = e.code() == xdfs::errc::connection_refused || e.code() == xdfs::errc::connection_failed ||
                            e.operation() == "session set-up";
  return tried < retries && e.recovery() != xdfs::Recovery::give_up && !e.once() && !(never_opened && tried == 0) &&
         !g_cancel.load();
}

// A tree copy that lost its session ends in a TreeError: the failure that ended it, to decide
// on a retry with; none if the session still stands.
std::optional<xdfs::TransferError> session_lost(const xdfs::pathm::TreeError& e, const xdfs::Session& s) {
  if (s.usable()) return std::nullopt;
  if (const auto& f = e.result().session_failure) return xdfs::TransferError(f->code, f->message, f->remote);
  return xdfs::TransferError(xdfs::errc::peer_aborted, "the session ended", false);
}

// Says retry `tried` of `retries` in one line and waits 1, 2, 4 ... 30 s with +-50% jitter;
// throws cancelled if the user stops it meanwhile.
void wait_to_retry(unsigned tried, unsigned retries, const xdfs::TransferError& e, ProgressReport& report) {
  const double base = std::min(30.0, static_cast<double>(1u << std::min(tried - 1, 5u)));
  static std::minstd_rand jitter{std::random_device{}()};
  const double wait = base * std::uniform_real_distribution<double>(0.5, 1.5)(jitter);
  report.say(fmt::format("xduc: retry {} of {} in {:.1f} s: {}{}: {}", tried, retries, wait, xdfs::to_string(e.code()),
                         e.remote() ? " (server)" : "", shown(e.context())));
  for (auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait);
       std::chrono::steady_clock::now() < until && !g_cancel.load();)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (g_cancel.load()) throw xdfs::TransferError(xdfs::errc::cancelled, "cancelled by the user", false);
}

// Several sources over one session: files as xFTSM transfers, directories (with -r) as tree
// copies in path mode, switching modes on the same channels. A source that fails gets its line
// and the others go on while the session does; a lost session is opened again (up to
// `retries` times in a row) and the source it was copying goes again, resuming where it was.
// The exit status says whether all went well.
int copy_many(const std::vector<std::string>& sources, const std::string& dst, bool up, const xdfs::cli::Url& url,
              const xdfs::TransferOptions& opt, xdfs::pathm::TreeOptions tree, bool recursive, bool quiet, bool json,
              unsigned retries, ProgressReport& report) {
  const xdfs::Endpoint ep{url.host, url.port};
  if (!up) {
    struct stat sb {};
    if (::stat(dst.c_str(), &sb) != 0 || !S_ISDIR(sb.st_mode))
      bad("with several sources DST must be an existing directory ('" + shown(dst) + "' is not)");
  }
  std::vector<std::string> remote_paths;
  for (const auto& s : sources) {
    if (up) continue;
    std::string why;
    auto u = xdfs::cli::parse_url(s, why);
    if (!u) bad(why);
    if (u->host != url.host || u->port != url.port) bad("all remote paths of one command must be on the same server");
    if (u->path.empty()) bad("'" + shown(s) + "' names no remote file");
    remote_paths.push_back(u->path);
  }
  // Files and bytes of all sources: the totals grow as each source starts.
  ProgressFeed feed{report};
  report.begin(true);
  xdfs::TransferOptions o = opt;
  if (report.show() != Show::none) {
    o.progress = [&feed](const xdfs::Progress& p) { feed.file(p); };
    tree.progress = [&feed](const xdfs::pathm::TreeProgress& p) { feed.tree(p); };
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::uint64_t files = 0, trees = 0, bytes = 0, failed = 0, skipped = 0;
  double setup = 0;
  std::optional<xdfs::Session> session_holder;
  session_holder.emplace(ep, opt);
  unsigned tried = 0, retried = 0;  // retries in a row (since a source last went well), in all
  std::vector<std::string> errors;  // for --json: each failure, with its class
  std::vector<std::string> digests;  // for --json: each file's manifest digest
  auto fail_line = [&](const std::string& what, const xdfs::Error& e, bool remote) {
    report.say(fmt::format("xduc: {}: {}{}: {}", shown(what), xdfs::to_string(e.code()), remote ? " (server)" : "",
                           shown(e.context())));
    errors.push_back(fmt::format("{{\"source\":\"{}\",{}", json_escape(shown(what)), json_error(e, remote).substr(1)));
    ++failed;
  };
  // A lost session, if e is worth it: waits, says so, and opens a new one. False: no retry (or
  // the user stopped it while it waited).
  auto retry_in_new_session = [&](const xdfs::TransferError& e) {
    if (!worth_retrying(e, tried, retries)) return false;
    feed.next();  // what the lost session copied stays
    try {
      wait_to_retry(++tried, retries, e, report);
    } catch (const xdfs::TransferError&) {
      return false;
    }
    ++retried;
    session_holder.emplace(ep, opt);
    return true;
  };
  std::size_t k = 0;
  for (; k < sources.size() && !g_cancel.load(); ++k) {
    const std::string& src = sources[k];
    const std::string name = base_name(up ? src : remote_paths[k]);
    feed.last = k + 1 == sources.size();
    tried = 0;
    auto this_tree = tree;  // a retry of this source skips what is whole at DST; later sources do not
    for (bool again = true; again;) {  // again: the session was lost and is opened anew
    again = false;
    feed.in_tree = false;
    auto& session = *session_holder;
    try {
      struct stat sb {};
      const bool tree_source = up ? (::stat(src.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode)) : false;
      if (tree_source && !recursive) throw xdfs::TransferError(xdfs::errc::is_directory, "'" + src + "' is a directory (-r copies trees)", false);
      if (tree_source) {
        feed.in_tree = true;
        const bool contents = src.back() == '/';
        auto r = xdfs::upload_tree(session, src, contents ? url.path : join_path(url.path, name), this_tree, o);
        ++trees;
        files += r.files;
        bytes += r.bytes;
        skipped += r.skipped;
      } else {
        xdfs::TransferResult r;
        try {
          r = up ? xdfs::upload(session, src, join_path(url.path, name), o)
                 : xdfs::download(session, remote_paths[k], join_path(dst, name), o);
        } catch (const xdfs::TransferError& e) {
          // A remote directory: with -r it is a tree, copied in path mode on the same session.
          if (up || !recursive || e.code() != xdfs::errc::is_directory || !session.usable()) throw;
          const bool contents = remote_paths[k].back() == '/';
          feed.in_tree = true;
          auto t = xdfs::download_tree(session, remote_paths[k], contents ? dst : join_path(dst, name), this_tree, o);
          ++trees;
          files += t.files;
          bytes += t.bytes;
          skipped += t.skipped;
          continue;
        }
        feed.file_done(r.bytes);
        if (files == 0 && trees == 0) setup = r.setup_seconds;
        if (!r.digest.empty())
          digests.push_back(fmt::format("{{\"source\":\"{}\",\"digest\":\"{}\"}}", json_escape(shown(src)), r.digest));
        ++files;
        bytes += r.bytes;
      }
    } catch (const xdfs::pathm::TreeError& e) {
      if (auto lost = session_lost(e, session); lost && retry_in_new_session(*lost)) {
        // Again, skipping what is already whole at DST, as --sync does.
        this_tree.sync = true;
        again = true;
        continue;
      }
      for (const auto& f : e.result().failures) {
        report.say(fmt::format("xduc: {}{}: {}{}", xdfs::to_string(f.code), f.remote ? " (server)" : "",
                               f.message.find(f.path) == std::string::npos ? shown(f.path) + ": " : "",
                               shown(f.message)));
        errors.push_back(fmt::format("{{\"source\":\"{}\",\"path\":\"{}\",{}", json_escape(shown(src)),
                                     json_escape(shown(f.path)), json_error(f.code, f.message, f.remote).substr(1)));
      }
      files += e.result().files;
      bytes += e.result().bytes;
      ++failed;
    } catch (const xdfs::TransferError& e) {
      if (!session.usable() && retry_in_new_session(e)) {
        again = true;
        continue;
      }
      fail_line(src, e, e.remote());
    } catch (const xdfs::Error& e) {
      fail_line(src, e, false);
    }
    }
    feed.next();
    if (!session_holder->usable()) {
      ++k;
      break;
    }
  }
  session_holder->close();
  report.finish(ProgressReport::Counts{files, feed.before.files_total, bytes, feed.before.bytes_total, true});
  const std::uint64_t not_tried = sources.size() - k;
  if (not_tried) fmt::print(stderr, "xduc: {} source{} not copied: the session ended\n", not_tried, not_tried == 1 ? "" : "s");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (json) {
    const double bps = secs > 0 ? static_cast<double>(bytes) / secs : 0;
    fmt::print("{{\"direction\":\"{}\",\"sources\":{},\"files\":{},\"trees\":{},\"skipped\":{},\"failed\":{},"
               "\"bytes\":{},\"seconds\":{:.6f},\"bytes_per_second\":{:.0f},\"channels\":{},\"setup_seconds\":{:.6f},"
               "\"retries\":{},\"block_size\":{},\"digests\":[{}],\"errors\":[{}]}}\n",
               up ? "upload" : "download", sources.size(), files, trees, skipped, failed + not_tried, bytes, secs, bps,
               opt.channels, setup, retried, opt.block_size, fmt::join(digests, ","), fmt::join(errors, ","));
  } else if (!quiet) {
    fmt::print(stderr, "xduc: {} files{}, {} in {:.2f} s over one session{}\n", files,
               trees ? fmt::format(" ({} trees)", trees) : std::string(), xdfs::cli::human_bytes(static_cast<double>(bytes)),
               secs, failed + not_tried ? fmt::format(", {} sources not copied", failed + not_tried) : std::string());
  }
  if (g_cancel.load()) return 130;
  return failed + not_tried ? 1 : 0;
}

// What the command line says, parsed: the copy's options and, for a subcommand, which.
struct Command {
  std::string name;                     ///< the subcommand (ls, get, keygen ...); empty: a copy
  std::vector<std::string> positional;  ///< a copy's SRC... DST, or the subcommand's arguments
  xdfs::TransferOptions opt;
  xdfs::pathm::TreeOptions tree;
  xdfs::RelaySetOptions chain_set;
  xdfs::PullOptions pull_opt;
  bool quiet = false, json = false, recursive = false, parents = false, plain_sha256 = false;
  unsigned retries = 5;  ///< --retries: a copy whose session is lost goes on in a new one
  bool block_size_given = false;
  std::optional<Show> progress;  ///< --progress; default: a line on a terminal
  std::string files_from, hosts_file, failed_hosts = "xduc-failed-hosts", server_log;
};

// xduc's help: each app's description begins with its usage lines; a group's heading may be the
// paragraph its options need; the main help shows every command in full (no second page to find).
class Help : public CLI::Formatter {
public:
  std::map<std::string, std::string> paragraphs;  ///< a group's heading -> the paragraph shown instead

  std::string make_usage(const CLI::App*, std::string) const override { return {}; }
  std::string make_positionals(const CLI::App*) const override { return {}; }
  // One blank line before each group (CLI11 puts one between groups, and one after this).
  std::string make_description(const CLI::App* app) const override { return CLI::Formatter::make_description(app) + "\n"; }
  std::string make_group(std::string group, bool positional, std::vector<const CLI::Option*> opts) const override {
    const auto p = paragraphs.find(group);
    std::string out = (p == paragraphs.end() ? group + ":" : p->second) + "\n";
    for (const auto* o : opts) out += make_option(o, positional);
    return out;
  }
  std::string make_help(const CLI::App* app, std::string name, CLI::AppFormatMode mode) const override {
    if (!app->get_parent() && mode == CLI::AppFormatMode::Normal) mode = CLI::AppFormatMode::All;
    return CLI::Formatter::make_help(app, name, mode);
  }
  std::string make_expanded(const CLI::App* sub) const override {
    const std::string text = make_description(sub) + make_groups(sub, CLI::AppFormatMode::Sub);
    std::string out;
    for (std::size_t at = 0, end; at < text.size(); at = end + 1) {
      end = std::min(text.find('\n', at), text.size());
      if (end > at) out += "  " + text.substr(at, end - at) + "\n";
    }
    return out;
  }
};

// A value's check, in the words the option's help uses; CLI11 reports it (exit 2, one line).
[[noreturn]] void reject(const std::string& why) { throw CLI::ValidationError(why); }

std::uint64_t size_in(const std::string& v, const std::string& name, std::uint64_t lo, std::uint64_t hi,
                      const std::string& what) {
  auto n = xdfs::cli::parse_size(v);
  if (!n || *n < lo || *n > hi) reject(name + " takes " + what);
  return *n;
}

std::uint64_t count_in(const std::string& v, const std::string& name, std::uint64_t lo, std::uint64_t hi,
                       const std::string& what) {
  auto n = xdfs::cli::parse_uint(v, lo, hi);
  if (!n) reject(fmt::format("{} takes {} from {} to {}", name, what, lo, hi));
  return *n;
}

const char* const url_form = "xdfs://HOST[:PORT]/PATH";

// Every option and subcommand, writing into c.
void define(CLI::App& app, Command& c, Help& help) {
  auto& opt = c.opt;
  app.description(
      "usage: xduc [-p N] [--block-size SIZE] [--tcp-window SIZE] [--protect MODE] [-q] [--json] SRC... DST\n"
      "       xduc [OPTIONS] --files-from FILE DST\n"
      "       xduc [-r] [OPTIONS] SRC... xdfs://HOST1/PATH xdfs://HOST2/PATH ... | --hosts FILE\n"
      "       xduc -r [--sync [--checksum]] [--follow] [--progress MODE] [OPTIONS] SRC DST\n"
      "       xduc ls | stat | mkdir | rm | mv | sum | get | keygen | pubkey  ... (below)\n"
      "Copies files; either every SRC or DST is xdfs://HOST[:PORT]/PATH (default port 7721), all on\n"
      "one server, and all of them travel over one session (its channels are set up once).\n"
      "With one SRC, DST may be a local directory, '-' (standard output) or a device such as\n"
      "/dev/null; with several, DST is a directory (remote: the files go into it). SRC '-' uploads\n"
      "standard input to the remote file DST names, as does a pipe or FIFO: a stream, whose size\n"
      "is known at its end (its digest too); it cannot be resumed or retried.\n"
      "An IPv6 HOST goes in brackets (xdfs://[::1]:7721/f); %XX in PATH is the byte XX (%20 a\n"
      "space, %25 a '%'). No USER@: the server knows this client by its key (--identity).");
  app.require_subcommand(0, 1);
  // An option given twice takes its last value, as before (scripts add to command lines).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("SRC", c.positional)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  help.column_width(25);

  auto value = [](CLI::App* on, const std::string& names, const std::string& type, const std::string& text,
                  std::function<void(const std::string&)> set) {
    return on->add_option_function<std::string>(names, std::move(set), text)->type_name(type);
  };
  auto file = [](CLI::App* on, const std::string& names, std::string& into, const std::string& text) {
    return on->add_option(names, into, text)->type_name("FILE");
  };

  const std::string copies = "Copies";
  file(&app, "--files-from", c.files_from,
       "more SRCs, one a line ('-': standard input; empty lines and lines\n"
       "starting with # are skipped); remote ones as xdfs:// URLs")
      ->group(copies);
  app.add_flag("-r,--recursive", c.recursive,
               "copy a directory tree (files, empty directories, symlinks, modes,\n"
               "mtimes); as with rsync, SRC/ copies the contents of SRC into DST,\n"
               "SRC without the slash copies the directory itself into DST")
      ->group(copies);
  app.add_flag("--sync", c.tree.sync, "skip files whose size and mtime already match at DST")->group(copies);
  app.add_flag("--checksum", c.tree.checksum, "with --sync: compare content (SHA-256) instead of mtime")->group(copies);
  app.add_flag("--follow", c.tree.follow, "copy what symlinks point to instead of the symlinks")->group(copies);
  value(&app, "--workers", "N", "local threads reading or writing files in a tree copy (default 4)",
        [&c](const std::string& v) { c.tree.workers = static_cast<unsigned>(count_in(v, "--workers", 1, 64, "a thread count")); })
      ->group(copies);
  value(&app, "--max-listing", "SIZE", "memory a tree copy may hold for the server's listing (default 2G)",
        [&c](const std::string& v) {
          c.tree.max_listing = static_cast<std::size_t>(
              size_in(v, "--max-listing", 1u << 20, SIZE_MAX, "a size of at least 1M, e.g. 4G"));
        })
      ->group(copies);
  value(&app, "--large-file", "SIZE",
        "in a tree copy, files of at least SIZE go as transfers of their own\n"
        "on the same session, as a single file does (default 64M; 0: never)",
        [&c](const std::string& v) {
          c.tree.large_file =
              size_in(v, "--large-file", 0, UINT64_MAX, "a size, e.g. 64M (0: every file of a tree in path mode)");
        })
      ->group(copies);

  const std::string hosts = "To many hosts";
  help.paragraphs[hosts] =
      "To many hosts: SRC... then two or more xdfs:// DSTs (or --hosts) go through a chain of those\n"
      "xdfsd servers in the order given: each verifies every block, writes it and forwards it at\n"
      "once, so a file leaves this machine about once and the last host has it about as soon as the\n"
      "first. A host that fails is passed over and named; the others finish. A line per host.\n"
      "Blocks are 256K there unless --block-size says otherwise (a host forwards a block once whole).\n"
      "Several SRCs (and trees, with -r) go into each DST as a directory; a tree's small files travel\n"
      "in packs (one chain each, written out on every host), so every byte leaves here about once.";
  file(&app, "--hosts", c.hosts_file, "more DSTs for a chain, one xdfs:// URL a line (# comments skipped)")->group(hosts);
  value(&app, "--chains", "N",
        "N chains fed at once, the hosts dealt among them in turn: for a\n"
        "source whose link is N times faster than a host's (default 1)",
        [&c](const std::string& v) { c.chain_set.chains = static_cast<unsigned>(count_in(v, "--chains", 1, 64, "a count")); })
      ->group(hosts);
  value(&app, "--chain-min", "SIZE",
        "a tree's files of at least SIZE get a chain each, smaller ones are\n"
        "packed (default 1M, at most 16M counts)",
        [&c](const std::string& v) {
          c.chain_set.chain_threshold = size_in(v, "--chain-min", 1, UINT64_MAX, "a size of at least 1 byte, e.g. 1M");
        })
      ->group(hosts);
  file(&app, "--failed-hosts", c.failed_hosts,
       "where to list the hosts that failed, to give back as --hosts\n"
       "(default: xduc-failed-hosts in the current directory)")
      ->group(hosts);

  const std::string transfers = "Transfers";
  value(&app, "-p,--parallel", "N", "parallel TCP channels (default 1)", [&opt](const std::string& v) {
    opt.channels = static_cast<unsigned>(count_in(v, "--parallel", 1, 4096, "a channel count"));
  })->group(transfers);
  value(&app, "--block-size", "SIZE", "block size, e.g. 1M (default 1M, 4K..64M)", [&c](const std::string& v) {
    c.opt.block_size = static_cast<std::uint32_t>(size_in(v, "--block-size", xdfs::wire::min_block_size,
                                                           xdfs::wire::max_block_size, "a size from 4K to 64M, e.g. 1M"));
    c.block_size_given = true;
  })->group(transfers);
  value(&app, "--tcp-window", "SIZE", "socket buffer size (default: kernel autotuning)", [&opt](const std::string& v) {
    opt.tcp_window = static_cast<std::uint32_t>(size_in(v, "--tcp-window", 4096, 1ull << 30, "a size from 4K to 1G"));
  })->group(transfers);
  app.add_flag("--fsync", opt.fsync, "flush a downloaded file to disk before renaming it into place")->group(transfers);
  value(&app, "--limit-rate", "RATE",
        "bytes per second for file transfers over all channels together,\n"
        "e.g. 100M (binary units: 100 MiB/s; default: no limit)",
        [&opt](const std::string& v) {
          auto n = xdfs::cli::parse_rate(v);
          if (!n) reject("--limit-rate takes a rate in bytes per second from 1K to 1P, e.g. 100M");
          opt.limit_rate = *n;
        })
      ->group(transfers);
  app.add_flag_callback("--no-verify", [&opt] { opt.verify = false; },
                        "blocks travel without their SHA-256 digests (docs/manifest.md):\n"
                        "faster; in clear mode nothing then checks the data")
      ->group(transfers);
  value(&app, "--block-workers", "N",
        "helper threads that hash, seal and open blocks beside the disk\n"
        "thread (0 to 7; default: one per core but one)",
        [](const std::string& v) {
          xdfs::piod::BlockWorkers::configure(static_cast<unsigned>(
              count_in(v, "--block-workers", 0, xdfs::piod::BlockWorkers::max_helpers, "a count")));
        })
      ->group(transfers);
  app.add_flag_callback("--no-zero-copy", [&opt] { opt.zero_copy = false; },
                        "every block goes through memory: an upload reads it first instead\n"
                        "of sending it from the page cache by sendfile, a download writes\n"
                        "it from there instead of splicing it into the file (clear mode)")
      ->group(transfers);
  app.add_flag_callback("--loopback-sendfile", [&opt] { opt.loopback_sendfile = true; },
                        "an upload to a server on this host goes by sendfile too (by default\n"
                        "it is read first: over loopback that costs less CPU)")
      ->group(transfers);
  app.add_flag_callback("--debug", [&opt] {
       opt.debug = [](const std::string& line) { fmt::print(stderr, "xduc: debug: {}\n", xdfs::text::escape(line)); };
     }, "debug lines on standard error (zero copy, or why not)")
      ->group(transfers);
  value(&app, "--retries", "N",
        "a copy whose session is lost (the server gone or restarting, the\n"
        "link cut, a timeout) goes on in a new session, resuming where it\n"
        "was, up to N times in a row, waiting 1, 2, 4 ... 30 s with jitter; not\n"
        "for refusals, missing files, a full disk, a session that never\n"
        "opened, a download to '-' or a device, an upload of a stream or\n"
        "into a server's FIFO (default 5; 0: never)",
        [&c](const std::string& v) { c.retries = static_cast<unsigned>(count_in(v, "--retries", 0, 100, "a count")); })
      ->group(transfers);
  app.add_flag_callback("--no-resume", [&opt] { opt.resume = false; },
                        "start over instead of continuing an interrupted transfer (by\n"
                        "default a download is written as .NAME.xdfs-partial with a\n"
                        "record of its verified blocks, kept when the transfer is cut, and\n"
                        "the same command continues it; uploads resume at the server)")
      ->group(transfers);
  value(&app, "--memory", "SIZE",
        "benchmark mode: move SIZE bytes memory to memory, no disk at either\n"
        "end (the local path is ignored; xdfsd needs --allow-memory-mode)",
        [&opt](const std::string& v) {
          opt.memory_size = size_in(v, "--memory", 0, UINT64_MAX, "a size, e.g. 4G");
          opt.memory = true;
        })
      ->group(transfers);

  const std::string security = "Security";
  value(&app, "--protect", "MODE",
        "clear | integrity | private (default private): clear MACs control\n"
        "frames only, integrity MACs every frame, private encrypts every frame",
        [&opt](const std::string& v) {
          auto p = xdfs::xsec::parse_protect(v);
          if (!p) reject("--protect takes clear, integrity or private");
          opt.protect = *p;
        })
      ->group(security);
  file(&app, "--identity", opt.identity_file, "private key (default ~/.config/xdfs/id_x25519, made on first use)")
      ->group(security);
  file(&app, "--known-hosts", opt.known_hosts_file, "pinned server keys (default ~/.config/xdfs/known_hosts)")
      ->group(security);
  app.add_flag("--strict-host-key", opt.strict_host_key, "refuse a server whose key is not pinned yet (default: pin on first use)")
      ->group(security);

  const std::string output = "Output";
  app.add_flag("-q,--quiet", c.quiet, "no progress line (unless --progress says so) and no summary")->group(output);
  value(&app, "--progress", "MODE",
        "line: a line on standard error that redraws itself (files and bytes\n"
        "of the total, rate, ETA; the default on a terminal); json: for\n"
        "programs, a JSON object a line on standard error every second\n"
        "({\"files\",\"files_total\",\"bytes\",\"bytes_total\",\"totals_final\",\n"
        "\"bytes_per_second\",\"eta_seconds\",\"seconds\",\"final\"}), the last one with\n"
        "\"final\":true; none. A download's totals grow as the listing comes\n"
        "(\"totals_final\":false until it is all in)",
        [&c](const std::string& v) {
          if (v == "line") c.progress = Show::line;
          else if (v == "json") c.progress = Show::json;
          else if (v == "none") c.progress = Show::none;
          else reject("--progress takes line, json or none");
        })
      ->group(output);
  app.add_flag("--json", c.json, "print a one-line JSON summary at the end")->group(output);
  app.set_help_flag("-h,--help", "this text (xduc COMMAND --help: one command's)")->group(output);
  app.set_version_flag("--version", xdfs::cli::version_line("xduc"), "print the version and the protocol version")
      ->group(output);

  // The subcommands: their own options here; the ones above go after their names too.
  auto command = [&](const char* name, const std::string& text) {
    CLI::App* sub = app.add_subcommand(name, text);
    sub->fallthrough();
    sub->group("Commands (each takes the options above too, e.g. xduc ls --json URL)");
    sub->set_help_flag("-h,--help", "this text");
    sub->add_option("ARGS", c.positional);
    sub->footer("The options of xduc --help (-p, --protect, --identity, --known-hosts, --json ...) go\n"
                "after the command too.");
    return sub;
  };
  const std::string flags = "Options";
  CLI::App* ls = command("ls", fmt::format("usage: xduc ls [-r] [OPTIONS] {} ...\nlists remote paths (-r: the whole tree)", url_form));
  ls->add_flag("-r,--recursive", c.recursive, "the whole tree")->group(flags);
  command("stat", fmt::format("usage: xduc stat [OPTIONS] {} ...\nshows one remote entry", url_form));
  command("mkdir", fmt::format("usage: xduc mkdir [--parents] [OPTIONS] {} ...\nmakes a remote directory", url_form))
      ->add_flag("--parents", c.parents, "with its parents")
      ->group(flags);
  command("rm", fmt::format("usage: xduc rm [-r] [OPTIONS] {} ...\nremoves remote paths", url_form))
      ->add_flag("-r,--recursive", c.recursive, "directories with their contents")
      ->group(flags);
  command("mv", fmt::format("usage: xduc mv [OPTIONS] {} NEWPATH\nrenames within the server", url_form));
  command("sum", fmt::format("usage: xduc sum [--sha256] [--block-size SIZE] [OPTIONS] {} ... | FILE ...\n"
                             "prints a file's manifest digest for the block size (what --json reports after\n"
                             "a copy; local files too), or with --sha256 the SHA-256 of remote files as\n"
                             "sha256sum does",
                             url_form))
      ->add_flag("--sha256", c.plain_sha256, "the plain SHA-256 of remote files")
      ->group(flags);
  CLI::App* get = command(
      "get",
      "usage: xduc get [-r] [--listen HOST:PORT] [--server-log FILE] [OPTIONS] xdfs://MASTER[:PORT]/PATH DST\n"
      "asks the xdfsd MASTER for its file PATH (with -r or a PATH ending in '/', a set: the\n"
      "files (at most 20000), directories and symlinks under that directory, into the directory DST,\n"
      "in parts: packs of the small files and each file over 16M alone) and joins that file's\n"
      "chain: this host's own server (with this client's key) is fed by the host before it,\n"
      "verifies every block, writes it and feeds the hosts that ask later, and stays until the\n"
      "master lets it go (no later host needs it). Hosts asking at once or one after another all\n"
      "get the file about once from the master. A lost session to the master is tried again (20\n"
      "times); what was verified stays.");
  get->add_flag("-r,--recursive", c.recursive, "PATH is a directory: what it holds, as a set")->group(flags);
  value(get, "--listen", "HOST:PORT",
        "where this host's server listens for its upstream (default\n"
        "0.0.0.0:0, a free port; the master connects to this host's address)",
        [&c](const std::string& v) {
          // This host's server binds there: an IP address of this host and a port (0: any free
          // one), both given (the server's own default port is not what a pulling host wants).
          std::string host;
          std::uint16_t port = 0, port2 = 0;
          boost::system::error_code ec;
          if (!xdfs::xdsi::parse_host_port(v, 1, host, port) || !xdfs::xdsi::parse_host_port(v, 2, host, port2) ||
              port != port2 || (boost::asio::ip::make_address(host, ec), ec))
            reject("--listen takes an IP address and a port, e.g. 0.0.0.0:0 or [::]:7722 (not '" +
                   xdfs::text::escape(v) + "')");
          c.pull_opt.listen = v;
        })
      ->group(flags);
  value(get, "--memory-stage", "DIR",
        "a memory file system where a set's parts (up to 128M, two at\n"
        "once) wait while they arrive and feed later hosts, so that they reach\n"
        "the disk once, as files (default /dev/shm; none: beside DST)",
        [&c](const std::string& v) {
          // The default is taken where it is a tmpfs with room; a DIR given is one, or a mistake.
          if (v != "none") {
            struct stat st {};
            struct statfs fs {};
            const std::string why = ::stat(v.c_str(), &st) != 0   ? std::strerror(errno)
                                    : !S_ISDIR(st.st_mode)          ? "not a directory"
                                    : ::statfs(v.c_str(), &fs) != 0 ? std::strerror(errno)
                                    : fs.f_type != TMPFS_MAGIC      ? "not on a tmpfs"
                                                                    : "";
            if (!why.empty())
              reject("--memory-stage takes a directory on a memory file system, or none ('" + xdfs::text::escape(v) +
                     "': " + why + ")");
          }
          c.pull_opt.memory_stage = v == "none" ? std::string() : v;
        })
      ->group(flags);
  file(get, "--server-log", c.server_log, "append this host's server's log lines to FILE")->group(flags);
  const char* key_text =
      "Give that line, followed by rw or ro, to the server's authorized_keys (--identity FILE: another key).";
  command("keygen", fmt::format("usage: xduc keygen [--identity FILE]\n"
                                "makes the key if missing and prints its public half.\n{}",
                                key_text));
  command("pubkey", fmt::format("usage: xduc pubkey [--identity FILE]\nprints the key's public half.\n{}", key_text));
}

// A subcommand's name counts only as the first word that is neither an option nor an option's
// value, as before: `xduc xdfs://h/f stat` downloads into ./stat. Elsewhere the name is a path.
void commands_first_only(CLI::App& app, const std::vector<std::string>& args) {
  auto takes_value = [&](const std::string& name) {
    const CLI::Option* o = app.get_option_no_throw(name);
    return o && o->get_items_expected_min() > 0;
  };
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") break;
    if (a.size() > 1 && a[0] == '-') {
      if (a[1] == '-') {
        if (a.find('=') == std::string::npos && takes_value(a)) ++i;
      } else {
        for (std::size_t k = 1; k < a.size(); ++k)  // -rp 4: the last one takes the next word
          if (takes_value(std::string("-") + a[k])) {
            if (k + 1 == a.size()) ++i;
            break;
          }
      }
      continue;
    }
    for (auto* sub : app.get_subcommands([](CLI::App*) { return true; }))
      if (sub->get_name() == a) return;
    break;
  }
  if (i >= args.size()) return;  // no word at all
  for (auto* sub : app.get_subcommands([](CLI::App*) { return true; })) sub->disabled();
}

// A CLI11 error as one line; an option of another command than the one given says which.
std::string parse_error_text(const CLI::App& app, const CLI::ParseError& e) {
  if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
    for (const auto& a : app.remaining(true)) {
      if (a.size() < 2 || a[0] != '-') continue;
      const std::string name = a.substr(0, a.find('='));
      std::vector<std::string> owners;
      for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; }))
        if (sub->get_option_no_throw(name)) owners.push_back(sub->get_name());
      if (!owners.empty())
        return fmt::format("{} goes with {} (xduc {} {} ...)", name, fmt::join(owners, " or "), owners[0], name);
    }
    return std::string(e.what()) + " (see --help)";
  }
  return e.what();
}

}  // namespace

int main(int argc, char** argv) {
  Command c;
  Help* help = nullptr;
  CLI::App app{"", "xduc"};
  {
    auto h = std::make_shared<Help>();
    help = h.get();
    app.formatter(h);
  }
  define(app, c, *help);
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    commands_first_only(app, args);
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them last first
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      if (dynamic_cast<const CLI::CallForVersion*>(&e)) fmt::print("{}\n", e.what());
      else fmt::print("{}", app.help());  // the command's, if one was given
      return 0;
    }
    bad(parse_error_text(app, e));
  }
  if (const auto subs = app.get_subcommands(); !subs.empty()) c.name = subs[0]->get_name();
  auto& opt = c.opt;
  auto& tree = c.tree;
  auto& positional = c.positional;
  const bool quiet = c.quiet, json = c.json, recursive = c.recursive;

  if (c.name == "keygen" || c.name == "pubkey") {
    if (!positional.empty()) bad(c.name + " takes no arguments (--identity FILE names the key)");
    const std::string path =
        opt.identity_file.empty() ? xdfs::xsec::default_config_dir() + "/id_x25519" : opt.identity_file;
    try {
      bool created = false;
      auto key = c.name == "keygen" ? xdfs::xsec::load_or_create_key(path, &created) : xdfs::xsec::load_key(path);
      if (created) fmt::print(stderr, "xduc: made a new key in {}\n", shown(path));
      fmt::print("{}\n", xdfs::xsec::format_public(key.public_key));
      return 0;
    } catch (const xdfs::Error& e) {
      fmt::print(stderr, "xduc: {}\n", shown(e.what()));
      return 1;
    }
  }
  if (tree.checksum && !tree.sync) bad("--checksum goes with --sync");
  if (auto why = xdfs::cli::too_slow("--limit-rate", opt.limit_rate, opt.block_size, "--block-size"); !why.empty())
    bad(why);
  tree.fsync = opt.fsync;

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  // Past the file size limit (ulimit -f) a write fails with EFBIG, which names the cause,
  // instead of ending xduc by SIGXFSZ with nothing said.
  std::signal(SIGXFSZ, SIG_IGN);
  opt.cancel = &g_cancel;
  // Progress on standard error: by default a line on a terminal, but not over a download that
  // goes to standard output on the same terminal.
  const bool onto_terminal = c.name.empty() && !positional.empty() && positional.back() == "-" && ::isatty(STDOUT_FILENO);
  ProgressReport report(c.progress.value_or(!quiet && ::isatty(STDERR_FILENO) && !onto_terminal ? Show::line : Show::none));
  if (!quiet) opt.notice = [&report](const std::string& line) { report.say("xduc: " + line); };

  if (c.name == "get") {
    auto& pull_opt = c.pull_opt;
    if (positional.size() != 2 || !xdfs::cli::is_url(positional[0]) || xdfs::cli::is_url(positional[1]))
      bad("get takes xdfs://MASTER[:PORT]/PATH and a local DST");
    std::string why;
    auto url = xdfs::cli::parse_url(positional[0], why);
    if (!url) bad(why);
    // A directory (-r, or a path ending in '/'): a set, its files into DST.
    pull_opt.set = recursive || url->path.empty() || url->path.back() == '/';
    while (pull_opt.set && url->path.size() > 1 && url->path.back() == '/') url->path.pop_back();
    if (url->path.empty()) url->path = ".";
    if (!c.block_size_given) opt.block_size = 256u << 10;  // a host forwards a block once it is whole
    std::FILE* log = nullptr;
    if (!c.server_log.empty()) {
      log = std::fopen(c.server_log.c_str(), "ae");
      if (!log) bad("--server-log '" + shown(c.server_log) + "': " + std::strerror(errno));
      pull_opt.log = [log](const std::string& line) {
        const auto t = std::time(nullptr);
        std::tm tm{};
        gmtime_r(&t, &tm);
        char when[32];
        std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
        std::fprintf(log, "%s %s\n", when, line.c_str());  // (escaped by the server)
        std::fflush(log);
      };
    }
    report.begin(false);
    if (report.show() != Show::none)
      pull_opt.progress = [&report](std::uint64_t verified, std::uint64_t size) {
        report.set({0, 1, verified, size, size > 0});
      };
    try {
      const auto r = xdfs::pull({url->host, url->port}, url->path, positional[1], opt, pull_opt);
      report.finish(ProgressReport::Counts{pull_opt.set ? r.files : 1, pull_opt.set ? r.files : 1, r.size, r.size, true});
      if (json)
        fmt::print("{{\"pulled\":\"{}\",\"local\":\"{}\",\"set\":{},\"files\":{},\"bytes\":{},\"seconds\":{:.3f},"
                   "\"tries\":{},\"early_files\":{}}}\n",
                   json_escape(shown(url->path)), json_escape(shown(r.local)), pull_opt.set, pull_opt.set ? r.files : 1,
                   r.size, r.seconds, r.tries, r.early_files);
      else if (!quiet)
        fmt::print(stderr, "xduc: {} ({}{}) in {:.2f} s{}\n", shown(r.local),
                   pull_opt.set ? fmt::format("{} files, ", r.files) : std::string(), xdfs::cli::human_bytes(double(r.size)),
                   r.seconds, r.tries > 1 ? fmt::format(", {} sessions to the master", r.tries) : std::string());
      return 0;
    } catch (const xdfs::TransferError& e) {
      report.finish();
      return report_error(e, e.remote(), json);
    }
  }

  if (!c.name.empty()) {  // ls, stat, mkdir, rm, mv, sum
    const std::string& op = c.name;
    const std::vector<std::string>& targets = positional;
    if (targets.empty()) bad(op + " needs an xdfs://HOST[:PORT]/PATH");
    // sum of local files: the same manifest digest, computed here.
    if (op == "sum" && !xdfs::cli::is_url(targets[0])) return sum_local(targets, opt.block_size, c.plain_sha256);
    if (op == "mv" && targets.size() != 2) bad("mv takes xdfs://HOST[:PORT]/PATH and the new path");
    std::vector<xdfs::cli::Url> urls;
    for (std::size_t k = 0; k < targets.size(); ++k) {
      if (op == "mv" && k == 1 && !xdfs::cli::is_url(targets[k])) {
        xdfs::cli::Url u = urls[0];
        u.path = targets[k];
        while (!u.path.empty() && u.path.front() == '/') u.path.erase(0, 1);
        urls.push_back(u);
        continue;
      }
      std::string why;
      auto u = xdfs::cli::parse_url(targets[k], why);
      if (!u) bad(why);
      if (!urls.empty() && (u->host != urls[0].host || u->port != urls[0].port))
        bad("all paths of one command must be on the same server");
      urls.push_back(*u);
    }
    std::unique_ptr<xdfs::RemoteFs> fsp;
    try {
      fsp = std::make_unique<xdfs::RemoteFs>(xdfs::Endpoint{urls[0].host, urls[0].port}, opt);
      auto& fs = *fsp;
      if (op == "mv") {
        fs->rename(urls[0].path, urls[1].path);
      } else {
        for (const auto& u : urls) {
          if (op == "ls") {
            auto e = fs->stat(u.path);
            if (e.type != xdfs::pathm::Type::directory) {
              print_entry(e, json);
              continue;
            }
            if (urls.size() > 1 && !json) fmt::print("{}:\n", u.path.empty() ? "." : shown(u.path));
            fs->list(u.path, recursive, [&](std::vector<xdfs::pathm::Entry>& chunk) {
              for (const auto& x : chunk) print_entry(x, json);
            });
          } else if (op == "stat") {
            print_entry(fs->stat(u.path), json);
          } else if (op == "mkdir") {
            fs->mkdir(u.path, c.parents);
          } else if (op == "rm") {
            fs->remove(u.path, recursive);
          } else if (op == "sum") {
            fmt::print("{}  {}\n", c.plain_sha256 ? fs->checksum(u.path) : fs->manifest_digest(u.path, opt.block_size),
                       shown(u.path));
          }
        }
      }
      fs.close();
      return 0;
    } catch (const xdfs::TransferError& e) {
      return report_error(e, e.remote(), json);
    } catch (const xdfs::Error& e) {
      return report_error(e, fsp && fsp->remote_error(), json);
    } catch (const std::exception& e) {
      fmt::print(stderr, "xduc: internal error: {}\n", shown(e.what()));
      return 1;
    }
  }

  // SRC and two or more remote DSTs (or --hosts): one file to many hosts, through a chain.
  {
    std::size_t urls = 0;
    while (urls < positional.size() && xdfs::cli::is_url(positional[positional.size() - 1 - urls])) ++urls;
    if (!c.hosts_file.empty() || (urls >= 2 && (urls < positional.size() || !c.files_from.empty()))) {
      std::vector<std::string> hosts(positional.end() - static_cast<std::ptrdiff_t>(urls), positional.end());
      if (!c.hosts_file.empty()) {
        std::string why;
        if (!read_sources(c.hosts_file, hosts, why, "--hosts")) bad(why);
      }
      std::vector<std::string> srcs(positional.begin(), positional.end() - static_cast<std::ptrdiff_t>(urls));
      if (!c.files_from.empty()) {
        std::string why;
        if (!read_sources(c.files_from, srcs, why)) bad(why);
      }
      if (srcs.empty()) bad("a chain to several hosts needs a SRC");
      if (hosts.empty()) bad("--hosts " + shown(c.hosts_file) + " names no host");
      for (const auto& h : hosts)
        if (!xdfs::cli::is_url(h)) bad("'" + shown(h) + "' is not an xdfs:// URL (a chain's hosts are remote)");
      for (const auto& s : srcs) {
        if (s == "-") bad("a chain to several hosts takes files, not standard input");
        if (xdfs::cli::is_url(s)) bad("'" + shown(s) + "': a chain's sources are local files");
        struct stat sb {};
        if (::stat(s.c_str(), &sb) != 0) bad("'" + shown(s) + "': " + std::strerror(errno));
        if (S_ISDIR(sb.st_mode) && !recursive) bad("'" + shown(s) + "' is a directory (-r copies trees)");
        if (!S_ISDIR(sb.st_mode) && !S_ISREG(sb.st_mode)) bad("'" + shown(s) + "' is not a regular file or a directory");
      }
      if (opt.memory) bad("--memory does not go with several hosts");
      if (tree.sync) bad("--sync does not go with several hosts (a chain resumes what a host has)");
      // Every host forwards a block once it has it whole: smaller blocks fill the chain sooner.
      if (!c.block_size_given) opt.block_size = 256 * 1024;
      c.chain_set.recursive = recursive;
      c.chain_set.tree = tree;
      return copy_to_hosts(srcs, hosts, opt, c.chain_set, c.failed_hosts, quiet, json, report.show() == Show::line);
    }
  }
  if (positional.empty() || (positional.size() < 2 && c.files_from.empty()))
    bad("expected SRC... DST (see --help)");
  std::vector<std::string> sources(positional.begin(), positional.end() - 1);
  if (!c.files_from.empty()) {
    std::string why;
    if (!read_sources(c.files_from, sources, why)) bad(why);
    if (sources.empty()) bad("--files-from " + shown(c.files_from) + " names no source");
  }
  const std::string& dst = positional.back();
  const bool up = xdfs::cli::is_url(dst);
  for (const auto& s : sources)
    if (xdfs::cli::is_url(s) == up)
      bad(up ? "'" + shown(s) + "' and DST are both remote; copy between a local and a remote side"
             : "one of SRC and DST must be an xdfs:// URL ('" + shown(s) + "' and '" + shown(dst) + "' are both local)");
  const bool down = !up;
  std::string why;
  auto url = xdfs::cli::parse_url(up ? dst : sources[0], why);
  if (!url) bad(why);
  if (!recursive && (tree.sync || tree.follow)) bad("--sync and --follow go with -r");
  if (up && (sources.size() > 1 || !c.files_from.empty() || recursive) &&
      std::find(sources.begin(), sources.end(), "-") != sources.end())
    bad("standard input ('-') is uploaded alone, to a remote file name, without -r");
  if (sources.size() > 1 || !c.files_from.empty())
    return copy_many(sources, dst, up, *url, opt, tree, recursive, quiet, json, c.retries, report);
  const std::string& src = sources[0];
  if (down && url->path.empty()) bad("'" + shown(src) + "' names no remote file");
  if (up && src == "-" && !opt.memory && (url->path.empty() || url->path.back() == '/'))
    bad("uploading standard input needs a remote file name: xdfs://HOST[:PORT]/DIR/NAME");


  if (recursive) {
    // rsync's rule: a trailing slash on SRC copies its contents, none copies the directory.
    const std::string& from = up ? src : url->path;
    const bool contents = !from.empty() && from.back() == '/';
    std::string remote = url->path;
    std::string local = up ? src : dst;
    if (!contents) {
      if (up) remote = join_path(remote, base_name(src));
      else local = join_path(local, base_name(url->path));
    }
    // The tree's files and bytes of its totals, a large file's own transfer on top of them.
    ProgressFeed feed{report};
    feed.in_tree = true;
    report.begin(true);
    if (report.show() != Show::none) {
      tree.progress = [&feed](const xdfs::pathm::TreeProgress& p) { feed.tree(p); };
      opt.progress = [&feed](const xdfs::Progress& p) { feed.file(p); };
    }
    std::optional<xdfs::Session> session;
    const auto t0 = std::chrono::steady_clock::now();
    unsigned tree_retries = 0;
    // The progress's last word: the tree's files and bytes as the result counts them.
    auto finish = [&](const xdfs::pathm::TreeResult& r) {
      report.finish(feed.plus({r.files, feed.now.files_total, r.bytes, feed.now.bytes_total, feed.now.totals_final}));
    };
    auto summary = [&](const xdfs::pathm::TreeResult& r) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r.swept && !quiet)
        fmt::print(stderr, "xduc: removed {} temporary file{} left by an interrupted download\n", r.swept,
                   r.swept == 1 ? "" : "s");
      if (json)
        fmt::print("{{\"direction\":\"{}\",\"files\":{},\"directories\":{},\"symlinks\":{},\"skipped\":{},"
                   "\"failed\":{},\"bytes\":{},\"seconds\":{:.6f},\"requests\":{},\"channels\":{},"
                   "\"large_files\":{},\"large_bytes\":{},\"large_seconds\":{:.6f},\"retries\":{}}}\n",
                   up ? "upload" : "download", r.files, r.directories, r.symlinks, r.skipped, r.failures.size(), r.bytes,
                   secs, r.requests, opt.channels, r.large_files, r.large_bytes, r.large_seconds, tree_retries);
      else if (!quiet || !r.failures.empty())
        fmt::print(stderr, "xduc: {} files, {} directories, {} symlinks, {} in {:.2f} s ({} up to date or skipped{})\n",
                   r.files, r.directories, r.symlinks, xdfs::cli::human_bytes(static_cast<double>(r.bytes)), secs,
                   r.skipped, r.failures.empty() ? "" : fmt::format(", {} not copied", r.failures.size()));
    };
    try {
      // A lost session is opened again and the copy goes on, skipping (as --sync does) what is
      // already there whole; its large files resume where they were.
      std::optional<xdfs::pathm::TreeResult> done;
      while (!done) {
        session.emplace(xdfs::Endpoint{url->host, url->port}, opt);
        std::optional<xdfs::TransferError> lost;
        try {
          done = up ? xdfs::upload_tree(*session, local, remote, tree, opt)
                    : xdfs::download_tree(*session, remote, local, tree, opt);
        } catch (const xdfs::pathm::TreeError& e) {
          lost = session_lost(e, *session);
          if (!lost || !worth_retrying(*lost, tree_retries, c.retries)) throw;
        } catch (const xdfs::TransferError& e) {
          if (session->usable() || !worth_retrying(e, tree_retries, c.retries)) throw;
          lost = e;
        }
        if (lost) {
          feed.next();  // what the lost session copied stays; the next one skips it (sync)
          wait_to_retry(++tree_retries, c.retries, *lost, report);
          tree.sync = true;
        }
      }
      session->close();
      finish(*done);
      summary(*done);
      return 0;
    } catch (const xdfs::pathm::TreeError& e) {
      // As rsync: everything else was copied; each entry that was not gets its line.
      finish(e.result());
      for (const auto& f : e.result().failures)
        fmt::print(stderr, "xduc: {}{}: {}{}\n", xdfs::to_string(f.code), f.remote ? " (server)" : "",
                   f.message.find(f.path) == std::string::npos ? shown(f.path) + ": " : "", shown(f.message));
      session->close();
      summary(e.result());
      return 1;
    } catch (const xdfs::TransferError& e) {
      report.finish();
      return report_error(e, e.remote(), json);
    } catch (const xdfs::Error& e) {
      report.finish();
      return report_error(e, false, json);
    } catch (const std::exception& e) {
      report.finish();
      fmt::print(stderr, "xduc: internal error: {}\n", shown(e.what()));
      return 1;
    }
  }

  ProgressFeed feed{report};
  report.begin(false);
  if (report.show() != Show::none) opt.progress = [&feed](const xdfs::Progress& p) { feed.file(p); };

  try {
    const xdfs::Endpoint ep{url->host, url->port};
    // A lost session is tried again and resumes where it was (the partial files stay); what
    // went to standard output, a device or a FIFO, or came from a stream, cannot be taken back
    // or read again: the library says so (TransferError::once) and those are not.
    unsigned tried = 0;
    std::optional<xdfs::TransferResult> done;
    while (!done) {
      try {
        done = up ? xdfs::upload(src, ep, url->path, opt) : xdfs::download(ep, url->path, dst, opt);
      } catch (const xdfs::TransferError& e) {
        if (!worth_retrying(e, tried, c.retries)) throw;
        wait_to_retry(++tried, c.retries, e, report);
      }
    }
    const auto& r = *done;
    report.finish(ProgressReport::Counts{1, 1, r.bytes, r.bytes, true});
    if (json) {
      const double bps = r.seconds > 0 ? static_cast<double>(r.bytes) / r.seconds : 0;
      fmt::print("{{\"direction\":\"{}\",\"bytes\":{},\"seconds\":{:.6f},\"bytes_per_second\":{:.0f},\"channels\":{},"
                 "\"setup_seconds\":{:.6f},\"resumed_from\":{},\"bytes_sent\":{},\"retries\":{}{}}}\n",
                 up ? "upload" : "download", r.bytes, r.seconds, bps, r.channels, r.setup_seconds, r.resumed_from,
                 r.bytes - r.resumed_from, tried,
                 r.digest.empty() ? std::string()
                                  : fmt::format(",\"block_size\":{},\"digest_algorithm\":\"{}\",\"digest\":\"{}\"",
                                                opt.block_size, xdfs::manifest::algorithm, r.digest));
    }
    return 0;
  } catch (const xdfs::TransferError& e) {
    report.finish();
    return report_error(e, e.remote(), json);
  } catch (const std::exception& e) {
    report.finish();
    fmt::print(stderr, "xduc: {}\n", shown(e.what()));
    return 1;
  }
}
