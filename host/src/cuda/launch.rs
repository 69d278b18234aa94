//! Launches of the data-path and perftest kernels, each waited for by polling its stream (see
//! [`wait_idle`]) and timed with CUDA events around the kernel alone.
use std::time::Duration;

use cudarc::driver::sys;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use gdaki_layout::perf::PingPongSide;

use super::{CudaError, Gpu};

/// The execution scope of a kernel instantiation (`gdaki_<kernel>_<scope>_<mode>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelScope {
    /// Every thread posts on its own.
    Thread,
    /// Each warp posts as a group (one reservation, one doorbell).
    Warp,
    /// Each block posts as a group.
    Block,
}

/// The sharing mode of a kernel instantiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelMode {
    /// One thread, warp or block owns the QP.
    Exclusive,
    /// The QP is shared within one block.
    Cta,
    /// The QP is shared across the grid.
    Gpu,
}

impl KernelScope {
    /// The name in kernel instantiations (`thread`, `warp`, `block`).
    pub fn name(self) -> &'static str {
        match self {
            KernelScope::Thread => "thread",
            KernelScope::Warp => "warp",
            KernelScope::Block => "block",
        }
    }
}

impl KernelMode {
    /// The name in kernel instantiations (`exclusive`, `cta`, `gpu`).
    pub fn name(self) -> &'static str {
        match self {
            KernelMode::Exclusive => "exclusive",
            KernelMode::Cta => "cta",
            KernelMode::Gpu => "gpu",
        }
    }
}

/// A launch of one of the data-path kernels.
#[derive(Debug, Clone, Copy)]
pub struct DataPathLaunch {
    /// Scope of the instantiation.
    pub scope: KernelScope,
    /// Sharing mode of the instantiation.
    pub mode: KernelMode,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
}

impl DataPathLaunch {
    fn threads(&self) -> usize {
        self.grid as usize * self.block as usize
    }
}

/// What a put kernel posts: thread `t` of the grid puts `iters` messages of `len` bytes,
/// numbered `first + t + k * threads`; message `m` goes from slot `m % slots` of `src` to the
/// same slot of `dst` (slots `len` bytes apart).
#[derive(Debug, Clone, Copy)]
pub struct PutStream {
    /// Target buffer.
    pub dst: gdaki_device::Remote,
    /// Source buffer.
    pub src: gdaki_device::Local,
    /// Message size.
    pub len: u64,
    /// Slots in each buffer (at least one).
    pub slots: u64,
    /// Number of thread 0's first message.
    pub first: u64,
    /// Messages per thread.
    pub iters: u32,
}

/// What a data-path kernel launch returned.
#[derive(Debug, Clone)]
pub struct KernelRun {
    /// Every thread's status code (`gdaki_device::status`; `u32::MAX`: never written).
    pub status: Vec<u32>,
    /// GPU time of the kernel alone (CUDA events recorded around it, launch latency excluded).
    pub elapsed: Duration,
}

impl KernelRun {
    /// The first thread whose status is not OK, with its code.
    pub fn first_failure(&self) -> Option<(usize, u32)> {
        self.status
            .iter()
            .enumerate()
            .find(|(_, c)| **c != gdaki_device::status::CODE_OK)
            .map(|(i, c)| (i, *c))
    }
}

/// What [`Gpu::run_write_lat`] returned.
#[derive(Debug, Clone)]
pub struct WriteLatRun {
    /// Each side's status code (thread 0 of its block).
    pub status: Vec<u32>,
    /// Each side's send timestamps (GPU global timer, ns), one per round.
    pub times: Vec<Vec<u64>>,
    /// GPU time of the whole kernel.
    pub elapsed: Duration,
}

impl Gpu {
    /// Runs `gdaki_put_<scope>_<mode>` (`put_bw`'s stream, `gdaki_device::perf::put_stream`):
    /// block `b` posts on the exported QP handle `qps[b % qps.len()]` (device addresses), every
    /// thread `stream.iters` messages, then waits for its last. Each handle must be used in
    /// `launch.mode` by the blocks that map to it.
    pub fn run_put(&self, qps: &[u64], launch: DataPathLaunch, stream: &PutStream) -> Result<KernelRun, CudaError> {
        if qps.is_empty() || qps.len() > u32::MAX as usize {
            return Err(CudaError::BadArgument {
                what: "run_put",
                why: format!("{} QP handles (at least one)", qps.len()),
            });
        }
        let name = format!("gdaki_put_{}_{}", launch.scope.name(), launch.mode.name());
        let handles = self.ctx.default_stream().clone_htod(qps)?;
        use Arg::{Ptr, U32, U64};
        let s = stream;
        self.run_data_path(
            &name,
            launch,
            &[
                Ptr(&handles),
                U32(qps.len() as u32),
                U64(s.dst.addr),
                U32(s.dst.rkey),
                U64(s.src.addr),
                U32(s.src.lkey),
                U64(s.len),
                U64(s.slots),
                U64(s.first),
                U32(s.iters),
            ],
        )
    }

