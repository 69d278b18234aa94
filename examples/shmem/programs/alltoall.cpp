// The MoE-dispatch pattern on gshmem: every PE sends a block to every PE (itself included)
// with put_signal_nbi, then waits until every PE's block for it has arrived; repeated, timed,
// and verified on every PE. Next to it, in the same run: a plain copy of the same bytes on this
// PE (cudaMemcpyAsync device to device in GPU mode, memcpy in CPU mode).
//
// On the GPU each block goes out as -b pieces (default: one per 32 KiB, at most 128 / PEs and
// no more than the GPU holds at once beside gdaki's copy kernel; a -b that does not fit is refused),
// each sent by a thread block of 256 threads with put_signal_nbi_block: on the load/store path
// (gshmem_pe_path) those threads copy it themselves, through a queue pair one warp posts it.
// In CPU mode one host thread sends each piece (one piece unless -b says).
//
// With --api gin (GPU builds) the same exchange is written against gdaki's GIN-shaped handle
// (gdaki_gin.cuh), as a kernel written for NCCL GIN would be: gin.put(peer, recv window, ...,
// send window, ..., SignalInc{0}, Block) and gin.wait_signal, over gshmem's queue pairs and
// windows (gshmem_window_create), the same paths per PE.
//
//   alltoall [-s BYTES[,BYTES...]] [-n ITERATIONS] [-w WARMUP] [-b PIECES] [--api gshmem|gin] [--json]
//
// Progress goes to stderr, the table (or JSON) to stdout from PE 0, on PE 0's clock. Exit 0 when
// every PE received every block intact.
#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstring>
#include <string>

#include "launch.hpp"
#if defined(GDAKI_CUDA)
#include "gdaki_gin.cuh"
#endif

using launch::Failures;

namespace {

LAUNCH_HD uint8_t pattern(uint32_t from, uint32_t to, uint64_t i) {
    return (uint8_t)(from * 37u + to * 101u + (uint32_t)(i >> 3) * 7u + (uint32_t)i + 3u);
}

/** Threads of a sending block on the GPU. */
constexpr uint32_t BLOCK_THREADS = 256;

/** Sender (q, k) (a thread block on the GPU, a host thread in CPU mode) sends piece k of
 *  block q to PE q, then waits until all pieces of this round are here. */
struct AllToAll {
    uint8_t *send, *recv;
    uint64_t *signal;
    uint64_t bytes, base;
    uint32_t iters, pieces;
    Failures *f;
    GSHMEM_FN void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        const int me = gshmem::my_pe(c), np = gshmem::n_pes(c);
#if defined(GDAKI_CUDA)
        const uint32_t sender = t / BLOCK_THREADS;
#else
        const uint32_t sender = t;
#endif
        const int q = (int)(sender / pieces);
        // Pieces of whole 16-byte units (the last one shorter); std::min is host-only.
        const uint64_t piece = ((bytes + pieces - 1) / pieces + 15) / 16 * 16;
        const uint64_t start = (sender % pieces) * piece;
        const uint64_t from = start < bytes ? start : bytes;
        const uint64_t len = bytes - from < piece ? bytes - from : piece;
        uint8_t *dst = recv + (uint64_t)me * bytes + from, *src = send + (uint64_t)q * bytes + from;
        const uint64_t per_round = (uint64_t)np * pieces;
        for (uint32_t i = 0; i < iters; i++) {
#if defined(GDAKI_CUDA)
            EXPECT_OK(f, gshmem::put_signal_nbi_block(c, dst, src, len, signal, 1, q), i);
#else
            EXPECT_OK(f, gshmem::put_signal_nbi(c, dst, src, len, signal, 1, q), i);
#endif
            EXPECT_OK(f, gshmem::signal_wait_until_ge(c, signal, base + (uint64_t)(i + 1) * per_round), i);
        }
#if defined(GDAKI_CUDA)
        if (threadIdx.x < 32) EXPECT_OK(f, gshmem::quiet_warp(c), t);
#else
        EXPECT_OK(f, gshmem::quiet(c), t);
#endif
    }
};

#if defined(GDAKI_CUDA)
/** gdaki::Window of a gshmem window (the same fields, in order). */
gdaki::Window gin_window(const gshmem_window &w) {
    return gdaki::Window{w.local, w.size, w.lkey, w.npeers, w.peers, w.mapped};
}

/** AllToAll written against the GIN-shaped handle, as a GIN kernel is: each block puts its
 *  piece with one coop put (gdaki::Block: the threads share the copy, or the first posts it)
 *  that adds 1 to signal word 0 at the peer, then waits for the round's signals. The windows
 *  are every PE's send and receive buffers. */
