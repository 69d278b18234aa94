//! Replays of stream-triggered posting (CUDA graphs, and the same on a CPU stream): a recorded
//! sequence of posts and waits launched many times, the queue pairs' ring positions moving on
//! at every launch, every byte checked; and the rules a recording refuses.
mod common;
use common::{cpu_stream as stream, loopback_qp, pattern, soft_loopback as setup};
use std::time::Duration;

use gdaki::stream::{CpuStream, MemOps, Replay, StreamError, StreamQp, WorkRequest};
use gdaki::{Access, Context, MemoryRegion, Provider, QpConfig, ReceiveConfig};

/// Waits (bounded) until WQE `t` of `sq` has completed: a stream that has run its doorbell has
/// not necessarily seen the HCA complete the WQE.
fn settle(sq: &mut StreamQp<'_>, t: u64) {
    let start = std::time::Instant::now();
    while !sq.completed(t).unwrap() {
        assert!(start.elapsed() < Duration::from_secs(10), "WQE {t} did not complete");
        std::thread::yield_now();
    }
}

const PAIRS: u64 = 1000;
const SLICE: u64 = 256;
const DST: u64 = 512 * 1024;

/// Records PAIRS puts, each followed by a wait for it, from slice i of the region to slice i
/// at DST.
fn record_pairs(sq: &mut StreamQp<'_>, s: &mut CpuStream, mr: &MemoryRegion) -> Replay {
    // SAFETY: the recording names no memory of the test's (only the queue pair's).
    unsafe { s.begin_recording() }.unwrap();
    for i in 0..PAIRS {
        let t = sq
            .put(s, mr.remote(DST + i * SLICE), mr.local(i * SLICE), SLICE as u32)
            .unwrap();
        sq.wait(s, t).unwrap();
    }
    s.end_recording().unwrap()
}

#[test]
fn a_recording_of_a_thousand_puts_and_waits_replays_a_hundred_times_with_every_byte_checked() {
    let (_ctx, qp, mr) = setup(1024);
    let mut s = stream();
    // SAFETY: the only poster of `qp`; the stream is synchronized before it goes.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    let mut replay = record_pairs(&mut sq, &mut s, &mr);
    // Recording posted nothing and ran nothing.
    assert_eq!(sq.queued(), 0);
    s.synchronize().unwrap();
    assert_eq!(s.done(), 0);
    let len = (PAIRS * SLICE) as usize;
    for launch in 0..100u64 {
        let data = pattern(launch + 1, len);
        mr.write(0, &data).unwrap();
        mr.write(DST, &vec![0; len]).unwrap();
        let tickets = replay.launch(&mut [&mut sq]).unwrap();
        assert_eq!(tickets, vec![launch * PAIRS..(launch + 1) * PAIRS]);
        s.synchronize().unwrap();
        assert!(sq.completed(tickets[0].end - 1).unwrap());
        let mut got = vec![0; len];
        mr.read(DST, &mut got).unwrap();
        assert!(got == data, "launch {launch}: the bytes that landed differ");
    }
    assert_eq!(replay.launches(), 100);
    // 100 launches of 1000 WQEs each crossed the 16-bit counters and the ring many times.
    assert_eq!(sq.queued(), 100 * PAIRS);
}

