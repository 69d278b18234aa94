// gshmem's test: every operation between every PE, data verified on every PE. Thread scope
// runs in both builds (kernels, or host threads in CPU mode); warp scope needs the CUDA build.
// Exits 0 when every check passed on this PE. Run it as N processes (mpirun -np N, or the TCP
// rendezvous: GSHMEM_RANK / GSHMEM_NRANKS); see ../README.md. GSHMEM_TEST_THREADS sets the
// threads of the thread-scope tests (default 256 on the GPU, 8 in CPU mode).
#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <set>

#include "gdaki_gin_host.h"
#include "launch.hpp"

using launch::Failures;

namespace {

int checks = 0, failed = 0;

#define CHECK(cond, ...)                                                     \
    do {                                                                     \
        checks++;                                                            \
        if (!(cond)) {                                                       \
            failed++;                                                        \
            std::fprintf(stderr, "PE %d: %s:%d: %s: ", gshmem_my_pe(), __FILE__, __LINE__, #cond); \
            std::fprintf(stderr, __VA_ARGS__);                               \
            std::fprintf(stderr, "\n");                                      \
        }                                                                    \
    } while (0)

LAUNCH_HD uint8_t pattern(uint32_t pe, uint32_t index, uint64_t i) {
    return (uint8_t)(pe * 131u + index * 7u + (uint32_t)i * 13u + 1u);
}
LAUNCH_HD uint32_t value(uint32_t pe, uint32_t t) { return 0x80000000u | (pe << 20) | t; }

constexpr uint32_t BLOCK = 64;     // bytes per thread in thread scope
constexpr uint32_t FETCHES = 4;    // fetch-adds per thread
constexpr uint32_t ROUNDS = 8;     // device barrier rounds
constexpr uint64_t BIG = 64 << 10; // bytes per warp in warp scope
constexpr uint32_t WARPS = 4;

template <class T>
std::vector<T> read(const T *sym, size_t count) {
    std::vector<T> out(count);
    launch::check(gshmem_heap_read(out.data(), sym, count * sizeof(T)), "gshmem_heap_read");
    return out;
}

/** The kernel's failure record: none expected. */
void no_failures(Failures *f, const char *test) {
    Failures got = read(f, 1)[0];
    CHECK(got.count == 0, "%s: %u failures, the first at line %u, index %u: code %u", test, got.count, got.first_line,
          got.first_index, got.first_code);
    if (got.count != 0 && gshmem_check_queues() != 0) std::fprintf(stderr, "PE %d: %s\n", gshmem_my_pe(), gshmem_error());
    const Failures none{};
    launch::check(gshmem_heap_write(f, &none, sizeof none), "gshmem_heap_write");
}

void fill(uint8_t *sym, uint32_t pe, uint32_t index, uint64_t bytes) {
    std::vector<uint8_t> v(bytes);
    for (uint64_t i = 0; i < bytes; i++) v[i] = pattern(pe, index, i);
    launch::check(gshmem_heap_write(sym, v.data(), bytes), "gshmem_heap_write");
}

/** `bytes` at `sym` hold pattern(pe, index); names the first byte that does not. */
void expect_pattern(const uint8_t *sym, uint32_t pe, uint32_t index, uint64_t bytes, const char *what) {
    std::vector<uint8_t> v = read(sym, bytes);
    uint64_t i = 0;
    while (i < bytes && v[i] == pattern(pe, index, i)) i++;
    CHECK(i == bytes, "%s: byte %llu is %u, expected %u (from PE %u, block %u)", what, (unsigned long long)i,
          i < bytes ? v[i] : 0, i < bytes ? pattern(pe, index, i) : 0, pe, index);
}

// ---- thread scope ----

/** Thread t puts its block to the next PE (blocking or not, by parity). */
struct PutRing {
    uint8_t *src, *dst;
    Failures *f;
    GSHMEM_FN void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        int me = gshmem::my_pe(c), next = (me + 1) % gshmem::n_pes(c);
        uint8_t *s = src + (uint64_t)t * BLOCK;
        for (uint32_t i = 0; i < BLOCK; i++) s[i] = pattern(me, t, i);
        if (t % 2 == 0) EXPECT_OK(f, gshmem::put(c, dst + (uint64_t)t * BLOCK, s, BLOCK, next), t);
        else EXPECT_OK(f, gshmem::put_nbi(c, dst + (uint64_t)t * BLOCK, s, BLOCK, next), t);
        EXPECT_OK(f, gshmem::quiet(c), t);
    }
};

/** Thread t writes one word, through p, to PE t % n_pes, at its own slot there. */
struct PScatter {
    uint32_t *words;
    Failures *f;
    GSHMEM_FN void operator()(const gshmem_ctx &c, uint32_t t, uint32_t n) const {
        int me = gshmem::my_pe(c);
        EXPECT_OK(f, gshmem::p<uint32_t>(c, &words[(uint64_t)me * n + t], value(me, t), t % gshmem::n_pes(c)), t);
        EXPECT_OK(f, gshmem::quiet(c), t);
    }
};

/** Thread t gets the next PE's block t. */
struct GetNext {
    uint8_t *src, *dst;
    Failures *f;
    GSHMEM_FN void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        int next = (gshmem::my_pe(c) + 1) % gshmem::n_pes(c);
        EXPECT_OK(f, gshmem::get(c, dst + (uint64_t)t * BLOCK, src + (uint64_t)t * BLOCK, BLOCK, next), t);
    }
};

