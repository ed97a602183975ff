// examples/qwen/tp.cu: TpEngine (tp.hpp): the communicators, one worker thread per rank, and the
// calls posted to every rank.
#include "tp.hpp"

#include <replay/error.hpp>
#include <replay/lockstep.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

namespace qwen {

namespace {

bool is_input_error(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const input_error&) {
    return true;
  } catch (...) {
    return false;
  }
}

bool is_lockstep_error(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const replay::lockstep_error&) {
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

/// One rank's memory for the sums over peer memory (TpSum::one_shot), on its device: two exchange
/// buffers of rows x hidden floats, the flags the other ranks write, and its own call counts.
struct PeerMemory {
  replay::device_buffer<float> exchange;
  replay::device_buffer<unsigned> flags, calls;
};

struct TpEngine::Impl {
  Config cfg;
  int tp = 0;
  std::vector<replay::nccl_comm> comms;  // the step's collectives, rank r on device r
  std::vector<replay::nccl_comm> agree;  // the lockstep runners' agreements (split off comms)
  std::vector<PeerMemory> peer_mem;      // TpSum::one_shot: rank r's on device r (outlives the engines)
  std::vector<PeerSum> sums;             // TpSum::one_shot: rank r's view of peer_mem (else size 0)
  std::vector<std::optional<Engine>> engines;
  std::vector<std::vector<int>> scratch;  // ranks 1..: their tokens (compared with rank 0's)
  bool broken = false;                    // a rank failed mid-call: communicators aborted

  // The workers: each waits for a new generation, runs *job(rank) and counts itself done.
  std::vector<std::thread> threads;
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  const std::function<void(int)>* job = nullptr;
  std::uint64_t generation = 0;
  int pending = 0;
  bool fatal = false;  // this call: some rank threw something other than input_error
  bool quit = false;
  std::vector<std::exception_ptr> errors;

  void worker(int r) {
    std::uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* f = nullptr;
      {
        std::unique_lock lock(mu);
        work_cv.wait(lock, [&] { return quit || generation != seen; });
        if (quit) return;
        seen = generation;
        f = job;
      }
      std::exception_ptr e;
      try {
        REPLAY_CHECK(cudaSetDevice(r));
        (*f)(r);
      } catch (...) {
        e = std::current_exception();
      }
      {
        const std::lock_guard lock(mu);
        errors[static_cast<std::size_t>(r)] = e;
        if (e && !is_input_error(e)) fatal = true;
        --pending;
      }
      done_cv.notify_all();
    }
  }

  void start_workers() {
    errors.assign(static_cast<std::size_t>(tp), nullptr);
    try {
      for (int r = 0; r < tp; ++r) threads.emplace_back([this, r] { worker(r); });
    } catch (...) {
      stop_workers();
      throw;
    }
  }

  void stop_workers() noexcept {
    {
      const std::lock_guard lock(mu);
      quit = true;
    }
    work_cv.notify_all();
    for (auto& t : threads) t.join();
    threads.clear();
  }

  /// Posts f to every worker and waits for all. A failure other than input_error on any rank aborts
  /// the communicators at once (ranks waiting in a collective for it would wait forever). Returns
  /// the ranks' exceptions; never throws.
  std::vector<std::exception_ptr> post(const std::function<void(int)>& f) noexcept {
    std::unique_lock lock(mu);
    job = &f;
    errors.assign(static_cast<std::size_t>(tp), nullptr);
    pending = tp;
    fatal = false;
    ++generation;
    lock.unlock();
    work_cv.notify_all();
    lock.lock();
    done_cv.wait(lock, [&] { return pending == 0 || fatal; });
    if (fatal) {
      lock.unlock();
      abort_comms();
      lock.lock();
      done_cv.wait(lock, [&] { return pending == 0; });
    }
    job = nullptr;
    return errors;
  }

  /// post(), then rethrows: a failure on one rank breaks the engine; see tp.hpp.
  void run(const std::function<void(int)>& f) {
    if (broken)
      throw std::runtime_error("qwen::TpEngine: an earlier call failed on a rank and aborted the communicators; "
                               "build a new engine");
    const std::vector<std::exception_ptr> errs = post(f);
    std::exception_ptr first, cause;
    bool all_input = true;
    for (const auto& e : errs) {
      if (!e) continue;
      if (!first) first = e;
      if (!cause && !is_lockstep_error(e)) cause = e;
      all_input = all_input && is_input_error(e);
    }
    if (!first) return;
    if (!all_input) {
      abort_comms();  // already done when a rank failed while others still ran
      broken = true;
    }
    std::rethrow_exception(cause ? cause : first);
  }

  /// Aborts every communicator. Runs while a rank's exception is being rethrown, so a failed abort
  /// is reported on stderr rather than thrown.
  void abort_comms() noexcept {
    auto abort_one = [](replay::nccl_comm& c, const char* which, std::size_t r) {
      if (const ncclResult_t e = c.abort(); e != ncclSuccess)
        std::fprintf(stderr, "qwen::TpEngine: ncclCommAbort of rank %zu's %s communicator failed: %s\n", r, which,
                     ncclGetErrorString(e));
    };
    for (std::size_t r = 0; r < comms.size(); ++r) abort_one(comms[r], "step", r);
    for (std::size_t r = 0; r < agree.size(); ++r) abort_one(agree[r], "agreement", r);
    broken = true;
  }

  ~Impl() {
    if (!threads.empty()) {
      // The engines first (their graphs hold the communicators' collectives), each on its device.
      if (!engines.empty() && engines[0]) engines[0]->kv().clear_followers();
      const std::function<void(int)> destroy = [this](int r) { engines[static_cast<std::size_t>(r)].reset(); };
      (void)post(destroy);
      stop_workers();
    }
    engines.clear();
    replay::destroy_all(agree);
    replay::destroy_all(comms);
  }
};

TpEngine::TpEngine(const Config& cfg, const EngineOptions& opt, const replay_examples::safetensors* weights, int tp)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  cfg.validate();
  if (tp < 2) throw input_error(fmt::format("TpEngine: {} ranks; tensor parallel needs at least 2 (one GPU: Engine)", tp));
  EngineOptions o = opt;
  o.tp_size = tp;
  o.tp_rank = 0;
  o.validate(cfg);
  if (weights != nullptr) check_weights(cfg, *weights);
  int devices = 0;
  REPLAY_CHECK(cudaGetDeviceCount(&devices));
  if (tp > devices) throw input_error(fmt::format("--tp {} needs {} GPUs (one rank per GPU); {} present", tp, tp, devices));
  const bool one_shot = o.tp_sum == TpSum::one_shot;
  if (one_shot) {
    if (tp > kMaxPeers)
      throw input_error(fmt::format("--tp {}: the one-shot sum joins at most {} ranks (--tp-sum nccl)", tp, kMaxPeers));
    for (int a = 0; a < tp; ++a)
      for (int b = 0; b < tp; ++b) {
        if (a == b) continue;
        int ok = 0;
        REPLAY_CHECK(cudaDeviceCanAccessPeer(&ok, a, b));
        if (ok == 0)
          throw input_error(fmt::format("--tp {}: GPU {} cannot access GPU {}'s memory, which the one-shot sum "
                                        "needs (--tp-sum nccl)", tp, a, b));
      }
  }
  // ---- GPU work starts here -------------------------------------------------------------------
  m.cfg = cfg;
  m.tp = tp;
  std::vector<int> ids(static_cast<std::size_t>(tp));
  std::iota(ids.begin(), ids.end(), 0);
  m.comms = replay::nccl_comm::init_all(ids);
  m.agree.resize(ids.size());
  m.engines.resize(ids.size());
  m.scratch.assign(ids.size(), std::vector<int>(static_cast<std::size_t>(o.max_batch)));
  m.start_workers();
  // Rows x hidden floats per exchange slot: what the engine's activation buffers hold.
  const std::size_t slot_floats = std::size_t(std::max(o.max_batch, o.prefill_chunk)) * cfg.hidden_size;
  if (one_shot) m.peer_mem.resize(ids.size());
  m.run([&](int r) {
    const auto i = static_cast<std::size_t>(r);
    m.agree[i] = m.comms[i].split();  // collective: every worker at once
    if (!one_shot) return;
    for (int q = 0; q < tp; ++q) {
      if (q == r) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(q, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();  // NCCL may have done it
      else REPLAY_CHECK(e);
    }
    PeerMemory& pm = m.peer_mem[i];
    pm.exchange = replay::device_buffer<float>(2 * slot_floats);
    pm.flags = replay::device_buffer<unsigned>(std::size_t(kMaxPeers) * kPeerSumBlocks);
    pm.calls = replay::device_buffer<unsigned>(kPeerSumBlocks);
    REPLAY_CHECK(cudaMemset(pm.exchange.data(), 0, pm.exchange.size_bytes()));
    REPLAY_CHECK(cudaMemset(pm.flags.data(), 0, pm.flags.size_bytes()));
    REPLAY_CHECK(cudaMemset(pm.calls.data(), 0, pm.calls.size_bytes()));
    REPLAY_CHECK(cudaDeviceSynchronize());
  });
  // Every rank's view of the group: the same buffers, its own rank and call counts.
  auto& sums = m.sums;
  sums.resize(ids.size());
  for (std::size_t r = 0; one_shot && r < ids.size(); ++r) {
    PeerSum& ps = sums[r];
    for (std::size_t q = 0; q < ids.size(); ++q) {
      ps.in[q][0] = m.peer_mem[q].exchange.data();
      ps.in[q][1] = m.peer_mem[q].exchange.data() + slot_floats;
      ps.flags[q] = m.peer_mem[q].flags.data();
    }
    ps.calls = m.peer_mem[r].calls.data();
    ps.rank = static_cast<int>(r), ps.size = tp;
  }
  m.run([&](int r) {
    const auto i = static_cast<std::size_t>(r);
    EngineOptions ro = o;
    ro.tp_rank = r;
    m.engines[i].emplace(cfg, ro, weights, TpComms{m.comms[i].ref(), m.agree[i].ref(), sums[i]});
  });
  for (int r = 1; r < tp; ++r) m.engines[0]->kv().add_follower(m.engines[static_cast<std::size_t>(r)]->kv());
}

TpEngine::~TpEngine() = default;
TpEngine::TpEngine(TpEngine&&) noexcept = default;
TpEngine& TpEngine::operator=(TpEngine&&) noexcept = default;

int TpEngine::tp() const { return impl_->tp; }
Engine& TpEngine::rank(int r) { return *impl_->engines.at(static_cast<std::size_t>(r)); }
replay::nccl_comm_ref TpEngine::comm(int r) const { return impl_->comms.at(static_cast<std::size_t>(r)).ref(); }
const PeerSum& TpEngine::peer_sum(int r) const { return impl_->sums.at(static_cast<std::size_t>(r)); }
void TpEngine::for_each_rank(const std::function<void(int, Engine&)>& f) {
  impl_->run([&](int r) { f(r, *impl_->engines[static_cast<std::size_t>(r)]); });
}

const Config& TpEngine::config() const { return impl_->cfg; }
const EngineOptions& TpEngine::options() const { return impl_->engines[0]->options(); }
PagedKvBook& TpEngine::kv() { return impl_->engines[0]->kv(); }
replay::stream_ref TpEngine::stream() const { return impl_->engines[0]->stream(); }
const std::vector<int>& TpEngine::buckets() const { return impl_->engines[0]->buckets(); }
int TpEngine::bucket_for(int rows) const { return impl_->engines[0]->bucket_for(rows); }
const SampleParams& TpEngine::sampling() const { return impl_->engines[0]->sampling(); }
GraphStats TpEngine::graph_stats() const { return impl_->engines[0]->graph_stats(); }
replay::pool_stats TpEngine::pool_stats() const { return impl_->engines[0]->pool_stats(); }
std::string TpEngine::describe_kernels() const {
  return fmt::format("tensor parallel over {} GPUs; rank 0's {}", impl_->tp, impl_->engines[0]->describe_kernels());
}
std::size_t TpEngine::weight_bytes() const { return impl_->engines[0]->weight_bytes(); }
std::size_t TpEngine::kv_pool_bytes() const { return impl_->engines[0]->kv_pool_bytes(); }
std::size_t TpEngine::buffer_bytes() const { return impl_->engines[0]->buffer_bytes(); }

int TpEngine::prefill(int slot, std::span<const int> tokens, int start, std::span<float> logits) {
  auto& m = *impl_;
  if (!logits.empty() && logits.size() < std::size_t(m.cfg.vocab_size))
    throw replay::usage_error("prefill: logits span smaller than the vocabulary");
  std::vector<int> next(static_cast<std::size_t>(m.tp));
  m.run([&](int r) { next[static_cast<std::size_t>(r)] = m.engines[static_cast<std::size_t>(r)]->prefill(slot, tokens, start, logits); });
  for (int r = 1; r < m.tp; ++r)
    if (next[static_cast<std::size_t>(r)] != next[0])
      throw std::runtime_error(fmt::format("qwen::TpEngine::prefill: rank {} chose token {}, rank 0 token {}", r,
                                           next[static_cast<std::size_t>(r)], next[0]));
  return next[0];
}

void TpEngine::decode(std::span<const DecodeRow> rows, bool use_graph, std::span<int> next, std::span<float> logits) {
  auto& m = *impl_;
  const std::size_t n = rows.size();
  if (next.size() < n) throw replay::usage_error("decode: `next` smaller than the number of rows");
  if (!logits.empty() && logits.size() < n * std::size_t(m.cfg.vocab_size))
    throw replay::usage_error("decode: logits span smaller than rows x vocab");
  for (auto& s : m.scratch)
    if (s.size() < n) s.resize(n);
  m.run([&](int r) {
    const auto i = static_cast<std::size_t>(r);
    m.engines[i]->decode(rows, use_graph, r == 0 ? next : std::span<int>(m.scratch[i].data(), n), logits);
  });
  for (int r = 1; r < m.tp; ++r)
    for (std::size_t i = 0; i < n; ++i)
      if (m.scratch[static_cast<std::size_t>(r)][i] != next[i])
        throw std::runtime_error(fmt::format("qwen::TpEngine::decode: rank {} chose token {} for row {}, rank 0 token {}",
                                             r, m.scratch[static_cast<std::size_t>(r)][i], i, next[i]));
}

int TpEngine::decode_loop(int, int, int, int, int, std::span<int>) {
  throw input_error("decode_loop: the device loop runs on one GPU; with tensor parallel (--tp) decode one step per call");
}

void TpEngine::set_sampling(const SampleParams& p) {
  p.validate();  // on the caller: every rank would throw the same
  impl_->run([&](int r) { impl_->engines[static_cast<std::size_t>(r)]->set_sampling(p); });
}

std::size_t TpEngine::prewarm_graphs() {
  std::vector<std::size_t> n(static_cast<std::size_t>(impl_->tp));
  impl_->run([&](int r) {
    n[static_cast<std::size_t>(r)] = impl_->engines[static_cast<std::size_t>(r)]->prewarm_graphs();
  });
  return n[0];
}

}  // namespace qwen
