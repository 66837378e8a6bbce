// Turns the state tables (the session's, xFTSM's and path mode's) into a Promela model of a
// client and a server exchanging frames over n FIFO channels each way, for spin to check: no
// deadlock (invalid end state), no unspecified reception (an assertion), every final state
// reachable (spin's unreached-code report). docs/model.md explains the model and spin's trail.
//
//   xdfs_model [--channels N] [--blocks B] [--operations K] [--faults F] [--drop TABLE:ROW] > xdfs.pml
//
// The tables are the engines' own (session_fsm::table, xftsm::table): every row becomes one
// alternative of its state's event loop. What a row's event means on the wire (which frame
// triggers it, or which local condition) and what its action sends is bound here, once per
// event and action; a row the model has no trigger for (block_sent, ack_sent: completions the
// model folds into the send itself) is listed in a comment. --drop removes a row, to show that
// the check then fails.
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "xdfs/detail/path_fsm.hpp"
#include "xdfs/detail/session_fsm.hpp"
#include "xdfs/detail/xftsm_fsm.hpp"

namespace {

namespace sf = xdfs::session_fsm;
namespace xf = xdfs::xftsm;
namespace pm = xdfs::pathm;

struct Params {
  int channels = 2;
  int blocks = 2;
  int operations = 2;
  int faults = 1;
  std::string drop_table;
  int drop_row = -1;
};

std::string out;
void emit(const std::string& s) { out += s + "\n"; }

// One alternative of a state's loop: for a received frame (msg set) or a local condition.
struct Alt {
  std::string msg;    // frame type that triggers it ("" for a local condition)
  std::string guard;  // Promela condition (local), or extra condition on the frame
  std::string body;   // statements, ending in a goto
  std::string note;   // the row, for the reader
  /// Fires as soon as its condition holds, before anything else is read: a count that
  /// completes (all n joined, every channel answered) is acted on in the same handler.
  bool eager = false;
};

// No frame waits on any channel this side reads: what a closed peer or a timer acts on only
// once everything that arrived before was read.
std::string drained(bool client, int channels) {
  std::string e;
  for (int i = 0; i < channels; ++i)
    e += std::string(i ? " && " : "") + "len(" + (client ? "s2c[" : "c2s[") + std::to_string(i) + "]) == 0";
  return "(" + e + ")";
}

// What each side's operation machines look like in the model: the prefix of their labels, the
// table, and which wire direction is "in" and "out" for that side.
struct Side {
  bool client;
  std::string in(int i) const { return (client ? "s2c[" : "c2s[") + std::to_string(i) + "]"; }
  std::string out_(int i) const { return (client ? "c2s[" : "s2c[") + std::to_string(i) + "]"; }
  std::string peer_gone() const { return client ? "server_gone" : "client_gone"; }
  std::string me_gone() const { return client ? "client_gone" : "server_gone"; }
};

std::string send_all(const Side& s, const Params& p, const std::string& msg, const std::string& val = "0") {
  std::string b;
  for (int i = 0; i < p.channels; ++i) b += "SEND(" + s.out_(i) + ", " + msg + ", " + val + ", " + s.peer_gone() + "); ";
  return b;
}

// A frame on whichever channel (the engines pick the least loaded one).
std::string send_any(const Side& s, const Params& p, const std::string& msg) {
  std::string b = "if ";
  for (int i = 0; i < p.channels; ++i) b += ":: SEND(" + s.out_(i) + ", " + msg + ", 0, " + s.peer_gone() + ") ";
  return b + "fi; ";
}

// The local failure every live state has: spent from a budget shared by both sides.
// Three ways to fail: the peer hears why (an exception on every channel), or the process dies
// (its sockets close with nothing said), or it hangs (silent, its sockets open: the peer's
// timers must notice).
std::string abort_body(const Side& s, const Params& p) {
  return "if :: " + send_all(s, p, "EXC") + ":: skip :: goto " + (s.client ? "end_client_hung" : "end_server_hung") +
         " fi; " + s.me_gone() + " = true; ";
}

bool dropped(const Params& p, const std::string& table, int row) { return p.drop_table == table && p.drop_row == row; }

// Writes one state's event loop: every alternative, then for every channel a receive whose
// frame no alternative takes is an unspecified reception.
// `open` names the per-channel flag array of channels no longer read in this state (the real
// engines stop reading a channel once its last frame of the operation came), or is empty.
void write_state(const Side& s, const Params& p, const std::string& label, const std::vector<Alt>& alts,
                 const std::vector<int>& readable, const std::string& closed_flags = "") {
  emit(label + ":");
  // A server with no session yet waiting for a client that never comes is at rest.
  if (label == "s_idle") emit("end_no_session:");
  bool any_eager = false;
  for (const auto& a : alts)
    if (a.eager) {
      if (!any_eager) emit("  if");
      any_eager = true;
      emit("  :: (" + a.guard + ") -> /* " + a.note + " */ " + a.body);
    }
  if (any_eager) emit("  :: else -> skip\n  fi;");
  emit("  do");
  for (const auto& a : alts) {
    if (!a.msg.empty() || a.eager) continue;
    emit("  :: (" + (a.guard.empty() ? std::string("true") : a.guard) + ") -> /* " + a.note + " */ " + a.body);
  }
  std::set<std::string> msgs;
  for (const auto& a : alts)
    if (!a.msg.empty()) msgs.insert(a.msg);
  for (int i : readable) {
    const std::string idx = std::to_string(i);
    const std::string cond = (closed_flags.empty() ? std::string() : "!" + closed_flags + "[" + idx + "] && ") + "len(" +
                             s.in(i) + ") > 0";
    emit("  :: atomic { " + cond + " -> " + s.in(i) + "?t,v; ch = " + idx + " };");
    emit("     if");
    for (const auto& a : alts) {
      if (a.msg.empty()) continue;
      emit("     :: t == " + a.msg + (a.guard.empty() ? "" : " && (" + a.guard + ")") + " -> /* " + a.note + " */ " +
           a.body);
    }
    emit("     :: else -> printf(\"unspecified reception in " + label + "\\n\"); assert(false)");
    emit("     fi");
  }
  emit("  od;");
}

std::string lbl(const std::string& prefix, const char* state) { return prefix + "_" + state; }

// A row's alternative starts with a marker that changes no state: spin lists it among the
// unreached statements if no run ever takes the row.
std::string marker(const std::string& table, int row) { return "printf(\"ROW " + table + ":" + std::to_string(row) + "\\n\"); "; }

// ---- the operation tables (xFTSM and path mode), from their transferring state on ----

// The model of one operation machine of `role` on side `s`. Entry is its `transferring` state;
// it leaves to `done_label` (ended on every channel) or `failed_label`.
void write_operation(const Side& s, const Params& p, xf::Role role, const std::string& prefix,
                     const std::string& done_label, const std::string& failed_label) {
  const auto rows = xf::table(role);
  const std::string tname = xf::to_string(role);
  const bool sender = role == xf::Role::client_upload || role == xf::Role::server_download;
  std::map<xf::State, std::vector<Alt>> by_state;
  std::vector<std::string> folded;
  int index = 0;
  for (const auto& r : rows) {
    const int row = index++;
    if (r.from == xf::State::idle || r.from == xf::State::connecting || r.from == xf::State::negotiating ||
        r.from == xf::State::joining)
      continue;  // the session's part: connecting, joining and negotiating are the session table's
    const std::string note = tname + " row " + std::to_string(row) + ": " + xf::to_string(r.from) + " --" +
                             xf::to_string(r.on) + "--> " + xf::to_string(r.to);
    if (dropped(p, tname, row)) continue;
    const std::string to = r.to == xf::State::done ? done_label : r.to == xf::State::failed ? failed_label
                                                                                             : lbl(prefix, xf::to_string(r.to));
    Alt a;
    a.note = note;
    std::string act;
    switch (r.action) {
      case xf::TransferAction::send_block: act = "sent++; " + send_any(s, p, "DATA"); break;
      case xf::TransferAction::queue_write: act = "got++; pend++; "; break;
      case xf::TransferAction::send_ack: act = "written = written + pend; pend = 0; SEND(" + s.out_(0) + ", ACK, written, " + s.peer_gone() + "); "; break;
      case xf::TransferAction::open_window: act = "acked = v; "; break;
      case xf::TransferAction::send_eofr: act = send_all(s, p, "EOFR"); break;
      // A block sent again: it was counted when first sent (and is outside the window).
      case xf::TransferAction::resend_block: act = send_any(s, p, "DATA"); break;
      case xf::TransferAction::send_nack: act = "SEND(" + s.out_(0) + ", NACK, 0, " + s.peer_gone() + "); "; break;
      case xf::TransferAction::commit: act = send_all(s, p, "EOFR"); break;
      case xf::TransferAction::abort: act = abort_body(s, p); break;
      default: break;  // none, finish
    }
    switch (r.on) {
      case xf::TransferEvent::block_ready:
        // The disk thread read a block ahead: it may go if the window allows (one block's room here).
        a.guard = "sent < B && sent - acked < W";
        break;
      case xf::TransferEvent::block_sent:
      case xf::TransferEvent::ack_sent:
        folded.push_back(note);
        continue;
      case xf::TransferEvent::ack_received:
        a.msg = "ACK";
        a.guard = "v <= sent";
        break;
      case xf::TransferEvent::all_sent:
        // EOFR once every block is acknowledged: until then the receiver may ask for one again.
        a.guard = "sent == B && acked == B && !eofr_sent";
        a.eager = true;
        act = "eofr_sent = true; " + act;
        break;
      case xf::TransferEvent::block_received:
        a.msg = "DATA";
        a.guard = "!eofr_in[ch]";
        break;
      case xf::TransferEvent::block_written:
        a.guard = "pend > 0";
        break;
      case xf::TransferEvent::block_rejected:
        // A received block fails its digest (once per operation here): not written, asked again.
        a.guard = "pend > 0 && !rejected";
        act = "pend--; got--; rejected = true; " + act;
        break;
      case xf::TransferEvent::nack_received:
        a.msg = "NACK";
        break;
      case xf::TransferEvent::all_received:
        // EOFR on every channel (counted as they come) and every block written.
        a.guard = "eofrs == N && got == B && written == B";
        a.eager = true;
        break;
      case xf::TransferEvent::committed:
        if (sender) {
          // The receiver's EOFR on every channel: the file is committed.
          a.msg = "EOFR";
          a.guard = "!eofr_in[ch]";
          act = "eofr_in[ch] = true; eofrs++; if :: eofrs < N -> goto " + lbl(prefix, xf::to_string(r.from)) + " :: else -> skip fi; " + act;
        } else {
          a.guard = "true";  // the receiver's EOFRs have left (SEND is atomic here)
          a.eager = true;
        }
        break;
      case xf::TransferEvent::peer_exception: a.msg = "EXC"; break;
      case xf::TransferEvent::local_error: a.guard = "faults > 0"; act = "faults--; injected = true; " + act; break;
      case xf::TransferEvent::channel_lost: a.guard = s.peer_gone() + " && " + drained(s.client, p.channels); break;
      case xf::TransferEvent::timeout: a.guard = "timeout"; break;  // nothing else can happen anywhere
      default: folded.push_back(note + " (no trigger in the model)"); continue;
    }
    a.body = marker(tname, row) + act + "goto " + to;
    by_state[r.from].push_back(a);
  }
  // What the engines do in a state beyond the table's rows: a receiver counts EOFRs (all_received
  // fires on the count).
  for (auto& [st, alts] : by_state)
    if (!sender && st == xf::State::transferring)
      alts.push_back(Alt{"EOFR", "!eofr_in[ch]", "eofr_in[ch] = true; eofrs++; goto " + lbl(prefix, "transferring"),
                         "receiver: the sender's EOFR on a channel (counted; not read again)"});
  for (const auto& f : folded) emit("  /* folded: " + f + " */");
  for (auto& [st, alts] : by_state) {
    std::vector<int> readable;
    for (int i = 0; i < p.channels; ++i) readable.push_back(i);
    write_state(s, p, lbl(prefix, xf::to_string(st)), alts, readable, "eofr_in");
  }
}

// ---- path mode's tables, from their serving state on ----

// The model of a path operation on side `s`, from its own table (pathm::table): entry is its
// `serving` state. The client asks up to R requests, each answered; it ends once every request
// has its answer; the server ends once every channel ended and every request is answered.
void write_path_operation(const Side& s, const Params& p, const std::string& prefix, const std::string& done_label,
                          const std::string& failed_label) {
  const auto side = s.client ? pm::PathSide::client : pm::PathSide::server;
  const std::string tname = pm::to_string(side);
  std::map<pm::PathState, std::vector<Alt>> by_state;
  std::vector<std::string> folded;
  int index = 0;
  // A channel's EOFR, counted: the rows for "not yet on all" and "on the last" split on the count.
  const std::string count = "eofr_in[ch] = true; eofrs++; ";
  for (const auto& r : pm::table(side)) {
    const int row = index++;
    // The start is the session's: its negotiation (client) or the mode's open (server, below).
    if (r.from == pm::PathState::idle) continue;
    const std::string note = tname + " row " + std::to_string(row) + ": " + pm::to_string(r.from) + " --" +
                             pm::to_string(r.on) + "--> " + pm::to_string(r.to);
    if (dropped(p, tname, row)) continue;
    const std::string to = r.to == pm::PathState::done     ? done_label
                           : r.to == pm::PathState::failed ? failed_label
                                                           : lbl(prefix, pm::to_string(r.to));
    Alt a;
    a.note = note;
    std::string act;
    switch (r.action) {
      case pm::PathAction::send_request: act = "asked++; " + send_any(s, p, "REQ"); break;
      case pm::PathAction::deliver_reply: act = "answered++; "; break;
      case pm::PathAction::execute: act = "asked++; "; break;  // a worker takes it
      case pm::PathAction::send_eofr: act = send_all(s, p, "EOFR"); break;
      case pm::PathAction::abort: act = abort_body(s, p); break;
      default: break;  // none, serve, finish
    }
    switch (r.on) {
      case pm::PathEvent::request:
        if (s.client) {
          a.guard = "asked < R";
        } else {
          a.msg = "REQ";
          a.guard = "!eofr_in[ch]";
        }
        break;
      case pm::PathEvent::reply:
        a.msg = "RSP";
        a.guard = "answered < asked";
        break;
      case pm::PathEvent::replied:
        // A worker's answer leaves (the client takes it on whichever channel).
        a.guard = "answered < asked";
        act = "answered++; " + send_any(s, p, "RSP") + act;
        break;
      case pm::PathEvent::end_asked: a.guard = "answered == asked"; break;
      case pm::PathEvent::channel_ended:
        a.msg = "EOFR";
        a.guard = "!eofr_in[ch] && eofrs + 1 < N";
        act = count + act;
        break;
      case pm::PathEvent::all_ended:
        a.msg = "EOFR";
        a.guard = "!eofr_in[ch] && eofrs + 1 == N";
        act = count + act;
        break;
      case pm::PathEvent::all_answered:
        a.guard = "answered == asked";
        a.eager = true;
        break;
      case pm::PathEvent::committed:
        if (s.client) {
          // The server's EOFR on the last channel.
          a.msg = "EOFR";
          a.guard = "!eofr_in[ch] && eofrs + 1 == N";
          act = count + act;
        } else {
          a.guard = "true";  // its EOFRs have left (SEND is atomic here)
          a.eager = true;
        }
        break;
      case pm::PathEvent::peer_exception: a.msg = "EXC"; break;
      case pm::PathEvent::local_error: a.guard = "faults > 0"; act = "faults--; injected = true; " + act; break;
      case pm::PathEvent::channel_lost: a.guard = s.peer_gone() + " && " + drained(s.client, p.channels); break;
      case pm::PathEvent::timeout: a.guard = "timeout"; break;
      default: folded.push_back(note + " (no trigger in the model)"); continue;
    }
    a.body = marker(tname, row) + act + "goto " + to;
    by_state[r.from].push_back(a);
  }
  for (const auto& f : folded) emit("  /* folded: " + f + " */");
  for (auto& [st, alts] : by_state) {
    std::vector<int> readable;
    for (int i = 0; i < p.channels; ++i) readable.push_back(i);
    write_state(s, p, lbl(prefix, pm::to_string(st)), alts, readable, "eofr_in");
  }
}

// The operation's entry: counters reset, then its machine's first state after the start.
std::string op_entry(const std::string& prefix, const char* state = "transferring") {
  return "sent = 0; acked = 0; got = 0; pend = 0; written = 0; eofrs = 0; eofr_sent = false; closing = false; "
         "rejected = false; "
         "asked = 0; answered = 0; k = 0; do :: k < N -> eofr_in[k] = false; k++ :: else -> break od; goto " +
         prefix + "_" + state;
}

// ---- the session tables ----

void write_client(const Params& p) {
  const Side s{true};
  const auto rows = sf::table(sf::Side::client);
  emit("proctype client() {");
  emit("  mtype t; byte v, ch, k, mode, ops, answers, refusals;");
  emit("  byte sent, acked, got, pend, written, eofrs, asked, answered; bool eofr_sent, closing, rejected;");
  emit("  bool eofr_in[N]; bool heard[N];");
  std::map<sf::State, std::vector<Alt>> by_state;
  int index = 0;
  for (const auto& r : rows) {
    const int row = index++;
    if (dropped(p, "session-client", row)) continue;
    const std::string note = std::string("session-client row ") + std::to_string(row) + ": " + sf::to_string(r.from) +
                             " --" + sf::to_string(r.on) + "--> " + sf::to_string(r.to);
    const std::string to = std::string("c_") + sf::to_string(r.to);
    Alt a;
    a.note = note;
    std::string act;
    switch (r.action) {
      case sf::SessionAction::connect_channels:
      case sf::SessionAction::send_negotiation:
        // Any mode, any order: the user's sequence of operations.
        act = "ops++; answers = 0; refusals = 0; k = 0; do :: k < N -> heard[k] = false; k++ :: else -> break od; "
              "if :: mode = UPLOAD :: mode = DOWNLOAD :: mode = PATH fi; " + send_all(s, p, "NEGO", "mode");
        break;
      case sf::SessionAction::start_operation:
        act = "if :: mode == UPLOAD -> " + op_entry("cu") + " :: mode == DOWNLOAD -> " + op_entry("cd") +
              " :: mode == PATH -> " + op_entry("cp", "serving") + " fi; ";
        break;
      case sf::SessionAction::finish: act = send_all(s, p, "EOFT"); break;
      case sf::SessionAction::abort: act = abort_body(s, p); break;
      default: break;
    }
    switch (r.on) {
      case sf::SessionEvent::begin: a.guard = "ops < K"; break;
      case sf::SessionEvent::end_asked: a.guard = "true"; break;
      case sf::SessionEvent::accepted: a.guard = "answers == N && refusals == 0"; a.eager = true; break;
      case sf::SessionEvent::refused: a.guard = "answers == N && refusals == N"; a.eager = true; break;
      case sf::SessionEvent::peer_exception: a.msg = "EXC"; break;
      case sf::SessionEvent::local_error: a.guard = "faults > 0"; act = "faults--; injected = true; " + act; break;
      case sf::SessionEvent::timeout: a.guard = "timeout"; break;  // no answer will come
      case sf::SessionEvent::operation_ended:
      case sf::SessionEvent::operation_failed:
        // Reported by the operation's machine: its done and failed states lead here.
        continue;
      default: continue;
    }
    a.body = marker("session-client", row) + act + (r.action == sf::SessionAction::start_operation ? "" : "goto " + to);
    by_state[r.from].push_back(a);
  }
  // Negotiating: one answer per channel (a reply, or a refusal), counted.
  by_state[sf::State::negotiating].push_back(
      Alt{"REPLY", "", "heard[ch] = true; answers++; goto c_negotiating", "an answer: the reply"});
  by_state[sf::State::negotiating].push_back(
      Alt{"REFUSED", "", "heard[ch] = true; answers++; refusals++; goto c_negotiating", "an answer: a refusal"});
  for (auto st : {sf::State::idle, sf::State::negotiating, sf::State::ready}) {
    std::vector<int> readable;
    if (st == sf::State::negotiating)
      for (int i = 0; i < p.channels; ++i) readable.push_back(i);
    write_state(s, p, std::string("c_") + sf::to_string(st), by_state[st], readable, "heard");
  }
  emit("c_operating: assert(false);  /* entered through an operation's machine only */");
  write_operation(s, p, xf::Role::client_upload, "cu", "c_op_ended", "c_op_failed");
  write_operation(s, p, xf::Role::client_download, "cd", "c_op_ended", "c_op_failed");
  write_path_operation(s, p, "cp", "c_op_ended", "c_op_failed");
  // The operation's end, as the session table says.
  bool ended = false, failed = false;
  index = 0;
  for (const auto& r : rows) {
    const int row = index++;
    if (dropped(p, "session-client", row)) continue;
    if (r.from == sf::State::operating && r.on == sf::SessionEvent::operation_ended) {
      emit("c_op_ended: " + marker("session-client", row) + "goto c_" + std::string(sf::to_string(r.to)) + ";");
      ended = true;
    }
    if (r.from == sf::State::operating && r.on == sf::SessionEvent::operation_failed) {
      emit("c_op_failed: " + marker("session-client", row) + "client_gone = true; goto c_" + std::string(sf::to_string(r.to)) + ";");
      failed = true;
    }
  }
  if (!ended) emit("c_op_ended: printf(\"no row ends an operation\\n\"); assert(false);");
  if (!failed) emit("c_op_failed: printf(\"no row fails an operation\\n\"); assert(false);");
  emit("c_done: client_gone = true; client_done = true; goto end_client;");
  emit("c_failed: assert(injected); client_gone = true; goto end_client;  /* only a fault may fail a session */");
  emit("end_client_hung: skip;");
  emit("end_client: skip");
  emit("}");
}

void write_server(const Params& p) {
  const Side s{false};
  const auto rows = sf::table(sf::Side::server);
  emit("proctype server() {");
  emit("  mtype t; byte v, ch, k, mode, joined, nexts, ends;");
  emit("  byte sent, acked, got, pend, written, eofrs, asked, answered; bool eofr_sent, closing, rejected;");
  emit("  bool eofr_in[N]; bool heard[N];");
  std::map<sf::State, std::vector<Alt>> by_state;
  int index = 0;
  // Operation start: the mode's own table decides (all_joined --> open_and_reply, or a refusal).
  const std::string start = "if :: mode == UPLOAD -> goto su_open :: mode == DOWNLOAD -> goto sd_open :: mode == PATH -> goto sp_open fi";
  for (const auto& r : rows) {
    const int row = index++;
    if (dropped(p, "session-server", row)) continue;
    const std::string note = std::string("session-server row ") + std::to_string(row) + ": " + sf::to_string(r.from) +
                             " --" + sf::to_string(r.on) + "--> " + sf::to_string(r.to);
    const std::string to = std::string("s_") + sf::to_string(r.to);
    Alt a;
    a.note = note;
    std::string act;
    switch (r.action) {
      case sf::SessionAction::abort: act = abort_body(s, p); break;
      case sf::SessionAction::await_next:
      case sf::SessionAction::refuse_operation:
        act = std::string(r.action == sf::SessionAction::refuse_operation ? send_all(s, p, "REFUSED") : "") +
              "nexts = 0; ends = 0; k = 0; do :: k < N -> heard[k] = false; k++ :: else -> break od; ";
        break;
      default: break;
    }
    switch (r.on) {
      case sf::SessionEvent::channel_joined:
        a.msg = "NEGO";
        act = "heard[ch] = true; joined++; mode = v; " + act;
        break;
      case sf::SessionEvent::all_joined: a.guard = "joined == N"; a.eager = true; act += start + "; "; break;
      case sf::SessionEvent::operation_asked: a.guard = "nexts == N"; a.eager = true; act += start + "; "; break;
      case sf::SessionEvent::end_asked: a.guard = "ends == N"; a.eager = true; break;
      case sf::SessionEvent::peer_left: a.guard = "client_gone && " + drained(false, p.channels); break;
      case sf::SessionEvent::peer_exception: a.msg = "EXC"; break;
      case sf::SessionEvent::local_error: a.guard = "faults > 0"; act = "faults--; injected = true; " + act; break;
      case sf::SessionEvent::timeout: a.guard = "timeout"; break;
      case sf::SessionEvent::operation_refused:
      case sf::SessionEvent::operation_ended:
      case sf::SessionEvent::operation_failed:
        // Reported by the operation: written below at the labels its machine leads to.
        {
          std::string l = r.on == sf::SessionEvent::operation_refused ? "s_op_refused" : r.on == sf::SessionEvent::operation_ended ? "s_op_ended" : "s_op_failed";
          emit("  /* " + note + " */");
          by_state[sf::State::operating].push_back(Alt{"", "false", "skip", "(via " + l + ")"});
          (void)l;
        }
        continue;
      default: continue;
    }
    a.body = marker("session-server", row) + act +
             (r.on == sf::SessionEvent::all_joined || r.on == sf::SessionEvent::operation_asked ? "" : "goto " + to);
    by_state[r.from].push_back(a);
  }
  // Ready: one frame per channel, the same on all: the next negotiation or EOFT.
  by_state[sf::State::ready].push_back(Alt{"NEGO", "(nexts == 0 || v == mode) && ends == 0",
                                          "heard[ch] = true; nexts++; mode = v; goto s_ready", "the next operation on a channel"});
  by_state[sf::State::ready].push_back(Alt{"EOFT", "nexts == 0", "heard[ch] = true; ends++; goto s_ready",
                                          "the end of the session on a channel"});
  for (auto st : {sf::State::idle, sf::State::joining, sf::State::ready}) {
    std::vector<int> readable;
    for (int i = 0; i < p.channels; ++i) readable.push_back(i);
    write_state(s, p, std::string("s_") + sf::to_string(st), by_state[st], readable, "heard");
  }
  // Each mode opens (the xFTSM/path tables' joining --all_joined--> row) or refuses.
  for (auto [prefix, role] : {std::pair{"su", xf::Role::server_upload}, std::pair{"sd", xf::Role::server_download}}) {
    const xf::Transition* open = nullptr;
    int row = 0, open_row = 0;
    for (const auto& r : xf::table(role)) {
      if (r.from == xf::State::joining && r.on == xf::TransferEvent::all_joined && !dropped(p, xf::to_string(role), row)) {
        open = &r;
        open_row = row;
      }
      ++row;
    }
    emit(std::string(prefix) + "_open:");
    if (!open) {
      emit("  printf(\"" + std::string(xf::to_string(role)) + ": nothing opens the operation\\n\"); assert(false);");
      continue;
    }
    // A file that is not there, a path outside the root...: refused before anything is sent.
    emit("  if :: " + marker(xf::to_string(role), open_row) + send_all(s, p, "REPLY") + op_entry(prefix) +
         " :: goto s_op_refused fi;");
  }
  write_operation(s, p, xf::Role::server_upload, "su", "s_op_ended", "s_op_failed");
  write_operation(s, p, xf::Role::server_download, "sd", "s_op_ended", "s_op_failed");
  // Path mode opens with its table's idle --accepted--> row (or refuses).
  {
    int row = 0, open_row = -1;
    for (const auto& r : pm::table(pm::PathSide::server)) {
      if (r.from == pm::PathState::idle && r.on == pm::PathEvent::accepted && !dropped(p, "server-path", row)) open_row = row;
      ++row;
    }
    emit("sp_open:");
    if (open_row < 0)
      emit("  printf(\"server-path: nothing opens the operation\\n\"); assert(false);");
    else
      emit("  if :: " + marker("server-path", open_row) + send_all(s, p, "REPLY") + op_entry("sp", "serving") +
           " :: goto s_op_refused fi;");
  }
  write_path_operation(s, p, "sp", "s_op_ended", "s_op_failed");
  bool refused = false, ended = false, failed = false;
  index = 0;
  for (const auto& r : rows) {
    const int row = index++;
    if (dropped(p, "session-server", row) || r.from != sf::State::operating) continue;
    const std::string to = std::string("s_") + sf::to_string(r.to);
    const std::string next = "nexts = 0; ends = 0; k = 0; do :: k < N -> heard[k] = false; k++ :: else -> break od; ";
    if (r.on == sf::SessionEvent::operation_refused) {
      emit("s_op_refused: " + marker("session-server", row) + send_all(s, p, "REFUSED") + next + "goto " + to + ";");
      refused = true;
    } else if (r.on == sf::SessionEvent::operation_ended) {
      emit("s_op_ended: " + marker("session-server", row) + next + "goto " + to + ";");
      ended = true;
    } else if (r.on == sf::SessionEvent::operation_failed) {
      emit("s_op_failed: " + marker("session-server", row) + "server_gone = true; goto " + to + ";");
      failed = true;
    }
  }
  if (!refused) emit("s_op_refused: printf(\"no row refuses an operation\\n\"); assert(false);");
  if (!ended) emit("s_op_ended: printf(\"no row ends an operation\\n\"); assert(false);");
  if (!failed) emit("s_op_failed: printf(\"no row fails an operation\\n\"); assert(false);");
  emit("s_operating: assert(false);");
  emit("s_done: server_gone = true; server_done = true; goto end_server;");
  emit("s_failed: assert(injected); server_gone = true; goto end_server;  /* only a fault may fail a session */");
  emit("end_server_hung: skip;");
  emit("end_server: skip");
  emit("}");
}

}  // namespace

