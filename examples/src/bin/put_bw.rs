//! `put_bw`: RDMA WRITE bandwidth and message rate, posted by GPU kernels (or, in CPU mode, by
//! CPU threads running the same device code), in perftest `ib_write_bw`'s format, next to a
//! reference measured in the same run (a device-to-device copy on the GPU, memcpy on the CPU).
//!
//! `put_bw [-s SIZE | -a] [-n ITERS] [-q QPS] [--scope thread|warp|block] [--read | --send]
//! [--json] [--plot F.svg]` loops back in one process; `put_bw --server` and `put_bw SERVER`
//! run across two. `--read` streams RDMA READs instead, as perftest's `ib_read_bw`; `--send`
//! streams SENDs, which receives posted by CPU threads on the receiving side take, as
//! `ib_send_bw` (one tool per pattern, the verb a flag: the same posters, windows and
//! references, so the verbs compare like with like).
use std::path::PathBuf;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Parser;
use gdaki::cuda::StreamOp;
use gdaki::cuda::{DataPathLaunch, KernelMode, PeerDirection};
use gdaki::handshake::{Hello, RemoteRegion};
use gdaki::stream::{StreamError, StreamQp, WorkRequest};
use gdaki::{CompletionQueue, MemoryRegion, QpConfig, QueuePair, ReceiveConfig};
use gdaki_device::status::Code;
use gdaki_device::{Exclusive, Local, Remote};
use gdaki_examples::cli::{Common, Mem, Role, Scope};
use gdaki_examples::plot::{self, Panel, PlotFile, Scale, Series};
use gdaki_examples::report::{self, BwRow, JsonReport, MIB};
use gdaki_examples::session::{check_bytes, pattern_bytes, PeerPath, Session, Symmetric};
use serde::Serialize;

/// Most bytes of message slots per buffer: messages cycle through `BUFFER_BYTES / size` slots
/// (at most [`MAX_SLOTS`]), so an 8 MiB sweep does not need gigabytes.
const BUFFER_BYTES: u64 = 64 << 20;
/// Most slots per buffer.
const MAX_SLOTS: u64 = 1024;
/// Timed windows per size: the average is over all of them, the peak is the best one.
const WINDOWS: u32 = 4;

#[derive(Debug, Parser)]
#[command(
    name = "put_bw",
    version,
    about = "RDMA WRITE bandwidth and message rate, posted by GPU kernels (or CPU threads) through gdaki"
)]
struct Cli {
    #[command(flatten)]
    common: Common,
    /// Number of QPs.
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    qps: u32,
    /// Bandwidth in Gbit/s (10^9 bits) instead of MiB/s (2^20 bytes).
    #[arg(long = "report-gbits", alias = "report_gbits")]
    report_gbits: bool,
    /// Write an SVG: bandwidth, message rate and their share of the reference against size
    /// (log axes) for -a sweeps; a table for one size. Checked before the run.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// GPU blocks (default: 2, or the number of QPs if more); block b posts on QP b mod q.
    #[arg(long)]
    blocks: Option<u32>,
    /// GPU threads per block (default: 256).
    #[arg(long)]
    threads: Option<u32>,
    /// RDMA READs instead of WRITEs (perftest's `ib_read_bw`): the messages come from the
    /// peer's buffer into this side's, which this side validates. Give it on both sides.
    #[arg(long, conflicts_with = "send")]
    read: bool,
    /// SENDs instead of WRITEs (perftest's `ib_send_bw`): each message is taken by a receive
    /// that the receiving side (the server, or this process in loopback) keeps posted from one
    /// CPU thread per QP, into its buffer, which it validates. Give it on both sides.
    #[arg(long)]
    send: bool,
    /// Post from streams instead of kernels (GPUDirect Async, docs/stream.md): one stream per
    /// QP (a CUDA stream in GPU mode, a CPU thread's stream in CPU mode) rings each batch of
    /// WQEs the CPU wrote ahead, and waits for each window's last completion; windows are timed
    /// on the streams.
    #[arg(long)]
    stream: bool,
    /// With --send: receives each receiving QP keeps posted (perftest's -r, --rx-depth).
    #[arg(short = 'r', long = "rx-depth", default_value_t = DEFAULT_RX_DEPTH)]
    rx_depth: u32,
}

/// perftest's default receive depth.
const DEFAULT_RX_DEPTH: u32 = 512;

impl Cli {
    fn stream_op(&self) -> StreamOp {
        match (self.read, self.send) {
            (true, _) => StreamOp::Read,
            (_, true) => StreamOp::Send,
            _ => StreamOp::Write,
        }
    }

    /// The test's name, in the handshake (both sides must run the same) and the reports.
    fn test(&self) -> &'static str {
        match self.stream_op() {
            StreamOp::Write => "put_bw",
            StreamOp::Read => "put_bw --read",
            StreamOp::Send => "put_bw --send",
        }
    }

    /// The operation, as `--json` reports it.
    fn op(&self) -> &'static str {
        match self.stream_op() {
            StreamOp::Write => "write",
            StreamOp::Read => "read",
            StreamOp::Send => "send",
        }
    }

    /// perftest's title for the test.
    fn title(&self) -> &'static str {
        match self.stream_op() {
            StreamOp::Write => "RDMA_Write BW Test",
            StreamOp::Read => "RDMA_Read BW Test",
            StreamOp::Send => "Send BW Test",
        }
    }

    /// The receive queue a `--send` QP needs: `--rx-depth` receives, in a queue of the next
    /// power of two.
    fn receive(&self) -> anyhow::Result<Option<ReceiveConfig>> {
        let depth = self.rx_depth;
        if !self.send {
            if depth != DEFAULT_RX_DEPTH {
                bail!("--rx-depth {depth}: receives are posted only with --send");
            }
            return Ok(None);
        }
        if !(1..=MAX_RX_DEPTH).contains(&depth) {
            bail!("--rx-depth {depth}: 1 to {MAX_RX_DEPTH} receives");
        }
        Ok(Some(ReceiveConfig {
            size: depth.next_power_of_two(),
            max_bufs: 1,
        }))
    }
}

/// The deepest receive queue `--rx-depth` asks for (as deep as a send queue may be).
const MAX_RX_DEPTH: u32 = gdaki::MAX_SQ_SIZE;

