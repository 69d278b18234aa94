//! Host (CPU mode and tests): std atomics with the ordering the GPU instructions give, so CPU
//! threads run the data path against the soft HCA or a test consumer in another thread.
extern crate std;

use core::sync::atomic::Ordering;

use cells::{fence, u32_at, u64_at, u8_at};

/// Atomic views of memory shared with the consumer (HCA, proxy) or other posters. Normally std
/// atomics over the raw memory; under `--cfg loom`, loom's atomics, one per address, created
/// on first use with the memory's value, so the loom model runs this very code.
#[cfg(not(loom))]
pub(crate) mod cells {
    pub use core::sync::atomic::fence;
    use core::sync::atomic::{AtomicU32, AtomicU64, AtomicU8};

    /// # Safety
    /// `p` is valid, 8-byte aligned, and only accessed atomically while the view is used.
    #[inline(always)]
    pub unsafe fn u64_at<'a>(p: *mut u64) -> &'a AtomicU64 {
        // SAFETY: per the caller's contract.
        unsafe { AtomicU64::from_ptr(p) }
    }
    /// # Safety
    /// As for [`u64_at`], 4-byte aligned.
    #[inline(always)]
    pub unsafe fn u32_at<'a>(p: *mut u32) -> &'a AtomicU32 {
        // SAFETY: per the caller's contract.
        unsafe { AtomicU32::from_ptr(p) }
    }
    /// # Safety
    /// As for [`u64_at`].
    #[inline(always)]
    pub unsafe fn u8_at<'a>(p: *mut u8) -> &'a AtomicU8 {
        // SAFETY: per the caller's contract.
        unsafe { AtomicU8::from_ptr(p) }
    }
}

#[cfg(loom)]
pub(crate) mod cells {
    extern crate std;
    use std::boxed::Box;
    use std::collections::HashMap;
    use std::sync::Mutex;

    pub use loom::sync::atomic::fence;
    use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicU8};

    enum Cell {
        U64(&'static AtomicU64),
        U32(&'static AtomicU32),
        U8(&'static AtomicU8),
    }

    loom::lazy_static! {
        // Reset for every execution of the model. Loom runs one thread at a time, so the
        // mutex never blocks. The leaked atomics belong to one execution each.
        static ref CELLS: Mutex<HashMap<usize, Cell>> = Mutex::new(HashMap::new());
    }

    macro_rules! cell_at {
        ($name:ident, $t:ty, $atomic:ident, $variant:ident) => {
            /// # Safety
            /// `p` is valid and aligned; every access to it goes through this registry with
            /// the same width.
            pub unsafe fn $name(p: *mut $t) -> &'static $atomic {
                let mut cells = CELLS.lock().unwrap();
                let cell = cells
                    .entry(p as usize)
                    // SAFETY: first access: the memory holds the value the test set up.
                    .or_insert_with(|| Cell::$variant(Box::leak(Box::new($atomic::new(unsafe { p.read() })))));
                match cell {
                    Cell::$variant(a) => a,
                    _ => panic!("loom model: {:p} accessed with two widths", p),
                }
            }
        };
    }
    cell_at!(u64_at, u64, AtomicU64, U64);
    cell_at!(u32_at, u32, AtomicU32, U32);
    cell_at!(u8_at, u8, AtomicU8, U8);
}

/// Earlier writes are visible to the consumer (HCA) before later stores.
#[inline(always)]
pub fn to_device_barrier() {
    fence(Ordering::Release);
}

/// [`to_device_barrier`] for rings in the poster's own memory: on the host there is one scope.
#[inline(always)]
pub fn to_device_barrier_gpu() {
    to_device_barrier();
}

/// Later reads see what the HCA wrote before the flag just read.
#[inline(always)]
pub fn from_device_barrier() {
    fence(Ordering::Acquire);
}

/// Stores one 16-byte WQE segment.
///
/// # Safety
/// `dst` is valid for 16 bytes of writes and 8-byte aligned.
#[inline(always)]
pub unsafe fn store_seg(dst: *mut u64, words: [u64; 2]) {
    // SAFETY: the caller guarantees `dst` is a valid, aligned 16-byte slot. Relaxed atomic
    // stores, since the consumer reads the ring concurrently (ordered by the doorbell).
    unsafe {
        u64_at(dst).store(words[0], Ordering::Relaxed);
        u64_at(dst.add(1)).store(words[1], Ordering::Relaxed);
    }
}

/// The doorbell store. On the host it is a release store, so a consumer that acquires the
/// doorbell word sees everything written before it.
///
/// # Safety
/// `dst` is a valid, 8-byte aligned doorbell word.
#[inline(always)]
pub unsafe fn mmio_store(dst: *mut u64, value: u64) {
    // SAFETY: per the caller's contract.
    unsafe { u64_at(dst).store(value, Ordering::Release) }
}

/// Stores a send doorbell-record word, relaxed ([`crate::Qp::ring`] orders it with its
/// fences); on the host there is one scope.
///
/// # Safety
/// `dst` is a valid, 4-byte aligned doorbell-record word.
#[inline(always)]
pub unsafe fn store_dbrec(dst: *mut u32, value: u32, _gpu: bool) {
    // SAFETY: per the caller's contract.
    unsafe { u32_at(dst).store(value, Ordering::Relaxed) }
}

/// Stores a CQ doorbell-record word: a release store where the caller read a CQE's body
/// (`after_reads`: those reads come before the HCA may reuse the slot), else relaxed (the
/// store depends on the polled tail through a branch). See the nvptx twin.
///
/// # Safety
/// `dst` is a valid, 4-byte aligned doorbell-record word.
#[inline(always)]
pub unsafe fn store_cq_dbrec(dst: *mut u32, value: u32, after_reads: bool) {
    let order = if after_reads {
        Ordering::Release
    } else {
        Ordering::Relaxed
    };
    // SAFETY: per the caller's contract.
    unsafe { u32_at(dst).store(value, order) }
}

/// Compare-and-swap on a doorbell-record word; returns the previous value.
///
/// # Safety
/// `dst` is a valid, 4-byte aligned doorbell-record word.
#[inline(always)]
pub unsafe fn cas_dbrec(dst: *mut u32, current: u32, new: u32) -> u32 {
    // SAFETY: per the caller's contract.
    match unsafe { u32_at(dst) }.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire) {
        Ok(v) | Err(v) => v,
    }
}

