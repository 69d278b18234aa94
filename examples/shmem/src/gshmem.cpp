// gshmem's host side: bootstrap, one gdaki context per PE, the symmetric heap, a queue pair to
// every PE (itself included, as a loopback), the tables kernels read, and the heap allocator.
// Everything goes through gdaki's C API (gdaki.h); no CUDA runtime is needed here.
#include "gshmem.h"
#include "gdaki_gin_host.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bootstrap.hpp"

static_assert(sizeof(gshmem_internal) <= GSHMEM_RESERVED_BYTES, "gshmem's own words outgrew their reservation");

namespace gshmem {
namespace {

std::string g_error;

/** Throws a gshmem::Error naming the gdaki call that failed and gdaki's reason. */
void ok(gdaki_status s, const char *what) {
    if (s != GDAKI_STATUS_OK)
        throw Error(std::string(what) + ": " + gdaki_status_name(s) + ": " + gdaki_last_error());
}

const char *env(const char *name) {
    const char *v = std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
}

/** An unsigned number from the environment, with binary suffixes (K, M, G); `fallback` unset. */
uint64_t env_number(const char *name, uint64_t fallback) {
    const char *v = env(name);
    if (v == nullptr) return fallback;
    char *end = nullptr;
    errno = 0;
    unsigned long long n = std::strtoull(v, &end, 10);
    uint64_t scale = 1;
    if (end != v && *end != '\0' && end[1] == '\0') {
        switch (*end) {
        case 'K': case 'k': scale = 1ull << 10; end++; break;
        case 'M': case 'm': scale = 1ull << 20; end++; break;
        case 'G': case 'g': scale = 1ull << 30; end++; break;
        default: break;
        }
    }
    if (end == v || *end != '\0' || errno != 0 || v[0] == '-' || n > UINT64_MAX / scale)
        throw Error(std::string(name) + "=\"" + v + "\" is not a non-negative number");
    return n * scale;
}

/** First-fit over the heap's user part, by offset; the same calls give the same offsets on
 *  every PE. */
class Allocator {
  public:
    static constexpr uint64_t ALIGN = 256;
    void reset(uint64_t start, uint64_t end) {
        free_.clear();
        used_.clear();
        if (end > start) free_[start] = end - start;
    }
    /** Offset of a new block, or UINT64_MAX. */
    uint64_t alloc(uint64_t bytes) {
        uint64_t size = std::max<uint64_t>(ALIGN, (bytes + ALIGN - 1) / ALIGN * ALIGN);
        if (size < bytes) return UINT64_MAX;
        for (auto it = free_.begin(); it != free_.end(); ++it) {
            if (it->second < size) continue;
            uint64_t off = it->first, left = it->second - size;
            free_.erase(it);
            if (left > 0) free_[off + size] = left;
            used_[off] = size;
            return off;
        }
        return UINT64_MAX;
    }
    /** Size of the block at `off`, or 0 when none starts there. */
    uint64_t size_of(uint64_t off) const {
        auto it = used_.find(off);
        return it == used_.end() ? 0 : it->second;
    }
    void release(uint64_t off) {
        auto it = used_.find(off);
        if (it == used_.end()) return;
        uint64_t size = it->second;
        used_.erase(it);
        auto next = free_.lower_bound(off);
        if (next != free_.end() && off + size == next->first) {
            size += next->second;
            next = free_.erase(next);
        }
        if (next != free_.begin()) {
            auto prev = std::prev(next);
            if (prev->first + prev->second == off) {
                prev->second += size;
                return;
            }
        }
        free_[off] = size;
    }

  private:
    std::map<uint64_t, uint64_t> free_, used_;
};

/** What one PE exchanges with the others: its heap (as a remote region, and for peer maps
 *  where it is device memory) and its endpoint for each PE. */
struct Card {
    uint32_t magic;
    uint32_t version;
    uint32_t n_pes;
    uint32_t heap_kind;
    uint64_t heap_bytes;
    gdaki_remote_region heap;
    /** 1 when heap_export holds the heap's peer export. */
    uint32_t exported;
    uint32_t pad;
    gdaki_peer_export heap_export;
    /** The UUID of the PE's GPU (zero in CPU mode). */
    uint8_t gpu_uuid[16];
};
constexpr uint32_t CARD_MAGIC = 0x47534331; // "GSC1"

struct Peer {
    gdaki_cq *cq = nullptr;
    gdaki_qp *qp = nullptr;
    gdaki_gpu_qp *exported = nullptr;
    gdaki_dev_qp *handle = nullptr;

    /** The handle posters take: exported to `gpu`, or the host one in CPU mode (gpu NULL). */
    void publish(gdaki_gpu *gpu) {
        if (gpu != nullptr) {
            ok(gdaki_qp_export_gpu(qp, gpu, &exported), "gdaki_qp_export_gpu");
            ok(gdaki_gpu_qp_handle(exported, &handle), "gdaki_gpu_qp_handle");
        } else {
            ok(gdaki_qp_host_handle(qp, &handle), "gdaki_qp_host_handle");
        }
    }

