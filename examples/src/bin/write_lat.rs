//! `write_lat`: RDMA WRITE ping-pong latency, both sides polling for the peer's message in a
//! GPU kernel (or, in CPU mode, a CPU thread running the same device code), timed with the
//! GPU's global timer, in perftest `ib_write_lat`'s format (one-way = half the round trip),
//! next to references measured in the same run: the GPU <-> CPU round trip through host-pinned
//! memory and a synchronised 8-byte copy (CPU mode: a thread-to-thread round trip).
//!
//! `write_lat [-s SIZE | -a] [-n ITERS] [--send] [--json]` loops back in one process;
//! `write_lat --server` and `write_lat SERVER` run across two. `--send` ping-pongs SENDs taken by
//! receives instead, as perftest's `ib_send_lat` (one tool per pattern, the verb a flag, as
//! `put_bw --read` is `ib_read_bw`: the same sides, timers and references, so the two verbs
//! compare like with like).
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{bail, Context as _};
use clap::Parser;
use gdaki::cuda::WriteLatSide;
use gdaki::handshake::Hello;
use gdaki::stream::{Store, StreamError, StreamQp, WorkRequest};
use gdaki::{CompletionQueue, MemoryRegion, QpConfig, QueuePair, ReceiveConfig};
use gdaki_device::qp::{MAX_INLINE, MAX_SEND_INLINE};
use gdaki_device::status::Code;
use gdaki_device::{Exclusive, RecvBuf};
use gdaki_examples::cli::{Common, Plan, Role};
use gdaki_examples::report::{self, JsonReport, LatRow};
use gdaki_examples::session::{check_bytes, pattern_bytes, Session, Symmetric};
use gdaki_examples::stream::Executor;
use gdaki_layout::perf::PingPongSide;
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(
    name = "write_lat",
    version,
    about = "RDMA WRITE ping-pong latency, polled by GPU kernels (or CPU threads) through gdaki"
)]
struct Cli {
    #[command(flatten)]
    common: Common,
    /// SENDs taken by posted receives instead of RDMA WRITEs (perftest's `ib_send_lat`): each
    /// side waits for its next receive's completion instead of polling the message's last byte.
    #[arg(long)]
    send: bool,
    /// Post from a stream instead of a kernel (GPUDirect Async): the CPU writes the WQEs ahead,
    /// and each side's stream (a CUDA stream in GPU mode, a CPU thread's stream in CPU mode)
    /// stores the message's flag, rings the doorbell and waits for the peer's flag in order,
    /// timed by events on the streams (docs/stream.md).
    #[arg(long)]
    stream: bool,
    /// Messages of at most this many bytes travel inline in their WQE, as perftest's `-I`: at
    /// most what one WQE carries, 28 bytes for a WRITE and 44 for a SEND (default 0: none;
    /// perftest's latency tests inline by default, but through the soft HCA an inline message
    /// measured slower except into another GPU's memory: docs/figures.md). Not with `--stream`,
    /// whose WQEs are written ahead from the buffers.
    #[arg(short = 'I', long = "inline-size", value_name = "BYTES")]
    inline_size: Option<u32>,
    /// Ring each message with a BlueFlame write of its WQE (the WQE's 64 bytes into the
    /// doorbell register, DOCA's `submit_bf`) instead of the 8-byte doorbell. Not with
    /// --cpu-proxy or --stream, which do not ring from the poster.
    #[arg(long)]
    blueflame: bool,
}

impl Cli {
    /// Messages of at most this many bytes travel inline (`-I`, checked against what one WQE
    /// carries; `--stream` posts none).
    fn inline_max(&self) -> anyhow::Result<u32> {
        let cap = if self.send { MAX_SEND_INLINE } else { MAX_INLINE } as u32;
        match (self.inline_size, self.stream) {
            (Some(n), true) if n > 0 => bail!("--inline-size {n}: --stream writes its WQEs ahead, from the buffers"),
            (_, true) => Ok(0),
            (Some(n), false) if n > cap => bail!(
                "--inline-size {n}: one WQE carries at most {cap} bytes inline for {}",
                if self.send { "a SEND" } else { "a WRITE" }
            ),
            (Some(n), false) => Ok(n),
            (None, false) => Ok(0),
        }
    }

    /// The test's name, in the handshake (both sides must run the same) and the progress.
    fn test(&self) -> &'static str {
        match (self.send, self.stream) {
            (true, true) => "write_lat --stream --send",
            (true, false) => "write_lat --send",
            (false, true) => "write_lat --stream",
            (false, false) => "write_lat",
        }
    }
}

