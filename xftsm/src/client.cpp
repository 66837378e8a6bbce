#include "xdfs/client.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/core.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "xdfs/files.hpp"
#include "xdfs/types.hpp"
#include "xdfs/xsec.hpp"
#include "xdfs/xftsm/cfsm.hpp"
#include "xdfs/xftsm/transfer.hpp"

namespace xdfs {
namespace {

using namespace xftsm;
using Clock = std::chrono::steady_clock;
using xdsi::ErrorCode;
using xdsi::tcp;

std::string basename_of(const std::string& p) {
  auto s = p;
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  auto slash = s.rfind('/');
  return slash == std::string::npos ? s : s.substr(slash + 1);
}

class ClientSession final : public TransferHost {
public:
  ClientSession(Mode mode, const Endpoint& ep, std::string remote, const TransferOptions& opt)
      : machine_(mode == Mode::upload ? Role::client_upload
                 : mode == Mode::path ? Role::client_path
                                      : Role::client_download),
        endpoint_(ep),
        opt_(opt),
        resolver_(io_),
        deadline_(io_),
        ticker_(io_),
        linger_(io_) {
    opening_.session = SessionId::random();
    nego_.channel_count = opt.channels;
    nego_.mode = mode;
    nego_.remote_path = std::move(remote);
    nego_.block_size = opt.block_size;
    nego_.tcp_window = opt.tcp_window;
    slots_ = static_cast<std::uint32_t>(std::max<std::size_t>(opt.ring_bytes / std::max<std::uint32_t>(opt.block_size, 1), 4));
  }

  TransferResult upload(const std::string& local) {
    check_options();
    if (opt_.memory) {
      size_ = opt_.memory_size;
      nego_.file_size = size_;
      nego_.extended_flags |= wire::flag_memory;
      if (nego_.remote_path.empty() || nego_.remote_path.back() == '/') nego_.remote_path += "memory";
      memory_source_ = true;
      return run();
    }
    int fd = ::open(local.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw TransferError(errc_from_errno(errno), "'" + local + "': " + std::strerror(errno), false);
    source_ = files::Fd(fd);
    struct stat sb {};
    if (::fstat(fd, &sb) != 0) throw TransferError(errc_from_errno(errno), "stat '" + local + "'", false);
    if (S_ISDIR(sb.st_mode)) throw TransferError(errc::is_directory, "'" + local + "' is a directory", false);
    if (!S_ISREG(sb.st_mode)) throw TransferError(errc::not_regular_file, "'" + local + "' is not a regular file", false);
    size_ = static_cast<std::uint64_t>(sb.st_size);
    nego_.file_size = size_;
    if (nego_.remote_path.empty() || nego_.remote_path.back() == '/') nego_.remote_path += basename_of(local);
    return run();
  }

  TransferResult download(const std::string& local) {
    check_options();
    if (opt_.memory) {
      nego_.file_size = opt_.memory_size;
      nego_.extended_flags |= wire::flag_memory;
      sink_ = piod::Sink{-1, true, true};
    } else {
      prepare_sink(local);
    }
    nego_.window = std::uint64_t(slots_) * opt_.block_size;
    return run();
  }

  // Path mode: connects and authenticates all channels, then hands them over.
  void open_path() {
    check_options();
    nego_.remote_path = ".";
    run();
  }
  boost::asio::io_context& io() noexcept { return io_; }
  ChannelList& channels() noexcept { return channels_; }
  std::uint32_t block_size() const noexcept { return nego_.block_size; }
  const TransferOptions& options() const noexcept { return opt_; }
  Machine& machine() noexcept { return machine_; }

  files::Status commit() override {
    if (pending_.active()) return pending_.commit(size_, opt_.fsync);
    return files::Status::ok();
  }

  void finished(errc code, const std::string& message, bool from_peer) override { end(code, message, from_peer); }

private:
  void check_options() {
    if (opt_.channels == 0) throw TransferError(errc::bad_argument, "channel count must be at least 1", false);
    if (opt_.block_size < wire::min_block_size || opt_.block_size > wire::max_block_size)
      throw TransferError(errc::bad_argument,
                          fmt::format("block size {} is outside {}..{}", opt_.block_size, wire::min_block_size,
                                      wire::max_block_size),
                          false);
    if (nego_.remote_path.size() > wire::max_path_bytes)
      throw TransferError(errc::bad_argument, "remote path longer than 4096 bytes", false);
  }

  void prepare_sink(std::string local) {
    if (local == "-") {
      sink_ = piod::Sink{STDOUT_FILENO, false, false};
      return;
    }
    struct stat sb {};
    if (::stat(local.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode)) {
      local += "/" + basename_of(nego_.remote_path);
    }
    if (::stat(local.c_str(), &sb) == 0 && !S_ISREG(sb.st_mode)) {
      if (S_ISDIR(sb.st_mode)) throw TransferError(errc::is_directory, "'" + local + "' is a directory", false);
      // /dev/null needs no writes at all.
      if (S_ISCHR(sb.st_mode) && sb.st_rdev == makedev(1, 3)) {
        sink_ = piod::Sink{-1, true, true};
        return;
      }
      // A device or FIFO is written in place, in order, and never replaced.
      int fd = ::open(local.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0) throw TransferError(errc_from_errno(errno), "'" + local + "': " + std::strerror(errno), false);
      in_place_ = files::Fd(fd);
      sink_ = piod::Sink{fd, false, false};
      return;
    }
    auto [dir, name] = files::split_parent(local);
    int dfd = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) throw TransferError(errc_from_errno(errno), "directory '" + dir + "': " + std::strerror(errno), false);
    if (auto st = files::PendingFile::create(files::Fd(dfd), name, opening_.session.short_hex(), pending_); !st)
      throw TransferError(st.code, st.message, false);
    sink_ = piod::Sink{pending_.fd(), true, false};
  }

