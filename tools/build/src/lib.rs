//! `gdaki-build`: builds a crate of GPU kernels (a library that depends on `gdaki-device` and
//! defines `extern "ptx-kernel"` functions) to PTX, from a build script, with the toolchain
//! `tools/setup.sh` installs: Debian's `rustc-web`, which ships the NVPTX backend and the
//! library sources for `-Zbuild-std=core`. gdaki's own kernels are built with it too.
//!
//! In `build.rs` of the crate that launches the kernels (its code then reads the PTX with
//! `include_str!(concat!(env!("OUT_DIR"), "/my_kernels.ptx"))`):
//!
//! ```no_run
//! let kernels = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
//! gdaki_build::PtxBuild::new(kernels).build_script("my_kernels");
//! ```
//!
//! Panics abort (`-Cpanic=immediate-abort`, `core` rebuilt with it), so a bounds check becomes
//! a `trap` instead of a call into `core` that no module defines; a PTX file that still declares
//! an `.extern .func` is refused with the names. Knobs (environment): `GDAKI_PTX=off` skips the
//! build; `GDAKI_PTX_CARGO` / `GDAKI_PTX_RUSTC` name another compiler pair (default
//! `/usr/bin/cargo`, `/usr/bin/rustc`); `GDAKI_PTX_ARCH` (default `sm_90`) and
//! `GDAKI_PTX_VERSION` (default `ptx86`: PTX ISA 8.6, which CUDA 12.8 drivers and newer load,
//! and the first with a release-only fence, which a doorbell needs; `ptx84` builds for CUDA 12.4
//! drivers, its doorbell fences also invalidating the SM's L1; gdaki's own host library needs a
//! CUDA 13.0 driver for its bindings) select the target.
use std::env;
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The fix named whenever the toolchain is missing.
pub const FIX: &str = "run tools/setup.sh (it installs Debian's rustc-web, cargo-web and rust-web-src)";

/// The environment variables that change what is built.
pub const KNOBS: [&str; 7] = [
    "GDAKI_PTX",
    "GDAKI_PTX_CARGO",
    "GDAKI_PTX_RUSTC",
    "GDAKI_PTX_ARCH",
    "GDAKI_PTX_VERSION",
    "GDAKI_SASS",
    "GDAKI_PTXAS",
];

/// The GPU architecture the PTX is built for (`GDAKI_PTX_ARCH`, default `sm_90`), and the one
/// [`assemble`] assembles it for.
pub fn target_arch() -> String {
    env::var("GDAKI_PTX_ARCH").unwrap_or_else(|_| "sm_90".into())
}

/// The reason given when `GDAKI_PTX=off` switched the build off (tests that need the PTX
/// say SKIPPED on it rather than fail).
pub const SWITCHED_OFF: &str = "GDAKI_PTX=off";

/// Why no PTX came out.
#[derive(Debug)]
pub enum BuildError {
    /// The PTX toolchain is absent or switched off (not a bug: hosts build for CPU use).
    Missing(String),
    /// The kernel crate did not compile for nvptx64.
    Failed {
        /// What the compiler said.
        output: String,
    },
    /// The PTX declares functions it does not define: loading it would fail.
    Unresolved(Vec<String>),
    /// Reading or writing a file failed.
    Io(String),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Switched off on purpose: the fix is to switch it back on, not to install anything.
            BuildError::Missing(why) if why == SWITCHED_OFF => write!(
                f,
                "GPU kernels not built ({why}); fix: build without GDAKI_PTX=off for GPU mode"
            ),
            BuildError::Missing(why) => write!(f, "GPU kernels not built ({why}); fix: {FIX}"),
            BuildError::Failed { output } => write!(f, "building the kernels for nvptx64 failed:\n{output}"),
            BuildError::Unresolved(names) => write!(
                f,
                "the PTX declares functions it does not define: {} (an out-of-line function of another \
                 crate: mark it #[inline])",
                names.join(", ")
            ),
            BuildError::Io(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for BuildError {}

/// A built PTX module.
#[derive(Debug, Clone)]
pub struct Ptx {
    /// Where it was written.
    pub path: PathBuf,
    /// Its text.
    pub text: String,
}

/// How to build one kernel crate.
#[derive(Debug, Clone)]
pub struct PtxBuild {
    dir: PathBuf,
    package: Option<String>,
    target_dir: Option<PathBuf>,
    features: Vec<String>,
    default_features: bool,
    bitcode: Option<PathBuf>,
}

impl PtxBuild {
    /// The library crate whose `Cargo.toml` is in `dir` (or, with [`package`](Self::package), a
    /// workspace there).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        PtxBuild {
            dir: dir.into(),
            package: None,
            target_dir: None,
            features: Vec::new(),
            default_features: true,
            bitcode: None,
        }
    }