/// The run's parameters, as `--json` reports them.
#[derive(Debug, Serialize)]
struct Params {
    role: &'static str,
    /// `write`, `read` (`--read`) or `send` (`--send`).
    op: &'static str,
    /// `--send`: receives each receiving QP keeps posted.
    #[serde(skip_serializing_if = "Option::is_none")]
    rx_depth: Option<u32>,
    /// Who posts: `kernel` (CPU threads in CPU mode) or `stream` (`--stream`).
    poster: &'static str,
    provider: String,
    device: String,
    mode: &'static str,
    gpu: Option<String>,
    scope: Scope,
    handler: &'static str,
    /// `--reliable-doorbell`: the queue pairs have no doorbell record.
    reliable_doorbell: bool,
    /// `--collapsed-cq`: the send CQs have one entry.
    collapsed_cq: bool,
    /// Where the queues' rings are: `host` or `gpu`.
    rings: &'static str,
    qps: u32,
    tx_depth: u32,
    memory: &'static str,
    blocks: Option<u32>,
    threads_per_block: Option<u32>,
    sharing: Option<String>,
    /// Messages per QP per size (per round with `duration_s`): `-n`, rounded up in GPU mode
    /// to whole messages per thread.
    iterations: u64,
    /// `-n` as given.
    iterations_asked: u32,
    /// `-D`: each size ran for this many seconds, in rounds of `iterations`.
    duration_s: Option<u64>,
    sizes: Vec<u64>,
    bw_unit: &'static str,
}

#[derive(Debug, Serialize, serde::Deserialize)]
struct Reference {
    what: String,
}

/// What a client sends its server at the end: its rows and the reference of their last column.
#[derive(Debug, Serialize, serde::Deserialize)]
struct ClientResults {
    rows: Vec<BwRow>,
    reference: Reference,
}

/// Slots per buffer for `size`-byte messages, `iters` per QP: never more than the messages,
/// so every slot is written and validated.
fn slots(size: u64, iters: u32) -> u64 {
    (BUFFER_BYTES / size).clamp(1, MAX_SLOTS.min(iters as u64))
}

fn buffer_len(sizes: &[u64], iters: u32) -> u64 {
    sizes.iter().map(|&s| s * slots(s, iters)).max().unwrap_or(1)
}

fn main() {
    gdaki_examples::init_tracing();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("put_bw: error: {}", gdaki_examples::error_text(&e));
        std::process::exit(1);
    }
}

/// The GPU launch: shape and the sharing mode the QP mapping needs.
fn gpu_launch(cli: &Cli, scope: Scope) -> anyhow::Result<DataPathLaunch> {
    let blocks = cli.blocks.unwrap_or(cli.qps.max(2));
    if blocks == 0 || blocks % cli.qps != 0 {
        bail!(
            "--blocks {blocks}: must be a multiple of -q {} (block b posts on QP b mod q)",
            cli.qps
        );
    }
    let threads = cli.threads.unwrap_or(256);
    if !(1..=1024).contains(&threads) || (scope == Scope::Warp && threads % 32 != 0) {
        bail!("--threads {threads}: 1 to 1024 per block, a multiple of 32 in warp scope");
    }
    // One block per QP: the block owns it (block scope) or shares it within itself.
    let mode = match (blocks == cli.qps, scope) {
        (true, Scope::Block) => KernelMode::Exclusive,
        (true, _) => KernelMode::Cta,
        (false, _) => KernelMode::Gpu,
    };
    Ok(DataPathLaunch {
        scope: scope.kernel(),
        mode,
        grid: blocks,
        block: threads,
    })
}

