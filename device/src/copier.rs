//! The soft HCA's persistent copy kernel (see [`gdaki_layout::copy`]).
//!
//! Block 0's first warp watches the host-pinned ring and mirrors new descriptors into device
//! memory, up to 32 per PCIe round trip, running ahead of the others (so one warp polls across
//! PCIe, and descriptors are fetched while earlier ones are copied). A small descriptor that
//! arrives alone it serves itself (see
//! [`MIRROR_SERVES_MAX`](gdaki_layout::copy::MIRROR_SERVES_MAX)), and so a small message and
//! the flag stored after it (see [`MIRROR_RUN_MAX`](gdaki_layout::copy::MIRROR_RUN_MAX)): those
//! are latency cases, and the hand-off to a worker warp costs more than the copy. Every other warp
//! walks the mirrored descriptors 32 at a time and serves its own: a small copy, a copy list (up to 32
//! small copies, a lane each) or an atomic belongs to one warp (descriptor `n` to worker warp
//! `n mod warps`), so many are served at once; a large copy is shared by the warps of enough
//! blocks (starting at a different block for each copy), and the last warp to finish its share
//! answers. Answers ([`CopyDone`](gdaki_layout::copy::CopyDone)) are published per slot with a
//! system-scope release, in any order; the host reads completion per slot. Each answer also
//! marks its slot done in device memory, for copies the host ordered after it (a copy onto
//! bytes an earlier one still writes names that one, and its warps wait for it).
//!
//! Within one copy the final unit (up to 16 bytes) is written last, after the rest is visible,
//! so a poller that sees a message's last byte sees the whole message. Separate copies may be
//! placed in any order unless the host ordered them (see the host side).
//!
//! [`copy_share`] is compiled for the host too, where the tests run it with simulated threads.
use gdaki_layout::copy::OP_COPY;
#[cfg(target_arch = "nvptx64")]
use gdaki_layout::copy::{CopierState, CopyDesc, CopyDone};

/// A unit of copying: loaded and stored whole, each a single access the compiler keeps in
/// place (never merged into a `memcpy`, which the GPU back end lowers to a byte loop).
trait Unit: Copy {
    /// # Safety
    /// `p` is valid for reads and aligned.
    unsafe fn load(p: *const Self) -> Self {
        // SAFETY: the caller's contract.
        unsafe { p.read_volatile() }
    }
    /// # Safety
    /// `p` is valid for writes and aligned.
    unsafe fn store(p: *mut Self, v: Self) {
        // SAFETY: the caller's contract.
        unsafe { p.write_volatile(v) }
    }
}
impl Unit for u8 {}
impl Unit for u32 {}
impl Unit for u64 {}

/// 16 bytes, aligned as such: on the GPU one vector load and one vector store (a volatile
/// access of 16 bytes would be split in two).
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct Unit16([u64; 2]);

#[cfg(not(target_arch = "nvptx64"))]
impl Unit for Unit16 {}

#[cfg(target_arch = "nvptx64")]
impl Unit for Unit16 {
    unsafe fn load(p: *const Self) -> Self {
        let (a, b): (u64, u64);
        // SAFETY: `p` is valid and 16-byte aligned (caller's contract).
        unsafe {
            core::arch::asm!("ld.v2.u64 {{{a}, {b}}}, [{p}];", a = out(reg64) a, b = out(reg64) b,
                             p = in(reg64) p, options(nostack, readonly))
        };
        Unit16([a, b])
    }
    unsafe fn store(p: *mut Self, v: Self) {
        // SAFETY: as above, for writes.
        unsafe {
            core::arch::asm!("st.v2.u64 [{p}], {{{a}, {b}}};", p = in(reg64) p, a = in(reg64) v.0[0],
                             b = in(reg64) v.0[1], options(nostack))
        }
    }
}

/// Copies `count` units of `T` from `src` to `dst`: the share of thread `tid` of `n`, eight
/// units in flight at a time, then four, then one (loads first, then stores: one load at a
/// time left the copy waiting on memory latency for every unit, and four left large copies
/// short of the memory's bandwidth).
///
/// # Safety
/// Both ranges are valid for `count` units of `T`, aligned for `T`, and not overlapping.
#[inline(always)]
unsafe fn units<T: Unit>(dst: u64, src: u64, count: u64, tid: u64, n: u64) {
    let (d, s) = (dst as *mut T, src as *const T);
    let mut i = tid;
    // SAFETY (all loops): every index used is below `count`, inside both ranges (caller's
    // contract).
    while i + 7 * n < count {
        let at = |k: u64| (i + k * n) as usize;
        unsafe {
            let (a, b, c, e) = (
                T::load(s.add(at(0))),
                T::load(s.add(at(1))),
                T::load(s.add(at(2))),
                T::load(s.add(at(3))),
            );
            let (f, g, h, j) = (
                T::load(s.add(at(4))),
                T::load(s.add(at(5))),
                T::load(s.add(at(6))),
                T::load(s.add(at(7))),
            );
            T::store(d.add(at(0)), a);
            T::store(d.add(at(1)), b);
            T::store(d.add(at(2)), c);
            T::store(d.add(at(3)), e);
            T::store(d.add(at(4)), f);
            T::store(d.add(at(5)), g);
            T::store(d.add(at(6)), h);
            T::store(d.add(at(7)), j);
        }
        i += 8 * n;
    }
    while i + 3 * n < count {
        let at = |k: u64| (i + k * n) as usize;
        // SAFETY: every index used is below `count`, inside both ranges (caller's contract).
        unsafe {
            let (a, b, c, e) = (
                T::load(s.add(at(0))),
                T::load(s.add(at(1))),
                T::load(s.add(at(2))),
                T::load(s.add(at(3))),
            );
            T::store(d.add(at(0)), a);
            T::store(d.add(at(1)), b);
            T::store(d.add(at(2)), c);
            T::store(d.add(at(3)), e);
        }
        i += 4 * n;
    }
    while i < count {
        // SAFETY: as above: `i < count`.
        unsafe { T::store(d.add(i as usize), T::load(s.add(i as usize))) };
        i += n;
    }
}

