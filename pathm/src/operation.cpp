#include <fmt/core.h>

#include "xdfs/detail/path_server.hpp"
#include "xdfs/pathm/server_mode.hpp"
#include "xdfs/xsec.hpp"

namespace xdfs::pathm {
namespace {

// Path requests on a session's channels until the client ends the operation.
class PathOperation final : public runtime::Operation {
public:
  PathOperation(runtime::OperationEnv& env, runtime::OperationDone done) : env_(env), done_(std::move(done)) {}

  void start() override {
    const auto& n = env_.nego;
    env_.log(fmt::format("session {} start{} peer={} mode={} path={} channels={} block={} protect={} client={}",
                         env_.id.short_hex(), n.transfer ? fmt::format(" op={}", n.transfer) : std::string(), env_.peer,
                         to_string(n.mode), n.remote_path, n.channel_count, n.block_size,
                         xsec::to_string(static_cast<xsec::Protect>(env_.opening.protect)), env_.client.fingerprint));
    ServerParams pp;
    pp.block_size = n.block_size;
    pp.workers = env_.config.path_workers;
    pp.read_only = !env_.client.write;
    pp.fsync = env_.config.fsync;
    pp.tag = env_.tag;
    pp.idle_timeout = env_.config.idle_timeout;
    pp.budget = &env_.budget;
    pp.max_file_size = env_.config.max_file_size;
    // What an earlier operation of this session made is still this session's: a tree copy sets
    // the modes of its directories and large files in the operation after those files went.
    pp.made = env_.made;
    pp.metrics = env_.metrics;
    server_ = std::make_unique<PathServer>(env_.io, env_.channels, env_.root_fd, pp,
                                       [this](errc code, const std::string& message, bool from_peer) {
                                         done_(runtime::OperationResult{code, message, from_peer, false, code == errc::ok});
                                       });
    wire::NegotiationReply reply;
    reply.block_size = n.block_size;
    auto payload = wire::encode(reply);
    for (auto& ch : env_.channels) ch->send_control(wire::ChannelEvent::nego_reply, payload);
    server_->start();
  }

  void abort(errc code, const std::string& message) override {
    if (server_) server_->abort(code, message);
  }

  std::uint64_t bytes() const noexcept override { return server_ ? server_->bytes() : 0; }

private:
  runtime::OperationEnv& env_;
  runtime::OperationDone done_;
  std::unique_ptr<PathServer> server_;
};

}  // namespace

runtime::ModeEntry server_mode() {
  return runtime::ModeEntry{Mode::path, [](runtime::OperationEnv& env, runtime::OperationDone done) {
                              return std::unique_ptr<runtime::Operation>(new PathOperation(env, std::move(done)));
                            }};
}

}  // namespace xdfs::pathm
