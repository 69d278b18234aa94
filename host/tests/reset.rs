//! Resetting queue pairs after an error (DOCA GPUNetIO's QP reset): both sides of an RC
//! connection go back to RESET, connect again, and post on through the same handles, their
//! tickets going on. In CPU mode against the soft HCA, in one process.
mod common;
use common::{pattern, qp};

use gdaki::{Access, Context, Provider, QpConfig, QpState, QueuePair, ReceiveConfig};
use gdaki_device::{Exclusive, WaitError};
use gdaki_layout::Syndrome;

/// Resets both sides and connects them again.
fn reset_and_reconnect(a: &QueuePair, b: &QueuePair) {
    // SAFETY: no poster uses either QP until the connects below have returned.
    unsafe {
        a.reset().unwrap();
        b.reset().unwrap();
    }
    assert_eq!(
        (a.state(), b.state(), a.error(), b.error()),
        (QpState::Reset, QpState::Reset, None, None)
    );
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    assert_eq!((a.state(), b.state()), (QpState::Rts, QpState::Rts));
}

/// A bad key fails the requester (and the responder QP), the reset brings both back, and the
/// view taken before the error posts on: data checked across several ring laps (the send
/// queue's slots and 16-bit counter line up with the CQ again), twice.
fn recovers(a: &Context, b: &Context) {
    let (qa, qb) = (qp(a, 16, QpConfig::default()), qp(b, 16, QpConfig::default()));
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    let src = a.alloc_region(1 << 16, Access::ALL).unwrap();
    let dst = b.alloc_region(1 << 16, Access::ALL).unwrap();
    let scratch = a.alloc_region(4096, Access::ALL).unwrap();
    let data = pattern(5, 1 << 16);
    src.write(0, &data).unwrap();
    // SAFETY: the view does not outlive its QP; this thread alone posts.
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    let mut last = 0;
    for round in 0..2u64 {
        // Some traffic first, so the CQ's place is not a multiple of anything.
        for i in 0..(37 + 11 * round) {
            last = dev.put(dst.remote(i * 64), src.local(i * 64), 64).unwrap();
        }
        dev.wait(last).unwrap();
        let bad = gdaki_device::Remote {
            addr: dst.remote(0).addr,
            rkey: dst.rkey() ^ 0x5a5a,
        };
        let t = dev.put(bad, src.local(0), 8).unwrap();
        match dev.wait(t) {
            Err(WaitError::Cqe(e)) => assert_eq!(e.syndrome, Syndrome::RemoteAccess),
            other => panic!("a bad key: {other:?}"),
        }
        assert!(qa.error().is_some());
        // Posted after the error: flushed by the reset's drain.
        dev.put(dst.remote(0), src.local(0), 8).unwrap();
        reset_and_reconnect(&qa, &qb);
        dst.write(0, &vec![0; 1 << 16]).unwrap();
        // Four laps of the 16-slot ring, then one message of every size.
        let mut next = 0;
        for i in 0..64u64 {
            next = dev.put(dst.remote(i * 1024), src.local(i * 1024), 1024).unwrap();
            assert!(next > t, "tickets go on after the reset");
        }
        dev.wait(next).unwrap();
        let mut got = vec![0; 1 << 16];
        dst.read(0, &mut got).unwrap();
        let wrong = got.iter().zip(&data).position(|(g, d)| g != d);
        assert_eq!(wrong, None, "round {round}: every byte after the reset");
        assert_eq!(
            dev.atomic_fetch_add(dst.remote(0), 3, scratch.local(0)).unwrap(),
            u64::from_le_bytes(data[..8].try_into().unwrap())
        );
        dev.quiet().unwrap();
        assert_eq!((qa.error(), qb.error()), (None, None));
    }
}

#[test]
fn a_queue_pair_in_error_is_reset_and_posts_on_through_the_same_handle() {
    recovers(
        &Context::open(Provider::Soft).unwrap(),
        &Context::open(Provider::Soft).unwrap(),
    );
}

/// A QP that never failed resets too (from RTS: whatever is outstanding is flushed first), and
/// one in RESET already is left as it is.
#[test]
fn a_healthy_or_fresh_queue_pair_resets() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let q = qp(&ctx, 16, QpConfig::default());
    // SAFETY: no poster.
    unsafe { q.reset() }.unwrap();
    assert_eq!(q.state(), QpState::Reset);
    q.connect(&q.endpoint()).unwrap();
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    // SAFETY: as above.
    let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
    for _ in 0..5 {
        dev.wait(dev.put_inline(mr.remote(0), b"before").unwrap()).unwrap();
    }
    // SAFETY: no poster until the connect.
    unsafe { q.reset() }.unwrap();
    q.connect(&q.endpoint()).unwrap();
    let t = dev.put_inline(mr.remote(8), b"after").unwrap();
    // After the 5 WQEs before, the realignment's one signalled NOP.
    assert_eq!(t, 6, "the tickets go on");
    dev.wait(t).unwrap();
    let mut got = [0u8; 5];
    mr.read(8, &mut got).unwrap();
    assert_eq!(&got, b"after");
}

