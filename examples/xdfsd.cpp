// xdfsd: the long-running multi-session xDFS server.
//
// Its options are defined once (CLI11): the command line, the TOML config file (--config, the
// same names without the dashes) and a SIGHUP reload all go through that one definition; the
// command line overrides the file.
#include <CLI/CLI.hpp>
#include <fmt/chrono.h>
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <regex>
#include <string>
#include <toml++/toml.h>
#include <vector>

#include "cli.hpp"
#include "metrics_http.hpp"
#include "xdfs/server.hpp"
#include "xdfs/text.hpp"
#include "xdfs/xdfs.hpp"

namespace {

struct Options {
  xdfs::ServerConfig cfg;
  std::string port_file;
  std::string metrics;  // HOST:PORT, empty: off
  std::string log_format = "text";
  bool print_key = false;
  bool check = false;
  std::vector<std::string> disabled;       // modes refused (--disable-mode)
  std::vector<std::string> file_disabled;  // ... by the config file
};

// Settings that only make sense on the command line: not read from the file.
const std::vector<std::string> command_line_only{"config", "check-config", "print-key", "help", "version"};

// The config file in TOML, read by toml++ into CLI11's items: a key is an option's long name
// without its dashes, a value a string, a whole number, true/false (a flag) or an array (an
// option given several times). Unknown keys and other types are errors naming the line.
class TomlConfig : public CLI::Config {
public:
  TomlConfig(const CLI::App& app, const CLI::Option& file, std::vector<std::string>& disabled)
      : app_(app), file_(file), disabled_(disabled) {}

  std::string to_config(const CLI::App*, bool, bool, std::string) const override { return {}; }

  std::vector<CLI::ConfigItem> from_config(std::istream& in) const override {
    const std::string path_ = file_.results().empty() ? "config" : file_.results().back();
    toml::table table;
    try {
      table = toml::parse(in, path_);
    } catch (const toml::parse_error& e) {
      throw CLI::ConfigError(fmt::format("{} line {}: {}", path_, e.source().begin.line, e.description()));
    }
    std::vector<CLI::ConfigItem> items;
    for (auto&& [key, node] : table) {
      const std::string name(key.str());
      const auto line = key.source().begin.line;
      auto fail = [&](const std::string& why) {
        throw CLI::ConfigError(fmt::format("{} line {}: '{}' {}", path_, line, xdfs::text::escape(name), why));
      };
      const CLI::Option* opt = name.size() > 1 ? app_.get_option_no_throw("--" + name) : nullptr;
      if (!opt) fail("is not a setting of xdfsd (see xdfsd --help)");
      if (std::find(command_line_only.begin(), command_line_only.end(), name) != command_line_only.end())
        fail("goes on the command line only");
      CLI::ConfigItem item;
      item.name = name;
      auto value = [&](const toml::node& v) -> std::string {
        if (auto s = v.value_exact<std::string>()) {
          // Names and addresses: a control character (a NUL would cut a path short) is a mistake.
          if (std::any_of(s->begin(), s->end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; }))
            fail("holds a control character");
          return *s;
        }
        if (auto i = v.value_exact<std::int64_t>()) return std::to_string(*i);
        if (auto b = v.value_exact<bool>()) return *b ? "true" : "false";
        fail("takes a string, a whole number or true/false");
        return {};
      };
      if (const auto* arr = node.as_array()) {
        if (opt->get_expected_max() <= 1) fail("takes one value, not an array");
        for (const auto& v : *arr) item.inputs.push_back(value(v));
      } else {
        item.inputs.push_back(value(node));
      }
      // Modes the file disables stay disabled whatever the command line adds (CLI11 would let
      // a --disable-mode there replace the file's list).
      if (name == "disable-mode") disabled_.insert(disabled_.end(), item.inputs.begin(), item.inputs.end());
      items.push_back(std::move(item));
    }
    return items;
  }

private:
  const CLI::App& app_;
  const CLI::Option& file_;  // --config: its name for the errors
  std::vector<std::string>& disabled_;
};

// A value's check, in the words the option's help uses; throws CLI11's validation error.
[[noreturn]] void reject(const std::string& why) { throw CLI::ValidationError(why); }

std::uint64_t in_range(const std::string& name, const std::string& v, std::uint64_t lo, std::uint64_t hi,
                       const std::string& what) {
  auto n = xdfs::cli::parse_uint(v, lo, hi);
  if (!n) reject(fmt::format("--{} takes {} from {} to {}", name, what, lo, hi));
  return *n;
}

