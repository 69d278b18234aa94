//! Sockets on the soft HCA, CPU side (docs/sockets.md): both directions, partial sends and
//! receives across the ring's wrap, backpressure that loses nothing, orderly close mid-stream,
//! reset, timeouts, a dead peer, refusals, and many sockets at once.
mod common;
use common::{pattern, socket_listener as listener};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use gdaki::handshake::{Channel, Hello};
use gdaki::socket::{Socket, SocketConfig, SocketFailure, SocketListener};
use gdaki::{Context, Error, Provider};

/// A connected pair: (server side, client side), both sides configured alike.
fn pair(cfg: SocketConfig) -> (Socket, Socket) {
    common::socket_pair(cfg.clone(), cfg)
}

fn small(rx_bytes: u64) -> SocketConfig {
    SocketConfig {
        rx_bytes,
        timeout: Duration::from_secs(5),
        ..SocketConfig::default()
    }
}

/// Reads until the end of the stream, in reads of at most `chunk` bytes.
fn read_to_end(s: &Socket, chunk: usize) -> Vec<u8> {
    let mut all = Vec::new();
    let mut buf = vec![0u8; chunk];
    loop {
        match s.recv(&mut buf).unwrap() {
            0 => return all,
            n => all.extend_from_slice(&buf[..n]),
        }
    }
}

#[test]
fn bytes_go_both_ways() {
    let (s, c) = pair(SocketConfig::default());
    for round in 0..10u8 {
        let msg = pattern(round as u64 + 1, 100 + round as usize * 37);
        c.send_all(&msg).unwrap();
        let mut got = vec![0u8; msg.len()];
        let mut at = 0;
        while at < got.len() {
            at += s.recv(&mut got[at..]).unwrap();
        }
        assert_eq!(got, msg);
        s.send_all(&got).unwrap(); // echo
        let mut back = vec![0u8; msg.len()];
        let mut at = 0;
        while at < back.len() {
            at += c.recv(&mut back[at..]).unwrap();
        }
        assert_eq!(back, msg);
    }
    // Empty sends and receives move nothing.
    assert_eq!(c.send(&[]).unwrap(), 0);
    assert_eq!(s.recv(&mut []).unwrap(), 0);
}

/// A socket's queue pair rings with the reliable doorbell where the device has one (the soft
/// HCA does): no record, one doorbell store a send (docs/connectx-conformance.md).
#[test]
fn socket_queue_pairs_ring_without_a_doorbell_record_where_the_device_has_one() {
    let (s, c) = pair(SocketConfig::default());
    for (side, sock) in [("server", &s), ("client", &c)] {
        // SAFETY: the live queue pair's handle, read as plain data.
        let handle = unsafe { sock.queue_pair().device_handle().read_volatile() };
        assert!(
            handle.no_doorbell_record(),
            "{side}: the socket's queue pair has a doorbell record"
        );
    }
    c.send_all(b"rung once").unwrap();
    let mut got = [0u8; 9];
    let mut at = 0;
    while at < got.len() {
        at += s.recv(&mut got[at..]).unwrap();
    }
    assert_eq!(&got, b"rung once");
}

#[test]
fn a_stream_many_rings_long_arrives_whole_and_in_order_through_partial_sends() {
    // A 4 KiB ring and 1 MiB of data in sends of 3000 bytes: sends are cut where the ring has
    // less room, reads of 1000 bytes cross its wrap.
    let (s, c) = pair(small(4096));
    let data = pattern(42, 1 << 20);
    let sent = data.clone();
    let sender = std::thread::spawn(move || {
        let mut partial = 0;
        for piece in sent.chunks(3000) {
            let mut at = 0;
            while at < piece.len() {
                let n = c.send(&piece[at..]).unwrap();
                if n < piece.len() - at {
                    partial += 1;
                }
                at += n;
            }
        }
        c.close().unwrap();
        partial
    });
    let got = read_to_end(&s, 1000);
    let partial = sender.join().unwrap();
    assert!(
        got == data,
        "the stream differs ({} bytes of {})",
        got.len(),
        data.len()
    );
    assert!(partial > 0, "no send was partial: the ring never filled");
    // The end stays the end.
    assert_eq!(s.recv(&mut [0u8; 16]).unwrap(), 0);
}

#[test]
fn a_receiver_that_stops_reading_holds_the_sender_back_and_loses_nothing() {
    let (s, c) = pair(small(4096));
    let data = pattern(7, 10_000);
    // try_send fills the ring, then would block: never more than the ring in flight.
    let mut at = 0;
    loop {
        match c.try_send(&data[at..]) {
            Ok(n) => at += n,
            Err(SocketFailure::WouldBlock) => break,
            Err(e) => panic!("{e}"),
        }
    }
    // Two frames of half a ring, each less its 16-byte trailer.
    assert_eq!(at, 4096 - 2 * 16);
    // A blocking send waits for room and times out when none comes.
    let c = {
        let timeout = small(4096).timeout;
        let start = Instant::now();
        assert!(matches!(c.send(&data[at..]), Err(SocketFailure::TimedOut(t)) if t == timeout));
        assert!(start.elapsed() >= timeout);
        c
    };
    // The receiver reads the first frame: the credit lets the sender go on from where it
    // stopped.
    let mut got = vec![0u8; 2048];
    let mut n = 0;
    while n < got.len() {
        n += s.recv(&mut got[n..]).unwrap();
    }
    let sender = std::thread::spawn(move || {
        c.send_all(&data[at..]).unwrap();
        c.close().unwrap();
        data
    });
    got.extend(read_to_end(&s, 777));
    let data = sender.join().unwrap();
    assert!(got == data, "bytes were lost or overwritten");
}

#[test]
fn a_close_mid_stream_delivers_the_rest_then_the_end() {
    let (s, c) = pair(small(4096));
    let data = pattern(9, 3000);
    c.send_all(&data).unwrap();
    c.shutdown().unwrap();
    c.shutdown().unwrap(); // once is enough
    assert!(matches!(c.send(b"late"), Err(SocketFailure::Closed)));
    // The other direction still works after a half close.
    s.send_all(b"still here").unwrap();
    let mut buf = [0u8; 10];
    let mut n = 0;
    while n < 10 {
        n += c.recv(&mut buf[n..]).unwrap();
    }
    assert_eq!(&buf, b"still here");
    assert_eq!(read_to_end(&s, 1024), data);
    assert_eq!(s.try_recv(&mut [0u8; 8]).unwrap(), 0);
}

#[test]
fn a_reset_fails_both_sides() {
    let (s, c) = pair(SocketConfig::default());
    c.send_all(b"before").unwrap();
    c.reset().unwrap();
    c.flush().unwrap();
    assert!(matches!(c.send(b"x"), Err(SocketFailure::Reset)));
    assert!(matches!(c.recv(&mut [0u8; 4]), Err(SocketFailure::Reset)));
    assert!(matches!(s.recv(&mut [0u8; 4]), Err(SocketFailure::Reset)));
    assert!(matches!(s.send(b"x"), Err(SocketFailure::Reset)));
}

