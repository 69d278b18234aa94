//! `gdaki-cuda`: the CUDA driver, loaded at run time through `cudarc` (no CUDA toolkit at build
//! time), with the PTX of `gdaki-device` embedded ([`ptx`]). Both the `gdaki` library and the
//! soft HCA's GPU copier (`gdaki-soft`) use it, so it sits below both and knows neither: kernel
//! arguments that name their objects (an exported queue pair, a GPU-reachable region) come in
//! through the [`ExportedQp`] and [`GpuRegion`] traits, which `gdaki` implements.
//!
//! Also here: the host memory both devices are given ([`HostBuffer`]), and what GPUs measure
//! about themselves (a plain device copy, a pinned round trip) as the references perftests
//! print beside their figures.
//!
//! cudarc panics when asked to call into a `libcuda` that is not there, so every entry point
//! here probes first ([`driver_present`]) and turns absence into [`CudaError::NoDriver`].
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdevice_attribute as Attr};
use cudarc::driver::{CudaContext, CudaModule, DriverError, LaunchConfig, PushKernelArg};
use thiserror::Error;

use crate::ptx::PtxUnavailable;

pub mod gdr;
mod host_buffer;
mod ipc;
mod kernel;
mod launch;
mod posting;
pub mod ptx;
mod reference;
mod stream;
pub use cudarc::driver::{CudaEvent, CudaStream};
pub use gdaki_layout::perf::StreamOp;
pub use host_buffer::{AllocError, HostBuffer};
pub use ipc::{
    enable_peer_access, ordinal_of as gpu_ordinal_of, reaches as gpu_reaches, uuid as gpu_uuid, GpuUuid, IpcExport,
    IpcImport, HANDLE_BYTES as IPC_HANDLE_BYTES,
};
pub use kernel::{Args, Dims, ExportedQp, GpuRegion, Kernel, LinkInput, Module};
pub use launch::{
    DataPathLaunch, KernelMode, KernelRun, KernelScope, PutStream, SocketBenchRun, WriteLatRun, WriteLatSide,
};
pub use posting::{PostingKernels, PostingRun, PostingShape, RingPlacement};
pub use reference::PeerDirection;
pub use stream::{
    begin_capture, captured_node, end_capture, record_event, stream_batch, stream_capturing, stream_idle_within,
    stream_memops_supported, stream_wait_u32, stream_write_u32, stream_write_u64, CapturedGraph, GraphNode, MemOp,
    StreamWait, MAX_BATCH,
};

/// The oldest driver API the bindings are generated for (CUDA 13.0).
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// Errors from the GPU side of the host library.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CudaError {
    /// `libcuda.so` could not be loaded: no NVIDIA driver on this machine.
    #[error("no NVIDIA driver: libcuda.so could not be loaded (GPU mode unavailable; CPU mode works)")]
    NoDriver,
    /// The driver is older than the CUDA API the bindings use.
    #[error("NVIDIA driver supports CUDA {}, gdaki needs CUDA {} or newer", fmt_version(*.found), fmt_version(*.needed))]
    DriverTooOld {
        /// Version the driver reports (e.g. 12040 for 12.4).
        found: i32,
        /// Version needed.
        needed: i32,
    },
    /// The driver loaded but sees no GPU.
    #[error("the NVIDIA driver reports no GPU")]
    NoDevice,
    /// The GPU index is beyond the number of GPUs.
    #[error("GPU {ordinal} requested but only {count} GPU(s) present")]
    NoSuchDevice {
        /// Requested index.
        ordinal: usize,
        /// GPUs present.
        count: usize,
    },
    /// The library was built without its kernels.
    #[error(transparent)]
    Ptx(#[from] PtxUnavailable),
    /// A driver call failed.
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),
    /// A copy outside a device buffer.
    #[error("{len} bytes at offset {offset} do not fit a device buffer of {size} bytes")]
    OutOfBounds {
        /// Offset asked for.
        offset: usize,
        /// Bytes asked for.
        len: usize,
        /// The buffer's size.
        size: usize,
    },
    /// An argument the call cannot use.
    #[error("{what}: {why}")]
    BadArgument {
        /// The call.
        what: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A read or write through a gdrcopy mapping failed.
    #[error("gdrcopy: {0}")]
    Gdr(#[from] gdr::GdrError),
    /// A kernel ran but its results are wrong.
    #[error("kernel {kernel} produced wrong results: {detail}")]
    WrongResult {
        /// Kernel name.
        kernel: &'static str,
        /// What was wrong.
        detail: String,
    },
}

fn fmt_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Whether `libcuda` can be loaded. Never panics.
pub fn driver_present() -> bool {
    // SAFETY: only tries `dlopen` on cudarc's candidate names; loads nothing it keeps.
    unsafe { sys::is_culib_present() }
}

/// The driver's CUDA version (e.g. 13000), after checking the library is there.
pub fn driver_version() -> Result<i32, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let mut version = 0;
    // SAFETY: the library is present (checked above); the out-pointer is a valid local.
    let rc = unsafe { sys::cuDriverGetVersion(&mut version) };
    rc.result()?;
    Ok(version)
}

