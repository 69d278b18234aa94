//! Reliable byte-stream sockets over queue pairs (GPUnet's model; `docs/sockets.md` has the wire
//! protocol): a [`SocketListener`] accepts, [`Socket::connect`] connects, through gdaki's
//! handshake at `host:port`; [`Socket::send`] and [`Socket::recv`] move bytes with POSIX results
//! (partial allowed, 0 at an orderly close), `try_` forms never wait, and every wait is
//! bounded by [`SocketConfig::timeout`]. The data path is `gdaki_device::socket`, the code a
//! kernel runs too; here CPU threads run it.
//!
//! ```
//! use gdaki::socket::{Socket, SocketConfig, SocketListener};
//! use gdaki::{Context, Provider};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server_ctx = Context::open(Provider::Soft)?;
//! let listener = SocketListener::bind(&server_ctx, "127.0.0.1:0".parse()?, SocketConfig::default())?;
//! let addr = listener.local_addr()?;
//! let server = std::thread::spawn(move || -> gdaki::Result<Vec<u8>> {
//!     let s = listener.accept()?;
//!     let mut buf = vec![0u8; 64];
//!     let n = s.recv(&mut buf)?;
//!     s.send(&buf[..n])?; // echo
//!     Ok(buf[..n].to_vec())
//! });
//! let ctx = Context::open(Provider::Soft)?;
//! let s = Socket::connect(&ctx, addr, SocketConfig::default())?;
//! assert_eq!(s.send(b"hello, socket")?, 13);
//! let mut back = [0u8; 13];
//! assert_eq!(s.recv(&mut back)?, 13);
//! assert_eq!(&back, b"hello, socket");
//! assert_eq!(server.join().unwrap()?, b"hello, socket");
//! # Ok(()) }
//! ```
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use gdaki_device::socket::SocketError;
use std::sync::Mutex;

use gdaki_device::Gpu as Shared;
use gdaki_devx::HostBuffer;
use gdaki_layout::socket::{self as layout, DevSocket, DEV_SOCKET_VERSION};

pub use crate::error::SocketFailure;

mod service;
use crate::error::{check_pow2, Error, Result};
use crate::handshake::{Channel, Hello};
use crate::{Access, CompletionQueue, Context, MemoryRegion, QpConfig, QueuePair};
pub use service::SocketService;

/// Where a socket's receive window and staging ring live.
#[derive(Debug, Clone, Default)]
pub enum SocketMemory {
    /// Host memory: CPU threads use the socket ([`Socket::send`], ...).
    #[default]
    Host,
    /// Host memory mapped into this GPU: CPU threads use the socket, or, exported to the GPU
    /// ([`Socket::into_gpu`]), its kernels (which reach the rings over PCIe).
    Pinned(gdaki_cuda::Gpu),
    /// This GPU's memory (GPUnet's network buffers): only its kernels use the socket, once
    /// exported; the HCA writes the bytes into GPU memory.
    Device(gdaki_cuda::Gpu),
}

/// How a socket is made.
#[derive(Debug, Clone)]
pub struct SocketConfig {
    /// Bytes of this side's receive ring: a power of two, 4 KiB to 1 GiB (default 64 KiB).
    /// The peer's staging ring for this direction is as large. A sender waits for credit once
    /// a ring is unread, so a bulk stream wants a ring that holds what it sends during a
    /// credit's round trip: megabytes between two processes' GPUs (docs/sockets.md, "Ring
    /// size"; `sock_bw` takes 8 MiB).
    pub rx_bytes: u64,
    /// How long a wait (for room, for bytes, for the peer in the handshake) may take.
    pub timeout: Duration,
    /// Send queue size of the socket's queue pair: a power of two, [`MIN_SQ_SIZE`] to
    /// [`MAX_SQ_SIZE`] (default 256).
    pub sq_size: u32,
    /// Where the rings live (default host memory).
    pub memory: SocketMemory,
}

impl Default for SocketConfig {
    fn default() -> Self {
        SocketConfig {
            rx_bytes: 64 << 10,
            timeout: Duration::from_secs(10),
            sq_size: 256,
            memory: SocketMemory::Host,
        }
    }
}