    /// Also writes the crate as LLVM bitcode to `path`, from the same compilation as the PTX:
    /// what a clang-CUDA build links into its kernels and inlines (`-mlink-builtin-bitcode`;
    /// clang must share the compiler's LLVM, 22 for Debian's rustc-web 1.96).
    pub fn bitcode(mut self, path: impl Into<PathBuf>) -> Self {
        self.bitcode = Some(path.into());
        self
    }

    /// Turns on the crate's feature `name` (any number of times).
    pub fn feature(mut self, name: impl Into<String>) -> Self {
        self.features.push(name.into());
        self
    }

    /// Leaves the crate's default features off.
    pub fn no_default_features(mut self) -> Self {
        self.default_features = false;
        self
    }

    /// Builds package `name` of the workspace in the directory.
    pub fn package(mut self, name: impl Into<String>) -> Self {
        self.package = Some(name.into());
        self
    }

    /// Where the nested build keeps its files (default: `ptx/` in the target directory of
    /// the build script's own build, beside it: the outer cargo holds its own directory's lock).
    pub fn target_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.target_dir = Some(dir.into());
        self
    }

    /// Builds the PTX into `out` (a file path).
    pub fn build(&self, out: &Path) -> Result<Ptx, BuildError> {
        if env::var("GDAKI_PTX").is_ok_and(|v| v == "off" || v == "0") {
            return Err(BuildError::Missing(SWITCHED_OFF.into()));
        }
        let cargo = env::var_os("GDAKI_PTX_CARGO").unwrap_or_else(|| "/usr/bin/cargo".into());
        let rustc = env::var_os("GDAKI_PTX_RUSTC").unwrap_or_else(|| "/usr/bin/rustc".into());
        let arch = target_arch();
        let isa = env::var("GDAKI_PTX_VERSION").unwrap_or_else(|_| "ptx86".into());
        for tool in [&cargo, &rustc] {
            if !Path::new(tool).exists() {
                return Err(BuildError::Missing(format!("{} not found", Path::new(tool).display())));
            }
        }
        let sysroot = Command::new(&rustc)
            .arg("--print=sysroot")
            .output()
            .map_err(|e| BuildError::Missing(format!("cannot run {}: {e}", Path::new(&rustc).display())))?;
        let sysroot = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim());
        let core_src = sysroot.join("lib/rustlib/src/rust/library/core");
        if !core_src.exists() {
            return Err(BuildError::Missing(format!(
                "library sources missing ({})",
                core_src.display()
            )));
        }
        let target_dir = match &self.target_dir {
            Some(d) => d.clone(),
            None => nested_target_dir(),
        };
        let mut cmd = Command::new(&cargo);
        scrub_env(&mut cmd);
        // Every crate, `core` included, gets the flags: panics then abort in place everywhere.
        let flags = [
            "-Zunstable-options".to_string(),
            "-Cpanic=immediate-abort".to_string(),
            format!("-Ctarget-cpu={arch}"),
            format!("-Ctarget-feature=+{isa}"),
        ];
        cmd.env("RUSTC", &rustc)
            .env("RUSTC_BOOTSTRAP", "1")
            .env("CARGO_ENCODED_RUSTFLAGS", flags.join("\x1f"))
            .current_dir(&self.dir)
            .args(["rustc", "--quiet", "--lib", "--release"]);
        if let Some(p) = &self.package {
            cmd.args(["-p", p]);
        }
        if !self.default_features {
            cmd.arg("--no-default-features");
        }
        if !self.features.is_empty() {
            cmd.args(["--features", &self.features.join(",")]);
        }
        // rustc writes its --emit files only when it runs, and cargo keeps an artifact per
        // configuration (the flags are in its hash) and runs rustc for none that is fresh: built
        // for one ISA, then another, then the first again, a shared `out` kept the second's
        // PTX. So each configuration emits into files of its own, copied to `out`.
        let emit_dir = target_dir.join("emit").join(self.configuration(&arch, &isa));
        let file = |path: &Path, fallback: &str| emit_dir.join(path.file_name().unwrap_or(fallback.as_ref()));
        let (asm, bc) = (
            file(out, "kernels.ptx"),
            self.bitcode.as_deref().map(|b| file(b, "kernels.bc")),
        );
        fs::create_dir_all(&emit_dir).map_err(|e| BuildError::Io(format!("{}: {e}", emit_dir.display())))?;
        cmd.args(["--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"])
            .args(["--config", "profile.release.debug=false"])
            .arg("--target-dir")
            .arg(&target_dir)
            .arg("--")
            .arg(match &bc {
                Some(bc) => format!("--emit=asm={},llvm-bc={}", asm.display(), bc.display()),
                None => format!("--emit=asm={}", asm.display()),
            });
        let run = |cmd: &mut Command| -> Result<(), BuildError> {
            let output = cmd
                .output()
                .map_err(|e| BuildError::Missing(format!("cannot run {}: {e}", Path::new(&cargo).display())))?;
            if !output.status.success() {
                return Err(BuildError::Failed {
                    output: format!(
                        "{}{}",
                        String::from_utf8_lossy(&output.stdout),
                        String::from_utf8_lossy(&output.stderr)
                    ),
                });
            }
            Ok(())
        };
        run(&mut cmd)?;
        // A fresh artifact whose emitted files are gone (removed by hand): only a build from
        // scratch writes them again.
        if !asm.exists() || bc.as_ref().is_some_and(|b| !b.exists()) {
            let stale = target_dir.join("nvptx64-nvidia-cuda");
            remove_dir_if_any(&stale)?;
            run(&mut cmd)?;
        }
        let copy = |from: &Path, to: &Path| {
            fs::copy(from, to)
                .map(|_| ())
                .map_err(|e| BuildError::Io(format!("copying {} to {}: {e}", from.display(), to.display())))
        };
        copy(&asm, out)?;
        if let (Some(from), Some(to)) = (&bc, &self.bitcode) {
            copy(from, to)?;
        }
        let text = fs::read_to_string(out).map_err(|e| BuildError::Io(format!("no PTX at {}: {e}", out.display())))?;
        let unresolved = unresolved(&text);
        if !unresolved.is_empty() {
            return Err(BuildError::Unresolved(unresolved));
        }
        Ok(Ptx {
            path: out.to_path_buf(),
            text,
        })
    }

    /// For a build script: builds the PTX to `OUT_DIR/<name>.ptx` and tells cargo when to
    /// build it again (the crate's sources and manifest, the lock file, the knobs). Where the
    /// toolchain is missing or switched off, it writes an empty file, warns once through cargo,
    /// and returns `None`, so the host crate still builds for CPU use (check for an empty
    /// string at run time and say [`FIX`]). A crate that fails to compile, or PTX with
    /// unresolved functions, fails the build.
    pub fn build_script(&self, name: &str) -> Option<Ptx> {
        for watched in self.watched() {
            println!("cargo:rerun-if-changed={}", watched.display());
        }
        for var in KNOBS {
            println!("cargo:rerun-if-env-changed={var}");
        }
        let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("build_script runs in a build script (OUT_DIR)"));
        let out = out_dir.join(format!("{name}.ptx"));
        match self.build(&out) {
            Ok(ptx) => Some(ptx),
            Err(e @ BuildError::Missing(_)) => {
                println!("cargo:warning={name}: {e}; CPU mode only");
                fs::write(&out, "").unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
                None
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
}

/// Removes `dir` and everything in it, where it exists.
fn remove_dir_if_any(dir: &Path) -> Result<(), BuildError> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(BuildError::Io(format!("removing {}: {e}", dir.display())))
        }
        _ => Ok(()),
    }
}

