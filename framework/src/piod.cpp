#include "xdfs/piod.hpp"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <map>
#include <new>
#include <optional>

namespace xdfs::piod {

EventFd::EventFd() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (fd_ < 0) throw Error(errc_from_errno(errno), std::string("eventfd: ") + std::strerror(errno));
}

EventFd::~EventFd() {
  if (fd_ >= 0) ::close(fd_);
}

void EventFd::notify() noexcept {
  std::uint64_t one = 1;
  // EAGAIN means the counter is saturated: the reader is awake anyway.
  [[maybe_unused]] auto r = ::write(fd_, &one, sizeof one);
}

bool EventFd::drain() noexcept {
  std::uint64_t v = 0;
  return ::read(fd_, &v, sizeof v) == static_cast<ssize_t>(sizeof v);
}

void PoolDeleter::operator()(std::uint8_t* p) const noexcept { ::munmap(p, bytes); }

ssize_t DiskIo::pwritev(int fd, const iovec* iov, int count, off_t offset) { return ::pwritev(fd, iov, count, offset); }
ssize_t DiskIo::writev(int fd, const iovec* iov, int count) { return ::writev(fd, iov, count); }
ssize_t DiskIo::preadv(int fd, const iovec* iov, int count, off_t offset) { return ::preadv(fd, iov, count, offset); }
ssize_t DiskIo::readv(int fd, const iovec* iov, int count) { return ::readv(fd, iov, count); }

DiskIo& DiskIo::system() noexcept {
  static DiskIo real;
  return real;
}

PoolMemory PoolCache::take(std::size_t bytes) noexcept {
  if (kept_ && kept_.get_deleter().bytes >= bytes) return std::move(kept_);
  kept_.reset();
  return PoolMemory(nullptr, PoolDeleter{0});
}

void PoolCache::give(PoolMemory pool) noexcept {
  if (pool && (!kept_ || pool.get_deleter().bytes >= kept_.get_deleter().bytes)) kept_ = std::move(pool);
}

BlockPipe::BlockPipe(std::uint32_t block_size, std::uint32_t slots, PoolCache* cache)
    : block_size_(block_size), slots_(slots), cache_(cache), memory_(nullptr, PoolDeleter{0}), forth_(slots), back_(slots) {
  const std::size_t bytes = (static_cast<std::size_t>(block_size) + slot_tag_room) * slots;
  if (cache_) {
    memory_ = cache_->take(bytes);
    if (memory_) return;
  }
  // Anonymous pages: page-aligned, zero-filled (memory sources seal defined bytes) and faulted
  // in only when a slot is first used, so a small transfer never pays for the whole pool.
  // A pool of 2 MiB or more is aligned to 2 MiB and asks for transparent huge pages: every
  // transfer starts on fresh memory, and faulting it in 4 KiB at a time cost more than reading
  // a 10 MiB file from the page cache.
  constexpr std::size_t huge = std::size_t{2} << 20;
  // Whole pages: the tail past a big pool is unmapped from a page boundary (munmap refuses any
  // other, which left up to 2 MiB and a mapping behind for every pool a server made).
  const long pg = ::sysconf(_SC_PAGESIZE);
  const std::size_t page = pg > 0 ? static_cast<std::size_t>(pg) : 4096;
  const std::size_t mapped = (bytes + page - 1) / page * page;
  const bool big = mapped >= huge;
  const std::size_t want = big ? mapped + huge : mapped;
  void* mem = ::mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::bad_alloc();
  auto* p = static_cast<std::uint8_t*>(mem);
  if (big) {
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    const std::size_t head = (huge - addr % huge) % huge;
    if (head) ::munmap(p, head);
    if (huge - head) ::munmap(p + head + mapped, huge - head);
    p += head;
    (void)::madvise(p, mapped, MADV_HUGEPAGE);  // a hint: without THP, 4 KiB pages as before
    huge_ = true;
  }
  memory_ = std::unique_ptr<std::uint8_t, PoolDeleter>(p, PoolDeleter{mapped});
}

BlockPipe::~BlockPipe() {
  // A sparse pool has a page here and there in every 2 MiB: one that fills its slots would
  // fault 4 KiB pages all over it. The session's next pipe maps a fresh one instead.
  if (cache_ && !sparse_) cache_->give(std::move(memory_));
}

