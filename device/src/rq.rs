//! A receive queue as the device drives it: posting receives (scatter lists of local buffers)
//! and polling their completions. The two-sided half of a queue pair; the sending half is
//! [`Qp::send`](crate::Qp::send) and friends.
//!
//! # Protocol
//! 1. [`Rq::post_recv`]: an atomic add on `rq_reserved` claims a receive slot
//!    ([`Rq::post_recvs`]: several, behind one fence and record update); on a ring wrap
//!    the slot's previous receive must have completed and its completion been polled (the
//!    receive CQ is as large as the queue: an unpolled completion still holds the CQE slot the
//!    new receive's would take). The caller waits for that (bounded) before it claims the slot,
//!    so a timeout claims nothing.
//! 2. The receive WQE is written: one data segment per buffer, ended by an
//!    [`INVALID_LKEY`](gdaki_layout::recv::INVALID_LKEY) segment when shorter than the stride.
//! 3. In reservation order, the receive counter of the doorbell record advances past it (the
//!    HCA reads it there; receives have no doorbell), then `rq_ready`.
//! 4. [`Rq::poll`]: the HCA consumes receives in posting order, one per SEND, SEND with
//!    immediate or RDMA WRITE with immediate that reaches the QP, and writes one CQE each on
//!    the receive CQ: so a receive's ticket is its CQE's index, as on the send side. The CQE
//!    says how many bytes landed, the opcode and the immediate.
//!
//! Receives are per thread in every scope (each thread posts and polls its own); a receive
//! posted by one thread may be polled by another (its ticket is all it takes).
use core::marker::PhantomData;
use core::ptr::addr_of_mut;

use gdaki_layout::cqe::Cqe64;
use gdaki_layout::data::{DataSeg, MAX_BYTE_COUNT};
use gdaki_layout::{dbrec, recv, CqeOpcode, DevRq, Segment};

use crate::arch;
use crate::cq::Cq;
use crate::qp::Local;
use crate::sharing::Sharing;
use crate::status::{PostError, Ticket, WaitError};

/// One buffer of a receive's scatter list: where the bytes land and how many it takes.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct RecvBuf {
    /// The buffer (address and local key; the key needs local write access).
    pub local: Local,
    /// Its length in bytes.
    pub len: u32,
}

/// Refuses a buffer longer than a data segment holds.
#[inline(always)]
fn check_len(mut bufs: impl Iterator<Item = RecvBuf>) -> Result<(), PostError> {
    match bufs.find(|b| b.len > MAX_BYTE_COUNT) {
        Some(b) => Err(PostError::TooLong {
            len: b.len as u64,
            max: MAX_BYTE_COUNT as u64,
        }),
        None => Ok(()),
    }
}

/// How a message reached a receive.
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub enum RecvKind {
    /// A SEND: the bytes are in the receive's buffers.
    Send,
    /// A SEND with immediate data.
    SendImm(u32),
    /// An RDMA WRITE with immediate data: the bytes went where the writer put them (the count
    /// says how many); only the immediate is here.
    WriteImm(u32),
}

impl RecvKind {
    /// The kind as the C ABI reports it: 0 SEND, 1 SEND with immediate, 2 WRITE with
    /// immediate (`GDAKI_RECV_*`).
    #[inline(always)]
    pub const fn code(&self) -> u32 {
        match self {
            RecvKind::Send => 0,
            RecvKind::SendImm(_) => 1,
            RecvKind::WriteImm(_) => 2,
        }
    }
}

/// A completed receive.
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct Recv {
    /// The receive's ticket.
    pub index: Ticket,
    /// Bytes of the message.
    pub bytes: u32,
    /// What it was, with its immediate data.
    pub kind: RecvKind,
    /// The QP number it came from.
    pub src_qpn: u32,
}

impl Recv {
    /// The immediate data, if the message carried one.
    #[inline(always)]
    pub const fn imm(&self) -> Option<u32> {
        match self.kind {
            RecvKind::Send => None,
            RecvKind::SendImm(v) | RecvKind::WriteImm(v) => Some(v),
        }
    }
}

/// The constant fields of a handle, read once (as `qp::Consts`).
#[derive(Clone, Copy)]
struct Consts {
    rq_base: u64,
    rq_dbrec: u64,
    timeout_ns: u64,
    /// The CQ's constants.
    cq: crate::cq::Consts,
    log_size: u32,
    log_stride: u32,
    gpu: bool,
}

