//! The PTX entry points (`extern "ptx-kernel"`), all in one place. Each is a thin shell that
//! reads its thread coordinates and calls the data-path API, so the logic is the code CPU
//! threads run too. Kernels are instantiated for every execution scope and sharing mode
//! (`gdaki_<kernel>_<scope>_<mode>`; `put_bw`, `ops`, `post_rate`), all with the same parameters; results go to
//! `status[thread]` as [`crate::status`] codes.
//!
//! Launch shapes: a warp-scope kernel needs whole warps (a partial warp reports
//! [`CODE_BAD_SCOPE`]); block-scope kernels take one [`BlockScratch`] per block at `scratch`
//! (others ignore it); exclusive mode means one thread, warp or block in all.
use core::arch::nvptx::{_block_dim_x, _block_idx_x, _grid_dim_x, _thread_idx_x};
use core::sync::atomic::{AtomicU64, Ordering};

use gdaki_layout::perf::PingPongSide;
use gdaki_layout::DevQp;

use crate::arch;
use crate::perf;
use crate::qp::{AtomicOp, Local, Qp, Remote};
use crate::scope::{Block, BlockScratch, Scope, Thread, Warp};
use crate::sharing::{Cta, Exclusive, Gpu, Sharing};
use crate::status::{PostError, CODE_BAD_ARGUMENT, CODE_BAD_SCOPE, CODE_FLAG_TIMEOUT, CODE_OK};

#[inline(always)]
fn global_thread() -> u32 {
    // SAFETY: reading special registers has no preconditions inside a kernel.
    unsafe { _block_idx_x() as u32 * _block_dim_x() as u32 + _thread_idx_x() as u32 }
}

/// Self-test kernel used by `doctor` and the GPU runner: thread `i` of the grid writes the
/// big-endian encoding of `i ^ seed` to `out[i]` (the byte order every WQE field uses) and adds
/// one to `*count`, so the host can check both plain stores and device atomics.
///
/// # Safety
/// `out` must be valid for `n` u32 writes and `count` must point to a u64 in device-accessible
/// memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn gdaki_selftest(out: *mut u32, count: *mut u64, n: u32, seed: u32) {
    let i = global_thread();
    if i < n {
        // SAFETY: i < n and the caller guarantees `out` holds n elements.
        unsafe { out.add(i as usize).write_volatile((i ^ seed).to_be()) };
    }
    // SAFETY: the caller guarantees `count` is a valid, aligned u64 in device-visible memory.
    unsafe { AtomicU64::from_ptr(count) }.fetch_add(1, Ordering::Relaxed);
}

/// Exercises every high- and low-level operation once, against a remote region of at least
/// 64 bytes per thread at `remote` and a local one at `local` (the same size): the PTX proof
/// that the whole API instantiates, and a GPU smoke test.
#[inline(always)]
fn all_ops<M: Sharing, S: Scope>(qp: Qp<M, S>, remote: Remote, local: Local) -> Result<(), PostError> {
    let t = global_thread() as u64 * 64;
    let r = |off: u64| remote.offset(t + off);
    let l = |off: u64| local.offset(t + off);
    // Deferred posts: the first is rung by the next post's doorbell, the third by the commit.
    qp.deferred().put(r(0), l(0), 8)?;
    qp.put(r(8), l(8), 8)?;
    qp.deferred().put_inline(r(16), &t.to_le_bytes())?;
    qp.commit()?;
    qp.get(l(24), r(0), 8)?;
    // Sends what the get fetched: the fence holds the put until the get's data has landed.
    qp.fenced().put(r(24), l(24), 8)?;
    qp.put_signal(r(32), l(32), 8, r(40), 1, l(48))?;
    qp.signal(r(40), 1, l(48))?;
    let before = qp.atomic_fetch_add(r(40), 5, l(48))?;
    let _ = qp.atomic_compare_swap(r(40), before + 5, 0, l(56))?;
    let _ = qp.atomic(AtomicOp::FetchAdd(0), r(40), l(48))?;
    // The low level, by hand: one NOP (by the leader only: in exclusive mode only one thread
    // may change the QP's state).
    if qp.scope().is_leader() {
        let i = qp.reserve(1)?;
        qp.wqe_prepare_nop(i, 0);
        qp.mark_ready(i, i + 1)?;
        qp.submit(i + 1)?;
        let _ = qp.poll_one();
    }
    qp.quiet()?;
    Ok(())
}

