/* gshmem_device.h: gshmem's one-sided operations, called from kernels (CUDA C++) or, in CPU
 * mode, from host threads (any C++17 compiler: the thread-scope calls only). Built only on
 * gdaki_device.h's extern "C" functions.
 *
 * Addresses named "symmetric" are this PE's pointers into its heap (from gshmem_malloc): the
 * same offset is used at the target PE. Each target PE's heap is reached one way by every PE
 * (gshmem_pe_path): through the queue pair to it, the PE itself included (a loopback), or, in
 * GPU builds where every PE's GPU maps that heap, by the calling threads' own loads, stores
 * and system-scope atomics (NVLink, PCIe P2P, or inside one GPU). Either way atomics from all
 * PEs on a heap are atomic with respect to one another. Queue pairs are shared by every thread
 * of the GPU (gdaki's gpu mode), so any thread may call anything.
 *
 * On the load/store path every operation has completed when it returns (the caller's stores
 * are fenced at system scope before it returns, and before any signal), so quiet has nothing
 * left to wait for there.
 *
 * Each call returns GDAKI_OK or a GDAKI_CODE_* (gdaki_device.h): a PE out of range, a range
 * outside the heap or a misaligned atomic is GDAKI_CODE_BAD_ARGUMENT / _MISALIGNED before
 * anything is posted.
 *
 * Scopes: the plain calls are made by one thread. The _warp calls are made by all 32 lanes of
 * a warp together, converged: put_warp / get_warp move one buffer (every lane passes the same
 * arguments; the warp splits it), p_warp / atomic_fetch_add_warp carry one element per lane
 * (every lane its own address and value, the same PE), all in one doorbell. barrier_all is
 * called by one thread per PE (barrier_all_warp by one warp), which then stands for its whole
 * PE: synchronise the rest of the kernel around it yourself. */
#ifndef GSHMEM_DEVICE_H
#define GSHMEM_DEVICE_H

#include "gdaki_device.h"
#if defined(GDAKI_CUDA)
#include "gdaki_p2p.cuh"
#endif
#include "gshmem.h"

#ifndef __cplusplus
#error "gshmem_device.h is C++"
#endif

#if defined(GDAKI_CUDA)
#define GSHMEM_FN __device__ inline
#else
#include <atomic>
#include <cstring>
#define GSHMEM_FN inline
#endif

