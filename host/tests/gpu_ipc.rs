//! GPU memory between two processes on one machine: WRITEs from device memory to a peer
//! process, and READs back into device memory, where the peer maps the allocation (CUDA IPC)
//! and moves the bytes with its own copier, or, where it refuses, the bytes travel. The peer is this test binary run a second time
//! (`peer_process`, which does nothing unless `GDAKI_GPU_IPC_PEER` is set). Without a GPU
//! the tests say they were skipped.
mod common;
use common::{gpu_or_skip, pattern, qp, PeerProcess, ReadVec};
use std::net::TcpListener;
use std::thread;
use std::time::Duration;

use gdaki::handshake::{Channel, Hello};
use gdaki::{Access, Context, ContextOptions, Provider, QpConfig};
use gdaki_device::{Exclusive, WaitError};
use gdaki_layout::Syndrome;
use gdaki_soft::copier::Copier;

const APP: &[u8] = b"gdaki gpu ipc test v1";
/// The requester's source and the peer's device target.
const LEN: usize = 4 << 20;
/// The peer's host-memory targets.
const HOST_LEN: usize = 64 << 10;

/// A listening soft context whose same-host connections take shared memory, with CUDA IPC
/// references as `ipc` says.
fn listening(ipc: bool) -> Context {
    let options = ContextOptions::default()
        .same_host_shared_memory(true)
        .same_host_cuda_ipc(ipc);
    let ctx = Context::open_with(Provider::Soft, options).unwrap();
    ctx.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    ctx
}

/// What the requester writes where (the peer checks it): `(target, offset in the target,
/// offset in the source, length)`; target 0 is the peer's device region, 1 its pinned host
/// region, 2 its plain host region.
fn writes() -> Vec<(usize, u64, u64, u64)> {
    let mut w = vec![(0, 0, 0, 65536)];
    // Odd sizes and offsets, one GPU copy each on the peer.
    w.extend((0..16u64).map(|k| (0, 65536 + k * 4096 + 3, k * 4096 + 7, 4093)));
    // Large (more than the copier's bounce buffer).
    w.push(OBSERVED);
    // Into host memory the peer's GPU maps (one GPU copy) and into plain host memory (bounced).
    w.push((1, 5, 11, 40_000));
    w.push((2, 9, 13, 30_000));
    w
}

/// The large WRITE of [`writes`] that the peer's observer checks once [`FLAG`] is set.
const OBSERVED: (usize, u64, u64, u64) = (0, 1 << 20, (1 << 20) + 1, (2 << 20) + 5);
/// A WRITE gathered from two ranges of the source (a message, then a 128-byte tail: a socket
/// frame's bytes and its padded trailer), into the peer's device region: `(offset in the
/// target, message offset in the source, its length, tail offset in the source, its length)`.
/// One copy with a tail on the peer's GPU where both ranges go as references.
const GATHERED: (u64, u64, u64, u64, u64) = ((3 << 20) + 4096, 9, 65536, (3 << 20) + 100, 128);
/// Where in the peer's device region the requester's inline flag goes, after every WRITE.
const FLAG: u64 = LEN as u64 - 16;

