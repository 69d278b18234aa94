//! The requester: turns one parsed WQE into a request. It checks the local side first (lkeys,
//! bounds, the local-write right for READ and atomic destinations, the message size), gathers
//! the payload, hands the request to the peer's responder and lets the completer apply the
//! answer. Every failure is a syndrome, as a NIC reports it; nothing is written outside a
//! registered region.
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use gdaki_device::Remote as DevRemote;
use gdaki_layout::copy::{STORE_MAX, TAIL_MAX};
use gdaki_layout::ctrl::FenceMode;
use gdaki_layout::wait::WaitSeg;
use gdaki_layout::wqe::{Operation, Payload, Sge, WorkRequest};
use gdaki_layout::{Syndrome, WqeOpcode};

use crate::completer::Locals;
use crate::copier::{Copier, Pending, Way};
use crate::ipc;
use crate::net::{Link, Meta, Sink};
use crate::objects::SoftQp;
use crate::responder::{self, AtomicOp, Message, Receiving, SendData, Side, SmallWrite};
use crate::{Hca, RegionCache};
use gdaki_devx::wire::Op;
use gdaki_devx::Access;

/// Buffers the engine thread reuses between WQEs, and the GPU copies it has in flight.
#[derive(Default)]
pub(crate) struct Scratch {
    data: Vec<u8>,
    regions: RegionCache,
    /// The newest copy submitted to each GPU copier and not yet known done.
    copies: Pending,
}

/// How a WQE was executed.
pub(crate) enum Executed {
    /// Done: this many bytes moved.
    Done(u32),
    /// Sent to a remote peer: its link completes it.
    InFlight,
    /// Handed to a GPU copier: done once copy `seq` is.
    Copying {
        /// Bytes moved.
        bytes: u32,
        /// The copier.
        copier: Arc<Copier>,
        /// The copy.
        seq: u64,
    },
    /// Not executed: its fence mode holds it until earlier requests complete. The engine
    /// comes back to it (and to everything after it) on a later round.
    Fenced,
    /// Not executed: the responder has no receive posted for it ("receiver not ready"). The
    /// engine tries it again after this delay (the responder's RNR timer), as often as the
    /// QP's `rnr_retry` allows.
    NotReady(std::time::Duration),
}

impl Scratch {
    /// See [`RegionCache::release_if_stale`].
    pub(crate) fn release_stale_regions(&mut self) {
        self.regions.release_if_stale();
        // A flush that failed earlier (a paused copier) is retried here.
        self.flush_copies();
        self.copies.release_done();
    }
}

impl Scratch {
    /// Hands the small copies gathered so far to their copiers' kernels (see
    /// [`Copier::flush`]): at the end of every doorbell batch, so a batch of WQEs becomes a few
    /// copy lists instead of a descriptor each.
    pub(crate) fn flush_copies(&self) {
        self.copies.flush();
    }
}

/// Waits until every GPU copy this engine submitted is done: before the CPU moves data itself,
/// so it never overtakes an earlier WQE's copy (a put then its signal).
fn settle(copies: &mut Pending) -> Result<(), Syndrome> {
    copies.settle().map_err(|_| Syndrome::LocalAccess)
}

/// The GPU copy of a WRITE from one local buffer to a target in this process (`Way::Write`),
/// or of a READ from a source in this process into one local buffer (`Way::Read`), when one
/// copier moves it in one step (device memory on one side, memory that GPU reaches on the
/// other): submitted after the pending copies it must follow, not waited for, and added to
/// them. `None` otherwise.
fn gpu_copy(
    target: &mut Target<'_>,
    regions: &mut RegionCache,
    copies: &mut Pending,
    r: DevRemote,
    local: &Locals,
    way: Way,
) -> Result<Option<(Arc<Copier>, u64)>, Syndrome> {
    let (Target::Local(peer, tq), Some(side)) = (target, side(local, way == Way::Write)) else {
        return Ok(None);
    };
    // Plain host memory never pairs with a copier: no target lookup for it.
    if side.dma.gpu_copier().is_none() && !side.dma.gpu_mapped() {
        return Ok(None);
    }
    copies.before(way).map_err(|_| Syndrome::LocalAccess)?;
    let copy = responder::copy_by_gpu(peer, regions, tq.pd, r, way, side);
    let copy = copy.transpose()?;
    if let Some((copier, seq)) = &copy {
        copies.add(copier, *seq, way);
    }
    Ok(copy)
}