/// One participant of the ping-pong in this process.
struct Side {
    _cq: CompletionQueue,
    qp: QueuePair,
    post: MemoryRegion,
    poll: MemoryRegion,
    initiator: bool,
}

#[derive(Debug, Serialize)]
struct Params {
    role: &'static str,
    /// `write` or `send` (`--send`).
    op: &'static str,
    /// `kernel` (or CPU threads in CPU mode) or `stream` (`--stream`).
    poster: &'static str,
    provider: String,
    mode: &'static str,
    gpu: Option<String>,
    handler: &'static str,
    /// `--reliable-doorbell`: the queue pairs have no doorbell record.
    reliable_doorbell: bool,
    /// `--collapsed-cq`: the send CQs have one entry.
    collapsed_cq: bool,
    /// Where the queues' rings are: `host` or `gpu`.
    rings: &'static str,
    memory: &'static str,
    /// Round trips per size (per round with `duration_s`).
    iterations: u32,
    /// `-D`: each size ran for this many seconds, in rounds of `iterations`.
    duration_s: Option<u64>,
    sizes: Vec<u64>,
    /// `-I`: messages of at most this many bytes went inline (0: none).
    inline_size: u32,
    /// `--blueflame`: each message was rung by a BlueFlame write of its WQE.
    blueflame: bool,
}

/// The references, in microseconds (medians).
#[derive(Debug, Default, Serialize)]
struct Reference {
    /// GPU thread <-> CPU thread flag round trip through host-pinned memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pinned_round_trip_us: Option<f64>,
    /// Synchronous 8-byte host-to-device copy.
    #[serde(skip_serializing_if = "Option::is_none")]
    synced_copy_8b_us: Option<f64>,
    /// CPU mode: thread <-> thread flag round trip through shared memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    thread_round_trip_us: Option<f64>,
    /// Why the reference cannot be trusted (then no ratio is printed against it).
    #[serde(skip_serializing_if = "Option::is_none")]
    doubt: Option<String>,
}

/// One size's result: perftest's statistics, and where a one-way went when both sides ran here.
#[derive(Debug, Serialize)]
struct Row {
    #[serde(flatten)]
    lat: LatRow,
    /// Loopback only (both sides' timestamps on one clock).
    #[serde(skip_serializing_if = "Option::is_none")]
    breakdown: Option<Breakdown>,
}

/// A one-way latency split in two (medians over both directions and every round).
#[derive(Debug, Serialize)]
struct Breakdown {
    /// From the stamp taken when the side may send (the peer's message seen) to the put's
    /// return: the WQE written, the fences and the doorbell, and on a GPU possibly the end of
    /// the wait before it (reads of the GPU's timer are not ordered against memory operations:
    /// docs/figures.md).
    post_us: f64,
    /// From the put's return to the peer seeing the message's flag: the HCA noticing the
    /// doorbell, moving the data, and the peer's poll.
    delivery_us: f64,
}

/// One side's timestamps of a ping-pong run (ns, one per round).
struct Stamps {
    /// Just before the side's put.
    sent: Vec<u64>,
    /// Once the put had returned.
    posted: Vec<u64>,
}

impl From<(Vec<u64>, Vec<u64>)> for Stamps {
    fn from((sent, posted): (Vec<u64>, Vec<u64>)) -> Self {
        Stamps { sent, posted }
    }
}

/// Post and delivery samples collected over the rounds of one size.
#[derive(Default)]
struct Split {
    post: Vec<u64>,
    delivery: Vec<u64>,
}

impl Split {
    /// Adds one run's samples, if both sides of the ping-pong ran in this process. The
    /// responder's send time is when it saw the initiator's flag (it sends at once), and the
    /// initiator's next send time is when it saw the answer.
    fn add(&mut self, sides: &[(Side, gdaki_device::Remote)], stamps: &[Stamps]) {
        let (Some(a), Some(b)) = (
            sides.iter().position(|(s, _)| s.initiator),
            sides.iter().position(|(s, _)| !s.initiator),
        ) else {
            return;
        };
        let (Some(a), Some(b)) = (stamps.get(a), stamps.get(b)) else {
            return;
        };
        for s in [a, b] {
            self.post
                .extend(s.sent.iter().zip(&s.posted).map(|(t, p)| p.saturating_sub(*t)));
        }
        self.delivery
            .extend(b.sent.iter().zip(&a.posted).map(|(seen, p)| seen.saturating_sub(*p)));
        self.delivery.extend(
            a.sent
                .iter()
                .skip(1)
                .zip(&b.posted)
                .map(|(seen, p)| seen.saturating_sub(*p)),
        );
    }

