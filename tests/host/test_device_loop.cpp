// Host tests of the device loop's stop rule (device_loop.hpp) and its names.
#include <doctest/doctest.h>
#include <replay/device_loop.hpp>

using replay::loop_stop;
using replay::stop_reason;

TEST_CASE("the loop goes on until the step limit") {
  for (int produced = 1; produced < 16; ++produced) CHECK(stop_reason(produced, 7, false, 16, -1, 64) == loop_stop::running);
  CHECK(stop_reason(16, 7, false, 16, -1, 64) == loop_stop::steps);
  CHECK(stop_reason(1, 7, false, 1, -1, 64) == loop_stop::steps);
}

TEST_CASE("a stop token outranks the context, which outranks the step limit") {
  CHECK(stop_reason(3, 5, false, 16, 5, 64) == loop_stop::stop_token);
  CHECK(stop_reason(16, 5, true, 16, 5, 64) == loop_stop::stop_token);
  CHECK(stop_reason(16, 4, true, 16, 5, 64) == loop_stop::context);
  CHECK(stop_reason(2, 4, true, 16, 5, 64) == loop_stop::context);
  CHECK(stop_reason(16, 4, false, 16, 5, 64) == loop_stop::steps);
}

TEST_CASE("no stop token: -1 never matches, token 0 is an ordinary token") {
  CHECK(stop_reason(1, 0, false, 8, -1, 64) == loop_stop::running);
  CHECK(stop_reason(1, -1, false, 8, -1, 64) == loop_stop::running);
  CHECK(stop_reason(1, 0, false, 8, 0, 64) == loop_stop::stop_token);
}

TEST_CASE("the capacity stops a loop whose limit is larger") {
  CHECK(stop_reason(4, 1, false, 100, -1, 4) == loop_stop::steps);
}

TEST_CASE("stop reasons have names") {
  CHECK(replay::to_string(loop_stop::running) == "running");
  CHECK(replay::to_string(loop_stop::steps) == "steps");
  CHECK(replay::to_string(loop_stop::stop_token) == "stop token");
  CHECK(replay::to_string(loop_stop::context) == "context full");
}

static_assert(stop_reason(2, 9, false, 2, -1, 8) == loop_stop::steps, "usable in constant expressions");
