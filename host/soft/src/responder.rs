//! The responder: executes a request against the target HCA's memory, checking everything a
//! NIC checks (the target QP's state, the rkey, bounds, access rights, atomic alignment) and
//! answering with a NAK syndrome instead of touching memory when a check fails.
use gdaki_device::Remote;
use gdaki_layout::copy::TAIL_MAX;
use gdaki_layout::{CqeOpcode, Syndrome};
use tracing::warn;

use std::sync::Arc;

use crate::completer::{self, RecvOutcome};
use crate::copier::{Copier, Pending, Way};
use crate::dma::shared_copier;
use crate::dma::Dma;
use crate::objects::{RqCursor, SoftQp, SoftRq};
use crate::{Hca, Region, RegionCache};
use gdaki_devx::Access;
use gdaki_devx::QpState;

/// An 8-byte atomic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Add.
    FetchAdd(u64),
    /// Compare and swap.
    CompareSwap {
        /// Expected.
        compare: u64,
        /// New.
        swap: u64,
    },
}

/// Whether target QP `qpn` accepts requests: it must exist and be in RTR or RTS. A target
/// that is gone or in error does not answer: the requester's transport retries run out.
/// Checked once per batch of requests.
pub(crate) fn accepts(target: Option<&SoftQp>) -> Result<(), Syndrome> {
    match target.map(|q| q.state()) {
        Some(QpState::Rtr | QpState::Rts) => Ok(()),
        _ => Err(Syndrome::TransportRetryExc),
    }
}

/// A request broke the responder's rules (an rkey, a right or a bound it does not have, a
/// misaligned atomic): as RC does (rxe's class A and C errors), the responder QP goes to error
/// too, so a peer cannot probe keys and addresses on a live QP. Said at warn, once per QP
/// (it is in error afterwards).
pub(crate) fn violated(qp: &SoftQp, s: Syndrome) {
    if !matches!(s, Syndrome::RemoteAccess | Syndrome::RemoteInvalReq) {
        return;
    }
    if qp.state() != QpState::Error {
        warn!(
            qpn = format_args!("{:#x}", qp.qpn),
            syndrome = ?s,
            "a request from the peer broke the access rules: the queue pair goes to error"
        );
    }
    qp.fail(s);
}

/// RDMA WRITE of `data` at `remote`.
pub(crate) fn write(hca: &Hca, cache: &mut RegionCache, pd: u32, remote: Remote, data: &[u8]) -> Result<(), Syndrome> {
    if data.is_empty() {
        return Ok(()); // a zero-length WRITE touches no memory, so its rkey is not checked
    }
    let r = hca
        .region(
            cache,
            pd,
            remote.rkey,
            remote.addr,
            data.len() as u64,
            Access::REMOTE_WRITE,
        )
        .ok_or(Syndrome::RemoteAccess)?;
    write_into(r, remote.addr, data)
}

/// The other side of a GPU copy with a region ([`copy_by_gpu`]): `len` bytes at `addr` in
/// memory that `dma` moves (a requester's region in this process, or a peer process's
/// allocation mapped here), and for a WRITE perhaps a short `tail` gathered after them (a
/// message's trailer from another buffer: memory, address, bytes, at most
/// [`TAIL_MAX`](gdaki_layout::copy::TAIL_MAX)).
pub(crate) struct Side<'a> {
    pub dma: &'a dyn Dma,
    pub addr: u64,
    pub len: u64,
    pub tail: Option<(&'a dyn Dma, u64, u64)>,
}

