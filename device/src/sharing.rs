//! Sharing modes: how many posters share a QP, and so which atomics its counters need.
//! [`Exclusive`]: one thread (plain loads and stores; block scope on a GPU); [`Cta`]: threads of one block
//! (block-scope atomics); [`Gpu`]: threads of any block (device-scope atomics). On the host all
//! three use std atomics; `Exclusive` avoids read-modify-writes there too.

/// Atomics on the QP's hot counters at the mode's scope. Implemented by the three mode types.
///
/// # Safety
/// Every function takes a raw pointer into a live, exported `DevQp` that is only accessed
/// through this crate; implementors must give the orderings documented per function.
pub unsafe trait Sharing {
    /// Whether more than one thread may post concurrently.
    const SHARED: bool;
    /// Mode name.
    const NAME: &'static str;
    /// `*p += v`, relaxed; returns the old value.
    ///
    /// # Safety
    /// `p` points to the named counter (or lock) of a live `DevQp`, suitably aligned.
    unsafe fn fetch_add(p: *mut u64, v: u64) -> u64;
    /// Load with acquire order.
    ///
    /// # Safety
    /// `p` points to the named counter (or lock) of a live `DevQp`, suitably aligned.
    unsafe fn load_acquire(p: *const u64) -> u64;
    /// Store with release order.
    ///
    /// # Safety
    /// `p` points to the named counter (or lock) of a live `DevQp`, suitably aligned.
    unsafe fn store_release(p: *mut u64, v: u64);
    /// `*p = max(*p, v)` with acquire-release order; returns the old value.
    ///
    /// # Safety
    /// `p` points to the named counter (or lock) of a live `DevQp`, suitably aligned.
    unsafe fn fetch_max(p: *mut u64, v: u64) -> u64;
    /// Tries to take a spin lock (0 → 1) with acquire order.
    ///
    /// # Safety
    /// `p` points to the named counter (or lock) of a live `DevQp`, suitably aligned.
    unsafe fn try_lock(p: *mut u32) -> bool;
    /// Releases the lock with release order.
    ///
    /// # Safety
    /// `p` points to the named counter (or lock) of a live `DevQp`, suitably aligned.
    unsafe fn unlock(p: *mut u32);
}

/// One thread owns the QP.
#[derive(Clone, Copy, Default)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct Exclusive;
/// Threads of one block share the QP.
#[derive(Clone, Copy, Default)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct Cta;
/// Threads of any block share the QP.
#[derive(Clone, Copy, Default)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct Gpu;

#[cfg(not(target_arch = "nvptx64"))]
mod imp {
    use core::sync::atomic::Ordering::*;

    use super::*;
    use crate::arch::cells::{u32_at, u64_at};

    macro_rules! shared_host {
        ($t:ty, $name:literal) => {
            // SAFETY: std atomics give (at least) the documented orderings.
            unsafe impl Sharing for $t {
                const SHARED: bool = true;
                const NAME: &'static str = $name;
                #[inline(always)]
                unsafe fn fetch_add(p: *mut u64, v: u64) -> u64 {
                    // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
                    unsafe { u64_at(p) }.fetch_add(v, Relaxed)
                }
                #[inline(always)]
                unsafe fn load_acquire(p: *const u64) -> u64 {
                    // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
                    unsafe { u64_at(p as *mut u64) }.load(Acquire)
                }
                #[inline(always)]
                unsafe fn store_release(p: *mut u64, v: u64) {
                    // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
                    unsafe { u64_at(p) }.store(v, Release)
                }
                #[inline(always)]
                unsafe fn fetch_max(p: *mut u64, v: u64) -> u64 {
                    // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
                    unsafe { u64_at(p) }.fetch_max(v, AcqRel)
                }
                #[inline(always)]
                unsafe fn try_lock(p: *mut u32) -> bool {
                    // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
                    unsafe { u32_at(p) }
                        .compare_exchange(0, 1, Acquire, Relaxed)
                        .is_ok()
                }
                #[inline(always)]
                unsafe fn unlock(p: *mut u32) {
                    // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
                    unsafe { u32_at(p) }.store(0, Release)
                }
            }
        };
    }
    shared_host!(Cta, "cta");
    shared_host!(Gpu, "gpu");

    // SAFETY: one thread owns the QP, so plain (relaxed atomic) loads and stores suffice;
    // release/acquire still order the ring against the consumer thread.
    unsafe impl Sharing for Exclusive {
        const SHARED: bool = false;
        const NAME: &'static str = "exclusive";
        #[inline(always)]
        unsafe fn fetch_add(p: *mut u64, v: u64) -> u64 {
            // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
            let a = unsafe { u64_at(p) };
            let old = a.load(Relaxed);
            a.store(old + v, Relaxed);
            old
        }
        #[inline(always)]
        unsafe fn load_acquire(p: *const u64) -> u64 {
            // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
            unsafe { u64_at(p as *mut u64) }.load(Acquire)
        }
        #[inline(always)]
        unsafe fn store_release(p: *mut u64, v: u64) {
            // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
            unsafe { u64_at(p) }.store(v, Release)
        }
        #[inline(always)]
        unsafe fn fetch_max(p: *mut u64, v: u64) -> u64 {
            // SAFETY: `p` is valid and aligned for this access (the trait method's contract).
            let a = unsafe { u64_at(p) };
            let old = a.load(Relaxed);
            if v > old {
                a.store(v, Release);
            }
            old
        }
        #[inline(always)]
        unsafe fn try_lock(_p: *mut u32) -> bool {
            true
        }
        #[inline(always)]
        unsafe fn unlock(_p: *mut u32) {}
    }
}

