//! Reference measurements the perftests print next to their figures, taken in the same run on
//! the same GPU: a device-to-device copy, a GPU <-> CPU flag round trip through host-pinned
//! memory, and a synchronised 8-byte host-to-device copy.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{CudaError, DeviceBuffer, Gpu, GpuUuid, HostMapping};
use crate::stream::timed;
use crate::HostBuffer;

/// How long the CPU side of the pinned round trip waits for the GPU before giving up.
const ECHO_TIMEOUT: Duration = Duration::from_secs(10);

impl Gpu {
    /// GPU time of `count` back-to-back `cuMemcpyDtoDAsync` copies of `len` bytes between two
    /// device buffers of `slots` slots, copy `m` from slot `m % slots` to the same slot of the
    /// other: the plain device copy `put_bw`'s bandwidth is read against, through the same
    /// amount of memory as its puts (one slot would stay in the L2 cache, which puts cycling
    /// through many slots do not).
    pub fn device_copy(&self, len: usize, slots: usize, count: u32) -> Result<Duration, CudaError> {
        let stream = self.ctx.default_stream();
        let bytes = slot_bytes(len, slots)?;
        let src = stream.alloc_zeros::<u8>(bytes)?;
        let mut dst = stream.alloc_zeros::<u8>(bytes)?;
        let (s, _s) = src.device_ptr(&stream);
        let (d, _d) = dst.device_ptr_mut(&stream);
        timed(&stream, || {
            copy_slots(len, slots, count, |at, len| {
                // SAFETY: both allocations hold `slots` slots of `len` bytes and live until the
                // stream is idle (`timed` waits for it).
                unsafe { sys::cuMemcpyDtoDAsync_v2(d + at, s + at, len, stream.cu_stream()) }.result()
            })
        })
    }

    /// GPU time of `count` back-to-back `cuMemcpyPeerAsync` copies of `len` bytes between a
    /// buffer on this GPU and one on the GPU with UUID `peer`, slot by slot as
    /// [`device_copy`](Self::device_copy) does, in `direction`: the P2P copy a two-process
    /// `put_bw` across two GPUs is read against. Peer access to that GPU is enabled first (see
    /// [`enable_peer_access`](crate::enable_peer_access)), so the copy engines move the bytes
    /// over NVLink or PCIe rather than through host memory; refused where the peer GPU is not
    /// visible to this process, is this GPU, or is not reachable over P2P.
    pub fn peer_copy(
        &self,
        peer: &GpuUuid,
        direction: PeerDirection,
        len: usize,
        slots: usize,
        count: u32,
    ) -> Result<Duration, CudaError> {
        let refuse = |why: &str| CudaError::BadArgument {
            what: "peer_copy",
            why: why.into(),
        };
        let ordinal =
            crate::gpu_ordinal_of(peer).ok_or_else(|| refuse("the peer GPU is not visible to this process"))?;
        if crate::gpu_uuid(&self.ctx)? == *peer {
            return Err(refuse("the peer GPU is this GPU (device_copy measures that)"));
        }
        if !crate::gpu_reaches(&self.ctx, peer) {
            return Err(refuse("this GPU has no P2P path to the peer GPU"));
        }
        crate::enable_peer_access(&self.ctx, peer)?;
        let theirs_ctx = cudarc::driver::CudaContext::new(ordinal)?;
        let theirs_stream = theirs_ctx.default_stream();
        let bytes = slot_bytes(len, slots)?;
        let mut theirs = theirs_stream.alloc_zeros::<u8>(bytes)?;
        // The zeros land before this GPU's copies touch the buffer.
        theirs_stream.synchronize()?;
        let stream = self.ctx.default_stream();
        let mut mine = stream.alloc_zeros::<u8>(bytes)?;
        let (m, _m) = mine.device_ptr_mut(&stream);
        let (t, _t) = theirs.device_ptr_mut(&theirs_stream);
        let (my_ctx, their_ctx) = (self.ctx.cu_ctx(), theirs_ctx.cu_ctx());
        let ((dst, dst_ctx), (src, src_ctx)) = match direction {
            PeerDirection::ToPeer => ((t, their_ctx), (m, my_ctx)),
            PeerDirection::FromPeer => ((m, my_ctx), (t, their_ctx)),
        };
        self.ctx.bind_to_thread()?;
        timed(&stream, || {
            copy_slots(len, slots, count, |at, len| {
                // SAFETY: both allocations hold `slots` slots of `len` bytes, each in the
                // context named beside it, and live until this stream is idle (`timed` waits).
                unsafe { sys::cuMemcpyPeerAsync(dst + at, dst_ctx, src + at, src_ctx, len, stream.cu_stream()) }
                    .result()
            })
        })
    }

