//! The soft HCA's transport between processes and the handshake: every operation between two
//! HCAs over loopback TCP and over the same-host shared-memory carrier (in one process,
//! endpoints stripped of their in-process identity, and across two processes), faults with
//! their syndromes, a peer process killed mid-run, and the handshake's refusals.
//!
//! Tests named `name::tcp` and `name::shm` run one body over each carrier, and check that the
//! connection took the carrier asked for.
//!
//! The two-process tests run this test binary a second time as the peer (`peer_process`,
//! which does nothing unless `GDAKI_TCP_PEER` is set).
mod common;
use common::{pattern, qp, PeerProcess, ReadVec};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use gdaki::handshake::{Channel, Hello};
use gdaki::{Access, Context, ContextOptions, Endpoint, Error, MemoryRegion, Provider, QpConfig, QpState, QueuePair};
use gdaki_device::{Exclusive, Gpu, WaitError};
use gdaki_layout::Syndrome;

const LOOPBACK: &str = "127.0.0.1:0";
const APP: &[u8] = b"gdaki tcp test v1";

fn cqe_error(r: Result<(), WaitError>) -> Syndrome {
    match r {
        Err(WaitError::Cqe(e)) => e.syndrome,
        other => panic!("expected an error CQE, got {other:?}"),
    }
}

/// What carries a same-host transport connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Carrier {
    Tcp,
    Shm,
}

/// Runs the transport test `name(Carrier)` over each carrier, as `name::tcp` and `name::shm`.
macro_rules! over_each_carrier {
    ($name:ident) => {
        mod $name {
            #[test]
            fn tcp() {
                super::$name(super::Carrier::Tcp)
            }
            #[test]
            fn shm() {
                super::$name(super::Carrier::Shm)
            }
        }
    };
}

/// A listening soft context whose same-host connections take `carrier`.
fn listening_over(carrier: Carrier) -> Context {
    let options = ContextOptions::default().same_host_shared_memory(carrier == Carrier::Shm);
    let ctx = Context::open_with(Provider::Soft, options).unwrap();
    ctx.listen(LOOPBACK.parse().unwrap()).unwrap();
    ctx
}

fn listening_context() -> Context {
    listening_over(Carrier::Tcp)
}

/// Mappings in this process of the shared-memory segments of `e`'s QP's connection (its
/// name carries the HCA and QP: see the soft HCA's `shm` module). In a one-process test both
/// sides map it: 2 while connected over shared memory, 0 over TCP or once closed.
fn shm_maps(e: &Endpoint) -> usize {
    let guid = u64::from_be_bytes(e.gid[8..].try_into().unwrap());
    let tag = format!("/gdaki-{guid:016x}-{:06x}-", e.qpn);
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&tag))
        .count()
}

/// Connects `qa` and `qb` (of two contexts of this process) over the transport, and checks
/// that their connections took `carrier`.
fn connect_over(qa: &QueuePair, qb: &QueuePair, carrier: Carrier) {
    qa.connect(&over_tcp(qb.endpoint())).unwrap();
    qb.connect(&over_tcp(qa.endpoint())).unwrap();
    let want = if carrier == Carrier::Shm { 2 } else { 0 };
    for e in [qa.endpoint(), qb.endpoint()] {
        assert_eq!(shm_maps(&e), want, "QP {:#x} is not connected over {carrier:?}", e.qpn);
    }
}

/// The endpoint as another process would see it: a GID no HCA of this process has, so the
/// connection goes over TCP.
fn over_tcp(e: Endpoint) -> Endpoint {
    assert!(e.addr.is_some(), "a listening context's endpoints carry its address");
    let mut gid = e.gid;
    gid[8..].iter_mut().for_each(|b| *b ^= 0xa5);
    Endpoint { gid, ..e }
}

/// Two listening contexts with a QP each, connected to each other over `carrier`.
fn pair_over(cfg: QpConfig, carrier: Carrier) -> (Context, QueuePair, Context, QueuePair) {
    let (a, b) = (listening_over(carrier), listening_over(carrier));
    let (qa, qb) = (qp(&a, 64, cfg.clone()), qp(&b, 64, cfg));
    connect_over(&qa, &qb, carrier);
    (a, qa, b, qb)
}

/// Two listening contexts with a QP each, connected to each other over TCP.
fn tcp_pair(cfg: QpConfig) -> (Context, QueuePair, Context, QueuePair) {
    pair_over(cfg, Carrier::Tcp)
}

