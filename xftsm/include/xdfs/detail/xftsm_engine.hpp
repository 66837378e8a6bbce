// xFTSM block scheduling over a session's n channels: the sending and the receiving engine.
//
// Both run on the session's one network thread and own one disk thread through a
// piod::BlockPipe. The sender hands read-ahead blocks to whichever channel is idle, never more
// than the receiver's window beyond the last acknowledgement; the receiver reads each block
// straight into a pool slot, the disk thread writes it, and cumulative ACKs flow back
// asynchronously. Both feed every happening into the session's CFSM and do what it answers.
#pragma once

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>

#include <chrono>
#include <functional>
#include <deque>
#include <map>
#include <set>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "xdfs/files.hpp"
#include "xdfs/manifest.hpp"
#include "xdfs/rate.hpp"
#include "xdfs/piod.hpp"
#include "xdfs/ranges.hpp"
#include "xdfs/wire.hpp"
#include "xdfs/xdsi.hpp"
#include "xdfs/detail/xftsm_fsm.hpp"

namespace xdfs::xftsm {

namespace asio = boost::asio;
using xdsi::ChannelList;
using xdsi::tell_and_close;

/// What an engine needs from the session that owns it.
class TransferHost {
public:
  virtual ~TransferHost() = default;
  /// Receiver only: every byte is written; make the file final (rename, flush).
  virtual files::Status commit() { return files::Status::ok(); }
  /// The transfer ended, successfully (a Failure whose code is ok) or with the first failure:
  /// its code, words, and the channel and offset where known. Called once.
  virtual void finished(const Failure& f) = 0;
  /// After a failure: the peer has been told (or could not be) and every channel is closed;
  /// nothing of the engine's is left on the channels. Called once, on the loop.
  virtual void closed() {}
  /// A line for the debug log (how the transfer goes: zero copy or why not).
  virtual void debug(const std::string&) {}
};

struct TransferParams {
  std::uint32_t block_size = 1 << 20;
  std::uint64_t file_size = 0;
  /// Sender: bytes the receiver accepts beyond its last ACK. Receiver: ignored (it is slots*block).
  std::uint64_t window = 0;
  /// Number of pool slots (the ring between network and disk).
  std::uint32_t slots = 32;
  wire::ChannelEvent data_event = wire::ChannelEvent::xftsmu;
  std::chrono::milliseconds idle_timeout{60000};
  /// How long a failing side waits for its exception header to leave before closing.
  std::chrono::milliseconds linger{2000};
  /// Where the pool comes from and goes back to (a session's, between its transfers); null:
  /// a fresh one.
  piod::PoolCache* pools = nullptr;
  /// The content manifest (wire::flag_manifest): blocks travel with their digests, the
  /// receiver checks each, and both sides compare the whole-file digest at the end.
  bool manifest = false;
  /// Rate limits every block is taken from (not owned; unlimited ones are skipped): a sender
  /// waits before it sends a block, a receiver before it reads one.
  std::vector<RateLimiter*> limits;
  /// A resumed transfer (with a manifest): the receiver has the first start_offset bytes
  /// (whole blocks); only the rest travels. Both ends hash that part from their own file into
  /// the whole-file digest, so what the receiver kept is verified, not trusted.
  std::uint64_t start_offset = 0;
  /// A stream (wire::Negotiation::open_ended): its size is known at its end only, and
  /// file_size is the most it may have. Whole blocks travel until the end, the last may be
  /// short; the receiver learns the end from that block or the sender's EOFRs, and acknowledges
  /// whenever it has written all that came (the sender's EOFRs wait for the last bytes to be
  /// acknowledged, as for a file). With a manifest no block is sent again: the sender cannot
  /// read a stream twice.
  bool open_ended = false;
  /// Sender: move file data from the page cache to the sockets with sendfile(2), without a
  /// copy through user space, where it can (clear data frames, a regular file whose file
  /// system supports it); false: always read into the pool (a setting switched it off).
  bool zero_copy = true;
  /// Sender: sendfile to a peer on this host too (xdsi::Channel::peer_on_this_host); false:
  /// such a peer gets blocks read into the pool, because over loopback sendfile's packets of
  /// at most 17 pages cost the host more than the copy they save (perf/zerocopy.py).
  bool loopback_sendfile = false;
  /// Blocks apart a side keeps track of (received runs apart and digests waiting for a missing
  /// block; blocks asked again): 0, the default, apart_for(*this). A server sets it, counting
  /// what goes beyond min_apart in its memory budget.
  std::size_t max_apart = 0;
};

/// Blocks apart every transfer may keep track of (about 10 MiB of records: apart_record_bytes
/// each, a run and a waiting digest).
inline constexpr std::size_t min_apart = 65536;
inline constexpr std::size_t apart_record_bytes = 160;

/// Where a resumed transfer starts, given the prefix a receiver recorded: whole blocks, and
/// at least the last block still to send (a partial file that is whole but was never renamed
/// gets its last block again: the end of a transfer is its EOFR and digests, which need one).
inline std::uint64_t resume_point(std::uint64_t prefix, std::uint64_t size, std::uint32_t block) noexcept {
  if (size == 0 || block == 0) return 0;
  const std::uint64_t last = (size - 1) / block * block;
  return std::min(prefix / block * block, last);
}

/// A resumable partial file as the receiving disk thread's checkpoint.
class PartialCheckpoint final : public piod::Checkpoint {
public:
  explicit PartialCheckpoint(files::PendingFile& f) : file_(f) {}
  void save(std::uint64_t prefix) noexcept override { file_.save(prefix); }

private:
  files::PendingFile& file_;
};

/// After a failed transfer: a resumable partial file is kept for the next attempt, unless the
/// failure says its content or its source cannot be trusted (a digest that differs, a size
/// that does not add up, a peer that breaks the protocol) or the user cancelled it; a partial
/// file with nothing recorded is removed too.
inline void settle_partial(files::PendingFile& f, const Failure& failure) noexcept {
  if (failure.code == errc::integrity_error || failure.code == errc::size_mismatch ||
      failure.code == errc::protocol_error || failure.code == errc::cancelled)
    f.discard();
  else
    (void)f.keep();
}

/// Times a receiver asks for one block again (clear mode, manifest) before the transfer fails.
inline constexpr unsigned max_refetches = 3;

/// Slots an engine's pool gets for these parameters: no more than the file has blocks (a small
/// file, a small pool), never fewer than two, so that reading and sending overlap.
std::uint32_t pool_slots(const TransferParams& p) noexcept;
/// The blocks apart a transfer would keep track of, unbounded by memory: 64 rings of blocks
/// (the sender's window counts bytes written, not a prefix, so a channel that stalls lets the
/// others run ahead; 64 windows is far beyond any stall that ends), at least min_apart.
std::size_t apart_for(const TransferParams& p) noexcept;

/// Common plumbing: the CFSM, the disk wake-up, the idle watchdog and failure handling.
class Engine {
public:
  Engine(asio::io_context& io, Machine& machine, ChannelList& channels, TransferHost& host, const TransferParams& p);
  virtual ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Fails the transfer from outside (shutdown, cancel): tells the peer, closes the channels.
  void abort(errc code, const std::string& message);
  bool finished() const noexcept { return machine_.finished(); }
  /// Bytes the receiver has written (sender: as acknowledged).
  std::uint64_t bytes_done() const noexcept { return done_bytes_; }
  /// After a transfer with a manifest ended well: the whole-file digest, which both sides
  /// computed and found equal. None otherwise.
  std::optional<manifest::Digest> digest() const noexcept { return agreed_; }
  /// The file's size: for a stream, once its end is known (BlockPipe::no_end before).
  std::uint64_t size() const noexcept { return end_; }

protected:
  /// Feeds an event to the CFSM; a refused event fails the session and returns nullopt.
  std::optional<TransferAction> fire(TransferEvent e);
  void fail(Failure f, bool tell_peer, TransferEvent ev = TransferEvent::local_error);
  void fail(errc code, const std::string& message, bool from_peer, bool tell_peer, TransferEvent ev = TransferEvent::local_error) {
    fail(Failure(code, message, from_peer), tell_peer, ev);
  }
  /// EOFR carrying `offset` on every channel (eofr_unsent_ counts those not written yet), and
  /// with a manifest this side's whole-file digest; each that leaves lets the engine see
  /// whether it is done.
  void eofr_everywhere(std::uint64_t offset);
  /// Reads the whole-file digest an EOFR carries (with a manifest; its header said `length`
  /// bytes), then `then` runs. A digest that differs from one seen before fails the transfer.
  void read_digest(xdsi::Channel& ch, const wire::FrameHeader& h, std::function<void()> then);
  /// committed, once everything the engine waits for has happened.
  virtual void maybe_finish() = 0;
  std::size_t eofr_unsent_ = 0;          // EOFRs queued and not written yet
  /// A block that is not one this transfer takes, named with its channel and offset.
  void bad_block(const xdsi::Channel& ch, const wire::FrameHeader& h, std::string what);
  void finish_ok();
  void close_all() noexcept;
  void watch_disk();
  virtual void on_disk() = 0;
  /// Stops the disk thread and waits for it: for the read or write in progress (on a pipe or a
  /// FIFO sink that nobody reads, that can be long).
  virtual void stop_disk() noexcept = 0;
  void touch() noexcept { last_activity_ = std::chrono::steady_clock::now(); }
  /// Takes n bytes from every rate limit: how long to wait before they go.
  std::chrono::steady_clock::duration pace(std::uint64_t n) noexcept;
  /// "unexpected EVENT on channel i in state S", for a frame the transfer does not take.
  std::string unexpected(const xdsi::Channel& ch, const wire::FrameHeader& h) const;
  /// Handles a control frame every side may get (EXCEPTION, NOOP); false if it was not one.
  bool handle_common(xdsi::Channel& ch, const wire::FrameHeader& h);
  /// A stream's NOOP (TransferParams::open_ended): the sender sends one a second while its
  /// input is silent and everything is acknowledged; the receiver, if it owes nothing, counts it
  /// as activity and answers it; the answer is the sender's sign that the receiver is alive.
  virtual void on_noop() { touch(); }
  void channel_error(xdsi::Channel& ch, const xdsi::ErrorCode& ec);
  void read_exception(xdsi::Channel& ch, std::uint32_t length);
  /// A channel counter (sendfile or splice bytes) summed over the session's channels.
  std::uint64_t channel_total(std::uint64_t (xdsi::Channel::*count)() const noexcept) const noexcept;

