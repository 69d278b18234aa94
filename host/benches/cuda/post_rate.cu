/* gdaki's posting-rate kernels written in CUDA C++ against gdaki_device.h: the same names,
 * parameters and posts as the Rust kernels (`gdaki_post_rate_<scope>_<mode>`, perf::post_only),
 * so the gpu_posting benchmark can put both side by side. Compiled by NVRTC with -rdc=true and
 * linked with gdaki's C PTX at run time: every gdaki call is a real call across the boundary.
 * Nothing consumes the rings, so addresses and keys are placeholders. */
#include "gdaki_device.h"

#define GDAKI_NO_SCRATCH(s)
#define GDAKI_SCRATCH(s) , (s)
#define GDAKI_POST_RATE(scope, mode, SCRATCH)                                                                  \
    extern "C" __global__ void gdaki_post_rate_##scope##_##mode(const uint64_t *qps, uint32_t nqp,            \
                                                                uint32_t stride, uint32_t iters,               \
                                                                uint32_t commit_every,                         \
                                                                gdaki_block_scratch *scratch, uint32_t *status) { \
        uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;                                                    \
        gdaki_dev_qp *qp = (gdaki_dev_qp *)qps[(t / (stride ? stride : 1)) % (nqp ? nqp : 1)];                \
        gdaki_block_scratch *mine = scratch + blockIdx.x;                                                      \
        (void)mine;                                                                                            \
        uint32_t s = GDAKI_OK;                                                                                 \
        if (commit_every <= 1) {                                                                               \
            for (uint32_t i = 0; i < iters && s == GDAKI_OK; i++)                                              \
                s = gdaki_put_##scope##_##mode(qp SCRATCH(mine), 0x1000, 1, 0x2000, 1, 8, 0, nullptr);          \
        } else {                                                                                               \
            uint32_t since = 0;                                                                                \
            for (uint32_t i = 0; i < iters && s == GDAKI_OK; i++) {                                            \
                s = gdaki_put_##scope##_##mode(qp SCRATCH(mine), 0x1000, 1, 0x2000, 1, 8, GDAKI_POST_DEFER,    \
                                               nullptr);                                                       \
                if (s == GDAKI_OK && (++since == commit_every || i + 1 == iters)) {                            \
                    s = gdaki_commit_##scope##_##mode(qp SCRATCH(mine));                                       \
                    since = 0;                                                                                 \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        status[t] = s;                                                                                         \
    }

/* The shapes the benchmark runs. */
GDAKI_POST_RATE(warp, exclusive, GDAKI_NO_SCRATCH)
GDAKI_POST_RATE(thread, cta, GDAKI_NO_SCRATCH)
GDAKI_POST_RATE(block, exclusive, GDAKI_SCRATCH)
