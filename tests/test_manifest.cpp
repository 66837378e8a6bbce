// The content manifest (framework/include/xdfs/manifest.hpp, docs/manifest.md): the digest's
// definition, the digests transfers report, and peers whose digests do not add up.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <botan/hash.h>

#include <fmt/core.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"
#include "xdfs/xdfs.hpp"

using xdfs::errc;
using xdfs::wire::ChannelEvent;
using xdfs::wire::FrameHeader;
namespace mf = xdfs::manifest;
using Added = mf::FileDigest::Added;

namespace {

std::string url(std::uint16_t port, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(port) + "/" + path;
}

// The definition in docs/manifest.md, computed here from Botan's SHA-256 and nothing of the
// library's: the header, then each block's digest in order.
std::string reference(const std::vector<std::uint8_t>& file, std::uint32_t bs) {
  auto whole = Botan::HashFunction::create_or_throw("SHA-256");
  auto block = Botan::HashFunction::create_or_throw("SHA-256");
  std::uint8_t head[20];
  std::memcpy(head, "xDFS-manifest-2\n", 16);
  for (int i = 0; i < 4; ++i) head[16 + i] = static_cast<std::uint8_t>(bs >> (8 * i));
  whole->update(head, sizeof head);
  for (std::size_t at = 0; at < file.size(); at += bs) {
    block->update(file.data() + at, std::min<std::size_t>(bs, file.size() - at));
    whole->update(block->final());
  }
  const std::uint64_t size = file.size();
  std::uint8_t tail[8];
  for (int i = 0; i < 8; ++i) tail[i] = static_cast<std::uint8_t>(size >> (8 * i));
  whole->update(tail, sizeof tail);
  const auto d = whole->final();
  mf::Digest out{};
  std::copy(d.begin(), d.end(), out.begin());
  return mf::hex(out);
}

mf::Digest block_digest(const std::vector<std::uint8_t>& file, std::size_t at, std::size_t n) {
  return mf::BlockHasher().digest(file.data() + at, n);
}

std::string digest_of_file(const std::string& path, std::uint32_t bs) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  const auto size = static_cast<std::uint64_t>(::lseek(fd, 0, SEEK_END));
  const auto r = mf::of_file(fd, size, bs);
  ::close(fd);
  REQUIRE(r.code == errc::ok);
  return mf::hex(r.digest);
}

}  // namespace

