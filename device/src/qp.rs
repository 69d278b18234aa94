//! A queue pair as the device drives it: the low-level protocol and the high-level operations
//! built on it, in every execution scope ([`crate::scope`]): a thread posts for itself, a warp
//! or block posts its members' operations with one reservation and one doorbell.
//!
//! # Protocol
//! 1. [`Qp::reserve`]: an atomic add on `sq_reserved` claims WQE slots; on a ring wrap the
//!    caller first waits for the CQE of the slot's previous user.
//! 2. `wqe_prepare_*`: the WQE is written with 16-byte stores.
//! 3. [`Qp::mark_ready`]: in reservation order, `sq_ready` advances past the caller's WQEs.
//! 4. [`Qp::submit`]: the doorbell covers every ready WQE. GPU handler: one poster at a time
//!    (a lock in shared modes) writes the doorbell record and rings with the newest ready
//!    index, so doorbells never go backwards and concurrent posters share one doorbell.
//!    CPU-proxy handler: the newest ready index is published to the proxy's word. Either way
//!    `sq_rung` records what was rung. Through a [`Qp::deferred`] handle this step is left
//!    to [`Qp::commit`] (one doorbell for many posts); a wait on the QP rings whatever is
//!    ready and not rung first, so no ticket waits on a doorbell that never comes.
//! 5. [`Qp::poll_at`] / [`Qp::wait`]: the CQE of a WQE is polled by owner-bit parity.
//!
//! Every WQE this crate writes is one 64-byte building block and asks for a CQE, so WQE index,
//! building-block index and CQE index are the same number: a ticket. Mixing these functions
//! with WQEs of several blocks or unsignalled WQEs on one QP is unsupported. Mixing the high-
//! and low-level functions on one QP is safe: both follow the protocol above.
//!
//! # Scopes
//! The high-level functions are collectives in warp and block scope (see [`crate::scope`]):
//! every member brings its own operation, the group's WQEs are reserved, marked ready and rung
//! by the leader, and every member gets the group's last ticket (waiting on it covers the
//! whole group). Errors of the group's reservation or doorbell reach every member; an error in
//! a member's own arguments (say, inline data too long) reaches that member only, whose slots
//! then hold NOPs. The low-level functions are per thread in every scope.
use core::marker::PhantomData;
use core::ptr::addr_of_mut;

use gdaki_layout::atomic::AtomicSeg;
use gdaki_layout::ctrl::{self, CtrlSeg};
use gdaki_layout::data::DataSeg;
use gdaki_layout::handle::QP_FLUSH_AFTER_FETCH;
use gdaki_layout::raddr::RaddrSeg;
use gdaki_layout::wait::WaitSeg;
use gdaki_layout::{
    atomic as atomic_seg, dbrec, doorbell, inline, ring, AtomicReplyOrder, DevQp, DoorbellKind, Segment, WqeOpcode,
};

use crate::arch;
use crate::cq::Cq;
use crate::scope::{Scope, Thread};
use crate::sharing::Sharing;
use crate::status::{self, PostError, Ticket, WaitError};

pub use gdaki_layout::wqe::Remote;

/// A local buffer: address (as the device and the HCA see it) and local key.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct Local {
    /// Address.
    pub addr: u64,
    /// Local key.
    pub lkey: u32,
}

impl Local {
    /// The buffer `by` bytes further on, same key.
    #[inline(always)]
    pub const fn offset(self, by: u64) -> Local {
        Local {
            addr: self.addr.wrapping_add(by),
            lkey: self.lkey,
        }
    }
}

/// The atomic a WQE performs.
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub enum AtomicOp {
    /// Add `0` to the remote u64.
    FetchAdd(u64),
    /// If the remote u64 equals `compare`, store `swap`.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
}

/// What ringing for a producer index stores, for an agent that rings later on a poster's
/// behalf (a CUDA stream's memory operations: stream-triggered posting, after
/// [`Qp::note_rung`]): each value is what one native-endian store writes, in this order, as
/// [`Qp::submit`] would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DoorbellWrites {
    /// The GPU doorbell (and the CPU-assisted one, whose `DevQp::doorbell` is a host word a
    /// proxy forwards): the 32-bit send doorbell record (at `DevQp::sq_dbrec`), then the
    /// 8-byte doorbell (at `DevQp::doorbell`). The record goes first: an agent's stores are
    /// ordered, and a HCA that recovers a lost doorbell from the record then finds it current.
    Doorbell {
        /// The record's word (big-endian counter, as stored); `None` for a reliable doorbell
        /// (no record: [`DevQp::no_doorbell_record`]).
        record: Option<u32>,
        /// The doorbell's 8 bytes as one word.
        doorbell: u64,
    },
    /// The CPU proxy: the producer index, one 8-byte store at `DevQp::doorbell`; the proxy
    /// writes the record and rings.
    Proxy {
        /// The producer index.
        index: u64,
    },
}

impl DoorbellWrites {
    /// What ringing QP `qpn` for producer index `pi` stores through a doorbell of `kind`,
    /// `with_record` or (a reliable doorbell) without the doorbell record.
    #[inline(always)]
    pub const fn new(kind: DoorbellKind, qpn: u32, pi: u64, with_record: bool) -> DoorbellWrites {
        match kind {
            DoorbellKind::Gpu | DoorbellKind::CpuAssisted => DoorbellWrites::Doorbell {
                record: if with_record {
                    Some(dbrec::wq_counter(pi).to_be())
                } else {
                    None
                },
                doorbell: doorbell::word(qpn, pi),
            },
            DoorbellKind::CpuProxy => DoorbellWrites::Proxy { index: pi },
        }
    }
}

/// The most bytes [`Qp::put_inline`] carries (one building block).
pub const MAX_INLINE: usize = inline::MAX_SINGLE_BB;

/// The most bytes [`Qp::send_inline`] carries (one building block).
pub const MAX_SEND_INLINE: usize = inline::MAX_SEND_SINGLE_BB;

/// The inline segment of `data` (at most [`MAX_SEND_INLINE`] bytes, checked by the caller): its
/// header, then the bytes, zero-padded, as three 16-byte segments' words; a WQE takes the first
/// `inline::ds(len)` of them.
#[inline(always)]
fn inline_segments(data: &[u8]) -> [[u64; 2]; 3] {
    let mut tail = [0u8; 48];
    let len = data.len().min(MAX_SEND_INLINE);
    tail[..4].copy_from_slice(&inline::byte_count(len as u32).to_be_bytes());
    tail[4..4 + len].copy_from_slice(&data[..len]);
    let w = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&tail[8 * i..8 * i + 8]);
        u64::from_ne_bytes(b)
    };
    [[w(0), w(1)], [w(2), w(3)], [w(4), w(5)]]
}

/// `data` fits a WQE that carries at most `max` bytes inline.
#[inline(always)]
fn check_inline(data: &[u8], max: usize) -> Result<(), PostError> {
    if data.len() > max {
        return Err(PostError::InlineTooLong { len: data.len(), max });
    }
    Ok(())
}

/// Flags every WQE carries: a CQE for each, so tickets are CQE indices.
const SIGNALED: u8 = ctrl::CE_CQ_UPDATE;

/// A queue pair handle used in sharing mode `M` by execution scope `S`.
pub struct Qp<M: Sharing, S: Scope = Thread> {
    ptr: *mut DevQp,
    /// The handle's constant fields, read once.
    k: Consts,
    scope: S,
    /// Posts leave the doorbell to [`Qp::commit`] (see [`Qp::deferred`]).
    defer: bool,
    /// Fence-mode bits the first WQE of each post carries (see [`Qp::fenced`]).
    fence: u8,
    /// A lone WQE is rung by a BlueFlame write of itself (see [`Qp::blueflame`]).
    blueflame: bool,
    _mode: PhantomData<M>,
}

/// The constant fields of a handle that posting and completing use, read when the handle is
/// wrapped. Read through the pointer instead, they were loaded again after every fence and
/// doorbell store (asm the compiler must assume touches memory), each load a round trip to L2
/// on a post's critical path: the profile of the posting rate showed those waits, not the
/// fences, as where a post's time went.
#[derive(Clone, Copy)]
struct Consts {
    sq_base: u64,
    sq_dbrec: u64,
    doorbell: u64,
    max_msg_size: u64,
    timeout_ns: u64,
    /// The CQ's constants.
    cq: crate::cq::Consts,
    qpn: u32,
    sq_log_size: u32,
    doorbell_kind: u8,
    flags: u8,
    /// Decoded from `flags` once: `ring` picks its fences' scope by it on every doorbell.
    rings_in_gpu_memory: bool,
}

impl Consts {
    /// # Safety
    /// `ptr` is valid for reads (as `Qp::from_raw` requires).
    #[inline(always)]
    const unsafe fn read(ptr: *const DevQp) -> Consts {
        // SAFETY: the caller's contract; constant fields, read by value.
        unsafe {
            Consts {
                sq_base: (*ptr).sq_base,
                sq_dbrec: (*ptr).sq_dbrec,
                doorbell: (*ptr).doorbell,
                max_msg_size: (*ptr).max_msg_size,
                timeout_ns: (*ptr).timeout_ns,
                cq: crate::cq::Consts::read(core::ptr::addr_of!((*ptr).cq)),
                qpn: (*ptr).qpn,
                sq_log_size: (*ptr).sq_log_size,
                doorbell_kind: (*ptr).doorbell_kind,
                flags: (*ptr).flags,
                rings_in_gpu_memory: (*ptr).rings_in_gpu_memory(),
            }
        }
    }
}

