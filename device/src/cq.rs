//! A completion queue as the device consumes it: polling a CQE by its index (owner-bit
//! parity and WQE counter, one 8-byte load), the sticky first error, and the consumer index
//! (doorbell record first, then the count posters read). Written once for a QP's send CQ
//! ([`crate::qp`]) and its receive CQ ([`crate::rq`]): both complete in order, so a CQE's
//! index is the index of the WQE it completes. A collapsed CQ (`DevCq::log_size` 0) keeps only
//! the newest CQE, which completes its WQE and every one before it.
use core::marker::PhantomData;
use core::ptr::addr_of_mut;

use gdaki_layout::cqe::{self, Cqe64, Tail as CqeTail};
use gdaki_layout::handle::{error_word, ERROR_SYNDROME_SHIFT, ERROR_VALID, NO_ERROR};
use gdaki_layout::{dbrec, ring, DevCq, Syndrome};

use crate::arch;
use crate::sharing::Sharing;
use crate::status::{CqeError, WaitError};

/// The constant fields of a `DevCq`, read once with the handle that embeds it (see
/// `qp::Consts`).
#[derive(Clone, Copy)]
pub(crate) struct Consts {
    cqe_base: u64,
    dbrec: u64,
    log_size: u32,
}

impl Consts {
    /// # Safety
    /// `ptr` is valid for reads.
    #[inline(always)]
    pub(crate) const unsafe fn read(ptr: *const DevCq) -> Consts {
        // SAFETY: the caller's contract; constant fields, read by value.
        unsafe {
            Consts {
                cqe_base: (*ptr).cqe_base,
                dbrec: (*ptr).dbrec,
                log_size: (*ptr).log_size,
            }
        }
    }
}

/// A CQ of a live handle, with its constant fields read once.
pub(crate) struct Cq<M: Sharing> {
    ptr: *mut DevCq,
    k: Consts,
    /// What the WQE counter of CQE `i` holds is `i - base` (16 bits of it): 0 on a send CQ
    /// (its QP's send queue is realigned after a reset), a receive queue's `index_base` on its.
    base: u64,
    _mode: PhantomData<M>,
}

impl<M: Sharing> Cq<M> {
    /// The CQ at `ptr`, whose constants are `k`.
    ///
    /// # Safety
    /// `ptr` is the `DevCq` of a live exported handle, and `k` was read from it.
    #[inline(always)]
    pub(crate) const unsafe fn new(ptr: *mut DevCq, k: Consts) -> Self {
        Cq {
            ptr,
            k,
            base: 0,
            _mode: PhantomData,
        }
    }

    /// The same CQ, whose CQE `i` carries the WQE counter of `i - base` (a receive CQ after a
    /// reset of its QP: see `DevRq::index_base`).
    #[inline(always)]
    pub(crate) const fn with_base(self, base: u64) -> Self {
        Cq { base, ..self }
    }

    /// The WQE counter CQE `index` carries.
    #[inline(always)]
    const fn counter(&self, index: u64) -> u16 {
        index.wrapping_sub(self.base) as u16
    }

    /// The count of consumed CQEs (`DevCq::consumed`).
    #[inline(always)]
    pub(crate) fn consumed(&self) -> *mut u64 {
        // SAFETY: `ptr` is valid per `new`; only the field's address is taken.
        unsafe { addr_of_mut!((*self.ptr).consumed) }
    }

    /// The sticky error word (`DevCq::error`).
    #[inline(always)]
    pub(crate) fn error(&self) -> *mut u64 {
        // SAFETY: `ptr` is valid per `new`; only the field's address is taken.
        unsafe { addr_of_mut!((*self.ptr).error) }
    }

    /// Address of the CQE slot of `index`.
    #[inline(always)]
    pub(crate) fn cqe_slot(&self, index: u64) -> u64 {
        let (base, log) = (self.k.cqe_base, self.k.log_size);
        base + ring::cqe_offset(index, log)
    }

    /// Loads the last 8 bytes of the CQE slot of `index`: the WQE counter and `op_own`
    /// (opcode, format, owner), all a successful completion needs, in one load (one round
    /// trip where the CQ is in host memory). An acquire load: once the tail says the CQE is
    /// written, what the HCA wrote before it (the CQE's body, a READ's data) is visible
    /// without a barrier. See [`CqeTail`].
    #[inline(always)]
    pub(crate) fn peek(&self, index: u64) -> CqeTail {
        let slot = self.cqe_slot(index);
        // SAFETY: the CQ ring of the live handle; the tail word is 8-byte aligned in its entry.
        CqeTail(unsafe { arch::load_u64_acquire((slot + cqe::TAIL_OFFSET as u64) as *const u64) })
    }

    /// [`peek`](Self::peek) as a relaxed load, which orders nothing after it: several are in
    /// flight at once, where each acquire load holds back the loads after it for its round
    /// trip. For a look that reads nothing else of a successful CQE (a send queue's slot
    /// count); [`complete_seen`](Self::complete_seen) reads an error CQE's body after a barrier.
    #[inline(always)]
    pub(crate) fn peek_relaxed(&self, index: u64) -> CqeTail {
        let slot = self.cqe_slot(index);
        // SAFETY: as in `peek`.
        CqeTail(unsafe { arch::load_u64_volatile((slot + cqe::TAIL_OFFSET as u64) as *const u64) })
    }

