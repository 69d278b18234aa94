//! The soft provider end to end in CPU mode: the device crate's API, driven by CPU threads,
//! against the soft HCA: every opcode, sizes from 0 B to 64 MiB, many QPs, ring wrap, every
//! fault with its syndrome and the flush after it, CQ overrun, a vanished peer.
mod common;
use common::{loopback_qp, pattern, qp, ReadVec};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use gdaki::{Access, Context, Error, Provider, QpConfig, QpState};
use gdaki_device::{Exclusive, Gpu, PostError, WaitError};
use gdaki_layout::Syndrome;

/// Posts one operation and returns its ticket.
type Post<'a> = dyn Fn(&gdaki_device::Qp<Exclusive>) -> Result<u64, PostError> + 'a;

/// Posts one WQE written by `write` at its reserved index (by hand, as a fault test needs) and
/// returns the syndrome of its error CQE.
fn raw_wqe_error(dev: &gdaki_device::Qp<Exclusive>, write: impl FnOnce(u64)) -> Syndrome {
    let i = dev.reserve(1).unwrap();
    write(i);
    dev.mark_ready(i, i + 1).unwrap();
    dev.submit(i + 1).unwrap();
    cqe_error(dev.wait(i))
}

fn cqe_error(r: Result<(), WaitError>) -> Syndrome {
    match r {
        Err(WaitError::Cqe(e)) => e.syndrome,
        other => panic!("expected an error CQE, got {other:?}"),
    }
}

#[test]
fn every_opcode_between_two_contexts() {
    let (a, b) = (
        Context::open(Provider::Soft).unwrap(),
        Context::open(Provider::Auto).unwrap(),
    );
    assert_eq!(b.provider(), Provider::Soft);
    let (qa, qb) = (qp(&a, 64, QpConfig::default()), qp(&b, 64, QpConfig::default()));
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    assert_eq!(qa.state(), QpState::Rts);
    let la = a.alloc_region(1 << 16, Access::ALL).unwrap();
    let rb = b.alloc_region(1 << 16, Access::ALL).unwrap();
    let data = pattern(1, 5000);
    la.write(0, &data).unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    dev.wait(dev.put(rb.remote(100), la.local(0), 5000).unwrap()).unwrap();
    let mut got = vec![0; 5000];
    rb.read(100, &mut got).unwrap();
    assert_eq!(got, data, "RDMA WRITE");
    dev.wait(dev.put_inline(rb.remote(8000), b"inline bytes").unwrap())
        .unwrap();
    dev.wait(dev.get(la.local(20000), rb.remote(8000), 12).unwrap())
        .unwrap();
    let mut back = [0u8; 12];
    la.read(20000, &mut back).unwrap();
    assert_eq!(&back, b"inline bytes", "RDMA READ of an inline WRITE");
    dev.wait(dev.put(rb.remote(0), la.local(0), 0).unwrap()).unwrap();
    dev.wait(dev.put_inline(rb.remote(0), &[]).unwrap()).unwrap();
    dev.wait(dev.fenced().put(rb.remote(8192), la.local(20000), 12).unwrap())
        .unwrap();
    assert_eq!(dev.atomic_fetch_add(rb.remote(12288), 5, la.local(4096)).unwrap(), 0);
    assert_eq!(dev.atomic_fetch_add(rb.remote(12288), 7, la.local(4096)).unwrap(), 5);
    assert_eq!(
        dev.atomic_compare_swap(rb.remote(12288), 12, 100, la.local(4096))
            .unwrap(),
        12
    );
    assert_eq!(
        dev.atomic_compare_swap(rb.remote(12288), 12, 1, la.local(4096))
            .unwrap(),
        100
    );
    assert_eq!(rb.load_u64(12288).unwrap(), 100, "remote memory holds the native value");
    dev.wait(
        dev.put_signal(rb.remote(9000), la.local(0), 64, rb.remote(12296), 1, la.local(4200))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(rb.load_u64(12296).unwrap(), 1);
    dev.quiet().unwrap();
    assert_eq!(qa.error(), None);
}

/// A message is split into WQEs of `max_msg_size` bytes, at most one send queue of them in one
/// call: beyond that (`u64::MAX`, a negative size cast, once took 2^34 WQEs and 53 minutes) the
/// call is refused at once, before anything is posted, and the QP goes on.
#[test]
fn a_message_longer_than_one_send_queue_of_wqes_is_refused_at_once() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = qp(
        &ctx,
        16,
        QpConfig {
            max_msg_size: 1 << 20,
            ..Default::default()
        },
    );
    qp.connect(&qp.endpoint()).unwrap();
    let src = ctx.alloc_region(16 << 20, Access::ALL).unwrap();
    let dst = ctx.alloc_region(16 << 20, Access::ALL).unwrap();
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    for len in [u64::MAX, (16 << 20) + 1, 1 << 40] {
        let started = std::time::Instant::now();
        let err = dev.put(dst.remote(0), src.local(0), len).unwrap_err();
        assert!(matches!(err, PostError::BadCount { ring: 16, .. }), "{len}: {err}");
        let err = dev.get(dst.local(0), src.remote(0), len).unwrap_err();
        assert!(matches!(err, PostError::BadCount { ring: 16, .. }), "{len}: {err}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(1),
            "{len}: {:?}",
            started.elapsed()
        );
    }
    // The largest that fits still goes, and the QP is fine.
    let t = dev.put(dst.remote(0), src.local(0), 16 << 20).unwrap();
    dev.wait(t).unwrap();
    assert_eq!(qp.error(), None);
}

