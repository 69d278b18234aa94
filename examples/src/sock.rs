//! `sock_bw` and `sock_lat`: the socket perftests (docs/sockets.md). Each size runs on a fresh
//! socket pair in this process (two contexts, connected through a listener on loopback), CPU
//! threads or a GPU kernel on each side, and then, on the same queue pairs and memory, the
//! reference: `put_bw`'s stream of RDMA WRITEs (`sock_bw`) or `write_lat`'s ping-pong
//! (`sock_lat`), without the socket protocol. The loops are `gdaki_device::socket::bench`.
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use gdaki::socket::{GpuSocket, Socket, SocketConfig, SocketListener, SocketMemory};
use gdaki::{Context, Provider};
use gdaki_device::socket::{BenchRole, Socket as DevSocket, STEPS};
use serde::Serialize;

use crate::cli::{Mem, Mode, SWEEP};

/// The flags of both socket perftests.
#[derive(Debug, Clone, Args)]
pub struct SockArgs {
    /// Connect to a server at this address (host or host:port); without it, and without
    /// --server, both sides run in this process.
    pub server_address: Option<String>,
    /// Serve clients (the passive side of a two-process run) until one says it is done.
    #[arg(long)]
    pub server: bool,
    /// TCP port of the socket listener, on both sides.
    #[arg(short = 'p', long, default_value_t = crate::cli::DEFAULT_PORT)]
    pub port: u16,
    /// Message size in bytes (at most the receive ring).
    #[arg(short = 's', long)]
    pub size: Option<u64>,
    /// Every power of two from 2 B up to the receive ring (at most 8 MiB).
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Messages (sock_bw) or round trips (sock_lat) per size.
    #[arg(short = 'n', long = "iters")]
    pub iters: Option<u32>,
    /// Who runs the sockets: GPU kernels (a block per side), CPU threads, or auto.
    #[arg(long, default_value = "auto")]
    pub mode: Mode,
    /// Where the rings live: host (CPU mode), pinned (host memory mapped into the GPU) or
    /// device (GPU memory); auto: pinned in GPU mode, host in CPU mode.
    #[arg(long, default_value = "auto")]
    pub mem: Mem,
    /// Bytes of each side's receive ring (a power of two, 4 KiB to 1 GiB). The default holds
    /// what a stream of 64 KiB messages sends during a credit's round trip between two
    /// processes (a ring of 1 MiB made the sender wait for credits: docs/sockets.md), as
    /// ib_write_bw keeps 128 such WRITEs outstanding.
    #[arg(long = "rx-bytes", default_value_t = 8 << 20)]
    pub rx_bytes: u64,
    /// Threads of each side's block in GPU mode (they copy together, GPUnet's
    /// threadblock-cooperative calls).
    #[arg(long, default_value_t = 256)]
    pub threads: u32,
    /// The GPU, in GPU mode.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// sock_bw: sockets streaming at once, each its own connection and queue pair, a block (or
    /// a thread) each per side; the reference puts on the same queue pairs at once (as
    /// ib_write_bw's `-q`). Bandwidth is all of their bytes over the span from the first start
    /// to the last end; steps are means over every socket's calls.
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    pub qps: u32,
    /// sock_bw: send from registered memory without copying (`send_from`): each message is
    /// the bytes the reference puts, from the staging ring's memory (at most the ring).
    #[arg(long = "zero-copy")]
    pub zero_copy: bool,
    /// Send queue depth of each socket's queue pair, in WQEs (a power of two; ib_write_bw's
    /// `-t`). A message takes one WQE (from registered memory too: one gathered WRITE), two
    /// where it wraps the ring.
    #[arg(short = 't', long = "tx-depth", default_value_t = 256)]
    pub tx_depth: u32,
    /// sock_bw: the receiver reads each message where it landed in its ring (`peek`, then
    /// `consume`) instead of copying it out into its buffer.
    #[arg(long = "in-place")]
    pub in_place: bool,
    /// Time each call's steps and print where a call's time goes (the Steps lines; a server
    /// prints its side's on stderr). The timing costs the calls (a copying 64 KiB stream 7-8%
    /// in a GPU kernel), so the rates printed with it are lower than without.
    #[arg(long)]
    pub steps: bool,
    /// How long a socket's wait (and the server's wait for its next client) may take, seconds.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    /// Results as one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Which test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    /// Bandwidth.
    Bw,
    /// Latency.
    Lat,
}

impl Test {
    fn name(self) -> &'static str {
        match self {
            Test::Bw => "sock_bw",
            Test::Lat => "sock_lat",
        }
    }
}

/// A run's settled parameters.
#[derive(Debug, Clone, Serialize)]
pub struct Params {
    /// `gpu` or `cpu`.
    pub mode: &'static str,
    /// Where the rings live.
    pub mem: &'static str,
    /// Receive ring bytes.
    pub rx_bytes: u64,
    /// Threads per side (GPU mode).
    pub threads: u32,
    /// Sockets streaming at once (`-q`).
    pub qps: u32,
    /// Send queue depth (`-t`).
    pub tx_depth: u32,
    /// Sends from registered memory, no copy (`--zero-copy`).
    pub zero_copy: bool,
    /// Receives read in place, no copy (`--in-place`).
    pub in_place: bool,
    /// The calls' steps timed (`--steps`).
    pub steps: bool,
    /// Iterations per size.
    pub iters: u32,
    /// Sizes.
    pub sizes: Vec<u64>,
}

/// One `sock_bw` row.
#[derive(Debug, Clone, Serialize)]
pub struct BwResult {
    /// Message size.
    pub bytes: u64,
    /// Messages.
    pub iterations: u32,
    /// Through the socket, MiB/s.
    pub bw_mib_s: f64,
    /// The same bytes as RDMA WRITEs on the same queue pair and memory, MiB/s.
    pub put_bw_mib_s: f64,
    /// `bw_mib_s / put_bw_mib_s`.
    pub socket_vs_put: f64,
    /// Where the sender's calls spent their time.
    pub sender: Option<SenderSteps>,
    /// Where the receiver's calls spent theirs, where it ran in this process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub receiver: Option<ReceiverSteps>,
}

