//! Stream-triggered posting on the soft provider, with the memory operations run by a CPU
//! thread (`CpuStream`): the doorbell leaves when the stream reaches it, waits end on the
//! completion (an error's too), the window refuses instead of waiting, the stores and waits a
//! post makes are the ones its queue pair needs, and data crosses the ring's wrap many times.
mod common;
use common::{cpu_stream as stream, loopback_qp, pattern, qp, soft_loopback as setup};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use gdaki::cuda::StreamWait;
use gdaki::stream::{CpuStream, MemOps, Space, Store, StreamError, StreamQp, WorkRequest};
use gdaki::{Access, Context, MemoryRegion, Provider, QpConfig, QueuePair, ReceiveConfig};
use gdaki_device::{Exclusive, RecvBuf, RecvKind, WaitError};
use gdaki_layout::{dbrec, doorbell, Syndrome};

/// Words a test's stream waits on and writes (host memory the test owns for its whole run).
struct Flags(Box<[AtomicU32; 16]>);

impl Flags {
    fn new() -> Flags {
        Flags(Box::new(std::array::from_fn(|_| AtomicU32::new(0))))
    }
    fn addr(&self, i: usize) -> u64 {
        self.0[i].as_ptr() as u64
    }
    fn get(&self, i: usize) -> u32 {
        self.0[i].load(Ordering::Acquire)
    }
    fn set(&self, i: usize, v: u32) {
        self.0[i].store(v, Ordering::Release)
    }
}

const GATE: usize = 0;
const DONE: usize = 1;

#[test]
fn a_put_leaves_when_the_stream_reaches_its_doorbell() {
    let (_ctx, qp, mr) = setup(64);
    let data = pattern(1, 4096);
    mr.write(0, &data).unwrap();
    let flags = Flags::new();
    let mut s = stream();
    // SAFETY: this test posts to `qp` only through `sq`.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    // SAFETY: the flags outlive the stream (dropped first, at the end of the test).
    unsafe { s.wait(flags.addr(GATE), StreamWait::Geq, 1) }.unwrap();
    let t = sq.put(&mut s, mr.remote(65536), mr.local(0), 4096).unwrap();
    sq.wait(&mut s, t).unwrap();
    // SAFETY: as above.
    unsafe {
        s.store(&[Store::U32 {
            addr: flags.addr(DONE),
            value: 7,
        }])
    }
    .unwrap();
    // The stream is held at the gate: the WQE is written, but the HCA has not seen it.
    std::thread::sleep(Duration::from_millis(100));
    let mut got = vec![0; 4096];
    mr.read(65536, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "the put went before its doorbell");
    assert_eq!(flags.get(DONE), 0);
    assert!(!sq.completed(t).unwrap());
    flags.set(GATE, 1);
    s.synchronize().unwrap();
    // The store after the wait ran after the completion, so the bytes are there.
    assert_eq!(flags.get(DONE), 7);
    mr.read(65536, &mut got).unwrap();
    assert_eq!(got, data);
    assert!(sq.completed(t).unwrap());
}

