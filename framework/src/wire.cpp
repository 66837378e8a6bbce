#include "xdfs/wire.hpp"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstring>

#include "xdfs/text.hpp"
#include "xdopi.capnp.h"

namespace xdfs::wire {
namespace {

void put_u16(std::uint8_t* p, std::uint16_t v) noexcept {
  p[0] = static_cast<std::uint8_t>(v);
  p[1] = static_cast<std::uint8_t>(v >> 8);
}
void put_u32(std::uint8_t* p, std::uint32_t v) noexcept {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
void put_u64(std::uint8_t* p, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint16_t get_u16(const std::uint8_t* p) noexcept {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}
std::uint32_t get_u32(const std::uint8_t* p) noexcept {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
std::uint64_t get_u64(const std::uint8_t* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void set_why(std::string* why, std::string text) {
  if (why) *why = std::move(text);
}

std::vector<std::uint8_t> to_bytes(capnp::MessageBuilder& msg) {
  auto words = capnp::messageToFlatArray(msg);
  auto bytes = words.asBytes();
  return {bytes.begin(), bytes.end()};
}

// Cap'n Proto reads whole words from aligned memory; copy the untrusted bytes into such a buffer.
// The traversal limit caps the work a hostile message can cause at a few times its own size.
template <class Root, class Fn>
auto read_message(std::span<const std::uint8_t> b, std::string* why, Fn&& fn)
    -> decltype(fn(std::declval<typename Root::Reader>())) {
  if (b.empty() || b.size() % sizeof(capnp::word) != 0 || b.size() > max_control_payload) {
    set_why(why, "control message of " + std::to_string(b.size()) + " bytes is not a whole message");
    return std::nullopt;
  }
  kj::Array<capnp::word> words = kj::heapArray<capnp::word>(b.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), b.data(), b.size());
  capnp::ReaderOptions opts;
  opts.traversalLimitInWords = 4 * words.size() + 64;
  opts.nestingLimit = 8;
  try {
    capnp::FlatArrayMessageReader reader(words.asPtr(), opts);
    return fn(reader.getRoot<Root>());
  } catch (const kj::Exception& e) {
    set_why(why, std::string("malformed control message: ") + e.getDescription().cStr());
    return std::nullopt;
  }
}

}  // namespace

const char* to_string(ChannelEvent e) noexcept {
  switch (e) {
    case ChannelEvent::nego: return "NEGO";
    case ChannelEvent::nego_reply: return "NEGO_REPLY";
    case ChannelEvent::xftsmu: return "xFTSMU";
    case ChannelEvent::xftsmd: return "xFTSMD";
    case ChannelEvent::xpathm: return "xPathM";
    case ChannelEvent::eofr: return "EOFR";
    case ChannelEvent::eoft: return "EOFT";
    case ChannelEvent::noop: return "NOOP";
    case ChannelEvent::conm: return "CONM";
    case ChannelEvent::zxdfs: return "ZxDFS";
    case ChannelEvent::ack: return "ACK";
    case ChannelEvent::exception: return "EXCEPTION";
    case ChannelEvent::handshake: return "HANDSHAKE";
    case ChannelEvent::nack: return "NACK";
  }
  return "?";
}

bool is_known(std::uint8_t raw) noexcept {
  return raw >= static_cast<std::uint8_t>(ChannelEvent::nego) && raw <= static_cast<std::uint8_t>(ChannelEvent::nack);
}

HeaderBytes encode(const FrameHeader& h) noexcept {
  HeaderBytes b{};
  b[0] = static_cast<std::uint8_t>(h.event);
  b[1] = h.flags;
  put_u16(&b[2], 0);
  put_u32(&b[4], h.length);
  put_u64(&b[8], h.offset);
  put_u64(&b[16], h.aux);
  return b;
}

std::optional<FrameHeader> decode(std::span<const std::uint8_t, frame_header_size> b, std::string* why) noexcept {
  if (!is_known(b[0])) {
    set_why(why, "unknown channel event " + std::to_string(b[0]));
    return std::nullopt;
  }
  if (get_u16(&b[2]) != 0) {
    set_why(why, "reserved header bits set");
    return std::nullopt;
  }
  FrameHeader h;
  h.event = static_cast<ChannelEvent>(b[0]);
  h.flags = b[1];
  h.length = get_u32(&b[4]);
  h.offset = get_u64(&b[8]);
  h.aux = get_u64(&b[16]);
  const bool data = h.event == ChannelEvent::xftsmu || h.event == ChannelEvent::xftsmd;
  if (h.event == ChannelEvent::xpathm) {
    if (h.length > max_path_payload) {
      set_why(why, "xPathM payload of " + std::to_string(h.length) + " bytes exceeds the " +
                       std::to_string(max_path_payload) + "-byte limit");
      return std::nullopt;
    }
    return h;
  }
  if (!data && h.length > max_control_payload) {
    set_why(why, std::string(to_string(h.event)) + " payload of " + std::to_string(h.length) +
                     " bytes exceeds the " + std::to_string(max_control_payload) + "-byte limit");
    return std::nullopt;
  }
  if (data && h.length > max_block_size + max_block_tag) {
    set_why(why, "data block of " + std::to_string(h.length) + " bytes exceeds the maximum block size");
    return std::nullopt;
  }
  return h;
}

PreambleBytes encode_preamble(std::uint16_t version) noexcept {
  PreambleBytes b{};
  std::memcpy(b.data(), magic.data(), magic.size());
  put_u16(&b[4], version);
  put_u16(&b[6], 0);
  return b;
}

std::optional<std::uint16_t> decode_preamble(std::span<const std::uint8_t, preamble_size> b) noexcept {
  if (std::memcmp(b.data(), magic.data(), magic.size()) != 0) return std::nullopt;
  return get_u16(&b[4]);
}

std::vector<std::uint8_t> encode(const Opening& o) {
  capnp::MallocMessageBuilder msg;
  auto r = msg.initRoot<schema::Opening>();
  r.setVersion(o.version);
  r.setSessionGuid(kj::arrayPtr(o.session.bytes.data(), o.session.bytes.size()));
  r.setChannelIndex(o.channel_index);
  r.setProtect(o.protect);
  r.setCipher(o.cipher);
  r.setJoin(o.join);
  r.setJoinNonce(kj::arrayPtr(o.join_nonce.data(), o.join_nonce.size()));
  return to_bytes(msg);
}

std::vector<std::uint8_t> encode(const Negotiation& n) {
  capnp::MallocMessageBuilder msg;
  auto r = msg.initRoot<schema::Negotiation>();
  r.setChannelCount(n.channel_count);
  r.setMode(static_cast<schema::Mode>(n.mode));
  r.setRemotePath(n.remote_path);
  r.setBlockSize(n.block_size);
  r.setTcpWindow(n.tcp_window);
  r.setExtendedFlags(n.extended_flags);
  r.setFileSize(n.file_size);
  r.setWindow(n.window);
  r.setTransfer(n.transfer);
  r.setResumeOffset(n.resume_offset);
  r.setSourceMtime(n.source_mtime_ns);
  r.setFresh(n.fresh);
  r.setOpenEnded(n.open_ended);
  return to_bytes(msg);
}

std::vector<std::uint8_t> encode(const NegotiationReply& n) {
  capnp::MallocMessageBuilder msg;
  auto r = msg.initRoot<schema::NegotiationReply>();
  r.setFileSize(n.file_size);
  r.setWindow(n.window);
  r.setBlockSize(n.block_size);
  r.setResumeOffset(n.resume_offset);
  r.setMtime(n.mtime_ns);
  r.setInPlace(n.in_place);
  return to_bytes(msg);
}

std::vector<std::uint8_t> encode(const ExceptionHeader& e) {
  capnp::MallocMessageBuilder msg;
  auto r = msg.initRoot<schema::ExceptionHeader>();
  r.setCode(static_cast<std::uint32_t>(e.code));
  r.setMessage(e.message);
  r.setChannelIndex(e.channel_index);
  r.setOffset(e.offset);
  r.setRefused(e.refused);
  return to_bytes(msg);
}

std::optional<Opening> decode_opening(std::span<const std::uint8_t> b, std::string* why) {
  if (b.size() > max_opening_payload) {
    set_why(why, "opening of " + std::to_string(b.size()) + " bytes exceeds the " +
                     std::to_string(max_opening_payload) + "-byte limit");
    return std::nullopt;
  }
  return read_message<schema::Opening>(b, why, [&](schema::Opening::Reader r) -> std::optional<Opening> {
    Opening o;
    o.version = r.getVersion();
    auto guid = r.getSessionGuid();
    if (guid.size() != o.session.bytes.size()) {
      set_why(why, "session GUID must be 16 bytes, got " + std::to_string(guid.size()));
      return std::nullopt;
    }
    std::memcpy(o.session.bytes.data(), guid.begin(), guid.size());
    o.channel_index = r.getChannelIndex();
    o.protect = r.getProtect();
    o.cipher = r.getCipher();
    if (o.protect > 2 || o.cipher > 1) {
      set_why(why, "unknown protection " + std::to_string(o.protect) + " or cipher " + std::to_string(o.cipher));
      return std::nullopt;
    }
    o.join = r.getJoin();
    auto jn = r.getJoinNonce();
    if (o.join ? jn.size() != 32 : jn.size() != 0) {
      set_why(why, "join nonce of " + std::to_string(jn.size()) + " bytes");
      return std::nullopt;
    }
    if (o.join != (o.channel_index != 0)) {
      set_why(why, o.join ? "channel 0 cannot join: it opens the session" : "channel " + std::to_string(o.channel_index) +
                                                                               " must join the session of channel 0");
      return std::nullopt;
    }
    o.join_nonce.assign(jn.begin(), jn.end());
    return o;
  });
}

std::optional<Negotiation> decode_negotiation(std::span<const std::uint8_t> b, std::string* why) {
  if (b.size() > max_negotiation_payload) {
    set_why(why, "negotiation of " + std::to_string(b.size()) + " bytes exceeds the " +
                     std::to_string(max_negotiation_payload) + "-byte limit");
    return std::nullopt;
  }
  return read_message<schema::Negotiation>(b, why, [&](schema::Negotiation::Reader r) -> std::optional<Negotiation> {
    Negotiation n;
    n.channel_count = r.getChannelCount();
    auto mode = static_cast<unsigned>(r.getMode());
    if (mode > static_cast<unsigned>(Mode::path)) {
      set_why(why, "unknown mode " + std::to_string(mode));
      return std::nullopt;
    }
    n.mode = static_cast<Mode>(mode);
    auto path = r.getRemotePath();
    if (!check_text({path.cStr(), path.size()}, "remote path", why)) return std::nullopt;
    n.remote_path.assign(path.cStr(), path.size());
    n.block_size = r.getBlockSize();
    n.tcp_window = r.getTcpWindow();
    n.extended_flags = r.getExtendedFlags();
    n.file_size = r.getFileSize();
    n.window = r.getWindow();
    n.transfer = r.getTransfer();
    n.resume_offset = r.getResumeOffset();
    n.source_mtime_ns = r.getSourceMtime();
    n.fresh = r.getFresh();
    n.open_ended = r.getOpenEnded();
    if (n.open_ended && (n.mode != Mode::upload || n.file_size != 0)) {
      set_why(why, n.mode != Mode::upload ? "only an upload is open-ended" : "an open-ended upload declares a size");
      return std::nullopt;
    }
    if (n.resume_offset > n.file_size) {
      set_why(why, "resume offset " + std::to_string(n.resume_offset) + " is beyond the file size " +
                       std::to_string(n.file_size));
      return std::nullopt;
    }
    if (n.file_size > max_file_size || n.window > max_file_size) {
      set_why(why, "file size " + std::to_string(n.file_size) + " or window " + std::to_string(n.window) +
                       " exceeds the protocol's limit of 2^62 bytes");
      return std::nullopt;
    }
    return n;
  });
}

std::optional<NegotiationReply> decode_reply(std::span<const std::uint8_t> b, std::string* why) {
  return read_message<schema::NegotiationReply>(b, why, [&](schema::NegotiationReply::Reader r) -> std::optional<NegotiationReply> {
    NegotiationReply n{r.getFileSize(), r.getWindow(), r.getBlockSize(), r.getResumeOffset(), r.getMtime(),
                       r.getInPlace()};
    if (n.file_size > max_file_size || n.window > max_file_size || n.resume_offset > max_file_size) {
      set_why(why, "file size " + std::to_string(n.file_size) + " or window " + std::to_string(n.window) +
                       " exceeds the protocol's limit of 2^62 bytes");
      return std::nullopt;
    }
    return n;
  });
}

std::optional<ExceptionHeader> decode_exception(std::span<const std::uint8_t> b, std::string* why) {
  return read_message<schema::ExceptionHeader>(b, why, [&](schema::ExceptionHeader::Reader r) -> std::optional<ExceptionHeader> {
    ExceptionHeader e;
    e.code = errc_from_wire(r.getCode());
    auto msg = r.getMessage();
    // Keep what we show a user to one bounded line.
    std::size_t len = std::min<std::size_t>(msg.size(), 512);
    // Never cut a UTF-8 sequence in half: back up over continuation bytes.
    if (len < msg.size())
      while (len > 0 && (static_cast<unsigned char>(msg.cStr()[len]) & 0xC0) == 0x80) --len;
    // One printable line: a peer must not be able to forge log lines or drive a terminal.
    e.message = text::escape({msg.cStr(), len});
    e.channel_index = r.getChannelIndex();
    e.offset = r.getOffset();
    e.refused = r.getRefused();
    return e;
  });
}

bool check_text(std::string_view text, const char* what, std::string* why) {
  if (text.size() > max_path_bytes) {
    set_why(why, std::string(what) + " of " + std::to_string(text.size()) + " bytes is longer than " +
                     std::to_string(max_path_bytes));
    return false;
  }
  if (text.find('\0') != std::string_view::npos) {
    set_why(why, std::string(what) + " contains a NUL byte");
    return false;
  }
  return true;
}

}  // namespace xdfs::wire
