//! A reliable byte-stream socket over one queue pair (GPUnet's model; the wire protocol is in
//! `docs/sockets.md`): [`Socket::send`] and [`Socket::recv`] with POSIX results (bytes moved,
//! partial allowed, 0 from `recv` at an orderly close), non-blocking forms, and a deadline (the
//! queue pair's timeout) on every wait. Thread scope. Who may call at once: one caller of the
//! sending side (`send`, `try_send`, `shutdown`) and one of the receiving side (`recv`,
//! `try_recv`) at a time; the two sides, `reset` and `flush` may run concurrently where the
//! queue pair's sharing mode takes concurrent posters ([`Cta`](crate::Cta),
//! [`Gpu`](crate::Gpu)); with [`Exclusive`](crate::Exclusive), one caller at a time in all.
//! A group's call is over once every member has returned from it: in a block, one member may
//! still ring a send's doorbell after the others return, so a next caller other than the same
//! group (a thread of it calling alone, another block) first synchronises with the whole group.
use core::sync::atomic::{AtomicU64, Ordering};
use gdaki_layout::socket::{self as layout, DevSocket, DEV_SOCKET_VERSION, SOCKET_RESET, SOCKET_SHUT_WR};
use gdaki_layout::DevQp;

use crate::arch;
use crate::copier::copy_share;
use crate::qp::{Local, Qp, Remote, ReserveAhead};
use crate::scope::{Scope, Thread};
use crate::sharing::Sharing;
use crate::status::{
    PostError, Ticket, WaitError, CODE_BAD_ARGUMENT, CODE_BAD_HANDLE, CODE_CLOSED, CODE_REFUSED, CODE_RESET,
    CODE_TIMEOUT, CODE_WOULD_BLOCK,
};

mod service;
pub use service::Service;

/// Why a socket call did nothing (or, for `send`/`recv`, moved nothing).
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub enum SocketError {
    /// `try_send` found no room in the peer's ring, `try_recv` no bytes (and no end of stream).
    WouldBlock,
    /// The peer reset the connection, or this side did (POSIX `ECONNRESET`).
    Reset,
    /// A send after this side shut down its sending side (POSIX `EPIPE`).
    Closed,
    /// A wait for room or for bytes ran past the queue pair's timeout (POSIX `ETIMEDOUT`).
    TimedOut,
    /// The handle is not a socket of this layout (its version word).
    BadHandle {
        /// The version word found.
        version: u32,
    },
    /// A post failed: the queue pair is in error (the peer died or refused an access) or full.
    Post(PostError),
    /// A completion of this socket's queue pair reported an error: the connection is lost.
    Lost(WaitError),
    /// A socket service's connect found no listener (or could not resolve the address), its
    /// listen found the port taken, its accept no listener at that port.
    Refused,
    /// An argument the call cannot take (an empty or over-long address, a null socket).
    BadArgument,
    /// (A group's members other than the leader.) The leader's post or wait failed with this
    /// status code (its own result has the details).
    Failed {
        /// The leader's status code.
        code: u32,
    },
}

impl SocketError {
    /// The outcome code ([`CODE_WOULD_BLOCK`], [`CODE_RESET`], [`CODE_CLOSED`],
    /// [`CODE_TIMEOUT`], [`CODE_BAD_HANDLE`], or a post's or completion's code).
    pub const fn code(&self) -> u32 {
        match self {
            SocketError::WouldBlock => CODE_WOULD_BLOCK,
            SocketError::Reset => CODE_RESET,
            SocketError::Closed => CODE_CLOSED,
            SocketError::TimedOut => CODE_TIMEOUT,
            SocketError::BadHandle { .. } => CODE_BAD_HANDLE,
            SocketError::Refused => CODE_REFUSED,
            SocketError::BadArgument => CODE_BAD_ARGUMENT,
            SocketError::Post(e) => e.code(),
            SocketError::Lost(e) => e.code(),
            SocketError::Failed { code } => *code,
        }
    }

    /// The error a group member reports for the leader's `code` (not [`CODE_OK`](crate::status::CODE_OK)).
    pub const fn from_code(code: u32) -> SocketError {
        match code {
            CODE_WOULD_BLOCK => SocketError::WouldBlock,
            CODE_RESET => SocketError::Reset,
            CODE_CLOSED => SocketError::Closed,
            CODE_TIMEOUT => SocketError::TimedOut,
            CODE_REFUSED => SocketError::Refused,
            CODE_BAD_ARGUMENT => SocketError::BadArgument,
            code => SocketError::Failed { code },
        }
    }
}

/// Copies `len` bytes from `src` to `dst`, member `rank` of `members` doing its part. One CPU
/// thread copies it all (`memcpy`); a group, or one GPU thread (nvptx lowers `memcpy` to a byte
/// loop), copies as the soft HCA's copier does ([`copy_share`]): neighbouring members move
/// neighbouring units (coalesced on a GPU), 16 bytes where both sides allow, eight loads in
/// flight per member (a 64 KiB send from a 256-thread block spent most of its time waiting on
/// memory with four 16-byte chunks in flight).
///
/// # Safety
/// Both ranges are valid (`dst` for writes) and do not overlap.
#[inline(always)]
unsafe fn group_copy(dst: u64, src: u64, len: u64, rank: u32, members: u32) {
    if len == 0 {
        return;
    }
    // SAFETY: the caller's contract.
    unsafe {
        if members <= 1 && cfg!(not(target_arch = "nvptx64")) {
            core::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize);
        } else {
            copy_share(dst, src, len, rank as u64, members.max(1) as u64);
        }
    }
}

/// The stream bytes a send of `want` puts at ring position `pos` of a ring of `cap` bytes (a
/// power of two) whose receiver has credited up to `credit`: those of the frame at `pos`, and
/// of a second frame at the top of the ring where the first fills the lap to its end (the
/// first may then carry none: a 16-byte trailer alone). A frame takes at most half the ring:
/// the receiver frees a frame's space only once it has read all of it, and credits every half
/// ring, so a stream of frames keeps the ring in use. `(0, 0)` where no byte fits.
#[inline(always)]
fn frame_plan(cap: u64, pos: u64, credit: u64, want: u64) -> (u64, u64) {
    let free = cap - pos.wrapping_sub(credit).min(cap);
    let to_end = cap - (pos & (cap - 1));
    let Some(room) = free.min(to_end).min(cap / 2).checked_sub(layout::TRAILER_BYTES) else {
        return (0, 0);
    };
    let first = want.min(room);
    if first == want || layout::frame_bytes(first) < to_end {
        return (first, 0);
    }
    let second = (want - first).min((free - to_end).min(cap / 2).saturating_sub(layout::TRAILER_BYTES));
    if second == 0 {
        return (first, 0);
    }
    (first, second)
}

/// What a receive's leader found: ring bytes of empty frames skipped before the frame it reads
/// (both below 2^32: at most a ring, [`layout::MAX_LOG_RING`]), and that frame's length.
#[inline(always)]
fn found_word(skipped: u64, len: u64) -> u64 {
    skipped << 32 | len
}

/// [`found_word`] read back from a receive that started at `consumed` with `taken` bytes of
/// that frame read: the frame's ring position, the bytes of it read before, and its length.
#[inline(always)]
fn found_frame(found: u64, consumed: u64, taken: u64) -> (u64, u64, u64) {
    let (skipped, len) = (found >> 32, found & u32::MAX as u64);
    if skipped == 0 {
        (consumed, taken, len)
    } else {
        (consumed + skipped, 0, len)
    }
}

/// The stream position (`consumed`, `taken`) once `n` more bytes are read of the frame of
/// `len` stream bytes at ring position `pos`, `done` of them read before: past the frame once
/// all of it is read.
#[inline(always)]
fn read_on(pos: u64, done: u64, len: u64, n: u64) -> (u64, u64) {
    if done + n == len {
        (pos + layout::frame_bytes(len), 0)
    } else {
        (pos, done + n)
    }
}

/// A send's frames: one, or two where the second carries bytes (see [`frame_plan`]).
#[inline(always)]
fn frame_count(second: u64) -> u32 {
    if second > 0 {
        2
    } else {
        1
    }
}

/// Frame `k` (0 or 1) of a send at ring position `pos` whose frames carry `first` and
/// `second` bytes: its ring position, offset in the send and bytes. (Selected, not an array a
/// loop indexes: a GPU keeps such an array in local memory, stores and loads on every send.)
#[inline(always)]
fn nth_frame(pos: u64, first: u64, second: u64, k: u32) -> (u64, u64, u64) {
    if k == 0 {
        (pos, 0, first)
    } else {
        (pos + layout::frame_bytes(first), first, second)
    }
}

/// The ring position after a send's frames.
#[inline(always)]
fn frames_end(pos: u64, first: u64, second: u64) -> u64 {
    let (last, _, len) = nth_frame(pos, first, second, frame_count(second) - 1);
    last + layout::frame_bytes(len)
}

/// How a send of `n` bytes (as [`frame_plan`] chose) splits between its two frames, from `n`
/// alone (so a group's members need only the count): a frame holds at most the bytes before
/// the ring's end (and half the ring) less its trailer.
#[inline(always)]
fn frame_split(cap: u64, pos: u64, n: u64) -> (u64, u64) {
    let to_end = cap - (pos & (cap - 1));
    let first = n.min(to_end.min(cap / 2) - layout::TRAILER_BYTES);
    (first, n - first)
}

/// What a step called out of line returns where it failed, its error left in the caller's
/// slot (see [`fail_into`]).
const FAILED: u64 = u64::MAX;

/// An out-of-line step's end: its word (never [`FAILED`]), or [`FAILED`] with the error in
/// `failure`.
#[inline(always)]
fn fail_into(outcome: Result<u64, SocketError>, failure: &mut Option<SocketError>) -> u64 {
    match outcome {
        Ok(word) => word,
        Err(e) => {
            *failure = Some(e);
            FAILED
        }
    }
}

