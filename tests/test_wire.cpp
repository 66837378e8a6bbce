// Unit tests for XDOPI (framework/include/xdfs/wire.hpp) and files::check_relative_path.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "xdfs/error.hpp"
#include "xdfs/files.hpp"
#include "xdfs/types.hpp"
#include "xdfs/wire.hpp"

namespace {

using namespace xdfs;
namespace w = xdfs::wire;

constexpr std::array<w::ChannelEvent, 14> all_events{
    w::ChannelEvent::nego, w::ChannelEvent::nego_reply, w::ChannelEvent::xftsmu,    w::ChannelEvent::xftsmd,
    w::ChannelEvent::xpathm, w::ChannelEvent::eofr,     w::ChannelEvent::eoft,      w::ChannelEvent::noop,
    w::ChannelEvent::conm, w::ChannelEvent::zxdfs,      w::ChannelEvent::ack,       w::ChannelEvent::exception,
    w::ChannelEvent::handshake, w::ChannelEvent::nack,
};

std::optional<w::FrameHeader> decode_bytes(const w::HeaderBytes& b, std::string* why = nullptr) {
  return w::decode(std::span<const std::uint8_t, w::frame_header_size>(b), why);
}

void put_le32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

std::uint64_t get_le64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void put_le64(std::uint8_t* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

w::Opening sample_opening() {
  w::Opening o;
  o.version = 7;
  for (std::size_t i = 0; i < o.session.bytes.size(); ++i) o.session.bytes[i] = static_cast<std::uint8_t>(0xA0 + i);
  o.channel_index = 3;
  o.protect = 1;
  o.cipher = 1;
  o.join = true;
  o.join_nonce.assign(32, 0x5A);
  return o;
}

w::Negotiation sample_negotiation() {
  w::Negotiation n;
  n.channel_count = 9;
  n.mode = Mode::download;
  n.remote_path = "dir/sub/file.bin";
  n.block_size = 256 * 1024;
  n.tcp_window = 4 * 1024 * 1024;
  n.extended_flags = 0x0123456789ABCDEFull;
  n.file_size = 0x3EDCBA9876543210ull;
  n.window = 123456789012ull;
  return n;
}

void check_header_roundtrip(const w::FrameHeader& h) {
  const auto bytes = w::encode(h);
  std::string why = "untouched";
  const auto d = decode_bytes(bytes, &why);
  REQUIRE(d.has_value());
  CHECK(d->event == h.event);
  CHECK(d->flags == h.flags);
  CHECK(d->length == h.length);
  CHECK(d->offset == h.offset);
  CHECK(d->aux == h.aux);
  CHECK(w::encode(*d) == bytes);
}

// Finds the list pointers of the root struct of a single-segment, flat-array Cap'n Proto
// message: returns the byte offsets of list pointers with byte-sized elements and `count`
// elements. Used to patch messages without the (private) schema header.
std::vector<std::size_t> find_byte_list_pointers(const std::vector<std::uint8_t>& msg, std::uint32_t count) {
  std::vector<std::size_t> found;
  REQUIRE(msg.size() >= 16);
  // Segment table: one segment -> (count-1 = 0, size), one word.
  REQUIRE(msg[0] == 0);
  const std::uint64_t root = get_le64(&msg[8]);
  REQUIRE((root & 3) == 0);  // struct pointer
  const auto off = static_cast<std::int32_t>(static_cast<std::uint32_t>(root)) >> 2;
  const auto data_words = static_cast<std::uint16_t>(root >> 32);
  const auto ptr_count = static_cast<std::uint16_t>(root >> 48);
  const std::size_t data_start = 16 + static_cast<std::size_t>(off) * 8;
  const std::size_t ptr_start = data_start + data_words * 8u;
  for (std::size_t i = 0; i < ptr_count; ++i) {
    const std::size_t at = ptr_start + i * 8;
    REQUIRE(at + 8 <= msg.size());
    const std::uint64_t p = get_le64(&msg[at]);
    if ((p & 3) != 1) continue;                  // not a list pointer
    if (((p >> 32) & 7) != 2) continue;          // not byte-sized elements
    if ((p >> 35) != count) continue;
    found.push_back(at);
  }
  return found;
}

}  // namespace

namespace {
w::RelayHop sample_hop(std::uint8_t seed) {
  w::RelayHop h;
  h.address = "10.0.0." + std::to_string(seed) + ":7721";
  h.server_key.fill(seed);
  h.ticket.fill(static_cast<std::uint8_t>(seed + 100));
  return h;
}
}  // namespace

TEST_SUITE("wire") {

TEST_CASE("frame header round trip for every event") {
  for (auto e : all_events) {
    CAPTURE(w::to_string(e));
    w::FrameHeader h;
    h.event = e;
    h.flags = 0x5A;
    const bool data = e == w::ChannelEvent::xftsmu || e == w::ChannelEvent::xftsmd;
    h.length = data ? w::max_block_size : w::max_control_payload;
    h.offset = 0x0102030405060708ull;
    h.aux = 0xF0E0D0C0B0A09080ull;
    check_header_roundtrip(h);
    // And the small values.
    h.flags = 0;
    h.length = 0;
    h.offset = 0;
    h.aux = 0;
    check_header_roundtrip(h);
    CHECK(w::is_known(static_cast<std::uint8_t>(e)));
    CHECK(std::string(w::to_string(e)) != "?");
  }
}

TEST_CASE("frame header byte layout is little-endian and fixed") {
  w::FrameHeader h;
  h.event = w::ChannelEvent::xftsmu;  // 3
  h.flags = 0x81;
  h.length = 0x00012345;
  h.offset = 0x1122334455667788ull;
  h.aux = 0x0000000000000102ull;
  const auto b = w::encode(h);
  const std::array<std::uint8_t, 24> expected{
      0x03, 0x81, 0x00, 0x00,                          // event, flags, reserved
      0x45, 0x23, 0x01, 0x00,                          // length
      0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,  // offset
      0x02, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // aux
  };
  CHECK(b.size() == w::frame_header_size);
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CAPTURE(i);
    CHECK(b[i] == expected[i]);
  }
  // Decoding the hand-written bytes gives the same header.
  w::HeaderBytes raw{};
  std::memcpy(raw.data(), expected.data(), raw.size());
  auto d = decode_bytes(raw);
  REQUIRE(d);
  CHECK(d->event == w::ChannelEvent::xftsmu);
  CHECK(d->flags == 0x81);
  CHECK(d->length == 0x12345u);
  CHECK(d->offset == 0x1122334455667788ull);
  CHECK(d->aux == 0x102u);
}

TEST_CASE("frame header decode refuses unknown events") {
  for (int raw : {0, 17, 18, 100, 255}) {
    CAPTURE(raw);
    CHECK_FALSE(w::is_known(static_cast<std::uint8_t>(raw)));
    w::FrameHeader h;
    auto b = w::encode(h);
    b[0] = static_cast<std::uint8_t>(raw);
    std::string why;
    CHECK_FALSE(decode_bytes(b, &why).has_value());
    CHECK_FALSE(why.empty());
    CHECK(why.find(std::to_string(raw)) != std::string::npos);
  }
}

TEST_CASE("frame header decode refuses non-zero reserved bytes") {
  for (std::size_t idx : {std::size_t{2}, std::size_t{3}}) {
    for (std::uint8_t v : {std::uint8_t{1}, std::uint8_t{0x80}, std::uint8_t{0xFF}}) {
      CAPTURE(idx);
      CAPTURE(static_cast<int>(v));
      w::FrameHeader h;
      h.event = w::ChannelEvent::ack;
      auto b = w::encode(h);
      b[idx] = v;
      std::string why;
      CHECK_FALSE(decode_bytes(b, &why).has_value());
      CHECK_FALSE(why.empty());
    }
  }
}

TEST_CASE("frame header decode bounds payload lengths") {
  for (auto e : all_events) {
    CAPTURE(w::to_string(e));
    const bool data = e == w::ChannelEvent::xftsmu || e == w::ChannelEvent::xftsmd;
    const bool path = e == w::ChannelEvent::xpathm;
    w::FrameHeader h;
    h.event = e;
    auto b = w::encode(h);
    // Exactly at the limit: accepted. A data frame's limit is the largest block and its tag, so a
    // full block of the largest size still travels sealed.
    const std::uint32_t limit =
        data ? w::max_block_size + w::max_block_tag : path ? w::max_path_payload : w::max_control_payload;
    put_le32(&b[4], limit);
    std::string why;
    auto ok = decode_bytes(b, &why);
    REQUIRE(ok.has_value());
    CHECK(ok->length == limit);
    // One past and far past: refused, with a reason.
    for (std::uint32_t len : {limit + 1, 0xFFFFFFFFu}) {
      CAPTURE(len);
      put_le32(&b[4], len);
      why.clear();
      CHECK_FALSE(decode_bytes(b, &why).has_value());
      CHECK_FALSE(why.empty());
    }
    // A control payload of a data block's size is refused for control frames only (xPathM
    // messages carry batches of file bytes).
    put_le32(&b[4], w::max_control_payload + 1);
    CHECK(decode_bytes(b).has_value() == (data || path));
  }
}

TEST_CASE("preamble round trip and bad magic") {
  for (std::uint16_t v : {std::uint16_t{0}, std::uint16_t{1}, protocol_version, std::uint16_t{0xBEEF}}) {
    const auto p = w::encode_preamble(v);
    CHECK(p[0] == 'x');
    CHECK(p[1] == 'D');
    CHECK(p[2] == 'F');
    CHECK(p[3] == 'S');
    CHECK(p[4] == static_cast<std::uint8_t>(v & 0xFF));
    CHECK(p[5] == static_cast<std::uint8_t>(v >> 8));
    CHECK(p[6] == 0);
    CHECK(p[7] == 0);
    auto d = w::decode_preamble(std::span<const std::uint8_t, w::preamble_size>(p));
    REQUIRE(d.has_value());
    CHECK(*d == v);
  }
  CHECK(w::decode_preamble(std::span<const std::uint8_t, w::preamble_size>(w::encode_preamble())) == protocol_version);
  for (std::size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    auto p = w::encode_preamble();
    p[i] ^= 0x20;  // "xDFS" -> case flipped in one position
    CHECK_FALSE(w::decode_preamble(std::span<const std::uint8_t, w::preamble_size>(p)).has_value());
  }
  const w::PreambleBytes http{'G', 'E', 'T', ' ', '/', ' ', 'H', 'T'};
  CHECK_FALSE(w::decode_preamble(std::span<const std::uint8_t, w::preamble_size>(http)).has_value());
  const w::PreambleBytes zero{};
  CHECK_FALSE(w::decode_preamble(std::span<const std::uint8_t, w::preamble_size>(zero)).has_value());
}

TEST_CASE("opening round trip; what it may claim about joining") {
  const auto o = sample_opening();
  const auto bytes = w::encode(o);
  CHECK(bytes.size() % 8 == 0);
  CHECK(bytes.size() <= w::max_opening_payload);
  std::string why;
  auto d = w::decode_opening(bytes, &why);
  REQUIRE_MESSAGE(d.has_value(), why);
  CHECK(*d == o);
  CHECK(d->session.hex() == o.session.hex());
  // Channel 0 opens the session (Noise XX); every other channel joins it.
  auto first = o;
  first.channel_index = 0;
  first.join = false;
  first.join_nonce.clear();
  auto df = w::decode_opening(w::encode(first));
  REQUIRE(df);
  CHECK(*df == first);
  auto bad = first;
  bad.join = true;
  bad.join_nonce.assign(32, 1);
  CHECK_FALSE(w::decode_opening(w::encode(bad), &why).has_value());
  CHECK(why.find("channel 0 cannot join") != std::string::npos);
  auto lone = o;
  lone.join = false;
  lone.join_nonce.clear();
  CHECK_FALSE(w::decode_opening(w::encode(lone), &why).has_value());
  CHECK(why.find("must join") != std::string::npos);
  auto short_nonce = o;
  short_nonce.join_nonce.resize(31);
  CHECK_FALSE(w::decode_opening(w::encode(short_nonce), &why).has_value());
  CHECK(why.find("join nonce of 31 bytes") != std::string::npos);
  auto strong = o;
  strong.protect = 3;
  CHECK_FALSE(w::decode_opening(w::encode(strong), &why).has_value());
  CHECK(why.find("unknown protection 3") != std::string::npos);
  // Over its own small limit it is refused before Cap'n Proto reads it.
  std::vector<std::uint8_t> big(w::max_opening_payload + 8, 0);
  CHECK_FALSE(w::decode_opening(big, &why).has_value());
  CHECK(why.find("exceeds") != std::string::npos);
}

TEST_CASE("negotiation round trip") {
  const auto n = sample_negotiation();
  const auto bytes = w::encode(n);
  CHECK(bytes.size() % 8 == 0);
  CHECK(bytes.size() <= w::max_negotiation_payload);
  std::string why;
  auto d = w::decode_negotiation(bytes, &why);
  REQUIRE_MESSAGE(d.has_value(), why);
  CHECK(*d == n);

  // Each mode survives, including path.
  for (Mode m : {Mode::upload, Mode::download, Mode::path}) {
    auto n2 = n;
    n2.mode = m;
    auto d2 = w::decode_negotiation(w::encode(n2));
    REQUIRE(d2);
    CHECK(d2->mode == m);
    CHECK(*d2 == n2);
  }
  // Defaults survive too (an empty path, zero fields).
  w::Negotiation def;
  auto dd = w::decode_negotiation(w::encode(def));
  REQUIRE(dd);
  CHECK(*dd == def);
  // A path of exactly max_path_bytes is accepted.
  auto n3 = n;
  n3.remote_path = std::string(w::max_path_bytes, 'p');
  auto d3 = w::decode_negotiation(w::encode(n3));
  REQUIRE(d3);
  CHECK(*d3 == n3);
  // The later fields: a resumed download's, an upload's that starts over, a stream's.
  auto n4 = n;
  n4.transfer = 7;
  n4.resume_offset = 1 << 20;
  n4.source_mtime_ns = -5;
  n4.fresh = true;
  auto d4 = w::decode_negotiation(w::encode(n4));
  REQUIRE(d4);
  CHECK(*d4 == n4);
  auto n5 = n;
  n5.mode = Mode::upload;
  n5.file_size = 0;
  n5.open_ended = true;
  auto d5 = w::decode_negotiation(w::encode(n5));
  REQUIRE(d5);
  CHECK(*d5 == n5);
  CHECK(d5->open_ended);
}

TEST_CASE("a file size or window beyond 2^62 is refused where it is decoded, naming the field") {
  for (std::uint64_t huge : {w::max_file_size + 1, std::uint64_t(1) << 63, ~std::uint64_t(0)}) {
    CAPTURE(huge);
    auto n = sample_negotiation();
    n.file_size = huge;
    std::string why;
    CHECK_FALSE(w::decode_negotiation(w::encode(n), &why).has_value());
    CHECK(why.find("file size") != std::string::npos);
    n = sample_negotiation();
    n.window = huge;
    CHECK_FALSE(w::decode_negotiation(w::encode(n), &why).has_value());
    w::NegotiationReply r{huge, 1 << 20, 1 << 20};
    CHECK_FALSE(w::decode_reply(w::encode(r), &why).has_value());
    CHECK(why.find("file size") != std::string::npos);
  }
  auto n = sample_negotiation();
  n.file_size = w::max_file_size;
  CHECK(w::decode_negotiation(w::encode(n)).has_value());
}

TEST_CASE("negotiation reply and exception header round trips") {
  w::NegotiationReply r{0x1122334455667788ull, 0x19AABBCCDDEEFF00ull, 0x00400000u};
  std::string why;
  auto dr = w::decode_reply(w::encode(r), &why);
  REQUIRE_MESSAGE(dr.has_value(), why);
  CHECK(*dr == r);
  CHECK(dr->file_size == 0x1122334455667788ull);
  CHECK(dr->window == 0x19AABBCCDDEEFF00ull);
  CHECK(dr->block_size == 0x00400000u);
  const w::NegotiationReply later{1, 2, 3, 4, -6, true};
  auto dl = w::decode_reply(w::encode(later));
  REQUIRE(dl.has_value());
  CHECK(*dl == later);
  CHECK(dl->in_place);

  w::ExceptionHeader e{errc::disk_full, "no space left on device while writing 'a/b'", 5, 0xDEADBEEFCAFEull};
  auto de = w::decode_exception(w::encode(e), &why);
  REQUIRE_MESSAGE(de.has_value(), why);
  CHECK(*de == e);

  // Every failure code survives unchanged (0, "ok", is not a failure: see below).
  for (std::uint32_t c = 1; c <= static_cast<std::uint32_t>(xdfs::last_errc); ++c) {
    CAPTURE(c);
    w::ExceptionHeader x{static_cast<errc>(c), "m", 1, 2};
    auto dx = w::decode_exception(w::encode(x));
    REQUIRE(dx);
    CHECK(*dx == x);
  }
}

template <class T, class Decode>
void check_truncations(const T& value, const std::vector<std::uint8_t>& bytes, Decode decode) {
  REQUIRE(bytes.size() > 16);
  std::size_t refused = 0;
  for (std::size_t len = 0; len < bytes.size(); ++len) {
    CAPTURE(len);
    std::string why;
    auto d = decode(std::span<const std::uint8_t>(bytes.data(), len), &why);
    if (d) {
      CHECK_FALSE(*d == value);
    } else {
      ++refused;
      CHECK_FALSE(why.empty());
    }
    if (len % 8 != 0) CHECK_FALSE(d.has_value());  // not whole words: never a message
  }
  CHECK(refused >= bytes.size() - bytes.size() / 8);
}

TEST_CASE("every truncation of an opening or a negotiation is refused or differs") {
  check_truncations(sample_opening(), w::encode(sample_opening()),
                    [](std::span<const std::uint8_t> b, std::string* why) { return w::decode_opening(b, why); });
  check_truncations(sample_negotiation(), w::encode(sample_negotiation()),
                    [](std::span<const std::uint8_t> b, std::string* why) { return w::decode_negotiation(b, why); });
}

TEST_CASE("flipping any byte of an opening or a negotiation never crashes") {
  const auto n = sample_negotiation();
  const auto bytes = w::encode(n);
  std::size_t decoded = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    for (std::uint8_t mask : {std::uint8_t{0xFF}, std::uint8_t{0x01}, std::uint8_t{0x80}}) {
      CAPTURE(i);
      CAPTURE(static_cast<int>(mask));
      auto b = bytes;
      b[i] ^= mask;
      std::string why;
      auto d = w::decode_negotiation(b, &why);
      if (d) {
        ++decoded;
        // Whatever decodes still satisfies the decoder's own checks.
        CHECK(d->remote_path.size() <= w::max_path_bytes);
        CHECK(static_cast<unsigned>(d->mode) <= static_cast<unsigned>(Mode::path));
        CHECK(d->file_size <= w::max_file_size);
        CHECK(d->window <= w::max_file_size);
      } else {
        CHECK_FALSE(why.empty());
      }
    }
  }
  // Flipping a byte inside the path text or a scalar field still decodes: the loop ran.
  CHECK(decoded > 0);
  const auto ob = w::encode(sample_opening());
  std::size_t odecoded = 0;
  for (std::size_t i = 0; i < ob.size(); ++i) {
    auto b = ob;
    b[i] ^= 0xFF;
    std::string why;
    if (auto d = w::decode_opening(b, &why)) {
      ++odecoded;
      CHECK(d->protect <= 2);
      CHECK(d->join == (d->channel_index != 0));
      CHECK(d->join_nonce.size() == (d->join ? 32u : 0u));
    } else {
      CHECK_FALSE(why.empty());
    }
  }
  CHECK(odecoded > 0);
}

