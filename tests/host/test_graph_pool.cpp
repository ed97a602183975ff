// Host tests of the graph pool's logic under a fake backend (no GPU): get-or-capture, warm-up
// runs, LRU order and eviction choice, deferred retirement, prewarm order, failure phases, key
// hashing and equality, statistics arithmetic, fmt and JSON output.
#include <doctest/doctest.h>
#include <replay/graph_pool.hpp>

#include "pool_fake_backend.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

using pool_fake::fake_backend;
using pool_fake::fake_pool;
using pool_fake::journal;

namespace {

/// A step that records its eager runs and its captures in the journal.
struct recording_step {
  journal* j;
  std::vector<std::string>* calls;
  void operator()(int s, std::size_t key) const {
    calls->push_back(fmt::format("{} {} s{}", j->capturing ? "captured" : "eager", key, s));
  }
};

struct fixture {
  std::shared_ptr<journal> j = std::make_shared<journal>();
  std::vector<std::string> calls;
  recording_step step{j.get(), &calls};
  fake_pool<std::size_t> make(replay::pool_options o = {}) { return fake_pool<std::size_t>(o, fake_backend(j)); }
};

std::vector<std::size_t> keys(std::initializer_list<std::size_t> k) { return k; }

}  // namespace

TEST_CASE("miss: warm-up runs, capture, replay; hit: replay only") {
  fixture f;
  auto pool = f.make({.warmup = 2});
  CHECK(pool.run(8, 1, f.step) == replay::step_path::captured);
  CHECK(f.calls == std::vector<std::string>{"eager 8 s1", "eager 8 s1", "captured 8 s1"});
  CHECK(f.j->events == std::vector<std::string>{"capture 8", "launch 8 s1"});
  CHECK(pool.contains(8));
  CHECK(pool.size() == 1);

  f.calls.clear();
  CHECK(pool.run(8, 1, f.step) == replay::step_path::replayed);
  CHECK(f.calls.empty());  // a hit never calls the step
  CHECK(f.j->launches == 2);
  const auto& c = pool.counters();
  CHECK(c.hits == 1);
  CHECK(c.misses == 1);
  CHECK(c.captures == 1);
  CHECK(pool.last_failure() == replay::pool_phase::none);
}

TEST_CASE("warmup 0: a miss runs the step only under capture, then replays once") {
  fixture f;
  auto pool = f.make({.warmup = 0});
  pool.run(4, 0, f.step);
  CHECK(f.calls == std::vector<std::string>{"captured 4 s0"});
  CHECK(f.j->launches == 1);
}

TEST_CASE("a step taking only the stream is accepted") {
  fixture f;
  auto pool = f.make();
  int eager = 0;
  pool.run(1, 0, [&](int) { eager += f.j->capturing ? 0 : 1; });
  CHECK(eager == 1);
}

TEST_CASE("LRU: the least recently used graph is evicted, hits refresh recency") {
  fixture f;
  auto pool = f.make({.capacity = 3});
  for (std::size_t k : {1, 2, 3}) pool.run(k, 0, f.step);
  CHECK(pool.lru_order() == keys({3, 2, 1}));
  pool.run(1, 0, f.step);  // hit: 1 becomes most recent
  CHECK(pool.lru_order() == keys({1, 3, 2}));
  pool.run(4, 7, f.step);  // miss on a full pool: evicts 2 (least recent) before capturing 4
  CHECK(pool.lru_order() == keys({4, 1, 3}));
  CHECK_FALSE(pool.contains(2));
  CHECK(pool.counters().evictions == 1);
  // The eviction retired 2 with the stream of its last launch, before 4 was captured.
  const auto ev = f.j->events;
  const auto retire = std::find(ev.begin(), ev.end(), "retire 2 s0");
  const auto capture4 = std::find(ev.begin(), ev.end(), "capture 4");
  REQUIRE(retire != ev.end());
  CHECK(retire < capture4);
  // 2 comes back: a miss again; 3 is now the least recent and goes.
  CHECK(pool.run(2, 0, f.step) == replay::step_path::captured);
  CHECK(pool.lru_order() == keys({2, 4, 1}));
  CHECK(pool.size() == 3);
}