/// The unit [`copy_share`] moves a copy in: 16 bytes when both addresses and the length are
/// multiples of 16, else 8, 4 or 1.
#[inline(always)]
pub const fn unit(dst: u64, src: u64, len: u64) -> u64 {
    let a = dst | src | len;
    if a % 16 == 0 {
        16
    } else if a % 8 == 0 {
        8
    } else if a % 4 == 0 {
        4
    } else {
        1
    }
}

/// The length of a copy's body: everything but its final unit, which is written last.
#[inline(always)]
pub const fn body(dst: u64, src: u64, len: u64) -> u64 {
    len.saturating_sub(unit(dst, src, len))
}

/// How a copy is moved: the bytes every thread shares first, then its final unit alone, last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Bytes from the copy's source, shared first (all of them when it has a tail).
    pub main: u64,
    /// Bytes from the tail's source, shared first.
    pub tail_body: u64,
    /// The final unit: destination, source and length, written last.
    pub last: (u64, u64, u64),
}

/// The [`Plan`] of a copy of `len` bytes from `src` to `dst`, then `tail` bytes (0: none) from
/// `tail_src` to `dst + len` (see [`CopyDesc::tail`](gdaki_layout::copy::CopyDesc::tail)):
/// the final unit is the tail's where there is one, so a poller of the tail's last byte sees
/// both parts.
#[inline(always)]
pub const fn plan(dst: u64, src: u64, len: u64, tail_src: u64, tail: u64) -> Plan {
    if tail == 0 {
        let b = body(dst, src, len);
        return Plan {
            main: b,
            tail_body: 0,
            last: (dst + b, src + b, len - b),
        };
    }
    let at = dst + len;
    let b = body(at, tail_src, tail);
    Plan {
        main: len,
        tail_body: b,
        last: (at + b, tail_src + b, tail - b),
    }
}

/// Thread `tid`'s share (of `n` threads) of copying `len` bytes from `src` to `dst`, in the
/// [`unit()`] of the three.
///
/// # Safety
/// `src..src + len` is readable and `dst..dst + len` writable by the caller, and they do not
/// overlap.
#[inline(always)]
pub unsafe fn copy_share(dst: u64, src: u64, len: u64, tid: u64, n: u64) {
    let u = unit(dst, src, len);
    // SAFETY (all arms): the unit divides both addresses and the length, so `len / u` units
    // cover the ranges exactly, aligned.
    unsafe {
        match u {
            16 => units::<Unit16>(dst, src, len / 16, tid, n),
            8 => units::<u64>(dst, src, len / 8, tid, n),
            4 => units::<u32>(dst, src, len / 4, tid, n),
            _ => units::<u8>(dst, src, len, tid, n),
        }
    }
}

/// Stores the first `len` bytes (at most 16) of `words`, in memory order, at `dst`, as a copy
/// of them would: its final unit last, after the rest is visible (an [`OP_STORE`]
/// descriptor's bytes, carried in the descriptor).
///
/// [`OP_STORE`]: gdaki_layout::copy::OP_STORE
///
/// # Safety
/// `dst..dst + len` is writable by the caller.
#[inline(always)]
pub unsafe fn store_carried(dst: u64, words: [u64; 2], len: u64) {
    let len = if len < 16 { len } else { 16 };
    // The units are a copy's from a 16-byte aligned source (offset 0): the bytes never go
    // through memory on their way (parked in a 16-byte local and copied out of it, they cost
    // the copier's lane a local-memory round trip, byte by byte where unaligned, for every
    // store it served).
    let body = body(dst, 0, len);
    // SAFETY: the caller vouches for `dst..dst + len`.
    unsafe { store_bytes(dst, words, 0, body) };
    if body != 0 {
        order_stores();
    }
    // SAFETY: as above.
    unsafe { store_bytes(dst + body, words, body, len - body) };
}

/// Stores bytes `from..from + len` (within 16) of `words`, in memory order, at `dst`, in the
/// units a copy of them from a 16-byte aligned source would take ([`unit()`]).
///
/// # Safety
/// `dst..dst + len` is writable by the caller.
#[inline(always)]
unsafe fn store_bytes(dst: u64, words: [u64; 2], from: u64, len: u64) {
    let u = unit(dst, from, len);
    let mut i = 0;
    while i < len {
        let at = dst + i;
        let v = bytes_from(words, from + i, u.min(8));
        // SAFETY (all arms): `at..at + u` lies in `dst..dst + len` (the caller's), aligned
        // for the unit (`unit` divides `dst` and `len`).
        unsafe {
            match u {
                16 => Unit16::store(at as *mut Unit16, Unit16(words)),
                8 => u64::store(at as *mut u64, v),
                4 => u32::store(at as *mut u32, v as u32),
                _ => u8::store(at as *mut u8, v as u8),
            }
        }
        i += u;
    }
}

/// The `width` bytes (1, 4 or 8; `at + width` at most 16) of `words` (16 bytes in memory
/// order) from byte `at`, as a value of that width stored in native order holds them.
#[inline(always)]
const fn bytes_from(words: [u64; 2], at: u64, width: u64) -> u64 {
    let (all, shift) = if cfg!(target_endian = "little") {
        ((words[1] as u128) << 64 | words[0] as u128, 8 * at)
    } else {
        ((words[0] as u128) << 64 | words[1] as u128, 8 * (16 - at - width))
    };
    let v = (all >> (shift & 127)) as u64;
    if width >= 8 {
        v
    } else {
        v & ((1u64 << (8 * width)) - 1)
    }
}

/// Orders this thread's earlier stores before its later ones for every observer of the GPU.
#[inline(always)]
fn order_stores() {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: a fence has no operands.
    unsafe {
        core::arch::asm!("fence.acq_rel.gpu;", options(nostack))
    }
    #[cfg(not(target_arch = "nvptx64"))]
    core::sync::atomic::fence(core::sync::atomic::Ordering::Release);
}

/// Items of a copy list of at most this many bytes are moved by one lane alone (one round of
/// four 16-byte loads).
pub const LANE_COPY_MAX: u64 = 64;

