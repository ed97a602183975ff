// examples/qwen/tools/tokenize_batch.cpp: the tokenizer on many strings at once, for the parity
// check against Hugging Face `tokenizers` and `tiktoken` (tokenizer_parity.py) and its speed.
//
//   qwen_tokenize_batch TOKENIZER IN.json OUT.json   # IN: a JSON array of strings; OUT: {"ids": [[...]],
//                                                    # "decoded": [...]} (decode of each encoding)
//   qwen_tokenize_batch TOKENIZER --bench TEXT [N]   # encode the file TEXT N times (default 5), single
//                                                    # thread; prints JSON: bytes, tokens, first and best MB/s
#include "qwen/tokenizer.hpp"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

namespace {

std::string read_all(const char* path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw qwen::tokenizer_error(std::string(path) + ": cannot read");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int bench(qwen::Tokenizer& tok, const std::string& text, int n) {
  double first = 0, best = 1e30;
  std::size_t tokens = 0;
  for (int i = 0; i < n; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    tokens = tok.encode(text).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i == 0) first = s;
    best = std::min(best, s);
  }
  const double mb = static_cast<double>(text.size()) / 1e6;
  std::cout << nlohmann::json{{"bytes", text.size()}, {"tokens", tokens}, {"first_mb_per_s", mb / first},
                              {"best_mb_per_s", mb / best}}
                   .dump()
            << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s TOKENIZER IN.json OUT.json | TOKENIZER --bench TEXT [N]\n", argv[0]);
    return 2;
  }
  try {
    qwen::Tokenizer tok = qwen::Tokenizer::from_file(argv[1]);
    if (std::string(argv[2]) == "--bench") return bench(tok, read_all(argv[3]), argc > 4 ? std::stoi(argv[4]) : 5);
    const auto in = nlohmann::json::parse(read_all(argv[2]));
    nlohmann::json ids = nlohmann::json::array(), decoded = nlohmann::json::array();
    for (const auto& s : in) {
      const std::vector<int> v = tok.encode(s.get<std::string>());
      ids.push_back(v);
      decoded.push_back(tok.decode(v));
    }
    std::ofstream(argv[3]) << nlohmann::json{{"ids", ids}, {"decoded", decoded}}.dump() << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
