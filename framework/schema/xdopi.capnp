# XDOPI control messages. Data frames use a fixed little-endian header instead (see wire.hpp):
# they are the hot path and are never parsed through Cap'n Proto.
@0xc4e0d7a1b3f29e51;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("xdfs::schema");

enum Mode {
  upload @0;     # client sends a file (xFTSMU)
  download @1;   # server sends a file (xFTSMD)
  path @2;       # path operations (xPathM)
  relay @3;      # one file to many hosts: the master registers this host's place in a chain
  pull @4;       # a host asks for a file and is routed into that file's chain (its own server
                 # listens at pullPort and takes the place the master registers there)
}

# Relay: a host the chain's data goes on to from this one (its upstream forwards to it).
struct RelayHop {
  address @0 :Text;              # "host:port" as the master reached it
  serverKey @1 :Data;            # 32 bytes: its xdfsd's public key, as the master saw it
  ticket @2 :Data;               # 32 bytes: what the master registered there for this file
}

# Relay: what the master tells a host of its place in a chain (Negotiation.relayPlan).
struct RelayPlan {
  ticket @0 :Data;               # 32 random bytes: an upload carrying it feeds this host's copy
  next @1 :List(RelayHop);       # where this host forwards, in order: the first that answers
  protect @2 :UInt8;             # protection of the sessions it opens downstream (xsec::Protect)
  channels @3 :UInt32;           # n of the sessions it opens downstream
  mode @4 :UInt32;               # the file's permission bits (0777 at most; 0: the server's default),
                                 # set on the copy here when it is whole, less the server's umask
  pack @5 :Bool;                 # the file is a pack of small files (docs/relay.md): once the chain
                                 # is done, the host writes them into the file's directory and
                                 # removes the pack
  packDigest @6 :Data;           # with pack: the pack's manifest digest (32 bytes), as the master
                                 # made it; a pack with any other is not written out
  digest @7 :Data;               # empty, or the file's manifest digest (32 bytes) as the master
                                 # computed it: a copy with any other is not kept under its name
}

# Relay: a host's progress, sent by it to the master (event REPORT) at least once a second.
struct RelayReport {
  verified @0 :UInt64;           # bytes of the file written here, every block checked
  forwarded @1 :UInt64;          # bytes the host downstream has acknowledged
  state @2 :UInt8;               # 0 waiting for data, 1 receiving, 2 the file is whole here, 3 failed
  final @3 :Bool;                # the last report: EOFR follows
  code @4 :UInt32;               # failed: the errc
  message @5 :Text;              # failed: why, one line
  digest @6 :Data;               # whole: the whole-file digest (32 bytes)
  next @7 :UInt32;               # the hop of RelayPlan.next it forwards to now (its count: none)
  skipped @8 :List(RelaySkip);   # hops it gave up on, and why
  forwarding @9 :Bool;           # its forwarder runs (it has a hop to feed and has not fed it whole)
  upstream @10 :Data;            # 32 bytes: the key of who fed it last (empty: nobody yet)
  upstreamCode @11 :UInt32;      # how the last upload into it ended, if it failed (errc; 0: it did not)
  upstreamMessage @12 :Text;
  relinks @13 :UInt64;           # RELINKs it has heard so far (skipped counts hops of the last)
}

# Relay: the master gives a host new hops to forward to (event RELINK), replacing the plan's;
# its forwarder drops the hop it feeds and starts again from the first of these.
struct RelayRelink {
  next @0 :List(RelayHop);
}

struct RelaySkip {
  hop @0 :UInt32;                # index into RelayPlan.next
  code @1 :UInt32;
  message @2 :Text;
}

# Sent first on every channel, in the clear: only what the server needs to run the channel's
# handshake. Everything about the transfer travels inside the handshake (Negotiation below).
struct Opening {
  version @0 :UInt16;
  sessionGuid @1 :Data;          # 16 bytes, random, same on all n channels
  channelIndex @2 :UInt32;       # 0 .. n-1 (0: the channel that runs Noise XX)
  protect @3 :UInt8;             # xSec protection: 0 clear, 1 integrity, 2 private
  cipher @4 :UInt8;              # private mode AEAD: 0 AES-256-GCM, 1 ChaCha20-Poly1305
  join @5 :Bool;                 # false: first channel (Noise XX); true: joins with the session secret
  joinNonce @6 :Data;            # join: the client's 32 fresh random bytes
}