#[test]
fn launches_queue_up_behind_each_other_within_the_window() {
    // A send queue of twice a launch: the CPU prepares the next launch while one runs.
    let (_ctx, qp, mr) = setup(2048);
    let data = pattern(7, (PAIRS * SLICE) as usize);
    mr.write(0, &data).unwrap();
    let mut s = stream();
    // SAFETY: as above.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    let mut replay = record_pairs(&mut sq, &mut s, &mr);
    let mut refused = 0;
    for launch in 0..20u64 {
        loop {
            match replay.launch(&mut [&mut sq]) {
                Ok(t) => {
                    assert_eq!(t[0].start, launch * PAIRS);
                    break;
                }
                Err(StreamError::WindowFull { .. }) => {
                    refused += 1;
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(e) => panic!("launch {launch}: {e}"),
            }
        }
    }
    s.synchronize().unwrap();
    assert!(sq.completed(20 * PAIRS - 1).unwrap());
    let mut got = vec![0; data.len()];
    mr.read(DST, &mut got).unwrap();
    assert!(got == data);
    eprintln!("20 launches back to back, refused for a full window {refused} times");
}

#[test]
fn a_launch_without_room_is_refused_whole() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let (a, b) = (
        loopback_qp(&ctx, 64, QpConfig::default()),
        loopback_qp(&ctx, 64, QpConfig::default()),
    );
    let mr = ctx.alloc_region(1 << 16, Access::ALL).unwrap();
    let mut s = stream();
    // SAFETY: the only posters of `a` and `b`; the stream is synchronized before they go.
    let (mut sa, mut sb) = unsafe { (StreamQp::new(&a, None).unwrap(), StreamQp::new(&b, None).unwrap()) };
    // SAFETY: as above.
    unsafe { s.begin_recording() }.unwrap();
    sa.put(&mut s, mr.remote(4096), mr.local(0), 8).unwrap();
    sb.post(
        &mut s,
        &[WorkRequest::Put {
            dst: mr.remote(8192),
            src: mr.local(0),
            len: 8,
        }; 40],
    )
    .unwrap();
    let mut replay = s.end_recording().unwrap();
    // Hold the stream (a wait on a word the test sets) so the first launch stays outstanding.
    let gate = Box::new(std::sync::atomic::AtomicU32::new(0));
    // SAFETY: `gate` outlives the stream's work (synchronized below).
    unsafe { s.wait(gate.as_ptr() as u64, gdaki::cuda::StreamWait::Eq, 1) }.unwrap();
    replay.launch(&mut [&mut sa, &mut sb]).unwrap();
    // `b` has 24 free slots for 40 WQEs: nothing launches, `a` is untouched too.
    assert!(matches!(
        replay.launch(&mut [&mut sb, &mut sa]),
        Err(StreamError::WindowFull {
            outstanding: 40,
            ring: 64
        })
    ));
    assert_eq!((sa.queued(), sb.queued()), (1, 40));
    gate.store(1, std::sync::atomic::Ordering::Release);
    s.synchronize().unwrap();
    settle(&mut sb, 39);
    let t = replay.launch(&mut [&mut sb, &mut sa]).unwrap();
    assert_eq!(t, vec![40..80, 1..2]);
    s.synchronize().unwrap();
    settle(&mut sa, 1);
    settle(&mut sb, 79);
    // Every queue pair that posted into the recording, and no other.
    assert!(matches!(
        replay.launch(&mut [&mut sa]),
        Err(StreamError::BadRequest { .. })
    ));
    let c = loopback_qp(&ctx, 64, QpConfig::default());
    // SAFETY: as above.
    let mut sc = unsafe { StreamQp::new(&c, None) }.unwrap();
    assert!(matches!(
        replay.launch(&mut [&mut sa, &mut sb, &mut sc]),
        Err(StreamError::BadRequest { .. })
    ));
}

#[test]
fn a_recording_refuses_what_would_not_replay() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let cfg = QpConfig {
        receive: Some(ReceiveConfig { size: 16, max_bufs: 1 }),
        ..QpConfig::default()
    };
    let qp = loopback_qp(&ctx, 16, cfg);
    let mr = ctx.alloc_region(1 << 16, Access::ALL).unwrap();
    let (mut s, mut other) = (stream(), stream());
    // SAFETY: the only poster of `qp`; the streams are synchronized before it goes.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    let before = sq.put(&mut other, mr.remote(4096), mr.local(0), 8).unwrap();
    // SAFETY: nothing of the test's is named.
    unsafe { s.begin_recording() }.unwrap();
    let t = sq.put(&mut s, mr.remote(4096), mr.local(0), 8).unwrap();
    // A wait for a ticket posted before the recording: it would not move with a launch.
    assert!(matches!(sq.wait(&mut s, before), Err(StreamError::NotQueued { .. })));
    // A ticket the recording has not posted.
    assert!(matches!(sq.wait(&mut s, t + 1), Err(StreamError::NotQueued { .. })));
    sq.wait(&mut s, t).unwrap();
    // Receives are the CPU's: their tickets do not move.
    assert!(matches!(sq.wait_recv(&mut s, 0), Err(StreamError::BadRequest { .. })));
    // More than the send queue in one launch.
    let wr = WorkRequest::Put {
        dst: mr.remote(4096),
        src: mr.local(0),
        len: 8,
    };
    assert!(matches!(
        sq.post(&mut s, &[wr; 16]),
        Err(StreamError::BadRequest { .. })
    ));
    sq.post(&mut s, &[wr; 15]).unwrap();
    // Posting outside the recording ends the queue pair's part in it.
    sq.put(&mut other, mr.remote(4096), mr.local(0), 8).unwrap();
    assert!(matches!(
        sq.put(&mut s, mr.remote(4096), mr.local(0), 8),
        Err(StreamError::Recording(_))
    ));
    // Nested recordings and ending a recording that did not start.
    // SAFETY: as above.
    assert!(matches!(unsafe { s.begin_recording() }, Err(StreamError::Recording(_))));
    let mut replay = s.end_recording().unwrap();
    assert!(matches!(other.end_recording(), Err(StreamError::Recording(_))));
    other.synchronize().unwrap();
    settle(&mut sq, 1);
    // The recording still launches: 16 WQEs after the two posted outside it.
    assert_eq!(replay.launch(&mut [&mut sq]).unwrap(), vec![2..18]);
    s.synchronize().unwrap();
    settle(&mut sq, 17);
}

