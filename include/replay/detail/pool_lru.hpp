// replay/detail/pool_lru.hpp: an intrusive doubly linked recency list (most recent at the front).
//
// The graph pool keeps one node per resident graph inside its hash-map entries, so touching,
// inserting and removing are O(1) pointer moves with no allocation. Nodes must not move while
// linked (std::unordered_map guarantees stable element addresses).
#pragma once

#include <cstddef>

namespace replay::detail {

/// Links embedded in a node of an intrusive_lru.
struct lru_hook {
  lru_hook* prev = nullptr;
  lru_hook* next = nullptr;
  bool linked = false;
};

/// Recency order over lru_hook nodes: front() is the most recently used, back() the least.
class intrusive_lru {
 public:
  intrusive_lru() noexcept = default;
  intrusive_lru(const intrusive_lru&) = delete;
  intrusive_lru& operator=(const intrusive_lru&) = delete;
  intrusive_lru(intrusive_lru&& o) noexcept : head_(o.head_), tail_(o.tail_), size_(o.size_) {
    o.head_ = o.tail_ = nullptr;
    o.size_ = 0;
  }

  [[nodiscard]] lru_hook* front() const noexcept { return head_; }
  [[nodiscard]] lru_hook* back() const noexcept { return tail_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  /// Links an unlinked node at the front.
  void push_front(lru_hook* n) noexcept {
    n->prev = nullptr;
    n->next = head_;
    if (head_ != nullptr) head_->prev = n;
    head_ = n;
    if (tail_ == nullptr) tail_ = n;
    n->linked = true;
    ++size_;
  }

  /// Unlinks a linked node.
  void erase(lru_hook* n) noexcept {
    if (!n->linked) return;
    if (n->prev != nullptr) n->prev->next = n->next; else head_ = n->next;
    if (n->next != nullptr) n->next->prev = n->prev; else tail_ = n->prev;
    n->prev = n->next = nullptr;
    n->linked = false;
    --size_;
  }

  /// Moves a linked node to the front (most recently used).
  void touch(lru_hook* n) noexcept {
    if (head_ == n) return;
    erase(n);
    push_front(n);
  }

 private:
  lru_hook* head_ = nullptr;
  lru_hook* tail_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace replay::detail
