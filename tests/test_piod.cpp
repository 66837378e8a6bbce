// Unit tests for PIOD (framework/include/xdfs/piod.hpp): the SPSC ring, the block pipe and the
// disk threads, against real temporary files and pipes.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "xdfs/error.hpp"
#include "xdfs/piod.hpp"
#include "xdfs/xsec.hpp"

namespace {

using namespace xdfs;
using namespace xdfs::piod;

/// Byte expected at absolute file position p: depends on the position within a block and on
/// the block, so a block written at the wrong offset or in the wrong order is detected.
std::uint8_t byte_at(std::uint64_t p) {
  return static_cast<std::uint8_t>((p % 251) ^ ((p / 4096) * 37) ^ (p >> 16));
}

std::vector<std::uint8_t> expected_bytes(std::uint64_t size) {
  std::vector<std::uint8_t> v(size);
  for (std::uint64_t i = 0; i < size; ++i) v[i] = byte_at(i);
  return v;
}

/// A temporary file under /tmp, removed on destruction.
struct TempFile {
  std::string path;
  int fd = -1;
  TempFile() {
    char name[] = "/tmp/xdfs_piod_XXXXXX";
    fd = ::mkstemp(name);
    REQUIRE(fd >= 0);
    path = name;
  }
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    ::unlink(path.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  std::vector<std::uint8_t> contents() const {
    std::vector<std::uint8_t> out;
    int rfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(rfd >= 0);
    std::uint8_t buf[65536];
    while (true) {
      ssize_t n = ::read(rfd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      REQUIRE(n >= 0);
      if (n == 0) break;
      out.insert(out.end(), buf, buf + n);
    }
    ::close(rfd);
    return out;
  }

  void write_all(const std::vector<std::uint8_t>& data) const {
    std::size_t done = 0;
    while (done < data.size()) {
      ssize_t n = ::pwrite(fd, data.data() + done, data.size() - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      REQUIRE(n > 0);
      done += static_cast<std::size_t>(n);
    }
  }
};

/// Blocks until the disk thread signals the eventfd (or fails the test after 10 s).
void wait_wake(BlockPipe& pipe) {
  pollfd p{pipe.net_wake().fd(), POLLIN, 0};
  int r;
  do {
    r = ::poll(&p, 1, 10000);
  } while (r < 0 && errno == EINTR);
  // Plain ifs rather than assertions here and in the polling loops: how often the loops spin
  // depends on thread timing, and the assertion count should not.
  if (r != 1 || (p.revents & POLLIN) == 0) FAIL("disk thread did not signal within 10 s");
  pipe.net_wake().drain();
}

/// Order in which blocks are fed: within each group of `group` blocks, reversed.
/// group 2 gives 1,0,3,2,5,4,...
std::vector<std::uint64_t> scrambled_order(std::uint64_t blocks, std::uint64_t group) {
  std::vector<std::uint64_t> order;
  for (std::uint64_t g = 0; g < blocks; g += group) {
    const std::uint64_t end = std::min(blocks, g + group);
    for (std::uint64_t i = end; i-- > g;) order.push_back(i);
  }
  return order;
}

struct FeedResult {
  std::vector<Block> returned;  // in return order
};

/// Network side of a receiving pipe: fills blocks of a file of `size` bytes in `order`, hands
/// them to the disk thread and recycles the slots it gets back. Returns when every block came
/// back (or fails the test if the disk thread fails).
FeedResult feed_blocks(BlockPipe& pipe, std::uint64_t size, const std::vector<std::uint64_t>& order) {
  const std::uint32_t bs = pipe.block_size();
  std::deque<std::uint32_t> free_slots;
  for (std::uint32_t s = 0; s < pipe.slots(); ++s) free_slots.push_back(s);
  std::map<std::uint32_t, Block> in_flight;  // slot -> block handed to disk
  FeedResult res;

  auto collect = [&](bool block) {
    Block b;
    bool any = false;
    while (pipe.from_disk(b)) {
      any = true;
      auto it = in_flight.find(b.slot);
      REQUIRE_MESSAGE(it != in_flight.end(), "disk returned a slot it was not given: " << b.slot);
      CHECK(it->second.offset.value() == b.offset.value());
      CHECK(it->second.length.value() == b.length.value());
      in_flight.erase(it);
      res.returned.push_back(b);
      free_slots.push_back(b.slot);
    }
    if (pipe.failed()) FAIL("disk thread failed: " << pipe.error_text());
    if (!any && block) wait_wake(pipe);
  };

  for (std::uint64_t idx : order) {
    while (free_slots.empty()) collect(true);
    const std::uint32_t slot = free_slots.front();
    free_slots.pop_front();
    const std::uint64_t off = idx * bs;
    REQUIRE(off < size);
    const auto len = static_cast<std::uint32_t>(std::min<std::uint64_t>(bs, size - off));
    std::uint8_t* p = pipe.slot_data(slot);
    for (std::uint32_t i = 0; i < len; ++i) p[i] = byte_at(off + i);
    Block b{slot, xdfs::DataLength(len), xdfs::FileOffset(off)};
    in_flight[slot] = b;
    pipe.to_disk(b);
  }
  while (!in_flight.empty()) collect(true);
  return res;
}

/// Reads everything from fd until EOF (runs on its own thread).
void drain_fd(int fd, std::vector<std::uint8_t>& out, int& err) {
  std::uint8_t buf[16384];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      err = errno;
      return;
    }
    if (n == 0) return;
    out.insert(out.end(), buf, buf + n);
  }
}

/// A disk whose system calls misbehave on purpose, deterministically: each call moves at most
/// half of the first buffer it is given (at least one byte), every even-numbered call is
/// interrupted (EINTR), and call number fail_at (1-based; 0: none) fails with fail_errno.
class FaultyIo final : public DiskIo {
public:
  int fail_at = 0;
  int fail_errno = ENOSPC;
  std::atomic<int> calls{0};
  std::atomic<int> shortened{0};

