// replay/bucket.hpp: batch-size buckets, padding, and padding waste.
//
// A captured graph has fixed shapes, so a decode engine captures one graph per *bucket* and pads a
// batch of `n` rows up to the smallest bucket that holds it (the extra rows are dummies whose
// results are ignored). `bucket_policy` is the list of buckets with the arithmetic around it:
//
// | policy                             | buckets                                  |
// |------------------------------------|------------------------------------------|
// | `powers_of_two(512)`               | 1, 2, 4, ..., 512                        |
// | `every(8, 512)`                    | 8, 16, 24, ..., 512                      |
// | `list({1, 3, 10})`                 | exactly those (sorted, duplicates merged) |
// | `vllm_default(512)` (the default)  | 1, 2, 4, then every 8: 8, 16, ..., 512   |
//
// When `max` is not itself a bucket of the series (`powers_of_two(48)`), `max` is added as the last
// bucket, so every n in 1..max fits. `pad(n)` returns the bucket or an empty optional when n is
// above the largest bucket (the caller then runs eagerly or refuses, see runner.hpp).
//
// Waste: a batch of n rows padded to bucket b computes b - n useless rows; `waste(n)` is the
// fraction (b - n) / b. `average_waste(512)` averages it over n = 1..512 (uniform);
// `average_waste(weights)` does the same for any distribution of batch sizes.
//
// Guarantees: a policy is an immutable, sorted, duplicate-free, non-empty list of positive sizes;
// construction with an invalid argument (max 0, step 0, empty list, a zero size, more than
// `max_buckets` generated buckets) throws usage_error; average_waste() refuses NaN, infinite or
// negative weights. pad() is O(log buckets), allocation-free and noexcept for n >= 1. Thread safety:
// immutable, so safe to share.
//
// Example:
//   auto buckets = replay::bucket_policy::vllm_default(256);
//   if (auto b = buckets.pad(batch)) { /* pad rows up to *b, replay the graph for *b */ }
//   else { /* batch > 256: run eagerly */ }
//   fmt::print("{}: mean waste {:.1f}%\n", buckets, 100 * buckets.average_waste(256).mean_waste);
#pragma once

#include <replay/error.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace replay {

/// How a bucket_policy was built (for printing; the buckets themselves are in sizes()).
enum class bucket_scheme : std::uint8_t {
  powers_of_two,  ///< 1, 2, 4, ... up to max
  every_n,        ///< step, 2*step, ... up to max
  list,           ///< an explicit list
  vllm_default,   ///< 1, 2, 4, then every 8 up to max
};

/// Padding waste of a bucket policy over a distribution of batch sizes.
struct waste_summary {
  /// Mean over batch sizes n (weighted) of (bucket(n) - n) / bucket(n): the share of a padded
  /// step's rows that are padding, averaged per step.
  double mean_waste = 0.0;
  /// Sum of padding rows over sum of computed rows (weighted): the share of all computed rows that
  /// are padding. Smaller than mean_waste when large batches dominate.
  double padded_row_share = 0.0;
  /// Weight share of batch sizes above the largest bucket (not padded; they run eagerly). The two
  /// figures above are over the batch sizes that fit.
  double oversize_share = 0.0;
};

/// An immutable, sorted list of bucket sizes with padding arithmetic.
class bucket_policy {
 public:
  /// Most buckets a generated policy (every, vllm_default) may have: each bucket is a graph.
  static constexpr std::size_t max_buckets = std::size_t{1} << 16;

  /// 1, 2, 4, ..., the largest power of two <= max, then max itself if it is not a power of two.
  [[nodiscard]] static bucket_policy powers_of_two(std::size_t max) {
    require_positive(max, "powers_of_two: max");
    std::vector<std::size_t> v;
    for (std::size_t b = 1; b <= max && b != 0; b <<= 1) v.push_back(b);
    if (v.back() != max) v.push_back(max);
    return bucket_policy(bucket_scheme::powers_of_two, std::move(v), 0);
  }

  /// step, 2*step, ..., then max itself if it is not a multiple of step. Batches smaller than
  /// `step` pad to `step` (use vllm_default() for small buckets below 8).
  [[nodiscard]] static bucket_policy every(std::size_t step, std::size_t max) {
    require_positive(step, "every: step");
    require_positive(max, "every: max");
    require_count(max / step, "every");
    std::vector<std::size_t> v;
    for (std::size_t b = step; b <= max && b >= step; b += step) v.push_back(b);  // b >= step: no wrap
    if (v.empty() || v.back() != max) v.push_back(max);
    return bucket_policy(bucket_scheme::every_n, std::move(v), step);
  }

