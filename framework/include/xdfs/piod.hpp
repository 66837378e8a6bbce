// PIOD: the parallel I/O dispatcher's disk side.
//
// A session's network thread and its disk thread meet in a BlockPipe: a fixed pool of
// block-sized slots and two single-producer single-consumer rings of slot descriptors, one
// each way. No mutex is taken on the hot path: the disk thread sleeps on an atomic (futex)
// and wakes the network thread through an eventfd that the event loop watches.
//
//  receive:  net --filled--> to_disk --> DiskWriter (pwritev runs) --> from_disk --free--> net
//  send:     net --free----> to_disk --> DiskReader (preadv ahead) --> from_disk --filled--> net
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "xdfs/error.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/types.hpp"
#include "xdfs/wire.hpp"

namespace xdfs::piod {

/// Lock-free ring for exactly one producer thread and one consumer thread.
template <class T>
class SpscRing {
public:
  /// Capacity is rounded up to a power of two.
  explicit SpscRing(std::size_t capacity) {
    std::size_t cap = 1;
    while (cap < capacity) cap <<= 1;
    buf_.resize(cap);
    mask_ = cap - 1;
  }
  SpscRing(const SpscRing&) = delete;
  SpscRing& operator=(const SpscRing&) = delete;

  std::size_t capacity() const noexcept { return mask_ + 1; }

  /// Producer side. False when full.
  bool try_push(const T& v) noexcept {
    const std::size_t tail = tail_.load(std::memory_order_relaxed);
    if (tail - head_cache_ > mask_) {
      head_cache_ = head_.load(std::memory_order_acquire);
      if (tail - head_cache_ > mask_) return false;
    }
    buf_[tail & mask_] = v;
    tail_.store(tail + 1, std::memory_order_release);
    return true;
  }

  /// Consumer side. False when empty.
  bool try_pop(T& out) noexcept {
    const std::size_t head = head_.load(std::memory_order_relaxed);
    if (head == tail_cache_) {
      tail_cache_ = tail_.load(std::memory_order_acquire);
      if (head == tail_cache_) return false;
    }
    out = buf_[head & mask_];
    head_.store(head + 1, std::memory_order_release);
    return true;
  }

  bool empty() const noexcept {
    return head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_acquire);
  }

private:
  std::vector<T> buf_;
  std::size_t mask_ = 0;
  alignas(64) std::atomic<std::size_t> head_{0};  // next slot the consumer reads
  alignas(64) std::size_t tail_cache_ = 0;        // consumer's view of tail_
  alignas(64) std::atomic<std::size_t> tail_{0};  // next slot the producer writes
  alignas(64) std::size_t head_cache_ = 0;        // producer's view of head_
};

/// One block of file data living in a pool slot.
struct Block {
  std::uint32_t slot = 0;
  DataLength length{};  ///< file data in the slot; a sealed block's tag follows it
  FileOffset offset{};
  /// Receive: the disk thread did not write it, its digest did not match (Sink::refetch).
  /// Send: a block to read again (network to disk) and, read, to send again (disk to network).
  bool retry = false;
  /// Send, zero copy (Source::zero_copy): the block's data was read into its slot (to make its
  /// digest from it), so that is what goes, not the file's bytes of now.
  bool in_slot = false;
  /// Receive, zero copy: the block's first `in_file` bytes are in the file already (spliced
  /// there by the network thread); only the rest, from the slot, is written.
  std::uint32_t in_file = 0;
};

/// RAII eventfd: the disk thread's way to wake the network thread's event loop.
class EventFd {
public:
  EventFd();
  ~EventFd();
  EventFd(const EventFd&) = delete;
  EventFd& operator=(const EventFd&) = delete;
  int fd() const noexcept { return fd_; }
  void notify() noexcept;
  /// Clears the counter; returns false if nothing was pending.
  bool drain() noexcept;

private:
  int fd_ = -1;
};

/// Protects block payloads on the disk threads, so that bulk cryptography runs beside the
/// network thread instead of on it. Each instance is used by one disk thread only.
class BlockSealer {
public:
  virtual ~BlockSealer() = default;
  /// Bytes of tag stored right after a block's data.
  virtual TagLength tag_size() const noexcept = 0;
  /// Protects data[0, len) in place and writes the tag at data + len.
  virtual void seal(std::uint8_t* data, DataLength len, FileOffset offset) = 0;
  /// Checks (and decrypts in place) the block whose tag is at data + len.
  virtual bool open(std::uint8_t* data, DataLength len, FileOffset offset) = 0;
  /// Another sealer with the same key, for another thread (a BlockWorkers lane): each block is
  /// still sealed once, by whichever lane takes it, so no nonce serves twice.
  virtual std::unique_ptr<BlockSealer> clone() const = 0;
};

