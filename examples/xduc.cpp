// xduc: copy a file or a directory tree to or from an xdfsd over n parallel channels, and
// work on remote paths (ls, stat, mkdir, rm, mv, sum).
#include <boost/asio/ip/address.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <chrono>
#include <ctime>
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

const char* usage =
    "usage: xduc [-p N] [--block-size SIZE] [--tcp-window SIZE] [--protect MODE] [-q] [--json] SRC... DST\n"
    "       xduc [OPTIONS] --files-from FILE DST\n"
    "       xduc [-r] [OPTIONS] SRC... xdfs://HOST1/PATH xdfs://HOST2/PATH ... | --hosts FILE\n"
    "       xduc -r [--sync [--checksum]] [--follow] [OPTIONS] SRC DST\n"
    "       xduc ls [-r] | stat | mkdir [--parents] | rm [-r] | sum [--sha256]  xdfs://HOST[:PORT]/PATH ...\n"
    "       xduc mv xdfs://HOST[:PORT]/PATH NEWPATH\n"
    "       xduc get [--listen HOST:PORT] [OPTIONS] xdfs://MASTER[:PORT]/PATH DST\n"
    "       xduc keygen | pubkey\n"
    "Copies files; either every SRC or DST is xdfs://HOST[:PORT]/PATH (default port 7721), all on\n"
    "one server, and all of them travel over one session (its channels are set up once).\n"
    "With one SRC, DST may be a local directory, '-' (standard output) or a device such as\n"
    "/dev/null; with several, DST is a directory (remote: the files go into it). SRC '-' uploads\n"
    "standard input to the remote file DST names, as does a pipe or FIFO: a stream, whose size\n"
    "is known at its end (its digest too); it cannot be resumed or retried.\n"
    "  --files-from FILE      more SRCs, one a line ('-': standard input; empty lines and lines\n"
    "                         starting with # are skipped); remote ones as xdfs:// URLs\n"
    "  -r, --recursive        copy a directory tree (files, empty directories, symlinks, modes,\n"
    "                         mtimes); as with rsync, SRC/ copies the contents of SRC into DST,\n"
    "                         SRC without the slash copies the directory itself into DST\n"
    "  --sync                 skip files whose size and mtime already match at DST\n"
    "  --checksum             with --sync: compare content (SHA-256) instead of mtime\n"
    "  --follow               copy what symlinks point to instead of the symlinks\n"
    "  --workers N            local threads reading or writing files in a tree copy (default 4)\n"
    "  --max-listing SIZE     memory a tree copy may hold for the server's listing (default 2G)\n"
    "  --large-file SIZE      in a tree copy, files of at least SIZE go as transfers of their own\n"
    "                         on the same session, as a single file does (default 64M; 0: never)\n"
    "To many hosts: SRC... then two or more xdfs:// DSTs (or --hosts) go through a chain of those\n"
    "xdfsd servers in the order given: each verifies every block, writes it and forwards it at\n"
    "once, so a file leaves this machine about once and the last host has it about as soon as the\n"
    "first. A host that fails is passed over and named; the others finish. A line per host.\n"
    "Blocks are 256K there unless --block-size says otherwise (a host forwards a block once whole).\n"
    "Several SRCs (and trees, with -r) go into each DST as a directory; a tree's small files travel\n"
    "in packs (one chain each, written out on every host), so every byte leaves here about once.\n"
    "  --hosts FILE           more DSTs for a chain, one xdfs:// URL a line (# comments skipped)\n"
    "  --chains N             N chains fed at once, the hosts dealt among them in turn: for a\n"
    "                         source whose link is N times faster than a host's (default 1)\n"
    "  --chain-min SIZE       a tree's files of at least SIZE get a chain each, smaller ones are\n"
    "                         packed (default 1M, at most 16M counts)\n"
    "  --failed-hosts FILE    where to list the hosts that failed, to give back as --hosts\n"
    "                         (default: xduc-failed-hosts in the current directory)\n"
    "get asks the xdfsd MASTER for its file PATH (with -r or a PATH ending in '/', a set: the\n"
    "regular files under that directory, as one pack, into the directory DST; at most 20000\n"
    "files of at most 16M, 128M in all) and joins that file's chain: this host's own\n"
    "server (with this client's key) is fed by the host before it, verifies every block, writes\n"
    "it and feeds the hosts that ask later, and stays until the master lets it go (no later host\n"
    "needs it). Hosts asking at once or one after another all get the file about once from the\n"
    "master. A lost session to the master is tried again (20 times); what was verified stays.\n"
    "  --listen HOST:PORT     where this host's server listens for its upstream (default\n"
    "                         0.0.0.0:0, a free port; the master connects to this host's address)\n"
    "  --server-log FILE      append this host's server's log lines to FILE\n"
    "ls lists (-r: the whole tree), stat shows one entry, mkdir makes a directory (--parents:\n"
    "with its parents), rm removes (-r: directories with their contents), mv renames within the\n"
    "server. sum prints a file's manifest digest for the block size (what --json reports after\n"
    "a copy; local files too), or with --sha256 the SHA-256 of remote files as sha256sum does.\n"
    "  -p, --parallel N       parallel TCP channels (default 1)\n"
    "  --block-size SIZE      block size, e.g. 1M (default 1M, 4K..64M)\n"
    "  --tcp-window SIZE      socket buffer size (default: kernel autotuning)\n"
    "  --fsync                flush a downloaded file to disk before renaming it into place\n"
    "  --limit-rate RATE      bytes per second for file transfers over all channels together,\n"
    "                         e.g. 100M (binary units: 100 MiB/s; default: no limit)\n"
    "  --no-verify            blocks travel without their SHA-256 digests (docs/manifest.md):\n"
    "                         faster; in clear mode nothing then checks the data\n"
    "  --no-zero-copy         an upload reads every block into memory first, instead of\n"
    "                         sending it from the page cache by sendfile (clear mode)\n"
    "  --debug                debug lines on standard error (zero copy, or why not)\n"
    "  --retries N            a copy whose session is lost (the server gone or restarting, the\n"
    "                         link cut, a timeout) goes on in a new session, resuming where it\n"
    "                         was, up to N times in a row, waiting 1, 2, 4 ... 30 s with jitter; not\n"
    "                         for refusals, missing files, a full disk, a session that never\n"
    "                         opened, a download to '-' or a device, an upload of a stream or\n"
    "                         into a server's FIFO (default 5; 0: never)\n"
    "  --no-resume            start over instead of continuing an interrupted transfer (by\n"
    "                         default a download is written as .NAME.xdfs-partial with a\n"
    "                         record of its verified blocks, kept when the transfer is cut, and\n"
    "                         the same command continues it; uploads resume at the server)\n"
    "  --protect MODE         clear | integrity | private (default private): clear MACs control\n"
    "                         frames only, integrity MACs every frame, private encrypts every frame\n"
    "  --identity FILE        private key (default ~/.config/xdfs/id_x25519, made on first use)\n"
    "  --known-hosts FILE     pinned server keys (default ~/.config/xdfs/known_hosts)\n"
    "  --strict-host-key      refuse a server whose key is not pinned yet (default: pin on first use)\n"
    "keygen makes the key if missing and prints its public half; pubkey prints the public half.\n"
    "Give that line, followed by rw or ro, to the server's authorized_keys.\n"
    "  --memory SIZE          benchmark mode: move SIZE bytes memory to memory, no disk at either\n"
    "                         end (the local path is ignored; xdfsd needs --allow-memory-mode)\n"
    "  -q, --quiet            no progress line\n"
    "  --json                 print a one-line JSON summary at the end\n"
    "  -h, --help             this text\n";

