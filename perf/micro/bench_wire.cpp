// Frame codec: the 24-byte data-frame header every block carries, and the Cap'n Proto
// negotiation header every channel opens with.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "xdfs/wire.hpp"

namespace {

using namespace xdfs::wire;

constexpr std::uint32_t kBlock = 1 << 20;

void BM_FrameHeaderEncode(benchmark::State& state) {
  FrameHeader h{ChannelEvent::xftsmu, 0, kBlock, 0, 0};
  for (auto _ : state) {
    h.offset += kBlock;
    HeaderBytes b = encode(h);
    benchmark::DoNotOptimize(b);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FrameHeaderEncode);

void BM_FrameHeaderDecode(benchmark::State& state) {
  // A ring of distinct valid headers so the decoder cannot be specialised to one input.
  std::vector<HeaderBytes> in;
  for (std::uint64_t i = 0; i < 256; ++i) in.push_back(encode(FrameHeader{ChannelEvent::xftsmd, 0, kBlock, i * kBlock, 0}));
  std::size_t i = 0;
  for (auto _ : state) {
    auto h = decode(std::span<const std::uint8_t, frame_header_size>(in[i++ & 255]));
    benchmark::DoNotOptimize(h);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FrameHeaderDecode);

void BM_FrameHeaderDecodeRejects(benchmark::State& state) {
  // The hostile-input path: an unknown event must be refused (and explained) cheaply.
  HeaderBytes bad = encode(FrameHeader{ChannelEvent::ack, 0, 0, 1, 0});
  bad[0] = 0xee;
  std::string why;
  for (auto _ : state) {
    auto h = decode(std::span<const std::uint8_t, frame_header_size>(bad), &why);
    benchmark::DoNotOptimize(h);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FrameHeaderDecodeRejects);

void BM_FrameHeaderRoundTrip(benchmark::State& state) {
  FrameHeader h{ChannelEvent::xftsmu, 0, kBlock, 0, 0};
  for (auto _ : state) {
    h.offset += kBlock;
    HeaderBytes b = encode(h);
    auto back = decode(std::span<const std::uint8_t, frame_header_size>(b));
    benchmark::DoNotOptimize(back);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FrameHeaderRoundTrip);

Negotiation sample_negotiation() {
  Negotiation n;
  n.channel_count = 64;
  n.mode = xdfs::Mode::upload;
  n.remote_path = "incoming/run-42/big-file.iso";
  n.block_size = kBlock;
  n.file_size = 4ull << 30;
  return n;
}

void BM_NegotiationEncode(benchmark::State& state) {
  const Negotiation n = sample_negotiation();
  for (auto _ : state) {
    auto bytes = encode(n);
    benchmark::DoNotOptimize(bytes);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_NegotiationEncode);

void BM_NegotiationDecode(benchmark::State& state) {
  const auto bytes = encode(sample_negotiation());
  for (auto _ : state) {
    auto n = decode_negotiation(bytes);
    benchmark::DoNotOptimize(n);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_NegotiationDecode);

}  // namespace