over_each_carrier!(every_operation);
fn every_operation(carrier: Carrier) {
    let (a, qa, b, _qb) = pair_over(
        QpConfig {
            max_msg_size: 1 << 20,
            ..Default::default()
        },
        carrier,
    );
    let la = a.alloc_region(8 << 20, Access::ALL).unwrap();
    let rb = b.alloc_region(4 << 20, Access::ALL).unwrap();
    let data = pattern(1, 3 << 20);
    la.write(0, &data).unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    for len in [0usize, 1, 8, 4095, 4096, (1 << 20) + 3, 3 << 20] {
        dev.wait(dev.put(rb.remote(1 << 20), la.local(0), len as u64).unwrap())
            .unwrap();
        let mut got = vec![0; len];
        rb.read(1 << 20, &mut got).unwrap();
        assert!(got == data[..len], "WRITE of {len} bytes");
        dev.wait(dev.get(la.local(4 << 20), rb.remote(1 << 20), len as u64).unwrap())
            .unwrap();
        let mut back = vec![0; len];
        la.read(4 << 20, &mut back).unwrap();
        assert!(back == data[..len], "READ of {len} bytes");
    }
    dev.wait(dev.put_inline(rb.remote(64), b"inline over tcp").unwrap())
        .unwrap();
    let mut inline = [0u8; 15];
    rb.read(64, &mut inline).unwrap();
    assert_eq!(&inline, b"inline over tcp");
    dev.wait(dev.fenced().put(rb.remote(128), la.local(0), 16).unwrap())
        .unwrap();
    assert_eq!(dev.atomic_fetch_add(rb.remote(4096), 5, la.local(8192)).unwrap(), 0);
    assert_eq!(dev.atomic_fetch_add(rb.remote(4096), 7, la.local(8192)).unwrap(), 5);
    assert_eq!(
        dev.atomic_compare_swap(rb.remote(4096), 12, 99, la.local(8192))
            .unwrap(),
        12
    );
    assert_eq!(
        dev.atomic_compare_swap(rb.remote(4096), 12, 1, la.local(8192)).unwrap(),
        99
    );
    assert_eq!(rb.load_u64(4096).unwrap(), 99);
    dev.wait(
        dev.put_signal(rb.remote(10000), la.local(0), 64, rb.remote(4104), 1, la.local(8200))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(rb.load_u64(4104).unwrap(), 1);
    dev.quiet().unwrap();
    assert_eq!(qa.error(), None);
}

over_each_carrier!(many_qps_and_threads_pipeline);
fn many_qps_and_threads_pipeline(carrier: Carrier) {
    let (a, b) = (Arc::new(listening_over(carrier)), listening_over(carrier));
    const QPS: usize = 3;
    const PER_THREAD: usize = 1500;
    const THREADS: usize = 2;
    const MSG: usize = 256;
    let src = Arc::new(a.alloc_region(MSG * PER_THREAD * THREADS, Access::ALL).unwrap());
    let data = pattern(5, MSG * PER_THREAD * THREADS);
    src.write(0, &data).unwrap();
    let dst: Vec<MemoryRegion> = (0..QPS)
        .map(|_| b.alloc_region(MSG * PER_THREAD * THREADS, Access::ALL).unwrap())
        .collect();
    let mut pairs = Vec::new();
    for _ in 0..QPS {
        let (qa, qb) = (qp(&a, 128, QpConfig::default()), qp(&b, 128, QpConfig::default()));
        connect_over(&qa, &qb, carrier);
        pairs.push((Arc::new(qa), qb));
    }
    thread::scope(|s| {
        for (i, (qa, _)) in pairs.iter().enumerate() {
            for t in 0..THREADS {
                let (qa, src, remote) = (qa.clone(), src.clone(), dst[i].remote(0));
                s.spawn(move || {
                    // Shared mode: both threads post to the same QP, which wraps its ring
                    // many times over.
                    let dev = unsafe { qa.cpu::<Gpu>() }.unwrap();
                    for k in 0..PER_THREAD {
                        let off = ((t * PER_THREAD + k) * MSG) as u64;
                        let r = gdaki_device::Remote {
                            addr: remote.addr + off,
                            rkey: remote.rkey,
                        };
                        dev.put(r, src.local(off), MSG as u64).unwrap();
                    }
                    dev.quiet().unwrap();
                });
            }
        }
    });
    for (i, d) in dst.iter().enumerate() {
        let mut got = vec![0; data.len()];
        d.read(0, &mut got).unwrap();
        assert!(got == data, "QP {i}: data differs");
        assert_eq!(pairs[i].0.error(), None);
    }
}

over_each_carrier!(remote_faults_nak_and_flush_what_follows);
fn remote_faults_nak_and_flush_what_follows(carrier: Carrier) {
    let (a, qa, b, qb) = pair_over(QpConfig::default(), carrier);
    let la = a.alloc_region(1 << 16, Access::ALL).unwrap();
    let rb = b
        .alloc_region(1 << 16, Access::REMOTE_READ | Access::LOCAL_WRITE)
        .unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    // A good READ, a WRITE without the remote-write right, then a WRITE after it.
    let ok = dev.get(la.local(0), rb.remote(0), 64).unwrap();
    let bad = dev.put(rb.remote(0), la.local(0), 64).unwrap();
    let after = dev.put_inline(rb.remote(0), b"x").unwrap();
    dev.wait(ok).unwrap();
    assert_eq!(cqe_error(dev.wait(bad)), Syndrome::RemoteAccess);
    assert_eq!(cqe_error(dev.wait(after)), Syndrome::WrFlush);
    assert_eq!(rb.read_vec(0, 1).unwrap(), [0], "nothing after the NAK executed");
    assert_eq!(qa.state(), QpState::Error);
    assert_eq!(qa.error(), Some(Syndrome::RemoteAccess));
    // As RC does, the responder's QP goes to error too (no CQE there: nothing was posted on
    // it): no probing keys on a live QP.
    assert_eq!(qb.state(), QpState::Error);
    // A misaligned atomic on a fresh pair.
    let (a2, qa2, b2, qb2) = pair_over(QpConfig::default(), carrier);
    let (l2, r2) = (
        a2.alloc_region(4096, Access::ALL).unwrap(),
        b2.alloc_region(4096, Access::ALL).unwrap(),
    );
    let dev2 = unsafe { qa2.cpu::<Exclusive>() }.unwrap();
    // The device refuses it; a WQE written by hand reaches the responder, which NAKs it.
    let op = gdaki_device::AtomicOp::FetchAdd(1);
    assert!(matches!(
        dev2.atomic(op, r2.remote(4), l2.local(0)),
        Err(gdaki_device::PostError::Misaligned { .. })
    ));
    let t = dev2.reserve(1).unwrap();
    dev2.wqe_prepare_atomic(t, op, r2.remote(4), l2.local(0), 0);
    dev2.mark_ready(t, t + 1).unwrap();
    dev2.submit(t + 1).unwrap();
    assert_eq!(cqe_error(dev2.wait(t)), Syndrome::RemoteInvalReq);
    assert_eq!(qb2.state(), QpState::Error);
}

over_each_carrier!(a_local_error_behind_requests_in_flight_completes_in_order);
fn a_local_error_behind_requests_in_flight_completes_in_order(carrier: Carrier) {
    let (a, qa, b, _qb) = pair_over(QpConfig::default(), carrier);
    let la = a.alloc_region(4 << 20, Access::ALL).unwrap();
    let rb = b.alloc_region(4 << 20, Access::ALL).unwrap();
    la.write(0, &pattern(3, 4 << 20)).unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    let big = dev.put(rb.remote(0), la.local(0), 4 << 20).unwrap();
    let bad_lkey = gdaki_device::Local {
        addr: la.addr(),
        lkey: la.rkey() ^ 1,
    };
    let bad = dev.put(rb.remote(0), bad_lkey, 8).unwrap();
    let after = dev.put(rb.remote(0), la.local(0), 8).unwrap();
    dev.wait(big).unwrap();
    assert_eq!(cqe_error(dev.wait(bad)), Syndrome::LocalProt);
    assert_eq!(cqe_error(dev.wait(after)), Syndrome::WrFlush);
    assert_eq!(rb.read_vec(0, 4 << 20).unwrap(), pattern(3, 4 << 20));
}

over_each_carrier!(a_target_qp_in_error_or_gone_gives_transport_errors);
fn a_target_qp_in_error_or_gone_gives_transport_errors(carrier: Carrier) {
    let cfg = QpConfig {
        retry_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let (a, qa, b, qb) = pair_over(cfg.clone(), carrier);
    let la = a.alloc_region(4096, Access::ALL).unwrap();
    let rb = b.alloc_region(4096, Access::ALL).unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    dev.wait(dev.put(rb.remote(0), la.local(0), 8).unwrap()).unwrap();
    qb.to_error().unwrap();
    let t = dev.put(rb.remote(0), la.local(0), 8).unwrap();
    assert_eq!(cqe_error(dev.wait(t)), Syndrome::TransportRetryExc);
    // The whole peer context goes away: its connections close.
    let (a2, qa2, b2, qb2) = pair_over(cfg, carrier);
    let (l2, r2) = (
        a2.alloc_region(4096, Access::ALL).unwrap(),
        b2.alloc_region(4096, Access::ALL).unwrap(),
    );
    let remote = r2.remote(0);
    let dev2 = unsafe { qa2.cpu::<Exclusive>() }.unwrap();
    dev2.wait(dev2.put(remote, l2.local(0), 8).unwrap()).unwrap();
    drop((qb2, r2, b2));
    let started = Instant::now();
    let t = dev2.put(remote, l2.local(0), 8).unwrap();
    assert_eq!(cqe_error(dev2.wait(t)), Syndrome::TransportRetryExc);
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[test]
fn a_peer_that_accepts_and_then_goes_silent_times_out() {
    // A "responder" that accepts the connection, then never answers (a host that vanished
    // without closing anything).
    let (addr, silent) = common::silent_peer();
    let a = listening_context();
    let la = a.alloc_region(4096, Access::ALL).unwrap();
    let retry = Duration::from_millis(300);
    let q = qp(
        &a,
        8,
        QpConfig {
            retry_timeout: retry,
            ..Default::default()
        },
    );
    q.connect(&Endpoint {
        gid: [0; 16],
        lid: 0,
        qpn: 0x42,
        psn: 0,
        mtu: 4096,
        secret: 0x5ec,
        rd_atomic: 0,
        addr: Some(addr),
    })
    .unwrap();
    let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
    let started = Instant::now();
    let first = dev.put(la.remote(0), la.local(0), 8).unwrap();
    let second = dev.get(la.local(8), la.remote(0), 8).unwrap();
    assert_eq!(cqe_error(dev.wait(first)), Syndrome::TransportRetryExc);
    assert_eq!(cqe_error(dev.wait(second)), Syndrome::WrFlush);
    let took = started.elapsed();
    assert!(took >= retry && took < retry * 5, "{took:?}");
    drop(q);
    silent.join().unwrap();
}

#[test]
fn connecting_to_nothing_is_refused_at_once() {
    let a = listening_context();
    // A listener that is not a gdaki HCA's QP: an unknown QPN on a real HCA.
    let b = listening_context();
    let qb = qp(&b, 8, QpConfig::default());
    let wrong = Endpoint {
        qpn: qb.qpn() ^ 0x40_0000,
        ..over_tcp(qb.endpoint())
    };
    // The soft HCA connects its transport at RTR2RTS, when the send PSN is known.
    let started = Instant::now();
    let q = qp(&a, 8, QpConfig::default());
    q.to_init().unwrap();
    q.to_rtr(&wrong).unwrap();
    match q.to_rts() {
        // No answer at all (a responder is no oracle over its QPNs), at once.
        Err(e @ Error::Device { .. }) => assert!(e.to_string().contains("without an answer"), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(q.state(), QpState::Rtr, "a refused RTR2RTS leaves the QP in RTR");
    // Nobody listening.
    let port = TcpListener::bind(LOOPBACK).unwrap().local_addr().unwrap();
    let nobody = Endpoint {
        addr: Some(port),
        ..wrong
    };
    let q = qp(&a, 8, QpConfig::default());
    let err = q.connect(&nobody).unwrap_err();
    assert!(matches!(err, Error::Device { .. }), "{err}");
    assert_eq!(q.state(), QpState::Rtr);
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
}

#[test]
fn handshake_exchanges_validates_and_refuses() {
    let listener = TcpListener::bind(LOOPBACK).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let mut ch = Channel::accept(&listener, Duration::from_secs(5)).unwrap();
        let theirs = ch.receive().unwrap();
        assert_eq!(theirs.app, APP);
        ch.send(&Hello {
            app: APP.to_vec(),
            endpoints: theirs.endpoints.clone(),
            regions: vec![],
        })
        .unwrap();
        ch.sync(1).unwrap();
        // Second client: wrong parameters.
        let mut ch = Channel::accept(&listener, Duration::from_secs(5)).unwrap();
        let theirs = ch.receive().unwrap();
        assert_ne!(theirs.app, APP);
        ch.reject("test parameters differ: size=8 here").unwrap();
    });
    let ep = Endpoint {
        gid: [7; 16],
        lid: 0,
        qpn: 0x1234,
        psn: 99,
        mtu: 1024,
        secret: 0x5ec2e7,
        rd_atomic: 0,
        addr: Some("0.0.0.0:4791".parse().unwrap()),
    };
    let mut ch = Channel::connect(addr, Duration::from_secs(5)).unwrap();
    ch.send(&Hello {
        app: APP.to_vec(),
        endpoints: vec![ep],
        regions: vec![],
    })
    .unwrap();
    let back = ch.receive().unwrap();
    // The unspecified IP came back filled in with the address the peer is reached at.
    assert_eq!(
        back.endpoints[0],
        Endpoint {
            addr: Some("127.0.0.1:4791".parse().unwrap()),
            ..ep
        }
    );
    ch.sync(1).unwrap();
    let mut ch = Channel::connect(addr, Duration::from_secs(5)).unwrap();
    ch.send(&Hello {
        app: b"other".to_vec(),
        ..Default::default()
    })
    .unwrap();
    match ch.receive() {
        Err(Error::Rejected { reason, .. }) => assert!(reason.contains("size=8"), "{reason}"),
        other => panic!("expected a rejection, got {other:?}"),
    }
    server.join().unwrap();
    // A port nobody listens on.
    let closed: SocketAddr = TcpListener::bind(LOOPBACK).unwrap().local_addr().unwrap();
    assert!(matches!(
        Channel::connect(closed, Duration::from_secs(2)),
        Err(Error::PeerUnreachable { .. })
    ));
}

#[test]
fn a_handshake_peer_speaking_garbage_gets_an_error() {
    let listener = TcpListener::bind(LOOPBACK).unwrap();
    let addr = listener.local_addr().unwrap();
    let garbage = thread::spawn(move || {
        use std::io::Write;
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").unwrap();
        thread::sleep(Duration::from_millis(200));
    });
    let mut ch = Channel::connect(addr, Duration::from_secs(2)).unwrap();
    assert!(matches!(ch.receive(), Err(Error::Protocol { .. })));
    garbage.join().unwrap();
}

// ------------------------------------------------------------------------------ two processes

/// Region layout of the peer process: its first 64 KiB hold `pattern(42)`; the test writes
/// `pattern(7)` at 64 KiB; word at 256 KiB is an atomic counter.
const PEER_REGION: usize = 1 << 20;
/// The echo peer: receives it keeps posted (4 KiB each, at the start of its region), and
/// messages the test sends.
const ECHO_DEPTH: u64 = 16;
const ECHO_MESSAGES: u64 = 100;

/// The peer process (runs only when spawned by the tests below).
#[test]
fn peer_process() {
    let Ok(mode) = std::env::var("GDAKI_TCP_PEER") else {
        return;
    };
    let carrier = match std::env::var("GDAKI_TCP_PEER_CARRIER").as_deref() {
        Ok("shm") => Carrier::Shm,
        _ => Carrier::Tcp,
    };
    let ctx = listening_over(carrier);
    let mr = ctx.alloc_region(PEER_REGION, Access::ALL).unwrap();
    mr.write(0, &pattern(42, 64 << 10)).unwrap();
    let echo = mode == "echo";
    let cfg = QpConfig {
        receive: echo.then_some(gdaki::ReceiveConfig {
            size: ECHO_DEPTH as u32,
            max_bufs: 1,
        }),
        ..Default::default()
    };
    let q = qp(&ctx, 64, cfg);
    let listener = TcpListener::bind(LOOPBACK).unwrap();
    println!("PORT {}", listener.local_addr().unwrap().port());
    let mut ch = Channel::accept(&listener, Duration::from_secs(20)).unwrap();
    let theirs = ch.receive().unwrap();
    if mode == "reject" || theirs.app != APP {
        ch.reject("parameters differ").unwrap();
        return;
    }
    ch.send(&Hello {
        app: APP.to_vec(),
        endpoints: vec![q.endpoint()],
        regions: vec![mr.remote_region()],
    })
    .unwrap();
    q.connect(&theirs.endpoints[0]).unwrap();
    if echo {
        // Receives first, then the go: every message the test sends comes back as a SEND
        // with immediate data (its index), its bytes unchanged.
        let (sq, rq) = unsafe { (q.cpu::<Exclusive>().unwrap(), q.cpu_receive::<Exclusive>().unwrap()) };
        let slot = |m: u64| mr.local((m % ECHO_DEPTH) * 4096);
        for m in 0..ECHO_DEPTH {
            rq.post_recv_one(slot(m), 4096).unwrap();
        }
        ch.sync(1).unwrap();
        for m in 0..ECHO_MESSAGES {
            let got = rq.poll(m).unwrap();
            sq.wait(sq.send_imm(slot(m), got.bytes as u64, m as u32).unwrap())
                .unwrap();
            rq.post_recv_one(slot(m + ECHO_DEPTH), 4096).unwrap();
        }
        ch.sync(2).unwrap();
        thread::sleep(Duration::from_secs(60));
        return;
    }
    ch.sync(1).unwrap();
    ch.sync(2).unwrap();
    // The test wrote pattern(7) at 64 KiB and added to the counter: check it here, where the
    // memory is.
    let ok = mr.read_vec(64 << 10, 64 << 10).unwrap() == pattern(7, 64 << 10) && mr.load_u64(256 << 10).unwrap() == 3;
    ch.sync(if ok { 3 } else { 999 }).unwrap();
    // Stay until killed.
    thread::sleep(Duration::from_secs(60));
}

fn spawn_peer(mode: &str, carrier: Carrier) -> PeerProcess {
    let carrier = if carrier == Carrier::Shm { "shm" } else { "tcp" };
    PeerProcess::spawn(&[("GDAKI_TCP_PEER", mode), ("GDAKI_TCP_PEER_CARRIER", carrier)])
}

over_each_carrier!(two_processes_then_the_peer_is_killed);
fn two_processes_then_the_peer_is_killed(carrier: Carrier) {
    let mut peer = spawn_peer("serve", carrier);
    let ctx = listening_over(carrier);
    let mr = ctx.alloc_region(PEER_REGION, Access::ALL).unwrap();
    mr.write(0, &pattern(7, 64 << 10)).unwrap();
    let q = qp(
        &ctx,
        64,
        QpConfig {
            retry_timeout: Duration::from_secs(1),
            ..Default::default()
        },
    );
    let (mut ch, theirs) = peer.hello(APP, &q);
    assert_ne!(
        theirs.endpoints[0].gid,
        q.endpoint().gid,
        "another process, another HCA"
    );
    q.connect(&theirs.endpoints[0]).unwrap();
    ch.sync(1).unwrap();
    // This side's mapping of its own connection's segment (the peer maps it too, over there).
    let want = if carrier == Carrier::Shm { 1 } else { 0 };
    assert_eq!(shm_maps(&q.endpoint()), want, "not connected over {carrier:?}");
    let region = theirs.regions[0];
    let at = |off: u64| region.at(off).unwrap();
    let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
    // READ what the peer wrote into its memory.
    dev.wait(dev.get(mr.local(128 << 10), at(0), 64 << 10).unwrap())
        .unwrap();
    assert_eq!(mr.read_vec(128 << 10, 64 << 10).unwrap(), pattern(42, 64 << 10));
    // WRITE (in pieces), each counted by a cross-channel companion of this context once the
    // peer has acknowledged it (a WAIT on this QP's CQ, then an add to a local word).
    let companion = qp(
        &ctx,
        64,
        QpConfig {
            cross_channel: true,
            ..Default::default()
        },
    );
    companion.connect(&companion.endpoint()).unwrap();
    let counts = unsafe { companion.cpu::<Exclusive>() }.unwrap();
    for k in 0..16u64 {
        let t = dev.put(at((64 << 10) + k * 4096), mr.local(k * 4096), 4096).unwrap();
        counts
            .count_when_done(&dev, t, mr.remote(600 << 10), 1, mr.local(608 << 10))
            .unwrap();
    }
    assert_eq!(dev.atomic_fetch_add(at(256 << 10), 2, mr.local(512 << 10)).unwrap(), 0);
    dev.wait(
        dev.put_signal(at(300 << 10), mr.local(0), 8, at(256 << 10), 1, mr.local(512 << 10))
            .unwrap(),
    )
    .unwrap();
    dev.quiet().unwrap();
    counts.quiet().unwrap();
    assert_eq!(mr.load_u64(600 << 10).unwrap(), 16, "every put counted");
    ch.sync(2).unwrap();
    ch.sync(3).expect("the peer found the data it was sent");
    // Kill the peer: the next operations end in transport errors, within the retry timeout.
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    let started = Instant::now();
    let t = dev.put(at(0), mr.local(0), 8).unwrap();
    assert_eq!(cqe_error(dev.wait(t)), Syndrome::TransportRetryExc);
    let t = dev.get(mr.local(0), at(0), 8).unwrap();
    assert_eq!(cqe_error(dev.wait(t)), Syndrome::WrFlush);
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    assert_eq!(q.state(), QpState::Error);
    // The handshake channel is dead too.
    assert!(ch.sync(4).is_err());
}

over_each_carrier!(two_processes_echo_sends);
/// Two-sided verbs between two processes: 100 SENDs of every size up to 4 KiB to a peer
/// process that echoes each as a SEND with immediate data (the message's index); every byte
/// and every immediate comes back, over TCP and over shared memory. The test sends without
/// waiting for its receives, so some SENDs find the peer's queue empty and are tried again.
fn two_processes_echo_sends(carrier: Carrier) {
    let peer = spawn_peer("echo", carrier);
    let ctx = listening_over(carrier);
    let mr = ctx.alloc_region(PEER_REGION, Access::ALL).unwrap();
    let data = pattern(9, 4096);
    mr.write(0, &data).unwrap();
    let cfg = QpConfig {
        receive: Some(gdaki::ReceiveConfig { size: 128, max_bufs: 1 }),
        min_rnr_timer: 1,
        ..Default::default()
    };
    let q = qp(&ctx, 128, cfg);
    let (mut ch, theirs) = peer.hello(APP, &q);
    q.connect(&theirs.endpoints[0]).unwrap();
    let (sq, rq) = unsafe { (q.cpu::<Exclusive>().unwrap(), q.cpu_receive::<Exclusive>().unwrap()) };
    let len = |m: u64| 1 + (m * 41) % 4096;
    for m in 0..ECHO_MESSAGES {
        rq.post_recv_one(mr.local(8192 + m * 4096), 4096).unwrap();
    }
    ch.sync(1).unwrap();
    let mut last = 0;
    for m in 0..ECHO_MESSAGES {
        last = sq.send(mr.local(0), len(m)).unwrap();
    }
    sq.wait(last).unwrap();
    for m in 0..ECHO_MESSAGES {
        let got = rq.poll(m).unwrap();
        assert_eq!(
            (got.bytes as u64, got.kind),
            (len(m), gdaki_device::RecvKind::SendImm(m as u32)),
            "echo {m}"
        );
        assert_eq!(
            mr.read_vec(8192 + m * 4096, len(m) as usize).unwrap(),
            data[..len(m) as usize]
        );
    }
    ch.sync(2).expect("the peer echoed every message");
    assert_eq!(q.error(), None);
}

#[test]
fn two_processes_with_different_parameters_are_refused() {
    let peer = spawn_peer("reject", Carrier::Tcp);
    let mut ch = Channel::connect(SocketAddr::from(([127, 0, 0, 1], peer.port)), Duration::from_secs(20)).unwrap();
    ch.send(&Hello {
        app: APP.to_vec(),
        ..Default::default()
    })
    .unwrap();
    assert!(matches!(ch.receive(), Err(Error::Rejected { reason, .. }) if reason == "parameters differ"));
}

/// The fence modes as a ConnectX honours them, where a READ's answer takes a round trip: a WRITE
/// that sends what an earlier READ fetched must carry the data read, not what was in the buffer
/// before, under FENCE (0x40, the kernel's and NVSHMEM's), STRONG_ORDERING (0x60) and FENCE with
/// INITIATOR_SMALL (0x80, rdma-core's `IBV_SEND_FENCE`). A reserved mode is a malformed WQE.
#[test]
fn fence_modes_hold_a_wqe_until_earlier_reads_complete() {
    use gdaki_layout::ctrl;
    let (a, qa, b, _qb) = tcp_pair(QpConfig::default());
    let len = 64u32 << 10;
    let la = a.alloc_region(1 << 20, Access::ALL).unwrap();
    let rb = b.alloc_region(1 << 20, Access::ALL).unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    let modes = [
        ctrl::FM_FENCE,
        ctrl::FM_STRONG_ORDERING,
        ctrl::FM_FENCE_AND_INITIATOR_SMALL_FENCE,
    ];
    for (round, fm) in modes.into_iter().enumerate() {
        let fresh = pattern(round as u64 + 10, len as usize);
        rb.write(0, &fresh).unwrap();
        la.write(0, &vec![0xee; len as usize]).unwrap();
        // READ rb[0..] into la[0..], then (fenced) WRITE la[0..] to rb[512 KiB..], one doorbell.
        let i = dev.reserve(2).unwrap();
        dev.wqe_prepare_read(i, la.local(0), rb.remote(0), len, 0);
        dev.wqe_prepare_write(i + 1, rb.remote(512 << 10), la.local(0), len, fm);
        dev.mark_ready(i, i + 2).unwrap();
        dev.submit(i + 2).unwrap();
        dev.wait(i + 1).unwrap();
        assert!(
            rb.read_vec(512 << 10, len as usize).unwrap() == fresh,
            "fence mode {fm:#04x}: the WRITE did not wait for the READ before it"
        );
    }
    // Modes 5..7 are reserved by the PRM.
    let i = dev.reserve(1).unwrap();
    dev.wqe_prepare_write(i, rb.remote(0), la.local(0), 8, 0xa0);
    dev.mark_ready(i, i + 1).unwrap();
    dev.submit(i + 1).unwrap();
    assert_eq!(cqe_error(dev.wait(i)), Syndrome::LocalQpOp);
}

/// `Qp::fenced` puts the FENCE on the first WQE of a put, so a put may send what a get just
/// fetched, over TCP.
#[test]
fn a_fenced_put_sends_what_a_get_fetched() {
    let (a, qa, b, _qb) = tcp_pair(QpConfig::default());
    let la = a.alloc_region(1 << 20, Access::ALL).unwrap();
    let rb = b.alloc_region(1 << 20, Access::ALL).unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    for round in 0..4u64 {
        let fresh = pattern(round + 20, 32 << 10);
        rb.write(0, &fresh).unwrap();
        la.write(0, &[0x11; 32 << 10]).unwrap();
        dev.get(la.local(0), rb.remote(0), 32 << 10).unwrap();
        let t = dev.fenced().put(rb.remote(256 << 10), la.local(0), 32 << 10).unwrap();
        dev.wait(t).unwrap();
        assert!(rb.read_vec(256 << 10, 32 << 10).unwrap() == fresh, "round {round}");
    }
}

/// 8-byte atomic results in both byte orders a ConnectX can be set to, in process and over
/// TCP: the soft HCA writes them as the mode says, the device code reads them back right.
#[test]
fn atomic_results_in_both_reply_orders() {
    use gdaki::ContextOptions;
    use gdaki_layout::AtomicReplyOrder;
    for order in [AtomicReplyOrder::BigEndian, AtomicReplyOrder::HostOrder] {
        let open = || {
            let ctx = Context::open_with(Provider::Soft, ContextOptions::default().atomic_reply_order(order)).unwrap();
            ctx.listen(LOOPBACK.parse().unwrap()).unwrap();
            ctx
        };
        let (a, b) = (open(), open());
        let (qa, qb) = (qp(&a, 64, QpConfig::default()), qp(&b, 64, QpConfig::default()));
        qa.connect(&over_tcp(qb.endpoint())).unwrap();
        qb.connect(&over_tcp(qa.endpoint())).unwrap();
        let local = common::loopback_qp(&a, 64, QpConfig::default());
        let la = a.alloc_region(4096, Access::ALL).unwrap();
        let rb = b.alloc_region(4096, Access::ALL).unwrap();
        for (how, q, target) in [("over TCP", &qa, &rb), ("in process", &local, &la)] {
            let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
            assert_eq!(dev.atomic_reply_order(), order);
            target.write(1024, &[0; 16]).unwrap();
            let big = 0x1122_3344_5566_7788u64;
            assert_eq!(dev.atomic_fetch_add(target.remote(1024), big, la.local(0)).unwrap(), 0);
            assert_eq!(dev.atomic_fetch_add(target.remote(1024), 1, la.local(8)).unwrap(), big);
            assert_eq!(
                la.read_vec(8, 8).unwrap(),
                order.encode(big),
                "{order:?} {how}: raw bytes"
            );
            assert_eq!(
                dev.atomic_compare_swap(target.remote(1024), big + 1, 5, la.local(16))
                    .unwrap(),
                big + 1,
                "{order:?} {how}"
            );
            assert_eq!(target.load_u64(1024).unwrap(), 5, "{order:?} {how}");
        }
    }
}

// ------------------------------------------------------------------------------ hostile peers

/// A raw transport connection to `target` claiming to be QP `qpn` (first PSN `psn`) and
/// presenting `secret` for `target_qpn`, followed by the shared-memory offer a real peer sends
/// next (none: stay on TCP). Reads give up after `wait`.
fn raw_connect(
    target: SocketAddr,
    target_qpn: u32,
    qpn: u32,
    psn: u32,
    secret: u64,
    wait: Duration,
) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(target).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    let connect = gdaki::wire::Connect {
        hca: 0x1234_5678,
        qpn,
        target_qpn,
        psn,
        secret,
    };
    let _ = s.write_all(&connect.encode());
    let _ = s.write_all(&gdaki::wire::encode_shm_offer(None));
    s
}

/// Every byte `s` receives, and whether the peer closed it (false: the read timed out first).
fn read_until_closed(s: &mut std::net::TcpStream) -> (Vec<u8>, bool) {
    use std::io::Read;
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, true),
            Err(_) => return (got, false),
        }
    }
}