// Defines every option on app, writing into o. Used for each parse: at start and at each reload.
void define(CLI::App& app, Options& o) {
  auto& cfg = o.cfg;
  app.description("Serves the files under DIR over xDFS (default listen address 127.0.0.1:7721).");
  app.set_version_flag("--version", xdfs::cli::version_line("xdfsd"), "print the version and the protocol version");
  app.get_formatter()->column_width(34);
  // An option given twice takes its last value, as scripts that add to a command line expect.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto cfg_opt = app.set_config("--config", "", "read settings from this TOML file (the options' long names as keys,\n"
                                                "e.g. max-sessions = 64); the command line overrides it");
  cfg_opt->type_name("FILE");
  // A regular file: a FIFO or a device would hang the start, or a reload on the listener.
  cfg_opt->check(CLI::Validator(
      [](std::string& path) -> std::string {
        struct stat st {};
        if (::stat(path.c_str(), &st) != 0) return "'" + path + "': " + std::strerror(errno);
        if (!S_ISREG(st.st_mode)) return "'" + path + "' is not a regular file";
        if (st.st_size > (1 << 20)) return "'" + path + "' is larger than 1 MiB: not a config file";
        return {};
      },
      ""));
  app.set_help_flag("-h,--help", "this text");
  app.add_flag("--check-config", o.check, "check the settings (and the root, keys and config files) and exit");
  auto text = [&](const char* name, std::string& into, const char* help) {
    return app.add_option(std::string("--") + name, into, help)->type_name("");
  };
  auto fn = [&](const char* name, const char* help, std::function<void(const std::string&)> f) {
    return app.add_option_function<std::string>(std::string("--") + name, std::move(f), help);
  };
  auto count = [&](const char* name, unsigned& into, std::uint64_t lo, std::uint64_t hi, const char* help) {
    fn(name, help, [&into, name, lo, hi](const std::string& v) {
      into = static_cast<unsigned>(in_range(name, v, lo, hi, "a number"));
    });
  };
  auto seconds = [&](const char* name, std::chrono::milliseconds& into, const char* help) {
    fn(name, help, [&into, name](const std::string& v) {
      into = std::chrono::milliseconds(in_range(name, v, 1, 86400, "whole seconds") * 1000);
    });
  };
  text("root", cfg.root, "directory to serve; nothing outside it is reachable")->type_name("DIR");
  text("listen", cfg.listen, "address to listen on (port 0 picks a free port)")->type_name("HOST:PORT");
  text("port-file", o.port_file, "write the bound port to FILE once listening")->type_name("FILE");
  text("state-dir", cfg.state_dir, "server identity lives here (default ~/.local/state/xdfsd)")->type_name("DIR");
  text("authorized-keys", cfg.authorized_keys,
       "client keys admitted (default STATE-DIR/authorized_keys), lines of\n"
       "'xdfs-x25519 KEY [rw|ro] [subdir=DIR]' (see xduc pubkey)")
      ->type_name("FILE");
  text("relay-peers", cfg.relay_peers,
       "xdfsd servers this one may forward a relay chain to (default\n"
       "STATE-DIR/relay_peers): a line each, the key as --print-key prints it\n"
       "and then the HOST:PORTs users name it by; without it this server is\n"
       "only ever a chain's last host")
      ->type_name("FILE");
  app.add_flag("--print-key", o.print_key, "print the server's public key and exit");
  count("max-sessions", cfg.max_sessions, 1, 100000, "authenticated sessions at once (default 64)");
  count("max-channels", cfg.max_channels, 1, 4096, "channels per session (default 256)");
  count("max-sessions-per-key", cfg.max_sessions_per_key, 1, 100000,
        "sessions one client key may hold (default 16; sessions=N in\nauthorized_keys overrides it for a key)");
  count("max-channels-per-key", cfg.max_channels_per_key, 1, 1000000,
        "channels one client key may hold over its sessions (default\n1024; channels=N in authorized_keys)");
  count("max-pending", cfg.max_pending, 1, 1000000, "connections not authenticated yet, server-wide (default 1024)");
  count("max-pending-per-address", cfg.max_pending_per_address, 1, 1000000,
        "... from one source address, an IPv6 /64 counting as one (default 64)");
  fn("memory-limit",
     "memory for all sessions' buffers together (default: a quarter of\nthe machine's memory, at most 2G)",
     [&cfg](const std::string& v) {
       auto n = xdfs::cli::parse_size(v);
       if (!n || *n < (16u << 20)) reject("--memory-limit takes a size of at least 16M, e.g. 1G");
       cfg.memory_limit = static_cast<std::size_t>(*n);
     });
  fn("max-file-size", "largest upload (default: what the file system has free)", [&cfg](const std::string& v) {
    auto n = xdfs::cli::parse_size(v);
    if (!n || *n == 0 || *n > xdfs::wire::max_file_size) reject("--max-file-size takes a size from 1 to 4096P, e.g. 100G");
    cfg.max_file_size = *n;
  });
  fn("min-protect", "refuse sessions weaker than clear|integrity|private (default clear)", [&cfg](const std::string& v) {
    auto p = xdfs::xsec::parse_protect(v);
    if (!p) reject("--min-protect takes clear, integrity or private");
    cfg.min_protect = static_cast<std::uint8_t>(*p);
  });
  fn("max-block-size", "largest block a client may ask for (default 16M)", [&cfg](const std::string& v) {
    auto n = xdfs::cli::parse_size(v);
    if (!n || *n < xdfs::wire::min_block_size || *n > xdfs::wire::max_block_size)
      reject("--max-block-size takes a size from 4K to 64M");
    cfg.max_block_size = static_cast<std::uint32_t>(*n);
  });
  fn("ring", "per-session buffer between network and disk (default 32M)", [&cfg](const std::string& v) {
    auto n = xdfs::cli::parse_size(v);
    if (!n || *n < (64u << 10) || *n > (4ull << 30)) reject("--ring takes a size from 64K to 4G");
    cfg.ring_bytes = *n;
  });
  fn("pull-pack-size",
     "a pulled set (xduc get -r) travels in packs of its small files of at\n"
     "most this size, and each file over 16M on its own (default 128M)",
     [&cfg](const std::string& v) {
       auto n = xdfs::cli::parse_size(v);
       if (!n || *n < (64u << 10) || *n > (128u << 20)) reject("--pull-pack-size takes a size from 64K to 128M");
       cfg.pull_pack_size = *n;
     });
  seconds("handshake-timeout", cfg.handshake_timeout, "deadline for a connection's opening and handshake (default 5)");
  seconds("join-timeout", cfg.join_timeout, "deadline for all n channels to arrive (default 10)");
  seconds("idle-timeout", cfg.idle_timeout, "end sessions without progress this long (default 60)");
  app.add_flag("--fsync", cfg.fsync, "fdatasync received files before renaming them into place");
  fn("partial-expiry",
     "keep an interrupted upload's partial file and resume record this\n"
     "long (seconds) for its client to continue it (default 86400; 0:\n"
     "uploads are not resumable); older ones are swept at start and hourly",
     [&cfg](const std::string& v) {
       cfg.partial_expiry = std::chrono::seconds(in_range("partial-expiry", v, 0, 365ull * 86400, "whole seconds"));
     });
  for (auto [name, into, help] :
       {std::tuple{"max-rate", &cfg.max_rate,
                   "bytes per second one session's file transfers may move over all\n"
                   "its channels, e.g. 100M (binary units; default: no limit)"},
        std::tuple{"max-total-rate", &cfg.max_total_rate,
                   "bytes per second all sessions' file transfers together may move\n"
                   "(each at least --max-block-size per 15 s)"}})
    fn(name, help, [name = std::string(name), into = into](const std::string& v) {
      auto n = xdfs::cli::parse_rate(v);
      if (!n) reject("--" + name + " takes a rate in bytes per second from 1K to 1P, e.g. 100M");
      *into = *n;
    });
  app.add_flag("--allow-memory-mode", cfg.allow_memory_mode, "accept memory-to-memory benchmark sessions (no files touched)");
  app.add_flag("--allow-fifo", cfg.allow_fifo,
               "an upload to an existing FIFO under the root writes into it, in\n"
               "order, for the process that has it open for reading");
  app.add_option("--disable-mode", o.disabled,
                 "refuse operations of MODE: upload, download, path, relay or pull\n"
                 "(repeatable; pull is off with download or relay too)")
      ->type_name("MODE")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  count("path-workers", cfg.path_workers, 1, 64, "threads per path-mode session doing file-system work (default 4)");
  count("block-workers", cfg.block_workers, 0, xdfs::piod::BlockWorkers::max_helpers,
        "helper threads that hash, seal and open blocks beside the disk\n"
        "threads, shared by all sessions (0 to 7; default: one per core but one)");
  app.add_flag("!--no-zero-copy", cfg.zero_copy,
               "every block goes through memory: a download or relay reads it first\n"
               "instead of sending it from the page cache by sendfile, an upload\n"
               "writes it from there instead of splicing it into the file");
  app.add_flag("--loopback-sendfile", cfg.loopback_sendfile,
               "a download or relay to a peer on this host goes by sendfile too (by\n"
               "default it is read first: over loopback that costs less CPU)");
  app.add_flag("--debug", cfg.debug, "debug lines in the log too (zero copy, or why not)");
  text("metrics", o.metrics,
       "serve counters in Prometheus' text format at http://HOST:PORT/metrics\n"
       "(default: off; keep it on a private address)")
      ->type_name("HOST:PORT");
  text("log-format", o.log_format, "text (default) or json: one JSON object a line")
      ->type_name("FORMAT")
      ->check(CLI::IsMember({"text", "json"}));
  app.config_formatter(std::make_shared<TomlConfig>(app, *cfg_opt, o.file_disabled));
}

