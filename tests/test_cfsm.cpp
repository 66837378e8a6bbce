// Unit tests for the xFTSM communicating state machines (xftsm/include/xdfs/detail/xftsm_fsm.hpp):
// table properties, and client-vs-server simulations through in-memory message queues.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <queue>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "xdfs/detail/xftsm_fsm.hpp"

namespace {

using namespace xdfs::xftsm;

constexpr std::array<Role, 4> all_roles{Role::client_upload, Role::client_download, Role::server_upload,
                                        Role::server_download};

std::vector<State> all_states() {
  std::vector<State> v;
  for (int s = 0; s <= static_cast<int>(State::failed); ++s) v.push_back(static_cast<State>(s));
  return v;
}

std::vector<TransferEvent> all_events() {
  std::vector<TransferEvent> v;
  for (int e = 0; e <= static_cast<int>(TransferEvent::timeout); ++e) v.push_back(static_cast<TransferEvent>(e));
  return v;
}

const Transition* row(Role r, State s, TransferEvent e) {
  for (const auto& t : table(r))
    if (t.from == s && t.on == e) return &t;
  return nullptr;
}

/// Shortest event sequence from idle to each reachable state (BFS over the table).
std::map<State, std::vector<TransferEvent>> paths_from_idle(Role r) {
  std::map<State, std::vector<TransferEvent>> path;
  path[State::idle] = {};
  std::queue<State> q;
  q.push(State::idle);
  while (!q.empty()) {
    const State s = q.front();
    q.pop();
    for (const auto& t : table(r)) {
      if (t.from != s || path.count(t.to)) continue;
      auto p = path[s];
      p.push_back(t.on);
      path[t.to] = std::move(p);
      q.push(t.to);
    }
  }
  return path;
}

/// A fresh machine driven along `path`; every step must be accepted.
Machine replay(Role r, const std::vector<TransferEvent>& path) {
  Machine m(r);
  for (TransferEvent e : path) {
    auto a = m.fire(e);
    REQUIRE_MESSAGE(a.has_value(), m.why());
  }
  return m;
}

bool is_final(State s) { return s == State::done || s == State::failed; }

// ---------------------------------------------------------------------------------------------
// Simulation: two machines talking through two in-memory queues.

enum class Msg : std::uint8_t { Nego, Reply, Data, Ack, Eofr, Eoft, Exception };

struct Packet {
  Msg kind;
  std::uint64_t value = 0;  // channel index (Nego), block index (Data), blocks written (Ack)
};

struct Peer {
  Peer(Role r, bool is_client, bool is_sender, std::deque<Packet>& out_queue)
      : m(r), client(is_client), sender(is_sender), out(out_queue) {}

  Machine m;
  bool client;
  bool sender;
  std::deque<Packet>& out;
  std::vector<TransferAction> actions;

  // Handshake.
  std::uint32_t joined = 0;
  std::uint32_t replies = 0;
  // Sender.
  bool sending = false;
  std::uint64_t sent = 0;
  std::uint64_t acked = 0;
  bool eofr_sent = false;
  // Receiver.
  bool receiving = false;
  std::uint64_t received = 0;
  std::uint64_t written = 0;
  std::uint64_t pending_writes = 0;
  std::uint32_t eofrs = 0;
  bool committed = false;
  std::set<std::uint64_t> blocks_seen;