    fn medians(self) -> Option<Breakdown> {
        (!self.post.is_empty() && !self.delivery.is_empty()).then(|| Breakdown {
            post_us: median_us(self.post),
            delivery_us: median_us(self.delivery),
        })
    }
}

/// A thread <-> thread round trip through shared memory takes well under a microsecond on any
/// host; a median above this is a thread that waited for a core, not the memory.
const PLAUSIBLE_THREAD_ROUND_TRIP_US: f64 = 20.0;
/// Attempts at a plausible reference before it is flagged.
const REFERENCE_TRIES: u32 = 3;

/// Why a thread round trip median of `us` cannot be a reference, if it cannot.
fn thread_reference_doubt(us: f64) -> Option<String> {
    (!(us.is_finite() && us > 0.0 && us <= PLAUSIBLE_THREAD_ROUND_TRIP_US)).then(|| {
        format!(
            "the thread round trip took {us:.2} usec (median of the best of {REFERENCE_TRIES} tries), where shared \
             memory takes well under {PLAUSIBLE_THREAD_ROUND_TRIP_US} usec: its threads waited for cores"
        )
    })
}

/// What to say when this machine's cores cannot all spin at once: the engine and each posting
/// side spin, and so do the reference's two threads.
fn cores_note(spinning: usize) -> Option<String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores < spinning).then(|| {
        format!(
            "{cores} cores for {spinning} spinning threads (engine, posters, reference): latencies here \
             include waits for a core; measure on a machine with more cores ({}=0 makes the soft HCA's \
             engine give its core back at once, the default on 2 cores or fewer)",
            gdaki::ContextOptions::ENGINE_IDLE_SPIN_VAR
        )
    })
}

