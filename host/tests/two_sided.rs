//! Two-sided verbs on the soft provider in CPU mode: receives posted and polled through
//! `gdaki_device::Rq`, SEND / SEND with immediate / inline SEND / WRITE with immediate through
//! `gdaki_device::Qp`, between two contexts: data and completions, scatter lists, receives
//! larger and smaller than the message, "receiver not ready" with and without retries, many
//! receives outstanding across the ring's wrap, flushes, and every refusal.
mod common;
use common::{pattern, qp};
use std::thread;
use std::time::{Duration, Instant};

use gdaki::{Access, Context, Error, MemoryRegion, Provider, QpConfig, QpState, QueuePair, ReceiveConfig};
use gdaki_device::{Exclusive, PostError, Recv, RecvBuf, RecvKind, WaitError, MAX_SEND_INLINE};
use gdaki_layout::Syndrome;

/// Two connected QPs in two contexts, both with receive queues of `rq` receives of up to
/// `bufs` buffers, and a region of 1 MiB on each side.
struct Pair {
    a: QueuePair,
    b: QueuePair,
    la: MemoryRegion,
    lb: MemoryRegion,
    _ctx: (Context, Context),
}

fn pair_with(rq: u32, bufs: u32, cfg: QpConfig) -> Pair {
    let (ca, cb) = (
        Context::open(Provider::Soft).unwrap(),
        Context::open(Provider::Soft).unwrap(),
    );
    let cfg = QpConfig {
        receive: Some(ReceiveConfig {
            size: rq,
            max_bufs: bufs,
        }),
        ..cfg
    };
    let (a, b) = (qp(&ca, 64, cfg.clone()), qp(&cb, 64, cfg));
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    let la = ca.alloc_region(1 << 20, Access::ALL).unwrap();
    let lb = cb.alloc_region(1 << 20, Access::ALL).unwrap();
    Pair {
        a,
        b,
        la,
        lb,
        _ctx: (ca, cb),
    }
}

fn pair(rq: u32, bufs: u32) -> Pair {
    pair_with(rq, bufs, QpConfig::default())
}

/// [`pair`] with one-buffer receives whose waits time out after 300 ms, for tests of them.
fn pair_with_short_waits(rq: u32) -> Pair {
    pair_with(
        rq,
        1,
        QpConfig {
            timeout: Duration::from_millis(300),
            retry_timeout: Duration::from_millis(200),
            ..Default::default()
        },
    )
}

fn cqe_error<T: std::fmt::Debug>(r: Result<T, WaitError>) -> Syndrome {
    match r {
        Err(WaitError::Cqe(e)) => e.syndrome,
        other => panic!("expected an error CQE, got {other:?}"),
    }
}

