//! Launches of the data-path and perftest kernels, each waited for by polling its stream (see
//! [`wait_idle`](crate::stream::wait_idle)) and timed with CUDA events around the kernel alone.
use std::time::Duration;

use gdaki_layout::perf::{PingPongSide, StreamOp};

use super::kernel::{Args, Dims, ExportedQp, GpuRegion, Kernel};
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
    /// Target buffer (the source of READs; unused by SENDs, which the peer's receives place).
    pub dst: gdaki_device::Remote,
    /// Source buffer (the target of READs).
    pub src: gdaki_device::Local,
    /// Message size.
    pub len: u64,
    /// Slots in each buffer (at least one).
    pub slots: u64,
    /// Number of thread 0's first message.
    pub first: u64,
    /// Messages per thread.
    pub iters: u32,
    /// How threads take the queue pairs: consecutive runs of this many threads share one, the
    /// runs taking the QPs in turn. 0: a block's threads (block `b` posts on QP `b % qps`).
    /// A warp or block that posts as a group shares one QP, so in warp scope this is a
    /// multiple of 32 and in block scope of the block size.
    pub threads_per_qp: u32,
    /// What each message is: an RDMA WRITE, an RDMA READ from `dst` into `src`
    /// (`put_bw --read`), or a SEND taken by the peer's next receive (`put_bw --send`).
    pub op: StreamOp,
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
    /// Each side's timestamps once its put of the round had returned (doorbell rung): with
    /// `times`, what posting cost, and with the peer's, how long delivery took.
    pub posted: Vec<Vec<u64>>,
    /// GPU time of the whole kernel.
    pub elapsed: Duration,
}

/// The socket perftests' kernel, with its calls' steps `timed` or not.
fn socket_bench_kernel(timed: bool) -> &'static str {
    if timed {
        "gdaki_socket_bench"
    } else {
        "gdaki_socket_bench_untimed"
    }
}

/// What [`Gpu::run_socket_bench`] returned.
#[derive(Debug, Clone)]
pub struct SocketBenchRun {
    /// Each block's status code.
    pub status: Vec<u32>,
    /// Bytes each block moved.
    pub moved: Vec<u64>,
    /// Each block's timestamps (GPU global timer, ns).
    pub times: Vec<Vec<u64>>,
    /// GPU time of the whole kernel.
    pub elapsed: Duration,
}

/// One side of a `write_lat` ping-pong on the GPU ([`Gpu::run_write_lat`]).
#[derive(Debug, Clone, Copy)]
pub struct WriteLatSide<'a> {
    /// The side's queue pair, exported to the GPU that runs the kernel.
    pub qp: &'a dyn ExportedQp,
    /// Where its messages are sent from (at least `size` bytes; the last is the flag): the
    /// kernel writes the flag itself, so the region must be reachable by the GPU.
    pub post: &'a dyn GpuRegion,
    /// Where the peer's messages land (at least `size` bytes), polled by the kernel.
    pub poll: &'a dyn GpuRegion,
    /// The peer's poll buffer, as the peer's HCA knows it.
    pub remote: gdaki_device::Remote,
    /// This side sends first.
    pub initiator: bool,
    /// Two-sided (`write_lat --send`): the messages are SENDs, taken by receives the kernel
    /// posts into `poll` on the QP's receive queue (which it must have).
    pub send: bool,
    /// Messages of at most this many bytes travel inline in their WQE (perftest's `-I`; see
    /// `gdaki_device::perf::ping_pong`); 0: none.
    pub inline_max: u32,
    /// Each message is rung by a BlueFlame write of its WQE (`gdaki_device::Qp::blueflame`).
    pub blueflame: bool,
}

