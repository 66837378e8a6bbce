#include "xdfs/pathm/messages.hpp"

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstring>

#include "pathm.capnp.h"
#include "xdfs/text.hpp"
#include "xdfs/wire.hpp"

namespace xdfs::pathm {
namespace {

namespace s = xdfs::schema::pathm;

void set_why(std::string* why, std::string text) {
  if (why) *why = std::move(text);
}

kj::ArrayPtr<const kj::byte> bytes_of(std::span<const std::uint8_t> d) { return {d.data(), d.size()}; }

void fill(s::Entry::Builder b, const Entry& e) {
  b.setPath(e.path);
  b.setType(static_cast<s::EntryType>(e.type));
  b.setSize(e.size);
  b.setMode(e.mode);
  b.setMtimeNs(e.mtime_ns);
  if (!e.target.empty()) b.setTarget(e.target);
  b.setOffset(e.offset);
  b.setFileId(e.file_id);
  if (e.code != errc::ok) {
    b.setCode(static_cast<std::uint32_t>(e.code));
    b.setMessage(e.message.substr(0, 4096));
  }
}

void fill(s::Request::Builder b, const Request& r) {
  b.setId(r.id);
  b.setOp(static_cast<s::Op>(r.op));
  b.setPath(r.path);
  if (!r.to.empty()) b.setTo(r.to);
  b.setRecursive(r.recursive);
  b.setOffset(r.offset);
  b.setLength(r.length);
  b.setMode(r.mode);
  b.setBlockSize(r.block_size);
}

void fill(s::Reply::Builder b, const Reply& r) {
  b.setId(r.id);
  b.setCode(static_cast<std::uint32_t>(r.code));
  if (!r.message.empty()) b.setMessage(r.message);
  b.setLast(r.last);
  if (!r.algorithm.empty()) b.setAlgorithm(r.algorithm);
  if (!r.digest.empty()) b.setDigest(bytes_of(r.digest));
}

template <class L>
void fill_entries(L list, const std::vector<Entry>& entries) {
  for (unsigned i = 0; i < entries.size(); ++i) {
    fill(list[i], entries[i]);
    if (!entries[i].data.empty()) list[i].setData(bytes_of(entries[i].data));
  }
}

Encoded flatten(capnp::MessageBuilder& msg) {
  auto words = capnp::messageToFlatArray(msg);
  Encoded out;
  out.size = words.size() * sizeof(capnp::word);
  out.words.resize(words.size());
  std::memcpy(out.words.data(), words.begin(), out.size);
  return out;
}

bool text_ok(capnp::Text::Reader t, const char* what, std::string* why) {
  return wire::check_text({t.cStr(), t.size()}, what, why);
}

template <class ListReader>
bool read_entries(ListReader list, std::vector<Entry>& out, std::string* why) {
  if (list.size() > max_entries) {
    set_why(why, "message carries " + std::to_string(list.size()) + " entries, more than " +
                     std::to_string(max_entries));
    return false;
  }
  out.resize(list.size());
  for (unsigned i = 0; i < list.size(); ++i) {
    auto e = list[i];
    if (!text_ok(e.getPath(), "entry path", why) || !text_ok(e.getTarget(), "symlink target", why) ||
        !text_ok(e.getMessage(), "entry message", why))
      return false;
    const auto t = static_cast<unsigned>(e.getType());
    if (t > static_cast<unsigned>(Type::other)) {
      set_why(why, "unknown entry type " + std::to_string(t));
      return false;
    }
    if (e.getSize() > wire::max_file_size || e.getOffset() > wire::max_file_size) {
      set_why(why, "entry size " + std::to_string(e.getSize()) + " or offset " + std::to_string(e.getOffset()) +
                       " exceeds the protocol's limit of 2^62 bytes");
      return false;
    }
    auto& o = out[i];
    o.path = e.getPath().cStr();
    o.type = static_cast<Type>(t);
    o.size = e.getSize();
    o.mode = e.getMode() & 07777;
    o.mtime_ns = e.getMtimeNs();
    o.target = e.getTarget().cStr();
    o.offset = e.getOffset();
    o.file_id = e.getFileId();
    o.code = e.getCode() == 0 ? errc::ok : errc_from_wire(e.getCode());
    o.message = text::escape(e.getMessage().cStr());  // a human message: one printable line
    auto d = e.getData();
    o.data = {d.begin(), d.size()};
  }
  return true;
}

template <class Root, class Fn>
auto read_message(std::span<const std::uint8_t> b, std::string* why, Fn&& fn)
    -> decltype(fn(std::declval<typename Root::Reader>())) {
  if (b.empty() || b.size() % sizeof(capnp::word) != 0) {
    set_why(why, "path message of " + std::to_string(b.size()) + " bytes is not a whole message");
    return std::nullopt;
  }
  if (reinterpret_cast<std::uintptr_t>(b.data()) % alignof(capnp::word) != 0) {
    set_why(why, "path message buffer is not word-aligned");
    return std::nullopt;
  }
  kj::ArrayPtr<const capnp::word> words(reinterpret_cast<const capnp::word*>(b.data()), b.size() / sizeof(capnp::word));
  capnp::ReaderOptions opts;
  // Data blobs count towards the limit: a message can be read about twice, no more.
  opts.traversalLimitInWords = 2 * words.size() + 1024;
  opts.nestingLimit = 8;
  try {
    capnp::FlatArrayMessageReader reader(words, opts);
    return fn(reader.getRoot<Root>());
  } catch (const kj::Exception& e) {
    set_why(why, std::string("malformed path message: ") + e.getDescription().cStr());
    return std::nullopt;
  }
}

}  // namespace

const char* to_string(Type t) noexcept {
  switch (t) {
    case Type::file: return "file";
    case Type::directory: return "directory";
    case Type::symlink: return "symlink";
    case Type::other: return "other";
  }
  return "?";
}

const char* to_string(Op o) noexcept {
  switch (o) {
    case Op::stat: return "stat";
    case Op::list: return "list";
    case Op::mkdir: return "mkdir";
    case Op::remove: return "remove";
    case Op::rename: return "rename";
    case Op::checksum: return "checksum";
    case Op::put: return "put";
    case Op::get: return "get";
    case Op::set_attrs: return "setattrs";
  }
  return "?";
}

namespace {
template <class Root, class Message>
Encoded encode_as(const Message& r) {
  capnp::MallocMessageBuilder msg;
  auto b = msg.initRoot<Root>();
  fill(b, r);
  if (!r.entries.empty()) fill_entries(b.initEntries(static_cast<unsigned>(r.entries.size())), r.entries);
  return flatten(msg);
}
}  // namespace

Encoded encode(const Request& r) { return encode_as<s::Request>(r); }
Encoded encode(const Reply& r) { return encode_as<s::Reply>(r); }

std::optional<Request> decode_request(std::span<const std::uint8_t> buf, std::string* why) {
  return read_message<s::Request>(buf, why, [&](s::Request::Reader m) -> std::optional<Request> {
    const auto op = static_cast<unsigned>(m.getOp());
    if (op > static_cast<unsigned>(Op::set_attrs)) {
      set_why(why, "unknown path operation " + std::to_string(op));
      return std::nullopt;
    }
    if (!text_ok(m.getPath(), "path", why) || !text_ok(m.getTo(), "target path", why)) return std::nullopt;
    Request r;
    r.id = m.getId();
    r.op = static_cast<Op>(op);
    r.path = m.getPath().cStr();
    r.to = m.getTo().cStr();
    r.recursive = m.getRecursive();
    r.offset = m.getOffset();
    r.length = m.getLength();
    r.mode = m.getMode() & 07777;
    r.block_size = m.getBlockSize();
    if (!read_entries(m.getEntries(), r.entries, why)) return std::nullopt;
    return r;
  });
}

std::optional<Reply> decode_reply(std::span<const std::uint8_t> buf, std::string* why) {
  return read_message<s::Reply>(buf, why, [&](s::Reply::Reader m) -> std::optional<Reply> {
    if (m.getMessage().size() > max_entries || m.getAlgorithm().size() > 64 || m.getDigest().size() > 64) {
      set_why(why, "path reply with an oversized message, algorithm or digest");
      return std::nullopt;
    }
    Reply r;
    r.id = m.getId();
    r.code = m.getCode() == 0 ? errc::ok : errc_from_wire(m.getCode());
    r.message = text::escape(m.getMessage().cStr());
    r.last = m.getLast();
    r.algorithm = m.getAlgorithm().cStr();
    auto d = m.getDigest();
    r.digest.assign(d.begin(), d.end());
    if (!read_entries(m.getEntries(), r.entries, why)) return std::nullopt;
    return r;
  });
}

// The message is built in one segment placed right after a one-word segment table, so that
// the finished buffer is the frame payload as it stands (no flattening copy).
struct Writer::Impl {
  std::vector<std::uint64_t> buf;
  std::unique_ptr<capnp::MallocMessageBuilder> msg;
  s::Request::Builder req{nullptr};
  s::Reply::Builder rep{nullptr};
  capnp::List<s::Entry>::Builder entries{nullptr};
  bool is_reply = false;

