// bench.h — `main --bench ...`: the benchmark entry point.
// main() hands it the untouched argc/argv (argv[0] is the program, "--bench" is among the rest),
// so the benchmark owns its own options. The CUDA build implements it (bench/bench.cu); the
// CPU-only build links the stub in cuda_stub.cpp, which fails with exit 2.
// Returns the process exit status (common.h's ExitCode); may throw attnstep::Error, which main()
// reports like any other error.
#pragma once

namespace attnstep {

int run_bench(int argc, char** argv);

// `main --bench-decode ...`: the split-KV decode kernel on a paged cache (bench/bench_decode.cu).
int run_decode_bench(int argc, char** argv);

// `main --bench-varlen ...`: the flash forward on a packed batch of random lengths beside a dense
// batch at their mean length (bench/bench_varlen.cu).
int run_varlen_bench(int argc, char** argv);

}  // namespace attnstep
