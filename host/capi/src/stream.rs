//! Stream-triggered posting (GPUDirect Async, docs/stream.md): executors of memory operations
//! (a CUDA stream of the caller's, or a CPU stream), stream queue pairs that write WQEs now and
//! let the executor ring them later, waits on completions and on flags, and recorded replays
//! (CUDA graphs).
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gdaki::cuda::StreamWait;
use gdaki::stream::{CpuStream, CudaStreamOps, MemOps, Replay, Store, StreamError, StreamQp, WorkRequest};
use gdaki::{GpuQp, QueuePair};
use gdaki_device::{Local, Remote};

use crate::context::gdaki_gpu;
use crate::guard::{self, call, gdaki_status, handle, Failure};
use crate::queue::{gdaki_gpu_qp, gdaki_qp};

/// An RDMA WRITE from `local_addr`/`lkey` to `remote_addr`/`rkey`.
pub const GDAKI_WR_PUT: u32 = 0;
/// An RDMA WRITE of `len` bytes at `inline_data`, carried in the WQE (at most
/// `GDAKI_MAX_INLINE`).
pub const GDAKI_WR_PUT_INLINE: u32 = 1;
/// An RDMA READ from `remote_addr`/`rkey` into `local_addr`/`lkey`.
pub const GDAKI_WR_GET: u32 = 2;
/// A SEND from `local_addr`/`lkey` into the peer's next receive.
pub const GDAKI_WR_SEND: u32 = 3;
/// A SEND with `imm` as immediate data.
pub const GDAKI_WR_SEND_IMM: u32 = 4;
/// A SEND of `len` bytes at `inline_data`, carried in the WQE.
pub const GDAKI_WR_SEND_INLINE: u32 = 5;
/// An RDMA WRITE with immediate: consumes a receive of the peer, which gets `imm`.
pub const GDAKI_WR_WRITE_IMM: u32 = 6;

/// `gdaki_stream_wait_value32`: until `(int32_t)(*addr - value) >= 0`.
pub const GDAKI_WAIT_GEQ: u32 = 0;
/// Until `*addr == value`.
pub const GDAKI_WAIT_EQ: u32 = 1;
/// Until `(*addr & value) != 0`.
pub const GDAKI_WAIT_AND: u32 = 2;
/// Until `~(*addr | value) != 0`.
pub const GDAKI_WAIT_NOR: u32 = 3;

/// One work request for `gdaki_stream_qp_post` (libgdsync's descriptors): which fields an
/// opcode reads is said at each `GDAKI_WR_*`; the others are ignored.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gdaki_work_request {
    /// A `GDAKI_WR_*` opcode.
    pub opcode: u32,
    /// Bytes: of the local buffer, or at `inline_data` for the inline opcodes.
    pub len: u32,
    /// The local buffer (a registered region's address).
    pub local_addr: u64,
    /// Its region's `lkey`.
    pub lkey: u32,
    /// Immediate data (`GDAKI_WR_SEND_IMM`, `GDAKI_WR_WRITE_IMM`).
    pub imm: u32,
    /// The remote buffer.
    pub remote_addr: u64,
    /// Its region's `rkey`.
    pub rkey: u32,
    /// Zero.
    pub reserved: u32,
    /// The bytes of the inline opcodes, copied into the WQE when posted.
    pub inline_data: *const c_void,
}

/// What a stream handle runs its memory operations on.
pub(crate) enum Executor {
    Cuda(CudaStreamOps),
    Cpu(CpuStream),
}

impl Executor {
    fn ops(&mut self) -> &mut dyn MemOps {
        match self {
            Executor::Cuda(c) => c,
            Executor::Cpu(c) => c,
        }
    }
}

/// An in-order executor of memory operations: a CUDA stream of the caller's
/// (`gdaki_stream_cuda`) or a CPU thread (`gdaki_stream_cpu`: the same rules without a GPU).
pub struct gdaki_stream(guard::Tagged<Mutex<Executor>>);
handle!(gdaki_stream(Mutex<Executor>), b"gdakiSTM", "stream");

/// A stream queue pair and what it borrows, kept alive.
pub(crate) struct Posting {
    // Declared first: dropped before the queue pair and the export it borrows.
    sq: StreamQp<'static>,
    _gpu: Option<Arc<GpuQp>>,
    _qp: Arc<QueuePair>,
}