namespace gshmem {

/** Puts of at least this many bytes are split across the lanes of put_warp / get_warp. */
constexpr uint64_t WARP_SPLIT_BYTES = 8192;

namespace detail {

#if defined(GDAKI_CUDA)
GSHMEM_FN uint32_t thread_index() {
    uint32_t block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    uint32_t in_block = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    return block * (blockDim.x * blockDim.y * blockDim.z) + in_block;
}
GSHMEM_FN void lock(uint32_t *word) {
    while (atomicCAS(word, 0u, 1u) != 0u) {
    }
    __threadfence();
}
GSHMEM_FN void unlock(uint32_t *word) {
    __threadfence();
    atomicExch(word, 0u);
}
#else
inline uint32_t thread_index() {
    static std::atomic<uint32_t> next{0};
    thread_local uint32_t mine = next.fetch_add(1, std::memory_order_relaxed);
    return mine;
}
inline void lock(uint32_t *word) {
    uint32_t expected = 0;
    while (!__atomic_compare_exchange_n(word, &expected, 1u, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
        expected = 0;
    }
}
inline void unlock(uint32_t *word) { __atomic_store_n(word, 0u, __ATOMIC_RELEASE); }
#endif

GSHMEM_FN gshmem_internal *internal(const gshmem_ctx &c) { return (gshmem_internal *)c.heap_base; }

/* `bytes` at symmetric `addr` lie in the heap, past gshmem's own words; true also for 0 bytes
 * at a heap address. */
GSHMEM_FN bool in_heap(const gshmem_ctx &c, const void *addr, uint64_t bytes) {
    uint64_t a = (uint64_t)addr;
    uint64_t lo = c.heap_base + GSHMEM_RESERVED_BYTES, hi = c.heap_base + c.heap_bytes;
    return a >= lo && a <= hi && bytes <= hi - a;
}
GSHMEM_FN bool pe_ok(const gshmem_ctx &c, int pe) {
    return c.version == GSHMEM_CTX_VERSION && pe >= 0 && (uint32_t)pe < c.n_pes && c.qps[pe] != nullptr;
}
/* Where symmetric `addr` is at `pe`, and its key there. */
GSHMEM_FN uint64_t remote_addr(const gshmem_ctx &c, const void *addr, int pe) {
    return c.heaps[pe].addr + ((uint64_t)addr - c.heap_base);
}
GSHMEM_FN uint32_t rkey(const gshmem_ctx &c, int pe) { return c.heaps[pe].rkey; }

#if defined(GDAKI_CUDA)
/* Where this GPU loads and stores symmetric `addr` of `pe`'s heap, or nullptr where `pe` is
 * reached through its queue pair. */
template <class T>
GSHMEM_FN T *direct(const gshmem_ctx &c, const T *addr, int pe) {
    uint64_t base = c.peer_heaps != nullptr ? c.peer_heaps[pe] : 0;
    return base == 0 ? nullptr : (T *)(base + ((uint64_t)addr - c.heap_base));
}
#else
/* CPU mode reaches every heap through queue pairs. */
template <class T>
GSHMEM_FN T *direct(const gshmem_ctx &, const T *, int) {
    return nullptr;
}
#endif
/* Whether `pe`'s heap is reached by loads and stores (else through its queue pair). */
GSHMEM_FN bool loads_stores(const gshmem_ctx &c, int pe) { return direct(c, (const char *)c.heap_base, pe) != nullptr; }
/* Announces this PE's arrival at a barrier to `pe` (an add to its counter) and waits until
 * the add is done. */
GSHMEM_FN uint32_t arrive(const gshmem_ctx &c, uint32_t pe) {
#if defined(GDAKI_CUDA)
    if (uint64_t *word = direct(c, &internal(c)->barrier_arrivals, (int)pe)) {
        gdaki::p2p::fence();
        gdaki::p2p::add(word, 1);
        return GDAKI_OK;
    }
#endif
    uint64_t ticket = 0;
    uint32_t s = gdaki_signal_thread_gpu(c.qps[pe], c.heaps[pe].addr + offsetof(gshmem_internal, barrier_arrivals),
                                         c.heaps[pe].rkey, 1, (uint64_t)&internal(c)->discard, c.lkey, 0u, &ticket);
    return s != GDAKI_OK ? s : gdaki_wait_thread_gpu(c.qps[pe], ticket);
}

#if defined(GDAKI_CUDA)
/* Whether `ok` holds on every lane and every lane names the same PE. Every lane shuffles (a
 * lane whose `ok` is false must not skip it: the others' full-mask shuffle would be undefined). */
GSHMEM_FN bool warp_agree(bool ok, int pe) {
    const int first = __shfl_sync(0xffffffffu, pe, 0);
    return __all_sync(0xffffffffu, ok && pe == first);
}
/* The first failure of any lane, on every lane. */
GSHMEM_FN uint32_t warp_status(uint32_t s) {
    uint32_t failing = __ballot_sync(0xffffffffu, s != GDAKI_OK);
    return failing == 0 ? GDAKI_OK : __shfl_sync(0xffffffffu, s, __ffs(failing) - 1);
}
/* Lane `lane`'s share of a buffer split across the warp: offset and length. */
GSHMEM_FN void warp_share(uint64_t bytes, uint32_t lane, uint64_t *off, uint64_t *len) {
    uint64_t chunk = (bytes + 31) / 32;
    uint64_t start = chunk * lane;
    *off = start < bytes ? start : bytes;
    *len = start < bytes ? (bytes - start < chunk ? bytes - start : chunk) : 0;
}
GSHMEM_FN uint32_t lane_id() { return threadIdx.x % 32; }
#endif

} // namespace detail

/** This PE and the number of PEs. */
GSHMEM_FN int my_pe(const gshmem_ctx &c) { return (int)c.my_pe; }
GSHMEM_FN int n_pes(const gshmem_ctx &c) { return (int)c.n_pes; }

namespace detail {
/* Checks and posts a put (stores it, on the load/store path); its ticket into `*ticket`
 * unless null. */
GSHMEM_FN uint32_t post_put(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes, int pe,
                            uint64_t *ticket) {
    if (!pe_ok(c, pe) || !in_heap(c, dest, bytes) || !in_heap(c, src, bytes)) return GDAKI_CODE_BAD_ARGUMENT;
#if defined(GDAKI_CUDA)
    if (void *to = direct(c, dest, pe)) {
        gdaki::p2p::copy(to, src, bytes, 0, 1);
        gdaki::p2p::fence();
        if (ticket != nullptr) *ticket = 0;
        return GDAKI_OK;
    }
#endif
    return gdaki_put_thread_gpu(c.qps[pe], remote_addr(c, dest, pe), rkey(c, pe), (uint64_t)src, c.lkey, bytes, 0u,
                                ticket);
}
} // namespace detail

/** Starts copying `bytes` from symmetric `src` here to symmetric `dest` at `pe`; complete
 *  (source reusable, data at `pe`) after quiet(). */
GSHMEM_FN uint32_t put_nbi(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes, int pe) {
    return detail::post_put(c, dest, src, bytes, pe, nullptr);
}

/** put_nbi, then waits until it has completed. */
GSHMEM_FN uint32_t put(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes, int pe) {
    uint64_t ticket = 0;
    uint32_t s = detail::post_put(c, dest, src, bytes, pe, &ticket);
    if (s != GDAKI_OK || detail::loads_stores(c, pe)) return s;
    return gdaki_wait_thread_gpu(c.qps[pe], ticket);
}

/** Copies `bytes` from symmetric `src` at `pe` to symmetric `dest` here; returns when the data
 *  is here. */
GSHMEM_FN uint32_t get(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes, int pe) {
    if (!detail::pe_ok(c, pe) || !detail::in_heap(c, dest, bytes) || !detail::in_heap(c, src, bytes))
        return GDAKI_CODE_BAD_ARGUMENT;
#if defined(GDAKI_CUDA)
    if (const void *from = detail::direct(c, src, pe)) {
        gdaki::p2p::copy(dest, from, bytes, 0, 1);
        return GDAKI_OK;
    }
#endif
    uint64_t ticket = 0;
    uint32_t s = gdaki_get_thread_gpu(c.qps[pe], (uint64_t)dest, c.lkey, detail::remote_addr(c, src, pe),
                                      detail::rkey(c, pe), bytes, 0u, &ticket);
    return s != GDAKI_OK ? s : gdaki_wait_thread_gpu(c.qps[pe], ticket);
}

/** Writes `value` (at most 8 bytes, carried in the WQE) to symmetric `dest` at `pe`; complete
 *  after quiet(). */
template <class T>
GSHMEM_FN uint32_t p(const gshmem_ctx &c, T *dest, T value, int pe) {
    static_assert(sizeof(T) <= 8, "p carries at most 8 bytes");
    if (!detail::pe_ok(c, pe) || !detail::in_heap(c, dest, sizeof(T))) return GDAKI_CODE_BAD_ARGUMENT;
#if defined(GDAKI_CUDA)
    if (T *to = detail::direct(c, dest, pe)) {
        *to = value;
        gdaki::p2p::fence();
        return GDAKI_OK;
    }
#endif
    return gdaki_put_inline_thread_gpu(c.qps[pe], detail::remote_addr(c, dest, pe), detail::rkey(c, pe), &value,
                                       (uint32_t)sizeof(T), 0u, nullptr);
}

/** Adds `value` to the u64 at symmetric `dest` (8-byte aligned) at `pe`; `*fetched` (unless
 *  null) gets the value before the add. Returns when it has. */
GSHMEM_FN uint32_t atomic_fetch_add(const gshmem_ctx &c, uint64_t *dest, uint64_t value, int pe,
                                    uint64_t *fetched) {
    if (!detail::pe_ok(c, pe) || !detail::in_heap(c, dest, 8)) return GDAKI_CODE_BAD_ARGUMENT;
    if ((uint64_t)dest % 8 != 0) return GDAKI_CODE_MISALIGNED;
#if defined(GDAKI_CUDA)
    if (uint64_t *at = detail::direct(c, dest, pe)) {
        uint64_t old = gdaki::p2p::add(at, value);
        if (fetched != nullptr) *fetched = old;
        return GDAKI_OK;
    }
#endif
    /* The fetched value lands in a registered slot of this PE's heap, held under its lock
     * until the call has read it. */
    gshmem_internal *in = detail::internal(c);
    uint32_t slot = detail::thread_index() % GSHMEM_THREAD_SLOTS;
    detail::lock(&in->thread_locks[slot]);
    uint32_t s = gdaki_atomic_fetch_add_thread_gpu(c.qps[pe], detail::remote_addr(c, dest, pe), detail::rkey(c, pe),
                                                   value, (uint64_t)&in->thread_slots[slot], c.lkey, 0u, fetched);
    detail::unlock(&in->thread_locks[slot]);
    return s;
}

/** Starts copying `bytes` from symmetric `src` to symmetric `dest` at `pe`, then adds `add`
 *  to the u64 at symmetric `signal` there, after the data (RC order): a PE waiting with
 *  signal_wait_until sees the data once it sees the signal. Complete after quiet(). */
GSHMEM_FN uint32_t put_signal_nbi(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes,
                                  uint64_t *signal, uint64_t add, int pe) {
    if (!detail::pe_ok(c, pe) || !detail::in_heap(c, dest, bytes) || !detail::in_heap(c, src, bytes) ||
        !detail::in_heap(c, signal, 8))
        return GDAKI_CODE_BAD_ARGUMENT;
    if ((uint64_t)signal % 8 != 0) return GDAKI_CODE_MISALIGNED;
#if defined(GDAKI_CUDA)
    if (void *to = detail::direct(c, dest, pe)) {
        gdaki::p2p::copy(to, src, bytes, 0, 1);
        gdaki::p2p::fence();
        gdaki::p2p::add(detail::direct(c, signal, pe), add);
        return GDAKI_OK;
    }
#endif
    return gdaki_put_signal_thread_gpu(c.qps[pe], detail::remote_addr(c, dest, pe), detail::rkey(c, pe),
                                       (uint64_t)src, c.lkey, bytes, detail::remote_addr(c, signal, pe),
                                       detail::rkey(c, pe), add, (uint64_t)&detail::internal(c)->discard, c.lkey,
                                       0u, nullptr);
}

/** Waits until the u64 at symmetric `signal` here is at least `value` (bounded by the queue
 *  pairs' timeout: GDAKI_CODE_FLAG_TIMEOUT). */
GSHMEM_FN uint32_t signal_wait_until_ge(const gshmem_ctx &c, const uint64_t *signal, uint64_t value) {
    if (!detail::pe_ok(c, (int)c.my_pe) || !detail::in_heap(c, signal, 8)) return GDAKI_CODE_BAD_ARGUMENT;
    if ((uint64_t)signal % 8 != 0) return GDAKI_CODE_MISALIGNED;
    return gdaki_wait_signal_thread_gpu(c.qps[c.my_pe], signal, value);
}

/** Waits until everything this PE posted to every PE has completed (data delivered, sources
 *  reusable). */
GSHMEM_FN uint32_t quiet(const gshmem_ctx &c) {
    if (c.version != GSHMEM_CTX_VERSION) return GDAKI_CODE_BAD_ARGUMENT;
    uint32_t first = GDAKI_OK;
    for (uint32_t pe = 0; pe < c.n_pes; pe++) {
        if (detail::loads_stores(c, (int)pe)) continue;
        uint32_t s = gdaki_quiet_thread_gpu(c.qps[pe]);
        if (first == GDAKI_OK) first = s;
    }
#if defined(GDAKI_CUDA)
    gdaki::p2p::fence();
#endif
    return first;
}

/** quiet(), then waits until every PE has called barrier_all as often as this one: what any PE
 *  put before its barrier is in place everywhere after it. One thread per PE calls it. */
GSHMEM_FN uint32_t barrier_all(const gshmem_ctx &c) {
    uint32_t s = quiet(c);
    if (s != GDAKI_OK) return s;
    gshmem_internal *in = detail::internal(c);
    uint64_t round = ++*(volatile uint64_t *)&in->barrier_done;
    for (uint32_t pe = 0; pe < c.n_pes; pe++) {
        if (pe == c.my_pe) continue;
        s = detail::arrive(c, pe);
        if (s != GDAKI_OK) return s;
    }
    return gdaki_wait_signal_thread_gpu(c.qps[c.my_pe], &in->barrier_arrivals, round * (c.n_pes - 1));
}

#if defined(GDAKI_CUDA)

/** put_nbi by a whole warp: every lane passes the same arguments. Large buffers are split
 *  across the lanes (one doorbell for all), small ones go from lane 0. */
__device__ inline uint32_t put_nbi_warp(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes, int pe) {
    bool ok = detail::pe_ok(c, pe) && detail::in_heap(c, dest, bytes) && detail::in_heap(c, src, bytes);
    if (!detail::warp_agree(ok, pe)) return GDAKI_CODE_BAD_ARGUMENT;
    if (void *to = detail::direct(c, dest, pe)) {
        gdaki::p2p::copy(to, src, bytes, detail::lane_id(), 32);
        gdaki::p2p::fence();
        __syncwarp();
        return GDAKI_OK;
    }
    uint32_t s = GDAKI_OK;
    if (bytes < WARP_SPLIT_BYTES) {
        if (detail::lane_id() == 0) s = put_nbi(c, dest, src, bytes, pe);
        return detail::warp_status(s);
    }
    uint64_t off, len;
    detail::warp_share(bytes, detail::lane_id(), &off, &len);
    s = gdaki_put_warp_gpu(c.qps[pe], detail::remote_addr(c, dest, pe) + off, detail::rkey(c, pe),
                           (uint64_t)src + off, c.lkey, len, 0u, nullptr);
    return detail::warp_status(s);
}

/** put_nbi_warp, then waits until it has completed. */
__device__ inline uint32_t put_warp(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes, int pe) {
    uint32_t s = put_nbi_warp(c, dest, src, bytes, pe);
    if (s != GDAKI_OK || detail::loads_stores(c, pe)) return s;
    return detail::warp_status(gdaki_quiet_warp_gpu(c.qps[pe]));
}

/** get by a whole warp: every lane passes the same arguments; returns when the data is here. */
__device__ inline uint32_t get_warp(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes, int pe) {
    bool ok = detail::pe_ok(c, pe) && detail::in_heap(c, dest, bytes) && detail::in_heap(c, src, bytes);
    if (!detail::warp_agree(ok, pe)) return GDAKI_CODE_BAD_ARGUMENT;
    if (const void *from = detail::direct(c, src, pe)) {
        gdaki::p2p::copy(dest, from, bytes, detail::lane_id(), 32);
        __syncwarp();
        return GDAKI_OK;
    }
    uint32_t s = GDAKI_OK;
    if (bytes < WARP_SPLIT_BYTES) {
        if (detail::lane_id() == 0) s = get(c, dest, src, bytes, pe);
        return detail::warp_status(s);
    }
    uint64_t off, len, ticket = 0;
    detail::warp_share(bytes, detail::lane_id(), &off, &len);
    s = gdaki_get_warp_gpu(c.qps[pe], (uint64_t)dest + off, c.lkey, detail::remote_addr(c, src, pe) + off,
                           detail::rkey(c, pe), len, 0u, &ticket);
    if (s == GDAKI_OK) s = gdaki_wait_warp_gpu(c.qps[pe], ticket);
    return detail::warp_status(s);
}

/** p by a whole warp: each lane writes its own `value` to its own `dest`, all at `pe`. */
template <class T>
__device__ inline uint32_t p_warp(const gshmem_ctx &c, T *dest, T value, int pe) {
    static_assert(sizeof(T) <= 8, "p carries at most 8 bytes");
    bool ok = detail::pe_ok(c, pe) && detail::in_heap(c, dest, sizeof(T));
    if (!detail::warp_agree(ok, pe)) return GDAKI_CODE_BAD_ARGUMENT;
    if (T *to = detail::direct(c, dest, pe)) {
        *to = value;
        gdaki::p2p::fence();
        __syncwarp();
        return GDAKI_OK;
    }
    uint32_t s = gdaki_put_inline_warp_gpu(c.qps[pe], detail::remote_addr(c, dest, pe), detail::rkey(c, pe), &value,
                                           (uint32_t)sizeof(T), 0u, nullptr);
    return detail::warp_status(s);
}

/** atomic_fetch_add by a whole warp: each lane adds its own `value` to its own `dest`, all at
 *  `pe`, and gets its own `*fetched`. */
__device__ inline uint32_t atomic_fetch_add_warp(const gshmem_ctx &c, uint64_t *dest, uint64_t value, int pe,
                                                 uint64_t *fetched) {
    bool ok = detail::pe_ok(c, pe) && detail::in_heap(c, dest, 8) && (uint64_t)dest % 8 == 0;
    if (!detail::warp_agree(ok, pe)) {
        bool aligned = __all_sync(0xffffffffu, (uint64_t)dest % 8 == 0);
        return aligned ? GDAKI_CODE_BAD_ARGUMENT : GDAKI_CODE_MISALIGNED;
    }
    if (uint64_t *at = detail::direct(c, dest, pe)) {
        uint64_t old = gdaki::p2p::add(at, value);
        if (fetched != nullptr) *fetched = old;
        __syncwarp();
        return GDAKI_OK;
    }
    /* One group of 32 result slots per warp, held by lane 0 for the whole warp. */
    gshmem_internal *in = detail::internal(c);
    uint32_t group = (detail::thread_index() / 32) % GSHMEM_WARP_GROUPS;
    if (detail::lane_id() == 0) detail::lock(&in->warp_locks[group]);
    __syncwarp();
    uint32_t s = gdaki_atomic_fetch_add_warp_gpu(c.qps[pe], detail::remote_addr(c, dest, pe), detail::rkey(c, pe),
                                                 value, (uint64_t)&in->warp_slots[group][detail::lane_id()], c.lkey,
                                                 0u, fetched);
    __syncwarp();
    if (detail::lane_id() == 0) detail::unlock(&in->warp_locks[group]);
    return detail::warp_status(s);
}

/** put_signal_nbi by a whole warp (every lane the same arguments): the data split across the
 *  lanes, then one signal after all of it. */
__device__ inline uint32_t put_signal_nbi_warp(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes,
                                               uint64_t *signal, uint64_t add, int pe) {
    bool ok = detail::pe_ok(c, pe) && detail::in_heap(c, dest, bytes) && detail::in_heap(c, src, bytes) &&
              detail::in_heap(c, signal, 8) && (uint64_t)signal % 8 == 0;
    if (!detail::warp_agree(ok, pe)) return GDAKI_CODE_BAD_ARGUMENT;
    if (void *to = detail::direct(c, dest, pe)) {
        gdaki::p2p::copy(to, src, bytes, detail::lane_id(), 32);
        gdaki::p2p::fence();
        __syncwarp();
        if (detail::lane_id() == 0) gdaki::p2p::add(detail::direct(c, signal, pe), add);
        __syncwarp();
        return GDAKI_OK;
    }
    uint32_t s = GDAKI_OK;
    if (bytes < WARP_SPLIT_BYTES) {
        if (detail::lane_id() == 0) s = put_signal_nbi(c, dest, src, bytes, signal, add, pe);
        return detail::warp_status(s);
    }
    /* The chunks deferred (rung with the signal), the signal after them on the same queue pair. */
    uint64_t off, len;
    detail::warp_share(bytes, detail::lane_id(), &off, &len);
    s = gdaki_put_warp_gpu(c.qps[pe], detail::remote_addr(c, dest, pe) + off, detail::rkey(c, pe),
                           (uint64_t)src + off, c.lkey, len, GDAKI_POST_DEFER, nullptr);
    s = detail::warp_status(s);
    if (s != GDAKI_OK) return s;
    if (detail::lane_id() == 0)
        s = gdaki_signal_thread_gpu(c.qps[pe], detail::remote_addr(c, signal, pe), detail::rkey(c, pe), add,
                                    (uint64_t)&detail::internal(c)->discard, c.lkey, 0u, nullptr);
    return detail::warp_status(s);
}

/** quiet by a whole warp: the lanes share the queue pairs. */
__device__ inline uint32_t quiet_warp(const gshmem_ctx &c) {
    uint32_t first = GDAKI_OK;
    if (c.version != GSHMEM_CTX_VERSION) return GDAKI_CODE_BAD_ARGUMENT;
    for (uint32_t pe = detail::lane_id(); pe < c.n_pes; pe += 32) {
        if (detail::loads_stores(c, (int)pe)) continue;
        uint32_t s = gdaki_quiet_thread_gpu(c.qps[pe]);
        if (first == GDAKI_OK) first = s;
    }
    gdaki::p2p::fence();
    return detail::warp_status(first);
}

namespace detail {
/* put_nbi (signal null) or put_signal_nbi by a whole thread block: see put_signal_nbi_block. */
__device__ inline uint32_t put_block(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes,
                                     uint64_t *signal, uint64_t add, int pe) {
    __shared__ uint32_t status;
    bool ok = pe_ok(c, pe) && in_heap(c, dest, bytes) && in_heap(c, src, bytes) &&
              (signal == nullptr || (in_heap(c, signal, 8) && (uint64_t)signal % 8 == 0));
    if (!__syncthreads_and(ok)) return GDAKI_CODE_BAD_ARGUMENT;
    if (void *to = direct(c, dest, pe)) {
        gdaki::p2p::copy(to, src, bytes, threadIdx.x, blockDim.x);
        gdaki::p2p::fence();
        __syncthreads();
        if (signal != nullptr && threadIdx.x == 0) gdaki::p2p::add(direct(c, signal, pe), add);
        __syncthreads();
        return GDAKI_OK;
    }
    if (threadIdx.x < 32) {
        uint32_t s = signal != nullptr ? put_signal_nbi_warp(c, dest, src, bytes, signal, add, pe)
                                       : put_nbi_warp(c, dest, src, bytes, pe);
        if (threadIdx.x == 0) status = s;
    }
    __syncthreads();
    uint32_t s = status;
    __syncthreads();
    return s;
}
} // namespace detail

/** put_signal_nbi by a whole thread block (every thread the same arguments; a 1-D block of
 *  whole warps): on the load/store path every thread copies a share and one signal follows
 *  all of it; through a queue pair the first warp posts it (put_signal_nbi_warp). Returns the
 *  same status on every thread. */
__device__ inline uint32_t put_signal_nbi_block(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes,
                                                uint64_t *signal, uint64_t add, int pe) {
    return detail::put_block(c, dest, src, bytes, signal, add, pe);
}

/** put_nbi by a whole thread block (as put_signal_nbi_block, without the signal). */
__device__ inline uint32_t put_nbi_block(const gshmem_ctx &c, void *dest, const void *src, uint64_t bytes, int pe) {
    return detail::put_block(c, dest, src, bytes, nullptr, 0, pe);
}

/** barrier_all by one whole warp of the PE: the lanes signal the PEs in parallel. */
__device__ inline uint32_t barrier_all_warp(const gshmem_ctx &c) {
    uint32_t s = quiet_warp(c);
    if (s != GDAKI_OK) return s;
    gshmem_internal *in = detail::internal(c);
    uint64_t round = 0;
    if (detail::lane_id() == 0) round = ++*(volatile uint64_t *)&in->barrier_done;
    round = __shfl_sync(0xffffffffu, round, 0);
    for (uint32_t pe = detail::lane_id(); pe < c.n_pes; pe += 32) {
        if (pe == c.my_pe) continue;
        uint32_t r = detail::arrive(c, pe);
        if (s == GDAKI_OK) s = r;
    }
    s = detail::warp_status(s);
    if (s != GDAKI_OK) return s;
    if (detail::lane_id() == 0)
        s = gdaki_wait_signal_thread_gpu(c.qps[c.my_pe], &in->barrier_arrivals, round * (c.n_pes - 1));
    return detail::warp_status(s);
}

#endif /* GDAKI_CUDA */

} // namespace gshmem

#endif /* GSHMEM_DEVICE_H */
