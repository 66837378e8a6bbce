// xSec: the security layer between the socket interface and the channel events.
//
// Identities are long-term X25519 key pairs. The first channel of a session runs the Noise XX
// handshake (Noise_XX_25519_ChaChaPoly_SHA256): ephemeral keys for forward secrecy, both static
// keys authenticated, and the channel's opening bytes (preamble and negotiation header) as the
// prologue, so that any change to mode, version or protection level in transit breaks the
// handshake. The handshake also yields a session secret; the other n-1 channels join with a
// cheap exchange keyed from it (fresh nonces from both sides, HMAC proofs, no public-key work),
// so a recorded join cannot be replayed and a channel without the secret cannot join. Every
// channel ends with its own pair of keys, one per direction.
//
// After that every frame passes through a FrameProtector: per-direction 64-bit counters are the
// nonces, so a replayed, reordered, dropped or modified frame fails its check.
//   clear     : control frames carry a MAC; data frames are sent as they are (but still count)
//   integrity : every frame carries a MAC (GMAC-AES-256 over header and payload)
//   private   : every frame is AEAD-protected (AES-256-GCM with AES-NI, else ChaCha20-Poly1305)
// The payload of a data frame is protected on the disk threads (BlockCrypto: a per-session,
// per-direction key, the block's offset as nonce, its tag stored after the data), so that bulk
// cryptography runs beside the network thread; the channel then authenticates the frame's header
// and that tag with its own key and counter, which binds each block to its place in the stream.
// Block payloads are sealed and opened with OpenSSL's libcrypto (the same AES-256-GCM,
// ChaCha20-Poly1305 and GMAC, in about half the CPU time); every other primitive comes from Botan 2.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "xdfs/error.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/piod.hpp"
#include "xdfs/xdsi.hpp"

namespace Botan {
class AEAD_Mode;
class MessageAuthenticationCode;
}  // namespace Botan

namespace xdfs::xsec {

using Key32 = std::array<std::uint8_t, 32>;

/// Protection level of a session's frames.
enum class Protect : std::uint8_t { clear = 0, integrity = 1, private_ = 2 };
const char* to_string(Protect p) noexcept;
std::optional<Protect> parse_protect(const std::string& s) noexcept;

/// AEAD used for `private` sessions.
enum class Cipher : std::uint8_t { aes256gcm = 0, chacha20poly1305 = 1 };
const char* to_string(Cipher c) noexcept;
/// AES-256-GCM where the CPU has AES-NI and carry-less multiply, ChaCha20-Poly1305 otherwise.
Cipher preferred_cipher() noexcept;

/// A long-term X25519 identity.
struct KeyPair {
  Key32 secret{};
  Key32 public_key{};
  static KeyPair generate();
  static KeyPair from_secret(const Key32& secret);
};

/// "xdfs-x25519 <base64>" form of a public key, as it appears in key files.
std::string format_public(const Key32& pub);
std::optional<Key32> parse_public(const std::string& text);
/// Short fingerprint for messages: "SHA256:" and 16 base64 characters of the key's hash.
std::string fingerprint(const Key32& pub);

/// Loads a private key file. Refuses a file that group or others can read or write: a key
/// that others can read is not secret any more.
KeyPair load_key(const std::string& path);
/// Loads the key at path, creating it (mode 0600, directory 0700) if it does not exist.
/// Sets *created when it made a new one.
KeyPair load_or_create_key(const std::string& path, bool* created = nullptr);

/// What an authorized client may do.
struct Permission {
  bool write = true;        ///< rw: upload and download; ro: download only
  std::string subdir;       ///< if set, the client sees only this directory under the root
  unsigned sessions = 0;    ///< sessions at once (0: the server's per-key default)
  unsigned channels = 0;    ///< channels at once over its sessions (0: the server's per-key default)
};

/// The server's authorized-keys file: one client per line,
///   xdfs-x25519 <base64> [rw|ro] [subdir=PATH] [sessions=N] [channels=N] [# comment]
class AuthorizedKeys {
public:
  /// Parses the file; a malformed line is an error naming its line number.
  static AuthorizedKeys load(const std::string& path);
  static AuthorizedKeys parse(const std::string& text, const std::string& origin);
  const Permission* find(const Key32& pub) const;
  std::size_t size() const noexcept { return keys_.size(); }

private:
  std::map<Key32, Permission> keys_;
};

/// The client's pinned server keys: "HOST:PORT xdfs-x25519 <base64>" per line.
class KnownHosts {
public:
  explicit KnownHosts(std::string path) : path_(std::move(path)) {}
  /// The pinned key of host:port, if any.
  std::optional<Key32> lookup(const std::string& host_port) const;
  /// Appends a pin (creating the file 0600 and its directory).
  void add(const std::string& host_port, const Key32& pub) const;

private:
  std::string path_;
};

/// Default locations: $XDFS_CONFIG_DIR, else $XDG_CONFIG_HOME/xdfs, else ~/.config/xdfs.
std::string default_config_dir();

/// Noise_XX_25519_ChaChaPoly_SHA256, initiator or responder, without sockets.
class NoiseXX {
public:
  NoiseXX(bool initiator, const KeyPair& self, std::span<const std::uint8_t> prologue);
  ~NoiseXX();
  NoiseXX(const NoiseXX&) = delete;
  NoiseXX& operator=(const NoiseXX&) = delete;

