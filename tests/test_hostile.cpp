// Hostile peers against real xdfsd and xduc processes: nothing a client or a server sends may
// crash, freeze or lock out the other side, make it hold memory in proportion to a number it
// declared, or reach a log line or a terminal unescaped. One test case per way in.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "support.hpp"
#include "xdfs/xdfs.hpp"
#include "xdfs/pathm/messages.hpp"
#include "xdfs/xdfs.hpp"

using xdfs::errc;
using xdfs::Mode;
using xdfs::wire::ChannelEvent;
using xdfs::wire::FrameHeader;
namespace pm = xdfs::pathm;
namespace fs = std::filesystem;

namespace {

constexpr const char* outside_name = "xdfs-hostile-outside-target";

std::string url(std::uint16_t port, const std::string& path) {
  return "xdfs://127.0.0.1:" + std::to_string(port) + "/" + path;
}

// The frame the server answers a channel's negotiation with, or its exception.
void expect_reply(xt::RawChannel& c) {
  auto reply = c.read_frame();
  REQUIRE(reply.has_value());
  REQUIRE_MESSAGE(reply->first.event == ChannelEvent::nego_reply, "got " << xdfs::wire::to_string(reply->first.event));
}

// A path operation on two raw channels: c opens the session, other joins it, both get the reply.
void open_path_pair(xt::RawChannel& c, xt::RawChannel& other) {
  auto h = xt::make_hello(Mode::path, ".", 2);
  REQUIRE(c.establish(h));
  REQUIRE(other.join(h, 1, c.session_secret()));
  expect_reply(c);
  expect_reply(other);
}

// A path request or reply in an xPathM frame.
template <class Message>
void send_path(xt::RawPeer& c, const Message& m) {
  auto enc = pm::encode(m);
  FrameHeader h;
  h.event = ChannelEvent::xpathm;
  h.length = static_cast<std::uint32_t>(enc.size);
  auto b = enc.bytes();
  c.send_frame(h, std::vector<std::uint8_t>(b.begin(), b.end()));
}

// A frame's payload, word-aligned as the library's buffers are (kept until the next call).
std::span<const std::uint8_t> aligned(const std::vector<std::uint8_t>& payload) {
  static thread_local std::vector<std::uint64_t> keep;
  keep.assign((payload.size() + 7) / 8, 0);
  std::memcpy(keep.data(), payload.data(), payload.size());
  return {reinterpret_cast<const std::uint8_t*>(keep.data()), payload.size()};
}

std::optional<pm::Request> read_request(xt::RawPeer& c, ChannelEvent* ev = nullptr) {
  auto f = c.read_frame();
  if (!f) return std::nullopt;
  if (ev) *ev = f->first.event;
  if (f->first.event != ChannelEvent::xpathm) return std::nullopt;
  return pm::decode_request(aligned(f->second));
}

// A path reply (its entries' data point into a buffer kept until the next call).
std::optional<pm::Reply> read_reply(xt::RawPeer& c) {
  auto f = c.read_frame();
  if (!f || f->first.event != ChannelEvent::xpathm) return std::nullopt;
  return pm::decode_reply(aligned(f->second));
}

bool lines_start_with_timestamps(const std::string& log) {
  std::size_t at = 0;
  while (at < log.size()) {
    const auto end = log.find('\n', at);
    const std::string line = log.substr(at, end == std::string::npos ? std::string::npos : end - at);
    // 2026-11-23T20:32:52Z xdfsd: ...
    if (!line.empty() && (line.size() < 22 || line[4] != '-' || line[10] != 'T' || line.compare(20, 8, " xdfsd: ") != 0))
      return false;
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return true;
}

}  // namespace

TEST_SUITE("hostile") {

TEST_CASE("extreme sizes from a client: refused where decoded, or costing only what arrived; xdfsd keeps serving") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {"--allow-memory-mode", "--idle-timeout", "3"});
  SUBCASE("sizes near 2^64 are refused while the negotiation is decoded, naming the field") {
    for (std::uint64_t size : {~std::uint64_t(0), std::uint64_t(1) << 63, xdfs::wire::max_file_size + 1}) {
      CAPTURE(size);
      xt::RawChannel c(d.port());
      REQUIRE(c.establish(xt::make_hello(Mode::upload, "big", 1, size)));
      auto ex = c.read_exception();
      REQUIRE(ex.has_value());
      CHECK(ex->code == errc::protocol_error);
      CHECK(ex->message.find("file size") != std::string::npos);
    }
  }
  SUBCASE("2^60 bytes into a file: more than the file system holds, refused before anything is written") {
    auto h = xt::make_hello(Mode::upload, "big", 1, std::uint64_t(1) << 60);
    h.nego.block_size = 4096;
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(h));
    auto ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::disk_full);
    CHECK(ex->message.find("do not fit") != std::string::npos);
  }
  SUBCASE("2^62 bytes in memory mode with 4 KiB blocks: blocks far apart are taken, a repeat is refused") {
    auto h = xt::make_hello(Mode::upload, "m", 1, xdfs::wire::max_file_size);
    h.nego.block_size = 4096;
    h.nego.extended_flags = xdfs::wire::flag_memory;
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(h));
    expect_reply(c);
    for (std::uint64_t off : {std::uint64_t(0), std::uint64_t(1) << 40, std::uint64_t(1) << 61,
                              xdfs::wire::max_file_size - 4096})
      c.send_block(ChannelEvent::xftsmu, off, xt::random_bytes(4096, off % 977));
    c.send_block(ChannelEvent::xftsmu, std::uint64_t(1) << 40, xt::random_bytes(4096, 1));
    auto ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::protocol_error);
    CHECK(ex->message.find("received twice") != std::string::npos);
  }
  SUBCASE("path mode: a chunk of a 2^50-byte file, and one whose size exceeds 2^62") {
    xdfs::TransferOptions o;
    o.block_size = 4096;
    xdfs::RemoteFs rfs({"127.0.0.1", d.port()}, o);
    pm::Entry e;
    e.path = "huge";
    e.size = std::uint64_t(1) << 50;
    e.file_id = 1;
    const auto chunk = xt::random_bytes(4096, 3);
    e.data = chunk;
    try {
      rfs->put({e});
      FAIL("a 2^50-byte file was accepted");
    } catch (const xdfs::Error& err) {
      CHECK(err.code() == errc::disk_full);
      CHECK(std::string(err.what()).find("do not fit") != std::string::npos);
    }
    e.size = xdfs::wire::max_file_size + 4096;
    try {
      rfs->put({e});
      FAIL("a size beyond 2^62 was accepted");
    } catch (const xdfs::Error& err) {
      CHECK(err.code() == errc::protocol_error);
      CHECK(std::string(err.what()).find("2^62") != std::string::npos);
    }
  }
  REQUIRE(d.alive());
  xt::check_serving(d.port(), root.path(), local.path());
  xt::check_no_partials(root.path());
}