/// A send that finds the peer's reset posts nothing: on an exclusive queue pair the fast send
/// reserves and writes its WQEs before it looks at the early-loaded reset word, and gives the
/// slots back when the look fails, so the queue pair's counters stay where they were.
#[test]
fn a_send_on_a_reset_stream_posts_nothing_and_gives_its_slots_back() {
    let (s, c) = pair(small(4096));
    // SAFETY: the client's handle, alive for the test; this thread is its only user.
    let dev = unsafe { gdaki_device::socket::Socket::<gdaki_device::Exclusive>::from_raw(c.device_handle()) }.unwrap();
    assert_eq!(dev.send(b"first").unwrap(), 5);
    dev.flush().unwrap();
    s.reset().unwrap();
    s.flush().unwrap();
    let h = c.queue_pair().device_handle();
    // SAFETY: the client's live queue-pair handle, which nothing posts to meanwhile.
    let counters = || unsafe { ((*h).sq_reserved, (*h).sq_ready, (*h).sq_rung) };
    let before = counters();
    assert_eq!(
        dev.send(b"after the reset"),
        Err(gdaki_device::socket::SocketError::Reset)
    );
    assert_eq!(counters(), before, "a refused send reserved, readied or rang slots");
    assert!(before.0 > 0, "the first send went through these counters");
}

/// A peer that breaks the protocol: a frame whose trailer (its tag right) claims more bytes
/// than this side's ring holds (a bug or an attack). The receiver copies nothing from outside
/// its ring and stops trusting the stream: the call and every later one fail as reset.
#[test]
fn a_count_past_the_ring_is_refused_not_copied() {
    let (s, c) = pair(small(4096));
    c.send_all(b"honest").unwrap();
    let mut buf = [0u8; 6];
    let mut n = 0;
    while n < 6 {
        n += s.recv(&mut buf[n..]).unwrap();
    }
    // SAFETY: the live socket's handle; its receive ring is host memory (CPU mode), which
    // this test writes as the peer's WRITE would: the trailer of the next frame, at the ring
    // position after "honest"'s frame.
    unsafe {
        use gdaki_layout::socket::{frame_bytes, frame_offset, frame_tag, CONTROL_BYTES, TRAILER_BYTES};
        let h = s.device_handle();
        let (pos, len) = ((*h).consumed, 4 * 4096);
        assert_eq!(pos, frame_bytes(6));
        let at = (*h).rx_window + CONTROL_BYTES + frame_offset(4096, pos, TRAILER_BYTES);
        (at as *mut [u64; 2]).write_volatile([len, frame_tag(pos, len, (*h).rx_key)]);
    }
    let mut big = vec![0u8; 8 * 4096];
    assert!(
        matches!(s.recv(&mut big), Err(SocketFailure::Reset)),
        "a count past the ring"
    );
    assert!(big.iter().all(|&b| b == 0), "nothing was copied");
    assert!(
        matches!(s.try_recv(&mut big), Err(SocketFailure::Reset)),
        "and after it"
    );
}

#[test]
fn waits_are_bounded_and_try_forms_never_wait() {
    let cfg = SocketConfig {
        timeout: Duration::from_millis(300),
        ..SocketConfig::default()
    };
    let (_s, c) = pair(cfg);
    assert!(matches!(c.try_recv(&mut [0u8; 8]), Err(SocketFailure::WouldBlock)));
    let start = Instant::now();
    assert!(matches!(c.recv(&mut [0u8; 8]), Err(SocketFailure::TimedOut(_))));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
}

#[test]
fn a_peer_that_went_away_shows_as_a_lost_connection() {
    let cfg = SocketConfig {
        timeout: Duration::from_secs(2),
        ..SocketConfig::default()
    };
    let (s, c) = pair(cfg);
    drop(s);
    c.send_all(b"into the void").unwrap();
    // The put cannot complete: its error (or the wait's bound) says the connection is gone.
    match c.flush() {
        Err(SocketFailure::Lost(_)) => {}
        other => panic!("expected a lost connection, got {other:?}"),
    }
}

