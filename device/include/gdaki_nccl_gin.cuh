/* gdaki_nccl_gin.cuh: NCCL GIN's device API (NCCL 2.28-2.30: ncclGin, its put, putValue, get,
 * signal, flush, signals, counters and shadows, teams, coops and the world GIN barrier) over
 * gdaki's queue pairs and windows, so that a kernel written for NCCL's GIN moves to gdaki by
 * including this header instead of NCCL's device headers and taking a gdakiDevComm
 * (gdaki_gin_host.h) where it took an ncclDevComm. Header-only over gdaki_gin.cuh and the
 * extern "C" device functions: link as for gdaki_device.h. See docs/cuda-cpp.md, which lists
 * what does not match NCCL and why.
 *
 * NCCL's methods return nothing; a call that gdaki refuses or that fails (bad arguments, a
 * failed completion, a wait past the communicator's timeout) does nothing further and leaves its
 * GDAKI_CODE_* in the communicator's error word (the first one stays), which the host reads after
 * the kernel (gshmem: gshmem_dev_comm_error). Every member of a coop passes the same arguments,
 * as NCCL requires; gdaki checks that and refuses a call whose members differ, for all of them. */
#ifndef GDAKI_NCCL_GIN_CUH
#define GDAKI_NCCL_GIN_CUH

#include <stddef.h>

#include "gdaki_gin.cuh"

#if defined(_NCCL_DEVICE_CORE_H_) || defined(_NCCL_DEVICE_GIN_SESSION_H_)
#error "gdaki_nccl_gin.cuh takes the place of NCCL's device headers: include one or the other"
#endif

/* NCCL's signatures name libcu++'s memory orders and thread scopes; where libcu++ is not there
 * (a syntax check without the CUDA toolkit) the same names stand in. */
#if defined(__has_include)
#if __has_include(<cuda/atomic>)
#include <cuda/atomic>
#define GDAKI_NCCL_HAVE_LIBCUDACXX 1
#endif
#endif
#ifndef GDAKI_NCCL_HAVE_LIBCUDACXX
namespace cuda {
enum memory_order {
    memory_order_relaxed,
    memory_order_consume,
    memory_order_acquire,
    memory_order_release,
    memory_order_acq_rel,
    memory_order_seq_cst
};
enum thread_scope { thread_scope_system, thread_scope_device, thread_scope_block, thread_scope_thread };
} // namespace cuda
#endif

/* ------------------------------------------------------------------------------ types */

/** A window: a device pointer to a gdaki::Window in GPU memory (gshmem_window::device). */
typedef const gdaki::Window *ncclWindow_t;
/** A signal id (0 .. ginSignalCount-1) and a counter id (0 .. ginCounterCount-1). */
typedef uint32_t ncclGinSignal_t;
typedef uint32_t ncclGinCounter_t;

/** A team: nRanks ranks, this one `rank` among them, world ranks `stride` apart. */
struct ncclTeam {
    int nRanks, rank, stride;
};
typedef struct ncclTeam ncclTeam_t;
struct ncclTeamTagWorld {};
struct ncclTeamTagLsa {};
struct ncclTeamTagRail {};

/** Every rank. */
__host__ __device__ inline ncclTeam ncclTeamWorld(const gdakiDevComm &comm) { return ncclTeam{comm.nRanks, comm.rank, 1}; }
/** The load/store team as gdaki sees it: this rank alone (see gdakiDevComm::lsaSize). */
__host__ __device__ inline ncclTeam ncclTeamLsa(const gdakiDevComm &comm) { return ncclTeam{1, 0, comm.nRanks}; }
/** The world rank of `rank` in `team`. */
__host__ __device__ inline int ncclTeamRankToWorld(const gdakiDevComm &comm, ncclTeam team, int rank) {
    return comm.rank + (rank - team.rank) * team.stride;
}

/** Coops, as NCCL's: a thread, a warp (all 32 lanes, converged), the block (1-D, every thread). */
template <int N>
struct ncclCoopTile {
    static_assert(N == 1 || N == 32, "gdaki_nccl_gin.cuh: a coop is one thread, a warp or the block");
    __device__ int thread_rank() const { return (int)gdaki::detail::rank(gdaki::Warp{}) % N; }
    __device__ constexpr int size() const { return N; }
    __device__ constexpr int num_threads() const { return N; }
    __device__ void sync() {
        if (N > 1) __syncwarp();
    }
};
typedef ncclCoopTile<1> ncclCoopThread;
typedef ncclCoopTile<32> ncclCoopWarp;
struct ncclCoopCta {
    __device__ int thread_rank() const { return (int)threadIdx.x; }
    __device__ int size() const { return (int)blockDim.x; }
    __device__ int num_threads() const { return (int)blockDim.x; }
    __device__ void sync() { __syncthreads(); }
};

