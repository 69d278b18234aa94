//! Model check of the posting protocol (reserve, write, mark ready, submit) with loom: every
//! interleaving of the posters and the consumer (up to loom's preemption bound), on the very
//! code of `gdaki-device`, whose host atomics become loom's under `--cfg loom`.
//!
//! `RUSTFLAGS="--cfg loom" cargo test -p gdaki-device --test loom --release`
//!
//! Checked in every execution:
//! - a consumer that sees a doorbell (or proxy word) finds every WQE before it fully written;
//!   so does one that reads the doorbell record (an HCA recovering a lost doorbell): the
//!   record may trail the doorbell, which is rung first, but never leads the WQEs;
//! - doorbells never go backwards;
//! - when the posters are done, the last doorbell (or proxy word) and the record cover every
//!   WQE: no lost doorbell, whoever rang last.
//!
//! Completions are outside this model (rings here never wrap); the consumer tests cover them.
#![cfg(loom)]

use gdaki_device::arch;
use gdaki_device::{Cta, Exclusive, Gpu, Local, Qp, Remote, Sharing};
use gdaki_layout::wqe::{Operation, WorkRequest, WqeView};
use gdaki_layout::{dbrec, doorbell, ring, DevQp, DoorbellKind};
use loom::thread;

const QPN: u32 = 0x77;
const LOG: u32 = 3;

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u64; 8]);

/// Rings and records for one execution (fresh memory, so fresh loom cells).
struct Rings {
    qp: Box<DevQp>,
    sq: Vec<Line>,
    records: Box<[u32; 2]>,
    doorbell: Box<u64>,
}

#[derive(Clone, Copy)]
struct Ptr(*mut DevQp);
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

impl Rings {
    fn new(kind: DoorbellKind) -> Box<Rings> {
        let mut r = Box::new(Rings {
            qp: Box::new(bytemuck::Zeroable::zeroed()),
            sq: vec![Line([0; 8]); 1 << LOG],
            records: Box::new([0; 2]),
            doorbell: Box::new(0),
        });
        *r.qp = DevQp {
            sq_base: r.sq.as_ptr() as u64,
            sq_dbrec: &r.records[dbrec::SND_DBR] as *const u32 as u64,
            doorbell: &*r.doorbell as *const u64 as u64,
            max_msg_size: 1 << 20,
            // Never expires: the model explores interleavings, not time.
            timeout_ns: u64::MAX / 2,
            qpn: QPN,
            sq_log_size: LOG,
            doorbell_kind: kind as u8,
            ..bytemuck::Zeroable::zeroed()
        };
        r.touch();
        r
    }

    /// Creates the loom cell of every shared word here, before any thread starts: loom counts
    /// an atomic's creation as a write, which must happen before other threads' accesses.
    fn touch(&self) {
        let q = &*self.qp;
        unsafe {
            for w in [&q.sq_reserved, &q.sq_ready, &q.sq_rung, &*self.doorbell] {
                arch::load_u64_volatile(w);
            }
            arch::load_u32_volatile(&q.db_lock);
            arch::load_u32_volatile(q.sq_dbrec as *const u32);
            for line in &self.sq {
                for w in &line.0 {
                    arch::load_u64_volatile(w);
                }
            }
        }
    }
    fn ptr(&self) -> Ptr {
        Ptr(&*self.qp as *const DevQp as *mut DevQp)
    }
}

/// Poster `p`'s `i`-th put: remote address tells who wrote it.
fn remote(p: u64, i: u64) -> Remote {
    Remote {
        addr: 0x10_0000 + p * 0x1000 + i * 64,
        rkey: 5,
    }
}

/// The producer index the consumer sees now in the doorbell (or proxy word), and the one in
/// the doorbell record (0: nothing rung or recorded yet).
fn producer_index(qp: &DevQp, kind: DoorbellKind) -> (u64, u64) {
    // A barrier after each load: what the posters wrote before either value is visible.
    let db = unsafe { arch::load_u64_volatile(qp.doorbell as *const u64) };
    arch::from_device_barrier();
    let rec = u32::from_be(unsafe { arch::load_u32_volatile(qp.sq_dbrec as *const u32) });
    arch::from_device_barrier();
    match kind {
        DoorbellKind::CpuProxy => (db, 0),
        // CPU-assisted posters ring a host word exactly as they ring a NIC's doorbell.
        DoorbellKind::Gpu | DoorbellKind::CpuAssisted => {
            // Rings never wrap here, so the 16-bit indices are the counts.
            let rec = rec as u16 as u64;
            if db == 0 {
                return (0, rec);
            }
            let (qpn, pi) = doorbell::decode(db.to_ne_bytes());
            assert_eq!(qpn, QPN);
            (pi as u64, rec)
        }
    }
}

