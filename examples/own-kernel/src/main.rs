//! `own-kernel`: a kernel of your own on gdaki. The kernel crate (`kernels/`) depends on
//! `gdaki-device` and is built to PTX by `build.rs` with `gdaki-build`; this program opens a
//! context, connects a queue pair to itself, exports it to the GPU, loads the PTX and launches
//! `own_scatter` with typed arguments (the exported QP, the regions' operands, a status
//! buffer), then checks every byte. In CPU mode the same `scatter` runs on CPU threads.
use anyhow::{bail, Context as _, Result};
use clap::{Parser, ValueEnum};
use gdaki::cuda::{Args, DeviceBuffer, Dims, Gpu};
use gdaki::{Access, Context, MemoryRegion, Provider, QpConfig, QueuePair};

/// The PTX `build.rs` made (empty without the PTX toolchain).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/own_kernels.ptx"));

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// The GPU if one is usable and the PTX was built, else CPU threads.
    Auto,
    /// A GPU kernel.
    Gpu,
    /// CPU threads.
    Cpu,
}

/// Puts `--posters` chunks from one region to another with a kernel of your own, and checks them.
#[derive(Debug, Parser)]
struct Cli {
    /// Who runs the kernel.
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    mode: Mode,
    /// Posters (GPU threads or CPU threads), one chunk each.
    #[arg(long, default_value_t = 64)]
    posters: u32,
    /// Bytes per chunk.
    #[arg(long, default_value_t = 4096)]
    chunk: u64,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if !(1..=1024).contains(&cli.posters) || !(1..=1 << 20).contains(&cli.chunk) {
        bail!("--posters 1..=1024 and --chunk 1..=1048576");
    }
    let gpu = match cli.mode {
        Mode::Cpu => None,
        Mode::Gpu => Some(open_gpu()?),
        Mode::Auto => open_gpu().map_err(|e| eprintln!("own-kernel: CPU mode ({e:#})")).ok(),
    };
    let ctx = Context::open(Provider::Soft)?;
    let cq = ctx.create_cq(1024)?;
    let qp = ctx.create_qp(
        &cq,
        QpConfig {
            sq_size: 1024,
            ..Default::default()
        },
    )?;
    qp.connect(&qp.endpoint())?;
    let len = (cli.posters as u64 * cli.chunk) as usize;
    let alloc = |len| match &gpu {
        Some(g) => ctx.alloc_pinned_region(g, len, Access::ALL),
        None => ctx.alloc_region(len, Access::ALL),
    };
    let (src, dst) = (alloc(len)?, alloc(len)?);
    let data: Vec<u8> = (0..len).map(|i| (i * 131 + i / 4096) as u8).collect();
    src.write(0, &data)?;
    let codes = match &gpu {
        Some(g) => on_gpu(g, &qp, &src, &dst, &cli)?,
        None => on_cpu(&qp, &src, &dst, &cli)?,
    };
    if let Some((t, &c)) = codes.iter().enumerate().find(|(_, c)| **c != 0) {
        bail!("poster {t}: {}", gdaki_device::status::Code(c));
    }
    let mut got = vec![0u8; len];
    dst.read(0, &mut got)?;
    if got != data {
        let at = got.iter().zip(&data).position(|(a, b)| a != b).unwrap_or(0);
        bail!("byte {at} differs after the kernel ran");
    }
    println!(
        "own-kernel: {} chunks of {} B put by {} and verified",
        cli.posters,
        cli.chunk,
        match &gpu {
            Some(g) => format!("GPU kernel own_scatter (GPU {})", g.ordinal()),
            None => "CPU threads running scatter".into(),
        }
    );
    Ok(())
}

fn open_gpu() -> Result<Gpu> {
    if PTX.is_empty() {
        bail!("the kernels were not built to PTX (run tools/setup.sh, then build again)");
    }
    Gpu::open(0).context("GPU 0")
}

fn on_gpu(gpu: &Gpu, qp: &QueuePair, src: &MemoryRegion, dst: &MemoryRegion, cli: &Cli) -> Result<Vec<u32>> {
    let exported = qp.export_gpu(gpu)?;
    let module = gpu.load_module(PTX)?;
    let kernel = module.kernel("own_scatter")?;
    let status = DeviceBuffer::zeroed(gpu, 4 * cli.posters as usize)?;
    let args = Args::new()
        .qp(&exported)
        .remote(dst.remote(0))
        .local(src.local(0))
        .u64(cli.chunk)
        .buffer(&status);
    let block = cli.posters.min(128);
    if cli.posters % block != 0 {
        bail!(
            "--posters {}: above 128, a multiple of 128 (blocks of 128 threads)",
            cli.posters
        );
    }
    let grid = cli.posters / block;
    // SAFETY: own_scatter(qp, dst, rkey, src, lkey, chunk, status) is what `args` pushes; the
    // QP is used by this launch alone; the regions hold `chunk` bytes per thread and `status`
    // one u32 per thread.
    let took = unsafe { kernel.run(Dims::linear(grid, block), args) }?;
    eprintln!("own-kernel: kernel ran {:.1} us", took.as_secs_f64() * 1e6);
    let mut raw = vec![0u8; 4 * cli.posters as usize];
    status.read(0, &mut raw)?;
    Ok(raw
        .chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn on_cpu(qp: &QueuePair, src: &MemoryRegion, dst: &MemoryRegion, cli: &Cli) -> Result<Vec<u32>> {
    let (dst, src) = (dst.remote(0), src.local(0));
    std::thread::scope(|s| {
        let posters: Vec<_> = (0..cli.posters as u64)
            .map(|t| {
                s.spawn(move || -> Result<u32> {
                    // SAFETY: every poster shares the QP in GPU-wide mode, and the QP outlives
                    // the scope.
                    let q = unsafe { qp.cpu::<gdaki_device::Gpu>() }?;
                    Ok(own_kernel_kernels::scatter(q, dst, src, cli.chunk, t))
                })
            })
            .collect();
        posters
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a poster panicked"))?)
            .collect()
    })
}
