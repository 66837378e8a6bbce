// The relay mode on the server: a master registers this host's place in a chain; the uploads
// that carry its ticket feed it (xftsm's FileOperation attaches them), a forwarder thread sends
// what they wrote on to the next host that answers, and this operation reports to the master
// once a second until the file is whole here and handed on (or given up), then ends with EOFR.
//
//   master                         this xdfsd
//   NEGO(relay, plan)      ──▶     register the place under plan.ticket
//                          ◀──     NEGO_REPLY
//                          ◀──     REPORT (ten times a second: verified, forwarded, state)
//   RELINK(hops)           ──▶     the forwarder drops its hop and feeds these instead
//   EOFR                   ──▶     (the whole chain is done) the forwarder stops
//                          ◀──     REPORT(final), EOFR; the place is removed, the session is
//                                  ready for its next operation
//
// The master may end it early with an EXCEPTION (it gives up on this host); a lost channel ends
// it too. Either way the place is removed and the forwarder stopped; what was verified here
// stays as a partial file that a later relay of the same file goes on from.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/steady_timer.hpp>
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "xdfs/client.hpp"
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

using Clock = std::chrono::steady_clock;
using runtime::RelaySlot;
constexpr std::string_view pack_prefix = ".xdfs-pack-";
using relay_fsm::RelayAction;
using relay_fsm::RelayEvent;

class RelayOperation final : public runtime::Operation {
public:
  RelayOperation(runtime::OperationEnv& env, runtime::OperationDone done)
      : env_(env), nego_(env.nego), done_(std::move(done)), tick_(env.io), linger_(env.io) {}

  ~RelayOperation() override { stop(); }