/// Helper threads that hash, seal and open the blocks of a disk thread's batch beside it, one
/// block each, so that one transfer's per-byte work (SHA-256 digests, AES-GCM) is not bounded
/// by one core. One pool serves every transfer of a process; a disk thread takes part in its
/// own batch as lane 0 and never waits for a helper to start: a helper busy elsewhere only
/// means that the disk thread does more of the batch itself. Helpers hold no session state;
/// what a lane needs (its sealer, its hasher) is the disk thread's, by lane number.
class BlockWorkers {
public:
  /// Helpers of the shared pool unless configure() says otherwise: one per core but one.
  static constexpr unsigned max_helpers = 7;
  static unsigned default_helpers() noexcept;
  /// Sets the shared pool's helpers (0: none, every batch on its disk thread). The first call
  /// before shared() is first used decides; false for any later one (the pool is made once per
  /// process, and a program's own setting is not undone by a library's default).
  static bool configure(unsigned helpers) noexcept;
  /// The process's pool, made on first use and never destroyed (its helpers sleep until work
  /// comes); fewer helpers if the system will not start as many threads.
  static BlockWorkers& shared();

  explicit BlockWorkers(unsigned helpers);
  ~BlockWorkers();  // stops and joins the helpers (a pool no batch is using)
  BlockWorkers(const BlockWorkers&) = delete;
  BlockWorkers& operator=(const BlockWorkers&) = delete;

  /// Lanes a batch can spread over: the helpers and the calling thread.
  unsigned lanes() const noexcept { return static_cast<unsigned>(helpers_.size()) + 1; }
  /// Runs task(i, lane) for every i in [0, n): the caller as lane 0, helpers that are free as
  /// lanes 1 .. lanes()-1, each lane one task at a time; returns once every task is done. Every
  /// task runs even when one throws; the exception of the lowest task that threw is thrown
  /// here, after every task has ended.
  void run(std::size_t n, const std::function<void(std::size_t, unsigned)>& task);

private:
  struct Job;
  void help() noexcept;
  void work(Job& job, unsigned lane) noexcept;
  std::mutex m_;
  std::condition_variable work_;  // helpers wait here for a job
  std::condition_variable done_;  // a caller waits here for the helpers in its job to leave it
  std::deque<Job*> jobs_;         // with tasks left to take
  bool stop_ = false;
  std::vector<std::thread> helpers_;
};

/// Slack after every slot for a block's digest and tag.
inline constexpr std::uint32_t slot_tag_room = wire::max_block_tag;

/// The system calls a disk thread makes. The default makes the real ones; a test puts a faulty
/// one in their place (short transfers, EINTR, ENOSPC at the Nth call) to drive the retry and
/// failure paths deterministically.
class DiskIo {
public:
  virtual ~DiskIo() = default;
  virtual ssize_t pwritev(int fd, const iovec* iov, int count, off_t offset);
  virtual ssize_t writev(int fd, const iovec* iov, int count);
  virtual ssize_t preadv(int fd, const iovec* iov, int count, off_t offset);
  virtual ssize_t readv(int fd, const iovec* iov, int count);
  /// The real system calls.
  static DiskIo& system() noexcept;
};

/// Where a receiver keeps its resume point (a resumable partial file): the disk thread tells it
/// the prefix of the file that is written, every block in it verified against its digest,
/// whenever it grew by `bytes` or `interval` passed since the last time, and once more when it
/// stops short of the end. What a crash (no last word) loses is what came since.
class Checkpoint {
public:
  virtual ~Checkpoint() = default;
  /// On the disk thread: every byte below `prefix` is written and verified.
  virtual void save(std::uint64_t prefix) noexcept = 0;
  std::chrono::milliseconds interval{1000};
  std::uint64_t bytes = std::uint64_t(16) << 20;
};

/// Per-block digests a receiver keeps for a reader of the same file: a relay forwards every
/// block with the digest its source gave, not one made from its own copy, so a copy damaged
/// here is caught at the next host. Thread-safe: written by one disk thread, read by another.
class DigestLog {
public:
  virtual ~DigestLog() = default;
  virtual void put(std::uint64_t block, const manifest::Digest& d) noexcept = 0;
  /// False if the block's digest is not known here (it came before this process kept them).
  /// Called from several threads at once (a reader's BlockWorkers lanes).
  virtual bool get(std::uint64_t block, manifest::Digest& d) const noexcept = 0;
};

