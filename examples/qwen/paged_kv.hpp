// examples/qwen/paged_kv.hpp: host-side bookkeeping of the paged KV cache (no CUDA; host-testable).
//
// The device pool is `num_blocks` fixed-size blocks allocated once; a sequence owns a list of
// blocks (its block-table row) and a length. Block 0 is reserved as a scratch block: padded batch
// rows point at the scratch slot, whose block-table row is all zeros, so their (ignored) K/V writes
// land there and never touch a live sequence. This class keeps the host image of the block table;
// the model pushes the rows that changed (`dirty range`) to the device table, whose address never
// changes, before the next step.
#pragma once

#include "config.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace qwen {

/// Bytes one KV block takes on the device: K and V, every layer, every kv head, `block_size` tokens.
inline std::int64_t kv_block_bytes(const Config& c, int block_size) {
  return 2LL * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * 2 /*bf16*/;
}

/// Bookkeeping of sequence slots, their block lists and lengths, and the free-block list.
///
/// Guarantees: a block is owned by at most one slot; block 0 is never handed out; every operation
/// that would exceed the pool or a slot's table width throws input_error and changes nothing.
///
/// Followers (tensor parallel, tp.hpp): every rank's engine keeps its own book and pushes its own
/// device table. Rank 0's book leads: each acquire_slot, ensure and release applied to it is then
/// applied to its followers (the other ranks' books, built with the same sizes and never changed
/// directly), so every book holds the same slots, blocks, lengths and dirty range. clear_dirty()
/// is each book's own.
class PagedKvBook {
 public:
  PagedKvBook(int num_blocks, int block_size, int max_seqs, int max_blocks_per_seq)
      : num_blocks_(num_blocks), block_size_(block_size), max_seqs_(max_seqs), width_(max_blocks_per_seq),
        table_(static_cast<std::size_t>(max_seqs + 1) * max_blocks_per_seq, 0),
        blocks_(max_seqs), length_(max_seqs, 0), in_use_(max_seqs, false) {
    if (num_blocks < 2) throw input_error("KV cache: the memory budget gives " + std::to_string(num_blocks) +
                                          " blocks; at least 2 are needed (block 0 is scratch)");
    if (block_size <= 0 || max_seqs <= 0 || max_blocks_per_seq <= 0)
      throw input_error("KV cache: block size, sequence count and table width must be positive");
    for (int b = num_blocks - 1; b >= 1; --b) free_.push_back(b);  // pop_back gives 1, 2, 3, ...
    mark_dirty(0, static_cast<int>(table_.size()));
  }

