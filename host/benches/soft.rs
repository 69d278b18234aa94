//! The soft provider in CPU mode, loopback: the 8-byte put rate (one poster thread, the engine
//! thread executing), the 8-byte SEND rate next to it (a second pair of QPs, the receiver's queue
//! kept posted by the same thread between its sends: what the engine's two-sided path costs
//! against its WRITE path, #42's message-rate aim being 0.8), and 1 MiB put bandwidth next to a
//! plain memcpy of the same size measured in the same run. `--transport tcp` puts the two QPs in two contexts connected over loopback
//! TCP (as two processes would be) and adds a raw TCP stream of the same bytes as a reference.
//!
//! Then the round trip of one 8-byte put (post, wait for its CQE) while the same HCA also
//! serves idle QPs (`--idle 0,100,10000`), next to the round trip with none in the same run:
//! what idle QPs cost a busy one.
//!
//! `cargo bench -p gdaki --bench soft [-- --json] [--messages N] [--transport inproc|tcp]
//! [--idle N,N,...]`
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use gdaki::{Access, Context, Endpoint, Provider, QpConfig, ReceiveConfig};
use gdaki_device::{Exclusive, RecvBuf};
use serde::Serialize;

#[derive(Serialize)]
struct Report {
    transport: String,
    put_8b_messages: u64,
    put_8b_msgs_per_s: f64,
    /// 8-byte SENDs, each taken by a posted receive, same run.
    send_8b_msgs_per_s: f64,
    /// The SEND rate over the put rate.
    send_vs_put: f64,
    put_1mib_gb_per_s: f64,
    memcpy_1mib_gb_per_s: f64,
    put_vs_memcpy: f64,
    /// Raw TCP loopback stream of the same 1 MiB writes (tcp transport only).
    tcp_stream_1mib_gb_per_s: Option<f64>,
    /// One put's round trip with idle QPs beside it.
    idle: Vec<IdleRow>,
}

#[derive(Serialize)]
struct IdleRow {
    idle_qps: usize,
    round_trip_median_us: f64,
    round_trip_p99_us: f64,
    /// The median over the first row's (normally 0 idle QPs), same run.
    vs_first: f64,
}

