// bug_head_order.cu: attention that processes the heads in the order `ls` lists their files.
//
// BUG (listed_heads, below): the program finds its heads by listing Q_head_*.txt and sorting the
// names as strings, then writes the i-th listed head's results as head i. "Q_head_10.txt" sorts
// before "Q_head_2.txt", so from 11 heads on, head 2 holds head 10's results, head 3 head 11's, and
// so on. Up to 10 heads the order is right and every check passes. Every step of the attention
// itself is the correct one (seed_steps.cuh).
//
// Build:  cmake --build build --target bug_head_order
// Run:    python3 -m verify generate --heads 12 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         cd build && ./bug_head_order random_test && cd ..
//         python3 -m verify check
// attnstep reports: first failing stage KT, diagnosis `head_permuted` (head 2 holds head 10's
// result, ...), and every later stage of those heads.
#include <algorithm>

#include "seed_steps.cuh"

std::vector<int> listed_heads(const std::string& in_dir) {
  const std::string prefix = "Q_head_";
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(in_dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) names.push_back(name);
  }
  std::sort(names.begin(), names.end());  // BUG: by name, not by head number
  std::vector<int> heads;
  for (const std::string& name : names) heads.push_back(std::stoi(name.substr(prefix.size())));
  if (heads.empty()) seed::fail(in_dir + ": no Q_head_*.txt files");
  return heads;
}

int main(int argc, char** argv) {
  seed::Steps steps;
  steps.input_heads = listed_heads;
  return seed::run(argc, argv, steps);
}