/** Remote actions: none, or a signal at the peer after the data. Strong: every earlier put on
 *  this context to that peer has landed when the signal is seen; weak: the bundled put has.
 *  gdaki's signals are all strong (a queue pair executes in order; a mapped peer's signal
 *  follows a system-scope fence), which satisfies both. The unqualified forms are NCCL's
 *  deprecated names for the strong ones. */
struct ncclGin_None {};
struct ncclGin_StrongSignalInc {
    ncclGinSignal_t signal;
};
struct ncclGin_WeakSignalInc {
    ncclGinSignal_t signal;
};
struct ncclGin_SignalInc {
    ncclGinSignal_t signal;
};
struct ncclGin_StrongSignalAdd {
    ncclGinSignal_t signal;
    uint64_t value;
};
struct ncclGin_WeakSignalAdd {
    ncclGinSignal_t signal;
    uint64_t value;
};
struct ncclGin_SignalAdd {
    ncclGinSignal_t signal;
    uint64_t value;
};
/** Signals at a window offset (8-byte aligned) instead of a signal id. */
struct ncclGin_StrongVASignalInc {
    ncclWindow_t signalWindow;
    size_t signalOffset;
};
struct ncclGin_WeakVASignalInc {
    ncclWindow_t signalWindow;
    size_t signalOffset;
};
struct ncclGin_VASignalInc {
    ncclWindow_t signalWindow;
    size_t signalOffset;
};
struct ncclGin_StrongVASignalAdd {
    ncclWindow_t signalWindow;
    size_t signalOffset;
    uint64_t value;
};
struct ncclGin_WeakVASignalAdd {
    ncclWindow_t signalWindow;
    size_t signalOffset;
    uint64_t value;
};
struct ncclGin_VASignalAdd {
    ncclWindow_t signalWindow;
    size_t signalOffset;
    uint64_t value;
};
/** Local action: this rank's counter goes up by one once the put's source may be reused. */
struct ncclGin_WeakCounterInc {
    ncclGinCounter_t counter;
};
struct ncclGin_CounterInc {
    ncclGinCounter_t counter;
};
/** Accepted and unused: gdaki needs no descriptor space, and reads any segment type. */
struct ncclGinDescriptorSmem;
struct ncclGin_DescriptorSmem {
    ncclGinDescriptorSmem *descriptor;
};
struct ncclGin_SegmentDevice {};
struct ncclGin_SegmentMixed {};
struct ncclGin_SegmentHostNuma {};
enum ncclGinResourceSharingMode { NCCL_GIN_RESOURCE_SHARING_CTA, NCCL_GIN_RESOURCE_SHARING_GPU };
constexpr uint32_t ncclGinOptFlagsDefault = 0;

