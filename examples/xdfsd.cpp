// xdfsd: the long-running multi-session xDFS server.
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "xdfs/server.hpp"
#include "xdfs/xdfs.hpp"

namespace {

const char* usage =
    "usage: xdfsd --root DIR [--listen HOST:PORT] [options]\n"
    "Serves the files under DIR over xDFS (default listen address 127.0.0.1:7721).\n"
    "  --root DIR               directory to serve; nothing outside it is reachable\n"
    "  --listen HOST:PORT       address to listen on (port 0 picks a free port)\n"
    "  --port-file FILE         write the bound port to FILE once listening\n"
    "  --state-dir DIR          server identity lives here (default ~/.local/state/xdfsd)\n"
    "  --authorized-keys FILE   client keys admitted (default STATE-DIR/authorized_keys), lines of\n"
    "                           'xdfs-x25519 KEY [rw|ro] [subdir=DIR]' (see xduc pubkey)\n"
    "  --relay-peers FILE       xdfsd servers this one may forward a relay chain to (default\n"
    "                           STATE-DIR/relay_peers): a line each, the key as --print-key\n"
    "                           prints it and then the HOST:PORTs users name it by; without it\n"
    "                           this server is only ever a chain's last host\n"
    "  --print-key              print the server's public key and exit\n"
    "  --max-sessions N         authenticated sessions at once (default 64)\n"
    "  --max-channels N         channels per session (default 256)\n"
    "  --max-sessions-per-key N sessions one client key may hold (default 16; sessions=N in\n"
    "                           authorized_keys overrides it for a key)\n"
    "  --max-channels-per-key N channels one client key may hold over its sessions (default\n"
    "                           1024; channels=N in authorized_keys)\n"
    "  --max-pending N          connections not authenticated yet, server-wide (default 1024)\n"
    "  --max-pending-per-address N   ... from one source address, an IPv6 /64 counting as one\n"
    "                           (default 64)\n"
    "  --memory-limit SIZE      memory for all sessions' buffers together (default: a quarter of\n"
    "                           the machine's memory, at most 2G)\n"
    "  --max-file-size SIZE     largest upload (default: what the file system has free)\n"
    "  --min-protect MODE       refuse sessions weaker than clear|integrity|private (default clear)\n"
    "  --max-block-size SIZE    largest block a client may ask for (default 16M)\n"
    "  --ring SIZE              per-session buffer between network and disk (default 32M)\n"
    "  --handshake-timeout SEC  deadline for a connection's opening and handshake (default 5)\n"
    "  --join-timeout SEC       deadline for all n channels to arrive (default 10)\n"
    "  --idle-timeout SEC       end sessions without progress this long (default 60)\n"
    "  --fsync                  fdatasync received files before renaming them into place\n"
    "  --partial-expiry SEC     keep an interrupted upload's partial file and resume record this\n"
    "                           long for its client to continue it (default 86400; 0: uploads\n"
    "                           are not resumable); older ones are swept at start and hourly\n"
    "  --max-rate RATE          bytes per second one session's file transfers may move over all\n"
    "                           its channels, e.g. 100M (binary units; default: no limit)\n"
    "  --max-total-rate RATE    bytes per second all sessions' file transfers together may move\n"
    "                           (each at least --max-block-size per 15 s)\n"
    "  --allow-memory-mode      accept memory-to-memory benchmark sessions (no files touched)\n"
    "  --allow-fifo             an upload to an existing FIFO under the root writes into it, in\n"
    "                           order, for the process that has it open for reading\n"
    "  --disable-mode MODE      refuse operations of MODE: upload, download, path, relay or pull\n"
    "                           (repeatable; pull is off with download or relay too)\n"
    "  --path-workers N         threads per path-mode session doing file-system work (default 4)\n"
    "  --no-zero-copy           read every block a download or relay sends into memory first,\n"
    "                           instead of sending it from the page cache by sendfile\n"
    "  --debug                  debug lines in the log too (zero copy, or why not)\n"
    "  -h, --help               this text\n";

[[noreturn]] void bad(const std::string& why) {
  fmt::print(stderr, "xdfsd: bad argument: {}\n", why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  xdfs::ServerConfig cfg;
  std::string port_file;
  bool print_key = false;
  std::vector<std::string> disabled;  // modes refused (--disable-mode)
  std::vector<std::string> args(argv + 1, argv + argc);
  auto value = [&](std::size_t& i) -> const std::string& {
    if (i + 1 >= args.size()) bad(args[i] + " needs a value");
    return args[++i];
  };
  auto seconds = [&](std::size_t& i) {
    const std::string& name = args[i];
    auto v = xdfs::cli::parse_uint(value(i), 1, 86400);
    if (!v) bad(name + " takes whole seconds from 1 to 86400");
    return std::chrono::milliseconds(*v * 1000);
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      fmt::print("{}", usage);
      return 0;
    } else if (a == "--root") {
      cfg.root = value(i);
    } else if (a == "--listen") {
      cfg.listen = value(i);
    } else if (a == "--port-file") {
      port_file = value(i);
    } else if (a == "--state-dir") {
      cfg.state_dir = value(i);
    } else if (a == "--authorized-keys") {
      cfg.authorized_keys = value(i);
    } else if (a == "--relay-peers") {
      cfg.relay_peers = value(i);
    } else if (a == "--print-key") {
      print_key = true;
    } else if (a == "--max-sessions") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 100000);
      if (!v) bad("--max-sessions takes a number from 1 to 100000");
      cfg.max_sessions = static_cast<unsigned>(*v);
    } else if (a == "--max-sessions-per-key") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 100000);
      if (!v) bad("--max-sessions-per-key takes a number from 1 to 100000");
      cfg.max_sessions_per_key = static_cast<unsigned>(*v);
    } else if (a == "--max-channels-per-key") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 1000000);
      if (!v) bad("--max-channels-per-key takes a number from 1 to 1000000");
      cfg.max_channels_per_key = static_cast<unsigned>(*v);
    } else if (a == "--max-pending") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 1000000);
      if (!v) bad("--max-pending takes a number from 1 to 1000000");
      cfg.max_pending = static_cast<unsigned>(*v);
    } else if (a == "--max-pending-per-address") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 1000000);
      if (!v) bad("--max-pending-per-address takes a number from 1 to 1000000");
      cfg.max_pending_per_address = static_cast<unsigned>(*v);
    } else if (a == "--memory-limit") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v || *v < (16u << 20)) bad("--memory-limit takes a size of at least 16M, e.g. 1G");
      cfg.memory_limit = static_cast<std::size_t>(*v);
    } else if (a == "--max-rate" || a == "--max-total-rate") {
      auto v = xdfs::cli::parse_rate(value(i));
      if (!v) bad(a + " takes a rate in bytes per second from 1K to 1P, e.g. 100M");
      (a == "--max-rate" ? cfg.max_rate : cfg.max_total_rate) = *v;
    } else if (a == "--max-file-size") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v || *v == 0 || *v > xdfs::wire::max_file_size) bad("--max-file-size takes a size from 1 to 4096P, e.g. 100G");
      cfg.max_file_size = *v;
    } else if (a == "--min-protect") {
      auto p = xdfs::xsec::parse_protect(value(i));
      if (!p) bad("--min-protect takes clear, integrity or private");
      cfg.min_protect = static_cast<std::uint8_t>(*p);
    } else if (a == "--max-channels") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 4096);
      if (!v) bad("--max-channels takes a number from 1 to 4096");
      cfg.max_channels = static_cast<unsigned>(*v);
    } else if (a == "--max-block-size") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v || *v < xdfs::wire::min_block_size || *v > xdfs::wire::max_block_size)
        bad("--max-block-size takes a size from 4K to 64M");
      cfg.max_block_size = static_cast<std::uint32_t>(*v);
    } else if (a == "--ring") {
      auto v = xdfs::cli::parse_size(value(i));
      if (!v || *v < (64u << 10) || *v > (4ull << 30)) bad("--ring takes a size from 64K to 4G");
      cfg.ring_bytes = *v;
    } else if (a == "--handshake-timeout") {
      cfg.handshake_timeout = seconds(i);
    } else if (a == "--join-timeout") {
      cfg.join_timeout = seconds(i);
    } else if (a == "--idle-timeout") {
      cfg.idle_timeout = seconds(i);
    } else if (a == "--fsync") {
      cfg.fsync = true;
    } else if (a == "--partial-expiry") {
      auto v = xdfs::cli::parse_uint(value(i), 0, 365ull * 86400);
      if (!v) bad("--partial-expiry takes whole seconds from 0 to 31536000");
      cfg.partial_expiry = std::chrono::seconds(*v);
    } else if (a == "--path-workers") {
      auto v = xdfs::cli::parse_uint(value(i), 1, 64);
      if (!v) bad("--path-workers takes a thread count from 1 to 64");
      cfg.path_workers = static_cast<unsigned>(*v);
    } else if (a == "--allow-memory-mode") {
      cfg.allow_memory_mode = true;
    } else if (a == "--allow-fifo") {
      cfg.allow_fifo = true;
    } else if (a == "--no-zero-copy") {
      cfg.zero_copy = false;
    } else if (a == "--debug") {
      cfg.debug = true;
    } else if (a == "--disable-mode") {
      const std::string& m = value(i);
      if (m != "upload" && m != "download" && m != "path" && m != "relay" && m != "pull")
        bad("--disable-mode takes upload, download, path, relay or pull");
      disabled.push_back(m);
      // A pull serves the file as a download does, through a chain: off with either.
      if (m == "download" || m == "relay") disabled.push_back("pull");
    } else {
      bad("unknown option '" + a + "' (see --help)");
    }
  }
  if (cfg.root.empty()) bad("--root DIR is required (see --help)");
  // A client's largest block at the limit must take well under the idle timeouts.
  for (auto [name, rate] : {std::pair{"--max-rate", cfg.max_rate}, std::pair{"--max-total-rate", cfg.max_total_rate}})
    if (auto why = xdfs::cli::too_slow(name, rate, cfg.max_block_size, "--max-block-size"); !why.empty()) bad(why);
  try {
    auto modes = xdfs::standard_modes();
    std::erase_if(modes, [&](const xdfs::runtime::ModeEntry& e) {
      return std::find(disabled.begin(), disabled.end(), xdfs::to_string(e.mode)) != disabled.end();
    });
    xdfs::Server server(cfg, xdfs::runtime::session_factory(std::move(modes)));
    if (print_key) {
      fmt::print("{}\n", xdfs::xsec::format_public(server.public_key()));
      return 0;
    }
    if (!port_file.empty()) {
      std::string tmp = port_file + ".tmp";
      std::ofstream(tmp) << server.port() << "\n";
      if (std::rename(tmp.c_str(), port_file.c_str()) != 0) bad("cannot write --port-file " + port_file);
    }
    server.run(/*handle_signals=*/true);
  } catch (const xdfs::Error& e) {
    fmt::print(stderr, "xdfsd: {}\n", e.what());
    return e.code() == xdfs::errc::bad_argument ? 2 : 1;
  }
  return 0;
}