  Impl(std::size_t entry_count, std::size_t data_bytes) {
    const std::size_t words = 64 + entry_count * 40 + data_bytes / 8 + entry_count;
    buf.resize(words + 1);
    msg = std::make_unique<capnp::MallocMessageBuilder>(
        kj::arrayPtr(reinterpret_cast<capnp::word*>(buf.data() + 1), words));
  }
};

Writer::Writer(std::unique_ptr<Impl> p) : p_(std::move(p)) {}
Writer::Writer(Writer&&) noexcept = default;
Writer& Writer::operator=(Writer&&) noexcept = default;
Writer::~Writer() = default;

Writer Writer::request(std::uint64_t id, Op op, std::size_t entries, std::size_t data_bytes) {
  auto p = std::make_unique<Impl>(entries, data_bytes);
  p->req = p->msg->initRoot<s::Request>();
  p->req.setId(id);
  p->req.setOp(static_cast<s::Op>(op));
  p->entries = p->req.initEntries(static_cast<unsigned>(entries));
  return Writer(std::move(p));
}

Writer Writer::reply(std::uint64_t id, std::size_t entries, std::size_t data_bytes) {
  auto p = std::make_unique<Impl>(entries, data_bytes);
  p->is_reply = true;
  p->rep = p->msg->initRoot<s::Reply>();
  p->rep.setId(id);
  p->rep.setLast(true);
  p->entries = p->rep.initEntries(static_cast<unsigned>(entries));
  return Writer(std::move(p));
}

std::span<std::uint8_t> Writer::set(std::size_t i, const Entry& e, std::size_t data_size) {
  auto b = p_->entries[static_cast<unsigned>(i)];
  fill(b, e);
  if (data_size == 0) {
    if (b.hasData()) b.disownData();  // a failure after the bytes were reserved
    return {};
  }
  auto d = b.initData(static_cast<unsigned>(data_size));
  return {d.begin(), d.size()};
}

void Writer::set_result(errc code, const std::string& message) {
  if (!p_->is_reply) return;
  p_->rep.setCode(static_cast<std::uint32_t>(code));
  if (!message.empty()) p_->rep.setMessage(message);
}

Encoded Writer::finish() {
  auto segs = p_->msg->getSegmentsForOutput();
  auto* first = reinterpret_cast<const capnp::word*>(p_->buf.data() + 1);
  if (segs.size() == 1 && segs[0].begin() == first) {
    const std::uint64_t n = segs[0].size();
    p_->buf[0] = n << 32;  // segment count - 1 = 0, then the segment's size in words
    Encoded out;
    out.size = (1 + n) * sizeof(capnp::word);
    out.words = std::move(p_->buf);  // the heap block, and so the builder's segment, stays put
    out.keep = std::shared_ptr<capnp::MallocMessageBuilder>(std::move(p_->msg));
    return out;
  }
  return flatten(*p_->msg);
}

}  // namespace xdfs::pathm