/// The calling thread's member of scope `S` (`None`: the launch shape does not fit it).
trait Launch: Scope {
    /// # Safety
    /// For block scope, `scratch` holds one [`BlockScratch`] per block of the grid.
    unsafe fn here(scratch: *mut BlockScratch) -> Option<Self>;
}
impl Launch for Thread {
    #[inline(always)]
    unsafe fn here(_: *mut BlockScratch) -> Option<Self> {
        Some(Thread)
    }
}
impl Launch for Warp {
    #[inline(always)]
    unsafe fn here(_: *mut BlockScratch) -> Option<Self> {
        Warp::converged()
    }
}
impl Launch for Block {
    #[inline(always)]
    unsafe fn here(scratch: *mut BlockScratch) -> Option<Self> {
        // SAFETY: one scratch per block, per the contract; every thread of the block computes
        // the same pointer.
        Some(unsafe { Block::new(scratch.add(_block_idx_x() as usize)) })
    }
}

/// Runs `f` with the QP in scope `S` and writes the thread's outcome code.
#[inline(always)]
unsafe fn run<M: Sharing, S: Launch>(
    qp: *mut DevQp,
    scratch: *mut BlockScratch,
    status: *mut u32,
    f: impl FnOnce(Qp<M, S>) -> Result<(), PostError>,
) {
    // SAFETY: the caller passes an exported handle used in mode M and scope S by the launch.
    let code = match unsafe { S::here(scratch) } {
        Some(scope) => f(unsafe { Qp::<M>::from_raw(qp) }.with_scope(scope)).map_or_else(|e| e.code(), |()| CODE_OK),
        None => CODE_BAD_SCOPE,
    };
    // SAFETY: one status word per thread, per the kernel's contract.
    unsafe { status.add(global_thread() as usize).write_volatile(code) };
}