/// A sender's `send` calls, means a call (microseconds; the GPU's timer, or the host's clock on
/// a CPU, read by the side's leader between the steps).
#[derive(Debug, Clone, Serialize)]
pub struct SenderSteps {
    /// Calls (a message takes more than one where the ring had room for part of it).
    pub calls: u64,
    /// Finding room in the staging ring: the look at the peer's credit, and any wait for one.
    pub room_us: f64,
    /// Telling the group how much (a block's broadcast; nothing in one thread).
    pub broadcast_us: f64,
    /// Copying the bytes into the staging ring (the group together, then its barrier).
    pub copy_us: f64,
    /// Writing the WQEs (the WRITEs and the count's inline WRITE), each slot reclaimed first.
    pub wqes_us: f64,
    /// Ringing their doorbell (0 in a block of more than a warp on an exclusive queue pair:
    /// another member rings, after the result, beside the leader's next call).
    pub doorbell_us: f64,
    /// Telling the group the result.
    pub result_us: f64,
}

/// A receiver's `recv` calls, means a call (as [`SenderSteps`]).
#[derive(Debug, Clone, Serialize)]
pub struct ReceiverSteps {
    /// Calls (the last one sees the end of the stream).
    pub calls: u64,
    /// Waiting for bytes: the looks at the count, until it moves.
    pub wait_us: f64,
    /// Telling the group how many.
    pub broadcast_us: f64,
    /// Copying the bytes out of the receive ring (the group together, then its barrier).
    pub copy_us: f64,
    /// Consuming them.
    pub consume_us: f64,
    /// The credit's inline WRITE, once half a ring is read (a mean over every call).
    pub credit_us: f64,
    /// Telling the group the result.
    pub result_us: f64,
}

/// One `sock_lat` row: the socket's latency and the reference's, one-way, microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct LatResult {
    /// Through the socket.
    pub socket: crate::report::LatRow,
    /// `write_lat`'s ping-pong on the same queue pair and memory.
    pub write_lat: crate::report::LatRow,
    /// `socket.t_typical_us / write_lat.t_typical_us`.
    pub socket_vs_write_lat: f64,
    /// Where a round trip through the socket goes (the other side's share only where it ran
    /// in this process).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<RoundTripSteps>,
    /// What the GPU copier saw of each ping-pong, where it served them (rings in GPU memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copier: Option<CopierTraces>,
}

/// [`CopierTrace`]s of a `sock_lat` size.
#[derive(Debug, Clone, Serialize)]
pub struct CopierTraces {
    /// Of the socket's ping-pong.
    pub socket: CopierTrace,
    /// Of write_lat's.
    pub write_lat: CopierTrace,
}

/// A socket round trip taken apart: each side's calls, means a call (as [`SenderSteps`]), and
/// what is left of the ping's wait once the pong's calls are taken out of it. The pong's
/// (and so the trips) only where it ran in this process; a `--server` prints its own.
#[derive(Debug, Clone, Serialize)]
pub struct RoundTripSteps {
    /// The pinging side's sends.
    pub ping_send: SenderSteps,
    /// The pinging side's receives (its wait holds the pong's calls and both trips).
    pub ping_receive: ReceiverSteps,
    /// The ponging side's receives (its wait is idle time: the ping's calls).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pong_receive: Option<ReceiverSteps>,
    /// The ponging side's sends.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pong_send: Option<SenderSteps>,
    /// Both trips through the HCA (from a send's return to the peer seeing its count), per
    /// round trip: the ping's wait less the pong's calls but their wait, microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wire_us: Option<f64>,
}

impl RoundTripSteps {
    /// From the two sides' runs of `iters` rounds (`BenchRole::Ping` and `Pong` record their
    /// sends' and then their receives' steps).
    fn of(ping: &SideRun, pong: Option<&SideRun>, iters: u32) -> Option<RoundTripSteps> {
        let (Some(ping_send), Some(ping_receive)) = ping.steps_of(BenchRole::Ping, iters) else {
            return None;
        };
        let (pong_send, pong_receive) = pong.map_or((None, None), |p| p.steps_of(BenchRole::Pong, iters));
        let round = |mean: f64, calls: u64| mean * calls as f64 / iters.max(1) as f64;
        let wire_us = pong_send.as_ref().zip(pong_receive.as_ref()).map(|(send, receive)| {
            round(ping_receive.wait_us, ping_receive.calls)
                - round(receive.total_us() - receive.wait_us, receive.calls)
                - round(send.total_us(), send.calls)
        });
        Some(RoundTripSteps {
            ping_send,
            ping_receive,
            pong_receive,
            pong_send,
            wire_us,
        })
    }
}

impl std::fmt::Display for RoundTripSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ping {}; ping {}", self.ping_send, self.ping_receive)?;
        if let (Some(receive), Some(send), Some(wire)) = (&self.pong_receive, &self.pong_send, self.wire_us) {
            write!(
                f,
                "; {}; both trips through the HCA {wire:.2} usec a round trip",
                PongSteps(receive, send)
            )?;
        }
        Ok(())
    }
}

/// The ponging side's calls, as a round trip's line shows them (and a `--server` pong its
/// own): its receives, then its sends.
struct PongSteps<'a>(&'a ReceiverSteps, &'a SenderSteps);

impl std::fmt::Display for PongSteps<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pong {}; pong {}", self.0, self.1)
    }
}

/// What the soft HCA's GPU copier saw of a ping-pong into GPU memory, from the stamps its kernel
/// leaves in its answers (the GPU's timer, as the sockets' own steps): the ring's last
/// descriptors, grouped by the look at the ring that fetched them (a message's copy and its
/// count are fetched together).
#[derive(Debug, Clone, Serialize)]
pub struct CopierTrace {
    /// Looks counted (the last ring's worth of descriptors, less the close's).
    pub looks: usize,
    /// Descriptors a look fetched, mean.
    pub per_look: f64,
    /// From a look to its last descriptor landing, median, microseconds.
    pub served_us: f64,
    /// From a look's last descriptor landing to the next look that fetched any, median,
    /// microseconds: the peer seeing the message, its calls, its doorbell, its engine and the
    /// copier's look at its ring.
    pub turnaround_us: f64,
}