fn main() {
    gdaki_examples::init_tracing();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("write_lat: error: {}", gdaki_examples::error_text(&e));
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let inline_max = cli.inline_max()?;
    if cli.blueflame && (cli.stream || cli.common.cpu_proxy) {
        bail!(
            "--blueflame: the poster writes its WQE into the doorbell register, and with {} it does not ring",
            if cli.stream { "--stream" } else { "--cpu-proxy" }
        );
    }
    let mut plan = cli.common.plan(2, 1000, || gdaki::cuda::why_unusable(cli.common.gpu))?;
    eprintln!("write_lat: {}", plan.mode_line);
    if plan.gpu.is_some() && plan.mem == gdaki_examples::cli::Mem::Host {
        bail!("--mem host: in GPU mode the kernels poll their buffers, which must be pinned or device memory");
    }
    let mut session = Session::open(&cli.common, &plan)?;
    let symmetric = Symmetric::of(cli.test(), &plan, 1);
    let cfg = QpConfig {
        sq_size: plan.tx_depth,
        timeout: plan.timeout,
        retry_timeout: plan.timeout.mul_f64(0.8),
        handler: plan.handler(),
        reliable_doorbell: plan.reliable_doorbell,
        rings: session.rings.clone(),
        // A few receives are ever posted (the ping-pong keeps two ahead); a message that
        // found none would be tried again after 10 us.
        receive: cli.send.then_some(ReceiveConfig { size: 16, max_bufs: 1 }),
        min_rnr_timer: 1,
        ..Default::default()
    };
    // A stream stores and waits on whole 32-bit words: the flag's word may pass the message.
    let max = match *plan.sizes.last().context("no sizes")? as usize {
        m if cli.stream => m.next_multiple_of(4),
        m => m,
    };
    let side = |session: &Session, initiator| -> anyhow::Result<Side> {
        let cq = session.create_cq(&plan)?;
        let qp = session.ctx.create_qp(&cq, cfg.clone())?;
        Ok(Side {
            _cq: cq,
            qp,
            post: session.alloc(max)?,
            poll: session.alloc(max)?,
            initiator,
        })
    };
    // Each side: its own buffers and where its messages go (the peer's poll buffer).
    let mut sides: Vec<(Side, gdaki_device::Remote)> = Vec::new();
    // perftest's address lines: this side's QP and the one it writes to.
    let addresses = |me: &Side, peer: &Hello| {
        gdaki_examples::session::address_lines(&[me.qp.endpoint()], Some(me.poll.remote_region()), Some(peer))
    };
    let address_lines = match plan.role {
        Role::Loopback => {
            let (a, b) = (side(&session, true)?, side(&session, false)?);
            a.qp.connect(&b.qp.endpoint())?;
            b.qp.connect(&a.qp.endpoint())?;
            let b_hello = Hello {
                app: vec![],
                endpoints: vec![b.qp.endpoint()],
                regions: vec![b.poll.remote_region()],
            };
            let lines = addresses(&a, &b_hello);
            let (to_b, to_a) = (b.poll.remote(0), a.poll.remote(0));
            sides.push((a, to_b));
            sides.push((b, to_a));
            lines
        }
        Role::Server(_) | Role::Client(_) => {
            let me = side(&session, matches!(plan.role, Role::Client(_)))?;
            let hello = Hello {
                app: vec![],
                endpoints: vec![me.qp.endpoint()],
                regions: vec![me.poll.remote_region()],
            };
            let theirs = session.exchange(&symmetric, hello)?.context("no hello")?;
            let (Some(e), Some(r)) = (theirs.endpoints.first(), theirs.regions.first()) else {
                bail!("the peer offered no QP or no buffer");
            };
            if r.len < max as u64 {
                bail!("the peer's buffer is {} bytes, {max} needed", r.len);
            }
            me.qp.connect(e)?;
            let lines = addresses(&me, &theirs);
            sides.push((
                me,
                gdaki_device::Remote {
                    addr: r.addr,
                    rkey: r.rkey,
                },
            ));
            session.agree(1, Ok(()))?;
            lines
        }
    };
    if let Some(gpu) = session.gpu.as_ref().filter(|_| !cli.send) {
        // The kernels poll the last byte of the peer's put: only sound where the GPU orders
        // NIC writes for its own reads (docs/connectx-conformance.md).
        let ordering = gpu.rdma_writes_ordering()?;
        if !ordering.owner_sees_writes_in_order() {
            eprintln!(
                "write_lat: warning: this GPU's GPUDirect RDMA writes ordering is {ordering} (below owner): \
                 a polled last byte may be seen before the rest of the message"
            );
        }
    }
    let exported = match &session.gpu {
        Some(gpu) => sides
            .iter()
            .map(|(s, _)| s.qp.export_gpu(gpu))
            .collect::<Result<Vec<_>, _>>()?,
        None => vec![],
    };
    let _proxy = session.proxy(&mut plan, sides.iter().map(|(s, _)| &s.qp))?;
    let mut streams = match cli.stream {
        true => Some(StreamSides::new(&session, &sides, &exported, cli.send)?),
        false => None,
    };

    let reference = measure_reference(&session)?;
    let params = Params {
        role: plan.role.name(),
        op: if cli.send { "send" } else { "write" },
        poster: if cli.stream { "stream" } else { "kernel" },
        provider: session.ctx.provider().to_string(),
        mode: if session.gpu.is_some() { "gpu" } else { "cpu" },
        gpu: session.gpu_label(cli.common.gpu),
        handler: plan.handler_name(),
        reliable_doorbell: plan.reliable_doorbell,
        collapsed_cq: plan.collapsed_cq,
        rings: session.rings_name(),
        memory: plan.mem.describe(),
        iterations: plan.iters,
        duration_s: plan.duration.map(|d| d.as_secs()),
        sizes: plan.sizes.clone(),
        inline_size: inline_max,
        blueflame: cli.blueflame,
    };
    if !cli.common.json {
        print_header(&session, &plan, &params, &sides, address_lines, cli.send);
        gdaki_examples::outln!("{}", LatRow::header());
    }
    // One round of `iters` round trips as the device code runs them: on the GPU, or one CPU
    // thread per side.
    let kernel_round = |gpu: Option<&gdaki::cuda::Gpu>, size: u64, iters: u32| -> anyhow::Result<Vec<Stamps>> {
        let Some(gpu) = gpu else {
            return cpu_ping_pong(&sides, size, iters, cli.send, inline_max, cli.blueflame);
        };
        let dev: Vec<WriteLatSide> = sides
            .iter()
            .zip(&exported)
            .map(|((s, to), g)| WriteLatSide {
                qp: g,
                post: &s.post,
                poll: &s.poll,
                remote: *to,
                initiator: s.initiator,
                send: cli.send,
                inline_max,
                blueflame: cli.blueflame,
            })
            .collect();
        let run = gpu.run_write_lat(&dev, size, iters)?;
        if let Some((k, &c)) = run.status.iter().enumerate().find(|(_, c)| **c != 0) {
            bail!(
                "{} side: {}",
                if sides[k].0.initiator { "initiator" } else { "responder" },
                Code(c)
            );
        }
        Ok(run.times.into_iter().zip(run.posted).map(Stamps::from).collect())
    };
    // With --send, each side posts its first receives before the first round's barrier (a
    // round of no round trips: the ping-pong posts its receives ahead, then returns), so the
    // first SEND finds one, as in perftest; later rounds find those the last one left posted.
    if cli.send && streams.is_none() {
        if let Some(&size) = plan.sizes.first() {
            kernel_round(session.gpu.as_ref(), size, 0)?;
        }
    }
    let mut rows = Vec::new();
    // Barrier steps, the same sequence on both sides.
    let mut steps = 10u64..;
    let mut step = move || steps.next().unwrap_or(u64::MAX);
    for (i, &size) in plan.sizes.iter().enumerate() {
        report::progress(cli.test(), i, plan.sizes.len(), size);
        let payload = pattern_bytes(size, 0, size as usize - 1);
        let started = Instant::now();
        let (mut round_trips, mut rounds) = (Vec::new(), 0u64);
        let mut split = Split::default();
        loop {
            for (s, _) in &sides {
                let clear = match cli.stream {
                    true => (size as usize).next_multiple_of(4),
                    false => size as usize,
                };
                s.poll.write(0, &vec![0u8; clear])?;
                s.post.write(0, &payload)?;
            }
            session.agree(step(), Ok(()))?; // both sides ready
            let stamps = match &mut streams {
                Some(st) => st.ping_pong(&sides, size, plan.iters, plan.timeout)?,
                None => kernel_round(session.gpu.as_ref(), size, plan.iters)?,
            };
            session.agree(step(), Ok(()))?; // both sides done
                                            // Every side received the other's message and the last flag.
            let mut want = payload.clone();
            want.push((plan.iters as u8).to_le_bytes()[0]);
            let verdict = sides
                .iter()
                .try_for_each(|(s, _)| check_bytes(&s.poll, 0, &want, &format!("{size}-byte message")));
            session.agree(step(), verdict)?;
            let first = stamps.first().map(|s| s.sent.as_slice()).unwrap_or_default();
            round_trips.extend(first.windows(2).map(|w| w[1].saturating_sub(w[0])));
            split.add(&sides, &stamps);
            rounds += 1;
            let Some(d) = plan.duration else { break };
            // With -D the client (or this process, in loopback) says after each round whether
            // another follows; the server does what it is told, so both run the same rounds.
            let mine = started.elapsed() < d;
            let more = match session.from_client(&[mine as u8])? {
                Some(b) => match b.as_slice() {
                    [m @ (0 | 1)] => *m == 1,
                    _ => bail!("the client's round decision is unreadable ({} bytes)", b.len()),
                },
                None => mine,
            };
            if !more {
                break;
            }
        }
        let row = Row {
            lat: LatRow {
                iterations: rounds * plan.iters as u64,
                ..LatRow::from_round_trips(size, &round_trips)
            },
            breakdown: split.medians(),
        };
        if !cli.common.json {
            gdaki_examples::outln!("{}", row.lat.line());
        }
        rows.push(row);
    }
    if cli.common.json {
        let out = JsonReport {
            test: "write_lat",
            version: env!("CARGO_PKG_VERSION"),
            params,
            reference,
            results: rows,
            validation: "ok",
        };
        gdaki_examples::outln!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        report::print_rule();
        for r in &rows {
            if let Some(b) = &r.breakdown {
                gdaki_examples::outln!(
                    " Breakdown ({} B, medians): post {:.2} usec (the put call, with the end of the wait before it) + delivery {:.2} \
                     usec (doorbell to the peer seeing the flag)",
                    r.lat.bytes,
                    b.post_us,
                    b.delivery_us
                );
            }
        }
        let typical = rows.first().map(|r| r.lat.t_typical_us).unwrap_or(0.0);
        if let Some(rt) = reference.pinned_round_trip_us {
            gdaki_examples::outln!(" Ref: GPU <-> CPU round trip through host-pinned memory: {rt:.2} usec (median)");
            gdaki_examples::outln!(
                " Ref: synchronised 8-byte host-to-device copy: {:.2} usec (median)",
                reference.synced_copy_8b_us.unwrap_or(0.0)
            );
            gdaki_examples::outln!(
                " t_typical ({} B) / pinned round trip: {:.2}",
                plan.sizes[0],
                typical / rt.max(1e-9)
            );
        }
        if let Some(rt) = reference.thread_round_trip_us {
            gdaki_examples::outln!(
                " Ref: CPU thread <-> thread round trip through shared memory: {rt:.2} usec (median)"
            );
            match &reference.doubt {
                Some(why) => gdaki_examples::outln!(" Ref not trusted, no ratio: {why}"),
                None => gdaki_examples::outln!(
                    " t_typical ({} B) / thread round trip: {:.2}",
                    plan.sizes[0],
                    typical / rt.max(1e-9)
                ),
            }
        }
        gdaki_examples::outln!(" Validation: every size's messages arrived intact");
    }
    Ok(())
}