impl PtxBuild {
    /// A name for what this build compiles and emits (the crate, its features, whether it
    /// writes bitcode, the architecture and the ISA): the folder its emitted files live in, so
    /// another configuration's never stand in (a build without bitcode leaves an older bitcode
    /// file beside a newer PTX).
    fn configuration(&self, arch: &str, isa: &str) -> String {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        let dir = self.dir.canonicalize().unwrap_or_else(|_| self.dir.clone());
        (
            dir,
            &self.package,
            &self.features,
            self.default_features,
            self.bitcode.is_some(),
        )
            .hash(&mut h);
        format!("{arch}-{isa}-{:016x}", h.finish())
    }

    /// What a change to rebuilds the PTX: the crate's sources and manifest, and the lock file
    /// cargo uses for it, the nearest `Cargo.lock` at or above the crate (a workspace member has
    /// none of its own). Only paths that exist: cargo reruns a script that watches a missing one
    /// on every build.
    fn watched(&self) -> Vec<PathBuf> {
        let lock = self.dir.ancestors().map(|d| d.join("Cargo.lock")).find(|l| l.is_file());
        [self.dir.join("src"), self.dir.join("Cargo.toml")]
            .into_iter()
            .chain(lock)
            .filter(|p| p.exists())
            .collect()
    }
}