TEST_CASE("a hostile server's sizes: xduc refuses or survives them, writes nothing it cannot keep") {
  xt::TempDir local;
  xt::RawServer srv;
  const std::string kh = local / "known_hosts";
  auto serve = [&](std::function<void(xt::RawServer::Conn&)> script) {
    return std::thread([&srv, script] {
      auto c = srv.accept();
      if (c) script(*c);
    });
  };
  SUBCASE("a file size beyond 2^62 in the reply") {
    auto t = serve([](xt::RawServer::Conn& c) {
      c.send_reply({~std::uint64_t(0), 0, c.hello.nego.block_size});
      c.wait_closed();
    });
    auto r = xt::xduc({"-q", "--known-hosts", kh, url(srv.port(), "f"), local / "out"}, 60000);
    t.join();
    CHECK(r.status == 1);
    CHECK(r.err.find("file size") != std::string::npos);
    CHECK_FALSE(xt::exists(local / "out"));
  }
  SUBCASE("2^60 bytes announced for a file: refused before a byte is written") {
    auto t = serve([](xt::RawServer::Conn& c) {
      c.send_reply({std::uint64_t(1) << 60, 0, c.hello.nego.block_size});
      c.wait_closed();
    });
    auto r = xt::xduc({"-q", "--known-hosts", kh, url(srv.port(), "f"), local / "out"}, 60000);
    t.join();
    CHECK(r.status == 1);
    CHECK(r.err.find("disk full: 'out': ") != std::string::npos);
    CHECK(r.err.find("do not fit") != std::string::npos);
    CHECK_FALSE(xt::exists(local / "out"));
  }
  SUBCASE("2^62 bytes announced, blocks at scattered offsets, then the server goes") {
    auto t = serve([](xt::RawServer::Conn& c) {
      const std::uint32_t bs = c.hello.nego.block_size;
      c.send_reply({xdfs::wire::max_file_size, 0, bs});
      for (std::uint64_t off : {std::uint64_t(0), std::uint64_t(1) << 45, std::uint64_t(1) << 61})
        c.send_block(ChannelEvent::xftsmd, off, xt::random_bytes(bs, off % 31));
    });
    auto r = xt::xduc({"-q", "--known-hosts", kh, url(srv.port(), "f"), "/dev/null"}, 60000);
    t.join();
    CHECK(r.status == 1);  // not a crash: the transfer failed and said why
    CHECK(r.err.find("peer aborted (server)") != std::string::npos);
  }
  xt::check_no_partials(local.path());
}

TEST_CASE("a hostile path server: a listed file of 2^62 bytes, names with escapes; xduc stays whole") {
  xt::TempDir local;
  xt::RawServer srv;
  const std::string kh = local / "known_hosts";
  // A server whose listing claims an enormous file with a name that would drive a terminal,
  // and refuses to send it: asked in path mode (--large-file 0) and, as a large file, as a file
  // transfer of its own after the path operation, which this server does not end cleanly.
  std::thread t([&] {
   for (int round = 0; round < 2; ++round) {
    auto c = srv.accept();
    if (!c) return;
    c->send_reply({0, 0, c->hello.nego.block_size});
    for (;;) {
      ChannelEvent ev{};
      auto r = read_request(*c, &ev);
      if (!r) break;
      pm::Reply rep;
      rep.id = r->id;
      if (r->op == pm::Op::stat) {
        pm::Entry top;
        top.path = ".";
        top.type = pm::Type::directory;
        top.mode = 0755;
        rep.entries.push_back(top);
      } else if (r->op == pm::Op::list) {
        pm::Entry big;
        big.path = "evil\x1b]0;owned\x07\nname";
        big.type = pm::Type::file;
        big.size = xdfs::wire::max_file_size;
        big.mode = 0644;
        rep.entries.push_back(big);
      } else if (r->op == pm::Op::get) {
        pm::Entry no;
        no.code = errc::io_error;
        no.message = "not today\x1b[2J";
        rep.entries.push_back(no);
      }
      send_path(*c, rep);
    }
   }
  });
  for (const char* large : {"0", "64M"}) {
    CAPTURE(large);
    // (--retries 0: the fake server serves one session, whose end would otherwise be retried.)
    auto r = xt::xduc({"-q", "-r", "--retries", "0", "--large-file", large, "--known-hosts", kh, url(srv.port(), "t/"),
                       local / "back"},
                      60000);
    INFO(r.err);
    CHECK(r.status == 1);
    CHECK(r.err.find("1 not copied") != std::string::npos);
    // What the server named is shown escaped: no escape sequence or bell reached the terminal.
    CHECK(r.err.find('\x1b') == std::string::npos);
    CHECK(r.err.find('\x07') == std::string::npos);
    CHECK(r.err.find("evil\\x1b]0;owned\\x07\\nname") != std::string::npos);
    CHECK(xt::list_dir(local / "back").empty());
  }
  t.join();
}

TEST_CASE("a hostile path server's large files cannot be downloaded outside the tree, nor through a symlink or device") {
  xt::TempDir local, outside;
  xt::RawServer srv;
  const std::string kh = local / "known_hosts";
  // Its listing: a symlink out of the tree, then large files (which go as transfers of their
  // own after the path part) through that symlink and onto a symlink to a device (a name with
  // ".." fails the listing itself). It ends the path operation cleanly and would then be asked for them.
  std::thread t([&] {
    auto c = srv.accept();
    if (!c) return;
    c->send_reply({0, 0, c->hello.nego.block_size});
    for (;;) {
      auto f = c->read_frame();
      if (!f) break;
      if (f->first.event == ChannelEvent::eofr) {
        FrameHeader h;
        h.event = ChannelEvent::eofr;
        c->send_frame(h);
        continue;
      }
      if (f->first.event != ChannelEvent::xpathm) break;  // the transfer it must not be asked for, or EOFT
      auto r = pm::decode_request(aligned(f->second));
      if (!r) break;
      pm::Reply rep;
      rep.id = r->id;
      auto entry = [](const std::string& path, pm::Type type, std::uint64_t size, const std::string& target = {}) {
        pm::Entry e;
        e.path = path;
        e.type = type;
        e.size = size;
        e.mode = 0644;
        e.target = target;
        return e;
      };
      if (r->op == pm::Op::stat) {
        rep.entries.push_back(entry(".", pm::Type::directory, 0));
      } else if (r->op == pm::Op::list) {
        rep.entries.push_back(entry("out", pm::Type::symlink, 0, outside.path()));
        rep.entries.push_back(entry("null", pm::Type::symlink, 0, "/dev/null"));
        rep.entries.push_back(entry("out/big", pm::Type::file, 2 << 20));
        rep.entries.push_back(entry("null", pm::Type::file, 2 << 20));
      }
      send_path(*c, rep);
    }
  });
  auto r = xt::xduc({"-r", "--large-file", "1M", "--known-hosts", kh, url(srv.port(), "t/"), local / "back"}, 60000);
  t.join();
  INFO(r.err);
  CHECK(r.status == 1);
  CHECK(r.err.find("2 not copied") != std::string::npos);
  CHECK(r.err.find("out/big") != std::string::npos);
  CHECK(r.err.find("'null' exists here and is not a regular file") != std::string::npos);
  CHECK(xt::list_dir(outside.path()).empty());
  CHECK(xt::list_dir(local / "back") == std::vector<std::string>{"null", "out"});
}

TEST_CASE("a hostile path server sending more of a file than it listed: xduc refuses it, keeps nothing of it") {
  xt::TempDir local;
  xt::RawServer srv;
  std::thread t([&] {
    auto c = srv.accept();
    if (!c) return;
    c->send_reply({0, 0, c->hello.nego.block_size});
    const auto lots = xt::random_bytes(1 << 20, 3);
    for (;;) {
      auto r = read_request(*c);
      if (!r) break;
      pm::Reply rep;
      rep.id = r->id;
      pm::Entry e;
      e.type = pm::Type::file;
      e.mode = 0644;
      if (r->op == pm::Op::stat) {
        e.path = ".";
        e.type = pm::Type::directory;
        e.mode = 0755;
      } else if (r->op == pm::Op::list) {
        e.path = "f";
        e.size = 2;
      } else if (r->op == pm::Op::get) {
        e.path = "f";
        e.size = lots.size();
        e.data = lots;  // a megabyte for the two bytes listed
      }
      rep.entries.push_back(e);
      send_path(*c, rep);
    }
  });
  auto r = xt::xduc({"-q", "-r", "--known-hosts", local / "kh", url(srv.port(), "t/"), local / "back"}, 60000);
  t.join();
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.err.find("server sent more of 'f' than the 2 bytes it listed") != std::string::npos, r.err);
  CHECK_FALSE(xt::exists(local / "back/f"));
  xt::check_no_partials(local.path());
}