/** Thread t adds 1 to the counter of PE t % n_pes, FETCHES times, logging what it fetched. */
struct FetchAdd {
    uint64_t *counter, *log;
    Failures *f;
    GSHMEM_FN void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        for (uint32_t k = 0; k < FETCHES; k++) {
            uint64_t v = ~0ull;
            EXPECT_OK(f, gshmem::atomic_fetch_add(c, counter, 1, t % gshmem::n_pes(c), &v), t);
            log[(uint64_t)t * FETCHES + k] = v;
        }
    }
};

/** Thread q sends a block to PE q and signals it; every thread waits for all PEs' blocks and
 *  checks them. */
struct SignalAll {
    uint8_t *outbox, *inbox;
    uint64_t *signal;
    Failures *f;
    GSHMEM_FN void operator()(const gshmem_ctx &c, uint32_t q, uint32_t) const {
        int me = gshmem::my_pe(c), np = gshmem::n_pes(c);
        uint8_t *out = outbox + (uint64_t)q * BLOCK;
        for (uint32_t i = 0; i < BLOCK; i++) out[i] = pattern(me, q + 2000, i);
        EXPECT_OK(f, gshmem::put_signal_nbi(c, inbox + (uint64_t)me * BLOCK, out, BLOCK, signal, 1, (int)q), q);
        EXPECT_OK(f, gshmem::signal_wait_until_ge(c, signal, (uint64_t)np), q);
        for (int s = 0; s < np; s++)
            for (uint32_t i = 0; i < BLOCK; i++)
                if (((volatile uint8_t *)inbox)[(uint64_t)s * BLOCK + i] != pattern(s, me + 2000, i)) {
                    launch::record(f, 0xdada, __LINE__, s);
                    break;
                }
        EXPECT_OK(f, gshmem::quiet(c), q);
    }
};

/** One thread: each round puts the round's number to the next PE, passes a device barrier and
 *  checks that the previous PE's number for the round is here. */
struct Barriers {
    uint64_t *slots;
    Failures *f;
    GSHMEM_FN void operator()(const gshmem_ctx &c, uint32_t, uint32_t) const {
        int next = (gshmem::my_pe(c) + 1) % gshmem::n_pes(c);
        for (uint64_t r = 0; r < ROUNDS; r++) {
            EXPECT_OK(f, gshmem::p<uint64_t>(c, &slots[r % 2], r + 1, next), (uint32_t)r);
            EXPECT_OK(f, gshmem::barrier_all(c), (uint32_t)r);
            uint64_t got = ((volatile uint64_t *)slots)[r % 2];
            if (got != r + 1) launch::record(f, (uint32_t)got, __LINE__, (uint32_t)r);
        }
    }
};

