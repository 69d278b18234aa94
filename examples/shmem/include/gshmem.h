/* gshmem.h: the host side of gshmem, a small SHMEM-style PGAS library built on gdaki's C API
 * (gdaki.h) and its device header (gdaki_device.h), the way an embedder would build one.
 *
 * N processes (PEs) each own a symmetric heap of the same size: memory from gshmem_malloc is at
 * the same offset in every PE's heap, so a local pointer names the same object on every PE.
 * Kernels move data between heaps with gshmem_device.h; the host sets up, allocates and
 * synchronises. Processes find each other through MPI (mpirun -np N) or a TCP rendezvous.
 * See examples/shmem/README.md.
 *
 * Every function returning int gives 0 on success and -1 on failure, with the reason in
 * gshmem_error(). Not thread-safe: one host thread per PE calls these. */
#ifndef GSHMEM_H
#define GSHMEM_H

#include <stddef.h>
#include <stdint.h>

#include "gdaki.h"

#ifdef __cplusplus
extern "C" {
#endif

/** How the PEs find each other. */
typedef enum gshmem_bootstrap {
    /** GSHMEM_BOOTSTRAP ("mpi" or "tcp"); unset: MPI when started by mpirun (and built with
     *  MPI), else TCP. */
    GSHMEM_BOOTSTRAP_ENV = 0,
    /** MPI_COMM_WORLD (MPI is initialised if the program has not done so). */
    GSHMEM_BOOTSTRAP_MPI = 1,
    /** A TCP rendezvous at tcp_addr: rank 0 listens there, the others connect. */
    GSHMEM_BOOTSTRAP_TCP = 2,
} gshmem_bootstrap;

/** Where the symmetric heap lives. */
typedef enum gshmem_heap_kind {
    /** GPU memory (GPU mode), host memory (CPU mode). */
    GSHMEM_HEAP_DEFAULT = 0,
    /** GPU memory of the PE's GPU. */
    GSHMEM_HEAP_DEVICE = 1,
    /** Page-locked host memory mapped into the GPU. */
    GSHMEM_HEAP_PINNED = 2,
} gshmem_heap_kind;

/** What gshmem_init needs; gshmem_options_init fills in the defaults, which read the
 *  environment variables named beside each field. */
typedef struct gshmem_options {
    gshmem_bootstrap bootstrap;
    /** TCP: "ip:port" of rank 0 (GSHMEM_TCP_ADDR, default 127.0.0.1:29517). */
    const char *tcp_addr;
    /** TCP: this process's rank and the number of processes (GSHMEM_RANK, GSHMEM_NRANKS;
     *  default 0 and 1). */
    int tcp_rank, tcp_nranks;
    /** Bound of every bootstrap wait, in ms (GSHMEM_TIMEOUT_MS, default 60000). */
    int timeout_ms;
    /** Usable heap bytes per PE (GSHMEM_HEAP_BYTES, default 64 MiB). */
    size_t heap_bytes;
    gshmem_heap_kind heap_kind;
    /** GPU ordinal (GSHMEM_GPU, default 0), or -1 for CPU mode: host threads play the kernels,
     *  through the host build of gdaki_device.h's thread scope. GSHMEM_GPU=local picks the
     *  process's rank on its host (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID,
     *  else GSHMEM_LOCAL_RANK, else GSHMEM_RANK) modulo the GPUs it sees: one GPU per process. */
    int gpu;
    /** gdaki provider (GDAKI_PROVIDER_*; GSHMEM_PROVIDER "soft", "mlx5" or "auto", default
     *  soft). */
    uint32_t provider;
    /** Where the soft HCA listens for the other PEs (GSHMEM_LISTEN, default 127.0.0.1:0). */
    const char *listen;
    /** Send queue size of each queue pair, in WQEs (GSHMEM_SQ_SIZE, default 1024). */
    uint32_t sq_size;
    /** Bound of every device-side wait (completions, signals, barriers), in ms
     *  (GSHMEM_WAIT_TIMEOUT_MS, default 30000). */
    uint32_t wait_timeout_ms;
    /** Whether kernels load and store the heaps of the PEs they can (GSHMEM_P2P): see
     *  gshmem_pe_path. 1 (default): heaps on this PE's own GPU (other processes on it) and on
     *  the other GPUs of this host that this GPU reaches over P2P (NVLink, PCIe); 0: every
     *  operation goes through a queue pair. */
    int p2p;
    /** gdaki's diagnostics to stderr, filtered as RUST_LOG is ("warn", "gdaki=debug"), or NULL
     *  for none (GSHMEM_LOG). */
    const char *log;
} gshmem_options;

/** Version word of gshmem_ctx and gshmem_internal: bump on any layout change. */
#define GSHMEM_CTX_VERSION 0x00010002u
/** Slots for thread-scope fetching operations (one lock and one 8-byte result each). */
#define GSHMEM_THREAD_SLOTS 1024u
/** Slot groups for warp-scope fetching operations (32 results each). */
#define GSHMEM_WARP_GROUPS 64u

/** gshmem's own words at the start of every heap (the same offsets on every PE); user
 *  allocations come after it. Kernels reach it through gshmem_ctx. */
typedef struct gshmem_internal {
    /** Raised by one per barrier by every other PE. */
    uint64_t barrier_arrivals;
    /** Barriers this PE has completed (written only by its barrier caller). */
    uint64_t barrier_done;
    /** Where signal atomics put the value they fetched, which nobody reads. */
    uint64_t discard;
    uint64_t pad[5];
    uint32_t thread_locks[GSHMEM_THREAD_SLOTS];
    uint32_t warp_locks[GSHMEM_WARP_GROUPS];
    uint64_t thread_slots[GSHMEM_THREAD_SLOTS];
    uint64_t warp_slots[GSHMEM_WARP_GROUPS][32];
} gshmem_internal;

/** Heap bytes gshmem keeps for itself (gshmem_internal, rounded up). */
#define GSHMEM_RESERVED_BYTES 65536u

/** What kernels need, by value (pass it as a kernel argument): gshmem_device.h's calls take it.
 *  Its pointers are device addresses in GPU mode, host addresses in CPU mode. */
typedef struct gshmem_ctx {
    /** GSHMEM_CTX_VERSION. */
    uint32_t version;
    uint32_t my_pe;
    uint32_t n_pes;
    /** Local key of this PE's heap. */
    uint32_t lkey;
    /** This PE's heap: base address and size (gshmem_internal first). */
    uint64_t heap_base;
    uint64_t heap_bytes;
    /** Every PE's heap as it sees it (address, length, rkey), indexed by PE. */
    const gdaki_remote_region *heaps;
    /** The queue pair to each PE (to this PE: a loopback), indexed by PE. */
    gdaki_dev_qp *const *qps;
    /** Where this GPU's kernels load and store each PE's heap (its first byte), indexed by PE;
     *  0 where operations on that PE go through its queue pair. NULL in CPU mode. */
    const uint64_t *peer_heaps;
} gshmem_ctx;

/** How operations on a PE's heap travel (gshmem_pe_path). */
typedef enum gshmem_path {
    /** Through the queue pair to the PE (the HCA moves the bytes). */
    GSHMEM_PATH_QUEUE_PAIR = 0,
    /** Loads, stores and atomics of the calling GPU threads, over NVLink or PCIe (P2P) or
     *  inside the GPU. */
    GSHMEM_PATH_LOAD_STORE = 1,
} gshmem_path;

/** Fills `opts` with the defaults (and the environment's overrides). GSHMEM_GPU=local
 *  initialises CUDA (to count the GPUs): set CUDA_MODULE_LOADING=EAGER before calling it. */
int gshmem_options_init(gshmem_options *opts);
/** Joins the job: bootstraps, opens gdaki, allocates the heap, connects a queue pair to every
 *  PE. Collective. `opts` NULL: the defaults. */
int gshmem_init(const gshmem_options *opts);
/** Leaves the job and frees everything. Collective (a barrier first). */
int gshmem_finalize(void);
/** Why the last call failed. */
const char *gshmem_error(void);

/** This PE's number, and the number of PEs (-1 before gshmem_init). */
int gshmem_my_pe(void);
int gshmem_n_pes(void);
/** The GPU ordinal in use, or -1 in CPU mode. */
int gshmem_gpu(void);
/** The bootstrap in use ("mpi", "tcp"), or "" before gshmem_init. */
const char *gshmem_bootstrap_name(void);

/** `bytes` of the symmetric heap, 256-byte aligned, zeroed. Collective: every PE calls with
 *  the same size in the same order (checked: a PE that differs gets NULL everywhere). NULL on
 *  failure. */
void *gshmem_malloc(size_t bytes);
/** Returns a gshmem_malloc block (NULL: nothing). Collective. */
int gshmem_free(void *ptr);
/** 0 when every queue pair of this PE is ready to send; -1 naming each one that is not (its
 *  peer, state and error syndrome: the first failed operation's cause), e.g. after a kernel
 *  got GDAKI_CODE_CQE_ERROR. Local: not collective. */
int gshmem_check_queues(void);
/** How operations on PE `pe`'s heap travel (a gshmem_path), or -1 (pe out of range). `why`,
 *  unless NULL, gets the reason, valid until gshmem_finalize. Every PE takes the same path to
 *  a given PE: load/store where every PE's GPU can map that PE's heap (device memory on GPUs
 *  of one host with P2P between them, or one GPU), the queue pair otherwise, so that atomics
 *  and signals on a heap are atomic with respect to one another. */
int gshmem_pe_path(int pe, const char **why);
/** How many PEs, this one included, run on this PE's GPU (the same GPU UUID); 1 in CPU mode.
 *  Their kernels and gdaki's copy kernels share its SMs when MPS runs, so a kernel whose blocks
 *  wait for one another counts on 1/N of what the GPU holds (programs/launch.hpp does). */
int gshmem_gpu_sharers(void);

/** A symmetric allocation as a window of gdaki's GIN-shaped handle (gdaki_gin.cuh; its fields
 *  are gdaki::Window's, in order): this PE's part as a local operand, every PE's part as a
 *  remote one, and where this GPU loads and stores each PE's part (the load/store path of
 *  gshmem_pe_path, 0 for the queue-pair path). With gshmem_ctx's qps as the handle's queue
 *  pairs, a kernel written against NCCL GIN's device API runs over gshmem's set-up. */
typedef struct gshmem_window {
    /** This PE's part, and its size. */
    uint64_t local;
    uint64_t size;
    /** Local key of this PE's heap. */
    uint32_t lkey;
    /** Entries of peers and mapped: one per PE. */
    uint32_t npeers;
    /** Every PE's part as this PE reaches it (address, length, rkey), indexed by PE. */
    const gdaki_remote_region *peers;
    /** Where this GPU loads and stores every PE's part, indexed by PE; NULL in CPU mode. */
    const uint64_t *mapped;
    /** The fields above, in GPU memory (host memory in CPU mode): what a kernel written for
     *  NCCL's GIN takes as an ncclWindow_t (gdaki_nccl_gin.cuh). */
    const void *device;
} gshmem_window;

/** Makes the window of `bytes` at symmetric `sym` (inside one gshmem_malloc block or not: any
 *  range of the heap past gshmem's own words). Its tables live in GPU memory (host memory in
 *  CPU mode) until gshmem_window_destroy or gshmem_finalize. Local: not collective. */
int gshmem_window_create(void *sym, size_t bytes, gshmem_window *out);
/** Frees a window's tables and zeroes `w` (a zeroed window: nothing). */
int gshmem_window_destroy(gshmem_window *w);

/** What a device communicator for NCCL-style GIN kernels holds (gdaki_nccl_gin.cuh). */
typedef struct gshmem_dev_comm_requirements {
    /** Signals (ids 0..n-1, zeroed), counters (ids 0..n-1, zeroed) and world barriers. */
    int gin_signal_count;
    int gin_counter_count;
    int world_gin_barrier_count;
} gshmem_dev_comm_requirements;

struct gdakiDevComm;
/** Fills `out` (gdaki_gin_host.h's gdakiDevComm, NCCL's ncclDevComm for gdaki_nccl_gin.cuh):
 *  every PE as a rank, gshmem's queue pairs, a signal window in the heap, local counters,
 *  shadows and barrier epochs, an error word, and (with counters) a cross-channel queue pair of
 *  its own through which the HCA advances a counter once its put has completed. Collective (it allocates from the heap): every
 *  PE calls with the same requirements. */
int gshmem_dev_comm_create(const gshmem_dev_comm_requirements *req, struct gdakiDevComm *out);
/** The first GDAKI_CODE_* one of the communicator's methods met in a kernel (0: none). */
int gshmem_dev_comm_error(const struct gdakiDevComm *comm, uint32_t *code);
/** Frees what gshmem_dev_comm_create made and zeroes `comm`. Collective. */
int gshmem_dev_comm_destroy(struct gdakiDevComm *comm);

/** Waits until every PE has called it (host side; kernels use gshmem::barrier_all). */
int gshmem_barrier_all(void);
/** The context kernels take. */
gshmem_ctx gshmem_device_ctx(void);

/** Copies `bytes` into / out of this PE's heap at symmetric address `sym` (device memory
 *  too: no CUDA runtime needed). */
int gshmem_heap_write(void *sym, const void *src, size_t bytes);
int gshmem_heap_read(void *dst, const void *sym, size_t bytes);

#ifdef __cplusplus
}
#endif

#endif /* GSHMEM_H */