/// Machine code (SASS) assembled from a PTX module for one architecture: a cubin the driver
/// loads as it is, where the PTX would be compiled on each machine's first run (a minute or
/// more for gdaki's kernels, then cached per user by the driver).
#[derive(Debug, Clone)]
pub struct Sass {
    /// The cubin file.
    pub path: PathBuf,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// The architecture (`sm_90`).
    pub arch: String,
}

/// Assembles `ptx` for [`target_arch`] with NVIDIA's `ptxas` ([`find_ptxas`]) into
/// `<ptx>.<arch>.cubin` beside it. The cubin is kept with a copy of the PTX it came from and
/// reused while that PTX is the same, byte for byte (assembling gdaki's kernels takes a
/// minute and a half on two cores). Knobs: `GDAKI_SASS=off` skips it; `GDAKI_PTXAS` names
/// the assembler. [`BuildError::Missing`] where skipped or no `ptxas` is found: the PTX alone
/// still works.
pub fn assemble(ptx: &Ptx) -> Result<Sass, BuildError> {
    if env::var("GDAKI_SASS").is_ok_and(|v| v == "off" || v == "0") {
        return Err(BuildError::Missing("GDAKI_SASS=off".into()));
    }
    let ptxas = find_ptxas().ok_or_else(|| {
        BuildError::Missing("no ptxas (GDAKI_PTXAS, PATH, /usr/local/cuda/bin, or tools/setup.sh's copy)".into())
    })?;
    assemble_with(&ptxas, ptx, &target_arch())
}

/// [`assemble`] with the assembler at `ptxas`, for `arch`.
pub fn assemble_with(ptxas: &Path, ptx: &Ptx, arch: &str) -> Result<Sass, BuildError> {
    let io = |what: &str, p: &Path, e: std::io::Error| BuildError::Io(format!("{what} {}: {e}", p.display()));
    let cubin = ptx.path.with_extension(format!("{arch}.cubin"));
    let source = ptx.path.with_extension(format!("{arch}.cubin.ptx"));
    let done = |bytes: Vec<u8>| Sass {
        path: cubin.clone(),
        bytes,
        arch: arch.to_string(),
    };
    if fs::read(&source).is_ok_and(|kept| kept == ptx.text.as_bytes()) {
        if let Ok(bytes) = fs::read(&cubin) {
            return Ok(done(bytes));
        }
    }
    // Written under names of this process and renamed into place: a debug and a release
    // build may assemble the same PTX at once.
    let tmp = |p: &Path| p.with_extension(format!("tmp{}", std::process::id()));
    let (tmp_cubin, tmp_source) = (tmp(&cubin), tmp(&source));
    let output = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg(&ptx.path)
        .arg("-o")
        .arg(&tmp_cubin)
        .output()
        .map_err(|e| BuildError::Missing(format!("cannot run {}: {e}", ptxas.display())))?;
    if !output.status.success() {
        let _ = fs::remove_file(&tmp_cubin);
        return Err(BuildError::Failed {
            output: format!(
                "{} -arch={arch} {}: {}",
                ptxas.display(),
                ptx.path.display(),
                String::from_utf8_lossy(&output.stderr)
            ),
        });
    }
    let bytes = fs::read(&tmp_cubin).map_err(|e| io("reading", &tmp_cubin, e))?;
    fs::write(&tmp_source, &ptx.text).map_err(|e| io("writing", &tmp_source, e))?;
    // The cubin first: a kept source names the cubin beside it.
    fs::rename(&tmp_cubin, &cubin).map_err(|e| io("renaming to", &cubin, e))?;
    fs::rename(&tmp_source, &source).map_err(|e| io("renaming to", &source, e))?;
    Ok(done(bytes))
}