void BlockPipe::sparse() noexcept {
  // (A pool from the cache was mapped by an earlier pipe, and took its advice then.)
  if (!huge_ || sparse_) return;
  sparse_ = ::madvise(memory_.get(), memory_.get_deleter().bytes, MADV_NOHUGEPAGE) == 0;
}

namespace {
long futex(std::atomic<std::uint32_t>& word, int op, std::uint32_t value) noexcept {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), op, value, nullptr, nullptr, 0);
}
}  // namespace

void BlockPipe::wake_disk() noexcept {
  // Paired with disk_wait(): either the sleeper sees the new sequence number, or we see it asleep.
  disk_seq_.fetch_add(1, std::memory_order_seq_cst);
  if (disk_sleeping_.load(std::memory_order_seq_cst)) futex(disk_seq_, FUTEX_WAKE_PRIVATE, 1);
}

void BlockPipe::disk_wait(std::uint32_t seen) noexcept {
  disk_sleeping_.store(true, std::memory_order_seq_cst);
  if (disk_seq_.load(std::memory_order_seq_cst) == seen) futex(disk_seq_, FUTEX_WAIT_PRIVATE, seen);
  disk_sleeping_.store(false, std::memory_order_relaxed);
}

void BlockPipe::to_disk(const Block& b) noexcept {
  [[maybe_unused]] bool ok = forth_.try_push(b);
  unwoken_ = 0;
  wake_disk();
}

void BlockPipe::flush_to_disk() noexcept {
  if (unwoken_ == 0) return;
  unwoken_ = 0;
  wake_disk();
}

void BlockPipe::to_disk_lazily(const Block& b, std::uint32_t batch, bool now) noexcept {
  [[maybe_unused]] bool ok = forth_.try_push(b);
  if (now || ++unwoken_ >= batch) {
    unwoken_ = 0;
    wake_disk();
  }
}

void BlockPipe::disk_push(const Block& b) noexcept {
  [[maybe_unused]] bool ok = back_.try_push(b);
}

void BlockPipe::stop() noexcept {
  stop_.store(true, std::memory_order_release);
  wake_disk();
}

void BlockPipe::set_error(errc code, std::string what) noexcept {
  if (failed_.load(std::memory_order_acquire)) return;
  error_code_ = code;
  error_text_ = std::move(what);
  failed_.store(true, std::memory_order_release);
  net_wake_.notify();
}

namespace {

// Steps an iovec array past n transferred bytes (a short pwritev/preadv): whole entries are
// dropped, a partial one is trimmed. Returns the new first entry and count.
void advance(iovec*& iov, int& cnt, std::size_t n) noexcept {
  while (cnt > 0 && n >= iov->iov_len) {
    n -= iov->iov_len;
    ++iov;
    --cnt;
  }
  if (cnt > 0 && n > 0) {
    iov->iov_base = static_cast<char*>(iov->iov_base) + n;
    iov->iov_len -= n;
  }
}

// Writes every byte of iov at offset (or at the current position when offset < 0), retrying on
// short writes and EINTR. A non-blocking sink (a FIFO) that is full is waited for with poll in
// short steps, so that a stop is seen while its reader does not read. Returns 0 or an errno.
int write_all(DiskIo& io, int fd, iovec* iov, int cnt, std::int64_t offset, const std::atomic<bool>& stop) {
  while (cnt > 0) {
    ssize_t n = offset >= 0 ? io.pwritev(fd, iov, cnt, offset) : io.writev(fd, iov, cnt);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        if (stop.load(std::memory_order_acquire)) return ECANCELED;
        pollfd pfd{fd, POLLOUT, 0};
        (void)::poll(&pfd, 1, 200);
        continue;
      }
      return errno;
    }
    if (n == 0) return EIO;
    if (offset >= 0) offset += n;
    advance(iov, cnt, static_cast<std::size_t>(n));
  }
  return 0;
}

}  // namespace

// ---- BlockWorkers ----

struct BlockWorkers::Job {
  const std::function<void(std::size_t, unsigned)>* task = nullptr;
  std::size_t n = 0;
  std::atomic<std::size_t> next{0};
  unsigned lanes = 1;  // lanes given out so far (under m_)
  unsigned inside = 0;  // helpers working in it (under m_)
  std::exception_ptr error;  // of the lowest task that threw (under m_)
  std::size_t error_task = SIZE_MAX;
};

namespace {
std::atomic<int> configured_helpers{-1};  // -1: default_helpers()
std::atomic<bool> shared_made{false};
}  // namespace

