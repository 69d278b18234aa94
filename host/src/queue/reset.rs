//! Resetting a queue pair (DOCA GPUNetIO's QP reset): after an error, back to RESET and
//! connected again, with the same handles (the CPU one and every GPU export), without
//! recreating anything.
//!
//! 2RST starts the send queue again at WQE 0, as a NIC's hardware counter does, while the CQ
//! keeps its place. gdaki's tickets are CQE indices and WQE indices at once (every WQE is one
//! building block and signalled), so after a reset the two must agree again in what the HCA
//! sees of them: the 16-bit WQE counter, the ring slot and the doorbell. Once connected, the
//! library posts NOPs without CQEs until the send queue's counter equals the CQ's modulo 2^16
//! (every ring size divides it), one signalled NOP closing each ring's worth, then sets the
//! handles' counters to the CQ's: the posters' code is the same before and after, and no
//! hot-path field was added for it. The receive side cannot be padded so (a receive completes
//! only when a message takes it): its handle keeps a base instead (`DevRq::index_base`, in the
//! hot line posting reads anyway), which receives are posted and counted in the record less.
use std::mem::{offset_of, size_of};
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use gdaki_device::{Exclusive, WaitError};
use gdaki_layout::ctrl::{CtrlSeg, CE_CQ_UPDATE};
use gdaki_layout::handle::NO_ERROR;
use gdaki_layout::prm::{command, Opcode};
use gdaki_layout::{dbrec, doorbell, ring, CqeOpcode, DevCq, DevQp, DevRq, Segment, WqeOpcode};

use super::QueuePair;
use crate::error::{Error, Result};
use crate::lock;
use gdaki_devx::QpState;

/// The live GPU copies of one kind of a QP's handles (its `DevQp`s or its `DevRq`s), which a
/// reset reads back and rewrites.
#[derive(Default)]
pub(super) struct Exports(Mutex<Vec<Weak<gdaki_cuda::DeviceBuffer>>>);

impl Exports {
    /// Adds an export's handle (and forgets the gone ones).
    pub(super) fn add(&self, handle: &Arc<gdaki_cuda::DeviceBuffer>) {
        let mut live = lock(&self.0);
        live.retain(|e| e.strong_count() > 0);
        live.push(Arc::downgrade(handle));
    }

    fn live(&self) -> Vec<Arc<gdaki_cuda::DeviceBuffer>> {
        lock(&self.0).iter().filter_map(Weak::upgrade).collect()
    }
}

/// A handle whose hot words (its counters and its CQ's) a reset moves between the CPU handle
/// and the exports.
trait Hot: bytemuck::Pod {
    /// Their byte ranges: the handle's hot line up to its padding, then its CQ's.
    const HOT: [Range<usize>; 2];
    /// Slots reserved through this handle: the one that reserved most is the one that posted.
    fn reserved(&self) -> u64;
}

/// The byte range of a `DevCq`'s hot words at `at`.
const fn cq_hot(at: usize) -> Range<usize> {
    at..at + offset_of!(DevCq, hot_pad)
}

impl Hot for DevQp {
    const HOT: [Range<usize>; 2] = [0..offset_of!(DevQp, lock_pad), cq_hot(offset_of!(DevQp, cq))];
    fn reserved(&self) -> u64 {
        self.sq_reserved
    }
}

impl Hot for DevRq {
    const HOT: [Range<usize>; 2] = [0..offset_of!(DevRq, hot_pad), cq_hot(offset_of!(DevRq, cq))];
    fn reserved(&self) -> u64 {
        self.rq_reserved
    }
}

/// Copies into the CPU handle `cpu` the hot words of the export that reserved the most, if
/// one reserved more than `cpu`: only one handle posts at a time, so that one holds the QP's
/// true counters.
///
/// # Safety
/// `cpu` is a live CPU handle that no poster uses now (reset's contract).
unsafe fn adopt_furthest<H: Hot>(cpu: *mut H, exports: &Exports) -> Result<()> {
    // SAFETY: the caller's contract.
    let mut most = unsafe { cpu.read() }.reserved();
    let mut best = None;
    for export in exports.live() {
        let mut theirs = H::zeroed();
        export.read(0, bytemuck::bytes_of_mut(&mut theirs))?;
        if theirs.reserved() > most {
            most = theirs.reserved();
            best = Some(theirs);
        }
    }
    if let Some(theirs) = best {
        // SAFETY: the caller's contract: the CPU handle's bytes, alive, unused now.
        let mine = unsafe { std::slice::from_raw_parts_mut(cpu as *mut u8, size_of::<H>()) };
        for r in H::HOT {
            mine[r.clone()].copy_from_slice(&bytemuck::bytes_of(&theirs)[r]);
        }
    }
    Ok(())
}