/// The caller's side of [`fail_into`]: the word, or the error the step left.
#[inline(always)]
fn outcome(word: u64, failure: &Option<SocketError>) -> Result<u64, SocketError> {
    match failure {
        Some(e) if word == FAILED => Err(*e),
        _ => Ok(word),
    }
}

/// Lanes in a warp: in a group larger than this, a member outside the leader's warp rings a
/// send's doorbell.
const WARP: u32 = 32;

/// The member that rings a block's send (see `send_in`): the first lane outside the leader's
/// warp.
const RINGER: u32 = WARP;

/// Runs `step` on the leader of `scope` and hands its outcome to every member (the others get
/// the leader's error as its code: [`SocketError::from_code`]).
fn on_leader<S: Scope>(scope: S, step: impl FnOnce() -> Result<u64, SocketError>) -> Result<u64, SocketError> {
    on_leader_settle(scope, step, || ())
}

/// [`on_leader`], where the leader also runs `settle` once `step` succeeded and every member
/// has come this far, before it hands the outcome on: for the words that every member read
/// as the call started and that the leader may change only once they all have (a send's
/// `sent`), where no earlier barrier of the call says so.
fn on_leader_settle<S: Scope>(
    scope: S,
    step: impl FnOnce() -> Result<u64, SocketError>,
    settle: impl FnOnce(),
) -> Result<u64, SocketError> {
    // The leader's error itself is set aside where there is one: the barriers and the
    // broadcast see two words, so a call that succeeds tests a word, not the variants of an
    // `Option<Result<..>>` (which compiled to indirect branches through jump tables on every
    // call, its error's `code()` among them).
    let mut failure = None;
    let mut word = [0, 0];
    if scope.is_leader() {
        match step() {
            Ok(v) => word[0] = v,
            Err(e) => {
                word[1] = e.code() as u64;
                failure = Some(e);
            }
        }
    }
    if S::SOLO {
        if failure.is_none() {
            settle();
        }
    } else {
        // A barrier of its own before the broadcast's: on 2 x H100 a block's send and receive
        // calls took 20-30% less time with it (docs/figures.md, "A barrier before a socket's
        // broadcast"). Why is not known: the time the broadcast took (6 us at 64 KiB, growing
        // with the block's copy) moved, less of it, into the copy after it.
        scope.sync();
        if scope.is_leader() && failure.is_none() {
            settle();
        }
        // Every call of this starts with that barrier: one barrier less than a broadcast.
        word = scope.broadcast_met(word);
    }
    // The leader's own error first: its word would read as success were its code ever 0.
    match (failure, word) {
        (Some(e), _) => Err(e),
        (None, [value, 0]) => Ok(value),
        (None, [_, code]) => Err(SocketError::from_code(code as u32)),
    }
}

/// Where a stream call's time goes, for the socket perftests ([`bench`]'s `Send` and `Recv`):
/// `mark(0)` as a call starts, then `mark(k)` after its step `k` of [`STEPS`]. The calls of
/// the socket API mark into [`NoSteps`], which compiles to nothing.
trait Steps: Default {
    fn mark(&mut self, step: usize);
    /// The step sums and the calls, where they were kept (see [`bench`]).
    fn sums(&self) -> Option<([u64; STEPS], u64)>;
}

/// Steps a stream call has, as the socket perftests time them. A send: room found (the look at
/// the peer's credit, and any wait for one), the group told how much, bytes copied into the
/// staging ring (with the barrier; none from registered memory), WQEs written, doorbell rung
/// (0 in a block of more than a warp on an exclusive queue pair: another member rings after
/// the result), the group told the result. A receive: bytes seen (the looks at the count), the
/// group told, bytes copied out (with the barrier), consumed, credited (the inline WRITE once
/// half a ring is read), the group told the result. The leader's marks; in one thread the
/// telling costs nothing.
pub const STEPS: usize = 6;

/// Marks nothing: every call but the perftests' timed ones.
#[derive(Default)]
struct NoSteps;

impl Steps for NoSteps {
    #[inline(always)]
    fn mark(&mut self, _: usize) {}
    #[inline(always)]
    fn sums(&self) -> Option<([u64; STEPS], u64)> {
        None
    }
}

/// The time between the marks of every call, summed per step (ns, from
/// `arch::global_timer_ns`), and the calls.
#[derive(Default)]
struct StepSums {
    last: u64,
    sums: [u64; STEPS],
    calls: u64,
}

impl Steps for StepSums {
    #[inline(always)]
    fn mark(&mut self, step: usize) {
        let now = arch::global_timer_ns();
        match step.checked_sub(1).and_then(|k| self.sums.get_mut(k)) {
            Some(sum) => *sum += now.saturating_sub(self.last),
            None => self.calls += 1,
        }
        self.last = now;
    }
    #[inline(always)]
    fn sums(&self) -> Option<([u64; STEPS], u64)> {
        Some((self.sums, self.calls))
    }
}

impl From<PostError> for SocketError {
    fn from(e: PostError) -> Self {
        SocketError::Post(e)
    }
}

/// Stream bytes that have landed in this side's receive ring, read where they lie: what
/// [`Socket::peek_with`] found (up to one frame's bytes), until [`Socket::consume_with`] lets
/// them go. The peer writes over them only once they are consumed and credited, so they hold
/// still until then. Reading them in place saves a receive's copy out of the ring (GPUnet's
/// `grecv` copies; Linux's `TCP_ZEROCOPY_RECEIVE` maps instead).
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct Landed {
    addr: u64,
    len: u64,
    /// The frame's ring position, its stream bytes, the bytes of it read before this view,
    /// and the ring's frame key (a view of another socket is refused).
    pos: u64,
    frame_len: u64,
    done: u64,
    key: u64,
}

impl Landed {
    /// The bytes' address (in the receive ring's memory: GPU memory for a GPU socket with
    /// rings there); 0 for an empty view.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// How many bytes: 0 once the stream has ended (or for a peek of 0 bytes).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// No bytes: the stream has ended (or the peek asked for none).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, in place.
    ///
    /// # Safety
    /// The socket is alive and connected, this view has not been consumed (nor the bytes after
    /// it received), and the reader is the group that peeked, after the peek returned (its
    /// acquire of the frame's trailer is what orders the bytes before these reads).
    pub unsafe fn bytes<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller's contract: `len` bytes at `addr` lie in the live receive ring,
        // and the peer writes them again only after they are consumed and credited.
        unsafe { core::slice::from_raw_parts(self.addr as *const u8, self.len as usize) }
    }
}

/// A connected socket: what [`from_raw`](Self::from_raw) reads out of a [`DevSocket`] once,
/// and the queue pair it posts through.
pub struct Socket<M: Sharing> {
    s: *mut DevSocket,
    qp: Qp<M>,
    rx_window: u64,
    tx_ring: u64,
    tx_lkey: u32,
    peer: Remote,
    log_rx: u32,
    log_tx: u32,
    rx_key: u64,
    tx_key: u64,
}

/// One look at a control word of this side's receive window and the copy of `reset` beside
/// it (`docs/sockets.md`).
struct Look {
    value: u64,
    reset: u64,
}

/// Whether the socket may wait (the blocking forms) or must say it would block.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Wait,
    Try,
}

/// Where a send's bytes come from: the caller's buffer, copied into the staging ring by the
/// group, or registered memory the HCA reads itself (`send_from`).
#[derive(Clone, Copy)]
enum Source<'a> {
    Copy(&'a [u8]),
    Region(Local, u64),
}

impl Source<'_> {
    /// Bytes left to send.
    #[inline(always)]
    fn len(&self) -> u64 {
        match self {
            Source::Copy(data) => data.len() as u64,
            Source::Region(_, len) => *len,
        }
    }

    /// The same source without its first `n` bytes (`n` at most `len`).
    #[inline(always)]
    fn after(self, n: u64) -> Self {
        match self {
            Source::Copy(data) => Source::Copy(data.get(n as usize..).unwrap_or(&[])),
            Source::Region(src, len) => Source::Region(src.offset(n), len.saturating_sub(n)),
        }
    }

    /// The registered memory the WQEs read, where nothing is copied.
    #[inline(always)]
    fn region(&self) -> Option<Local> {
        match self {
            Source::Copy(_) => None,
            Source::Region(src, _) => Some(*src),
        }
    }
}

impl<M: Sharing> Socket<M> {
    /// Wraps a socket handle the host wrote.
    ///
    /// # Safety
    /// `ptr` points to a `DevSocket` written by the host for this device (its queue pair's
    /// handle, windows and rings valid for this device or thread and registered as it says),
    /// alive for as long as this value is used, and used by one caller at a time on each side
    /// (a sender and a receiver may be two: each side's words are its own), a group's call
    /// lasting until its last member returns (see the module's documentation).
    pub unsafe fn from_raw(ptr: *mut DevSocket) -> Result<Self, SocketError> {
        // The constants, each read once: a volatile read of the whole handle also loaded the
        // stream's words (`sent` .. `taken`, which the calls load themselves where they need
        // them), volatile loads the compiler must keep, and more registers for them.
        macro_rules! field {
            ($f:ident) => {
                // SAFETY: `ptr` is a live handle (the caller's contract); an aligned field of it.
                unsafe { core::ptr::read_volatile(&raw const (*ptr).$f) }
            };
        }
        let version = field!(version);
        if version != DEV_SOCKET_VERSION {
            return Err(SocketError::BadHandle { version });
        }
        Ok(Socket {
            s: ptr,
            qp: {
                let qp = field!(qp) as *mut DevQp;
                // SAFETY: the socket's queue pair handle, valid as the socket is (the contract).
                unsafe { Qp::<M>::from_raw(qp) }
            },
            rx_window: field!(rx_window),
            tx_ring: field!(tx_ring),
            tx_lkey: field!(tx_lkey),
            peer: Remote {
                addr: field!(peer_window),
                rkey: field!(peer_rkey),
            },
            log_rx: field!(log_rx),
            log_tx: field!(log_tx),
            rx_key: field!(rx_key),
            tx_key: field!(tx_key),
        })
    }