/// The local buffers of a request as one GPU copy's side: one buffer, or where a `tail` may
/// follow (a WRITE's gather list) one and a tail of at most [`TAIL_MAX`] bytes (a message and
/// its trailer); `None` for other lists (their bytes are gathered in host memory).
fn side(local: &Locals, tail: bool) -> Option<Side<'_>> {
    // A tail the copier takes travels in a referenced WRITE to a peer process too.
    const _: () = assert!(gdaki_devx::wire::MAX_REF_TAIL as usize == TAIL_MAX);
    let mut items = local.iter();
    let (s, region) = items.next()?;
    let tail = match (items.next(), items.next(), tail) {
        (None, _, _) => None,
        (Some((t, r)), None, true) if t.length as usize <= TAIL_MAX => Some((&*r.dma, t.addr, t.length as u64)),
        _ => return None,
    };
    Some(Side {
        dma: &*region.dma,
        addr: s.addr,
        len: s.length as u64,
        tail,
    })
}

/// A WRITE from (`Way::Write`) or READ into (`Way::Read`) one local buffer of GPU memory (a
/// WRITE's perhaps with a tail, see [`side`]), to or from a peer process on this machine:
/// posted as CUDA IPC references to the buffers, acknowledged once the peer's copier has moved
/// the bytes, when the peer has mapped their allocations (see [`ipc`](crate::ipc)). Whether it
/// was posted (if not, the bytes must travel).
fn post_reference(link: &mut Link, meta: Meta, r: DevRemote, local: &Locals, way: Way) -> bool {
    let Some((first, tail)) = references(link, local, way == Way::Write) else {
        return false;
    };
    let ipc::Reference { alloc, offset, len } = first;
    let op = match way {
        Way::Write => Op::WriteRef {
            alloc,
            offset,
            len,
            tail,
        },
        Way::Read => Op::ReadRef { alloc, offset, len },
    };
    link.post(meta, r, op, &[], Sink::Ack);
    true
}

/// The CUDA IPC references to a request's local buffers (a [`side`]: one, or where a `tail`
/// may follow, one and its tail), when the peer has mapped their allocations; `None`: the
/// bytes must travel.
fn references(link: &mut Link, local: &Locals, tail: bool) -> Option<(ipc::Reference, Option<ipc::Reference>)> {
    let side = side(local, tail)?;
    // Zero bytes touch no memory: nothing to refer to.
    if side.len == 0 {
        return None;
    }
    let first = link.reference(side.dma, side.addr, side.len as u32)?;
    let tail = match side.tail {
        Some((dma, addr, len)) => Some(link.reference(dma, addr, len as u32)?),
        None => None,
    };
    Some((first, tail))
}

fn remote(r: gdaki_layout::wqe::Remote) -> DevRemote {
    DevRemote {
        addr: r.addr,
        rkey: r.rkey,
    }
}

/// The local regions of `sges` in protection domain `pd` (the posting QP's), with the rights
/// `need`; a bad key, range, PD or right is a local protection error.
fn locals(hca: &Hca, cache: &mut RegionCache, pd: u32, sges: &[Sge], need: Access) -> Result<Locals, Syndrome> {
    let mut out = Locals::default();
    for (slot, s) in out.items.iter_mut().zip(sges) {
        let r = hca
            .region(cache, pd, s.lkey, s.addr, s.length as u64, need)
            .ok_or(Syndrome::LocalProt)?;
        *slot = Some((*s, r.clone()));
    }
    Ok(out)
}

/// The peer a connected QP sends to.
pub(crate) enum Peer {
    /// In this process: the responder runs on the requester's engine thread.
    Local {
        /// The peer's HCA.
        hca: Weak<Hca>,
        /// The peer QP.
        qp: Weak<SoftQp>,
    },
    /// In another process or host, over TCP.
    Remote(Link),
}

/// Where a QP's requests go, resolved once per doorbell batch.
pub(crate) enum Target<'a> {
    /// A peer HCA in this process and the target QP: its responder runs right here.
    Local(Arc<Hca>, Arc<SoftQp>),
    /// A peer in another process, over the QP's link.
    Remote(&'a mut Link),
    /// Nowhere: requests fail with this syndrome.
    Down(Syndrome),
}