TEST_CASE("garbage and empty control messages are refused") {
  std::string why;
  CHECK_FALSE(w::decode_negotiation({}, &why).has_value());
  CHECK_FALSE(why.empty());
  why.clear();
  CHECK_FALSE(w::decode_opening({}, &why).has_value());
  CHECK_FALSE(why.empty());
  why.clear();
  CHECK_FALSE(w::decode_reply({}, &why).has_value());
  CHECK_FALSE(why.empty());
  why.clear();
  CHECK_FALSE(w::decode_exception({}, &why).has_value());
  CHECK_FALSE(why.empty());

  std::mt19937_64 rng(0x5EEDull);
  for (int round = 0; round < 64; ++round) {
    CAPTURE(round);
    std::vector<std::uint8_t> junk(64);
    for (std::size_t i = 0; i < junk.size(); i += 8) {
      const std::uint64_t v = rng();
      put_le64(&junk[i], v);
    }
    why.clear();
    CHECK_FALSE(w::decode_negotiation(junk, &why).has_value());
    CHECK_FALSE(why.empty());
    why.clear();
    CHECK_FALSE(w::decode_opening(junk, &why).has_value());
    CHECK_FALSE(why.empty());
  }

  // Over the negotiation's limit, even if whole words.
  std::vector<std::uint8_t> big(w::max_negotiation_payload + 8, 0);
  CHECK_FALSE(w::decode_negotiation(big, &why).has_value());
  CHECK(why.find("exceeds") != std::string::npos);
  // An oversized but otherwise valid message (a long path) is refused by size.
  auto n = sample_negotiation();
  n.remote_path = std::string(w::max_control_payload, 'x');
  CHECK_FALSE(w::decode_negotiation(w::encode(n)).has_value());
}

