//! Setting a run up: the context (and GPU), memory for the test, and for two-process runs the
//! setup connection (perftest's socket) with the flags check and the barriers around each size.
use std::net::{SocketAddr, TcpListener};

use anyhow::{bail, Context as _};
use gdaki::cuda::{Gpu, GpuUuid};
use gdaki::handshake::{Channel, Hello};
use gdaki::{Access, Context, ContextOptions, MemoryRegion, Provider, Rings};
use serde::{Deserialize, Serialize};
use tracing::info;

use crate::cli::{Common, Plan, RingsArg, Role};

/// The flags that must be equal on both sides (perftest's "SYMMETRIC" ones), compared by the
/// server when the client says hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Symmetric {
    /// `put_bw` or `write_lat`.
    pub test: String,
    /// Sizes, in order.
    pub sizes: Vec<u64>,
    /// Iterations per size.
    pub iters: u32,
    /// Number of QPs.
    pub qps: u32,
    /// `-D` in seconds, if given.
    #[serde(default)]
    pub duration_s: Option<u64>,
    /// Not a flag: the UUID of the GPU whose device memory holds this side's buffers, if it is
    /// device memory, so the peer can say how bytes travel between the two. Never compared.
    #[serde(default)]
    pub buffers_gpu: Option<GpuUuid>,
}

impl Symmetric {
    /// The flags of `plan` that `test` needs both sides to share.
    pub fn of(test: &str, plan: &crate::cli::Plan, qps: u32) -> Symmetric {
        Symmetric {
            test: test.into(),
            sizes: plan.sizes.clone(),
            iters: plan.iters,
            qps,
            duration_s: plan.duration.map(|d| d.as_secs()),
            buffers_gpu: None,
        }
    }

    /// The `buffers_gpu` of the peer whose hello is `theirs`, if it sent one that reads.
    pub fn buffers_gpu_of(theirs: &Hello) -> Option<GpuUuid> {
        serde_json::from_slice::<Symmetric>(&theirs.app).ok()?.buffers_gpu
    }

    /// Why `theirs` (the client's) does not match `self` (the server's), flag by flag.
    pub fn mismatch(&self, theirs: &Symmetric) -> Option<String> {
        let mut why = Vec::new();
        if self.test != theirs.test {
            why.push(format!(
                "the client runs {}, this server {}",
                gdaki::wire::printable(&theirs.test),
                self.test
            ));
        }
        if self.sizes != theirs.sizes {
            let show = |s: &[u64]| match s {
                [one] => format!("-s {one}"),
                _ => format!("-a ({} sizes)", s.len()),
            };
            why.push(format!(
                "client {} vs server {}",
                show(&theirs.sizes),
                show(&self.sizes)
            ));
        }
        if self.iters != theirs.iters {
            why.push(format!("client -n {} vs server -n {}", theirs.iters, self.iters));
        }
        if self.duration_s != theirs.duration_s {
            let show = |d: Option<u64>| d.map_or("no -D".to_string(), |d| format!("-D {d}"));
            why.push(format!(
                "client {} vs server {}",
                show(theirs.duration_s),
                show(self.duration_s)
            ));
        }
        if self.qps != theirs.qps {
            why.push(format!("client -q {} vs server -q {}", theirs.qps, self.qps));
        }
        (!why.is_empty()).then(|| format!("test flags differ: {}", why.join("; ")))
    }
}

/// How the bytes of a two-process run travel between the two sides' buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerPath {
    /// One side's buffers are not device memory (or this is one process): as the header's
    /// memory line says.
    NotBothGpu,
    /// Both in device memory of the same GPU: a CUDA IPC mapping, copied inside that GPU.
    SameGpu,
    /// On another GPU, this one (ordinal here) reaches: a CUDA IPC mapping opened in the
    /// peer's GPU, copied GPU to GPU over NVLink or PCIe.
    Peer(usize),
    /// On another GPU with no P2P path to this one: bytes through both hosts' memory.
    NoP2p(usize),
    /// On a GPU this process does not see (`CUDA_VISIBLE_DEVICES`): whether it reaches the
    /// peer's is unknown here.
    Hidden,
}

impl PeerPath {
    /// The header's line.
    pub fn describe(self) -> String {
        match self {
            PeerPath::NotBothGpu => "as the memory line says".into(),
            PeerPath::SameGpu => "device memory of this GPU: CUDA IPC, copied inside the GPU".into(),
            PeerPath::Peer(g) => format!("device memory of GPU {g}: CUDA IPC, copied GPU to GPU (P2P)"),
            PeerPath::NoP2p(g) => format!("device memory of GPU {g}, no P2P path: bytes through host memory"),
            PeerPath::Hidden => "device memory of a GPU this process does not see".into(),
        }
    }
}

