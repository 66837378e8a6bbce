#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <fmt/core.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "xdfs/pathm/path_client.hpp"

#include "xdfs/detail/path_fsm.hpp"
#include "xdfs/types.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/wire.hpp"

namespace xdfs::pathm {
namespace {

using Clock = std::chrono::steady_clock;
using files::Fd;

std::string hex(const std::vector<std::uint8_t>& d) {
  std::string s;
  for (auto b : d) s += fmt::format("{:02x}", b);
  return s;
}

// Makes a local directory and its parents.
void make_local_dirs(const std::string& path) {
  std::string cur;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), 0777) != 0 && errno != EEXIST)
      throw Error(errc_from_errno(errno), "mkdir '" + cur + "': " + std::strerror(errno));
  }
}

Fd open_local_dir(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) {
    const int err = errno;
    if (err == ENOTDIR) throw Error(errc::not_regular_file, "'" + path + "' is not a directory");
    throw Error(errc_from_errno(err), "'" + path + "': " + std::strerror(err));
  }
  return fd;
}

// A local entry as the server would see it: resolved beneath dir, where a symbolic link that
// leads out of it is refused (a link in the destination tree must not make a file outside it
// look up to date); the last component is not followed.
Entry local_entry(int dir, const std::string& rel) {
  Entry e;
  if (auto st = stat_entry(dir, rel, e); !st) {
    e = Entry{};
    e.type = Type::other;
    e.mode = 0xffffffff;  // marks "missing"
  }
  e.path = rel;
  return e;
}

bool same(const Entry& a, const Entry& b) {
  if (a.type != b.type) return false;
  if (a.type == Type::symlink) return a.target == b.target;
  return a.size == b.size && a.mtime_ns == b.mtime_ns;
}

// One unit of tree work: a batch of whole small files, or one chunk of a large file.
struct Unit {
  std::size_t first = 0, count = 0;  // range in the file list
  std::uint64_t bytes = 0;
  bool chunk = false;
  std::uint64_t offset = 0;
};

// prefix: bytes the remote base adds to each name. A batch's names are bounded too: a message
// may carry one block of file bytes plus 4 MiB of everything else (max_message), and 1024 names
// near the 4096-byte limit would not fit beside the bytes.
std::vector<Unit> plan(const std::vector<Entry>& files, std::uint32_t block, std::size_t batch_bytes,
                       std::size_t prefix) {
  constexpr std::size_t name_budget = 2u << 20;  // names plus per-entry overhead, per batch
  constexpr std::size_t entry_overhead = 128;     // an Entry struct and its text padding
  std::vector<Unit> units;
  const std::uint64_t small = std::max<std::uint64_t>(block / 4, 4096);
  Unit cur;
  std::size_t names = 0;
  auto flush = [&] {
    if (cur.count) units.push_back(cur);
    cur = Unit{};
    names = 0;
  };
  for (std::size_t i = 0; i < files.size(); ++i) {
    const auto& f = files[i];
    if (f.size <= small) {
      const std::size_t name = prefix + f.path.size() + entry_overhead;
      if (cur.count && (cur.bytes + f.size > batch_bytes || cur.count >= 1024 || names + name > name_budget)) flush();
      if (!cur.count) cur.first = i;
      ++cur.count;
      cur.bytes += f.size;
      names += name;
      continue;
    }
    flush();  // a batch is a contiguous run of the list
    // A large file is one unit here; its chunks are made one at a time as they are sent
    // (TreePlan::take), never all at once: a size from a server is as untrusted as its names.
    units.push_back(Unit{i, 1, f.size, true, 0});
  }
  flush();
  return units;
}

}  // namespace

PathClient::PathClient(asio::io_context& io, ChannelList& channels, std::uint32_t block_size, const std::atomic<bool>* cancel,
               std::chrono::milliseconds idle_timeout)
    : io_(io), channels_(channels), block_size_(block_size), cancel_(cancel), idle_timeout_(idle_timeout), watch_(io) {
  machine_ = std::make_unique<PathMachine>(PathSide::client);
  outstanding_.assign(channels_.size(), 0);
  eofr_.assign(channels_.size(), false);
  last_ = Clock::now();
  Work none;
  on(PathEvent::accepted, none);
}

void PathClient::on(PathEvent e, Work& w) {
  if (machine_->finished()) return;
  const auto a = machine_->fire(e);
  if (!a) return fail(errc::state_violation, machine_->why(), false);
  switch (*a) {
    case PathAction::serve:
      for (auto& ch : channels_) read_loop(*ch);
      return;
    case PathAction::send_request: return send_request(w);
    case PathAction::deliver_reply: return deliver_reply(w);
    case PathAction::send_eofr: return send_eofr();
    case PathAction::finish:
    case PathAction::none: return;  // finish: close() sees the machine done and returns
    default: return fail(errc::internal, std::string("the path client has no handler for ") + to_string(*a), false);
  }
}

PathClient::~PathClient() {
  // Channels that did not end cleanly must not be read again on behalf of a client that is gone.
  if (machine_->state() != PathState::done)
    for (auto& ch : channels_)
      if (ch) ch->close();
}

void PathClient::fail(errc code, const std::string& message, bool remote) {
  fail_as(remote ? (code == errc::peer_aborted ? PathEvent::channel_lost : PathEvent::peer_exception)
                 : code == errc::timeout ? PathEvent::timeout
                                         : PathEvent::local_error,
          code, message, remote, !remote);
}

void PathClient::fail_as(PathEvent ev, errc code, const std::string& message, bool remote, bool tell) {
  if (machine_->finished()) return;  // failed (code_ set with it) or done
  // The table's row to failed (every live state has them), then abort: tell the server unless
  // it reported the failure or is gone.
  if (!machine_->fire(ev)) (void)machine_->fire(PathEvent::local_error);
  code_ = code;
  message_ = message;
  remote_ = remote;
  fail_calls();
  auto payload = wire::encode(wire::ExceptionHeader{code, message, 0, 0});
  for (auto& c : channels_) {
    if (!c || !c->open()) continue;
    if (!tell) {
      c->close();
      continue;
    }
    auto* ch = c.get();
    // Closed only once the server has closed too (or the Client goes): closing with its replies
    // unread would reset the connection and could destroy the exception before it is read.
    ch->send_control(wire::ChannelEvent::exception, payload, [ch](const xdsi::ErrorCode&) { ch->linger_close({}); });
  }
}

