//! How the soft HCA touches memory: every data movement goes through [`Dma`], so the model runs
//! on plain host memory in tests and on GPU memory (through the copier) with another
//! implementation. Addresses are the ones posters use (virtual addresses); the caller has already checked them against a
//! registered region.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use gdaki_cuda::IpcExport;
use tracing::debug;

use crate::copier::Copier;

pub use crate::error::DmaFault;

/// Memory the soft HCA reads and writes on a region's behalf.
///
/// # Safety
/// Implementations must only access `addr..addr + len` of the calls they are given, which the
/// caller guarantees lie inside a live registered region of this kind of memory.
pub unsafe trait Dma: Send + Sync {
    /// Copies `dst.len()` bytes at `addr` into `dst`.
    fn read(&self, addr: u64, dst: &mut [u8]) -> Result<(), DmaFault>;
    /// Copies `src` to `addr`.
    fn write(&self, addr: u64, src: &[u8]) -> Result<(), DmaFault>;
    /// 8-byte fetch-and-add of the native u64 at `addr` (8-byte aligned); returns the old value.
    /// Callers serialise atomics per HCA.
    fn fetch_add(&self, addr: u64, add: u64) -> Result<u64, DmaFault>;
    /// 8-byte compare-and-swap of the native u64 at `addr`; returns the old value.
    fn compare_swap(&self, addr: u64, compare: u64, swap: u64) -> Result<u64, DmaFault>;
    /// Whether the CPU can address this memory directly (then copies skip the bounce buffer).
    fn host_addressable(&self) -> bool {
        false
    }
    /// Whether GPU kernels reach this memory at the addresses the HCA uses (host memory mapped
    /// into the GPUs), so a GPU copier can move it directly.
    fn gpu_mapped(&self) -> bool {
        false
    }
    /// The copier of the GPU this memory lives on (device memory only).
    fn gpu_copier(&self) -> Option<&Arc<Copier>> {
        None
    }
    /// The CUDA IPC export of this region's allocation, made at the first call (device memory
    /// that another process may map; `None` when it cannot be exported).
    fn ipc_export(&self) -> Option<&IpcExport> {
        None
    }
}

/// Host memory: the addresses are CPU pointers. `mapped`: also mapped into the GPUs at the same
/// addresses (page-locked), so GPU copiers can move it directly.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostDma {
    /// Mapped into the GPUs at the same addresses.
    pub mapped: bool,
}