/// Whether CUDA loads modules lazily, at a kernel's first launch (`CUDA_MODULE_LOADING=LAZY`,
/// the default since CUDA 12.2). False before the driver is initialised (it reads the
/// variable then).
pub fn lazy_module_loading() -> Result<bool, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let mut mode = sys::CUmoduleLoadingMode::CU_MODULE_EAGER_LOADING;
    // SAFETY: the library is present (checked above); the out-pointer is a valid local.
    match unsafe { sys::cuModuleGetLoadingMode(&mut mode) } {
        sys::CUresult::CUDA_SUCCESS => Ok(mode == sys::CUmoduleLoadingMode::CU_MODULE_LAZY_LOADING),
        sys::CUresult::CUDA_ERROR_NOT_INITIALIZED => Ok(false),
        other => other.result().map(|_| false).map_err(CudaError::from),
    }
}

/// One GPU as a newcomer wants to see it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_memory: usize,
    /// Number of streaming multiprocessors.
    pub multiprocessors: i32,
    /// PCI address, `dddd:bb:dd.0`.
    pub pci_address: String,
    /// Whether GPU memory can be exported as dma-buf (the modern GPUDirect RDMA registration).
    pub dma_buf: bool,
    /// Whether the driver reports GPUDirect RDMA support at all.
    pub gpudirect_rdma: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`: 0 none, 100 owner, 200 all
    /// devices (see [`RdmaWritesOrdering`]).
    pub rdma_writes_ordering: RdmaWritesOrdering,
    /// Whether its streams take the memory operations stream-triggered posting needs (64-bit
    /// writes, NOR waits): `None` where they do, else the one missing.
    pub stream_memops_missing: Option<&'static str>,
}

/// How a GPU orders writes that a NIC makes into its memory (CUDA's GPUDirect RDMA writes
/// ordering), as far as a kernel on that GPU reading them is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RdmaWritesOrdering {
    /// Below `OWNER`: a kernel that has seen a completion may still read stale data. gdaki's
    /// data path then ends every READ and fetching atomic with a fenced DUMP WQE and waits for
    /// that (`QP_FLUSH_AFTER_FETCH`), as NVSHMEM and DOCA do. Flag polling on data a peer
    /// writes (write_lat's last byte, a put_signal's signal) is not safe on such a GPU.
    None,
    /// `OWNER` (100): the owning GPU sees NIC writes in order; nothing extra is needed.
    Owner,
    /// `ALL_DEVICES` (200): every device does.
    AllDevices,
}

impl RdmaWritesOrdering {
    /// From the attribute's value (anything below 100 is none, as CUDA defines the levels).
    pub fn from_raw(v: i32) -> Self {
        match v {
            v if v >= 200 => RdmaWritesOrdering::AllDevices,
            v if v >= 100 => RdmaWritesOrdering::Owner,
            _ => RdmaWritesOrdering::None,
        }
    }

    /// Whether a kernel may read fetched data as soon as it sees the completion.
    pub fn owner_sees_writes_in_order(self) -> bool {
        self != RdmaWritesOrdering::None
    }
}

impl std::fmt::Display for RdmaWritesOrdering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RdmaWritesOrdering::None => "none",
            RdmaWritesOrdering::Owner => "owner",
            RdmaWritesOrdering::AllDevices => "all devices",
        })
    }
}

/// The driver and its GPUs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CudaInfo {
    /// CUDA version the driver supports, e.g. 13000.
    pub driver_version: i32,
    /// The GPUs, by ordinal.
    pub gpus: Vec<GpuInfo>,
}

/// Probes the driver and lists the GPUs. Never panics when there is no driver.
pub fn probe() -> Result<CudaInfo, CudaError> {
    let driver_version = checked_driver_version()?;
    let count = CudaContext::device_count()? as usize;
    let mut gpus = Vec::with_capacity(count);
    for ordinal in 0..count {
        let ctx = CudaContext::new(ordinal)?;
        let attr = |a| ctx.attribute(a);
        gpus.push(GpuInfo {
            ordinal,
            name: ctx.name()?,
            compute_capability: ctx.compute_capability()?,
            total_memory: ctx.total_mem()?,
            multiprocessors: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            pci_address: format!(
                "{:04x}:{:02x}:{:02x}.0",
                attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
                attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
                attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
            ),
            dma_buf: attr(Attr::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? != 0,
            gpudirect_rdma: attr(Attr::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)? != 0,
            rdma_writes_ordering: RdmaWritesOrdering::from_raw(attr(
                Attr::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
            )?),
            stream_memops_missing: stream::stream_memops_missing(&ctx)?,
        });
    }
    Ok(CudaInfo { driver_version, gpus })
}

/// Whether GPU `ordinal` looks usable: a recent enough driver, the GPU present and the kernels
/// built in. Cheap (no module load, unlike [`Gpu::open`], which is the real test); never panics.
pub fn usable(ordinal: usize) -> bool {
    why_unusable(ordinal).is_none()
}

/// Why GPU `ordinal` does not look usable ([`usable`]), or `None` when it does.
pub fn why_unusable(ordinal: usize) -> Option<String> {
    if let Err(e) = ptx::ptx() {
        return Some(e.to_string());
    }
    match probe() {
        Err(e) => Some(e.to_string()),
        Ok(info) if info.gpus.len() <= ordinal => Some(format!(
            "no GPU {ordinal} (this machine has {} GPU{})",
            info.gpus.len(),
            if info.gpus.len() == 1 { "" } else { "s" }
        )),
        Ok(_) => None,
    }
}

fn checked_driver_version() -> Result<i32, CudaError> {
    let found = driver_version()?;
    if found < MIN_DRIVER_VERSION {
        return Err(CudaError::DriverTooOld {
            found,
            needed: MIN_DRIVER_VERSION,
        });
    }
    Ok(found)
}

/// A GPU with gdaki's kernels loaded: the handle everything GPU-side starts from. Clones share
/// the context and module.
#[derive(Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    module: LoadedModule,
    loaded_from: ModuleImage,
    /// A stream held for the handle's life: cudarc synchronizes the whole context when a
    /// handle's first stream is made, which beside a running copier (another handle's: the
    /// copier is one per GPU) would wait for ever. The first is made in `open`, quiesced.
    _first_stream: Arc<CudaStream>,
}

/// What a GPU's copy of gdaki's kernels came from ([`Gpu::loaded_from`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ModuleImage {
    /// Machine code assembled at build time for this GPU's architecture ([`ptx::sass_for`]).
    Sass,
    /// The PTX, compiled by the driver (on a machine's first run; cached after).
    Ptx,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

/// How long [`Gpu::open`] loads the kernels before it says why: the driver compiles the embedded
/// PTX (every kernel of gdaki) on a machine's first run with a build, which took more than 100 s
/// for two processes starting at once on a fresh 2 x H200 machine, and a program that prints
/// nothing for that long looks hung.
const LOAD_NOTICE_AFTER: std::time::Duration = std::time::Duration::from_secs(3);

/// Runs `work`; if it has not returned after `after`, calls `notice` once (from a helper
/// thread, while `work` goes on). Returns as soon as `work` does.
fn noting_if_slow<T>(
    after: std::time::Duration,
    notice: impl FnOnce() + Send + 'static,
    work: impl FnOnce() -> T,
) -> T {
    let (finished, wait) = std::sync::mpsc::channel::<()>();
    let watcher = std::thread::Builder::new()
        .name("gdaki-load-notice".into())
        .spawn(move || {
            // Disconnected (the sender dropped): the work ended in time.
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(after) {
                notice();
            }
        });
    let out = work();
    drop(finished);
    // No watcher (the thread could not start) only means no notice.
    if let Ok(w) = watcher {
        let _ = w.join();
    }
    out
}

impl Gpu {
    /// Opens GPU `ordinal` and loads the embedded PTX into it.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        // Whether the GPU is there first: on a machine without one, "no GPU" is the answer,
        // whether or not this build has its kernels.
        checked_driver_version()?;
        let count = CudaContext::device_count()? as usize;
        if count == 0 {
            return Err(CudaError::NoDevice);
        }
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let text = ptx::ptx()?;
        let ctx = CudaContext::new(ordinal)?;
        let sass = ptx::sass_for(ctx.compute_capability()?);
        let notice = move || {
            tracing::warn!(
                "GPU {ordinal}: still loading gdaki's kernels after {} s: the driver compiles their \
                 PTX on a machine's first run with this build (a minute or more), then caches the \
                 result (CUDA_CACHE_PATH, CUDA_CACHE_MAXSIZE)",
                LOAD_NOTICE_AFTER.as_secs()
            )
        };
        // Loading a module and its kernels, the driver's first memset and cudarc's first stream
        // wait for every running kernel: with another handle's copier running (a second `Gpu`
        // of this device), for ever, unless it is stopped meanwhile.
        let (module, loaded_from, first_stream) = quiesced(|| {
            noting_if_slow(LOAD_NOTICE_AFTER, notice, || -> Result<_, CudaError> {
                // The build's machine code for this GPU where it has some; the PTX (compiled by
                // the driver) where it has none or the driver refuses it.
                let machine_code = sass.map(|image| ctx.load_module(cudarc::nvrtc::Ptx::from_binary(image.to_vec())));
                let (module, loaded_from) = match machine_code {
                    Some(Ok(module)) => (module, ModuleImage::Sass),
                    other => {
                        if let Some(Err(e)) = other {
                            tracing::warn!("GPU {ordinal}: gdaki's machine code did not load ({e}); compiling its PTX");
                        }
                        (ctx.load_module(cudarc::nvrtc::Ptx::from_src(text))?, ModuleImage::Ptx)
                    }
                };
                // Load every kernel now. Under CUDA's lazy loading (the default) a kernel's code is
                // loaded at first use, and that load waits for running kernels: behind the soft
                // HCA's persistent copier it would wait forever.
                for name in ptx::ENTRY_POINTS {
                    module.load_function(name)?;
                }
                // The driver's own memset kernels load lazily too: use them once now.
                let warm = ctx.default_stream().alloc_zeros::<u32>(64)?;
                ctx.default_stream().synchronize()?;
                drop(warm);
                Ok((module, loaded_from, ctx.new_stream()?))
            })
        })?;
        Ok(Gpu {
            ctx,
            module: LoadedModule::new(module),
            loaded_from,
            _first_stream: first_stream,
        })
    }

    /// What gdaki's kernels were loaded from on this GPU: the build's machine code, or its PTX
    /// compiled by the driver.
    pub fn loaded_from(&self) -> ModuleImage {
        self.loaded_from
    }

    /// How this GPU orders NIC writes into its memory (read from the driver each call).
    pub fn rdma_writes_ordering(&self) -> Result<RdmaWritesOrdering, CudaError> {
        Ok(RdmaWritesOrdering::from_raw(self.ctx.attribute(
            Attr::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
        )?))
    }

    /// The device's compute capability, `(major, minor)`: `(9, 0)` is `sm_90`.
    pub fn compute_capability(&self) -> Result<(i32, i32), CudaError> {
        Ok(self.ctx.compute_capability()?)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The CUDA context (primary context of the device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The loaded gdaki module.
    pub fn module(&self) -> &Arc<CudaModule> {
        &self.module
    }

    /// Runs the `gdaki_selftest` kernel over `threads` threads and checks every result: the
    /// proof that the PTX loads, launches, stores big-endian words and does device atomics.
    pub fn selftest(&self, threads: u32) -> Result<SelftestReport, CudaError> {
        const KERNEL: &str = "gdaki_selftest";
        let threads = threads.max(1);
        let block = threads.min(256);
        let grid = threads.div_ceil(block);
        let launched = grid * block;
        let seed = 0x5eed_0000u32 ^ threads;
        let function = self.module.load_function(KERNEL)?;
        let stream = self.ctx.default_stream();
        let mut out = stream.alloc_zeros::<u32>(threads as usize)?;
        let mut count = stream.alloc_zeros::<u64>(1)?;
        let started = std::time::Instant::now();
        let mut launch = stream.launch_builder(&function);
        launch.arg(&mut out).arg(&mut count).arg(&threads).arg(&seed);
        let config = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument list matches `gdaki_selftest(out: *mut u32, count: *mut u64, n: u32,
        // seed: u32)`; `out` holds `threads` elements and only threads below `n` write them.
        unsafe { launch.launch(config) }?;
        let words = stream.clone_dtoh(&out)?;
        let counted = stream.clone_dtoh(&count)?[0];
        let elapsed = started.elapsed();
        if counted != u64::from(launched) {
            return Err(CudaError::WrongResult {
                kernel: KERNEL,
                detail: format!("counted {counted} of {launched} threads"),
            });
        }
        if let Some((i, w)) = words
            .iter()
            .enumerate()
            .find(|(i, w)| u32::from_be(**w) != *i as u32 ^ seed)
        {
            return Err(CudaError::WrongResult {
                kernel: KERNEL,
                detail: format!(
                    "word {i} is {:#010x}, expected {:#010x}",
                    u32::from_be(*w),
                    i as u32 ^ seed
                ),
            });
        }
        Ok(SelftestReport {
            kernel: KERNEL,
            threads: launched,
            elapsed_us: elapsed.as_secs_f64() * 1e6,
        })
    }

    /// Checks that `addr..addr + len` lies inside one allocation of device memory in this
    /// GPU's context (what `cudaMalloc` or `cuMemAlloc` returned): the driver's own record of
    /// the allocation, so a host pointer, a freed range or one that runs past its allocation
    /// is refused before the HCA is told about it.
    pub fn check_device_range(&self, addr: u64, len: usize) -> Result<(), CudaError> {
        let what = "cuMemGetAddressRange";
        self.ctx.bind_to_thread()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: two valid out-pointers; the driver only reads `addr` as a number.
        let found = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }.result();
        let bad = |why: String| CudaError::BadArgument { what, why };
        if let Err(e) = found {
            return Err(bad(format!(
                "{addr:#x} is not device memory of GPU {} ({e})",
                self.ordinal()
            )));
        }
        let end = addr.checked_add(len as u64);
        if len == 0 || end.is_none_or(|end| end > base + size as u64) {
            return Err(bad(format!(
                "{len} bytes at {addr:#x} do not fit its allocation ({size} bytes at {base:#x})"
            )));
        }
        Ok(())
    }
}