  TransferAction fire(TransferEvent e) {
    auto a = m.fire(e);
    REQUIRE_MESSAGE(a.has_value(), "refused: " << m.why());
    CHECK(m.why().empty());  // no refusal ever happened on this machine
    actions.push_back(*a);
    return *a;
  }
  void expect(TransferEvent e, TransferAction want) {
    const TransferAction got = fire(e);
    CHECK_MESSAGE(got == want, to_string(m.role()) << ": " << to_string(e) << " gave " << to_string(got)
                                                   << ", expected " << to_string(want));
  }
  /// Blocks this side has handled so far (sent or received), for failure injection.
  std::uint64_t blocks_handled() const { return sender ? sent : received; }
};

struct SimConfig {
  bool upload = true;
  std::uint32_t channels = 1;
  std::uint64_t blocks = 0;
  std::uint64_t window = 2;  // blocks
  /// When set, the server fails (local_error) once it has handled this many blocks.
  std::optional<std::uint64_t> server_fails_after;
};

struct SimResult {
  State client_state;
  State server_state;
  std::vector<TransferAction> client_actions;
  std::vector<TransferAction> server_actions;
  std::uint64_t delivered = 0;  // blocks the receiver wrote
  std::uint64_t steps = 0;
  State server_state_at_failure = State::idle;
};

class Simulation {
public:
  explicit Simulation(const SimConfig& c)
      : cfg_(c),
        client_(c.upload ? Role::client_upload : Role::client_download, true, c.upload, c2s_),
        server_(c.upload ? Role::server_upload : Role::server_download, false, !c.upload, s2c_) {}

  SimResult run() {
    // Client: the user starts; n channels connect and each sends its negotiation header.
    client_.expect(TransferEvent::start, TransferAction::connect_channels);
    CHECK(client_.m.state() == State::connecting);
    for (std::uint32_t i = 0; i < cfg_.channels; ++i) c2s_.push_back({Msg::Nego, i});
    client_.expect(TransferEvent::connected, TransferAction::none);
    CHECK(client_.m.state() == State::negotiating);

    SimResult res{};
    while (true) {
      REQUIRE(++res.steps < 100000);
      bool progress = false;
      if (!c2s_.empty()) {
        const Packet p = c2s_.front();
        c2s_.pop_front();
        on_server_packet(p);
        progress = true;
      }
      if (!s2c_.empty()) {
        const Packet p = s2c_.front();
        s2c_.pop_front();
        on_client_packet(p);
        progress = true;
      }
      progress |= local_step(server_, res);
      progress |= local_step(client_, res);
      if (!progress) break;
    }
    res.client_state = client_.m.state();
    res.server_state = server_.m.state();
    res.client_actions = client_.actions;
    res.server_actions = server_.actions;
    res.delivered = (cfg_.upload ? server_ : client_).written;
    return res;
  }

private:
  void on_server_packet(const Packet& p) {
    if (server_.m.finished()) return;  // channels are closed: nothing more is read
    switch (p.kind) {
      case Msg::Nego: {
        ++server_.joined;
        REQUIRE(server_.joined <= cfg_.channels);
        CHECK(p.value == server_.joined - 1);
        server_.expect(TransferEvent::channel_joined, server_.joined == 1 ? TransferAction::register_session : TransferAction::add_channel);
        CHECK(server_.m.state() == State::joining);
        if (server_.joined == cfg_.channels) {
          server_.expect(TransferEvent::all_joined, TransferAction::open_and_reply);
          CHECK(server_.m.state() == State::transferring);
          for (std::uint32_t i = 0; i < cfg_.channels; ++i) s2c_.push_back({Msg::Reply, i});
          start_side(server_);
        }
        return;
      }
      default:
        return on_common_packet(server_, p);
    }
  }

  void on_client_packet(const Packet& p) {
    if (client_.m.finished()) return;
    switch (p.kind) {
      case Msg::Reply:
        ++client_.replies;
        REQUIRE(client_.replies <= cfg_.channels);
        if (client_.replies == cfg_.channels) {
          client_.expect(TransferEvent::accepted, client_.sender ? TransferAction::start_sending : TransferAction::start_receiving);
          CHECK(client_.m.state() == State::transferring);
          start_side(client_);
        }
        return;
      default:
        return on_common_packet(client_, p);
    }
  }

  void start_side(Peer& peer) {
    if (peer.sender)
      peer.sending = true;
    else
      peer.receiving = true;
  }

