//! Memory regions registered with an HCA, with their access rights and keys.
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::options::ContextInner;
pub use gdaki_devx::Access;
use gdaki_devx::{HostBuffer, Memory, MemoryKind, Mr};

/// A memory region registered with a context's device: an address range, its rights, and its
/// keys (on mlx5 one mkey serves as both). The soft device's keys are random, not sequential, so
/// a peer cannot guess its way to another region. Dropping it deregisters the range.
pub struct MemoryRegion {
    ctx: Arc<ContextInner>,
    mr: Mr,
    addr: u64,
    len: u64,
    access: Access,
    memory: Owned,
}

/// The memory behind a region, as far as this library owns it (and so may read and write it
/// for the application).
pub(crate) enum Owned {
    /// The caller's host memory: accessed through the caller's own pointer.
    Caller,
    /// The caller's device memory on GPU `0`: accessed through the caller's own pointer.
    CallerDevice(usize),
    /// Host memory allocated here (kept alive by the registration, which lives as long as the
    /// region).
    Host,
    /// Host memory allocated here and mapped into GPU `0` at the same addresses.
    Pinned(usize),
    /// GPU device memory allocated here.
    Device(Arc<gdaki_cuda::DeviceBuffer>),
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.mr.lkey))
            .field("rkey", &format_args!("{:#x}", self.mr.rkey))
            .field("access", &self.access)
            .finish()
    }
}

impl MemoryRegion {
    /// Allocates `len` zeroed bytes of host memory and registers them.
    pub(crate) fn alloc(ctx: &Arc<ContextInner>, len: usize, access: Access) -> Result<MemoryRegion> {
        let buf = Arc::new(HostBuffer::new("a memory region", len)?);
        let addr = buf.addr();
        let kind = MemoryKind::Host { gpu_mapped: false };
        // SAFETY: the library's own buffer, which `keep` holds.
        unsafe { Self::register(ctx, addr, len as u64, access, kind, Owned::Host, Some(buf)) }
    }

    /// Allocates host memory mapped into `gpu` (page-locked) and registers it: kernels and the
    /// HCA use the same addresses, so GPU code may pass `local`/`remote` operands of it and
    /// read what the HCA wrote there (READ data, fetched atomic values).
    pub(crate) fn alloc_pinned(
        ctx: &Arc<ContextInner>,
        gpu: &gdaki_cuda::Gpu,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        let buf = HostBuffer::new("a GPU-mapped memory region", len)?;
        // SAFETY: a page-aligned allocation of whole pages, kept alive by `Pinned` below.
        let map = unsafe { gdaki_cuda::HostMapping::new(gpu, buf.as_ptr(), buf.size()) }?;
        if map.device_addr(0) != buf.addr() {
            return Err(Error::Cuda(gdaki_cuda::CudaError::WrongResult {
                kernel: "cuMemHostGetDevicePointer",
                detail: format!(
                    "GPU address {:#x} differs from the host address {:#x}: this GPU cannot use host pointers for mapped memory",
                    map.device_addr(0),
                    buf.addr()
                ),
            }));
        }
        // Unmapped (field order) before the buffer can be freed.
        struct Pinned {
            _map: gdaki_cuda::HostMapping,
            _buf: HostBuffer,
        }
        let addr = buf.addr();
        let keep = Arc::new(Pinned { _map: map, _buf: buf });
        let kind = MemoryKind::Host { gpu_mapped: true };
        let memory = Owned::Pinned(gpu.ordinal());
        // SAFETY: the library's own buffer, which `keep` holds.
        unsafe { Self::register(ctx, addr, len as u64, access, kind, memory, Some(keep)) }
    }

    /// Allocates `len` zeroed bytes of device memory on `gpu` and registers them (a NIC reaches
    /// them by dma-buf; the soft HCA moves their bytes with the GPU's copier kernel).
    pub(crate) fn alloc_device(
        ctx: &Arc<ContextInner>,
        gpu: &gdaki_cuda::Gpu,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        let buf = Arc::new(gdaki_cuda::DeviceBuffer::zeroed(gpu, len)?);
        let addr = buf.device_addr();
        let kind = MemoryKind::Gpu(gpu.clone());
        let keep: Arc<dyn Send + Sync> = buf.clone();
        // SAFETY: the library's own device buffer, which `keep` holds.
        unsafe { Self::register(ctx, addr, len as u64, access, kind, Owned::Device(buf), Some(keep)) }
    }

