#include "xdfs/xftsm/cfsm.hpp"

#include <array>

namespace xdfs::xftsm {
namespace {

using S = State;
using E = Event;
using A = Action;

// Failure rows every machine has in every live state: listed once per state below.
#define XDFS_FAILURES(st)                                   \
  {st, E::peer_exception, S::failed, A::abort},             \
  {st, E::local_error, S::failed, A::abort},                \
  {st, E::channel_lost, S::failed, A::abort},               \
  {st, E::timeout, S::failed, A::abort}

// After the session is accepted, a sender (client upload, server download) and a receiver
// (client download, server upload) behave the same whichever end they are: the duality the
// paper notes between the right-hand sides of its figures.
#define XDFS_SENDER_ROWS                                                  \
  {S::transferring, E::block_ready, S::transferring, A::send_block},      \
  {S::transferring, E::block_sent, S::transferring, A::send_block},       \
  {S::transferring, E::ack_received, S::transferring, A::open_window},    \
  {S::transferring, E::all_sent, S::draining, A::send_eofr},              \
  XDFS_FAILURES(S::transferring),                                         \
  {S::draining, E::block_sent, S::draining, A::none},                     \
  {S::draining, E::ack_received, S::draining, A::none},                   \
  {S::draining, E::committed, S::done, A::finish},                        \
  XDFS_FAILURES(S::draining)

#define XDFS_RECEIVER_ROWS                                                \
  {S::transferring, E::block_received, S::transferring, A::queue_write},  \
  {S::transferring, E::block_written, S::transferring, A::send_ack},      \
  {S::transferring, E::ack_sent, S::transferring, A::none},               \
  {S::transferring, E::all_received, S::draining, A::commit},             \
  XDFS_FAILURES(S::transferring),                                         \
  {S::draining, E::ack_sent, S::draining, A::none},                       \
  {S::draining, E::committed, S::done, A::finish},                        \
  XDFS_FAILURES(S::draining)

// Client, upload (Fig. 11): the client is the sender.
constexpr Transition client_upload[] = {
    {S::idle, E::start, S::connecting, A::connect_channels},
    {S::connecting, E::connected, S::negotiating, A::none},
    XDFS_FAILURES(S::connecting),
    {S::negotiating, E::accepted, S::transferring, A::start_sending},
    XDFS_FAILURES(S::negotiating),
    XDFS_SENDER_ROWS,
};

// Client, download (Fig. 9): the client is the receiver.
constexpr Transition client_download[] = {
    {S::idle, E::start, S::connecting, A::connect_channels},
    {S::connecting, E::connected, S::negotiating, A::none},
    XDFS_FAILURES(S::connecting),
    {S::negotiating, E::accepted, S::transferring, A::start_receiving},
    XDFS_FAILURES(S::negotiating),
    XDFS_RECEIVER_ROWS,
};

// Server, upload (Fig. 10): the server is the receiver.
constexpr Transition server_upload[] = {
    {S::idle, E::channel_joined, S::joining, A::register_session},
    {S::joining, E::channel_joined, S::joining, A::add_channel},
    {S::joining, E::all_joined, S::transferring, A::open_and_reply},
    XDFS_FAILURES(S::joining),
    XDFS_RECEIVER_ROWS,
};

// Server, download (Fig. 8): the server is the sender.
constexpr Transition server_download[] = {
    {S::idle, E::channel_joined, S::joining, A::register_session},
    {S::joining, E::channel_joined, S::joining, A::add_channel},
    {S::joining, E::all_joined, S::transferring, A::open_and_reply},
    XDFS_FAILURES(S::joining),
    XDFS_SENDER_ROWS,
};

// Path mode, client: once accepted, requests flow until the client ends the operation (EOFR on every
// channel, answered by the server's EOFR on every channel: committed).
constexpr Transition client_path[] = {
    {S::idle, E::start, S::connecting, A::connect_channels},
    {S::connecting, E::connected, S::negotiating, A::none},
    XDFS_FAILURES(S::connecting),
    {S::negotiating, E::accepted, S::transferring, A::serve_path},
    XDFS_FAILURES(S::negotiating),
    {S::transferring, E::committed, S::done, A::finish},
    XDFS_FAILURES(S::transferring),
};

// Path mode, server: answers requests until the client's EOFR on every channel; its own EOFRs in
// answer have left (committed).
constexpr Transition server_path[] = {
    {S::idle, E::channel_joined, S::joining, A::register_session},
    {S::joining, E::channel_joined, S::joining, A::add_channel},
    {S::joining, E::all_joined, S::transferring, A::open_and_reply},
    XDFS_FAILURES(S::joining),
    {S::transferring, E::committed, S::done, A::finish},
    XDFS_FAILURES(S::transferring),
};

#undef XDFS_SENDER_ROWS
#undef XDFS_RECEIVER_ROWS
#undef XDFS_FAILURES

}  // namespace

std::span<const Transition> table(Role r) noexcept {
  switch (r) {
    case Role::client_upload: return client_upload;
    case Role::client_download: return client_download;
    case Role::server_upload: return server_upload;
    case Role::server_download: return server_download;
    case Role::client_path: return client_path;
    case Role::server_path: return server_path;
  }
  return {};
}

const Transition* Machine::find(Event e) const noexcept {
  for (const auto& t : table_)
    if (t.from == state_ && t.on == e) return &t;
  return nullptr;
}

std::optional<Action> Machine::fire(Event e) noexcept {
  const Transition* t = find(e);
  if (!t) {
    why_ = std::string(to_string(role_)) + ": event " + to_string(e) + " is not allowed in state " + to_string(state_);
    return std::nullopt;
  }
  state_ = t->to;
  return t->action;
}

const char* to_string(State s) noexcept {
  switch (s) {
    case State::idle: return "idle";
    case State::connecting: return "connecting";
    case State::negotiating: return "negotiating";
    case State::joining: return "joining";
    case State::transferring: return "transferring";
    case State::draining: return "draining";
    case State::done: return "done";
    case State::failed: return "failed";
  }
  return "?";
}

const char* to_string(Event e) noexcept {
  switch (e) {
    case Event::start: return "start";
    case Event::connected: return "connected";
    case Event::channel_joined: return "channel_joined";
    case Event::all_joined: return "all_joined";
    case Event::accepted: return "accepted";
    case Event::block_ready: return "block_ready";
    case Event::block_sent: return "block_sent";
    case Event::block_received: return "block_received";
    case Event::block_written: return "block_written";
    case Event::ack_received: return "ack_received";
    case Event::ack_sent: return "ack_sent";
    case Event::all_sent: return "all_sent";
    case Event::all_received: return "all_received";
    case Event::committed: return "committed";
    case Event::peer_exception: return "peer_exception";
    case Event::local_error: return "local_error";
    case Event::channel_lost: return "channel_lost";
    case Event::timeout: return "timeout";
  }
  return "?";
}

const char* to_string(Action a) noexcept {
  switch (a) {
    case Action::none: return "none";
    case Action::connect_channels: return "connect_channels";
    case Action::register_session: return "register_session";
    case Action::add_channel: return "add_channel";
    case Action::open_and_reply: return "open_and_reply";
    case Action::start_sending: return "start_sending";
    case Action::start_receiving: return "start_receiving";
    case Action::send_block: return "send_block";
    case Action::queue_write: return "queue_write";
    case Action::send_ack: return "send_ack";
    case Action::open_window: return "open_window";
    case Action::send_eofr: return "send_eofr";
    case Action::commit: return "commit";
    case Action::finish: return "finish";
    case Action::abort: return "abort";
    case Action::serve_path: return "serve-path";
  }
  return "?";
}

const char* to_string(Role r) noexcept {
  switch (r) {
    case Role::client_upload: return "client-upload";
    case Role::client_download: return "client-download";
    case Role::server_upload: return "server-upload";
    case Role::server_download: return "server-download";
    case Role::client_path: return "client-path";
    case Role::server_path: return "server-path";
  }
  return "?";
}

}  // namespace xdfs::xftsm
