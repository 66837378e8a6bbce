// xSec: identities, Noise XX, joins, frame protection, and what a man in the middle can and
// cannot do in each protection mode.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include <botan/aead.h>
#include <botan/mac.h>

#include "support.hpp"
#include "xdfs/xdfs.hpp"
#include "xdfs/pathm/messages.hpp"
#include "xdfs/xsec.hpp"

namespace xs = xdfs::xsec;
namespace w = xdfs::wire;
using xdfs::errc;

namespace {


struct Noise {
  xs::KeyPair client = xs::KeyPair::generate();
  xs::KeyPair server = xs::KeyPair::generate();
};


}  // namespace

TEST_SUITE("xsec") {

TEST_CASE("Noise XX: both sides agree on keys and learn each other's identity") {
  Noise k;
  std::vector<std::uint8_t> prologue{1, 2, 3};
  xs::NoiseXX i(true, k.client, prologue), r(false, k.server, prologue);
  REQUIRE(r.read_message_1(i.write_message_1()));
  auto m2 = r.write_message_2();
  REQUIRE(i.read_message_2(m2));
  CHECK(i.remote_static() == k.server.public_key);
  REQUIRE(r.read_message_3(i.write_message_3()));
  CHECK(r.remote_static() == k.client.public_key);
  auto a = i.split(), b = r.split();
  CHECK(a.send == b.recv);
  CHECK(a.recv == b.send);
  CHECK(a.send != a.recv);
  CHECK(a.session_secret == b.session_secret);
  // Fresh ephemerals: a second handshake between the same identities yields other keys.
  xs::NoiseXX i2(true, k.client, prologue), r2(false, k.server, prologue);
  REQUIRE(r2.read_message_1(i2.write_message_1()));
  REQUIRE(i2.read_message_2(r2.write_message_2()));
  REQUIRE(r2.read_message_3(i2.write_message_3()));
  CHECK(i2.split().send != a.send);
}

TEST_CASE("Noise XX: a changed prologue (negotiation header) or a modified message fails") {
  Noise k;
  std::vector<std::uint8_t> sent{'p', 'r', 'i', 'v'}, seen{'c', 'l', 'e', 'a'};
  xs::NoiseXX i(true, k.client, sent), r(false, k.server, seen);
  REQUIRE(r.read_message_1(i.write_message_1()));
  CHECK_FALSE(i.read_message_2(r.write_message_2()));

  for (std::size_t at : {0u, 40u, 80u, 95u}) {
    CAPTURE(at);
    xs::NoiseXX i2(true, k.client, sent), r2(false, k.server, sent);
    REQUIRE(r2.read_message_1(i2.write_message_1()));
    auto m2 = r2.write_message_2();
    m2[at] ^= 1;
    CHECK_FALSE(i2.read_message_2(m2));
  }
  xs::NoiseXX i3(true, k.client, sent), r3(false, k.server, sent);
  REQUIRE(r3.read_message_1(i3.write_message_1()));
  REQUIRE(i3.read_message_2(r3.write_message_2()));
  auto m3 = i3.write_message_3();
  m3[10] ^= 4;
  CHECK_FALSE(r3.read_message_3(m3));
  CHECK_FALSE(r3.read_message_3(std::vector<std::uint8_t>(5)));
  // A low-order point as ephemeral key is refused.
  xs::NoiseXX r4(false, k.server, sent);
  REQUIRE(r4.read_message_1(std::vector<std::uint8_t>(32, 0)));
  CHECK(r4.write_message_2().empty());
}

TEST_CASE("joins: keys depend on the secret and both nonces; a recorded join proof does not replay") {
  xs::Key32 secret{}, other{};
  secret[0] = 1;
  other[0] = 2;
  std::vector<std::uint8_t> cn(32, 3), sn(32, 4), sn2(32, 5), opening{9, 9};
  auto k = xs::derive_join_keys(secret, cn, sn, opening);
  auto same = xs::derive_join_keys(secret, cn, sn, opening);
  CHECK(k.client_to_server == same.client_to_server);
  CHECK(k.client_to_server != k.server_to_client);
  auto proof = xs::join_proof(k, "client", cn, sn);
  // The server picks a fresh nonce each time: yesterday's proof fails today.
  auto fresh = xs::derive_join_keys(secret, cn, sn2, opening);
  CHECK_FALSE(xs::equal_constant_time(proof, xs::join_proof(fresh, "client", cn, sn2)));
  // Another session's secret gives other keys and proofs.
  auto wrong = xs::derive_join_keys(other, cn, sn, opening);
  CHECK_FALSE(xs::equal_constant_time(proof, xs::join_proof(wrong, "client", cn, sn)));
  // So does another negotiation header.
  auto changed = xs::derive_join_keys(secret, cn, sn, std::vector<std::uint8_t>{9, 8});
  CHECK(changed.client_to_server != k.client_to_server);
  // Client and server proofs differ: a reflected proof is useless.
  CHECK_FALSE(xs::equal_constant_time(proof, xs::join_proof(k, "server", cn, sn)));
}

TEST_CASE("frame protection: each mode detects what it claims") {
  xs::Key32 a{}, b{};
  a[0] = 1;
  b[0] = 2;
  for (auto mode : {xs::Protect::clear, xs::Protect::integrity, xs::Protect::private_}) {
    for (auto cipher : {xs::Cipher::aes256gcm, xs::Cipher::chacha20poly1305}) {
      CAPTURE(xs::to_string(mode));
      CAPTURE(xs::to_string(cipher));
      xs::FrameProtector tx(mode, cipher, a, b), rx(mode, cipher, b, a);
      auto make = [](w::ChannelEvent e, std::size_t len, std::uint64_t off) {
        w::FrameHeader h;
        h.event = e;
        h.length = static_cast<std::uint32_t>(len);
        h.offset = off;
        return std::make_pair(w::encode(h), xt::random_bytes(len, off + 1));
      };
      struct Sealed {
        w::HeaderBytes h;
        std::vector<std::uint8_t> body;
        std::array<std::uint8_t, 16> tag;
      };
      auto seal = [&](w::ChannelEvent e, std::size_t len, std::uint64_t off) {
        auto [h, body] = make(e, len, off);
        Sealed s{h, body, {}};
        tx.seal(s.h, s.body, s.tag.data());
        return s;
      };
      const bool data_protected = mode != xs::Protect::clear;
      auto d0 = seal(w::ChannelEvent::xftsmd, 1000, 0);
      auto d1 = seal(w::ChannelEvent::xftsmd, 1000, 1000);
      auto c2 = seal(w::ChannelEvent::eofr, 0, 2000);
      auto plain = make(w::ChannelEvent::xftsmd, 1000, 0).second;
      // A data frame's payload is sealed by BlockCrypto on the disk thread (see below); the
      // channel covers the header and the payload's trailing block tag.
      CHECK(d0.body == plain);

      // In order and untouched: every frame opens and decrypts.
      {
        xs::FrameProtector r(mode, cipher, b, a);
        auto x0 = d0, x1 = d1, x2 = c2;
        CHECK(r.open(x0.h, x0.body, x0.tag.data()));
        CHECK(x0.body == plain);
        CHECK(r.open(x1.h, x1.body, x1.tag.data()));
        CHECK(r.open(x2.h, x2.body, x2.tag.data()));
      }
      // A flipped bit in the block tag a data frame carries at its end.
      {
        xs::FrameProtector r(mode, cipher, b, a);
        auto x0 = d0;
        x0.body[995] ^= 1;
        CHECK(r.open(x0.h, x0.body, x0.tag.data()) == !data_protected);
      }
      // A flipped bit in a control frame's header: caught in every mode.
      {
        xs::FrameProtector r(mode, cipher, b, a);
        auto x0 = d0, x1 = d1, x2 = c2;
        REQUIRE(r.open(x0.h, x0.body, x0.tag.data()));
        REQUIRE(r.open(x1.h, x1.body, x1.tag.data()));
        x2.h[9] ^= 1;
        CHECK_FALSE(r.open(x2.h, x2.body, x2.tag.data()));
      }
      // Replay, reorder, drop: the counters catch them where frames carry tags; in clear mode the
      // next control frame still notices that the count is off.
      {
        xs::FrameProtector r(mode, cipher, b, a);
        auto x0 = d0, again = d0;
        REQUIRE(r.open(x0.h, x0.body, x0.tag.data()));
        CHECK(r.open(again.h, again.body, again.tag.data()) == !data_protected);
      }
      {
        xs::FrameProtector r(mode, cipher, b, a);
        auto x1 = d1;
        CHECK(r.open(x1.h, x1.body, x1.tag.data()) == !data_protected);  // d1 before d0
      }
      {
        xs::FrameProtector r(mode, cipher, b, a);
        auto x0 = d0, x2 = c2;  // d1 dropped
        REQUIRE(r.open(x0.h, x0.body, x0.tag.data()));
        CHECK_FALSE(r.open(x2.h, x2.body, x2.tag.data()));
      }
    }
  }
}

TEST_CASE("block payloads: sealed on the disk thread, bound to their offset") {
  const auto key = xs::data_key(xs::Key32{}, true, 0);
  CHECK(key != xs::data_key(xs::Key32{}, false, 0));  // one key per direction
  CHECK(key != xs::data_key(xs::Key32{}, true, 1));   // and per transfer
  for (auto mode : {xs::Protect::integrity, xs::Protect::private_}) {
    for (auto cipher : {xs::Cipher::aes256gcm, xs::Cipher::chacha20poly1305}) {
      CAPTURE(xs::to_string(mode));
      CAPTURE(xs::to_string(cipher));
      xs::BlockCrypto tx(mode, cipher, key), rx(mode, cipher, key);
      const auto plain = xt::random_bytes(5000, 3);
      std::vector<std::uint8_t> slot(plain);
      slot.resize(plain.size() + 16);
      tx.seal(slot.data(), xdfs::DataLength(5000), xdfs::FileOffset(65536));
      CHECK((std::equal(plain.begin(), plain.end(), slot.begin())) == (mode == xs::Protect::integrity));
      auto ok = slot;
      REQUIRE(rx.open(ok.data(), xdfs::DataLength(5000), xdfs::FileOffset(65536)));
      CHECK(std::equal(plain.begin(), plain.end(), ok.begin()));
      auto flipped = slot;
      flipped[1234] ^= 8;
      CHECK_FALSE(rx.open(flipped.data(), xdfs::DataLength(5000), xdfs::FileOffset(65536)));
      auto moved = slot;  // the same block presented at another offset
      CHECK_FALSE(rx.open(moved.data(), xdfs::DataLength(5000), xdfs::FileOffset(0)));
      auto shorter = slot;
      CHECK_FALSE(rx.open(shorter.data(), xdfs::DataLength(4999), xdfs::FileOffset(65536)));
      xs::BlockCrypto other(mode, cipher, xs::data_key(xs::Key32{}, false, 0));
      auto wrong_key = slot;
      CHECK_FALSE(other.open(wrong_key.data(), xdfs::DataLength(5000), xdfs::FileOffset(65536)));
    }
  }
}

TEST_CASE("a sealed block is its cipher's AEAD (private) or GMAC (integrity) over the documented nonce and associated data, byte for byte as Botan makes it") {
  // The wire format of a sealed block, whatever library seals it here: nonce "blk\0" then the
  // offset (8 bytes, little-endian); associated data the offset (8) and the length (4, both
  // little-endian); the tag after the data. Integrity's tag is GMAC(AES-256) over the associated
  // data then the block. A peer built on either library reads the other's.
  const auto key = xs::data_key(xs::Key32{}, false, 3);
  for (auto cipher : {xs::Cipher::aes256gcm, xs::Cipher::chacha20poly1305}) {
    // One of each for every block, as a disk thread keeps them: a forged block must not spoil
    // the context for the blocks after it.
    xs::BlockCrypto bc(xs::Protect::private_, cipher, key), ic(xs::Protect::integrity, cipher, key);
    for (std::uint32_t len : {0u, 1u, 15u, 16u, 5000u, (1u << 20) + 3}) {
      for (std::uint64_t offset : {std::uint64_t(0), std::uint64_t(1) << 20, (std::uint64_t(1) << 62) - (1u << 20)}) {
        CAPTURE(xs::to_string(cipher));
        CAPTURE(len);
        CAPTURE(offset);
        std::vector<std::uint8_t> nonce{'b', 'l', 'k', 0}, ad;
        for (int i = 0; i < 8; ++i) nonce.push_back(static_cast<std::uint8_t>(offset >> (8 * i)));
        for (int i = 0; i < 8; ++i) ad.push_back(static_cast<std::uint8_t>(offset >> (8 * i)));
        for (int i = 0; i < 4; ++i) ad.push_back(static_cast<std::uint8_t>(len >> (8 * i)));
        const auto plain = xt::random_bytes(len, len + offset % 89);
        auto botan_seal = Botan::AEAD_Mode::create_or_throw(xs::to_string(cipher), Botan::ENCRYPTION);
        botan_seal->set_key(key.data(), key.size());
        botan_seal->set_associated_data(ad.data(), ad.size());
        botan_seal->start(nonce.data(), nonce.size());
        Botan::secure_vector<std::uint8_t> expect(plain.begin(), plain.end());
        botan_seal->finish(expect);
        REQUIRE(expect.size() == len + 16u);

        std::vector<std::uint8_t> slot(plain);
        slot.resize(len + 16u);
        bc.seal(slot.data(), xdfs::DataLength(len), xdfs::FileOffset(offset));
        CHECK(std::equal(slot.begin(), slot.end(), expect.begin(), expect.end()));

        std::vector<std::uint8_t> forged(expect.begin(), expect.end());
        forged[len] ^= 1;  // the tag's first byte
        CHECK_FALSE(bc.open(forged.data(), xdfs::DataLength(len), xdfs::FileOffset(offset)));
        std::vector<std::uint8_t> theirs(expect.begin(), expect.end());
        REQUIRE(bc.open(theirs.data(), xdfs::DataLength(len), xdfs::FileOffset(offset)));
        CHECK(std::equal(plain.begin(), plain.end(), theirs.begin()));

        auto gmac = Botan::MessageAuthenticationCode::create_or_throw("GMAC(AES-256)");  // with either cipher
        gmac->set_key(key.data(), key.size());
        gmac->start(nonce.data(), nonce.size());
        gmac->update(ad.data(), ad.size());
        gmac->update(plain.data(), plain.size());
        const auto tag = gmac->final();
        std::vector<std::uint8_t> marked(plain), their_mark(plain);
        marked.resize(len + 16u);
        their_mark.insert(their_mark.end(), tag.begin(), tag.end());
        ic.seal(marked.data(), xdfs::DataLength(len), xdfs::FileOffset(offset));
        CHECK(marked == their_mark);
        auto bad_tag = their_mark;
        bad_tag[len + 15] ^= 0x80;  // the tag's last byte
        CHECK_FALSE(ic.open(bad_tag.data(), xdfs::DataLength(len), xdfs::FileOffset(offset)));
        if (len > 0) {
          auto bad_data = their_mark;
          bad_data[0] ^= 1;
          CHECK_FALSE(ic.open(bad_data.data(), xdfs::DataLength(len), xdfs::FileOffset(offset)));
        }
        CHECK(ic.open(their_mark.data(), xdfs::DataLength(len), xdfs::FileOffset(offset)));
      }
    }
  }
}

TEST_CASE("key files: made 0600 in a 0700 directory; loose permissions refused") {
  xt::TempDir dir;
  bool created = false;
  auto k = xs::load_or_create_key(dir / "sub/id", &created);
  CHECK(created);
  struct stat st {};
  REQUIRE(::stat((dir / "sub/id").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(::stat((dir / "sub").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  CHECK(xs::load_or_create_key(dir / "sub/id", &created).public_key == k.public_key);
  CHECK_FALSE(created);
  for (mode_t m : {0644, 0640, 0604, 0660}) {
    CAPTURE(m);
    ::chmod((dir / "sub/id").c_str(), m);
    try {
      xs::load_key(dir / "sub/id");
      FAIL("a loose key file was accepted");
    } catch (const xdfs::Error& e) {
      CHECK(e.code() == errc::insecure_key_file);
      CHECK(std::string(e.what()).find("chmod 600") != std::string::npos);
    }
  }
  xt::write_file(dir / "junk", "not a key");
  ::chmod((dir / "junk").c_str(), 0600);
  CHECK_THROWS_AS(xs::load_key(dir / "junk"), xdfs::Error);
  CHECK(xs::parse_public(xs::format_public(k.public_key)) == k.public_key);
  CHECK_FALSE(xs::parse_public("xdfs-x25519 AAAA").has_value());
  CHECK_FALSE(xs::parse_public("ssh-ed25519 AAAA").has_value());
}

TEST_CASE("key files: threads making the same key at once all get the one key, whole") {
  // A relay's master opens sessions from several threads; on a fresh machine the first of them
  // make the client key together. None may read a half-written file.
  for (int round = 0; round < 20; ++round) {
    xt::TempDir dir;
    const std::string path = dir / "id";
    std::atomic<bool> go{false};
    std::atomic<int> made{0}, failed{0};
    std::vector<xs::Key32> keys(12);
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < keys.size(); ++i)
      threads.emplace_back([&, i] {
        while (!go.load()) std::this_thread::yield();
        try {
          bool created = false;
          keys[i] = xs::load_or_create_key(path, &created).public_key;
          made += created;
        } catch (const xdfs::Error&) {
          ++failed;
        }
      });
    go = true;
    for (auto& t : threads) t.join();
    CHECK(failed.load() == 0);
    CHECK(made.load() == 1);
    CHECK(std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return k == keys[0]; }));
    CHECK(xs::load_key(path).public_key == keys[0]);
    std::size_t left = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++left;
    CHECK(left == 1);  // no temporary file stays
  }
}

TEST_CASE("authorized keys: permissions and clear errors for bad lines") {
  auto a = xs::KeyPair::generate(), b = xs::KeyPair::generate(), c = xs::KeyPair::generate();
  auto keys = xs::AuthorizedKeys::parse("# comment\n\n" + xs::format_public(a.public_key) + " rw\n" +
                                            xs::format_public(b.public_key) + " ro subdir=pub  # reader\n",
                                        "ak");
  REQUIRE(keys.find(a.public_key));
  CHECK(keys.find(a.public_key)->write);
  REQUIRE(keys.find(b.public_key));
  CHECK_FALSE(keys.find(b.public_key)->write);
  CHECK(keys.find(b.public_key)->subdir == "pub");
  CHECK(keys.find(c.public_key) == nullptr);
  try {
    xs::AuthorizedKeys::parse(xs::format_public(a.public_key) + "\nxdfs-x25519 nonsense\n", "ak");
    FAIL("bad line accepted");
  } catch (const xdfs::Error& e) {
    CHECK(std::string(e.what()).find("ak:2") != std::string::npos);
  }
  CHECK_THROWS_AS(xs::AuthorizedKeys::parse(xs::format_public(a.public_key) + " rwx\n", "ak"), xdfs::Error);
}

TEST_CASE("authentication end to end: unknown client, unknown or changed server, read-only, confinement") {
  xt::TempDir root, local, state;
  auto me = xt::test_identity();
  auto reader = xs::KeyPair::generate();
  const std::string stranger_dir = local / "stranger";
  ::mkdir((root / "pub").c_str(), 0755);
  xt::write_file(root / "pub/readme", "public words");
  xt::write_file(root / "secret", "not for readers");
  xt::write_file(state / "authorized_keys", xs::format_public(me.public_key) + " rw\n" +
                                                xs::format_public(reader.public_key) + " ro subdir=pub\n");
  // The test servers' one identity: clients here pin into the shared known_hosts too.
  std::filesystem::copy_file(std::string(std::getenv("XDFS_STATE_DIR")) + "/server_x25519", state / "server_x25519");
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  cfg.state_dir = state.path();
  xt::InProcessServer srv(cfg);
  const xdfs::Endpoint ep{"127.0.0.1", srv.port()};
  xt::write_random_file(local / "f", 70000, 1);
  bool remote = false;
  std::string what;

  SUBCASE("an unknown client key is refused by the server") {
    xdfs::TransferOptions o;
    o.identity_file = stranger_dir + "/id";
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "f", o); }, &remote, &what) == errc::auth_failed);
    CHECK(remote);
    CHECK(what.find("not in the server's authorized keys") != std::string::npos);
    CHECK_FALSE(xt::exists(root / "f"));
  }
  SUBCASE("strict host key: an unknown server is refused, a pinned one accepted, a changed one refused") {
    xdfs::TransferOptions o;
    o.known_hosts_file = local / "kh";
    o.strict_host_key = true;
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "f", o); }, &remote, &what) == errc::auth_failed);
    CHECK_FALSE(remote);
    CHECK(what.find("unknown server key") != std::string::npos);
    CHECK_FALSE(xt::exists(root / "f"));
    // Trust on first use pins it, with a notice.
    o.strict_host_key = false;
    std::string notice;
    o.notice = [&](const std::string& s) { notice = s; };
    xdfs::upload(local / "f", ep, "f", o);
    CHECK(notice.find("pinned") != std::string::npos);
    o.strict_host_key = true;
    xdfs::upload(local / "f", ep, "f2", o);
    CHECK(xt::files_equal(local / "f", root / "f2"));
    // Another key at the same address is refused even without strict mode.
    xt::write_file(local / "kh", "127.0.0.1:" + std::to_string(srv.port()) + " " +
                                     xs::format_public(xs::KeyPair::generate().public_key) + "\n");
    o.strict_host_key = false;
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "f3", o); }, &remote, &what) == errc::auth_failed);
    CHECK(what.find("changed") != std::string::npos);
    CHECK_FALSE(xt::exists(root / "f3"));
  }
  SUBCASE("the server's key is handed over once accepted, before the operation reaches the server; a failure "
          "there fails the handshake and nothing is made") {
    xdfs::TransferOptions o;
    o.known_hosts_file = local / "kh";
    xs::Key32 seen{};
    bool before_op = false;
    o.server_key_accepted = [&](const xs::Key32& k) {
      seen = k;
      before_op = !xt::exists(root / "g");
    };
    xdfs::upload(local / "f", ep, "g", o);
    CHECK(xt::files_equal(local / "f", root / "g"));
    const auto pinned = xs::KnownHosts(local / "kh").lookup("127.0.0.1:" + std::to_string(srv.port()));
    REQUIRE(pinned);
    CHECK(seen == *pinned);
    CHECK(before_op);
    o.server_key_accepted = [](const xs::Key32&) { throw xdfs::Error(errc::disk_full, "no room for the keys"); };
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "h", o); }, &remote, &what) == errc::disk_full);
    CHECK_FALSE(remote);
    CHECK(what.find("no room for the keys") != std::string::npos);
    CHECK_FALSE(xt::exists(root / "h"));
  }
  SUBCASE("a read-only key downloads, cannot upload, and sees only its subdirectory") {
    xdfs::TransferOptions o;
    o.identity_file = local / "reader-id";
    auto made = xs::load_or_create_key(o.identity_file);
    xt::write_file(state / "authorized_keys", xs::format_public(made.public_key) + " ro subdir=pub\n");
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "f", o); }, &remote, &what) == errc::permission_denied);
    CHECK(remote);
    xdfs::download(ep, "readme", local / "readme", o);
    CHECK(xt::read_file(local / "readme") == "public words");
    CHECK(xt::error_of([&] { xdfs::download(ep, "../secret", local / "s", o); }) == errc::path_escape);
    CHECK(xt::error_of([&] { xdfs::download(ep, "secret", local / "s", o); }) == errc::no_such_file);
    CHECK_FALSE(xt::exists(local / "s"));
    // Edits to authorized_keys apply to the next session, without a restart: the key loses its
    // place (a line of the same length: only the file's time stamps tell), then gets it back.
    const std::string line = xs::format_public(made.public_key) + " ro subdir=pub\n";
    xt::write_file(state / "authorized_keys", "#" + line.substr(1));
    CHECK(xt::error_of([&] { xdfs::download(ep, "readme", local / "r2", o); }, &remote, &what) == errc::auth_failed);
    CHECK(what.find("not in the server's authorized keys") != std::string::npos);
    CHECK_FALSE(xt::exists(local / "r2"));
    xt::write_file(state / "authorized_keys", line);
    xdfs::download(ep, "readme", local / "r2", o);
    CHECK(xt::read_file(local / "r2") == "public words");
  }
  SUBCASE("a client key file others can read is refused before connecting") {
    xdfs::TransferOptions o;
    o.identity_file = local / "loose";
    xs::load_or_create_key(o.identity_file);
    ::chmod(o.identity_file.c_str(), 0644);
    CHECK(xt::error_of([&] { xdfs::upload(local / "f", ep, "f", o); }) == errc::insecure_key_file);
  }
}

