//! Cache-line prefetches for the engine's hot rings. Every message the engine serves touches
//! lines another agent wrote or read last: the send WQE the poster wrote, the receive WQE the
//! receiver's core wrote, the CQE slot the poller read a lap ago. Asking for them a few entries
//! ahead takes those misses off the message's path. A prefetch is a hint: it never faults and
//! changes no value, so a line that is still being written ahead simply moves twice.

/// Whether the CPU has `PREFETCHW` (CPUID 8000_0001h ECX bit 8, PRFCHW / 3DNowPrefetch), asked
/// once.
#[cfg(target_arch = "x86_64")]
fn has_prefetchw() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        // Leaf 8000_0000h says which extended leaves exist.
        let max = std::arch::x86_64::__cpuid(0x8000_0000).eax;
        max >= 0x8000_0001 && std::arch::x86_64::__cpuid(0x8000_0001).ecx & (1 << 8) != 0
    })
}

/// Brings the line at `addr` into this core's cache, owned, ahead of a write: another core that
/// holds it gives it up now rather than when the write comes.
#[inline]
pub(crate) fn for_write(addr: u64) {
    #[cfg(target_arch = "x86_64")]
    if has_prefetchw() {
        // SAFETY: a prefetch reads nothing into registers and never faults, whatever `addr` is.
        unsafe { std::arch::asm!("prefetchw [{a}]", a = in(reg) addr, options(nostack, preserves_flags, readonly)) };
    } else {
        for_read(addr);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

/// Brings the line at `addr` into this core's cache ahead of a read.
#[inline]
pub(crate) fn for_read(addr: u64) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever `addr` is (SSE is part of x86-64).
    #[allow(unused_unsafe)]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefetch is only a hint: addresses that map nothing (a NULL page, the top of the
    /// address space) must not fault, as a load there would.
    #[test]
    fn prefetching_unmapped_addresses_does_not_fault() {
        for addr in [0, 64, !63, 0x7fff_ffff_ffc0] {
            for_write(addr);
            for_read(addr);
        }
    }
}
