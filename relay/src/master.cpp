// The relay's master: registers every host's place, feeds the chain, watches the reports, and
// routes around what fails: a lost or stalled host is dropped, a host whose copy turns out
// damaged (the next host's digests caught it) is dropped, a host far slower than its upstream
// is moved to the end of the chain, where it delays nobody. Each change is a RELINK to the
// hosts whose next hop it changes; the host after the one dropped goes on from what it has.
#include <fcntl.h>
#include <sys/stat.h>

#include <boost/asio/post.hpp>
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include "xdfs/detail/relay_fsm.hpp"
#include "xdfs/files.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/relay.hpp"
#include "xdfs/relay_registry.hpp"
#include "xdfs/session.hpp"
#include "xdfs/text.hpp"

#include "forward.hpp"

namespace xdfs {
namespace {

using Clock = std::chrono::steady_clock;
using State = wire::RelayReport::State;
using relay_fsm::RelayAction;
using relay_fsm::RelayEvent;

// A report's digest (empty, or 32 bytes: the decoder checks it) in hex, as TransferResult's.
std::string hex(const std::vector<std::uint8_t>& b) {
  manifest::Digest d{};
  if (b.size() != d.size()) return {};
  std::copy(b.begin(), b.end(), d.begin());
  return manifest::hex(d);
}

// One host: its control session (read on a thread of its own) and what it said last.
struct Place {
  std::size_t index = 0;  // in the targets given
  std::string name;       // for messages
  RelayTarget target;
  std::string path;
  wire::RelayHop hop;     // how its upstream reaches it
  std::unique_ptr<Session> session;
  std::thread reader;
  // Under Chain::m.
  RelayHost host;
  wire::RelayReport last;
  bool reported = false;
  bool gone = false;      // its session ended (host.code says why, unless it was released)
  bool dropped = false;   // out of the chain (failed)
  bool moved = false;     // moved to the end once already
  bool released = false;  // EOFR sent: the chain is done
  bool final_heard = false;  // its last report (after the release) came
  Clock::time_point whole_at{}, moved_at{};
  Clock::time_point progress_at{};  // when its verified bytes last grew past `most`
  std::uint64_t most = 0;
  std::uint64_t relinks_sent = 0;   // RELINKs sent to it: its reports' skips count from the last
  Clock::time_point slow_since{};   // since when it has looked too slow for its place
  std::deque<std::pair<Clock::time_point, std::uint64_t>> samples;  // verified over the last seconds
  std::vector<wire::RelayHop> sent_next;
  double peak = 0;        // its best rate over a window, bytes/s
  unsigned passed = 0;    // times the host before it passed it over and was sent back to it
  std::size_t skips_seen = 0;  // of its own report's skipped list, those acted on
  // Lost or stalled, it may come back: registered again, at the end of the chain.
  bool rejoinable = false;
  std::future<std::unique_ptr<Session>> coming;
  relay_fsm::RelayMachine machine{relay_fsm::RelaySide::master};  // on its reader's thread only
  std::atomic<bool> reader_done{false};
  std::array<std::uint8_t, 32> coming_ticket{};
  Clock::time_point tried_at{};
  // A host that joined as the chain ran (pull mode): its pull operation hears how it ended.
  std::shared_ptr<relay_detail::Member> member;
  bool joined = false;     // its place was registered once
  bool told = false;       // its member is final
  unsigned tries = 0;      // registrations tried
  Clock::time_point joined_at{}, released_at{};
};

struct Chain {
  std::mutex m;
  std::condition_variable heard;  // a report, an end: the master looks again at once
  bool news = false;
  // Set, with `heard` notified, without the mutex (a host asking to join, under Joins::m, which
  // the master takes after this mutex): a wake-up lost to that race waits out one 50 ms round.
  std::atomic<bool> poke{false};
  std::vector<std::unique_ptr<Place>> places;
  Clock::time_point t0 = Clock::now();
  std::uint64_t size = 0;
};

// Bytes per second over the samples of the last second and a half.
double rate_of(const Place& p) {
  if (p.samples.size() < 2) return 0;
  const auto& [t1, b1] = p.samples.front();
  const auto& [t2, b2] = p.samples.back();
  const double s = std::chrono::duration<double>(t2 - t1).count();
  return s > 0.5 && b2 >= b1 ? static_cast<double>(b2 - b1) / s : 0;
}

// Reads a place's reports until its EOFR (after the master's) or a failure, on its own thread,
// which also runs what the master tells the place (tell()): the master's table for this place
// lives here.
void read_reports(Chain& chain, Place& p) {
  auto& s = *p.session;
  auto& ch = *s.channels()[0];
  std::vector<std::uint8_t> buf;
  bool over = false;
  (void)p.machine.fire(RelayEvent::accepted);
  auto lost = [&](RelayEvent e, errc code, const std::string& why) {
    if (!p.machine.finished()) (void)p.machine.fire(e);  // abort
    std::lock_guard lock(chain.m);
    if (!p.gone && !p.released) {
      p.host.code = code;
      p.host.message = why;
    }
    p.gone = true;
    over = true;
    chain.news = true;
    chain.heard.notify_one();
  };
  std::function<void()> next = [&] {
    ch.async_read_header([&](const xdsi::ErrorCode& ec, const wire::FrameHeader& h) {
      if (p.machine.finished()) {
        over = true;
        return;
      }
      if (ec) {
        auto f = ch.failure(ec, "server");
        return lost(RelayEvent::channel_lost, f.code, "lost: " + f.message);
      }
      if (h.event == wire::ChannelEvent::eofr && h.length == 0) {
        if (!p.machine.fire(RelayEvent::ended))
          return lost(RelayEvent::local_error, errc::protocol_error, "it ended its place before the chain was done");
        s.end_operation(true);
        std::lock_guard lock(chain.m);
        p.gone = true;
        over = true;
        chain.news = true;
        chain.heard.notify_one();
        return;
      }
      if (h.event != wire::ChannelEvent::report && h.event != wire::ChannelEvent::exception)
        return lost(RelayEvent::local_error, errc::protocol_error,
                    fmt::format("{} in a relay's reports", wire::to_string(h.event)));
      buf.resize(h.length);
      ch.async_read_payload(buf, [&, event = h.event](const xdsi::ErrorCode& e) {
        if (p.machine.finished()) {
          over = true;
          return;
        }
        if (e) {
          auto f = ch.failure(e, "server");
          return lost(RelayEvent::channel_lost, f.code, "lost: " + f.message);
        }
        if (event == wire::ChannelEvent::exception) {
          auto ex = wire::decode_exception(buf);
          return lost(RelayEvent::peer_exception, ex ? ex->code : errc::protocol_error,
                      ex ? ex->message : std::string("a malformed exception"));
        }
        std::string why;
        auto r = wire::decode_report(buf, &why);
        if (!r) return lost(RelayEvent::local_error, errc::protocol_error, "report: " + why);
        if (!p.machine.fire(RelayEvent::report)) return lost(RelayEvent::local_error, errc::state_violation, p.machine.why());
        {
          std::lock_guard lock(chain.m);
          const auto now = Clock::now();
          r->verified = std::min(r->verified, chain.size);
          if (!p.reported || r->verified > p.most) {
            p.progress_at = now;
            p.most = r->verified;
          }
          p.last = *r;
          p.reported = true;
          p.host.verified = r->verified;
          // At most one sample per 50 ms is kept (a newer one replaces the last): a host that
          // reports faster, as fast as its link allows, grows nothing.
          if (p.samples.size() >= 2 && now - p.samples[p.samples.size() - 2].first < std::chrono::milliseconds(50))
            p.samples.back() = {now, r->verified};
          else
            p.samples.emplace_back(now, r->verified);
          while (p.samples.size() > 2 && now - p.samples.front().first > std::chrono::milliseconds(1500)) p.samples.pop_front();
          p.peak = std::max(p.peak, rate_of(p));
          if (r->state == State::whole && p.whole_at == Clock::time_point{}) {
            p.whole_at = now;
            p.host.digest = hex(r->digest);
          }
          // The last word, after the release: what the host did with the file at the end (a
          // pack written out) failed.
          if (r->final) p.final_heard = true;
          if (r->final && r->state == State::failed && p.host.code == errc::ok) {
            p.host.code = r->code == errc::ok ? errc::internal : r->code;
            p.host.message = r->message;
          }
          chain.news = true;
          chain.heard.notify_one();
        }
        next();
      });
    });
  };
  next();
  try {
    while (!over && !s.io().stopped()) s.io().run_one();
  } catch (const std::exception& e) {
    lost(RelayEvent::local_error, errc::internal, e.what());
  }
  s.close();
  p.reader_done.store(true);
}

// What the master tells a place (RELINK, EOFR, or an EXCEPTION when it drops it), through the
// place's table, on the thread that reads it.
void tell(Place& p, RelayEvent e, std::vector<std::uint8_t> payload) {
  boost::asio::post(p.session->io(), [&p, e, payload = std::move(payload)]() mutable {
    auto& s = *p.session;
    if (s.channels().empty() || !s.channels()[0] || p.machine.finished()) return;
    auto& ch = *s.channels()[0];
    auto a = p.machine.fire(e);
    if (!a) return;
    if (*a == RelayAction::send_relink) return ch.send_control(wire::ChannelEvent::relink, std::move(payload));
    if (*a == RelayAction::send_eofr) {
      wire::FrameHeader h;
      h.event = wire::ChannelEvent::eofr;
      return ch.send(h, std::vector<std::uint8_t>{});
    }
    if (*a == RelayAction::tell_and_drop) {
      // Nothing more from it counts: the channel closes once the exception left, or in 2 s.
      auto timer = std::make_shared<boost::asio::steady_timer>(s.io(), std::chrono::seconds(2));
      ch.send_control(wire::ChannelEvent::exception, std::move(payload), [&ch, timer](const xdsi::ErrorCode&) {
        timer->cancel();
        ch.close();
      });
      timer->async_wait([&ch](const xdsi::ErrorCode& ec) {
        if (!ec) ch.close();
      });
    }
  });
}

}  // namespace

std::string relay_detail::base_name(std::string s) {
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  auto i = s.find_last_of('/');
  return i == std::string::npos ? s : s.substr(i + 1);
}

RelayResult relay(const std::string& local, const std::vector<RelayTarget>& targets, const TransferOptions& options,
                  const std::function<void(const std::vector<RelayHost>&)>& progress) {
  return relay_detail::relay_file(local, targets, options, progress, nullptr);
}

RelayResult relay_detail::relay_file(const std::string& local, const std::vector<RelayTarget>& targets,
                                     const TransferOptions& options,
                                     const std::function<void(const std::vector<RelayHost>&)>& progress,
                                     const manifest::Digest* pack, Joins* joins) {
  if (!options.verify) throw TransferError(errc::bad_argument, "a relay verifies every block: not with --no-verify", false);
  if (options.memory) throw TransferError(errc::bad_argument, "a relay moves a file, not memory", false);
  const int fd = ::open(local.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) throw TransferError(errc_from_errno(errno), "'" + local + "': " + std::strerror(errno), false);
  files::Fd source(fd);
  struct stat sb {};
  if (::fstat(fd, &sb) != 0) throw TransferError(errc_from_errno(errno), "stat '" + local + "'", false);
  if (!S_ISREG(sb.st_mode)) throw TransferError(errc::not_regular_file, "'" + local + "' is not a regular file", false);
  const auto size = static_cast<std::uint64_t>(sb.st_size);
  const auto mtime = files::mtime_ns(sb);
  const auto bs = options.block_size;
  // Hosts that join are anyone's (pull mode): each copy is checked against the source's own
  // digest, on the host before it keeps it and here before the host counts as done.
  std::string expected;
  std::vector<std::uint8_t> expected_bytes;
  if (joins) {
    const auto c = manifest::of_file(fd, size, bs, options.cancel);
    if (c.code != errc::ok) throw TransferError(c.code, "'" + local + "': " + c.message, false);
    expected = manifest::hex(c.digest);
    expected_bytes.assign(c.digest.begin(), c.digest.end());
  }

  Chain chain;
  chain.size = size;
  auto make_place = [&](const RelayTarget& t) {
    auto p = std::make_unique<Place>();
    p->index = chain.places.size();
    p->target = t;
    p->host.target = t;
    const auto& h = t.server.host;
    p->name = (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + std::to_string(t.server.port);
    p->hop.address = p->name;
    p->path = t.path.empty() || t.path.back() == '/' ? t.path + relay_detail::base_name(local) : t.path;
    chain.places.push_back(std::move(p));
    return chain.places.back().get();
  };
  for (const auto& t : targets) make_place(t);
  // The same host and file twice would be one copy fed twice: the second is left out.
  for (std::size_t i = 0; i < chain.places.size(); ++i)
    for (std::size_t j = 0; j < i; ++j) {
      auto& a = *chain.places[i];
      auto& b = *chain.places[j];
      if (!a.dropped && a.target.server.host == b.target.server.host && a.target.server.port == b.target.server.port &&
          a.path == b.path) {
        a.host.code = errc::bad_argument;
        a.host.message = "the same host and file as host " + std::to_string(j + 1) + " of the list";
        a.dropped = true;
      }
    }

  // Places from the last to the first: each plan names the registered hosts after it, with
  // their server keys as their handshakes proved them.
  SessionOptions control = options;
  control.channels = 1;
  std::vector<Place*> order;  // the chain: registered places, in order
  // A place's registration: the file, a fresh ticket, the hops after it (none yet).
  auto place_negotiation = [&](const Place& p) {
    wire::Negotiation n;
    n.mode = Mode::relay;
    n.remote_path = p.path;
    n.file_size = size;
    n.source_mtime_ns = mtime;
    xsec::random_fill(n.relay_plan.ticket);
    n.relay_plan.protect = static_cast<std::uint8_t>(options.protect);
    n.relay_plan.mode = static_cast<std::uint32_t>(sb.st_mode & 0777);
    n.relay_plan.pack = pack != nullptr;
    if (pack) n.relay_plan.pack_digest = *pack;
    n.relay_plan.digest = expected_bytes;
    n.relay_plan.channels = options.channels;
    return n;
  };
  for (std::size_t k = chain.places.size(); k-- > 0;) {
    auto& p = *chain.places[k];
    if (p.dropped) continue;
    wire::Negotiation n = place_negotiation(p);
    for (std::size_t i = 0; i < order.size() && i < wire::max_relay_hops; ++i) n.relay_plan.next.push_back(order[i]->hop);
    try {
      p.session = std::make_unique<Session>(p.target.server, control);
      p.session->begin(n);
    } catch (const TransferError& e) {
      p.host.code = e.code();
      p.host.message = e.what();
      p.dropped = true;
      p.session.reset();
      continue;
    }
    p.hop.address = p.name;
    p.hop.server_key = p.session->server_key();
    p.hop.ticket = n.relay_plan.ticket;
    p.sent_next = n.relay_plan.next;
    order.insert(order.begin(), &p);
  }
  chain.t0 = Clock::now();
  for (auto* p : order) p->progress_at = chain.t0;

  // The source's own forwarder: the whole file is there, to the first host that takes it.
  auto feeder = std::make_shared<runtime::RelaySlot>();
  feeder->path = local;
  feeder->size = size;
  feeder->mtime_ns = mtime;
  feeder->block_size = bs;
  feeder->written.store(size);
  feeder->file = std::move(source);
  auto hops_after = [&](std::size_t from) {
    std::vector<wire::RelayHop> v;
    for (std::size_t i = from; i < order.size() && v.size() < wire::max_relay_hops; ++i) v.push_back(order[i]->hop);
    return v;
  };
  feeder->next_hops = hops_after(0);
  TransferOptions base = options;
  base.progress = nullptr;
  std::vector<std::string> notes;
  // What the master changed on the way: kept for the result, and logged as it happens by a
  // chain that runs in a server (Joins::log). Under chain.m.
  auto note = [&notes, joins](const std::string& line) {
    notes.push_back(line);
    if (joins && joins->log) joins->log(line);
  };
  std::thread feeding([feeder, base, &chain, &note] {
    try {
      relay_detail::forward(feeder, base, [&](const std::string& line) {
        std::lock_guard lock(chain.m);
        note(line);
      });
    } catch (...) {
    }
    std::lock_guard lock(feeder->m);
    feeder->forward_done = true;
  });
  // However this ends (an exception too), the threads are stopped and joined first.
  struct Joiner {
    std::shared_ptr<runtime::RelaySlot>& feeder;
    std::thread& feeding;
    Chain& chain;
    ~Joiner() { stop(); }
    void stop() {
      feeder->cancel.store(true);
      feeder->hop_cancel.store(true);
      if (feeding.joinable()) feeding.join();
      for (auto& p : chain.places) {
        if (!p->session) continue;
        if (p->reader.joinable()) {
          boost::asio::post(p->session->io(), [s = p->session.get()] {
            for (auto& ch : s->channels())
              if (ch) ch->close();
          });
          p->reader.join();
        }
      }
    }
  } joiner{feeder, feeding, chain};
  for (auto* p : order) p->reader = std::thread([&chain, p] { read_reports(chain, *p); });

  std::size_t feeder_skips_seen = 0;
  // Routes every host to what follows it in `order` now; only those whose next hops changed hear it.
  auto relink_all = [&] {
    for (std::size_t i = 0; i <= order.size(); ++i) {
      auto next = hops_after(i);
      // (Joining hosts: a head whole already needs nothing from the source.)
      if (i == 0 && joins && !order.empty() && order[0]->reported && order[0]->last.state == State::whole) next.clear();
      if (i == 0) {
        std::lock_guard lock(feeder->m);
        if (feeder->next_hops == next) continue;
        const bool same_head = !feeder->next_hops.empty() && !next.empty() && feeder->next_hops[0] == next[0];
        feeder->next_hops = next;
        ++feeder->relinks;
        feeder->skipped.clear();
        feeder_skips_seen = 0;
        if (!same_head) feeder->hop_cancel.store(true);
        continue;
      }
      auto& p = *order[i - 1];
      if (p.sent_next == next) continue;
      p.sent_next = next;
      p.skips_seen = 0;
      ++p.relinks_sent;
      tell(p, RelayEvent::relink, wire::encode_relink(next));
    }
  };
  // Registers a place again, on a thread of its own (a host that is down takes a connect
  // timeout to say so): as the chain's last host, fed by the one before it.
  auto try_rejoin = [&](Place& p, Clock::time_point now) {
    const wire::Negotiation n = place_negotiation(p);
    SessionOptions o = control;
    o.connect_timeout = std::chrono::milliseconds(3000);
    o.notice = nullptr;
    if (p.member) o.server_key = p.member->key;  // the key its pull session proved
    p.coming_ticket = n.relay_plan.ticket;
    p.tried_at = now;
    ++p.tries;
    p.coming = std::async(std::launch::async, [o, n, where = p.target.server, &chain]() {
      // However it ends, the master looks at once (the future outlives nothing of the chain's:
      // a Place waits for it when it goes, before the chain's mutex does).
      struct Wake {
        Chain& c;
        ~Wake() {
          std::lock_guard lock(c.m);
          c.news = true;
          c.heard.notify_one();
        }
      } wake{chain};
      auto s = std::make_unique<Session>(where, o);
      (void)s->begin(n);
      return s;
    });
  };
  auto drop = [&](Place& p, errc code, const std::string& why) {
    if (joins && !p.dropped) note(p.name + " is out of the chain: " + why);
    p.dropped = true;
    if (p.host.code == errc::ok) {
      p.host.code = code;
      p.host.message = why;
    }
    if (!p.gone) tell(p, RelayEvent::give_up, wire::encode(wire::ExceptionHeader{code, why, 0, 0}));
    std::erase(order, &p);
  };

  // A host asking to join wakes the master at once.
  if (joins) {
    std::lock_guard j(joins->m);
    joins->wake = [&chain] {
      chain.poke.store(true);
      chain.heard.notify_one();
    };
  }
  struct Unwake {
    Joins* joins;
    ~Unwake() {
      if (!joins) return;
      std::lock_guard j(joins->m);
      joins->wake = nullptr;
    }
  } unwake{joins};
  if (joins) chain.news = true;  // (its first hosts are waiting already)
  const bool cancelled_at_start = options.cancel && options.cancel->load();
  bool released = false;
  auto released_at = Clock::now();
  auto last_change = chain.t0;
  for (;;) {
    {
      std::unique_lock lock(chain.m);
      chain.heard.wait_for(lock, std::chrono::milliseconds(50), [&] { return chain.news || chain.poke.load(); });
      chain.news = false;
      chain.poke.store(false);
    }
    const auto now = Clock::now();
    const bool cancel = cancelled_at_start || (options.cancel && options.cancel->load());
    {
      std::lock_guard lock(chain.m);
      bool changed = false;
      // A chain that runs in a server stops with it: every host still in it hears so.
      if (joins && cancel) {
        for (auto& pp : chain.places)
          if (pp->member && !pp->told) {
            if (!pp->gone && !pp->dropped) tell(*pp, RelayEvent::give_up, wire::encode(wire::ExceptionHeader{
                                                                           errc::shutting_down, "the master stops", 0, 0}));
            pp->told = true;
            std::lock_guard m(pp->member->m);
            pp->member->host.code = errc::shutting_down;
            pp->member->host.message = "the master stops";
            pp->member->final = true;
          }
        std::lock_guard j(joins->m);
        joins->closed = true;
        break;
      }
      if (joins) {
        // Hosts asking to join: each is registered at the end of the chain, as a lost host
        // coming back is, with the key its own session proved.
        std::vector<std::shared_ptr<relay_detail::Member>> in;
        {
          std::lock_guard j(joins->m);
          in.swap(joins->arriving);
        }
        for (auto& m : in) {
          auto* p = make_place(m->target);
          p->member = m;
          p->dropped = p->rejoinable = true;
          p->reader_done.store(true);  // (no reader yet)
          p->joined_at = now;
        }
        // One that went away (its pull session ended) is out for good.
        for (auto& pp : chain.places) {
          auto& p = *pp;
          if (!p.member || p.told || !p.member->gone.load()) continue;
          if (!p.dropped) {
            drop(p, errc::cancelled, "it went away");
            changed = true;
          }
          p.rejoinable = false;
          // A registration still on its way is let go once it is done.
          if (p.coming.valid() && p.coming.wait_for(std::chrono::seconds(0)) == std::future_status::ready) try {
              (void)p.coming.get();
            } catch (...) {
            }
        }
        for (auto& pp : chain.places)
          if (pp->member && !pp->told && pp->dropped && pp->rejoinable && pp->tries >= joins->max_tries &&
              !pp->coming.valid()) {
            pp->rejoinable = false;
            // (Only registrations that failed say its server cannot be reached: a host dropped
            // as stalled keeps its own reason.)
            if (pp->host.code == errc::ok) {
              pp->host.code = errc::connection_failed;
              pp->host.message = fmt::format("the master could not reach this host's server at {} ({} tries){}", pp->name,
                                             pp->tries, pp->host.message.empty() ? "" : ": " + pp->host.message);
            }
          }
      }
      for (auto* p : released ? std::vector<Place*>{} : std::vector<Place*>(order)) {
        if (cancel) {
          drop(*p, errc::cancelled, "cancelled");
          continue;
        }
        // Lost: its session ended.
        if (p->gone) {
          drop(*p, p->host.code == errc::ok ? errc::peer_aborted : p->host.code,
               p->host.message.empty() ? "its session ended" : p->host.message);
          p->rejoinable = true;
          changed = true;
          continue;
        }
      }
      // Stalled, by its own word (nothing fed it for the server's idle timeout) or by ours: only
      // the first such host whose upstream has more than it (those after it wait on it), one at
      // a time (the chain changes, and every clock starts again).
      for (std::size_t i = 0; !released && !cancel && !changed && i < order.size(); ++i) {
        auto* p = order[i];
        const bool stuck = p->reported && p->last.state == State::failed;
        const bool still = p->last.state != State::whole && now - p->progress_at >= options.idle_timeout;
        const bool ahead = i == 0 || order[i - 1]->last.verified > p->last.verified;
        if ((stuck || still) && ahead) {
          drop(*p, stuck ? p->last.code : errc::timeout,
               stuck ? p->last.message : fmt::format("no progress for {} s", options.idle_timeout.count() / 1000));
          p->rejoinable = true;
          changed = true;
        }
      }
      // A host that was lost and answers again is fed from what it has, at the end of the chain.
      for (auto& pp : chain.places) {
        auto& p = *pp;
        if (released || cancel || !p.rejoinable || !p.dropped) continue;
        if (!p.coming.valid()) {
          if (now - p.tried_at >= std::chrono::seconds(1)) try_rejoin(p, now);
          continue;
        }
        if (p.coming.wait_for(std::chrono::seconds(0)) != std::future_status::ready || !p.reader_done.load()) continue;
        std::unique_ptr<Session> back;
        try {
          back = p.coming.get();
        } catch (const std::exception& e) {
          if (p.member) {
            note(fmt::format("{} cannot take its place yet (try {}): {}", p.name, p.tries, e.what()));
            p.host.message = e.what();
          }
          continue;  // not yet: tried again in a second
        }
        if (p.reader.joinable()) p.reader.join();  // the old session's, which ended
        if (p.member && !p.rejoinable) continue;   // it went away meanwhile
        p.session = std::move(back);
        p.machine = relay_fsm::RelayMachine(relay_fsm::RelaySide::master);
        p.reader_done.store(false);
        p.hop.ticket = p.coming_ticket;
        p.hop.server_key = p.session->server_key();
        p.sent_next.clear();
        p.relinks_sent = 0;
        p.skips_seen = 0;
        p.last = {};
        p.reported = p.gone = p.dropped = p.released = false;
        p.host.code = errc::ok;
        p.host.message.clear();
        p.progress_at = now;
        p.samples.clear();
        p.most = 0;
        p.passed = 0;
        order.push_back(&p);
        note(p.joined || !p.member ? p.name + " answers again: it goes on from what it has, at the end of the chain"
                                   : p.name + " joins at the end of the chain");
        p.joined = true;
        p.reader = std::thread([&chain, pp = &p] { read_reports(chain, *pp); });
        changed = true;
      }
      // Whole, but not the source's file: dropped at once.
      std::string source_digest = expected;
      if (source_digest.empty()) {
        std::lock_guard f(feeder->m);
        source_digest = feeder->sent_digest;
      }
      for (auto* p : released || source_digest.empty() ? std::vector<Place*>{} : std::vector<Place*>(order))
        if (p->reported && p->last.state == State::whole && hex(p->last.digest) != source_digest) {
          drop(*p, errc::integrity_error, "its whole-file digest " + hex(p->last.digest) + " is not the source's");
          changed = true;
        }
      // A host whose copy is damaged: the host after it says its blocks failed their digests.
      // Only the host the master itself routed to feed it can be blamed: a host cannot get any
      // other dropped by naming it.
      for (std::size_t i = 1; !released && i < order.size(); ++i) {
        auto* p = order[i];
        auto* q = order[i - 1];
        if (!p->reported || p->last.upstream_code != errc::integrity_error) continue;
        if (p->last.upstream.size() == q->hop.server_key.size() &&
            std::equal(q->hop.server_key.begin(), q->hop.server_key.end(), p->last.upstream.begin())) {
          drop(*q, errc::integrity_error,
               "its copy is damaged: blocks it sent failed their digests at " + p->name + " (" +
                   p->last.upstream_message + ")");
          changed = true;
          break;
        }
      }
      // A host passed over by the one before it (that one could not feed it) while it still
      // answers here: the one before goes back to it, three times; then it is dropped.
      // (A hop still fed by the upstream it is leaving, or left because the chain changed, says
      // nothing against it.)
      auto passed_over = [&](const std::vector<wire::RelayReport::Skip>& skipped, const std::vector<wire::RelayHop>& hops,
                             std::size_t& seen) {
        while (seen < skipped.size()) {
          const auto& sk = skipped[seen++];
          if (sk.hop >= hops.size() || sk.code == errc::limit_exceeded || sk.code == errc::cancelled) continue;
          for (auto* q : std::vector<Place*>(order))
            if (q->hop == hops[sk.hop] && !q->dropped && q->last.state != State::whole) {
              if (++q->passed > 3) drop(*q, sk.code, "the host before it could not feed it: " + sk.message);
              changed = true;
              return true;
            }
        }
        return false;
      };
      for (std::size_t i = 0; !released && i < order.size(); ++i) {
        auto& u = *order[i];
        // Its skips count hops of the list it heard last: one it has not heard yet says nothing.
        if (u.reported && u.last.relinks == u.relinks_sent && passed_over(u.last.skipped, u.sent_next, u.skips_seen))
          u.sent_next.clear();
      }
      if (!released) {
        std::lock_guard f(feeder->m);
        if (passed_over(feeder->skipped, feeder->next_hops, feeder_skips_seen)) feeder->next_hops.clear();
      }
      // A host far slower than the one feeding it (which has blocks waiting for it) goes to the
      // end of the chain, where it delays nobody.
      for (std::size_t i = 1; !released && i + 1 < order.size(); ++i) {
        auto& u = *order[i - 1];
        auto& p = *order[i];
        if (p.moved || !p.reported || p.last.state == State::whole || now - last_change < std::chrono::seconds(2)) continue;
        const double r = rate_of(p);
        const bool waiting = u.last.verified >= p.last.verified + 8ull * bs;
        const bool slow = waiting && u.peak > 0 && r < 0.4 * u.peak && p.samples.size() >= 5;
        if (!slow) p.slow_since = Clock::time_point{};
        else if (p.slow_since == Clock::time_point{}) p.slow_since = now;
        // Slow for a second on end, not a moment's dip (a reconnect, a resumed prefix hashed).
        if (slow && now - p.slow_since >= std::chrono::seconds(1)) {
          p.moved = true;
          p.moved_at = now;
          note(fmt::format("{} gets {:.1f} MB/s where {} sends up to {:.1f} MB/s: it goes to the end of the chain",
                                      p.name, r / 1e6, u.name, u.peak / 1e6));
          order.erase(order.begin() + static_cast<std::ptrdiff_t>(i));
          order.push_back(&p);
          changed = true;
          break;
        }
      }
      if (changed) {
        relink_all();
        // Rates and stalls from before the chain changed say nothing of it now.
        last_change = now;
        for (auto* p : order) {
          p->samples.clear();
          p->progress_at = now;
        }
      }
      // Done: every host of the chain whole and none still forwarding; then each is released.
      bool done = true;
      for (auto* p : order)
        done = done && p->reported && p->last.state == State::whole && !p->last.forwarding;
      {
        std::lock_guard f(feeder->m);
        done = done && (feeder->forward_done || order.empty());
      }
      // Joining hosts: the chain's whole head goes once the host after it is whole too (nobody
      // needs it), and the last host once it lingered for later joiners as long as its copy took.
      while (joins && !cancel && !order.empty()) {
        auto& p = *order[0];
        if (!p.reported || p.last.state != State::whole || p.last.forwarding) break;
        const bool next_whole = order.size() > 1 && order[1]->reported && order[1]->last.state == State::whole;
        const auto linger = joins->only_awaited ? Clock::duration::zero()
                                                : std::clamp<Clock::duration>(p.whole_at - p.joined_at,
                                                                              std::chrono::seconds(1), joins->linger_max);
        if (!next_whole) {
          if (order.size() > 1 || now - p.whole_at < linger) break;
          // A host taking its place now, or still to come, keeps the last one, up to
          // linger_max: it will be fed from here.
          const bool joining = std::any_of(chain.places.begin(), chain.places.end(), [](const auto& q) {
            return q->member && !q->told && q->dropped && q->rejoinable;
          });
          if (now - p.whole_at < joins->linger_max && (joining || (joins->awaited && joins->awaited()))) break;
        }
        p.released = true;
        p.released_at = now;
        tell(p, RelayEvent::release, {});
        order.erase(order.begin());
        relink_all();
      }
      if (joins) {
        // A joined host is final once its last word came after its release, or once it is out
        // for good: its pull operation hears how it ended.
        const std::string& source_digest = expected;
        for (auto& pp : chain.places) {
          auto& p = *pp;
          if (!p.member) continue;
          if (p.told) {
            if (p.reader_done.load() && p.reader.joinable()) p.reader.join();
            continue;
          }
          const bool out = p.dropped && !p.rejoinable && !p.coming.valid();
          // (A released host that never says its last word is let go too.)
          const bool let_go = p.released && (p.gone || now - p.released_at > std::max<Clock::duration>(
                                                                                  std::chrono::seconds(10),
                                                                                  options.idle_timeout));
          if (!let_go && !out) continue;
          RelayHost h = p.host;
          h.final = true;
          if (p.whole_at != Clock::time_point{}) h.seconds = std::chrono::duration<double>(p.whole_at - p.joined_at).count();
          h.ok = !out && p.whole_at != Clock::time_point{} && !source_digest.empty() && h.digest == source_digest &&
                 h.code == errc::ok;
          if (!h.ok && h.code == errc::ok) {
            h.code = p.whole_at == Clock::time_point{} ? errc::peer_aborted : errc::integrity_error;
            h.message = p.whole_at == Clock::time_point{} ? "it never had the whole file"
                                                           : "its whole-file digest " + h.digest + " is not the source's";
          }
          p.told = true;
          {
            std::lock_guard m(p.member->m);
            p.member->host = h;
            p.member->final = true;
          }
          if (p.reader_done.load() && p.reader.joinable()) p.reader.join();
        }
        bool all_told = true;
        for (auto& pp : chain.places) all_told = all_told && pp->told;
        if (order.empty() && all_told) {
          std::lock_guard j(joins->m);
          if (joins->arriving.empty()) {
            joins->closed = true;
            break;
          }
        }
      }
      if (!joins && done && !released) {
        released = true;
        released_at = now;
        for (auto& p : chain.places)
          if (p->session && !p->gone) {
            p->released = true;
            tell(*p, RelayEvent::release, {});
          }
      }
      bool all_gone = true;
      for (auto& p : chain.places) all_gone = all_gone && (!p->session || p->gone);
      // (A host writes a pack out before its last word: that may take a while.)
      if (released && (all_gone || now - released_at > std::max<Clock::duration>(std::chrono::seconds(10),
                                                                                 options.idle_timeout)))
        break;
    }
    if (progress) {
      std::vector<RelayHost> v;
      {
        std::lock_guard lock(chain.m);
        for (auto& p : chain.places) {
          v.push_back(p->host);
          v.back().final = p->dropped || p->whole_at != Clock::time_point{};
          v.back().ok = !p->dropped && p->whole_at != Clock::time_point{};
        }
      }
      progress(v);
    }
  }
  joiner.stop();

  RelayResult result;
  result.size = size;
  result.seconds = std::chrono::duration<double>(Clock::now() - chain.t0).count();
  result.digest = feeder->sent_digest;
  result.source_bytes = feeder->sent;
  result.notes = notes;
  for (auto& p : chain.places) {
    auto h = p->host;
    h.final = true;
    if (p->whole_at != Clock::time_point{}) h.seconds = std::chrono::duration<double>(p->whole_at - chain.t0).count();
    h.ok = !p->dropped && h.code == errc::ok && p->whole_at != Clock::time_point{} && !result.digest.empty() &&
           h.digest == result.digest;
    // A pack counts only once the host said it wrote it out.
    if (h.ok && pack && !p->final_heard) {
      h.ok = false;
      h.code = errc::timeout;
      h.message = "it did not say whether it wrote the pack out";
    }
    if (!h.ok && h.code == errc::ok) {
      h.code = result.digest.empty() ? errc::peer_aborted
               : p->whole_at == Clock::time_point{} ? errc::timeout
                                                    : errc::integrity_error;
      h.message = result.digest.empty()                  ? "the source could feed no host of the chain"
                  : p->whole_at == Clock::time_point{} ? "it never had the whole file"
                                                       : "its whole-file digest " + h.digest + " is not the source's";
    }
    result.hosts.push_back(std::move(h));
  }
  return result;
}

}  // namespace xdfs
