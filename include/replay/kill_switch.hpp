// replay/kill_switch.hpp: REPLAY_CUDA_GRAPHS, the process-wide switch that turns CUDA graphs off.
//
// The environment variable REPLAY_CUDA_GRAPHS, read once per process, turns graphs off for every
// step_runner when it is 0, false, off or no (any case); 1, true, on, yes or unset leave them on;
// anything else warns once (through the runner's warning sink) and leaves them on. It is the one
// environment variable replay reads: an operator's switch for a misbehaving deployment, not an
// option (options are struct fields: runner_options::use_graphs). `parse_graphs_switch()` is the
// pure parser; `refresh_graphs_env()` re-reads the variable (tests, or a program that sets it).
//
// Guarantees: reading is thread-safe (an atomic, parsed once); runners read it when constructed.
//
// Example:
//   if (!replay::graphs_env().enabled) fmt::print("CUDA graphs are off (REPLAY_CUDA_GRAPHS)\n");
#pragma once

#include <replay/warnings.hpp>

#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

namespace replay {

/// The name of the kill-switch environment variable.
inline constexpr const char* graphs_env_var = "REPLAY_CUDA_GRAPHS";

/// The meaning of a REPLAY_CUDA_GRAPHS value.
struct graphs_switch {
  bool enabled = true;     ///< graphs allowed
  bool recognised = true;  ///< the value was one of the known words (or unset)
  friend constexpr bool operator==(const graphs_switch&, const graphs_switch&) noexcept = default;
};

/// Parses a REPLAY_CUDA_GRAPHS value (nullopt = unset). Case-insensitive, surrounding blanks
/// ignored. 0/false/off/no disable; 1/true/on/yes, unset or empty enable; anything else enables
/// and is not recognised (the caller warns).
[[nodiscard]] constexpr graphs_switch parse_graphs_switch(std::optional<std::string_view> value) noexcept {
  if (!value) return {true, true};
  std::string_view v = *value;
  constexpr std::string_view blanks = " \t\r\n";
  while (!v.empty() && blanks.find(v.front()) != std::string_view::npos) v.remove_prefix(1);
  while (!v.empty() && blanks.find(v.back()) != std::string_view::npos) v.remove_suffix(1);
  if (v.empty()) return {true, true};
  const auto is = [&](std::string_view word) {
    if (v.size() != word.size()) return false;
    for (std::size_t i = 0; i < v.size(); ++i) {
      char c = v[i];
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      if (c != word[i]) return false;
    }
    return true;
  };
  for (const std::string_view off : {"0", "false", "off", "no"})
    if (is(off)) return {false, true};
  for (const std::string_view on : {"1", "true", "on", "yes"})
    if (is(on)) return {true, true};
  return {true, false};
}

namespace detail {

// Packed switch state: bit 0 enabled, bit 1 recognised, bit 2 parsed, bit 3 warning already given.
inline std::atomic<unsigned>& graphs_switch_state() noexcept {
  static std::atomic<unsigned> state{0};
  return state;
}

inline unsigned read_graphs_env() noexcept {
  const char* raw = std::getenv(graphs_env_var);  // NOLINT: read once, before threads matter
  const graphs_switch sw =
      parse_graphs_switch(raw ? std::optional<std::string_view>(raw) : std::nullopt);
  return (sw.enabled ? 1u : 0u) | (sw.recognised ? 2u : 0u) | 4u;
}

}  // namespace detail

/// REPLAY_CUDA_GRAPHS as parsed once per process (the first call reads the environment).
[[nodiscard]] inline graphs_switch graphs_env() noexcept {
  auto& st = detail::graphs_switch_state();
  unsigned v = st.load(std::memory_order_acquire);
  if ((v & 4u) == 0) {
    unsigned expected = v;
    const unsigned parsed = detail::read_graphs_env();
    st.compare_exchange_strong(expected, parsed, std::memory_order_acq_rel);
    v = st.load(std::memory_order_acquire);
  }
  return {(v & 1u) != 0, (v & 2u) != 0};
}

/// Re-reads REPLAY_CUDA_GRAPHS (for tests, or a program that sets it with setenv after start).
/// Runners created before keep the setting they started with.
inline graphs_switch refresh_graphs_env() noexcept {
  detail::graphs_switch_state().store(detail::read_graphs_env(), std::memory_order_release);
  return graphs_env();
}

namespace detail {
/// Warns once per process (through `sink`) when REPLAY_CUDA_GRAPHS held an unknown value.
inline void warn_unrecognised_graphs_env(const warning_sink& sink) {
  if (graphs_env().recognised) return;
  auto& st = graphs_switch_state();
  const unsigned before = st.fetch_or(8u, std::memory_order_acq_rel);
  if ((before & 8u) != 0) return;
  const char* raw = std::getenv(graphs_env_var);  // NOLINT
  const std::string msg =
      fmt::format("{}='{}' is not one of 0/false/off/no or 1/true/on/yes; CUDA graphs stay enabled",
                  graphs_env_var, raw ? raw : "");
  if (sink) sink(msg); else stderr_warning_sink(msg);
}
}  // namespace detail

}  // namespace replay