/// Copies of at most this many bytes, atomics and stores are served by one warp.
pub const WARP_COPY_MAX: u64 = 4 << 10;

/// Whether descriptor (`op`, `len`) is served by one warp (else by the warps of several blocks).
#[inline(always)]
pub const fn warp_sized(op: u32, len: u64) -> bool {
    op != OP_COPY || len <= WARP_COPY_MAX
}

/// The smallest share of a large copy worth a block of its own: smaller shares spend more on
/// each warp's fixed cost per copy (walk, counter, fences) than on moving bytes.
pub const MIN_BLOCK_SHARE: u64 = 64 << 10;

/// How many of `blocks` blocks move a large `len`-byte copy (at least one).
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

/// Which share (of `parts`) of large copy `k` worker block `b` (of `blocks`) moves, if any.
/// Consecutive copies start at different blocks, so copies that need fewer blocks than there
/// are run side by side instead of queueing on the first ones.
#[inline(always)]
pub const fn block_part(k: u64, b: u64, parts: u64, blocks: u64) -> Option<u64> {
    // (No division by a zero `blocks`: kernels must not carry a panic path.)
    let Some(first) = k.wrapping_mul(parts).checked_rem(blocks) else {
        return None;
    };
    let part = if b >= first { b - first } else { b + blocks - first };
    if part < parts {
        Some(part)
    } else {
        None
    }
}

/// The byte range `[lo, hi)` of a `len`-byte copy that block `b` of `blocks` moves: equal
/// shares in multiples of 16 bytes, so aligned copies stay aligned in every share.
#[inline(always)]
pub const fn block_share(len: u64, b: u64, blocks: u64) -> (u64, u64) {
    // (No division by a zero `blocks`: kernels must not carry a panic path.)
    let share = match len.checked_div(blocks) {
        Some(q) => q + (len % blocks != 0) as u64,
        None => len,
    }
    .next_multiple_of(16);
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
    /// Warps done with each slot's (large) descriptor.
    pub finished: *mut u64,
    /// Per slot, the newest descriptor done (for copies that wait for an earlier one).
    pub completed: *mut u64,
}

#[cfg(target_arch = "nvptx64")]
mod gpu {
    use core::arch::asm;
    use core::arch::nvptx::{_block_dim_x, _block_idx_x, _grid_dim_x, _thread_idx_x};
    use core::ptr::{addr_of, addr_of_mut};

    use gdaki_layout::copy::{
        CopyDesc, CopyDone, CopyItem, LIST_MAX, MIRROR_RUN_MAX, MIRROR_SERVES_MAX, OP_COMPARE_SWAP, OP_COPY,
        OP_COPY_LIST, OP_FETCH_ADD, OP_SERVED, OP_STORE, RING_SLOTS, SERVER_MIRROR, SPAN_FLAG_FOLLOWS,
    };

    use super::{
        block_part, block_share, body, copy_share, participants, plan, store_carried, warp_sized, Work, LANE_COPY_MAX,
    };
    use crate::arch::{self, FULL_WARP};
    use crate::scope::shfl_u64;

    const MASK: u64 = RING_SLOTS as u64 - 1;
    /// Looks at a message's flag slot before the fetching warp gives up on it (the host
    /// publishes the flag first, so one is enough unless it failed to post it).
    const FOLLOW_LOOKS: u32 = 4;

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

    /// Waits until descriptor `m` is done (its slot's completion record reached it: a slot is
    /// reused only once its descriptor is answered, so a later one there means `m` was done).
    /// Cannot deadlock: every warp serves its descriptors in order and waits only for earlier
    /// ones, whose warps are not waiting for later ones.
    ///
    /// # Safety
    /// As for [`serve`]; every lane of the warp calls this together.
    #[inline(always)]
    unsafe fn wait_done(work: &Work, m: u64, lane: u64) {
        if lane == 0 {
            let mut polls = 0u32;
            // SAFETY: the slot of the work area (contract).
            while unsafe { ld_acquire_gpu(work.completed.add((m & MASK) as usize)) } < m {
                polls = polls.wrapping_add(1);
                arch::backoff(polls / 64);
            }
        }
        arch::warp_sync(FULL_WARP);
    }

    /// Whether the `span` descriptors up to `m` (0: all) are done, for store `k` ordered after
    /// them: those from `first` on, and only the last ring's worth (a slot is reused only once
    /// its descriptor was answered, so older ones are done). The lanes look at 32 at a time. `m`
    /// is clamped below `k` (a store never waits for itself or a later one). Uniform across the
    /// warp; every lane calls this together.
    ///
    /// # Safety
    /// As for [`serve`].
    #[inline(always)]
    unsafe fn done_through(work: &Work, first: u64, k: u64, m: u64, span: u32, lane: u64) -> bool {
        let ring = RING_SLOTS as u64;
        let m = if m < k { m } else { k.saturating_sub(1) };
        let mut lo = if k + 1 > ring && k + 1 - ring > first {
            k + 1 - ring
        } else {
            first
        };
        if span != 0 && m + 1 > span as u64 && m + 1 - span as u64 > lo {
            lo = m + 1 - span as u64;
        }
        let mut j = lo;
        while j <= m {
            let mine = j + lane;
            // SAFETY: the slot of the work area (contract).
            let done = mine > m || unsafe { ld_acquire_gpu(work.completed.add((mine & MASK) as usize)) } >= mine;
            if arch::ballot(FULL_WARP, done) != FULL_WARP {
                return false;
            }
            j += 32;
        }
        true
    }

    /// Orders this warp's next stores after what [`done_through`] acquired in every lane: the
    /// lanes meet (a warp barrier orders memory among them), then lane 0 fences.
    #[inline(always)]
    fn after_acquired(lane: u64) {
        arch::warp_sync(FULL_WARP);
        if lane == 0 {
            fence_gpu();
        }
    }

