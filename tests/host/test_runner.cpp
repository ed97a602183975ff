// Host tests of the step runner under a fake backend: kill-switch parsing, eager fallback after a
// capture or replay failure (one warning, the step still runs), runner vs key fallback scope,
// oversize batches, and the statistics the runner feeds.
#include <doctest/doctest.h>
#include <env_guard.hpp>
#include <replay/runner.hpp>

#include "pool_fake_backend.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

using pool_fake::fake_backend;
using pool_fake::journal;
using replay::step_path;

namespace {

using runner_t = replay::basic_step_runner<replay::graph_key, fake_backend>;

replay::graph_key key_for(std::size_t bucket) {
  return replay::graph_key{.bucket = static_cast<std::uint32_t>(bucket)};
}

using replay_test::env_guard;

/// A runner over a fake backend whose step records what ran ("eager 8" / "captured 8") and can be
/// told to fail under capture for some buckets.
struct fixture {
  std::shared_ptr<journal> j = std::make_shared<journal>();
  std::vector<std::string> calls;
  std::vector<std::string> warnings;
  std::vector<std::uint32_t> bad_buckets;  // these throw under capture

  runner_t make(replay::runner_options o = {}) {
    o.warn = [this](std::string_view m) { warnings.emplace_back(m); };
    return runner_t(
        [this](int, const replay::graph_key& k) {
          for (auto b : bad_buckets)
            if (j->capturing && k.bucket == b)
              throw std::runtime_error(fmt::format("capture-unsafe call for bucket {}", b));
          calls.push_back(fmt::format("{} {}", j->capturing ? "captured" : "eager", k.bucket));
        },
        std::move(o), fake_backend(j));
  }
};

}  // namespace

TEST_CASE("kill switch parsing") {
  using replay::graphs_switch;
  using replay::parse_graphs_switch;
  constexpr graphs_switch on{true, true}, off{false, true}, unknown{true, false};
  static_assert(parse_graphs_switch("0") == off);  // usable at compile time
  CHECK(parse_graphs_switch(std::nullopt) == on);
  CHECK(parse_graphs_switch("") == on);
  CHECK(parse_graphs_switch("  ") == on);
  for (const char* v : {"0", "false", "FALSE", "False", "off", "OFF", "no", "No", " 0 ", "off\n"})
    CHECK_MESSAGE(parse_graphs_switch(v) == off, v);
  for (const char* v : {"1", "true", "TRUE", "on", "On", "yes", "YES", "\t1"})
    CHECK_MESSAGE(parse_graphs_switch(v) == on, v);
  for (const char* v : {"2", "disable", "nope", "00", "o f f", "-1", "enabled"})
    CHECK_MESSAGE(parse_graphs_switch(v) == unknown, v);
}

TEST_CASE("kill switch from the environment: parsed once, refreshable") {
  {
    env_guard g("0");
    CHECK_FALSE(replay::graphs_env().enabled);
    setenv(replay::graphs_env_var, "1", 1);
    CHECK_FALSE(replay::graphs_env().enabled);  // parsed once: still the old value
    CHECK(replay::refresh_graphs_env().enabled);
  }
  {
    env_guard g(nullptr);
    CHECK(replay::graphs_env().enabled);
    CHECK(replay::graphs_env().recognised);
  }
}

TEST_CASE("REPLAY_CUDA_GRAPHS=0: every runner runs eagerly, counted as disabled") {
  env_guard g("off");
  fixture f;
  auto r = f.make();
  CHECK_FALSE(r.graphs_enabled());
  for (int i = 0; i < 3; ++i) CHECK(r.run(key_for(8), 0, {.real = 5, .bucket = 8}) == step_path::eager_disabled);
  CHECK(f.calls == std::vector<std::string>{"eager 8", "eager 8", "eager 8"});
  CHECK(f.j->captures == 0);
  const auto s = r.stats();
  CHECK(s.eager_disabled == 3);
  CHECK(s.lookups() == 0);
  CHECK(s.real_rows == 15);
  CHECK(f.warnings.empty());  // switching graphs off is not a warning
  r.reenable_graphs();        // cannot override the kill switch
  CHECK_FALSE(r.graphs_enabled());
}