namespace gdaki {
namespace nccl {

/* gdaki's coop for NCCL's. The block's scratch is a __shared__ area of this header's own. */
__device__ inline Thread coop(ncclCoopTile<1>) { return Thread{}; }
__device__ inline Warp coop(ncclCoopTile<32>) { return Warp{}; }
__device__ inline Block coop(ncclCoopCta) {
    __shared__ gdaki_block_scratch scratch;
    return Block{&scratch};
}

/* `v` of the coop's first member, for every member (a barrier of the coop). */
__device__ inline uint64_t share64(uint64_t v, Thread) { return v; }
__device__ inline uint64_t share64(uint64_t v, Warp) { return __shfl_sync(0xffffffffu, (unsigned long long)v, 0); }
__device__ inline uint64_t share64(uint64_t v, Block b) {
    if (detail::rank(b) == 0) b.scratch->words[0] = v;
    __syncthreads();
    const uint64_t out = b.scratch->words[0];
    __syncthreads();
    return out;
}

__device__ inline uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ inline uint64_t load_acquire(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ inline uint64_t mask(int bits) { return bits >= 64 ? ~0ull : (bits <= 0 ? 0 : (1ull << bits) - 1); }
/* NCCL's rolling comparison: `a` is at most `b` within `bits` bits. */
__device__ inline bool rolling_le(uint64_t a, uint64_t b, int bits) {
    const uint64_t m = mask(bits);
    return ((b - a) & m) <= (m >> 1);
}

/* A remote action as gdaki's: the handle it goes through (the communicator's, or one whose
 * signal window is a VA signal's window) and the action on it. An id that is not the user's
 * becomes one that no signal window holds, so gdaki refuses it for every member. */
constexpr uint32_t NO_SIGNAL = 0xffffffffu;
__device__ inline Gin<Gpu> handle(const gdakiDevComm &c) { return Gin<Gpu>(c.qps, (uint32_t)c.nRanks, c.signals, c.scratch); }
__device__ inline uint32_t user_signal(const gdakiDevComm &c, ncclGinSignal_t s) {
    return s < (uint32_t)c.ginSignalCount ? s : NO_SIGNAL;
}
/* A window's fields; a NULL window is an empty one, which every call refuses. */
__device__ inline Window window(ncclWindow_t w) { return w != nullptr ? *w : Window{0, 0, 0, 0, nullptr, nullptr}; }
/* A handle whose signal words are `w`'s, and the id of the word at `offset`. */
__device__ inline Gin<Gpu> va_handle(const gdakiDevComm &c, ncclWindow_t w) {
    return Gin<Gpu>(c.qps, (uint32_t)c.nRanks, window(w), c.scratch);
}
__device__ inline uint32_t va_id(size_t offset) {
    return offset % 8 == 0 && offset / 8 < NO_SIGNAL ? (uint32_t)(offset / 8) : NO_SIGNAL;
}

/* Calls `f(handle, action)` with the remote action in gdaki's terms. */
template <class F>
__device__ uint32_t with(const gdakiDevComm &c, ncclGin_None, F f) { return f(handle(c), None{}); }
#define GDAKI_NCCL_ID_ACTION(T, make)                                  \
    template <class F>                                                 \
    __device__ uint32_t with(const gdakiDevComm &c, T a, F f) {        \
        return f(handle(c), make);                                     \
    }
GDAKI_NCCL_ID_ACTION(ncclGin_StrongSignalInc, (SignalInc{user_signal(c, a.signal)}))
GDAKI_NCCL_ID_ACTION(ncclGin_WeakSignalInc, (SignalInc{user_signal(c, a.signal)}))
GDAKI_NCCL_ID_ACTION(ncclGin_SignalInc, (SignalInc{user_signal(c, a.signal)}))
GDAKI_NCCL_ID_ACTION(ncclGin_StrongSignalAdd, (SignalAdd{user_signal(c, a.signal), a.value}))
GDAKI_NCCL_ID_ACTION(ncclGin_WeakSignalAdd, (SignalAdd{user_signal(c, a.signal), a.value}))
GDAKI_NCCL_ID_ACTION(ncclGin_SignalAdd, (SignalAdd{user_signal(c, a.signal), a.value}))
#undef GDAKI_NCCL_ID_ACTION
#define GDAKI_NCCL_VA_ACTION(T, make)                                  \
    template <class F>                                                 \
    __device__ uint32_t with(const gdakiDevComm &c, T a, F f) {        \
        return f(va_handle(c, a.signalWindow), make);                  \
    }
GDAKI_NCCL_VA_ACTION(ncclGin_StrongVASignalInc, (SignalInc{va_id(a.signalOffset)}))
GDAKI_NCCL_VA_ACTION(ncclGin_WeakVASignalInc, (SignalInc{va_id(a.signalOffset)}))
GDAKI_NCCL_VA_ACTION(ncclGin_VASignalInc, (SignalInc{va_id(a.signalOffset)}))
GDAKI_NCCL_VA_ACTION(ncclGin_StrongVASignalAdd, (SignalAdd{va_id(a.signalOffset), a.value}))
GDAKI_NCCL_VA_ACTION(ncclGin_WeakVASignalAdd, (SignalAdd{va_id(a.signalOffset), a.value}))
GDAKI_NCCL_VA_ACTION(ncclGin_VASignalAdd, (SignalAdd{va_id(a.signalOffset), a.value}))
#undef GDAKI_NCCL_VA_ACTION

/* The local action, by the coop's first member once the put succeeded (`ticket`: the put's on
 * the peer's queue pair, ~0 to a mapped peer, whose copy is already done). Through a queue pair
 * the communicator's counter QP posts a WAIT for the put's completion and an add to the
 * counter, and the caller goes on: the counter moves once the source is consumed. Without a
 * counter QP the member waits for the put, then counts. */
__device__ inline uint32_t local(const gdakiDevComm &, int, ncclGin_None, uint64_t) { return GDAKI_OK; }
__device__ inline uint32_t count(const gdakiDevComm &c, int peer, ncclGinCounter_t id, uint64_t ticket) {
    if (id >= (uint32_t)c.ginCounterCount) return GDAKI_CODE_BAD_ARGUMENT;
    if (c.qps[peer] != nullptr && ticket != ~0ull) {
        if (c.counterQp != nullptr)
            return gdaki_count_when_done_thread_gpu(c.counterQp, c.qps[peer], ticket, (uint64_t)&c.counters[id],
                                                    c.counterRkey, 1, c.scratch.local, c.scratch.lkey, 0u, nullptr);
        const uint32_t s = gdaki_wait_thread_gpu(c.qps[peer], ticket);
        if (s != GDAKI_OK) return s;
    }
    atomicAdd((unsigned long long *)&c.counters[id], 1ull);
    return GDAKI_OK;
}
__device__ inline uint32_t local(const gdakiDevComm &c, int peer, ncclGin_WeakCounterInc a, uint64_t ticket) {
    return count(c, peer, a.counter, ticket);
}
__device__ inline uint32_t local(const gdakiDevComm &c, int peer, ncclGin_CounterInc a, uint64_t ticket) {
    return count(c, peer, a.counter, ticket);
}
template <class A>
struct is_none {
    static constexpr bool value = false;
};
template <>
struct is_none<ncclGin_None> {
    static constexpr bool value = true;
};

/* Keeps the first failure in the communicator's error word. */
__device__ inline void note(const gdakiDevComm &c, uint32_t s) {
    if (s != GDAKI_OK && c.error != nullptr) atomicCAS((unsigned int *)c.error, 0u, s);
}

/* Waits (the coop's first member polls, the others wait at the share) until `word` within
 * `bits` bits is at least `least`, or the communicator's timeout passes. Returns the value
 * seen (every member), and a status. */
template <class Coop>
__device__ uint64_t wait_at_least(const gdakiDevComm &c, Coop co, const uint64_t *word, uint64_t least, int bits,
                                  uint32_t *status) {
    uint64_t v = 0;
    uint32_t s = GDAKI_OK;
    if (detail::rank(co) == 0) {
        const uint64_t start = now_ns();
        while (!rolling_le(least, (v = load_acquire(word)), bits)) {
            if (now_ns() - start > c.timeoutNs) {
                s = GDAKI_CODE_TIMEOUT;
                break;
            }
        }
    }
    *status = detail::share(s, co);
    return share64(v & mask(bits), co);
}

} // namespace nccl
} // namespace gdaki

/* ------------------------------------------------------------------------------ ncclGin */

/** One GIN context over a gdaki communicator: NCCL's ncclGin. */
struct ncclGin {
    const gdakiDevComm &comm;
    uint32_t contextId;

