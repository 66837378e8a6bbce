// The receive path's disk side: a network-side loop hands filled blocks through a BlockPipe to
// a DiskWriter, which coalesces contiguous runs into one pwritev and hands the slots back.
// Sinks: discard (the memory-mode sink: pure hand-off cost) and a file in /dev/shm (tmpfs: the
// vectored write without a disk). Block order: in order, or pairs swapped (what n channels
// interleaving looks like to the writer).
#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "xdfs/piod.hpp"
#include "xdfs/xsec.hpp"

namespace {

using namespace xdfs::piod;
using xdfs::DataLength;
using xdfs::FileOffset;

constexpr std::uint64_t kRing = 32ull << 20;  // xdfsd's default --ring
constexpr std::uint64_t kBytes = 256ull << 20; // per iteration

enum SinkKind { discard = 0, shm_file = 1 };

struct ShmFile {
  std::string path;
  int fd = -1;
  ShmFile() {
    char name[] = "/dev/shm/xdfs_micro_XXXXXX";
    fd = ::mkstemp(name);
    if (fd < 0) throw std::runtime_error("mkstemp in /dev/shm failed");
    path = name;
  }
  ~ShmFile() {
    if (fd >= 0) ::close(fd);
    ::unlink(path.c_str());
  }
};

void wait_wake(BlockPipe& pipe) {
  pollfd p{pipe.net_wake().fd(), POLLIN, 0};
  while (::poll(&p, 1, 10000) < 0 && errno == EINTR) {
  }
  pipe.net_wake().drain();
}

// The network thread's part: feed every block of `total` bytes, recycle the returned slots.
void feed(BlockPipe& pipe, const std::vector<std::uint64_t>& order, std::uint64_t total) {
  const std::uint32_t bs = pipe.block_size();
  std::vector<std::uint32_t> free_slots;
  for (std::uint32_t s = 0; s < pipe.slots(); ++s) free_slots.push_back(s);
  std::size_t next = 0, outstanding = 0;
  while (next < order.size() || outstanding > 0) {
    while (next < order.size() && !free_slots.empty()) {
      const std::uint64_t off = order[next++] * bs;
      const auto len = static_cast<std::uint32_t>(std::min<std::uint64_t>(bs, total - off));
      pipe.to_disk(Block{free_slots.back(), DataLength(len), FileOffset(off)});
      free_slots.pop_back();
      ++outstanding;
    }
    bool got = false;
    Block b;
    while (pipe.from_disk(b)) {
      free_slots.push_back(b.slot);
      --outstanding;
      got = true;
    }
    if (pipe.failed()) throw std::runtime_error(pipe.error_text());
    if (!got) wait_wake(pipe);
  }
}

void BM_DiskWriter(benchmark::State& state) {
  const auto bs = static_cast<std::uint32_t>(state.range(0));
  const bool swapped = state.range(1) != 0;
  const auto sink_kind = static_cast<SinkKind>(state.range(2));
  const std::uint64_t blocks = kBytes / bs;
  std::vector<std::uint64_t> order(blocks);
  for (std::uint64_t i = 0; i < blocks; ++i) order[i] = swapped ? (i ^ 1) : i;

  std::optional<ShmFile> file;
  if (sink_kind == shm_file) {
    file.emplace();
    if (::ftruncate(file->fd, static_cast<off_t>(kBytes)) != 0) {
      state.SkipWithError("ftruncate failed");
      return;
    }
  }
  Sink sink = file ? Sink{file->fd, true, false} : Sink{-1, true, true};
  BlockPipe pipe(bs, static_cast<std::uint32_t>(kRing / bs));
  DiskWriter writer(pipe, sink);
  for (auto _ : state) {
    try {
      feed(pipe, order, kBytes);
    } catch (const std::exception& e) {
      state.SkipWithError(e.what());
      break;
    }
  }
  // A discard sink moves no bytes: its figure is blocks handed over and back per second.
  if (sink_kind == shm_file) state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kBytes));
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(blocks));
  state.SetLabel(std::string(sink_kind == discard ? "discard" : "/dev/shm") + (swapped ? ", pairs swapped" : ", in order"));
}
BENCHMARK(BM_DiskWriter)
    ->ArgNames({"block", "swapped", "shm"})
    ->ArgsProduct({{64 << 10, 1 << 20}, {0, 1}, {discard, shm_file}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// kBytes of 'x' into the file.
bool fill(ShmFile& file, benchmark::State& state) {
  std::vector<char> chunk(1 << 20, 'x');
  for (std::uint64_t done = 0; done < kBytes; done += chunk.size())
    if (::write(file.fd, chunk.data(), chunk.size()) != static_cast<ssize_t>(chunk.size())) {
      state.SkipWithError("write failed");
      return false;
    }
  return true;
}

// The network side of a sending pipe: takes kBytes of blocks, handing each slot back at once.
void take_all(BlockPipe& pipe, benchmark::State& state) {
  std::uint64_t got = 0;
  while (got < kBytes) {
    Block b;
    bool any = false;
    while (pipe.from_disk(b)) {
      got += b.length.value();
      pipe.to_disk(Block{b.slot, DataLength(0), FileOffset(0)});
      any = true;
    }
    if (pipe.failed()) {
      state.SkipWithError(pipe.error_text().c_str());
      return;
    }
    if (!any) wait_wake(pipe);
  }
}

// The send path's disk side for comparison: DiskReader filling slots from a /dev/shm file.
void BM_DiskReader(benchmark::State& state) {
  const auto bs = static_cast<std::uint32_t>(state.range(0));
  ShmFile file;
  if (!fill(file, state)) return;
  for (auto _ : state) {
    // A reader stops its pipe when it is destroyed, so each pass gets a fresh pipe (untimed).
    state.PauseTiming();
    BlockPipe pipe(bs, static_cast<std::uint32_t>(kRing / bs));
    // The network side starts by handing every slot over as free.
    for (std::uint32_t s = 0; s < pipe.slots(); ++s) pipe.to_disk(Block{s, DataLength(0), FileOffset(0)});
    state.ResumeTiming();
    DiskReader reader(pipe, Source{file.fd, kBytes, false});
    take_all(pipe, state);
    pipe.stop();
    reader.join();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kBytes));
}
BENCHMARK(BM_DiskReader)->Arg(64 << 10)->Arg(1 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);

// The send path's disk side with its per-byte work: every 1 MiB block hashed (the manifest) and
// sealed (private, AES-256-GCM), on the disk thread alone or spread over a BlockWorkers pool of
// 1 to 3 helpers. Nothing else runs, so with free cores the rate grows with the lanes; on a
// host with as many cores as lanes, it shows what one transfer's disk side can feed.
void BM_DiskReaderProtected(benchmark::State& state) {
  constexpr std::uint32_t bs = 1 << 20;
  const auto helpers = static_cast<unsigned>(state.range(0));
  ShmFile file;
  if (!fill(file, state)) return;
  BlockWorkers workers(helpers);
  xdfs::xsec::Key32 key;
  key.fill(7);
  for (auto _ : state) {
    state.PauseTiming();
    BlockPipe pipe(bs, static_cast<std::uint32_t>(kRing / bs));
    for (std::uint32_t s = 0; s < pipe.slots(); ++s) {
      std::memset(pipe.slot_data(s), 0, bs);  // faulted in here, untimed: the pool is a session's, kept
      pipe.to_disk(Block{s, DataLength(0), FileOffset(0)});
    }
    xdfs::xsec::BlockCrypto sealer(xdfs::xsec::Protect::private_, xdfs::xsec::Cipher::aes256gcm, key);
    xdfs::manifest::FileDigest manifest(kBytes, bs);
    state.ResumeTiming();
    Source source{file.fd, kBytes, false};
    source.sealer = &sealer;
    source.manifest = &manifest;
    source.workers = helpers ? &workers : nullptr;
    DiskReader reader(pipe, source);
    take_all(pipe, state);
    pipe.stop();
    reader.join();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kBytes));
  state.SetLabel("SHA-256 + AES-256-GCM, " + std::to_string(helpers) + " helpers");
}
BENCHMARK(BM_DiskReaderProtected)->ArgName("helpers")->DenseRange(0, 3)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
