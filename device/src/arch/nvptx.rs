//! NVIDIA GPUs (sm_90, PTX ISA 8.6; 8.4 builds too): inline PTX. Scopes: `.sys` for anything the
//! HCA or the CPU observes.
use core::arch::asm;

/// Earlier writes are visible to the HCA before later stores: a system-scope release fence,
/// which LLVM writes as `fence.release.sys` for PTX ISA 8.6 and newer and as
/// `fence.acq_rel.sys` before it. The acquire half is what a doorbell does not need and what
/// costs: ptxas follows it with an invalidation of the SM's whole L1 (`CCTL.IVALL`), so every
/// warp of the SM reloads from L2 after each doorbell (docs/figures.md, "A release fence before
/// the doorbell").
#[inline(always)]
pub fn to_device_barrier() {
    core::sync::atomic::fence(core::sync::atomic::Ordering::Release);
}

/// [`to_device_barrier`] for an HCA that reads this GPU's own memory (rings in GPU memory, read
/// peer-to-peer): `fence.acq_rel.gpu`, as NVSHMEM's IBGDA and DOCA fence such rings.
#[inline(always)]
pub fn to_device_barrier_gpu() {
    // SAFETY: as above.
    unsafe { asm!("fence.acq_rel.gpu;", options(nostack)) }
}

/// Later reads see what the HCA wrote before the flag just read (`fence.acq_rel.sys`).
#[inline(always)]
pub fn from_device_barrier() {
    // SAFETY: as above.
    unsafe { asm!("fence.acq_rel.sys;", options(nostack)) }
}

/// Stores one 16-byte WQE segment with one vector store.
///
/// # Safety
/// `dst` is a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn store_seg(dst: *mut u64, words: [u64; 2]) {
    // SAFETY: per the caller's contract.
    unsafe {
        asm!("st.v2.b64 [{p}], {{{a}, {b}}};", p = in(reg64) dst, a = in(reg64) words[0], b = in(reg64) words[1], options(nostack))
    }
}

/// The doorbell: an 8-byte MMIO store to the UAR (`st.mmio.relaxed.sys`).
///
/// # Safety
/// `dst` is the GPU mapping of a doorbell register or word.
#[inline(always)]
pub unsafe fn mmio_store(dst: *mut u64, value: u64) {
    // SAFETY: per the caller's contract.
    unsafe {
        asm!("st.mmio.relaxed.sys.global.b64 [{p}], {v};", p = in(reg64) dst, v = in(reg64) value, options(nostack))
    }
}

/// Stores a send doorbell-record word, relaxed, at system scope or (`gpu`: the record is in
/// this GPU's memory) GPU scope: [`crate::Qp::ring`] orders it with its fences.
///
/// # Safety
/// `dst` is a valid, 4-byte aligned address.
#[inline(always)]
pub unsafe fn store_dbrec(dst: *mut u32, value: u32, gpu: bool) {
    // SAFETY: per the caller's contract.
    unsafe {
        if gpu {
            asm!("st.relaxed.gpu.b32 [{p}], {v};", p = in(reg64) dst, v = in(reg32) value, options(nostack))
        } else {
            asm!("st.relaxed.sys.b32 [{p}], {v};", p = in(reg64) dst, v = in(reg32) value, options(nostack))
        }
    }
}

/// Stores a CQ doorbell-record word: the consumer index the HCA may overwrite CQEs below.
///
/// `after_reads`: the caller read a CQE's body after its tail, and those loads must return
/// before the HCA may reuse the slot: `st.release.gpu` (a GPU-scope fence waits for the
/// thread's loads; DOCA's choice for its CQ records). Otherwise `st.relaxed.sys`: the tail
/// was an acquire load (`Cq::peek`), or the store waits on its value through a branch
/// (`Cq::peek_relaxed`). A system-scope release here (a MEMBAR.SYS, which also waits for the
/// thread's earlier system-scope stores) cost a SEND ping-pong about a microsecond a round trip.
///
/// # Safety
/// `dst` is a valid, 4-byte aligned address.
#[inline(always)]
pub unsafe fn store_cq_dbrec(dst: *mut u32, value: u32, after_reads: bool) {
    // SAFETY: per the caller's contract.
    unsafe {
        if after_reads {
            asm!("st.release.gpu.b32 [{p}], {v};", p = in(reg64) dst, v = in(reg32) value, options(nostack))
        } else {
            asm!("st.relaxed.sys.b32 [{p}], {v};", p = in(reg64) dst, v = in(reg32) value, options(nostack))
        }
    }
}