TEST_CASE("a hostile path server whose chunks name a smaller file than it listed: the file already there stays") {
  // 'f' is listed at 4 MiB, so it comes in 1 MiB chunks; each chunk says the file is 1 MiB.
  // Taken at its word, the first chunk would complete a 1 MiB file and replace the one there.
  xt::TempDir local;
  xt::RawServer srv;
  std::thread t([&] {
    auto c = srv.accept();
    if (!c) return;
    c->send_reply({0, 0, c->hello.nego.block_size});
    const auto chunk = xt::random_bytes(1 << 20, 3);
    for (;;) {
      auto r = read_request(*c);
      if (!r) break;
      pm::Reply rep;
      rep.id = r->id;
      if (r->op == pm::Op::stat) {
        pm::Entry top;
        top.path = ".";
        top.type = pm::Type::directory;
        top.mode = 0755;
        rep.entries.push_back(top);
      } else if (r->op == pm::Op::list) {
        pm::Entry e;
        e.path = "f";
        e.type = pm::Type::file;
        e.mode = 0644;
        e.size = 4u << 20;
        rep.entries.push_back(e);
      } else if (r->op == pm::Op::get) {
        for (const auto& q : r->entries) {
          pm::Entry e;
          e.path = "f";
          e.type = pm::Type::file;
          e.mode = 0644;
          e.size = 1u << 20;
          e.offset = q.offset;
          e.file_id = q.file_id;
          e.data = chunk;
          rep.entries.push_back(e);
        }
      }
      send_path(*c, rep);
    }
  });
  const std::string back = local / "back";
  fs::create_directory(back);
  xt::write_file(back + "/f", "precious");
  // (--retries 0: the fake server serves one session, whose end would otherwise be retried.)
  auto r = xt::xduc({"-q", "-r", "--retries", "0", "--known-hosts", local / "kh", url(srv.port(), "t/"), back}, 60000);
  t.join();
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.err.find("'f' changed size while it was copied (listed 4194304 bytes, now 1048576)") != std::string::npos,
                r.err);
  CHECK(xt::read_file(back + "/f") == "precious");
  xt::check_no_partials(local.path());
}

TEST_CASE("a hostile path server naming paths that escape: the listing is refused, a reply's own path is ignored") {
  xt::TempDir local, outside;
  xt::RawServer srv;
  const std::string kh = local / "known_hosts";
  // Serves a tree listing `names`; answers every get with the file's bytes under a path of its
  // own choosing (which the client must not follow).
  auto serve = [&](std::vector<std::string> names) {
    return std::thread([&srv, names] {
      auto c = srv.accept();
      if (!c) return;
      c->send_reply({0, 0, c->hello.nego.block_size});
      static const std::uint8_t bytes[] = {'o', 'k'};
      for (;;) {
        auto r = read_request(*c);
        if (!r) break;
        pm::Reply rep;
        rep.id = r->id;
        if (r->op == pm::Op::stat) {
          pm::Entry top;
          top.path = ".";
          top.type = pm::Type::directory;
          top.mode = 0755;
          rep.entries.push_back(top);
        } else if (r->op == pm::Op::list) {
          for (const auto& n : names) {
            pm::Entry e;
            e.path = n;
            e.type = pm::Type::file;
            e.size = 2;
            e.mode = 0644;
            rep.entries.push_back(e);
          }
        } else if (r->op == pm::Op::get) {
          for (std::size_t i = 0; i < r->entries.size(); ++i) {
            pm::Entry e;
            e.path = "../../../../" + std::string(outside_name);
            e.size = 2;
            e.mode = 0644;
            e.data = bytes;
            rep.entries.push_back(e);
          }
        }
        send_path(*c, rep);
      }
    });
  };
  for (const char* bad : {"../up", "/abs/x", "a/../../x", "a/./../../x"}) {
    CAPTURE(bad);
    auto t = serve({"fine", bad});
    auto r = xt::xduc({"-q", "-r", "--known-hosts", kh, url(srv.port(), "t/"), local / "back"}, 60000);
    t.join();
    CHECK(r.status == 1);
    CHECK(r.err.find("server listed a bad name") != std::string::npos);
  }
  // Good names, but get replies that name a path outside: the bytes land under the client's own
  // name for what it asked.
  auto t = serve({"fine", "sub/also"});
  auto r = xt::xduc({"-q", "-r", "--known-hosts", kh, url(srv.port(), "t/"), local / "back2"}, 60000);
  t.join();
  CHECK_MESSAGE(r.status == 0, r.err);
  CHECK(xt::read_file(local / "back2/fine") == "ok");
  CHECK(xt::read_file(local / "back2/sub/also") == "ok");
  CHECK(xt::list_dir(outside.path()).empty());
  CHECK_FALSE(xt::exists(local / "up"));
}

TEST_CASE("a hostile path server answering a request twice: xduc refuses it, neither hangs nor runs a handler twice") {
  // Every reply runs the request's handler, which refers to its caller's locals: a second reply
  // after the caller has returned would write to a frame that is gone, and a second reply to a
  // get would count a chunk twice and wait for ever.
  xt::TempDir local;
  xt::RawServer srv;
  const std::string kh = local / "known_hosts";
  // part: which op is answered in two parts (a non-final one first, an error one if error, an
  // empty one 2000 times if empty); the rest answer normally.
  auto serve = [&](pm::Op part, bool error, bool empty) {
    return std::thread([&srv, part, error, empty] {
      auto c = srv.accept();
      if (!c) return;
      c->send_reply({0, 0, c->hello.nego.block_size});
      for (;;) {
        auto r = read_request(*c);
        if (!r) break;
        pm::Reply rep;
        rep.id = r->id;
        pm::Entry e;
        e.type = pm::Type::file;
        e.mode = 0644;
        e.path = "f";
        e.size = 2;
        if (r->op == pm::Op::stat) {
          e.path = ".";
          e.type = pm::Type::directory;
          e.mode = 0755;
        } else if (r->op == pm::Op::get) {
          static const std::uint8_t ok[] = {'o', 'k'};
          e.data = ok;
        }
        rep.entries.push_back(e);
        if (r->op == part) {
          pm::Reply first = rep;
          first.last = false;
          if (error) {
            first.code = errc::io_error;
            first.message = "no";
          }
          if (empty || error) first.entries.clear();
          // Empty parts say nothing and cost the client nothing it counts: many of them.
          for (int k = 0; k < (empty ? 2000 : 1); ++k) send_path(*c, first);
        }
        send_path(*c, rep);
      }
    });
  };
  auto run = [&](pm::Op part, bool error, bool empty = false) {
    auto t = serve(part, error, empty);
    auto r = xt::xduc({"-q", "-r", "--known-hosts", kh, url(srv.port(), "t/"), local / "back"}, 60000);
    t.join();
    return r;
  };
  SUBCASE("a stat answered in two parts") {
    auto r = run(pm::Op::stat, false);
    CHECK(r.status == 1);
    CHECK_MESSAGE(r.err.find("partial reply to request") != std::string::npos, r.err);
  }
  SUBCASE("a get answered in two parts") {
    auto r = run(pm::Op::get, false);
    CHECK(r.status == 1);
    CHECK_MESSAGE(r.err.find("partial reply to request") != std::string::npos, r.err);
    CHECK_FALSE(xt::exists(local / "back/f"));
  }
  SUBCASE("a listing's error that does not end it") {
    auto r = run(pm::Op::list, true);
    CHECK(r.status == 1);
    CHECK_MESSAGE(r.err.find("partial reply to request") != std::string::npos, r.err);
  }
  SUBCASE("a listing in empty parts") {
    auto r = run(pm::Op::list, false, true);
    CHECK(r.status == 1);
    CHECK_MESSAGE(r.err.find("empty part of a listing") != std::string::npos, r.err);
  }
  xt::check_no_partials(local.path());
}