    /** Context `contextIndex` (gdaki has one; every index is that one). */
    __device__ ncclGin(const gdakiDevComm &c, int contextIndex,
                       ncclGinResourceSharingMode = NCCL_GIN_RESOURCE_SHARING_GPU)
        : comm(c), contextId((uint32_t)contextIndex) {}

    /** `bytes` from `srcWnd` at `srcOffset` to team rank `peer`'s part of `dstWnd` at
     *  `dstOffset`, then the remote action there and the local action here. */
    template <typename RemoteAction = ncclGin_None, typename LocalAction = ncclGin_None,
              typename Coop = ncclCoopThread, typename DescriptorSmem = ncclGin_None,
              typename SegmentType = ncclGin_SegmentDevice>
    __device__ void put(ncclTeam team, int peer, ncclWindow_t dstWnd, size_t dstOffset, ncclWindow_t srcWnd,
                        size_t srcOffset, size_t bytes, RemoteAction remoteAction = ncclGin_None{},
                        LocalAction localAction = ncclGin_None{}, Coop coop = ncclCoopThread{},
                        DescriptorSmem = ncclGin_None{}, cuda::thread_scope = cuda::thread_scope_thread,
                        cuda::thread_scope = cuda::thread_scope_device, uint32_t = ncclGinOptFlagsDefault,
                        SegmentType = ncclGin_SegmentDevice{}) const {
        using namespace gdaki::nccl;
        const int to = ncclTeamRankToWorld(comm, team, peer);
        const auto co = gdaki::nccl::coop(coop);
        const gdaki::Window dst = window(dstWnd), src = window(srcWnd);
        uint64_t ticket = ~0ull;
        uint32_t s = with(comm, remoteAction, [&](const gdaki::Gin<gdaki::Gpu> &g, auto a) {
            return g.put((uint32_t)to, dst, dstOffset, src, srcOffset, bytes, a, co, &ticket);
        });
        finish(to, s, localAction, co, ticket);
    }