/// A send queue's counters, loaded ahead of a reservation ([`Qp::reserve_ahead`]).
#[derive(Clone, Copy)]
pub(crate) struct ReserveAhead {
    reserved: u64,
    consumed: u64,
}

impl<M: Sharing, S: Scope> Clone for Qp<M, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M: Sharing, S: Scope> Copy for Qp<M, S> {}

/// A bounded wait: backs off between rounds and reports expiry of the handle's timeout. The
/// clock starts at the first unsuccessful round, so a wait that is not needed reads no timer.
pub(crate) struct Deadline {
    start: Option<u64>,
    limit: u64,
    round: u32,
    polls: u32,
}

/// Polls between two looks at the clock in a wait on what the HCA writes
/// ([`Deadline::poll_due`]). On a GPU a poll is a memory round trip; on the host a poll is a
/// cache hit and the clock cheap, and a waiter must yield soon (posters, the HCA model and
/// proxies share a few cores; under loom, every round).
#[cfg(target_arch = "nvptx64")]
const POLLS_PER_CHECK: u32 = 256;
#[cfg(not(target_arch = "nvptx64"))]
const POLLS_PER_CHECK: u32 = 1;

impl Deadline {
    /// A wait bounded by `limit` nanoseconds.
    #[inline(always)]
    pub(crate) const fn new(limit: u64) -> Deadline {
        Deadline {
            start: None,
            limit,
            round: 0,
            polls: 0,
        }
    }

    /// Counts a poll of memory the HCA writes; true once every [`POLLS_PER_CHECK`], when the
    /// wait should look at the clock ([`expired`](Self::expired), which also backs off). On a
    /// GPU each such poll costs a memory round trip (a microsecond from host memory): a wait
    /// that backed off after eight of them would sleep through a message a few microseconds
    /// away, and a timeout is seconds.
    #[inline(always)]
    pub(crate) fn poll_due(&mut self) -> bool {
        self.polls += 1;
        if self.polls < POLLS_PER_CHECK {
            return false;
        }
        self.polls = 0;
        true
    }

    /// [`poll_due`](Self::poll_due), then [`expired`](Self::expired) when it is: the round of a
    /// wait whose every poll loads what the HCA writes.
    #[inline(always)]
    pub(crate) fn poll_expired(&mut self) -> bool {
        self.poll_due() && self.expired()
    }

    #[inline(always)]
    pub(crate) fn expired(&mut self) -> bool {
        let now = arch::global_timer_ns();
        let start = *self.start.get_or_insert(now);
        self.round = self.round.wrapping_add(1);
        arch::backoff(self.round);
        now.wrapping_sub(start) > self.limit
    }
}

impl<M: Sharing> Qp<M, Thread> {
    /// Wraps an exported handle, in thread scope.
    ///
    /// # Safety
    /// `ptr` points to a `DevQp` exported by the host (rings, records and doorbell addresses
    /// valid for this device or thread), alive for as long as this value is used, and accessed
    /// concurrently only through this crate in the same sharing mode.
    #[inline(always)]
    pub const unsafe fn from_raw(ptr: *mut DevQp) -> Self {
        Qp {
            ptr,
            // SAFETY: `ptr` is valid (this function's contract).
            k: unsafe { Consts::read(ptr) },
            scope: Thread,
            defer: false,
            fence: 0,
            blueflame: false,
            _mode: PhantomData,
        }
    }
}

impl<M: Sharing, S: Scope> Qp<M, S> {
    /// The same QP used by the group `scope` (every member converts its own handle).
    #[inline(always)]
    pub const fn with_scope<T: Scope>(self, scope: T) -> Qp<M, T> {
        Qp {
            ptr: self.ptr,
            k: self.k,
            scope,
            defer: self.defer,
            fence: self.fence,
            blueflame: self.blueflame,
            _mode: PhantomData,
        }
    }

    /// The same QP with its doorbell left for later: operations posted through the returned
    /// handle write their WQEs and mark them ready but do not ring; [`commit`](Self::commit)
    /// then rings once for all of them, so many posts share one doorbell and its system-scope
    /// fences (what bounds the posting rate into device-memory rings). The HCA sees nothing
    /// before the commit, except that any wait on the QP (`wait`, `poll_at`, `quiet`, or a post
    /// that needs a slot back) rings first: a deferred ticket never waits forever.
    #[inline(always)]
    pub const fn deferred(self) -> Self {
        Qp { defer: true, ..self }
    }

    /// The same QP with its posts fenced, in the form verbs (`IBV_SEND_FENCE`) and NVSHMEM use:
    /// the first WQE of each operation posted through the returned handle carries the PRM's
    /// FENCE mode ([`ctrl::FM_FENCE`]).
    ///
    /// What that guarantees, on a ConnectX as on the soft HCA: the operation starts only once
    /// every earlier RDMA READ ([`get`](Self::get)) and atomic of this QP has completed, its
    /// data written into local memory. So a put may send what an earlier get fetched, or
    /// depend on an earlier atomic's result. It does not wait for earlier puts: RC already
    /// executes a QP's WRITEs and atomics at the responder in posting order, so a later put or
    /// atomic can never overtake an earlier put there, fenced or not. For "everything earlier
    /// has completed", wait on the earlier ticket ([`wait`](Self::wait), [`quiet`](Self::quiet)).
    /// Ordering across different QPs is never given by a fence.
    #[inline(always)]
    pub const fn fenced(self) -> Self {
        Qp {
            fence: ctrl::FM_FENCE,
            ..self
        }
    }

    /// The same QP rung by BlueFlame where that can help: a post of one WQE through the
    /// returned handle, exclusive and rung by the poster itself ([`DoorbellKind::Gpu`]), writes
    /// the whole 64-byte WQE into the doorbell register instead of the 8-byte doorbell (after
    /// the doorbell record, as a ConnectX needs it), so a NIC need not fetch the WQE from the
    /// send queue before it starts: the write the latency of a lone small put waits on.
    /// Anything else (several WQEs rung at once, shared handles, a proxy) rings as usual, as
    /// rdma-core's `mlx5_post_send` uses BlueFlame only for a lone WQE. The WQE is still
    /// written to the send queue. DOCA GPUNetIO's `submit_bf`; its register is the UAR's
    /// doorbell register, which on a ConnectX must belong to a BlueFlame (write-combining)
    /// UAR page for the 64 bytes to travel as one write.
    #[inline(always)]
    pub const fn blueflame(self) -> Self {
        Qp {
            blueflame: true,
            ..self
        }
    }

    /// Rings for every WQE marked ready on this QP and not rung yet (posted through a
    /// [`deferred`](Self::deferred) handle, by any poster). A collective in group scope.
    #[inline(always)]
    pub fn commit(&self) -> Result<(), PostError> {
        self.on_leader(|| self.ring_pending().map(|()| 0)).map(|_| ())
    }

    /// Rings up to `sq_ready` if that is past `sq_rung`.
    #[inline(always)]
    fn ring_pending(&self) -> Result<(), PostError> {
        // SAFETY: counters of the live handle.
        let ready = unsafe { M::load_acquire(self.sq_ready()) };
        if ready > unsafe { M::load_acquire(self.sq_rung()) } {
            self.submit(ready)?;
        }
        Ok(())
    }

    /// The execution scope.
    #[inline(always)]
    pub const fn scope(&self) -> S {
        self.scope
    }

    /// The raw handle.
    #[inline(always)]
    pub const fn as_ptr(&self) -> *mut DevQp {
        self.ptr
    }

    // Field access through the raw pointer: hot counters are only touched with atomics, and
    // constants are read by value, so no reference to the shared handle is ever made.
    #[inline(always)]
    fn sq_reserved(&self) -> *mut u64 {
        // SAFETY (all field helpers): `ptr` is valid per `from_raw`.
        unsafe { addr_of_mut!((*self.ptr).sq_reserved) }
    }
    #[inline(always)]
    fn sq_ready(&self) -> *mut u64 {
        // SAFETY: `ptr` is valid per `from_raw`; only the field's address is taken (no reference to the shared handle).
        unsafe { addr_of_mut!((*self.ptr).sq_ready) }
    }
    #[inline(always)]
    fn sq_rung(&self) -> *mut u64 {
        // SAFETY: `ptr` is valid per `from_raw`; only the field's address is taken (no reference to the shared handle).
        unsafe { addr_of_mut!((*self.ptr).sq_rung) }
    }
    #[inline(always)]
    fn db_lock(&self) -> *mut u32 {
        // SAFETY: `ptr` is valid per `from_raw`; only the field's address is taken (no reference to the shared handle).
        unsafe { addr_of_mut!((*self.ptr).db_lock) }
    }
    #[inline(always)]
    fn cq_consumed(&self) -> *mut u64 {
        self.cq().consumed()
    }
    /// The send CQ.
    #[inline(always)]
    fn cq(&self) -> Cq<M> {
        // SAFETY: `ptr` is valid per `from_raw`; the CQ's addresses come from its constants.
        unsafe { Cq::new(addr_of_mut!((*self.ptr).cq), self.k.cq) }
    }
    #[inline(always)]
    fn sq_log_size(&self) -> u32 {
        self.k.sq_log_size
    }
    #[inline(always)]
    fn qpn(&self) -> u32 {
        self.k.qpn
    }
    #[inline(always)]
    fn max_msg_size(&self) -> u64 {
        self.k.max_msg_size.max(1)
    }
    #[inline(always)]
    fn flags(&self) -> u8 {
        self.k.flags
    }