TEST_CASE("a path reply's declared length costs the client nothing until its bytes arrive") {
  // The server announces a reply of the largest size a client accepts (a block and 8 MiB), sends
  // 100 bytes of it and stalls. The client holds what a reply to its own requests takes (a
  // block and the names), not what was announced.
  xt::TempDir local;
  xt::RawServer srv;
  std::atomic<bool> stalled{false}, release{false};
  std::thread t([&] {
    auto c = srv.accept();
    if (!c) return;
    c->send_reply({0, 0, c->hello.nego.block_size});
    if (read_request(*c)) {
      FrameHeader h;
      h.event = ChannelEvent::xpathm;
      h.length = c->hello.nego.block_size + (8u << 20);
      c->send_frame(h, xt::random_bytes(100, 1));  // a header that claims more than follows
      stalled = true;
      stalled.notify_all();
    }
    release.wait(false);
  });
  xdfs::TransferOptions opt;
  opt.known_hosts_file = local / "known_hosts";
  // Blocks this large always come from mmap (glibc raises the threshold after freeing one).
  ::mallopt(M_MMAP_THRESHOLD, 128 << 10);
  const std::size_t before = ::mallinfo2().hblkhd;
  std::size_t during = 0;
  std::thread client([&] {
    xdfs::RemoteFs rfs({"127.0.0.1", srv.port()}, opt);
    try {
      rfs->stat("x");
      FAIL("a stat with no reply succeeded");
    } catch (const xdfs::Error& e) {
      CHECK(e.code() == errc::peer_aborted);
    }
  });
  stalled.wait(false);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the client has read the header
  during = ::mallinfo2().hblkhd;
  release = true;
  release.notify_all();
  t.join();
  client.join();
  INFO("mapped by malloc: " << before << " before, " << during << " while the reply stalled");
  CHECK(during < before + (opt.block_size + (2u << 20)));

  // A real reply larger than that (a listing chunk of long link targets, about 1 MiB, with
  // 64 KiB blocks) grows as it arrives and arrives whole, its tag checked, in every mode.
  xt::TempDir root;
  fs::create_directory(root / "d");
  const std::string target(4000, 't');
  for (int i = 0; i < 250; ++i) fs::create_symlink(target + std::to_string(i), root / ("d/" + std::to_string(i)));
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer real(cfg);
  for (auto mode : {xdfs::xsec::Protect::clear, xdfs::xsec::Protect::integrity, xdfs::xsec::Protect::private_}) {
    xdfs::TransferOptions o;
    o.block_size = 64u << 10;
    o.protect = mode;
    xdfs::RemoteFs rfs({"127.0.0.1", real.port()}, o);
    std::size_t listed = 0, right = 0;
    rfs->list("d", false, [&](std::vector<pm::Entry>& chunk) {
      for (const auto& e : chunk) right += e.target == target + e.path;
      listed += chunk.size();
    });
    CHECK(listed == 250);
    CHECK(right == 250);
    rfs.close();
  }
}

TEST_CASE("unauthenticated connections and stalled openings do not lock out a real client") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {"--handshake-timeout", "30"});
  std::vector<std::unique_ptr<xt::RawChannel>> held;
  // Silent connections and well-formed openings that go no further, from several source
  // addresses: under the old design each opening made a session and 64 of them filled the server.
  for (int i = 0; i < 300; ++i)
    held.push_back(std::make_unique<xt::RawChannel>(d.port(), "127.0.1." + std::to_string(1 + i % 50)));
  for (int i = 0; i < 150; ++i) {
    auto c = std::make_unique<xt::RawChannel>(d.port(), "127.0.2." + std::to_string(1 + i % 50));
    c->send_opening(xt::make_hello(Mode::upload, "x", 1, 10).opening);
    held.push_back(std::move(c));
  }
  // A real client, while all of that is held.
  xt::write_random_file(local / "f", 8 << 20, 5);
  auto up = xt::xduc({"-q", "-p", "4", local / "f", url(d.port(), "f")}, 60000);
  CHECK_MESSAGE(up.status == 0, up.err);
  CHECK(xt::files_equal(local / "f", root / "f"));
  // The same from the loopback address the first 300 came from shares no cap with them.
  auto down = xt::xduc({"-q", "-p", "2", url(d.port(), "f"), local / "back"}, 60000);
  CHECK_MESSAGE(down.status == 0, down.err);
  CHECK(xt::files_equal(local / "f", local / "back"));
  held.clear();
  CHECK(d.alive());
}

TEST_CASE("a pending cap that is full drops the oldest waiting connection, not a newcomer") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {"--handshake-timeout", "30", "--max-pending", "40", "--max-pending-per-address", "10"});
  std::vector<std::unique_ptr<xt::RawChannel>> flood;
  for (int i = 0; i < 30; ++i) flood.push_back(std::make_unique<xt::RawChannel>(d.port(), "127.0.3.1"));
  // The first 20 from that address were dropped as the later ones came.
  CHECK(flood.front()->wait_closed(10000));
  CHECK(d.wait_for_log("connections from 127.0.3.1 are pending, its limit"));
  for (int i = 0; i < 40; ++i)
    flood.push_back(std::make_unique<xt::RawChannel>(d.port(), "127.0.4." + std::to_string(1 + i)));
  CHECK(d.wait_for_log("connections are pending, the server's limit"));
  CHECK(flood[10]->wait_closed(10000));  // the oldest survivors of the first address went first
  // A newcomer gets in, and so do its channels: each joins while the oldest waiting ones go.
  xt::write_random_file(local / "g", 1 << 20, 6);
  auto ok = xt::xduc({"-q", "-p", "8", local / "g", url(d.port(), "g")}, 60000);
  CHECK_MESSAGE(ok.status == 0, ok.err);
  CHECK(xt::files_equal(local / "g", root / "g"));
}

TEST_CASE("a session torn down in the middle of a long checksum does not stop the server accepting") {
  xt::TempDir root, local;
  {
    // A sparse terabyte: hashing it takes minutes; only cancelling it ends sooner.
    int fd = ::open((root / "huge").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, static_cast<off_t>(std::uint64_t(1) << 40)) == 0);
    ::close(fd);
  }
  xt::XdfsdProcess d(root.path());
  {
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(xt::make_hello(Mode::path, ".", 1)));
    expect_reply(c);
    pm::Request r;
    r.id = 1;
    r.op = pm::Op::checksum;
    r.path = "huge";
    send_path(c, r);
    REQUIRE(d.wait_for_log("mode=path"));
  }  // the client goes while its checksum runs
  CHECK(d.wait_for_log("status=error: peer aborted"));
  xt::write_file(root / "small", "hello");
  auto st = xt::xduc({"stat", url(d.port(), "small")}, 60000);
  CHECK_MESSAGE(st.status == 0, st.err);
  xt::check_serving(d.port(), root.path(), local.path());
  // And the server stops at once: nothing is left hashing.
  CHECK(d.stop(SIGTERM, 30000) == 0);
}