macro_rules! kernels_for {
    ($mode:ty, $scope:ty, $put:ident, $ops:ident, $rate:ident) => {
        /// `put_bw`'s stream (see [`perf::put_stream`]) in this scope and sharing mode:
        /// thread `t` posts on `qps[(t / per_qp) % nqp]` (`per_qp` 0: a block's threads),
        /// every thread of the grid `iters` messages of `len` bytes into `slots` slots,
        /// thread `t` numbering its messages from `first + t`; `op` a
        /// [`StreamOp`](gdaki_layout::perf::StreamOp) code (an unknown one is
        /// `CODE_BAD_ARGUMENT`): WRITEs into `dst`, READs from `dst` into `src`, or SENDs.
        ///
        /// # Safety
        /// `qps` holds `nqp` (at least one) exported handles, each shared only by this launch's
        /// threads in this mode; `per_qp` keeps each posting group (warp, block) on one QP;
        /// the buffers hold `len * slots` bytes and are registered with the keys given;
        /// `status` holds one u32 per thread; `scratch` as in the module documentation.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $put(
            qps: *const u64,
            nqp: u32,
            dst: u64,
            rkey: u32,
            src: u64,
            lkey: u32,
            len: u64,
            slots: u64,
            first: u64,
            iters: u32,
            per_qp: u32,
            op: u32,
            scratch: *mut BlockScratch,
            status: *mut u32,
        ) {
            let Some(op) = gdaki_layout::perf::StreamOp::from_code(op) else {
                // SAFETY: one status word per thread (contract).
                unsafe {
                    status
                        .add(global_thread() as usize)
                        .write_volatile(CODE_BAD_ARGUMENT)
                };
                return;
            };
            let (dst, src) = (Remote { addr: dst, rkey }, Local { addr: src, lkey });
            // SAFETY: special registers are always readable.
            let (block, threads) = unsafe {
                (
                    _block_dim_x() as u32,
                    _grid_dim_x() as u64 * _block_dim_x() as u64,
                )
            };
            let per_qp = if per_qp == 0 { block } else { per_qp };
            let i = (global_thread() / per_qp.max(1)) % nqp.max(1);
            // SAFETY: `qps` holds `nqp` entries (contract).
            let qp = unsafe { *qps.add(i as usize) } as *mut DevQp;
            let t = first + global_thread() as u64;
            unsafe {
                run::<$mode, $scope>(qp, scratch, status, |qp| {
                    perf::put_stream(qp, dst, src, len, slots, t, threads, iters, op)
                })
            }
        }

        /// The posting rate (see [`perf::post_only`]): thread `t` posts `iters` 8-byte puts on
        /// `qps[(t / stride) % nqp]` and waits for none; with `commit_every` above 1, deferred
        /// and committed every `commit_every` puts.
        ///
        /// # Safety
        /// `qps` holds `nqp` exported handles whose rings hold every WQE posted, each used in
        /// this mode by the threads that map to it; `stride` is at least 1; `status` and
        /// `scratch` as for the put kernel.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $rate(
            qps: *const u64,
            nqp: u32,
            stride: u32,
            iters: u32,
            commit_every: u32,
            scratch: *mut BlockScratch,
            status: *mut u32,
        ) {
            let i = (global_thread() / stride.max(1)) % nqp.max(1);
            // SAFETY: `qps` holds `nqp` entries (contract).
            let qp = unsafe { *qps.add(i as usize) } as *mut DevQp;
            // Never executed (nothing consumes the ring): any address and key.
            let (dst, src) = (
                Remote {
                    addr: 0x1000,
                    rkey: 1,
                },
                Local {
                    addr: 0x2000,
                    lkey: 1,
                },
            );
            // SAFETY: the launch passes a live QP handle, block scratch and one status word per
            // thread (the kernel's contract).
            unsafe {
                run::<$mode, $scope>(qp, scratch, status, |qp| {
                    perf::post_only(qp, dst, src, iters, commit_every)
                })
            }
        }

        /// Every operation once (see `all_ops`) in this scope and sharing mode.
        ///
        /// # Safety
        /// As for the put kernel, with 64 bytes per thread at `remote` and `local`.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $ops(
            qp: *mut DevQp,
            remote: u64,
            rkey: u32,
            local: u64,
            lkey: u32,
            scratch: *mut BlockScratch,
            status: *mut u32,
        ) {
            let (remote, local) = (Remote { addr: remote, rkey }, Local { addr: local, lkey });
            // SAFETY: as above.
            unsafe { run::<$mode, $scope>(qp, scratch, status, |qp| all_ops(qp, remote, local)) }
        }
    };
}

