//! NVIDIA GPUs (sm_90, PTX ISA 8.4): inline PTX. Scopes: `.sys` for anything the HCA or the
//! CPU observes.
use core::arch::asm;

/// Earlier writes are visible to the HCA before later stores (`fence.acq_rel.sys`).
#[inline(always)]
pub fn to_device_barrier() {
    // SAFETY: a fence has no operands and no memory effect other than ordering.
    unsafe { asm!("fence.acq_rel.sys;", options(nostack)) }
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

/// Stores a doorbell-record word (`st.release.sys`).
///
/// # Safety
/// `dst` is a valid, 4-byte aligned address.
#[inline(always)]
pub unsafe fn store_dbrec(dst: *mut u32, value: u32) {
    // SAFETY: per the caller's contract.
    unsafe { asm!("st.release.sys.b32 [{p}], {v};", p = in(reg64) dst, v = in(reg32) value, options(nostack)) }
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