/// NVIDIA's `ptxas`: `GDAKI_PTXAS`, else the first on `PATH`, in `/usr/local/cuda/bin`, or
/// unpacked by `tools/setup.sh` from PyPI's `nvidia-cuda-nvcc` (`~/.cache/gdaki/cuda-nvcc-*`).
pub fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = env::var_os("GDAKI_PTXAS") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path_dirs = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    let mut cached: Vec<PathBuf> = env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/gdaki"))
        .and_then(|d| fs::read_dir(d).ok())
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("cuda-nvcc-"))
                })
                .map(|p| p.join("nvidia/cu13/bin"))
                .collect()
        })
        .unwrap_or_default();
    cached.sort(); // the same choice on every run
    path_dirs
        .into_iter()
        .chain([PathBuf::from("/usr/local/cuda/bin")])
        .chain(cached.into_iter().rev())
        .map(|d| d.join("ptxas"))
        .find(|p| p.is_file())
}

/// The names of functions PTX text declares `.extern .func` (defined by no one in it).
pub fn unresolved(ptx: &str) -> Vec<String> {
    ptx.lines()
        .map(str::trim)
        .filter(|l| l.starts_with(".extern") && l.contains(".func"))
        .filter_map(|l| {
            let after = l.split(".func").nth(1)?.trim_start();
            let after = match after.strip_prefix('(') {
                Some(rest) => rest.split_once(')')?.1.trim_start(),
                None => after,
            };
            let name: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

/// Where nested builds keep their files by default: `ptx/` in the target directory of the
/// running build script (the first ancestor of OUT_DIR that cargo tagged), or in OUT_DIR.
pub fn nested_target_dir() -> PathBuf {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_else(|| "target".into()));
    out_dir
        .ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").exists())
        .unwrap_or(&out_dir)
        .join("ptx")
}

/// Drops what the outer cargo (or clippy) set for the build script, so the nested build is a
/// plain build with the PTX compiler; keeps what reaches the registry.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unresolved_functions_are_named() {
        let text = ".version 8.4\n.extern .func (.param .b32 r) vprintf(\n.visible .entry k(\n\
                    .extern .func _RNvNtCs1_4core9panicking18panic_bounds_check(\n.visible .func f(\n";
        assert_eq!(
            unresolved(text),
            ["vprintf", "_RNvNtCs1_4core9panicking18panic_bounds_check"]
        );
        assert!(unresolved(".visible .entry k(\n").is_empty());
    }

    /// A workspace member has no lock file of its own: watching `<crate>/Cargo.lock` made
    /// cargo rerun the build script (and rebuild the PTX) on every command.
    #[test]
    fn a_workspace_member_watches_the_workspace_lock_and_nothing_missing() {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .canonicalize()
            .unwrap();
        let kernels = workspace.join("examples/own-kernel/kernels");
        let watched = PtxBuild::new(&kernels).watched();
        assert_eq!(
            watched,
            [
                kernels.join("src"),
                kernels.join("Cargo.toml"),
                workspace.join("Cargo.lock")
            ]
        );
    }

    /// A tiny module assembles into an ELF cubin, which is kept and reused while its PTX is
    /// the same and assembled again once it changes; PTX that does not assemble fails with
    /// ptxas's message. Skipped where no ptxas is found (tools/setup.sh unpacks one).
    #[test]
    fn ptx_assembles_into_a_kept_cubin() {
        let Some(ptxas) = find_ptxas() else {
            eprintln!("SKIPPED: no ptxas (tools/setup.sh unpacks one from PyPI)");
            return;
        };
        let dir = std::env::temp_dir().join(format!("gdaki-build-sass-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let module = |body: &str| {
            let path = dir.join("k.ptx");
            let text =
                format!(".version 8.4\n.target sm_90\n.address_size 64\n.visible .entry k()\n{{\n{body}ret;\n}}\n");
            fs::write(&path, &text).unwrap();
            Ptx { path, text }
        };
        let ptx = module("");
        let first = assemble_with(&ptxas, &ptx, "sm_90").unwrap();
        assert_eq!(&first.bytes[..4], b"\x7fELF");
        assert_eq!(first.path, dir.join("k.sm_90.cubin"));
        // Kept: a marker written over the cubin comes back as it is.
        fs::write(&first.path, b"kept").unwrap();
        assert_eq!(assemble_with(&ptxas, &ptx, "sm_90").unwrap().bytes, b"kept");
        // A changed module is assembled again.
        let changed = module("membar.gl;\n");
        assert_eq!(
            &assemble_with(&ptxas, &changed, "sm_90").unwrap().bytes[..4],
            b"\x7fELF"
        );
        let err = assemble_with(&ptxas, &module("not_an_instruction;\n"), "sm_90").unwrap_err();
        assert!(matches!(err, BuildError::Failed { .. }), "{err}");
        assert!(err.to_string().contains("not_an_instruction"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The tests that set the knobs (the process's environment) take turns.
    static KNOBS_SET: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Built for ISA 8.6, then 8.4, then 8.6 again: the third build's artifact is fresh in the
    /// nested cargo (the second did not replace it), and the PTX must still be 8.6, not the
    /// 8.4 that the last compilation emitted. Skipped without the PTX toolchain.
    #[test]
    fn a_configuration_built_again_gets_its_own_ptx_back() {
        let _turn = KNOBS_SET.lock().unwrap_or_else(|e| e.into_inner());
        let dir = std::env::temp_dir().join(format!("gdaki-build-knobs-{}", std::process::id()));
        fs::create_dir_all(dir.join("src")).unwrap();
        fs::write(
            dir.join("Cargo.toml"),
            "[package]\nname = \"knobs\"\nversion = \"0.1.0\"\nedition = \"2021\"\n[workspace]\n",
        )
        .unwrap();
        fs::write(
            dir.join("src/lib.rs"),
            "#![no_std]\n#![feature(abi_ptx)]\n#[no_mangle]\npub unsafe extern \"ptx-kernel\" fn k(p: *mut u32) {\n    unsafe { *p = 1 }\n}\n",
        )
        .unwrap();
        let out = dir.join("k.ptx");
        let build = PtxBuild::new(&dir).target_dir(dir.join("target"));
        let mut versions = vec![];
        for isa in ["ptx86", "ptx84", "ptx86"] {
            std::env::set_var("GDAKI_PTX_VERSION", isa);
            let built = build.build(&out);
            std::env::remove_var("GDAKI_PTX_VERSION");
            match built {
                Ok(ptx) => versions.push(
                    ptx.text
                        .lines()
                        .find_map(|l| l.strip_prefix(".version "))
                        .unwrap_or("")
                        .to_string(),
                ),
                Err(BuildError::Missing(why)) => {
                    eprintln!("SKIPPED: a_configuration_built_again_gets_its_own_ptx_back: {why}");
                    fs::remove_dir_all(&dir).unwrap();
                    return;
                }
                Err(e) => panic!("{e}"),
            }
        }
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(versions, ["8.6", "8.4", "8.6"]);
    }

    #[test]
    fn a_switched_off_build_is_missing_not_failed() {
        let _turn = KNOBS_SET.lock().unwrap_or_else(|e| e.into_inner());
        std::env::set_var("GDAKI_PTX", "off");
        let err = PtxBuild::new(".").build(Path::new("/nonexistent/x.ptx")).unwrap_err();
        std::env::remove_var("GDAKI_PTX");
        assert!(matches!(err, BuildError::Missing(_)), "{err}");
        // Switched off on purpose: the fix is to switch it on, not to install anything.
        assert!(err.to_string().contains("build without GDAKI_PTX=off"), "{err}");
        assert!(!err.to_string().contains("tools/setup.sh"), "{err}");
    }
}