#[test]
fn sends_land_in_receives_with_their_counts_and_immediates() {
    let p = pair(16, 4);
    let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
    let data = pattern(7, 5000);
    p.la.write(0, &data).unwrap();
    // A SEND into one buffer larger than the message.
    let r0 = rb.post_recv_one(p.lb.local(0), 8192).unwrap();
    sa.wait(sa.send(p.la.local(0), 5000).unwrap()).unwrap();
    // A wait that reads nothing, then the poll that reads the completion (still in its slot).
    rb.wait(r0).unwrap();
    let got = rb.poll(r0).unwrap();
    assert_eq!(
        got,
        Recv {
            index: r0,
            bytes: 5000,
            kind: RecvKind::Send,
            src_qpn: p.a.qpn()
        }
    );
    let mut back = vec![0; 5000];
    p.lb.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    // A SEND with immediate scattered over three buffers, in order.
    let bufs = [(100_000u64, 1000u32), (200_000, 24), (300_000, 4000)].map(|(at, len)| RecvBuf {
        local: p.lb.local(at),
        len,
    });
    let r1 = rb.post_recv(&bufs).unwrap();
    sa.wait(sa.send_imm(p.la.local(0), 3000, 0xdead_beef).unwrap()).unwrap();
    let got = rb.poll(r1).unwrap();
    assert_eq!(
        (got.bytes, got.kind, got.imm()),
        (3000, RecvKind::SendImm(0xdead_beef), Some(0xdead_beef))
    );
    let mut parts = vec![0; 3000];
    p.lb.read(100_000, &mut parts[..1000]).unwrap();
    p.lb.read(200_000, &mut parts[1000..1024]).unwrap();
    p.lb.read(300_000, &mut parts[1024..]).unwrap();
    assert_eq!(parts, data[..3000]);
    // Inline, up to the most one building block carries, and zero bytes.
    let r2 = rb.post_recv_one(p.lb.local(400_000), 64).unwrap();
    let r3 = rb.post_recv_one(p.lb.local(400_100), 64).unwrap();
    sa.wait(sa.send_inline(&data[..MAX_SEND_INLINE]).unwrap()).unwrap();
    sa.wait(sa.send(p.la.local(0), 0).unwrap()).unwrap();
    assert_eq!(rb.poll(r2).unwrap().bytes, MAX_SEND_INLINE as u32);
    assert_eq!(rb.poll(r3).unwrap().bytes, 0);
    let mut small = vec![0; MAX_SEND_INLINE];
    p.lb.read(400_000, &mut small).unwrap();
    assert_eq!(small, data[..MAX_SEND_INLINE]);
    // A WRITE with immediate: the bytes go where the writer says, the receive's buffer stays
    // untouched, its completion carries the immediate and the count.
    p.lb.write(500_000, &[0xaa; 16]).unwrap();
    let r4 = rb.post_recv_one(p.lb.local(500_000), 16).unwrap();
    sa.wait(sa.write_imm(p.lb.remote(600_000), p.la.local(0), 4096, 42).unwrap())
        .unwrap();
    let got = rb.poll(r4).unwrap();
    assert_eq!((got.bytes, got.kind), (4096, RecvKind::WriteImm(42)));
    let mut written = vec![0; 4096];
    p.lb.read(600_000, &mut written).unwrap();
    assert_eq!(written, data[..4096]);
    let mut untouched = [0; 16];
    p.lb.read(500_000, &mut untouched).unwrap();
    assert_eq!(untouched, [0xaa; 16]);
    // Nothing else arrived; both QPs are fine.
    assert!(rb.poll_next().is_none());
    assert_eq!((p.a.error(), p.b.error()), (None, None));
}

