//! The soft HCA's persistent copy kernel (see [`gdaki_layout::copy`]). Block 0's first thread
//! watches the host-pinned ring and mirrors each new descriptor into device memory, running
//! ahead of the others (so only one thread polls across PCIe, and the next descriptor is
//! fetched while the current one is copied). The other blocks serve descriptors in order,
//! moving each one's bytes together; the last to finish publishes its [`CopyDone`] with a
//! system-scope release.
//!
//! [`copy_share`] is compiled for the host too, where the tests run it with simulated threads.
#[cfg(target_arch = "nvptx64")]
use gdaki_layout::copy::{CopierState, CopyDesc, CopyDone};

/// Copies `count` units of `T` from `src` to `dst`: the share of thread `tid` of `n`.
///
/// # Safety
/// Both ranges are valid for `count` units of `T`, aligned for `T`, and not overlapping.
#[inline(always)]
unsafe fn units<T: Copy>(dst: u64, src: u64, count: u64, tid: u64, n: u64) {
    let (d, s) = (dst as *mut T, src as *const T);
    let mut i = tid;
    while i < count {
        // SAFETY: i < count, inside both ranges (caller's contract).
        unsafe { d.add(i as usize).write_volatile(s.add(i as usize).read_volatile()) };
        i += n;
    }
}

/// Thread `tid`'s share (of `n` threads) of copying `len` bytes from `src` to `dst`: 16-byte
/// units when both addresses and the length are multiples of 16, else 8, 4, or single bytes.
///
/// # Safety
/// `src..src + len` is readable and `dst..dst + len` writable by the caller, and they do not
/// overlap.
#[inline(always)]
pub unsafe fn copy_share(dst: u64, src: u64, len: u64, tid: u64, n: u64) {
    let a = dst | src | len;
    // SAFETY (all arms): the unit divides both addresses and the length, so `len / size` units
    // cover the ranges exactly, aligned.
    unsafe {
        if a % 16 == 0 {
            units::<[u64; 2]>(dst, src, len / 16, tid, n)
        } else if a % 8 == 0 {
            units::<u64>(dst, src, len / 8, tid, n)
        } else if a % 4 == 0 {
            units::<u32>(dst, src, len / 4, tid, n)
        } else {
            units::<u8>(dst, src, len, tid, n)
        }
    }
}

/// The smallest share of a copy worth a block of its own: smaller copies take fewer blocks (an
/// 8-byte copy, one), so the others skip the hand-off and the done count.
pub const MIN_BLOCK_SHARE: u64 = 16 << 10;

/// How many of `blocks` blocks move a `len`-byte copy (at least one).
#[inline(always)]
pub const fn participants(len: u64, blocks: u64) -> u64 {
    let want = len.div_ceil(MIN_BLOCK_SHARE);
    let n = if want < blocks { want } else { blocks };
    if n == 0 {
        1
    } else {
        n
    }
}

/// The byte range `[lo, hi)` of a `len`-byte copy that block `b` of `blocks` moves: equal
/// shares in multiples of 16 bytes, so aligned copies stay aligned in every share.
#[inline(always)]
pub const fn block_share(len: u64, b: u64, blocks: u64) -> (u64, u64) {
    let share = len.div_ceil(blocks).next_multiple_of(16);
    let lo = if b * share < len { b * share } else { len };
    let hi = if lo + share < len { lo + share } else { len };
    (lo, hi)
}

/// Where the kernel's device-memory working state lives (one allocation, zeroed per launch).
#[cfg(target_arch = "nvptx64")]
pub struct Work {
    /// The state block.
    pub state: *mut CopierState,
    /// Mirrored descriptors, one per ring slot.
    pub mirror: *mut CopyDesc,
    /// Blocks done with each slot's descriptor.
    pub finished: *mut u64,
    /// Each slot's atomic result.
    pub results: *mut u64,
}

#[cfg(target_arch = "nvptx64")]
mod gpu {
    use core::arch::asm;
    use core::arch::nvptx::{_block_dim_x, _block_idx_x, _grid_dim_x, _thread_idx_x};
    use core::ptr::{addr_of, addr_of_mut};

    use gdaki_layout::copy::{CopyDesc, CopyDone, OP_COMPARE_SWAP, OP_COPY, OP_FETCH_ADD, RING_SLOTS};

    use super::{block_share, copy_share, participants, Work};
    use crate::arch;