/// Resolves a QP's peer: an in-process HCA and QP must still exist and the QP must accept
/// requests; a remote peer is its link (which reports its own failures).
pub(crate) fn resolve(peer: Option<&mut Peer>) -> Target<'_> {
    match peer {
        None => Target::Down(Syndrome::LocalQpOp),
        Some(Peer::Remote(link)) => Target::Remote(link),
        Some(Peer::Local { hca, qp }) => {
            let Some(hca) = hca.upgrade() else {
                return Target::Down(Syndrome::TransportRetryExc);
            };
            let qp = qp.upgrade();
            match (responder::accepts(qp.as_deref()), qp) {
                (Ok(()), Some(qp)) => Target::Local(hca, qp),
                (Err(s), _) => Target::Down(s),
                (Ok(()), None) => Target::Down(Syndrome::TransportRetryExc),
            }
        }
    }
}

/// The receive queue of a peer QP in this process, held across one doorbell's batch: locked at
/// the batch's first message that takes a receive, released when the batch is done. Locking it
/// per message cost two locked instructions each, and each waited for every store before it
/// (the last CQE's among them).
pub(crate) struct HeldReceives<'q> {
    qp: Option<&'q SoftQp>,
    held: Option<Receiving<'q>>,
}

impl<'q> HeldReceives<'q> {
    /// For a batch to `qp` (the target's QP where it is in this process; `None` otherwise).
    pub(crate) fn new(qp: Option<&'q SoftQp>) -> Self {
        HeldReceives { qp, held: None }
    }

    /// The held queue if a receive waits for the next message; `Ok(None)` if none does.
    fn next(&mut self) -> Result<Option<&mut Receiving<'q>>, Syndrome> {
        let Some(qp) = self.qp else {
            return Err(Syndrome::RemoteInvalReq);
        };
        let r = match &mut self.held {
            Some(r) => r,
            none => none.insert(Receiving::hold(qp)?),
        };
        Ok(if r.ready()? { Some(r) } else { None })
    }
}