TEST_CASE("requests a path session never finishes sending are parked at the header, within the memory limit") {
  xt::TempDir root;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  cfg.memory_limit = 64u << 20;
  xt::InProcessServer srv(cfg);
  auto h = xt::make_hello(Mode::path, ".", 8);
  h.nego.block_size = 16u << 20;  // each request may be 20 MiB
  std::vector<std::unique_ptr<xt::RawChannel>> ch;
  ch.push_back(std::make_unique<xt::RawChannel>(srv.port()));
  REQUIRE(ch[0]->establish(h));
  for (std::uint32_t i = 1; i < 8; ++i) {
    ch.push_back(std::make_unique<xt::RawChannel>(srv.port()));
    REQUIRE(ch[i]->join(h, i, ch[0]->session_secret()));
  }
  for (auto& c : ch) {
    auto reply = c->read_frame();
    REQUIRE(reply.has_value());
    REQUIRE(reply->first.event == ChannelEvent::nego_reply);
  }
  // Every channel announces a 20 MiB request and sends 1 MiB of it.
  const std::uint32_t claim = (16u << 20) + (4u << 20);
  for (auto& c : ch) {
    FrameHeader fh;
    fh.event = ChannelEvent::xpathm;
    fh.length = claim;
    auto hb = xdfs::wire::encode(fh);
    c->send_bytes(hb.data(), hb.size());
    c->send_bytes(xt::random_bytes(1 << 20, 4));
  }
  // The server took what fits its limit and no more: a few requests' buffers, not eight.
  const auto& mem = srv.server().memory();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (mem.used() < 2ull * claim && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(mem.used() >= 2ull * claim);
  CHECK(mem.used() <= cfg.memory_limit);
  CHECK(mem.peak() <= cfg.memory_limit);
  // Another client is served meanwhile: its small requests fit what is left.
  xt::write_file(root / "f", "x");
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()});
  CHECK(rfs->stat("f").size == 1);
  rfs.close();
  ch.clear();  // the stalled session goes; what it held comes back
  const auto back = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (mem.used() != 0 && std::chrono::steady_clock::now() < back)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(mem.used() == 0);
}

TEST_CASE("a path session that asks for many listings and reads none holds a few chunks of memory, and NOOPs do not keep it") {
  // A listing of 1000 symbolic links with 4000-byte targets is four chunks of about 1 MiB. A
  // client that asks for many and reads no reply leaves them waiting: they are bounded per
  // session (8 chunks, 9 MiB here), so the server's memory is not the client's to fill. (They
  // were bounded per listing, 4 each, and a session held 21 MiB here.)
  xt::TempDir root;
  fs::create_directory(root / "d");
  const std::string target(4000, 't');
  for (int i = 0; i < 1000; ++i) fs::create_symlink(target, root / ("d/" + std::to_string(1000 + i)));
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  cfg.memory_limit = 256u << 20;
  cfg.idle_timeout = std::chrono::milliseconds(2000);
  xt::InProcessServer srv(cfg);
  xt::RawChannel c(srv.port()), other(srv.port());
  open_path_pair(c, other);
  for (std::uint64_t id = 1; id <= 64; ++id) {
    pm::Request r;
    r.id = id;
    r.op = pm::Op::list;
    r.path = "d";
    send_path(c, r);
  }
  // Meanwhile the client says on its other channel that it is there (a NOOP every 200 ms),
  // which keeps an idle session but not one that reads nothing it is sent: that one still
  // times out and gives back what it held.
  FrameHeader noop;
  noop.event = ChannelEvent::noop;
  const auto& mem = srv.server().memory();
  bool timed_out = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (int i = 0; !timed_out && std::chrono::steady_clock::now() < until; ++i) {
    if (i % 10 == 0) other.send_frame(noop);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    timed_out = srv.wait_for_log("timed out: no progress for 2000 ms", 0);
  }
  CHECK(timed_out);
  CHECK_MESSAGE(mem.peak() <= (16u << 20), "peak " << mem.peak());
  // Another client is served meanwhile.
  xt::write_file(root / "f", "x");
  xdfs::RemoteFs rfs({"127.0.0.1", srv.port()});
  CHECK(rfs->stat("f").size == 1);
  std::size_t listed = 0;
  rfs->list("d", false, [&](std::vector<pm::Entry>& chunk) { listed += chunk.size(); });
  CHECK(listed == 1000);
  rfs.close();
}

TEST_CASE("a path client that ends with requests still unanswered: the server answers them all, then ends on every channel") {
  // The real client ends only once every request has its answer; one that does not is still
  // served: the server's table has it wait in `ending` until its workers are done and the
  // replies have left, and only then send its EOFRs (the model checks the honest order only).
  xt::TempDir root;
  for (int i = 0; i < 16; ++i) xt::write_file(root / ("f" + std::to_string(i)), std::string(std::size_t(i) + 1, 'x'));
  xt::InProcessServer srv([&] {
    xdfs::ServerConfig cfg;
    cfg.root = root.path();
    return cfg;
  }());
  xt::RawChannel c(srv.port()), other(srv.port());
  open_path_pair(c, other);
  for (std::uint64_t id = 1; id <= 16; ++id) {
    pm::Request r;
    r.id = id;
    r.op = pm::Op::checksum;
    r.path = "f" + std::to_string(id - 1);
    send_path(c, r);
  }
  FrameHeader e;
  e.event = ChannelEvent::eofr;
  c.send_frame(e);
  other.send_frame(e);
  // Every request answered, then EOFR, on the channel they came on; EOFR alone on the other.
  std::set<std::uint64_t> answered;
  for (;;) {
    auto f = c.read_frame();
    REQUIRE(f.has_value());
    if (f->first.event == ChannelEvent::eofr) break;
    REQUIRE_MESSAGE(f->first.event == ChannelEvent::xpathm, xdfs::wire::to_string(f->first.event));
    std::string why;
    auto rep = pm::decode_reply(f->second, &why);
    REQUIRE_MESSAGE(rep.has_value(), why);
    CHECK(rep->code == errc::ok);
    answered.insert(rep->id);
  }
  CHECK(answered.size() == 16);
  auto f = other.read_frame();
  REQUIRE(f.has_value());
  CHECK(f->first.event == ChannelEvent::eofr);
  // The operation ended cleanly: the channels are the session's, which takes the end.
  FrameHeader t;
  t.event = ChannelEvent::eoft;
  c.send_frame(t);
  other.send_frame(t);
  CHECK(srv.wait_for_log("status=ok", 10000));
}

TEST_CASE("path mode: an EOFR or NOOP carrying a payload is refused before it is acted on, by either side") {
  // Such a frame's header is authenticated only by the tag after its payload: acting on the
  // header at once would let anyone on the path end an operation as if the client had.
  xt::TempDir root, local;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  for (auto ev : {ChannelEvent::eofr, ChannelEvent::noop}) {
    CAPTURE(xdfs::wire::to_string(ev));
    xt::RawChannel c(srv.port());
    REQUIRE(c.establish(xt::make_hello(Mode::path, ".", 1)));
    expect_reply(c);
    FrameHeader h;
    h.event = ev;
    h.length = 5;
    c.send_frame(h, xt::random_bytes(5, 1));
    auto ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::protocol_error);
    CHECK(ex->message == std::string(xdfs::wire::to_string(ev)) + " with a payload");
  }
  xt::RawServer hostile;
  std::thread t([&] {
    auto c = hostile.accept();
    if (!c) return;
    c->send_reply({0, 0, c->hello.nego.block_size});
    FrameHeader h;
    h.event = ChannelEvent::noop;
    h.length = 5;
    c->send_frame(h, xt::random_bytes(5, 1));
    c->wait_closed();
  });
  auto r = xt::xduc({"-q", "--known-hosts", local / "kh", "ls", url(hostile.port(), ".")}, 60000);
  t.join();
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.err.find("NOOP with a payload from the server") != std::string::npos, r.err);
}

