//! Helpers shared by the host library's integration tests.
#![allow(dead_code)] // each test crate uses a different subset

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::thread::JoinHandle;

use gdaki::cuda::Gpu;
use gdaki::socket::{Socket, SocketConfig, SocketListener};
use gdaki::{Context, MemoryRegion, QpConfig, QueuePair};

/// A queue pair of `sq` WQEs with a CQ of its own (which the QP keeps alive).
pub fn qp(ctx: &Context, sq: u32, cfg: QpConfig) -> QueuePair {
    let cq = ctx.create_cq(sq).unwrap();
    ctx.create_qp(&cq, QpConfig { sq_size: sq, ..cfg }).unwrap()
}

/// [`qp`], connected to itself.
pub fn loopback_qp(ctx: &Context, sq: u32, cfg: QpConfig) -> QueuePair {
    let qp = qp(ctx, sq, cfg);
    qp.connect(&qp.endpoint()).unwrap();
    qp
}

/// A soft-HCA context, a loopback queue pair of `sq` WQEs and a 1 MiB region (the stream
/// tests' set-up).
pub fn soft_loopback(sq: u32) -> (Context, QueuePair, MemoryRegion) {
    let ctx = Context::open(gdaki::Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, sq, QpConfig::default());
    let mr = ctx.alloc_region(1 << 20, gdaki::Access::ALL).unwrap();
    (ctx, qp, mr)
}

/// A socket listener on loopback in a soft-HCA context of its own.
pub fn socket_listener(cfg: &SocketConfig) -> (SocketListener, SocketAddr, Context) {
    let ctx = Context::open(gdaki::Provider::Soft).unwrap();
    let l = SocketListener::bind(&ctx, "127.0.0.1:0".parse().unwrap(), cfg.clone()).unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr, ctx)
}

/// A connected socket pair on loopback, `(server side, client side)`, each side with its own
/// configuration, in a context of its own.
pub fn socket_pair(server: SocketConfig, client: SocketConfig) -> (Socket, Socket) {
    let (l, addr, _sctx) = socket_listener(&server);
    let accepted = std::thread::spawn(move || l.accept().unwrap());
    let cctx = Context::open(gdaki::Provider::Soft).unwrap();
    let c = Socket::connect(&cctx, addr, client).unwrap();
    (accepted.join().unwrap(), c)
}

/// A CPU stream whose waits give up after 10 s.
pub fn cpu_stream() -> gdaki::stream::CpuStream {
    gdaki::stream::CpuStream::new(std::time::Duration::from_secs(10)).unwrap()
}

/// `len` pseudo-random bytes from `seed` (xorshift), so every test's data is distinct.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Reads a library-owned region into a new vector.
pub trait ReadVec {
    /// `len` bytes at `offset`.
    fn read_vec(&self, offset: u64, len: usize) -> gdaki::Result<Vec<u8>>;
}

impl ReadVec for MemoryRegion {
    fn read_vec(&self, offset: u64, len: usize) -> gdaki::Result<Vec<u8>> {
        let mut v = vec![0; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }
}

/// A soft-HCA "responder" that accepts one transport connection and then never answers (a
/// host that vanished without closing anything). It swallows requests until the requester
/// closes; join the handle after dropping the QP.
pub fn silent_peer() -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let handle = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut connect = [0u8; gdaki::wire::HEADER_LEN + gdaki::wire::CONNECT_LEN];
        s.read_exact(&mut connect).unwrap();
        let target = u32::from_be_bytes(connect[gdaki::wire::HEADER_LEN + 12..][..4].try_into().unwrap());
        s.write_all(&gdaki::wire::encode_accept(target)).unwrap();
        // The requester's shared-memory offer (a header, then a name): declined, it stays on
        // TCP, where nothing answers.
        let mut head = [0u8; gdaki::wire::HEADER_LEN];
        s.read_exact(&mut head).unwrap();
        let h = gdaki::wire::Header::parse(&head).unwrap();
        assert_eq!(h.kind, gdaki::wire::Kind::ShmOffer);
        s.read_exact(&mut vec![0u8; h.len as usize]).unwrap();
        s.write_all(&gdaki::wire::encode_shm_answer(false)).unwrap();
        let mut sink = [0u8; 4096];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    (addr, handle)
}

