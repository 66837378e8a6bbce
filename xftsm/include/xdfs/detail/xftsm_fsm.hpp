// The xFTSM communicating finite state machines (the paper's Figs. 8-11), as data.
//
// Each side of each mode has an enum of states, an enum of events and a transition table.
// The socket code turns I/O completions into events and asks the machine what to do: the
// table says the next state and the action to run. An event the table does not allow in the
// current state is refused with errc::state_violation and a message naming both.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <system_error>

#include "xdfs/detail/fsm.hpp"
#include "xdfs/error.hpp"

namespace xdfs::xftsm {

/// States shared by the four machines (each table uses the subset it needs).
enum class State : std::uint8_t {
  idle,         ///< nothing has happened yet
  connecting,   ///< client: opening the n channels
  negotiating,  ///< client: negotiation headers sent, waiting for the server's reply
  joining,      ///< server: first channel registered the session, waiting for the other n-1
  transferring, ///< blocks flow: sending, or receiving and writing
  draining,     ///< sender: all blocks sent, waiting for the receiver to confirm; receiver: all blocks in, waiting for the disk
  done,         ///< the file is complete at the receiver (final state)
  failed,       ///< the session ended with an error (final state)
};

/// Everything that can happen to a session, as the socket and disk code reports it.
enum class TransferEvent : std::uint8_t {
  start,            ///< client: the user asked for the transfer
  connected,        ///< client: all n channels are connected, negotiation headers sent
  channel_joined,   ///< server: one more of the n channels arrived
  all_joined,       ///< server: all n channels are there and the file is open
  accepted,         ///< client: the server's negotiation reply arrived on every channel
  block_ready,      ///< sender: the disk thread read a block ahead
  block_sent,       ///< sender: a block left on a channel
  block_received,   ///< receiver: a block arrived on a channel and went to the disk thread
  block_written,    ///< receiver: the disk thread wrote blocks
  ack_received,     ///< sender: the receiver acknowledged written bytes
  ack_sent,         ///< receiver: an acknowledgement left
  all_sent,         ///< sender: every block is out and acknowledged: EOFR goes on every channel
  all_received,     ///< receiver: EOFR on every channel and every byte accounted for
  committed,        ///< receiver: the file is final and its EOFRs left; sender: the receiver's EOFR came on every channel
  block_rejected,   ///< receiver (clear mode, manifest): a block did not match its digest and was not written
  nack_received,    ///< sender: the receiver asks for a block again (NACK)
  peer_exception,   ///< an exception header arrived
  local_error,      ///< this side failed (disk, bad frame, state violation)
  channel_lost,     ///< a channel closed or reset before the end
  timeout,          ///< a bounded wait ran out (join, idle)
};

/// What the driver must do on a transition.
enum class TransferAction : std::uint8_t {
  none,              ///< only the state changes (or a counter in the driver)
  connect_channels,  ///< client: open n channels and send the negotiation headers
  register_session,  ///< server: record the session and start the join timer
  add_channel,       ///< server: add a channel to the session
  open_and_reply,    ///< server: open the file and send the negotiation reply on every channel
  start_sending,     ///< sender: start reading ahead and sending blocks
  start_receiving,   ///< receiver: start reading blocks from every channel
  send_block,        ///< sender: put the next block on an idle channel
  queue_write,       ///< receiver: hand the block to the disk thread
  send_ack,          ///< receiver: send a cumulative acknowledgement
  open_window,       ///< sender: acknowledged bytes free window room
  send_eofr,         ///< sender: end of blocks on every channel
  commit,            ///< receiver: flush, check the size, rename into place, EOFR on every channel
  send_nack,         ///< receiver: ask for the rejected block again (NACK), at most three times per block
  resend_block,      ///< sender: read the block again and send it, ahead of new ones and outside the window
  finish,            ///< close the channels, report success
  abort,             ///< discard any partial file, tell the peer, close the channels
};

const char* to_string(State s) noexcept;
const char* to_string(TransferEvent e) noexcept;
const char* to_string(TransferAction a) noexcept;

using Transition = fsm::Transition<State, TransferEvent, TransferAction>;

/// Which machine: the four of xFTSM (path mode has its own: xdfs/detail/path_fsm.hpp).
enum class Role : std::uint8_t { client_upload, client_download, server_upload, server_download };
const char* to_string(Role r) noexcept;

/// The table of a role.
std::span<const Transition> table(Role r) noexcept;

/// A running machine of a role. An event the table does not allow in the current state is
/// refused (fire returns nullopt, why() names role, event and state; the driver fails with
/// errc::state_violation).
class Machine : public fsm::Machine<State, TransferEvent, TransferAction> {
public:
  explicit Machine(Role role) noexcept : Machine(role, table(role)) {}
  /// A machine of `role` on other rows (a test's changed copy of the role's table: the engines
  /// do what the rows say, whatever they are).
  Machine(Role role, std::span<const Transition> rows) noexcept
      : fsm::Machine<State, TransferEvent, TransferAction>(rows, to_string(role)), role_(role) {}
  Role role() const noexcept { return role_; }

private:
  Role role_;
};

}  // namespace xdfs::xftsm
