//! The soft HCA's carrier between two processes of one machine: the frames of a transport
//! connection go through two rings in a shared-memory segment instead of the loopback socket.
//!
//! - **Set-up.** The TCP connection carries the connect and its verification as it does
//!   between hosts. Then the requester offers a segment it created under `/dev/shm` (its
//!   name goes over the connection), and the responder maps it if it can: same machine, same
//!   user, a regular file of exactly the size expected, the right magic. Both switch; in every
//!   other case (another host, `/dev/shm` full or missing, turned off on either side) the
//!   connection stays on TCP. The name is unlinked as soon as both have it mapped.
//! - **The same bytes.** The rings carry exactly the frames TCP would, in the same order, so
//!   pipelining, ordering, NAKs and flushes are the TCP transport's code (`net`), unchanged.
//! - **Dead peers.** The TCP connection stays open and idle. A process that dies closes it, and
//!   a side waiting for bytes or room checks it at every poll interval: a dead peer still ends
//!   in a transport error well within the retry timeout. An orderly close sets the ring's
//!   closed flag, which wakes the other side at once.
//! - **Untrusted peer.** The other process can write anything into the segment. Positions are
//!   checked before use (a corrupt ring breaks the connection, as a malformed frame does), the
//!   frames are parsed as untrusted bytes above, and the segment is never grown or remapped.
//!
//! Each ring is single-producer, single-consumer: the producer publishes its tail with a
//! release store, the consumer its head. A side with nothing to do spins (at least [`MIN_SPIN`]) and then
//! sleeps on a futex in the segment (not process-private, so the other process can wake it);
//! the other side only pays the wake system call when the waiting flag says someone sleeps.
use std::fs::File;
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{FallocateFlags, FileType, Mode, OFlags};
use rustix::thread::futex;

/// Bytes of each ring. A power of two; 2 MiB and a page per connection in all, which the
/// 64 MiB `/dev/shm` of a default container holds 31 times before offers start to fail (and
/// connections stay on TCP).
pub(crate) const RING_BYTES: usize = 1 << 20;

/// How often blocked reads (of the socket and of the shared ring) wake up to check deadlines,
/// stop flags and dead peers.
pub(crate) const POLL: Duration = Duration::from_millis(50);
/// The segment header: magic, ring size, the two rings' control blocks.
const HEADER: usize = 4096;
/// The segment's size.
pub(crate) const SEGMENT_BYTES: usize = HEADER + 2 * RING_BYTES;
/// First word of a segment: "GDKISHM" and a layout version.
const MAGIC: u64 = u64::from_be_bytes(*b"GDKISHM1");
/// Where the segments live (tmpfs on Linux).
const DIR: &str = "/dev/shm";
/// The shortest time a side with nothing to read (or no room) spins before it sleeps: a few
/// round trips of the other side, so back-to-back traffic never pays a futex. A connection
/// spins as long as its HCA's engine, where that is longer, while few others do ([`LinkSpin`]).
pub(crate) const MIN_SPIN: Duration = Duration::from_micros(20);

/// How long the waiting threads of an HCA's shared-memory links spin before they sleep on a
/// futex: `long` (the engine's spin) for at most `max_long` of them at a time, [`MIN_SPIN`] for
/// the others, so an HCA with many idle connections does not hold as many cores. A ping-pong
/// needs two at a time (the responder waiting for the next request, the requester's receiver
/// for the next answer).
#[derive(Debug, Clone)]
pub(crate) struct LinkSpin(Arc<SpinShared>);

/// What an HCA's links share of their spin.
#[derive(Debug)]
struct SpinShared {
    long: Duration,
    max_long: u32,
    /// Threads spinning `long` now.
    long_now: AtomicU32,
}

impl LinkSpin {
    /// `long` (at least [`MIN_SPIN`]) for at most `max_long` threads at a time (0: none).
    pub fn new(long: Duration, max_long: u32) -> LinkSpin {
        LinkSpin(Arc::new(SpinShared {
            long: long.max(MIN_SPIN),
            max_long,
            long_now: AtomicU32::new(0),
        }))
    }

