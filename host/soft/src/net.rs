//! The soft HCA's transport between processes or hosts: one TCP connection per connected QP,
//! reliable and ordered as an RC connection is, carrying the frames of [`gdaki_devx::wire`].
//!
//! - **Requester side** ([`Link`]): the engine thread sends each request as soon as the WQE is
//!   checked, without waiting (requests are pipelined). A receiver thread per link reads the
//!   responses, applies them (READ data and atomic results land in local memory) and writes
//!   the CQEs. Completions stay in WQE order: WQEs whose outcome is known locally (NOPs, local
//!   errors, flushes) queue behind the requests still in flight ([`Inflight`]).
//! - **Responder side** ([`listen`]): a listener per HCA, one thread per incoming connection.
//!   It checks each request as a NIC does (target QP state, rkey, bounds, rights, atomic
//!   alignment), executes it through the region's [`Dma`](super::dma::Dma), acknowledges
//!   writes in batches (when no more requests are buffered) and, after a NAK, executes
//!   nothing more on that connection.
//! - **Dead peers**: a closed connection, a socket error, a malformed frame, or no answer within
//!   the QP's retry timeout completes the oldest outstanding WQE with a transport error and
//!   flushes the rest; the QP goes to error. Nothing waits forever.
//!
//! Payloads go through a bounce buffer rather than straight from the socket into registered
//! memory: the memory may be GPU memory, and other agents write host memory concurrently.
use std::collections::VecDeque;
use std::io::{self, BufWriter, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gdaki_layout::copy::STORE_MAX;
use gdaki_layout::Syndrome;
use tracing::{debug, info, warn};

use crate::completer::{self, Locals, Outcome};
use crate::copier::Way;
use crate::dma::{Dma, DmaFault};
use crate::error::{Error, Result};
use crate::ipc::{self, Imports};
use crate::objects::SoftQp;
use crate::responder::{self, AtomicOp, Message, SendData, SmallWrite};
use crate::shm::{self, Segment, Side};
use crate::{Hca, Region, RegionCache};
use gdaki_devx::util::lock;
use gdaki_devx::wire::{self, Header, Kind, Op, Request, Response, WireError, HEADER_LEN, MAX_FIXED};
use gdaki_devx::Access;
use gdaki_devx::QpState;

pub(crate) use crate::shm::POLL;
/// Bounce buffer size for payloads.
const CHUNK: usize = 256 << 10;
/// How long connection set-up may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a connection ended.
#[derive(Debug)]
enum Fault {
    Io(io::Error),
    Wire(WireError),
    /// The peer broke the protocol's rules (an answer to nothing, a wrong length).
    Protocol(String),
    /// No answer within the retry timeout.
    Timeout,
    /// This side is shutting down.
    Stopped,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => f.write_str("peer closed the connection"),
            Fault::Io(e) => write!(f, "socket error: {e}"),
            Fault::Wire(e) => write!(f, "malformed frame: {e}"),
            Fault::Protocol(s) => write!(f, "protocol violation: {s}"),
            Fault::Timeout => f.write_str("no answer within the retry timeout"),
            Fault::Stopped => f.write_str("shutting down"),
        }
    }
}

impl From<io::Error> for Fault {
    fn from(e: io::Error) -> Fault {
        Fault::Io(e)
    }
}

impl From<WireError> for Fault {
    fn from(e: WireError) -> Fault {
        Fault::Wire(e)
    }
}

/// Where a connection's bytes come from: the socket, or the shared ring once the set-up
/// switched to it (see [`shm`]).
enum Inbound {
    Tcp(TcpStream),
    Shm(shm::Rx),
}

impl Inbound {
    /// Reads what there is, waiting at most about [`POLL`]; a timeout is an error of kind
    /// `WouldBlock` or `TimedOut`.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Inbound::Tcp(s) => s.read(buf),
            Inbound::Shm(rx) => rx.read(buf),
        }
    }

    /// Ends the connection both ways.
    fn shutdown(&self) {
        match self {
            Inbound::Tcp(s) => drop(s.shutdown(Shutdown::Both)),
            Inbound::Shm(rx) => {
                rx.closer().close();
                rx.watch().shutdown();
            }
        }
    }
}

/// Where a connection's bytes go: the socket (buffered) or the shared ring.
enum Outbound {
    Tcp(BufWriter<TcpStream>),
    Shm(shm::Tx),
}

impl Write for Outbound {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Outbound::Tcp(w) => w.write(buf),
            Outbound::Shm(w) => w.write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            Outbound::Tcp(w) => w.write_all(buf),
            Outbound::Shm(w) => w.write_all(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Outbound::Tcp(w) => w.flush(),
            Outbound::Shm(w) => w.flush(),
        }
    }
}

/// Reads a connection's bytes with a timeout, calling `idle` on every timeout (to check
/// deadlines and stop flags) without losing a byte.
struct Reader {
    s: Inbound,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    /// While set (connection set-up), reads fail with a timeout past it, however the bytes
    /// arrive: a peer sending a byte at a time never lets a read time out, so `idle` alone
    /// would not bound the set-up.
    deadline: Option<Instant>,
}

impl Reader {
    fn new(s: TcpStream) -> io::Result<Reader> {
        s.set_read_timeout(Some(POLL))?;
        Ok(Reader {
            s: Inbound::Tcp(s),
            buf: vec![0u8; 64 << 10].into_boxed_slice(),
            pos: 0,
            end: 0,
            deadline: None,
        })
    }

    /// Bytes received but not yet consumed.
    fn buffered(&self) -> usize {
        self.end - self.pos
    }

    /// Reads from the shared ring `rx` from now on. Nothing may be left over from the socket:
    /// the peer sends nothing after the frame that switched.
    fn switch(&mut self, rx: shm::Rx) -> Result<(), Fault> {
        if self.buffered() != 0 {
            return Err(Fault::Protocol(format!(
                "{} bytes sent over TCP after the switch to shared memory",
                self.buffered()
            )));
        }
        self.s = Inbound::Shm(rx);
        Ok(())
    }