fn run(cli: Cli) -> anyhow::Result<()> {
    // Opened first: a path that cannot be written fails now, not after the run.
    let plot_file = cli.plot.as_deref().map(PlotFile::open).transpose()?;
    if !(1..=64).contains(&cli.qps) {
        bail!("-q {}: 1 to 64 QPs", cli.qps);
    }
    let mut plan = cli
        .common
        .plan(65536, 5000, || gdaki::cuda::why_unusable(cli.common.gpu))?;
    if matches!(plan.role, Role::Server(_)) {
        // The server only offers a buffer and validates it: it needs no proxy, and the GPU
        // only for `--mem device`, a buffer in GPU memory (the target of a GPU-memory run across
        // two processes on one machine, as perftest's --use_cuda on both sides). Host memory
        // otherwise: pinning it would change nothing for the HCA, and opening the GPU takes
        // seconds before the handshake.
        if plan.mem != Mem::Device {
            plan.gpu = None;
        }
        plan.proxy_threads = None;
        plan.mode_line = if cli.send {
            format!(
                "the server posts receives ({} per QP, from one CPU thread each) into a buffer ({}) and validates it",
                cli.rx_depth,
                plan.mem.describe()
            )
        } else {
            format!(
                "the server posts nothing: it offers a buffer ({}) and validates it",
                plan.mem.describe()
            )
        };
    }
    eprintln!("put_bw: {}", plan.mode_line);
    let launch = match plan.gpu {
        Some(_) if !cli.stream => Some(gpu_launch(&cli, plan.scope)?),
        _ => {
            let shape = [("--blocks", cli.blocks), ("--threads", cli.threads)];
            if let Some((flag, Some(n))) = shape.into_iter().find(|(_, v)| v.is_some()) {
                match cli.stream {
                    true => bail!("{flag} {n}: --stream posts from one stream per QP (-q), no kernel"),
                    false => bail!(
                        "{flag} {n}: CPU mode posts from one CPU thread per QP (-q); {flag} shapes the GPU launch"
                    ),
                }
            }
            None
        }
    };
    let mut session = Session::open(&cli.common, &plan)?;
    let mut symmetric = Symmetric::of(cli.test(), &plan, cli.qps);
    symmetric.buffers_gpu = session.buffers_gpu();
    let cfg = QpConfig {
        sq_size: plan.tx_depth,
        timeout: plan.timeout,
        retry_timeout: plan.timeout.mul_f64(0.8),
        handler: plan.handler(),
        reliable_doorbell: plan.reliable_doorbell,
        rings: session.rings.clone(),
        receive: cli.receive()?,
        // Receives are kept posted: a SEND that finds none waits 10 us and is tried again.
        min_rnr_timer: 1,
        ..Default::default()
    };
    let op = cli.stream_op();
    let len = buffer_len(&plan.sizes, plan.iters);
    let mut qps: Vec<(CompletionQueue, QueuePair)> = Vec::new();
    for _ in 0..cli.qps {
        let cq = session.create_cq(&plan)?;
        let qp = session.ctx.create_qp(&cq, cfg.clone())?;
        qps.push((cq, qp));
    }

    // The server only offers its buffer and validates what lands there (with --read, it fills
    // it with each size's data, which the client validates).
    if matches!(plan.role, Role::Server(_)) {
        let dst = session.alloc(len as usize)?;
        let hello = Hello {
            app: vec![],
            endpoints: qps.iter().map(|(_, q)| q.endpoint()).collect(),
            regions: vec![dst.remote_region()],
        };
        let theirs = session.exchange(&symmetric, hello)?.context("no hello")?;
        connect(&qps, &theirs.endpoints)?;
        session.agree(1, Ok(()))?;
        if !cli.common.json {
            report::print_header(
                &format!("{} (gdaki {}, server)", cli.title(), cli.test()),
                &header_lines(
                    &cli,
                    &plan,
                    &session,
                    None,
                    &qps,
                    Some(dst.remote_region()),
                    Some(&theirs),
                ),
            );
        }
        let mut rounds = 0u64;
        for (i, &size) in plan.sizes.iter().enumerate() {
            let nslots = slots(size, plan.iters);
            let data = stream_data(op, size, nslots);
            if cli.send {
                // Cleared, so that a slot no receive filled shows.
                dst.write(0, &vec![0; data.len()]).context("clearing the buffer")?;
                // Rounds as the client announces them, each with the messages per QP it sends.
                loop {
                    let count = match session.from_client(&[])?.as_deref() {
                        Some(b) => round_count(b)?,
                        None => bail!("no round from the client"),
                    };
                    if count == 0 {
                        break;
                    }
                    let step = ROUND_STEPS + 3 * rounds;
                    rounds += 1;
                    let (waited, received) = receive_round(&qps, &dst, size, nslots, count, cli.rx_depth, || {
                        // The receivers have started; then the client has sent the round.
                        session.agree(step, Ok(()))?;
                        session.agree(step + 1, Ok(())).context("the client's sends")
                    });
                    waited?;
                    session.agree(step + 2, received)?;
                }
            }
            if cli.read {
                let filled = dst.write(0, &data).context("filling the buffer");
                session.agree(10 + 2 * i as u64, filled)?; // the client may read this size
                session
                    .agree(11 + 2 * i as u64, Ok(()))
                    .context("the client's validation")?;
                eprintln!("put_bw: {size} B: read by the client intact");
                continue;
            }
            session.agree(10 + 2 * i as u64, Ok(()))?; // the client is done with this size
            let verdict = check_bytes(&dst, 0, &data, &format!("{size}-byte messages"));
            session.agree(11 + 2 * i as u64, verdict)?;
            eprintln!("put_bw: {size} B: data validated");
        }
        // The client's measurements, which the server prints too.
        let (rows, reference) = match session.from_client(&[])? {
            Some(json) => {
                let r: ClientResults = serde_json::from_slice(&json).map_err(|e| {
                    // serde quotes what it could not read: the client's text, escaped.
                    anyhow::anyhow!(
                        "the client's results are unreadable: {}",
                        gdaki::wire::printable(&e.to_string())
                    )
                })?;
                (r.rows, Some(r.reference))
            }
            None => (vec![], None),
        };
        if cli.common.json {
            let op = cli.op();
            gdaki_examples::outln!(
                "{}",
                serde_json::json!({"test": "put_bw", "op": op, "role": "server", "sizes": plan.sizes, "results": rows, "reference": reference, "validation": "ok"})
            );
        } else {
            gdaki_examples::outln!("{}", BwRow::header(cli.report_gbits));
            for row in &rows {
                gdaki_examples::outln!("{}", row.line(cli.report_gbits));
            }
            report::print_rule();
            if let Some(r) = &reference {
                gdaki_examples::outln!(" Ref: {} (the client's)", gdaki::wire::printable(&r.what));
            }
            if cli.read {
                gdaki_examples::outln!(" Validation: {} size(s), read by the client intact", plan.sizes.len());
            } else if cli.send {
                gdaki_examples::outln!(
                    " Validation: {} size(s), every message received whole, every slot intact",
                    plan.sizes.len()
                );
            } else {
                gdaki_examples::outln!(
                    " Validation: {} size(s), data received correctly from the client",
                    plan.sizes.len()
                );
            }
        }
        return Ok(());
    }

    // Loopback or client: this side posts.
    let src = session.alloc(len as usize)?;
    let (dst_local, target, peer) = match plan.role {
        Role::Loopback => {
            let dst = session.alloc(len as usize)?;
            for (_, q) in &qps {
                q.connect(&q.endpoint())?;
            }
            let r = dst.remote(0);
            (Some(dst), r, None)
        }
        _ => {
            let hello = Hello {
                app: vec![],
                endpoints: qps.iter().map(|(_, q)| q.endpoint()).collect(),
                regions: vec![],
            };
            let theirs = session.exchange(&symmetric, hello)?.context("no hello")?;
            let Some(RemoteRegion { addr, len: rlen, rkey }) = theirs.regions.first().copied() else {
                bail!("the server offered no buffer");
            };
            if rlen < len {
                bail!("the server's buffer is {rlen} bytes, {len} needed");
            }
            connect(&qps, &theirs.endpoints)?;
            session.agree(1, Ok(()))?;
            (None, Remote { addr, rkey }, Some(theirs))
        }
    };
    let exported = match &session.gpu {
        Some(gpu) => qps
            .iter()
            .map(|(_, q)| q.export_gpu(gpu))
            .collect::<Result<Vec<_>, _>>()?,
        None => vec![],
    };
    let proxy = session.proxy(&mut plan, qps.iter().map(|(_, q)| q))?;
    let gbits = cli.report_gbits;
    if !cli.common.json {
        report::print_header(
            &format!("{} (gdaki {})", cli.title(), cli.test()),
            &header_lines(&cli, &plan, &session, launch.as_ref(), &qps, None, peer.as_ref()),
        );
        gdaki_examples::outln!("{}", BwRow::header(gbits));
    }
    let handles: Vec<&gdaki::GpuQp> = exported.iter().collect();
    if cli.send && dst_local.is_some() {
        // In loopback the receivers are CPU threads on these QPs: refused now, not after the
        // first round's senders timed out.
        for (_, q) in &qps {
            // SAFETY: the view is dropped at once, unused.
            unsafe { q.cpu_receive::<Exclusive>() }
                .context("--send in loopback posts receives from CPU threads (--rings host)")?;
        }
    }
    let ref_copy = RefCopy::of(&session, peer.as_ref(), cli.read);
    let mut rounds = 0u64;
    // The posting GPU, apart from the session (whose barriers a --send round also takes).
    let gpu = session.gpu.clone();
    let mut rows = Vec::new();
    for (i, &size) in plan.sizes.iter().enumerate() {
        report::progress("put_bw", i, plan.sizes.len(), size);
        let nslots = slots(size, plan.iters);
        let data = stream_data(op, size, nslots);
        if cli.read {
            // The data comes from the target (filled here in loopback, by the server
            // otherwise) into `src`, cleared so that what was not read shows.
            src.write(0, &vec![0; data.len()])?;
            if let Some(dst) = &dst_local {
                dst.write(0, &data)?;
            }
            session
                .agree(10 + 2 * i as u64, Ok(()))
                .context("the server's buffer")?;
        } else {
            src.write(0, &data)?;
            if let Some(dst) = dst_local.as_ref().filter(|_| cli.send) {
                // Cleared, so that a slot no receive filled shows.
                dst.write(0, &vec![0; data.len()])?;
            }
        }
        // One round of -n messages per QP, or rounds until -D has passed.
        let started = Instant::now();
        let (mut windows, mut per_qp) = (Vec::new(), 0);
        // Messages in a round (all QPs): every round runs the same.
        let round = loop {
            let first_round = windows.is_empty();
            let post = || match (&gpu, launch) {
                _ if cli.stream => stream_windows(
                    gpu.as_ref(),
                    &qps,
                    &exported,
                    target,
                    src.local(0),
                    size,
                    nslots,
                    plan.iters,
                    op,
                    plan.timeout,
                ),
                (Some(gpu), Some(l)) => gpu_windows(
                    gpu,
                    &handles,
                    l,
                    target,
                    src.local(0),
                    size,
                    nslots,
                    plan.iters,
                    cli.qps,
                    first_round,
                    op,
                ),
                _ => cpu_windows(&qps, target, src.local(0), size, nslots, plan.iters, op, &|| {}),
            };
            let (w, n) = if cli.send {
                // The receivers take exactly what this round sends, announced to a server first.
                let count = round_messages(launch, cli.qps, plan.iters, nslots, first_round);
                let step = ROUND_STEPS + 3 * rounds;
                rounds += 1;
                session.from_client(&count.to_le_bytes())?;
                session.agree(step, Ok(())).context("the server's receivers")?;
                let (sent, received) = match &dst_local {
                    Some(dst) => receive_round(&qps, dst, size, nslots, count, cli.rx_depth, post),
                    None => (post(), Ok(())),
                };
                session.agree(
                    step + 1,
                    sent.as_ref().map(|_| ()).map_err(|e| anyhow::anyhow!("{e:#}")),
                )?;
                session.agree(step + 2, received).context("the receives")?;
                sent?
            } else {
                post()?
            };
            windows.extend(w);
            per_qp += n;
            match plan.duration {
                Some(d) if started.elapsed() < d => {}
                _ => break n * cli.qps as u64,
            }
        };
        if cli.send {
            session.from_client(&0u64.to_le_bytes())?; // no more rounds of this size
        }
        // Validation: of what was read, here; of what was written, here in loopback and by the
        // server otherwise.
        let what = format!("{size}-byte messages");
        if cli.read {
            session.agree(11 + 2 * i as u64, check_bytes(&src, 0, &data, &what))?;
        } else {
            let verdict = match &dst_local {
                Some(dst) => check_bytes(dst, 0, &data, &what),
                None => Ok(()),
            };
            session.agree(10 + 2 * i as u64, verdict)?;
            session
                .agree(11 + 2 * i as u64, Ok(()))
                .context("the server's validation")?;
        }
        let messages = per_qp * cli.qps as u64;
        let total: Duration = windows.iter().map(|w| w.0).sum();
        let bytes = (messages * size) as f64;
        let avg = bytes / total.as_secs_f64().max(1e-12) / MIB;
        let peak = windows
            .iter()
            .map(|(t, m)| (m * size) as f64 / t.as_secs_f64().max(1e-12) / MIB)
            .fold(0.0, f64::max);
        // The reference copies one round's worth: enough for a bandwidth, however long -D is.
        let count = round.clamp(1, u32::MAX as u64) as u32;
        let reference = reference_bw(&session, ref_copy, size, nslots, count)?;
        let row = BwRow {
            bytes: size,
            iterations: per_qp,
            bw_peak_mib_s: peak,
            bw_avg_mib_s: avg,
            msg_rate_mpps: messages as f64 / total.as_secs_f64().max(1e-12) / 1e6,
            ref_bw_mib_s: reference,
            bw_vs_ref: avg / reference.max(1e-12),
        };
        if !cli.common.json {
            gdaki_examples::outln!("{}", row.line(gbits));
        }
        rows.push(row);
    }
    let count = match plan.duration {
        Some(_) => "one round's message count",
        None => "message count",
    };
    let reference = Reference {
        what: format!("{}, same size, {count} and buffer slots", ref_copy.describe()),
    };
    let results = ClientResults { rows, reference };
    session.from_client(&serde_json::to_vec(&results)?)?;
    let ClientResults { rows, reference } = results;
    if cli.common.json {
        let params = params(&cli, &plan, &session, launch.as_ref());
        let out = JsonReport {
            test: "put_bw",
            version: env!("CARGO_PKG_VERSION"),
            params,
            reference,
            results: rows.clone(),
            validation: "ok",
        };
        gdaki_examples::outln!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        report::print_rule();
        let rung = match &proxy {
            Some(p) => Some(p.counters()),
            None => qps.iter().find_map(|(_, q)| q.fallback_proxy_counters()),
        };
        if let Some(c) = rung {
            gdaki_examples::outln!(" Proxy: {} doorbells rung in {} batches", c.doorbells, c.batches);
        }
        // Device memory moves through the soft HCA's GPU copier: how it batched and waited.
        if let Some(c) = session.gpu.as_ref().and_then(gdaki_soft::copier::Copier::existing) {
            let s = c.stats();
            gdaki_examples::outln!(
                " GPU copier: {} copies in {} descriptors ({:.1} per descriptor), ring full at {:.1}% of posts; \
                 copies onto bytes still being written: {} ordered on the GPU, {} waited for",
                s.copies,
                s.posted,
                s.copies as f64 / s.posted.max(1) as f64,
                100.0 * s.ring_full as f64 / s.posted.max(1) as f64,
                s.ordered,
                s.overlap_waits
            );
        }
        gdaki_examples::outln!(" Ref: {}", reference.what);
        gdaki_examples::outln!(" Validation: every size's data arrived intact");
    }
    if let Some(file) = plot_file {
        write_plot(file, &cli, &session, &rows)?;
    }
    Ok(())
}

