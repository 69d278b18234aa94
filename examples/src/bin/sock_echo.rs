//! `sock_echo`: GPUnet's echo server and client over gdaki sockets (docs/sockets.md).
//!
//! ```text
//! sock_echo --server -c 4                 # serve 4 connections: a GPU block each (or a CPU thread)
//! sock_echo 127.0.0.1 -c 4 -s 4096 -n 1000   # 4 clients: each sends 1000 x 4 KiB, checks every echoed byte
//! ```
//!
//! The server accepts its connections, then serves them all at once until each client's end of
//! stream: in GPU mode one kernel with a block per socket (`gdaki_device::socket::echo`,
//! GPUnet's threadblock-cooperative `grecv`/`gsend`), in CPU mode a thread per socket running
//! the same code. The client's blocks (or threads) each send a known stream and compare its
//! echo (`BenchRole::Check`). Either side may be GPU or CPU. Both run through the socket
//! perftests' runner (`gdaki_examples::sock::Runner`).
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Parser;
use gdaki::socket::{Socket, SocketConfig, SocketListener};
use gdaki::{Context, Provider};
use gdaki_device::socket::BenchRole;
use gdaki_examples::cli::{Mem, Mode};
use gdaki_examples::sock::Runner;
use serde::Serialize;

/// The port `sock_echo` listens at and connects to unless told otherwise.
const ECHO_PORT: u16 = 18517;

#[derive(Debug, Parser)]
#[command(
    name = "sock_echo",
    version,
    about = "GPUnet's echo server and client over gdaki sockets: a GPU block (or CPU thread) per connection"
)]
struct Cli {
    /// Connect to an echo server at this address (host or host:port) and check its echo.
    server_address: Option<String>,
    /// Serve echo connections.
    #[arg(long)]
    server: bool,
    /// TCP port of the listener, on both sides.
    #[arg(short = 'p', long, default_value_t = ECHO_PORT)]
    port: u16,
    /// Connections: the server serves this many at once, the client opens this many.
    #[arg(short = 'c', long, default_value_t = 1)]
    connections: u32,
    /// Client: bytes per message (at most the receive ring).
    #[arg(short = 's', long, default_value_t = 4096)]
    size: u64,
    /// Client: messages per connection, each echoed before the next.
    #[arg(short = 'n', long = "iters", default_value_t = 1000)]
    iters: u32,
    /// Who runs the sockets: GPU kernels (a block per connection), CPU threads, or auto.
    #[arg(long, default_value = "auto")]
    mode: Mode,
    /// Where the rings live: host (CPU mode), pinned or device; auto: pinned on a GPU.
    #[arg(long, default_value = "auto")]
    mem: Mem,
    /// Bytes of each side's receive ring (a power of two, 4 KiB to 1 GiB).
    #[arg(long = "rx-bytes", default_value_t = 1 << 16)]
    rx_bytes: u64,
    /// Threads of each block in GPU mode.
    #[arg(long, default_value_t = 256)]
    threads: u32,
    /// The GPU, in GPU mode.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// How long any wait (a connection, room, bytes) may take, seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// The client's results as one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

/// What the client measured.
#[derive(Debug, Serialize)]
struct Report {
    mode: &'static str,
    mem: &'static str,
    connections: u32,
    bytes_per_message: u64,
    messages_per_connection: u32,
    /// Bytes echoed and checked, all connections.
    bytes_checked: u64,
    seconds: f64,
    /// Round trips a second, all connections.
    round_trips_per_s: f64,
    /// Echoed bytes a second, all connections, MiB/s.
    mib_s: f64,
}

fn main() {
    gdaki_examples::init_tracing();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("sock_echo: {}", gdaki_examples::error_text(&e));
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let threads = cli.threads;
    let (gpu, memory, mem_name) = gdaki_examples::sock::placement(cli.mode, cli.mem, cli.gpu, cli.rx_bytes, threads)?;
    if cli.connections == 0 || cli.connections > 4096 {
        bail!("-c {}: 1 to 4096 connections", cli.connections);
    }
    let cfg = SocketConfig {
        rx_bytes: cli.rx_bytes,
        timeout: Duration::from_secs(cli.timeout.max(1)),
        memory,
        ..SocketConfig::default()
    };
    let ctx = Context::open(Provider::Soft)?;
    let runner = match gpu {
        Some(g) => Runner::Gpu(g),
        None => Runner::Cpu,
    };
    match (cli.server, &cli.server_address) {
        (true, Some(_)) => bail!("--server and a server address together: choose one"),
        (false, None) => bail!("give --server, or the address of a server to connect to"),
        (true, None) => {
            let listener = SocketListener::bind(&ctx, SocketAddr::from(([0, 0, 0, 0], cli.port)), cfg)?;
            eprintln!(
                "sock_echo: serving {} connection(s) on port {}",
                cli.connections,
                listener.local_addr()?.port()
            );
            let sockets = (0..cli.connections)
                .map(|_| listener.accept_within(Duration::from_secs(cli.timeout.max(1))))
                .collect::<gdaki::Result<Vec<Socket>>>()?;
            // GPUnet's echo server (`gdaki_device::socket::echo`) through a ring-sized buffer.
            let roles = vec![BenchRole::Echo; sockets.len()];
            for (i, side) in runner
                .run(sockets, &roles, (cli.rx_bytes, 0), threads, false)?
                .iter()
                .enumerate()
            {
                eprintln!("sock_echo: connection {i} echoed {} bytes", side.moved);
            }
            Ok(())
        }
        (false, Some(a)) => {
            if !(1..=cli.rx_bytes).contains(&cli.size) || cli.iters == 0 {
                bail!(
                    "-s {} -n {}: 1 to the receive ring ({} bytes), at least one message",
                    cli.size,
                    cli.iters,
                    cli.rx_bytes
                );
            }
            let addr = gdaki_examples::cli::resolve(a, cli.port)?;
            let sockets = (0..cli.connections)
                .map(|_| Socket::connect(&ctx, addr, cfg.clone()))
                .collect::<gdaki::Result<Vec<Socket>>>()
                .with_context(|| format!("cannot connect to the echo server at {addr}"))?;
            let start = Instant::now();
            let roles = vec![BenchRole::Check; sockets.len()];
            let checked: u64 = runner
                .run(sockets, &roles, (cli.size, cli.iters), threads, false)?
                .iter()
                .map(|side| side.moved)
                .sum();
            let seconds = start.elapsed().as_secs_f64();
            let report = Report {
                mode: match runner {
                    Runner::Gpu(_) => "gpu",
                    Runner::Cpu => "cpu",
                },
                mem: mem_name,
                connections: cli.connections,
                bytes_per_message: cli.size,
                messages_per_connection: cli.iters,
                bytes_checked: checked,
                seconds,
                round_trips_per_s: (cli.connections as u64 * cli.iters as u64) as f64 / seconds,
                mib_s: checked as f64 / seconds / (1 << 20) as f64,
            };
            if cli.json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!(
                    "{} connection(s) ({} mode, rings {}): {} x {} B each, every byte echoed and checked\n\
                     {:.3} s, {:.0} round trips/s, {:.1} MiB/s echoed",
                    report.connections,
                    report.mode,
                    report.mem,
                    report.messages_per_connection,
                    report.bytes_per_message,
                    report.seconds,
                    report.round_trips_per_s,
                    report.mib_s
                );
            }
            Ok(())
        }
    }
}