struct GinAllToAll {
    gdaki::Gin<gdaki::Gpu> gin;
    gdaki::Window send, recv;
    uint64_t bytes, base;
    uint32_t iters, pieces;
    Failures *f;
    __device__ void operator()(const gshmem_ctx &c, uint32_t t, uint32_t) const {
        __shared__ gdaki_block_scratch scratch;
        const gdaki::Block block{&scratch};
        const uint32_t me = c.my_pe, np = c.n_pes, sender = t / BLOCK_THREADS, q = sender / pieces;
        const uint64_t piece = ((bytes + pieces - 1) / pieces + 15) / 16 * 16;
        const uint64_t start = (sender % pieces) * piece;
        const uint64_t from = start < bytes ? start : bytes;
        const uint64_t len = bytes - from < piece ? bytes - from : piece;
        const uint64_t per_round = (uint64_t)np * pieces;
        for (uint32_t i = 0; i < iters; i++) {
            EXPECT_OK(f, gin.put(q, recv, (uint64_t)me * bytes + from, send, (uint64_t)q * bytes + from, len,
                                 gdaki::SignalInc{0}, block), i);
            EXPECT_OK(f, gin.wait_signal(block, 0, base + (uint64_t)(i + 1) * per_round), i);
        }
        EXPECT_OK(f, gin.flush(block), t);
    }
};
#endif

/** A plain copy of `bytes` from `src` to `dst`, `iters` times: ms. */
double copy_reference(void *dst, const void *src, uint64_t bytes, uint32_t iters) {
#if defined(GDAKI_CUDA)
    cudaEvent_t start, stop;
    launch::cuda(cudaEventCreate(&start), "cudaEventCreate");
    launch::cuda(cudaEventCreate(&stop), "cudaEventCreate");
    launch::cuda(cudaEventRecord(start, launch::stream()), "cudaEventRecord");
    for (uint32_t i = 0; i < iters; i++)
        launch::cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, launch::stream()), "cudaMemcpyAsync");
    launch::cuda(cudaEventRecord(stop, launch::stream()), "cudaEventRecord");
    launch::wait_stream();
    float ms = 0;
    launch::cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms;
#else
    auto t0 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < iters; i++) {
        std::memcpy(dst, src, bytes);
        // Keeps the compiler from merging the copies.
        __asm__ __volatile__("" : : "r"(dst) : "memory");
    }
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
#endif
}

[[noreturn]] void usage(const std::string &why) {
    if (gshmem_my_pe() <= 0)
        std::fprintf(stderr,
                     "alltoall: %s\nusage: alltoall [-s BYTES[,BYTES...]] [-n ITERATIONS] [-w WARMUP] [-b PIECES] "
                     "[--api gshmem|gin] [--json]\n",
                     why.c_str());
    std::exit(2);
}

uint64_t number(const char *text, const char *what) {
    char *end = nullptr;
    errno = 0;
    unsigned long long v = std::strtoull(text, &end, 10);
    if (end == text || *end != '\0' || errno != 0 || text[0] == '-' || v == 0)
        usage(std::string(what) + " \"" + text + "\" is not a positive number");
    return v;
}

struct Row {
    uint64_t bytes;
    uint32_t pieces;
    double alltoall_us, copy_us;
};

} // namespace

int main(int argc, char **argv) {
    std::vector<uint64_t> sizes;
    uint32_t iters = 50, warmup = 5, pieces_asked = 0;
    bool json = false, gin = false;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--json") json = true;
        else if (a == "--api" && i + 1 < argc) {
            std::string v = argv[++i];
            if (v != "gshmem" && v != "gin") usage("--api \"" + v + "\": use gshmem or gin");
            gin = v == "gin";
        }
        else if ((a == "-s" || a == "-n" || a == "-w" || a == "-b") && i + 1 < argc) {
            std::string v = argv[++i];
            if (a == "-b") pieces_asked = (uint32_t)std::min<uint64_t>(number(v.c_str(), "-b"), 1024);
            else if (a == "-n") iters = (uint32_t)std::min<uint64_t>(number(v.c_str(), "-n"), 1u << 20);
            else if (a == "-w") warmup = (uint32_t)std::min<uint64_t>(number(v.c_str(), "-w"), 1u << 20);
            else
                for (size_t at = 0; at <= v.size();) {
                    size_t comma = v.find(',', at);
                    std::string one = v.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
                    sizes.push_back(number(one.c_str(), "-s"));
                    if (comma == std::string::npos) break;
                    at = comma + 1;
                }
        } else if (a == "-h" || a == "--help") usage("the MoE all-to-all on gshmem");
        else usage("unknown argument " + a);
    }
    if (sizes.empty()) sizes = {4096, 65536, 1 << 20};