TEST_CASE("an unrecognised REPLAY_CUDA_GRAPHS value warns once and keeps graphs on") {
  env_guard g("maybe");
  fixture f;
  auto r1 = f.make();
  auto r2 = f.make();
  CHECK(r1.graphs_enabled());
  CHECK(r2.graphs_enabled());
  REQUIRE(f.warnings.size() == 1);  // once per process, not per runner
  CHECK(f.warnings[0].find("REPLAY_CUDA_GRAPHS='maybe'") != std::string::npos);
}

TEST_CASE("use_graphs = false turns one runner off") {
  env_guard g(nullptr);
  fixture f;
  auto r = f.make({.use_graphs = false});
  CHECK(r.run(key_for(4), 0) == step_path::eager_disabled);
  auto r2 = f.make();
  CHECK(r2.run(key_for(4), 0) == step_path::captured);
}

TEST_CASE("normal operation: capture once, then replay") {
  env_guard g(nullptr);
  fixture f;
  auto r = f.make({.pool = {.warmup = 1}});
  CHECK(r.run(key_for(8), 0) == step_path::captured);
  CHECK(r.run(key_for(8), 0) == step_path::replayed);
  CHECK(f.calls == std::vector<std::string>{"eager 8", "captured 8"});
  CHECK(f.j->launches == 2);
  CHECK(f.warnings.empty());
}

TEST_CASE("capture failure, runner scope: one warning, eager fallback, graphs off for the runner") {
  env_guard g(nullptr);
  fixture f;
  f.bad_buckets = {16};
  auto r = f.make({.pool = {.warmup = 1}});
  CHECK(r.run(key_for(8), 0) == step_path::captured);
  f.calls.clear();
  CHECK(r.run(key_for(16), 0, {.real = 9, .bucket = 16}) == step_path::eager_fallback);
  // Warm-up ran, the capture threw, then the step ran eagerly: the request was served.
  CHECK(f.calls == std::vector<std::string>{"eager 16", "eager 16"});
  REQUIRE(f.warnings.size() == 1);
  CHECK(f.warnings[0].find("capture failed for key bucket 16") != std::string::npos);
  CHECK(f.warnings[0].find("capture-unsafe call for bucket 16") != std::string::npos);
  CHECK_FALSE(r.graphs_enabled());
  CHECK(r.pool().size() == 0);  // graphs dropped (retired safely)

  // Every later step runs eagerly, including keys that had worked, with no new warning.
  f.calls.clear();
  CHECK(r.run(key_for(8), 0) == step_path::eager_fallback);
  CHECK(r.run(key_for(16), 0) == step_path::eager_fallback);
  CHECK(f.calls == std::vector<std::string>{"eager 8", "eager 16"});
  CHECK(f.warnings.size() == 1);
  const auto s = r.stats();
  CHECK(s.capture_failures == 1);
  CHECK(s.eager_fallbacks == 3);
  CHECK(s.real_rows >= 9);

  // Re-enabling: captures again; the failure mode already warned stays quiet.
  r.reenable_graphs();
  CHECK(r.run(key_for(8), 0) == step_path::captured);
  CHECK(r.run(key_for(16), 0) == step_path::eager_fallback);
  CHECK(f.warnings.size() == 1);
}

