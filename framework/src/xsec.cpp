#include "xdfs/xsec.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <botan/aead.h>
#include <botan/base64.h>
#include <botan/cpuid.h>
#include <botan/curve25519.h>
#include <botan/hash.h>
#include <botan/hex.h>
#include <botan/kdf.h>
#include <botan/mac.h>
#include <botan/mem_ops.h>
#include <botan/system_rng.h>
#include <openssl/err.h>
#include <openssl/evp.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace xdfs::xsec {
namespace {

constexpr char noise_name[] = "Noise_XX_25519_ChaChaPoly_SHA256";
constexpr char key_prefix[] = "xdfs-x25519";
constexpr char private_prefix[] = "xdfs-x25519-private";

Key32 sha256(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b = {}) {
  auto h = Botan::HashFunction::create_or_throw("SHA-256");
  h->update(a.data(), a.size());
  h->update(b.data(), b.size());
  Key32 out;
  h->final(out.data());
  return out;
}

Key32 hmac(const Key32& key, std::span<const std::uint8_t> a, std::span<const std::uint8_t> b = {}) {
  auto m = Botan::MessageAuthenticationCode::create_or_throw("HMAC(SHA-256)");
  m->set_key(key.data(), key.size());
  m->update(a.data(), a.size());
  m->update(b.data(), b.size());
  Key32 out;
  m->final(out.data());
  return out;
}

// Noise's HKDF with two outputs.
std::pair<Key32, Key32> hkdf2(const Key32& ck, std::span<const std::uint8_t> ikm) {
  Key32 temp = hmac(ck, ikm);
  const std::uint8_t one = 1;
  Key32 o1 = hmac(temp, std::span<const std::uint8_t>(&one, 1));
  const std::uint8_t two = 2;
  Key32 o2 = hmac(temp, o1, std::span<const std::uint8_t>(&two, 1));
  return {o1, o2};
}

bool dh(Key32& out, const Key32& secret, const Key32& pub) {
  Botan::curve25519_donna(out.data(), secret.data(), pub.data());
  std::uint8_t acc = 0;
  for (auto b : out) acc |= b;
  return acc != 0;  // an all-zero result means a low-order point: refuse it
}

using Nonce = std::array<std::uint8_t, 12>;

// A 96-bit nonce: a 4-byte domain and a little-endian 64-bit counter (Noise's ChaChaPoly layout
// when the domain is zero).
Nonce counter_nonce(std::uint64_t n, std::array<std::uint8_t, 4> domain = {}) {
  Nonce out{domain[0], domain[1], domain[2], domain[3]};
  for (int i = 0; i < 8; ++i) out[4 + i] = static_cast<std::uint8_t>(n >> (8 * i));
  return out;
}

// GMAC over a and b. Botan 2's GMAC forgets its key at final(): it is keyed for every message
// (a cheap AES key schedule).
void gmac(Botan::MessageAuthenticationCode& mac, const Key32& key, const Nonce& n, std::span<const std::uint8_t> a,
          std::span<const std::uint8_t> b, std::uint8_t* out) {
  mac.set_key(key.data(), key.size());
  mac.start(n.data(), n.size());
  mac.update(a.data(), a.size());
  mac.update(b.data(), b.size());
  mac.final(out);
}

// AEAD in place: the bulk of data is processed where it lies, only the last partial chunk and
// the tag go through Botan's buffer.
void aead_seal(Botan::AEAD_Mode& enc, const Nonce& n, std::span<const std::uint8_t> ad, std::uint8_t* data,
               std::size_t len, std::uint8_t* tag) {
  enc.set_associated_data(ad.data(), ad.size());
  enc.start(n.data(), n.size());
  const std::size_t g = enc.update_granularity();
  const std::size_t bulk = len / g * g;
  if (bulk) enc.process(data, bulk);
  Botan::secure_vector<std::uint8_t> last(data + bulk, data + len);
  enc.finish(last);
  // (An empty payload may come with a null pointer: no copy then, not even of zero bytes.)
  if (len > bulk) std::memcpy(data + bulk, last.data(), len - bulk);
  std::memcpy(tag, last.data() + (len - bulk), 16);
}

bool aead_open(Botan::AEAD_Mode& dec, const Nonce& n, std::span<const std::uint8_t> ad, std::uint8_t* data,
               std::size_t len, const std::uint8_t* tag) {
  try {
    dec.set_associated_data(ad.data(), ad.size());
    dec.start(n.data(), n.size());
    const std::size_t g = dec.update_granularity();
    const std::size_t bulk = len / g * g;
    if (bulk) dec.process(data, bulk);
    Botan::secure_vector<std::uint8_t> last(data + bulk, data + len);
    last.insert(last.end(), tag, tag + 16);
    dec.finish(last);
    if (len > bulk) std::memcpy(data + bulk, last.data(), len - bulk);
    return true;
  } catch (const std::exception&) {
    return false;  // Botan reports a wrong tag by throwing
  }
}

std::string mode_octal(mode_t m) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(m & 07777));
  return buf;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.pop_back();
  std::size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  return s.substr(i);
}

std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  std::string w;
  while (in >> w) {
    if (w[0] == '#') break;
    out.push_back(w);
  }
  return out;
}

void make_private_dir(const std::string& dir) {
  if (dir.empty()) return;
  std::string cur;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    cur = dir.substr(0, pos);
    if (!cur.empty()) ::mkdir(cur.c_str(), 0700);
  }
}