    /// [`MIN_SPIN`] for every thread: links that never spin longer.
    #[cfg(test)]
    pub fn short() -> LinkSpin {
        LinkSpin::new(MIN_SPIN, 0)
    }

    /// The longest spin a thread may get.
    #[cfg(test)]
    pub fn long(&self) -> Duration {
        self.0.long
    }

    /// How long the calling thread spins now; a long spin is counted until the turn drops.
    fn turn(&self) -> SpinTurn<'_> {
        let s = &*self.0;
        let long = s.long > MIN_SPIN
            && s.long_now
                .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
                    (n < s.max_long).then_some(n + 1)
                })
                .is_ok();
        SpinTurn { spin: s, long }
    }
}

/// One thread's spin ([`LinkSpin::turn`]).
struct SpinTurn<'a> {
    spin: &'a SpinShared,
    long: bool,
}

impl SpinTurn<'_> {
    fn len(&self) -> Duration {
        if self.long {
            self.spin.long
        } else {
            MIN_SPIN
        }
    }
}

impl Drop for SpinTurn<'_> {
    fn drop(&mut self) {
        if self.long {
            self.spin.long_now.fetch_sub(1, Ordering::Release);
        }
    }
}
/// The producer publishes at least every quarter ring, so the consumer starts on a long
/// message before the producer's flush.
const PUBLISH_EVERY: u64 = RING_BYTES as u64 / 4;

/// One ring's control block, each side's words on their own 128-byte lines (two cache lines:
/// adjacent-line prefetch would otherwise share them).
#[repr(C)]
struct Ctl {
    /// Producer: bytes published.
    tail: AtomicU64,
    /// Producer: set once it will publish no more (after its last publish).
    writer_closed: AtomicU32,
    _w: [u8; 116],
    /// Consumer: bytes consumed.
    head: AtomicU64,
    /// Consumer: set once it will read no more; the producer's writes then fail.
    reader_closed: AtomicU32,
    _r: [u8; 116],
    /// The futex a sleeping consumer waits on, bumped by a publish that finds it waiting.
    data_seq: AtomicU32,
    reader_waiting: AtomicU32,
    _d: [u8; 120],
    /// The futex a producer waiting for room sleeps on.
    space_seq: AtomicU32,
    writer_waiting: AtomicU32,
    _s: [u8; 120],
}

const _: () = assert!(std::mem::size_of::<Ctl>() == 512 && 512 + 2 * 512 <= HEADER);
const _: () = assert!(RING_BYTES.is_power_of_two());

/// Which ring: requests (requester to responder) or responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// Requests and WRITE data, requester to responder.
    Requests = 0,
    /// Responses and READ data, responder to requester.
    Responses = 1,
}

/// Which side of a connection this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// Sends requests, receives responses.
    Requester,
    /// Receives requests, sends responses.
    Responder,
}

/// `side`'s ends of `seg`'s rings, both watching the set-up connection `stream`: the producer
/// of its outgoing ring (whose writes wait at most `timeout` for room) and the consumer of the
/// other, each spinning as `spin` says before it sleeps.
pub(crate) fn ends(
    seg: Arc<Segment>,
    side: Side,
    timeout: Duration,
    spin: LinkSpin,
    stream: &TcpStream,
) -> io::Result<(Tx, Rx)> {
    let watch = Arc::new(Watch::new(stream)?);
    let (out, back) = match side {
        Side::Requester => (Dir::Requests, Dir::Responses),
        Side::Responder => (Dir::Responses, Dir::Requests),
    };
    Ok((
        Tx::new(seg.clone(), out, timeout, spin.clone(), watch.clone()),
        Rx::new(seg, back, spin, watch),
    ))
}

/// A mapped segment.
pub(crate) struct Segment {
    map: memmap2::MmapRaw,
    name: String,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("name", &self.name).finish()
    }
}

fn path(name: &str) -> String {
    format!("{DIR}/{name}")
}