    /// Sends up to `data.len()` bytes, waiting (bounded) until the peer's ring has room for
    /// some: the number sent, which may be fewer (a partial send, as POSIX `send`). `data` is
    /// copied into the staging ring, so it may be reused at once. 0 bytes sends nothing.
    pub fn send(&self, data: &[u8]) -> Result<usize, SocketError> {
        self.send_with(Thread, data)
    }

    /// [`send`](Self::send) that never waits: [`SocketError::WouldBlock`] when the peer's ring
    /// is full.
    pub fn try_send(&self, data: &[u8]) -> Result<usize, SocketError> {
        self.try_send_with(Thread, data)
    }

    /// Receives up to `buf.len()` bytes, waiting (bounded) until some have arrived: the number
    /// received, 0 once the peer has shut down and every byte it sent has been read.
    pub fn recv(&self, buf: &mut [u8]) -> Result<usize, SocketError> {
        self.recv_with(Thread, buf)
    }

    /// [`recv`](Self::recv) that never waits: [`SocketError::WouldBlock`] when nothing has
    /// arrived and the stream has not ended.
    pub fn try_recv(&self, buf: &mut [u8]) -> Result<usize, SocketError> {
        self.try_recv_with(Thread, buf)
    }

    /// Shuts down the sending side: the peer reads what was sent, then gets 0. Later sends
    /// fail with [`SocketError::Closed`]; receiving goes on. A second call does nothing.
    pub fn shutdown(&self) -> Result<(), SocketError> {
        self.shutdown_with(Thread)
    }

    /// Resets the connection: the peer's calls fail with [`SocketError::Reset`] from now on,
    /// and so do this side's. Nothing in flight is waited for.
    pub fn reset(&self) -> Result<(), SocketError> {
        self.reset_with(Thread)
    }

    /// Waits (bounded) until everything this side posted has completed: its bytes, credits,
    /// `fin` and `reset` have reached the peer's memory. What a close does before the queue
    /// pair goes.
    pub fn flush(&self) -> Result<(), SocketError> {
        self.flush_with(Thread)
    }

    /// [`send`](Self::send) by the group `scope` (GPUnet's threadblock-cooperative `gsend`):
    /// every member calls with the same `data`, all copy a part of it, the leader posts and
    /// waits; every member gets the same count (a member other than the leader gets
    /// [`SocketError::Failed`] where the leader got a post or completion error).
    pub fn send_with<S: Scope>(&self, scope: S, data: &[u8]) -> Result<usize, SocketError> {
        self.send_in(scope, Source::Copy(data), Mode::Wait, &mut NoSteps)
    }

    /// [`try_send`](Self::try_send) by the group `scope`.
    pub fn try_send_with<S: Scope>(&self, scope: S, data: &[u8]) -> Result<usize, SocketError> {
        self.send_in(scope, Source::Copy(data), Mode::Try, &mut NoSteps)
    }

    /// [`send`](Self::send) of `len` bytes of registered memory at `src` (its key names the
    /// region) without the copy into the staging ring: the HCA reads them from `src` after the
    /// call returns, so they must stay unchanged until a [`flush`](Self::flush) has returned
    /// (or the peer has answered what they carry). The bytes land in the stream as `send`'s
    /// would, so the two mix freely; a key the HCA refuses fails the queue pair, and the
    /// socket's calls then fail with [`SocketError::Lost`].
    pub fn send_from(&self, src: Local, len: u64) -> Result<usize, SocketError> {
        self.send_from_with(Thread, src, len)
    }

    /// [`send_from`](Self::send_from) that never waits: [`SocketError::WouldBlock`] when the
    /// peer's ring is full.
    pub fn try_send_from(&self, src: Local, len: u64) -> Result<usize, SocketError> {
        self.try_send_from_with(Thread, src, len)
    }

    /// [`send_from`](Self::send_from) by the group `scope`: every member calls with the same
    /// arguments, the leader posts (after a barrier, so what the members wrote to `src` before
    /// the call is what the HCA reads); every member gets the same count.
    pub fn send_from_with<S: Scope>(&self, scope: S, src: Local, len: u64) -> Result<usize, SocketError> {
        self.send_in(scope, Source::Region(src, len), Mode::Wait, &mut NoSteps)
    }

    /// [`try_send_from`](Self::try_send_from) by the group `scope`.
    pub fn try_send_from_with<S: Scope>(&self, scope: S, src: Local, len: u64) -> Result<usize, SocketError> {
        self.send_in(scope, Source::Region(src, len), Mode::Try, &mut NoSteps)
    }

    /// [`send_from_with`](Self::send_from_with) until all `len` bytes are sent.
    pub fn send_all_from_with<S: Scope>(&self, scope: S, src: Local, len: u64) -> Result<(), SocketError> {
        self.send_all_in(scope, Source::Region(src, len), &mut NoSteps)
    }

    /// [`recv`](Self::recv) by the group `scope` (`grecv`): every member calls with the same
    /// `buf`, the leader waits, all copy a part out.
    pub fn recv_with<S: Scope>(&self, scope: S, buf: &mut [u8]) -> Result<usize, SocketError> {
        self.recv_in(scope, buf, Mode::Wait, &mut NoSteps)
    }

    /// [`try_recv`](Self::try_recv) by the group `scope`.
    pub fn try_recv_with<S: Scope>(&self, scope: S, buf: &mut [u8]) -> Result<usize, SocketError> {
        self.recv_in(scope, buf, Mode::Try, &mut NoSteps)
    }

    /// Waits (bounded) until stream bytes have landed and says where they lie in the receive
    /// ring, up to `max` of them (and of one frame), without copying them out: read them there
    /// ([`Landed::bytes`]), then let them go with [`consume`](Self::consume). Until then a
    /// peek sees the same bytes again. An empty view once the peer has shut down and every
    /// byte it sent has been consumed.
    pub fn peek(&self, max: u64) -> Result<Landed, SocketError> {
        self.peek_with(Thread, max)
    }

    /// [`peek`](Self::peek) that never waits: [`SocketError::WouldBlock`] when nothing has
    /// arrived and the stream has not ended.
    pub fn try_peek(&self, max: u64) -> Result<Landed, SocketError> {
        self.try_peek_with(Thread, max)
    }

    /// Lets go of the first `n` bytes of `view`, this socket's latest peek: a later receive or
    /// peek starts after them, and their ring space goes back to the peer (credited as a
    /// receive's). [`SocketError::BadArgument`], consuming nothing, where `n` is more than the
    /// view holds or the view is not of the stream's next bytes (already consumed, received
    /// since, or another socket's).
    pub fn consume(&self, view: &Landed, n: u64) -> Result<(), SocketError> {
        self.consume_with(Thread, view, n)
    }

    /// [`peek`](Self::peek) by the group `scope`: every member calls with the same `max`, the
    /// leader waits, all get the same view.
    pub fn peek_with<S: Scope>(&self, scope: S, max: u64) -> Result<Landed, SocketError> {
        self.peek_in(scope, max, Mode::Wait, &mut NoSteps)
    }

    /// [`try_peek`](Self::try_peek) by the group `scope`.
    pub fn try_peek_with<S: Scope>(&self, scope: S, max: u64) -> Result<Landed, SocketError> {
        self.peek_in(scope, max, Mode::Try, &mut NoSteps)
    }

    /// [`consume`](Self::consume) by the group `scope`: every member calls with the same
    /// arguments once its reads of the bytes are done (a barrier orders them before the
    /// credit that lets the peer write there again).
    pub fn consume_with<S: Scope>(&self, scope: S, view: &Landed, n: u64) -> Result<(), SocketError> {
        self.consume_in(scope, view, n, &mut NoSteps)
    }

    /// [`consume_with`](Self::consume_with) of the stream's next `n` bytes, looked at again
    /// (no wait: they have landed): for callers that keep no view (the C ABI).
    /// [`SocketError::BadArgument`], consuming nothing, where fewer than `n` of the frame have
    /// landed (more than a peek could show).
    pub fn consume_next_with<S: Scope>(&self, scope: S, n: u64) -> Result<(), SocketError> {
        if n == 0 {
            return Ok(());
        }
        let view = match self.peek_in(scope, n, Mode::Try, &mut NoSteps) {
            Err(SocketError::WouldBlock) => return Err(SocketError::BadArgument),
            other => other?,
        };
        self.consume_in(scope, &view, n, &mut NoSteps)
    }

    /// [`shutdown`](Self::shutdown) by the group `scope` (its leader posts).
    pub fn shutdown_with<S: Scope>(&self, scope: S) -> Result<(), SocketError> {
        // A member may still be ringing for the group's last send (see `send_in`).
        scope.sync();
        on_leader(scope, || {
            let (sent, flags) = (self.sent(), self.flags());
            self.usable(flags, self.control(layout::RESET))?;
            if flags & SOCKET_SHUT_WR == 0 {
                self.qp
                    .put_inline(self.peer_word(layout::FIN), &(sent + 1).to_le_bytes())?;
                self.add_flags(SOCKET_SHUT_WR);
            }
            Ok(0)
        })
        .map(|_| ())
    }