#[test]
fn a_peer_speaking_another_protocol_is_refused() {
    let cfg = SocketConfig::default();
    let (l, addr, _ctx) = listener(&cfg);
    let server = std::thread::spawn(move || l.accept());
    let mut ch = Channel::connect(addr, Duration::from_secs(5)).unwrap();
    ch.send(&Hello {
        app: b"gdaki-socket/2 log_rx=16".to_vec(),
        endpoints: vec![],
        regions: vec![],
    })
    .unwrap();
    assert!(matches!(ch.receive(), Err(Error::Rejected { .. })));
    match server.join().unwrap() {
        Err(Error::Rejected { reason, .. }) => assert!(reason.contains("gdaki-socket/3"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // Rings outside 4 KiB..1 GiB or not a power of two are refused before anything is made.
    let ctx = Context::open(Provider::Soft).unwrap();
    for rx_bytes in [1000, 2048, 1 << 31] {
        let bad = SocketConfig {
            rx_bytes,
            ..SocketConfig::default()
        };
        assert!(matches!(
            SocketListener::bind(&ctx, "127.0.0.1:0".parse().unwrap(), bad),
            Err(Error::BadSize { .. })
        ));
    }
    // So are send queues too small for a send's WQEs (up to four) or not a power of two, at
    // a bind and at a connect (which makes nothing: the listener serves the next client).
    let (l, addr, _lctx) = listener(&SocketConfig::default());
    for sq_size in [4, 12, 1 << 16] {
        let bad = SocketConfig {
            sq_size,
            ..SocketConfig::default()
        };
        assert!(matches!(
            SocketListener::bind(&ctx, "127.0.0.1:0".parse().unwrap(), bad.clone()),
            Err(Error::BadSize {
                what: "a socket's send queue",
                ..
            })
        ));
        assert!(matches!(
            Socket::connect(&ctx, addr, bad),
            Err(Error::BadSize {
                what: "a socket's send queue",
                ..
            })
        ));
    }
    let served = std::thread::spawn(move || l.accept().map(|_| ()));
    Socket::connect(&ctx, addr, SocketConfig::default()).unwrap();
    served.join().unwrap().unwrap();
}

#[test]
fn many_sockets_at_once_each_carry_their_own_stream() {
    const N: usize = 64;
    let cfg = small(4096);
    let (l, addr, _sctx) = listener(&cfg);
    // The server accepts N sockets and echoes each one's stream back on it.
    let server = std::thread::spawn(move || {
        let sockets: Vec<Socket> = (0..N).map(|_| l.accept().unwrap()).collect();
        for s in &sockets {
            let got = read_to_end(s, 512);
            s.send_all(&got).unwrap();
        }
        for s in sockets {
            s.close().unwrap();
        }
    });
    let ctx = Context::open(Provider::Soft).unwrap();
    let clients: Vec<Socket> = (0..N)
        .map(|_| Socket::connect(&ctx, addr, cfg.clone()).unwrap())
        .collect();
    let streams: Vec<Vec<u8>> = (0..N).map(|i| pattern(100 + i as u64, 1000 + i * 13)).collect();
    for (c, data) in clients.iter().zip(&streams) {
        c.send_all(data).unwrap();
        c.shutdown().unwrap();
    }
    for (i, (c, data)) in clients.iter().zip(&streams).enumerate() {
        assert_eq!(&read_to_end(c, 300), data, "socket {i}");
    }
    server.join().unwrap();
}

/// The peer of the two-process tests (this binary run again): a socket server that echoes one
/// stream per connection, for `GDAKI_SOCKET_PEER` connections; it prints its port first.
#[test]
fn peer_process() {
    let Ok(n) = std::env::var("GDAKI_SOCKET_PEER") else {
        return;
    };
    let cfg = small(8192);
    let (l, addr, _ctx) = listener(&cfg);
    println!("PORT {}", addr.port());
    for _ in 0..n.parse::<usize>().unwrap() {
        let s = l.accept().unwrap();
        let got = read_to_end(&s, 4096);
        s.send_all(&got).unwrap();
        s.close().unwrap();
    }
}

#[test]
fn a_socket_to_another_process_carries_a_stream_through_the_soft_transport() {
    let peer = common::PeerProcess::spawn(&[("GDAKI_SOCKET_PEER", "2")]);
    let addr = SocketAddr::from(([127, 0, 0, 1], peer.port));
    let ctx = Context::open(Provider::Soft).unwrap();
    for (i, len) in [(0u64, 300_000usize), (1, 5)].into_iter() {
        // A 4 KiB receive ring here, 8 KiB there: each direction uses its receiver's size.
        let s = Socket::connect(&ctx, addr, small(4096)).unwrap();
        let data = pattern(77 + i, len);
        let sender = {
            let data = data.clone();
            // Send and read at once: the echo can fill this side's ring before the send ends.
            std::thread::scope(|scope| {
                let reader = scope.spawn(|| read_to_end(&s, 1500));
                s.send_all(&data).unwrap();
                s.shutdown().unwrap();
                reader.join().unwrap()
            })
        };
        assert!(sender == data, "connection {i}: the echo differs");
    }
}

/// GPUnet's threadblock-cooperative calls, with CPU threads playing a block: every member
/// calls with the same buffer, each copies its share, the leader posts; the server's block
/// echoes a stream that crosses its 4 KiB ring many times.
#[test]
fn a_block_of_threads_receives_and_sends_together() {
    block_echoes::<gdaki_device::Gpu>(5);
}

/// The same with a block of more than a warp on an exclusive queue pair, where a member other
/// than the leader (the first past its warp) rings each send's doorbell after the block has
/// its result, beside the leader's next call and the echo's closing shutdown; and, sharing the
/// queue pair, where the leader rings.
#[test]
fn a_block_of_more_than_a_warp_rings_on_another_member() {
    block_echoes::<gdaki_device::Exclusive>(34);
    block_echoes::<gdaki_device::Gpu>(34);
}

/// A block of `threads` CPU threads echoes a 200 KB stream through its server socket, its
/// queue pair posted to in sharing mode `M`.
fn block_echoes<M: gdaki_device::Sharing>(threads: u32) {
    use gdaki_device::scope::Group;
    use gdaki_device::socket::Socket as DevSocket;
    use std::sync::Mutex;
    let (s, c) = pair(small(4096));
    let data = pattern(5, 200_000);
    let echoed = std::thread::scope(|scope| {
        let reader = scope.spawn(|| read_to_end(&c, 3000));
        let group = Group::new(threads).unwrap();
        // One buffer for the block (as in shared memory), an odd size so the pieces vary.
        let buf = Mutex::new(vec![0u8; 1500]);
        let handle = s.device_handle() as usize;
        std::thread::scope(|block| {
            for r in 0..threads {
                let (group, buf) = (&group, &buf);
                block.spawn(move || {
                    let me = group.block(r).unwrap();
                    // SAFETY: the server's handle, alive for the scope; the block is its only user.
                    let dev = unsafe { DevSocket::<M>::from_raw(handle as *mut _) }.unwrap();
                    let ptr = buf.lock().unwrap().as_mut_ptr() as usize;
                    // SAFETY: the block's buffer of 1500 bytes, alive for the scope; members
                    // write disjoint parts of it between barriers.
                    let b = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, 1500) };
                    gdaki_device::socket::echo(&dev, me, b).unwrap();
                });
            }
            c.send_all(&data).unwrap();
            c.shutdown().unwrap();
        });
        reader.join().unwrap()
    });
    assert!(echoed == data, "the block of {threads}'s echo differs");
}

/// GPUnet's echo server on the GPU: every block of one kernel serves a socket of its own,
/// all its threads together, for CPU clients that each send a stream many rings long; the
/// server's rings in GPU memory, then in host memory mapped into the GPU.
#[test]
fn a_gpu_server_echoes_cpu_clients_a_block_per_socket() {
    use gdaki::socket::{GpuSocket, SocketMemory};
    let test = "a_gpu_server_echoes_cpu_clients_a_block_per_socket";
    let Some((gpu, _one)) = common::gpu_or_skip(test) else {
        return;
    };
    const N: usize = 8;
    for memory in [SocketMemory::Device(gpu.clone()), SocketMemory::Pinned(gpu.clone())] {
        let server_cfg = SocketConfig {
            rx_bytes: 16 << 10,
            timeout: Duration::from_secs(30),
            memory: memory.clone(),
            ..SocketConfig::default()
        };
        let (l, addr, _sctx) = listener(&server_cfg);
        let accepting = {
            let gpu = gpu.clone();
            std::thread::spawn(move || {
                (0..N)
                    .map(|_| l.accept().unwrap().into_gpu(&gpu).unwrap())
                    .collect::<Vec<GpuSocket>>()
            })
        };
        let ctx = Context::open(Provider::Soft).unwrap();
        let client_cfg = SocketConfig {
            timeout: Duration::from_secs(30),
            ..small(8192)
        };
        let clients: Vec<Socket> = (0..N)
            .map(|_| Socket::connect(&ctx, addr, client_cfg.clone()).unwrap())
            .collect();
        let mut served = accepting.join().unwrap();
        let serving = {
            let gpu = gpu.clone();
            std::thread::spawn(move || {
                let run = GpuSocket::echo_on_gpu(&gpu, &mut served, 128, 3000).unwrap();
                (run, served)
            })
        };
        let streams: Vec<Vec<u8>> = (0..N).map(|i| pattern(300 + i as u64, 100_000 + i * 777)).collect();
        std::thread::scope(|scope| {
            for (i, (c, data)) in clients.iter().zip(&streams).enumerate() {
                scope.spawn(move || {
                    let back = std::thread::scope(|inner| {
                        let reader = inner.spawn(|| read_to_end(c, 5000));
                        c.send_all(data).unwrap();
                        c.shutdown().unwrap();
                        reader.join().unwrap()
                    });
                    assert!(&back == data, "socket {i}'s echo differs");
                });
            }
        });
        let (run, _served) = serving.join().unwrap();
        for (i, data) in streams.iter().enumerate() {
            assert_eq!((run.status[i], run.moved[i]), (0, data.len() as u64), "block {i}");
        }
        eprintln!(
            "{N} sockets echoed by the GPU ({}): {:.1} ms",
            match memory {
                SocketMemory::Device(_) => "rings in GPU memory",
                _ => "rings in pinned host memory",
            },
            run.elapsed.as_secs_f64() * 1e3
        );
    }
}

/// A thousand sockets on one GPU at once: a block of 32 threads each, echoing a small stream
/// for a CPU client. The clients send everything first (each stream fits its ring), so blocks
/// that are not resident yet start as others finish.
#[test]
fn a_thousand_sockets_on_one_gpu() {
    use gdaki::socket::{GpuSocket, SocketMemory};
    let test = "a_thousand_sockets_on_one_gpu";
    let Some((gpu, _one)) = common::gpu_or_skip(test) else {
        return;
    };
    const N: usize = 1000;
    let cfg = SocketConfig {
        rx_bytes: 4096,
        timeout: Duration::from_secs(60),
        sq_size: 64,
        memory: SocketMemory::Pinned(gpu.clone()),
    };
    let (l, addr, _sctx) = listener(&cfg);
    let accepting = {
        let gpu = gpu.clone();
        std::thread::spawn(move || {
            (0..N)
                .map(|_| l.accept().unwrap().into_gpu(&gpu).unwrap())
                .collect::<Vec<GpuSocket>>()
        })
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let client_cfg = SocketConfig {
        sq_size: 64,
        ..small(4096)
    };
    let clients: Vec<Socket> = (0..N)
        .map(|_| Socket::connect(&ctx, addr, client_cfg.clone()).unwrap())
        .collect();
    let mut served = accepting.join().unwrap();
    let serving = {
        let gpu = gpu.clone();
        std::thread::spawn(move || GpuSocket::echo_on_gpu(&gpu, &mut served, 32, 1024).map(|run| (run, served)))
    };
    let streams: Vec<Vec<u8>> = (0..N).map(|i| pattern(5000 + i as u64, 100 + i % 900)).collect();
    for (c, data) in clients.iter().zip(&streams) {
        c.send_all(data).unwrap();
        c.shutdown().unwrap();
    }
    for (i, (c, data)) in clients.iter().zip(&streams).enumerate() {
        assert_eq!(&read_to_end(c, 4096), data, "socket {i}");
    }
    let (run, _served) = serving.join().unwrap().unwrap();
    assert!(
        run.status.iter().all(|&s| s == 0),
        "{:?}",
        run.status.iter().find(|&&s| s != 0)
    );
    let total: u64 = run.moved.iter().sum();
    assert_eq!(total, streams.iter().map(|s| s.len() as u64).sum::<u64>());
    eprintln!(
        "{N} sockets on one GPU echoed {total} bytes in {:.1} ms",
        run.elapsed.as_secs_f64() * 1e3
    );
}

#[test]
fn a_client_hands_the_server_data_with_the_connection() {
    let cfg = SocketConfig::default();
    let (l, addr, _sctx) = listener(&cfg);
    let server = std::thread::spawn(move || {
        let s = l.accept().unwrap();
        let data = s.peer_data().to_vec();
        s.send_all(&data).unwrap(); // and the socket works as ever
        s.close().unwrap();
        data
    });
    let ctx = Context::open(Provider::Soft).unwrap();
    let c = Socket::connect_with(&ctx, addr, cfg.clone(), b"size=64 role=pong").unwrap();
    assert!(c.peer_data().is_empty());
    assert_eq!(read_to_end(&c, 100), b"size=64 role=pong");
    assert_eq!(server.join().unwrap(), b"size=64 role=pong");
    // More than the hello carries is refused before connecting.
    assert!(matches!(
        Socket::connect_with(&ctx, addr, cfg, &[0u8; 1025]),
        Err(Error::OutOfRange { .. })
    ));
}

/// The reverse of the GPU echo server, and GPU to GPU: a GPU block as a client that sends a
/// known stream and checks its echo, against a CPU server, then against a GPU server block in
/// the same kernel (rings in GPU memory).
#[test]
fn gpu_clients_check_their_echo_from_a_cpu_server_and_from_a_gpu_server() {
    use gdaki::socket::{GpuSocket, SocketMemory};
    use gdaki_device::socket::{BenchRole, Socket as DevSocket};
    let test = "gpu_clients_check_their_echo_from_a_cpu_server_and_from_a_gpu_server";
    let Some((gpu, _one)) = common::gpu_or_skip(test) else {
        return;
    };
    let (size, iters) = (3000u64, 200u32);
    // A CPU server (a thread running the same echo) and a GPU client.
    let gpu_cfg = SocketConfig {
        rx_bytes: 8192,
        timeout: Duration::from_secs(30),
        memory: SocketMemory::Pinned(gpu.clone()),
        ..SocketConfig::default()
    };
    let (l, addr, _sctx) = listener(&small(8192));
    let server = std::thread::spawn(move || {
        let s = l.accept().unwrap();
        // SAFETY: the server socket's own handle; this thread is its only user.
        let dev = unsafe { DevSocket::<gdaki_device::Gpu>::from_raw(s.device_handle()) }.unwrap();
        let echoed = gdaki_device::socket::echo(&dev, gdaki_device::Thread, &mut [0u8; 1024]).unwrap();
        drop(s);
        echoed
    });
    let ctx = Context::open(Provider::Soft).unwrap();
    let client = Socket::connect(&ctx, addr, gpu_cfg.clone())
        .unwrap()
        .into_gpu(&gpu)
        .unwrap();
    let run = GpuSocket::bench_on_gpu(
        &gpu,
        &mut [client],
        &[BenchRole::Check],
        size,
        iters,
        128,
        size as usize,
        false,
    )
    .unwrap();
    assert_eq!(
        (run.status[0], run.moved[0]),
        (0, size * iters as u64),
        "{}",
        gdaki_device::status::Code(run.status[0])
    );
    assert_eq!(server.join().unwrap(), size * iters as u64);
    // GPU to GPU: both sides' blocks in one kernel.
    let device_cfg = SocketConfig {
        memory: SocketMemory::Device(gpu.clone()),
        ..gpu_cfg
    };
    let (l, addr, _sctx2) = listener(&device_cfg);
    let accepting = std::thread::spawn(move || l.accept().unwrap());
    let c = Socket::connect(&ctx, addr, device_cfg).unwrap();
    let mut both = vec![
        c.into_gpu(&gpu).unwrap(),
        accepting.join().unwrap().into_gpu(&gpu).unwrap(),
    ];
    // First with a block of the device's 1024 threads: the kernel runs it, or (its registers
    // allow fewer) the launch is refused with the kernel's limit before anything runs (never
    // a driver failure) and the sockets serve the run with 128.
    let mut bench = |threads| {
        GpuSocket::bench_on_gpu(
            &gpu,
            &mut both,
            &[BenchRole::Check, BenchRole::Echo],
            size,
            iters,
            threads,
            size as usize,
            false,
        )
    };
    let run = match bench(1024) {
        Ok(run) => run,
        Err(e) => {
            let said = e.to_string();
            assert!(
                said.contains("gdaki_socket_bench_untimed: a block of 1024 threads, where this kernel runs at most"),
                "{said}"
            );
            bench(128).unwrap()
        }
    };
    assert_eq!(run.status, vec![0, 0], "{}", gdaki_device::status::Code(run.status[0]));
    assert_eq!(run.moved, vec![size * iters as u64; 2]);
}

/// The checking client in CPU mode: it passes against the echo, and a server that changes a
/// byte makes it fail with the wrong-data code.
#[test]
fn the_checking_client_notices_a_changed_byte() {
    use gdaki_device::socket::{bench, BenchRole, Socket as DevSocket, CODE_WRONG_DATA};
    for corrupt in [false, true] {
        let (s, c) = pair(small(4096));
        let server = std::thread::spawn(move || {
            let mut buf = [0u8; 700];
            // Until the end of the stream (or the client's reset, in the corrupt case).
            while let Ok(n @ 1..) = s.recv(&mut buf) {
                if corrupt {
                    buf[n / 2] ^= 0x40;
                }
                if s.send_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = s.shutdown();
        });
        // SAFETY: the client's own handle; this thread is its only user meanwhile.
        let dev = unsafe { DevSocket::<gdaki_device::Gpu>::from_raw(c.device_handle()) }.unwrap();
        let mut buf = vec![0u8; 2000];
        // SAFETY: Check records no timestamps.
        let outcome = unsafe {
            bench::<_, _, false>(
                &dev,
                gdaki_device::Thread,
                BenchRole::Check,
                2000,
                20,
                &mut buf,
                std::ptr::null_mut(),
            )
        };
        if corrupt {
            assert!(matches!(
                outcome,
                Err(gdaki_device::socket::SocketError::Failed { code: CODE_WRONG_DATA })
            ));
            c.reset().unwrap();
        } else {
            assert_eq!(outcome.unwrap(), 40_000);
        }
        server.join().unwrap();
    }
}

/// A socket service on its own context, listening on 127.0.0.1, for CPU threads (the rings in
/// host memory).
fn local_service(cfg: SocketConfig) -> gdaki::socket::SocketService {
    let ctx = Context::open(Provider::Soft).unwrap();
    gdaki::socket::SocketService::start(&ctx, "127.0.0.1".parse().unwrap(), cfg).unwrap()
}

/// The device view of a CPU-mode service's handle (`SocketService::device_handle`).
fn svc(handle: usize) -> gdaki_device::socket::Service {
    // SAFETY: callers pass the handle of a CPU-mode service (host memory) that outlives the use.
    unsafe { gdaki_device::socket::Service::from_raw(handle as *const _) }.unwrap()
}

/// Connection set-up from the device side (GPUnet's `gconnect_in`, `gbind`, `gaccept`), in
/// CPU mode: threads playing kernels listen, accept, connect, echo and release through two
/// socket services, a block of them accepts together; the refusals each get their code, and
/// the services hold nothing at the end.
#[test]
fn threads_connect_listen_and_accept_through_a_socket_service() {
    use gdaki_device::scope::Group;
    use gdaki_device::socket::{Service, Socket as DevSocket, SocketError};
    type Dev = DevSocket<gdaki_device::Gpu>;
    let cfg = SocketConfig {
        timeout: Duration::from_millis(700),
        ..small(4096)
    };
    let (server, client) = (local_service(cfg.clone()), local_service(cfg));
    let (sh, ch) = (server.device_handle() as usize, client.device_handle() as usize);
    let data = pattern(9, 50_000);

    let port = svc(sh).listen(0).unwrap();
    assert_ne!(port, 0);
    let addr = format!("127.0.0.1:{port}");
    let group = Group::new(3).unwrap();
    let buf = std::sync::Mutex::new(vec![0u8; 1000]);
    std::thread::scope(|scope| {
        // The server: a block of three accepts together, echoes together (one buffer for the
        // block, as in shared memory), closes, releases.
        for r in 0..3 {
            let (group, buf) = (&group, &buf);
            scope.spawn(move || {
                let me = group.block(r).unwrap();
                let s = svc(sh).accept_with(me, port).unwrap();
                // SAFETY: the handle the service made for this block, used by it alone.
                let dev = unsafe { Dev::from_raw(s) }.unwrap();
                let ptr = buf.lock().unwrap().as_mut_ptr() as usize;
                // SAFETY: the block's buffer of 1000 bytes, alive for the scope; members write
                // disjoint parts of it between barriers.
                let b = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, 1000) };
                gdaki_device::socket::echo(&dev, me, b).unwrap();
                dev.close_with(me).unwrap();
                svc(sh).release_with(me, s).unwrap();
            });
        }
        // The client: one thread receives, another sends.
        let s = svc(ch).connect(addr.as_bytes()).unwrap();
        // SAFETY: the handle the service made for this thread, which receives only.
        let dev = unsafe { Dev::from_raw(s) }.unwrap();
        let mut back = vec![0u8; data.len()];
        let writer = {
            let (data, s) = (&data, s as usize);
            scope.spawn(move || {
                // SAFETY: as above; this thread is the socket's only sender.
                let tx = unsafe { Dev::from_raw(s as *mut _) }.unwrap();
                let mut at = 0;
                while at < data.len() {
                    at += tx.send(&data[at..]).unwrap();
                }
                tx.shutdown().unwrap();
            })
        };
        dev.recv_exact_with(gdaki_device::Thread, &mut back).unwrap();
        writer.join().unwrap();
        assert_eq!(dev.recv(&mut [0u8; 16]), Ok(0), "the echo ends where the stream did");
        assert!(back == data, "the echo differs");
        dev.close_with(gdaki_device::Thread).unwrap();
        svc(ch).release(s).unwrap();
    });

    // Refusals: each with its code, the caller's slot given back every time.
    let c = svc(ch);
    assert_eq!(c.connect(b""), Err(SocketError::BadArgument));
    assert_eq!(c.connect(&[b'1'; 65]), Err(SocketError::BadArgument));
    assert_eq!(c.connect(b"not an address"), Err(SocketError::Refused));
    // Port 1 (tcpmux): nothing listens there, and no test's port-0 listener can be given it.
    let closed = "127.0.0.1:1";
    assert_eq!(
        c.connect(closed.as_bytes()),
        Err(SocketError::Refused),
        "nobody listens"
    );
    assert_eq!(
        c.accept(port),
        Err(SocketError::Refused),
        "the client's service never listened there"
    );
    assert_eq!(c.release(std::ptr::null_mut()), Err(SocketError::BadArgument));
    assert_eq!(
        c.release(std::ptr::dangling_mut()),
        Err(SocketError::BadHandle { version: 0 }),
        "not one of its sockets"
    );
    assert_eq!(
        c.unlisten(port),
        Err(SocketError::BadArgument),
        "no listener at that port here"
    );
    assert_eq!(svc(sh).listen(port), Err(SocketError::Refused), "the port is taken");
    let started = Instant::now();
    assert_eq!(svc(sh).accept(port), Err(SocketError::TimedOut), "nobody connects");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the accept kept the socket timeout"
    );
    svc(sh).unlisten(port).unwrap();
    assert_eq!(svc(sh).accept(port), Err(SocketError::Refused), "no longer listening");
    assert_eq!((server.held(), client.held()), ((0, 0), (0, 0)));
    // SAFETY: a null handle is refused before it is read.
    assert!(matches!(
        unsafe { Service::from_raw(std::ptr::null()) },
        Err(SocketError::BadHandle { .. })
    ));
    #[repr(C, align(64))]
    struct Zeroed([u8; 64]);
    let zero = Zeroed([0; 64]);
    // SAFETY: 64 readable bytes, aligned as a handle, of another version (0).
    assert!(matches!(
        unsafe { Service::from_raw(&zero as *const Zeroed as *const _) },
        Err(SocketError::BadHandle { version: 0 })
    ));
}

