//! Counters the HCA advances when operations complete (DOCA GPUNetIO's `*_counter` calls):
//! a cross-channel companion QP posts a Core-Direct WAIT on the data QP's CQ, then an atomic
//! add on the counter. In CPU mode against the soft HCA, in one process (across processes:
//! `tcp.rs`).
mod common;
use common::{pattern, qp};
use std::time::{Duration, Instant};

use gdaki::{Access, Context, Error, MemoryRegion, Provider, QpConfig, QueuePair};
use gdaki_device::{Exclusive, WaitError};
use gdaki_layout::Syndrome;

/// A cross-channel QP of `ctx` connected to itself: the counter it adds to is local.
fn companion(ctx: &Context) -> QueuePair {
    let c = qp(
        ctx,
        64,
        QpConfig {
            cross_channel: true,
            ..Default::default()
        },
    );
    c.connect(&c.endpoint()).unwrap();
    c
}

/// A data QP of one context connected to a peer QP of another, a companion beside the data QP,
/// `bytes` of `pattern(seed)` at `src`, as many at `dst` on the peer's side, and a counter page.
struct Rig {
    main: QueuePair,
    comp: QueuePair,
    src: MemoryRegion,
    dst: MemoryRegion,
    counter: MemoryRegion,
    data: Vec<u8>,
    // Bound by the tests (a `..` would drop them at once): the QPs and regions above need
    // their contexts and the peer QP.
    _peer: QueuePair,
    _contexts: (Context, Context),
}

fn rig(bytes: usize, seed: u64) -> Rig {
    let (a, b) = (
        Context::open(Provider::Soft).unwrap(),
        Context::open(Provider::Soft).unwrap(),
    );
    let (main, peer) = (qp(&a, 64, QpConfig::default()), qp(&b, 64, QpConfig::default()));
    main.connect(&peer.endpoint()).unwrap();
    peer.connect(&main.endpoint()).unwrap();
    let data = pattern(seed, bytes);
    let src = a.alloc_region(bytes, Access::ALL).unwrap();
    src.write(0, &data).unwrap();
    Rig {
        comp: companion(&a),
        src,
        dst: b.alloc_region(bytes, Access::ALL).unwrap(),
        counter: a.alloc_region(4096, Access::ALL).unwrap(),
        main,
        data,
        _peer: peer,
        _contexts: (a, b),
    }
}

/// Polls the 8 bytes at `offset` of `mr` until they read `want` (or 10 s pass).
fn await_u64(mr: &gdaki::MemoryRegion, offset: u64, want: u64) -> u64 {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let v = mr.load_u64(offset).unwrap();
        if v == want || Instant::now() > until {
            return v;
        }
        std::thread::yield_now();
    }
}

/// The counter waits for the data QP's completion: while the put is written but not rung, the
/// companion's WAIT holds its atomic (a HCA that ignored the WAIT would count at once); once
/// rung, the counter reads what was added, and the data is there before it.
#[test]
fn a_counter_advances_only_once_the_operation_it_waits_for_has_completed() {
    let Rig {
        main,
        comp,
        src,
        dst,
        counter,
        data,
        _peer,
        _contexts,
    } = rig(1 << 16, 3);
    // SAFETY: the views do not outlive their QPs; this thread alone posts.
    let (m, c) = unsafe { (main.cpu::<Exclusive>().unwrap(), comp.cpu::<Exclusive>().unwrap()) };

    let t = m.deferred().put(dst.remote(0), src.local(0), 1 << 16).unwrap();
    let ct = c
        .count_when_done(&m, t, counter.remote(0), 5, counter.local(64))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(counter.load_u64(0).unwrap(), 0, "counted before the put was even rung");
    assert!(c.poll_one().is_none(), "the WAIT completed before its CQE was produced");
    m.commit().unwrap();
    c.wait(ct).unwrap();
    assert_eq!(counter.load_u64(0).unwrap(), 5);
    let mut got = vec![0; 1 << 16];
    dst.read(0, &mut got).unwrap();
    assert_eq!(got, data, "the data landed before the count");

    // Many puts, each counted; the poster never waits on the data QP (its slots are reclaimed
    // as the ring wraps), only on the counter.
    let mut want = 5;
    for i in 0..300u64 {
        let t = m.put(dst.remote(i % 64 * 8), src.local(i % 64 * 8), 8).unwrap();
        c.count_when_done(&m, t, counter.remote(0), i, counter.local(64))
            .unwrap();
        want += i;
    }
    assert_eq!(await_u64(&counter, 0, want), want);
    m.quiet().unwrap();
    c.quiet().unwrap();
    assert_eq!((main.error(), comp.error()), (None, None));
}

