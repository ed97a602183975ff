// Host tests for common/report.hpp and common/rng.hpp.
#include "common/report.hpp"
#include "common/rng.hpp"

#include <doctest/doctest.h>

#include <set>

using namespace replay_examples;

TEST_CASE("summarize: median, percentiles, empty input") {
  const stats s = summarize({5, 1, 3, 2, 4});
  CHECK(s.count == 5);
  CHECK(s.median == doctest::Approx(3));
  CHECK(s.min == 1);
  CHECK(s.max == 5);
  CHECK(s.mean == doctest::Approx(3));
  CHECK(median({1, 2, 3, 4}) == doctest::Approx(2.5));
  CHECK(summarize({}).count == 0);
}

TEST_CASE("markdown table aligns columns and rejects ragged rows") {
  table t({"Config", "tok/s"});
  t.add_row({"smoke_test", "580.2"});
  const std::string md = t.markdown();
  CHECK(md.find("| Config     | tok/s |") != std::string::npos);
  CHECK(md.find("| smoke_test | 580.2 |") != std::string::npos);
  CHECK_THROWS(t.add_row({"only one"}));
}

TEST_CASE("counter-based RNG: deterministic, in [0, 1), varies with seed and counter") {
  CHECK(uniform01(42, 7) == uniform01(42, 7));
  std::set<float> seen;
  for (std::uint64_t i = 0; i < 1000; ++i) {
    const float u = uniform01(1337, i);
    CHECK(u >= 0.0f);
    CHECK(u < 1.0f);
    seen.insert(u);
  }
  CHECK(seen.size() > 990);
  CHECK(uniform01(1, 0) != uniform01(2, 0));
}
