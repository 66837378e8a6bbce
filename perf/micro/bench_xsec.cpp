// xSec protection of the data path. A block's payload is sealed once, on the disk thread, by
// BlockCrypto (integrity: GMAC tag; private: AEAD, AES-256-GCM or ChaCha20-Poly1305), and its
// tag travels at the end of the payload; the network thread's FrameProtector then MACs each data
// frame's header together with that tag, so its cost is per frame, not per byte (the frame
// benchmarks count frames; the block benchmark counts bytes).
#include <benchmark/benchmark.h>
#include <botan/aead.h>
#include <botan/block_cipher.h>
#include <botan/mac.h>
#include <botan/stream_cipher.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "xdfs/wire.hpp"
#include "xdfs/xsec.hpp"

namespace {

using namespace xdfs;
using xsec::Cipher;
using xsec::Protect;

xsec::Key32 key(std::uint8_t fill) {
  xsec::Key32 k;
  k.fill(fill);
  return k;
}

std::string label(Protect p, Cipher c) {
  return std::string(xsec::to_string(p)) + (p == Protect::private_ ? std::string(", ") + xsec::to_string(c) : "");
}

void BM_FrameSeal(benchmark::State& state) {
  const auto mode = static_cast<Protect>(state.range(0));
  const auto cipher = static_cast<Cipher>(state.range(1));
  const auto len = static_cast<std::uint32_t>(state.range(2));
  xsec::FrameProtector tx(mode, cipher, key(1), key(2));
  std::vector<std::uint8_t> payload(len, 0x5a);
  std::uint8_t tag[xsec::tag_size];
  std::uint64_t off = 0;
  for (auto _ : state) {
    const auto header = wire::encode(wire::FrameHeader{wire::ChannelEvent::xftsmu, 0, len, off, 0});
    tx.seal(header, payload, tag);
    off += len;
    benchmark::DoNotOptimize(tag);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(label(mode, cipher));
}

void BM_FrameSealOpen(benchmark::State& state) {
  const auto mode = static_cast<Protect>(state.range(0));
  const auto cipher = static_cast<Cipher>(state.range(1));
  const auto len = static_cast<std::uint32_t>(state.range(2));
  xsec::FrameProtector tx(mode, cipher, key(1), key(2));
  xsec::FrameProtector rx(mode, cipher, key(2), key(1));
  std::vector<std::uint8_t> payload(len, 0x5a);
  std::uint8_t tag[xsec::tag_size];
  std::uint64_t off = 0;
  for (auto _ : state) {
    const auto header = wire::encode(wire::FrameHeader{wire::ChannelEvent::xftsmu, 0, len, off, 0});
    tx.seal(header, payload, tag);
    if (!rx.open(header, payload, tag)) {
      state.SkipWithError("open refused a frame sealed by its peer");
      break;
    }
    off += len;
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(label(mode, cipher));
}

void BM_BlockSealOpen(benchmark::State& state) {
  const auto mode = static_cast<Protect>(state.range(0));
  const auto cipher = static_cast<Cipher>(state.range(1));
  const auto len = static_cast<std::uint32_t>(state.range(2));
  xsec::BlockCrypto crypto(mode, cipher, key(3));
  std::vector<std::uint8_t> block(len + crypto.tag_size().value(), 0x5a);
  std::uint64_t off = 0;
  for (auto _ : state) {
    crypto.seal(block.data(), DataLength(len), FileOffset(off));
    if (!crypto.open(block.data(), DataLength(len), FileOffset(off))) {
      state.SkipWithError("open refused a block it sealed");
      break;
    }
    off += len;
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(len));
  state.SetLabel(label(mode, cipher));
}

void modes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"mode", "cipher", "bytes"});
  for (std::int64_t len : {64 << 10, 1 << 20}) {
    b->Args({static_cast<std::int64_t>(Protect::integrity), 0, len});
    b->Args({static_cast<std::int64_t>(Protect::private_), static_cast<std::int64_t>(Cipher::aes256gcm), len});
    b->Args({static_cast<std::int64_t>(Protect::private_), static_cast<std::int64_t>(Cipher::chacha20poly1305), len});
  }
}
// Botan 2's own speed for what private mode can be built from, one direction over 1 MiB: the
// ceiling of sealing (or opening) a block on one core. AES-256/GCM is CTR(AES-256) plus GHASH
// (measured as GMAC); AES-256 alone (ECB) is what a counter-mode keystream can cost at best.
constexpr std::array<const char*, 7> primitives = {"AES-256/GCM",     "AES-256/OCB",   "ChaCha20Poly1305",
                                                   "CTR-BE(AES-256)", "GMAC(AES-256)", "Poly1305",
                                                   "AES-256"};

void BM_BotanPrimitive(benchmark::State& state) {
  const std::string name = primitives.at(static_cast<std::size_t>(state.range(0)));
  std::vector<std::uint8_t> buf(1 << 20, 0x5a), k(32, 7), nonce(12, 1);
  std::function<void()> once;
  std::unique_ptr<Botan::AEAD_Mode> aead;
  std::unique_ptr<Botan::StreamCipher> stream;
  std::unique_ptr<Botan::MessageAuthenticationCode> mac;
  std::unique_ptr<Botan::BlockCipher> block;
  if ((aead = Botan::AEAD_Mode::create(name, Botan::ENCRYPTION))) {
    aead->set_key(k.data(), k.size());
    once = [&] {
      ++nonce[0];
      aead->start(nonce.data(), nonce.size());
      aead->process(buf.data(), buf.size() / aead->update_granularity() * aead->update_granularity());
      Botan::secure_vector<std::uint8_t> rest;
      aead->finish(rest);
    };
  } else if ((stream = Botan::StreamCipher::create(name))) {
    stream->set_key(k.data(), k.size());
    once = [&] { stream->cipher1(buf.data(), buf.size()); };
  } else if ((mac = Botan::MessageAuthenticationCode::create(name))) {
    once = [&] {
      mac->set_key(k.data(), k.size());  // Poly1305 keys are one-time; GMAC forgets its key at final()
      if (name.rfind("GMAC", 0) == 0) mac->start(nonce.data(), nonce.size());
      mac->update(buf.data(), buf.size());
      benchmark::DoNotOptimize(mac->final());
    };
  } else if ((block = Botan::BlockCipher::create(name))) {
    block->set_key(k.data(), k.size());
    once = [&] { block->encrypt_n(buf.data(), buf.data(), buf.size() / block->block_size()); };
  } else {
    state.SkipWithError(("Botan has no " + name).c_str());
    return;
  }
  for (auto _ : state) once();
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(buf.size()));
  state.SetLabel(name);
}

BENCHMARK(BM_BotanPrimitive)->DenseRange(0, primitives.size() - 1)->ArgName("primitive");
BENCHMARK(BM_FrameSeal)->Apply(modes);
BENCHMARK(BM_FrameSealOpen)->Apply(modes);
BENCHMARK(BM_BlockSealOpen)->Apply(modes);

}  // namespace