fn connect(qps: &[(CompletionQueue, QueuePair)], peers: &[gdaki::Endpoint]) -> anyhow::Result<()> {
    if peers.len() != qps.len() {
        bail!("the peer offered {} QPs, {} needed", peers.len(), qps.len());
    }
    for ((_, q), e) in qps.iter().zip(peers) {
        q.connect(e)?;
    }
    Ok(())
}

/// The first barrier step of `--send` rounds: three per round (receivers started, sent,
/// received), counted alike on both sides across sizes, above the sizes' own steps.
const ROUND_STEPS: u64 = 1 << 32;

/// What a size's messages carry, one slot after another. SENDs land in whichever receive is
/// next, not in the slot they came from, so for `--send` every slot holds the same message and
/// each slot of the receiving buffer is checked against it.
fn stream_data(op: StreamOp, size: u64, slots: u64) -> Vec<u8> {
    match op {
        StreamOp::Send => pattern_bytes(size, 0, size as usize).repeat(slots as usize),
        StreamOp::Write | StreamOp::Read => pattern_bytes(size, 0, (slots * size) as usize),
    }
}

/// Messages each QP sends in one round of a size (`first_round`: with the warm-up): what the
/// receivers of a `--send` round take.
fn round_messages(launch: Option<DataPathLaunch>, qps: u32, iters: u32, slots: u64, first_round: bool) -> u64 {
    match launch {
        Some(l) => {
            let c = GpuCounts::new(l, iters, qps);
            c.per_qp() + if first_round { c.warm_up_per_qp() } else { 0 }
        }
        // `cpu_windows` warms every slot up in each round.
        None => slots + iters as u64,
    }
}

