//! The soft device's own view of the queues it serves: a CQ's ring and counters, a QP's send
//! queue, doorbell, progress and connected peer. The rings live in memory the host library
//! registered (umems); a [`Window`] names such memory and keeps it alive for as long as the
//! engine may touch it.
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gdaki_layout::{AtomicReplyOrder, Syndrome};

use gdaki_devx::util::lock;
use gdaki_devx::QpState;

/// A range of host memory the device reads and writes (a ring, a doorbell record, a doorbell
/// page), with what keeps it allocated.
pub(crate) struct Window {
    addr: u64,
    _keep: Arc<dyn Send + Sync>,
}

impl Window {
    /// Memory at `addr`, kept alive by `keep`.
    ///
    /// # Safety
    /// The range the device will touch from `addr` (checked by whoever made the window: the
    /// firmware against the umem's length) stays valid memory for as long as `keep` lives.
    pub unsafe fn new(addr: u64, keep: Arc<dyn Send + Sync>) -> Window {
        Window { addr, _keep: keep }
    }

    /// A whole buffer the library owns.
    pub fn of(buffer: Arc<gdaki_devx::HostBuffer>) -> Window {
        // SAFETY: the buffer is kept alive by the window itself.
        unsafe { Window::new(buffer.addr(), buffer) }
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// Its address as the HCA and posters see it.
    pub fn addr(&self) -> u64 {
        self.addr
    }
}

/// A completion queue as the soft HCA holds it.
pub(crate) struct SoftCq {
    pub cqn: u32,
    pub log_size: u32,
    /// The CQE ring.
    pub ring: Window,
    /// Doorbell record: word 0 the consumer index (big-endian), word 1 arm.
    pub dbrec: Window,
    /// CQEs written so far (the engine's producer index).
    pub pi: AtomicU64,
    /// The consumer index last read from the doorbell record (re-read only when the CQ looks
    /// full, so the record's cache line is not pulled from the poller on every CQE).
    pub ci_seen: std::sync::atomic::AtomicU32,
    /// Set when the engine had a CQE to write and no room.
    pub overrun: AtomicBool,
    /// The QP it serves, if any.
    pub qpn: Mutex<Option<u32>>,
    /// Collapsed (`cqc.cc`): every CQE goes to entry 0.
    pub collapsed: bool,
    /// Overrun ignore (`cqc.oi`): CQEs are written whatever the consumer index says.
    pub overrun_ignore: bool,
}

impl SoftCq {
    /// A CQ of `2^log_size` CQEs in `ring`, with its doorbell record in `dbrec`, written as
    /// `cc` (collapsed) and `oi` (overrun ignore) say.
    pub fn new(cqn: u32, log_size: u32, ring: Window, dbrec: Window, collapsed: bool, overrun_ignore: bool) -> SoftCq {
        SoftCq {
            cqn,
            log_size,
            ring,
            dbrec,
            collapsed,
            overrun_ignore,
            pi: AtomicU64::new(0),
            ci_seen: std::sync::atomic::AtomicU32::new(0),
            overrun: AtomicBool::new(false),
            qpn: Mutex::new(None),
        }
    }
}

/// The largest receive WQE the soft HCA takes (`MAX_RECV_SGES` data segments).
pub(crate) const RECV_WQE_MAX: usize = gdaki_layout::recv::MAX_RECV_SGES * gdaki_layout::data::SIZE;

/// A QP's receive queue as the soft HCA holds it: the ring of receive WQEs, the receive word of
/// the QP's doorbell record (posters raise it), and the receive CQ.
pub(crate) struct SoftRq {
    pub log_size: u32,
    pub log_stride: u32,
    /// The receive WQEs.
    pub ring: Window,
    /// The QP's doorbell record: word 0 is the receive counter.
    pub dbrec: Window,
    pub cq: Arc<SoftCq>,
    /// Where the responder is: every writer of the receive CQ holds this lock (the responder,
    /// on a requester's engine or a transport thread, and the engine that flushes), so its
    /// CQEs go in receive order.
    pub taken: Mutex<RqCursor>,
}

/// The responder's place in a receive queue (under [`SoftRq::taken`]'s lock).
#[derive(Debug, Default)]
pub(crate) struct RqCursor {
    /// Receives taken so far (by messages, or flushed).
    pub taken: u64,
    /// Receives past `taken` that the record announced when last read. They are taken without
    /// reading it again: the record's cache line is the posters', written on every post, and
    /// a read per message would fetch it from their core each time.
    pub known: u64,
}

impl SoftRq {
    /// The receive counter posters last wrote (16 bits, big-endian in the record).
    pub fn posted(&self) -> u16 {
        // SAFETY: word 0 of the QP's doorbell record, aligned, alive with the window.
        let rec = unsafe { std::sync::atomic::AtomicU32::from_ptr(self.dbrec.as_ptr() as *mut u32) };
        u32::from_be(rec.load(Ordering::Acquire)) as u16
    }

