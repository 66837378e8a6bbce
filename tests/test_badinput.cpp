// Hostile and broken clients against a real xdfsd process: each gets an exception header that
// names the cause, nothing is left under a final name, and the server goes on serving.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include "support.hpp"

using xdfs::Mode;
using xdfs::errc;
using xdfs::wire::ChannelEvent;
using xdfs::wire::FrameHeader;

namespace {

void check_still_serving(xt::XdfsdProcess& d, const xt::TempDir& root, const xt::TempDir& local) {
  REQUIRE(d.alive());
  xt::check_serving(d.port(), root.path(), local.path());
}

}  // namespace

TEST_SUITE("badinput") {

TEST_CASE("every bad first header is refused with its cause, and xdfsd keeps serving") {
  xt::TempDir root, local;
  ::mkdir((root / "sub").c_str(), 0755);
  REQUIRE(::symlink("/etc", (root / "out").c_str()) == 0);
  xt::XdfsdProcess d(root.path(), {"--max-channels", "16", "--handshake-timeout", "2", "--join-timeout", "2"});

  auto expect = [&](xt::RawChannel& c, errc code, const std::string& words) {
    auto ex = c.read_exception();
    REQUIRE_MESSAGE(ex.has_value(), "no exception header; xdfsd log:\n" << d.log());
    CHECK(ex->code == code);
    CHECK_MESSAGE(ex->message.find(words) != std::string::npos, ex->message);
    CHECK(c.wait_closed());
  };
  // Refused once the file is opened: the operation goes, the session stays for the next one
  // until the client ends it (EOFT), and then closes.
  auto expect_refused = [&](xt::RawChannel& c, errc code, const std::string& words) {
    auto ex = c.read_exception();
    REQUIRE_MESSAGE(ex.has_value(), "no exception header; xdfsd log:\n" << d.log());
    CHECK(ex->code == code);
    CHECK(ex->refused);
    CHECK_MESSAGE(ex->message.find(words) != std::string::npos, ex->message);
    CHECK_FALSE(c.wait_closed(300));
    FrameHeader end;
    end.event = ChannelEvent::eoft;
    c.send_frame(end);
    CHECK(c.wait_closed());
  };

  SUBCASE("garbage bytes on a fresh connection") {
    xt::RawChannel c(d.port());
    c.send_bytes(xt::random_bytes(200, 1));
    expect(c, errc::protocol_error, "bad magic");
  }
  SUBCASE("an HTTP request") {
    xt::RawChannel c(d.port());
    std::string req = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    c.send_bytes(req.data(), req.size());
    expect(c, errc::protocol_error, "bad magic");
  }
  SUBCASE("a truncated frame header") {
    xt::RawChannel c(d.port());
    c.send_preamble();
    std::uint8_t half[10] = {1, 0, 0, 0, 8};
    c.send_bytes(half, sizeof half);
    c.shutdown_write();
    expect(c, errc::protocol_error, "truncated");
  }
  SUBCASE("a truncated negotiation payload") {
    xt::RawChannel c(d.port());
    auto payload = xdfs::wire::encode(xt::make_hello(Mode::upload, "x", 1, 10).opening);
    FrameHeader h;
    h.event = ChannelEvent::nego;
    h.length = static_cast<std::uint32_t>(payload.size());
    c.send_preamble();
    c.send_frame(h);
    c.send_bytes(payload.data(), payload.size() / 2);
    c.shutdown_write();
    expect(c, errc::protocol_error, "truncated");
  }
  SUBCASE("a wrong protocol version in the preamble") {
    xt::RawChannel c(d.port());
    c.send_preamble(7);
    expect(c, errc::bad_version, "version 7");
  }
  SUBCASE("a wrong protocol version in the opening") {
    xt::RawChannel c(d.port());
    auto n = xt::make_hello(Mode::upload, "x", 1, 10);
    n.opening.version = 9;
    c.send_opening(n.opening);
    expect(c, errc::bad_version, "version 9");
  }
  SUBCASE("a frame other than NEGO first") {
    xt::RawChannel c(d.port());
    c.send_preamble();
    FrameHeader h;
    h.event = ChannelEvent::xftsmu;
    h.length = 16;
    c.send_frame(h, std::vector<std::uint8_t>(16));
    expect(c, errc::protocol_error, "expected a negotiation header");
  }
  SUBCASE("an oversized control payload") {
    xt::RawChannel c(d.port());
    c.send_preamble();
    std::uint8_t h[24] = {1, 0, 0, 0, 0, 0, 0, 0x10};  // NEGO with a 256 MiB payload
    c.send_bytes(h, sizeof h);
    expect(c, errc::protocol_error, "exceeds");
  }
  SUBCASE("an opening larger than an opening can be") {
    xt::RawChannel c(d.port());
    c.send_preamble();
    FrameHeader h;
    h.event = ChannelEvent::nego;
    h.length = 4096;  // within the control limit, far beyond what an opening needs
    auto hb = xdfs::wire::encode(h);
    c.send_bytes(hb.data(), hb.size());  // the header alone: the server must not wait for 4 KiB
    expect(c, errc::protocol_error, "exceeds the limit");
  }
  SUBCASE("a handshake message larger than its step's message can be") {
    xt::RawChannel c(d.port());
    c.send_opening(xt::make_hello(Mode::upload, "x", 1, 10).opening);
    FrameHeader h;
    h.event = ChannelEvent::handshake;
    h.length = 4096;  // within the control limit; Noise XX's first message is 32 bytes
    auto hb = xdfs::wire::encode(h);
    c.send_bytes(hb.data(), hb.size());  // the header alone: the server must not wait for 4 KiB
    expect(c, errc::protocol_error, "a handshake message of 4096 bytes (at most 32)");
  }
  SUBCASE("a malformed negotiation message") {
    xt::RawChannel c(d.port());
    c.send_preamble();
    FrameHeader h;
    h.event = ChannelEvent::nego;
    h.length = 64;
    c.send_frame(h, std::vector<std::uint8_t>(64, 0xFF));  // a segment table that promises 2^32 segments
    expect(c, errc::protocol_error, "malformed control message");
  }
  // What the negotiation asks travels inside the handshake: refused over the protected channel.
  SUBCASE("n = 0") {
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(xt::make_hello(Mode::upload, "x", 0, 10)));
    expect(c, errc::bad_argument, "n = 0");
  }
  SUBCASE("n over the limit") {
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(xt::make_hello(Mode::upload, "x", 17, 10)));
    expect(c, errc::limit_exceeded, "allows 16");
  }
  SUBCASE("channel index not below n, and channel 0 claiming to join") {
    auto n = xt::make_hello(Mode::upload, "x", 2, 10);
    xt::RawChannel c0(d.port());
    REQUIRE(c0.establish(n));
    xt::RawChannel c(d.port());
    auto o = n.opening;
    o.channel_index = 2;
    o.join = true;
    o.join_nonce.assign(32, 7);
    c.send_opening(o);
    expect(c, errc::bad_channel, "index 2 is not below n = 2");
    xt::RawChannel zero(d.port());
    o.channel_index = 0;
    zero.send_opening(o);
    expect(zero, errc::protocol_error, "channel 0 cannot join");
  }
  SUBCASE("block size out of range") {
    xt::RawChannel c(d.port());
    auto n = xt::make_hello(Mode::upload, "x", 1, 10);
    n.nego.block_size = 100;
    REQUIRE(c.establish(n));
    expect(c, errc::bad_argument, "block size 100");
  }
  SUBCASE("path escapes: '..', absolute, symlink out of the root") {
    for (const char* p : {"../x", "sub/../../x", "/etc/passwd"}) {
      CAPTURE(p);
      xt::RawChannel c(d.port());
      REQUIRE(c.establish(xt::make_hello(Mode::download, p, 1)));
      expect(c, errc::path_escape, p[0] == '/' ? "absolute path" : "'..' component");
    }
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(xt::make_hello(Mode::download, "out/passwd", 1)));
    expect_refused(c, errc::path_escape, "outside the root");
    xt::RawChannel c2(d.port());
    REQUIRE(c2.establish(xt::make_hello(Mode::upload, "out/evil", 1, 5)));
    expect_refused(c2, errc::path_escape, "outside the root");
    CHECK_FALSE(xt::exists("/etc/evil"));
  }
  SUBCASE("a client that sends nothing") {
    xt::RawChannel c(d.port());
    expect(c, errc::timeout, "did not complete within 2000 ms");
  }
  SUBCASE("channels that never arrive") {
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(xt::make_hello(Mode::upload, "x", 3, 10)));
    expect(c, errc::timeout, "only 1 of 3 channels");
  }
  SUBCASE("a duplicate, a mismatched and a stranger's channel") {
    auto n0 = xt::make_hello(Mode::upload, "x", 3, 10);
    xt::RawChannel c0(d.port());
    REQUIRE(c0.establish(n0));
    xt::RawChannel again(d.port());  // a second first channel for the same session
    again.send_opening(n0.opening);
    expect(again, errc::bad_channel, "already exists");
    // Channel 1 joins with the session secret; a second channel 1 proves the secret too, and
    // is refused over its own protected channel.
    xt::RawChannel one(d.port());
    REQUIRE(one.join(n0, 1, c0.session_secret()));
    xt::RawChannel dup(d.port());
    REQUIRE(dup.join(n0, 1, c0.session_secret()));
    // Whichever proved itself second is refused at once; the other waits with the session and
    // hears its join timeout.
    auto first = dup.read_exception();
    auto second = one.read_exception();
    REQUIRE(first.has_value());
    REQUIRE(second.has_value());
    const bool dup_refused = first->code == errc::bad_channel;
    const auto& refused = dup_refused ? *first : *second;
    const auto& waited = dup_refused ? *second : *first;
    CHECK(refused.code == errc::bad_channel);
    CHECK(refused.message.find("duplicate channel index 1") != std::string::npos);
    CHECK(waited.code == errc::timeout);
    auto other = n0.opening;  // the same session at another protection level
    other.channel_index = 2;
    other.join = true;
    other.join_nonce.assign(32, 7);
    other.protect = 2;
    xt::RawChannel mism(d.port());
    mism.send_opening(other);
    expect(mism, errc::bad_channel, "does not match");
    auto stranger = other;
    stranger.protect = 0;
    stranger.session = xdfs::SessionId::random();
    xt::RawChannel lost(d.port());
    lost.send_opening(stranger);
    expect(lost, errc::bad_channel, "to join");
  }
  check_still_serving(d, root, local);
  xt::check_no_partials(root.path());
  CHECK_FALSE(xt::exists(root / "x"));
}