  [[nodiscard]] int num_blocks() const { return num_blocks_; }
  [[nodiscard]] int block_size() const { return block_size_; }
  [[nodiscard]] int max_seqs() const { return max_seqs_; }
  [[nodiscard]] int table_width() const { return width_; }
  /// Tokens one slot can hold (its table width in blocks times the block size).
  [[nodiscard]] int max_tokens_per_seq() const { return width_ * block_size_; }
  [[nodiscard]] int free_blocks() const { return static_cast<int>(free_.size()); }
  /// The block-table row padded batch rows use: all zeros, i.e. the scratch block.
  [[nodiscard]] int scratch_slot() const { return max_seqs_; }
  [[nodiscard]] int blocks_for(int tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  /// Whether a new sequence of `tokens` total tokens (prompt + generation) fits right now.
  [[nodiscard]] bool can_admit(int tokens) const {
    return tokens <= max_tokens_per_seq() && blocks_for(tokens) <= free_blocks() && free_slot() >= 0;
  }

  /// Takes a free slot; throws input_error when all are in use.
  int acquire_slot() {
    const int s = free_slot();
    if (s < 0) throw input_error("KV cache: all " + std::to_string(max_seqs_) + " sequence slots are in use");
    in_use_[s] = true;
    length_[s] = 0;
    for (PagedKvBook* f : followers_) (void)f->acquire_slot();
    return s;
  }

  /// Makes positions [0, tokens) of `slot` backed by blocks (allocating as needed) and sets its length.
  void ensure(int slot, int tokens) {
    check_slot(slot);
    if (tokens > max_tokens_per_seq())
      throw input_error("KV cache: " + std::to_string(tokens) + " tokens exceed the per-sequence limit of " +
                        std::to_string(max_tokens_per_seq()));
    auto& bl = blocks_[slot];
    const int need = blocks_for(tokens) - static_cast<int>(bl.size());
    if (need > free_blocks())
      throw input_error("KV cache: out of blocks (" + std::to_string(need) + " needed, " +
                        std::to_string(free_blocks()) + " free); raise the KV memory budget");
    for (int i = 0; i < need; ++i) {
      const int b = free_.back();
      free_.pop_back();
      const int col = static_cast<int>(bl.size());
      bl.push_back(b);
      table_[static_cast<std::size_t>(slot) * width_ + col] = b;
      mark_dirty(slot * width_ + col, slot * width_ + col + 1);
    }
    length_[slot] = std::max(length_[slot], tokens);
    for (PagedKvBook* f : followers_) f->ensure(slot, tokens);
  }

  /// Returns the slot's blocks to the pool and frees the slot.
  void release(int slot) {
    check_slot(slot);
    auto& bl = blocks_[slot];
    for (auto it = bl.rbegin(); it != bl.rend(); ++it) free_.push_back(*it);
    std::fill_n(table_.begin() + static_cast<std::ptrdiff_t>(slot) * width_, bl.size(), 0);
    mark_dirty(slot * width_, slot * width_ + static_cast<int>(bl.size()));
    bl.clear();
    length_[slot] = 0;
    in_use_[slot] = false;
    for (PagedKvBook* f : followers_) f->release(slot);
  }

  /// Makes `f` follow this book (see the class comment). `f` must have been built with the same
  /// sizes, be unchanged since (or equal to this book), and outlive this book or stop following it
  /// first (clear_followers). Throws input_error for a book of other sizes or for this book itself.
  void add_follower(PagedKvBook& f) {
    if (&f == this || f.num_blocks_ != num_blocks_ || f.block_size_ != block_size_ || f.max_seqs_ != max_seqs_ ||
        f.width_ != width_)
      throw input_error("KV cache: a follower book must be another book of the same sizes");
    followers_.push_back(&f);
  }
  void clear_followers() { followers_.clear(); }

  [[nodiscard]] int length(int slot) const { return length_.at(slot); }
  [[nodiscard]] bool in_use(int slot) const { return in_use_.at(slot); }
  [[nodiscard]] const std::vector<int>& blocks(int slot) const { return blocks_.at(slot); }
  /// Physical block and offset of token `pos` of `slot`.
  [[nodiscard]] std::pair<int, int> locate(int slot, int pos) const {
    return {blocks_.at(slot).at(pos / block_size_), pos % block_size_};
  }

  /// Host image of the device block table: (max_seqs + 1) rows of table_width ints (last row: scratch).
  [[nodiscard]] const std::vector<std::int32_t>& table() const { return table_; }
  /// Half-open range of table entries changed since clear_dirty() (begin == end: nothing changed).
  [[nodiscard]] std::pair<int, int> dirty() const { return {dirty_begin_, dirty_end_}; }
  void clear_dirty() { dirty_begin_ = dirty_end_ = 0; }

 private:
  [[nodiscard]] int free_slot() const {
    for (int s = 0; s < max_seqs_; ++s)
      if (!in_use_[s]) return s;
    return -1;
  }
  void check_slot(int slot) const {
    if (slot < 0 || slot >= max_seqs_ || !in_use_[slot])
      throw input_error("KV cache: slot " + std::to_string(slot) + " is not in use");
  }
  void mark_dirty(int b, int e) {
    if (b >= e) return;
    if (dirty_begin_ == dirty_end_) {
      dirty_begin_ = b, dirty_end_ = e;
    } else {
      dirty_begin_ = std::min(dirty_begin_, b), dirty_end_ = std::max(dirty_end_, e);
    }
  }

  int num_blocks_, block_size_, max_seqs_, width_;
  std::vector<std::int32_t> table_;
  std::vector<std::vector<int>> blocks_;
  std::vector<int> length_;
  std::vector<bool> in_use_;
  std::vector<int> free_;
  int dirty_begin_ = 0, dirty_end_ = 0;
  std::vector<PagedKvBook*> followers_;  // not owned
};

}  // namespace qwen