impl Segment {
    /// Creates a segment for a connection of QP `qpn` of HCA `hca`, its pages reserved (so a
    /// full `/dev/shm` fails here, not as a fault on a later write) and its header written.
    /// The name carries the HCA and QP, for whoever looks at `/dev/shm` or a process's maps,
    /// and 128 random bits.
    pub fn create(hca: u64, qpn: u32) -> io::Result<Arc<Segment>> {
        let mut r = [0u8; 16];
        getrandom::fill(&mut r).map_err(|e| io::Error::other(e.to_string()))?;
        let name = format!(
            "{}{hca:016x}-{qpn:06x}-{:032x}",
            gdaki_devx::wire::SHM_PREFIX,
            u128::from_ne_bytes(r)
        );
        let p = path(&name);
        let fd = rustix::fs::open(
            p.as_str(),
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::RUSR | Mode::WUSR,
        )?;
        let made = (|| {
            rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, SEGMENT_BYTES as u64)?;
            let seg = Segment::map(File::from(fd), name.clone())?;
            // SAFETY: the header lies inside the mapping, which nothing else has yet.
            unsafe {
                seg.word(8).store(RING_BYTES as u64, Ordering::Relaxed);
                seg.word(0).store(MAGIC, Ordering::Release);
            }
            Ok(Arc::new(seg))
        })();
        if made.is_err() {
            let _ = rustix::fs::unlink(p.as_str());
        }
        made
    }

    /// Opens and maps the segment a requester offered, if it is one: a regular file of this
    /// user, of exactly [`SEGMENT_BYTES`], holding the magic and this build's ring size. Its
    /// name is unlinked at once (nobody else opens it after this).
    pub fn open(name: &str) -> io::Result<Arc<Segment>> {
        let refuse = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        let p = path(name);
        // NONBLOCK: a FIFO put where a segment is expected must not block the responder.
        let fd = rustix::fs::open(
            p.as_str(),
            OFlags::RDWR | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let st = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(refuse(format!("{p} is not a regular file")));
        }
        if st.st_uid != rustix::process::geteuid().as_raw() {
            return Err(refuse(format!("{p} belongs to another user")));
        }
        if st.st_size != SEGMENT_BYTES as i64 {
            return Err(refuse(format!("{p} has {} bytes, not {SEGMENT_BYTES}", st.st_size)));
        }
        let seg = Segment::map(File::from(fd), name.to_owned())?;
        seg.unlink();
        // SAFETY: the header lies inside the mapping.
        let (magic, ring) = unsafe { (seg.word(0).load(Ordering::Acquire), seg.word(8).load(Ordering::Relaxed)) };
        if magic != MAGIC || ring != RING_BYTES as u64 {
            return Err(refuse(format!(
                "{p} is not a segment of this build (magic {magic:#x}, ring {ring})"
            )));
        }
        Ok(Arc::new(seg))
    }

    fn map(file: File, name: String) -> io::Result<Segment> {
        let map = memmap2::MmapOptions::new().len(SEGMENT_BYTES).map_raw(&file)?;
        // The mapping outlives the descriptor: no file stays open per connection.
        Ok(Segment { map, name })
    }

    /// The segment's name (what an offer carries).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Removes the name (the mapping stays). Either side may; the second finds it gone.
    pub fn unlink(&self) {
        let _ = rustix::fs::unlink(path(&self.name).as_str());
    }

    /// # Safety
    /// `off` is 8-byte aligned and below [`HEADER`].
    unsafe fn word(&self, off: usize) -> &AtomicU64 {
        // SAFETY: inside the live mapping and aligned (caller); shared memory is accessed only
        // through atomics here.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(off).cast()) }
    }

    fn ctl(&self, dir: Dir) -> &Ctl {
        // SAFETY: the control blocks lie inside the header of the live mapping, which is
        // page-aligned; `Ctl` is atomics and padding, valid for any bytes.
        unsafe { &*self.map.as_mut_ptr().add(512 + 512 * dir as usize).cast::<Ctl>() }
    }

    fn data(&self, dir: Dir) -> *mut u8 {
        // SAFETY: the ring lies inside the mapping.
        unsafe { self.map.as_mut_ptr().add(HEADER + RING_BYTES * dir as usize) }
    }
}

