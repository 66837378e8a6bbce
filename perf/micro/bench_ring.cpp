// SpscRing: the lock-free ring between a session's network thread and its disk thread.
#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdint>
#include <thread>

#include "xdfs/piod.hpp"

namespace {

using xdfs::FileOffset;
using xdfs::piod::Block;
using xdfs::piod::SpscRing;

// One thread pushes a burst then pops it: the uncontended cost of an operation pair.
void BM_SpscRingPushPopSingleThread(benchmark::State& state) {
  const auto burst = static_cast<std::size_t>(state.range(0));
  SpscRing<Block> ring(burst);
  Block b{};
  std::uint64_t sum = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < burst; ++i) {
      b.offset = FileOffset(i);
      ring.try_push(b);
    }
    Block out;
    for (std::size_t i = 0; i < burst; ++i) {
      ring.try_pop(out);
      sum += out.offset.value();
    }
  }
  benchmark::DoNotOptimize(sum);
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(burst));
}
BENCHMARK(BM_SpscRingPushPopSingleThread)->Arg(1)->Arg(32)->Arg(1024);

// A producer thread and the benchmark thread as consumer, spinning when full/empty: the
// cross-core hand-off rate. Capacity is the argument (the real pipe holds ring/block slots).
void BM_SpscRingTwoThreads(benchmark::State& state) {
  const auto capacity = static_cast<std::size_t>(state.range(0));
  constexpr std::uint64_t kItems = 1 << 20;
  std::uint64_t sum = 0;
  for (auto _ : state) {
    SpscRing<Block> ring(capacity);
    std::thread producer([&] {
      Block b{};
      for (std::uint64_t i = 0; i < kItems; ++i) {
        b.offset = FileOffset(i);
        while (!ring.try_push(b)) std::this_thread::yield();
      }
    });
    Block out;
    for (std::uint64_t i = 0; i < kItems; ++i) {
      while (!ring.try_pop(out)) std::this_thread::yield();
      sum += out.offset.value();
    }
    producer.join();
  }
  benchmark::DoNotOptimize(sum);
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(kItems));
}
BENCHMARK(BM_SpscRingTwoThreads)->Arg(32)->Arg(1024)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