TEST_SUITE("manifest") {

TEST_CASE("the whole-file digest is the documented formula, in whatever order the blocks' digests come") {
  const std::uint32_t bs = 4096;
  xt::TempDir dir;
  for (std::size_t size : {std::size_t(0), std::size_t(1), std::size_t(bs - 1), std::size_t(bs), std::size_t(bs + 1),
                           std::size_t(5 * bs + 17)}) {
    CAPTURE(size);
    const auto bytes = xt::random_bytes(size, size + 3);
    const std::string want = reference(bytes, bs);
    const std::size_t blocks = (size + bs - 1) / bs;

    mf::FileDigest in_order(size, bs);
    for (std::size_t i = 0; i < blocks; ++i) {
      CHECK_FALSE(in_order.result().has_value());
      const std::size_t at = i * bs;
      CHECK(in_order.add(xdfs::FileOffset(at), block_digest(bytes, at, std::min<std::size_t>(bs, size - at))) == Added::ok);
    }
    REQUIRE(in_order.result().has_value());
    CHECK(mf::hex(*in_order.result()) == want);

    mf::FileDigest backwards(size, bs);
    for (std::size_t i = blocks; i-- > 0;) {
      const std::size_t at = i * bs;
      CHECK(backwards.add(xdfs::FileOffset(at), block_digest(bytes, at, std::min<std::size_t>(bs, size - at))) == Added::ok);
      CHECK(backwards.complete() == (i == 0));
    }
    REQUIRE(backwards.result().has_value());
    CHECK(mf::hex(*backwards.result()) == want);

    // A stream's: the size comes at the end, after blocks in any order.
    mf::FileDigest stream(mf::FileDigest::OpenEnded{}, bs);
    for (std::size_t i = blocks; i-- > 0;) {
      const std::size_t at = i * bs;
      CHECK(stream.add(xdfs::FileOffset(at), block_digest(bytes, at, std::min<std::size_t>(bs, size - at))) == Added::ok);
    }
    CHECK_FALSE(stream.complete());
    CHECK_FALSE(stream.result().has_value());
    if (blocks > 0) CHECK_FALSE(stream.set_size((blocks - 1) * bs));  // a block it has is beyond that end
    REQUIRE(stream.set_size(size));
    CHECK_FALSE(stream.set_size(size));  // once
    REQUIRE(stream.result().has_value());
    CHECK(mf::hex(*stream.result()) == want);

    const std::string path = dir / "f";
    xt::write_file(path, std::string(bytes.begin(), bytes.end()));
    CHECK(digest_of_file(path, bs) == want);
  }
  // The block size is part of the value: the same bytes cut differently hash differently.
  const auto bytes = xt::random_bytes(3 * 8192, 9);
  CHECK(reference(bytes, 4096) != reference(bytes, 8192));
}

TEST_CASE("a digest that is not one of the file's blocks is refused: misaligned, beyond the end, twice") {
  const std::uint32_t bs = 4096;
  mf::FileDigest d(3 * bs + 10, bs);
  const mf::Digest any{};
  CHECK(d.add(xdfs::FileOffset(1), any) == Added::not_a_block);
  CHECK(d.add(xdfs::FileOffset(4 * bs), any) == Added::not_a_block);
  CHECK(d.add(xdfs::FileOffset(~std::uint64_t(0) - 4095), any) == Added::not_a_block);
  CHECK(d.add(xdfs::FileOffset(2 * bs), any) == Added::ok);
  CHECK(d.add(xdfs::FileOffset(2 * bs), any) == Added::not_a_block);  // waiting, and again
  CHECK(d.add(xdfs::FileOffset(0), any) == Added::ok);
  CHECK(d.add(xdfs::FileOffset(0), any) == Added::not_a_block);       // taken, and again
  CHECK(d.add(xdfs::FileOffset(bs), any) == Added::ok);
  CHECK_FALSE(d.complete());
  CHECK(d.add(xdfs::FileOffset(3 * bs), any) == Added::ok);
  CHECK(d.complete());
  const auto first = d.result();
  CHECK(first == d.result());
}

TEST_CASE("a block withheld cannot make the digests after it pile up: at most max_waiting wait") {
  const std::uint32_t bs = 4096;
  mf::FileDigest d(std::uint64_t(1) << 40, bs, 8);
  const mf::Digest any{};
  for (std::uint64_t i = 1; i <= 8; ++i) CHECK(d.add(xdfs::FileOffset(i * bs), any) == Added::ok);
  CHECK(d.add(xdfs::FileOffset(9 * bs), any) == Added::too_far_ahead);
  CHECK(d.next_offset() == 0);
  CHECK(d.add(xdfs::FileOffset(0), any) == Added::ok);  // the withheld one: the waiting ones go in
  CHECK(d.next_offset() == 9 * bs);
  CHECK(d.add(xdfs::FileOffset(9 * bs), any) == Added::ok);
}

TEST_CASE("transfers report the digest both ends agreed on, in every protection mode, both ways; without "
          "verification none") {
  xt::TempDir root, local;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  const std::uint32_t bs = 64 * 1024;
  xt::write_random_file(local / "src", 9 * bs + 100, 21);
  const std::string want = digest_of_file(local / "src", bs);
  for (auto mode : {xdfs::xsec::Protect::clear, xdfs::xsec::Protect::integrity, xdfs::xsec::Protect::private_}) {
    CAPTURE(std::string(xdfs::xsec::to_string(mode)));
    xdfs::TransferOptions o;
    o.protect = mode;
    o.block_size = bs;
    o.ring_bytes = 4 * bs;
    o.channels = 3;
    o.known_hosts_file = local / "kh";
    const xdfs::Endpoint ep{"127.0.0.1", srv.port()};
    auto up = xdfs::upload(local / "src", ep, "dst", o);
    CHECK(up.digest == want);
    auto down = xdfs::download(ep, "dst", local / "back", o);
    CHECK(down.digest == want);
    CHECK(xt::files_equal(local / "src", local / "back"));
    {
      xdfs::RemoteFs fs(ep, o);
      CHECK(fs->manifest_digest("dst", bs) == want);
      CHECK(fs->manifest_digest("dst", 2 * bs) == digest_of_file(local / "src", 2 * bs));
      CHECK(xt::error_of([&] { fs->manifest_digest("dst", 1000); }) == errc::bad_argument);
      fs.close();
    }
    o.verify = false;
    auto raw = xdfs::download(ep, "dst", local / "raw", o);
    CHECK(raw.digest.empty());
    CHECK(xt::files_equal(local / "src", local / "raw"));
    ::unlink((local / "back").c_str());
    ::unlink((local / "raw").c_str());
    ::unlink((root / "dst").c_str());
  }
}

TEST_CASE("xduc --json reports the digest and xduc sum computes the same for the remote file and the local one") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  xt::write_random_file(local / "f", (3 << 20) + 77, 4);
  auto up = xt::xduc({"-q", "--json", "-p", "2", "--protect", "clear", local / "f", url(d.port(), "f")});
  REQUIRE_MESSAGE(up.status == 0, up.err);
  const std::string want = digest_of_file(local / "f", 1 << 20);
  CHECK(up.out.find("\"digest\":\"" + want + "\"") != std::string::npos);
  CHECK(up.out.find("\"digest_algorithm\":\"xdfs-manifest-2-sha256\"") != std::string::npos);
  auto remote = xt::xduc({"sum", url(d.port(), "f")});
  CHECK(remote.out == want + "  f\n");
  auto mine = xt::xduc({"sum", local / "f"});
  CHECK(mine.out == want + "  " + (local / "f") + "\n");
  auto other = xt::xduc({"sum", "--block-size", "4M", local / "f"});
  CHECK(other.out.substr(0, 64) == digest_of_file(local / "f", 4 << 20));
  ::mkdir((root / "two").c_str(), 0755);
  auto many = xt::xduc({"-q", "--json", local / "f", local / "f", url(d.port(), "two/")});
  INFO(many.out, many.err);
  CHECK(many.out.find("\"digests\":[{\"source\":\"" + (local / "f") + "\",\"digest\":\"" + want + "\"}") !=
        std::string::npos);
  auto plain = xt::xduc({"-q", "--json", "--no-verify", local / "f", url(d.port(), "g")});
  REQUIRE_MESSAGE(plain.status == 0, plain.err);
  CHECK(plain.out.find("digest") == std::string::npos);
  CHECK(xt::files_equal(local / "f", root / "g"));
  auto missing = xt::xduc({"sum", local / "nothing"});
  CHECK(missing.status == 1);
  CHECK(missing.err.find("nothing") != std::string::npos);
  // --sha256 only where it means something: remote files of sum.
  auto not_sum = xt::xduc({"ls", "--sha256", url(d.port(), "")});
  CHECK(not_sum.status == 2);
  CHECK(not_sum.err.find("--sha256 goes with sum") != std::string::npos);
  auto local_sha = xt::xduc({"sum", "--sha256", local / "f"});
  CHECK(local_sha.status == 2);
  CHECK(local_sha.err.find("--sha256 is for remote files") != std::string::npos);
  auto mixed = xt::xduc({"sum", local / "f", url(d.port(), "f")});
  CHECK(mixed.status == 2);
  CHECK(mixed.err.find("not both") != std::string::npos);
}