/// An RDMA WRITE into (`Way::Write`) or READ from (`Way::Read`) the region at `remote` of the
/// bytes of `other`, handed to a GPU copier (one step) when one side is device memory and the
/// other (each of its buffers) is reachable by the same GPU: the copier and the copy's
/// sequence number, not waited for. `None`: not such a pair, or nothing to move (the caller
/// moves the bytes through host memory).
pub(crate) fn copy_by_gpu(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    remote: Remote,
    way: Way,
    other: Side<'_>,
) -> Option<Result<(Arc<Copier>, u64), Syndrome>> {
    let tail_len = other.tail.map_or(0, |t| t.2);
    let len = other.len + tail_len;
    if len == 0 || (other.tail.is_some() && (way != Way::Write || tail_len > TAIL_MAX as u64)) {
        return None;
    }
    let access = match way {
        Way::Write => Access::REMOTE_WRITE,
        Way::Read => Access::REMOTE_READ,
    };
    let region = match hca.region(cache, pd, remote.rkey, remote.addr, len, access) {
        Some(r) => r.clone(),
        None => return Some(Err(Syndrome::RemoteAccess)),
    };
    let copier = shared_copier(other.dma, &*region.dma)?.clone();
    if let Some((dma, _, _)) = other.tail {
        // Both sources on the one copier's reach, or the bytes travel through host memory.
        if !shared_copier(dma, &*region.dma).is_some_and(|c| Arc::ptr_eq(c, &copier)) {
            return None;
        }
    }
    let (dst, src) = match way {
        Way::Write => (remote.addr, other.addr),
        Way::Read => (other.addr, remote.addr),
    };
    // SAFETY: the region's side lies in a live registered region this copier's GPU reaches
    // (checked above, with the right the copy needs, for the whole gather), the other side in
    // memory the caller keeps mapped until the copy is done (live registered regions, or a
    // peer's allocations whose mappings outlive their pending copies); overlap and concurrent
    // access are the application's, as with a NIC's DMA.
    let submitted = match other.tail {
        None => unsafe { copier.submit_copy(dst, src, other.len) },
        Some((_, tail_src, tail)) => unsafe { copier.submit_copy_with_tail(dst, src, other.len, tail_src, tail) },
    };
    Some(match submitted {
        Ok(seq) => Ok((copier, seq)),
        Err(_) => Err(Syndrome::RemoteOp),
    })
}

/// Where a small WRITE ([`write_small`]) goes.
pub(crate) enum SmallWrite<'c> {
    /// Handed to this GPU copier as store `.1`, which lands after the copies pending before it
    /// (and was added to them); not waited for.
    Stored(Arc<Copier>, u64),
    /// For the caller to write with the CPU into this region (checked for the WRITE), once
    /// the copies pending before it are done.
    Cpu(&'c Arc<Region>),
}

/// An RDMA WRITE of `data` (1 to [`STORE_MAX`](gdaki_layout::copy::STORE_MAX) bytes: an inline WRITE, a flag) into the region
/// at `remote`, checked as any WRITE (a bad key, range or right is `RemoteAccess`). Where the
/// region is device memory (its copier), or host memory mapped into the GPU of the copier that
/// `pending`'s copies are on, it is a store that copier lands after every descriptor posted to
/// it before (see [`Copier::submit_store`]), so nobody waits for those copies; copies pending on
/// other copiers are waited for first (a failure there is `settle_failed`). Else the caller
/// writes it ([`SmallWrite::Cpu`]), after settling what is pending.
pub(crate) fn write_small<'c>(
    hca: &Hca,
    cache: &'c mut RegionCache,
    pd: u32,
    remote: Remote,
    data: &[u8],
    pending: &mut Pending,
    settle_failed: Syndrome,
) -> Result<SmallWrite<'c>, Syndrome> {
    let len = data.len() as u64;
    let region = hca
        .region(cache, pd, remote.rkey, remote.addr, len, Access::REMOTE_WRITE)
        .ok_or(Syndrome::RemoteAccess)?;
    let copier = match (region.dma.gpu_copier(), pending.only_copier()) {
        (Some(own), _) => own.clone(),
        (None, Some(p)) if region.dma.gpu_mapped() => p.clone(),
        _ => return Ok(SmallWrite::Cpu(region)),
    };
    pending.before_store(&copier).map_err(|_| settle_failed)?;
    // SAFETY: the bytes lie in a live registered region with the remote-write right that this
    // copier's GPU reaches (checked above); concurrent access is the application's, as with a
    // NIC's DMA.
    let seq = unsafe { copier.submit_store(remote.addr, data) }.map_err(|_| Syndrome::RemoteOp)?;
    pending.add(&copier, seq, Way::Write);
    Ok(SmallWrite::Stored(copier, seq))
}

