//! The PTX of `gdaki-device`, built by this crate's build script with the Debian `rustc-web`
//! compiler and embedded in the library, so users never build kernels by hand. When that
//! compiler was absent at build time the library is CPU-only and [`ptx`] says how to fix it.
use thiserror::Error;

const EMBEDDED: &str = include_str!(concat!(env!("OUT_DIR"), "/gdaki_device.ptx"));
const C_ABI: &str = include_str!(concat!(env!("OUT_DIR"), "/gdaki_device_c.ptx"));
const MISSING_REASON: &str = include_str!(concat!(env!("OUT_DIR"), "/ptx_missing.txt"));
const SASS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/gdaki_device.cubin"));
const SASS_ARCH: &str = include_str!(concat!(env!("OUT_DIR"), "/gdaki_device_sass_arch.txt"));

/// The kernel entry points the PTX must declare; the host launches them by these names.
pub const ENTRY_POINTS: &[&str] = &[
    "gdaki_selftest",
    "gdaki_put_bw_thread_exclusive",
    "gdaki_put_bw_thread_cta",
    "gdaki_put_bw_thread_gpu",
    "gdaki_put_bw_warp_exclusive",
    "gdaki_put_bw_warp_cta",
    "gdaki_put_bw_warp_gpu",
    "gdaki_put_bw_block_exclusive",
    "gdaki_put_bw_block_cta",
    "gdaki_put_bw_block_gpu",
    "gdaki_ops_thread_exclusive",
    "gdaki_ops_thread_cta",
    "gdaki_ops_thread_gpu",
    "gdaki_ops_warp_exclusive",
    "gdaki_ops_warp_cta",
    "gdaki_ops_warp_gpu",
    "gdaki_ops_block_exclusive",
    "gdaki_ops_block_cta",
    "gdaki_ops_block_gpu",
    "gdaki_write_lat",
    "gdaki_pinned_pingpong",
    "gdaki_post_rate_thread_exclusive",
    "gdaki_post_rate_thread_cta",
    "gdaki_post_rate_thread_gpu",
    "gdaki_post_rate_warp_exclusive",
    "gdaki_post_rate_warp_cta",
    "gdaki_post_rate_warp_gpu",
    "gdaki_post_rate_block_exclusive",
    "gdaki_post_rate_block_cta",
    "gdaki_post_rate_block_gpu",
    "gdaki_store_loop",
    "gdaki_store_loop_rings",
    "gdaki_copier",
    "gdaki_socket_bench",
    "gdaki_socket_bench_untimed",
];

/// The PTX was not built into this copy of the library.
#[derive(Debug, Clone, Error)]
#[error("gdaki was built without GPU kernels: {reason}")]
pub struct PtxUnavailable {
    /// Why, with the fix (as the build script recorded it).
    pub reason: &'static str,
}

/// The embedded PTX text, or why there is none.
pub fn ptx() -> Result<&'static str, PtxUnavailable> {
    if EMBEDDED.is_empty() {
        Err(PtxUnavailable {
            reason: MISSING_REASON.trim(),
        })
    } else {
        Ok(EMBEDDED)
    }
}

/// The same kernels as [`ptx`], assembled at build time into machine code (a cubin) for a GPU
/// of compute capability `cc` (`(9, 0)`: `sm_90`): loaded as it is, it spares the driver's
/// compile of the PTX on a machine's first run. `None` where this build has none for that
/// architecture (no `ptxas` at build time, `GDAKI_SASS=off`, or another GPU: a cubin runs
/// only on the architecture it was assembled for).
pub fn sass_for(cc: (i32, i32)) -> Option<&'static [u8]> {
    sass_matching(SASS, SASS_ARCH, cc)
}

/// The architecture this build assembled its kernels for (`sm_90`), if it did.
pub fn sass_arch() -> Option<&'static str> {
    (!SASS.is_empty() && !SASS_ARCH.is_empty()).then_some(SASS_ARCH)
}

fn sass_matching(sass: &'static [u8], arch: &str, (major, minor): (i32, i32)) -> Option<&'static [u8]> {
    (!sass.is_empty() && arch == format!("sm_{major}{minor}")).then_some(sass)
}

/// The PTX of the data path as `extern "C"` functions (`gdaki_device::ffi`, no kernels): what
/// CUDA C++ code links against, ahead of time (`libgdaki_device.a`) or at run time; or why
/// there is none.
pub fn c_abi_ptx() -> Result<&'static str, PtxUnavailable> {
    ptx().map(|_| C_ABI)
}