TEST_CASE("capture failure, key scope: only that key runs eagerly; one warning per key") {
  env_guard g(nullptr);
  fixture f;
  f.bad_buckets = {16, 32};
  auto r = f.make({.fallback = replay::fallback_scope::key});
  CHECK(r.run(key_for(16), 0) == step_path::eager_fallback);
  CHECK(r.run(key_for(16), 0) == step_path::eager_fallback);
  CHECK(r.run(key_for(8), 0) == step_path::captured);
  CHECK(r.run(key_for(8), 0) == step_path::replayed);
  CHECK(r.run(key_for(32), 0) == step_path::eager_fallback);
  CHECK(r.graphs_enabled());
  CHECK(r.key_disabled(key_for(16)));
  CHECK(r.key_disabled(key_for(32)));
  CHECK_FALSE(r.key_disabled(key_for(8)));
  REQUIRE(f.warnings.size() == 2);
  CHECK(f.warnings[0].find("bucket 16") != std::string::npos);
  CHECK(f.warnings[1].find("bucket 32") != std::string::npos);
  CHECK(f.warnings[0].find("steps with this key") != std::string::npos);
}

TEST_CASE("instantiate failure is reported as such") {
  env_guard g(nullptr);
  fixture f;
  f.j->fail_instantiate = true;
  auto r = f.make();
  CHECK(r.run(key_for(4), 0) == step_path::eager_fallback);
  REQUIRE(f.warnings.size() == 1);
  CHECK(f.warnings[0].find("instantiate failed") != std::string::npos);
}

TEST_CASE("replay failure: eager fallback, the request is not lost") {
  env_guard g(nullptr);
  fixture f;
  auto r = f.make({.pool = {.warmup = 0}});
  CHECK(r.run(key_for(4), 0) == step_path::captured);
  f.j->fail_launch = true;
  f.calls.clear();
  CHECK(r.run(key_for(4), 0) == step_path::eager_fallback);
  CHECK(f.calls == std::vector<std::string>{"eager 4"});
  REQUIRE(f.warnings.size() == 1);
  CHECK(f.warnings[0].find("replay failed") != std::string::npos);
  CHECK(r.stats().replay_failures == 1);
}

TEST_CASE("a step that fails eagerly propagates (no silent double run)") {
  env_guard g(nullptr);
  std::vector<std::string> warnings;
  runner_t r([](int, const replay::graph_key&) { throw std::invalid_argument("broken step"); },
             {.warn = [&](std::string_view m) { warnings.emplace_back(m); }},
             fake_backend());
  CHECK_THROWS_AS(r.run(key_for(4), 0), std::invalid_argument);
  CHECK(warnings.empty());
  CHECK(r.graphs_enabled());
}

TEST_CASE("the default warning sink is replaceable; an empty step is refused") {
  env_guard g(nullptr);
  fixture f;
  f.bad_buckets = {2};
  auto r = f.make();
  std::vector<std::string> other;
  r.set_warning_sink([&](std::string_view m) { other.emplace_back(m); });
  r.run(key_for(2), 0);
  CHECK(f.warnings.empty());
  CHECK(other.size() == 1);
  CHECK_THROWS_AS(runner_t(nullptr), replay::usage_error);
}

TEST_CASE("run_batch pads to the bucket; oversize runs eagerly or throws") {
  env_guard g(nullptr);
  fixture f;
  auto r = f.make({.buckets = replay::bucket_policy::powers_of_two(16)});
  CHECK(r.run_batch(5, 0, key_for) == step_path::captured);
  CHECK(r.run_batch(7, 0, key_for) == step_path::replayed);  // 5 and 7 share bucket 8
  CHECK(r.run_batch(16, 0, key_for) == step_path::captured);
  f.calls.clear();
  CHECK(r.run_batch(17, 0, key_for) == step_path::eager_oversize);
  CHECK(f.calls == std::vector<std::string>{"eager 17"});  // unpadded key for the eager run
  const auto s = r.stats();
  CHECK(s.real_rows == 5 + 7 + 16 + 17);
  CHECK(s.padded_rows == 8 + 8 + 16 + 17);
  CHECK(s.eager_oversize == 1);
  CHECK(s.padding_waste() == doctest::Approx(4.0 / 49.0));

  auto strict = f.make({.buckets = replay::bucket_policy::powers_of_two(16),
                        .oversize = replay::oversize_policy::throw_error});
  CHECK_THROWS_WITH_AS(strict.run_batch(17, 0, key_for), doctest::Contains("exceeds the largest bucket (16)"),
                       replay::usage_error);
}