TEST_CASE("a channel presenting another session's secret cannot join") {
  xt::TempDir root;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  auto victim = xt::make_hello(xdfs::Mode::upload, "v", 2, 10);
  xt::RawChannel a(srv.port());
  REQUIRE(a.establish(victim));
  auto other = xt::make_hello(xdfs::Mode::upload, "o", 2, 10);
  xt::RawChannel b(srv.port());
  REQUIRE(b.establish(other));
  REQUIRE(a.session_secret() != b.session_secret());

  // Channel 1 of the victim's session, keyed with the other session's secret.
  auto join = victim.opening;
  join.channel_index = 1;
  join.join = true;
  join.join_nonce = xt::random_bytes(32, 11);
  xt::RawChannel c(srv.port());
  c.send_opening(join);
  auto answer = c.read_frame();
  REQUIRE(answer.has_value());
  REQUIRE(answer->first.event == w::ChannelEvent::handshake);
  REQUIRE(answer->second.size() == 64);
  std::span<const std::uint8_t> sn(answer->second.data(), 32);
  auto keys = xs::derive_join_keys(b.session_secret(), join.join_nonce, sn, c.opening());
  // The server's proof does not verify under the wrong secret either.
  CHECK_FALSE(xs::equal_constant_time(xs::join_proof(keys, "server", join.join_nonce, sn),
                                      std::span<const std::uint8_t>(answer->second.data() + 32, 32)));
  auto proof = xs::join_proof(keys, "client", join.join_nonce, sn);
  w::FrameHeader h;
  h.event = w::ChannelEvent::handshake;
  h.length = 32;
  c.send_frame(h, std::vector<std::uint8_t>(proof.begin(), proof.end()));
  CHECK(c.wait_closed());
  CHECK(srv.wait_for_log("refused channel 1 from 127.0.0.1:"));
  CHECK(srv.wait_for_log("authentication failed: join proof does not verify"));
  // The impostor took nothing: the victim's own channel 1 joins, and its session starts.
  xt::RawChannel real(srv.port());
  REQUIRE(real.join(victim, 1, a.session_secret()));
  for (auto* ch : {&a, &real}) {
    auto reply = ch->read_frame();
    REQUIRE(reply.has_value());
    CHECK(reply->first.event == w::ChannelEvent::nego_reply);
  }
}