TEST_CASE("a get carries no more than the sizes it asked for: a file larger than asked is refused, not read") {
  xt::TempDir root;
  xt::write_random_file(root / "big", 3 << 20, 9);
  xt::write_file(root / "small", "12345");
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  auto h = xt::make_hello(Mode::path, ".", 1);
  h.nego.block_size = 4u << 20;  // a get may carry up to two blocks: big fits that
  xt::RawChannel c(srv.port());
  REQUIRE(c.establish(h));
  expect_reply(c);
  // Whole files, declared as 0 and 5 bytes: the reply was reserved for 5 bytes.
  pm::Request r;
  r.id = 7;
  r.op = pm::Op::get;
  for (const char* name : {"big", "small"}) {
    pm::Entry e;
    e.path = name;
    e.size = std::string(name) == "small" ? 5 : 0;
    r.entries.push_back(e);
  }
  send_path(c, r);
  auto rep = read_reply(c);
  REQUIRE(rep.has_value());
  REQUIRE(rep->entries.size() == 2);
  CHECK(rep->entries[0].code == errc::size_mismatch);
  CHECK(rep->entries[0].message.find("larger than the 0 bytes asked for") != std::string::npos);
  CHECK(rep->entries[0].data.empty());
  CHECK(rep->entries[1].code == errc::ok);
  CHECK(rep->entries[1].data.size() == 5);
}

TEST_CASE("when memory is short, sessions get smaller rings or wait for it, and all of them finish") {
  xt::TempDir root, local;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  cfg.memory_limit = 48u << 20;  // 42 MiB for sessions: not enough for twelve 8 MiB rings at once
  xt::InProcessServer srv(cfg);
  const int n = 12;
  for (int i = 0; i < n; ++i) xt::write_random_file(local / ("f" + std::to_string(i)), 8 << 20, 100 + i);
  std::vector<std::thread> t;
  std::vector<xdfs::errc> got(n, errc::internal);
  for (int i = 0; i < n; ++i)
    t.emplace_back([&, i] {
      xdfs::TransferOptions o;
      o.channels = 4;
      o.protect = xdfs::xsec::Protect::clear;
      got[i] = xt::error_of([&] { xdfs::upload(local / ("f" + std::to_string(i)), {"127.0.0.1", srv.port()},
                                               "f" + std::to_string(i), o); });
    });
  for (auto& th : t) th.join();
  for (int i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(got[i] == errc::ok);
    CHECK(xt::files_equal(local / ("f" + std::to_string(i)), root / ("f" + std::to_string(i))));
  }
  const auto& mem = srv.server().memory();
  CHECK(mem.limit() <= cfg.memory_limit);
  CHECK(mem.peak() <= mem.limit());
  CHECK(mem.peak() > mem.limit() / 2);  // the sessions did press on the limit
}

TEST_CASE("a newline in a path cannot forge a log line; names from a server reach xduc's terminal escaped") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path());
  const std::string forged = "2026-01-01T00:00:00Z xdfsd: session 00000000 end peer=1.2.3.4:5 status=ok";
  {
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(xt::make_hello(Mode::upload, "x\n" + forged, 1, 10)));
    expect_reply(c);
  }  // gone mid-file: the session's end line names the path too
  {
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(xt::make_hello(Mode::download, "/etc\r\n" + forged, 1)));
    auto ex = c.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::path_escape);
  }
  REQUIRE(d.wait_for_log("path=x\\n2026-01-01"));
  REQUIRE(d.wait_for_log("absolute path '/etc\\r\\n2026-01-01"));
  CHECK(lines_start_with_timestamps(d.log()));
  CHECK(d.log().find("\n" + forged) == std::string::npos);

  xt::write_file(root / "evil\x1b[31m\x07\nname", "x");
  ::symlink("\x1b]2;title\x07", (root / "link").c_str());
  auto ls = xt::xduc({"ls", url(d.port(), "")}, 60000);
  REQUIRE(ls.status == 0);
  CHECK(ls.out.find('\x1b') == std::string::npos);
  CHECK(ls.out.find('\x07') == std::string::npos);
  CHECK(ls.out.find("evil\\x1b[31m\\x07\\nname") != std::string::npos);
  CHECK(ls.out.find("link -> \\x1b]2;title\\x07") != std::string::npos);
  CHECK(std::count(ls.out.begin(), ls.out.end(), '\n') == 2);  // one line per entry
  auto json = xt::xduc({"ls", "--json", url(d.port(), "")}, 60000);
  CHECK(json.out.find('\x1b') == std::string::npos);
  CHECK(json.out.find("evil\\\\x1b[31m\\\\x07\\\\nname") != std::string::npos);
}

TEST_CASE("one key cannot hold the whole server: sessions and channels per key") {
  xt::TempDir root, local, state;
  const auto me = xt::test_identity();
  const std::string other_id = local / "other";
  const auto other = xdfs::xsec::load_or_create_key(other_id);
  xt::write_file(state / "authorized_keys", xdfs::xsec::format_public(me.public_key) + " rw sessions=2 channels=6\n" +
                                                xdfs::xsec::format_public(other.public_key) + " rw\n");
  xt::XdfsdProcess d(root.path(), {"--authorized-keys", state / "authorized_keys", "--join-timeout", "20"});
  // Two sessions of this key, each waiting for its second channel.
  auto a = std::make_unique<xt::RawChannel>(d.port());
  REQUIRE(a->establish(xt::make_hello(Mode::upload, "a", 2, 10)));
  xt::RawChannel b(d.port());
  REQUIRE(b.establish(xt::make_hello(Mode::upload, "b", 2, 10)));
  xt::RawChannel third(d.port());
  REQUIRE(third.establish(xt::make_hello(Mode::upload, "c", 1, 10)));
  auto ex = third.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->code == errc::limit_exceeded);
  CHECK(ex->message.find("has 2 sessions running, its limit") != std::string::npos);
  a.reset();  // one goes: a session may start again, but not with more channels than are left
  REQUIRE(d.wait_for_log("path=a channels=2"));
  xt::RawChannel wide(d.port());
  REQUIRE(wide.establish(xt::make_hello(Mode::upload, "w", 5, 10)));
  ex = wide.read_exception();
  REQUIRE(ex.has_value());
  CHECK(ex->code == errc::limit_exceeded);
  CHECK(ex->message.find("has 2 channels open and asks for 5 more, its limit is 6") != std::string::npos);
  // Another key is not held up by this one.
  xt::write_random_file(local / "f", 100000, 2);
  auto up = xt::xduc({"-q", "--identity", other_id, "-p", "8", local / "f", url(d.port(), "f")}, 60000);
  CHECK_MESSAGE(up.status == 0, up.err);
}

