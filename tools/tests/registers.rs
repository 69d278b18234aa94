//! What calling each `extern "C"` device function costs a kernel in registers (issue: C++
//! kernels of 512 threads), measured with NVIDIA's `ptxas` and `nvlink` (`gdaki_tools::registers`)
//! for every function of the C ABI PTX, linked as `libgdaki_device.a` is (`-rdc`), in one
//! module with the kernel, and inlined into CUDA C++ probes by clang with gdaki's bitcode
//! (`tools/cuda/clang-kernel.sh`; clang-22, which `tools/setup.sh` installs). `tools/setup.sh`
//! unpacks both NVIDIA tools from PyPI's `nvidia-cuda-nvcc` (13.0.88, CUDA 13.0 as on the
//! device machine); without them, or without the PTX toolchain,
//! the test says SKIPPED. `GDAKI_CUDA_BIN` names another directory holding both.
//!
//! The ceilings below are the figures of 2026-11-27 (ptxas 13.0.88, sm_90): a change that needs
//! more registers fails here; one that needs fewer is said, so the ceilings follow it down.
//! `docs/cuda-cpp.md` has the table and the gap to the aim (<= 128 a thread, 512-thread blocks).
use std::io::Write as _;
use std::path::PathBuf;

use gdaki_tools::registers::{Assembler, Mode};

/// The PyPI toolchain `tools/setup.sh` unpacks.
const PYPI_VERSION: &str = "13.0.88";

/// Linked (`-rdc`): the most registers a kernel calling any function of a family may use.
const LINKED_CEILINGS: &[(&str, u32)] = &[
    ("gdaki_atomic_compare_swap", 243),
    ("gdaki_atomic_fetch_add", 243),
    ("gdaki_commit", 61),
    ("gdaki_count_when_done", 228),
    ("gdaki_get", 236),
    ("gdaki_poll_recv", 110),
    ("gdaki_post_recv", 70),
    ("gdaki_post_recvs", 101),
    ("gdaki_put", 243),
    ("gdaki_put_inline", 227),
    ("gdaki_put_signal", 254),
    ("gdaki_quiet", 164),
    ("gdaki_recv_arrived", 36),
    ("gdaki_send", 214),
    ("gdaki_send_imm", 214),
    ("gdaki_send_inline", 212),
    ("gdaki_signal", 235),
    ("gdaki_socket_accept", 62),
    ("gdaki_socket_close", 254),
    ("gdaki_socket_connect", 70),
    ("gdaki_socket_consume", 254),
    ("gdaki_socket_flush", 163),
    ("gdaki_socket_listen", 62),
    ("gdaki_socket_peek", 165),
    ("gdaki_socket_recv", 254),
    ("gdaki_socket_recv_exact", 254),
    ("gdaki_socket_release", 60),
    ("gdaki_socket_reset", 252),
    ("gdaki_socket_send", 254),
    ("gdaki_socket_send_all", 254),
    ("gdaki_socket_send_all_from", 254),
    ("gdaki_socket_send_from", 254),
    ("gdaki_socket_shutdown", 254),
    ("gdaki_socket_try_peek", 165),
    ("gdaki_socket_try_recv", 254),
    ("gdaki_socket_try_send", 254),
    ("gdaki_socket_try_send_from", 254),
    ("gdaki_socket_unlisten", 62),
    ("gdaki_wait", 126), // 124 with the fence after a reliable doorbell (gone: Qp::ring)
    ("gdaki_wait_recv_arrived", 38),
    ("gdaki_wait_signal", 36),
    ("gdaki_write_imm", 220),
];

/// Linked, the socket functions spill a little (bytes of local memory a thread, at most, by
/// family): under the ABI a whole send or receive is one function, above 255 registers. Every
/// other function spills nothing.
const LINKED_SPILL_CEILINGS: &[(&str, u32)] = &[
    ("gdaki_socket_close", 136),
    ("gdaki_socket_consume", 64),
    ("gdaki_socket_flush", 8),
    ("gdaki_socket_peek", 8),
    ("gdaki_socket_recv", 20),
    ("gdaki_socket_recv_exact", 72),
    ("gdaki_socket_reset", 0),
    ("gdaki_socket_send", 36),
    ("gdaki_socket_send_all", 164),
    ("gdaki_socket_send_all_from", 164),
    ("gdaki_socket_send_from", 36),
    ("gdaki_socket_shutdown", 12),
    ("gdaki_socket_try_peek", 8),
    ("gdaki_socket_try_recv", 20),
    ("gdaki_socket_try_send", 36),
    ("gdaki_socket_try_send_from", 36),
];

/// In one module with the kernel every queue-pair function fits 512-thread blocks today.
const ONE_MODULE_CEILING: u32 = 128;
/// The socket functions (`gdaki_socket_*`: a whole send or receive, waits, copies and posts
/// inlined) fit 256-thread blocks, GPUnet's block per socket; docs/cuda-cpp.md says so.
const SOCKET_ONE_MODULE_CEILING: u32 = 255;

/// A function's family: its name without the scope and sharing mode.
fn family(name: &str) -> &str {
    let mut base = name;
    for suffix in ["_gpu", "_cta", "_exclusive"] {
        base = base.strip_suffix(suffix).unwrap_or(base);
    }
    for suffix in ["_thread", "_warp", "_block"] {
        base = base.strip_suffix(suffix).unwrap_or(base);
    }
    base
}

