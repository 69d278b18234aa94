//! The device data path driven by CPU threads against a small consumer thread that plays the
//! HCA: it reads the doorbell, parses every WQE with `gdaki_layout::wqe` (checking order,
//! index, QP number, `ds`), executes it on registered host buffers, and writes CQEs (error CQEs
//! for bad keys, then flushes, as a NIC does). Every scenario checks the data byte for byte.
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use gdaki_device::scope::Group;
use gdaki_device::{AtomicOp, Cta, Exclusive, Gpu, Local, PostError, Qp, Remote, Scope, Sharing, WaitError};
use gdaki_layout::cqe::{Cqe64, ErrCqe};
use gdaki_layout::ctrl::FenceMode;
use gdaki_layout::handle::{QP_ATOMIC_REPLY_HOST_ORDER, QP_FLUSH_AFTER_FETCH, QP_RINGS_IN_GPU_MEMORY};
use gdaki_layout::wqe::{Operation, Payload, WorkRequest, WqeView};
use gdaki_layout::{dbrec, doorbell, ring, AtomicReplyOrder, DevCq, DevQp, DoorbellKind, Syndrome, WqeOpcode};

const QPN: u32 = 0x1234;
const RKEY: u32 = 0xbeef;
const LKEY: u32 = 0xcafe;

/// 64-byte aligned memory shared with the consumer.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

struct Setup {
    qp: Box<DevQp>,
    sq: Vec<Line>,
    cq: Vec<Line>,
    qp_dbrec: Box<[u32; 2]>,
    cq_dbrec: Box<[u32; 2]>,
    /// The doorbell register: 64 bytes, a BlueFlame write's size.
    doorbell: Box<Line>,
    remote: Vec<Line>,
    local: Vec<Line>,
}

/// What the consumer saw and does.
struct Consumer {
    stop: AtomicBool,
    /// Reject the WQE with this index with a remote access error (u64::MAX: none).
    fail_at: AtomicU64,
    /// Write the CQE of the WQE with this index with format bits 3, a compressed block, as a
    /// CQ created with compression would (u64::MAX: none).
    format_at: AtomicU64,
    /// Execute no WQE from this index on until it is raised (u64::MAX: none held): an HCA
    /// that is behind.
    hold_from: AtomicU64,
    seen: Mutex<Vec<WorkRequest>>,
    error: Mutex<Option<String>>,
}

struct Harness {
    setup: Box<Setup>,
    consumer: Arc<Consumer>,
    thread: Option<thread::JoinHandle<()>>,
}

/// Raw pointers the consumer thread uses; the harness outlives the thread (joined on drop).
#[derive(Clone, Copy)]
struct Ptrs {
    qp: *mut DevQp,
    /// The send word of the QP's doorbell record (also where a handle without one names none).
    record: u64,
    remote: (u64, u64),
    local: (u64, u64),
}
unsafe impl Send for Ptrs {}

impl Harness {
    fn new(sq_log: u32, kind: DoorbellKind, max_msg: u64, remote_bytes: usize) -> Self {
        let lines = |bytes: usize| vec![Line([0; 64]); bytes.div_ceil(64).max(1)];
        let mut cq = lines(64 << sq_log);
        for l in &mut cq {
            l.0 = bytemuck::cast(Cqe64::default());
        }
        let mut s = Box::new(Setup {
            qp: Box::new(bytemuck::Zeroable::zeroed()),
            sq: lines(64 << sq_log),
            cq,
            qp_dbrec: Box::new([0; 2]),
            cq_dbrec: Box::new([0; 2]),
            doorbell: Box::new(Line([0; 64])),
            remote: lines(remote_bytes),
            local: lines(remote_bytes),
        });
        let cq_handle = DevCq {
            cqe_base: s.cq.as_ptr() as u64,
            dbrec: s.cq_dbrec.as_ptr() as u64,
            cqn: 7,
            log_size: sq_log,
            ..bytemuck::Zeroable::zeroed()
        };
        *s.qp = DevQp {
            sq_base: s.sq.as_ptr() as u64,
            sq_dbrec: unsafe { s.qp_dbrec.as_ptr().add(dbrec::SND_DBR) } as u64,
            doorbell: s.doorbell.0.as_ptr() as u64,
            max_msg_size: max_msg,
            timeout_ns: 2_000_000_000,
            qpn: QPN,
            sq_log_size: sq_log,
            doorbell_kind: kind as u8,
            cq: cq_handle,
            ..bytemuck::Zeroable::zeroed()
        };
        for (i, l) in s.local.iter_mut().enumerate() {
            l.0 = [i as u8 ^ 0x5a; 64];
            for (k, b) in l.0.iter_mut().enumerate() {
                *b = (i * 64 + k) as u8 ^ 0x5a;
            }
        }
        let consumer = Arc::new(Consumer {
            stop: AtomicBool::new(false),
            fail_at: AtomicU64::new(u64::MAX),
            format_at: AtomicU64::new(u64::MAX),
            hold_from: AtomicU64::new(u64::MAX),
            seen: Mutex::new(Vec::new()),
            error: Mutex::new(None),
        });
        let ptrs = Ptrs {
            qp: &mut *s.qp,
            record: s.qp.sq_dbrec,
            remote: (s.remote.as_ptr() as u64, (s.remote.len() * 64) as u64),
            local: (s.local.as_ptr() as u64, (s.local.len() * 64) as u64),
        };
        let c = consumer.clone();
        let thread = Some(thread::spawn(move || {
            let p = ptrs;
            if let Err(e) = run_consumer(&c, p) {
                *c.error.lock().unwrap() = Some(e);
            }
        }));
        Harness {
            setup: s,
            consumer,
            thread,
        }
    }

    /// Sets the handle's `QP_*` flags (before anything is posted).
    fn with_flags(mut self, flags: u8) -> Self {
        self.setup.qp.flags = flags;
        self
    }

    /// A reliable doorbell's handle (before anything is posted): it names no record, as the
    /// host library writes it. The consumer still watches the record's memory.
    fn without_record(mut self) -> Self {
        self.setup.qp.sq_dbrec = 0;
        self
    }

