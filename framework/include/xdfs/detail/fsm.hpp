// The one engine behind every state table of xDFS (the session's, xFTSM's, path mode's): rows
// (state, event) -> (state, action), and a machine that moves on an event only where a row
// allows it and hands back that row's action for the driver to run. The tables are data; the
// model checker's generator reads the same rows.
#pragma once

#include <optional>
#include <span>
#include <string>

namespace xdfs::fsm {

template <class State, class Event, class Action>
struct Transition {
  State from;
  Event on;
  State to;
  Action action;
};

/// A running machine: its table and its current state. State has `idle` (where it starts),
/// `done` and `failed` (its final states); to_string(State) and to_string(Event) are found by
/// argument-dependent lookup.
template <class State, class Event, class Action>
class Machine {
public:
  using Row = Transition<State, Event, Action>;

  /// name: how why() names the machine ("session-server", "client-upload", ...); it must outlive
  /// the machine (a string literal).
  Machine(std::span<const Row> table, const char* name) noexcept : table_(table), name_(name) {}

  State state() const noexcept { return state_; }
  bool finished() const noexcept { return state_ == State::done || state_ == State::failed; }

  /// The row for e in the current state, if the table has one (does not move).
  const Row* find(Event e) const noexcept {
    for (const auto& t : table_)
      if (t.from == state_ && t.on == e) return &t;
    return nullptr;
  }

  /// Moves on e and returns the row's action; without a row, nullopt (state unchanged) and why()
  /// names the machine, the event and the state.
  std::optional<Action> fire(Event e) noexcept {
    const Row* t = find(e);
    if (!t) {
      why_ = std::string(name_) + ": event " + to_string(e) + " is not allowed in state " + to_string(state_);
      return std::nullopt;
    }
    state_ = t->to;
    return t->action;
  }

  const std::string& why() const noexcept { return why_; }

private:
  std::span<const Row> table_;
  const char* name_;
  State state_ = State::idle;
  std::string why_;
};

}  // namespace xdfs::fsm