/// The CPU's write of `data` at `addr` into `region` (checked for it by the caller).
pub(crate) fn write_into(region: &Region, addr: u64, data: &[u8]) -> Result<(), Syndrome> {
    region.dma.write(addr, data).map_err(|_| Syndrome::RemoteOp)
}

/// RDMA READ of `out.len()` bytes at `remote` into `out`.
pub(crate) fn read(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    remote: Remote,
    out: &mut [u8],
) -> Result<(), Syndrome> {
    if out.is_empty() {
        return Ok(());
    }
    let r = hca
        .region(
            cache,
            pd,
            remote.rkey,
            remote.addr,
            out.len() as u64,
            Access::REMOTE_READ,
        )
        .ok_or(Syndrome::RemoteAccess)?;
    r.dma.read(remote.addr, out).map_err(|_| Syndrome::RemoteOp)
}

/// An 8-byte atomic at `remote` (native byte order in memory); returns the old value.
/// Serialised per HCA, which is IB's atomicity guarantee.
pub(crate) fn atomic(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    remote: Remote,
    op: AtomicOp,
) -> Result<u64, Syndrome> {
    if remote.addr % 8 != 0 {
        return Err(Syndrome::RemoteInvalReq);
    }
    let r = hca
        .region(cache, pd, remote.rkey, remote.addr, 8, Access::REMOTE_ATOMIC)
        .ok_or(Syndrome::RemoteAccess)?;
    let _serial = gdaki_devx::util::lock(&hca.atomics);
    match op {
        AtomicOp::FetchAdd(add) => r.dma.fetch_add(remote.addr, add),
        AtomicOp::CompareSwap { compare, swap } => r.dma.compare_swap(remote.addr, compare, swap),
    }
    .map_err(|_| Syndrome::RemoteOp)
}

/// A message that consumes a receive at the responder.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Message<'a> {
    /// A SEND (with immediate data when `imm` is given): `data` is scattered into the receive.
    Send {
        /// The payload.
        data: SendData<'a>,
        /// The immediate data.
        imm: Option<u32>,
    },
    /// An RDMA WRITE with immediate data whose `bytes` have been written already: the receive
    /// only completes.
    WriteImm {
        /// Bytes the WRITE carried.
        bytes: u32,
        /// The immediate data.
        imm: u32,
    },
}

/// Where a SEND's payload is.
#[derive(Clone, Copy)]
pub(crate) enum SendData<'a> {
    /// Bytes in host memory (inline, gathered, or received from a remote peer).
    Bytes(&'a [u8]),
    /// `len` bytes at `addr` of a requester's region in this process that `dma` moves: a
    /// receive buffer that the same GPU copier reaches gets them by a GPU copy, never through
    /// host memory.
    InPlace {
        /// The source region's memory.
        dma: &'a dyn Dma,
        /// The first byte.
        addr: u64,
        /// How many.
        len: u32,
    },
}

impl std::fmt::Debug for SendData<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendData::Bytes(b) => write!(f, "Bytes({})", b.len()),
            SendData::InPlace { addr, len, .. } => write!(f, "InPlace({addr:#x}, {len})"),
        }
    }
}

impl SendData<'_> {
    /// The payload's length.
    pub(crate) fn len(&self) -> usize {
        match self {
            SendData::Bytes(b) => b.len(),
            SendData::InPlace { len, .. } => *len as usize,
        }
    }
}

/// A QP's receive queue held by a responder: the lock every writer of its receive CQ takes (so
/// its CQEs go in receive order), taken once for as many messages as arrive together, and the
/// responder's place in it.
pub(crate) struct Receiving<'q> {
    cursor: std::sync::MutexGuard<'q, RqCursor>,
    qp: &'q SoftQp,
    rq: &'q SoftRq,
    /// Receives taken whose completions wait, in receive order: the first for its payload's
    /// GPU copy, the others behind it. Written when the queue is let go (`Drop`), still
    /// under its lock, so receive CQEs stay in receive order.
    pending: Vec<PendingReceive>,
}