    /// The byte order in which this QP's HCA returns fetched atomic values (a property of the
    /// device, carried in the handle): what [`fetched`](Self::fetched) undoes.
    #[inline(always)]
    pub fn atomic_reply_order(&self) -> AtomicReplyOrder {
        AtomicReplyOrder::of_flags(self.k.flags)
    }

    #[inline(always)]
    pub(crate) fn deadline(&self) -> Deadline {
        Deadline::new(self.k.timeout_ns)
    }

    /// Address of WQE `index`.
    #[inline(always)]
    pub fn wqe_ptr(&self, index: u64) -> *mut u64 {
        (self.k.sq_base + ring::wqe_offset(index, self.sq_log_size())) as *mut u64
    }

    // ---------------------------------------------------------------- low level: posting

    /// Claims `count` consecutive WQE slots and returns the first index, after waiting (bounded)
    /// until the slots' previous users have completed.
    #[inline(always)]
    pub fn reserve(&self, count: u32) -> Result<u64, PostError> {
        let size = 1u64 << self.sq_log_size();
        if count == 0 || count as u64 > size {
            return Err(PostError::BadCount { count, ring: size });
        }
        // SAFETY: the counter belongs to the live handle.
        let base = unsafe { M::fetch_add(self.sq_reserved(), count as u64) };
        let last = base + count as u64 - 1;
        if last >= size {
            // Completions are in order, so the CQE of the last slot's previous user covers all.
            self.reclaim(last - size)?;
        }
        Ok(base)
    }

    /// For an exclusive poster: the counters [`reserve`](Self::reserve) reads (the slots
    /// reserved, the CQEs consumed), loaded now, so that a call can issue the loads as it
    /// starts, beside its own, instead of one after the other in its post (each a round trip
    /// to L2, the second waiting for the first). `None` for a shared handle, whose counters
    /// other posters move meanwhile.
    #[inline(always)]
    pub(crate) fn reserve_ahead(&self) -> Option<ReserveAhead> {
        if M::SHARED {
            return None;
        }
        Some(ReserveAhead {
            // SAFETY: a counter of the live handle, touched only through `M`'s atomics.
            reserved: unsafe { M::load_acquire(self.sq_reserved()) },
            consumed: self.consumed(),
        })
    }

    /// [`reserve`](Self::reserve), from the counters `ahead` that this poster loaded with
    /// [`reserve_ahead`](Self::reserve_ahead) since its last reservation on this handle (the
    /// caller's invariant: with the handle exclusive, nothing else reserved or consumed
    /// meanwhile but this poster; a completion consumed since only makes `ahead` cautious).
    /// `None`: as `reserve`.
    #[inline(always)]
    pub(crate) fn reserve_from(&self, ahead: Option<ReserveAhead>, count: u32) -> Result<u64, PostError> {
        let Some(ahead) = ahead.filter(|_| !M::SHARED) else {
            return self.reserve(count);
        };
        let size = 1u64 << self.sq_log_size();
        if count == 0 || count as u64 > size {
            return Err(PostError::BadCount { count, ring: size });
        }
        let base = ahead.reserved;
        // SAFETY: the counter belongs to the live handle, which only this poster moves.
        unsafe { M::store_release(self.sq_reserved(), base + count as u64) };
        let last = base + count as u64 - 1;
        if last >= size && ahead.consumed <= last - size {
            self.reclaim(last - size)?;
        }
        Ok(base)
    }

    /// Gives back the reservation that [`reserve_from`](Self::reserve_from) made from `base`,
    /// before any of its WQEs is marked ready: the slots go to the next reservation, whatever
    /// was written into them is never rung. Only where `ahead` was `Some` (an exclusive
    /// handle: nothing reserved since); a shared handle keeps its reservation.
    #[inline(always)]
    pub(crate) fn unreserve(&self, ahead: Option<ReserveAhead>, base: u64) {
        if ahead.is_none() || M::SHARED {
            return;
        }
        // SAFETY: the counter belongs to the live handle, which only this poster moves.
        unsafe { M::store_release(self.sq_reserved(), base) };
    }

    /// Waits (bounded) until WQE `index` has completed, so that its slot can be reused. Its
    /// outcome is not the caller's: a failed previous user still frees the slot, and a WQE
    /// posted into it then reports the QP's error itself (flushed).
    ///
    /// Before waiting, two CQEs are looked at in one round trip (relaxed loads, in flight
    /// together): the newest rung WQE's and the one halfway to it. Completions are in order
    /// (and after an error every later WQE completes flushed), so one that is in frees the
    /// ring up to it. A poster that waits for its peer between posts (a ping-pong) finds the
    /// newest in and reads the CQ once a ring; a stream poster, whose newest WQE was rung a
    /// moment ago, finds the halfway one in whenever the HCA is less than half the
    /// outstanding WQEs behind, and reads the CQ once per half ring. Consuming `index` alone
    /// cost a stream a CQE read per post (a PCIe round trip and a doorbell-record store, where
    /// the CQ is host memory), which held one thread's WRITEs to one per 8-12 us on an H100.
    #[inline(always)]
    fn reclaim(&self, index: u64) -> Result<(), WaitError> {
        if self.consumed() > index {
            return Ok(());
        }
        // SAFETY: a counter of the live handle.
        let rung = unsafe { M::load_acquire(self.sq_rung()) };
        if rung > index + 1 {
            let newest = rung - 1;
            let halfway = index + (newest - index) / 2;
            let cq = self.cq();
            let (ahead, half) = (cq.peek_relaxed(newest), cq.peek_relaxed(halfway));
            for (i, tail) in [(newest, ahead), (halfway, half)] {
                // Consumed (success or error); a CQE of a format this crate cannot read stays
                // for the wait below to report.
                if let Some(Ok(()) | Err(WaitError::Cqe(_))) = cq.complete_seen(i, tail) {
                    return Ok(());
                }
            }
        }
        self.wait_until(index, false)
    }

    /// Writes segments at WQE `index`.
    #[inline(always)]
    fn write_wqe(&self, index: u64, segs: &[[u64; 2]]) {
        let p = self.wqe_ptr(index);
        for (i, s) in segs.iter().enumerate() {
            // SAFETY: `index` was reserved by the caller; a WQE of at most 4 segments stays in
            // its 64-byte slot of the ring.
            unsafe { arch::store_seg(p.add(2 * i), *s) };
        }
    }

    #[inline(always)]
    fn ctrl(&self, opcode: WqeOpcode, index: u64, ds: u8, flags: u8) -> [u64; 2] {
        self.ctrl_imm(opcode, index, ds, flags, 0)
    }

    /// A control segment carrying immediate data `imm` (SEND_IMM, RDMA_WRITE_IMM).
    #[inline(always)]
    fn ctrl_imm(&self, opcode: WqeOpcode, index: u64, ds: u8, flags: u8, imm: u32) -> [u64; 2] {
        CtrlSeg::new(opcode, 0, index as u16, self.qpn(), ds, SIGNALED | flags, imm).to_words()
    }

    /// Writes a NOP at reserved slot `index` (`flags`: extra `fm_ce_se` bits, e.g. a fence).
    #[inline(always)]
    pub fn wqe_prepare_nop(&self, index: u64, flags: u8) {
        self.write_wqe(index, &[self.ctrl(WqeOpcode::Nop, index, ring::DS_NOP, flags)]);
    }

    /// Writes an RDMA WRITE of `len` bytes from `src` to `dst` at reserved slot `index`.
    #[inline(always)]
    pub fn wqe_prepare_write(&self, index: u64, dst: Remote, src: Local, len: u32, flags: u8) {
        self.prepare_rdma(WqeOpcode::RdmaWrite, index, dst, src, len, flags);
    }

    /// Writes an RDMA WRITE at reserved slot `index` gathered from two local buffers: the
    /// `first.1` bytes at `first.0`, then the `second.1` bytes at `second.0`, landing
    /// contiguously at `dst` (a message and a trailer kept elsewhere, as one WRITE whose last
    /// bytes are the trailer's). Both lengths are non-zero (a data segment's 0 means 2 GiB to
    /// a ConnectX) and their sum at most the QP's largest message; one 64-byte WQE.
    #[inline(always)]
    pub fn wqe_prepare_write_gather(
        &self,
        index: u64,
        dst: Remote,
        first: (Local, u32),
        second: (Local, u32),
        flags: u8,
    ) {
        self.write_wqe(
            index,
            &[
                self.ctrl(WqeOpcode::RdmaWrite, index, ring::DS_RDMA_GATHER2, flags),
                RaddrSeg::new(dst.addr, dst.rkey).to_words(),
                DataSeg::new(first.1, first.0.lkey, first.0.addr).to_words(),
                DataSeg::new(second.1, second.0.lkey, second.0.addr).to_words(),
            ],
        );
    }