    fn qp<M: Sharing>(&self) -> Qp<M> {
        // SAFETY: the handle lives as long as the harness.
        unsafe { Qp::from_raw(&*self.setup.qp as *const DevQp as *mut DevQp) }
    }
    fn remote(&self, off: u64) -> Remote {
        Remote {
            addr: self.setup.remote.as_ptr() as u64 + off,
            rkey: RKEY,
        }
    }
    fn local(&self, off: u64) -> Local {
        Local {
            addr: self.setup.local.as_ptr() as u64 + off,
            lkey: LKEY,
        }
    }
    /// Waits (5 s at most) until the consumer has written CQE `index` of a CQ of `2^log` entries.
    fn wait_cqe_written(&self, index: u64, log: u32) {
        let slot = &self.setup.cq[ring::cqe_offset(index, log) as usize / 64];
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        // op_own is a CQE's last byte. SAFETY: a byte of the harness's live CQ, which the
        // consumer thread writes (hence the volatile read).
        while !ring::cqe_ready(unsafe { std::ptr::read_volatile(&slot.0[63]) }, index, log) {
            assert!(std::time::Instant::now() < deadline, "CQE {index} never came");
            thread::yield_now();
        }
    }
    fn remote_bytes(&self) -> Vec<u8> {
        self.setup.remote.iter().flat_map(|l| l.0).collect()
    }
    fn local_bytes(&self) -> Vec<u8> {
        self.setup.local.iter().flat_map(|l| l.0).collect()
    }
    fn finish(mut self) -> Vec<WorkRequest> {
        self.consumer.stop.store(true, Release);
        self.thread.take().unwrap().join().unwrap();
        if let Some(e) = self.consumer.error.lock().unwrap().take() {
            panic!("consumer: {e}");
        }
        std::mem::take(&mut *self.consumer.seen.lock().unwrap())
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.consumer.stop.store(true, Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn load64(addr: u64) -> u64 {
    unsafe { AtomicU64::from_ptr(addr as *mut u64) }.load(Acquire)
}

/// The consumer loop: a minimal in-order HCA.
fn run_consumer(c: &Consumer, p: Ptrs) -> Result<(), String> {
    let h = unsafe { &*p.qp };
    let (log, kind) = (h.sq_log_size, DoorbellKind::from_raw(h.doorbell_kind).unwrap());
    let size = 1u64 << log;
    let mut done = 0u64;
    let mut in_error = false;
    let check = |(base, len): (u64, u64), addr: u64, n: u64| addr >= base && addr + n <= base + len;
    loop {
        let stopping = c.stop.load(Acquire);
        let db = load64(h.doorbell);
        let target = match kind {
            // CPU-assisted posters ring exactly as for a NIC (a proxy forwards the doorbell).
            DoorbellKind::Gpu | DoorbellKind::CpuAssisted => {
                // gdaki's doorbell, or a BlueFlame write whose first 8 bytes are the lone WQE's
                // control segment (`ds` not 0): then it announces the end of that WQE.
                let (qpn, pi16) = doorbell::producer(db.to_ne_bytes());
                if db != 0 && qpn != QPN {
                    return Err(format!("doorbell for QP {qpn:#x}"));
                }
                let blueflame = db.to_ne_bytes()[7] != 0;
                // The doorbell is the 8-byte image NVSHMEM's `ibgda_ring_db` stores:
                // {htobe32(pi << 8), htobe32(qpn << 8)}, pi the 16-bit producer index.
                let image = [((pi16 as u32) << 8).to_be_bytes(), (QPN << 8).to_be_bytes()].concat();
                if db != 0 && !blueflame && db.to_ne_bytes()[..] != image[..] {
                    return Err(format!(
                        "doorbell {:02x?} is not the image {image:02x?}",
                        db.to_ne_bytes()
                    ));
                }
                // The record is the send word at +4 (`dbrec[1]`), big-endian, the 16-bit
                // producer index with nothing above it. It follows the doorbell (DOCA's order:
                // the doorbell is rung first and again after the record), so it may trail it
                // here; once the posters are done it holds the last index (checked at stop).
                let dbr = u32::from_be(unsafe { AtomicU32::from_ptr(p.record as *mut u32) }.load(Acquire));
                // A reliable doorbell's QP has no record: nothing may write it.
                if h.no_doorbell_record() && dbr != 0 {
                    return Err(format!("doorbell record {dbr:#x} written on a QP without one"));
                }
                if dbr > 0xffff {
                    return Err(format!("doorbell record {dbr:#x} holds more than 16 bits"));
                }
                let target = done + pi16.wrapping_sub(done as u16) as u64;
                if stopping && target == done && db != 0 && dbr as u16 != pi16 && !h.no_doorbell_record() {
                    return Err(format!("doorbell record {dbr:#x} behind the last doorbell {pi16:#x}"));
                }
                target
            }
            DoorbellKind::CpuProxy => db,
        };
        let target = target.min(c.hold_from.load(Acquire).max(done));
        if done == target {
            if stopping {
                return Ok(());
            }
            thread::yield_now();
            continue;
        }
        while done < target {
            let slot = h.sq_base + ring::wqe_offset(done, log);
            let words: Vec<u64> = (0..8).map(|i| load64(slot + 8 * i)).collect();
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
            let view = WqeView::new_checked(&bytes[..]).map_err(|e| format!("WQE {done}: {e:?}"))?;
            let wr = WorkRequest::parse(&view).map_err(|e| format!("WQE {done}: {e:?}"))?;
            if wr.wqe_index != done as u16 || wr.qpn != QPN || !wr.signaled() {
                return Err(format!("WQE {done} out of order or malformed: {wr:?}"));
            }
            let ci = u32::from_be(unsafe { std::ptr::read_volatile(h.cq.dbrec as *const u32) });
            if done - (ci as u64) >= size && !ring::cq_ci_at_or_after(ci, dbrec::cq_ci(done + 1 - size)) {
                return Err(format!("CQ overrun writing CQE {done} with consumer index {ci}"));
            }
            let fail = c.fail_at.load(Acquire) == done;
            let mut syndrome = None;
            if in_error {
                syndrome = Some(Syndrome::WrFlush);
            } else if fail {
                syndrome = Some(Syndrome::RemoteAccess);
            } else {
                let bad = |r: &Remote, n: u64| r.rkey != RKEY || !check(p.remote, r.addr, n);
                match wr.op {
                    Operation::Nop => {}
                    // This consumer has no receive queue (two-sided verbs are tested against
                    // the soft HCA): a SEND fails as a NIC fails one that no receive takes.
                    Operation::Send { .. } => syndrome = Some(Syndrome::RnrRetryExc),
                    // One QP and no Core-Direct here (WAITs are tested against the soft HCA):
                    // failed as a NIC fails a WAIT on a QP that is not a Core-Direct master.
                    Operation::Wait { .. } => syndrome = Some(Syndrome::LocalQpOp),
                    Operation::Dump { local } => {
                        if local.lkey != LKEY || !check(p.local, local.addr, local.length as u64) {
                            syndrome = Some(Syndrome::LocalProt);
                        }
                    }
                    Operation::Write { remote, payload } => match payload {
                        // A zero-length WRITE (the 0-byte inline form): nothing moves.
                        Payload::Gather(list) if list.as_slice().is_empty() => {}
                        Payload::Gather(list) => {
                            let s = list.as_slice()[0];
                            if bad(&remote, s.length as u64)
                                || s.lkey != LKEY
                                || !check(p.local, s.addr, s.length as u64)
                            {
                                syndrome = Some(Syndrome::RemoteAccess);
                            } else {
                                unsafe {
                                    std::ptr::copy(s.addr as *const u8, remote.addr as *mut u8, s.length as usize)
                                };
                            }
                        }
                        Payload::Inline { offset, len } => {
                            if bad(&remote, len as u64) {
                                syndrome = Some(Syndrome::RemoteAccess);
                            } else {
                                let src = &view.bytes()[offset as usize..(offset + len) as usize];
                                unsafe { std::ptr::copy(src.as_ptr(), remote.addr as *mut u8, len as usize) };
                            }
                        }
                    },
                    Operation::Read { remote, local } => {
                        let s = local.as_slice()[0];
                        if bad(&remote, s.length as u64) || !check(p.local, s.addr, s.length as u64) {
                            syndrome = Some(Syndrome::RemoteAccess);
                        } else {
                            unsafe { std::ptr::copy(remote.addr as *const u8, s.addr as *mut u8, s.length as usize) };
                        }
                    }
                    Operation::FetchAdd { remote, result, .. } | Operation::CompareSwap { remote, result, .. } => {
                        if bad(&remote, 8) || remote.addr % 8 != 0 || !check(p.local, result.addr, 8) {
                            syndrome = Some(Syndrome::RemoteAccess);
                        } else {
                            let target = unsafe { AtomicU64::from_ptr(remote.addr as *mut u64) };
                            let old = match wr.op {
                                Operation::FetchAdd { add, .. } => target.fetch_add(add, SeqCst),
                                Operation::CompareSwap { compare, swap, .. } => target
                                    .compare_exchange(compare, swap, SeqCst, SeqCst)
                                    .unwrap_or_else(|v| v),
                                _ => unreachable!(),
                            };
                            // In the handle's reply byte order, as the NIC's endianness mode writes it.
                            let raw = u64::from_ne_bytes(h.atomic_reply_order().encode(old));
                            unsafe { AtomicU64::from_ptr(result.addr as *mut u64) }.store(raw, Release);
                        }
                    }
                }
            }
            let owner = ring::owner_parity(done, log);
            let mut cqe = match syndrome {
                None => Cqe64::success(QPN, done as u16, 0, owner),
                Some(s) => {
                    in_error = true;
                    ErrCqe::new(QPN, done as u16, wr.opcode.raw(), s, 0x42, owner).as_cqe()
                }
            };
            if c.format_at.load(Acquire) == done {
                cqe.op_own |= gdaki_layout::cqe::FORMAT_MASK << gdaki_layout::cqe::FORMAT_SHIFT;
            }
            let words: [u64; 8] = bytemuck::cast(cqe);
            let cslot = h.cq.cqe_base + ring::cqe_offset(done, log);
            for (i, w) in words.iter().enumerate() {
                // The word holding op_own goes last, with release: the CQE body is visible first.
                let order = if i == 7 { Release } else { Relaxed };
                unsafe { AtomicU64::from_ptr((cslot + 8 * i as u64) as *mut u64) }.store(*w, order);
            }
            c.seen.lock().unwrap().push(wr);
            done += 1;
        }
    }
}

fn pattern(off: usize, len: usize) -> Vec<u8> {
    (off..off + len).map(|i| (i as u8) ^ 0x5a).collect()
}

/// Many threads post puts of varied sizes into one QP; every byte lands, WQEs arrive in order.
fn many_posters<M: Sharing>(threads: usize, per_thread: usize, sq_log: u32, kind: DoorbellKind) {
    many_posters_with::<M>(threads, per_thread, sq_log, kind, 0, true)
}

/// [`many_posters`] into a QP whose handle carries `flags`, and a doorbell record or none.
fn many_posters_with<M: Sharing>(
    threads: usize,
    per_thread: usize,
    sq_log: u32,
    kind: DoorbellKind,
    flags: u8,
    record: bool,
) {
    let chunk = 256usize;
    let mut h = Harness::new(sq_log, kind, 1 << 30, threads * per_thread * chunk).with_flags(flags);
    if !record {
        h = h.without_record();
    }
    thread::scope(|s| {
        for t in 0..threads {
            let h = &h;
            s.spawn(move || {
                let qp = h.qp::<M>();
                for i in 0..per_thread {
                    let off = ((t * per_thread + i) * chunk) as u64;
                    let len = 1 + (t * 31 + i * 7) % chunk;
                    let ticket = qp.put(h.remote(off), h.local(off), len as u64).expect("put");
                    if i % 16 == 0 {
                        qp.wait(ticket).expect("wait");
                    }
                }
                qp.quiet().expect("quiet");
            });
        }
    });
    let remote = h.remote_bytes();
    for t in 0..threads {
        for i in 0..per_thread {
            let off = (t * per_thread + i) * chunk;
            let len = 1 + (t * 31 + i * 7) % chunk;
            assert_eq!(&remote[off..off + len], &pattern(off, len)[..], "thread {t} put {i}");
            assert!(
                remote[off + len..off + chunk].iter().all(|&b| b == 0),
                "bytes past put {t}/{i} written"
            );
        }
    }
    let seen = h.finish();
    assert_eq!(seen.len(), threads * per_thread);
    assert!(seen
        .iter()
        .enumerate()
        .all(|(i, wr)| wr.wqe_index == i as u16 && wr.opcode == WqeOpcode::RdmaWrite));
}

#[test]
fn exclusive_poster_wraps_the_ring_many_times() {
    many_posters::<Exclusive>(1, 3000, 3, DoorbellKind::Gpu);
}

#[test]
fn gpu_mode_many_threads_one_qp() {
    many_posters::<Gpu>(4, 500, 5, DoorbellKind::Gpu);
}

#[test]
fn cta_mode_many_threads_small_ring() {
    many_posters::<Cta>(3, 400, 2, DoorbellKind::Gpu);
}

/// A poller moves the CQ's doorbell record before it raises the consumed count, which frees
/// send-queue slots: whoever sees a slot freed (here a watcher thread reading the count, then
/// the record) finds the record at least as far. The other way round, a WQE posted into the
/// freed slot could complete while the record said the CQ was full: an overrun (seen on the
/// GPU as a dropped CQE and a timed-out wait).
#[test]
fn the_cq_record_never_trails_the_consumed_count() {
    let h = Harness::new(2, DoorbellKind::Gpu, 1 << 30, 4096);
    let handle = h.setup.qp.as_ref() as *const DevQp;
    // SAFETY: fields of the live handle, which outlives the threads below.
    let (consumed, record) = unsafe {
        (
            AtomicU64::from_ptr(std::ptr::addr_of!((*handle).cq.consumed) as *mut u64),
            AtomicU32::from_ptr((*handle).cq.dbrec as *mut u32),
        )
    };
    let done = AtomicBool::new(false);
    let trailing = thread::scope(|s| {
        let watcher = s.spawn(|| {
            let mut trailing = 0u64;
            while !done.load(Acquire) {
                let c = consumed.load(Acquire);
                let ci = u32::from_be(record.load(Acquire));
                if !ring::cq_ci_at_or_after(ci, dbrec::cq_ci(c)) {
                    trailing += 1;
                }
            }
            trailing
        });
        // Two posters sharing the QP (the shared path's compare-and-swap on the record).
        let posters: Vec<_> = (0..2)
            .map(|t| {
                let h = &h;
                s.spawn(move || {
                    let qp = h.qp::<Gpu>();
                    for i in 0..10_000u64 {
                        let off = t * 64 + i % 64;
                        let ticket = qp.put(h.remote(off), h.local(off), 1).expect("put");
                        qp.wait(ticket).expect("wait");
                    }
                })
            })
            .collect();
        posters.into_iter().for_each(|p| p.join().unwrap());
        done.store(true, Release);
        watcher.join().unwrap()
    });
    h.finish();
    assert_eq!(trailing, 0, "times the record trailed the consumed count");
}

/// A stream poster that laps the ring while the HCA is a little behind (the newest WQE not yet
/// complete) frees half the ring with one look at the CQ, not one slot: with a slot freed per
/// post, every post of a stream paid a CQE read (a PCIe round trip from a GPU) and a record
/// store, and a single poster's WRITEs took 8-12 us each on H100s.
#[test]
fn a_poster_that_laps_the_ring_frees_half_of_it_at_once() {
    let h = Harness::new(4, DoorbellKind::Gpu, 1 << 30, 4096);
    h.consumer.hold_from.store(12, Release);
    let qp = h.qp::<Exclusive>();
    for i in 0..16u64 {
        qp.put(h.remote(i * 64), h.local(i * 64), 64).expect("put");
    }
    // The HCA completes WQEs 0..12 and holds the rest.
    h.wait_cqe_written(11, 4);
    assert_eq!(qp.consumed(), 0);
    // WQE 16 reuses slot 0: the look finds WQE 7 (halfway to the newest, 15) complete.
    qp.put(h.remote(0), h.local(0), 64).expect("put");
    assert_eq!(qp.consumed(), 8, "CQEs consumed by one post after the lap");
    h.consumer.hold_from.store(u64::MAX, Release);
    qp.quiet().expect("quiet");
    assert_eq!(h.finish().len(), 17);
}

#[test]
fn cpu_proxy_handler_publishes_the_producer_index() {
    many_posters::<Gpu>(3, 300, 4, DoorbellKind::CpuProxy);
}

/// CPU-assisted (rings in GPU memory): the posters write the record and the doorbell image
/// exactly as for a NIC, only into a host word a proxy forwards.
#[test]
fn cpu_assisted_posters_ring_a_host_word_as_they_would_a_nic() {
    many_posters::<Gpu>(3, 300, 4, DoorbellKind::CpuAssisted);
    many_posters::<Exclusive>(1, 1000, 3, DoorbellKind::CpuAssisted);
}

/// A reliable doorbell (no doorbell record): posters in every sharing mode, and through a
/// CPU-assisted proxy word, ring with the doorbell alone; the consumer, which executes by the
/// doorbell, fails the test if anything writes the record.
#[test]
fn a_reliable_doorbell_never_writes_the_record() {
    many_posters_with::<Exclusive>(1, 2000, 3, DoorbellKind::Gpu, 0, false);
    many_posters_with::<Gpu>(4, 300, 4, DoorbellKind::Gpu, 0, false);
    many_posters_with::<Cta>(2, 300, 2, DoorbellKind::CpuAssisted, 0, false);
    many_posters_with::<Exclusive>(1, 500, 3, DoorbellKind::Gpu, QP_RINGS_IN_GPU_MEMORY, false);
}

/// BlueFlame (`Qp::blueflame`): a lone WQE is rung by writing all 64 of its bytes into the
/// doorbell register, after the record; several WQEs rung at once (a deferred batch) ring with
/// the plain doorbell. The consumer executes by either; every byte lands.
#[test]
fn a_lone_wqe_is_rung_by_a_blueflame_write_of_itself() {
    for record in [true, false] {
        let mut h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, 1 << 14);
        if !record {
            h = h.without_record();
        }
        let register = h.setup.doorbell.0.as_ptr() as *const u64;
        let read_register = || -> [u64; 8] { std::array::from_fn(|i| unsafe { register.add(i).read_volatile() }) };
        let qp = h.qp::<Exclusive>().blueflame();
        for i in 0..40u64 {
            let t = qp.put(h.remote(i * 64), h.local(i * 64), 64).unwrap();
            qp.wait(t).unwrap();
            // The register holds WQE `t` whole, as the send queue does.
            let wqe = qp.wqe_ptr(t) as *const u64;
            let in_sq: [u64; 8] = std::array::from_fn(|k| unsafe { wqe.add(k).read_volatile() });
            assert_eq!(read_register(), in_sq, "put {i}");
        }
        // A deferred batch of three: one plain doorbell for all of them.
        let batch = qp.deferred();
        let mut last = 0;
        for i in 40..43u64 {
            last = batch.put(h.remote(i * 64), h.local(i * 64), 64).unwrap();
        }
        batch.commit().unwrap();
        qp.wait(last).unwrap();
        assert_eq!(read_register()[0], doorbell::word(QPN, last + 1), "a plain doorbell");
        assert_eq!(&h.remote_bytes()[..43 * 64], &h.local_bytes()[..43 * 64]);
        let seen = h.finish();
        assert_eq!(seen.len(), 43);
    }
}

/// Deferred posts: the consumer sees nothing until the commit, which rings once for all of
/// them; a wait on a deferred ticket, and a post that needs a slot back, ring by themselves.
fn deferred_posts<M: Sharing>(kind: DoorbellKind) {
    let h = Harness::new(3, kind, 1 << 20, 64 * 64);
    let qp = h.qp::<M>().deferred();
    let seen = || h.consumer.seen.lock().unwrap().len();
    for i in 0..5u64 {
        qp.put(h.remote(i * 64), h.local(i * 64), 40).unwrap();
    }
    thread::sleep(Duration::from_millis(20));
    assert_eq!(seen(), 0, "deferred WQEs were consumed before the commit");
    qp.commit().unwrap();
    qp.commit().unwrap(); // nothing new: no second doorbell needed, no error
    qp.quiet().unwrap();
    assert_eq!(seen(), 5);
    // A wait on a deferred ticket rings for it.
    let t = qp.put(h.remote(5 * 64), h.local(5 * 64), 40).unwrap();
    qp.wait(t).unwrap();
    // 30 deferred posts into a ring of 8 without a commit: reservations ring for themselves.
    for i in 6..36u64 {
        qp.put(h.remote(i * 64), h.local(i * 64), 8 + i).unwrap();
    }
    qp.quiet().unwrap();
    let remote = h.remote_bytes();
    for i in 0..36usize {
        let len = if i < 6 { 40 } else { 8 + i };
        assert_eq!(&remote[i * 64..i * 64 + len], &pattern(i * 64, len)[..], "put {i}");
    }
    assert_eq!(h.finish().len(), 36);
}

#[test]
fn deferred_posts_wait_for_the_commit_exclusive() {
    deferred_posts::<Exclusive>(DoorbellKind::Gpu);
}

#[test]
fn deferred_posts_wait_for_the_commit_shared() {
    deferred_posts::<Gpu>(DoorbellKind::Gpu);
}

#[test]
fn deferred_posts_wait_for_the_commit_cpu_proxy() {
    deferred_posts::<Cta>(DoorbellKind::CpuProxy);
}

#[test]
fn deferred_posts_wait_for_the_commit_cpu_assisted() {
    deferred_posts::<Cta>(DoorbellKind::CpuAssisted);
}

#[test]
fn large_messages_are_split_and_zero_length_is_a_nop() {
    let h = Harness::new(5, DoorbellKind::Gpu, 1000, 64 * 1024);
    let qp = h.qp::<Exclusive>();
    let t = qp.put(h.remote(0), h.local(0), 20_500).unwrap();
    qp.wait(t).unwrap();
    let t = qp.put(h.remote(30_000), h.local(0), 0).unwrap();
    qp.wait(t).unwrap();
    assert_eq!(&h.remote_bytes()[..20_500], &pattern(0, 20_500)[..]);
    let seen = h.finish();
    assert_eq!(seen.len(), 22, "21 writes of at most 1000 bytes, then one NOP");
    assert!(seen[..21]
        .iter()
        .all(|w| matches!(w.op, Operation::Write { payload: Payload::Gather(l), .. } if l.total_len() <= 1000)));
    assert_eq!(seen[21].op, Operation::Nop);
}

#[test]
fn inline_get_signal_fence_and_atomics() {
    let h = Harness::new(4, DoorbellKind::Gpu, 1 << 20, 4096);
    let qp = h.qp::<Gpu>();
    qp.put_inline(h.remote(100), b"hello, inline world!").unwrap();
    assert!(matches!(
        qp.put_inline(h.remote(0), &[0; 29]),
        Err(PostError::InlineTooLong { len: 29, max: 28 })
    ));
    assert_eq!(qp.reserve(0), Err(PostError::BadCount { count: 0, ring: 16 }));
    assert_eq!(qp.reserve(17), Err(PostError::BadCount { count: 17, ring: 16 }));
    let t = qp.fenced().get(h.local(2048), h.remote(100), 20).unwrap();
    qp.wait(t).unwrap();
    assert_eq!(&h.local_bytes()[2048..2068], b"hello, inline world!");
    qp.put_signal(h.remote(200), h.local(200), 64, h.remote(1024), 3, h.local(3000))
        .unwrap();
    qp.signal(h.remote(1024), 4, h.local(3000)).unwrap();
    assert_eq!(qp.atomic_fetch_add(h.remote(1024), 10, h.local(3000)).unwrap(), 7);
    assert_eq!(
        qp.atomic_compare_swap(h.remote(1024), 17, 99, h.local(3008)).unwrap(),
        17
    );
    assert_eq!(
        qp.atomic_compare_swap(h.remote(1024), 17, 5, h.local(3008)).unwrap(),
        99,
        "failed CAS returns the value found"
    );
    qp.quiet().unwrap();
    assert_eq!(&h.remote_bytes()[200..264], &pattern(200, 64)[..]);
    h.finish();
}

#[test]
fn concurrent_fetch_adds_return_distinct_values() {
    let h = Harness::new(4, DoorbellKind::Gpu, 1 << 20, 4096);
    let fetched = Mutex::new(Vec::new());
    thread::scope(|s| {
        for t in 0..4u64 {
            let (h, fetched) = (&h, &fetched);
            s.spawn(move || {
                let qp = h.qp::<Gpu>();
                for _ in 0..200 {
                    let v = qp.atomic_fetch_add(h.remote(0), 1, h.local(64 + t * 8)).unwrap();
                    fetched.lock().unwrap().push(v);
                }
            });
        }
    });
    let mut v = fetched.into_inner().unwrap();
    v.sort_unstable();
    assert_eq!(v, (0..800).collect::<Vec<u64>>());
    assert_eq!(u64::from_ne_bytes(h.remote_bytes()[..8].try_into().unwrap()), 800);
    h.finish();
}

#[test]
fn error_cqe_reaches_every_waiter_and_later_work_is_flushed() {
    let h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, 4096);
    let qp = h.qp::<Gpu>();
    let ok = qp.put(h.remote(0), h.local(0), 8).unwrap();
    qp.wait(ok).unwrap();
    let bad = qp
        .put(
            Remote {
                addr: h.remote(0).addr,
                rkey: 0xdead,
            },
            h.local(0),
            8,
        )
        .unwrap();
    let after = qp.put(h.remote(8), h.local(8), 8).unwrap();
    match qp.wait(after) {
        Err(WaitError::Cqe(e)) => assert_eq!(e.syndrome, Syndrome::WrFlush, "the later WQE is flushed: {e:?}"),
        other => panic!("expected a flush error, got {other:?}"),
    }
    // The bad WQE's CQE was consumed by the wait above; its waiter still learns the real cause.
    match qp.wait(bad) {
        Err(WaitError::Cqe(e)) => {
            assert_eq!(
                (e.syndrome, e.wqe_index, e.vendor_syndrome),
                (Syndrome::RemoteAccess, bad as u32, 0x42)
            );
            assert_eq!(e.wqe_opcode, WqeOpcode::RdmaWrite);
        }
        other => panic!("expected the remote access error, got {other:?}"),
    }
    assert_eq!(qp.wait(ok), Ok(()), "work completed before the error stays successful");
    // Posting continues to fail fast (flushes), never hangs, also across a ring wrap.
    for _ in 0..20 {
        let t = qp.put(h.remote(16), h.local(16), 8).unwrap();
        assert!(matches!(qp.wait(t), Err(WaitError::Cqe(_))));
    }
    h.finish();
}

#[test]
fn injected_fault_mid_stream_under_contention() {
    let h = Harness::new(4, DoorbellKind::Gpu, 1 << 20, 64 * 1024);
    h.consumer.fail_at.store(150, Release);
    let failures = AtomicU64::new(0);
    thread::scope(|s| {
        for t in 0..3u64 {
            let (h, failures) = (&h, &failures);
            s.spawn(move || {
                let qp = h.qp::<Gpu>();
                for i in 0..100u64 {
                    match qp
                        .put(h.remote((t * 100 + i) * 8), h.local(0), 8)
                        .and_then(|tk| qp.wait(tk).map_err(PostError::from))
                    {
                        Ok(()) => {}
                        Err(PostError::Wait(WaitError::Cqe(_))) => {
                            failures.fetch_add(1, Relaxed);
                        }
                        Err(e) => panic!("unexpected {e}"),
                    }
                }
            });
        }
    });
    let f = failures.load(Relaxed);
    assert!((100..=150).contains(&f), "WQEs from index 150 on fail: {f}");
    h.finish();
}

#[test]
fn waits_time_out_when_nothing_answers() {
    let h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, 4096);
    h.consumer.stop.store(true, Release);
    thread::sleep(Duration::from_millis(20)); // the consumer has exited
    unsafe { (*(&*h.setup.qp as *const DevQp as *mut DevQp)).timeout_ns = 50_000_000 };
    let qp = h.qp::<Gpu>();
    let t = qp.put(h.remote(0), h.local(0), 8).unwrap();
    let started = std::time::Instant::now();
    assert_eq!(qp.wait(t), Err(WaitError::Timeout { index: t }));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "bounded by the handle's timeout"
    );
    // A full ring then makes reserve time out too.
    for _ in 0..7 {
        qp.put(h.remote(0), h.local(0), 8).unwrap();
    }
    assert!(matches!(
        qp.put(h.remote(0), h.local(0), 8),
        Err(PostError::Wait(WaitError::Timeout { .. }))
    ));
    assert!(matches!(
        qp.atomic(AtomicOp::FetchAdd(1), h.remote(0), h.local(8)),
        Err(PostError::Wait(WaitError::Timeout { .. }))
    ));
}

