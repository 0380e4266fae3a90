// seed_steps.cuh: the correct attention steps and the per-head driver the examples share.
//
// Per head: KT = transpose(K) (kernel), QK = Q·KT (cublasSgemm), QK_scaled = QK·scale with -inf
// above the diagonal when causal (kernel), attention_weights = row softmax (kernel), output =
// attention_weights·V (cublasSgemm), and a tiled FlashAttention forward (flash_output and its
// natural-log log-sum-exp flash_lse). correct_seed.cu runs these steps as they are; every other
// example replaces exactly one of them (seed::Steps) with a buggy version in its own file.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <type_traits>

#include "seed_io.h"

#define CUDA_CHECK(call)                                                                       \
  do {                                                                                         \
    cudaError_t err_ = (call);                                                                 \
    if (err_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));       \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

#define CUBLAS_CHECK(call)                                                                     \
  do {                                                                                         \
    cublasStatus_t st_ = (call);                                                               \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                        \
      std::fprintf(stderr, "%s:%d: cuBLAS status %d\n", __FILE__, __LINE__, (int)st_);         \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace seed {

constexpr int TILE = 16;  // 2D thread blocks of the element-wise kernels
inline dim3 grid_2d(int rows, int cols) { return dim3((cols + TILE - 1) / TILE, (rows + TILE - 1) / TILE); }

// ------------------------------------------------------------------ the stage path

__global__ void transpose_kernel(const float* K, float* KT, int M, int d) {
  int r = blockIdx.y * blockDim.y + threadIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < M && c < d) KT[(size_t)c * M + r] = K[(size_t)r * d + c];
}

inline void transpose_K(const float* K, float* KT, int M, int d) {
  transpose_kernel<<<grid_2d(M, d), dim3(TILE, TILE)>>>(K, KT, M, d);
}

// S (N×M, row-major) = Q (N×d) · KT (d×M). cuBLAS is column-major: a row-major R×C buffer is a
// column-major C×R matrix, so it computes Sᵀ (M×N) = KTᵀ (M×d, lda = M) · Qᵀ (d×N, ldb = d).
inline void qk_gemm(cublasHandle_t handle, const float* Q, const float* KT, float* S, int N, int M, int d) {
  const float one = 1.f, zero = 0.f;
  CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, M, N, d, &one, KT, M, Q, d, &zero, S, M));
}

__global__ void scale_mask_kernel(const float* S, float* out, int N, int M, float scale, bool causal) {
  int r = blockIdx.y * blockDim.y + threadIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= N || c >= M) return;
  out[(size_t)r * M + c] = (causal && c > r) ? -INFINITY : S[(size_t)r * M + c] * scale;
}

inline void scale_and_mask(const float* S, float* out, int N, int M, float scale, bool causal) {
  scale_mask_kernel<<<grid_2d(N, M), dim3(TILE, TILE)>>>(S, out, N, M, scale, causal);
}

// One thread per row: subtract the row maximum, exponentiate, divide by the row sum.
__global__ void softmax_rows_kernel(const float* S, float* P, int N, int M) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= N) return;
  const float* s = S + (size_t)r * M;
  float mx = -INFINITY, sum = 0.f;
  for (int c = 0; c < M; ++c) mx = fmaxf(mx, s[c]);
  for (int c = 0; c < M; ++c) sum += expf(s[c] - mx);
  for (int c = 0; c < M; ++c) P[(size_t)r * M + c] = expf(s[c] - mx) / sum;
}

inline void softmax_rows(const float* S, float* P, int N, int M) {
  softmax_rows_kernel<<<(N + 127) / 128, 128>>>(S, P, N, M);
}

// O (N×d_v) = P (N×M) · V (M×d_v), as Oᵀ = Vᵀ · Pᵀ in cuBLAS's column-major terms.
inline void pv_gemm(cublasHandle_t handle, const float* P, const float* V, float* O, int N, int M, int d_v) {
  const float one = 1.f, zero = 0.f;
  CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, d_v, N, M, &one, V, d_v, P, M, &zero, O, d_v));
}

// ------------------------------------------------------------------ FlashAttention forward
// One thread per query row, FLASH_BR rows per block; K and V pass through shared memory in tiles
// of FLASH_BC keys. The softmax runs online in base 2 (scores times scale·log2 e, exp2f), as
// FlashAttention does; the log-sum-exp goes back to the natural log at the end.

constexpr int FLASH_BR = 64;
constexpr int FLASH_BC = 32;
constexpr float LOG2_E = 1.4426950408889634f;
constexpr float LN_2 = 0.6931471805599453f;

// Keys [k0, k0 + FLASH_BC) of K and V into shared memory (zeros past M), by all threads together.
template <int D>
__device__ void load_kv_tile(float* Ks, float* Vs, const float* K, const float* V, int k0, int M) {
  for (int e = threadIdx.x; e < FLASH_BC * D; e += blockDim.x) {
    const int key = k0 + e / D;
    Ks[e] = key < M ? K[(size_t)key * D + e % D] : 0.f;
    Vs[e] = key < M ? V[(size_t)key * D + e % D] : 0.f;
  }
}

