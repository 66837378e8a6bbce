#include "xdfs/wire.hpp"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstdio>
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
    case ChannelEvent::report: return "REPORT";
    case ChannelEvent::relink: return "RELINK";
  }
  return "?";
}

bool is_known(std::uint8_t raw) noexcept {
  return raw >= static_cast<std::uint8_t>(ChannelEvent::nego) && raw <= static_cast<std::uint8_t>(ChannelEvent::relink);
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

// A relay's hops, both ways (a plan's and a RELINK's).
static void put_hops(capnp::List<schema::RelayHop>::Builder out, const std::vector<RelayHop>& hops) {
  for (unsigned i = 0; i < out.size(); ++i) {
    const auto& h = hops[i];
    out[i].setAddress(h.address);
    out[i].setServerKey(kj::arrayPtr(h.server_key.data(), h.server_key.size()));
    out[i].setTicket(kj::arrayPtr(h.ticket.data(), h.ticket.size()));
  }
}

static std::optional<std::vector<RelayHop>> get_hops(capnp::List<schema::RelayHop>::Reader hops, std::string* why) {
  if (hops.size() > max_relay_hops) {
    set_why(why, "relay plan names " + std::to_string(hops.size()) + " hops, at most " + std::to_string(max_relay_hops));
    return std::nullopt;
  }
  std::vector<RelayHop> out;
  for (auto h : hops) {
    RelayHop hop;
    auto a = h.getAddress();
    auto k = h.getServerKey();
    auto ht = h.getTicket();
    if (a.size() == 0 || a.size() > max_relay_address ||
        std::string_view(a.cStr(), a.size()).find('\0') != std::string_view::npos || k.size() != hop.server_key.size() ||
        ht.size() != hop.ticket.size()) {
      set_why(why, "a relay hop needs an address of 1.." + std::to_string(max_relay_address) +
                       " bytes, a 32-byte server key and a 32-byte ticket");
      return std::nullopt;
    }
    hop.address.assign(a.cStr(), a.size());
    std::memcpy(hop.server_key.data(), k.begin(), k.size());
    std::memcpy(hop.ticket.data(), ht.begin(), ht.size());
    out.push_back(std::move(hop));
  }
  return out;
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
  r.setRelayTicket(kj::arrayPtr(n.relay_ticket.data(), n.relay_ticket.size()));
  if (n.mode == Mode::relay) {
    auto plan = r.initRelayPlan();
    plan.setTicket(kj::arrayPtr(n.relay_plan.ticket.data(), n.relay_plan.ticket.size()));
    plan.setProtect(n.relay_plan.protect);
    plan.setChannels(n.relay_plan.channels);
    plan.setMode(n.relay_plan.mode);
    plan.setPack(n.relay_plan.pack);
    if (n.relay_plan.pack)
      plan.setPackDigest(kj::arrayPtr(n.relay_plan.pack_digest.data(), n.relay_plan.pack_digest.size()));
    plan.setDigest(kj::arrayPtr(n.relay_plan.digest.data(), n.relay_plan.digest.size()));
    put_hops(plan.initNext(static_cast<unsigned>(n.relay_plan.next.size())), n.relay_plan.next);
  }
  if (n.mode == Mode::pull) {
    r.setPullPort(n.pull_port);
    r.setPullName(n.pull_name);
    r.setPullSet(n.pull_set);
    r.setPullParts(n.pull_parts);
    r.setPullPart(n.pull_part);
    r.setPullPlan(kj::arrayPtr(n.pull_plan.data(), n.pull_plan.size()));
    r.setPullLinks(n.pull_links);
  }
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
  if (n.set_parts) {
    r.setSetParts(n.set_parts);
    r.setSetPlan(kj::arrayPtr(n.set_plan.data(), n.set_plan.size()));
    r.setSetPath(n.set_path);
    r.setSetBytes(n.set_bytes);
  }
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

std::vector<std::uint8_t> encode(const RelayReport& rep) {
  capnp::MallocMessageBuilder msg;
  auto r = msg.initRoot<schema::RelayReport>();
  r.setVerified(rep.verified);
  r.setForwarded(rep.forwarded);
  r.setState(static_cast<std::uint8_t>(rep.state));
  r.setFinal(rep.final);
  r.setCode(static_cast<std::uint32_t>(rep.code));
  r.setMessage(rep.message);
  r.setDigest(kj::arrayPtr(rep.digest.data(), rep.digest.size()));
  r.setNext(rep.next);
  r.setForwarding(rep.forwarding);
  r.setUpstream(kj::arrayPtr(rep.upstream.data(), rep.upstream.size()));
  r.setUpstreamCode(static_cast<std::uint32_t>(rep.upstream_code));
  r.setUpstreamMessage(rep.upstream_message);
  r.setRelinks(rep.relinks);
  auto sk = r.initSkipped(static_cast<unsigned>(rep.skipped.size()));
  for (unsigned i = 0; i < sk.size(); ++i) {
    sk[i].setHop(rep.skipped[i].hop);
    sk[i].setCode(static_cast<std::uint32_t>(rep.skipped[i].code));
    sk[i].setMessage(rep.skipped[i].message);
  }
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
    if (mode > static_cast<unsigned>(Mode::pull)) {
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
    auto ticket = r.getRelayTicket();
    if (ticket.size() != 0 && (ticket.size() != 32 || n.mode != Mode::upload || n.open_ended)) {
      set_why(why, "a relay ticket is 32 bytes and goes with an upload of a file");
      return std::nullopt;
    }
    n.relay_ticket.assign(ticket.begin(), ticket.end());
    if (n.mode == Mode::relay) {
      if (!r.hasRelayPlan()) {
        set_why(why, "a relay operation without its plan");
        return std::nullopt;
      }
      auto plan = r.getRelayPlan();
      auto t = plan.getTicket();
      if (t.size() != n.relay_plan.ticket.size()) {
        set_why(why, "relay ticket of " + std::to_string(t.size()) + " bytes");
        return std::nullopt;
      }
      std::memcpy(n.relay_plan.ticket.data(), t.begin(), t.size());
      n.relay_plan.protect = plan.getProtect();
      n.relay_plan.channels = plan.getChannels();
      n.relay_plan.mode = plan.getMode();
      n.relay_plan.pack = plan.getPack();
      const auto pd = plan.getPackDigest();
      if (n.relay_plan.pack != (pd.size() != 0) || (pd.size() != 0 && pd.size() != n.relay_plan.pack_digest.size())) {
        set_why(why, "a relay pack comes with its 32-byte digest, and only a pack");
        return std::nullopt;
      }
      if (n.relay_plan.pack) std::memcpy(n.relay_plan.pack_digest.data(), pd.begin(), pd.size());
      const auto fd = plan.getDigest();
      if (fd.size() != 0 && fd.size() != 32) {
        set_why(why, "a relay's file digest is 32 bytes, not " + std::to_string(fd.size()));
        return std::nullopt;
      }
      n.relay_plan.digest.assign(fd.begin(), fd.end());
      if (n.relay_plan.mode > 0777) {
        char octal[16];
        std::snprintf(octal, sizeof octal, "%o", n.relay_plan.mode);
        set_why(why, std::string("relay file mode ") + octal + " is more than permission bits");
        return std::nullopt;
      }
      if (n.relay_plan.protect > 2) {
        set_why(why, "unknown protection " + std::to_string(n.relay_plan.protect) + " for the relay's next hop");
        return std::nullopt;
      }
      auto hops = get_hops(plan.getNext(), why);
      if (!hops) return std::nullopt;
      n.relay_plan.next = std::move(*hops);
    } else if (r.hasRelayPlan()) {
      set_why(why, "a relay plan goes only with a relay operation");
      return std::nullopt;
    }
    if (n.mode == Mode::pull) {
      n.pull_port = r.getPullPort();
      auto name = r.getPullName();
      const std::string_view nm(name.cStr(), name.size());
      if (!check_text(nm, "pull name", why)) return std::nullopt;
      if (n.pull_port == 0 || nm.empty() || nm.size() > 255 || nm == "." || nm == ".." ||
          nm.find('/') != std::string_view::npos) {
        set_why(why, "a pull names its port (1..65535) and one file name (no '/', at most 255 bytes)");
        return std::nullopt;
      }
      n.pull_name.assign(nm);
      n.pull_set = r.getPullSet();
      n.pull_parts = r.getPullParts();
      n.pull_part = r.getPullPart();
      auto plan = r.getPullPlan();
      if ((n.pull_parts && !n.pull_set) || (n.pull_part != 0 && !n.pull_parts) || n.pull_part >= max_set_parts ||
          (plan.size() != 0 && plan.size() != 32) || (n.pull_part != 0) != (plan.size() == 32)) {
        set_why(why, "a set's part is one of at most " + std::to_string(max_set_parts) +
                         ", and every part after the first names its set's 32-byte plan");
        return std::nullopt;
      }
      n.pull_plan.assign(plan.begin(), plan.end());
      n.pull_links = r.getPullLinks();
      if (n.pull_links && !n.pull_parts) {
        set_why(why, "a pull takes a set's directories and symlinks only in parts");
        return std::nullopt;
      }
    } else if (r.getPullPort() != 0 || r.getPullName().size() != 0 || r.getPullSet() || r.getPullParts() ||
               r.getPullPart() != 0 || r.hasPullPlan() || r.getPullLinks()) {
      set_why(why, "a pull's port and name go only with a pull");
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
    NegotiationReply n;
    n.file_size = r.getFileSize();
    n.window = r.getWindow();
    n.block_size = r.getBlockSize();
    n.resume_offset = r.getResumeOffset();
    n.mtime_ns = r.getMtime();
    n.in_place = r.getInPlace();
    if (n.file_size > max_file_size || n.window > max_file_size || n.resume_offset > max_file_size ||
        r.getSetBytes() > max_file_size) {
      set_why(why, "file size " + std::to_string(n.file_size) + " or window " + std::to_string(n.window) +
                       " exceeds the protocol's limit of 2^62 bytes");
      return std::nullopt;
    }
    n.set_parts = r.getSetParts();
    auto plan = r.getSetPlan();
    auto path = r.getSetPath();
    const std::string_view p(path.cStr(), path.size());
    if (n.set_parts == 0 ? (plan.size() != 0 || p.size() != 0 || r.getSetBytes() != 0)
                         : (n.set_parts > max_set_parts || plan.size() != 32)) {
      set_why(why, "a set's parts (at most " + std::to_string(max_set_parts) + ") come with its 32-byte plan");
      return std::nullopt;
    }
    if (!check_text(p, "set path", why)) return std::nullopt;  // (at most max_path_bytes)
    n.set_plan.assign(plan.begin(), plan.end());
    n.set_path.assign(p);
    n.set_bytes = r.getSetBytes();
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

std::optional<RelayReport> decode_report(std::span<const std::uint8_t> b, std::string* why) {
  return read_message<schema::RelayReport>(b, why, [&](schema::RelayReport::Reader r) -> std::optional<RelayReport> {
    RelayReport rep;
    rep.verified = r.getVerified();
    rep.forwarded = r.getForwarded();
    if (r.getState() > static_cast<std::uint8_t>(RelayReport::State::failed)) {
      set_why(why, "unknown relay state " + std::to_string(r.getState()));
      return std::nullopt;
    }
    rep.state = static_cast<RelayReport::State>(r.getState());
    rep.final = r.getFinal();
    // 0 is "no failure" here (an exception's code never is).
    rep.code = r.getCode() == 0 ? errc::ok : errc_from_wire(r.getCode());
    auto one_line = [](capnp::Text::Reader t) {
      std::size_t len = std::min<std::size_t>(t.size(), 512);
      if (len < t.size())
        while (len > 0 && (static_cast<unsigned char>(t.cStr()[len]) & 0xC0) == 0x80) --len;
      return text::escape({t.cStr(), len});
    };
    rep.message = one_line(r.getMessage());
    auto d = r.getDigest();
    if (d.size() != 0 && d.size() != 32) {
      set_why(why, "relay digest of " + std::to_string(d.size()) + " bytes");
      return std::nullopt;
    }
    rep.digest.assign(d.begin(), d.end());
    rep.next = r.getNext();
    auto sk = r.getSkipped();
    if (sk.size() > max_relay_hops) {
      set_why(why, std::to_string(sk.size()) + " skipped relay hops, at most " + std::to_string(max_relay_hops));
      return std::nullopt;
    }
    for (auto s : sk) rep.skipped.push_back({s.getHop(), errc_from_wire(s.getCode()), one_line(s.getMessage())});
    rep.forwarding = r.getForwarding();
    auto up = r.getUpstream();
    if (up.size() != 0 && up.size() != 32) {
      set_why(why, "relay upstream key of " + std::to_string(up.size()) + " bytes");
      return std::nullopt;
    }
    rep.upstream.assign(up.begin(), up.end());
    rep.upstream_code = r.getUpstreamCode() == 0 ? errc::ok : errc_from_wire(r.getUpstreamCode());
    rep.upstream_message = one_line(r.getUpstreamMessage());
    rep.relinks = r.getRelinks();
    return rep;
  });
}

std::vector<std::uint8_t> encode_relink(const std::vector<RelayHop>& next) {
  capnp::MallocMessageBuilder msg;
  auto r = msg.initRoot<schema::RelayRelink>();
  put_hops(r.initNext(static_cast<unsigned>(next.size())), next);
  return to_bytes(msg);
}

std::optional<std::vector<RelayHop>> decode_relink(std::span<const std::uint8_t> b, std::string* why) {
  return read_message<schema::RelayRelink>(b, why, [&](schema::RelayRelink::Reader r) {
    return get_hops(r.getNext(), why);
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