  // Initiator: write_message_1, read_message_2, write_message_3.
  // Responder: read_message_1, write_message_2, read_message_3.
  // A read that fails (bad length, failed decryption, low-order point) returns false.
  std::vector<std::uint8_t> write_message_1();
  bool read_message_1(std::span<const std::uint8_t> msg);
  std::vector<std::uint8_t> write_message_2();
  bool read_message_2(std::span<const std::uint8_t> msg);
  /// Message 3 carries the initiator's payload (encrypted; empty if none). read_message_3 with
  /// no payload out-parameter refuses a message that carries one.
  std::vector<std::uint8_t> write_message_3(std::span<const std::uint8_t> payload = {});
  bool read_message_3(std::span<const std::uint8_t> msg, std::vector<std::uint8_t>* payload = nullptr);

  /// The peer's static key (after message 2 for the initiator, 3 for the responder).
  const Key32& remote_static() const noexcept { return rs_; }

  /// After the last message: this side's send and receive keys, and the session secret the
  /// other channels join with.
  struct Result {
    Key32 send{};
    Key32 recv{};
    Key32 session_secret{};
  };
  Result split() const;

private:
  struct Impl;
  std::unique_ptr<Impl> d_;
  Key32 rs_{};
};

/// Keys of a joining channel, derived from the session secret, both sides' fresh nonces and the
/// channel's opening bytes (its negotiation header). No public-key operation.
struct JoinKeys {
  Key32 client_to_server{};
  Key32 server_to_client{};
  Key32 confirm{};
};
JoinKeys derive_join_keys(const Key32& session_secret, std::span<const std::uint8_t> client_nonce,
                          std::span<const std::uint8_t> server_nonce, std::span<const std::uint8_t> opening);
/// HMAC-SHA-256 proof that a side holds the join keys ("client" or "server").
Key32 join_proof(const JoinKeys& k, const char* side, std::span<const std::uint8_t> client_nonce,
                 std::span<const std::uint8_t> server_nonce);
bool equal_constant_time(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) noexcept;
/// The key that protects block payloads in one direction of one operation of a session: each
/// (transfer, direction) pair has its own key, and within it a block's offset is its nonce, sealed
/// once; so no (key, nonce) pair is ever used twice in a session.
Key32 data_key(const Key32& session_secret, bool client_to_server, std::uint64_t transfer);

/// Seals and opens block payloads on a disk thread (integrity: GMAC tag; private: AEAD). One
/// thread at a time: it keeps its cipher contexts between blocks; clone() gives another thread
/// its own.
class BlockCrypto final : public piod::BlockSealer {
public:
  BlockCrypto(Protect mode, Cipher cipher, const Key32& key);
  ~BlockCrypto() override;
  TagLength tag_size() const noexcept override { return TagLength(16); }
  void seal(std::uint8_t* data, DataLength len, FileOffset offset) override;
  bool open(std::uint8_t* data, DataLength len, FileOffset offset) override;
  std::unique_ptr<piod::BlockSealer> clone() const override;

private:
  class Evp;
  Protect mode_;
  Cipher cipher_;
  Key32 key_;  // for clones; wiped with the object
  std::unique_ptr<Evp> seal_;  // private: seals; integrity: makes and checks GMACs
  std::unique_ptr<Evp> open_;  // private only
};

/// Random bytes from the system RNG.
void random_fill(std::span<std::uint8_t> out);

inline constexpr std::size_t tag_size = 16;
static_assert(tag_size <= wire::max_block_tag, "a sealed block must fit its frame and its slot");
static_assert(manifest::digest_size + tag_size <= wire::max_block_tag,
              "a sealed block with its digest must fit its frame and its slot");

/// Protects the frames of one channel. Each direction has its own key and counter.
class FrameProtector final : public xdsi::FrameGuard {
public:
  FrameProtector(Protect mode, Cipher cipher, const Key32& send_key, const Key32& recv_key);
  ~FrameProtector() override;
  FrameProtector(const FrameProtector&) = delete;
  FrameProtector& operator=(const FrameProtector&) = delete;