/// Many callers at once through one socket service (more than it has slots): 80 threads
/// connect while 80 accept on one listener, each pair echoes its own stream; every call gets
/// a slot in time, every stream arrives whole, and the services hold nothing afterwards.
#[test]
fn many_callers_share_a_socket_service() {
    use gdaki_device::socket::Socket as DevSocket;
    type Dev = DevSocket<gdaki_device::Gpu>;
    const PAIRS: usize = 80;
    let cfg = SocketConfig {
        timeout: Duration::from_secs(20),
        ..small(4096)
    };
    let (server, client) = (local_service(cfg.clone()), local_service(cfg));
    let (sh, ch) = (server.device_handle() as usize, client.device_handle() as usize);
    let port = svc(sh).listen(0).unwrap();
    let addr = format!("127.0.0.1:{port}");
    std::thread::scope(|scope| {
        for _ in 0..PAIRS {
            scope.spawn(move || {
                let s = svc(sh).accept(port).unwrap();
                // SAFETY: the handle the service made for this thread, used by it alone.
                let dev = unsafe { Dev::from_raw(s) }.unwrap();
                let mut buf = [0u8; 512];
                gdaki_device::socket::echo(&dev, gdaki_device::Thread, &mut buf).unwrap();
                dev.close_with(gdaki_device::Thread).unwrap();
                svc(sh).release(s).unwrap();
            });
        }
        for i in 0..PAIRS {
            let addr = addr.clone();
            scope.spawn(move || {
                let s = svc(ch).connect(addr.as_bytes()).unwrap();
                // SAFETY: as above.
                let dev = unsafe { Dev::from_raw(s) }.unwrap();
                let data = pattern(i as u64, 3000 + i);
                dev.send_all_with(gdaki_device::Thread, &data).unwrap();
                let mut back = vec![0u8; data.len()];
                dev.recv_exact_with(gdaki_device::Thread, &mut back).unwrap();
                assert!(back == data, "pair {i}: the echo differs");
                dev.close_with(gdaki_device::Thread).unwrap();
                svc(ch).release(s).unwrap();
            });
        }
    });
    svc(sh).unlisten(port).unwrap();
    assert_eq!((server.held(), client.held()), ((0, 0), (0, 0)));
}