/// A receive queue handle used in sharing mode `M`.
pub struct Rq<M: Sharing> {
    ptr: *mut DevRq,
    k: Consts,
    _mode: PhantomData<M>,
}

impl<M: Sharing> Clone for Rq<M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M: Sharing> Copy for Rq<M> {}

impl<M: Sharing> Rq<M> {
    /// Wraps an exported receive-queue handle.
    ///
    /// # Safety
    /// `ptr` points to a `DevRq` exported by the host (ring, record and CQ addresses valid for
    /// this device or thread), alive for as long as this value is used, and accessed
    /// concurrently only through this crate in the same sharing mode.
    #[inline(always)]
    pub const unsafe fn from_raw(ptr: *mut DevRq) -> Self {
        // SAFETY: `ptr` is valid (this function's contract); constant fields, read by value.
        let k = unsafe {
            Consts {
                rq_base: (*ptr).rq_base,
                rq_dbrec: (*ptr).rq_dbrec,
                timeout_ns: (*ptr).timeout_ns,
                cq: crate::cq::Consts::read(core::ptr::addr_of!((*ptr).cq)),
                log_size: (*ptr).log_size,
                log_stride: (*ptr).log_stride,
                gpu: (*ptr).rings_in_gpu_memory(),
            }
        };
        Rq {
            ptr,
            k,
            _mode: PhantomData,
        }
    }

    /// The raw handle.
    #[inline(always)]
    pub const fn as_ptr(&self) -> *mut DevRq {
        self.ptr
    }

    /// Receives the queue holds.
    #[inline(always)]
    pub const fn size(&self) -> u64 {
        1 << self.k.log_size
    }

    /// The most buffers one receive scatters into (the queue's stride).
    #[inline(always)]
    pub const fn max_bufs(&self) -> usize {
        1 << self.k.log_stride
    }

    #[inline(always)]
    fn reserved(&self) -> *mut u64 {
        // SAFETY: `ptr` is valid per `from_raw`; only the field's address is taken.
        unsafe { addr_of_mut!((*self.ptr).rq_reserved) }
    }

    /// The receive index the hardware's counter 0 stands for ([`DevRq::index_base`]).
    #[inline(always)]
    fn base(&self) -> u64 {
        // SAFETY: a word of the live handle (its hot line, which posting touches anyway). It
        // changes only while nobody posts or polls (a reset), so a plain load does.
        unsafe { arch::load_u64_volatile(addr_of_mut!((*self.ptr).index_base)) }
    }

    #[inline(always)]
    fn ready(&self) -> *mut u64 {
        // SAFETY: `ptr` is valid per `from_raw`; only the field's address is taken.
        unsafe { addr_of_mut!((*self.ptr).rq_ready) }
    }

    /// The receive CQ.
    #[inline(always)]
    fn cq(&self) -> Cq<M> {
        // SAFETY: `ptr` is valid per `from_raw`; the CQ's addresses come from its constants.
        unsafe { Cq::new(addr_of_mut!((*self.ptr).cq), self.k.cq) }.with_base(self.base())
    }

    /// Runs `look` until it answers, bounded by the handle's timeout (reported for `index`).
    #[inline(always)]
    fn until<T>(&self, index: u64, mut look: impl FnMut() -> Option<Result<T, WaitError>>) -> Result<T, WaitError> {
        let mut deadline = crate::qp::Deadline::new(self.k.timeout_ns);
        loop {
            if let Some(r) = look() {
                return r;
            }
            if deadline.poll_expired() {
                return Err(WaitError::Timeout { index });
            }
        }
    }

    /// Posts a receive scattering into `bufs` (1 to [`max_bufs`](Self::max_bufs) buffers;
    /// none posts a receive that takes only zero-byte messages). Returns its ticket.
    pub fn post_recv(&self, bufs: &[RecvBuf]) -> Result<Ticket, PostError> {
        let max = self.max_bufs();
        if bufs.len() > max {
            return Err(PostError::TooManyBufs { count: bufs.len(), max });
        }
        check_len(bufs.iter().copied())?;
        let index = self.claim(1)?;
        let base = self.base();
        self.write_wqe(index - base, bufs);
        self.mark_ready(index, 1, base)?;
        Ok(index)
    }

    /// [`post_recv`](Self::post_recv) of one buffer.
    #[inline(always)]
    pub fn post_recv_one(&self, local: Local, len: u32) -> Result<Ticket, PostError> {
        self.post_recv(&[RecvBuf { local, len }])
    }