  ssize_t pwritev(int fd, const iovec* iov, int n, off_t off) override {
    if (auto r = fault(); r) return *r;
    iovec one = half(iov, n);
    return ::pwritev(fd, &one, 1, off);
  }
  ssize_t writev(int fd, const iovec* iov, int n) override {
    if (auto r = fault(); r) return *r;
    iovec one = half(iov, n);
    return ::writev(fd, &one, 1);
  }
  ssize_t preadv(int fd, const iovec* iov, int n, off_t off) override {
    if (auto r = fault(); r) return *r;
    iovec one = half(iov, n);
    return ::preadv(fd, &one, 1, off);
  }

private:
  std::optional<ssize_t> fault() {
    const int k = ++calls;
    if (k == fail_at) {
      errno = fail_errno;
      return -1;
    }
    if (k % 2 == 0) {
      errno = EINTR;
      return -1;
    }
    return std::nullopt;
  }
  iovec half(const iovec* iov, int n) {
    iovec one = iov[0];
    if (n > 1 || one.iov_len > 1) ++shortened;
    one.iov_len = std::max<std::size_t>(1, one.iov_len / 2);
    return one;
  }
};


/// What a DiskReader hands over for a file, each block sealed (private, AES-256-GCM) after its
/// digest, on the disk thread alone (no workers) or over a pool: every block's slot bytes (data,
/// digest, tag) by offset, and the whole-file digest.
struct Sealed {
  std::map<std::uint64_t, std::vector<std::uint8_t>> blocks;
  std::optional<manifest::Digest> whole;
};

xsec::Key32 test_key() {
  xsec::Key32 k;
  k.fill(9);
  return k;
}

/// Which threads sealed or opened blocks, shared by a sealer and its clones. With
/// `wait_for_second`, the first thread to seal waits (10 s at most) until a second one has
/// too: a pool's helper then surely takes part, however loaded the machine.
struct SealThreads {
  std::mutex m;
  std::condition_variable cv;
  std::set<std::thread::id> threads;
  bool wait_for_second = false;
  std::uint64_t slow_offset = UINT64_MAX;  // opening the block there takes 100 ms more
  void note() {
    std::unique_lock lock(m);
    threads.insert(std::this_thread::get_id());
    cv.notify_all();
    if (wait_for_second && threads.size() == 1)
      cv.wait_for(lock, std::chrono::seconds(10), [&] { return threads.size() > 1; });
  }
};

/// xsec::BlockCrypto (private, AES-256-GCM) that notes the threads it runs on.
class NotingSealer final : public BlockSealer {
public:
  explicit NotingSealer(SealThreads& t) : inner_(xsec::Protect::private_, xsec::Cipher::aes256gcm, test_key()), t_(t) {}
  TagLength tag_size() const noexcept override { return inner_.tag_size(); }
  void seal(std::uint8_t* data, DataLength len, FileOffset offset) override {
    t_.note();
    inner_.seal(data, len, offset);
  }
  bool open(std::uint8_t* data, DataLength len, FileOffset offset) override {
    t_.note();
    if (offset.value() == t_.slow_offset) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return inner_.open(data, len, offset);
  }
  std::unique_ptr<BlockSealer> clone() const override { return std::make_unique<NotingSealer>(t_); }

private:
  xsec::BlockCrypto inner_;
  SealThreads& t_;
};

Sealed read_sealed(int fd, std::uint64_t size, std::uint32_t bs, BlockWorkers* workers, SealThreads& threads) {
  NotingSealer sealer(threads);
  manifest::FileDigest whole(size, bs);
  BlockPipe pipe(bs, 16);
  Source src{fd, size, false};
  src.sealer = &sealer;
  src.manifest = &whole;
  src.workers = workers;
  Sealed out;
  // Every slot free before the reader starts: its first group is a whole one.
  for (std::uint32_t s = 0; s < pipe.slots(); ++s) pipe.to_disk(Block{s});
  {
    DiskReader reader(pipe, src);
    std::uint64_t got = 0;
    while (got < size) {
      Block b;
      bool any = false;
      while (pipe.from_disk(b)) {
        any = true;
        const std::uint8_t* p = pipe.slot_data(b.slot);
        out.blocks[b.offset.value()].assign(p, p + b.length.value() + manifest::digest_size + xsec::tag_size);
        got += b.length.value();
        pipe.to_disk(Block{b.slot});
      }
      if (pipe.failed()) FAIL("disk thread failed: " << pipe.error_text());
      if (!any && got < size) wait_wake(pipe);
    }
    reader.join();
  }
  out.whole = whole.result();
  return out;
}

/// Network side of a receiving pipe whose blocks come sealed: hands `sealed`'s blocks (in
/// `order` of block index) to a DiskWriter that opens them on `workers`, recycling slots as
/// they come back. Returns the pipe's error text ("" if none).
std::string write_sealed(int fd, std::uint64_t size, std::uint32_t bs, const Sealed& sealed,
                         const std::vector<std::uint64_t>& order, BlockWorkers* workers, manifest::FileDigest& whole,
                         SealThreads& threads) {
  NotingSealer opener(threads);
  BlockPipe pipe(bs, 16);
  Sink sink{fd, true, false, &opener};
  sink.manifest = &whole;
  sink.workers = workers;
  std::deque<std::uint32_t> free_slots;
  for (std::uint32_t s = 0; s < pipe.slots(); ++s) free_slots.push_back(s);
  std::size_t out = 0;
  std::optional<DiskWriter> writer;
  auto collect = [&] {
    Block b;
    bool any = false;
    while (pipe.from_disk(b)) {
      any = true;
      --out;
      free_slots.push_back(b.slot);
    }
    if (!any && !pipe.failed()) wait_wake(pipe);
  };
  for (std::uint64_t idx : order) {
    // The writer starts once every slot is full: its first groups are whole ones.
    if (free_slots.empty() && !writer) writer.emplace(pipe, sink);
    while (free_slots.empty() && !pipe.failed()) collect();
    if (pipe.failed()) break;
    const std::uint32_t slot = free_slots.front();
    free_slots.pop_front();
    const auto& bytes = sealed.blocks.at(idx * bs);
    std::memcpy(pipe.slot_data(slot), bytes.data(), bytes.size());
    const auto len = static_cast<std::uint32_t>(std::min<std::uint64_t>(bs, size - idx * bs));
    pipe.to_disk(Block{slot, DataLength(len), FileOffset(idx * bs)});
    ++out;
  }
  if (!writer) writer.emplace(pipe, sink);
  while (out > 0 && !pipe.failed()) collect();
  // Every block came back written (or the writer failed and wrote no more).
  return pipe.failed() ? pipe.error_text() : std::string();
}

}  // namespace

TEST_SUITE("piod") {

TEST_CASE("DiskWriter retries short and interrupted writes; the bytes land exactly") {
  constexpr std::uint32_t bs = 4096;
  constexpr std::uint64_t blocks = 32;
  const std::uint64_t size = (blocks - 1) * bs + 777;
  SUBCASE("a seekable file (pwritev)") {
    TempFile f;
    FaultyIo io;
    {
      BlockPipe pipe(bs, 8);
      DiskWriter writer(pipe, Sink{f.fd, true, false, nullptr, &io});
      feed_blocks(pipe, size, scrambled_order(blocks, 4));
      CHECK_FALSE(pipe.failed());
    }
    CHECK(io.shortened > static_cast<int>(blocks));  // the faults happened, and often
    CHECK(f.contents() == expected_bytes(size));
  }
  SUBCASE("a pipe (writev, in order)") {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    std::vector<std::uint8_t> seen;
    int read_err = 0;
    std::thread reader([&] { drain_fd(fds[0], seen, read_err); });
    FaultyIo io;
    {
      BlockPipe pipe(bs, 8);
      DiskWriter writer(pipe, Sink{fds[1], false, false, nullptr, &io});
      feed_blocks(pipe, size, scrambled_order(blocks, 4));
      CHECK_FALSE(pipe.failed());
    }
    ::close(fds[1]);
    reader.join();
    ::close(fds[0]);
    CHECK(io.shortened > static_cast<int>(blocks));
    CHECK(seen == expected_bytes(size));
  }
}

TEST_CASE("DiskWriter reports a disk that fills up at the Nth write: disk full, with the offset") {
  TempFile f;
  FaultyIo io;
  io.fail_at = 7;
  BlockPipe pipe(4096, 8);
  DiskWriter writer(pipe, Sink{f.fd, true, false, nullptr, &io});
  for (std::uint32_t s = 0; s < 8; ++s) {
    std::memset(pipe.slot_data(s), 'a' + static_cast<int>(s), 4096);
    pipe.to_disk(Block{s, xdfs::DataLength(4096), xdfs::FileOffset(std::uint64_t(s) * 4096)});
  }
  while (!pipe.failed()) wait_wake(pipe);
  CHECK(pipe.error_code() == errc::disk_full);
  CHECK(pipe.error_text().find("No space left on device") != std::string::npos);
  CHECK(pipe.error_text().find("write at offset ") != std::string::npos);
  CHECK(io.calls == 7);  // it stopped at the failure: no write after it
}

/// A disk whose first write waits until the test lets it go: the writer is caught in the middle
/// of a batch, with the rest of the batch still to write.
class HeldIo final : public DiskIo {
public:
  std::atomic<int> calls{0};
  std::atomic<bool> entered{false};
  std::atomic<bool> released{false};

  ssize_t pwritev(int fd, const iovec* iov, int n, off_t off) override {
    if (++calls == 1) {
      entered = true;
      entered.notify_all();
      released.wait(false);
    }
    return ::pwritev(fd, iov, n, off);
  }
};

TEST_CASE("a stopped DiskWriter writes nothing more: what is still queued is dropped") {
  // A failed transfer stops its pipe, then closes its file; a write after that would land in
  // whatever file reuses the descriptor.
  constexpr std::uint32_t bs = 4096;
  constexpr std::uint32_t blocks = 16;
  TempFile f;
  HeldIo io;
  BlockPipe pipe(bs, blocks);
  // Every other block: no two are contiguous, so each is a write of its own, all in one batch.
  for (std::uint32_t i = 0; i < blocks; ++i) pipe.to_disk(Block{i, xdfs::DataLength(bs), xdfs::FileOffset(std::uint64_t(i) * 2 * bs)});
  {
    DiskWriter writer(pipe, Sink{f.fd, true, false, nullptr, &io});
    io.entered.wait(false);
    pipe.stop();
    io.released = true;
    io.released.notify_all();
    writer.join();
  }
  CHECK(io.calls == 1);
  CHECK_FALSE(pipe.failed());
  struct stat st {};
  REQUIRE(::fstat(f.fd, &st) == 0);
  CHECK(st.st_size == bs);
}

TEST_CASE("DiskReader retries short and interrupted reads; a read error is reported") {
  constexpr std::uint32_t bs = 65536;
  constexpr std::uint64_t size = 1'000'003;
  TempFile f;
  const auto data = expected_bytes(size);
  f.write_all(data);
  SUBCASE("short and interrupted") {
    FaultyIo io;
    BlockPipe pipe(bs, 8);
    DiskReader reader(pipe, Source{f.fd, size, false, nullptr, &io});
    for (std::uint32_t s = 0; s < pipe.slots(); ++s) pipe.to_disk(Block{s});
    std::uint64_t next = 0;
    std::size_t bad = 0;
    while (next < size) {
      Block b;
      bool any = false;
      while (pipe.from_disk(b)) {
        any = true;
        if (b.offset.value() != next || std::memcmp(pipe.slot_data(b.slot), data.data() + b.offset.value(), b.length.value()) != 0) ++bad;
        next += b.length.value();
        pipe.to_disk(Block{b.slot});
      }
      if (pipe.failed()) FAIL("disk thread failed: " << pipe.error_text());
      if (!any && next < size) wait_wake(pipe);
    }
    CHECK(bad == 0);
    CHECK(io.shortened > 16);
  }
  SUBCASE("an I/O error at the third read") {
    FaultyIo io;
    io.fail_at = 3;
    io.fail_errno = EIO;
    BlockPipe pipe(bs, 8);
    DiskReader reader(pipe, Source{f.fd, size, false, nullptr, &io});
    for (std::uint32_t s = 0; s < pipe.slots(); ++s) pipe.to_disk(Block{s});
    while (!pipe.failed()) wait_wake(pipe);
    CHECK(pipe.error_code() == errc::io_error);
    // The first read moved half a block, the second was interrupted: the third fails where it was.
    CHECK(pipe.error_text().find("read at offset 32768: Input/output error") != std::string::npos);
  }
}

TEST_CASE("SpscRing capacity rounds up to a power of two") {
  CHECK(SpscRing<int>(0).capacity() == 1);
  CHECK(SpscRing<int>(1).capacity() == 1);
  CHECK(SpscRing<int>(2).capacity() == 2);
  CHECK(SpscRing<int>(3).capacity() == 4);
  CHECK(SpscRing<int>(4).capacity() == 4);
  CHECK(SpscRing<int>(5).capacity() == 8);
  CHECK(SpscRing<int>(16).capacity() == 16);
  CHECK(SpscRing<int>(17).capacity() == 32);
  CHECK(SpscRing<int>(1000).capacity() == 1024);
}

TEST_CASE("SpscRing fills, refuses when full, pops FIFO, refuses when empty") {
  SpscRing<int> r(5);
  REQUIRE(r.capacity() == 8);
  CHECK(r.empty());
  int out = -1;
  CHECK_FALSE(r.try_pop(out));
  CHECK(out == -1);
  for (int i = 0; i < 8; ++i) CHECK(r.try_push(100 + i));
  CHECK_FALSE(r.try_push(999));
  CHECK_FALSE(r.try_push(998));
  CHECK_FALSE(r.empty());
  for (int i = 0; i < 8; ++i) {
    REQUIRE(r.try_pop(out));
    CHECK(out == 100 + i);
  }
  CHECK_FALSE(r.try_pop(out));
  CHECK(r.empty());
  // Room again after emptying.
  CHECK(r.try_push(7));
  REQUIRE(r.try_pop(out));
  CHECK(out == 7);
}

TEST_CASE("SpscRing wraps around over many cycles") {
  SpscRing<std::uint64_t> r(4);
  REQUIRE(r.capacity() == 4);
  std::uint64_t next_in = 0, next_out = 0;
  std::size_t errors = 0;
  for (int cycle = 0; cycle < 10000; ++cycle) {
    const int pushes = 1 + cycle % 4;  // 1..4, so head and tail land on every index
    for (int i = 0; i < pushes; ++i)
      if (!r.try_push(next_in++)) ++errors;
    if (pushes == 4 && r.try_push(12345)) ++errors;  // full exactly when 4 are in
    std::uint64_t v;
    for (int i = 0; i < pushes; ++i) {
      if (!r.try_pop(v)) {
        ++errors;
        continue;
      }
      if (v != next_out++) ++errors;
    }
    if (r.try_pop(v)) ++errors;
  }
  CHECK(errors == 0);
  CHECK(next_out == next_in);
  CHECK(r.empty());
}

TEST_CASE("SpscRing two threads: one million values in order") {
  constexpr std::uint64_t count = 1'000'000;
  SpscRing<std::uint64_t> r(256);
  std::thread producer([&] {
    for (std::uint64_t i = 0; i < count; ++i)
      while (!r.try_push(i)) std::this_thread::yield();
  });
  std::uint64_t expected = 0, mismatches = 0, first_bad = 0;
  while (expected < count) {
    std::uint64_t v;
    if (!r.try_pop(v)) {
      std::this_thread::yield();
      continue;
    }
    if (v != expected && mismatches++ == 0) first_bad = expected;
    ++expected;
  }
  producer.join();
  CHECK_MESSAGE(mismatches == 0, "first mismatch at index " << first_bad);
  std::uint64_t extra;
  CHECK_FALSE(r.try_pop(extra));
  CHECK(r.empty());
}

TEST_CASE("EventFd notify and drain") {
  EventFd e;
  REQUIRE(e.fd() >= 0);
  CHECK_FALSE(e.drain());
  e.notify();
  e.notify();
  CHECK(e.drain());
  CHECK_FALSE(e.drain());
}

TEST_CASE("BlockPipe slots are distinct and hold a block plus room for its tag") {
  BlockPipe pipe(4096, 16);
  CHECK(pipe.block_size() == 4096);
  CHECK(pipe.slots() == 16);
  for (std::uint32_t s = 1; s < 16; ++s)
    CHECK(pipe.slot_data(s) - pipe.slot_data(s - 1) == 4096 + xdfs::piod::slot_tag_room);
  CHECK(reinterpret_cast<std::uintptr_t>(pipe.slot_data(0)) % 4096 == 0);
  CHECK_FALSE(pipe.failed());
  CHECK(pipe.error_code() == errc::ok);
  CHECK_FALSE(pipe.stopping());
  pipe.stop();
  CHECK(pipe.stopping());
}

TEST_CASE("BlockPipe: slots handed over lazily wake the disk thread once a batch waits, at once when asked, or at a flush") {
  BlockPipe pipe(4096, 16);
  const auto seq = pipe.disk_seq();
  pipe.to_disk_lazily(xdfs::piod::Block{0}, 3, false);
  pipe.to_disk_lazily(xdfs::piod::Block{1}, 3, false);
  CHECK(pipe.disk_seq() == seq);  // two of three: not woken
  pipe.flush_to_disk();
  CHECK(pipe.disk_seq() == seq + 1);  // the flush wakes it for them
  pipe.flush_to_disk();
  CHECK(pipe.disk_seq() == seq + 1);  // nothing left unwoken: no wake
  pipe.to_disk_lazily(xdfs::piod::Block{2}, 3, false);
  pipe.to_disk_lazily(xdfs::piod::Block{3}, 3, false);
  pipe.to_disk_lazily(xdfs::piod::Block{4}, 3, false);
  CHECK(pipe.disk_seq() == seq + 2);  // the third of a batch
  pipe.to_disk_lazily(xdfs::piod::Block{5}, 3, true);
  CHECK(pipe.disk_seq() == seq + 3);  // now
  xdfs::piod::Block b;
  for (std::uint32_t s = 0; s < 6; ++s) {
    REQUIRE(pipe.disk_pop(b));
    CHECK(b.slot == s);
  }
  CHECK_FALSE(pipe.disk_pop(b));
}

TEST_CASE("DiskWriter writes out-of-order blocks to a seekable file") {
  constexpr std::uint32_t bs = 4096;
  constexpr std::uint64_t blocks = 64;
  TempFile f;

  SUBCASE("pairs swapped, full blocks") {
    const std::uint64_t size = blocks * bs;
    {
      BlockPipe pipe(bs, 16);
      DiskWriter writer(pipe, Sink{f.fd, true, false});
      auto res = feed_blocks(pipe, size, scrambled_order(blocks, 2));
      CHECK(res.returned.size() == blocks);
      CHECK_FALSE(pipe.failed());
    }
    CHECK(f.contents() == expected_bytes(size));
  }
  SUBCASE("groups of 16 reversed, short last block") {
    const std::uint64_t size = (blocks - 1) * bs + 1000;
    {
      BlockPipe pipe(bs, 16);
      DiskWriter writer(pipe, Sink{f.fd, true, false});
      auto res = feed_blocks(pipe, size, scrambled_order(blocks, 16));
      CHECK(res.returned.size() == blocks);
      std::set<std::uint64_t> offsets;
      for (const auto& b : res.returned) offsets.insert(b.offset.value());
      CHECK(offsets.size() == blocks);
      CHECK_FALSE(pipe.failed());
    }
    CHECK(f.contents() == expected_bytes(size));
  }
}

TEST_CASE("DiskWriter writes only what is not in the file already: none of a block spliced whole, the rest of one spliced in part") {
  constexpr std::uint32_t bs = 4096;
  constexpr std::uint32_t blocks = 8;
  TempFile f;
  // What the network thread spliced: 'F' wherever a block says it is in the file.
  const std::vector<std::uint8_t> spliced(std::size_t(blocks) * bs, 'F');
  REQUIRE(::pwrite(f.fd, spliced.data(), spliced.size(), 0) == static_cast<ssize_t>(spliced.size()));
  // Per block: its bytes in the file (blocks 1 and 5 whole, 2 and 6 in part, the others none).
  const std::uint32_t in_file[blocks] = {0, bs, 100, 0, 0, bs, bs - 1, 0};
  std::vector<std::uint8_t> expect(spliced);
  {
    BlockPipe pipe(bs, blocks);
    DiskWriter writer(pipe, Sink{f.fd, true, false});
    for (std::uint32_t i = 0; i < blocks; ++i) {
      // The slot holds the block's bytes past its part in the file, and junk before them.
      std::uint8_t* slot = pipe.slot_data(i);
      for (std::uint32_t k = 0; k < bs; ++k) {
        slot[k] = k < in_file[i] ? 'x' : static_cast<std::uint8_t>('a' + i);
        if (k >= in_file[i]) expect[std::size_t(i) * bs + k] = slot[k];
      }
      Block b{i, DataLength(bs), FileOffset(std::uint64_t(i) * bs)};
      b.in_file = in_file[i];
      pipe.to_disk(b);
    }
    std::uint32_t back = 0;
    for (int tries = 0; back < blocks && tries < 1000 && !pipe.failed(); ++tries) {
      Block b;
      while (pipe.from_disk(b)) ++back;
      if (back < blocks) wait_wake(pipe);
    }
    CHECK(back == blocks);
    CHECK_FALSE(pipe.failed());
  }
  CHECK(f.contents() == expect);
}

TEST_CASE("DiskWriter restores offset order for a non-seekable sink") {
  constexpr std::uint32_t bs = 4096;
  constexpr std::uint64_t blocks = 64;
  const std::uint64_t size = (blocks - 1) * bs + 123;
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  std::vector<std::uint8_t> seen;
  int read_err = 0;
  std::thread reader([&] { drain_fd(fds[0], seen, read_err); });
  std::size_t returned = 0;
  {
    BlockPipe pipe(bs, 16);
    DiskWriter writer(pipe, Sink{fds[1], false, false});
    // Reversed groups of 8: up to 7 blocks wait in the writer for their predecessor.
    auto order = scrambled_order(blocks, 8);
    REQUIRE(order.front() == 7);
    returned = feed_blocks(pipe, size, order).returned.size();
    CHECK_FALSE(pipe.failed());
  }
  ::close(fds[1]);
  reader.join();
  ::close(fds[0]);
  CHECK(returned == blocks);
  CHECK(read_err == 0);
  REQUIRE(seen.size() == size);
  // Every byte is position-dependent, so equality means the blocks came strictly in order.
  std::size_t first_bad = size;
  for (std::size_t i = 0; i < size; ++i)
    if (seen[i] != byte_at(i)) {
      first_bad = i;
      break;
    }
  CHECK_MESSAGE(first_bad == size, "first wrong byte at " << first_bad << " (block " << first_bad / bs << ")");
}

TEST_CASE("DiskWriter with a discard sink returns every block") {
  constexpr std::uint32_t bs = 8192;
  constexpr std::uint64_t blocks = 100;
  BlockPipe pipe(bs, 16);
  DiskWriter writer(pipe, Sink{-1, true, true});
  auto res = feed_blocks(pipe, blocks * bs, scrambled_order(blocks, 3));
  CHECK(res.returned.size() == blocks);
  std::set<std::uint64_t> offsets;
  for (const auto& b : res.returned) {
    offsets.insert(b.offset.value());
    CHECK(b.length.value() == bs);
  }
  CHECK(offsets.size() == blocks);
  CHECK(*offsets.rbegin() == (blocks - 1) * bs);
  CHECK_FALSE(pipe.failed());
}

TEST_CASE("DiskWriter reports a failing sink") {
  TempFile f;
  int ro = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(ro >= 0);
  for (bool seekable : {true, false}) {
    CAPTURE(seekable);
    BlockPipe pipe(4096, 4);
    DiskWriter writer(pipe, Sink{ro, seekable, false});
    std::memset(pipe.slot_data(0), 'z', 4096);
    pipe.to_disk(Block{0, xdfs::DataLength(4096), xdfs::FileOffset(0)});
    // The failure must wake the network thread through the eventfd.
    pollfd p{pipe.net_wake().fd(), POLLIN, 0};
    int r;
    do {
      r = ::poll(&p, 1, 10000);
    } while (r < 0 && errno == EINTR);
    REQUIRE(r == 1);
    CHECK(pipe.failed());
    CHECK(pipe.error_code() == errc::io_error);  // EBADF
    CHECK_FALSE(pipe.error_text().empty());
    CHECK(pipe.error_text().find("offset 0") != std::string::npos);
    // The writer thread has given up: the destructor must still stop and join.
  }
  ::close(ro);
  CHECK(f.contents().empty());
}

TEST_CASE("DiskReader reads a file block by block") {
  constexpr std::uint32_t bs = 65536;
  constexpr std::uint64_t size = 1'000'003;
  TempFile f;
  const auto data = expected_bytes(size);
  f.write_all(data);

  for (std::uint64_t start : {std::uint64_t{0}, std::uint64_t{3 * bs + 5}}) {
    CAPTURE(start);
    BlockPipe pipe(bs, 8);
    DiskReader reader(pipe, Source{f.fd, size, false}, start);
    for (std::uint32_t s = 0; s < pipe.slots(); ++s) pipe.to_disk(Block{s});
    std::uint64_t next = start;
    std::size_t blocks = 0, bad_content = 0;
    while (next < size) {
      Block b;
      bool any = false;
      while (pipe.from_disk(b)) {
        any = true;
        ++blocks;
        REQUIRE(b.slot < pipe.slots());
        REQUIRE(b.offset.value() == next);
        REQUIRE(b.length.value() == std::min<std::uint64_t>(bs, size - b.offset.value()));
        if (std::memcmp(pipe.slot_data(b.slot), data.data() + b.offset.value(), b.length.value()) != 0) ++bad_content;
        next += b.length.value();
        pipe.to_disk(Block{b.slot});  // recycle
      }
      if (pipe.failed()) FAIL("disk thread failed: " << pipe.error_text());
      if (!any && next < size) wait_wake(pipe);
    }
    CHECK(next == size);
    CHECK(bad_content == 0);
    CHECK(blocks == (size - start + bs - 1) / bs);
    // Nothing beyond the end.
    Block extra;
    CHECK_FALSE(pipe.from_disk(extra));
    CHECK_FALSE(pipe.failed());
  }
}

TEST_CASE("DiskReader with a zero source makes zero blocks without reading") {
  constexpr std::uint32_t bs = 4096;
  constexpr std::uint64_t size = 10 * bs + 17;
  BlockPipe pipe(bs, 4);
  DiskReader reader(pipe, Source{-1, size, true});
  for (std::uint32_t s = 0; s < pipe.slots(); ++s) pipe.to_disk(Block{s});
  std::uint64_t next = 0;
  std::size_t nonzero = 0;
  while (next < size) {
    Block b;
    bool any = false;
    while (pipe.from_disk(b)) {
      any = true;
      REQUIRE(b.offset.value() == next);
      REQUIRE(b.length.value() == std::min<std::uint64_t>(bs, size - next));
      for (std::uint32_t i = 0; i < b.length.value(); ++i) nonzero += pipe.slot_data(b.slot)[i] != 0;
      next += b.length.value();
      pipe.to_disk(Block{b.slot});
    }
    if (pipe.failed()) FAIL("disk thread failed: " << pipe.error_text());
    if (!any && next < size) wait_wake(pipe);
  }
  CHECK(next == size);
  CHECK(nonzero == 0);
}

TEST_CASE("DiskReader reports a source shorter than announced") {
  constexpr std::uint32_t bs = 65536;
  constexpr std::uint64_t real = 1'000'003;
  TempFile f;
  const auto data = expected_bytes(real);
  f.write_all(data);

  BlockPipe pipe(bs, 8);
  DiskReader reader(pipe, Source{f.fd, real + 200'000, false});
  for (std::uint32_t s = 0; s < pipe.slots(); ++s) pipe.to_disk(Block{s});
  std::uint64_t next = 0;
  std::size_t bad_content = 0, bad_offsets = 0, beyond_end = 0;
  int rounds = 0;
  while (!pipe.failed()) {
    if (++rounds >= 10000) FAIL("no failure reported");
    Block b;
    bool any = false;
    while (pipe.from_disk(b)) {
      any = true;
      // How many blocks come before the failure depends on batching: count, don't assert each.
      if (b.offset.value() != next) ++bad_offsets;
      // Only blocks the file really holds may be delivered.
      if (b.offset.value() + b.length.value() > real) ++beyond_end;
      if (b.offset.value() + b.length.value() > real || b.length.value() > bs) continue;
      if (std::memcmp(pipe.slot_data(b.slot), data.data() + b.offset.value(), b.length.value()) != 0) ++bad_content;
      next += b.length.value();
      pipe.to_disk(Block{b.slot});
    }
    if (!any && !pipe.failed()) wait_wake(pipe);
  }
  CHECK(pipe.error_code() == errc::size_mismatch);
  CHECK_FALSE(pipe.error_text().empty());
  CHECK(bad_content == 0);
  CHECK(bad_offsets == 0);
  CHECK(beyond_end == 0);
  CHECK(next <= real);
}

TEST_CASE("disk threads stop and join when idle") {
  // Destroying a writer or reader that waits for work must not hang.
  {
    BlockPipe pipe(4096, 4);
    DiskWriter writer(pipe, Sink{-1, true, true});
  }
  {
    BlockPipe pipe(4096, 4);
    DiskReader reader(pipe, Source{-1, 1 << 20, true});
  }
  {
    BlockPipe pipe(4096, 4);
    DiskWriter writer(pipe, Sink{-1, true, true});
    pipe.stop();
    writer.join();
    writer.join();  // idempotent
    CHECK(pipe.stopping());
    // A block handed over after the stop is not taken: the thread is gone.
    pipe.to_disk(Block{0, xdfs::DataLength(4096), xdfs::FileOffset(0)});
    Block b;
    CHECK_FALSE(pipe.from_disk(b));
    CHECK_FALSE(pipe.failed());
  }
  {
    // A reader with no free slot waits; stopping it produces nothing.
    BlockPipe pipe(4096, 4);
    {
      DiskReader reader(pipe, Source{-1, 1 << 20, true});
      pipe.stop();
    }
    Block b;
    CHECK_FALSE(pipe.from_disk(b));
  }
}

TEST_CASE("BlockWorkers runs every task once, each lane one task at a time, and brings a task's exception back after all end") {
  BlockWorkers pool(3);
  REQUIRE(pool.lanes() == 4);

  SUBCASE("every task once; lanes never run two at a time; helpers take part") {
    constexpr std::size_t n = 200;
    std::vector<std::atomic<int>> ran(n);
    std::vector<std::atomic<bool>> busy(pool.lanes());
    std::atomic<int> clashes{0}, bad_lane{0};
    std::set<unsigned> used;
    std::mutex used_m;
    std::atomic<bool> helped{false};
    pool.run(n, [&](std::size_t i, unsigned lane) {
      if (lane >= pool.lanes()) {
        ++bad_lane;
        return;
      }
      // The caller's first task waits (10 s at most) for a helper to take one: they do take
      // part, however loaded the machine.
      if (lane != 0) helped = true;
      for (int k = 0; lane == 0 && i == 0 && !helped && k < 10000; ++k)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (busy[lane].exchange(true)) ++clashes;
      ++ran[i];
      {
        std::lock_guard lock(used_m);
        used.insert(lane);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      busy[lane] = false;
    });
    CHECK(bad_lane == 0);
    CHECK(clashes == 0);
    int wrong = 0;
    for (auto& r : ran) wrong += r != 1;
    CHECK(wrong == 0);
    CHECK(used.count(0) == 1);  // the caller works too
    CHECK(used.size() > 1);     // the sleeping helpers woke for it
  }

  SUBCASE("throwing tasks: the others still run, and run() throws the lowest one's once all have") {
    BlockWorkers none(0);
    for (BlockWorkers* p : {&pool, &none}) {
      CAPTURE(p->lanes());
      constexpr std::size_t n = 64;
      std::vector<std::atomic<int>> ran(n);
      std::atomic<int> inside{0};
      std::string thrown;
      try {
        p->run(n, [&](std::size_t i, unsigned) {
          ++inside;
          // Task 40 throws first in time, task 17 later.
          std::this_thread::sleep_for(std::chrono::microseconds(i == 17 ? 20000 : 200));
          ++ran[i];
          --inside;
          if (i == 17 || i == 40) throw std::runtime_error("task " + std::to_string(i) + " failed");
        });
      } catch (const std::runtime_error& e) {
        thrown = e.what();
        CHECK(inside == 0);  // nothing still runs once it is thrown
      }
      CHECK(thrown == "task 17 failed");
      int wrong = 0;
      for (auto& r : ran) wrong += r != 1;
      CHECK(wrong == 0);
    }
  }

  SUBCASE("several disk threads share the pool at once") {
    constexpr int callers = 4, rounds = 50;
    constexpr std::size_t n = 16;
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int c = 0; c < callers; ++c)
      threads.emplace_back([&] {
        for (int r = 0; r < rounds; ++r) {
          std::vector<std::atomic<int>> ran(n);
          pool.run(n, [&](std::size_t i, unsigned) { ++ran[i]; });
          for (auto& x : ran) wrong += x != 1;
        }
      });
    for (auto& t : threads) t.join();
    CHECK(wrong == 0);
  }

  SUBCASE("without helpers everything runs on the caller, as lane 0") {
    BlockWorkers none(0);
    CHECK(none.lanes() == 1);
    const auto me = std::this_thread::get_id();
    int elsewhere = 0, count = 0;
    none.run(10, [&](std::size_t, unsigned lane) {
      elsewhere += lane != 0 || std::this_thread::get_id() != me;
      ++count;
    });
    CHECK(count == 10);
    CHECK(elsewhere == 0);
  }
}

TEST_CASE("blocks hashed and sealed over a BlockWorkers pool are those of the disk thread alone, and open back over one") {
  constexpr std::uint32_t bs = 65536;
  constexpr std::uint64_t size = 40 * bs + 12345;  // 41 blocks, the last short
  constexpr std::uint64_t blocks = 41;
  TempFile src;
  const auto data = expected_bytes(size);
  src.write_all(data);
  BlockWorkers pool(3);

  SealThreads on_alone, on_pool;
  on_pool.wait_for_second = true;
  const Sealed alone = read_sealed(src.fd, size, bs, nullptr, on_alone);
  const Sealed spread = read_sealed(src.fd, size, bs, &pool, on_pool);
  CHECK(on_alone.threads.size() == 1);  // the disk thread
  CHECK(on_pool.threads.size() > 1);    // and a helper
  REQUIRE(alone.blocks.size() == blocks);
  REQUIRE(alone.whole);
  CHECK(spread.whole == alone.whole);
  int differ = 0;
  for (const auto& [off, bytes] : alone.blocks) differ += spread.blocks.count(off) == 0 || spread.blocks.at(off) != bytes;
  CHECK(differ == 0);
  // Sealed: no block's bytes are the file's.
  CHECK(std::memcmp(alone.blocks.at(0).data(), data.data(), bs) != 0);

  SUBCASE("opened over the pool, in order and not: the file, and the same whole-file digest") {
    for (std::uint64_t reversed : {1, 2}) {  // groups of 1: in order; of 2 reversed: no run is contiguous
      CAPTURE(reversed);
      TempFile dst;
      manifest::FileDigest whole(size, bs);
      SealThreads opened;
      opened.wait_for_second = reversed == 1;  // in order, groups of 4 contiguous blocks go over the lanes
      CHECK(write_sealed(dst.fd, size, bs, spread, scrambled_order(blocks, reversed), &pool, whole, opened) == "");
      if (reversed == 1) CHECK(opened.threads.size() > 1);
      CHECK(dst.contents() == data);
      CHECK(whole.result() == alone.whole);
    }
  }
  SUBCASE("two damaged blocks of one group: the transfer fails naming the first in order, whichever lane opened it") {
    // The ring holds 16 slots, so a group is 4 blocks: blocks 4-7 are one.
    REQUIRE(crypto_group(bs, pool.lanes(), 16) == 4);
    Sealed bad = spread;
    bad.blocks[7 * bs][100] ^= 1;
    bad.blocks[5 * bs][bs - 1] ^= 1;
    TempFile dst;
    manifest::FileDigest whole(size, bs);
    std::vector<std::uint64_t> order(blocks);
    for (std::uint64_t i = 0; i < blocks; ++i) order[i] = i;
    SealThreads opened;
    opened.slow_offset = 5 * bs;  // block 7's failure comes first in time, on another lane
    CHECK(write_sealed(dst.fd, size, bs, bad, order, &pool, whole, opened) ==
          "block at offset " + std::to_string(5 * bs) + " failed its integrity check");
    // Nothing of the damaged blocks' group, or after it, reached the file.
    CHECK(dst.contents().size() <= 4 * bs);
  }
}

}  // TEST_SUITE("piod")

TEST_SUITE("piod") {

TEST_CASE("a pool cache hands a session's next pipe the last pool when it fits, and a fresh one when not") {
  xdfs::piod::PoolCache cache;
  std::uint8_t* first = nullptr;
  {
    xdfs::piod::BlockPipe p(64 * 1024, 8, &cache);
    first = p.slot_data(0);
    p.slot_data(7)[0] = 42;  // used
  }
  {
    xdfs::piod::BlockPipe q(64 * 1024, 4, &cache);  // smaller: fits in the kept pool
    CHECK(q.slot_data(0) == first);
  }
  {
    xdfs::piod::BlockPipe r(64 * 1024, 16, &cache);  // larger: the kept pool goes, a fresh one comes
    CHECK(r.slot_data(15)[0] == 0);
  }
  xdfs::piod::BlockPipe fresh(64 * 1024, 8);  // without a cache: always fresh, zero-filled
  CHECK(fresh.slot_data(7)[0] == 0);
}

TEST_CASE("a sparse pipe faults in a page for each trailer written, not a 2 MiB huge page") {
  // Zero copy moves the data past the slots: only the trailers are written. Each one used to
  // fault in (and zero) a huge page of the pool, the whole pool in all.
  constexpr std::uint32_t bs = 1u << 20;
  constexpr std::uint32_t slots = 32;
  const std::size_t bytes = std::size_t{bs + xdfs::piod::slot_tag_room} * slots;
  const long page = ::sysconf(_SC_PAGESIZE);
  auto resident = [&](xdfs::piod::BlockPipe& p) {
    std::vector<unsigned char> in(bytes / page + 1);
    REQUIRE(::mincore(p.slot_data(0), bytes, in.data()) == 0);
    return std::count_if(in.begin(), in.end(), [](unsigned char c) { return c & 1; });
  };
  xdfs::piod::BlockPipe dense(bs, slots);
  xdfs::piod::BlockPipe sparse(bs, slots);
  sparse.sparse();
  for (std::uint32_t s = 0; s < slots; ++s) {
    dense.slot_data(s)[bs] = 1;
    sparse.slot_data(s)[bs] = 1;
  }
  const auto few = resident(sparse);
  CHECK(few >= slots);
  CHECK(few <= 2 * slots);
  // Where the kernel gave the dense pool huge pages, the same writes fault in most of it: what
  // this test tells apart. (Not everywhere: THP may be off, or no 2 MiB page free.)
  const auto at = reinterpret_cast<std::uintptr_t>(dense.slot_data(0));
  long huge_kb = 0;
  if (std::FILE* f = std::fopen("/proc/self/smaps", "r")) {
    char line[512];
    bool in = false;
    while (std::fgets(line, sizeof line, f)) {
      unsigned long lo = 0, hi = 0;
      if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2)  // a mapping's first line; its fields follow
        in = lo <= at && at < hi;
      else if (in)
        std::sscanf(line, "AnonHugePages: %ld kB", &huge_kb);
    }
    std::fclose(f);
  }
  if (huge_kb > 0)
    CHECK(resident(dense) > 8 * few);
  else
    MESSAGE("no huge pages here: the pool without the advice is not compared");
}

TEST_CASE("a big pool leaves no mapping behind when it goes") {
  // Its size is not a whole number of pages (a block plus its tag room, times the slots): the
  // 2 MiB alignment's tail must still be unmapped. (Leftover tails may merge with their
  // neighbours, so the address space is counted, not the mappings.)
  auto mapped_pages = [] {
    std::FILE* f = std::fopen("/proc/self/statm", "r");
    REQUIRE(f != nullptr);
    unsigned long size = 0;
    REQUIRE(std::fscanf(f, "%lu", &size) == 1);
    std::fclose(f);
    return size;
  };
  REQUIRE((std::size_t{(1u << 20) + xdfs::piod::slot_tag_room} * 8) % 4096 != 0);
  { xdfs::piod::BlockPipe warm(1u << 20, 8); }
  const unsigned long before = mapped_pages();
  for (int i = 0; i < 50; ++i) xdfs::piod::BlockPipe p(1u << 20, 8);
  const long grown = static_cast<long>(mapped_pages()) - static_cast<long>(before);
  CHECK(grown * ::sysconf(_SC_PAGESIZE) < (4l << 20));
}

}  // TEST_SUITE("piod")
