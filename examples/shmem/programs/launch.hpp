// What gshmem's programs share: a functor run as a kernel (CUDA builds: one thread per index)
// or by host threads (CPU mode: the same code through gdaki's host data path), its time, and
// failure records kernels write into the heap.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gshmem.h"
#include "gshmem_device.h"

#if defined(GDAKI_CUDA)
#include <cuda_runtime.h>
#include <unistd.h>
#endif

/** Helpers both the host and kernels call (patterns, expected values). */
#if defined(GDAKI_CUDA)
#define LAUNCH_HD __host__ __device__ inline
#else
#define LAUNCH_HD inline
#endif

namespace launch {

[[noreturn]] inline void die(const std::string &what) {
    std::fprintf(stderr, "PE %d: %s\n", gshmem_my_pe(), what.c_str());
    std::exit(1);
}

/** Failures a kernel recorded (in the symmetric heap, so CPU and GPU builds read it alike). */
struct Failures {
    uint32_t count;
    uint32_t first_code;
    uint32_t first_line;
    uint32_t first_index;
};

GSHMEM_FN void record(Failures *f, uint32_t code, uint32_t line, uint32_t index) {
#if defined(GDAKI_CUDA)
    if (atomicAdd(&f->count, 1u) == 0) {
#else
    if (__atomic_fetch_add(&f->count, 1u, __ATOMIC_RELAXED) == 0) {
#endif
        f->first_code = code;
        f->first_line = line;
        f->first_index = index;
    }
}

/** Records a status that is not `want` (GDAKI_OK unless said), with the line and index. */
#define EXPECT_CODE(failures, want, call, index)                                  \
    do {                                                                          \
        uint32_t got_ = (call);                                                   \
        if (got_ != (want)) launch::record((failures), got_, __LINE__, (index)); \
    } while (0)
#define EXPECT_OK(failures, call, index) EXPECT_CODE(failures, GDAKI_OK, call, index)

#if defined(GDAKI_CUDA)

inline void cuda(cudaError_t e, const char *what) {
    if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}

inline cudaStream_t &stream() {
    static cudaStream_t s = nullptr;
    return s;
}

/** Call before gshmem_init (after options()): the CUDA runtime loads every kernel of this
 *  program now. gdaki's soft HCA keeps a copy kernel resident on the GPU, and a module loaded
 *  later (CUDA loads lazily by default, at a kernel's first launch) would wait for it forever. */
inline void prepare_gpu(int ordinal) {
    cuda(cudaSetDevice(ordinal), "cudaSetDevice");
    cuda(cudaFree(nullptr), "initialising the CUDA runtime");
    // Never the legacy stream: it would wait for the resident copy kernel's stream.
    cuda(cudaStreamCreateWithFlags(&stream(), cudaStreamNonBlocking), "cudaStreamCreate");
}

template <class F>
__global__ void kernel(F f, gshmem_ctx c, uint32_t n) {
    uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) f(c, t, n);
}

/** How many blocks of `block` threads of kernel<F> this process may count on being resident at
 *  once. The GPU holds per_sm of them on each SM; gdaki's copy kernel of this process takes a
 *  grid of a quarter of the SMs (at least 2), counted as a whole SM each. When other PEs run on
 *  the same GPU (gshmem_gpu_sharers) their kernels may share it at the same time (MPS): each
 *  of their copy kernels is counted as one block each, and the rest split evenly. A kernel
 *  whose blocks wait for each other must not launch more: the rest would never start. */
template <class F>
uint32_t resident_blocks(uint32_t block) {
    int dev = 0, sms = 0, per_sm = 0;
    cuda(cudaGetDevice(&dev), "cudaGetDevice");
    cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
    cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel<F>, (int)block, 0),
         "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    const long copier = (sms > 8 ? sms : 8) / 4, sharers = gshmem_gpu_sharers() > 1 ? gshmem_gpu_sharers() : 1;
    const long all = sms > copier ? (long)per_sm * (sms - copier) - copier * (sharers - 1) : 0;
    return all > 0 ? (uint32_t)(all / sharers) : 0;
}

/** Waits for the stream by polling, so the waiting thread never holds the driver. */
inline void wait_stream() {
    for (;;) {
        cudaError_t e = cudaStreamQuery(stream());
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) cuda(e, "kernel");
        usleep(20);
    }
}

/** Runs f(c, t, n) for t in 0..n as a kernel of `block`-thread blocks; its GPU time in ms. */
template <class F>
double run(F f, uint32_t n, uint32_t block = 128) {
    cudaEvent_t start, stop;
    cuda(cudaEventCreate(&start), "cudaEventCreate");
    cuda(cudaEventCreate(&stop), "cudaEventCreate");
    cuda(cudaEventRecord(start, stream()), "cudaEventRecord");
    kernel<<<(n + block - 1) / block, block, 0, stream()>>>(f, gshmem_device_ctx(), n);
    cuda(cudaGetLastError(), "launch");
    cuda(cudaEventRecord(stop, stream()), "cudaEventRecord");
    wait_stream();
    float ms = 0;
    cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms;
}

#else

inline void prepare_gpu(int) {}

/** Runs f(c, t, n) for t in 0..n, each on its own host thread; the wall time in ms. */
template <class F>
double run(F f, uint32_t n, uint32_t = 0) {
    gshmem_ctx c = gshmem_device_ctx();
    auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (uint32_t t = 0; t < n; t++) threads.emplace_back([=] { f(c, t, n); });
    for (auto &th : threads) th.join();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

#endif

inline void check(int rc, const char *what) {
    if (rc != 0) die(std::string(what) + ": " + gshmem_error());
}

/** gshmem's options, defaults and environment. Module loading is made eager first: CUDA reads
 *  CUDA_MODULE_LOADING once, when it initialises, and gshmem_options_init may initialise it
 *  (GSHMEM_GPU=local counts the GPUs). */
inline gshmem_options options() {
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    gshmem_options o;
    check(gshmem_options_init(&o), "gshmem_options_init");
    return o;
}

/** gshmem_malloc or die. */
template <class T>
T *alloc(size_t count) {
    void *p = gshmem_malloc(count * sizeof(T));
    if (p == nullptr) die(std::string("gshmem_malloc: ") + gshmem_error());
    return static_cast<T *>(p);
}

} // namespace launch