/// The side as the device code runs it, in CPU mode (`qp` 0: the caller passes its own view);
/// two-sided with `send`.
fn ping_pong_side(
    s: &Side,
    to: gdaki_device::Remote,
    qp: u64,
    send: bool,
    inline_max: u32,
    blueflame: bool,
) -> PingPongSide {
    PingPongSide {
        qp,
        post: s.post.addr(),
        poll: s.poll.addr(),
        remote: to.addr,
        lkey: s.post.lkey(),
        rkey: to.rkey,
        initiator: s.initiator as u32,
        poll_lkey: s.poll.lkey(),
        times: 0,
        posted: 0,
        rq: match s.qp.receive_handle() {
            Some(h) if send => h as u64,
            _ => 0,
        },
        recv_len: s.poll.len(),
        inline_max,
        flags: if blueflame {
            gdaki_layout::perf::PING_PONG_BLUEFLAME
        } else {
            0
        },
    }
}

/// CPU mode: one thread per side runs the device crate's ping-pong; returns each side's
/// timestamps.
fn cpu_ping_pong(
    sides: &[(Side, gdaki_device::Remote)],
    size: u64,
    iters: u32,
    send: bool,
    inline_max: u32,
    blueflame: bool,
) -> anyhow::Result<Vec<Stamps>> {
    std::thread::scope(|sc| {
        let workers: Vec<_> = sides
            .iter()
            .map(|(s, to)| {
                sc.spawn(move || -> Result<Stamps, String> {
                    let mut stamps = Stamps {
                        sent: vec![0u64; iters as usize],
                        posted: vec![0u64; iters as usize],
                    };
                    let mut side = ping_pong_side(s, *to, 0, send, inline_max, blueflame);
                    side.times = stamps.sent.as_mut_ptr() as u64;
                    side.posted = stamps.posted.as_mut_ptr() as u64;
                    // SAFETY: this thread is the QP's only poster (exclusive) and, two-sided,
                    // its receive queue's only user; the buffers are the side's regions (at
                    // least `size` bytes), and `sent` and `posted` hold `iters` each.
                    let r = unsafe {
                        let qp = s.qp.cpu::<Exclusive>().map_err(|e| e.to_string())?;
                        gdaki_device::perf::ping_pong(qp, &side, size, iters)
                    };
                    r.map(|()| stamps).map_err(|e| e.to_string())
                })
            })
            .collect();
        let mut all = Vec::new();
        for (k, w) in workers.into_iter().enumerate() {
            let t = w
                .join()
                .map_err(|_| anyhow::anyhow!("ping-pong thread panicked"))?
                .map_err(|e| {
                    anyhow::anyhow!(
                        "{} side: {e}",
                        if sides[k].0.initiator { "initiator" } else { "responder" }
                    )
                })?;
            all.push(t);
        }
        Ok(all)
    })
}