  TransferResult run() {
    const std::string dir = xsec::default_config_dir();
    const std::string id_path = opt_.identity_file.empty() ? dir + "/id_x25519" : opt_.identity_file;
    known_hosts_path_ = opt_.known_hosts_file.empty() ? dir + "/known_hosts" : opt_.known_hosts_file;
    try {
      bool created = false;
      identity_ = xsec::load_or_create_key(id_path, &created);
      if (created && opt_.notice)
        opt_.notice("made a new client key " + xsec::fingerprint(identity_.public_key) + " in " + id_path);
    } catch (const Error& e) {
      throw TransferError(e.code(), e.context(), false);
    }
    opening_.protect = static_cast<std::uint8_t>(opt_.protect);
    opening_.cipher = static_cast<std::uint8_t>(xsec::preferred_cipher());
    start_ = Clock::now();
    if (machine_.fire(Event::start) != Action::connect_channels) throw TransferError(errc::internal, machine_.why(), false);
    deadline_.expires_after(opt_.connect_timeout);
    deadline_.async_wait([this](const ErrorCode& ec) {
      if (ec || machine_.state() == State::transferring || machine_.finished()) return;
      fail_early(errc::timeout,
                 fmt::format("{}:{} did not accept the session within {} ms", endpoint_.host, endpoint_.port,
                             opt_.connect_timeout.count()),
                 false, Event::timeout);
    });
    tick();
    resolver_.async_resolve(endpoint_.host, std::to_string(endpoint_.port),
                            [this](const ErrorCode& ec, tcp::resolver::results_type results) {
                              if (machine_.finished()) return;
                              if (ec)
                                return fail_early(errc::connection_failed,
                                                  "cannot resolve '" + endpoint_.host + "': " + ec.message(), false,
                                                  Event::local_error);
                              connect_all(results);
                            });
    // A handler that throws ends this transfer with its reason (and its partial file), not the
    // calling program.
    try {
      io_.run();
    } catch (const std::exception& e) {
      if (sender_) sender_->abort(errc::internal, e.what());
      if (receiver_) receiver_->abort(errc::internal, e.what());
      fail_early(errc::internal, e.what(), false, Event::local_error);
      end(errc::internal, e.what(), false);  // whichever of them reported first, the reason is set
    }
    const double setup = accepted_ ? std::chrono::duration<double>(accepted_at_ - start_).count() : 0;
    if (path_ready_ && code_ == errc::ok) return TransferResult{0, seconds_, opt_.channels, setup};
    // Nothing of this session is left running: make sure the disk thread is gone too.
    sender_.reset();
    receiver_.reset();
    if (code_ != errc::ok) throw TransferError(code_, message_, remote_);
    if (opt_.progress) opt_.progress(Progress{size_, size_, seconds_});
    return TransferResult{size_, seconds_, opt_.channels, setup};
  }

  // Channel 0 connects and runs the full handshake first; the others then join in parallel.
  void connect_all(const tcp::resolver::results_type& results) {
    results_ = results;
    channels_.resize(opt_.channels);
    connect(0);
  }