/// A queue pair posted to through streams: its only poster while it lives.
pub struct gdaki_stream_qp(guard::Tagged<Mutex<Posting>>);
handle!(gdaki_stream_qp(Mutex<Posting>), b"gdakiSQP", "stream_qp");

/// A recording of posts and waits (and, on a CUDA stream, the kernels and copies captured with
/// them) launched many times.
pub struct gdaki_replay(guard::Tagged<Mutex<Replay>>);
handle!(gdaki_replay(Mutex<Replay>), b"gdakiRPL", "replay");

impl From<StreamError> for Failure {
    fn from(e: StreamError) -> Failure {
        let status = match &e {
            StreamError::WindowFull { .. } => gdaki_status::Again,
            StreamError::NotQueued { .. } | StreamError::BadRequest { .. } | StreamError::WrongSpace { .. } => {
                gdaki_status::InvalidArgument
            }
            StreamError::Post(_) => gdaki_status::InvalidArgument,
            StreamError::Completion(_) => gdaki_status::QueueError,
            StreamError::WaitTimedOut { .. } => gdaki_status::Timeout,
            StreamError::Recording(_) => gdaki_status::InvalidState,
            _ => gdaki_status::Cuda,
        };
        Failure::new(status, e.to_string())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    guard::lock(m)
}

/// A CUDA stream of `gpu` (a `CUstream`, or a `cudaStream_t` of the runtime API, in the GPU's
/// primary context) as an executor into `*stream`. The stream stays the caller's: it must
/// outlive the handle, which does not destroy it. Refused where the driver lacks the stream
/// memory operations (`GDAKI_STATUS_CUDA`, the attribute named).
///
/// # Safety
/// `gpu` is NULL or a GPU handle; `cu_stream` is a live stream of that GPU's primary context
/// (not the legacy NULL stream) that outlives the handle; `stream` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_cuda(
    gpu: *const gdaki_gpu,
    cu_stream: *mut c_void,
    stream: *mut *mut gdaki_stream,
) -> gdaki_status {
    call("gdaki_stream_cuda", || {
        // SAFETY: the caller's contract.
        let (g, out) = unsafe { (guard::borrow(gpu, "gpu")?, guard::out(stream, "stream")?) };
        if cu_stream.is_null() {
            return Err(Failure::invalid(
                "cu_stream is NULL (the legacy stream waits for every other stream: use a stream of your own)",
            ));
        }
        // SAFETY: the caller's contract: a live stream of this context, outliving the handle.
        let wrapped = unsafe { g.context().wrap_borrowed_stream(cu_stream.cast()) };
        let ops = CudaStreamOps::new(g, wrapped)?;
        out.write(guard::into_handle(Mutex::new(Executor::Cuda(ops))));
        Ok(())
    })
}

/// A CPU thread as an executor into `*stream`, on this process's addresses: a wait that does
/// not end within `timeout_ms` (1 to 3,600,000) fails the stream, which drops its later work
/// and says why at `gdaki_stream_synchronize`.
///
/// # Safety
/// `stream` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_cpu(timeout_ms: u32, stream: *mut *mut gdaki_stream) -> gdaki_status {
    call("gdaki_stream_cpu", || {
        // SAFETY: the caller's contract.
        let out = unsafe { guard::out(stream, "stream") }?;
        if !(1..=3_600_000).contains(&timeout_ms) {
            return Err(Failure::invalid(format!("timeout_ms {timeout_ms}: 1 to 3,600,000")));
        }
        let cpu = CpuStream::new(Duration::from_millis(u64::from(timeout_ms)))
            .map_err(|e| Failure::new(gdaki_status::Io, format!("starting the stream's thread: {e}")))?;
        out.write(guard::into_handle(Mutex::new(Executor::Cpu(cpu))));
        Ok(())
    })
}