/** Bad arguments are refused before anything is posted. */
struct Refusals {
    uint8_t *buf;
    Failures *f;
    GSHMEM_FN void operator()(const gshmem_ctx &c, uint32_t, uint32_t) const {
        int me = gshmem::my_pe(c), np = gshmem::n_pes(c);
        uint8_t *own = (uint8_t *)c.heap_base, *end = (uint8_t *)(c.heap_base + c.heap_bytes);
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT, gshmem::put(c, buf, buf + 8, 8, np), 1);
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT, gshmem::put_nbi(c, buf, buf + 8, 8, -1), 2);
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT, gshmem::put(c, own, buf, 8, me), 3);
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT, gshmem::put(c, end - 4, buf, 8, me), 4);
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT, gshmem::get(c, buf, buf, c.heap_bytes, me), 5);
        EXPECT_CODE(f, GDAKI_CODE_MISALIGNED, gshmem::atomic_fetch_add(c, (uint64_t *)(buf + 4), 1, me, nullptr), 6);
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT, gshmem::p<uint32_t>(c, (uint32_t *)64, 1u, me), 7);
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT, gshmem::signal_wait_until_ge(c, (const uint64_t *)own, 1), 8);
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT,
                    gshmem::put_signal_nbi(c, buf, buf, 8, (uint64_t *)end, 1, me), 9);
        gshmem_ctx stale = c;
        stale.version = 0;
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT, gshmem::quiet(stale), 10);
        EXPECT_CODE(f, GDAKI_CODE_BAD_ARGUMENT, gshmem::p<uint32_t>(stale, (uint32_t *)buf, 1u, me), 11);
    }
};

// ---- warp scope ----
#if defined(GDAKI_CUDA)

/** Warp w puts a large and a small buffer to PE me + 1 + w, at its own slots there. */
struct WarpPut {
    uint8_t *src, *dst, *small_src, *small_dst;
    Failures *f;
    __device__ void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        int me = gshmem::my_pe(c), np = gshmem::n_pes(c);
        uint32_t w = t / 32, lane = t % 32;
        int pe = (me + 1 + (int)w) % np;
        for (uint64_t i = lane; i < BIG; i += 32) src[w * BIG + i] = pattern(me, w + 3000, i);
        for (uint64_t i = lane; i < 256; i += 32) small_src[w * 256 + i] = pattern(me, w + 4000, i);
        __syncwarp();
        uint64_t slot = (uint64_t)me * WARPS + w;
        EXPECT_OK(f, gshmem::put_warp(c, dst + slot * BIG, src + w * BIG, BIG, pe), t);
        EXPECT_OK(f, gshmem::put_nbi_warp(c, small_dst + slot * 256, small_src + w * 256, 256, pe), t);
        EXPECT_OK(f, gshmem::quiet_warp(c), t);
    }
};

/** Warp w gets PE me + 1 + w's large buffer w, and 100 bytes of it again. */
struct WarpGet {
    uint8_t *src, *dst, *small_dst;
    Failures *f;
    __device__ void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        int pe = (gshmem::my_pe(c) + 1 + (int)(t / 32)) % gshmem::n_pes(c);
        uint32_t w = t / 32;
        EXPECT_OK(f, gshmem::get_warp(c, dst + w * BIG, src + w * BIG, BIG, pe), t);
        EXPECT_OK(f, gshmem::get_warp(c, small_dst + w * 128, src + w * BIG, 100, pe), t);
    }
};

/** Every lane of warp w writes its own word to PE w % n_pes. */
struct WarpP {
    uint32_t *words;
    Failures *f;
    __device__ void operator()(const gshmem_ctx &c, uint32_t t, uint32_t n) const {
        int me = gshmem::my_pe(c);
        EXPECT_OK(f, gshmem::p_warp<uint32_t>(c, &words[(uint64_t)me * n + t], value(me, t), (int)(t / 32) % gshmem::n_pes(c)), t);
        EXPECT_OK(f, gshmem::quiet_warp(c), t);
    }
};

/** Every lane of warp w adds 1 to PE w % n_pes's counter, FETCHES times. */
struct WarpFetchAdd {
    uint64_t *counter, *log;
    Failures *f;
    __device__ void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        for (uint32_t k = 0; k < FETCHES; k++) {
            uint64_t v = ~0ull;
            EXPECT_OK(f, gshmem::atomic_fetch_add_warp(c, counter, 1, (int)(t / 32) % gshmem::n_pes(c), &v), t);
            log[(uint64_t)t * FETCHES + k] = v;
        }
    }
};

/** Warp q sends a large block to PE q with a signal; all wait for every PE's block. */
struct WarpSignalAll {
    uint8_t *outbox, *inbox;
    uint64_t *signal;
    Failures *f;
    __device__ void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        int me = gshmem::my_pe(c), np = gshmem::n_pes(c);
        uint32_t q = t / 32, lane = t % 32;
        for (uint64_t i = lane; i < BIG; i += 32) outbox[q * BIG + i] = pattern(me, q + 6000, i);
        __syncwarp();
        EXPECT_OK(f, gshmem::put_signal_nbi_warp(c, inbox + (uint64_t)me * BIG, outbox + q * BIG, BIG, signal, 1, (int)q), t);
        EXPECT_OK(f, gshmem::signal_wait_until_ge(c, signal, (uint64_t)np), t);
        EXPECT_OK(f, gshmem::quiet_warp(c), t);
    }
};