    /// Receives posted and not taken, given `taken` so far; more than the ring holds (a record
    /// that cannot be) is `None`.
    pub fn waiting(&self, taken: u64) -> Option<u64> {
        let n = self.posted().wrapping_sub(taken as u16) as u64;
        (n <= 1 << self.log_size).then_some(n)
    }

    /// Where receive WQE `index` is in the ring.
    pub fn wqe_addr(&self, index: u64) -> u64 {
        self.ring.addr() + gdaki_layout::recv::wqe_offset(index, self.log_size, self.log_stride)
    }

    /// The bytes of receive WQE `index`: the first `wqe_size(log_stride)` of the block (at
    /// most 64: CREATE_QP refuses larger strides).
    pub fn wqe(&self, index: u64) -> ([u8; RECV_WQE_MAX], usize) {
        let size = gdaki_layout::recv::wqe_size(self.log_stride).min(RECV_WQE_MAX);
        let at = self.wqe_addr(index);
        let mut out = [0u8; RECV_WQE_MAX];
        // SAFETY: a WQE of the live ring (checked against the umem at creation), written by
        // the poster before the record that announced it, which the caller read.
        unsafe { std::ptr::copy_nonoverlapping(at as *const u8, out.as_mut_ptr(), size) };
        (out, size)
    }
}

/// Who may send to a QP over the transport: the QP it was moved to RTR with, starting at the
/// PSN exchanged then, from that peer's address (RC's rule; rxe drops anything else).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RtrPeer {
    pub qpn: u32,
    pub psn: u32,
    /// The peer HCA's address, where known (its endpoint's transport address).
    pub ip: Option<IpAddr>,
}

impl RtrPeer {
    /// Whether a connection from `from` claiming QP `qpn` with first PSN `psn` is this peer.
    pub fn admits(&self, qpn: u32, psn: u32, from: Option<IpAddr>) -> bool {
        let ip_ok = match (self.ip.map(|a| a.to_canonical()), from.map(|a| a.to_canonical())) {
            (Some(want), Some(got)) if !want.is_unspecified() => want == got,
            _ => true,
        };
        self.qpn == qpn && self.psn == psn & 0xff_ffff && ip_ok
    }
}

