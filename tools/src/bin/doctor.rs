//! `doctor`: tells a newcomer whether this machine can run gdaki, and how: GPUs, kernels, RDMA
//! devices, GPU-memory registration, and what `auto` would choose. Exit status 0 when gdaki can
//! run in some mode (and every `--require` holds), 1 otherwise. `--json`'s schema is in the
//! README ("Two commands"): every probe reads `{"ok", "value" | "error"}`.
use std::process::ExitCode;

use clap::Parser;
use gdaki::cuda::{self, CudaInfo, Gpu, SelftestReport};
use gdaki::ptx::{self, PtxSummary};
use gdaki::system::{self, RdmaDevice};
use gdaki::{Context, ContextOptions, DeviceReport, ExecutionMode, Provider, Selection};
use serde::{Serialize, Serializer};

#[derive(Parser, Debug)]
#[command(name = "doctor", version, about = "Can this machine run gdaki, and how?")]
struct Args {
    /// Print one JSON object instead of the report.
    #[arg(long)]
    json: bool,
    /// Skip launching the self-test kernel on each GPU.
    #[arg(long)]
    no_selftest: bool,
    /// Fail (exit 1) unless this is available: `gpu` (kernels run on a GPU) or `mlx5` (an mlx5
    /// RDMA device). May be repeated.
    #[arg(long, value_parser = ["gpu", "mlx5"])]
    require: Vec<String>,
    /// Provider to resolve as `auto` would (`auto`, `soft`, `mlx5`).
    #[arg(long, default_value = "auto")]
    provider: Provider,
    /// Log more (also `RUST_LOG`).
    #[arg(short, long)]
    verbose: bool,
}

/// A probe's outcome in `--json`: `{"ok": true, "value": ...}` or `{"ok": false, "error": "..."}`.
fn outcome<T: Serialize, S: Serializer>(r: &Result<T, String>, s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Outcome<'a, T> {
        ok: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        value: Option<&'a T>,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<&'a str>,
    }
    match r {
        Ok(v) => Outcome {
            ok: true,
            value: Some(v),
            error: None,
        },
        Err(e) => Outcome {
            ok: false,
            value: None,
            error: Some(e.as_str()),
        },
    }
    .serialize(s)
}

#[derive(Serialize)]
struct Report {
    gdaki_version: &'static str,
    #[serde(serialize_with = "outcome")]
    cuda: Result<CudaInfo, String>,
    #[serde(serialize_with = "outcome")]
    ptx: Result<PtxSummary, String>,
    selftests: Vec<GpuSelftest>,
    /// Whether a GPU exports its memory as dma-buf (how a NIC reaches GPU memory).
    dma_buf: bool,
    libibverbs: bool,
    libmlx5: bool,
    rdma_devices: Vec<RdmaDevice>,
    /// Each device opened as gdaki opens it (every mlx5 device, and the soft device), with
    /// what gdaki needs of it and a verdict per requirement.
    devices: Vec<DeviceCheck>,
    nvidia_peermem: bool,
    /// gdrcopy (CPU mapping of GPU memory): its library's version, or why it is not there.
    #[serde(serialize_with = "outcome")]
    gdrcopy: Result<String, String>,
    selection: Selection,
    /// The verdict, and the exit status: no requirement failed.
    can_run: bool,
    /// `--require`d items, and `mlx5` where the mlx5 provider was asked for, that are missing.
    failed_requirements: Vec<String>,
}

#[derive(Serialize)]
struct DeviceCheck {
    /// The device (`mlx5_0`, `soft`).
    name: String,
    /// What it has, when it opened.
    report: Option<DeviceReport>,
    /// Why it did not open.
    error: Option<String>,
}

impl DeviceCheck {
    /// Opens `name` with `provider` as a context would.
    fn open(provider: Provider, name: &str) -> DeviceCheck {
        let options = ContextOptions::from_env().device(name);
        match Context::open_with(provider, options) {
            Ok(ctx) => DeviceCheck {
                name: name.into(),
                report: Some(ctx.device_report()),
                error: None,
            },
            Err(e) => DeviceCheck {
                name: name.into(),
                report: None,
                error: Some(format!("{e:#}")),
            },
        }
    }
}