  asio::io_context& io_;
  Machine& machine_;
  ChannelList& channels_;
  TransferHost& host_;
  TransferParams params_;
  piod::BlockPipe pipe_;
  asio::posix::stream_descriptor wake_;
  asio::steady_timer watchdog_;
  asio::steady_timer linger_;
  std::chrono::steady_clock::time_point last_activity_;
  std::uint64_t done_bytes_ = 0;
  std::uint64_t end_;  // the file's size; a stream's once known, no_end until then
  /// How far apart arrivals may be: blocks waiting for a missing one before their digests
  /// (manifest), or separate runs of received bytes (a receiver's seen_).
  std::size_t max_apart_;
  /// With a manifest: this side's whole-file digest, built by the disk thread (which outlives
  /// no engine: the derived class stops it first).
  std::optional<manifest::FileDigest> manifest_;
  std::optional<manifest::Digest> peer_digest_;  // what the peer's EOFRs said
  std::optional<manifest::Digest> agreed_;
  /// This side's whole-file digest once every block has been through the disk thread; a failed
  /// transfer (internal error) if it is not complete then.
  std::optional<manifest::Digest> own_digest();
  /// The peer's digest equals ours (or there is no manifest); else the transfer fails.
  bool digests_agree();

private:
  void arm_watchdog();
  std::uint64_t hashed_seen_ = 0;  // the disk thread's prefix_hashed() at the last look
};

/// Sends one file (or a memory source) over all channels.
class Sender final : public Engine {
public:
  Sender(asio::io_context& io, Machine& machine, ChannelList& channels, TransferHost& host, const TransferParams& p,
         piod::Source source);
  ~Sender() override;
  /// Starts the read-ahead thread and the channel loops (after the machine's start_sending).
  void start();

private:
  void on_disk() override;
  void stop_disk() noexcept override;
  /// Feeds e to the table and runs the action it answers: one handler per action.
  void on(TransferEvent e);
  /// send_block and open_window: hands ready blocks to idle channels while the window allows;
  /// once every byte is queued, all_sent.
  void pump();
  /// send_eofr: EOFR on every channel.
  void send_eofrs();
  /// Puts block b on channel `pick` (a resend: again, outside the window).
  void send_on(std::size_t pick, const piod::Block& b);
  /// resend_block: the spare slot reads the next block asked for again, when it is free.
  void resend();
  /// A stream whose writer is silent: once a second while everything it gave is sent and
  /// acknowledged, a NOOP on channel 0 tells the receiver that the session waits for its input,
  /// not for the network (its answer keeps this side's watchdog from ending it).
  void keep_alive();
  void read_loop(xdsi::Channel& ch);
  void on_frame(xdsi::Channel& ch, const wire::FrameHeader& h);
  /// Why the blocks cannot go by sendfile(2) from the source, or nothing if they can.
  std::string zero_copy_refusal() const;

