// Host tests of bucket policies: the bucket lists, pad(), and the padding-waste figures the
// decode-optimization article quotes (25% for powers of two, ~4% for every-8 buckets).
#include <doctest/doctest.h>
#include <replay/bucket.hpp>

#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <vector>

namespace {
std::vector<std::size_t> sizes_of(const replay::bucket_policy& p) {
  return {p.sizes().begin(), p.sizes().end()};
}
}  // namespace

TEST_CASE("powers of two: buckets, pad, max that is not a power of two") {
  const auto p = replay::bucket_policy::powers_of_two(512);
  CHECK(sizes_of(p) == std::vector<std::size_t>{1, 2, 4, 8, 16, 32, 64, 128, 256, 512});
  CHECK(p.count() == 10);
  CHECK(p.smallest() == 1);
  CHECK(p.largest() == 512);
  CHECK(p.pad(1) == 1);
  CHECK(p.pad(3) == 4);
  CHECK(p.pad(5) == 8);
  CHECK(p.pad(64) == 64);
  CHECK(p.pad(65) == 128);
  CHECK(p.pad(512) == 512);
  CHECK_FALSE(p.pad(513).has_value());
  CHECK(p.fits(512));
  CHECK_FALSE(p.fits(513));
  CHECK_FALSE(p.fits(0));
  CHECK(p.scheme() == replay::bucket_scheme::powers_of_two);

  const auto q = replay::bucket_policy::powers_of_two(48);
  CHECK(sizes_of(q) == std::vector<std::size_t>{1, 2, 4, 8, 16, 32, 48});
  CHECK(q.pad(33) == 48);
  CHECK(sizes_of(replay::bucket_policy::powers_of_two(1)) == std::vector<std::size_t>{1});
}

TEST_CASE("every N up to max") {
  const auto p = replay::bucket_policy::every(8, 64);
  CHECK(sizes_of(p) == std::vector<std::size_t>{8, 16, 24, 32, 40, 48, 56, 64});
  CHECK(p.pad(1) == 8);
  CHECK(p.pad(9) == 16);
  CHECK(p.pad(64) == 64);
  CHECK_FALSE(p.pad(65));
  CHECK(p.step() == 8);
  CHECK(sizes_of(replay::bucket_policy::every(8, 20)) == std::vector<std::size_t>{8, 16, 20});
  CHECK(sizes_of(replay::bucket_policy::every(8, 5)) == std::vector<std::size_t>{5});
  CHECK(sizes_of(replay::bucket_policy::every(1, 4)) == std::vector<std::size_t>{1, 2, 3, 4});
}

TEST_CASE("explicit list: sorted, deduplicated, validated") {
  const auto p = replay::bucket_policy::list({10, 1, 3, 10, 3});
  CHECK(sizes_of(p) == std::vector<std::size_t>{1, 3, 10});
  CHECK(p.pad(2) == 3);
  CHECK(p.pad(4) == 10);
  CHECK_FALSE(p.pad(11));
  CHECK(p.describe() == "buckets {1, 3, 10}");
  CHECK_THROWS_AS(replay::bucket_policy::list(std::vector<std::size_t>{}), replay::usage_error);
  CHECK_THROWS_AS(replay::bucket_policy::list({0, 4}), replay::usage_error);
}

TEST_CASE("vLLM default: 1, 2, 4, then every 8") {
  const auto p = replay::bucket_policy::vllm_default(512);
  CHECK(p.count() == 67);
  CHECK(p.sizes()[0] == 1);
  CHECK(p.sizes()[1] == 2);
  CHECK(p.sizes()[2] == 4);
  CHECK(p.sizes()[3] == 8);
  CHECK(p.sizes()[4] == 16);
  CHECK(p.largest() == 512);
  CHECK(p.pad(3) == 4);
  CHECK(p.pad(5) == 8);
  CHECK(p.pad(100) == 104);
  CHECK(replay::bucket_policy{} == p);  // the default policy
  CHECK(sizes_of(replay::bucket_policy::vllm_default(2)) == std::vector<std::size_t>{1, 2});
  CHECK(sizes_of(replay::bucket_policy::vllm_default(12)) == std::vector<std::size_t>{1, 2, 4, 8, 12});
}