  void connect(std::uint32_t i) {
    channels_[i] = std::make_unique<xdsi::Channel>(tcp::socket(io_), i);
    auto& ch = *channels_[i];
    boost::asio::async_connect(ch.socket(), results_, [this, &ch](const ErrorCode& ec, const tcp::endpoint&) {
      if (machine_.finished()) return;
      if (ec) {
        const errc code =
            ec == boost::asio::error::connection_refused ? errc::connection_refused : errc::connection_failed;
        return fail_early(code, fmt::format("{}:{}: {}", endpoint_.host, endpoint_.port, ec.message()), false,
                          Event::local_error);
      }
      on_connected(ch);
    });
  }

  // Each channel opens with the preamble and its opening in the clear; channel 0 then runs Noise
  // XX and sends the negotiation inside it (once the server's key checked out), the others join.
  void on_connected(xdsi::Channel& ch) {
    xdsi::SocketOptions so;
    so.tcp_window = opt_.tcp_window;
    xdsi::apply(ch.socket(), so);
    auto o = opening_;
    o.channel_index = ch.index();
    o.join = ch.index() != 0;
    if (o.join) {
      o.join_nonce.resize(32);
      xsec::random_fill(o.join_nonce);
    }
    auto payload = wire::encode(o);
    wire::FrameHeader h;
    h.event = wire::Event::nego;
    h.length = static_cast<std::uint32_t>(payload.size());
    auto pre = wire::encode_preamble();
    auto hb = wire::encode(h);
    std::vector<std::uint8_t> bytes(pre.size() + hb.size() + payload.size());
    auto at = std::copy(pre.begin(), pre.end(), bytes.begin());
    at = std::copy(hb.begin(), hb.end(), at);
    std::copy(payload.begin(), payload.end(), at);
    std::vector<std::uint8_t> opening = bytes;
    ch.send_raw(std::move(bytes), [this, &ch](const ErrorCode& ec) {
      if (ec && !machine_.finished()) channel_lost(ch, ec);
    });
    const auto mode = static_cast<xsec::Protect>(opening_.protect);
    const auto cipher = static_cast<xsec::Cipher>(opening_.cipher);
    if (!o.join) {
      xsec::client_establish(ch, std::move(opening), identity_, mode, cipher, wire::encode(nego_),
                             [this](const xsec::Key32& k) { return check_server(k); },
                             [this, &ch](xsec::HandshakeResult r) {
                               if (machine_.finished()) return;
                               if (r.code != errc::ok) return secure_failed(r);
                               secret_ = r.session_secret;
                               secured(ch);
                               for (std::uint32_t i = 1; i < opt_.channels; ++i) connect(i);
                             });
    } else {
      xsec::client_join(ch, std::move(opening), o.join_nonce, secret_, mode, cipher,
                        [this, &ch](xsec::HandshakeResult r) {
                          if (machine_.finished()) return;
                          if (r.code != errc::ok) return secure_failed(r);
                          secured(ch);
                        });
    }
  }

  void secured(xdsi::Channel& ch) {
    read_reply(ch);
    if (++connected_ == opt_.channels && !machine_.fire(Event::connected))
      fail_early(errc::state_violation, machine_.why(), false, Event::local_error);
  }

  void secure_failed(const xsec::HandshakeResult& r) {
    fail_early(r.code, r.message, r.remote, r.remote ? Event::peer_exception : Event::local_error);
  }

  // Known hosts: trust on first use (with a notice) unless strict; a changed key is refused.
  xsec::HandshakeResult check_server(const xsec::Key32& key) {
    xsec::HandshakeResult r;
    const std::string where = endpoint_.host + ":" + std::to_string(endpoint_.port);
    xsec::KnownHosts hosts(known_hosts_path_);
    auto pinned = hosts.lookup(where);
    if (pinned && *pinned == key) return r;
    r.code = errc::auth_failed;
    if (pinned) {
      r.message = "the server key of " + where + " changed: pinned " + xsec::fingerprint(*pinned) + ", offered " +
                  xsec::fingerprint(key) + "; if that is expected, remove its line from " + known_hosts_path_;
      return r;
    }
    if (opt_.strict_host_key) {
      r.message = "unknown server key " + xsec::fingerprint(key) + " for " + where +
                  " (--strict-host-key: add it to " + known_hosts_path_ + " first)";
      return r;
    }
    try {
      hosts.add(where, key);
    } catch (const Error& e) {
      r.message = e.what();
      return r;
    }
    if (opt_.notice)
      opt_.notice("new server " + where + " with key " + xsec::fingerprint(key) + " pinned in " + known_hosts_path_);
    return xsec::HandshakeResult{};
  }

