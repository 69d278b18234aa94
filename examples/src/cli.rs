//! The flags both perftests take, in perftest's spelling where it has one (`-s`, `-a`, `-n`,
//! `-q`, `-t`, `-d`, `-p`, `--report-gbits`), plus gdaki's own (provider, mode, scope, GPU
//! launch shape), and their check into a [`Plan`].
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Args, ValueEnum};
use gdaki::cuda::KernelScope;
use gdaki::Provider;

/// The smallest and largest sizes of an `-a` sweep (perftest's 2 B .. 8 MiB).
pub const SWEEP: (u64, u64) = (2, 8 << 20);
/// perftest's default setup port.
pub const DEFAULT_PORT: u16 = 18515;
/// Longest `-D`, per size: a day.
pub const MAX_DURATION_S: i64 = 86_400;

/// Who posts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// GPU kernels if a usable GPU is there, else CPU threads.
    Auto,
    /// GPU kernels.
    Gpu,
    /// CPU threads running the same device code.
    Cpu,
}

/// Who posts together on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Every thread posts on its own.
    Thread,
    /// Each warp posts as one (one reservation and one doorbell per warp).
    Warp,
    /// Each block posts as one.
    Block,
}

impl Scope {
    /// The kernel instantiation's scope.
    pub fn kernel(self) -> KernelScope {
        match self {
            Scope::Thread => KernelScope::Thread,
            Scope::Warp => KernelScope::Warp,
            Scope::Block => KernelScope::Block,
        }
    }
}

/// Where the test's buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mem {
    /// Host-pinned memory mapped into the GPU in GPU mode, plain host memory in CPU mode.
    Auto,
    /// Plain host memory.
    Host,
    /// Host memory pinned and mapped into the GPU.
    Pinned,
    /// GPU device memory (moved by the soft HCA's GPU copier).
    Device,
}

impl Mem {
    /// How reports name it.
    pub fn describe(self) -> &'static str {
        match self {
            Mem::Auto | Mem::Host => "host",
            Mem::Pinned => "host-pinned, mapped into the GPU",
            Mem::Device => "GPU device memory",
        }
    }
}

/// Where the queues' rings live (`--rings`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RingsArg {
    /// GPU memory on a real NIC in GPU mode, else host memory.
    Auto,
    /// Host memory (page-locked and mapped into the GPU in GPU mode).
    Host,
    /// GPU memory, which a NIC reads through a dma-buf export (GPU mode; with --cpu-proxy the
    /// posters write the doorbell records and the proxy forwards their doorbells).
    Gpu,
}