void PathClient::fail(const Failure& f) {
  if (machine_->finished()) return;
  channel_ = f.channel;
  // Whose fault (from_peer) and whether it can still be told (peer_gone) are separate: a
  // connection that timed out is gone, and not the server's doing.
  fail_as(f.peer_gone ? PathEvent::channel_lost : PathEvent::local_error, f.code, f.message, f.from_peer, !f.peer_gone);
}

std::optional<Failure> PathClient::failure() const {
  if (code_ == errc::ok) return std::nullopt;
  Failure f(code_, message_, remote_);
  f.channel = channel_;
  return f;
}

void PathClient::check() const {
  if (auto f = failure()) throw TransferError(*f);
  if (machine_->state() != PathState::serving)
    throw Error(errc::bad_argument, "the path operation has ended (RemoteFs closed)");
}

void PathClient::read_loop(xdsi::Channel& ch) {
  ch.async_read_header([this, &ch](const xdsi::ErrorCode& ec, const wire::FrameHeader& h) {
    if (machine_->finished()) return;
    if (ec) {
      auto f = ch.failure(ec, "server");
      return fail(f);
    }
    if (h.event == wire::ChannelEvent::exception) {
      if (h.length > wire::max_control_payload) return fail(errc::protocol_error, "oversized exception header", false);
      auto buf = std::make_shared<std::vector<std::uint8_t>>(h.length);
      ch.async_read_payload(*buf, [this, buf](const xdsi::ErrorCode& ec) {
        if (code_ != errc::ok) return;
        if (ec) return fail(errc::peer_aborted, "server closed a channel", true);
        std::string why;
        auto ex = wire::decode_exception(*buf, &why);
        if (!ex) return fail(errc::protocol_error, "bad exception header: " + why, false);
        fail(ex->code, ex->message, true);
      });
      return;
    }
    if (h.event == wire::ChannelEvent::noop) {
      if (h.length != 0) return fail(errc::protocol_error, "NOOP with a payload from the server", false);
      return read_loop(ch);
    }
    if (h.event == wire::ChannelEvent::eofr) {
      // The server's answer to our EOFR: the operation is over on this channel, not read again.
      // Before the client ended, the table refuses it (no row in serving).
      if (h.length != 0 || eofr_[ch.index()])
        return fail(errc::protocol_error, fmt::format("EOFR with a payload or twice on channel {}", ch.index()), false);
      eofr_[ch.index()] = true;
      ++eofrs_;
      Work none;
      return on(eofrs_ == channels_.size() ? PathEvent::committed : PathEvent::channel_ended, none);
    }
    if (h.event != wire::ChannelEvent::xpathm)
      return fail(errc::protocol_error, std::string("unexpected ") + wire::to_string(h.event) + " frame from the server", false);
    if (h.length == 0 || h.length > max_message(block_size_) + (4u << 20))
      return fail(errc::protocol_error, fmt::format("path reply of {} bytes", h.length), false);
    // Replies come on the channel their request went out on: one that asked nothing gets none
    // (and costs nothing).
    if (outstanding_[ch.index()] == 0)
      return fail(errc::protocol_error, fmt::format("path reply on channel {}, which has no request", ch.index()), false);
    // What a reply to this client's requests takes (a block of file bytes and their names) is
    // allocated at once; a larger one grows as its bytes arrive, so that a length the server
    // declares costs nothing until it is sent.
    const std::size_t first = std::min<std::size_t>(h.length, std::size_t(block_size_) + (64u << 10));
    if (first < h.length) return read_reply_in_parts(ch, Buffer::make(first), 0, h.length);
    auto buf = Buffer::make(h.length);
    ch.async_read_payload(buf->writable(), [this, &ch, buf](const xdsi::ErrorCode& ec) { finish_reply(ch, buf, ec); });
  });
}

void PathClient::finish_reply(xdsi::Channel& ch, std::shared_ptr<Buffer> buf, const xdsi::ErrorCode& ec) {
  if (machine_->finished()) return;
  if (ec) {
    auto f = ch.failure(ec, "server");
    return fail(f);
  }
  Work w;
  w.ch = &ch;
  w.buf = std::move(buf);
  on(PathEvent::reply, w);
  read_loop(ch);
}

void PathClient::read_reply_in_parts(xdsi::Channel& ch, std::shared_ptr<Buffer> buf, std::size_t have, std::size_t total) {
  auto part = buf->writable().subspan(have);
  ch.async_read_payload_part(part, [this, &ch, buf, total](const xdsi::ErrorCode& ec) {
    if (ec || machine_->finished()) return finish_reply(ch, buf, ec);
    if (buf->size < total) {
      auto bigger = Buffer::make(std::min(total, 2 * buf->size));
      std::memcpy(bigger->words.get(), buf->words.get(), buf->size);
      return read_reply_in_parts(ch, std::move(bigger), buf->size, total);
    }
    ch.async_check_payload(buf->writable(), [this, &ch, buf](const xdsi::ErrorCode& ec) { finish_reply(ch, buf, ec); });
  });
}

void PathClient::deliver_reply(Work& w) {
  auto buf = std::move(w.buf);
  last_ = Clock::now();
  std::string why;
  auto r = decode_reply(buf->bytes(), &why);
  if (!r) return fail(errc::protocol_error, "bad path reply: " + why, false);
  auto it = pending_.find(r->id);
  if (it == pending_.end()) return fail(errc::protocol_error, fmt::format("reply to unknown request {}", r->id), false);
  // Only a listing comes in parts, and an error ends it: anything else that is not final
  // would run its handler again after its caller had moved on.
  if (!r->last && (!it->second.many || r->code != errc::ok))
    return fail(errc::protocol_error, fmt::format("partial reply to request {}, which has one reply", r->id), false);
  auto handler = it->second.on;  // copy: the handler may send more requests
  if (r->last) {
    --outstanding_[it->second.channel];
    pending_.erase(it);
  }
  // A handler that throws ends the session (its caller's wait() then reports why): it must not
  // unwind out of the loop while replies for the frames it left are still on their way.
  try {
    handler(*r, std::move(buf));
  } catch (const Error& e) {
    fail(e.code(), e.context(), false);
  } catch (const std::exception& e) {
    fail(errc::internal, e.what(), false);
  }
}

std::string PathClient::remote_join(const std::string& base, const std::string& rel) const {
  std::string b = base;
  while (!b.empty() && b.back() == '/') b.pop_back();
  if (b.empty() || b == ".") return rel.empty() ? "." : rel;
  return rel.empty() || rel == "." ? b : b + "/" + rel;
}

