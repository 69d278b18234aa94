//! Execution scopes: which threads call an operation together.
//!
//! - [`Thread`]: each thread posts for itself.
//! - [`Warp`]: the 32 lanes of a warp call together; each lane brings its own operation (its own
//!   buffers and lengths) and the warp posts them with one reservation and one doorbell.
//! - [`Block`]: the same for every thread of a block.
//!
//! In group scope, lane or thread 0 (the leader) does every change to the QP's shared state
//! (reserve, mark ready, submit, poll), and the members only write WQEs into the slots the
//! leader reserved. So a group is one poster as far as the sharing mode is concerned:
//! [`Exclusive`](crate::Exclusive) is valid for a warp or block that owns a QP.
//!
//! Every member must make the same sequence of high-level calls (the calls are collectives);
//! a member with nothing to post still calls (for example with a zero-length put, which posts a
//! NOP, or by calling `quiet`). The low-level functions stay per thread in every scope.
//!
//! On the GPU the collectives are warp shuffles and block barriers. On the host, a [`Group`]
//! of CPU threads plays a warp or a block with a barrier and shared slots, so CPU mode and the
//! tests run the same group code.

/// A group of threads that posts together.
///
/// # Safety
/// All members of one group calling [`scan`](Self::scan) or a broadcast together must get
/// consistent results (disjoint prefix ranges that sum to the total; the leader's value), and
/// ranks must be distinct, `0..size`: the QP lets members write the slots
/// these results assign to them.
pub unsafe trait Scope: Copy {
    /// Scope name (`thread`, `warp`, `block`).
    const NAME: &'static str;
    /// A group of one ([`Thread`]): collectives are no-ops and can be skipped.
    const SOLO: bool = false;
    /// This member's rank, `0..size()`; rank 0 leads.
    fn rank(&self) -> u32;
    /// Members in the group.
    fn size(&self) -> u32;
    /// Whether this member leads.
    #[inline(always)]
    fn is_leader(&self) -> bool {
        self.rank() == 0
    }
    /// Barrier: every member's memory writes before it are visible to every member after it.
    fn sync(&self);
    /// Exclusive prefix sum of `value` over ranks, and the group's total.
    fn scan(&self, value: u64) -> (u64, u64);
    /// The leader's `value`, for every member.
    fn broadcast(&self, value: [u64; 2]) -> [u64; 2];
    /// [`broadcast`](Self::broadcast) where the group has just met ([`sync`](Self::sync))
    /// and meets again before the leader's next call of this: the member that reads last
    /// has then always read before the leader writes again, so a block needs one barrier for
    /// it, not two. Every member calls it right after the same `sync`.
    #[inline(always)]
    fn broadcast_met(&self, value: [u64; 2]) -> [u64; 2] {
        self.broadcast(value)
    }
    /// The leader's one word, for every member: what a successful step hands on, for half
    /// the collective work of [`broadcast`](Self::broadcast) in a warp.
    #[inline(always)]
    fn broadcast_word(&self, value: u64) -> u64 {
        self.broadcast([value, 0])[0]
    }
    /// The leader's `flag`, for every member (one vote in a warp): whether its step failed.
    #[inline(always)]
    fn broadcast_flag(&self, flag: bool) -> bool {
        self.broadcast([flag as u64, 0])[0] != 0
    }
}

/// One thread on its own.
#[derive(Clone, Copy, Default)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct Thread;

// SAFETY: a group of one: rank 0, the whole range, its own value.
unsafe impl Scope for Thread {
    const NAME: &'static str = "thread";
    const SOLO: bool = true;
    #[inline(always)]
    fn rank(&self) -> u32 {
        0
    }
    #[inline(always)]
    fn size(&self) -> u32 {
        1
    }
    #[inline(always)]
    fn sync(&self) {}
    #[inline(always)]
    fn scan(&self, value: u64) -> (u64, u64) {
        (0, value)
    }
    #[inline(always)]
    fn broadcast(&self, value: [u64; 2]) -> [u64; 2] {
        value
    }
}

/// Exclusive prefix sum and total over the lanes of `mask` (contiguous from lane 0). When every
/// lane brings the same value (posts of one size: the common case) one match instruction
/// replaces the ten shuffles of the scan and the broadcast of its total.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn warp_scan(mask: u32, lane: u32, value: u64) -> (u64, u64) {
    if crate::arch::match_any(mask, value) == mask {
        return (lane as u64 * value, mask.count_ones() as u64 * value);
    }
    let incl = warp_inclusive_scan(mask, lane, value);
    (incl - value, shfl_u64(mask, incl, 31 - mask.leading_zeros()))
}