/// Waits until the stream has run everything enqueued so far, at most `timeout_ms`
/// (`GDAKI_STATUS_TIMEOUT` then; a CUDA stream waiting on a word nobody writes never ends). A
/// CPU stream that failed returns why (`GDAKI_STATUS_TIMEOUT` for a wait that timed out).
///
/// # Safety
/// `stream` is NULL or a stream handle.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_synchronize(stream: *const gdaki_stream, timeout_ms: u32) -> gdaki_status {
    call("gdaki_stream_synchronize", || {
        // SAFETY: the caller's contract.
        let s = unsafe { guard::borrow(stream, "stream") }?;
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        let idle = match &*lock(s) {
            Executor::Cuda(c) => gdaki::cuda::stream_idle_within(c.stream(), timeout)?,
            Executor::Cpu(c) => c.synchronize_within(timeout)?,
        };
        if !idle {
            return Err(Failure::new(
                gdaki_status::Timeout,
                format!("the stream has not run its work within {timeout_ms} ms"),
            ));
        }
        Ok(())
    })
}

/// Destroys a stream handle (NULL: nothing). A CUDA stream stays the caller's; a CPU stream's
/// thread stops, dropping what it has not run.
///
/// # Safety
/// `stream` is NULL or a stream handle with no call on it in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_destroy(stream: *mut gdaki_stream) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_stream_destroy", || unsafe { guard::destroy(stream, "stream") })
}

/// Enqueues a 32-bit store of `value` at `addr` (libgdsync's `gds_stream_write_value32`): a
/// device address of the stream's GPU for a CUDA stream, a host address for a CPU stream.
///
/// # Safety
/// `stream` is NULL or a stream handle; `addr` is 4-byte aligned and valid for the store
/// when the stream reaches it (and at every launch of a replay recorded with it).
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_write_value32(
    stream: *const gdaki_stream,
    addr: u64,
    value: u32,
) -> gdaki_status {
    call("gdaki_stream_write_value32", || {
        // SAFETY: the caller's contract.
        let s = unsafe { guard::borrow(stream, "stream") }?;
        // SAFETY: the caller's contract.
        unsafe { lock(s).ops().store(&[Store::U32 { addr, value }]) }?;
        Ok(())
    })
}

/// Enqueues a 64-bit store, as `gdaki_stream_write_value32` a 32-bit one.
///
/// # Safety
/// As `gdaki_stream_write_value32`, `addr` 8-byte aligned.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_write_value64(
    stream: *const gdaki_stream,
    addr: u64,
    value: u64,
) -> gdaki_status {
    call("gdaki_stream_write_value64", || {
        // SAFETY: the caller's contract.
        let s = unsafe { guard::borrow(stream, "stream") }?;
        // SAFETY: the caller's contract.
        unsafe { lock(s).ops().store(&[Store::U64 { addr, value }]) }?;
        Ok(())
    })
}

/// Enqueues a wait until the 32-bit word at `addr` satisfies `condition` (a `GDAKI_WAIT_*`)
/// against `value` (libgdsync's `gds_stream_wait_value32`): the stream's later work starts
/// after it. A CUDA stream's wait has no bound.
///
/// # Safety
/// `stream` is NULL or a stream handle; `addr` is 4-byte aligned and readable until the wait
/// is over (at every launch of a replay recorded with it).
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_wait_value32(
    stream: *const gdaki_stream,
    addr: u64,
    value: u32,
    condition: u32,
) -> gdaki_status {
    call("gdaki_stream_wait_value32", || {
        // SAFETY: the caller's contract.
        let s = unsafe { guard::borrow(stream, "stream") }?;
        let how = match condition {
            GDAKI_WAIT_GEQ => StreamWait::Geq,
            GDAKI_WAIT_EQ => StreamWait::Eq,
            GDAKI_WAIT_AND => StreamWait::And,
            GDAKI_WAIT_NOR => StreamWait::Nor,
            other => return Err(Failure::invalid(format!("condition {other} (expected a GDAKI_WAIT_*)"))),
        };
        // SAFETY: the caller's contract.
        unsafe { lock(s).ops().wait(addr, how, value) }?;
        Ok(())
    })
}