// "name=N" with N a whole number from 1 to 1000000.
std::optional<unsigned> count_option(const std::string& word, const char* name) {
  const std::size_t len = std::strlen(name);
  if (word.compare(0, len, name) != 0 || word.size() == len || word.size() > len + 7) return std::nullopt;
  unsigned v = 0;
  for (std::size_t i = len; i < word.size(); ++i) {
    if (word[i] < '0' || word[i] > '9') return std::nullopt;
    v = v * 10 + static_cast<unsigned>(word[i] - '0');
  }
  if (v == 0 || v > 1000000) return std::nullopt;
  return v;
}

std::string parent_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

}  // namespace

const char* to_string(Protect p) noexcept {
  switch (p) {
    case Protect::clear: return "clear";
    case Protect::integrity: return "integrity";
    case Protect::private_: return "private";
  }
  return "?";
}

std::optional<Protect> parse_protect(const std::string& s) noexcept {
  if (s == "clear") return Protect::clear;
  if (s == "integrity") return Protect::integrity;
  if (s == "private") return Protect::private_;
  return std::nullopt;
}

const char* to_string(Cipher c) noexcept {
  return c == Cipher::aes256gcm ? "AES-256/GCM" : "ChaCha20Poly1305";
}

Cipher preferred_cipher() noexcept {
  return Botan::CPUID::has_aes_ni() && Botan::CPUID::has_clmul() ? Cipher::aes256gcm : Cipher::chacha20poly1305;
}

void random_fill(std::span<std::uint8_t> out) { Botan::system_rng().randomize(out.data(), out.size()); }

KeyPair KeyPair::generate() {
  Key32 secret;
  random_fill(secret);
  return from_secret(secret);
}

KeyPair KeyPair::from_secret(const Key32& secret) {
  KeyPair k;
  k.secret = secret;
  Botan::curve25519_basepoint(k.public_key.data(), k.secret.data());
  return k;
}

std::string format_public(const Key32& pub) {
  return std::string(key_prefix) + " " + Botan::base64_encode(pub.data(), pub.size());
}

std::optional<Key32> parse_public(const std::string& text) {
  auto w = words(text);
  if (w.size() < 2 || w[0] != key_prefix) return std::nullopt;
  try {
    auto raw = Botan::base64_decode(w[1]);
    if (raw.size() != 32) return std::nullopt;
    Key32 k;
    std::memcpy(k.data(), raw.data(), 32);
    return k;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::string fingerprint(const Key32& pub) {
  auto h = sha256(pub);
  return "SHA256:" + Botan::base64_encode(h.data(), h.size()).substr(0, 16);
}

KeyPair load_key(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) throw Error(errc_from_errno(errno), "key file '" + path + "': " + std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  if (st.st_mode & 077) {
    ::close(fd);
    throw Error(errc::insecure_key_file, "key file '" + path + "' has mode " + mode_octal(st.st_mode) +
                                             ": others can read it; run chmod 600 '" + path + "'");
  }
  char buf[512];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) throw Error(errc::bad_argument, "key file '" + path + "' is empty");
  buf[n] = 0;
  auto w = words(buf);
  if (w.size() < 2 || w[0] != private_prefix) throw Error(errc::bad_argument, "key file '" + path + "' is not an xDFS private key");
  Botan::secure_vector<std::uint8_t> raw;
  try {
    raw = Botan::base64_decode(w[1]);
  } catch (const std::exception&) {
    throw Error(errc::bad_argument, "key file '" + path + "' is not valid base64");
  }
  if (raw.size() != 32) throw Error(errc::bad_argument, "key file '" + path + "' does not hold a 32-byte key");
  Key32 secret;
  std::memcpy(secret.data(), raw.data(), 32);
  return KeyPair::from_secret(secret);
}

KeyPair load_or_create_key(const std::string& path, bool* created) {
  if (created) *created = false;
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) return load_key(path);
  make_private_dir(parent_of(path));
  KeyPair k = KeyPair::generate();
  // Written whole under a name of its own, then linked into place: a process or thread that
  // makes the key at the same moment finds either no file or the whole of one, never a part.
  std::array<std::uint8_t, 8> tag{};
  random_fill(tag);
  const std::string temp = path + ".new-" + Botan::hex_encode(tag.data(), tag.size());
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) throw Error(errc_from_errno(errno), "cannot create key file '" + temp + "': " + std::strerror(errno));
  std::string text = std::string(private_prefix) + " " + Botan::base64_encode(k.secret.data(), k.secret.size()) + "\n" +
                     "# public: " + format_public(k.public_key) + "\n";
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ok = ::fsync(fd) == 0 && ok;
  ::close(fd);
  if (!ok) {
    ::unlink(temp.c_str());
    throw Error(errc::io_error, "cannot write key file '" + temp + "'");
  }
  // (A file system without hard links: a rename that replaces nothing does the same.)
  int linked = ::link(temp.c_str(), path.c_str());
  int e = errno;
  if (linked != 0 && (e == EPERM || e == EOPNOTSUPP)) {
    linked = ::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE);
    e = errno;
  }
  ::unlink(temp.c_str());
  if (linked != 0 && e == EINVAL) {
    // Neither hard links nor an exclusive rename here: made in place, as the only way left.
    const int fd2 = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd2 < 0 && errno == EEXIST) return load_key(path);
    if (fd2 < 0) throw Error(errc_from_errno(errno), "cannot create key file '" + path + "': " + std::strerror(errno));
    const bool whole = ::write(fd2, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd2) == 0;
    ::close(fd2);
    if (!whole) throw Error(errc::io_error, "cannot write key file '" + path + "'");
    linked = 0;
  }
  if (linked != 0) {
    if (e == EEXIST) return load_key(path);  // another one made it first
    throw Error(errc_from_errno(e), "cannot create key file '" + path + "': " + std::strerror(e));
  }
  // The key is this machine's identity from now on: its name must survive a crash too.
  if (const int dir = ::open(parent_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
  if (created) *created = true;
  return k;
}

AuthorizedKeys AuthorizedKeys::load(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw Error(errc::no_such_file, "authorized keys '" + path + "' cannot be read");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse(ss.str(), path);
}

AuthorizedKeys AuthorizedKeys::parse(const std::string& text, const std::string& origin) {
  AuthorizedKeys ak;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    auto w = words(trim(line));
    if (w.empty()) continue;
    auto where = origin + ":" + std::to_string(lineno);
    if (w.size() < 2) throw Error(errc::bad_argument, where + ": expected 'xdfs-x25519 KEY [rw|ro] [subdir=DIR]'");
    auto key = parse_public(w[0] + " " + w[1]);
    if (!key) throw Error(errc::bad_argument, where + ": not an xdfs-x25519 public key");
    Permission p;
    for (std::size_t i = 2; i < w.size(); ++i) {
      if (w[i] == "rw") p.write = true;
      else if (w[i] == "ro") p.write = false;
      else if (w[i].rfind("subdir=", 0) == 0 && w[i].size() > 7) p.subdir = w[i].substr(7);
      else if (auto n = count_option(w[i], "sessions=")) p.sessions = *n;
      else if (auto c = count_option(w[i], "channels=")) p.channels = *c;
      else throw Error(errc::bad_argument, where + ": unknown option '" + w[i] + "' (rw, ro, subdir=DIR, sessions=N, channels=N)");
    }
    ak.keys_[*key] = p;
  }
  return ak;
}