    /** A value of at most 8 bytes to team rank `peer`'s part of `dstWnd` at `dstOffset`, then
     *  the remote action. */
    template <typename T, typename RemoteAction = ncclGin_None, typename Coop = ncclCoopThread,
              typename DescriptorSmem = ncclGin_None>
    __device__ void putValue(ncclTeam team, int peer, ncclWindow_t dstWnd, size_t dstOffset, T value,
                             RemoteAction remoteAction = ncclGin_None{}, Coop coop = ncclCoopThread{},
                             DescriptorSmem = ncclGin_None{}, cuda::thread_scope = cuda::thread_scope_thread,
                             cuda::thread_scope = cuda::thread_scope_device,
                             uint32_t = ncclGinOptFlagsDefault) const {
        using namespace gdaki::nccl;
        const int to = ncclTeamRankToWorld(comm, team, peer);
        const auto co = gdaki::nccl::coop(coop);
        const gdaki::Window dst = window(dstWnd);
        note(comm, with(comm, remoteAction, [&](const gdaki::Gin<gdaki::Gpu> &g, auto a) {
                 return g.put_value((uint32_t)to, dst, dstOffset, value, a, co);
             }));
    }

    /** The remote action alone, after everything put to `peer` before it. */
    template <typename RemoteAction, typename Coop = ncclCoopThread, typename DescriptorSmem = ncclGin_None>
    __device__ void signal(ncclTeam team, int peer, RemoteAction remoteAction, Coop coop = ncclCoopThread(),
                           DescriptorSmem = ncclGin_None{}, cuda::thread_scope = cuda::thread_scope_thread,
                           cuda::thread_scope = cuda::thread_scope_device, uint32_t = ncclGinOptFlagsDefault) const {
        using namespace gdaki::nccl;
        const int to = ncclTeamRankToWorld(comm, team, peer);
        const auto co = gdaki::nccl::coop(coop);
        note(comm, with(comm, remoteAction,
                        [&](const gdaki::Gin<gdaki::Gpu> &g, auto a) { return g.signal((uint32_t)to, a, co); }));
    }

    /** `bytes` of team rank `peer`'s part of `remoteWnd` at `remoteOffset` into `localWnd` at
     *  `localOffset`: there once flush() returns (from a mapped peer, when this returns). */
    template <typename Coop = ncclCoopThread, typename DescriptorSmem = ncclGin_None,
              typename SegmentType = ncclGin_SegmentDevice>
    __device__ void get(ncclTeam team, int peer, ncclWindow_t remoteWnd, size_t remoteOffset, ncclWindow_t localWnd,
                        size_t localOffset, size_t bytes, Coop coop = ncclCoopThread{},
                        DescriptorSmem = ncclGin_None{}, uint32_t = ncclGinOptFlagsDefault,
                        SegmentType = ncclGin_SegmentDevice{}) const {
        using namespace gdaki::nccl;
        namespace d = gdaki::detail;
        const int to = ncclTeamRankToWorld(comm, team, peer);
        const auto co = gdaki::nccl::coop(coop);
        const gdaki::Window from = window(remoteWnd), into = window(localWnd);
        const bool reach = to >= 0 && to < comm.nRanks && (uint32_t)to < from.npeers &&
                           (d::mapped(from, (uint32_t)to) != 0 || comm.qps[to] != nullptr);
        const bool ok = reach && fits(from.peers[to].len, remoteOffset, bytes) && fits(into.size, localOffset, bytes);
        if (!d::agree(ok, d::Args{{(uint64_t)to, remoteOffset, localOffset, bytes, 0, 0}}, co)) {
            note(comm, GDAKI_CODE_BAD_ARGUMENT);
            return;
        }
        uint32_t s = GDAKI_OK;
        if (const uint64_t at = d::mapped(from, (uint32_t)to)) {
            gdaki::p2p::copy((void *)(into.local + localOffset), (const void *)(at + remoteOffset), bytes, d::rank(co),
                             d::size(co));
            d::sync(co);
        } else if (d::rank(co) == 0) {
            s = gdaki_get_thread_gpu(comm.qps[to], into.local + localOffset, into.lkey,
                                     from.peers[to].addr + remoteOffset, from.peers[to].rkey, bytes, 0u, nullptr);
        }
        note(comm, d::share(s, co));
    }