/// Flags common to `put_bw` and `write_lat`.
#[derive(Debug, Clone, Args)]
pub struct Common {
    /// Connect to a server at this address (host or host:port); without it, and without
    /// --server, both sides run in this process (loopback).
    pub server_address: Option<String>,
    /// Wait for a client (the passive side of a two-process run).
    #[arg(long)]
    pub server: bool,
    /// TCP port of the setup connection, on both sides.
    #[arg(short = 'p', long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Message size in bytes.
    #[arg(short = 's', long, allow_negative_numbers = true)]
    pub size: Option<u64>,
    /// Every power of two from 2 B to 8 MiB.
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Iterations (messages per QP, or round trips) per size.
    #[arg(short = 'n', long = "iters")]
    pub iters: Option<u32>,
    /// Send queue depth in WQEs (a power of two).
    #[arg(short = 't', long = "tx-depth")]
    pub tx_depth: Option<u32>,
    /// RDMA device (`mlx5_0`; the soft provider has one: "soft"). Unset: the first one.
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,
    /// Provider: soft, mlx5 or auto (mlx5 where a ConnectX device exists).
    #[arg(long, default_value = "auto")]
    pub provider: Provider,
    /// Who posts: GPU kernels, CPU threads, or auto (GPU if usable).
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    pub mode: Mode,
    /// GPU index.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Where the buffers live: host, pinned (host memory mapped into the GPU) or device (GPU
    /// memory); auto: pinned in GPU mode, host in CPU mode.
    #[arg(long, value_enum, default_value_t = Mem::Auto)]
    pub mem: Mem,
    /// Where the queues' rings live: host (page-locked, mapped into the GPU) or gpu (GPU
    /// memory; GPU mode, on a NIC: the soft HCA serves host rings only; with --cpu-proxy the
    /// posters write the doorbell records, CPU-assisted); auto: gpu on a real NIC in GPU
    /// mode, else host.
    #[arg(long, value_enum, default_value_t = RingsArg::Auto)]
    pub rings: RingsArg,
    /// Execution scope of the posting kernel.
    #[arg(long, value_enum, default_value_t = Scope::Thread)]
    pub scope: Scope,
    /// Ring doorbells from CPU proxy threads instead of the poster (posters publish their
    /// producer index; `gdaki-proxy` rings for them).
    #[arg(long)]
    pub cpu_proxy: bool,
    /// CPU proxy threads (with --cpu-proxy).
    #[arg(long, default_value_t = 1)]
    pub proxy_threads: usize,
    /// A reliable doorbell (DOCA's GPU_SM_NO_DBR, NCCL's NCCL_GDAKI_USE_RELIABLE_DB): queue
    /// pairs without a doorbell record, rung by the doorbell alone. Needs a device that has it
    /// (ConnectX-8; the soft HCA does).
    #[arg(long)]
    pub reliable_doorbell: bool,
    /// Collapsed CQs (DOCA's `cq_collapsed`): the HCA writes every CQE to one entry, which
    /// pollers read; a wait is done once the newest CQE is its WQE's or a later one's.
    #[arg(long)]
    pub collapsed_cq: bool,
    /// Seconds to wait for the peer during setup and for each wait of the data path (10). A
    /// server waits for its client this long only when the flag is given; without it, for
    /// ever, as perftest's servers do.
    #[arg(long)]
    pub timeout: Option<u64>,
    /// Print one JSON object on stdout instead of the header and table.
    #[arg(long)]
    pub json: bool,
    /// perftest's -F (do not fail on CPU frequency checks): accepted and ignored, since gdaki
    /// times with monotonic clocks, never cycle counters.
    #[arg(short = 'F', long = "CPU-freq")]
    pub cpu_freq: bool,
    /// perftest's -x: GID index. The soft device has one GID (index 0); on a ConnectX the mlx5
    /// provider takes it from GDAKI_GID_INDEX.
    #[arg(short = 'x', long = "gid-index")]
    pub gid_index: Option<u32>,
    /// perftest's -c: connection type. RC only.
    #[arg(short = 'c', long = "connection", default_value = "RC")]
    pub connection: String,
    /// perftest's -R / --rdma_cm: not supported (gdaki connects QPs through its own setup
    /// connection, as perftest does without -R).
    #[arg(short = 'R', long = "rdma_cm")]
    pub rdma_cm: bool,
    /// perftest's -D SECONDS: run each size for this many seconds, in rounds of -n
    /// iterations, instead of -n iterations once.
    #[arg(short = 'D', long = "duration", allow_negative_numbers = true)]
    pub duration: Option<i64>,
    /// perftest's -i PORT: the IB port; 1 only (each gdaki device has one port).
    #[arg(short = 'i', long = "ib-port")]
    pub ib_port: Option<u32>,
    /// perftest flags gdaki does not support, taken only to refuse them with the reason (else
    /// clap would suggest passing them as values): -b, -e, -l, -m, --run_infinitely.
    #[command(flatten)]
    pub unsupported: Unsupported,
}

/// perftest flags gdaki refuses, each with its reason ([`Unsupported::refusal`]).
#[derive(Debug, Clone, Default, Args)]
pub struct Unsupported {
    #[arg(short = 'b', long = "bidirectional", hide = true)]
    bidirectional: bool,
    #[arg(short = 'e', long = "events", hide = true)]
    events: bool,
    #[arg(short = 'l', long = "post_list", hide = true)]
    post_list: Option<String>,
    #[arg(short = 'm', long = "mtu", hide = true)]
    mtu: Option<String>,
    #[arg(long = "run_infinitely", hide = true)]
    run_infinitely: bool,
}

