//! How a context is opened ([`ContextOptions`]), and the state every object of an open context
//! shares (below [`context`](crate::context), [`memory`](crate::memory) and
//! [`queue`](crate::queue), which all hold it).
use std::sync::Arc;
use std::time::Duration;

use gdaki_devx::Opened;
use gdaki_layout::AtomicReplyOrder;

/// The state every object of a context shares.
pub(crate) struct ContextInner {
    pub options: ContextOptions,
    /// The protection domain its regions and queue pairs are in (given back before what the
    /// device opened: fields drop in order).
    pub pd: gdaki_devx::OwnedPd,
    /// The device queues are created on, and what the context opened on it (shared by the
    /// contexts of [`Context::alloc_pd`](crate::Context::alloc_pd)).
    pub device: Arc<Opened>,
}

/// How a context is opened, beyond its provider. [`Context::open`](crate::Context::open) takes these from the
/// environment ([`ContextOptions::from_env`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContextOptions {
    device: Option<String>,
    unmappable_doorbell: bool,
    unordered_rdma_writes: bool,
    atomic_reply: AtomicReplyOrder,
    /// Same-host transport connections stay on TCP (the default is shared memory).
    tcp_only: bool,
    /// WRITEs from GPU memory to a same-host peer carry the bytes (the default is a CUDA IPC
    /// reference).
    no_cuda_ipc: bool,
    /// How long the soft HCA's engine spins when idle (`None`: its default).
    engine_idle_spin: Option<Duration>,
}

impl ContextOptions {
    /// The variable [`from_env`](Self::from_env) reads for
    /// [`unmappable_doorbell`](Self::unmappable_doorbell) (`1`, `true` or `yes` turn it on).
    pub const UNMAPPABLE_DOORBELL_VAR: &'static str = "GDAKI_SOFT_UNMAPPABLE_DOORBELL";

    /// The variable [`from_env`](Self::from_env) reads for
    /// [`atomic_reply_order`](Self::atomic_reply_order): `host` (mode 1) or `big-endian` (mode 0,
    /// the default).
    pub const ATOMIC_REPLY_VAR: &'static str = "GDAKI_SOFT_ATOMIC_REPLY";

    /// The variable [`from_env`](Self::from_env) reads for
    /// [`unordered_rdma_writes`](Self::unordered_rdma_writes) (`1`, `true` or `yes`).
    pub const UNORDERED_RDMA_WRITES_VAR: &'static str = "GDAKI_SOFT_UNORDERED_RDMA_WRITES";

    /// The variable [`from_env`](Self::from_env) reads for
    /// [`same_host_shared_memory`](Self::same_host_shared_memory): `0`, `false`, `no` or `off`
    /// keep same-host connections on TCP.
    pub const SHARED_MEMORY_VAR: &'static str = "GDAKI_SOFT_SHM";

    /// The variable [`from_env`](Self::from_env) reads for
    /// [`same_host_cuda_ipc`](Self::same_host_cuda_ipc): `0`, `false`, `no` or `off` send the
    /// bytes of GPU memory to same-host peers.
    pub const CUDA_IPC_VAR: &'static str = "GDAKI_SOFT_CUDA_IPC";

    /// The variable [`from_env`](Self::from_env) reads for
    /// [`engine_idle_spin`](Self::engine_idle_spin): whole microseconds.
    pub const ENGINE_IDLE_SPIN_VAR: &'static str = "GDAKI_SOFT_IDLE_SPIN_US";