TEST_CASE("prewarm_buckets captures every bucket, largest first; a failing bucket is disabled") {
  env_guard g(nullptr);
  fixture f;
  auto r = f.make({.pool = {.warmup = 1},
                   .buckets = replay::bucket_policy::list({1, 2, 4, 8}),
                   .fallback = replay::fallback_scope::key});
  f.bad_buckets = {2};
  CHECK(r.prewarm_buckets(0, key_for) == 3);
  CHECK(f.j->only("capture") ==
        std::vector<std::string>{"capture bucket 8", "capture bucket 4", "capture bucket 1"});
  CHECK(r.key_disabled(key_for(2)));
  CHECK(f.warnings.size() == 1);
  CHECK(r.stats().prewarmed == 3);
  CHECK(r.run(key_for(4), 0) == step_path::replayed);
  CHECK(r.run(key_for(2), 0) == step_path::eager_fallback);

  auto small = f.make({.pool = {.capacity = 2}, .buckets = replay::bucket_policy::list({1, 2, 4})});
  CHECK_THROWS_AS(small.prewarm_buckets(0, key_for), replay::usage_error);
}

TEST_CASE("the runner is move-constructible") {
  env_guard g(nullptr);
  fixture f;
  auto r = f.make();
  r.run(key_for(8), 0);
  runner_t moved = std::move(r);
  CHECK(moved.run(key_for(8), 0) == step_path::replayed);
}

TEST_CASE("an exception not derived from std::exception under capture still falls back to eager") {
  env_guard g(nullptr);
  fixture f;
  auto r = runner_t(
      [&](int, const replay::graph_key& k) {
        if (f.j->capturing) throw 42;  // not a std::exception
        f.calls.push_back(fmt::format("eager {}", k.bucket));
      },
      {.warn = [&](std::string_view m) { f.warnings.emplace_back(m); }}, fake_backend(f.j));
  CHECK(r.run(key_for(8), 0) == step_path::eager_fallback);
  CHECK(f.calls.back() == "eager 8");
  REQUIRE(f.warnings.size() == 1);
  CHECK(f.warnings[0].find("not derived from std::exception") != std::string::npos);
}

TEST_CASE("runner.prewarm de-duplicates keys before checking the capacity") {
  env_guard g(nullptr);
  fixture f;
  auto r = f.make({.pool = {.capacity = 2}});
  const std::vector<replay::graph_key> keys{key_for(8), key_for(8), key_for(4), key_for(4), key_for(8)};
  CHECK(r.prewarm(keys, 0) == 2);
  CHECK(r.stats().prewarmed == 2);
  CHECK(r.prewarm(keys, 0) == 0);  // resident keys are not counted again
  const std::vector<replay::graph_key> three{key_for(1), key_for(2), key_for(4)};
  CHECK_THROWS_AS(r.prewarm(three, 0), replay::usage_error);  // 2 new + 2 resident > 2
}

TEST_CASE("misuse of the runner's own pool from its step propagates as usage_error") {
  env_guard g(nullptr);
  fixture f;
  runner_t* self = nullptr;
  auto r = runner_t(
      [&](int s, const replay::graph_key& k) {
        if (k.bucket == 8) (void)self->pool().run(key_for(4), s, [](int) {});
      },
      {}, fake_backend(f.j));
  self = &r;
  CHECK_THROWS_AS(r.run(key_for(8), 0), replay::usage_error);
  CHECK(r.graphs_enabled());  // misuse is not a graph failure: no fallback
}
