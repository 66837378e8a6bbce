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

#include <map>
#include <mutex>
#include <thread>

#include "xdfs/files.hpp"
#include "xdfs/relay.hpp"
#include "xdfs/relay_registry.hpp"
#include "xdfs/text.hpp"

#include "forward.hpp"

namespace xdfs::relay_mode {
namespace {

using relay_detail::Joins;
using relay_detail::Member;

// One file's chain while anyone is in it or joining.
struct Distribution {
  Joins joins;
  files::Fd file;  // the source, opened beneath the root of the first host that asked
  std::vector<std::shared_ptr<Member>> all;  // every host that joined (under joins.m)
};

// The chains running in this process, by what makes them one (see PullOperation::start).
std::mutex registry_m;
std::map<std::string, std::shared_ptr<Distribution>>& registry() {
  static auto* r = new std::map<std::string, std::shared_ptr<Distribution>>;  // outlives every chain's thread
  return *r;
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
void join(const std::string& key, int fd, const TransferOptions& options, const std::shared_ptr<Member>& m,
          runtime::RelayRegistry& relays, const std::function<void(const std::string&)>& log) {
  std::lock_guard lock(registry_m);
  auto& reg = registry();
  if (auto it = reg.find(key); it != reg.end()) {
    auto& d = *it->second;
    std::lock_guard j(d.joins.m);
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
  d->all.push_back(m);
  d->joins.arriving.push_back(m);
  d->joins.log = [log](const std::string& line) { log("pull chain: " + line); };
  auto o = options;
  o.cancel = &relays.stopping;
  // (The thread ends by taking registry_m: registered below first, whatever it does.)
  relays.run_chain([d, key, o, log] {
    try {
      (void)relay_detail::relay_file("/proc/self/fd/" + std::to_string(d->file.get()), {}, o, {}, nullptr, &d->joins);
      finalize(*d, errc::cancelled, "the master's chain ended");
    } catch (const std::exception& e) {
      log(std::string("pull chain: ") + e.what());
      finalize(*d, errc::internal, std::string("the master's chain failed: ") + e.what());
    } catch (...) {
      finalize(*d, errc::internal, "the master's chain failed");
    }
    std::lock_guard l(registry_m);
    auto& r = registry();
    if (auto it = r.find(key); it != r.end() && it->second == d) r.erase(it);
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
    if (!env_.relays) return refuse(errc::not_supported, "relays (and so pulls) are disabled on this server");
    if (!(nego_.extended_flags & wire::flag_manifest))
      return refuse(errc::bad_argument, "a pull verifies every block: not without the content manifest (--no-verify)");
    if (nego_.channel_count != 1 || env_.channels.size() != 1)
      return refuse(errc::bad_argument, "a pull's own session has one channel");
    files::Fd fd;
    if (auto st = files::open_beneath(env_.root_fd, nego_.remote_path, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0, fd); !st)
      return refuse(st.code, st.message);
    struct stat sb {};
    if (::fstat(fd.get(), &sb) != 0) return refuse(errc_from_errno(errno), "stat '" + nego_.remote_path + "'");
    if (S_ISDIR(sb.st_mode)) return refuse(errc::is_directory, "'" + nego_.remote_path + "' is a directory");
    if (!S_ISREG(sb.st_mode)) return refuse(errc::not_regular_file, "'" + nego_.remote_path + "' is not a regular file");
    size_ = static_cast<std::uint64_t>(sb.st_size);
    // The host's own server: where this session comes from, at the port it named.
    Endpoint at;
    std::uint16_t ignored = 0;
    xdsi::ErrorCode bad;
    // (Always an address the listener saw, never a name to look up.)
    if (!xdsi::parse_host_port(env_.peer, 0, at.host, ignored) || (boost::asio::ip::make_address(at.host, bad), bad))
      return refuse(errc::internal, "cannot tell where this session comes from");
    at.port = nego_.pull_port;
    wire::NegotiationReply reply;
    reply.block_size = nego_.block_size;
    reply.file_size = size_;
    reply.mtime_ns = files::mtime_ns(sb);
    env_.channels[0]->send_control(wire::ChannelEvent::nego_reply, wire::encode(reply));
    env_.log(fmt::format("session {} pull of '{}' ({} bytes) for {} at {}", env_.id.short_hex(),
                         text::escape(nego_.remote_path), size_, env_.client.fingerprint, text::escape(env_.peer)));
    if (size_ == 0) return finish_ok();  // nothing to route: the host makes it empty
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
    // One chain per file, block size and protection, and per root its hosts see (a confined
    // key's subdirectory): hosts of different roots never feed each other nor learn of each other.
    struct stat rs {};
    if (::fstat(env_.root_fd, &rs) != 0) return fail(errc_from_errno(errno), "stat of the root");
    const std::string key = fmt::format("{}:{}:{}:{}:{}:{}:{}:{}:{}:{}", xsec::fingerprint(env_.relays->server_key().public_key),
                                        rs.st_dev, rs.st_ino, sb.st_dev, sb.st_ino, size_, files::mtime_ns(sb),
                                        nego_.block_size, static_cast<int>(o.protect), static_cast<int>(env_.opening.cipher));
    try {
      join(key, fd.get(), o, member_, *env_.relays, env_.log);
    } catch (const std::exception& e) {
      return fail(errc::internal, e.what());
    }
    read();
    tick();
  }

  void abort(errc code, const std::string& message) override { fail(code, message); }

  std::uint64_t bytes() const noexcept override { return 0; }

private:
  // Every 20 ms: has the chain let this host go?
  void tick() {
    if (over_) return;
    bool final = false;
    RelayHost h;
    {
      std::lock_guard lock(member_->m);
      final = member_->final;
      if (final) h = member_->host;
    }
    if (final) {
      if (h.ok) return finish_ok();
      return fail(h.code == errc::ok ? errc::internal : h.code, h.message);
    }
    tick_.expires_after(std::chrono::milliseconds(20));
    tick_.async_wait([this](const xdsi::ErrorCode& ec) {
      if (!ec) tick();
    });
  }

  // The host's copy is whole and verified: EOFR; its own EOFR ends the operation (within 10 s).
  void finish_ok() {
    sent_eofr_ = true;
    tick_.cancel();
    tick_.expires_after(std::chrono::seconds(10));
    tick_.async_wait([this](const xdsi::ErrorCode& ec) {
      if (!ec) fail(errc::timeout, "the pulling host did not end its pull within 10 s");
    });
    wire::FrameHeader h;
    h.event = wire::ChannelEvent::eofr;
    h.offset = size_;
    env_.channels[0]->send(h, std::vector<std::uint8_t>{});
    if (!member_) read();
  }

  // The host says nothing but its EOFR (after ours: done; before: it leaves).
  void read() {
    auto& ch = *env_.channels[0];
    ch.async_read_header([this, &ch](const xdsi::ErrorCode& ec, const wire::FrameHeader& h) {
      if (over_) return;
      if (ec) {
        auto f = ch.failure(ec, "client");
        return fail(f.code, f.message);
      }
      if (h.event == wire::ChannelEvent::eofr && h.length == 0) {
        if (!sent_eofr_) return fail(errc::cancelled, "the pulling host left before its copy was whole");
        over_ = true;
        tick_.cancel();
        if (member_) member_->gone.store(true);
        return done_(runtime::OperationResult{errc::ok, {}, false, false, true});
      }
      fail(errc::protocol_error, fmt::format("{} from a pulling host", wire::to_string(h.event)));
    });
  }

  void fail(errc code, const std::string& message) {
    if (over_) return;
    over_ = true;
    tick_.cancel();
    if (member_) member_->gone.store(true);
    xdsi::tell_and_close(env_.channels, wire::ExceptionHeader{code, message, 0, 0}, linger_, std::chrono::seconds(2));
    done_(runtime::OperationResult{code, message, false, false, false});
  }

  void refuse(errc code, const std::string& message) {
    over_ = true;
    done_(runtime::OperationResult{code, message, false, true, true});
  }

  runtime::OperationEnv& env_;
  wire::Negotiation nego_;
  runtime::OperationDone done_;
  boost::asio::steady_timer tick_;
  boost::asio::steady_timer linger_;
  std::shared_ptr<Member> member_;
  std::uint64_t size_ = 0;
  bool sent_eofr_ = false;
  bool over_ = false;
};

}  // namespace

runtime::ModeEntry pull_mode() {
  return runtime::ModeEntry{Mode::pull, [](runtime::OperationEnv& env, runtime::OperationDone done) {
                              return std::unique_ptr<runtime::Operation>(new PullOperation(env, std::move(done)));
                            }};
}

}  // namespace xdfs::relay_mode