kernels_for!(
    Exclusive,
    Thread,
    gdaki_put_bw_thread_exclusive,
    gdaki_ops_thread_exclusive,
    gdaki_post_rate_thread_exclusive
);
kernels_for!(
    Cta,
    Thread,
    gdaki_put_bw_thread_cta,
    gdaki_ops_thread_cta,
    gdaki_post_rate_thread_cta
);
kernels_for!(
    Gpu,
    Thread,
    gdaki_put_bw_thread_gpu,
    gdaki_ops_thread_gpu,
    gdaki_post_rate_thread_gpu
);
kernels_for!(
    Exclusive,
    Warp,
    gdaki_put_bw_warp_exclusive,
    gdaki_ops_warp_exclusive,
    gdaki_post_rate_warp_exclusive
);
kernels_for!(
    Cta,
    Warp,
    gdaki_put_bw_warp_cta,
    gdaki_ops_warp_cta,
    gdaki_post_rate_warp_cta
);
kernels_for!(
    Gpu,
    Warp,
    gdaki_put_bw_warp_gpu,
    gdaki_ops_warp_gpu,
    gdaki_post_rate_warp_gpu
);
kernels_for!(
    Exclusive,
    Block,
    gdaki_put_bw_block_exclusive,
    gdaki_ops_block_exclusive,
    gdaki_post_rate_block_exclusive
);
kernels_for!(
    Cta,
    Block,
    gdaki_put_bw_block_cta,
    gdaki_ops_block_cta,
    gdaki_post_rate_block_cta
);
kernels_for!(
    Gpu,
    Block,
    gdaki_put_bw_block_gpu,
    gdaki_ops_block_gpu,
    gdaki_post_rate_block_gpu
);

/// `write_lat`'s ping-pong (see [`perf::ping_pong`]): thread 0 of block `b` plays `sides[b]`,
/// with the QP exclusively its own; other threads only report OK. One block per side, so a
/// loopback run has both sides in one launch.
///
/// # Safety
/// `sides` holds one [`PingPongSide`] per block, valid as `perf::ping_pong` requires;
/// `status` holds one u32 per thread.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn gdaki_write_lat(sides: *const PingPongSide, size: u64, iters: u32, status: *mut u32) {
    // SAFETY: special registers are always readable.
    let code = if unsafe { _thread_idx_x() } == 0 {
        // SAFETY: one side per block (contract).
        let side = unsafe { *sides.add(_block_idx_x() as usize) };
        // SAFETY: the side's QP is exclusively this thread's; its buffers are valid.
        let qp = unsafe { Qp::<Exclusive>::from_raw(side.qp as *mut DevQp) };
        unsafe { perf::ping_pong(qp, &side, size, iters) }.map_or_else(|e| e.code(), |()| CODE_OK)
    } else {
        CODE_OK
    };
    // SAFETY: one status word per thread.
    unsafe { status.add(global_thread() as usize).write_volatile(code) };
}

/// Defines a socket perftest kernel `$name` over [`socket_bench`], its calls' steps `$timed`.
macro_rules! socket_bench_kernel {
    ($(#[$doc:meta])* $name:ident, $timed:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `sockets` and `roles` hold one entry per block, each socket this block's alone; the
        /// buffers are GPU memory of `buf_len` (at least `size`) bytes per block; `times` holds
        /// `times_per_block` (at least the role's timestamps) per block; `scratch` one
        /// [`BlockScratch`] per block; `status` and `moved` one entry per block.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(
            sockets: *const u64,
            roles: *const u32,
            size: u64,
            iters: u32,
            bufs: u64,
            buf_len: u64,
            times: *mut u64,
            times_per_block: u64,
            scratch: *mut BlockScratch,
            status: *mut u32,
            moved: *mut u64,
        ) {
            let area = (bufs, buf_len, times, times_per_block, scratch);
            // SAFETY: the caller's contract.
            unsafe { socket_bench::<$timed>(sockets, roles, size, iters, area, status, moved) }
        }
    };
}

socket_bench_kernel!(
    /// The socket perftests ([`socket::bench`](crate::socket::bench)), their calls' steps
    /// timed (the Steps lines): block `b` runs role `roles[b]` on the socket whose handle is
    /// `sockets[b]`, all its threads together, `iters` messages of `size` bytes through
    /// `buf_len` bytes at `bufs + b * buf_len`; its leader writes its timestamps from
    /// `times + b * times_per_block`, `status[b]` and `moved[b]`.
    gdaki_socket_bench,
    true
);

socket_bench_kernel!(
    /// [`gdaki_socket_bench`] without the steps' timing: the calls run as an application's,
    /// whose rates the perftests print (the timing's code cost a copying stream 7-8%).
    gdaki_socket_bench_untimed,
    false
);