#[test]
fn the_window_refuses_rather_than_waits() {
    let (_ctx, qp, mr) = setup(16);
    let flags = Flags::new();
    let mut s = stream();
    // SAFETY: the only poster of `qp`.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    // SAFETY: the flags outlive the stream.
    unsafe { s.wait(flags.addr(GATE), StreamWait::Eq, 1) }.unwrap();
    for i in 0..16 {
        assert_eq!(sq.put(&mut s, mr.remote(8192 + i * 8), mr.local(0), 8).unwrap(), i);
    }
    let started = Instant::now();
    match sq.put(&mut s, mr.remote(0), mr.local(0), 8) {
        Err(StreamError::WindowFull {
            outstanding: 16,
            ring: 16,
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(1), "the refusal waited");
    let wrs = [WorkRequest::Put {
        dst: mr.remote(0),
        src: mr.local(0),
        len: 8,
    }; 17];
    assert!(matches!(sq.post(&mut s, &wrs), Err(StreamError::BadRequest { .. })));
    flags.set(GATE, 1);
    sq.wait(&mut s, 15).unwrap();
    s.synchronize().unwrap();
    // Completed: the next post takes the slots back itself.
    assert_eq!(sq.put(&mut s, mr.remote(0), mr.local(0), 8).unwrap(), 16);
    sq.wait(&mut s, 16).unwrap();
    s.synchronize().unwrap();
    assert!(sq.completed(16).unwrap());
}

#[test]
fn a_wait_needs_its_doorbell_first_and_a_consumed_completion_needs_none() {
    let (_ctx, qp, mr) = setup(64);
    let mut s = stream();
    // SAFETY: the only poster of `qp`.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    match sq.wait(&mut s, 0) {
        Err(StreamError::NotQueued { ticket: 0, queued: 0 }) => {}
        other => panic!("{other:?}"),
    }
    let t = sq.put(&mut s, mr.remote(4096), mr.local(0), 64).unwrap();
    assert!(matches!(sq.wait(&mut s, t + 1), Err(StreamError::NotQueued { .. })));
    assert!(matches!(sq.completed(t + 1), Err(StreamError::NotQueued { .. })));
    s.synchronize().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sq.completed(t).unwrap() {
        assert!(Instant::now() < deadline, "the put never completed");
    }
    let before = s.done();
    sq.wait(&mut s, t).unwrap();
    s.synchronize().unwrap();
    assert_eq!(s.done(), before, "a wait for a consumed completion enqueued work");
}

/// An executor that records what it is given.
#[derive(Default)]
struct Recorder {
    space: Option<Space>,
    stores: Vec<Store>,
    waits: Vec<(u64, StreamWait, u32)>,
}

impl MemOps for Recorder {
    fn space(&self) -> Space {
        self.space.unwrap_or(Space::Host)
    }
    unsafe fn store(&mut self, stores: &[Store]) -> Result<(), StreamError> {
        self.stores.extend_from_slice(stores);
        Ok(())
    }
    unsafe fn wait(&mut self, addr: u64, how: StreamWait, value: u32) -> Result<(), StreamError> {
        self.waits.push((addr, how, value));
        Ok(())
    }
}

#[test]
fn a_post_stores_the_record_then_the_doorbell_and_a_wait_watches_the_owner_bit() {
    let (_ctx, qp, mr) = setup(16);
    // SAFETY: the handle lives as long as `qp`.
    let h = unsafe { qp.device_handle().read() };
    let mut r = Recorder::default();
    // SAFETY: the only poster of `qp`; nothing executes what `r` records.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    let wrs = [
        WorkRequest::Put {
            dst: mr.remote(4096),
            src: mr.local(0),
            len: 64,
        },
        WorkRequest::PutInline {
            dst: mr.remote(8192),
            data: b"inline",
        },
        WorkRequest::Get {
            dst: mr.local(12288),
            src: mr.remote(0),
            len: 64,
        },
    ];
    assert_eq!(sq.post(&mut r, &wrs).unwrap(), 0..3);
    // One doorbell for the three: the record's big-endian counter, then the doorbell word.
    assert_eq!(
        r.stores,
        [
            Store::U32 {
                addr: h.sq_dbrec,
                value: dbrec::wq_counter(3).to_be(),
            },
            Store::U64 {
                addr: h.doorbell,
                value: doorbell::word(h.qpn, 3),
            },
        ]
    );
    // Lap 0 waits for the owner bit to clear (NOR), on the word of the CQE that holds op_own.
    sq.wait(&mut r, 2).unwrap();
    let owner = 1u32 << 24;
    assert_eq!(r.waits, [(h.cq.cqe_base + 2 * 64 + 60, StreamWait::Nor, !owner)]);
    // Stores of the caller's go just ahead of the doorbell, in the same call.
    let flag = Store::U32 { addr: 0x1000, value: 9 };
    // SAFETY: nothing executes what `r` records.
    let t = unsafe { sq.post_after(&mut r, &[flag], &wrs[..1]) }.unwrap();
    assert_eq!(t, 3..4);
    assert_eq!(
        r.stores[2..],
        [
            flag,
            Store::U32 {
                addr: h.sq_dbrec,
                value: dbrec::wq_counter(4).to_be(),
            },
            Store::U64 {
                addr: h.doorbell,
                value: doorbell::word(h.qpn, 4),
            },
        ]
    );
    // Refused requests post nothing, the caller's stores included.
    let before = r.stores.len();
    // SAFETY: as above.
    assert!(unsafe { sq.post_after(&mut r, &[flag], &[]) }.is_err());
    let too_long = [WorkRequest::PutInline {
        dst: mr.remote(0),
        data: &[0; 1024],
    }];
    assert!(matches!(
        sq.post(&mut r, &too_long),
        Err(StreamError::BadRequest { index: 0, .. })
    ));
    assert!(matches!(sq.post(&mut r, &[]), Err(StreamError::BadRequest { .. })));
    assert_eq!(r.stores.len(), before);
    // Another address space is refused.
    let mut gpu = Recorder {
        space: Some(Space::Gpu(0)),
        ..Recorder::default()
    };
    assert!(matches!(
        sq.put(&mut gpu, mr.remote(0), mr.local(0), 8),
        Err(StreamError::WrongSpace { .. })
    ));
    assert!(matches!(sq.wait(&mut gpu, 0), Err(StreamError::WrongSpace { .. })));
}