impl Gpu {
    /// Runs `gdaki_put_<scope>_<mode>` (`put_bw`'s stream, `gdaki_device::perf::put_stream`):
    /// block `b` posts on `qps[b % qps.len()]`, every thread `stream.iters` messages, then waits
    /// for its last. Each QP must be used in `launch.mode` by the blocks that map to it.
    pub fn run_put<Q: ExportedQp>(
        &self,
        qps: &[&Q],
        launch: DataPathLaunch,
        stream: &PutStream,
    ) -> Result<KernelRun, CudaError> {
        let name = format!("gdaki_put_bw_{}_{}", launch.scope.name(), launch.mode.name());
        let s = stream;
        let group = match launch.scope {
            KernelScope::Thread => 1,
            KernelScope::Warp => 32,
            KernelScope::Block => launch.block.max(1),
        };
        if s.threads_per_qp % group != 0 {
            return Err(CudaError::BadArgument {
                what: "run_put",
                why: format!(
                    "{} threads per queue pair split the {} scope's groups of {group} threads",
                    s.threads_per_qp,
                    launch.scope.name()
                ),
            });
        }
        let args = Args::new()
            .qps(qps)
            .remote(s.dst)
            .local(s.src)
            .u64(s.len)
            .u64(s.slots)
            .u64(s.first)
            .u32(s.iters)
            .u32(s.threads_per_qp)
            .u32(s.op.code());
        self.run_data_path(&name, launch, args)
    }

    /// Runs `gdaki_ops_<scope>_<mode>`: every operation once per thread, on 64 bytes per
    /// thread at `remote` and `local`. Returns every thread's status code.
    pub fn run_ops(
        &self,
        qp: &impl ExportedQp,
        launch: DataPathLaunch,
        remote: gdaki_device::Remote,
        local: gdaki_device::Local,
    ) -> Result<Vec<u32>, CudaError> {
        let name = format!("gdaki_ops_{}_{}", launch.scope.name(), launch.mode.name());
        let args = Args::new().qp(qp).remote(remote).local(local);
        Ok(self.run_data_path(&name, launch, args)?.status)
    }