/// What a third party reading and writing raw frames gets from `target` (a listening soft
/// HCA) when it claims to be QP `qpn` with first PSN `psn` and presents `secret`: every byte
/// it receives until the connection closes (or 2 s pass).
fn third_party(target: SocketAddr, target_qpn: u32, qpn: u32, psn: u32, secret: u64, region: &MemoryRegion) -> Vec<u8> {
    use gdaki::wire::{Op, Request};
    use std::io::Write;
    let mut s = raw_connect(target, target_qpn, qpn, psn, secret, Duration::from_secs(2));
    let write = Request {
        seq: psn,
        rkey: region.rkey(),
        addr: region.remote(0).addr,
        op: Op::Write { len: 8 },
    };
    let read = Request {
        seq: psn.wrapping_add(1),
        op: Op::Read { len: 8 },
        ..write
    };
    let _ = s.write_all(&write.encode_head().unwrap());
    let _ = s.write_all(b"PWNED!!!");
    let _ = s.write_all(&read.encode_head().unwrap());
    read_until_closed(&mut s).0
}

/// RC accepts packets only from the QP a QP was moved to RTR with, in PSN order from the PSN
/// exchanged then. A third party that knows the target QPN, the rkey and the address, and even
/// holds the target's endpoint with its secret, but not the peer's QPN and PSN gets nothing:
/// no write lands, no read answers, no answer at all, and the real peer's traffic goes on.
#[test]
fn a_third_party_cannot_write_or_read_a_connected_qp() {
    let (a, qa, b, qb) = tcp_pair(QpConfig::default());
    let la = a.alloc_region(4096, Access::ALL).unwrap();
    let rb = b.alloc_region(4096, Access::ALL).unwrap();
    let secret = pattern(77, 64);
    rb.write(0, &secret).unwrap();
    let at = qb.endpoint().addr.unwrap();
    let key = qb.endpoint().secret;
    let real = qa.endpoint();
    for (qpn, psn) in [(0x31337, 0x777), (real.qpn, real.psn ^ 1), (real.qpn ^ 1, real.psn)] {
        let got = third_party(at, qb.qpn(), qpn, psn, key, &rb);
        assert!(
            got.is_empty(),
            "QPN {qpn:#x}, PSN {psn:#x}: {} bytes answered",
            got.len()
        );
        assert_eq!(rb.read_vec(0, 64).unwrap(), secret, "QPN {qpn:#x}, PSN {psn:#x} wrote");
    }
    // A QP that does not exist answers nothing either (no oracle over QPNs).
    assert!(third_party(at, qb.qpn() ^ 0x40_0000, real.qpn, real.psn, key, &rb).is_empty());
    assert_eq!(qb.state(), QpState::Rts);
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    la.write(0, b"from qa!").unwrap();
    dev.wait(dev.put(rb.remote(0), la.local(0), 8).unwrap()).unwrap();
    assert_eq!(rb.read_vec(0, 8).unwrap(), b"from qa!");
}