impl SocketMemory {
    /// The GPU that reaches the rings ([`Pinned`](Self::Pinned) or [`Device`](Self::Device)
    /// memory of it), or `None` for host memory.
    pub fn gpu(&self) -> Option<&gdaki_cuda::Gpu> {
        match self {
            SocketMemory::Host => None,
            SocketMemory::Pinned(g) | SocketMemory::Device(g) => Some(g),
        }
    }
}

impl SocketConfig {
    /// `len` bytes of registered memory where [`memory`](Self::memory) says.
    fn alloc(&self, ctx: &Context, len: usize) -> Result<MemoryRegion> {
        match &self.memory {
            SocketMemory::Host => ctx.alloc_region(len, Access::ALL),
            SocketMemory::Pinned(gpu) => ctx.alloc_pinned_region(gpu, len, Access::ALL),
            SocketMemory::Device(gpu) => ctx.alloc_device_region(gpu, len, Access::ALL),
        }
    }

    /// Checks the sizes: the receive ring's log2, or why not.
    fn checked(&self) -> Result<u32> {
        // A send takes up to two frames of a WQE each (from registered memory too: one
        // gathered WRITE), and credits, `fin` and `reset` share the queue.
        check_pow2("a socket's send queue", self.sq_size.into(), MIN_SQ_SIZE, MAX_SQ_SIZE)?;
        self.log_rx()
    }

    fn log_rx(&self) -> Result<u32> {
        check_pow2(
            "a socket's receive ring",
            self.rx_bytes,
            1 << layout::MIN_LOG_RING,
            1 << layout::MAX_LOG_RING,
        )
    }
}

impl SocketFailure {
    fn of(e: SocketError, timeout: Duration) -> SocketFailure {
        match e {
            SocketError::WouldBlock => SocketFailure::WouldBlock,
            SocketError::Reset => SocketFailure::Reset,
            SocketError::Closed => SocketFailure::Closed,
            SocketError::TimedOut => SocketFailure::TimedOut(timeout),
            SocketError::BadHandle { version } => SocketFailure::Lost(format!("bad socket handle {version:#x}")),
            SocketError::Post(p) => SocketFailure::Lost(format!("a post failed: {p:?}")),
            SocketError::Lost(w) => SocketFailure::Lost(format!("{w:?}")),
            // A leader's code, or the socket service's answers (a socket's own calls never
            // give those).
            e @ (SocketError::Failed { .. } | SocketError::Refused | SocketError::BadArgument) => {
                SocketFailure::Lost(gdaki_device::status::Code(e.code()).to_string())
            }
        }
    }
}

/// The smallest send queue a socket takes ([`SocketConfig::sq_size`]).
pub const MIN_SQ_SIZE: u64 = 8;

/// The largest send queue a socket takes ([`SocketConfig::sq_size`]).
pub const MAX_SQ_SIZE: u64 = 1 << 15;

/// The most bytes of application data a connection carries in its hello ([`Socket::connect_with`]).
pub const MAX_CONNECT_DATA: usize = 1024;

/// `gdaki-socket/N log_rx=L key=K` (N the protocol version, K this side's frame key in hex),
/// then a newline and the application's data: what each side's hello says.
fn hello_app(log_rx: u32, key: u64, data: &[u8]) -> Vec<u8> {
    let mut app = format!(
        "gdaki-socket/{} log_rx={log_rx} key={key:x}\n",
        layout::PROTOCOL_VERSION
    )
    .into_bytes();
    app.extend_from_slice(data);
    app
}

/// The application data after the protocol line of a hello.
fn app_data(app: &[u8]) -> &[u8] {
    app.iter().position(|&b| b == b'\n').map_or(&[][..], |i| &app[i + 1..])
}

/// The peer's `log_rx` and frame key, or why its hello is not a socket's of this version.
fn peer_params(app: &[u8]) -> std::result::Result<(u32, u64), String> {
    let line = app.split(|&b| b == b'\n').next().unwrap_or_default();
    let text = std::str::from_utf8(line).map_err(|_| "its hello is not a socket's".to_string())?;
    let want = format!("gdaki-socket/{} log_rx=", layout::PROTOCOL_VERSION);
    let Some(rest) = text.strip_prefix(&want) else {
        return Err(format!("it speaks {text:?}, this side {want}N key=K"));
    };
    let (log, key) = rest.split_once(" key=").unwrap_or((rest, ""));
    let log = log
        .parse::<u32>()
        .ok()
        .filter(|l| (layout::MIN_LOG_RING..=layout::MAX_LOG_RING).contains(l))
        .ok_or_else(|| format!("its receive ring (log2 {log:?}) is out of range"))?;
    let key = u64::from_str_radix(key, 16)
        .ok()
        .filter(|&k| k != 0)
        .ok_or_else(|| format!("its frame key {key:?} is not a non-zero hex number"))?;
    Ok((log, key))
}

