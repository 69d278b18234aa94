// gin_nccl: a kernel written for NCCL's GIN device API, run over gdaki by including
// gdaki_nccl_gin.cuh in place of NCCL's device headers and taking a gdakiDevComm (from
// gshmem_dev_comm_create) where NCCL's kernel takes an ncclDevComm. Nothing else in the kernel
// changes. It runs one block per PE (under mpirun, one PE per GPU or several on one) and checks
// every byte on every PE:
//   - an all-to-all: block-cooperative puts with a signal, waitSignal, flush, `rounds` times;
//   - putValue with an add signal, get, a counter (local action), a VA signal, signal shadows;
//   - the world GIN barrier between the phases.
//
//   gin_nccl [-s BYTES] [-r ROUNDS]     (GPU builds; the CPU build says so and exits 2)
//
// Exit 0 when every PE saw every value; each PE prints one line.
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "launch.hpp"
#if defined(GDAKI_CUDA)
#include "gin_nccl_kernel.cuh"
#endif

namespace {

inline uint8_t pattern(int from, int to, int round, uint64_t i) {
    return (uint8_t)(from * 29 + to * 83 + round * 7 + (int)(i % 251) + 1);
}


[[noreturn]] void usage(const std::string &why) {
    std::fprintf(stderr, "gin_nccl: %s\nusage: gin_nccl [-s BYTES] [-r ROUNDS]\n", why.c_str());
    std::exit(2);
}

} // namespace

int main(int argc, char **argv) {
    uint64_t bytes = 4096;
    int rounds = 4;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        if ((a == "-s" || a == "-r") && i + 1 < argc) {
            char *end = nullptr;
            const unsigned long long v = std::strtoull(argv[++i], &end, 10);
            if (*end != '\0' || v == 0 || v > (a == "-s" ? (1ull << 24) : 1000ull)) usage(a + " " + argv[i] + ": out of range");
            if (a == "-s") bytes = (v + 7) / 8 * 8;
            else rounds = (int)v;
        } else {
            usage("unknown argument " + a);
        }
    }
#if !defined(GDAKI_CUDA)
    (void)bytes;
    (void)rounds;
    usage("a kernel written for NCCL's GIN needs the GPU build (gdaki_nccl_gin.cuh is CUDA C++): make gpu");
#else
    gshmem_options opts = launch::options();
    launch::prepare_gpu(opts.gpu);
    launch::check(gshmem_init(&opts), "gshmem_init");
    const int me = gshmem_my_pe(), n = gshmem_n_pes();
    const uint64_t block_bytes = bytes;
    auto *send = (uint8_t *)gshmem_malloc((uint64_t)rounds * n * bytes);
    auto *recv = (uint8_t *)gshmem_malloc((uint64_t)rounds * n * bytes);
    auto *values = (uint64_t *)gshmem_malloc(8 * (uint64_t)n);
    auto *fetched = (uint8_t *)gshmem_malloc(bytes);
    auto *flags = (uint64_t *)gshmem_malloc(8 * (uint64_t)n);
    if (!send || !recv || !values || !fetched || !flags) launch::die(std::string("gshmem_malloc: ") + gshmem_error());
    std::vector<uint8_t> mine((uint64_t)rounds * n * bytes);
    for (int r = 0; r < rounds; r++)
        for (int q = 0; q < n; q++)
            for (uint64_t i = 0; i < bytes; i++) mine[((uint64_t)r * n + q) * bytes + i] = pattern(me, q, r, i);
    launch::check(gshmem_heap_write(send, mine.data(), mine.size()), "gshmem_heap_write");

    gshmem_window w[5]{};
    void *syms[5] = {send, recv, values, fetched, flags};
    const uint64_t sizes[5] = {mine.size(), mine.size(), 8 * (uint64_t)n, bytes, 8 * (uint64_t)n};
    for (int i = 0; i < 5; i++) launch::check(gshmem_window_create(syms[i], sizes[i], &w[i]), "gshmem_window_create");
    gshmem_dev_comm_requirements req{2, 1, 1};
    gdakiDevComm comm{};
    launch::check(gshmem_dev_comm_create(&req, &comm), "gshmem_dev_comm_create");
    launch::check(gshmem_barrier_all(), "gshmem_barrier_all");

    std::fprintf(stderr, "gin_nccl: PE %d of %d: %d rounds of %" PRIu64 " bytes per peer\n", me, n, rounds, block_bytes);
    gin_nccl_kernel<<<1, 256, 0, launch::stream()>>>(comm, (ncclWindow_t)w[0].device, (ncclWindow_t)w[1].device,
                                                      (ncclWindow_t)w[2].device, (ncclWindow_t)w[3].device,
                                                      (ncclWindow_t)w[4].device, bytes, rounds);
    launch::cuda(cudaGetLastError(), "launch");
    launch::wait_stream();

    std::vector<std::string> bad;
    uint32_t code = 0;
    launch::check(gshmem_dev_comm_error(&comm, &code), "gshmem_dev_comm_error");
    if (code != 0) bad.push_back("the communicator's error word holds " + std::to_string(code));
    std::vector<uint8_t> got(mine.size());
    launch::check(gshmem_heap_read(got.data(), recv, got.size()), "gshmem_heap_read");
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    for (int r = 0; r < rounds && bad.empty(); r++)
        for (int q = 0; q < n; q++)
            for (uint64_t i = 0; i < bytes; i++) {
                // Bytes 0..7 of block 0 were last written by the counted put (prev's, round 0).
                const uint8_t want = (r == 0 && q == 0 && i < 8) ? pattern(prev, 0, 0, i) : pattern(q, me, r, i);
                if (got[((uint64_t)r * n + q) * bytes + i] != want) {
                    bad.push_back("round " + std::to_string(r) + ", block from PE " + std::to_string(q) + ", byte " +
                                  std::to_string(i));
                    break;
                }
            }
    std::vector<uint64_t> vals(n), flag(n);
    launch::check(gshmem_heap_read(vals.data(), values, 8 * (uint64_t)n), "gshmem_heap_read");
    for (int q = 0; q < n; q++)
        if (vals[q] != (uint64_t)(1000 * q + me + 1)) bad.push_back("putValue from PE " + std::to_string(q));
    std::vector<uint8_t> back(bytes);
    launch::check(gshmem_heap_read(back.data(), fetched, bytes), "gshmem_heap_read");
    for (uint64_t i = 0; i < bytes; i++)
        if (back[i] != pattern(next, me, 0, i)) {
            bad.push_back("get from PE " + std::to_string(next) + ", byte " + std::to_string(i));
            break;
        }
    launch::check(gshmem_heap_read(flag.data(), flags, 8 * (uint64_t)n), "gshmem_heap_read");
    if (flag[prev] != 1) bad.push_back("the VA signal from PE " + std::to_string(prev));

    launch::check(gshmem_dev_comm_destroy(&comm), "gshmem_dev_comm_destroy");
    for (gshmem_window &x : w) launch::check(gshmem_window_destroy(&x), "gshmem_window_destroy");
    launch::check(gshmem_finalize(), "gshmem_finalize");
    if (!bad.empty()) {
        std::printf("gin_nccl: PE %d: FAILED: %s\n", me, bad[0].c_str());
        return 1;
    }
    std::printf("gin_nccl: PE %d of %d: ok (all-to-all, putValue, get, counter, VA signal, shadow, barrier)\n", me, n);
    return 0;
#endif
}