    /// Waits until every descriptor up to `m` is done (see [`done_through`]), for store `k`,
    /// then orders the warp's next stores after them. Cannot deadlock, as [`wait_done`].
    ///
    /// # Safety
    /// As for [`serve`]; every lane of the warp calls this together.
    #[inline(always)]
    unsafe fn wait_through(work: &Work, first: u64, k: u64, m: u64, span: u32, lane: u64) {
        let mut polls = 0u32;
        // SAFETY: the caller's contract.
        while !unsafe { done_through(work, first, k, m, span, lane) } {
            polls = polls.wrapping_add(1);
            arch::backoff(polls / 64);
        }
        after_acquired(lane);
    }

    /// When descriptor `k` was seen and started (GPU global timer), for its answer's stamps.
    #[derive(Clone, Copy)]
    struct Times {
        seen: u64,
        started: u64,
    }

    /// Who serves a descriptor: the warp's lane, and what its answer names as the server
    /// ([`CopyDone::server`]).
    #[derive(Clone, Copy)]
    struct Server {
        lane: u64,
        id: u64,
    }

    /// Publishes the answer to descriptor `n` (see [`publish_done`] and [`answer_host`]).
    #[inline(always)]
    unsafe fn answer(dones: *mut CopyDone, work: &Work, n: u64, result: u64, t: Times, server: u64) {
        // SAFETY: the caller's contract.
        unsafe {
            let finished = publish_done(work, n);
            answer_host(dones, n, result, t, finished, server);
        }
    }

    /// Makes everything this thread saw written for descriptor `n` (the copy's bytes, through
    /// the warp barrier or the `finished` chain) visible system-wide, then marks `n` done for
    /// the descriptors ordered after it (`wait_done`, `done_through`); returns when (GPU global
    /// timer).
    #[inline(always)]
    unsafe fn publish_done(work: &Work, n: u64) -> u64 {
        arch::to_device_barrier();
        let finished = arch::global_timer_ns();
        // SAFETY: the slot of the work area (the kernel's contract).
        unsafe { st_release_gpu(work.completed.add((n & MASK) as usize), n) };
        finished
    }

    /// The host's answer to descriptor `n`, done ([`publish_done`]) at `finished`: the stamps
    /// and the result, then the sequence number with a system-scope release.
    #[inline(always)]
    unsafe fn answer_host(dones: *mut CopyDone, n: u64, result: u64, t: Times, finished: u64, server: u64) {
        // SAFETY: the slot of a live answer ring (the kernel's contract).
        unsafe {
            let done = dones.add((n & MASK) as usize);
            addr_of_mut!((*done).stamps).write_volatile([t.seen, t.started, finished]);
            addr_of_mut!((*done).result).write_volatile(result);
            addr_of_mut!((*done).server).write_volatile(server);
            st_release_sys(addr_of_mut!((*done).seq), n);
        }
    }

    /// A served descriptor's answer, held back until the rest of its run is served (see
    /// [`mirror`]): lane 0's values.
    #[derive(Clone, Copy)]
    struct Held {
        result: u64,
        started: u64,
        finished: u64,
    }

    /// Reads mirrored descriptor `n` as a seqlock reader: `Some` with the descriptor, or `None`
    /// if its slot already holds a later one (so `n` was answered and is not needed here).
    /// Retries while the slot is being written or still shows an earlier lap.
    #[inline(always)]
    unsafe fn read_mirror(work: &Work, n: u64) -> Option<CopyDesc> {
        // SAFETY: slot < RING_SLOTS inside the mirror (the kernel's contract).
        let m = unsafe { work.mirror.add((n & MASK) as usize) };
        let mut polls = 0u32;
        loop {
            // SAFETY: as above.
            let (before, d, after) = unsafe {
                let before = arch::load_u64_volatile(addr_of!((*m).seq));
                fence_gpu();
                let d = m.read_volatile();
                fence_gpu();
                (before, d, arch::load_u64_volatile(addr_of!((*m).seq)))
            };
            if before == after && before == n {
                return Some(d);
            }
            if before == after && before > n {
                return None;
            }
            polls = polls.wrapping_add(1);
            arch::backoff(polls / 64);
        }
    }

