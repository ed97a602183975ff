// replay/warnings.hpp: where replay's one-time warnings go.
//
// A runner that falls back to eager execution, or a kill switch with a value it does not know, says
// so once through a `warning_sink`: a callable taking the message. The default writes
// "replay: warning: <message>" to stderr; an engine passes its own logger in the runner's options.
//
// Guarantees: the sinks are plain functions of their argument; nothing here is global state.
//
// Example:
//   replay::runner_options o{.warn = [&](std::string_view m) { log.warn("{}", m); }};
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <functional>
#include <string_view>

namespace replay {

/// Receives one warning message (no trailing newline).
using warning_sink = std::function<void(std::string_view)>;

/// The default sink: "replay: warning: <message>" on stderr.
inline void stderr_warning_sink(std::string_view message) {
  fmt::print(stderr, "replay: warning: {}\n", message);
}

}  // namespace replay