# An operation of the session (the paper's Table 2, minus what the opening says). The first is
# the payload of the client's last Noise XX message, so it is encrypted and bound to the
# handshake in every protection mode; each later one is a NEGO frame on every channel, protected
# as every control frame is. Channel count, block size, TCP window and flags stay the session's.
struct Negotiation {
  channelCount @0 :UInt32;       # n
  mode @1 :Mode;
  remotePath @2 :Text;           # relative to the server root
  blockSize @3 :UInt32;          # bytes per data block
  tcpWindow @4 :UInt32;          # SO_SNDBUF/SO_RCVBUF wanted, 0 = kernel autotuning
  extendedFlags @5 :UInt64;      # bit set of ExtendedFlag
  fileSize @6 :UInt64;           # upload: bytes the client will send
  window @7 :UInt64;             # download: bytes the client lets be unacknowledged
  transfer @8 :UInt64;           # the operation's number in its session: 0 in the handshake, then
                                 # strictly increasing; the data keys of an operation derive from it
  resumeOffset @9 :UInt64;       # download: the client holds a verified partial copy of this many
                                 # bytes (a multiple of the block size) and asks for the rest
  sourceMtime @10 :Int64;        # upload: the file's mtime (ns); download with resumeOffset: the
                                 # source's mtime when the partial copy began (fileSize its size)
  fresh @11 :Bool;               # upload: start at byte 0 even if a partial copy was kept
  openEnded @12 :Bool;           # upload of a stream: its size is unknown (fileSize 0); blocks come
                                 # until a short one or the EOFRs, whose offset is the size
  relayTicket @13 :Data;         # upload: 32 bytes; the file feeds the relay registered with it
                                 # (its path is the relay's; the uploader may be another xdfsd)
  relayPlan @14 :RelayPlan;      # relay: this host's place in the chain
  pullPort @15 :UInt16;          # pull: the port the pulling host's own server listens on (at the
                                 # address its session comes from; its key is the session's key)
  pullName @16 :Text;            # pull: the file's name in that server's root (one name, no '/')
  pullSet @17 :Bool;             # pull: remotePath is a directory, whose files come as one pack
  pullParts @18 :Bool;           # pull of a set: this host takes a set in several parts (one
                                 # operation each); without it a set must fit one pack
  pullPart @19 :UInt32;          # pull of a set with pullParts: which part (0: the first, whose
                                 # reply tells how many there are)
  pullPlan @20 :Data;            # with pullPart > 0: the set's plan (32 bytes) as part 0's reply
                                 # gave it; the master refuses a part of a set that changed since
  pullLinks @21 :Bool;           # pull of a set with pullParts: this host takes the set's
                                 # directories and symlinks too (in part 0, a pack of version 2)
}


# The server's answer on each channel once all n have joined.
struct NegotiationReply {
  fileSize @0 :UInt64;           # download: bytes the server will send
  window @1 :UInt64;             # upload: bytes the server lets be unacknowledged
  blockSize @2 :UInt32;          # block size in force for the session
  resumeOffset @3 :UInt64;       # where the data starts: the receiver's verified prefix (0: all)
  mtime @4 :Int64;               # download: the file's mtime (ns), for the client's resume record
  inPlace @5 :Bool;              # upload: written as it comes (a FIFO, xdfsd --allow-fifo): what
                                 # went cannot be resumed, and a new attempt would repeat it
  setParts @6 :UInt32;           # pull of a set with pullParts: its parts (each a pack of small
                                 # files or one large file)
  setPlan @7 :Data;              # with setParts: 32 bytes naming the set's plan (pullPlan)
  setPath @8 :Text;              # with setParts: this part's file, relative to the set (empty: a pack)
  setBytes @9 :UInt64;           # with setParts: the bytes of all the set's parts
}

# An error travelling to the peer (code from xdfs::errc and a one-line message).
struct ExceptionHeader {
  code @0 :UInt32;
  message @1 :Text;
  channelIndex @2 :UInt32;
  offset @3 :UInt64;
  refused @4 :Bool;              # the operation asked for is refused; the session and its channels
                                 # stay as they were, ready for the next one
}