TEST_CASE("a man in the middle: downgrades and tampered frames are detected, no file is kept") {
  xt::TempDir root, local;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  const std::uint32_t bs = 64 * 1024;
  xt::write_random_file(root / "src", 8 * bs + 100, 5);

  auto download_via = [&](xt::Relay& relay, xs::Protect mode, bool verify = true) {
    xdfs::TransferOptions o;
    o.protect = mode;
    o.verify = verify;
    o.block_size = bs;
    o.ring_bytes = 4 * bs;
    o.known_hosts_file = local / "kh";
    o.idle_timeout = std::chrono::milliseconds(5000);
    return xt::error_of([&] { xdfs::download({"127.0.0.1", relay.port()}, "src", local / "dst", o); });
  };

  SUBCASE("an untouched relay changes nothing") {
    for (auto mode : {xs::Protect::clear, xs::Protect::integrity, xs::Protect::private_}) {
      xt::Relay relay(srv.port(), mode);
      CHECK(download_via(relay, mode) == errc::ok);
      CHECK(xt::files_equal(root / "src", local / "dst"));
      ::unlink((local / "dst").c_str());
    }
  }
  SUBCASE("lowering the protection in the negotiation header breaks the handshake") {
    for (auto mode : {xs::Protect::integrity, xs::Protect::private_}) {
      xt::Relay relay(srv.port(), mode);
      relay.rewrite_opening = [](std::vector<std::uint8_t>& opening) {
        auto n = w::decode_opening(std::span<const std::uint8_t>(opening.data() + 32, opening.size() - 32));
        REQUIRE(n.has_value());
        n->protect = static_cast<std::uint8_t>(xs::Protect::clear);
        auto payload = w::encode(*n);
        w::FrameHeader h;
        h.event = w::ChannelEvent::nego;
        h.length = static_cast<std::uint32_t>(payload.size());
        auto hb = w::encode(h);
        opening.resize(8);
        opening.insert(opening.end(), hb.begin(), hb.end());
        opening.insert(opening.end(), payload.begin(), payload.end());
      };
      CHECK(download_via(relay, mode) == errc::auth_failed);
      CHECK_FALSE(xt::exists(local / "dst"));
    }
  }
  SUBCASE("clear mode without the manifest does not claim to protect data: the relay really does change bytes") {
    xt::Relay relay(srv.port(), xs::Protect::clear);
    relay.hook = [](const xt::Relay::Seen& f) {
      return f.dir == xt::Relay::Dir::down && f.data_index == 2 ? xt::Relay::Verdict::flip_payload_bit
                                                                : xt::Relay::Verdict::pass;
    };
    CHECK(download_via(relay, xs::Protect::clear, false) == errc::ok);
    CHECK_FALSE(xt::files_equal(root / "src", local / "dst"));
  }
  SUBCASE("with the manifest, clear mode catches a changed block by its digest and fetches it again") {
    xt::Relay relay(srv.port(), xs::Protect::clear);
    std::atomic<int> nacks{0};
    relay.hook = [&nacks](const xt::Relay::Seen& f) {
      if (f.dir == xt::Relay::Dir::up && f.header.event == w::ChannelEvent::nack) ++nacks;
      return f.dir == xt::Relay::Dir::down && f.data_index == 2 ? xt::Relay::Verdict::flip_payload_bit
                                                                : xt::Relay::Verdict::pass;
    };
    CHECK(download_via(relay, xs::Protect::clear) == errc::ok);
    CHECK(xt::files_equal(root / "src", local / "dst"));
    CHECK(nacks == 1);
  }
  SUBCASE("a block changed every time it is sent is asked for three times, then the transfer fails naming it") {
    xt::Relay relay(srv.port(), xs::Protect::clear);
    std::atomic<int> nacks{0};
    relay.hook = [&nacks](const xt::Relay::Seen& f) {
      if (f.dir == xt::Relay::Dir::up && f.header.event == w::ChannelEvent::nack) ++nacks;
      return f.dir == xt::Relay::Dir::down && f.header.offset == 2 * bs && f.data_index != SIZE_MAX
                 ? xt::Relay::Verdict::flip_payload_bit
                 : xt::Relay::Verdict::pass;
    };
    std::string what;
    xdfs::TransferOptions o;
    o.protect = xs::Protect::clear;
    o.block_size = bs;
    o.ring_bytes = 4 * bs;
    o.known_hosts_file = local / "kh";
    o.idle_timeout = std::chrono::milliseconds(5000);
    CHECK(xt::error_of([&] { xdfs::download({"127.0.0.1", relay.port()}, "src", local / "dst", o); }, nullptr, &what) ==
          errc::integrity_error);
    CHECK(what.find("the block at offset " + std::to_string(2 * bs) + " did not match its digest 4 times") !=
          std::string::npos);
    CHECK(nacks == 3);
    CHECK_FALSE(xt::exists(local / "dst"));
  }
  SUBCASE("a recorded join does not replay; a rewritten version or negotiation does not pass") {
    // The version in the preamble: refused before any handshake.
    {
      xt::Relay relay(srv.port(), xs::Protect::private_);
      relay.rewrite_opening = [](std::vector<std::uint8_t>& opening) { opening[4] = 9; };
      CHECK(download_via(relay, xs::Protect::private_) == errc::bad_version);
    }
    // The negotiation (mode, path, sizes) rides in Noise message 3: one changed byte of it and
    // the server's check of that message fails.
    {
      xt::Relay relay(srv.port(), xs::Protect::private_);
      relay.rewrite_opening = nullptr;
      relay.rewrite_client_handshake = [](std::size_t nth, std::vector<std::uint8_t>& frame) {
        if (nth == 1) frame[24 + 40] ^= 0x04;  // message 3, inside its encrypted payload
      };
      CHECK(download_via(relay, xs::Protect::private_) != errc::ok);
      CHECK(srv.wait_for_log("the client's handshake does not verify"));
      CHECK_FALSE(xt::exists(local / "dst"));
    }
    // A join's opening and proof, recorded and sent again on a new connection: the server's new
    // nonce makes the old proof worthless. (Three channels: one index is still to be handed out,
    // so the replay gets as far as its proof.)
    auto h = xt::make_hello(xdfs::Mode::upload, "r", 3, 10);
    xt::RawChannel first(srv.port());
    REQUIRE(first.establish(h));
    xt::RawChannel joined(srv.port());
    REQUIRE(joined.join(h, 1, first.session_secret()));
    const auto recording = joined.sent();  // its opening and its proof
    xt::RawChannel replay(srv.port());
    replay.send_bytes(recording);  // the proof went with another server nonce
    auto fresh = replay.read_frame();
    REQUIRE(fresh.has_value());
    REQUIRE(fresh->first.event == w::ChannelEvent::handshake);
    CHECK(replay.wait_closed());
    CHECK(srv.wait_for_log("join proof does not verify"));
  }
}