/// A round's message count as the client announces it to the server (0: no more rounds).
fn round_count(bytes: &[u8]) -> anyhow::Result<u64> {
    match <[u8; 8]>::try_from(bytes) {
        Ok(b) => Ok(u64::from_le_bytes(b)),
        Err(_) => bail!("the client's round is unreadable ({} bytes, 8 expected)", bytes.len()),
    }
}

/// The receiving side of one `--send` round: one CPU thread per QP takes `count` messages of
/// `size` bytes into the slots of `buf` (`gdaki_device::perf::recv_stream`, `depth` receives
/// posted ahead) while `during` runs on this thread (the senders, or a server's wait for its
/// client). Returns what `during` returned, and whether every QP took `count` messages of
/// `size` bytes.
fn receive_round<T>(
    qps: &[(CompletionQueue, QueuePair)],
    buf: &MemoryRegion,
    size: u64,
    slots: u64,
    count: u64,
    depth: u32,
    during: impl FnOnce() -> anyhow::Result<T>,
) -> (anyhow::Result<T>, anyhow::Result<()>) {
    let Ok(len) = u32::try_from(size) else {
        return (
            Err(anyhow::anyhow!("{size}-byte receives: one receive takes at most 4 GiB")),
            Ok(()),
        );
    };
    std::thread::scope(|s| {
        let takers: Vec<_> = qps
            .iter()
            .map(|(_, q)| {
                s.spawn(move || -> Result<u64, String> {
                    // SAFETY: this thread is the receive queue's only user (exclusive mode),
                    // and the QP outlives the scope.
                    let rq = unsafe { q.cpu_receive::<Exclusive>() }.map_err(|e| e.to_string())?;
                    gdaki_device::perf::recv_stream(rq, buf.local(0), len, slots, count, depth as u64)
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        let out = during();
        let mut verdict = Ok(());
        for (i, t) in takers.into_iter().enumerate() {
            let took = match t.join() {
                Err(_) => Err(anyhow::anyhow!("QP {i}'s receiving thread panicked")),
                Ok(Err(e)) => Err(anyhow::anyhow!("QP {i}'s receives: {e}")),
                Ok(Ok(bytes)) if bytes != count * size => Err(anyhow::anyhow!(
                    "QP {i}'s {count} receives took {bytes} bytes, {} expected ({size} per message)",
                    count * size
                )),
                Ok(Ok(_)) => Ok(()),
            };
            if verdict.is_ok() {
                verdict = took;
            }
        }
        (out, verdict)
    })
}

/// Timed GPU windows: (GPU time, messages over all QPs) each, and messages per QP in all.
/// Message numbers continue across windows, so every slot gets written.
#[allow(clippy::too_many_arguments)] // the run's parameters, each a scalar
fn gpu_windows(
    gpu: &gdaki::cuda::Gpu,
    handles: &[&gdaki::GpuQp],
    launch: DataPathLaunch,
    dst: Remote,
    src: Local,
    size: u64,
    slots: u64,
    iters: u32,
    qps: u32,
    warm_up: bool,
    op: StreamOp,
) -> anyhow::Result<(Vec<(Duration, u64)>, u64)> {
    let counts = GpuCounts::new(launch, iters, qps);
    let GpuCounts {
        threads,
        windows,
        per_window,
        ..
    } = counts;
    let check = |run: gdaki::cuda::KernelRun| -> anyhow::Result<Duration> {
        if let Some((t, code)) = run.first_failure() {
            bail!("GPU thread {t}: {}", Code(code));
        }
        Ok(run.elapsed)
    };
    let stream = |first: u64, iters: u32| gdaki::cuda::PutStream {
        dst,
        src,
        len: size,
        slots,
        first,
        iters,
        threads_per_qp: 0,
        op,
    };
    if warm_up {
        // One message per thread (module load, first touches of the rings): what
        // `GpuCounts::warm_up_per_qp` counts.
        check(gpu.run_put(handles, launch, &stream(0, 1))?)?;
    }
    let mut out = Vec::new();
    for w in 0..windows {
        let first = w * per_window as u64 * threads;
        let t = check(gpu.run_put(handles, launch, &stream(first, per_window))?)?;
        out.push((t, per_window as u64 * threads));
    }
    Ok((out, counts.per_qp()))
}

/// How a GPU round of `-n` messages per QP is cut: every thread posts the same number of
/// messages, in `windows` launches of `per_window` each, so `-n` rounds up to whole messages
/// per thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GpuCounts {
    threads: u64,
    qps: u64,
    windows: u64,
    per_window: u32,
}

impl GpuCounts {
    fn new(launch: DataPathLaunch, iters: u32, qps: u32) -> GpuCounts {
        let threads = launch.grid as u64 * launch.block as u64;
        let per_thread = (iters as u64 * qps as u64).div_ceil(threads).max(1);
        let windows = (WINDOWS as u64).min(per_thread);
        GpuCounts {
            threads,
            qps: qps.max(1) as u64,
            windows,
            per_window: per_thread.div_ceil(windows) as u32,
        }
    }

    /// Messages per QP of the warm-up launch (one per thread).
    fn warm_up_per_qp(&self) -> u64 {
        self.threads / self.qps
    }

    fn per_thread(&self) -> u64 {
        self.windows * self.per_window as u64
    }

    /// Messages per QP in a round: what runs for `-n`.
    fn per_qp(&self) -> u64 {
        self.per_thread() * self.threads / self.qps
    }
}

/// Timed CPU windows: one thread per QP, released together; (wall time, messages) each, and
/// messages per QP in all. Each posting thread takes its own clock readings, around its own
/// posts, and a window runs from the first thread's start to the last one's end: a thread that
/// is descheduled (the releasing one, or a poster before its first post) cannot shorten it.
/// `stall` runs on the releasing thread right after each release (tests use it to model that
/// thread being descheduled).
#[allow(clippy::too_many_arguments)] // the run's parameters, each a scalar
fn cpu_windows(
    qps: &[(CompletionQueue, QueuePair)],
    dst: Remote,
    src: Local,
    size: u64,
    slots: u64,
    iters: u32,
    op: StreamOp,
    stall: &(dyn Fn() + Sync),
) -> anyhow::Result<(Vec<(Duration, u64)>, u64)> {
    let (windows, in_window) = split_windows(iters);
    let first_of = |w: u32| (0..w).map(in_window).map(u64::from).sum::<u64>();
    let barrier = Barrier::new(qps.len() + 1);
    type Stamps = Vec<Option<(Instant, Instant)>>;
    let mut out = Vec::new();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let workers: Vec<_> = qps
            .iter()
            .map(|(_, q)| {
                let barrier = &barrier;
                s.spawn(move || -> Result<Stamps, String> {
                    // SAFETY: each QP has exactly one posting thread (this one), in exclusive
                    // mode, and the QP outlives the scope.
                    let dev = unsafe { q.cpu::<Exclusive>() }.map_err(|e| e.to_string())?;
                    // Warm-up, untimed: every slot once (first touches of the pages; what
                    // `round_messages` counts).
                    let mut result = gdaki_device::perf::put_stream(dev, dst, src, size, slots, 0, 1, slots as u32, op)
                        .map_err(|e| e.to_string());
                    let mut stamps = Vec::new();
                    for w in 0..windows {
                        barrier.wait();
                        if result.is_ok() {
                            // Messages continue across windows, so every slot gets written.
                            let started = Instant::now();
                            result = gdaki_device::perf::put_stream(
                                dev,
                                dst,
                                src,
                                size,
                                slots,
                                first_of(w),
                                1,
                                in_window(w),
                                op,
                            )
                            .map_err(|e| e.to_string());
                            stamps.push(Some((started, Instant::now())));
                        } else {
                            stamps.push(None);
                        }
                        barrier.wait();
                    }
                    result.map(|()| stamps)
                })
            })
            .collect();
        for _ in 0..windows {
            barrier.wait();
            stall();
            barrier.wait();
        }
        let mut all = Vec::new();
        for (i, w) in workers.into_iter().enumerate() {
            all.push(
                w.join()
                    .map_err(|_| anyhow::anyhow!("posting thread {i} panicked"))?
                    .map_err(|e| anyhow::anyhow!("QP {i}: {e}"))?,
            );
        }
        for w in 0..windows as usize {
            let spans = all.iter().filter_map(|stamps| stamps[w]);
            let first = spans.clone().map(|(a, _)| a).min();
            let last = spans.map(|(_, b)| b).max();
            let took = match (first, last) {
                (Some(a), Some(b)) => b.duration_since(a),
                _ => bail!("window {w} has no posting thread's times"),
            };
            out.push((took, in_window(w as u32) as u64 * qps.len() as u64));
        }
        Ok(())
    })?;
    Ok((out, iters as u64))
}

/// What put_bw's bandwidth is read against: a copy of the same size and count through the
/// same buffer slots, made by what would otherwise move the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RefCopy {
    /// CPU mode: memcpy by one CPU thread.
    Memcpy,
    /// A device-to-device copy on the posting GPU.
    Device,
    /// The peer's buffers are on another GPU this one reaches: a P2P copy between the two
    /// GPUs, to the peer's for WRITEs and SENDs, from it for READs.
    Peer {
        uuid: gdaki::cuda::GpuUuid,
        mine: usize,
        theirs: usize,
        direction: PeerDirection,
    },
}