const Permission* AuthorizedKeys::find(const Key32& pub) const {
  auto it = keys_.find(pub);
  return it == keys_.end() ? nullptr : &it->second;
}

std::optional<Key32> KnownHosts::lookup(const std::string& host_port) const {
  std::ifstream f(path_);
  std::string line;
  while (std::getline(f, line)) {
    auto w = words(trim(line));
    if (w.size() >= 3 && w[0] == host_port) return parse_public(w[1] + " " + w[2]);
  }
  return std::nullopt;
}

void KnownHosts::add(const std::string& host_port, const Key32& pub) const {
  make_private_dir(parent_of(path_));
  int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(errc_from_errno(errno), "known hosts '" + path_ + "': " + std::strerror(errno));
  std::string line = host_port + " " + format_public(pub) + "\n";
  bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  ::close(fd);
  if (!ok) throw Error(errc::io_error, "cannot write known hosts '" + path_ + "'");
}

std::string default_config_dir() {
  if (const char* d = std::getenv("XDFS_CONFIG_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CONFIG_HOME"); x && *x) return std::string(x) + "/xdfs";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.config/xdfs";
}

// ---------------------------------------------------------------------------------------------
// Noise XX

struct NoiseXX::Impl {
  bool initiator;
  KeyPair s;
  Key32 e_secret{}, e_public{}, re{};
  Key32 ck{}, h{}, k{};
  bool has_key = false;
  std::uint64_t n = 0;
  std::unique_ptr<Botan::AEAD_Mode> enc = Botan::AEAD_Mode::create_or_throw("ChaCha20Poly1305", Botan::ENCRYPTION);
  std::unique_ptr<Botan::AEAD_Mode> dec = Botan::AEAD_Mode::create_or_throw("ChaCha20Poly1305", Botan::DECRYPTION);

  void mix_hash(std::span<const std::uint8_t> data) { h = sha256(h, data); }
  void mix_key(const Key32& ikm) {
    auto [a, b] = hkdf2(ck, ikm);
    ck = a;
    k = b;
    n = 0;
    has_key = true;
  }
  Nonce nonce() const { return counter_nonce(n); }
  void encrypt_and_hash(std::span<const std::uint8_t> pt, std::vector<std::uint8_t>& out) {
    std::vector<std::uint8_t> ct(pt.begin(), pt.end());
    if (has_key) {
      ct.resize(pt.size() + tag_size);
      enc->set_key(k.data(), k.size());
      aead_seal(*enc, nonce(), h, ct.data(), pt.size(), ct.data() + pt.size());
      ++n;
    }
    mix_hash(ct);
    out.insert(out.end(), ct.begin(), ct.end());
  }
  bool decrypt_and_hash(std::span<const std::uint8_t> ct, std::vector<std::uint8_t>& pt) {
    if (!has_key) {
      pt.assign(ct.begin(), ct.end());
      mix_hash(ct);
      return true;
    }
    if (ct.size() < tag_size) return false;
    const std::size_t len = ct.size() - tag_size;
    pt.assign(ct.begin(), ct.begin() + static_cast<std::ptrdiff_t>(len));
    dec->set_key(k.data(), k.size());
    if (!aead_open(*dec, nonce(), h, pt.data(), len, ct.data() + len)) return false;
    ++n;
    mix_hash(ct);
    return true;
  }
  bool mix_dh(const Key32& secret, const Key32& pub) {
    Key32 out;
    if (!dh(out, secret, pub)) return false;
    mix_key(out);
    return true;
  }
};

