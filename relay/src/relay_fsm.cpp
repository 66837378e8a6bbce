#include "xdfs/detail/relay_fsm.hpp"

namespace xdfs::relay_fsm {
namespace {

using S = RelayState;
using E = RelayEvent;
using A = RelayAction;

// Failure rows every live state has.
#define XDFS_RELAY_FAILURES(st)                 \
  {st, E::peer_exception, S::failed, A::abort}, \
  {st, E::local_error, S::failed, A::abort},    \
  {st, E::channel_lost, S::failed, A::abort},   \
  {st, E::timeout, S::failed, A::abort}

constexpr RelayTransition host_rows[] = {
    {S::idle, E::accepted, S::placed, A::start},
    {S::idle, E::local_error, S::failed, A::refuse},
    {S::placed, E::tick, S::placed, A::send_report},
    {S::placed, E::relink, S::placed, A::apply_relink},
    {S::placed, E::ended, S::done, A::release},
    XDFS_RELAY_FAILURES(S::placed),
};

constexpr RelayTransition master_rows[] = {
    {S::idle, E::accepted, S::placed, A::start},
    {S::placed, E::report, S::placed, A::record},
    {S::placed, E::relink, S::placed, A::send_relink},
    {S::placed, E::release, S::releasing, A::send_eofr},
    {S::placed, E::give_up, S::failed, A::tell_and_drop},
    XDFS_RELAY_FAILURES(S::placed),
    {S::releasing, E::report, S::releasing, A::record},
    {S::releasing, E::ended, S::done, A::finish},
    XDFS_RELAY_FAILURES(S::releasing),
};

// The xdfsd that runs a pulled file's chain, per host that asked (relay/src/pull.cpp). An empty
// file needs no chain: it is released at once.
constexpr RelayTransition pull_master_rows[] = {
    {S::idle, E::accepted, S::placed, A::watch},
    {S::idle, E::release, S::releasing, A::send_eofr},
    {S::idle, E::local_error, S::failed, A::refuse},
    {S::placed, E::release, S::releasing, A::send_eofr},
    {S::placed, E::give_up, S::failed, A::tell_and_drop},
    XDFS_RELAY_FAILURES(S::placed),
    {S::releasing, E::ended, S::done, A::finish},
    XDFS_RELAY_FAILURES(S::releasing),
};

// The host that asked (xduc get, relay/src/pull_client.cpp): the master's EOFR or EXCEPTION ends it.
constexpr RelayTransition pull_host_rows[] = {
    {S::idle, E::accepted, S::placed, A::none},
    {S::placed, E::ended, S::done, A::send_eofr_back},
    XDFS_RELAY_FAILURES(S::placed),
};

#undef XDFS_RELAY_FAILURES

}  // namespace

std::span<const RelayTransition> table(RelaySide s) noexcept {
  switch (s) {
    case RelaySide::master: return master_rows;
    case RelaySide::host: return host_rows;
    case RelaySide::pull_master: return pull_master_rows;
    case RelaySide::pull_host: return pull_host_rows;
  }
  return host_rows;
}

const char* to_string(RelayState s) noexcept {
  switch (s) {
    case RelayState::idle: return "idle";
    case RelayState::placed: return "placed";
    case RelayState::releasing: return "releasing";
    case RelayState::done: return "done";
    case RelayState::failed: return "failed";
  }
  return "?";
}

const char* to_string(RelayEvent e) noexcept {
  switch (e) {
    case RelayEvent::accepted: return "accepted";
    case RelayEvent::tick: return "tick";
    case RelayEvent::report: return "report";
    case RelayEvent::relink: return "relink";
    case RelayEvent::release: return "release";
    case RelayEvent::ended: return "ended";
    case RelayEvent::give_up: return "give_up";
    case RelayEvent::peer_exception: return "peer_exception";
    case RelayEvent::local_error: return "local_error";
    case RelayEvent::channel_lost: return "channel_lost";
    case RelayEvent::timeout: return "timeout";
  }
  return "?";
}

const char* to_string(RelayAction a) noexcept {
  switch (a) {
    case RelayAction::none: return "none";
    case RelayAction::start: return "start";
    case RelayAction::send_report: return "send_report";
    case RelayAction::record: return "record";
    case RelayAction::apply_relink: return "apply_relink";
    case RelayAction::send_relink: return "send_relink";
    case RelayAction::send_eofr: return "send_eofr";
    case RelayAction::release: return "release";
    case RelayAction::finish: return "finish";
    case RelayAction::tell_and_drop: return "tell_and_drop";
    case RelayAction::refuse: return "refuse";
    case RelayAction::abort: return "abort";
    case RelayAction::watch: return "watch";
    case RelayAction::send_eofr_back: return "send_eofr_back";
  }
  return "?";
}

const char* to_string(RelaySide s) noexcept {
  switch (s) {
    case RelaySide::master: return "relay-master";
    case RelaySide::host: return "relay-host";
    case RelaySide::pull_master: return "pull-master";
    case RelaySide::pull_host: return "pull-host";
  }
  return "?";
}

}  // namespace xdfs::relay_fsm
