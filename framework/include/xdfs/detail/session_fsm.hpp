// The session's state machines, as data: the server's and the client's side of a session that
// carries one operation after another on its n channels. The operations themselves have their
// own tables (xFTSM, path mode); this one says when an operation may start, what ends it, and
// how the session ends. The session code asks it before it acts, and does the action it names;
// the model checker's generator reads the same rows.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "xdfs/detail/fsm.hpp"

namespace xdfs::session_fsm {

enum class State : std::uint8_t {
  idle,         ///< nothing yet
  joining,      ///< server: channel 0 registered the session, the other n-1 are awaited
  negotiating,  ///< client: an operation's negotiation is out, its answers awaited
  operating,    ///< an operation runs on the channels
  ready,        ///< between operations: the channels are clear
  done,         ///< the session ended as the client asked (final)
  failed,       ///< the session ended with an error (final)
};

enum class SessionEvent : std::uint8_t {
  channel_joined,     ///< server: one more authenticated channel
  all_joined,         ///< server: all n are there
  begin,              ///< client: the user starts an operation
  accepted,           ///< client: every channel answered the negotiation with a reply
  refused,            ///< client: every channel answered with a refusal
  operation_asked,    ///< server: every channel carried the same next negotiation
  operation_refused,  ///< server: the operation was refused before it started
  operation_ended,    ///< the operation ended on every channel; the channels are clear
  operation_failed,   ///< the operation failed (its mode told the peer)
  end_asked,          ///< server: EOFT on every channel; client: the user closes
  peer_left,          ///< server: a channel closed between operations
  peer_exception,     ///< an exception from the peer outside an operation
  local_error,        ///< this side failed outside an operation (bad frame, ...)
  timeout,            ///< a bounded wait ran out (join, negotiation, idle between operations)
};

enum class SessionAction : std::uint8_t {
  none,
  register_session,   ///< server: start the join timer
  add_channel,        ///< server: take the channel
  connect_channels,   ///< client: connect and authenticate n channels, the negotiation in the handshake
  send_negotiation,   ///< client: the next operation's NEGO on every channel
  start_operation,    ///< start the operation's mode on the channels
  refuse_operation,   ///< server: the refusal on every channel, then await the next
  report_refusal,     ///< client: the operation's error to the caller, the session stays
  await_next,         ///< server: read one frame from every channel
  finish,             ///< server: close the channels, report; client: EOFT on every channel, close
  abort,              ///< tell the peer (when it can hear), close the channels, report
};

const char* to_string(State s) noexcept;
const char* to_string(SessionEvent e) noexcept;
const char* to_string(SessionAction a) noexcept;

using Transition = fsm::Transition<State, SessionEvent, SessionAction>;

enum class Side : std::uint8_t { server, client };
const char* to_string(Side s) noexcept;
std::span<const Transition> table(Side s) noexcept;

/// A running session machine.
class Machine : public fsm::Machine<State, SessionEvent, SessionAction> {
public:
  explicit Machine(Side side) noexcept
      : fsm::Machine<State, SessionEvent, SessionAction>(table(side), side == Side::server ? "session-server" : "session-client") {}
};

}  // namespace xdfs::session_fsm