TEST_CASE("capacity 4 over 10 keys cycling: evictions in LRU order, never more than 4 resident") {
  fixture f;
  auto pool = f.make({.capacity = 4});
  for (int round = 0; round < 3; ++round)
    for (std::size_t k = 1; k <= 10; ++k) {
      pool.run(k, 0, f.step);
      CHECK(pool.size() <= 4);
    }
  // Cycling through 10 keys with 4 slots: every run misses, every miss after the 4th evicts.
  CHECK(pool.counters().misses == 30);
  CHECK(pool.counters().hits == 0);
  CHECK(pool.counters().evictions == 26);
  const auto retired = f.j->only("retire");
  REQUIRE(retired.size() == 26);
  for (std::size_t i = 0; i < retired.size(); ++i)  // evicted in the order they were used
    CHECK(retired[i] == fmt::format("retire {} s0", i % 10 + 1));
  CHECK(pool.lru_order() == keys({10, 9, 8, 7}));
}

TEST_CASE("a skewed workload: hot keys stay, cold keys are evicted") {
  fixture f;
  auto pool = f.make({.capacity = 2});
  for (int i = 0; i < 20; ++i) {
    pool.run(1, 0, f.step);                       // hot
    pool.run(static_cast<std::size_t>(100 + i), 0, f.step);  // a new cold key every time
  }
  CHECK(pool.contains(1));
  CHECK(pool.counters().hits == 19);
  CHECK(pool.counters().misses == 21);
  CHECK(std::count(f.j->events.begin(), f.j->events.end(), "retire 1 s0") == 0);
  CHECK(f.j->only("retire").size() == 19);
}

TEST_CASE("eviction is deferred: retired execs are destroyed at collect once complete") {
  fixture f;
  auto pool = f.make({.capacity = 1});
  pool.run(1, 3, f.step);
  f.j->completed = false;  // the last replay of 1 is still "running"
  pool.run(2, 3, f.step);  // evicts 1
  CHECK(f.j->pending == std::vector<std::string>{"1"});
  CHECK(pool.stats().retired_pending == 1);
  pool.collect();
  CHECK(f.j->destroyed.empty());  // not complete: kept
  f.j->completed = true;
  pool.run(3, 3, f.step);  // a miss polls the retired list first
  CHECK(f.j->destroyed == std::vector<std::string>{"1"});
  pool.collect();
  CHECK(f.j->destroyed == std::vector<std::string>{"1", "2"});
}

TEST_CASE("explicit evict and clear; destruction retires every resident graph") {
  fixture f;
  {
    auto pool = f.make();
    for (std::size_t k : {1, 2, 3}) pool.run(k, 0, f.step);
    CHECK(pool.evict(2));
    CHECK_FALSE(pool.evict(2));
    CHECK_FALSE(pool.evict(42));
    CHECK(pool.lru_order() == keys({3, 1}));
    CHECK(pool.counters().evictions == 1);
    pool.clear();
    CHECK(pool.size() == 0);
    pool.run(5, 0, f.step);
  }
  CHECK(f.j->only("retire") == std::vector<std::string>{"retire 2 s0", "retire 1 s0", "retire 3 s0", "retire 5 s0"});
}

TEST_CASE("prewarm: largest first, duplicates and resident keys skipped, no replay") {
  fixture f;
  auto pool = f.make({.warmup = 1});
  pool.run(2, 0, f.step);
  f.calls.clear();
  f.j->events.clear();
  const std::vector<std::size_t> want{1, 4, 2, 16, 8, 4};
  CHECK(pool.prewarm(want, 0, f.step) == 4);
  CHECK(f.j->only("capture") == std::vector<std::string>{"capture 16", "capture 8", "capture 4", "capture 1"});
  CHECK(f.j->only("launch").empty());
  // The largest bucket's warm-up ran first: a workspace sized on first use is sized for 16.
  REQUIRE_FALSE(f.calls.empty());
  CHECK(f.calls.front() == "eager 16 s0");
  CHECK(pool.counters().prewarmed == 4);
  CHECK(pool.counters().captures == 5);
  CHECK(pool.counters().misses == 1);
  // The prewarmed graphs are hits afterwards.
  CHECK(pool.run(16, 0, f.step) == replay::step_path::replayed);
}

