//! The PTX entry points (`extern "ptx-kernel"`), one place for all of them. Each is a thin shell
//! that reads its thread coordinates and calls the data-path API; the logic lives in the rest of
//! the crate so that CPU threads run it too.
use core::arch::nvptx::{_block_dim_x, _block_idx_x, _thread_idx_x};
use core::sync::atomic::{AtomicU64, Ordering};

/// Self-test kernel used by `doctor` and the GPU runner: thread `i` of the grid writes the
/// big-endian encoding of `i ^ seed` to `out[i]` (the byte order every WQE field uses) and adds
/// one to `*count`, so the host can check both plain stores and device atomics.
///
/// # Safety
/// `out` must be valid for `n` u32 writes and `count` must point to a u64 in device-accessible
/// memory; the launch must not have more than `n` threads that write (extra threads only count).
#[no_mangle]
pub unsafe extern "ptx-kernel" fn gdaki_selftest(out: *mut u32, count: *mut u64, n: u32, seed: u32) {
    let i = _block_idx_x() as u32 * _block_dim_x() as u32 + _thread_idx_x() as u32;
    if i < n {
        // SAFETY: i < n and the caller guarantees `out` holds n elements.
        unsafe { out.add(i as usize).write_volatile((i ^ seed).to_be()) };
    }
    // SAFETY: the caller guarantees `count` is a valid, aligned u64 in device-visible memory.
    unsafe { AtomicU64::from_ptr(count) }.fetch_add(1, Ordering::Relaxed);
}
