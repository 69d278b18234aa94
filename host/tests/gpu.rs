//! GPU tests of the host library. Where there is no usable GPU each test prints a `SKIPPED`
//! line and passes, unless `GDAKI_REQUIRE_GPU=1` (the GPU runner sets it), which makes a
//! missing GPU a failure instead.
mod common;
use common::{gpu_or_skip, loopback_qp, pattern, qp, ReadVec};
use std::io::Write;

use gdaki::cuda::{self, Gpu};

#[test]
fn selftest_kernel_runs_and_verifies() {
    let Some((gpu, _one)) = gpu_or_skip("selftest_kernel_runs_and_verifies") else {
        return;
    };
    for threads in [1, 31, 4096, 100_000] {
        let report = gpu.selftest(threads).expect("selftest");
        assert!(report.threads >= threads);
    }
}

#[test]
fn probe_matches_the_opened_gpu() {
    let Some((gpu, _one)) = gpu_or_skip("probe_matches_the_opened_gpu") else {
        return;
    };
    let info = cuda::probe().expect("probe after a successful open");
    assert!(!info.gpus.is_empty());
    assert_eq!(info.gpus[0].name, gpu.context().name().unwrap());
    assert!(info.driver_version >= cuda::MIN_DRIVER_VERSION);
}

#[test]
fn missing_gpu_index_is_an_error_not_a_panic() {
    // Holds with or without a GPU: index 4096 never exists.
    let err = Gpu::open(4096).unwrap_err();
    assert!(
        matches!(
            err,
            cuda::CudaError::NoDriver | cuda::CudaError::NoSuchDevice { .. } | cuda::CudaError::NoDevice
        ),
        "{err}"
    );
}

// ------------------------------------------------------------------------------ the data path on a GPU

use gdaki::cuda::{DataPathLaunch, KernelMode, KernelScope, PutStream, StreamOp};

/// One 8-byte put per thread.
fn one_put(dst: gdaki_device::Remote, src: gdaki_device::Local) -> PutStream {
    PutStream {
        dst,
        src,
        len: 8,
        slots: 1,
        first: 0,
        iters: 1,
        threads_per_qp: 0,
        op: StreamOp::Write,
    }
}
use gdaki::{Access, Context, ContextOptions, Provider, QpConfig, QueuePair};
use gdaki_device::status::{CODE_CQE_ERROR, CODE_OK, CODE_TIMEOUT};
use gdaki_layout::Syndrome;

/// A launch shape for every (scope, mode): several threads, warps or blocks share one QP in
/// the shared modes. `GDAKI_GPU_ONLY=warp-exclusive,block-gpu` (say) runs just those, to debug.
fn shapes() -> Vec<DataPathLaunch> {
    let only = std::env::var("GDAKI_GPU_ONLY").ok();
    let wanted = |scope: KernelScope, mode: KernelMode| {
        only.as_ref().is_none_or(|list| {
            list.split(',')
                .any(|s| s.eq_ignore_ascii_case(&format!("{scope:?}-{mode:?}")))
        })
    };
    let mut v = Vec::new();
    for scope in [KernelScope::Thread, KernelScope::Warp, KernelScope::Block] {
        for mode in [KernelMode::Exclusive, KernelMode::Cta, KernelMode::Gpu] {
            if !wanted(scope, mode) {
                continue;
            }
            let (grid, block) = match (scope, mode) {
                (KernelScope::Thread, KernelMode::Exclusive) => (1, 1),
                (KernelScope::Warp, KernelMode::Exclusive) => (1, 32),
                (_, KernelMode::Exclusive) | (_, KernelMode::Cta) => (1, 128),
                (_, KernelMode::Gpu) => (4, 128),
            };
            v.push(DataPathLaunch {
                scope,
                mode,
                grid,
                block,
            });
        }
    }
    v
}