/// A WRITE with immediate longer than one WQE is split: only its last WQE takes a receive,
/// after every byte is in place.
#[test]
fn a_long_write_with_immediate_takes_one_receive_after_all_its_bytes() {
    let p = pair_with(
        4,
        1,
        QpConfig {
            max_msg_size: 4096,
            ..Default::default()
        },
    );
    let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
    let data = pattern(9, 10_000);
    p.la.write(0, &data).unwrap();
    let r = rb.post_recv_one(p.lb.local(0), 0).unwrap();
    sa.wait(sa.write_imm(p.lb.remote(100_000), p.la.local(0), 10_000, 7).unwrap())
        .unwrap();
    let got = rb.poll(r).unwrap();
    assert_eq!(got.kind, RecvKind::WriteImm(7));
    assert_eq!(got.bytes, 10_000 - 2 * 4096, "the last WQE's bytes");
    let mut back = vec![0; 10_000];
    p.lb.read(100_000, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(rb.poll_next().is_none(), "one receive taken");
    // A SEND is one message: longer than max_msg_size is refused before posting.
    assert!(matches!(
        sa.send(p.la.local(0), 4097),
        Err(PostError::TooLong { len: 4097, max: 4096 })
    ));
}

#[test]
fn a_receive_smaller_than_the_message_fails_both_sides_and_flushes_the_rest() {
    let p = pair(8, 1);
    let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
    let small = rb.post_recv_one(p.lb.local(0), 100).unwrap();
    let later = [
        rb.post_recv_one(p.lb.local(4096), 100).unwrap(),
        rb.post_recv_one(p.lb.local(8192), 100).unwrap(),
    ];
    p.lb.write(0, &[0x55; 100]).unwrap();
    assert_eq!(
        cqe_error(sa.wait(sa.send(p.la.local(0), 101).unwrap())),
        Syndrome::RemoteInvalReq
    );
    assert_eq!(cqe_error(rb.poll(small)), Syndrome::LocalLength);
    for r in later {
        assert_eq!(cqe_error(rb.poll(r)), Syndrome::WrFlush);
    }
    assert_eq!(p.b.state(), QpState::Error);
    // The QP's error is its receive's, not the flush that followed.
    assert_eq!(p.b.error(), Some(Syndrome::LocalLength));
    let mut kept = [0; 100];
    p.lb.read(0, &mut kept).unwrap();
    assert_eq!(
        kept, [0x55; 100],
        "nothing written into a receive that cannot take the message"
    );
}

#[test]
fn receiver_not_ready_is_retried_until_a_receive_comes() {
    let p = pair_with(
        4,
        1,
        QpConfig {
            min_rnr_timer: 1, // 10 us between tries
            ..Default::default()
        },
    );
    let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
    p.la.write(0, b"late receive").unwrap();
    let t = sa.send(p.la.local(0), 12).unwrap();
    let started = Instant::now();
    // Another thread posts the receive later (the handle travels as an address).
    let (handle, buf) = (p.b.receive_handle().unwrap() as usize, p.lb.local(0));
    let poster = thread::spawn(move || {
        thread::sleep(Duration::from_millis(20));
        // SAFETY: the QP outlives the thread (joined below); only this thread posts.
        let rq = unsafe { gdaki_device::Rq::<Exclusive>::from_raw(handle as *mut gdaki_layout::DevRq) };
        rq.post_recv_one(buf, 64)
    });
    sa.wait(t).unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(20),
        "completed before any receive"
    );
    let r = poster.join().unwrap().unwrap();
    assert_eq!(rb.poll(r).unwrap().bytes, 12);
    let mut got = [0; 12];
    p.lb.read(0, &mut got).unwrap();
    assert_eq!(&got, b"late receive");
}

#[test]
fn receiver_not_ready_past_the_retry_count_fails_the_sender_only() {
    for rnr_retry in [0u8, 2] {
        let p = pair_with(
            4,
            1,
            QpConfig {
                rnr_retry,
                min_rnr_timer: 1,
                ..Default::default()
            },
        );
        let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
        assert_eq!(
            cqe_error(sa.wait(sa.send_inline(b"nobody listens").unwrap())),
            Syndrome::RnrRetryExc,
            "rnr_retry {rnr_retry}"
        );
        assert_eq!(p.a.state(), QpState::Error);
        // The responder is untouched: a receive posted now waits for a message.
        assert_eq!(p.b.state(), QpState::Rts);
        let r = rb.post_recv_one(p.lb.local(0), 64).unwrap();
        assert!(rb.try_poll(r).is_none());
    }
}

/// Many receives outstanding, reposted as they complete, across several laps of a small ring.
#[test]
fn receives_outstanding_across_the_ring_wrap_complete_in_order() {
    let p = pair(8, 1);
    let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
    let mut next = Vec::new();
    for i in 0..8u64 {
        next.push(rb.post_recv_one(p.lb.local(i * 64), 64).unwrap());
    }
    for m in 0..100u64 {
        let msg = m.to_le_bytes();
        sa.wait(sa.send_inline(&msg).unwrap()).unwrap();
        let r = next.remove(0);
        assert_eq!(r, m);
        let got = rb.poll(r).unwrap();
        assert_eq!((got.index, got.bytes), (m, 8));
        let mut back = [0; 8];
        p.lb.read((m % 8) * 64, &mut back).unwrap();
        assert_eq!(u64::from_le_bytes(back), m);
        next.push(rb.post_recv_one(p.lb.local((m % 8) * 64), 64).unwrap());
    }
}