    /// Registers caller memory at `addr`.
    ///
    /// # Safety
    /// As [`Context::register_host`](crate::Context::register_host): the caller's memory stays allocated
    /// until the region is dropped.
    pub(crate) unsafe fn register_caller(
        ctx: &Arc<ContextInner>,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<MemoryRegion> {
        let kind = MemoryKind::Host { gpu_mapped: false };
        // SAFETY: the caller's contract.
        unsafe { Self::register(ctx, addr, len, access, kind, Owned::Caller, None) }
    }

    /// Registers caller device memory of `gpu` at `addr` (checked by the caller).
    ///
    /// # Safety
    /// As [`register_caller`](Self::register_caller), in device memory of `gpu`.
    pub(crate) unsafe fn register_caller_device(
        ctx: &Arc<ContextInner>,
        gpu: &gdaki_cuda::Gpu,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<MemoryRegion> {
        let kind = MemoryKind::Gpu(gpu.clone());
        let memory = Owned::CallerDevice(gpu.ordinal());
        // SAFETY: the caller's contract.
        unsafe { Self::register(ctx, addr, len, access, kind, memory, None) }
    }

    /// Registers `addr..addr + len` with the context's device; `keep` is what the device holds
    /// alive while it may use the memory.
    ///
    /// # Safety
    /// The range is memory of `kind` that stays allocated while the device may use it: `keep`
    /// holds it, or (with `keep` `None`) it outlives the region.
    unsafe fn register(
        ctx: &Arc<ContextInner>,
        addr: u64,
        len: u64,
        access: Access,
        kind: MemoryKind,
        memory: Owned,
        keep: Option<Arc<dyn Send + Sync>>,
    ) -> Result<MemoryRegion> {
        if addr.checked_add(len).is_none() {
            return Err(Error::OutOfRange {
                what: "region end",
                got: len,
                min: 0,
                max: u64::MAX - addr,
            });
        }
        let dev = &ctx.device;
        // SAFETY: this function's contract.
        let mem = unsafe { Memory::new(addr, len, kind, keep) };
        let mr = dev
            .device()
            .reg_mr(ctx.pd.number, &mem, access)
            .map_err(Error::device("registering a memory region"))?;
        Ok(MemoryRegion {
            ctx: ctx.clone(),
            mr,
            addr,
            len,
            access,
            memory,
        })
    }

    /// First address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether `other` belongs to the same context (its keys mean something to this one's
    /// queue pairs).
    pub(crate) fn same_context(&self, other: &MemoryRegion) -> bool {
        Arc::ptr_eq(&self.ctx, &other.ctx)
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey
    }
    /// Rights.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The buffer at `offset` as a local operand for `gdaki-device` (no bounds check: the HCA
    /// checks every access against the region).
    pub fn local(&self, offset: u64) -> gdaki_device::Local {
        gdaki_device::Local {
            addr: self.addr.wrapping_add(offset),
            lkey: self.mr.lkey,
        }
    }

    /// The buffer at `offset` as a remote operand (what a peer needs).
    pub fn remote(&self, offset: u64) -> gdaki_device::Remote {
        gdaki_device::Remote {
            addr: self.addr.wrapping_add(offset),
            rkey: self.mr.rkey,
        }
    }

    /// The whole region as a peer sees it (what a handshake sends).
    pub fn remote_region(&self) -> gdaki_devx::wire::RemoteRegion {
        gdaki_devx::wire::RemoteRegion {
            addr: self.addr,
            len: self.len,
            rkey: self.mr.rkey,
        }
    }

    /// The address of `offset..offset + len` in library-owned memory. Caller-registered
    /// memory is accessed through the caller's own pointer instead.
    fn check(&self, offset: u64, len: usize) -> Result<*mut u8> {
        if !matches!(self.memory, Owned::Host | Owned::Pinned(_)) {
            return Err(Error::CallerMemory { key: self.mr.lkey });
        }
        self.bounds(offset, len)?;
        Ok((self.addr + offset) as *mut u8)
    }

    fn bounds(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfRange {
                what: "region offset + length",
                got: offset.saturating_add(len as u64),
                min: 0,
                max: self.len,
            }),
        }
    }