    /// Writes an RDMA WRITE with immediate data at reserved slot `index`: `len` bytes from
    /// `src` land at `dst`, then the peer's next receive completes with `imm` and the count.
    #[inline(always)]
    pub fn wqe_prepare_write_imm(&self, index: u64, dst: Remote, src: Local, len: u32, imm: u32, flags: u8) {
        self.prepare_rdma_imm(WqeOpcode::RdmaWriteImm, index, dst, src, len, flags, imm);
    }

    /// Writes a SEND of `len` bytes from `src` at reserved slot `index` (with `imm`: a SEND
    /// with immediate data): they land in the buffers of the peer's next receive. 0 bytes
    /// take no data segment.
    #[inline(always)]
    pub fn wqe_prepare_send(&self, index: u64, src: Local, len: u32, imm: Option<u32>, flags: u8) {
        let opcode = if imm.is_some() {
            WqeOpcode::SendImm
        } else {
            WqeOpcode::Send
        };
        let imm = imm.unwrap_or(0);
        if len == 0 {
            let ds = ring::ds_send_inline(0);
            return self.write_wqe(index, &[self.ctrl_imm(opcode, index, ds, flags, imm)]);
        }
        self.write_wqe(
            index,
            &[
                self.ctrl_imm(opcode, index, ring::DS_SEND, flags, imm),
                DataSeg::new(len, src.lkey, src.addr).to_words(),
            ],
        );
    }

    /// Writes a SEND carrying `data` inline (at most [`MAX_SEND_INLINE`] bytes) at `index`,
    /// with immediate data when `imm` is given.
    #[inline(always)]
    pub fn wqe_prepare_send_inline(
        &self,
        index: u64,
        data: &[u8],
        imm: Option<u32>,
        flags: u8,
    ) -> Result<(), PostError> {
        check_inline(data, MAX_SEND_INLINE)?;
        let opcode = if imm.is_some() {
            WqeOpcode::SendImm
        } else {
            WqeOpcode::Send
        };
        // Segments 1..=3 hold the inline header and up to 44 payload bytes.
        let [a, b, c] = inline_segments(data);
        let ds = ring::ds_send_inline(data.len());
        let segs = [self.ctrl_imm(opcode, index, ds, flags, imm.unwrap_or(0)), a, b, c];
        self.write_wqe(index, &segs[..ds as usize]);
        Ok(())
    }

    /// An RDMA WRITE or READ: control, remote address, one data segment (the local buffer).
    #[inline(always)]
    fn prepare_rdma(&self, opcode: WqeOpcode, index: u64, remote: Remote, local: Local, len: u32, flags: u8) {
        self.prepare_rdma_imm(opcode, index, remote, local, len, flags, 0)
    }

