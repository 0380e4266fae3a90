// read_bandwidth.cu — how fast the GPU reads memory that nothing writes back: the ceiling a decode
// step (which reads its K/V cache and writes a few hundred KiB) streams against, beside the
// device-to-device copy that `main --bench-decode` times (whose bytes are half reads, half writes).
//
//   nvcc -O3 -arch=sm_90 -o /tmp/read_bandwidth scripts/read_bandwidth.cu && /tmp/read_bandwidth [GiB]
//
// Two patterns over the same bytes (8 GiB unless given), each timed over 5 launches after 2:
// `contiguous`, 16-byte loads striding through the whole buffer, at several grid sizes (how many
// bytes must be in flight); `per head`, rows of 2 KB read as 8 heads' 256-byte slices, one head a
// block, as a decode kernel reads a [pages][page size][heads][d] cache of d128 bf16 one K/V head at
// a time. Then a cudaMemcpy of half the buffer onto the other half, counted as bytes read and
// written. The loads skip L1 and mark their lines evict-first (__ldcs).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                     \
    do {                                                                             \
        const cudaError_t e = (x);                                                   \
        if (e != cudaSuccess) {                                                      \
            std::fprintf(stderr, "read_bandwidth: %s: %s\n", #x, cudaGetErrorString(e)); \
            return 1;                                                                \
        }                                                                            \
    } while (0)

// Folded into a value nobody reads unless it matches, so that the loads are not removed.
__global__ void contiguous(const uint4* p, long long n, unsigned* sink) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;
}

constexpr int kHeads = 8, kRowBytes = 2048, kSliceVectors = kRowBytes / kHeads / 16;

__global__ void per_head(const uint4* p, long long rows, int rows_per_block, unsigned* sink) {
    const int head = blockIdx.x % kHeads;
    const long long first = static_cast<long long>(blockIdx.x / kHeads) * rows_per_block;
    unsigned acc = 0;
    for (int r = threadIdx.x / kSliceVectors; r < rows_per_block; r += blockDim.x / kSliceVectors) {
        const long long row = first + r;
        if (row >= rows) break;
        const uint4 v = __ldcs(p + row * (kRowBytes / 16) + head * kSliceVectors + threadIdx.x % kSliceVectors);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;
}

int main(int argc, char** argv) {
    const double gib = argc > 1 ? std::atof(argv[1]) : 8.0;
    const size_t bytes = static_cast<size_t>(gib * (1ull << 30)) / kRowBytes * kRowBytes;
    if (bytes == 0) {
        std::fprintf(stderr, "read_bandwidth: the size must be a positive number of GiB, got '%s'\n", argv[1]);
        return 2;
    }
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint4* p = nullptr;
    unsigned* sink = nullptr;
    CHECK(cudaMalloc(&p, bytes));
    CHECK(cudaMalloc(&sink, sizeof(unsigned)));
    CHECK(cudaMemset(p, 1, bytes));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    constexpr int kWarmup = 2, kReps = 5;
    auto time_gbps = [&](auto launch, double moved) {
        for (int i = 0; i < kWarmup; ++i) launch();
        cudaEventRecord(start);
        for (int i = 0; i < kReps; ++i) launch();
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms = 0;
        cudaEventElapsedTime(&ms, start, stop);
        return kReps * moved / ms / 1e6;
    };
    const long long vectors = static_cast<long long>(bytes / 16), rows = static_cast<long long>(bytes / kRowBytes);
    for (int per_sm : {2, 4, 8, 16})
        for (int threads : {256, 512}) {
            const int blocks = per_sm * sms;
            const double gbps = time_gbps([&] { contiguous<<<blocks, threads>>>(p, vectors, sink); }, bytes);
            std::printf("contiguous: %5d blocks of %d threads (%5.1f MiB of loads in flight): %.0f GB/s\n", blocks,
                        threads, blocks * threads * 16.0 / (1 << 20), gbps);
        }
    for (int rows_per_block : {2048, 8192, 32768}) {
        const int blocks = static_cast<int>((rows + rows_per_block - 1) / rows_per_block) * kHeads;
        const double gbps = time_gbps([&] { per_head<<<blocks, 512>>>(p, rows, rows_per_block, sink); }, bytes);
        std::printf("per head:   %5d blocks of 512 threads, %d rows each: %.0f GB/s\n", blocks, rows_per_block, gbps);
    }
    CHECK(cudaGetLastError());
    const size_t half = bytes / 2;
    const double copy = time_gbps([&] { cudaMemcpyAsync(p, reinterpret_cast<char*>(p) + half, half, cudaMemcpyDeviceToDevice); },
                                  2.0 * half);
    std::printf("copy:       %.0f GB/s read + written\n", copy);
    CHECK(cudaDeviceSynchronize());
    return 0;
}
