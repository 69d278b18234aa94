// The kernel of gin_nccl, as written for NCCL's GIN device API: with NCCL it would include
// <nccl_device.h> and take an ncclDevComm; over gdaki it includes gdaki_nccl_gin.cuh and takes a
// gdakiDevComm. Nothing else differs. Kept apart so that CI syntax-checks it without CUDA.
#ifndef GIN_NCCL_KERNEL_CUH
#define GIN_NCCL_KERNEL_CUH

#include "gdaki_nccl_gin.cuh" // in place of <nccl_device.h>

// Signals: 0 counts the all-to-all's blocks, 1 the putValues; counter 0 the puts of the get
// phase; `flags`' word at offset 8*rank is a VA signal.
__global__ void gin_nccl_kernel(gdakiDevComm devComm, ncclWindow_t send, ncclWindow_t recv, ncclWindow_t values,
                                ncclWindow_t fetched, ncclWindow_t flags, size_t bytes, int rounds) {
    ncclGin gin(devComm, blockIdx.x % devComm.ginContextCount);
    ncclTeam world = ncclTeamWorld(devComm);
    ncclCoopCta cta;
    const int me = devComm.rank, n = devComm.nRanks;

    ncclGinBarrierSession<ncclCoopCta> bar(cta, gin, ncclTeamTagWorld{}, 0);
    bar.sync(cta, cuda::memory_order_relaxed, ncclGinFenceLevel::Relaxed);

    for (int r = 0; r < rounds; r++) {
        // Round r's blocks come from `send` at r * n * bytes: block `peer` to every peer.
        for (int peer = 0; peer < n; peer++)
            gin.put(world, peer, recv, (size_t)(r * n + me) * bytes, send, (size_t)(r * n + peer) * bytes, bytes,
                    ncclGin_SignalInc{0}, ncclGin_None{}, cta);
        gin.waitSignal(cta, 0, (uint64_t)(r + 1) * n);
    }
    gin.flush(cta);
    bar.sync(cta, cuda::memory_order_acq_rel, ncclGinFenceLevel::Put | ncclGinFenceLevel::Get);

    // One value to every peer (thread `peer` of the block), with an add signal of 10.
    if (threadIdx.x < (unsigned)n)
        gin.putValue(world, (int)threadIdx.x, values, 8 * (size_t)me, (uint64_t)(1000 * me + (int)threadIdx.x + 1),
                     ncclGin_WeakSignalAdd{1, 10});
    gin.waitSignal(cta, 1, 10ull * n);

    // The next peer's first block of round 0 back into `fetched`, then a put counted locally.
    const int next = (me + 1) % n;
    gin.get(world, next, send, (size_t)me * bytes, fetched, 0, bytes, cta);
    gin.flush(cta);
    gin.put(world, next, recv, 0, send, 0, 8, ncclGin_None{}, ncclGin_WeakCounterInc{0}, cta);
    gin.waitCounter(cta, 0, 1);

    // A VA signal at the next peer's flag word for this rank, and the shadow of signal 0.
    gin.signal(world, next, ncclGin_StrongVASignalInc{flags, 8 * (size_t)me}, cta);
    const int prev = (me + n - 1) % n;
    gin.waitSignal(cta, flags, 8 * (size_t)prev, 1);
    uint64_t before = 0, delta = 0;
    gin.increaseSignalShadow(0, 0);
    gin.waitSignalFollowShadow(cta, 0, (uint64_t)rounds * n, &before, &delta);
    if (threadIdx.x == 0 && (before != 0 || delta != (uint64_t)rounds * n || gin.readSignal(0) != delta))
        gin.resetSignal(devComm.ginSignalCount); // not a signal: leaves BAD_ARGUMENT in the error word
    bar.sync(cta, cuda::memory_order_acq_rel);
}

#endif /* GIN_NCCL_KERNEL_CUH */