fn assembler() -> Option<Assembler> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("GDAKI_CUDA_BIN")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(format!(".cache/gdaki/cuda-nvcc-{PYPI_VERSION}/nvidia/cu13/bin")));
    }
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs.push("/usr/local/cuda/bin".into());
    Assembler::find(&dirs)
}

#[test]
fn every_device_function_stays_within_its_register_ceiling() {
    let test = "every_device_function_stays_within_its_register_ceiling";
    let skip = |why: String| {
        let _ = writeln!(std::io::stderr(), "SKIPPED ({why}): {test}");
    };
    let Some(asm) = assembler() else {
        return skip("no ptxas and nvlink: tools/setup.sh unpacks them, or set GDAKI_CUDA_BIN".into());
    };
    let ptx = match gdaki::cuda::ptx::c_abi_ptx() {
        Ok(p) if !p.is_empty() => p,
        Ok(_) => return skip("the C ABI PTX is empty".into()),
        Err(e) => return skip(format!("no C ABI PTX: {e}")),
    };
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("registers");
    std::fs::create_dir_all(&work).unwrap();
    let version = asm.version().unwrap_or_default();
    let linked = asm.measure(ptx, "sm_90", Mode::Linked, &work).unwrap();
    let whole = asm.measure(ptx, "sm_90", Mode::OneModule, &work).unwrap();
    // CUDA C++ compiled by clang with the bitcode linked in: every call inlined.
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let bitcode = gdaki::cuda::ptx::c_abi_bitcode_path().expect("the PTX was built, so was its bitcode");
    let header = std::fs::read_to_string(workspace.join("device/include/gdaki_device.h")).unwrap();
    let script = workspace.join("tools/cuda/clang-kernel.sh");
    let inlined = asm
        .measure_inlined(
            &header,
            |cu, out| {
                let mut cmd = std::process::Command::new(&script);
                cmd.arg(cu).arg(out).env("GDAKI_BITCODE", &bitcode);
                cmd
            },
            "sm_90",
            &work,
        )
        .unwrap_or_else(|e| panic!("inlined with clang (tools/setup.sh installs clang-22): {e}"));
    let mut report =
        format!("registers a thread, sm_90, {version} (linked with -rdc / in one module / inlined by clang):\n");
    let mut failures = Vec::new();
    let mut lower = Vec::new();
    let mut best = std::collections::BTreeMap::<&str, u32>::new();
    for (name, l) in &linked {
        let w = whole[name];
        let Some(&i) = inlined.get(name) else {
            failures.push(format!("{name}: not in the header's probes"));
            continue;
        };
        report.push_str(&format!(
            "  {name:<40} {:>4} / {:>4} / {:>4}{}\n",
            l.registers,
            w.registers,
            i.registers,
            if l.registers > 128 { "   above 128 linked" } else { "" }
        ));
        let fam = family(name);
        let Some(&(_, ceiling)) = LINKED_CEILINGS.iter().find(|(f, _)| *f == fam) else {
            failures.push(format!("{name}: a family with no ceiling ({fam}): add it"));
            continue;
        };
        if l.registers > ceiling {
            failures.push(format!(
                "{name}: {} registers linked, the ceiling is {ceiling}",
                l.registers
            ));
        }
        let e = best.entry(fam).or_default();
        *e = (*e).max(l.registers);
        let spill_ceiling = LINKED_SPILL_CEILINGS
            .iter()
            .find(|(f, _)| *f == fam)
            .map_or(0, |&(_, c)| c);
        if l.spill_bytes > spill_ceiling || w.spill_bytes > 0 {
            failures.push(format!(
                "{name}: spills {} bytes linked, {} in one module",
                l.spill_bytes, w.spill_bytes
            ));
        }
        let one_module = if fam.starts_with("gdaki_socket_") {
            SOCKET_ONE_MODULE_CEILING
        } else {
            ONE_MODULE_CEILING
        };
        if w.registers > one_module {
            failures.push(format!(
                "{name}: {} registers in one module, above {one_module}",
                w.registers
            ));
        }
        // Inlined, a socket's whole send may still spill a little, as it does linked.
        if i.registers > one_module || i.spill_bytes > spill_ceiling {
            failures.push(format!(
                "{name}: {} registers inlined by clang (ceiling {one_module}), {} bytes spilled",
                i.registers, i.spill_bytes
            ));
        }
    }
    for (fam, ceiling) in LINKED_CEILINGS {
        match best.get(fam) {
            Some(&now) if now < *ceiling => lower.push(format!("{fam}: {now} (ceiling {ceiling})")),
            Some(_) => {}
            None => failures.push(format!("{fam}: a ceiling for a family the PTX no longer has")),
        }
    }
    let above = linked.values().filter(|u| u.registers > 128).count();
    let most = |m: &std::collections::BTreeMap<String, gdaki_tools::registers::Usage>, sockets: bool| {
        m.iter()
            .filter(|(n, _)| n.starts_with("gdaki_socket_") == sockets)
            .map(|(_, u)| u.registers)
            .max()
            .unwrap_or(0)
    };
    report.push_str(&format!(
        "{above} of {} functions need more than 128 registers linked; the most without the socket \
         functions: {} in one module, {} inlined by clang (sockets: {}, {})\n",
        linked.len(),
        most(&whole, false),
        most(&inlined, false),
        most(&whole, true),
        most(&inlined, true),
    ));
    if !lower.is_empty() {
        report.push_str(&format!(
            "fewer registers than the ceilings, lower them: {}\n",
            lower.join(", ")
        ));
    }
    let _ = std::io::stderr().write_all(report.as_bytes());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
