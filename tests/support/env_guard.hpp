// Test helper: sets REPLAY_CUDA_GRAPHS for one scope (re-parsed by the library) and restores the
// previous value afterwards. Shared by the host and GPU runner tests.
#pragma once
#include <replay/runner.hpp>

#include <cstdlib>
#include <optional>
#include <string>

namespace replay_test {

struct env_guard {
  std::optional<std::string> old;
  explicit env_guard(const char* value) {
    if (const char* o = std::getenv(replay::graphs_env_var)) old = o;
    if (value) setenv(replay::graphs_env_var, value, 1); else unsetenv(replay::graphs_env_var);
    replay::refresh_graphs_env();
  }
  ~env_guard() {
    if (old) setenv(replay::graphs_env_var, old->c_str(), 1); else unsetenv(replay::graphs_env_var);
    replay::refresh_graphs_env();
  }
  env_guard(const env_guard&) = delete;
  env_guard& operator=(const env_guard&) = delete;
};

}  // namespace replay_test