/// Compare-and-swap on a doorbell-record word; returns the previous value.
///
/// # Safety
/// `dst` is a valid, 4-byte aligned address.
#[inline(always)]
pub unsafe fn cas_dbrec(dst: *mut u32, current: u32, new: u32) -> u32 {
    let old: u32;
    // SAFETY: per the caller's contract.
    unsafe {
        asm!("atom.acq_rel.sys.cas.b32 {o}, [{p}], {c}, {n};", o = out(reg32) old, p = in(reg64) dst,
             c = in(reg32) current, n = in(reg32) new, options(nostack))
    }
    old
}

/// Raises a host-visible u64 (`atom.release.sys.max.u64`); returns the old value.
///
/// # Safety
/// `dst` is a valid, 8-byte aligned address.
#[inline(always)]
pub unsafe fn fetch_max_sys(dst: *mut u64, value: u64) -> u64 {
    let old: u64;
    // SAFETY: per the caller's contract.
    unsafe {
        asm!("atom.release.sys.max.u64 {o}, [{p}], {v};", o = out(reg64) old, p = in(reg64) dst, v = in(reg64) value,
             options(nostack))
    }
    old
}

/// Stores a host-visible u64 (`st.relaxed.sys`): a posted write, where an atomic is a round
/// trip.
///
/// # Safety
/// `dst` is a valid, 8-byte aligned address.
#[inline(always)]
pub unsafe fn store_sys(dst: *mut u64, value: u64) {
    // SAFETY: per the caller's contract.
    unsafe { asm!("st.relaxed.sys.u64 [{p}], {v};", p = in(reg64) dst, v = in(reg64) value, options(nostack)) }
}

/// Reads a word that only the calling block's threads touch while it runs (`ld.relaxed.cta`):
/// served from the SM's L1 where the block last wrote it, where a volatile load is a
/// system-scope access that goes to L2 on every call (a dependent round trip on a call's path).
/// The block's barriers order it against the other members' [`store_u64_block`]s; a next
/// owner in another block synchronises first (at GPU scope, whose acquire empties L1).
///
/// # Safety
/// `src` is valid for reads and 8-byte aligned.
#[inline(always)]
pub unsafe fn load_u64_block(src: *const u64) -> u64 {
    let v: u64;
    // SAFETY: per the caller's contract.
    unsafe { asm!("ld.relaxed.cta.u64 {v}, [{p}];", v = out(reg64) v, p = in(reg64) src, options(nostack)) }
    v
}

/// Stores a word that only the calling block's threads touch while it runs (`st.relaxed.cta`;
/// see [`load_u64_block`]). It still writes through to L2, where the host's diagnostics and
/// the kernel's next launch read it.
///
/// # Safety
/// `dst` is valid for writes and 8-byte aligned.
#[inline(always)]
pub unsafe fn store_u64_block(dst: *mut u64, value: u64) {
    // SAFETY: per the caller's contract.
    unsafe { asm!("st.relaxed.cta.u64 [{p}], {v};", p = in(reg64) dst, v = in(reg64) value, options(nostack)) }
}

/// Reads a byte the HCA writes (`ld.relaxed.sys`).
///
/// # Safety
/// `src` is valid for reads.
#[inline(always)]
pub unsafe fn load_u8_volatile(src: *const u8) -> u8 {
    let v: u16;
    // SAFETY: per the caller's contract.
    unsafe { asm!("ld.relaxed.sys.u8 {v}, [{p}];", v = out(reg16) v, p = in(reg64) src, options(nostack, readonly)) }
    v as u8
}

/// Reads a byte the HCA writes with acquire semantics (`ld.acquire.sys`): what the thread reads
/// after it is ordered after it, with no fence (a poll's success needs nothing more). The
/// acquire loads are not `readonly` asm, so the compiler does not move later reads above them
/// either.
///
/// # Safety
/// `src` is valid for reads.
#[inline(always)]
pub unsafe fn load_u8_acquire(src: *const u8) -> u8 {
    let v: u16;
    // SAFETY: per the caller's contract.
    unsafe { asm!("ld.acquire.sys.u8 {v}, [{p}];", v = out(reg16) v, p = in(reg64) src, options(nostack)) }
    v as u8
}