/// A receive's completion that waits (see [`Receiving::pending`]).
struct PendingReceive {
    index: u64,
    outcome: RecvOutcome,
    /// The copy its bytes wait for.
    copy: Option<(Arc<Copier>, u64)>,
}

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        for p in self.pending.drain(..) {
            let mut outcome = p.outcome;
            if let Some((copier, seq)) = p.copy {
                if copier.settle(seq).is_err() {
                    // The bytes may never land (the copier broke): the receive fails.
                    self.qp.fail(Syndrome::LocalAccess);
                    outcome = RecvOutcome::Error(Syndrome::LocalAccess);
                }
            }
            completer::complete_receive(self.qp, self.rq, p.index, outcome);
        }
    }
}

impl<'q> Receiving<'q> {
    /// Holds `qp`'s receive queue. A QP without one cannot take a message: the requester gets
    /// the syndrome of its NAK.
    pub(crate) fn hold(qp: &'q SoftQp) -> Result<Self, Syndrome> {
        let Some(rq) = &qp.rq else {
            return Err(Syndrome::RemoteInvalReq);
        };
        Ok(Receiving {
            cursor: gdaki_devx::util::lock(&rq.taken),
            qp,
            rq,
            pending: Vec::new(),
        })
    }

    /// Whether a receive waits for the next message: `Ok(false)` is "receiver not ready" (the
    /// requester retries after the QP's RNR timer, as its `rnr_retry` allows). A receive
    /// record that claims more than the ring holds fails the QP, and the requester gets the
    /// syndrome of its NAK.
    pub(crate) fn ready(&mut self) -> Result<bool, Syndrome> {
        let qp = self.qp;
        if self.cursor.known > 0 {
            return Ok(true);
        }
        match self.rq.waiting(self.cursor.taken) {
            Some(n) => {
                self.cursor.known = n;
                Ok(n > 0)
            }
            None => {
                warn!(
                    qpn = format_args!("{:#x}", qp.qpn),
                    "the receive counter is more than a ring ahead of the receives taken"
                );
                qp.fail(Syndrome::LocalQpOp);
                Err(Syndrome::RemoteOp)
            }
        }
    }
}

/// [`Receiving::hold`] and [`Receiving::ready`] for one message: the held queue if a receive
/// waits for it, `Ok(None)` if none does.
pub(crate) fn take_receive(qp: &SoftQp) -> Result<Option<Receiving<'_>>, Syndrome> {
    let mut r = Receiving::hold(qp)?;
    Ok(r.ready()?.then_some(r))
}

/// How many cache lines of receive WQEs ahead of the one it takes the responder asks for.
const RECV_LINES_AHEAD: u64 = 2;

/// Delivers `msg` from QP `src_qpn` into the next receive of `taken`, a responder QP's held
/// receive queue (of HCA `hca`), which [`Receiving::ready`] said is there: scatters a SEND's
/// payload into its buffers (each checked: key, PD, bounds, local write), then writes its
/// responder CQE. A receive that cannot take the message completes in
/// error and the responder QP goes to error (its later receives are flushed), as RC does:
/// too small a receive is a local length error here and an invalid request for the requester;
/// a malformed receive or a buffer it may not write is a local QP or protection error here and
/// a remote operation error there. Returns the requester's syndrome, or on success the GPU copy
/// that is still moving the payload (`InPlace` payloads): the receive completes once it is
/// done (when `taken` is let go), and the requester's WQE must wait for it too.
pub(crate) fn deliver(
    hca: &Hca,
    cache: &mut RegionCache,
    taken: &mut Receiving<'_>,
    msg: Message<'_>,
    src_qpn: u32,
) -> Result<Option<(Arc<Copier>, u64)>, Syndrome> {
    let index = taken.cursor.taken;
    let (qp, rq) = (taken.qp, taken.rq);
    // The receive WQEs two lines on, when posted: the receiver's core wrote them last.
    let ahead = RECV_LINES_AHEAD * (64 / gdaki_layout::recv::wqe_size(rq.log_stride) as u64).max(1);
    if taken.cursor.known > ahead {
        crate::prefetch::for_read(rq.wqe_addr(index + ahead));
    }
    let (outcome, copy, result) = match scatter(hca, cache, qp, rq, index, msg) {
        Ok((bytes, copy)) => {
            let (opcode, imm) = match msg {
                Message::Send { imm: None, .. } => (CqeOpcode::RespSend, 0),
                Message::Send { imm: Some(v), .. } => (CqeOpcode::RespSendImm, v),
                Message::WriteImm { imm, .. } => (CqeOpcode::RespWrImm, imm),
            };
            let outcome = RecvOutcome::Success {
                bytes,
                opcode,
                imm,
                src_qpn,
            };
            (outcome, copy.clone(), Ok(copy))
        }
        Err((here, there)) => {
            qp.fail(here);
            (RecvOutcome::Error(here), None, Err(there))
        }
    };
    if copy.is_some() || !taken.pending.is_empty() {
        taken.pending.push(PendingReceive { index, outcome, copy });
    } else {
        completer::complete_receive(qp, rq, index, outcome);
    }
    taken.cursor.taken += 1;
    taken.cursor.known = taken.cursor.known.saturating_sub(1);
    result
}

