//! Builds `gdaki-device` to PTX with the Debian `rustc-web` compiler (which ships the NVPTX
//! backend and the library sources for `-Zbuild-std`) and hands the result to the library,
//! which embeds it. Host builds never need CUDA: when the PTX compiler pair is missing, the
//! library still builds for CPU use and every GPU entry point reports how to get the PTX.
//!
//! Knobs: `GDAKI_PTX=off` skips the build; `GDAKI_PTX_CARGO` / `GDAKI_PTX_RUSTC` name another
//! compiler pair; `GDAKI_PTX_ARCH` (default `sm_90`) and `GDAKI_PTX_VERSION` (default `ptx84`)
//! select the target.
use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The fix named whenever the PTX cannot be built.
const FIX: &str = "run tools/setup.sh (it installs Debian's rustc-web, cargo-web and rust-web-src)";

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest.parent().expect("host/ lives in the workspace").to_path_buf();
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for watched in [
        "device/src",
        "device/Cargo.toml",
        "shared-layout/src",
        "shared-layout/Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={}", workspace.join(watched).display());
    }
    for var in [
        "GDAKI_PTX",
        "GDAKI_PTX_CARGO",
        "GDAKI_PTX_RUSTC",
        "GDAKI_PTX_ARCH",
        "GDAKI_PTX_VERSION",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let (ptx, missing) = match build_ptx(&workspace, &out_dir) {
        Ok(ptx) => (ptx, String::new()),
        Err(Missing(why)) => {
            println!("cargo:warning=gdaki: GPU kernels not built ({why}); CPU mode only. Fix: {FIX}");
            (String::new(), format!("{why}; fix: {FIX}"))
        }
    };
    fs::write(out_dir.join("gdaki_device.ptx"), ptx).expect("write OUT_DIR/gdaki_device.ptx");
    fs::write(out_dir.join("ptx_missing.txt"), missing).expect("write OUT_DIR/ptx_missing.txt");
}

/// Why the PTX is absent when that is not a bug (a missing or disabled toolchain). A device
/// crate that fails to compile is a bug and fails the build instead.
struct Missing(String);

fn build_ptx(workspace: &Path, out_dir: &Path) -> Result<String, Missing> {
    if env::var("GDAKI_PTX").is_ok_and(|v| v == "off" || v == "0") {
        return Err(Missing("GDAKI_PTX=off".into()));
    }
    let cargo = env::var_os("GDAKI_PTX_CARGO").unwrap_or_else(|| "/usr/bin/cargo".into());
    let rustc = env::var_os("GDAKI_PTX_RUSTC").unwrap_or_else(|| "/usr/bin/rustc".into());
    let arch = env::var("GDAKI_PTX_ARCH").unwrap_or_else(|_| "sm_90".into());
    let ptx_isa = env::var("GDAKI_PTX_VERSION").unwrap_or_else(|_| "ptx84".into());
    for tool in [&cargo, &rustc] {
        if !Path::new(tool).exists() {
            return Err(Missing(format!("{} not found", Path::new(tool).display())));
        }
    }
    let sysroot = Command::new(&rustc)
        .arg("--print=sysroot")
        .output()
        .map_err(|e| Missing(format!("cannot run {}: {e}", Path::new(&rustc).display())))?;
    let sysroot = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim());
    let core_src = sysroot.join("lib/rustlib/src/rust/library/core");
    if !core_src.exists() {
        return Err(Missing(format!("library sources missing ({})", core_src.display())));
    }

    // A target directory of its own beside the outer one: the outer cargo holds its lock while
    // this script runs, and sharing one directory between debug and release keeps one build.
    let target_dir = find_target_dir(out_dir).join("ptx");
    let ptx_path = target_dir.join("gdaki_device.ptx");
    let mut cmd = Command::new(&cargo);
    scrub_env(&mut cmd);
    cmd.env("RUSTC", &rustc)
        .env("RUSTC_BOOTSTRAP", "1")
        .current_dir(workspace)
        .args(["rustc", "--quiet", "-p", "gdaki-device", "--lib", "--release"])
        .args(["--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"])
        .args(["--config", "profile.release.debug=false"])
        .arg("--target-dir")
        .arg(&target_dir)
        .args([
            "--",
            "-C",
            &format!("target-cpu={arch}"),
            "-C",
            &format!("target-feature=+{ptx_isa}"),
        ])
        .arg(format!("--emit=asm={}", ptx_path.display()));
    let output = cmd
        .output()
        .map_err(|e| Missing(format!("cannot run {}: {e}", Path::new(&cargo).display())))?;
    if !output.status.success() {
        panic!(
            "building gdaki-device for nvptx64 failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    fs::read_to_string(&ptx_path).map_err(|e| Missing(format!("no PTX at {}: {e}", ptx_path.display())))
}

/// The outer target directory (the first ancestor of OUT_DIR that cargo tagged), or OUT_DIR.
fn find_target_dir(out_dir: &Path) -> PathBuf {
    out_dir
        .ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").exists())
        .unwrap_or(out_dir)
        .to_path_buf()
}

/// Drop what the outer cargo (or clippy) set for this build script, so the nested build is a
/// plain build with the Debian compiler; keep what reaches the registry.
fn scrub_env(cmd: &mut Command) {
    let keep = |name: &str| {
        name == "CARGO_HOME"
            || name.starts_with("CARGO_HTTP")
            || name.starts_with("CARGO_NET")
            || name.starts_with("CARGO_REGISTR")
    };
    let drop: Vec<OsString> = env::vars_os()
        .map(|(name, _)| name)
        .filter(|name| {
            let name = name.to_string_lossy();
            (name.starts_with("CARGO") && !keep(&name))
                || name.starts_with("RUST")
                || name.starts_with("CLIPPY")
                || name.starts_with("DEP_")
                || [
                    "TARGET",
                    "HOST",
                    "OUT_DIR",
                    "NUM_JOBS",
                    "OPT_LEVEL",
                    "PROFILE",
                    "DEBUG",
                    "MAKEFLAGS",
                    "MFLAGS",
                ]
                .contains(&name.as_ref())
        })
        .collect();
    for name in drop {
        cmd.env_remove(name);
    }
}