NoiseXX::NoiseXX(bool initiator, const KeyPair& self, std::span<const std::uint8_t> prologue)
    : d_(std::make_unique<Impl>()) {
  d_->initiator = initiator;
  d_->s = self;
  static_assert(sizeof noise_name - 1 <= 32);
  std::memcpy(d_->h.data(), noise_name, sizeof noise_name - 1);
  d_->ck = d_->h;
  d_->mix_hash(prologue);
  random_fill(d_->e_secret);
  Botan::curve25519_basepoint(d_->e_public.data(), d_->e_secret.data());
}

NoiseXX::~NoiseXX() = default;

// -> e
std::vector<std::uint8_t> NoiseXX::write_message_1() {
  std::vector<std::uint8_t> out(d_->e_public.begin(), d_->e_public.end());
  d_->mix_hash(d_->e_public);
  d_->encrypt_and_hash({}, out);  // empty payload, no key yet: nothing added
  return out;
}

bool NoiseXX::read_message_1(std::span<const std::uint8_t> msg) {
  if (msg.size() != 32) return false;
  std::memcpy(d_->re.data(), msg.data(), 32);
  d_->mix_hash(d_->re);
  std::vector<std::uint8_t> payload;
  return d_->decrypt_and_hash({}, payload);
}

// <- e, ee, s, es
std::vector<std::uint8_t> NoiseXX::write_message_2() {
  std::vector<std::uint8_t> out(d_->e_public.begin(), d_->e_public.end());
  d_->mix_hash(d_->e_public);
  if (!d_->mix_dh(d_->e_secret, d_->re)) return {};
  d_->encrypt_and_hash(d_->s.public_key, out);
  if (!d_->mix_dh(d_->s.secret, d_->re)) return {};
  d_->encrypt_and_hash({}, out);
  return out;
}

bool NoiseXX::read_message_2(std::span<const std::uint8_t> msg) {
  if (msg.size() != 32 + 32 + tag_size + tag_size) return false;
  std::memcpy(d_->re.data(), msg.data(), 32);
  d_->mix_hash(d_->re);
  if (!d_->mix_dh(d_->e_secret, d_->re)) return false;
  std::vector<std::uint8_t> s;
  if (!d_->decrypt_and_hash(msg.subspan(32, 32 + tag_size), s) || s.size() != 32) return false;
  std::memcpy(rs_.data(), s.data(), 32);
  if (!d_->mix_dh(d_->e_secret, rs_)) return false;
  std::vector<std::uint8_t> payload;
  return d_->decrypt_and_hash(msg.subspan(64 + tag_size), payload) && payload.empty();
}

// -> s, se (with the payload: the initiator's first words that only the responder can read)
std::vector<std::uint8_t> NoiseXX::write_message_3(std::span<const std::uint8_t> payload) {
  std::vector<std::uint8_t> out;
  d_->encrypt_and_hash(d_->s.public_key, out);
  if (!d_->mix_dh(d_->s.secret, d_->re)) return {};
  d_->encrypt_and_hash(payload, out);
  return out;
}

bool NoiseXX::read_message_3(std::span<const std::uint8_t> msg, std::vector<std::uint8_t>* payload) {
  if (msg.size() < 32 + tag_size + tag_size) return false;
  std::vector<std::uint8_t> s;
  if (!d_->decrypt_and_hash(msg.subspan(0, 32 + tag_size), s) || s.size() != 32) return false;
  std::memcpy(rs_.data(), s.data(), 32);
  if (!d_->mix_dh(d_->e_secret, rs_)) return false;
  std::vector<std::uint8_t> p;
  if (!d_->decrypt_and_hash(msg.subspan(32 + tag_size), p)) return false;
  if (payload) *payload = std::move(p);
  else if (!p.empty()) return false;
  return true;
}

NoiseXX::Result NoiseXX::split() const {
  auto [k1, k2] = hkdf2(d_->ck, {});
  Result r;
  r.send = d_->initiator ? k1 : k2;
  r.recv = d_->initiator ? k2 : k1;
  // The join secret is bound to this handshake's whole transcript (h) and chaining key.
  auto kdf = Botan::KDF::create_or_throw("HKDF(SHA-256)");
  static constexpr char label[] = "xdfs session secret v1";
  auto out = kdf->derive_key(32, d_->ck.data(), d_->ck.size(), d_->h.data(), d_->h.size(),
                             reinterpret_cast<const std::uint8_t*>(label), sizeof label - 1);
  std::memcpy(r.session_secret.data(), out.data(), 32);
  return r;
}

JoinKeys derive_join_keys(const Key32& session_secret, std::span<const std::uint8_t> client_nonce,
                          std::span<const std::uint8_t> server_nonce, std::span<const std::uint8_t> opening) {
  std::vector<std::uint8_t> salt(client_nonce.begin(), client_nonce.end());
  salt.insert(salt.end(), server_nonce.begin(), server_nonce.end());
  static constexpr char label[] = "xdfs join v1";
  std::vector<std::uint8_t> info(label, label + sizeof label - 1);
  auto oh = sha256(opening);
  info.insert(info.end(), oh.begin(), oh.end());
  auto kdf = Botan::KDF::create_or_throw("HKDF(SHA-256)");
  auto out = kdf->derive_key(96, session_secret.data(), session_secret.size(), salt.data(), salt.size(), info.data(),
                             info.size());
  JoinKeys k;
  std::memcpy(k.client_to_server.data(), out.data(), 32);
  std::memcpy(k.server_to_client.data(), out.data() + 32, 32);
  std::memcpy(k.confirm.data(), out.data() + 64, 32);
  return k;
}