impl CopierTrace {
    /// The trace of `copier` now, if it answered enough descriptors.
    fn of(copier: &gdaki_soft::copier::Copier) -> Option<CopierTrace> {
        use gdaki_layout::copy::RING_SLOTS;
        let last = copier.stats().posted;
        let first = last.saturating_sub(RING_SLOTS as u64 - 1).max(1);
        CopierTrace::from_stamps((first..=last).filter_map(|seq| copier.stamps(seq)))
    }

    /// The trace of descriptors' stamps ([`CopyDone::stamps`]), in posting order: `None` for
    /// fewer than 8 looks (after the last 4, a close's, are left out).
    ///
    /// [`CopyDone::stamps`]: gdaki_layout::copy::CopyDone::stamps
    fn from_stamps(stamps: impl IntoIterator<Item = [u64; 3]>) -> Option<CopierTrace> {
        use gdaki_layout::copy::{STAMP_FINISHED, STAMP_SEEN};
        // (seen, last finished, descriptors) of each look, in order.
        let mut looks: Vec<(u64, u64, usize)> = Vec::new();
        for stamps in stamps {
            let (seen, finished) = (stamps[STAMP_SEEN], stamps[STAMP_FINISHED]);
            match looks.last_mut() {
                Some(look) if look.0 == seen => {
                    look.1 = look.1.max(finished);
                    look.2 += 1;
                }
                _ => looks.push((seen, finished, 1)),
            }
        }
        // The close's descriptors are not the ping-pong's.
        looks.truncate(looks.len().saturating_sub(4));
        if looks.len() < 8 {
            return None;
        }
        let us = |ns: u64| ns as f64 / 1e3;
        let mut served: Vec<f64> = looks
            .iter()
            .map(|&(seen, done, _)| us(done.saturating_sub(seen)))
            .collect();
        let mut turnaround: Vec<f64> = looks.windows(2).map(|w| us(w[1].0.saturating_sub(w[0].1))).collect();
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        Some(CopierTrace {
            looks: looks.len(),
            per_look: looks.iter().map(|l| l.2).sum::<usize>() as f64 / looks.len() as f64,
            served_us: median(&mut served),
            turnaround_us: median(&mut turnaround),
        })
    }
}

impl std::fmt::Display for CopierTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} descriptors a look at its ring, all landed {:.2} usec after it, the next look {:.2} usec \
             after that ({} looks, medians)",
            self.per_look, self.served_us, self.turnaround_us, self.looks
        )
    }
}

/// What a side ran: its bytes, its timestamps.
pub struct SideRun {
    /// Bytes it moved.
    pub moved: u64,
    /// Its role's timestamps (`BenchRole::timestamps`).
    pub times: Vec<u64>,
}

impl SideRun {
    /// The sides of one bandwidth `role` (start and end stamps, then step sums and calls) as
    /// one: their bytes, the first start and the last end, every step's sums and calls added.
    /// A single side stays as it is; the sides of a role that records no stamps (`Idle`) add
    /// their bytes, whatever their (unwritten) timestamp words hold: a GPU run gives every
    /// side as many as its busiest role; other roles' stamps (per round) are not merged (`None`).
    fn merged(mut runs: Vec<SideRun>, role: BenchRole) -> Option<SideRun> {
        if runs.len() == 1 {
            return runs.pop();
        }
        if role.timestamps(1) == 0 {
            let moved = runs.iter().map(|r| r.moved).sum();
            return Some(SideRun {
                moved,
                times: Vec::new(),
            });
        }
        let bandwidth = matches!(
            role,
            BenchRole::Send | BenchRole::SendFrom | BenchRole::Recv | BenchRole::RecvInPlace | BenchRole::RawSend
        );
        if !bandwidth {
            return None;
        }
        let mut all = runs.into_iter();
        let mut one = all.next()?;
        for run in all {
            one.moved += run.moved;
            for (k, (mine, theirs)) in one.times.iter_mut().zip(run.times).enumerate() {
                *mine = match k {
                    0 => (*mine).min(theirs),
                    1 => (*mine).max(theirs),
                    _ => *mine + theirs,
                };
            }
        }
        Some(one)
    }

    /// A side's calls and their steps' means (us), recorded from timestamp `at` on
    /// (`BenchRole::timestamps`); `None` for a side that made no call.
    fn steps(&self, at: usize) -> Option<(u64, [f64; STEPS])> {
        let (sums, calls) = match self.times.get(at..at + STEPS + 1)? {
            [sums @ .., calls] => (sums, *calls),
            [] => return None,
        };
        let mean = |ns: u64| ns as f64 / calls as f64 / 1e3;
        (calls > 0).then(|| (calls, std::array::from_fn(|k| mean(sums[k]))))
    }

    /// The side's sends' and receives' steps as `role` recorded them over `iters` rounds
    /// (`BenchRole::steps_at`): a `Send` side has only sends, a `Recv` side only receives.
    fn steps_of(&self, role: BenchRole, iters: u32) -> (Option<SenderSteps>, Option<ReceiverSteps>) {
        let Some(at) = role.steps_at(iters) else {
            return (None, None);
        };
        match role {
            BenchRole::Recv | BenchRole::RecvInPlace => (None, self.receiver_at(at)),
            BenchRole::Ping | BenchRole::Pong => (self.sender_at(at), self.receiver_at(at + STEPS + 1)),
            _ => (self.sender_at(at), None),
        }
    }

    fn sender_at(&self, at: usize) -> Option<SenderSteps> {
        self.steps(at).map(
            |(calls, [room_us, broadcast_us, copy_us, wqes_us, doorbell_us, result_us])| SenderSteps {
                calls,
                room_us,
                broadcast_us,
                copy_us,
                wqes_us,
                doorbell_us,
                result_us,
            },
        )
    }

    fn receiver_at(&self, at: usize) -> Option<ReceiverSteps> {
        self.steps(at).map(
            |(calls, [wait_us, broadcast_us, copy_us, consume_us, credit_us, result_us])| ReceiverSteps {
                calls,
                wait_us,
                broadcast_us,
                copy_us,
                consume_us,
                credit_us,
                result_us,
            },
        )
    }
}

