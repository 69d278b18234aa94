//! A context: one opened provider (an HCA), the owner of everything created from it. Objects
//! hold the context alive; when the last one goes, its engine thread is stopped and joined.
use std::sync::Arc;
use std::time::Duration;

use gdaki_layout::AtomicReplyOrder;
use tracing::{info, warn};

use crate::devx::{Device, Devx, Opened};
use crate::error::{Error, Result};
use crate::memory::{Access, MemoryRegion};
use crate::mlx5::Mlx5Device;
use crate::provider::Provider;
use crate::queue::{CompletionQueue, QpConfig, QueuePair, Rings};
use crate::soft::firmware::SoftDevice;
use crate::system;

/// The state every object of a context shares.
pub(crate) struct ContextInner {
    pub options: ContextOptions,
    /// The protection domain its regions and queue pairs are in (given back before what the
    /// device opened: fields drop in order).
    pub pd: crate::devx::OwnedPd,
    /// The device queues are created on, and what the context opened on it (shared by the
    /// contexts of [`Context::alloc_pd`]).
    pub device: Arc<Opened>,
}

/// How a context is opened, beyond its provider. [`Context::open`] takes these from the
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
    /// 200 us, keeps it awake between the doorbells of a latency test; a longer spin keeps it
    /// awake across pauses in an application (a doorbell that finds it asleep waits up to
    /// 200 us more), a shorter one gives its core back sooner on a machine with few cores.
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

/// An opened provider.
pub struct Context {
    inner: Arc<ContextInner>,
    provider: Provider,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("provider", &self.provider)
            .field("device", &self.inner.device.device().name())
            .finish()
    }
}

impl Context {
    /// Opens `provider` with options from the environment ([`ContextOptions::from_env`]).
    /// `Auto` takes mlx5 where an mlx5 RDMA device exists and the provider is supported, else
    /// the soft HCA, and logs why.
    pub fn open(provider: Provider) -> Result<Context> {
        Context::open_with(provider, ContextOptions::from_env())
    }

    /// Opens `provider` with `options`. `Auto` takes the mlx5 device where one exists and opens
    /// for DevX, else the soft HCA, and logs which and why.
    pub fn open_with(provider: Provider, options: ContextOptions) -> Result<Context> {
        let mlx5 = || -> Result<Arc<dyn Device>> {
            let device = Mlx5Device::open(options.device_name()).map_err(Error::device("opening the mlx5 device"))?;
            Ok(Arc::new(device))
        };
        let (device, provider) = match provider {
            Provider::Soft => (Self::soft(&options)?, Provider::Soft),
            Provider::Mlx5 => {
                if !system::rdma_devices().iter().any(|d| d.mlx5) {
                    return Err(Error::NoRdmaDevice);
                }
                (mlx5()?, Provider::Mlx5)
            }
            Provider::Auto => match system::rdma_devices().iter().find(|d| d.mlx5) {
                None => {
                    info!("no mlx5 RDMA device: using the soft HCA");
                    (Self::soft(&options)?, Provider::Soft)
                }
                Some(d) => match mlx5().and_then(|dev| Context::open_on(dev, options.clone(), Provider::Mlx5)) {
                    Ok(ctx) => {
                        info!(device = %d.name, "using the mlx5 device");
                        return Ok(ctx);
                    }
                    Err(e) => {
                        warn!(device = %d.name, "the mlx5 device cannot be used ({e}): using the soft HCA");
                        (Self::soft(&options)?, Provider::Soft)
                    }
                },
            },
        };
        Context::open_on(device, options, provider)
    }

    /// A new soft device.
    fn soft(options: &ContextOptions) -> Result<Arc<dyn Device>> {
        if let Some(name) = options.device_name().filter(|&n| n != "soft") {
            return Err(Error::device("opening the soft device")(
                crate::devx::DeviceError::Call {
                    what: "choosing the device",
                    why: format!("the soft provider has one device, \"soft\", not {name:?}"),
                },
            ));
        }
        let same_host = crate::soft::SameHost {
            shared_memory: options.uses_same_host_shared_memory(),
            cuda_ipc: options.uses_same_host_cuda_ipc(),
        };
        let idle = crate::soft::engine::Idle::spinning_for(options.chosen_engine_idle_spin());
        let soft = SoftDevice::open(options.atomic_reply(), same_host, idle)
            .map_err(Error::device("opening the soft device"))?;
        Ok(Arc::new(soft))
    }

    /// Opens a context on `device` (a NIC, the soft device, or a test's wrapper of one).
    pub(crate) fn open_on(device: Arc<dyn Device>, options: ContextOptions, provider: Provider) -> Result<Context> {
        let device = Devx::open(device).map_err(Error::device("opening the device"))?;
        let pd = device
            .devx
            .pd()
            .map_err(Error::device("allocating a protection domain"))?;
        Ok(Context {
            inner: Arc::new(ContextInner {
                options,
                device: Arc::new(device),
                pd,
            }),
            provider,
        })
    }

    /// Another context on the same device with a protection domain of its own, as
    /// `ibv_alloc_pd` gives: regions and queue pairs made through it are in that domain, and a
    /// queue pair uses keys of its own domain only. A WQE naming a region of another domain
    /// completes with a local protection error; a peer's request naming one is refused with a
    /// remote access error and moves the target queue pair to error, as on RC. Use one per
    /// tenant, or per peer whose requests should reach only the memory registered for it.
    /// The domain is given back when the context and everything made through it are gone.
    pub fn alloc_pd(&self) -> Result<Context> {
        let pd = self
            .inner
            .device
            .devx
            .pd()
            .map_err(Error::device("allocating a protection domain"))?;
        Ok(Context {
            inner: Arc::new(ContextInner {
                options: self.inner.options.clone(),
                device: self.inner.device.clone(),
                pd,
            }),
            provider: self.provider,
        })
    }

