//! The perftest loops, written once: `put_bw`'s stream of puts and `write_lat`'s ping-pong.
//! The GPU kernels (`kernels`, built for nvptx64 only) and CPU mode (`gdaki-examples`) run this very code, so
//! a figure measured in one mode is the other's reference.
use gdaki_layout::perf::{PingPongSide, StreamOp};

use crate::arch;
use crate::qp::{Local, Qp, Remote, MAX_INLINE, MAX_SEND_INLINE};
use crate::rq::{RecvBuf, Rq};
use crate::scope::{Scope, Thread};
use crate::sharing::Sharing;
use crate::status::PostError;

/// The 16-byte stores per record of the posting rate's store loops (the `gdaki_store_loop*`
/// kernels): what the benchmarked post, an 8-byte put, writes into its 64-byte slot (control,
/// remote address and data segments: 48 bytes), so records per second and WQEs per second
/// compare like with like.
pub const STORE_LOOP_SEGMENTS: usize = 3;

/// Member `t` of `threads` posters sharing `qp` puts `iters` messages of `len` bytes: message
/// `m = t + k * threads` goes from slot `m % slots` of `src` to the same slot of `dst` (slots
/// are `len` bytes apart), so every slot is written once there are at least `slots` messages.
/// With [`StreamOp::Read`] each message is an RDMA READ the other way: from the slot of `dst`
/// into the same slot of `src` (`put_bw --read`, perftest's `ib_read_bw`); with
/// [`StreamOp::Send`] a SEND from the slot of `src` that the peer's next receive takes (`dst`
/// unused; `put_bw --send`, `ib_send_bw`; the peer runs [`recv_stream`]). Then it waits for its
/// last message (in group scope, the group's).
#[allow(clippy::too_many_arguments)] // the perftest's parameters, each a scalar
#[inline(always)]
pub fn put_stream<M: Sharing, S: Scope>(
    qp: Qp<M, S>,
    dst: Remote,
    src: Local,
    len: u64,
    slots: u64,
    t: u64,
    threads: u64,
    iters: u32,
    op: StreamOp,
) -> Result<(), PostError> {
    let slots = slots.max(1);
    let mut last = None;
    let mut m = t;
    for _ in 0..iters {
        let off = (m % slots) * len;
        let (remote, local) = (dst.offset(off), src.offset(off));
        last = Some(match op {
            StreamOp::Write => qp.put(remote, local, len)?,
            StreamOp::Read => qp.get(local, remote, len)?,
            StreamOp::Send => qp.send(local, len)?,
        });
        m += threads;
    }
    if let Some(ticket) = last {
        qp.wait(ticket)?;
    }
    Ok(())
}

/// The receiving side of a two-sided [`put_stream`], the receive queue's only poster: takes
/// `count` messages on `rq`, receive `k` into slot `k % slots` of `buf` (slots `len` bytes
/// apart, each receive offering `len` bytes), keeping up to `ahead` receives posted (at least
/// one, at most the queue's size) and never more than `count` in all, so none is left behind
/// for a later stream. Returns the bytes the messages carried: `count * len` when every one
/// was a `len`-byte message.
///
/// Receives go up in batches (a quarter of `ahead`, at most 64: one fence and one record
/// update each). Completions are read as they come; when none is there, the receiver watches
/// the batch's last one first.
#[inline(always)]
pub fn recv_stream<M: Sharing>(
    rq: Rq<M>,
    buf: Local,
    len: u32,
    slots: u64,
    count: u64,
    ahead: u64,
) -> Result<u64, PostError> {
    let slots = slots.max(1);
    let ahead = ahead.clamp(1, rq.size());
    let batch = (ahead / 4).clamp(1, 64);
    let (mut posted, mut taken, mut bytes) = (0u64, 0u64, 0u64);
    // This poster's receives are consecutive tickets from its first one on.
    let mut first = 0;
    while taken < count {
        let room = (ahead - (posted - taken)).min(count - posted);
        if room > 0 && (room >= batch || posted + room == count) {
            let from = posted;
            let ticket = rq.post_recvs(room as u32, |i| RecvBuf {
                local: buf.offset(((from + i as u64) % slots) * len as u64),
                len,
            })?;
            if posted == 0 {
                first = ticket;
            }
            posted += room;
        }
        // Something is posted and not taken here: room was below `ahead`, or was just posted.
        let index = first + taken;
        let got = match rq.try_poll(index) {
            Some(r) => r?,
            None => {
                // Watch a later completion, not this one: the HCA then writes the ones before
                // it onto lines no poller is reading (a line being read costs its writer a
                // trip to the reader's core). A bounded watch; then the usual bounded wait.
                let later = first + (taken + batch).min(posted) - 1;
                let mut spins = 0u32;
                while later > index && spins < WATCH_SPINS && !rq.arrived(later) {
                    spins += 1;
                    core::hint::spin_loop();
                }
                rq.poll(index)?
            }
        };
        bytes += got.bytes as u64;
        taken += 1;
    }
    Ok(bytes)
}

