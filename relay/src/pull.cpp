// The pull mode on the master's side: a host asks this xdfsd for a file and is routed into that
// file's chain, which this server runs as the chain's master (relay_file with joins): the first
// host is fed from here, each later one at the chain's end by the host before it, from whatever
// that one has already; a whole host is let go once nobody after it needs it.
//
//   pulling host (xduc get)           this xdfsd (master)
//   NEGO(pull, path, port, name) ──▶  opens the file; the host joins its chain
//                                ◀──  NEGO_REPLY (size, block size, mtime)
//                                     ... registers the host's place on its own server (the
//                                     address this session comes from, that port, pinned to
//                                     this session's key) and feeds it through the chain ...
//                                ◀──  EOFR: its copy is whole, its digest the source's, and
//                                     nobody needs it any more (or EXCEPTION: why not)
//   EOFR                         ──▶  the operation ends; the session is ready for the next
//
// A host whose session ends is out of the chain at once. Every chain (one per file, block size,
// protection and master key) runs on a thread of its own while anyone is in it.
#include <fcntl.h>
#include <sys/stat.h>

#include <boost/asio/ip/address.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/core.h>

#include <dirent.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "xdfs/detail/relay_fsm.hpp"
#include "xdfs/files.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/relay.hpp"
#include "xdfs/relay_registry.hpp"
#include "xdfs/text.hpp"

#include "forward.hpp"
#include "pack.hpp"

namespace xdfs::relay_mode {
namespace {

using relay_detail::Joins;
using relay_detail::Member;

// A set's hosts, each by the last part it asked for: the chain of a part keeps its last host
// while a host of the set that has not asked for that part yet still pulls the set, so that a
// host fallen behind the others (a slow link, a retry) is fed by them, not by the source again.
struct Roster {
  using Clock = std::chrono::steady_clock;
  struct Host {
    std::uint32_t part = 0;
    std::weak_ptr<Member> member;  // its session for that part (none: a part of no bytes)
    Clock::time_point left{};      // first seen without a session (between parts, or out)
    bool failed = false;           // its session for `part` failed: it left the set (or asks again)
  };
  // A host without a session for this long is out of the set (its next part would have come).
  static constexpr std::chrono::seconds between_parts{3};
  // Only a host at most this many parts behind is waited for: one that keeps pace with the
  // others is never further behind (a host holds a part serving and the next), and one parked
  // for good costs the chains of the next parts at most linger_max each, not every chain.
  static constexpr std::uint32_t most_behind = 2;
  static constexpr std::size_t max_hosts = 4096;  // (past it, hosts that left go first)
  std::mutex m;
  std::map<std::string, Host> hosts;  // by its server (address and port)

  // Host `at` asked for `part` (its session: `member`).
  void asked(const std::string& at, std::uint32_t part, const std::shared_ptr<Member>& member) {
    std::lock_guard l(m);
    prune(Clock::now(), false);
    auto it = hosts.find(at);
    if (it == hosts.end()) {
      if (hosts.size() >= max_hosts) prune(Clock::now(), true);
      if (hosts.size() >= max_hosts) return;  // (as many pulling now: this one is not waited for)
      it = hosts.emplace(at, Host{part, member, {}}).first;
    }
    if (part >= it->second.part) it->second = Host{part, member, {}};
  }

  // Host `at`'s session `member` failed (it left, or its server is lost): it is not waited for
  // as one between parts; if it asks again, it is back.
  void failed(const std::string& at, const std::shared_ptr<Member>& member) {
    std::lock_guard l(m);
    if (auto it = hosts.find(at); it != hosts.end() && it->second.member.lock() == member) it->second.failed = true;
  }

  // Is a host still to come to `part`?
  bool awaited(std::uint32_t part) {
    std::lock_guard l(m);
    const auto now = Clock::now();
    bool any = false;
    for (auto& [at, h] : hosts) {
      if (h.part >= part || h.part + most_behind < part || h.failed) continue;
      if (present(h, now)) return true;
      any = any || now - h.left < between_parts;
    }
    return any;
  }

  // Whether `h` has a session now (and it has not failed); if not, since when (marked the
  // first time it is seen so).
  static bool present(Host& h, Clock::time_point now) {
    if (auto mm = h.member.lock(); mm && !mm->gone.load() && !h.failed) return true;
    if (h.left == Clock::time_point{}) h.left = now;
    return false;
  }

