//! Waiting for a stream without blocking in the driver, timing a launch with events, and the
//! stream memory operations stream-triggered posting enqueues (`cuStreamWriteValue*`,
//! `cuStreamWaitValue32`).
use std::time::Duration;

use cudarc::driver::sys;
use cudarc::driver::CudaStream;

use crate::{CudaError, Gpu};

/// Runs `launch` between two timing events on `stream`, waits for it (polling) and returns the
/// GPU time between the events.
pub(crate) fn timed(
    stream: &CudaStream,
    launch: impl FnOnce() -> Result<(), cudarc::driver::DriverError>,
) -> Result<Duration, CudaError> {
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags)?;
    launch()?;
    let end = stream.record_event(flags)?;
    wait_idle(stream)?;
    let ms = start.elapsed_ms(&end)?;
    Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
}

/// Waits for `stream`'s work by polling it rather than in a blocking driver call: a thread
/// blocked in a synchronous copy behind a running kernel can stall other threads' driver calls
/// (seen on the H100 with driver 580), and the kernel may be waiting for one of them.
pub(crate) fn wait_idle(stream: &CudaStream) -> Result<(), CudaError> {
    poll_idle(stream, None).map(|_| ())
}

/// Runs `work` on a stream of its own, created non-blocking (so it waits for no kernel of the
/// application's, as the legacy stream would: a kernel may be waiting for this very work), and
/// waits for it by polling; the stream is gone when this returns. For the library's own small
/// copies and fills of device memory, which may run while application kernels do.
pub(crate) fn on_private_stream(work: impl FnOnce(sys::CUstream) -> sys::CUresult) -> Result<(), CudaError> {
    let mut stream: sys::CUstream = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the caller bound the context.
    unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }.result()?;
    let done = work(stream)
        .result()
        .map_err(CudaError::from)
        .and_then(|()| poll_raw(stream, None).map(|_| ()));
    // SAFETY: created above; its work is done (or failed to be queued).
    let _ = unsafe { sys::cuStreamDestroy_v2(stream) };
    done
}

/// Polls `stream` until its work is done (`true`) or `deadline` passes (`false`), pausing a
/// little longer each time, up to 200 us.
fn poll_idle(stream: &CudaStream, deadline: Option<std::time::Instant>) -> Result<bool, CudaError> {
    poll_raw(stream.cu_stream(), deadline)
}

/// [`poll_idle`] of a raw stream of the bound context.
fn poll_raw(stream: sys::CUstream, deadline: Option<std::time::Instant>) -> Result<bool, CudaError> {
    let mut pause = Duration::from_micros(5);
    loop {
        // SAFETY: a query of a live stream of the bound context.
        match unsafe { sys::cuStreamQuery(stream) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => {
                if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                    return Ok(false);
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_micros(200));
            }
            other => {
                other.result()?; // an error: returned here
                return Ok(true);
            }
        }
    }
}

/// How a stream wait compares the 32-bit word it watches with its value (CUDA's
/// `CU_STREAM_WAIT_VALUE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamWait {
    /// `(int32_t)(*addr - value) >= 0`: at or after `value` in wrapping order.
    Geq,
    /// `*addr == value`.
    Eq,
    /// `(*addr & value) != 0`.
    And,
    /// `~(*addr | value) != 0`: some bit outside `value` is clear.
    Nor,
}

impl StreamWait {
    /// Whether `word` satisfies this comparison against `value`, as CUDA's stream waits
    /// define it.
    pub fn holds(self, value: u32, word: u32) -> bool {
        match self {
            StreamWait::Geq => word.wrapping_sub(value) as i32 >= 0,
            StreamWait::Eq => word == value,
            StreamWait::And => word & value != 0,
            StreamWait::Nor => !(word | value) != 0,
        }
    }
}

