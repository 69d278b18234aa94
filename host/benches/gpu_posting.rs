//! The device posting rate on a GPU: 8-byte puts posted by every thread of a full-GPU launch
//! into send queues no HCA consumes, in warp scope (one QP per warp), thread scope (one QP per
//! block, its threads sharing it) and block scope (one QP per block), with the rings in
//! host-pinned memory (the soft HCA's placement) and in device memory (mlx5's), each next to
//! two plain store loops into the same memory measured in the same run, each record the 48 bytes
//! an 8-byte put writes into its 64-byte slot (`perf::STORE_LOOP_SEGMENTS`): records
//! scattered over it, and records in ring order where the posts put their WQEs (a ring written
//! in order combines writes, which matters in host-pinned memory). Device rings run
//! twice: with the GPU-scope doorbell fences they get (`QP_RINGS_IN_GPU_MEMORY`), and with
//! system-scope fences as the reference for what that scope gains. Each shape runs
//! twice: a doorbell per post, and deferred posts with a commit every `--commit-every` posts
//! per thread (default: all of a thread's posts), so many posts share one doorbell.
//!
//! Every row runs twice more: the same kernels written in CUDA C++ against `gdaki_device.h`
//! (`benches/cuda/post_rate.cu`, NVRTC, linked with gdaki's C PTX at run time, so each gdaki
//! call is a real call), next to the Rust kernels' row of the same run (`c++ / rust`). With
//! `--clang-ptx FILE`, once more: the same source compiled by clang with gdaki's bitcode
//! inlined (`tools/cuda/clang-kernel.sh host/benches/cuda/post_rate.cu FILE`, on a machine with
//! clang-22; the GPU machine needs only the PTX), kernel `c++ clang`.
//!
//! `cargo bench -p gdaki --bench gpu_posting [-- --json] [--iters N] [--commit-every N]
//! [--clang-ptx FILE]`; without a usable GPU it says so and exits 0.
use gdaki::cuda::{
    self, DataPathLaunch, Gpu, KernelMode, KernelScope, LinkInput, Module, PostingKernels, PostingShape, RingPlacement,
};
use serde::Serialize;

const CPP_KERNELS: &str = include_str!("cuda/post_rate.cu");
const DEVICE_HEADER: &str = include_str!("../../device/include/gdaki_device.h");

