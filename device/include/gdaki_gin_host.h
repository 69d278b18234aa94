/* gdaki_gin_host.h: the objects of gdaki's GIN-shaped headers that host code builds and passes
 * to kernels by value: gdaki::Window (gdaki_gin.cuh's windows) and gdakiDevComm (the device
 * communicator of gdaki_nccl_gin.cuh, NCCL's ncclDevComm). Plain C++ (host compilers include it
 * too); the device code that uses them is in the .cuh headers. See docs/cuda-cpp.md. */
#ifndef GDAKI_GIN_HOST_H
#define GDAKI_GIN_HOST_H

#include "gdaki_device.h"

#ifndef __cplusplus
#error "gdaki_gin_host.h is C++"
#endif

namespace gdaki {

/** A buffer registered on every peer (a window, as NCCL calls it): this PE's part as a local
 *  operand, and every peer's part as a remote one (a device array indexed by peer, whose
 *  entries the host copies from gdaki_region_remote). */
struct Window {
    uint64_t local;
    uint64_t size;
    uint32_t lkey;
    uint32_t npeers;
    const gdaki_remote_region *peers;
    /** Where this GPU loads and stores each peer's part (a device array indexed by peer: the
     *  address gdaki_peer_map_addr gives for that peer's export, 0 for a peer reached through
     *  its queue pair), or NULL: every peer through queue pairs. For the signal window, map a
     *  peer's part only where every PE maps it: its words then see one kind of atomic (a
     *  system-scope atomic is not atomic against an HCA's). */
    const uint64_t *mapped = nullptr;
};

} // namespace gdaki

/** The device communicator of gdaki_nccl_gin.cuh (what NCCL's ncclDevComm is to its GIN
 *  kernels), passed to kernels by value. Filled by whoever sets up the job (gshmem:
 *  gshmem_dev_comm_create); every pointer is a device address, and the memory behind it lives
 *  until that creator destroys the communicator. */
struct gdakiDevComm {
    /** This PE's rank and the number of ranks (NCCL's world team). */
    int rank, nRanks;
    /** NCCL's load/store team, as gdaki sees it: this rank alone (0 of 1). gdaki's GIN methods
     *  choose load/store themselves for peers this GPU maps (gdaki::Window::mapped). */
    int lsaRank, lsaSize;
    /** GIN contexts: 1 (one queue pair per peer; any context index maps to it). */
    int ginContextCount;
    /** Signals, counters and world barriers the creator was asked for (ids from 0). */
    int ginSignalCount, ginCounterCount, worldGinBarrierCount;
    /** The queue pair to every rank, indexed by rank (this rank's: a loopback or NULL). */
    gdaki_dev_qp *const *qps;
    /** The signal words: ginSignalCount for the user, then one per world barrier. */
    gdaki::Window signals;
    /** 8 bytes that fetching signal atomics write and nobody reads. */
    gdaki::Window scratch;
    /** This rank's counters (ginCounterCount), signal shadows (ginSignalCount) and barrier
     *  epochs (worldGinBarrierCount). */
    uint64_t *counters;
    uint64_t *shadows;
    uint32_t *barrierEpochs;
    /** The first GDAKI_CODE_* a method that returns nothing met (0: none); the host reads it
     *  after the kernel. */
    uint32_t *error;
    /** How long a wait with no queue pair deadline of its own waits before it gives up. */
    uint64_t timeoutNs;
    /** A cross-channel queue pair of this rank connected to itself, or NULL: through it a
     *  counter advances when a put completes, the HCA alone doing it (a WAIT on the put's queue
     *  pair, then an add; gdaki_count_when_done). Without it a counted put waits for its own
     *  completion. */
    gdaki_dev_qp *counterQp;
    /** The remote key of the counters' memory, for the companion's adds. */
    uint32_t counterRkey;
    /** The creator's bookkeeping. */
    void *internal;
};

#endif /* GDAKI_GIN_HOST_H */