    /** Frees the export before its queue pair, the queue pair before its CQ (each takes NULL). */
    void destroy() {
        gdaki_gpu_qp_destroy(exported);
        gdaki_qp_destroy(qp);
        gdaki_cq_destroy(cq);
        *this = Peer{};
    }
};

struct State {
    std::unique_ptr<Bootstrap> boot;
    gdaki_context *ctx = nullptr;
    gdaki_gpu *gpu = nullptr;
    int gpu_ordinal = -1;
    gdaki_region *heap = nullptr;
    gdaki_region_info heap_info{};
    gdaki_region *tables = nullptr;
    std::vector<Peer> peers;
    std::vector<gdaki_remote_region> heaps;
    std::vector<gdaki_dev_qp *> handles;
    /** Peer maps of the heaps kernels load and store (NULL elsewhere), indexed by PE. */
    std::vector<gdaki_peer_map *> maps;
    /** What the kernels' peer_heaps table holds, and why each PE's path was chosen. */
    std::vector<uint64_t> peer_heaps;
    std::vector<std::string> path_why;
    gshmem_ctx dev{};
    Allocator alloc;
    /** PEs on this PE's GPU, this one included (gshmem_gpu_sharers). */
    int gpu_sharers = 1;
    /** The tables of live windows, by the address of their peers table. */
    std::map<uint64_t, gdaki_region *> windows;
    /** How the peers' queue pairs were made (a device communicator's counter QP copies it). */
    gdaki_qp_config qp_config{};
    /** The peers' CQs' size. */
    uint32_t cq_size = 0;