/// Whether `gpu`'s driver takes the stream memory operations stream-triggered posting uses:
/// 32- and 64-bit writes and 32-bit waits, the NOR wait among them. Refused with the reason.
pub fn stream_memops_supported(gpu: &Gpu) -> Result<(), CudaError> {
    match stream_memops_missing(gpu.context())? {
        None => Ok(()),
        Some(what) => Err(CudaError::BadArgument {
            what: "stream memory operations",
            why: format!("this GPU's driver does not offer {what}"),
        }),
    }
}

/// The stream memory operation `ctx`'s GPU lacks that stream-triggered posting needs, if any.
pub(crate) fn stream_memops_missing(ctx: &cudarc::driver::CudaContext) -> Result<Option<&'static str>, CudaError> {
    use sys::CUdevice_attribute as Attr;
    for (attr, what) in [
        (
            Attr::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
            "64-bit stream memory operations (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)",
        ),
        (
            Attr::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR,
            "NOR stream waits (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR)",
        ),
    ] {
        if ctx.attribute(attr)? == 0 {
            return Ok(Some(what));
        }
    }
    Ok(None)
}

/// Enqueues a 32-bit store of `value` at device address `addr` on `stream`, after the
/// stream's earlier work (whose writes it follows: the default memory barrier).
///
/// # Safety
/// `addr` is a 4-byte-aligned device address of `stream`'s context, valid for that store when
/// the stream reaches it, and nothing relies on the word holding anything else.
pub unsafe fn stream_write_u32(stream: &CudaStream, addr: u64, value: u32) -> Result<(), CudaError> {
    stream.context().bind_to_thread()?;
    // SAFETY: per the caller's contract; the stream is live.
    unsafe { sys::cuStreamWriteValue32_v2(stream.cu_stream(), addr, value, 0) }.result()?;
    Ok(())
}

/// Enqueues a 64-bit store, as [`stream_write_u32`] does a 32-bit one.
///
/// # Safety
/// As [`stream_write_u32`], for an 8-byte-aligned word.
pub unsafe fn stream_write_u64(stream: &CudaStream, addr: u64, value: u64) -> Result<(), CudaError> {
    stream.context().bind_to_thread()?;
    // SAFETY: per the caller's contract; the stream is live.
    unsafe { sys::cuStreamWriteValue64_v2(stream.cu_stream(), addr, value, 0) }.result()?;
    Ok(())
}

/// Enqueues a wait on `stream` until the 32-bit word at `addr` satisfies `how` against
/// `value`; the stream's later work starts after it. There is no time bound: the caller bounds
/// it (a wait whose condition is never met holds the stream).
///
/// # Safety
/// `addr` is a 4-byte-aligned device address of `stream`'s context, valid for reads until the
/// wait is over.
pub unsafe fn stream_wait_u32(stream: &CudaStream, addr: u64, how: StreamWait, value: u32) -> Result<(), CudaError> {
    use sys::CUstreamWaitValue_flags_enum as F;
    let flags = match how {
        StreamWait::Geq => F::CU_STREAM_WAIT_VALUE_GEQ,
        StreamWait::Eq => F::CU_STREAM_WAIT_VALUE_EQ,
        StreamWait::And => F::CU_STREAM_WAIT_VALUE_AND,
        StreamWait::Nor => F::CU_STREAM_WAIT_VALUE_NOR,
    } as u32;
    stream.context().bind_to_thread()?;
    // SAFETY: per the caller's contract; the stream is live.
    unsafe { sys::cuStreamWaitValue32_v2(stream.cu_stream(), addr, value, flags) }.result()?;
    Ok(())
}

/// One stream memory operation of a batch ([`stream_batch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemOp {
    /// A 32-bit store (`CU_STREAM_MEM_OP_WRITE_VALUE_32`).
    WriteU32 {
        /// A 4-byte-aligned device address.
        addr: u64,
        /// What is stored.
        value: u32,
    },
    /// A 64-bit store (`CU_STREAM_MEM_OP_WRITE_VALUE_64`).
    WriteU64 {
        /// An 8-byte-aligned device address.
        addr: u64,
        /// What is stored.
        value: u64,
    },
    /// A wait on a 32-bit word (`CU_STREAM_MEM_OP_WAIT_VALUE_32`).
    WaitU32 {
        /// A 4-byte-aligned device address.
        addr: u64,
        /// The comparison.
        how: StreamWait,
        /// Compared with the word.
        value: u32,
    },
}