/// Makes `qp` postable through streams into `*stream_qp`: through CPU streams with `gpu_qp`
/// NULL, through CUDA streams of the export's GPU with `gpu_qp` (the export of `qp`). The queue
/// pair must be connected, its rings in host memory and its CQ at least as large as its send
/// queue. The handle keeps `qp` and `gpu_qp` alive.
///
/// # Safety
/// `qp` is NULL or a QP handle, `gpu_qp` NULL or an exported-QP handle, `stream_qp` NULL or
/// writable. While the stream queue pair lives it is the queue pair's only poster (no kernel
/// or CPU-mode poster posts to it or polls its CQ), and it is destroyed only after every stream
/// it enqueued to has run that work.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_qp_create(
    qp: *const gdaki_qp,
    gpu_qp: *const gdaki_gpu_qp,
    stream_qp: *mut *mut gdaki_stream_qp,
) -> gdaki_status {
    call("gdaki_stream_qp_create", || {
        // SAFETY: the caller's contract.
        let (q, g, out) = unsafe {
            (
                guard::borrow(qp, "qp")?.clone(),
                guard::borrow_opt(gpu_qp, "gpu_qp")?.cloned(),
                guard::out(stream_qp, "stream_qp")?,
            )
        };
        // SAFETY: both live in the Arcs `Posting` holds, whose heap values never move and are
        // dropped after `sq` (field order); the only-poster and drain rules are the caller's.
        let sq = unsafe {
            let qp_ref: &'static QueuePair = &*Arc::as_ptr(&q);
            let gpu_ref: Option<&'static GpuQp> = g.as_ref().map(|g| &*Arc::as_ptr(g));
            StreamQp::new(qp_ref, gpu_ref)
        }?;
        out.write(guard::into_handle(Mutex::new(Posting { sq, _gpu: g, _qp: q })));
        Ok(())
    })
}

/// Destroys a stream queue pair (NULL: nothing); the queue pair may be posted to otherwise
/// afterwards.
///
/// # Safety
/// `stream_qp` is NULL or a stream-QP handle with no call in flight, not used after, whose
/// streams have run the work it enqueued.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_qp_destroy(stream_qp: *mut gdaki_stream_qp) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_stream_qp_destroy", || unsafe {
        guard::destroy(stream_qp, "stream_qp")
    })
}

/// The Rust request for `wr`.
///
/// # Safety
/// An inline opcode's `inline_data` is NULL or readable for `len` bytes.
unsafe fn request<'a>(wr: &gdaki_work_request, index: usize) -> Result<WorkRequest<'a>, Failure> {
    let local = Local {
        addr: wr.local_addr,
        lkey: wr.lkey,
    };
    let remote = Remote {
        addr: wr.remote_addr,
        rkey: wr.rkey,
    };
    if wr.reserved != 0 {
        return Err(Failure::invalid(format!(
            "wrs[{index}].reserved is {}, not 0",
            wr.reserved
        )));
    }
    let len = wr.len;
    // SAFETY: the caller's contract.
    let bytes = || unsafe { guard::slice(wr.inline_data.cast::<u8>(), len as usize, "inline_data") };
    Ok(match wr.opcode {
        GDAKI_WR_PUT => WorkRequest::Put {
            dst: remote,
            src: local,
            len,
        },
        GDAKI_WR_PUT_INLINE => WorkRequest::PutInline {
            dst: remote,
            data: bytes()?,
        },
        GDAKI_WR_GET => WorkRequest::Get {
            dst: local,
            src: remote,
            len,
        },
        GDAKI_WR_SEND => WorkRequest::Send { src: local, len },
        GDAKI_WR_SEND_IMM => WorkRequest::SendImm {
            src: local,
            len,
            imm: wr.imm,
        },
        GDAKI_WR_SEND_INLINE => WorkRequest::SendInline { data: bytes()? },
        GDAKI_WR_WRITE_IMM => WorkRequest::WriteImm {
            dst: remote,
            src: local,
            len,
            imm: wr.imm,
        },
        other => {
            return Err(Failure::invalid(format!(
                "wrs[{index}].opcode {other} (expected a GDAKI_WR_*)"
            )))
        }
    })
}