/// Host memory mapped into a GPU's address space: page-locked, so the GPU reads and writes it
/// over PCIe while the CPU (the soft HCA's engine) sees it as ordinary memory. Unmapped on drop.
pub struct HostMapping {
    ctx: Arc<CudaContext>,
    host: *mut u8,
    dev: u64,
    len: usize,
}

// SAFETY: the mapping is an address range and a context handle; the driver's register and
// unregister calls are thread-safe once the context is bound.
unsafe impl Send for HostMapping {}
// SAFETY: as above; shared references only read the addresses.
unsafe impl Sync for HostMapping {}

impl std::fmt::Debug for HostMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostMapping({:p} -> {:#x}, {} bytes)", self.host, self.dev, self.len)
    }
}

impl HostMapping {
    /// Maps `host..host + len` into `gpu`.
    ///
    /// # Safety
    /// The range is allocated host memory, page-aligned and of whole pages, not mapped by
    /// another `HostMapping`, and stays allocated until this value is dropped.
    pub unsafe fn new(gpu: &Gpu, host: *mut u8, len: usize) -> Result<HostMapping, CudaError> {
        // SAFETY: the caller's contract.
        unsafe { HostMapping::register(gpu, host, len, 0) }
    }

    /// Maps the device registers at `host..host + len` (a NIC's doorbell page, mapped into this
    /// process) into `gpu` as IO memory: how a GPU rings a NIC. Drivers refuse this unless
    /// peer mappings are allowed (`NVreg_RegistryDwords="PeerMappingOverride=1;"`, or root).
    ///
    /// # Safety
    /// The range is a page-aligned mapping of device registers of whole pages, not mapped by
    /// another `HostMapping`, and stays mapped until this value is dropped.
    pub unsafe fn io(gpu: &Gpu, host: *mut u8, len: usize) -> Result<HostMapping, CudaError> {
        // SAFETY: the caller's contract.
        unsafe { HostMapping::register(gpu, host, len, sys::CU_MEMHOSTREGISTER_IOMEMORY) }
    }