#[test]
fn sizes_from_zero_to_64_mib_and_splits() {
    let ctx = Context::open(Provider::Soft).unwrap();
    // 64 MiB in 1 MiB WQEs: a send queue of 64 holds them.
    let qp = qp(
        &ctx,
        64,
        QpConfig {
            max_msg_size: 1 << 20,
            ..Default::default()
        },
    );
    qp.connect(&qp.endpoint()).unwrap();
    let total = 64 << 20;
    let src = ctx.alloc_region(total, Access::ALL).unwrap();
    let dst = ctx.alloc_region(total, Access::ALL).unwrap();
    let data = pattern(7, total);
    src.write(0, &data).unwrap();
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    for len in [
        0usize,
        1,
        7,
        8,
        63,
        64,
        65,
        4095,
        4096,
        1 << 20,
        (1 << 20) + 1,
        3 << 20,
        total,
    ] {
        let t = dev.put(dst.remote(0), src.local(0), len as u64).unwrap();
        dev.wait(t).unwrap();
        let mut got = vec![0; len];
        dst.read(0, &mut got).unwrap();
        assert!(got == data[..len], "{len} bytes");
    }
    assert_eq!(qp.error(), None);
}

#[test]
fn many_qps_many_threads_wrap_their_rings() {
    let ctx = Arc::new(Context::open(Provider::Soft).unwrap());
    let mr = Arc::new(ctx.alloc_region(8 * 64 * 1024, Access::ALL).unwrap());
    let reference = pattern(3, 64 * 1024);
    mr.write(0, &reference).unwrap();
    thread::scope(|s| {
        for q in 0..4u64 {
            let (ctx, mr, reference) = (ctx.clone(), mr.clone(), &reference);
            s.spawn(move || {
                let qp = loopback_qp(&ctx, 8, QpConfig::default());
                let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
                let base = (q + 1) * 64 * 1024;
                for i in 0..500u64 {
                    let off = (i * 131) % (64 * 1024 - 256);
                    dev.put(mr.remote(base + off), mr.local(off), 200).unwrap();
                }
                dev.quiet().unwrap();
                let mut got = vec![0; 200];
                let off = (499 * 131) % (64 * 1024 - 256);
                mr.read(base + off, &mut got).unwrap();
                assert_eq!(got, reference[off as usize..off as usize + 200]);
            });
        }
    });
}

