//! Proxy doorbells per second: producer threads keep raising the published indices of many
//! fake queue pairs (as GPU posters would), and 1, 2 or 4 proxy threads ring for them. Next to
//! it, in the same run, the reference: one thread ringing the same queue pairs in a plain loop
//! (the three atomic stores of a doorbell and nothing else). The producers' own rate
//! (publications/s) is printed beside the proxy's: a proxy can only ring an index that moved, so
//! where the producers slow down (their cache lines are pulled by the proxy threads) the
//! doorbell rate follows them.
//!
//! `cargo bench -p gdaki-proxy --bench doorbells [-- --json] [--qps N] [--producers N] [--secs S]`
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gdaki_proxy::{IdlePolicy, Proxy, ProxyConfig, Target};

#[repr(C, align(128))]
#[derive(Default)]
struct Words {
    index: AtomicU64,
    _pad: [u64; 7],
    dbrec: AtomicU32,
    doorbell: AtomicU64,
}

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let qps = arg(&args, "--qps", 256) as usize;
    let producers = arg(&args, "--producers", 4).max(1) as usize;
    let secs = arg(&args, "--secs", 1).max(1);
    let words: Vec<Arc<Words>> = (0..qps).map(|_| Arc::new(Words::default())).collect();

    // Reference: one thread doing nothing but the doorbell stores, round-robin.
    let started = Instant::now();
    let mut rings = 0u64;
    while started.elapsed() < Duration::from_secs(secs) {
        for (i, w) in words.iter().enumerate() {
            w.dbrec.store((rings as u32).to_be(), Ordering::Release);
            std::sync::atomic::fence(Ordering::Release);
            w.doorbell.store(rings ^ i as u64, Ordering::Release);
        }
        rings += qps as u64;
    }
    let plain = rings as f64 / started.elapsed().as_secs_f64();

    let mut rows = Vec::new();
    for threads in [1usize, 2, 4] {
        let stop = Arc::new(AtomicBool::new(false));
        let published = Arc::new(AtomicU64::new(0));
        let feeders: Vec<_> = (0..producers)
            .map(|p| {
                let (stop, words, published) = (stop.clone(), words.clone(), published.clone());
                std::thread::spawn(move || {
                    let mine: Vec<_> = words.iter().skip(p).step_by(producers).collect();
                    // Each queue pair has one producer, so it raises the index by one like a
                    // poster would. (An earlier version raised them to a loop count with
                    // fetch_max, which the indices left by the previous row's producers
                    // outran: later rows published nothing new for most of their run.)
                    while !stop.load(Ordering::Relaxed) {
                        for w in &mine {
                            w.index.fetch_add(1, Ordering::Release);
                        }
                        published.fetch_add(mine.len() as u64, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let proxy = Proxy::start(ProxyConfig {
            threads,
            idle: IdlePolicy::default(),
        })
        .expect("start the proxy");
        for (i, w) in words.iter().enumerate() {
            // SAFETY: the words outlive the target (it keeps an Arc).
            let t = unsafe {
                Target::new(
                    i as u32,
                    w.index.as_ptr(),
                    w.dbrec.as_ptr(),
                    w.doorbell.as_ptr(),
                    w.clone(),
                )
            };
            proxy.add(t);
        }
        let before = proxy.counters();
        let published_before = published.load(Ordering::Relaxed);
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_secs(secs));
        let after = proxy.counters();
        let published_after = published.load(Ordering::Relaxed);
        let dt = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        for f in feeders {
            let _ = f.join();
        }
        proxy.stop();
        let rate = (after.doorbells - before.doorbells) as f64 / dt;
        let batch = (after.doorbells - before.doorbells) as f64 / (after.batches - before.batches).max(1) as f64;
        let publications = (published_after - published_before) as f64 / dt;
        rows.push((threads, rate, rate / threads as f64, batch, publications));
    }
    if json {
        let rows: Vec<_> = rows
            .iter()
            .map(|(t, r, per, b, p)| {
                format!(
                    r#"{{"threads":{t},"doorbells_per_s":{r:.0},"per_thread":{per:.0},"per_batch":{b:.1},"publications_per_s":{p:.0}}}"#
                )
            })
            .collect();
        println!(
            r#"{{"qps":{qps},"producers":{producers},"plain_ring_loop_per_s":{plain:.0},"rows":[{}]}}"#,
            rows.join(",")
        );
    } else {
        println!("CPU proxy doorbell rate: {qps} queue pairs, {producers} producer threads raising their indices");
        println!(
            " reference: one thread's plain ring loop: {:.1} M doorbells/s",
            plain / 1e6
        );
        println!(" proxy threads   doorbells/s   per thread   doorbells per batch   publications/s");
        for (t, r, per, b, p) in rows {
            println!(
                " {t:<15} {:>9.1} M   {:>8.1} M   {b:>8.1}              {:>8.1} M",
                r / 1e6,
                per / 1e6,
                p / 1e6
            );
        }
    }
}
