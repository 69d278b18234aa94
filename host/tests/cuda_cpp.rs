//! CUDA C++ kernels calling gdaki's C ABI (`gdaki_device.h`), linked with gdaki's device code
//! both ways an embedder can: at run time (NVRTC with `-rdc=true`, then the driver's linker,
//! [`Gpu::link_module`]) and ahead of time (`tools/cuda/build-device-lib.sh` makes
//! `libgdaki_device.a`, `nvcc -rdc` links the kernels against it, [`Gpu::load_image`] loads
//! the result). The kernels are in `tests/cuda/c_abi.cu`; what they wrote is checked here. The
//! NCCL GIN-shaped C++ handle (`gdaki_gin.cuh`) is run the first way, from `tests/cuda/gin.cu`,
//! and so are two-sided verbs (receives, SENDs, immediates) from `tests/cuda/two_sided.cu`
//! sockets (echo servers, clients, refusals) from `tests/cuda/socket.cu`, and counters
//! (a companion QP's WAIT and atomic add) from `tests/cuda/counters.cu`.
//! Needs a GPU (prints SKIPPED without one); the nvcc way also needs nvcc.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{gpu_or_skip, loopback_qp, pattern, qp as new_qp};
use gdaki::cuda::{Args, DeviceBuffer, Dims, Gpu, LinkInput, Module};
use gdaki::{Access, Context, Provider, QpConfig};

const KERNELS: &str = include_str!("cuda/c_abi.cu");
const GIN_KERNELS: &str = include_str!("cuda/gin.cu");
const TWO_SIDED_KERNELS: &str = include_str!("cuda/two_sided.cu");
const SOCKET_KERNELS: &str = include_str!("cuda/socket.cu");
const COUNTER_KERNELS: &str = include_str!("cuda/counters.cu");
const HEADERS: [(&str, &str); 6] = [
    ("gdaki_device.h", include_str!("../../device/include/gdaki_device.h")),
    (
        "gdaki_gin_host.h",
        include_str!("../../device/include/gdaki_gin_host.h"),
    ),
    (
        "gdaki_layout_check.h",
        include_str!("../../device/include/gdaki_layout_check.h"),
    ),
    ("gdaki_gin.cuh", include_str!("../../device/include/gdaki_gin.cuh")),
    ("gdaki_p2p.cuh", include_str!("../../device/include/gdaki_p2p.cuh")),
    ("gdaki_test_check.h", include_str!("cuda/gdaki_test_check.h")),
];
const BUILD_LIB: &str = include_str!("../../tools/cuda/build-device-lib.sh");

/// A scratch directory holding the headers and the kernels' source.
fn workdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gdaki-cuda-cpp-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (file, text) in HEADERS {
        std::fs::write(dir.join(file), text).unwrap();
    }
    std::fs::write(dir.join("c_abi.cu"), KERNELS).unwrap();
    dir
}

/// The GPU's architecture as nvcc and NVRTC spell it.
fn arch(gpu: &Gpu) -> String {
    let (major, minor) = gpu.compute_capability().unwrap();
    format!("sm_{major}{minor}")
}