    /// Posts `n` receives of one buffer each, `buf(i)` for the `i`-th, behind one fence and
    /// one doorbell-record update (where [`post_recv`](Self::post_recv) pays both per
    /// receive), as a chain of receive work requests is posted. Returns the first one's
    /// ticket; the others follow it. `n` larger than the queue is refused; an error posts
    /// nothing. `n` 0 posts nothing and returns the next ticket.
    pub fn post_recvs(&self, n: u32, buf: impl Fn(u32) -> RecvBuf) -> Result<Ticket, PostError> {
        let size = self.size();
        if n as u64 > size {
            return Err(PostError::BadCount { count: n, ring: size });
        }
        check_len((0..n).map(&buf))?;
        if n == 0 {
            // SAFETY: a counter of the live handle.
            return Ok(unsafe { M::load_acquire(self.reserved()) });
        }
        let index = self.claim(n as u64)?;
        let base = self.base();
        for i in 0..n {
            self.write_wqe(index + i as u64 - base, &[buf(i)]);
        }
        self.mark_ready(index, n as u64, base)?;
        Ok(index)
    }

    /// Claims `n` consecutive receive slots (at most the queue's size), first waiting
    /// (bounded) for room: a timeout then claims nothing and leaves no hole in the queue.
    fn claim(&self, n: u64) -> Result<u64, WaitError> {
        let size = self.size();
        // SAFETY: a counter of the live handle.
        let next = unsafe { M::load_acquire(self.reserved()) };
        if next + n > size {
            self.reclaim(next + n - 1 - size)?;
        }
        // SAFETY: a counter of the live handle, touched only through `M`'s atomics.
        let index = unsafe { M::fetch_add(self.reserved(), n) };
        // Only in a shared mode can another poster have claimed the freed slots in between (an
        // exclusive poster's `index` is `next`): check again.
        if M::SHARED && index + n > size {
            self.reclaim(index + n - 1 - size)?;
        }
        Ok(index)
    }

    /// Writes the WQE of the receive whose hardware index (its index less the base) is `hw`:
    /// one data segment per buffer, then a terminator where the stride has room.
    #[inline(always)]
    fn write_wqe(&self, hw: u64, bufs: &[RecvBuf]) {
        let wqe = self.k.rq_base + recv::wqe_offset(hw, self.k.log_size, self.k.log_stride);
        for i in 0..self.max_bufs().min(bufs.len() + 1) {
            let seg = match bufs.get(i) {
                Some(b) => DataSeg::new(b.len, b.local.lkey, b.local.addr),
                None => recv::terminator(),
            };
            // SAFETY: slot `index` was claimed and its previous receive has completed;
            // segment `i` lies inside the slot's `16 << log_stride` bytes.
            unsafe { arch::store_seg((wqe as *mut u64).add(2 * i), seg.to_words()) };
        }
    }

    /// Waits (bounded) until receive `index`'s slot is free: its completion was polled, so both
    /// its WQE slot and its CQE slot may be taken again (and, completions being polled in
    /// order, every slot before it).
    fn reclaim(&self, index: u64) -> Result<(), WaitError> {
        let cq = self.cq();
        // SAFETY: a counter of the live handle.
        self.until(index, || {
            (unsafe { M::load_acquire(cq.consumed()) } > index).then_some(Ok(()))
        })
    }

    /// In reservation order: announces receives `index..index + n` in the doorbell record (as
    /// the hardware counts them: less `base`), then in `rq_ready`. The record only moves
    /// forwards: each poster writes it after the one before has (`rq_ready` says so).
    fn mark_ready(&self, index: u64, n: u64, base: u64) -> Result<(), WaitError> {
        if M::SHARED {
            // SAFETY: a counter of the live handle.
            self.until(index, || {
                (unsafe { M::load_acquire(self.ready()) } == index).then_some(Ok(()))
            })?;
        }
        let next = index + n;
        // The WQEs before the record: the HCA may take a receive as soon as it sees the count.
        if self.k.gpu {
            arch::to_device_barrier_gpu();
        } else {
            arch::to_device_barrier();
        }
        // SAFETY: the receive word of the live QP's doorbell record, 4-byte aligned.
        unsafe {
            arch::store_dbrec(
                self.k.rq_dbrec as *mut u32,
                dbrec::wq_counter(next - base).to_be(),
                self.k.gpu,
            );
            M::store_release(self.ready(), next);
        }
        Ok(())
    }

