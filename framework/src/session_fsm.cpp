#include "xdfs/detail/session_fsm.hpp"

namespace xdfs::session_fsm {
namespace {

using S = State;
using E = SessionEvent;
using A = SessionAction;

// The server's side. An operation's own failures end it inside its mode (which tells the peer);
// the session then only records that it failed.
constexpr Transition server_rows[] = {
    {S::idle, E::channel_joined, S::joining, A::register_session},
    {S::idle, E::local_error, S::failed, A::abort},
    {S::joining, E::channel_joined, S::joining, A::add_channel},
    {S::joining, E::all_joined, S::operating, A::start_operation},
    {S::joining, E::peer_exception, S::failed, A::abort},
    {S::joining, E::local_error, S::failed, A::abort},
    {S::joining, E::timeout, S::failed, A::abort},
    {S::joining, E::peer_left, S::failed, A::abort},
    {S::operating, E::operation_refused, S::ready, A::refuse_operation},
    {S::operating, E::operation_ended, S::ready, A::await_next},
    {S::operating, E::operation_failed, S::failed, A::none},
    {S::ready, E::operation_asked, S::operating, A::start_operation},
    {S::ready, E::end_asked, S::done, A::finish},
    {S::ready, E::peer_left, S::done, A::finish},
    {S::ready, E::peer_exception, S::failed, A::abort},
    {S::ready, E::local_error, S::failed, A::abort},
    {S::ready, E::timeout, S::failed, A::abort},
};

// The client's side: the first begin connects (the negotiation rides in the handshake), later
// ones send it on the open channels.
constexpr Transition client_rows[] = {
    {S::idle, E::begin, S::negotiating, A::connect_channels},
    {S::negotiating, E::accepted, S::operating, A::start_operation},
    {S::negotiating, E::refused, S::ready, A::report_refusal},
    {S::negotiating, E::peer_exception, S::failed, A::abort},
    {S::negotiating, E::local_error, S::failed, A::abort},
    {S::negotiating, E::timeout, S::failed, A::abort},
    {S::operating, E::operation_ended, S::ready, A::none},
    {S::operating, E::operation_failed, S::failed, A::none},
    {S::ready, E::begin, S::negotiating, A::send_negotiation},
    {S::ready, E::end_asked, S::done, A::finish},
    {S::idle, E::end_asked, S::done, A::none},
};

}  // namespace

std::span<const Transition> table(Side s) noexcept {
  return s == Side::server ? std::span<const Transition>(server_rows) : std::span<const Transition>(client_rows);
}

const char* to_string(State s) noexcept {
  switch (s) {
    case State::idle: return "idle";
    case State::joining: return "joining";
    case State::negotiating: return "negotiating";
    case State::operating: return "operating";
    case State::ready: return "ready";
    case State::done: return "done";
    case State::failed: return "failed";
  }
  return "?";
}

const char* to_string(SessionEvent e) noexcept {
  switch (e) {
    case SessionEvent::channel_joined: return "channel_joined";
    case SessionEvent::all_joined: return "all_joined";
    case SessionEvent::begin: return "begin";
    case SessionEvent::accepted: return "accepted";
    case SessionEvent::refused: return "refused";
    case SessionEvent::operation_asked: return "operation_asked";
    case SessionEvent::operation_refused: return "operation_refused";
    case SessionEvent::operation_ended: return "operation_ended";
    case SessionEvent::operation_failed: return "operation_failed";
    case SessionEvent::end_asked: return "end_asked";
    case SessionEvent::peer_left: return "peer_left";
    case SessionEvent::peer_exception: return "peer_exception";
    case SessionEvent::local_error: return "local_error";
    case SessionEvent::timeout: return "timeout";
  }
  return "?";
}

const char* to_string(SessionAction a) noexcept {
  switch (a) {
    case SessionAction::none: return "none";
    case SessionAction::register_session: return "register_session";
    case SessionAction::add_channel: return "add_channel";
    case SessionAction::connect_channels: return "connect_channels";
    case SessionAction::send_negotiation: return "send_negotiation";
    case SessionAction::start_operation: return "start_operation";
    case SessionAction::refuse_operation: return "refuse_operation";
    case SessionAction::report_refusal: return "report_refusal";
    case SessionAction::await_next: return "await_next";
    case SessionAction::finish: return "finish";
    case SessionAction::abort: return "abort";
  }
  return "?";
}

const char* to_string(Side s) noexcept { return s == Side::server ? "server" : "client"; }

}  // namespace xdfs::session_fsm