/// The body of the two socket perftest kernels (see [`gdaki_socket_bench`]).
///
/// # Safety
/// As for [`gdaki_socket_bench`].
/// `area`: the buffers, their length, the timestamps and their count per block, the
/// scratch.
#[inline(always)]
unsafe fn socket_bench<const TIMED: bool>(
    sockets: *const u64,
    roles: *const u32,
    size: u64,
    iters: u32,
    (bufs, buf_len, times, times_per_block, scratch): (u64, u64, *mut u64, u64, *mut BlockScratch),
    status: *mut u32,
    moved: *mut u64,
) {
    // SAFETY: special registers are always readable.
    let b = unsafe { _block_idx_x() } as usize;
    // SAFETY: one scratch per block (contract); every thread of the block computes the same.
    let block = unsafe { Block::new(scratch.add(b)) };
    // SAFETY: one role and one handle per block (contract), this block's alone.
    let outcome = match (crate::socket::BenchRole::from_code(unsafe { *roles.add(b) }), unsafe {
        crate::socket::Socket::<Exclusive>::from_raw(*sockets.add(b) as *mut _)
    }) {
        (None, _) => Err(CODE_BAD_ARGUMENT),
        (_, Err(e)) => Err(e.code()),
        // SAFETY: this block's buffer and timestamps (contract).
        (Some(role), Ok(sock)) => unsafe {
            crate::socket::bench::<_, _, TIMED>(
                &sock,
                block,
                role,
                size,
                iters,
                core::slice::from_raw_parts_mut((bufs + b as u64 * buf_len) as *mut u8, buf_len as usize),
                times.add(b * times_per_block as usize),
            )
        }
        .map_err(|e| e.code()),
    };
    if block.is_leader() {
        let (code, n) = outcome.map_or_else(|c| (c, 0), |n| (CODE_OK, n));
        // SAFETY: one entry per block (contract).
        unsafe {
            status.add(b).write_volatile(code);
            moved.add(b).write_volatile(n);
        }
    }
}

/// `write_lat`'s reference: a flag ping-pong between this (single) thread and a CPU thread
/// through host-pinned memory, with no HCA in between. Round `i` (from 1) records the time,
/// stores `i` to `*gpu_word` and waits until the CPU echoes `i` in `*cpu_word`. `*status` gets
/// OK or [`CODE_FLAG_TIMEOUT`] (no echo within `timeout_ns`).
///
/// # Safety
/// `gpu_word` and `cpu_word` are host-pinned u64s mapped for this GPU; `times` holds `iters`
/// u64s; `status` one u32. Launch one thread.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn gdaki_pinned_pingpong(
    gpu_word: *mut u64,
    cpu_word: *const u64,
    iters: u32,
    timeout_ns: u64,
    times: *mut u64,
    status: *mut u32,
) {
    let mut code = CODE_OK;
    'rounds: for i in 1..=iters as u64 {
        let start = arch::global_timer_ns();
        // SAFETY: `times` holds `iters` entries; the words are valid (contract).
        unsafe {
            times.add(i as usize - 1).write_volatile(start);
            arch::to_device_barrier();
            gpu_word.write_volatile(i);
        }
        let mut polls = 0u32;
        // SAFETY: `cpu_word` is a host-pinned word of this side (contract).
        while unsafe { arch::load_u64_volatile(cpu_word) } != i {
            polls = polls.wrapping_add(1);
            if polls % 256 == 0 && arch::global_timer_ns().wrapping_sub(start) > timeout_ns {
                code = CODE_FLAG_TIMEOUT;
                break 'rounds;
            }
        }
    }
    // SAFETY: one status word (contract).
    unsafe { status.write_volatile(code) };
}