#[test]
fn moving_a_qp_to_error_flushes_its_receives() {
    let p = pair(8, 1);
    let rb = unsafe { p.b.cpu_receive::<Exclusive>().unwrap() };
    let posted: Vec<u64> = (0..5)
        .map(|i| rb.post_recv_one(p.lb.local(i * 64), 64).unwrap())
        .collect();
    p.b.to_error().unwrap();
    for (i, r) in posted.into_iter().enumerate() {
        let outcome = if i % 2 == 0 { rb.poll(r).map(drop) } else { rb.wait(r) };
        assert_eq!(cqe_error(outcome), Syndrome::WrFlush);
    }
    // Receives posted after the QP failed are flushed too.
    let r = rb.post_recv_one(p.lb.local(0), 64).unwrap();
    assert_eq!(cqe_error(rb.poll(r)), Syndrome::WrFlush);
}

#[test]
fn a_receive_into_memory_it_may_not_write_fails_there_and_answers_a_remote_error() {
    let p = pair(4, 1);
    let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
    let bad = gdaki_device::Local {
        addr: p.lb.local(0).addr,
        lkey: p.lb.local(0).lkey ^ 0x100,
    };
    let r = rb.post_recv_one(bad, 64).unwrap();
    assert_eq!(cqe_error(sa.wait(sa.send_inline(b"x").unwrap())), Syndrome::RemoteOp);
    assert_eq!(cqe_error(rb.poll(r)), Syndrome::LocalProt);
    assert_eq!(p.b.error(), Some(Syndrome::LocalProt));
    assert_eq!(p.a.error(), Some(Syndrome::RemoteOp));
}

#[test]
fn a_send_to_a_qp_without_a_receive_queue_is_an_invalid_request() {
    let (ca, cb) = (
        Context::open(Provider::Soft).unwrap(),
        Context::open(Provider::Soft).unwrap(),
    );
    let (a, b) = (qp(&ca, 16, QpConfig::default()), qp(&cb, 16, QpConfig::default()));
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    let sa = unsafe { a.cpu::<Exclusive>().unwrap() };
    assert_eq!(
        cqe_error(sa.wait(sa.send_inline(b"x").unwrap())),
        Syndrome::RemoteInvalReq
    );
    // And no receive view of it.
    let Err(err) = (unsafe { b.cpu_receive::<Exclusive>() }) else {
        panic!("a receive view of a QP without a receive queue")
    };
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
}

#[test]
fn bad_receive_arguments_are_refused_before_anything_is_posted() {
    let p = pair(4, 2);
    let rb = unsafe { p.b.cpu_receive::<Exclusive>().unwrap() };
    let buf = RecvBuf {
        local: p.lb.local(0),
        len: 8,
    };
    assert_eq!(
        rb.post_recv(&[buf; 3]),
        Err(PostError::TooManyBufs { count: 3, max: 2 })
    );
    assert!(matches!(
        rb.post_recv(&[RecvBuf { len: u32::MAX, ..buf }]),
        Err(PostError::TooLong { .. })
    ));
    assert!(matches!(
        unsafe { p.a.cpu::<Exclusive>().unwrap() }.send_inline(&[0; MAX_SEND_INLINE + 1]),
        Err(PostError::InlineTooLong { .. })
    ));
    // Nothing was posted: the first receive is still index 0.
    assert_eq!(rb.post_recv(&[buf]).unwrap(), 0);
    let ctx = Context::open(Provider::Soft).unwrap();
    let cq = ctx.create_cq(16).unwrap();
    for (size, max_bufs) in [(0, 1), (3, 1), (1 << 20, 1), (16, 0), (16, 5)] {
        let cfg = QpConfig {
            sq_size: 16,
            receive: Some(ReceiveConfig { size, max_bufs }),
            ..Default::default()
        };
        let err = ctx.create_qp(&cq, cfg).unwrap_err();
        assert!(
            matches!(err, Error::OutOfRange { .. } | Error::BadSize { .. }),
            "{size} {max_bufs}: {err}"
        );
    }
    for (rnr_retry, min_rnr_timer) in [(8, 12), (7, 32)] {
        let cfg = QpConfig {
            sq_size: 16,
            rnr_retry,
            min_rnr_timer,
            ..Default::default()
        };
        assert!(matches!(ctx.create_qp(&cq, cfg), Err(Error::OutOfRange { .. })));
    }
}