/// A fake responder that reads the connect and answers with `answer` (then keeps the
/// connection open for `hold`, sending `trickle` one byte every 20 ms).
fn fake_responder(answer: Vec<u8>, trickle: usize, hold: Duration) -> (SocketAddr, thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let listener = TcpListener::bind(LOOPBACK).unwrap();
    let addr = listener.local_addr().unwrap();
    let h = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut connect = [0u8; gdaki::wire::HEADER_LEN + gdaki::wire::CONNECT_LEN];
        let _ = s.read_exact(&mut connect);
        let _ = s.write_all(&answer);
        let end = Instant::now() + hold;
        for _ in 0..trickle {
            if Instant::now() > end || s.write_all(b"x").is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        while Instant::now() < end && s.write_all(&[]).is_ok() {
            thread::sleep(Duration::from_millis(20));
        }
    });
    (addr, h)
}

/// The endpoint of a fake responder at `addr`: QP 0x42 on an HCA of no process here, taking
/// one READ or atomic at a time.
fn fake_endpoint(addr: SocketAddr) -> Endpoint {
    Endpoint {
        gid: [7; 16],
        lid: 0,
        qpn: 0x42,
        psn: 0,
        mtu: 4096,
        secret: 0x5ec,
        rd_atomic: 0,
        addr: Some(addr),
    }
}