impl Unsupported {
    /// Why the first flag given cannot be served, or `None` when none was given.
    pub fn refusal(&self) -> Option<String> {
        let why = if self.bidirectional {
            "-b / --bidirectional is not supported: run a second pair in the other direction, on another -p port"
                .to_string()
        } else if self.events {
            "-e / --events is not supported: completions are polled (by GPU or CPU threads); there is no \
             completion channel to sleep on"
                .to_string()
        } else if let Some(n) = &self.post_list {
            format!("-l {n} / --post_list is not supported: threads post their own WQEs, not ibv_post_send lists")
        } else if let Some(m) = &self.mtu {
            format!("-m {m} / --mtu is not supported: queue pairs use the port's active MTU")
        } else if self.run_infinitely {
            format!("--run_infinitely is not supported: use -D SECONDS (at most {MAX_DURATION_S})")
        } else {
            return None;
        };
        Some(why)
    }
}

/// Where the peer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Both sides in this process.
    Loopback,
    /// Wait for a client on this port.
    Server(u16),
    /// Connect to this server.
    Client(SocketAddr),
}

impl Plan {
    /// Who rings the doorbells of the QPs this side posts on.
    pub fn handler(&self) -> gdaki::DoorbellHandler {
        match self.proxy_threads {
            Some(_) => gdaki::DoorbellHandler::CpuProxy,
            None => gdaki::DoorbellHandler::Gpu,
        }
    }

    /// The handler as `--json` names it: `direct` (the poster rings), `cpu-proxy`, or
    /// `cpu-proxy-fallback` (the library's proxy, because the doorbell page cannot be mapped).
    pub fn handler_name(&self) -> &'static str {
        match (self.proxy_threads, self.fell_back) {
            (Some(_), _) => "cpu-proxy",
            (None, true) => "cpu-proxy-fallback",
            (None, false) => "direct",
        }
    }

    /// The header block's handler line.
    pub fn handler_line(&self) -> String {
        let mut line = self.handler_said();
        if self.reliable_doorbell {
            line += ", reliable doorbell (no doorbell record)";
        }
        if self.collapsed_cq {
            line += ", collapsed CQ";
        }
        line
    }

    fn handler_said(&self) -> String {
        match self.proxy_threads {
            Some(n) => format!(
                "{} ({n} proxy thread{})",
                self.handler_name(),
                if n == 1 { "" } else { "s" }
            ),
            None if self.fell_back => format!(
                "{} (the doorbell page cannot be mapped into the GPU: the library's proxy thread rings)",
                self.handler_name()
            ),
            None => format!("{} (the poster rings the doorbell)", self.handler_name()),
        }
    }
}

impl Role {
    /// `loopback`, `server` or `client`, as `--json` reports it.
    pub fn name(&self) -> &'static str {
        match self {
            Role::Loopback => "loopback",
            Role::Server(_) => "server",
            Role::Client(_) => "client",
        }
    }

    /// The header block's transport line.
    pub fn transport(&self) -> String {
        match self {
            Role::Loopback => "in-process loopback".into(),
            Role::Server(port) => format!("server, setup port {port}"),
            Role::Client(a) => format!("client of {a}"),
        }
    }
}

/// Checked flags.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Loopback, server or client.
    pub role: Role,
    /// Sizes to run, ascending.
    pub sizes: Vec<u64>,
    /// Iterations per size, or per round with a duration.
    pub iters: u32,
    /// `-D`: run each size this long, in rounds of `iters`.
    pub duration: Option<Duration>,
    /// Send queue depth.
    pub tx_depth: u32,
    /// GPU or CPU (resolved).
    pub gpu: Option<usize>,
    /// Posting scope.
    pub scope: Scope,
    /// Where the buffers live (never `Auto`).
    pub mem: Mem,
    /// CPU proxy threads ringing the doorbells, or `None`: the posters ring.
    pub proxy_threads: Option<usize>,
    /// `--reliable-doorbell`: queue pairs without a doorbell record.
    pub reliable_doorbell: bool,
    /// `--collapsed-cq`: send CQs of one entry.
    pub collapsed_cq: bool,
    /// Whether the doorbell page could not be mapped into the GPU, so the library's fallback
    /// proxy rings instead of the posters (found when the QPs are exported).
    pub fell_back: bool,
    /// Bound of every wait.
    pub timeout: Duration,
    /// How long a server waits for its client (`None`: for ever, unless `--timeout` was given).
    pub accept_wait: Option<Duration>,
    /// The mode and why, in one line ("CPU mode (auto: no usable GPU: ...)").
    pub mode_line: String,
}