/// The C++ posting kernels, compiled by NVRTC and linked with gdaki's C PTX.
fn cpp_module(gpu: &Gpu) -> anyhow::Result<Module> {
    let dir = std::env::temp_dir().join(format!("gdaki-bench-posting-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("gdaki_device.h"), DEVICE_HEADER)?;
    let (major, minor) = gpu.compute_capability()?;
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(Box::leak(format!("sm_{major}{minor}").into_boxed_str())),
        include_paths: vec![dir.display().to_string()],
        options: vec!["-rdc=true".into(), "-std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(CPP_KERNELS, opts).map_err(|e| anyhow::anyhow!("NVRTC: {e:?}"))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(gpu.link_module(&[LinkInput::Ptx(&ptx.to_src()), LinkInput::GdakiDevice])?)
}

#[derive(Serialize)]
struct Row {
    /// "rust" (gdaki's kernels), "c++" (benches/cuda/post_rate.cu, calls into gdaki's PTX) or
    /// "c++ clang" (the same, compiled by clang with gdaki inlined: `--clang-ptx`).
    kernel: &'static str,
    placement: RingPlacement,
    scope: &'static str,
    /// Posts per thread between doorbells (1: every post rings).
    commit_every: u32,
    qps: u32,
    threads: u64,
    wqes: u64,
    post_mwqe_s: f64,
    store_mrec_s: f64,
    post_vs_store: f64,
    /// The same stores in ring order, where the posts put their WQEs: the reference that
    /// write-combines as a ring does.
    ring_store_mrec_s: f64,
    post_vs_ring_store: f64,
    /// C++ rows: the posting rate over the Rust kernels' of the same shape.
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_rust: Option<f64>,
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let value = |name: &str| -> anyhow::Result<Option<u32>> {
        let v = args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
        Ok(v.map(|v| v.parse()).transpose()?)
    };
    let iters = value("--iters")?.unwrap_or(16);
    let clang_ptx = match args.iter().position(|a| a == "--clang-ptx") {
        Some(i) => {
            let path = args
                .get(i + 1)
                .ok_or_else(|| anyhow::anyhow!("--clang-ptx needs a file"))?;
            let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("--clang-ptx {path}: {e}"))?;
            Some(text)
        }
        None => None,
    };
    // The per-post row is always measured; the batched one needs at least two posts per commit.
    let commit_every = value("--commit-every")?.unwrap_or(iters).max(2);
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu_posting: SKIPPED (no usable GPU): {e}");
            return Ok(());
        }
    };
    let info = cuda::probe()?;
    let sms = info.gpus[0].multiprocessors.max(1) as u32;
    let (grid, block) = (sms * 2, 256u32);
    let warps = grid * block / 32;
    // (scope name, scope, mode, QPs, threads per QP in a row)
    let shapes = [
        ("warp", KernelScope::Warp, KernelMode::Exclusive, warps, 32),
        ("thread", KernelScope::Thread, KernelMode::Cta, grid, block),
        ("block", KernelScope::Block, KernelMode::Exclusive, grid, block),
    ];
    let module = cpp_module(&gpu)?;
    // SAFETY: post_rate.cu's kernels have gdaki's names and parameters and post as it does.
    let cpp = unsafe { PostingKernels::module(&module) };
    // The same source through clang, gdaki inlined: a module of its own, nothing to link.
    let clang_module = clang_ptx
        .as_deref()
        .map(|ptx| gpu.link_module(&[LinkInput::Ptx(ptx)]))
        .transpose()?;
    let mut kernel_sets = vec![("rust", PostingKernels::GDAKI), ("c++", cpp)];
    if let Some(m) = &clang_module {
        // SAFETY: as above (the same source).
        kernel_sets.push(("c++ clang", unsafe { PostingKernels::module(m) }));
    }
    let mut rows = Vec::new();
    for placement in [
        RingPlacement::HostPinned,
        RingPlacement::Device,
        RingPlacement::DeviceSystemFences,
    ] {
        for ((name, scope, mode, qps, stride), every) in shapes.iter().flat_map(|&s| [(s, 1), (s, commit_every)]) {
            eprintln!("gpu_posting: {placement:?}, {name} scope, a doorbell per {every} posts ...");
            let launch = DataPathLaunch {
                scope,
                mode,
                grid,
                block,
            };
            let mut rust_post = f64::NAN;
            for &(kernel, kernels) in &kernel_sets {
                let shape = PostingShape {
                    qps,
                    stride,
                    per_thread: iters,
                    commit_every: every,
                };
                let r = gpu.posting_rate(kernels, placement, launch, shape)?;
                let post = r.wqes as f64 / r.post.as_secs_f64() / 1e6;
                let store = r.wqes as f64 / r.store.as_secs_f64() / 1e6;
                let ring_store = r.wqes as f64 / r.ring_store.as_secs_f64() / 1e6;
                if kernel == "rust" {
                    rust_post = post;
                }
                let vs_rust = (kernel != "rust").then(|| post / rust_post);
                rows.push(Row {
                    kernel,
                    placement,
                    scope: name,
                    commit_every: every,
                    qps,
                    threads: grid as u64 * block as u64,
                    wqes: r.wqes,
                    post_mwqe_s: post,
                    store_mrec_s: store,
                    post_vs_store: post / store,
                    ring_store_mrec_s: ring_store,
                    post_vs_ring_store: post / ring_store,
                    vs_rust,
                });
            }
        }
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "gpu": info.gpus[0].name, "grid": grid, "block": block, "iters_per_thread": iters, "rows": rows
            }))?
        );
    } else {
        println!(
            "device posting rate, {} ({grid} blocks x {block} threads, {iters} 8-byte puts per thread)",
            info.gpus[0].name
        );
        println!(
            " kernel    placement            scope    doorbell per  QPs    WQEs       post [M WQE/s]   store loop [M rec/s]   post/store   ring order [M rec/s]   post/ring   c++/rust"
        );
        for r in &rows {
            println!(
                " {:<9} {:<20} {:<8} {:<13} {:<6} {:<10} {:>14.1} {:>22.1} {:>11.1}% {:>22.1} {:>10.1}% {:>10}",
                r.kernel,
                format!("{:?}", r.placement),
                r.scope,
                if r.commit_every <= 1 {
                    "post".to_string()
                } else {
                    format!("{} posts", r.commit_every)
                },
                r.qps,
                r.wqes,
                r.post_mwqe_s,
                r.store_mrec_s,
                100.0 * r.post_vs_store,
                r.ring_store_mrec_s,
                100.0 * r.post_vs_ring_store,
                r.vs_rust.map_or(String::new(), |v| format!("{:.1}%", 100.0 * v))
            );
        }
    }
    Ok(())
}