  void start() override {
    const auto& plan = nego_.relay_plan;
    if (!env_.relays) return refuse(errc::not_supported, "relays are disabled on this server");
    if (!(nego_.extended_flags & wire::flag_manifest))
      return refuse(errc::bad_argument, "a relay verifies every block: not without the content manifest (--no-verify)");
    if (nego_.channel_count != 1 || env_.channels.size() != 1)
      return refuse(errc::bad_argument, "a relay's own session has one channel");
    if (plan.channels == 0 || plan.channels > env_.config.max_channels)
      return refuse(errc::limit_exceeded, fmt::format("n = {} channels downstream (this server allows 1..{})",
                                                      plan.channels, env_.config.max_channels));
    std::string why;
    if (!plan.next.empty() && !peers_allowed(plan.next, why)) return refuse(errc::permission_denied, why);
    auto [dir, name] = files::split_parent(nego_.remote_path);
    if (name.empty()) return refuse(errc::bad_argument, "a relay names its file, not a directory");
    // A pack is removed once unpacked: only under a pack's own name, never a file of the user's.
    if (plan.pack && name.rfind(pack_prefix, 0) != 0)
      return refuse(errc::bad_argument, "a relay's pack is named " + std::string(pack_prefix) + "...");
    if (plan.pack && nego_.file_size > relay_detail::max_pack_size)
      return refuse(errc::limit_exceeded, fmt::format("a relay's pack of {} bytes (at most {})", nego_.file_size,
                                                      relay_detail::max_pack_size));
    // A small place (not a pack, which is unpacked where it is) in the memory directory if it
    // has the room now, and as much again for another; anything else under the root.
    files::Fd memory;
    if (!env_.config.relay_memory_dir.empty() && !plan.pack && nego_.file_size <= env_.config.relay_memory_max) {
      memory = files::Fd(::open(env_.config.relay_memory_dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      files::Fd d;
      if (memory && !(files::open_beneath(memory.get(), dir, O_PATH | O_DIRECTORY, 0, d) &&
                      files::check_room(d.get(), nego_.file_size + env_.config.relay_memory_max, "'" + nego_.remote_path + "'")))
        memory.reset();
    }
    const int base = memory ? memory.get() : env_.root_fd;
    files::Fd dirfd;
    if (auto st = files::open_beneath(base, dir, O_PATH | O_DIRECTORY, 0, dirfd); !st)
      return refuse(st.code, st.message);
    if (env_.config.max_file_size == 0 && !memory)  // (in memory: its room was checked above)
      if (auto st = files::check_room(dirfd.get(), nego_.file_size, "'" + nego_.remote_path + "'"); !st)
        return refuse(st.code, st.message);
    // The digests of the blocks it receives stay while the place does (32 bytes a block).
    const std::uint64_t blocks = nego_.file_size / nego_.block_size + 1;
    auto held = Reservation::take(&env_.budget, static_cast<std::size_t>(blocks * manifest::digest_size));
    if (!held)
      return refuse(errc::limit_exceeded, fmt::format("the server's memory for sessions cannot hold the {} block digests "
                                                      "of this relay now; try again later",
                                                      blocks));
    digests_ = std::move(*held);
    auto slot = std::make_shared<RelaySlot>();
    if (!slot->digests.size_for(blocks))
      return refuse(errc::limit_exceeded, fmt::format("this server cannot hold the {} block digests of this relay now; "
                                                      "try again later",
                                                      blocks));
    slot->plan = plan;
    slot->path = nego_.remote_path;
    slot->size = nego_.file_size;
    slot->mtime_ns = nego_.source_mtime_ns;
    slot->block_size = nego_.block_size;
    slot->master = env_.client.key;
    slot->master_fingerprint = env_.client.fingerprint;
    slot->next_hops = plan.next;
    const int root = ::fcntl(base, F_DUPFD_CLOEXEC, 3);
    if (root < 0) return refuse(errc_from_errno(errno), std::string("root: ") + std::strerror(errno));
    slot->root = files::Fd(root);
    if (!env_.relays->add(slot)) return refuse(errc::bad_argument, "that relay ticket is in use here");
    slot_ = slot;
    started_ = Clock::now();
    last_move_ = started_;
    env_.log(fmt::format("session {} relay of '{}' ({} bytes) for {}, {} hop{} after this one", env_.id.short_hex(),
                         nego_.remote_path, nego_.file_size, env_.client.fingerprint, plan.next.size(),
                         plan.next.size() == 1 ? "" : "s"));
    on(RelayEvent::accepted);
  }

  void abort(errc code, const std::string& message) override { on(RelayEvent::local_error, code, message); }

  std::uint64_t bytes() const noexcept override { return slot_ ? slot_->written.load() : 0; }

private:
  // What happens goes through the table; the row's action runs here. An event the table does
  // not allow fails the operation, naming it.
  void on(RelayEvent e, errc code = errc::ok, const std::string& why = {}, std::vector<wire::RelayHop> hops = {}) {
    if (machine_.finished()) return;
    auto a = machine_.fire(e);
    if (!a) return on(RelayEvent::local_error, errc::state_violation, machine_.why());
    switch (*a) {
      case RelayAction::start: return begin_place();
      case RelayAction::send_report: return send_report();
      case RelayAction::apply_relink:
        relink(std::move(hops));
        return read();
      case RelayAction::release: return release();
      case RelayAction::refuse: return done_(runtime::OperationResult{code, why, false, true, true});
      case RelayAction::abort: return fail(code, why, e == RelayEvent::peer_exception);
      default: return on(RelayEvent::local_error, errc::internal, "relay-host: no such action here");
    }
  }

  void begin_place() {
    const auto& plan = nego_.relay_plan;
    auto slot = slot_;
    wire::NegotiationReply reply;
    reply.block_size = nego_.block_size;
    reply.file_size = nego_.file_size;
    env_.channels[0]->send_control(wire::ChannelEvent::nego_reply, wire::encode(reply));
    TransferOptions base;
    base.channels = plan.channels;
    base.block_size = nego_.block_size;
    base.protect = static_cast<xsec::Protect>(plan.protect);
    base.identity_secret = env_.relays->server_key().secret;
    base.idle_timeout = env_.config.idle_timeout;
    base.zero_copy = env_.config.zero_copy;
    base.loopback_sendfile = env_.config.loopback_sendfile;
    if (env_.config.debug)
      base.debug = [log = env_.log, path = slot->path](const std::string& line) {
        log(fmt::format("relay of '{}' debug: {}", path, line));
      };
    try {
      // A failure in the forwarder ends its forwarding, never the process.
      forwarder_ = std::thread([slot, base, log = env_.log] {
        try {
          relay_detail::forward(slot, base, log);
        } catch (const std::exception& e) {
          log(std::string("relay forwarder: ") + e.what());
        } catch (...) {
          log("relay forwarder: unknown exception");
        }
        slot->forwarding.store(false);
        std::lock_guard lock(slot->m);
        slot->forward_done = true;
      });
    } catch (const std::system_error& e) {
      return on(RelayEvent::local_error, errc::limit_exceeded, std::string("cannot start the relay's forwarder: ") + e.what());
    }
    read();
    tick();
  }

  // What the master hears now.
  wire::RelayReport report() {
    wire::RelayReport r;
    auto& s = *slot_;
    r.verified = std::min(s.written.load(), s.size);
    r.forwarded = s.forwarded.load();
    r.next = s.next.load();
    r.forwarding = s.forwarding.load();
    std::lock_guard lock(s.m);
    r.skipped = s.skipped;
    r.state = s.whole ? wire::RelayReport::State::whole
              : s.feeding ? wire::RelayReport::State::receiving
                          : wire::RelayReport::State::waiting;
    if (s.whole) r.digest = s.digest;
    r.upstream = s.upstream;
    r.upstream_code = s.upstream_code;
    r.upstream_message = s.upstream_message;
    r.relinks = s.relinks_heard;
    if (r.verified != seen_ || s.feeding || s.whole) {
      seen_ = r.verified;
      last_move_ = Clock::now();
    }
    // Nothing fed it for a whole idle timeout: the master hears it will not be whole by itself.
    if (!s.whole && Clock::now() - last_move_ > env_.config.idle_timeout) {
      r.state = wire::RelayReport::State::failed;
      r.code = errc::timeout;
      r.message = fmt::format("no upstream fed it for {} s", env_.config.idle_timeout.count() / 1000);
    }
    return r;
  }

  void tick() {
    // One report in flight at a time: a master that does not read gets no pile of them, and one
    // that reads nothing for the idle timeout loses its place.
    if (report_out_ && Clock::now() - sent_at_ > env_.config.idle_timeout)
      return on(RelayEvent::timeout, errc::timeout,
                fmt::format("the master read no report for {} s", env_.config.idle_timeout.count() / 1000));
    on(RelayEvent::tick);
  }

  // A report every 100 ms, and at once (within a tick) when the place becomes whole, fails, or
  // stops forwarding: the master moves on when every host is whole and done, and a file waits
  // for nothing else.
  void send_report() {
    auto r = report();
    const auto now = Clock::now();
    const bool changed = r.state != sent_state_ || r.forwarding != sent_forwarding_;
    if (!report_out_ && (changed || now - sent_at_ >= std::chrono::milliseconds(100))) {
      report_out_ = true;
      sent_at_ = now;
      sent_state_ = r.state;
      sent_forwarding_ = r.forwarding;
      env_.channels[0]->send_control(wire::ChannelEvent::report, wire::encode(r),
                                     [this](const xdsi::ErrorCode& ec) {
                                       if (machine_.finished() || ec) return;
                                       report_out_ = false;
                                     });
    }
    tick_.expires_after(std::chrono::milliseconds(10));
    tick_.async_wait([this](const xdsi::ErrorCode& ec) {
      if (!ec) tick();
    });
  }

  // The master's EOFR ends it: the forwarder stops, the last report goes, then our EOFR.
  void release() {
    tick_.cancel();
    stop();
    auto r = report();
    r.final = true;
    // A pack, whole and handed on: its files go into its directory, and it goes.
    if (nego_.relay_plan.pack) {
      if (r.state == wire::RelayReport::State::whole) {
        const auto u = unpack_here();
        if (u.code != errc::ok) {
          r.state = wire::RelayReport::State::failed;
          r.code = u.code;
          r.message = u.message;
        }
        env_.log(fmt::format("session {} relay pack '{}': {} files, {} bytes written{}", env_.id.short_hex(),
                             text::escape(nego_.remote_path), u.files, u.bytes,
                             u.code == errc::ok ? "" : "; " + u.message));
      }
      discard_pack();
    }
    auto& ch = *env_.channels[0];
    ch.send_control(wire::ChannelEvent::report, wire::encode(r));
    wire::FrameHeader h;
    h.event = wire::ChannelEvent::eofr;
    h.offset = r.verified;
    ch.send(h, std::vector<std::uint8_t>{});
    env_.log(fmt::format("session {} relay of '{}': {}, {} sent on", env_.id.short_hex(), text::escape(nego_.remote_path),
                         r.state == wire::RelayReport::State::whole ? "whole here" : "not whole here",
                         slot_->sent));
    done_(runtime::OperationResult{errc::ok, {}, false, false, true});
  }

  // RELINK: new hops for the forwarder, which drops the one it feeds.
  // Whether every hop is one of this server's relay peers (ServerConfig::relay_peers): a client
  // must not make it connect wherever it likes. `why` names the first that is not.
  // A peer is a key at the addresses its line names: nothing else is ever connected to.
  bool peers_allowed(const std::vector<wire::RelayHop>& hops, std::string& why) const {
    if (env_.config.relay_trust_master) return true;  // a pulling host's server: its master routes it
    const auto& file = env_.config.relay_peers;
    std::map<xsec::Key32, std::vector<std::string>> peers;
    if (::access(file.c_str(), F_OK) == 0) {
      std::ifstream in(file);
      std::string line;
      for (int n = 1; std::getline(in, line); ++n) {
        std::istringstream words(line);
        std::string kind, key, at;
        if (!(words >> kind) || kind[0] == '#') continue;
        auto pub = (words >> key) ? xsec::parse_public(kind + " " + key) : std::nullopt;
        std::vector<std::string> where;
        while (words >> at) where.push_back(at);
        if (!pub || where.empty()) {
          why = fmt::format("this server's relay peers {}:{}: expected 'xdfs-x25519 KEY HOST:PORT...'", file, n);
          return false;
        }
        auto& list = peers[*pub];
        list.insert(list.end(), where.begin(), where.end());
      }
    }
    for (const auto& h : hops) {
      auto it = peers.find(h.server_key);
      if (it == peers.end() || std::find(it->second.begin(), it->second.end(), h.address) == it->second.end()) {
        why = "this server may not forward to " + text::escape(h.address) + " (key " + xsec::fingerprint(h.server_key) +
              "): that key at that address is not among its relay peers in " + file;
        return false;
      }
    }
    return true;
  }

  // The hop it feeds now stays fed if it is still the first of the new ones.
  void relink(std::vector<wire::RelayHop> hops) {
    std::lock_guard lock(slot_->m);
    const auto now = slot_->next.load();
    const bool same_head = slot_->forwarding.load() && now < slot_->next_hops.size() && !hops.empty() &&
                           slot_->next_hops[now] == hops[0];
    slot_->next_hops = std::move(hops);
    ++slot_->relinks;
    ++slot_->relinks_heard;
    slot_->skipped.clear();
    slot_->forward_done = false;
    if (!same_head) slot_->hop_cancel.store(true);
  }

  // The master says RELINK, EOFR (the chain is done) or EXCEPTION (it gives up on this host).
  void read() {
    auto& ch = *env_.channels[0];
    ch.async_read_header([this, &ch](const xdsi::ErrorCode& ec, const wire::FrameHeader& h) {
      if (machine_.finished()) return;
      if (ec) {
        auto f = ch.failure(ec, "master");
        return on(RelayEvent::channel_lost, f.code, f.message);
      }
      if (h.event == wire::ChannelEvent::eofr && h.length == 0) return on(RelayEvent::ended);
      if (h.event != wire::ChannelEvent::exception && h.event != wire::ChannelEvent::relink)
        return on(RelayEvent::local_error, errc::protocol_error,
                  fmt::format("{} from the master in a relay", wire::to_string(h.event)));
      in_.resize(h.length);
      ch.async_read_payload(in_, [this, &ch, event = h.event](const xdsi::ErrorCode& e) {
        if (machine_.finished()) return;
        if (e) {
          auto f = ch.failure(e, "master");
          return on(RelayEvent::channel_lost, f.code, f.message);
        }
        if (event == wire::ChannelEvent::exception) {
          auto ex = wire::decode_exception(in_);
          // Given up because its copy is damaged: what it verified goes too.
          if (ex && ex->code == errc::integrity_error) slot_->discard.store(true);
          return on(RelayEvent::peer_exception, errc::cancelled,
                    "the master gave up on this host" + (ex ? ": " + ex->message : std::string()));
        }
        std::string why;
        auto hops = wire::decode_relink(in_, &why);
        if (!hops) return on(RelayEvent::local_error, errc::protocol_error, "RELINK: " + why);
        if (!peers_allowed(*hops, why)) return on(RelayEvent::local_error, errc::permission_denied, why);
        on(RelayEvent::relink, errc::ok, {}, std::move(*hops));
      });
    });
  }

  relay_detail::Unpacked unpack_here() {
    files::Fd fd;
    // Not blocking: a FIFO moved to the pack's name meanwhile would hold this session's thread
    // in open(2) for good; it fails the check below instead.
    if (auto s = files::open_beneath(slot_->root.get(), slot_->path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC,
                                     0, fd);
        !s)
      return {s.code, "pack: " + s.message};
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || static_cast<std::uint64_t>(st.st_size) != slot_->size)
      return {errc::size_mismatch, "pack: not the file that was relayed"};
    {
      // Only the master's own pack: an upstream could have fed any bytes that matched its own
      // digests, and a pack says where files go.
      std::lock_guard lock(slot_->m);
      const auto& want = nego_.relay_plan.pack_digest;
      if (slot_->digest.size() != want.size() || !std::equal(want.begin(), want.end(), slot_->digest.begin()))
        return {errc::integrity_error, "pack: its digest is not the one the master gave; nothing written"};
    }
    pathm::TreeWriter writer(slot_->root.get(), env_.tag, env_.config.fsync, nego_.block_size, 1, files::process_umask(),
                             env_.config.max_file_size, env_.made);
    return relay_detail::unpack(fd.get(), slot_->size, writer, files::split_parent(slot_->path).first,
                                env_.config.max_file_size);
  }

  // The pack and what is left of it (a partial copy and its resume record), whatever became of
  // it: only the file this place wrote, under either name.
  void discard_pack() {
    auto [dir, name] = files::split_parent(slot_->path);
    struct stat mine {};
    {
      std::lock_guard lock(slot_->m);
      if (!slot_->file || ::fstat(slot_->file.get(), &mine) != 0) return;  // never fed: nothing of ours
    }
    files::Fd d;
    if (name.rfind(pack_prefix, 0) != 0 ||
        !files::open_beneath(slot_->root.get(), dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0, d))
      return;
    for (const auto& n : {files::partial_name(name), name}) {
      struct stat st {};
      if (::fstatat(d.get(), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == mine.st_dev &&
          st.st_ino == mine.st_ino)
        ::unlinkat(d.get(), n.c_str(), 0);
    }
    ::unlinkat(d.get(), files::record_name(name).c_str(), 0);
  }

  void stop() {
    if (slot_) {
      slot_->cancel.store(true);
      slot_->hop_cancel.store(true);
      env_.relays->remove(slot_->plan.ticket);
    }
    if (forwarder_.joinable()) forwarder_.join();
  }

  void fail(errc code, const std::string& message, bool from_peer = false) {
    tick_.cancel();
    stop();
    if (slot_ && nego_.relay_plan.pack) discard_pack();
    xdsi::tell_and_close(env_.channels, wire::ExceptionHeader{code, message, 0, 0}, linger_, std::chrono::seconds(2));
    done_(runtime::OperationResult{code, message, from_peer, false, false});
  }

  void refuse(errc code, const std::string& message) { on(RelayEvent::local_error, code, message); }

  runtime::OperationEnv& env_;
  wire::Negotiation nego_;
  runtime::OperationDone done_;
  boost::asio::steady_timer tick_;
  boost::asio::steady_timer linger_;
  std::shared_ptr<RelaySlot> slot_;
  std::thread forwarder_;
  std::vector<std::uint8_t> in_;
  Clock::time_point started_{}, last_move_{};
  std::uint64_t seen_ = 0;
  bool report_out_ = false;       // a report is queued and not yet on the wire
  Clock::time_point sent_at_{};
  wire::RelayReport::State sent_state_ = wire::RelayReport::State::waiting;  // in the last report sent
  bool sent_forwarding_ = false;
  Reservation digests_;           // the block digests the place keeps, in the server's memory budget
  relay_fsm::RelayMachine machine_{relay_fsm::RelaySide::host};
};

}  // namespace

runtime::ModeEntry server_mode() {
  return runtime::ModeEntry{Mode::relay, [](runtime::OperationEnv& env, runtime::OperationDone done) {
                              return std::unique_ptr<runtime::Operation>(new RelayOperation(env, std::move(done)));
                            }};
}

}  // namespace xdfs::relay_mode