// SAFETY: only the given ranges are touched, through raw pointers, as a NIC's DMA would.
//
// These copies model a NIC's DMA engine and use `memcpy`, not the atomic word copies of
// `MemoryRegion::read`/`write` (`crate::shared_copy`): a NIC's writes are outside Rust's
// memory model, and atomic word copies run at about half memcpy's speed (17 vs 30 GB/s for
// 1 MiB on the build machine), which every soft-HCA transfer would pay. An application that
// reads a region while a peer writes it races with this engine thread as it would with a NIC.
unsafe impl Dma for HostDma {
    fn read(&self, addr: u64, dst: &mut [u8]) -> Result<(), DmaFault> {
        // SAFETY: the range lies in a live registered region (trait contract). `copy` allows
        // overlap (a loopback transfer within one region).
        unsafe { std::ptr::copy(addr as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn write(&self, addr: u64, src: &[u8]) -> Result<(), DmaFault> {
        // The final 16 bytes land after the rest, as a NIC's in-order PCIe writes and the GPU
        // copier's final unit do: a reader polling a message's last bytes (a socket frame's
        // trailer, write_lat's flag) then finds all of it. `memcpy` promises no order (glibc
        // stores a large copy's head last). An overlapping copy (loopback within one region)
        // keeps `memmove`'s semantics instead.
        let (dst, n) = (addr as *mut u8, src.len());
        let head = n.saturating_sub(16);
        let apart = addr >= src.as_ptr() as u64 + n as u64 || src.as_ptr() as u64 >= addr + n as u64;
        // SAFETY: as in `read`; the split copies are used only where the ranges do not overlap.
        unsafe {
            if head == 0 || !apart {
                std::ptr::copy(src.as_ptr(), dst, n);
            } else {
                std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
                std::sync::atomic::fence(Ordering::Release);
                std::ptr::copy_nonoverlapping(src.as_ptr().add(head), dst.add(head), n - head);
            }
        }
        Ok(())
    }
    fn fetch_add(&self, addr: u64, add: u64) -> Result<u64, DmaFault> {
        // SAFETY: in a live region, 8-byte aligned (checked by the responder).
        Ok(unsafe { AtomicU64::from_ptr(addr as *mut u64) }.fetch_add(add, Ordering::SeqCst))
    }
    fn compare_swap(&self, addr: u64, compare: u64, swap: u64) -> Result<u64, DmaFault> {
        // SAFETY: as in `fetch_add`.
        let word = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
        Ok(
            match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(v) | Err(v) => v,
            },
        )
    }
    fn host_addressable(&self) -> bool {
        true
    }
    fn gpu_mapped(&self) -> bool {
        self.mapped
    }
}

/// The copier that can move bytes between memory `a` and `b` in one step: one side is device
/// memory of its GPU and the other the same GPU's, or host memory mapped into the GPUs.
pub(crate) fn shared_copier<'a>(a: &'a dyn Dma, b: &'a dyn Dma) -> Option<&'a Arc<Copier>> {
    match (a.gpu_copier(), b.gpu_copier()) {
        (Some(x), Some(y)) => Arc::ptr_eq(x, y).then_some(x),
        (Some(x), None) if b.gpu_mapped() => Some(x),
        (None, Some(y)) if a.gpu_mapped() => Some(y),
        _ => None,
    }
}

/// Device memory of a region: every access goes through the copier of its GPU. Host memory is
/// reached through the copier's pinned bounce buffer.
pub(crate) struct DeviceDma {
    pub copier: Arc<Copier>,
    /// The region (`addr`, `len`), whose allocation is exported for CUDA IPC at its first
    /// WRITE to a peer process; `None` for memory that is never exported (a peer's, mapped).
    span: Option<(u64, u64)>,
    export: OnceLock<Option<IpcExport>>,
}

impl DeviceDma {
    /// The `Dma` of a region of `len` bytes at `addr`, device memory of `copier`'s GPU.
    pub fn new(copier: Arc<Copier>, addr: u64, len: u64) -> DeviceDma {
        DeviceDma {
            copier,
            span: Some((addr, len)),
            export: OnceLock::new(),
        }
    }

    /// The `Dma` of another process's device memory mapped into this one (CUDA IPC): never
    /// exported again.
    pub fn imported(copier: Arc<Copier>) -> DeviceDma {
        DeviceDma {
            copier,
            span: None,
            export: OnceLock::new(),
        }
    }

    /// Moves `len` bytes between device memory at `dev` and host memory at `host`.
    fn bounce(&self, dev: u64, host: *mut u8, len: usize, to_device: bool) -> Result<(), DmaFault> {
        // SAFETY: `host..host + len` is the caller's buffer (a `Dma` call's slice) and
        // `dev..dev + len` lies in this region's device memory (the `Dma` contract).
        unsafe { self.copier.bounce(dev, host, len, to_device) }
    }
}

// SAFETY: touches only the given ranges (of device memory, through the copier's kernel, and of
// the caller's host buffers).
unsafe impl Dma for DeviceDma {
    fn read(&self, addr: u64, dst: &mut [u8]) -> Result<(), DmaFault> {
        self.bounce(addr, dst.as_mut_ptr(), dst.len(), false)
    }
    fn write(&self, addr: u64, src: &[u8]) -> Result<(), DmaFault> {
        self.bounce(addr, src.as_ptr() as *mut u8, src.len(), true)
    }
    fn fetch_add(&self, addr: u64, add: u64) -> Result<u64, DmaFault> {
        self.copier.fetch_add(addr, add)
    }
    fn compare_swap(&self, addr: u64, compare: u64, swap: u64) -> Result<u64, DmaFault> {
        self.copier.compare_swap(addr, compare, swap)
    }
    fn gpu_copier(&self) -> Option<&Arc<Copier>> {
        Some(&self.copier)
    }
    fn ipc_export(&self) -> Option<&IpcExport> {
        let (addr, len) = self.span?;
        self.export
            .get_or_init(|| {
                IpcExport::of(self.copier.context(), addr, len)
                    .inspect_err(|e| debug!("device memory at {addr:#x} is sent as bytes: {e}"))
                    .ok()
            })
            .as_ref()
    }
}