    /// The protection domain's number (what the device calls it).
    #[cfg(test)]
    pub(crate) fn pd(&self) -> u32 {
        self.inner.pd.number
    }

    /// The RDMA device the context opened (`mlx5_0`, or `soft`).
    pub fn device_name(&self) -> String {
        self.inner.device.device().name()
    }

    /// The device as gdaki uses it: port, link layer, MTU, GID in use, and each capability
    /// gdaki depends on with its verdict (what `doctor` lists).
    pub fn device_report(&self) -> crate::DeviceReport {
        self.inner.device.report()
    }

    /// The provider in use (never `Auto`).
    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// Allocates `len` zeroed bytes of host memory registered with `access`. From 1 MiB on
    /// the memory is mapped and zeroed lazily, a page at a time as it is first touched, so a
    /// large region costs memory only as it is used; a size the kernel will not commit is
    /// [`Error::Alloc`]. The soft device pins nothing, so no locked-memory
    /// limit applies to it; a NIC pins what is registered, within `RLIMIT_MEMLOCK`
    /// (`ulimit -l`).
    pub fn alloc_region(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        MemoryRegion::alloc(&self.inner, len, access)
    }

    /// Allocates `len` zeroed bytes of host memory mapped into `gpu` (page-locked), registered
    /// with `access`: GPU kernels can use it as local or remote operands and read what the HCA
    /// wrote there (READ data, fetched atomic values).
    pub fn alloc_pinned_region(&self, gpu: &crate::cuda::Gpu, len: usize, access: Access) -> Result<MemoryRegion> {
        MemoryRegion::alloc_pinned(&self.inner, gpu, len, access)
    }

    /// Allocates `len` zeroed bytes of GPU device memory on `gpu`, registered with `access`: kernels
    /// use it directly, and the soft HCA moves its bytes with a persistent copy kernel on that GPU
    /// (started with the first device-memory region and stopped with the last; see
    /// [`cuda::quiesced`](crate::cuda::quiesced) for what that means for the application's own
    /// CUDA calls that wait for every kernel).
    pub fn alloc_device_region(&self, gpu: &crate::cuda::Gpu, len: usize, access: Access) -> Result<MemoryRegion> {
        MemoryRegion::alloc_device(&self.inner, gpu, len, access)
    }

    /// Registers caller-owned host memory.
    ///
    /// # Safety
    /// `addr..addr + len` is host memory that stays valid (and is not freed) for as long as
    /// the returned region lives and until every WQE naming it has completed, and that the
    /// application lets the HCA read and write as `access` allows.
    pub unsafe fn register_host(&self, addr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion> {
        MemoryRegion::register_caller(&self.inner, addr as u64, len as u64, access)
    }

    /// Registers caller-owned device memory of `gpu` (from `cudaMalloc` or `cuMemAlloc` in the
    /// GPU's primary context). The range must lie in one allocation, which the driver is asked.
    ///
    /// # Safety
    /// The allocation stays valid (is not freed) for as long as the returned region lives and
    /// until every WQE naming it has completed, and the application lets the HCA read and write
    /// it as `access` allows.
    pub unsafe fn register_device(
        &self,
        gpu: &crate::cuda::Gpu,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        gpu.check_device_range(addr, len)?;
        MemoryRegion::register_caller_device(&self.inner, gpu, addr, len as u64, access)
    }

    /// Starts accepting transport connections from peers in other processes or hosts on
    /// `bind` (port 0: any free port) and returns the bound address, which every
    /// [`Endpoint`](crate::Endpoint) of this context then carries. Once per context: later
    /// calls return the first address. Only the soft provider needs this (its transport runs
    /// over TCP; requests are checked against keys, bounds and rights like any RDMA request,
    /// and a connection must come from the QP's RTR peer and present the secret of the
    /// endpoint it was handed, but nothing is encrypted and endpoints travel in clear in the
    /// handshake: bind to an interface of a network you trust). On a NIC the fabric carries requests: `None`.
    pub fn listen(&self, bind: std::net::SocketAddr) -> Result<Option<std::net::SocketAddr>> {
        self.inner
            .device
            .device()
            .listen(bind)
            .map_err(Error::device("listening for peers"))
    }

    /// A completion queue of `size` CQEs (a power of two), its ring in host memory.
    pub fn create_cq(&self, size: u32) -> Result<CompletionQueue> {
        CompletionQueue::create(&self.inner, size, &Rings::Host)
    }

    /// A completion queue of `size` CQEs (a power of two), its ring and doorbell record where
    /// `rings` says ([`Rings::Gpu`]: only kernels on that GPU can poll it).
    pub fn create_cq_in(&self, size: u32, rings: &Rings) -> Result<CompletionQueue> {
        CompletionQueue::create(&self.inner, size, rings)
    }

    /// A reliable-connected queue pair completing into `cq` (which must serve no other QP).
    pub fn create_qp(&self, cq: &CompletionQueue, config: QpConfig) -> Result<QueuePair> {
        QueuePair::create(&self.inner, cq, config)
    }
}