/// Writes `wrs[0..n]` into the send queue now and enqueues one doorbell for all of them on
/// `stream` (libgdsync's `gds_stream_post_descriptors`): the HCA sees them when the stream
/// gets there. Whole or nothing. `*first` gets the first request's ticket (the others follow
/// it). `GDAKI_STATUS_AGAIN`: the send queue has no room until earlier WQEs complete (enqueue
/// a wait for one, let the stream get there, post again); the CPU never waits for the stream.
/// While `stream` records (`gdaki_stream_begin_recording`), nothing is written: the tickets are
/// the recording's.
///
/// # Safety
/// `stream_qp`, `stream` are NULL or handles of their types; `wrs` is NULL or readable for `n`
/// requests, each inline one's `inline_data` readable for its `len`; `first` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_qp_post(
    stream_qp: *const gdaki_stream_qp,
    stream: *const gdaki_stream,
    wrs: *const gdaki_work_request,
    n: u32,
    first: *mut u64,
) -> gdaki_status {
    call("gdaki_stream_qp_post", || {
        // SAFETY: the caller's contract.
        let (p, s, list, out) = unsafe {
            (
                guard::borrow(stream_qp, "stream_qp")?,
                guard::borrow(stream, "stream")?,
                guard::slice(wrs, n as usize, "wrs")?,
                guard::out(first, "first")?,
            )
        };
        let reqs = list
            .iter()
            .enumerate()
            // SAFETY: the caller's contract covers every inline request's bytes.
            .map(|(i, wr)| unsafe { request(wr, i) })
            .collect::<Result<Vec<_>, _>>()?;
        let tickets = lock(p).sq.post(lock(s).ops(), &reqs)?;
        out.write(tickets.start);
        Ok(())
    })
}

/// Enqueues on `stream` a wait for the completion of WQE `ticket` (success or error: an error
/// completes it too, so the stream never waits on a failed queue pair): the stream's later
/// work starts once the HCA has completed it. `GDAKI_STATUS_INVALID_ARGUMENT` for a ticket
/// whose doorbell is not enqueued yet (it would wait for ever).
///
/// # Safety
/// `stream_qp`, `stream` are NULL or handles of their types.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_qp_wait(
    stream_qp: *const gdaki_stream_qp,
    stream: *const gdaki_stream,
    ticket: u64,
) -> gdaki_status {
    call("gdaki_stream_qp_wait", || {
        // SAFETY: the caller's contract.
        let (p, s) = unsafe { (guard::borrow(stream_qp, "stream_qp")?, guard::borrow(stream, "stream")?) };
        lock(p).sq.wait(lock(s).ops(), ticket)?;
        Ok(())
    })
}

/// Enqueues on `stream` a wait until a message has landed in receive `ticket` (the ticket the
/// CPU's posting of it gave), for a queue pair with a receive queue.
///
/// # Safety
/// `stream_qp`, `stream` are NULL or handles of their types.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_qp_wait_recv(
    stream_qp: *const gdaki_stream_qp,
    stream: *const gdaki_stream,
    ticket: u64,
) -> gdaki_status {
    call("gdaki_stream_qp_wait_recv", || {
        // SAFETY: the caller's contract.
        let (p, s) = unsafe { (guard::borrow(stream_qp, "stream_qp")?, guard::borrow(stream, "stream")?) };
        lock(p).sq.wait_recv(lock(s).ops(), ticket)?;
        Ok(())
    })
}

/// Whether WQE `ticket` has completed, looked at now (no waiting): `*done` 1 once it has, 0 if
/// not yet; `GDAKI_STATUS_QUEUE_ERROR` with the decoded error if it (or a WQE before it)
/// failed.
///
/// # Safety
/// `stream_qp` is NULL or a stream-QP handle; `done` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_qp_completed(
    stream_qp: *const gdaki_stream_qp,
    ticket: u64,
    done: *mut u32,
) -> gdaki_status {
    call("gdaki_stream_qp_completed", || {
        // SAFETY: the caller's contract.
        let (p, out) = unsafe { (guard::borrow(stream_qp, "stream_qp")?, guard::out(done, "done")?) };
        let finished = lock(p).sq.completed(ticket)?;
        out.write(u32::from(finished));
        Ok(())
    })
}

/// Starts recording on `stream` (a CUDA stream is captured into a graph, thread-local capture
/// mode): what is enqueued until `gdaki_stream_end_recording` becomes a replay launched with
/// `gdaki_replay_launch`. Recorded posts write nothing; each launch writes its WQEs where the
/// queue pairs are then (docs/stream.md has the rules).
///
/// # Safety
/// `stream` is NULL or a stream handle. Every store and wait enqueued while recording names
/// memory valid at every launch of the replay until it is destroyed.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_begin_recording(stream: *const gdaki_stream) -> gdaki_status {
    call("gdaki_stream_begin_recording", || {
        // SAFETY: the caller's contract.
        let s = unsafe { guard::borrow(stream, "stream") }?;
        // SAFETY: the caller's contract (the memory a recording names).
        match &mut *lock(s) {
            Executor::Cuda(c) => unsafe { c.begin_recording() }?,
            Executor::Cpu(c) => unsafe { c.begin_recording() }?,
        }
        Ok(())
    })
}