  piod::Source source_;
  std::uint64_t zero_copy_from_ = 0;     // the channels' sendfile bytes when the transfer began
  std::uint64_t zero_page_from_ = 0;     // the channels' zero-page bytes when the transfer began
  std::optional<piod::DiskReader> reader_;
  std::vector<piod::Block> ready_;       // filled blocks in offset order, consumed from ready_head_
  std::size_t ready_head_ = 0;
  // Resends (clear mode, manifest): one spare slot, outside the read-ahead, reads the blocks the
  // receiver asks for again, one at a time; they go out before new blocks and outside the window.
  bool resends_ = false;
  std::uint32_t spare_ = 0;
  bool spare_busy_ = false;
  std::deque<piod::Block> asked_;        // blocks asked for again, waiting for the spare slot
  std::vector<piod::Block> again_;       // read again, waiting for a channel
  std::map<std::uint64_t, unsigned> nacks_;  // per offset: times asked again
  std::set<std::uint64_t> resending_;    // offsets asked for and not sent again yet (at most slots)
  // Rate limits: the next block waits on this timer (pacing_), then goes on the reservation it
  // waited for (paced_).
  asio::steady_timer keepalive_;         // keep_alive()'s
  std::size_t noops_unsent_ = 0;
  asio::steady_timer pace_timer_;
  bool pacing_ = false;
  bool paced_ = false;
  /// Whether a block of n bytes may go now; else the timer will pump again.
  bool may_send(std::uint64_t n);
  std::vector<std::uint8_t> inflight_;   // per channel: blocks queued on it (at most 2)
  std::size_t next_channel_ = 0;
  std::uint64_t queued_ = 0;             // bytes handed to channels
  std::uint64_t acked_ = 0;
  // Counters that turn n channels' happenings into one event of the table (the state is the
  // table's alone: transferring until all_sent, then draining until committed).
  std::vector<bool> confirmed_;          // per channel: the receiver's EOFR arrived
  std::size_t confirmations_ = 0;
  /// committed, once the receiver confirmed on every channel and nothing of ours is unsent.
  void maybe_finish() override;
};

/// Receives one file (or into a memory sink) from all channels.
class Receiver final : public Engine {
public:
  Receiver(asio::io_context& io, Machine& machine, ChannelList& channels, TransferHost& host, const TransferParams& p,
           piod::Sink sink);
  ~Receiver() override;
  /// The window to advertise: what the pool can hold.
  std::uint64_t window() const noexcept { return std::uint64_t(pipe_.slots()) * pipe_.block_size(); }
  void start();

private:
  /// What each block carries after its data: its digest (with a manifest), then its tag (none
  /// in clear mode).
  TagLength tag() const noexcept { return piod::trailer(sink_.manifest, sink_.opener); }
  void on_disk() override;
  void stop_disk() noexcept override;
  /// What an event of a block carries to its action's handler.
  struct Arrival {
    xdsi::Channel* ch = nullptr;
    std::uint32_t slot = 0;
    wire::FrameHeader h;
    DataLength data{};  // the block's file data: the frame without its tag
    std::uint32_t in_file = 0;  // leading bytes of it spliced into the file already
  };
  /// Feeds e to the table and runs the action it answers: one handler per action.
  void on(TransferEvent e, const Arrival& a);
  void on(TransferEvent e) { on(e, Arrival()); }
  void read_loop(xdsi::Channel& ch);
  void on_header(xdsi::Channel& ch, const wire::FrameHeader& h);
  /// A data frame whose length checked out: into a free slot, or parked until one is free.
  void admit(xdsi::Channel& ch, const wire::FrameHeader& h);
  std::vector<std::unique_ptr<asio::steady_timer>> pace_;  // per channel: its next read waits for the rate
  void read_block(xdsi::Channel& ch, const wire::FrameHeader& h);
  /// Whether the header names one whole, aligned block that has not come before (then marked
  /// as come): its data length, or none once the transfer has failed for it.
  std::optional<DataLength> judge(xdsi::Channel& ch, const wire::FrameHeader& h);
  /// queue_write: the authenticated block goes to the disk thread; its channel reads on.
  void queue_write(const Arrival& a);
  /// send_ack: a cumulative ACK once a quarter window (or the whole file) is written.
  void send_ack();
  /// commit: the file is made final, then EOFR on every channel with the bytes committed.
  void commit();
  /// all_received, once EOFR came on every channel and every byte is written.
  void maybe_complete();
  /// A stream's block, its frame read: whole blocks up to the end, the one short block at the
  /// end (which tells it, if the EOFRs did not). Its data length, or none and `why`.
  std::optional<DataLength> stream_block(const wire::FrameHeader& h, std::string& why);
  /// A stream's EOFR: its offset is the stream's size, the same on every channel and what the
  /// blocks said. False: the transfer failed.
  bool stream_eofr(const xdsi::Channel& ch, const wire::FrameHeader& h);
  /// Fails a stream that went past the most this side takes (TransferParams::file_size).
  void too_long();