// The settings from args (the command line without the program's name), checked as a whole.
// Throws CLI::ParseError (CLI::Success and CLI::CallForVersion for --help and --version).
Options parse(const std::vector<std::string>& args) {
  Options o;
  CLI::App app{"", "xdfsd"};
  define(app, o);
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them last first
  app.parse(reversed);
  if (o.cfg.root.empty()) reject("--root DIR is required (see --help)");
  // A client's largest block at the limit must take well under the idle timeouts.
  for (auto [name, rate] : {std::pair{"--max-rate", o.cfg.max_rate}, std::pair{"--max-total-rate", o.cfg.max_total_rate}})
    if (auto why = xdfs::cli::too_slow(name, rate, o.cfg.max_block_size, "--max-block-size"); !why.empty()) reject(why);
  o.disabled.insert(o.disabled.end(), o.file_disabled.begin(), o.file_disabled.end());
  std::sort(o.disabled.begin(), o.disabled.end());
  o.disabled.erase(std::unique(o.disabled.begin(), o.disabled.end()), o.disabled.end());
  // A pull serves the file as a download does, through a chain: off with either.
  for (const auto& m : std::vector<std::string>(o.disabled)) {
    if (m != "upload" && m != "download" && m != "path" && m != "relay" && m != "pull")
      reject("--disable-mode takes upload, download, path, relay or pull");
    if (m == "download" || m == "relay") o.disabled.push_back("pull");
  }
  return o;
}

