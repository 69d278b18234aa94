//! Memory regions: allocated by the library (host, GPU-mapped host, GPU) or the caller's
//! (host, GPU), their keys, and copies in and out of the library's own.
use std::ffi::c_void;

use gdaki::{Access, MemoryRegion};
use gdaki_layout::handle::DevRemote;

use crate::context::{gdaki_context, gdaki_gpu};
use crate::guard::{self, call, gdaki_status, handle, Failure, Outcome};

/// The local HCA may write the region (READ destinations, atomic results).
pub const GDAKI_ACCESS_LOCAL_WRITE: u32 = 1;
/// Peers may write it.
pub const GDAKI_ACCESS_REMOTE_WRITE: u32 = 2;
/// Peers may read it.
pub const GDAKI_ACCESS_REMOTE_READ: u32 = 4;
/// Peers may run atomics on it.
pub const GDAKI_ACCESS_REMOTE_ATOMIC: u32 = 8;
/// All of the above.
pub const GDAKI_ACCESS_ALL: u32 = 15;
// The header takes literals (cbindgen evaluates no calls): they must be the Rust flags.
const _: () = assert!(
    GDAKI_ACCESS_LOCAL_WRITE == Access::LOCAL_WRITE.bits()
        && GDAKI_ACCESS_REMOTE_WRITE == Access::REMOTE_WRITE.bits()
        && GDAKI_ACCESS_REMOTE_READ == Access::REMOTE_READ.bits()
        && GDAKI_ACCESS_REMOTE_ATOMIC == Access::REMOTE_ATOMIC.bits()
        && GDAKI_ACCESS_ALL == Access::ALL.bits()
);

/// A registered memory region. Destroying it deregisters the range (the memory of a
/// library-allocated region is freed with it).
pub struct gdaki_region(guard::Tagged<MemoryRegion>);
handle!(gdaki_region(MemoryRegion), b"gdakiMR\0", "region");

/// What `gdaki_region_query` reports.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gdaki_region_info {
    /// First address (a device address for GPU memory).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Key for local operands (`lkey` of the device functions).
    pub lkey: u32,
    /// Key peers use (`rkey`).
    pub rkey: u32,
    /// The `GDAKI_ACCESS_*` bits it was registered with.
    pub access: u32,
    /// The GPU whose kernels reach it at `addr` (its device memory, or host memory mapped into
    /// it), or -1.
    pub gpu: i32,
    /// 1 for GPU device memory, else 0.
    pub device_memory: u32,
    /// 1 when the library allocated it (`gdaki_region_read`/`_write` work), else 0.
    pub library_owned: u32,
}

fn access(bits: u32) -> Result<Access, Failure> {
    Access::from_bits(bits).ok_or_else(|| {
        Failure::invalid(format!(
            "access {bits:#x} has unknown bits (allowed: GDAKI_ACCESS_* = {:#x})",
            Access::ALL.bits()
        ))
    })
}

/// Registers what `make` returns as a new region handle in `*region`.
///
/// # Safety
/// `region` is NULL or writable.
unsafe fn new_region(region: *mut *mut gdaki_region, make: impl FnOnce() -> Result<MemoryRegion, Failure>) -> Outcome {
    // SAFETY: the caller's contract.
    let out = unsafe { guard::out(region, "region") }?;
    out.write(guard::into_handle(make()?));
    Ok(())
}

/// Allocates `len` zeroed bytes of host memory registered with `access` (`GDAKI_ACCESS_*`).
///
/// # Safety
/// `ctx` is NULL or a context handle; `region` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_alloc(
    ctx: *const gdaki_context,
    len: usize,
    access: u32,
    region: *mut *mut gdaki_region,
) -> gdaki_status {
    call("gdaki_region_alloc", || {
        // SAFETY: the caller's contract.
        let c = unsafe { guard::borrow(ctx, "ctx") }?;
        let a = self::access(access)?;
        // SAFETY: the caller's contract.
        unsafe { new_region(region, || Ok(c.alloc_region(len, a)?)) }
    })
}