/// Reads a word the HCA writes with acquire semantics (`ld.acquire.sys`).
///
/// # Safety
/// `src` is valid for reads and 8-byte aligned.
#[inline(always)]
pub unsafe fn load_u64_acquire(src: *const u64) -> u64 {
    let v: u64;
    // SAFETY: per the caller's contract.
    unsafe { asm!("ld.acquire.sys.u64 {v}, [{p}];", v = out(reg64) v, p = in(reg64) src, options(nostack)) }
    v
}

/// Reads a 4-byte word the device and HCA share (`ld.relaxed.sys`).
///
/// # Safety
/// `src` is valid for reads and 4-byte aligned.
#[inline(always)]
pub unsafe fn load_u32_volatile(src: *const u32) -> u32 {
    let v: u32;
    // SAFETY: per the caller's contract.
    unsafe { asm!("ld.relaxed.sys.u32 {v}, [{p}];", v = out(reg32) v, p = in(reg64) src, options(nostack, readonly)) }
    v
}

/// Reads a word the HCA writes (`ld.relaxed.sys`).
///
/// # Safety
/// `src` is valid for reads and 8-byte aligned.
#[inline(always)]
pub unsafe fn load_u64_volatile(src: *const u64) -> u64 {
    let v: u64;
    // SAFETY: per the caller's contract.
    unsafe { asm!("ld.relaxed.sys.u64 {v}, [{p}];", v = out(reg64) v, p = in(reg64) src, options(nostack, readonly)) }
    v
}

/// Reads two words the HCA writes in one 16-byte load (`ld.relaxed.sys.v2`): one memory
/// transaction, one PCIe read where the words are host memory.
///
/// # Safety
/// `src` is valid for reads of 16 bytes and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_u64x2_volatile(src: *const [u64; 2]) -> [u64; 2] {
    let (a, b): (u64, u64);
    // SAFETY: per the caller's contract.
    unsafe {
        asm!("ld.relaxed.sys.v2.u64 {{{a}, {b}}}, [{p}];", a = out(reg64) a, b = out(reg64) b, p = in(reg64) src,
             options(nostack, readonly))
    }
    [a, b]
}

/// [`load_u64x2_volatile`] with acquire semantics (`ld.acquire.sys.v2`): one 16-byte load after
/// which the thread's later reads see what was written before the words it read.
///
/// # Safety
/// `src` is valid for reads of 16 bytes and 16-byte aligned.
#[inline(always)]
pub unsafe fn load_u64x2_acquire(src: *const [u64; 2]) -> [u64; 2] {
    let (a, b): (u64, u64);
    // SAFETY: per the caller's contract.
    unsafe {
        asm!("ld.acquire.sys.v2.u64 {{{a}, {b}}}, [{p}];", a = out(reg64) a, b = out(reg64) b, p = in(reg64) src,
             options(nostack))
    }
    [a, b]
}

/// Nanoseconds of the GPU's global timer.
#[inline(always)]
pub fn global_timer_ns() -> u64 {
    let t: u64;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u64 {t}, %globaltimer;", t = out(reg64) t, options(nostack, nomem)) }
    t
}

/// Between polls: sleep a little, more as rounds go by (bounded at ~1 us), to leave the
/// memory system to the HCA and other warps.
#[inline(always)]
pub fn backoff(round: u32) {
    let ns = if round < 8 { 0 } else { (round.min(64) * 16) as u32 };
    if ns > 0 {
        // SAFETY: nanosleep only suspends the thread.
        unsafe { asm!("nanosleep.u32 {n};", n = in(reg32) ns, options(nostack, nomem)) }
    }
}

// Warp and block primitives go through LLVM's NVVM intrinsics rather than inline PTX: the
// intrinsics are marked convergent, so the optimiser never moves them into divergent code.
#[allow(improper_ctypes)]
extern "C" {
    #[link_name = "llvm.nvvm.read.ptx.sreg.laneid"]
    fn nvvm_laneid() -> i32;
    #[link_name = "llvm.nvvm.activemask"]
    fn nvvm_activemask() -> i32;
    #[link_name = "llvm.nvvm.vote.ballot.sync"]
    fn nvvm_ballot(mask: i32, pred: bool) -> i32;
    #[link_name = "llvm.nvvm.match.any.sync.i64"]
    fn nvvm_match_any_i64(mask: i32, value: i64) -> i32;
    #[link_name = "llvm.nvvm.shfl.sync.idx.i32"]
    fn nvvm_shfl_idx(mask: i32, value: i32, lane: i32, clamp: i32) -> i32;
    #[link_name = "llvm.nvvm.shfl.sync.up.i32"]
    fn nvvm_shfl_up(mask: i32, value: i32, delta: i32, clamp: i32) -> i32;
    #[link_name = "llvm.nvvm.bar.warp.sync"]
    fn nvvm_bar_warp_sync(mask: i32);
    #[link_name = "llvm.nvvm.barrier.cta.sync.all"]
    fn nvvm_barrier_cta_sync_all(id: i32);
}