int main(int argc, char** argv) {
  Params p;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "xdfs_model: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--channels") p.channels = std::atoi(next().c_str());
    else if (a == "--blocks") p.blocks = std::atoi(next().c_str());
    else if (a == "--operations") p.operations = std::atoi(next().c_str());
    else if (a == "--faults") p.faults = std::atoi(next().c_str());
    else if (a == "--drop") {
      const std::string v = next();
      const auto colon = v.rfind(':');
      if (colon == std::string::npos) {
        std::fprintf(stderr, "xdfs_model: --drop takes TABLE:ROW\n");
        return 2;
      }
      p.drop_table = v.substr(0, colon);
      p.drop_row = std::atoi(v.substr(colon + 1).c_str());
    } else {
      std::fprintf(stderr, "usage: xdfs_model [--channels N] [--blocks B] [--operations K] [--faults F] [--drop TABLE:ROW]\n");
      return 2;
    }
  }
  if (p.channels < 1 || p.channels > 4 || p.blocks < 0 || p.blocks > 8 || p.operations < 1 || p.operations > 4) {
    std::fprintf(stderr, "xdfs_model: channels 1..4, blocks 0..8, operations 1..4\n");
    return 2;
  }
  emit("/* Generated by xdfs_model from the xDFS state tables; do not edit. */");
  emit("#define N " + std::to_string(p.channels) + "   /* channels */");
  emit("#define B " + std::to_string(p.blocks) + "   /* blocks in a file */");
  emit("#define W 1   /* blocks the sender may have unacknowledged (the receiver's window) */");
  emit("#define K " + std::to_string(p.operations) + "   /* operations the client may run in one session */");
  emit("#define R 1   /* path requests per path operation */");
  emit("#define UPLOAD 0");
  emit("#define DOWNLOAD 1");
  emit("#define PATH 2");
  emit("mtype = { NEGO, REPLY, REFUSED, DATA, ACK, NACK, EOFR, EOFT, EXC, REQ, RSP };");
  emit("chan c2s[N] = [6] of { mtype, byte };  /* client to server, one FIFO per channel */");
  emit("chan s2c[N] = [6] of { mtype, byte };");
  emit("bool client_gone, server_gone;   /* a side closed its channels */");
  emit("bool client_done, server_done;   /* a side ended the session as asked */");
  emit("byte faults = " + std::to_string(p.faults) + ";                 /* local failures the model may inject, both sides together */");
  emit("bool injected;                   /* one was */");
  emit("/* A send to a peer that has gone is dropped (its socket would fail), never blocks. */");
  emit("#define SEND(c, m, x, gone) if :: c!m,x :: gone -> skip fi");
  write_client(p);
  write_server(p);
  emit("init { atomic { run client(); run server() } }");
  std::fputs(out.c_str(), stdout);
  return 0;
}