    /// Runs `gdaki_write_lat`: one block per side, thread 0 of block `b` plays `sides[b]`
    /// (`gdaki_device::perf::ping_pong`) for `iters` rounds of `size` bytes; the timestamps
    /// come back in the result.
    pub fn run_write_lat(&self, sides: &[WriteLatSide<'_>], size: u64, iters: u32) -> Result<WriteLatRun, CudaError> {
        if sides.is_empty() || sides.len() > 64 {
            return Err(CudaError::BadArgument {
                what: "run_write_lat",
                why: format!("{} sides (1 to 64)", sides.len()),
            });
        }
        let ordinal = self.ordinal();
        for s in sides {
            for (what, r) in [("post", s.post), ("poll", s.poll)] {
                if r.gpu_ordinal() != Some(ordinal) || r.len() < size {
                    return Err(CudaError::BadArgument {
                        what: "run_write_lat",
                        why: format!(
                            "a side's {what} region ({} bytes{}) must hold {size} bytes in memory GPU {ordinal} reaches",
                            r.len(),
                            match r.gpu_ordinal() {
                                Some(g) => format!(", reached by GPU {g}"),
                                None => ", host memory no GPU reaches".into(),
                            }
                        ),
                    });
                }
            }
            if s.qp.gpu_ordinal() != ordinal {
                return Err(CudaError::BadArgument {
                    what: "run_write_lat",
                    why: format!("a side's QP is exported to GPU {}, not {ordinal}", s.qp.gpu_ordinal()),
                });
            }
            if s.send && s.qp.receive_handle().is_none() {
                return Err(CudaError::BadArgument {
                    what: "run_write_lat",
                    why: "a two-sided side's QP has no receive queue".into(),
                });
            }
        }
        let stream = self.ctx.default_stream();
        let per_side = iters.max(1) as usize;
        // Send timestamps of every side, then their posted timestamps.
        let times = stream.alloc_zeros::<u64>(2 * per_side * sides.len())?;
        let times_base = {
            use cudarc::driver::DevicePtr;
            times.device_ptr(&stream).0
        };
        let posted_base = times_base + (per_side * sides.len() * 8) as u64;
        let dev: Vec<PingPongSide> = sides
            .iter()
            .enumerate()
            .map(|(i, s)| PingPongSide {
                qp: s.qp.device_handle(),
                post: s.post.addr(),
                poll: s.poll.addr(),
                remote: s.remote.addr,
                lkey: s.post.lkey(),
                rkey: s.remote.rkey,
                initiator: s.initiator as u32,
                poll_lkey: s.poll.lkey(),
                times: times_base + (i * per_side * 8) as u64,
                posted: posted_base + (i * per_side * 8) as u64,
                rq: if s.send { s.qp.receive_handle().unwrap_or(0) } else { 0 },
                recv_len: s.poll.len(),
                inline_max: s.inline_max,
                flags: if s.blueflame {
                    gdaki_layout::perf::PING_PONG_BLUEFLAME
                } else {
                    0
                },
            })
            .collect();
        let sides_dev = stream.clone_htod(bytemuck::cast_slice::<PingPongSide, u8>(&dev))?;
        let mut status = stream.alloc_zeros::<u32>(sides.len())?;
        stream.memcpy_htod(&vec![u32::MAX; sides.len()], &mut status)?;
        let args = Args::new().slice(&sides_dev).u64(size).u32(iters).slice(&status);
        // SAFETY: `gdaki_write_lat(sides: *const PingPongSide, size: u64, iters: u32, status:
        // *mut u32)`: one side per block (checked above: each side's QP is exported to this
        // GPU, its buffers hold `size` bytes the GPU reaches, and `iters` timestamp slots are
        // allocated for it, and as many posted slots), one status per block.
        let elapsed = unsafe { Kernel::own(self, "gdaki_write_lat")?.run(Dims::linear(sides.len() as u32, 1), args) }?;
        let all = stream.clone_dtoh(&times)?;
        let (sent, posted) = all.split_at(per_side * sides.len());
        let per = |v: &[u64]| v.chunks(per_side).map(|c| c[..iters as usize].to_vec()).collect();
        Ok(WriteLatRun {
            status: stream.clone_dtoh(&status)?,
            times: per(sent),
            posted: per(posted),
            elapsed,
        })
    }

    /// Refuses `blocks` blocks of `threads` threads of the socket perftests' kernel (`timed`:
    /// see [`run_socket_bench`](Self::run_socket_bench)) that this GPU cannot hold all at once
    /// beside the soft HCA's copier (see `Kernel::check_resident`): for
    /// launches whose blocks must run together, such as a stream's sender and receiver in one
    /// launch (the sender waits for the receiver's credits) or streams measured side by side.
    /// Blocks that need not (an echo server's, each serving its own client) may outnumber
    /// the SMs: the later ones start as earlier ones finish.
    pub fn socket_blocks_fit(&self, blocks: usize, threads: u32, timed: bool) -> Result<(), CudaError> {
        Kernel::own(self, socket_bench_kernel(timed))?
            .check_resident(u32::try_from(blocks).unwrap_or(u32::MAX), threads)
    }

    /// Runs the socket perftests' kernel, `gdaki_socket_bench` where the calls' steps are
    /// `timed` (their sums follow each role's stamps), else `gdaki_socket_bench_untimed` (those
    /// words stay zero; the calls run as an application's, without the timing's cost): block
    /// `b`, `threads` threads together, runs role code
    /// `roles[b]` (`gdaki_device::socket::BenchRole`) on the socket whose device handle is
    /// `sockets[b]`, `iters` messages of `size` bytes through a buffer of `buf_len` bytes in GPU
    /// memory, with `timestamps` timestamps per block; waits for every block.
    ///
    /// # Safety
    /// Each handle is a socket exported to this GPU (`gdaki::socket::GpuSocket`), alive until
    /// this returns and used by nothing else meanwhile; `timestamps` at least what each role
    /// records, `buf_len` at least `size`.
    #[allow(clippy::too_many_arguments)] // the benchmark's parameters, each a scalar or a list
    pub unsafe fn run_socket_bench(
        &self,
        sockets: &[u64],
        roles: &[u32],
        size: u64,
        iters: u32,
        threads: u32,
        buf_len: usize,
        timestamps: usize,
        timed: bool,
    ) -> Result<SocketBenchRun, CudaError> {
        if sockets.is_empty()
            || roles.len() != sockets.len()
            || !(1..=1024).contains(&threads)
            || (buf_len as u64) < size
        {
            return Err(CudaError::BadArgument {
                what: "run_socket_bench",
                why: format!(
                    "{} sockets, {} roles, {threads} threads a block, {buf_len}-byte buffers for {size}-byte messages",
                    sockets.len(),
                    roles.len()
                ),
            });
        }
        let n = sockets.len();
        let stream = self.ctx.default_stream();
        let handles = stream.clone_htod(sockets)?;
        let role_codes = stream.clone_htod(roles)?;
        let bufs = stream.alloc_zeros::<u8>(n * buf_len.max(1))?;
        let times = stream.alloc_zeros::<u64>(n * timestamps.max(1))?;
        let scratch = stream.alloc_zeros::<u8>(gdaki_device::scope::BLOCK_SCRATCH_BYTES * n)?;
        let mut status = stream.alloc_zeros::<u32>(n)?;
        stream.memcpy_htod(&vec![u32::MAX; n], &mut status)?;
        let moved = stream.alloc_zeros::<u64>(n)?;
        let args = Args::new()
            .slice(&handles)
            .slice(&role_codes)
            .u64(size)
            .u32(iters)
            .slice(&bufs)
            .u64(buf_len as u64)
            .slice(&times)
            .u64(timestamps.max(1) as u64)
            .slice(&scratch)
            .slice(&status)
            .slice(&moved);
        // SAFETY: `gdaki_socket_bench[_untimed](sockets, roles, size, iters, bufs, buf_len,
        // times, times_per_block, scratch, status, moved)`, one block per socket: the handles
        // are exported sockets this launch alone uses (the caller's contract), every other area
        // allocated above with one entry (or `timestamps`, or `buf_len` bytes) per block.
        let kernel = Kernel::own(self, socket_bench_kernel(timed))?;
        let elapsed = unsafe { kernel.run(Dims::linear(n as u32, threads), args) }?;
        let all = stream.clone_dtoh(&times)?;
        Ok(SocketBenchRun {
            status: stream.clone_dtoh(&status)?,
            moved: stream.clone_dtoh(&moved)?,
            times: all.chunks(timestamps.max(1)).map(<[u64]>::to_vec).collect(),
            elapsed,
        })
    }

    /// Runs a data-path kernel: its own `args`, then a scratch area per block and a status
    /// word per thread, which come back in the result.
    pub(super) fn run_data_path(
        &self,
        name: &str,
        launch: DataPathLaunch,
        args: Args<'_>,
    ) -> Result<KernelRun, CudaError> {
        // SAFETY: gdaki's own data-path kernels take exactly that parameter list.
        unsafe { self.run_data_path_kernel(&Kernel::own(self, name)?, launch, args) }
    }

    /// [`run_data_path`](Self::run_data_path) with a kernel of any module.
    ///
    /// # Safety
    /// `kernel` takes `args`, then `scratch: *mut BlockScratch` (one per block) and
    /// `status: *mut u32` (one per thread), and touches nothing else.
    pub(super) unsafe fn run_data_path_kernel(
        &self,
        kernel: &Kernel<'_>,
        launch: DataPathLaunch,
        args: Args<'_>,
    ) -> Result<KernelRun, CudaError> {
        let stream = self.ctx.default_stream();
        let threads = launch.threads().max(1);
        let mut status = stream.alloc_zeros::<u32>(threads)?;
        // Marks threads that never wrote a status.
        stream.memcpy_htod(&vec![u32::MAX; threads], &mut status)?;
        let scratch_bytes = gdaki_device::scope::BLOCK_SCRATCH_BYTES * launch.grid.max(1) as usize;
        let scratch = stream.alloc_zeros::<u8>(scratch_bytes)?;
        let args = args.slice(&scratch).slice(&status);
        // SAFETY: the kernel takes the caller's arguments (typed: the QPs are exported to this
        // GPU and borrowed until the kernel is done), then `scratch: *mut BlockScratch` (one
        // per block) and `status: *mut u32` (one per thread), allocated above (the contract).
        let elapsed = unsafe { kernel.run(Dims::linear(launch.grid, launch.block), args) }?;
        Ok(KernelRun {
            status: stream.clone_dtoh(&status)?,
            elapsed,
        })
    }
}