/// Inclusive prefix sum over the lanes of `mask` (contiguous from lane 0), by shuffles.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn warp_inclusive_scan(mask: u32, lane: u32, value: u64) -> u64 {
    let mut x = value;
    let mut d = 1;
    while d < 32 {
        let lo = crate::arch::shfl_up(mask, x as u32, d);
        let hi = crate::arch::shfl_up(mask, (x >> 32) as u32, d);
        if lane >= d {
            x += (hi as u64) << 32 | lo as u64;
        }
        d <<= 1;
    }
    x
}

/// `value` of lane `src`.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) fn shfl_u64(mask: u32, value: u64, src: u32) -> u64 {
    let lo = crate::arch::shfl_idx(mask, value as u32, src);
    let hi = crate::arch::shfl_idx(mask, (value >> 32) as u32, src);
    (hi as u64) << 32 | lo as u64
}

#[cfg(target_arch = "nvptx64")]
mod gpu {
    use super::*;
    use crate::arch::{self, FULL_WARP};

    /// The 32 lanes of a warp, all converged (see [`Warp::converged`]).
    #[derive(Clone, Copy)]
    pub struct Warp(());

    impl Warp {
        /// The calling warp, if all 32 lanes execute this call together; `None` otherwise (a
        /// partial or diverged warp cannot post as a warp).
        #[inline(always)]
        pub fn converged() -> Option<Warp> {
            (arch::active_mask() == FULL_WARP).then_some(Warp(()))
        }
    }

    // SAFETY: ranks are lane ids; the scan and broadcast are whole-warp shuffles.
    unsafe impl Scope for Warp {
        const NAME: &'static str = "warp";
        #[inline(always)]
        fn rank(&self) -> u32 {
            arch::lane_id()
        }
        #[inline(always)]
        fn size(&self) -> u32 {
            32
        }
        #[inline(always)]
        fn sync(&self) {
            arch::warp_sync(FULL_WARP)
        }
        #[inline(always)]
        fn scan(&self, value: u64) -> (u64, u64) {
            warp_scan(FULL_WARP, arch::lane_id(), value)
        }
        #[inline(always)]
        fn broadcast(&self, value: [u64; 2]) -> [u64; 2] {
            [shfl_u64(FULL_WARP, value[0], 0), shfl_u64(FULL_WARP, value[1], 0)]
        }
        #[inline(always)]
        fn broadcast_word(&self, value: u64) -> u64 {
            shfl_u64(FULL_WARP, value, 0)
        }
        #[inline(always)]
        fn broadcast_flag(&self, flag: bool) -> bool {
            arch::ballot(FULL_WARP, flag) & 1 != 0
        }
    }

    /// The lanes of a warp that execute this call together with the same key (CUDA's
    /// coalesced group, split by `__match_any_sync`). Thread scope posts as one in the shared
    /// modes, so a warp's concurrent posters on one queue pair take one reservation, one
    /// in-order hand-off and one doorbell instead of contending lane by lane. Every lane of the
    /// group must then run the same collectives in the same order, which the posting code does
    /// (its loop bounds are the group's, not the lane's).
    #[derive(Clone, Copy)]
    pub struct Coalesced {
        mask: u32,
    }

    impl Coalesced {
        /// The lanes executing this call with the caller and passing the same `key`. Lanes
        /// that act on different queues must pass different keys: a group acts through its
        /// leader's queue.
        #[inline(always)]
        pub fn sharing(key: u64) -> Coalesced {
            Coalesced {
                mask: arch::match_any(arch::active_mask(), key),
            }
        }
    }

    // SAFETY: ranks are positions among the mask's lanes (lowest lane leads); the scan and
    // broadcast are shuffles over exactly the mask, which every lane of it executes.
    unsafe impl Scope for Coalesced {
        const NAME: &'static str = "coalesced";
        #[inline(always)]
        fn rank(&self) -> u32 {
            (self.mask & ((1u32 << arch::lane_id()) - 1)).count_ones()
        }
        #[inline(always)]
        fn size(&self) -> u32 {
            self.mask.count_ones()
        }
        #[inline(always)]
        fn sync(&self) {
            arch::warp_sync(self.mask)
        }
        #[inline(always)]
        fn scan(&self, value: u64) -> (u64, u64) {
            let lane = arch::lane_id();
            if self.mask == FULL_WARP {
                return warp_scan(FULL_WARP, lane, value);
            }
            if arch::match_any(self.mask, value) == self.mask {
                return (self.rank() as u64 * value, self.size() as u64 * value);
            }
            // Lanes are not contiguous: visit each once (every lane runs the same loop).
            let (mut before, mut total) = (0, 0);
            let mut rest = self.mask;
            while rest != 0 {
                let l = rest.trailing_zeros();
                rest &= rest - 1;
                let v = shfl_u64(self.mask, value, l);
                if l < lane {
                    before += v;
                }
                total += v;
            }
            (before, total)
        }
        #[inline(always)]
        fn broadcast(&self, value: [u64; 2]) -> [u64; 2] {
            let leader = self.mask.trailing_zeros();
            [
                shfl_u64(self.mask, value[0], leader),
                shfl_u64(self.mask, value[1], leader),
            ]
        }
        #[inline(always)]
        fn broadcast_word(&self, value: u64) -> u64 {
            shfl_u64(self.mask, value, self.mask.trailing_zeros())
        }
        #[inline(always)]
        fn broadcast_flag(&self, flag: bool) -> bool {
            // The leader is the mask's lowest lane: its vote is the ballot's lowest bit.
            let votes = arch::ballot(self.mask, flag);
            votes & (self.mask & self.mask.wrapping_neg()) != 0
        }
    }

