// xduc: copy a file to or from an xdfsd over n parallel channels.
#include <fmt/core.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <string>
#include <vector>

#include "cli.hpp"
#include "xdfs/client.hpp"
#include "xdfs/wire.hpp"

namespace {

const char* usage =
    "usage: xduc [-p N] [--block-size SIZE] [--tcp-window SIZE] [--protect MODE] [-q] [--json] SRC DST\n"
    "       xduc keygen | pubkey\n"
    "Copies one file; exactly one of SRC and DST is xdfs://HOST[:PORT]/PATH (default port 7721).\n"
    "DST may be a local directory, '-' (standard output) or a device such as /dev/null.\n"
    "  -p, --parallel N       parallel TCP channels (default 1)\n"
    "  --block-size SIZE      block size, e.g. 1M (default 1M, 4K..64M)\n"
    "  --tcp-window SIZE      socket buffer size (default: kernel autotuning)\n"
    "  --fsync                flush a downloaded file to disk before renaming it into place\n"
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

}  // namespace

int main(int argc, char** argv) {
  xdfs::TransferOptions opt;
  bool quiet = false;
  bool json = false;
  std::vector<std::string> positional;
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
    } else if (a == "--tcp-window") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v || *v < 4096 || *v > (1ull << 30)) bad("--tcp-window takes a size from 4K to 1G");
      opt.tcp_window = static_cast<std::uint32_t>(*v);
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
  if (positional.size() != 2) bad("expected SRC and DST (see --help)");
  const std::string& src = positional[0];
  const std::string& dst = positional[1];
  const bool up = xdfs::cli::is_url(dst);
  const bool down = xdfs::cli::is_url(src);
  if (up == down) bad(up ? "both SRC and DST are remote; one must be local" : "one of SRC and DST must be an xdfs:// URL");
  std::string why;
  auto url = xdfs::cli::parse_url(up ? dst : src, why);
  if (!url) bad(why);
  if (down && url->path.empty()) bad("'" + src + "' names no remote file");
  if (up && src == "-" && !opt.memory) bad("uploading from standard input is not supported; name a file");

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  opt.cancel = &g_cancel;
  if (!quiet) opt.notice = [](const std::string& line) { fmt::print(stderr, "xduc: {}\n", line); };

  ProgressLine line;
  const bool show = !quiet && ::isatty(STDERR_FILENO) && !(down && dst == "-" && ::isatty(STDOUT_FILENO));
  if (show) opt.progress = [&line](const xdfs::Progress& p) { line.draw(p); };

  try {
    const xdfs::Endpoint ep{url->host, url->port};
    auto r = up ? xdfs::upload(src, ep, url->path, opt) : xdfs::download(ep, url->path, dst, opt);
    line.end();
    if (json) {
      const double bps = r.seconds > 0 ? static_cast<double>(r.bytes) / r.seconds : 0;
      fmt::print("{{\"direction\":\"{}\",\"bytes\":{},\"seconds\":{:.6f},\"bytes_per_second\":{:.0f},\"channels\":{}}}\n",
                 up ? "upload" : "download", r.bytes, r.seconds, bps, r.channels);
    }
    return 0;
  } catch (const xdfs::TransferError& e) {
    line.end();
    const char* side = e.remote() ? " (server)" : "";
    fmt::print(stderr, "xduc: {}{}: {}\n", xdfs::to_string(e.code()), side, e.context());
    if (e.code() == xdfs::errc::cancelled) return 130;
    return e.code() == xdfs::errc::bad_argument ? 2 : 1;
  } catch (const std::exception& e) {
    line.end();
    fmt::print(stderr, "xduc: {}\n", e.what());
    return 1;
  }
}
