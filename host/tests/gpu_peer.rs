//! Peer mappings: a region of device memory of another process on this host, mapped into this
//! process's GPU for loads and stores (`PeerExport`, `PeerMapping`). The peer is this test
//! binary run a second time (`peer_process`, which does nothing unless `GDAKI_PEER_MAP_PEER` is
//! set), on GPU 1 where there are two GPUs (the P2P path), else on GPU 0 (the same GPU). Without
//! a GPU the tests say they were skipped.
mod common;
use common::{gpu_or_skip, pattern, PeerProcess};
use std::io::Write as _;
use std::net::TcpListener;
use std::time::Duration;

use cudarc::driver::sys;
use gdaki::handshake::{Channel, Hello};
use gdaki::{Access, Context, PeerExport, PeerMapping, Provider, PEER_EXPORT_BYTES};

const LEN: usize = 1 << 20;
/// Where in the region the export starts (a region inside its allocation).
const SEED_PEER: u64 = 31;
const SEED_HERE: u64 = 77;

/// The peer process: exports a region of its device memory holding a pattern, then checks the
/// pattern the test wrote back through its mapping.
#[test]
fn peer_process() {
    let Ok(ordinal) = std::env::var("GDAKI_PEER_MAP_PEER") else {
        return;
    };
    common::log_from_env();
    let gpu = gdaki::cuda::Gpu::open(ordinal.parse().unwrap()).unwrap();
    let ctx = Context::open(Provider::Soft).unwrap();
    let region = ctx.alloc_device_region(&gpu, LEN, Access::ALL).unwrap();
    region.write(0, &pattern(SEED_PEER, LEN)).unwrap();
    let export = PeerExport::of(&region, &gpu).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("PORT {}", listener.local_addr().unwrap().port());
    let mut ch = Channel::accept(&listener, Duration::from_secs(30)).unwrap();
    let _ = ch.receive().unwrap();
    ch.send(&Hello {
        app: export.to_bytes().to_vec(),
        endpoints: vec![],
        regions: vec![],
    })
    .unwrap();
    // The test has read the pattern and written its own.
    ch.sync(1).unwrap();
    let mut got = vec![0u8; LEN];
    region.read(0, &mut got).unwrap();
    let ok = got == pattern(SEED_HERE, LEN);
    ch.send(&Hello {
        app: format!("{ok}").into_bytes(),
        endpoints: vec![],
        regions: vec![],
    })
    .unwrap();
    // Keeps the region until the test has unmapped it.
    ch.sync(2).unwrap();
}

/// Copies `len` bytes from device address `from` to host memory.
fn read_device(gpu: &gdaki::cuda::Gpu, from: u64, len: usize) -> Vec<u8> {
    gpu.context().bind_to_thread().unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: `out` has `len` writable bytes; `from..from + len` is mapped in this context.
    unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), from, len) }
        .result()
        .unwrap();
    out
}

fn write_device(gpu: &gdaki::cuda::Gpu, to: u64, data: &[u8]) {
    gpu.context().bind_to_thread().unwrap();
    // SAFETY: `data` is readable; `to..to + data.len()` is mapped in this context.
    unsafe { sys::cuMemcpyHtoD_v2(to, data.as_ptr().cast(), data.len()) }
        .result()
        .unwrap();
}

/// A process on this host maps another process's device memory into its GPU (the other GPU
/// where there are two, over P2P) and reads and writes it there: the owner sees the writes.
#[test]
fn a_peer_process_region_is_read_and_written_through_a_mapping() {
    let test = "a_peer_process_region_is_read_and_written_through_a_mapping";
    let Some((gpu, _one)) = gpu_or_skip(test) else {
        return;
    };
    let two = gdaki::cuda::probe().is_ok_and(|i| i.gpus.len() >= 2);
    let peer = PeerProcess::spawn(&[("GDAKI_PEER_MAP_PEER", if two { "1" } else { "0" })]);
    let mut ch = Channel::connect(
        std::net::SocketAddr::from(([127, 0, 0, 1], peer.port)),
        Duration::from_secs(30),
    )
    .unwrap();
    ch.send(&Hello::default()).unwrap();
    let theirs = ch.receive().unwrap();
    assert_eq!(theirs.app.len(), PEER_EXPORT_BYTES);
    let export = PeerExport::from_bytes(&theirs.app).unwrap();
    assert_eq!(export.len(), LEN as u64);
    let map = PeerMapping::open(&gpu, &export).unwrap();
    assert_eq!(map.len(), LEN as u64);
    assert!(
        read_device(&gpu, map.addr(), LEN) == pattern(SEED_PEER, LEN),
        "the mapping shows other bytes"
    );
    write_device(&gpu, map.addr(), &pattern(SEED_HERE, LEN));
    ch.sync(1).unwrap();
    let verdict = ch.receive().unwrap();
    assert_eq!(
        verdict.app, b"true",
        "the owner did not see what was written through the mapping"
    );
    drop(map);
    ch.sync(2).unwrap();
    eprintln!("{test}: peer on GPU {}", if two { 1 } else { 0 });
}

