// Relay places against hostile ticket holders, in process (the chains themselves run on the
// namespace test bed: tests/relay/chain.py).
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>

#include "support.hpp"
#include "xdfs/relay.hpp"
#include "xdfs/xdfs.hpp"

namespace w = xdfs::wire;

namespace {

xdfs::ServerConfig relay_config(const xt::TempDir& root) {
  xdfs::ServerConfig c;
  c.root = root.path();
  c.idle_timeout = std::chrono::milliseconds(20000);
  return c;
}

// The master's side: registers a place for `path` (size bytes) and returns its ticket; the
// session stays open (the place lasts as long as it).
std::array<std::uint8_t, 32> register_place(xdfs::Session& master, const std::string& path, std::uint64_t size) {
  w::Negotiation n;
  n.mode = xdfs::Mode::relay;
  n.remote_path = path;
  n.file_size = size;
  n.source_mtime_ns = 1234;
  xdfs::xsec::random_fill(n.relay_plan.ticket);
  (void)master.begin(n);
  return n.relay_plan.ticket;
}

}  // namespace

TEST_SUITE("badinput") {

TEST_CASE("relay: a ticket holder writes the place's file and nothing else, with a key the server does not know") {
  xt::TempDir root, local;
  xt::InProcessServer srv(relay_config(root));
  const std::uint64_t size = 3 * 65536 + 17;
  xt::write_random_file(local / "src", size, 7);
  xt::write_file(root / "victim", "the master's other file");
  xdfs::SessionOptions so;
  so.block_size = 65536;
  so.protect = xdfs::xsec::Protect::clear;
  xdfs::Session master({"127.0.0.1", srv.port()}, so);
  const auto ticket = register_place(master, "placed", size);

  // A stranger's key, holding the ticket (as an upstream xdfsd would).
  const auto stranger = xdfs::xsec::KeyPair::generate();
  xdfs::TransferOptions opt;
  opt.block_size = so.block_size;
  opt.protect = so.protect;
  opt.identity_secret = stranger.secret;
  opt.relay_ticket.assign(ticket.begin(), ticket.end());
  opt.relay_size = size;
  opt.relay_mtime_ns = 1234;

  SUBCASE("without a ticket the stranger is refused") {
    auto plain = opt;
    plain.relay_ticket.clear();
    CHECK(xt::error_of([&] { (void)xdfs::upload(local / "src", {"127.0.0.1", srv.port()}, "x", plain); }) ==
          xdfs::errc::auth_failed);
  }
  SUBCASE("a wrong ticket is refused") {
    auto wrong = opt;
    wrong.relay_ticket.assign(32, 0x5a);
    CHECK(xt::error_of([&] { (void)xdfs::upload(local / "src", {"127.0.0.1", srv.port()}, "x", wrong); }) ==
          xdfs::errc::auth_failed);
  }
  SUBCASE("the upload lands under the place's name, whatever name it asked for") {
    // The file is whole already: its size and mtime are the place's (the source's own differ).
    std::atomic<std::uint64_t> all{size};
    opt.available = &all;
    auto r = xdfs::upload(local / "src", {"127.0.0.1", srv.port()}, "../../etc/elsewhere", opt);
    CHECK(r.bytes == size);
    CHECK(xt::files_equal(local / "src", root / "placed"));
    CHECK_FALSE(xt::exists(root / "elsewhere"));
  }
  SUBCASE("the session it opened carries nothing after that upload") {
    std::atomic<std::uint64_t> all{size};
    opt.available = &all;
    xdfs::Session s({"127.0.0.1", srv.port()}, opt);
    (void)xdfs::upload(s, local / "src", "placed", opt);
    auto later = opt;
    later.relay_ticket.clear();
    later.available = nullptr;
    std::string what;
    CHECK(xt::error_of([&] { (void)xdfs::download(s, "victim", local / "got", later); }, nullptr, &what) ==
          xdfs::errc::permission_denied);
    CHECK(what.find("nothing else") != std::string::npos);
    CHECK(xt::error_of([&] { (void)xdfs::upload(s, local / "src", "victim", later); }) == xdfs::errc::permission_denied);
    CHECK(xt::read_file(root / "victim") == "the master's other file");
    CHECK_FALSE(xt::exists(local / "got"));
    s.close();
  }
  master.close();
}

TEST_CASE("relay: a plan naming a hop that is not a relay peer, at that address, is refused with its cause") {
  xt::TempDir root, state;
  auto cfg = relay_config(root);
  const auto peer = xdfs::xsec::KeyPair::generate();
  cfg.relay_peers = state / "relay_peers";
  xt::write_file(cfg.relay_peers, xdfs::xsec::format_public(peer.public_key) + " 10.1.2.3:7721\n");
  xt::InProcessServer srv(cfg);
  xdfs::SessionOptions so;
  so.protect = xdfs::xsec::Protect::clear;
  for (const std::string& address : {std::string("10.9.9.9:7721"), std::string("10.1.2.3:7721")}) {
    CAPTURE(address);
    xdfs::Session master({"127.0.0.1", srv.port()}, so);
    w::Negotiation n;
    n.mode = xdfs::Mode::relay;
    n.remote_path = "f";
    n.file_size = 10;
    xdfs::xsec::random_fill(n.relay_plan.ticket);
    w::RelayHop hop;
    hop.address = address;
    hop.server_key = address == "10.1.2.3:7721" ? xdfs::xsec::KeyPair::generate().public_key : peer.public_key;
    n.relay_plan.next.push_back(hop);
    std::string what;
    CHECK(xt::error_of([&] { (void)master.begin(n); }, nullptr, &what) == xdfs::errc::permission_denied);
    CHECK(what.find("relay peers") != std::string::npos);
    master.close();
  }
}

TEST_CASE("relay: xduc's bad chain arguments exit 2 with one line naming the cause") {
  xt::TempDir dir;
  xt::write_random_file(dir / "f", 10, 1);
  xt::write_file(dir / "hosts", "xdfs://127.0.0.1:1/in/\nnot-a-url\n");
  xt::write_file(dir / "empty", "# nobody\n");
  const std::string a = "xdfs://127.0.0.1:1/in/", b = "xdfs://127.0.0.1:2/in/";
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  for (const auto& c : std::vector<Case>{
           {{dir.path(), a, b}, "is a directory (-r copies trees)"},
           {{dir / "f", "/dev/null", a, b}, "not a regular file or a directory"},
           {{dir / "f", dir / "missing", a, b}, "No such file"},
           {{"xdfs://127.0.0.1:3/x", a, b}, "both remote"},
           {{"--chains", "0", dir / "f", a, b}, "--chains takes"},
           {{"--chain-min", "0", dir / "f", a, b}, "--chain-min takes"},
           {{"-r", "--sync", dir.path(), a, b}, "--sync does not go with several hosts"},
           {{"-", a, b}, "not standard input"},
           {{"--hosts", dir / "nope", dir / "f"}, "--hosts"},
           {{"--hosts", dir / "hosts", dir / "f"}, "not-a-url"},
           {{"--hosts", dir / "empty", dir / "f"}, "names no host"},
       }) {
    CAPTURE(c.says);
    auto r = xt::xduc(c.args);
    CHECK(r.status == 2);
    CHECK(r.err.find(c.says) != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
}

TEST_CASE("relay: a malformed relay peers line is refused, naming the file and the line") {
  xt::TempDir root, state;
  auto cfg = relay_config(root);
  cfg.relay_peers = state / "relay_peers";
  const auto peer = xdfs::xsec::KeyPair::generate();
  // A key without an address: the server could not know where it may connect.
  xt::write_file(cfg.relay_peers, "# peers\n" + xdfs::xsec::format_public(peer.public_key) + "\n");
  xt::InProcessServer srv(cfg);
  xdfs::SessionOptions so;
  so.protect = xdfs::xsec::Protect::clear;
  xdfs::Session master({"127.0.0.1", srv.port()}, so);
  w::Negotiation n;
  n.mode = xdfs::Mode::relay;
  n.remote_path = "f";
  n.file_size = 10;
  xdfs::xsec::random_fill(n.relay_plan.ticket);
  w::RelayHop hop;
  hop.address = "10.1.2.3:7721";
  hop.server_key = peer.public_key;
  n.relay_plan.next.push_back(hop);
  std::string what;
  CHECK(xt::error_of([&] { (void)master.begin(n); }, nullptr, &what) == xdfs::errc::permission_denied);
  CHECK(what.find(cfg.relay_peers + ":2") != std::string::npos);
  CHECK(what.find("HOST:PORT") != std::string::npos);
  master.close();
}

}  // TEST_SUITE("badinput")