TEST_CASE("invalid arguments are usage errors") {
  CHECK_THROWS_AS(replay::bucket_policy::powers_of_two(0), replay::usage_error);
  CHECK_THROWS_AS(replay::bucket_policy::every(0, 64), replay::usage_error);
  CHECK_THROWS_AS(replay::bucket_policy::every(8, 0), replay::usage_error);
  CHECK_THROWS_AS(replay::bucket_policy::vllm_default(0), replay::usage_error);
  const auto p = replay::bucket_policy::powers_of_two(8);
  CHECK_THROWS_AS((void)p.pad(0), replay::usage_error);
  CHECK_THROWS_WITH_AS((void)p.bucket_for(9), doctest::Contains("exceeds the largest bucket (8)"),
                       replay::usage_error);
  CHECK_THROWS_AS((void)p.waste(9), replay::usage_error);
}

TEST_CASE("waste per batch size") {
  const auto p = replay::bucket_policy::powers_of_two(512);
  CHECK(p.padding(5) == 3);
  CHECK(p.waste(5) == doctest::Approx(3.0 / 8.0));
  CHECK(p.waste(8) == 0.0);
  CHECK(p.waste(129) == doctest::Approx(127.0 / 256.0));
  const auto e = replay::bucket_policy::every(8, 512);
  CHECK(e.padding(1) == 7);
  CHECK(e.waste(17) == doctest::Approx(7.0 / 24.0));
}

TEST_CASE("average waste over 1..512: the article's 25% (powers of two) and ~4% (every 8)") {
  const auto pow2 = replay::bucket_policy::powers_of_two(512).average_waste(512);
  MESSAGE(fmt::format("powers of two: mean waste {:.4f}, padded-row share {:.4f}", pow2.mean_waste,
                      pow2.padded_row_share));
  CHECK(pow2.mean_waste == doctest::Approx(0.2451171875));  // exact: 251/1024
  CHECK(std::abs(pow2.mean_waste - 0.25) < 0.01);
  CHECK(pow2.padded_row_share == doctest::Approx(0.2485).epsilon(0.001));
  CHECK(pow2.oversize_share == 0.0);

  const auto step8 = replay::bucket_policy::every(8, 512).average_waste(512);
  MESSAGE(fmt::format("every 8: mean waste {:.4f}, padded-row share {:.4f}", step8.mean_waste,
                      step8.padded_row_share));
  CHECK(step8.mean_waste == doctest::Approx(0.03243).epsilon(0.001));
  CHECK(step8.mean_waste > 0.02);
  CHECK(step8.mean_waste < 0.045);  // "about 4%"
  CHECK(step8.padded_row_share == doctest::Approx(1792.0 / 133120.0));

  const auto vllm = replay::bucket_policy::vllm_default(512).average_waste(512);
  CHECK(vllm.mean_waste < step8.mean_waste);  // the small buckets help tiny batches
  CHECK(vllm.mean_waste == doctest::Approx(0.02755).epsilon(0.001));

  // Coarser is worse, finer is better (the article's every-16 / every-4 rows).
  const double w16 = replay::bucket_policy::every(16, 512).average_waste(512).mean_waste;
  const double w4 = replay::bucket_policy::every(4, 512).average_waste(512).mean_waste;
  CHECK(w16 > step8.mean_waste);
  CHECK(w4 < step8.mean_waste);
}