/// Executes `wr` (whose bytes are `wqe`; `meta` names it) for `qp`, or says why not. `held`
/// holds the receive queue of a target in this process.
#[allow(clippy::too_many_arguments)] // the engine's state for one WQE, each distinct
pub(crate) fn execute(
    hca: &Hca,
    qp: &SoftQp,
    target: &mut Target<'_>,
    held: &mut HeldReceives<'_>,
    meta: Meta,
    wr: &WorkRequest,
    wqe: &[u8],
    scratch: &mut Scratch,
) -> Result<Executed, Syndrome> {
    let check_len = |len: u64| {
        if len > qp.max_msg_size() {
            Err(Syndrome::LocalLength)
        } else {
            Ok(len as u32)
        }
    };
    let Scratch {
        data: buf,
        regions,
        copies,
    } = scratch;
    // The fence mode, exactly as a NIC honours it (see `FenceMode`): no more, or tests would
    // pass that hardware fails. Requests to a peer in this process are executed here, atomics
    // to completion, so only GPU copies (of WRITEs and READs) and a remote link's requests can
    // still be outstanding.
    let fence = FenceMode::from_fm_ce_se(wr.fm_ce_se);
    if let FenceMode::Reserved(_) = fence {
        return Err(Syndrome::LocalQpOp);
    }
    if fence.waits_for_everything() {
        settle(copies)?;
    }
    if fence.waits_for_reads_and_atomics() {
        copies.settle_reads().map_err(|_| Syndrome::LocalAccess)?;
        if let Target::Remote(link) = target {
            if link.outstanding(fence.waits_for_everything(), 1) {
                return Ok(Executed::Fenced);
            }
        }
    }
    // A READ or atomic to a remote peer waits in the send queue while as many as the peer
    // accepts are in flight (RTR2RTS's log_sra_max), as a NIC holds it.
    if matches!(
        wr.op,
        Operation::Read { .. } | Operation::FetchAdd { .. } | Operation::CompareSwap { .. }
    ) {
        if let Target::Remote(link) = target {
            if link.outstanding(false, qp.max_reads_in_flight()) {
                return Ok(Executed::Fenced);
            }
        }
    }
    // Data the CPU moves waits for the GPU copies submitted before it (`settle`).
    match wr.op {
        Operation::Nop => Ok(Executed::Done(0)), // no data moves: nothing to settle
        Operation::Send { payload } => {
            let (bytes, src) = source(hca, regions, qp, payload, check_len)?;
            settle(copies)?;
            let imm = (wr.opcode == WqeOpcode::SendImm).then_some(wr.imm);
            match target {
                Target::Local(peer, tq) => match held.next()? {
                    None => Ok(Executed::NotReady(tq.rnr_delay())),
                    Some(taken) => {
                        // One buffer of GPU memory: the receive side copies from it in place
                        // (by the GPU where its copier reaches the receive buffers).
                        let in_place = match &src {
                            Source::Buffers(local) => local.single().filter(|(_, r)| r.dma.gpu_copier().is_some()),
                            Source::Inline { .. } => None,
                        };
                        let data = match in_place {
                            Some((s, region)) => SendData::InPlace {
                                dma: &*region.dma,
                                addr: s.addr,
                                len: bytes,
                            },
                            None => SendData::Bytes(payload_bytes(&src, wqe, buf)?),
                        };
                        let msg = Message::Send { data, imm };
                        Ok(match responder::deliver(peer, regions, taken, msg, qp.qpn)? {
                            // Completed (here and at the receive) once the payload's GPU copy
                            // is done. Later requests need not wait for it: only the receive's
                            // completion says the bytes are there, so SENDs copy side by side.
                            Some((copier, seq)) => Executed::Copying { bytes, copier, seq },
                            None => Executed::Done(bytes),
                        })
                    }
                },
                Target::Remote(link) => {
                    let none = DevRemote { addr: 0, rkey: 0 };
                    // One buffer of GPU memory to a peer process on this machine: a reference
                    // that the peer's copier reads (CUDA IPC), once it has mapped the allocation.
                    if let Source::Buffers(local) = &src {
                        if let Some((ipc::Reference { alloc, offset, len }, None)) = references(link, local, false) {
                            let op = Op::SendRef {
                                alloc,
                                offset,
                                len,
                                imm,
                            };
                            link.post(meta, none, op, &[], Sink::Ack);
                            return Ok(Executed::InFlight);
                        }
                    }
                    let data = payload_bytes(&src, wqe, buf)?;
                    link.post(meta, none, Op::Send { len: bytes, imm }, data, Sink::Ack);
                    Ok(Executed::InFlight)
                }
                Target::Down(s) => Err(*s),
            }
        }
        // A WRITE that completes a receive: the receive is checked first (no receive, no
        // bytes written: the requester retries the whole message), the bytes written, then the
        // receive completed. Moved by the CPU, in order with everything before it.
        Operation::Write { remote: r, payload } if wr.opcode == WqeOpcode::RdmaWriteImm => {
            let (bytes, src) = source(hca, regions, qp, payload, check_len)?;
            settle(copies)?;
            let data = payload_bytes(&src, wqe, buf)?;
            match target {
                Target::Local(peer, tq) => match held.next()? {
                    None => Ok(Executed::NotReady(tq.rnr_delay())),
                    Some(taken) => {
                        responder::write(peer, regions, tq.pd, remote(r), data)?;
                        let msg = Message::WriteImm { bytes, imm: wr.imm };
                        responder::deliver(peer, regions, taken, msg, qp.qpn).map(|_| Executed::Done(bytes))
                    }
                },
                Target::Remote(link) => {
                    let op = Op::WriteImm {
                        len: bytes,
                        imm: wr.imm,
                    };
                    link.post(meta, remote(r), op, data, Sink::Ack);
                    Ok(Executed::InFlight)
                }
                Target::Down(s) => Err(*s),
            }
        }
        // Core-Direct: the send queue stops here until the named CQ has produced the CQE
        // waited for. Only a QP created as a Core-Direct master may post it, as on a NIC; a CQ
        // that does not exist (or no longer) fails it.
        Operation::Wait { cqn, max_index } => {
            if !qp.cd_master {
                return Err(Syndrome::LocalQpOp);
            }
            let cq = hca.cq(cqn).ok_or(Syndrome::LocalQpOp)?;
            if WaitSeg::reached(cq.pi.load(Ordering::Acquire), max_index) {
                Ok(Executed::Done(0))
            } else {
                Ok(Executed::Fenced)
            }
        }
        // The HCA reads the local bytes (checked as a NIC checks them) and completes; what
        // makes it a consistency point is its fence, handled above.
        Operation::Dump { local } => {
            locals(hca, regions, qp.pd, std::slice::from_ref(&local), Access::empty())?;
            Ok(Executed::Done(0))
        }
        Operation::Write { remote: r, payload } => {
            let (bytes, src) = source(hca, regions, qp, payload, check_len)?;
            if let Source::Buffers(local) = &src {
                // GPU memory to a target in this process: the GPU copies it in one step, after
                // the copies before it, and the engine completes the WQE once done.
                if let Some((copier, seq)) = gpu_copy(target, regions, copies, remote(r), local, Way::Write)? {
                    return Ok(Executed::Copying { bytes, copier, seq });
                }
            }
            if let (Source::Inline { .. }, Target::Local(peer, tq)) = (&src, &mut *target) {
                // A few inline bytes into GPU memory (or behind the GPU copies before them): a
                // store by the GPU, after those copies, without the engine waiting for them.
                let data = payload_bytes(&src, wqe, buf)?;
                if (1..=STORE_MAX).contains(&data.len()) {
                    let to = remote(r);
                    let fail = Syndrome::LocalAccess; // as `settle` says it
                    return match responder::write_small(peer, regions, tq.pd, to, data, copies, fail)? {
                        SmallWrite::Stored(copier, seq) => Ok(Executed::Copying { bytes, copier, seq }),
                        SmallWrite::Cpu(region) => {
                            settle(copies)?;
                            responder::write_into(region, to.addr, data).map(|()| Executed::Done(bytes))
                        }
                    };
                }
            }
            settle(copies)?;
            if let (Source::Buffers(local), Target::Remote(link)) = (&src, &mut *target) {
                // GPU memory to a peer process on this machine: a reference that the peer's
                // copier reads (CUDA IPC), once the peer has mapped the allocation.
                if post_reference(link, meta, remote(r), local, Way::Write) {
                    return Ok(Executed::InFlight);
                }
            }
            let data = payload_bytes(&src, wqe, buf)?;
            match target {
                Target::Local(peer, tq) => {
                    responder::write(peer, regions, tq.pd, remote(r), data).map(|()| Executed::Done(bytes))
                }
                Target::Remote(link) => {
                    link.post(meta, remote(r), Op::Write { len: bytes }, data, Sink::Ack);
                    Ok(Executed::InFlight)
                }
                Target::Down(s) => Err(*s),
            }
        }
        Operation::Read { remote: r, local } => {
            let bytes = check_len(local.total_len())?;
            let dst = locals(hca, regions, qp.pd, local.as_slice(), Access::LOCAL_WRITE)?;
            // From a source in this process into GPU memory (or GPU memory into memory that GPU
            // reaches): one GPU copy, after the WRITEs' copies before it, completed once done.
            if let Some((copier, seq)) = gpu_copy(target, regions, copies, remote(r), &dst, Way::Read)? {
                return Ok(Executed::Copying { bytes, copier, seq });
            }
            settle(copies)?;
            match target {
                Target::Local(peer, tq) => {
                    buf.clear();
                    buf.resize(bytes as usize, 0);
                    responder::read(peer, regions, tq.pd, remote(r), buf)?;
                    // Completer side: scatter the response.
                    let mut at = 0;
                    for (s, region) in dst.iter() {
                        region
                            .dma
                            .write(s.addr, &buf[at..at + s.length as usize])
                            .map_err(|_| Syndrome::LocalAccess)?;
                        at += s.length as usize;
                    }
                    Ok(Executed::Done(bytes))
                }
                Target::Remote(link) => {
                    // Into GPU memory from a peer process on this machine: a reference to where
                    // the bytes go, which the peer's copier fills (CUDA IPC), once the peer has
                    // mapped the allocation; it acknowledges them once they have landed.
                    if post_reference(link, meta, remote(r), &dst, Way::Read) {
                        return Ok(Executed::InFlight);
                    }
                    link.post(meta, remote(r), Op::Read { len: bytes }, &[], Sink::Scatter(dst));
                    Ok(Executed::InFlight)
                }
                Target::Down(s) => Err(*s),
            }
        }
        Operation::FetchAdd { remote: r, add, result } => {
            settle(copies)?;
            let op = AtomicOp::FetchAdd(add);
            atomic(hca, regions, qp, target, meta, remote(r), op, result)
        }
        Operation::CompareSwap {
            remote: r,
            compare,
            swap,
            result,
        } => {
            settle(copies)?;
            atomic(
                hca,
                regions,
                qp,
                target,
                meta,
                remote(r),
                AtomicOp::CompareSwap { compare, swap },
                result,
            )
        }
    }
}