#[test]
fn shared_qp_gpu_mode_threads_fetch_add() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 32, QpConfig::default());
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    let mut seen: Vec<u64> = thread::scope(|s| {
        let hs: Vec<_> = (0..3u64)
            .map(|t| {
                let (qp, mr) = (&qp, &mr);
                s.spawn(move || {
                    let dev = unsafe { qp.cpu::<Gpu>() }.unwrap();
                    (0..300)
                        .map(|_| dev.atomic_fetch_add(mr.remote(0), 1, mr.local(64 + 8 * t)).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    seen.sort_unstable();
    assert_eq!(seen, (0..900).collect::<Vec<_>>());
}

/// One fault per case: the failing WQE reports its syndrome, the next is flushed, and nothing
/// outside a region is written.
#[test]
fn faults_report_their_syndrome_and_flush_what_follows() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    let ro = ctx.alloc_region(4096, Access::REMOTE_READ).unwrap();
    let cases: Vec<(&str, Syndrome, Box<Post<'_>>)> = vec![
        (
            "bad rkey",
            Syndrome::RemoteAccess,
            Box::new(|d| {
                d.put(
                    gdaki_device::Remote {
                        addr: mr.addr(),
                        rkey: mr.rkey() ^ 1,
                    },
                    mr.local(0),
                    8,
                )
            }),
        ),
        (
            "remote out of bounds",
            Syndrome::RemoteAccess,
            Box::new(|d| d.put(mr.remote(4090), mr.local(0), 8)),
        ),
        (
            "no remote write right",
            Syndrome::RemoteAccess,
            Box::new(|d| d.put(ro.remote(0), mr.local(0), 8)),
        ),
        (
            "bad lkey",
            Syndrome::LocalProt,
            Box::new(|d| {
                d.put(
                    mr.remote(0),
                    gdaki_device::Local {
                        addr: mr.addr(),
                        lkey: 0x1234,
                    },
                    8,
                )
            }),
        ),
        (
            "local out of bounds",
            Syndrome::LocalProt,
            Box::new(|d| d.put(mr.remote(0), mr.local(4095), 8)),
        ),
        (
            "READ into a region without local write",
            Syndrome::LocalProt,
            Box::new(|d| d.get(ro.local(0), mr.remote(0), 8)),
        ),
        (
            // The device refuses it before posting (`PostError::Misaligned`); a WQE written by
            // hand reaches the HCA, which answers as a NIC does.
            "misaligned atomic",
            Syndrome::RemoteInvalReq,
            Box::new(|d| {
                assert!(matches!(
                    d.signal(mr.remote(4), 1, mr.local(64)),
                    Err(PostError::Misaligned { .. })
                ));
                let i = d.reserve(1)?;
                d.wqe_prepare_atomic(i, gdaki_device::AtomicOp::FetchAdd(1), mr.remote(4), mr.local(64), 0);
                d.mark_ready(i, i + 1)?;
                d.submit(i + 1)?;
                Ok(i)
            }),
        ),
        (
            "atomic without the right",
            Syndrome::RemoteAccess,
            Box::new(|d| d.signal(ro.remote(0), 1, mr.local(64))),
        ),
    ];
    for (name, syndrome, post) in cases {
        let qp = loopback_qp(&ctx, 8, QpConfig::default());
        let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
        let bad = post(&dev).unwrap();
        let after = dev.put(mr.remote(0), mr.local(0), 8).unwrap();
        assert_eq!(cqe_error(dev.wait(bad)), syndrome, "{name}");
        assert_eq!(
            cqe_error(dev.wait(after)),
            Syndrome::WrFlush,
            "{name}: the next WQE is flushed"
        );
        assert_eq!(qp.state(), QpState::Error, "{name}");
        assert_eq!(qp.error(), Some(syndrome), "{name}");
    }
    // Nothing was written past the read-only region or the end of the other.
    let mut ro_bytes = vec![1; 4096];
    ro.read(0, &mut ro_bytes).unwrap();
    assert!(ro_bytes.iter().all(|&b| b == 0));
}

#[test]
fn message_larger_than_the_limit_is_a_local_length_error() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 8, QpConfig::default());
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    // Write a WQE by hand that claims more than max_msg_size (the device API splits instead).
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    let s = raw_wqe_error(&dev, |i| {
        dev.wqe_prepare_write(i, mr.remote(0), mr.local(0), u32::MAX, 0)
    });
    assert_eq!(s, Syndrome::LocalLength);
}

#[test]
fn malformed_wqe_is_an_error_not_a_crash() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 8, QpConfig::default());
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    let s = raw_wqe_error(&dev, |i| {
        dev.wqe_prepare_nop(i, 0);
        // Corrupt the opcode into one the model does not execute (0x7f), keeping the CQE request.
        unsafe { *(dev.wqe_ptr(i) as *mut u8).add(3) = 0x7f };
    });
    assert_eq!(s, Syndrome::LocalQpOp);
}

#[test]
fn a_wqe_running_past_the_doorbell_is_an_error_and_nothing_past_it_is_read() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 8, QpConfig::default());
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    let s = raw_wqe_error(&dev, |i| {
        dev.wqe_prepare_nop(i, 0);
        // Claim 5 segments (two building blocks) but ring only one.
        unsafe { *(dev.wqe_ptr(i) as *mut u8).add(7) = 5 };
    });
    assert_eq!(s, Syndrome::LocalQpOp);
}