  Protect mode() const noexcept { return mode_; }
  /// Bytes of tag that follow the payload of a frame with this event (0 or tag_size).
  std::size_t tag_bytes(wire::ChannelEvent e) const noexcept override;
  /// Seals one outgoing frame: encrypts the payload in place (private) and writes the tag.
  void seal(const wire::HeaderBytes& header, std::span<std::uint8_t> payload, std::uint8_t* tag) override;
  /// Checks (and decrypts in place) one incoming frame. False means it was modified,
  /// replayed, reordered, or a frame before it was dropped.
  bool open(const wire::HeaderBytes& header, std::span<std::uint8_t> payload, const std::uint8_t* tag) override;

private:
  Protect mode_;
  Cipher cipher_;
  std::unique_ptr<Botan::AEAD_Mode> enc_, dec_;
  std::unique_ptr<Botan::MessageAuthenticationCode> mac_send_, mac_recv_;
  Key32 send_key_{}, recv_key_{};          // GMAC keys: for every frame, or data frames in private mode
  std::uint64_t send_n_ = 0;
  std::uint64_t recv_n_ = 0;
};

}  // namespace xdfs::xsec

namespace xdfs::xsec {

/// Outcome of a channel's handshake.
struct HandshakeResult {
  errc code = errc::ok;
  std::string message;
  bool remote = false;      ///< the peer reported the failure (an exception header)
  Key32 remote_static{};    ///< establish: the peer's identity
  Key32 session_secret{};   ///< establish: what the other channels join with
  std::vector<std::uint8_t> payload;  ///< server establish: what the client's message 3 carried
};
using HandshakeHandler = std::function<void(HandshakeResult)>;
/// Client side: decides whether the server's static key is acceptable (known hosts).
using ServerKeyCheck = std::function<HandshakeResult(const Key32& server_static)>;
/// Runs a step that costs public-key work, now or later (a server queues them fairly).
using Defer = std::function<void(std::function<void()>)>;

/// The Noise XX exchange on a channel whose opening bytes (preamble and NEGO frame) are
/// `opening`; on success the channel is protected with its own keys. The client sends
/// `payload` (the negotiation) in message 3, once it has checked the server's key; the server
/// returns it in the result, with the client's key, for the caller to judge. The caller then
/// answers over the now protected channel: an empty HANDSHAKE frame once the session exists
/// (client_establish completes only when it arrives), or an EXCEPTION saying why not.
void client_establish(xdsi::Channel& ch, std::vector<std::uint8_t> opening, const KeyPair& self, Protect mode,
                      Cipher cipher, std::vector<std::uint8_t> payload, ServerKeyCheck check, HandshakeHandler h);
void server_establish(xdsi::Channel& ch, std::vector<std::uint8_t> opening, const KeyPair& self, Protect mode,
                      Cipher cipher, Defer defer, HandshakeHandler h);

/// The cheap join of channels 2..n: server sends its nonce and proof, client answers with its
/// proof; both derive the channel's keys from the session secret and both nonces.
void client_join(xdsi::Channel& ch, std::vector<std::uint8_t> opening, std::vector<std::uint8_t> client_nonce,
                 const Key32& session_secret, Protect mode, Cipher cipher, HandshakeHandler h);
void server_join(xdsi::Channel& ch, std::vector<std::uint8_t> opening, std::vector<std::uint8_t> client_nonce,
                 const Key32& session_secret, Protect mode, Cipher cipher, HandshakeHandler h);

}  // namespace xdfs::xsec
