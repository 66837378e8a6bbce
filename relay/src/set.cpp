// Several files and trees to many hosts: each file of at least the chain threshold goes through
// relay chains (relay(), one or several chains of the hosts, a few files at once); a tree's
// directories, symlinks and smaller files go to each host in path mode, where a chain's setup
// would cost more than their bytes; then each host's attributes are set, as a tree upload does.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/core.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "xdfs/manifest.hpp"
#include "xdfs/relay.hpp"
#include "xdfs/remote_fs.hpp"
#include "xdfs/xsec.hpp"

#include "forward.hpp"
#include "pack.hpp"

namespace xdfs {
namespace {

using Clock = std::chrono::steady_clock;

using relay_detail::base_name;

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

// One file through the chains: where it goes on each host (by the host's index in the targets).
// Or a pack of a tree's small files (pack.hpp), made when its turn comes: `local` is the tree.
struct Job {
  std::string local;
  std::uint64_t size = 0;  // its files' bytes
  std::vector<std::pair<std::size_t, std::string>> to;
  std::vector<relay_detail::PackEntry> pack;
};

// A tree source as one host takes it: where it goes there, and what its path part left to the chains.
struct TreePart {
  std::size_t source = 0;
  std::string local, remote;
  pathm::LargeFiles large;
};

// A pack's bytes and files at most: a chain's setup for every 32 MiB or 20000 small files.
constexpr std::uint64_t pack_bytes = std::uint64_t(32) << 20;
constexpr std::size_t pack_files = 20000;

// Writes a pack of `job`'s files (read under job.local) to a temporary file, removed with it.
struct PackFile {
  std::string path;
  files::Fd fd;
  manifest::Digest digest{};  // its manifest digest at the relay's block size: the hosts check it
  ~PackFile() {
    if (!path.empty()) ::unlink(path.c_str());
  }
  files::Status make(const Job& job, std::uint32_t block_size, const std::atomic<bool>* cancel) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/xdfs-pack-XXXXXX";
    const int f = ::mkostemp(templ.data(), O_CLOEXEC);
    if (f < 0) return files::Status::from_errno(errno, "make a pack in " + templ);
    path = templ;
    fd = files::Fd(f);
    bool first = true;
    for (const auto& e : job.pack) {
      const std::string from = join(job.local, e.path);
      files::Fd in(::open(from.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
      struct stat sb {};
      if (!in || ::fstat(in.get(), &sb) != 0) return files::Status::from_errno(errno, "open '" + from + "'");
      if (!S_ISREG(sb.st_mode) || static_cast<std::uint64_t>(sb.st_size) != e.size)
        return {errc::size_mismatch, "'" + from + "' changed since the tree was listed"};
      if (auto s = relay_detail::pack_append(fd.get(), first, e, in.get()); !s) return s;
      first = false;
    }
    struct stat sb {};
    if (::fstat(fd.get(), &sb) != 0) return files::Status::from_errno(errno, "stat " + path);
    const auto m = manifest::of_file(fd.get(), static_cast<std::uint64_t>(sb.st_size), block_size, cancel);
    if (m.code != errc::ok) return {m.code, m.message};
    digest = m.digest;
    return files::Status::ok();
  }
};

// Everything known of one host, over every part of the set.
struct HostState {
  RelayHost host;
  bool failed = false;
  std::uint64_t done = 0;                         // bytes of the parts it finished
  std::uint64_t tree_bytes = 0;                   // of those, its path parts'
  std::map<std::size_t, std::uint64_t> running;   // job -> bytes verified so far
  Clock::time_point last{};
  std::vector<TreePart> trees;
  // Its path-mode session, kept from its trees' path parts to their end: the directories it
  // made there get their modes from it (a server sets modes only on what the session made).
  std::unique_ptr<RemoteFs> fs;
};

}  // namespace

RelayResult relay_set(const std::vector<std::string>& sources, const std::vector<RelayTarget>& targets,
                      const TransferOptions& options, const RelaySetOptions& set,
                      const std::function<void(const std::vector<RelayHost>&)>& progress) {
  if (sources.empty()) throw TransferError(errc::bad_argument, "a relay needs a source", false);
  const unsigned chains = std::max(1u, set.chains);
  // One file in one chain: the chain as it is (its digest and notes are the result's own).
  struct stat sb {};
  const bool one_file = sources.size() == 1 && ::stat(sources[0].c_str(), &sb) == 0 && S_ISREG(sb.st_mode);
  if (one_file && chains == 1) return relay(sources[0], targets, options, progress);

  const auto t0 = Clock::now();
  std::mutex m;
  std::vector<HostState> hosts(targets.size());
  for (std::size_t i = 0; i < targets.size(); ++i) hosts[i].host.target = targets[i];
  RelayResult result;
  auto fail = [&](std::size_t h, errc code, const std::string& what, const std::string& why) {
    auto& s = hosts[h];
    if (s.failed) return;
    s.failed = true;
    s.host.code = code == errc::ok ? errc::peer_aborted : code;
    s.host.message = what.empty() ? why : "'" + what + "': " + why;
  };

  // The jobs: files named as sources, then each tree's large files (as each host's path part
  // listed them). A tree source needs recursive; a file source goes in the targets' directories
  // (or, alone, where each target says).
  std::vector<Job> jobs;
  std::vector<std::size_t> tree_sources;
  for (std::size_t k = 0; k < sources.size(); ++k) {
    const auto& src = sources[k];
    if (::stat(src.c_str(), &sb) != 0)
      throw TransferError(errc_from_errno(errno), "'" + src + "': " + std::strerror(errno), false);
    if (S_ISDIR(sb.st_mode)) {
      if (!set.recursive) throw TransferError(errc::is_directory, "'" + src + "' is a directory (-r copies trees)", false);
      tree_sources.push_back(k);
      continue;
    }
    if (!S_ISREG(sb.st_mode)) throw TransferError(errc::not_regular_file, "'" + src + "' is not a regular file", false);
    Job j;
    j.local = src;
    j.size = static_cast<std::uint64_t>(sb.st_size);
    for (std::size_t h = 0; h < targets.size(); ++h) {
      const auto& dir = targets[h].path;
      j.to.emplace_back(h, sources.size() == 1 && !dir.empty() && dir.back() != '/' ? dir : join(dir, base_name(src)));
    }
    jobs.push_back(std::move(j));
  }

  SessionOptions control = options;
  control.channels = std::max<std::uint32_t>(1, std::min<std::uint32_t>(options.channels, 4));
  pathm::TreeOptions tree = set.tree;
  tree.progress = nullptr;
  const std::uint64_t threshold = std::clamp<std::uint64_t>(set.chain_threshold, 1, relay_detail::max_pack_file + 1);
  std::uint64_t path_bytes = 0;  // the path parts' bytes, over every host (each went from here)
  // Each host's path part, all hosts at once (one that does not answer takes its connect timeout).
  if (!tree_sources.empty()) {
    std::vector<std::thread> threads;
    for (std::size_t h = 0; h < targets.size(); ++h)
      threads.emplace_back([&, h] {
        std::vector<TreePart> parts;
        std::uint64_t bytes = 0;
        try {
          auto fs = std::make_unique<RemoteFs>(targets[h].server, control);
          for (auto k : tree_sources) {
            const auto& src = sources[k];
            TreePart part;
            part.source = k;
            part.local = src;
            part.remote = src.back() == '/' ? targets[h].path : join(targets[h].path, base_name(src));
            part.large.threshold = 1;  // every file that is not empty: by chain, or in a pack
            auto r = (*fs)->upload_tree(src, part.remote, tree, &part.large);
            bytes += r.bytes;
            if (!r.failures.empty() || r.session_failure) {
              const auto& f = r.session_failure ? *r.session_failure : r.failures.front();
              std::lock_guard lock(m);
              fail(h, f.code, f.path, f.message);
              path_bytes += bytes;
              return;
            }
            parts.push_back(std::move(part));
          }
          std::lock_guard lock(m);
          hosts[h].fs = std::move(fs);
        } catch (const Error& e) {
          std::lock_guard lock(m);
          fail(h, e.code(), {}, e.context());
          path_bytes += bytes;
          return;
        } catch (const std::exception& e) {
          std::lock_guard lock(m);
          fail(h, errc::internal, {}, e.what());
          path_bytes += bytes;
          return;
        }
        std::lock_guard lock(m);
        path_bytes += bytes;
        hosts[h].done += bytes;
        hosts[h].tree_bytes = bytes;
        hosts[h].trees = std::move(parts);
      });
    for (auto& t : threads) t.join();
    // The trees' files as jobs: each large one a job of its own, to every host whose part
    // listed it; the small ones of each tree in packs, to every host that has that tree's part.
    std::map<std::string, std::size_t> by_local;
    std::map<std::size_t, std::map<std::string, relay_detail::PackEntry>> small;  // by source, by path
    std::map<std::size_t, std::vector<std::pair<std::size_t, std::string>>> tree_hosts;  // source -> (host, remote)
    std::vector<Job> large_jobs;
    for (std::size_t h = 0; h < targets.size(); ++h)
      for (const auto& part : hosts[h].trees) {
        tree_hosts[part.source].emplace_back(h, part.remote);
        for (const auto& e : part.large.files) {
          if (e.size < threshold) {
            small[part.source].emplace(e.path, relay_detail::PackEntry{e.path, e.mode & 0777, e.mtime_ns, e.size});
            continue;
          }
          const auto local = join(part.local, e.path);
          auto [it, added] = by_local.emplace(local, large_jobs.size());
          if (added) {
            Job j;
            j.local = local;
            j.size = e.size;
            large_jobs.push_back(std::move(j));
          }
          large_jobs[it->second].to.emplace_back(h, join(part.remote, e.path));
        }
      }
    for (auto& [k, entries] : small) {
      Job j;
      auto close_pack = [&] {
        if (j.pack.empty()) return;
        std::array<std::uint8_t, 8> tag{};
        xsec::random_fill(tag);
        std::string name = ".xdfs-pack-";
        for (auto b : tag) name += fmt::format("{:02x}", b);
        j.local = sources[k];
        for (const auto& [h, remote] : tree_hosts[k]) j.to.emplace_back(h, join(remote, name));
        jobs.push_back(std::move(j));
        j = Job{};
      };
      for (auto& [path, e] : entries) {
        if (j.size + e.size > pack_bytes || j.pack.size() >= pack_files) close_pack();
        j.size += e.size;
        j.pack.push_back(std::move(e));
      }
      close_pack();
    }
    for (auto& j : large_jobs) jobs.push_back(std::move(j));
  }

  // The jobs, several at a time; each in `chains` chains (the hosts dealt in turn), all of a
  // job's chains at once. A host that failed is left out of the jobs that start after.
  std::uint64_t source_bytes = 0, size = 0;
  std::vector<std::string> notes;
  std::string digest;
  auto last_progress = Clock::now();
  auto show = [&] {  // under m
    if (!progress) return;
    const auto now = Clock::now();
    if (now - last_progress < std::chrono::milliseconds(200)) return;
    last_progress = now;
    std::vector<RelayHost> v;
    for (auto& s : hosts) {
      v.push_back(s.host);
      v.back().verified = s.done;
      for (auto& [j, b] : s.running) v.back().verified += b;
      v.back().final = s.failed;
    }
    progress(v);
  };
  // One job: its chains at once, each a relay() of its own.
  auto run_job = [&](std::size_t ji, const std::vector<std::vector<std::pair<std::size_t, std::string>>>& groups) {
    const auto& job = jobs[ji];
    const bool packed = !job.pack.empty();
    PackFile pack;
    if (packed)
      if (auto s = pack.make(job, options.block_size, options.cancel); !s) {
        std::lock_guard lock(m);
        for (const auto& g : groups)
          for (const auto& [h, path] : g) fail(h, s.code, job.local, "a pack of its small files: " + s.message);
        return;
      }
    const std::string& file = packed ? pack.path : job.local;
    std::vector<std::future<void>> running;
    for (const auto& g : groups) {
      if (g.empty()) continue;
      running.push_back(std::async(std::launch::async, [&] {
        std::vector<RelayTarget> to;
        for (const auto& [h, path] : g) to.push_back({targets[h].server, path});
        auto on = [&](const std::vector<RelayHost>& v) {
          std::lock_guard lock(m);
          for (std::size_t i = 0; i < v.size() && i < g.size(); ++i) hosts[g[i].first].running[ji] = v[i].verified;
          show();
        };
        RelayResult r;
        const auto started = Clock::now();
        try {
          r = relay_detail::relay_file(file, to, options, on, packed ? &pack.digest : nullptr);
        } catch (const Error& e) {
          std::lock_guard lock(m);
          for (const auto& [h, path] : g) {
            hosts[h].running.erase(ji);
            fail(h, e.code(), job.local, e.context());
          }
          return;
        } catch (const std::exception& e) {
          std::lock_guard lock(m);
          for (const auto& [h, path] : g) {
            hosts[h].running.erase(ji);
            fail(h, errc::internal, job.local, e.what());
          }
          return;
        }
        std::lock_guard lock(m);
        source_bytes += r.source_bytes;
        if (one_file) digest = r.digest;
        for (const auto& n : r.notes) notes.push_back(one_file ? n : "'" + job.local + "': " + n);
        for (std::size_t i = 0; i < r.hosts.size() && i < g.size(); ++i) {
          auto& s = hosts[g[i].first];
          s.running.erase(ji);
          const auto& h = r.hosts[i];
          if (!h.ok) {
            fail(g[i].first, h.code, job.local, h.message);
            continue;
          }
          s.done += packed ? job.size : h.verified;
          s.last = std::max(s.last, started + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(h.seconds)));
          if (one_file) s.host.digest = h.digest;
        }
      }));
    }
    for (auto& f : running) f.wait();
  };
  // The jobs in order, as many at once as files_at_once and bytes_at_once allow (one at least):
  // small files many at once, so that their chains' setups overlap; large ones few.
  std::condition_variable freed;
  std::size_t in_flight = 0;
  std::uint64_t bytes_in_flight = 0;
  std::size_t started_jobs = 0;
  std::vector<std::future<void>> flying;
  const auto cancelled = [&] { return options.cancel && options.cancel->load(); };
  for (std::size_t ji = 0; ji < jobs.size(); ++ji) {
    std::vector<std::vector<std::pair<std::size_t, std::string>>> groups(chains);
    {
      std::unique_lock lock(m);
      freed.wait(lock, [&] {
        return cancelled() || (in_flight < std::max(1u, set.files_at_once) &&
                               (in_flight == 0 || bytes_in_flight + jobs[ji].size <= set.bytes_at_once));
      });
      if (cancelled()) break;
      std::size_t n = 0;
      for (const auto& t : jobs[ji].to)
        if (!hosts[t.first].failed) groups[n++ % chains].push_back(t);
      if (n == 0) continue;
      ++in_flight;
      bytes_in_flight += jobs[ji].size;
      size += jobs[ji].size;
      ++started_jobs;
    }
    // However a job ends (an exception too: no thread to start, no memory), its room is given
    // back and its hosts that did not finish are failed, naming why.
    auto give_back = [&, ji](const std::vector<std::vector<std::pair<std::size_t, std::string>>>& gs, const char* why) {
      std::lock_guard lock(m);
      if (why)
        for (const auto& g : gs)
          for (const auto& [h, path] : g) fail(h, errc::internal, jobs[ji].local, why);
      --in_flight;
      bytes_in_flight -= jobs[ji].size;
      freed.notify_all();
    };
    try {
      flying.push_back(std::async(std::launch::async, [&, ji, give_back, groups] {
        try {
          run_job(ji, groups);
        } catch (const std::exception& e) {
          return give_back(groups, e.what());
        }
        give_back(groups, nullptr);
      }));
    } catch (const std::exception& e) {
      give_back(groups, e.what());
    }
    std::erase_if(flying, [](std::future<void>& f) { return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
  }
  for (auto& f : flying) f.wait();
  if (cancelled())
    for (std::size_t h = 0; h < hosts.size(); ++h)
      if (!hosts[h].failed) fail(h, errc::cancelled, {}, "cancelled");

  // The trees' attributes, on each host that has all of its files, over the session that made
  // the directories: the directories' (their files, written since, changed their mtimes) and
  // the mtimes of the files that came by chain (the packs' files have theirs).
  {
    std::vector<std::thread> threads;
    for (std::size_t h = 0; h < targets.size(); ++h) {
      if (!hosts[h].fs) continue;
      threads.emplace_back([&, h] {
        auto& fs = *hosts[h].fs;
        try {
          for (const auto& part : hosts[h].trees) {
            if (hosts[h].failed) continue;
            std::vector<pathm::Entry> entries;
            for (const auto& e : part.large.files)
              if (e.size >= threshold) entries.push_back(e);
            entries.insert(entries.end(), part.large.dirs.begin(), part.large.dirs.end());
            if (entries.empty()) continue;
            pathm::TreeResult r;
            fs->set_attrs(part.remote, entries, r);
            if (!r.failures.empty()) {
              std::lock_guard lock(m);
              fail(h, r.failures.front().code, r.failures.front().path, r.failures.front().message);
              break;
            }
          }
          fs.close();
        } catch (const Error& e) {
          std::lock_guard lock(m);
          fail(h, e.code(), {}, "setting attributes: " + e.context());
        } catch (const std::exception& e) {
          std::lock_guard lock(m);
          fail(h, errc::internal, {}, std::string("setting attributes: ") + e.what());
        }
        std::lock_guard lock(m);
        hosts[h].last = std::max(hosts[h].last, Clock::now());
      });
    }
    for (auto& t : threads) t.join();
  }

  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  // The set's bytes: its files through the chains, and the small files of a host's path parts.
  std::uint64_t small = 0;
  for (const auto& s : hosts) small = std::max(small, s.tree_bytes);
  result.size = size + small;
  result.source_bytes = source_bytes + path_bytes;
  result.digest = digest;
  result.notes = std::move(notes);
  for (auto& s : hosts) {
    auto h = s.host;
    h.final = true;
    h.ok = !s.failed;
    h.verified = s.done;
    if (s.last != Clock::time_point{}) h.seconds = std::chrono::duration<double>(s.last - t0).count();
    if (h.ok) h.code = errc::ok, h.message.clear();
    result.hosts.push_back(std::move(h));
  }
  return result;
}

}  // namespace xdfs