/// Where received bytes go.
struct Sink {
  int fd = -1;             ///< not owned
  bool seekable = true;    ///< regular file: pwritev at offsets; else in order with write(v)
  bool discard = false;    ///< memory sink: count the bytes, write nothing
  BlockSealer* opener = nullptr;  ///< if set, every block is checked (and decrypted) before it is written
  DiskIo* io = nullptr;    ///< the system calls to make (null: the real ones)
  /// If set, every block carries its digest after its data (inside the opener's protection):
  /// a block that does not match it fails the transfer; the ones that do go into this
  /// whole-file digest (written by the disk thread; the network thread reads it once every
  /// block is back).
  manifest::FileDigest* manifest = nullptr;
  /// With a manifest and no opener (clear mode): a block that does not match its digest is
  /// not written and goes back with `retry` set, for the receiver to ask for it again, instead
  /// of failing the transfer.
  bool refetch = false;
  /// A resumed transfer (with a manifest): the first `prefix` bytes are in the file already.
  /// The disk thread hashes them into the manifest first, from the file, before any block.
  std::uint64_t prefix = 0;
  /// If set (seekable, with a manifest): told the verified prefix as it grows.
  Checkpoint* checkpoint = nullptr;
  /// If set (seekable, with a manifest): raised to the verified prefix after every batch is
  /// written (never lowered), for a reader of the same file (a relay forwards what is here).
  std::atomic<std::uint64_t>* written = nullptr;
  /// If set (with a manifest): every verified block's digest is put here.
  DigestLog* digests = nullptr;
  /// If set, blocks are opened and their digests checked on its lanes, several at once (each
  /// lane with a clone of the opener); else one after the other on the disk thread.
  BlockWorkers* workers = nullptr;
};

/// Where sent bytes come from.
struct Source {
  int fd = -1;             ///< not owned
  std::uint64_t size = 0;  ///< bytes to send
  bool zero = false;       ///< memory source: zero-filled blocks, no reads
  BlockSealer* sealer = nullptr;  ///< if set, every block is sealed after it is read
  DiskIo* io = nullptr;    ///< the system calls to make (null: the real ones)
  /// If set, every block's digest is written after its data (before it is sealed) and goes
  /// into this whole-file digest, complete once the last block is handed over.
  manifest::FileDigest* manifest = nullptr;
  /// The reader stays after the last block, reading blocks again as the network thread asks
  /// (a Block with `retry` set names it). Never with a sealer: a block is sealed once per
  /// transfer, so no nonce serves twice.
  bool resends = false;
  /// A stream (a pipe, standard input): read in order with read(2) until its end, at most
  /// `size` bytes (more fails the transfer). Blocks are whole but the last; the end, once met,
  /// is BlockPipe::stream_end(), and the manifest's size is set then. Never with resends.
  bool stream = false;
  /// A file still being written (a relay's copy): a block is read only once every byte of it
  /// lies below *available; until then the reader waits (seeing a stop within 5 ms).
  const std::atomic<std::uint64_t>* available = nullptr;
  /// If set (with a manifest): a block goes with the digest kept here for it, where there is
  /// one, instead of one made from what was read (which is then not hashed at all). Read from
  /// the lanes of `workers`, so several threads at once.
  const DigestLog* digests = nullptr;
  /// Zero copy: the network thread sends each block's data from `fd` itself (sendfile), so a
  /// block is read here only where a digest must be made from it (one `digests` lacks); a
  /// slot carries the block's trailer (digest) alone. Never with a sealer, a stream, a memory
  /// source or the test hook, which all need the bytes in the slot, nor with a manifest
  /// without `digests` (the Sender's choice: what is hashed must be what is sent).
  bool zero_copy = false;
  /// Test hook (a relay host whose copy is damaged): every block's last byte is flipped (a
  /// pack's magic, at its start, stays), 1: after its digest is taken; 2: before (a forgery
  /// whose digests match it).
  std::uint8_t test_corrupt = 0;
  /// If set, blocks are hashed and sealed on its lanes, several at once (each lane with a clone
  /// of the sealer); else one after the other on the disk thread.
  BlockWorkers* workers = nullptr;
};

/// Bytes after a block's data in its slot and its frame: its digest, then its tag.
inline TagLength trailer(const manifest::FileDigest* manifest, const BlockSealer* sealer) noexcept {
  return TagLength((manifest ? manifest::digest_size : 0) + (sealer ? sealer->tag_size().value() : 0));
}

/// Unmaps a block pool.
struct PoolDeleter {
  std::size_t bytes;
  void operator()(std::uint8_t* p) const noexcept;
};