TEST_CASE("sessions waiting for memory count against their key's limits: one key cannot fill the queue") {
  // 14 MiB of the 16 are the sessions'; a session of 256 channels takes 4.25 MiB of it before
  // any buffer. Three hold 12.75 MiB while their channels do not come: later ones wait.
  xt::TempDir root, local, state;
  const auto me = xt::test_identity();
  const std::string other_id = local / "other";
  const auto other = xdfs::xsec::load_or_create_key(other_id);
  xt::write_file(state / "authorized_keys", xdfs::xsec::format_public(me.public_key) + " rw\n" +
                                                xdfs::xsec::format_public(other.public_key) + " rw sessions=2\n");
  xt::XdfsdProcess d(root.path(), {"--authorized-keys", state / "authorized_keys", "--memory-limit", "16M",
                                   "--join-timeout", "30"});
  std::vector<std::unique_ptr<xt::RawChannel>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<xt::RawChannel>(d.port()));
    REQUIRE(held.back()->establish(xt::make_hello(Mode::upload, "h" + std::to_string(i), 256, 10)));
  }
  // The other key's two sessions wait for memory...
  std::vector<std::unique_ptr<xt::RawChannel>> waiting;
  for (int i = 1; i <= 2; ++i) {
    waiting.push_back(std::make_unique<xt::RawChannel>(d.port()));
    REQUIRE(waiting.back()->establish(xt::make_hello(Mode::upload, "w" + std::to_string(i), 256, 10), &other, 0));
    REQUIRE(d.wait_for_log("waits for memory (" + std::to_string(i) + " waiting)"));
  }
  // ...and count as its two sessions: a third is refused at once, not queued.
  xt::RawChannel third(d.port());
  REQUIRE(third.establish(xt::make_hello(Mode::upload, "w3", 256, 10), &other, 0));
  auto ex = third.read_exception(5000);
  REQUIRE(ex.has_value());
  CHECK(ex->code == errc::limit_exceeded);
  CHECK(ex->message.find("has 0 sessions running and 2 waiting for memory, its limit") != std::string::npos);
  // The first key may still queue behind them.
  xt::RawChannel mine(d.port());
  REQUIRE(mine.establish(xt::make_hello(Mode::upload, "m", 256, 10), nullptr, 0));
  CHECK(d.wait_for_log("waits for memory (3 waiting)"));
}