TEST_CASE("session GUID of the wrong length is refused") {
  auto n = sample_opening();
  const auto bytes = w::encode(n);
  REQUIRE(w::decode_opening(bytes) == n);
  const auto at = find_byte_list_pointers(bytes, 16);
  REQUIRE(at.size() == 1);
  for (std::uint64_t count : {0ull, 1ull, 8ull, 15ull}) {
    CAPTURE(count);
    auto b = bytes;
    std::uint64_t p = get_le64(&b[at[0]]);
    p = (p & ((1ull << 35) - 1)) | (count << 35);
    put_le64(&b[at[0]], p);
    std::string why;
    CHECK_FALSE(w::decode_opening(b, &why).has_value());
    CHECK(why.find("GUID") != std::string::npos);
  }
  // Longer than the bytes behind the pointer: malformed, refused.
  auto b = bytes;
  std::uint64_t p = get_le64(&b[at[0]]);
  p = (p & ((1ull << 35) - 1)) | (4096ull << 35);
  put_le64(&b[at[0]], p);
  CHECK_FALSE(w::decode_opening(b).has_value());
  // A null GUID pointer (zero bytes) is refused too.
  b = bytes;
  put_le64(&b[at[0]], 0);
  std::string why;
  CHECK_FALSE(w::decode_opening(b, &why).has_value());
  CHECK(why.find("GUID") != std::string::npos);
}