/// Where a message's payload is: inline in the WQE, or in local buffers, checked (keys, PD,
/// bounds) once, for the fast paths that hand them on and for [`payload_bytes`].
enum Source {
    /// `len` bytes at `offset` of the WQE.
    Inline { offset: u16, len: u16 },
    /// The gather list's buffers.
    Buffers(Locals),
}

/// A payload's length (checked against the QP's largest message) and its [`Source`].
fn source(
    hca: &Hca,
    regions: &mut RegionCache,
    qp: &SoftQp,
    payload: Payload,
    check_len: impl Fn(u64) -> Result<u32, Syndrome>,
) -> Result<(u32, Source), Syndrome> {
    Ok(match payload {
        Payload::Inline { offset, len } => (check_len(len as u64)?, Source::Inline { offset, len }),
        Payload::Gather(list) => (
            check_len(list.total_len())?,
            Source::Buffers(locals(hca, regions, qp.pd, list.as_slice(), Access::empty())?),
        ),
    })
}

/// A payload's bytes: in the WQE, in place (one host buffer), or gathered into `buf`.
fn payload_bytes<'a>(src: &Source, wqe: &'a [u8], buf: &'a mut Vec<u8>) -> Result<&'a [u8], Syndrome> {
    let list = match src {
        Source::Inline { offset, len } => {
            return wqe
                .get(*offset as usize..(offset + len) as usize)
                .ok_or(Syndrome::LocalLength)
        }
        Source::Buffers(list) => list,
    };
    if let Some((s, region)) = list.single() {
        if region.dma.host_addressable() {
            // SAFETY: the range was checked against a live, host-addressable region; like
            // DMA, concurrent writes by the application may be torn.
            return Ok(unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) });
        }
    }
    buf.clear();
    for (s, region) in list.iter() {
        let at = buf.len();
        buf.resize(at + s.length as usize, 0);
        region
            .dma
            .read(s.addr, &mut buf[at..])
            .map_err(|_| Syndrome::LocalAccess)?;
    }
    Ok(&buf[..])
}