    #[inline(always)]
    unsafe fn ld_acquire_gpu(p: *const u64) -> u64 {
        let v: u64;
        // SAFETY: a valid aligned address (callers).
        unsafe { asm!("ld.acquire.gpu.u64 {v}, [{p}];", v = out(reg64) v, p = in(reg64) p, options(nostack)) }
        v
    }
    #[inline(always)]
    unsafe fn st_release_gpu(p: *mut u64, v: u64) {
        // SAFETY: as above.
        unsafe { asm!("st.release.gpu.u64 [{p}], {v};", p = in(reg64) p, v = in(reg64) v, options(nostack)) }
    }
    #[inline(always)]
    fn fence_gpu() {
        // SAFETY: a fence has no operands.
        unsafe { asm!("fence.acq_rel.gpu;", options(nostack)) }
    }
    #[inline(always)]
    unsafe fn st_release_sys(p: *mut u64, v: u64) {
        // SAFETY: as above.
        unsafe { asm!("st.release.sys.u64 [{p}], {v};", p = in(reg64) p, v = in(reg64) v, options(nostack)) }
    }
    #[inline(always)]
    unsafe fn add_acq_rel_gpu(p: *mut u64, v: u64) -> u64 {
        let o: u64;
        // SAFETY: as above.
        unsafe {
            asm!("atom.acq_rel.gpu.add.u64 {o}, [{p}], {v};", o = out(reg64) o, p = in(reg64) p, v = in(reg64) v,
                 options(nostack))
        }
        o
    }
    #[inline(always)]
    unsafe fn cas_gpu(p: *mut u64, compare: u64, swap: u64) -> u64 {
        let o: u64;
        // SAFETY: as above.
        unsafe {
            asm!("atom.acq_rel.gpu.cas.b64 {o}, [{p}], {c}, {s};", o = out(reg64) o, p = in(reg64) p,
                 c = in(reg64) compare, s = in(reg64) swap, options(nostack))
        }
        o
    }

    /// The kernel body: serves descriptors `first`, `first + 1`, ... until the host sets
    /// `*stop` while the ring is empty.
    ///
    /// # Safety
    /// `descs` and `dones` are host-pinned rings of `RING_SLOTS` entries mapped for this GPU,
    /// `stop` a host-pinned word, `work` zeroed device memory as [`Work`] describes; every
    /// descriptor names memory this GPU may access; every thread of the grid calls this.
    pub unsafe fn serve(descs: *const CopyDesc, dones: *mut CopyDone, stop: *const u32, work: &Work, first: u64) {
        let mask = RING_SLOTS as u64 - 1;
        // SAFETY: special registers are always readable.
        let (tid, b, nt, nb) = unsafe {
            (
                _thread_idx_x() as u64,
                _block_idx_x() as u64,
                _block_dim_x() as u64,
                _grid_dim_x() as u64,
            )
        };
        let head = unsafe { addr_of_mut!((*work.state).head) };
        let stopped = unsafe { addr_of_mut!((*work.state).stop) };
        if b == 0 {
            // Block 0's first thread only mirrors descriptors from the host ring into device
            // memory, running ahead of the copying blocks (the host posts at most a ring ahead
            // of the answers, so a slot is only overwritten once every block is done with it).
            if tid == 0 {
                // SAFETY: the rings and the state are valid per the contract.
                unsafe { mirror(descs, stop, work, first, head, stopped) };
            }
            return;
        }
        // The copying blocks: 1..nb, as workers 0..nw.
        let (w, nw) = (b - 1, nb - 1);
        let mut n = first;
        loop {
            let slot = (n & mask) as usize;
            if tid == 0 {
                let mut polls = 0u32;
                // SAFETY: the state is valid per the contract.
                while unsafe { ld_acquire_gpu(head) } < n && unsafe { ld_acquire_gpu(stopped) } == 0 {
                    polls = polls.wrapping_add(1);
                    arch::backoff(polls / 64);
                }
            }
            arch::block_sync();
            // SAFETY: as above. The descriptor was mirrored before `head` was released.
            if unsafe { ld_acquire_gpu(head) } < n {
                return; // asked to stop, nothing pending
            }
            // Small copies take few blocks; the others skip the descriptor. Only participants
            // count themselves done, so the host may reuse the slot while a non-participant
            // lags: it then finds another descriptor there, or one being written (the mirror's
            // seq is cleared first and set last, and read on both sides of the fields), and
            // was not needed for this one.
            let m = work.mirror.add(slot);
            let d = unsafe {
                let before = addr_of!((*m).seq).read_volatile();
                fence_gpu();
                let d = m.read_volatile();
                fence_gpu();
                CopyDesc {
                    seq: if addr_of!((*m).seq).read_volatile() == before {
                        before
                    } else {
                        0
                    },
                    ..d
                }
            };
            let parts = match (d.seq == n, d.op) {
                (false, _) => 0,
                (true, OP_COPY) => participants(d.len, nw),
                (true, _) => 1,
            };
            if w < parts {
                match d.op {
                    OP_COPY => {
                        let (lo, hi) = block_share(d.len, w, parts);
                        // SAFETY: the host names valid, non-overlapping ranges (contract).
                        unsafe { copy_share(d.dst + lo, d.src + lo, hi - lo, tid, nt) };
                    }
                    OP_FETCH_ADD if tid == 0 => unsafe {
                        let old = add_acq_rel_gpu(d.dst as *mut u64, d.arg0);
                        work.results.add(slot).write_volatile(old);
                    },
                    OP_COMPARE_SWAP if tid == 0 => unsafe {
                        let old = cas_gpu(d.dst as *mut u64, d.arg0, d.arg1);
                        work.results.add(slot).write_volatile(old);
                    },
                    _ => {}
                }
            }
            arch::block_sync();
            if tid == 0 && w < parts {
                // SAFETY: as above. The acq_rel chain on `finished` orders every participating
                // block's bytes before the last one's system-scope release of the answer.
                unsafe {
                    if add_acq_rel_gpu(work.finished.add(slot), 1) == parts - 1 {
                        work.finished.add(slot).write_volatile(0);
                        arch::to_device_barrier();
                        let done = dones.add(slot);
                        addr_of_mut!((*done).result).write_volatile(work.results.add(slot).read_volatile());
                        st_release_sys(addr_of_mut!((*done).seq), n);
                    }
                }
            }
            n += 1;
        }
    }