impl SenderSteps {
    /// A call, all its steps.
    pub fn total_us(&self) -> f64 {
        self.room_us + self.broadcast_us + self.copy_us + self.wqes_us + self.doorbell_us + self.result_us
    }
}

impl ReceiverSteps {
    /// A call, all its steps.
    pub fn total_us(&self) -> f64 {
        self.wait_us + self.broadcast_us + self.copy_us + self.consume_us + self.credit_us + self.result_us
    }
}

impl std::fmt::Display for SenderSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "send: room {:.2} + broadcast {:.2} + copy {:.2} + WQEs {:.2} + doorbell {:.2} + result {:.2} \
             usec a call ({} calls)",
            self.room_us, self.broadcast_us, self.copy_us, self.wqes_us, self.doorbell_us, self.result_us, self.calls
        )
    }
}

impl std::fmt::Display for ReceiverSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "receive: wait {:.2} + broadcast {:.2} + copy {:.2} + consume {:.2} + credit {:.2} + result \
             {:.2} usec a call ({} calls)",
            self.wait_us, self.broadcast_us, self.copy_us, self.consume_us, self.credit_us, self.result_us, self.calls
        )
    }
}

/// Where the sockets run.
pub enum Runner {
    /// A CPU thread per socket.
    Cpu,
    /// A block per socket, of one kernel on this GPU.
    Gpu(gdaki::cuda::Gpu),
}