  /// Exactly the given sizes (sorted, duplicates merged). Throws usage_error on an empty list or a
  /// zero size.
  [[nodiscard]] static bucket_policy list(std::vector<std::size_t> sizes) {
    if (sizes.empty()) throw usage_error("replay::bucket_policy::list: the list of buckets is empty");
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    if (sizes.front() == 0) throw usage_error("replay::bucket_policy::list: a bucket size is 0");
    return bucket_policy(bucket_scheme::list, std::move(sizes), 0);
  }
  [[nodiscard]] static bucket_policy list(std::initializer_list<std::size_t> sizes) {
    return list(std::vector<std::size_t>(sizes));
  }

  /// vLLM's decode buckets: 1, 2, 4, then 8, 16, 24, ... up to max (max added if not a multiple of
  /// 8). vllm_default(512) has 67 buckets.
  [[nodiscard]] static bucket_policy vllm_default(std::size_t max = 512) {
    require_positive(max, "vllm_default: max");
    require_count(max / 8, "vllm_default");
    std::vector<std::size_t> v;
    for (std::size_t b : {1, 2, 4})
      if (b <= max) v.push_back(b);
    for (std::size_t b = 8; b <= max && b >= 8; b += 8) v.push_back(b);
    if (v.back() != max) v.push_back(max);
    return bucket_policy(bucket_scheme::vllm_default, std::move(v), 8);
  }

  /// The default policy: vllm_default(512).
  bucket_policy() : bucket_policy(vllm_default()) {}

  /// The smallest bucket >= n, or empty when n is above the largest bucket. Throws usage_error for
  /// n == 0 (a batch has at least one row).
  [[nodiscard]] std::optional<std::size_t> pad(std::size_t n) const {
    if (n == 0) [[unlikely]]
      throw usage_error("replay::bucket_policy::pad: a batch of 0 rows has no bucket");
    if (n > sizes_.back()) return std::nullopt;
    return *std::lower_bound(sizes_.begin(), sizes_.end(), n);
  }
  /// True when n (>= 1) fits in a bucket.
  [[nodiscard]] bool fits(std::size_t n) const noexcept { return n >= 1 && n <= sizes_.back(); }
  /// The bucket for n; throws usage_error when n is 0 or above the largest bucket.
  [[nodiscard]] std::size_t bucket_for(std::size_t n) const {
    const auto b = pad(n);
    if (!b)
      throw usage_error(fmt::format("replay::bucket_policy: a batch of {} rows exceeds the largest "
                                    "bucket ({})", n, largest()));
    return *b;
  }

  /// Padding rows for a batch of n: bucket_for(n) - n.
  [[nodiscard]] std::size_t padding(std::size_t n) const { return bucket_for(n) - n; }
  /// Padding share of a batch of n: (bucket_for(n) - n) / bucket_for(n).
  [[nodiscard]] double waste(std::size_t n) const {
    const std::size_t b = bucket_for(n);
    return static_cast<double>(b - n) / static_cast<double>(b);
  }

  /// Waste averaged over batch sizes 1..max_n, each equally likely. O(buckets), whatever max_n.
  [[nodiscard]] waste_summary average_waste(std::size_t max_n) const {
    require_positive(max_n, "average_waste: max_n");
    double mean = 0.0, pad_rows = 0.0, rows = 0.0;
    std::size_t prev = 0;  // batch sizes prev+1 .. min(b, max_n) pad to bucket b
    for (const std::size_t b : sizes_) {
      if (prev >= max_n) break;
      const std::size_t hi = b < max_n ? b : max_n;
      const double m = static_cast<double>(hi - prev);      // batch sizes in this bucket
      const double lo_pad = static_cast<double>(b - hi);    // padding of the largest of them
      const double sum_pad = m * lo_pad + m * (m - 1.0) / 2.0;  // (b-hi) + ... + (b-prev-1)
      mean += sum_pad / static_cast<double>(b);
      pad_rows += sum_pad;
      rows += m * static_cast<double>(b);
      prev = b;
    }
    const double over = max_n > sizes_.back() ? static_cast<double>(max_n - sizes_.back()) : 0.0;
    return summarise(mean, pad_rows, rows, over, static_cast<double>(max_n));
  }