/// The most operations one `cuStreamBatchMemOp` takes (the driver's limit).
pub const MAX_BATCH: usize = 256;

fn batch_params(ops: &[MemOp]) -> Vec<sys::CUstreamBatchMemOpParams> {
    use sys::CUstreamBatchMemOpType as T;
    use sys::CUstreamWaitValue_flags_enum as F;
    ops.iter()
        .map(|op| {
            // SAFETY: an all-zero parameter union is valid (plain integers and addresses).
            let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
            match *op {
                MemOp::WriteU32 { addr, value } => {
                    p.writeValue.operation = T::CU_STREAM_MEM_OP_WRITE_VALUE_32;
                    p.writeValue.address = addr;
                    p.writeValue.__bindgen_anon_1.value = value;
                }
                MemOp::WriteU64 { addr, value } => {
                    p.writeValue.operation = T::CU_STREAM_MEM_OP_WRITE_VALUE_64;
                    p.writeValue.address = addr;
                    p.writeValue.__bindgen_anon_1.value64 = value;
                }
                MemOp::WaitU32 { addr, how, value } => {
                    p.waitValue.operation = T::CU_STREAM_MEM_OP_WAIT_VALUE_32;
                    p.waitValue.address = addr;
                    p.waitValue.__bindgen_anon_1.value = value;
                    p.waitValue.flags = match how {
                        StreamWait::Geq => F::CU_STREAM_WAIT_VALUE_GEQ,
                        StreamWait::Eq => F::CU_STREAM_WAIT_VALUE_EQ,
                        StreamWait::And => F::CU_STREAM_WAIT_VALUE_AND,
                        StreamWait::Nor => F::CU_STREAM_WAIT_VALUE_NOR,
                    } as u32;
                }
            }
            p
        })
        .collect()
}

fn batch_size(ops: &[MemOp]) -> Result<u32, CudaError> {
    if ops.is_empty() || ops.len() > MAX_BATCH {
        return Err(CudaError::BadArgument {
            what: "a batch of stream memory operations",
            why: format!("{} operations: 1 to {MAX_BATCH}", ops.len()),
        });
    }
    Ok(ops.len() as u32)
}

/// Enqueues `ops` on `stream` as one `cuStreamBatchMemOp`, run in order after the stream's
/// earlier work (one submission where [`stream_write_u32`] and friends make one each; captured
/// into a graph, one node). 1 to [`MAX_BATCH`] operations.
///
/// # Safety
/// Every store's address is as [`stream_write_u32`] requires (aligned, valid when the stream
/// reaches it), every wait's as [`stream_wait_u32`] requires.
pub unsafe fn stream_batch(stream: &CudaStream, ops: &[MemOp]) -> Result<(), CudaError> {
    let count = batch_size(ops)?;
    let mut params = batch_params(ops);
    stream.context().bind_to_thread()?;
    // SAFETY: per the caller's contract; `params` holds `count` initialised entries, which the
    // driver copies before returning; the stream is live.
    unsafe { sys::cuStreamBatchMemOp_v2(stream.cu_stream(), count, params.as_mut_ptr(), 0) }.result()?;
    Ok(())
}

/// A node of a graph being captured from a stream (the one [`captured_node`] found).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphNode(usize);