unsigned BlockWorkers::default_helpers() noexcept {
  const unsigned cores = std::thread::hardware_concurrency();
  return cores <= 1 ? 0 : std::min(cores - 1, max_helpers);
}

bool BlockWorkers::configure(unsigned helpers) noexcept {
  if (shared_made.load(std::memory_order_acquire)) return false;
  int unset = -1;
  return configured_helpers.compare_exchange_strong(unset, static_cast<int>(std::min(helpers, max_helpers)),
                                                    std::memory_order_acq_rel);
}

BlockWorkers& BlockWorkers::shared() {
  static BlockWorkers* const pool = [] {
    shared_made.store(true, std::memory_order_release);
    const int c = configured_helpers.load(std::memory_order_acquire);
    return new BlockWorkers(c < 0 ? default_helpers() : static_cast<unsigned>(c));  // never freed: see shared()
  }();
  return *pool;
}

BlockWorkers::BlockWorkers(unsigned helpers) {
  helpers = std::min(helpers, max_helpers);
  helpers_.reserve(helpers);
  for (unsigned i = 0; i < helpers; ++i) {
    try {
      helpers_.emplace_back([this] { help(); });
    } catch (...) {  // no thread (system_error) or no memory for one: fewer helpers, fewer lanes
      break;
    }
  }
}

BlockWorkers::~BlockWorkers() {
  {
    std::lock_guard lock(m_);
    stop_ = true;
  }
  work_.notify_all();
  for (auto& t : helpers_) t.join();
}

void BlockWorkers::work(Job& job, unsigned lane) noexcept {
  for (std::size_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.n;) {
    try {
      (*job.task)(i, lane);
    } catch (...) {
      std::lock_guard lock(m_);
      if (i < job.error_task) {
        job.error = std::current_exception();
        job.error_task = i;
      }
    }
  }
}

void BlockWorkers::help() noexcept {
  // Signals go to the process's other threads: a helper only computes. Not the ones a fault
  // raises, which would otherwise kill the process without its handlers' say.
  sigset_t all;
  sigfillset(&all);
  for (int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) sigdelset(&all, fault);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  std::unique_lock lock(m_);
  while (true) {
    work_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    Job* job = jobs_.front();
    // Every task taken (or every lane given): nobody else need come; its caller waits for those inside.
    if (job->next.load(std::memory_order_relaxed) >= job->n || job->lanes >= lanes()) {
      jobs_.pop_front();
      continue;
    }
    const unsigned lane = job->lanes++;
    ++job->inside;
    lock.unlock();
    work(*job, lane);
    lock.lock();
    if (--job->inside == 0) done_.notify_all();
  }
}

void BlockWorkers::run(std::size_t n, const std::function<void(std::size_t, unsigned)>& task) {
  if (n == 0) return;
  Job job;
  job.task = &task;
  job.n = n;
  if (helpers_.empty() || n == 1) {
    work(job, 0);  // the same rules: every task runs, the lowest one's exception comes back
    if (job.error) std::rethrow_exception(job.error);
    return;
  }
  {
    std::lock_guard lock(m_);
    jobs_.push_back(&job);
  }
  // As many helpers as there are tasks beside the caller's first one.
  if (n - 1 >= helpers_.size())
    work_.notify_all();
  else
    for (std::size_t i = 0; i + 1 < n; ++i) work_.notify_one();
  work(job, 0);
  std::unique_lock lock(m_);
  // No helper enters it from now on; those inside finish the task they took.
  if (auto it = std::find(jobs_.begin(), jobs_.end(), &job); it != jobs_.end()) jobs_.erase(it);
  done_.wait(lock, [&] { return job.inside == 0; });
  if (job.error) std::rethrow_exception(job.error);
}

Lanes::Lanes(BlockWorkers* w, BlockSealer* sealer) : workers(w), own(sealer) {
  const unsigned n = w ? w->lanes() : 1;
  clones.resize(n - 1);
  hashers.resize(n);
}

BlockSealer* Lanes::sealer(unsigned lane) {
  if (lane == 0 || !own) return own;
  auto& c = clones[lane - 1];
  if (!c) c = own->clone();
  return c.get();
}

manifest::BlockHasher& Lanes::hasher(unsigned lane) {
  auto& h = hashers[lane];
  if (!h) h = std::make_unique<manifest::BlockHasher>();
  return *h;
}

// ---- DiskWriter ----

DiskWriter::DiskWriter(BlockPipe& pipe, Sink sink) : pipe_(pipe), sink_(sink), thread_([this] { run(); }) {}