  void on_common_packet(Peer& peer, const Packet& p) {
    switch (p.kind) {
      case Msg::Exception:
        peer.expect(TransferEvent::peer_exception, TransferAction::abort);
        CHECK(peer.m.state() == State::failed);
        return;
      case Msg::Data: {
        REQUIRE_FALSE(peer.sender);
        REQUIRE(peer.receiving);
        CHECK(p.value < cfg_.blocks);
        CHECK(peer.blocks_seen.insert(p.value).second);
        // The sender respects the window: never more than `window` unacknowledged blocks.
        CHECK(peer.received + 1 - peer.written <= cfg_.window);
        peer.expect(TransferEvent::block_received, TransferAction::queue_write);
        ++peer.received;
        ++peer.pending_writes;
        return;
      }
      case Msg::Eofr:
        REQUIRE_FALSE(peer.sender);
        REQUIRE(peer.receiving);
        ++peer.eofrs;
        REQUIRE(peer.eofrs <= cfg_.channels);
        maybe_complete(peer);
        return;
      case Msg::Ack: {
        REQUIRE(peer.sender);
        REQUIRE(p.value <= peer.sent);
        REQUIRE(p.value >= peer.acked);
        const State before = peer.m.state();
        peer.expect(TransferEvent::ack_received, before == State::transferring ? TransferAction::open_window : TransferAction::none);
        CHECK(peer.m.state() == before);
        peer.acked = p.value;
        return;
      }
      case Msg::Eoft:
        REQUIRE(peer.sender);
        CHECK(peer.m.state() == State::draining);
        peer.expect(TransferEvent::committed, TransferAction::finish);
        CHECK(peer.m.state() == State::done);
        return;
      case Msg::Nego:
      case Msg::Reply:
        FAIL("handshake message out of place");
        return;
    }
  }

  void maybe_complete(Peer& peer) {
    if (peer.committed || peer.m.finished()) return;
    if (peer.eofrs != cfg_.channels || peer.written != cfg_.blocks) return;
    CHECK(peer.received == cfg_.blocks);
    peer.expect(TransferEvent::all_received, TransferAction::commit);
    CHECK(peer.m.state() == State::draining);
    peer.out.push_back({Msg::Eoft, cfg_.blocks});
    peer.expect(TransferEvent::committed, TransferAction::finish);
    CHECK(peer.m.state() == State::done);
    peer.committed = true;
  }

  /// Things that happen on one side without a message: disk progress, sending, failures.
  bool local_step(Peer& peer, SimResult& res) {
    if (peer.m.finished()) return false;
    if (!peer.client && cfg_.server_fails_after && peer.blocks_handled() >= *cfg_.server_fails_after &&
        (peer.sending || peer.receiving)) {
      res.server_state_at_failure = peer.m.state();
      peer.expect(TransferEvent::local_error, TransferAction::abort);
      CHECK(peer.m.state() == State::failed);
      peer.out.push_back({Msg::Exception, 0});
      return true;
    }
    if (peer.sending) {
      if (peer.sent < cfg_.blocks && peer.sent - peer.acked < cfg_.window) {
        peer.expect(TransferEvent::block_ready, TransferAction::send_block);
        peer.out.push_back({Msg::Data, peer.sent});
        peer.expect(TransferEvent::block_sent, TransferAction::send_block);
        ++peer.sent;
        return true;
      }
      // EOFR once every block is acknowledged: until then the receiver may ask for one again.
      if (peer.sent == cfg_.blocks && peer.acked == cfg_.blocks && !peer.eofr_sent) {
        peer.expect(TransferEvent::all_sent, TransferAction::send_eofr);
        CHECK(peer.m.state() == State::draining);
        for (std::uint32_t i = 0; i < cfg_.channels; ++i) peer.out.push_back({Msg::Eofr, i});
        peer.eofr_sent = true;
        return true;
      }
      return false;
    }
    if (peer.receiving && peer.pending_writes > 0) {
      // The disk thread wrote one block: acknowledge the cumulative count.
      peer.expect(TransferEvent::block_written, TransferAction::send_ack);
      --peer.pending_writes;
      ++peer.written;
      peer.out.push_back({Msg::Ack, peer.written});
      peer.expect(TransferEvent::ack_sent, TransferAction::none);
      maybe_complete(peer);
      return true;
    }
    if (peer.receiving) {
      // A 0-block file completes on EOFRs alone; also catches EOFRs that arrived before the
      // last write.
      const bool was = peer.committed;
      maybe_complete(peer);
      return peer.committed != was;
    }
    return false;
  }

