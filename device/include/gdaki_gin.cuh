/* gdaki_gin.cuh: a C++ handle over gdaki_device.h for kernels written against NCCL GIN's device
 * surface (put, put_value, signal, flush, wait_signal), so that such a kernel can move to gdaki
 * by swapping the handle's type. Header-only, over the extern "C" device functions: link with
 * libgdaki_device.a (nvcc -rdc=true) or the C PTX, as for gdaki_device.h. See docs/cuda-cpp.md.
 *
 * The differences from NCCL GIN: there are no teams (a peer is an index into the handle's queue
 * pairs), a window is a plain struct of addresses and keys that the host fills in, and every
 * method returns GDAKI_OK or a GDAKI_CODE_* instead of nothing (an existing call site may ignore
 * it). Cooperation is a tag, as in NCCL: gdaki::Thread, gdaki::Warp (all 32 lanes, converged) or
 * gdaki::Block{scratch} (every thread of the block), and a coop makes one operation together, as
 * NCCL's does: every member calls with the same arguments; the members share the copy to a mapped
 * peer, the first member posts to a queue pair, and all return its result. Arguments that differ
 * between members, or that one member gets wrong, are refused for all of them
 * (GDAKI_CODE_BAD_ARGUMENT) before anything is posted, so a collective never deadlocks.
 *
 * Peers whose windows this GPU maps (Window::mapped, from gdaki_peer_map_addr: another process
 * on this GPU, or another GPU of the host over NVLink or PCIe) are reached by the calling
 * threads' own stores and system-scope atomics (gdaki_p2p.cuh), as NCCL's LSA and NVSHMEM's P2P
 * transport do; every other peer through its queue pair. */
#ifndef GDAKI_GIN_CUH
#define GDAKI_GIN_CUH

#include "gdaki_device.h"
#include "gdaki_gin_host.h"
#include "gdaki_p2p.cuh"

#ifndef GDAKI_CUDA
#error "gdaki_gin.cuh is CUDA C++: compile it with nvcc or clang -x cuda"
#endif
#ifndef __cplusplus
#error "gdaki_gin.cuh is C++"
#endif