    /// Block 0's loop: waits for descriptor `n` in the host ring (or the stop word while the
    /// ring is empty), mirrors it and publishes `head = n`.
    ///
    /// # Safety
    /// As for [`serve`].
    unsafe fn mirror(
        descs: *const CopyDesc,
        stop: *const u32,
        work: &Work,
        first: u64,
        head: *mut u64,
        stopped: *mut u64,
    ) {
        let mask = RING_SLOTS as u64 - 1;
        let mut n = first;
        let mut polls = 0u32;
        loop {
            let slot = (n & mask) as usize;
            // SAFETY: per the contract.
            unsafe {
                let d = descs.add(slot);
                if arch::load_u64_volatile(addr_of!((*d).seq)) == n {
                    arch::from_device_barrier();
                    // A plain read after the acquire: its loads cross PCIe together (volatile
                    // ones would go one round trip at a time).
                    let desc = d.read();
                    // seq cleared first and set last: a lagging reader never takes a half
                    // written slot for its descriptor (see the copying loop).
                    let m = work.mirror.add(slot);
                    addr_of_mut!((*m).seq).write_volatile(0);
                    fence_gpu();
                    m.write_volatile(CopyDesc { seq: 0, ..desc });
                    fence_gpu();
                    addr_of_mut!((*m).seq).write_volatile(n);
                    st_release_gpu(head, n);
                    n += 1;
                    polls = 0;
                    continue;
                }
                if stop.read_volatile() != 0 {
                    st_release_gpu(stopped, 1);
                    return;
                }
            }
            polls = polls.wrapping_add(1);
            arch::backoff(polls / 64);
        }
    }
}
#[cfg(target_arch = "nvptx64")]
pub use gpu::serve;

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    #[test]
    fn every_alignment_and_thread_count_copies_exactly() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        for (off_d, off_s, len) in [(0, 0, 4096 - 64), (8, 8, 1000), (4, 4, 12), (1, 3, 777), (16, 0, 0)] {
            for n in [1u64, 3, 32, 256] {
                let mut dst = std::vec![0u8; 4096];
                for tid in 0..n {
                    // SAFETY: both ranges lie inside the vectors; they are distinct allocations.
                    unsafe {
                        copy_share(
                            dst.as_mut_ptr() as u64 + off_d,
                            src.as_ptr() as u64 + off_s,
                            len,
                            tid,
                            n,
                        )
                    };
                }
                let (d, s) = (off_d as usize, off_s as usize);
                assert_eq!(
                    &dst[d..d + len as usize],
                    &src[s..s + len as usize],
                    "{off_d} {off_s} {len} {n}"
                );
                assert!(dst[..d].iter().chain(&dst[d + len as usize..]).all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn small_copies_take_few_blocks() {
        assert_eq!(participants(0, 33), 1);
        assert_eq!(participants(8, 33), 1);
        assert_eq!(participants(MIN_BLOCK_SHARE, 33), 1);
        assert_eq!(participants(MIN_BLOCK_SHARE + 1, 33), 2);
        assert_eq!(participants(1 << 20, 33), 33);
        assert_eq!(participants(1 << 20, 8), 8);
    }

    #[test]
    fn block_shares_tile_the_copy_in_16_byte_multiples() {
        for len in [0u64, 1, 15, 16, 17, 1000, 1 << 20, (1 << 20) + 3] {
            for blocks in [1u64, 2, 7, 33, 132] {
                let mut next = 0;
                for b in 0..blocks {
                    let (lo, hi) = block_share(len, b, blocks);
                    assert_eq!(lo, next, "{len} {blocks} {b}");
                    assert!(lo <= hi && hi <= len);
                    assert!(lo % 16 == 0 || lo == len);
                    next = hi;
                }
                assert_eq!(next, len);
            }
        }
    }
}