TEST_CASE("a server whose digests do not add up: the download fails naming what differs and keeps nothing") {
  xt::TempDir local;
  xt::RawServer srv;
  const std::uint32_t bs = 64 * 1024;
  const auto bytes = xt::random_bytes(2 * bs, 77);
  const std::vector<std::uint8_t> first(bytes.begin(), bytes.begin() + bs), second(bytes.begin() + bs, bytes.end());
  // The server's script: both blocks (the first with `bad_block`'s digest if set), then EOFR
  // carrying `eofr` (its length as given).
  auto serve = [&](std::optional<mf::Digest> bad_block, std::vector<std::uint8_t> eofr) {
    return std::thread([&srv, &first, &second, bad_block, eofr] {
      auto c = srv.accept();
      if (!c) return;
      REQUIRE(c->manifest);
      c->send_reply({2 * bs, 0, bs});
      if (bad_block) {
        c->manifest = false;  // the frame as given: data, then the digest named here
        auto body = first;
        body.insert(body.end(), bad_block->begin(), bad_block->end());
        c->send_block(ChannelEvent::xftsmd, 0, body);
        c->manifest = true;
      } else {
        c->send_block(ChannelEvent::xftsmd, 0, first);
      }
      c->send_block(ChannelEvent::xftsmd, bs, second);
      FrameHeader h;
      h.event = ChannelEvent::eofr;
      h.offset = 2 * bs;
      h.length = static_cast<std::uint32_t>(eofr.size());
      c->send_frame(h, eofr);
      c->wait_closed();
    });
  };
  auto download = [&](std::string* what) {
    xdfs::TransferOptions o;
    o.block_size = bs;
    o.known_hosts_file = local / "kh";
    o.idle_timeout = std::chrono::milliseconds(5000);
    return xt::error_of([&] { xdfs::download({"127.0.0.1", srv.port()}, "f", local / "out", o); }, nullptr, what);
  };
  mf::FileDigest whole(2 * bs, bs);
  (void)whole.add(xdfs::FileOffset(0), mf::BlockHasher().digest(first.data(), first.size()));
  (void)whole.add(xdfs::FileOffset(bs), mf::BlockHasher().digest(second.data(), second.size()));
  const auto right = *whole.result();
  std::string what;
  SUBCASE("a block that does not match its digest") {
    mf::Digest wrong = mf::BlockHasher().digest(second.data(), second.size());
    auto t = serve(wrong, std::vector<std::uint8_t>(right.begin(), right.end()));
    CHECK(download(&what) == errc::integrity_error);
    t.join();
    CHECK(what.find("offset 0 does not match its digest") != std::string::npos);
  }
  SUBCASE("every block matches, but the whole-file digest is another") {
    auto other = right;
    other[5] ^= 1;
    auto t = serve(std::nullopt, std::vector<std::uint8_t>(other.begin(), other.end()));
    CHECK(download(&what) == errc::integrity_error);
    t.join();
    CHECK(what.find("the whole-file digest differs: " + mf::hex(right) + " computed here, " + mf::hex(other) +
                    " by the sender") != std::string::npos);
  }
  SUBCASE("an EOFR without the digest") {
    auto t = serve(std::nullopt, {});
    CHECK(download(&what) == errc::protocol_error);
    t.join();
    CHECK(what.find("carries 0 bytes, not a digest") != std::string::npos);
  }
  CHECK_FALSE(xt::exists(local / "out"));
  xt::check_no_partials(local.path());
}