TEST_CASE("prewarm: custom size order, graph_key sorted by bucket, capacity checked first") {
  fixture f;
  auto pool = f.make({.capacity = 2});
  CHECK_THROWS_AS(pool.prewarm({1, 2, 3}, 0, f.step), replay::usage_error);
  CHECK(f.j->captures == 0);  // refused before capturing anything
  CHECK(pool.prewarm({1, 2}, 0, f.step, [](std::size_t k) { return k; }) == 2);
  CHECK(f.j->only("capture") == std::vector<std::string>{"capture 2", "capture 1"});

  auto j = std::make_shared<journal>();
  fake_pool<replay::graph_key> gp({}, fake_backend(j));
  const std::vector<replay::graph_key> gk{{.bucket = 2}, {.bucket = 64}, {.bucket = 8}};
  gp.prewarm(gk, 0, [](int) {});
  CHECK(j->only("capture") == std::vector<std::string>{"capture bucket 64", "capture bucket 8", "capture bucket 2"});
}

TEST_CASE("ensure captures without replaying") {
  fixture f;
  auto pool = f.make();
  CHECK(pool.ensure(3, 0, f.step));
  CHECK_FALSE(pool.ensure(3, 0, f.step));
  CHECK(f.j->launches == 0);
  CHECK(pool.find(3) != nullptr);
  CHECK(pool.find(4) == nullptr);
}

TEST_CASE("failures: the phase is recorded, the exception propagates, the pool stays consistent") {
  fixture f;
  auto pool = f.make();

  SUBCASE("the step throws under capture") {
    auto step = [&](int, std::size_t) {
      if (f.j->capturing) throw std::runtime_error("cudaMalloc while capturing");
    };
    CHECK_THROWS_WITH(pool.run(8, 0, step), "cudaMalloc while capturing");
    CHECK(pool.last_failure() == replay::pool_phase::capture);
    CHECK_FALSE(pool.contains(8));
    CHECK(pool.counters().capture_failures == 1);
    CHECK(pool.counters().misses == 1);
    CHECK(f.j->clears >= 1);  // the CUDA error slot was cleared
    // A later good run of the same key captures normally.
    CHECK(pool.run(8, 0, f.step) == replay::step_path::captured);
    CHECK(pool.last_failure() == replay::pool_phase::none);
    CHECK(pool.stats().keys.at(0).capture_failures == 1);
  }
  SUBCASE("instantiation fails") {
    f.j->fail_instantiate = true;
    CHECK_THROWS_AS(pool.run(8, 0, f.step), pool_fake::fake_failure);
    CHECK(pool.last_failure() == replay::pool_phase::instantiate);
    CHECK(pool.size() == 0);
  }
  SUBCASE("the step fails when run eagerly (warm-up)") {
    auto step = [&](int, std::size_t) { throw std::runtime_error("bad step"); };
    CHECK_THROWS(pool.run(8, 0, step));
    CHECK(pool.last_failure() == replay::pool_phase::warmup);
    CHECK(pool.counters().capture_failures == 0);
  }
  SUBCASE("replay fails") {
    pool.run(8, 0, f.step);
    f.j->fail_launch = true;
    CHECK_THROWS_AS(pool.run(8, 0, f.step), pool_fake::fake_failure);
    CHECK(pool.last_failure() == replay::pool_phase::replay);
    CHECK(pool.counters().replay_failures == 1);
    CHECK(pool.contains(8));  // still cached; the runner decides what to do
  }
}

TEST_CASE("invalid options") {
  CHECK_THROWS_AS(fake_pool<int>({.capacity = 0}), replay::usage_error);
  CHECK_THROWS_AS(fake_pool<int>({.warmup = -1}), replay::usage_error);
}

TEST_CASE("the pool is move-constructible") {
  fixture f;
  auto a = f.make({.capacity = 2});
  a.run(1, 0, f.step);
  a.run(2, 0, f.step);
  auto b = std::move(a);
  CHECK(b.lru_order() == keys({2, 1}));
  CHECK(b.run(1, 0, f.step) == replay::step_path::replayed);
  b.run(3, 0, f.step);
  CHECK(b.lru_order() == keys({3, 1}));
}

// ---- keys -------------------------------------------------------------------------------------