fn connect_to(addr: SocketAddr) -> (Result<(), Error>, Duration) {
    let a = listening_context();
    let q = qp(&a, 8, QpConfig::default());
    let started = Instant::now();
    let r = q.connect(&fake_endpoint(addr));
    (r, started.elapsed())
}

/// One frame (header and payload) from `s`; `None` when none comes (closed, or the read
/// timeout passed).
fn read_frame(s: &mut std::net::TcpStream) -> Option<(gdaki::wire::Header, Vec<u8>)> {
    use std::io::Read;
    let mut h = [0u8; gdaki::wire::HEADER_LEN];
    s.read_exact(&mut h).ok()?;
    let h = gdaki::wire::Header::parse(&h).ok()?;
    let mut p = vec![0u8; h.len as usize];
    s.read_exact(&mut p).ok()?;
    Some((h, p))
}

/// The fake responder's side of a connection set-up on `listener`: it reads the connect,
/// accepts it as QP 0x42, declines shared memory, and returns the connection, ready for
/// requests.
fn accept_as_fake_responder(listener: &TcpListener) -> std::net::TcpStream {
    use std::io::Write;
    let (mut s, _) = listener.accept().unwrap();
    read_frame(&mut s).unwrap(); // the connect
    s.write_all(&gdaki::wire::encode_accept(0x42)).unwrap();
    read_frame(&mut s).unwrap(); // the shared-memory offer
    s.write_all(&gdaki::wire::encode_shm_answer(false)).unwrap();
    s
}

