// XDOPI: the bytes on an xDFS channel.
//
// A channel starts with an 8-byte preamble ("xDFS", version, reserved), then carries frames.
// Every frame is a fixed 24-byte little-endian header followed by `length` payload bytes.
// Data frames (xFTSMU/xFTSMD) carry file bytes; control frames carry a Cap'n Proto message.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xdfs/error.hpp"
#include "xdfs/types.hpp"

namespace xdfs::wire {

inline constexpr std::array<std::uint8_t, 4> magic{'x', 'D', 'F', 'S'};
inline constexpr std::size_t preamble_size = 8;
inline constexpr std::size_t frame_header_size = 24;

/// Largest control payload (negotiation, exception, path messages) a peer may send.
inline constexpr std::uint32_t max_control_payload = 64 * 1024;
/// Bounds on the negotiated block size.
inline constexpr std::uint32_t min_block_size = 4 * 1024;
inline constexpr std::uint32_t max_block_size = 64 * 1024 * 1024;
/// Room for a block's tag after its data in a data frame (xSec's is 16 bytes).
inline constexpr std::uint32_t max_block_tag = 64;
/// Largest xPathM payload at the frame level (a session bounds it further by its block size).
inline constexpr std::uint32_t max_path_payload = max_block_size + (8u << 20);
/// Longest remote path accepted.
inline constexpr std::size_t max_path_bytes = 4096;

/// A text field from a peer (a path, a name, a message): at most max_path_bytes and no NUL
/// inside. Otherwise false, and why names the field and the cause.
bool check_text(std::string_view text, const char* what, std::string* why);

/// The paper's channel events (Table 3), plus the control frames xDFS needs around them.
enum class ChannelEvent : std::uint8_t {
  nego = 1,       ///< the channel's opening (Cap'n Proto Opening); later, the next operation (Negotiation)
  nego_reply = 2, ///< server accepts an operation (Cap'n Proto NegotiationReply)
  xftsmu = 3,     ///< file block, client to server
  xftsmd = 4,     ///< file block, server to client
  xpathm = 5,     ///< path operation (reserved for path mode)
  eofr = 6,       ///< this side's part of the operation ends on this channel, which stays for the next
                  ///< (sender: no more blocks; receiver: the file is committed, offset = its bytes;
                  ///< with flag_manifest, the payload is the whole-file digest)
  eoft = 7,       ///< client: the session ends; the channels close
  noop = 8,       ///< keep-alive
  conm = 9,       ///< continue in the current channel state
  zxdfs = 10,     ///< zero-copy negotiation (reserved)
  ack = 11,       ///< cumulative count of bytes the receiver has written (in `offset`)
  exception = 12, ///< error for the peer (Cap'n Proto ExceptionHeader)
  handshake = 13, ///< xSec handshake message (Noise XX or join proof)
  nack = 14,      ///< receiver, clear mode with the manifest: the block at `offset` failed its digest; send it again
  report = 15,    ///< relay: a host's progress for the master (Cap'n Proto RelayReport)
  relink = 16,    ///< relay: the master gives a host new hops to forward to (Cap'n Proto RelayRelink)
};

const char* to_string(ChannelEvent e) noexcept;

/// Bits of Negotiation::extended_flags.
enum ExtendedFlag : std::uint64_t {
  /// Memory-to-memory: no file at the server. Upload: the server discards what it receives.
  /// Download: the server sends file_size zero bytes. For benchmarks; servers allow it only
  /// when configured to.
  flag_memory = 1u << 0,
  /// The content manifest (docs/manifest.md): every data frame carries its block's SHA-256
  /// after the data, inside the frame's protection; the sender's EOFRs carry the whole-file
  /// digest, and the receiver's EOFRs the one it computed from the blocks it verified.
  flag_manifest = 1u << 1,
};
inline constexpr std::uint64_t known_flags = flag_memory | flag_manifest;
bool is_known(std::uint8_t raw) noexcept;

struct FrameHeader {
  ChannelEvent event = ChannelEvent::noop;
  std::uint8_t flags = 0;
  std::uint32_t length = 0;   ///< payload bytes following the header
  std::uint64_t offset = 0;   ///< file offset (data), byte count (ack, eofr)
  std::uint64_t aux = 0;      ///< reserved, zero
};

using HeaderBytes = std::array<std::uint8_t, frame_header_size>;

HeaderBytes encode(const FrameHeader& h) noexcept;
/// Decodes and checks a header: unknown event, non-zero reserved bits or an oversized control
/// payload is a protocol error. Data payloads are bounded by the session's block size later.
std::optional<FrameHeader> decode(std::span<const std::uint8_t, frame_header_size> bytes,
                                  std::string* why = nullptr) noexcept;

using PreambleBytes = std::array<std::uint8_t, preamble_size>;
PreambleBytes encode_preamble(std::uint16_t version = protocol_version) noexcept;
/// Checks the magic; returns the peer's version, or errc::protocol_error.
std::optional<std::uint16_t> decode_preamble(std::span<const std::uint8_t, preamble_size> b) noexcept;

/// What a channel says first, in the clear (the NEGO frame after the preamble): only what the
/// server needs to run the channel's handshake. An unauthenticated peer can make the server read
/// this much and no more.
struct Opening {
  std::uint16_t version = protocol_version;
  SessionId session;
  std::uint32_t channel_index = 0;
  std::uint8_t protect = 2;     ///< xsec::Protect: 0 clear, 1 integrity, 2 private
  std::uint8_t cipher = 0;      ///< xsec::Cipher for private mode
  bool join = false;            ///< joins an established session with its secret
  std::vector<std::uint8_t> join_nonce;  ///< join: 32 fresh random bytes from the client
  bool operator==(const Opening&) const = default;
};

/// Largest opening payload: the fields above encode in about 100 bytes.
inline constexpr std::uint32_t max_opening_payload = 512;

/// Relay: a host the chain's data goes on to (RelayPlan::next).
struct RelayHop {
  std::string address;          ///< "host:port"
  std::array<std::uint8_t, 32> server_key{};
  std::array<std::uint8_t, 32> ticket{};
  bool operator==(const RelayHop&) const = default;
};

/// Relay: a host's place in a chain, registered by the master (Mode::relay).
struct RelayPlan {
  std::array<std::uint8_t, 32> ticket{};
  std::vector<RelayHop> next;   ///< at most max_relay_hops, tried in order
  std::uint8_t protect = 2;     ///< xsec::Protect of the sessions the host opens downstream
  std::uint32_t channels = 1;   ///< n of those sessions (the server bounds it by its max_channels)
  std::uint32_t mode = 0;       ///< the file's permission bits (0: the server's default)
  bool pack = false;            ///< a pack of small files, unpacked into its directory at the end
  std::array<std::uint8_t, 32> pack_digest{};  ///< with pack: its manifest digest, as the master made it
  /// Empty, or 32 bytes: the file's manifest digest as the master computed it from the source;
  /// a copy whose digest differs is not kept under its name (whatever its upstream's digests said).
  std::vector<std::uint8_t> digest;
  bool operator==(const RelayPlan&) const = default;
};

/// Hops a plan may name (with a 4096-byte path, a plan still fits one negotiation).
inline constexpr std::size_t max_relay_hops = 8;
/// Longest "host:port" of a hop.
inline constexpr std::size_t max_relay_address = 300;

/// An operation of the session (the paper's Table 2 without the opening's fields). The first is
/// the payload of the client's last Noise XX message: encrypted, and bound into the handshake's
/// transcript. Each later one is a NEGO frame sent on every channel once the previous operation
/// ended on it (EOFR both ways); channel_count, block_size, tcp_window and extended_flags must
/// stay those of the first.
struct Negotiation {
  std::uint32_t channel_count = 1;
  Mode mode = Mode::upload;
  std::string remote_path;
  std::uint32_t block_size = 1 << 20;
  std::uint32_t tcp_window = 0;
  std::uint64_t extended_flags = 0;
  std::uint64_t file_size = 0;  ///< upload: size of the file the client sends
  std::uint64_t window = 0;     ///< download: unacknowledged bytes the client accepts
  /// The operation's number: 0 for the first, then strictly increasing. Its data keys derive
  /// from the session secret and this number, so no two operations share a block nonce.
  std::uint64_t transfer = 0;
  /// Download: the client has this many bytes of the file, verified (a multiple of the block
  /// size, with flag_manifest), and asks for the rest; 0: the whole file.
  std::uint64_t resume_offset = 0;
  /// Upload: the source's mtime in ns (a resumed upload must come from the same file). Download
  /// with resume_offset: the source's mtime when the partial copy began (file_size its size).
  std::int64_t source_mtime_ns = 0;
  /// Upload: start at byte 0, whatever partial copy the server kept (xduc --no-resume).
  bool fresh = false;
  /// Upload of a stream (standard input, a pipe): its size is not known in advance (file_size
  /// is 0). Whole blocks come until the end; the last may be short, and the sender's EOFRs
  /// carry the size. Never resumed, and with the manifest no block is sent twice (a stream is
  /// read once): one that fails its digest fails the transfer.
  bool open_ended = false;
  /// Upload: feeds the relay registered at the server under this ticket (RelayPlan::ticket):
  /// the file, its size and its mtime are the relay's. Empty: an ordinary upload.
  std::vector<std::uint8_t> relay_ticket;
  /// Mode::relay: this host's place in the chain (remote_path, file_size and source_mtime_ns
  /// name the file it receives).
  RelayPlan relay_plan;
  /// Mode::pull: the pulling host's own server listens on this port, at the address the
  /// session comes from, with the session's client key; the master registers its place there,
  /// a file named pull_name in that server's root.
  std::uint16_t pull_port = 0;
  std::string pull_name;
  /// Mode::pull: remote_path is a directory, whose files travel as one pack (a set).
  bool pull_set = false;
  /// Mode::pull of a set: the host takes a set in several parts, one operation each (a pack of
  /// small files, or one large file); without it a set larger than a pack is refused.
  bool pull_parts = false;
  /// With pull_parts: the part asked for (0: the first; its reply says how many there are).
  std::uint32_t pull_part = 0;
  /// With pull_part > 0: the set's plan as part 0's reply named it (32 bytes); a part of a set
  /// that changed since is refused.
  std::vector<std::uint8_t> pull_plan{};
  /// Mode::pull of a set, with pull_parts: the host takes the set's directories and symlinks too
  /// (part 0 is then a pack of version 2, relay/src/pack.hpp); without it, only its files.
  bool pull_links = false;
  bool operator==(const Negotiation&) const = default;
};

/// Most parts a pulled set travels in: its first (always a pack, empty if need be) and one for
/// each of at most 20000 files.
inline constexpr std::uint32_t max_set_parts = 20001;

/// Largest negotiation payload (a 4096-byte path and the scalars).
inline constexpr std::uint32_t max_negotiation_payload = 8192;

/// Largest file size and window the protocol carries: 2^62 bytes, so that a sum of two of them
/// (an offset plus a length, a size plus a window) never overflows 64 bits.
inline constexpr std::uint64_t max_file_size = std::uint64_t(1) << 62;

struct NegotiationReply {
  std::uint64_t file_size = 0;
  std::uint64_t window = 0;
  std::uint32_t block_size = 0;
  /// The transfer starts here: the receiver's verified prefix, which the sender hashes but does
  /// not send (0: the whole file).
  std::uint64_t resume_offset = 0;
  std::int64_t mtime_ns = 0;  ///< download: the file's mtime, kept in the client's resume record
  /// Upload: the server writes it as it comes (into a FIFO): never resumed, never tried again.
  bool in_place = false;
  /// Pull of a set in parts: how many parts, the plan they belong to (32 bytes), this part's
  /// file relative to the set (empty: a pack of small files), and the bytes of all the parts.
  std::uint32_t set_parts = 0;
  std::vector<std::uint8_t> set_plan{};
  std::string set_path{};
  std::uint64_t set_bytes = 0;
  bool operator==(const NegotiationReply&) const = default;
};

struct ExceptionHeader {
  errc code = errc::internal;
  std::string message;
  std::uint32_t channel_index = 0;
  std::uint64_t offset = 0;
  /// The answer to an operation's negotiation, on every channel: that operation is refused, the
  /// session and its channels stay ready for the next. Otherwise the session ends.
  bool refused = false;
  bool operator==(const ExceptionHeader&) const = default;
};

/// Relay: a host's progress for the master (event REPORT).
struct RelayReport {
  enum class State : std::uint8_t { waiting = 0, receiving = 1, whole = 2, failed = 3 };
  struct Skip {
    std::uint32_t hop = 0;
    errc code = errc::internal;
    std::string message;
    bool operator==(const Skip&) const = default;
  };
  std::uint64_t verified = 0;
  std::uint64_t forwarded = 0;
  State state = State::waiting;
  bool final = false;
  errc code = errc::ok;
  std::string message;
  std::vector<std::uint8_t> digest;  ///< whole: 32 bytes
  std::uint32_t next = 0;            ///< index into the plan's hops it forwards to (their count: none)
  std::vector<Skip> skipped;         ///< at most max_relay_hops
  bool forwarding = false;           ///< its forwarder runs
  std::vector<std::uint8_t> upstream;  ///< 32 bytes: the key of who fed it last (empty: nobody yet)
  errc upstream_code = errc::ok;     ///< the last upload into it failed so (ok: it did not)
  std::string upstream_message;
  std::uint64_t relinks = 0;         ///< RELINKs heard so far: `skipped` counts the hops of the last
  bool operator==(const RelayReport&) const = default;
};

std::vector<std::uint8_t> encode_relink(const std::vector<RelayHop>& next);
/// A RELINK's hops: at most max_relay_hops, each checked as a plan's are.
std::optional<std::vector<RelayHop>> decode_relink(std::span<const std::uint8_t> b, std::string* why = nullptr);

/// Cap'n Proto encodings of the control messages (flat array of words, unpacked).
std::vector<std::uint8_t> encode(const Opening& o);
std::vector<std::uint8_t> encode(const Negotiation& n);
std::vector<std::uint8_t> encode(const NegotiationReply& r);
std::vector<std::uint8_t> encode(const ExceptionHeader& e);
std::vector<std::uint8_t> encode(const RelayReport& r);

/// Decoders treat the input as hostile: size limits, traversal limits and field checks apply,
/// and any failure returns nullopt with the reason in `why`.
std::optional<Opening> decode_opening(std::span<const std::uint8_t> b, std::string* why = nullptr);
std::optional<Negotiation> decode_negotiation(std::span<const std::uint8_t> b, std::string* why = nullptr);
std::optional<NegotiationReply> decode_reply(std::span<const std::uint8_t> b, std::string* why = nullptr);
std::optional<ExceptionHeader> decode_exception(std::span<const std::uint8_t> b, std::string* why = nullptr);
std::optional<RelayReport> decode_report(std::span<const std::uint8_t> b, std::string* why = nullptr);

}  // namespace xdfs::wire
