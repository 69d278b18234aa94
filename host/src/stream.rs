//! Stream-triggered posting (GPUDirect Async, libgdsync's model): the CPU writes work requests
//! into a queue pair's send queue now, and an in-order executor of memory operations (a CUDA
//! stream, [`CudaStreamOps`], or [`CpuStream`] where there is no GPU) rings the doorbell when
//! it reaches that point and waits for the completion in its own order. Communication then
//! interleaves with the kernels of a stream, with no CPU on the critical path and no
//! persistent kernel. `docs/stream.md` has the rules and an example.
//!
//! - **Posting.** [`StreamQp::post`] reserves slots, writes the WQEs and marks them ready on
//!   the calling thread, then enqueues the doorbell as the executor's stores: the doorbell
//!   record's word, then the doorbell (through a CPU proxy: the producer index). The work
//!   requests of one call share one doorbell (libgdsync's `gds_stream_post_descriptors`).
//! - **Waiting.** [`StreamQp::wait`] enqueues a wait on the owner bit of a WQE's CQE: the
//!   executor's later work starts once the HCA has completed that WQE, successfully or not (an
//!   error completes it, and the WQEs after it complete flushed). The CPU reads the outcome
//!   when it likes ([`StreamQp::completed`]).
//! - **The window.** The CPU never waits for the executor: a post that needs a slot whose
//!   previous WQE has not completed is refused ([`StreamError::WindowFull`]) rather than
//!   blocking on work the executor may not have reached. So at most a ring of WQEs lies
//!   between posting and completion, and the CQ (at least as large) never overflows.
//! - **Order.** A wait may only follow its WQE's doorbell ([`StreamError::NotQueued`]
//!   otherwise: it would wait forever). A `StreamQp` is its queue pair's only poster, and the
//!   executors' work must have run before the queue pair goes (the `unsafe` of
//!   [`StreamQp::new`]).
//!
//! ```
//! use std::time::Duration;
//! use gdaki::stream::{CpuStream, StreamQp};
//! use gdaki::{Access, Context, Provider, QpConfig};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = Context::open(Provider::Soft)?;
//! let mr = ctx.alloc_region(8192, Access::ALL)?;
//! mr.write(0, b"stream-triggered")?;
//! let cq = ctx.create_cq(1024)?;
//! let qp = ctx.create_qp(&cq, QpConfig::default())?;
//! qp.connect(&qp.endpoint())?;
//! // Where there is a GPU: CudaStreamOps::new(&gpu, stream) and StreamQp::new(&qp, Some(&export)).
//! let mut stream = CpuStream::new(Duration::from_secs(10))?;
//! // SAFETY: `sq` is the QP's only poster while it lives, and the stream runs its work
//! // (synchronize, below) before the QP goes.
//! let mut sq = unsafe { StreamQp::new(&qp, None) }?;
//! let ticket = sq.put(&mut stream, mr.remote(4096), mr.local(0), 16)?; // written now, rung later
//! sq.wait(&mut stream, ticket)?; // the stream's later work waits for the completion
//! stream.synchronize()?;
//! assert!(sq.completed(ticket)?);
//! let mut landed = [0u8; 16];
//! mr.read(4096, &mut landed)?;
//! assert_eq!(&landed, b"stream-triggered");
//! # Ok(()) }
//! ```
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gdaki_cuda::{GraphNode, MemOp, StreamWait};
use gdaki_device::status::{PostError, Ticket, WaitError};
use gdaki_device::{DoorbellWrites, Exclusive, Local, Remote, MAX_INLINE, MAX_SEND_INLINE};
use gdaki_layout::{cqe, ring, DevQp, DoorbellKind};
use thiserror::Error;

use crate::queue::{GpuQp, QueuePair};

/// Where the addresses an executor stores to and waits on live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// This process's own addresses ([`CpuStream`]).
    Host,
    /// Device addresses of the GPU with this ordinal ([`CudaStreamOps`]).
    Gpu(usize),
}

/// One store an executor makes, of the native-endian value given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// Four bytes at a 4-byte-aligned address.
    U32 {
        /// Where.
        addr: u64,
        /// What.
        value: u32,
    },
    /// Eight bytes at an 8-byte-aligned address.
    U64 {
        /// Where.
        addr: u64,
        /// What.
        value: u64,
    },
}

impl From<Store> for MemOp {
    fn from(s: Store) -> MemOp {
        match s {
            Store::U32 { addr, value } => MemOp::WriteU32 { addr, value },
            Store::U64 { addr, value } => MemOp::WriteU64 { addr, value },
        }
    }
}

/// An in-order executor of memory operations: what stream-triggered posting enqueues to. Each
/// call adds work after everything added before; nothing runs on the calling thread.
pub trait MemOps {
    /// Where the addresses given to this executor live.
    fn space(&self) -> Space;

    /// Adds `stores`, made in order once the executor reaches them (each after the executor's
    /// earlier work, whose memory effects it follows).
    ///
    /// # Safety
    /// Each address is aligned for its store and valid for it, in [`space`](Self::space), until
    /// the executor has made it, and nothing relies on that memory holding anything else.
    unsafe fn store(&mut self, stores: &[Store]) -> Result<(), StreamError>;

    /// Adds a wait until the 32-bit word at `addr` satisfies `how` against `value`: the
    /// executor's later work starts after it.
    ///
    /// # Safety
    /// `addr` is 4-byte aligned and valid for reads, in [`space`](Self::space), until the wait
    /// is over.
    unsafe fn wait(&mut self, addr: u64, how: StreamWait, value: u32) -> Result<(), StreamError>;

    /// The recording this executor is making while it records a replayable sequence
    /// ([`Replay`]); `None` otherwise (the default: an executor that cannot record).
    fn recording(&mut self) -> Option<&mut Recording> {
        None
    }

    /// Whether work enqueued now would be captured into a graph without a recording (a CUDA
    /// stream captured by someone else, or joined into another stream's capture): a stream
    /// queue pair refuses to post or wait then, since a replay would repeat fixed ring
    /// positions. `false` by default.
    fn captured_blindly(&self) -> Result<bool, StreamError> {
        Ok(false)
    }
}

