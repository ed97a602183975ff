// replay/graph_key.hpp: what a graph pool is keyed by.
//
// One decode step needs a different graph for every combination of the things that change the
// captured work: bucket (padded batch size), dtype, the shapes of the step metadata, any user
// setting. A pool key is any copyable type with `operator==` and a hash, either a `hash()` member
// returning std::size_t or a `std::hash<Key>` specialisation (the `graph_pool_key` concept), that
// compares equal to itself. It must include *everything* that changes the captured graph: two keys
// that compare equal share one graph. `graph_key` is a ready-made key (bucket, dtype tag, four user
// fields). Keys that fmt can format are printed as such in statistics; others as their hash.
//
// Guarantees: everything here is constexpr or pure, allocation-free except describe_key, and
// thread-safe.
//
// Example:
//   struct my_key {
//     std::uint32_t bucket;
//     bool top_k;
//     friend bool operator==(const my_key&, const my_key&) = default;
//     std::size_t hash() const noexcept { return replay::hash_values(bucket, top_k); }
//   };
//   static_assert(replay::graph_pool_key<my_key>);
#pragma once

#include <fmt/format.h>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>

namespace replay {

/// Mixes `v` into `seed` (64-bit finaliser of splitmix64; good avalanche for small integers).
[[nodiscard]] constexpr std::size_t hash_mix(std::size_t seed, std::uint64_t v) noexcept {
  std::uint64_t x = static_cast<std::uint64_t>(seed) ^ (v + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2));
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return static_cast<std::size_t>(x);
}

/// Combined hash of several values, each hashed with std::hash (for writing a key's hash()).
template <class... T>
[[nodiscard]] std::size_t hash_values(const T&... values) noexcept {
  std::size_t seed = 0x51ed2701u;
  ((seed = hash_mix(seed, static_cast<std::uint64_t>(std::hash<T>{}(values)))), ...);
  return seed;
}

/// A key type with a `hash()` member.
template <class K>
concept has_hash_member = requires(const K& k) {
  { k.hash() } -> std::convertible_to<std::size_t>;
};
/// A key type with a std::hash specialisation.
template <class K>
concept has_std_hash = requires(const K& k) {
  { std::hash<K>{}(k) } -> std::convertible_to<std::size_t>;
};
/// What a graph pool key must be: copyable, equality-comparable and hashable (member or std::hash).
template <class K>
concept graph_pool_key =
    std::copy_constructible<K> && std::equality_comparable<K> && (has_hash_member<K> || has_std_hash<K>);

/// The pool's default hasher: `key.hash()` when the key has one, else `std::hash<Key>`.
template <class K>
struct key_hash {
  [[nodiscard]] std::size_t operator()(const K& k) const noexcept {
    if constexpr (has_hash_member<K>)
      return static_cast<std::size_t>(k.hash());
    else
      return std::hash<K>{}(k);
  }
};

/// A ready-made key: bucket, a dtype tag and up to four user fields (metadata shapes, settings).
/// Unused fields stay 0. Everything that changes the captured graph must be in the key.
///
///   replay::graph_key{.bucket = 16, .dtype = 2, .fields = {max_blocks_per_seq, use_top_k}}
struct graph_key {
  std::uint32_t bucket = 0;              ///< padded batch size: rows the graph computes
  std::uint32_t dtype = 0;               ///< data-type tag (cast of a user enum; 0 = default)
  std::array<std::int64_t, 4> fields{};  ///< other graph-changing values (shapes, settings)

  friend constexpr bool operator==(const graph_key&, const graph_key&) noexcept = default;
  /// Hash of all members: each one multiplied by its own odd constant and rotated by its own
  /// amount (independent, so the CPU does them in parallel), then one 64-bit finaliser. (A
  /// collision never selects a wrong graph: the pool compares keys with operator==.)
  [[nodiscard]] constexpr std::size_t hash() const noexcept {
    const auto rotl = [](std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
    std::uint64_t h = ((static_cast<std::uint64_t>(bucket) << 32) | dtype) * 0x9e3779b97f4a7c15ULL;
    h ^= rotl(static_cast<std::uint64_t>(fields[0]) * 0xc2b2ae3d27d4eb4fULL, 13);
    h ^= rotl(static_cast<std::uint64_t>(fields[1]) * 0x165667b19e3779f9ULL, 29);
    h ^= rotl(static_cast<std::uint64_t>(fields[2]) * 0xd6e8feb86659fd93ULL, 41);
    h ^= rotl(static_cast<std::uint64_t>(fields[3]) * 0x9fb21c651e98df25ULL, 53);
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ULL;
    h ^= h >> 32;
    return static_cast<std::size_t>(h);
  }
};

/// How a key is named in statistics: fmt's formatting when the key is formattable, else its hash.
template <class K>
[[nodiscard]] std::string describe_key(const K& k) {
  if constexpr (fmt::is_formattable<K>::value)
    return fmt::format("{}", k);
  else
    return fmt::format("key#{:016x}", static_cast<std::uint64_t>(key_hash<K>{}(k)));
}

/// The size a key is sorted by in prewarm() (largest first): `key.bucket` when the key has such a
/// member, the key itself when it converts to std::size_t, else 0 (order kept).
struct key_size {
  template <class K>
  [[nodiscard]] std::size_t operator()(const K& k) const noexcept {
    if constexpr (requires { static_cast<std::size_t>(k.bucket); })
      return static_cast<std::size_t>(k.bucket);
    else if constexpr (std::is_convertible_v<K, std::size_t>)
      return static_cast<std::size_t>(k);
    else
      return 0;
  }
};

}  // namespace replay

/// std::hash for graph_key (the pool uses graph_key::hash() directly; this is for users' own maps).
template <>
struct std::hash<replay::graph_key> {
  std::size_t operator()(const replay::graph_key& k) const noexcept { return k.hash(); }
};

/// graph_key prints as "bucket 8, dtype 1, fields [128, 4]" (trailing zero fields omitted).
template <>
struct fmt::formatter<replay::graph_key> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(const replay::graph_key& k, Ctx& ctx) const {
    std::string s = fmt::format("bucket {}", k.bucket);
    if (k.dtype != 0) s += fmt::format(", dtype {}", k.dtype);
    std::size_t used = k.fields.size();
    while (used > 0 && k.fields[used - 1] == 0) --used;
    if (used > 0) {
      s += ", fields [";
      for (std::size_t i = 0; i < used; ++i) s += fmt::format("{}{}", i ? ", " : "", k.fields[i]);
      s += "]";
    }
    return fmt::formatter<std::string_view>::format(std::string_view(s), ctx);
  }
};