    /// [`reset`](Self::reset) by the group `scope` (its leader posts).
    pub fn reset_with<S: Scope>(&self, scope: S) -> Result<(), SocketError> {
        // A member may still be ringing for the group's last send (see `send_in`).
        scope.sync();
        on_leader(scope, || {
            let flags = self.flags();
            if flags & SOCKET_RESET == 0 {
                self.add_flags(SOCKET_RESET);
                let q = self.qp.deferred();
                for word in [layout::RESET, layout::RESET_BY_CREDIT] {
                    q.put_inline(self.peer_word(word), &1u64.to_le_bytes())?;
                }
                q.commit()?;
            }
            Ok(0)
        })
        .map(|_| ())
    }

    /// [`flush`](Self::flush) by the group `scope` (its leader waits).
    pub fn flush_with<S: Scope>(&self, scope: S) -> Result<(), SocketError> {
        // A member may still be ringing for the group's last send (see `send_in`).
        scope.sync();
        on_leader(scope, || self.qp.quiet().map(|()| 0).map_err(SocketError::Lost)).map(|_| ())
    }

    /// [`send_with`](Self::send_with) until all of `data` is sent.
    pub fn send_all_with<S: Scope>(&self, scope: S, data: &[u8]) -> Result<(), SocketError> {
        self.send_all_in(scope, Source::Copy(data), &mut NoSteps)
    }

    /// Sends all of `src`, its calls' steps marked in `steps`.
    fn send_all_in<S: Scope>(&self, scope: S, mut src: Source, steps: &mut impl Steps) -> Result<(), SocketError> {
        while src.len() > 0 {
            let n = self.send_in(scope, src, Mode::Wait, steps)?;
            src = src.after(n as u64);
        }
        Ok(())
    }

    /// [`recv_with`](Self::recv_with) until `buf` is full; [`SocketError::Closed`] if the
    /// stream ends first.
    pub fn recv_exact_with<S: Scope>(&self, scope: S, buf: &mut [u8]) -> Result<(), SocketError> {
        self.recv_exact_in(scope, buf, &mut NoSteps)
    }

    /// Fills `buf`, its calls' steps marked in `steps`.
    fn recv_exact_in<S: Scope>(&self, scope: S, buf: &mut [u8], steps: &mut impl Steps) -> Result<(), SocketError> {
        let mut at = 0;
        while at < buf.len() {
            match self.recv_in(scope, &mut buf[at..], Mode::Wait, steps)? {
                0 => return Err(SocketError::Closed),
                n => at += n,
            }
        }
        Ok(())
    }

    /// The peer's receive ring at `off`.
    fn peer_ring(&self, off: u64) -> Remote {
        Remote {
            addr: self.peer.addr + layout::CONTROL_BYTES + off,
            rkey: self.peer.rkey,
        }
    }

    /// The staging ring at `off`.
    fn tx_local(&self, off: u64) -> Local {
        Local {
            addr: self.tx_ring + off,
            lkey: self.tx_lkey,
        }
    }

    /// Waits (bounded) until the byte at `flag` (written by the HCA) is `value`.
    fn wait_flag(&self, flag: *const u8, value: u8) -> Result<(), SocketError> {
        // SAFETY: callers pass a byte of this side's receive ring (registered, alive).
        unsafe { self.qp.wait_until_u8(flag, value) }.map_err(|e| match e {
            WaitError::Flag { .. } | WaitError::Timeout { .. } => SocketError::TimedOut,
            e => SocketError::Lost(e),
        })
    }

    /// Waits (bounded) until the peer has shut down and every byte it sent is taken (read or,
    /// here, dropped unread): the second half of an orderly close.
    pub fn wait_end_with<S: Scope>(&self, scope: S) -> Result<(), SocketError> {
        on_leader(scope, || {
            let mut deadline = self.qp.deadline();
            loop {
                let (consumed, flags, reset) = (self.consumed(), self.flags(), self.control(layout::RESET));
                let frame = self.frame_at(consumed);
                self.usable(flags, reset)?;
                if let Some(len) = frame? {
                    self.set_consumed(consumed + layout::frame_bytes(len));
                    self.set_taken(0);
                    continue;
                }
                let fin = self.control(layout::FIN);
                if fin != 0 && fin - 1 == consumed {
                    return Ok(0);
                }
                self.idle(Mode::Wait, &mut deadline)?;
            }
        })
        .map(|_| ())
    }

    /// An orderly close in both directions, as GPUnet's `gclose`: shuts down the sending side,
    /// waits for the peer's end of stream (dropping what it still sends), and flushes. After
    /// it neither side posts to the other, so both may drop their queue pairs.
    pub fn close_with<S: Scope>(&self, scope: S) -> Result<(), SocketError> {
        self.shutdown_with(scope)?;
        self.wait_end_with(scope)?;
        self.flush_with(scope)
    }

    /// A send (`mode`: wait for room or not), its steps marked in `steps` (see [`Steps`]).
    fn send_in<S: Scope>(
        &self,
        scope: S,
        src: Source,
        mode: Mode,
        steps: &mut impl Steps,
    ) -> Result<usize, SocketError> {
        steps.mark(0);
        let cap = 1u64 << self.log_tx;
        let want = src.len();
        // `sent` and the credit last seen are written by the leader alone, before the last
        // call's closing barrier, so every member reads the same values: where that credit
        // already leaves room for all of `data` (a credit only grows), every member knows `n`
        // and the copy starts at once, with no look at the window and no broadcast. The leader
        // loads `flags` and the peer's `reset` now, in flight during the copy, and checks them
        // before it posts (bytes copied into the staging ring of a broken stream are never
        // put). Otherwise the leader looks at the credit (and waits for room), and keeps what
        // it saw only once every member has read the old value (see `publish` below).
        let (sent, credit) = (self.sent(), self.credit_seen());
        // The leader's post reads the send queue's counters: loaded now, beside the words
        // above, not one after the other after the copy (an exclusive queue pair: see `stage`).
        let ahead = if scope.is_leader() {
            self.qp.reserve_ahead()
        } else {
            None
        };
        let words = scope
            .is_leader()
            .then(|| (self.flags(), self.control(layout::RESET_BY_CREDIT)));
        let mut fresh = None;
        let plan = |credit: u64| {
            let (first, second) = frame_plan(cap, sent, credit, want);
            first + second
        };
        let fast = want != 0 && plan(credit) == want;
        let early = words.filter(|_| fast);
        let n = if fast {
            steps.mark(1);
            want
        } else {
            on_leader(scope, || {
                let mut deadline = self.qp.deadline();
                loop {
                    let flags = self.flags();
                    let seen = self.look_credit();
                    fresh = Some(seen.value);
                    self.sendable(flags, seen.reset)?;
                    if want == 0 {
                        steps.mark(1);
                        return Ok(0);
                    }
                    // A blocking send takes all of `data` or, where it cannot wait for that
                    // (more than a frame holds), at least half a ring: bytes dribbled into
                    // what a frame's padding left cost a call and a WRITE each. It waits only
                    // while more than half a ring is uncredited, which a receiver that reads on
                    // always credits.
                    let n = plan(seen.value);
                    let free = cap - sent.wrapping_sub(seen.value).min(cap);
                    if n == want || (n > 0 && (mode == Mode::Try || free >= cap / 2)) {
                        steps.mark(1);
                        return Ok(n);
                    }
                    self.idle(mode, &mut deadline)?;
                }
            })?
        };
        steps.mark(2);
        if n == 0 {
            return Ok(0);
        }
        // One frame, or two where the first fills the ring to its end: each is composed in the
        // staging ring where it lands in the peer's (the bytes, then the leader's trailer) and
        // put with one WRITE.
        let (first, second) = frame_split(cap, sent, n);
        if let Source::Copy(data) = src {
            for k in 0..frame_count(second) {
                let (pos, at, len) = nth_frame(sent, first, second, k);
                self.compose(scope, pos, data.as_ptr() as u64 + at, len);
            }
        }
        // In a group of more than a warp on an exclusive queue pair, the WQEs are rung after
        // the result's broadcast by another member (`RINGER`), so the doorbell's fences overlap
        // the leader's next call and the others' next copy, where they held the whole group (a
        // 64 KiB send's 3.1 of 7.8 us on 2 x H200, docs/figures.md). A thread, a warp (whose
        // lanes would only take turns) or a shared queue pair ring on the leader, before the
        // broadcast. Where the ring is late, `submit` cannot fail, so the result the group
        // hears is the send's.
        let from = src.region();
        let late = scope.size() > WARP && self.qp.submit_cannot_fail();
        // The bytes must be in place before the doorbell that lets the HCA read them: where the
        // leader rings, a barrier after the copy (or after what the members wrote into
        // registered memory). A late doorbell comes after the result's barriers, which order
        // every member's bytes before the ringer's fence: there the leader posts as soon as
        // its own part is done, and the ringer, still in the last call's fences, holds no
        // barrier of this call before the leader has posted. Nothing is rung out of order:
        // the ringer rings each call's WQEs, all written before the barrier it passed, in
        // call order; calls whose leader posts before their first barrier start with one
        // (`shutdown_with`, `reset_with`, `flush_with`).
        if !late {
            scope.sync();
        }
        steps.mark(3);
        // `sent` and the credit seen change only once every member read them for this call
        // (they all did by the result's first barrier): before it, where no copy barrier
        // says so.
        let publish = || {
            if let Some(credit) = fresh {
                self.set_credit_seen(credit);
            }
            self.set_sent(frames_end(sent, first, second));
        };
        let ring = on_leader_settle(
            scope,
            || {
                let last = self.stage(sent, n, early, ahead, from)?;
                steps.mark(4);
                if !late {
                    publish();
                    self.qp.commit()?;
                }
                steps.mark(5);
                Ok(if late { last + 1 } else { 0 })
            },
            || {
                if late {
                    publish();
                }
            },
        );
        steps.mark(6);
        let ring = ring?;
        if ring != 0 && scope.rank() == RINGER {
            self.qp.submit(ring)?;
        }
        Ok(n as usize)
    }