/// A fresh frame key for a receive ring: random, so that nothing but this connection's frames
/// (not a zeroed ring, not an earlier connection's bytes) passes for one.
fn frame_key() -> Result<u64> {
    gdaki_devx::util::random_secret().ok_or_else(|| Error::Io {
        what: "drawing a socket's frame key",
        source: std::io::Error::other("the OS random generator failed"),
    })
}

/// A socket's resources before the peer is known: the queue pair and the receive window.
struct Half {
    qp: QueuePair,
    rx: MemoryRegion,
    log_rx: u32,
    /// The tag key of the frames the peer writes into `rx`.
    key: u64,
    memory: SocketMemory,
}

impl Half {
    fn new(ctx: &Context, cfg: &SocketConfig) -> Result<Half> {
        let log_rx = cfg.checked()?;
        let cq: CompletionQueue = ctx.create_cq(cfg.sq_size)?;
        let qp = ctx.create_qp(
            &cq,
            QpConfig {
                sq_size: cfg.sq_size,
                timeout: cfg.timeout,
                retry_timeout: cfg.timeout.mul_f64(0.8),
                // Where the device has it (a ConnectX-8, the soft HCA): one doorbell store a
                // send and no fence after it (`Qp::ring`), 64 KiB sends across two GPUs 9.7 ->
                // 12.5 GB/s (docs/figures.md, "Credits and the doorbell's last fence").
                reliable_doorbell: ctx.supports_reliable_doorbell(),
                ..QpConfig::default()
            },
        )?;
        let rx = cfg.alloc(ctx, (layout::CONTROL_BYTES + (1u64 << log_rx)) as usize)?;
        Ok(Half {
            qp,
            rx,
            log_rx,
            key: frame_key()?,
            memory: cfg.memory.clone(),
        })
    }

    fn hello(&self, data: &[u8]) -> Hello {
        Hello {
            app: hello_app(self.log_rx, self.key, data),
            endpoints: vec![self.qp.endpoint()],
            regions: vec![self.rx.remote_region()],
        }
    }

    /// Connects to the peer that said `theirs` and makes the socket.
    fn finish(self, ctx: &Context, theirs: &Hello, peer: SocketAddr, timeout: Duration) -> Result<Socket> {
        let bad = |why: String| Error::Rejected {
            peer: peer.to_string(),
            reason: why,
        };
        let (log_tx, tx_key) = peer_params(&theirs.app).map_err(bad)?;
        let (Some(ep), Some(window)) = (theirs.endpoints.first(), theirs.regions.first()) else {
            return Err(bad("its hello carries no queue pair or no window".into()));
        };
        if window.len != layout::CONTROL_BYTES + (1u64 << log_tx) {
            return Err(bad(format!(
                "its window is {} bytes, its ring says {}",
                window.len,
                layout::CONTROL_BYTES + (1u64 << log_tx)
            )));
        }
        self.qp.connect(ep)?;
        let tx = SocketConfig {
            memory: self.memory.clone(),
            ..SocketConfig::default()
        }
        .alloc(ctx, 1usize << log_tx)?;
        let handle = HostBuffer::new("a socket handle", std::mem::size_of::<DevSocket>())?;
        let h = DevSocket {
            qp: self.qp.device_handle() as u64,
            rx_window: self.rx.addr(),
            tx_ring: tx.addr(),
            peer_window: window.addr,
            rx_lkey: self.rx.lkey(),
            tx_lkey: tx.lkey(),
            peer_rkey: window.rkey,
            log_rx: self.log_rx,
            log_tx,
            rx_key: self.key,
            tx_key,
            version: DEV_SOCKET_VERSION,
            ..bytemuck::Zeroable::zeroed()
        };
        // SAFETY: a fresh page-aligned buffer of the handle's size.
        unsafe { (handle.as_ptr() as *mut DevSocket).write(h) };
        // SAFETY: the handle and everything it names live in the returned Socket, the queue
        // pair's only poster; it lets one sender and one receiver in at a time (its locks), and
        // the queue pair's Gpu sharing mode takes them posting at once.
        let dev = unsafe { gdaki_device::socket::Socket::<Shared>::from_raw(handle.as_ptr() as *mut DevSocket) }
            .map_err(|e| Error::Unsupported {
                what: "a socket handle",
                why: format!("{e:?}"),
            })?;
        Ok(Socket {
            dev,
            send_lock: Mutex::new(()),
            recv_lock: Mutex::new(()),
            handle,
            qp: self.qp,
            _rx: self.rx,
            tx,
            peer,
            timeout,
            memory: self.memory,
            exported: false,
            peer_data: app_data(&theirs.app).to_vec(),
        })
    }
}