TEST_CASE("average waste over a distribution, with oversize batches") {
  const auto p = replay::bucket_policy::powers_of_two(8);
  std::vector<double> w(11, 0.0);
  w[3] = 1.0;  // pads to 4: waste 1/4
  w[5] = 3.0;  // pads to 8: waste 3/8
  const auto s = p.average_waste(w);
  CHECK(s.mean_waste == doctest::Approx((1.0 * 0.25 + 3.0 * 0.375) / 4.0));
  CHECK(s.padded_row_share == doctest::Approx((1.0 * 1 + 3.0 * 3) / (1.0 * 4 + 3.0 * 8)));
  CHECK(s.oversize_share == 0.0);

  w[10] = 4.0;  // above 8: oversize, excluded from the waste figures
  const auto t = p.average_waste(w);
  CHECK(t.oversize_share == doctest::Approx(0.5));
  CHECK(t.mean_waste == doctest::Approx(s.mean_waste));

  const auto u = p.average_waste(16);  // uniform 1..16: 9..16 do not fit
  CHECK(u.oversize_share == doctest::Approx(0.5));

  CHECK_THROWS_AS((void)p.average_waste(std::vector<double>(5, 0.0)), replay::usage_error);
  CHECK_THROWS_AS((void)p.average_waste(std::vector<double>{0.0, -1.0}), replay::usage_error);
}

TEST_CASE("describe and fmt") {
  CHECK(fmt::format("{}", replay::bucket_policy::powers_of_two(512)) == "powers of two up to 512 (10 buckets)");
  CHECK(fmt::format("{}", replay::bucket_policy::every(8, 64)) == "every 8 up to 64 (8 buckets)");
  CHECK(fmt::format("{}", replay::bucket_policy::vllm_default(64)) == "1, 2, 4 then every 8 up to 64 (11 buckets)");
}

TEST_CASE("generated policies with too many buckets are refused, never looped over") {
  constexpr std::size_t big = std::size_t{1} << 62;
  CHECK_THROWS_AS(replay::bucket_policy::every(1, SIZE_MAX), replay::usage_error);
  CHECK_THROWS_AS(replay::bucket_policy::vllm_default(SIZE_MAX), replay::usage_error);
  // A step near the top of the range: no wrap-around.
  const auto p = replay::bucket_policy::every(big, SIZE_MAX);
  CHECK(sizes_of(p) == std::vector<std::size_t>{big, 2 * big, 3 * big, SIZE_MAX});
  const auto q = replay::bucket_policy::powers_of_two(SIZE_MAX);
  CHECK(q.count() == 65);
  CHECK(q.largest() == SIZE_MAX);
  CHECK(replay::bucket_policy::every(8, 8 * replay::bucket_policy::max_buckets).count() ==
        replay::bucket_policy::max_buckets);
}

TEST_CASE("average_waste over a huge range is computed per bucket, and matches the loop") {
  const auto p = replay::bucket_policy::vllm_default(512);
  const auto w = p.average_waste(SIZE_MAX);  // returns at once
  CHECK(w.oversize_share == doctest::Approx(1.0));
  for (std::size_t max_n : {1u, 7u, 100u, 512u, 600u}) {
    double mean = 0, pad = 0, rows = 0;
    std::size_t fit = 0;
    for (std::size_t n = 1; n <= max_n; ++n) {
      const auto b = p.pad(n);
      if (!b) continue;
      ++fit;
      mean += double(*b - n) / double(*b);
      pad += double(*b - n);
      rows += double(*b);
    }
    const auto s = p.average_waste(max_n);
    CHECK(s.mean_waste == doctest::Approx(mean / double(fit)));
    CHECK(s.padded_row_share == doctest::Approx(pad / rows));
  }
}

TEST_CASE("average_waste refuses NaN and infinite weights") {
  const auto p = replay::bucket_policy::powers_of_two(8);
  const double nan = std::nan("");
  const double inf = HUGE_VAL;
  CHECK_THROWS_AS((void)p.average_waste(std::vector<double>{0, 1, nan}), replay::usage_error);
  CHECK_THROWS_AS((void)p.average_waste(std::vector<double>{0, inf, 1}), replay::usage_error);
  CHECK_THROWS_AS((void)p.average_waste(std::vector<double>{0, 1e308, 1e308}), replay::usage_error);
}
