// Host tests of the Qwen example: config parsing, request checks, weight checks, paged-KV bookkeeping.
#include <doctest/doctest.h>

#include "qwen/config.hpp"
#include "qwen/options.hpp"
#include "qwen/paged_kv.hpp"
#include "qwen/weights.hpp"

#include <common/safetensors.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

using namespace qwen;
namespace fs = std::filesystem;

namespace {

const char* tiny_json = R"({"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
  "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true})";

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Writes a checkpoint for `c` to `dir` (BF16 zeros), optionally altering one tensor.
void write_checkpoint(const fs::path& dir, const Config& c, const std::string& alter = "", int extra_layer = -1) {
  using replay_examples::dtype;
  fs::create_directories(dir);
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> specs;
  const std::int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  specs.push_back({"model.embed_tokens.weight", {V, H}});
  specs.push_back({"model.norm.weight", {H}});
  const int layers = extra_layer >= 0 ? extra_layer + 1 : c.num_hidden_layers;
  for (int i = 0; i < layers; ++i) {
    specs.push_back({layer_tensor(i, "input_layernorm.weight"), {H}});
    specs.push_back({layer_tensor(i, "post_attention_layernorm.weight"), {H}});
    specs.push_back({layer_tensor(i, "self_attn.q_proj.weight"), {c.q_dim(), H}});
    specs.push_back({layer_tensor(i, "self_attn.k_proj.weight"), {c.kv_dim(), H}});
    specs.push_back({layer_tensor(i, "self_attn.v_proj.weight"), {c.kv_dim(), H}});
    specs.push_back({layer_tensor(i, "self_attn.o_proj.weight"), {H, c.q_dim()}});
    specs.push_back({layer_tensor(i, "self_attn.q_norm.weight"), {D}});
    specs.push_back({layer_tensor(i, "self_attn.k_norm.weight"), {D}});
    specs.push_back({layer_tensor(i, "mlp.gate_proj.weight"), {I, H}});
    specs.push_back({layer_tensor(i, "mlp.up_proj.weight"), {I, H}});
    specs.push_back({layer_tensor(i, "mlp.down_proj.weight"), {H, I}});
  }
  std::vector<std::vector<std::byte>> store;
  std::vector<replay_examples::tensor_to_write> ts;
  for (auto& [name, shape] : specs) {
    if (name + ":missing" == alter) continue;
    dtype t = dtype::BF16;
    if (name + ":f32" == alter) t = dtype::F32;
    if (name + ":shape" == alter) shape[0] += 1;
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    store.emplace_back(static_cast<std::size_t>(n) * replay_examples::dtype_size(t));
    ts.push_back({name, t, shape, std::span<const std::byte>(store.back())});
  }
  replay_examples::write_safetensors(dir / "model.safetensors", ts);
}

}  // namespace