#[test]
fn put_kernels_post_through_the_soft_hca_in_every_scope_and_mode() {
    let Some((gpu, _one)) = gpu_or_skip("put_kernels_post_through_the_soft_hca_in_every_scope_and_mode") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    const LEN: u64 = 64;
    const ITERS: u32 = 16;
    // Each shape streams WRITEs, then READs (`put_bw --read`): the data goes the other way.
    let failures: Vec<String> = shapes()
        .into_iter()
        .flat_map(|launch| [(launch, false), (launch, true)])
        .filter_map(|(launch, read)| {
            // A small ring, so every launch wraps it many times.
            let qp = loopback_qp(&ctx, 256, QpConfig::default());
            let gq = qp.export_gpu(&gpu).unwrap();
            let threads = (launch.grid * launch.block) as usize;
            let src = ctx.alloc_region(threads * LEN as usize, Access::ALL).unwrap();
            let dst = ctx.alloc_region(threads * LEN as usize, Access::ALL).unwrap();
            let data = pattern(threads as u64, threads * LEN as usize);
            // What the stream moves from (`src` for WRITEs, `dst` for READs) and into.
            let (from, into) = if read { (&dst, &src) } else { (&src, &dst) };
            from.write(0, &data).unwrap();
            let _ = writeln!(std::io::stderr(), "put: {launch:?}, read {read}");
            let status = gpu
                .run_put(
                    &[&gq],
                    launch,
                    &PutStream {
                        dst: dst.remote(0),
                        src: src.local(0),
                        len: LEN,
                        slots: threads as u64,
                        first: 0,
                        iters: ITERS,
                        threads_per_qp: 0,
                        op: if read { StreamOp::Read } else { StreamOp::Write },
                    },
                )
                .unwrap()
                .status;
            let outcome = if !status.iter().all(|&s| s == CODE_OK) {
                Err(format!(
                    "statuses {:?}, {:?}",
                    &status[..8.min(status.len())],
                    gq.counters()
                ))
            } else if into.read_vec(0, data.len()).unwrap() != data {
                Err("data differs".into())
            } else if qp.error().is_some() || qp.state() != gdaki::QpState::Rts {
                Err(format!("QP {:?}, {:?}", qp.state(), qp.error()))
            } else {
                Ok(())
            };
            outcome.err().map(|e| format!("{launch:?}, read {read}: {e}"))
        })
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn put_kernel_spreads_blocks_over_several_qps() {
    let Some((gpu, _one)) = gpu_or_skip("put_kernel_spreads_blocks_over_several_qps") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    // 6 blocks over 3 QPs: each QP shared by two blocks (GPU mode), 24 slots for 768 threads,
    // so slots are written many times over.
    let qps: Vec<QueuePair> = (0..3).map(|_| loopback_qp(&ctx, 128, QpConfig::default())).collect();
    let exported: Vec<_> = qps.iter().map(|q| q.export_gpu(&gpu).unwrap()).collect();
    let handles: Vec<&gdaki::GpuQp> = exported.iter().collect();
    const LEN: u64 = 1000;
    const SLOTS: u64 = 24;
    let src = ctx
        .alloc_pinned_region(&gpu, (LEN * SLOTS) as usize, Access::ALL)
        .unwrap();
    let dst = ctx
        .alloc_pinned_region(&gpu, (LEN * SLOTS) as usize, Access::ALL)
        .unwrap();
    let data = pattern(5, (LEN * SLOTS) as usize);
    src.write(0, &data).unwrap();
    let launch = DataPathLaunch {
        scope: KernelScope::Warp,
        mode: KernelMode::Gpu,
        grid: 6,
        block: 128,
    };
    let stream = PutStream {
        dst: dst.remote(0),
        src: src.local(0),
        len: LEN,
        slots: SLOTS,
        first: 7,
        iters: 10,
        threads_per_qp: 0,
        op: StreamOp::Write,
    };
    let run = gpu.run_put(&handles, launch, &stream).unwrap();
    assert_eq!(run.first_failure(), None);
    assert!(run.elapsed > std::time::Duration::ZERO);
    assert_eq!(dst.read_vec(0, data.len()).unwrap(), data);
    for (q, g) in qps.iter().zip(&exported) {
        assert_eq!(q.state(), gdaki::QpState::Rts);
        // 2 blocks x 128 threads x 10 messages per QP, all completed and consumed.
        let c = g.counters().unwrap();
        assert_eq!((c.hca_completed, c.cq_consumed), (2560, 2560), "{c:?}");
    }
    // No handles: an error, not a launch.
    assert!(gpu.run_put::<gdaki::GpuQp>(&[], launch, &stream).is_err());
}

/// Lanes of one warp that post on different QPs at the same moment: thread scope in the shared
/// modes posts with the lanes beside it, which must be only those on its own QP (a group
/// reserves and rings on its leader's QP). Before that was so, lane 1's WQE went into its own
/// ring at the index lane 0 reserved on QP 0, and QP 0's doorbell covered a slot never written.
#[test]
fn lanes_of_a_warp_post_on_different_qps() {
    let Some((gpu, _one)) = gpu_or_skip("lanes_of_a_warp_post_on_different_qps") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    const NQP: usize = 3;
    const LEN: u64 = 48;
    const ITERS: u32 = 6;
    let cases = [
        (KernelScope::Thread, KernelMode::Gpu, 1),
        (KernelScope::Thread, KernelMode::Cta, 1),
        (KernelScope::Thread, KernelMode::Gpu, 5),
        (KernelScope::Warp, KernelMode::Gpu, 32),
    ];
    let failures: Vec<String> = cases
        .iter()
        .enumerate()
        .filter_map(|(c, &(scope, mode, per))| {
            // Every QP is shared by several groups across the grid, so each sees many rounds.
            let qps: Vec<QueuePair> = (0..NQP).map(|_| loopback_qp(&ctx, 64, QpConfig::default())).collect();
            let exported: Vec<_> = qps.iter().map(|q| q.export_gpu(&gpu).unwrap()).collect();
            let handles: Vec<&gdaki::GpuQp> = exported.iter().collect();
            let launch = DataPathLaunch {
                scope,
                mode,
                grid: if mode == KernelMode::Cta { 1 } else { 2 },
                block: 96,
            };
            let threads = (launch.grid * launch.block) as u64;
            let src = ctx
                .alloc_pinned_region(&gpu, (LEN * threads) as usize, Access::ALL)
                .unwrap();
            let dst = ctx
                .alloc_pinned_region(&gpu, (LEN * threads) as usize, Access::ALL)
                .unwrap();
            let data = pattern(40 + c as u64, (LEN * threads) as usize);
            src.write(0, &data).unwrap();
            let _ = writeln!(std::io::stderr(), "{launch:?}, {per} threads per QP");
            let stream = PutStream {
                dst: dst.remote(0),
                src: src.local(0),
                len: LEN,
                slots: threads,
                first: 0,
                iters: ITERS,
                threads_per_qp: per,
                op: StreamOp::Write,
            };
            let run = gpu.run_put(&handles, launch, &stream).unwrap();
            let mut why = Vec::new();
            if let Some((t, code)) = run.first_failure() {
                why.push(format!("thread {t}: {}", gdaki_device::status::Code(code)));
            }
            if dst.read_vec(0, data.len()).unwrap() != data {
                why.push("the data differs".into());
            }
            for (i, (q, g)) in qps.iter().zip(&exported).enumerate() {
                let posts = (0..threads).filter(|t| (t / per as u64) as usize % NQP == i).count() as u64;
                let c = g.counters().unwrap();
                if q.state() != gdaki::QpState::Rts || c.hca_completed != posts * ITERS as u64 {
                    why.push(format!("QP {i}: {:?}, {:?}, {c:?}", q.state(), q.error()));
                }
            }
            (!why.is_empty()).then(|| format!("{launch:?}, {per} per QP: {why:?}"))
        })
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn put_groups_stay_on_one_qp() {
    let Some((gpu, _one)) = gpu_or_skip("put_groups_stay_on_one_qp") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    let gq = qp.export_gpu(&gpu).unwrap();
    let mr = ctx.alloc_region(64, Access::ALL).unwrap();
    let split = |scope, block, per| {
        let launch = DataPathLaunch {
            scope,
            mode: KernelMode::Gpu,
            grid: 1,
            block,
        };
        let stream = PutStream {
            threads_per_qp: per,
            ..one_put(mr.remote(0), mr.local(0))
        };
        gpu.run_put(&[&gq], launch, &stream)
    };
    // A warp, or a block, that would post as a group over two QPs: refused before a launch.
    let e = split(KernelScope::Warp, 64, 16).unwrap_err().to_string();
    assert!(e.contains("16 threads per queue pair"), "{e}");
    assert!(split(KernelScope::Block, 64, 32).is_err());
    assert_eq!(split(KernelScope::Block, 64, 64).unwrap().first_failure(), None);
}

#[test]
fn write_lat_kernel_ping_pongs_between_two_qps() {
    let Some((gpu, _one)) = gpu_or_skip("write_lat_kernel_ping_pongs_between_two_qps") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let cfg = QpConfig {
        timeout: std::time::Duration::from_secs(3),
        ..Default::default()
    };
    let (a, b) = (qp(&ctx, 64, cfg.clone()), qp(&ctx, 64, cfg));
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    let (ga, gb) = (a.export_gpu(&gpu).unwrap(), b.export_gpu(&gpu).unwrap());
    const SIZE: u64 = 100;
    const ITERS: u32 = 300; // the u8 flag wraps
    let bufs: Vec<_> = (0..4)
        .map(|_| ctx.alloc_pinned_region(&gpu, SIZE as usize, Access::ALL).unwrap())
        .collect();
    let (a_post, a_poll, b_post, b_poll) = (&bufs[0], &bufs[1], &bufs[2], &bufs[3]);
    a_post.write(0, &pattern(1, SIZE as usize - 1)).unwrap();
    b_post.write(0, &pattern(2, SIZE as usize - 1)).unwrap();
    let side = |qp, post, poll, peer_poll: &gdaki::MemoryRegion, initiator| cuda::WriteLatSide {
        qp,
        post,
        poll,
        remote: peer_poll.remote(0),
        initiator,
        send: false,
        inline_max: 0,
        blueflame: false,
    };
    // Messages that fit their WQE go inline (perftest's -I): each side's bytes, read once from
    // its post buffer, with each round's flag.
    const INLINE: u64 = 24;
    let inline = [
        cuda::WriteLatSide {
            inline_max: 28,
            ..side(&ga, a_post, a_poll, b_poll, true)
        },
        cuda::WriteLatSide {
            inline_max: 28,
            ..side(&gb, b_post, b_poll, a_poll, false)
        },
    ];
    let run = gpu.run_write_lat(&inline, INLINE, 40).unwrap();
    assert_eq!(run.status, vec![CODE_OK, CODE_OK]);
    for (poll, from) in [(a_poll, 2), (b_poll, 1)] {
        let mut want = pattern(from, INLINE as usize - 1);
        want.push(40);
        assert_eq!(poll.read_vec(0, INLINE as usize).unwrap(), want, "inline messages");
        poll.write(0, &[0; SIZE as usize]).unwrap();
    }
    for (post, from) in [(a_post, 1), (b_post, 2)] {
        post.write(0, &pattern(from, SIZE as usize - 1)).unwrap();
    }
    let sides = [
        side(&ga, a_post, a_poll, b_poll, true),
        side(&gb, b_post, b_poll, a_poll, false),
    ];
    let run = gpu.run_write_lat(&sides, SIZE, ITERS).unwrap();
    assert_eq!(run.status, vec![CODE_OK, CODE_OK]);
    assert_eq!(run.times.len(), 2);
    assert!(run.times[0].windows(2).all(|w| w[1] >= w[0]), "timestamps go forward");
    // Each side received the other's bytes, and the last flag.
    let last = (ITERS as u8).to_le_bytes()[0];
    let mut want_a = pattern(2, SIZE as usize - 1);
    want_a.push(last);
    let mut want_b = pattern(1, SIZE as usize - 1);
    want_b.push(last);
    assert_eq!(a_poll.read_vec(0, SIZE as usize).unwrap(), want_a);
    assert_eq!(b_poll.read_vec(0, SIZE as usize).unwrap(), want_b);

    // A peer that never answers: the initiator's flag wait times out with a status.
    let lonely = [side(&ga, a_post, a_poll, b_poll, true)];
    a_poll.write(0, &[0; SIZE as usize]).unwrap();
    let run = gpu.run_write_lat(&lonely, SIZE, 2).unwrap();
    assert_eq!(run.status, vec![gdaki_device::status::CODE_FLAG_TIMEOUT]);

    // Buffers the kernel touches itself must be GPU-reachable and large enough: refused
    // before anything launches.
    let host = ctx.alloc_region(SIZE as usize, Access::ALL).unwrap();
    let small = ctx.alloc_pinned_region(&gpu, 8, Access::ALL).unwrap();
    for bad in [
        side(&ga, &host, a_poll, b_poll, true),
        side(&ga, a_post, &small, b_poll, true),
    ] {
        let err = gpu.run_write_lat(&[bad], SIZE, 2).unwrap_err();
        assert!(matches!(err, cuda::CudaError::BadArgument { .. }), "{err}");
    }
}

#[test]
fn reference_measurements_run() {
    let Some((gpu, _one)) = gpu_or_skip("reference_measurements_run") else {
        return;
    };
    let rt = gpu.pinned_round_trip(200).unwrap();
    assert_eq!(rt.len(), 199);
    assert!(rt.iter().all(|&ns| ns > 0 && ns < 1_000_000), "{:?}", &rt[..8]);
    assert!(gpu.device_copy(1 << 20, 3, 10).unwrap() > std::time::Duration::ZERO);
    assert_eq!(gpu.synced_copy(5).unwrap().len(), 5);
}

#[test]
fn every_operation_from_gpu_kernels() {
    let Some((gpu, _one)) = gpu_or_skip("every_operation_from_gpu_kernels") else {
        return;
    };
    // The H100 orders GPUDirect RDMA writes for its owner: no DUMP unless modelled.
    let ordering = gpu.rdma_writes_ordering().unwrap();
    let _ = writeln!(std::io::stderr(), "GPUDirect RDMA writes ordering: {ordering}");
    // Every shape on the default device, then (on a few shapes) a device that returns atomic
    // results in host order and a GPU that needs a fenced DUMP before reading fetched data.
    let variants = [
        ("default", ContextOptions::default(), usize::MAX),
        (
            "host-order atomic replies",
            ContextOptions::default().atomic_reply_order(gdaki_layout::AtomicReplyOrder::HostOrder),
            3,
        ),
        (
            "unordered GPUDirect writes",
            ContextOptions::default().unordered_rdma_writes(true),
            3,
        ),
    ];
    let mut failures = Vec::new();
    for (variant, options, shapes_run) in variants {
        let _ = writeln!(std::io::stderr(), "ops variant: {variant}");
        let ctx = Context::open_with(Provider::Soft, options).unwrap();
        failures.extend(
            every_operation_on(&gpu, &ctx, shapes_run)
                .into_iter()
                .map(|f| format!("{variant}: {f}")),
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// [`every_operation_from_gpu_kernels`] on the first `count` shapes with context `ctx`: the
/// failures found.
fn every_operation_on(gpu: &Gpu, ctx: &Context, count: usize) -> Vec<String> {
    shapes()
        .into_iter()
        .take(count)
        .filter_map(|launch| {
            let cfg = QpConfig {
                timeout: std::time::Duration::from_secs(2),
                ..Default::default()
            };
            let qp = loopback_qp(ctx, 1024, cfg);
            let gq = qp.export_gpu(gpu).unwrap();
            let _ = writeln!(std::io::stderr(), "ops: {launch:?}");
            let threads = (launch.grid * launch.block) as usize;
            let remote = ctx.alloc_region(threads * 64, Access::ALL).unwrap();
            // The kernel reads fetched atomic values from its local buffer: map it into the GPU.
            let local = ctx.alloc_pinned_region(gpu, threads * 64, Access::ALL).unwrap();
            local.write(0, &pattern(9, threads * 64)).unwrap();
            let status = gpu.run_ops(&gq, launch, remote.remote(0), local.local(0)).unwrap();
            if !status.iter().all(|&s| s == CODE_OK) {
                let e = format!("statuses {:?}, {:?}", &status[..8.min(status.len())], gq.counters());
                return Some(format!("{launch:?}: {e}"));
            }
            (0..threads as u64).find_map(|t| {
                let at = t * 64;
                let wrong = if remote.read_vec(at, 16).unwrap() != local.read_vec(at, 16).unwrap() {
                    "put"
                } else if remote.read_vec(at + 16, 8).unwrap() != at.to_le_bytes() {
                    "inline put"
                } else if local.read_vec(at + 24, 8).unwrap() != remote.read_vec(at, 8).unwrap() {
                    "get"
                } else if remote.read_vec(at + 24, 8).unwrap() != remote.read_vec(at, 8).unwrap() {
                    "fenced put of what the get fetched"
                } else if remote.load_u64(at + 40).unwrap() != 0 {
                    // signal +1, signal +1, fetch-add 5, compare-swap 7 -> 0.
                    "atomics"
                } else {
                    return None;
                };
                Some(format!("{launch:?}: thread {t}: {wrong}"))
            })
        })
        .collect()
}

#[test]
fn an_error_cqe_reaches_the_kernel_with_its_syndrome() {
    let Some((gpu, _one)) = gpu_or_skip("an_error_cqe_reaches_the_kernel_with_its_syndrome") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    let gq = qp.export_gpu(&gpu).unwrap();
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    let bad = gdaki_device::Remote {
        addr: mr.addr(),
        rkey: mr.rkey() ^ 0x5a5a,
    };
    let launch = DataPathLaunch {
        scope: KernelScope::Thread,
        mode: KernelMode::Exclusive,
        grid: 1,
        block: 1,
    };
    let status = gpu.run_put(&[&gq], launch, &one_put(bad, mr.local(0))).unwrap().status;
    assert_eq!(status, [CODE_CQE_ERROR | Syndrome::RemoteAccess.raw() as u32]);
    assert_eq!(qp.error(), Some(Syndrome::RemoteAccess));
}

#[test]
fn a_wait_on_a_peer_that_never_answers_times_out_in_the_kernel() {
    let Some((gpu, _one)) = gpu_or_skip("a_wait_on_a_peer_that_never_answers_times_out_in_the_kernel") else {
        return;
    };
    // A peer that accepts the transport connection and then never answers.
    let (addr, silent) = common::silent_peer();
    let ctx = Context::open(Provider::Soft).unwrap();
    let cfg = QpConfig {
        timeout: std::time::Duration::from_millis(300),
        retry_timeout: std::time::Duration::from_secs(600),
        ..Default::default()
    };
    let qp = qp(&ctx, 64, cfg);
    qp.connect(&gdaki::Endpoint {
        gid: [0; 16],
        lid: 0,
        qpn: 0x77,
        psn: 0,
        mtu: 4096,
        secret: 0x77,
        rd_atomic: 0,
        addr: Some(addr),
    })
    .unwrap();
    let gq = qp.export_gpu(&gpu).unwrap();
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    let launch = DataPathLaunch {
        scope: KernelScope::Thread,
        mode: KernelMode::Exclusive,
        grid: 1,
        block: 1,
    };
    let started = std::time::Instant::now();
    let status = gpu
        .run_put(&[&gq], launch, &one_put(mr.remote(0), mr.local(0)))
        .unwrap()
        .status;
    assert_eq!(status, [CODE_TIMEOUT]);
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    drop((gq, qp, ctx));
    silent.join().unwrap();
}

// ------------------------------------------------------------------------------ GPU memory

#[test]
fn device_memory_regions_move_through_the_copier() {
    let Some((gpu, _one)) = gpu_or_skip("device_memory_regions_move_through_the_copier") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    const LEN: usize = 5 << 20; // more than the copier's 4 MiB bounce buffer
    let d1 = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
    let d2 = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
    let pinned = ctx.alloc_pinned_region(&gpu, LEN, Access::ALL).unwrap();
    let host = ctx.alloc_region(LEN, Access::ALL).unwrap();
    assert!(d1.is_device_memory() && !pinned.is_device_memory());
    let data = pattern(77, LEN);
    host.write(0, &data).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
    let put = |dst: &gdaki::MemoryRegion, doff: u64, src: &gdaki::MemoryRegion, soff: u64, len: u64| {
        let t = dev.put(dst.remote(doff), src.local(soff), len).unwrap();
        dev.wait(t).unwrap_or_else(|e| panic!("put {len} B: {e}"));
    };
    // host -> device (bounced, chunked), device -> device (one GPU copy), device -> pinned
    // (one GPU copy), pinned -> device, device -> host (bounced); odd sizes and offsets.
    put(&d1, 0, &host, 0, LEN as u64);
    assert_eq!(d1.read_vec(0, LEN).unwrap(), data, "host -> device");
    put(&d2, 3, &d1, 5, 1_000_001);
    assert_eq!(
        d2.read_vec(3, 1_000_001).unwrap(),
        data[5..1_000_006],
        "device -> device"
    );
    put(&pinned, 0, &d2, 3, 777);
    assert_eq!(pinned.read_vec(0, 777).unwrap(), data[5..782], "device -> pinned");
    put(&d2, 4096, &pinned, 0, 777);
    assert_eq!(d2.read_vec(4096, 777).unwrap(), data[5..782], "pinned -> device");
    host.write(0, &[0; 4096]).unwrap();
    put(&host, 1, &d1, 0, 4000);
    assert_eq!(host.read_vec(1, 4000).unwrap(), data[..4000], "device -> host");
    // Inline data into device memory (carried in the copier's descriptor up to 16 bytes, then
    // through the bounce buffer): every length around that bound at every offset of a word.
    // The bytes around each write must stay as they were.
    const WINDOW: u64 = 65536;
    let mut model = d2.read_vec(WINDOW, 64 * 22).unwrap();
    for len in 1..=20usize {
        for off in 0..8usize {
            let at = 64 * len + off;
            let data = pattern((len * 8 + off) as u64, len);
            let t = dev.put_inline(d2.remote(WINDOW + at as u64), &data).unwrap();
            dev.wait(t).unwrap();
            model[at..at + len].copy_from_slice(&data);
            let got = d2.read_vec(WINDOW + 64 * len as u64, 64).unwrap();
            assert_eq!(got, model[64 * len..64 * len + 64], "inline {len} B at +{off}");
        }
    }
    // get: device -> device.
    let t = dev.get(d2.local(8192), d1.remote(16), 64).unwrap();
    dev.wait(t).unwrap();
    assert_eq!(d2.read_vec(8192, 64).unwrap(), data[16..80], "get");
    // Atomics on device memory, results in pinned and in device memory.
    d1.write(0, &40u64.to_ne_bytes()).unwrap();
    assert_eq!(dev.atomic_fetch_add(d1.remote(0), 2, pinned.local(8)).unwrap(), 40);
    // The result goes to device memory, which this CPU poster cannot read: wait, then copy.
    let cas = gdaki_device::AtomicOp::CompareSwap { compare: 42, swap: 7 };
    let t = dev.atomic(cas, d1.remote(0), d2.local(16)).unwrap();
    dev.wait(t).unwrap();
    assert_eq!(d1.load_u64(0).unwrap(), 7);
    assert_eq!(u64::from_be_bytes(d2.read_vec(16, 8).unwrap().try_into().unwrap()), 42);
    // Freeing memory while the copier runs (it is stopped around the free and restarted).
    drop(pinned);
    let extra = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    drop(extra);
    put(&d2, 0, &d1, 0, 4096);
    assert_eq!(d2.read_vec(0, 4096).unwrap()[8..], data[8..4096]);
    assert_eq!(qp.error(), None);
}

#[test]
fn caller_device_memory_registers_once_the_driver_vouches_for_it() {
    let Some((gpu, _one)) = gpu_or_skip("caller_device_memory_registers_once_the_driver_vouches_for_it") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    const LEN: usize = 1 << 20;
    // The caller's allocation (as cudaMalloc would give it).
    let buf = gdaki::cuda::DeviceBuffer::zeroed(&gpu, LEN).unwrap();
    let host = ctx.alloc_region(LEN, Access::ALL).unwrap();
    // SAFETY (each call): the ranges are refused before registration, or lie in `buf`, which
    // outlives the region and every WQE naming it.
    unsafe {
        assert!(
            ctx.register_device(&gpu, host.addr(), 4096, Access::ALL).is_err(),
            "a host address"
        );
        assert!(
            ctx.register_device(&gpu, buf.device_addr() + 4096, LEN, Access::ALL)
                .is_err(),
            "a range past the allocation"
        );
        assert!(
            ctx.register_device(&gpu, buf.device_addr(), 0, Access::ALL).is_err(),
            "no bytes"
        );
    }
    // SAFETY: as above.
    let mr = unsafe { ctx.register_device(&gpu, buf.device_addr() + 64, 65536, Access::ALL) }.unwrap();
    assert!(mr.is_device_memory() && !mr.is_library_owned());
    assert_eq!(mr.gpu_ordinal(), Some(gpu.ordinal()));
    assert!(
        mr.read(0, &mut [0; 8]).is_err(),
        "the library does not read caller memory"
    );
    let data = pattern(91, 65536);
    host.write(0, &data).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
    let t = dev.put(mr.remote(0), host.local(0), 65536).unwrap();
    dev.wait(t).unwrap();
    let mut got = vec![0u8; 65536];
    buf.read(64, &mut got).unwrap();
    assert_eq!(got, data, "host -> caller device memory");
    let t = dev.put(host.remote(65536), mr.local(100), 1000).unwrap();
    dev.wait(t).unwrap();
    assert_eq!(
        host.read_vec(65536, 1000).unwrap(),
        data[100..1100],
        "caller device memory -> host"
    );
    drop(mr);
    drop(buf);
}

#[test]
fn gpu_kernels_put_between_device_memory_regions() {
    let Some((gpu, _one)) = gpu_or_skip("gpu_kernels_put_between_device_memory_regions") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    const LEN: u64 = 1000;
    // WRITEs, then READs (one GPU copy each way).
    let failures: Vec<String> = shapes()
        .into_iter()
        .flat_map(|launch| [(launch, false), (launch, true)])
        .filter_map(|(launch, read)| {
            let qp = loopback_qp(&ctx, 256, QpConfig::default());
            let gq = qp.export_gpu(&gpu).unwrap();
            let threads = (launch.grid * launch.block) as u64;
            let src = ctx
                .alloc_device_region(&gpu, (threads * LEN) as usize, Access::ALL)
                .unwrap();
            let dst = ctx
                .alloc_device_region(&gpu, (threads * LEN) as usize, Access::ALL)
                .unwrap();
            let data = pattern(threads, (threads * LEN) as usize);
            let (from, into) = if read { (&dst, &src) } else { (&src, &dst) };
            from.write(0, &data).unwrap();
            let _ = writeln!(std::io::stderr(), "device-memory put: {launch:?}, read {read}");
            let stream = PutStream {
                dst: dst.remote(0),
                src: src.local(0),
                len: LEN,
                slots: threads,
                first: 0,
                iters: 4,
                threads_per_qp: 0,
                op: if read { StreamOp::Read } else { StreamOp::Write },
            };
            let run = gpu.run_put(&[&gq], launch, &stream).unwrap();
            if let Some((t, c)) = run.first_failure() {
                return Some(format!(
                    "{launch:?}, read {read}: thread {t}: {}",
                    gdaki_device::status::Code(c)
                ));
            }
            (into.read_vec(0, data.len()).unwrap() != data).then(|| format!("{launch:?}, read {read}: data differs"))
        })
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A READ between device memory regions of one process is one GPU copy, as a WRITE is, and
/// the copies keep the QP's order where the GPU would not: a READ sees the WRITE before it,
/// and a WRITE does not change what the READ before it still reads (nothing is waited for in
/// between). Before READs were copies, their bytes went through host memory.
#[test]
fn reads_in_one_process_are_gpu_copies_in_order_with_the_writes() {
    let Some((gpu, _one)) = gpu_or_skip("reads_in_one_process_are_gpu_copies_in_order_with_the_writes") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    const N: usize = 2 << 20;
    let region = || ctx.alloc_device_region(&gpu, 2 * N, Access::ALL).unwrap();
    let (a, b, target, back) = (region(), region(), region(), region());
    let (da, db) = (pattern(1, N), pattern(2, N));
    a.write(0, &da).unwrap();
    b.write(0, &db).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
    let copies = || gdaki_soft::copier::Copier::existing(&gpu).unwrap().stats().copies;
    let before = copies();
    for round in 0..4u64 {
        let (src, off) = if round % 2 == 0 { (&a, 0) } else { (&b, N as u64) };
        dev.put(target.remote(0), src.local(0), N as u64).unwrap();
        dev.get(back.local(off), target.remote(0), N as u64).unwrap();
    }
    dev.quiet().unwrap();
    assert_eq!(copies() - before, 8, "GPU copies for 4 WRITEs and 4 READs");
    assert!(back.read_vec(0, N).unwrap() == da, "the READ after the first WRITE");
    assert!(
        back.read_vec(N as u64, N).unwrap() == db,
        "the READ after the second WRITE"
    );
    assert_eq!(qp.error(), None);
}

/// SENDs between buffers of GPU memory in one process are GPU copies into the receive's
/// buffers (each scattered piece one copy), completed once they landed; a receive in host
/// memory gets the same bytes (by the copier where it maps that memory, else through host
/// memory). Before, every SEND went through host memory twice (gathered, then scattered).
#[test]
fn sends_between_gpu_buffers_are_gpu_copies_into_the_receive() {
    let Some((gpu, _one)) = gpu_or_skip("sends_between_gpu_buffers_are_gpu_copies_into_the_receive") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    const N: usize = 1 << 20;
    let src = ctx.alloc_device_region(&gpu, N, Access::ALL).unwrap();
    let dst = ctx.alloc_device_region(&gpu, 2 * N, Access::ALL).unwrap();
    let host = ctx.alloc_region(N, Access::ALL).unwrap();
    let data = pattern(9, N);
    src.write(0, &data).unwrap();
    let cfg = QpConfig {
        receive: Some(gdaki::ReceiveConfig { size: 16, max_bufs: 3 }),
        ..QpConfig::default()
    };
    let qp = loopback_qp(&ctx, 64, cfg);
    // SAFETY: one poster and one receiver (this thread); the QP outlives both.
    let (tx, rx) = unsafe {
        (
            qp.cpu::<gdaki_device::Exclusive>().unwrap(),
            qp.cpu_receive::<gdaki_device::Exclusive>().unwrap(),
        )
    };
    let copies = || gdaki_soft::copier::Copier::existing(&gpu).unwrap().stats().copies;
    // Sizes from one byte to the whole buffer, at odd offsets, over three receive buffers
    // (the last piece shorter than its buffer).
    for (round, len) in [1usize, 7, 4096, 65_537, N - 3].into_iter().enumerate() {
        let cut = [len / 3 + 1, len / 3 + 6];
        let bufs = [
            (101u64, cut[0] as u32),
            (N as u64 / 2 + 3, (cut[1] - cut[0]) as u32),
            (N as u64 + 11, N as u32),
        ]
        .map(|(at, n)| gdaki_device::RecvBuf {
            local: dst.local(at),
            len: n,
        });
        let pieces = bufs.iter().scan(len, |left, b| {
            let n = (*left).min(b.len as usize);
            *left -= n;
            Some(n)
        });
        let used = pieces.clone().filter(|&n| n > 0).count() as u64;
        let before = copies();
        let r = rx.post_recv(&bufs).unwrap();
        tx.wait(tx.send(src.local(3), len as u64).unwrap()).unwrap();
        let got = rx.poll(r).unwrap();
        assert_eq!(got.bytes as usize, len, "round {round}");
        assert_eq!(
            copies() - before,
            used,
            "round {round} ({len} bytes): a GPU copy per piece"
        );
        let mut at = 0usize;
        for (b, n) in bufs.iter().zip(pieces) {
            let off = b.local.addr - dst.local(0).addr;
            assert!(
                dst.read_vec(off, n).unwrap() == data[3 + at..3 + at + n],
                "round {round}, piece at {at}"
            );
            at += n;
        }
    }
    // Into host memory: the same bytes.
    let r = rx.post_recv_one(host.local(5), 8192).unwrap();
    tx.wait(tx.send(src.local(0), 5000).unwrap()).unwrap();
    assert_eq!(rx.poll(r).unwrap().bytes, 5000);
    assert!(host.read_vec(5, 5000).unwrap() == data[..5000]);
    // One doorbell for copied SENDs and inline ones in turn: the receives complete in order,
    // each with its own count and bytes (an inline SEND's receive waits behind a copy's).
    let batch = tx.deferred();
    let rs: Vec<u64> = (0..8u64)
        .map(|i| rx.post_recv_one(dst.local(i * 70_000), 70_000).unwrap())
        .collect();
    let lens: Vec<usize> = (0..8).map(|i| if i % 2 == 0 { 60_000 + i } else { 9 + i }).collect();
    for (i, &len) in lens.iter().enumerate() {
        if i % 2 == 0 {
            batch.send(src.local(i as u64), len as u64).unwrap();
        } else {
            batch.send_inline(&data[i..i + len]).unwrap();
        }
    }
    batch.commit().unwrap();
    batch.quiet().unwrap();
    for (i, (&r, &len)) in rs.iter().zip(&lens).enumerate() {
        let got = rx.poll(r).unwrap();
        assert_eq!((got.index, got.bytes as usize), (r, len), "receive {i}");
        assert!(
            dst.read_vec(i as u64 * 70_000, len).unwrap() == data[i..i + len],
            "receive {i}'s bytes"
        );
    }
    assert_eq!(qp.error(), None);
}

/// A build that embedded machine code for this GPU's architecture loads gdaki's kernels from it
/// (no driver compile on a machine's first run); any other from the PTX. Either way they run.
#[test]
fn gdaki_kernels_load_from_machine_code_where_the_build_has_it() {
    let Some((gpu, _one)) = gpu_or_skip("gdaki_kernels_load_from_machine_code_where_the_build_has_it") else {
        return;
    };
    let cc = gpu.compute_capability().unwrap();
    let want = match gdaki::ptx::sass_for(cc) {
        Some(_) => cuda::ModuleImage::Sass,
        None => cuda::ModuleImage::Ptx,
    };
    assert_eq!(
        gpu.loaded_from(),
        want,
        "compute capability {cc:?}, SASS for {:?}",
        gdaki::ptx::sass_arch()
    );
    gpu.selftest(64).unwrap();
}

#[test]
fn other_kernels_run_while_the_copier_runs() {
    let Some((gpu, _one)) = gpu_or_skip("other_kernels_run_while_the_copier_runs") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let _d = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    let say = |s: &str| {
        let _ = writeln!(std::io::stderr(), "copier coexistence: {s}");
    };
    say("selftest (launch, synchronous copy back)");
    gpu.selftest(64).unwrap();
    say("device copy (timing events)");
    gpu.device_copy(4096, 2, 4).unwrap();
    say("put kernel on host memory");
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    let gq = qp.export_gpu(&gpu).unwrap();
    let mr = ctx.alloc_region(64, Access::ALL).unwrap();
    let launch = DataPathLaunch {
        scope: KernelScope::Thread,
        mode: KernelMode::Exclusive,
        grid: 1,
        block: 1,
    };
    let run = gpu
        .run_put(&[&gq], launch, &one_put(mr.remote(0), mr.local(8)))
        .unwrap();
    assert_eq!(run.first_failure(), None);
    say("done");
}

#[test]
fn an_unmappable_doorbell_falls_back_to_the_library_proxy() {
    let Some((gpu, _one)) = gpu_or_skip("an_unmappable_doorbell_falls_back_to_the_library_proxy") else {
        return;
    };
    let ctx = Context::open_with(
        Provider::Soft,
        gdaki::ContextOptions::default().unmappable_doorbell(true),
    )
    .unwrap();
    const LEN: u64 = 64;
    let failures: Vec<String> = shapes()
        .into_iter()
        .filter(|l| l.mode == KernelMode::Gpu)
        .filter_map(|launch| {
            let qp = loopback_qp(&ctx, 256, QpConfig::default());
            assert_eq!(qp.handler(), gdaki::DoorbellHandler::Gpu);
            let gq = qp.export_gpu(&gpu).unwrap();
            assert!(qp.fell_back(), "the export did not fall back");
            assert_eq!(qp.handler(), gdaki::DoorbellHandler::CpuProxy);
            let threads = (launch.grid * launch.block) as usize;
            let src = ctx.alloc_region(threads * LEN as usize, Access::ALL).unwrap();
            let dst = ctx.alloc_region(threads * LEN as usize, Access::ALL).unwrap();
            let data = pattern(threads as u64 + 11, threads * LEN as usize);
            src.write(0, &data).unwrap();
            let _ = writeln!(std::io::stderr(), "put through the fallback proxy: {launch:?}");
            let stream = PutStream {
                dst: dst.remote(0),
                src: src.local(0),
                len: LEN,
                slots: threads as u64,
                first: 0,
                iters: 8,
                threads_per_qp: 0,
                op: StreamOp::Write,
            };
            let run = gpu.run_put(&[&gq], launch, &stream).unwrap();
            let rung = qp.fallback_proxy_counters().unwrap().doorbells;
            if let Some((t, c)) = run.first_failure() {
                Some(format!("{launch:?}: thread {t}: {}", gdaki_device::status::Code(c)))
            } else if dst.read_vec(0, data.len()).unwrap() != data {
                Some(format!("{launch:?}: data differs"))
            } else if rung == 0 {
                Some(format!("{launch:?}: the proxy rang no doorbell"))
            } else {
                None
            }
        })
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn copier_lists_copy_every_size_and_alignment_in_order() {
    let Some((gpu, _one)) = gpu_or_skip("copier_lists_copy_every_size_and_alignment_in_order") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let src = ctx.alloc_device_region(&gpu, 64 << 10, Access::ALL).unwrap();
    let dst = ctx.alloc_device_region(&gpu, 256 << 10, Access::ALL).unwrap();
    let data = pattern(11, 64 << 10);
    src.write(0, &data).unwrap();
    let copier = gdaki_soft::copier::Copier::of(&gpu).unwrap();
    let mut want = vec![0u8; 256 << 10];
    // Small copies side by side travel as lists: far fewer descriptors than copies.
    let before = copier.stats();
    let mut last = 0;
    for i in 0..512u64 {
        let (to, from) = (200_000 + i * 16, i * 8);
        want[to as usize..to as usize + 8].copy_from_slice(&data[from as usize..from as usize + 8]);
        // SAFETY: both ranges lie inside the two live device regions of this GPU, which do not
        // overlap; nothing else touches them until the copies are done (settle below).
        last = unsafe { copier.submit_copy(dst.addr() + to, src.addr() + from, 8) }.unwrap();
    }
    copier.flush().unwrap();
    copier.settle(last).unwrap();
    let batched = copier.stats();
    assert!(batched.posted - before.posted <= 512 / 8, "{before:?} -> {batched:?}");
    let before = batched;
    // Sizes around the lane (64 B) and list (512 B) limits, at odd offsets; every fifth copy
    // lands on bytes an earlier one wrote (the later must win, also within one list).
    let sizes = [1u64, 3, 8, 15, 16, 17, 63, 64, 65, 100, 1000, 4095, 4096, 4097, 9000];
    let (mut rng, mut at) = (0x9e37_79b9_7f4a_7c15u64, 0u64);
    for i in 0..3000u64 {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let len = sizes[(rng >> 33) as usize % sizes.len()];
        let from = (rng >> 13) % ((64 << 10) - len);
        let to = if i % 5 == 4 {
            at.saturating_sub(len + (rng >> 50) % 64)
        } else {
            at + (rng >> 58)
        };
        let to = to.min(190_000 - len);
        at = (to + len) % 180_000;
        want[to as usize..(to + len) as usize].copy_from_slice(&data[from as usize..(from + len) as usize]);
        // SAFETY: both ranges lie inside the two live device regions of this GPU, which do not
        // overlap; nothing else touches them until the copies are done (settle below).
        last = unsafe { copier.submit_copy(dst.addr() + to, src.addr() + from, len) }.unwrap();
    }
    // A chain of rewrites of the same bytes, each ordered after the one before on the GPU.
    for k in 0..64u64 {
        let to = 100_000;
        want[to..to + 24].copy_from_slice(&data[k as usize * 24..k as usize * 24 + 24]);
        // SAFETY: as above.
        last = unsafe { copier.submit_copy(dst.addr() + to as u64, src.addr() + k * 24, 24) }.unwrap();
    }
    copier.flush().unwrap();
    copier.settle(last).unwrap();
    let stats = copier.stats();
    assert!(stats.ordered > before.ordered, "{stats:?}");
    let got = dst.read_vec(0, 256 << 10).unwrap();
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("byte {i}: {} != {}", got[i], want[i]);
    }
}

/// A lone small copy (nothing else ready behind it) is served by the warp that fetched it, not
/// handed to a worker warp through device memory: that hand-off was most of a small write's
/// latency into GPU memory. Large copies still go to the workers, and a lone small copy onto
/// bytes a large one is still writing lands after it.
#[test]
fn a_lone_small_copy_is_served_by_the_warp_that_fetched_it() {
    let Some((gpu, _one)) = gpu_or_skip("a_lone_small_copy_is_served_by_the_warp_that_fetched_it") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let src = ctx.alloc_device_region(&gpu, 4 << 20, Access::ALL).unwrap();
    let dst = ctx.alloc_device_region(&gpu, 4 << 20, Access::ALL).unwrap();
    let data = pattern(21, 4 << 20);
    src.write(0, &data).unwrap();
    let copier = gdaki_soft::copier::Copier::of(&gpu).unwrap();
    // SAFETY (every submit below): both ranges lie inside the two live device regions of this
    // GPU, which do not overlap; nothing else touches them until the copies are settled.
    let lone = |to: u64, from: u64, len: u64| {
        let n = unsafe { copier.submit_copy(dst.addr() + to, src.addr() + from, len) }.unwrap();
        copier.flush().unwrap();
        copier.settle(n).unwrap();
        copier.served_by_mirror(n).expect("answer still in its slot")
    };
    for (len, mirror) in [(1u64, true), (8, true), (256, true), (4096, false), (64 << 10, false)] {
        for round in 0..4u64 {
            let (to, from) = (round * 8192 + 3, round * 64 + 1);
            assert_eq!(lone(to, from, len), mirror, "{len} B, round {round}");
            let got = dst.read_vec(to, len as usize).unwrap();
            assert_eq!(
                got,
                data[from as usize..(from + len) as usize],
                "{len} B, round {round}"
            );
        }
    }
    // Small copies onto the start of a large one just submitted: each must land last, whoever
    // serves it (the fetching warp only once the large one is done).
    let mut want = dst.read_vec(0, 4 << 20).unwrap();
    for round in 0..16u64 {
        let big = 3 << 20;
        let from = round * 4096;
        want[..big as usize].copy_from_slice(&data[from as usize..(from + big) as usize]);
        // SAFETY: as above.
        unsafe { copier.submit_copy(dst.addr(), src.addr() + from, big) }.unwrap();
        copier.flush().unwrap();
        let small = 64 + round;
        want[..8].copy_from_slice(&data[small as usize..small as usize + 8]);
        // SAFETY: as above.
        let n = unsafe { copier.submit_copy(dst.addr(), src.addr() + small, 8) }.unwrap();
        copier.flush().unwrap();
        copier.settle(n).unwrap();
        let got = dst.read_vec(0, big as usize).unwrap();
        assert!(
            got == want[..big as usize],
            "round {round}: the small copy did not land last"
        );
    }
}

/// A small copy and an 8-byte store ordered after it, posted together (a message and its flag:
/// a socket's chunk and its count), are both served by the warp that fetched them, found in
/// one look at the ring, in order:
/// handed to worker warps, the pair cost two hand-offs and a wait between them, the larger part
/// of a socket's 64-byte latency into GPU memory. A large copy's flag still lands after it.
#[test]
fn a_small_copy_and_its_flag_are_served_by_the_warp_that_fetched_them() {
    let name = "a_small_copy_and_its_flag_are_served_by_the_warp_that_fetched_them";
    let Some((gpu, _one)) = gpu_or_skip(name) else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let src = ctx.alloc_device_region(&gpu, 4 << 20, Access::ALL).unwrap();
    let dst = ctx.alloc_device_region(&gpu, 4 << 20, Access::ALL).unwrap();
    let data = pattern(23, 4 << 20);
    src.write(0, &data).unwrap();
    let copier = gdaki_soft::copier::Copier::of(&gpu).unwrap();
    let flag_at = dst.addr() + (4 << 20) - 64;
    // One copy and its flag, settled; whether each was served by the fetching warp, and
    // whether it found both in one look at the ring (the same `seen` stamp).
    let pair = |to: u64, from: u64, len: u64, flag: u64| {
        // SAFETY: both ranges and the flag's 8 bytes lie inside the two live device regions of
        // this GPU, which do not overlap, and not in each other; nothing else touches them until
        // the store (ordered after the copy) is settled.
        let (copy, store) = unsafe {
            let copy = copier.submit_copy(dst.addr() + to, src.addr() + from, len).unwrap();
            (copy, copier.submit_store(flag_at, &flag.to_le_bytes()).unwrap())
        };
        copier.settle(store).unwrap();
        let seen = |n| copier.stamps(n).expect("answer still in its slot")[gdaki_layout::copy::STAMP_SEEN];
        (
            copier.served_by_mirror(copy).expect("answer still in its slot"),
            copier.served_by_mirror(store).expect("answer still in its slot"),
            seen(copy) == seen(store),
        )
    };
    // Rounds whose flag the fetching warp found a look after its message: the copier publishes
    // the store before the list and marks the list (`SPAN_FLAG_FOLLOWS`), and a look that finds
    // the list without its flag (the lanes' loads are not ordered) looks again at the flag's
    // slot, so there are none (1 to 4 of 192 published the other way round; now and then one,
    // published in this order but unmarked).
    let mut apart = 0;
    for (len, fetcher) in [(8u64, true), (64, true), (256, true), (64 << 10, false)] {
        // Enough rounds that a pair the warp could find apart would be, in some.
        for round in 0..64u64 {
            let (to, from, flag) = (round * 8192 + 3, round * 64 + 1, len << 8 | round);
            let (copy, store, together) = pair(to, from, len, flag);
            if fetcher && !together {
                apart += 1;
            }
            if fetcher {
                assert!(copy && store, "{len} B, round {round}: copy {copy}, flag {store}");
            } else {
                assert!(!copy, "{len} B, round {round}: a large copy went to the fetching warp");
            }
            let got = dst.read_vec(to, len as usize).unwrap();
            assert_eq!(
                got,
                data[from as usize..(from + len) as usize],
                "{len} B, round {round}"
            );
            let got = dst.read_vec(flag_at - dst.addr(), 8).unwrap();
            assert_eq!(got, flag.to_le_bytes(), "{len} B, round {round}");
        }
    }
    assert_eq!(apart, 0, "rounds of 192 whose flag was fetched apart from its message");
}

#[test]
fn copier_orders_what_needs_order() {
    let Some((gpu, _one)) = gpu_or_skip("copier_orders_what_needs_order") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let src = ctx.alloc_device_region(&gpu, 1 << 20, Access::ALL).unwrap();
    let dst = ctx.alloc_device_region(&gpu, 1 << 20, Access::ALL).unwrap();
    let pinned = ctx.alloc_pinned_region(&gpu, 4096, Access::ALL).unwrap();
    let data = pattern(5, 1 << 20);
    src.write(0, &data).unwrap();
    let qp = loopback_qp(&ctx, 1024, QpConfig::default());
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
    for round in 0..20u64 {
        // Many small copies in flight at once (served by different warps, answered in any
        // order), then a large one over the same bytes (it must land after them) and a small
        // one over its start (it must land last: RC writes land in order, no fence needed).
        for i in 0..400u64 {
            dev.put(dst.remote(i * 8), src.local(8 * ((i + round) % 400)), 8)
                .unwrap();
        }
        dev.put(dst.remote(0), src.local(4096), 256 << 10).unwrap();
        let t = dev.put(dst.remote(0), src.local(8 * round), 8).unwrap();
        dev.wait(t).unwrap(); // CQEs come in order: every put above is done too
        let got = dst.read_vec(0, 256 << 10).unwrap();
        let r = 8 * round as usize;
        assert_eq!(got[..8], data[r..r + 8], "round {round}: fenced put");
        assert_eq!(got[8..], data[4096 + 8..4096 + (256 << 10)], "round {round}: large put");
        // An atomic after a put to its target sees the put (the HCA executes in order).
        pinned.write(0, &(round * 10).to_ne_bytes()).unwrap();
        dev.put(dst.remote(512 << 10), pinned.local(0), 8).unwrap();
        let old = dev
            .atomic_fetch_add(dst.remote(512 << 10), 1, pinned.local(64))
            .unwrap();
        assert_eq!(old, round * 10, "round {round}: the atomic overtook the put before it");
    }
    assert_eq!(qp.error(), None);
}

/// An inline WRITE into GPU memory behind a put's GPU copy is a store the copier lands after
/// the copy, without the engine waiting for the copy first: an observer on the GPU (a stream
/// that waits for the flag, then copies the put's target) finds the whole put each round. If
/// the copier served the store unordered, the observer would copy the target while the put
/// still wrote it (a 4 MiB copy takes microseconds; a store, one).
#[test]
fn inline_flags_land_after_the_puts_before_them() {
    use cudarc::driver::sys;
    use gdaki::cuda::{stream_wait_u32, StreamWait};
    let Some((gpu, _one)) = gpu_or_skip("inline_flags_land_after_the_puts_before_them") else {
        return;
    };
    const N: usize = 4 << 20;
    const ROUNDS: u32 = 20;
    let ctx = Context::open(Provider::Soft).unwrap();
    let src = ctx.alloc_device_region(&gpu, 2 * N, Access::ALL).unwrap();
    let dst = ctx.alloc_device_region(&gpu, N, Access::ALL).unwrap();
    let flag = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    let seen = cuda::DeviceBuffer::zeroed(&gpu, N).unwrap();
    let data = pattern(9, 2 * N);
    src.write(0, &data).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
    let observer = gpu.context().new_stream().unwrap();
    let stores = || gdaki_soft::copier::Copier::existing(&gpu).unwrap().stats().stores;
    let before = stores();
    for round in 1..=ROUNDS {
        // The observer first: it waits for this round's flag, then copies the target.
        gpu.context().bind_to_thread().unwrap();
        // SAFETY: the flag word and both ranges lie in live allocations of this GPU until the
        // stream is idle (synchronised below, before the next round).
        unsafe {
            stream_wait_u32(&observer, flag.remote(0).addr, StreamWait::Geq, round).unwrap();
            sys::cuMemcpyDtoDAsync_v2(seen.device_addr(), dst.remote(0).addr, N, observer.cu_stream())
                .result()
                .unwrap();
        }
        // Each round puts the other half of `src`, so a stale or torn target shows.
        let from = (round as usize % 2) * N;
        dev.put(dst.remote(0), src.local(from as u64), N as u64).unwrap();
        let t = dev.put_inline(flag.remote(0), &round.to_ne_bytes()).unwrap();
        dev.wait(t).unwrap();
        observer.synchronize().unwrap();
        let mut got = vec![0u8; N];
        seen.read(0, &mut got).unwrap();
        assert!(
            got == data[from..from + N],
            "round {round}: the flag landed before the put's bytes"
        );
    }
    assert_eq!(
        stores() - before,
        u64::from(ROUNDS),
        "each flag was a store behind the put's copy"
    );
    assert_eq!(qp.error(), None);
}

/// A WRITE gathered from a message and a short tail (a socket frame from registered memory:
/// its bytes, then the padding and trailer from the staging ring) is one copy with a tail, not
/// a copy and a store ordered after it: the tail lands last, so a poller of its last word
/// sees the whole message, whether the copier's fetching warp, one worker warp or the warps
/// of several blocks move it.
#[test]
fn a_write_gathered_with_a_tail_is_one_copy_that_lands_the_tail_last() {
    use cudarc::driver::sys;
    use gdaki::cuda::{stream_wait_u32, StreamWait};
    let Some((gpu, _one)) = gpu_or_skip("a_write_gathered_with_a_tail_is_one_copy_that_lands_the_tail_last") else {
        return;
    };
    const N: usize = 4 << 20;
    let ctx = Context::open(Provider::Soft).unwrap();
    let src = ctx.alloc_device_region(&gpu, 2 * N, Access::ALL).unwrap();
    let tail = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    let dst = ctx.alloc_device_region(&gpu, N + 4096, Access::ALL).unwrap();
    let seen = cuda::DeviceBuffer::zeroed(&gpu, N).unwrap();
    let data = pattern(12, 2 * N);
    src.write(0, &data).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
    let observer = gpu.context().new_stream().unwrap();
    let copier = gdaki_soft::copier::Copier::existing(&gpu).unwrap();
    let before = copier.stats();
    let mut round = 0u32;
    // A lone small one (the fetching warp's), one worker warp's, several blocks'.
    for len in [96usize, 3000, N] {
        for _ in 0..4 {
            round += 1;
            // The tail: padding, then a 16-byte trailer whose first word is the round.
            let mut trailer = [0u8; 128];
            trailer[112..116].copy_from_slice(&round.to_ne_bytes());
            tail.write(0, &trailer).unwrap();
            let flag = dst.remote(len as u64 + 112).addr;
            gpu.context().bind_to_thread().unwrap();
            // SAFETY: the flag word and both ranges lie in live allocations of this GPU until
            // the stream is idle (synchronised below, before the next round).
            unsafe {
                stream_wait_u32(&observer, flag, StreamWait::Geq, round).unwrap();
                sys::cuMemcpyDtoDAsync_v2(seen.device_addr(), dst.remote(0).addr, len, observer.cu_stream())
                    .result()
                    .unwrap();
            }
            // Each round takes the other half of `src`, so a stale or torn message shows.
            let from = (round as usize % 2) * N;
            let i = dev.reserve(1).unwrap();
            let parts = ((src.local(from as u64), len as u32), (tail.local(0), 128));
            dev.wqe_prepare_write_gather(i, dst.remote(0), parts.0, parts.1, 0);
            dev.mark_ready(i, i + 1).unwrap();
            dev.submit(i + 1).unwrap();
            dev.wait(i).unwrap();
            observer.synchronize().unwrap();
            let mut got = vec![0u8; len];
            seen.read(0, &mut got).unwrap();
            assert!(
                got == data[from..from + len],
                "{len} bytes, round {round}: the tail landed first"
            );
            assert_eq!(dst.read_vec(len as u64, 128).unwrap(), trailer, "{len} bytes: the tail");
        }
    }
    let after = copier.stats();
    assert_eq!(after.stores, before.stores, "a gathered WRITE took an ordered store");
    assert_eq!(after.copies - before.copies, u64::from(round), "one copy a WRITE");
    assert_eq!(qp.error(), None);
}

/// GPU memory reaches a NIC through a dma-buf export of whole pages: device buffers start on a
/// page and span whole pages, they export where the GPU supports dma-buf, and a range that does
/// not start and end on page boundaries is refused with a clear error before the driver is asked.
#[test]
fn device_buffers_export_as_dma_buf_in_whole_pages() {
    let Some((gpu, _one)) = gpu_or_skip("device_buffers_export_as_dma_buf_in_whole_pages") else {
        return;
    };
    // Sizes cuMemAlloc sub-allocates (unaligned bases are possible) and one it places whole.
    for len in [64, 4096, 5000, 3 << 20] {
        let buf = cuda::DeviceBuffer::zeroed(&gpu, len).expect("allocation");
        assert_eq!(buf.device_addr() % 4096, 0, "{len} bytes at {:#x}", buf.device_addr());
        assert_eq!(buf.len(), len.next_multiple_of(4096));
        let mut back = vec![1u8; buf.len()];
        buf.read(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0), "zeroed");
        let supported = cuda::probe().unwrap().gpus[0].dma_buf;
        match cuda::DmaBuf::export(&gpu, buf.device_addr(), buf.len()) {
            Ok(fd) => {
                use std::os::fd::AsRawFd;
                assert!(supported && fd.fd().as_raw_fd() >= 0);
            }
            Err(e) => assert!(!supported, "dma-buf is supported, but exporting failed: {e}"),
        }
        if supported {
            // A range inside the buffer that is not page-aligned: the pages around it.
            let (_, offset) = cuda::DmaBuf::covering(&gpu, buf.device_addr() + 64, 100).expect("covering export");
            assert_eq!(offset, 64);
        }
        for (addr, n) in [(buf.device_addr() + 64, 4096), (buf.device_addr(), 100)] {
            let err = cuda::DmaBuf::export(&gpu, addr, n).unwrap_err();
            assert!(
                matches!(err, cuda::CudaError::BadArgument { .. }) && err.to_string().contains("whole pages"),
                "{err}"
            );
        }
    }
}

/// The soft HCA reads queues with the CPU: rings in GPU memory are refused with the reason and
/// the way out, and nothing is held afterwards (the CQ the refused QP claimed serves the next).
#[test]
fn the_soft_hca_refuses_rings_in_gpu_memory() {
    let Some((gpu, _one)) = gpu_or_skip("the_soft_hca_refuses_rings_in_gpu_memory") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let rings = gdaki::Rings::Gpu(gpu.clone());
    let err = ctx.create_cq_in(64, &rings).unwrap_err();
    assert!(
        matches!(err, gdaki::Error::Device { .. }) && format!("{err:#}").contains("host memory"),
        "{err:#}"
    );
    let cq = ctx.create_cq(64).unwrap();
    let host = QpConfig {
        sq_size: 64,
        ..Default::default()
    };
    let err = ctx.create_qp(&cq, QpConfig { rings, ..host.clone() }).unwrap_err();
    assert!(matches!(err, gdaki::Error::Device { .. }), "{err:#}");
    let qp = ctx.create_qp(&cq, host).unwrap();
    assert!(!qp.rings_in_gpu_memory());
}

/// Loading your own PTX: a module that declares functions it does not define, or has no
/// kernels, is refused with the reason; a kernel it lacks is named; arguments the kernel's GPU
/// cannot reach are refused before anything launches.
#[test]
fn own_modules_are_checked_before_they_load_or_launch() {
    let Some((gpu, _one)) = gpu_or_skip("own_modules_are_checked_before_they_load_or_launch") else {
        return;
    };
    let head = ".version 8.4\n.target sm_90\n.address_size 64\n";
    let err = gpu
        .load_module(&format!(
            "{head}.extern .func panic_bounds_check()\n.visible .entry k()\n{{\nret;\n}}\n"
        ))
        .unwrap_err();
    assert!(err.to_string().contains("panic_bounds_check"), "{err}");
    let err = gpu.load_module(head).unwrap_err();
    assert!(err.to_string().contains("no .entry"), "{err}");

    let module = gpu.load_module(gdaki::ptx::ptx().unwrap()).unwrap();
    assert!(module.entry_points().iter().any(|e| e == "gdaki_write_lat"));
    let err = module.kernel("no_such_kernel").unwrap_err();
    assert!(err.to_string().contains("no_such_kernel"), "{err}");

    // A host region no GPU reaches, as a pointer argument: refused at launch, nothing runs.
    let ctx = Context::open(Provider::Soft).unwrap();
    let host = ctx.alloc_region(4096, Access::ALL).unwrap();
    let kernel = module.kernel("gdaki_store_loop").unwrap();
    let args = cuda::Args::new().region(&host).u32(0).u32(1);
    // SAFETY: refused before launching (the region is not GPU-reachable).
    let err = unsafe { kernel.run(cuda::Dims::linear(1, 1), args) }.unwrap_err();
    assert!(err.to_string().contains("no GPU can reach"), "{err}");
}

/// The posting rate's ring-order reference writes every record of every ring, each with its own
/// index, in the order posters sharing a QP would: 2 QPs, 32 threads each, 2 rounds fill two
/// 64-record rings exactly (a wrong mapping leaves records unwritten or writes one twice).
#[test]
fn the_ring_order_store_loop_fills_each_ring_as_its_posters_would() {
    let Some((gpu, _one)) = gpu_or_skip("the_ring_order_store_loop_fills_each_ring_as_its_posters_would") else {
        return;
    };
    let module = gpu.load_module(gdaki::ptx::ptx().unwrap()).unwrap();
    let kernel = module.kernel("gdaki_store_loop_rings").unwrap();
    let (qps, stride, iters, ring_log) = (2u32, 32u32, 2u32, 6u32);
    let buf = cuda::DeviceBuffer::zeroed(&gpu, (qps as usize * 64) << ring_log).unwrap();
    let args = cuda::Args::new()
        .buffer(&buf)
        .u32(ring_log)
        .u32(qps)
        .u32(stride)
        .u32(iters);
    // SAFETY: `gdaki_store_loop_rings(base, ring_log, qps, stride, iters)` writes `qps` rings of
    // `64 << ring_log` bytes from `base`, which `buf` holds.
    unsafe { kernel.run(cuda::Dims::linear(2, 32), args) }.unwrap();
    let mut back = vec![0u8; buf.len()];
    buf.read(0, &mut back).unwrap();
    for (m, rec) in back.chunks(64).enumerate() {
        let words: Vec<u64> = rec
            .chunks(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        // The first segments as an 8-byte put's WQE; the slot's last 16 bytes untouched.
        for seg in 0..4 {
            let want = if seg < gdaki_device::perf::STORE_LOOP_SEGMENTS {
                (m as u64, seg as u64)
            } else {
                (0, 0)
            };
            assert_eq!((words[2 * seg], words[2 * seg + 1]), want, "record {m}, segment {seg}");
        }
    }
}

// ------------------------------------------------------------------------------ own kernels beside the copier

/// A kernel of the user's: `own_store(dst, value)` stores `value` at `dst`.
const OWN_STORE_PTX: &str = ".version 8.4\n.target sm_90\n.address_size 64\n\
.visible .entry own_store(.param .u64 dst, .param .u32 value)\n{\n\
.reg .b64 %rd<3>;\n.reg .b32 %r<2>;\n\
ld.param.u64 %rd1, [dst];\nld.param.u32 %r1, [value];\n\
cvta.to.global.u64 %rd2, %rd1;\nst.global.u32 [%rd2], %r1;\nret;\n}\n";

/// Runs `f`, or aborts the test process with `what` if it has not returned within 60 s: a
/// kernel that never ends would otherwise hang the run with no word of which one.
fn within_a_minute<T: Send>(what: &str, f: impl FnOnce() -> T + Send) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(v) => v,
            Err(_) => {
                eprintln!("FAILED: {what} did not finish within 60 s; aborting");
                std::process::abort();
            }
        }
    })
}

/// Stores a word into `region` (GPU memory of a soft HCA with a running copier) from a kernel
/// of `module`, and reads it back.
fn own_store_into(module: &cuda::Module, region: &gdaki::MemoryRegion, value: u32) {
    let kernel = module.kernel("own_store").unwrap();
    let args = cuda::Args::new().region(region).u32(value);
    // SAFETY: `own_store(dst, value)` writes the 4 bytes at `dst`, the region's first.
    within_a_minute("a kernel of an own module", || unsafe {
        kernel.run(cuda::Dims::linear(1, 1), args)
    })
    .unwrap();
    let mut back = [0u8; 4];
    region.read(0, &mut back).unwrap();
    assert_eq!(u32::from_le_bytes(back), value);
}

/// A module of the user's, loaded while the soft HCA's resident copier runs (GPU memory was
/// registered first), launches and finishes as it does without one, and unloads: neither its
/// load, its launch nor its unload waits for the copier, which never ends.
#[test]
fn an_own_module_loaded_beside_the_copier_runs() {
    let Some((gpu, _one)) = gpu_or_skip("an_own_module_loaded_beside_the_copier_runs") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let region = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    let module = within_a_minute("loading an own module", || gpu.load_module(OWN_STORE_PTX)).unwrap();
    own_store_into(&module, &region, 0x5eed_0001);
    // And again once a second region (the copier is already running) exists.
    let again = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    own_store_into(&module, &again, 0x5eed_0002);
    // Unloading a module waits for every kernel of the context: the copier's too, unless it
    // is stopped around the unload.
    within_a_minute("unloading an own module beside the copier", move || drop(module));
    own_store_into(
        &within_a_minute("loading it again", || gpu.load_module(OWN_STORE_PTX)).unwrap(),
        &region,
        0x5eed_0004,
    );
}

/// The same module loaded before any copier exists, its kernel launched once the copier runs.
#[test]
fn an_own_module_loaded_before_the_copier_runs_beside_it() {
    let Some((gpu, _one)) = gpu_or_skip("an_own_module_loaded_before_the_copier_runs_beside_it") else {
        return;
    };
    let module = gpu.load_module(OWN_STORE_PTX).unwrap();
    let ctx = Context::open(Provider::Soft).unwrap();
    let region = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    own_store_into(&module, &region, 0x5eed_0003);
}

/// A second handle to the same GPU, opened and dropped while a copier runs: it loads gdaki's
/// kernels again, makes a stream and unloads them, and none of it waits for the copier.
#[test]
fn a_second_gpu_handle_comes_and_goes_beside_the_copier() {
    let Some((gpu, _one)) = gpu_or_skip("a_second_gpu_handle_comes_and_goes_beside_the_copier") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let region = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    let second = within_a_minute("opening a second handle", || Gpu::open(0)).unwrap();
    second.selftest(32).unwrap();
    within_a_minute("a stream of the second handle", || second.context().new_stream()).unwrap();
    within_a_minute("dropping the second handle", move || drop(second));
    own_store_into(&gpu.load_module(OWN_STORE_PTX).unwrap(), &region, 0x5eed_0005);
}