/** One warp: Barriers, with barrier_all_warp. */
struct WarpBarriers {
    uint64_t *slots;
    Failures *f;
    __device__ void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        int next = (gshmem::my_pe(c) + 1) % gshmem::n_pes(c);
        for (uint64_t r = 0; r < ROUNDS; r++) {
            if (t == 0) EXPECT_OK(f, gshmem::p<uint64_t>(c, &slots[r % 2], r + 1, next), (uint32_t)r);
            EXPECT_OK(f, gshmem::barrier_all_warp(c), (uint32_t)r);
            uint64_t got = ((volatile uint64_t *)slots)[r % 2];
            if (got != r + 1) launch::record(f, (uint32_t)got, __LINE__, (uint32_t)r);
        }
    }
};

#endif

/** The fetched values from this PE's threads, per target, are distinct and below the total
 *  the target's counter reached. */
void expect_fetches(const uint64_t *log, uint32_t threads, uint32_t group, uint32_t np, uint64_t per_target,
                    const char *what) {
    std::vector<uint64_t> got = read(log, (size_t)threads * FETCHES);
    std::vector<std::set<uint64_t>> seen(np);
    bool fine = true;
    for (uint32_t t = 0; t < threads; t++)
        for (uint32_t k = 0; k < FETCHES; k++) {
            uint64_t v = got[(size_t)t * FETCHES + k];
            uint32_t target = (t / group) % np;
            fine = fine && v < per_target && seen[target].insert(v).second;
        }
    CHECK(fine, "%s: a fetched value repeats or exceeds the counter's final %llu", what, (unsigned long long)per_target);
}

void windows(int np);

void host_api(int np) {
    CHECK(gshmem_init(nullptr) == -1 && std::strstr(gshmem_error(), "already") != nullptr, "%s", gshmem_error());
    CHECK(gshmem_malloc(0) == nullptr && std::strstr(gshmem_error(), "0 bytes") != nullptr, "%s", gshmem_error());
    CHECK(gshmem_malloc((size_t)1 << 50) == nullptr && std::strstr(gshmem_error(), "do not fit") != nullptr, "%s",
          gshmem_error());
    int local = 0;
    CHECK(gshmem_free(&local) == -1 && std::strstr(gshmem_error(), "not a block") != nullptr, "%s", gshmem_error());
    CHECK(gshmem_heap_write(&local, &local, 4) == -1 && std::strstr(gshmem_error(), "outside the heap") != nullptr,
          "%s", gshmem_error());
    // First fit reuses a freed block, 256-byte aligned, zeroed again.
    uint8_t *a = launch::alloc<uint8_t>(1000);
    uint8_t *b = launch::alloc<uint8_t>(10);
    CHECK((uintptr_t)a % 256 == 0 && (uintptr_t)b % 256 == 0 && b == a + 1024, "a %p b %p", (void *)a, (void *)b);
    fill(a, 1, 1, 1000);
    launch::check(gshmem_free(a), "gshmem_free");
    uint8_t *c = launch::alloc<uint8_t>(500);
    CHECK(c == a, "first fit: %p, expected %p", (void *)c, (void *)a);
    std::vector<uint8_t> zero = read(c, 500);
    CHECK(std::all_of(zero.begin(), zero.end(), [](uint8_t x) { return x == 0; }), "a reused block is not zeroed");
    launch::check(gshmem_free(c), "gshmem_free");
    launch::check(gshmem_free(b), "gshmem_free");
    CHECK(gshmem_n_pes() == np, "n_pes %d", gshmem_n_pes());
    // Paths: one per PE, with a reason; GSHMEM_EXPECT_PATH (load_store or queue_pair) says
    // which every PE must take.
    const char *why = nullptr;
    CHECK(gshmem_pe_path(np, &why) == -1 && std::strstr(gshmem_error(), "is not in") != nullptr, "%s", gshmem_error());
    const char *expect = std::getenv("GSHMEM_EXPECT_PATH");
    for (int pe = 0; pe < np; pe++) {
        int path = gshmem_pe_path(pe, &why);
        CHECK(path >= 0 && why != nullptr && *why != '\0', "PE %d: %s", pe, gshmem_error());
        if (gshmem_my_pe() == 0) std::printf("gshmem_test: path to PE %d: %s\n", pe, why != nullptr ? why : "?");
        if (expect != nullptr) {
            int want = std::strcmp(expect, "load_store") == 0 ? GSHMEM_PATH_LOAD_STORE : GSHMEM_PATH_QUEUE_PAIR;
            CHECK(path == want, "PE %d: path %d, GSHMEM_EXPECT_PATH=%s: %s", pe, path, expect, why);
        }
    }
#if !defined(GDAKI_CUDA)
    CHECK(gshmem_pe_path(0, &why) == GSHMEM_PATH_QUEUE_PAIR && std::strstr(why, "CPU mode") != nullptr, "%s", why);
    CHECK(gshmem_gpu_sharers() == 1, "CPU mode: %d PEs share a GPU", gshmem_gpu_sharers());
#else
    CHECK(gshmem_gpu_sharers() >= 1 && gshmem_gpu_sharers() <= np, "%d PEs share this GPU", gshmem_gpu_sharers());
#endif
    windows(np);
}