/// Every WQE before `pi` is a complete put from one of the posters.
fn check_wqes(qp: &DevQp, pi: u64, posters: u64, per: u64) {
    for index in 0..pi {
        let slot = qp.sq_base + ring::wqe_offset(index, LOG);
        let words: Vec<u64> = (0..8)
            .map(|k| {
                if k < 6 {
                    unsafe { arch::load_u64_volatile((slot + 8 * k) as *const u64) }
                } else {
                    0 // a put writes three segments; the rest is never touched
                }
            })
            .collect();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let wr = WqeView::new_checked(&bytes[..])
            .and_then(|v| WorkRequest::parse(&v))
            .unwrap_or_else(|e| panic!("WQE {index} rung but not written: {e:?}"));
        assert_eq!((wr.wqe_index, wr.qpn), (index as u16, QPN), "WQE {index}: {wr:?}");
        let Operation::Write { remote: r, .. } = wr.op else {
            panic!("WQE {index} is not a put: {wr:?}");
        };
        assert!(
            (0..posters).any(|p| (0..per).any(|i| remote(p, i) == r)),
            "WQE {index} carries a put no one posted: {r:?}"
        );
    }
}

/// `posters` threads each put `per` messages while a consumer looks at the doorbell twice.
/// Says on stderr every 10 s how far the exploration is, and what it took in the end (a model
/// runs for a minute and more; run with `--nocapture` to see it as it goes).
fn model<M: Sharing>(kind: DoorbellKind, posters: u64, per: u64, bound: usize) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let name = std::thread::current().name().unwrap_or("model").to_string();
    let explored = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let heartbeat = {
        let (explored, done, name) = (explored.clone(), done.clone(), name.clone());
        std::thread::spawn(move || {
            let mut next = Duration::from_secs(10);
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                if started.elapsed() >= next {
                    eprintln!(
                        "   loom: {name}: {} interleavings so far, {} s",
                        explored.load(Ordering::Relaxed),
                        next.as_secs()
                    );
                    next += Duration::from_secs(10);
                }
            }
        })
    };
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(bound);
    let counter = explored.clone();
    b.check(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        let rings = Rings::new(kind);
        let p = rings.ptr();
        let handles: Vec<_> = (0..posters)
            .map(|poster| {
                thread::spawn(move || {
                    let qp = unsafe { Qp::<M>::from_raw(p.0) };
                    for i in 0..per {
                        qp.put(remote(poster, i), Local { addr: 0x2000, lkey: 9 }, 64)
                            .expect("put");
                    }
                })
            })
            .collect();
        let consumer = thread::spawn(move || {
            let qp = unsafe { &*p.0 };
            let mut last = 0;
            for _ in 0..2 {
                let (pi, rec) = producer_index(qp, kind);
                assert!(pi >= last, "doorbell went backwards: {last} then {pi}");
                check_wqes(qp, pi.max(rec), posters, per);
                last = pi;
                thread::yield_now();
            }
        });
        for h in handles {
            h.join().unwrap();
        }
        consumer.join().unwrap();
        let qp = unsafe { &*p.0 };
        let total = posters * per;
        let (pi, rec) = producer_index(qp, kind);
        assert_eq!(pi, total, "the last doorbell covers every WQE");
        if kind == DoorbellKind::Gpu {
            assert_eq!(rec, total, "the doorbell record covers every WQE");
        }
        check_wqes(qp, total, posters, per);
        drop(rings);
    });
    done.store(true, Ordering::Relaxed);
    let _ = heartbeat.join();
    eprintln!(
        "   loom: {name}: {} interleavings, all checked, in {:.1} s",
        explored.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn gpu_mode_two_posters_gpu_doorbell() {
    model::<Gpu>(DoorbellKind::Gpu, 2, 1, 3);
}

#[test]
fn cta_mode_two_posters_two_puts_each() {
    model::<Cta>(DoorbellKind::Gpu, 2, 2, 2);
}

#[test]
fn gpu_mode_three_posters() {
    model::<Gpu>(DoorbellKind::Gpu, 3, 1, 1);
}

#[test]
fn gpu_mode_two_posters_cpu_proxy() {
    model::<Gpu>(DoorbellKind::CpuProxy, 2, 1, 3);
}

#[test]
fn exclusive_poster_against_the_consumer() {
    model::<Exclusive>(DoorbellKind::Gpu, 1, 3, 3);
}
