// The relay's tables (relay/include/xdfs/detail/relay_fsm.hpp): every row reachable and doing
// what it says, no two rows for one (state, event), final states final, events a state does not
// allow refused without moving, every live state failing on the failure events, and a master and
// a host that end a place together.
#include <doctest/doctest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "xdfs/detail/relay_fsm.hpp"

namespace rf = xdfs::relay_fsm;
using rf::RelayAction;
using rf::RelayEvent;
using rf::RelayMachine;
using rf::RelaySide;
using rf::RelayState;

namespace {

constexpr RelaySide sides[] = {RelaySide::master, RelaySide::host, RelaySide::pull_master, RelaySide::pull_host};

std::vector<RelayEvent> all_events() {
  std::vector<RelayEvent> v;
  for (int e = 0; e <= static_cast<int>(RelayEvent::timeout); ++e) v.push_back(static_cast<RelayEvent>(e));
  return v;
}

bool is_final(RelayState s) { return s == RelayState::done || s == RelayState::failed; }

// The shortest event path from idle to each reachable state.
std::map<RelayState, std::vector<RelayEvent>> paths_from_idle(RelaySide side) {
  std::map<RelayState, std::vector<RelayEvent>> paths{{RelayState::idle, {}}};
  for (bool grew = true; grew;) {
    grew = false;
    for (const auto& t : rf::table(side))
      if (paths.count(t.from) && !paths.count(t.to)) {
        auto p = paths[t.from];
        p.push_back(t.on);
        paths[t.to] = p;
        grew = true;
      }
  }
  return paths;
}

RelayMachine replay(RelaySide side, const std::vector<RelayEvent>& path) {
  RelayMachine m(side);
  for (auto e : path) REQUIRE(m.fire(e).has_value());
  return m;
}

}  // namespace

