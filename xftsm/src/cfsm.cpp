#include "xdfs/detail/xftsm_fsm.hpp"

#include <array>

namespace xdfs::xftsm {
namespace {

using S = State;
using E = TransferEvent;
using A = TransferAction;

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
  {S::transferring, E::nack_received, S::transferring, A::resend_block},  \
  {S::transferring, E::all_sent, S::draining, A::send_eofr},              \
  XDFS_FAILURES(S::transferring),                                         \
  {S::draining, E::block_sent, S::draining, A::none},                     \
  {S::draining, E::committed, S::done, A::finish},                        \
  XDFS_FAILURES(S::draining)

#define XDFS_RECEIVER_ROWS                                                \
  {S::transferring, E::block_received, S::transferring, A::queue_write},  \
  {S::transferring, E::block_written, S::transferring, A::send_ack},      \
  {S::transferring, E::ack_sent, S::transferring, A::none},               \
  {S::transferring, E::block_rejected, S::transferring, A::send_nack},    \
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
  }
  return {};
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

const char* to_string(TransferEvent e) noexcept {
  switch (e) {
    case TransferEvent::start: return "start";
    case TransferEvent::connected: return "connected";
    case TransferEvent::channel_joined: return "channel_joined";
    case TransferEvent::all_joined: return "all_joined";
    case TransferEvent::accepted: return "accepted";
    case TransferEvent::block_ready: return "block_ready";
    case TransferEvent::block_sent: return "block_sent";
    case TransferEvent::block_received: return "block_received";
    case TransferEvent::block_written: return "block_written";
    case TransferEvent::ack_received: return "ack_received";
    case TransferEvent::ack_sent: return "ack_sent";
    case TransferEvent::all_sent: return "all_sent";
    case TransferEvent::all_received: return "all_received";
    case TransferEvent::committed: return "committed";
    case TransferEvent::block_rejected: return "block_rejected";
    case TransferEvent::nack_received: return "nack_received";
    case TransferEvent::peer_exception: return "peer_exception";
    case TransferEvent::local_error: return "local_error";
    case TransferEvent::channel_lost: return "channel_lost";
    case TransferEvent::timeout: return "timeout";
  }
  return "?";
}

const char* to_string(TransferAction a) noexcept {
  switch (a) {
    case TransferAction::none: return "none";
    case TransferAction::connect_channels: return "connect_channels";
    case TransferAction::register_session: return "register_session";
    case TransferAction::add_channel: return "add_channel";
    case TransferAction::open_and_reply: return "open_and_reply";
    case TransferAction::start_sending: return "start_sending";
    case TransferAction::start_receiving: return "start_receiving";
    case TransferAction::send_block: return "send_block";
    case TransferAction::queue_write: return "queue_write";
    case TransferAction::send_ack: return "send_ack";
    case TransferAction::open_window: return "open_window";
    case TransferAction::send_eofr: return "send_eofr";
    case TransferAction::commit: return "commit";
    case TransferAction::send_nack: return "send_nack";
    case TransferAction::resend_block: return "resend_block";
    case TransferAction::finish: return "finish";
    case TransferAction::abort: return "abort";
  }
  return "?";
}

const char* to_string(Role r) noexcept {
  switch (r) {
    case Role::client_upload: return "client-upload";
    case Role::client_download: return "client-download";
    case Role::server_upload: return "server-upload";
    case Role::server_download: return "server-download";
  }
  return "?";
}

}  // namespace xdfs::xftsm