/// An open run: the context, the GPU when kernels post, and the setup connection when the peer
/// is another process.
pub struct Session {
    /// The provider's context.
    pub ctx: Context,
    /// The GPU, in GPU mode.
    pub gpu: Option<Gpu>,
    /// The setup connection (server or client).
    pub channel: Option<Channel>,
    /// Where [`alloc`](Self::alloc) puts buffers.
    pub mem: crate::cli::Mem,
    /// Loopback, server or client.
    pub role: Role,
    /// Where this side's queues keep their rings.
    pub rings: Rings,
}

impl Session {
    /// Opens the provider (and GPU), and connects to the peer process if there is one: the
    /// server waits for one client; the client fails at once on a refused connection.
    pub fn open(common: &Common, plan: &Plan) -> anyhow::Result<Session> {
        // The server listens before anything slow (loading the GPU's kernels takes seconds), so
        // a client started right after it is not refused.
        let listener = match &plan.role {
            Role::Server(port) => {
                let bind = SocketAddr::from(([0, 0, 0, 0], *port));
                Some(TcpListener::bind(bind).with_context(|| format!("listening on {bind}"))?)
            }
            _ => None,
        };
        let gpu = match plan.gpu {
            Some(i) => Some(Gpu::open(i).with_context(|| format!("GPU {i} (--mode cpu runs without one)"))?),
            None => None,
        };
        let mut options = ContextOptions::from_env();
        if let Some(d) = &common.device {
            options = options.device(d.clone());
        }
        let ctx = Context::open_with(common.provider, options)
            .with_context(|| format!("opening provider {}", common.provider))?;
        let channel =
            match (&plan.role, listener) {
                (Role::Server(_), Some(listener)) => {
                    // The port bound, which `-p 0` leaves to the system.
                    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
                    eprintln!("waiting for a client on port {port} ...");
                    let ch = match plan.accept_wait {
                        Some(wait) => Channel::accept_within(&listener, wait, plan.timeout),
                        None => Channel::accept(&listener, plan.timeout),
                    }
                    .context("accepting the client")?;
                    info!(peer = %ch.peer_addr(), "client connected");
                    Some(ch)
                }
                (Role::Client(addr), _) => Some(Channel::connect(*addr, plan.timeout).with_context(|| {
                    format!("cannot connect to the server at {addr} (is `--server` running there?)")
                })?),
                _ => None,
            };
        if let Some(ch) = &channel {
            // The transport listens on the interface that reaches the peer.
            ctx.listen(SocketAddr::new(ch.local_addr().ip(), 0))
                .context("starting the soft HCA's transport listener")?;
        }
        // `plan` refused --rings gpu without a GPU; auto places the rings as a NIC wants them
        // (GPU memory, read through dma-buf), a proxy included (CPU-assisted, as NVSHMEM's).
        let rings = match (common.rings, &gpu) {
            (RingsArg::Gpu, Some(g)) => Rings::Gpu(g.clone()),
            (RingsArg::Auto, Some(g)) if ctx.provider() == Provider::Mlx5 => Rings::Gpu(g.clone()),
            _ => Rings::Host,
        };
        Ok(Session {
            rings,
            ctx,
            gpu,
            channel,
            role: plan.role.clone(),
            mem: plan.mem,
        })
    }

    /// The GPU as reports name it (`NVIDIA H100 80GB HBM3, GPU 0`), in GPU mode.
    pub fn gpu_label(&self, ordinal: usize) -> Option<String> {
        self.gpu.as_ref().map(|g| {
            let name = g.context().name().unwrap_or_else(|_| "?".into());
            format!("{name}, GPU {ordinal}")
        })
    }

    /// The UUID of the GPU whose device memory [`alloc`](Self::alloc) uses (`--mem device` in
    /// GPU mode); `None` for host memory.
    pub fn buffers_gpu(&self) -> Option<GpuUuid> {
        let gpu = self.gpu.as_ref().filter(|_| self.mem == crate::cli::Mem::Device)?;
        gdaki::cuda::gpu_uuid(gpu.context()).ok()
    }