/// Looks at a later completion [`recv_stream`] watches before it waits for the next one.
const WATCH_SPINS: u32 = 1 << 20;

/// Member posts `iters` 8-byte puts from `src` to `dst` and waits for none: the device posting
/// rate, measured on a ring no HCA consumes (it must hold every WQE posted, or the reservation
/// waits for completions that never come and times out). With `commit_every` above 1 the
/// puts are [deferred](Qp::deferred) and committed every `commit_every` puts and at the end:
/// one doorbell for that many posts.
#[inline(always)]
pub fn post_only<M: Sharing, S: Scope>(
    qp: Qp<M, S>,
    dst: Remote,
    src: Local,
    iters: u32,
    commit_every: u32,
) -> Result<(), PostError> {
    if commit_every <= 1 {
        for _ in 0..iters {
            qp.put(dst, src, 8)?;
        }
        return Ok(());
    }
    let deferred = qp.deferred();
    let mut since = 0;
    for i in 0..iters {
        deferred.put(dst, src, 8)?;
        since += 1;
        if since == commit_every || i + 1 == iters {
            deferred.commit()?;
            since = 0;
        }
    }
    Ok(())
}

/// One side of `write_lat`'s ping-pong over `iters` round trips of `size`-byte RDMA WRITEs. The
/// last byte of each message is its flag, `(i + 1) as u8` in round `i`: the initiator writes
/// the flag into its post buffer, puts the message into the peer's poll buffer and waits for
/// the peer's message with the same flag in its own; the other side waits first, then answers.
/// Timestamps (ns) are taken just before each send (`times`) and once its put has returned
/// (`posted`). Ends with a quiet.
///
/// A message is only rewritten after the peer's answer arrived, which the peer sent after
/// receiving it, so the HCA never reads a post buffer being changed.
///
/// A message of at most `side.inline_max` bytes (and at most what one WQE carries inline:
/// [`MAX_INLINE`] for a WRITE, [`MAX_SEND_INLINE`]
/// for a SEND) travels inline (perftest's latency tests do so by default): the post buffer's
/// bytes are read once, before the first round, and each round only its flag changes, in the
/// WQE and in the post buffer alike.
///
/// With `side.rq` set (`write_lat --send`, perftest's `ib_send_lat`) the messages are SENDs and
/// each side waits for the completion of its next receive instead of a flag, without consuming
/// it. It keeps [`RECEIVES_AHEAD`] receives into its poll buffer posted, and consumes and
/// reposts the one a message took right after its own next send, off the round trip's path:
/// the peer's next message comes after that send and finds the other one.
///
/// # Safety
/// `qp` is `side.qp`; `side.post` and `side.poll` are valid for `size` bytes (reads and writes
/// by this device), and `side.poll` for `side.recv_len` bytes in two-sided mode, whose `side.rq`
/// is the QP's exported receive queue used by this side alone; `side.times` and `side.posted`
/// are each 0 or valid for `iters` u64 writes; both poll buffers start with a flag byte that is
/// not 1 (zeroed).
#[inline(always)]
pub unsafe fn ping_pong<M: Sharing>(
    qp: Qp<M, Thread>,
    side: &PingPongSide,
    size: u64,
    iters: u32,
) -> Result<(), PostError> {
    let size = size.max(1);
    let qp = if side.flags & gdaki_layout::perf::PING_PONG_BLUEFLAME != 0 {
        qp.blueflame()
    } else {
        qp
    };
    let post_flag = (side.post + size - 1) as *mut u8;
    let poll_flag = (side.poll + size - 1) as *const u8;
    let dst = Remote {
        addr: side.remote,
        rkey: side.rkey,
    };
    let src = Local {
        addr: side.post,
        lkey: side.lkey,
    };
    let times = side.times as *mut u64;
    let posted = side.posted as *mut u64;
    // SAFETY: the side's own exported receive queue (caller's contract).
    let rq = (side.rq != 0).then(|| unsafe { Rq::<M>::from_raw(side.rq as *mut gdaki_layout::DevRq) });
    let poll = Local {
        addr: side.poll,
        lkey: side.poll_lkey,
    };
    let recv_len = side.recv_len.max(size).min(u32::MAX as u64) as u32;
    // Inline messages: the post buffer's bytes, read once (from host memory a read costs a PCIe
    // round trip; one per round would be on the round trip's path).
    let inline_cap = if rq.is_some() { MAX_SEND_INLINE } else { MAX_INLINE };
    let inline = size <= side.inline_max as u64 && size as usize <= inline_cap;
    let mut carried = [0u8; MAX_SEND_INLINE];
    if inline {
        // SAFETY: the post buffer holds `size` bytes (caller's contract), at most `carried`'s.
        unsafe { core::ptr::copy_nonoverlapping(side.post as *const u8, carried.as_mut_ptr(), size as usize) };
    }
    // The next message: its flag in the poll buffer, or the completion of the next receive, left
    // unconsumed: consuming it stores the CQ's doorbell record, which would then sit before the
    // answer's doorbell fence, on the round trip's path. `retire` consumes it after the answer.
    let arrived = |flag: u8| -> Result<(), PostError> {
        match rq {
            // SAFETY: the poll buffer is valid (caller's contract).
            None => unsafe { qp.wait_until_u8(poll_flag, flag) }?,
            Some(rq) => rq.wait_arrived(rq.next_to_complete())?,
        }
        Ok(())
    };
    // Consumes the receive `arrived` saw: its completion is written, so the wait's first look
    // (one more load of the CQE's tail, off the round trip's path) finds it.
    let retire = || -> Result<(), PostError> {
        if let Some(rq) = rq {
            rq.wait(rq.next_to_complete())?;
        }
        Ok(())
    };
    // Receives back up to RECEIVES_AHEAD outstanding.
    let top_up = || -> Result<(), PostError> {
        if let Some(rq) = rq {
            while rq.outstanding() < RECEIVES_AHEAD {
                rq.post_recv_one(poll, recv_len)?;
            }
        }
        Ok(())
    };
    top_up()?;
    for i in 0..iters {
        let flag = (i as u8).wrapping_add(1);
        if side.initiator == 0 {
            arrived(flag)?;
        }
        if !times.is_null() {
            // SAFETY: `times` holds `iters` entries (caller's contract).
            unsafe { times.add(i as usize).write_volatile(arch::global_timer_ns()) };
        }
        // SAFETY: the post buffer is valid; the put's barrier makes the byte visible to the
        // HCA before its doorbell.
        unsafe { post_flag.write_volatile(flag) };
        if inline {
            carried[size as usize - 1] = flag;
            let data = &carried[..size as usize];
            if rq.is_some() {
                qp.send_inline(data)?;
            } else {
                qp.put_inline(dst, data)?;
            }
        } else if rq.is_some() {
            qp.send(src, size)?;
        } else {
            qp.put(dst, src, size)?;
        }
        if !posted.is_null() {
            // SAFETY: `posted` holds `iters` entries (caller's contract).
            unsafe { posted.add(i as usize).write_volatile(arch::global_timer_ns()) };
        }
        // Off the round trip's path: the message is out. The receive the responder answered,
        // or the one the initiator's previous round took, is retired before the top-up (whose
        // slot it may free).
        if side.initiator == 0 || i > 0 {
            retire()?;
        }
        top_up()?;
        if side.initiator != 0 {
            arrived(flag)?;
        }
    }
    if side.initiator != 0 && iters > 0 {
        retire()?;
    }
    top_up()?;
    qp.quiet()?;
    Ok(())
}

/// Receives a two-sided ping-pong side keeps posted ahead of the peer's messages.
pub const RECEIVES_AHEAD: u64 = 2;