/// What cannot be mapped is refused with its reason: host memory, this process's own memory,
/// another GPU's region under the wrong GPU, an export from another host.
#[test]
fn what_cannot_be_mapped_is_refused_with_its_reason() {
    let Some((gpu, _one)) = gpu_or_skip("what_cannot_be_mapped_is_refused_with_its_reason") else {
        return;
    };
    let ctx = Context::open(Provider::Soft).unwrap();
    let host = ctx.alloc_region(4096, Access::ALL).unwrap();
    let e = PeerExport::of(&host, &gpu).unwrap_err().to_string();
    assert!(e.contains("host memory"), "{e}");
    let pinned = ctx.alloc_pinned_region(&gpu, 4096, Access::ALL).unwrap();
    let e = PeerExport::of(&pinned, &gpu).unwrap_err().to_string();
    assert!(e.contains("host memory"), "{e}");

    let dev = ctx.alloc_device_region(&gpu, 4096, Access::ALL).unwrap();
    let own = PeerExport::of(&dev, &gpu).unwrap();
    let e = PeerMapping::open(&gpu, &own).unwrap_err().to_string();
    assert!(e.contains("this process's own"), "{e}");

    // The same export said to come from another host (its boot id changed).
    let mut bytes = own.to_bytes();
    bytes[88] ^= 0xff;
    let e = PeerMapping::open(&gpu, &PeerExport::from_bytes(&bytes).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("another host"), "{e}");
}

/// A region write has landed when it returns: a read on a stream of its own (what a kernel on
/// another stream, or a peer process, would see) finds every byte. Fails where the write
/// returned with its last DMA still in flight (pageable `cuMemcpyHtoD`): the zeroing of a
/// gshmem block then landed over what peers stored into it.
#[test]
fn a_region_write_has_landed_when_it_returns() {
    let Some((gpu, _one)) = gpu_or_skip("a_region_write_has_landed_when_it_returns") else {
        return;
    };
    const BIG: usize = 64 << 20;
    let ctx = Context::open(Provider::Soft).unwrap();
    let region = ctx.alloc_device_region(&gpu, BIG, Access::ALL).unwrap();
    gpu.context().bind_to_thread().unwrap();
    let mut stream: sys::CUstream = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }
        .result()
        .unwrap();
    let mut host = vec![0u8; BIG];
    for round in 0..4u64 {
        let want = pattern(round + 1, BIG);
        region.write(0, &want).unwrap();
        // SAFETY: `host` has BIG writable bytes, the region BIG readable ones; the stream is live.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), region.addr(), BIG, stream)
                .result()
                .unwrap();
            sys::cuStreamSynchronize(stream).result().unwrap();
        }
        let first_wrong = host.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(first_wrong, None, "round {round}: the write had not landed");
    }
    // SAFETY: created above, destroyed once.
    unsafe { sys::cuStreamDestroy_v2(stream) }.result().unwrap();
}

/// put_bw's reference across two GPUs: a P2P copy to or from another GPU this one reaches,
/// refused with its reason for this GPU itself and for a GPU this process does not see.
#[test]
fn a_p2p_reference_copy_goes_to_another_gpu_or_says_why_not() {
    use gdaki::cuda::PeerDirection::{FromPeer, ToPeer};
    let test = "a_p2p_reference_copy_goes_to_another_gpu_or_says_why_not";
    let Some((gpu, _one)) = gpu_or_skip(test) else {
        return;
    };
    let mine = gdaki::cuda::gpu_uuid(gpu.context()).unwrap();
    let e = gpu.peer_copy(&mine, ToPeer, 4096, 4, 8).unwrap_err().to_string();
    assert!(e.contains("is this GPU"), "{e}");
    let e = gpu.peer_copy(&[0xee; 16], ToPeer, 4096, 4, 8).unwrap_err().to_string();
    assert!(e.contains("not visible"), "{e}");
    if !common::has_gpus(test, 2) {
        return;
    }
    let other = gdaki::cuda::Gpu::open(1).unwrap();
    let theirs = gdaki::cuda::gpu_uuid(other.context()).unwrap();
    if !gdaki::cuda::gpu_reaches(gpu.context(), &theirs) {
        let e = gpu.peer_copy(&theirs, ToPeer, 4096, 4, 8).unwrap_err().to_string();
        assert!(e.contains("no P2P path"), "{e}");
        return;
    }
    // A figure, not a check: back to back, each copy of this size costs the copy engines
    // about as long as its bytes take (tens of GB/s on NVLink), so speed proves no path.
    for direction in [ToPeer, FromPeer] {
        let took = gpu.peer_copy(&theirs, direction, 1 << 20, 8, 64).unwrap();
        assert!(took > std::time::Duration::ZERO, "{direction:?}");
        let gb_s = (64u64 << 20) as f64 / took.as_secs_f64() / 1e9;
        let _ = writeln!(
            std::io::stderr(),
            "P2P reference {direction:?}: 64 x 1 MiB in {took:?} ({gb_s:.1} GB/s)"
        );
    }
}