    /// # Safety
    /// As [`new`](Self::new) or [`io`](Self::io), as `extra` says.
    unsafe fn register(gpu: &Gpu, host: *mut u8, len: usize, extra: u32) -> Result<HostMapping, CudaError> {
        gpu.ctx.bind_to_thread()?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE | extra;
        // SAFETY: the range is valid host memory for the mapping's life (caller's contract).
        unsafe { sys::cuMemHostRegister_v2(host.cast(), len, flags) }.result()?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` was registered just above; `dev` is a valid out-pointer.
        if let Err(e) = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) }.result() {
            // SAFETY: registered above, not yet handed out.
            let _ = unsafe { sys::cuMemHostUnregister(host.cast()) };
            return Err(e.into());
        }
        Ok(HostMapping {
            ctx: gpu.ctx.clone(),
            host,
            dev,
            len,
        })
    }

    /// The address of byte `offset` as GPU code sees it.
    pub fn device_addr(&self, offset: u64) -> u64 {
        self.dev + offset
    }

    /// The address of the host range's first byte.
    pub fn host_addr(&self) -> u64 {
        self.host as u64
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        // Nothing sensible to do on failure: the process keeps a pinned range until exit.
        // Unregistering waits for every kernel, the soft HCA's copiers included: stop them.
        quiesced(|| {
            if self.ctx.bind_to_thread().is_ok() {
                // SAFETY: registered in `new` and not unregistered since.
                let _ = unsafe { sys::cuMemHostUnregister(self.host.cast()) };
            }
        })
    }
}

/// GPU memory allocated with the driver (`cuMemAlloc`), freed on drop.
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    /// What `cuMemAlloc` returned (freed on drop).
    base: sys::CUdeviceptr,
    /// The first usable byte: `base` rounded up to a page.
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The CPU's mapping of it through gdrcopy, made at the first read or write where gdrcopy
    /// is there ([`gdr::shared`]); `None` where it is not, or the mapping was refused (then
    /// CUDA copies, as without gdrcopy).
    cpu_map: std::sync::OnceLock<Option<gdr::GdrMapping>>,
}

// SAFETY: a device address range and a context handle; driver calls bind the context first.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as above.
unsafe impl Sync for DeviceBuffer {}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes)", self.ptr, self.len)
    }
}

impl DeviceBuffer {
    /// `len` bytes (at least one) of GPU memory, zeroed, starting on a page boundary and
    /// spanning whole pages, so a NIC can reach it through a dma-buf export
    /// ([`DmaBuf::export`]).
    pub fn zeroed(gpu: &Gpu, len: usize) -> Result<DeviceBuffer, CudaError> {
        gpu.ctx.bind_to_thread()?;
        let pages = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| CudaError::BadArgument {
                what: "cuMemAlloc",
                why: format!("{len} bytes is more than an address space holds"),
            })?;
        // cuMemAlloc promises 256-byte alignment only (large allocations come 2 MiB-aligned):
        // where a small one is not page-aligned, over-allocate by a page and start inside.
        let mut base: sys::CUdeviceptr = 0;
        for extra in [0, PAGE] {
            // SAFETY: a valid out-pointer; the size is non-zero.
            unsafe { sys::cuMemAlloc_v2(&mut base, pages + extra) }.result()?;
            if base % PAGE as u64 == 0 || extra != 0 {
                break;
            }
            // SAFETY: allocated just above, not handed out.
            unsafe { sys::cuMemFree_v2(base) }.result()?;
        }
        let buf = DeviceBuffer {
            ctx: gpu.ctx.clone(),
            base,
            ptr: base.next_multiple_of(PAGE as u64),
            len: pages,
            cpu_map: std::sync::OnceLock::new(),
        };
        // Not on the legacy stream, which waits for the application's kernels on blocking
        // streams: one of them may be waiting for what this allocation is for (a socket a
        // service makes while its kernel waits in accept).
        // SAFETY: the whole usable range, inside the allocation just made.
        stream::on_private_stream(|s| unsafe { sys::cuMemsetD8Async(buf.ptr, 0, buf.len, s) })?;
        Ok(buf)
    }

    /// Its device address.
    pub fn device_addr(&self) -> u64 {
        self.ptr
    }

    /// The GPU it lives on.
    pub fn gpu_ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Its size in bytes (whole pages: at least what was asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: allocations are at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    fn check(&self, offset: usize, n: usize) -> Result<(), CudaError> {
        if offset.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(CudaError::OutOfBounds {
                offset,
                len: n,
                size: self.len,
            });
        }
        Ok(())
    }

    /// The CPU mapping of the buffer through gdrcopy, made on first use; `None` where gdrcopy
    /// is absent, the buffer is larger than [`gdr::MAP_MAX`], or gdrcopy refused it (said once,
    /// at debug level).
    fn cpu_map(&self) -> Option<&gdr::GdrMapping> {
        self.cpu_map
            .get_or_init(|| {
                if self.len > gdr::MAP_MAX {
                    return None;
                }
                let gdr = gdr::shared()?;
                // gdrdrv's mappings see the GPU's memory operations in order only where the
                // buffer synchronises them (what gdrcopy asks of every buffer it pins).
                let on: u32 = 1;
                let made = self.ctx.bind_to_thread().map_err(|e| e.to_string()).and_then(|()| {
                    // SAFETY: a live allocation of this context, and a u32 value as the
                    // attribute takes.
                    unsafe {
                        sys::cuPointerSetAttribute(
                            (&on as *const u32).cast(),
                            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                            self.ptr,
                        )
                    }
                    .result()
                    .map_err(|e| e.to_string())?;
                    // SAFETY: this allocation, which `Drop` frees only after dropping the
                    // mapping.
                    unsafe { gdr::GdrMapping::new(gdr, self.ptr, self.len) }.map_err(|e| e.to_string())
                });
                made.map_err(|e| tracing::debug!(buffer = ?self, "gdrcopy refused a mapping ({e}): CUDA copies"))
                    .ok()
            })
            .as_ref()
    }

    /// Whether the CPU reads and writes it through a gdrcopy mapping (made now if it can be).
    pub fn cpu_mapped(&self) -> bool {
        self.cpu_map().is_some()
    }

    /// Copies `src` to `offset`; the bytes are in device memory when it returns, for every
    /// reader (other streams, other processes, peers over P2P). Up to [`gdr::WRITE_MAX`]
    /// bytes through gdrcopy where it is there: the CPU's own stores through BAR1, ordered
    /// before its later stores as PCIe orders posted writes.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        self.check(offset, src.len())?;
        if let Some(map) = self.cpu_map().filter(|_| src.len() <= gdr::WRITE_MAX) {
            map.write(offset, src)?;
            // The write-combined stores leave the CPU before anything it does next.
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // On a stream of its own, waited for: from pageable memory a copy returns once its
        // bytes are staged, before the last DMA lands (a kernel on another stream, or a peer
        // storing into this memory, could see it land later). Not the legacy stream, which
        // waits for the application's kernels on blocking streams, one of which may be waiting
        // for this write (a handle a socket service exports while its kernel waits).
        // SAFETY: the destination range lies inside this allocation (checked); `src` is a
        // valid host slice that outlives the copy (the stream is waited for).
        stream::on_private_stream(|s| unsafe {
            sys::cuMemcpyHtoDAsync_v2(self.ptr + offset as u64, src.as_ptr().cast(), src.len(), s)
        })
    }

    /// Copies `src` to `offset` on `stream` and waits for that stream: landed when it returns,
    /// like [`write`](Self::write), but without the legacy stream, which waits for every kernel
    /// launched on a blocking stream first. What a resident kernel's own set-up uses: an
    /// application kernel waiting for that resident kernel would otherwise wait for itself.
    pub fn write_on(&self, stream: &cudarc::driver::CudaStream, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        self.check(offset, src.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: the destination range lies inside this allocation (checked); `src` is a
        // valid host slice that outlives the copy (the stream is synchronised before return).
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                self.ptr + offset as u64,
                src.as_ptr().cast(),
                src.len(),
                stream.cu_stream(),
            )
        }
        .result()?;
        stream::wait_idle(stream)
    }

    /// Copies from `offset` into `dst` (synchronous; up to [`gdr::READ_MAX`] bytes through
    /// gdrcopy where it is there).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check(offset, dst.len())?;
        if let Some(map) = self.cpu_map().filter(|_| dst.len() <= gdr::READ_MAX) {
            return Ok(map.read(offset, dst)?);
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the source range lies inside this allocation (checked); `dst` is a valid
        // host slice.
        unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + offset as u64, dst.len()) }.result()?;
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Unmapped and unpinned before the memory goes.
        drop(self.cpu_map.take());
        // Freeing waits for every kernel, the soft HCA's copiers included: stop them.
        quiesced(|| {
            if self.ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated in `zeroed`, freed once.
                let _ = unsafe { sys::cuMemFree_v2(self.base) };
            }
        })
    }
}

/// A kernel that stays resident on a GPU while the library runs (the soft HCA's copier). CUDA
/// calls that wait for every kernel would wait for it forever, so [`quiesced`] stops each
/// around them.
pub trait Resident: Send + Sync {
    /// Stops the kernel; pauses nest, each ended by one [`resume`](Self::resume).
    fn pause(&self);
    /// Ends a pause; the last one restarts the kernel.
    fn resume(&self);
}

/// The resident kernels of the process.
static RESIDENT: std::sync::Mutex<Vec<std::sync::Weak<dyn Resident>>> = std::sync::Mutex::new(Vec::new());

/// Blocks of the soft HCA's resident copier kernel on a GPU of `sms` SMs, an SM each: a
/// quarter of them, enough for bulk copies and leaving the rest to the application. Kernels
/// whose blocks must all run at once fit beside them ([`Kernel::check_resident`](kernel::Kernel)).
pub fn copier_blocks(sms: i32) -> u32 {
    (sms.max(8) / 4) as u32
}

/// Registers a resident kernel for [`quiesced`] (for as long as it lives), and stops it when
/// the process exits, should it still run then.
pub fn resident(kernel: std::sync::Weak<dyn Resident>) {
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    AT_EXIT.call_once(|| {
        extern "C" {
            fn atexit(f: extern "C" fn()) -> std::os::raw::c_int;
        }
        // SAFETY: `atexit` takes a function that lives as long as the program; this one never
        // unwinds (it catches panics).
        if unsafe { atexit(stop_residents_at_exit) } != 0 {
            tracing::warn!("no exit hook: a resident kernel alive at exit is left to the driver");
        }
    });
    let mut all = lock(&RESIDENT);
    all.retain(|w| w.strong_count() > 0);
    all.push(kernel);
}

/// The resident kernels alive now.
fn live_residents() -> Vec<Arc<dyn Resident>> {
    lock(&RESIDENT).iter().filter_map(|w| w.upgrade()).collect()
}

/// Stops every resident kernel as the process exits (an `atexit` hook, registered after
/// `cuInit` registered the driver's, so it runs before the driver tears down). A resident
/// kernel never ends on its own, and its last holder may be a thread that exit ends first
/// (the reaper, an engine): it would be left running to the driver's teardown. The pauses are
/// never resumed: nothing restarts a kernel once the process is ending.
extern "C" fn stop_residents_at_exit() {
    let _ = std::panic::catch_unwind(|| live_residents().iter().for_each(|k| k.pause()));
}

/// Runs `f` with every resident kernel of the process stopped (the soft HCA's GPU copiers), and
/// restarts them after: for CUDA calls that wait for every kernel, such as freeing device memory
/// or unpinning host memory. Nests.
pub fn quiesced<R>(f: impl FnOnce() -> R) -> R {
    let kernels = live_residents();
    kernels.iter().for_each(|k| k.pause());
    let r = f();
    kernels.iter().for_each(|k| k.resume());
    r
}

/// A loaded module, unloaded with the resident kernels stopped: `cuModuleUnload` waits for every
/// kernel of the context, and the soft HCA's copier never ends on its own, so an unload beside
/// it (a user's module dropped, or a second [`Gpu`] handle's copy of gdaki's kernels) would
/// wait forever. Clones (a `Gpu`'s) and the module's kernels (`CudaFunction`) share it; the
/// last holder unloads it.
#[derive(Clone)]
pub(crate) struct LoadedModule(std::mem::ManuallyDrop<Arc<CudaModule>>);

impl LoadedModule {
    pub(crate) fn new(module: Arc<CudaModule>) -> LoadedModule {
        LoadedModule(std::mem::ManuallyDrop::new(module))
    }
}

impl std::ops::Deref for LoadedModule {
    type Target = Arc<CudaModule>;
    fn deref(&self) -> &Arc<CudaModule> {
        &self.0
    }
}

impl Drop for LoadedModule {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and the field is not used again.
        let module = unsafe { std::mem::ManuallyDrop::take(&mut self.0) };
        // `into_inner` yields the module only to its last holder, which unloads it on drop.
        if let Some(last) = Arc::into_inner(module) {
            quiesced(|| drop(last));
        }
    }
}

/// Locks a mutex, taking it over if a thread panicked while holding it (the list it guards
/// stays consistent at every unlock point).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The host page size dma-buf exports are aligned to (and device buffers are allocated in).
const PAGE: usize = 4096;

/// A dma-buf file descriptor exporting a range of GPU memory: how a NIC reaches GPU memory
/// without nvidia-peermem (`ibv_reg_dmabuf_mr`, `mlx5dv_devx_umem_reg_ex`). The NIC's
/// registration takes its own reference, so this may be dropped (closing the fd) once the
/// registration is made.
#[derive(Debug)]
pub struct DmaBuf {
    fd: std::os::fd::OwnedFd,
}

impl DmaBuf {
    /// Exports `addr..addr + len` of `gpu`'s memory. The range must start and end on page
    /// boundaries (4096 bytes) and lie in memory this process allocated on that GPU.
    pub fn export(gpu: &Gpu, addr: u64, len: usize) -> Result<DmaBuf, CudaError> {
        let what = "cuMemGetHandleForAddressRange";
        if addr % PAGE as u64 != 0 || len % PAGE != 0 || len == 0 {
            return Err(CudaError::BadArgument {
                what,
                why: format!(
                    "a dma-buf export covers whole pages: {len} bytes at {addr:#x} do not start and end on \
                     {PAGE}-byte boundaries"
                ),
            });
        }
        gpu.ctx.bind_to_thread()?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: `fd` is a valid out-pointer for the descriptor this handle type returns.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                addr,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()?;
        if fd < 0 {
            return Err(CudaError::WrongResult {
                kernel: what,
                detail: format!("succeeded but returned descriptor {fd}"),
            });
        }
        // SAFETY: the driver just opened this descriptor for us; nothing else owns it.
        Ok(DmaBuf {
            fd: unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) },
        })
    }

    /// Exports the whole pages around `addr..addr + len` (memory this process allocated on
    /// `gpu`, whose pages it owns whole, as [`DeviceBuffer`]s do) and says where `addr` is in
    /// the export: what a registration of a range that is not page-aligned needs.
    pub fn covering(gpu: &Gpu, addr: u64, len: usize) -> Result<(DmaBuf, u64), CudaError> {
        let start = addr - addr % PAGE as u64;
        let end = addr
            .checked_add(len as u64)
            .and_then(|e| e.checked_next_multiple_of(PAGE as u64))
            .ok_or_else(|| CudaError::BadArgument {
                what: "cuMemGetHandleForAddressRange",
                why: format!("{len} bytes at {addr:#x} wrap around the address space"),
            })?;
        Ok((DmaBuf::export(gpu, start, (end - start) as usize)?, addr - start))
    }

    /// The descriptor.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.fd)
    }
}

/// What [`Gpu::selftest`] saw.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SelftestReport {
    /// The kernel launched.
    pub kernel: &'static str,
    /// Threads launched (all verified).
    pub threads: u32,
    /// Launch to results copied back, first launch included (module load excluded).
    pub elapsed_us: f64,
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::noting_if_slow;

    fn noted(after: Duration, work: Duration) -> (bool, Duration) {
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        let start = Instant::now();
        let v = noting_if_slow(
            after,
            move || f.store(true, Ordering::SeqCst),
            || {
                std::thread::sleep(work);
                7
            },
        );
        assert_eq!(v, 7);
        (flag.load(Ordering::SeqCst), start.elapsed())
    }

    #[test]
    fn a_slow_load_is_noted_while_it_runs() {
        assert!(noted(Duration::from_millis(20), Duration::from_millis(300)).0);
    }

    #[test]
    fn a_quick_load_is_not_noted_and_does_not_wait_for_the_notice() {
        let (was_noted, took) = noted(Duration::from_secs(30), Duration::from_millis(1));
        assert!(!was_noted);
        assert!(took < Duration::from_secs(5), "took {took:?}");
    }
}