TEST_CASE("a man in the middle tampering either way, on any of n channels, in both modes: each protection level "
          "reports what it promises") {
  using V = xt::Relay::Verdict;
  using D = xt::Relay::Dir;
  xt::TempDir root, local;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  const std::uint32_t bs = 64 * 1024;
  xt::write_random_file(root / "src", 9 * bs + 100, 5);
  xt::write_random_file(local / "src", 9 * bs + 100, 6);

  // One transfer through the relay: a download (blocks go down) or an upload (blocks go up), with
  // three channels; returns its error code and whether the server reported it.
  auto transfer = [&](xt::Relay& relay, xs::Protect mode, bool verify, D data_dir, bool* remote) {
    xdfs::TransferOptions o;
    o.protect = mode;
    o.verify = verify;
    o.resume = false;  // each case from byte 0: a partial file an earlier case kept is not continued
    o.block_size = bs;
    o.ring_bytes = 4 * bs;
    o.channels = 3;
    o.known_hosts_file = local / "kh";
    o.idle_timeout = std::chrono::milliseconds(5000);
    const xdfs::Endpoint ep{"127.0.0.1", relay.port()};
    if (data_dir == D::down) return xt::error_of([&] { xdfs::download(ep, "src", local / "dst", o); }, remote);
    return xt::error_of([&] { xdfs::upload(local / "src", ep, "dst", o); }, remote);
  };
  struct Case {
    const char* name;
    V verdict;
    bool control;  // an EOFR (with the data) or an ACK (against it) instead of a data frame
    bool against;  // the frame goes against the data: an ACK from the receiver
    // What integrity/private must report, what clear does with the manifest (a block's digest
    // catches a changed block) and without it (--no-verify: nothing looks at data bytes).
    errc integrity, clear, raw;
  };
  const std::vector<Case> cases{
      // Clear mode with the manifest: the block fails its digest and is fetched again.
      {"flip a payload bit", V::flip_payload_bit, false, false, errc::integrity_error, errc::ok, errc::ok},
      {"flip a bit of an EOFR's header", V::flip_header_bit, true, false, errc::integrity_error, errc::integrity_error,
       errc::integrity_error},
      {"flip a bit of an ACK's header", V::flip_header_bit, true, true, errc::integrity_error, errc::integrity_error,
       errc::integrity_error},
      {"replay a data frame", V::duplicate, false, false, errc::integrity_error, errc::protocol_error,
       errc::protocol_error},
      // Clear mode: the sender's EOFR waits for the acknowledgement of every block (the receiver
      // may still ask for one again), so nothing more comes whose check would show the gap; the
      // idle timeout ends it.
      {"drop a data frame", V::drop, false, false, errc::integrity_error, errc::timeout, errc::timeout},
      {"reorder two data frames", V::swap_with_next, false, false, errc::integrity_error, errc::ok, errc::ok},
      {"cut the stream", V::cut, false, false, errc::peer_aborted, errc::peer_aborted, errc::peer_aborted},
  };
  struct Level {
    xs::Protect mode;
    bool verify;
  };
  const Level levels[] = {{xs::Protect::clear, false}, {xs::Protect::clear, true}, {xs::Protect::integrity, true},
                          {xs::Protect::private_, true}};
  for (D data_dir : {D::down, D::up}) {
    for (const auto& c : cases) {
      for (const auto [mode, verify] : levels) {
        CAPTURE(std::string(data_dir == D::down ? "download" : "upload"));
        CAPTURE(std::string(c.name));
        CAPTURE(std::string(xs::to_string(mode)));
        CAPTURE(verify);
        xt::Relay relay(srv.port(), mode);
        // Blocks and EOFR on channel 1 (a joined one); ACKs travel on channel 0.
        relay.hook = [&c, data_dir](const xt::Relay::Seen& f) {
          const D want = c.against ? (data_dir == D::down ? D::up : D::down) : data_dir;
          if (f.dir != want || f.conn != (c.against ? 0u : 1u)) return V::pass;
          const bool target = c.control ? f.header.event == (c.against ? w::ChannelEvent::ack : w::ChannelEvent::eofr)
                                        : f.data_index == 1;
          return target ? c.verdict : V::pass;
        };
        bool remote = false;
        const errc got = transfer(relay, mode, verify, data_dir, &remote);
        const errc want = mode != xs::Protect::clear ? c.integrity : verify ? c.clear : c.raw;
        // Clear mode promises nothing of data frames; a replay there trips the counter (integrity)
        // or the duplicate-block check first (protocol): either is fine, success is not.
        if (mode == xs::Protect::clear && c.verdict == V::duplicate)
          CHECK_MESSAGE((got == errc::protocol_error || got == errc::integrity_error), "got " << xdfs::to_string(got));
        else
          CHECK_MESSAGE(got == want, "got " << xdfs::to_string(got) << ", want " << xdfs::to_string(want));
        // Who noticed: the receiver of the tampered frame; the other side hears it from its peer.
        if (got == errc::integrity_error) {
          const bool server_saw = (c.against ? (data_dir == D::down) : (data_dir == D::up));
          CHECK(remote == server_saw);
        }
        const std::string src = data_dir == D::down ? root / "src" : local / "src";
        const std::string dst = data_dir == D::down ? local / "dst" : root / "dst";
        if (got != errc::ok && c.against) {
          // An acknowledgement was tampered with: the receiver may have had every block, checked,
          // and made the file final before the sender noticed. If it did, the file is whole.
          if (xt::exists(dst)) CHECK(xt::files_equal(src, dst));
        } else if (got != errc::ok) {
          CHECK_FALSE(xt::exists(dst));
        } else if (c.verdict == V::flip_payload_bit) {
          // Clear mode without the manifest moved the changed bytes, as it says it would; with
          // it, the changed block was fetched again and the file is whole.
          CHECK(xt::files_equal(src, dst) == verify);
        }
        ::unlink((local / "dst").c_str());
        ::unlink((root / "dst").c_str());
        xt::check_no_partials(local.path());
        xt::check_no_partials(root.path());
      }
    }
  }
}