#if !defined(GDAKI_CUDA)
    if (gin) usage("--api gin needs the GPU build (gdaki_gin.cuh is CUDA C++)");
#endif

    gshmem_options o = launch::options();
#if defined(GDAKI_CUDA)
    launch::prepare_gpu(o.gpu < 0 ? 0 : o.gpu);
    const char *mode = "GPU";
#else
    o.gpu = -1;
    o.heap_kind = GSHMEM_HEAP_DEFAULT;
    const char *mode = "CPU";
#endif
    uint64_t largest = *std::max_element(sizes.begin(), sizes.end());
    launch::check(gshmem_init(&o), "gshmem_init");
    const uint32_t me = (uint32_t)gshmem_my_pe(), np = (uint32_t)gshmem_n_pes();
    if (largest > o.heap_bytes / (2 * (uint64_t)np + 1))
        usage("blocks of " + std::to_string(largest) + " bytes for " + std::to_string(np) +
              " PEs do not fit in the heap: raise GSHMEM_HEAP_BYTES");
    uint8_t *send = launch::alloc<uint8_t>(np * largest), *recv = launch::alloc<uint8_t>(np * largest);
    uint8_t *copy_dst = launch::alloc<uint8_t>(np * largest);
    uint64_t *signal = launch::alloc<uint64_t>(1);
    Failures *f = launch::alloc<Failures>(1);
#if defined(GDAKI_CUDA)
    // The GIN handle's windows: the buffers, the signal word, 8 bytes for the fetched values of
    // signal atomics through queue pairs.
    uint64_t *discard = launch::alloc<uint64_t>(1);
    gshmem_window send_w{}, recv_w{}, signal_w{}, discard_w{};
    if (gin) {
        launch::check(gshmem_window_create(send, np * largest, &send_w), "gshmem_window_create");
        launch::check(gshmem_window_create(recv, np * largest, &recv_w), "gshmem_window_create");
        launch::check(gshmem_window_create(signal, 8, &signal_w), "gshmem_window_create");
        launch::check(gshmem_window_create(discard, 8, &discard_w), "gshmem_window_create");
    }
    const gshmem_ctx ctx = gshmem_device_ctx();
    const gdaki::Gin<gdaki::Gpu> handle(ctx.qps, np, gin_window(signal_w), gin_window(discard_w));