void PathClient::send(std::uint64_t id, Encoded e, OnReply on_reply, bool many) {
  if (code_ != errc::ok) return;
  Work w;
  w.id = id;
  w.request = &e;
  w.on_reply = &on_reply;
  w.many = many;
  on(PathEvent::request, w);
}

void PathClient::send_request(Work& w) {
  const std::uint64_t id = w.id;
  const bool many = w.many;
  std::size_t best = 0;
  for (std::size_t i = 1; i < channels_.size(); ++i)
    if (outstanding_[i] < outstanding_[best]) best = i;
  ++outstanding_[best];
  ++requests_;
  pending_.emplace(id, Pending{best, many, std::move(*w.on_reply)});
  auto holder = std::make_shared<Encoded>(std::move(*w.request));
  wire::FrameHeader h;
  h.event = wire::ChannelEvent::xpathm;
  h.length = static_cast<std::uint32_t>(holder->size);
  auto* ch = channels_[best].get();
  ch->send(h, holder->bytes(), [this, holder, ch](const xdsi::ErrorCode& ec) {
    if (ec && ec != boost::asio::error::operation_aborted && code_ == errc::ok) fail(ch->failure(ec, "server"));
  });
}

void PathClient::wait(const std::function<bool()>& done) {
  io_.restart();
  last_ = Clock::now();
  while (code_ == errc::ok && !done()) {
    if (cancel_ && cancel_->load()) {
      fail(errc::cancelled, "cancelled by the user", false);
      break;
    }
    io_.run_one_for(std::chrono::milliseconds(200));
    if (code_ == errc::ok && !pending_.empty() && Clock::now() - last_ > idle_timeout_)
      fail(errc::timeout, fmt::format("no reply from the server for {} ms", idle_timeout_.count()), false);
  }
  if (code_ != errc::ok) {
    // Let the exception header leave before the caller tears the channels down.
    const auto until = Clock::now() + std::chrono::milliseconds(200);
    while (Clock::now() < until && io_.run_one_for(std::chrono::milliseconds(50))) {
    }
  }
  check();
}

std::exception_ptr PathClient::ended() const {
  try {
    check();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

void PathClient::wait_for(std::uint64_t id, const bool& done) {
  try {
    wait([&] { return done; });
  } catch (...) {
    calls_.erase(id);  // its completion refers to the caller's frame
    throw;
  }
}

std::uint64_t PathClient::start_call(Request r, Completion<Reply> done) {
  if (auto e = ended()) {
    detail::fail_later(io_, std::move(done), e);
    return 0;
  }
  r.id = new_id();
  const std::uint64_t id = r.id;
  if (calls_.empty()) last_ = Clock::now();
  calls_.emplace(id, std::move(done));
  send(id, encode(r), [this, id](Reply& rep, std::shared_ptr<Buffer>) {
    auto it = calls_.find(id);
    if (it == calls_.end()) return;  // its caller has gone (a blocking call that failed)
    auto done = std::move(it->second);
    calls_.erase(it);
    for (auto& e : rep.entries) e.data = {};
    if (rep.code != errc::ok) {
      remote_ = true;
      return done(std::make_exception_ptr(TransferError(rep.code, rep.message, true)), Reply{});
    }
    done(nullptr, std::move(rep));
  });
  watch_calls();
  return id;
}

void PathClient::fail_calls() {
  if (calls_.empty()) return;
  // On the loop, after the failure's own handlers: a blocking call that gave up has taken its
  // completion out by then.
  asio::post(io_, [this] {
    auto calls = std::move(calls_);
    calls_.clear();
    const auto e = std::make_exception_ptr(TransferError(*failure()));
    for (auto& [id, done] : calls) {
      try {
        done(e, Reply{});
      } catch (...) {
        // The operation has failed already; one completion's exception must not keep the
        // others from theirs.
      }
    }
  });
}

void PathClient::watch_calls() {
  if (watching_ || calls_.empty()) return;
  watching_ = true;
  watch_.expires_after(std::chrono::milliseconds(200));
  watch_.async_wait([this](const xdsi::ErrorCode& ec) {
    if (ec) return;  // the client is going
    watching_ = false;
    if (calls_.empty() || code_ != errc::ok) return;
    if (cancel_ && cancel_->load()) return fail(errc::cancelled, "cancelled by the user", false);
    if (Clock::now() - last_ > idle_timeout_)
      return fail(errc::timeout, fmt::format("no reply from the server for {} ms", idle_timeout_.count()), false);
    watch_calls();
  });
}

void PathClient::start_stat(const std::string& path, Completion<Entry> done) {
  start_call(request(Op::stat, path, false), [done = std::move(done)](std::exception_ptr e, Reply rep) {
    if (!e && rep.entries.size() != 1)
      e = std::make_exception_ptr(Error(errc::protocol_error, "stat reply without exactly one entry"));
    done(e, e ? Entry{} : std::move(rep.entries[0]));
  });
}

void PathClient::start_plain(const Request& r, Completion<> done) {
  start_call(r, [done = std::move(done)](std::exception_ptr e, Reply) { done(e); });
}

void PathClient::start_checksum(const Request& r, Completion<std::string> done) {
  start_call(r, [done = std::move(done)](std::exception_ptr e, Reply rep) {
    if (!e && (rep.algorithm != "sha256" || rep.digest.size() != 32))
      e = std::make_exception_ptr(Error(errc::protocol_error, "checksum reply is not a SHA-256"));
    done(e, e ? std::string() : hex(rep.digest));
  });
}

// The blocking form of a single request: start_call, with this thread running the loop.
Reply PathClient::call(Request r) {
  check();
  bool done = false;
  std::exception_ptr err;
  Reply out;
  const auto id = start_call(std::move(r), [&](std::exception_ptr e, Reply rep) {
    done = true;
    err = e;
    out = std::move(rep);
  });
  wait_for(id, done);
  if (err) std::rethrow_exception(err);
  return out;
}

Entry PathClient::stat(const std::string& path) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  auto rep = call(request(Op::stat, path, false));
  if (rep.entries.size() != 1) throw Error(errc::protocol_error, "stat reply without exactly one entry");
  return rep.entries[0];
}

std::uint64_t PathClient::start_list(const std::string& path, bool recursive, Chunk chunk, Completion<std::size_t> done) {
  if (auto e = ended()) {
    detail::fail_later(io_, std::move(done), e);
    return 0;
  }
  Request r = request(Op::list, path, recursive);
  r.id = new_id();
  const std::uint64_t id = r.id;
  auto chunks = std::make_shared<std::size_t>(0);
  if (calls_.empty()) last_ = Clock::now();
  // What completes the listing, at its last part or with the operation's failure.
  calls_.emplace(id, [done = std::move(done), chunks](std::exception_ptr e, Reply) { done(e, e ? 0 : *chunks); });
  send(id, encode(r), [this, id, chunks, chunk = std::move(chunk)](Reply& rep, std::shared_ptr<Buffer>) {
    if (!calls_.count(id)) return;  // its caller has gone (a blocking call that failed)
    // Found again each time: chunk() may start calls of its own, which can rehash calls_.
    auto finish = [&](std::exception_ptr e) {
      auto it = calls_.find(id);
      if (it == calls_.end()) return;
      auto d = std::move(it->second);
      calls_.erase(it);
      d(e, Reply{});
    };
    if (rep.code != errc::ok) {
      remote_ = true;
      return finish(std::make_exception_ptr(TransferError(rep.code, rep.message, true)));
    }
    // A part says something: parts without entries would hold the session for ever, each one
    // resetting the timeout and adding nothing to what --max-listing counts.
    if (!rep.last && rep.entries.empty())
      return fail(errc::protocol_error, "server sent an empty part of a listing", false);
    for (auto& e : rep.entries) {
      // The server's names are as untrusted as anything else it sends.
      if (auto st = files::check_relative_path(e.path); !st)
        return fail(errc::protocol_error, "server listed a bad name: " + st.message, false);
      e.data = {};
    }
    if (!rep.entries.empty()) {
      ++*chunks;
      chunk(rep.entries);
    }
    if (rep.last) finish(nullptr);
  }, true);
  watch_calls();
  return id;
}

std::size_t PathClient::list(const std::string& path, bool recursive, const std::function<void(std::vector<Entry>&)>& chunk) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  check();
  bool done = false;
  std::exception_ptr err;
  std::size_t chunks = 0;
  const auto id = start_list(path, recursive, chunk, [&](std::exception_ptr e, std::size_t n) {
    done = true;
    err = e;
    chunks = n;
  });
  wait_for(id, done);
  if (err) std::rethrow_exception(err);
  return chunks;
}