#[test]
fn a_cuda_graph_of_a_thousand_puts_and_waits_replays_a_hundred_times_with_every_byte_checked() {
    use cudarc::driver::sys;
    use gdaki::stream::CudaStreamOps;
    let test = "a_cuda_graph_of_a_thousand_puts_and_waits_replays_a_hundred_times_with_every_byte_checked";
    let Some((gpu, _one)) = common::gpu_or_skip(test) else {
        return;
    };
    let len = (PAIRS * SLICE) as usize;
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 1024, QpConfig::default());
    let export = qp.export_gpu(&gpu).unwrap();
    let src = ctx.alloc_device_region(&gpu, len, Access::ALL).unwrap();
    let dst = ctx.alloc_device_region(&gpu, len, Access::ALL).unwrap();
    // The CPU writes each launch's data into `staging`; the graph copies it to `src` first,
    // clears `dst`, puts and waits, and copies `dst` to `landed` last.
    let staging = gdaki::cuda::DeviceBuffer::zeroed(&gpu, len).unwrap();
    let landed = gdaki::cuda::DeviceBuffer::zeroed(&gpu, len).unwrap();
    let cuda = gpu.context().new_stream().unwrap();
    let mut ops = CudaStreamOps::new(&gpu, cuda.clone()).unwrap();
    // SAFETY: the only poster of `qp` (no kernel uses the export); the stream is idle before
    // the queue pair goes.
    let mut sq = unsafe { StreamQp::new(&qp, Some(&export)) }.unwrap();
    // SAFETY: the stores and waits recorded name only the queue pair's words.
    unsafe { ops.begin_recording() }.unwrap();
    gpu.context().bind_to_thread().unwrap();
    // SAFETY: live allocations of this GPU of `len` bytes each, alive until the stream is idle
    // after the last launch.
    unsafe {
        sys::cuMemcpyDtoDAsync_v2(src.addr(), staging.device_addr(), len, cuda.cu_stream())
            .result()
            .unwrap();
        sys::cuMemsetD8Async(dst.addr(), 0, len, cuda.cu_stream())
            .result()
            .unwrap();
    }
    for i in 0..PAIRS {
        let t = sq
            .put(&mut ops, dst.remote(i * SLICE), src.local(i * SLICE), SLICE as u32)
            .unwrap();
        sq.wait(&mut ops, t).unwrap();
    }
    // SAFETY: as above.
    unsafe { sys::cuMemcpyDtoDAsync_v2(landed.device_addr(), dst.addr(), len, cuda.cu_stream()) }
        .result()
        .unwrap();
    let mut replay = ops.end_recording().unwrap();
    let start = std::time::Instant::now();
    for launch in 0..100u64 {
        let data = pattern(launch + 11, len);
        staging.write(0, &data).unwrap();
        let tickets = replay.launch(&mut [&mut sq]).unwrap();
        assert_eq!(tickets, vec![launch * PAIRS..(launch + 1) * PAIRS]);
        assert!(
            gdaki::cuda::stream_idle_within(&cuda, Duration::from_secs(60)).unwrap(),
            "launch {launch} did not finish within 60 s"
        );
        let mut got = vec![0; len];
        landed.read(0, &mut got).unwrap();
        assert!(got == data, "launch {launch}: the bytes that landed differ");
    }
    assert!(sq.completed(100 * PAIRS - 1).unwrap());
    eprintln!(
        "100 launches of a graph of {PAIRS} put+wait pairs ({SLICE} B each): {:.1} ms a launch",
        start.elapsed().as_secs_f64() * 1e3 / 100.0
    );
}

#[test]
fn a_post_captured_outside_a_recording_is_refused() {
    use gdaki::stream::CudaStreamOps;
    let test = "a_post_captured_outside_a_recording_is_refused";
    let Some((gpu, _one)) = common::gpu_or_skip(test) else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    let export = qp.export_gpu(&gpu).unwrap();
    let mr = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    let cuda = gpu.context().new_stream().unwrap();
    let mut ops = CudaStreamOps::new(&gpu, cuda.clone()).unwrap();
    // SAFETY: the only poster of `qp`; nothing is enqueued.
    let mut sq = unsafe { StreamQp::new(&qp, Some(&export)) }.unwrap();
    // Someone else's capture of the stream: a replay of it would repeat this post's indices.
    gdaki::cuda::begin_capture(&cuda).unwrap();
    assert!(matches!(
        sq.put(&mut ops, mr.remote(0), mr.local(2048), 8),
        Err(StreamError::Recording(_))
    ));
    assert_eq!(sq.queued(), 0);
    drop(cuda.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)));
    // Outside the capture it posts.
    let t = sq.put(&mut ops, mr.remote(0), mr.local(2048), 8).unwrap();
    sq.wait(&mut ops, t).unwrap();
    assert!(gdaki::cuda::stream_idle_within(&cuda, Duration::from_secs(30)).unwrap());
    assert!(sq.completed(t).unwrap());
}