/// A caller that gives up before the service answers: the service, finishing the call later,
/// sees `cancelled` and undoes it (the socket it made is dropped, never handed out), and the
/// peer's connection ends. Played with a copy of the service's handle whose caller timeout is
/// far shorter than the service's accept.
#[test]
fn a_call_its_caller_gave_up_on_is_undone() {
    use gdaki_device::socket::{Service, SocketError};
    use gdaki_layout::socket::DevSocketService;
    let cfg = SocketConfig {
        timeout: Duration::from_secs(3),
        ..small(4096)
    };
    let server = local_service(cfg.clone());
    // SAFETY: the service's handle in host memory (CPU mode), alive for the test.
    let mut impatient: DevSocketService = unsafe { std::ptr::read(server.device_handle() as *const DevSocketService) };
    impatient.timeout_ns = 50_000_000;
    // SAFETY: a copy of the live handle (same mailbox and locks), alive for the test.
    let svc = unsafe { Service::from_raw(&impatient) }.unwrap();
    let port = svc.listen(0).unwrap();
    // The client connects only after the caller gave up waiting (twice 50 ms).
    let client = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        let c = Socket::connect(
            &Context::open(Provider::Soft).unwrap(),
            format!("127.0.0.1:{port}").parse().unwrap(),
            cfg,
        )
        .unwrap();
        // The server's side was dropped: nothing ever comes, and the stream ends or is lost.
        let mut buf = [0u8; 8];
        c.recv(&mut buf)
    });
    let started = Instant::now();
    assert_eq!(svc.accept(port), Err(SocketError::TimedOut));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the caller kept its own timeout"
    );
    let ended = client.join().unwrap();
    assert!(
        !matches!(ended, Ok(n) if n > 0),
        "the undone socket sent nothing: {ended:?}"
    );
    // Once the service finished the accept, it undid it: no socket held, the listener stays.
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.held() != (0, 1) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.held(), (0, 1));
}