// ------------------------------------------------------------------ warp and block scope

/// Groups of CPU threads post as warps: every member its own put (some split, some empty),
/// one reservation per group and ring lap. Checks every byte, and that each group's WQEs
/// arrive in at most one run per round (a per-thread reservation would scatter them).
#[test]
fn warp_groups_post_members_operations_with_one_reservation_per_round() {
    const GROUPS: usize = 2;
    const LANES: usize = 4;
    const ITERS: usize = 60;
    const SLOT: usize = 256;
    const MAX_MSG: u64 = 100;
    let len_of = |lane: usize, i: usize| (lane * 37 + i * 11) % 250;
    let off_of = |g: usize, lane: usize, i: usize| ((g * LANES + lane) * ITERS + i) * SLOT;
    let wqes_of = |len: usize| (len as u64).div_ceil(MAX_MSG).max(1);
    let h = Harness::new(3, DoorbellKind::Gpu, MAX_MSG, GROUPS * LANES * ITERS * SLOT);
    let tickets = Mutex::new(Vec::new());
    thread::scope(|s| {
        for g in 0..GROUPS {
            let group = Arc::new(Group::new(LANES as u32).unwrap());
            for lane in 0..LANES {
                let (h, group, tickets) = (&h, group.clone(), &tickets);
                s.spawn(move || {
                    let warp = group.warp(lane as u32).unwrap();
                    assert_eq!((warp.rank(), warp.size()), (lane as u32, LANES as u32));
                    let qp = h.qp::<Gpu>().with_scope(warp);
                    for i in 0..ITERS {
                        let off = off_of(g, lane, i) as u64;
                        let t = qp
                            .put(h.remote(off), h.local(off), len_of(lane, i) as u64)
                            .expect("put");
                        tickets.lock().unwrap().push((g, i, t));
                        if i % 8 == 7 {
                            qp.wait(t).expect("wait");
                        }
                    }
                    qp.quiet().expect("quiet");
                });
            }
        }
    });
    let mut t = tickets.into_inner().unwrap();
    t.sort_unstable();
    for call in t.chunks(LANES) {
        assert!(
            call.iter().all(|&x| x == call[0]),
            "members of one call share the ticket: {call:?}"
        );
    }
    let remote = h.remote_bytes();
    let mut rounds = [0u64; GROUPS];
    let mut total = 0;
    for (g, r) in rounds.iter_mut().enumerate() {
        for i in 0..ITERS {
            let wqes: u64 = (0..LANES).map(|lane| wqes_of(len_of(lane, i))).sum();
            *r += wqes.div_ceil(8);
            total += wqes;
            for lane in 0..LANES {
                let (off, len) = (off_of(g, lane, i), len_of(lane, i));
                assert_eq!(
                    &remote[off..off + len],
                    &pattern(off, len)[..],
                    "group {g} lane {lane} put {i}"
                );
                assert!(remote[off + len..off + SLOT].iter().all(|&b| b == 0));
            }
        }
    }
    let seen = h.finish();
    assert_eq!(seen.len() as u64, total);
    // Attribute each WQE to its group by its remote address (NOPs by their neighbours).
    let base = seen
        .iter()
        .filter_map(|w| match w.op {
            Operation::Write { remote, .. } => Some(remote.addr),
            _ => None,
        })
        .min()
        .unwrap();
    let per_group = (LANES * ITERS * SLOT) as u64;
    let mut runs = [0u64; GROUPS];
    let mut prev = None;
    for w in &seen {
        let g = match w.op {
            Operation::Write { remote, .. } => Some(((remote.addr - base) / per_group) as usize),
            _ => prev,
        };
        if g != prev {
            if let Some(g) = g {
                runs[g] += 1;
            }
        }
        prev = g.or(prev);
    }
    for g in 0..GROUPS {
        assert!(
            runs[g] <= rounds[g],
            "group {g}: {} runs for {} rounds",
            runs[g],
            rounds[g]
        );
    }
}

