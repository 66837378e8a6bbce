#include "xdfs/detail/session_fsm.hpp"

namespace xdfs::session_fsm {
namespace {

using S = State;
using E = Event;
using A = Action;

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

const Transition* Machine::find(Event e) const noexcept {
  for (const auto& t : table_)
    if (t.from == state_ && t.on == e) return &t;
  return nullptr;
}

std::optional<Action> Machine::fire(Event e) noexcept {
  const Transition* t = find(e);
  if (!t) {
    why_ = std::string("session-") + to_string(side_) + ": event " + to_string(e) + " is not allowed in state " +
           to_string(state_);
    return std::nullopt;
  }
  state_ = t->to;
  return t->action;
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

const char* to_string(Event e) noexcept {
  switch (e) {
    case Event::channel_joined: return "channel_joined";
    case Event::all_joined: return "all_joined";
    case Event::begin: return "begin";
    case Event::accepted: return "accepted";
    case Event::refused: return "refused";
    case Event::operation_asked: return "operation_asked";
    case Event::operation_refused: return "operation_refused";
    case Event::operation_ended: return "operation_ended";
    case Event::operation_failed: return "operation_failed";
    case Event::end_asked: return "end_asked";
    case Event::peer_left: return "peer_left";
    case Event::peer_exception: return "peer_exception";
    case Event::local_error: return "local_error";
    case Event::timeout: return "timeout";
  }
  return "?";
}

const char* to_string(Action a) noexcept {
  switch (a) {
    case Action::none: return "none";
    case Action::register_session: return "register_session";
    case Action::add_channel: return "add_channel";
    case Action::connect_channels: return "connect_channels";
    case Action::send_negotiation: return "send_negotiation";
    case Action::start_operation: return "start_operation";
    case Action::refuse_operation: return "refuse_operation";
    case Action::report_refusal: return "report_refusal";
    case Action::await_next: return "await_next";
    case Action::finish: return "finish";
    case Action::abort: return "abort";
  }
  return "?";
}

const char* to_string(Side s) noexcept { return s == Side::server ? "server" : "client"; }

}  // namespace xdfs::session_fsm