/// A connected pair, and the client's context (for regions its socket may send from).
fn pair_with_client_context(cfg: SocketConfig) -> (Socket, Socket, Context) {
    let (l, addr, _sctx) = listener(&cfg);
    let accepted = std::thread::spawn(move || l.accept().unwrap());
    let cctx = Context::open(Provider::Soft).unwrap();
    let c = Socket::connect(&cctx, addr, cfg).unwrap();
    (accepted.join().unwrap(), c, cctx)
}

/// Sends from registered memory (no copy into the staging ring) land in the stream in order,
/// between copied sends, cut where the 4 KiB ring has less room, across its wrap.
#[test]
fn sends_from_registered_memory_mix_with_copied_sends_in_one_stream() {
    let (s, c, cctx) = pair_with_client_context(small(4096));
    let data = pattern(77, 300_000);
    let region = cctx.alloc_region(data.len(), gdaki::Access::ALL).unwrap();
    region.write(0, &data).unwrap();
    let reader = std::thread::spawn(move || read_to_end(&s, 1700));
    let (mut at, mut partial, mut turn) = (0usize, 0, 0);
    while at < data.len() {
        let want = (2500 + turn * 611 % 3000).min(data.len() - at);
        let n = if turn % 2 == 0 {
            c.send_from(&region, at as u64, want as u64).unwrap()
        } else {
            c.send(&data[at..at + want]).unwrap()
        };
        assert!(n > 0 && n <= want, "a send moved {n} of {want} bytes");
        partial += (n < want) as u32;
        at += n;
        turn += 1;
    }
    c.flush().unwrap();
    c.shutdown().unwrap();
    let got = reader.join().unwrap();
    assert!(
        got == data,
        "the stream differs ({} bytes of {})",
        got.len(),
        data.len()
    );
    assert!(partial > 0, "no send was cut by the ring");
}

