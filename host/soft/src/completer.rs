//! The completer: applies a request's outcome on the requester's side (READ data and fetched
//! atomic values land in local memory) and writes the CQE, as the PRM says: signalled WQEs
//! and every error get one, with the WQE counter, the byte count, and the owner bit of the lap,
//! written last. A CQ with no room is an overrun, not an overwrite.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gdaki_layout::cqe::{Cqe64, ErrCqe};
use gdaki_layout::wqe::{Sge, MAX_SGES};
use gdaki_layout::{dbrec, ring, CqeOpcode, Syndrome};
use tracing::error;

use crate::objects::{SoftCq, SoftQp, SoftRq};
use crate::prefetch;
use crate::Region;

/// Vendor syndrome the soft HCA puts in error CQEs (so its errors are recognisable).
pub const VENDOR_SYNDROME: u8 = 0x5f;

/// The outcome of one WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Done; bytes moved (0 for NOPs and atomics' remote side).
    Success {
        /// Byte count for the CQE.
        bytes: u32,
    },
    /// Failed with this syndrome.
    Error(Syndrome),
}

/// Writes the CQE of WQE `wqe_counter` (opcode `opcode`) if it is due. Returns false on
/// overrun (the QP then goes to error).
pub(crate) fn complete(qp: &SoftQp, wqe_counter: u16, opcode: u8, signaled: bool, outcome: Outcome) -> bool {
    let cqe = match outcome {
        Outcome::Success { .. } if !signaled => return true,
        Outcome::Success { bytes } => Cqe64::success(qp.qpn, wqe_counter, bytes, 0),
        Outcome::Error(s) => ErrCqe::new(qp.qpn, wqe_counter, opcode, s, VENDOR_SYNDROME, 0).as_cqe(),
    };
    if !write_cqe(&qp.cq, cqe) {
        qp.fail(Syndrome::LocalQpOp);
        return false;
    }
    true
}

/// The outcome of one receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvOutcome {
    /// A message landed.
    Success {
        /// Its bytes.
        bytes: u32,
        /// `RESP_SEND`, `RESP_SEND_IMM` or `RESP_WR_IMM`.
        opcode: CqeOpcode,
        /// The immediate data (0 without).
        imm: u32,
        /// The QP it came from.
        src_qpn: u32,
    },
    /// The receive failed (or was flushed) with this syndrome.
    Error(Syndrome),
}

/// Writes the responder CQE of receive `index` on the receive CQ of `rq` (`qp`'s). The caller
/// holds the RQ's lock (`SoftRq::taken`): receive CQEs go in receive order. Returns false on
/// overrun (the QP then goes to error).
pub(crate) fn complete_receive(qp: &SoftQp, rq: &SoftRq, index: u64, outcome: RecvOutcome) -> bool {
    let cqe = match outcome {
        RecvOutcome::Success {
            bytes,
            opcode,
            imm,
            src_qpn,
        } => Cqe64::responder(qp.qpn, index as u16, bytes, opcode, imm, src_qpn, 0),
        RecvOutcome::Error(s) => ErrCqe::responder(qp.qpn, index as u16, s, VENDOR_SYNDROME, 0).as_cqe(),
    };
    if !write_cqe(&rq.cq, cqe) {
        qp.fail(Syndrome::LocalQpOp);
        return false;
    }
    true
}

/// Flushes the receives posted to `qp` and not taken, once it is in error: each completes with
/// a work-request-flushed error CQE, as a NIC's do.
pub(crate) fn flush_receives(qp: &SoftQp) {
    let Some(rq) = &qp.rq else { return };
    let mut cursor = gdaki_devx::util::lock(&rq.taken);
    // A record more than a ring ahead flushes a ring's worth: all there can be.
    let waiting = rq.waiting(cursor.taken).unwrap_or(1 << rq.log_size);
    cursor.known = 0;
    for _ in 0..waiting {
        if !complete_receive(qp, rq, cursor.taken, RecvOutcome::Error(Syndrome::WrFlush)) {
            return;
        }
        cursor.taken += 1;
    }
}

/// How many CQEs ahead of the one it writes the engine asks for a CQ's line (one line each).
const CQES_AHEAD: u64 = 4;

/// Writes `cqe` at the CQ's producer index (entry 0 of a collapsed CQ) with the lap's owner
/// bit, unless the CQ is full (never, for a CQ that ignores overruns).
fn write_cqe(cq: &SoftCq, mut cqe: Cqe64) -> bool {
    let pi = cq.pi.load(Ordering::Relaxed);
    // Entries not yet consumed: the 24-bit distance from the consumer index to ours.
    let outstanding = |ci: u32| ((pi as u32).wrapping_sub(ci) & dbrec::CQ_CI_MASK) as u64;
    let size = 1u64 << cq.log_size;
    let ci = cq.ci_seen.load(Ordering::Relaxed);
    if !cq.overrun_ignore && outstanding(ci) >= size {
        // Re-read the record only now, so its cache line is not pulled from the poller on
        // every CQE. SAFETY: word 0 of the CQ's doorbell record, aligned, alive with the CQ.
        let rec = unsafe { std::sync::atomic::AtomicU32::from_ptr(cq.dbrec.as_ptr() as *mut u32) };
        let ci = u32::from_be(rec.load(Ordering::Acquire)) & dbrec::CQ_CI_MASK;
        cq.ci_seen.store(ci, Ordering::Relaxed);
        if outstanding(ci) >= size {
            if !cq.overrun.swap(true, Ordering::AcqRel) {
                error!(
                    cqn = format_args!("{:#x}", cq.cqn),
                    pi, ci, "CQ overrun: no room for a CQE"
                );
            }
            return false;
        }
    }
    if !cq.collapsed && size >= 2 * CQES_AHEAD {
        // The slot a few CQEs on was read by the poller a lap ago: take it back now.
        prefetch::for_write(cq.ring.addr() + ring::cqe_offset(pi + CQES_AHEAD, cq.log_size));
    }
    cqe.op_own = (cqe.op_own & !1) | ring::owner_parity(pi, cq.log_size);
    let words: [u64; 8] = bytemuck::cast(cqe);
    let slot = cq.ring.addr()
        + if cq.collapsed {
            0
        } else {
            ring::cqe_offset(pi, cq.log_size)
        };
    for (i, w) in words.iter().enumerate() {
        // The word holding op_own goes last, with release: the body is visible first.
        let order = if i == 7 { Ordering::Release } else { Ordering::Relaxed };
        // SAFETY: a 64-byte entry of the live CQ ring.
        unsafe { AtomicU64::from_ptr((slot + 8 * i as u64) as *mut u64) }.store(*w, order);
    }
    cq.pi.store(pi + 1, Ordering::Release);
    true
}

/// Checked local buffers (at most a WQE's worth, without allocating).
#[derive(Default)]
pub(crate) struct Locals {
    /// The buffers, in order, then `None`s.
    pub(crate) items: [Option<(Sge, Arc<Region>)>; MAX_SGES],
}

impl Locals {
    /// The buffers, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &(Sge, Arc<Region>)> {
        self.items.iter().map_while(Option::as_ref)
    }

    /// The buffer, when there is exactly one (what GPU copies and references move in one step).
    pub(crate) fn single(&self) -> Option<&(Sge, Arc<Region>)> {
        match &self.items {
            [Some(one), None, ..] => Some(one),
            _ => None,
        }
    }
}