/// A requester keeps its READs and atomics in flight within what the responder's endpoint
/// accepts (`rd_atomic`, log2), as a NIC must: with 2^0 the second READ is sent only once the
/// first is answered; the rest wait in the send queue and all complete, in order.
#[test]
fn reads_in_flight_stay_within_what_the_responder_accepts() {
    use gdaki::wire::{Request, Response};
    use std::io::Write;
    let listener = TcpListener::bind(LOOPBACK).unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = thread::spawn(move || -> Vec<usize> {
        let mut s = accept_as_fake_responder(&listener);
        // How many READs arrive before each answer (within 300 ms of quiet).
        let mut waiting = Vec::new();
        let mut seen_per_answer = Vec::new();
        while seen_per_answer.len() < 4 {
            s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
            while let Some((h, fixed)) = read_frame(&mut s) {
                waiting.push(Request::decode(h, &fixed).unwrap().seq);
            }
            seen_per_answer.push(waiting.len());
            let seq = waiting.remove(0);
            s.set_read_timeout(None).unwrap();
            s.write_all(&Response::ReadResp { seq, len: 8 }.encode_head().unwrap())
                .unwrap();
            s.write_all(&seq.to_be_bytes().repeat(2)).unwrap();
        }
        seen_per_answer
    });
    let a = listening_context();
    let q = qp(&a, 8, QpConfig::default());
    q.connect(&fake_endpoint(addr)).unwrap();
    let local = a.alloc_region(4096, Access::ALL).unwrap();
    let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
    let remote = gdaki_device::Remote { addr: 0x1000, rkey: 7 };
    let tickets: Vec<_> = (0..4u64)
        .map(|k| dev.get(local.local(8 * k), remote, 8).unwrap())
        .collect();
    for t in tickets {
        dev.wait(t).unwrap();
    }
    assert_eq!(fake.join().unwrap(), [1, 1, 1, 1], "READs in flight before each answer");
}

/// A READ whose response trickles in, a byte every 30 ms (each sooner than the socket's 50 ms
/// poll, so the connection never looks idle), fails with a transport error within the QP's
/// retry timeout, as a NIC's per-packet timer does, rather than taking as long as the peer
/// likes (here 2 s for 64 bytes; 1 MiB would take 9 hours).
#[test]
fn a_read_response_that_stalls_fails_within_the_retry_timeout() {
    use gdaki::wire::{Request, Response};
    use std::io::Write;
    let listener = TcpListener::bind(LOOPBACK).unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = thread::spawn(move || {
        let mut s = accept_as_fake_responder(&listener);
        let (h, fixed) = read_frame(&mut s).unwrap();
        let req = Request::decode(h, &fixed).unwrap();
        s.write_all(&Response::ReadResp { seq: req.seq, len: 64 }.encode_head().unwrap())
            .unwrap();
        for _ in 0..64 {
            if s.write_all(b"x").is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(30));
        }
    });
    let a = listening_context();
    let cfg = QpConfig {
        retry_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let q = qp(&a, 8, cfg);
    q.connect(&fake_endpoint(addr)).unwrap();
    let local = a.alloc_region(4096, Access::ALL).unwrap();
    let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
    let started = Instant::now();
    let t = dev
        .get(local.local(0), gdaki_device::Remote { addr: 0x1000, rkey: 7 }, 64)
        .unwrap();
    assert_eq!(cqe_error(dev.wait(t)), Syndrome::TransportRetryExc);
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    drop(q);
    let _ = fake.join();
}

/// A connect's answer is an accept or a reject: any other kind is refused before its length
/// is believed (a 2 GiB "read response" once made the requester allocate 2 GiB).
#[test]
fn a_connect_answer_of_another_kind_is_refused_before_its_payload() {
    use gdaki::wire::{Header, Kind};
    let huge = Header::new(Kind::ReadResp, 4 + (1 << 31)).encode().to_vec();
    let (addr, h) = fake_responder(huge, 0, Duration::from_secs(3));
    let (r, took) = connect_to(addr);
    let e = r.unwrap_err().to_string();
    assert!(e.contains("ReadResp"), "{e}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    h.join().unwrap();
}

/// The connect's deadline is absolute: a peer trickling its answer a byte at a time does not
/// stretch it.
#[test]
fn a_trickling_responder_cannot_stretch_the_connect_deadline() {
    use gdaki::wire::{Header, Kind, MAX_REASON_BYTES};
    let reject = Header::new(Kind::Reject, 2 + MAX_REASON_BYTES as u32).encode().to_vec();
    let (addr, h) = fake_responder(reject, 2000, Duration::from_secs(12));
    let (r, took) = connect_to(addr);
    assert!(r.is_err());
    assert!(took < Duration::from_secs(8), "{took:?}");
    h.join().unwrap();
}

/// Each handshake frame must arrive within the channel's timeout as a whole, not per read: a
/// client sending a Hello a byte every 20 ms is cut off.
#[test]
fn a_slow_handshake_client_is_cut_off_at_the_timeout() {
    use gdaki::wire::{Header, Kind};
    use std::io::Write;
    let listener = TcpListener::bind(LOOPBACK).unwrap();
    let addr = listener.local_addr().unwrap();
    let client = thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let _ = s.write_all(&Header::new(Kind::Hello, 6 + 4000).encode());
        for _ in 0..4006 {
            if s.write_all(&[0]).is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
    });
    let mut ch = Channel::accept(&listener, Duration::from_millis(800)).unwrap();
    let started = Instant::now();
    let e = ch.receive().unwrap_err();
    let took = started.elapsed();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    drop(ch);
    client.join().unwrap();
}

/// Connections that never say who they are cost a bounded amount: at most
/// `MAX_UNVERIFIED` (64) are held, each at most the connect deadline (5 s); more are closed
/// at once. 2,000 such connections once held 2,009 threads.
#[test]
fn silent_connections_are_capped_and_closed() {
    use std::io::Read;
    let ctx = listening_context();
    let q = qp(&ctx, 8, QpConfig::default());
    let at = q.endpoint().addr.unwrap();
    let conns: Vec<std::net::TcpStream> = (0..70).map(|_| std::net::TcpStream::connect(at).unwrap()).collect();
    let closed = || {
        conns
            .iter()
            .filter(|s| {
                s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
                let mut r: &std::net::TcpStream = s;
                match r.read(&mut [0u8; 16]) {
                    Ok(n) => n == 0,
                    Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                }
            })
            .count()
    };
    thread::sleep(Duration::from_millis(1500));
    let early = closed();
    assert_eq!(early, 70 - 64, "closed at once");
    thread::sleep(Duration::from_secs(5));
    assert_eq!(closed(), 70, "closed at the connect deadline");
}

/// The connect a real peer sent (its QPN, first PSN and the secret), replayed after that
/// peer's connection ended, gets nothing: a QP serves one connection per RTR peer, as RC has
/// one, so neither a write lands nor a read answers.
#[test]
fn a_captured_connect_replayed_after_the_peer_left_gets_nothing() {
    let (a, qa, b, qb) = tcp_pair(QpConfig::default());
    let rb = b.alloc_region(4096, Access::ALL).unwrap();
    let before = pattern(79, 64);
    rb.write(0, &before).unwrap();
    let (real, at, key) = (qa.endpoint(), qb.endpoint().addr.unwrap(), qb.endpoint().secret);
    // The real peer goes: its connection to qb ends (qb itself stays as it was, as a responder
    // that posts nothing would on a NIC).
    drop(qa);
    drop(a);
    thread::sleep(Duration::from_millis(300));
    let got = third_party(at, qb.qpn(), real.qpn, real.psn, key, &rb);
    assert_eq!(rb.read_vec(0, 64).unwrap(), before, "the replay wrote");
    assert!(
        !got.windows(8).any(|w| w == &before[..8]),
        "the replay read the region: {} bytes answered",
        got.len()
    );
}

/// A connection to a queue pair with no peer yet (never connected), even one that shows the
/// QP's secret, is closed at the connect deadline (5 s from its arrival) unless it turns out
/// to be that QP's peer: it kept one of the 64 places for unverified connections for as long
/// as it liked, so 64 of them locked every real peer out. (Without the secret it is closed at
/// once: `a_connect_without_the_secret_learns_nothing_and_holds_no_place`.)
#[test]
fn a_connection_to_a_queue_pair_without_a_peer_is_closed_at_the_deadline() {
    let ctx = listening_context();
    let q = qp(&ctx, 8, QpConfig::default());
    let at = q.endpoint().addr.unwrap();
    let started = Instant::now();
    // With the shared-memory offer that follows an accept, after which the deadline used to
    // be cleared.
    let mut s = raw_connect(at, q.qpn(), 0x31337, 7, q.endpoint().secret, Duration::from_secs(9));
    let (_, closed) = read_until_closed(&mut s);
    let took = started.elapsed();
    assert!(closed, "still open after {took:?}");
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(8),
        "closed after {took:?}, not at the deadline"
    );
}

