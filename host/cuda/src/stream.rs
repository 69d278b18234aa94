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

/// Polls `stream` until its work is done (`true`) or `deadline` passes (`false`), pausing a
/// little longer each time, up to 200 us.
fn poll_idle(stream: &CudaStream, deadline: Option<std::time::Instant>) -> Result<bool, CudaError> {
    let mut pause = Duration::from_micros(5);
    loop {
        // SAFETY: a query of a live stream of the bound context.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
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