/// The peer process (runs only when spawned by the tests below): serves, then checks what it
/// was sent, and tells how many copies its copier was handed.
#[test]
fn peer_process() {
    let Ok(mode) = std::env::var("GDAKI_GPU_IPC_PEER") else {
        return;
    };
    common::log_from_env();
    if mode == "receive" {
        return receiving_peer();
    }
    if mode == "exit" {
        return exiting_peer();
    }
    let ordinal = std::env::var("GDAKI_GPU_IPC_PEER_GPU").map_or(0, |g| g.parse().unwrap());
    let gpu = gdaki::cuda::Gpu::open(ordinal).unwrap();
    let ctx = listening(mode == "on");
    let dev = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
    let pinned = ctx.alloc_pinned_region(&gpu, HOST_LEN, Access::ALL).unwrap();
    let host = ctx.alloc_region(HOST_LEN, Access::ALL).unwrap();
    let q = qp(&ctx, 64, QpConfig::default());
    let regions = vec![dev.remote_region(), pinned.remote_region(), host.remote_region()];
    // An observer on this GPU: once the requester's flag lands, it copies what the large WRITE
    // before the flag wrote, which must be all there (the flag is stored after the copies).
    let (_, at, from, len) = OBSERVED;
    let seen = gdaki::cuda::DeviceBuffer::zeroed(&gpu, len as usize).unwrap();
    let observer = gpu.context().new_stream().unwrap();
    gpu.context().bind_to_thread().unwrap();
    // SAFETY: the flag word and both ranges lie in live allocations of this GPU, which outlive
    // the stream's work (synchronised below).
    unsafe {
        use gdaki::cuda::{stream_wait_u32, StreamWait};
        stream_wait_u32(&observer, dev.remote(FLAG).addr, StreamWait::Geq, 1).unwrap();
        cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
            seen.device_addr(),
            dev.remote(at).addr,
            len as usize,
            observer.cu_stream(),
        )
        .result()
        .unwrap();
    }
    let mut ch = serve_hello(&q, regions);
    ch.sync(1).unwrap();
    ch.sync(2).unwrap();
    // Copies this side's copier was handed without waiting: the references (a bounced WRITE
    // waits for its copies and is not counted). Read before the checks below use the copier.
    let copies = Copier::existing(&gpu).map_or(0, |c| c.stats().copies);
    eprintln!("peer: copier copies {copies}");
    let src = pattern(5, LEN);
    let targets = [&dev, &pinned, &host];
    let mut ok = true;
    for (t, at, from, len) in writes() {
        let got = targets[t].read_vec(at, len as usize).unwrap();
        if got[..] != src[from as usize..(from + len) as usize] {
            eprintln!("peer: target {t} at {at}: {len} bytes differ");
            ok = false;
        }
    }
    let (at_g, from_g, len_g, tail_g, tail_len) = GATHERED;
    let got = dev.read_vec(at_g, (len_g + tail_len) as usize).unwrap();
    let want = [
        &src[from_g as usize..][..len_g as usize],
        &src[tail_g as usize..][..tail_len as usize],
    ]
    .concat();
    if got != want {
        eprintln!("peer: the gathered WRITE differs");
        ok = false;
    }
    // The signal of the put_signal, after its put.
    ok &= dev.load_u64(LEN as u64 - 8).unwrap() == 1;
    observer.synchronize().unwrap();
    let mut got = vec![0u8; len as usize];
    seen.read(0, &mut got).unwrap();
    if got[..] != src[from as usize..(from + len) as usize] {
        eprintln!("peer: the flag landed before the WRITE before it");
        ok = false;
    }
    // The flag (inline bytes into device memory) was a store by the copier, whichever way the
    // WRITEs before it came.
    let stores = Copier::existing(&gpu).map_or(0, |c| c.stats().stores);
    if stores == 0 {
        eprintln!("peer: the flag was not a copier store");
        ok = false;
    }
    send_verdict(&mut ch, ok, copies);
}

/// The peer's verdict (`"<ok> <copies>"`), then it stays until the requester is done with it
/// (the test kills it).
fn send_verdict(ch: &mut Channel, ok: bool, copies: u64) {
    ch.send(&Hello {
        app: format!("{ok} {copies}").into_bytes(),
        endpoints: vec![],
        regions: vec![],
    })
    .unwrap();
    thread::sleep(Duration::from_secs(60));
}

/// What the SEND test sends: `(offset in the source, length, scatter)`: the receive at
/// `k * RECV_SLOT` of the peer's device region takes it whole, or in two pieces of which the
/// first is `scatter` bytes.
fn sends() -> Vec<(u64, u64, Option<u32>)> {
    let mut s = vec![(0, 65536, None)];
    s.extend((0..12u64).map(|k| (k * 4096 + 7, 4093 + k * 1000, (k % 3 == 0).then_some(1000 + k as u32))));
    s.push(((1 << 20) + 1, (1 << 20) + 5, Some(4096)));
    s
}
/// Where the peer's receives start, `RECV_SLOT` bytes apart (the second piece at +RECV_SLOT/2).
const RECV_SLOT: u64 = 2 << 20;
const RECEIVES: usize = 14;