#endif
    std::vector<uint8_t> block(largest);

    uint32_t direct = 0;
    for (uint32_t pe = 0; pe < np; pe++) direct += gshmem_pe_path((int)pe, nullptr) == GSHMEM_PATH_LOAD_STORE;
    uint64_t signalled = 0;
    std::vector<Row> rows;
    bool intact = true;
    for (uint64_t bytes : sizes) {
        for (uint32_t q = 0; q < np; q++) {
            for (uint64_t i = 0; i < bytes; i++) block[i] = pattern(me, q, i);
            launch::check(gshmem_heap_write(send + q * bytes, block.data(), bytes), "gshmem_heap_write");
        }
        std::vector<uint8_t> zero(np * bytes, 0);
        launch::check(gshmem_heap_write(recv, zero.data(), zero.size()), "gshmem_heap_write");
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        if (me == 0) std::fprintf(stderr, "alltoall: %u PEs, blocks of %" PRIu64 " bytes ...\n", np, bytes);
#if defined(GDAKI_CUDA)
        // Every piece's block must be resident at once (each waits for all the others').
        const uint32_t fit = gin ? launch::resident_blocks<GinAllToAll>(BLOCK_THREADS)
                                 : launch::resident_blocks<AllToAll>(BLOCK_THREADS);
        uint32_t pieces = pieces_asked != 0 ? pieces_asked
                                            : (uint32_t)std::min<uint64_t>(std::max<uint64_t>(bytes / 32768, 1),
                                                                           std::max<uint32_t>(std::min(128u, fit) / np, 1));
        if ((uint64_t)np * pieces > fit)
            launch::die("alltoall: " + std::to_string(np) + " PEs x " + std::to_string(pieces) + " pieces need " +
                        std::to_string(np * pieces) + " blocks resident at once, and this GPU holds " +
                        std::to_string(fit) + " beside gdaki's copy kernel: use a smaller -b");
        const uint32_t threads = np * pieces * BLOCK_THREADS, group = BLOCK_THREADS;
#else
        uint32_t pieces = pieces_asked != 0 ? pieces_asked : 1;
        const uint32_t threads = np * pieces, group = threads;
#endif
        auto round = [&](uint32_t n) {
#if defined(GDAKI_CUDA)
            if (gin)
                return launch::run(GinAllToAll{handle, gin_window(send_w), gin_window(recv_w), bytes, signalled, n,
                                               pieces, f},
                                   threads, group);
#endif
            return launch::run(AllToAll{send, recv, signal, bytes, signalled, n, pieces, f}, threads, group);
        };
        round(warmup);
        signalled += (uint64_t)warmup * np * pieces;
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");
        double ms = round(iters);
        signalled += (uint64_t)iters * np * pieces;
        double copy_ms = copy_reference(copy_dst, send, np * bytes, iters);
        launch::check(gshmem_barrier_all(), "gshmem_barrier_all");

        Failures got{};
        launch::check(gshmem_heap_read(&got, f, sizeof got), "gshmem_heap_read");
        if (got.count != 0) {
            std::fprintf(stderr, "PE %u: %u failed calls, the first at line %u (round %u): code %u\n", me, got.count,
                         got.first_line, got.first_index, got.first_code);
            intact = false;
        }
        for (uint32_t s = 0; s < np; s++) {
            launch::check(gshmem_heap_read(block.data(), recv + s * bytes, bytes), "gshmem_heap_read");
            uint64_t i = 0;
            while (i < bytes && block[i] == pattern(s, me, i)) i++;
            if (i != bytes) {
                std::fprintf(stderr, "PE %u: the block from PE %u is wrong at byte %" PRIu64 " of %" PRIu64 "\n", me, s,
                             i, bytes);
                intact = false;
            }
        }
        uint64_t sig = 0;
        launch::check(gshmem_heap_read(&sig, signal, 8), "gshmem_heap_read");
        if (sig != signalled) {
            std::fprintf(stderr, "PE %u: the signal is %" PRIu64 ", expected %" PRIu64 "\n", me, sig, signalled);
            intact = false;
        }
        rows.push_back({bytes, pieces, 1000.0 * ms / iters, 1000.0 * copy_ms / iters});
    }
    if (me == 0) {
        if (json) {
            std::printf("{\"program\": \"gshmem-alltoall\", \"api\": \"%s\", \"pes\": %u, \"mode\": \"%s\", "
                        "\"bootstrap\": \"%s\", \"iterations\": %u, \"load_store_pes\": %u, \"clock\": \"PE 0\", "
                        "\"rows\": [",
                        gin ? "gin" : "gshmem", np, mode, gshmem_bootstrap_name(), iters, direct);
            for (size_t i = 0; i < rows.size(); i++) {
                const Row &r = rows[i];
                double moved = (double)r.bytes * np;
                std::printf("%s{\"block_bytes\": %" PRIu64 ", \"pieces\": %u, \"bytes_per_pe\": %.0f, "
                            "\"alltoall_us\": %.3f, \"copy_us\": %.3f, \"alltoall_gb_s\": %.3f, \"copy_gb_s\": %.3f}",
                            i ? ", " : "", r.bytes, r.pieces, moved, r.alltoall_us, r.copy_us,
                            moved / r.alltoall_us / 1e3, moved / r.copy_us / 1e3);
            }
            std::printf("], \"verified\": %s}\n", intact ? "true" : "false");
        } else {
            std::printf("%s all-to-all: %u PEs, %s mode, %s bootstrap, %u iterations (PE 0's clock), PE 0 loads "
                        "and stores %u of %u heaps\n",
                        gin ? "GIN handle (gdaki_gin.cuh) over gshmem" : "gshmem", np, mode, gshmem_bootstrap_name(),
                        iters, direct, np);
            std::printf(" %12s %7s %14s %18s %18s %12s\n", "block [B]", "pieces", "bytes per PE", "all-to-all [us]",
                        "plain copy [us]", "a2a / copy");
            for (const Row &r : rows)
                std::printf(" %12" PRIu64 " %7u %14" PRIu64 " %18.2f %18.2f %11.1fx\n", r.bytes, r.pieces, r.bytes * np,
                            r.alltoall_us, r.copy_us, r.alltoall_us / r.copy_us);
            std::printf(" data on PE 0: %s\n", intact ? "verified" : "WRONG");
        }
    }
    std::fflush(stdout);
#if defined(GDAKI_CUDA)
    for (gshmem_window *w : {&send_w, &recv_w, &signal_w, &discard_w})
        launch::check(gshmem_window_destroy(w), "gshmem_window_destroy");
#endif
    launch::check(gshmem_finalize(), "gshmem_finalize");
    return intact ? 0 : 1;
}