/// Moves a message into receive `index`: its byte count and the GPU copy of its payload still
/// under way, or the syndromes of the failure (this side's, the requester's).
#[allow(clippy::type_complexity)]
fn scatter(
    hca: &Hca,
    cache: &mut RegionCache,
    qp: &SoftQp,
    rq: &SoftRq,
    index: u64,
    msg: Message<'_>,
) -> Result<(u32, Option<(Arc<Copier>, u64)>), (Syndrome, Syndrome)> {
    let (wqe, len) = rq.wqe(index);
    let list = gdaki_layout::recv::parse(&wqe[..len]).map_err(|_| (Syndrome::LocalQpOp, Syndrome::RemoteOp))?;
    let data = match msg {
        Message::WriteImm { bytes, .. } => return Ok((bytes, None)),
        Message::Send { data, .. } => data,
    };
    let total = data.len();
    if list.total_len() < total as u64 {
        return Err((Syndrome::LocalLength, Syndrome::RemoteInvalReq));
    }
    let fault = |_| (Syndrome::LocalAccess, Syndrome::RemoteOp);
    // The newest GPU copy of the payload (one copier's copies complete in order, so its last
    // one done means all are).
    let mut copying: Option<(Arc<Copier>, u64)> = None;
    let mut at = 0usize;
    for s in list.as_slice() {
        if at == total {
            break;
        }
        let n = (s.length as usize).min(total - at);
        let region = hca
            .region(cache, qp.pd, s.lkey, s.addr, n as u64, Access::LOCAL_WRITE)
            .ok_or((Syndrome::LocalProt, Syndrome::RemoteOp))?;
        match data {
            SendData::Bytes(bytes) => region.dma.write(s.addr, &bytes[at..at + n]).map_err(fault)?,
            SendData::InPlace { .. } if n == 0 => {}
            SendData::InPlace { dma, addr, .. } => match shared_copier(dma, &*region.dma) {
                Some(copier) => {
                    if let Some((other, seq)) = copying.take_if(|(c, _)| !Arc::ptr_eq(c, copier)) {
                        other.settle(seq).map_err(fault)?;
                    }
                    // SAFETY: the receive buffer lies in a live registered region that this
                    // copier reaches (checked above, with local write), the source in the
                    // requester's live region it reaches too (`shared_copier`); the two are
                    // the applications', who may not touch them until the completions say so.
                    let seq = unsafe { copier.submit_copy(s.addr, addr + at as u64, n as u64) }.map_err(fault)?;
                    copying = Some((copier.clone(), seq));
                }
                None => {
                    // No copier reaches both: through host memory.
                    let mut bounce = vec![0u8; n];
                    dma.read(addr + at as u64, &mut bounce).map_err(fault)?;
                    region.dma.write(s.addr, &bounce).map_err(fault)?;
                }
            },
        }
        at += n;
    }
    // The receive completes once its bytes are in place: the caller waits for the copy.
    Ok((total as u32, copying))
}