/** `count` elements of a table the context or a window points to (device memory in GPU mode). */
template <class T>
std::vector<T> table(const T *at, size_t count) {
    std::vector<T> out(count);
#if defined(GDAKI_CUDA)
    launch::cuda(cudaMemcpy(out.data(), at, count * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
#else
    std::memcpy(out.data(), at, count * sizeof(T));
#endif
    return out;
}

/** Windows of the GIN-shaped handle: every PE's part at the same offset, the load/store
 *  addresses of the same PEs as the heaps', the refusals. */
void windows(int np) {
    uint8_t *buf = launch::alloc<uint8_t>(4096);
    const gshmem_ctx c = gshmem_device_ctx();
    const uint64_t off = (uint64_t)buf + 100 - c.heap_base;
    gshmem_window w{};
    launch::check(gshmem_window_create(buf + 100, 1000, &w), "gshmem_window_create");
    CHECK(w.local == (uint64_t)buf + 100 && w.size == 1000 && w.lkey == c.lkey && w.npeers == (uint32_t)np,
          "window %" PRIx64 " %" PRIu64 " %u %u", w.local, w.size, w.lkey, w.npeers);
    std::vector<gdaki_remote_region> heaps = table(c.heaps, np), parts = table(w.peers, np);
    for (int pe = 0; pe < np; pe++)
        CHECK(parts[pe].addr == heaps[pe].addr + off && parts[pe].len == 1000 && parts[pe].rkey == heaps[pe].rkey,
              "PE %d's part: %" PRIx64 " %" PRIu64 " %u", pe, parts[pe].addr, parts[pe].len, parts[pe].rkey);
#if defined(GDAKI_CUDA)
    std::vector<uint64_t> direct = table(c.peer_heaps, np), mapped = table(w.mapped, np);
    for (int pe = 0; pe < np; pe++)
        CHECK(mapped[pe] == (direct[pe] != 0 ? direct[pe] + off : 0), "PE %d mapped at %" PRIx64, pe, mapped[pe]);
#else
    CHECK(w.mapped == nullptr, "CPU mode maps nothing");
#endif
    launch::check(gshmem_window_destroy(&w), "gshmem_window_destroy");
    CHECK(w.peers == nullptr && w.local == 0, "a destroyed window is zeroed");
    CHECK(gshmem_window_destroy(&w) == 0, "a zeroed window is nothing to destroy: %s", gshmem_error());
    gshmem_window fake{};
    fake.peers = heaps.data();
    CHECK(gshmem_window_destroy(&fake) == -1 && std::strstr(gshmem_error(), "not a live window") != nullptr, "%s",
          gshmem_error());
    CHECK(gshmem_window_create((void *)c.heap_base, 8, &w) == -1 && std::strstr(gshmem_error(), "own words") != nullptr,
          "%s", gshmem_error());
    int local = 0;
    CHECK(gshmem_window_create(&local, 4, &w) == -1 && std::strstr(gshmem_error(), "outside the heap") != nullptr,
          "%s", gshmem_error());
    CHECK(gshmem_window_create(buf, 8, nullptr) == -1 && std::strstr(gshmem_error(), "out is NULL") != nullptr, "%s",
          gshmem_error());
    // The window's own fields, where kernels take them (NCCL-style kernels' ncclWindow_t).
    launch::check(gshmem_window_create(buf + 100, 1000, &w), "gshmem_window_create");
    const gshmem_window self = table((const gshmem_window *)w.device, 1)[0];
    CHECK(self.local == w.local && self.size == w.size && self.peers == w.peers && self.device == w.device,
          "the window's fields in its tables");
    launch::check(gshmem_window_destroy(&w), "gshmem_window_destroy");
    launch::check(gshmem_free(buf), "gshmem_free");

    // The device communicator of NCCL-style kernels (gdaki_nccl_gin.cuh).
    gshmem_dev_comm_requirements req{3, 2, 1};
    gdakiDevComm comm{};
    launch::check(gshmem_dev_comm_create(&req, &comm), "gshmem_dev_comm_create");
    CHECK(comm.rank == gshmem_my_pe() && comm.nRanks == np && comm.ginContextCount == 1 && comm.ginSignalCount == 3 &&
              comm.ginCounterCount == 2 && comm.worldGinBarrierCount == 1 && comm.qps == c.qps,
          "communicator %d/%d", comm.rank, comm.nRanks);
    CHECK(comm.signals.size == 5 * 8 && comm.signals.npeers == (uint32_t)np && comm.scratch.size == 8,
          "signal window of %" PRIu64 " bytes", comm.signals.size);
    const std::vector<uint64_t> zeros = table(comm.counters, 2 + 3);
    CHECK(zeros == std::vector<uint64_t>(5, 0), "counters and shadows start at 0");
    uint32_t code = 7;
    launch::check(gshmem_dev_comm_error(&comm, &code), "gshmem_dev_comm_error");
    CHECK(code == 0, "no error yet: %u", code);
    CHECK(comm.counterQp != nullptr, "counters come with a counter queue pair");
#if !defined(GDAKI_CUDA)
    {
        // In CPU mode the handles are host ones: a put to this PE, counted by the counter QP (a
        // WAIT for the put's completion, then an add of 5 to counter 1), as a kernel's would be.
        uint64_t *block = (uint64_t *)gshmem_malloc(8);
        const uint64_t at = (uint64_t)block - c.heap_base;
        const uint64_t word = 0x1122334455667788ull;
        uint64_t ticket = 0;
        gdaki_dev_qp *self = c.qps[gshmem_my_pe()];
        CHECK(gdaki_put_inline_thread_gpu(self, c.heaps[gshmem_my_pe()].addr + at, c.heaps[gshmem_my_pe()].rkey, &word,
                                          8, 0, &ticket) == 0,
              "a put to self");
        CHECK(gdaki_count_when_done_thread_gpu(comm.counterQp, self, ticket, (uint64_t)&comm.counters[1],
                                               comm.counterRkey, 5, comm.scratch.local, comm.scratch.lkey, 0,
                                               nullptr) == 0,
              "a count when it is done");
        CHECK(gdaki_wait_signal_thread_gpu(comm.counterQp, &comm.counters[1], 5) == 0 &&
                  table(comm.counters, 2)[1] == 5,
              "the counter reads 5");
        CHECK(table(block, 1)[0] == word, "the counted put landed");
        launch::check(gshmem_free(block), "gshmem_free");
    }
#endif
    launch::check(gshmem_dev_comm_destroy(&comm), "gshmem_dev_comm_destroy");
    CHECK(comm.internal == nullptr && comm.qps == nullptr, "a destroyed communicator is zeroed");
    CHECK(gshmem_dev_comm_destroy(&comm) == 0, "a zeroed communicator is nothing to destroy");
    gshmem_dev_comm_requirements no_counters{1, 0, 0};
    launch::check(gshmem_dev_comm_create(&no_counters, &comm), "gshmem_dev_comm_create");
    CHECK(comm.counterQp == nullptr, "no counters, no counter queue pair");
    launch::check(gshmem_dev_comm_destroy(&comm), "gshmem_dev_comm_destroy");
    req.gin_signal_count = -1;
    CHECK(gshmem_dev_comm_create(&req, &comm) == -1 && std::strstr(gshmem_error(), "out of range") != nullptr, "%s",
          gshmem_error());
    CHECK(gshmem_dev_comm_create(nullptr, &comm) == -1 && std::strstr(gshmem_error(), "NULL") != nullptr, "%s",
          gshmem_error());
    CHECK(gshmem_dev_comm_error(&comm, &code) == -1, "a destroyed communicator has no error word");
}

} // namespace

int main() {
    gshmem_options o = launch::options();
#if defined(GDAKI_CUDA)
    launch::prepare_gpu(o.gpu < 0 ? 0 : o.gpu);
    uint32_t T = 256;
#else
    o.gpu = -1;
    o.heap_kind = GSHMEM_HEAP_DEFAULT;
    uint32_t T = 8;
#endif
    // Threads of the thread-scope tests (GSHMEM_TEST_THREADS, 1 to 1024).
    if (const char *v = std::getenv("GSHMEM_TEST_THREADS")) T = (uint32_t)std::min(std::max(std::atoi(v), 1), 1024);
    launch::check(gshmem_init(&o), "gshmem_init");
    const uint32_t me = (uint32_t)gshmem_my_pe(), np = (uint32_t)gshmem_n_pes();
    const uint32_t prev = (me + np - 1) % np, next = (me + 1) % np;
    host_api((int)np);

    Failures *f = launch::alloc<Failures>(1);
    // put, put_nbi, quiet
    {
        uint8_t *src = launch::alloc<uint8_t>(T * BLOCK), *dst = launch::alloc<uint8_t>(T * BLOCK);
        launch::run(PutRing{src, dst, f}, T);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        no_failures(f, "put");
        for (uint32_t t = 0; t < T; t++) expect_pattern(dst + (uint64_t)t * BLOCK, prev, t, BLOCK, "put");
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        gshmem_free(dst);
        gshmem_free(src);
    }
    // p
    {
        uint32_t *words = launch::alloc<uint32_t>((size_t)np * T);
        launch::run(PScatter{words, f}, T);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        no_failures(f, "p");
        std::vector<uint32_t> got = read(words, (size_t)np * T);
        uint32_t wrong = 0;
        for (uint32_t s = 0; s < np; s++)
            for (uint32_t t = 0; t < T; t++)
                wrong += got[(size_t)s * T + t] != (t % np == me ? value(s, t) : 0u);
        CHECK(wrong == 0, "p: %u words wrong", wrong);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        gshmem_free(words);
    }
    // get
    {
        uint8_t *src = launch::alloc<uint8_t>(T * BLOCK), *dst = launch::alloc<uint8_t>(T * BLOCK);
        for (uint32_t t = 0; t < T; t++) fill(src + (uint64_t)t * BLOCK, me, t + 1000, BLOCK);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        launch::run(GetNext{src, dst, f}, T);
        no_failures(f, "get");
        for (uint32_t t = 0; t < T; t++) expect_pattern(dst + (uint64_t)t * BLOCK, next, t + 1000, BLOCK, "get");
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        gshmem_free(dst);
        gshmem_free(src);
    }
    // atomic_fetch_add
    {
        uint64_t *counter = launch::alloc<uint64_t>(1), *log = launch::alloc<uint64_t>((size_t)T * FETCHES);
        launch::run(FetchAdd{counter, log, f}, T);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        no_failures(f, "atomic_fetch_add");
        uint64_t mine = 0;
        for (uint32_t t = 0; t < T; t++) mine += t % np == me;
        uint64_t want = (uint64_t)np * FETCHES * mine;
        uint64_t got = read(counter, 1)[0];
        CHECK(got == want, "atomic_fetch_add: the counter is %llu, expected %llu", (unsigned long long)got,
              (unsigned long long)want);
        expect_fetches(log, T, 1, np, (uint64_t)np * FETCHES * ((T + np - 1) / np), "atomic_fetch_add");
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        gshmem_free(log);
        gshmem_free(counter);
    }
    // put_signal_nbi, signal_wait_until_ge
    {
        uint8_t *outbox = launch::alloc<uint8_t>((size_t)np * BLOCK), *inbox = launch::alloc<uint8_t>((size_t)np * BLOCK);
        uint64_t *signal = launch::alloc<uint64_t>(1);
        launch::run(SignalAll{outbox, inbox, signal, f}, np);
        no_failures(f, "put_signal_nbi");
        for (uint32_t s = 0; s < np; s++) expect_pattern(inbox + (uint64_t)s * BLOCK, s, me + 2000, BLOCK, "put_signal");
        CHECK(read(signal, 1)[0] == np, "the signal is %llu", (unsigned long long)read(signal, 1)[0]);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        gshmem_free(signal);
        gshmem_free(inbox);
        gshmem_free(outbox);
    }
    // barrier_all on the device
    uint64_t *slots = launch::alloc<uint64_t>(2);
    launch::run(Barriers{slots, f}, 1);
    no_failures(f, "barrier_all");
    // refusals
    {
        uint8_t *buf = launch::alloc<uint8_t>(64);
        launch::run(Refusals{buf, f}, 1);
        no_failures(f, "refusals");
        gshmem_free(buf);
    }
    const char *mode = "CPU";
#if defined(GDAKI_CUDA)
    mode = "GPU";
    {
        const uint32_t W = WARPS * 32;
        uint8_t *src = launch::alloc<uint8_t>(WARPS * BIG), *dst = launch::alloc<uint8_t>((size_t)np * WARPS * BIG);
        uint8_t *ssrc = launch::alloc<uint8_t>(WARPS * 256), *sdst = launch::alloc<uint8_t>((size_t)np * WARPS * 256);
        launch::run(WarpPut{src, dst, ssrc, sdst, f}, W);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        no_failures(f, "put_warp");
        for (uint32_t s = 0; s < np; s++)
            for (uint32_t w = 0; w < WARPS; w++) {
                if ((s + 1 + w) % np != me) continue;
                expect_pattern(dst + ((uint64_t)s * WARPS + w) * BIG, s, w + 3000, BIG, "put_warp");
                expect_pattern(sdst + ((uint64_t)s * WARPS + w) * 256, s, w + 4000, 256, "put_nbi_warp");
            }
        // get_warp of what every PE holds in its src.
        for (uint32_t w = 0; w < WARPS; w++) fill(src + w * BIG, me, w + 5000, BIG);
        uint8_t *gdst = launch::alloc<uint8_t>(WARPS * BIG), *gsmall = launch::alloc<uint8_t>(WARPS * 128);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        launch::run(WarpGet{src, gdst, gsmall, f}, W);
        no_failures(f, "get_warp");
        for (uint32_t w = 0; w < WARPS; w++) {
            expect_pattern(gdst + w * BIG, (me + 1 + w) % np, w + 5000, BIG, "get_warp");
            expect_pattern(gsmall + w * 128, (me + 1 + w) % np, w + 5000, 100, "get_warp (small)");
        }
        // p_warp
        uint32_t *words = launch::alloc<uint32_t>((size_t)np * W);
        launch::run(WarpP{words, f}, W);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        no_failures(f, "p_warp");
        std::vector<uint32_t> got = read(words, (size_t)np * W);
        uint32_t wrong = 0;
        for (uint32_t s = 0; s < np; s++)
            for (uint32_t t = 0; t < W; t++) wrong += got[(size_t)s * W + t] != ((t / 32) % np == me ? value(s, t) : 0u);
        CHECK(wrong == 0, "p_warp: %u words wrong", wrong);
        // atomic_fetch_add_warp
        uint64_t *counter = launch::alloc<uint64_t>(1), *log = launch::alloc<uint64_t>((size_t)W * FETCHES);
        launch::run(WarpFetchAdd{counter, log, f}, W);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        no_failures(f, "atomic_fetch_add_warp");
        uint64_t warps_here = 0;
        for (uint32_t w = 0; w < WARPS; w++) warps_here += w % np == me;
        uint64_t want = (uint64_t)np * FETCHES * 32 * warps_here;
        CHECK(read(counter, 1)[0] == want, "atomic_fetch_add_warp: the counter is %llu, expected %llu",
              (unsigned long long)read(counter, 1)[0], (unsigned long long)want);
        expect_fetches(log, W, 32, np, (uint64_t)np * FETCHES * 32 * ((WARPS + np - 1) / np), "atomic_fetch_add_warp");
        // put_signal_nbi_warp
        uint8_t *outbox = launch::alloc<uint8_t>((size_t)np * BIG), *inbox = launch::alloc<uint8_t>((size_t)np * BIG);
        uint64_t *signal = launch::alloc<uint64_t>(1);
        launch::run(WarpSignalAll{outbox, inbox, signal, f}, 32 * np);
        no_failures(f, "put_signal_nbi_warp");
        for (uint32_t s = 0; s < np; s++) expect_pattern(inbox + (uint64_t)s * BIG, s, me + 6000, BIG, "put_signal_nbi_warp");
        // barrier_all_warp
        uint64_t *wslots = launch::alloc<uint64_t>(2);
        launch::run(WarpBarriers{wslots, f}, 32);
        no_failures(f, "barrier_all_warp");
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
    }
#else
    std::fprintf(stderr, "PE %u: warp scope: SKIPPED (CPU mode has no warps; build with nvcc)\n", me);
#endif
    std::printf("gshmem_test: PE %u of %u (%s mode, %s bootstrap): %d checks, %d failed\n", me, np, mode,
                gshmem_bootstrap_name(), checks, failed);
    std::fflush(stdout);
    launch::check(gshmem_finalize(), "gshmem_finalize");
    return failed == 0 ? 0 : 1;
}