    /// Options from the environment: `GDAKI_SOFT_UNMAPPABLE_DOORBELL`, `GDAKI_SOFT_ATOMIC_REPLY`,
    /// `GDAKI_SOFT_UNORDERED_RDMA_WRITES`, `GDAKI_SOFT_SHM`, `GDAKI_SOFT_CUDA_IPC`,
    /// `GDAKI_SOFT_IDLE_SPIN_US`. An atomic-reply value that is neither `host` nor `big-endian`,
    /// or a spin that is not a whole number of microseconds, is ignored with a warning.
    pub fn from_env() -> ContextOptions {
        let on = |var| {
            std::env::var(var).is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
        };
        let reply = match std::env::var(Self::ATOMIC_REPLY_VAR) {
            Err(_) => AtomicReplyOrder::BigEndian,
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "host" | "1" => AtomicReplyOrder::HostOrder,
                "big-endian" | "be" | "0" | "" => AtomicReplyOrder::BigEndian,
                other => {
                    tracing::warn!(
                        "{}={other:?} is neither `host` nor `big-endian`; ignored",
                        Self::ATOMIC_REPLY_VAR
                    );
                    AtomicReplyOrder::BigEndian
                }
            },
        };
        let off = |var| {
            std::env::var(var)
                .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "no" | "off"))
        };
        let spin = std::env::var(Self::ENGINE_IDLE_SPIN_VAR)
            .ok()
            .and_then(|v| match v.trim().parse::<u64>() {
                Ok(us) => Some(Duration::from_micros(us)),
                Err(_) => {
                    tracing::warn!(
                        "{}={v:?} is not a whole number of microseconds; ignored",
                        Self::ENGINE_IDLE_SPIN_VAR
                    );
                    None
                }
            });
        ContextOptions {
            engine_idle_spin: spin,
            ..ContextOptions::default()
        }
        .same_host_shared_memory(!off(Self::SHARED_MEMORY_VAR))
        .same_host_cuda_ipc(!off(Self::CUDA_IPC_VAR))
        .unmappable_doorbell(on(Self::UNMAPPABLE_DOORBELL_VAR))
        .atomic_reply_order(reply)
        .unordered_rdma_writes(on(Self::UNORDERED_RDMA_WRITES_VAR))
    }

    /// The RDMA device to open (`mlx5_1`; the soft provider has one, `soft`). Unset: the
    /// first device the provider drives.
    pub fn device(mut self, name: impl Into<String>) -> ContextOptions {
        self.device = Some(name.into());
        self
    }

    /// The device asked for with [`device`](Self::device).
    pub fn device_name(&self) -> Option<&str> {
        self.device.as_deref()
    }

    /// Soft HCA: the byte order in which it returns 8-byte atomic results, modelling the two
    /// modes a ConnectX has (`atomic_req_8B_endianness_mode`): big-endian, the IB default, or
    /// the requester's host order, which mlx5_core selects where the NIC supports it. Every QP
    /// of the context carries the mode to the device code, which reads results accordingly.
    pub fn atomic_reply_order(mut self, order: AtomicReplyOrder) -> ContextOptions {
        self.atomic_reply = order;
        self
    }

    /// The byte order of atomic results (see [`atomic_reply_order`](Self::atomic_reply_order)).
    pub fn atomic_reply(&self) -> AtomicReplyOrder {
        self.atomic_reply
    }

    /// Soft HCA: model a platform whose doorbell page cannot be mapped into a GPU (the NIC's
    /// UAR, where `cuMemHostRegister` with the IO-memory flag fails). Queue pairs with the GPU
    /// doorbell handler then fall back to the CPU proxy when exported to a GPU, exactly as
    /// when the driver refuses the mapping. For testing that path on machines that can map.
    pub fn unmappable_doorbell(mut self, on: bool) -> ContextOptions {
        self.unmappable_doorbell = on;
        self
    }

    /// Model a GPU whose GPUDirect RDMA writes ordering is below `OWNER` (CUDA's attribute):
    /// queue pairs exported to a GPU then end every READ and fetching atomic with a fenced DUMP
    /// WQE, as on such a GPU. For testing that path on GPUs that order writes (the H100 does).
    pub fn unordered_rdma_writes(mut self, on: bool) -> ContextOptions {
        self.unordered_rdma_writes = on;
        self
    }

    /// Soft HCA: whether a transport connection to a peer process on this machine moves its
    /// frames through a shared-memory segment instead of the loopback socket (on by default).
    /// The TCP connection still sets it up and tells when the peer dies, so semantics, ordering
    /// and failures are the same; off keeps every byte on TCP (to compare, or where
    /// `/dev/shm` is not wanted). A connection uses shared memory only when both sides allow it.
    pub fn same_host_shared_memory(mut self, on: bool) -> ContextOptions {
        self.tcp_only = !on;
        self
    }

    /// Whether [`same_host_shared_memory`](Self::same_host_shared_memory) is on.
    pub fn uses_same_host_shared_memory(&self) -> bool {
        !self.tcp_only
    }

    /// Soft HCA: whether a WRITE from GPU memory to a peer process on this machine, over a
    /// shared-memory connection, sends a CUDA IPC reference to the bytes instead of the bytes
    /// (on by default). The peer's GPU copier then moves them inside the GPU: the first WRITE
    /// from each allocation still carries its bytes while the peer maps it. Needs both sides
    /// to allow it, memory from `cuMemAlloc`/`cudaMalloc` (not `cuMemCreate`), and device
    /// memory registered on the peer's side of the same GPU. Off: every byte is sent.
    pub fn same_host_cuda_ipc(mut self, on: bool) -> ContextOptions {
        self.no_cuda_ipc = !on;
        self
    }

    /// Whether [`same_host_cuda_ipc`](Self::same_host_cuda_ipc) is on.
    pub fn uses_same_host_cuda_ipc(&self) -> bool {
        !self.no_cuda_ipc
    }

    /// Soft HCA: how long its engine thread keeps spinning once it has nothing to do, before
    /// it yields its core (for 2 ms) and then sleeps between looks at the doorbells (up to
    /// 200 us, longer the longer it has been idle). Any work starts the spin again. The default,
    /// 200 us (0 on a machine of 2 cores or fewer, where the spin would hold a core the posters
    /// need), keeps it awake between the doorbells of a latency test; a longer spin keeps it
    /// awake across pauses in an application (a doorbell that finds it asleep waits up to
    /// 200 us more), a shorter one gives its core back sooner on a machine with few cores.
    /// A shared-memory connection to another process spins as long (at least 20 us; as many
    /// of an HCA's link threads at a time as an eighth of the cores, the others 20 us) before
    /// its threads sleep on a futex.
    pub fn engine_idle_spin(mut self, spin: Duration) -> ContextOptions {
        self.engine_idle_spin = Some(spin);
        self
    }

    /// The spin set with [`engine_idle_spin`](Self::engine_idle_spin); `None`: the soft HCA's
    /// default.
    pub fn chosen_engine_idle_spin(&self) -> Option<Duration> {
        self.engine_idle_spin
    }

    /// Whether [`unordered_rdma_writes`](Self::unordered_rdma_writes) is on.
    pub fn models_unordered_rdma_writes(&self) -> bool {
        self.unordered_rdma_writes
    }

    /// Whether [`unmappable_doorbell`](Self::unmappable_doorbell) is on.
    pub fn models_unmappable_doorbell(&self) -> bool {
        self.unmappable_doorbell
    }
}