TEST_CASE("presets have the released Qwen3 shapes") {
  const Config a = preset("qwen3-0.6b");
  CHECK(a.hidden_size == 1024);
  CHECK(a.num_hidden_layers == 28);
  CHECK(a.q_dim() == 2048);
  CHECK(a.group_size() == 2);
  // 0.6B: ~0.6e9 parameters, with the tied embedding counted once.
  CHECK(a.total_params() > 590'000'000);
  CHECK(a.total_params() < 600'000'000);
  const Config b = preset("qwen3-4b");
  CHECK(b.intermediate_size == 9728);
  CHECK(b.group_size() == 4);
  CHECK(b.total_params() > 4'000'000'000);
  CHECK(preset("qwen3-1.7b").hidden_size == 2048);
  CHECK(preset("tiny").head_dim == 64);
  const Config e = preset("qwen3-8b");
  CHECK(e.hidden_size == 4096);
  CHECK(!e.tie_word_embeddings);
  const Config f = preset("qwen3-14b");
  CHECK(f.group_size() == 5);  // 40 query heads over 8 kv heads
  CHECK(f.total_params() > 14'000'000'000);
  CHECK(f.total_params() < 15'500'000'000);
  const Config g = preset("qwen3-32b");
  CHECK(g.hidden_size == 5120);
  CHECK(g.intermediate_size == 25600);
  CHECK(g.num_hidden_layers == 64);
  CHECK(g.group_size() == 8);  // 64 query heads over 8 kv heads
  CHECK(!g.tie_word_embeddings);
  CHECK(g.total_params() > 32'500'000'000);  // Qwen3-32B: 32.8e9
  CHECK(g.total_params() < 33'000'000'000);
  CHECK(contains(error_of([] { (void)preset("qwen9"); }), "unknown preset"));
}

TEST_CASE("--tp: the split and the request are checked before any GPU work") {
  for (const char* name : {"qwen3-8b", "qwen3-14b", "qwen3-32b"})
    for (int tp : {1, 2, 4}) {
      CAPTURE(name);
      CAPTURE(tp);
      const Config c = preset(name);
      CHECK(error_of([&] { check_tp_split(c, tp); }).empty());
      CHECK(error_of([&] { check_tp_request(c, tp, 8, true); }).empty());
      // A rank reads its share of every matrix and of the lm_head, and all of the norms.
      if (tp > 1) CHECK(c.decode_weight_bytes(tp) * tp > c.decode_weight_bytes());
      if (tp > 1) CHECK(c.decode_weight_bytes(tp) * tp < c.decode_weight_bytes() + 2 * tp * c.hidden_size * 2 * (2 * c.num_hidden_layers + 3));
    }
  const Config t = preset("tiny");  // 4 query heads, 2 kv heads, intermediate 512, vocab 1024
  CHECK(error_of([&] { check_tp_request(t, 2, 2, true); }).empty());
  CHECK(contains(error_of([&] { check_tp_request(t, 0, 2, true); }), "--tp 0 must be at least 1"));
  CHECK(contains(error_of([&] { check_tp_request(t, 3, 8, true); }), "num_key_value_heads 2 of config tiny is not divisible by 3"));
  CHECK(contains(error_of([&] { check_tp_request(t, 2, 1, true); }), "--tp 2 needs 2 GPUs (one rank per GPU); 1 present"));
  CHECK(contains(error_of([&] { check_tp_request(t, 2, 0, true); }), "0 present"));
  CHECK(contains(error_of([&] { check_tp_request(t, 2, 2, false); }), "tensor parallel needs NCCL"));
  CHECK(error_of([&] { check_tp_request(t, 1, 0, false); }).empty());  // one GPU needs neither
  auto with = [&](auto&& change) {
    Config c = preset("tiny");
    change(c);
    return c;
  };
  CHECK(contains(error_of([&] { check_tp_split(with([](Config& c) { c.num_attention_heads = 6, c.num_key_value_heads = 6; }), 4); }),
                 "num_key_value_heads 6"));
  CHECK(contains(error_of([&] { check_tp_split(with([](Config& c) { c.intermediate_size = 513; }), 2); }),
                 "intermediate_size 513 of config tiny is not divisible by 2"));
  CHECK(contains(error_of([&] { check_tp_split(with([](Config& c) { c.intermediate_size = 520; }), 2); }),
                 "intermediate_size / 2 = 260 must be a multiple of 8"));
  CHECK(contains(error_of([&] { check_tp_split(with([](Config& c) { c.vocab_size = 1023; }), 2); }),
                 "vocab_size 1023 of config tiny is not divisible by 2"));
  // EngineOptions: the same split, the rank in range, and a KV block of 1/tp of the kv heads.
  EngineOptions o;
  o.max_context = 512;
  o.tp_size = 2;
  CHECK(error_of([&] { o.validate(t); }).empty());
  CHECK(o.block_bytes(t) * 2 == kv_block_bytes(t, o.block_size));
  CHECK(o.kv_blocks(t) == 2 * EngineOptions{}.kv_blocks(t));
  o.tp_rank = 2;
  CHECK(contains(error_of([&] { o.validate(t); }), "rank 2 is outside 0..1"));
  o.tp_rank = 0, o.tp_size = 3;
  CHECK(contains(error_of([&] { o.validate(t); }), "not divisible by 3"));
}

TEST_CASE("config.json parsing and validation") {
  const Config c = config_from_json_text(tiny_json, "tiny.json");
  CHECK(c.vocab_size == 1000);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.head_dim == 64);
  CHECK(c.rope_theta == doctest::Approx(10000.0));
  CHECK(c.tie_word_embeddings);

  CHECK(contains(error_of([] { (void)config_from_json_text("{", "x.json"); }), "not valid JSON"));
  CHECK(contains(error_of([] { (void)config_from_json_text(R"({"hidden_size": 64})", "x.json"); }),
                 "missing field 'vocab_size'"));
  std::string s = tiny_json;
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = s;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  CHECK(contains(error_of([&] { (void)config_from_json_text(replaced("\"hidden_size\": 256", "\"hidden_size\": \"x\""), "x"); }),
                 "must be an integer"));
  CHECK(contains(error_of([&] { (void)config_from_json_text(replaced("\"qwen3\"", "\"llama\""), "x"); }), "expected 'qwen3'"));
  CHECK(contains(error_of([&] { (void)config_from_json_text(replaced("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"), "x"); }),
                 "multiple of num_key_value_heads"));
  CHECK(contains(error_of([&] { (void)config_from_json_text(replaced("\"head_dim\": 64", "\"head_dim\": 96"), "x"); }),
                 "head_dim must be 64 or 128"));
  // head_dim defaults to hidden / heads when absent.
  const Config d = config_from_json_text(replaced("\"head_dim\": 64,", ""), "x");
  CHECK(d.head_dim == 64);
}

TEST_CASE("paged KV bookkeeping") {
  PagedKvBook book(/*blocks*/ 9, /*block size*/ 4, /*seqs*/ 3, /*width*/ 4);
  CHECK(book.free_blocks() == 8);  // block 0 is scratch
  CHECK(book.max_tokens_per_seq() == 16);
  CHECK(book.scratch_slot() == 3);
  const int a = book.acquire_slot(), b = book.acquire_slot();
  CHECK(a == 0);
  CHECK(b == 1);
  book.clear_dirty();
  book.ensure(a, 5);  // 2 blocks
  CHECK(book.blocks(a).size() == 2);
  CHECK(book.length(a) == 5);
  CHECK(book.free_blocks() == 6);
  CHECK(book.dirty() == std::pair<int, int>{0, 2});
  book.ensure(a, 5);  // idempotent
  CHECK(book.free_blocks() == 6);
  book.ensure(b, 4);
  CHECK(book.table()[static_cast<std::size_t>(b) * 4] == book.blocks(b)[0]);
  // No block is owned twice and none is 0.
  std::vector<int> all = book.blocks(a);
  all.insert(all.end(), book.blocks(b).begin(), book.blocks(b).end());
  std::sort(all.begin(), all.end());
  CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
  CHECK(all.front() >= 1);
  const auto [blk, off] = book.locate(a, 4);
  CHECK(blk == book.blocks(a)[1]);
  CHECK(off == 0);
  // Limits: per-sequence width, pool size, slots.
  CHECK(contains(error_of([&] { book.ensure(a, 17); }), "per-sequence limit"));
  const int c = book.acquire_slot();
  book.ensure(c, 12);  // 3 blocks: 2 left
  CHECK(contains(error_of([&] { book.ensure(b, 16); }), "out of blocks"));
  CHECK(book.blocks(b).size() == 1);  // failed ensure changed nothing
  CHECK(contains(error_of([&] { (void)book.acquire_slot(); }), "slots are in use"));
  CHECK_FALSE(book.can_admit(4));
  // Release returns blocks and clears the table row; the scratch row stays zero.
  book.clear_dirty();
  book.release(a);
  CHECK(book.free_blocks() == 4);
  CHECK(book.table()[0] == 0);
  CHECK(book.dirty().first == 0);
  CHECK(contains(error_of([&] { book.release(a); }), "not in use"));
  for (int i = 0; i < 4; ++i) CHECK(book.table()[3 * 4 + i] == 0);
  CHECK(book.acquire_slot() == a);  // the freed slot is reused
  CHECK(contains(error_of([] { PagedKvBook tiny(1, 16, 1, 1); }), "at least 2"));
}

TEST_CASE("paged KV bookkeeping: followers (tensor-parallel ranks) apply the leader's changes") {
  PagedKvBook lead(9, 16, 3, 4), f1(9, 16, 3, 4), f2(9, 16, 3, 4);
  lead.add_follower(f1);
  lead.add_follower(f2);
  auto same = [&](const PagedKvBook& f) {
    CHECK(f.table() == lead.table());
    CHECK(f.free_blocks() == lead.free_blocks());
    CHECK(f.dirty() == lead.dirty());
    for (int s = 0; s < lead.max_seqs(); ++s) {
      CHECK(f.in_use(s) == lead.in_use(s));
      CHECK(f.length(s) == lead.length(s));
      CHECK(f.blocks(s) == lead.blocks(s));
    }
  };
  const int a = lead.acquire_slot(), b = lead.acquire_slot();
  lead.ensure(a, 20);
  lead.ensure(b, 40);
  lead.ensure(a, 33);
  same(f1);
  same(f2);
  lead.release(a);
  same(f1);
  lead.clear_dirty();  // each book's own: the followers keep theirs until they push
  CHECK(f1.dirty() != lead.dirty());
  f1.clear_dirty(), f2.clear_dirty();
  // A change the leader refuses changes no book.
  CHECK(contains(error_of([&] { lead.ensure(b, 1000); }), "exceed the per-sequence limit"));
  CHECK(contains(error_of([&] { lead.ensure(a, 16); }), "not in use"));
  same(f1);
  same(f2);
  PagedKvBook other(9, 16, 4, 4);
  CHECK(contains(error_of([&] { lead.add_follower(other); }), "same sizes"));
  CHECK(contains(error_of([&] { lead.add_follower(lead); }), "same sizes"));
}

TEST_CASE("request checks happen before GPU work") {
  const Config c = config_from_json_text(tiny_json, "tiny.json");
  EngineOptions o;
  o.max_context = 64;
  o.kv_budget_bytes = static_cast<std::size_t>(kv_block_bytes(c, 16)) * 9;  // 8 usable blocks
  o.max_batch = 8;
  o.max_bucket = 4;
  o.eager_fallback = false;
  CHECK(error_of([&] { validate_request(c, o, {{{1, 2, 3}, 10}}); }).empty());
  CHECK(contains(error_of([&] { validate_request(c, o, {{{1, 1000, 3}, 10}}); }), "token id 1000 at prompt position 1 is out of range"));
  CHECK(contains(error_of([&] { validate_request(c, o, {{{-1}, 10}}); }), "out of range"));
  CHECK(contains(error_of([&] { validate_request(c, o, {{{1, 2}, 63}}); }), "exceeds the context limit 64"));
  // 3 sequences of 48 tokens need 9 blocks of 16 > 8.
  std::vector<SequenceRequest> three(3, SequenceRequest{{1, 2, 3}, 45});
  CHECK(contains(error_of([&] { validate_request(c, o, three); }), "KV budget"));
  std::vector<SequenceRequest> five(5, SequenceRequest{{1}, 1});
  CHECK(contains(error_of([&] { validate_request(c, o, five); }), "largest graph bucket 4 and eager fallback is off"));
  o.eager_fallback = true;
  CHECK(error_of([&] { validate_request(c, o, five); }).empty());
  o.max_context = 100000;
  CHECK(contains(error_of([&] { o.validate(c); }), "max_position_embeddings"));
  o.max_context = 64;
  o.kv_budget_bytes = 100;
  CHECK(contains(error_of([&] { o.validate(c); }), "at least 2 are needed"));
  o.kv_budget_bytes = static_cast<std::size_t>(kv_block_bytes(c, 16)) * 9;
  o.gemv_max_rows = 12;
  CHECK(contains(error_of([&] { o.validate(c); }), "fused-GEMV bucket must be 0, 1, 2, 4, 8 or 16"));
  o.gemv_max_rows = 32;
  CHECK(contains(error_of([&] { o.validate(c); }), "fused-GEMV bucket must be"));
  o.gemv_max_rows = 8;
  CHECK(error_of([&] { o.validate(c); }).empty());
  o.kv_budget_bytes = std::size_t(1) << 62;  // a huge budget: the error gives a sane block count
  CHECK(contains(error_of([&] { o.validate(c); }), "at most 2^30 are supported"));
}

TEST_CASE("sampling parameters are checked with clear messages") {
  CHECK(error_of([] { SampleParams{}.validate(); }).empty());  // greedy
  CHECK(error_of([] { SampleParams{.temperature = 0.8f, .top_p = 0.95f, .top_k = 40, .seed = 7}.validate(); }).empty());
  CHECK(error_of([] { SampleParams{.temperature = 1.f, .top_p = 1.f, .top_k = 0}.validate(); }).empty());
  CHECK(contains(error_of([] { SampleParams{.temperature = -1.f}.validate(); }),
                 "temperature must be finite and >= 0"));
  CHECK(contains(error_of([] { SampleParams{.temperature = std::numeric_limits<float>::quiet_NaN()}.validate(); }),
                 "temperature"));
  CHECK(contains(error_of([] { SampleParams{.temperature = std::numeric_limits<float>::infinity()}.validate(); }),
                 "temperature"));
  CHECK(contains(error_of([] { SampleParams{.top_p = 0.f}.validate(); }), "top_p must be in (0, 1]"));
  CHECK(contains(error_of([] { SampleParams{.top_p = 1.01f}.validate(); }), "top_p must be in (0, 1]"));
  CHECK(contains(error_of([] { SampleParams{.top_p = std::numeric_limits<float>::quiet_NaN()}.validate(); }),
                 "top_p"));
  CHECK(contains(error_of([] { SampleParams{.top_k = -2}.validate(); }), "top_k must be >= 0"));
  CHECK_FALSE(EngineOptions{}.sampling);  // off unless asked for: the fused argmax
}

TEST_CASE("weights are checked against the config") {
  const fs::path root = fs::temp_directory_path() / fmt::format("qwen_host_test_{}", ::getpid());
  const Config c = config_from_json_text(tiny_json, "tiny.json");
  auto check_dir = [&](const std::string& name, const std::string& alter, int extra = -1) {
    const fs::path d = root / name;
    write_checkpoint(d, c, alter, extra);
    return error_of([&] { check_weights(c, replay_examples::safetensors::open(d)); });
  };
  CHECK(check_dir("ok", "").empty());
  CHECK(contains(check_dir("missing", "model.layers.1.mlp.up_proj.weight:missing"), "missing tensor model.layers.1.mlp.up_proj.weight"));
  CHECK(contains(check_dir("shape", "model.layers.0.self_attn.k_proj.weight:shape"), "expected shape [128, 256]"));
  CHECK(contains(check_dir("dtype", "model.norm.weight:f32"), "dtype BF16"));
  CHECK(contains(check_dir("extra", "", 2), "config has 2 layers"));
  // Config and weights that disagree: a config with a larger vocabulary.
  {
    std::string s = tiny_json;
    s.replace(s.find("1000"), 4, "2000");
    const Config big = config_from_json_text(s, "big.json");
    CHECK(contains(error_of([&] { check_weights(big, replay_examples::safetensors::open(root / "ok")); }),
                   "model.embed_tokens.weight: expected shape [2000, 256]"));
  }
  // Truncated file.
  {
    const fs::path f = root / "ok" / "model.safetensors";
    const auto size = fs::file_size(f);
    fs::create_directories(root / "trunc");
    fs::copy_file(f, root / "trunc" / "model.safetensors", fs::copy_options::overwrite_existing);
    fs::resize_file(root / "trunc" / "model.safetensors", size - 100);
    CHECK(contains(error_of([&] { (void)replay_examples::safetensors::open(root / "trunc"); }), "truncated"));
  }
  fs::remove_all(root);
}

TEST_CASE("a sequence ends at its first end-of-sequence id, or keeps everything without one") {
  const SequenceRequest q{{1, 2}, 8, {151645, 151643}};
  CHECK(q.stops_at(151645));
  CHECK(q.stops_at(151643));
  CHECK_FALSE(q.stops_at(7));
  const std::vector<int> launch{5, 6, 151643, 9, 151645};  // what one device-loop launch returned
  CHECK(q.kept(launch) == 3);
  CHECK(q.kept(std::span<const int>(launch.data(), 2)) == 2);
  const SequenceRequest none{{1}, 4};
  CHECK_FALSE(none.stops_at(151645));
  CHECK(none.kept(launch) == launch.size());
}