// What --check-config and a reload check beyond the values: the root is a directory, the key
// files (if there) parse.
std::string check_files(const Options& o) {
  std::string host;
  std::uint16_t port = 0;
  if (!xdfs::xdsi::parse_host_port(o.cfg.listen, 7721, host, port)) return "--listen '" + o.cfg.listen + "' is not HOST:PORT";
  if (!o.metrics.empty() && !std::regex_match(o.metrics, std::regex(R"((\[[0-9a-fA-F:.]+\]|[0-9.]+):[0-9]{1,5})")))
    return "--metrics takes an IP address and a port, e.g. 127.0.0.1:9721, not '" + o.metrics + "'";
  struct stat st {};
  if (::stat(o.cfg.root.c_str(), &st) != 0) return "--root '" + o.cfg.root + "': " + std::strerror(errno);
  if (!S_ISDIR(st.st_mode)) return "--root '" + o.cfg.root + "' is not a directory";
  if (!o.cfg.authorized_keys.empty() && ::access(o.cfg.authorized_keys.c_str(), F_OK) == 0) {
    try {
      (void)xdfs::xsec::AuthorizedKeys::load(o.cfg.authorized_keys);
    } catch (const xdfs::Error& e) {
      return e.what();
    }
  }
  return {};
}

// Log lines: one a line, already escaped by the server; as text or as one JSON object.
std::atomic<bool> g_json_log{false};