#[test]
fn the_second_lap_waits_for_the_owner_bit_to_be_set() {
    let (_ctx, qp, mr) = setup(16);
    // SAFETY: the handle lives as long as `qp`.
    let h = unsafe { qp.device_handle().read() };
    let mut s = stream();
    // SAFETY: the only poster of `qp`.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    for i in 0..16 {
        sq.put(&mut s, mr.remote(4096 + i * 8), mr.local(0), 8).unwrap();
    }
    sq.wait(&mut s, 15).unwrap();
    s.synchronize().unwrap();
    let t = sq.put(&mut s, mr.remote(0), mr.local(0), 8).unwrap();
    assert_eq!(t, 16);
    let mut r = Recorder::default();
    sq.wait(&mut r, t).unwrap();
    assert_eq!(r.waits, [(h.cq.cqe_base + 60, StreamWait::And, 1 << 24)]);
}

#[test]
fn a_thousand_puts_and_waits_cross_the_ring_with_every_byte_checked() {
    let (_ctx, qp, mr) = setup(16);
    let data = pattern(5, 1000 * 64);
    mr.write(0, &data).unwrap();
    let flags = Flags::new();
    let mut s = stream();
    // SAFETY: the only poster of `qp`.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    let mut refused = 0;
    for i in 0..1000u64 {
        let at = i * 64;
        let t = loop {
            match sq.put(&mut s, mr.remote(512 * 1024 + at), mr.local(at), 64) {
                Ok(t) => break t,
                // The CPU is a ring ahead of the stream: let it catch up.
                Err(StreamError::WindowFull { .. }) => {
                    refused += 1;
                    s.synchronize().unwrap();
                }
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(t, i);
        sq.wait(&mut s, t).unwrap();
        // SAFETY: the flags outlive the stream.
        unsafe {
            s.store(&[Store::U32 {
                addr: flags.addr(DONE),
                value: i as u32 + 1,
            }])
        }
        .unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(flags.get(DONE), 1000);
    assert!(sq.completed(999).unwrap());
    let mut got = vec![0; data.len()];
    mr.read(512 * 1024, &mut got).unwrap();
    assert_eq!(got, data);
    eprintln!("1000 puts through the stream, refused for a full window {refused} times");
}

#[test]
fn an_error_completion_ends_the_wait_and_is_decoded() {
    let (_ctx, qp, mr) = setup(64);
    let flags = Flags::new();
    let mut s = stream();
    // SAFETY: the only poster of `qp`.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    let mut bad = mr.remote(0);
    bad.rkey ^= 0x5a5a;
    let t = sq.put(&mut s, bad, mr.local(0), 64).unwrap();
    let after = sq.put(&mut s, mr.remote(4096), mr.local(0), 64).unwrap();
    sq.wait(&mut s, after).unwrap();
    // SAFETY: the flags outlive the stream.
    unsafe {
        s.store(&[Store::U32 {
            addr: flags.addr(DONE),
            value: 1,
        }])
    }
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(flags.get(DONE), 1, "the wait did not end");
    match sq.completed(t) {
        Err(StreamError::Completion(WaitError::Cqe(e))) => assert_eq!(e.syndrome, Syndrome::RemoteAccess),
        other => panic!("{other:?}"),
    }
    // The WQE after it was flushed, and says the queue pair's error.
    assert!(matches!(sq.completed(after), Err(StreamError::Completion(_))));
}

#[test]
fn a_wait_that_never_ends_fails_the_stream_within_its_bound() {
    let flags = Flags::new();
    let mut s = CpuStream::new(Duration::from_millis(200)).unwrap();
    let started = Instant::now();
    // SAFETY: the flags outlive the stream.
    unsafe { s.wait(flags.addr(GATE), StreamWait::Eq, 1) }.unwrap();
    unsafe {
        s.store(&[Store::U32 {
            addr: flags.addr(DONE),
            value: 1,
        }])
    }
    .unwrap();
    match s.synchronize() {
        Err(StreamError::WaitTimedOut {
            how: StreamWait::Eq,
            value: 1,
            seen: 0,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(flags.get(DONE), 0, "work after the failed wait ran");
    // Failed for good: later work is refused, and the error stays.
    let e = unsafe {
        s.store(&[Store::U32 {
            addr: flags.addr(DONE),
            value: 1,
        }])
    }
    .unwrap_err();
    assert!(e.to_string().contains("failed earlier"), "{e}");
    assert!(s.synchronize().is_err());
    // Misaligned addresses are refused when enqueued.
    let mut t = stream();
    assert!(unsafe { t.wait(flags.addr(GATE) + 1, StreamWait::Eq, 1) }.is_err());
    assert!(unsafe {
        t.store(&[Store::U64 {
            addr: flags.addr(GATE) + 4,
            value: 1,
        }])
    }
    .is_err());
}

/// Two connected queue pairs in two contexts, both with receive queues of `rq` receives, and
/// a 64 KiB region on each side.
struct Pair {
    a: QueuePair,
    b: QueuePair,
    la: MemoryRegion,
    lb: MemoryRegion,
    _ctx: (Context, Context),
}

fn pair(rq: u32) -> Pair {
    let (ca, cb) = (
        Context::open(Provider::Soft).unwrap(),
        Context::open(Provider::Soft).unwrap(),
    );
    let cfg = QpConfig {
        receive: Some(ReceiveConfig { size: rq, max_bufs: 1 }),
        ..QpConfig::default()
    };
    let (a, b) = (qp(&ca, 64, cfg.clone()), qp(&cb, 64, cfg));
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    let la = ca.alloc_region(1 << 16, Access::ALL).unwrap();
    let lb = cb.alloc_region(1 << 16, Access::ALL).unwrap();
    Pair {
        a,
        b,
        la,
        lb,
        _ctx: (ca, cb),
    }
}

#[test]
fn sends_from_a_stream_land_in_the_peers_receives() {
    let p = pair(64);
    let (a, b, la, lb) = (&p.a, &p.b, &p.la, &p.lb);
    let data = pattern(9, 1000);
    la.write(0, &data).unwrap();
    // SAFETY: this thread is b's only receiver; `rb` does not outlive b.
    let rb = unsafe { b.cpu_receive::<Exclusive>() }.unwrap();
    let recv = |at: u64| {
        rb.post_recv(&[RecvBuf {
            local: lb.local(at),
            len: 1000,
        }])
        .unwrap()
    };
    let (r0, r1, r2) = (recv(0), recv(1024), recv(2048));
    let mut s = stream();
    // SAFETY: the only poster of `a`.
    let mut sq = unsafe { StreamQp::new(a, None) }.unwrap();
    let wrs = [
        WorkRequest::Send {
            src: la.local(0),
            len: 1000,
        },
        WorkRequest::SendImm {
            src: la.local(0),
            len: 500,
            imm: 0xfeed,
        },
        WorkRequest::SendInline { data: b"inline send" },
    ];
    let tickets = sq.post(&mut s, &wrs).unwrap();
    sq.wait(&mut s, tickets.end - 1).unwrap();
    s.synchronize().unwrap();
    let got: Vec<_> = [r0, r1, r2].iter().map(|&r| rb.poll(r).unwrap()).collect();
    assert_eq!(
        got.iter().map(|g| (g.bytes, g.kind)).collect::<Vec<_>>(),
        [
            (1000, RecvKind::Send),
            (500, RecvKind::SendImm(0xfeed)),
            (11, RecvKind::Send)
        ]
    );
    let mut back = vec![0; 1000];
    lb.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    let mut inline = vec![0; 11];
    lb.read(2048, &mut inline).unwrap();
    assert_eq!(&inline, b"inline send");
}

// ------------------------------------------------------------------------------ on a GPU

/// A CUDA stream rings after the stream's earlier work and its later work waits for the
/// completion: each round a memset gives the source the round's value, the stream posts a put
/// of it into device memory and waits, and a copy after the wait records what the destination
/// held; 100 rounds cross the 64-slot ring's wrap. SKIPPED without a GPU.
#[test]
fn a_cuda_stream_rings_after_its_earlier_work_and_waits_for_the_completion() {
    use cudarc::driver::sys;
    use gdaki::stream::CudaStreamOps;
    let test = "a_cuda_stream_rings_after_its_earlier_work_and_waits_for_the_completion";
    let Some((gpu, _one)) = common::gpu_or_skip(test) else {
        return;
    };
    const LEN: usize = 65536;
    const ROUNDS: u32 = 100;
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    let export = qp.export_gpu(&gpu).unwrap();
    let src = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
    let dst = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
    let seen = gdaki::cuda::DeviceBuffer::zeroed(&gpu, 4 * ROUNDS as usize * 2).unwrap();
    let cuda = gpu.context().new_stream().unwrap();
    let mut ops = CudaStreamOps::new(&gpu, cuda.clone()).unwrap();
    // SAFETY: the only poster of `qp` (no kernel uses the export).
    let mut sq = unsafe { StreamQp::new(&qp, Some(&export)) }.unwrap();
    assert_eq!(sq.space(), Space::Gpu(gpu.ordinal()));
    // The CPU stream's addresses are refused for this queue pair.
    assert!(matches!(
        sq.put(&mut stream(), dst.remote(0), src.local(0), 8),
        Err(StreamError::WrongSpace { .. })
    ));
    // A byte per round: the driver's byte memset is loaded when the GPU is opened; a kernel
    // CUDA loads lazily at first use (its 32-bit memset, say) would wait behind the soft HCA's
    // resident copier (docs/stream.md).
    let byte = |round: u32| 0x80 | round as u8;
    let value = |round: u32| u32::from_ne_bytes([byte(round); 4]);
    for round in 0..ROUNDS {
        gpu.context().bind_to_thread().unwrap();
        // SAFETY: `src` holds LEN bytes of this GPU's memory, alive until the stream is idle.
        unsafe { sys::cuMemsetD8Async(src.addr(), byte(round), LEN, cuda.cu_stream()) }
            .result()
            .unwrap();
        let t = loop {
            match sq.put(&mut ops, dst.remote(0), src.local(0), LEN as u32) {
                Ok(t) => break t,
                Err(StreamError::WindowFull { .. }) => cuda.synchronize().unwrap(),
                Err(e) => panic!("round {round}: {e}"),
            }
        };
        sq.wait(&mut ops, t).unwrap();
        // The first and the last word of what landed, after the wait.
        for (k, at) in [(0u64, 0u64), (1, LEN as u64 - 4)] {
            let to = seen.device_addr() + u64::from(round) * 8 + k * 4;
            // SAFETY: both ranges lie in live allocations of this GPU until the stream is idle.
            unsafe { sys::cuMemcpyDtoDAsync_v2(to, dst.addr() + at, 4, cuda.cu_stream()) }
                .result()
                .unwrap();
        }
    }
    cuda.synchronize().unwrap();
    let mut words = vec![0u8; 8 * ROUNDS as usize];
    seen.read(0, &mut words).unwrap();
    for round in 0..ROUNDS {
        let at = round as usize * 8;
        let first = u32::from_le_bytes(words[at..at + 4].try_into().unwrap());
        let last = u32::from_le_bytes(words[at + 4..at + 8].try_into().unwrap());
        assert_eq!((first, last), (value(round), value(round)), "round {round}");
    }
    assert!(sq.completed(u64::from(ROUNDS) - 1).unwrap());
}

/// On a CUDA stream too, an error completion ends the wait (the stream goes on to the store
/// after it, and no further), and the CPU reads the decoded error.
#[test]
fn a_cuda_streams_wait_ends_on_an_error_completion() {
    use gdaki::stream::CudaStreamOps;
    let test = "a_cuda_streams_wait_ends_on_an_error_completion";
    let Some((gpu, _one)) = common::gpu_or_skip(test) else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 64, QpConfig::default());
    let export = qp.export_gpu(&gpu).unwrap();
    let mr = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    let flag = gdaki::cuda::DeviceBuffer::zeroed(&gpu, 4).unwrap();
    let cuda = gpu.context().new_stream().unwrap();
    let mut ops = CudaStreamOps::new(&gpu, cuda.clone()).unwrap();
    // SAFETY: the only poster of `qp`; the stream is idle before the queue pair goes.
    let mut sq = unsafe { StreamQp::new(&qp, Some(&export)) }.unwrap();
    let mut bad = mr.remote(0);
    bad.rkey ^= 0x5a5a;
    let t = sq.put(&mut ops, bad, mr.local(2048), 64).unwrap();
    let after = sq.put(&mut ops, mr.remote(1024), mr.local(2048), 64).unwrap();
    sq.wait(&mut ops, t).unwrap();
    sq.wait(&mut ops, after).unwrap();
    // SAFETY: `flag` is a word of this GPU's memory, alive until the stream is idle.
    unsafe {
        ops.store(&[Store::U32 {
            addr: flag.device_addr(),
            value: 1,
        }])
    }
    .unwrap();
    assert!(
        gdaki::cuda::stream_idle_within(&cuda, Duration::from_secs(30)).unwrap(),
        "the stream still waits after an error completion"
    );
    let mut word = [0u8; 4];
    flag.read(0, &mut word).unwrap();
    assert_eq!(u32::from_ne_bytes(word), 1);
    match sq.completed(t) {
        Err(StreamError::Completion(WaitError::Cqe(e))) => assert_eq!(e.syndrome, Syndrome::RemoteAccess),
        other => panic!("{other:?}"),
    }
    assert!(matches!(sq.completed(after), Err(StreamError::Completion(_))));
}

/// A reliable doorbell's queue pair has no record: a stream's post is the doorbell alone, and
/// the put lands and completes through it.
#[test]
fn with_a_reliable_doorbell_the_stream_stores_the_doorbell_alone() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let cfg = QpConfig {
        reliable_doorbell: true,
        ..QpConfig::default()
    };
    let qp = loopback_qp(&ctx, 64, cfg);
    let mr = ctx.alloc_region(1 << 20, Access::ALL).unwrap();
    // SAFETY: the handle lives as long as the QP.
    let h = unsafe { qp.device_handle().read() };
    let mut r = Recorder::default();
    // SAFETY: the only poster of `qp`; what `r` records is stored for real below, once.
    let mut sq = unsafe { StreamQp::new(&qp, None) }.unwrap();
    let data = pattern(12, 4096);
    mr.write(0, &data).unwrap();
    let t = sq.put(&mut r, mr.remote(65536), mr.local(0), 4096).unwrap();
    assert_eq!(
        r.stores,
        [Store::U64 {
            addr: h.doorbell,
            value: doorbell::word(h.qpn, 1),
        }]
    );
    // The recorded stores, executed: the HCA takes the put from the doorbell alone.
    let mut s = stream();
    // SAFETY: the doorbell word of the live QP, as the post made it.
    unsafe { s.store(&r.stores) }.unwrap();
    sq.wait(&mut s, t).unwrap();
    s.synchronize().unwrap();
    assert!(sq.completed(t).unwrap());
    let mut got = vec![0; 4096];
    mr.read(65536, &mut got).unwrap();
    assert_eq!(got, data);
}

/// Through a CPU proxy the stream stores the producer index into the proxy's word (one store),
/// and the proxy rings: the data lands and the wait ends.
#[test]
fn through_a_cpu_proxy_the_stream_publishes_the_producer_index() {
    use gdaki::DoorbellHandler;
    use gdaki_proxy::{Proxy, ProxyConfig};
    let ctx = Context::open(Provider::Soft).unwrap();
    let cfg = QpConfig {
        handler: DoorbellHandler::CpuProxy,
        ..QpConfig::default()
    };
    let (recorded, live) = (loopback_qp(&ctx, 64, cfg.clone()), loopback_qp(&ctx, 64, cfg));
    let mr = ctx.alloc_region(1 << 20, Access::ALL).unwrap();
    // SAFETY: the handle lives as long as the QP.
    let h = unsafe { recorded.device_handle().read() };
    let mut r = Recorder::default();
    // SAFETY: the only poster of `recorded`; nothing executes what `r` records.
    let mut sq = unsafe { StreamQp::new(&recorded, None) }.unwrap();
    sq.put(&mut r, mr.remote(4096), mr.local(0), 8).unwrap();
    sq.put(&mut r, mr.remote(4096), mr.local(0), 8).unwrap();
    assert_eq!(
        r.stores,
        [
            Store::U64 {
                addr: h.doorbell,
                value: 1
            },
            Store::U64 {
                addr: h.doorbell,
                value: 2
            }
        ]
    );
    let proxy = Proxy::start(ProxyConfig::default()).unwrap();
    proxy.add(live.proxy_target().unwrap());
    let data = pattern(11, 4096);
    mr.write(0, &data).unwrap();
    let mut s = stream();
    // SAFETY: the only poster of `live`.
    let mut sq = unsafe { StreamQp::new(&live, None) }.unwrap();
    let t = sq.put(&mut s, mr.remote(65536), mr.local(0), 4096).unwrap();
    sq.wait(&mut s, t).unwrap();
    s.synchronize().unwrap();
    assert!(sq.completed(t).unwrap());
    let mut got = vec![0; 4096];
    mr.read(65536, &mut got).unwrap();
    assert_eq!(got, data);
}

/// A queue pair that is not connected yet is refused: its WQEs would not run, and a stream
/// waiting for them would wait forever. Connected, it is taken.
#[test]
fn a_queue_pair_that_is_not_connected_is_refused() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let q = qp(&ctx, 64, QpConfig::default());
    // SAFETY: no other poster; the value is dropped at once.
    let e = unsafe { StreamQp::new(&q, None) }.unwrap_err().to_string();
    assert!(e.contains("not connected") && e.contains("Reset"), "{e}");
    q.connect(&q.endpoint()).unwrap();
    // SAFETY: as above.
    assert!(unsafe { StreamQp::new(&q, None) }.is_ok());
}

/// A collapsed CQ is refused: a stream waits for a CQE's owner bit in the CQE's own entry,
/// and a collapsed CQ writes them all to one.
#[test]
fn a_collapsed_cq_is_refused() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let cq = ctx.create_collapsed_cq_in(1024, &gdaki::Rings::Host).unwrap();
    let q = ctx.create_qp(&cq, QpConfig::default()).unwrap();
    q.connect(&q.endpoint()).unwrap();
    // SAFETY: no other poster; the value is dropped at once.
    let e = unsafe { StreamQp::new(&q, None) }.unwrap_err().to_string();
    assert!(e.contains("collapsed"), "{e}");
}

/// A stream can wait for a message to arrive in a receive: its later work runs only once the
/// peer's SEND has landed. A receive more than a CQ ahead, and a queue pair without a receive
/// queue, are refused.
#[test]
fn a_stream_waits_for_a_message_in_a_receive() {
    let p = pair(16);
    let (a, b, la, lb) = (&p.a, &p.b, &p.la, &p.lb);
    let data = pattern(21, 512);
    la.write(0, &data).unwrap();
    // SAFETY: this thread is b's only receiver; `rb` does not outlive b.
    let rb = unsafe { b.cpu_receive::<Exclusive>() }.unwrap();
    let r0 = rb
        .post_recv(&[RecvBuf {
            local: lb.local(0),
            len: 512,
        }])
        .unwrap();
    let flags = Flags::new();
    let mut s = stream();
    // SAFETY: the stream queue pair only waits here (b posts nothing), and the stream is
    // synchronised before b goes.
    let mut sq = unsafe { StreamQp::new(b, None) }.unwrap();
    sq.wait_recv(&mut s, r0).unwrap();
    // SAFETY: the flags outlive the stream.
    unsafe {
        s.store(&[Store::U32 {
            addr: flags.addr(DONE),
            value: 1,
        }])
    }
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(flags.get(DONE), 0, "the stream went on before the message came");
    // SAFETY: this thread is a's only poster; the view does not outlive a.
    let sa = unsafe { a.cpu::<Exclusive>() }.unwrap();
    sa.wait(sa.send(la.local(0), 512).unwrap()).unwrap();
    s.synchronize().unwrap();
    assert_eq!(flags.get(DONE), 1);
    let got = rb.poll(r0).unwrap();
    assert_eq!((got.bytes, got.kind), (512, RecvKind::Send));
    let mut back = vec![0; 512];
    lb.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    // Consumed: nothing to wait for. A CQ (16 entries) ahead of the consumed ones: refused.
    let before = s.done();
    sq.wait_recv(&mut s, r0).unwrap();
    s.synchronize().unwrap();
    assert_eq!(s.done(), before);
    assert!(matches!(
        sq.wait_recv(&mut s, r0 + 1 + 16),
        Err(StreamError::NotQueued { .. })
    ));
    // No receive queue.
    let (_ctx, plain, _mr) = setup(64);
    // SAFETY: the only poster of `plain`.
    let mut sp = unsafe { StreamQp::new(&plain, None) }.unwrap();
    assert!(matches!(sp.wait_recv(&mut s, 0), Err(StreamError::BadRequest { .. })));
}
