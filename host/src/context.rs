//! A context: one opened provider (an HCA), the owner of everything created from it. Objects
//! hold the context alive; when the last one goes, its engine thread is stopped and joined.
use std::sync::Arc;

use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::memory::{Access, MemoryRegion};
use crate::options::ContextInner;
pub use crate::options::ContextOptions;
use crate::provider::Provider;
use crate::queue::{CompletionQueue, QpConfig, QueuePair, Rings};
use crate::system;
use gdaki_devx::{Device, Devx};
use gdaki_mlx5::Mlx5Device;
use gdaki_soft::SoftDevice;

/// An opened provider. Cloning gives another handle to the same device and protection domain.
#[derive(Clone)]
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
                gdaki_devx::DeviceError::Call {
                    what: "choosing the device",
                    why: format!("the soft provider has one device, \"soft\", not {name:?}"),
                },
            ));
        }
        let same_host = gdaki_soft::SameHost {
            shared_memory: options.uses_same_host_shared_memory(),
            cuda_ipc: options.uses_same_host_cuda_ipc(),
        };
        let idle = gdaki_soft::Idle::spinning_for(options.chosen_engine_idle_spin());
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

    /// Whether queue pairs may be created with a reliable doorbell
    /// ([`QpConfig::reliable_doorbell`](crate::QpConfig::reliable_doorbell)): the device reports
    /// `cmd_hca_cap_2.send_dbr_mode_no_dbr_ext` (ConnectX-8 and later; the soft HCA does).
    pub fn supports_reliable_doorbell(&self) -> bool {
        self.inner.device.caps.general2.send_dbr_mode_no_dbr_ext
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
    pub fn alloc_pinned_region(&self, gpu: &gdaki_cuda::Gpu, len: usize, access: Access) -> Result<MemoryRegion> {
        MemoryRegion::alloc_pinned(&self.inner, gpu, len, access)
    }

    /// Allocates `len` zeroed bytes of GPU device memory on `gpu`, registered with `access`: kernels
    /// use it directly, and the soft HCA moves its bytes with a persistent copy kernel on that GPU
    /// (started with the first device-memory region and stopped with the last; see
    /// [`cuda::quiesced`](gdaki_cuda::quiesced) for what that means for the application's own
    /// CUDA calls that wait for every kernel).
    pub fn alloc_device_region(&self, gpu: &gdaki_cuda::Gpu, len: usize, access: Access) -> Result<MemoryRegion> {
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
        gpu: &gdaki_cuda::Gpu,
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
        CompletionQueue::create(&self.inner, size, &Rings::Host, false)
    }

    /// A completion queue of `size` CQEs (a power of two), its ring and doorbell record where
    /// `rings` says ([`Rings::Gpu`]: only kernels on that GPU can poll it).
    pub fn create_cq_in(&self, size: u32, rings: &Rings) -> Result<CompletionQueue> {
        CompletionQueue::create(&self.inner, size, rings, false)
    }

    /// A collapsed completion queue (DOCA GPUNetIO 2.0's `cq_collapsed`, mlx5's `cqc.cc`): the
    /// HCA writes every CQE to entry 0, the newest over the rest, and never checks for room
    /// (`cqc.oi`). Pollers read one entry, so a CQ in host memory costs one cache line
    /// however many WQEs complete; what is lost is every CQE but the newest: a WQE is
    /// complete once the newest CQE is its own or a later one's (completions come in order),
    /// and an error shows only as the newest CQE (often the flush that followed it), charged to
    /// the first WQE not yet known complete. `size` is the ring the HCA is given (a power of
    /// two, at least the send queue it serves, as for [`create_cq_in`](Self::create_cq_in)).
    /// Not for stream-triggered posting (a stream waits on a CQE's owner bit, which a
    /// collapsed entry does not keep). `docs/connectx-conformance.md` has the details.
    pub fn create_collapsed_cq_in(&self, size: u32, rings: &Rings) -> Result<CompletionQueue> {
        CompletionQueue::create(&self.inner, size, rings, true)
    }

    /// A reliable-connected queue pair completing into `cq` (which must serve no other QP).
    pub fn create_qp(&self, cq: &CompletionQueue, config: QpConfig) -> Result<QueuePair> {
        QueuePair::create(&self.inner, cq, config)
    }
}