Key32 join_proof(const JoinKeys& k, const char* side, std::span<const std::uint8_t> client_nonce,
                 std::span<const std::uint8_t> server_nonce) {
  std::vector<std::uint8_t> msg(side, side + std::strlen(side));
  msg.insert(msg.end(), client_nonce.begin(), client_nonce.end());
  msg.insert(msg.end(), server_nonce.begin(), server_nonce.end());
  return hmac(k.confirm, msg);
}

bool equal_constant_time(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) noexcept {
  return a.size() == b.size() && Botan::constant_time_compare(a.data(), b.data(), a.size());
}

// ---------------------------------------------------------------------------------------------
// Frame protection

namespace {
// A separate key for MACs, so that one key never serves two primitives.
Key32 mac_subkey(const Key32& k) {
  static constexpr char label[] = "xdfs frame mac v1";
  return hmac(k, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(label), sizeof label - 1));
}
bool is_data(wire::ChannelEvent e) { return e == wire::ChannelEvent::xftsmu || e == wire::ChannelEvent::xftsmd; }
}  // namespace

FrameProtector::FrameProtector(Protect mode, Cipher cipher, const Key32& send_key, const Key32& recv_key)
    : mode_(mode), cipher_(cipher) {
  if (mode == Protect::private_) {
    const char* name = to_string(cipher);
    enc_ = Botan::AEAD_Mode::create_or_throw(name, Botan::ENCRYPTION);
    dec_ = Botan::AEAD_Mode::create_or_throw(name, Botan::DECRYPTION);
    enc_->set_key(send_key.data(), send_key.size());
    dec_->set_key(recv_key.data(), recv_key.size());
  }
  mac_send_ = Botan::MessageAuthenticationCode::create_or_throw("GMAC(AES-256)");
  mac_recv_ = Botan::MessageAuthenticationCode::create_or_throw("GMAC(AES-256)");
  send_key_ = mac_subkey(send_key);
  recv_key_ = mac_subkey(recv_key);
}

FrameProtector::~FrameProtector() = default;

std::size_t FrameProtector::tag_bytes(wire::ChannelEvent e) const noexcept {
  const bool data = e == wire::ChannelEvent::xftsmu || e == wire::ChannelEvent::xftsmd;
  return (mode_ == Protect::clear && data) ? 0 : tag_size;
}

void FrameProtector::seal(const wire::HeaderBytes& header, std::span<std::uint8_t> payload, std::uint8_t* tag) {
  const auto n = counter_nonce(send_n_++);
  const auto ev = static_cast<wire::ChannelEvent>(header[0]);
  if (tag_bytes(ev) == 0) return;  // clear data frame: counted, not protected
  if (mode_ != Protect::private_ || is_data(ev)) {
    // A data frame's payload ends with its block's own tag (made on the disk thread): covering
    // that tag covers the data.
    auto covered = is_data(ev) ? payload.last(std::min<std::size_t>(payload.size(), tag_size)) : payload;
    return gmac(*mac_send_, send_key_, n, header, covered, tag);
  }
  aead_seal(*enc_, n, header, payload.data(), payload.size(), tag);
}

bool FrameProtector::open(const wire::HeaderBytes& header, std::span<std::uint8_t> payload, const std::uint8_t* tag) {
  const auto n = counter_nonce(recv_n_++);
  const auto ev = static_cast<wire::ChannelEvent>(header[0]);
  if (tag_bytes(ev) == 0) return true;
  if (mode_ != Protect::private_ || is_data(ev)) {
    auto covered = is_data(ev) ? payload.last(std::min<std::size_t>(payload.size(), tag_size)) : payload;
    std::uint8_t expect[tag_size];
    gmac(*mac_recv_, recv_key_, n, header, covered, expect);
    return Botan::constant_time_compare(expect, tag, tag_size);
  }
  return aead_open(*dec_, n, header, payload.data(), payload.size(), tag);
}

}  // namespace xdfs::xsec

// ---------------------------------------------------------------------------------------------
// Block payloads