void PathClient::mkdir(const std::string& path, bool parents) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  Request r;
  r.op = Op::mkdir;
  r.path = path;
  r.recursive = parents;
  call(std::move(r));
}

void PathClient::remove(const std::string& path, bool recursive) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  Request r;
  r.op = Op::remove;
  r.path = path;
  r.recursive = recursive;
  call(std::move(r));
}

void PathClient::rename(const std::string& from, const std::string& to) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  Request r;
  r.op = Op::rename;
  r.path = from;
  r.to = to;
  call(std::move(r));
}

std::string PathClient::checksum(const std::string& path, std::uint64_t offset, std::uint64_t length) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  Request r;
  r.op = Op::checksum;
  r.path = path;
  r.offset = offset;
  r.length = length;
  auto rep = call(std::move(r));
  if (rep.algorithm != "sha256" || rep.digest.size() != 32) throw Error(errc::protocol_error, "checksum reply is not a SHA-256");
  return hex(rep.digest);
}

std::string PathClient::manifest_digest(const std::string& path, std::uint32_t block_size) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  Request r;
  r.op = Op::checksum;
  r.path = path;
  r.block_size = block_size;
  auto rep = call(std::move(r));
  if (rep.algorithm != manifest::algorithm || rep.digest.size() != manifest::digest_size)
    throw Error(errc::protocol_error, "manifest reply is not a " + std::string(manifest::algorithm) + " digest");
  return hex(rep.digest);
}

void PathClient::put(std::vector<Entry> entries) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  Request r;
  r.op = Op::put;
  r.entries = std::move(entries);
  auto rep = call(std::move(r));
  for (const auto& e : rep.entries)
    if (e.code != errc::ok) throw Error(e.code, e.message);
}

bool PathClient::close() {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  if (machine_->state() != PathState::serving) return machine_->state() == PathState::done;
  for (auto& c : channels_)
    if (!c || !c->open()) {
      fail_as(PathEvent::channel_lost, errc::peer_aborted, "a channel closed before the path operation ended", false,
              false);
      return false;
    }
  // Asynchronous calls still waiting get their replies first: a reply after our EOFR is out of
  // turn (the table has no reply row in ending).
  if (!pending_.empty()) {
    try {
      wait([&] { return pending_.empty(); });
    } catch (const Error&) {
      return false;
    }
  }
  // EOFR on every channel: every request has its answer, so the server answers with EOFR on
  // every channel (committed) and the channels are the session's again.
  Work none;
  on(PathEvent::end_asked, none);
  io_.restart();
  const auto until = Clock::now() + idle_timeout_;
  while (machine_->state() != PathState::failed && (machine_->state() == PathState::ending || eofr_unsent_ > 0)) {
    if (Clock::now() >= until) {
      fail(errc::timeout, fmt::format("the server did not end the path operation within {} ms", idle_timeout_.count()),
           false);
      break;
    }
    io_.run_one_for(std::chrono::milliseconds(100));
  }
  // What is left of the failure's goodbye leaves before the caller goes on.
  while (eofr_unsent_ > 0 && io_.run_one_for(std::chrono::milliseconds(50))) {
  }
  return machine_->state() == PathState::done && !eofr_lost_;
}

void PathClient::send_eofr() {
  for (auto& c : channels_) {
    wire::FrameHeader h;
    h.event = wire::ChannelEvent::eofr;
    ++eofr_unsent_;
    auto* ch = c.get();
    ch->send(h, std::vector<std::uint8_t>{}, [this, ch](const xdsi::ErrorCode& ec) {
      --eofr_unsent_;
      if (!ec) return;
      eofr_lost_ = true;  // even once the server's EOFRs are in: ours did not all leave
      if (code_ == errc::ok) fail(ch->failure(ec, "server"));
    });
  }
}