/// Accepts socket connections at a TCP address (gdaki's handshake).
pub struct SocketListener {
    tcp: TcpListener,
    ctx: Context,
    cfg: SocketConfig,
}

impl std::fmt::Debug for SocketListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketListener")
            .field("addr", &self.tcp.local_addr().ok())
            .finish()
    }
}

impl SocketListener {
    /// Listens at `addr` (port 0: any free port) for sockets on `ctx`'s device (whose soft
    /// transport then listens on the same interface).
    pub fn bind(ctx: &Context, addr: SocketAddr, cfg: SocketConfig) -> Result<SocketListener> {
        cfg.checked()?;
        let tcp = TcpListener::bind(addr).map_err(|source| Error::Io {
            what: "binding a socket listener",
            source,
        })?;
        // The soft transport listens where clients reach this side; for an address of every
        // interface, the first accepted connection says which.
        if !addr.ip().is_unspecified() {
            ctx.listen(SocketAddr::new(addr.ip(), 0))?;
        }
        Ok(SocketListener {
            tcp,
            ctx: ctx.clone(),
            cfg,
        })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.tcp.local_addr().map_err(|source| Error::Io {
            what: "reading a socket listener's address",
            source,
        })
    }

    /// Waits (without bound) for a client and makes its socket. A client that speaks another
    /// protocol is refused (it hears why) and the error returned here.
    pub fn accept(&self) -> Result<Socket> {
        self.accept_from(Channel::accept(&self.tcp, self.cfg.timeout)?)
    }

    /// [`accept`](Self::accept), waiting at most `wait` for a client
    /// ([`Error::Timeout`] then).
    pub fn accept_within(&self, wait: Duration) -> Result<Socket> {
        self.accept_from(Channel::accept_within(&self.tcp, wait, self.cfg.timeout)?)
    }

    fn accept_from(&self, mut ch: Channel) -> Result<Socket> {
        self.ctx.listen(SocketAddr::new(ch.local_addr().ip(), 0))?;
        let theirs = ch.receive()?;
        if let Err(why) = peer_params(&theirs.app) {
            let _ = ch.reject(&why);
            return Err(Error::Rejected {
                peer: ch.peer_addr().to_string(),
                reason: why,
            });
        }
        let half = Half::new(&self.ctx, &self.cfg)?;
        ch.send(&half.hello(&[]))?;
        let socket = half.finish(&self.ctx, &theirs, ch.peer_addr(), self.cfg.timeout)?;
        ch.sync(1)?;
        Ok(socket)
    }
}