/// The peer of the SEND test: a queue pair with a receive queue, a receive per message of
/// `sends()` posted in device memory before the requester starts, each message checked where
/// it landed; then it tells how many copies its copier was handed.
fn receiving_peer() {
    let gpu = gdaki::cuda::Gpu::open(0).unwrap();
    let ctx = listening(true);
    let dev = ctx
        .alloc_device_region(&gpu, RECEIVES * RECV_SLOT as usize, Access::ALL)
        .unwrap();
    let cfg = QpConfig {
        receive: Some(gdaki::ReceiveConfig { size: 16, max_bufs: 2 }),
        ..QpConfig::default()
    };
    let q = qp(&ctx, 64, cfg);
    let mut ch = serve_hello(&q, vec![]);
    // SAFETY: this thread is the only receiver; the QP outlives it.
    let rx = unsafe { q.cpu_receive::<Exclusive>() }.unwrap();
    let posted: Vec<u64> = sends()
        .iter()
        .enumerate()
        .map(|(k, &(_, len, scatter))| {
            let base = k as u64 * RECV_SLOT;
            let bufs = match scatter {
                None => vec![gdaki_device::RecvBuf {
                    local: dev.local(base),
                    len: len as u32,
                }],
                Some(first) => vec![
                    gdaki_device::RecvBuf {
                        local: dev.local(base),
                        len: first,
                    },
                    gdaki_device::RecvBuf {
                        local: dev.local(base + RECV_SLOT / 2),
                        len: RECV_SLOT as u32 / 2,
                    },
                ],
            };
            rx.post_recv(&bufs).unwrap()
        })
        .collect();
    ch.sync(1).unwrap();
    let got: Vec<_> = posted.iter().map(|&r| rx.poll(r)).collect();
    // Copies handed to this side's copier (read before the checks below use it).
    let copies = Copier::existing(&gpu).map_or(0, |c| c.stats().copies);
    let src = pattern(5, LEN);
    let mut ok = true;
    for (k, (got, &(from, len, scatter))) in got.iter().zip(&sends()).enumerate() {
        if got.as_ref().map(|g| g.bytes as u64) != Ok(len) {
            eprintln!("peer: receive {k}: {got:?}, {len} bytes sent");
            ok = false;
            continue;
        }
        let base = k as u64 * RECV_SLOT;
        let first = scatter.map_or(len, |f| f as u64);
        let mut bytes = dev.read_vec(base, first as usize).unwrap();
        if scatter.is_some() {
            bytes.extend(dev.read_vec(base + RECV_SLOT / 2, (len - first) as usize).unwrap());
        }
        if bytes[..] != src[from as usize..(from + len) as usize] {
            eprintln!("peer: receive {k}: {len} bytes differ");
            ok = false;
        }
    }
    ch.sync(2).unwrap();
    send_verdict(&mut ch, ok, copies);
}

/// SENDs from device memory to a peer process on the same GPU: the first carries its bytes
/// (and the allocation's offer), every later one is a CUDA IPC reference that the peer's
/// copier copies into the receive's buffers (a copy per piece, scattered ones too), and the
/// sender's completions come once they have landed. Before, every SEND's bytes went through
/// host memory on both sides.
#[test]
fn sends_from_device_memory_go_to_a_peer_process_as_references() {
    let test = "sends_from_device_memory_go_to_a_peer_process_as_references";
    let Some((gpu, _one)) = gpu_or_skip(test) else {
        return;
    };
    let peer = spawn_peer("receive", 0);
    let ctx = listening(true);
    let src = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
    src.write(0, &pattern(5, LEN)).unwrap();
    let q = qp(&ctx, 64, QpConfig::default());
    let (mut ch, theirs) = peer.hello(APP, &q);
    q.connect(&theirs.endpoints[0]).unwrap();
    ch.sync(1).unwrap();
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
    let all = sends();
    // The first SEND carries its bytes and the offer; waiting for it also waits for the
    // peer's answer, which comes before its acknowledgement.
    dev.wait(dev.send(src.local(all[0].0), all[0].1).unwrap()).unwrap();
    let posted = || Copier::existing(&gpu).unwrap().stats().posted;
    let before = posted();
    for &(from, len, _) in &all[1..] {
        dev.send(src.local(from), len).unwrap();
    }
    dev.quiet().unwrap();
    assert_eq!(
        posted() - before,
        0,
        "this side's copier read SEND bytes sent as references"
    );
    ch.sync(2).unwrap();
    let verdict = String::from_utf8(ch.receive().expect("the peer's verdict").app).unwrap();
    let (ok, copies) = verdict.split_once(' ').unwrap();
    assert_eq!(ok, "true", "the peer received other messages than were sent");
    let pieces: u64 = all[1..].iter().map(|&(_, _, s)| if s.is_some() { 2 } else { 1 }).sum();
    assert_eq!(
        copies.parse::<u64>().unwrap(),
        pieces,
        "copies the peer's copier was handed"
    );
}

/// The peer's side of the handshake: says its port (`PORT <n>`), takes the requester's hello,
/// answers with `q`'s endpoint and `regions`, and connects `q`.
fn serve_hello(q: &gdaki::QueuePair, regions: Vec<gdaki::wire::RemoteRegion>) -> Channel {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("PORT {}", listener.local_addr().unwrap().port());
    let mut ch = Channel::accept(&listener, Duration::from_secs(30)).unwrap();
    let theirs = ch.receive().unwrap();
    ch.send(&Hello {
        app: APP.to_vec(),
        endpoints: vec![q.endpoint()],
        regions,
    })
    .unwrap();
    q.connect(&theirs.endpoints[0]).unwrap();
    ch
}