void PathClient::keep_alive() {
  std::unique_lock<std::recursive_mutex> one_call(call_mu_, std::try_to_lock);
  if (!one_call.owns_lock() || machine_->state() != PathState::serving || channels_.empty() || !channels_[0] ||
      !channels_[0]->open())
    return;  // a call is running (the session is not idle), or it is over
  wire::FrameHeader h;
  h.event = wire::ChannelEvent::noop;
  auto sent = std::make_shared<bool>(false);
  channels_[0]->send(h, std::vector<std::uint8_t>{}, [sent](const xdsi::ErrorCode&) { *sent = true; });
  // Also lets anything the server sent meanwhile (an exception) reach the read loops.
  io_.restart();
  const auto until = Clock::now() + std::chrono::seconds(2);
  while (!*sent && Clock::now() < until) io_.run_one_for(std::chrono::milliseconds(100));
}

// ---- trees ----

namespace {
std::string tree_error_text(const TreeResult& r) {
  const auto& f = r.failures.front();
  return fmt::format("{} {} not copied ({}{}: {})", r.failures.size(), r.failures.size() == 1 ? "entry was" : "entries were",
                     f.path, f.remote ? ", server" : "", f.message);
}
}  // namespace

TreeError::TreeError(TreeResult r)
    : Error(r.failures.empty() ? errc::internal : r.failures.front().code, tree_error_text(r)), result_(std::move(r)) {}

// For the files at `which`: does the local copy (under local_root) hash the same as the remote
// one (under remote)? Up to 64 checksum requests are outstanding while local hashing goes on.
std::vector<bool> PathClient::same_content(int local_root, const std::string& remote, const std::vector<Entry>& files,
                                       const std::vector<std::size_t>& which) {
  std::vector<bool> equal(files.size(), false);
  std::size_t answered = 0, next = 0;
  std::function<void()> ask = [&] {
    while (code_ == errc::ok && next < which.size() && next - answered < 64) {
      const std::size_t k = which[next++];
      std::vector<std::uint8_t> mine;
      if (auto st = pathm::checksum(local_root, files[k].path, 0, 0, mine); !st) return fail(st.code, st.message, false);
      Request r;
      r.op = Op::checksum;
      r.path = remote_join(remote, files[k].path);
      r.id = new_id();
      send(r.id, encode(r), [&, k, mine](Reply& rep, std::shared_ptr<Buffer>) {
        ++answered;
        equal[k] = rep.code == errc::ok && rep.digest == mine;
        ask();
      });
    }
  };
  ask();
  wait([&] { return answered == which.size(); });
  return equal;
}

namespace {

// Work shared by both directions of a tree copy: which files need to move.
struct TreePlan {
  std::vector<Entry> dirs, links, files;
  TreeResult result;

  // Sorts a listed entry into its list; what is neither file, directory nor symlink is skipped.
  void add(Entry&& e) {
    if (e.type == Type::directory) dirs.push_back(std::move(e));
    else if (e.type == Type::symlink) links.push_back(std::move(e));
    else if (e.type == Type::file) {
      ++shown.files_total;
      shown.bytes_total += e.size;
      files.push_back(std::move(e));
    } else ++result.skipped;
  }

  // What the progress callback gets: the totals grow as entries are listed, and are whole once
  // the files to copy are known (after the comparison, with sync).
  TreeProgress shown;
  void report(const TreeOptions& o) const {
    if (o.progress) o.progress(shown);
  }
  void settle_totals(const TreeOptions& o, LargeFiles* large) {
    shown.files_total = files.size();
    shown.bytes_total = 0;
    for (const auto& f : files) shown.bytes_total += f.size;
    shown.totals_final = true;
    if (large) {
      large->files_total = shown.files_total;
      large->bytes_total = shown.bytes_total;
    }
    report(o);
  }

  // The files' units (batches of small files, chunks of large ones), in the order they go.
  std::vector<Unit> units;
  std::size_t next_unit = 0;
  std::uint64_t chunk = 1;     // block size: the bytes of one chunk
  std::uint64_t chunk_at = 0;  // the next chunk's offset in the large file at next_unit
  std::vector<std::uint64_t> file_ids;  // per entry of files: a large file's id, 0 until its first chunk
  std::uint64_t ids = 1;
  std::vector<char> file_failed;  // per entry of files, once the copy goes on without it
  std::vector<std::uint64_t> file_done;  // bytes answered, per entry of files
  std::vector<std::uint64_t> file_taken;  // bytes handed out, per entry of files
  std::uint64_t moved = 0;               // bytes answered, for the progress line
  // Large files started and not yet answered in full: the writing side holds each open, and
  // takes at most files::max_files_in_progress; half of that leaves it room for its own lag.
  std::size_t open_large = 0;
  static constexpr std::size_t max_open_large = files::max_files_in_progress / 2;

  void plan_files(std::uint32_t block, std::size_t batch_bytes, std::size_t name_prefix) {
    units = plan(files, block, batch_bytes, name_prefix);
    chunk = block;
    file_ids.assign(files.size(), 0);
    file_failed.assign(files.size(), 0);
    file_done.assign(files.size(), 0);
    file_taken.assign(files.size(), 0);
  }
  // The next unit to send and its large file's id (0 for a batch): a batch, or the next chunk of
  // a large file; the rest of a large file that failed is left out. False once every unit has
  // gone, or while the next one would start one large file more than may be in progress.
  bool take(Unit& u, std::uint64_t& fid) {
    while (next_unit < units.size()) {
      const Unit& cur = units[next_unit];
      if (!cur.chunk) {
        u = cur;
        fid = 0;
        ++next_unit;
        return true;
      }
      const std::uint64_t size = files[cur.first].size;
      if (file_failed[cur.first] || chunk_at >= size) {
        ++next_unit;
        chunk_at = 0;
        continue;
      }
      if (file_ids[cur.first] == 0) {
        if (open_large >= max_open_large) return false;  // asked again as answers come back
        file_ids[cur.first] = ids++;
        ++open_large;
      }
      u = Unit{cur.first, 1, std::min<std::uint64_t>(chunk, size - chunk_at), true, chunk_at};
      chunk_at += u.bytes;
      file_taken[cur.first] += u.bytes;
      fid = file_ids[cur.first];
      return true;
    }
    return false;
  }
  bool all_taken() const noexcept { return next_unit == units.size(); }


  std::unordered_set<std::string> failed_paths;  // each entry fails once (a directory that could
                                                 // not be made fails its attributes too)
  void failure(const std::string& path, errc code, const std::string& message, bool remote) {
    if (failed_paths.insert(path).second) result.failures.push_back({path, code, message, remote});
  }
  // Files fail once: later chunks of a large file that failed say nothing new.
  void fail_file(std::size_t i, errc code, const std::string& message, bool remote) {
    if (file_failed[i]) return;
    file_failed[i] = 1;
    failure(files[i].path, code, message, remote);
  }

