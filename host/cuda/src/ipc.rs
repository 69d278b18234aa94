//! CUDA IPC: device memory of one process mapped into another process on the same machine
//! (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`). The soft HCA's same-host transport sends a
//! reference to the requester's device memory instead of its bytes, and the responder's copier
//! moves them inside the GPU (see the soft HCA's `ipc` module).
//!
//! Legacy IPC covers whole allocations made by `cuMemAlloc` / `cudaMalloc`; memory made with
//! the virtual memory management API (`cuMemCreate`) is not IPC-capable this way and is sent
//! as bytes. An importer must close its mapping before the exporter frees the allocation for
//! the contents to stay defined; the driver keeps the physical pages for an open mapping.
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::{quiesced, CudaError};

/// Bytes of an IPC memory handle.
pub const HANDLE_BYTES: usize = 64;

/// A GPU's identity across processes (`cuDeviceGetUuid`): ordinals differ between processes
/// that see different `CUDA_VISIBLE_DEVICES`, the UUID does not.
pub type GpuUuid = [u8; 16];

/// The UUID of the device of `ctx`.
pub fn uuid(ctx: &CudaContext) -> Result<GpuUuid, CudaError> {
    let mut u = sys::CUuuid_st { bytes: [0; 16] };
    // SAFETY: a valid out-pointer and a device the context was made for.
    unsafe { sys::cuDeviceGetUuid_v2(&mut u, ctx.cu_device()) }.result()?;
    Ok(u.bytes.map(|b| b as u8))
}

/// The ordinal (among the GPUs this process sees) and device of the GPU with UUID `uuid`;
/// `None` where it is not visible (`CUDA_VISIBLE_DEVICES`) or a driver call fails. Call with
/// the driver loaded (a context exists).
fn device_of(uuid: &GpuUuid) -> Option<(usize, sys::CUdevice)> {
    let mut count = 0;
    // SAFETY: a valid out-pointer.
    unsafe { sys::cuDeviceGetCount(&mut count) }.result().ok()?;
    (0..count).find_map(|ordinal| {
        let mut dev = 0;
        let mut u = sys::CUuuid_st { bytes: [0; 16] };
        // SAFETY: valid out-pointers, an ordinal below the count.
        let named = unsafe { sys::cuDeviceGet(&mut dev, ordinal) }.result().is_ok()
            && unsafe { sys::cuDeviceGetUuid_v2(&mut u, dev) }.result().is_ok();
        (named && u.bytes.map(|b| b as u8) == *uuid).then_some((ordinal as usize, dev))
    })
}

/// The ordinal of the GPU with UUID `uuid` among the GPUs this process sees, if it sees it
/// (`None` also where there is no driver).
pub fn ordinal_of(uuid: &GpuUuid) -> Option<usize> {
    if !crate::driver_present() {
        return None;
    }
    device_of(uuid).map(|(ordinal, _)| ordinal)
}

/// Whether kernels on the GPU of `ctx` can read and write device memory of the GPU with UUID
/// `peer` through a P2P mapping (NVLink or PCIe): the same GPU, or one `cuDeviceCanAccessPeer`
/// says it reaches. `false` where that GPU is not visible to this process
/// (`CUDA_VISIBLE_DEVICES`), or where a driver call fails.
pub fn reaches(ctx: &CudaContext, peer: &GpuUuid) -> bool {
    let from = ctx.cu_device();
    let Some((_, dev)) = device_of(peer) else {
        return false;
    };
    if dev == from {
        return true;
    }
    let mut can = 0;
    // SAFETY: a valid out-pointer and two devices the driver named.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, from, dev) }
        .result()
        .is_ok()
        && can != 0
}

/// Lets kernels in `ctx` load and store memory of the GPU with UUID `peer` (`cuCtxEnablePeerAccess`
/// to that GPU's primary context, retained for the life of the process), now rather than lazily
/// at some later launch, with the resident kernels stopped: enabling waits for the context's
/// kernels. Nothing to do for `ctx`'s own GPU or where access is enabled already.
pub fn enable_peer_access(ctx: &CudaContext, peer: &GpuUuid) -> Result<(), CudaError> {
    let Some((_, dev)) = device_of(peer) else {
        return Err(CudaError::BadArgument {
            what: "cuCtxEnablePeerAccess",
            why: "the peer GPU is not visible to this process".into(),
        });
    };
    if dev == ctx.cu_device() {
        return Ok(());
    }
    ctx.bind_to_thread()?;
    let mut peer_ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and a device the driver named. Retained for good: access
    // lasts as long as the peer context does.
    unsafe { sys::cuDevicePrimaryCtxRetain(&mut peer_ctx, dev) }.result()?;
    quiesced(|| {
        // SAFETY: the current context is `ctx`; `peer_ctx` is live (retained above).
        match unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            e => e.result(),
        }
    })?;
    Ok(())
}