TEST_CASE("the session limit refuses one more session, then frees up") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {"--max-sessions", "1", "--idle-timeout", "2"});
  {
    xt::RawChannel holder(d.port());  // a session that is accepted, then sends nothing
    REQUIRE(holder.establish(xt::make_hello(Mode::upload, "x", 1, 10)));
    auto reply = holder.read_frame();
    REQUIRE(reply.has_value());
    REQUIRE(reply->first.event == ChannelEvent::nego_reply);
    xt::RawChannel extra(d.port());
    REQUIRE(extra.establish(xt::make_hello(Mode::upload, "y", 1, 10)));
    auto ex = extra.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::limit_exceeded);
    CHECK(ex->message.find("1 sessions are running, the limit") != std::string::npos);
    auto gone = holder.read_exception();  // the idle timeout ends the held session
    REQUIRE(gone.has_value());
    CHECK(gone->code == errc::timeout);
    CHECK(gone->message.find("no progress for 2 s") != std::string::npos);
  }
  CHECK(d.wait_for_log("status=error: timed out"));
  check_still_serving(d, root, local);
}

TEST_CASE("bad frames mid-transfer end the session; no file appears; xdfsd keeps serving") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {"--idle-timeout", "2"});
  const std::uint32_t bs = 64 * 1024;

  // Joins an upload session of 1 channel for a file of 4 blocks and reads the server's reply.
  auto start_upload = [&](xt::RawChannel& c) {
    auto n = xt::make_hello(Mode::upload, "victim", 1, 4 * bs);
    REQUIRE(c.establish(n));
    auto reply = c.read_frame();
    REQUIRE(reply.has_value());
    REQUIRE(reply->first.event == ChannelEvent::nego_reply);
  };
  const auto block = xt::upload_block;

  SUBCASE("a misaligned block") {
    xt::RawChannel c(d.port());
    start_upload(c);
    c.send_frame(block(100, bs), xt::random_bytes(bs, 1));
    auto ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::protocol_error);
    CHECK(ex->message.find("bad block") != std::string::npos);
  }
  SUBCASE("a block past the end of the file") {
    xt::RawChannel c(d.port());
    start_upload(c);
    c.send_frame(block(8 * bs, bs), xt::random_bytes(bs, 1));
    auto ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::protocol_error);
    CHECK(ex->message.find("bad block on channel 0: offset 524288 length 65536 in a file of 262144 bytes") !=
          std::string::npos);
  }
  SUBCASE("the same block twice") {
    xt::RawChannel c(d.port());
    start_upload(c);
    c.send_frame(block(0, bs), xt::random_bytes(bs, 1));
    c.send_frame(block(0, bs), xt::random_bytes(bs, 1));
    auto ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::protocol_error);
    CHECK(ex->message.find("block at offset 0 received twice") != std::string::npos);
  }
  SUBCASE("a download-direction block in an upload") {
    xt::RawChannel c(d.port());
    start_upload(c);
    auto h = block(0, bs);
    h.event = ChannelEvent::xftsmd;
    c.send_frame(h, xt::random_bytes(bs, 1));
    auto ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::protocol_error);
    CHECK(ex->message.find("unexpected xFTSMD on channel 0") != std::string::npos);
  }
  SUBCASE("EOFR before all bytes") {
    xt::RawChannel c(d.port());
    start_upload(c);
    c.send_frame(block(0, bs), xt::random_bytes(bs, 1));
    c.send_frame(xt::eofr_header(0));
    auto ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::size_mismatch);
    CHECK(ex->message.find("sender ended after 65536 of 262144 bytes") != std::string::npos);
  }
  SUBCASE("a peer that disconnects mid-file") {
    xt::RawChannel c(d.port());
    start_upload(c);
    c.send_frame(block(0, bs), xt::random_bytes(bs, 1));
    c.send_frame(block(bs, bs), xt::random_bytes(bs / 2, 2));  // half a block, then gone
    // A FIN and nothing more: closing the socket outright would answer whatever the server had
    // sent meanwhile with a reset, and the server would report that instead (also an abort).
    c.shutdown_write();
    CHECK(d.wait_for_log("status=error: peer aborted: channel 0 closed by the client"));
    CHECK(c.wait_closed());
  }
  // Sends `poke` every 200 ms until an exception arrives (at most 10 s).
  auto poke_until_exception = [](xt::RawChannel& c, const FrameHeader& poke) {
    std::optional<xdfs::wire::ExceptionHeader> ex;
    for (int i = 0; i < 50 && !ex; ++i) {
      c.send_frame(poke);
      auto f = c.read_frame(200);
      if (f && f->first.event == ChannelEvent::exception) ex = xdfs::wire::decode_exception(f->second);
    }
    return ex;
  };
  SUBCASE("a peer that stalls mid-file but sends NOOPs hits the idle timeout: NOOPs are not progress") {
    xt::RawChannel c(d.port());
    start_upload(c);
    c.send_frame(block(0, bs), xt::random_bytes(bs, 1));
    FrameHeader noop;
    noop.event = ChannelEvent::noop;
    auto ex = poke_until_exception(c, noop);
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::timeout);
    CHECK(ex->message.find("no progress for 2 s") != std::string::npos);
  }
  SUBCASE("a peer that stalls mid-file hits the idle timeout") {
    xt::RawChannel c(d.port());
    start_upload(c);
    c.send_frame(block(0, bs), xt::random_bytes(bs, 1));
    auto ex = c.read_exception(10000);
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::timeout);
    CHECK(ex->message.find("no progress for 2 s") != std::string::npos);
  }
  CHECK(d.wait_for_log("path=victim channels=1"));
  CHECK(d.wait_for_log("status=error"));
  CHECK_FALSE(xt::exists(root / "victim"));
  check_still_serving(d, root, local);
  xt::check_no_partials(root.path());
}

TEST_CASE("a downloading peer that only repeats its last ACK makes no progress: the idle timeout ends it") {
  xt::TempDir root, local;
  xt::write_random_file(root / "f", 16 * 65536, 5);
  xt::XdfsdProcess d(root.path(), {"--idle-timeout", "2"});
  auto h = xt::make_hello(Mode::download, "f", 1);
  h.nego.window = 2 * 65536;  // two blocks, then the server waits for an acknowledgement
  xt::RawChannel c(d.port());
  REQUIRE(c.establish(h));
  FrameHeader ack;
  ack.event = ChannelEvent::ack;
  ack.offset = 0;
  std::optional<xdfs::wire::ExceptionHeader> ex;
  for (int i = 0; i < 50 && !ex; ++i) {
    c.send_frame(ack);
    for (auto f = c.read_frame(200); f; f = c.read_frame(200))
      if (f->first.event == ChannelEvent::exception) {
        ex = xdfs::wire::decode_exception(f->second);
        break;
      }
  }
  REQUIRE(ex.has_value());
  CHECK(ex->code == errc::timeout);
  CHECK(ex->message.find("no progress for 2 s") != std::string::npos);
  check_still_serving(d, root, local);
}

}  // TEST_SUITE