    /// The leader's WQEs for the `n` bytes of a send's frames at ring position `sent` (see
    /// [`frame_split`]), marked ready for one doorbell; the last one's index is returned. A
    /// frame composed in the staging ring goes as one WRITE; from registered memory (`from`,
    /// holding all `n`), a frame is one WRITE gathered from there and from the staging ring
    /// (its padding and trailer, written there first), or, past one message, its bytes'
    /// WRITEs and its trailer's inline WRITE after them (RC places them in posting order). A
    /// fast send's `early` look at `flags` and the peer's `reset` is checked before any WQE is
    /// marked ready, so a broken stream's bytes are never put.
    ///
    /// One reservation for all of them: as a post each (up to four), the reservation's path
    /// was inlined four times, and the send took 255 registers and spilled (ptxas, sm_90).
    #[inline(always)]
    fn stage(
        &self,
        sent: u64,
        n: u64,
        early: Option<(u64, u64)>,
        ahead: Option<ReserveAhead>,
        from: Option<Local>,
    ) -> Result<Ticket, SocketError> {
        // On an exclusive queue pair the early look is checked once the WQEs are written, as
        // late as it can be and with its loads in flight meanwhile (the reservation is given
        // back where it fails); a shared one checks before it reserves.
        let late = ahead.is_some();
        if let Some((flags, reset)) = early.filter(|_| !late) {
            self.sendable(flags, reset)?;
        }
        let cap = 1u64 << self.log_tx;
        let (first, second) = frame_split(cap, sent, n);
        let q = self.qp.deferred();
        let mut count = 0;
        for k in 0..frame_count(second) {
            let (_, _, len) = nth_frame(sent, first, second, k);
            count += Self::frame_wqes(q, len, from);
        }
        // `ahead` was loaded as this call started: one caller at a time on an exclusive
        // socket, so nothing reserved on its queue pair since.
        let base = q.reserve_from(ahead, count.min(u32::MAX as u64) as u32)?;
        let mut next = base;
        let mut written = Ok(());
        for k in 0..frame_count(second) {
            let (pos, at, len) = nth_frame(sent, first, second, k);
            next = self.stage_frame(q, next, pos, at, len, from, &mut written);
        }
        debug_assert_eq!(next, base + count, "a send's frames took other slots than it reserved");
        if let Some((flags, reset)) = early.filter(|_| late) {
            if let Err(e) = self.sendable(flags, reset) {
                q.unreserve(ahead, base);
                return Err(e);
            }
        }
        q.mark_ready(base, next).map_err(PostError::from)?;
        written?;
        Ok(next - 1)
    }

    /// The group's part of composing the frame of `len` bytes at ring position `pos` in the
    /// staging ring: the bytes from `src`, copied by every member, and the leader's trailer.
    #[inline(always)]
    fn compose<S: Scope>(&self, scope: S, pos: u64, src: u64, len: u64) {
        let cap = 1u64 << self.log_tx;
        let frame = layout::frame_bytes(len);
        let off = layout::frame_offset(cap, pos, frame);
        // SAFETY: the frame lies in the staging ring (`frame_offset`: it never wraps), which
        // the peer's credit freed; the send's `src` holds `len` bytes from here.
        unsafe { group_copy(self.tx_ring + off, src, len, scope.rank(), scope.size()) };
        if scope.is_leader() {
            self.write_trailer(off + frame - layout::TRAILER_BYTES, pos, len);
        }
    }

    /// The WQE slots [`stage_frame`](Self::stage_frame) writes for a frame of `len` bytes: the
    /// frame's WRITE from the staging ring (its bytes and trailer); from registered memory, one
    /// WRITE gathered from there and the staging ring where the frame is one message, else the
    /// bytes' WRITEs (none for none) and the trailer's inline WRITE.
    #[inline(always)]
    fn frame_wqes(q: Qp<M>, len: u64, from: Option<Local>) -> u64 {
        match from {
            None => q.put_wqes(layout::frame_bytes(len)),
            Some(_) if len == 0 => 1,
            Some(_) if Self::gathered(q, len) => 1,
            Some(_) => q.put_wqes(len) + 1,
        }
    }

    /// Whether a frame of `len` bytes (more than 0) from registered memory goes as one WRITE
    /// gathered from there and the staging ring: when the frame is one message.
    #[inline(always)]
    fn gathered(q: Qp<M>, len: u64) -> bool {
        len > 0 && q.put_wqes(layout::frame_bytes(len)) == 1
    }