/// Ends the recording into `*replay`.
///
/// # Safety
/// `stream` is NULL or a stream handle; `replay` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_stream_end_recording(
    stream: *const gdaki_stream,
    replay: *mut *mut gdaki_replay,
) -> gdaki_status {
    call("gdaki_stream_end_recording", || {
        // SAFETY: the caller's contract.
        let (s, out) = unsafe { (guard::borrow(stream, "stream")?, guard::out(replay, "replay")?) };
        let made = match &mut *lock(s) {
            Executor::Cuda(c) => c.end_recording()?,
            Executor::Cpu(c) => c.end_recording()?,
        };
        out.write(guard::into_handle(Mutex::new(made)));
        Ok(())
    })
}

/// Launches the replay once on the stream it was recorded on, its posts going to
/// `stream_qps[0..n]` (every stream queue pair that posted into the recording, each once, in
/// any order); `first_tickets[i]` (NULL: not wanted) gets the first ticket of this launch's
/// WQEs on `stream_qps[i]`. Whole or nothing: `GDAKI_STATUS_AGAIN` when a queue pair has no
/// room for its recorded WQEs yet.
///
/// # Safety
/// `replay` is NULL or a replay handle; `stream_qps` NULL or readable for `n` stream-QP
/// handles; `first_tickets` NULL or writable for `n` values.
#[no_mangle]
pub unsafe extern "C" fn gdaki_replay_launch(
    replay: *const gdaki_replay,
    stream_qps: *const *const gdaki_stream_qp,
    n: u32,
    first_tickets: *mut u64,
) -> gdaki_status {
    call("gdaki_replay_launch", || {
        // SAFETY: the caller's contract.
        let (r, handles) = unsafe {
            (
                guard::borrow(replay, "replay")?,
                guard::slice(stream_qps, n as usize, "stream_qps")?,
            )
        };
        let mut seen = std::collections::HashSet::new();
        let mut postings = Vec::with_capacity(handles.len());
        for (i, &h) in handles.iter().enumerate() {
            if !seen.insert(h) {
                return Err(Failure::invalid(format!("stream_qps[{i}] is given twice")));
            }
            // SAFETY: the caller's contract.
            postings.push(unsafe { guard::borrow(h, "stream_qps[i]") }?);
        }
        let mut guards: Vec<_> = postings.iter().map(|p| lock(p)).collect();
        let mut qps: Vec<&mut StreamQp<'static>> = guards.iter_mut().map(|g| &mut g.sq).collect();
        let tickets = lock(r).launch(&mut qps)?;
        if !first_tickets.is_null() {
            // SAFETY: the caller's contract.
            let out = unsafe { guard::slice_mut(first_tickets, tickets.len(), "first_tickets") }?;
            for (o, t) in out.iter_mut().zip(&tickets) {
                *o = t.start;
            }
        }
        Ok(())
    })
}