    /// The kernel body: serves descriptors `first`, `first + 1`, ... until the host sets
    /// `*stop` while the ring is empty.
    ///
    /// # Safety
    /// `descs` and `dones` are host-pinned rings of `RING_SLOTS` entries mapped for this GPU,
    /// `stop` a host-pinned word, `work` zeroed device memory as [`Work`] describes; every
    /// descriptor names memory this GPU may access; the block size is a multiple of 32; every
    /// thread of the grid calls this.
    // Inline: compiled only into the crate that launches it (the copier kernel), not into
    // every PTX of this crate (the C ABI library has no use for it).
    #[inline]
    pub unsafe fn serve(descs: *const CopyDesc, dones: *mut CopyDone, stop: *const u32, work: &Work, first: u64) {
        // SAFETY: special registers are always readable.
        let (tid, b, nt, nb) = unsafe {
            (
                _thread_idx_x() as u64,
                _block_idx_x() as u64,
                _block_dim_x() as u64,
                _grid_dim_x() as u64,
            )
        };
        let (lane, warp, per_block) = (tid % 32, tid / 32, nt / 32);
        // SAFETY: `work.state` is the device memory the contract names; only field addresses are taken.
        let head = unsafe { addr_of_mut!((*work.state).head) };
        // SAFETY: as above.
        let stopped = unsafe { addr_of_mut!((*work.state).stop) };
        if b == 0 {
            if warp == 0 {
                // SAFETY: the rings and the state are valid per the contract.
                unsafe { mirror(descs, dones, stop, work, first, head, stopped, lane) };
            }
            return;
        }
        // Worker blocks 1..nb as 0..nw; their warps as 0..warps.
        let (wb, nw) = (b - 1, nb - 1);
        let (me, warps) = (wb * per_block + warp, nw * per_block);
        let mut n = first;
        loop {
            let mut h = 0;
            if lane == 0 {
                let mut polls = 0u32;
                // SAFETY: the state is valid per the contract.
                loop {
                    h = unsafe { ld_acquire_gpu(head) };
                    if h >= n || unsafe { ld_acquire_gpu(stopped) } != 0 {
                        break;
                    }
                    polls = polls.wrapping_add(1);
                    arch::backoff(polls / 64);
                }
                if h < n {
                    // SAFETY: the state is valid per the contract.
                    h = unsafe { ld_acquire_gpu(head) }; // the stop raced a last mirror
                }
            }
            let h = shfl_u64(FULL_WARP, h, 0);
            if h < n {
                return; // asked to stop, nothing pending
            }
            let batch = (h - n + 1).min(32);
            // Lane i looks at descriptor n + i and says whether this warp serves it.
            let mine = n + lane;
            let d = if lane < batch {
                // SAFETY: per the contract; mirrored (head >= mine).
                unsafe { read_mirror(work, mine) }
            } else {
                None
            };
            let serves = match d {
                Some(d) if d.op == OP_SERVED => false,
                Some(d) if warp_sized(d.op, d.len) => mine.checked_rem(warps) == Some(me),
                Some(d) => block_part(mine, wb, participants(d.len, nw), nw).is_some(),
                None => false,
            };
            let mut todo = arch::ballot(FULL_WARP, serves);
            // Lanes with nothing to look at hold a zeroed descriptor (never served: no ballot bit).
            let d = d.unwrap_or(bytemuck::Zeroable::zeroed());
            while todo != 0 {
                let i = todo.trailing_zeros();
                todo &= todo - 1;
                let k = n + i as u64;
                let op = arch::shfl_idx(FULL_WARP, d.op, i);
                let dst = shfl_u64(FULL_WARP, d.dst, i);
                let src = shfl_u64(FULL_WARP, d.src, i);
                let len = shfl_u64(FULL_WARP, d.len, i);
                let arg0 = shfl_u64(FULL_WARP, d.arg0, i);
                let arg1 = shfl_u64(FULL_WARP, d.arg1, i);
                let tail = arch::shfl_idx(FULL_WARP, d.tail as u32, i) as u64;
                // A copy onto bytes an earlier copy writes starts once that one is done. Every
                // descriptor before `first` was done before this launch.
                if (op == OP_COPY || op == OP_COPY_LIST) && arg1 >= first {
                    // SAFETY: the work area (contract).
                    unsafe { wait_done(work, arg1, lane) };
                }
                // A store ordered after the descriptors before it lands once they are all done.
                if op == OP_STORE && arg1 >= first {
                    // SAFETY: the work area (contract).
                    unsafe { wait_through(work, first, k, arg1, arch::shfl_idx(FULL_WARP, d.span as u32, i), lane) };
                }
                let t = Times {
                    seen: shfl_u64(FULL_WARP, d.seen, i),
                    started: arch::global_timer_ns(),
                };
                // SAFETY: the host names valid, non-overlapping ranges and aligned atomic
                // targets (contract).
                unsafe {
                    if warp_sized(op, len) {
                        let who = Server { lane, id: me };
                        let args = Args { arg0, arg1, tail };
                        serve_small(dones, work, k, op, dst, src, len, args, who, t, false);
                    } else {
                        let tail = (arg0, tail);
                        serve_share(
                            dones,
                            work,
                            k,
                            dst,
                            src,
                            len,
                            tail,
                            wb,
                            nw,
                            tid,
                            nt,
                            (lane, me),
                            per_block,
                            t,
                        );
                    }
                }
            }
            n += batch;
        }
    }

    /// A descriptor's operands besides its addresses and length: `arg0`, `arg1` and the
    /// copy's `tail` (see [`CopyDesc`]).
    #[derive(Clone, Copy)]
    struct Args {
        arg0: u64,
        arg1: u64,
        tail: u64,
    }