TEST_CASE("a tree download into an existing directory leaves that directory's mode alone") {
  xt::TempDir root, local;
  fs::create_directories(root / "d/sub");
  xt::write_file(root / "d/f", "x");
  ::chmod((root / "d").c_str(), 0777);
  ::chmod((root / "d/sub").c_str(), 0750);
  xt::XdfsdProcess d(root.path());
  const std::string mine = local / "home";
  ::mkdir(mine.c_str(), 0700);
  auto r = xt::xduc({"-q", "-r", url(d.port(), "d/"), mine}, 60000);
  REQUIRE_MESSAGE(r.status == 0, r.err);
  struct stat st {};
  REQUIRE(::stat(mine.c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0700);  // not the server's 0777
  REQUIRE(::stat((mine + "/sub").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0750);  // what the copy made gets the remote mode
  // A directory the copy makes as its destination gets the remote mode (less the umask).
  auto fresh = xt::xduc({"-q", "-r", url(d.port(), "d"), local / "new"}, 60000);
  REQUIRE_MESSAGE(fresh.status == 0, fresh.err);
  REQUIRE(::stat((local / "new/d").c_str(), &st) == 0);
  const mode_t mask = xdfs::files::process_umask();
  CHECK((st.st_mode & 07777) == (0777 & ~mask));
}

TEST_CASE("xdfsd refuses a state directory inside its root, and honours its umask") {
  xt::TempDir root, local;
  ::mkdir((root / "state").c_str(), 0700);
  auto r = xt::run(XDFSD_PATH, {"--root", root.path(), "--state-dir", root / "state", "--listen", "127.0.0.1:0"}, 30000);
  CHECK(r.status == 2);
  CHECK(r.err.find("lies inside the served root") != std::string::npos);
  CHECK_FALSE(xt::exists(root / "state/server_x25519"));  // refused before a key was made there
  // umask 077 for the server: what it creates is its owner's alone, whatever the client sent.
  const mode_t old = ::umask(077);
  xt::XdfsdProcess d(root.path());
  ::umask(old);
  fs::create_directories(local / "t/sub");
  xt::write_file(local / "t/sub/f", "x");
  ::chmod((local / "t/sub/f").c_str(), 0664);
  ::chmod((local / "t/sub").c_str(), 0775);
  auto up = xt::xduc({"-q", "-r", local / "t", url(d.port(), "")}, 60000);
  REQUIRE_MESSAGE(up.status == 0, up.err);
  xt::write_file(local / "single", "y");
  ::chmod((local / "single").c_str(), 0666);
  REQUIRE(xt::xduc({"-q", local / "single", url(d.port(), "single")}, 60000).status == 0);
  struct stat st {};
  REQUIRE(::stat((root / "t/sub/f").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(::stat((root / "t/sub").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  REQUIRE(::stat((root / "single").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
}

TEST_CASE("partial files of a killed server are removed when it starts again") {
  xt::TempDir root, local, state;
  xt::write_file(state / "authorized_keys", xdfs::xsec::format_public(xt::test_identity().public_key) + " rw\n");
  // The test servers' one identity, so that no client pins another key for a loopback port a
  // later test's server may get.
  fs::copy_file(std::string(std::getenv("XDFS_STATE_DIR")) + "/server_x25519", state / "server_x25519");
  const std::vector<std::string> args{"--state-dir", state.path()};
  std::string part;
  {
    xt::XdfsdProcess d(root.path(), args);
    xt::RawChannel c(d.port());
    REQUIRE(c.establish(xt::make_hello(Mode::upload, "cut", 1, 4 << 16)));
    expect_reply(c);
    c.send_block(ChannelEvent::xftsmu, 0, xt::random_bytes(1 << 16, 1));
    REQUIRE(d.wait_for_log("start peer="));
    for (auto& n : xt::list_dir(root.path()))
      if (n.find(".part") != std::string::npos) part = n;
    REQUIRE_MESSAGE(!part.empty(), "no temporary file while the upload runs");
    d.stop(SIGKILL);
  }
  REQUIRE(xt::exists(root / part));  // a killed server cannot clean up
  xt::XdfsdProcess again(root.path(), args);
  CHECK(again.wait_for_log("removed 1 partial file left by an earlier run"));
  CHECK_FALSE(xt::exists(root / part));
  // A live server's files are not touched by another one starting on the same root.
  xt::RawChannel c(again.port());
  REQUIRE(c.establish(xt::make_hello(Mode::upload, "live", 1, 4 << 16)));
  expect_reply(c);
  c.send_block(ChannelEvent::xftsmu, 0, xt::random_bytes(1 << 16, 1));
  std::string live;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (live.empty() && std::chrono::steady_clock::now() < until) {
    for (auto& n : xt::list_dir(root.path()))
      if (n.find(".part") != std::string::npos) live = n;
    if (live.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(!live.empty());
  xt::XdfsdProcess third(root.path(), args);
  xt::check_serving(third.port(), root.path(), local.path());
  CHECK(xt::exists(root / live));
}

TEST_CASE("--min-protect refuses weaker sessions before any handshake work") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {"--min-protect", "integrity"});
  xt::write_random_file(local / "f", 1000, 1);
  auto weak = xt::xduc({"-q", "--protect", "clear", local / "f", url(d.port(), "f")}, 60000);
  CHECK(weak.status == 1);
  CHECK(weak.err.find("requires protection 'integrity' or stronger") != std::string::npos);
  CHECK_FALSE(xt::exists(root / "f"));
  for (const char* ok : {"integrity", "private"}) {
    auto r = xt::xduc({"-q", "--protect", ok, local / "f", url(d.port(), std::string("f-") + ok)}, 60000);
    CHECK_MESSAGE(r.status == 0, r.err);
  }
}

TEST_CASE("what a session moves never crosses the wire in the clear, and a seen session id squats nothing") {
  xt::TempDir root, local;
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  xt::InProcessServer srv(cfg);
  const std::string name = "quarterly-results-7f3a9c.csv";
  const std::uint64_t size = 1234567;
  xt::write_random_file(local / "f", size, 8);
  for (auto mode : {xdfs::xsec::Protect::clear, xdfs::xsec::Protect::private_}) {
    CAPTURE(xdfs::xsec::to_string(mode));
    xt::Relay relay(srv.port(), mode);
    xdfs::TransferOptions o;
    o.protect = mode;
    o.channels = 3;
    o.known_hosts_file = local / "kh";
    xdfs::upload(local / "f", {"127.0.0.1", relay.port()}, name, o);
    REQUIRE(xt::files_equal(local / "f", root / name));
    const auto up = relay.bytes(xt::Relay::Dir::up);
    CHECK(std::search(up.begin(), up.end(), name.begin(), name.end()) == up.end());
    ::unlink((root / name).c_str());
  }
  // Someone who saw a session's id on the wire opens its channels first, as many as the session
  // has: without the secret they prove nothing and claim no index; the real channels join, and
  // each pushes out the oldest squatter at once, long before a handshake deadline would.
  xdfs::ServerConfig slow = cfg;
  slow.handshake_timeout = std::chrono::minutes(5);
  slow.join_timeout = std::chrono::minutes(5);
  xt::InProcessServer srv2(slow);
  auto h = xt::make_hello(Mode::upload, "v", 3, 2 << 16);
  xt::RawChannel victim(srv2.port());
  REQUIRE(victim.establish(h));
  std::vector<std::unique_ptr<xt::RawChannel>> squatters;
  for (std::uint32_t k = 0; k < 3; ++k) {
    auto o = h.opening;
    o.channel_index = 1 + k % 2;
    o.join = true;
    o.join_nonce = xt::random_bytes(32, 50 + k);
    squatters.push_back(std::make_unique<xt::RawChannel>(srv2.port()));
    squatters.back()->send_opening(o);
    REQUIRE(squatters.back()->read_frame().has_value());  // the server's answer; no proof follows
  }
  xt::RawChannel one(srv2.port()), two(srv2.port());
  REQUIRE(one.join(h, 1, victim.session_secret()));
  CHECK(squatters[0]->wait_closed(20000));  // the oldest place went to the real channel
  REQUIRE(two.join(h, 2, victim.session_secret()));
  expect_reply(victim);
  expect_reply(one);
  expect_reply(two);
  for (auto& s : squatters) CHECK(s->wait_closed(20000));  // the complete session needs none of them
  // Once the session has its channels, a further join (even one with the secret) is refused
  // before it costs anything more.
  {
    xt::RawChannel again(srv2.port());
    auto o = h.opening;
    o.channel_index = 1;
    o.join = true;
    o.join_nonce = xt::random_bytes(32, 60);
    again.send_opening(o);
    auto ex = again.read_exception();
    REQUIRE(ex.has_value());
    CHECK(ex->code == errc::bad_channel);
    CHECK(ex->message.find("already has its 3 channels") != std::string::npos);
    CHECK(again.wait_closed());
  }
  victim.send_block(ChannelEvent::xftsmu, 0, xt::random_bytes(1 << 16, 1));
  one.send_block(ChannelEvent::xftsmu, 1 << 16, xt::random_bytes(1 << 16, 2));
  for (auto* c : {&victim, &one, &two}) {
    FrameHeader e;
    e.event = ChannelEvent::eofr;
    c->send_frame(e);
  }
  auto done = victim.read_frame();
  REQUIRE(done.has_value());
  while (done && done->first.event == ChannelEvent::ack) done = victim.read_frame();
  REQUIRE(done.has_value());
  CHECK(done->first.event == ChannelEvent::eofr);  // committed; the channel stays for the next operation
  CHECK(fs::file_size(root / "v") == (2u << 16));
}

TEST_CASE("a handler that throws fails its own session only") {
  xt::TempDir root, local;
  // The real xFTSM mode, with one fault injected: its handler throws when a channel of a session
  // for "boom" arrives (as a failed allocation would).
  struct Faulty final : xdfs::runtime::SessionHandler {
    std::unique_ptr<xdfs::runtime::SessionHandler> real;
    bool boom;
    void add_channel(std::unique_ptr<xdfs::xdsi::Channel> ch) override {
      real->add_channel(std::move(ch));
      if (boom) throw std::runtime_error("injected fault");
    }
    void shutdown() override { real->shutdown(); }
    void crash(const std::string& what) override { real->crash(what); }
  };
  xdfs::ServerConfig cfg;
  cfg.root = root.path();
  std::vector<std::string> lines;
  std::mutex mu;
  cfg.log = [&](const std::string& l) {
    std::lock_guard g(mu);
    lines.push_back(l);
  };
  auto real = xdfs::runtime::session_factory(xdfs::standard_modes());
  cfg.listen = "127.0.0.1:0";
  xdfs::Server server(cfg, [real](xdfs::runtime::SessionEnv& env) -> std::unique_ptr<xdfs::runtime::SessionHandler> {
    auto f = std::make_unique<Faulty>();
    f->real = real(env);
    f->boom = env.nego.remote_path == "boom";
    return f;
  });
  std::thread t([&] { server.run(); });
  xt::write_random_file(local / "f", 300000, 4);
  bool remote = false;
  std::string what;
  CHECK(xt::error_of([&] { xdfs::upload(local / "f", {"127.0.0.1", server.port()}, "boom", {}); }, &remote, &what) ==
        errc::internal);
  CHECK(remote);
  CHECK(what.find("injected fault") != std::string::npos);
  CHECK_FALSE(xt::exists(root / "boom"));
  // The process, the listener and every other session go on.
  xdfs::upload(local / "f", {"127.0.0.1", server.port()}, "fine", {});
  CHECK(xt::files_equal(local / "f", root / "fine"));
  server.stop();
  t.join();
  std::lock_guard g(mu);
  CHECK(std::any_of(lines.begin(), lines.end(), [](const std::string& l) {
    return l.find("path=boom") != std::string::npos && l.find("status=error: internal error") != std::string::npos;
  }));
}

TEST_CASE("out of descriptors: xdfsd backs off, sheds with its reserve, says so a few times, and recovers") {
  xt::TempDir root, local;
  xt::XdfsdProcess d(root.path(), {}, {"prlimit", "--nofile=48:48", "--"});
  CHECK(d.wait_for_log("descriptor limit is 48"));
  std::vector<std::unique_ptr<xt::RawChannel>> held;
  for (int i = 0; i < 120; ++i) held.push_back(std::make_unique<xt::RawChannel>(d.port()));
  CHECK(d.wait_for_log("shedding a connection"));
  // While the flood is held, an accept loop that re-armed at once would spin on a core; one that
  // backs off sleeps. Measured over a second of the server's own CPU time.
  const double before = xt::cpu_seconds(d.pid());
  const auto t0 = std::chrono::steady_clock::now();
  d.wait_for_log("a line that never comes", 1000);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double used = xt::cpu_seconds(d.pid()) - before;
  INFO("xdfsd used " << used << " s of CPU in " << wall << " s");
  CHECK(used < 0.5 * wall);
  const std::string log = d.log();
  std::size_t accept_lines = 0;
  for (std::size_t at = 0; (at = log.find("accept: ", at)) != std::string::npos; ++at) ++accept_lines;
  CHECK(accept_lines < 100);  // rationed, not a line per attempt
  held.clear();
  xt::check_serving(d.port(), root.path(), local.path());
}

}  // TEST_SUITE