/// How a side learns that the other process is gone: the idle TCP connection of the set-up,
/// non-blocking, peeked at.
#[derive(Debug)]
pub(crate) struct Watch(TcpStream);

impl Watch {
    /// Watches `s` (switched to non-blocking: nothing reads it any more).
    pub fn new(s: &TcpStream) -> io::Result<Watch> {
        let s = s.try_clone()?;
        s.set_nonblocking(true)?;
        Ok(Watch(s))
    }

    /// Whether the peer closed the connection or broke it (bytes on it break the protocol:
    /// nothing is sent over TCP once the rings carry the connection).
    fn gone(&self) -> bool {
        match self.0.peek(&mut [0u8; 1]) {
            Ok(_) => true,
            Err(e) => !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted),
        }
    }

    /// Closes the connection both ways (the peer's watch then sees it at once).
    pub fn shutdown(&self) {
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

fn corrupt(what: &str, v: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("the peer corrupted the shared ring ({what} {v})"),
    )
}

fn wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let t = futex::Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    // Shared (not private) futex: the waker is another process. An error (EAGAIN: the word
    // moved, EINTR) is a wake-up; the caller re-checks.
    let _ = futex::wait(word, futex::Flags::empty(), seen, Some(&t));
}

fn wake(seq: &AtomicU32) {
    seq.fetch_add(1, Ordering::Release);
    let _ = futex::wake(seq, futex::Flags::empty(), 1);
}

/// Spins until `ready` or this thread's turn of `spin` passed; whether it became ready.
fn spin(spin: &LinkSpin, mut ready: impl FnMut() -> bool) -> bool {
    let turn = spin.turn();
    let until = Instant::now() + turn.len();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() > until {
            return ready();
        }
    }
}

/// The producing end of one ring.
pub(crate) struct Tx {
    seg: Arc<Segment>,
    dir: Dir,
    /// Bytes written (published or not).
    tail: u64,
    /// Bytes published.
    published: u64,
    /// How long a write waits for room (the QP's retry timeout, as TCP's write timeout).
    timeout: Duration,
    /// How long it spins for room before it sleeps.
    spin: LinkSpin,
    watch: Arc<Watch>,
}

impl Tx {
    /// The producer of `seg`'s ring `dir`.
    fn new(seg: Arc<Segment>, dir: Dir, timeout: Duration, spin: LinkSpin, watch: Arc<Watch>) -> Tx {
        Tx {
            seg,
            dir,
            tail: 0,
            published: 0,
            timeout,
            spin,
            watch,
        }
    }

    fn publish(&mut self) {
        if self.tail == self.published {
            return;
        }
        let ctl = self.seg.ctl(self.dir);
        ctl.tail.store(self.tail, Ordering::Release);
        self.published = self.tail;
        // Store the tail, then look for a sleeper; the consumer sets its flag, then looks at
        // the tail: one of the two sees the other.
        fence(Ordering::SeqCst);
        if ctl.reader_waiting.load(Ordering::Relaxed) != 0 {
            wake(&ctl.data_seq);
        }
    }

    /// Waits until the consumer's head moves from `seen`, the consumer closes, the peer dies
    /// or the timeout passes.
    fn wait_room(&self, seen: u64) -> io::Result<()> {
        let ctl = self.seg.ctl(self.dir);
        let moved = || ctl.head.load(Ordering::Acquire) != seen || ctl.reader_closed.load(Ordering::Acquire) != 0;
        if spin(&self.spin, moved) {
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let seq = ctl.space_seq.load(Ordering::Acquire);
            ctl.writer_waiting.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if !moved() {
                wait(&ctl.space_seq, seq, POLL.min(self.timeout));
            }
            ctl.writer_waiting.store(0, Ordering::Relaxed);
            if moved() {
                return Ok(());
            }
            if self.watch.gone() {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer took nothing from the shared ring within the retry timeout",
                ));
            }
        }
    }
}

