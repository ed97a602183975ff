// examples/qwen/tp.hpp: tensor-parallel decode over NCCL, in one process: one Engine per GPU, each
// driven by its own host thread, behind the Decoder interface (so the CLI's runs and the benchmark
// use it as they use one Engine).
//
// TpEngine(cfg, opt, weights, tp) makes the communicators of devices 0..tp-1 (ncclCommInitAll), starts
// one worker thread per rank (its device set once), and builds each rank's Engine (opt.tp_rank =
// rank) on its worker, after splitting the rank's agreement communicator off there. With
// opt.tp_sum one_shot (the default) it also turns on peer access between every pair of GPUs and
// allocates each rank's exchange buffers and flags (kernels.cuh, PeerSum), which the ranks' sums
// read over NVLink. Every call
// (prefill, decode, set_sampling, prewarm_graphs) posts the same call to every worker and returns
// when all have finished; rank 0's results are returned (every rank computes the same tokens).
// Logits: each rank writes its own vocabulary columns of the caller's span.
//
// The KV bookkeeping: kv() is rank 0's book, which leads the other ranks' books
// (PagedKvBook::add_follower): the caller's acquire_slot / ensure / release are applied to every
// rank's book, so all push the same block table.
//
// Failures: an input_error every rank throws (validation, identical on every rank) is rethrown and
// the engine stays usable. Any other exception on any rank (a failed step, lockstep_error) means
// the ranks' collectives no longer match: the communicators are aborted (which also ends
// collectives that other ranks wait in), the first rank's root-cause exception is rethrown, and
// every later call throws.
//
// Not thread-safe: one caller thread at a time. Move-only. The device loop (decode_loop) is refused
// (input_error): it runs on one GPU.
#pragma once

#include "model.hpp"

#if !QWEN_WITH_NCCL
#  error "qwen/tp.hpp needs NCCL (QWEN_WITH_NCCL: link replay_example_qwen built with replay::nccl)"
#endif

#include <replay/nccl.hpp>

#include <functional>
#include <memory>

namespace qwen {

class TpEngine final : public Decoder {
 public:
  /// Tensor parallel over devices 0..tp-1 (2 <= tp <= the device count; cfg must split:
  /// check_tp_split). `opt` holds every rank's sizes (its tp_size and tp_rank are set here);
  /// kv_budget_bytes is per GPU. Throws input_error for bad input before any GPU work.
  TpEngine(const Config& cfg, const EngineOptions& opt, const replay_examples::safetensors* weights, int tp);
  ~TpEngine() override;
  TpEngine(TpEngine&&) noexcept;
  TpEngine& operator=(TpEngine&&) noexcept;

  [[nodiscard]] int tp() const;
  /// Rank r's engine (r < tp); drive it only through for_each_rank.
  [[nodiscard]] Engine& rank(int r);
  /// Rank r's step communicator (for measurements of the step's collectives).
  [[nodiscard]] replay::nccl_comm_ref comm(int r) const;
  /// Rank r's view of the group's exchange buffers (options().tp_sum one_shot; else size 0), for
  /// measurements: a launch_peer_sum made outside the step must be made on every rank.
  [[nodiscard]] const PeerSum& peer_sum(int r) const;
  /// Runs f(r, rank r's engine) on every rank's worker thread (its device current) and returns when
  /// all have finished; failures as for the other calls. f must make the same collectives, in the
  /// same order, on every rank.
  void for_each_rank(const std::function<void(int, Engine&)>& f);

  [[nodiscard]] const Config& config() const override;
  [[nodiscard]] const EngineOptions& options() const override;  ///< rank 0's
  [[nodiscard]] PagedKvBook& kv() override;                       ///< rank 0's, which the others follow
  [[nodiscard]] replay::stream_ref stream() const override;       ///< rank 0's (device 0)
  [[nodiscard]] const std::vector<int>& buckets() const override;
  [[nodiscard]] int bucket_for(int rows) const override;
  int prefill(int slot, std::span<const int> tokens, int start, std::span<float> logits = {}) override;
  void decode(std::span<const DecodeRow> rows, bool use_graph, std::span<int> next,
              std::span<float> logits = {}) override;
  /// Always throws input_error (the device loop is single-GPU).
  int decode_loop(int slot, int token, int pos, int k, int stop_token, std::span<int> out) override;
  void set_sampling(const SampleParams& p) override;
  [[nodiscard]] const SampleParams& sampling() const override;
  std::size_t prewarm_graphs() override;
  [[nodiscard]] GraphStats graph_stats() const override;            ///< rank 0's
  [[nodiscard]] replay::pool_stats pool_stats() const override;     ///< rank 0's
  [[nodiscard]] std::string describe_kernels() const override;      ///< rank 0's
  [[nodiscard]] std::size_t weight_bytes() const override;          ///< per rank (rank 0)
  [[nodiscard]] std::size_t kv_pool_bytes() const override;         ///< per rank (rank 0)
  [[nodiscard]] std::size_t buffer_bytes() const override;          ///< per rank (rank 0)

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace qwen