    /// Copies `buf.len()` bytes at `offset` out of a region this library allocated (for device
    /// memory, a synchronous copy). Host memory is copied with atomic word loads, so a copy
    /// racing the HCA (or a kernel) writing the same bytes is defined behaviour; like any DMA
    /// buffer, such bytes may come from before or after that write, per 8-byte word. To read
    /// what a peer wrote, wait for its signal first ([`load_u64`](Self::load_u64) acquires).
    /// (The soft HCA's own transfers copy as a NIC's DMA does, at memcpy speed: see
    /// `soft::dma`.)
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        if let Owned::Device(d) = &self.memory {
            self.bounds(offset, buf.len())?;
            return Ok(d.read(offset as usize, buf)?);
        }
        let src = self.check(offset, buf.len())?;
        // SAFETY: in bounds of the owned allocation, which outlives this call; the other
        // accesses are atomic, a kernel's, or the HCA's DMA (see `soft::dma`).
        unsafe { crate::shared_copy::load(src, buf) };
        Ok(())
    }

    /// Copies `data` into a region this library allocated, at `offset` (host memory with
    /// atomic word stores, as [`read`](Self::read) loads).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        if let Owned::Device(d) = &self.memory {
            self.bounds(offset, data.len())?;
            return Ok(d.write(offset as usize, data)?);
        }
        let dst = self.check(offset, data.len())?;
        // SAFETY: as in `read`; `data` is a Rust slice, so it cannot be the region's memory,
        // which safe code never borrows.
        unsafe { crate::shared_copy::store(dst, data) };
        Ok(())
    }

    /// Atomically loads the native u64 at `offset` (8-byte aligned), e.g. a signal word. Device
    /// memory is read with a synchronous copy (an 8-byte copy is never torn).
    pub fn load_u64(&self, offset: u64) -> Result<u64> {
        if offset % 8 != 0 || self.addr % 8 != 0 {
            return Err(Error::OutOfRange {
                what: "u64 offset alignment",
                got: offset % 8,
                min: 0,
                max: 0,
            });
        }
        if self.is_device_memory() {
            let mut b = [0u8; 8];
            self.read(offset, &mut b)?;
            return Ok(u64::from_ne_bytes(b));
        }
        let p = self.check(offset, 8)?;
        // SAFETY: in bounds and aligned; the HCA updates such words atomically too.
        Ok(unsafe { std::sync::atomic::AtomicU64::from_ptr(p as *mut u64) }.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Whether the library allocated the memory (and so [`read`](Self::read) and
    /// [`write`](Self::write) work), rather than the caller registering its own.
    pub fn is_library_owned(&self) -> bool {
        !matches!(self.memory, Owned::Caller | Owned::CallerDevice(_))
    }

    /// Whether the region is GPU device memory.
    pub fn is_device_memory(&self) -> bool {
        matches!(self.memory, Owned::Device(_) | Owned::CallerDevice(_))
    }

    /// The GPU whose kernels can read and write the region at its address: the GPU of device
    /// memory, or the one host memory is mapped into; `None` for host memory no GPU reaches.
    pub fn gpu_ordinal(&self) -> Option<usize> {
        match &self.memory {
            Owned::Device(d) => Some(d.gpu_ordinal()),
            Owned::Pinned(g) | Owned::CallerDevice(g) => Some(*g),
            Owned::Host | Owned::Caller => None,
        }
    }
}

// SAFETY: a region a GPU reaches is device memory of that GPU or host memory mapped into it,
// which the region keeps allocated (library-owned) or its registration's owner does.
unsafe impl gdaki_cuda::GpuRegion for MemoryRegion {
    fn gpu_ordinal(&self) -> Option<usize> {
        MemoryRegion::gpu_ordinal(self)
    }
    fn addr(&self) -> u64 {
        MemoryRegion::addr(self)
    }
    fn len(&self) -> u64 {
        MemoryRegion::len(self)
    }
    fn lkey(&self) -> u32 {
        MemoryRegion::lkey(self)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.device.device().dereg_mr(&self.mr) {
            tracing::warn!(target: "gdaki::devx", lkey = format_args!("{:#x}", self.mr.lkey), "region not deregistered: {e}");
        }
    }
}