/// A QP with a receive queue: the receives posted before the reset are flushed (the reset
/// consumes their completions), and the
/// same views post receives and SENDs after it, across several laps of both queues (the
/// receive handle's base keeps the hardware's count from 0 and the tickets going on).
#[test]
fn a_queue_pair_with_a_receive_queue_resets_and_receives_on() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let q = qp(
        &ctx,
        16,
        QpConfig {
            receive: Some(ReceiveConfig { size: 8, max_bufs: 1 }),
            min_rnr_timer: 1,
            ..Default::default()
        },
    );
    q.connect(&q.endpoint()).unwrap();
    let mr = ctx.alloc_region(1 << 16, Access::ALL).unwrap();
    let data = pattern(11, 4096);
    mr.write(0, &data).unwrap();
    // SAFETY: the views do not outlive the QP; this thread alone uses them.
    let (sq, rq) = unsafe { (q.cpu::<Exclusive>().unwrap(), q.cpu_receive::<Exclusive>().unwrap()) };
    let round = |from: u64, messages: u64| {
        for m in from..from + messages {
            let r = rq.post_recv_one(mr.local(8192 + (m % 8) * 512), 512).unwrap();
            sq.wait(sq.send_imm(mr.local((m % 8) * 256), 256, m as u32).unwrap())
                .unwrap();
            let got = rq.poll(r).unwrap();
            assert_eq!(got.imm(), Some(m as u32), "message {m}");
            let mut back = vec![0u8; 256];
            mr.read(8192 + (m % 8) * 512, &mut back).unwrap();
            assert_eq!(back, data[(m % 8) as usize * 256..][..256], "message {m}");
        }
    };
    round(0, 13);
    // Two receives left posted, then an error.
    let waiting = [
        rq.post_recv_one(mr.local(8192), 512).unwrap(),
        rq.post_recv_one(mr.local(8704), 512).unwrap(),
    ];
    let bad = gdaki_device::Remote {
        addr: mr.remote(0).addr,
        rkey: mr.rkey() ^ 0x5a5a,
    };
    assert!(sq.wait(sq.put(bad, mr.local(0), 8).unwrap()).is_err());
    // SAFETY: nothing posts until the connect has returned.
    unsafe { q.reset() }.unwrap();
    q.connect(&q.endpoint()).unwrap();
    // The two posted before were flushed and their completions consumed by the reset: the next
    // receive's ticket follows them.
    assert_eq!(rq.post_recv_one(mr.local(8192), 512).unwrap(), waiting[1] + 1);
    sq.wait(sq.send_imm(mr.local(0), 256, 77).unwrap()).unwrap();
    assert_eq!(rq.poll(waiting[1] + 1).unwrap().imm(), Some(77));
    round(16, 21);
    assert_eq!(q.error(), None);
}

/// Receives posted before a first connect, then a reset of the fresh QP: they are flushed and
/// consumed too, so the receive CQ accounts for them and later receives complete in place.
#[test]
fn receives_posted_before_the_first_connect_are_flushed_by_a_reset() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let q = qp(
        &ctx,
        16,
        QpConfig {
            receive: Some(ReceiveConfig { size: 8, max_bufs: 1 }),
            ..Default::default()
        },
    );
    let mr = ctx.alloc_region(1 << 16, Access::ALL).unwrap();
    // SAFETY: the views do not outlive the QP; this thread alone uses them.
    let (sq, rq) = unsafe { (q.cpu::<Exclusive>().unwrap(), q.cpu_receive::<Exclusive>().unwrap()) };
    for i in 0..3 {
        rq.post_recv_one(mr.local(4096 * i), 4096).unwrap();
    }
    // SAFETY: nothing posts until the connect has returned.
    unsafe { q.reset() }.unwrap();
    q.connect(&q.endpoint()).unwrap();
    let r = rq.post_recv_one(mr.local(0), 4096).unwrap();
    assert_eq!(r, 3, "the three flushed receives are behind");
    sq.wait(sq.send_inline(b"after").unwrap()).unwrap();
    assert_eq!(rq.poll(r).unwrap().bytes, 5);
    assert_eq!(q.error(), None);
}