impl RefCopy {
    /// The reference of a run on `session` whose peer said `peer` in its hello.
    fn of(session: &Session, peer: Option<&Hello>, read: bool) -> RefCopy {
        let Some(gpu) = &session.gpu else {
            return RefCopy::Memcpy;
        };
        let theirs = peer.and_then(Symmetric::buffers_gpu_of);
        match (session.peer_path(theirs), theirs) {
            (PeerPath::Peer(ordinal), Some(uuid)) => RefCopy::Peer {
                uuid,
                mine: gpu.context().ordinal(),
                theirs: ordinal,
                direction: if read {
                    PeerDirection::FromPeer
                } else {
                    PeerDirection::ToPeer
                },
            },
            _ => RefCopy::Device,
        }
    }

    /// What the reference line says it is.
    fn describe(self) -> String {
        match self {
            RefCopy::Memcpy => "memcpy by one CPU thread".into(),
            RefCopy::Device => "device-to-device copy (cuMemcpyDtoDAsync) on the same GPU".into(),
            RefCopy::Peer {
                mine,
                theirs,
                direction,
                ..
            } => {
                let (from, to) = match direction {
                    PeerDirection::ToPeer => (mine, theirs),
                    PeerDirection::FromPeer => (theirs, mine),
                };
                format!("P2P copy (cuMemcpyPeerAsync, peer access enabled) from GPU {from} to GPU {to}")
            }
        }
    }
}

/// `iters` messages per QP in [`WINDOWS`] timed windows (fewer for fewer messages): how many
/// windows, and the messages of window `w`. Exactly `iters` in all: the windows differ by at
/// most one message.
fn split_windows(iters: u32) -> (u32, impl Fn(u32) -> u32 + Copy) {
    let windows = WINDOWS.min(iters).max(1);
    (windows, move |w: u32| iters / windows + u32::from(w < iters % windows))
}

/// Work requests a stream's doorbell covers (at most a quarter of the send queue, so the CPU
/// writes the next batches while the HCA works on the first).
const STREAM_BATCH: u64 = 16;