TEST_CASE("a downloading peer's NACKs: a block asked again comes again; asked a fourth time, never sent, or in a "
          "session without the manifest, the transfer fails and the server serves on") {
  xt::TempDir root, local;
  const std::uint32_t bs = 64 * 1024;
  xt::write_random_file(root / "f", 4 * bs, 31);
  const std::string bytes = xt::read_file(root / "f");
  xt::XdfsdProcess d(root.path(), {"--idle-timeout", "5"});
  auto nack = [](xt::RawChannel& c, std::uint64_t offset) {
    FrameHeader h;
    h.event = ChannelEvent::nack;
    h.offset = offset;
    c.send_frame(h);
  };
  // Reads frames until a data frame for `offset` (true) or an exception (its message in why).
  auto until_block = [&](xt::RawChannel& c, std::uint64_t offset, std::string* why) -> bool {
    for (auto f = c.read_frame(); f; f = c.read_frame()) {
      if (f->first.event == ChannelEvent::exception) {
        if (auto ex = xdfs::wire::decode_exception(f->second)) *why = ex->message;
        return false;
      }
      if (f->first.event != ChannelEvent::xftsmd || f->first.offset != offset) continue;
      // The block as first sent: its data, then the SHA-256 of that data.
      REQUIRE(f->second.size() == bs + mf::digest_size);
      CHECK(std::memcmp(f->second.data(), bytes.data() + offset, bs) == 0);
      const auto dg = mf::BlockHasher().digest(f->second.data(), bs);
      CHECK(std::equal(dg.begin(), dg.end(), f->second.begin() + bs));
      return true;
    }
    return false;
  };
  auto open = [&](bool manifest) {
    auto h = xt::make_hello(xdfs::Mode::download, "f", 1);
    if (manifest) h.nego.extended_flags = xdfs::wire::flag_manifest;
    auto c = std::make_unique<xt::RawChannel>(d.port());
    REQUIRE(c->establish(h));
    return c;
  };
  std::string why;
  SUBCASE("asked again up to three times, the block comes each time; a fourth time fails the transfer") {
    auto c = open(true);
    REQUIRE(until_block(*c, bs, &why));
    for (int k = 0; k < 3; ++k) {
      nack(*c, bs);
      CHECK(until_block(*c, bs, &why));
    }
    nack(*c, bs);
    CHECK_FALSE(until_block(*c, bs, &why));
    CHECK(why.find("asked for the block at offset 65536 more than 3 times") != std::string::npos);
  }
  SUBCASE("an offset that is not a block it sent") {
    auto c = open(true);
    REQUIRE(until_block(*c, 0, &why));
    nack(*c, 1);
    CHECK_FALSE(until_block(*c, 4 * bs, &why));
    CHECK(why.find("NACK of offset 1 on channel 0: not a block that was sent") != std::string::npos);
  }
  SUBCASE("a session without the manifest sends nothing again") {
    auto c = open(false);
    nack(*c, 0);
    CHECK_FALSE(until_block(*c, 4 * bs, &why));
    CHECK(why.find("this transfer sends no block again") != std::string::npos);
  }
  xt::check_serving(d.port(), root.path(), local.path());
}