    /// How this side's device buffers and the peer's (`theirs`: the UUID of the GPU that holds
    /// them, from its hello) are connected.
    pub fn peer_path(&self, theirs: Option<GpuUuid>) -> PeerPath {
        let (Some(gpu), Some(mine), Some(theirs)) = (&self.gpu, self.buffers_gpu(), theirs) else {
            return PeerPath::NotBothGpu;
        };
        if mine == theirs {
            return PeerPath::SameGpu;
        }
        match gdaki::cuda::gpu_ordinal_of(&theirs) {
            None => PeerPath::Hidden,
            Some(ordinal) if gdaki::cuda::gpu_reaches(gpu.context(), &theirs) => PeerPath::Peer(ordinal),
            Some(ordinal) => PeerPath::NoP2p(ordinal),
        }
    }

    /// A send CQ for a queue pair of `plan.tx_depth` WQEs, in this side's rings, collapsed
    /// with `--collapsed-cq`.
    pub fn create_cq(&self, plan: &Plan) -> gdaki::Result<gdaki::CompletionQueue> {
        if plan.collapsed_cq {
            self.ctx.create_collapsed_cq_in(plan.tx_depth, &self.rings)
        } else {
            self.ctx.create_cq_in(plan.tx_depth, &self.rings)
        }
    }

