// Host tests: static_arena layout arithmetic (alignment, capacity, freezing) without a device.
#include <doctest/doctest.h>
#include <replay/buffer.hpp>

using replay::detail::align_up;
using replay::detail::arena_layout;

TEST_CASE("align_up") {
  static_assert(align_up(0, 256) == 0);
  static_assert(align_up(1, 256) == 256);
  static_assert(align_up(256, 256) == 256);
  static_assert(align_up(257, 16) == 272);
  CHECK(replay::detail::is_power_of_two(1024));
  CHECK_FALSE(replay::detail::is_power_of_two(0));
  CHECK_FALSE(replay::detail::is_power_of_two(48));
}

TEST_CASE("arena layout aligns every sub-buffer and counts capacity") {
  arena_layout a(4096);
  CHECK(a.reserve(10, 256) == 0);
  CHECK(a.used() == 10);
  CHECK(a.reserve(4, 4) == 12);       // 10 -> aligned to 4
  CHECK(a.reserve(100, 256) == 256);  // 16 -> aligned to 256
  CHECK(a.used() == 356);
  CHECK(a.remaining() == 4096 - 356);
  CHECK(a.allocations() == 3);
}

TEST_CASE("arena layout: exactly full fits, one byte more throws") {
  arena_layout a(1024);
  CHECK(a.reserve(512, 256) == 0);
  CHECK(a.reserve(512, 256) == 512);
  CHECK(a.remaining() == 0);
  CHECK_THROWS_AS(a.reserve(1, 1), replay::usage_error);
  arena_layout b(1000);
  CHECK(b.reserve(1, 1) == 0);
  CHECK_THROWS_AS(b.reserve(1000, 1), replay::usage_error);  // alignment padding pushes past the end
  CHECK_THROWS_AS(b.reserve(745, 256), replay::usage_error);  // 256 + 745 > 1000
  CHECK(b.reserve(744, 256) == 256);                          // 256 + 744 == 1000: fits exactly
}

TEST_CASE("arena layout: freeze, bad alignment and overflow") {
  arena_layout a(1 << 20);
  (void)a.reserve(64, 64);
  a.freeze();
  CHECK(a.frozen());
  CHECK_THROWS_WITH_AS(a.reserve(64, 64), doctest::Contains("after freeze()"), replay::usage_error);
  arena_layout b(1 << 20);
  CHECK_THROWS_WITH_AS(b.reserve(8, 48), doctest::Contains("power of two"), replay::usage_error);
  CHECK_THROWS_WITH_AS(b.reserve(static_cast<std::size_t>(-1), 1), doctest::Contains("out of capacity"),
                       replay::usage_error);
  CHECK(b.used() == 0);  // failed reservations allocate nothing
}

TEST_CASE("device_span views") {
  float storage[8] = {};
  replay::device_span<float> s{storage, 8};
  CHECK(s.size_bytes() == 32);
  CHECK(s.subspan(2, 3).data() == storage + 2);
  replay::device_span<const float> c = s;
  CHECK(c.size() == 8);
}
