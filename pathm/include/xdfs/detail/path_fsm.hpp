// Path mode's communicating state machines (xPathM), as data: the client's and the server's.
//
// An operation of path mode is many requests in flight on the session's n channels, each
// answered on the channel it came on, until the client ends it: EOFR on every channel once
// every request has its answer, answered by the server's EOFR on every channel once every
// request is answered and every reply has left. The engines (PathClient, PathServer) feed what
// happens into their machine and run the action the table answers; the model checker reads the
// same rows (tests/model/gen.cpp).
#pragma once

#include <cstdint>
#include <span>

#include "xdfs/detail/fsm.hpp"

namespace xdfs::pathm {

enum class PathState : std::uint8_t {
  idle,     ///< negotiated; nothing served yet
  serving,  ///< requests and replies flow
  ending,   ///< client: its EOFR went on every channel, the server's are awaited; server: the
            ///< client's EOFR came on every channel, requests are still being answered
  closing,  ///< server: every request answered, its EOFRs on their way
  done,     ///< the operation ended on every channel (final)
  failed,   ///< the operation ended with an error (final)
};

enum class PathEvent : std::uint8_t {
  accepted,        ///< the operation began: server, its reply went; client, the server's reply came
  request,         ///< client: the caller asks; server: a request arrived whole
  reply,           ///< client: a reply arrived
  replied,         ///< server: a reply left
  end_asked,       ///< client: the caller ends the operation (every request has its answer)
  channel_ended,   ///< the peer's EOFR on one channel, not yet on all
  all_ended,       ///< server: the client's EOFR on every channel
  all_answered,    ///< server: after all_ended, every request answered and every reply sent
  committed,       ///< client: the server's EOFR on every channel; server: its EOFRs left
  peer_exception,  ///< an exception header arrived
  local_error,     ///< this side failed (a bad frame, a worker that threw, a state violation)
  channel_lost,    ///< a channel closed or reset before the end
  timeout,         ///< a bounded wait ran out
};

enum class PathAction : std::uint8_t {
  none,           ///< only the state changes (or a counter in the engine)
  serve,          ///< start reading every channel
  send_request,   ///< client: put the request on the least loaded channel
  deliver_reply,  ///< client: hand the reply to the call that waits for it
  execute,        ///< server: hand the request to a worker
  send_eofr,      ///< EOFR on every channel (server: and stop the workers, drop unfinished files)
  finish,         ///< report success; the channels are the session's again
  abort,          ///< discard what is unfinished, tell the peer, close the channels
};

enum class PathSide : std::uint8_t { client, server };

const char* to_string(PathState s) noexcept;
const char* to_string(PathEvent e) noexcept;
const char* to_string(PathAction a) noexcept;
/// "client-path", "server-path": how tests, the model and why() name the tables.
const char* to_string(PathSide s) noexcept;

using PathTransition = fsm::Transition<PathState, PathEvent, PathAction>;

/// The table of a side.
std::span<const PathTransition> table(PathSide s) noexcept;

/// A running machine of a side (on its table, or on other rows: a test's changed copy).
class PathMachine : public fsm::Machine<PathState, PathEvent, PathAction> {
public:
  explicit PathMachine(PathSide s) noexcept : PathMachine(s, table(s)) {}
  PathMachine(PathSide s, std::span<const PathTransition> rows) noexcept
      : fsm::Machine<PathState, PathEvent, PathAction>(rows, to_string(s)) {}
};

}  // namespace xdfs::pathm