/// A connected byte-stream socket (CPU side). One thread may send while another receives;
/// concurrent senders (or receivers) take turns.
pub struct Socket {
    // Declared first: it names the handle, queue pair and regions below.
    dev: gdaki_device::socket::Socket<Shared>,
    /// Held by the sending side's calls.
    send_lock: Mutex<()>,
    /// Held by the receiving side's calls.
    recv_lock: Mutex<()>,
    handle: HostBuffer,
    qp: QueuePair,
    _rx: MemoryRegion,
    /// The staging ring (its context is the one a send's source region must share).
    tx: MemoryRegion,
    peer: SocketAddr,
    timeout: Duration,
    memory: SocketMemory,
    /// Handed to a GPU ([`into_gpu`](Socket::into_gpu)): its state lives there now.
    exported: bool,
    /// The application data of the peer's hello.
    peer_data: Vec<u8>,
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: the live handle, read as plain data.
        let h = unsafe { (self.handle.as_ptr() as *const DevSocket).read_volatile() };
        f.debug_struct("Socket")
            .field("peer", &self.peer)
            .field("sent", &h.sent)
            .field("received", &h.consumed)
            .finish()
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        if self.exported || matches!(self.memory, SocketMemory::Device(_)) {
            return;
        }
        if let Err(e) = self.dev.flush() {
            tracing::debug!(peer = %self.peer, "socket dropped before its last posts completed: {e:?}");
        }
    }
}

// SAFETY: the socket owns every resource its raw pointers name (handle, queue pair, regions);
// moving it to another thread moves them all.
unsafe impl Send for Socket {}
// SAFETY: shared use goes through the locks (one sender, one receiver at a time) and the
// queue pair's Gpu sharing mode, which takes concurrent posters and pollers; `reset` and
// `flush` are safe beside both (atomic flags, shared-mode posting).
unsafe impl Sync for Socket {}