/// Each of many 1 MiB puts counted once it is done, between two contexts; the count of each
/// comes after its put's CQE. (Across processes: `tcp.rs`, over TCP and shared memory.)
#[test]
fn each_large_put_is_counted_after_its_completion() {
    let Rig {
        main,
        comp,
        src,
        dst,
        counter,
        data,
        _peer,
        _contexts,
    } = rig(1 << 20, 9);
    // SAFETY: as above.
    let (m, c) = unsafe { (main.cpu::<Exclusive>().unwrap(), comp.cpu::<Exclusive>().unwrap()) };
    for round in 1..=20u64 {
        let t = m.put(dst.remote(0), src.local(0), 1 << 20).unwrap();
        let ct = c
            .count_when_done(&m, t, counter.remote(8), 1, counter.local(64))
            .unwrap();
        c.wait(ct).unwrap();
        // The count came after the CQE of the put, so the put is acknowledged: complete.
        assert_eq!(
            m.poll_one().map(|r| r.is_ok()),
            Some(true),
            "round {round}: the put's CQE is there"
        );
        assert_eq!(counter.load_u64(8).unwrap(), round);
    }
    let mut got = vec![0; 1 << 20];
    dst.read(0, &mut got).unwrap();
    assert_eq!(got, data);
}

/// A WAIT is a Core-Direct master's: a QP created without `cross_channel` fails it with a
/// local QP operation error, as a NIC does, and so does a WAIT naming a CQ that is not there.
#[test]
fn a_wait_needs_a_cross_channel_qp_and_an_existing_cq() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let main = qp(&ctx, 16, QpConfig::default());
    main.connect(&main.endpoint()).unwrap();
    let plain = qp(&ctx, 16, QpConfig::default());
    plain.connect(&plain.endpoint()).unwrap();
    let counter = ctx.alloc_region(4096, Access::ALL).unwrap();
    // SAFETY: as above.
    let (m, p) = unsafe { (main.cpu::<Exclusive>().unwrap(), plain.cpu::<Exclusive>().unwrap()) };
    let t = m.put_inline(counter.remote(128), b"x").unwrap();
    m.wait(t).unwrap();
    let ct = p
        .count_when_done(&m, t, counter.remote(0), 1, counter.local(64))
        .unwrap();
    // The WAIT fails; the add after it is flushed.
    match p.wait(ct - 1) {
        Err(WaitError::Cqe(e)) => assert_eq!(e.syndrome, Syndrome::LocalQpOp),
        other => panic!("a WAIT on a QP that is not cross-channel: {other:?}"),
    }
    match p.wait(ct) {
        Err(WaitError::Cqe(e)) => assert_eq!(e.syndrome, Syndrome::WrFlush),
        other => panic!("the add after a failed WAIT: {other:?}"),
    }
    assert_eq!(counter.load_u64(0).unwrap(), 0, "nothing counted");
    assert!(
        matches!(plain.error(), Some(Syndrome::LocalQpOp)),
        "{:?}",
        plain.error()
    );

    let comp = companion(&ctx);
    // SAFETY: as above.
    let c = unsafe { comp.cpu::<Exclusive>() }.unwrap();
    let i = c.reserve(1).unwrap();
    c.wqe_prepare_wait(i, 0xff_fff0, 0, 0);
    c.mark_ready(i, i + 1).unwrap();
    c.submit(i + 1).unwrap();
    match c.wait(i) {
        Err(WaitError::Cqe(e)) => assert_eq!(e.syndrome, Syndrome::LocalQpOp),
        other => panic!("a WAIT on a CQ that does not exist: {other:?}"),
    }
    // A misaligned counter is refused before anything is posted.
    let fresh = companion(&ctx);
    // SAFETY: as above.
    let f = unsafe { fresh.cpu::<Exclusive>() }.unwrap();
    assert!(f
        .count_when_done(&m, t, counter.remote(4), 1, counter.local(64))
        .is_err());
    assert_eq!(f.reserved(), 0);
}

/// `cross_channel` reaches the device as `qpc.cd_master` and is accepted by a device that reports
/// Core-Direct (the soft one does); the option is off by default.
#[test]
fn cross_channel_is_off_by_default_and_accepted_where_the_device_has_core_direct() {
    assert!(!QpConfig::default().cross_channel);
    let ctx = Context::open(Provider::Soft).unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let made = ctx.create_qp(
        &cq,
        QpConfig {
            cross_channel: true,
            sq_size: 16,
            ..Default::default()
        },
    );
    assert!(!matches!(made, Err(Error::Unsupported { .. })));
    made.unwrap();
}
