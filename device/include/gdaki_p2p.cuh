/* gdaki_p2p.cuh: the calling threads' own loads, stores and atomics on memory this GPU maps
 * from another process or GPU of the host (gdaki_peer_map_addr; NVLink, PCIe or the same GPU):
 * the copy, the fence and the signal add that the load/store paths of gdaki_gin.cuh and of
 * gshmem share. CUDA C++, header-only; no queue pair, no HCA. See docs/c-api.md ("Load and store
 * between the GPUs of one host"). */
#ifndef GDAKI_P2P_CUH
#define GDAKI_P2P_CUH

#include "gdaki_device.h"

#ifndef GDAKI_CUDA
#error "gdaki_p2p.cuh is CUDA C++: compile it with nvcc or clang -x cuda"
#endif

namespace gdaki {
namespace p2p {

/** Copies `bytes` from `src` to `dst` (global memory both, either mapped from a peer), member
 *  `lane` of `lanes` threads doing every lanes-th piece (0 of 1 for one thread alone): 16-byte
 *  pieces where both ends are 16-byte aligned, bytes for the rest. Loads bypass L1, since `src`
 *  may be memory that another GPU writes. */
__device__ inline void copy(void *dst, const void *src, uint64_t bytes, uint32_t lane, uint32_t lanes) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
    uint64_t head = 0;
    if (((uint64_t)d | (uint64_t)s) % 16 == 0) {
        head = bytes / 16 * 16;
        for (uint64_t i = (uint64_t)lane * 16; i < head; i += (uint64_t)lanes * 16)
            *(int4 *)(d + i) = __ldcv((const int4 *)(s + i));
    }
    for (uint64_t i = head + lane; i < bytes; i += lanes) d[i] = __ldcv(s + i);
}

/** Orders the calling thread's earlier stores before its later ones as every GPU and the CPU
 *  see them: what makes data visible before the signal that announces it. */
__device__ inline void fence() { __threadfence_system(); }

/** Adds `value` to the u64 at `word` (a peer's memory or this GPU's) at system scope; returns
 *  the old value. Atomic only against other system-scope atomics: a word that some PE adds to
 *  through a queue pair (the HCA's atomics) must not be added to here. */
__device__ inline uint64_t add(uint64_t *word, uint64_t value) {
    return atomicAdd_system((unsigned long long *)word, (unsigned long long)value);
}

} // namespace p2p
} // namespace gdaki

#endif /* GDAKI_P2P_CUH */