  SimConfig cfg_;
  std::deque<Packet> c2s_;
  std::deque<Packet> s2c_;
  Peer client_;
  Peer server_;
};

}  // namespace

TEST_SUITE("cfsm") {

TEST_CASE("every row of every table is reachable and does what it says") {
  for (Role r : all_roles) {
    CAPTURE(to_string(r));
    const auto paths = paths_from_idle(r);
    REQUIRE_FALSE(table(r).empty());
    for (const auto& t : table(r)) {
      CAPTURE(to_string(t.from));
      CAPTURE(to_string(t.on));
      auto it = paths.find(t.from);
      REQUIRE_MESSAGE(it != paths.end(), "row from unreachable state " << to_string(t.from));
      Machine m = replay(r, it->second);
      REQUIRE(m.state() == t.from);
      const Transition* found = m.find(t.on);
      REQUIRE(found != nullptr);
      CHECK(found->to == t.to);
      CHECK(found->action == t.action);
      CHECK(m.state() == t.from);  // find() does not move
      auto a = m.fire(t.on);
      REQUIRE_MESSAGE(a.has_value(), m.why());
      CHECK(*a == t.action);
      CHECK(m.state() == t.to);
      CHECK(m.role() == r);
      CHECK(m.finished() == is_final(t.to));
    }
  }
}

TEST_CASE("tables have no duplicate (state, event) pairs") {
  for (Role r : all_roles) {
    CAPTURE(to_string(r));
    std::set<std::pair<State, TransferEvent>> seen;
    for (const auto& t : table(r)) {
      CAPTURE(to_string(t.from));
      CAPTURE(to_string(t.on));
      CHECK(seen.insert({t.from, t.on}).second);
    }
  }
}

TEST_CASE("done and failed are final: no outgoing rows") {
  for (Role r : all_roles) {
    CAPTURE(to_string(r));
    for (const auto& t : table(r)) {
      CHECK(t.from != State::done);
      CHECK(t.from != State::failed);
    }
    // And both are reachable, so a machine can end either way.
    const auto paths = paths_from_idle(r);
    CHECK(paths.count(State::done) == 1);
    CHECK(paths.count(State::failed) == 1);
    // Only `committed` leads to done, only with finish; failed only with abort.
    for (const auto& t : table(r)) {
      if (t.to == State::done) {
        CHECK(t.on == TransferEvent::committed);
        CHECK(t.action == TransferAction::finish);
      }
      if (t.to == State::failed) CHECK(t.action == TransferAction::abort);
      if (t.action == TransferAction::abort) CHECK(t.to == State::failed);
    }
  }
}

TEST_CASE("events a state does not allow are refused without moving") {
  for (Role r : all_roles) {
    CAPTURE(to_string(r));
    const auto paths = paths_from_idle(r);
    for (const auto& [state, path] : paths) {
      for (TransferEvent e : all_events()) {
        if (row(r, state, e)) continue;
        CAPTURE(to_string(state));
        CAPTURE(to_string(e));
        Machine m = replay(r, path);
        REQUIRE(m.state() == state);
        CHECK(m.find(e) == nullptr);
        auto a = m.fire(e);
        CHECK_FALSE(a.has_value());
        CHECK(m.state() == state);
        const std::string why = m.why();
        CHECK(why.find(to_string(state)) != std::string::npos);
        CHECK(why.find(to_string(e)) != std::string::npos);
        // Still usable afterwards: a refused event changes nothing.
        if (!is_final(state)) {
          const Transition* any = nullptr;
          for (const auto& t : table(r))
            if (t.from == state) {
              any = &t;
              break;
            }
          REQUIRE(any != nullptr);
          auto b = m.fire(any->on);
          REQUIRE(b.has_value());
          CHECK(m.state() == any->to);
        }
      }
    }
  }
}

TEST_CASE("every live state fails on peer_exception, local_error, channel_lost and timeout") {
  const std::array<TransferEvent, 4> failures{TransferEvent::peer_exception, TransferEvent::local_error, TransferEvent::channel_lost,
                                      TransferEvent::timeout};
  for (Role r : all_roles) {
    CAPTURE(to_string(r));
    const auto paths = paths_from_idle(r);
    std::size_t live = 0;
    for (const auto& [state, path] : paths) {
      // idle is before the session exists (no channel, no file): the drivers fire `start` /
      // `channel_joined` first, so failures are only defined once the machine is live.
      if (is_final(state) || state == State::idle) continue;
      ++live;
      for (TransferEvent e : failures) {
        CAPTURE(to_string(state));
        CAPTURE(to_string(e));
        const Transition* t = row(r, state, e);
        REQUIRE(t != nullptr);
        CHECK(t->to == State::failed);
        CHECK(t->action == TransferAction::abort);
        Machine m = replay(r, path);
        auto a = m.fire(e);
        REQUIRE(a.has_value());
        CHECK(*a == TransferAction::abort);
        CHECK(m.state() == State::failed);
        CHECK(m.finished());
      }
    }
    const bool is_client = r == Role::client_upload || r == Role::client_download;
    // connecting+negotiating or joining, transferring, and draining
    CHECK(live == (is_client ? 3u : 2u) + 1u);
  }
}

TEST_CASE("names of states, events, actions and roles") {
  std::set<std::string> names;
  for (State s : all_states()) {
    const std::string n = to_string(s);
    CHECK(n != "?");
    CHECK(names.insert("s:" + n).second);
  }
  for (TransferEvent e : all_events()) {
    const std::string n = to_string(e);
    CHECK(n != "?");
    CHECK(names.insert("e:" + n).second);
  }
  for (int a = 0; a <= static_cast<int>(TransferAction::abort); ++a) {
    const std::string n = to_string(static_cast<TransferAction>(a));
    CHECK(n != "?");
    CHECK(names.insert("a:" + n).second);
  }
  for (Role r : all_roles) {
    const std::string n = to_string(r);
    CHECK(n != "?");
    CHECK(names.insert("r:" + n).second);
  }
  Machine m(Role::server_upload);
  CHECK(m.state() == State::idle);
  CHECK_FALSE(m.finished());
  CHECK(m.why().empty());
}

TEST_CASE("client and server machines complete a transfer together") {
  for (bool upload : {true, false}) {
    for (std::uint32_t n : {1u, 3u}) {
      for (std::uint64_t k : {0ull, 1ull, 5ull}) {
        CAPTURE(upload);
        CAPTURE(n);
        CAPTURE(k);
        SimConfig cfg;
        cfg.upload = upload;
        cfg.channels = n;
        cfg.blocks = k;
        cfg.window = 2;
        Simulation sim(cfg);
        const auto res = sim.run();
        CHECK(res.client_state == State::done);
        CHECK(res.server_state == State::done);
        CHECK(res.delivered == k);
        REQUIRE_FALSE(res.client_actions.empty());
        REQUIRE_FALSE(res.server_actions.empty());
        CHECK(res.client_actions.back() == TransferAction::finish);
        CHECK(res.server_actions.back() == TransferAction::finish);
        for (TransferAction a : res.client_actions) CHECK(a != TransferAction::abort);
        for (TransferAction a : res.server_actions) CHECK(a != TransferAction::abort);
      }
    }
  }
}

TEST_CASE("a server failure mid-transfer fails both machines") {
  for (bool upload : {true, false}) {
    for (std::uint32_t n : {1u, 3u}) {
      for (std::uint64_t after : {0ull, 2ull, 4ull}) {
        CAPTURE(upload);
        CAPTURE(n);
        CAPTURE(after);
        SimConfig cfg;
        cfg.upload = upload;
        cfg.channels = n;
        cfg.blocks = 5;
        cfg.window = 2;
        cfg.server_fails_after = after;
        Simulation sim(cfg);
        const auto res = sim.run();
        CHECK(res.server_state_at_failure == State::transferring);
        CHECK(res.client_state == State::failed);
        CHECK(res.server_state == State::failed);
        REQUIRE_FALSE(res.client_actions.empty());
        REQUIRE_FALSE(res.server_actions.empty());
        CHECK(res.client_actions.back() == TransferAction::abort);
        CHECK(res.server_actions.back() == TransferAction::abort);
        CHECK(res.delivered < 5);
      }
    }
  }
}

TEST_CASE("a failed or done machine refuses every further event") {
  for (Role r : all_roles) {
    CAPTURE(to_string(r));
    const auto paths = paths_from_idle(r);
    for (State fin : {State::done, State::failed}) {
      Machine m = replay(r, paths.at(fin));
      REQUIRE(m.finished());
      for (TransferEvent e : all_events()) {
        CHECK_FALSE(m.fire(e).has_value());
        CHECK(m.state() == fin);
      }
    }
  }
}

}  // TEST_SUITE("cfsm")