    /// Whether the CQE of `index` is written (successful or not), without consuming it.
    #[inline(always)]
    pub(crate) fn written(&self, index: u64) -> bool {
        let (tail, log) = (self.peek(index), self.k.log_size);
        ring::cqe_ready(tail.op_own(), index, log) && ring::cqe_completes(tail.wqe_counter(), self.counter(index), log)
    }

    /// Looks at the CQE of `index` once: `None` if not written yet, else its outcome, consuming
    /// it (consumer index, doorbell record, sticky error).
    #[inline(always)]
    pub(crate) fn try_complete(&self, index: u64) -> Option<Result<(), WaitError>> {
        self.complete_seen(index, self.peek(index))
    }

    /// [`try_complete`](Self::try_complete) with the CQE's tail already loaded by [`peek`](Self::peek)
    /// (whose acquire load orders the reads after it).
    #[inline(always)]
    pub(crate) fn complete_seen(&self, index: u64, tail: CqeTail) -> Option<Result<(), WaitError>> {
        self.complete_with(index, tail, false, |_| ())
    }

    /// [`complete_seen`](Self::complete_seen), handing a successful CQE's slot to `success`
    /// (the tail's acquire load made what the HCA wrote before it visible) for what the caller
    /// reads from it: nothing for a send, the byte count and immediate for a receive.
    /// `reads_body`: `success` loads from the slot, so the doorbell record that frees it is
    /// stored after those loads (see [`consume_through`](Self::consume_through)).
    #[inline(always)]
    pub(crate) fn complete_with<T>(
        &self,
        index: u64,
        tail: CqeTail,
        reads_body: bool,
        success: impl FnOnce(u64) -> T,
    ) -> Option<Result<T, WaitError>> {
        let log = self.k.log_size;
        let op_own = tail.op_own();
        if !ring::cqe_ready(op_own, index, log) {
            return None;
        }
        // A compressed or otherwise formatted CQE is not a 64-byte CQE of this WQE: misreading
        // it would complete the wrong WQE. gdaki's CQs never ask for one; say so rather than
        // guess (it stays unconsumed).
        if cqe::format(op_own) != 0 {
            return Some(Err(WaitError::CqeFormat {
                index,
                format: cqe::format(op_own),
            }));
        }
        // The owner bit only tells laps apart modulo 2: an entry two laps old looks written too.
        // Its WQE counter does not match (rings are at most 2^15 entries). The counter and
        // op_own come from one load; were they ever torn, a stale counter reads as "not yet"
        // and a stale owner bit fails the check above, so a CQE is never taken for another.
        // A collapsed CQ's one entry holds the newest CQE, which may be a later WQE's.
        if !ring::cqe_completes(tail.wqe_counter(), self.counter(index), log) {
            return None;
        }
        // What the HCA wrote before this CQE (a READ's data, say) is visible where `tail` was an
        // acquire load (`peek`); an error's body is read after a barrier, as the tail may come
        // from a relaxed load (`peek_relaxed`).
        let is_error = cqe::opcode(op_own).is_error();
        let outcome = if is_error {
            arch::from_device_barrier();
            let e = Self::read_cqe(self.cqe_slot(index)).as_error();
            let word = error_word(self.failed_at(index), e.syndrome, e.vendor_err_synd, e.wqe_opcode());
            self.record_error(word);
            Err(WaitError::Cqe(CqeError::from_word(word)))
        } else {
            Ok(success(self.cqe_slot(index)))
        };
        // A collapsed CQ's newest CQE may be a later WQE's: consumed through `index` alone, the
        // next poll reads the same entry and is done at once.
        self.consume_through(index, reads_body || is_error);
        Some(outcome)
    }

    /// Where the error the CQE for `index` holds is charged. In a ring, to `index`, after any
    /// earlier real error is recorded (a flush seen first must not hide it). In a collapsed CQ
    /// the CQEs before it were overwritten, so the WQE that failed is any from the first not
    /// yet known complete: the error is charged there (those before completed, or the CQ would
    /// have said so), and since only the newest CQE is kept, it is often the flush that
    /// followed the failure. Error path only: cold (see
    /// [`record_earlier_errors`](Self::record_earlier_errors) for the `#[inline]`).
    #[cold]
    #[inline]
    fn failed_at(&self, index: u64) -> u64 {
        if self.k.log_size == 0 {
            // SAFETY: a counter of the live handle, touched only through `M`'s atomics.
            unsafe { M::load_acquire(self.consumed()) }.min(index)
        } else {
            self.record_earlier_errors(index);
            index
        }
    }