/// A value as it is typed on the command line (`warp`, not `Warp`).
fn flag_value(v: impl ValueEnum) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_owned())
}

/// Seconds each wait takes at most when `--timeout` is not given.
const DEFAULT_TIMEOUT_S: u64 = 10;

impl Common {
    /// Checks the flags; `default_size` and `default_iters` are the test's own defaults.
    pub fn plan(
        &self,
        default_size: u64,
        default_iters: u32,
        why_gpu_unusable: impl FnOnce() -> Option<String>,
    ) -> anyhow::Result<Plan> {
        if !(1..=64).contains(&self.proxy_threads) {
            bail!("--proxy-threads {}: 1 to 64", self.proxy_threads);
        }
        if !self.connection.eq_ignore_ascii_case("RC") {
            bail!(
                "-c {}: only RC (reliable connection) is supported; UC, UD, XRC and DC are not",
                self.connection
            );
        }
        if self.rdma_cm {
            bail!("-R / --rdma_cm is not supported: gdaki connects queue pairs through its own setup connection (-p)");
        }
        if let Some(why) = self.unsupported.refusal() {
            bail!("{why}");
        }
        if let Some(port) = self.ib_port.filter(|&p| p != 1) {
            bail!("-i {port}: port {port}: gdaki's devices have one port, 1");
        }
        let duration = match self.duration {
            None => None,
            Some(d) if (1..=MAX_DURATION_S).contains(&d) => Some(Duration::from_secs(d as u64)),
            Some(d) => bail!("-D {d}: a duration from 1 to {MAX_DURATION_S} seconds"),
        };
        if let Some(x) = self.gid_index.filter(|&x| x != 0) {
            // The variable serves a ConnectX only: on the soft device -x must be 0 whatever it says.
            let soft = match self.provider {
                Provider::Soft => true,
                Provider::Mlx5 => false,
                Provider::Auto => !gdaki::system::rdma_devices().iter().any(|d| d.mlx5),
            };
            let env = std::env::var(gdaki::GID_INDEX_VAR).ok();
            if soft || env.as_deref().map(str::trim) != Some(x.to_string().as_str()) {
                bail!(
                    "-x {x}: GID index {x}: the soft device has one GID (index 0); on a ConnectX set {}={x}, \
                     which the mlx5 provider reads when it opens the device",
                    gdaki::GID_INDEX_VAR
                );
            }
        }
        if let Some(d) = &self.device {
            if self.provider == Provider::Soft && d != "soft" {
                bail!("-d {d}: the soft provider has one device, \"soft\" (mlx5 devices need --provider mlx5 or auto)");
            }
        }
        let sizes = match (self.all, self.size) {
            (true, Some(_)) => bail!("-a and -s exclude each other"),
            (true, None) => (SWEEP.0.trailing_zeros()..=SWEEP.1.trailing_zeros())
                .map(|b| 1u64 << b)
                .collect(),
            (false, Some(0)) => bail!("-s 0: the message size must be at least 1 byte"),
            (false, Some(s)) if s > SWEEP.1 * 128 => bail!("-s {s}: at most {} bytes", SWEEP.1 * 128),
            (false, Some(s)) => vec![s],
            (false, None) => vec![default_size],
        };
        let iters = self.iters.unwrap_or(default_iters);
        if iters < 5 {
            bail!("-n {iters}: at least 5 iterations");
        }
        let tx_depth = self.tx_depth.unwrap_or(1024);
        if !tx_depth.is_power_of_two() || !(2..=32768).contains(&tx_depth) {
            bail!("-t {tx_depth}: the send queue depth must be a power of two from 2 to 32768");
        }
        let role = match (&self.server_address, self.server) {
            (Some(_), true) => bail!("--server and a server address exclude each other"),
            (None, true) => Role::Server(self.port),
            (None, false) => Role::Loopback,
            (Some(a), false) => Role::Client(resolve(a, self.port)?),
        };
        let (gpu, mode_line) = match self.mode {
            Mode::Cpu => (None, "CPU mode (--mode cpu)".to_string()),
            Mode::Gpu => match why_gpu_unusable() {
                None => (Some(self.gpu), format!("GPU mode on GPU {} (--mode gpu)", self.gpu)),
                Some(why) => bail!(
                    "--mode gpu: GPU {} is not usable (--mode cpu runs without one): {why}",
                    self.gpu
                ),
            },
            Mode::Auto => match why_gpu_unusable() {
                None => (Some(self.gpu), format!("GPU mode (auto: GPU {} is usable)", self.gpu)),
                Some(why) => (None, format!("CPU mode (auto: no usable GPU: {why})")),
            },
        };
        if gpu.is_none() && self.scope != Scope::Thread {
            bail!(
                "--scope {}: CPU mode posts from one CPU thread per QP (thread scope); warp and block scope need --mode gpu",
                flag_value(self.scope)
            );
        }
        let mem = match (self.mem, gpu) {
            (Mem::Auto, Some(_)) => Mem::Pinned,
            (Mem::Auto, None) => Mem::Host,
            (Mem::Device, None) => {
                bail!("--mem device: GPU memory needs --mode gpu (CPU mode uses host memory)")
            }
            (Mem::Pinned, None) => {
                bail!("--mem pinned: memory mapped into a GPU needs --mode gpu (CPU mode uses plain host memory)")
            }
            (m, _) => m,
        };
        if self.rings == RingsArg::Gpu && gpu.is_none() {
            bail!("--rings gpu: rings in GPU memory need --mode gpu (CPU threads post to host rings)");
        }
        if self.timeout == Some(0) {
            bail!("--timeout 0: at least one second");
        }
        Ok(Plan {
            role,
            sizes,
            iters,
            duration,
            tx_depth,
            gpu,
            scope: self.scope,
            mem,
            proxy_threads: self.cpu_proxy.then_some(self.proxy_threads),
            reliable_doorbell: self.reliable_doorbell,
            collapsed_cq: self.collapsed_cq,
            fell_back: false,
            timeout: Duration::from_secs(self.timeout.unwrap_or(DEFAULT_TIMEOUT_S)),
            accept_wait: self.timeout.map(Duration::from_secs),
            mode_line,
        })
    }
}