/// An exclusive warp reads its reservation base on every member (no broadcast): with the
/// leader's own low-level posts between the group's calls, on a ring smaller than many rounds,
/// no two WQEs may share a slot and every member must read the same base. (A leader that moved
/// the counter on before a slow member had read it split the group: it hung or timed out.)
#[test]
fn an_exclusive_warp_and_its_leaders_own_posts_never_share_a_slot() {
    const LANES: u32 = 4;
    const ITERS: usize = 200;
    let slot = |i: usize, who: usize| ((i * (LANES as usize + 1) + who) * 16) as u64;
    let h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, ITERS * (LANES as usize + 1) * 16);
    let group = Group::new(LANES).unwrap();
    thread::scope(|s| {
        for lane in 0..LANES {
            let (h, group) = (&h, &group);
            s.spawn(move || {
                let qp = h.qp::<Exclusive>().with_scope(group.warp(lane).unwrap());
                for i in 0..ITERS {
                    let off = slot(i, lane as usize);
                    qp.put(h.remote(off), h.local(off), 16).expect("put");
                    if lane == 0 {
                        // The leader alone, through the per-thread protocol.
                        let off = slot(i, LANES as usize);
                        let index = qp.reserve(1).expect("reserve");
                        qp.wqe_prepare_write(index, h.remote(off), h.local(off), 16, 0);
                        qp.mark_ready(index, index + 1).expect("ready");
                        qp.submit(index + 1).expect("submit");
                        // Give the members time to reach the next call's read.
                        thread::yield_now();
                    }
                }
                qp.quiet().expect("quiet");
            });
        }
    });
    let remote = h.remote_bytes();
    for i in 0..ITERS {
        for who in 0..=LANES as usize {
            let off = slot(i, who) as usize;
            assert_eq!(&remote[off..off + 16], &pattern(off, 16)[..], "put {i} by {who}");
        }
    }
    assert_eq!(h.finish().len(), ITERS * (LANES as usize + 1));
}