  // Hosts out of the set a minute are forgotten (all that left, if `full`, for room).
  void prune(Clock::time_point now, bool full) {
    for (auto it = hosts.begin(); it != hosts.end();) {
      auto& h = it->second;
      const bool out = !present(h, now) && (full || now - h.left >= std::chrono::seconds(60));
      it = out ? hosts.erase(it) : std::next(it);
    }
  }
};

// One file's chain while anyone is in it or joining.
struct Distribution {
  Joins joins;  // (a set's part: its `awaited` holds the set's Roster)
  files::Fd file;  // the source, opened beneath the root of the first host that asked (or a set's pack)
  std::uint64_t size = 0;
  std::vector<std::shared_ptr<Member>> all;  // every host that joined (under joins.m)
  const void* server = nullptr;  // whose chain it is (its RelayRegistry)
  xsec::Key32 starter{};         // the key of the host that started it
};

// Who may start a chain, and how many a server and a key may have running at once.
struct ChainLimits {
  const void* server = nullptr;  // the server's RelayRegistry
  xsec::Key32 key{};
  unsigned per_server = 0;  // its max_sessions
  unsigned per_key = 0;     // the key's sessions at once
};

// The chains running in this process, by what makes them one (see PullOperation::start).
std::mutex registry_m;
std::map<std::string, std::shared_ptr<Distribution>>& registry() {
  static auto* r = new std::map<std::string, std::shared_ptr<Distribution>>;  // outlives every chain's thread
  return *r;
}

// Why a chain under `key` may not start now (nullopt: it may, or it runs already and is
// joined). A server runs at most as many chains at once as it admits sessions, and a key has
// at most as many as its own sessions: a chain outlives the session that started it
// (until its hosts' registrations end, a few seconds for a host that never answers), so a key
// asking for file after file, or one file with block size after block size, would otherwise
// start chains, each a thread and an open source (a set's pack, in the state directory), as
// fast as it opens sessions. (Under registry_m.)
std::optional<std::string> no_room_for_chain_held(const std::string& key, const ChainLimits& limits) {
  const auto& reg = registry();
  if (auto it = reg.find(key); it != reg.end()) {
    std::lock_guard j(it->second->joins.m);
    if (!it->second->joins.closed) return std::nullopt;
  }
  // A chain counts against each key with a host in it now, and, while none is, against the key
  // that started it: not against a starter whose own hosts have left while others' keep it.
  unsigned server = 0, mine = 0;
  for (const auto& [k, d] : reg) {
    if (d->server != limits.server) continue;
    ++server;
    bool any = false, ours = false;
    std::lock_guard j(d->joins.m);
    for (const auto& m : d->all) {
      if (m->gone.load()) continue;
      any = true;
      ours = ours || m->key == limits.key;
    }
    if (ours || (!any && d->starter == limits.key)) ++mine;
  }
  if (server >= limits.per_server)
    return fmt::format("{} pull chains are running on this server, its limit (as many as its sessions): try again "
                       "once one has ended",
                       server);
  if (mine >= limits.per_key)
    return fmt::format("{} pull chains of this key are running, its limit (as many as its sessions): try again once "
                       "one has ended",
                       mine);
  return std::nullopt;
}

std::optional<std::string> no_room_for_chain(const std::string& key, const ChainLimits& limits) {
  std::lock_guard lock(registry_m);
  return no_room_for_chain_held(key, limits);
}

// The roster of the set and plan `key`: the one a chain of its parts keeps, or a new one.
std::shared_ptr<Roster> roster_of(const std::string& key) {
  static auto* rosters = new std::map<std::string, std::weak_ptr<Roster>>;  // (under registry_m)
  std::lock_guard lock(registry_m);
  std::erase_if(*rosters, [](const auto& kv) { return kv.second.expired(); });
  auto& slot = (*rosters)[key];
  auto r = slot.lock();
  if (!r) slot = r = std::make_shared<Roster>();
  return r;
}

// Sets whose pack is being made, by chain key: those asking meanwhile wait for the one pack.
struct Making {
  std::mutex m;
  std::condition_variable ready;
  bool done = false;
  files::Status status = files::Status::ok();
  files::Fd pack;
  std::uint64_t size = 0;
};
std::map<std::string, std::shared_ptr<Making>>& making() {
  static auto* m = new std::map<std::string, std::shared_ptr<Making>>;
  return *m;
}

// The pack being made under `key` is done with (only `mk`, if given).
void forget(const std::string& key, const std::shared_ptr<Making>& mk) {
  std::lock_guard lock(registry_m);
  auto it = making().find(key);
  if (it != making().end() && (!mk || it->second == mk)) making().erase(it);
}

// A running chain's source (a descriptor of its own) and size, if one runs under `key`.
std::optional<std::pair<files::Fd, std::uint64_t>> running(const std::string& key) {
  std::lock_guard lock(registry_m);
  auto it = registry().find(key);
  if (it == registry().end()) return std::nullopt;
  std::lock_guard j(it->second->joins.m);
  if (it->second->joins.closed) return std::nullopt;
  const int fd = ::fcntl(it->second->file.get(), F_DUPFD_CLOEXEC, 3);
  if (fd < 0) return std::nullopt;
  return std::pair{files::Fd(fd), it->second->size};
}

// A set: the regular files under a directory (and, for a host that takes them, its
// directories and symlinks; other kinds are left out), as the walk found them, dealt into parts
// that each travel as a file through a chain of their own: packs (pack.hpp) of the small files,
// of at most `pack_size` bytes and max_pack_files entries, and each file over max_pack_file on
// its own; the directories and symlinks go in part 0 (a pack of version 2), before its files.
// The plan's id names it (its entries' paths, identities, sizes, modes and mtimes, and the
// parts): a host's later parts must come from the plan its first part did.
struct SetFile {
  std::string path;  // relative to the set's directory
  dev_t dev = 0;
  ino_t ino = 0;
  std::uint64_t size = 0;  // a symlink's: its target's length
  std::uint32_t mode = 0;
  std::int64_t mtime_ns = 0;
  pathm::Type type = pathm::Type::file;
};
struct SetPart {
  bool pack = true;
  std::vector<std::size_t> files;  // into SetPlan::files
  std::uint64_t bytes = 0;         // what travels: the pack's size, or the file's
};
struct SetPlan {
  std::vector<SetFile> files;
  bool links = false;           // with the directories and symlinks:
  std::vector<SetFile> others;  // those, parents before what they hold (in part 0)
  std::vector<SetPart> parts;
  std::uint64_t bytes = 0;
  manifest::Digest id{};
};

files::Status plan_set(int dir, std::uint64_t pack_size, bool links, SetPlan& plan) {
  plan.links = links;
  std::uint64_t seen = 0, file_bytes = 0;
  // Entries looked at in all (directories and what is left out too): the walk is bounded.
  const std::uint64_t max_seen = 4 * relay_detail::max_pack_files;
  const auto too_large = [links](const std::string& why) {
    return files::Status{errc::not_supported,
                         fmt::format("a set is at most {} files{} and {} entries ({}): pull it a directory at a time",
                                     relay_detail::max_pack_files, links ? " (and as many directories and symlinks)" : "",
                                     4 * relay_detail::max_pack_files, why)};
  };
  std::function<files::Status(int, const std::string&, unsigned)> walk = [&](int d, const std::string& at,
                                                                               unsigned depth) -> files::Status {
    if (depth > 64) return too_large("it nests more than 64 directories deep");
    const int dd = ::fcntl(d, F_DUPFD_CLOEXEC, 3);
    if (dd < 0) return files::Status::from_errno(errno, "'" + at + "'");
    DIR* list = ::fdopendir(dd);
    if (!list) {
      ::close(dd);
      return files::Status::from_errno(errno, "'" + at + "'");
    }
    std::vector<std::string> names;
    while (auto* e = ::readdir(list)) {
      const std::string n = e->d_name;
      if (n == "." || n == "..") continue;
      if (++seen > max_seen) {
        ::closedir(list);
        return too_large("'" + text::escape(at.empty() ? "." : at) + "' is past that");
      }
      names.push_back(n);
    }
    ::closedir(list);
    std::sort(names.begin(), names.end());
    for (const auto& n : names) {
      const std::string path = at.empty() ? n : at + "/" + n;
      struct stat st {};
      if (::fstatat(d, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // gone meanwhile
      if (links && (S_ISDIR(st.st_mode) || S_ISLNK(st.st_mode))) {
        if (plan.others.size() >= relay_detail::max_pack_files)  // (all of them in part 0)
          return too_large("'" + text::escape(path) + "' is past that");
        if (path.size() > relay_detail::max_pack_path)
          return {errc::not_supported, "'" + text::escape(path.substr(0, 64)) + "...': a set's paths are at most 4096 bytes"};
        SetFile o{path, st.st_dev, st.st_ino, 0, static_cast<std::uint32_t>(st.st_mode & 0777), files::mtime_ns(st),
                  S_ISDIR(st.st_mode) ? pathm::Type::directory : pathm::Type::symlink};
        if (S_ISLNK(st.st_mode)) {
          std::array<char, relay_detail::max_pack_path + 1> target{};
          const ssize_t len = ::readlinkat(d, n.c_str(), target.data(), target.size());
          if (len <= 0 || static_cast<std::size_t>(len) > relay_detail::max_pack_path) continue;  // gone, or no target
          o.size = static_cast<std::uint64_t>(len);
          o.mode = 0777;
        }
        plan.others.push_back(std::move(o));
      }
      if (S_ISDIR(st.st_mode)) {
        const int sub = ::openat(d, n.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (sub < 0) return files::Status::from_errno(errno, "'" + path + "'");
        files::Fd hold(sub);
        if (auto s = walk(sub, path, depth + 1); !s) return s;
        continue;
      }
      if (!S_ISREG(st.st_mode)) continue;
      if (plan.files.size() >= relay_detail::max_pack_files)
        return too_large("'" + text::escape(path) + "' is past that");
      const auto sz = static_cast<std::uint64_t>(st.st_size);
      if (sz > wire::max_file_size / 2 - file_bytes)
        return {errc::not_supported, "a set is at most 2^61 bytes: '" + text::escape(path) + "' is past that"};
      file_bytes += sz;
      if (path.size() > relay_detail::max_pack_path)
        return {errc::not_supported, "'" + text::escape(path.substr(0, 64)) + "...': a set's paths are at most 4096 bytes"};
      plan.files.push_back({path, st.st_dev, st.st_ino, sz, static_cast<std::uint32_t>(st.st_mode & 0777),
                            files::mtime_ns(st)});
    }
    return files::Status::ok();
  };
  if (auto s = walk(dir, "", 0); !s) return s;
  // The parts: the packs of the small files first (so part 0 is always a pack, made afresh,
  // which no host's partial copy of another plan's part 0 can pass for), then each large file
  // alone, in the walk's order.
  std::size_t open_pack = SIZE_MAX;
  std::uint64_t others_bytes = 0;
  for (const auto& o : plan.others) others_bytes += relay_detail::pack_entry_size(o.path.size(), o.size);
  if (others_bytes > pack_size - relay_detail::pack_magic.size())
    return {errc::not_supported,
            fmt::format("the set's directories and symlinks take {} bytes in its first pack, which holds {} "
                        "(xdfsd --pull-pack-size): pull it a directory at a time",
                        others_bytes, pack_size - relay_detail::pack_magic.size())};
  if (links) {  // part 0: the directories and symlinks, then files as they fit
    plan.parts.push_back({true, {}, relay_detail::pack_magic.size() + others_bytes});
    open_pack = 0;
  }
  std::vector<SetPart> large;
  for (std::size_t i = 0; i < plan.files.size(); ++i) {
    const auto& f = plan.files[i];
    if (f.size > relay_detail::max_pack_file) {
      large.push_back({false, {i}, f.size});
    } else {
      const std::uint64_t add = relay_detail::pack_entry_size(f.path.size(), f.size);
      const std::size_t entries = open_pack == SIZE_MAX ? 0
                                  : plan.parts[open_pack].files.size() + (open_pack == 0 ? plan.others.size() : 0);
      if (open_pack == SIZE_MAX || plan.parts[open_pack].bytes + add > pack_size || entries >= relay_detail::max_pack_files) {
        plan.parts.push_back({true, {}, relay_detail::pack_magic.size()});
        open_pack = plan.parts.size() - 1;
      }
      plan.parts[open_pack].files.push_back(i);
      plan.parts[open_pack].bytes += add;
    }
  }
  if (plan.parts.empty()) plan.parts.push_back({true, {}, relay_detail::pack_magic.size()});  // the magic alone
  plan.parts.insert(plan.parts.end(), large.begin(), large.end());
  manifest::BlockHasher h;
  const auto hash = [&h](const SetFile& f) {
    const std::string kind = f.type == pathm::Type::file ? "" : f.type == pathm::Type::directory ? "dir " : "link ";
    const std::string line = fmt::format("{}{} {} {} {} {} {}", kind, f.dev, f.ino, f.size, f.mode, f.mtime_ns, f.path.size());
    h.update(reinterpret_cast<const std::uint8_t*>(line.data()), line.size() + 1);  // with its NUL
    h.update(reinterpret_cast<const std::uint8_t*>(f.path.data()), f.path.size());
  };
  if (links) {
    const std::string head = fmt::format("links {}\n", plan.others.size());
    h.update(reinterpret_cast<const std::uint8_t*>(head.data()), head.size());
    for (const auto& o : plan.others) hash(o);
  }
  for (const auto& part : plan.parts) {
    // (The files' bytes are at most 2^61 in all; a pack adds at most 4118 bytes an entry, and a
    // symlink's target 4096 more, and there are at most 20000: the sum stays below 2^62.)
    plan.bytes += part.bytes;
    const std::string head = fmt::format("{} {}\n", part.pack ? "pack" : "file", part.files.size());
    h.update(reinterpret_cast<const std::uint8_t*>(head.data()), head.size());
    for (auto i : part.files) hash(plan.files[i]);
  }
  plan.id = h.finish();
  return files::Status::ok();
}

// Plans made lately, by what names the set (see PullOperation::start): without them each part's
// request would walk the whole set again. One is used for 2 s after it was made; a change
// within that shows when the part's files are opened (open_planned), or at the next walk.
struct CachedPlan {
  std::shared_ptr<const SetPlan> plan;
  std::chrono::steady_clock::time_point made;
};
std::mutex plans_m;
std::map<std::string, CachedPlan>& plans() {
  static auto* p = new std::map<std::string, CachedPlan>;
  return *p;
}

files::Status plan_of(const std::string& key, int dir, std::uint64_t pack_size, bool links,
                      std::shared_ptr<const SetPlan>& out) {
  const auto now = std::chrono::steady_clock::now();
  constexpr auto lifetime = std::chrono::seconds(2);
  {
    std::lock_guard lock(plans_m);
    std::erase_if(plans(), [&](const auto& kv) { return now - kv.second.made > lifetime; });
    if (auto it = plans().find(key); it != plans().end()) {
      out = it->second.plan;
      return files::Status::ok();
    }
  }
  auto plan = std::make_shared<SetPlan>();
  if (auto s = plan_set(dir, pack_size, links, *plan); !s) return s;
  out = plan;
  std::lock_guard lock(plans_m);
  if (plans().size() < 16) plans()[key] = CachedPlan{plan, now};  // (a few sets at once: bounded)
  return files::Status::ok();
}

// One of the set's files, opened beneath its directory: still the file the plan found.
files::Status open_planned(int dir, const SetFile& f, files::Fd& out) {
  if (auto s = files::open_beneath(dir, f.path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY, 0, out); !s) return s;
  struct stat now {};
  if (::fstat(out.get(), &now) != 0 || !S_ISREG(now.st_mode) || now.st_ino != f.ino || now.st_dev != f.dev ||
      static_cast<std::uint64_t>(now.st_size) != f.size)
    return {errc::size_mismatch, "'" + text::escape(f.path) + "' changed while the set was pulled: pull it again"};
  return files::Status::ok();
}

// A pack part of the plan (`index`), written into an unnamed file in `state` (outside the root;
// it goes with its last descriptor).
files::Status make_pack(int dir, const SetPlan& plan, std::size_t index, const std::string& state, files::Fd& out,
                        std::uint64_t& size) {
  const auto& part = plan.parts[index];
  int fd = ::open(state.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return files::Status::from_errno(errno, "a set's pack in the state directory " + state);
  out = files::Fd(fd);
  const unsigned version = plan.links && index == 0 ? 2 : 1;  // (the others: packs of files)
  bool first = true;
  if (index == 0 && plan.links) {
    for (const auto& o : plan.others) {
      relay_detail::PackEntry pe{o.path, o.mode, o.mtime_ns, 0, o.type, {}};
      if (o.type == pathm::Type::symlink) {
        // Still the symlink the walk found (the same inode, mtime and target's length).
        const auto changed = [&] {
          return files::Status{errc::size_mismatch, "'" + text::escape(o.path) + "' changed while the set was pulled: pull it again"};
        };
        const auto [parent, name] = files::split_parent(o.path);
        files::Fd in;
        if (auto s = files::open_beneath(dir, parent, O_PATH | O_DIRECTORY, 0, in); !s) return s;
        struct stat st {};
        std::array<char, relay_detail::max_pack_path + 1> target{};
        if (::fstatat(in.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISLNK(st.st_mode) ||
            st.st_dev != o.dev || st.st_ino != o.ino || files::mtime_ns(st) != o.mtime_ns)
          return changed();
        const ssize_t len = ::readlinkat(in.get(), name.c_str(), target.data(), target.size());
        if (len < 0 || static_cast<std::uint64_t>(len) != o.size) return changed();
        pe.target.assign(target.data(), static_cast<std::size_t>(len));
        pe.size = o.size;
      }
      if (auto s = relay_detail::pack_append(out.get(), first, pe, -1, version); !s) return s;
      first = false;
    }
  }
  for (auto i : part.files) {
    const auto& f = plan.files[i];
    files::Fd data;
    if (auto s = open_planned(dir, f, data); !s) return s;
    relay_detail::PackEntry pe{f.path, f.mode, f.mtime_ns, f.size, pathm::Type::file, {}};
    if (auto s = relay_detail::pack_append(out.get(), first, pe, data.get(), version); !s) return s;
    first = false;
  }
  if (first) {  // an empty set is a pack of its magic alone
    const auto magic = version < 2 ? relay_detail::pack_magic : relay_detail::pack_magic_2;
    if (::pwrite(out.get(), magic.data(), magic.size(), 0) < 0) return files::Status::from_errno(errno, "a set's pack");
  }
  struct stat st {};
  if (::fstat(out.get(), &st) != 0) return files::Status::from_errno(errno, "a set's pack");
  size = static_cast<std::uint64_t>(st.st_size);
  if (size != part.bytes) return {errc::size_mismatch, "the set changed while it was packed: pull it again"};
  return files::Status::ok();
}

// Every host of a chain that ended hears it, told or not (its pull operation waits for that).
void finalize(Distribution& d, errc code, const std::string& why) {
  std::lock_guard j(d.joins.m);
  d.joins.closed = true;
  d.joins.arriving.clear();
  for (auto& m : d.all) {
    std::lock_guard g(m->m);
    if (m->final) continue;
    m->host.code = code;
    m->host.message = why;
    m->final = true;
  }
}

// Joins `m` to the chain of this file, starting one (on a thread of the server's) if none runs.
// A set's part: `roster` is its set's, `part` its number.
void join(const std::string& key, int fd, std::uint64_t size, const TransferOptions& options,
          const std::shared_ptr<Member>& m, runtime::RelayRegistry& relays,
          const std::function<void(const std::string&)>& log, const std::shared_ptr<Roster>& roster,
          std::uint32_t part, const ChainLimits& limits) {
  std::lock_guard lock(registry_m);
  auto& reg = registry();
  // (Asked before the answer too; sessions starting chains at once may have taken the room since.)
  if (auto why = no_room_for_chain_held(key, limits)) throw TransferError(errc::limit_exceeded, *why, false);
  if (auto it = reg.find(key); it != reg.end()) {
    auto& d = *it->second;
    std::lock_guard j(d.joins.m);
    if (!d.joins.closed && d.size != size)
      throw TransferError(errc::size_mismatch, "the set changed while this host asked for it: ask again", false);
    if (!d.joins.closed) {
      // The same host and file again (it asks again before its last session was seen to end):
      // the earlier one is out.
      for (auto& o : d.all)
        if (o->target.server.host == m->target.server.host && o->target.server.port == m->target.server.port &&
            o->target.path == m->target.path)
          o->gone.store(true);
      d.all.push_back(m);
      d.joins.arriving.push_back(m);
      if (d.joins.wake) d.joins.wake();
      return;
    }
  }
  auto d = std::make_shared<Distribution>();
  const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (dup < 0) throw TransferError(errc_from_errno(errno), "the file to pull: " + std::string(std::strerror(errno)), false);
  d->file = files::Fd(dup);
  d->size = size;
  d->server = limits.server;
  d->starter = limits.key;
  d->all.push_back(m);
  d->joins.arriving.push_back(m);
  d->joins.log = [log](const std::string& line) { log("pull chain: " + line); };
  if (roster) {
    d->joins.awaited = [roster, part] { return roster->awaited(part); };
    d->joins.only_awaited = part > 0;
  }
  auto o = options;
  o.cancel = &relays.stopping;
  // (The thread ends by taking registry_m: registered below first, whatever it does.)
  relays.run_chain([d, key, o, log] {
    // Out of the registry however the body ends (it counts against the limits while there).
    struct Unregister {
      const std::shared_ptr<Distribution>& d;
      const std::string& key;
      ~Unregister() {
        std::lock_guard l(registry_m);
        auto& r = registry();
        if (auto it = r.find(key); it != r.end() && it->second == d) r.erase(it);
      }
    } unregister{d, key};
    try {
      (void)relay_detail::relay_file("/proc/self/fd/" + std::to_string(d->file.get()), {}, o, {}, nullptr, &d->joins);
      finalize(*d, errc::cancelled, "the master's chain ended");
    } catch (const std::exception& e) {
      log(std::string("pull chain: ") + e.what());
      finalize(*d, errc::internal, std::string("the master's chain failed: ") + e.what());
    } catch (...) {
      finalize(*d, errc::internal, "the master's chain failed");
    }
  });
  reg[key] = d;
}

class PullOperation final : public runtime::Operation {
public:
  PullOperation(runtime::OperationEnv& env, runtime::OperationDone done)
      : env_(env), nego_(env.nego), done_(std::move(done)), tick_(env.io), linger_(env.io) {}

  ~PullOperation() override {
    if (member_) member_->gone.store(true);
  }

  void start() override {
    if (!env_.relays) return on(E::local_error, errc::not_supported, "relays (and so pulls) are disabled on this server");
    if (!(nego_.extended_flags & wire::flag_manifest))
      return on(E::local_error, errc::bad_argument,
                "a pull verifies every block: not without the content manifest (--no-verify)");
    if (nego_.channel_count != 1 || env_.channels.size() != 1)
      return on(E::local_error, errc::bad_argument, "a pull's own session has one channel");
    files::Fd fd;
    if (auto st = files::open_beneath(env_.root_fd, nego_.remote_path, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0, fd); !st)
      return on(E::local_error, st.code, st.message);
    struct stat sb {};
    if (::fstat(fd.get(), &sb) != 0) return on(E::local_error, errc_from_errno(errno), "stat '" + nego_.remote_path + "'");
    if (nego_.pull_set && !S_ISDIR(sb.st_mode))
      return on(E::local_error, errc::bad_argument, "'" + nego_.remote_path + "' is not a directory (a set is one)");
    if (!nego_.pull_set && S_ISDIR(sb.st_mode))
      return on(E::local_error, errc::is_directory, "'" + nego_.remote_path + "' is a directory");
    if (!nego_.pull_set && !S_ISREG(sb.st_mode))
      return on(E::local_error, errc::not_regular_file, "'" + nego_.remote_path + "' is not a regular file");
    size_ = static_cast<std::uint64_t>(sb.st_size);
    // The host's own server: where this session comes from (always an address the listener saw,
    // never a name to look up), at the port it named.
    Endpoint at;
    std::uint16_t ignored = 0;
    xdsi::ErrorCode bad;
    if (!xdsi::parse_host_port(env_.peer, 0, at.host, ignored) || (boost::asio::ip::make_address(at.host, bad), bad))
      return on(E::local_error, errc::internal, "cannot tell where this session comes from");
    at.port = nego_.pull_port;
    struct stat rs {};
    if (::fstat(env_.root_fd, &rs) != 0) return on(E::local_error, errc_from_errno(errno), "stat of the root");
    // One chain per file (a set: per directory, as it stood when its chain began), block size
    // and protection, and per root its hosts see (a confined key's subdirectory): hosts of
    // different roots never feed each other nor learn of each other.
    std::string key =
        fmt::format("{}:{}:{}:{}:{}:{}:{}:{}:{}:{}:{}", xsec::fingerprint(env_.relays->server_key().public_key),
                    nego_.pull_set ? "set" : "file", rs.st_dev, rs.st_ino, sb.st_dev, sb.st_ino, size_,
                    files::mtime_ns(sb), nego_.block_size, static_cast<int>(env_.opening.protect),
                    static_cast<int>(env_.opening.cipher));
    const ChainLimits limits{env_.relays, env_.client.key, env_.config.max_sessions,
                             env_.client.max_sessions ? env_.client.max_sessions : env_.config.max_sessions_per_key};
    if (!nego_.pull_set && size_ > 0)  // (an empty file starts no chain)
      if (auto why = no_room_for_chain(key, limits)) return on(E::local_error, errc::limit_exceeded, *why);
    std::string set_path;  // a part that is one file: its path in the set
    std::int64_t mtime_ns = files::mtime_ns(sb);
    std::shared_ptr<const SetPlan> planned;
    std::string roster_key;  // a set's part: its set and plan
    if (nego_.pull_set) {
      // The set's plan (a walk, no file read), then the part asked for: a large file as it is,
      // or a pack: the running chain's, or one made now (reading its files once), by the first
      // to ask while the others asking meanwhile wait for it. A host that cannot take parts
      // gets the set as one pack, if it fits one.
      const std::uint64_t pack_size = nego_.pull_parts ? env_.config.pull_pack_size : relay_detail::max_pack_size;
      if (auto st = plan_of(fmt::format("{}:{}:{}:{}", key, pack_size, nego_.pull_parts, nego_.pull_links), fd.get(),
                            pack_size, nego_.pull_links, planned);
          !st)
        return on(E::local_error, st.code, st.message);
      const auto& plan = *planned;
      if (!nego_.pull_parts && (plan.parts.size() > 1 || !plan.parts[0].pack))
        return on(E::local_error, errc::not_supported,
                  fmt::format("this set travels in {} parts (a pack holds at most {} MiB, files of at most {} MiB), "
                              "and this host takes a set as one pack: upgrade its xduc, or pull the files one by one",
                              std::max<std::size_t>(2, plan.parts.size()), relay_detail::max_pack_size >> 20,
                              relay_detail::max_pack_file >> 20));
      if (nego_.pull_part >= plan.parts.size())
        return on(E::local_error, errc::size_mismatch,
                  fmt::format("the set has {} parts now, none numbered {}: it changed while this host pulled it; pull it again",
                              plan.parts.size(), nego_.pull_part));
      if (nego_.pull_part > 0 && !std::equal(plan.id.begin(), plan.id.end(), nego_.pull_plan.begin(), nego_.pull_plan.end()))
        return on(E::local_error, errc::size_mismatch,
                  "the set changed since this host began to pull it: pull it again");
      const auto& part = plan.parts[nego_.pull_part];
      roster_key = fmt::format("{}:{}", key, manifest::hex(plan.id));
      key = fmt::format("{}:{}", roster_key, nego_.pull_part);
      // (Before a pack is made for it.)
      if (auto why = no_room_for_chain(key, limits)) return on(E::local_error, errc::limit_exceeded, *why);
      if (auto r = running(key)) {
        fd = std::move(r->first);
        size_ = r->second;
      } else if (!part.pack) {
        files::Fd file;
        if (auto st = open_planned(fd.get(), plan.files[part.files[0]], file); !st)
          return on(E::local_error, st.code, st.message);
        fd = std::move(file);
        size_ = part.bytes;
      } else {
        std::shared_ptr<Making> mk;
        bool mine = false;
        {
          std::lock_guard lock(registry_m);
          auto& slot = making()[key];
          if (!slot) {
            slot = std::make_shared<Making>();
            mine = true;
          }
          mk = slot;
        }
        if (mine) {
          files::Fd pack;
          std::uint64_t size = 0;
          auto st = make_pack(fd.get(), plan, nego_.pull_part, env_.config.state_dir, pack, size);
          std::lock_guard lock(mk->m);
          mk->status = st;
          mk->pack = std::move(pack);
          mk->size = size;
          mk->done = true;
          mk->ready.notify_all();
        }
        std::unique_lock lock(mk->m);
        if (!mk->ready.wait_for(lock, std::chrono::seconds(120), [&] { return mk->done; }))
          return on(E::local_error, errc::timeout, "the set's pack was not made within 120 s");
        if (!mk->status) {
          lock.unlock();
          forget(key, mk);  // the next to ask tries again
          return on(E::local_error, mk->status.code, mk->status.message);
        }
        const int dup = mk->pack ? ::fcntl(mk->pack.get(), F_DUPFD_CLOEXEC, 3) : -1;
        if (dup < 0) return on(E::local_error, errc_from_errno(errno), "the set's pack");
        fd = files::Fd(dup);
        size_ = mk->size;
      }
      if (!part.pack) {
        set_path = plan.files[part.files[0]].path;
        mtime_ns = plan.files[part.files[0]].mtime_ns;
      }
    }
    wire::NegotiationReply reply;
    reply.block_size = nego_.block_size;
    reply.file_size = size_;
    reply.mtime_ns = mtime_ns;
    if (nego_.pull_set && nego_.pull_parts) {
      reply.set_parts = static_cast<std::uint32_t>(planned->parts.size());
      reply.set_plan.assign(planned->id.begin(), planned->id.end());
      reply.set_path = set_path;
      reply.set_bytes = planned->bytes;
    }
    env_.channels[0]->send_control(wire::ChannelEvent::nego_reply, wire::encode(reply));
    env_.log(fmt::format("session {} pull of {}'{}'{} ({} bytes) for {} at {}", env_.id.short_hex(),
                         nego_.pull_set ? "the set " : "", text::escape(nego_.remote_path),
                         planned && nego_.pull_parts ? fmt::format(", part {} of {}", nego_.pull_part + 1, planned->parts.size()) : "",
                         size_, env_.client.fingerprint, text::escape(env_.peer)));
    host_at_ = fmt::format("{}:{}", at.host, at.port);
    if (planned && nego_.pull_parts) roster_ = roster_of(roster_key);
    if (size_ == 0) {  // nothing to route: the host makes it empty
      if (roster_) roster_->asked(host_at_, nego_.pull_part, nullptr);
      return on(E::release);
    }
    member_ = std::make_shared<Member>();
    member_->target = RelayTarget{at, nego_.pull_name};
    member_->key = env_.client.key;
    TransferOptions o;
    o.channels = 2;
    o.block_size = nego_.block_size;
    o.protect = static_cast<xsec::Protect>(env_.opening.protect);
    o.identity_secret = env_.relays->server_key().secret;
    o.idle_timeout = env_.config.idle_timeout;
    o.verify = true;
    o.limit_rate = env_.config.max_rate;  // the source's feed, as any one session's transfers
    o.zero_copy = env_.config.zero_copy;
    o.loopback_sendfile = env_.config.loopback_sendfile;
    if (env_.config.debug)
      o.debug = [log = env_.log, path = nego_.remote_path](const std::string& line) {
        log(fmt::format("pull of '{}' debug: {}", path, line));
      };
    on(E::accepted);  // (answered: from here a failure is an abort, never a refusal)
    try {
      join(key, fd.get(), size_, o, member_, *env_.relays, env_.log, roster_, nego_.pull_part, limits);
      // (Only now: until it is among the chain's arrivals, its last part keeps this chain's
      // last host waiting for it.)
      if (roster_) roster_->asked(host_at_, nego_.pull_part, member_);
    } catch (const TransferError& e) {
      on(E::local_error, e.code(), e.what());
    } catch (const std::exception& e) {
      on(E::local_error, errc::internal, e.what());
    }
    // A set's pack now lives with its chain: the next to ask takes it from there.
    if (nego_.pull_set) forget(key, nullptr);
  }

  void abort(errc code, const std::string& message) override { on(E::local_error, code, message); }

  std::uint64_t bytes() const noexcept override { return 0; }

private:
  using E = relay_fsm::RelayEvent;
  using A = relay_fsm::RelayAction;

  // What happens goes through the table (relay_fsm, pull-master); the row's action runs here.
  void on(E e, errc code = errc::ok, const std::string& why = {}) {
    if (machine_.finished()) return;
    auto a = machine_.fire(e);
    if (!a) return on(E::local_error, errc::state_violation, machine_.why());
    switch (*a) {
      case A::watch:
        read();
        return tick();
      case A::send_eofr: return send_eofr();
      case A::finish:
        tick_.cancel();
        if (member_) member_->gone.store(true);
        return done_(runtime::OperationResult{errc::ok, {}, false, false, true});
      case A::refuse: return done_(runtime::OperationResult{code, why, false, true, true});
      case A::tell_and_drop:
      case A::abort: {
        tick_.cancel();
        if (member_ && roster_) roster_->failed(host_at_, member_);  // (not awaited as between parts)
        if (member_) member_->gone.store(true);
        xdsi::tell_and_close(env_.channels, wire::ExceptionHeader{code, why, 0, 0}, linger_, std::chrono::seconds(2));
        return done_(runtime::OperationResult{code, why, e == E::peer_exception, false, false});
      }
      default: return on(E::local_error, errc::internal, "pull-master: no such action here");
    }
  }

  // Every 20 ms: has the chain let this host go, or put it out?
  void tick() {
    if (machine_.finished()) return;
    bool final = false;
    RelayHost h;
    {
      std::lock_guard lock(member_->m);
      final = member_->final;
      if (final) h = member_->host;
    }
    if (final && h.ok) return on(E::release);
    if (final) return on(E::give_up, h.code == errc::ok ? errc::internal : h.code, h.message);
    tick_.expires_after(std::chrono::milliseconds(20));
    tick_.async_wait([this](const xdsi::ErrorCode& ec) {
      if (!ec) tick();
    });
  }

  // The host's copy is whole and verified (or empty): EOFR; its own EOFR ends the operation,
  // within 10 s.
  void send_eofr() {
    tick_.cancel();
    wire::FrameHeader h;
    h.event = wire::ChannelEvent::eofr;
    h.offset = size_;
    env_.channels[0]->send(h, std::vector<std::uint8_t>{});
    tick_.expires_after(std::chrono::seconds(10));
    tick_.async_wait([this](const xdsi::ErrorCode& ec) {
      if (!ec) on(E::timeout, errc::timeout, "the pulling host did not end its pull within 10 s");
    });
    if (!reading_) read();
  }

  // The host says nothing but its EOFR (after ours: done; before: it leaves).
  void read() {
    reading_ = true;
    auto& ch = *env_.channels[0];
    ch.async_read_header([this, &ch](const xdsi::ErrorCode& ec, const wire::FrameHeader& h) {
      if (machine_.finished()) return;
      if (ec) {
        auto f = ch.failure(ec, "client");
        return on(E::channel_lost, f.code, f.message);
      }
      if (h.event == wire::ChannelEvent::eofr && h.length == 0) {
        if (machine_.state() == relay_fsm::RelayState::placed)
          return on(E::local_error, errc::cancelled, "the pulling host left before its copy was whole");
        return on(E::ended);
      }
      on(E::local_error, errc::protocol_error, fmt::format("{} from a pulling host", wire::to_string(h.event)));
    });
  }

  runtime::OperationEnv& env_;
  wire::Negotiation nego_;
  runtime::OperationDone done_;
  boost::asio::steady_timer tick_;
  boost::asio::steady_timer linger_;
  std::shared_ptr<Member> member_;
  std::shared_ptr<Roster> roster_;  // a set's part: its set's
  std::string host_at_;             // the host's server, as the roster names it
  std::uint64_t size_ = 0;
  bool reading_ = false;  // the host's EOFR is awaited (one read at a time)
  relay_fsm::RelayMachine machine_{relay_fsm::RelaySide::pull_master};
};

}  // namespace

runtime::ModeEntry pull_mode() {
  return runtime::ModeEntry{Mode::pull, [](runtime::OperationEnv& env, runtime::OperationDone done) {
                              return std::unique_ptr<runtime::Operation>(new PullOperation(env, std::move(done)));
                            }};
}

}  // namespace xdfs::relay_mode