/// The node the work just enqueued on `stream` became, while `stream` is being captured: the
/// capture's only dependency. Refused when the stream is not capturing or its next work would
/// depend on several nodes (work joined from other streams since).
pub fn captured_node(stream: &CudaStream) -> Result<GraphNode, CudaError> {
    stream.context().bind_to_thread()?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut n = 0usize;
    // SAFETY: a query of a live stream into locals.
    unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream.cu_stream(),
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            &mut edges,
            &mut n,
        )
    }
    .result()?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || n != 1 || deps.is_null() {
        return Err(CudaError::BadArgument {
            what: "the node of a captured stream memory operation",
            why: format!(
                "the stream's capture is {status:?} with {n} dependencies (expected an active capture and one)"
            ),
        });
    }
    // SAFETY: the driver returned one valid entry, alive while the capture is.
    Ok(GraphNode(unsafe { *deps } as usize))
}

/// Starts capturing `stream` into a graph (thread-local mode: this thread's calls that are
/// unsafe during a capture are refused, other threads go on as before), for [`end_capture`].
pub fn begin_capture(stream: &CudaStream) -> Result<(), CudaError> {
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    Ok(())
}

/// Whether `stream` is being captured into a graph now (by anyone: its own capture, or work
/// joined into another stream's).
pub fn stream_capturing(stream: &CudaStream) -> Result<bool, CudaError> {
    Ok(stream.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// A graph captured from a stream and instantiated, launched on that stream.
pub struct CapturedGraph {
    graph: cudarc::driver::CudaGraph,
    stream: std::sync::Arc<CudaStream>,
}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedGraph").finish_non_exhaustive()
    }
}

/// Ends the capture [`begin_capture`] started and instantiates the graph. Refused for a
/// capture that captured nothing.
pub fn end_capture(stream: &std::sync::Arc<CudaStream>) -> Result<CapturedGraph, CudaError> {
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))?
        .ok_or(CudaError::BadArgument {
            what: "a captured graph",
            why: "the capture holds no work".into(),
        })?;
    Ok(CapturedGraph {
        graph,
        stream: stream.clone(),
    })
}

impl CapturedGraph {
    /// Enqueues one run of the graph on the stream it was captured from.
    pub fn launch(&self) -> Result<(), CudaError> {
        self.graph.launch()?;
        Ok(())
    }

    /// The stream it was captured from, which it runs on.
    pub fn stream(&self) -> &std::sync::Arc<CudaStream> {
        &self.stream
    }

    /// Gives `node` (a batch node captured from [`stream_batch`] into this graph) the
    /// operations `ops` for the launches from now on: launches already enqueued keep the old
    /// ones. Same count as captured.
    ///
    /// # Safety
    /// `node` was captured into this graph, and `ops` meet [`stream_batch`]'s contract for
    /// every launch from now on.
    pub unsafe fn set_batch(&self, node: GraphNode, ops: &[MemOp]) -> Result<(), CudaError> {
        let count = batch_size(ops)?;
        let mut params = batch_params(ops);
        let ctx = self.stream.context();
        ctx.bind_to_thread()?;
        let node_params = sys::CUDA_BATCH_MEM_OP_NODE_PARAMS {
            ctx: ctx.cu_ctx(),
            count,
            paramArray: params.as_mut_ptr(),
            flags: 0,
        };
        // SAFETY: per the caller's contract; the driver copies `params` before returning.
        unsafe {
            sys::cuGraphExecBatchMemOpNodeSetParams(
                self.graph.cu_graph_exec(),
                node.0 as sys::CUgraphNode,
                &node_params,
            )
        }
        .result()?;
        Ok(())
    }
}

/// Records a timing event on `stream` now: where the stream is when it gets there
/// (`cuEventElapsedTime` between two of them), as `write_lat --stream` marks arrivals.
pub fn record_event(stream: &CudaStream) -> Result<cudarc::driver::CudaEvent, CudaError> {
    Ok(stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Waits for `stream`'s work, polling it rather than blocking in the driver, for at most
/// `timeout`: whether it finished (a stream waiting on a word nobody writes never does).
pub fn stream_idle_within(stream: &CudaStream, timeout: Duration) -> Result<bool, CudaError> {
    poll_idle(stream, std::time::Instant::now().checked_add(timeout))
}