namespace {
struct member_key {  // hash through a member
  int bucket;
  int heads;
  friend bool operator==(const member_key&, const member_key&) = default;
  [[nodiscard]] std::size_t hash() const noexcept { return replay::hash_values(bucket, heads); }
};
struct std_key {  // hash through std::hash, not formattable
  int bucket;
  bool top_k;
  friend bool operator==(const std_key&, const std_key&) = default;
};
}  // namespace
template <>
struct std::hash<std_key> {
  std::size_t operator()(const std_key& k) const noexcept { return replay::hash_values(k.bucket, k.top_k); }
};

static_assert(replay::graph_pool_key<replay::graph_key>);
static_assert(replay::graph_pool_key<member_key>);
static_assert(replay::graph_pool_key<std_key>);
static_assert(replay::graph_pool_key<std::size_t>);
static_assert(!replay::graph_pool_key<std::vector<int>>);  // no hash

TEST_CASE("graph_key: equality and hash cover every field") {
  const replay::graph_key a{.bucket = 8, .dtype = 1, .fields = {128, 4}};
  replay::graph_key b = a;
  CHECK(a == b);
  CHECK(a.hash() == b.hash());
  CHECK(std::hash<replay::graph_key>{}(a) == a.hash());
  std::unordered_set<std::size_t> hashes{a.hash()};
  const auto differs = [&](replay::graph_key k) {
    CHECK_FALSE(k == a);
    CHECK(hashes.insert(k.hash()).second);  // distinct hashes for these neighbours
  };
  b.bucket = 16; differs(b); b = a;
  b.dtype = 2; differs(b); b = a;
  b.fields[0] = 129; differs(b); b = a;
  b.fields[1] = 5; differs(b); b = a;
  b.fields[3] = 1; differs(b); b = a;
  // Swapped fields must not collide (order matters).
  differs(replay::graph_key{.bucket = 8, .dtype = 1, .fields = {4, 128}});

  // Many neighbouring keys: no collisions in practice.
  std::unordered_set<std::size_t> many;
  for (std::uint32_t bucket = 1; bucket <= 64; ++bucket)
    for (std::uint32_t dtype = 0; dtype < 4; ++dtype)
      for (std::int64_t f0 = 0; f0 < 16; ++f0)
        many.insert(replay::graph_key{.bucket = bucket, .dtype = dtype, .fields = {f0}}.hash());
  CHECK(many.size() == 64 * 4 * 16);
  // Every field position, small values (the common case: shapes and flags).
  std::unordered_set<std::size_t> all;
  std::size_t count = 0;
  for (std::uint32_t bucket = 1; bucket <= 256; bucket *= 2)
    for (std::int64_t a = 0; a < 8; ++a)
      for (std::int64_t b2 = 0; b2 < 8; ++b2)
        for (std::int64_t c = 0; c < 8; ++c)
          for (std::int64_t d = 0; d < 8; ++d, ++count)
            all.insert(replay::graph_key{.bucket = bucket, .dtype = 1, .fields = {a, b2, c, d}}.hash());
  CHECK(all.size() == count);
}

TEST_CASE("key hashing: member hash(), std::hash, and describe_key") {
  CHECK(replay::key_hash<member_key>{}({8, 32}) == member_key{8, 32}.hash());
  CHECK(replay::key_hash<std_key>{}({8, true}) == std::hash<std_key>{}({8, true}));
  CHECK(replay::key_hash<member_key>{}({8, 32}) != replay::key_hash<member_key>{}({32, 8}));
  CHECK(replay::describe_key(std::size_t{8}) == "8");
  CHECK(replay::describe_key(replay::graph_key{.bucket = 8, .dtype = 1, .fields = {128, 4}}) ==
        "bucket 8, dtype 1, fields [128, 4]");
  CHECK(replay::describe_key(replay::graph_key{.bucket = 2}) == "bucket 2");
  CHECK(replay::describe_key(std_key{8, true}).rfind("key#", 0) == 0);  // not formattable: its hash

  // Equal keys share one graph; keys differing in any member get their own.
  auto j = std::make_shared<journal>();
  replay::basic_graph_pool<std_key, fake_backend> pool({}, fake_backend(j));
  pool.run({8, false}, 0, [](int) {});
  CHECK(pool.run({8, false}, 0, [](int) {}) == replay::step_path::replayed);
  CHECK(pool.run({8, true}, 0, [](int) {}) == replay::step_path::captured);
  CHECK(pool.size() == 2);
}