/// A receive's slot (and its CQE's) is reused only once its completion was polled: a receive
/// posted a ring ahead of completions nobody polled waits (bounded) instead of overrunning the
/// receive CQ, and goes once one is polled.
#[test]
fn a_receive_a_ring_ahead_of_unpolled_completions_waits_for_a_poll() {
    let p = pair_with_short_waits(4);
    let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
    let first: Vec<u64> = (0..4)
        .map(|i| rb.post_recv_one(p.lb.local(i * 64), 64).unwrap())
        .collect();
    for i in 0..4u8 {
        sa.wait(sa.send_inline(&[i; 8]).unwrap()).unwrap();
    }
    // Four completions written, none polled: a fifth receive would reuse receive 0's CQE slot.
    let started = Instant::now();
    assert_eq!(
        rb.post_recv_one(p.lb.local(512), 64),
        Err(PostError::Wait(WaitError::Timeout { index: 0 }))
    );
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert_eq!(rb.poll(first[0]).unwrap().bytes, 8);
    let fifth = rb.post_recv_one(p.lb.local(512), 64).unwrap();
    sa.wait(sa.send_inline(&[9; 8]).unwrap()).unwrap();
    assert_eq!(rb.poll(fifth).unwrap().bytes, 8);
    for r in &first[1..] {
        assert_eq!(rb.poll(*r).unwrap().bytes, 8);
    }
    assert_eq!((p.a.error(), p.b.error()), (None, None));
}

/// `wait_arrived` returns once a receive's completion is written and leaves it there: the
/// receive still counts as outstanding, its slot is not reusable, and `poll` (or `wait`) then
/// reads and consumes it; a receive nothing arrives for times out, consuming nothing; an error
/// completion is arrived too, and its error is the poll's.
#[test]
fn waiting_for_a_receive_to_arrive_leaves_its_completion_for_the_poll() {
    let p = pair_with_short_waits(4);
    let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
    assert_eq!(rb.size(), 4);
    let r0 = rb.post_recv_one(p.lb.local(0), 64).unwrap();
    let r1 = rb.post_recv_one(p.lb.local(64), 64).unwrap();
    rb.post_recvs(2, |i| RecvBuf {
        local: p.lb.local(128 + 64 * i as u64),
        len: 64,
    })
    .unwrap();
    let started = Instant::now();
    assert_eq!(rb.wait_arrived(r0), Err(WaitError::Timeout { index: r0 }));
    assert!(started.elapsed() >= Duration::from_millis(250));
    sa.wait(sa.send_inline(b"arrived").unwrap()).unwrap();
    rb.wait_arrived(r0).unwrap();
    rb.wait_arrived(r0).unwrap();
    assert_eq!((rb.next_to_complete(), rb.outstanding()), (r0, 4), "nothing consumed");
    // Every slot is taken until a poll frees one.
    assert_eq!(
        rb.post_recv_one(p.lb.local(512), 64),
        Err(PostError::Wait(WaitError::Timeout { index: r0 }))
    );
    let got = rb.poll(r0).unwrap();
    assert_eq!((got.index, got.bytes, got.kind), (r0, 7, RecvKind::Send));
    assert_eq!(rb.next_to_complete(), r1);
    let r4 = rb.post_recv_one(p.lb.local(512), 64).unwrap();
    p.b.to_error().unwrap();
    rb.wait_arrived(r1).unwrap();
    assert_eq!(cqe_error(rb.poll(r1)), Syndrome::WrFlush);
    for r in r1 + 1..r4 {
        assert_eq!(cqe_error(rb.poll(r)), Syndrome::WrFlush);
    }
    rb.wait_arrived(r4).unwrap();
    assert_eq!(cqe_error(rb.wait(r4)), Syndrome::WrFlush);
}