    fn read_exact(&mut self, dst: &mut [u8], idle: &mut dyn FnMut() -> Result<(), Fault>) -> Result<(), Fault> {
        let n = dst.len().min(self.buffered());
        dst[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        let mut done = n;
        while done < dst.len() {
            if self.deadline.is_some_and(|d| Instant::now() > d) {
                return Err(Fault::Timeout);
            }
            let direct = dst.len() - done >= self.buf.len();
            let r = if direct {
                self.s.read(&mut dst[done..])
            } else {
                self.s.read(&mut self.buf)
            };
            match r {
                Ok(0) => return Err(Fault::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(got) if direct => done += got,
                Ok(got) => {
                    let take = got.min(dst.len() - done);
                    dst[done..done + take].copy_from_slice(&self.buf[..take]);
                    (self.pos, self.end) = (take, got);
                    done += take;
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => idle()?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn header(&mut self, idle: &mut dyn FnMut() -> Result<(), Fault>) -> Result<Header, Fault> {
        let mut h = [0u8; HEADER_LEN];
        self.read_exact(&mut h, idle)?;
        Ok(Header::parse(&h)?)
    }

    /// Reads the fixed part of a frame (at most [`MAX_FIXED`] bytes; a longer one is a protocol
    /// error, never a panic).
    fn fixed<'b>(
        &mut self,
        n: usize,
        out: &'b mut [u8; MAX_FIXED],
        idle: &mut dyn FnMut() -> Result<(), Fault>,
    ) -> Result<&'b [u8], Fault> {
        let Some(out) = out.get_mut(..n) else {
            return Err(Fault::Protocol(format!(
                "a fixed part of {n} bytes (at most {MAX_FIXED})"
            )));
        };
        self.read_exact(out, idle)?;
        Ok(out)
    }

    /// Reads a whole small payload (handshake-sized frames).
    fn payload(&mut self, h: Header, idle: &mut dyn FnMut() -> Result<(), Fault>) -> Result<Vec<u8>, Fault> {
        let mut p = vec![0u8; h.len as usize];
        self.read_exact(&mut p, idle)?;
        Ok(p)
    }

    /// Reads a whole frame that must be of `kind` (`want` names it in the error) and returns
    /// its payload: the set-up steps, where anything else is a protocol error.
    fn expect(
        &mut self,
        kind: Kind,
        want: &'static str,
        idle: &mut dyn FnMut() -> Result<(), Fault>,
    ) -> Result<Vec<u8>, Fault> {
        let h = self.header(idle)?;
        if h.kind != kind {
            return Err(WireError::Unexpected { got: h.kind, want }.into());
        }
        self.payload(h, idle)
    }

    /// Reads `len` bytes into registered memory at `addr`: straight from the shared ring where
    /// the connection has one, through `bounce` from a socket (in whole chunks: over TCP a
    /// message of up to [`CHUNK`] bytes reaches memory whole or not at all; over shared memory
    /// a peer that dies mid-payload may leave part of it, which a failed READ's buffer may
    /// hold on RC too). The stream is always consumed in full; a failed copy into the region
    /// is the inner error.
    /// With `stall`, each [`CHUNK`] of the payload must arrive within it (a [`Fault::Timeout`]
    /// otherwise), as a NIC's retry timer runs per packet: bytes that trickle in never look
    /// idle, but they are no progress either.
    #[allow(clippy::too_many_arguments)]
    fn read_to_region(
        &mut self,
        region: Option<&Region>,
        addr: u64,
        len: u64,
        bounce: &mut Vec<u8>,
        stall: Option<Duration>,
        idle: &mut dyn FnMut() -> Result<(), Fault>,
    ) -> Result<Result<(), DmaFault>, Fault> {
        let mut copied = Ok(());
        let mut at = addr;
        let mut put = |piece: &[u8]| {
            if let (Some(r), Ok(())) = (region, copied) {
                copied = r.dma.write(at, piece);
            }
            at += piece.len() as u64;
        };
        let mut left = len;
        // Where the current piece ends (as `left` counts down), and when it must have arrived.
        let mut piece_end = left;
        while left > 0 {
            if let Some(t) = stall {
                if left <= piece_end {
                    piece_end = left.saturating_sub(CHUNK as u64);
                    self.deadline = Some(Instant::now() + t);
                }
                if self.deadline.is_some_and(|d| Instant::now() > d) {
                    return Err(Fault::Timeout);
                }
            }
            let max = left.min(CHUNK as u64) as usize;
            let buffered = self.buffered();
            match &mut self.s {
                // What this reader buffered comes first.
                Inbound::Shm(_) if buffered > 0 => {
                    let n = max.min(buffered);
                    put(&self.buf[self.pos..self.pos + n]);
                    self.pos += n;
                    left -= n as u64;
                }
                Inbound::Shm(rx) => match rx.read_with(max, &mut put) {
                    Ok(0) => return Err(Fault::Io(io::ErrorKind::UnexpectedEof.into())),
                    Ok(got) => left -= got as u64,
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => idle()?,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                },
                Inbound::Tcp(_) => {
                    bounce.resize(max, 0);
                    self.read_exact(&mut bounce[..max], idle)?;
                    put(&bounce[..max]);
                    left -= max as u64;
                }
            }
        }
        if stall.is_some() {
            self.deadline = None;
        }
        Ok(copied)
    }
}

/// Writes `len` bytes of registered memory at `addr` to `w`, through a bounce buffer.
fn from_region(w: &mut impl Write, region: &Region, mut addr: u64, len: u64, bounce: &mut Vec<u8>) -> io::Result<()> {
    if region.dma.host_addressable() {
        // SAFETY: the range was checked against this live, host-addressable region (the
        // caller holds it); like DMA, concurrent writes by the application may be torn.
        let d = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
        return w.write_all(d);
    }
    let mut left = len;
    while left > 0 {
        let n = left.min(CHUNK as u64) as usize;
        bounce.resize(n, 0);
        // The response header is out: a copy that fails now can only break the connection,
        // which the requester sees as a transport error.
        region
            .dma
            .read(addr, &mut bounce[..n])
            .map_err(|_| io::Error::other("a copy out of the region failed"))?;
        w.write_all(&bounce[..n])?;
        addr += n as u64;
        left -= n as u64;
    }
    Ok(())
}

/// Whether sequence number `a` comes at or before `b` (wrapping, as PSNs do).
fn seq_le(a: u32, b: u32) -> bool {
    b.wrapping_sub(a) < 1 << 31
}

// ------------------------------------------------------------------------------ requester side

/// Which WQE a completion belongs to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meta {
    /// WQE counter (its first building block).
    pub index: u16,
    /// Opcode, for error CQEs.
    pub opcode: u8,
    /// Whether a successful completion writes a CQE.
    pub signaled: bool,
}

/// Where a response's data goes on the requester's side.
pub(crate) enum Sink {
    /// Nothing comes back (WRITE).
    Ack,
    /// READ data, scattered over these checked local buffers.
    Scatter(Locals),
    /// An atomic's old value, into this checked 8-byte buffer in this byte order.
    Atomic(Locals, gdaki_layout::AtomicReplyOrder),
}

struct Entry {
    meta: Meta,
    /// The request's sequence number; `None` for WQEs completed locally.
    seq: Option<u32>,
    outcome: Option<Outcome>,
    sink: Sink,
    /// A READ or an atomic (what a FENCE waits for). Kept apart from `sink`, which the
    /// receiver takes out while it fills it.
    fetches: bool,
    bytes: u32,
}

/// WQEs of one linked QP not yet completed, in order.
#[derive(Default)]
struct Inflight {
    entries: VecDeque<Entry>,
    /// Set once the connection is gone: later requests fail with this.
    dead: Option<Syndrome>,
    /// When the oldest unanswered request was sent (or the last answer came).
    waiting_since: Option<Instant>,
    /// The responder answered request `seq` "receiver not ready": it and everything after it
    /// go again from `until` on (see [`Link::rnr`]).
    rnr: Option<(u32, Instant)>,
}

impl Inflight {
    fn unanswered(&self) -> bool {
        self.entries.iter().any(|e| e.outcome.is_none())
    }

    /// Fails every unanswered request: the first with `first`, the rest flushed.
    fn fail_unanswered(&mut self, first: Syndrome) {
        let mut s = first;
        for e in self.entries.iter_mut().filter(|e| e.outcome.is_none()) {
            e.outcome = Some(Outcome::Error(s));
            s = Syndrome::WrFlush;
        }
        self.dead.get_or_insert(first);
    }

    /// Completes the entries at the front that have an outcome, in order.
    fn drain(&mut self, qp: Option<&SoftQp>) {
        while self.entries.front().is_some_and(|e| e.outcome.is_some()) {
            let Some(e) = self.entries.pop_front() else { break };
            let Some(qp) = qp else { continue };
            let outcome = match e.outcome {
                Some(Outcome::Error(s)) => {
                    qp.fail(s);
                    Outcome::Error(s)
                }
                // Answered, but the QP went to error before it was completed: flushed.
                _ if qp.state() == QpState::Error => Outcome::Error(Syndrome::WrFlush),
                Some(o) => o,
                None => Outcome::Error(Syndrome::WrFlush),
            };
            completer::complete(qp, e.meta.index, e.meta.opcode, e.meta.signaled, outcome);
        }
    }
}

/// A "receiver not ready" answer as the engine sees it ([`Link::rnr`]).
pub(crate) enum Rnr {
    /// The responder's RNR timer is still running: execute nothing yet.
    Wait,
    /// The answer named no outstanding request: the QP fails.
    Lost,
    /// Execute again from the WQE with counter `index`, whose request was `seq`.
    Retry {
        /// The WQE counter.
        index: u16,
        /// Its request's sequence number.
        seq: u32,
    },
}

/// What the engine and a link's receiver thread share.
struct Shared {
    qp: Weak<SoftQp>,
    retry_timeout: Duration,
    inflight: Mutex<Inflight>,
    closed: AtomicBool,
    /// The peer's answers to GPU allocation offers (see [`ipc`]).
    gpu_answers: ipc::Answers,
}

/// A QP's connection to a peer in another process (the requester's side of it).
pub(crate) struct Link {
    tx: Outbound,
    stream: TcpStream,
    /// Ends the receiver's wait on the shared ring (a socket shutdown does not reach it).
    rx_closer: Option<shm::Closer>,
    next_seq: u32,
    /// The engine hit a local error on this QP with requests still in flight: the QP goes
    /// to error when that WQE completes, and nothing after it executes.
    pub halted: bool,
    shared: Arc<Shared>,
    receiver: Option<JoinHandle<()>>,
    peer: SocketAddr,
    /// GPU allocations offered to the peer: where WRITEs from GPU memory may travel as CUDA
    /// IPC references (a shared-memory connection, both sides allowing it).
    exports: Option<ipc::Exports>,
}

impl Link {
    /// Connects `qp` (of HCA `hca`) to QP `peer_qpn` of the soft HCA listening at `addr`, which
    /// must accept, presenting the peer QP's transport `secret` (from its endpoint). A peer on
    /// this machine is then reached through shared memory where both sides can (see [`shm`]).
    pub(crate) fn connect(hca: &Hca, qp: &Arc<SoftQp>, peer_qpn: u32, secret: u64, addr: SocketAddr) -> Result<Link> {
        let io = |what: &'static str| move |source| Error::Io { what, source };
        let stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(|e| Error::PeerUnreachable {
            what: format!("QP {peer_qpn:#x} at {addr}"),
            why: e.to_string(),
        })?;
        stream.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
        stream
            .set_write_timeout(Some(qp.retry_timeout()))
            .map_err(io("setting a socket write timeout"))?;
        let hello = wire::Connect {
            hca: hca.id,
            qpn: qp.qpn,
            target_qpn: peer_qpn,
            psn: qp.psn(),
            secret,
        };
        (&stream)
            .write_all(&hello.encode())
            .map_err(io("sending a transport connect"))?;
        let mut reader = Reader::new(stream.try_clone().map_err(io("cloning a socket"))?)
            .map_err(io("setting a socket read timeout"))?;
        reader.deadline = Some(Instant::now() + CONNECT_TIMEOUT);
        // The reader's deadline bounds the set-up; nothing else to check while waiting.
        let mut idle = || Ok(());
        let refused = |why: String| Error::PeerUnreachable {
            what: format!("QP {peer_qpn:#x} at {addr}"),
            why,
        };
        let h = reader.header(&mut idle).map_err(|f| match f {
            Fault::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => refused(
                "closed without an answer: it has no queue pair connected to this one (check that the \
                 endpoints exchanged are these queue pairs')"
                    .into(),
            ),
            f => refused(f.to_string()),
        })?;
        // Only these answers are believed, and only then is their length allocated.
        if !matches!(h.kind, Kind::Accept | Kind::Reject) {
            return Err(refused(format!("unexpected {:?} answer to a connect", h.kind)));
        }
        let p = reader.payload(h, &mut idle).map_err(|f| refused(f.to_string()))?;
        reader.deadline = None;
        match h.kind {
            Kind::Accept if wire::decode_accept(&p).map_err(|e| refused(e.to_string()))? == peer_qpn => {}
            Kind::Reject => {
                return Err(refused(format!(
                    "refused: {}",
                    wire::decode_reject(&p).map_err(|e| refused(e.to_string()))?
                )))
            }
            k => return Err(refused(format!("unexpected {k:?} answer to a connect"))),
        }
        let (tx, rx_closer) = offer(hca, qp, &stream, &mut reader).map_err(|f| refused(f.to_string()))?;
        let carrier = if rx_closer.is_some() { "shared memory" } else { "TCP" };
        let shared = Arc::new(Shared {
            qp: Arc::downgrade(qp),
            retry_timeout: qp.retry_timeout(),
            inflight: Mutex::new(Inflight::default()),
            closed: AtomicBool::new(false),
            gpu_answers: Default::default(),
        });
        // (The responder refuses offers if it does not take references.)
        let exports = (rx_closer.is_some() && hca.same_host.cuda_ipc).then(ipc::Exports::default);
        let rx_shared = shared.clone();
        let receiver = super::spawn_hca_thread(format!("gdaki-rx-{:x}", qp.qpn), move || {
            receive(reader, rx_shared, addr)
        })
        .map_err(io("starting a transport receiver thread"))?;
        info!(qpn = format_args!("{:#x}", qp.qpn), peer = format_args!("{:#x}", peer_qpn), %addr, "connected over {carrier}");
        Ok(Link {
            tx,
            stream,
            rx_closer,
            next_seq: qp.psn(),
            halted: false,
            shared,
            receiver: Some(receiver),
            peer: addr,
            exports,
        })
    }

    /// Where the peer can reach the `len` bytes at `addr` of GPU memory `dma` itself (CUDA IPC,
    /// see [`ipc`]); `None` when they must travel as bytes. The first time an allocation comes
    /// by, this sends its offer (and the bytes go, this time).
    pub(crate) fn reference(&mut self, dma: &dyn Dma, addr: u64, len: u32) -> Option<ipc::Reference> {
        let exports = self.exports.as_mut()?;
        let export = dma.ipc_export()?;
        match exports.reference(&self.shared.gpu_answers, export, addr, len) {
            ipc::Choice::Reference(r) => Some(r),
            ipc::Choice::Bytes => None,
            ipc::Choice::OfferThenBytes(offer) => {
                if lock(&self.shared.inflight).dead.is_none() {
                    if let Err(e) = self.tx.write_all(&offer) {
                        self.kill(&format!("sending to {}: {e}", self.peer));
                    }
                }
                None
            }
        }
    }

    /// Sends a request for WQE `meta` (`data`: a WRITE's payload) and queues its completion.
    pub(crate) fn post(&mut self, meta: Meta, remote: gdaki_device::Remote, op: Op, data: &[u8], sink: Sink) {
        let bytes = match op {
            Op::WriteRef { len, tail, .. } => len.saturating_add(tail.map_or(0, |t| t.len)),
            Op::Write { len }
            | Op::Read { len }
            | Op::ReadRef { len, .. }
            | Op::Send { len, .. }
            | Op::SendRef { len, .. }
            | Op::WriteImm { len, .. } => len,
            Op::FetchAdd { .. } | Op::CompareSwap { .. } => 8,
        };
        // A READ whose bytes the responder places itself completes on an acknowledgement, as
        // a WRITE does, but a FENCE still waits for it.
        let fetches = !matches!(
            op,
            Op::Write { .. } | Op::WriteRef { .. } | Op::Send { .. } | Op::SendRef { .. } | Op::WriteImm { .. }
        );
        let (rkey, addr) = (remote.rkey, remote.addr);
        let seq = self.next_seq;
        // A length no peer accepts (over the wire's MAX_MESSAGE) fails this WQE alone, as a
        // NIC's local length error.
        let head = Request { seq, rkey, addr, op }.encode_head();
        {
            let mut inflight = lock(&self.shared.inflight);
            let outcome = inflight
                .dead
                .map(|s| Outcome::Error(if inflight.unanswered() { Syndrome::WrFlush } else { s }))
                .or_else(|| head.is_err().then_some(Outcome::Error(Syndrome::LocalLength)));
            if outcome.is_none() && !inflight.unanswered() {
                inflight.waiting_since = Some(Instant::now());
            }
            inflight.entries.push_back(Entry {
                meta,
                seq: outcome.is_none().then_some(seq),
                outcome,
                sink,
                fetches,
                bytes,
            });
            if outcome.is_some() {
                let qp = self.shared.qp.upgrade();
                inflight.drain(qp.as_deref());
                return;
            }
        }
        let Ok(head) = head else { return };
        self.next_seq = seq.wrapping_add(1);
        let sent = self.tx.write_all(&head).and_then(|()| self.tx.write_all(data));
        if let Err(e) = sent {
            self.kill(&format!("sending to {}: {e}", self.peer));
        }
    }

    /// Whether at least `n` (1 or more) requests sent on this link are still unanswered: with
    /// `all`, of any kind; without, RDMA READs and atomics only (what a FENCE waits for, and
    /// what `log_sra_max` bounds; WRITEs are not). Stops counting at `n`.
    pub(crate) fn outstanding(&self, all: bool, n: usize) -> bool {
        lock(&self.shared.inflight)
            .entries
            .iter()
            .filter(|e| e.outcome.is_none() && (all || e.fetches))
            .nth(n.max(1) - 1)
            .is_some()
    }

    /// Whether the responder answered a request "receiver not ready": `Rnr::Wait` until its
    /// timer ran out, then `Rnr::Retry` with the request's WQE, from which the engine executes
    /// again ([`rewind`](Self::rewind)) or gives up ([`give_up_rnr`](Self::give_up_rnr)).
    pub(crate) fn rnr(&self) -> Option<Rnr> {
        let inflight = lock(&self.shared.inflight);
        let (seq, until) = inflight.rnr?;
        if Instant::now() < until {
            return Some(Rnr::Wait);
        }
        Some(match inflight.entries.iter().find(|e| e.seq == Some(seq)) {
            Some(e) => Rnr::Retry {
                index: e.meta.index,
                seq,
            },
            // Answered for a request that is not outstanding: nothing to send again.
            None => Rnr::Lost,
        })
    }

    /// Forgets request `seq` and everything posted after it (the responder dropped them), to
    /// be posted again from `seq`, in the same order and with the same sequence numbers.
    pub(crate) fn rewind(&mut self, seq: u32) {
        let mut inflight = lock(&self.shared.inflight);
        if let Some(at) = inflight.entries.iter().position(|e| e.seq == Some(seq)) {
            inflight.entries.truncate(at);
        }
        inflight.rnr = None;
        self.next_seq = seq;
    }

    /// The RNR retries ran out: the request fails with `RNR_RETRY_EXC_ERR`, everything after it
    /// is flushed.
    pub(crate) fn give_up_rnr(&mut self) {
        self.halted = true;
        let mut inflight = lock(&self.shared.inflight);
        inflight.rnr = None;
        inflight.fail_unanswered(Syndrome::RnrRetryExc);
        let qp = self.shared.qp.upgrade();
        inflight.drain(qp.as_deref());
    }

    /// Queues the completion of a WQE whose outcome is known without the peer.
    pub(crate) fn complete_local(&mut self, meta: Meta, outcome: Outcome) {
        if matches!(outcome, Outcome::Error(_)) {
            self.halted = true;
        }
        let mut inflight = lock(&self.shared.inflight);
        inflight.entries.push_back(Entry {
            meta,
            seq: None,
            outcome: Some(outcome),
            sink: Sink::Ack,
            fetches: false,
            bytes: 0,
        });
        let qp = self.shared.qp.upgrade();
        inflight.drain(qp.as_deref());
    }

    /// Pushes buffered requests onto the wire (end of a doorbell batch).
    pub(crate) fn flush(&mut self) {
        if let Err(e) = self.tx.flush() {
            self.kill(&format!("sending to {}: {e}", self.peer));
        }
    }

    fn kill(&mut self, why: &str) {
        warn!(peer = %self.peer, "transport connection lost: {why}");
        self.shutdown();
        let mut inflight = lock(&self.shared.inflight);
        inflight.fail_unanswered(Syndrome::TransportRetryExc);
        let qp = self.shared.qp.upgrade();
        inflight.drain(qp.as_deref());
    }

    /// Ends the connection both ways, waking this side's receiver.
    fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(c) = &self.rx_closer {
            c.close();
        }
    }
}

/// The requester's half of choosing the carrier, right after the accept: offers a
/// shared-memory segment (when this HCA may and one can be made) and, when the responder
/// mapped it, switches `reader` to it. Returns where requests go, and what closes the
/// receiver's ring.
fn offer(
    hca: &Hca,
    qp: &SoftQp,
    stream: &TcpStream,
    reader: &mut Reader,
) -> Result<(Outbound, Option<shm::Closer>), Fault> {
    let seg = match hca.same_host.shared_memory {
        false => None,
        true => Segment::create(hca.id, qp.qpn)
            .inspect_err(|e| {
                debug!(
                    qpn = format_args!("{:#x}", qp.qpn),
                    "no shared-memory segment ({e}): the connection stays on TCP"
                )
            })
            .ok(),
    };
    let mut answer = || -> Result<bool, Fault> {
        let mut w = stream;
        w.write_all(&wire::encode_shm_offer(seg.as_deref().map(Segment::name)))?;
        reader.deadline = Some(Instant::now() + CONNECT_TIMEOUT);
        let frame = reader.expect(Kind::ShmAnswer, "a shared-memory answer", &mut || Ok(()))?;
        let mapped = wire::decode_shm_answer(&frame)?;
        reader.deadline = None;
        Ok(mapped)
    };
    let mapped = answer();
    if let Some(s) = &seg {
        s.unlink();
    }
    match (seg, mapped?) {
        (Some(seg), true) => {
            let (tx, rx) = shm::ends(seg, Side::Requester, qp.retry_timeout(), hca.link_spin(), stream)?;
            let closer = rx.closer();
            reader.switch(rx)?;
            Ok((Outbound::Shm(tx), Some(closer)))
        }
        (None, true) => Err(Fault::Protocol("a shared-memory answer to no offer".into())),
        (_, false) => Ok((
            Outbound::Tcp(BufWriter::with_capacity(CHUNK, stream.try_clone()?)),
            None,
        )),
    }
}

/// The responder's half: reads the requester's offer and answers it, mapping the segment when
/// this HCA may and the segment checks out. Returns where answers go from now on.
fn answer_offer(
    hca: &Hca,
    target: &SoftQp,
    reader: &mut Reader,
    mut w: BufWriter<TcpStream>,
    idle: &mut dyn FnMut() -> Result<(), Fault>,
) -> Result<Outbound, Fault> {
    // Within the deadline the connection arrived with (the caller's), not a new one.
    let offered = wire::decode_shm_offer(&reader.expect(Kind::ShmOffer, "a shared-memory offer", idle)?)?;
    let seg = offered.filter(|_| hca.same_host.shared_memory).and_then(|name| {
        Segment::open(&name)
            .inspect_err(|e| {
                debug!(
                    qpn = format_args!("{:#x}", target.qpn),
                    "shared-memory segment {name} not taken ({e}): the connection stays on TCP"
                )
            })
            .ok()
    });
    w.write_all(&wire::encode_shm_answer(seg.is_some()))?;
    w.flush()?;
    let Some(seg) = seg else { return Ok(Outbound::Tcp(w)) };
    let (tx, rx) = shm::ends(
        seg,
        Side::Responder,
        target.retry_timeout(),
        hca.link_spin(),
        w.get_ref(),
    )?;
    reader.switch(rx)?;
    Ok(Outbound::Shm(tx))
}

impl Drop for Link {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        let _ = self.tx.flush();
        self.shutdown();
        if let Some(t) = self.receiver.take() {
            // The receiver may itself drop the last reference to the QP (and so this link).
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// The receiver thread: applies responses in order until the connection ends.
fn receive(mut reader: Reader, shared: Arc<Shared>, peer: SocketAddr) {
    let fault = receive_loop(&mut reader, &shared).unwrap_err();
    reader.s.shutdown();
    let mut inflight = lock(&shared.inflight);
    let unanswered = inflight.unanswered();
    match fault {
        Fault::Stopped => return,
        _ if unanswered => warn!(%peer, "transport: {fault}; outstanding requests fail"),
        _ => debug!(%peer, "transport: {fault}"),
    }
    inflight.fail_unanswered(Syndrome::TransportRetryExc);
    let qp = shared.qp.upgrade();
    inflight.drain(qp.as_deref());
}

fn receive_loop(reader: &mut Reader, shared: &Shared) -> Result<(), Fault> {
    let mut idle = || {
        if shared.closed.load(Ordering::Acquire) {
            return Err(Fault::Stopped);
        }
        let inflight = lock(&shared.inflight);
        match inflight.waiting_since {
            Some(t) if inflight.unanswered() && t.elapsed() > shared.retry_timeout => Err(Fault::Timeout),
            _ => Ok(()),
        }
    };
    let mut fixed = [0u8; MAX_FIXED];
    let mut bounce = Vec::new();
    loop {
        let h = reader.header(&mut idle)?;
        if h.kind == Kind::GpuAnswer {
            let a = wire::GpuAnswer::decode(&reader.payload(h, &mut idle)?)?;
            ipc::answered(&shared.gpu_answers, a).map_err(Fault::Protocol)?;
            continue;
        }
        let n = Response::fixed_len(h)?;
        let resp = Response::decode(h, reader.fixed(n, &mut fixed, &mut idle)?)?;
        let seq = match resp {
            Response::Ack { seq }
            | Response::ReadResp { seq, .. }
            | Response::Atomic { seq, .. }
            | Response::Nak { seq, .. }
            | Response::RnrNak { seq, .. } => seq,
        };
        // Everything before `seq` succeeded (responses come in order); `seq` itself is answered
        // below. Take the target's sink out to fill it without holding the lock.
        let sink = {
            let mut inflight = lock(&shared.inflight);
            let mut found = None;
            for (i, e) in inflight.entries.iter_mut().enumerate() {
                let Some(s) = e.seq else { continue };
                if e.outcome.is_some() {
                    continue;
                }
                if s == seq {
                    found = Some(i);
                    break;
                }
                if !seq_le(s, seq) {
                    break;
                }
                if !matches!(e.sink, Sink::Ack) {
                    return Err(Fault::Protocol(format!(
                        "request {s} (a read or atomic) skipped by an answer to {seq}"
                    )));
                }
                e.outcome = Some(Outcome::Success { bytes: e.bytes });
            }
            let Some(i) = found else {
                return Err(Fault::Protocol(format!(
                    "answer to request {seq}, which is not outstanding"
                )));
            };
            inflight.waiting_since = Some(Instant::now());
            if let Response::RnrNak { timer, .. } = resp {
                // Not executed, nor anything after it: the engine posts them again once the
                // timer has run out (no transport timeout meanwhile).
                inflight.rnr = Some((seq, Instant::now() + crate::objects::rnr_timer(timer)));
                inflight.waiting_since = None;
                let qp = shared.qp.upgrade();
                inflight.drain(qp.as_deref());
                if let Some(qp) = qp {
                    qp.rnr_events.fetch_add(1, Ordering::Release);
                }
                continue;
            }
            std::mem::replace(&mut inflight.entries[i].sink, Sink::Ack)
        };
        let outcome = match (resp, sink) {
            (Response::Ack { .. }, Sink::Ack) => None,
            (Response::Nak { syndrome, .. }, _) => Some(Outcome::Error(syndrome)),
            (Response::ReadResp { len, .. }, Sink::Scatter(dst)) => {
                let want: u64 = dst.iter().map(|(s, _)| s.length as u64).sum();
                if want != len as u64 {
                    return Err(Fault::Protocol(format!(
                        "read response of {len} bytes for a read of {want}"
                    )));
                }
                let mut copied = Ok(());
                for (s, region) in dst.iter() {
                    let r = reader.read_to_region(
                        Some(region),
                        s.addr,
                        s.length as u64,
                        &mut bounce,
                        Some(shared.retry_timeout),
                        &mut idle,
                    )?;
                    copied = copied.and(r);
                }
                copied.err().map(|_| Outcome::Error(Syndrome::LocalAccess))
            }
            (Response::Atomic { old, .. }, Sink::Atomic(dst, order)) => match dst.iter().next() {
                Some((s, region)) => region
                    .dma
                    .write(s.addr, &order.encode(old))
                    .err()
                    .map(|_| Outcome::Error(Syndrome::LocalAccess)),
                None => None,
            },
            (r, _) => return Err(Fault::Protocol(format!("{r:?} does not answer its request's kind"))),
        };
        let mut inflight = lock(&shared.inflight);
        let nak = matches!(outcome, Some(Outcome::Error(_)));
        if let Some(e) = inflight
            .entries
            .iter_mut()
            .find(|e| e.seq == Some(seq) && e.outcome.is_none())
        {
            e.outcome = Some(outcome.unwrap_or(Outcome::Success { bytes: e.bytes }));
        }
        if nak {
            // The responder executes nothing after a NAK: the rest is flushed.
            inflight.fail_unanswered(Syndrome::WrFlush);
        }
        let qp = shared.qp.upgrade();
        inflight.drain(qp.as_deref());
        if nak {
            return Err(Fault::Stopped);
        }
    }
}

// ------------------------------------------------------------------------------ responder side

/// A running listener.
pub(crate) struct Listening {
    pub addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

/// Starts `hca`'s transport listener on `bind` (once; later calls return the first address).
pub(crate) fn listen(hca: &Arc<Hca>, bind: SocketAddr) -> Result<SocketAddr> {
    let mut slot = lock(&hca.listening);
    if let Some(l) = slot.as_ref() {
        return Ok(l.addr);
    }
    let listener = TcpListener::bind(bind).map_err(|source| Error::Io {
        what: "binding the soft HCA's transport listener",
        source,
    })?;
    let addr = listener.local_addr().map_err(|source| Error::Io {
        what: "reading the listener's address",
        source,
    })?;
    let weak = Arc::downgrade(hca);
    let thread = super::spawn_hca_thread(format!("gdaki-listen-{}", addr.port()), move || {
        accept_loop(listener, weak)
    })
    .map_err(|source| Error::Io {
        what: "starting the listener thread",
        source,
    })?;
    info!(%addr, "soft HCA listening for transport connections");
    *slot = Some(Listening {
        addr,
        thread: Some(thread),
    });
    Ok(addr)
}

/// Stops the listener (the HCA is stopping): wakes its `accept` with a connection of its own.
pub(crate) fn stop(hca: &Hca) {
    let Some(mut l) = lock(&hca.listening).take() else {
        return;
    };
    let mut wake = l.addr;
    if wake.ip().is_unspecified() {
        wake.set_ip(match wake {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    if TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok() {
        if let Some(t) = l.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, hca: Weak<Hca>) {
    for conn in listener.incoming() {
        let Some(h) = hca.upgrade().filter(|h| !h.stop.load(Ordering::Acquire)) else {
            return;
        };
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                warn!("transport listener: {e}");
                std::thread::sleep(POLL);
                continue;
            }
        };
        let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let spawned = super::spawn_hca_thread("gdaki-responder".into(), move || {
            if let Err(f) = serve(&h, stream) {
                match f {
                    Fault::Stopped => {}
                    f => debug!(%peer, "transport connection ended: {f}"),
                }
            }
        });
        if let Err(e) = spawned {
            warn!("cannot start a responder thread: {e}");
        }
    }
}

/// At most this many incoming connections per HCA may wait to be known as a QP's RTR peer
/// (before their connect, or accepted for a QP not yet at RTR). A known peer's connection does
/// not count: there is one per QP. When all are taken, a new connection takes the place of the
/// oldest one that has not shown a QP's secret (it is closed), so connections that say nothing
/// cannot keep a real peer, which shows the secret in its first frame, out; only when every
/// place holds a connection that showed a secret is the new one closed.
pub(crate) const MAX_UNVERIFIED: usize = 64;

/// An HCA's places for connections not yet known as a QP's peer, oldest first.
#[derive(Default)]
pub(crate) struct Waiting {
    places: Mutex<(u64, std::collections::VecDeque<Place>)>,
}

/// One taken place: the connection (to close it when its place is taken) and whether it
/// showed the secret of the QP it named.
struct Place {
    id: u64,
    stream: TcpStream,
    vouched: bool,
}

/// Holds one of an HCA's [`MAX_UNVERIFIED`] places until dropped.
struct Unverified<'a> {
    waiting: &'a Waiting,
    id: u64,
}

impl<'a> Unverified<'a> {
    /// A place for `stream`: a free one, or the oldest unvouched one's (that connection is shut
    /// down); `None` when every place is vouched for.
    fn take(waiting: &'a Waiting, stream: &TcpStream) -> Option<Unverified<'a>> {
        let mut g = lock(&waiting.places);
        let (next, places) = &mut *g;
        if places.len() >= MAX_UNVERIFIED {
            let oldest = places.iter().position(|p| !p.vouched)?;
            if let Some(p) = places.remove(oldest) {
                debug!(
                    peer = ?p.stream.peer_addr().ok(),
                    "{MAX_UNVERIFIED} connections wait to be known as a peer: the oldest silent one is closed"
                );
                let _ = p.stream.shutdown(Shutdown::Both);
            }
        }
        let id = *next;
        *next += 1;
        places.push_back(Place {
            id,
            stream: stream.try_clone().ok()?,
            vouched: false,
        });
        Some(Unverified { waiting, id })
    }

    /// The connection showed the secret of the QP it named: its place is not given away.
    fn vouch(&self) {
        if let Some(p) = lock(&self.waiting.places).1.iter_mut().find(|p| p.id == self.id) {
            p.vouched = true;
        }
    }
}

impl Drop for Unverified<'_> {
    fn drop(&mut self) {
        lock(&self.waiting.places).1.retain(|p| p.id != self.id);
    }
}

/// A QP's one transport connection from its peer. Its end does not free the place: RC has one
/// connection per peer, so the same connect replayed afterwards (its QPN, PSN and secret are
/// static) is refused; a new RTR peer (INIT2RTR) opens it again.
struct Bound;

/// Whether connection `c` from `from` is `qp`'s RTR peer: `Some` when it is (it now holds the
/// QP's one connection), `None` while the QP has no peer yet (not at RTR) and `c` shows its
/// secret, a fault, logged, when it lacks the secret, is not the peer, or the peer has
/// connected already.
fn verify(qp: &Arc<SoftQp>, c: &wire::Connect, from: Option<IpAddr>) -> Result<Option<Bound>, Fault> {
    // The secret first, peer or not: without it a QP is as silent as a QPN that does not exist.
    let peer = *lock(&qp.rtr_peer);
    let why = if c.secret != qp.secret {
        // Said without the numbers: they would help whoever is guessing.
        format!(
            "the connection claims QP {:#x} without this QP's transport secret",
            c.qpn
        )
    } else if let Some(peer) = peer.filter(|p| !p.admits(c.qpn, c.psn, from)) {
        format!(
            "the connection claims QP {:#x}, PSN {:#x}, from {}; the QP's RTR peer is QP {:#x}, PSN {:#x}, at {}",
            c.qpn,
            c.psn,
            from.map_or("an unknown address".into(), |a| a.to_string()),
            peer.qpn,
            peer.psn,
            peer.ip.map_or("any address".into(), |a| a.to_string()),
        )
    } else if peer.is_none() {
        return Ok(None);
    } else if qp.transport_bound.swap(true, Ordering::AcqRel) {
        format!(
            "QP {:#x} (its peer) has connected already: one connection per QP and peer, so a second \
             (or the first replayed) is refused",
            c.qpn
        )
    } else {
        return Ok(Some(Bound));
    };
    say_refused(qp, &why);
    Err(Fault::Protocol(why))
}

/// Logs a refused connection to `qp`: at warn the first time for each QP (someone who is not
/// its peer tried to reach it), at debug afterwards.
fn say_refused(qp: &SoftQp, why: &str) {
    if !qp.refusal_said.swap(true, Ordering::AcqRel) {
        warn!(
            qpn = format_args!("{:#x}", qp.qpn),
            "transport connection closed unanswered: not this queue pair's peer: {why} (said once per QP)"
        );
    } else {
        debug!(
            qpn = format_args!("{:#x}", qp.qpn),
            "transport connection closed unanswered: {why}"
        );
    }
}

/// Serves one incoming connection: the connect, then requests until the peer closes. Only a
/// QP's RTR peer is served (its QPN and first PSN, from its address); anything else, an
/// unknown QPN included, is closed without an answer, so a third party learns nothing.
fn serve(hca: &Arc<Hca>, stream: TcpStream) -> Result<(), Fault> {
    let Some(place) = Unverified::take(&hca.unverified, &stream) else {
        let why = format!(
            "{MAX_UNVERIFIED} connections that showed a QP's secret already wait to be known as its peer \
             (their QPs' sides have not connected yet): try again"
        );
        // Said before its connect is read: it tells nothing about any QP. Its connect is read
        // and dropped (briefly) after, so that closing does not reset the answer away.
        let _ = (&stream).write_all(&wire::encode_reject(&why));
        let _ = stream.shutdown(Shutdown::Write);
        let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
        let _ = io::copy(&mut (&stream).take(4096), &mut io::sink());
        return Err(Fault::Protocol(why));
    };
    let mut unverified = Some(place);
    let from = stream.peer_addr().ok().map(|a| a.ip());
    stream.set_nodelay(true)?;
    let mut reader = Reader::new(stream.try_clone()?)?;
    let mut w = BufWriter::with_capacity(CHUNK, stream);
    reader.deadline = Some(Instant::now() + CONNECT_TIMEOUT);
    let mut connecting = || {
        if hca.stop.load(Ordering::Acquire) {
            Err(Fault::Stopped)
        } else {
            Ok(())
        }
    };
    let c = wire::Connect::decode(&reader.expect(Kind::Connect, "a connect", &mut connecting)?)?;
    // Until this connection is verified as the target QP's peer it keeps the deadline it
    // arrived with, whatever it sends: it cannot hold one of the unverified places longer.
    let deadline = reader.deadline.unwrap_or_else(Instant::now);
    let Some(target) = hca.qp(c.target_qpn) else {
        return Err(Fault::Protocol(format!("connect to unknown QP {:#x}", c.target_qpn)));
    };
    let mut bound = verify(&target, &c, from)?;
    // It showed the secret (verify refuses otherwise).
    if let Some(u) = &unverified {
        u.vouch();
    }
    if bound.is_some() {
        drop(unverified.take());
    }
    w.get_ref().set_write_timeout(Some(target.retry_timeout()))?;
    w.write_all(&wire::encode_accept(c.target_qpn))?;
    w.flush()?;
    let mut w = answer_offer(hca, &target, &mut reader, w, &mut connecting)?;
    // Accepted before its QP had a peer (the QP's side connects later): served only once the
    // QP's RTR peer is this one, by the deadline. Its requests wait meanwhile.
    while bound.is_none() {
        connecting()?;
        bound = verify(&target, &c, from)?;
        if bound.is_none() {
            if Instant::now() >= deadline {
                return Err(Fault::Protocol(format!(
                    "QP {:#x} got no RTR peer within {CONNECT_TIMEOUT:?} of this connection: closed",
                    c.target_qpn
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    reader.deadline = None;
    drop(unverified.take());
    // References to the peer's GPU memory are taken over shared memory only: a TCP peer may be
    // on another host, where a handle means nothing.
    let takes_references = matches!(w, Outbound::Shm(_)) && hca.same_host.cuda_ipc;
    let mut imports = Imports::default();
    let pd = target.pd;
    // Only a weak reference while serving: a strong one would keep a destroyed QP (and so
    // its own link, whose peer's thread here holds that peer's QP) alive for ever.
    let target = {
        let weak = Arc::downgrade(&target);
        drop(target);
        weak
    };
    debug!(
        qpn = format_args!("{:#x}", c.target_qpn),
        from = format_args!("{:#x}", c.qpn),
        "transport connection accepted"
    );
    let mut idle = || {
        if hca.stop.load(Ordering::Acquire) {
            Err(Fault::Stopped)
        } else {
            Ok(())
        }
    };
    let mut cache = RegionCache::default();
    let mut fixed = [0u8; MAX_FIXED];
    let mut bounce = Vec::new();
    let mut expect = c.psn;
    let mut unacked: Option<u32> = None;
    let mut failed = false;
    // A request found no receive: everything is dropped until it comes again (RC's RNR NAK).
    let mut rnr_wait: Option<u32> = None;
    loop {
        if reader.buffered() == 0 {
            // About to wait for more requests: hold no region while idle (a dropped region's
            // memory is then released by the thread that dropped it), and acknowledge what
            // was executed.
            cache = RegionCache::default();
            if let Some(seq) = unacked.take() {
                // What is acknowledged has landed.
                imports.settle().map_err(copy_failed)?;
                w.write_all(&Response::Ack { seq }.encode_head().map_err(io::Error::other)?)?;
            }
            w.flush()?;
        }
        let h = reader.header(&mut idle)?;
        if h.kind == Kind::GpuOffer {
            // Only the QP's peer makes this side map memory (it is: verified above).
            let offer = wire::GpuOffer::decode(&reader.payload(h, &mut idle)?)?;
            let take = takes_references;
            let answer = imports.offer(&offer, take).map_err(Fault::Protocol)?;
            w.write_all(&answer.encode())?;
            continue;
        }
        let n = Request::fixed_len(h)?;
        let req = Request::decode(h, reader.fixed(n, &mut fixed, &mut idle)?)?;
        if hca.stop.load(Ordering::Acquire) {
            // Its context is gone: a dead HCA answers nothing.
            return Err(Fault::Stopped);
        }
        if let Some(k) = rnr_wait {
            if req.seq != k {
                // Sent before the requester heard the RNR NAK: dropped, it sends them again.
                skip_data(&mut reader, req.op, &mut bounce, &mut idle)?;
                continue;
            }
            rnr_wait = None;
            expect = k;
        }
        if req.seq != expect {
            return Err(Fault::Protocol(format!("request {} where {expect} was due", req.seq)));
        }
        expect = expect.wrapping_add(1);
        if failed {
            // After a NAK nothing executes; WRITE data is read and dropped.
            skip_data(&mut reader, req.op, &mut bounce, &mut idle)?;
            continue;
        }
        let ready = responder::accepts(target.upgrade().as_deref());
        match req.op {
            Op::WriteRef { .. } => imports.pending().before(Way::Write).map_err(copy_failed)?,
            Op::ReadRef { .. } => imports.pending().before(Way::Read).map_err(copy_failed)?,
            // A few bytes may be stored by the GPU behind its copies (`execute` decides).
            Op::Write { len } if (1..=STORE_MAX).contains(&(len as usize)) => {}
            // What the CPU executes, and any answer with data, comes after the GPU's copies.
            _ => imports.settle().map_err(copy_failed)?,
        }
        let answer = match (ready, target.upgrade()) {
            (Err(s), _) => {
                skip_data(&mut reader, req.op, &mut bounce, &mut idle)?;
                Err(s)
            }
            (Ok(()), Some(t)) if matches!(req.op, Op::Send { .. } | Op::SendRef { .. } | Op::WriteImm { .. }) => {
                let io = (&mut reader, &mut bounce, &mut imports);
                match two_sided(hca, &mut cache, &t, io, req, c.qpn, &mut idle)? {
                    TwoSided::Done => Ok(true),
                    TwoSided::Nak(s) => Err(s),
                    TwoSided::NotReady(timer) => {
                        // What came before it succeeded: said first, then the RNR NAK.
                        imports.settle().map_err(copy_failed)?;
                        if let Some(seq) = unacked.take() {
                            w.write_all(&Response::Ack { seq }.encode_head().map_err(io::Error::other)?)?;
                        }
                        let nak = Response::RnrNak { seq: req.seq, timer };
                        w.write_all(&nak.encode_head().map_err(io::Error::other)?)?;
                        rnr_wait = Some(req.seq);
                        continue;
                    }
                }
            }
            (Ok(()), _) => {
                let mut io = Io {
                    reader: &mut reader,
                    w: &mut w,
                    bounce: &mut bounce,
                    imports: &mut imports,
                };
                execute(hca, &mut cache, pd, &mut io, req, &mut idle)?
            }
        };
        match answer {
            Ok(true) => unacked = Some(req.seq),
            Ok(false) => unacked = None, // answered with data, which acknowledges everything before
            Err(syndrome) => {
                if let Some(t) = target.upgrade() {
                    responder::violated(&t, syndrome);
                }
                // The requests before it succeeded: their copies land first.
                imports.settle().map_err(copy_failed)?;
                w.write_all(
                    &Response::Nak { seq: req.seq, syndrome }
                        .encode_head()
                        .map_err(io::Error::other)?,
                )?;
                unacked = None;
                failed = true;
            }
        }
    }
}

/// Reads and drops the data that follows a request's head (WRITEs and SENDs carry some).
fn skip_data(
    reader: &mut Reader,
    op: Op,
    bounce: &mut Vec<u8>,
    idle: &mut dyn FnMut() -> Result<(), Fault>,
) -> Result<(), Fault> {
    if let Op::Write { len } | Op::Send { len, .. } | Op::WriteImm { len, .. } = op {
        let _ = reader.read_to_region(None, 0, len as u64, bounce, None, idle)?;
    }
    Ok(())
}

/// Reads the `len` bytes of a WRITE (with immediate or not) off the wire into the region its
/// request names, checked as a NIC checks it (rkey, PD, bounds, remote write); a bad one is
/// read and dropped and answers `RemoteAccess`, a failed copy `RemoteOp`.
#[allow(clippy::too_many_arguments)]
fn write_from_wire(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    reader: &mut Reader,
    req: &Request,
    len: u32,
    bounce: &mut Vec<u8>,
    idle: &mut dyn FnMut() -> Result<(), Fault>,
) -> Result<Result<(), Syndrome>, Fault> {
    let region = match len {
        0 => None,
        _ => match hca.region(cache, pd, req.rkey, req.addr, len as u64, Access::REMOTE_WRITE) {
            Some(r) => Some(r.clone()),
            None => {
                skip_data(reader, req.op, bounce, idle)?;
                return Ok(Err(Syndrome::RemoteAccess));
            }
        },
    };
    Ok(reader
        .read_to_region(region.as_deref(), req.addr, len as u64, bounce, None, idle)?
        .map_err(|_| Syndrome::RemoteOp))
}

/// How a SEND or a WRITE with immediate ended at the responder.
enum TwoSided {
    /// Delivered: acknowledged with what follows.
    Done,
    /// Failed: NAKed with this syndrome.
    Nak(Syndrome),
    /// No receive posted: RNR NAKed with the QP's timer code.
    NotReady(u8),
}

/// Executes a SEND or a WRITE with immediate from QP `src_qpn` against responder QP `qp`: the
/// receive is taken first (none: the request and its data are dropped, "receiver not ready"),
/// then a SEND's data is scattered into it, or a WRITE's written where it says and the receive
/// completed.
/// A SEND by reference (CUDA IPC) is copied by the GPU from the requester's mapped allocation
/// into the receive's buffers where one copier reaches both, else through host memory; it is
/// acknowledged once the copy has landed (`taken` is let go first).
fn two_sided(
    hca: &Hca,
    cache: &mut RegionCache,
    qp: &SoftQp,
    (reader, bounce, imports): (&mut Reader, &mut Vec<u8>, &mut Imports),
    req: Request,
    src_qpn: u32,
    idle: &mut dyn FnMut() -> Result<(), Fault>,
) -> Result<TwoSided, Fault> {
    let mut taken = match responder::take_receive(qp) {
        Ok(Some(t)) => t,
        other => {
            skip_data(reader, req.op, bounce, idle)?;
            return Ok(match other {
                Err(s) => TwoSided::Nak(s),
                _ => TwoSided::NotReady(qp.min_rnr_nak()),
            });
        }
    };
    let msg = match req.op {
        Op::Send { len, imm } => {
            bounce.resize(len as usize, 0);
            reader.read_exact(&mut bounce[..], idle)?;
            Message::Send {
                data: SendData::Bytes(&bounce[..]),
                imm,
            }
        }
        Op::WriteImm { len, imm } => {
            if let Err(s) = write_from_wire(hca, cache, qp.pd, reader, &req, len, bounce, idle)? {
                return Ok(TwoSided::Nak(s));
            }
            Message::WriteImm { bytes: len, imm }
        }
        Op::SendRef {
            alloc,
            offset,
            len,
            imm,
        } => {
            let (mapped, at) = referenced(imports, ipc::Reference { alloc, offset, len })?;
            let data = SendData::InPlace {
                dma: &mapped.dma,
                addr: at,
                len,
            };
            let delivered = responder::deliver(hca, cache, &mut taken, Message::Send { data, imm }, src_qpn);
            // Its copy lands, and the receive completes, before the acknowledgement.
            drop(taken);
            return Ok(match delivered {
                Ok(_) if qp.state() == QpState::Error => TwoSided::Nak(Syndrome::RemoteOp),
                Ok(_) => TwoSided::Done,
                Err(s) => TwoSided::Nak(s),
            });
        }
        _ => return Ok(TwoSided::Nak(Syndrome::RemoteInvalReq)),
    };
    // Bytes from the wire: scattered by the CPU, nothing left copying.
    Ok(match responder::deliver(hca, cache, &mut taken, msg, src_qpn) {
        Ok(_) => TwoSided::Done,
        Err(s) => TwoSided::Nak(s),
    })
}

/// A GPU copy from a mapped allocation failed (the copier broke): the connection ends, and the
/// requester's outstanding requests fail with transport errors.
fn copy_failed(_: DmaFault) -> Fault {
    Fault::Io(io::Error::other("a GPU copy out of the peer's mapped memory failed"))
}

/// What a responder's connection executes requests with.
struct Io<'a> {
    reader: &'a mut Reader,
    w: &'a mut Outbound,
    bounce: &'a mut Vec<u8>,
    imports: &'a mut Imports,
}

/// Executes one request for a QP of protection domain `pd`. `Ok(Ok(true))`: a write, to
/// acknowledge; `Ok(Ok(false))`: answered; `Ok(Err(s))`: to NAK.
fn execute(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    io: &mut Io<'_>,
    req: Request,
    idle: &mut dyn FnMut() -> Result<(), Fault>,
) -> Result<Result<bool, Syndrome>, Fault> {
    let remote = gdaki_device::Remote {
        addr: req.addr,
        rkey: req.rkey,
    };
    let Io {
        reader,
        w,
        bounce,
        imports,
    } = io;
    Ok(match req.op {
        Op::WriteRef {
            alloc,
            offset,
            len,
            tail,
        } => {
            let r = ipc::Reference { alloc, offset, len };
            by_reference(hca, cache, pd, remote, imports, bounce, Way::Write, r, tail)?
        }
        Op::ReadRef { alloc, offset, len } => {
            let r = ipc::Reference { alloc, offset, len };
            by_reference(hca, cache, pd, remote, imports, bounce, Way::Read, r, None)?
        }
        Op::Write { len } if (1..=STORE_MAX).contains(&(len as usize)) => {
            // An inline WRITE (a flag, a length): stored by the GPU behind the copies before
            // it where one copier reaches the target, else written once they are done.
            let mut data = [0u8; STORE_MAX];
            let data = &mut data[..len as usize];
            reader.read_exact(data, idle)?;
            let pending = imports.pending();
            match responder::write_small(hca, cache, pd, remote, data, pending, Syndrome::RemoteOp) {
                Ok(SmallWrite::Stored(..)) => Ok(true),
                Ok(SmallWrite::Cpu(region)) => {
                    imports.settle().map_err(copy_failed)?;
                    responder::write_into(region, remote.addr, data).map(|()| true)
                }
                Err(s) => Err(s),
            }
        }
        Op::Write { len } => write_from_wire(hca, cache, pd, reader, &req, len, bounce, idle)?.map(|()| true),
        Op::Read { len } => {
            let region = match len {
                0 => None,
                _ => match hca.region(cache, pd, req.rkey, req.addr, len as u64, Access::REMOTE_READ) {
                    Some(r) => Some(r.clone()),
                    None => return Ok(Err(Syndrome::RemoteAccess)),
                },
            };
            w.write_all(
                &Response::ReadResp { seq: req.seq, len }
                    .encode_head()
                    .map_err(io::Error::other)?,
            )?;
            if let Some(r) = region {
                from_region(w, &r, req.addr, len as u64, bounce)?;
            }
            Ok(false)
        }
        Op::FetchAdd { add } => atomic(hca, cache, pd, w, req.seq, remote, AtomicOp::FetchAdd(add))?,
        // Served by `two_sided` while its QP lives; gone, it takes nothing.
        Op::Send { .. } | Op::SendRef { .. } | Op::WriteImm { .. } => {
            skip_data(reader, req.op, bounce, idle)?;
            Err(Syndrome::RemoteInvalReq)
        }
        Op::CompareSwap { compare, swap } => atomic(
            hca,
            cache,
            pd,
            w,
            req.seq,
            remote,
            AtomicOp::CompareSwap { compare, swap },
        )?,
    })
}

/// The mapped allocation a reference names and the address of its first byte there; a
/// reference to an allocation never mapped, or past the mapping's end, is a protocol error.
fn referenced(imports: &Imports, r: ipc::Reference) -> Result<(Arc<ipc::Import>, u64), Fault> {
    let ipc::Reference { alloc, offset, len } = r;
    let mapped = imports.get(alloc).map_err(Fault::Protocol)?;
    let Some(at) = mapped.at(offset, len as u64) else {
        return Err(Fault::Protocol(format!(
            "a reference to {len} bytes at {offset:#x}, past the end of GPU allocation {alloc}"
        )));
    };
    Ok((mapped, at))
}

/// Executes a WRITE or a READ (`way`) whose bytes are at `r` in an allocation of
/// the peer's mapped here (a WRITE's perhaps followed by a `tail`'s): one GPU copy when the
/// region and the mappings have a copier in common (waited for before the acknowledgement),
/// else through host memory.
#[allow(clippy::too_many_arguments)]
fn by_reference(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    remote: gdaki_device::Remote,
    imports: &mut Imports,
    bounce: &mut Vec<u8>,
    way: Way,
    r: ipc::Reference,
    tail: Option<ipc::Reference>,
) -> Result<Result<bool, Syndrome>, Fault> {
    let len = r.len as usize;
    let (mapped, at) = referenced(imports, r)?;
    let tail = match tail {
        Some(t) => Some((referenced(imports, t)?, t.len as usize)),
        None => None,
    };
    let side = responder::Side {
        dma: &mapped.dma,
        addr: at,
        len: len as u64,
        tail: tail
            .as_ref()
            .map(|((m, at), n)| (&m.dma as &dyn crate::dma::Dma, *at, *n as u64)),
    };
    Ok(match responder::copy_by_gpu(hca, cache, pd, remote, way, side) {
        Some(Ok((copier, seq))) => {
            imports.pending().add(&copier, seq, way);
            crate::copier::release(copier);
            Ok(true)
        }
        Some(Err(s)) => Err(s),
        // Not one copier's step (the region is on another GPU, or host memory no GPU maps;
        // or nothing to move): through host memory, after the copies before it.
        None => {
            imports.settle().map_err(copy_failed)?;
            let tail_len = tail.as_ref().map_or(0, |t| t.1);
            bounce.resize(len + tail_len, 0);
            match way {
                Way::Write => {
                    let (main, rest) = bounce.split_at_mut(len);
                    let read = match &tail {
                        Some(((m, t_at), _)) => mapped.dma.read(at, main).and_then(|()| m.dma.read(*t_at, rest)),
                        None => mapped.dma.read(at, main),
                    };
                    match read {
                        Ok(()) => responder::write(hca, cache, pd, remote, &bounce[..]).map(|()| true),
                        Err(_) => Err(Syndrome::RemoteOp),
                    }
                }
                Way::Read => match responder::read(hca, cache, pd, remote, &mut bounce[..]) {
                    Ok(()) if mapped.dma.write(at, &bounce[..]).is_err() => Err(Syndrome::RemoteOp),
                    r => r.map(|()| true),
                },
            }
        }
    })
}

fn atomic(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    w: &mut impl Write,
    seq: u32,
    remote: gdaki_device::Remote,
    op: AtomicOp,
) -> io::Result<Result<bool, Syndrome>> {
    Ok(match responder::atomic(hca, cache, pd, remote, op) {
        Ok(old) => {
            w.write_all(&Response::Atomic { seq, old }.encode_head().map_err(io::Error::other)?)?;
            Ok(false)
        }
        Err(s) => Err(s),
    })
}