TEST_CASE("a frame whose tag does not verify is refused by the server, in every mode that tags it, in both modes") {
  xt::TempDir root;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  const std::uint32_t bs = 64 * 1024;
  for (auto mode : {xs::Protect::clear, xs::Protect::integrity, xs::Protect::private_}) {
    CAPTURE(std::string(xs::to_string(mode)));
    auto upload = [&](const std::function<void(xt::RawChannel&)>& send) {
      auto h = xt::make_hello(xdfs::Mode::upload, "u", 1, 2 * bs);
      h.opening.protect = static_cast<std::uint8_t>(mode);
      xt::RawChannel c(srv.port());
      REQUIRE(c.establish(h));
      auto reply = c.read_frame();
      REQUIRE(reply.has_value());
      REQUIRE(reply->first.event == w::ChannelEvent::nego_reply);
      send(c);
      auto ex = c.read_exception();
      REQUIRE(ex.has_value());
      return *ex;
    };
    // A control frame is tagged in every mode.
    auto ex = upload([&](xt::RawChannel& c) {
      c.send_block(w::ChannelEvent::xftsmu, 0, xt::random_bytes(bs, 1));
      w::FrameHeader eofr;
      eofr.event = w::ChannelEvent::eofr;
      c.send_frame(eofr, {}, true);
    });
    CHECK(ex.code == errc::integrity_error);
    CHECK(ex.message.find("failed its integrity check") != std::string::npos);
    // A data frame is tagged in integrity and private mode (clear sends blocks as they are).
    if (mode != xs::Protect::clear) {
      ex = upload([&](xt::RawChannel& c) { c.send_block(w::ChannelEvent::xftsmu, 0, xt::random_bytes(bs, 1), true); });
      CHECK(ex.code == errc::integrity_error);
    }
    // A path request likewise.
    auto p = xt::make_hello(xdfs::Mode::path, ".", 1);
    p.opening.protect = static_cast<std::uint8_t>(mode);
    xt::RawChannel c(srv.port());
    REQUIRE(c.establish(p));
    REQUIRE(c.read_frame().has_value());
    xdfs::pathm::Request r;
    r.id = 1;
    r.op = xdfs::pathm::Op::stat;
    r.path = ".";
    auto enc = xdfs::pathm::encode(r);
    w::FrameHeader h;
    h.event = w::ChannelEvent::xpathm;
    h.length = static_cast<std::uint32_t>(enc.size);
    auto b = enc.bytes();
    c.send_frame(h, std::vector<std::uint8_t>(b.begin(), b.end()), true);
    auto pex = c.read_exception();
    REQUIRE(pex.has_value());
    CHECK(pex->code == errc::integrity_error);
  }
  CHECK_FALSE(xt::exists(root / "u"));
  xt::check_no_partials(root.path());
}