/// A queue pair as the soft HCA holds it.
pub(crate) struct SoftQp {
    pub qpn: u32,
    /// What a transport connection to this QP must present (its endpoint carries it): binds
    /// the connection to the handshake that handed the endpoint out.
    pub secret: u64,
    /// The protection domain: the QP's WQEs and its peer's requests may use keys of this PD
    /// only.
    pub pd: u32,
    /// Initial PSN: the first transport request's sequence number (set at creation by the
    /// library's path, at RTR2RTS by the firmware's).
    psn: std::sync::atomic::AtomicU32,
    /// How long a request waits for its answer, in nanoseconds.
    retry_timeout_ns: AtomicU64,
    pub(crate) state: AtomicU8,
    pub sq_log: u32,
    pub sq: Window,
    /// The doorbell page: the 8-byte doorbell word at offset 0.
    pub uar: Window,
    pub cq: Arc<SoftCq>,
    max_msg_size: AtomicU64,
    /// log2 of the READs and atomics it keeps in flight as a requester (RTR2RTS's
    /// `log_sra_max`).
    log_sra_max: AtomicU8,
    /// The byte order in which this QP's fetched atomic values are written back.
    pub atomic_reply: AtomicReplyOrder,
    /// The receive queue, if it was created with one.
    pub rq: Option<SoftRq>,
    /// INIT2RTR's `min_rnr_nak`: the timer code this QP's RNR NAKs carry.
    min_rnr_nak: AtomicU8,
    /// RTR2RTS's `rnr_retry`: how often a request answered "receiver not ready" is tried again
    /// (7: forever).
    rnr_retry: AtomicU8,
    /// Raised each time the peer answers "receiver not ready" over the transport: the engine
    /// watches it, so a quiet QP is serviced for the retry.
    pub rnr_events: std::sync::atomic::AtomicU32,
    pub first_error: Mutex<Option<Syndrome>>,
    /// The peer set at INIT2RTR: the only one the transport serves.
    pub rtr_peer: Mutex<Option<RtrPeer>>,
    /// The RTR peer's transport connection came (it may have ended since): RC has one per
    /// peer, so no other, nor the same replayed, is served until INIT2RTR sets a new peer.
    pub transport_bound: AtomicBool,
    /// A refused connection to this QP was logged at warn (later ones at debug).
    pub refusal_said: AtomicBool,
    /// Created with `qpc.cd_master`: it may post WAIT WQEs.
    pub cd_master: bool,
}