    /// Where the rings are, as `--json` names it: `host` or `gpu`.
    pub fn rings_name(&self) -> &'static str {
        match self.rings {
            Rings::Host => "host",
            Rings::Gpu(_) => "gpu",
        }
    }

    /// The header block's lines every perftest has: device, provider, mode, handler, transport.
    pub fn header_lines(&self, plan: &Plan) -> Vec<(&'static str, String)> {
        let provider = self.ctx.provider().to_string();
        vec![
            ("Device", self.ctx.device_name()),
            ("Provider", provider),
            (
                "Mode",
                match self.gpu_label(plan.gpu.unwrap_or(0)) {
                    Some(g) => format!("gpu ({g})"),
                    None => "cpu (CPU threads run the device code)".into(),
                },
            ),
            ("Handler", plan.handler_line()),
            ("Rings", self.rings.to_string()),
            ("Connection type", "RC".into()),
            ("Transport", plan.role.transport()),
            ("TX depth", plan.tx_depth.to_string()),
        ]
    }

    /// With `--cpu-proxy`: a proxy ringing for `qps` (keep it while they post). Call it after the
    /// QPs are exported: it also notes in `plan` whether they fell back to the library's proxy.
    pub fn proxy<'a>(
        &self,
        plan: &mut Plan,
        qps: impl IntoIterator<Item = &'a gdaki::QueuePair>,
    ) -> anyhow::Result<Option<gdaki_proxy::Proxy>> {
        let qps: Vec<_> = qps.into_iter().collect();
        plan.fell_back = qps.iter().any(|q| q.fell_back());
        let Some(threads) = plan.proxy_threads else {
            return Ok(None);
        };
        let proxy = gdaki_proxy::Proxy::start(gdaki_proxy::ProxyConfig {
            threads,
            ..Default::default()
        })?;
        for q in qps {
            let target = q
                .proxy_target()
                .context("a queue pair for the proxy was created without the proxy handler")?;
            proxy.add(target);
        }
        Ok(Some(proxy))
    }

    /// `len` zeroed bytes for the test, where `--mem` says.
    pub fn alloc(&self, len: usize) -> anyhow::Result<MemoryRegion> {
        use crate::cli::Mem;
        Ok(match (&self.gpu, self.mem) {
            (Some(gpu), Mem::Pinned) => self.ctx.alloc_pinned_region(gpu, len, Access::ALL)?,
            (Some(gpu), Mem::Device) => self.ctx.alloc_device_region(gpu, len, Access::ALL)?,
            _ => self.ctx.alloc_region(len, Access::ALL)?,
        })
    }

    /// Says hello to the peer and returns its hello: the client speaks first and the server
    /// checks the test flags, rejecting a client whose flags differ (both sides then exit with
    /// the reason). `None` in loopback.
    pub fn exchange(&mut self, mine: &Symmetric, mut hello: Hello) -> anyhow::Result<Option<Hello>> {
        let role = self.role.clone();
        let Some(ch) = self.channel.as_mut() else {
            return Ok(None);
        };
        hello.app = serde_json::to_vec(mine)?;
        match role {
            Role::Client(_) => {
                ch.send(&hello)?;
                let theirs = ch.receive().context("the server's answer")?;
                // The client connects its queue pairs where the answer says: only to the host
                // it reached the server on, as the server checks the client.
                if let Some(why) = foreign_endpoints(&theirs, ch.peer_addr(), "server") {
                    let _ = ch.reject(&why);
                    bail!("{why}");
                }
                Ok(Some(theirs))
            }
            Role::Server(_) => {
                let theirs = ch.receive().context("the client's hello")?;
                let flags: Symmetric = serde_json::from_slice(&theirs.app).map_err(|e| {
                    anyhow::anyhow!(
                        "the client's test flags are unreadable ({}): is it a gdaki perftest of this version?",
                        // serde quotes what it could not read: the client's text.
                        gdaki::wire::printable(&e.to_string())
                    )
                })?;
                if let Some(why) = mine
                    .mismatch(&flags)
                    .or_else(|| foreign_endpoints(&theirs, ch.peer_addr(), "client"))
                {
                    let _ = ch.reject(&why);
                    bail!("{why}");
                }
                ch.send(&hello)?;
                Ok(Some(theirs))
            }
            Role::Loopback => Ok(None),
        }
    }

    /// The client's `bytes` (at most [`MAX_CLIENT_MESSAGE`]) reach the server, which returns
    /// them (its own `bytes` are not used); `None` on the client and in loopback. For what only
    /// the client knows: its result rows (so the server prints the table too, as perftest's
    /// does), the `-D` rounds.
    ///
    /// A message travels in frames of [`MAX_APP_BYTES`](gdaki::wire::MAX_APP_BYTES): every one
    /// full but the last, which may be empty, so the server knows where a message ends.
    pub fn from_client(&mut self, bytes: &[u8]) -> anyhow::Result<Option<Vec<u8>>> {
        use gdaki::wire::MAX_APP_BYTES;
        let role = self.role.clone();
        let Some(ch) = self.channel.as_mut() else {
            return Ok(None);
        };
        let frame = |app: &[u8]| Hello {
            app: app.to_vec(),
            endpoints: vec![],
            regions: vec![],
        };
        match role {
            Role::Client(_) => {
                if bytes.len() > MAX_CLIENT_MESSAGE {
                    bail!(
                        "a message for the server of {} bytes (at most {MAX_CLIENT_MESSAGE})",
                        bytes.len()
                    );
                }
                for chunk in bytes.chunks(MAX_APP_BYTES) {
                    ch.send(&frame(chunk))?;
                }
                if bytes.len() % MAX_APP_BYTES == 0 {
                    ch.send(&frame(&[]))?; // ends a message of whole frames (or none)
                }
                Ok(None)
            }
            Role::Server(_) => {
                let mut message = Vec::new();
                loop {
                    let part = ch.receive().context("the client's message")?.app;
                    message.extend_from_slice(&part);
                    if message.len() > MAX_CLIENT_MESSAGE {
                        bail!("the client's message is longer than {MAX_CLIENT_MESSAGE} bytes");
                    }
                    if part.len() < MAX_APP_BYTES {
                        return Ok(Some(message));
                    }
                }
            }
            Role::Loopback => Ok(None),
        }
    }

    /// A barrier with the peer that also carries this side's verdict: `Err` is sent to the peer
    /// as a rejection (and returned), and a peer's rejection comes back as an error. A no-op
    /// verdict check in loopback.
    pub fn agree(&mut self, step: u64, verdict: anyhow::Result<()>) -> anyhow::Result<()> {
        let Some(ch) = self.channel.as_mut() else {
            return verdict;
        };
        if let Err(e) = verdict {
            let _ = ch.reject(&crate::error_text(&e));
            return Err(e);
        }
        ch.sync(step).context("the peer")?;
        Ok(())
    }
}