  // A unit was answered (its failures, if any, already noted): a file counts once all of it
  // was answered, and only if none of it failed.
  void done(const Unit& u, const TreeOptions& o) {
    for (std::size_t k = u.first; k < u.first + u.count; ++k) {
      file_done[k] += u.chunk ? u.bytes : files[k].size;
      moved += u.chunk ? u.bytes : files[k].size;
      // A large file is no longer in progress once all of it, or all it got of it before it
      // failed, was answered.
      if (u.chunk && (file_done[k] == files[k].size || (file_failed[k] && file_done[k] == file_taken[k])))
        --open_large;
      if (file_done[k] == files[k].size && !file_failed[k]) {
        ++result.files;
        result.bytes += files[k].size;
      }
    }
    shown.files = result.files;
    shown.bytes = moved;
    report(o);
  }
  // Files of at least large->threshold bytes leave the plan, for the caller to copy.
  void set_aside(LargeFiles* large) {
    if (!large || large->threshold == 0) return;
    std::vector<Entry> keep;
    for (auto& f : files) (f.size >= large->threshold ? large->files : keep).push_back(std::move(f));
    files = std::move(keep);
  }
  // The end of a tree copy: its result, or the entries that failed with it.
  TreeResult finish() {
    if (!result.failures.empty()) throw TreeError(std::move(result));
    return std::move(result);
  }
};

// What a tree copy keeps of a server's listing is bounded (TreeOptions::max_listing): a server
// that lists without end fails the copy instead of filling this side's memory.
class ListingBound {
public:
  ListingBound(const TreeOptions& o, const std::string& remote) : max_(o.max_listing), remote_(remote) {}
  void add(const Entry& e) {
    bytes_ += sizeof(Entry) + e.path.size() + e.target.size() + e.message.size();
    if (max_ && bytes_ > max_)  // ends the session (PathClient::on_reply), so the server stops too
      throw Error(errc::limit_exceeded, fmt::format("the listing of '{}' from the server exceeds {} bytes of memory "
                                                    "(--max-listing)",
                                                    remote_, max_));
  }

private:
  std::size_t max_;
  std::string remote_;
  std::size_t bytes_ = 0;
};

// Request bytes a tree copy keeps outstanding.
std::size_t window_of(const TreeOptions& o, std::uint32_t block, std::size_t channels) {
  return o.window ? o.window : std::max<std::size_t>(32u << 20, 8ull * block * channels);
}

}  // namespace

// Drops from v what the destination already has (with sync): same size and mtime, or with
// --checksum (files only) same size and same SHA-256; a symlink with the same target.
// at_destination gives the destination's entry for a path (type `other` when it has none).
void PathClient::keep_changed(std::vector<Entry>& v, bool files, const TreeOptions& o, int local_root,
                          const std::string& remote, const std::function<Entry(const Entry&)>& at_destination,
                          std::uint64_t& skipped) {
  const bool by_content = files && o.checksum;
  std::vector<Entry> out;
  std::vector<std::size_t> maybe;  // same size, content to compare
  for (auto& e : v) {
    const Entry there = at_destination(e);
    const bool match = by_content ? there.type == Type::file && there.size == e.size : same(e, there);
    if (!match) {
      out.push_back(std::move(e));
    } else if (by_content) {
      maybe.push_back(out.size());
      out.push_back(std::move(e));
    } else {
      ++skipped;
    }
  }
  if (!maybe.empty()) {
    auto equal = same_content(local_root, remote, out, maybe);
    std::vector<Entry> left;
    for (std::size_t k = 0; k < out.size(); ++k) {
      if (equal[k]) ++skipped;
      else left.push_back(std::move(out[k]));
    }
    out = std::move(left);
  }
  v = std::move(out);
}