TEST_CASE("unknown mode is refused") {
  auto up = sample_negotiation();
  up.mode = Mode::upload;
  auto down = up;
  down.mode = Mode::download;
  const auto a = w::encode(up);
  const auto b = w::encode(down);
  REQUIRE(a.size() == b.size());
  std::vector<std::size_t> diff;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) diff.push_back(i);
  REQUIRE(diff.size() == 1);  // the mode field, nothing else
  for (std::uint8_t bad : {std::uint8_t{5}, std::uint8_t{7}, std::uint8_t{0xFF}}) {
    auto m = a;
    m[diff[0]] = bad;
    std::string why;
    CHECK_FALSE(w::decode_negotiation(m, &why).has_value());
    CHECK(why.find("mode") != std::string::npos);
  }
  auto m = a;
  m[diff[0]] = 2;
  auto d = w::decode_negotiation(m);
  REQUIRE(d);
  CHECK(d->mode == Mode::path);
}

TEST_CASE("remote path over max_path_bytes is refused") {
  auto n = sample_negotiation();
  n.remote_path = std::string(5000, 'a');
  const auto bytes = w::encode(n);
  REQUIRE(bytes.size() <= w::max_negotiation_payload);
  std::string why;
  CHECK_FALSE(w::decode_negotiation(bytes, &why).has_value());
  CHECK(why.find("5000") != std::string::npos);

  n.remote_path = std::string(w::max_path_bytes + 1, 'b');
  CHECK_FALSE(w::decode_negotiation(w::encode(n)).has_value());
}