#[test]
fn posting_to_a_qp_that_is_not_ready_fails_and_states_are_checked() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = qp(&ctx, 8, QpConfig::default());
    assert!(matches!(qp.to_rts(), Err(Error::BadTransition { .. })));
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    let t = dev
        .put(gdaki_device::Remote::default(), gdaki_device::Local::default(), 0)
        .unwrap();
    assert_eq!(cqe_error(dev.wait(t)), Syndrome::LocalQpOp, "a WQE on a QP in RESET");
    assert_eq!(qp.state(), QpState::Error);
    assert!(matches!(qp.connect(&qp.endpoint()), Err(Error::BadTransition { .. })));
}

#[test]
fn sizes_and_objects_are_validated() {
    let ctx = Context::open(Provider::Soft).unwrap();
    assert!(matches!(ctx.create_cq(0), Err(Error::BadSize { .. })));
    assert!(matches!(ctx.create_cq(100), Err(Error::BadSize { .. })));
    let cq = ctx.create_cq(16).unwrap();
    for sq in [0, 3, 32, 1 << 16] {
        assert!(
            ctx.create_qp(
                &cq,
                QpConfig {
                    sq_size: sq,
                    ..Default::default()
                }
            )
            .is_err(),
            "sq {sq}"
        );
    }
    let qp = ctx
        .create_qp(
            &cq,
            QpConfig {
                sq_size: 16,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(matches!(
        ctx.create_qp(
            &cq,
            QpConfig {
                sq_size: 16,
                ..Default::default()
            }
        ),
        Err(Error::CqInUse { .. })
    ));
    let other = Context::open(Provider::Soft).unwrap();
    assert!(matches!(
        other.create_qp(
            &cq,
            QpConfig {
                sq_size: 16,
                ..Default::default()
            }
        ),
        Err(Error::ForeignObject { .. })
    ));
    drop(qp);
    ctx.create_qp(
        &cq,
        QpConfig {
            sq_size: 16,
            ..Default::default()
        },
    )
    .expect("the CQ is free again");
    assert!(matches!(
        Context::open(Provider::Mlx5),
        Err(Error::NoRdmaDevice | Error::Device { .. })
    ));
    let a = ctx.alloc_region(64, Access::ALL).unwrap();
    let b = ctx.alloc_region(64, Access::ALL).unwrap();
    assert_ne!(a.rkey(), b.rkey());
    assert_ne!(b.rkey().wrapping_sub(a.rkey()), 1, "keys are not sequential");
    assert!(matches!(a.read(60, &mut [0; 8]), Err(Error::OutOfRange { .. })));
    let mut mine = vec![0u8; 64];
    let theirs = unsafe { ctx.register_host(mine.as_mut_ptr(), mine.len(), Access::ALL) }.unwrap();
    assert!(matches!(theirs.read(0, &mut [0; 8]), Err(Error::CallerMemory { .. })));
    drop(theirs);
}

#[test]
fn cq_overrun_is_an_error_not_an_overwrite() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let cq = ctx.create_cq(4).unwrap();
    let qp = ctx
        .create_qp(
            &cq,
            QpConfig {
                sq_size: 4,
                ..Default::default()
            },
        )
        .unwrap();
    qp.connect(&qp.endpoint()).unwrap();
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    // Ring 8 NOPs by hand without ever consuming a CQE: slots 0..4, then 4..8 (the device API
    // would wait for completions before reusing a slot; this poster does not).
    for round in 0..2u64 {
        for i in 0..4 {
            dev.wqe_prepare_nop(round * 4 + i, 0);
        }
        dev.ring((round + 1) * 4);
        thread::sleep(Duration::from_millis(50));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while cq.status().is_ok() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
    assert!(matches!(cq.status(), Err(Error::CqOverrun { .. })));
    assert_eq!(cq.written().unwrap(), 4, "no CQE was overwritten");
    assert_eq!(qp.state(), QpState::Error);
}

#[test]
fn a_vanished_peer_gives_a_transport_error_in_bounded_time() {
    let a = Context::open(Provider::Soft).unwrap();
    let qa = qp(&a, 8, QpConfig::default());
    let mr = a.alloc_region(4096, Access::ALL).unwrap();
    let remote = {
        let b = Context::open(Provider::Soft).unwrap();
        let qb = qp(&b, 8, QpConfig::default());
        qa.connect(&qb.endpoint()).unwrap();
        let rb = b.alloc_region(4096, Access::ALL).unwrap();
        rb.remote(0)
    }; // b and everything of it are gone
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    let started = Instant::now();
    let t = dev.put(remote, mr.local(0), 8).unwrap();
    assert_eq!(cqe_error(dev.wait(t)), Syndrome::TransportRetryExc);
    assert!(started.elapsed() < Duration::from_secs(5));
    // Connecting to a vanished peer is refused up front (at RTR2RTS, where the soft HCA
    // connects), and the QP stays in RTR.
    let qc = qp(&a, 8, QpConfig::default());
    let gone = gdaki::Endpoint {
        qpn: 1,
        ..qc.endpoint()
    };
    let gone = gdaki::Endpoint {
        gid: [
            0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        ],
        addr: None,
        ..gone
    };
    match qc.connect(&gone) {
        Err(e @ Error::Device { .. }) => assert!(e.to_string().contains("not in this process"), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(qc.state(), QpState::Rtr);
}

/// The engine's idle spin is an option: with none it yields and then sleeps as soon as it has
/// nothing to do, and with a long one it never sleeps in a test; either way every doorbell is
/// served, also one that comes after the engine has gone to sleep.
#[test]
fn an_engine_serves_doorbells_whatever_its_idle_spin() {
    for spin in [Duration::ZERO, Duration::from_micros(200), Duration::from_secs(60)] {
        let options = gdaki::ContextOptions::default().engine_idle_spin(spin);
        assert_eq!(options.chosen_engine_idle_spin(), Some(spin));
        let ctx = Context::open_with(Provider::Soft, options).unwrap();
        let qp = loopback_qp(&ctx, 8, QpConfig::default());
        let local = ctx.alloc_region(4096, Access::ALL).unwrap();
        let target = ctx.alloc_region(4096, Access::ALL).unwrap();
        local.write(0, &pattern(7, 4096)).unwrap();
        let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
        for round in 0..4u64 {
            // Past the spin and the 2 ms of yielding where there is one: asleep.
            thread::sleep(Duration::from_millis(5));
            let at = round * 1024;
            dev.wait(dev.put(target.remote(at), local.local(at), 1024).unwrap())
                .unwrap_or_else(|e| panic!("spin {spin:?}, round {round}: {e:?}"));
        }
        let mut got = vec![0; 4096];
        target.read(0, &mut got).unwrap();
        assert_eq!(got, pattern(7, 4096), "spin {spin:?}");
    }
    assert_eq!(
        gdaki::ContextOptions::default().chosen_engine_idle_spin(),
        None,
        "unset: the engine's default (200 us, checked beside it)"
    );
}

#[test]
fn a_deregistered_key_stops_working_at_once() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 8, QpConfig::default());
    let local = ctx.alloc_region(4096, Access::ALL).unwrap();
    let target = ctx.alloc_region(4096, Access::ALL).unwrap();
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    // Warm the engine's key cache with the target, then drop the target.
    dev.wait(dev.put(target.remote(0), local.local(0), 8).unwrap()).unwrap();
    let gone = target.remote(0);
    drop(target);
    let t = dev.put(gone, local.local(0), 8).unwrap();
    assert_eq!(cqe_error(dev.wait(t)), Syndrome::RemoteAccess);
}

/// A request that breaks the responder's rules moves the responder's QP to error too, as RC
/// does, in process as over TCP (tests/tcp.rs): a bad rkey is not a free guess on a live QP.
#[test]
fn an_access_violation_moves_the_responder_qp_to_error() {
    let (a, b) = (
        Context::open(Provider::Soft).unwrap(),
        Context::open(Provider::Soft).unwrap(),
    );
    let (qa, qb) = (qp(&a, 8, QpConfig::default()), qp(&b, 8, QpConfig::default()));
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    let la = a.alloc_region(64, Access::ALL).unwrap();
    let rb = b.alloc_region(64, Access::ALL).unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    let guess = gdaki_device::Remote {
        rkey: rb.rkey() ^ 0x100,
        ..rb.remote(0)
    };
    assert_eq!(
        cqe_error(dev.wait(dev.put(guess, la.local(0), 8).unwrap())),
        Syndrome::RemoteAccess
    );
    assert_eq!(qb.state(), QpState::Error);
}

/// Keys are scoped to protection domains, as on RC: a queue pair of one domain can use
/// neither a local key nor a peer's remote key of another domain of the same device, and the
/// responder that was asked goes to error; within one domain everything works.
#[test]
fn keys_of_another_protection_domain_are_refused() {
    let a = Context::open(Provider::Soft).unwrap();
    let other = a.alloc_pd().unwrap();
    let ours = a.alloc_region(64, Access::ALL).unwrap();
    let theirs = other.alloc_region(64, Access::ALL).unwrap();
    theirs.write(0, b"tenant 2").unwrap();
    // A WQE naming a region of another domain as its source.
    let q = loopback_qp(&a, 8, QpConfig::default());
    let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
    let t = dev.put(ours.remote(0), theirs.local(0), 8).unwrap();
    assert_eq!(cqe_error(dev.wait(t)), Syndrome::LocalProt);
    // A peer's request naming one: the target QP (in `a`'s domain) refuses it and goes to
    // error; the bytes are untouched.
    let b = Context::open(Provider::Soft).unwrap();
    let (qa, qb) = (qp(&a, 8, QpConfig::default()), qp(&b, 8, QpConfig::default()));
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    let lb = b.alloc_region(64, Access::ALL).unwrap();
    let dev = unsafe { qb.cpu::<Exclusive>() }.unwrap();
    let t = dev.put(theirs.remote(0), lb.local(0), 8).unwrap();
    assert_eq!(cqe_error(dev.wait(t)), Syndrome::RemoteAccess);
    assert_eq!(qa.state(), QpState::Error);
    assert_eq!(theirs.read_vec(0, 8).unwrap(), b"tenant 2");
    // Within the other domain, its own QP uses its keys.
    let q = loopback_qp(&other, 8, QpConfig::default());
    let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
    dev.wait(dev.put(theirs.remote(8), theirs.local(0), 8).unwrap())
        .unwrap();
    assert_eq!(theirs.read_vec(8, 8).unwrap(), b"tenant 2");
}

/// Resident memory of this process, in bytes (Linux).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}

/// A large region is zeroed lazily, page by page as it is touched: allocating 2 GiB once
/// wrote 2 GiB of zeros at once (10 GiB took 18 s and 10 GB of RAM before a byte was used).
#[test]
fn a_large_region_is_zeroed_lazily() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let before = rss();
    let big = ctx.alloc_region(2 << 30, Access::ALL).unwrap();
    let grew = rss().saturating_sub(before);
    assert!(grew < 64 << 20, "allocating 2 GiB made {grew} bytes resident");
    // Zeroed all the same, and usable at both ends.
    assert_eq!(big.read_vec((2 << 30) - 8, 8).unwrap(), [0; 8]);
    big.write(0, b"first").unwrap();
    assert_eq!(big.read_vec(0, 5).unwrap(), b"first");
    // More than the address space can hold: an error, not an abort.
    assert!(ctx.alloc_region(usize::MAX - 4096, Access::ALL).is_err());
}

/// write_lat's ping-pong (perftest's `-I`) sends a message that fits its WQE inline: the HCA
/// never reads the post buffer, so a post buffer key the HCA would refuse goes unnoticed, and
/// the peer still gets the buffer's bytes with each round's flag. Without inline the same key
/// fails the first message (the test of the test: the key is really bad).
#[test]
fn ping_pong_messages_up_to_inline_max_travel_in_their_wqe() {
    use gdaki_layout::perf::PingPongSide;
    const SIZE: u64 = 24;
    const ITERS: u32 = 50;
    let ctx = Context::open(Provider::Soft).unwrap();
    let cfg = QpConfig {
        timeout: Duration::from_secs(5),
        retry_timeout: Duration::from_secs(4),
        ..QpConfig::default()
    };
    // Each side's outcome, and the initiator's QP error.
    let run = |inline_max: u32| -> (Vec<Result<(), PostError>>, Option<Syndrome>) {
        let (a, b) = (qp(&ctx, 64, cfg.clone()), qp(&ctx, 64, cfg.clone()));
        a.connect(&b.endpoint()).unwrap();
        b.connect(&a.endpoint()).unwrap();
        let region = || ctx.alloc_region(SIZE as usize, Access::ALL).unwrap();
        let (posts, polls) = ([region(), region()], [region(), region()]);
        for (k, p) in posts.iter().enumerate() {
            p.write(0, &pattern(k as u64, SIZE as usize)).unwrap();
        }
        let side = |k: usize| PingPongSide {
            qp: 0,
            post: posts[k].addr(),
            poll: polls[k].addr(),
            remote: polls[1 - k].remote(0).addr,
            // Not the post buffer's key: the HCA refuses a WQE that gathers with it.
            lkey: posts[k].lkey() ^ 0x5a00,
            rkey: polls[1 - k].remote(0).rkey,
            initiator: (k == 0) as u32,
            poll_lkey: polls[k].lkey(),
            times: 0,
            posted: 0,
            rq: 0,
            recv_len: SIZE,
            inline_max,
            flags: 0,
        };
        let results = thread::scope(|s| {
            let workers: Vec<_> = [&a, &b]
                .into_iter()
                .enumerate()
                .map(|(k, q)| {
                    let side = side(k);
                    s.spawn(move || {
                        // SAFETY: this thread is the QP's only poster; the side's buffers are
                        // live regions of SIZE bytes with a zeroed flag; no time stamps.
                        unsafe {
                            let dev = q.cpu::<Exclusive>().unwrap();
                            gdaki_device::perf::ping_pong(dev, &side, SIZE, ITERS)
                        }
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect::<Vec<_>>()
        });
        if results.iter().all(Result::is_ok) {
            for (k, poll) in polls.iter().enumerate() {
                // The peer's buffer, with the last round's flag.
                let mut want = pattern(1 - k as u64, SIZE as usize);
                want[SIZE as usize - 1] = ITERS as u8;
                assert_eq!(poll.read_vec(0, SIZE as usize).unwrap(), want, "side {k}");
            }
        }
        (results, a.error())
    };
    let (inline, error) = run(28);
    assert!(inline.iter().all(Result::is_ok), "{inline:?}, QP error {error:?}");
    // Without inline the first message fails at its gather (and the wait for its answer times out).
    let (without, error) = run(0);
    assert!(without.iter().all(Result::is_err), "{without:?}");
    assert_eq!(error, Some(Syndrome::LocalProt));
}

/// The doorbell register takes what rdma-core stores there (the last WQE's control segment's
/// first 8 bytes) and a BlueFlame write (the whole 64-byte WQE), not only gdaki's producer
/// index: the soft HCA then executes up to the end of that WQE, as a ConnectX does.
/// A WRITE gathered from two buffers (a message, then a short tail kept elsewhere: a socket
/// frame's trailer) lands as one contiguous range, each part whole, at every length.
#[test]
fn a_write_gathered_from_two_buffers_lands_contiguously() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 8, QpConfig::default());
    let src = ctx.alloc_region(8192, Access::ALL).unwrap();
    let tail = ctx.alloc_region(4096, Access::ALL).unwrap();
    let dst = ctx.alloc_region(16384, Access::ALL).unwrap();
    let (body, trailer) = (pattern(21, 8192), pattern(22, 4096));
    src.write(0, &body).unwrap();
    tail.write(0, &trailer).unwrap();
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    for (len, t, at) in [(1u32, 16u32, 0u64), (4096, 128, 64), (5000, 143, 7), (8192, 1, 3)] {
        dst.write(0, &[0u8; 16384]).unwrap();
        let i = dev.reserve(1).unwrap();
        dev.wqe_prepare_write_gather(i, dst.remote(at), (src.local(0), len), (tail.local(100), t), 0);
        dev.mark_ready(i, i + 1).unwrap();
        dev.submit(i + 1).unwrap();
        dev.wait(i).unwrap();
        let got = dst.read_vec(0, 16384).unwrap();
        let (at, len, t) = (at as usize, len as usize, t as usize);
        assert!(got[at..at + len] == body[..len], "{len} + {t}: the message");
        assert!(
            got[at + len..at + len + t] == trailer[100..100 + t],
            "{len} + {t}: the tail"
        );
        assert!(
            got[..at].iter().chain(&got[at + len + t..]).all(|&b| b == 0),
            "{len} + {t}: bytes outside"
        );
    }
}

#[test]
fn a_control_segment_written_to_the_doorbell_rings_it() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 8, QpConfig::default());
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    mr.write(0, &pattern(3, 512)).unwrap();
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
    // SAFETY: the live QP's exported handle.
    let h = unsafe { qp.device_handle().read() };
    for (k, whole) in [(0u64, false), (1, true), (2, false)] {
        let i = dev.reserve(1).unwrap();
        dev.wqe_prepare_write(i, mr.remote(1024 + k * 64), mr.local(k * 64), 64, 0);
        dev.mark_ready(i, i + 1).unwrap();
        let wqe = dev.wqe_ptr(i) as *const u64;
        // SAFETY: the WQE's 64 bytes in the send queue, and the doorbell register of the QP's
        // UAR page (64 bytes: a BlueFlame write's size); the first word, which the HCA watches,
        // goes last, as a BlueFlame burst lands whole.
        unsafe {
            let db = h.doorbell as *mut u64;
            if whole {
                for w in (1..8).rev() {
                    db.add(w).write_volatile(wqe.add(w).read_volatile());
                }
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            db.write_volatile(wqe.read_volatile());
        }
        dev.note_rung(i + 1);
        dev.wait(i).unwrap();
        let k = k as usize;
        assert_eq!(
            mr.read_vec(1024 + 64 * k as u64, 64).unwrap(),
            pattern(3, 512)[64 * k..64 * k + 64],
            "WRITE {k} (BlueFlame: {whole})"
        );
    }
    assert_eq!(qp.error(), None);
}

/// A poster's BlueFlame writes (`Qp::blueflame`: the lone WQE's 64 bytes into the doorbell
/// register) ring the soft HCA as a doorbell does: puts, inline puts and reads land, and a
/// deferred batch rung with the plain doorbell between them too.
#[test]
fn blueflame_writes_from_a_poster_ring_the_soft_hca() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 8, QpConfig::default());
    let mr = ctx.alloc_region(1 << 16, Access::ALL).unwrap();
    mr.write(0, &pattern(5, 4096)).unwrap();
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap().blueflame();
    for i in 0..50u64 {
        let t = match i % 3 {
            0 => dev.put(mr.remote(8192 + i * 64), mr.local(i * 64), 64),
            1 => dev.put_inline(mr.remote(8192 + i * 64), &pattern(5, 4096)[i as usize * 64..][..28]),
            _ => dev.get(mr.local(16384 + i * 64), mr.remote(i * 64), 64),
        }
        .unwrap();
        dev.wait(t).unwrap();
    }
    let batch = dev.deferred();
    let mut last = 0;
    for i in 50..60u64 {
        last = batch.put(mr.remote(8192 + i * 64), mr.local(i * 64), 64).unwrap();
    }
    batch.commit().unwrap();
    dev.wait(last).unwrap();
    let src = pattern(5, 4096);
    for i in 0..60usize {
        let (at, len) = match i % 3 {
            _ if i >= 50 => (8192 + i * 64, 64),
            0 => (8192 + i * 64, 64),
            1 => (8192 + i * 64, 28),
            _ => (16384 + i * 64, 64),
        };
        assert_eq!(
            mr.read_vec(at as u64, len).unwrap(),
            src[i * 64..][..len],
            "operation {i}"
        );
    }
    assert_eq!(qp.error(), None);
}