/// A region on `gpu` made by `make`, as a new handle in `*region`.
///
/// # Safety
/// `ctx`, `gpu` are NULL or handles of their types; `region` is NULL or writable.
unsafe fn gpu_region(
    name: &str,
    ctx: *const gdaki_context,
    gpu: *const gdaki_gpu,
    access: u32,
    region: *mut *mut gdaki_region,
    make: impl FnOnce(&gdaki::Context, &gdaki::cuda::Gpu, Access) -> gdaki::Result<MemoryRegion>,
) -> gdaki_status {
    call(name, || {
        // SAFETY: the caller's contract.
        let (c, g) = unsafe { (guard::borrow(ctx, "ctx")?, guard::borrow(gpu, "gpu")?) };
        let a = self::access(access)?;
        // SAFETY: the caller's contract.
        unsafe { new_region(region, || Ok(make(c, g, a)?)) }
    })
}

/// Allocates `len` zeroed bytes of page-locked host memory mapped into `gpu` at the same
/// address: kernels use it as local or remote operands and read what the HCA wrote there.
///
/// # Safety
/// `ctx`, `gpu` are NULL or handles of their types; `region` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_alloc_pinned(
    ctx: *const gdaki_context,
    gpu: *const gdaki_gpu,
    len: usize,
    access: u32,
    region: *mut *mut gdaki_region,
) -> gdaki_status {
    // SAFETY: the caller's contract.
    unsafe {
        gpu_region("gdaki_region_alloc_pinned", ctx, gpu, access, region, |c, g, a| {
            c.alloc_pinned_region(g, len, a)
        })
    }
}

/// Allocates `len` zeroed bytes of device memory on `gpu`, registered with `access`.
///
/// # Safety
/// `ctx`, `gpu` are NULL or handles of their types; `region` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_alloc_device(
    ctx: *const gdaki_context,
    gpu: *const gdaki_gpu,
    len: usize,
    access: u32,
    region: *mut *mut gdaki_region,
) -> gdaki_status {
    // SAFETY: the caller's contract.
    unsafe {
        gpu_region("gdaki_region_alloc_device", ctx, gpu, access, region, |c, g, a| {
            c.alloc_device_region(g, len, a)
        })
    }
}

/// Registers the caller's host memory `addr..addr + len`. The memory must stay allocated until
/// the region is destroyed and every WQE naming it has completed; the library never reads or
/// writes it for the caller (`gdaki_region_read` refuses), only the HCA does, as `access`
/// allows.
///
/// # Safety
/// `ctx` is NULL or a context handle; `addr..addr + len` is host memory of this process that
/// stays valid as said above; `region` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_register_host(
    ctx: *const gdaki_context,
    addr: *mut c_void,
    len: usize,
    access: u32,
    region: *mut *mut gdaki_region,
) -> gdaki_status {
    call("gdaki_region_register_host", || {
        // SAFETY: the caller's contract.
        let c = unsafe { guard::borrow(ctx, "ctx") }?;
        let a = self::access(access)?;
        if addr.is_null() {
            return Err(Failure::new(gdaki_status::NullArgument, "addr is NULL"));
        }
        if len == 0 {
            return Err(Failure::invalid("len is 0"));
        }
        // SAFETY: the range is the caller's memory, valid for as long as the region and its
        // WQEs (the caller's contract).
        unsafe { new_region(region, || Ok(c.register_host(addr.cast(), len, a)?)) }
    })
}