#[derive(Serialize)]
struct GpuSelftest {
    ordinal: usize,
    #[serde(serialize_with = "outcome")]
    result: Result<SelftestReport, String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    gdaki_tools::init_tracing(args.verbose);
    let report = examine(&args);
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("doctor: cannot encode the report: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print_report(&report);
    }
    if report.can_run {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn examine(args: &Args) -> Report {
    let cuda = cuda::probe().map_err(|e| e.to_string());
    let ptx = ptx::ptx().map(PtxSummary::parse).map_err(|e| e.to_string());
    let mut selftests = Vec::new();
    if let (Ok(info), Ok(_), false) = (&cuda, &ptx, args.no_selftest) {
        for gpu in &info.gpus {
            let result = Gpu::open(gpu.ordinal)
                .and_then(|g| g.selftest(4096))
                .map_err(|e| e.to_string());
            selftests.push(GpuSelftest {
                ordinal: gpu.ordinal,
                result,
            });
        }
    }
    let gpu_usable = match (&cuda, &ptx) {
        (Ok(info), Ok(_)) if !info.gpus.is_empty() => args.no_selftest || selftests.iter().any(|t| t.result.is_ok()),
        _ => false,
    };
    let rdma_devices = system::rdma_devices();
    let mut devices: Vec<DeviceCheck> = rdma_devices
        .iter()
        .filter(|d| d.mlx5)
        .map(|d| DeviceCheck::open(Provider::Mlx5, &d.name))
        .collect();
    devices.push(DeviceCheck::open(Provider::Soft, "soft"));
    let selection = Selection::resolve(args.provider, &rdma_devices, gpu_usable);
    let mlx5 = rdma_devices.iter().any(|d| d.mlx5);
    // The soft provider in CPU mode needs nothing beyond this binary; the mlx5 provider, asked
    // for by name, needs a device as `--require mlx5` does. The verdict is the exit status.
    let mut needed: Vec<String> = args.require.clone();
    if selection.provider == Provider::Mlx5 {
        needed.push("mlx5".into());
    }
    let mut failed_requirements = Vec::new();
    for req in needed {
        let ok = match req.as_str() {
            "gpu" => gpu_usable,
            _ => mlx5,
        };
        if !ok && !failed_requirements.contains(&req) {
            failed_requirements.push(req);
        }
    }
    let can_run = failed_requirements.is_empty();
    let dma_buf = cuda.as_ref().is_ok_and(|i| i.gpus.iter().any(|g| g.dma_buf));
    Report {
        gdaki_version: env!("CARGO_PKG_VERSION"),
        dma_buf,
        cuda,
        ptx,
        selftests,
        libibverbs: system::library_loadable("libibverbs.so.1"),
        libmlx5: system::library_loadable("libmlx5.so.1"),
        rdma_devices,
        devices,
        nvidia_peermem: system::nvidia_peermem_loaded(),
        gdrcopy: cuda::gdr::Gdr::open()
            .map(|g| format!("libgdrapi {}.{} with gdrdrv", g.version().0, g.version().1))
            .map_err(|e| e.to_string()),
        selection,
        can_run,
        failed_requirements,
    }
}

fn yes_no(b: bool, yes: &str, no: &str) -> String {
    if b {
        yes.to_string()
    } else {
        no.to_string()
    }
}

/// One device like `ibv_devinfo` shows it, then each requirement with its verdict.
fn print_device(d: &DeviceCheck) {
    let Some(rep) = &d.report else {
        println!("  {}: cannot be opened: {}", d.name, d.error.as_deref().unwrap_or("?"));
        return;
    };
    println!(
        "  {}: port {} {}, MTU {}, GID[{}] {}{}",
        rep.name,
        rep.port,
        rep.link_layer,
        rep.mtu,
        rep.gid_index,
        rep.gid,
        if rep.link_layer == "InfiniBand" {
            format!(", LID {:#x}", rep.lid)
        } else {
            String::new()
        }
    );
    for q in &rep.requirements {
        let verdict = match (q.met, q.without.is_empty()) {
            (true, _) => "ok".to_string(),
            (false, true) => "MISSING: gdaki cannot use this device".to_string(),
            (false, false) => format!("limited: {}", q.without),
        };
        println!("    {:<26} {:<40} {verdict}", q.what, q.found);
    }
}

fn print_report(r: &Report) {
    println!("gdaki doctor (gdaki {})", r.gdaki_version);
    println!("\nGPU");
    match &r.cuda {
        Ok(info) => {
            println!(
                "  driver:          loaded, supports CUDA {}.{}",
                info.driver_version / 1000,
                info.driver_version % 1000 / 10
            );
            if info.gpus.is_empty() {
                println!("  GPUs:            none");
            }
            for g in &info.gpus {
                println!(
                    "  GPU {}:           {} (sm_{}{}), {:.1} GiB, {} SMs, PCI {}",
                    g.ordinal,
                    g.name,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.total_memory as f64 / (1u64 << 30) as f64,
                    g.multiprocessors,
                    g.pci_address
                );
                println!(
                    "                   GPUDirect RDMA {}, dma-buf export {}",
                    yes_no(g.gpudirect_rdma, "supported", "not supported"),
                    yes_no(g.dma_buf, "supported", "not supported")
                );
                println!(
                    "                   stream memory operations (--stream, gdaki::stream): {}",
                    match g.stream_memops_missing {
                        None => "supported".to_string(),
                        Some(what) => format!("not supported: no {what}"),
                    }
                );
                println!(
                    "                   GPUDirect RDMA writes ordering: {}{}",
                    g.rdma_writes_ordering,
                    if g.rdma_writes_ordering.owner_sees_writes_in_order() {
                        " (fetched data is read at its completion)"
                    } else {
                        " (READs and fetching atomics end with a fenced DUMP; flag polling on peer writes is unsafe)"
                    }
                );
            }
        }
        Err(e) => println!("  none: {e}"),
    }
    match &r.ptx {
        Ok(s) => println!(
            "  kernels (PTX):   built in: PTX {} for {}, {} entry points{}",
            s.version,
            s.target,
            s.entries.len(),
            yes_no(s.unresolved.is_empty(), "", ", UNRESOLVED EXTERNALS")
        ),
        Err(e) => println!("  kernels (PTX):   missing: {e}"),
    }
    if r.ptx.is_ok() {
        match ptx::sass_arch() {
            Some(arch) => println!("  kernels (SASS):  built in for {arch}: such GPUs load them without compiling the PTX"),
            None => println!("  kernels (SASS):  none (no ptxas at build time, or GDAKI_SASS=off): GPUs compile the PTX on first use"),
        }
    }
    for t in &r.selftests {
        match &t.result {
            Ok(s) => println!(
                "  self-test GPU {}: ok ({} threads ran {}, {:.0} us)",
                t.ordinal, s.threads, s.kernel, s.elapsed_us
            ),
            Err(e) => println!("  self-test GPU {}: FAILED: {e}", t.ordinal),
        }
    }
    println!("\nRDMA");
    println!(
        "  libibverbs.so.1: {}",
        yes_no(
            r.libibverbs,
            "present",
            "missing (install libibverbs1 / ibverbs-providers)"
        )
    );
    println!(
        "  libmlx5.so.1:    {}",
        yes_no(r.libmlx5, "present", "missing (install ibverbs-providers)")
    );
    if r.rdma_devices.is_empty() {
        println!(
            "  devices:         none ({} is empty or absent)",
            system::SYSFS_INFINIBAND
        );
    }
    for d in &r.rdma_devices {
        println!(
            "  {}:{}{} {}{} fw {}",
            d.name,
            " ".repeat(16usize.saturating_sub(d.name.len() + 1)),
            yes_no(d.mlx5, "mlx5", "not mlx5"),
            d.hca_type,
            yes_no(d.driver.is_empty(), String::new().as_str(), &format!(" ({})", d.driver)),
            if d.fw_ver.is_empty() { "?" } else { &d.fw_ver }
        );
        for p in &d.ports {
            println!(
                "                   port {}: {} {} {}",
                p.number, p.state, p.link_layer, p.rate
            );
        }
    }
    println!("\nDevices as gdaki opens them");
    for d in &r.devices {
        print_device(d);
    }
    println!("\nGPU memory registration (for the mlx5 provider)");
    let dma_buf = r
        .cuda
        .as_ref()
        .map(|i| i.gpus.iter().any(|g| g.dma_buf))
        .unwrap_or(false);
    println!(
        "  dma-buf:         {}",
        yes_no(dma_buf, "available", "unavailable (no GPU reports it)")
    );
    println!(
        "  nvidia_peermem:  {}",
        yes_no(r.nvidia_peermem, "loaded", "not loaded")
    );
    println!("  soft provider:   needs neither (it copies GPU payloads itself)");
    match &r.gdrcopy {
        Ok(v) => println!(
            "  gdrcopy:         {v}: the library's CPU reads and writes of GPU memory go through BAR1{}",
            if cuda::gdr::turned_off() {
                " (turned off here: GDAKI_GDRCOPY=0)"
            } else {
                ""
            }
        ),
        Err(why) => {
            println!("  gdrcopy:         not present: {why} (the CPU reads and writes GPU memory with CUDA copies)")
        }
    }
    println!("\nWhat `auto` chooses");
    println!("  provider:        {}", r.selection.provider);
    println!("  mode:            {}", r.selection.mode);
    let rings = match r.selection.handler {
        gdaki::DoorbellHandler::Gpu => "the posting thread rings the doorbell itself",
        gdaki::DoorbellHandler::CpuProxy => "a CPU proxy thread rings it for the poster",
    };
    println!("  doorbell:        {} ({rings})", r.selection.handler);
    if gdaki::ContextOptions::from_env().models_unmappable_doorbell() {
        println!(
            "                   {} is set: the soft HCA models an unmappable doorbell page, so GPU exports fall \
             back to the CPU proxy",
            gdaki::ContextOptions::UNMAPPABLE_DOORBELL_VAR
        );
    }
    println!("  why:             {}", r.selection.reason);
    println!();
    if r.can_run {
        let how = match r.selection.mode {
            ExecutionMode::Gpu => "GPU kernels post",
            ExecutionMode::Cpu => "CPU mode: CPU threads post",
        };
        println!(
            "verdict: gdaki can run here ({} provider, {how}).",
            r.selection.provider
        );
    } else {
        println!("verdict: gdaki cannot run as asked here.");
    }
    for req in &r.failed_requirements {
        let why = match req.as_str() {
            "gpu" => "no usable GPU (see GPU above)",
            _ => "no mlx5 RDMA device in /sys/class/infiniband (--provider soft runs without one)",
        };
        println!("required but unavailable: {req}: {why}");
    }
}