// The engines ask their tables: an event a table does not allow fails the session with the
// table's own words, end to end, on a real server and a real client.
#include <thread>

#include "support.hpp"

TEST_SUITE("cfsm") {

TEST_CASE("a real server's engine refuses an event its table does not allow (a confirming EOFR while it still sends)") {
  xt::TempDir root, local;
  xt::write_random_file(root / "f", 8 * 65536, 3);
  xt::XdfsdProcess d(root.path());
  auto h = xt::make_hello(xdfs::Mode::download, "f", 1);
  h.nego.window = 2 * 65536;  // the server sends two blocks, then waits for an acknowledgement
  xt::RawChannel c(d.port());
  REQUIRE(c.establish(h));
  auto reply = c.read_frame();
  REQUIRE(reply.has_value());
  REQUIRE(reply->first.event == xdfs::wire::ChannelEvent::nego_reply);
  // The right size, at the wrong time: only a receiver that has everything confirms (EOFR).
  xdfs::wire::FrameHeader eofr;
  eofr.event = xdfs::wire::ChannelEvent::eofr;
  eofr.offset = 8 * 65536;
  c.send_frame(eofr);
  auto ex = c.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->code == xdfs::errc::state_violation);
  CHECK(ex->message.find("server-download: event committed is not allowed in state transferring") !=
        std::string::npos);
  CHECK(d.wait_for_log("status=error: state machine violation"));
}

TEST_CASE("a real client's engine refuses an event its table does not allow (a server's early EOFR)") {
  xt::TempDir local;
  xt::RawServer srv;
  xt::write_random_file(local / "f", 4 << 20, 4);
  std::thread t([&] {
    auto c = srv.accept();
    if (!c) return;
    c->send_reply({0, 1 << 20, c->hello.nego.block_size});
    xdfs::wire::FrameHeader eofr;
    eofr.event = xdfs::wire::ChannelEvent::eofr;
    eofr.offset = c->hello.nego.file_size;
    c->send_frame(eofr);
    c->wait_closed();
  });
  auto r = xt::xduc({"-q", "--known-hosts", local / "kh", local / "f",
                     "xdfs://127.0.0.1:" + std::to_string(srv.port()) + "/f"},
                    60000);
  t.join();
  CHECK(r.status == 1);
  CHECK(r.err.find("state machine violation: client-upload: event committed is not allowed in state transferring") !=
        std::string::npos);
}

}  // TEST_SUITE("cfsm")