  /// Waste over a distribution: weights[n] is the relative frequency of a batch of n rows
  /// (weights[0] is ignored; weights need not sum to 1). Throws usage_error if all weights are 0
  /// or one is negative.
  [[nodiscard]] waste_summary average_waste(std::span<const double> weights) const {
    double mean = 0.0, pad_rows = 0.0, rows = 0.0, over = 0.0, total = 0.0;
    for (std::size_t n = 1; n < weights.size(); ++n) {
      const double w = weights[n];
      if (!std::isfinite(w) || w < 0.0)
        throw usage_error(fmt::format("replay::bucket_policy::average_waste: weight of {} is {} (must "
                                      "be finite and non-negative)", n, w));
      if (w == 0.0) continue;
      total += w;
      const auto b = pad(n);
      if (!b) {
        over += w;
        continue;
      }
      mean += w * static_cast<double>(*b - n) / static_cast<double>(*b);
      pad_rows += w * static_cast<double>(*b - n);
      rows += w * static_cast<double>(*b);
    }
    if (total <= 0.0)
      throw usage_error("replay::bucket_policy::average_waste: the weights are all zero");
    if (!std::isfinite(total))
      throw usage_error("replay::bucket_policy::average_waste: the weights' sum overflows");
    return summarise(mean, pad_rows, rows, over, total);
  }

  /// The buckets, ascending.
  [[nodiscard]] std::span<const std::size_t> sizes() const noexcept { return sizes_; }
  [[nodiscard]] std::size_t count() const noexcept { return sizes_.size(); }
  [[nodiscard]] std::size_t smallest() const noexcept { return sizes_.front(); }
  [[nodiscard]] std::size_t largest() const noexcept { return sizes_.back(); }
  [[nodiscard]] bucket_scheme scheme() const noexcept { return scheme_; }
  /// The step of every() (8 for vllm_default, 0 for the others).
  [[nodiscard]] std::size_t step() const noexcept { return step_; }

  /// A one-line description, e.g. "powers of two up to 512 (10 buckets)".
  [[nodiscard]] std::string describe() const {
    switch (scheme_) {
      case bucket_scheme::powers_of_two:
        return fmt::format("powers of two up to {} ({} buckets)", largest(), count());
      case bucket_scheme::every_n:
        return fmt::format("every {} up to {} ({} buckets)", step_, largest(), count());
      case bucket_scheme::vllm_default:
        return fmt::format("1, 2, 4 then every 8 up to {} ({} buckets)", largest(), count());
      case bucket_scheme::list:
        break;
    }
    std::string s = "buckets {";
    for (std::size_t i = 0; i < sizes_.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", sizes_[i]);
    return s + "}";
  }

  friend bool operator==(const bucket_policy& a, const bucket_policy& b) noexcept {
    return a.sizes_ == b.sizes_;
  }

 private:
  bucket_policy(bucket_scheme scheme, std::vector<std::size_t> sizes, std::size_t step)
      : scheme_(scheme), step_(step), sizes_(std::move(sizes)) {}

  static void require_positive(std::size_t v, const char* what) {
    if (v == 0) throw usage_error(fmt::format("replay::bucket_policy::{} must be at least 1", what));
  }
  static void require_count(std::size_t n, const char* what) {
    if (n > max_buckets)
      throw usage_error(fmt::format("replay::bucket_policy::{}: {} buckets exceed the limit of {}; "
                                    "use a larger step or a smaller max", what, n, max_buckets));
  }
  static waste_summary summarise(double mean, double pad_rows, double rows, double over,
                                 double total) noexcept {
    waste_summary w;
    const double fit = total - over;
    w.mean_waste = fit > 0.0 ? mean / fit : 0.0;
    w.padded_row_share = rows > 0.0 ? pad_rows / rows : 0.0;
    w.oversize_share = total > 0.0 ? over / total : 0.0;
    return w;
  }

  bucket_scheme scheme_;
  std::size_t step_;
  std::vector<std::size_t> sizes_;
};

}  // namespace replay

/// Prints bucket_policy::describe().
template <>
struct fmt::formatter<replay::bucket_policy> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(const replay::bucket_policy& p, Ctx& ctx) const {
    const std::string s = p.describe();
    return fmt::formatter<std::string_view>::format(std::string_view(s), ctx);
  }
};