/// Writes the CPU handle `cpu`'s hot words into every export.
///
/// # Safety
/// As [`adopt_furthest`].
unsafe fn publish<H: Hot>(cpu: *const H, exports: &Exports) -> Result<()> {
    // SAFETY: the caller's contract.
    let fresh = unsafe { cpu.read() };
    let bytes = bytemuck::bytes_of(&fresh);
    for export in exports.live() {
        for r in H::HOT {
            export.write(r.start, &bytes[r])?;
        }
    }
    Ok(())
}

impl QueuePair {
    /// Back to RESET from any state: whatever is outstanding is flushed (and its completions
    /// consumed), then 2RST. [`connect`](Self::connect) to the peer (which resets and connects
    /// too: RC needs both sides) makes the QP post again, through the same handles: the CPU
    /// one, views from [`cpu`](Self::cpu) and every GPU export keep working, their tickets
    /// going on from where they were; receives posted before are flushed, their completions
    /// consumed by the reset as the sends' are.
    /// Refused for a QP with rings in GPU memory (the CPU writes the NOPs that realign the send
    /// queue; see `docs/devx-provider.md`).
    ///
    /// # Safety
    /// No poster (CPU thread or kernel) uses the QP's handles from this call until `connect`
    /// has returned: the handles' counters are rewritten meanwhile. A kernel that posts on
    /// afterwards first learns that `connect` returned through an acquire at system scope: a
    /// GPU poster's exclusive counters are block-scope accesses, which the SM's L1 may serve
    /// from before the reset until such an acquire empties it.
    pub unsafe fn reset(&self) -> Result<()> {
        if self.rings_in_gpu_memory() {
            return Err(Error::Unsupported {
                what: "resetting a queue pair with rings in GPU memory",
                why: "the CPU writes the NOPs that realign the send queue: destroy and create it again".into(),
            });
        }
        // The handle that posted (a GPU export's, when kernels did) is the one whose counters
        // went furthest: the CPU handle takes them, then drains through them.
        // SAFETY (both): the live CPU handles, which no poster uses now (this call's contract).
        unsafe { adopt_furthest(self.device_handle(), &self.inner.exports) }?;
        if let Some(h) = self.receive_handle() {
            unsafe { adopt_furthest(h, &self.inner.recv_exports) }?;
        }
        let next = match self.pending_pad() {
            // Reset again before a connect: nothing can have been posted since.
            Some(next) => next,
            // From any state, RESET included (receives may be posted before a first connect):
            // what is outstanding completes flushed, so the CQs account for every WQE.
            None => {
                self.to_error()?;
                self.drain_receives()?;
                self.drain()?
            }
        };
        self.modify(&command::object_command(Opcode::Qp2Rst, self.qpn()), QpState::Reset)?;
        // The record's counters start again with the queues.
        let record = (self.inner.sq() + (64u64 << self.inner.sq_log)) as *const AtomicU64;
        // SAFETY: the QP's doorbell record (8-byte aligned, after the send queue in its umem,
        // host memory: refused above otherwise), alive with the QP.
        unsafe { &*record }.store(0, Ordering::Release);
        self.rebase_receives()?;
        *lock(&self.inner.pad) = Some(next);
        tracing::debug!(qpn = format_args!("{:#x}", self.qpn()), next, "queue pair reset");
        Ok(())
    }

