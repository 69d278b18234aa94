//! How the soft HCA touches memory: every data movement goes through [`Dma`], so the model runs
//! on plain host memory in tests and on GPU memory (through the copier) with another
//! implementation. Addresses are the ones posters use (virtual addresses); the caller has already checked them against a
//! registered region.
use std::sync::atomic::{AtomicU64, Ordering};

/// A transfer that could not be made (a GPU copy failed or timed out; the cause is logged where
/// it happened). The WQE fails as a NIC's DMA error fails it: a local access error at the
/// requester, a remote operation error at the responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaFault;

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
    fn gpu_copier(&self) -> Option<&std::sync::Arc<crate::copier::Copier>> {
        None
    }
    /// The CUDA IPC export of this region's allocation, made at the first call (device memory
    /// that another process may map; `None` when it cannot be exported).
    fn ipc_export(&self) -> Option<&gdaki_cuda::IpcExport> {
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
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy(src.as_ptr(), addr as *mut u8, src.len()) };
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
