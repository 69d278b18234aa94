//! The device posting-rate benchmark: GPU kernels post 8-byte puts into standalone send queues
//! that no HCA consumes (each ring holds every WQE a run posts), in host-pinned memory (the
//! soft HCA's placement) or device memory (the mlx5 placement), with a host-pinned stand-in
//! for each doorbell record and doorbell. The reference is a plain store loop writing the same
//! number of records (the 48 bytes of an 8-byte put's WQE in each 64-byte slot) into the same
//! memory, timed the same way.
use std::time::Duration;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use gdaki_layout::{DevCq, DevQp, DoorbellKind, SEND_WQE_BB};

use super::kernel::Args;
use super::{CudaError, DataPathLaunch, DeviceBuffer, Gpu, HostMapping};
use crate::stream::timed;
use crate::HostBuffer;

/// Where the rings live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RingPlacement {
    /// Host memory mapped into the GPU: WQE stores cross PCIe; doorbells fence at system scope.
    HostPinned,
    /// GPU memory, with the doorbell record beside the ring: doorbells fence at GPU scope
    /// (`QP_RINGS_IN_GPU_MEMORY`), as a NIC reading the rings peer-to-peer allows.
    Device,
    /// As `Device`, but fenced at system scope as if the rings were in host memory: the
    /// reference that shows what the GPU scope gains.
    DeviceSystemFences,
}

/// Which code posts: gdaki's Rust kernels ([`PostingKernels::GDAKI`]), or the same kernels
/// written elsewhere, e.g. CUDA C++ calling `gdaki_device.h`, linked with
/// [`Gpu::link_module`] ([`PostingKernels::module`]).
#[derive(Debug, Clone, Copy)]
pub struct PostingKernels<'a>(Option<&'a super::Module>);

impl<'a> PostingKernels<'a> {
    /// gdaki's own (Rust) kernels.
    pub const GDAKI: PostingKernels<'static> = PostingKernels(None);

    /// The posting kernels of `module`.
    ///
    /// # Safety
    /// Each kernel is named as gdaki's are (`gdaki_post_rate_<scope>_<mode>`), takes the same
    /// parameters (`qps: *const u64, nqp: u32, stride: u32, iters: u32, commit_every: u32,
    /// scratch: *mut gdaki_block_scratch` (one per block), `status: *mut u32` (one per
    /// thread)), and touches only the queue pairs in `qps` (posting 8-byte puts as
    /// `perf::post_only` does), its block's scratch and its thread's status.
    pub unsafe fn module(module: &'a super::Module) -> PostingKernels<'a> {
        PostingKernels(Some(module))
    }
}

/// How a posting-rate run spreads its posts (see [`Gpu::posting_rate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostingShape {
    /// Queue pairs.
    pub qps: u32,
    /// Consecutive threads sharing a queue pair.
    pub stride: u32,
    /// Puts per thread.
    pub per_thread: u32,
    /// Puts per doorbell (1: every post rings).
    pub commit_every: u32,
}

/// What one posting-rate run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PostingRun {
    /// WQEs posted (and records the reference stored).
    pub wqes: u64,
    /// GPU time of the posting kernel.
    pub post: Duration,
    /// GPU time of the store loop (records scattered over the memory).
    pub store: Duration,
    /// GPU time of the same stores in ring order, where the posts put their WQEs.
    pub ring_store: Duration,
}