/// `--stream`: for each side, its stream queue pair, its executor of memory operations and,
/// with --send, its receive queue as the CPU posts to it.
struct StreamSides<'a> {
    sides: Vec<(StreamQp<'a>, Executor, Option<gdaki_device::Rq<Exclusive>>)>,
}

impl<'a> StreamSides<'a> {
    fn new(
        session: &Session,
        sides: &'a [(Side, gdaki_device::Remote)],
        exported: &'a [gdaki::GpuQp],
        send: bool,
    ) -> anyhow::Result<Self> {
        let mut out = Vec::new();
        for (k, (s, _)) in sides.iter().enumerate() {
            let executor = Executor::new(session.gpu.as_ref(), std::time::Duration::from_secs(30))?;
            let export = session.gpu.as_ref().and(exported.get(k));
            // SAFETY: the stream queue pair is the QP's only poster: no kernel runs with
            // --stream, and no CPU view is made. Each round waits for the streams' work
            // (`finish`), and the QPs outlive these values (an error return leaves a stream's
            // work behind: the program then exits).
            let sq = unsafe { StreamQp::new(&s.qp, export) }?;
            let rq = match send {
                // SAFETY: this thread is the QP's only receiver (no kernel runs with --stream);
                // the view lives no longer than `sides`.
                true => Some(unsafe { s.qp.cpu_receive::<Exclusive>() }?),
                false => None,
            };
            out.push((sq, executor, rq));
        }
        Ok(StreamSides { sides: out })
    }