/// A frame sent from registered memory is one WRITE gathered from there and from the staging
/// ring (the frame's padding and trailer), not its bytes' WRITE and an inline WRITE of the
/// trailer: one WQE a frame, at every padding, and the stream arrives whole.
#[test]
fn a_frame_from_registered_memory_is_one_gathered_write() {
    let (s, c, cctx) = pair_with_client_context(small(1 << 16));
    // Every padding a frame can have (its bytes and trailer rounded up to 128), within half
    // the ring in all: each send is one frame, never cut.
    let lens = [1usize, 15, 16, 17, 111, 112, 113, 127, 128, 129, 1000, 4096, 5000];
    let total: usize = lens.iter().sum();
    let data = pattern(80, total);
    let region = cctx.alloc_region(total, gdaki::Access::ALL).unwrap();
    region.write(0, &data).unwrap();
    // SAFETY: the live queue pair's handle, read as plain data between posts.
    let reserved = || unsafe { c.queue_pair().device_handle().read_volatile() }.sq_reserved;
    let before = reserved();
    let mut at = 0;
    for &len in &lens {
        assert_eq!(c.send_from(&region, at as u64, len as u64).unwrap(), len);
        at += len;
    }
    assert_eq!(reserved() - before, lens.len() as u64, "WQEs for {} frames", lens.len());
    c.shutdown().unwrap();
    let got = read_to_end(&s, 999);
    assert!(got == data, "the stream differs ({} bytes of {total})", got.len());
}

/// A send from bytes its region does not hold, or from another context's region, is refused
/// before anything is posted, and the stream goes on.
#[test]
fn a_send_from_outside_its_region_or_context_is_refused_and_loses_nothing() {
    let (s, c, cctx) = pair_with_client_context(small(4096));
    let region = cctx.alloc_region(1000, gdaki::Access::ALL).unwrap();
    let other = Context::open(Provider::Soft).unwrap();
    let foreign = other.alloc_region(1000, gdaki::Access::ALL).unwrap();
    for (r, off, len) in [
        (&region, 900, 101),
        (&region, 1001, 0),
        (&region, u64::MAX, 2),
        (&foreign, 0, 10),
    ] {
        for outcome in [c.send_from(r, off, len), c.try_send_from(r, off, len)] {
            match outcome {
                Err(SocketFailure::BadSource(why)) => assert!(!why.is_empty()),
                other => panic!("send_from({off}, {len}) gave {other:?}"),
            }
        }
    }
    let msg = pattern(78, 5000);
    region.write(0, &msg[..1000]).unwrap();
    let reader = std::thread::spawn(move || read_to_end(&s, 999));
    assert_eq!(c.try_send_from(&region, 0, 1000).unwrap(), 1000);
    c.send_all(&msg[1000..]).unwrap();
    c.shutdown().unwrap();
    assert!(reader.join().unwrap() == msg, "the stream after the refusals differs");
}

/// A key the HCA refuses (here one no region has) fails the queue pair: the socket's next
/// wait says the connection is lost; nothing panics.
#[test]
fn a_send_from_an_unknown_key_loses_the_connection_with_an_error() {
    let (_s, c) = pair(small(4096));
    // SAFETY: the client's handle, alive for the test; this thread is its only user.
    let dev = unsafe { gdaki_device::socket::Socket::<gdaki_device::Exclusive>::from_raw(c.device_handle()) }.unwrap();
    let bogus = gdaki_device::Local {
        addr: 0x1000,
        lkey: 0xdead_beef,
    };
    assert_eq!(dev.send_from(bogus, 64).unwrap(), 64, "the send is posted");
    match dev.flush() {
        Err(gdaki_device::socket::SocketError::Lost(_)) => {}
        other => panic!("flush after a refused key gave {other:?}"),
    }
}

/// A block of 34 CPU threads sends a stream from registered memory (its leader posts after
/// the block's barrier; no member copies).
#[test]
fn a_block_sends_from_registered_memory() {
    use gdaki_device::scope::Group;
    let (s, c, cctx) = pair_with_client_context(small(4096));
    let data = pattern(79, 100_000);
    let region = cctx.alloc_region(data.len(), gdaki::Access::ALL).unwrap();
    region.write(0, &data).unwrap();
    let reader = std::thread::spawn(move || read_to_end(&s, 3000));
    let group = Group::new(34).unwrap();
    let (handle, src) = (c.device_handle() as usize, region.local(0));
    std::thread::scope(|block| {
        for r in 0..34 {
            let group = &group;
            block.spawn(move || {
                let me = group.block(r).unwrap();
                // SAFETY: the client's handle, alive for the scope; the block is its only user.
                let dev =
                    unsafe { gdaki_device::socket::Socket::<gdaki_device::Exclusive>::from_raw(handle as *mut _) }
                        .unwrap();
                for piece in 0..10u64 {
                    dev.send_all_from_with(me, src.offset(piece * 10_000), 10_000).unwrap();
                }
                dev.shutdown_with(me).unwrap();
                dev.flush_with(me).unwrap();
            });
        }
    });
    assert!(reader.join().unwrap() == data, "the block's stream differs");
}