    /// Writes the WQEs of the frame of `len` bytes at ring position `pos`, bytes `at..` of the
    /// send (see [`stage`](Self::stage)), into the reserved slots from `index`
    /// ([`frame_wqes`](Self::frame_wqes) of them); the index after them. A WQE that cannot be
    /// written is a NOP in its slot and its error goes to `written`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // a frame's place, its source and the slot's outcome
    fn stage_frame(
        &self,
        q: Qp<M>,
        index: u64,
        pos: u64,
        at: u64,
        len: u64,
        from: Option<Local>,
        written: &mut Result<(), SocketError>,
    ) -> u64 {
        let cap = 1u64 << self.log_tx;
        let frame = layout::frame_bytes(len);
        let off = layout::frame_offset(cap, pos, frame);
        let Some(local) = from else {
            return q.wqe_prepare_put(index, self.peer_ring(off), self.tx_local(off), frame);
        };
        if Self::gathered(q, len) {
            // The trailer goes where the frame's would be composed; the WRITE takes the bytes
            // from the caller's memory and the padding and trailer from there, so its last
            // bytes are the trailer, as a frame composed in the staging ring has them.
            self.write_trailer(off + frame - layout::TRAILER_BYTES, pos, len);
            let bytes = (local.offset(at), len as u32);
            let tail = (self.tx_local(off + len), (frame - len) as u32);
            return q.wqe_prepare_put_gather(index, self.peer_ring(off), bytes, tail);
        }
        let next = if len > 0 {
            q.wqe_prepare_put(index, self.peer_ring(off), local.offset(at), len)
        } else {
            index
        };
        let words = self.trailer(pos, len);
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&words[0].to_le_bytes());
        bytes[8..].copy_from_slice(&words[1].to_le_bytes());
        let trailer = self.peer_ring(off + frame - layout::TRAILER_BYTES);
        if let Err(e) = q.wqe_prepare_write_inline(next, trailer, &bytes, 0) {
            // Keep the ring consistent: the slot must hold a valid WQE before it is ready.
            q.wqe_prepare_nop(next, 0);
            *written = Err(e.into());
        }
        next + 1
    }

    /// The trailer of the frame of `len` bytes at ring position `pos` of this side's stream.
    #[inline(always)]
    fn trailer(&self, pos: u64, len: u64) -> [u64; 2] {
        [len, layout::frame_tag(pos, len, self.tx_key)]
    }

    /// Writes the trailer of the frame of `len` bytes at ring position `pos` into the staging
    /// ring at `off`.
    #[inline(always)]
    fn write_trailer(&self, off: u64, pos: u64, len: u64) {
        // SAFETY: `off` is a frame's last 16 bytes in the staging ring (16-byte aligned: the
        // ring is, and frames are multiples of `FRAME_ALIGN`), which the peer's credit freed.
        unsafe { ((self.tx_ring + off) as *mut [u64; 2]).write_volatile(self.trailer(pos, len)) };
    }

    /// The frame at ring position `pos` of this side's receive ring: its length, once its
    /// trailer has landed (an acquire load: its bytes, placed before the trailer, are visible
    /// after it); `Err` where the trailer claims a frame the ring cannot hold (a broken peer).
    #[inline(always)]
    fn frame_at(&self, pos: u64) -> Result<Option<u64>, SocketError> {
        let cap = 1u64 << self.log_rx;
        let off = layout::frame_offset(cap, pos, layout::TRAILER_BYTES);
        // SAFETY: the trailer's 16 bytes lie in this side's receive ring (registered, alive,
        // 16-byte aligned), written only by the HCA.
        let [len, tag] =
            unsafe { arch::load_u64x2_acquire((self.rx_window + layout::CONTROL_BYTES + off) as *const [u64; 2]) };
        if tag != layout::frame_tag(pos, len, self.rx_key) {
            return Ok(None);
        }
        if len > cap - layout::TRAILER_BYTES || layout::frame_bytes(len) > cap - (pos & (cap - 1)) {
            return Err(SocketError::Reset);
        }
        Ok(Some(len))
    }

    /// A receive's leader: waits for a frame at `consumed` with bytes beyond `taken` (skipping
    /// empty frames), or the end of the stream (or, for an empty buffer, nothing); returns
    /// [`found_word`].
    #[inline(always)]
    fn wait_frame(
        &self,
        consumed: u64,
        taken: u64,
        empty: bool,
        mode: Mode,
        steps: &mut impl Steps,
    ) -> Result<u64, SocketError> {
        let mut deadline = self.qp.deadline();
        let mut pos = consumed;
        loop {
            let (flags, reset) = (self.flags(), self.control(layout::RESET));
            let frame = self.frame_at(pos);
            self.usable(flags, reset)?;
            let done = if pos == consumed { taken } else { 0 };
            match frame {
                // A trailer claiming more than the ring holds: no credit allowed it, so the
                // stream is broken. Its bytes stay where they are, and every later call fails
                // as this one.
                Err(e) => {
                    self.add_flags(SOCKET_RESET);
                    return Err(e);
                }
                Ok(Some(len)) if len > done => {
                    steps.mark(1);
                    return Ok(found_word(pos - consumed, len));
                }
                // An empty frame (the rest of a lap that had room for a trailer only).
                Ok(Some(len)) => {
                    pos += layout::frame_bytes(len);
                    continue;
                }
                Ok(None) => {}
            }
            // Nothing new: has the stream ended? (`fin` only now: a look of its own.)
            let fin = self.control(layout::FIN);
            if (fin != 0 && fin - 1 == pos) || empty {
                steps.mark(1);
                return Ok(found_word(pos - consumed, done));
            }
            self.idle(mode, &mut deadline)?;
        }
    }

    /// A receive (`mode`: wait for bytes or not), its steps marked in `steps` (see [`Steps`]).
    fn recv_in<S: Scope>(
        &self,
        scope: S,
        buf: &mut [u8],
        mode: Mode,
        steps: &mut impl Steps,
    ) -> Result<usize, SocketError> {
        steps.mark(0);
        let cap = 1u64 << self.log_rx;
        // The leader waits for a frame (or the end); everyone learns how far it skipped (empty
        // frames) and the frame's length. The others read only `consumed` and `taken` (see
        // `send_in`).
        let (consumed, taken) = (self.consumed(), self.taken());
        // The leader's last credit, loaded as the call starts (beside `consumed`), not after the
        // copy's barrier: one memory round trip less on a call's path.
        let mut credited = 0;
        let found = on_leader(scope, || {
            credited = self.credited();
            self.wait_frame(consumed, taken, buf.is_empty(), mode, steps)
        })?;
        steps.mark(2);
        let (pos, done, len) = found_frame(found, consumed, taken);
        let n = (buf.len() as u64).min(len.saturating_sub(done));
        if n == 0 {
            return Ok(0);
        }
        // The frame's bytes landed before its trailer, which the leader read with an acquire
        // load (`frame_at`) before the group's broadcast.
        let src = self.rx_byte(cap, pos, len, done);
        // What the leader records after the copy, computed before it: fewer words live across
        // the copy's loop (more of them spilled inside it).
        let (consumed, taken) = read_on(pos, done, len, n);
        // SAFETY: the frame lies in the receive ring (`frame_at` checked it); the peer does not
        // write it again before this side's credit says so; `buf` holds at least `n`.
        unsafe { group_copy(buf.as_mut_ptr() as u64, src, n, scope.rank(), scope.size()) };
        scope.sync();
        steps.mark(3);
        self.finish_read(scope, consumed, taken, credited, n, steps)
            .map(|n| n as usize)
    }

    /// The end of a read whose bytes the group has read (its barrier behind them): the leader
    /// records the stream's new position (`consumed`, `taken`) and credits the peer where due
    /// (`credited` its last credit); every member gets `n`, or the leader's error.
    #[inline(always)]
    fn finish_read<S: Scope>(
        &self,
        scope: S,
        consumed: u64,
        taken: u64,
        credited: u64,
        n: u64,
        steps: &mut impl Steps,
    ) -> Result<u64, SocketError> {
        let cap = 1u64 << self.log_rx;
        let read = on_leader(scope, || {
            self.set_consumed(consumed);
            self.set_taken(taken);
            steps.mark(4);
            // Credit once half a ring is read and not credited: a sender only waits for room
            // while more than half a ring is uncredited, so reading on always frees it, and a
            // stream costs one credit per half ring (not one per message).
            // No credit once the peer has shut down: it sends nothing more, and it may be gone.
            if consumed - credited >= cap / 2 && self.control(layout::FIN) == 0 {
                let mut failure = None;
                outcome(self.credit(consumed, &mut failure), &failure)?;
            }
            steps.mark(5);
            Ok(n)
        });
        steps.mark(6);
        read
    }

    /// The address of byte `done` of the frame of `len` stream bytes at ring position `pos`
    /// in this side's receive ring of `cap` bytes (read once a call: a load after the call's
    /// barriers otherwise).
    #[inline(always)]
    fn rx_byte(&self, cap: u64, pos: u64, len: u64, done: u64) -> u64 {
        self.rx_window + layout::CONTROL_BYTES + layout::frame_offset(cap, pos, layout::frame_bytes(len)) + done
    }

    /// A peek (`mode`: wait for bytes or not), its steps marked in `steps` as a receive's
    /// first two; nothing is recorded (a skipped empty frame is skipped again, or consumed).
    fn peek_in<S: Scope>(&self, scope: S, max: u64, mode: Mode, steps: &mut impl Steps) -> Result<Landed, SocketError> {
        steps.mark(0);
        let cap = 1u64 << self.log_rx;
        let (consumed, taken) = (self.consumed(), self.taken());
        let found = on_leader(scope, || self.wait_frame(consumed, taken, max == 0, mode, steps))?;
        steps.mark(2);
        let (pos, done, len) = found_frame(found, consumed, taken);
        let n = max.min(len.saturating_sub(done));
        // The frame's bytes landed before its trailer, which the leader read with an acquire
        // load (`frame_at`) before the group's broadcast.
        let addr = if n == 0 { 0 } else { self.rx_byte(cap, pos, len, done) };
        Ok(Landed {
            addr,
            len: n,
            pos,
            frame_len: len,
            done,
            key: self.rx_key,
        })
    }

    /// A consume, its steps marked in `steps` as a receive's last four (the barrier in the
    /// copy's place).
    fn consume_in<S: Scope>(&self, scope: S, view: &Landed, n: u64, steps: &mut impl Steps) -> Result<(), SocketError> {
        let cap = 1u64 << self.log_rx;
        let (consumed, taken) = (self.consumed(), self.taken());
        // The view is of the stream's next bytes: at its position, or past empty frames the
        // peek skipped (recorded by no one), with nothing of the frame taken yet. Every member
        // reads the same words (written by the leader before the last call's broadcast), so
        // all refuse together.
        let next = if view.pos == consumed {
            view.done == taken
        } else {
            taken == 0 && view.done == 0 && view.pos.wrapping_sub(consumed) < cap
        };
        if view.key != self.rx_key || !next || n > view.len {
            return Err(SocketError::BadArgument);
        }
        if n == 0 {
            return Ok(());
        }
        let (consumed, taken) = read_on(view.pos, view.done, view.frame_len, n);
        // Every member's reads of the bytes (and of `consumed`) before the leader lets the
        // ring space go.
        scope.sync();
        steps.mark(3);
        self.finish_read(scope, consumed, taken, self.credited(), n, steps)
            .map(|_| ())
    }

    /// Credits the peer up to ring position `consumed` (an inline WRITE): 0, or [`FAILED`] with
    /// the error in `failure`. Not inlined: once every half ring, and its WQE's registers would
    /// otherwise count against every receive. (Its error comes back beside a word, not in a
    /// `Result`: that would come back through local memory, copied there piece by piece on
    /// every call.)
    #[inline(never)]
    fn credit(&self, consumed: u64, failure: &mut Option<SocketError>) -> u64 {
        let put = self
            .qp
            .put_inline(self.peer_word(layout::CREDIT), &consumed.to_le_bytes());
        if put.is_ok() {
            self.set_credited(consumed);
        }
        fail_into(put.map(|_| 0).map_err(SocketError::from), failure)
    }

    /// Between looks at the control words: take this queue pair's completions (an error one
    /// means the connection is lost), then say would-block or check the deadline. A blocking
    /// wait does so only every few hundred looks (`Deadline::poll_due`): each look is a memory
    /// round trip, a CQ poll from host memory one more, and a backoff after a few of them slept
    /// through the message (microseconds of every round trip).
    fn idle(&self, mode: Mode, deadline: &mut crate::qp::Deadline) -> Result<(), SocketError> {
        if mode == Mode::Wait && !deadline.poll_due() {
            return Ok(());
        }
        if let Some(Err(e)) = self.qp.poll_one() {
            return Err(SocketError::Lost(e));
        }
        if mode == Mode::Try {
            return Err(SocketError::WouldBlock);
        }
        if deadline.expired() {
            return Err(SocketError::TimedOut);
        }
        Ok(())
    }

    /// Refuses every call once either side reset the connection (`reset`: the peer's word,
    /// as last looked at).
    fn usable(&self, flags: u64, reset: u64) -> Result<(), SocketError> {
        if flags & SOCKET_RESET != 0 || reset != 0 {
            return Err(SocketError::Reset);
        }
        Ok(())
    }

    /// [`usable`](Self::usable), and refuses a send after this side shut down.
    fn sendable(&self, flags: u64, reset: u64) -> Result<(), SocketError> {
        self.usable(flags, reset)?;
        if flags & SOCKET_SHUT_WR != 0 {
            return Err(SocketError::Closed);
        }
        Ok(())
    }

    /// A control word of this side's receive window, as the peer last wrote it.
    fn control(&self, word: u64) -> u64 {
        // SAFETY: the window's control words are 8-byte aligned words of registered memory
        // (the handle's contract), written only by the HCA.
        unsafe { arch::load_u64_volatile((self.rx_window + word) as *const u64) }
    }

    /// `credit` and the copy of `reset` beside it, in one 16-byte load: one memory
    /// transaction, where the window is host memory mapped into the GPU one PCIe read (a
    /// microsecond; one after another, and four loads to one line, cost more).
    fn look_credit(&self) -> Look {
        // SAFETY: the window's control words are registered memory (the handle's contract),
        // a 16-byte aligned pair (the window is, and `CREDIT` is 16), written only by the HCA.
        let [value, reset] = unsafe { arch::load_u64x2_acquire((self.rx_window + layout::CREDIT) as *const [u64; 2]) };
        Look { value, reset }
    }

    /// A control word of the peer's receive window.
    fn peer_word(&self, word: u64) -> Remote {
        Remote {
            addr: self.peer.addr + word,
            rkey: self.peer.rkey,
        }
    }

    /// `flags`, a relaxed load: its bits only fail calls and no data is published through
    /// them, so nothing after the load needs ordering by it (a send's leader loads it beside
    /// the copy and looks at it after).
    fn flags(&self) -> u64 {
        self.flags_word().load(Ordering::Relaxed)
    }

    /// A word of the stream's state that one side's one caller at a time reads and writes
    /// (`sent`, `credit_seen`: the sender's; `consumed`, `taken`, `credited`: the receiver's).
    /// On an exclusive socket (one caller at a time in all: one group) a block-scope load,
    /// which an SM's L1 serves after the group's own store; where the queue pair takes
    /// concurrent posters, the two sides may be other blocks, so a volatile load.
    #[inline(always)]
    fn own(&self, word: *const u64) -> u64 {
        // SAFETY: `word` is a field of the live handle (8-byte aligned), touched only by the
        // side's caller, whose group's barriers order its members' accesses (the contract).
        unsafe {
            if M::SHARED {
                core::ptr::read_volatile(word)
            } else {
                arch::load_u64_block(word)
            }
        }
    }

    /// Stores a word of the stream's state (see [`own`](Self::own)).
    #[inline(always)]
    fn set_own(&self, word: *mut u64, v: u64) {
        // SAFETY: as in `own`.
        unsafe {
            if M::SHARED {
                core::ptr::write_volatile(word, v)
            } else {
                arch::store_u64_block(word, v)
            }
        }
    }

    /// Bytes of this stream put to the peer.
    fn sent(&self) -> u64 {
        // SAFETY (field addresses): the live handle's; only the address is taken.
        self.own(unsafe { &raw const (*self.s).sent })
    }

    /// Bytes of the peer's stream taken out of the receive ring.
    fn consumed(&self) -> u64 {
        // SAFETY: as in `sent`.
        self.own(unsafe { &raw const (*self.s).consumed })
    }

    /// Bytes of the frame at `consumed` already taken.
    fn taken(&self) -> u64 {
        // SAFETY: as in `sent`.
        self.own(unsafe { &raw const (*self.s).taken })
    }

    fn set_taken(&self, v: u64) {
        // SAFETY: as in `sent`.
        self.set_own(unsafe { &raw mut (*self.s).taken }, v)
    }

    /// `consumed` as last credited to the peer.
    fn credited(&self) -> u64 {
        // SAFETY: as in `sent`.
        self.own(unsafe { &raw const (*self.s).credited })
    }

    /// The peer's credit as this side last read it.
    fn credit_seen(&self) -> u64 {
        // SAFETY: as in `sent`.
        self.own(unsafe { &raw const (*self.s).credit_seen })
    }

    fn set_credit_seen(&self, v: u64) {
        // SAFETY: as in `sent`.
        self.set_own(unsafe { &raw mut (*self.s).credit_seen }, v)
    }

    /// `flags`, which both sides (and `reset`) may change at once.
    fn flags_word(&self) -> &AtomicU64 {
        // SAFETY: the live handle's 8-byte aligned `flags`, touched only atomically.
        unsafe { AtomicU64::from_ptr(&raw mut (*self.s).flags) }
    }

    fn set_sent(&self, v: u64) {
        // SAFETY: as in `sent`.
        self.set_own(unsafe { &raw mut (*self.s).sent }, v)
    }

    fn set_consumed(&self, v: u64) {
        // SAFETY: as in `sent`.
        self.set_own(unsafe { &raw mut (*self.s).consumed }, v)
    }

    fn set_credited(&self, v: u64) {
        // SAFETY: as in `sent`.
        self.set_own(unsafe { &raw mut (*self.s).credited }, v)
    }

    fn add_flags(&self, bits: u64) {
        self.flags_word().fetch_or(bits, Ordering::AcqRel);
    }
}