  void read_reply(xdsi::Channel& ch) {
    ch.async_read_header([this, &ch](const ErrorCode& ec, const wire::FrameHeader& h) {
      if (machine_.finished()) return;
      if (ec == boost::system::errc::protocol_error)
        return fail_early(errc::protocol_error, "server sent " + ch.last_error_text(), false, Event::local_error);
      if (ec) return channel_lost(ch, ec);
      if (h.event != wire::Event::nego_reply && h.event != wire::Event::exception)
        return fail_early(errc::protocol_error,
                          std::string("server answered the negotiation with ") + wire::to_string(h.event), false,
                          Event::local_error);
      auto buf = std::make_shared<std::vector<std::uint8_t>>(h.length);
      ch.async_read_payload(*buf, [this, &ch, buf, ev = h.event](const ErrorCode& ec) {
        if (machine_.finished()) return;
        if (ec) return channel_lost(ch, ec);
        std::string why;
        if (ev == wire::Event::exception) {
          auto ex = wire::decode_exception(*buf, &why);
          if (!ex) return fail_early(errc::protocol_error, "bad exception header: " + why, false, Event::local_error);
          return fail_early(ex->code, ex->message, true, Event::peer_exception);
        }
        auto r = wire::decode_reply(*buf, &why);
        if (!r) return fail_early(errc::protocol_error, "bad negotiation reply: " + why, false, Event::local_error);
        if (r->block_size != nego_.block_size || (reply_ && !(*reply_ == *r)))
          return fail_early(errc::protocol_error, "negotiation replies disagree", false, Event::local_error);
        reply_ = *r;
        if (++replied_ == opt_.channels) accepted();
      });
    });
  }

  void accepted() {
    auto action = machine_.fire(Event::accepted);
    if (!action) return fail_early(errc::state_violation, machine_.why(), false, Event::local_error);
    deadline_.cancel();
    accepted_at_ = Clock::now();
    accepted_ = true;
    if (*action == Action::serve_path) {
      // The path client takes over the channels and runs the loop itself from now on.
      path_ready_ = true;
      ticker_.cancel();
      seconds_ = std::chrono::duration<double>(Clock::now() - start_).count();
      io_.stop();
      return;
    }
    TransferParams p;
    p.block_size = nego_.block_size;
    p.slots = slots_;
    p.idle_timeout = opt_.idle_timeout;
    if (*action == Action::start_sending) {
      if (reply_->window < nego_.block_size)
        return fail_early(errc::protocol_error, "server window is smaller than one block", false, Event::local_error);
      p.file_size = size_;
      p.window = reply_->window;
      p.data_event = wire::Event::xftsmu;
      sender_ = std::make_unique<Sender>(io_, machine_, channels_, *this, p,
                                         piod::Source{source_.get(), size_, memory_source_, crypto(true)});
      sender_->start();
    } else {
      size_ = reply_->file_size;
      if (pending_.active())
        if (auto st = files::check_room(pending_.dir(), size_, "'" + pending_.final_name() + "'"); !st)
          return fail_early(st.code, st.message, false, Event::local_error);
      p.file_size = size_;
      p.data_event = wire::Event::xftsmd;
      sink_.opener = crypto(false);
      receiver_ = std::make_unique<Receiver>(io_, machine_, channels_, *this, p, sink_);
      receiver_->start();
    }
  }

  // The block protection of this session's data direction (none in clear mode).
  xsec::BlockCrypto* crypto(bool client_to_server) {
    if (opt_.protect == xsec::Protect::clear) return nullptr;
    block_crypto_ = std::make_unique<xsec::BlockCrypto>(opt_.protect, static_cast<xsec::Cipher>(opening_.cipher),
                                                        xsec::data_key(secret_, client_to_server));
    return block_crypto_.get();
  }

  void channel_lost(xdsi::Channel& ch, const ErrorCode& ec) {
    if (ec == boost::asio::error::operation_aborted) return;
    fail_early(errc::peer_aborted,
               fmt::format("server closed channel {} during negotiation ({})", ch.index(), ec.message()), true,
               Event::channel_lost);
  }

  // Failure before an engine runs: close everything and record the error.
  void fail_early(errc code, const std::string& message, bool remote, Event ev) {
    if (machine_.finished()) return;
    if (!machine_.fire(ev)) (void)machine_.fire(Event::local_error);
    resolver_.cancel();
    for (auto& ch : channels_)
      if (ch) ch->close();
    end(code, message, remote);
  }