/// A receive in place hands the reader the bytes where they landed and consumes what it
/// takes: a stream many rings long arrives whole through reads that take part of what they
/// see; a reader that claims more than it was given is refused and loses nothing; the end of
/// the stream is 0 without a call of the reader.
#[test]
fn a_receive_in_place_reads_the_stream_where_it_landed() {
    let (s, c) = pair(small(4096));
    let data = pattern(83, 60_000);
    let got = std::thread::scope(|scope| {
        scope.spawn(|| {
            c.send_all(&data).unwrap();
            c.shutdown().unwrap();
        });
        let mut got = Vec::new();
        // One refusal first: the bytes stay for the next read.
        let err = s.recv_in_place(3000, |b| b.len() + 1).unwrap_err();
        assert!(matches!(err, SocketFailure::BadArgument(_)), "{err:?}");
        for round in 0.. {
            let n = s
                .recv_in_place(3000, |b| {
                    assert!(!b.is_empty() && b.len() <= 3000, "a view of {} bytes", b.len());
                    // Every third read takes all it sees, the others a part.
                    let take = if round % 3 == 0 { b.len() } else { b.len().div_ceil(2) };
                    got.extend_from_slice(&b[..take]);
                    take
                })
                .unwrap();
            if n == 0 {
                break;
            }
        }
        // Ended: the reader is not called.
        assert_eq!(s.recv_in_place(3000, |_| panic!("called at the end")).unwrap(), 0);
        got
    });
    assert!(got == data, "the stream read in place differs");
}

/// In place and copied receives mix in one stream, and `try_recv_in_place` never waits.
#[test]
fn receives_in_place_and_copied_mix() {
    let (s, c) = pair(small(4096));
    assert!(matches!(
        s.try_recv_in_place(100, |b| b.len()),
        Err(SocketFailure::WouldBlock)
    ));
    c.send_all(b"hello, world").unwrap();
    let mut first = Vec::new();
    let n = s
        .recv_in_place(5, |b| {
            first.extend_from_slice(b);
            b.len()
        })
        .unwrap();
    assert_eq!((n, first.as_slice()), (5, &b"hello"[..]));
    let mut buf = [0u8; 3];
    assert_eq!(s.recv(&mut buf).unwrap(), 3);
    assert_eq!(&buf, b", w");
    // A reader may take nothing: the bytes stay.
    assert_eq!(s.try_recv_in_place(100, |_| 0).unwrap(), 0);
    let mut rest = Vec::new();
    s.try_recv_in_place(100, |b| {
        rest.extend_from_slice(b);
        b.len()
    })
    .unwrap();
    assert_eq!(rest, b"orld");
}

/// The device calls refuse a view that is not the stream's next bytes (consumed already,
/// received since, another socket's) or a count past it, consuming nothing.
#[test]
fn a_view_that_is_not_the_streams_next_bytes_is_refused() {
    use gdaki_device::socket::{Socket as Dev, SocketError};
    let (s1, c1) = pair(small(4096));
    let (s2, c2) = pair(small(4096));
    c1.send_all(&pattern(1, 100)).unwrap();
    c2.send_all(&pattern(2, 100)).unwrap();
    // SAFETY: the servers' handles, alive for the test; this thread is their only user.
    let (d1, d2) = unsafe {
        (
            Dev::<gdaki_device::Exclusive>::from_raw(s1.device_handle()).unwrap(),
            Dev::<gdaki_device::Exclusive>::from_raw(s2.device_handle()).unwrap(),
        )
    };
    let view = d1.peek(1000).unwrap();
    assert_eq!(view.len(), 100);
    // SAFETY: the latest peek, not consumed, read by the thread that peeked.
    assert!(unsafe { view.bytes() } == pattern(1, 100).as_slice());
    let other = d2.peek(1000).unwrap();
    assert_eq!(
        d1.consume(&other, 1),
        Err(SocketError::BadArgument),
        "another socket's view"
    );
    assert_eq!(d1.consume(&view, 101), Err(SocketError::BadArgument), "past the view");
    d1.consume(&view, 40).unwrap();
    assert_eq!(d1.consume(&view, 10), Err(SocketError::BadArgument), "consumed already");
    let next = d1.peek(1000).unwrap();
    assert_eq!((next.len(), next.addr()), (60, view.addr() + 40));
    let mut buf = [0u8; 10];
    assert_eq!(d1.recv(&mut buf).unwrap(), 10);
    assert_eq!(d1.consume(&next, 1), Err(SocketError::BadArgument), "received since");
    // Nothing was lost: the rest of each stream is where it was.
    let mut rest = [0u8; 50];
    assert_eq!(d1.recv(&mut rest).unwrap(), 50);
    assert!(rest[..] == pattern(1, 100)[50..]);
    assert_eq!(d2.recv(&mut [0u8; 100]).unwrap(), 100);
    // The C ABI's consume (no view: the next bytes looked at again) refuses bytes that have
    // not landed, and takes those that have.
    let me = gdaki_device::scope::Thread;
    assert_eq!(
        d2.consume_next_with(me, 1),
        Err(SocketError::BadArgument),
        "nothing landed"
    );
    c2.send_all(b"abc").unwrap();
    assert_eq!(d2.peek(3).unwrap().len(), 3);
    assert_eq!(
        d2.consume_next_with(me, 4),
        Err(SocketError::BadArgument),
        "past what landed"
    );
    d2.consume_next_with(me, 2).unwrap();
    let mut last = [0u8; 1];
    assert_eq!(d2.recv(&mut last).unwrap(), 1);
    assert_eq!(&last, b"c");
}

/// A block of 34 CPU threads reads a stream in place: every member gets the same view, the
/// members check their shares, the block consumes after its barrier.
#[test]
fn a_block_reads_a_stream_in_place() {
    use gdaki_device::scope::Group;
    use std::sync::Mutex;
    let (s, c) = pair(small(4096));
    let data = pattern(97, 80_000);
    let got = Mutex::new(Vec::new());
    let group = Group::new(34).unwrap();
    let handle = s.device_handle() as usize;
    std::thread::scope(|block| {
        for r in 0..34u32 {
            let (group, got, data) = (&group, &got, &data);
            block.spawn(move || {
                let me = group.block(r).unwrap();
                // SAFETY: the server's handle, alive for the scope; the block is its only user.
                let dev =
                    unsafe { gdaki_device::socket::Socket::<gdaki_device::Exclusive>::from_raw(handle as *mut _) }
                        .unwrap();
                let mut at = 0usize;
                loop {
                    let view = dev.peek_with(me, 2500).unwrap();
                    if view.is_empty() {
                        break;
                    }
                    // SAFETY: the block's latest peek, not consumed, read after it returned.
                    let bytes = unsafe { view.bytes() };
                    for (i, &b) in bytes.iter().enumerate().skip(r as usize).step_by(34) {
                        assert_eq!(b, data[at + i], "member {r}, stream byte {}", at + i);
                    }
                    if r == 0 {
                        got.lock().unwrap().extend_from_slice(bytes);
                    }
                    dev.consume_with(me, &view, view.len()).unwrap();
                    at += view.len() as usize;
                }
            });
        }
        c.send_all(&data).unwrap();
        c.shutdown().unwrap();
    });
    assert!(*got.lock().unwrap() == data, "the block's stream differs");
}