TreeResult PathClient::upload_tree(const std::string& local, const std::string& remote, const TreeOptions& o,
                                   LargeFiles* large) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  check();
  const auto t0 = requests_;
  Fd src = open_local_dir(local);
  TreePlan p;
  {
    Entry top = local_entry(src.get(), ".");
    top.path = "";
    p.dirs.push_back(top);
  }
  if (auto st = list_dir(
          src.get(), ".", true, o.follow, 4096,
          [&](std::vector<Entry>& chunk) {
            for (auto& e : chunk) p.add(std::move(e));
            p.report(o);
            return true;
          },
          nullptr,
          // A directory that cannot be read is named and left out, as rsync does; the rest goes.
          [&](const std::string& rel, const Status& why) { p.failure(rel, why.code, why.message, false); });
      !st)
    throw Error(st.code, "reading '" + local + "': " + st.message);
  mkdir(remote, true);
  if (o.sync) {
    std::unordered_map<std::string, Entry> there;
    ListingBound bound(o, remote);
    list(remote, true, [&](std::vector<Entry>& chunk) {
      for (auto& e : chunk) {
        bound.add(e);
        there.emplace(e.path, std::move(e));
      }
    });
    auto at_destination = [&](const Entry& e) {
      auto it = there.find(e.path);
      if (it != there.end()) return it->second;
      Entry none;
      none.type = Type::other;
      return none;
    };
    keep_changed(p.files, true, o, src.get(), remote, at_destination, p.result.skipped);
    keep_changed(p.links, false, o, src.get(), remote, at_destination, p.result.skipped);
  }
  p.settle_totals(o, large);
  p.set_aside(large);
  // Directories and symlinks first (no bytes), batched; the server makes missing parents itself,
  // so files need not wait for them. An entry that fails is counted out and the copy goes on.
  std::size_t waiting = 0;
  auto counted_out = [&p](const std::vector<Entry>& v, std::uint64_t& copied) {
    return [&p, &v, &copied](std::size_t k, const Entry& why) {
      p.failure(v[k].path, why.code, why.message, true);
      if (copied) --copied;
    };
  };
  p.result.directories = p.dirs.size();
  p.result.symlinks = p.links.size();
  put_meta(Op::put, remote, p.dirs, waiting, counted_out(p.dirs, p.result.directories));
  put_meta(Op::put, remote, p.links, waiting, counted_out(p.links, p.result.symlinks));

  // Files: batches of small files and chunks of large ones, read by workers straight into the
  // request bytes, as many outstanding as the window allows.
  p.plan_files(block_size_, std::min<std::size_t>(o.batch_bytes, block_size_), remote.size() + 1);
  const std::size_t window = window_of(o, block_size_, channels_.size());
  std::size_t inflight = 0, building = 0;
  {
    WorkPool pool(o.workers, [this](const std::string& what) {
      asio::post(io_, [this, what] { fail(errc::internal, "tree worker: " + what, false); });
    });
    auto alive = std::make_shared<bool>(true);
    std::function<void()> pump = [&] {
      Unit u;
      std::uint64_t fid = 0;
      while (code_ == errc::ok && (inflight < window || inflight == 0) && p.take(u, fid)) {
        inflight += u.bytes + 1;
        ++building;
        const std::uint64_t id = new_id();
        std::weak_ptr<bool> w = alive;
        pool.submit([&, u, id, fid, w] {
          auto writer = Writer::request(id, Op::put, u.count, static_cast<std::size_t>(u.bytes));
          // A file that cannot be read goes as a placeholder the server skips; the others go on.
          std::vector<std::pair<std::size_t, Status>> unreadable;
          for (std::size_t k = 0; k < u.count; ++k) {
            const Entry& f = p.files[u.first + k];
            Entry e = f;
            e.path = remote_join(remote, f.path);
            e.file_id = fid;
            e.offset = u.chunk ? u.offset : 0;
            Status st;
            Fd fd(::openat(src.get(), f.path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | (o.follow ? 0 : O_NOFOLLOW)));
            if (!fd) {
              st = Status::from_errno(errno, "open '" + local + "/" + f.path + "'");
            } else {
              const std::uint64_t len = u.chunk ? u.bytes : f.size;
              auto dst = writer.set(k, e, static_cast<std::size_t>(len));
              st = read_exact(fd.get(), dst, e.offset, local + "/" + f.path);
            }
            if (!st) {
              e.code = st.code;
              e.message = st.message;
              writer.set(k, e, 0);
              unreadable.emplace_back(u.first + k, std::move(st));
            }
          }
          asio::post(io_, [&, u, id, w, unreadable = std::move(unreadable), msg = writer.finish()]() mutable {
            if (!w.lock()) return;
            --building;
            for (auto& [i, st] : unreadable) p.fail_file(i, st.code, st.message, false);
            send(id, std::move(msg), [&, u](Reply& rep, std::shared_ptr<Buffer>) {
              inflight -= u.bytes + 1;
              if (rep.code != errc::ok) return fail(rep.code, rep.message, true);
              if (!rep.entries.empty()) {
                if (rep.entries.size() != u.count)
                  return fail(errc::protocol_error, "a put reply that does not match its request's entries", false);
                for (std::size_t k = 0; k < u.count; ++k)
                  if (rep.entries[k].code != errc::ok)
                    p.fail_file(u.first + k, rep.entries[k].code, rep.entries[k].message, true);
              }
              p.done(u, o);
              pump();
            });
          });
        });
      }
    };
    pump();
    wait([&] { return p.all_taken() && building == 0 && pending_.empty(); });
    alive.reset();
  }
  // Directories last get their modes and mtimes: writing into them changed their mtimes. With
  // large files still to come, after them (set_attrs).
  std::uint64_t unused = 0;
  if (large && !large->files.empty()) large->dirs = p.dirs;
  else put_meta(Op::set_attrs, remote, p.dirs, waiting, counted_out(p.dirs, unused));
  wait([&] { return waiting == 0; });
  p.result.requests = requests_ - t0;
  return p.finish();
}

void PathClient::put_meta(Op op, const std::string& remote, const std::vector<Entry>& v, std::size_t& waiting,
                          const std::function<void(std::size_t, const Entry&)>& failed) {
  for (std::size_t i = 0; i < v.size(); i += 1024) {
    Request r;
    r.op = op;
    r.id = new_id();
    std::vector<std::size_t> which;
    for (std::size_t k = i; k < std::min(v.size(), i + 1024); ++k) {
      Entry e = v[k];
      e.path = remote_join(remote, e.path);
      if (op == Op::put && (e.path == "." || e.path == remote)) continue;
      if (op == Op::set_attrs && e.path == ".") continue;  // the server's root keeps its own
      r.entries.push_back(std::move(e));
      which.push_back(k);
    }
    if (r.entries.empty()) continue;
    ++waiting;
    send(r.id, encode(r), [this, &waiting, failed, which = std::move(which)](Reply& rep, std::shared_ptr<Buffer>) {
      --waiting;
      if (rep.code != errc::ok) return fail(rep.code, rep.message, true);
      if (rep.entries.empty()) return;
      if (rep.entries.size() != which.size())
        return fail(errc::protocol_error, "a reply that does not match its request's entries", false);
      for (std::size_t j = 0; j < which.size(); ++j)
        if (rep.entries[j].code != errc::ok) failed(which[j], rep.entries[j]);
    });
  }
}

void PathClient::set_attrs(const std::string& remote, const std::vector<Entry>& entries, TreeResult& r) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  check();
  std::size_t waiting = 0;
  std::unordered_set<std::string> named;
  put_meta(Op::set_attrs, remote, entries, waiting, [&](std::size_t k, const Entry& why) {
    if (named.insert(entries[k].path).second) r.failures.push_back({entries[k].path, why.code, why.message, true});
  });
  wait([&] { return waiting == 0; });
}