/// `host`, `host:port` or `[v6]:port`, resolved; the port defaults to `-p`'s.
pub fn resolve(addr: &str, port: u16) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let with_port = if addr.parse::<std::net::IpAddr>().is_ok() || !addr.contains(':') {
        format!("{}:{port}", addr.trim_matches(['[', ']']))
    } else {
        addr.to_string()
    };
    let with_port = match with_port.parse::<std::net::Ipv6Addr>() {
        Ok(_) => format!("[{with_port}]"),
        Err(_) => with_port,
    };
    let mut it = with_port
        .to_socket_addrs()
        .or_else(|_| format!("[{}]:{port}", addr.trim_matches(['[', ']'])).to_socket_addrs())
        .with_context(|| format!("cannot resolve the server address {addr:?}"))?;
    it.next()
        .with_context(|| format!("the server address {addr:?} resolves to nothing"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_resolve_with_and_without_ports() {
        assert_eq!(resolve("127.0.0.1", 7).unwrap(), "127.0.0.1:7".parse().unwrap());
        assert_eq!(resolve("127.0.0.1:9", 7).unwrap(), "127.0.0.1:9".parse().unwrap());
        assert_eq!(resolve("::1", 7).unwrap(), "[::1]:7".parse().unwrap());
        assert_eq!(resolve("[::1]:9", 7).unwrap(), "[::1]:9".parse().unwrap());
        assert!(resolve("no.such.host.invalid", 7).is_err());
    }
}
