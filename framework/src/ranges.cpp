#include "xdfs/ranges.hpp"

namespace xdfs {

bool RangeSet::overlaps(std::uint64_t begin, std::uint64_t end) const {
  if (begin >= end) return false;
  auto it = runs_.lower_bound(end);  // first run starting at or after end: cannot overlap
  if (it == runs_.begin()) return false;
  --it;  // the last run starting before end
  return it->second > begin;
}

bool RangeSet::insert(std::uint64_t begin, std::uint64_t end) {
  if (begin >= end || overlaps(begin, end)) return false;
  auto next = runs_.lower_bound(begin);
  std::uint64_t b = begin, e = end;
  if (next != runs_.end() && next->first == end) {  // touches the run after it
    e = next->second;
    next = runs_.erase(next);
  }
  if (next != runs_.begin()) {
    auto prev = std::prev(next);
    if (prev->second == begin) {  // touches the run before it
      prev->second = e;
      covered_ += end - begin;
      return true;
    }
  }
  runs_.emplace_hint(next, b, e);
  covered_ += end - begin;
  return true;
}

bool RangeSet::erase(std::uint64_t begin, std::uint64_t end) {
  if (begin >= end) return false;
  auto it = runs_.upper_bound(begin);  // first run starting after begin
  if (it == runs_.begin()) return false;
  --it;  // the run that would hold begin
  if (it->second < end) return false;
  const std::uint64_t b = it->first, e = it->second;
  runs_.erase(it);
  if (b < begin) runs_.emplace(b, begin);
  if (end < e) runs_.emplace(end, e);
  covered_ -= end - begin;
  return true;
}

bool RangeSet::complete(std::uint64_t size) const noexcept {
  if (size == 0) return runs_.empty();
  return runs_.size() == 1 && runs_.begin()->first == 0 && runs_.begin()->second == size;
}

}  // namespace xdfs