void write_log(const std::string& line) noexcept try {
  const auto now = std::chrono::system_clock::now();
  const auto t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  if (g_json_log.load()) {
    const std::string msg = xdfs::cli::json_escape(line);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
    fmt::print(stderr, "{{\"time\":\"{:%Y-%m-%dT%H:%M:%S}.{:03}Z\",\"program\":\"xdfsd\",\"message\":\"{}\"}}\n", tm, ms,
               msg);
  } else {
    fmt::print(stderr, "{:%Y-%m-%dT%H:%M:%S}Z xdfsd: {}\n", tm, line);
  }
  std::fflush(stderr);
} catch (...) {
  // A log that cannot be written (a full disk, a pipe whose reader has gone: SIGPIPE is ignored
  // by Server::run) loses the line, never a thread.
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  Options o;
  try {
    o = parse(args);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      CLI::App app{"", "xdfsd"};
      Options unused;
      define(app, unused);
      if (dynamic_cast<const CLI::CallForVersion*>(&e)) fmt::print("{}\n", e.what());
      else fmt::print("{}", app.help());
      return 0;
    }
    fmt::print(stderr, "xdfsd: bad argument: {}\n", xdfs::text::escape(e.what()));
    return 2;
  }
  g_json_log = o.log_format == "json";
  if (o.check) {
    if (auto why = check_files(o); !why.empty()) {
      fmt::print(stderr, "xdfsd: bad config: {}\n", xdfs::text::escape(why));
      return 2;
    }
    fmt::print("xdfsd: the settings are valid (root {}, listen {})\n", xdfs::text::escape(o.cfg.root),
               xdfs::text::escape(o.cfg.listen));
    return 0;
  }
  o.cfg.log = write_log;
  try {
    auto modes = xdfs::standard_modes();
    std::erase_if(modes, [&](const xdfs::runtime::ModeEntry& e) {
      return std::find(o.disabled.begin(), o.disabled.end(), xdfs::to_string(e.mode)) != o.disabled.end();
    });
    xdfs::Server server(o.cfg, xdfs::runtime::session_factory(std::move(modes)));
    if (o.print_key) {
      fmt::print("{}\n", xdfs::xsec::format_public(server.public_key()));
      return 0;
    }
    std::unique_ptr<xdfs::cli::MetricsEndpoint> metrics;
    if (!o.metrics.empty())
      metrics = std::make_unique<xdfs::cli::MetricsEndpoint>(o.metrics, [&server] { return server.metrics_text(); });
    if (!o.port_file.empty()) {
      std::string tmp = o.port_file + ".tmp";
      std::ofstream(tmp) << server.port() << "\n";
      if (std::rename(tmp.c_str(), o.port_file.c_str()) != 0) {
        fmt::print(stderr, "xdfsd: cannot write --port-file {}: {}\n", xdfs::text::escape(o.port_file), std::strerror(errno));
        return 1;
      }
    }
    if (metrics) write_log("metrics at http://" + metrics->where() + "/metrics");
    // systemd (Type=notify): ready once listening, reloading around SIGHUP, stopping at the end.
    server.on_state([](const std::string& state) { sd_notify(0, state.c_str()); });
    // SIGHUP: the same command line and the file again; what can change while running applies.
    server.on_reload([&args, &o](std::string& why) -> std::optional<xdfs::ServerConfig> {
      try {
        Options next = parse(args);
        // Checked against what will run: the root and the total rate stay until a restart.
        Options effective = next;
        effective.cfg.root = o.cfg.root;
        if (auto bad = check_files(effective); !bad.empty()) {
          why = bad;
          return std::nullopt;
        }
        if (auto bad = xdfs::cli::too_slow("--max-total-rate", o.cfg.max_total_rate, next.cfg.max_block_size,
                                           "--max-block-size");
            !bad.empty()) {
          why = bad + " (the total rate changes only at a restart)";
          return std::nullopt;
        }
        std::vector<std::string> restart;
        auto sorted = [](std::vector<std::string> v) {
          std::sort(v.begin(), v.end());
          v.erase(std::unique(v.begin(), v.end()), v.end());
          return v;
        };
        if (sorted(next.disabled) != sorted(o.disabled)) restart.push_back("disable-mode");
        if (next.metrics != o.metrics) restart.push_back("metrics");
        if (next.port_file != o.port_file) restart.push_back("port-file");
        if (!restart.empty())
          write_log(fmt::format("SIGHUP: not applied, these need a restart: {}", fmt::join(restart, ", ")));
        if (next.log_format != o.log_format) {
          g_json_log = next.log_format == "json";
          write_log("SIGHUP: log-format " + o.log_format + " -> " + next.log_format);
        }
        o.log_format = next.log_format;
        next.cfg.log = write_log;
        return std::move(next.cfg);
      } catch (const CLI::ParseError& e) {
        why = e.what();
        return std::nullopt;
      }
    });
    server.run(/*handle_signals=*/true);
  } catch (const xdfs::Error& e) {
    fmt::print(stderr, "xdfsd: {}\n", xdfs::text::escape(e.what()));
    return e.code() == xdfs::errc::bad_argument ? 2 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "xdfsd: {}\n", xdfs::text::escape(e.what()));
    return 1;
  }
  return 0;
}
