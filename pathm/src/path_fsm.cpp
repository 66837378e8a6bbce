#include "xdfs/detail/path_fsm.hpp"

namespace xdfs::pathm {
namespace {

using S = PathState;
using E = PathEvent;
using A = PathAction;

// Failure rows every live state has.
#define XDFS_PATH_FAILURES(st)                  \
  {st, E::peer_exception, S::failed, A::abort}, \
  {st, E::local_error, S::failed, A::abort},    \
  {st, E::channel_lost, S::failed, A::abort},   \
  {st, E::timeout, S::failed, A::abort}

constexpr PathTransition client_rows[] = {
    {S::idle, E::accepted, S::serving, A::serve},
    {S::serving, E::request, S::serving, A::send_request},
    {S::serving, E::reply, S::serving, A::deliver_reply},
    {S::serving, E::end_asked, S::ending, A::send_eofr},
    XDFS_PATH_FAILURES(S::serving),
    {S::ending, E::channel_ended, S::ending, A::none},
    {S::ending, E::committed, S::done, A::finish},
    XDFS_PATH_FAILURES(S::ending),
    // Last, so that the rows above keep their numbers: a failure before the operation started.
    XDFS_PATH_FAILURES(S::idle),
};

constexpr PathTransition server_rows[] = {
    {S::idle, E::accepted, S::serving, A::serve},
    {S::serving, E::request, S::serving, A::execute},
    {S::serving, E::replied, S::serving, A::none},
    {S::serving, E::channel_ended, S::serving, A::none},
    {S::serving, E::all_ended, S::ending, A::none},
    XDFS_PATH_FAILURES(S::serving),
    {S::ending, E::replied, S::ending, A::none},
    {S::ending, E::all_answered, S::closing, A::send_eofr},
    XDFS_PATH_FAILURES(S::ending),
    {S::closing, E::committed, S::done, A::finish},
    XDFS_PATH_FAILURES(S::closing),
    XDFS_PATH_FAILURES(S::idle),
};

#undef XDFS_PATH_FAILURES

}  // namespace

std::span<const PathTransition> table(PathSide s) noexcept {
  return s == PathSide::client ? std::span<const PathTransition>(client_rows) : std::span<const PathTransition>(server_rows);
}

const char* to_string(PathState s) noexcept {
  switch (s) {
    case PathState::idle: return "idle";
    case PathState::serving: return "serving";
    case PathState::ending: return "ending";
    case PathState::closing: return "closing";
    case PathState::done: return "done";
    case PathState::failed: return "failed";
  }
  return "?";
}

const char* to_string(PathEvent e) noexcept {
  switch (e) {
    case PathEvent::accepted: return "accepted";
    case PathEvent::request: return "request";
    case PathEvent::reply: return "reply";
    case PathEvent::replied: return "replied";
    case PathEvent::end_asked: return "end_asked";
    case PathEvent::channel_ended: return "channel_ended";
    case PathEvent::all_ended: return "all_ended";
    case PathEvent::all_answered: return "all_answered";
    case PathEvent::committed: return "committed";
    case PathEvent::peer_exception: return "peer_exception";
    case PathEvent::local_error: return "local_error";
    case PathEvent::channel_lost: return "channel_lost";
    case PathEvent::timeout: return "timeout";
  }
  return "?";
}

const char* to_string(PathAction a) noexcept {
  switch (a) {
    case PathAction::none: return "none";
    case PathAction::serve: return "serve";
    case PathAction::send_request: return "send_request";
    case PathAction::deliver_reply: return "deliver_reply";
    case PathAction::execute: return "execute";
    case PathAction::send_eofr: return "send_eofr";
    case PathAction::finish: return "finish";
    case PathAction::abort: return "abort";
  }
  return "?";
}

const char* to_string(PathSide s) noexcept { return s == PathSide::client ? "client-path" : "server-path"; }

}  // namespace xdfs::pathm