    /// Consumes the completions of every receive posted (flushed, the QP being in error).
    fn drain_receives(&self) -> Result<()> {
        if self.receive_handle().is_none() {
            return Ok(());
        }
        // SAFETY: host rings (checked by the caller); no other poster (reset's contract).
        let rq = unsafe { self.cpu_receive::<Exclusive>() }?;
        let h = self.receive_handle().expect("checked above");
        // SAFETY: the CPU receive handle's counters, read atomically.
        let (consumed, reserved) = unsafe {
            (
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*h).cq.consumed)).load(Ordering::Acquire),
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*h).rq_reserved)).load(Ordering::Acquire),
            )
        };
        for index in consumed..reserved {
            match rq.poll(index) {
                // A flushed receive is what a QP in error gives back; a timeout is not.
                Ok(_) | Err(WaitError::Cqe(_)) => {}
                Err(e) => {
                    return Err(Error::Timeout {
                        what: format!(
                            "flushing the receives of queue pair {:#x} before its reset ({e})",
                            self.qpn()
                        ),
                        after: self.timeout(),
                    })
                }
            }
        }
        Ok(())
    }

    /// After 2RST the hardware counts receives from 0 again while the receive CQ keeps its
    /// place: every receive handle's base becomes the next receive index (receives are posted
    /// at their index less the base, the record counts from it), nothing consumed past it, no
    /// error.
    fn rebase_receives(&self) -> Result<()> {
        let Some(h) = self.receive_handle() else { return Ok(()) };
        // SAFETY: the CPU receive handle, alive with self; no poster now (reset's contract).
        unsafe {
            let next = (*h).rq_reserved;
            (*h).rq_ready = next;
            (*h).index_base = next;
            (*h).cq.consumed = next;
            (*h).cq.error = NO_ERROR;
            publish(h, &self.inner.recv_exports)
        }
    }

    /// The next ticket a pending reset left (realigned at the next connect), if any.
    pub(super) fn pending_pad(&self) -> Option<u64> {
        *lock(&self.inner.pad)
    }

    /// Rings what was posted and not rung, then consumes every completion up to the last WQE
    /// reserved (flushed, the QP being in error). Returns the next ticket.
    fn drain(&self) -> Result<u64> {
        // SAFETY: host rings (checked by the caller); no other poster (reset's contract).
        let dev = unsafe { self.cpu::<Exclusive>() }?;
        // Ringing a QP in error only flushes what was pending.
        let _ = dev.commit();
        let reserved = dev.reserved();
        let timeout = self.timeout();
        let started = Instant::now();
        while dev.consumed() < reserved {
            if dev.poll_one().is_none() {
                if started.elapsed() > timeout {
                    return Err(Error::Timeout {
                        what: format!(
                            "flushing queue pair {:#x} before its reset ({} of {reserved} WQEs completed)",
                            self.qpn(),
                            dev.consumed()
                        ),
                        after: timeout,
                    });
                }
                std::thread::yield_now();
            }
        }
        Ok(reserved)
    }

    /// The bound of the QP's waits, from its handle.
    fn timeout(&self) -> std::time::Duration {
        // SAFETY: a constant field of the live handle.
        std::time::Duration::from_nanos(unsafe { (*self.device_handle()).timeout_ns })
    }

    /// After a reset, once in RTS: realigns the send queue with the CQ (module doc), then sets
    /// every handle's counters to the next ticket.
    pub(super) fn realign(&self, next: u64) -> Result<()> {
        let h = self.device_handle();
        // SAFETY: constant fields of the live CPU handle.
        let (sq_log, cq_log, cqe_base, cq_rec) =
            unsafe { ((*h).sq_log_size, (*h).cq.log_size, (*h).cq.cqe_base, (*h).cq.dbrec) };
        let size = 1u64 << sq_log;
        let (mut hw, mut cq) = (0u64, next);
        let started = Instant::now();
        loop {
            // Unsignalled NOPs still needed: each signalled one moves both counters.
            let d = cq.wrapping_sub(hw) & dbrec::WQ_COUNTER_MASK as u64;
            if d == 0 {
                break;
            }
            let n = d.min(size - 1);
            for i in 0..=n {
                let flags = if i == n { CE_CQ_UPDATE } else { 0 };
                let words =
                    CtrlSeg::new(WqeOpcode::Nop, 0, (hw + i) as u16, self.qpn(), ring::DS_NOP, flags, 0).to_words();
                let slot = (self.inner.sq() + ring::wqe_offset(hw + i, sq_log)) as *const AtomicU64;
                for (k, w) in words.iter().enumerate() {
                    // SAFETY: a 64-byte slot of the QP's send queue in host memory, which no
                    // poster touches now (reset's contract); the HCA reads it after the doorbell.
                    unsafe { &*slot.add(k) }.store(*w, Ordering::Relaxed);
                }
            }
            hw += n + 1;
            if cq_log == 0 {
                // A collapsed CQ's one entry still holds the CQE before (a flush, or the last
                // round's): marked unwritten, the wait below sees only this round's. Nothing
                // else is outstanding, so the entry is the library's to write.
                // SAFETY: op_own, the last byte of the CQ's entry 0 in host memory (refused
                // otherwise by `reset`), alive with the QP.
                unsafe {
                    &*((cqe_base + gdaki_layout::cqe::field::OP_OWN.start as u64) as *const std::sync::atomic::AtomicU8)
                }
                .store(gdaki_layout::cqe::OP_OWN_INIT, Ordering::Release);
            }
            self.ring_realigning(hw);
            self.await_cqe(cqe_base, cq_log, cq, started)?;
            cq += 1;
            // SAFETY: the CQ's doorbell record (host memory), 4-byte aligned.
            unsafe { &*(cq_rec as *const AtomicU32) }.store(dbrec::cq_ci(cq).to_be(), Ordering::Release);
        }
        self.set_counters(cq)?;
        tracing::debug!(
            qpn = format_args!("{:#x}", self.qpn()),
            next = cq,
            padded = hw,
            "queue pair realigned"
        );
        Ok(())
    }

    /// Rings for `pi` WQEs as a poster would: the record (unless the QP has none), then the
    /// doorbell register.
    fn ring_realigning(&self, pi: u64) {
        let record = (self.inner.sq() + self.inner.sq_dbrec_offset()) as *const AtomicU32;
        // SAFETY: the send word of the QP's record (host memory) and its doorbell register,
        // mapped for the QP's life, each written atomically as the HCA expects.
        unsafe {
            if !self.inner.reliable_doorbell {
                (*record).store(dbrec::wq_counter(pi).to_be(), Ordering::Release);
            }
            (*(self.inner.doorbell_addr() as *const AtomicU64))
                .store(doorbell::word(self.qpn(), pi), Ordering::Release);
        }
    }

    /// Waits for CQE `index` of the send CQ (a realigning NOP's): a success.
    fn await_cqe(&self, cqe_base: u64, log: u32, index: u64, started: Instant) -> Result<()> {
        let timeout = self.timeout();
        let slot = cqe_base + ring::cqe_offset(index, log);
        loop {
            // SAFETY: a CQE of the QP's CQ in host memory; its last word (op_own last) is
            // written by the HCA with release.
            let last = unsafe { &*((slot + 56) as *const AtomicU64) }.load(Ordering::Acquire);
            let op_own = last.to_ne_bytes()[7];
            if ring::cqe_ready(op_own, index, log) {
                // SAFETY: the whole CQE, written before its last word.
                let bytes: [u8; 64] = unsafe { std::ptr::read_volatile(slot as *const [u8; 64]) };
                let cqe: gdaki_layout::cqe::Cqe64 = bytemuck::cast(bytes);
                return match cqe.opcode() {
                    CqeOpcode::Req => Ok(()),
                    _ => Err(Error::QpError {
                        qpn: self.qpn(),
                        syndrome: cqe.as_error().syndrome(),
                    }),
                };
            }
            if started.elapsed() > timeout {
                return Err(Error::Timeout {
                    what: format!("realigning queue pair {:#x} after its reset", self.qpn()),
                    after: timeout,
                });
            }
            std::thread::yield_now();
        }
    }

    /// Sets the hot counters of the CPU handle and of every live GPU export to `next`: nothing
    /// reserved, ready or rung past it, every CQE before it consumed, no error.
    fn set_counters(&self, next: u64) -> Result<()> {
        let h = self.device_handle();
        // SAFETY: the CPU handle's hot words, which no poster uses now (reset's contract).
        unsafe {
            (*h).sq_reserved = next;
            (*h).sq_ready = next;
            (*h).sq_rung = next;
            (*h).db_lock = 0;
            (*h).cq.consumed = next;
            (*h).cq.error = NO_ERROR;
            publish(h, &self.inner.exports)
        }
    }
}