/// GPUnet's echo server on one socket, in group `scope` (every member calls with the same
/// `buf`): receives into `buf` and sends each piece back until the peer's end of stream, then
/// shuts down and flushes. Returns the bytes echoed.
pub fn echo<M: Sharing, S: Scope>(sock: &Socket<M>, scope: S, buf: &mut [u8]) -> Result<u64, SocketError> {
    let mut total = 0u64;
    loop {
        let n = sock.recv_with(scope, buf)?;
        if n == 0 {
            break;
        }
        let mut at = 0;
        while at < n {
            at += sock.send_with(scope, &buf[at..n])?;
        }
        total += n as u64;
    }
    sock.shutdown_with(scope)?;
    sock.flush_with(scope)?;
    Ok(total)
}

// ------------------------------------------------------------------------------ benchmarks

/// What one side of a socket benchmark does (`sock_bw`, `sock_lat`, and their references on
/// the same queue pair and memory).
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
#[repr(u32)]
pub enum BenchRole {
    /// Sends `iters` messages of `size` bytes (each whole), then closes (in order: every role
    /// ends with both sides' end of stream, so neither posts to a queue pair that is gone).
    Send = 0,
    /// Receives until the end of the stream, then shuts down.
    Recv = 1,
    /// Sends a message, then receives one back, `iters` times.
    Ping = 2,
    /// Receives a message, then sends it back, `iters` times.
    Pong = 3,
    /// The bandwidth reference: `iters` RDMA WRITEs of `size` bytes from the staging ring into
    /// the peer's receive ring, no socket protocol (no copies, no credits), then a wait for
    /// all: `put_bw` on the same queue pair and memory.
    RawSend = 4,
    /// The latency reference: `write_lat`'s ping on the same queue pair and memory (the last
    /// byte of each message is its round's flag).
    RawPing = 5,
    /// `write_lat`'s pong.
    RawPong = 6,
    /// Closes once the peer does (the peer of [`RawSend`](Self::RawSend)), keeping its socket
    /// until then.
    Idle = 7,
    /// GPUnet's echo server ([`echo`]).
    Echo = 8,
    /// An echo client that checks: sends `iters` messages of `size` bytes of a known pattern
    /// (byte `i` of the stream is `pattern_byte(i)`), reads each back and compares, then closes.
    /// A byte that differs is [`SocketError::Failed`] with [`CODE_WRONG_DATA`].
    Check = 9,
    /// [`Send`](Self::Send) from registered memory ([`Socket::send_from`]): each message is
    /// the first `size` bytes of the staging ring's memory (registered; the bytes the
    /// bandwidth reference puts), sent without a copy. [`SocketError::BadArgument`] where
    /// `size` is more than the ring.
    SendFrom = 10,
    /// [`Recv`](Self::Recv) in place: peeks at each message where it landed
    /// ([`Socket::peek_with`], up to the buffer's length) and consumes it, copying nothing out.
    RecvInPlace = 11,
}

/// [`BenchRole::Check`]'s failure code: the echo differed from what was sent.
pub const CODE_WRONG_DATA: u32 = 0xdada;

/// Byte `i` of [`BenchRole::Check`]'s stream.
pub const fn pattern_byte(i: u64) -> u8 {
    (i.wrapping_mul(131).wrapping_add(7) ^ (i >> 8)) as u8
}

impl BenchRole {
    /// The role of code `c`.
    pub const fn from_code(c: u32) -> Option<BenchRole> {
        Some(match c {
            0 => BenchRole::Send,
            1 => BenchRole::Recv,
            2 => BenchRole::Ping,
            3 => BenchRole::Pong,
            4 => BenchRole::RawSend,
            5 => BenchRole::RawPing,
            6 => BenchRole::RawPong,
            7 => BenchRole::Idle,
            8 => BenchRole::Echo,
            9 => BenchRole::Check,
            10 => BenchRole::SendFrom,
            11 => BenchRole::RecvInPlace,
            _ => return None,
        })
    }

    /// Timestamps the role records: two (start, end) for the bandwidth roles, a round start
    /// for each of `iters` rounds and the end for the pings, none for the others. Then where
    /// the stream's time goes: `Send` and `Recv` add their calls' step sums ([`STEPS`] of them,
    /// ns) and their calls, `Ping` and `Pong` those of their sends and then of their receives.
    pub const fn timestamps(self, iters: u32) -> usize {
        match (self, self.steps_at(iters)) {
            (BenchRole::Send | BenchRole::SendFrom | BenchRole::Recv | BenchRole::RecvInPlace, Some(at)) => {
                at + STEPS + 1
            }
            (BenchRole::Ping | BenchRole::Pong, Some(at)) => at + 2 * (STEPS + 1),
            (BenchRole::RawSend, _) => 2,
            (BenchRole::RawPing, _) => iters as usize + 1,
            _ => 0,
        }
    }

    /// Where the role's step sums start among its timestamps (see
    /// [`timestamps`](Self::timestamps)): after the bandwidth roles' two stamps, after the
    /// ping's round stamps, first for the pong; `Ping` and `Pong` put their receives' sums
    /// [`STEPS`] + 1 words after their sends'. `None` for a role that records none.
    pub const fn steps_at(self, iters: u32) -> Option<usize> {
        match self {
            BenchRole::Send | BenchRole::SendFrom | BenchRole::Recv | BenchRole::RecvInPlace => Some(2),
            BenchRole::Ping => Some(iters as usize + 1),
            BenchRole::Pong => Some(0),
            _ => None,
        }
    }
}

/// Runs `role` on `sock` in group `scope` (every member with the same arguments) for `iters`
/// messages of `size` bytes through `buf` (at least `size` bytes); the leader writes the
/// role's timestamps ([`BenchRole::timestamps`], `arch::global_timer_ns`) at `times`. Returns
/// the bytes this side moved. With `TIMED` the calls' steps are timed and their sums written
/// after the stamps; without, those words are left as they were (zero: no calls), and the
/// calls run as an application's do: in a GPU kernel the timing's code cost a copying 64 KiB
/// stream 7-8% (docs/figures.md, "Where a send's WQE step goes").
///
/// # Safety
/// `times` is valid for the role's timestamps; `size` is at most a ring (the raw roles put
/// whole messages into the peer's ring) and, for the raw roles, at least 1.
#[inline(always)]
pub unsafe fn bench<M: Sharing, S: Scope, const TIMED: bool>(
    sock: &Socket<M>,
    scope: S,
    role: BenchRole,
    size: u64,
    iters: u32,
    buf: &mut [u8],
    times: *mut u64,
) -> Result<u64, SocketError> {
    // SAFETY: the caller's contract.
    unsafe {
        if TIMED {
            bench_with::<M, S, StepSums>(sock, scope, role, size, iters, buf, times)
        } else {
            bench_with::<M, S, NoSteps>(sock, scope, role, size, iters, buf, times)
        }
    }
}