TEST_CASE("remote path with a NUL byte inside is refused") {
  // (Found by fuzz_wire: such a path decoded, but encoded again it was cut at the NUL.)
  auto n = sample_negotiation();
  n.remote_path = "dir/abcdefgh";
  const auto bytes = w::encode(n);
  const std::string needle = "abcdefgh";
  auto at = std::search(bytes.begin(), bytes.end(), needle.begin(), needle.end());
  REQUIRE(at != bytes.end());
  auto b = bytes;
  b[static_cast<std::size_t>(at - bytes.begin()) + 3] = 0;
  std::string why;
  CHECK_FALSE(w::decode_negotiation(b, &why).has_value());
  CHECK(why.find("NUL") != std::string::npos);
}

TEST_CASE("exception message is one bounded, escaped line") {
  w::ExceptionHeader e;
  e.code = errc::io_error;
  e.channel_index = 2;
  e.offset = 4096;
  std::string msg;
  for (int i = 0; i < 100; ++i) msg += "line " + std::to_string(i) + "\n\r\t";
  REQUIRE(msg.size() > 512);
  e.message = msg;
  auto d = w::decode_exception(w::encode(e));
  REQUIRE(d);
  CHECK(d->message.find('\n') == std::string::npos);
  CHECK(d->message.find('\r') == std::string::npos);
  for (char c : d->message) CHECK(static_cast<unsigned char>(c) >= 0x20);
  // Cut to 512 bytes first, then each control character shown as its escape.
  CHECK(d->message.rfind("line 0\\n\\r\\tline 1\\n", 0) == 0);
  CHECK(d->code == errc::io_error);
  CHECK(d->channel_index == 2);
  CHECK(d->offset == 4096);

  // A forged log line stays on the line it came in.
  e.message = "disk\n2026-01-01T00:00:00Z xdfsd: session ok";
  d = w::decode_exception(w::encode(e));
  REQUIRE(d);
  CHECK(d->message == "disk\\n2026-01-01T00:00:00Z xdfsd: session ok");

  // DEL, an escape sequence, a C1 control and bytes that are not UTF-8 are escaped too; a cut
  // never splits a UTF-8 sequence.
  e.message = std::string("a\x7f") + "b\x1b[2Jc\xc2\x9b" "d\xff";
  d = w::decode_exception(w::encode(e));
  REQUIRE(d);
  CHECK(d->message == "a\\x7fb\\x1b[2Jc\\xc2\\x9bd\\xff");
  std::string utf;
  while (utf.size() < 600) utf += "\xc3\xa9";  // é, two bytes each; 511 is mid-sequence
  e.message = "x" + utf;
  d = w::decode_exception(w::encode(e));
  REQUIRE(d);
  CHECK(d->message.size() == 511);
  CHECK((static_cast<unsigned char>(d->message.back()) & 0xC0) != 0xC0);  // ends on a whole character
}

TEST_CASE("unknown exception code maps to protocol_error") {
  CHECK(errc_from_wire(10) == errc::io_error);
  CHECK(errc_from_wire(static_cast<std::uint32_t>(errc::cancelled)) == errc::cancelled);
  CHECK(errc_from_wire(static_cast<std::uint32_t>(xdfs::last_errc) + 1) == errc::protocol_error);
  CHECK(errc_from_wire(999) == errc::protocol_error);
  CHECK(errc_from_wire(0xFFFFFFFFu) == errc::protocol_error);
  // "ok" in an exception header is a lie: it must not turn a failure into a success.
  CHECK(errc_from_wire(0) == errc::protocol_error);
  auto ok_claim = w::decode_exception(w::encode(w::ExceptionHeader{errc::ok, "x", 0, 0}));
  REQUIRE(ok_claim);
  CHECK(ok_claim->code != errc::ok);

  for (std::uint32_t code : {static_cast<std::uint32_t>(xdfs::last_errc) + 1, 999u, 0x80000000u, 0xFFFFFFFFu}) {
    CAPTURE(code);
    w::ExceptionHeader e{static_cast<errc>(code), "boom", 1, 2};
    auto d = w::decode_exception(w::encode(e));
    REQUIRE(d);
    CHECK(d->code == errc::protocol_error);
    CHECK(d->message == "boom");
  }
}

