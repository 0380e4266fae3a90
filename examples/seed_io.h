// seed_io.h: the file side every example shares, in the classic course layout.
//
//   ./program CASE [--causal]     run from the build folder
//
// reads ../data/CASE/{Q,K,V}_head_<i>.txt (one matrix row per line, as np.savetxt writes them),
// takes N, M, d_k, d_v from the files and `causal` / `scale` from ../data/CASE/manifest.toml when
// it is there, and writes ../data/<CASE with _test replaced by _verify>/<stage>_head_<i>.txt
// through a plain std::ofstream (default precision: 6 significant digits).
#pragma once

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace seed {

[[noreturn]] inline void fail(const std::string& what) {
  std::cerr << "error: " << what << "\n";
  std::exit(2);
}

struct Matrix {
  int rows = 0, cols = 0;
  std::vector<float> data;
};

inline Matrix read_matrix(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(path + ": cannot open");
  Matrix m;
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    if (!line.empty() && line[0] == '#') continue;
    std::istringstream row(line);
    int n = 0;
    for (float v; row >> v; ++n) m.data.push_back(v);
    if (!row.eof()) fail(path + ":" + std::to_string(lineno) + ": not a number");
    if (n == 0) continue;
    if (m.rows > 0 && n != m.cols)
      fail(path + ":" + std::to_string(lineno) + ": " + std::to_string(n) + " values, expected " +
           std::to_string(m.cols));
    m.cols = n;
    ++m.rows;
  }
  if (m.rows == 0) fail(path + ": no matrix rows");
  return m;
}

inline void write_matrix(const std::string& path, const std::vector<float>& data, int rows, int cols) {
  std::ofstream out(path);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) out << (c ? " " : "") << data[(size_t)r * cols + c];
    out << "\n";
  }
  if (!out) fail(path + ": cannot write");
}

inline std::string head_file(const std::string& dir, const std::string& name, int head) {
  return dir + "/" + name + "_head_" + std::to_string(head) + ".txt";
}

// Heads 0, 1, 2, ... for as long as Q_head_<i>.txt exists.
inline std::vector<int> numbered_heads(const std::string& in_dir) {
  std::vector<int> heads;
  while (std::filesystem::exists(head_file(in_dir, "Q", (int)heads.size()))) heads.push_back((int)heads.size());
  if (heads.empty()) fail(head_file(in_dir, "Q", 0) + ": no such file");
  return heads;
}

struct Case {
  std::string in_dir, out_dir;
  bool causal = false;
  float scale = 0.f;  // 0: 1/sqrt(d_k)
};

// `causal = true` and `scale = S` from the flat manifest.toml, if there is one.
inline void read_manifest(Case& cs) {
  std::ifstream in(cs.in_dir + "/manifest.toml");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream kv(line);
    std::string key, eq, value;
    if (!(kv >> key >> eq >> value) || eq != "=") continue;
    if (key == "causal") cs.causal = cs.causal || value == "true";
    if (key != "scale") continue;
    char* end = nullptr;
    cs.scale = std::strtof(value.c_str(), &end);
    if (*end != '\0' || !std::isfinite(cs.scale) || cs.scale == 0.f)
      fail(cs.in_dir + "/manifest.toml: scale = " + value + ": not a finite non-zero number");
  }
}

inline Case open_case(int argc, char** argv) {
  if (argc < 2) fail(std::string("usage: ") + argv[0] + " CASE [--causal]   (reads ../data/CASE)");
  Case cs;
  const std::string name = argv[1];
  for (int a = 2; a < argc; ++a) {
    if (std::string(argv[a]) != "--causal") fail(std::string("unknown option ") + argv[a]);
    cs.causal = true;
  }
  cs.in_dir = "../data/" + name;
  const std::string suffix = "_test";
  const bool test_case = name.size() > suffix.size() &&
                         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  cs.out_dir = "../data/" + (test_case ? name.substr(0, name.size() - suffix.size()) : name) + "_verify";
  if (!std::filesystem::is_directory(cs.in_dir)) fail(cs.in_dir + ": no such folder");
  read_manifest(cs);
  return cs;
}

inline void create_output_dir(const Case& cs) {
  std::error_code err;
  std::filesystem::create_directories(cs.out_dir, err);
  if (err) fail(cs.out_dir + ": cannot create: " + err.message());
}

}  // namespace seed