    /// One warp serves descriptor `k` whole: the copy's body (and its tail's) by every lane,
    /// its final unit by lane 0 after the rest is visible, or the atomic by lane 0; lane 0 answers, or with
    /// `hold` only publishes it done ([`publish_done`]) and returns the answer's values for a
    /// later [`answer_host`].
    ///
    /// # Safety
    /// As for [`serve`]; every lane of the warp calls this together.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn serve_small(
        dones: *mut CopyDone,
        work: &Work,
        k: u64,
        op: u32,
        dst: u64,
        src: u64,
        len: u64,
        Args { arg0, arg1, tail }: Args,
        who: Server,
        t: Times,
        hold: bool,
    ) -> Held {
        let lane = who.lane;
        let mut result = 0;
        let mut finished = 0;
        // SAFETY (all arms): the caller's contract.
        unsafe {
            match op {
                OP_COPY => {
                    let p = plan(dst, src, len, arg0, tail);
                    copy_share(dst, src, p.main, lane, 32);
                    // (Only a gather has a tail: no call on every other copy's path.)
                    if p.tail_body != 0 {
                        copy_share(dst + len, arg0, p.tail_body, lane, 32);
                    }
                    arch::warp_sync(FULL_WARP);
                    if lane == 0 {
                        fence_gpu();
                        let (d, s, n) = p.last;
                        copy_share(d, s, n, 0, 1);
                    }
                }
                OP_COPY_LIST => serve_list(src, len, lane),
                OP_STORE if lane == 0 => store_carried(dst, [src, arg0], len),
                OP_FETCH_ADD if lane == 0 => result = add_acq_rel_gpu(dst as *mut u64, arg0),
                OP_COMPARE_SWAP if lane == 0 => result = cas_gpu(dst as *mut u64, arg0, arg1),
                _ => {}
            }
            if lane == 0 {
                if hold {
                    finished = publish_done(work, k);
                } else {
                    answer(dones, work, k, result, t, who.id);
                }
            }
        }
        arch::warp_sync(FULL_WARP);
        Held {
            result,
            started: t.started,
            finished,
        }
    }

    /// The copies of a list descriptor (`count` [`CopyItem`]s at `list`): lane i reads item i;
    /// an item of at most [`LANE_COPY_MAX`] bytes is moved by its lane alone (body, fence, final
    /// unit), so a list of tiny copies costs one round of loads; larger items are moved by the
    /// whole warp, one after another, each final unit last.
    ///
    /// # Safety
    /// As for [`serve`]; `list` holds `count` items the host wrote before publishing the
    /// descriptor; every lane of the warp calls this together.
    #[inline(always)]
    unsafe fn serve_list(list: u64, count: u64, lane: u64) {
        // The walk acquired the mirror's head, which the mirror released after acquiring the
        // descriptor from the host: the host's items are ordered before these reads.
        fence_gpu();
        let item = if lane < count && lane < LIST_MAX as u64 {
            // SAFETY: item `lane` < count of the list (contract); plain loads, so the lanes'
            // reads cross PCIe together.
            unsafe { (list as *const CopyItem).add(lane as usize).read() }
        } else {
            bytemuck::Zeroable::zeroed()
        };
        let (dst, src, len) = (item.dst, item.src, item.len);
        if len != 0 && len <= LANE_COPY_MAX {
            let body = body(dst, src, len);
            // SAFETY: the host names valid, non-overlapping ranges (contract).
            unsafe {
                copy_share(dst, src, body, 0, 1);
                if body != 0 {
                    fence_gpu();
                }
                copy_share(dst + body, src + body, len - body, 0, 1);
            }
        }
        let mut large = arch::ballot(FULL_WARP, len > LANE_COPY_MAX);
        while large != 0 {
            let i = large.trailing_zeros();
            large &= large - 1;
            let (d, s, n) = (
                shfl_u64(FULL_WARP, dst, i),
                shfl_u64(FULL_WARP, src, i),
                shfl_u64(FULL_WARP, len, i),
            );
            let body = body(d, s, n);
            // SAFETY: as above.
            unsafe { copy_share(d, s, body, lane, 32) };
            arch::warp_sync(FULL_WARP);
            if lane == 0 {
                fence_gpu();
                // SAFETY: as above.
                unsafe { copy_share(d + body, s + body, n - body, 0, 1) };
            }
        }
        arch::warp_sync(FULL_WARP);
    }

    /// This warp's part of large copy `k`: block `wb`'s share of the body, split over the
    /// block's warps; the last of all participating warps writes the `tail` (source and
    /// length, see [`CopyDesc::tail`]) and the final unit, and answers.
    ///
    /// # Safety
    /// As for [`serve`]; every lane of the warp calls this together.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn serve_share(
        dones: *mut CopyDone,
        work: &Work,
        k: u64,
        dst: u64,
        src: u64,
        len: u64,
        (tail_src, tail): (u64, u64),
        wb: u64,
        nw: u64,
        tid: u64,
        nt: u64,
        (lane, me): (u64, u64),
        per_block: u64,
        t: Times,
    ) {
        let parts = participants(len, nw);
        let p = plan(dst, src, len, tail_src, tail);
        // Always Some here: the walk picked this block for the copy.
        let part = block_part(k, wb, parts, nw).unwrap_or(parts);
        let (lo, hi) = block_share(p.main, part, parts);
        // SAFETY: the caller's contract.
        unsafe { copy_share(dst + lo, src + lo, hi - lo, tid, nt) };
        arch::warp_sync(FULL_WARP);
        if lane == 0 {
            // SAFETY: as above. The acq_rel chain on `finished` orders every warp's bytes
            // before the last one's final unit and answer.
            unsafe {
                let finished = work.finished.add((k & MASK) as usize);
                if add_acq_rel_gpu(finished, 1) == parts * per_block - 1 {
                    finished.write_volatile(0);
                    if p.tail_body != 0 {
                        copy_share(dst + len, tail_src, p.tail_body, 0, 1);
                        fence_gpu();
                    }
                    let (d, s, n) = p.last;
                    copy_share(d, s, n, 0, 1);
                    answer(dones, work, k, 0, t, me);
                }
            }
        }
        arch::warp_sync(FULL_WARP);
    }

    /// The mirror warp serves descriptor `n` (lane `from` holds it: the only one ready, or one
    /// of a message and its flag, see [`MIRROR_RUN_MAX`]) itself when it is an atomic, a store
    /// whose earlier descriptors are done, or a copy of at most [`MIRROR_SERVES_MAX`] bytes not
    /// waiting for an unfinished earlier copy; returns whether it did (with `hold`, with the
    /// answer held back, see [`serve_small`]). Uniform across the warp.
    ///
    /// # Safety
    /// As for [`serve`]; every lane of the warp calls this together, with the same `from`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn serve_lone(
        dones: *mut CopyDone,
        work: &Work,
        first: u64,
        n: u64,
        d: CopyDesc,
        from: u32,
        seen: u64,
        lane: u64,
        hold: bool,
    ) -> Option<Held> {
        let op = arch::shfl_idx(FULL_WARP, d.op, from);
        let len = shfl_u64(FULL_WARP, d.len, from);
        let arg1 = shfl_u64(FULL_WARP, d.arg1, from);
        let tail = arch::shfl_idx(FULL_WARP, d.tail as u32, from) as u64;
        let small = match op {
            OP_FETCH_ADD | OP_COMPARE_SWAP | OP_STORE => true,
            OP_COPY => len + tail <= MIRROR_SERVES_MAX,
            _ => false,
        };
        if !small {
            return None;
        }
        // A copy ordered after an earlier one goes to the workers unless that one is done
        // (acquired: its bytes land before this copy's).
        let mut free = true;
        if op == OP_COPY && arg1 >= first && lane == from as u64 {
            // SAFETY: the work area's slot of `arg1` (contract).
            free = unsafe { ld_acquire_gpu(work.completed.add((arg1 & MASK) as usize)) } >= arg1;
        }
        if arch::ballot(FULL_WARP, free) & (1 << from) == 0 {
            return None;
        }
        // Likewise a store ordered after every descriptor up to `arg1`, unless those are all
        // earlier in this run (a message and its count): this warp served them, each published
        // done by lane 0 (its fence) before this store, which lane 0 makes.
        if op == OP_STORE && arg1 >= first {
            let span = arch::shfl_idx(FULL_WARP, d.span as u32, from) as u64;
            let in_run = span != 0 && arg1 < n && arg1 + 1 >= n - from as u64 + span;
            if !in_run {
                // SAFETY: the work area (contract).
                if !unsafe { done_through(work, first, n, arg1, span as u32, lane) } {
                    return None;
                }
                after_acquired(lane);
            }
        }
        let (dst, src, arg0) = (
            shfl_u64(FULL_WARP, d.dst, from),
            shfl_u64(FULL_WARP, d.src, from),
            shfl_u64(FULL_WARP, d.arg0, from),
        );
        let t = Times {
            seen,
            started: arch::global_timer_ns(),
        };
        let who = Server {
            lane,
            id: SERVER_MIRROR,
        };
        // SAFETY: the host names valid, non-overlapping ranges and aligned atomic targets
        // (contract).
        let args = Args { arg0, arg1, tail };
        Some(unsafe { serve_small(dones, work, n, op, dst, src, len, args, who, t, hold) })
    }

    /// Block 0's first warp: mirrors the descriptors the host has posted, up to 32 at a time
    /// (lane i checks slot n + i; the ready run from lane 0 is copied and published as
    /// `head`), until the host sets the stop word while nothing is posted.
    ///
    /// # Safety
    /// As for [`serve`]; every lane of the warp calls this together.
    unsafe fn mirror(
        descs: *const CopyDesc,
        dones: *mut CopyDone,
        stop: *const u32,
        work: &Work,
        first: u64,
        head: *mut u64,
        stopped: *mut u64,
        lane: u64,
    ) {
        let mut n = first;
        let mut polls = 0u32;
        loop {
            let mine = n + lane;
            // SAFETY: per the contract (slot < RING_SLOTS).
            let d = unsafe { descs.add((mine & MASK) as usize) };
            // An acquire load: a lane that finds its descriptor posted reads it next, ordered
            // by this load alone (a system-scope fence after the poll cost microseconds).
            let ready = unsafe { arch::load_u64_acquire(addr_of!((*d).seq)) } == mine;
            let mut run = (!arch::ballot(FULL_WARP, ready)).trailing_zeros() as u64;
            if run == 0 {
                // SAFETY: `stop` is a host-pinned word (contract).
                let stopping = lane == 0 && unsafe { stop.read_volatile() } != 0;
                if arch::ballot(FULL_WARP, stopping) != 0 {
                    if lane == 0 {
                        // SAFETY: the state word (contract).
                        unsafe { st_release_gpu(stopped, 1) };
                    }
                    return;
                }
                polls = polls.wrapping_add(1);
                arch::backoff(polls / 64);
                continue;
            }
            polls = 0;
            let seen = arch::global_timer_ns();
            let mut desc: CopyDesc = bytemuck::Zeroable::zeroed();
            if lane < run {
                // SAFETY: per the contract. A plain read after this lane's acquire of its `seq`:
                // its loads cross PCIe together (volatile ones would go one round trip at a time).
                desc = unsafe { d.read() };
            }
            // A message whose flag the host published before it, found without the flag: this
            // lane's load overtook the one before it. The flag is in host memory already; one
            // look at its slot alone (bounded, should the host not have posted it after all).
            let last = (run - 1) as u32;
            let (mut last_op, last_span) = (
                arch::shfl_idx(FULL_WARP, desc.op, last),
                arch::shfl_idx(FULL_WARP, desc.span as u32, last),
            );
            if run < 32 && last_span == SPAN_FLAG_FOLLOWS as u32 && (last_op == OP_COPY || last_op == OP_COPY_LIST) {
                for _ in 0..FOLLOW_LOOKS {
                    // SAFETY: as the look above, for this lane's slot.
                    let ready = lane == run && unsafe { arch::load_u64_acquire(addr_of!((*d).seq)) } == mine;
                    if arch::ballot(FULL_WARP, ready) != 0 {
                        if ready {
                            // SAFETY: as above.
                            desc = unsafe { d.read() };
                        }
                        last_op = arch::shfl_idx(FULL_WARP, desc.op, run as u32);
                        run += 1;
                        break;
                    }
                }
            }
            // A lone descriptor, or a message and its flag: served here in order, as far as
            // each may be (the rest go to the workers, whose rules order them after these).
            // (`last_op` is the run's last descriptor's op: shuffled with the look's, again only
            // where the look at the next slot found one more.)
            let last = (run - 1) as u32;
            let flag = last_op == OP_STORE && shfl_u64(FULL_WARP, desc.arg1, last) >= n;
            // In a run, each descriptor is published done at once (so the flag lands right after
            // the message) and the host's answers follow the last one (each a system-scope
            // release of a write to host memory: a PCIe round trip the flag need not wait for).
            // Lane i holds descriptor i's answer.
            let hold = run > 1;
            let mut held = None;
            if run == 1 || (run <= MIRROR_RUN_MAX && flag) {
                for i in 0..run as u32 {
                    // SAFETY: the rings and the work area are valid per the contract.
                    let Some(h) = (unsafe { serve_lone(dones, work, first, n + i as u64, desc, i, seen, lane, hold) })
                    else {
                        break;
                    };
                    let h = Held {
                        result: shfl_u64(FULL_WARP, h.result, 0),
                        started: shfl_u64(FULL_WARP, h.started, 0),
                        finished: shfl_u64(FULL_WARP, h.finished, 0),
                    };
                    if lane == i as u64 {
                        desc.op = OP_SERVED;
                        held = Some(h);
                    }
                }
            }
            if let (true, Some(h)) = (hold, held) {
                let t = Times {
                    seen,
                    started: h.started,
                };
                // SAFETY: the answer ring (contract); descriptor `mine` was served and published
                // done above, by lane 0, before the warp barrier that ended its serving.
                unsafe { answer_host(dones, mine, h.result, t, h.finished, SERVER_MIRROR) };
            }
            if lane < run {
                // SAFETY: the mirror slot of `mine` (contract). seq cleared first and set
                // last: a reader never takes a half-written slot for its descriptor (see
                // `read_mirror`).
                unsafe {
                    let m = work.mirror.add((mine & MASK) as usize);
                    addr_of_mut!((*m).seq).write_volatile(0);
                    fence_gpu();
                    m.write_volatile(CopyDesc { seq: 0, seen, ..desc });
                    fence_gpu();
                    addr_of_mut!((*m).seq).write_volatile(mine);
                }
            }
            arch::warp_sync(FULL_WARP);
            if lane == 0 {
                fence_gpu();
                // SAFETY: the state word (contract).
                unsafe { st_release_gpu(head, n + run - 1) };
            }
            n += run;
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
    fn a_copy_is_its_body_then_its_final_unit() {
        for (d, s, len, u) in [
            (0u64, 0u64, 4096u64, 16u64),
            (8, 8, 24, 8),
            (4, 0, 12, 4),
            (1, 0, 7, 1),
            (0, 0, 0, 16),
        ] {
            assert_eq!(unit(d, s, len), u, "{d} {s} {len}");
            let b = body(d, s, len);
            assert_eq!(b, len.saturating_sub(u));
            // The body keeps (at least) the copy's unit, so its shares stay aligned.
            assert!(b == 0 || unit(d, s, b) >= u);
        }
        assert!(warp_sized(OP_COPY, WARP_COPY_MAX) && !warp_sized(OP_COPY, WARP_COPY_MAX + 1));
        assert!(warp_sized(gdaki_layout::copy::OP_FETCH_ADD, 8));
    }

    #[test]
    fn a_copy_with_a_tail_ends_in_the_tails_final_unit() {
        // Without a tail: the body, then the copy's own final unit.
        let p = plan(0x1000, 0x2000, 64, 0, 0);
        assert_eq!(
            p,
            Plan {
                main: 48,
                tail_body: 0,
                last: (0x1030, 0x2030, 16)
            }
        );
        // A 64 KiB message and its 128-byte padded trailer: all the message first, then the
        // tail's body, its last 16 bytes last.
        let p = plan(0x10000, 0x90000, 65536, 0x5000, 128);
        assert_eq!(
            p,
            Plan {
                main: 65536,
                tail_body: 112,
                last: (0x10000 + 65536 + 112, 0x5070, 16)
            }
        );
        // An unaligned message: the tail's unit follows its own alignment.
        let p = plan(0x10000, 0x90001, 5, 0x5000, 27);
        assert_eq!(p.main, 5);
        assert_eq!((p.tail_body, p.last), (26, (0x10000 + 5 + 26, 0x5000 + 26, 1)));
        // Moving it as planned copies both parts exactly, into one contiguous range.
        let body: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        let tail: Vec<u8> = (0..40u32).map(|i| 200 - i as u8).collect();
        for (len, t) in [(300u64, 40u64), (256, 16), (3, 33), (0, 16)] {
            let mut dst = std::vec![0u8; 400];
            let (d, s, ts) = (dst.as_mut_ptr() as u64, body.as_ptr() as u64, tail.as_ptr() as u64);
            let p = plan(d, s, len, ts, t);
            // SAFETY: every range lies inside the vectors (`len + t` <= 340 < 400).
            unsafe {
                copy_share(d, s, p.main, 0, 1);
                copy_share(d + len, ts, p.tail_body, 0, 1);
                copy_share(p.last.0, p.last.1, p.last.2, 0, 1);
            }
            let (l, t) = (len as usize, t as usize);
            assert_eq!(&dst[..l], &body[..l], "{len} {t}");
            assert_eq!(&dst[l..l + t], &tail[..t], "{len} {t}");
            assert!(dst[l + t..].iter().all(|&b| b == 0), "{len} {t}");
        }
    }

    #[test]
    fn carried_bytes_are_stored_exactly_at_every_alignment() {
        let words = [0x0807_0605_0403_0201u64, 0x100f_0e0d_0c0b_0a09];
        let carried: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        for off in 0..16usize {
            for len in 1..=16usize {
                let mut dst = std::vec![0u8; 48];
                // SAFETY: `off + len` <= 32 bytes of a 48-byte vector.
                unsafe { store_carried(dst.as_mut_ptr() as u64 + off as u64, words, len as u64) };
                assert_eq!(&dst[off..off + len], &carried[..len], "{off} {len}");
                assert!(
                    dst[..off].iter().chain(&dst[off + len..]).all(|&b| b == 0),
                    "{off} {len}"
                );
            }
        }
        // More than 16 asked: 16 stored, nothing past them.
        let mut dst = std::vec![0u8; 32];
        // SAFETY: 16 bytes of a 32-byte vector.
        unsafe { store_carried(dst.as_mut_ptr() as u64, words, 40) };
        assert_eq!((&dst[..16], &dst[16..]), (&carried[..], &[0u8; 16][..]));
        assert!(warp_sized(gdaki_layout::copy::OP_STORE, 16));
    }

    #[test]
    fn small_copies_take_few_blocks() {
        assert_eq!(participants(0, 33), 1);
        assert_eq!(participants(8, 33), 1);
        assert_eq!(participants(MIN_BLOCK_SHARE, 33), 1);
        assert_eq!(participants(MIN_BLOCK_SHARE + 1, 33), 2);
        assert_eq!(participants(1 << 20, 33), 16);
        assert_eq!(participants(4 << 20, 33), 33);
        assert_eq!(participants(1 << 20, 8), 8);
    }

    #[test]
    fn every_share_of_a_large_copy_has_one_block() {
        for blocks in [1u64, 2, 7, 32] {
            for parts in 1..=blocks {
                for k in [0u64, 1, 5, 255, u64::MAX] {
                    let mut owners = std::vec![0u32; parts as usize];
                    for b in 0..blocks {
                        if let Some(p) = block_part(k, b, parts, blocks) {
                            owners[p as usize] += 1;
                        }
                    }
                    assert!(owners.iter().all(|&n| n == 1), "{k} {parts} {blocks}: {owners:?}");
                }
            }
        }
        // Consecutive copies that fit side by side use different blocks.
        let first = |k| (0..32).find(|&b| block_part(k, b, 4, 32) == Some(0));
        assert_eq!((first(0), first(1), first(2)), (Some(0), Some(4), Some(8)));
        assert_eq!(block_part(3, 0, 4, 0), None);
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