/// An atomic posted on `qp`: the result buffer is checked first, and the fetched value lands
/// there in the QP's reply byte order, as the NIC's atomic endianness mode writes it.
#[allow(clippy::too_many_arguments)]
fn atomic(
    hca: &Hca,
    cache: &mut RegionCache,
    qp: &SoftQp,
    target: &mut Target<'_>,
    meta: Meta,
    r: DevRemote,
    op: AtomicOp,
    result: Sge,
) -> Result<Executed, Syndrome> {
    let order = qp.atomic_reply;
    let dst = locals(hca, cache, qp.pd, std::slice::from_ref(&result), Access::LOCAL_WRITE)?;
    match target {
        Target::Local(peer, tq) => {
            let old = responder::atomic(peer, cache, tq.pd, r, op)?;
            if let Some((_, region)) = &dst.items[0] {
                region
                    .dma
                    .write(result.addr, &order.encode(old))
                    .map_err(|_| Syndrome::LocalAccess)?;
            }
            Ok(Executed::Done(8))
        }
        Target::Remote(link) => {
            let wire_op = match op {
                AtomicOp::FetchAdd(add) => Op::FetchAdd { add },
                AtomicOp::CompareSwap { compare, swap } => Op::CompareSwap { compare, swap },
            };
            link.post(meta, r, wire_op, &[], Sink::Atomic(dst, order));
            Ok(Executed::InFlight)
        }
        Target::Down(s) => Err(*s),
    }
}