// ---- statistics -------------------------------------------------------------------------------

TEST_CASE("stats arithmetic: hit rate, rows, per-key figures") {
  fixture f;
  auto pool = f.make({.capacity = 2});
  pool.run(8, 0, f.step, {.real = 5, .bucket = 8});   // miss
  pool.run(8, 0, f.step, {.real = 7, .bucket = 8});   // hit
  pool.run(8, 0, f.step, {.real = 8, .bucket = 8});   // hit
  pool.run(4, 0, f.step, {.real = 3, .bucket = 4});   // miss
  pool.run(2, 0, f.step, {.real = 2, .bucket = 2});   // miss, evicts 8

  const replay::pool_stats s = pool.stats();
  CHECK(s.hits == 2);
  CHECK(s.misses == 3);
  CHECK(s.lookups() == 5);
  CHECK(s.hit_rate() == doctest::Approx(0.4));
  CHECK(s.captures == 3);
  CHECK(s.evictions == 1);
  CHECK(s.eager_runs() == 0);  // eager runs are the runner's (runner.hpp)
  CHECK(s.real_rows == 5 + 7 + 8 + 3 + 2);
  CHECK(s.padded_rows == 8 + 8 + 8 + 4 + 2);
  CHECK(s.padding_rows() == 3 + 1 + 0 + 1);
  CHECK(s.padding_waste() == doctest::Approx(5.0 / 30.0));
  CHECK(s.resident == 2);
  CHECK(s.capacity == 2);
  REQUIRE(s.keys.size() == 3);
  CHECK(s.keys[0].key == "8");  // first-seen order
  CHECK(s.keys[0].hits == 2);
  CHECK(s.keys[0].misses == 1);
  CHECK(s.keys[0].evictions == 1);
  CHECK_FALSE(s.keys[0].resident);
  CHECK(s.keys[1].key == "4");
  CHECK(s.keys[1].resident);
  CHECK(s.keys[2].last_capture.nodes == 3);
  CHECK(s.total_capture_ms == doctest::Approx(3 * 2.0));  // fake: 1.5 + 0.5 per capture
  CHECK(s.resident_device_bytes == 2 * 1024);             // only the resident graphs

  replay::pool_stats empty;
  CHECK(empty.hit_rate() == 0.0);
  CHECK(empty.padding_waste() == 0.0);

  pool.reset_stats();
  CHECK(pool.counters().hits == 0);
  CHECK(pool.stats().keys[0].hits == 0);
  CHECK(pool.size() == 2);
}

TEST_CASE("stats print with fmt and as valid JSON") {
  auto j = std::make_shared<journal>();
  fake_pool<replay::graph_key> pool({.capacity = 4}, fake_backend(j));
  const replay::graph_key k8{.bucket = 8, .dtype = 1, .fields = {128}};
  pool.run(k8, 0, [](int) {}, {.real = 6, .bucket = 8});
  pool.run(k8, 0, [](int) {}, {.real = 8, .bucket = 8});
  const auto s = pool.stats();
  const std::string text = fmt::format("{}", s);
  MESSAGE(text);
  CHECK(text.find("hit rate 50.0%") != std::string::npos);
  CHECK(text.find("bucket 8, dtype 1, fields [128]") != std::string::npos);
  CHECK(text.find("capacity 4") != std::string::npos);

  const auto json = nlohmann::json::parse(s.to_json());
  CHECK(json["hits"] == 1);
  CHECK(json["misses"] == 1);
  CHECK(json["hit_rate"].get<double>() == doctest::Approx(0.5));
  CHECK(json["real_rows"] == 14);
  CHECK(json["padded_rows"] == 16);
  CHECK(json["capacity"] == 4);
  REQUIRE(json["keys"].size() == 1);
  CHECK(json["keys"][0]["key"] == "bucket 8, dtype 1, fields [128]");
  CHECK(json["keys"][0]["capture_ms"].get<double>() == doctest::Approx(1.5));
  CHECK(json["keys"][0]["device_bytes"] == 1024);

  fake_pool<int> unlimited({}, fake_backend(j));
  CHECK(nlohmann::json::parse(unlimited.stats().to_json())["capacity"].is_null());
}