/// One allocation of device memory, exported for other processes: what a peer needs to map it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    /// The driver's handle (opaque bytes).
    pub handle: [u8; HANDLE_BYTES],
    /// Where the allocation starts in this process.
    pub base: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The GPU it lives on.
    pub gpu: GpuUuid,
}

impl IpcExport {
    /// Exports the allocation that holds `addr..addr + len` (device memory of `ctx`'s GPU):
    /// refused when the range is not inside one allocation or the allocation is not
    /// IPC-capable.
    pub fn of(ctx: &CudaContext, addr: u64, len: u64) -> Result<IpcExport, CudaError> {
        let bad = |what, why: String| CudaError::BadArgument { what, why };
        ctx.bind_to_thread()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: two valid out-pointers; the driver only reads `addr` as a number.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }.result()?;
        let size = size as u64;
        if addr.checked_add(len).is_none_or(|end| end > base + size) {
            return Err(bad(
                "cuMemGetAddressRange",
                format!("{len} bytes at {addr:#x} run past their allocation ({size} bytes at {base:#x})"),
            ));
        }
        // The driver writes a boolean whose width it does not document: room for any, zeroed.
        let mut capable: u64 = 0;
        // SAFETY: a valid out-pointer to 8 writable bytes.
        let asked = unsafe {
            sys::cuPointerGetAttribute(
                (&mut capable as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                base,
            )
        }
        .result();
        if asked.is_err() || capable == 0 {
            return Err(bad(
                "cuIpcGetMemHandle",
                format!("the allocation at {base:#x} is not IPC-capable (made with cuMemCreate?)"),
            ));
        }
        let mut h = sys::CUipcMemHandle_st {
            reserved: [0; HANDLE_BYTES],
        };
        // SAFETY: a valid out-pointer; `base` is the start of a live allocation (found above).
        unsafe { sys::cuIpcGetMemHandle(&mut h, base) }.result()?;
        Ok(IpcExport {
            handle: h.reserved.map(|b| b as u8),
            base,
            size,
            gpu: uuid(ctx)?,
        })
    }
}

/// Another process's allocation mapped into this one, in `ctx`; closed on drop (with the
/// resident kernels stopped: unmapping may wait for every kernel, see [`quiesced`]).
pub struct IpcImport {
    ctx: Arc<CudaContext>,
    ptr: u64,
    size: u64,
}

impl std::fmt::Debug for IpcImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcImport")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .finish()
    }
}

impl IpcImport {
    /// Maps the allocation of `handle` into `ctx`. Its size is the driver's record of the
    /// mapping, not anything the exporter claims. Fails for a handle of this process, of a
    /// freed allocation, or of a GPU this one cannot reach.
    pub fn open(ctx: &Arc<CudaContext>, handle: &[u8; HANDLE_BYTES]) -> Result<IpcImport, CudaError> {
        ctx.bind_to_thread()?;
        let h = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as _),
        };
        let mut ptr = 0u64;
        // Mapping (and the peer access it may enable) can wait for every kernel of the
        // context: the resident ones are stopped meanwhile.
        quiesced(|| {
            // SAFETY: a valid out-pointer; the driver validates the handle's bytes.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
                )
            }
            .result()
        })?;
        // Closed on drop from here on, also if the size cannot be read.
        let mut import = IpcImport {
            ctx: ctx.clone(),
            ptr,
            size: 0,
        };
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: two valid out-pointers; `ptr` was just mapped.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }.result()?;
        import.size = size as u64;
        Ok(import)
    }

    /// Where the allocation is mapped in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for IpcImport {
    fn drop(&mut self) {
        let ctx = &self.ctx;
        let ptr = self.ptr;
        quiesced(|| {
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: mapped by `open`, closed once.
                let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
            }
        });
    }
}