/// The peer, in `mode`, with its memory on GPU `gpu`.
fn spawn_peer(mode: &str, gpu: usize) -> PeerProcess {
    PeerProcess::spawn(&[
        ("GDAKI_GPU_IPC_PEER", mode),
        ("GDAKI_GPU_IPC_PEER_GPU", &gpu.to_string()),
    ])
}

/// Which request with a key the peer never gave ends a run (it fails the QP).
#[derive(Clone, Copy, PartialEq)]
enum Bad {
    Write,
    Read,
}

/// Runs the writes against a peer in `mode` ("on": it maps offered allocations; "off": it
/// refuses them) from a requester with CUDA IPC `ipc`, then reads every written range back
/// into another allocation of device memory here (each READ after the WRITEs it reads), and
/// checks those bytes; returns how many copies the peer's copier was handed and how many
/// descriptors this side's copier ran for the writes and reads after the first of each. The
/// requester's memory is on GPU 0, the peer's on GPU `peer_gpu`.
fn run(test: &str, mode: &str, ipc: bool, bad: Bad, peer_gpu: usize) -> Option<(u64, u64)> {
    let (gpu, _one) = gpu_or_skip(test)?;
    if peer_gpu > 0 && !common::has_gpus(test, peer_gpu + 1) {
        return None;
    }
    let peer = spawn_peer(mode, peer_gpu);
    let ctx = listening(ipc);
    let src = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
    src.write(0, &pattern(5, LEN)).unwrap();
    let back = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
    let scratch = ctx.alloc_pinned_region(&gpu, 4096, Access::ALL).unwrap();
    let q = qp(&ctx, 64, QpConfig::default());
    let (mut ch, theirs) = peer.hello(APP, &q);
    q.connect(&theirs.endpoints[0]).unwrap();
    ch.sync(1).unwrap();
    let at = |t: usize, off: u64| theirs.regions[t].at(off).unwrap();
    // SAFETY: one poster (this thread); the QP outlives it.
    let dev = unsafe { q.cpu::<Exclusive>() }.unwrap();
    let w = writes();
    // The first WRITE from the allocation carries its bytes (and its offer); waiting for it
    // also waits for the peer's answer, which comes before its acknowledgement.
    let (t, off, from, len) = w[0];
    dev.wait(dev.put(at(t, off), src.local(from), len).unwrap()).unwrap();
    // So does the first READ into the other allocation (its bytes and its offer).
    dev.wait(dev.get(back.local(from), at(t, off), len).unwrap()).unwrap();
    let posted = || Copier::existing(&gpu).unwrap().stats().posted;
    let before = posted();
    for &(t, off, from, len) in &w[1..] {
        dev.put(at(t, off), src.local(from), len).unwrap();
    }
    let (at_g, from_g, len_g, tail_g, tail_len) = GATHERED;
    let i = dev.reserve(1).unwrap();
    let parts = ((src.local(from_g), len_g as u32), (src.local(tail_g), tail_len as u32));
    dev.wqe_prepare_write_gather(i, at(0, at_g), parts.0, parts.1, 0);
    dev.mark_ready(i, i + 1).unwrap();
    dev.submit(i + 1).unwrap();
    // The peer's observer waits for this flag, then checks the WRITEs before it landed.
    dev.put_inline(at(0, FLAG), &1u32.to_ne_bytes()).unwrap();
    // Each range back where it came from in `src`, through the peer's memory.
    for &(t, off, from, len) in &w[1..] {
        dev.get(back.local(from), at(t, off), len).unwrap();
    }
    // A put and its signal (an atomic, which the peer executes after the put's copy).
    let signal = dev
        .put_signal(at(0, 0), src.local(0), 8, at(0, LEN as u64 - 8), 1, scratch.local(0))
        .unwrap();
    dev.wait(signal).unwrap();
    dev.quiet().unwrap();
    let ran = posted() - before;
    ch.sync(2).unwrap();
    let verdict = String::from_utf8(ch.receive().expect("the peer's verdict").app).unwrap();
    let (ok, copies) = verdict.split_once(' ').unwrap();
    assert_eq!(ok, "true", "the peer found other bytes than were sent");
    let want = pattern(5, LEN);
    for &(t, off, from, len) in &w {
        let got = back.read_vec(from, len as usize).unwrap();
        let (from, len) = (from as usize, len as usize);
        assert!(
            got[..] == want[from..from + len],
            "{len} bytes read from target {t} at {off} differ"
        );
    }
    // A reference to a key the peer never gave: refused like any WRITE or READ (and the QP
    // fails).
    let wrong = gdaki_device::Remote {
        rkey: theirs.regions[0].rkey ^ 0x55,
        ..at(0, 0)
    };
    let refused = match bad {
        Bad::Write => dev.wait(dev.put(wrong, src.local(0), 64).unwrap()),
        Bad::Read => dev.wait(dev.get(back.local(0), wrong, 64).unwrap()),
    };
    match refused {
        Err(WaitError::Cqe(e)) => assert_eq!(e.syndrome, Syndrome::RemoteAccess),
        other => panic!("a request with a bad rkey: {other:?}"),
    }
    Some((copies.parse().unwrap(), ran))
}

