//! How the soft HCA touches memory: every data movement goes through [`Dma`], so the model runs
//! on plain host memory in tests and on GPU memory (#5) with another implementation. Addresses
//! are the ones posters use (virtual addresses); the caller has already checked them against a
//! registered region.
use std::sync::atomic::{AtomicU64, Ordering};

/// Memory the soft HCA reads and writes on a region's behalf.
///
/// # Safety
/// Implementations must only access `addr..addr + len` of the calls they are given, which the
/// caller guarantees lie inside a live registered region of this kind of memory.
pub unsafe trait Dma: Send + Sync {
    /// Copies `dst.len()` bytes at `addr` into `dst`.
    fn read(&self, addr: u64, dst: &mut [u8]);
    /// Copies `src` to `addr`.
    fn write(&self, addr: u64, src: &[u8]);
    /// 8-byte fetch-and-add of the native u64 at `addr` (8-byte aligned); returns the old value.
    fn fetch_add(&self, addr: u64, add: u64) -> u64;
    /// 8-byte compare-and-swap of the native u64 at `addr`; returns the old value.
    fn compare_swap(&self, addr: u64, compare: u64, swap: u64) -> u64;
    /// Whether the CPU can address this memory directly (then copies skip the bounce buffer).
    fn host_addressable(&self) -> bool {
        false
    }
}

/// Host memory: the addresses are CPU pointers.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostDma;

// SAFETY: only the given ranges are touched, through raw pointers, as a NIC's DMA would.
unsafe impl Dma for HostDma {
    fn read(&self, addr: u64, dst: &mut [u8]) {
        // SAFETY: the range lies in a live registered region (trait contract). `copy` allows
        // overlap (a loopback transfer within one region).
        unsafe { std::ptr::copy(addr as *const u8, dst.as_mut_ptr(), dst.len()) }
    }
    fn write(&self, addr: u64, src: &[u8]) {
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy(src.as_ptr(), addr as *mut u8, src.len()) }
    }
    fn fetch_add(&self, addr: u64, add: u64) -> u64 {
        // SAFETY: in a live region, 8-byte aligned (checked by the responder).
        unsafe { AtomicU64::from_ptr(addr as *mut u64) }.fetch_add(add, Ordering::SeqCst)
    }
    fn compare_swap(&self, addr: u64, compare: u64, swap: u64) -> u64 {
        // SAFETY: as in `fetch_add`.
        match unsafe { AtomicU64::from_ptr(addr as *mut u64) }.compare_exchange(
            compare,
            swap,
            Ordering::SeqCst,
            Ordering::SeqCst,
        ) {
            Ok(v) | Err(v) => v,
        }
    }
    fn host_addressable(&self) -> bool {
        true
    }
}