    /** Waits until every put and get this context posted so far has completed (sources
     *  reusable, gets landed; gdaki's puts have also landed at the peers by then). */
    template <typename Coop, typename DescriptorSmem = ncclGin_None>
    __device__ void flush(Coop coop, cuda::memory_order = cuda::memory_order_acquire,
                          DescriptorSmem = ncclGin_None{}) const {
        gdaki::nccl::note(comm, gdaki::nccl::handle(comm).flush(gdaki::nccl::coop(coop)));
    }

    /** This rank's signal `signal` (its low `bits` bits; 0 for an id that is not one). */
    __device__ uint64_t readSignal(ncclGinSignal_t signal, int bits = 64,
                                   cuda::memory_order = cuda::memory_order_acquire) const {
        if (signal >= (uint32_t)comm.ginSignalCount) return 0;
        return gdaki::nccl::load_acquire(signal_word(signal)) & gdaki::nccl::mask(bits);
    }
    /** The signal word at `signalOffset` of this rank's part of `signalWindow`. */
    __device__ uint64_t readSignal(ncclWindow_t signalWindow, size_t signalOffset, int bits = 64,
                                   cuda::memory_order = cuda::memory_order_acquire) const {
        const uint64_t *w = va_word(signalWindow, signalOffset);
        return w != nullptr ? gdaki::nccl::load_acquire(w) & gdaki::nccl::mask(bits) : 0;
    }

    /** Waits until signal `signal` is at least `least` (rolling, in `bits` bits). */
    template <typename Coop>
    __device__ void waitSignal(Coop coop, ncclGinSignal_t signal, uint64_t least, int bits = 64,
                               cuda::memory_order = cuda::memory_order_acquire) const {
        wait_word(coop, signal < (uint32_t)comm.ginSignalCount ? signal_word(signal) : nullptr, least, bits);
    }
    template <typename Coop>
    __device__ void waitSignal(Coop coop, ncclWindow_t signalWindow, size_t signalOffset, uint64_t least,
                               int bits = 64, cuda::memory_order = cuda::memory_order_acquire) const {
        wait_word(coop, va_word(signalWindow, signalOffset), least, bits);
    }

    /** Signal shadows: a word per signal for the kernel's own bookkeeping. */
    __device__ uint64_t *getSignalShadowPtr(ncclGinSignal_t signal) const {
        return signal < (uint32_t)comm.ginSignalCount ? &comm.shadows[signal] : nullptr;
    }
    __device__ void increaseSignalShadow(ncclGinSignal_t signal, uint64_t delta) const {
        if (uint64_t *s = getSignalShadowPtr(signal)) *s += delta;
        else gdaki::nccl::note(comm, GDAKI_CODE_BAD_ARGUMENT);
    }
    /** Waits until the signal reaches its shadow. */
    template <typename Coop>
    __device__ void waitSignalMeetShadow(Coop coop, ncclGinSignal_t signal, int bits = 64,
                                         cuda::memory_order ord = cuda::memory_order_acquire) const {
        const uint64_t *s = getSignalShadowPtr(signal);
        waitSignal(coop, signal, s != nullptr ? *(volatile const uint64_t *)s : 0, bits, ord);
    }
    /** Waits until the signal exceeds its shadow by `leastDelta`; `before` gets the shadow,
     *  `delta` the signal's lead over it, and the shadow becomes the signal. */
    template <typename Coop, typename Uint>
    __device__ void waitSignalFollowShadow(Coop coop, ncclGinSignal_t signal, Uint leastDelta, Uint *before,
                                           Uint *delta, int bits = 64,
                                           cuda::memory_order = cuda::memory_order_acquire) const {
        namespace d = gdaki::detail;
        uint64_t *shadow = getSignalShadowPtr(signal);
        const auto co = gdaki::nccl::coop(coop);
        const uint64_t was = shadow != nullptr ? *(volatile const uint64_t *)shadow : 0;
        const uint64_t now = wait_word(coop, shadow != nullptr ? signal_word(signal) : nullptr,
                                       was + (uint64_t)leastDelta, bits);
        if (before != nullptr) *before = (Uint)was;
        if (delta != nullptr) *delta = (Uint)((now - was) & gdaki::nccl::mask(bits));
        d::sync(co);
        if (shadow != nullptr && d::rank(co) == 0) *shadow = now;
        d::sync(co);
    }