impl io::Write for Tx {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            let ctl = self.seg.ctl(self.dir);
            if ctl.reader_closed.load(Ordering::Acquire) != 0 {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            let head = ctl.head.load(Ordering::Acquire);
            let used = self.tail.wrapping_sub(head);
            if used > RING_BYTES as u64 {
                return Err(corrupt("head", head));
            }
            let free = RING_BYTES - used as usize;
            if free == 0 {
                self.publish();
                self.wait_room(head)?;
                continue;
            }
            let n = free.min(buf.len());
            let at = (self.tail % RING_BYTES as u64) as usize;
            let first = n.min(RING_BYTES - at);
            let data = self.seg.data(self.dir);
            // SAFETY: `at + first` and `n - first` stay inside the ring, whose bytes from the
            // tail on are the producer's until it publishes them (the consumer reads only
            // below the tail). Plain copies, as a NIC's DMA into memory others may read.
            unsafe {
                std::ptr::copy_nonoverlapping(buf.as_ptr(), data.add(at), first);
                std::ptr::copy_nonoverlapping(buf.as_ptr().add(first), data, n - first);
            }
            self.tail += n as u64;
            if self.tail - self.published >= PUBLISH_EVERY {
                self.publish();
            }
            return Ok(n);
        }
    }

    /// Publishes what was written (the end of a doorbell batch, or of an answer).
    fn flush(&mut self) -> io::Result<()> {
        self.publish();
        Ok(())
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        self.publish();
        let ctl = self.seg.ctl(self.dir);
        ctl.writer_closed.store(1, Ordering::Release);
        wake(&ctl.data_seq);
    }
}

/// Closes a ring's consuming end from another thread: its reader sees the end of the stream
/// at once, its producer's writes fail.
#[derive(Debug, Clone)]
pub(crate) struct Closer {
    seg: Arc<Segment>,
    dir: Dir,
}

impl Closer {
    /// Closes the consuming end.
    pub fn close(&self) {
        let ctl = self.seg.ctl(self.dir);
        ctl.reader_closed.store(1, Ordering::Release);
        wake(&ctl.data_seq);
        wake(&ctl.space_seq);
    }
}

/// The consuming end of one ring.
#[derive(Debug)]
pub(crate) struct Rx {
    seg: Arc<Segment>,
    dir: Dir,
    head: u64,
    /// How long it spins for bytes before it sleeps.
    spin: LinkSpin,
    watch: Arc<Watch>,
}

impl Rx {
    /// The consumer of `seg`'s ring `dir`.
    fn new(seg: Arc<Segment>, dir: Dir, spin: LinkSpin, watch: Arc<Watch>) -> Rx {
        Rx {
            seg,
            dir,
            head: 0,
            spin,
            watch,
        }
    }

    /// A handle that closes this end from another thread.
    pub fn closer(&self) -> Closer {
        Closer {
            seg: self.seg.clone(),
            dir: self.dir,
        }
    }

    /// The watched TCP connection.
    pub fn watch(&self) -> &Watch {
        &self.watch
    }

    fn available(&self) -> io::Result<usize> {
        let tail = self.seg.ctl(self.dir).tail.load(Ordering::Acquire);
        match tail.wrapping_sub(self.head) {
            a if a <= RING_BYTES as u64 => Ok(a as usize),
            _ => Err(corrupt("tail", tail)),
        }
    }