namespace gdaki {

/** One thread calls. */
struct Thread {};
/** All 32 lanes of a warp call together, converged. */
struct Warp {};
/** Every thread of the block calls together; `scratch` is one gdaki_block_scratch per block
 *  (shared memory is best). */
struct Block {
    gdaki_block_scratch *scratch;
};

/** Who else posts on the handle's queue pairs: nobody (Exclusive), threads of this block (Cta),
 *  threads of any block (Gpu). */
struct Exclusive {};
struct Cta {};
struct Gpu {};

/** Remote actions of put, put_value and signal: none, or an atomic add to signal word `id` of
 *  the handle's signal window at the peer, after the data. */
struct None {};
struct SignalAdd {
    uint32_t id;
    uint64_t value;
};
struct SignalInc {
    uint32_t id;
};

namespace detail {

/* A member's place in its coop, the coop's size, and the coop's barrier. */
__device__ inline uint32_t rank(Thread) { return 0; }
__device__ inline uint32_t rank(Warp) {
    uint32_t lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
}
__device__ inline uint32_t rank(Block) { return (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x; }
__device__ inline uint32_t size(Thread) { return 1; }
__device__ inline uint32_t size(Warp) { return 32; }
__device__ inline uint32_t size(Block) { return blockDim.x * blockDim.y * blockDim.z; }
__device__ inline void sync(Thread) {}
__device__ inline void sync(Warp) { __syncwarp(); }
__device__ inline void sync(Block) { __syncthreads(); }

/* Words the members compare (the operation's peer, offsets, size, action). */
struct Args {
    uint64_t w[6];
};

/* Whether every member's `ok` holds and every member passes the first member's `a`: the coop
 * makes one operation, so a member that differs is a mistake, refused for all. */
__device__ inline bool agree(bool ok, const Args &, Thread) { return ok; }
__device__ inline bool agree(bool ok, const Args &a, Warp) {
    /* Every lane takes part in every shuffle (a lane that skipped one would leave the others'
     * full-mask shuffle undefined). */
    bool same = true;
    for (int i = 0; i < 6; i++) {
        const uint64_t first = __shfl_sync(0xffffffffu, (unsigned long long)a.w[i], 0);
        same &= a.w[i] == first;
    }
    return __all_sync(0xffffffffu, ok && same);
}
__device__ inline bool agree(bool ok, const Args &a, Block b) {
    /* The first member's words through the scratch area, which no gdaki call of this block
     * uses now: the barriers order the writes, the reads and the call that follows. */
    if (b.scratch != nullptr && rank(b) == 0)
        for (int i = 0; i < 6; i++) b.scratch->words[i] = a.w[i];
    __syncthreads();
    bool same = b.scratch != nullptr;
    for (int i = 0; i < 6 && same; i++) same = b.scratch->words[i] == a.w[i];
    return __syncthreads_and(ok && same) != 0;
}

/* The first member's `v`, to every member: a barrier of the coop (the others wait for the
 * first member's operation here). */
__device__ inline uint32_t share(uint32_t v, Thread) { return v; }
__device__ inline uint32_t share(uint32_t v, Warp) { return __shfl_sync(0xffffffffu, v, 0); }
__device__ inline uint32_t share(uint32_t v, Block b) {
    if (rank(b) == 0) b.scratch->words[0] = v;
    __syncthreads();
    uint32_t out = (uint32_t)b.scratch->words[0];
    __syncthreads();
    return out;
}

/* Where this GPU loads and stores `w`'s part at `peer`, or 0. */
__device__ inline uint64_t mapped(const Window &w, uint32_t peer) {
    return w.mapped != nullptr && peer < w.npeers ? w.mapped[peer] : 0;
}

/* One thread's posts (the coop's first member posts the coop's operation). */
template <class Mode>
struct Post;
/* A coop's collective calls on one queue pair (every member calls). */
template <class Coop, class Mode>
struct Collective;

#define GDAKI_GIN_POST(ModeT, mode)                                                                           \
    template <>                                                                                               \
    struct Post<ModeT> {                                                                                      \
        static __device__ uint32_t put(gdaki_dev_qp *qp, uint64_t dst, uint32_t rkey, uint64_t src,           \
                                       uint32_t lkey, uint64_t len, uint32_t flags, uint64_t *ticket = nullptr) { \
            return gdaki_put_thread_##mode(qp, dst, rkey, src, lkey, len, flags, ticket);                     \
        }                                                                                                     \
        static __device__ uint32_t put_signal(gdaki_dev_qp *qp, uint64_t dst, uint32_t rkey, uint64_t src,    \
                                              uint32_t lkey, uint64_t len, uint64_t signal, uint32_t signal_rkey, \
                                              uint64_t add, uint64_t scratch, uint32_t scratch_lkey,          \
                                              uint64_t *ticket) {                                             \
            return gdaki_put_signal_thread_##mode(qp, dst, rkey, src, lkey, len, signal, signal_rkey, add,    \
                                                  scratch, scratch_lkey, 0u, ticket);                         \
        }                                                                                                     \
        static __device__ uint32_t put_inline(gdaki_dev_qp *qp, uint64_t dst, uint32_t rkey, const void *data, \
                                              uint32_t len, uint32_t flags) {                                 \
            return gdaki_put_inline_thread_##mode(qp, dst, rkey, data, len, flags, nullptr);                  \
        }                                                                                                     \
        static __device__ uint32_t signal(gdaki_dev_qp *qp, uint64_t signal, uint32_t signal_rkey, uint64_t add, \
                                          uint64_t scratch, uint32_t scratch_lkey) {                          \
            return gdaki_signal_thread_##mode(qp, signal, signal_rkey, add, scratch, scratch_lkey, 0u, nullptr); \
        }                                                                                                     \
        static __device__ uint32_t quiet(gdaki_dev_qp *qp) { return gdaki_quiet_thread_##mode(qp); }           \
    };
GDAKI_GIN_POST(Exclusive, exclusive)
GDAKI_GIN_POST(Cta, cta)
GDAKI_GIN_POST(Gpu, gpu)
#undef GDAKI_GIN_POST

#define GDAKI_GIN_NO_SCRATCH(c)
#define GDAKI_GIN_SCRATCH(c) , (c).scratch
#define GDAKI_GIN_COLLECTIVE(CoopT, scope, ModeT, mode, SCRATCH)                                              \
    template <>                                                                                               \
    struct Collective<CoopT, ModeT> {                                                                         \
        static __device__ uint32_t quiet(const CoopT &c, gdaki_dev_qp *qp) {                                  \
            (void)c;                                                                                          \
            return gdaki_quiet_##scope##_##mode(qp SCRATCH(c));                                               \
        }                                                                                                     \
        static __device__ uint32_t wait_signal(const CoopT &c, gdaki_dev_qp *qp, const uint64_t *signal,      \
                                               uint64_t least) {                                              \
            (void)c;                                                                                          \
            return gdaki_wait_signal_##scope##_##mode(qp SCRATCH(c), signal, least);                          \
        }                                                                                                     \
    };
#define GDAKI_GIN_COLLECTIVE_ALL_MODES(CoopT, scope, SCRATCH)         \
    GDAKI_GIN_COLLECTIVE(CoopT, scope, Exclusive, exclusive, SCRATCH) \
    GDAKI_GIN_COLLECTIVE(CoopT, scope, Cta, cta, SCRATCH)             \
    GDAKI_GIN_COLLECTIVE(CoopT, scope, Gpu, gpu, SCRATCH)
GDAKI_GIN_COLLECTIVE_ALL_MODES(Thread, thread, GDAKI_GIN_NO_SCRATCH)
GDAKI_GIN_COLLECTIVE_ALL_MODES(Warp, warp, GDAKI_GIN_NO_SCRATCH)
GDAKI_GIN_COLLECTIVE_ALL_MODES(Block, block, GDAKI_GIN_SCRATCH)
#undef GDAKI_GIN_COLLECTIVE_ALL_MODES
#undef GDAKI_GIN_COLLECTIVE
#undef GDAKI_GIN_SCRATCH
#undef GDAKI_GIN_NO_SCRATCH

/* None only reaches here behind an is_signal check that refuses it. */
__device__ inline SignalAdd action(None) { return SignalAdd{0, 0}; }
__device__ inline SignalAdd action(SignalInc a) { return SignalAdd{a.id, 1}; }
__device__ inline SignalAdd action(SignalAdd a) { return a; }
/* The action as two words the members compare. */
__device__ inline uint64_t action_word(None) { return 0; }
__device__ inline uint64_t action_word(SignalInc a) { return 1ull << 63 | a.id; }
__device__ inline uint64_t action_word(SignalAdd a) { return 1ull << 62 | a.id; }

} // namespace detail

/** The handle: one queue pair per peer (exported with gdaki_qp_export_gpu; a PE's own entry is
 *  a loopback QP or NULL), a window of u64 signal words, and 8 bytes of local scratch per
 *  poster for the fetched values of signal atomics (which nobody reads). Copy it by value into
 *  kernels.
 *
 *  A coop (Thread, Warp, Block) makes one operation together, as in NCCL: every member passes
 *  the same arguments (a member that differs makes the call refuse for all), the members share
 *  a load/store copy, the coop's first member posts to a queue pair and signals, and every
 *  member returns once that is done, with its result. */
template <class Mode = Exclusive>
class Gin {
  public:
    __host__ __device__ Gin(gdaki_dev_qp *const *qps, uint32_t npeers, Window signals, Window scratch)
        : qps_(qps), npeers_(npeers), signals_(signals), scratch_(scratch) {}