/// `source` compiled by NVRTC (`-rdc`, the headers in a scratch directory named after `name`)
/// and linked at run time with gdaki's device code.
fn nvrtc_linked(gpu: &Gpu, name: &str, source: &str) -> Module {
    let dir = workdir(name);
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(Box::leak(arch(gpu).into_boxed_str())),
        include_paths: vec![dir.display().to_string()],
        options: vec!["-rdc=true".into(), "-std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).unwrap_or_else(|e| panic!("NVRTC: {e:?}"));
    gpu.link_module(&[LinkInput::Ptx(&ptx.to_src()), LinkInput::GdakiDevice])
        .unwrap()
}

/// Runs the three kernels of `module` against a loopback QP and checks their data.
fn run_kernels(gpu: &Gpu, module: &Module) {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(&ctx, 256, QpConfig::default());
    let mr = ctx.alloc_pinned_region(gpu, 1 << 17, Access::ALL).unwrap();
    let data = pattern(11, 4096);
    mr.write(0, &data).unwrap();
    let exported = qp.export_gpu(gpu).unwrap();
    let status = DeviceBuffer::zeroed(gpu, 4 * 256).unwrap();
    let out = DeviceBuffer::zeroed(gpu, 16).unwrap();
    let args = || {
        Args::new()
            .qp(&exported)
            .region(&mr)
            .u32(mr.rkey())
            .u32(mr.lkey())
            .buffer(&status)
    };
    let codes = |n: usize| {
        let mut raw = vec![0u8; 4 * n];
        status.read(0, &mut raw).unwrap();
        raw.chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect::<Vec<_>>()
    };
    let read = |at: u64, len: usize| {
        let mut v = vec![0u8; len];
        mr.read(at, &mut v).unwrap();
        v
    };
    // The kernels' status words say `line << 16 | code` for the first check that failed.
    // SAFETY (each launch): the kernel's parameters are what `args` pushes, the QP is used by
    // this launch alone, and the region and buffers hold what the kernel touches.
    unsafe {
        module
            .kernel("cpp_thread_ops")
            .unwrap()
            .run(Dims::linear(1, 1), args().buffer(&out))
    }
    .unwrap();
    assert_eq!(codes(1), [0], "cpp_thread_ops: status is line << 16 | code");
    assert_eq!(read(4096, 64), data[..64], "put");
    assert_eq!(read(65536, 64), data[..64], "fenced get of the put");
    assert_eq!(&read(8192, 11), b"c++ inline\0", "deferred inline put, committed");
    assert_eq!(read(8448, 32), data[..32], "put_signal");
    let mut fetched = [0u8; 16];
    out.read(0, &mut fetched).unwrap();
    assert_eq!(
        fetched,
        [[0u8; 8], 5u64.to_le_bytes()].concat()[..],
        "fetch-add then CAS"
    );
    assert_eq!(read(120016, 8), 77u64.to_le_bytes(), "the CAS swapped");

    unsafe { module.kernel("cpp_warp_put").unwrap().run(Dims::linear(1, 32), args()) }.unwrap();
    assert_eq!(codes(32), [0; 32], "cpp_warp_put");
    for t in 0..32 {
        assert_eq!(read(16384 + 64 * t, 64), data[64 * t as usize..][..64], "warp lane {t}");
    }
    unsafe {
        module
            .kernel("cpp_block_put")
            .unwrap()
            .run(Dims::linear(1, 256), args())
    }
    .unwrap();
    assert_eq!(codes(256), [0; 256], "cpp_block_put");
    for t in 0..256u64 {
        let src = 64 * (t % 64) as usize;
        assert_eq!(read(32768 + 64 * t, 64), data[src..src + 64], "block thread {t}");
    }
}

#[test]
fn nvrtc_kernels_linked_at_run_time() {
    let Some((gpu, _one)) = gpu_or_skip("nvrtc_kernels_linked_at_run_time") else {
        return;
    };
    let dir = workdir("nvrtc");
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(Box::leak(arch(&gpu).into_boxed_str())),
        include_paths: vec![dir.display().to_string()],
        options: vec!["-rdc=true".into(), "-std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts.clone()).unwrap_or_else(|e| panic!("NVRTC: {e:?}"));
    // With CUDA's include directory on the path the header takes libcu++'s fixed-width types.
    let cuda_include = "/usr/local/cuda/include";
    if Path::new(cuda_include).exists() {
        let mut with = opts;
        with.include_paths.push(cuda_include.into());
        cudarc::nvrtc::compile_ptx_with_opts(KERNELS, with).unwrap_or_else(|e| panic!("NVRTC with libcu++: {e:?}"));
    }
    let module = gpu
        .link_module(&[LinkInput::Ptx(&ptx.to_src()), LinkInput::GdakiDevice])
        .unwrap();
    run_kernels(&gpu, &module);
    // A module calling a function nobody defines is refused with the linker's words.
    let err = gpu
        .link_module(&[LinkInput::Ptx(&ptx.to_src())])
        .unwrap_err()
        .to_string();
    assert!(err.contains("gdaki_"), "the linker names the missing function: {err}");
}

fn nvcc() -> Option<PathBuf> {
    let found = Command::new("sh").args(["-c", "command -v nvcc"]).output().ok()?;
    let path = String::from_utf8_lossy(&found.stdout).trim().to_string();
    let path = if path.is_empty() {
        "/usr/local/cuda/bin/nvcc".into()
    } else {
        path
    };
    Path::new(&path).exists().then(|| path.into())
}

fn sh(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn nvcc_rdc_kernels_linked_against_libgdaki_device() {
    let Some((gpu, _one)) = gpu_or_skip("nvcc_rdc_kernels_linked_against_libgdaki_device") else {
        return;
    };
    let Some(nvcc) = nvcc() else {
        eprintln!("SKIPPED (no nvcc): nvcc_rdc_kernels_linked_against_libgdaki_device");
        return;
    };
    let dir = workdir("nvcc");
    std::fs::write(dir.join("gdaki_device_c.ptx"), gdaki::ptx::c_abi_ptx().unwrap()).unwrap();
    std::fs::write(dir.join("build-device-lib.sh"), BUILD_LIB).unwrap();
    let arch = arch(&gpu);
    sh(Command::new("bash")
        .arg(dir.join("build-device-lib.sh"))
        .arg(dir.join("gdaki_device_c.ptx"))
        .arg(&dir)
        .env("NVCC", &nvcc)
        .env("GDAKI_CUDA_ARCH", &arch));
    sh(Command::new(&nvcc).current_dir(&dir).args([
        &format!("-arch={arch}"),
        "-std=c++17",
        "-dc",
        "-I.",
        "c_abi.cu",
        "-o",
        "c_abi.o",
    ]));
    sh(Command::new(&nvcc).current_dir(&dir).args([
        &format!("-arch={arch}"),
        "-dlink",
        "-cubin",
        "c_abi.o",
        "-L.",
        "-lgdaki_device",
        "-o",
        "linked.cubin",
    ]));
    let image = std::fs::read(dir.join("linked.cubin")).unwrap();
    let module = gpu
        .load_image(&image, &["cpp_thread_ops", "cpp_warp_put", "cpp_block_put"])
        .unwrap();
    run_kernels(&gpu, &module);
}

#[test]
fn gin_handle_two_pes_in_thread_warp_and_block_scope() {
    let Some((gpu, _one)) = gpu_or_skip("gin_handle_two_pes_in_thread_warp_and_block_scope") else {
        return;
    };
    let module = nvrtc_linked(&gpu, "gin", GIN_KERNELS);

    // Two PEs: QP 0 (PE 0's, to PE 1) and QP 1 (PE 1's, to PE 0), connected to each other.
    let ctx = Context::open(Provider::Soft).unwrap();
    let (q0, q1) = (
        new_qp(&ctx, 1024, QpConfig::default()),
        new_qp(&ctx, 1024, QpConfig::default()),
    );
    q0.connect(&q1.endpoint()).unwrap();
    q1.connect(&q0.endpoint()).unwrap();
    let (e0, e1) = (q0.export_gpu(&gpu).unwrap(), q1.export_gpu(&gpu).unwrap());
    let mr = ctx.alloc_pinned_region(&gpu, 1 << 18, Access::ALL).unwrap();
    let data = pattern(17, 4096);
    mr.write(0, &data).unwrap();
    let status = DeviceBuffer::zeroed(&gpu, 4 * 256).unwrap();
    let launch = |kernel: &str, threads: u32, map: bool| {
        status.write(0, &[0xff; 4 * 256]).unwrap();
        let args = Args::new()
            .qps(&[&e0, &e0])
            .qps(&[&e1, &e1])
            .region(&mr)
            .u32(mr.rkey())
            .u32(mr.lkey())
            .buffer(&status)
            .u32(map.into());
        // SAFETY: the kernel's parameters are what `args` pushes; the QPs are used by this
        // launch alone; the region and the status buffer hold what the kernel touches.
        unsafe { module.kernel(kernel).unwrap().run(Dims::linear(1, threads), args) }.unwrap();
        let mut raw = vec![0u8; 4 * threads as usize];
        status.read(0, &mut raw).unwrap();
        let codes: Vec<u32> = raw
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(
            codes,
            vec![0; threads as usize],
            "{kernel} (map {map}): status is line << 16 | code"
        );
    };
    let read = |at: u64, len: usize| {
        let mut v = vec![0u8; len];
        mr.read(at, &mut v).unwrap();
        v
    };
    let signal = |pe: u64, id: u64| mr.load_u64(131072 + 512 * pe + 8 * id).unwrap();
    const PE1: u64 = 65536;

    // Through queue pairs, then again with every peer's windows mapped (load/store only: the
    // kernels drop the queue pairs between the PEs), from a clean slate.
    for map in [false, true] {
        mr.write(4096, &vec![0; (1 << 18) - 4096]).unwrap();
        launch("gin_thread", 1, map);
        assert_eq!(read(PE1, 4096), data, "put to PE 1 (map {map})");
        assert_eq!(
            read(PE1 + 8192, 8),
            0x1122334455667788u64.to_le_bytes(),
            "put_value u64 (map {map})"
        );
        assert_eq!(read(PE1 + 8200, 4), 0xa5a5a5a5u32.to_le_bytes(), "put_value u32");
        assert_eq!(read(16384, 256), data[..256], "PE 1 put back to PE 0 (map {map})");
        assert_eq!([signal(1, 0), signal(1, 1), signal(1, 2)], [1, 5, 9], "signals at PE 1");
        assert_eq!(signal(0, 0), 0, "nothing signalled PE 0");

        // A coop makes one operation: one put, one value, one signal add each.
        launch("gin_warp", 32, map);
        assert_eq!(read(PE1 + 32768, 2048), data[..2048], "warp put (map {map})");
        assert_eq!(read(PE1 + 34816, 8), 0x0f0e0d0c0b0a0908u64.to_le_bytes(), "warp value");
        assert_eq!(read(PE1 + 34824, 8), [0; 8], "nothing past the value (map {map})");
        assert_eq!(signal(1, 3), 2, "one add per warp call (map {map})");

        launch("gin_block", 256, map);
        assert_eq!(read(PE1 + 40960, 4096), data, "block put (map {map})");
        assert_eq!(
            read(PE1 + 45059, 1000),
            data[3..1003],
            "block put at odd offsets (map {map})"
        );
        assert_eq!(
            (read(PE1 + 45058, 1), read(PE1 + 46059, 1)),
            (vec![0], vec![0]),
            "nothing around it (map {map})"
        );
        assert_eq!(signal(1, 4), 12, "one add per block call (map {map})");
    }

    launch("gin_mixed", 1, false);
    assert_eq!(
        read(PE1 + 57344, 1000),
        data[..1000],
        "stores, then a signal through the QP"
    );
    assert_eq!(
        read(PE1 + 58368, 1000),
        data[1000..2000],
        "a put, then a signal by an atomic"
    );
    assert_eq!(read(PE1 + 59392, 8), 0x0102030405060708u64.to_le_bytes(), "put_value");
    assert_eq!([signal(1, 5), signal(1, 6)], [1, 4], "mixed signals");
}

#[test]
fn two_sided_verbs_in_thread_warp_and_block_scope() {
    let Some((gpu, _one)) = gpu_or_skip("two_sided_verbs_in_thread_warp_and_block_scope") else {
        return;
    };
    let module = nvrtc_linked(&gpu, "two-sided", TWO_SIDED_KERNELS);
    // A queue pair connected to itself, with 128 receives: what it sends, it receives.
    let ctx = Context::open(Provider::Soft).unwrap();
    let cfg = QpConfig {
        receive: Some(gdaki::ReceiveConfig { size: 128, max_bufs: 1 }),
        ..Default::default()
    };
    let qp = loopback_qp(&ctx, 256, cfg);
    let exported = qp.export_gpu(&gpu).unwrap();
    let rq = exported.receive_handle().expect("a receive queue");
    let mr = ctx.alloc_pinned_region(&gpu, 1 << 18, Access::ALL).unwrap();
    let data = pattern(23, 8192);
    mr.write(0, &data).unwrap();
    let posters = 128usize;
    let status = DeviceBuffer::zeroed(&gpu, 4 * posters).unwrap();
    let tickets = DeviceBuffer::zeroed(&gpu, 8 * posters).unwrap();
    let got = DeviceBuffer::zeroed(&gpu, 12 * posters).unwrap();
    let words = |b: &DeviceBuffer, n: usize| {
        let mut raw = vec![0u8; 4 * n];
        b.read(0, &mut raw).unwrap();
        raw.chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect::<Vec<_>>()
    };
    let run = |kernel: &str, blocks: u32, threads: u32, args: Args| {
        status.write(0, &vec![0xff; 4 * posters]).unwrap();
        // SAFETY: the kernel's parameters are what `args` pushes; the QP is used by this launch
        // alone; the region and buffers hold what the kernel touches.
        unsafe { module.kernel(kernel).unwrap().run(Dims::linear(blocks, threads), args) }.unwrap();
        let n = (blocks * threads) as usize;
        assert_eq!(words(&status, n), vec![0; n], "{kernel}: status is line << 16 | code");
    };
    run(
        "cpp_post_recvs",
        2,
        64,
        Args::new()
            .u64(rq)
            .region(&mr)
            .u32(mr.lkey())
            .buffer(&status)
            .buffer(&tickets),
    );
    run(
        "cpp_send_thread",
        1,
        1,
        Args::new()
            .qp(&exported)
            .region(&mr)
            .u32(mr.rkey())
            .u32(mr.lkey())
            .buffer(&status),
    );
    run(
        "cpp_send_warp",
        1,
        32,
        Args::new().qp(&exported).region(&mr).u32(mr.lkey()).buffer(&status),
    );
    run(
        "cpp_send_block",
        1,
        64,
        Args::new().qp(&exported).region(&mr).u32(mr.lkey()).buffer(&status),
    );
    // 4 messages from the thread, 32 from the warp, 64 from the block: 100 receives taken.
    let messages = 100usize;
    run(
        "cpp_poll_recvs",
        2,
        64,
        Args::new()
            .u64(rq)
            .buffer(&tickets)
            .u64(messages as u64)
            .buffer(&status)
            .buffer(&got),
    );
    let mut raw = vec![0u8; 8 * posters];
    tickets.read(0, &mut raw).unwrap();
    let tickets: Vec<u64> = raw
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let mut sorted = tickets.clone();
    sorted.sort();
    assert_eq!(sorted, (0..posters as u64).collect::<Vec<_>>(), "one ticket each");
    let got = words(&got, 3 * messages);
    let (send, send_imm, write_imm) = (0, 1, 2);
    for m in 0..messages {
        // The poster whose receive took message m, and so where its bytes are.
        let poster = tickets.iter().position(|&t| t == m as u64).unwrap() as u64;
        let buf = |len: usize| {
            let mut v = vec![0u8; len];
            mr.read(131072 + 256 * poster, &mut v).unwrap();
            v
        };
        let (bytes, kind, imm) = (got[3 * m], got[3 * m + 1], got[3 * m + 2]);
        match m {
            0 => {
                assert_eq!((bytes, kind), (100, send), "message 0");
                assert_eq!(buf(100), data[..100]);
            }
            1 => {
                assert_eq!((bytes, kind, imm), (7, send_imm, 0xabc), "message 1");
                assert_eq!(buf(7), data[100..107]);
            }
            2 => {
                assert_eq!((bytes, kind), (16, send), "message 2");
                assert_eq!(&buf(16), b"inline c++ send\0");
            }
            3 => {
                assert_eq!((bytes, kind, imm), (64, write_imm, 99), "message 3");
                let mut written = vec![0u8; 64];
                mr.read(200000, &mut written).unwrap();
                assert_eq!(written, data[200..264]);
            }
            4..36 => {
                let lane = m - 4;
                assert_eq!((bytes, kind, imm), (64, send_imm, lane as u32), "warp lane {lane}");
                assert_eq!(buf(64), data[64 * lane..64 * lane + 64], "warp lane {lane}");
            }
            _ => {
                let thread = m - 36;
                assert_eq!((bytes, kind), (32, send), "block thread {thread}");
                assert_eq!(buf(32), data[32 * thread..32 * thread + 32], "block thread {thread}");
            }
        }
    }
    assert_eq!(qp.error(), None);
}

/// Puts counted by a cross-channel companion (WAIT on the data QP's CQ, then an atomic add) in
/// thread, warp and block scope: the counter reaches the sum only once every put has
/// completed, and the data is there.
#[test]
fn counters_in_thread_warp_and_block_scope() {
    let Some((gpu, _one)) = gpu_or_skip("counters_in_thread_warp_and_block_scope") else {
        return;
    };
    let module = nvrtc_linked(&gpu, "counters", COUNTER_KERNELS);
    let ctx = Context::open(Provider::Soft).unwrap();
    let data_qp = loopback_qp(&ctx, 256, QpConfig::default());
    let comp = loopback_qp(
        &ctx,
        512,
        QpConfig {
            cross_channel: true,
            ..Default::default()
        },
    );
    let (data_dev, comp_dev) = (data_qp.export_gpu(&gpu).unwrap(), comp.export_gpu(&gpu).unwrap());
    let mr = ctx.alloc_pinned_region(&gpu, 1 << 18, Access::ALL).unwrap();
    let data = pattern(29, 8192);
    mr.write(0, &data).unwrap();
    let status = DeviceBuffer::zeroed(&gpu, 4 * 256).unwrap();
    let run = |kernel: &str, threads: u32, args: Args| {
        status.write(0, &[0xff; 4 * 256]).unwrap();
        // SAFETY: the kernel's parameters are what `args` pushes; the QPs are used by this
        // launch alone; the region holds what the kernel touches.
        unsafe { module.kernel(kernel).unwrap().run(Dims::linear(1, threads), args) }.unwrap();
        expect_ok(&status, 1, threads);
    };
    let args = || {
        Args::new()
            .qp(&data_dev)
            .qp(&comp_dev)
            .region(&mr)
            .u32(mr.rkey())
            .u32(mr.lkey())
            .buffer(&status)
    };
    run("cpp_count_thread", 1, args());
    assert_eq!(mr.load_u64(131072).unwrap(), 3, "thread scope: counted once done");
    run("cpp_count_warp", 32, args());
    run("cpp_count_block", 128, args());
    let want = 3 + 32 + 128;
    run(
        "cpp_await_count",
        1,
        Args::new().qp(&comp_dev).region(&mr).u64(want).buffer(&status),
    );
    assert_eq!(mr.load_u64(131072).unwrap(), want);
    let mut got = vec![0u8; 2148 + 32 * 128];
    mr.read(65536, &mut got).unwrap();
    assert_eq!(got, data[..got.len()], "every put landed before its count");
    assert_eq!((data_qp.error(), comp.error()), (None, None));

    // The data QP to error, reset and connected again: the same GPU export posts on (its
    // counters taken over and rewritten by the reset), counted as before.
    data_qp.to_error().unwrap();
    // SAFETY: no kernel runs on the QP until the connect has returned.
    unsafe { data_qp.reset() }.unwrap();
    data_qp.connect(&data_qp.endpoint()).unwrap();
    mr.write(65536, &[0; 100]).unwrap();
    run("cpp_count_thread", 1, args());
    assert_eq!(mr.load_u64(131072).unwrap(), want + 3, "counted after the reset");
    let mut again = vec![0u8; 100];
    mr.read(65536, &mut again).unwrap();
    assert_eq!(again, data[..100], "a put through the export after the reset");
    assert_eq!((data_qp.error(), comp.error()), (None, None));
}

/// Every thread of `blocks` blocks of `threads` left `GDAKI_OK` in `status` (else its
/// `line << 16 | code`, as `GDAKI_TEST_CHECK` writes it, is reported).
fn expect_ok(status: &DeviceBuffer, blocks: usize, threads: u32) {
    let mut raw = vec![0u8; 4 * threads as usize * blocks];
    status.read(0, &mut raw).unwrap();
    for (t, c) in raw.chunks(4).enumerate() {
        let c = u32::from_le_bytes(c.try_into().unwrap());
        assert_eq!(
            c,
            0,
            "block {} thread {}: line {} code {:#x}",
            t / threads as usize,
            t % threads as usize,
            c >> 16,
            c & 0xffff
        );
    }
}

#[test]
fn sockets_in_thread_warp_and_block_scope() {
    use gdaki::socket::{SocketConfig, SocketMemory};
    use std::time::Duration;
    let Some((gpu, _one)) = gpu_or_skip("sockets_in_thread_warp_and_block_scope") else {
        return;
    };
    let module = nvrtc_linked(&gpu, "sockets", SOCKET_KERNELS);
    let cfg = |memory| SocketConfig {
        rx_bytes: 8192,
        timeout: Duration::from_secs(30),
        memory,
        ..SocketConfig::default()
    };
    let (pinned, device, host) = (
        || cfg(SocketMemory::Pinned(gpu.clone())),
        || cfg(SocketMemory::Device(gpu.clone())),
        || cfg(SocketMemory::Host),
    );
    // Blocks 0 and 1 serve CPU clients (rings pinned, then in GPU memory), block 2 serves the
    // warp client of block 4, block 3 the thread client of block 5. Blocks 1 and 2 read in
    // place (role 3: the echo sent from where the bytes landed).
    let (s0, cpu0) = common::socket_pair(pinned(), host());
    let (s1, cpu1) = common::socket_pair(device(), host());
    let (s2, warp) = common::socket_pair(pinned(), device());
    let (s3, thread) = common::socket_pair(device(), pinned());
    let roles = [0u32, 3, 3, 0, 1, 2];
    let on_gpu: Vec<_> = [s0, s1, s2, s3, warp, thread]
        .into_iter()
        .map(|s| s.into_gpu(&gpu).unwrap())
        .collect();
    let handles = DeviceBuffer::zeroed(&gpu, 8 * on_gpu.len()).unwrap();
    let raw: Vec<u8> = on_gpu.iter().flat_map(|s| s.device_handle().to_le_bytes()).collect();
    handles.write(0, &raw).unwrap();
    let role_buf = DeviceBuffer::zeroed(&gpu, 4 * roles.len()).unwrap();
    role_buf
        .write(0, &roles.iter().flat_map(|r| r.to_le_bytes()).collect::<Vec<_>>())
        .unwrap();
    let (buf_len, msg_len, rounds, threads) = (4096u64, 3000u64, 40u32, 128u32);
    let bufs = DeviceBuffer::zeroed(&gpu, buf_len as usize * roles.len()).unwrap();
    let status = DeviceBuffer::zeroed(&gpu, 4 * threads as usize * roles.len()).unwrap();
    let echoed = DeviceBuffer::zeroed(&gpu, 8 * roles.len()).unwrap();
    // The CPU clients: each sends 100,000 bytes while it reads the echo, then closes.
    let stream = pattern(31, 100_000);
    std::thread::scope(|sc| {
        let clients: Vec<_> = [&cpu0, &cpu1]
            .into_iter()
            .map(|c| {
                let stream = &stream;
                sc.spawn(move || {
                    let sender = std::thread::scope(|inner| {
                        let sending = inner.spawn(|| {
                            c.send_all(stream).unwrap();
                            c.shutdown().unwrap();
                        });
                        let mut back = Vec::new();
                        let mut chunk = [0u8; 5000];
                        loop {
                            match c.recv(&mut chunk).unwrap() {
                                0 => break,
                                n => back.extend_from_slice(&chunk[..n]),
                            }
                        }
                        sending.join().unwrap();
                        back
                    });
                    c.flush().unwrap();
                    sender
                })
            })
            .collect();
        // SAFETY: the kernel's parameters are what the Args push; the sockets are this launch's
        // alone; the buffers hold what the kernel touches.
        unsafe {
            module.kernel("cpp_sockets").unwrap().run(
                Dims::linear(roles.len() as u32, threads),
                Args::new()
                    .buffer(&handles)
                    .buffer(&role_buf)
                    .buffer(&bufs)
                    .u64(buf_len)
                    .u64(msg_len)
                    .u32(rounds)
                    .buffer(&status)
                    .buffer(&echoed),
            )
        }
        .unwrap();
        for (i, c) in clients.into_iter().enumerate() {
            assert!(
                c.join().unwrap() == stream,
                "CPU client {i}: its echo differs from its stream"
            );
        }
    });
    expect_ok(&status, roles.len(), threads);
    let mut raw = vec![0u8; 8 * roles.len()];
    echoed.read(0, &mut raw).unwrap();
    let echoed: Vec<u64> = raw
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let warp_bytes = msg_len * rounds as u64;
    assert_eq!(
        echoed,
        [100_000, 100_000, warp_bytes, 11, warp_bytes, 11],
        "bytes each block echoed or checked"
    );
}

/// Connection set-up from a kernel through a socket service: one block listens and accepts,
/// another connects to it, in block scope; they echo 64 KiB through the sockets the service
/// made (rings in GPU memory), close and release them; a third block checks the refusals in
/// thread and warp scope. The service holds nothing afterwards.
#[test]
fn kernels_listen_accept_and_connect_through_a_socket_service() {
    use gdaki::socket::{SocketConfig, SocketMemory, SocketService};
    use std::time::Duration;
    let Some((gpu, _one)) = gpu_or_skip("kernels_listen_accept_and_connect_through_a_socket_service") else {
        return;
    };
    let module = nvrtc_linked(&gpu, "sockets", SOCKET_KERNELS);
    let ctx = Context::open(Provider::Soft).unwrap();
    let cfg = SocketConfig {
        rx_bytes: 16384,
        timeout: Duration::from_secs(30),
        memory: SocketMemory::Device(gpu.clone()),
        ..SocketConfig::default()
    };
    // The service starts the soft HCA's copy kernel for its GPU-memory rings, before the launch.
    let service = SocketService::start(&ctx, "127.0.0.1".parse().unwrap(), cfg).unwrap();
    // Port 1 (tcpmux): nothing listens there, and no port-0 listener can be given it.
    let closed: u16 = 1;
    let (threads, len) = (128u32, 65536u64);
    let status = DeviceBuffer::zeroed(&gpu, 4 * 3 * threads as usize).unwrap();
    status.write(0, &vec![0xff; 4 * 3 * threads as usize]).unwrap();
    let port_word = DeviceBuffer::zeroed(&gpu, 4).unwrap();
    let bufs = DeviceBuffer::zeroed(&gpu, 3 * 2 * len as usize).unwrap();
    let handle = service.device_handle();
    // SAFETY: the kernel's parameters are what the Args push; the service's handle lives for
    // the launch; the buffers hold what the kernel touches.
    unsafe {
        module.kernel("cpp_socket_service").unwrap().run(
            Dims::linear(3, threads),
            Args::new()
                .u64(handle)
                .buffer(&status)
                .buffer(&port_word)
                .buffer(&bufs)
                .u64(len)
                .u32(closed as u32),
        )
    }
    .unwrap();
    expect_ok(&status, 3, threads);
    assert_eq!(service.held(), (0, 0), "every socket released, every listener closed");
    assert_eq!(
        service.reap(),
        2,
        "the released GPU sockets are freed once no kernel runs"
    );
}
