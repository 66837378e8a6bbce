// The relay's communicating state machines, as data: the master's side of a place (what its
// session to one host does) and the host's (the relay operation in xdfsd); and a pull's two
// sides: the xdfsd that runs the file's chain (its pull operation) and the host that asked
// (xduc get), whose session lasts until the chain lets it go.
//
// A pull is answered (NEGO_REPLY) and the host joins the chain; the master ends it with EOFR once
// the host's copy is whole and nobody needs it (release), which the host answers with EOFR
// (ended); or with an EXCEPTION when the chain put the host out (give_up).
//
// A place is registered (NEGO, NEGO_REPLY), then the host reports ten times a second while the
// master may RELINK it; the master ends it with EOFR, which the host answers with its last report
// and EOFR. Either side may give up with an EXCEPTION; a lost channel, a local error or a timeout
// fails it. The engines (RelayOperation in relay/src/server_mode.cpp, the master's report reader
// in relay/src/master.cpp) feed what happens into their machine and run the action the table
// answers; an event the table does not allow is an error with a name.
#pragma once

#include <cstdint>
#include <span>

#include "xdfs/detail/fsm.hpp"

namespace xdfs::relay_fsm {

enum class RelayState : std::uint8_t {
  idle,       ///< negotiated; not registered yet (host) / not answered yet (master)
  placed,     ///< registered: reports flow, RELINKs may come
  releasing,  ///< master: its EOFR went; the host's last report and EOFR are awaited
  done,       ///< ended on its channel (final)
  failed,     ///< ended with an error (final)
};

enum class RelayEvent : std::uint8_t {
  accepted,        ///< host: the place is registered and its reply went; master: the reply came
  tick,            ///< host: time to report
  report,          ///< master: a report came
  relink,          ///< host: a RELINK came; master: the master sends one
  release,         ///< master: the chain is done, it sends EOFR
  ended,           ///< host: the master's EOFR came; master: the host's EOFR came
  give_up,         ///< master: it drops this host (sends an EXCEPTION)
  peer_exception,  ///< an exception header arrived
  local_error,     ///< this side failed (a bad frame, a refused hop, the server stopping)
  channel_lost,    ///< the channel closed or reset
  timeout,         ///< a bounded wait ran out (a master that reads no report)
};

enum class RelayAction : std::uint8_t {
  none,          ///< only the state changes
  start,         ///< host: start the forwarder, the reads and the reports; master: read reports
  send_report,   ///< host: the next report
  record,        ///< master: keep the report
  apply_relink,  ///< host: the forwarder goes to the new hops
  send_relink,   ///< master: put the RELINK on the channel
  send_eofr,     ///< master: EOFR on the channel
  release,       ///< host: stop the forwarder, last report and EOFR, remove the place
  finish,        ///< master: the place is over, the channel is the session's again
  tell_and_drop, ///< master: an EXCEPTION to the host, then nothing more from it counts
  refuse,        ///< host: the operation is refused before it began (nothing was sent)
  abort,         ///< stop the forwarder, remove the place, tell the peer, close the channel
  watch,         ///< pull master: watch the chain for how this host ends
  send_eofr_back,  ///< pulling host: its EOFR, then its copy goes to DST
};

enum class RelaySide : std::uint8_t { master, host, pull_master, pull_host };

const char* to_string(RelayState s) noexcept;
const char* to_string(RelayEvent e) noexcept;
const char* to_string(RelayAction a) noexcept;
/// "relay-master", "relay-host": how tests and why() name the tables.
const char* to_string(RelaySide s) noexcept;

using RelayTransition = fsm::Transition<RelayState, RelayEvent, RelayAction>;

std::span<const RelayTransition> table(RelaySide s) noexcept;

class RelayMachine : public fsm::Machine<RelayState, RelayEvent, RelayAction> {
public:
  explicit RelayMachine(RelaySide s) noexcept
      : fsm::Machine<RelayState, RelayEvent, RelayAction>(table(s), to_string(s)) {}
};

}  // namespace xdfs::relay_fsm