    /// Looks at receive `index`'s CQE once: `None` if not written yet, else the receive or its
    /// error (consumed).
    #[inline(always)]
    pub fn try_poll(&self, index: Ticket) -> Option<Result<Recv, WaitError>> {
        let cq = self.cq();
        cq.complete_with(index, cq.peek(index), true, Self::read_recv_cqe)
            .map(|r| r.and_then(|cqe| Self::decode(index, &cqe)))
    }

    /// The words of a receive's CQE that [`Recv`] needs (source QP, immediate, byte count,
    /// opcode): four loads, issued together, of the eight (a round trip each where the CQ is in
    /// host memory).
    #[inline(always)]
    fn read_recv_cqe(slot: u64) -> Cqe64 {
        let mut words = [0u64; 8];
        for i in [3usize, 4, 5, 7] {
            // SAFETY: `slot` is a 64-byte entry of the live CQ ring, written (its owner bit
            // said so, and a barrier followed).
            words[i] = unsafe { arch::load_u64_volatile((slot as *const u64).add(i)) };
        }
        bytemuck::cast(words)
    }

    /// Waits (bounded) for receive `index` (its ticket): the message it took, or its error
    /// (a flushed receive: the QP failed; a local length error: the message was larger than
    /// its buffers).
    pub fn poll(&self, index: Ticket) -> Result<Recv, WaitError> {
        self.until(index, || self.try_poll(index))
    }

    /// Waits (bounded) for receive `index` like [`poll`](Self::poll), without reading what it
    /// took (the count, the immediate): one load of the CQE's last word, as a send's wait. For
    /// a caller that knows the message (a ping-pong); an error is still its error.
    pub fn wait(&self, index: Ticket) -> Result<(), WaitError> {
        let cq = self.cq();
        self.until(index, || cq.complete_seen(index, cq.peek(index)))
    }

    /// Whether receive `index` has completed (its CQE is written, successful or not), without
    /// consuming it: one load. For a poller that watches a later receive while the earlier ones
    /// complete (see `perf::recv_stream`); [`poll`](Self::poll) them in order afterwards.
    #[inline(always)]
    pub fn arrived(&self, index: Ticket) -> bool {
        self.cq().written(index)
    }

    /// Waits (bounded) until receive `index` has completed (its CQE is written, successful or
    /// not), without consuming it: [`arrived`](Self::arrived) in a loop. The receive keeps its
    /// slots until [`poll`](Self::poll) or [`wait`](Self::wait) consumes it, which then reports
    /// its error if it has one. For a responder that answers before it retires the receive: the
    /// consumption (a doorbell-record store) then stays off the answer's path.
    pub fn wait_arrived(&self, index: Ticket) -> Result<(), WaitError> {
        let cq = self.cq();
        self.until(index, || cq.written(index).then_some(Ok(())))
    }

    /// The ticket of the oldest receive not consumed yet: the receive the next message takes
    /// when every receive posted before it has completed and been consumed.
    #[inline(always)]
    pub fn next_to_complete(&self) -> Ticket {
        // SAFETY: a counter of the live handle.
        unsafe { M::load_acquire(self.cq().consumed()) }
    }

    /// Receives posted (reserved) and not consumed yet.
    #[inline(always)]
    pub fn outstanding(&self) -> u64 {
        // SAFETY: counters of the live handle.
        unsafe { M::load_acquire(self.reserved()) }.saturating_sub(self.next_to_complete())
    }

    /// The oldest receive not consumed yet, if its CQE is there.
    #[inline(always)]
    pub fn poll_next(&self) -> Option<Result<Recv, WaitError>> {
        self.try_poll(self.next_to_complete())
    }

    /// A successful responder CQE as a [`Recv`]; an opcode a receive cannot have is a CQE of a
    /// kind this crate does not read.
    #[inline(always)]
    fn decode(index: u64, cqe: &Cqe64) -> Result<Recv, WaitError> {
        let kind = match cqe.opcode() {
            CqeOpcode::RespSend => RecvKind::Send,
            CqeOpcode::RespSendImm => RecvKind::SendImm(cqe.imm()),
            CqeOpcode::RespWrImm => RecvKind::WriteImm(cqe.imm()),
            _ => return Err(WaitError::CqeFormat { index, format: 0 }),
        };
        Ok(Recv {
            index,
            bytes: cqe.byte_count(),
            kind,
            src_qpn: cqe.src_qpn(),
        })
    }
}
