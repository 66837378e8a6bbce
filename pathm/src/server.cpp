#include <boost/asio/post.hpp>
#include <fmt/core.h>

#include <algorithm>
#include <condition_variable>

#include "xdfs/detail/path_server.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/wire.hpp"

namespace xdfs::pathm {
namespace {

using Clock = std::chrono::steady_clock;

// An entry that failed, as a reply carries it: no path (replies to put, get and setAttrs have one
// entry per request entry, in order), and a message short enough that 4096 of them fit a message.
Entry failed(const Status& s) {
  Entry f;
  f.code = s.code;
  f.message = s.message.substr(0, 1024);
  return f;
}

// A put or setAttrs reply: no entries when all went well, else one per request entry, in order.
void answer_each(Reply& rep, const std::vector<Status>& outcome) {
  if (std::all_of(outcome.begin(), outcome.end(), [](const Status& s) { return bool(s); })) return;
  for (const auto& s : outcome) rep.entries.push_back(s ? Entry{} : failed(s));
}

// Listing chunks: small enough that even entries with the longest names and targets fit a message.
constexpr std::size_t list_chunk = 256;
// Listing chunks that may wait to be sent, all of a session's listings together, before its
// listing workers pause: a client that asks for many listings and reads none holds this many
// chunks of the server's memory, not a chunk per listing.
constexpr int list_ahead = 8;

Encoded error_reply(std::uint64_t id, const Status& st) {
  Reply r;
  r.id = id;
  r.code = st.code;
  r.message = st.message;
  return encode(r);
}

}  // namespace

// What workers share with the network thread; workers reach the server only through it.
struct PathServer::Shared {
  std::mutex mu;
  std::condition_variable cv;
  int unsent = 0;                                // listing chunks queued, not yet sent
  std::atomic<bool> stopped{false};              // the session ended: long operations stop
};

namespace {

// How long a worker waits for the server's memory before it refuses a request.
constexpr auto memory_wait = std::chrono::seconds(2);

// Bytes a reply may take at most, reserved before the worker builds it (the reservation shrinks
// to what the reply really took).
std::size_t reply_estimate(const Request& r, std::uint64_t get_bytes) {
  constexpr std::size_t text = 2 * wire::max_path_bytes + 1024;  // a message or an entry with its names
  switch (r.op) {
    case Op::get: return static_cast<std::size_t>(get_bytes) + r.entries.size() * 1280 + 4096;
    case Op::put:
    case Op::set_attrs: return r.entries.size() * 1280 + text;  // a failure per entry at worst
    default: return text;
  }
}

std::size_t chunk_estimate(const std::vector<Entry>& chunk) {
  std::size_t n = 1024;
  for (const auto& e : chunk) n += e.path.size() + e.target.size() + 160;
  return n;
}

}  // namespace

PathServer::PathServer(asio::io_context& io, ChannelList& channels, int root, const ServerParams& p, Done done)
    : io_(io),
      channels_(channels),
      root_(root),
      p_(p),
      done_(std::move(done)),
      writer_(root, p.tag, p.fsync, p.block_size, files::max_files_in_progress, files::process_umask(),
              p.max_file_size, p.made),
      shared_(std::make_shared<Shared>()),
      limit_(4 * max_message(p.block_size)),
      watchdog_(io),
      linger_(io),
      retry_(io),
      pool_(p.workers, [this, alive = std::weak_ptr<Shared>(shared_)](const std::string& what) {
        // A worker's job threw: that fails this session, never the process.
        asio::post(io_, [this, alive, what] {
          if (alive.lock()) fail(errc::internal, "path worker: " + what, false, true);
        });
      }) {}

PathServer::~PathServer() {
  shared_->stopped = true;
  shared_->cv.notify_all();
  if (p_.budget) p_.budget->wake_all();
  pool_.stop();
}

void PathServer::start() { on(PathEvent::accepted); }

void PathServer::on(PathEvent e, const Arrived& w) {
  if (machine_.finished()) return;
  const auto a = machine_.fire(e);
  if (!a) return fail(errc::state_violation, machine_.why(), false, true);
  switch (*a) {
    case PathAction::serve: return serve();
    case PathAction::execute: return execute_later(w);
    case PathAction::send_eofr: return send_eofr();
    case PathAction::finish: return finish();
    case PathAction::none: return;
    default: return fail(errc::internal, std::string("the path server has no handler for ") + to_string(*a), false, true);
  }
}

void PathServer::serve() {
  last_ = Clock::now();
  arm_watchdog();
  for (auto& ch : channels_) read_loop(*ch);
}

void PathServer::arm_watchdog() {
  watchdog_.expires_after(std::chrono::milliseconds(500));
  watchdog_.async_wait([this](const xdsi::ErrorCode& ec) {
    if (ec || machine_.finished()) return;
    // Idle: nothing received and no reply written out for that long, with no worker busy (a
    // long checksum sends nothing meanwhile) or with replies waiting to be written (a client
    // that stops reading its replies, a listing's among them, counts as idle too).
    if ((busy_ == 0 || sending_ > 0) && Clock::now() - last_ > p_.idle_timeout)
      return fail(errc::timeout, fmt::format("no progress for {} ms", p_.idle_timeout.count()), false, true,
                  PathEvent::timeout);
    arm_watchdog();
  });
}

void PathServer::read_loop(xdsi::Channel& ch) {
  ch.async_read_header([this, &ch](const xdsi::ErrorCode& ec, const wire::FrameHeader& h) {
    if (machine_.finished()) return;
    if (ec) return channel_failed(ch, ec);
    // A NOOP keeps an idle session (RemoteFs sends them), not one whose client has stopped
    // reading its replies: that one holds the server's memory and must time out.
    if (h.event != wire::ChannelEvent::noop || (sending_ == 0 && parked_.empty())) last_ = Clock::now();
    // A frame with a payload is not authenticated until its tag, after the payload: one that
    // should have none is refused before it is acted on.
    if ((h.event == wire::ChannelEvent::eofr || h.event == wire::ChannelEvent::noop) && h.length != 0)
      return fail(errc::protocol_error, fmt::format("{} with a payload", wire::to_string(h.event)), false, true);
    switch (h.event) {
      case wire::ChannelEvent::xpathm: {
        if (h.length == 0 || h.length > max_message(p_.block_size))
          return fail(errc::protocol_error,
                      fmt::format("path request of {} bytes (this session takes 1..{})", h.length,
                                  max_message(p_.block_size)),
                      false, true);
        return admit(ch, h);
      }
      case wire::ChannelEvent::eofr: {
        // The client ends the path operation on this channel (it has every answer): the
        // channel is not read again in this operation.
        if (eofr_[ch.index()])
          return fail(errc::protocol_error, fmt::format("EOFR twice on channel {}", ch.index()), false, true);
        eofr_[ch.index()] = true;
        ++eofrs_;
        on(eofrs_ == channels_.size() ? PathEvent::all_ended : PathEvent::channel_ended);
        return maybe_end();
      }
      case wire::ChannelEvent::noop: return read_loop(ch);
      case wire::ChannelEvent::exception: {
        if (h.length > wire::max_control_payload) return fail(errc::protocol_error, "oversized exception header", false, true);
        auto buf = std::make_shared<std::vector<std::uint8_t>>(h.length);
        ch.async_read_payload(*buf, [this, buf, &ch](const xdsi::ErrorCode& ec) {
          if (machine_.finished()) return;
          if (ec) return channel_failed(ch, ec);
          std::string why;
          auto ex = wire::decode_exception(*buf, &why);
          if (!ex) return fail(errc::protocol_error, "bad exception header: " + why, false, false);
          fail(ex->code, ex->message, true, false, PathEvent::peer_exception);
        });
        return;
      }
      default:
        return fail(errc::protocol_error,
                    std::string("unexpected ") + wire::to_string(h.event) + " frame in a path session", false, true);
    }
  });
}

void PathServer::admit(xdsi::Channel& ch, const wire::FrameHeader& h) {
  // The session's bound: what its workers hold and its replies not yet sent. The channel parks
  // with the header read and the payload not: nothing of it is in memory yet.
  if (busy_ >= max_busy() || (inflight_ > 0 && inflight_ + h.length > limit_)) {
    parked_.push_back({&ch, h});
    return;
  }
  // The server's: the payload's buffer is reserved before it exists.
  auto r = Reservation::take(p_.budget, h.length);
  if (!r) {
    parked_.push_back({&ch, h});
    if (!retry_armed_) {
      // Other sessions hold the memory: nothing of this one may free it, so look again soon.
      retry_armed_ = true;
      retry_.expires_after(std::chrono::milliseconds(50));
      retry_.async_wait([this](const xdsi::ErrorCode& ec) {
        retry_armed_ = false;
        if (!ec) resume();
      });
    }
    return;
  }
  auto held = std::make_shared<Reservation>(std::move(*r));
  inflight_ += h.length;
  auto buf = Buffer::make(h.length);
  ch.async_read_payload(buf->writable(), [this, &ch, buf, held](const xdsi::ErrorCode& ec) {
    if (machine_.finished()) return;
    if (ec) return channel_failed(ch, ec);
    on(PathEvent::request, Arrived{&ch, buf, held});
  });
}

void PathServer::channel_failed(xdsi::Channel& ch, const xdsi::ErrorCode& ec) {
  auto f = ch.failure(ec, "client");
  fail(f.code, f.message, f.from_peer, !f.peer_gone, f.peer_gone ? PathEvent::channel_lost : PathEvent::local_error);
}

void PathServer::execute_later(const Arrived& w) {
  ++busy_;
  ++requests_;
  last_ = Clock::now();
  pool_.submit([this, c = w.ch, buf = w.buf, held = w.held] { execute(c, buf, held); });
  read_loop(*w.ch);  // the next header; whether its payload is read then is admit's call
}

void PathServer::resume() {
  if (machine_.finished()) return;
  auto parked = std::move(parked_);
  parked_.clear();
  for (const auto& p : parked) admit(*p.ch, p.h);  // in order; what still does not fit parks again
}

void PathServer::send_reply(xdsi::Channel* ch, Encoded e, std::function<void()> sent) {
  if (machine_.finished() || !ch->open()) {
    if (sent) sent();
    return;
  }
  auto holder = std::make_shared<Encoded>(std::move(e));
  wire::FrameHeader h;
  h.event = wire::ChannelEvent::xpathm;
  h.length = static_cast<std::uint32_t>(holder->size);
  ++sending_;
  ch->send(h, holder->bytes(), [this, ch, holder, sent = std::move(sent)](const xdsi::ErrorCode& ec) {
    --sending_;
    if (!ec) last_ = Clock::now();
    // A channel that is not being read (parked) learns of a vanished client only here.
    if (ec && ec != boost::asio::error::operation_aborted && !machine_.finished()) channel_failed(*ch, ec);
    if (!ec) on(PathEvent::replied);
    if (sent) sent();
    maybe_end();
  });
}

// The client ended the operation on every channel: once every request it sent is answered and
// the answers have left, EOFR goes back on every channel, and the channels are the session's
// again. Files the client left unfinished are discarded.
void PathServer::maybe_end() {
  if (machine_.state() != PathState::ending || busy_ != 0 || sending_ != 0 || !parked_.empty()) return;
  on(PathEvent::all_answered);
}

void PathServer::send_eofr() {
  watchdog_.cancel();
  retry_.cancel();
  shared_->stopped = true;
  shared_->cv.notify_all();
  writer_.discard_all();
  // A client that does not read the EOFRs (its window closed) must not hold the session: they
  // have the idle timeout to leave, then the operation fails like any other.
  linger_.expires_after(p_.idle_timeout);
  linger_.async_wait([this](const xdsi::ErrorCode& ec) {
    if (ec || machine_.finished()) return;
    fail(errc::timeout,
         fmt::format("the client did not read the end of the path operation for {} ms", p_.idle_timeout.count()), false,
         false, PathEvent::timeout);
  });
  auto left = std::make_shared<std::size_t>(channels_.size());
  for (auto& c : channels_) {
    wire::FrameHeader h;
    h.event = wire::ChannelEvent::eofr;
    c->send(h, std::vector<std::uint8_t>{}, [this, left, ch = c.get()](const xdsi::ErrorCode& ec) {
      if (machine_.finished()) return;
      if (ec) return channel_failed(*ch, ec);
      if (--*left == 0) on(PathEvent::committed);
    });
  }
}

void PathServer::finish() {
  linger_.cancel();
  done_(errc::ok, "", false);
}

// On a worker: decode, do the file-system work, and hand the replies to the network thread. A
// throw here fails this session with its reason.
void PathServer::execute(xdsi::Channel* ch, std::shared_ptr<Buffer> buf, Held held) {
  try {
    answer(ch, buf, held);
  } catch (const std::exception& e) {
    std::weak_ptr<Shared> alive = shared_;
    asio::post(io_, [this, alive, what = std::string(e.what())] {
      if (alive.lock()) fail(errc::internal, "path worker: " + what, false, true);
    });
  }
}

void PathServer::answer(xdsi::Channel* ch, std::shared_ptr<Buffer>& buf, Held& held) {
  std::weak_ptr<Shared> alive = shared_;
  const std::size_t cost = buf->size;
  // A request counts against the limits until its reply has left: a client that asks for
  // file bytes and never reads them stops being read itself.
  auto post = [this, alive, ch, cost, held](Encoded e, Held reply_held) {
    if (reply_held) reply_held->shrink_to(e.size);
    asio::post(io_, [this, alive, ch, cost, held, reply_held, e = std::move(e)]() mutable {
      if (!alive.lock()) return;
      const std::size_t reply = e.size;
      --busy_;
      inflight_ += reply;
      last_ = Clock::now();
      send_reply(ch, std::move(e), [this, alive, cost, reply, held, reply_held] {
        if (!alive.lock()) return;
        held->reset();
        if (reply_held) reply_held->reset();
        inflight_ -= cost + reply;
        last_ = Clock::now();
        resume();
      });
    });
  };
  // Room for a reply in the server's memory, waited for a little; refused after that.
  auto reserve = [this](std::size_t bytes) -> Held {
    if (!p_.budget) return std::make_shared<Reservation>();
    if (!p_.budget->reserve(bytes, memory_wait, &shared_->stopped)) return nullptr;
    return std::make_shared<Reservation>(p_.budget, bytes);
  };
  auto out_of_memory = [this](std::uint64_t id) {
    return error_reply(id, {errc::limit_exceeded,
                            fmt::format("the server's memory for transfers ({} MiB) is in use; try again later",
                                        p_.budget ? p_.budget->limit() >> 20 : 0)});
  };
  std::string why;
  auto req = decode_request(buf->bytes(), &why);
  if (!req) {
    asio::post(io_, [this, alive, why] {
      if (alive.lock()) fail(errc::protocol_error, "bad path request: " + why, false, true);
    });
    return;
  }
  Request& r = *req;
  if (p_.metrics) p_.metrics->add("xdfs_path_operations_total", {{"op", to_string(r.op)}});
  const bool writes = r.op == Op::mkdir || r.op == Op::remove || r.op == Op::rename || r.op == Op::put ||
                      r.op == Op::set_attrs;
  if (writes && p_.read_only)
    return post(error_reply(r.id, {errc::permission_denied, std::string(to_string(r.op)) +
                                                                ": this client key is read-only"}),
                nullptr);
  // A get's bytes, summed without overflow: the sizes are the peer's.
  const std::uint64_t budget = 2ull * p_.block_size;
  std::uint64_t want = 0;
  if (r.op == Op::get)
    for (const auto& e : r.entries) want = e.size > budget - std::min(want, budget) ? budget + 1 : want + e.size;
  if (r.op == Op::get && want > budget)
    return post(error_reply(r.id, {errc::limit_exceeded, fmt::format("get of more than {} bytes in one request", budget)}),
                nullptr);
  Held reply_held;
  if (r.op != Op::list) {
    reply_held = reserve(reply_estimate(r, want));
    if (!reply_held) return post(out_of_memory(r.id), nullptr);
  }
  Reply rep;
  rep.id = r.id;
  Status st;
  const Stop stop = &shared_->stopped;
  switch (r.op) {
    case Op::stat: {
      Entry e;
      st = stat_entry(root_, r.path, e);
      if (st) rep.entries.push_back(std::move(e));
      break;
    }
    case Op::list: {
      auto shared = shared_;
      bool starved = false;
      st = list_dir(
          root_, r.path, r.recursive, false, list_chunk,
          [&](std::vector<Entry>& chunk) {
            if (chunk.empty()) return true;
            Reply part;
            part.id = r.id;
            part.last = false;
            part.entries = std::move(chunk);
            chunk.clear();
            {
              // Counted as it is let through, so that workers listing at once cannot all pass.
              std::unique_lock lk(shared->mu);
              shared->cv.wait(lk, [&] { return shared->stopped || shared->unsent < list_ahead; });
              if (shared->stopped) return false;
              ++shared->unsent;
            }
            Held chunk_held = reserve(chunk_estimate(part.entries));
            if (!chunk_held) {
              {
                std::lock_guard lk(shared->mu);
                --shared->unsent;
              }
              shared->cv.notify_all();
              starved = true;
              return false;
            }
            auto e = encode(part);
            chunk_held->shrink_to(e.size);
            asio::post(io_, [this, alive, ch, chunk_held, e = std::move(e)]() mutable {
              auto s = alive.lock();
              if (!s) return;
              auto done = [s, chunk_held] {
                chunk_held->reset();
                {
                  std::lock_guard lk(s->mu);
                  --s->unsent;
                }
                s->cv.notify_all();
              };
              if (machine_.finished() || !ch->open()) return done();
              send_reply(ch, std::move(e), done);
            });
            return true;
          },
          stop);
      if (starved) return post(out_of_memory(r.id), nullptr);
      reply_held = reserve(reply_estimate(r, 0));
      if (!reply_held) return post(out_of_memory(r.id), nullptr);
      break;
    }
    case Op::mkdir: st = writer_.make_dir(r.path, r.recursive, r.mode); break;
    case Op::remove:
      if (auto c = check_path(r.path); c && (r.path.empty() || r.path == "."))
        st = {errc::permission_denied, "refusing to remove the root"};
      else
        st = remove_path(root_, r.path, r.recursive, stop);
      break;
    case Op::rename: st = rename_path(root_, r.path, r.to); break;
    case Op::checksum:
      if (r.block_size != 0) {
        st = r.offset || r.length ? Status{errc::bad_argument, "a manifest digest covers the whole file"}
                                  : manifest_digest(root_, r.path, r.block_size, rep.digest, stop);
        rep.algorithm = manifest::algorithm;
        break;
      }
      st = checksum(root_, r.path, r.offset, r.length, rep.digest, stop);
      rep.algorithm = "sha256";
      break;
    case Op::put: {
      // Each entry on its own: one that fails is answered, the others go on (like rsync).
      std::uint64_t n = 0;
      std::vector<Status> outcome;
      outcome.reserve(r.entries.size());
      for (const auto& e : r.entries) {
        if (shared_->stopped) break;
        if (e.code != errc::ok) {  // the client could not read it: skipped (a large file given up)
          if (e.file_id != 0) writer_.abandon(e.file_id);
          outcome.push_back(Status::ok());
          continue;
        }
        outcome.push_back(writer_.put(e));
        if (outcome.back()) n += e.data.size();
      }
      bytes_ += n;
      outcome.resize(r.entries.size(), Status{errc::cancelled, "the session ended"});
      answer_each(rep, outcome);
      break;
    }
    case Op::set_attrs: {
      std::vector<Status> outcome;
      outcome.reserve(r.entries.size());
      for (const auto& e : r.entries) outcome.push_back(writer_.set_attrs(e));
      answer_each(rep, outcome);
      break;
    }
    case Op::get: {
      // Files are read straight into the reply; one that cannot be read is answered as failed
      // and the others go on.
      auto w = Writer::reply(r.id, r.entries.size(), static_cast<std::size_t>(want));
      std::uint64_t total = 0;
      for (std::size_t i = 0; i < r.entries.size(); ++i) {
        const auto& q = r.entries[i];
        files::Fd fd;
        Entry e;
        Status s = open_file(root_, q.path, fd, e);
        std::uint64_t off = 0, len = e.size;
        if (s && q.file_id != 0) {
          off = q.offset;
          len = q.size;
          if (len > p_.block_size || off > e.size || e.size - off < len)
            s = {errc::size_mismatch, "'" + q.path + "' is shorter than the range asked for (it changed?)"};
        }
        // What the reply may carry is what the client asked for (its sizes were reserved): a
        // whole file that is now larger than the size asked for changed since it was listed.
        if (s && q.file_id == 0 && len > q.size)
          s = {errc::size_mismatch, "'" + q.path + "' is larger than the " + std::to_string(q.size) +
                                        " bytes asked for (it changed since it was listed?)"};
        if (s && (len > want || total > want - len))
          s = {errc::size_mismatch, "'" + q.path + "' grew while it was being copied"};
        if (s) {
          e.offset = off;
          e.file_id = q.file_id;
          auto dst = w.set(i, e, static_cast<std::size_t>(len));
          s = read_exact(fd.get(), dst, off, q.path);
        }
        if (!s) {
          w.set(i, failed(s), 0);
          continue;
        }
        total += len;
      }
      bytes_ += total;
      return post(w.finish(), reply_held);
    }
  }
  if (!st) return post(error_reply(r.id, st), reply_held);
  post(encode(rep), reply_held);
}

void PathServer::abort(errc code, const std::string& message) { fail(code, message, false, true); }

void PathServer::fail(errc code, const std::string& message, bool from_peer, bool tell, PathEvent ev) {
  if (machine_.finished()) return;
  // Every live state has the failure rows: the machine is failed now, and abort runs.
  if (!machine_.fire(ev)) (void)machine_.fire(PathEvent::local_error);
  watchdog_.cancel();
  retry_.cancel();
  shared_->stopped = true;
  shared_->cv.notify_all();
  if (p_.budget) p_.budget->wake_all();
  writer_.discard_all();
  if (tell) {
    xdsi::tell_and_close(channels_, wire::ExceptionHeader{code, message, 0, 0}, linger_, std::chrono::seconds(2));
  } else {
    for (auto& c : channels_)
      if (c) c->close();
  }
  done_(code, message, from_peer);
}

}  // namespace xdfs::pathm