/// Destroys a replay (NULL: nothing).
///
/// # Safety
/// `replay` is NULL or a replay handle with no call in flight, not used after, and no launch
/// of it still running.
#[no_mangle]
pub unsafe extern "C" fn gdaki_replay_destroy(replay: *mut gdaki_replay) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_replay_destroy", || unsafe { guard::destroy(replay, "replay") })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gdaki::{Access, Context, Provider, QpConfig};

    fn ok(status: gdaki_status) {
        assert_eq!(status, gdaki_status::Ok, "{:?}", unsafe {
            // SAFETY: this thread's NUL-terminated last error.
            std::ffi::CStr::from_ptr(guard::last_error())
        });
    }

    /// The C API on a CUDA stream of the caller's: a memset the stream runs first, the put the
    /// stream rings after it and a wait; then a recording of a memset node, the put and its
    /// wait, launched ten times into a cleared destination.
    #[test]
    fn a_cuda_stream_of_the_callers_posts_waits_and_replays_through_the_c_api() {
        let gpu = match gdaki::cuda::Gpu::open(0) {
            Ok(g) => g,
            Err(e) if std::env::var("GDAKI_REQUIRE_GPU").as_deref() != Ok("1") => {
                eprintln!("SKIPPED (no usable GPU): a_cuda_stream_of_the_callers_posts_waits_and_replays_through_the_c_api: {e}");
                return;
            }
            Err(e) => panic!("GDAKI_REQUIRE_GPU=1 but no usable GPU: {e}"),
        };
        const LEN: usize = 4096;
        let ctx = Context::open(Provider::Soft).unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = ctx
            .create_qp(
                &cq,
                QpConfig {
                    sq_size: 64,
                    ..QpConfig::default()
                },
            )
            .unwrap();
        qp.connect(&qp.endpoint()).unwrap();
        let src = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
        let dst = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
        let export = qp.export_gpu(&gpu).unwrap();
        let cuda = gpu.context().new_stream().unwrap();
        let h_gpu = guard::into_handle::<gdaki_gpu>(gpu.clone());
        let h_qp = guard::into_handle::<gdaki_qp>(Arc::new(qp));
        let h_export = guard::into_handle::<gdaki_gpu_qp>(Arc::new(export));
        let mut st = std::ptr::null_mut();
        let mut sq = std::ptr::null_mut();
        // SAFETY: live handles and out-pointers; `cuda` outlives the stream handle (destroyed
        // below, before it); `sq` is the queue pair's only poster, destroyed after the stream
        // has run its work.
        unsafe {
            ok(gdaki_stream_cuda(h_gpu, cuda.cu_stream().cast(), &mut st));
            ok(gdaki_stream_qp_create(h_qp, h_export, &mut sq));
        }
        let wr = gdaki_work_request {
            opcode: GDAKI_WR_PUT,
            len: LEN as u32,
            local_addr: src.addr(),
            lkey: src.lkey(),
            imm: 0,
            remote_addr: dst.addr(),
            rkey: dst.rkey(),
            reserved: 0,
            inline_data: std::ptr::null(),
        };
        let byte_memset = |byte: u8| {
            gpu.context().bind_to_thread().unwrap();
            // SAFETY: `src` holds LEN bytes of this GPU's memory, alive until the stream is idle.
            unsafe { cudarc::driver::sys::cuMemsetD8Async(src.addr(), byte, LEN, cuda.cu_stream()) }
                .result()
                .unwrap();
        };
        let landed = |byte: u8| {
            let mut got = vec![0u8; LEN];
            dst.read(0, &mut got).unwrap();
            got.iter().all(|&b| b == byte)
        };
        byte_memset(0x5a);
        let mut ticket = u64::MAX;
        // SAFETY: live handles; the request names registered memory.
        unsafe {
            ok(gdaki_stream_qp_post(sq, st, &wr, 1, &mut ticket));
            ok(gdaki_stream_qp_wait(sq, st, ticket));
            ok(gdaki_stream_synchronize(st, 30_000));
        }
        assert!(landed(0x5a));
        // A recording: the stream's memset node, then the put and its wait, launched ten times.
        let mut replay = std::ptr::null_mut();
        // SAFETY: as above; the recording names no memory of the test's but the regions, alive
        // until the replay is destroyed.
        unsafe {
            ok(gdaki_stream_begin_recording(st));
            byte_memset(0x33);
            ok(gdaki_stream_qp_post(sq, st, &wr, 1, &mut ticket));
            ok(gdaki_stream_qp_wait(sq, st, ticket));
            ok(gdaki_stream_end_recording(st, &mut replay));
        }
        let qps = [sq.cast_const()];
        for launch in 0..10u64 {
            dst.write(0, &[0u8; LEN]).unwrap();
            let mut first = 0;
            // SAFETY: live handles.
            unsafe {
                ok(gdaki_replay_launch(replay, qps.as_ptr(), 1, &mut first));
                ok(gdaki_stream_synchronize(st, 30_000));
            }
            assert_eq!(first, 1 + launch);
            assert!(landed(0x33), "launch {launch}");
        }
        // SAFETY: the stream is idle; each handle destroyed once.
        unsafe {
            ok(gdaki_replay_destroy(replay));
            ok(gdaki_stream_qp_destroy(sq));
            ok(gdaki_stream_destroy(st));
            guard::destroy(h_export, "export").unwrap();
            guard::destroy(h_qp, "qp").unwrap();
            guard::destroy(h_gpu, "gpu").unwrap();
        }
    }
}