    /// Scratch memory a block's collectives use: shared memory (fastest) or a per-block area of
    /// global memory, readable and writable by every thread of the block.
    #[repr(C, align(16))]
    pub struct BlockScratch {
        warp_totals: [u64; 32],
        value: [u64; 2],
        /// [`Scope::broadcast_met`]'s value: apart from `value`, so a plain broadcast between
        /// two of its calls never overwrites what a member is still to read.
        met: [u64; 2],
    }

    /// Every thread of a block.
    #[derive(Clone, Copy)]
    pub struct Block {
        scratch: *mut BlockScratch,
    }

    impl Block {
        /// The calling block, with its scratch area.
        ///
        /// # Safety
        /// `scratch` is valid for reads and writes of a [`BlockScratch`] by every thread of
        /// this block, used by no one else while the block's collectives run, and every thread
        /// of the block passes the same pointer.
        #[inline(always)]
        pub const unsafe fn new(scratch: *mut BlockScratch) -> Block {
            Block { scratch }
        }
    }

    // SAFETY: ranks are linear thread indices; the scan and broadcast go through the block's
    // scratch between barriers, so every thread reads what every other wrote.
    unsafe impl Scope for Block {
        const NAME: &'static str = "block";
        #[inline(always)]
        fn rank(&self) -> u32 {
            arch::block_thread_rank()
        }
        #[inline(always)]
        fn size(&self) -> u32 {
            arch::block_size()
        }
        #[inline(always)]
        fn sync(&self) {
            arch::block_sync()
        }
        #[inline(always)]
        fn scan(&self, value: u64) -> (u64, u64) {
            let (rank, size) = (self.rank(), self.size());
            let (warp, lane) = (rank / 32, rank % 32);
            // The last warp may be partial: its lanes are the low ones.
            let lanes = (size - warp * 32).min(32);
            let mask = if lanes == 32 { FULL_WARP } else { (1u32 << lanes) - 1 };
            let (excl, warp_total) = warp_scan(mask, lane, value);
            // SAFETY (scratch accesses): valid per `new`; barriers order them (`arch::load_u64_block`).
            let totals = unsafe { core::ptr::addr_of_mut!((*self.scratch).warp_totals) } as *mut u64;
            if lane == lanes - 1 {
                unsafe { arch::store_u64_block(totals.add(warp as usize), warp_total) };
            }
            arch::block_sync();
            let (mut before, mut total) = (0, 0);
            for w in 0..size.div_ceil(32) {
                // SAFETY: the block scratch holds one total per warp of the block, and `w` is below their number.
                let t = unsafe { arch::load_u64_block(totals.add(w as usize)) };
                if w < warp {
                    before += t;
                }
                total += t;
            }
            arch::block_sync(); // the totals are free for the next collective
            (before + excl, total)
        }
        #[inline(always)]
        fn broadcast(&self, value: [u64; 2]) -> [u64; 2] {
            // SAFETY: as in `scan`.
            let slot = unsafe { core::ptr::addr_of_mut!((*self.scratch).value) } as *mut u64;
            if self.is_leader() {
                // SAFETY: the two words of the scratch's broadcast value.
                unsafe {
                    arch::store_u64_block(slot, value[0]);
                    arch::store_u64_block(slot.add(1), value[1]);
                }
            }
            arch::block_sync();
            // SAFETY: as above; the barrier orders the leader's writes before these reads.
            let v = unsafe { [arch::load_u64_block(slot), arch::load_u64_block(slot.add(1))] };
            arch::block_sync();
            v
        }
        #[inline(always)]
        fn broadcast_met(&self, value: [u64; 2]) -> [u64; 2] {
            // SAFETY: as in `scan`.
            let slot = unsafe { core::ptr::addr_of_mut!((*self.scratch).met) } as *mut u64;
            // The barrier every member just passed came after its read of the last value here
            // (the contract), so the leader may write it now.
            if self.is_leader() {
                // SAFETY: the two words of the scratch's value.
                unsafe {
                    arch::store_u64_block(slot, value[0]);
                    arch::store_u64_block(slot.add(1), value[1]);
                }
            }
            arch::block_sync();
            // SAFETY: as above; the barrier orders the leader's writes before these reads.
            unsafe { [arch::load_u64_block(slot), arch::load_u64_block(slot.add(1))] }
        }
    }
}
#[cfg(target_arch = "nvptx64")]
pub use gpu::{Block, BlockScratch, Coalesced, Warp};