    /** This rank's counter `counter` (low `bits` bits; gdaki's counters are 64-bit). */
    __device__ uint64_t readCounter(ncclGinCounter_t counter, int bits = 56,
                                    cuda::memory_order = cuda::memory_order_acquire) const {
        if (counter >= (uint32_t)comm.ginCounterCount) return 0;
        return gdaki::nccl::load_acquire(&comm.counters[counter]) & gdaki::nccl::mask(bits);
    }
    /** Waits until counter `counter` is at least `least` (rolling, in `bits` bits). */
    template <typename Coop>
    __device__ void waitCounter(Coop coop, ncclGinCounter_t counter, uint64_t least, int bits = 56,
                                cuda::memory_order = cuda::memory_order_acquire) const {
        wait_word(coop, counter < (uint32_t)comm.ginCounterCount ? &comm.counters[counter] : nullptr, least, bits);
    }

    /** Sets a counter, or a signal and its shadow, to zero (no concurrent change may race). */
    __device__ void resetCounter(ncclGinCounter_t counter) const {
        if (counter < (uint32_t)comm.ginCounterCount) *(volatile uint64_t *)&comm.counters[counter] = 0;
        else gdaki::nccl::note(comm, GDAKI_CODE_BAD_ARGUMENT);
    }
    __device__ void resetSignal(ncclGinSignal_t signal) const {
        if (signal >= (uint32_t)comm.ginSignalCount) return gdaki::nccl::note(comm, GDAKI_CODE_BAD_ARGUMENT);
        *(volatile uint64_t *)signal_word(signal) = 0;
        *(volatile uint64_t *)&comm.shadows[signal] = 0;
    }
    __device__ void resetSignal(ncclWindow_t signalWindow, size_t signalOffset) const {
        if (const uint64_t *w = va_word(signalWindow, signalOffset)) *(volatile uint64_t *)w = 0;
        else gdaki::nccl::note(comm, GDAKI_CODE_BAD_ARGUMENT);
    }

    /* ---- gdaki's own, for the barrier */

    /** Signal word `id` of the communicator's signal window (the user's, then the barriers'). */
    __device__ uint64_t *signal_word(uint32_t id) const { return (uint64_t *)(comm.signals.local + (uint64_t)id * 8); }

    /** Waits on `word` (NULL: refused), noting a failure; returns the value seen. */
    template <typename Coop>
    __device__ uint64_t wait_word(Coop coop, const uint64_t *word, uint64_t least, int bits) const {
        const auto co = gdaki::nccl::coop(coop);
        if (!gdaki::detail::agree(word != nullptr, gdaki::detail::Args{{(uint64_t)word, least, (uint64_t)bits, 0, 0, 0}}, co)) {
            gdaki::nccl::note(comm, GDAKI_CODE_BAD_ARGUMENT);
            return 0;
        }
        uint32_t s;
        const uint64_t v = gdaki::nccl::wait_at_least(comm, co, word, least, bits, &s);
        gdaki::nccl::note(comm, s);
        return v;
    }

  private:
    __device__ static bool fits(uint64_t size, uint64_t offset, uint64_t bytes) {
        return offset <= size && bytes <= size - offset;
    }
    __device__ const uint64_t *va_word(ncclWindow_t w, size_t offset) const {
        if (w == nullptr || offset % 8 != 0 || !fits(w->size, offset, 8)) return nullptr;
        return (const uint64_t *)(w->local + offset);
    }
    /* After the put: the local action (first member, after the put succeeded), shared. */
    template <typename LocalAction, typename Co>
    __device__ void finish(int to, uint32_t s, LocalAction a, Co co, uint64_t ticket) const {
        if (!gdaki::nccl::is_none<LocalAction>::value) {
            if (gdaki::detail::rank(co) == 0 && s == GDAKI_OK) s = gdaki::nccl::local(comm, to, a, ticket);
            s = gdaki::detail::share(s, co);
        }
        gdaki::nccl::note(comm, s);
    }
};

/* -------------------------------------------------------------------- the world barrier */

/** What a barrier makes visible besides the synchronisation: NCCL's fence levels. */
enum ncclGinFenceLevel : uint32_t {
    None = 0,
    Put = 1u << 0,
    Get = 1u << 1,
    Relaxed = None,
};
__host__ __device__ constexpr ncclGinFenceLevel operator|(ncclGinFenceLevel a, ncclGinFenceLevel b) {
    return static_cast<ncclGinFenceLevel>(static_cast<uint32_t>(a) | static_cast<uint32_t>(b));
}
__host__ __device__ constexpr ncclGinFenceLevel operator&(ncclGinFenceLevel a, ncclGinFenceLevel b) {
    return static_cast<ncclGinFenceLevel>(static_cast<uint32_t>(a) & static_cast<uint32_t>(b));
}

/** Every context of a communicator (gdaki has one). */
struct ncclGinAllContexts {
    const gdakiDevComm &comm;
    __host__ __device__ constexpr ncclGinAllContexts(const gdakiDevComm &c) : comm(c) {}
};

/** World barrier `index` (0 .. worldGinBarrierCount-1) of a coop: every rank's coop calls
 *  sync() the same number of times, in the same order. Each sync signals every other rank on
 *  the barrier's own signal word (strong signals: a rank's earlier puts to this one have landed
 *  when its signal is seen) and waits for theirs; the session keeps its epoch and leaves it in
 *  the communicator when it ends. */
template <typename Coop>
struct ncclGinBarrierSession {
    __device__ ncclGinBarrierSession(Coop, ncclGin gin, ncclTeamTagWorld, uint32_t index)
        : comm_(gin.comm), index_(index), epoch_(load_epoch(gin.comm, index)) {}
    __device__ ncclGinBarrierSession(Coop, ncclGinAllContexts all, ncclTeamTagWorld, uint32_t index)
        : comm_(all.comm), index_(index), epoch_(load_epoch(all.comm, index)) {}
    ncclGinBarrierSession(const ncclGinBarrierSession &) = delete;
    __device__ ~ncclGinBarrierSession() {
        /* Every member holds the same epoch; the first leaves it. */
        if (index_ < (uint32_t)comm_.worldGinBarrierCount && gdaki::detail::rank(gdaki::nccl::coop(Coop{})) == 0)
            *(volatile uint32_t *)&comm_.barrierEpochs[index_] = epoch_;
    }