    /// Round trips (ns, GPU global timer) of a flag ping-pong between one GPU thread and one CPU
    /// thread through host-pinned memory: the floor of any GPU <-> host-agent exchange, and
    /// `write_lat`'s reference. Returns `iters` samples.
    pub fn pinned_round_trip(&self, iters: u32) -> Result<Vec<u64>, CudaError> {
        let iters = iters.max(1);
        let page = HostBuffer::new("the round-trip flags", 4096).map_err(|e| CudaError::BadArgument {
            what: "pinned_round_trip",
            why: e.to_string(),
        })?;
        // SAFETY: a page-aligned whole page, alive until after the mapping (dropped first).
        let map = unsafe { HostMapping::new(self, page.as_ptr(), page.size()) }?;
        let gpu_word = map.device_addr(0);
        let cpu_word = map.device_addr(64);
        let host = page.addr();
        let stop = Arc::new(AtomicBool::new(false));
        let echo = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("gdaki-pingpong-echo".into())
                .spawn(move || {
                    // SAFETY: both words lie in the page, which outlives this thread (joined
                    // below before it is freed); the GPU accesses them atomically too.
                    let (from_gpu, to_gpu) = unsafe {
                        (
                            AtomicU64::from_ptr(host as *mut u64),
                            AtomicU64::from_ptr((host + 64) as *mut u64),
                        )
                    };
                    let deadline = Instant::now() + ECHO_TIMEOUT;
                    let mut next = 1u64;
                    while next <= u64::from(iters) && !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        for _ in 0..4096 {
                            if from_gpu.load(Ordering::Acquire) == next {
                                to_gpu.store(next, Ordering::Release);
                                next += 1;
                                break;
                            }
                            std::hint::spin_loop();
                        }
                    }
                })
                .map_err(|e| CudaError::BadArgument {
                    what: "pinned_round_trip",
                    why: format!("starting the echo thread: {e}"),
                })?
        };
        let result = (|| {
            let function = self.module.load_function("gdaki_pinned_pingpong")?;
            let stream = self.ctx.default_stream();
            let mut times = stream.alloc_zeros::<u64>(iters as usize)?;
            let mut status = stream.alloc_zeros::<u32>(1)?;
            let timeout_ns = ECHO_TIMEOUT.as_nanos() as u64;
            let mut b = stream.launch_builder(&function);
            b.arg(&gpu_word)
                .arg(&cpu_word)
                .arg(&iters)
                .arg(&timeout_ns)
                .arg(&mut times)
                .arg(&mut status);
            let one = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `gdaki_pinned_pingpong(gpu_word, cpu_word: host-pinned u64s mapped for
            // this GPU (the page above), iters, timeout_ns, times: iters u64s, status: one u32)`,
            // one thread.
            timed(&stream, || unsafe { b.launch(one) }.map(|_| ()))?;
            let code = stream.clone_dtoh(&status)?[0];
            if code != gdaki_device::status::CODE_OK {
                return Err(CudaError::WrongResult {
                    kernel: "gdaki_pinned_pingpong",
                    detail: format!("status {code:#x}: the CPU echo did not answer"),
                });
            }
            Ok(stream.clone_dtoh(&times)?)
        })();
        stop.store(true, Ordering::Relaxed);
        let _ = echo.join();
        drop(map);
        let t = result?;
        // Round i ends where round i + 1 starts; the last round's end is not recorded.
        Ok(t.windows(2).map(|w| w[1].saturating_sub(w[0])).collect())
    }

    /// Wall time of each of `iters` synchronous 8-byte host-to-device copies (`cuMemcpyHtoD`):
    /// what a host agent pays per small message if it moves GPU data with the copy API.
    pub fn synced_copy(&self, iters: u32) -> Result<Vec<Duration>, CudaError> {
        let buf = DeviceBuffer::zeroed(self, 8)?;
        (0..iters)
            .map(|i| {
                let started = Instant::now();
                buf.write(0, &u64::from(i).to_le_bytes())?;
                Ok(started.elapsed())
            })
            .collect()
    }
}

/// Which way [`Gpu::peer_copy`] moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerDirection {
    /// From this GPU's buffer to the peer GPU's (what a WRITE to the peer does).
    ToPeer,
    /// From the peer GPU's buffer to this GPU's (what a READ from the peer does).
    FromPeer,
}

/// Bytes of `slots` slots of `len` bytes (each at least 1).
fn slot_bytes(len: usize, slots: usize) -> Result<usize, CudaError> {
    let (len, slots) = (len.max(1), slots.max(1));
    len.checked_mul(slots).ok_or(CudaError::OutOfBounds {
        offset: 0,
        len,
        size: usize::MAX,
    })
}

/// Issues `count` copies of `len` bytes, copy `m` at slot `m % slots`, through `copy(offset, len)`.
fn copy_slots(
    len: usize,
    slots: usize,
    count: u32,
    mut copy: impl FnMut(u64, usize) -> Result<(), cudarc::driver::DriverError>,
) -> Result<(), cudarc::driver::DriverError> {
    let (len, slots) = (len.max(1), slots.max(1) as u64);
    for m in 0..u64::from(count) {
        copy((m % slots) * len as u64, len)?;
    }
    Ok(())
}