TEST_CASE("a downloading peer asking for block after block again fails the transfer once it has asked for more than "
          "a manifest lets wait, and the server serves on") {
  // The server remembers each block asked again; a peer asking for every block once would grow
  // that without bound. A small ring (16 slots of 4 KiB) keeps the bound at its least, 64Ki.
  xt::TempDir root, local;
  const std::uint32_t bs = xdfs::wire::min_block_size;
  constexpr std::uint64_t allowed = 65536, blocks = allowed + 8;
  {
    xdfs::files::Fd f(::open((root / "f").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
    REQUIRE(::ftruncate(f.get(), blocks * bs) == 0);
  }
  xt::XdfsdProcess d(root.path(), {"--idle-timeout", "10", "--ring", "64K"});
  auto h = xt::make_hello(xdfs::Mode::download, "f", 1);
  h.nego.extended_flags = xdfs::wire::flag_manifest;
  h.nego.block_size = bs;
  h.nego.window = 64 * bs;
  xt::RawChannel c(d.port());
  REQUIRE(c.establish(h));
  // Each block once as it first comes, a few at a time (the server sends them again one by one);
  // acknowledged as they come, but never the last ones, so that the transfer cannot end first.
  std::set<std::uint64_t> seen, asked;
  std::deque<std::uint64_t> to_ask;
  std::uint64_t nacks = 0, acked = 0, past = 0;  // past: the first block asked again beyond the bound
  std::string why;
  for (auto f = c.read_frame(); f; f = c.read_frame()) {
    if (f->first.event == ChannelEvent::exception) {
      if (auto ex = xdfs::wire::decode_exception(f->second)) why = ex->message;
      break;
    }
    if (f->first.event != ChannelEvent::xftsmd) continue;
    if (!asked.erase(f->first.offset) && seen.insert(f->first.offset).second) to_ask.push_back(f->first.offset);
    while (asked.size() < 4 && !to_ask.empty()) {
      FrameHeader n;
      n.event = ChannelEvent::nack;
      n.offset = to_ask.front();
      c.send_frame(n);
      asked.insert(to_ask.front());
      to_ask.pop_front();
      if (++nacks == allowed + 1) past = n.offset;
    }
    const std::uint64_t ack = std::min<std::uint64_t>(seen.size(), blocks - 8) * bs;
    if (ack >= acked + 16 * bs) {
      FrameHeader a;
      a.event = ChannelEvent::ack;
      a.offset = acked = ack;
      c.send_frame(a);
    }
  }
  CHECK_MESSAGE(why.find(fmt::format("the receiver asked for more than {} blocks again", allowed)) != std::string::npos,
                why);
  CHECK(why.find(fmt::format("(the last at offset {})", past)) != std::string::npos);
  CHECK(nacks >= allowed + 1);
  xt::check_serving(d.port(), root.path(), local.path());
}

}  // TEST_SUITE("manifest")