/// The run with references both ways, checking that they carried every byte (the peer's memory
/// on GPU `peer_gpu`).
fn references(test: &str, bad: Bad, peer_gpu: usize) {
    let Some((copies, ran)) = run(test, "on", true, bad, peer_gpu) else {
        return;
    };
    // Every WRITE after the first, the gathered one and the signal's put, was one copy on the
    // peer's GPU, and so was every READ after the first, but the ones to and from plain host
    // memory (bounced, not counted); none touched this side's memory here.
    let after_the_first = writes().len() as u64 - 1;
    let bounced = 1; // into plain host memory
    let (gathered, signal) = (1, 1);
    assert_eq!(
        copies,
        2 * (after_the_first - bounced) + gathered + signal,
        "copies the peer's copier was handed"
    );
    assert_eq!(
        ran, 0,
        "this side's copier moved bytes of WRITEs or READs sent as references"
    );
}

/// The peer of the exit test: starts its GPU's copier, lets its handle go without stopping it
/// (as an exit that ends the thread holding the last handle would), and ends.
fn exiting_peer() {
    let gpu = gdaki::cuda::Gpu::open(0).unwrap();
    let copier = Copier::of(&gpu).unwrap();
    std::mem::forget(copier);
    eprintln!("peer: leaving with the copier running");
}

/// A process that exits while its copier kernel runs stops the kernel on the way out, rather
/// than leaving it to the driver's teardown. The peer says so in its log.
#[test]
fn a_process_stops_its_copier_as_it_exits() {
    let Some((_gpu, _one)) = gpu_or_skip("a_process_stops_its_copier_as_it_exits") else {
        return;
    };
    let out = PeerProcess::command(&[("GDAKI_GPU_IPC_PEER", "exit"), ("RUST_LOG", "gdaki_soft::copier=debug")])
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the peer failed: {log}");
    let left = log
        .find("leaving with the copier running")
        .expect("the peer did not get to its end");
    assert!(
        log[left..].contains("GPU copier stopped"),
        "the copier was still running at exit: {log}"
    );
}

#[test]
fn device_memory_goes_to_a_peer_process_as_a_reference_its_copier_reads() {
    references(
        "device_memory_goes_to_a_peer_process_as_a_reference_its_copier_reads",
        Bad::Write,
        0,
    );
}

#[test]
fn a_read_into_device_memory_is_a_reference_the_peer_process_fills() {
    references(
        "a_read_into_device_memory_is_a_reference_the_peer_process_fills",
        Bad::Read,
        0,
    );
}

/// A peer process whose memory is on another GPU of this machine maps the requester's
/// allocations into its own GPU (P2P over NVLink or PCIe): its copier pulls every WRITE and
/// pushes every READ GPU to GPU, and no byte goes through host memory here.
#[test]
fn a_peer_process_on_another_gpu_copies_gpu_to_gpu() {
    references("a_peer_process_on_another_gpu_copies_gpu_to_gpu", Bad::Write, 1);
}

#[test]
fn a_peer_that_refuses_the_mapping_gets_the_bytes() {
    let Some((copies, ran)) = run(
        "a_peer_that_refuses_the_mapping_gets_the_bytes",
        "off",
        true,
        Bad::Read,
        0,
    ) else {
        return;
    };
    assert_eq!(copies, 0, "the peer's copier was handed references it refused");
    assert!(ran > 0, "the bytes were read out of device memory here");
}

#[test]
fn without_cuda_ipc_the_bytes_travel() {
    let Some((copies, ran)) = run("without_cuda_ipc_the_bytes_travel", "on", false, Bad::Write, 0) else {
        return;
    };
    assert_eq!(copies, 0);
    assert!(ran > 0);
}