/// Registers the caller's device memory `addr..addr + len` on `gpu` (from `cudaMalloc` or
/// `cuMemAlloc`, in the GPU's primary context). The driver is asked that the range lies in one
/// allocation of that GPU: a host pointer or a range past the allocation is
/// `GDAKI_STATUS_INVALID_ARGUMENT`. It must stay allocated until the region is destroyed and
/// every WQE naming it has completed.
///
/// # Safety
/// `ctx`, `gpu` are NULL or handles of their types; the allocation stays valid as said above;
/// `region` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_register_device(
    ctx: *const gdaki_context,
    gpu: *const gdaki_gpu,
    addr: u64,
    len: usize,
    access: u32,
    region: *mut *mut gdaki_region,
) -> gdaki_status {
    // SAFETY: the caller's contract; the driver checks the range is one allocation, which
    // stays valid for the region's life (the caller's contract).
    unsafe {
        gpu_region("gdaki_region_register_device", ctx, gpu, access, region, |c, g, a| {
            c.register_device(g, addr, len, a)
        })
    }
}

/// Destroys a region (NULL: nothing), deregistering it.
///
/// # Safety
/// `region` is NULL or a region handle with no call on it in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_destroy(region: *mut gdaki_region) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_region_destroy", || unsafe { guard::destroy(region, "region") })
}

/// The region's address, length, keys and placement.
///
/// # Safety
/// `region` is NULL or a region handle; `info` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_query(region: *const gdaki_region, info: *mut gdaki_region_info) -> gdaki_status {
    call("gdaki_region_query", || {
        // SAFETY: the caller's contract.
        let (r, out) = unsafe { (guard::borrow(region, "region")?, guard::out(info, "info")?) };
        out.write(gdaki_region_info {
            addr: r.addr(),
            len: r.len(),
            lkey: r.lkey(),
            rkey: r.rkey(),
            access: r.access().bits(),
            gpu: r.gpu_ordinal().and_then(|g| i32::try_from(g).ok()).unwrap_or(-1),
            device_memory: r.is_device_memory() as u32,
            library_owned: r.is_library_owned() as u32,
        });
        Ok(())
    })
}

/// The region as a peer sees it, a `gdaki_remote_region` (address, length, rkey; declared in
/// `gdaki_device.h`): plain data to send to the peers that may access it, which put it into
/// the device functions' `dst`/`src` and `rkey`.
///
/// # Safety
/// `region` is NULL or a region handle; `remote` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_remote(region: *const gdaki_region, remote: *mut DevRemote) -> gdaki_status {
    call("gdaki_region_remote", || {
        // SAFETY: the caller's contract.
        let (r, out) = unsafe { (guard::borrow(region, "region")?, guard::out(remote, "remote")?) };
        out.write(r.remote_region().into());
        Ok(())
    })
}

/// Copies `len` bytes at `offset` of a library-allocated region into `buf` (device memory:
/// a synchronous copy). Caller-registered memory is `GDAKI_STATUS_INVALID_STATE` (read it
/// through your own pointer); a range past the end is `GDAKI_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `region` is NULL or a region handle; `buf` is NULL or valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_read(
    region: *const gdaki_region,
    offset: u64,
    buf: *mut c_void,
    len: usize,
) -> gdaki_status {
    call("gdaki_region_read", || {
        // SAFETY: the caller's contract.
        let (r, dst) = unsafe {
            (
                guard::borrow(region, "region")?,
                guard::slice_mut(buf.cast::<u8>(), len, "buf")?,
            )
        };
        Ok(r.read(offset, dst)?)
    })
}

/// Copies `len` bytes from `buf` into a library-allocated region at `offset` (the same rules as
/// `gdaki_region_read`).
///
/// # Safety
/// `region` is NULL or a region handle; `buf` is NULL or valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_write(
    region: *const gdaki_region,
    offset: u64,
    buf: *const c_void,
    len: usize,
) -> gdaki_status {
    call("gdaki_region_write", || {
        // SAFETY: the caller's contract.
        let (r, src) = unsafe {
            (
                guard::borrow(region, "region")?,
                guard::slice(buf.cast::<u8>(), len, "buf")?,
            )
        };
        Ok(r.write(offset, src)?)
    })
}