/// Silent connections holding all 64 places for unverified connections do not lock the real
/// peer out: the newest connection takes the place of the oldest one that has not shown the
/// QP's secret, and the real peer shows it at once.
#[test]
fn silent_connections_do_not_lock_the_real_peer_out() {
    let (a, b) = (listening_context(), listening_context());
    let cfg = QpConfig::default();
    let (qa, qb) = (qp(&a, 64, cfg.clone()), qp(&b, 64, cfg));
    let at = qb.endpoint().addr.unwrap();
    let silent: Vec<std::net::TcpStream> = (0..64).map(|_| std::net::TcpStream::connect(at).unwrap()).collect();
    thread::sleep(Duration::from_millis(300));
    // And more keep coming, 50 a second, while the real peer connects.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut held = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                held.extend(std::net::TcpStream::connect(at).ok());
                thread::sleep(Duration::from_millis(20));
            }
            held.len()
        })
    };
    thread::sleep(Duration::from_millis(200));
    // qa's side connects to b's listener, where every place is taken.
    qa.connect(&over_tcp(qb.endpoint()))
        .expect("the real peer was locked out");
    qb.connect(&over_tcp(qa.endpoint())).unwrap();
    let (la, rb) = (
        a.alloc_region(4096, Access::ALL).unwrap(),
        b.alloc_region(4096, Access::ALL).unwrap(),
    );
    la.write(0, b"from qa!").unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    dev.wait(dev.put(rb.remote(0), la.local(0), 8).unwrap()).unwrap();
    assert_eq!(rb.read_vec(0, 8).unwrap(), b"from qa!");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(flood.join().unwrap() > 5, "the flood ran");
    drop(silent);
}

/// When every place holds a connection that showed a QP's secret, a new one is refused with
/// that reason (not "it has no queue pair connected to this one").
#[test]
fn a_peer_refused_for_lack_of_places_is_told_why() {
    let (a, b) = (listening_context(), listening_context());
    let cfg = QpConfig::default();
    let (qa, qb) = (qp(&a, 64, cfg.clone()), qp(&b, 64, cfg.clone()));
    // 64 connections that show the secret of a QP of b's that gets no peer: they wait.
    let lonely = qp(&b, 8, cfg);
    let at = qb.endpoint().addr.unwrap();
    let waiting: Vec<std::net::TcpStream> = (0..64)
        .map(|i| {
            raw_connect(
                at,
                lonely.qpn(),
                0x31337 + i,
                7,
                lonely.endpoint().secret,
                Duration::from_secs(9),
            )
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    let err = qa.connect(&over_tcp(qb.endpoint())).unwrap_err().to_string();
    assert!(err.contains("wait to be known as its peer"), "{err}");
    drop(waiting);
}

/// A connect without the QP's secret is closed at once, whether the QP has a peer yet, has
/// none, or does not exist: nothing tells them apart, and it holds no place.
#[test]
fn a_connect_without_the_secret_learns_nothing_and_holds_no_place() {
    let ctx = listening_context();
    let q = qp(&ctx, 8, QpConfig::default());
    let at = q.endpoint().addr.unwrap();
    for target_qpn in [q.qpn(), q.qpn() ^ 0x40_0000] {
        let started = Instant::now();
        let mut s = raw_connect(
            at,
            target_qpn,
            0x31337,
            7,
            q.endpoint().secret ^ 1,
            Duration::from_secs(9),
        );
        let (got, _) = read_until_closed(&mut s);
        assert!(got.is_empty(), "QPN {target_qpn:#x}: {} bytes answered", got.len());
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "QPN {target_qpn:#x}: held {:?}",
            started.elapsed()
        );
    }
}

/// A third party that has every number of the real peer (its QPN and first PSN, from the same
/// address) but not the secret of the handshake that set the connection up gets nothing either,
/// even before the real peer has connected.
#[test]
fn a_third_party_with_every_number_but_not_the_secret_gets_nothing() {
    let (a, b) = (listening_context(), listening_context());
    let cfg = QpConfig::default();
    let (qa, qb) = (qp(&a, 64, cfg.clone()), qp(&b, 64, cfg));
    // Only qb is connected: its RTR peer is qa, which has not opened its connection yet.
    qb.connect(&over_tcp(qa.endpoint())).unwrap();
    let rb = b.alloc_region(4096, Access::ALL).unwrap();
    let before = pattern(78, 64);
    rb.write(0, &before).unwrap();
    let (real, at, key) = (qa.endpoint(), qb.endpoint().addr.unwrap(), qb.endpoint().secret);
    assert_ne!(key, 0, "a soft HCA's endpoint carries a secret");
    for guess in [0, key ^ 1, key.rotate_left(32)] {
        let got = third_party(at, qb.qpn(), real.qpn, real.psn, guess, &rb);
        assert!(got.is_empty(), "secret {guess:#x}: {} bytes answered", got.len());
        assert_eq!(
            rb.read_vec(0, 64).unwrap(),
            before,
            "secret {guess:#x}: the third party wrote"
        );
    }
    // The real peer still connects and writes.
    qa.connect(&over_tcp(qb.endpoint())).unwrap();
    let la = a.alloc_region(4096, Access::ALL).unwrap();
    la.write(0, b"from qa!").unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    dev.wait(dev.put(rb.remote(0), la.local(0), 8).unwrap()).unwrap();
    assert_eq!(rb.read_vec(0, 8).unwrap(), b"from qa!");
}

/// Over TCP too, a request naming a key of another protection domain than the target QP's is
/// refused with a remote access error and the target goes to error.
#[test]
fn over_tcp_a_key_of_another_protection_domain_is_refused() {
    let (a, qa, b, qb) = tcp_pair(QpConfig::default());
    let tenant = b.alloc_pd().unwrap();
    let theirs = tenant.alloc_region(64, Access::ALL).unwrap();
    theirs.write(0, b"tenant 2").unwrap();
    let la = a.alloc_region(64, Access::ALL).unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    for (i, t) in [
        dev.put(theirs.remote(0), la.local(0), 8).unwrap(),
        dev.get(la.local(8), theirs.remote(0), 8).unwrap(),
    ]
    .into_iter()
    .enumerate()
    {
        let want = [Syndrome::RemoteAccess, Syndrome::WrFlush][i];
        assert_eq!(cqe_error(dev.wait(t)), want);
    }
    assert_eq!(theirs.read_vec(0, 8).unwrap(), b"tenant 2");
    let deadline = Instant::now() + Duration::from_secs(5);
    while qb.state() != QpState::Error && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(qb.state(), QpState::Error);
}

/// Open file descriptors of this process (Linux).
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

over_each_carrier!(destroyed_queue_pairs_close_their_transport_connections);
/// Destroying connected queue pairs closes their transport connections on both sides: nothing
/// of them stays behind (threads, sockets, a place among the HCA's unverified connections).
fn destroyed_queue_pairs_close_their_transport_connections(carrier: Carrier) {
    let (a, b) = (listening_over(carrier), listening_over(carrier));
    let before = open_fds();
    let mut endpoints = Vec::new();
    for _ in 0..20 {
        let (qa, qb) = (qp(&a, 8, QpConfig::default()), qp(&b, 8, QpConfig::default()));
        connect_over(&qa, &qb, carrier);
        endpoints.extend([qa.endpoint(), qb.endpoint()]);
    }
    let maps = || endpoints.iter().map(shm_maps).sum::<usize>();
    let deadline = Instant::now() + Duration::from_secs(5);
    while (open_fds() > before + 4 || maps() > 0) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    assert!(
        open_fds() <= before + 4,
        "{} descriptors open after 20 connected pairs were destroyed, {before} before",
        open_fds()
    );
    assert_eq!(maps(), 0, "shared-memory segments still mapped");
}

/// Shared memory needs both sides: a side that turned it off keeps the connection on TCP,
/// whichever side offers, and the offered segment is not left behind in `/dev/shm`.
#[test]
fn a_side_without_shared_memory_keeps_tcp() {
    let (on, off) = (listening_over(Carrier::Shm), listening_over(Carrier::Tcp));
    let (qa, qb) = (qp(&on, 8, QpConfig::default()), qp(&off, 8, QpConfig::default()));
    connect_over(&qa, &qb, Carrier::Tcp);
    let guid = u64::from_be_bytes(qa.endpoint().gid[8..].try_into().unwrap());
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(&format!("{guid:016x}")))
        .collect();
    assert!(left.is_empty(), "offered segments left in /dev/shm: {left:?}");
    let (la, rb) = (
        on.alloc_region(4096, Access::ALL).unwrap(),
        off.alloc_region(4096, Access::ALL).unwrap(),
    );
    la.write(0, b"over tcp").unwrap();
    let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
    dev.wait(dev.put(rb.remote(0), la.local(0), 8).unwrap()).unwrap();
    assert_eq!(rb.read_vec(0, 8).unwrap(), b"over tcp");
}

