//! Waiting for a stream without blocking in the driver, and timing a launch with events.
use std::time::Duration;

use cudarc::driver::sys;
use cudarc::driver::CudaStream;

use crate::CudaError;

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
    let mut pause = Duration::from_micros(5);
    loop {
        // SAFETY: a query of a live stream of the bound context.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_micros(200));
            }
            other => {
                other.result()?; // an error: returned here
                return Ok(());
            }
        }
    }
}