TEST_SUITE("cfsm") {

TEST_CASE("relay tables: every row reachable, unique and doing what it says; finals are final") {
  for (auto side : sides) {
    CAPTURE(rf::to_string(side));
    const auto paths = paths_from_idle(side);
    std::set<std::pair<RelayState, RelayEvent>> seen;
    for (const auto& t : rf::table(side)) {
      CAPTURE(rf::to_string(t.from));
      CAPTURE(rf::to_string(t.on));
      CHECK(seen.insert({t.from, t.on}).second);
      CHECK_FALSE(is_final(t.from));
      REQUIRE(paths.count(t.from));
      auto m = replay(side, paths.at(t.from));
      auto a = m.fire(t.on);
      REQUIRE(a.has_value());
      CHECK(*a == t.action);
      CHECK(m.state() == t.to);
      CHECK(m.finished() == is_final(t.to));
      // Failing goes with abort (or a refusal before anything began, or the master's drop).
      if (t.to == RelayState::failed)
        CHECK((t.action == RelayAction::abort || t.action == RelayAction::refuse || t.action == RelayAction::tell_and_drop));
    }
    CHECK(paths.count(RelayState::done) == 1);
    CHECK(paths.count(RelayState::failed) == 1);
  }
}

TEST_CASE("relay tables: events a state does not allow are refused without moving, naming both") {
  for (auto side : sides) {
    for (const auto& [state, path] : paths_from_idle(side))
      for (auto e : all_events()) {
        RelayMachine m = replay(side, path);
        if (m.find(e)) continue;
        CAPTURE(rf::to_string(side));
        CAPTURE(rf::to_string(state));
        CAPTURE(rf::to_string(e));
        CHECK_FALSE(m.fire(e).has_value());
        CHECK(m.state() == state);
        CHECK(m.why().find(rf::to_string(e)) != std::string::npos);
        CHECK(m.why().find(rf::to_string(state)) != std::string::npos);
      }
  }
  // The ones that matter most: a host cannot end its place before the master releases it, and
  // a RELINK or a report cannot come before the place exists.
  RelayMachine master(RelaySide::master);
  REQUIRE(master.fire(RelayEvent::accepted));
  CHECK_FALSE(master.fire(RelayEvent::ended));
  RelayMachine host(RelaySide::host);
  CHECK_FALSE(host.fire(RelayEvent::relink));
  CHECK_FALSE(host.fire(RelayEvent::ended));
}

TEST_CASE("relay tables: every live state fails on peer_exception, local_error, channel_lost and timeout") {
  for (auto side : sides)
    for (const auto& [state, path] : paths_from_idle(side)) {
      if (is_final(state) || state == RelayState::idle) continue;
      for (auto e : {RelayEvent::peer_exception, RelayEvent::local_error, RelayEvent::channel_lost, RelayEvent::timeout}) {
        RelayMachine m = replay(side, path);
        auto a = m.fire(e);
        REQUIRE(a.has_value());
        CHECK(*a == RelayAction::abort);
        CHECK(m.state() == RelayState::failed);
      }
    }
}

TEST_CASE("relay tables: a master and a host end a place together") {
  RelayMachine master(RelaySide::master), host(RelaySide::host);
  CHECK(host.fire(RelayEvent::accepted) == RelayAction::start);
  CHECK(master.fire(RelayEvent::accepted) == RelayAction::start);
  for (int i = 0; i < 3; ++i) {
    CHECK(host.fire(RelayEvent::tick) == RelayAction::send_report);
    CHECK(master.fire(RelayEvent::report) == RelayAction::record);
  }
  CHECK(master.fire(RelayEvent::relink) == RelayAction::send_relink);
  CHECK(host.fire(RelayEvent::relink) == RelayAction::apply_relink);
  CHECK(master.fire(RelayEvent::release) == RelayAction::send_eofr);
  CHECK(master.state() == RelayState::releasing);
  CHECK(master.fire(RelayEvent::report) == RelayAction::record);  // the host's last report
  CHECK(host.fire(RelayEvent::ended) == RelayAction::release);
  CHECK(master.fire(RelayEvent::ended) == RelayAction::finish);
  CHECK(master.state() == RelayState::done);
  CHECK(host.state() == RelayState::done);
  // Dropping a host: the master's side ends there, whatever the host says next.
  RelayMachine dropped(RelaySide::master);
  REQUIRE(dropped.fire(RelayEvent::accepted));
  CHECK(dropped.fire(RelayEvent::give_up) == RelayAction::tell_and_drop);
  CHECK(dropped.finished());
  CHECK_FALSE(dropped.fire(RelayEvent::report));
}

TEST_CASE("pull tables: the master lets a host go with EOFR, answered by the host's; nothing ends it early") {
  RelayMachine master(RelaySide::pull_master), host(RelaySide::pull_host);
  CHECK(master.fire(RelayEvent::accepted) == RelayAction::watch);
  CHECK(host.fire(RelayEvent::accepted) == RelayAction::none);
  CHECK_FALSE(master.fire(RelayEvent::ended));  // a host's EOFR before its release is no ending
  RelayMachine early(RelaySide::pull_master);
  REQUIRE(early.fire(RelayEvent::accepted));
  CHECK(early.fire(RelayEvent::release) == RelayAction::send_eofr);
  CHECK(host.fire(RelayEvent::ended) == RelayAction::send_eofr_back);
  CHECK(early.fire(RelayEvent::ended) == RelayAction::finish);
  CHECK(early.state() == RelayState::done);
  CHECK(host.state() == RelayState::done);
  // An empty file: released at once, no chain.
  RelayMachine empty(RelaySide::pull_master);
  CHECK(empty.fire(RelayEvent::release) == RelayAction::send_eofr);
  // Put out by the chain: the host hears why, and the operation is over.
  RelayMachine out(RelaySide::pull_master);
  REQUIRE(out.fire(RelayEvent::accepted));
  CHECK(out.fire(RelayEvent::give_up) == RelayAction::tell_and_drop);
  CHECK(out.finished());
}

TEST_CASE("relay tables: names") {
  std::set<std::string> names;
  for (int s = 0; s <= static_cast<int>(RelayState::failed); ++s)
    CHECK(names.insert(std::string("s:") + rf::to_string(static_cast<RelayState>(s))).second);
  for (auto e : all_events()) CHECK(names.insert(std::string("e:") + rf::to_string(e)).second);
  for (int a = 0; a <= static_cast<int>(RelayAction::send_eofr_back); ++a)
    CHECK(names.insert(std::string("a:") + rf::to_string(static_cast<RelayAction>(a))).second);
  for (const auto& n : names) CHECK(n.find('?') == std::string::npos);
  CHECK(std::string(rf::to_string(RelaySide::master)) == "relay-master");
  for (auto side : sides) CHECK(std::string(rf::to_string(side)).find('?') == std::string::npos);
}

}  // TEST_SUITE("cfsm")