/// [`pair_over`] with receive queues of `rq` receives on both sides.
fn two_sided_pair(rq: u32, cfg: QpConfig, carrier: Carrier) -> (Context, QueuePair, Context, QueuePair) {
    let receive = Some(gdaki::ReceiveConfig { size: rq, max_bufs: 2 });
    pair_over(QpConfig { receive, ..cfg }, carrier)
}

over_each_carrier!(two_sided_verbs);
fn two_sided_verbs(carrier: Carrier) {
    let (a, qa, b, qb) = two_sided_pair(64, QpConfig::default(), carrier);
    let la = a.alloc_region(1 << 20, Access::ALL).unwrap();
    let lb = b.alloc_region(1 << 20, Access::ALL).unwrap();
    let data = pattern(3, 1 << 16);
    la.write(0, &data).unwrap();
    let (sa, rb) = unsafe { (qa.cpu::<Exclusive>().unwrap(), qb.cpu_receive::<Exclusive>().unwrap()) };
    // 32 receives outstanding, 32 messages in flight at once: SENDs of every kind and WRITEs
    // with immediate, interleaved with plain WRITEs that take no receive.
    let recvs: Vec<u64> = (0..32u64)
        .map(|i| rb.post_recv_one(lb.local(i * 4096), 4096).unwrap())
        .collect();
    let mut last = 0;
    for i in 0..32u64 {
        let src = la.local(i * 1000);
        last = match i % 4 {
            0 => sa.send(src, 1000 + i).unwrap(),
            1 => sa.send_imm(src, 7, i as u32).unwrap(),
            2 => sa.send_inline(&data[..i as usize]).unwrap(),
            _ => {
                sa.put(lb.remote(600_000 + i * 8), src, 8).unwrap();
                sa.write_imm(lb.remote(800_000 + i * 100), src, 100, !(i as u32))
                    .unwrap()
            }
        };
    }
    sa.wait(last).unwrap();
    for (i, r) in recvs.into_iter().enumerate() {
        let i = i as u64;
        let got = rb.poll(r).unwrap();
        assert_eq!(got.src_qpn, qa.qpn());
        let (len, kind, at) = match i % 4 {
            0 => (1000 + i, gdaki_device::RecvKind::Send, i * 4096),
            1 => (7, gdaki_device::RecvKind::SendImm(i as u32), i * 4096),
            2 => (i, gdaki_device::RecvKind::Send, i * 4096),
            _ => (100, gdaki_device::RecvKind::WriteImm(!(i as u32)), 800_000 + i * 100),
        };
        assert_eq!((got.bytes as u64, got.kind), (len, kind), "message {i}");
        let mut back = vec![0; len as usize];
        lb.read(at, &mut back).unwrap();
        let from = if i % 4 == 2 { 0 } else { (i * 1000) as usize };
        assert_eq!(back, data[from..from + len as usize], "message {i}");
    }
    assert!(rb.poll_next().is_none());
    assert_eq!((qa.error(), qb.error()), (None, None));
}

over_each_carrier!(receiver_not_ready_over_the_transport);
/// Over the transport a message that finds no receive is answered "receiver not ready" and
/// dropped with everything sent after it; the requester sends them all again, in order, once
/// the timer has run out, until receives come.
fn receiver_not_ready_over_the_transport(carrier: Carrier) {
    let cfg = QpConfig {
        min_rnr_timer: 4, // 40 us
        ..Default::default()
    };
    let (a, qa, b, qb) = two_sided_pair(8, cfg, carrier);
    let la = a.alloc_region(1 << 16, Access::ALL).unwrap();
    let lb = b.alloc_region(1 << 16, Access::ALL).unwrap();
    let data = pattern(4, 4096);
    la.write(0, &data).unwrap();
    let sa = unsafe { qa.cpu::<Exclusive>().unwrap() };
    // A WRITE, two SENDs and a WRITE behind them, before any receive.
    sa.put(lb.remote(10_000), la.local(0), 100).unwrap();
    sa.send(la.local(100), 200).unwrap();
    sa.send_inline(b"second").unwrap();
    let t = sa.put(lb.remote(20_000), la.local(300), 300).unwrap();
    let (handle, bufs) = (qb.receive_handle().unwrap() as usize, [lb.local(0), lb.local(1024)]);
    let poster = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        // SAFETY: the QP outlives the thread (joined below); only this thread posts.
        let rq = unsafe { gdaki_device::Rq::<Exclusive>::from_raw(handle as *mut gdaki_layout::DevRq) };
        bufs.map(|b| rq.post_recv_one(b, 1024).unwrap())
    });
    sa.wait(t).unwrap();
    let recvs = poster.join().unwrap();
    let rb = unsafe { qb.cpu_receive::<Exclusive>().unwrap() };
    assert_eq!(rb.poll(recvs[0]).unwrap().bytes, 200);
    assert_eq!(rb.poll(recvs[1]).unwrap().bytes, 6);
    for (at, from, len) in [(10_000, 0, 100), (0, 100, 200), (20_000, 300, 300)] {
        let mut back = vec![0; len];
        lb.read(at, &mut back).unwrap();
        assert_eq!(back, data[from..from + len], "at {at}");
    }
    let mut second = [0; 6];
    lb.read(1024, &mut second).unwrap();
    assert_eq!(&second, b"second");
    assert!(rb.poll_next().is_none(), "each message landed once");
    // With retries limited, a receive that never comes fails the sender alone.
    let cfg = QpConfig {
        min_rnr_timer: 1,
        rnr_retry: 2,
        ..Default::default()
    };
    let (_a, qa, _b, qb) = two_sided_pair(8, cfg, carrier);
    let sa = unsafe { qa.cpu::<Exclusive>().unwrap() };
    let first = sa.send_inline(b"nobody").unwrap();
    let after = sa.send_inline(b"behind").unwrap();
    assert_eq!(cqe_error(sa.wait(first)), Syndrome::RnrRetryExc);
    assert_eq!(cqe_error(sa.wait(after)), Syndrome::WrFlush);
    assert_eq!(qb.state(), QpState::Rts);
}

over_each_carrier!(a_receive_too_small_over_the_transport);
fn a_receive_too_small_over_the_transport(carrier: Carrier) {
    let (a, qa, b, qb) = two_sided_pair(8, QpConfig::default(), carrier);
    let la = a.alloc_region(1 << 16, Access::ALL).unwrap();
    let lb = b.alloc_region(1 << 16, Access::ALL).unwrap();
    let (sa, rb) = unsafe { (qa.cpu::<Exclusive>().unwrap(), qb.cpu_receive::<Exclusive>().unwrap()) };
    let r = rb.post_recv_one(lb.local(0), 10).unwrap();
    let later = rb.post_recv_one(lb.local(100), 10).unwrap();
    assert_eq!(
        cqe_error(sa.wait(sa.send(la.local(0), 11).unwrap())),
        Syndrome::RemoteInvalReq
    );
    let err = |r: Result<gdaki_device::Recv, WaitError>| match r {
        Err(WaitError::Cqe(e)) => e.syndrome,
        other => panic!("expected an error CQE, got {other:?}"),
    };
    assert_eq!(err(rb.poll(r)), Syndrome::LocalLength);
    assert_eq!(err(rb.poll(later)), Syndrome::WrFlush);
}
