// Consumer check: the installed headers compile and link (no GPU needed to run).
#include <replay/replay.hpp>

#include <fmt/format.h>

int main() {
  replay::detail::arena_layout layout(1024);
  const auto offset = layout.reserve(100, 256);
  fmt::print("replay {} consumer ok (offset {})\n", replay::version_string, offset);
  return offset == 0 ? 0 : 1;
}