/// The posting rate's reference: thread `t` writes `iters` records ([`perf::STORE_LOOP_SEGMENTS`]
/// 16-byte stores into a 64-byte slot, as a put's WQE segments are written) at slot
/// `(t + k * threads) mod 2^records_log` of `base`: the same memory a ring would be in, with no
/// protocol around the stores.
///
/// # Safety
/// `base` is valid for `64 << records_log` bytes of writes by this device.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn gdaki_store_loop(base: *mut u64, records_log: u32, iters: u32) {
    let t = global_thread() as u64;
    // SAFETY: special registers are always readable.
    let threads = unsafe { _grid_dim_x() as u64 * _block_dim_x() as u64 };
    let mask = (1u64 << records_log) - 1;
    for k in 0..iters as u64 {
        let m = (t + k * threads) & mask;
        // SAFETY: record m lies inside the buffer (masked); 16-byte aligned.
        unsafe {
            let p = base.add((m * 8) as usize);
            for seg in 0..perf::STORE_LOOP_SEGMENTS {
                arch::store_seg(p.add(seg * 2), [m, seg as u64]);
            }
        }
    }
}

/// The posting rate's ring-order reference: the stores of [`gdaki_store_loop`], placed where
/// the posts put their WQEs. Thread `t` writes into the ring of QP `q = (t / stride) mod qps`
/// (rings of `1 << ring_log` records, one after another from `base`), and the QP's threads take
/// its records in turn, as posters sharing a ring do: rank `r` of the QP's `n` threads writes
/// record `k * n + r` (mod the ring) in its `k`-th round. A ring written in order combines
/// writes that scattered records do not, so this, not the scattered loop, is what posting into
/// host-pinned rings compares with.
///
/// # Safety
/// `base` is valid for `qps * 64 << ring_log` bytes of writes by this device.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn gdaki_store_loop_rings(
    base: *mut u64,
    ring_log: u32,
    qps: u32,
    stride: u32,
    iters: u32,
) {
    let t = global_thread() as u64;
    // SAFETY: special registers are always readable.
    let threads = unsafe { _grid_dim_x() as u64 * _block_dim_x() as u64 };
    let (qps, stride) = (qps.max(1) as u64, stride.max(1) as u64);
    let group = t / stride;
    let q = group % qps;
    let rank = (group / qps) * stride + t % stride;
    let n = threads.div_ceil(qps);
    let mask = (1u64 << ring_log) - 1;
    for k in 0..iters as u64 {
        let m = (q << ring_log) + ((k * n + rank) & mask);
        // SAFETY: q < qps and the record is masked into its ring; 16-byte aligned.
        unsafe {
            let p = base.add((m * 8) as usize);
            for seg in 0..perf::STORE_LOOP_SEGMENTS {
                arch::store_seg(p.add(seg * 2), [m, seg as u64]);
            }
        }
    }
}

/// The soft HCA's persistent copy kernel (see [`crate::copier::serve`]): runs until the host
/// sets `*stop` while no descriptor is pending. `work` is the zeroed working area
/// `gdaki_layout::copy::WORK_BYTES` describes.
///
/// # Safety
/// As [`crate::copier::serve`] requires; `work` holds `WORK_BYTES` bytes.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn gdaki_copier(
    descs: *const gdaki_layout::copy::CopyDesc,
    dones: *mut gdaki_layout::copy::CopyDone,
    stop: *const u32,
    work: *mut u8,
    first: u64,
) {
    use gdaki_layout::copy::{WORK_COMPLETED, WORK_FINISHED, WORK_MIRROR};
    // SAFETY: the layout of the allocation as documented, all offsets 8-byte aligned.
    let w = unsafe {
        crate::copier::Work {
            state: work.cast(),
            mirror: work.add(WORK_MIRROR).cast(),
            finished: work.add(WORK_FINISHED).cast(),
            completed: work.add(WORK_COMPLETED).cast(),
        }
    };
    // SAFETY: the rings, the stop word and the work area are what `serve` requires (this kernel's contract).
    unsafe { crate::copier::serve(descs, dones, stop, &w, first) }
}