    /** `bytes` from `src` at `src_offset` to `peer`'s part of `dst` at `dst_offset`, then the
     *  remote action. Through a queue pair the source may be reused only after flush(); to a
     *  mapped peer the bytes are there when the call returns. Through a queue pair the coop's
     *  first member gets the put's ticket on that queue pair in `*ticket` (unless NULL; to a
     *  mapped peer it is left alone). */
    template <class Action = None, class Coop = Thread>
    __device__ uint32_t put(uint32_t peer, const Window &dst, uint64_t dst_offset, const Window &src,
                            uint64_t src_offset, uint64_t bytes, Action action = Action{}, Coop coop = Coop{},
                            uint64_t *ticket = nullptr) const {
        bool ok = peer_ok(peer, dst) && fits(dst.peers[peer].len, dst_offset, bytes) &&
                  fits(src.size, src_offset, bytes) && action_ok(peer, action);
        const detail::Args args{{peer, dst_offset, src_offset, bytes, detail::action_word(action),
                                 detail::action(action).value}};
        if (!detail::agree(ok, args, coop)) return GDAKI_CODE_BAD_ARGUMENT;
        uint32_t s = GDAKI_OK;
        if (uint64_t to = detail::mapped(dst, peer)) {
            /* The members copy interleaved 16-byte pieces (coalesced), each fences its stores,
             * and after the barrier the first member's signal comes after all of them. */
            gdaki::p2p::copy((void *)(to + dst_offset), (const void *)(src.local + src_offset), bytes,
                             detail::rank(coop), detail::size(coop));
            gdaki::p2p::fence();
            detail::sync(coop);
            if (detail::rank(coop) == 0 && is_signal(action)) s = signal_now(peer, detail::action(action));
            return detail::share(s, coop);
        }
        if (detail::rank(coop) == 0) {
            const gdaki_remote_region &to = dst.peers[peer];
            const uint64_t at = to.addr + dst_offset, from = src.local + src_offset;
            if (!is_signal(action)) {
                s = detail::Post<Mode>::put(qps_[peer], at, to.rkey, from, src.lkey, bytes, 0u, ticket);
            } else if (detail::mapped(signals_, peer) != 0) {
                /* The signal by a store must wait for the data's completion. */
                s = detail::Post<Mode>::put(qps_[peer], at, to.rkey, from, src.lkey, bytes, 0u, ticket);
                if (s == GDAKI_OK) s = detail::Post<Mode>::quiet(qps_[peer]);
                if (s == GDAKI_OK) s = signal_now(peer, detail::action(action));
            } else {
                const SignalAdd a = detail::action(action);
                const gdaki_remote_region &sig = signals_.peers[peer];
                s = detail::Post<Mode>::put_signal(qps_[peer], at, to.rkey, from, src.lkey, bytes,
                                                   sig.addr + (uint64_t)a.id * 8, sig.rkey, a.value, scratch_.local,
                                                   scratch_.lkey, ticket);
            }
        }
        return detail::share(s, coop);
    }