fn hold(m: &Mutex<()>) -> std::sync::MutexGuard<'_, ()> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Socket {
    /// Connects to a [`SocketListener`] at `addr` with `ctx`'s device.
    pub fn connect(ctx: &Context, addr: SocketAddr, cfg: SocketConfig) -> Result<Socket> {
        Socket::connect_with(ctx, addr, cfg, &[])
    }

    /// [`connect`](Self::connect), handing the server `data` (at most [`MAX_CONNECT_DATA`]
    /// bytes) with the connection: its accepted socket's [`peer_data`](Self::peer_data).
    pub fn connect_with(ctx: &Context, addr: SocketAddr, cfg: SocketConfig, data: &[u8]) -> Result<Socket> {
        if data.len() > MAX_CONNECT_DATA {
            return Err(Error::OutOfRange {
                what: "a socket's connection data",
                got: data.len() as u64,
                min: 0,
                max: MAX_CONNECT_DATA as u64,
            });
        }
        // Refused before anything is made (a connection the server would have to drop).
        cfg.checked()?;
        let mut ch = Channel::connect(addr, cfg.timeout)?;
        ctx.listen(SocketAddr::new(ch.local_addr().ip(), 0))?;
        let half = Half::new(ctx, &cfg)?;
        ch.send(&half.hello(data))?;
        let theirs = ch.receive()?;
        let socket = half.finish(ctx, &theirs, addr, cfg.timeout)?;
        ch.sync(1)?;
        Ok(socket)
    }

    /// Sends up to `data.len()` bytes, waiting (bounded) for room in the peer's ring: how many
    /// were sent (a partial send when the ring had less room). `data` may be reused at once.
    pub fn send(&self, data: &[u8]) -> Result<usize, SocketFailure> {
        self.on_cpu()?;
        let _turn = hold(&self.send_lock);
        self.dev.send(data).map_err(|e| SocketFailure::of(e, self.timeout))
    }

    /// [`send`](Self::send) without waiting: [`SocketFailure::WouldBlock`] when the ring is full.
    pub fn try_send(&self, data: &[u8]) -> Result<usize, SocketFailure> {
        self.on_cpu()?;
        let _turn = hold(&self.send_lock);
        self.dev.try_send(data).map_err(|e| SocketFailure::of(e, self.timeout))
    }

    /// Sends up to `len` bytes of `region` from `offset` without copying them into the
    /// staging ring: the HCA reads them from the region after the call returns, so they must
    /// stay unchanged until [`flush`](Self::flush) returns. Otherwise as [`send`](Self::send).
    /// [`SocketFailure::BadSource`] (nothing sent) where the region does not hold those bytes
    /// or belongs to another context.
    pub fn send_from(&self, region: &MemoryRegion, offset: u64, len: u64) -> Result<usize, SocketFailure> {
        let src = self.source(region, offset, len)?;
        let _turn = hold(&self.send_lock);
        self.dev
            .send_from(src, len)
            .map_err(|e| SocketFailure::of(e, self.timeout))
    }

    /// [`send_from`](Self::send_from) without waiting: [`SocketFailure::WouldBlock`] when the
    /// ring is full.
    pub fn try_send_from(&self, region: &MemoryRegion, offset: u64, len: u64) -> Result<usize, SocketFailure> {
        let src = self.source(region, offset, len)?;
        let _turn = hold(&self.send_lock);
        self.dev
            .try_send_from(src, len)
            .map_err(|e| SocketFailure::of(e, self.timeout))
    }

    /// `len` bytes of `region` from `offset` as a send's source, if the region holds them and
    /// belongs to this socket's context.
    fn source(&self, region: &MemoryRegion, offset: u64, len: u64) -> Result<gdaki_device::Local, SocketFailure> {
        self.on_cpu()?;
        if offset.checked_add(len).is_none_or(|end| end > region.len()) {
            return Err(SocketFailure::BadSource(format!(
                "{len} bytes from offset {offset} of a region of {} bytes",
                region.len()
            )));
        }
        if !region.same_context(&self.tx) {
            return Err(SocketFailure::BadSource(
                "the region belongs to another context than the socket's".into(),
            ));
        }
        Ok(region.local(offset))
    }

    /// Sends all of `data`, as many sends as it takes.
    pub fn send_all(&self, mut data: &[u8]) -> Result<(), SocketFailure> {
        while !data.is_empty() {
            let n = self.send(data)?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Receives up to `buf.len()` bytes, waiting (bounded) for some: how many, 0 once the peer
    /// shut down and everything it sent has been read.
    pub fn recv(&self, buf: &mut [u8]) -> Result<usize, SocketFailure> {
        self.on_cpu()?;
        let _turn = hold(&self.recv_lock);
        self.dev.recv(buf).map_err(|e| SocketFailure::of(e, self.timeout))
    }

    /// [`recv`](Self::recv) without waiting: [`SocketFailure::WouldBlock`] when nothing arrived.
    pub fn try_recv(&self, buf: &mut [u8]) -> Result<usize, SocketFailure> {
        self.on_cpu()?;
        let _turn = hold(&self.recv_lock);
        self.dev.try_recv(buf).map_err(|e| SocketFailure::of(e, self.timeout))
    }

    /// Receives in place: waits (bounded) for bytes, hands up to `max` of them (and of one
    /// frame) to `read` where they lie in the receive ring, and consumes as many as `read`
    /// returns; the rest stay for the next receive. What [`recv`](Self::recv) delivers, with
    /// no copy out of the ring. Returns the bytes consumed: 0 once the peer shut down and
    /// everything it sent has been read (`read` is then not called), or where `read` took
    /// none. `read` returning more than it was given is [`SocketFailure::BadArgument`], and
    /// nothing is consumed.
    pub fn recv_in_place(&self, max: usize, read: impl FnOnce(&[u8]) -> usize) -> Result<usize, SocketFailure> {
        self.in_place(true, max, read)
    }

    /// [`recv_in_place`](Self::recv_in_place) without waiting: [`SocketFailure::WouldBlock`]
    /// when nothing arrived.
    pub fn try_recv_in_place(&self, max: usize, read: impl FnOnce(&[u8]) -> usize) -> Result<usize, SocketFailure> {
        self.in_place(false, max, read)
    }

    /// A receive in place, waiting for bytes where `wait` says.
    fn in_place(&self, wait: bool, max: usize, read: impl FnOnce(&[u8]) -> usize) -> Result<usize, SocketFailure> {
        self.on_cpu()?;
        let _turn = hold(&self.recv_lock);
        let peek = if wait {
            self.dev.peek(max as u64)
        } else {
            self.dev.try_peek(max as u64)
        };
        let view = peek.map_err(|e| SocketFailure::of(e, self.timeout))?;
        if view.is_empty() {
            return Ok(0);
        }
        // SAFETY: the view is this socket's latest peek, not consumed; the receive lock keeps
        // every other receive out until the consume below; the rings are in host memory
        // (`on_cpu`), read by this thread after the peek's acquire of the frame's trailer.
        let n = read(unsafe { view.bytes() });
        if n as u64 > view.len() {
            return Err(SocketFailure::BadArgument(format!(
                "the reader took {n} bytes of the {} it was given",
                view.len()
            )));
        }
        self.dev
            .consume(&view, n as u64)
            .map_err(|e| SocketFailure::of(e, self.timeout))?;
        Ok(n)
    }

    /// Shuts down the sending side (the peer reads the rest, then 0); receiving goes on.
    pub fn shutdown(&self) -> Result<(), SocketFailure> {
        self.on_cpu()?;
        let _turn = hold(&self.send_lock);
        self.dev.shutdown().map_err(|e| SocketFailure::of(e, self.timeout))
    }

    /// Resets the connection: both sides' later calls fail with [`SocketFailure::Reset`].
    pub fn reset(&self) -> Result<(), SocketFailure> {
        self.on_cpu()?;
        self.dev.reset().map_err(|e| SocketFailure::of(e, self.timeout))
    }

    /// Waits (bounded) until everything sent so far has reached the peer's memory.
    pub fn flush(&self) -> Result<(), SocketFailure> {
        self.on_cpu()?;
        self.dev.flush().map_err(|e| SocketFailure::of(e, self.timeout))
    }

    /// Shuts down the sending side and waits for what was sent to reach the peer, then drops
    /// the socket. Dropping does the wait too (a socket's queue pair goes with it, and what it
    /// had not carried yet would be lost), but cannot say that it failed.
    pub fn close(self) -> Result<(), SocketFailure> {
        self.shutdown()?;
        self.flush()
    }

    /// Refuses CPU calls on a socket whose rings are in GPU memory.
    fn on_cpu(&self) -> Result<(), SocketFailure> {
        match self.memory {
            SocketMemory::Device(_) => Err(SocketFailure::OnGpu),
            _ => Ok(()),
        }
    }

    /// Hands the socket to `gpu`'s kernels: its queue pair is exported there and its handle
    /// (with the stream state so far) copied into GPU memory; kernels take
    /// [`GpuSocket::device_handle`] (`gdaki_device::socket::Socket::from_raw`). The rings must
    /// be memory that GPU reaches ([`SocketMemory::Pinned`] or [`SocketMemory::Device`] of it).
    pub fn into_gpu(mut self, gpu: &gdaki_cuda::Gpu) -> Result<GpuSocket> {
        self.reached_by(gpu)?;
        let export = self.qp.export_gpu(gpu)?;
        // SAFETY: the live handle, read as plain data.
        let mut h = unsafe { (self.handle.as_ptr() as *const DevSocket).read_volatile() };
        h.qp = export.device_handle();
        let handle = gdaki_cuda::DeviceBuffer::zeroed(gpu, std::mem::size_of::<DevSocket>())?;
        handle.write(0, bytemuck::bytes_of(&h))?;
        self.exported = true;
        Ok(GpuSocket {
            handle,
            _export: export,
            _socket: self,
        })
    }

    /// Whether `gpu` reaches the socket's rings, as [`into_gpu`](Self::into_gpu) needs
    /// ([`SocketMemory::Pinned`] or [`SocketMemory::Device`] of that GPU): [`Error::Unsupported`]
    /// with the reason if not.
    pub fn reached_by(&self, gpu: &gdaki_cuda::Gpu) -> Result<()> {
        let reached = self.memory.gpu().is_some_and(|g| g.ordinal() == gpu.ordinal());
        if reached {
            return Ok(());
        }
        Err(Error::Unsupported {
            what: "exporting a socket to a GPU",
            why: format!(
                "its rings are in {:?}, which GPU {} does not reach: make it with SocketMemory::Pinned or \
                 SocketMemory::Device of that GPU",
                self.memory,
                gpu.ordinal()
            ),
        })
    }

    /// What the peer handed over with the connection ([`connect_with`](Self::connect_with));
    /// empty for a plain `connect` (and on the client's side).
    pub fn peer_data(&self) -> &[u8] {
        &self.peer_data
    }

    /// The peer's handshake address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The socket's device handle in host memory, for CPU-mode code that drives it with
    /// `gdaki_device::socket::Socket` itself (in group scope, say). Such code counts as this
    /// socket's sender and receiver: do not call this value's own methods meanwhile.
    pub fn device_handle(&self) -> *mut DevSocket {
        self.handle.as_ptr() as *mut DevSocket
    }

    /// The queue pair the socket runs on.
    pub fn queue_pair(&self) -> &QueuePair {
        &self.qp
    }
}

/// A socket handed to a GPU ([`Socket::into_gpu`]): kernels on it use the socket through
/// [`device_handle`](Self::device_handle); keep this value alive while they run.
pub struct GpuSocket {
    handle: gdaki_cuda::DeviceBuffer,
    // The export before the socket: it unmaps before the queue pair goes.
    _export: crate::GpuQp,
    _socket: Socket,
}

impl std::fmt::Debug for GpuSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSocket")
            .field("peer", &self._socket.peer)
            .field("handle", &format_args!("{:#x}", self.handle.device_addr()))
            .finish()
    }
}