/// Errors of stream-triggered posting.
#[derive(Debug, Clone, Error)]
#[non_exhaustive]
pub enum StreamError {
    /// Every slot of the send queue holds a WQE that has not completed: the executor has not
    /// reached their doorbells, or the HCA not their completions.
    #[error(
        "the send queue is full: {outstanding} of its {ring} WQEs are posted and not completed; enqueue a wait \
         for an earlier ticket and let the stream reach it, then post again"
    )]
    WindowFull {
        /// WQEs posted and not completed.
        outstanding: u64,
        /// The send queue's size.
        ring: u64,
    },
    /// A wait for a WQE whose doorbell is not enqueued: it would wait forever.
    #[error("WQE {ticket} is not posted through this stream queue pair ({queued} are): a wait for it would never end")]
    NotQueued {
        /// The ticket waited for.
        ticket: Ticket,
        /// WQEs posted so far (tickets below this).
        queued: u64,
    },
    /// A work request the send queue cannot take.
    #[error("work request {index}: {why}")]
    BadRequest {
        /// Its place in the call.
        index: usize,
        /// What is wrong with it.
        why: String,
    },
    /// The executor works in another address space than the queue pair was set up for.
    #[error("this stream queue pair stores to {expected:?} addresses, the executor takes {got:?} addresses")]
    WrongSpace {
        /// The queue pair's.
        expected: Space,
        /// The executor's.
        got: Space,
    },
    /// The device code refused a post.
    #[error(transparent)]
    Post(#[from] PostError),
    /// A completion, or the polling of one, failed: the CQE's decoded error.
    #[error(transparent)]
    Completion(#[from] WaitError),
    /// A [`CpuStream`] wait that did not end in time; the stream drops its later work.
    #[error("a stream wait on {addr:#x} ({how:?} {value:#x}) did not end within {timeout:?} (last seen {seen:#x})")]
    WaitTimedOut {
        /// The word waited on.
        addr: u64,
        /// The comparison.
        how: StreamWait,
        /// Its value.
        value: u32,
        /// The word when the wait gave up.
        seen: u32,
        /// The bound.
        timeout: Duration,
    },
    /// A recording cannot do this now: the executor is not recording (or is already), or the
    /// queue pair posted outside the recording since it joined it.
    #[error("recording: {0}")]
    Recording(String),
    /// The executor refused work (a CUDA call failed), or an earlier refusal left this stream
    /// queue pair with WQEs nobody will ring.
    #[error("the stream executor failed: {0}")]
    Executor(String),
}

impl From<gdaki_cuda::CudaError> for StreamError {
    fn from(e: gdaki_cuda::CudaError) -> Self {
        StreamError::Executor(e.to_string())
    }
}

// ------------------------------------------------------------------------------ executors

/// A CUDA stream as an executor: its stores are `cuStreamWriteValue32/64`, its waits
/// `cuStreamWaitValue32`, in stream order with the kernels and copies around them (and
/// capturable into a CUDA graph). Addresses are device addresses of the stream's GPU.
pub struct CudaStreamOps {
    stream: Arc<gdaki_cuda::CudaStream>,
    ordinal: usize,
    /// While recording: what is recorded and the graph node each step became.
    recording: Option<(Recording, Vec<GraphNode>)>,
}

impl std::fmt::Debug for CudaStreamOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStreamOps").field("gpu", &self.ordinal).finish()
    }
}

impl CudaStreamOps {
    /// Enqueues to `stream`, a stream of `gpu`: refused where the driver lacks the memory
    /// operations (`CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`, `..._WAIT_VALUE_NOR`).
    pub fn new(gpu: &gdaki_cuda::Gpu, stream: Arc<gdaki_cuda::CudaStream>) -> Result<Self, StreamError> {
        gdaki_cuda::stream_memops_supported(gpu)?;
        if stream.context().cu_device() != gpu.context().cu_device() {
            return Err(StreamError::Executor(format!(
                "the stream belongs to GPU {}, not GPU {}",
                stream.context().ordinal(),
                gpu.ordinal()
            )));
        }
        Ok(CudaStreamOps {
            stream,
            ordinal: gpu.ordinal(),
            recording: None,
        })
    }

    /// Starts recording: the stream is captured into a CUDA graph (thread-local capture mode)
    /// until [`end_recording`](Self::end_recording), kernels and copies enqueued on it meanwhile
    /// included, and what stream queue pairs post and wait for through this executor becomes a
    /// [`Replay`] that can be launched many times (see [`Replay`] for the rules).
    ///
    /// # Safety
    /// Every store and wait enqueued through [`MemOps`] during the recording names memory
    /// that stays valid for it until the [`Replay`] is dropped and its last launch has run: a
    /// replay makes them again.
    pub unsafe fn begin_recording(&mut self) -> Result<(), StreamError> {
        if self.recording.is_some() {
            return Err(StreamError::Recording("this stream is recording already".into()));
        }
        gdaki_cuda::begin_capture(&self.stream)?;
        self.recording = Some((Recording::new(self.space()), Vec::new()));
        Ok(())
    }

    /// Ends the recording [`begin_recording`](Self::begin_recording) started and instantiates
    /// the captured graph.
    pub fn end_recording(&mut self) -> Result<Replay, StreamError> {
        let (rec, nodes) = self
            .recording
            .take()
            .ok_or_else(|| StreamError::Recording("this stream is not recording".into()))?;
        let graph = gdaki_cuda::end_capture(&self.stream)?;
        Ok(rec.finish(ReplayGraph::Cuda { graph, nodes }))
    }

    /// Enqueues `ops`: one batch of memory operations (one graph node while recording).
    ///
    /// # Safety
    /// As [`gdaki_cuda::stream_batch`].
    unsafe fn enqueue(&mut self, ops: &[MemOp]) -> Result<(), StreamError> {
        let Some((rec, nodes)) = &mut self.recording else {
            for chunk in ops.chunks(gdaki_cuda::MAX_BATCH) {
                // SAFETY: the caller's contract.
                unsafe { gdaki_cuda::stream_batch(&self.stream, chunk) }?;
            }
            return Ok(());
        };
        // One node per call: a replay recomputes a step's operations as a whole.
        // SAFETY: the caller's contract.
        unsafe { gdaki_cuda::stream_batch(&self.stream, ops) }?;
        nodes.push(gdaki_cuda::captured_node(&self.stream)?);
        rec.push_step();
        Ok(())
    }

    /// The stream.
    pub fn stream(&self) -> &Arc<gdaki_cuda::CudaStream> {
        &self.stream
    }
}

impl MemOps for CudaStreamOps {
    fn space(&self) -> Space {
        Space::Gpu(self.ordinal)
    }

    unsafe fn store(&mut self, stores: &[Store]) -> Result<(), StreamError> {
        let ops: Vec<MemOp> = stores.iter().map(|&s| s.into()).collect();
        // SAFETY: the caller's contract covers every store's address.
        unsafe { self.enqueue(&ops) }
    }

    unsafe fn wait(&mut self, addr: u64, how: StreamWait, value: u32) -> Result<(), StreamError> {
        // SAFETY: the caller's contract.
        unsafe { self.enqueue(&[MemOp::WaitU32 { addr, how, value }]) }
    }

    fn recording(&mut self) -> Option<&mut Recording> {
        self.recording.as_mut().map(|(rec, _)| rec)
    }

    fn captured_blindly(&self) -> Result<bool, StreamError> {
        if self.recording.is_some() {
            return Ok(false);
        }
        Ok(gdaki_cuda::stream_capturing(&self.stream)?)
    }
}

/// What a [`CpuStream`] runs.
#[derive(Debug, Clone, Copy)]
enum CpuOp {
    /// A store or a wait.
    Mem(MemOp),
    /// Note the time (a CUDA event's record).
    Mark,
}

#[derive(Default)]
struct CpuQueue {
    ops: VecDeque<CpuOp>,
    enqueued: u64,
    done: u64,
    failed: Option<StreamError>,
    stop: bool,
    /// When the stream reached each mark, in order.
    marks: Vec<Instant>,
}

struct CpuShared {
    queue: Mutex<CpuQueue>,
    moved: Condvar,
}

/// A CUDA stream's memory operations run by a CPU thread, in order, on this process's
/// addresses: stream-triggered posting where there is no GPU (CPU mode, CI), with the same
/// rules. A wait that does not end within the stream's bound fails the stream: the work
/// after it is dropped and [`synchronize`](Self::synchronize) says why (a CUDA stream would
/// wait forever).
pub struct CpuStream {
    shared: Arc<CpuShared>,
    worker: Option<JoinHandle<()>>,
    /// While recording: what is recorded and each step's operations.
    recording: Option<(Recording, Vec<Vec<CpuOp>>)>,
}