    /** A value of at most 8 bytes, carried in the WQE, to `peer`'s part of `dst` at
     *  `dst_offset`, then the remote action (the first member's value). */
    template <class T, class Action = None, class Coop = Thread>
    __device__ uint32_t put_value(uint32_t peer, const Window &dst, uint64_t dst_offset, T value,
                                  Action action = Action{}, Coop coop = Coop{}) const {
        static_assert(sizeof(T) <= 8, "put_value carries at most 8 bytes");
        bool ok = peer_ok(peer, dst) && fits(dst.peers[peer].len, dst_offset, sizeof(T)) && action_ok(peer, action);
        const detail::Args args{{peer, dst_offset, sizeof(T), 0, detail::action_word(action),
                                 detail::action(action).value}};
        if (!detail::agree(ok, args, coop)) return GDAKI_CODE_BAD_ARGUMENT;
        uint32_t s = GDAKI_OK;
        if (detail::rank(coop) == 0) {
            if (uint64_t to = detail::mapped(dst, peer)) {
                *(volatile T *)(to + dst_offset) = value;
                gdaki::p2p::fence();
                if (is_signal(action)) s = signal_now(peer, detail::action(action));
            } else {
                const gdaki_remote_region &part = dst.peers[peer];
                const bool store_signal = is_signal(action) && detail::mapped(signals_, peer) != 0;
                const uint32_t flags = is_signal(action) && !store_signal ? GDAKI_POST_DEFER : 0u;
                s = detail::Post<Mode>::put_inline(qps_[peer], part.addr + dst_offset, part.rkey, &value,
                                                   (uint32_t)sizeof(T), flags);
                /* A signal by a store waits for the value's completion. */
                if (s == GDAKI_OK && store_signal) s = detail::Post<Mode>::quiet(qps_[peer]);
                if (s == GDAKI_OK && is_signal(action)) s = signal_now(peer, detail::action(action));
            }
        }
        return detail::share(s, coop);
    }

    /** The remote action alone (after everything posted to `peer` before it). */
    template <class Action, class Coop = Thread>
    __device__ uint32_t signal(uint32_t peer, Action action, Coop coop = Coop{}) const {
        bool ok = peer < npeers_ && is_signal(action) && action_ok(peer, action);
        const detail::Args args{{peer, 0, 0, 0, detail::action_word(action), detail::action(action).value}};
        if (!detail::agree(ok, args, coop)) return GDAKI_CODE_BAD_ARGUMENT;
        /* Every member's earlier stores come before the signal. */
        gdaki::p2p::fence();
        detail::sync(coop);
        uint32_t s = detail::rank(coop) == 0 ? signal_now(peer, detail::action(action)) : GDAKI_OK;
        return detail::share(s, coop);
    }