using PoolMemory = std::unique_ptr<std::uint8_t, PoolDeleter>;

/// A block pool kept between transfers of one session (on its thread only): the next pipe that
/// fits in it takes it instead of mapping (and faulting in) fresh memory. Not for memory-mode
/// sessions, whose sources send a slot's bytes as they are.
class PoolCache {
public:
  /// The kept pool if it holds at least `bytes`, else nothing (and the kept one is freed).
  PoolMemory take(std::size_t bytes) noexcept;
  void give(PoolMemory pool) noexcept;

private:
  PoolMemory kept_{nullptr, PoolDeleter{0}};
};

/// The shared state between one network thread and one disk thread.
class BlockPipe {
public:
  /// With a cache, the pool comes from it when it fits, and goes back to it at the end.
  BlockPipe(std::uint32_t block_size, std::uint32_t slots, PoolCache* cache = nullptr);
  ~BlockPipe();
  BlockPipe(const BlockPipe&) = delete;
  BlockPipe& operator=(const BlockPipe&) = delete;

  std::uint32_t block_size() const noexcept { return block_size_; }
  std::uint32_t slots() const noexcept { return slots_; }
  /// The slots will hold little but their blocks' trailers: zero copy moves the data. A fresh
  /// pool then faults in 4 KiB pages as trailers are written, instead of a 2 MiB huge page
  /// zeroed for every other trailer (and is not kept for the session's next pipe). Before the
  /// disk thread starts, on the network thread.
  void sparse() noexcept;
  /// A slot holds one block and, after its data, room for the block's tag.
  std::uint8_t* slot_data(std::uint32_t slot) noexcept {
    return memory_.get() + static_cast<std::size_t>(slot) * (block_size_ + slot_tag_room);
  }

  // Network-thread side.
  /// Hands a block to the disk thread (never fails: the ring holds every slot).
  void to_disk(const Block& b) noexcept;
  /// Hands a slot back to the disk thread, waking it only once `batch` slots wait for it
  /// unwoken, or at once if `now`. A sender returns one slot per block sent; waking the disk
  /// thread for each one cost a futex wake, its wait, and an eventfd round trip back per block.
  /// Whoever calls this must call it with `now` before the blocks it can send run out.
  void to_disk_lazily(const Block& b, std::uint32_t batch, bool now) noexcept;
  /// Wakes the disk thread for the slots to_disk_lazily left unwoken, if any.
  void flush_to_disk() noexcept;
  bool from_disk(Block& out) noexcept { return back_.try_pop(out); }
  EventFd& net_wake() noexcept { return net_wake_; }

  // Disk-thread side.
  bool disk_pop(Block& out) noexcept { return forth_.try_pop(out); }
  void disk_push(const Block& b) noexcept;
  /// Sleeps until the network thread pushes something or stop() is called. A plain futex wait:
  /// std::atomic::wait spins through sched_yield first, which costs context switches per block.
  void disk_wait(std::uint32_t seen) noexcept;
  std::uint32_t disk_seq() const noexcept { return disk_seq_.load(std::memory_order_acquire); }

  /// Asks the disk thread to stop soon; safe from either thread.
private:
  void wake_disk() noexcept;

public:
  void stop() noexcept;
  bool stopping() const noexcept { return stop_.load(std::memory_order_acquire); }
  const std::atomic<bool>& stop_flag() const noexcept { return stop_; }
  /// A resumed transfer: bytes of the kept prefix the disk thread has hashed so far.
  std::atomic<std::uint64_t>& prefix_hashed() noexcept { return prefix_hashed_; }
  /// A stream's size once its reader met its end (set before the last blocks are handed over);
  /// none before.
  static constexpr std::uint64_t no_end = UINT64_MAX;
  std::uint64_t stream_end() const noexcept { return stream_end_.load(std::memory_order_acquire); }
  void set_stream_end(std::uint64_t size) noexcept { stream_end_.store(size, std::memory_order_release); }

  /// First error the disk thread hit (errno and what it was doing); set once, then it exits.
  void set_error(errc code, std::string what) noexcept;
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  errc error_code() const noexcept { return error_code_; }
  const std::string& error_text() const noexcept { return error_text_; }

private:
  std::uint32_t block_size_;
  std::uint32_t slots_;
  PoolCache* cache_;
  PoolMemory memory_;
  bool huge_ = false;    // a fresh pool asked for transparent huge pages
  bool sparse_ = false;  // ...and was told not to (sparse())
  SpscRing<Block> forth_;  // net -> disk
  SpscRing<Block> back_;   // disk -> net
  std::atomic<std::uint32_t> disk_seq_{0};
  std::atomic<bool> disk_sleeping_{false};  // lets the producer skip the wake-up syscall
  std::uint32_t unwoken_ = 0;               // network thread: slots pushed since the last wake
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> prefix_hashed_{0};
  std::atomic<std::uint64_t> stream_end_{no_end};
  EventFd net_wake_;
  std::atomic<bool> failed_{false};
  errc error_code_ = errc::ok;
  std::string error_text_;
};