/// Where this build wrote the data path as LLVM bitcode (`target/ptx/gdaki_device_c.bc`): the
/// same functions as [`c_abi_ptx`], for a clang-CUDA build that inlines them into its kernels
/// (`tools/cuda/clang-kernel.sh`, docs/cuda-cpp.md). `None` where the PTX toolchain was
/// missing. A file of this machine's build tree: it is not embedded.
pub fn c_abi_bitcode_path() -> Option<std::path::PathBuf> {
    let path = env!("GDAKI_C_BITCODE");
    (!path.is_empty()).then(|| path.into())
}

/// What a PTX module declares, read from its text: enough to check a build before loading it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PtxSummary {
    /// `.version` (PTX ISA), e.g. `8.4`.
    pub version: String,
    /// `.target`, e.g. `sm_90`.
    pub target: String,
    /// Names of the `.entry` kernels.
    pub entries: Vec<String>,
    /// Names of functions declared `.extern .func` (unresolved: loading would fail).
    pub unresolved: Vec<String>,
}

impl PtxSummary {
    /// Scans PTX text for its directives. Unknown lines are ignored; nothing here panics.
    pub fn parse(text: &str) -> Self {
        let mut summary = PtxSummary {
            version: String::new(),
            target: String::new(),
            entries: vec![],
            unresolved: vec![],
        };
        let ident = |text: &str| -> Option<String> {
            let name: String = text
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$')
                .collect();
            (!name.is_empty()).then_some(name)
        };
        let name_after = |line: &str, keyword: &str| ident(line.split(keyword).nth(1)?.trim_start());
        for line in text.lines().map(str::trim) {
            if let Some(v) = line.strip_prefix(".version") {
                summary.version = v.trim().to_string();
            } else if let Some(t) = line.strip_prefix(".target") {
                summary.target = t.trim().to_string();
            } else if line.contains(".entry") && !line.starts_with("//") {
                summary.entries.extend(name_after(line, ".entry"));
            } else if line.starts_with(".extern") && line.contains(".func") {
                // `.extern .func (retval) name(` or `.extern .func name(`
                let after = line.split(".func").nth(1).unwrap_or("");
                let after = after.trim_start();
                let after = if after.starts_with('(') {
                    after.split_once(')').map_or("", |(_, rest)| rest)
                } else {
                    after
                };
                summary.unresolved.extend(ident(after.trim_start()));
            }
        }
        summary
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fences that come last before a doorbell store (`st.mmio`) in `text`, one per store, as
    /// written (`fence.release.sys`, ...; `none` where the function has no fence before it).
    fn doorbell_fences(text: &str) -> Vec<&str> {
        let mut last = "none";
        let mut fences = vec![];
        for line in text.lines().map(str::trim) {
            if line.starts_with(".func") || line.starts_with(".visible") || line.starts_with(".entry") {
                last = "none";
            } else if line.starts_with("fence.") {
                last = line.trim_end_matches(';');
            } else if line.starts_with("st.mmio") {
                fences.push(last);
            }
        }
        fences
    }

    /// Why this PTX cannot have release-only and acquire-only fences, if it cannot: LLVM writes
    /// them from PTX ISA 8.6 on and for sm_90 and newer only; before, every fence is
    /// `fence.acq_rel` (a `GDAKI_PTX_ARCH=sm_80` build, say).
    fn no_split_fences(text: &str) -> Option<String> {
        let summary = PtxSummary::parse(text);
        let number = |s: &str| s.parse::<u32>().unwrap_or(0);
        let (major, minor) = summary.version.split_once('.').unwrap_or((&summary.version, "0"));
        let sm = summary.target.strip_prefix("sm_").unwrap_or("0");
        let sm = number(sm.trim_end_matches(|c: char| !c.is_ascii_digit()));
        if (number(major), number(minor)) < (8, 6) {
            Some(format!(
                "PTX ISA {} has no release- or acquire-only fence",
                summary.version
            ))
        } else if sm < 90 {
            Some(format!("{} has no release- or acquire-only fence", summary.target))
        } else {
            None
        }
    }

    /// The fence tests judge only PTX that can have split fences: ISA 8.6 and sm_90 (with its
    /// `a` variant) and newer.
    #[test]
    fn split_fences_need_isa_8_6_and_sm_90() {
        let module = |version: &str, target: &str| format!(".version {version}\n.target {target}\n.address_size 64\n");
        for (version, target, split) in [
            ("8.6", "sm_90", true),
            ("8.6", "sm_90a", true),
            ("8.7", "sm_100", true),
            ("9.0", "sm_120", true),
            ("8.4", "sm_90", false),
            ("8.6", "sm_80", false),
            ("8.6", "sm_89", false),
            ("", "", false),
        ] {
            let why = no_split_fences(&module(version, target));
            assert_eq!(why.is_none(), split, "{version} {target}: {why:?}");
        }
    }

    /// A cubin serves only the compute capability it was assembled for (sm_90 code does not
    /// run on 8.0 or 10.0), and an empty one never.
    #[test]
    fn machine_code_is_offered_only_to_its_own_architecture() {
        static CUBIN: &[u8] = b"\x7fELF...";
        assert_eq!(sass_matching(CUBIN, "sm_90", (9, 0)), Some(CUBIN));
        assert_eq!(sass_matching(CUBIN, "sm_90", (8, 0)), None);
        assert_eq!(sass_matching(CUBIN, "sm_90", (10, 0)), None);
        assert_eq!(sass_matching(CUBIN, "sm_100", (10, 0)), Some(CUBIN));
        assert_eq!(sass_matching(b"", "sm_90", (9, 0)), None);
        // This build's own: where it has one, for the PTX's architecture.
        if let Some(arch) = sass_arch() {
            assert_eq!(PtxSummary::parse(ptx().unwrap()).target, arch);
            assert!(sass_for((9, 0)).is_some() == (arch == "sm_90"));
        }
    }

    #[test]
    fn parse_finds_entries_and_externs() {
        let text = ".version 8.4\n.target sm_90\n.address_size 64\n.extern .func (.param .b32 r) vprintf(\n\
                    .visible .entry k_one(\n.param .u64 p\n)\n.entry k_two()\n.extern .func __assertfail(\n";
        let s = PtxSummary::parse(text);
        assert_eq!(s.version, "8.4");
        assert_eq!(s.target, "sm_90");
        assert_eq!(s.entries, ["k_one", "k_two"]);
        assert_eq!(s.unresolved, ["vprintf", "__assertfail"]);
    }

    /// The test command installs the PTX compiler first, so a missing PTX here is a failure:
    /// the GPU half of the project would otherwise ship unbuilt without anyone noticing. Only
    /// a build switched off on purpose (`GDAKI_PTX=off`) says SKIPPED.
    #[test]
    fn embedded_ptx_declares_every_entry_point_and_nothing_unresolved() {
        let text = match ptx() {
            Ok(text) => text,
            Err(e) if e.reason.contains("(GDAKI_PTX=off)") => {
                println!("SKIPPED: embedded_ptx_declares_every_entry_point_and_nothing_unresolved: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let s = PtxSummary::parse(text);
        for entry in ENTRY_POINTS {
            assert!(
                s.entries.iter().any(|e| e == entry),
                "PTX lacks .entry {entry}; it has {:?}",
                s.entries
            );
        }
        assert!(
            s.unresolved.is_empty(),
            "PTX has unresolved externals: {:?}",
            s.unresolved
        );
        assert!(
            !s.version.is_empty() && s.target.starts_with("sm_"),
            "odd PTX header: {s:?}"
        );
    }

    #[test]
    fn the_last_fence_before_a_doorbell_is_found_per_function() {
        let text = ".visible .entry k(\n{\nfence.acq_rel.sys;\nst.mmio.relaxed.sys.global.b64 [a], b;\n\
                    fence.release.sys;\nst.mmio.relaxed.sys.global.b64 [a], b;\n}\n.func f(\n{\n\
                    st.mmio.relaxed.sys.global.b64 [a], b;\n}\n";
        assert_eq!(
            doorbell_fences(text),
            ["fence.acq_rel.sys", "fence.release.sys", "none"]
        );
    }

    /// A doorbell needs the WQEs before it (a release), not the acquire half of `fence.acq_rel`,
    /// which ptxas follows with an invalidation of the SM's whole L1 (`CCTL.IVALL`): every
    /// warp of the SM then reloads from L2 (docs/figures.md, "A release fence before the
    /// doorbell"). From PTX ISA 8.6 on (for sm_90 and newer), no system-scope doorbell is
    /// fenced with it.
    #[test]
    fn doorbells_are_fenced_by_release_only_fences() {
        let Ok(text) = ptx() else {
            println!("SKIPPED: doorbells_are_fenced_by_release_only_fences: no PTX in this build");
            return;
        };
        let fences = doorbell_fences(text);
        assert!(!fences.is_empty(), "no doorbell store (st.mmio) in the PTX");
        if let Some(why) = no_split_fences(text) {
            println!("SKIPPED: doorbells_are_fenced_by_release_only_fences: {why}");
            return;
        }
        let acquiring: Vec<_> = fences
            .iter()
            .filter(|f| **f == "fence.acq_rel.sys" || **f == "fence.sc.sys")
            .collect();
        assert!(
            acquiring.is_empty(),
            "{} of {} doorbells follow an acquiring system-scope fence ({:?})",
            acquiring.len(),
            fences.len(),
            acquiring.first()
        );
        assert!(
            fences.contains(&"fence.release.sys"),
            "no doorbell follows fence.release.sys"
        );
    }
}