TEST_CASE("check_relative_path") {
  for (const char* ok : {"a", "a/b.txt", "a/./b", "..foo", "foo..", "a/..b/c", ".../x", "a.b/c..d"}) {
    CAPTURE(ok);
    auto s = files::check_relative_path(ok);
    CHECK(static_cast<bool>(s));
    CHECK(s.code == errc::ok);
  }
  {
    auto s = files::check_relative_path("");
    CHECK_FALSE(static_cast<bool>(s));
    CHECK(s.code == errc::bad_argument);
    CHECK_FALSE(s.message.empty());
  }
  for (const char* bad : {"/etc/passwd", "/", "..", "a/../b", "a/..", "../x", "a/b/../../..", "./.."}) {
    CAPTURE(bad);
    auto s = files::check_relative_path(bad);
    CHECK_FALSE(static_cast<bool>(s));
    CHECK(s.code == errc::path_escape);
    CHECK_FALSE(s.message.empty());
  }
  {
    std::string nul("a/b");
    nul.push_back('\0');
    nul += "c";
    auto s = files::check_relative_path(nul);
    CHECK_FALSE(static_cast<bool>(s));
    CHECK(s.code == errc::bad_argument);
    CHECK_FALSE(s.message.empty());
  }
  {
    auto s = files::check_relative_path(std::string(5000, 'a'));
    CHECK_FALSE(static_cast<bool>(s));
    CHECK(s.code == errc::bad_argument);
  }
  {
    auto s = files::check_relative_path(std::string(w::max_path_bytes, 'a'));
    CHECK(static_cast<bool>(s));
  }
}

TEST_CASE("pull: a pull's port and name travel whole; a bad one is refused with its cause") {
  auto n = sample_negotiation();
  n.mode = Mode::pull;
  n.pull_port = 40123;
  n.pull_name = "big.iso";
  auto d = w::decode_negotiation(w::encode(n));
  REQUIRE(d);
  CHECK(*d == n);
  auto set = n;
  set.pull_set = true;
  d = w::decode_negotiation(w::encode(set));
  REQUIRE(d);
  CHECK(d->pull_set);
  struct Bad {
    std::uint16_t port;
    std::string name;
  };
  for (const auto& b : {Bad{0, "big.iso"}, Bad{1, ""}, Bad{1, "a/b"}, Bad{1, ".."}, Bad{1, "."},
                        Bad{1, std::string(256, 'x')}}) {
    auto m = n;
    m.pull_port = b.port;
    m.pull_name = b.name;
    std::string why;
    CHECK_FALSE(w::decode_negotiation(w::encode(m), &why).has_value());
    CHECK(why.find("pull") != std::string::npos);
  }
  // Only a pull carries them: an upload naming a pull port is refused (a pull's bytes with the
  // mode changed: encode() writes them only for a pull).
  // (The mode's byte: where an upload and a download differ, at the same place in any
  // negotiation, its data section being of fixed layout.)
  auto up = sample_negotiation();
  up.mode = Mode::upload;
  auto down = up;
  down.mode = Mode::download;
  const auto a = w::encode(up);
  const auto c = w::encode(down);
  REQUIRE(a.size() == c.size());
  const auto mode_at = static_cast<std::size_t>(std::mismatch(a.begin(), a.end(), c.begin()).first - a.begin());
  auto m = w::encode(n);
  REQUIRE(m[mode_at] == static_cast<std::uint8_t>(Mode::pull));
  m[mode_at] = static_cast<std::uint8_t>(Mode::upload);
  std::string why;
  CHECK_FALSE(w::decode_negotiation(m, &why).has_value());
  CHECK(why.find("only with a pull") != std::string::npos);
  // The set flag alone too (no port, no name).
  auto flag = n;
  flag.pull_port = 0;
  flag.pull_name.clear();
  flag.pull_set = true;
  auto f = w::encode(flag);
  REQUIRE(f[mode_at] == static_cast<std::uint8_t>(Mode::pull));
  f[mode_at] = static_cast<std::uint8_t>(Mode::upload);
  why.clear();
  CHECK_FALSE(w::decode_negotiation(f, &why).has_value());
  CHECK(why.find("only with a pull") != std::string::npos);
}