/// Largest number of slots one vectored call covers.
inline constexpr std::size_t max_iov = 64;

/// Slots a disk thread seals (or opens) and then reads (or writes) in one go when blocks are
/// protected: about 2 MiB a lane, so the bytes are still in cache between the cryptography and
/// the copy, and every lane of a BlockWorkers pool has a block of the group; but at most a
/// quarter of the ring's `slots` (at least one), since the helpers may be busy elsewhere and the
/// disk thread then does the whole group alone before any of it is handed over.
constexpr std::size_t crypto_group(std::uint32_t block_size, unsigned lanes = 1, std::uint32_t slots = 0) noexcept {
  const std::size_t n = (std::size_t{2} << 20) / (block_size ? block_size : 1);
  std::size_t group = (n < 1 ? 1 : n) * (lanes ? lanes : 1);
  if (lanes > 1 && slots > 0 && group > slots / 4) group = slots / 4 < 1 ? 1 : slots / 4;
  return group > max_iov ? max_iov : group;
}

/// What a disk thread keeps for each lane of its BlockWorkers: lane 0 is its own (the source's
/// sealer or the sink's opener), the others clones, each lane with a hasher. A lane's are made
/// the first time that lane works for this disk thread, by the thread holding the lane (one at a
/// time), so a transfer of one block (path mode's small files) makes none.
struct Lanes {
  Lanes(BlockWorkers* workers, BlockSealer* sealer);
  unsigned count() const noexcept { return static_cast<unsigned>(hashers.size()); }
  BlockSealer* sealer(unsigned lane);
  manifest::BlockHasher& hasher(unsigned lane);
  BlockWorkers* workers;
  BlockSealer* own;
  std::vector<std::unique_ptr<BlockSealer>> clones;             // lanes 1.., made on first use
  std::vector<std::unique_ptr<manifest::BlockHasher>> hashers;  // made on first use
};

/// The disk thread of a receiving side: writes filled blocks, coalescing contiguous ones into
/// one pwritev; for a non-seekable sink it restores offset order and writes sequentially.
/// Each written block goes back to the network thread as a free slot.
class DiskWriter {
public:
  DiskWriter(BlockPipe& pipe, Sink sink);
  ~DiskWriter();  // stops and joins
  void join();

private:
  void run();
  void write_blocks();
  BlockPipe& pipe_;
  Sink sink_;
  std::thread thread_;
};

/// The disk thread of a sending side: fills free slots with the next blocks of the source,
/// several at a time with one preadv, ahead of the network.
class DiskReader {
public:
  /// From start_offset on (a resumed transfer); with a manifest, the blocks before it are
  /// hashed into it first, read from the source but not handed over.
  DiskReader(BlockPipe& pipe, Source source, std::uint64_t start_offset = 0);
  ~DiskReader();
  void join();

private:
  void run();
  void read_blocks();
  void read_stream();
  /// Blocks just read (offsets and lengths set, at most max_iov): each one's digest after its
  /// data, then sealed, as the source says, on the lanes of its workers; then the digests into
  /// the manifest in the blocks' order.
  void finish(Block* blocks, std::size_t n);
  /// One block of finish(), on `lane`; its digest (with a manifest) in `d`.
  void protect(Block& b, unsigned lane, manifest::Digest& d);
  /// Whether these blocks must be read into their slots: always, but with zero copy only if a
  /// digest is to be made from one.
  bool needs_bytes(const Block* blocks, std::size_t n) const noexcept;
  DiskIo& io() const noexcept { return source_.io ? *source_.io : DiskIo::system(); }
  /// Slots read in one go: with a sealer or digests at most crypto_group's bytes, hashed and
  /// sealed while still in cache.
  std::size_t batch_cap() const noexcept {
    return source_.sealer || source_.manifest ? crypto_group(pipe_.block_size(), lanes_ ? lanes_->count() : 1, pipe_.slots())
                                                : max_iov;
  }
  BlockPipe& pipe_;
  Source source_;
  std::uint64_t next_;
  std::optional<Lanes> lanes_;  // made on the disk thread
  std::thread thread_;
};


}  // namespace xdfs::piod