  piod::Sink sink_;
  std::optional<piod::DiskWriter> writer_;
  std::vector<std::uint32_t> free_slots_;
  struct Parked {
    xdsi::Channel* ch;
    wire::FrameHeader h;
  };
  std::vector<Parked> parked_;           // channels waiting for a free slot
  RangeSet seen_;                        // bytes whose blocks arrived (grows with what arrived)
  std::vector<bool> eofr_;               // per channel
  std::size_t eofr_count_ = 0;
  std::uint64_t received_ = 0;
  std::uint64_t acked_sent_ = 0;
  std::uint64_t ack_every_ = 0;
  std::size_t told_unsent_ = 0;          // ACKs and NACKs queued and not written yet
  /// send_nack: asks for the block at the arrival's offset again.
  void send_nack(const Arrival& a);
  void on_noop() override;
  /// An ACK or a NACK on channel 0 (told_unsent_ counts it until it has left).
  void tell_sender(wire::ChannelEvent event, std::uint64_t offset);
  bool refetch_ = false;                 // clear mode with a manifest: bad blocks are fetched again
  /// Zero copy in: why the blocks' payloads are read into slots ("" when they go by splice:
  /// skipped with xdsi::Channel::async_skip_payload where the sink discards them, else into
  /// the file with async_splice_payload).
  std::string zero_copy_in_refusal() const;
  bool skip_ = false;
  std::shared_ptr<xdsi::SpliceFile> splice_file_;  // payloads go into it; revoked with the disk thread
  std::uint64_t zero_copy_in_from_ = 0;  // the channels' spliced bytes when the transfer began
  /// Per offset: times asked again, until the block is written (at most a window of them: a
  /// correct sender has no more blocks than that unacknowledged).
  std::map<std::uint64_t, unsigned> refetched_;
  /// committed, once the confirmations (and any ACK or NACK) have left.
  void maybe_finish() override;
};

}  // namespace xdfs::xftsm