TEST_CASE("pull: a set's part and its plan travel whole, both ways; a bad one is refused with its cause") {
  auto n = sample_negotiation();
  n.mode = Mode::pull;
  n.pull_port = 40123;
  n.pull_name = ".xdfs-set-3";
  n.pull_set = true;
  n.pull_parts = true;
  n.pull_part = 3;
  n.pull_plan.assign(32, 0xa5);
  n.pull_links = true;
  auto d = w::decode_negotiation(w::encode(n));
  REQUIRE(d);
  CHECK(*d == n);
  {
    auto m = n;  // directories and symlinks only with parts
    m.pull_parts = false;
    m.pull_part = 0;
    m.pull_plan.clear();
    std::string why;
    CHECK_FALSE(w::decode_negotiation(w::encode(m), &why).has_value());
    CHECK(why.find("directories and symlinks only in parts") != std::string::npos);
    m.pull_links = false;
    CHECK(w::decode_negotiation(w::encode(m)).has_value());
  }
  struct Bad {
    bool set, parts;
    std::uint32_t part;
    std::size_t plan;
  };
  // A part without the set, a part past the first without its plan (or with a plan of another
  // size, or with parts off), a part past the most a set has, a plan on the first part.
  for (const auto& b : {Bad{false, true, 0, 0}, Bad{true, true, 1, 0}, Bad{true, true, 1, 31}, Bad{true, false, 1, 32},
                        Bad{true, true, w::max_set_parts, 32}, Bad{true, true, 0, 32}}) {
    auto m = n;
    m.pull_set = b.set;
    m.pull_parts = b.parts;
    m.pull_part = b.part;
    m.pull_plan.assign(b.plan, 1);
    std::string why;
    CHECK_FALSE(w::decode_negotiation(w::encode(m), &why).has_value());
    CHECK(why.find("part") != std::string::npos);
  }
  w::NegotiationReply r;
  r.file_size = 17 << 20;
  r.block_size = 1 << 18;
  r.set_parts = 9;
  r.set_plan.assign(32, 7);
  r.set_path = "a/b/huge.bin";
  r.set_bytes = 1ull << 40;
  auto dr = w::decode_reply(w::encode(r));
  REQUIRE(dr);
  CHECK(*dr == r);
  auto old = r;  // an older master's answer: no parts
  old.set_parts = 0;
  old.set_plan.clear();
  old.set_path.clear();
  old.set_bytes = 0;
  dr = w::decode_reply(w::encode(old));
  REQUIRE(dr);
  CHECK(*dr == old);
  for (int k = 0; k < 4; ++k) {
    auto m = r;
    if (k == 0) m.set_parts = w::max_set_parts + 1;
    if (k == 1) m.set_plan.resize(31);
    if (k == 2) m.set_path.assign(4097, 'a');
    if (k == 3) m.set_bytes = w::max_file_size + 1;
    std::string why;
    CHECK_FALSE(w::decode_reply(w::encode(m), &why).has_value());
    CHECK_FALSE(why.empty());
  }
}

TEST_CASE("relay: a plan, a report and a relink travel whole") {
  auto n = sample_negotiation();
  n.mode = Mode::relay;
  n.relay_plan.ticket.fill(7);
  n.relay_plan.protect = 1;
  n.relay_plan.channels = 8;
  n.relay_plan.mode = 0640;
  n.relay_plan.pack = true;
  n.relay_plan.pack_digest.fill(0x3c);
  for (std::uint8_t i = 1; i <= w::max_relay_hops; ++i) n.relay_plan.next.push_back(sample_hop(i));
  n.remote_path = std::string(w::max_path_bytes, 'p');
  auto bytes = w::encode(n);
  CHECK(bytes.size() <= w::max_negotiation_payload);  // fits the handshake with the longest path
  std::string why;
  auto d = w::decode_negotiation(bytes, &why);
  REQUIRE_MESSAGE(d.has_value(), why);
  CHECK(*d == n);

  auto up = sample_negotiation();
  up.mode = Mode::upload;
  up.relay_ticket.assign(32, 9);
  auto du = w::decode_negotiation(w::encode(up), &why);
  REQUIRE(du.has_value());
  CHECK(du->relay_ticket == up.relay_ticket);

  w::RelayReport r;
  r.verified = 123456789;
  r.forwarded = 1234;
  r.state = w::RelayReport::State::whole;
  r.code = errc::ok;
  r.digest.assign(32, 0xAB);
  r.next = 2;
  r.skipped.push_back({1, errc::connection_refused, "refused"});
  r.forwarding = true;
  r.upstream.assign(32, 3);
  r.upstream_code = errc::integrity_error;
  r.upstream_message = "block at offset 0 does not match its digest";
  r.relinks = 5;
  auto dr = w::decode_report(w::encode(r), &why);
  REQUIRE_MESSAGE(dr.has_value(), why);
  CHECK(*dr == r);

  std::vector<w::RelayHop> hops{sample_hop(4), sample_hop(5)};
  auto dl = w::decode_relink(w::encode_relink(hops), &why);
  REQUIRE_MESSAGE(dl.has_value(), why);
  CHECK(*dl == hops);
}