// One query row's running state: its base-2 scaled query, running maximum m, sum l and output.
template <int D>
struct FlashRow {
  float q[D], acc[D];
  float m = -INFINITY, l = 0.f;

  __device__ void load_query(const float* Q, int row, float scale) {
    for (int c = 0; c < D; ++c) {
      q[c] = Q[(size_t)row * D + c] * scale * LOG2_E;
      acc[c] = 0.f;
    }
  }

  // Folds one shared tile's keys into the row; keys past M (and past the row when causal) are out.
  __device__ void update(const float* Ks, const float* Vs, int k0, int row, int M, bool causal) {
    float s[FLASH_BC];
    float m_new = m;
    for (int j = 0; j < FLASH_BC; ++j) {
      const int key = k0 + j;
      float dot = 0.f;
      for (int c = 0; c < D; ++c) dot += q[c] * Ks[j * D + c];
      s[j] = (key < M && !(causal && key > row)) ? dot : -INFINITY;
      m_new = fmaxf(m_new, s[j]);
    }
    const float correction = exp2f(m - m_new);  // 0 on the first tile (m = -inf)
    l *= correction;
    for (int c = 0; c < D; ++c) acc[c] *= correction;
    for (int j = 0; j < FLASH_BC; ++j) {
      const float p = exp2f(s[j] - m_new);
      l += p;
      for (int c = 0; c < D; ++c) acc[c] += p * Vs[j * D + c];
    }
    m = m_new;
  }

  __device__ void store_output(float* O, int row) const {
    for (int c = 0; c < D; ++c) O[(size_t)row * D + c] = acc[c] / l;
  }

  // log Σ exp(scaled scores): the state is in base 2, so back to the natural log.
  __device__ float lse() const { return (m + log2f(l)) * LN_2; }
};

// Every key tile through shared memory, folded into this thread's row. A causal row skips the
// tiles that lie wholly ahead of it (the first tile always has key 0, so m becomes finite).
template <int D>
__device__ void flash_key_loop(FlashRow<D>& st, float* Ks, float* Vs, const float* K, const float* V,
                               int row, int N, int M, bool causal) {
  for (int k0 = 0; k0 < M; k0 += FLASH_BC) {
    load_kv_tile<D>(Ks, Vs, K, V, k0, M);
    __syncthreads();  // the tile is complete before anyone reads it
    if (row < N && !(causal && k0 > row)) st.update(Ks, Vs, k0, row, M, causal);
    __syncthreads();  // nobody reads the tile any more when the next load overwrites it
  }
}

template <int D>
__global__ void flash_forward_kernel(const float* Q, const float* K, const float* V, float* O, float* lse,
                                     int N, int M, float scale, bool causal) {
  __shared__ float Ks[FLASH_BC * D], Vs[FLASH_BC * D];
  const int row = blockIdx.x * FLASH_BR + threadIdx.x;
  FlashRow<D> st;
  if (row < N) st.load_query(Q, row, scale);
  flash_key_loop<D>(st, Ks, Vs, K, V, row, N, M, causal);
  if (row < N) {
    st.store_output(O, row);
    lse[row] = st.lse();
  }
}

// Calls launch(std::integral_constant<int, D>{}) for the head dimensions the flash kernels have.
inline bool flash_supports(int d) { return d == 16 || d == 32 || d == 64 || d == 128; }

template <typename Launch>
void with_head_dim(int d, Launch launch) {
  switch (d) {
    case 16: launch(std::integral_constant<int, 16>{}); break;
    case 32: launch(std::integral_constant<int, 32>{}); break;
    case 64: launch(std::integral_constant<int, 64>{}); break;
    case 128: launch(std::integral_constant<int, 128>{}); break;
    default: fail("flash attention needs d = 16, 32, 64 or 128, not " + std::to_string(d));
  }
}

inline void flash_forward(const float* Q, const float* K, const float* V, float* O, float* lse, int N, int M,
                          int d, float scale, bool causal) {
  with_head_dim(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    const int blocks = (N + FLASH_BR - 1) / FLASH_BR;
    flash_forward_kernel<D><<<blocks, FLASH_BR>>>(Q, K, V, O, lse, N, M, scale, causal);
  });
}

// ------------------------------------------------------------------ the program

// The steps of one head; each example swaps in its own version of one of them.
struct Steps {
  std::vector<int> (*input_heads)(const std::string& in_dir) = numbered_heads;  // input head of output i
  void (*transpose)(const float* K, float* KT, int M, int d) = transpose_K;
  void (*qk)(cublasHandle_t, const float* Q, const float* KT, float* S, int N, int M, int d) = qk_gemm;
  void (*scale_mask)(const float* S, float* out, int N, int M, float scale, bool causal) = scale_and_mask;
  void (*softmax)(const float* S, float* P, int N, int M) = softmax_rows;
  void (*pv)(cublasHandle_t, const float* P, const float* V, float* O, int N, int M, int d_v) = pv_gemm;
  void (*flash)(const float* Q, const float* K, const float* V, float* O, float* lse, int N, int M, int d,
                float scale, bool causal) = flash_forward;
};