    __device__ void sync(Coop coop, cuda::memory_order = cuda::memory_order_acq_rel,
                         ncclGinFenceLevel fence = ncclGinFenceLevel::Put | ncclGinFenceLevel::Get) {
        namespace d = gdaki::detail;
        if (index_ >= (uint32_t)comm_.worldGinBarrierCount) return gdaki::nccl::note(comm_, GDAKI_CODE_BAD_ARGUMENT);
        const ncclGin gin(comm_, 0);
        const auto co = gdaki::nccl::coop(coop);
        /* Get: this rank's gets have landed before anyone passes. */
        if ((fence & ncclGinFenceLevel::Get) != ncclGinFenceLevel::None) gin.flush(coop);
        const uint32_t id = (uint32_t)comm_.ginSignalCount + index_;
        const gdaki::Gin<gdaki::Gpu> handle = gdaki::nccl::handle(comm_);
        gdaki::p2p::fence();
        d::sync(co);
        /* The members share the signals: member r signals ranks r, r + size, ... */
        for (uint32_t p = d::rank(co); p < (uint32_t)comm_.nRanks; p += d::size(co))
            if (p != (uint32_t)comm_.rank) gdaki::nccl::note(comm_, handle.signal(p, gdaki::SignalInc{id}, gdaki::Thread{}));
        epoch_++;
        gin.wait_word(coop, gin.signal_word(id), (uint64_t)epoch_ * (uint64_t)(comm_.nRanks - 1), 64);
    }

  private:
    const gdakiDevComm &comm_;
    uint32_t index_;
    uint32_t epoch_;

    __device__ static uint32_t load_epoch(const gdakiDevComm &c, uint32_t index) {
        return index < (uint32_t)c.worldGinBarrierCount ? *(volatile const uint32_t *)&c.barrierEpochs[index] : 0;
    }
};

/** A one-shot world barrier: a session's construction, sync and end. */
template <typename Coop>
__device__ void ncclGinBarrier(Coop coop, ncclGin gin, ncclTeamTagWorld world, uint32_t index,
                               cuda::memory_order order = cuda::memory_order_acq_rel,
                               ncclGinFenceLevel fence = ncclGinFenceLevel::Put | ncclGinFenceLevel::Get) {
    ncclGinBarrierSession<Coop> session(coop, gin, world, index);
    session.sync(coop, order, fence);
}
template <typename Coop>
__device__ void ncclGinBarrier(Coop coop, ncclGinAllContexts all, ncclTeamTagWorld world, uint32_t index,
                               cuda::memory_order order = cuda::memory_order_acq_rel,
                               ncclGinFenceLevel fence = ncclGinFenceLevel::Put | ncclGinFenceLevel::Get) {
    ncclGinBarrierSession<Coop> session(coop, all, world, index);
    session.sync(coop, order, fence);
}

#endif /* GDAKI_NCCL_GIN_CUH */