#[cfg(target_arch = "nvptx64")]
mod imp {
    use core::arch::asm;

    use super::*;

    macro_rules! shared_ptx {
        ($t:ty, $name:literal, $scope:literal) => {
            // SAFETY: each instruction carries the documented order at the mode's scope.
            unsafe impl Sharing for $t {
                const SHARED: bool = true;
                const NAME: &'static str = $name;
                #[inline(always)]
                unsafe fn fetch_add(p: *mut u64, v: u64) -> u64 {
                    let o: u64;
                    // SAFETY: `p` is valid and 8-byte aligned for this scope's agents (the trait's contract).
                    unsafe { asm!(concat!("atom.relaxed.", $scope, ".add.u64 {o}, [{p}], {v};"), o = out(reg64) o, p = in(reg64) p, v = in(reg64) v, options(nostack)) }
                    o
                }
                #[inline(always)]
                unsafe fn load_acquire(p: *const u64) -> u64 {
                    let o: u64;
                    // SAFETY: as above.
                    unsafe { asm!(concat!("ld.acquire.", $scope, ".u64 {o}, [{p}];"), o = out(reg64) o, p = in(reg64) p, options(nostack)) }
                    o
                }
                #[inline(always)]
                unsafe fn store_release(p: *mut u64, v: u64) {
                    // SAFETY: as above.
                    unsafe { asm!(concat!("st.release.", $scope, ".u64 [{p}], {v};"), p = in(reg64) p, v = in(reg64) v, options(nostack)) }
                }
                #[inline(always)]
                unsafe fn fetch_max(p: *mut u64, v: u64) -> u64 {
                    let o: u64;
                    // SAFETY: as above.
                    unsafe { asm!(concat!("atom.acq_rel.", $scope, ".max.u64 {o}, [{p}], {v};"), o = out(reg64) o, p = in(reg64) p, v = in(reg64) v, options(nostack)) }
                    o
                }
                #[inline(always)]
                unsafe fn try_lock(p: *mut u32) -> bool {
                    let held: u32;
                    // Test before test-and-set: a poster that finds the lock held goes back to
                    // watching `sq_rung` with a load, instead of sending a compare-and-swap to
                    // L2 that must fail (failing here is what a failed CAS would have said).
                    // SAFETY: `p` is a valid, 4-byte aligned lock word (the trait's contract).
                    unsafe { asm!(concat!("ld.relaxed.", $scope, ".u32 {o}, [{p}];"), o = out(reg32) held, p = in(reg64) p, options(nostack)) }
                    if held != 0 {
                        return false;
                    }
                    let o: u32;
                    // SAFETY: as above.
                    unsafe { asm!(concat!("atom.acquire.", $scope, ".cas.b32 {o}, [{p}], 0, 1;"), o = out(reg32) o, p = in(reg64) p, options(nostack)) }
                    o == 0
                }
                #[inline(always)]
                unsafe fn unlock(p: *mut u32) {
                    // SAFETY: as above.
                    unsafe { asm!(concat!("st.release.", $scope, ".u32 [{p}], 0;"), p = in(reg64) p, options(nostack)) }
                }
            }
        };
    }
    shared_ptx!(Cta, "cta", "cta");
    shared_ptx!(Gpu, "gpu", "gpu");

    // SAFETY: one thread owns the QP (or a group that hands it on through its barriers, as a
    // socket's leader to its ringer): block-scope loads and stores, which the SM's L1 serves
    // after the owner's own store (a volatile access went to L2 on every post, a dependent round
    // trip on a post's path); the release/acquire pairs that matter (ring against HCA) are made
    // by the arch barriers, and they write through to L2 for the host's diagnostics.
    unsafe impl Sharing for Exclusive {
        const SHARED: bool = false;
        const NAME: &'static str = "exclusive";
        #[inline(always)]
        unsafe fn fetch_add(p: *mut u64, v: u64) -> u64 {
            // SAFETY: one thread owns the QP, and `p` is valid and aligned (the trait's contract).
            let old = unsafe { crate::arch::load_u64_block(p) };
            // SAFETY: as above.
            unsafe { crate::arch::store_u64_block(p, old + v) };
            old
        }
        #[inline(always)]
        unsafe fn load_acquire(p: *const u64) -> u64 {
            // SAFETY: as above.
            unsafe { crate::arch::load_u64_block(p) }
        }
        #[inline(always)]
        unsafe fn store_release(p: *mut u64, v: u64) {
            // SAFETY: as above.
            unsafe { crate::arch::store_u64_block(p, v) }
        }
        #[inline(always)]
        unsafe fn fetch_max(p: *mut u64, v: u64) -> u64 {
            // SAFETY: as above.
            let old = unsafe { crate::arch::load_u64_block(p) };
            if v > old {
                // SAFETY: as above.
                unsafe { crate::arch::store_u64_block(p, v) };
            }
            old
        }
        #[inline(always)]
        unsafe fn try_lock(_p: *mut u32) -> bool {
            true
        }
        #[inline(always)]
        unsafe fn unlock(_p: *mut u32) {}
    }
}