struct DeviceMatrix {
  float* ptr = nullptr;
  int rows = 0, cols = 0;
  DeviceMatrix(int r, int c) : rows(r), cols(c) { CUDA_CHECK(cudaMalloc(&ptr, sizeof(float) * r * c)); }
  ~DeviceMatrix() { cudaFree(ptr); }
  DeviceMatrix(const DeviceMatrix&) = delete;
  DeviceMatrix& operator=(const DeviceMatrix&) = delete;
  void upload(const Matrix& m) {
    CUDA_CHECK(cudaMemcpy(ptr, m.data.data(), sizeof(float) * rows * cols, cudaMemcpyHostToDevice));
  }
  void save(const std::string& path) const {
    std::vector<float> host((size_t)rows * cols);
    CUDA_CHECK(cudaMemcpy(host.data(), ptr, sizeof(float) * host.size(), cudaMemcpyDeviceToHost));
    write_matrix(path, host, rows, cols);
  }
};

inline Matrix read_input(const Case& cs, const char* name, int head, int rows, int cols) {
  Matrix m = read_matrix(head_file(cs.in_dir, name, head));
  if (rows && (m.rows != rows || m.cols != cols))
    fail(head_file(cs.in_dir, name, head) + ": " + std::to_string(m.rows) + "x" + std::to_string(m.cols) +
         ", expected " + std::to_string(rows) + "x" + std::to_string(cols) + " as in head 0");
  return m;
}

inline int run(int argc, char** argv, const Steps& steps) {
  const Case cs = open_case(argc, argv);
  const std::vector<int> heads = steps.input_heads(cs.in_dir);
  const Matrix q0 = read_input(cs, "Q", heads[0], 0, 0), k0 = read_input(cs, "K", heads[0], 0, 0),
               v0 = read_input(cs, "V", heads[0], 0, 0);
  const int N = q0.rows, M = k0.rows, d = q0.cols, d_v = v0.cols;
  if (k0.cols != d || v0.rows != M) fail(cs.in_dir + ": Q, K and V of head 0 disagree on M or d_k");
  const float scale = cs.scale != 0.f ? cs.scale : 1.f / std::sqrt((float)d);
  const bool flash = d == d_v && flash_supports(d);
  create_output_dir(cs);

  cublasHandle_t handle;
  CUBLAS_CHECK(cublasCreate(&handle));
  DeviceMatrix Q(N, d), K(M, d), V(M, d_v), KT(d, M), QK(N, M), QK_scaled(N, M), P(N, M), O(N, d_v),
      flash_O(N, d_v), flash_lse(N, 1);
  // Each stage's file name (the stage name) and where it lives on the device.
  const std::pair<const char*, const DeviceMatrix*> stages[] = {
      {"KT", &KT}, {"QK", &QK}, {"QK_scaled", &QK_scaled}, {"attention_weights", &P}, {"output", &O},
      {"flash_output", &flash_O}, {"flash_lse", &flash_lse}};

  for (int i = 0; i < (int)heads.size(); ++i) {
    Q.upload(read_input(cs, "Q", heads[i], N, d));
    K.upload(read_input(cs, "K", heads[i], M, d));
    V.upload(read_input(cs, "V", heads[i], M, d_v));
    steps.transpose(K.ptr, KT.ptr, M, d);
    steps.qk(handle, Q.ptr, KT.ptr, QK.ptr, N, M, d);
    steps.scale_mask(QK.ptr, QK_scaled.ptr, N, M, scale, cs.causal);
    steps.softmax(QK_scaled.ptr, P.ptr, N, M);
    steps.pv(handle, P.ptr, V.ptr, O.ptr, N, M, d_v);
    if (flash) {
      CUDA_CHECK(cudaMemset(flash_O.ptr, 0, sizeof(float) * N * d_v));
      CUDA_CHECK(cudaMemset(flash_lse.ptr, 0, sizeof(float) * N));
      steps.flash(Q.ptr, K.ptr, V.ptr, flash_O.ptr, flash_lse.ptr, N, M, d, scale, cs.causal);
    }
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    for (const auto& [name, m] : stages)
      if (flash || std::string(name).rfind("flash_", 0) != 0) m->save(head_file(cs.out_dir, name, i));
  }
  CUBLAS_CHECK(cublasDestroy(handle));
  std::cout << "wrote " << heads.size() << " heads (N=" << N << " M=" << M << " d=" << d
            << (cs.causal ? ", causal" : "") << (flash ? "" : ", no flash: d_k != d_v or unsupported d")
            << ") to " << cs.out_dir << "\n";
  return 0;
}

}  // namespace seed