    /// Reads the CQE at `slot` after its owner bit said it is written (and a barrier since).
    #[inline(always)]
    pub(crate) fn read_cqe(slot: u64) -> Cqe64 {
        let mut words = [0u64; 8];
        for (i, w) in words.iter_mut().enumerate() {
            // SAFETY: `slot` is a 64-byte entry of the live CQ ring.
            *w = unsafe { arch::load_u64_volatile((slot as *const u64).add(i)) };
        }
        bytemuck::cast(words)
    }

    /// Before consuming an error CQE past unread ones, records the earliest error among them: a
    /// flush seen first must not hide the error that caused it. CQEs are written in order, so
    /// every one before `index` is there. Error path only: cold, so it stays out of line in the
    /// hot loop, but `#[inline]` so a crate that embeds gdaki-device compiles its own copy and
    /// its PTX has no unresolved `.extern .func` into this crate.
    #[cold]
    #[inline]
    pub(crate) fn record_earlier_errors(&self, index: u64) {
        let (base, log) = (self.k.cqe_base, self.k.log_size);
        let first = unsafe { M::load_acquire(self.consumed()) };
        for j in first..index {
            let slot = base + ring::cqe_offset(j, log);
            // SAFETY: a slot of the live CQ ring.
            let op_own = unsafe { arch::load_u8_volatile((slot + cqe::field::OP_OWN.start as u64) as *const u8) };
            if ring::cqe_ready(op_own, j, log) && cqe::opcode(op_own).is_error() {
                arch::from_device_barrier();
                let e = Self::read_cqe(slot).as_error();
                if e.syndrome() != Syndrome::WrFlush {
                    self.record_error(error_word(j, e.syndrome, e.vendor_err_synd, e.wqe_opcode()));
                    return;
                }
            }
        }
    }

    /// Keeps the first real error: an earlier flush is replaced by the error that caused it.
    #[inline(always)]
    pub(crate) fn record_error(&self, word: u64) {
        let is_flush = |w: u64| (w >> ERROR_SYNDROME_SHIFT) as u8 == Syndrome::WrFlush.raw();
        // SAFETY: the CQ's error word of the live handle.
        let cur = unsafe { M::load_acquire(self.error()) };
        if cur == NO_ERROR || (is_flush(cur) && !is_flush(word)) {
            // A lost race only loses to another error recorded at the same moment; both are
            // errors of this QP, so either describes it.
            // SAFETY: a counter (or the lock) of the live handle (`from_raw`), touched only through `M`'s atomics.
            unsafe { M::store_release(self.error(), word) };
        }
    }

    /// Raises the consumer index past `index`: tells the HCA (the doorbell record never moves
    /// backwards: it is compare-and-swapped in 24-bit wrapped order), then the posters.
    ///
    /// In that order: the consumed count frees send-queue slots, and a WQE posted into a freed
    /// slot may complete at once. Were the count raised first, the HCA could complete that WQE
    /// while the record still said the CQ was full, and overrun it (the soft HCA reported
    /// "CQ overrun" and a kernel timed out, in about one GPU test run in four).
    ///
    /// `after_reads`: the caller read CQE bodies (not only the tail its poll loaded), so the
    /// record is a release store; a tail-only consumer (a send's completion) stores it relaxed
    /// and keeps a system-scope fence off its path (see [`arch::store_cq_dbrec`]).
    #[inline(always)]
    pub(crate) fn consume_through(&self, index: u64, after_reads: bool) {
        let next = index + 1;
        // SAFETY: counters and record of the live handle.
        if unsafe { M::load_acquire(self.consumed()) } >= next {
            return; // another poller consumed past it, and moved the record first
        }
        let rec = self.k.dbrec as *mut u32;
        let want = dbrec::cq_ci(next);
        if !M::SHARED {
            // SAFETY: as above; stored before the count below.
            unsafe { arch::store_cq_dbrec(rec, want.to_be(), after_reads) };
        } else {
            // SAFETY: `rec` is the CQ's doorbell record from the live handle, 4-byte aligned.
            let mut cur = unsafe { arch::load_u32_volatile(rec) };
            while !ring::cq_ci_at_or_after(u32::from_be(cur), want) {
                // SAFETY: as above (an acq_rel system-scope CAS: visible before the count).
                let seen = unsafe { arch::cas_dbrec(rec, cur, want.to_be()) };
                if seen == cur {
                    break;
                }
                cur = seen;
            }
        }
        if M::SHARED {
            // SAFETY: as above.
            unsafe { M::fetch_max(self.consumed(), next) };
        } else {
            // The only consumer, and the count is below `next` (read above): no second load.
            // SAFETY: as above.
            unsafe { M::store_release(self.consumed(), next) };
        }
    }

    /// The sticky error, if it concerns WQE `index` (at or before it).
    #[inline(always)]
    pub(crate) fn error_at_or_before(&self, index: u64) -> Result<(), CqeError> {
        // SAFETY: a counter (or the lock) of the live handle (`from_raw`), touched only through `M`'s atomics.
        let err = unsafe { M::load_acquire(self.error()) };
        if err & ERROR_VALID != 0 && ((index as u32).wrapping_sub(err as u32) as i32) >= 0 {
            return Err(CqeError::from_word(err));
        }
        Ok(())
    }
}
