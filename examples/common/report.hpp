// common/report.hpp: statistics of repeated measurements and Markdown tables for the examples.
//
// Header-only (fmt). Used by the example decoders' --bench output so that their tables look alike.
//
//   replay_examples::stats s = replay_examples::summarize(samples_us);   // median, mean, p10/p90, ...
//   replay_examples::table t({"Config", "Eager tok/s", "Graph tok/s"});
//   t.add_row({"smoke_test", fmt::format("{:.1f}", a), fmt::format("{:.1f}", b)});
//   fmt::print("{}", t.markdown());
//
// Guarantees: summarize() of an empty sample returns all-zero stats with count 0 (never UB);
// percentiles use linear interpolation between closest ranks; table pads columns to align.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace replay_examples {

/// Summary of a sample of measurements (all in the unit of the input).
struct stats {
  std::size_t count = 0;  ///< number of measurements
  double min = 0;         ///< smallest
  double p10 = 0;         ///< 10th percentile
  double median = 0;      ///< 50th percentile
  double p90 = 0;         ///< 90th percentile
  double max = 0;         ///< largest
  double mean = 0;        ///< arithmetic mean
};

/// The q-quantile (0..1) of an already sorted sample, linear interpolation; 0 for an empty one.
inline double quantile_sorted(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0.0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const auto hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return quantile_sorted(v, 0.5);
}

inline stats summarize(std::vector<double> v) {
  stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.count = v.size();
  s.min = v.front();
  s.max = v.back();
  s.p10 = quantile_sorted(v, 0.10);
  s.median = quantile_sorted(v, 0.50);
  s.p90 = quantile_sorted(v, 0.90);
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return s;
}

/// A Markdown table with aligned columns.
class table {
 public:
  explicit table(std::vector<std::string> header) : header_(std::move(header)) {}
  table(std::initializer_list<std::string> header) : header_(header) {}

  /// Adds a row; it must have as many cells as the header.
  void add_row(std::vector<std::string> row) {
    if (row.size() != header_.size())
      throw std::invalid_argument(fmt::format("table row has {} cells, header has {}", row.size(),
                                              header_.size()));
    rows_.push_back(std::move(row));
  }
  [[nodiscard]] std::size_t rows() const noexcept { return rows_.size(); }

  /// The table as Markdown; the first column is left-aligned, the others right-aligned.
  [[nodiscard]] std::string markdown() const {
    std::vector<std::size_t> w(header_.size());
    for (std::size_t c = 0; c < header_.size(); ++c) {
      w[c] = std::max<std::size_t>(header_[c].size(), 3);
      for (const auto& r : rows_) w[c] = std::max(w[c], r[c].size());
    }
    std::string out;
    const auto line = [&](const std::vector<std::string>& cells) {
      out += '|';
      for (std::size_t c = 0; c < cells.size(); ++c)
        out += c == 0 ? fmt::format(" {:<{}} |", cells[c], w[c]) : fmt::format(" {:>{}} |", cells[c], w[c]);
      out += '\n';
    };
    line(header_);
    out += '|';
    for (std::size_t c = 0; c < header_.size(); ++c)
      out += c == 0 ? fmt::format(":{:-<{}}|", "", w[c] + 1) : fmt::format("{:-<{}}:|", "", w[c] + 1);
    out += '\n';
    for (const auto& r : rows_) line(r);
    return out;
  }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace replay_examples