impl std::fmt::Debug for CpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = lock(&self.shared.queue);
        f.debug_struct("CpuStream")
            .field("enqueued", &q.enqueued)
            .field("done", &q.done)
            .finish()
    }
}

impl CpuStream {
    /// A stream whose waits give up after `timeout`.
    pub fn new(timeout: Duration) -> std::io::Result<CpuStream> {
        let shared = Arc::new(CpuShared {
            queue: Mutex::new(CpuQueue::default()),
            moved: Condvar::new(),
        });
        let worker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("gdaki-cpu-stream".into())
                .spawn(move || run_cpu_stream(&shared, timeout))?
        };
        Ok(CpuStream {
            shared,
            worker: Some(worker),
            recording: None,
        })
    }

    /// Starts recording: until [`end_recording`](Self::end_recording) the stream runs nothing
    /// enqueued to it, and what is enqueued (stream queue pairs' posts and waits, stores, waits,
    /// marks) becomes a [`Replay`] that can be launched on this stream many times: CUDA graph
    /// replay, on a CPU thread.
    ///
    /// # Safety
    /// Every store and wait enqueued during the recording names memory that stays valid for it
    /// until the [`Replay`] is dropped and its last launch has run: a replay makes them again.
    pub unsafe fn begin_recording(&mut self) -> Result<(), StreamError> {
        if self.recording.is_some() {
            return Err(StreamError::Recording("this stream is recording already".into()));
        }
        self.recording = Some((Recording::new(Space::Host), Vec::new()));
        Ok(())
    }

    /// Ends the recording [`begin_recording`](Self::begin_recording) started.
    pub fn end_recording(&mut self) -> Result<Replay, StreamError> {
        let (rec, ops) = self
            .recording
            .take()
            .ok_or_else(|| StreamError::Recording("this stream is not recording".into()))?;
        Ok(rec.finish(ReplayGraph::Cpu {
            shared: self.shared.clone(),
            ops,
        }))
    }

    /// Runs `ops` in order after what is enqueued, or records them as one step.
    fn enqueue(&mut self, ops: Vec<CpuOp>) -> Result<(), StreamError> {
        match &mut self.recording {
            Some((rec, steps)) => {
                steps.push(ops);
                rec.push_step();
                Ok(())
            }
            None => push_ops(&self.shared, ops),
        }
    }

    /// Waits until the stream has run everything enqueued so far; the error of a wait that
    /// timed out (sticky: the stream stays failed).
    pub fn synchronize(&self) -> Result<(), StreamError> {
        let mut q = lock(&self.shared.queue);
        while q.done < q.enqueued && q.failed.is_none() {
            q = self.shared.moved.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        q.failed.clone().map_or(Ok(()), Err)
    }

    /// [`synchronize`](Self::synchronize), giving up after `timeout`: `Ok(false)` if the
    /// stream has not run everything enqueued by then.
    pub fn synchronize_within(&self, timeout: Duration) -> Result<bool, StreamError> {
        let deadline = Instant::now() + timeout;
        let mut q = lock(&self.shared.queue);
        while q.done < q.enqueued && q.failed.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            q = self
                .shared
                .moved
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        q.failed.clone().map_or(Ok(true), Err)
    }

    /// Operations run so far (stores, waits and marks, one each).
    pub fn done(&self) -> u64 {
        lock(&self.shared.queue).done
    }

    /// Adds a mark: the stream notes the time when it reaches it (what recording a CUDA event
    /// on a stream gives); [`take_marks`](Self::take_marks) hands the times over.
    pub fn mark(&mut self) -> Result<(), StreamError> {
        self.enqueue(vec![CpuOp::Mark])
    }

    /// The times of the marks the stream has reached since the last call, in order.
    pub fn take_marks(&self) -> Vec<Instant> {
        std::mem::take(&mut lock(&self.shared.queue).marks)
    }
}

/// Adds `ops` to the CPU stream's queue, refused once the stream has failed.
fn push_ops(shared: &CpuShared, ops: impl IntoIterator<Item = CpuOp>) -> Result<(), StreamError> {
    let mut q = lock(&shared.queue);
    if let Some(e) = &q.failed {
        return Err(StreamError::Executor(format!("the stream failed earlier: {e}")));
    }
    for op in ops {
        q.ops.push_back(op);
        q.enqueued += 1;
    }
    shared.moved.notify_all();
    Ok(())
}

