// A set of disjoint byte ranges: which parts of a file have arrived. It grows with the ranges
// that actually arrived (neighbours merge), never with a size a peer announced.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>

namespace xdfs {

class RangeSet {
public:
  /// Adds [begin, end); false (and nothing added) if it overlaps a range already there or is
  /// empty or reversed.
  bool insert(std::uint64_t begin, std::uint64_t end);
  /// Takes [begin, end) out again; false (and nothing changed) unless all of it is there.
  bool erase(std::uint64_t begin, std::uint64_t end);
  /// Whether any byte of [begin, end) is there.
  bool overlaps(std::uint64_t begin, std::uint64_t end) const;
  /// Bytes covered.
  std::uint64_t covered() const noexcept { return covered_; }
  /// Disjoint runs held (what the set costs in memory).
  std::size_t runs() const noexcept { return runs_.size(); }
  /// True when [0, size) is covered exactly.
  bool complete(std::uint64_t size) const noexcept;
  void clear() noexcept {
    runs_.clear();
    covered_ = 0;
  }

private:
  std::map<std::uint64_t, std::uint64_t> runs_;  // begin -> end
  std::uint64_t covered_ = 0;
};

}  // namespace xdfs
