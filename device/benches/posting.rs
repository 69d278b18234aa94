//! Host posting rate of the device data path (CPU mode): WQEs per second written, marked ready
//! and rung by 1 and 2 CPU threads, next to the reference measured in the same run: a plain
//! loop of 64-byte stores into the same ring memory (the most a poster could do).
//!
//! Nothing consumes the ring: each repetition posts exactly one ring's worth into a fresh
//! handle, so no reservation waits for a completion and the figure is the posting cost alone.
//!
//! `cargo bench -p gdaki-device --bench posting [-- --json] [--reps N]`
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use gdaki_device::{Exclusive, Gpu, Local, Qp, Remote, Sharing};
use gdaki_layout::{DevCq, DevQp, DoorbellKind};
use serde::Serialize;

const LOG: u32 = 15;
const RING: usize = 1 << LOG;

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u64; 8]);

/// A QP whose rings live in host memory; the doorbell and records are plain words.
struct Rings {
    qp: Box<DevQp>,
    sq: Vec<Line>,
    cq: Vec<Line>,
    records: Box<[u32; 4]>,
    doorbell: Box<u64>,
}

impl Rings {
    fn new() -> Self {
        let mut r = Rings {
            qp: Box::new(bytemuck::Zeroable::zeroed()),
            sq: vec![Line([0; 8]); RING],
            cq: vec![Line([0; 8]); RING],
            records: Box::new([0; 4]),
            doorbell: Box::new(0),
        };
        r.reset();
        r
    }

    /// A fresh handle over the same rings: nothing reserved, nothing outstanding.
    fn reset(&mut self) {
        *self.qp = DevQp {
            sq_base: self.sq.as_ptr() as u64,
            sq_dbrec: &self.records[1] as *const u32 as u64,
            doorbell: &*self.doorbell as *const u64 as u64,
            max_msg_size: 1 << 30,
            timeout_ns: 1_000_000_000,
            qpn: 0x42,
            sq_log_size: LOG,
            doorbell_kind: DoorbellKind::Gpu as u8,
            cq: DevCq {
                cqe_base: self.cq.as_ptr() as u64,
                dbrec: &self.records[2] as *const u32 as u64,
                cqn: 1,
                log_size: LOG,
                ..bytemuck::Zeroable::zeroed()
            },
            ..bytemuck::Zeroable::zeroed()
        };
    }

    fn qp<M: Sharing>(&self) -> Qp<M> {
        // SAFETY: the handle and its rings outlive every poster (joined before reset/drop).
        unsafe { Qp::from_raw(&*self.qp as *const DevQp as *mut DevQp) }
    }
}

/// How one thread fills its share of the ring.
#[derive(Clone, Copy)]
enum Workload {
    /// The reference: four 16-byte stores per 64-byte slot, nothing else (a put's WQE is three).
    Stores,
    /// `put` per WQE: reserve, write, mark ready, doorbell record and doorbell, each time.
    Put,
    /// The low level in batches of 32: one reservation, ready mark and doorbell per batch.
    Batch32,
}

/// Runs `threads` posters over one ring; returns the wall time of the slowest.
fn once<M: Sharing>(rings: &Rings, threads: usize, work: Workload) -> Duration {
    let per = RING / threads;
    let start = Barrier::new(threads);
    let elapsed = AtomicU64::new(0);
    thread::scope(|s| {
        for t in 0..threads {
            let (start, elapsed) = (&start, &elapsed);
            s.spawn(move || {
                let qp = rings.qp::<M>();
                let sq = rings.sq.as_ptr() as u64;
                let dst = Remote { addr: 0x1000, rkey: 7 };
                let src = Local { addr: 0x2000, lkey: 9 };
                start.wait();
                let t0 = Instant::now();
                match work {
                    Workload::Stores => {
                        for i in (t * per) as u64..((t + 1) * per) as u64 {
                            let p = (sq + i * 64) as *mut u64;
                            for k in 0..4 {
                                // SAFETY: slot i of the ring, 16 bytes at a time with the data
                                // path's own segment store.
                                unsafe { gdaki_device::arch::store_seg(p.add(2 * k), [i, i ^ k as u64]) };
                            }
                        }
                    }
                    Workload::Put => {
                        for _ in 0..per {
                            black_box(qp.put(dst, src, 64).expect("put"));
                        }
                    }
                    Workload::Batch32 => {
                        for _ in 0..per / 32 {
                            let base = qp.reserve(32).expect("reserve");
                            for i in base..base + 32 {
                                qp.wqe_prepare_write(i, dst, src, 64, 0);
                            }
                            qp.mark_ready(base, base + 32).expect("ready");
                            qp.submit(base + 32).expect("submit");
                        }
                    }
                }
                elapsed.fetch_max(t0.elapsed().as_nanos() as u64, Relaxed);
            });
        }
    });
    Duration::from_nanos(elapsed.load(Relaxed))
}

#[derive(Serialize)]
struct Row {
    workload: &'static str,
    mode: &'static str,
    threads: usize,
    /// Best repetition, WQEs (or 64-byte slots) per second.
    per_second: f64,
    /// Median repetition.
    per_second_median: f64,
    /// Against the store loop with the same thread count, best against best.
    vs_stores: f64,
}

fn measure<M: Sharing>(rings: &mut Rings, threads: usize, work: Workload, reps: usize) -> (f64, f64) {
    let mut rates: Vec<f64> = (0..reps)
        .map(|_| {
            rings.reset();
            let d = once::<M>(rings, threads, work);
            RING as f64 / d.as_secs_f64()
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    (rates[reps - 1], rates[reps / 2])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(30usize)
        .max(1);
    let mut rings = Rings::new();
    let mut rows = Vec::new();
    for threads in [1usize, 2] {
        eprintln!("measuring with {threads} thread(s), {reps} repetitions of {RING} WQEs ...");
        let (stores, stores_med) = measure::<Gpu>(&mut rings, threads, Workload::Stores, reps);
        let mut push = |workload, mode, (best, med): (f64, f64)| {
            rows.push(Row {
                workload,
                mode,
                threads,
                per_second: best,
                per_second_median: med,
                vs_stores: best / stores,
            })
        };
        push("64-byte stores (reference)", "-", (stores, stores_med));
        if threads == 1 {
            push(
                "put",
                Exclusive::NAME,
                measure::<Exclusive>(&mut rings, 1, Workload::Put, reps),
            );
            push(
                "batch of 32",
                Exclusive::NAME,
                measure::<Exclusive>(&mut rings, 1, Workload::Batch32, reps),
            );
        }
        push(
            "put",
            Gpu::NAME,
            measure::<Gpu>(&mut rings, threads, Workload::Put, reps),
        );
        push(
            "batch of 32",
            Gpu::NAME,
            measure::<Gpu>(&mut rings, threads, Workload::Batch32, reps),
        );
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows).expect("rows serialise"));
        return;
    }
    println!("host posting rate, ring of {RING} WQEs, best of {reps} (median in brackets)");
    println!(
        "{:<28} {:<10} {:>7} {:>24} {:>10}",
        "workload", "mode", "threads", "per second", "vs stores"
    );
    for r in &rows {
        println!(
            "{:<28} {:<10} {:>7} {:>10.2} M ({:>8.2} M) {:>9.1}%",
            r.workload,
            r.mode,
            r.threads,
            r.per_second / 1e6,
            r.per_second_median / 1e6,
            100.0 * r.vs_stores
        );
    }
}