/// `post_recvs` posts a batch behind one record update: consecutive tickets, each receive
/// its own buffer; a batch larger than the queue, or with a buffer too long, posts nothing;
/// one that needs slots whose completions nobody polled waits (bounded), posting nothing.
#[test]
fn a_batch_of_receives_goes_up_whole_or_not_at_all() {
    let p = pair_with_short_waits(8);
    let (sa, rb) = unsafe { (p.a.cpu::<Exclusive>().unwrap(), p.b.cpu_receive::<Exclusive>().unwrap()) };
    let at = |i: u32| RecvBuf {
        local: p.lb.local(i as u64 * 64),
        len: 64,
    };
    assert_eq!(rb.post_recvs(9, at), Err(PostError::BadCount { count: 9, ring: 8 }));
    let huge = |i: u32| RecvBuf {
        len: if i == 2 { u32::MAX } else { 64 },
        ..at(i)
    };
    assert!(matches!(rb.post_recvs(3, huge), Err(PostError::TooLong { .. })));
    assert_eq!((rb.post_recvs(0, at), rb.outstanding()), (Ok(0), 0));
    assert_eq!(rb.post_recvs(6, at), Ok(0));
    assert_eq!(rb.outstanding(), 6);
    for i in 0..6u8 {
        sa.wait(sa.send_inline(&[i; 8]).unwrap()).unwrap();
    }
    // Six completions unpolled: a batch of three needs slot 0's again.
    assert_eq!(
        rb.post_recvs(3, at),
        Err(PostError::Wait(WaitError::Timeout { index: 0 }))
    );
    assert_eq!(rb.outstanding(), 6);
    for r in 0..6 {
        let got = rb.poll(r).unwrap();
        assert_eq!(got.bytes, 8);
        let mut bytes = [0u8; 8];
        p.lb.read(r * 64, &mut bytes).unwrap();
        assert_eq!(bytes, [r as u8; 8], "receive {r} landed in its own buffer");
    }
    assert_eq!(rb.post_recvs(3, at), Ok(6));
    sa.wait(sa.send_inline(&[7; 8]).unwrap()).unwrap();
    assert_eq!(rb.poll(6).unwrap().bytes, 8);
    assert_eq!((p.a.error(), p.b.error()), (None, None));
}

/// `put_bw --send`'s receiver (`perf::recv_stream`): takes exactly its count through a queue
/// smaller than the stream, across the ring's wrap, into slots; leaves no receive behind for a
/// later stream; and counts the bytes, so a message of another size shows.
#[test]
fn the_perftest_receiver_takes_its_count_and_leaves_nothing_posted() {
    use gdaki_device::perf::{put_stream, recv_stream};
    use gdaki_layout::perf::StreamOp;
    let p = pair(8, 1);
    let sa = unsafe { p.a.cpu::<Exclusive>().unwrap() };
    const LEN: u64 = 100;
    let data = pattern(3, LEN as usize);
    for slot in 0..4 {
        p.la.write(slot * LEN, &data).unwrap();
    }
    // A receiving thread takes `count` messages, `ahead` receives posted, while `send` runs.
    let receive = |count, ahead, send: &dyn Fn()| {
        thread::scope(|s| {
            let taker = s.spawn(|| {
                // SAFETY: this thread is the receive queue's only user while it runs.
                let rb = unsafe { p.b.cpu_receive::<Exclusive>() }.unwrap();
                (
                    recv_stream(rb, p.lb.local(0), LEN as u32, 4, count, ahead),
                    rb.outstanding(),
                )
            });
            send();
            taker.join().unwrap()
        })
    };
    let all = || put_stream(sa, p.lb.remote(0), p.la.local(0), LEN, 4, 0, 1, 50, StreamOp::Send).unwrap();
    assert_eq!(receive(50, 6, &all), (Ok(50 * LEN), 0));
    for slot in 0..4 {
        let mut got = vec![0; LEN as usize];
        p.lb.read(slot * LEN, &mut got).unwrap();
        assert_eq!(got, data, "slot {slot}");
    }
    // One short message among three: the bytes say so.
    let three = || {
        for len in [LEN, 10, LEN] {
            sa.wait(sa.send(p.la.local(0), len).unwrap()).unwrap();
        }
    };
    assert_eq!(receive(3, 2, &three), (Ok(2 * LEN + 10), 0));
}