impl SoftQp {
    /// A QP in RESET on `cq`, reading its send queue of `2^sq_log` blocks from `sq` and its
    /// doorbell from `uar` (the model does not read the doorbell record: the doorbell carries
    /// the same counter).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        qpn: u32,
        secret: u64,
        pd: u32,
        psn: u32,
        sq_log: u32,
        sq: Window,
        uar: Window,
        cq: Arc<SoftCq>,
        max_msg_size: u64,
        retry_timeout: Duration,
        atomic_reply: AtomicReplyOrder,
        rq: Option<SoftRq>,
    ) -> SoftQp {
        SoftQp {
            qpn,
            secret,
            pd,
            psn: psn.into(),
            retry_timeout_ns: AtomicU64::new(retry_timeout.as_nanos().min(u64::MAX as u128) as u64),
            state: AtomicU8::new(QpState::Reset as u8),
            sq_log,
            sq,
            uar,
            cq,
            max_msg_size: max_msg_size.into(),
            log_sra_max: AtomicU8::new(0),
            atomic_reply,
            rq,
            min_rnr_nak: AtomicU8::new(0),
            rnr_retry: AtomicU8::new(7),
            rnr_events: std::sync::atomic::AtomicU32::new(0),
            first_error: Mutex::new(None),
            rtr_peer: Mutex::new(None),
            transport_bound: AtomicBool::new(false),
            refusal_said: AtomicBool::new(false),
            cd_master: false,
        }
    }

    /// The same QP, a Core-Direct master (`qpc.cd_master`) or not.
    pub fn with_cd_master(self, on: bool) -> SoftQp {
        SoftQp { cd_master: on, ..self }
    }

    /// The first PSN this QP sends.
    pub fn psn(&self) -> u32 {
        self.psn.load(Ordering::Acquire)
    }

    /// How long a request waits for its answer before it fails with a transport error.
    pub fn retry_timeout(&self) -> Duration {
        Duration::from_nanos(self.retry_timeout_ns.load(Ordering::Acquire))
    }

    /// The largest message one WQE may carry.
    pub fn max_msg_size(&self) -> u64 {
        self.max_msg_size.load(Ordering::Acquire)
    }

    /// Sets what RTR2RTS carries: the first PSN and the retry timeout.
    pub fn set_send_params(&self, psn: u32, retry_timeout: Duration) {
        self.psn.store(psn, Ordering::Release);
        self.retry_timeout_ns
            .store(retry_timeout.as_nanos().min(u64::MAX as u128) as u64, Ordering::Release);
    }

    /// Sets the largest message (INIT2RTR's `log_msg_max`).
    pub fn set_max_msg_size(&self, bytes: u64) {
        self.max_msg_size.store(bytes, Ordering::Release);
    }

    /// Sets how many READs and atomics it keeps in flight (RTR2RTS's `log_sra_max`).
    pub fn set_log_sra_max(&self, log: u8) {
        self.log_sra_max.store(log, Ordering::Release);
    }

    /// How many READs and atomics it keeps in flight to a remote peer at most.
    pub fn max_reads_in_flight(&self) -> usize {
        1 << self.log_sra_max.load(Ordering::Acquire).min(7)
    }

    /// Sets INIT2RTR's RNR NAK timer code.
    pub fn set_min_rnr_nak(&self, code: u8) {
        self.min_rnr_nak.store(code & 0x1f, Ordering::Release);
    }

    /// INIT2RTR's RNR NAK timer code.
    pub fn min_rnr_nak(&self) -> u8 {
        self.min_rnr_nak.load(Ordering::Acquire)
    }

    /// How long a requester waits before it tries again after this QP answered "receiver not
    /// ready" (IB's RNR NAK timer, from INIT2RTR's `min_rnr_nak`).
    pub fn rnr_delay(&self) -> Duration {
        rnr_timer(self.min_rnr_nak.load(Ordering::Acquire))
    }

    /// Sets RTR2RTS's RNR retry count.
    pub fn set_rnr_retry(&self, n: u8) {
        self.rnr_retry.store(n & 7, Ordering::Release);
    }

    /// How often a request answered "receiver not ready" is tried again; `None`: forever.
    pub fn rnr_retries(&self) -> Option<u32> {
        match self.rnr_retry.load(Ordering::Acquire) {
            7 => None,
            n => Some(n as u32),
        }
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        QpState::from_raw(self.state.load(Ordering::Acquire))
    }

    pub(crate) fn set_state(&self, s: QpState) {
        self.state.store(s as u8, Ordering::Release);
    }

    /// Moves to the error state, keeping the first error's syndrome.
    pub fn fail(&self, syndrome: Syndrome) {
        let mut first = lock(&self.first_error);
        if first.is_none() {
            *first = Some(syndrome);
            tracing::warn!(qpn = format_args!("{:#x}", self.qpn), %syndrome, "queue pair to error");
        }
        self.set_state(QpState::Error);
    }

    /// 2RST: back to RESET as a new QP is, its error, RTR peer and transport binding
    /// forgotten, the receive queue's place back at 0 and the doorbell word cleared (the engine
    /// acts on changes of the word; a QP's doorbell always names it, so it never reads 0).
    /// The engine's progress on the send queue is reset by the caller.
    pub fn reset(&self) {
        self.set_state(QpState::Reset);
        *lock(&self.first_error) = None;
        *lock(&self.rtr_peer) = None;
        self.transport_bound.store(false, Ordering::Release);
        self.refusal_said.store(false, Ordering::Release);
        if let Some(rq) = &self.rq {
            *lock(&rq.taken) = RqCursor::default();
        }
        self.doorbell().store(0, Ordering::Release);
    }

    /// The doorbell word.
    pub fn doorbell(&self) -> &AtomicU64 {
        // SAFETY: the UAR buffer is at least 8 bytes, page-aligned, and lives as long as self.
        unsafe { AtomicU64::from_ptr(self.uar.as_ptr() as *mut u64) }
    }
}

/// IB's RNR NAK timer (InfiniBand Architecture 1.2, table 45): code 0 is 655.36 ms, codes 1
/// to 31 run from 0.01 ms to 491.52 ms, roughly doubling every two codes.
pub(crate) fn rnr_timer(code: u8) -> Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120, 7680, 10_240,
        15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[(code & 0x1f) as usize] as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rnr_timer_codes_follow_the_ib_table() {
        assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
        assert_eq!(rnr_timer(1), Duration::from_micros(10));
        assert_eq!(rnr_timer(12), Duration::from_micros(640));
        assert_eq!(rnr_timer(31), Duration::from_micros(491_520));
        assert_eq!(rnr_timer(32 + 12), rnr_timer(12), "5 bits");
    }
}