    /// Reads what is there, waiting at most about a poll interval for something: `Ok(0)` at
    /// the end of the stream (the producer closed, the peer is gone, this end was closed),
    /// a `TimedOut` error when nothing came (as a socket read with a timeout).
    pub fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        if dst.is_empty() {
            return Ok(0);
        }
        self.read_with(dst.len(), |piece| dst[..piece.len()].copy_from_slice(piece))
    }

    /// As [`read`](Self::read), but hands `f` the next bytes where they lie in the ring (one
    /// contiguous piece of at most `max` bytes) instead of copying them out, then consumes
    /// them: a payload goes from the ring to its destination in one copy.
    pub fn read_with(&mut self, max: usize, f: impl FnOnce(&[u8])) -> io::Result<usize> {
        let avail = self.wait()?;
        let at = (self.head % RING_BYTES as u64) as usize;
        let n = avail.min(max).min(RING_BYTES - at);
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: `at..at + n` lies inside the ring, below the tail the producer published
        // (release) and this side loaded (acquire): the producer does not write there until
        // the head passes it. A peer that breaks that rule only changes bytes that are parsed
        // as untrusted anyway (as a NIC's DMA may change memory under a reader).
        f(unsafe { std::slice::from_raw_parts(self.seg.data(self.dir).add(at), n) });
        self.head += n as u64;
        let ctl = self.seg.ctl(self.dir);
        ctl.head.store(self.head, Ordering::Release);
        fence(Ordering::SeqCst);
        if ctl.writer_waiting.load(Ordering::Relaxed) != 0 {
            wake(&ctl.space_seq);
        }
        Ok(n)
    }

    /// Waits at most about a poll interval for bytes: how many there are, 0 at the end of the
    /// stream, a `TimedOut` error when none came.
    fn wait(&mut self) -> io::Result<usize> {
        let ctl = self.seg.ctl(self.dir);
        let ended = || ctl.reader_closed.load(Ordering::Acquire) != 0 || ctl.writer_closed.load(Ordering::Acquire) != 0;
        let mut slept = false;
        loop {
            let avail = self.available()?;
            if avail > 0 {
                return Ok(avail);
            }
            if ctl.reader_closed.load(Ordering::Acquire) != 0 {
                return Ok(0);
            }
            if ctl.writer_closed.load(Ordering::Acquire) != 0 {
                // Closed after its last publish: what the tail says now is all there is.
                return self.available();
            }
            if slept {
                if self.watch.gone() {
                    // Whatever was published before the peer went is still delivered.
                    return self.available();
                }
                return Err(io::ErrorKind::TimedOut.into());
            }
            if spin(&self.spin, || ended() || matches!(self.available(), Ok(1..) | Err(_))) {
                continue;
            }
            let seq = ctl.data_seq.load(Ordering::Acquire);
            ctl.reader_waiting.store(1, Ordering::Relaxed);
            // Flag, then look at the tail (see `Tx::publish`).
            fence(Ordering::SeqCst);
            if self.available()? == 0 && !ended() {
                wait(&ctl.data_seq, seq, POLL);
            }
            ctl.reader_waiting.store(0, Ordering::Relaxed);
            slept = true;
        }
    }
}