namespace xdfs::xsec {

Key32 data_key(const Key32& session_secret, bool client_to_server, std::uint64_t transfer) {
  auto kdf = Botan::KDF::create_or_throw("HKDF(SHA-256)");
  // The label, then the transfer number in 8 big-endian bytes: one key per direction and operation.
  std::string label = client_to_server ? "xdfs data c2s v2" : "xdfs data s2c v2";
  for (int shift = 56; shift >= 0; shift -= 8) label.push_back(static_cast<char>((transfer >> shift) & 0xff));
  auto out = kdf->derive_key(32, session_secret.data(), session_secret.size(), nullptr, 0,
                             reinterpret_cast<const std::uint8_t*>(label.data()), label.size());
  Key32 k;
  std::memcpy(k.data(), out.data(), 32);
  return k;
}

// A block's AEAD on OpenSSL's EVP: the same AES-256-GCM or ChaCha20-Poly1305 (RFC 8439) as
// Botan's, bytes for bytes, in about half the CPU time where the CPU has AES-NI and carry-less
// multiply (one pass of AES and GHASH together, in wide registers where there are); and GMAC,
// which is AES-256-GCM over associated data alone. Blocks are the bulk of the private and
// integrity modes; the handshakes and frames stay with Botan. One direction, one key.
static_assert(sizeof(Nonce) == 12, "both ciphers' default IV length");
static_assert(std::uint64_t(wire::max_block_size) + wire::max_block_tag <= INT_MAX, "EVP takes lengths as int");

class BlockCrypto::Evp {
public:
  Evp(Cipher cipher, const Key32& key, bool encrypt) : ctx_(EVP_CIPHER_CTX_new()), encrypt_(encrypt) {
    const EVP_CIPHER* c = cipher == Cipher::aes256gcm ? EVP_aes_256_gcm() : EVP_chacha20_poly1305();
    if (!ctx_ || !c || EVP_CipherInit_ex(ctx_, c, nullptr, key.data(), nullptr, encrypt ? 1 : 0) != 1) {
      EVP_CIPHER_CTX_free(ctx_);
      throw Error(errc::internal, std::string("OpenSSL's ") + to_string(cipher) + ": " + openssl_error());
    }
  }
  // What OpenSSL's error queue says last (and the queue emptied), or a generic reason.
  static std::string openssl_error() {
    char text[256] = "no reason given";
    for (unsigned long e; (e = ERR_get_error()) != 0;) ERR_error_string_n(e, text, sizeof text);
    return text;
  }
  ~Evp() { EVP_CIPHER_CTX_free(ctx_); }
  Evp(const Evp&) = delete;
  Evp& operator=(const Evp&) = delete;

  // In place; the tag goes to (seal) or is checked against (open) `tag`. False: the block or
  // its tag is not what was sealed (its bytes are then garbage), or OpenSSL failed.
  bool run(const Nonce& n, std::span<const std::uint8_t> ad, std::uint8_t* data, std::size_t len, std::uint8_t* tag) {
    int out = 0;
    if (EVP_CipherInit_ex(ctx_, nullptr, nullptr, nullptr, n.data(), encrypt_ ? 1 : 0) != 1 ||
        EVP_CipherUpdate(ctx_, nullptr, &out, ad.data(), static_cast<int>(ad.size())) != 1 ||
        (len > 0 && EVP_CipherUpdate(ctx_, data, &out, data, static_cast<int>(len)) != 1))
      return false;
    if (!encrypt_ && EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_SET_TAG, static_cast<int>(xsec::tag_size), tag) != 1) return false;
    if (EVP_CipherFinal_ex(ctx_, data + len, &out) != 1) return false;
    return !encrypt_ || EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_GET_TAG, static_cast<int>(xsec::tag_size), tag) == 1;
  }

  // GMAC (a sealing AES-256-GCM context): the tag of ad then data, both associated data, into
  // `tag`. False if OpenSSL failed.
  bool mac(const Nonce& n, std::span<const std::uint8_t> ad, const std::uint8_t* data, std::size_t len, std::uint8_t* tag) {
    int out = 0;
    std::uint8_t none[16];  // the final call writes no bytes: there is no plaintext
    return EVP_CipherInit_ex(ctx_, nullptr, nullptr, nullptr, n.data(), 1) == 1 &&
           EVP_CipherUpdate(ctx_, nullptr, &out, ad.data(), static_cast<int>(ad.size())) == 1 &&
           (len == 0 || EVP_CipherUpdate(ctx_, nullptr, &out, data, static_cast<int>(len)) == 1) &&
           EVP_CipherFinal_ex(ctx_, none, &out) == 1 &&
           EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_GET_TAG, static_cast<int>(xsec::tag_size), tag) == 1;
  }

private:
  EVP_CIPHER_CTX* ctx_;
  bool encrypt_;
};

namespace {
// A block is sealed once per operation and direction (its key), so its offset is a unique nonce; the associated
// data binds offset and length.
Nonce block_nonce(std::uint64_t offset) { return counter_nonce(offset, {'b', 'l', 'k', 0}); }
std::array<std::uint8_t, 12> block_ad(std::uint64_t offset, std::uint32_t len) {
  std::array<std::uint8_t, 12> a{};
  for (int i = 0; i < 8; ++i) a[i] = static_cast<std::uint8_t>(offset >> (8 * i));
  for (int i = 0; i < 4; ++i) a[8 + i] = static_cast<std::uint8_t>(len >> (8 * i));
  return a;
}
}  // namespace

BlockCrypto::BlockCrypto(Protect mode, Cipher cipher, const Key32& key) : mode_(mode), cipher_(cipher), key_(key) {
  if (mode == Protect::private_) {
    seal_ = std::make_unique<Evp>(cipher, key, true);
    open_ = std::make_unique<Evp>(cipher, key, false);
  } else {
    seal_ = std::make_unique<Evp>(Cipher::aes256gcm, key, true);  // GMAC(AES-256), whatever the cipher
  }
}

BlockCrypto::~BlockCrypto() { OPENSSL_cleanse(key_.data(), key_.size()); }

std::unique_ptr<piod::BlockSealer> BlockCrypto::clone() const {
  return std::make_unique<BlockCrypto>(mode_, cipher_, key_);
}

void BlockCrypto::seal(std::uint8_t* data, DataLength length, FileOffset at) {
  const std::uint32_t len = length.value();
  const auto n = block_nonce(at.value());
  const auto ad = block_ad(at.value(), len);
  if (mode_ != Protect::private_ ? !seal_->mac(n, ad, data, len, data + len) : !seal_->run(n, ad, data, len, data + len))
    throw Error(errc::internal, "sealing the block at offset " + std::to_string(at.value()) + ": " + Evp::openssl_error());
}