std::atomic<bool> g_cancel{false};

void on_signal(int) { g_cancel.store(true); }

[[noreturn]] void bad(const std::string& why) {
  fmt::print(stderr, "xduc: bad argument: {}\n", why);
  std::exit(2);
}

struct ProgressLine {
  bool shown = false;
  void draw(const xdfs::Progress& p) {
    const double rate = p.seconds > 0 ? static_cast<double>(p.bytes) / p.seconds : 0;
    std::string eta = "--:--";
    if (rate > 0 && p.total >= p.bytes) {
      auto s = static_cast<long long>(static_cast<double>(p.total - p.bytes) / rate);
      eta = fmt::format("{}:{:02}", s / 60, s % 60);
    }
    if (p.stream) {  // its size is known at its end
      fmt::print(stderr, "\r{:>10}  {:>10}/s   ", xdfs::cli::human_bytes(static_cast<double>(p.bytes)),
                 xdfs::cli::human_bytes(rate));
      shown = true;
      return;
    }
    const double pct = p.total ? 100.0 * static_cast<double>(p.bytes) / static_cast<double>(p.total) : 100.0;
    fmt::print(stderr, "\r{:>10} / {:<10} {:5.1f}%  {:>10}/s  ETA {}   ", xdfs::cli::human_bytes(static_cast<double>(p.bytes)),
               xdfs::cli::human_bytes(static_cast<double>(p.total)), pct, xdfs::cli::human_bytes(rate), eta);
    shown = true;
  }
  void end() {
    if (shown) fmt::print(stderr, "\n");
    shown = false;
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

std::string json_escape(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += static_cast<char>(c);
    else if (c < 0x20) o += fmt::format("\\u{:04x}", c);
    else o += static_cast<char>(c);
  }
  return o;
}

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
                  const xdfs::RelaySetOptions& set, const std::string& failed_file, bool quiet, bool json) {
  std::vector<xdfs::RelayTarget> targets;
  for (const auto& u : urls) {
    std::string why;
    auto url = xdfs::cli::parse_url(u, why);
    if (!url) bad(why);
    targets.push_back({{url->host, url->port}, url->path});
  }
  const bool tty = !quiet && ::isatty(STDERR_FILENO);
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
  auto where = [](const xdfs::RelayHost& h) {
    return fmt::format("xdfs://{}:{}/{}", h.target.server.host.find(':') != std::string::npos ? "[" + h.target.server.host + "]"
                                                                                          : h.target.server.host,
                       h.target.server.port, h.target.path);
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
void wait_to_retry(unsigned tried, unsigned retries, const xdfs::TransferError& e) {
  const double base = std::min(30.0, static_cast<double>(1u << std::min(tried - 1, 5u)));
  static std::minstd_rand jitter{std::random_device{}()};
  const double wait = base * std::uniform_real_distribution<double>(0.5, 1.5)(jitter);
  fmt::print(stderr, "xduc: retry {} of {} in {:.1f} s: {}{}: {}\n", tried, retries, wait, xdfs::to_string(e.code()),
             e.remote() ? " (server)" : "", shown(e.context()));
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
              unsigned retries) {
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
  const bool tty = !quiet && ::isatty(STDERR_FILENO);
  ProgressLine line;
  xdfs::TransferOptions o = opt;
  const auto t0 = std::chrono::steady_clock::now();
  std::uint64_t files = 0, trees = 0, bytes = 0, failed = 0, skipped = 0;
  double setup = 0;
  std::optional<xdfs::Session> session_holder;
  session_holder.emplace(ep, opt);
  unsigned tried = 0, retried = 0;  // retries in a row (since a source last went well), in all
  std::vector<std::string> errors;  // for --json: each failure, with its class
  std::vector<std::string> digests;  // for --json: each file's manifest digest
  auto fail_line = [&](const std::string& what, const xdfs::Error& e, bool remote) {
    line.end();
    fmt::print(stderr, "xduc: {}: {}{}: {}\n", shown(what), xdfs::to_string(e.code()), remote ? " (server)" : "",
               shown(e.context()));
    errors.push_back(fmt::format("{{\"source\":\"{}\",{}", json_escape(shown(what)), json_error(e, remote).substr(1)));
    ++failed;
  };
  // A lost session, if e is worth it: waits, says so, and opens a new one. False: no retry (or
  // the user stopped it while it waited).
  auto retry_in_new_session = [&](const xdfs::TransferError& e) {
    if (!worth_retrying(e, tried, retries)) return false;
    line.end();
    try {
      wait_to_retry(++tried, retries, e);
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
    if (tty) o.progress = [&line](const xdfs::Progress& p) { line.draw(p); };
    tried = 0;
    auto this_tree = tree;  // a retry of this source skips what is whole at DST; later sources do not
    for (bool again = true; again;) {  // again: the session was lost and is opened anew
    again = false;
    auto& session = *session_holder;
    try {
      struct stat sb {};
      const bool tree_source = up ? (::stat(src.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode)) : false;
      if (tree_source && !recursive) throw xdfs::TransferError(xdfs::errc::is_directory, "'" + src + "' is a directory (-r copies trees)", false);
      if (tree_source) {
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
          auto t = xdfs::download_tree(session, remote_paths[k], contents ? dst : join_path(dst, name), this_tree, o);
          ++trees;
          files += t.files;
          bytes += t.bytes;
          skipped += t.skipped;
          continue;
        }
        line.end();
        if (files == 0 && trees == 0) setup = r.setup_seconds;
        if (!r.digest.empty())
          digests.push_back(fmt::format("{{\"source\":\"{}\",\"digest\":\"{}\"}}", json_escape(shown(src)), r.digest));
        ++files;
        bytes += r.bytes;
      }
    } catch (const xdfs::pathm::TreeError& e) {
      line.end();
      if (auto lost = session_lost(e, session); lost && retry_in_new_session(*lost)) {
        // Again, skipping what is already whole at DST, as --sync does.
        this_tree.sync = true;
        again = true;
        continue;
      }
      for (const auto& f : e.result().failures) {
        fmt::print(stderr, "xduc: {}{}: {}{}\n", xdfs::to_string(f.code), f.remote ? " (server)" : "",
                   f.message.find(f.path) == std::string::npos ? shown(f.path) + ": " : "", shown(f.message));
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
    if (!session_holder->usable()) {
      ++k;
      break;
    }
  }
  session_holder->close();
  line.end();
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

}  // namespace

int main(int argc, char** argv) {
  xdfs::TransferOptions opt;
  bool quiet = false;
  bool json = false;
  bool plain_sha256 = false;
  unsigned retries = 5;  // --retries: a copy whose session is lost goes on in a new one
  bool recursive = false;
  bool parents = false;
  xdfs::pathm::TreeOptions tree;
  std::vector<std::string> positional;
  std::string files_from;
  std::string hosts_file;
  bool block_size_given = false;
  std::string failed_hosts = "xduc-failed-hosts";
  xdfs::RelaySetOptions chain_set;
  xdfs::PullOptions pull_opt;
  std::string server_log;
  bool listen_given = false;
  std::vector<std::string> args(argv + 1, argv + argc);
  auto value = [&](std::size_t& i) -> const std::string& {
    if (i + 1 >= args.size()) bad(args[i] + " needs a value");
    return args[++i];
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      fmt::print("{}", usage);
      return 0;
    } else if (a == "-p" || a == "--parallel") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 4096);
      if (!v) bad("-p takes a channel count from 1 to 4096");
      opt.channels = static_cast<unsigned>(*v);
    } else if (a == "--block-size") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v || *v < xdfs::wire::min_block_size || *v > xdfs::wire::max_block_size)
        bad("--block-size takes a size from 4K to 64M, e.g. 1M");
      opt.block_size = static_cast<std::uint32_t>(*v);
      block_size_given = true;
    } else if (a == "--tcp-window") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v || *v < 4096 || *v > (1ull << 30)) bad("--tcp-window takes a size from 4K to 1G");
      opt.tcp_window = static_cast<std::uint32_t>(*v);
    } else if (a == "--limit-rate") {
      auto v = xdfs::cli::parse_rate(value(i));
      if (!v) bad("--limit-rate takes a rate in bytes per second from 1K to 1P, e.g. 100M");
      opt.limit_rate = *v;
    } else if (a == "--no-verify") {
      opt.verify = false;
    } else if (a == "--no-zero-copy") {
      opt.zero_copy = false;
    } else if (a == "--debug") {
      opt.debug = [](const std::string& line) { fmt::print(stderr, "xduc: debug: {}\n", xdfs::text::escape(line)); };
    } else if (a == "--no-resume") {
      opt.resume = false;
    } else if (a == "--retries") {
      auto v = xdfs::cli::parse_uint(value(i), 0, 100);
      if (!v) bad("--retries takes a count from 0 to 100");
      retries = static_cast<unsigned>(*v);
    } else if (a == "--sha256") {
      plain_sha256 = true;
    } else if (a == "--fsync") {
      opt.fsync = true;
    } else if (a == "--protect") {
      auto p = xdfs::xsec::parse_protect(value(i));
      if (!p) bad("--protect takes clear, integrity or private");
      opt.protect = *p;
    } else if (a == "--identity") {
      opt.identity_file = value(i);
    } else if (a == "--known-hosts") {
      opt.known_hosts_file = value(i);
    } else if (a == "--strict-host-key") {
      opt.strict_host_key = true;
    } else if (a == "--memory") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v) bad("--memory takes a size, e.g. 4G");
      opt.memory = true;
      opt.memory_size = *v;
    } else if (a == "-r" || a == "--recursive") {
      recursive = true;
    } else if (a == "--parents") {
      parents = true;
    } else if (a == "--sync") {
      tree.sync = true;
    } else if (a == "--checksum") {
      tree.checksum = true;
    } else if (a == "--follow") {
      tree.follow = true;
    } else if (a == "--max-listing") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v || *v < (1u << 20)) bad("--max-listing takes a size of at least 1M, e.g. 4G");
      tree.max_listing = static_cast<std::size_t>(*v);
    } else if (a == "--workers") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 64);
      if (!v) bad("--workers takes a thread count from 1 to 64");
      tree.workers = static_cast<unsigned>(*v);
    } else if (a == "--chains") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 64);
      if (!v) bad("--chains takes a count from 1 to 64");
      chain_set.chains = static_cast<unsigned>(*v);
    } else if (a == "--chain-min") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v || *v == 0) bad("--chain-min takes a size of at least 1 byte, e.g. 1M");
      chain_set.chain_threshold = *v;
    } else if (a == "--large-file") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v) bad("--large-file takes a size, e.g. 64M (0: every file of a tree in path mode)");
      tree.large_file = *v;
    } else if (a == "--files-from") {
      files_from = value(i);
    } else if (a == "--listen") {
      pull_opt.listen = value(i);
      listen_given = true;
    } else if (a == "--server-log") {
      server_log = value(i);
    } else if (a == "--hosts") {
      hosts_file = value(i);
    } else if (a == "--failed-hosts") {
      failed_hosts = value(i);
    } else if (a == "-q" || a == "--quiet") {
      quiet = true;
    } else if (a == "--json") {
      json = true;
    } else if (a.size() > 1 && a[0] == '-' && a != "-") {
      bad("unknown option '" + a + "' (see --help)");
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() == 1 && (positional[0] == "keygen" || positional[0] == "pubkey")) {
    const std::string path =
        opt.identity_file.empty() ? xdfs::xsec::default_config_dir() + "/id_x25519" : opt.identity_file;
    try {
      bool created = false;
      auto key = positional[0] == "keygen" ? xdfs::xsec::load_or_create_key(path, &created) : xdfs::xsec::load_key(path);
      if (created) fmt::print(stderr, "xduc: made a new key in {}\n", path);
      fmt::print("{}\n", xdfs::xsec::format_public(key.public_key));
      return 0;
    } catch (const xdfs::Error& e) {
      fmt::print(stderr, "xduc: {}\n", e.what());
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
  opt.cancel = &g_cancel;
  if (!quiet) opt.notice = [](const std::string& line) { fmt::print(stderr, "xduc: {}\n", line); };

  if (!positional.empty() && positional[0] == "get") {
    if (positional.size() != 3 || !xdfs::cli::is_url(positional[1]) || xdfs::cli::is_url(positional[2]))
      bad("get takes xdfs://MASTER[:PORT]/PATH and a local DST");
    std::string why;
    auto url = xdfs::cli::parse_url(positional[1], why);
    if (!url) bad(why);
    // A directory (-r, or a path ending in '/'): a set, its files into DST.
    pull_opt.set = recursive || url->path.empty() || url->path.back() == '/';
    while (pull_opt.set && url->path.size() > 1 && url->path.back() == '/') url->path.pop_back();
    if (url->path.empty()) url->path = ".";
    if (!block_size_given) opt.block_size = 256u << 10;  // a host forwards a block once it is whole
    {
      // This host's server binds there: an IP address of this host and a port (0: any free one),
      // both given (the server's own default port is not what a pulling host wants).
      std::string host;
      std::uint16_t port = 0, port2 = 0;
      boost::system::error_code ec;
      if (!xdfs::xdsi::parse_host_port(pull_opt.listen, 1, host, port) ||
          !xdfs::xdsi::parse_host_port(pull_opt.listen, 2, host, port2) || port != port2 ||
          (boost::asio::ip::make_address(host, ec), ec))
        bad("--listen takes an IP address and a port, e.g. 0.0.0.0:0 or [::]:7722 (not '" + shown(pull_opt.listen) + "')");
    }
    std::FILE* log = nullptr;
    if (!server_log.empty()) {
      log = std::fopen(server_log.c_str(), "ae");
      if (!log) bad("--server-log '" + shown(server_log) + "': " + std::strerror(errno));
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
    try {
      const auto r = xdfs::pull({url->host, url->port}, url->path, positional[2], opt, pull_opt);
      if (json)
        fmt::print("{{\"pulled\":\"{}\",\"local\":\"{}\",\"set\":{},\"files\":{},\"bytes\":{},\"seconds\":{:.3f},"
                   "\"tries\":{}}}\n",
                   json_escape(shown(url->path)), json_escape(shown(r.local)), pull_opt.set, pull_opt.set ? r.files : 1,
                   r.size, r.seconds, r.tries);
      else if (!quiet)
        fmt::print(stderr, "xduc: {} ({}{}) in {:.2f} s{}\n", shown(r.local),
                   pull_opt.set ? fmt::format("{} files, ", r.files) : std::string(), xdfs::cli::human_bytes(double(r.size)),
                   r.seconds, r.tries > 1 ? fmt::format(", {} sessions to the master", r.tries) : std::string());
      return 0;
    } catch (const xdfs::TransferError& e) {
      return report_error(e, e.remote(), json);
    }
  }
  if (listen_given || !server_log.empty()) bad("--listen and --server-log go with get");

  static const std::vector<std::string> ops{"ls", "stat", "mkdir", "rm", "mv", "sum"};
  if (!positional.empty() && std::find(ops.begin(), ops.end(), positional[0]) != ops.end()) {
    const std::string op = positional[0];
    std::vector<std::string> targets(positional.begin() + 1, positional.end());
    if (targets.empty()) bad(op + " needs an xdfs://HOST[:PORT]/PATH");
    if (plain_sha256 && op != "sum") bad("--sha256 goes with sum");
    // sum of local files: the same manifest digest, computed here.
    if (op == "sum" && !xdfs::cli::is_url(targets[0])) return sum_local(targets, opt.block_size, plain_sha256);
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
            fs->mkdir(u.path, parents);
          } else if (op == "rm") {
            fs->remove(u.path, recursive);
          } else if (op == "sum") {
            fmt::print("{}  {}\n", plain_sha256 ? fs->checksum(u.path) : fs->manifest_digest(u.path, opt.block_size),
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
    if (!hosts_file.empty() || (urls >= 2 && (urls < positional.size() || !files_from.empty()))) {
      std::vector<std::string> hosts(positional.end() - static_cast<std::ptrdiff_t>(urls), positional.end());
      if (!hosts_file.empty()) {
        std::string why;
        if (!read_sources(hosts_file, hosts, why, "--hosts")) bad(why);
      }
      std::vector<std::string> srcs(positional.begin(), positional.end() - static_cast<std::ptrdiff_t>(urls));
      if (!files_from.empty()) {
        std::string why;
        if (!read_sources(files_from, srcs, why)) bad(why);
      }
      if (srcs.empty()) bad("a chain to several hosts needs a SRC");
      if (hosts.empty()) bad("--hosts " + shown(hosts_file) + " names no host");
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
      if (!block_size_given) opt.block_size = 256 * 1024;
      chain_set.recursive = recursive;
      chain_set.tree = tree;
      return copy_to_hosts(srcs, hosts, opt, chain_set, failed_hosts, quiet, json);
    }
  }
  if (positional.empty() || (positional.size() < 2 && files_from.empty()))
    bad("expected SRC... DST (see --help)");
  std::vector<std::string> sources(positional.begin(), positional.end() - 1);
  if (!files_from.empty()) {
    std::string why;
    if (!read_sources(files_from, sources, why)) bad(why);
    if (sources.empty()) bad("--files-from " + files_from + " names no source");
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
  if (up && (sources.size() > 1 || !files_from.empty() || recursive) &&
      std::find(sources.begin(), sources.end(), "-") != sources.end())
    bad("standard input ('-') is uploaded alone, to a remote file name, without -r");
  if (sources.size() > 1 || !files_from.empty())
    return copy_many(sources, dst, up, *url, opt, tree, recursive, quiet, json, retries);
  const std::string& src = sources[0];
  if (down && url->path.empty()) bad("'" + src + "' names no remote file");
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
    const bool tty = !quiet && ::isatty(STDERR_FILENO);
    auto last = std::chrono::steady_clock::now();
    if (tty)
      tree.progress = [&](std::uint64_t files, std::uint64_t bytes) {
        auto now = std::chrono::steady_clock::now();
        if (now - last < std::chrono::milliseconds(200)) return;
        last = now;
        fmt::print(stderr, "\r{:>10} files  {:>10}   ", files, xdfs::cli::human_bytes(static_cast<double>(bytes)));
      };
    // A large file's own transfer shows on the same line.
    std::uint64_t shown_files = 0, shown_bytes = 0;
    if (tty) {
      auto draw = tree.progress;
      tree.progress = [&, draw](std::uint64_t files, std::uint64_t bytes) {
        shown_files = files;
        shown_bytes = bytes;
        draw(files, bytes);
      };
      opt.progress = [&, draw](const xdfs::Progress& p) { draw(shown_files, shown_bytes + p.bytes); };
    }
    std::optional<xdfs::Session> session;
    const auto t0 = std::chrono::steady_clock::now();
    unsigned tree_retries = 0;
    auto summary = [&](const xdfs::pathm::TreeResult& r, bool end_progress) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (tty && end_progress) fmt::print(stderr, "\n");
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
          if (!lost || !worth_retrying(*lost, tree_retries, retries)) throw;
        } catch (const xdfs::TransferError& e) {
          if (session->usable() || !worth_retrying(e, tree_retries, retries)) throw;
          lost = e;
        }
        if (lost) {
          if (tty) fmt::print(stderr, "\n");
          wait_to_retry(++tree_retries, retries, *lost);
          tree.sync = true;
        }
      }
      session->close();
      summary(*done, true);
      return 0;
    } catch (const xdfs::pathm::TreeError& e) {
      // As rsync: everything else was copied; each entry that was not gets its line.
      if (tty) fmt::print(stderr, "\n");
      for (const auto& f : e.result().failures)
        fmt::print(stderr, "xduc: {}{}: {}{}\n", xdfs::to_string(f.code), f.remote ? " (server)" : "",
                   f.message.find(f.path) == std::string::npos ? shown(f.path) + ": " : "", shown(f.message));
      session->close();
      summary(e.result(), false);
      return 1;
    } catch (const xdfs::TransferError& e) {
      if (tty) fmt::print(stderr, "\n");
      return report_error(e, e.remote(), json);
    } catch (const xdfs::Error& e) {
      if (tty) fmt::print(stderr, "\n");
      return report_error(e, false, json);
    } catch (const std::exception& e) {
      if (tty) fmt::print(stderr, "\n");
      fmt::print(stderr, "xduc: internal error: {}\n", shown(e.what()));
      return 1;
    }
  }

  ProgressLine line;
  const bool show = !quiet && ::isatty(STDERR_FILENO) && !(down && dst == "-" && ::isatty(STDOUT_FILENO));
  if (show) opt.progress = [&line](const xdfs::Progress& p) { line.draw(p); };

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
        if (!worth_retrying(e, tried, retries)) throw;
        line.end();
        wait_to_retry(++tried, retries, e);
      }
    }
    const auto& r = *done;
    line.end();
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
    line.end();
    return report_error(e, e.remote(), json);
  } catch (const std::exception& e) {
    line.end();
    fmt::print(stderr, "xduc: {}\n", shown(e.what()));
    return 1;
  }
}