TEST_CASE("a man in the middle of a path session: a tampered, replayed or dropped request or reply fails in every "
          "mode") {
  using V = xt::Relay::Verdict;
  using D = xt::Relay::Dir;
  xt::TempDir root, local;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  std::filesystem::create_directories(local / "tree/sub");
  for (int i = 0; i < 20; ++i) xt::write_random_file(local / ("tree/sub/f" + std::to_string(i)), 3000 + i, i);
  // Chunks enough that both channels carry several requests at once: what follows a dropped one
  // on its channel shows the gap.
  for (int i = 0; i < 6; ++i) xt::write_random_file(local / ("tree/big" + std::to_string(i)), 2 << 20, 90 + i);
  for (D dir : {D::up, D::down}) {
    for (V v : {V::flip_payload_bit, V::duplicate, V::drop}) {
      for (auto mode : {xs::Protect::clear, xs::Protect::integrity, xs::Protect::private_}) {
        CAPTURE(std::string(dir == D::up ? "request" : "reply"));
        CAPTURE(static_cast<int>(v));
        CAPTURE(std::string(xs::to_string(mode)));
        xt::Relay relay(srv.port(), mode);
        // The second request (or reply) on channel 1: both directions carry more after it, so
        // a dropped one shows as a gap in the count.
        int seen = 0;
        relay.hook = [dir, v, &seen](const xt::Relay::Seen& f) {
          if (f.dir != dir || f.conn != 1 || f.header.event != w::ChannelEvent::xpathm) return V::pass;
          return ++seen == 2 ? v : V::pass;
        };
        xdfs::TransferOptions o;
        o.protect = mode;
        o.channels = 2;
        o.known_hosts_file = local / "kh";
        o.idle_timeout = std::chrono::milliseconds(5000);
        errc got = errc::ok;
        try {
          xdfs::RemoteFs rfs({"127.0.0.1", relay.port()}, o);
          rfs->upload_tree(local / "tree", "t", {});
          rfs.close();
        } catch (const xdfs::Error& e) {
          got = e.code();
        }
        CHECK_MESSAGE(got == errc::integrity_error, "got " << xdfs::to_string(got));
        std::error_code ec;
        std::filesystem::remove_all(root / "t", ec);
      }
    }
  }
}

}  // TEST_SUITE