    /** Waits until everything posted on every peer's queue pair so far has completed: its
     *  sources may be reused and its data is at the peers (stores to mapped peers are there
     *  once the put returns; the fence here orders them for every observer again). */
    template <class Coop = Thread>
    __device__ uint32_t flush(Coop coop = Coop{}) const {
        gdaki::p2p::fence();
        uint32_t first = GDAKI_OK;
        for (uint32_t p = 0; p < npeers_; p++) {
            if (qps_[p] == nullptr) continue;
            uint32_t s = detail::Collective<Coop, Mode>::quiet(coop, qps_[p]);
            if (first == GDAKI_OK) first = s;
        }
        return first;
    }

    /** Waits until this PE's signal word `id` is at least `least` (or the queue pairs' timeout
     *  passes: GDAKI_CODE_TIMEOUT). */
    template <class Coop = Thread>
    __device__ uint32_t wait_signal(Coop coop, uint32_t id, uint64_t least) const {
        gdaki_dev_qp *any = any_qp();
        bool ok = any != nullptr && (uint64_t)id * 8 + 8 <= signals_.size;
        if (!detail::agree(ok, detail::Args{{id, least, 0, 0, 0, 0}}, coop)) return GDAKI_CODE_BAD_ARGUMENT;
        return detail::Collective<Coop, Mode>::wait_signal(coop, any, signal_word(id), least);
    }

    /** This PE's signal word `id` now (0 for an id outside the signal window). */
    __device__ uint64_t read_signal(uint32_t id) const {
        if ((uint64_t)id * 8 + 8 > signals_.size) return 0;
        return *(volatile const uint64_t *)signal_word(id);
    }

    /** The number of peers. */
    __host__ __device__ uint32_t npeers() const { return npeers_; }

  private:
    gdaki_dev_qp *const *qps_;
    uint32_t npeers_;
    Window signals_;
    Window scratch_;

    __device__ const uint64_t *signal_word(uint32_t id) const {
        return (const uint64_t *)(signals_.local + (uint64_t)id * 8);
    }
    __device__ gdaki_dev_qp *any_qp() const {
        for (uint32_t p = 0; p < npeers_; p++)
            if (qps_[p] != nullptr) return qps_[p];
        return nullptr;
    }
    /* `w`'s part at `peer` is reachable: mapped, or through the peer's queue pair. */
    __device__ bool peer_ok(uint32_t peer, const Window &w) const {
        return peer < npeers_ && peer < w.npeers && (detail::mapped(w, peer) != 0 || qps_[peer] != nullptr);
    }
    __device__ static bool fits(uint64_t size, uint64_t offset, uint64_t bytes) {
        return offset <= size && bytes <= size - offset;
    }
    __device__ static bool is_signal(None) { return false; }
    __device__ static bool is_signal(SignalAdd) { return true; }
    __device__ static bool is_signal(SignalInc) { return true; }
    __device__ bool action_ok(uint32_t, None) const { return true; }
    __device__ bool action_ok(uint32_t peer, SignalAdd a) const { return signal_ok(peer, a.id); }
    __device__ bool action_ok(uint32_t peer, SignalInc a) const { return signal_ok(peer, a.id); }
    /* Signal word `id` exists at `peer` (and here), and `peer` is reached: its signal window
     * mapped, or its queue pair with scratch for the fetched value. */
    __device__ bool signal_ok(uint32_t peer, uint32_t id) const {
        if (peer >= signals_.npeers || peer >= npeers_ || (uint64_t)id * 8 + 8 > signals_.peers[peer].len ||
            (uint64_t)id * 8 + 8 > signals_.size)
            return false;
        return detail::mapped(signals_, peer) != 0 || (qps_[peer] != nullptr && scratch_.size >= 8);
    }

    /* One thread signals `peer`: a system-scope add where its signal window is mapped (after
     * the fence, so the caller's earlier stores come first), else an atomic through its queue
     * pair (after what was posted there before). */
    __device__ uint32_t signal_now(uint32_t peer, SignalAdd a) const {
        if (uint64_t word = detail::mapped(signals_, peer)) {
            gdaki::p2p::fence();
            gdaki::p2p::add((uint64_t *)(word + (uint64_t)a.id * 8), a.value);
            return GDAKI_OK;
        }
        const gdaki_remote_region &sig = signals_.peers[peer];
        return detail::Post<Mode>::signal(qps_[peer], sig.addr + (uint64_t)a.id * 8, sig.rkey, a.value, scratch_.local,
                                          scratch_.lkey);
    }
};

} // namespace gdaki

#endif /* GDAKI_GIN_CUH */