impl Runner {
    /// Runs `roles[i]` on `sockets[i]`, all at once (a thread each, or a block each of one
    /// kernel of `threads` threads), `iters` messages of `size` bytes through a buffer of
    /// `size` bytes, the calls' steps `timed` or not; fails with the first side that failed.
    pub fn run(
        &self,
        sockets: Vec<Socket>,
        roles: &[BenchRole],
        (size, iters): (u64, u32),
        threads: u32,
        timed: bool,
    ) -> anyhow::Result<Vec<SideRun>> {
        let buf_len = size.max(1) as usize;
        match self {
            Runner::Cpu => {
                let outcome: Vec<anyhow::Result<SideRun>> = std::thread::scope(|s| {
                    let handles: Vec<_> = sockets
                        .iter()
                        .zip(roles.iter().copied())
                        .map(|(sock, role)| {
                            let handle = sock.device_handle() as usize;
                            s.spawn(move || -> anyhow::Result<SideRun> {
                                // SAFETY: the socket's own handle, alive for the scope; this
                                // thread is its only user meanwhile.
                                let dev = unsafe { DevSocket::<gdaki_device::Gpu>::from_raw(handle as *mut _) }
                                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                                let mut buf = vec![0x5au8; buf_len];
                                let mut times = vec![0u64; role.timestamps(iters)];
                                // SAFETY: `times` holds the role's timestamps; sizes are checked
                                // against the rings before any run.
                                let (t, buf) = (times.as_mut_ptr(), &mut buf[..]);
                                let thread = gdaki_device::Thread;
                                let moved = unsafe {
                                    if timed {
                                        gdaki_device::socket::bench::<_, _, true>(
                                            &dev, thread, role, size, iters, buf, t,
                                        )
                                    } else {
                                        gdaki_device::socket::bench::<_, _, false>(
                                            &dev, thread, role, size, iters, buf, t,
                                        )
                                    }
                                }
                                .map_err(|e| anyhow::anyhow!("{role:?}: {}", gdaki_device::status::Code(e.code())))?;
                                Ok(SideRun { moved, times })
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().unwrap_or_else(|_| bail!("a side panicked")))
                        .collect()
                });
                outcome.into_iter().collect()
            }
            Runner::Gpu(gpu) => {
                let mut exported = sockets
                    .into_iter()
                    .map(|s| s.into_gpu(gpu))
                    .collect::<gdaki::Result<Vec<GpuSocket>>>()?;
                let run = GpuSocket::bench_on_gpu(gpu, &mut exported, roles, size, iters, threads, buf_len, timed)?;
                if let Some((side, code)) = run.status.iter().enumerate().find(|(_, c)| **c != 0) {
                    bail!("side {side} ({:?}): {}", roles[side], gdaki_device::status::Code(*code));
                }
                Ok(run
                    .times
                    .into_iter()
                    .zip(run.moved)
                    .map(|(times, moved)| SideRun { moved, times })
                    .collect())
            }
        }
    }
}

/// Where the other side runs.
enum Peer {
    /// In this process.
    Loopback(Pairs),
    /// A `--server` process.
    Remote {
        ctx: Context,
        addr: std::net::SocketAddr,
        cfg: SocketConfig,
    },
}

impl Peer {
    /// Runs `mine` here and `theirs` on the other side over a fresh connection: this side's
    /// run, and the other's where it ran in this process.
    fn run(
        &self,
        runner: &Runner,
        [mine, theirs]: [BenchRole; 2],
        size: u64,
        iters: u32,
        threads: u32,
        timed: bool,
    ) -> anyhow::Result<(SideRun, Option<SideRun>)> {
        self.run_many(runner, [mine, theirs], 1, size, iters, threads, timed)
    }

    /// [`run`](Self::run) over `qps` connections at once, each side's runs merged
    /// ([`SideRun::merged`]; a bandwidth role where `qps` is more than one). A server times
    /// its side's steps where the client asks it to (`timed`).
    #[allow(clippy::too_many_arguments)] // a run's roles, shape and timing
    fn run_many(
        &self,
        runner: &Runner,
        [mine, theirs]: [BenchRole; 2],
        qps: u32,
        size: u64,
        iters: u32,
        threads: u32,
        timed: bool,
    ) -> anyhow::Result<(SideRun, Option<SideRun>)> {
        let n = qps.max(1) as usize;
        let merged = |runs: Vec<SideRun>, role: BenchRole| {
            SideRun::merged(runs, role).with_context(|| format!("{role:?} runs one socket at a time"))
        };
        match self {
            Peer::Loopback(pairs) => {
                let (mut sockets, mut theirs_sockets) = (Vec::with_capacity(2 * n), Vec::with_capacity(n));
                for _ in 0..n {
                    let (a, b) = pairs.pair()?;
                    sockets.push(a);
                    theirs_sockets.push(b);
                }
                sockets.append(&mut theirs_sockets);
                let roles: Vec<BenchRole> = [mine, theirs].iter().flat_map(|&r| std::iter::repeat_n(r, n)).collect();
                let mut runs = runner.run(sockets, &roles, (size, iters), threads, timed)?;
                let other = runs.split_off(n);
                Ok((merged(runs, mine)?, Some(merged(other, theirs)?)))
            }
            Peer::Remote { ctx, addr, cfg } => {
                let ask = format!(
                    "role={} size={size} iters={iters} qps={n} steps={}",
                    theirs as u32, timed as u32
                );
                let sockets = (0..n)
                    .map(|_| {
                        Socket::connect_with(ctx, *addr, cfg.clone(), ask.as_bytes())
                            .with_context(|| format!("cannot connect to the server at {addr}"))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let runs = runner.run(sockets, &vec![mine; n], (size, iters), threads, timed)?;
                Ok((merged(runs, mine)?, None))
            }
        }
    }
}

/// What a client asks the server to run ([`parse_ask`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ask {
    role: BenchRole,
    size: u64,
    iters: u32,
    /// The connections that run together (each of them asks the same).
    qps: u32,
    /// Whether the server times its calls' steps (`--steps` on the client).
    steps: bool,
}

/// What a client asks the server to run, from its connection data: the role, message size,
/// messages, the connections that run together (`qps`, 1 when not said) and whether to time
/// the calls' steps (`steps`, 0 or 1, 0 when not said).
fn parse_ask(data: &[u8]) -> anyhow::Result<Ask> {
    let text = std::str::from_utf8(data).context("a client's request is not text")?;
    let mut role = None;
    let mut size = None;
    let mut iters = None;
    let mut qps = Some(1);
    let mut steps = Some(false);
    for word in text.split_whitespace() {
        match word.split_once('=') {
            Some(("role", v)) => role = v.parse::<u32>().ok().and_then(BenchRole::from_code),
            Some(("size", v)) => size = v.parse::<u64>().ok(),
            Some(("iters", v)) => iters = v.parse::<u32>().ok(),
            Some(("qps", v)) => qps = v.parse::<u32>().ok().filter(|q| (1..=MAX_QPS).contains(q)),
            Some(("steps", v)) => {
                steps = match v {
                    "0" => Some(false),
                    "1" => Some(true),
                    _ => None,
                }
            }
            _ => bail!("a client asked {text:?}"),
        }
    }
    match (role, size, iters, qps, steps) {
        (Some(role), Some(size), Some(iters), Some(qps), Some(steps)) => Ok(Ask {
            role,
            size,
            iters,
            qps,
            steps,
        }),
        _ => bail!("a client asked {text:?}: role, size and iters are needed, qps 1 to {MAX_QPS} and steps 0 or 1"),
    }
}

/// The most sockets `-q` runs at once: a block each per side on a GPU (in one process both
/// sides' blocks share it), each block of the socket kernel taking an SM.
pub const MAX_QPS: u32 = 32;

/// The `--server` side: runs what each client connection asks (its connection data) until a
/// client says `end`.
fn serve(test: Test, args: &SockArgs, runner: &Runner, cfg: SocketConfig) -> anyhow::Result<()> {
    let ctx = Context::open(Provider::Soft)?;
    let rx_bytes = cfg.rx_bytes;
    let listener = SocketListener::bind(&ctx, std::net::SocketAddr::from(([0, 0, 0, 0], args.port)), cfg)?;
    eprintln!("{}: serving on port {}", test.name(), listener.local_addr()?.port());
    loop {
        let sock = listener.accept_within(Duration::from_secs(args.timeout.max(1)))?;
        if sock.peer_data() == b"end" {
            // Nothing was sent on it: dropped as is (a FIN could meet the client's closed side).
            return Ok(());
        }
        let ask = sock.peer_data().to_vec();
        let Ask {
            role,
            size,
            iters,
            qps,
            steps,
        } = parse_ask(&ask)?;
        if size == 0 || size > rx_bytes {
            bail!("a client asked for {size}-byte messages; this side's ring holds {rx_bytes}");
        }
        // The client's other connections of the same run, asking the same.
        let mut sockets = vec![sock];
        while sockets.len() < qps as usize {
            let more = listener.accept_within(Duration::from_secs(args.timeout.max(1)))?;
            if more.peer_data() != ask.as_slice() {
                bail!(
                    "a client asked {:?} while {qps} connections asking {:?} were coming",
                    String::from_utf8_lossy(more.peer_data()),
                    String::from_utf8_lossy(&ask)
                );
            }
            sockets.push(more);
        }
        let runs = runner.run(sockets, &vec![role; qps as usize], (size, iters), args.threads, steps)?;
        eprintln!(
            "{}: served {role:?}, {size} B x {iters} on {qps} socket(s)",
            test.name()
        );
        let run = SideRun::merged(runs, role);
        // A stream's receiver, or a pong: where its calls went (the client has only its own).
        match (role, run.as_ref().map(|side| side.steps_of(role, iters))) {
            (BenchRole::Recv | BenchRole::RecvInPlace, Some((_, Some(receive)))) => {
                eprintln!("{}: {size} B, {receive}", test.name())
            }
            (BenchRole::Pong, Some((Some(send), Some(receive)))) => {
                eprintln!("{}: {size} B, {}", test.name(), PongSteps(&receive, &send));
            }
            _ => {}
        }
    }
}

/// Two contexts and a listener between them, for fresh socket pairs.
struct Pairs {
    listener: SocketListener,
    client: Context,
    cfg: SocketConfig,
    _server: Context,
}

impl Pairs {
    fn new(cfg: SocketConfig) -> anyhow::Result<Pairs> {
        let server = Context::open(Provider::Soft)?;
        let listener = SocketListener::bind(&server, "127.0.0.1:0".parse()?, cfg.clone())?;
        Ok(Pairs {
            listener,
            client: Context::open(Provider::Soft)?,
            cfg,
            _server: server,
        })
    }

    /// A connected pair: (client side, server side).
    fn pair(&self) -> anyhow::Result<(Socket, Socket)> {
        let addr = self.listener.local_addr()?;
        std::thread::scope(|s| {
            let accepted = s.spawn(|| self.listener.accept());
            let client = Socket::connect(&self.client, addr, self.cfg.clone())?;
            let server = accepted.join().map_err(|_| anyhow::anyhow!("accept panicked"))??;
            Ok((client, server))
        })
    }
}

/// A socket perftest's whole program: parses its flags (named and described after `test`),
/// runs it, and exits 1 with the reason on stderr when it fails.
pub fn program(test: Test) {
    use clap::{CommandFactory, FromArgMatches};
    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: SockArgs,
    }
    crate::init_tracing();
    let about = match test {
        Test::Bw => "Streams messages through a gdaki socket (GPUnet's model) and reports bandwidth beside RDMA WRITEs on the same path",
        Test::Lat => "Ping-pongs messages through a gdaki socket (GPUnet's model) and reports one-way latency beside write_lat's on the same path",
    };
    let matches = Cli::command()
        .name(test.name())
        .about(about)
        .version(env!("CARGO_PKG_VERSION"))
        .get_matches();
    let outcome = Cli::from_arg_matches(&matches)
        .map_err(anyhow::Error::from)
        .and_then(|cli| main(test, cli.args));
    if let Err(e) = outcome {
        eprintln!("{}: {}", test.name(), crate::error_text(&e));
        std::process::exit(1);
    }
}

/// The GPU (`--mode`, `--gpu`) and where the rings live (`--mem`, with how reports name it),
/// and checks of `--rx-bytes` and `--threads`: what every socket program settles first.
pub fn placement(
    mode: Mode,
    mem: Mem,
    gpu: usize,
    rx_bytes: u64,
    threads: u32,
) -> anyhow::Result<(Option<gdaki::cuda::Gpu>, SocketMemory, &'static str)> {
    let gpu = match mode {
        Mode::Cpu => None,
        Mode::Gpu => Some(gdaki::cuda::Gpu::open(gpu).context("--mode gpu")?),
        Mode::Auto => gdaki::cuda::Gpu::open(gpu).ok(),
    };
    let (memory, mem_name) = match (mem, &gpu) {
        (Mem::Auto | Mem::Pinned, Some(g)) => (SocketMemory::Pinned(g.clone()), "host-pinned, mapped into the GPU"),
        (Mem::Device, Some(g)) => (SocketMemory::Device(g.clone()), "GPU device memory"),
        (Mem::Auto | Mem::Host, None) => (SocketMemory::Host, "host"),
        (Mem::Host, Some(_)) => bail!("--mem host: GPU kernels cannot reach plain host memory; use pinned or device"),
        (Mem::Pinned | Mem::Device, None) => bail!("--mem {mem:?} needs a GPU (--mode gpu)"),
    };
    if !rx_bytes.is_power_of_two() || !((4 << 10)..=(1 << 30)).contains(&rx_bytes) {
        bail!("--rx-bytes {rx_bytes}: a power of two, 4 KiB to 1 GiB");
    }
    if gpu.is_some() && !(1..=1024).contains(&threads) {
        bail!("--threads {threads}: 1 to 1024");
    }
    Ok((gpu, memory, mem_name))
}

/// Runs `test` with `args`: prints the table (or the JSON object).
pub fn main(test: Test, args: SockArgs) -> anyhow::Result<()> {
    let (gpu, memory, mem_name) = placement(args.mode, args.mem, args.gpu, args.rx_bytes, args.threads)?;
    let max = args.rx_bytes.min(SWEEP.1);
    let sizes: Vec<u64> = match (args.size, args.all) {
        (Some(_), true) => bail!("-s and -a together: choose one"),
        (Some(s), false) if (1..=args.rx_bytes).contains(&s) => vec![s],
        (Some(s), false) => bail!("-s {s}: 1 to the receive ring ({} bytes)", args.rx_bytes),
        (None, true) => (1..=63).map(|p| 1u64 << p).take_while(|&s| s <= max).collect(),
        (None, false) => vec![if test == Test::Bw { 65536.min(max) } else { 64 }],
    };
    let iters = args.iters.unwrap_or(if test == Test::Bw { 5000 } else { 1000 });
    if iters < 2 {
        bail!("-n {iters}: at least 2");
    }
    if !(1..=MAX_QPS).contains(&args.qps) {
        bail!("-q {}: 1 to {MAX_QPS}", args.qps);
    }
    if args.qps > 1 && test == Test::Lat {
        bail!("-q is sock_bw's (a latency test runs one ping-pong)");
    }
    let params = Params {
        mode: if gpu.is_some() { "gpu" } else { "cpu" },
        mem: mem_name,
        rx_bytes: args.rx_bytes,
        threads: args.threads,
        qps: args.qps,
        tx_depth: args.tx_depth,
        zero_copy: args.zero_copy,
        in_place: args.in_place,
        steps: args.steps,
        iters,
        sizes: sizes.clone(),
    };
    let cfg = SocketConfig {
        rx_bytes: args.rx_bytes,
        timeout: Duration::from_secs(args.timeout.max(1)),
        sq_size: args.tx_depth,
        memory,
    };
    let runner = match gpu {
        Some(g) => Runner::Gpu(g),
        None => Runner::Cpu,
    };
    if args.server && args.server_address.is_some() {
        bail!("--server and a server address together: choose one");
    }
    if args.zero_copy && test == Test::Lat {
        bail!("--zero-copy is sock_bw's (a ping-pong echoes what it received, which is not registered memory)");
    }
    let depths = gdaki::socket::MIN_SQ_SIZE..=gdaki::socket::MAX_SQ_SIZE;
    if !args.tx_depth.is_power_of_two() || !depths.contains(&u64::from(args.tx_depth)) {
        bail!(
            "-t {}: the send queue depth must be a power of two from {} to {}",
            args.tx_depth,
            depths.start(),
            depths.end()
        );
    }
    if args.in_place && test == Test::Lat {
        bail!("--in-place is sock_bw's (a ping-pong echoes what it received from its buffer)");
    }
    if args.server {
        return serve(test, &args, &runner, cfg);
    }
    let peer = match &args.server_address {
        None => Peer::Loopback(Pairs::new(cfg)?),
        Some(a) => Peer::Remote {
            ctx: Context::open(Provider::Soft)?,
            addr: crate::cli::resolve(a, args.port)?,
            cfg,
        },
    };
    if !args.json {
        let title = match test {
            Test::Bw => "Socket BW Test (gdaki sock_bw)",
            Test::Lat => "Socket Latency Test (gdaki sock_lat)",
        };
        crate::report::print_header(
            title,
            &[
                (
                    "Sockets",
                    match (&peer, args.qps) {
                        (Peer::Loopback(_), 1) => "one pair in this process, over the soft HCA (two contexts)".into(),
                        (Peer::Loopback(_), q) => {
                            format!("{q} pairs streaming at once in this process, over the soft HCA (two contexts)")
                        }
                        (Peer::Remote { addr, .. }, 1) => {
                            format!("to the server at {addr}, a connection per size and test")
                        }
                        (Peer::Remote { addr, .. }, q) => {
                            format!("to the server at {addr}, {q} connections at once per size and test")
                        }
                    },
                ),
                (
                    "Mode",
                    match &runner {
                        Runner::Gpu(g) => format!(
                            "gpu: a block of {} threads per socket and side on GPU {}",
                            args.threads,
                            g.ordinal()
                        ),
                        Runner::Cpu => "cpu: a thread per socket and side".into(),
                    },
                ),
                (
                    "Rings",
                    format!("{mem_name}, {} KiB receive ring per side", args.rx_bytes >> 10),
                ),
                (
                    "Sends",
                    if args.zero_copy {
                        "from registered memory, no copy (--zero-copy)".into()
                    } else {
                        "copied into the staging ring".into()
                    },
                ),
                (
                    "Receives",
                    if args.in_place {
                        "read in place in the receive ring, no copy (--in-place)".into()
                    } else {
                        "copied out of the receive ring".into()
                    },
                ),
                ("Iterations", format!("{iters} per size")),
                (
                    "Steps",
                    if args.steps {
                        "each call's timed (--steps), which lowers the rates".into()
                    } else {
                        "not timed (--steps prints where a call's time goes)".into()
                    },
                ),
                (
                    "Reference",
                    match test {
                        Test::Bw => "put_bw on the same queue pairs and memory (RDMA WRITEs, no protocol)".into(),
                        Test::Lat => "write_lat on the same queue pairs and memory (a flag byte per message)".into(),
                    },
                ),
            ],
        );
        match test {
            Test::Bw => crate::outln!(" #bytes     #iterations    BW[MiB/sec]      put BW[MiB/sec]    socket/put"),
            Test::Lat => crate::outln!("{}   (socket; then write_lat's)", crate::report::LatRow::header()),
        }
    }
    // The GPU copier that serves copies into GPU memory, held across the runs so that its
    // answers (and the stamps in them) outlive each run's sockets.
    let copier = match (&runner, args.mem) {
        (Runner::Gpu(gpu), Mem::Device) => Some(gdaki_soft::copier::Copier::of(gpu)?),
        _ => None,
    };
    let mut bw_rows = Vec::new();
    let mut lat_rows = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        crate::report::progress(test.name(), i, sizes.len(), size);
        match test {
            Test::Bw => {
                let sender = if args.zero_copy {
                    BenchRole::SendFrom
                } else {
                    BenchRole::Send
                };
                let receiver = if args.in_place {
                    BenchRole::RecvInPlace
                } else {
                    BenchRole::Recv
                };
                let qps = args.qps;
                let pair = [sender, receiver];
                let (send, recv) = peer.run_many(&runner, pair, qps, size, iters, args.threads, args.steps)?;
                let sent = size * iters as u64 * qps as u64;
                if let Some(recv) = recv.as_ref().filter(|r| r.moved != sent) {
                    bail!("{size} B: the receivers got {} bytes of {sent}", recv.moved);
                }
                let (raw, _) = peer.run_many(
                    &runner,
                    [BenchRole::RawSend, BenchRole::Idle],
                    qps,
                    size,
                    iters,
                    args.threads,
                    false,
                )?;
                let mib_s = |r: &SideRun| {
                    send.moved as f64 / crate::report::MIB / (r.times[1].saturating_sub(r.times[0]).max(1) as f64 / 1e9)
                };
                let row = BwResult {
                    bytes: size,
                    iterations: iters,
                    bw_mib_s: mib_s(&send),
                    put_bw_mib_s: mib_s(&raw),
                    socket_vs_put: 0.0,
                    sender: send.steps_of(sender, iters).0,
                    receiver: recv.as_ref().and_then(|r| r.steps_of(receiver, iters).1),
                };
                let row = BwResult {
                    socket_vs_put: row.bw_mib_s / row.put_bw_mib_s,
                    ..row
                };
                if !args.json {
                    crate::outln!(
                        " {:<10} {:<14} {:<16.2} {:<18.2} {:.1}%",
                        row.bytes,
                        row.iterations,
                        row.bw_mib_s,
                        row.put_bw_mib_s,
                        100.0 * row.socket_vs_put
                    );
                    let steps = [
                        row.sender.as_ref().map(ToString::to_string),
                        row.receiver.as_ref().map(ToString::to_string),
                    ];
                    let steps: Vec<String> = steps.into_iter().flatten().collect();
                    if !steps.is_empty() {
                        crate::outln!(" Steps ({} B, means): {}", row.bytes, steps.join("; "));
                    }
                }
                bw_rows.push(row);
            }
            Test::Lat => {
                let pair = [BenchRole::Ping, BenchRole::Pong];
                let (ping, pong) = peer.run(&runner, pair, size, iters, args.threads, args.steps)?;
                let steps = RoundTripSteps::of(&ping, pong.as_ref(), iters);
                let trace = || copier.as_deref().and_then(CopierTrace::of);
                let socket_trace = trace();
                let (raw, _) = peer.run(
                    &runner,
                    [BenchRole::RawPing, BenchRole::RawPong],
                    size,
                    iters,
                    args.threads,
                    false,
                )?;
                let traces = socket_trace
                    .zip(trace())
                    .map(|(socket, write_lat)| CopierTraces { socket, write_lat });
                // The rounds' stamps (the ping's step sums follow them).
                let trips = |r: &SideRun| {
                    r.times[..r.times.len().min(iters as usize + 1)]
                        .windows(2)
                        .map(|w| w[1].saturating_sub(w[0]))
                        .collect::<Vec<u64>>()
                };
                let socket = crate::report::LatRow::from_round_trips(size, &trips(&ping));
                let write_lat = crate::report::LatRow::from_round_trips(size, &trips(&raw));
                if !args.json {
                    crate::outln!("{}", socket.line());
                    crate::outln!("{}", write_lat.line());
                    if let Some(steps) = &steps {
                        crate::outln!(" Steps ({size} B, means): {steps}");
                    }
                    if let Some(c) = &traces {
                        crate::outln!(
                            " GPU copier ({size} B): socket: {}; write_lat: {}",
                            c.socket,
                            c.write_lat
                        );
                    }
                }
                lat_rows.push(LatResult {
                    socket_vs_write_lat: socket.t_typical_us / write_lat.t_typical_us,
                    socket,
                    write_lat,
                    steps,
                    copier: traces,
                });
            }
        }
    }
    if let Peer::Remote { ctx, addr, cfg } = &peer {
        // Tells the server this client is done (the connection carries nothing else).
        drop(Socket::connect_with(ctx, *addr, cfg.clone(), b"end")?);
    }
    if args.json {
        let text = match test {
            Test::Bw => serde_json::to_string_pretty(&Json {
                test: test.name(),
                version: env!("CARGO_PKG_VERSION"),
                params,
                results: bw_rows,
            }),
            Test::Lat => serde_json::to_string_pretty(&Json {
                test: test.name(),
                version: env!("CARGO_PKG_VERSION"),
                params,
                results: lat_rows,
            }),
        }?;
        crate::outln!("{text}");
    } else {
        crate::report::print_rule();
    }
    Ok(())
}

#[derive(Serialize)]
struct Json<R: Serialize> {
    test: &'static str,
    version: &'static str,
    params: Params,
    results: Vec<R>,
}

#[cfg(test)]
mod tests {
    use super::{parse_ask, Ask, BenchRole, CopierTrace, SideRun};

    /// A client's ask: `qps` and `steps` may be left out (1 and untimed: what a client before
    /// `--steps` asked), anything else is refused.
    #[test]
    fn a_clients_ask_names_its_run_and_whether_to_time_it() {
        let ask = |s: &str| parse_ask(s.as_bytes());
        let want = Ask {
            role: BenchRole::Recv,
            size: 4096,
            iters: 50,
            qps: 1,
            steps: false,
        };
        assert_eq!(ask("role=1 size=4096 iters=50").unwrap(), want);
        assert_eq!(
            ask("role=1 size=4096 iters=50 qps=2 steps=1").unwrap(),
            Ask {
                qps: 2,
                steps: true,
                ..want
            }
        );
        for bad in [
            "role=1 size=4096 iters=50 steps=2",
            "role=1 size=4096",
            "role=1 size=4096 iters=50 x=1",
        ] {
            assert!(ask(bad).is_err(), "{bad}");
        }
    }

    /// `-q`'s sides as one: bytes added, the first start and the last end, every step's sums
    /// and calls added; sides without stamps add their bytes; per-round stamps (a ping's) are
    /// not merged; one side stays as it is.
    #[test]
    fn a_bandwidth_role_s_sides_merge_into_one() {
        let side = |moved, start, end, step, calls| SideRun {
            moved,
            times: vec![start, end, step, 0, 0, 0, 0, 0, calls],
        };
        let one = SideRun::merged(vec![side(10, 100, 200, 5, 2), side(30, 90, 250, 7, 3)], BenchRole::Recv).unwrap();
        assert_eq!(one.moved, 40);
        assert_eq!(one.times, vec![90, 250, 12, 0, 0, 0, 0, 0, 5]);
        let idle = |moved| SideRun { moved, times: vec![] };
        assert_eq!(
            SideRun::merged(vec![idle(1), idle(2)], BenchRole::Idle).unwrap().moved,
            3
        );
        // On a GPU an idle side comes back with its busiest neighbour's count of (unwritten)
        // timestamp words.
        let gpu_idle = |moved| SideRun {
            moved,
            times: vec![0; 9],
        };
        assert_eq!(
            SideRun::merged(vec![gpu_idle(1), gpu_idle(2)], BenchRole::Idle)
                .unwrap()
                .moved,
            3
        );
        assert!(SideRun::merged(vec![side(1, 1, 2, 0, 1), side(1, 1, 2, 0, 1)], BenchRole::Ping).is_none());
        let alone = SideRun::merged(vec![side(5, 1, 9, 3, 1)], BenchRole::Ping).unwrap();
        assert_eq!((alone.moved, alone.times[1]), (5, 9));
    }

    /// Pairs fetched in one look (equal `seen`), each landing 5 us after it, the next look 9 us
    /// later; a lone straggler in between counts as a look of its own; the close's last four
    /// looks are left out, and too few looks give no trace.
    #[test]
    fn a_copier_trace_groups_descriptors_by_the_look_that_fetched_them() {
        let mut stamps = Vec::new();
        let mut t = 1_000_000u64;
        for i in 0..20 {
            // (seen, started, finished): the copy, then its count, which lands last.
            stamps.push([t, t + 100, t + 3_000]);
            stamps.push([t, t + 3_100, t + 5_000]);
            t += 5_000 + 9_000;
            if i == 10 {
                stamps.push([t, t + 50, t + 5_000]);
                t += 5_000 + 9_000;
            }
        }
        for _ in 0..4 {
            stamps.push([t, t, t + 100_000]);
            t += 1_000_000;
        }
        let trace = CopierTrace::from_stamps(stamps).expect("enough looks");
        assert_eq!(trace.looks, 21);
        assert!((trace.per_look - 41.0 / 21.0).abs() < 1e-9, "{}", trace.per_look);
        assert_eq!(trace.served_us, 5.0);
        assert_eq!(trace.turnaround_us, 9.0);
        let few: Vec<[u64; 3]> = (0..11u64).map(|i| [i * 10, i * 10, i * 10 + 1]).collect();
        assert!(CopierTrace::from_stamps(few).is_none(), "7 looks after the close's 4");
    }
}