bool BlockCrypto::open(std::uint8_t* data, DataLength length, FileOffset at) {
  const std::uint32_t len = length.value();
  const auto n = block_nonce(at.value());
  const auto ad = block_ad(at.value(), len);
  std::uint8_t expect[xsec::tag_size];
  const bool ok = mode_ != Protect::private_
                      ? seal_->mac(n, ad, data, len, expect) && Botan::constant_time_compare(expect, data + len, xsec::tag_size)
                      : open_->run(n, ad, data, len, data + len);
  if (!ok) ERR_clear_error();  // a forged block is the peer's doing: nothing of it stays on this thread
  return ok;
}

}  // namespace xdfs::xsec

// ---------------------------------------------------------------------------------------------
// Handshakes on channels

namespace xdfs::xsec {
namespace {

// Noise messages 1 and 2 and the join messages are at most 96 bytes; message 3 carries the
// negotiation.
constexpr std::uint32_t max_handshake_payload = 32 + 2 * tag_size + wire::max_negotiation_payload;

HandshakeResult failure(errc code, std::string msg, bool remote = false) {
  HandshakeResult r;
  r.code = code;
  r.message = std::move(msg);
  r.remote = remote;
  return r;
}

void send_handshake(xdsi::Channel& ch, std::vector<std::uint8_t> bytes) {
  ch.send_control(wire::ChannelEvent::handshake, std::move(bytes));
}

// An exception a client sends during a handshake: a reason, a line long. A server, which names
// paths in its reasons, may send up to a control frame's limit.
constexpr std::uint32_t max_client_exception = 4096;
constexpr std::uint32_t max_server_exception = wire::max_control_payload;
// The exact sizes of the fixed handshake messages: XX's e; e, ee, s, es (with an empty payload);
// a join's server nonce and proof; a join's client proof.
constexpr std::uint32_t msg1_size = 32, msg2_size = 32 + 32 + 2 * tag_size, join_answer_size = 64, proof_size = 32;

// What ended a read during the handshake, as XDSI names it.
HandshakeResult failed_read(const xdsi::Channel& ch, const xdsi::ErrorCode& ec) {
  auto f = ch.failure(ec);
  return failure(f.code, f.message + " during the handshake", f.from_peer);
}

// Reads one HANDSHAKE frame of at most `max` bytes (what that step's message can be: a peer's
// header cannot make us set aside more); an EXCEPTION from the peer (of at most max_exception
// bytes) ends the handshake with its cause.
void read_handshake(xdsi::Channel& ch, std::uint32_t max, std::uint32_t max_exception,
                    std::function<void(HandshakeResult, std::vector<std::uint8_t>)> next) {
  ch.async_read_header([&ch, max, max_exception, next = std::move(next)](const xdsi::ErrorCode& ec,
                                                                         const wire::FrameHeader& h) {
    if (ec) return next(failed_read(ch, ec), {});
    const bool ex = h.event == wire::ChannelEvent::exception;
    if (!ex && h.event != wire::ChannelEvent::handshake)
      return next(failure(errc::protocol_error, std::string("expected a handshake message, got ") + wire::to_string(h.event)), {});
    if (h.length > (ex ? max_exception : max))
      return next(failure(errc::protocol_error, "a handshake message of " + std::to_string(h.length) + " bytes (at most " +
                                                    std::to_string(ex ? max_exception : max) + ")"),
                  {});
    auto buf = std::make_shared<std::vector<std::uint8_t>>(h.length);
    ch.async_read_payload(*buf, [buf, ex, &ch, next](const xdsi::ErrorCode& ec2) {
      if (ec2) return next(failed_read(ch, ec2), {});
      if (ex) {
        std::string why;
        auto e = wire::decode_exception(*buf, &why);
        if (!e) return next(failure(errc::protocol_error, "bad exception header: " + why), {});
        return next(failure(e->code, e->message, true), {});
      }
      next(HandshakeResult{}, std::move(*buf));
    });
  });
}

void install(xdsi::Channel& ch, Protect mode, Cipher cipher, const Key32& send, const Key32& recv) {
  ch.protect(std::make_unique<FrameProtector>(mode, cipher, send, recv));
}

}  // namespace

void client_establish(xdsi::Channel& ch, std::vector<std::uint8_t> opening, const KeyPair& self, Protect mode,
                      Cipher cipher, std::vector<std::uint8_t> payload, ServerKeyCheck check, HandshakeHandler h) {
  auto noise = std::make_shared<NoiseXX>(true, self, opening);
  send_handshake(ch, noise->write_message_1());
  read_handshake(ch, msg2_size, max_server_exception,
                 [&ch, noise, mode, cipher, payload = std::move(payload), check = std::move(check),
                  h = std::move(h)](HandshakeResult r, std::vector<std::uint8_t> msg2) {
    if (r.code != errc::ok) return h(r);
    if (!noise->read_message_2(msg2))
      return h(failure(errc::auth_failed,
                       "the server's handshake does not verify (a changed opening, or not the server's key)"));
    // The server is known before the negotiation leaves: a stranger never learns what is moved.
    if (auto verdict = check(noise->remote_static()); verdict.code != errc::ok) return h(verdict);
    auto msg3 = noise->write_message_3(payload);
    if (msg3.empty()) return h(failure(errc::auth_failed, "the server's ephemeral key is a low-order point"));
    send_handshake(ch, std::move(msg3));
    auto keys = noise->split();
    install(ch, mode, cipher, keys.send, keys.recv);
    // The server confirms (an empty, protected HANDSHAKE frame) once it has accepted the key and
    // the negotiation and the session exists; only then may the other channels join it.
    read_handshake(ch, 0, max_server_exception,
                   [noise, keys, h = std::move(h)](HandshakeResult r4, std::vector<std::uint8_t> confirm) {
      if (r4.code != errc::ok) return h(r4);
      if (!confirm.empty()) return h(failure(errc::protocol_error, "the server's confirmation carries a payload"));
      HandshakeResult ok;
      ok.remote_static = noise->remote_static();
      ok.session_secret = keys.session_secret;
      h(ok);
    });
  });
}

void server_establish(xdsi::Channel& ch, std::vector<std::uint8_t> opening, const KeyPair& self, Protect mode,
                      Cipher cipher, Defer defer, HandshakeHandler h) {
  auto noise = std::make_shared<NoiseXX>(false, self, opening);
  if (!defer) defer = [](std::function<void()> work) { work(); };
  read_handshake(ch, msg1_size, max_client_exception,
                 [&ch, noise, mode, cipher, defer, h = std::move(h)](HandshakeResult r,
                                                                     std::vector<std::uint8_t> msg1) mutable {
    if (r.code != errc::ok) return h(r);
    if (msg1.size() != msg1_size) return h(failure(errc::protocol_error, "malformed first handshake message"));
    defer([&ch, noise, mode, cipher, defer, h = std::move(h), msg1 = std::move(msg1)]() mutable {
      if (!noise->read_message_1(msg1)) return h(failure(errc::protocol_error, "malformed first handshake message"));
      auto msg2 = noise->write_message_2();
      if (msg2.empty()) return h(failure(errc::auth_failed, "the client's ephemeral key is a low-order point"));
      send_handshake(ch, std::move(msg2));
      read_handshake(ch, max_handshake_payload, max_client_exception,
                     [&ch, noise, mode, cipher, defer, h = std::move(h)](HandshakeResult r2,
                                                                         std::vector<std::uint8_t> msg3) mutable {
        if (r2.code != errc::ok) return h(r2);
        defer([&ch, noise, mode, cipher, h = std::move(h), msg3 = std::move(msg3)] {
          HandshakeResult ok;
          if (!noise->read_message_3(msg3, &ok.payload))
            return h(failure(errc::auth_failed,
                             "the client's handshake does not verify (a changed opening, or a wrong key)"));
          auto keys = noise->split();
          install(ch, mode, cipher, keys.send, keys.recv);
          ok.remote_static = noise->remote_static();
          ok.session_secret = keys.session_secret;
          h(std::move(ok));
        });
      });
    });
  });
}

void client_join(xdsi::Channel& ch, std::vector<std::uint8_t> opening, std::vector<std::uint8_t> client_nonce,
                 const Key32& session_secret, Protect mode, Cipher cipher, HandshakeHandler h) {
  read_handshake(ch, join_answer_size, max_server_exception,
                 [&ch, opening = std::move(opening), client_nonce = std::move(client_nonce), session_secret, mode,
                  cipher, h = std::move(h)](HandshakeResult r, std::vector<std::uint8_t> msg) {
    if (r.code != errc::ok) return h(r);
    if (msg.size() != join_answer_size) return h(failure(errc::protocol_error, "join answer of " + std::to_string(msg.size()) + " bytes"));
    std::span<const std::uint8_t> server_nonce(msg.data(), 32);
    auto keys = derive_join_keys(session_secret, client_nonce, server_nonce, opening);
    auto expect = join_proof(keys, "server", client_nonce, server_nonce);
    if (!equal_constant_time(expect, std::span<const std::uint8_t>(msg.data() + 32, 32)))
      return h(failure(errc::auth_failed, "the server's join proof does not verify"));
    auto proof = join_proof(keys, "client", client_nonce, server_nonce);
    send_handshake(ch, std::vector<std::uint8_t>(proof.begin(), proof.end()));
    install(ch, mode, cipher, keys.client_to_server, keys.server_to_client);
    h(HandshakeResult{});
  });
}

void server_join(xdsi::Channel& ch, std::vector<std::uint8_t> opening, std::vector<std::uint8_t> client_nonce,
                 const Key32& session_secret, Protect mode, Cipher cipher, HandshakeHandler h) {
  std::vector<std::uint8_t> server_nonce(32);
  random_fill(server_nonce);
  auto keys = derive_join_keys(session_secret, client_nonce, server_nonce, opening);
  auto proof = join_proof(keys, "server", client_nonce, server_nonce);
  std::vector<std::uint8_t> msg(server_nonce);
  msg.insert(msg.end(), proof.begin(), proof.end());
  send_handshake(ch, std::move(msg));
  read_handshake(ch, proof_size, max_client_exception,
                 [&ch, keys, client_nonce = std::move(client_nonce), server_nonce, mode, cipher,
                  h = std::move(h)](HandshakeResult r, std::vector<std::uint8_t> answer) {
    if (r.code != errc::ok) return h(r);
    auto expect = join_proof(keys, "client", client_nonce, server_nonce);
    if (!equal_constant_time(expect, answer))
      return h(failure(errc::auth_failed, "join proof does not verify: the channel does not hold this session's secret"));
    install(ch, mode, cipher, keys.server_to_client, keys.client_to_server);
    h(HandshakeResult{});
  });
}

}  // namespace xdfs::xsec