    ~State() {
        for (auto &w : windows) gdaki_region_destroy(w.second);
        for (gdaki_peer_map *m : maps) gdaki_peer_map_destroy(m);
        for (Peer &p : peers) p.destroy();
        gdaki_region_destroy(tables);
        gdaki_region_destroy(heap);
        gdaki_gpu_destroy(gpu);
        gdaki_context_destroy(ctx);
    }
};

std::unique_ptr<State> g_state;

State &state() {
    if (!g_state) throw Error("gshmem_init has not been called");
    return *g_state;
}

/** Runs `body`, turning an exception into -1 and gshmem_error(): none crosses into C. */
template <class F>
int guard(const char *name, F body) {
    try {
        body();
        return 0;
    } catch (const std::exception &e) {
        g_error = std::string(name) + ": " + e.what();
    } catch (...) {
        g_error = std::string(name) + ": unknown failure";
    }
    return -1;
}

/** GSHMEM_GPU=local: this process's rank on its host, as its launcher tells it, modulo the
 *  GPUs it sees. */
int local_gpu() {
    const char *names[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "GSHMEM_LOCAL_RANK",
                           "GSHMEM_RANK"};
    uint64_t rank = 0;
    for (const char *name : names)
        if (env(name) != nullptr) {
            rank = env_number(name, 0);
            break;
        }
    uint32_t count = 0;
    ok(gdaki_gpu_count(&count), "gdaki_gpu_count");
    if (count == 0) throw Error("GSHMEM_GPU=local, but this process sees no GPU");
    return (int)(rank % count);
}

void options_init(gshmem_options *o) {
    *o = gshmem_options{};
    const char *boot = env("GSHMEM_BOOTSTRAP");
    if (boot == nullptr) o->bootstrap = GSHMEM_BOOTSTRAP_ENV;
    else if (std::strcmp(boot, "mpi") == 0) o->bootstrap = GSHMEM_BOOTSTRAP_MPI;
    else if (std::strcmp(boot, "tcp") == 0) o->bootstrap = GSHMEM_BOOTSTRAP_TCP;
    else throw Error(std::string("GSHMEM_BOOTSTRAP=\"") + boot + "\": use mpi or tcp");
    o->tcp_addr = env("GSHMEM_TCP_ADDR") != nullptr ? env("GSHMEM_TCP_ADDR") : "127.0.0.1:29517";
    o->tcp_rank = (int)std::min<uint64_t>(env_number("GSHMEM_RANK", 0), INT32_MAX);
    o->tcp_nranks = (int)std::min<uint64_t>(env_number("GSHMEM_NRANKS", 1), INT32_MAX);
    o->timeout_ms = (int)std::min<uint64_t>(env_number("GSHMEM_TIMEOUT_MS", 60000), INT32_MAX);
    o->heap_bytes = env_number("GSHMEM_HEAP_BYTES", 64ull << 20);
    const char *kind = env("GSHMEM_HEAP");
    if (kind == nullptr) o->heap_kind = GSHMEM_HEAP_DEFAULT;
    else if (std::strcmp(kind, "device") == 0) o->heap_kind = GSHMEM_HEAP_DEVICE;
    else if (std::strcmp(kind, "pinned") == 0) o->heap_kind = GSHMEM_HEAP_PINNED;
    else throw Error(std::string("GSHMEM_HEAP=\"") + kind + "\": use device or pinned");
    const char *gpu = env("GSHMEM_GPU");
    if (gpu != nullptr && std::strcmp(gpu, "cpu") == 0) o->gpu = -1;
    else if (gpu != nullptr && std::strcmp(gpu, "local") == 0) o->gpu = local_gpu();
    else o->gpu = (int)std::min<uint64_t>(env_number("GSHMEM_GPU", 0), INT32_MAX);
    o->p2p = env_number("GSHMEM_P2P", 1) != 0;
    const char *provider = env("GSHMEM_PROVIDER");
    if (provider == nullptr || std::strcmp(provider, "soft") == 0) o->provider = GDAKI_PROVIDER_SOFT;
    else if (std::strcmp(provider, "mlx5") == 0) o->provider = GDAKI_PROVIDER_MLX5;
    else if (std::strcmp(provider, "auto") == 0) o->provider = GDAKI_PROVIDER_AUTO;
    else throw Error(std::string("GSHMEM_PROVIDER=\"") + provider + "\": use soft, mlx5 or auto");
    o->listen = env("GSHMEM_LISTEN") != nullptr ? env("GSHMEM_LISTEN") : "127.0.0.1:0";
    o->sq_size = (uint32_t)std::min<uint64_t>(env_number("GSHMEM_SQ_SIZE", 1024), UINT32_MAX);
    o->wait_timeout_ms = (uint32_t)std::min<uint64_t>(env_number("GSHMEM_WAIT_TIMEOUT_MS", 30000), UINT32_MAX);
    o->log = env("GSHMEM_LOG");
}

/** mlx5's name for an error CQE's syndrome. */
const char *syndrome_name(uint32_t s) {
    switch (s) {
    case 0x01: return "local length error";
    case 0x02: return "local QP operation error";
    case 0x04: return "local protection error";
    case 0x05: return "flushed (the queue pair failed earlier)";
    case 0x06: return "memory window bind error";
    case 0x10: return "bad response";
    case 0x11: return "local access error";
    case 0x12: return "remote invalid request";
    case 0x13: return "remote access error";
    case 0x14: return "remote operation error";
    case 0x15: return "transport retries exceeded (the peer did not answer)";
    case 0x16: return "RNR retries exceeded";
    case 0x22: return "aborted";
    default: return "unknown syndrome";
    }
}

std::unique_ptr<Bootstrap> make_bootstrap(const gshmem_options &o) {
    bool mpi = o.bootstrap == GSHMEM_BOOTSTRAP_MPI || (o.bootstrap == GSHMEM_BOOTSTRAP_ENV && launched_by_mpi());
    if (mpi) {
        auto b = mpi_bootstrap();
        if (b) return b;
        if (o.bootstrap == GSHMEM_BOOTSTRAP_MPI)
            throw Error("the MPI bootstrap was asked for, but gshmem was built without MPI (make MPI=1)");
        throw Error("started by an MPI launcher, but gshmem was built without MPI: rebuild with make MPI=1, or "
                    "set GSHMEM_BOOTSTRAP=tcp");
    }
    if (o.tcp_addr == nullptr) throw Error("the TCP bootstrap needs tcp_addr");
    return tcp_bootstrap(o.tcp_addr, o.tcp_rank, o.tcp_nranks, o.timeout_ms);
}

/** Picks each PE's path, the same on every PE: load/store where every PE could map that PE's
 *  heap (so all atomics on a heap are of one kind), the queue pair otherwise. `s.maps` and
 *  `s.path_why` hold, per PE, this PE's map of its heap and why there is none. Closes the maps
 *  not taken. Collective. */
void choose_paths(State &s, uint32_t me, uint32_t n, const std::string &no_p2p) {
    std::vector<unsigned char> can(n, 0), all((size_t)n * n);
    for (uint32_t pe = 0; pe < n; pe++) can[pe] = no_p2p.empty() && (pe == me || s.maps[pe] != nullptr);
    s.boot->allgather(can.data(), all.data(), n);
    s.peer_heaps.assign(n, 0);
    for (uint32_t pe = 0; pe < n; pe++) {
        uint32_t blocker = n;
        for (uint32_t i = 0; i < n && blocker == n; i++)
            if (!all[(size_t)i * n + pe]) blocker = i;
        if (blocker == n) {
            uint64_t addr = s.heap_info.addr;
            if (pe != me) ok(gdaki_peer_map_addr(s.maps[pe], &addr, nullptr), "gdaki_peer_map_addr");
            s.peer_heaps[pe] = addr;
            s.path_why[pe] = pe == me ? "load/store: this PE's own heap, and every other PE maps it"
                                      : "load/store: every PE maps its heap (P2P, or the same GPU)";
            continue;
        }
        gdaki_peer_map_destroy(s.maps[pe]);
        s.maps[pe] = nullptr;
        std::string reason = !no_p2p.empty()          ? no_p2p
                             : !s.path_why[pe].empty() ? s.path_why[pe]
                                                       : "PE " + std::to_string(blocker) + " cannot map its heap";
        s.path_why[pe] = "queue pair: " + reason;
    }
}

void init(const gshmem_options *given) {
    if (g_state) throw Error("gshmem is already initialised (call gshmem_finalize first)");
    gshmem_options o;
    if (given != nullptr) o = *given;
    else options_init(&o);
    if (o.heap_bytes == 0 || o.heap_bytes > (1ull << 40))
        throw Error("heap_bytes " + std::to_string(o.heap_bytes) + " is not 1 byte to 1 TiB");
    if (o.heap_kind > GSHMEM_HEAP_PINNED) throw Error("heap_kind " + std::to_string(o.heap_kind) + " is unknown");
    if (o.gpu < 0 && o.heap_kind != GSHMEM_HEAP_DEFAULT)
        throw Error("CPU mode keeps the heap in host memory: heap_kind must be GSHMEM_HEAP_DEFAULT");

    // Once per process: gdaki keeps the first filter.
    if (o.log != nullptr) {
        gdaki_status st = gdaki_log_init(o.log);
        if (st != GDAKI_STATUS_OK && st != GDAKI_STATUS_INVALID_STATE) ok(st, "gdaki_log_init");
    }
    auto s = std::make_unique<State>();
    s->boot = make_bootstrap(o);
    const uint32_t me = (uint32_t)s->boot->rank(), n = (uint32_t)s->boot->size();

    ok(gdaki_context_open(o.provider, nullptr, &s->ctx), "gdaki_context_open");
    gdaki_provider provider = GDAKI_PROVIDER_AUTO;
    ok(gdaki_context_provider(s->ctx, &provider), "gdaki_context_provider");
    if (n > 1) {
        char addr[128];
        ok(gdaki_context_listen(s->ctx, o.listen, addr, sizeof addr, nullptr), "gdaki_context_listen");
    }
    if (o.gpu >= 0) {
        ok(gdaki_gpu_open((uint32_t)o.gpu, &s->gpu), "gdaki_gpu_open");
        s->gpu_ordinal = o.gpu;
    }

    const uint64_t total = GSHMEM_RESERVED_BYTES + (uint64_t)o.heap_bytes;
    const uint32_t access = GDAKI_ACCESS_ALL;
    gshmem_heap_kind kind = o.heap_kind == GSHMEM_HEAP_DEFAULT && s->gpu ? GSHMEM_HEAP_DEVICE : o.heap_kind;
    if (s->gpu == nullptr) ok(gdaki_region_alloc(s->ctx, total, access, &s->heap), "heap: gdaki_region_alloc");
    else if (kind == GSHMEM_HEAP_DEVICE)
        ok(gdaki_region_alloc_device(s->ctx, s->gpu, total, access, &s->heap), "heap: gdaki_region_alloc_device");
    else ok(gdaki_region_alloc_pinned(s->ctx, s->gpu, total, access, &s->heap), "heap: gdaki_region_alloc_pinned");
    ok(gdaki_region_query(s->heap, &s->heap_info), "gdaki_region_query");

    // A queue pair per PE. The soft HCA serves rings in host memory only; a NIC takes them in
    // GPU memory, where the GPU writes them fastest.
    const gdaki_gpu *rings = provider == GDAKI_PROVIDER_MLX5 ? s->gpu : nullptr;
    gdaki_qp_config config;
    ok(gdaki_qp_config_init(&config), "gdaki_qp_config_init");
    config.sq_size = o.sq_size;
    config.timeout_ms = o.wait_timeout_ms;
    config.retry_timeout_ms = std::min<uint32_t>(config.retry_timeout_ms, o.wait_timeout_ms / 2);
    config.rings_gpu = rings;
    s->qp_config = config;
    s->cq_size = o.sq_size;
    s->peers.resize(n);
    std::vector<unsigned char> mine(sizeof(Card) + n * sizeof(gdaki_endpoint));
    Card card{CARD_MAGIC, GSHMEM_CTX_VERSION, n, (uint32_t)kind, (uint64_t)o.heap_bytes, {}, 0, 0, {}, {}};
    if (s->gpu != nullptr) ok(gdaki_gpu_uuid(s->gpu, card.gpu_uuid), "gdaki_gpu_uuid");
    ok(gdaki_region_remote(s->heap, &card.heap), "gdaki_region_remote");
    // Why this PE cannot load and store the heaps (empty: it may try).
    std::string no_p2p = !o.p2p                      ? "GSHMEM_P2P=0 on PE " + std::to_string(me)
                         : s->gpu == nullptr          ? std::string("CPU mode")
                         : kind != GSHMEM_HEAP_DEVICE ? std::string("the heaps are in pinned host memory")
                                                      : std::string();
    if (no_p2p.empty()) {
        if (gdaki_region_export_peer(s->heap, s->gpu, &card.heap_export) == GDAKI_STATUS_OK) card.exported = 1;
        else no_p2p = std::string("PE ") + std::to_string(me) + " cannot export its heap: " + gdaki_last_error();
    }
    std::memcpy(mine.data(), &card, sizeof card);
    for (uint32_t pe = 0; pe < n; pe++) {
        Peer &p = s->peers[pe];
        ok(gdaki_cq_create(s->ctx, o.sq_size, rings, &p.cq), "gdaki_cq_create");
        ok(gdaki_qp_create(s->ctx, p.cq, &config, &p.qp), "gdaki_qp_create");
        gdaki_endpoint ep;
        ok(gdaki_qp_endpoint(p.qp, &ep), "gdaki_qp_endpoint");
        std::memcpy(mine.data() + sizeof(Card) + pe * sizeof ep, &ep, sizeof ep);
    }

    std::vector<unsigned char> all(mine.size() * n);
    s->boot->allgather(mine.data(), all.data(), mine.size());
    s->heaps.resize(n);
    s->maps.assign(n, nullptr);
    s->path_why.assign(n, std::string());
    for (uint32_t pe = 0; pe < n; pe++) {
        const unsigned char *theirs = all.data() + pe * mine.size();
        Card c;
        std::memcpy(&c, theirs, sizeof c);
        if (c.magic != CARD_MAGIC || c.version != GSHMEM_CTX_VERSION || c.n_pes != n)
            throw Error("PE " + std::to_string(pe) + " runs another gshmem version or job");
        if (c.heap_bytes != o.heap_bytes)
            throw Error("PE " + std::to_string(pe) + " has a heap of " + std::to_string(c.heap_bytes) +
                        " bytes, this PE " + std::to_string(o.heap_bytes) + ": set the same GSHMEM_HEAP_BYTES everywhere");
        s->heaps[pe] = c.heap;
        if (pe != me && s->gpu != nullptr && std::memcmp(c.gpu_uuid, card.gpu_uuid, sizeof c.gpu_uuid) == 0)
            s->gpu_sharers++;
        // PE `pe`'s endpoint for this PE.
        gdaki_endpoint ep;
        std::memcpy(&ep, theirs + sizeof(Card) + me * sizeof ep, sizeof ep);
        ok(gdaki_qp_connect(s->peers[pe].qp, &ep), "gdaki_qp_connect");
        // Map its heap where it exported it (this PE's own: its address).
        if (!no_p2p.empty() || !c.exported) continue;
        if (pe == me) continue;
        gdaki_peer_map *m = nullptr;
        if (gdaki_peer_map_open(s->gpu, &c.heap_export, &m) == GDAKI_STATUS_OK) {
            s->maps[pe] = m;
        } else {
            s->path_why[pe] = std::string("PE ") + std::to_string(me) + " cannot map it: " + gdaki_last_error();
        }
    }
    choose_paths(*s, me, n, no_p2p);

    // The tables kernels read: a handle per PE, every PE's heap, where kernels load and store it.
    s->handles.resize(n);
    for (uint32_t pe = 0; pe < n; pe++) {
        Peer &p = s->peers[pe];
        p.publish(s->gpu);
        s->handles[pe] = p.handle;
    }
    s->dev.version = GSHMEM_CTX_VERSION;
    s->dev.my_pe = me;
    s->dev.n_pes = n;
    s->dev.lkey = s->heap_info.lkey;
    s->dev.heap_base = s->heap_info.addr;
    s->dev.heap_bytes = total;
    if (s->gpu != nullptr) {
        const uint64_t handles_bytes = (n * sizeof(gdaki_dev_qp *) + 63) / 64 * 64;
        const uint64_t heaps_bytes = (n * sizeof(gdaki_remote_region) + 63) / 64 * 64;
        const uint64_t bytes = handles_bytes + heaps_bytes + n * sizeof(uint64_t);
        ok(gdaki_region_alloc_device(s->ctx, s->gpu, bytes, GDAKI_ACCESS_LOCAL_WRITE, &s->tables),
           "tables: gdaki_region_alloc_device");
        gdaki_region_info t;
        ok(gdaki_region_query(s->tables, &t), "gdaki_region_query");
        ok(gdaki_region_write(s->tables, 0, s->handles.data(), n * sizeof(gdaki_dev_qp *)), "gdaki_region_write");
        ok(gdaki_region_write(s->tables, handles_bytes, s->heaps.data(), n * sizeof(gdaki_remote_region)),
           "gdaki_region_write");
        s->dev.qps = reinterpret_cast<gdaki_dev_qp *const *>(t.addr);
        ok(gdaki_region_write(s->tables, handles_bytes + heaps_bytes, s->peer_heaps.data(), n * sizeof(uint64_t)),
           "gdaki_region_write");
        s->dev.heaps = reinterpret_cast<const gdaki_remote_region *>(t.addr + handles_bytes);
        s->dev.peer_heaps = reinterpret_cast<const uint64_t *>(t.addr + handles_bytes + heaps_bytes);
    } else {
        s->dev.qps = s->handles.data();
        s->dev.heaps = s->heaps.data();
        s->dev.peer_heaps = nullptr;
    }
    s->alloc.reset(GSHMEM_RESERVED_BYTES, total);
    // Nobody posts before every PE is connected.
    s->boot->barrier();
    g_state = std::move(s);
}

/** The heap offset of symmetric `ptr` holding `bytes`, checked. */
uint64_t heap_offset(const State &s, const void *ptr, uint64_t bytes) {
    uint64_t a = reinterpret_cast<uint64_t>(ptr), base = s.dev.heap_base, end = base + s.dev.heap_bytes;
    if (a < base || a > end || bytes > end - a) {
        char text[160];
        std::snprintf(text, sizeof text, "0x%" PRIx64 " + %" PRIu64 " bytes is outside the heap 0x%" PRIx64 "..0x%" PRIx64,
                      a, bytes, base, end);
        throw Error(text);
    }
    return a - base;
}

/** Every PE passed the same (call, value): checked through the bootstrap, so a PE that
 *  differs makes the call fail on every PE instead of corrupting the heap. */
bool agreed(State &s, uint64_t a, uint64_t b) {
    uint64_t mine[2] = {a, b};
    std::vector<uint64_t> all(2 * (size_t)s.boot->size());
    s.boot->allgather(mine, all.data(), sizeof mine);
    for (size_t i = 0; i < all.size(); i += 2)
        if (all[i] != a || all[i + 1] != b) return false;
    return true;
}

} // namespace
} // namespace gshmem