TreeResult PathClient::download_tree(const std::string& remote, const std::string& local, const TreeOptions& o,
                                     LargeFiles* large) {
  std::lock_guard<std::recursive_mutex> one_call(call_mu_);
  check();
  const auto t0 = requests_;
  Entry top = stat(remote);
  if (top.type != Type::directory) throw Error(errc::not_regular_file, "'" + remote + "' is not a directory");
  TreePlan p;
  top.path = ".";
  p.dirs.push_back(top);
  ListingBound bound(o, remote);
  list(remote, true, [&](std::vector<Entry>& chunk) {
    for (auto& e : chunk) {
      bound.add(e);
      p.add(std::move(e));
    }
    p.report(o);
  });
  struct stat before {};
  const bool existed = ::stat(local.c_str(), &before) == 0;
  make_local_dirs(local);
  Fd dst = open_local_dir(local);
  auto made = std::make_shared<files::Made>();
  TreeWriter writer(dst.get(), download_tag(), o.fsync, block_size_, 1024, files::process_umask(), 0, made);
  // The top directory gets the remote mode only if this copy made it: a directory that was
  // there (the user's home, say) keeps its own.
  if (!existed) writer.claim(".");
  // What a killed download into this tree left behind goes first.
  for (const auto& d : p.dirs) p.result.swept += sweep_stale_downloads(dst.get(), d.path);
  if (o.sync) {
    auto at_destination = [&](const Entry& e) { return local_entry(dst.get(), e.path); };
    keep_changed(p.files, true, o, dst.get(), remote, at_destination, p.result.skipped);
    keep_changed(p.links, false, o, dst.get(), remote, at_destination, p.result.skipped);
  }
  p.settle_totals(o, large);
  p.set_aside(large);
  // What cannot be made here is counted out and the copy goes on (as rsync).
  p.result.directories = 1;
  for (std::size_t i = 1; i < p.dirs.size(); ++i) {
    if (auto st = writer.put(p.dirs[i]); !st) p.failure(p.dirs[i].path, st.code, st.message, false);
    else ++p.result.directories;
  }
  for (auto& l : p.links) {
    if (auto st = writer.put(l); !st) p.failure(l.path, st.code, st.message, false);
    else ++p.result.symlinks;
  }

  p.plan_files(block_size_, std::min<std::size_t>(o.batch_bytes, block_size_), remote.size() + 1);
  const std::size_t window = window_of(o, block_size_, channels_.size());
  // Requests not answered yet: each may bring a reply of up to a message's size, whatever it
  // asked for, so their number is bounded too (at what keeps n channels busy).
  const std::size_t max_outstanding = std::max<std::size_t>(32, 8 * channels_.size());
  std::size_t inflight = 0, writing = 0, outstanding = 0;
  {
    WorkPool pool(o.workers, [this](const std::string& what) {
      asio::post(io_, [this, what] { fail(errc::internal, "tree worker: " + what, false); });
    });
    auto alive = std::make_shared<bool>(true);
    std::function<void()> pump = [&] {
      Unit u;
      std::uint64_t fid = 0;
      while (code_ == errc::ok && (inflight < window || inflight == 0) && outstanding < max_outstanding &&
             p.take(u, fid)) {
        inflight += u.bytes + 1;
        ++outstanding;
        Request r;
        r.op = Op::get;
        r.id = new_id();
        for (std::size_t k = 0; k < u.count; ++k) {
          const Entry& f = p.files[u.first + k];
          Entry q;
          q.path = remote_join(remote, f.path);
          q.size = u.chunk ? u.bytes : f.size;
          q.offset = u.chunk ? u.offset : 0;
          q.file_id = fid;
          r.entries.push_back(std::move(q));
        }
        std::weak_ptr<bool> w = alive;
        send(r.id, encode(r), [&, u, fid, w](Reply& rep, std::shared_ptr<Buffer> buf) {
          // From here until it is written, the reply counts as the bytes that arrived, not the
          // bytes asked for: a server cannot make more wait for the disk than the window.
          --outstanding;
          inflight = inflight - (u.bytes + 1) + buf->size;
          if (rep.code != errc::ok) return fail(rep.code, rep.message, true);
          if (rep.entries.size() != u.count)
            return fail(errc::protocol_error, "get reply with a different number of files", false);
          for (std::size_t k = 0; k < u.count; ++k) {
            auto& got = rep.entries[k];
            const Entry& f = p.files[u.first + k];
            if (got.code != errc::ok) continue;
            if (u.chunk && (got.offset != u.offset || got.data.size() != u.bytes))
              return fail(errc::protocol_error, "server sent another range of '" + f.path + "'", false);
            if (!u.chunk && got.data.size() > f.size)
              return fail(errc::protocol_error, "server sent more of '" + f.path + "' than the " +
                                                    std::to_string(f.size) + " bytes it listed",
                          false);
            if (!u.chunk && got.size != got.data.size())
              return fail(errc::protocol_error, "server sent " + std::to_string(got.data.size()) + " bytes of '" +
                                                    f.path + "' as a file of " + std::to_string(got.size),
                          false);
            // A chunked file is made final when the bytes of the size its chunks name are in:
            // that must be the size listed, which the chunks were planned for.
            if (u.chunk && got.size != f.size) {
              got.code = errc::size_mismatch;
              got.message = "'" + f.path + "' changed size while it was copied (listed " + std::to_string(f.size) +
                            " bytes, now " + std::to_string(got.size) + ")";
            }
          }
          for (std::size_t k = 0; k < u.count; ++k) {
            if (rep.entries[k].code == errc::ok) continue;
            p.fail_file(u.first + k, rep.entries[k].code, rep.entries[k].message, true);  // the server could not read it
            if (u.chunk) writer.abandon(fid);
          }
          ++writing;
          const std::size_t arrived = buf->size;
          pool.submit([&, u, fid, w, buf, arrived, rep = std::move(rep)]() mutable {
            std::vector<std::pair<std::size_t, Status>> unwritable;  // a file that fails here is left out
            for (std::size_t k = 0; k < u.count; ++k) {
              auto& got = rep.entries[k];
              if (got.code != errc::ok) continue;
              Entry e;
              e.path = p.files[u.first + k].path;  // our own name for it, not the server's
              e.type = Type::file;
              e.size = got.size;
              e.mode = got.mode;
              e.mtime_ns = got.mtime_ns;
              e.data = got.data;
              e.file_id = fid;
              e.offset = u.chunk ? u.offset : 0;
              if (auto put = writer.put(e); !put) {
                if (u.chunk) writer.abandon(fid);
                unwritable.emplace_back(u.first + k, std::move(put));
              }
            }
            asio::post(io_, [&, u, w, arrived, unwritable = std::move(unwritable)] {
              if (!w.lock()) return;
              --writing;
              inflight -= arrived;
              for (auto& [i, why] : unwritable) p.fail_file(i, why.code, why.message, false);
              p.done(u, o);
              pump();
            });
          });
        });
      }
    };
    pump();
    try {
      wait([&] { return p.all_taken() && writing == 0 && pending_.empty(); });
    } catch (...) {
      pool.stop();
      writer.discard_all();
      throw;
    }
    alive.reset();
  }
  // Directories last get their modes and mtimes; with large files still to come, after them
  // (set_local_attrs).
  if (large && !large->files.empty()) {
    large->dirs = p.dirs;
    large->made = made;
  } else {
    for (auto& d : p.dirs)
      if (auto st = writer.set_attrs(d); !st) p.failure(d.path, st.code, st.message, false);
  }
  p.result.requests = requests_ - t0;
  return p.finish();
}

}  // namespace xdfs::pathm