/// perftest's address lines: this side's QPs (with the buffer it offers, if any), then the
/// peer's (with the buffer it offered). At most 4 QPs a side, as the header shows.
pub fn address_lines(
    mine: &[gdaki::Endpoint],
    my_region: Option<gdaki::wire::RemoteRegion>,
    peer: Option<&Hello>,
) -> Vec<(&'static str, String)> {
    let line = |e: &gdaki::Endpoint, r: Option<gdaki::wire::RemoteRegion>| {
        let mut t = format!("QPN {:#08x} PSN {:#08x}", e.qpn, e.psn);
        if let Some(r) = r {
            t.push_str(&format!(" RKey {:#010x} VAddr {:#018x}", r.rkey, r.addr));
        }
        t
    };
    let mut v: Vec<(&'static str, String)> = mine
        .iter()
        .take(4)
        .map(|e| ("local address", line(e, my_region)))
        .collect();
    if let Some(h) = peer {
        let r = h.regions.first().copied();
        v.extend(h.endpoints.iter().take(4).map(|e| ("remote address", line(e, r))));
    }
    v
}

/// Why the peer's (`who`: "client" or "server") endpoints cannot be served: each side connects
/// its QPs to the addresses in the other's, so they must be the peer's own host (the one the
/// setup connection runs to), or a peer could make this side open connections, carrying the
/// connection secret, anywhere.
fn foreign_endpoints(theirs: &Hello, peer: SocketAddr, who: &str) -> Option<String> {
    theirs
        .endpoints
        .iter()
        .filter_map(|e| e.addr)
        .find(|a| a.ip().to_canonical() != peer.ip().to_canonical())
        .map(|a| {
            let seen = if who == "client" {
                "it connects from"
            } else {
                "it answers on"
            };
            format!(
                "the {who}'s queue pairs are at {a}, another host than the {} {seen}",
                peer.ip()
            )
        })
}

/// The byte at `offset` of a `size`-byte test message: differs between sizes, so a stale
/// message of another size fails validation.
pub fn pattern(size: u64, offset: u64) -> u8 {
    (offset
        .wrapping_mul(131)
        .wrapping_add(size.wrapping_mul(7))
        .wrapping_add(1)
        % 251) as u8
}

/// The longest message [`Session::from_client`] carries: a sweep's result rows take a few KiB.
pub const MAX_CLIENT_MESSAGE: usize = 1 << 20;

/// `len` bytes of [`pattern`] for `size`, starting at `offset`.
pub fn pattern_bytes(size: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| pattern(size, offset + i)).collect()
}

/// Compares `len` bytes of `region` at `offset` with `want`, naming the first difference.
pub fn check_bytes(region: &MemoryRegion, offset: u64, want: &[u8], what: &str) -> anyhow::Result<()> {
    let mut got = vec![0u8; want.len()];
    region.read(offset, &mut got)?;
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => bail!(
            "validation failed: {what}: byte {} is {:#04x}, expected {:#04x}",
            offset + i as u64,
            got[i],
            want[i]
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's strings reach the server's terminal escaped: no control character of theirs
    /// (a terminal escape) is printed as it came.
    #[test]
    fn a_mismatch_shows_the_clients_strings_escaped() {
        let mine = Symmetric {
            test: "put_bw".into(),
            sizes: vec![8],
            iters: 10,
            qps: 1,
            duration_s: None,
            buffers_gpu: None,
        };
        let theirs = Symmetric {
            test: "\u{1b}]0;owned\u{7}\u{1b}[2Jwrite_lat".into(),
            ..mine.clone()
        };
        let why = mine.mismatch(&theirs).unwrap();
        assert!(!why.chars().any(char::is_control), "{why:?}");
        assert!(why.contains("write_lat") && why.contains("\\u{1b}"), "{why}");
    }

    fn hello_with(app: &[u8]) -> Hello {
        Hello {
            app: app.to_vec(),
            endpoints: vec![],
            regions: vec![],
        }
    }

    /// The peer's buffer GPU travels in its flags; flags without it (an older peer) or that do
    /// not read (a malformed one) name none.
    #[test]
    fn the_peer_buffers_gpu_is_read_from_its_flags_or_not_at_all() {
        let uuid = [
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff,
        ];
        let flags = Symmetric {
            test: "put_bw".into(),
            sizes: vec![8],
            iters: 1,
            qps: 1,
            duration_s: None,
            buffers_gpu: Some(uuid),
        };
        let of = |app: &[u8]| Symmetric::buffers_gpu_of(&hello_with(app));
        assert_eq!(of(&serde_json::to_vec(&flags).unwrap()), Some(uuid));
        let none = Symmetric {
            buffers_gpu: None,
            ..flags
        };
        assert_eq!(of(&serde_json::to_vec(&none).unwrap()), None);
        for bad in [
            r#"[0, 17]"#,
            r#""00112233445566778899aabbccddeeff""#,
            r#"[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,300]"#,
        ] {
            let app = format!(r#"{{"test":"put_bw","sizes":[8],"iters":1,"qps":1,"buffers_gpu":{bad}}}"#);
            assert_eq!(of(app.as_bytes()), None, "{bad}");
        }
        assert_eq!(of(br#"{"test":"put_bw","sizes":[8],"iters":1,"qps":1}"#), None);
        assert_eq!(of(b"not json"), None);
    }
}
