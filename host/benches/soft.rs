//! The soft provider in CPU mode, loopback on one context: the 8-byte put rate (one poster
//! thread, the engine thread executing) and 1 MiB put bandwidth next to a plain memcpy of the
//! same size measured in the same run.
//!
//! `cargo bench -p gdaki --bench soft [-- --json] [--messages N]`
use std::time::Instant;

use gdaki::{Access, Context, Provider, QpConfig};
use gdaki_device::Exclusive;
use serde::Serialize;

#[derive(Serialize)]
struct Report {
    put_8b_messages: u64,
    put_8b_msgs_per_s: f64,
    put_1mib_gb_per_s: f64,
    memcpy_1mib_gb_per_s: f64,
    put_vs_memcpy: f64,
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let messages: u64 = arg(&args, "--messages", 2_000_000);
    const MIB: usize = 1 << 20;
    let ctx = Context::open(Provider::Soft)?;
    let cq = ctx.create_cq(4096)?;
    let qp = ctx.create_qp(
        &cq,
        QpConfig {
            sq_size: 4096,
            ..Default::default()
        },
    )?;
    qp.connect(&qp.endpoint())?;
    let src = ctx.alloc_region(MIB, Access::ALL)?;
    let dst = ctx.alloc_region(MIB, Access::ALL)?;
    // SAFETY: `qp` outlives `dev`; only this thread posts.
    let dev = unsafe { qp.cpu::<Exclusive>() };

    eprintln!("8-byte puts: {messages} messages ...");
    let started = Instant::now();
    for i in 0..messages {
        let off = (i % 4096) * 8;
        dev.put(dst.remote(off), src.local(off), 8)
            .map_err(|e| anyhow::anyhow!("put: {e}"))?;
    }
    dev.quiet().map_err(|e| anyhow::anyhow!("quiet: {e}"))?;
    let rate = messages as f64 / started.elapsed().as_secs_f64();

    eprintln!("1 MiB puts and memcpy ...");
    let reps = 200;
    let started = Instant::now();
    for _ in 0..reps {
        let t = dev
            .put(dst.remote(0), src.local(0), MIB as u64)
            .map_err(|e| anyhow::anyhow!("put: {e}"))?;
        dev.wait(t).map_err(|e| anyhow::anyhow!("wait: {e}"))?;
    }
    let put_bw = (reps * MIB) as f64 / started.elapsed().as_secs_f64() / 1e9;
    let (a, mut b) = (vec![1u8; MIB], vec![0u8; MIB]);
    let started = Instant::now();
    for i in 0..reps {
        b.copy_from_slice(&a);
        std::hint::black_box(&mut b)[i % MIB] ^= 1;
    }
    let memcpy_bw = (reps * MIB) as f64 / started.elapsed().as_secs_f64() / 1e9;

    let r = Report {
        put_8b_messages: messages,
        put_8b_msgs_per_s: rate,
        put_1mib_gb_per_s: put_bw,
        memcpy_1mib_gb_per_s: memcpy_bw,
        put_vs_memcpy: put_bw / memcpy_bw,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!("soft HCA, CPU mode, loopback, one poster thread (exclusive QP, 4096 WQEs)");
        println!(
            "  8-byte put rate:     {:>8.2} M msg/s ({} messages)",
            rate / 1e6,
            messages
        );
        println!("  1 MiB put bandwidth: {:>8.2} GB/s", put_bw);
        println!("  1 MiB memcpy:        {:>8.2} GB/s (reference, same run)", memcpy_bw);
        println!("  put / memcpy:        {:>8.1} %", 100.0 * put_bw / memcpy_bw);
    }
    Ok(())
}