TEST_CASE("relay: malformed plans, tickets, reports and relinks are refused with their cause") {
  std::string why;
  auto relay = sample_negotiation();
  relay.mode = Mode::relay;
  relay.relay_plan.next.push_back(sample_hop(1));

  SUBCASE("more hops than a plan may name") {
    auto n = relay;
    for (std::uint8_t i = 0; i < w::max_relay_hops; ++i) n.relay_plan.next.push_back(sample_hop(i));
    CHECK_FALSE(w::decode_negotiation(w::encode(n), &why).has_value());
    CHECK(why.find("hops") != std::string::npos);
    CHECK_FALSE(w::decode_relink(w::encode_relink(n.relay_plan.next), &why).has_value());
  }
  SUBCASE("a hop without an address, or with an address too long") {
    for (std::string a : {std::string(), std::string(w::max_relay_address + 1, 'a')}) {
      auto n = relay;
      n.relay_plan.next[0].address = a;
      CHECK_FALSE(w::decode_negotiation(w::encode(n), &why).has_value());
      CHECK(why.find("address") != std::string::npos);
    }
  }
  SUBCASE("an unknown protection for the hops downstream") {
    auto n = relay;
    n.relay_plan.protect = 3;
    CHECK_FALSE(w::decode_negotiation(w::encode(n), &why).has_value());
    CHECK(why.find("protection") != std::string::npos);
  }
  SUBCASE("a file mode beyond the permission bits (setuid, sticky)") {
    for (std::uint32_t m : {01000u, 04755u, 0xffffffffu}) {
      auto n = relay;
      n.relay_plan.mode = m;
      CHECK_FALSE(w::decode_negotiation(w::encode(n), &why).has_value());
      CHECK(why.find("mode") != std::string::npos);
    }
  }
  SUBCASE("a relay ticket with a download, a stream, or of the wrong size") {
    auto n = sample_negotiation();
    n.mode = Mode::download;
    n.relay_ticket.assign(32, 1);
    CHECK_FALSE(w::decode_negotiation(w::encode(n), &why).has_value());
    n.mode = Mode::upload;
    n.relay_ticket.assign(31, 1);
    CHECK_FALSE(w::decode_negotiation(w::encode(n), &why).has_value());
    n.relay_ticket.assign(32, 1);
    n.open_ended = true;
    n.file_size = 0;
    CHECK_FALSE(w::decode_negotiation(w::encode(n), &why).has_value());
    CHECK(why.find("ticket") != std::string::npos);
  }
  SUBCASE("a report with an unknown state, a digest or key of the wrong size, too many skips") {
    w::RelayReport r;
    r.digest.assign(31, 1);
    CHECK_FALSE(w::decode_report(w::encode(r), &why).has_value());
    r.digest.clear();
    r.upstream.assign(33, 1);
    CHECK_FALSE(w::decode_report(w::encode(r), &why).has_value());
    r.upstream.clear();
    for (std::uint32_t i = 0; i <= w::max_relay_hops; ++i) r.skipped.push_back({i, errc::timeout, "x"});
    CHECK_FALSE(w::decode_report(w::encode(r), &why).has_value());
    r.skipped.clear();
    auto bytes = w::encode(r);
    auto ok = w::decode_report(bytes, &why);
    REQUIRE(ok.has_value());
    r.state = static_cast<w::RelayReport::State>(9);
    CHECK_FALSE(w::decode_report(w::encode(r), &why).has_value());
    CHECK(why.find("state") != std::string::npos);
  }
  SUBCASE("a report's messages come out as one bounded, escaped line") {
    w::RelayReport r;
    r.message = "line\nforged\x1b[2J" + std::string(2000, 'x');
    r.upstream_message = "a\rb";
    auto d = w::decode_report(w::encode(r), &why);
    REQUIRE(d.has_value());
    CHECK(d->message.find('\n') == std::string::npos);
    CHECK(d->message.find('\x1b') == std::string::npos);
    CHECK(d->message.size() < 600);
    CHECK(d->upstream_message.find('\r') == std::string::npos);
  }
}

}  // TEST_SUITE("wire")

// ---- units ----

namespace {
template <class A, class B>
concept addable = requires(A a, B b) { a + b; };
template <class A, class B>
concept comparable = requires(A a, B b) { a == b; };

// A frame length, a data length, a tag, an offset and a channel index do not mix, and a raw
// integer becomes one only by naming it: each line below would compile if they did.
static_assert(!std::is_convertible_v<DataLength, FrameLength>);
static_assert(!std::is_convertible_v<FrameLength, DataLength>);
static_assert(!std::is_convertible_v<std::uint32_t, DataLength>);
static_assert(!std::is_convertible_v<DataLength, std::uint32_t>);
static_assert(!std::is_convertible_v<std::uint64_t, FileOffset>);
static_assert(!std::is_convertible_v<std::uint32_t, ChannelIndex>);
static_assert(!addable<DataLength, TagLength>);
static_assert(!addable<FileOffset, DataLength>);
static_assert(!addable<DataLength, std::uint32_t>);
static_assert(!comparable<DataLength, FrameLength>);
static_assert(!comparable<FileOffset, std::uint64_t>);
static_assert(comparable<DataLength, DataLength>);
}  // namespace

TEST_CASE("units: a frame is its data and its tag; blocks sit where the block size says; offsets do not wrap") {
  const TagLength tag(16), none(0);
  CHECK(framed(DataLength(4096), tag) == FrameLength(4112));
  CHECK(framed(DataLength(4096), none) == FrameLength(4096));
  CHECK(unframed(FrameLength(4112), tag) == DataLength(4096));
  CHECK(unframed(FrameLength(17), tag) == DataLength(1));
  // No block is empty: a frame no longer than its tag carries nothing.
  CHECK_FALSE(unframed(FrameLength(16), tag).has_value());
  CHECK_FALSE(unframed(FrameLength(3), tag).has_value());
  CHECK_FALSE(unframed(FrameLength(0), none).has_value());
  const DataLength bs(1 << 20);
  const std::uint64_t size = (5u << 20) + 7;
  CHECK(block_at(FileOffset(0), size, bs) == bs);
  CHECK(block_at(FileOffset(5u << 20), size, bs) == DataLength(7));
  CHECK_FALSE(block_at(FileOffset(1), size, bs).has_value());          // not aligned
  CHECK_FALSE(block_at(FileOffset(6u << 20), size, bs).has_value());   // past the end
  CHECK_FALSE(block_at(FileOffset(0), 0, bs).has_value());             // an empty file has no block
  CHECK_FALSE(block_at(FileOffset(0), size, DataLength(0)).has_value());
  CHECK(block_at(FileOffset(UINT64_MAX - (UINT64_MAX % (1 << 20))), UINT64_MAX, bs).has_value());
  CHECK(after(FileOffset(10), DataLength(5)) == FileOffset(15));
  CHECK(after(FileOffset(UINT64_MAX - 5), DataLength(5)) == FileOffset(UINT64_MAX));
  CHECK_FALSE(after(FileOffset(UINT64_MAX - 4), DataLength(5)).has_value());
}