impl Drop for Rx {
    fn drop(&mut self) {
        self.closer().close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    /// Two ends of a ring in one process, over a real segment and a real TCP connection.
    fn pair(timeout: Duration) -> (Tx, Rx, TcpStream, Arc<Segment>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let seg = Segment::create(1, 2).unwrap();
        let other = Segment::open(seg.name()).unwrap();
        let tx = Tx::new(
            seg.clone(),
            Dir::Requests,
            timeout,
            LinkSpin::short(),
            Arc::new(Watch::new(&a).unwrap()),
        );
        let rx = Rx::new(
            other,
            Dir::Requests,
            LinkSpin::short(),
            Arc::new(Watch::new(&b).unwrap()),
        );
        (tx, rx, a, seg)
    }

    /// At most `max_long` threads spin long at a time, the others the minimum; a turn that ends
    /// hands its place back. A spin no longer than the minimum takes no place.
    #[test]
    fn only_a_few_threads_at_a_time_spin_long() {
        let s = LinkSpin::new(Duration::from_micros(200), 2);
        let (a, b, c) = (s.turn(), s.turn(), s.turn());
        let long = Duration::from_micros(200);
        assert_eq!([a.len(), b.len(), c.len()], [long, long, MIN_SPIN]);
        drop(a);
        let d = s.turn();
        assert_eq!(d.len(), long);
        drop((b, c, d));
        assert_eq!(s.0.long_now.load(Ordering::Relaxed), 0);
        let short = LinkSpin::short();
        let turn = short.turn();
        assert_eq!(turn.len(), MIN_SPIN);
        assert_eq!(short.0.long_now.load(Ordering::Relaxed), 0);
        // A shorter spin than the minimum is raised to it; no long spinners, no long spin.
        assert_eq!(LinkSpin::new(Duration::ZERO, 4).long(), MIN_SPIN);
        let none = LinkSpin::new(Duration::from_micros(200), 0);
        assert_eq!(none.turn().len(), MIN_SPIN);
    }

    fn read_exact(rx: &mut Rx, n: usize) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; n];
        let mut got = 0;
        while got < n {
            match rx.read(&mut out[got..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(k) => got += k,
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    #[test]
    fn bytes_cross_in_order_through_wraps_and_a_full_ring() {
        let (mut tx, mut rx, _tcp, _seg) = pair(Duration::from_secs(10));
        // 5 ring sizes in odd pieces: the ring wraps and fills, the writer waits for room.
        let data: Vec<u8> = (0..5 * RING_BYTES + 77).map(|i| (i * 7 + i / 4099) as u8).collect();
        let reader = std::thread::spawn(move || read_exact(&mut rx, 5 * RING_BYTES + 77).map(|v| (v, rx)));
        for piece in data.chunks(12_345) {
            tx.write_all(piece).unwrap();
            tx.flush().unwrap();
        }
        let (got, mut rx) = reader.join().unwrap().unwrap();
        assert!(got == data, "the bytes arrived changed or out of order");
        // The producer closes: the consumer sees the end of the stream, not a timeout.
        drop(tx);
        assert_eq!(rx.read(&mut [0u8; 8]).unwrap(), 0);
    }

    #[test]
    fn a_dead_peer_ends_the_stream_and_a_full_ring_times_out() {
        let (mut tx, mut rx, tcp, _seg) = pair(Duration::from_millis(300));
        tx.write_all(b"last words").unwrap();
        tx.flush().unwrap();
        // The producer's process "dies": its TCP end closes, its closed flag is never set.
        std::mem::forget(tx);
        tcp.shutdown(std::net::Shutdown::Both).unwrap();
        assert_eq!(
            read_exact(&mut rx, 10).unwrap(),
            b"last words",
            "published bytes still arrive"
        );
        let started = Instant::now();
        let end = loop {
            match rx.read(&mut [0u8; 8]) {
                Err(e) if e.kind() == io::ErrorKind::TimedOut => continue,
                other => break other,
            }
        };
        assert_eq!(end.unwrap(), 0);
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());

        // A consumer that stops reading (alive, silent): the producer's write times out.
        let (mut tx, _rx, _tcp, _seg) = pair(Duration::from_millis(300));
        let started = Instant::now();
        let err = tx.write_all(&vec![0u8; RING_BYTES + 1]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_corrupt_position_breaks_the_stream() {
        let (mut tx, mut rx, _tcp, seg) = pair(Duration::from_secs(1));
        seg.ctl(Dir::Requests)
            .tail
            .store(RING_BYTES as u64 + 1, Ordering::Release);
        assert_eq!(rx.read(&mut [0u8; 8]).unwrap_err().kind(), io::ErrorKind::InvalidData);
        seg.ctl(Dir::Requests).tail.store(0, Ordering::Release);
        seg.ctl(Dir::Requests).head.store(5, Ordering::Release);
        assert_eq!(tx.write(b"x").unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn only_a_segment_of_this_user_and_size_is_opened() {
        let seg = Segment::create(3, 4).unwrap();
        assert!(Segment::open(seg.name()).is_ok());
        // Opening unlinked it: a second open finds nothing.
        assert_eq!(Segment::open(seg.name()).unwrap_err().kind(), io::ErrorKind::NotFound);
        // A file of another size under a segment's name.
        let name = format!("gdaki-test-{:x}", gdaki_devx::util::random_u32());
        std::fs::write(path(&name), b"not a segment").unwrap();
        let e = Segment::open(&name).unwrap_err();
        let _ = std::fs::remove_file(path(&name));
        assert!(e.to_string().contains("bytes, not"), "{e}");
    }
}