/// `--stream`: one stream per QP (CUDA, or a CPU thread's), as [`cpu_windows`] posts: every
/// slot once untimed, then `iters` messages per QP in [`WINDOWS`] windows. The CPU writes the
/// WQEs ahead in batches of [`STREAM_BATCH`], one doorbell each, as far as the send queues
/// allow; each stream waits for its window's last completion and marks the time. A window's
/// time is its slowest QP's.
#[allow(clippy::too_many_arguments)]
fn stream_windows(
    gpu: Option<&gdaki::cuda::Gpu>,
    qps: &[(CompletionQueue, QueuePair)],
    exported: &[gdaki::GpuQp],
    dst: Remote,
    src: Local,
    size: u64,
    slots: u64,
    iters: u32,
    op: StreamOp,
    timeout: Duration,
) -> anyhow::Result<(Vec<(Duration, u64)>, u64)> {
    let (windows, in_window) = split_windows(iters);
    let bound = timeout.max(Duration::from_secs(1)) * 4;
    let mut sides = Vec::new();
    for (k, (_, q)) in qps.iter().enumerate() {
        let ex = gdaki_examples::stream::Executor::new(gpu, bound)?;
        // SAFETY: no kernel posts with --stream and no CPU view is made: the stream queue pair
        // is the QP's only poster, and it lives only in this call, which waits for every
        // stream's work (`finish`) before it returns; the QPs outlive the call. (An error
        // return leaves a stream's work behind: the program then exits.)
        let sq = unsafe { StreamQp::new(q, gpu.and(exported.get(k))) }?;
        sides.push((sq, ex));
    }
    let len = u32::try_from(size).context("one WQE carries at most 4 GiB")?;
    let request = |m: u64| {
        let at = (m % slots) * size;
        let (remote, local) = (
            Remote {
                addr: dst.addr + at,
                ..dst
            },
            Local {
                addr: src.addr + at,
                ..src
            },
        );
        match op {
            StreamOp::Write => WorkRequest::Put {
                dst: remote,
                src: local,
                len,
            },
            StreamOp::Read => WorkRequest::Get {
                dst: local,
                src: remote,
                len,
            },
            StreamOp::Send => WorkRequest::Send { src: local, len },
        }
    };
    // Messages `from..to` of every QP, batch by batch across the QPs, then each stream waits
    // for its last and marks.
    let step = sides
        .iter()
        .map(|(sq, _)| (sq.ring() / 4).max(1))
        .min()
        .unwrap_or(1)
        .min(STREAM_BATCH);
    let post = |sides: &mut Vec<(StreamQp<'_>, gdaki_examples::stream::Executor)>, from: u64, to: u64| {
        let mut last = vec![None; sides.len()];
        let mut m = from;
        while m < to {
            let batch = step.min(to - m);
            for (k, (sq, ex)) in sides.iter_mut().enumerate() {
                let wrs: Vec<_> = (m..m + batch).map(request).collect();
                let started = Instant::now();
                let tickets = loop {
                    match sq.post(ex.ops(), &wrs) {
                        Ok(t) => break t,
                        // The stream is a send queue behind: let it catch up.
                        Err(StreamError::WindowFull { .. }) if started.elapsed() < bound => {
                            std::thread::sleep(Duration::from_micros(20))
                        }
                        Err(e) => bail!("QP {k}, message {m}: {e}"),
                    }
                };
                last[k] = Some(tickets.end - 1);
            }
            m += batch;
        }
        for ((sq, ex), t) in sides.iter_mut().zip(last) {
            if let Some(t) = t {
                sq.wait(ex.ops(), t)?;
            }
            ex.mark()?;
        }
        anyhow::Ok(())
    };
    // Warm-up, untimed: every slot once; its end is the first mark.
    post(&mut sides, 0, slots)?;
    let mut first = slots;
    for w in 0..windows {
        let n = u64::from(in_window(w));
        post(&mut sides, first, first + n)?;
        first += n;
    }
    let mut took = vec![Duration::ZERO; windows as usize];
    for (k, (_, ex)) in sides.iter_mut().enumerate() {
        let marks = ex.finish(bound).with_context(|| format!("QP {k}'s stream"))?;
        if marks.len() != windows as usize + 1 {
            bail!("QP {k}'s stream left {} marks, {} expected", marks.len(), windows + 1);
        }
        for (w, t) in marks.windows(2).enumerate() {
            took[w] = took[w].max(Duration::from_nanos(t[1].saturating_sub(t[0])));
        }
    }
    let out = took
        .into_iter()
        .enumerate()
        .map(|(w, t)| (t, u64::from(in_window(w as u32)) * qps.len() as u64))
        .collect();
    Ok((out, iters as u64))
}

/// The reference bandwidth (MiB/s) for `count` messages of `size` bytes through the same slots
/// the puts cycle through (so both see the same caches), copied as `how` says.
fn reference_bw(session: &Session, how: RefCopy, size: u64, slots: u64, count: u32) -> anyhow::Result<f64> {
    let elapsed = match (&session.gpu, how) {
        (Some(gpu), RefCopy::Peer { uuid, direction, .. }) => {
            gpu.peer_copy(&uuid, direction, size as usize, slots as usize, count)?
        }
        (Some(gpu), _) => gpu.device_copy(size as usize, slots as usize, count)?,
        (None, _) => {
            let n = (size * slots) as usize;
            let (a, mut b) = (vec![1u8; n], vec![0u8; n]);
            b.copy_from_slice(&a); // first touches, untimed
            let started = Instant::now();
            for m in 0..count as u64 {
                let at = ((m % slots) * size) as usize;
                b[at..at + size as usize].copy_from_slice(&a[at..at + size as usize]);
                std::hint::black_box(&mut b);
            }
            started.elapsed()
        }
    };
    Ok((size * count as u64) as f64 / elapsed.as_secs_f64().max(1e-12) / MIB)
}

fn header_lines(
    cli: &Cli,
    plan: &gdaki_examples::cli::Plan,
    session: &Session,
    launch: Option<&DataPathLaunch>,
    qps: &[(CompletionQueue, QueuePair)],
    my_region: Option<RemoteRegion>,
    peer: Option<&Hello>,
) -> Vec<(&'static str, String)> {
    let p = params(cli, plan, session, launch);
    let mut v = session.header_lines(plan);
    if cli.stream {
        v.push((
            "Poster",
            format!(
                "one stream per QP, no kernel: the CPU writes WQEs ahead, the stream rings each batch of up to \
                 {STREAM_BATCH} and waits for each window's last completion"
            ),
        ));
    }
    v.extend([
        ("Scope", format!("{:?}", p.scope).to_lowercase()),
        ("Number of qps", p.qps.to_string()),
        ("Memory", p.memory.into()),
    ]);
    if let Some(depth) = p.rx_depth {
        let who = match plan.role {
            Role::Client(_) => "the server's",
            _ => "this process's",
        };
        v.push((
            "RX depth",
            format!("{depth} receives per QP, posted by {who} CPU threads (one per QP)"),
        ));
    }
    v.extend([
        ("Iterations", iterations_line(plan.iters, p.duration_s, launch, cli.qps)),
        (
            "Sizes",
            match plan.sizes.as_slice() {
                [one] => one.to_string(),
                s => format!("{} .. {} ({} sizes)", s[0], s[s.len() - 1], s.len()),
            },
        ),
    ]);
    if let Some(l) = launch {
        v.push((
            "GPU launch",
            format!(
                "{} blocks x {} threads, {} sharing",
                l.grid,
                l.block,
                p.sharing.unwrap_or_default()
            ),
        ));
    }
    let path = session.peer_path(peer.and_then(Symmetric::buffers_gpu_of));
    if peer.is_some() && path != PeerPath::NotBothGpu {
        v.push(("Peer buffers", path.describe()));
    }
    let mine: Vec<gdaki::Endpoint> = qps.iter().map(|(_, q)| q.endpoint()).collect();
    v.extend(gdaki_examples::session::address_lines(&mine, my_region, peer));
    v
}

/// What runs per size (`-n` messages per QP, or rounds of them for `-D` seconds), and why it
/// differs from `-n` where it does.
fn iterations_line(asked: u32, duration_s: Option<u64>, launch: Option<&DataPathLaunch>, qps: u32) -> String {
    let counts = launch.map(|l| GpuCounts::new(*l, asked, qps));
    let runs = counts.map_or(asked as u64, |c| c.per_qp());
    let mut t = match duration_s {
        Some(d) => format!("for {d} s per size (-D), in rounds of {runs} per QP"),
        None => format!("{runs} per QP per size"),
    };
    if let Some(c) = counts.filter(|_| runs != asked as u64) {
        t.push_str(&format!(
            " (-n {asked} rounded up: each of the {} GPU threads posts {})",
            c.threads,
            c.per_thread()
        ));
    }
    t
}