  void end(errc code, const std::string& message, bool remote) {
    if (ended_) return;
    ended_ = true;
    code_ = code;
    message_ = message;
    remote_ = remote;
    seconds_ = std::chrono::duration<double>(Clock::now() - start_).count();
    if (code != errc::ok) pending_.discard();
    deadline_.cancel();
    ticker_.cancel();
  }

  void tick() {
    ticker_.expires_after(opt_.progress_interval);
    ticker_.async_wait([this](const ErrorCode& ec) {
      if (ec || ended_) return;
      if (opt_.cancel && opt_.cancel->load()) {
        if (sender_) return sender_->abort(errc::cancelled, "cancelled by the user");
        if (receiver_) return receiver_->abort(errc::cancelled, "cancelled by the user");
        return fail_early(errc::cancelled, "cancelled by the user", false, Event::local_error);
      }
      if (opt_.progress && (sender_ || receiver_)) {
        const std::uint64_t done = sender_ ? sender_->bytes_done() : receiver_->bytes_done();
        opt_.progress(Progress{done, size_, std::chrono::duration<double>(Clock::now() - accepted_at_).count()});
      }
      tick();
    });
  }

  boost::asio::io_context io_{1};
  Machine machine_;
  Endpoint endpoint_;
  TransferOptions opt_;
  wire::Opening opening_;   // what every channel says first (each with its own index and nonce)
  wire::Negotiation nego_;  // what channel 0 says inside its handshake
  std::uint32_t slots_ = 32;
  tcp::resolver resolver_;
  tcp::resolver::results_type results_;
  xsec::KeyPair identity_;
  std::string known_hosts_path_;
  xsec::Key32 secret_{};
  boost::asio::steady_timer deadline_;
  boost::asio::steady_timer ticker_;
  boost::asio::steady_timer linger_;
  ChannelList channels_;
  unsigned connected_ = 0;
  unsigned replied_ = 0;
  std::optional<wire::NegotiationReply> reply_;
  files::Fd source_;
  bool memory_source_ = false;
  files::Fd in_place_;
  files::PendingFile pending_;
  piod::Sink sink_;
  std::uint64_t size_ = 0;
  std::unique_ptr<xsec::BlockCrypto> block_crypto_;  // used by the disk thread: outlives the engines
  std::unique_ptr<Sender> sender_;
  std::unique_ptr<Receiver> receiver_;
  Clock::time_point start_;
  Clock::time_point accepted_at_;
  bool accepted_ = false;
  bool ended_ = false;
  bool path_ready_ = false;
  errc code_ = errc::ok;
  std::string message_;
  bool remote_ = false;
  double seconds_ = 0;
};

}  // namespace

struct RemoteFs::Impl {
  std::unique_ptr<ClientSession> session;
  std::unique_ptr<pathm::Client> client;
  // Keep-alives between calls.
  std::thread keeper;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;

  void stop_keeper() {
    {
      std::lock_guard lk(mu);
      stopping = true;
    }
    cv.notify_all();
    if (keeper.joinable()) keeper.join();
  }
};

RemoteFs::RemoteFs(const Endpoint& server, const TransferOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->session = std::make_unique<ClientSession>(Mode::path, server, ".", options);
  impl_->session->open_path();
  auto& s = *impl_->session;
  impl_->client = std::make_unique<pathm::Client>(s.io(), s.channels(), s.block_size(), options.cancel,
                                                  options.idle_timeout);
  if (options.keep_alive.count() > 0) {
    impl_->keeper = std::thread([impl = impl_.get(), every = options.keep_alive] {
      std::unique_lock lk(impl->mu);
      while (!impl->cv.wait_for(lk, every, [impl] { return impl->stopping; })) {
        lk.unlock();
        impl->client->keep_alive();
        lk.lock();
      }
    });
  }
}

RemoteFs::~RemoteFs() {
  try {
    close();
  } catch (...) {
  }
}

pathm::Client* RemoteFs::operator->() { return impl_->client.get(); }
pathm::Client& RemoteFs::client() { return *impl_->client; }

void RemoteFs::close() {
  if (!impl_->client) return;
  impl_->stop_keeper();
  impl_->client->close();
  (void)impl_->session->machine().fire(Event::committed);
}

TransferResult upload(const std::string& local, const Endpoint& server, const std::string& remote_path,
                      const TransferOptions& options) {
  ClientSession s(Mode::upload, server, remote_path, options);
  return s.upload(local);
}

TransferResult download(const Endpoint& server, const std::string& remote_path, const std::string& local,
                        const TransferOptions& options) {
  ClientSession s(Mode::download, server, remote_path, options);
  return s.download(local);
}

}  // namespace xdfs