/// Size of one block's `BlockScratch` (the GPU type), for hosts that allocate it for
/// block-scope launches.
pub const BLOCK_SCRATCH_BYTES: usize = 32 * 8 + 2 * 8 + 2 * 8;
#[cfg(target_arch = "nvptx64")]
const _: () = assert!(core::mem::size_of::<BlockScratch>() == BLOCK_SCRATCH_BYTES);

#[cfg(not(target_arch = "nvptx64"))]
mod host {
    extern crate std;
    use core::sync::atomic::{AtomicU64, Ordering::*};
    use std::sync::Barrier;
    use std::vec::Vec;

    use super::*;

    /// CPU threads that play a warp or a block: `size` members meeting at a barrier, with one
    /// slot per member for scans and two for broadcasts.
    #[derive(Debug)]
    pub struct Group {
        size: u32,
        barrier: Barrier,
        slots: Vec<AtomicU64>,
    }

    impl Group {
        /// A group of `size` members; `None` for 0.
        pub fn new(size: u32) -> Option<Group> {
            (size > 0).then(|| Group {
                size,
                barrier: Barrier::new(size as usize),
                slots: (0..size + 2).map(|_| AtomicU64::new(0)).collect(),
            })
        }

        /// Member `lane` as a warp lane; `None` if `lane` is out of range or the group is
        /// larger than a warp.
        pub fn warp(&self, lane: u32) -> Option<Warp<'_>> {
            (lane < self.size && self.size <= 32).then_some(Warp(Member {
                group: self,
                rank: lane,
            }))
        }

        /// Member `thread` as a thread of a block; `None` if out of range.
        pub fn block(&self, thread: u32) -> Option<Block<'_>> {
            (thread < self.size).then_some(Block(Member {
                group: self,
                rank: thread,
            }))
        }
    }

    #[derive(Clone, Copy, Debug)]
    struct Member<'a> {
        group: &'a Group,
        rank: u32,
    }

    impl Member<'_> {
        fn sync(&self) {
            self.group.barrier.wait();
        }

        fn scan(&self, value: u64) -> (u64, u64) {
            let slots = &self.group.slots;
            slots[self.rank as usize].store(value, Relaxed);
            self.sync();
            let (mut before, mut total) = (0, 0);
            for (r, s) in slots[..self.group.size as usize].iter().enumerate() {
                let v = s.load(Relaxed);
                if (r as u32) < self.rank {
                    before += v;
                }
                total += v;
            }
            self.sync();
            (before, total)
        }

        fn broadcast(&self, value: [u64; 2]) -> [u64; 2] {
            let n = self.group.size as usize;
            let slots = &self.group.slots[n..n + 2];
            if self.rank == 0 {
                slots[0].store(value[0], Relaxed);
                slots[1].store(value[1], Relaxed);
            }
            self.sync();
            let v = [slots[0].load(Relaxed), slots[1].load(Relaxed)];
            self.sync();
            v
        }
    }

    /// A lane of a [`Group`] playing a warp.
    #[derive(Clone, Copy, Debug)]
    pub struct Warp<'a>(Member<'a>);

    /// A thread of a [`Group`] playing a block.
    #[derive(Clone, Copy, Debug)]
    pub struct Block<'a>(Member<'a>);

    macro_rules! group_scope {
        ($t:ident, $name:literal) => {
            // SAFETY: every member reads the same slots between the same two barriers (a mutex
            // and a condition variable, which order the slot accesses). Ranks are distinct as
            // long as each member is taken once; if a caller takes one twice, two threads write
            // the same WQE slots, which garbles the WQEs but stays memory-safe on the host,
            // where ring stores are atomic.
            unsafe impl Scope for $t<'_> {
                const NAME: &'static str = $name;
                fn rank(&self) -> u32 {
                    self.0.rank
                }
                fn size(&self) -> u32 {
                    self.0.group.size
                }
                fn sync(&self) {
                    self.0.sync()
                }
                fn scan(&self, value: u64) -> (u64, u64) {
                    self.0.scan(value)
                }
                fn broadcast(&self, value: [u64; 2]) -> [u64; 2] {
                    self.0.broadcast(value)
                }
            }
        };
    }
    group_scope!(Warp, "warp");
    group_scope!(Block, "block");
}
#[cfg(not(target_arch = "nvptx64"))]
pub use host::{Block, Group, Warp};