impl GpuSocket {
    /// The socket's handle in GPU memory: what kernels pass to
    /// `gdaki_device::socket::Socket::from_raw`.
    pub fn device_handle(&self) -> u64 {
        self.handle.device_addr()
    }

    /// Runs GPUnet's echo server on `gpu` (`gdaki_device::socket::echo`, the bench kernel's
    /// `Echo` role): block `b` of `threads` threads serves `sockets[b]` with a `buf_len`-byte
    /// buffer until its peer's end of stream, then shuts it down; waits for every block and
    /// returns each block's status and bytes echoed (`moved`). The sockets are this launch's
    /// alone while it runs (`&mut`).
    pub fn echo_on_gpu(
        gpu: &gdaki_cuda::Gpu,
        sockets: &mut [GpuSocket],
        threads: u32,
        buf_len: usize,
    ) -> Result<gdaki_cuda::SocketBenchRun> {
        let roles = vec![gdaki_device::socket::BenchRole::Echo; sockets.len()];
        Self::bench_on_gpu(gpu, sockets, &roles, buf_len as u64, 0, threads, buf_len, false)
    }

    /// Runs the socket perftests' roles on `gpu` (`gdaki_device::socket::bench`, its calls'
    /// steps `timed` or not): block `b` of
    /// `threads` threads runs `roles[b]` on `sockets[b]`, `iters` messages of `size` bytes
    /// through a `buf_len`-byte buffer; waits for every block. The sockets are this launch's
    /// alone while it runs. Unless every role is `Echo`, refused where the GPU cannot hold
    /// every block at once (a stream's two sides in one launch wait on each other, and streams
    /// are measured together).
    #[allow(clippy::too_many_arguments)] // the benchmark's parameters
    pub fn bench_on_gpu(
        gpu: &gdaki_cuda::Gpu,
        sockets: &mut [GpuSocket],
        roles: &[gdaki_device::socket::BenchRole],
        size: u64,
        iters: u32,
        threads: u32,
        buf_len: usize,
        timed: bool,
    ) -> Result<gdaki_cuda::SocketBenchRun> {
        // Echo servers serve independent clients: more of them than fit start as others end.
        // Any other role runs with a peer in this launch, or is measured beside the others.
        if roles.iter().any(|&r| r != gdaki_device::socket::BenchRole::Echo) {
            gpu.socket_blocks_fit(sockets.len(), threads, timed)?;
        }
        Self::check_gpu(gpu, sockets)?;
        let handles: Vec<u64> = sockets.iter().map(GpuSocket::device_handle).collect();
        let codes: Vec<u32> = roles.iter().map(|&r| r as u32).collect();
        let timestamps = roles.iter().map(|r| r.timestamps(iters)).max().unwrap_or(1);
        // SAFETY: every handle is a socket exported to this GPU (checked), alive and borrowed
        // mutably until the launch returns; the timestamps fit every role.
        Ok(unsafe { gpu.run_socket_bench(&handles, &codes, size, iters, threads, buf_len, timestamps, timed) }?)
    }

    fn check_gpu(gpu: &gdaki_cuda::Gpu, sockets: &[GpuSocket]) -> Result<()> {
        match sockets.iter().find(|s| s._export.gpu_ordinal() != gpu.ordinal()) {
            Some(s) => Err(Error::Unsupported {
                what: "running sockets on a GPU",
                why: format!(
                    "a socket was exported to GPU {}, not GPU {}",
                    s._export.gpu_ordinal(),
                    gpu.ordinal()
                ),
            }),
            None => Ok(()),
        }
    }
}