    /// One round of `iters` round trips of `size`-byte messages, every side's work enqueued
    /// ahead (as far as the send queues allow), then waited for; each side's arrival times.
    fn ping_pong(
        &mut self,
        sides: &[(Side, gdaki_device::Remote)],
        size: u64,
        iters: u32,
        timeout: std::time::Duration,
    ) -> anyhow::Result<Vec<Stamps>> {
        let payload = pattern_bytes(size, 0, size as usize - 1);
        let bound = timeout.max(std::time::Duration::from_secs(1)) * 4;
        for i in 0..iters {
            let (at, word) = flag_word(&payload, (i + 1) as u8);
            for ((sq, ex, rq), (s, to)) in self.sides.iter_mut().zip(sides) {
                // With --send, the message arrives in a receive posted for it now.
                let receive = rq.as_ref().map(|rq| post_receive(rq, &s.poll, bound)).transpose()?;
                let arrival = |sq: &mut StreamQp<'_>, ex: &mut Executor| -> anyhow::Result<()> {
                    match receive {
                        Some(r) => sq.wait_recv(ex.ops(), r)?,
                        None => wait_flag(ex, &s.poll, at, word)?,
                    }
                    ex.mark()
                };
                if !s.initiator {
                    arrival(sq, ex)?;
                }
                // The flag goes into the source's last word in the doorbell's submission.
                let flag = [Store::U32 {
                    addr: s.post.addr() + at,
                    value: word,
                }];
                let src = s.post.local(0);
                let put = [match receive {
                    Some(_) => WorkRequest::Send { src, len: size as u32 },
                    None => WorkRequest::Put {
                        dst: *to,
                        src,
                        len: size as u32,
                    },
                }];
                let started = Instant::now();
                loop {
                    // SAFETY: the flag's word lies in the side's post buffer (allocated in
                    // whole words), which outlives the stream's work (waited for below, or the
                    // process ends with it).
                    match unsafe { sq.post_after(ex.ops(), &flag, &put) } {
                        Ok(_) => break,
                        // The stream is a send queue behind: let it catch up.
                        Err(StreamError::WindowFull { .. }) if started.elapsed() < bound => {
                            std::thread::sleep(std::time::Duration::from_micros(20))
                        }
                        Err(e) => bail!("round trip {i}: {e}"),
                    }
                }
                if s.initiator {
                    arrival(sq, ex)?;
                }
            }
        }
        let stamps = self
            .sides
            .iter_mut()
            .map(|(_, ex, _)| {
                let sent = ex.finish(bound)?;
                Ok(Stamps { sent, posted: vec![] })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Every receive has its message now: take their completions, so the next round's
        // receives find the queue empty.
        for (_, _, rq) in &self.sides {
            let Some(rq) = rq else { continue };
            while rq.outstanding() > 0 {
                match rq.poll_next() {
                    Some(r) => {
                        r?;
                    }
                    None => bail!("a receive did not complete after its stream's wait"),
                }
            }
        }
        Ok(stamps)
    }
}

/// Posts a receive into `poll` for the next message, taking the completions that are in when
/// the receive queue is full (the stream is behind: waits for it, within `bound`); its ticket.
fn post_receive(
    rq: &gdaki_device::Rq<Exclusive>,
    poll: &MemoryRegion,
    bound: std::time::Duration,
) -> anyhow::Result<u64> {
    let started = Instant::now();
    loop {
        while let Some(r) = rq.poll_next() {
            r?;
        }
        if rq.outstanding() < rq.size() {
            let len = u32::try_from(poll.len()).context("a receive takes at most 4 GiB")?;
            return Ok(rq.post_recv(&[RecvBuf {
                local: poll.local(0),
                len,
            }])?);
        }
        if started.elapsed() > bound {
            bail!("the receive queue stayed full for {bound:?}: the peer's messages stopped");
        }
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
}

/// Where the 32-bit word holding a message's last byte starts, and what it holds once the
/// message with `flag` has landed: the payload's bytes before the flag, zeros after it (the
/// poll buffer is cleared in whole words).
fn flag_word(payload: &[u8], flag: u8) -> (u64, u32) {
    let last = payload.len();
    let at = last & !3;
    let mut b = [0u8; 4];
    for (j, byte) in b.iter_mut().enumerate() {
        *byte = match at + j {
            k if k < last => payload[k],
            k if k == last => flag,
            _ => 0,
        };
    }
    (at as u64, u32::from_ne_bytes(b))
}

/// Enqueues a wait until the flag's word of `poll` holds `word`.
fn wait_flag(ex: &mut Executor, poll: &MemoryRegion, at: u64, word: u32) -> anyhow::Result<()> {
    // SAFETY: the word lies in the side's poll buffer (allocated in whole words), which
    // outlives the stream's work.
    unsafe { ex.ops().wait(poll.addr() + at, gdaki::cuda::StreamWait::Eq, word) }?;
    Ok(())
}

fn median_us(mut ns: Vec<u64>) -> f64 {
    ns.sort_unstable();
    ns.get(ns.len() / 2).copied().unwrap_or(0) as f64 / 1e3
}

fn measure_reference(session: &Session) -> anyhow::Result<Reference> {
    const N: u32 = 1000;
    Ok(match &session.gpu {
        Some(gpu) => Reference {
            pinned_round_trip_us: Some(median_us(gpu.pinned_round_trip(N)?)),
            synced_copy_8b_us: Some(median_us(
                gpu.synced_copy(N)?.iter().map(|d| d.as_nanos() as u64).collect(),
            )),
            thread_round_trip_us: None,
            doubt: None,
        },
        None => {
            // Re-measured while implausible: a descheduled spinner makes one try worthless.
            let mut best = f64::INFINITY;
            for _ in 0..REFERENCE_TRIES {
                best = best.min(median_us(thread_round_trip(N)));
                if thread_reference_doubt(best).is_none() {
                    break;
                }
            }
            Reference {
                thread_round_trip_us: Some(best),
                doubt: thread_reference_doubt(best),
                ..Default::default()
            }
        }
    })
}

/// Round trips (ns) of a flag ping-pong between two CPU threads.
fn thread_round_trip(iters: u32) -> Vec<u64> {
    let (ping, pong) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 1..=iters as u64 {
                while ping.load(Ordering::Acquire) != i {
                    std::hint::spin_loop();
                }
                pong.store(i, Ordering::Release);
            }
        });
        (1..=iters as u64)
            .map(|i| {
                let t = Instant::now();
                ping.store(i, Ordering::Release);
                while pong.load(Ordering::Acquire) != i {
                    std::hint::spin_loop();
                }
                t.elapsed().as_nanos() as u64
            })
            .collect()
    })
}