DiskWriter::~DiskWriter() {
  pipe_.stop();
  join();
}

namespace {
// Raises a watermark that other threads read (never lowers it).
void raise(std::atomic<std::uint64_t>& mark, std::uint64_t to) noexcept {
  std::uint64_t was = mark.load(std::memory_order_relaxed);
  while (was < to && !mark.compare_exchange_weak(was, to, std::memory_order_release, std::memory_order_relaxed)) {
  }
}
}  // namespace

void DiskWriter::join() {
  if (thread_.joinable()) thread_.join();
}

void DiskWriter::run() {
  // A pipe or FIFO sink whose reader went away fails this transfer with EPIPE; its SIGPIPE,
  // blocked on this thread only, never ends the process (it is dropped when the thread ends).
  sigset_t pipe_signal;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
  // A throw here (memory) fails the transfer, never the process.
  try {
    write_blocks();
  } catch (const std::exception& e) {
    pipe_.set_error(errc::internal, std::string("disk writer: ") + e.what());
  }
}

void DiskWriter::write_blocks() {
  std::vector<Block> batch;
  batch.reserve(pipe_.slots());
  std::map<std::uint64_t, Block> pending;  // non-seekable sinks: blocks waiting for their turn
  std::uint64_t next_in_order = 0;
  iovec iov[max_iov];

  auto fail = [&](int err, std::uint64_t offset) {
    pipe_.set_error(errc_from_errno(err), "write at offset " + std::to_string(offset) + ": " + std::strerror(err));
  };

  // Writes blocks[first..last) that are known to be contiguous, in runs of at most max_iov;
  // a block to fetch again (retry) is not written and splits the run. A block spliced into the
  // file whole has nothing left to write; one spliced in part (its file stopped taking
  // splices) goes alone, from where its part in the file ends.
  auto write_run = [&](const Block* blocks, std::size_t count) -> bool {
    for (std::size_t i = 0; i < count;) {
      if (blocks[i].retry || (blocks[i].in_file > 0 && blocks[i].in_file >= blocks[i].length.value())) {
        ++i;
        continue;
      }
      if (pipe_.stopping()) return false;
      const std::uint32_t skip = blocks[i].in_file;
      std::size_t n = 0;
      for (; n < max_iov && i + n < count && !blocks[i + n].retry && blocks[i + n].in_file == 0; ++n) {
        iov[n].iov_base = pipe_.slot_data(blocks[i + n].slot);
        iov[n].iov_len = blocks[i + n].length.value();
      }
      if (skip > 0) {
        iov[0].iov_base = pipe_.slot_data(blocks[i].slot) + skip;
        iov[0].iov_len = blocks[i].length.value() - skip;
        n = 1;
      }
      if (!sink_.discard) {
        const auto off = sink_.seekable ? static_cast<std::int64_t>(blocks[i].offset.value() + skip) : -1;
        if (int err = write_all(sink_.io ? *sink_.io : DiskIo::system(), sink_.fd, iov, static_cast<int>(n), off,
                                pipe_.stop_flag());
            err != 0) {
          fail(err, blocks[i].offset.value());
          return false;
        }
      }
      i += n;
    }
    return true;
  };

  // Opens (decrypts or checks) blocks in place, then checks each one's digest, on the lanes of
  // the sink's workers; then, in the blocks' order, false at the first that failed either check
  // (with refetch, a digest that does not match marks the block instead), and the digests of
  // the others go into the manifest.
  Lanes lanes(sink_.workers, sink_.opener);
  const std::uint32_t digest = sink_.manifest ? manifest::digest_size : 0;
  enum class Check : std::uint8_t { ok, tag, digest };
  std::vector<Check> checks;
  std::vector<manifest::Digest> found;
  auto check = [&](const Block& b, unsigned lane, Check& c, manifest::Digest& d) {
    std::uint8_t* data = pipe_.slot_data(b.slot);
    const std::uint32_t len = b.length.value();
    c = Check::ok;
    if (sink_.opener && !lanes.sealer(lane)->open(data, DataLength(len + digest), b.offset)) {
      c = Check::tag;
      return;
    }
    if (!sink_.manifest) return;
    d = lanes.hasher(lane).digest(data, len);
    if (std::memcmp(d.data(), data + len, d.size()) != 0) c = Check::digest;
  };
  auto open_all = [&](Block* blocks, std::size_t count) -> bool {
    if (!sink_.opener && !sink_.manifest) return true;
    checks.resize(count);
    found.resize(count);
    if (lanes.count() > 1 && count > 1)
      lanes.workers->run(count, [&](std::size_t k, unsigned lane) { check(blocks[k], lane, checks[k], found[k]); });
    else
      for (std::size_t k = 0; k < count; ++k) check(blocks[k], 0, checks[k], found[k]);
    for (std::size_t k = 0; k < count; ++k) {
      if (checks[k] == Check::tag) {
        pipe_.set_error(errc::integrity_error,
                        "block at offset " + std::to_string(blocks[k].offset.value()) + " failed its integrity check");
        return false;
      }
      if (!sink_.manifest) continue;
      if (checks[k] == Check::digest && sink_.refetch) {
        blocks[k].retry = true;
        continue;
      }
      if (checks[k] == Check::digest) {
        pipe_.set_error(errc::integrity_error, "block at offset " + std::to_string(blocks[k].offset.value()) +
                                                   " does not match its digest");
        return false;
      }
      const manifest::Digest& d = found[k];
      const auto added = sink_.manifest->add(blocks[k].offset, d);
      if (added == manifest::FileDigest::Added::ok && sink_.digests)
        sink_.digests->put(blocks[k].offset.value() / pipe_.block_size(), d);
      if (added != manifest::FileDigest::Added::ok) {
        pipe_.set_error(errc::protocol_error,
                        added == manifest::FileDigest::Added::too_far_ahead
                            ? "block at offset " + std::to_string(blocks[k].offset.value()) +
                                  " arrived too far ahead of the block at offset " +
                                  std::to_string(sink_.manifest->next_offset()) + ", which never came"
                            : "block at offset " + std::to_string(blocks[k].offset.value()) + " is not one of the file's");
        return false;
      }
    }
    return true;
  };

  // A resumed transfer: the part already in the file goes into the manifest first, read back
  // from the file (verified by the whole-file digest at the end, never trusted).
  if (sink_.manifest && sink_.prefix > 0) {
    const auto st = manifest::add_file(sink_.fd, *sink_.manifest, sink_.prefix, &pipe_.stop_flag(), &pipe_.prefix_hashed());
    if (st.code == errc::cancelled) return;
    if (st.code != errc::ok) {
      pipe_.set_error(st.code, "the partial file: " + st.message);
      return;
    }
  }
  // The verified prefix (every block below it checked and written), told to the checkpoint
  // while it grows and once more whichever way this ends.
  if (sink_.written && sink_.manifest && sink_.seekable) raise(*sink_.written, sink_.prefix);
  std::uint64_t written = sink_.prefix, saved = sink_.prefix;
  auto last_save = std::chrono::steady_clock::now();
  struct FinalSave {
    Checkpoint* c;
    const std::uint64_t& at;
    const std::uint64_t& saved;
    std::uint64_t end;
    ~FinalSave() {
      // A whole file is committed next: no record is needed for it.
      if (c && at != saved && at != end) c->save(at);
    }
  } final_save{sink_.seekable && sink_.manifest ? sink_.checkpoint : nullptr, written, saved,
               sink_.manifest ? sink_.manifest->file_size() : 0};

  while (true) {
    // The wake-up count first, then the stop: a stop after this read raises the count, so the
    // wait below returns at once. Read the other way round, a stop between the two was lost
    // and the thread slept for ever, its transfer's join with it (a fuzzed session hung so).
    const std::uint32_t seen = pipe_.disk_seq();
    // Once stopped, nothing more is written: the transfer has failed (or ended), and its file
    // descriptor is about to be closed and may then name another session's file.
    if (pipe_.stopping()) return;
    batch.clear();
    Block b;
    while (batch.size() < pipe_.slots() && pipe_.disk_pop(b)) batch.push_back(b);
    if (batch.empty()) {
      pipe_.disk_wait(seen);
      continue;
    }
    if (sink_.seekable || sink_.discard) {
      // Blocks arrive from n channels roughly in order: write each contiguous run in one call.
      // With an opener, a run is at most crypto_group bytes, each opened just before its write
      // (still in cache); every run's slots go back to the network thread as soon as it is out.
      const bool checked = sink_.opener || sink_.manifest;
      const std::size_t cap = checked ? crypto_group(pipe_.block_size(), lanes.count(), pipe_.slots()) : max_iov;
      std::size_t start = 0;
      for (std::size_t i = 1; i <= batch.size(); ++i) {
        const bool breaks = i == batch.size() || i - start == cap ||
                            after(batch[i - 1].offset, batch[i - 1].length) != batch[i].offset;
        if (!breaks) continue;
        if (!open_all(&batch[start], i - start) || !write_run(&batch[start], i - start)) return;
        if (checked) {
          for (std::size_t k = start; k < i; ++k) pipe_.disk_push(batch[k]);
          pipe_.net_wake().notify();
        }
        start = i;
      }
      if (!checked) {
        for (const auto& blk : batch) pipe_.disk_push(blk);
        pipe_.net_wake().notify();
      }
      if (sink_.written && sink_.manifest && sink_.seekable) raise(*sink_.written, sink_.manifest->next_offset());
      if (final_save.c && sink_.manifest->next_offset() != written) {
        written = sink_.manifest->next_offset();
        const auto now = std::chrono::steady_clock::now();
        if (written != final_save.end &&
            (written - saved >= final_save.c->bytes || now - last_save >= final_save.c->interval)) {
          final_save.c->save(written);
          saved = written;
          last_save = now;
        }
      }
      continue;
    }
    if (!open_all(batch.data(), batch.size())) return;
    bool rejected = false;
    for (const auto& blk : batch) {
      if (!blk.retry) {
        pending.emplace(blk.offset.value(), blk);
        continue;
      }
      pipe_.disk_push(blk);  // back unwritten, to be fetched again
      rejected = true;
    }
    if (rejected) pipe_.net_wake().notify();
    std::vector<Block> run;
    while (!pending.empty() && pending.begin()->first == next_in_order) {
      run.push_back(pending.begin()->second);
      next_in_order += pending.begin()->second.length.value();
      pending.erase(pending.begin());
    }
    if (run.empty()) continue;
    if (!write_run(run.data(), run.size())) return;
    for (const auto& blk : run) pipe_.disk_push(blk);
    pipe_.net_wake().notify();
  }
}