/// A block of CPU threads that owns a QP (exclusive mode) runs every high-level operation as a
/// collective, on a ring smaller than the group.
#[test]
fn block_scope_runs_every_operation_in_exclusive_mode() {
    const THREADS: u32 = 5;
    let h = Harness::new(2, DoorbellKind::Gpu, 1 << 20, 8192);
    let group = Group::new(THREADS).unwrap();
    assert!(Group::new(0).is_none());
    assert!(group.block(THREADS).is_none());
    assert!(Group::new(33).unwrap().warp(0).is_none(), "a warp has at most 32 lanes");
    let fetched = Mutex::new(Vec::new());
    thread::scope(|s| {
        for r in 0..THREADS {
            let (h, group, fetched) = (&h, &group, &fetched);
            s.spawn(move || {
                let qp = h.qp::<Exclusive>().with_scope(group.block(r).unwrap());
                let me = r as u64 * 64;
                // One member's inline data is too long: only it fails, the others' posts land.
                let data = if r == 3 { vec![7u8; 29] } else { vec![r as u8 + 1; 8] };
                let res = qp.put_inline(h.remote(me), &data);
                if r == 3 {
                    assert_eq!(res, Err(PostError::InlineTooLong { len: 29, max: 28 }));
                } else {
                    res.expect("put_inline");
                }
                // Fenced: each member's READ carries the fence (no NOP is posted for it).
                let t = qp.fenced().get(h.local(4096 + me), h.remote(me), 8).expect("get");
                qp.wait(t).expect("wait");
                let got = &h.local_bytes()[4096 + me as usize..4096 + me as usize + 8];
                if r != 3 {
                    assert_eq!(got, &[r as u8 + 1; 8][..]);
                }
                qp.put_signal(
                    h.remote(me + 16),
                    h.local(me + 16),
                    16,
                    h.remote(2048),
                    1,
                    h.local(6000 + me),
                )
                .expect("put_signal");
                let v = qp
                    .atomic_fetch_add(h.remote(2048 + 8), 10, h.local(6016 + me))
                    .expect("fetch_add");
                fetched.lock().unwrap().push(v);
                qp.quiet().expect("quiet");
                let cas = qp
                    .atomic_compare_swap(h.remote(2048 + 8), 50, 1000 + r as u64, h.local(6032 + me))
                    .expect("cas");
                assert!(
                    cas == 50 || cas >= 1000,
                    "a CAS finds the sum or the winner's value: {cas}"
                );
            });
        }
    });
    let mut v = fetched.into_inner().unwrap();
    v.sort_unstable();
    assert_eq!(v, vec![0, 10, 20, 30, 40]);
    let remote = h.remote_bytes();
    assert_eq!(
        u64::from_ne_bytes(remote[2048..2056].try_into().unwrap()),
        THREADS as u64
    );
    for r in 0..THREADS as usize {
        let off = r * 64 + 16;
        assert_eq!(&remote[off..off + 16], &pattern(off, 16)[..]);
    }
    let seen = h.finish();
    let nops = seen.iter().filter(|w| w.op == Operation::Nop).count();
    assert_eq!(
        nops, 0,
        "no NOP: the fence rides on the gets, the failed inline put posts none"
    );
    let fenced = |w: &&WorkRequest| FenceMode::from_fm_ce_se(w.fm_ce_se) == FenceMode::Fence;
    assert_eq!(seen.iter().filter(fenced).count(), 5, "one fenced WQE per member");
    assert!(seen
        .iter()
        .filter(fenced)
        .all(|w| matches!(w.op, Operation::Read { .. })));
    // inline 4 + get 5 + put_signal 10 + fetch_add 5 + CAS 5
    assert_eq!(seen.len(), 29);
}