/// Memory of either placement, freed on drop (a pinned buffer after its mapping: field order).
enum Rings {
    Pinned(HostMapping, #[allow(dead_code)] HostBuffer),
    Device(DeviceBuffer),
}

impl Rings {
    fn addr(&self) -> u64 {
        match self {
            Rings::Pinned(m, _) => m.device_addr(0),
            Rings::Device(d) => d.device_addr(),
        }
    }
}

fn bad(why: String) -> CudaError {
    CudaError::BadArgument {
        what: "posting_rate",
        why,
    }
}

impl Gpu {
    /// With `kernels`' posting kernel, posts `per_thread` 8-byte puts from every thread of
    /// `launch` (thread `t` on QP `(t / stride) % qps`, each QP used in `launch.mode` by the
    /// threads that map to it), then runs the store-loop reference over the same memory;
    /// returns both GPU times. With `commit_every` above 1 the puts are deferred and each
    /// thread commits every `commit_every` puts (one doorbell for that many posts), else every
    /// post rings.
    pub fn posting_rate(
        &self,
        kernels: PostingKernels<'_>,
        placement: RingPlacement,
        launch: DataPathLaunch,
        shape: PostingShape,
    ) -> Result<PostingRun, CudaError> {
        let PostingShape {
            qps,
            stride,
            per_thread,
            commit_every,
        } = shape;
        let threads = launch.grid as u64 * launch.block as u64;
        if qps == 0 || stride == 0 || per_thread == 0 || threads == 0 {
            return Err(bad("QPs, stride, iterations and threads must be at least 1".into()));
        }
        // The busiest QP's WQEs, rounded up to a power of two, is every ring's size.
        let mut per_qp = vec![0u64; qps as usize];
        for t in 0..threads {
            per_qp[((t / stride as u64) % qps as u64) as usize] += per_thread as u64;
        }
        let ring_log = per_qp
            .iter()
            .max()
            .copied()
            .unwrap_or(1)
            .next_power_of_two()
            .trailing_zeros();
        let ring_bytes = (SEND_WQE_BB as u64) << ring_log;
        let total = ring_bytes
            .checked_mul(qps as u64)
            .filter(|b| *b <= 1 << 32)
            .ok_or_else(|| bad(format!("{qps} rings of {ring_bytes} bytes exceed 4 GiB")))?
            as usize;
        let rings = match placement {
            RingPlacement::HostPinned => {
                let buf = HostBuffer::new("posting-rate rings", total).map_err(|e| bad(e.to_string()))?;
                // SAFETY: page-aligned whole pages, kept alive next to the mapping (dropped first).
                let map = unsafe { HostMapping::new(self, buf.as_ptr(), buf.size()) }?;
                Rings::Pinned(map, buf)
            }
            RingPlacement::Device | RingPlacement::DeviceSystemFences => {
                Rings::Device(DeviceBuffer::zeroed(self, total)?)
            }
        };
        // With device rings the send queues' doorbell records sit in device memory too.
        let device_records = match placement {
            RingPlacement::HostPinned => None,
            _ => Some(DeviceBuffer::zeroed(self, 64 * qps as usize)?),
        };
        let flags = match placement {
            RingPlacement::Device => gdaki_layout::handle::QP_RINGS_IN_GPU_MEMORY,
            _ => 0,
        };
        // Doorbell record and doorbell stand-ins: 64 bytes per QP, host-pinned.
        let records = HostBuffer::new("posting-rate doorbells", 64 * qps as usize).map_err(|e| bad(e.to_string()))?;
        // SAFETY: as above.
        let records_map = unsafe { HostMapping::new(self, records.as_ptr(), records.size()) }?;
        let cq = DeviceBuffer::zeroed(self, 64)?;
        let handles = DeviceBuffer::zeroed(self, std::mem::size_of::<DevQp>() * qps as usize)?;
        let mut addrs = Vec::with_capacity(qps as usize);
        for q in 0..qps as u64 {
            let dev = DevQp {
                sq_base: rings.addr() + q * ring_bytes,
                sq_dbrec: match &device_records {
                    Some(d) => d.device_addr() + q * 64 + 4,
                    None => records_map.device_addr(q * 64 + 4),
                },
                version: gdaki_layout::handle::DEV_QP_VERSION,
                flags,
                doorbell: records_map.device_addr(q * 64 + 8),
                max_msg_size: 1 << 30,
                timeout_ns: 10_000_000_000,
                qpn: q as u32 + 1,
                sq_log_size: ring_log,
                doorbell_kind: DoorbellKind::Gpu as u8,
                cq: DevCq {
                    cqe_base: cq.device_addr(),
                    dbrec: records_map.device_addr(q * 64 + 16),
                    cqn: q as u32 + 1,
                    log_size: 0,
                    ..bytemuck::Zeroable::zeroed()
                },
                ..bytemuck::Zeroable::zeroed()
            };
            let at = q as usize * std::mem::size_of::<DevQp>();
            handles.write(at, bytemuck::bytes_of(&dev))?;
            addrs.push(handles.device_addr() + at as u64);
        }
        let stream = self.ctx.default_stream();
        let handle_list = stream.clone_htod(&addrs)?;

        // The store loop first: it also touches every page before the timed posting run.
        // The largest power of two of whole records the memory holds.
        let records_log = (total / SEND_WQE_BB).ilog2();
        let store_loop = self.module.load_function("gdaki_store_loop")?;
        let config = LaunchConfig {
            grid_dim: (launch.grid, 1, 1),
            block_dim: (launch.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let base = rings.addr();
        let store = fastest_of_two(|| {
            let mut b = stream.launch_builder(&store_loop);
            b.arg(&base).arg(&records_log).arg(&per_thread);
            // SAFETY: `gdaki_store_loop(base, records_log, iters)`: `base` holds at least
            // `64 << records_log` bytes (records_log is rounded down).
            timed(&stream, || unsafe { b.launch(config) }.map(|_| ()))
        })?;
        let ring_loop = self.module.load_function("gdaki_store_loop_rings")?;
        let ring_store = fastest_of_two(|| {
            let mut b = stream.launch_builder(&ring_loop);
            b.arg(&base).arg(&ring_log).arg(&qps).arg(&stride).arg(&per_thread);
            // SAFETY: `gdaki_store_loop_rings(base, ring_log, qps, stride, iters)`: `base` holds
            // `qps` rings of `64 << ring_log` bytes (`total`).
            timed(&stream, || unsafe { b.launch(config) }.map(|_| ()))
        })?;
        let name = format!("gdaki_post_rate_{}_{}", launch.scope.name(), launch.mode.name());
        let args = Args::new()
            .slice(&handle_list)
            .u32(qps)
            .u32(stride)
            .u32(per_thread)
            .u32(commit_every);
        let run = match kernels.0 {
            None => self.run_data_path(&name, launch, args)?,
            Some(module) => {
                if module.gpu().ordinal() != self.ordinal() {
                    return Err(bad(format!(
                        "the module is loaded into GPU {}, not GPU {}",
                        module.gpu().ordinal(),
                        self.ordinal()
                    )));
                }
                // SAFETY: the kernel takes these parameters and touches only what they name
                // (the contract of `PostingKernels::module`).
                unsafe { self.run_data_path_kernel(&module.kernel(&name)?, launch, args)? }
            }
        };
        if let Some((t, code)) = run.first_failure() {
            return Err(CudaError::WrongResult {
                kernel: "gdaki_post_rate",
                detail: format!("thread {t}: {}", gdaki_device::status::Code(code)),
            });
        }
        drop(records_map);
        drop(rings);
        Ok(PostingRun {
            wqes: threads * per_thread as u64,
            post: run.elapsed,
            store,
            ring_store,
        })
    }
}

/// The faster of two runs of a reference loop (the first also touches the pages).
fn fastest_of_two(mut run: impl FnMut() -> Result<Duration, CudaError>) -> Result<Duration, CudaError> {
    Ok(run()?.min(run()?))
}