/// Raises a host-visible u64 to at least `value` with release order; returns the old value.
///
/// # Safety
/// `dst` is a valid, 8-byte aligned u64.
#[inline(always)]
pub unsafe fn fetch_max_sys(dst: *mut u64, value: u64) -> u64 {
    // SAFETY: per the caller's contract.
    unsafe { u64_at(dst) }.fetch_max(value, Ordering::AcqRel)
}

/// Stores a host-visible u64 with release order.
///
/// # Safety
/// `dst` is a valid, 8-byte aligned u64.
#[inline(always)]
pub unsafe fn store_sys(dst: *mut u64, value: u64) {
    // SAFETY: per the caller's contract.
    unsafe { u64_at(dst) }.store(value, Ordering::Release)
}

/// Reads a word that only the caller's group touches while it runs (on a GPU served from the
/// block's L1): a volatile read here, ordered by the group's barriers.
///
/// # Safety
/// `src` is valid for reads and 8-byte aligned.
#[inline(always)]
pub unsafe fn load_u64_block(src: *const u64) -> u64 {
    // SAFETY: per the caller's contract.
    unsafe { src.read_volatile() }
}

/// Stores a word that only the caller's group touches while it runs (see [`load_u64_block`]).
///
/// # Safety
/// `dst` is valid for writes and 8-byte aligned.
#[inline(always)]
pub unsafe fn store_u64_block(dst: *mut u64, value: u64) {
    // SAFETY: per the caller's contract.
    unsafe { dst.write_volatile(value) }
}

/// Reads a byte the HCA writes (a CQE's `op_own`).
///
/// # Safety
/// `src` is valid for reads.
#[inline(always)]
pub unsafe fn load_u8_volatile(src: *const u8) -> u8 {
    // SAFETY: per the caller's contract; atomic, since the HCA writes it concurrently.
    unsafe { u8_at(src as *mut u8) }.load(Ordering::Relaxed)
}

/// Reads a byte the HCA writes, with acquire ordering.
///
/// # Safety
/// `src` is valid for reads.
#[inline(always)]
pub unsafe fn load_u8_acquire(src: *const u8) -> u8 {
    // SAFETY: per the caller's contract; atomic, since the HCA writes it concurrently.
    unsafe { u8_at(src as *mut u8) }.load(Ordering::Acquire)
}