DiskReader::DiskReader(BlockPipe& pipe, Source source, std::uint64_t start_offset)
    : pipe_(pipe), source_(source), next_(start_offset), thread_([this] { run(); }) {}

DiskReader::~DiskReader() {
  pipe_.stop();
  join();
}

void DiskReader::join() {
  if (thread_.joinable()) thread_.join();
}

void DiskReader::run() {
  try {
    lanes_.emplace(source_.workers, source_.sealer);
    if (source_.stream)
      read_stream();
    else
      read_blocks();
  } catch (const std::exception& e) {
    pipe_.set_error(errc::internal, std::string("disk reader: ") + e.what());
  }
}

void DiskReader::read_blocks() {
  const std::uint32_t bs = pipe_.block_size();
  DiskIo& io = this->io();
  Block batch[max_iov];
  iovec iov[max_iov];

  // A file still being written: the part the receiver has must be here before it is hashed.
  while (source_.available && next_ > 0 && source_.available->load(std::memory_order_acquire) < next_) {
    if (pipe_.stopping()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // A resumed transfer: the blocks before the start go into the manifest, read but not sent.
  if (source_.manifest && next_ > 0 && !source_.zero) {
    const auto st = manifest::add_file(source_.fd, *source_.manifest, next_, &pipe_.stop_flag(), &pipe_.prefix_hashed());
    if (st.code == errc::cancelled) return;
    if (st.code != errc::ok) {
      pipe_.set_error(st.code, "hashing the part the receiver has: " + st.message);
      return;
    }
  }

  // Reads iov[0, count) at pos whole; a short read means the file shrank under us.
  auto read_all = [&](iovec* cur, int left, std::uint64_t pos) -> bool {
    while (left > 0) {
      ssize_t r = io.preadv(source_.fd, cur, left, static_cast<off_t>(pos));
      if (r < 0) {
        if (errno == EINTR) continue;
        pipe_.set_error(errc_from_errno(errno), "read at offset " + std::to_string(pos) + ": " + std::strerror(errno));
        return false;
      }
      if (r == 0) {
        pipe_.set_error(errc::size_mismatch, "source file shrank to " + std::to_string(pos) + " bytes while being sent");
        return false;
      }
      pos += static_cast<std::uint64_t>(r);
      advance(cur, left, static_cast<std::size_t>(r));
    }
    return true;
  };

  // A block the receiver asks for again: read it where it is and hand it over as it was first
  // sent, with its digest (never sealed: Source::resends goes without a sealer).
  auto read_again = [&](Block b) -> bool {
    if (source_.sealer) {  // never: its nonce would serve twice (Source::resends goes without one)
      pipe_.set_error(errc::internal, "a sealed block cannot be sent again");
      return false;
    }
    b.in_slot = !source_.zero && needs_bytes(&b, 1);
    if (b.in_slot) {
      iovec one{pipe_.slot_data(b.slot), b.length.value()};
      if (!read_all(&one, 1, b.offset.value())) return false;
    }
    if (source_.manifest) {
      std::uint8_t* data = pipe_.slot_data(b.slot);
      manifest::Digest d;
      if (source_.test_corrupt == 2) data[b.length.value() - 1] ^= 1;
      if (source_.test_corrupt == 2 || !source_.digests || !source_.digests->get(b.offset.value() / pipe_.block_size(), d))
        d = lanes_->hasher(0).digest(data, b.length.value());
      manifest::BlockHasher::put(data + b.length.value(), d);
      if (source_.test_corrupt == 1) data[b.length.value() - 1] ^= 1;
    }
    pipe_.disk_push(b);
    pipe_.net_wake().notify();
    return true;
  };

  Block held_block{};  // a slot for a block that is not in the file yet (Source::available)
  bool held = false;
  while (true) {
    const std::uint32_t seen = pipe_.disk_seq();
    std::size_t n = 0;
    std::uint64_t off = next_;
    Block b;
    bool popped = false;
    const std::size_t cap = batch_cap();
    // A file still being written: only whole blocks below what is there now (or its tail).
    std::uint64_t limit = source_.size;
    if (source_.available) {
      const std::uint64_t there = std::min(source_.available->load(std::memory_order_acquire), source_.size);
      limit = there == source_.size ? there : there - there % bs;
    }
    auto next_slot = [&](Block& out) {
      if (!held) return pipe_.disk_pop(out);
      out = held_block;
      held = false;
      return true;
    };
    while (n < cap && next_slot(b)) {
      popped = true;
      if (b.retry) {
        if (pipe_.stopping() || !read_again(b)) return;
        continue;
      }
      if (off >= source_.size) continue;  // a slot after the last block: nothing to read into it
      if (off >= limit) {                  // not there yet: the slot waits for it
        held_block = b;
        held = true;
        break;
      }
      b.offset = FileOffset(off);
      b.length = DataLength(static_cast<std::uint32_t>(std::min<std::uint64_t>(bs, source_.size - off)));
      off += b.length.value();
      batch[n] = b;
      iov[n].iov_base = pipe_.slot_data(b.slot);
      iov[n].iov_len = b.length.value();
      ++n;
    }
    if (pipe_.stopping()) return;
    if (n == 0 && held) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    if (n == 0) {
      if (popped) continue;
      // Every block is out: done, unless the network thread may still ask for one again.
      if (next_ >= source_.size && !source_.resends) return;
      pipe_.disk_wait(seen);
      continue;
    }
    const bool read = !source_.zero && needs_bytes(batch, n);
    if (read && !read_all(iov, static_cast<int>(n), next_)) return;
    for (std::size_t i = 0; i < n; ++i) batch[i].in_slot = read;
    next_ = off;
    finish(batch, n);
    for (std::size_t i = 0; i < n; ++i) pipe_.disk_push(batch[i]);
    pipe_.net_wake().notify();
  }
}

bool DiskReader::needs_bytes(const Block* blocks, std::size_t n) const noexcept {
  if (!source_.zero_copy) return true;  // the slot's bytes are what is sent
  if (!source_.manifest) return false;  // nothing is made from them
  manifest::Digest d;
  for (std::size_t i = 0; i < n; ++i)
    if (!source_.digests || !source_.digests->get(blocks[i].offset.value() / pipe_.block_size(), d)) return true;
  return false;  // every digest is kept already (a relay's copy)
}

void DiskReader::protect(Block& b, unsigned lane, manifest::Digest& d) {
  std::uint8_t* data = pipe_.slot_data(b.slot);
  std::uint32_t len = b.length.value();
  if (source_.manifest) {
    if (source_.test_corrupt == 2) data[len - 1] ^= 1;
    if (source_.test_corrupt == 2 || !source_.digests || !source_.digests->get(b.offset.value() / pipe_.block_size(), d))
      d = lanes_->hasher(lane).digest(data, len);
    manifest::BlockHasher::put(data + len, d);
    if (source_.test_corrupt == 1) data[len - 1] ^= 1;
    len += manifest::digest_size;
  }
  if (source_.sealer) lanes_->sealer(lane)->seal(data, DataLength(len), b.offset);
}

void DiskReader::finish(Block* blocks, std::size_t n) {
  if (!source_.manifest && !source_.sealer) return;
  manifest::Digest digests[max_iov];
  if (lanes_->count() > 1 && n > 1)
    lanes_->workers->run(n, [&](std::size_t i, unsigned lane) { protect(blocks[i], lane, digests[i]); });
  else
    for (std::size_t i = 0; i < n; ++i) protect(blocks[i], 0, digests[i]);
  if (source_.manifest)
    for (std::size_t i = 0; i < n; ++i) (void)source_.manifest->add(blocks[i].offset, digests[i]);  // in order: taken at once
}

// A stream: blocks in order from read(2), each handed over as soon as it is full (a slow
// writer's data does not wait for a whole batch), the last one short or none at all.
void DiskReader::read_stream() {
  const std::uint32_t bs = pipe_.block_size();
  DiskIo& io = this->io();
  Block batch[max_iov];
  iovec iov[max_iov];
  const std::size_t cap = batch_cap();
  // A larger pipe buffer means fewer, larger reads (best effort: not a pipe, or not allowed).
  (void)::fcntl(source_.fd, F_SETPIPE_SZ, 1 << 20);

  while (true) {
    const std::uint32_t seen = pipe_.disk_seq();
    int n = 0;
    Block b;
    while (static_cast<std::size_t>(n) < cap && pipe_.disk_pop(b)) {
      batch[n] = b;
      iov[n].iov_base = pipe_.slot_data(b.slot);
      iov[n].iov_len = bs;
      ++n;
    }
    if (pipe_.stopping()) return;
    if (n == 0) {
      pipe_.disk_wait(seen);
      continue;
    }
    iovec* cur = iov;
    int left = n;
    std::uint64_t got = 0;  // bytes in this batch's slots
    int handed = 0;         // of them, blocks handed over
    bool ended = false;
    while (!ended && left > 0) {
      if (pipe_.stopping()) return;
      // Waits for data in short steps, so that a stop is seen while the stream's writer is
      // silent (a pipe nobody writes to would otherwise hold the reader, and its session).
      pollfd pfd{source_.fd, POLLIN, 0};
      const int pr = ::poll(&pfd, 1, 200);
      if (pr < 0 && errno != EINTR) {
        pipe_.set_error(errc_from_errno(errno), std::string("waiting for the stream: ") + std::strerror(errno));
        return;
      }
      if (pr <= 0) continue;
      const ssize_t r = io.readv(source_.fd, cur, left);
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        pipe_.set_error(errc_from_errno(errno),
                        "read of the stream at offset " + std::to_string(next_ + got) + ": " + std::strerror(errno));
        return;
      }
      if (r == 0) {
        ended = true;
      } else {
        got += static_cast<std::uint64_t>(r);
        advance(cur, left, static_cast<std::size_t>(r));
      }
      if (next_ + got > source_.size) {
        pipe_.set_error(errc::limit_exceeded, "the stream is longer than " + std::to_string(source_.size) + " bytes");
        return;
      }
      // The blocks now full (or, at the end, the short last one) go.
      const int full = static_cast<int>(got / bs);
      const int ready = ended && got % bs != 0 ? full + 1 : full;
      if (ready == handed && !ended) continue;
      for (int i = handed; i < ready; ++i) {
        Block& blk = batch[i];
        blk.offset = FileOffset(next_ + std::uint64_t(i) * bs);
        blk.length = DataLength(static_cast<std::uint32_t>(std::min<std::uint64_t>(bs, got - std::uint64_t(i) * bs)));
      }
      finish(batch + handed, static_cast<std::size_t>(ready - handed));
      if (ended) {
        // The size is known: the manifest's, then the network thread's, before the last block.
        if (source_.manifest && !source_.manifest->set_size(next_ + got)) {
          pipe_.set_error(errc::internal, "the stream's digest does not take its size");
          return;
        }
        pipe_.set_stream_end(next_ + got);
      }
      for (int i = handed; i < ready; ++i) pipe_.disk_push(batch[i]);
      handed = ready;
      pipe_.net_wake().notify();
    }
    next_ += got;
    if (ended) return;  // the slots not filled stay here: the transfer needs no more
  }
}

}  // namespace xdfs::piod