/// [`bench`], its calls' steps kept in `T`.
///
/// # Safety
/// As for [`bench`].
unsafe fn bench_with<M: Sharing, S: Scope, T: Steps>(
    sock: &Socket<M>,
    scope: S,
    role: BenchRole,
    size: u64,
    iters: u32,
    buf: &mut [u8],
    times: *mut u64,
) -> Result<u64, SocketError> {
    let stamp = |i: usize| {
        if scope.is_leader() {
            // SAFETY: the role's timestamps fit (the contract).
            unsafe { times.add(i).write_volatile(arch::global_timer_ns()) };
        }
    };
    // A side's step sums and calls, at timestamp `at` on (`BenchRole::steps_at`).
    let at = role.steps_at(iters).unwrap_or(0);
    let record_steps = |at: usize, steps: &T| {
        if let (true, Some((sums, calls))) = (scope.is_leader(), steps.sums()) {
            for (i, v) in sums.iter().chain([&calls]).enumerate() {
                // SAFETY: the role's timestamps fit (the contract): its stamps, then these.
                unsafe { times.add(at + i).write_volatile(*v) };
            }
        }
    };
    let msg = size.min(buf.len() as u64) as usize;
    match role {
        BenchRole::Send | BenchRole::SendFrom => {
            let src = if role == BenchRole::SendFrom {
                if size > 1u64 << sock.log_tx {
                    return Err(SocketError::BadArgument);
                }
                Source::Region(sock.tx_local(0), size)
            } else {
                Source::Copy(&buf[..msg])
            };
            let mut steps = T::default();
            stamp(0);
            for _ in 0..iters {
                sock.send_all_in(scope, src, &mut steps)?;
            }
            sock.shutdown_with(scope)?;
            sock.flush_with(scope)?;
            stamp(1);
            record_steps(at, &steps);
            sock.wait_end_with(scope)?;
            Ok(src.len() * iters as u64)
        }
        BenchRole::Recv | BenchRole::RecvInPlace => {
            let mut steps = T::default();
            stamp(0);
            let mut total = 0;
            loop {
                let n = if role == BenchRole::RecvInPlace {
                    let view = sock.peek_in(scope, buf.len() as u64, Mode::Wait, &mut steps)?;
                    sock.consume_in(scope, &view, view.len(), &mut steps)?;
                    view.len()
                } else {
                    sock.recv_in(scope, buf, Mode::Wait, &mut steps)? as u64
                };
                if n == 0 {
                    break;
                }
                total += n;
            }
            stamp(1);
            record_steps(at, &steps);
            // The sender waits for this side's end before it closes.
            sock.shutdown_with(scope)?;
            sock.flush_with(scope)?;
            Ok(total)
        }
        BenchRole::Ping | BenchRole::Pong => {
            let (mut sends, mut recvs) = (T::default(), T::default());
            for i in 0..iters as usize {
                if role == BenchRole::Ping {
                    stamp(i);
                    sock.send_all_in(scope, Source::Copy(&buf[..msg]), &mut sends)?;
                    sock.recv_exact_in(scope, &mut buf[..msg], &mut recvs)?;
                } else {
                    sock.recv_exact_in(scope, &mut buf[..msg], &mut recvs)?;
                    sock.send_all_in(scope, Source::Copy(&buf[..msg]), &mut sends)?;
                }
            }
            if role == BenchRole::Ping {
                stamp(iters as usize);
            }
            record_steps(at, &sends);
            record_steps(at + STEPS + 1, &recvs);
            sock.close_with(scope)?;
            Ok(msg as u64 * iters as u64)
        }
        BenchRole::RawSend => {
            stamp(0);
            on_leader(scope, || {
                let cap = 1u64 << sock.log_tx;
                // Whole message slots, as a stream fills the ring: a message lands on the one
                // a ring before it, never across two (an HCA may order a WRITE after one onto
                // the same bytes; after several it waits).
                // (No division by zero: kernels must not carry a panic path.)
                let slots = cap.checked_div(size).unwrap_or(1);
                for i in 0..iters as u64 {
                    let off = i.checked_rem(slots).unwrap_or(0) * size;
                    sock.qp.put(sock.peer_ring(off), sock.tx_local(off), size)?;
                }
                sock.qp.quiet().map_err(SocketError::Lost)?;
                Ok(0)
            })?;
            stamp(1);
            sock.close_with(scope)?;
            Ok(size * iters as u64)
        }
        BenchRole::RawPing | BenchRole::RawPong => {
            on_leader(scope, || {
                let last = size - 1;
                // SAFETY: this side's receive ring holds at least `size` bytes (the contract);
                // the HCA writes its byte `last`.
                let mine = (sock.rx_window + layout::CONTROL_BYTES + last) as *const u8;
                let flag_out = (sock.tx_ring + last) as *mut u8;
                for i in 0..iters as usize {
                    let flag = (i % 255) as u8 + 1;
                    if role == BenchRole::RawPing {
                        stamp(i);
                    } else {
                        sock.wait_flag(mine, flag)?;
                    }
                    // SAFETY: the staging ring's byte `last`, this side's own.
                    unsafe { flag_out.write_volatile(flag) };
                    sock.qp.put(sock.peer_ring(0), sock.tx_local(0), size)?;
                    if role == BenchRole::RawPing {
                        sock.wait_flag(mine, flag)?;
                    }
                }
                if role == BenchRole::RawPing {
                    stamp(iters as usize);
                }
                Ok(0)
            })?;
            sock.close_with(scope)?;
            Ok(size * iters as u64)
        }
        BenchRole::Echo => echo(sock, scope, buf),
        BenchRole::Check => {
            for k in 0..iters as u64 {
                let base = k * msg as u64;
                // Every member writes its bytes of the message.
                let mut i = scope.rank() as usize;
                while i < msg {
                    buf[i] = pattern_byte(base + i as u64);
                    i += scope.size().max(1) as usize;
                }
                scope.sync();
                sock.send_all_with(scope, &buf[..msg])?;
                // Cleared (each member its bytes), so only the echo can refill it.
                let mut i = scope.rank() as usize;
                while i < msg {
                    buf[i] = 0;
                    i += scope.size().max(1) as usize;
                }
                scope.sync();
                sock.recv_exact_with(scope, &mut buf[..msg])?;
                let wrong = buf[..msg]
                    .iter()
                    .enumerate()
                    .any(|(i, &b)| b != pattern_byte(base + i as u64));
                if scope.broadcast_flag(wrong) {
                    return Err(SocketError::Failed { code: CODE_WRONG_DATA });
                }
            }
            sock.close_with(scope)?;
            Ok(msg as u64 * iters as u64)
        }
        BenchRole::Idle => {
            // The raw WRITEs do not count as stream bytes: only the peer's close ends this.
            sock.close_with(scope)?;
            Ok(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::Thread;
    use crate::status::CODE_OK;

    #[test]
    fn on_leader_hands_back_the_leaders_value_or_its_own_error() {
        assert_eq!(on_leader(Thread, || Ok(7)), Ok(7));
        assert_eq!(on_leader(Thread, || Err(SocketError::Reset)), Err(SocketError::Reset));
        // An error whose code reads as "ok" in the broadcast word is still the leader's error.
        let odd = SocketError::Failed { code: CODE_OK };
        assert_eq!(on_leader(Thread, || Err(odd)), Err(odd));
    }

    /// Every plan fits: frames inside the lap and the credit, at most half a ring each, the
    /// second only at the top of the ring; the members' split from the count alone agrees; and
    /// a send blocks only where the receiver, once it reads on, must credit.
    #[test]
    fn a_send_plans_frames_that_fit_and_its_members_agree() {
        let cap = 4096u64;
        // Positions and credits are frame boundaries: multiples of `FRAME_ALIGN`.
        let step = layout::FRAME_ALIGN as usize;
        for pos in (0..3 * cap).step_by(step) {
            for used in (0..=cap).step_by(step) {
                let credit = pos.saturating_sub(used);
                for want in [0, 1, 15, 16, 17, 100, 112, 113, 2000, 2032, 2033, 4096, 10_000] {
                    let (first, second) = frame_plan(cap, pos, credit, want);
                    let n = first + second;
                    assert!(n <= want);
                    assert_eq!(frame_split(cap, pos, n), (first, second), "{pos} {credit} {want}");
                    let mut end = pos;
                    for k in 0..frame_count(second) {
                        let (at, _, len) = nth_frame(pos, first, second, k);
                        let frame = layout::frame_bytes(len);
                        assert!(
                            frame <= cap / 2 && (at & (cap - 1)) + frame <= cap,
                            "{pos} {credit} {want}"
                        );
                        end = at + frame;
                    }
                    assert_eq!(end, frames_end(pos, first, second));
                    if n > 0 {
                        assert!(end - credit <= cap, "past the credit: {pos} {credit} {want}");
                    }
                    if second > 0 {
                        assert_eq!(
                            (pos + layout::frame_bytes(first)) & (cap - 1),
                            0,
                            "second not at the top"
                        );
                    }
                    if want > 0 && n == 0 {
                        assert!(
                            pos - credit > cap / 2,
                            "blocked with half a ring credited: {pos} {credit}"
                        );
                    }
                }
            }
        }
    }
}