/// Reads a word the HCA writes, with acquire ordering.
///
/// # Safety
/// `src` is valid for reads and 8-byte aligned.
#[inline(always)]
pub unsafe fn load_u64_acquire(src: *const u64) -> u64 {
    // SAFETY: per the caller's contract.
    unsafe { u64_at(src as *mut u64) }.load(Ordering::Acquire)
}

/// Reads a 4-byte word the device and HCA share (a doorbell-record word).
///
/// # Safety
/// `src` is valid for reads and 4-byte aligned.
#[inline(always)]
pub unsafe fn load_u32_volatile(src: *const u32) -> u32 {
    // SAFETY: per the caller's contract.
    unsafe { u32_at(src as *mut u32) }.load(Ordering::Relaxed)
}

/// Reads a word the HCA writes (CQE body, fetched atomic values).
///
/// # Safety
/// `src` is valid for reads and 8-byte aligned.
#[inline(always)]
pub unsafe fn load_u64_volatile(src: *const u64) -> u64 {
    // SAFETY: per the caller's contract.
    unsafe { u64_at(src as *mut u64) }.load(Ordering::Relaxed)
}

/// Reads two words the HCA writes (each atomically; on a GPU one 16-byte load).
///
/// # Safety
/// `src` is valid for reads of 16 bytes and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_u64x2_volatile(src: *const [u64; 2]) -> [u64; 2] {
    // SAFETY: per the caller's contract.
    unsafe { load_u64x2(src, Ordering::Relaxed) }
}

/// Both words at `src`, each loaded atomically with `order`.
///
/// # Safety
/// `src` is valid for reads of 16 bytes and 16-byte aligned.
#[inline(always)]
unsafe fn load_u64x2(src: *const [u64; 2], order: Ordering) -> [u64; 2] {
    let p = src as *mut u64;
    // SAFETY: per the caller's contract, both words are readable and aligned.
    unsafe { [u64_at(p).load(order), u64_at(p.add(1)).load(order)] }
}

/// Reads two words the HCA writes, each with acquire ordering (on a GPU one 16-byte acquire
/// load): later reads see what was written before them.
///
/// # Safety
/// `src` is valid for reads of 16 bytes and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_u64x2_acquire(src: *const [u64; 2]) -> [u64; 2] {
    // SAFETY: per the caller's contract.
    unsafe { load_u64x2(src, Ordering::Acquire) }
}

/// Monotonic nanoseconds since the first call in this process.
#[inline]
pub fn global_timer_ns() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64
}

/// Between polls: spin briefly, then yield the core (a 2-core machine runs posters, the HCA
/// model and proxies together).
#[inline]
pub fn backoff(round: u32) {
    // Under loom a waiter must yield every round, so the model scheduler runs the others.
    #[cfg(loom)]
    {
        let _ = round;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    if round < 64 {
        core::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// Every lane of a warp.
pub const FULL_WARP: u32 = u32::MAX;

// A CPU thread is a warp of one lane: the warp primitives below are that warp's, so code written
// for the GPU's warp runs unchanged. Groups of CPU threads (warp and block scope in CPU mode)
// are emulated by `crate::scope::Group`.

/// This thread's lane: 0.
#[inline(always)]
pub fn lane_id() -> u32 {
    0
}

/// The lanes executing together: lane 0.
#[inline(always)]
pub fn active_mask() -> u32 {
    1
}

/// Lane 0's vote, if lane 0 is in `mask`.
#[inline(always)]
pub fn ballot(mask: u32, pred: bool) -> u32 {
    pred as u32 & mask & 1
}

/// Lane 0 alone holds its own value, if lane 0 is in `mask`.
#[inline(always)]
pub fn match_any(mask: u32, _value: u64) -> u32 {
    mask & 1
}

/// `value`: lane 0 is the only source.
#[inline(always)]
pub fn shfl_idx(_mask: u32, value: u32, _src: u32) -> u32 {
    value
}

/// `value`: below lane `delta` a lane keeps its own.
#[inline(always)]
pub fn shfl_up(_mask: u32, value: u32, _delta: u32) -> u32 {
    value
}

/// Nothing to wait for.
#[inline(always)]
pub fn warp_sync(_mask: u32) {}