/// Every lane of a warp.
pub const FULL_WARP: u32 = u32::MAX;

/// This thread's lane in its warp (`%laneid`).
#[inline(always)]
pub fn lane_id() -> u32 {
    // SAFETY: reads a special register.
    unsafe { nvvm_laneid() as u32 }
}

/// The lanes of this warp executing this instruction together (`activemask`).
#[inline(always)]
pub fn active_mask() -> u32 {
    // SAFETY: no operands.
    unsafe { nvvm_activemask() as u32 }
}

/// One bit per lane of `mask` whose `pred` is true (`vote.sync.ballot`). Every lane in `mask`
/// must call it together.
#[inline(always)]
pub fn ballot(mask: u32, pred: bool) -> u32 {
    // SAFETY: the caller's lanes in `mask` converge here, per the contract.
    unsafe { nvvm_ballot(mask as i32, pred) as u32 }
}

/// The lanes of `mask` whose `value` equals the caller's (`match.any.sync.b64`). Every lane in
/// `mask` must call it together.
#[inline(always)]
pub fn match_any(mask: u32, value: u64) -> u32 {
    // SAFETY: as for `ballot`.
    unsafe { nvvm_match_any_i64(mask as i32, value as i64) as u32 }
}

/// `value` of lane `src` (`shfl.sync.idx`). Every lane in `mask` must call it together.
#[inline(always)]
pub fn shfl_idx(mask: u32, value: u32, src: u32) -> u32 {
    // SAFETY: as for `ballot`; clamp 0x1f keeps the whole warp one segment.
    unsafe { nvvm_shfl_idx(mask as i32, value as i32, src as i32, 0x1f) as u32 }
}

/// `value` of lane `lane_id() - delta`, or the caller's own below lane `delta`
/// (`shfl.sync.up`). Every lane in `mask` must call it together.
#[inline(always)]
pub fn shfl_up(mask: u32, value: u32, delta: u32) -> u32 {
    // SAFETY: as for `ballot`.
    unsafe { nvvm_shfl_up(mask as i32, value as i32, delta as i32, 0) as u32 }
}

/// Warp barrier with memory ordering among the lanes of `mask` (`bar.warp.sync`).
#[inline(always)]
pub fn warp_sync(mask: u32) {
    // SAFETY: as for `ballot`.
    unsafe { nvvm_bar_warp_sync(mask as i32) }
}

/// Block barrier with memory ordering among the block's threads (`barrier.sync 0`). Every
/// thread of the block must reach it, but not in step: the *non-aligned* form, because a group
/// leader arrives late from its own work (polling, reserving) while the rest of its warp already
/// waits. `__syncthreads` (`bar.sync`, which is `barrier.sync.aligned`) requires every thread of
/// a warp to execute the same barrier instruction together; a warp that arrives split deadlocks
/// the block or releases it early.
#[inline(always)]
pub fn block_sync() {
    // SAFETY: every thread of the block calls this, per the contract.
    unsafe { nvvm_barrier_cta_sync_all(0) }
}

/// This thread's linear index in its block (x fastest).
#[inline(always)]
pub fn block_thread_rank() -> u32 {
    use core::arch::nvptx::*;
    // SAFETY: special registers.
    unsafe {
        (_thread_idx_z() as u32 * _block_dim_y() as u32 + _thread_idx_y() as u32) * _block_dim_x() as u32
            + _thread_idx_x() as u32
    }
}

/// Threads in this block.
#[inline(always)]
pub fn block_size() -> u32 {
    use core::arch::nvptx::*;
    // SAFETY: special registers.
    unsafe { _block_dim_x() as u32 * _block_dim_y() as u32 * _block_dim_z() as u32 }
}