/// Median and 99th percentile (µs) of `n` round trips of one 8-byte put.
fn round_trips(
    dev: &gdaki_device::Qp<Exclusive>,
    dst: gdaki_device::Remote,
    src: gdaki_device::Local,
    n: usize,
) -> anyhow::Result<(f64, f64)> {
    let mut us = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let t = dev.put(dst, src, 8).map_err(|e| anyhow::anyhow!("put: {e}"))?;
        dev.wait(t).map_err(|e| anyhow::anyhow!("wait: {e}"))?;
        us.push(started.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    Ok((us[n / 2], us[n * 99 / 100]))
}

/// GB/s of `reps` 1 MiB writes through a plain loopback TCP stream to a reading thread.
fn tcp_stream(reps: usize) -> anyhow::Result<f64> {
    const MIB: usize = 1 << 20;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; MIB];
        let mut left = reps * MIB;
        while left > 0 {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            left -= n.min(left);
        }
        s.write_all(b"k")
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let data = vec![1u8; MIB];
    let started = Instant::now();
    for _ in 0..reps {
        s.write_all(&data)?;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    let bw = (reps * MIB) as f64 / started.elapsed().as_secs_f64() / 1e9;
    reader.join().map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
    Ok(bw)
}

/// `e` with the zero GID, which names no HCA of this process: a connection to it goes over
/// TCP even to a context of this process.
fn over_tcp(e: Endpoint) -> Endpoint {
    Endpoint { gid: [0; 16], ..e }
}

/// `messages` 8-byte SENDs from a QP of `ctx` to one with a receive queue (of `peer`, or of
/// `ctx`), this thread keeping receives posted ahead of them; SENDs a second.
fn send_rate(ctx: &Context, peer: Option<&Context>, tcp: bool, messages: u64) -> anyhow::Result<f64> {
    /// Receives kept posted; the thread takes completions and posts again every `BATCH` sends.
    const DEPTH: u32 = 2048;
    const BATCH: u64 = 256;
    let on = peer.unwrap_or(ctx);
    let (scq, rcq) = (ctx.create_cq(4096)?, on.create_cq(4096)?);
    let sqp = ctx.create_qp(
        &scq,
        QpConfig {
            sq_size: 4096,
            ..Default::default()
        },
    )?;
    let rqp = on.create_qp(
        &rcq,
        QpConfig {
            sq_size: 64,
            receive: Some(ReceiveConfig {
                size: 4096,
                max_bufs: 1,
            }),
            ..Default::default()
        },
    )?;
    let reach = |e: Endpoint| if tcp { over_tcp(e) } else { e };
    sqp.connect(&reach(rqp.endpoint()))?;
    rqp.connect(&reach(sqp.endpoint()))?;
    let (src, dst) = (ctx.alloc_region(8, Access::ALL)?, on.alloc_region(8, Access::ALL)?);
    // SAFETY: both QPs outlive the handles; only this thread posts to either queue.
    let (dev, rq) = unsafe { (sqp.cpu::<Exclusive>()?, rqp.cpu_receive::<Exclusive>()?) };
    let post = |n: u32| {
        rq.post_recvs(n, |_| RecvBuf {
            local: dst.local(0),
            len: 8,
        })
        .map_err(|e| anyhow::anyhow!("post_recvs: {e}"))
    };
    let first = post(DEPTH)?;
    let (mut posted, mut taken) = (u64::from(DEPTH), 0u64);
    let take = |upto: u64, taken: &mut u64| -> anyhow::Result<()> {
        while *taken < upto {
            rq.poll(first + *taken).map_err(|e| anyhow::anyhow!("receive: {e}"))?;
            *taken += 1;
        }
        Ok(())
    };
    let started = Instant::now();
    for i in 0..messages {
        if i % BATCH == 0 && i > 0 {
            // Every receive a SEND took up to a batch ago has completed or is about to: take
            // them and post as many again, so a SEND never finds none (an RNR wait).
            take(i - BATCH, &mut taken)?;
            let n = (taken + u64::from(DEPTH) - posted).min(messages - posted.min(messages));
            if n > 0 {
                post(n as u32)?;
                posted += n;
            }
        }
        dev.send(src.local(0), 8).map_err(|e| anyhow::anyhow!("send: {e}"))?;
    }
    take(messages, &mut taken)?;
    let rate = messages as f64 / started.elapsed().as_secs_f64();
    dev.quiet().map_err(|e| anyhow::anyhow!("quiet: {e}"))?;
    Ok(rate)
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
    let transport: String = arg(&args, "--transport", "inproc".to_string());
    let tcp = match transport.as_str() {
        "inproc" => false,
        "tcp" => true,
        t => anyhow::bail!("--transport {t}: expected inproc or tcp"),
    };
    let messages: u64 = arg(&args, "--messages", if tcp { 500_000 } else { 2_000_000 });
    const MIB: usize = 1 << 20;
    let cfg = QpConfig {
        sq_size: 4096,
        ..Default::default()
    };
    let ctx = Context::open(Provider::Soft)?;
    let cq = ctx.create_cq(4096)?;
    let qp = ctx.create_qp(&cq, cfg.clone())?;
    let src = ctx.alloc_region(MIB, Access::ALL)?;
    // The target: the same context (in-process), or a second one reached over loopback TCP.
    let peer = if tcp {
        let loopback = "127.0.0.1:0".parse()?;
        ctx.listen(loopback)?;
        let peer = Context::open(Provider::Soft)?;
        peer.listen(loopback)?;
        let pcq = peer.create_cq(4096)?;
        let pqp = peer.create_qp(&pcq, cfg)?;
        qp.connect(&over_tcp(pqp.endpoint()))?;
        pqp.connect(&over_tcp(qp.endpoint()))?;
        Some((peer, pcq, pqp))
    } else {
        qp.connect(&qp.endpoint())?;
        None
    };
    let dst = match &peer {
        Some((p, _, _)) => p.alloc_region(MIB, Access::ALL)?,
        None => ctx.alloc_region(MIB, Access::ALL)?,
    };
    // SAFETY: `qp` outlives `dev`; only this thread posts.
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();

    eprintln!("8-byte puts: {messages} messages ...");
    let started = Instant::now();
    for i in 0..messages {
        let off = (i % 4096) * 8;
        dev.put(dst.remote(off), src.local(off), 8)
            .map_err(|e| anyhow::anyhow!("put: {e}"))?;
    }
    dev.quiet().map_err(|e| anyhow::anyhow!("quiet: {e}"))?;
    let rate = messages as f64 / started.elapsed().as_secs_f64();

    eprintln!("8-byte sends: {messages} messages ...");
    let send_rate = send_rate(&ctx, peer.as_ref().map(|(p, _, _)| p), tcp, messages)?;

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
    let stream_bw = if tcp { Some(tcp_stream(reps)?) } else { None };

    let counts: Vec<usize> = arg(&args, "--idle", "0,100,10000".to_string())
        .split(',')
        .map(|n| n.trim().parse())
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("--idle: {e}"))?;
    let mut idle = Vec::new();
    let mut kept = Vec::new();
    for &n in &counts {
        eprintln!("8-byte put round trips beside {n} idle QPs ...");
        while kept.len() < n {
            let cq = ctx.create_cq(8)?;
            let q = ctx.create_qp(
                &cq,
                QpConfig {
                    sq_size: 8,
                    ..Default::default()
                },
            )?;
            q.connect(&q.endpoint())?;
            kept.push((cq, q));
        }
        let (median, p99) = round_trips(&dev, dst.remote(0), src.local(0), 2000)?;
        let first = idle.first().map_or(median, |r: &IdleRow| r.round_trip_median_us);
        idle.push(IdleRow {
            idle_qps: n,
            round_trip_median_us: median,
            round_trip_p99_us: p99,
            vs_first: median / first,
        });
    }
    drop(kept);

    let r = Report {
        transport: transport.clone(),
        tcp_stream_1mib_gb_per_s: stream_bw,
        put_8b_messages: messages,
        put_8b_msgs_per_s: rate,
        send_8b_msgs_per_s: send_rate,
        send_vs_put: send_rate / rate,
        put_1mib_gb_per_s: put_bw,
        memcpy_1mib_gb_per_s: memcpy_bw,
        put_vs_memcpy: put_bw / memcpy_bw,
        idle,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!("soft HCA, CPU mode, loopback ({transport}), one poster thread (exclusive QP, 4096 WQEs)");
        println!(
            "  8-byte put rate:     {:>8.2} M msg/s ({} messages)",
            rate / 1e6,
            messages
        );
        println!(
            "  8-byte send rate:    {:>8.2} M msg/s ({:.2} of the put rate, same run)",
            send_rate / 1e6,
            send_rate / rate
        );
        println!("  1 MiB put bandwidth: {:>8.2} GB/s", put_bw);
        println!("  1 MiB memcpy:        {:>8.2} GB/s (reference, same run)", memcpy_bw);
        println!("  put / memcpy:        {:>8.1} %", 100.0 * put_bw / memcpy_bw);
        if let Some(s) = stream_bw {
            println!("  1 MiB TCP stream:    {s:>8.2} GB/s (reference, same run)");
            println!("  put / TCP stream:    {:>8.1} %", 100.0 * put_bw / s);
        }
        println!("  8-byte put round trip beside idle QPs (2000 each; reference: the first row, same run)");
        println!("    idle QPs   median [us]   p99 [us]   median / first");
        for r in &r.idle {
            println!(
                "    {:>8}   {:>11.2}   {:>8.2}   {:>14.2}",
                r.idle_qps, r.round_trip_median_us, r.round_trip_p99_us, r.vs_first
            );
        }
    }
    Ok(())
}