impl Drop for CpuStream {
    fn drop(&mut self) {
        lock(&self.shared.queue).stop = true;
        self.shared.moved.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl MemOps for CpuStream {
    fn space(&self) -> Space {
        Space::Host
    }

    unsafe fn store(&mut self, stores: &[Store]) -> Result<(), StreamError> {
        for s in stores {
            let (addr, align) = match *s {
                Store::U32 { addr, .. } => (addr, 4),
                Store::U64 { addr, .. } => (addr, 8),
            };
            if addr == 0 || addr % align != 0 {
                return Err(StreamError::Executor(format!(
                    "a store to {addr:#x} is not {align}-byte aligned"
                )));
            }
        }
        self.enqueue(stores.iter().map(|&s| CpuOp::Mem(s.into())).collect())
    }

    unsafe fn wait(&mut self, addr: u64, how: StreamWait, value: u32) -> Result<(), StreamError> {
        if addr == 0 || addr % 4 != 0 {
            return Err(StreamError::Executor(format!(
                "a wait on {addr:#x} is not 4-byte aligned"
            )));
        }
        self.enqueue(vec![CpuOp::Mem(MemOp::WaitU32 { addr, how, value })])
    }

    fn recording(&mut self) -> Option<&mut Recording> {
        self.recording.as_mut().map(|(rec, _)| rec)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CPU stream's thread: runs each operation in order until told to stop.
fn run_cpu_stream(shared: &CpuShared, timeout: Duration) {
    loop {
        let op = {
            let mut q = lock(&shared.queue);
            loop {
                if q.stop {
                    return;
                }
                if let Some(op) = q.ops.pop_front() {
                    break op;
                }
                q = shared.moved.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let outcome = match op {
            CpuOp::Mark => {
                lock(&shared.queue).marks.push(Instant::now());
                Ok(())
            }
            // SAFETY: enqueued through `MemOps::store` (or replayed, then recorded through it),
            // whose caller promised the address valid (and aligned, checked there) until this
            // store is made (for every launch of a replay: `begin_recording`'s contract).
            CpuOp::Mem(MemOp::WriteU32 { addr, value }) => {
                unsafe { AtomicU32::from_ptr(addr as *mut u32) }.store(value, Ordering::Release);
                Ok(())
            }
            CpuOp::Mem(MemOp::WriteU64 { addr, value }) => {
                // SAFETY: as above.
                unsafe { AtomicU64::from_ptr(addr as *mut u64) }.store(value, Ordering::Release);
                Ok(())
            }
            CpuOp::Mem(MemOp::WaitU32 { addr, how, value }) => {
                // SAFETY: enqueued (or recorded) through `MemOps::wait`, whose caller promised the
                // word valid for reads until the wait is over (as for stores, above).
                let word = unsafe { AtomicU32::from_ptr(addr as *mut u32) };
                wait_for(word, how, value, timeout, &shared.queue).map_err(|seen| StreamError::WaitTimedOut {
                    addr,
                    how,
                    value,
                    seen,
                    timeout,
                })
            }
        };
        let mut q = lock(&shared.queue);
        q.done += 1;
        if let Err(e) = outcome {
            tracing::warn!("CPU stream: {e}; the {} operations after it are dropped", q.ops.len());
            q.done += q.ops.len() as u64;
            q.ops.clear();
            q.failed = Some(e);
        }
        shared.moved.notify_all();
    }
}

/// Spins, then sleeps a little between looks, until `word` satisfies the wait; its last value
/// if `timeout` passes first (or the stream is dropped).
fn wait_for(
    word: &AtomicU32,
    how: StreamWait,
    value: u32,
    timeout: Duration,
    queue: &Mutex<CpuQueue>,
) -> Result<(), u32> {
    let start = Instant::now();
    let mut looks = 0u32;
    loop {
        let seen = word.load(Ordering::Acquire);
        if how.holds(value, seen) {
            return Ok(());
        }
        looks += 1;
        if looks < 1 << 12 {
            std::hint::spin_loop();
            continue;
        }
        if start.elapsed() > timeout || lock(queue).stop {
            return Err(seen);
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

// ------------------------------------------------------------------------------ queue pairs

/// The wait that ends once CQE `index` of the CQ at `cqe_base` (`1 << log` entries) is
/// written: on its last four bytes (WQE counter, signature, `op_own`) read as one
/// little-endian word, `op_own` its top byte, whose owner bit turns to the lap's parity when the
/// HCA writes the entry (a fresh ring holds owner 1, so lap 0 waits for 0).
fn owner_wait(cqe_base: u64, log: u32, index: u64) -> MemOp {
    let addr = cqe_base + ring::cqe_offset(index, log) + (cqe::SIZE - 4) as u64;
    let owner = u32::from(cqe::OWNER_MASK) << 24;
    let (how, value) = match ring::owner_parity(index, log) {
        0 => (StreamWait::Nor, !owner),
        _ => (StreamWait::And, owner),
    };
    MemOp::WaitU32 { addr, how, value }
}

/// Enqueues `op` (a wait) on `ops`.
///
/// # Safety
/// As [`MemOps::wait`].
unsafe fn enqueue_wait(ops: &mut dyn MemOps, op: MemOp) -> Result<(), StreamError> {
    let MemOp::WaitU32 { addr, how, value } = op else {
        return Err(StreamError::Executor(format!("{op:?} is not a wait")));
    };
    // SAFETY: the caller's contract.
    unsafe { ops.wait(addr, how, value) }
}

/// One work request for [`StreamQp::post`]: the send queue's operations, one WQE each.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum WorkRequest<'a> {
    /// RDMA WRITE of `len` bytes from `src` to `dst`.
    Put {
        /// Remote destination.
        dst: Remote,
        /// Local source.
        src: Local,
        /// Bytes (at most the QP's largest message).
        len: u32,
    },
    /// RDMA WRITE of `data`, carried in the WQE (at most [`MAX_INLINE`] bytes).
    PutInline {
        /// Remote destination.
        dst: Remote,
        /// The bytes, copied into the WQE when posted.
        data: &'a [u8],
    },
    /// RDMA READ of `len` bytes from `src` into `dst`.
    Get {
        /// Local destination.
        dst: Local,
        /// Remote source.
        src: Remote,
        /// Bytes.
        len: u32,
    },
    /// SEND of `len` bytes from `src`, into the peer's next receive.
    Send {
        /// Local source.
        src: Local,
        /// Bytes.
        len: u32,
    },
    /// SEND with 32 bits of immediate data.
    SendImm {
        /// Local source.
        src: Local,
        /// Bytes.
        len: u32,
        /// The immediate.
        imm: u32,
    },
    /// SEND of `data` carried in the WQE (at most [`MAX_SEND_INLINE`] bytes).
    SendInline {
        /// The bytes, copied into the WQE when posted.
        data: &'a [u8],
    },
    /// RDMA WRITE with immediate: consumes a receive of the peer, which gets `imm`.
    WriteImm {
        /// Remote destination.
        dst: Remote,
        /// Local source.
        src: Local,
        /// Bytes.
        len: u32,
        /// The immediate.
        imm: u32,
    },
}

impl WorkRequest<'_> {
    /// Why the send queue cannot take it, if it cannot.
    fn refusal(&self, max_msg: u64) -> Option<String> {
        let too_long = |len: u32| {
            (u64::from(len) > max_msg).then(|| format!("{len} bytes, the QP carries at most {max_msg} in one WQE"))
        };
        match *self {
            WorkRequest::Put { len, .. }
            | WorkRequest::Get { len, .. }
            | WorkRequest::Send { len, .. }
            | WorkRequest::SendImm { len, .. }
            | WorkRequest::WriteImm { len, .. } => too_long(len),
            WorkRequest::PutInline { data, .. } => (data.len() > MAX_INLINE)
                .then(|| format!("{} bytes inline, a WRITE carries at most {MAX_INLINE}", data.len())),
            WorkRequest::SendInline { data } => (data.len() > MAX_SEND_INLINE)
                .then(|| format!("{} bytes inline, a SEND carries at most {MAX_SEND_INLINE}", data.len())),
        }
    }
}

/// A queue pair posted to through an executor of memory operations (see the module's text).
pub struct StreamQp<'q> {
    dev: gdaki_device::Qp<Exclusive>,
    space: Space,
    kind: DoorbellKind,
    qpn: u32,
    /// The executor's addresses of the send doorbell record (0: the QP has none), the doorbell
    /// (or proxy word) and CQE 0.
    record: u64,
    doorbell: u64,
    cqe_base: u64,
    cq_log_size: u32,
    ring: u64,
    max_msg: u64,
    /// WQEs whose doorbell is enqueued (tickets below this).
    queued: u64,
    /// The receive side, for a QP with a receive queue: a view of it (its consumed count) and
    /// the executor's address and log size of its CQ.
    recv: Option<(gdaki_device::Rq<Exclusive>, u64, u32)>,
    /// An executor refused a doorbell: WQEs are ready that nobody will ring.
    broken: bool,
    /// This queue pair's part in the recording it posted to last, while that is not over.
    recorded: Option<Recorded>,
    _qp: std::marker::PhantomData<&'q QueuePair>,
}

/// A stream queue pair's part in a recording: its recorded posts are tickets
/// `base..base + count` of the recording (nothing reserved: a replay reserves them anew).
#[derive(Debug, Clone, Copy)]
struct Recorded {
    /// The recording's id.
    id: u64,
    /// Its entry in the recording's queue pairs.
    slot: usize,
    /// The first recorded ticket.
    base: u64,
    /// WQEs recorded.
    count: u64,
}

impl std::fmt::Debug for StreamQp<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamQp")
            .field("qpn", &format_args!("{:#x}", self.qpn))
            .field("space", &self.space)
            .field("queued", &self.queued)
            .finish()
    }
}

impl<'q> StreamQp<'q> {
    /// Posting to `qp` through an executor of [`Space::Host`] addresses (a [`CpuStream`]), or,
    /// with `gpu` (`qp`'s export), of that GPU's addresses (a [`CudaStreamOps`] on it). The
    /// CPU writes the WQEs, so the send queue and CQ must be in host memory, and the CQ at
    /// least as large as the send queue (the window's rule); the queue pair must be connected
    /// (ready to send, or failed: a failed one completes its WQEs flushed).
    ///
    /// # Safety
    /// While the returned value lives it is `qp`'s only poster: no CPU view
    /// ([`QueuePair::cpu`]) and no kernel through an export posts to it or polls its CQ. And
    /// every executor it enqueues to has run that work (`CpuStream::synchronize`, the CUDA
    /// stream idle) before `qp` or `gpu` is dropped: the executor's stores and waits name the
    /// queue pair's doorbell record, doorbell and CQ, which go with them.
    pub unsafe fn new(qp: &'q QueuePair, gpu: Option<&'q GpuQp>) -> crate::Result<StreamQp<'q>> {
        // SAFETY: the caller's contract (the only poster, outliving nothing: `'q`).
        let dev = unsafe { qp.cpu::<Exclusive>() }.map_err(|e| match e {
            crate::Error::Unsupported { why, .. } => crate::Error::Unsupported {
                what: "stream-triggered posting to a queue pair whose rings are in GPU memory",
                why: format!("the CPU writes its WQEs: {why}"),
            },
            e => e,
        })?;
        // A queue pair that has not started executing its WQEs would leave a stream's waits
        // waiting; a failed one still completes them (flushed). Asked once: a connected queue
        // pair never goes back.
        match qp.state() {
            crate::QpState::Rts | crate::QpState::Error => {}
            state => {
                return Err(crate::Error::Unsupported {
                    what: "stream-triggered posting to a queue pair that is not connected",
                    why: format!("it is in {state:?}: connect it first, or a stream's waits would never end"),
                })
            }
        }
        // SAFETY: the CPU handle was written at creation and lives as long as `qp`.
        let host: DevQp = unsafe { qp.device_handle().read() };
        // The receive CQ in the executor's space. Only its consumed count is read through the
        // view, which the receiving thread's own view also keeps.
        let recv = match qp.receive_handle() {
            Some(h) => {
                // SAFETY: the view lives no longer than `qp` (`'q`) and only reads the consumed
                // count, which the receiving thread's view raises atomically.
                let rq = unsafe { qp.cpu_receive::<Exclusive>() }?;
                let cq = match gpu.and_then(|g| g.recv_view()) {
                    Some(v) => v.cq,
                    // SAFETY: the receive handle of the live `qp`, written at its creation.
                    None => unsafe { h.read() }.cq,
                };
                Some((rq, cq.cqe_base, cq.log_size))
            }
            None => None,
        };
        let (view, space) = match gpu {
            None => (host, Space::Host),
            Some(g) => {
                if !g.exports(qp) {
                    return Err(crate::Error::Unsupported {
                        what: "stream-triggered posting through another queue pair's export",
                        why: format!("the export is of QP {:#x}, not of QP {:#x}", g.view().qpn, host.qpn),
                    });
                }
                (*g.view(), Space::Gpu(g.gpu_ordinal()))
            }
        };
        let kind = DoorbellKind::from_raw(view.doorbell_kind).ok_or(crate::Error::Unsupported {
            what: "stream-triggered posting to a queue pair without a doorbell",
            why: format!("its handle names doorbell kind {}", view.doorbell_kind),
        })?;
        if view.cq.log_size == 0 {
            return Err(crate::Error::Unsupported {
                what: "stream-triggered posting with a collapsed (or one-entry) CQ",
                why: "a stream waits for a CQE's owner bit to flip in the CQE's own entry, \
                      and a collapsed CQ writes every CQE to one entry"
                    .into(),
            });
        }
        if view.cq.log_size < view.sq_log_size {
            return Err(crate::Error::Unsupported {
                what: "stream-triggered posting with a CQ smaller than the send queue",
                why: format!(
                    "the CQ has {} entries, the send queue {}: a stream's wait could see the previous lap's CQE",
                    1u64 << view.cq.log_size,
                    1u64 << view.sq_log_size
                ),
            });
        }
        Ok(StreamQp {
            dev,
            space,
            kind,
            qpn: view.qpn,
            record: view.sq_dbrec,
            doorbell: view.doorbell,
            cqe_base: view.cq.cqe_base,
            cq_log_size: view.cq.log_size,
            ring: 1 << view.sq_log_size,
            max_msg: view.max_msg_size,
            queued: dev.reserved(),
            recv,
            broken: false,
            recorded: None,
            _qp: std::marker::PhantomData,
        })
    }

    /// Writes `wrs` into the send queue and enqueues one doorbell for all of them on `ops`:
    /// the HCA sees them when the executor reaches it. Whole or nothing: a request the queue
    /// cannot take, or too little room ([`StreamError::WindowFull`]), posts none. Returns the
    /// tickets (WQE indices) of the requests, in order.
    pub fn post(&mut self, ops: &mut dyn MemOps, wrs: &[WorkRequest<'_>]) -> Result<Range<Ticket>, StreamError> {
        // SAFETY: no stores of the caller's.
        unsafe { self.post_after(ops, &[], wrs) }
    }

    /// [`post`](Self::post), with `before` made by the executor just ahead of the doorbell,
    /// in the same call (and so never without it): a flag or the message's last word set in
    /// stream order right before the HCA reads it.
    ///
    /// # Safety
    /// As [`MemOps::store`] for every store of `before`.
    pub unsafe fn post_after(
        &mut self,
        ops: &mut dyn MemOps,
        before: &[Store],
        wrs: &[WorkRequest<'_>],
    ) -> Result<Range<Ticket>, StreamError> {
        self.usable(ops)?;
        let n = wrs.len() as u64;
        if n == 0 || n > self.ring {
            return Err(StreamError::BadRequest {
                index: 0,
                why: format!("{n} work requests in one post: 1 to {} (the send queue)", self.ring),
            });
        }
        if let Some((index, why)) = wrs
            .iter()
            .enumerate()
            .find_map(|(i, wr)| wr.refusal(self.max_msg).map(|w| (i, w)))
        {
            return Err(StreamError::BadRequest { index, why });
        }
        if ops.recording().is_some() {
            return self.record_post(ops, before, wrs);
        }
        // A real post ends this queue pair's part in any recording: its tickets would overlap.
        self.recorded = None;
        self.make_room(n)?;
        // Room is made: reserve finds every slot's previous WQE consumed and does not wait.
        let first = self.dev.reserve(n as u32)?;
        for (k, wr) in wrs.iter().enumerate() {
            self.prepare(first + k as u64, wr)?;
        }
        let end = first + n;
        self.dev.mark_ready(first, end)?;
        let mut stores = before.to_vec();
        stores.extend(self.doorbell_stores(end));
        // SAFETY: `before` is the caller's (their contract); then the record, the doorbell (or
        // proxy word) of this QP in the executor's space (checked in `usable`), which live as
        // long as the QP (`'q`), and which only the HCA reads.
        if let Err(e) = unsafe { ops.store(&stores) } {
            self.broken = true;
            return Err(e);
        }
        self.dev.note_rung(end);
        self.queued = end;
        Ok(first..end)
    }

    /// The stores that ring the doorbell for every WQE before `end`: the record, then the
    /// doorbell; through a CPU proxy the producer index into the proxy's word.
    fn doorbell_stores(&self, end: u64) -> Vec<Store> {
        match DoorbellWrites::new(self.kind, self.qpn, end, self.record != 0) {
            DoorbellWrites::Doorbell { record, doorbell } => record
                .map(|value| Store::U32 {
                    addr: self.record,
                    value,
                })
                .into_iter()
                .chain([Store::U64 {
                    addr: self.doorbell,
                    value: doorbell,
                }])
                .collect(),
            DoorbellWrites::Proxy { index } => vec![Store::U64 {
                addr: self.doorbell,
                value: index,
            }],
        }
    }

    /// `post_after` into a recording: nothing is written to the send queue (each launch of the
    /// replay writes its WQEs); the executor records the stores, which a launch recomputes.
    ///
    /// # Safety
    /// As [`post_after`](Self::post_after).
    unsafe fn record_post(
        &mut self,
        ops: &mut dyn MemOps,
        before: &[Store],
        wrs: &[WorkRequest<'_>],
    ) -> Result<Range<Ticket>, StreamError> {
        let part = self.recording_part(ops)?;
        let n = wrs.len() as u64;
        if part.count + n > self.ring {
            return Err(StreamError::BadRequest {
                index: 0,
                why: format!(
                    "a replay posts at most a send queue of WQEs ({}) to a queue pair; this post would make it {}",
                    self.ring,
                    part.count + n
                ),
            });
        }
        let first = part.base + part.count;
        let end = first + n;
        let mut stores = before.to_vec();
        stores.extend(self.doorbell_stores(end));
        // SAFETY: as in `post_after`; recorded for replays under `begin_recording`'s contract
        // (the caller's stores) and `new`'s (the queue pair's words outlive the executor's work).
        unsafe { ops.store(&stores) }?;
        let rec = ops
            .recording()
            .ok_or_else(|| StreamError::Recording("the executor stopped recording".into()))?;
        rec.describe_last(Recipe::Doorbell {
            qp: part.slot,
            before: before.to_vec(),
            end: end - part.base,
        });
        rec.qps[part.slot].wrs.extend(wrs.iter().map(OwnedRequest::new));
        self.recorded = Some(Recorded {
            count: part.count + n,
            ..part
        });
        Ok(first..end)
    }

    /// This queue pair's part in the recording `ops` is making, joined now if it has none.
    fn recording_part(&mut self, ops: &mut dyn MemOps) -> Result<Recorded, StreamError> {
        let rec = ops
            .recording()
            .ok_or_else(|| StreamError::Recording("the executor is not recording".into()))?;
        if let Some(part) = self.recorded.filter(|p| p.id == rec.id) {
            return Ok(part);
        }
        if rec.qps.iter().any(|q| q.qpn == self.qpn) {
            return Err(StreamError::Recording(format!(
                "QP {:#x} posted outside this recording after joining it: its recorded tickets no longer hold",
                self.qpn
            )));
        }
        rec.qps.push(RecordedQp {
            qpn: self.qpn,
            wrs: Vec::new(),
        });
        let part = Recorded {
            id: rec.id,
            slot: rec.qps.len() - 1,
            base: self.queued,
            count: 0,
        };
        self.recorded = Some(part);
        Ok(part)
    }

    /// [`post`](Self::post) of one RDMA WRITE.
    pub fn put(&mut self, ops: &mut dyn MemOps, dst: Remote, src: Local, len: u32) -> Result<Ticket, StreamError> {
        self.post(ops, &[WorkRequest::Put { dst, src, len }]).map(|r| r.start)
    }

    /// Enqueues on `ops` a wait for the completion of WQE `ticket` (success or error): the
    /// executor's later work starts once the HCA has completed it. Nothing is enqueued for a
    /// WQE whose completion the CPU has consumed already. Refused for a WQE whose doorbell is
    /// not enqueued yet.
    pub fn wait(&mut self, ops: &mut dyn MemOps, ticket: Ticket) -> Result<(), StreamError> {
        self.usable(ops)?;
        if ops.recording().is_some() {
            // Only this recording's own posts: their tickets move with every launch.
            let part = self.recorded.filter(|p| ops.recording().is_some_and(|r| r.id == p.id));
            let Some(part) = part.filter(|p| (p.base..p.base + p.count).contains(&ticket)) else {
                return Err(StreamError::NotQueued {
                    ticket,
                    queued: part.map_or(0, |p| p.base + p.count),
                });
            };
            let op = owner_wait(self.cqe_base, self.cq_log_size, ticket);
            // SAFETY: as below, for every launch (`new`'s contract).
            unsafe { enqueue_wait(ops, op) }?;
            if let Some(rec) = ops.recording() {
                rec.describe_last(Recipe::Completion {
                    qp: part.slot,
                    offset: ticket - part.base,
                });
            }
            return Ok(());
        }
        if ticket >= self.queued {
            return Err(StreamError::NotQueued {
                ticket,
                queued: self.queued,
            });
        }
        if ticket < self.dev.consumed() {
            return Ok(());
        }
        // The slot holds the previous lap's CQE (the window keeps it from being older).
        // SAFETY: a CQE of this QP's CQ, in the executor's space (checked in `usable`), which
        // lives as long as the QP (`'q`).
        unsafe { enqueue_wait(ops, owner_wait(self.cqe_base, self.cq_log_size, ticket)) }
    }

    /// Enqueues on `ops` a wait for the completion of receive `ticket` (the ticket the CPU's
    /// `post_recv` gave; receives complete in posting order, so it is also the message's place
    /// in the stream of arrivals): the executor's later work starts once a message has landed
    /// in it (or it completed in error, flushed). Nothing is enqueued for a receive whose
    /// completion is consumed already; refused for a queue pair without a receive queue and for
    /// a receive more than a receive CQ ahead of the consumed ones (its CQE slot still holds an
    /// older lap's entry).
    pub fn wait_recv(&mut self, ops: &mut dyn MemOps, ticket: Ticket) -> Result<(), StreamError> {
        self.usable(ops)?;
        if ops.recording().is_some() {
            return Err(StreamError::BadRequest {
                index: 0,
                why: "a wait for a receive in a recording: receives are posted by the CPU, their tickets do not move \
                      with a replay"
                    .into(),
            });
        }
        let Some((rq, cqe_base, log)) = self.recv else {
            return Err(StreamError::BadRequest {
                index: 0,
                why: "a wait for a receive on a queue pair without a receive queue".into(),
            });
        };
        let consumed = rq.next_to_complete();
        if ticket < consumed {
            return Ok(());
        }
        if ticket - consumed >= 1 << log {
            return Err(StreamError::NotQueued {
                ticket,
                queued: consumed + (1 << log),
            });
        }
        // SAFETY: a CQE of this QP's receive CQ, in the executor's space (checked in `usable`),
        // which lives as long as the QP (`'q`).
        unsafe { enqueue_wait(ops, owner_wait(cqe_base, log, ticket)) }
    }

    /// Whether WQE `ticket` has completed, looked at now from the CPU (no waiting): `Ok(true)`
    /// once it has, its error (or the queue pair's earlier one) if it failed.
    pub fn completed(&mut self, ticket: Ticket) -> Result<bool, StreamError> {
        if ticket >= self.queued {
            return Err(StreamError::NotQueued {
                ticket,
                queued: self.queued,
            });
        }
        while self.dev.consumed() <= ticket {
            match self.dev.poll_one() {
                None => return Ok(false),
                Some(Err(e @ WaitError::CqeFormat { .. })) => return Err(e.into()),
                Some(_) => {}
            }
        }
        // Consumed: its own outcome, or the first error at or before it.
        self.dev.poll_at(ticket).map(|()| true).map_err(Into::into)
    }

    /// The send queue's size in WQEs: the most that can be posted and not completed.
    pub fn ring(&self) -> u64 {
        self.ring
    }

    /// WQEs posted so far: tickets below this have their doorbells enqueued.
    pub fn queued(&self) -> u64 {
        self.queued
    }

    /// The executor's address space this queue pair stores to.
    pub fn space(&self) -> Space {
        self.space
    }

    fn usable(&self, ops: &dyn MemOps) -> Result<(), StreamError> {
        if ops.captured_blindly()? {
            return Err(StreamError::Recording(
                "the stream is being captured into a graph outside a recording: the graph would replay this \
                 post's or wait's ring positions unchanged; record it (begin_recording) instead"
                    .into(),
            ));
        }
        if self.broken {
            return Err(StreamError::Executor(
                "an executor refused an earlier doorbell: this stream queue pair has WQEs nobody will ring".into(),
            ));
        }
        if ops.space() != self.space {
            return Err(StreamError::WrongSpace {
                expected: self.space,
                got: ops.space(),
            });
        }
        Ok(())
    }

    /// Consumes the completions that are in until `n` slots are free; refuses rather than
    /// waits when they are not.
    fn make_room(&self, n: u64) -> Result<(), StreamError> {
        loop {
            let outstanding = self.dev.reserved() - self.dev.consumed();
            if outstanding + n <= self.ring {
                return Ok(());
            }
            match self.dev.poll_one() {
                // Consumed, successful or not: either way its slot is free.
                Some(Ok(_) | Err(WaitError::Cqe(_))) => {}
                Some(Err(e)) => return Err(e.into()),
                None => {
                    return Err(StreamError::WindowFull {
                        outstanding,
                        ring: self.ring,
                    })
                }
            }
        }
    }

    fn prepare(&self, index: u64, wr: &WorkRequest<'_>) -> Result<(), StreamError> {
        let d = &self.dev;
        match *wr {
            WorkRequest::Put { dst, src, len } => d.wqe_prepare_write(index, dst, src, len, 0),
            WorkRequest::PutInline { dst, data } => d.wqe_prepare_write_inline(index, dst, data, 0)?,
            WorkRequest::Get { dst, src, len } => d.wqe_prepare_read(index, dst, src, len, 0),
            WorkRequest::Send { src, len } => d.wqe_prepare_send(index, src, len, None, 0),
            WorkRequest::SendImm { src, len, imm } => d.wqe_prepare_send(index, src, len, Some(imm), 0),
            WorkRequest::SendInline { data } => d.wqe_prepare_send_inline(index, data, None, 0)?,
            WorkRequest::WriteImm { dst, src, len, imm } => d.wqe_prepare_write_imm(index, dst, src, len, imm, 0),
        }
        Ok(())
    }
}

// ------------------------------------------------------------------------------ replays

/// A work request kept by a recording (inline bytes copied).
#[derive(Debug, Clone)]
struct OwnedRequest {
    /// The request, its inline bytes (if any) left empty: they are in `data`.
    wr: WorkRequest<'static>,
    data: Vec<u8>,
}

impl OwnedRequest {
    fn new(wr: &WorkRequest<'_>) -> OwnedRequest {
        match *wr {
            WorkRequest::PutInline { dst, data } => OwnedRequest {
                wr: WorkRequest::PutInline { dst, data: &[] },
                data: data.to_vec(),
            },
            WorkRequest::SendInline { data } => OwnedRequest {
                wr: WorkRequest::SendInline { data: &[] },
                data: data.to_vec(),
            },
            WorkRequest::Put { dst, src, len } => Self::plain(WorkRequest::Put { dst, src, len }),
            WorkRequest::Get { dst, src, len } => Self::plain(WorkRequest::Get { dst, src, len }),
            WorkRequest::Send { src, len } => Self::plain(WorkRequest::Send { src, len }),
            WorkRequest::SendImm { src, len, imm } => Self::plain(WorkRequest::SendImm { src, len, imm }),
            WorkRequest::WriteImm { dst, src, len, imm } => Self::plain(WorkRequest::WriteImm { dst, src, len, imm }),
        }
    }

    fn plain(wr: WorkRequest<'static>) -> OwnedRequest {
        OwnedRequest { wr, data: Vec::new() }
    }

    fn request(&self) -> WorkRequest<'_> {
        match self.wr {
            WorkRequest::PutInline { dst, .. } => WorkRequest::PutInline { dst, data: &self.data },
            WorkRequest::SendInline { .. } => WorkRequest::SendInline { data: &self.data },
            wr => wr,
        }
    }
}

/// A recorded step whose operations a launch recomputes from where its queue pair's WQEs land.
#[derive(Debug, Clone)]
enum Recipe {
    /// A post's stores: the caller's `before`, then the doorbell for every WQE before the
    /// recording's WQE `end` (counted from the queue pair's first recorded one).
    Doorbell { qp: usize, before: Vec<Store>, end: u64 },
    /// A wait for the completion of the queue pair's recorded WQE `offset`.
    Completion { qp: usize, offset: u64 },
}

/// What a queue pair posted into a recording, in order.
#[derive(Debug)]
struct RecordedQp {
    qpn: u32,
    wrs: Vec<OwnedRequest>,
}

/// What an executor records while it records a [`Replay`] (see there). Executors keep one
/// while recording ([`MemOps::recording`]); stream queue pairs add what a launch recomputes.
#[derive(Debug)]
pub struct Recording {
    id: u64,
    space: Space,
    /// One per store or wait call made on the executor while recording, in order: how a
    /// launch recomputes its operations (`None`: replayed as recorded).
    steps: Vec<Option<Recipe>>,
    qps: Vec<RecordedQp>,
}

impl Recording {
    fn new(space: Space) -> Recording {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Recording {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            space,
            steps: Vec::new(),
            qps: Vec::new(),
        }
    }

    /// The executor made one store or wait call: a step, replayed as recorded unless a stream
    /// queue pair describes it.
    fn push_step(&mut self) {
        self.steps.push(None);
    }

    fn describe_last(&mut self, recipe: Recipe) {
        if let Some(last) = self.steps.last_mut() {
            *last = Some(recipe);
        }
    }

    fn finish(self, graph: ReplayGraph) -> Replay {
        Replay {
            rec: self,
            graph,
            launches: 0,
        }
    }
}

/// The executor's side of a replay.
enum ReplayGraph {
    /// A CUDA graph and the batch node each step became.
    Cuda {
        graph: gdaki_cuda::CapturedGraph,
        nodes: Vec<GraphNode>,
    },
    /// A CPU stream and each step's operations.
    Cpu {
        shared: Arc<CpuShared>,
        ops: Vec<Vec<CpuOp>>,
    },
}

/// A recorded sequence of posts, waits and (on a CUDA stream) kernels and copies, launched many
/// times: what a CUDA graph is to a stream, with the queue pairs' ring positions moving on at
/// every launch (the replayable window).
///
/// Record with [`CudaStreamOps::begin_recording`] (the stream is captured into a CUDA graph) or
/// [`CpuStream::begin_recording`], post and wait through [`StreamQp`]s as usual, end the
/// recording, then [`launch`](Self::launch) it with the same queue pairs. The rules:
///
/// - **Nothing is posted while recording.** A recorded post writes no WQE: its tickets are
///   positions in the recording. Each launch reserves a queue pair's recorded WQEs anew at its
///   current position, writes them, recomputes the recorded doorbell stores and completion
///   waits for those indices (CUDA: `cuGraphExecBatchMemOpNodeSetParams` on the captured batch
///   nodes; launches already enqueued keep theirs) and launches.
/// - **A launch is a window of its own.** A queue pair's recorded WQEs must fit its send queue
///   (refused while recording otherwise), and a launch needs that many free slots: it consumes
///   the completions that are in and is refused with [`StreamError::WindowFull`] otherwise, as
///   a post is. With a send queue twice a launch's WQEs, the CPU prepares the next launch while
///   the stream runs the previous one.
/// - **Waits inside the recording only.** A recorded wait names a ticket the same recording
///   posted (they move together); waits for receives are refused (the CPU posts receives, and
///   their tickets do not move with a launch).
/// - **The queue pair's own order.** Posting to a queue pair outside a recording while it is
///   recorded ends its part in that recording (a later recorded post to it is refused).
/// - **Only recordings capture posts.** A post or wait on a CUDA stream that is being
///   captured outside a recording (someone else's capture, or joined into another stream's)
///   is refused ([`StreamError::Recording`]): that graph would replay its ring positions
///   unchanged.
///
/// ```
/// use std::time::Duration;
/// use gdaki::stream::{CpuStream, StreamQp};
/// use gdaki::{Access, Context, Provider, QpConfig};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let ctx = Context::open(Provider::Soft)?;
/// let mr = ctx.alloc_region(8192, Access::ALL)?;
/// let cq = ctx.create_cq(64)?;
/// let qp = ctx.create_qp(&cq, QpConfig { sq_size: 64, ..QpConfig::default() })?;
/// qp.connect(&qp.endpoint())?;
/// let mut stream = CpuStream::new(Duration::from_secs(10))?; // or CudaStreamOps: a CUDA graph
/// // SAFETY: the only poster of `qp`; the stream runs its work (synchronize) before `qp` goes.
/// let mut sq = unsafe { StreamQp::new(&qp, None) }?;
/// // SAFETY: the recording stores to and waits on nothing but the queue pair's own words.
/// unsafe { stream.begin_recording() }?;
/// let t = sq.put(&mut stream, mr.remote(4096), mr.local(0), 16)?; // recorded, nothing written
/// sq.wait(&mut stream, t)?;
/// let mut replay = stream.end_recording()?;
/// for step in 0..100u8 {
///     mr.write(0, &[step; 16])?;
///     let tickets = replay.launch(&mut [&mut sq])?; // this launch's WQE: ticket `step`
///     stream.synchronize()?; // the recorded wait: the put has completed
///     assert!(sq.completed(tickets[0].start)?);
///     let mut landed = [0u8; 16];
///     mr.read(4096, &mut landed)?;
///     assert_eq!(landed, [step; 16]);
/// }
/// # Ok(()) }
/// ```
pub struct Replay {
    rec: Recording,
    graph: ReplayGraph,
    launches: u64,
}

impl std::fmt::Debug for Replay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replay")
            .field("space", &self.rec.space)
            .field("steps", &self.rec.steps.len())
            .field("qps", &self.rec.qps.len())
            .field("launches", &self.launches)
            .finish()
    }
}

impl Replay {
    /// Launches the recording once, its posts going to `qps` (every queue pair that posted into
    /// the recording, in any order, and no other). Returns, for each of `qps` in order, the
    /// tickets this launch's WQEs took (the recorded tickets `t` of that queue pair are
    /// `range.start + (t - first recorded ticket)`). Whole or nothing: a queue pair without room
    /// for its recorded WQEs ([`StreamError::WindowFull`]) launches nothing.
    pub fn launch(&mut self, qps: &mut [&mut StreamQp<'_>]) -> Result<Vec<Range<Ticket>>, StreamError> {
        let space = self.rec.space;
        // Each recorded queue pair's place in `qps`.
        let mut place = Vec::with_capacity(self.rec.qps.len());
        for rq in &self.rec.qps {
            let at = qps
                .iter()
                .position(|q| q.qpn == rq.qpn)
                .ok_or_else(|| StreamError::BadRequest {
                    index: 0,
                    why: format!(
                        "QP {:#x} posted into the recording and is not given to the launch",
                        rq.qpn
                    ),
                })?;
            place.push(at);
        }
        if let Some(extra) = qps.iter().find(|q| !self.rec.qps.iter().any(|rq| rq.qpn == q.qpn)) {
            return Err(StreamError::BadRequest {
                index: 0,
                why: format!("QP {:#x} did not post into the recording", extra.qpn),
            });
        }
        for (rq, &at) in self.rec.qps.iter().zip(&place) {
            let sq = &*qps[at];
            if sq.broken {
                return Err(StreamError::Executor(
                    "an executor refused an earlier doorbell: this stream queue pair has WQEs nobody will ring".into(),
                ));
            }
            if sq.space != space {
                return Err(StreamError::WrongSpace {
                    expected: sq.space,
                    got: space,
                });
            }
            sq.make_room(rq.wrs.len() as u64)?;
        }
        // Room is made everywhere: write each queue pair's WQEs at its current position.
        let mut firsts = Vec::with_capacity(place.len());
        for (rq, &at) in self.rec.qps.iter().zip(&place) {
            let sq = &mut *qps[at];
            sq.recorded = None;
            let n = rq.wrs.len() as u64;
            let first = sq.dev.reserve(n as u32)?;
            for (k, wr) in rq.wrs.iter().enumerate() {
                sq.prepare(first + k as u64, &wr.request())?;
            }
            sq.dev.mark_ready(first, first + n)?;
            firsts.push(first);
        }
        if let Err(e) = self.set_and_launch(qps, &place, &firsts) {
            // The WQEs are written and ready; nobody will ring them.
            for &at in &place {
                qps[at].broken = true;
            }
            return Err(e);
        }
        let mut tickets = vec![0..0; qps.len()];
        for ((rq, &at), &first) in self.rec.qps.iter().zip(&place).zip(&firsts) {
            let end = first + rq.wrs.len() as u64;
            qps[at].dev.note_rung(end);
            qps[at].queued = end;
            tickets[at] = first..end;
        }
        self.launches += 1;
        Ok(tickets)
    }

    /// Launches so far.
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// Gives each recomputed step its operations for this launch, then launches.
    fn set_and_launch(
        &mut self,
        qps: &[&mut StreamQp<'_>],
        place: &[usize],
        firsts: &[u64],
    ) -> Result<(), StreamError> {
        for (i, step) in self.rec.steps.iter().enumerate() {
            let Some(recipe) = step else { continue };
            let ops: Vec<MemOp> = match recipe {
                Recipe::Doorbell { qp, before, end } => {
                    let sq = &qps[place[*qp]];
                    let mut stores = before.clone();
                    stores.extend(sq.doorbell_stores(firsts[*qp] + end));
                    stores.into_iter().map(MemOp::from).collect()
                }
                Recipe::Completion { qp, offset } => {
                    let sq = &qps[place[*qp]];
                    vec![owner_wait(sq.cqe_base, sq.cq_log_size, firsts[*qp] + offset)]
                }
            };
            match &mut self.graph {
                // SAFETY: the node of this step, captured from `stream_batch`; the stores and the
                // wait name the queue pair's doorbell record, doorbell and CQ, valid while the
                // stream's work runs (`StreamQp::new`'s contract), and the caller's stores
                // (`begin_recording`'s).
                ReplayGraph::Cuda { graph, nodes } => unsafe { graph.set_batch(nodes[i], &ops) }?,
                ReplayGraph::Cpu { ops: steps, .. } => steps[i] = ops.into_iter().map(CpuOp::Mem).collect(),
            }
        }
        match &self.graph {
            ReplayGraph::Cuda { graph, .. } => graph.launch()?,
            ReplayGraph::Cpu { shared, ops } => push_ops(shared, ops.iter().flatten().copied())?,
        }
        Ok(())
    }
}