/// An error CQE in a group's WQEs reaches every member's wait.
#[test]
fn every_member_of_a_warp_sees_the_error() {
    let h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, 4096);
    h.consumer.fail_at.store(2, Release);
    let group = Group::new(4).unwrap();
    thread::scope(|s| {
        for lane in 0..4 {
            let (h, group) = (&h, &group);
            s.spawn(move || {
                let qp = h.qp::<Cta>().with_scope(group.warp(lane).unwrap());
                let t = qp.put(h.remote(lane as u64 * 8), h.local(0), 8).unwrap();
                assert_eq!(t, 3);
                // The group's last WQE was flushed; the cause is recorded for the failed one.
                match qp.wait(t) {
                    Err(WaitError::Cqe(e)) => assert_eq!((e.wqe_index, e.syndrome), (3, Syndrome::WrFlush)),
                    other => panic!("lane {lane}: {other:?}"),
                }
                match qp.wait(2) {
                    Err(WaitError::Cqe(e)) => assert_eq!((e.wqe_index, e.syndrome), (2, Syndrome::RemoteAccess)),
                    other => panic!("lane {lane}: {other:?}"),
                }
                assert_eq!(qp.wait(1), Ok(()));
            });
        }
    });
    h.finish();
}

/// 8-byte atomic results in both reply byte orders a ConnectX can be set to: the device reads
/// the value the handle's mode says the HCA wrote.
#[test]
fn atomics_read_results_in_either_reply_order() {
    for (flags, order) in [
        (0, AtomicReplyOrder::BigEndian),
        (QP_ATOMIC_REPLY_HOST_ORDER, AtomicReplyOrder::HostOrder),
    ] {
        let h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, 4096).with_flags(flags);
        let qp = h.qp::<Exclusive>();
        assert_eq!(qp.atomic_reply_order(), order);
        let big = 0x0102_0304_0506_0708u64;
        assert_eq!(qp.atomic_fetch_add(h.remote(0), big, h.local(64)).unwrap(), 0);
        assert_eq!(
            qp.atomic_fetch_add(h.remote(0), 1, h.local(64)).unwrap(),
            big,
            "{order:?}"
        );
        // The bytes in the result buffer are the HCA's, in its mode.
        let raw: [u8; 8] = h.local_bytes()[64..72].try_into().unwrap();
        assert_eq!(raw, order.encode(big), "{order:?}");
        assert_eq!(
            qp.atomic_compare_swap(h.remote(0), big + 1, 7, h.local(72)).unwrap(),
            big + 1
        );
        let t = qp.atomic(AtomicOp::FetchAdd(0), h.remote(0), h.local(80)).unwrap();
        qp.wait(t).unwrap();
        // SAFETY: a local buffer of the harness, its atomic completed.
        assert_eq!(unsafe { qp.fetched(h.local(80)) }, 7, "{order:?}");
        h.finish();
    }
}