fn print_header(
    session: &Session,
    plan: &Plan,
    p: &Params,
    sides: &[(Side, gdaki_device::Remote)],
    addresses: Vec<(&'static str, String)>,
    send: bool,
) {
    let mut lines = session.header_lines(plan);
    lines.extend([
        ("Number of qps", "1".into()),
        ("Memory", p.memory.into()),
        (
            "Inline data",
            match p.inline_size {
                0 => "none: the HCA reads every message from the post buffer".into(),
                n => format!("messages of up to {n} bytes travel in their WQE (-I)"),
            },
        ),
        (
            "Doorbell",
            if p.blueflame {
                "a BlueFlame write of each message's WQE (--blueflame)".into()
            } else {
                "8 bytes".into()
            },
        ),
        (
            "Iterations",
            match p.duration_s {
                Some(d) => format!("for {d} s per size (-D), in rounds of {} round trips", p.iterations),
                None => format!("{} round trips per size", p.iterations),
            },
        ),
        (
            "Timer",
            match (p.poster, p.gpu.is_some()) {
                ("stream", true) => "CUDA events on each side's stream, one after each arrival",
                ("stream", false) => "CPU monotonic clock, marked by each side's stream after each arrival",
                (_, true) => "GPU %globaltimer, one thread per side polls",
                (_, false) => "CPU monotonic clock",
            }
            .into(),
        ),
    ]);
    if p.poster == "stream" {
        lines.push((
            "Poster",
            "each side's stream, no kernel: the CPU writes the WQEs ahead, the stream stores the flag, rings and \
             waits"
                .into(),
        ));
    }
    lines.extend(addresses);
    if p.gpu.is_none() {
        // CPU mode: each side's poster and the engine spin; a peer process may share the host.
        let peer = if matches!(plan.role, Role::Loopback) { 0 } else { 2 };
        if let Some(note) = cores_note(sides.len() + 1 + peer) {
            lines.push(("Note", note));
        }
    }
    report::print_header(
        match (send, p.poster) {
            (true, "stream") => "Send Latency Test (gdaki write_lat --stream --send)",
            (true, _) => "Send Latency Test (gdaki write_lat --send)",
            (false, "stream") => "RDMA_Write Latency Test (gdaki write_lat --stream)",
            _ => "RDMA_Write Latency Test (gdaki write_lat)",
        },
        &lines,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// References seen in two-process runs on a 2-core machine (7999.78 and 172.71 usec, where
    /// 0.13 is normal) are flagged, never used for a ratio; normal ones are kept.
    #[test]
    fn implausible_thread_references_are_flagged() {
        for bad in [7999.78, 172.71, 0.0, f64::NAN, f64::INFINITY] {
            assert!(thread_reference_doubt(bad).is_some(), "{bad}");
        }
        for good in [0.13, 0.9, 4.0] {
            assert_eq!(thread_reference_doubt(good), None, "{good}");
        }
        assert!(cores_note(usize::MAX).is_some_and(|n| n.contains("spinning threads")));
        assert_eq!(cores_note(1), None);
    }
}