fn params(cli: &Cli, plan: &gdaki_examples::cli::Plan, session: &Session, launch: Option<&DataPathLaunch>) -> Params {
    Params {
        role: plan.role.name(),
        op: cli.op(),
        rx_depth: cli.send.then_some(cli.rx_depth),
        poster: if cli.stream { "stream" } else { "kernel" },
        provider: session.ctx.provider().to_string(),
        device: session.ctx.device_name(),
        mode: if session.gpu.is_some() { "gpu" } else { "cpu" },
        gpu: session.gpu_label(cli.common.gpu),
        scope: plan.scope,
        handler: plan.handler_name(),
        reliable_doorbell: plan.reliable_doorbell,
        collapsed_cq: plan.collapsed_cq,
        rings: session.rings_name(),
        qps: cli.qps,
        tx_depth: plan.tx_depth,
        memory: match (&plan.role, &session.gpu) {
            (Role::Server(_), None) => "host",
            _ => plan.mem.describe(),
        },
        blocks: launch.map(|l| l.grid),
        threads_per_block: launch.map(|l| l.block),
        sharing: launch.map(|l| format!("{:?}", l.mode).to_lowercase()),
        iterations: match launch {
            Some(l) => GpuCounts::new(*l, plan.iters, cli.qps).per_qp(),
            None => plan.iters as u64,
        },
        iterations_asked: plan.iters,
        duration_s: plan.duration.map(|d| d.as_secs()),
        sizes: plan.sizes.clone(),
        // The JSON values' unit (their keys say it too); --report-gbits changes the table only.
        bw_unit: "MiB/s",
    }
}

/// `--plot`: bandwidth (average and peak) and message rate against size on log axes, each next
/// to its reference, and put_bw as a share of the reference; a one-size run as a table.
fn write_plot(file: PlotFile, cli: &Cli, session: &Session, rows: &[BwRow]) -> anyhow::Result<()> {
    let who = match &session.gpu {
        Some(g) => g.context().name().unwrap_or_else(|_| "GPU".into()),
        None => "CPU mode".into(),
    };
    let ref_name = if session.gpu.is_some() { "device copy" } else { "memcpy" };
    let title = format!("put_bw, {} QP(s), {:?} scope, {who}", cli.qps, cli.common.scope).to_lowercase();
    let doc = if rows.len() < 2 {
        let head = [
            "#bytes",
            "BW peak [MiB/s]",
            "BW average [MiB/s]",
            "msg rate [Mpps]",
            "ref [MiB/s]",
            "BW / ref",
        ];
        let cells: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                vec![
                    r.bytes.to_string(),
                    format!("{:.2}", r.bw_peak_mib_s),
                    format!("{:.2}", r.bw_avg_mib_s),
                    format!("{:.6}", r.msg_rate_mpps),
                    format!("{:.2}", r.ref_bw_mib_s),
                    format!("{:.1}%", 100.0 * r.bw_vs_ref),
                ]
            })
            .collect();
        plot::table(&format!("{title} ({ref_name} as reference)"), &head, &cells)
    } else {
        let at = |f: &dyn Fn(&BwRow) -> f64| rows.iter().map(|r| (r.bytes as f64, f(r))).collect::<Vec<_>>();
        let line = |name, color, dashed, points| Series {
            name,
            color,
            dashed,
            points,
        };
        let (blue, orange) = ("#1f77b4", "#ff7f0e");
        plot::svg(
            &title,
            "message size [bytes]",
            &[
                Panel {
                    y_label: "bandwidth [MiB/s]",
                    scale: Scale::Log,
                    series: vec![
                        line("put_bw average", blue, false, at(&|r| r.bw_avg_mib_s)),
                        line("put_bw peak", blue, true, at(&|r| r.bw_peak_mib_s)),
                        line(ref_name, orange, false, at(&|r| r.ref_bw_mib_s)),
                    ],
                },
                Panel {
                    y_label: "message rate [Mpps]",
                    scale: Scale::Log,
                    series: vec![
                        line("put_bw", blue, false, at(&|r| r.msg_rate_mpps)),
                        line(
                            ref_name,
                            orange,
                            false,
                            at(&|r| r.ref_bw_mib_s * MIB / r.bytes as f64 / 1e6),
                        ),
                    ],
                },
                Panel {
                    y_label: "put_bw / reference [%]",
                    scale: Scale::Linear,
                    series: vec![line("average", blue, false, at(&|r| 100.0 * r.bw_vs_ref))],
                },
            ],
        )
    };
    let path = file.path().display().to_string();
    file.write(&doc)?;
    eprintln!("put_bw: plot written to {path}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gdaki::{Access, Context, Provider};

    /// GPU mode runs whole messages per thread: `-n 5000` on 512 threads runs 6144 per QP, and
    /// the header says so (it once said 5000).
    #[test]
    fn the_header_says_what_gpu_mode_runs_for_n() {
        let launch = DataPathLaunch {
            scope: gdaki::cuda::KernelScope::Thread,
            mode: KernelMode::Cta,
            grid: 2,
            block: 256,
        };
        let c = GpuCounts::new(launch, 5000, 1);
        assert_eq!((c.per_thread(), c.per_qp()), (12, 6144));
        assert_eq!(
            iterations_line(5000, None, Some(&launch), 1),
            "6144 per QP per size (-n 5000 rounded up: each of the 512 GPU threads posts 12)"
        );
        // Exact where the count divides: 2 QPs x 512 = 1024 messages, 2 per thread.
        assert_eq!(iterations_line(512, None, Some(&launch), 2), "512 per QP per size");
        assert_eq!(iterations_line(1001, None, None, 1), "1001 per QP per size");
        assert_eq!(
            iterations_line(40, Some(3), None, 1),
            "for 3 s per size (-D), in rounds of 40 per QP"
        );
    }

    /// A window's time covers all of its posting, however the threads are scheduled: the
    /// thread that releases the posters being descheduled right after the release (modelled
    /// by a stall) once shortened the window to nothing, and put_bw printed peaks of 380 GB/s
    /// in CPU mode.
    #[test]
    fn a_descheduled_releasing_thread_does_not_shorten_a_window() {
        let ctx = Context::open(Provider::Soft).unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = ctx
            .create_qp(
                &cq,
                QpConfig {
                    sq_size: 64,
                    ..Default::default()
                },
            )
            .unwrap();
        qp.connect(&qp.endpoint()).unwrap();
        const SIZE: u64 = 4 << 20;
        let (src, dst) = (
            ctx.alloc_region(2 * SIZE as usize, Access::ALL).unwrap(),
            ctx.alloc_region(2 * SIZE as usize, Access::ALL).unwrap(),
        );
        let qps = [(cq, qp)];
        let stall = || std::thread::sleep(Duration::from_millis(300));
        let (windows, _) =
            cpu_windows(&qps, dst.remote(0), src.local(0), SIZE, 2, 16, StreamOp::Write, &stall).unwrap();
        for (t, messages) in windows {
            // No host copies 4 MiB messages at 200 GB/s on one thread.
            let gb_s = (messages * SIZE) as f64 / t.as_secs_f64().max(1e-12) / 1e9;
            assert!(gb_s < 200.0, "{messages} messages of 4 MiB in {t:?}: {gb_s:.0} GB/s");
        }
    }
}