/// Logs the library's tracing events to stderr when `RUST_LOG` is set.
pub fn log_from_env() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
}

/// GPU tests run one at a time, so one test's kernel never waits behind another's (the
/// kernels share the legacy stream) and timing-bounded checks stay meaningful.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Opens GPU 0 (holding the GPU-test lock until the returned guard drops) or reports the skip.
/// Writes to the raw stderr handle because the test harness captures `eprintln!` of passing
/// tests, and a skip must be seen.
pub fn gpu_or_skip(test: &str) -> Option<(Gpu, std::sync::MutexGuard<'static, ()>)> {
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    log_from_env();
    let required = std::env::var("GDAKI_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match Gpu::open(0) {
        Ok(gpu) => Some((gpu, guard)),
        Err(e) if !required => {
            let _ = writeln!(std::io::stderr(), "SKIPPED (no usable GPU): {test}: {e}");
            None
        }
        Err(e) => panic!("GDAKI_REQUIRE_GPU=1 but no usable GPU: {e}"),
    }
}

/// Whether this machine has at least `n` usable GPUs; says `SKIPPED (needs N GPUs)` where not
/// (also under `GDAKI_REQUIRE_GPU=1`, which asks for one GPU, not several).
pub fn has_gpus(test: &str, n: usize) -> bool {
    let found = gdaki::cuda::probe().map_or(0, |i| i.gpus.len());
    if found < n {
        let _ = writeln!(std::io::stderr(), "SKIPPED (needs {n} GPUs, found {found}): {test}");
    }
    found >= n
}

/// This test binary run a second time as the peer process of a two-process test: only its
/// test `peer_process`, which does nothing unless the environment `env` sets says so, and
/// which prints `PORT <n>` once it listens. Killed when dropped.
pub struct PeerProcess {
    /// The child.
    pub child: std::process::Child,
    /// The port it said it listens on.
    pub port: u16,
}

impl PeerProcess {
    /// The command that runs this test binary's `peer_process` test alone, with `env` set.
    pub fn command(env: &[(&str, &str)]) -> std::process::Command {
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args(["--exact", "peer_process", "--nocapture", "--test-threads", "1"])
            .envs(env.iter().copied());
        c
    }

    /// Starts the peer with `env` set and waits for its port.
    pub fn spawn(env: &[(&str, &str)]) -> PeerProcess {
        use std::io::BufRead;
        let mut child = PeerProcess::command(env)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(out).lines();
        let port = loop {
            let line = lines.next().expect("peer exited before saying its port").unwrap();
            // The harness prints "test peer_process ... " on the same line.
            if let Some(i) = line.find("PORT ") {
                break line[i + 5..].trim().parse().unwrap();
            }
        };
        // Keep draining its stdout so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        PeerProcess { child, port }
    }

    /// Connects to the peer's handshake, says hello with `app` and `q`'s endpoint, and returns
    /// the channel and the peer's hello.
    pub fn hello(&self, app: &[u8], q: &QueuePair) -> (gdaki::handshake::Channel, gdaki::handshake::Hello) {
        let at = SocketAddr::from(([127, 0, 0, 1], self.port));
        let mut ch = gdaki::handshake::Channel::connect(at, std::time::Duration::from_secs(30)).unwrap();
        ch.send(&gdaki::handshake::Hello {
            app: app.to_vec(),
            endpoints: vec![q.endpoint()],
            regions: vec![],
        })
        .unwrap();
        let theirs = ch.receive().unwrap();
        (ch, theirs)
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