TEST_CASE("JSON strings are escaped") {
  CHECK(replay::detail::json_string("a\"b\\c\n\t\x01") == "\"a\\\"b\\\\c\\n\\t\\u0001\"");
  CHECK(replay::detail::json_number(1.5) == "1.5");
  CHECK(replay::detail::json_number(std::numeric_limits<double>::quiet_NaN()) == "null");
  replay::pool_stats s;
  s.keys.push_back(replay::key_stats{.key = "weird \"key\"\n"});
  const auto json = nlohmann::json::parse(s.to_json());
  CHECK(json["keys"][0]["key"] == "weird \"key\"\n");
}

TEST_CASE("hit path cost model: a hit is one lookup and one launch") {
  fixture f;
  auto pool = f.make({.capacity = 8});
  for (std::size_t k = 1; k <= 8; ++k) pool.run(k, 0, f.step);
  const int launches = f.j->launches;
  const int collects = f.j->collects;
  for (int i = 0; i < 1000; ++i) pool.run(static_cast<std::size_t>(i % 8 + 1), 0, f.step);
  CHECK(f.j->launches == launches + 1000);
  CHECK(f.j->collects == collects);  // the hit path never polls retired graphs
  CHECK(pool.counters().hits == 1000);
}

// ---- misuse -----------------------------------------------------------------------------------

namespace {
/// A key with a floating-point field: NaN never compares equal to itself.
struct float_key {
  double scale = 1.0;
  friend bool operator==(const float_key&, const float_key&) = default;
  [[nodiscard]] std::size_t hash() const noexcept { return replay::hash_values(scale); }
};
}  // namespace

TEST_CASE("a step that runs its own pool is refused, and the LRU stays consistent") {
  fixture f;
  auto pool = f.make({.warmup = 1});
  bool inner_threw = false;
  auto step = [&](int s, std::size_t) {
    try {
      pool.run(4, s, f.step);  // re-entry from inside the warm-up / capture
    } catch (const replay::usage_error&) {
      inner_threw = true;
    }
  };
  CHECK(pool.run(8, 0, step) == replay::step_path::captured);
  CHECK(inner_threw);
  CHECK(pool.lru_order() == keys({8}));
  auto ensure_inside = [&](int s, std::size_t) { (void)pool.ensure(2, s, f.step); };
  CHECK(pool.run(8, 0, ensure_inside) == replay::step_path::replayed);  // a hit never calls the step
  CHECK_THROWS_AS(pool.run(32, 0, ensure_inside), replay::usage_error);
  CHECK(pool.lru_order() == keys({8}));
  auto prewarm_inside = [&](int s, std::size_t) { (void)pool.prewarm({1, 2}, s, f.step); };
  CHECK_THROWS_AS(pool.run(16, 0, prewarm_inside), replay::usage_error);
  CHECK(pool.lru_order() == keys({8}));
  CHECK(pool.size() == 1);
}

TEST_CASE("moving a pool from inside its own step is refused") {
  fixture f;
  auto pool = f.make({.warmup = 0});
  std::optional<fake_pool<std::size_t>> moved;
  auto step = [&](int, std::size_t) { moved.emplace(std::move(pool)); };
  CHECK_THROWS_AS(pool.run(8, 0, step), replay::usage_error);
  CHECK_FALSE(moved.has_value());
  CHECK(pool.run(8, 0, f.step) == replay::step_path::captured);  // the pool is intact
}

TEST_CASE("a key that does not compare equal to itself is refused instead of growing the pool") {
  auto j = std::make_shared<journal>();
  replay::basic_graph_pool<float_key, fake_backend> pool({}, fake_backend(j));
  const float_key nan{std::numeric_limits<double>::quiet_NaN()};
  for (int i = 0; i < 3; ++i)
    CHECK_THROWS_WITH_AS(pool.run(nan, 0, [](int) {}), doctest::Contains("does not compare equal to itself"),
                         replay::usage_error);
  CHECK(pool.size() == 0);
  CHECK(pool.stats().keys.empty());
  CHECK(pool.run(float_key{2.0}, 0, [](int) {}) == replay::step_path::captured);
}