    /// Runs `gdaki_ops_<scope>_<mode>`: every operation once per thread, on 64 bytes per
    /// thread at `remote` and `local`. Returns every thread's status code.
    pub fn run_ops(
        &self,
        qp: u64,
        launch: DataPathLaunch,
        remote: gdaki_device::Remote,
        local: gdaki_device::Local,
    ) -> Result<Vec<u32>, CudaError> {
        let name = format!("gdaki_ops_{}_{}", launch.scope.name(), launch.mode.name());
        use Arg::{U32, U64};
        let run = self.run_data_path(
            &name,
            launch,
            &[
                U64(qp),
                U64(remote.addr),
                U32(remote.rkey),
                U64(local.addr),
                U32(local.lkey),
            ],
        )?;
        Ok(run.status)
    }

    /// Runs `gdaki_write_lat`: one block per side, thread 0 of block `b` plays `sides[b]`
    /// (`gdaki_device::perf::ping_pong`) for `iters` rounds of `size` bytes. The sides'
    /// `times` fields are ignored: timestamps go to device memory and come back in the result.
    pub fn run_write_lat(&self, sides: &[PingPongSide], size: u64, iters: u32) -> Result<WriteLatRun, CudaError> {
        if sides.is_empty() || sides.len() > 64 {
            return Err(CudaError::BadArgument {
                what: "run_write_lat",
                why: format!("{} sides (1 to 64)", sides.len()),
            });
        }
        let function = self.module.load_function("gdaki_write_lat")?;
        let stream = self.ctx.default_stream();
        let per_side = iters.max(1) as usize;
        let times = stream.alloc_zeros::<u64>(per_side * sides.len())?;
        let mut with_times = sides.to_vec();
        {
            use cudarc::driver::DevicePtr;
            let (base, _sync) = times.device_ptr(&stream);
            for (i, s) in with_times.iter_mut().enumerate() {
                s.times = base + (i * per_side * 8) as u64;
            }
        }
        let sides_dev = stream.clone_htod(bytemuck::cast_slice::<PingPongSide, u8>(&with_times))?;
        let mut status = stream.alloc_zeros::<u32>(sides.len())?;
        stream.memcpy_htod(&vec![u32::MAX; sides.len()], &mut status)?;
        let mut b = stream.launch_builder(&function);
        b.arg(&sides_dev).arg(&size).arg(&iters).arg(&mut status);
        let config = LaunchConfig {
            grid_dim: (sides.len() as u32, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `gdaki_write_lat(sides: *const PingPongSide, size: u64, iters: u32, status:
        // *mut u32)`: one side per block (copied above, each with `iters` timestamp slots),
        // one status per thread (one thread per block). The sides' QPs and buffers are the
        // caller's, exported for this GPU.
        let elapsed = timed(&stream, || unsafe { b.launch(config) }.map(|_| ()))?;
        let all = stream.clone_dtoh(&times)?;
        Ok(WriteLatRun {
            status: stream.clone_dtoh(&status)?,
            times: all.chunks(per_side).map(|c| c[..iters as usize].to_vec()).collect(),
            elapsed,
        })
    }

    pub(super) fn run_data_path(
        &self,
        name: &str,
        launch: DataPathLaunch,
        args: &[Arg],
    ) -> Result<KernelRun, CudaError> {
        let function = self.module.load_function(name)?;
        let stream = self.ctx.default_stream();
        let threads = launch.threads().max(1);
        let mut status = stream.alloc_zeros::<u32>(threads)?;
        // Marks threads that never wrote a status.
        stream.memcpy_htod(&vec![u32::MAX; threads], &mut status)?;
        let scratch_bytes = gdaki_device::scope::BLOCK_SCRATCH_BYTES * launch.grid.max(1) as usize;
        let mut scratch = stream.alloc_zeros::<u8>(scratch_bytes)?;
        let mut b = stream.launch_builder(&function);
        for a in args {
            match a {
                Arg::U64(v) => b.arg(v),
                Arg::U32(v) => b.arg(v),
                Arg::Ptr(v) => b.arg(*v),
            };
        }
        b.arg(&mut scratch).arg(&mut status);
        let config = LaunchConfig {
            grid_dim: (launch.grid, 1, 1),
            block_dim: (launch.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every data-path kernel takes its own arguments (pushed by `args`), then
        // `scratch: *mut BlockScratch` (one per block, allocated above) and `status: *mut u32`
        // (one per thread, above). The QP handles and buffers are the caller's, exported for
        // this GPU.
        let elapsed = timed(&stream, || unsafe { b.launch(config) }.map(|_| ()))?;
        Ok(KernelRun {
            status: stream.clone_dtoh(&status)?,
            elapsed,
        })
    }
}

/// Runs `launch` between two timing events on `stream`, waits for it (polling) and returns the
/// GPU time between the events.
pub(super) fn timed(
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
pub(super) fn wait_idle(stream: &CudaStream) -> Result<(), CudaError> {
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

/// A kernel argument.
pub(super) enum Arg<'a> {
    U64(u64),
    U32(u32),
    /// Device memory (its address is pushed).
    Ptr(&'a cudarc::driver::CudaSlice<u64>),
}