using namespace gshmem;

extern "C" {

int gshmem_options_init(gshmem_options *opts) {
    return guard("gshmem_options_init", [&] {
        if (opts == nullptr) throw Error("opts is NULL");
        options_init(opts);
    });
}

int gshmem_init(const gshmem_options *opts) { return guard("gshmem_init", [&] { init(opts); }); }

int gshmem_finalize(void) {
    return guard("gshmem_finalize", [&] {
        State &s = state();
        // Nobody may still be writing into this PE's heap, and nobody still maps it when it is
        // freed.
        s.boot->barrier();
        for (gdaki_peer_map *&m : s.maps) {
            gdaki_peer_map_destroy(m);
            m = nullptr;
        }
        s.boot->barrier();
        g_state.reset();
    });
}

const char *gshmem_error(void) { return g_error.c_str(); }

int gshmem_my_pe(void) { return g_state ? (int)g_state->dev.my_pe : -1; }
int gshmem_n_pes(void) { return g_state ? (int)g_state->dev.n_pes : -1; }
int gshmem_gpu(void) { return g_state ? g_state->gpu_ordinal : -1; }
const char *gshmem_bootstrap_name(void) { return g_state ? g_state->boot->name() : ""; }

void *gshmem_malloc(size_t bytes) {
    void *out = nullptr;
    guard("gshmem_malloc", [&] {
        State &s = state();
        uint64_t off = bytes == 0 ? UINT64_MAX : s.alloc.alloc(bytes);
        if (off != UINT64_MAX) {
            // Zeroed before any PE can learn of the block (the agreement below is a barrier).
            std::vector<unsigned char> zero(std::min<uint64_t>(s.alloc.size_of(off), 1 << 20));
            for (uint64_t done = 0, size = s.alloc.size_of(off); done < size; done += zero.size()) {
                uint64_t n = std::min<uint64_t>(zero.size(), size - done);
                ok(gdaki_region_write(s.heap, off + done, zero.data(), n), "gdaki_region_write");
            }
        }
        bool same = agreed(s, 1, off);
        if (!same || off == UINT64_MAX) {
            if (off != UINT64_MAX) s.alloc.release(off);
            if (bytes == 0) throw Error("0 bytes asked for");
            if (!same) throw Error("the PEs disagree: call gshmem_malloc with the same sizes, in the same order, everywhere");
            throw Error(std::to_string(bytes) + " bytes do not fit in the heap (GSHMEM_HEAP_BYTES)");
        }
        out = reinterpret_cast<void *>(s.dev.heap_base + off);
    });
    return out;
}

int gshmem_free(void *ptr) {
    return guard("gshmem_free", [&] {
        if (ptr == nullptr) return;
        State &s = state();
        uint64_t a = reinterpret_cast<uint64_t>(ptr);
        uint64_t off = a >= s.dev.heap_base ? a - s.dev.heap_base : UINT64_MAX;
        bool known = off < s.dev.heap_bytes && s.alloc.size_of(off) != 0;
        if (!agreed(s, 2, known ? off : UINT64_MAX))
            throw Error("the PEs disagree: free the same block everywhere (and only blocks from gshmem_malloc)");
        if (!known) throw Error("the pointer is not a block from gshmem_malloc");
        s.alloc.release(off);
    });
}

int gshmem_check_queues(void) {
    return guard("gshmem_check_queues", [&] {
        State &s = state();
        std::string bad;
        static const char *states[] = {"RESET", "INIT", "RTR", "RTS", "ERROR"};
        for (size_t pe = 0; pe < s.peers.size(); pe++) {
            gdaki_qp_info info{};
            ok(gdaki_qp_query(s.peers[pe].qp, &info), "gdaki_qp_query");
            if (info.state == GDAKI_QP_STATE_RTS) continue;
            char text[200];
            std::snprintf(text, sizeof text, "%sthe queue pair to PE %zu (QPN 0x%x) is in %s", bad.empty() ? "" : "; ",
                          pe, info.qpn, (uint32_t)info.state < 5 ? states[info.state] : "an unknown state");
            bad += text;
            if (info.state == GDAKI_QP_STATE_ERROR) {
                std::snprintf(text, sizeof text, ", syndrome 0x%02x: %s", info.syndrome, syndrome_name(info.syndrome));
                bad += text;
            }
        }
        if (!bad.empty()) throw Error(bad);
    });
}

int gshmem_pe_path(int pe, const char **why) {
    int path = -1;
    guard("gshmem_pe_path", [&] {
        State &s = state();
        if (pe < 0 || (uint32_t)pe >= s.dev.n_pes)
            throw Error("PE " + std::to_string(pe) + " is not in 0.." + std::to_string(s.dev.n_pes - 1));
        if (why != nullptr) *why = s.path_why[pe].c_str();
        path = s.peer_heaps[pe] != 0 ? GSHMEM_PATH_LOAD_STORE : GSHMEM_PATH_QUEUE_PAIR;
    });
    return path;
}

int gshmem_gpu_sharers(void) { return g_state ? g_state->gpu_sharers : -1; }

int gshmem_window_create(void *sym, size_t bytes, gshmem_window *out) {
    return guard("gshmem_window_create", [&] {
        State &s = state();
        if (out == nullptr) throw Error("out is NULL");
        const uint64_t off = heap_offset(s, sym, bytes);
        if (off < GSHMEM_RESERVED_BYTES) throw Error("the range overlaps gshmem's own words at the heap's start");
        const uint32_t n = s.dev.n_pes;
        std::vector<gdaki_remote_region> peers(s.heaps);
        for (gdaki_remote_region &r : peers) {
            r.addr += off;
            r.len = bytes;
        }
        const uint64_t peers_bytes = (n * sizeof(gdaki_remote_region) + 63) / 64 * 64;
        const bool gpu = s.gpu != nullptr;
        gdaki_region *tables = nullptr;
        const uint64_t mapped_bytes = gpu ? (n * sizeof(uint64_t) + 63) / 64 * 64 : 0;
        // The window's own fields go last, for kernels that take it by pointer.
        const uint64_t total = peers_bytes + mapped_bytes + sizeof(gshmem_window);
        if (gpu) ok(gdaki_region_alloc_device(s.ctx, s.gpu, total, GDAKI_ACCESS_LOCAL_WRITE, &tables), "gdaki_region_alloc_device");
        else ok(gdaki_region_alloc(s.ctx, total, GDAKI_ACCESS_LOCAL_WRITE, &tables), "gdaki_region_alloc");
        try {
            gdaki_region_info t;
            ok(gdaki_region_query(tables, &t), "gdaki_region_query");
            ok(gdaki_region_write(tables, 0, peers.data(), n * sizeof(gdaki_remote_region)), "gdaki_region_write");
            gshmem_window w{s.dev.heap_base + off, bytes, s.dev.lkey, n,
                            reinterpret_cast<const gdaki_remote_region *>(t.addr), nullptr, nullptr};
            if (gpu) {
                std::vector<uint64_t> mapped(s.peer_heaps);
                for (uint64_t &m : mapped)
                    if (m != 0) m += off;
                ok(gdaki_region_write(tables, peers_bytes, mapped.data(), n * sizeof(uint64_t)), "gdaki_region_write");
                w.mapped = reinterpret_cast<const uint64_t *>(t.addr + peers_bytes);
            }
            w.device = reinterpret_cast<const void *>(t.addr + peers_bytes + mapped_bytes);
            ok(gdaki_region_write(tables, peers_bytes + mapped_bytes, &w, sizeof w), "gdaki_region_write");
            s.windows[t.addr] = tables;
            *out = w;
        } catch (...) {
            gdaki_region_destroy(tables);
            throw;
        }
    });
}

int gshmem_window_destroy(gshmem_window *w) {
    return guard("gshmem_window_destroy", [&] {
        if (w == nullptr || w->peers == nullptr) return;
        State &s = state();
        auto it = s.windows.find(reinterpret_cast<uint64_t>(w->peers));
        if (it == s.windows.end()) throw Error("not a live window of this PE");
        gdaki_region_destroy(it->second);
        s.windows.erase(it);
        *w = gshmem_window{};
    });
}

namespace {
/** What gshmem_dev_comm_create made, for its destroy. */
struct DevCommParts {
    void *signals = nullptr, *scratch = nullptr;
    gshmem_window signal_w{}, scratch_w{};
    gdaki_region *local = nullptr;
    /** The counter QP: cross-channel, connected to itself. */
    Peer counter{};

    /** Frees what is this PE's alone (the heap blocks are collective to free). */
    void free_local() {
        gshmem_window_destroy(&signal_w);
        gshmem_window_destroy(&scratch_w);
        // The counter QP goes before the counters its adds target.
        counter.destroy();
        gdaki_region_destroy(local);
        local = nullptr;
    }

    /** The counter QP of this PE (`s`'s queue pair settings, cross-channel), connected to
     *  itself: its WAITs hold its adds to the counters until the peers' puts complete. Each
     *  count takes two of its WQEs. */
    void make_counter_qp(const State &s) {
        gdaki_qp_config config = s.qp_config;
        config.cross_channel = 1;
        ok(gdaki_cq_create(s.ctx, s.cq_size, config.rings_gpu, &counter.cq), "counter QP: gdaki_cq_create");
        ok(gdaki_qp_create(s.ctx, counter.cq, &config, &counter.qp), "counter QP: gdaki_qp_create");
        gdaki_endpoint ep;
        ok(gdaki_qp_endpoint(counter.qp, &ep), "gdaki_qp_endpoint");
        ok(gdaki_qp_connect(counter.qp, &ep), "counter QP: gdaki_qp_connect");
        counter.publish(s.gpu);
    }
};

/** A gshmem window as gdaki_gin.cuh's (the same fields, in order). */
gdaki::Window gin_window(const gshmem_window &w) {
    return gdaki::Window{w.local, w.size, w.lkey, w.npeers, w.peers, w.mapped};
}
} // namespace

int gshmem_dev_comm_create(const gshmem_dev_comm_requirements *req, gdakiDevComm *out) {
    return guard("gshmem_dev_comm_create", [&] {
        State &s = state();
        if (req == nullptr || out == nullptr) throw Error("req or out is NULL");
        const int counts[] = {req->gin_signal_count, req->gin_counter_count, req->world_gin_barrier_count};
        for (int c : counts)
            if (c < 0 || c > (1 << 20)) throw Error("a count out of range (0 to 2^20): " + std::to_string(c));
        auto parts = std::make_unique<DevCommParts>();
        const uint64_t signals = (uint64_t)req->gin_signal_count, counters = (uint64_t)req->gin_counter_count,
                       barriers = (uint64_t)req->world_gin_barrier_count;
        const auto call = [](int rc, const char *what) {
            if (rc != 0) throw Error(std::string(what) + ": " + gshmem_error());
        };
        try {
            // Symmetric (collective), zeroed: the user's signal words, then one per barrier, and
            // one more so that no request asks for 0 bytes (which gshmem_malloc refuses).
            const uint64_t signal_bytes = (signals + barriers) * 8 + 8;
            parts->signals = gshmem_malloc(signal_bytes);
            parts->scratch = gshmem_malloc(8);
            if (parts->signals == nullptr || parts->scratch == nullptr) throw Error(gshmem_error());
            call(gshmem_window_create(parts->signals, signal_bytes, &parts->signal_w), "the signal window");
            call(gshmem_window_create(parts->scratch, 8, &parts->scratch_w), "the scratch window");
            // Local: counters, shadows, barrier epochs, the error word.
            const uint64_t at_shadows = counters * 8, at_epochs = at_shadows + signals * 8,
                           at_error = at_epochs + barriers * 4, local_bytes = (at_error + 4 + 63) / 64 * 64;
            // The counter QP's adds land in the counters: remote atomics, by this PE's QP alone
            // (the key never leaves the PE).
            const uint32_t access = GDAKI_ACCESS_LOCAL_WRITE | GDAKI_ACCESS_REMOTE_ATOMIC;
            if (s.gpu != nullptr)
                ok(gdaki_region_alloc_device(s.ctx, s.gpu, local_bytes, access, &parts->local),
                   "gdaki_region_alloc_device");
            else
                ok(gdaki_region_alloc(s.ctx, local_bytes, access, &parts->local), "gdaki_region_alloc");
            const std::vector<unsigned char> zero(local_bytes);
            ok(gdaki_region_write(parts->local, 0, zero.data(), zero.size()), "gdaki_region_write");
            gdaki_region_info li;
            ok(gdaki_region_query(parts->local, &li), "gdaki_region_query");
            gdakiDevComm c{};
            c.rank = (int)s.dev.my_pe;
            c.nRanks = (int)s.dev.n_pes;
            c.lsaRank = 0;
            c.lsaSize = 1;
            c.ginContextCount = 1;
            c.ginSignalCount = req->gin_signal_count;
            c.ginCounterCount = req->gin_counter_count;
            c.worldGinBarrierCount = req->world_gin_barrier_count;
            c.qps = s.dev.qps;
            c.signals = gin_window(parts->signal_w);
            c.scratch = gin_window(parts->scratch_w);
            c.counters = reinterpret_cast<uint64_t *>(li.addr);
            c.shadows = reinterpret_cast<uint64_t *>(li.addr + at_shadows);
            c.barrierEpochs = reinterpret_cast<uint32_t *>(li.addr + at_epochs);
            c.error = reinterpret_cast<uint32_t *>(li.addr + at_error);
            c.timeoutNs = 30ull * 1000 * 1000 * 1000;
            if (counters > 0) {
                parts->make_counter_qp(s);
                c.counterQp = parts->counter.handle;
                c.counterRkey = li.rkey;
            }
            c.internal = parts.get();
            *out = c;
            parts.release();
        } catch (...) {
            // The heap blocks stay until gshmem_finalize: freeing them is collective.
            parts->free_local();
            throw;
        }
    });
}

int gshmem_dev_comm_error(const gdakiDevComm *comm, uint32_t *code) {
    return guard("gshmem_dev_comm_error", [&] {
        if (comm == nullptr || code == nullptr || comm->internal == nullptr) throw Error("comm or code is NULL");
        const auto *parts = static_cast<const DevCommParts *>(comm->internal);
        const uint64_t at = reinterpret_cast<uint64_t>(comm->error) - reinterpret_cast<uint64_t>(comm->counters);
        ok(gdaki_region_read(parts->local, at, code, sizeof *code), "gdaki_region_read");
    });
}

int gshmem_dev_comm_destroy(gdakiDevComm *comm) {
    return guard("gshmem_dev_comm_destroy", [&] {
        if (comm == nullptr || comm->internal == nullptr) return;
        std::unique_ptr<DevCommParts> parts(static_cast<DevCommParts *>(comm->internal));
        parts->free_local();
        if (gshmem_free(parts->signals) != 0 || gshmem_free(parts->scratch) != 0) throw Error(gshmem_error());
        *comm = gdakiDevComm{};
    });
}

int gshmem_barrier_all(void) { return guard("gshmem_barrier_all", [&] { state().boot->barrier(); }); }

gshmem_ctx gshmem_device_ctx(void) { return g_state ? g_state->dev : gshmem_ctx{}; }

int gshmem_heap_write(void *sym, const void *src, size_t bytes) {
    return guard("gshmem_heap_write", [&] {
        State &s = state();
        if (src == nullptr && bytes > 0) throw Error("src is NULL");
        ok(gdaki_region_write(s.heap, heap_offset(s, sym, bytes), src, bytes), "gdaki_region_write");
    });
}

int gshmem_heap_read(void *dst, const void *sym, size_t bytes) {
    return guard("gshmem_heap_read", [&] {
        State &s = state();
        if (dst == nullptr && bytes > 0) throw Error("dst is NULL");
        ok(gdaki_region_read(s.heap, heap_offset(s, sym, bytes), dst, bytes), "gdaki_region_read");
    });
}

} // extern "C"