/// A misaligned atomic target is refused before anything is posted (a NIC would answer with
/// an error CQE whose syndrome is device-specific).
#[test]
fn misaligned_atomic_targets_are_refused_before_posting() {
    let h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, 4096);
    let qp = h.qp::<Exclusive>();
    let addr = h.remote(1028).addr;
    assert_eq!(
        qp.atomic_fetch_add(h.remote(1028), 1, h.local(0)),
        Err(PostError::Misaligned { addr })
    );
    assert_eq!(
        qp.atomic_compare_swap(h.remote(1028), 0, 1, h.local(0)),
        Err(PostError::Misaligned { addr })
    );
    assert_eq!(
        qp.signal(h.remote(1028), 1, h.local(0)),
        Err(PostError::Misaligned { addr })
    );
    assert_eq!(
        qp.put_signal(h.remote(0), h.local(0), 64, h.remote(1028), 1, h.local(8)),
        Err(PostError::Misaligned { addr })
    );
    // The QP is fine afterwards.
    assert_eq!(qp.atomic_fetch_add(h.remote(1024), 1, h.local(0)).unwrap(), 0);
    let seen = h.finish();
    assert_eq!(seen.len(), 1, "nothing was posted for the misaligned ones: {seen:?}");
}

/// A CQE with its format bits set (a compressed block) is refused with a clear status, and not
/// consumed, instead of being read as the completion of the WQE.
#[test]
fn a_cqe_of_another_format_is_refused() {
    let h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, 4096);
    h.consumer.format_at.store(1, Release);
    let qp = h.qp::<Exclusive>();
    qp.wait(qp.put(h.remote(0), h.local(0), 8).unwrap()).unwrap();
    let t = qp.put(h.remote(8), h.local(8), 8).unwrap();
    assert_eq!(qp.wait(t), Err(WaitError::CqeFormat { index: 1, format: 3 }));
    assert!(matches!(
        qp.poll_one(),
        Some(Err(WaitError::CqeFormat { index: 1, format: 3 }))
    ));
    assert_eq!(PostError::from(WaitError::CqeFormat { index: 1, format: 3 }).code(), 8);
    h.finish();
}