    /// [`prepare_rdma`](Self::prepare_rdma) with immediate data in the control segment.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn prepare_rdma_imm(
        &self,
        opcode: WqeOpcode,
        index: u64,
        remote: Remote,
        local: Local,
        len: u32,
        flags: u8,
        imm: u32,
    ) {
        self.write_wqe(
            index,
            &[
                self.ctrl_imm(opcode, index, ring::DS_RDMA, flags, imm),
                RaddrSeg::new(remote.addr, remote.rkey).to_words(),
                DataSeg::new(len, local.lkey, local.addr).to_words(),
            ],
        );
    }

    /// Writes an RDMA WRITE carrying `data` inline (at most [`MAX_INLINE`] bytes) at `index`.
    #[inline(always)]
    pub fn wqe_prepare_write_inline(&self, index: u64, dst: Remote, data: &[u8], flags: u8) -> Result<(), PostError> {
        check_inline(data, MAX_INLINE)?;
        // Segments 2 and 3 hold the inline header and up to 28 payload bytes; 0 bytes take no
        // inline segment at all (`ring::ds_write_inline`), as rdma-core posts them.
        let [a, b, _] = inline_segments(data);
        let ds = ring::ds_write_inline(data.len());
        let segs = [
            self.ctrl(WqeOpcode::RdmaWrite, index, ds, flags),
            RaddrSeg::new(dst.addr, dst.rkey).to_words(),
            a,
            b,
        ];
        self.write_wqe(index, &segs[..ds as usize]);
        Ok(())
    }

    /// Writes an RDMA READ of `len` bytes from `src` into `dst` at reserved slot `index`.
    #[inline(always)]
    pub fn wqe_prepare_read(&self, index: u64, dst: Local, src: Remote, len: u32, flags: u8) {
        self.prepare_rdma(WqeOpcode::RdmaRead, index, src, dst, len, flags);
    }

    /// Writes an 8-byte atomic on `target` at reserved slot `index`; the old value lands in the
    /// 8 bytes at `result`, in the QP's [`atomic_reply_order`](Self::atomic_reply_order).
    /// `target.addr` must be 8-byte aligned (the high-level functions check it; a NIC fails a
    /// misaligned atomic with an error CQE).
    #[inline(always)]
    pub fn wqe_prepare_atomic(&self, index: u64, op: AtomicOp, target: Remote, result: Local, flags: u8) {
        let (opcode, seg) = match op {
            AtomicOp::FetchAdd(add) => (WqeOpcode::AtomicFa, AtomicSeg::fetch_add(add)),
            AtomicOp::CompareSwap { compare, swap } => (WqeOpcode::AtomicCs, AtomicSeg::compare_swap(compare, swap)),
        };
        self.write_wqe(
            index,
            &[
                self.ctrl(opcode, index, ring::DS_ATOMIC, flags),
                RaddrSeg::new(target.addr, target.rkey).to_words(),
                seg.to_words(),
                DataSeg::new(8, result.lkey, result.addr).to_words(),
            ],
        );
    }

    /// Writes a DUMP at reserved slot `index`: the HCA reads the `len` bytes at `local` and
    /// completes. With a fence mode in `flags` it completes only after the earlier READs and
    /// atomics, which is how a reader makes their data visible where GPUDirect RDMA writes are
    /// not ordered for it (see [`QP_FLUSH_AFTER_FETCH`]).
    #[inline(always)]
    pub fn wqe_prepare_dump(&self, index: u64, local: Local, len: u32, flags: u8) {
        self.write_wqe(
            index,
            &[
                self.ctrl(WqeOpcode::Dump, index, ring::DS_DUMP, flags),
                DataSeg::new(len, local.lkey, local.addr).to_words(),
            ],
        );
    }

    /// Writes a WAIT at reserved slot `index`, on a cross-channel QP (`QpConfig::cross_channel`
    /// on the host; elsewhere the HCA fails it): this QP's send queue stops there until CQ
    /// `cqn` has produced its CQE of index `cqe` (the low 32 bits travel), then goes on.
    #[inline(always)]
    pub fn wqe_prepare_wait(&self, index: u64, cqn: u32, cqe: u64, flags: u8) {
        self.write_wqe(
            index,
            &[
                self.ctrl(WqeOpcode::Wait, index, ring::DS_WAIT, flags),
                WaitSeg::new(cqn, cqe).to_words(),
            ],
        );
    }

    /// Declares WQEs `start..end` written, in reservation order: waits (bounded) until every
    /// earlier reservation is ready, then advances `sq_ready` to `end`.
    #[inline(always)]
    pub fn mark_ready(&self, start: u64, end: u64) -> Result<(), WaitError> {
        if M::SHARED {
            let mut deadline = self.deadline();
            // SAFETY: counters of the live handle.
            while unsafe { M::load_acquire(self.sq_ready()) } != start {
                if deadline.expired() {
                    return Err(WaitError::Timeout { index: start });
                }
            }
        }
        // SAFETY: a counter (or the lock) of the live handle (`from_raw`), touched only through `M`'s atomics.
        unsafe { M::store_release(self.sq_ready(), end) };
        Ok(())
    }

    /// Makes the HCA see every ready WQE up to at least `pi` (which the caller marked ready).
    /// In exclusive mode it fails only for a handle that names no doorbell kind (`post_group`
    /// relies on that).
    #[inline(always)]
    pub fn submit(&self, pi: u64) -> Result<(), PostError> {
        let kind = DoorbellKind::from_raw(self.k.doorbell_kind);
        match kind {
            // CPU-assisted posters do all a GPU doorbell does; only the doorbell's address is
            // a host word, which the proxy forwards to the UAR.
            Some(DoorbellKind::Gpu) if !M::SHARED && self.blueflame && self.lone_wqe(pi) => {
                self.ring_blueflame(pi);
                // SAFETY: a counter of the live handle, touched only through `M`'s atomics.
                unsafe { M::store_release(self.sq_rung(), pi) };
                Ok(())
            }
            Some(DoorbellKind::Gpu | DoorbellKind::CpuAssisted) if !M::SHARED => {
                self.ring(pi);
                // SAFETY: a counter (or the lock) of the live handle (`from_raw`), touched only through `M`'s atomics.
                unsafe { M::store_release(self.sq_rung(), pi) };
                Ok(())
            }
            Some(DoorbellKind::Gpu | DoorbellKind::CpuAssisted) => {
                let mut deadline = self.deadline();
                loop {
                    // SAFETY: counters and lock of the live handle.
                    if unsafe { M::load_acquire(self.sq_rung()) } >= pi {
                        return Ok(()); // someone rang for us
                    }
                    if unsafe { M::try_lock(self.db_lock()) } {
                        // SAFETY: a counter (or the lock) of the live handle (`from_raw`), touched only through `M`'s atomics.
                        let ready = unsafe { M::load_acquire(self.sq_ready()) };
                        if ready > unsafe { M::load_acquire(self.sq_rung()) } {
                            self.ring(ready);
                            unsafe { M::store_release(self.sq_rung(), ready) };
                        }
                        // SAFETY: a counter (or the lock) of the live handle (`from_raw`), touched only through `M`'s atomics.
                        unsafe { M::unlock(self.db_lock()) };
                        return Ok(());
                    }
                    if deadline.expired() {
                        return Err(WaitError::Timeout { index: pi }.into());
                    }
                }
            }
            Some(DoorbellKind::CpuProxy) => {
                let ready = if M::SHARED {
                    // SAFETY: a counter (or the lock) of the live handle (`from_raw`), touched only through `M`'s atomics.
                    unsafe { M::load_acquire(self.sq_ready()) }
                } else {
                    pi
                };
                arch::to_device_barrier();
                let word = self.k.doorbell as *mut u64;
                // SAFETY: the proxy word is a valid host-visible u64 per the handle; the
                // counter belongs to the live handle.
                unsafe {
                    if M::SHARED {
                        // Posters publish concurrently: the word only ever rises.
                        arch::fetch_max_sys(word, ready.max(pi));
                    } else {
                        // The only poster publishes rising indices: a posted store, where an
                        // atomic on host memory waits a PCIe round trip for its answer.
                        arch::store_sys(word, pi);
                    }
                    M::fetch_max(self.sq_rung(), ready.max(pi));
                }
                Ok(())
            }
            None => Err(PostError::BadHandle),
        }
    }

    /// Writes the send doorbell record and rings the doorbell with producer index `pi`, with no
    /// serialisation: for exclusive use, or by the holder of the doorbell lock.
    ///
    /// The order is DOCA GPUNetIO's for ConnectX: fence, doorbell, record, fence, doorbell.
    /// The doorbell carries the producer index, so the HCA needs only the WQEs before it (the
    /// first fence) and starts at once, instead of after the record has also reached memory.
    /// The record serves the HCA's doorbell recovery; the second doorbell, ordered after it,
    /// covers an HCA that recovered in between (it read a record behind the first doorbell).
    /// One fence less than record, fence, doorbell with a release store to the record, and the
    /// doorbell leaves a fence earlier: a put's one-way latency through the soft HCA went from
    /// 8.0 to 5.5 us on an H100 (docs/figures.md).
    ///
    /// A QP with a reliable doorbell ([`DevQp::no_doorbell_record`]) has no recovery to cover:
    /// fence, doorbell. No fence after it: that one waited for the doorbell's store to reach
    /// host memory (a PCIe round trip) before the poster went on, so a thread posting 64 KiB
    /// WRITEs one after another moved 15.7 GB/s with it and 25.0 without (2 x H200, the
    /// socket perftest's reference; docs/figures.md, "Credits and the doorbell's last fence");
    /// 64 B latency did not move there. The next doorbell's first fence orders it.
    #[inline(always)]
    pub fn ring(&self, pi: u64) {
        // SAFETY: the record and doorbell addresses come from the live handle.
        unsafe {
            let doorbell = self.k.doorbell as *mut u64;
            let word = doorbell::word(self.qpn(), pi);
            let (gpu, fence) = (self.k.rings_in_gpu_memory, || self.doorbell_fence());
            fence();
            arch::mmio_store(doorbell, word);
            // A QP without a record names none in its handle (address 0): the address is needed
            // here anyway, where testing a flag kept another value live across every post and
            // cost the shared paths up to 7 registers.
            let record = self.k.sq_dbrec as *mut u32;
            if record.is_null() {
                return;
            }
            arch::store_dbrec(record, dbrec::wq_counter(pi).to_be(), gpu);
            fence();
            arch::mmio_store(doorbell, word);
        }
    }

    /// The fence before a doorbell (and between record and doorbell): its scope is the memory
    /// the HCA reads the WQEs and the record from.
    #[inline(always)]
    fn doorbell_fence(&self) {
        if self.k.rings_in_gpu_memory {
            arch::to_device_barrier_gpu()
        } else {
            arch::to_device_barrier()
        }
    }

    /// Whether ringing for `pi` announces exactly one WQE (exclusive use: `sq_rung` is ours).
    #[inline(always)]
    fn lone_wqe(&self, pi: u64) -> bool {
        // SAFETY: a counter of the live handle.
        (unsafe { M::load_acquire(self.sq_rung()) }) + 1 == pi
    }

    /// [`ring`](Self::ring) for the lone WQE `pi - 1` as a BlueFlame write: fence, record (if
    /// the QP has one), fence, then the WQE's 64 bytes into the doorbell register, its control
    /// segment first (whose first 8 bytes are what rdma-core rings with: its index and size, so
    /// the HCA knows where the send queue ends). Exclusive use, or the holder of the lock.
    #[inline(always)]
    fn ring_blueflame(&self, pi: u64) {
        let wqe = self.wqe_ptr(pi - 1) as *const u64;
        // SAFETY: the record, the doorbell register (a BlueFlame register of at least 64
        // bytes, the handle's contract for a poster-rung QP) and the WQE's block of the live
        // send queue, which this poster wrote and marked ready.
        unsafe {
            let (gpu, fence) = (self.k.rings_in_gpu_memory, || self.doorbell_fence());
            fence();
            let record = self.k.sq_dbrec as *mut u32;
            if !record.is_null() {
                arch::store_dbrec(record, dbrec::wq_counter(pi).to_be(), gpu);
                fence();
            }
            // Read back with plain loads (this thread wrote it): from GPU memory an L2 hit, from
            // host memory eight reads across PCIe, which is why BlueFlame belongs with rings in
            // GPU memory (docs/connectx-conformance.md).
            let register = self.k.doorbell as *mut u64;
            for i in 0..gdaki_layout::SEND_WQE_BB / 8 {
                arch::mmio_store(register.add(i), wqe.add(i).read());
            }
        }
    }

    // ---------------------------------------------------------------- rung by another agent

    /// Declares WQEs up to `pi` (marked ready) handed to an agent that rings for them
    /// (with the stores of [`DoorbellWrites`]): nothing here rings for them again, and a
    /// later [`reserve`](Self::reserve) may look for their completions. Exclusive use.
    #[inline(always)]
    pub fn note_rung(&self, pi: u64) {
        // SAFETY: a counter of the live handle, touched only through `M`'s atomics.
        unsafe { M::store_release(self.sq_rung(), pi) };
    }

    /// WQEs reserved so far (the next WQE's index).
    #[inline(always)]
    pub fn reserved(&self) -> u64 {
        // SAFETY: a counter of the live handle, touched only through `M`'s atomics.
        unsafe { M::load_acquire(self.sq_reserved()) }
    }

    /// CQEs consumed so far: every WQE before this index has completed and its slot is free.
    #[inline(always)]
    pub fn consumed(&self) -> u64 {
        // SAFETY: a counter of the live handle, touched only through `M`'s atomics.
        unsafe { M::load_acquire(self.cq_consumed()) }
    }

    // ---------------------------------------------------------------- low level: completions

    /// Consumes the oldest unconsumed CQE if it is there: `Some(Ok(index))`, `Some(Err(..))`
    /// for an error CQE (or one of a format this crate does not read, left unconsumed), `None`
    /// if the HCA has not written it.
    #[inline(always)]
    pub fn poll_one(&self) -> Option<Result<u64, WaitError>> {
        let index = self.consumed();
        self.cq().try_complete(index).map(|r| r.map(|()| index))
    }

    /// Waits (bounded) until WQE `index` has completed: success, its error (or the QP's earlier
    /// one), or a timeout. Works whoever else polls the same CQ. `index` must be a posted WQE
    /// (a ticket) or within one ring of the consumed count.
    #[inline(always)]
    pub fn poll_at(&self, index: u64) -> Result<(), WaitError> {
        self.wait_until(index, true)
    }

    /// Waits (bounded) until WQE `index` has completed; with `report_errors`, its error (or the
    /// QP's earlier one) is the result, without, any completion is success.
    #[inline(always)]
    fn wait_until(&self, index: u64, report_errors: bool) -> Result<(), WaitError> {
        let mut deadline = self.deadline();
        let mut rang = false;
        loop {
            // Already consumed (by anyone): done, unless the QP failed at or before it.
            if self.consumed() > index {
                if !report_errors {
                    return Ok(());
                }
                return self.cq().error_at_or_before(index).map_err(WaitError::Cqe);
            }
            if let Some(outcome) = self.cq().try_complete(index) {
                return match outcome {
                    // Not a CQE this crate can read: no completion to count either way.
                    Err(e @ WaitError::CqeFormat { .. }) => Err(e),
                    _ if report_errors => outcome,
                    _ => Ok(()),
                };
            }
            if !rang {
                // Not complete: it may be a deferred post nobody rang for (see `deferred`).
                rang = true;
                match self.ring_pending() {
                    Err(PostError::Wait(e)) => return Err(e),
                    // A handle without a doorbell: the wait times out and says so.
                    _ => continue,
                }
            }
            if deadline.poll_expired() {
                return Err(WaitError::Timeout { index });
            }
        }
    }

    /// Waits (bounded by the handle's timeout) until the byte at `flag` equals `value`: how a
    /// receiver learns that a peer's put has landed (the flag is the put's last byte, written
    /// by the HCA). Spins tightly at first, since latency is the point, and backs off only after
    /// long waits (thousands of polls); each calling thread waits on its own (no group
    /// semantics). Touches no QP state.
    ///
    /// # Safety
    /// `flag` is valid for reads for the whole wait (memory the HCA writes, mapped for this
    /// device).
    #[inline(always)]
    pub unsafe fn wait_until_u8(&self, flag: *const u8, value: u8) -> Result<(), WaitError> {
        // SAFETY: per the caller's contract.
        self.wait_for_value(
            value as u64,
            || unsafe { arch::load_u8_acquire(flag) } as u64,
            |v| v == value as u64,
        )
    }

    /// Waits (bounded by the handle's timeout) until the u64 at `signal` is at least `value`:
    /// how a receiver learns that `value` signals ([`signal`](Self::signal),
    /// [`put_signal`](Self::put_signal)) have reached it, each added after its data. Waits
    /// like [`wait_until_u8`](Self::wait_until_u8), each calling thread on its own.
    ///
    /// # Safety
    /// `signal` is 8-byte aligned and valid for reads for the whole wait.
    #[inline(always)]
    pub unsafe fn wait_signal(&self, signal: *const u64, value: u64) -> Result<(), WaitError> {
        // SAFETY: per the caller's contract.
        self.wait_for_value(value, || unsafe { arch::load_u64_acquire(signal) }, |v| v >= value)
    }

    /// Polls `load` until `done` holds, bounded by the handle's timeout; `expected` is what a
    /// timeout reports. `load` is an acquire load, so a successful poll needs no barrier after
    /// it (a system fence there waited for this thread's own earlier writes to the host, the
    /// last doorbell among them: microseconds of a ping-pong's round trip).
    #[inline(always)]
    fn wait_for_value(
        &self,
        expected: u64,
        load: impl Fn() -> u64,
        done: impl Fn(u64) -> bool,
    ) -> Result<(), WaitError> {
        let mut deadline = self.deadline();
        loop {
            let found = load();
            if done(found) {
                return Ok(());
            }
            if deadline.poll_expired() {
                return Err(WaitError::Flag { expected, found });
            }
        }
    }

    // ---------------------------------------------------------------- high level

    /// Runs `f` on the leader and hands its outcome to every member. Success, the usual
    /// outcome, travels as its one word; an error (or a value equal to the marker that says
    /// "look at the whole status") takes a second broadcast of the whole status.
    #[inline(always)]
    fn on_leader(&self, f: impl FnOnce() -> Result<u64, PostError>) -> Result<u64, PostError> {
        const WHOLE_STATUS: u64 = u64::MAX;
        if S::SOLO {
            return f();
        }
        let mine = if self.scope.is_leader() {
            status::encode(f())
        } else {
            [0; 2]
        };
        let ok = mine[0] == status::CODE_OK as u64 && mine[1] != WHOLE_STATUS;
        let word = self.scope.broadcast_word(if ok { mine[1] } else { WHOLE_STATUS });
        if word != WHOLE_STATUS {
            return Ok(word);
        }
        status::decode(self.scope.broadcast(mine))
    }

    /// [`on_leader`](Self::on_leader) for a step that returns nothing: success takes one
    /// flag (a vote in a warp), an error its whole status.
    #[inline(always)]
    fn on_leader_ok(&self, f: impl FnOnce() -> Result<(), PostError>) -> Result<(), PostError> {
        if S::SOLO {
            return f();
        }
        let mine = if self.scope.is_leader() {
            status::encode(f().map(|()| 0))
        } else {
            [0; 2]
        };
        if !self.scope.broadcast_flag(mine[0] != status::CODE_OK as u64) {
            return Ok(());
        }
        status::decode(self.scope.broadcast(mine)).map(|_| ())
    }

    /// [`on_leader`](Self::on_leader) for waits.
    #[inline(always)]
    fn wait_on_leader(&self, index: u64, f: impl FnOnce() -> Result<(), WaitError>) -> Result<(), WaitError> {
        match self.on_leader(|| f().map(|()| 0).map_err(PostError::Wait)) {
            Ok(_) => Ok(()),
            Err(PostError::Wait(e)) => Err(e),
            // Only wait errors are encoded above.
            Err(_) => Err(WaitError::Timeout { index }),
        }
    }

    /// Posts `count` WQEs of this member (see [`post_group`](Self::post_group)). On the GPU,
    /// thread scope in a shared mode posts with the warp's lanes that post on the same QP at
    /// the same moment ([`Coalesced`](crate::scope::Coalesced)): one reservation and one
    /// doorbell per warp instead of a contended atomic and an in-order hand-off per thread.
    /// The ticket is then the group's last index, which covers this thread's WQEs too.
    #[inline(always)]
    fn post(&self, count: u64, write: impl FnMut(u64, u64, u8) -> Result<(), PostError>) -> Result<Ticket, PostError> {
        #[cfg(target_arch = "nvptx64")]
        if S::SOLO && M::SHARED {
            // The group reserves, writes and rings on its leader's QP: lanes on other QPs, or
            // that defer when the leader would ring, form groups of their own. The handle is
            // 8-byte aligned, so its low bit is free for the deferral.
            let key = self.ptr as u64 | self.defer as u64;
            return self
                .with_scope(crate::scope::Coalesced::sharing(key))
                .post_group(count, write);
        }
        self.post_group(count, write)
    }

    /// The group posts: each member brings `count` WQEs (0 allowed), its `k`-th written by
    /// `write(index, k, flags)`, where `flags` are the extra `fm_ce_se` bits of that WQE (the
    /// handle's fence on the first, see [`fenced`](Self::fenced)). In rounds of at most one
    /// ring, the leader reserves, members write, the leader marks ready and submits. Returns
    /// the group's last index.
    #[inline(always)]
    fn post_group(
        &self,
        count: u64,
        mut write: impl FnMut(u64, u64, u8) -> Result<(), PostError>,
    ) -> Result<Ticket, PostError> {
        let (first, total) = self.scope.scan(count);
        let ring = 1u64 << self.sq_log_size();
        let mut written = Ok(());
        let mut last = Err(PostError::BadCount { count: 0, ring });
        let mut done = 0u64;
        while done < total {
            let n = ring.min(total - done);
            let base = self.reserve_group(n)?;
            // This member's WQEs that fall in this round.
            for p in first.max(done)..(first + count).min(done + n) {
                let index = base + (p - done);
                if written.is_ok() {
                    let k = p - first;
                    written = write(index, k, if k == 0 { self.fence } else { 0 });
                }
                if written.is_err() {
                    // Keep the ring consistent: the slot must hold a valid WQE before it is ready.
                    self.wqe_prepare_nop(index, 0);
                }
            }
            self.scope.sync();
            let step = || {
                if Self::MEMBERS_READ_THE_BASE {
                    // After the barrier above every member has read the base: the counter may
                    // move on (see `reserve_group`).
                    // SAFETY: a counter of the live handle, written by the leader alone.
                    unsafe { M::store_release(self.sq_reserved(), base + n) };
                }
                self.mark_ready(base, base + n)?;
                if !self.defer {
                    self.submit(base + n)?;
                }
                Ok(())
            };
            if self.leader_step_cannot_fail() {
                if self.scope.is_leader() {
                    let stepped = step();
                    debug_assert!(stepped.is_ok());
                }
            } else {
                self.on_leader_ok(step)?;
            }
            last = Ok(base + n - 1);
            done += n;
        }
        written?;
        last
    }

    /// Whether a group's members read its reservation base themselves ([`reserve_group`]).
    ///
    /// [`reserve_group`]: Self::reserve_group
    const MEMBERS_READ_THE_BASE: bool = !S::SOLO && !M::SHARED;

    /// The group's reservation of `n` slots (`1..=` the ring's size): its first index, for
    /// every member.
    ///
    /// In exclusive mode the leader is the counter's only writer, so each member reads the base
    /// itself instead of waiting for the leader to broadcast it (a warp's post paid four
    /// shuffles for that, which ptxas wraps in convergence loops). The barrier before the read
    /// makes the leader's last store visible (its own low-level posts included), and the leader
    /// moves the counter on only after the barrier that follows the members' writes, when
    /// every member has read it: so all read one base.
    #[inline(always)]
    fn reserve_group(&self, n: u64) -> Result<u64, PostError> {
        if !Self::MEMBERS_READ_THE_BASE {
            return self.on_leader(|| self.reserve(n as u32));
        }
        self.scope.sync();
        // SAFETY: a counter of the live handle, read by every member and written by the leader
        // alone, ordered by the group's barriers (above).
        let base = unsafe { M::load_acquire(self.sq_reserved()) };
        let size = 1u64 << self.sq_log_size();
        let last = base + n - 1;
        if last >= size {
            // Every member read the same base, so all take this branch together.
            self.on_leader_ok(|| self.reclaim(last - size).map_err(PostError::from))?;
        }
        Ok(base)
    }

    /// Whether the leader's step after the group's writes (mark ready, then submit unless
    /// deferred) cannot fail, so the members need not wait to hear its outcome: in exclusive
    /// mode nothing waits for another poster, and `submit` fails only for a handle that names
    /// no doorbell kind, which every member sees in its own copy of the constants.
    #[inline(always)]
    fn leader_step_cannot_fail(&self) -> bool {
        (!M::SHARED && self.defer) || self.submit_cannot_fail()
    }

    /// Whether [`submit`](Self::submit) cannot fail: in exclusive mode on a handle that names
    /// a doorbell kind (every member sees it in its own copy of the constants).
    #[inline(always)]
    pub fn submit_cannot_fail(&self) -> bool {
        !M::SHARED && DoorbellKind::from_raw(self.k.doorbell_kind).is_some()
    }

    /// WQEs a message of `len` bytes takes (one NOP for 0 bytes), and the bytes per WQE.
    #[inline(always)]
    fn split(&self, len: u64) -> (u64, u64) {
        let max = self.max_msg_size().min(gdaki_layout::data::MAX_BYTE_COUNT as u64);
        // Most messages fit one WQE: no 64-bit division (a long sequence on a GPU) for them.
        if len <= max {
            return (1, max);
        }
        (len.div_ceil(max), max)
    }

    /// Writes WQE `k` of an RDMA WRITE or READ of `len` bytes split by `max` bytes (`len` 0:
    /// a NOP), with extra `fm_ce_se` bits `flags`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn write_chunk(
        &self,
        opcode: WqeOpcode,
        index: u64,
        k: u64,
        remote: Remote,
        local: Local,
        len: u64,
        max: u64,
        flags: u8,
    ) {
        if len == 0 {
            return self.wqe_prepare_nop(index, flags);
        }
        let off = k * max;
        self.prepare_rdma(
            opcode,
            index,
            remote.offset(off),
            local.offset(off),
            (len - off).min(max) as u32,
            flags,
        );
    }

    /// WQEs an RDMA WRITE of `len` bytes takes as [`put`](Self::put) posts it (a NOP for 0
    /// bytes): for a caller that reserves several operations' slots at once.
    #[inline(always)]
    pub(crate) fn put_wqes(&self, len: u64) -> u64 {
        self.split(len).0
    }

    /// Writes an RDMA WRITE of `len` bytes from `src` to `dst` as [`put`](Self::put) would,
    /// into the reserved slots from `index` ([`put_wqes`](Self::put_wqes) of them); the
    /// index after them.
    #[inline(always)]
    pub(crate) fn wqe_prepare_put(&self, index: u64, dst: Remote, src: Local, len: u64) -> u64 {
        let (count, max) = self.split(len);
        for k in 0..count {
            let flags = if k == 0 { self.fence } else { 0 };
            self.write_chunk(WqeOpcode::RdmaWrite, index + k, k, dst, src, len, max, flags);
        }
        index + count
    }

    /// Writes an RDMA WRITE gathered from two local buffers as [`put`](Self::put) would write a
    /// one-WQE put (its fence bits), at reserved slot `index` (see
    /// [`wqe_prepare_write_gather`](Self::wqe_prepare_write_gather)); the index after it.
    #[inline(always)]
    pub(crate) fn wqe_prepare_put_gather(
        &self,
        index: u64,
        dst: Remote,
        first: (Local, u32),
        second: (Local, u32),
    ) -> u64 {
        self.wqe_prepare_write_gather(index, dst, first, second, self.fence);
        index + 1
    }

    /// Whether fetched data (READ data, atomic results) needs a fenced DUMP before the device
    /// may read it ([`QP_FLUSH_AFTER_FETCH`]).
    #[inline(always)]
    fn flush_after_fetch(&self) -> bool {
        self.flags() & QP_FLUSH_AFTER_FETCH != 0
    }

    /// Posts an RDMA WRITE or READ of `len` bytes between `remote` and `local`, split into WQEs
    /// of at most `max_msg_size` (one NOP when `len` is 0). A READ on a QP that needs it ends
    /// with a fenced DUMP of its first local byte, whose ticket is returned.
    #[inline(always)]
    fn post_split(&self, opcode: WqeOpcode, remote: Remote, local: Local, len: u64) -> Result<Ticket, PostError> {
        let (count, max) = self.split(len);
        let dump = opcode == WqeOpcode::RdmaRead && len > 0 && self.flush_after_fetch();
        self.post_checked(self.check_split(count), count + dump as u64, |i, k, flags| {
            if k < count {
                self.write_chunk(opcode, i, k, remote, local, len, max, flags);
            } else {
                self.wqe_prepare_dump(i, local, 1, ctrl::FM_FENCE);
            }
            Ok(())
        })
    }

    /// RDMA WRITE of `len` bytes from `src` to `dst`, split into WQEs of at most
    /// `max_msg_size` bytes, at most one send queue of them ([`PostError::BadCount`] beyond,
    /// nothing posted); 0 bytes is a NOP.
    #[inline(always)]
    pub fn put(&self, dst: Remote, src: Local, len: u64) -> Result<Ticket, PostError> {
        self.post_split(WqeOpcode::RdmaWrite, dst, src, len)
    }

    /// RDMA WRITE of `data` carried in the WQE (at most [`MAX_INLINE`] bytes): no local key needed.
    #[inline(always)]
    pub fn put_inline(&self, dst: Remote, data: &[u8]) -> Result<Ticket, PostError> {
        self.post_checked(check_inline(data, MAX_INLINE), 1, |i, _, flags| {
            self.wqe_prepare_write_inline(i, dst, data, flags)
        })
    }

    /// A message of `count` WQEs fits one call: at most one send queue of them (one more
    /// for a signal or a fenced DUMP is fine), so a length like `u64::MAX` (a negative size
    /// cast) is refused at once rather than posted as billions of WQEs.
    #[inline(always)]
    fn check_split(&self, count: u64) -> Result<(), PostError> {
        let ring = 1u64 << self.sq_log_size();
        if count > ring {
            return Err(PostError::BadCount {
                count: count.min(u32::MAX as u64) as u32,
                ring,
            });
        }
        Ok(())
    }

    /// [`post`](Self::post) for a member whose own arguments were `checked`: one that failed
    /// still takes part in the collective, with nothing to post, and gets its own error.
    #[inline(always)]
    fn post_checked(
        &self,
        checked: Result<(), PostError>,
        count: u64,
        write: impl FnMut(u64, u64, u8) -> Result<(), PostError>,
    ) -> Result<Ticket, PostError> {
        let r = self.post(if checked.is_ok() { count } else { 0 }, write);
        checked?;
        r
    }

    /// [`put`](Self::put), then an atomic add of `add` at `signal`, posted together (one
    /// doorbell); RC ordering makes the signal visible only after the data. The fetched value
    /// lands in the 8-byte `scratch` (never read by gdaki). `len` 0 posts the signal alone.
    /// `signal.addr` must be 8-byte aligned.
    #[inline(always)]
    pub fn put_signal(
        &self,
        dst: Remote,
        src: Local,
        len: u64,
        signal: Remote,
        add: u64,
        scratch: Local,
    ) -> Result<Ticket, PostError> {
        let (chunks, max) = if len == 0 { (0, 0) } else { self.split(len) };
        let checked = Self::check_atomic_target(signal).and(self.check_split(chunks));
        self.post_checked(checked, chunks + 1, |i, k, flags| {
            if k < chunks {
                self.write_chunk(WqeOpcode::RdmaWrite, i, k, dst, src, len, max, flags);
            } else {
                self.wqe_prepare_atomic(i, AtomicOp::FetchAdd(add), signal, scratch, flags);
            }
            Ok(())
        })
    }

    /// An atomic add of `add` at `signal` (8-byte aligned; the fetched value lands in
    /// `scratch` and is not read, so no flush is posted for it).
    #[inline(always)]
    pub fn signal(&self, signal: Remote, add: u64, scratch: Local) -> Result<Ticket, PostError> {
        self.post_atomic(AtomicOp::FetchAdd(add), signal, scratch, false)
    }

    /// An atomic's target must be 8-byte aligned: a NIC answers a misaligned one with an error
    /// CQE whose syndrome varies by device, so the device refuses it before posting.
    #[inline(always)]
    fn check_atomic_target(target: Remote) -> Result<(), PostError> {
        if target.addr % atomic_seg::OPERAND_SIZE as u64 != 0 {
            return Err(PostError::Misaligned { addr: target.addr });
        }
        Ok(())
    }

    /// A counter that advances when an operation completes, the HCA alone doing it (DOCA
    /// GPUNetIO's `*_counter` calls, NCCL GIN's counters): posts on this QP, which must be
    /// cross-channel (`QpConfig::cross_channel`), a WAIT for `main`'s completion of `ticket`,
    /// then an atomic add of `add` at the 8-byte aligned `counter`. So `counter` grows by `add`
    /// only once `ticket` (and every earlier WQE of `main`) has completed, for a put: once the
    /// peer has the data. Nobody polls `main` for it and the poster goes on at once; a waiter
    /// watches the counter. Connect this QP to one of the same context (or to itself) for a
    /// counter in local memory, to a peer's for a remote one. The fetched value lands in the
    /// 8-byte `scratch` (never read by gdaki). Returns this QP's ticket (the add's).
    ///
    /// A CQE counts whatever its status: a failed operation advances the counter too, and
    /// `main`'s error stays for whoever waits on `main` (a later post's slot reclaim, `quiet`).
    /// A `ticket` of a deferred post counts once it is committed. Two WQEs per member in group
    /// scope, each member's WAIT on its own `ticket`.
    #[inline(always)]
    pub fn count_when_done<N: Sharing, T: Scope>(
        &self,
        main: &Qp<N, T>,
        ticket: Ticket,
        counter: Remote,
        add: u64,
        scratch: Local,
    ) -> Result<Ticket, PostError> {
        // SAFETY: a constant field of `main`'s live handle (its `from_raw`), read by value.
        let cqn = unsafe { (*main.ptr).cq.cqn };
        self.count_after_cqe(cqn, ticket, counter, add, scratch)
    }

    /// [`count_when_done`](Self::count_when_done) by CQ: the WAIT holds until CQ `cqn` has
    /// produced its CQE of index `cqe` (on a gdaki QP's CQ, its ticket).
    #[inline(always)]
    pub fn count_after_cqe(
        &self,
        cqn: u32,
        cqe: u64,
        counter: Remote,
        add: u64,
        scratch: Local,
    ) -> Result<Ticket, PostError> {
        self.post_checked(Self::check_atomic_target(counter), 2, |i, k, flags| {
            if k == 0 {
                self.wqe_prepare_wait(i, cqn, cqe, flags);
            } else {
                self.wqe_prepare_atomic(i, AtomicOp::FetchAdd(add), counter, scratch, flags);
            }
            Ok(())
        })
    }

    /// A SEND of `len` bytes from `src`: they land in the buffers of the peer's next receive,
    /// which completes with the count ([`Rq::poll`](crate::Rq::poll) on the peer). One message
    /// is one WQE, so `len` is at most `max_msg_size` ([`PostError::TooLong`] beyond, nothing
    /// posted). A peer with no receive posted answers "receiver not ready" and the HCA retries
    /// as the QP's `rnr_retry` says; a receive too small for the message fails both sides.
    #[inline(always)]
    pub fn send(&self, src: Local, len: u64) -> Result<Ticket, PostError> {
        self.post_send(src, len, None)
    }

    /// [`send`](Self::send) with 32 bits of immediate data, which the peer's receive
    /// completion carries ([`Recv::imm`](crate::Recv::imm)).
    #[inline(always)]
    pub fn send_imm(&self, src: Local, len: u64, imm: u32) -> Result<Ticket, PostError> {
        self.post_send(src, len, Some(imm))
    }

    /// A SEND of `data` carried in the WQE (at most [`MAX_SEND_INLINE`] bytes): no local key
    /// needed.
    #[inline(always)]
    pub fn send_inline(&self, data: &[u8]) -> Result<Ticket, PostError> {
        self.post_checked(check_inline(data, MAX_SEND_INLINE), 1, |i, _, flags| {
            self.wqe_prepare_send_inline(i, data, None, flags)
        })
    }

    /// One SEND WQE, if the message fits one.
    #[inline(always)]
    fn post_send(&self, src: Local, len: u64, imm: Option<u32>) -> Result<Ticket, PostError> {
        let max = self.max_msg_size().min(gdaki_layout::data::MAX_BYTE_COUNT as u64);
        let checked = if len > max {
            Err(PostError::TooLong { len, max })
        } else {
            Ok(())
        };
        self.post_checked(checked, 1, |i, _, flags| {
            self.wqe_prepare_send(i, src, len as u32, imm, flags);
            Ok(())
        })
    }

    /// An RDMA WRITE of `len` bytes from `src` to `dst` whose last WQE carries immediate data
    /// `imm`: the bytes land at `dst`, then the peer's next receive completes with `imm` and
    /// the last WQE's byte count (its buffers stay untouched). Split as [`put`](Self::put) is;
    /// only the last WQE takes a receive, and RC ordering puts every byte in place before it.
    #[inline(always)]
    pub fn write_imm(&self, dst: Remote, src: Local, len: u64, imm: u32) -> Result<Ticket, PostError> {
        let (count, max) = self.split(len);
        self.post_checked(self.check_split(count), count, |i, k, flags| {
            let off = k * max;
            let n = (len - off.min(len)).min(max) as u32;
            if k + 1 < count {
                self.prepare_rdma(WqeOpcode::RdmaWrite, i, dst.offset(off), src.offset(off), n, flags);
            } else {
                self.wqe_prepare_write_imm(i, dst.offset(off), src.offset(off), n, imm, flags);
            }
            Ok(())
        })
    }

    /// RDMA READ of `len` bytes from `src` into `dst`, split as [`put`](Self::put) is; 0
    /// bytes is a NOP.
    #[inline(always)]
    pub fn get(&self, dst: Local, src: Remote, len: u64) -> Result<Ticket, PostError> {
        self.post_split(WqeOpcode::RdmaRead, src, dst, len)
    }

    /// Posts one atomic on the 8-byte aligned `target`; once the ticket has completed, the old
    /// value is at `result` in the QP's [`atomic_reply_order`](Self::atomic_reply_order)
    /// ([`fetched`](Self::fetched) reads it). On a QP that needs it the atomic is followed by
    /// a fenced DUMP of `result`, whose ticket is returned.
    #[inline(always)]
    pub fn atomic(&self, op: AtomicOp, target: Remote, result: Local) -> Result<Ticket, PostError> {
        self.post_atomic(op, target, result, self.flush_after_fetch())
    }

    /// One atomic, then (with `flush`) a fenced DUMP of its result. A misaligned target posts
    /// nothing (but still takes part in the group's collective).
    #[inline(always)]
    fn post_atomic(&self, op: AtomicOp, target: Remote, result: Local, flush: bool) -> Result<Ticket, PostError> {
        self.post_checked(Self::check_atomic_target(target), 1 + flush as u64, |i, k, flags| {
            if k == 0 {
                self.wqe_prepare_atomic(i, op, target, result, flags);
            } else {
                self.wqe_prepare_dump(i, result, 1, ctrl::FM_FENCE);
            }
            Ok(())
        })
    }

    /// Atomic fetch-and-add; waits and returns the value before the add.
    #[inline(always)]
    pub fn atomic_fetch_add(&self, target: Remote, add: u64, result: Local) -> Result<u64, PostError> {
        let t = self.atomic(AtomicOp::FetchAdd(add), target, result)?;
        self.wait(t)?;
        // SAFETY: `result` is the caller's 8-byte, device-readable buffer (the same contract
        // every operation here has for the buffers it names), and its atomic has completed.
        Ok(unsafe { self.fetched(result) })
    }

    /// Atomic compare-and-swap; waits and returns the value found (equal to `compare` when the
    /// swap happened).
    #[inline(always)]
    pub fn atomic_compare_swap(
        &self,
        target: Remote,
        compare: u64,
        swap: u64,
        result: Local,
    ) -> Result<u64, PostError> {
        let t = self.atomic(AtomicOp::CompareSwap { compare, swap }, target, result)?;
        self.wait(t)?;
        // SAFETY: `result` is the caller's 8-byte, device-readable buffer (the same contract
        // every operation here has for the buffers it names), and its atomic has completed.
        Ok(unsafe { self.fetched(result) })
    }

    /// Reads the value an atomic posted on this QP fetched into `result`, after its ticket has
    /// completed, in the QP's [`atomic_reply_order`](Self::atomic_reply_order).
    ///
    /// # Safety
    /// `result` is an 8-byte aligned buffer readable by this device, and the atomic that wrote
    /// it has completed (its ticket waited for).
    #[inline(always)]
    pub unsafe fn fetched(&self, result: Local) -> u64 {
        arch::from_device_barrier();
        // SAFETY: per the caller's contract.
        let raw = unsafe { arch::load_u64_volatile(result.addr as *const u64) };
        self.atomic_reply_order().decode(raw)
    }

    /// Waits for the operation that returned `ticket`. In group scope the leader waits for its
    /// ticket, which is the group's (every member got the same one from the group's posts).
    #[inline(always)]
    pub fn wait(&self, ticket: Ticket) -> Result<(), WaitError> {
        self.wait_on_leader(ticket, || self.poll_at(ticket))
    }

    /// Waits for every WQE reserved on this QP so far.
    #[inline(always)]
    pub fn quiet(&self) -> Result<(), WaitError> {
        self.wait_on_leader(0, || self.quiet_here())
    }

    /// [`quiet`](Self::quiet) by the calling thread.
    #[inline(always)]
    fn quiet_here(&self) -> Result<(), WaitError> {
        // SAFETY: a counter (or the lock) of the live handle (`from_raw`), touched only through `M`'s atomics.
        let reserved = unsafe { M::load_acquire(self.sq_reserved()) };
        if reserved == 0 {
            return Ok(());
        }
        let target = reserved - 1;
        let size = 1u64 << self.sq_log_size();
        // Other posters' WQEs may be more than a lap ahead of the consumer; wait a lap at a
        // time so every polled slot holds at worst the previous lap's entry.
        loop {
            let step = target.min(self.consumed() + size - 1);
            self.wait_until(step, true)?;
            if step == target {
                return Ok(());
            }
        }
    }
}