/// A zero-byte inline put is a zero-length WRITE of control and remote address, with no inline
/// segment (rdma-core's form), and completes.
#[test]
fn a_zero_byte_inline_put_has_no_inline_segment() {
    let h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, 4096);
    let qp = h.qp::<Exclusive>();
    qp.wait(qp.put_inline(h.remote(0), &[]).unwrap()).unwrap();
    let seen = h.finish();
    assert_eq!(seen[0].ds, 2);
    assert!(matches!(
        seen[0].op,
        Operation::Write { payload: Payload::Gather(l), .. } if l.as_slice().is_empty()
    ));
    assert_eq!(seen.len(), 1);
}

/// Where the GPU needs it (GPUDirect RDMA writes ordering below OWNER), every READ and fetching
/// atomic ends with a fenced DUMP of its local buffer, and its ticket is the DUMP's: what
/// NVSHMEM and DOCA do before a kernel reads fetched data. `signal` reads nothing: no DUMP.
#[test]
fn fetched_data_is_flushed_by_a_fenced_dump_where_needed() {
    let h = Harness::new(4, DoorbellKind::Gpu, 1 << 20, 4096).with_flags(QP_FLUSH_AFTER_FETCH);
    let qp = h.qp::<Exclusive>();
    qp.put_inline(h.remote(0), b"flushed!").unwrap();
    let t = qp.get(h.local(512), h.remote(0), 8).unwrap();
    assert_eq!(t, 2, "the get's ticket is its DUMP's");
    qp.wait(t).unwrap();
    assert_eq!(&h.local_bytes()[512..520], b"flushed!");
    assert_eq!(qp.atomic_fetch_add(h.remote(64), 3, h.local(1024)).unwrap(), 0);
    qp.signal(h.remote(64), 1, h.local(1032)).unwrap();
    qp.wait(qp.get(h.local(0), h.remote(0), 0).unwrap()).unwrap();
    let dumps = [(2, h.local(512)), (4, h.local(1024))];
    let seen = h.finish();
    let kinds: Vec<_> = seen.iter().map(|w| w.opcode).collect();
    use WqeOpcode::*;
    assert_eq!(kinds, [RdmaWrite, RdmaRead, Dump, AtomicFa, Dump, AtomicFa, Nop]);
    for (i, local) in dumps {
        assert_eq!(FenceMode::from_fm_ce_se(seen[i].fm_ce_se), FenceMode::Fence);
        let Operation::Dump { local: l } = seen[i].op else {
            panic!("not a DUMP")
        };
        assert_eq!((l.addr, l.lkey, l.length), (local.addr, local.lkey, 1));
    }
}

/// Without the flag no DUMP is posted (the H100 here orders GPUDirect writes for its owner).
#[test]
fn no_dump_where_the_gpu_orders_rdma_writes() {
    let h = Harness::new(4, DoorbellKind::Gpu, 1 << 20, 4096);
    let qp = h.qp::<Exclusive>();
    qp.wait(qp.get(h.local(512), h.remote(0), 8).unwrap()).unwrap();
    assert_eq!(qp.atomic_fetch_add(h.remote(64), 3, h.local(1024)).unwrap(), 0);
    let seen = h.finish();
    assert!(seen.iter().all(|w| w.opcode != WqeOpcode::Dump));
}

/// Rings in GPU memory change only the scope of the doorbell fences: the consumer sees the
/// same WQEs, doorbell record and doorbells, in every scope's posting path.
#[test]
fn rings_in_gpu_memory_post_the_same_queue() {
    let h = Harness::new(4, DoorbellKind::Gpu, 1 << 20, 4096).with_flags(QP_RINGS_IN_GPU_MEMORY);
    let qp = h.qp::<Exclusive>();
    qp.put_inline(h.remote(0), b"gpu ring").unwrap();
    qp.wait(qp.get(h.local(512), h.remote(0), 8).unwrap()).unwrap();
    assert_eq!(&h.local_bytes()[512..520], b"gpu ring");
    let seen = h.finish();
    let kinds: Vec<_> = seen.iter().map(|w| w.opcode).collect();
    assert_eq!(kinds, [WqeOpcode::RdmaWrite, WqeOpcode::RdmaRead]);
}

/// Reusing a slot consumes through the newest completed WQE, not just the slot's previous
/// user: a poster that waits for its peer between posts (write_lat) then polls one CQE per
/// ring, not one per post on its way to the doorbell. An error among them is still reported.
#[test]
fn reusing_a_slot_consumes_every_completion_that_is_in() {
    let h = Harness::new(3, DoorbellKind::Gpu, 1 << 20, 4096);
    h.consumer.fail_at.store(13, Release);
    let qp = h.qp::<Exclusive>();
    let consumed = || unsafe { std::ptr::read_volatile(&h.setup.qp.cq.consumed) };
    let written = |index: u64| h.wait_cqe_written(index, 3);
    for i in 0..8u64 {
        qp.put(h.remote(8 * i), h.local(8 * i), 8).unwrap();
    }
    written(7);
    assert_eq!(consumed(), 0);
    // The ninth post needs slot 0 back: every CQE up to the eighth's is in, and consumed.
    qp.put(h.remote(0), h.local(0), 8).unwrap();
    assert_eq!(consumed(), 8);
    assert_eq!(u32::from_be(h.setup.cq_dbrec[0]), 8, "the CQ's doorbell record follows");
    for i in 9..16u64 {
        qp.put(h.remote(8 * (i % 8)), h.local(8 * (i % 8)), 8).unwrap();
    }
    assert_eq!(consumed(), 8, "slots 1..8 were already free");
    written(15);
    // WQE 13 failed (and 14, 15 were flushed): consuming through 15 keeps its error.
    qp.put(h.remote(0), h.local(0), 8).unwrap();
    assert_eq!(consumed(), 16);
    for index in [13, 15] {
        match qp.poll_at(index) {
            Err(WaitError::Cqe(e)) => assert_eq!((e.wqe_index, e.syndrome), (13, Syndrome::RemoteAccess)),
            other => panic!("expected WQE 13's error at {index}, got {other:?}"),
        }
    }
    assert_eq!(qp.poll_at(12), Ok(()));
    h.finish();
}
