//! Registers a kernel pays for calling gdaki's `extern "C"` device functions (the CUDA C++
//! data path, `gdaki_device.h`): for every function, a probe kernel that loads its arguments
//! from memory, calls it and stores its result, assembled by NVIDIA's `ptxas` the two ways a
//! CUDA C++ program gets the functions:
//!
//! - **linked** ([`Mode::Linked`]): the library and the probes assembled apart (`ptxas -c`) and
//!   joined by `nvlink`, as `libgdaki_device.a` is linked into a program built with `-rdc`;
//!   the call keeps the ABI, and the kernel pays the callee's registers;
//! - **one module** ([`Mode::OneModule`]): the probes appended to the library's PTX and
//!   assembled whole, as a program that loads the PTX into its own module gets them
//!   (`cuModuleLoadData` with the kernel's PTX); `ptxas` may inline.
//!
//! And a third way, for CUDA C++ compiled by clang with gdaki's LLVM bitcode linked in
//! (`tools/cuda/clang-kernel.sh`): [`Assembler::measure_inlined`] writes the probes in CUDA
//! C++ against the header, has the script compile them (every call inlined) and assembles the
//! PTX whole.
//!
//! A block of 1024 threads needs at most 64 registers a thread, 512 at most 128 (65536
//! registers per SM on sm_90). `docs/cuda-cpp.md` lists where the functions stand.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// How the probes are assembled (see the module's text).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    /// `ptxas -c` apart, then `nvlink` (CUDA C++ with `-rdc` and `libgdaki_device.a`).
    Linked,
    /// One PTX module, assembled whole.
    OneModule,
}

/// What a kernel calling one function uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes spilled to local memory (spill stores; linked, the function's own or `lmem`).
    pub spill_bytes: u32,
    /// Bytes of stack frame.
    pub stack_bytes: u32,
}

/// `ptxas` and `nvlink` of one CUDA toolkit (or of PyPI's `nvidia-cuda-nvcc`).
#[derive(Debug, Clone)]
pub struct Assembler {
    /// The directory holding both.
    pub bin: PathBuf,
}

impl Assembler {
    /// The first of `dirs` holding an executable `ptxas` and `nvlink`.
    pub fn find(dirs: &[PathBuf]) -> Option<Assembler> {
        dirs.iter()
            .find(|d| d.join("ptxas").is_file() && d.join("nvlink").is_file())
            .map(|d| Assembler { bin: d.clone() })
    }

    /// `ptxas --version`'s last line.
    pub fn version(&self) -> std::io::Result<String> {
        let out = Command::new(self.bin.join("ptxas")).arg("--version").output()?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .to_string())
    }

    /// Assembles the probes of every `gdaki_*` function of `c_ptx` for `arch` (`sm_90`) in
    /// `mode`, in `work`; each function's usage by name.
    pub fn measure(&self, c_ptx: &str, arch: &str, mode: Mode, work: &Path) -> Result<BTreeMap<String, Usage>, String> {
        let functions = functions(c_ptx);
        if functions.is_empty() {
            return Err("the PTX declares no gdaki_* function".into());
        }
        // The probes pass 32- and 64-bit words; another width would be called wrongly.
        if let Some(f) = functions.iter().find(|f| f.params.iter().any(|&b| b != 32 && b != 64)) {
            return Err(format!("{}: a parameter of {:?} bits, not 32 or 64", f.name, f.params));
        }
        let probes = probes(&functions);
        let arch_flag = format!("-arch={arch}");
        let usages = match mode {
            Mode::OneModule => {
                let ptx = work.join("one-module.ptx");
                write(&ptx, &format!("{c_ptx}\n{probes}"))?;
                let log = run(Command::new(self.bin.join("ptxas"))
                    .args([arch_flag.as_str(), "-v"])
                    .arg(&ptx)
                    .arg("-o")
                    .arg(work.join("one-module.cubin")))?;
                parse_ptxas(&log)
            }
            Mode::Linked => {
                let (lib, kernels) = (work.join("library.ptx"), work.join("probes.ptx"));
                write(&lib, c_ptx)?;
                write(&kernels, &format!("{}{}\n{probes}", header(c_ptx), externs(&functions)))?;
                let mut library_log = String::new();
                for (ptx, obj) in [(&lib, "library.o"), (&kernels, "probes.o")] {
                    let log = run(Command::new(self.bin.join("ptxas"))
                        .args([arch_flag.as_str(), "-c", "-v"])
                        .arg(ptx)
                        .arg("-o")
                        .arg(work.join(obj)))?;
                    if obj == "library.o" {
                        library_log = log;
                    }
                }
                let log = run(Command::new(self.bin.join("nvlink"))
                    .args(["-v", arch_flag.as_str()])
                    .arg(work.join("probes.o"))
                    .arg(work.join("library.o"))
                    .arg("-o")
                    .arg(work.join("linked.cubin")))?;
                // nvlink's lmem leaves out what a function spills into its own stack frame:
                // that is in the library's assembly report.
                let spills = parse_function_spills(&library_log);
                let mut usages = parse_nvlink(&log);
                for (name, u) in usages.iter_mut() {
                    u.spill_bytes = u.spill_bytes.max(spills.get(name).copied().unwrap_or(0));
                }
                usages
            }
        };
        every_probe_reported(functions.iter().map(|f| f.name.as_str()), usages)
    }
    /// The usage of a CUDA C++ probe kernel per function that `header` (`gdaki_device.h`)
    /// declares, compiled by the command `compile(IN.cu, OUT.ptx)` gives
    /// (`tools/cuda/clang-kernel.sh IN.cu OUT.ptx`, which inlines gdaki's bitcode) and
    /// assembled whole for `arch`, in `work`. The probes include `gdaki_device.h`, found by the
    /// compiler's include path. A call left in the PTX is an error: nothing was inlined then.
    pub fn measure_inlined(
        &self,
        header: &str,
        compile: impl Fn(&Path, &Path) -> Command,
        arch: &str,
        work: &Path,
    ) -> Result<BTreeMap<String, Usage>, String> {
        let prototypes = prototypes(header);
        if prototypes.is_empty() {
            return Err("the header declares no gdaki_* device function".into());
        }
        let (cu, ptx) = (work.join("inlined-probes.cu"), work.join("inlined-probes.ptx"));
        write(&cu, &cpp_probes(&prototypes))?;
        run(&mut compile(&cu, &ptx))?;
        let text = std::fs::read_to_string(&ptx).map_err(|e| format!("{}: {e}", ptx.display()))?;
        // gdaki's own calls inside its functions (as in its Rust kernels) may stay; a call to
        // a function of the header means the boundary was not inlined.
        let called: Vec<_> = calls(&text).into_iter().filter(|c| c.starts_with("gdaki_")).collect();
        if !called.is_empty() {
            return Err(format!(
                "{} of the header's functions still called by the inlined probes: {}",
                called.len(),
                called.join(", ")
            ));
        }
        let log = run(Command::new(self.bin.join("ptxas"))
            .args([format!("-arch={arch}").as_str(), "-v"])
            .arg(&ptx)
            .arg("-o")
            .arg(work.join("inlined-probes.cubin")))?;
        every_probe_reported(prototypes.iter().map(|p| p.name.as_str()), parse_ptxas(&log))
    }
}

/// `usages`, if it has every one of `names`.
fn every_probe_reported<'a>(
    names: impl Iterator<Item = &'a str>,
    usages: BTreeMap<String, Usage>,
) -> Result<BTreeMap<String, Usage>, String> {
    let missing: Vec<_> = names.filter(|n| !usages.contains_key(*n)).collect();
    match missing.first() {
        Some(first) => Err(format!(
            "no usage reported for {} probes, the first {first}",
            missing.len()
        )),
        None => Ok(usages),
    }
}

/// One device function as the header declares it: its name and its parameters' C types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prototype {
    /// `gdaki_put_thread_gpu`, ...
    pub name: String,
    /// Each parameter's C type (`gdaki_dev_qp *`, `uint64_t`, ...).
    pub types: Vec<String>,
}

/// The `uint32_t gdaki_*(...)` device functions `header` declares (one per line, as
/// `gen-headers` writes them).
pub fn prototypes(header: &str) -> Vec<Prototype> {
    header
        .lines()
        .filter_map(|l| l.strip_prefix("GDAKI_DEVICE_FN uint32_t "))
        .filter_map(|rest| {
            let (name, params) = rest.split_once('(')?;
            let params = params.strip_suffix(");")?;
            let types = params
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty() && *p != "void")
                .map(|p| {
                    // The type is what precedes the parameter's name.
                    let name_at = p
                        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .map_or(0, |i| i + 1);
                    p[..name_at].trim().to_string()
                })
                .collect();
            Some(Prototype {
                name: name.trim().to_string(),
                types,
            })
        })
        .filter(|p| p.name.starts_with("gdaki_"))
        .collect()
}

/// A CUDA C++ probe kernel per prototype: its arguments loaded from the buffer its one
/// parameter points at (8 bytes each), the call, the status stored.
fn cpp_probes(prototypes: &[Prototype]) -> String {
    let mut s = String::from("#include \"gdaki_device.h\"\n\n");
    for p in prototypes {
        let args: Vec<_> = p
            .types
            .iter()
            .enumerate()
            .map(|(i, t)| format!("({t})a[{i}]"))
            .collect();
        s.push_str(&format!(
            "extern \"C\" __global__ void probe_{}(uint64_t *a) {{ *(uint32_t *)a = {}({}); }}\n",
            p.name,
            p.name,
            args.join(", ")
        ));
    }
    s
}

/// The functions a PTX module still calls (`call... name, (...)`), each once.
fn calls(ptx: &str) -> Vec<String> {
    let mut out: Vec<String> = ptx
        .lines()
        .filter_map(|l| l.trim().strip_prefix("call"))
        // `.uni (retval), name, (params);` or `.uni name, (params);`: the first word list
        // without a parenthesis ends with the name.
        .filter_map(|rest| rest.split(',').find(|t| !t.contains('(') && !t.trim().is_empty()))
        .filter_map(|t| t.split_whitespace().last())
        .map(|t| t.trim_end_matches(';').to_string())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Runs `cmd`: its stdout and stderr, or why it failed.
fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!("{cmd:?} failed:\n{text}"));
    }
    Ok(text)
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// One `extern "C"` function: its name and its parameters' widths (32 or 64 bits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// `gdaki_put_thread_gpu`, ...
    pub name: String,
    /// Bits of each parameter, in order.
    pub params: Vec<u32>,
}

/// The `gdaki_*` functions `ptx` defines (all return a 32-bit status) with their parameters'
/// widths (0 for a declaration this reader does not know).
pub fn functions(ptx: &str) -> Vec<Function> {
    let mut out = Vec::new();
    let mut lines = ptx.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.strip_prefix(".visible .func") else {
            continue;
        };
        let Some(name) = rest
            .trim()
            .strip_prefix("(.param .b32 func_retval0)")
            .map(|s| s.trim().trim_end_matches('('))
            .filter(|n| n.starts_with("gdaki_"))
        else {
            continue;
        };
        let mut params = Vec::new();
        for p in lines.by_ref() {
            let p = p.trim();
            if p.starts_with(')') {
                break;
            }
            // `.param .bN name`: N, or 0 for a form this reader does not know.
            let bits = p.split_whitespace().nth(1).and_then(|t| t.strip_prefix(".b"));
            params.push(bits.and_then(|n| n.parse().ok()).unwrap_or(0));
        }
        out.push(Function {
            name: name.to_string(),
            params,
        });
    }
    out
}

/// The module header of `ptx` (`.version`, `.target`, `.address_size`).
fn header(ptx: &str) -> String {
    ptx.lines()
        .filter(|l| l.starts_with(".version") || l.starts_with(".target") || l.starts_with(".address_size"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// `.extern .func` declarations of `functions`, for a module that only calls them.
fn externs(functions: &[Function]) -> String {
    functions
        .iter()
        .map(|f| {
            let params: Vec<_> = f
                .params
                .iter()
                .enumerate()
                .map(|(i, b)| format!(".param .b{b} {}_param_{i}", f.name))
                .collect();
            format!(
                ".extern .func (.param .b32 func_retval0) {}({});\n",
                f.name,
                params.join(", ")
            )
        })
        .collect()
}

/// A probe kernel per function: loads its arguments from the buffer its one parameter points
/// at (8 bytes each), calls it, stores the status.
fn probes(functions: &[Function]) -> String {
    let mut s = String::new();
    for f in functions {
        let n = f.params.len();
        s.push_str(&format!(
            ".visible .entry probe_{}(.param .u64 probe_args)\n{{\n\t.reg .b64 %pa<2>;\n\t.reg .b64 %pd<{}>;\n\t.reg .b32 %pr<{}>;\n",
            f.name,
            n + 1,
            n + 2
        ));
        s.push_str("\tld.param.u64 %pa0, [probe_args];\n\tcvta.to.global.u64 %pa1, %pa0;\n");
        for (i, b) in f.params.iter().enumerate() {
            let (reg, ty) = if *b == 64 { ("pd", "u64") } else { ("pr", "u32") };
            s.push_str(&format!("\tld.global.{ty} %{reg}{i}, [%pa1+{}];\n", 8 * i));
        }
        s.push_str("\t{\n");
        for (i, b) in f.params.iter().enumerate() {
            let reg = if *b == 64 { "pd" } else { "pr" };
            s.push_str(&format!("\t.param .b{b} p{i};\n\tst.param.b{b} [p{i}], %{reg}{i};\n"));
        }
        let args: Vec<_> = (0..n).map(|i| format!("p{i}")).collect();
        s.push_str(&format!(
            "\t.param .b32 rv;\n\tcall.uni (rv), {}, ({});\n\tld.param.b32 %pr{n}, [rv];\n\t}}\n",
            f.name,
            args.join(", ")
        ));
        s.push_str(&format!("\tst.global.u32 [%pa1], %pr{n};\n\tret;\n}}\n\n"));
    }
    s
}

/// Usages from `ptxas -v` of a whole module: each probe's entry.
fn parse_ptxas(log: &str) -> BTreeMap<String, Usage> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, Usage)> = None;
    for line in log.lines() {
        if let Some(name) = line
            .split("Compiling entry function 'probe_")
            .nth(1)
            .and_then(|r| r.split('\'').next())
        {
            current = Some((
                name.to_string(),
                Usage {
                    registers: 0,
                    spill_bytes: 0,
                    stack_bytes: 0,
                },
            ));
        } else if let Some((_, u)) = current.as_mut().filter(|_| line.contains("bytes stack frame")) {
            let n = numbers(line);
            u.stack_bytes = n.first().copied().unwrap_or(0);
            u.spill_bytes = n.get(1).copied().unwrap_or(0);
        } else if line.contains("Used ") && line.contains(" registers") {
            if let Some((name, mut u)) = current.take() {
                u.registers = numbers(line.split("Used ").nth(1).unwrap_or_default())
                    .first()
                    .copied()
                    .unwrap_or(0);
                out.insert(name, u);
            }
        }
    }
    out
}

/// Spill stores (bytes) of each `gdaki_*` function from `ptxas -c -v` of the library:
/// "Function properties for X" then "F bytes stack frame, S bytes spill stores, ...".
fn parse_function_spills(log: &str) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    let mut name: Option<&str> = None;
    for line in log.lines() {
        if let Some(n) = line.split("Function properties for ").nth(1) {
            name = Some(n.trim()).filter(|n| n.starts_with("gdaki_"));
        } else if let Some(n) = name.take().filter(|_| line.contains("bytes spill stores")) {
            out.insert(n.to_string(), numbers(line).get(1).copied().unwrap_or(0));
        }
    }
    out
}

/// Usages from `nvlink -v`: "Function properties for 'probe_X':" then "used N registers, ...,
/// S stack, ..., L bytes lmem".
fn parse_nvlink(log: &str) -> BTreeMap<String, Usage> {
    let mut out = BTreeMap::new();
    let mut name: Option<String> = None;
    for line in log.lines() {
        if let Some(n) = line
            .split("Function properties for 'probe_")
            .nth(1)
            .and_then(|r| r.split('\'').next())
        {
            name = Some(n.to_string());
        } else if let Some(n) = name
            .take()
            .filter(|_| line.contains("used ") && line.contains(" registers"))
        {
            let field = |unit: &str| {
                line.split(',')
                    .find(|part| part.trim_end().ends_with(unit))
                    .and_then(|part| numbers(part).first().copied())
                    .unwrap_or(0)
            };
            out.insert(
                n,
                Usage {
                    registers: field("registers"),
                    spill_bytes: field("bytes lmem"),
                    stack_bytes: field("stack"),
                },
            );
        }
    }
    out
}

/// The decimal numbers in `s`, in order.
fn numbers(s: &str) -> Vec<u32> {
    s.split(|c: char| !c.is_ascii_digit())
        .filter(|t| !t.is_empty())
        .filter_map(|t| t.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = ".version 8.4\n.target sm_90\n.address_size 64\n\n\
        .visible .func  (.param .b32 func_retval0) gdaki_put_thread_gpu(\n\
        \t.param .b64 gdaki_put_thread_gpu_param_0,\n\t.param .b32 gdaki_put_thread_gpu_param_1\n)\n{\n\tret;\n}\n\
        .visible .func _RNvother(\n\t.param .b64 x\n)\n{\n\tret;\n}\n";

    #[test]
    fn functions_and_probes_are_read_from_the_ptx() {
        let f = functions(PTX);
        assert_eq!(
            f,
            [Function {
                name: "gdaki_put_thread_gpu".into(),
                params: vec![64, 32]
            }]
        );
        let p = probes(&f);
        assert!(p.contains(".visible .entry probe_gdaki_put_thread_gpu(.param .u64 probe_args)"));
        assert!(p.contains("ld.global.u64 %pd0, [%pa1+0];") && p.contains("ld.global.u32 %pr1, [%pa1+8];"));
        assert!(p.contains("call.uni (rv), gdaki_put_thread_gpu, (p0, p1);"));
        assert_eq!(
            externs(&f),
            ".extern .func (.param .b32 func_retval0) gdaki_put_thread_gpu(.param .b64 gdaki_put_thread_gpu_param_0, \
             .param .b32 gdaki_put_thread_gpu_param_1);\n"
        );
        assert_eq!(header(PTX), ".version 8.4\n.target sm_90\n.address_size 64\n");
    }

    #[test]
    fn prototypes_and_cpp_probes_come_from_the_header() {
        let header = "#define GDAKI_DEVICE_FN __device__\n\
            GDAKI_DEVICE_FN uint32_t gdaki_put_thread_gpu(gdaki_dev_qp *qp, uint64_t dst, const uint8_t *data);\n\
            GDAKI_DEVICE_FN uint32_t gdaki_commit_block_cta(gdaki_dev_qp *qp, gdaki_block_scratch *block_scratch);\n\
            uint32_t gdaki_host_only(void);\n";
        let p = prototypes(header);
        assert_eq!(
            p[0],
            Prototype {
                name: "gdaki_put_thread_gpu".into(),
                types: vec!["gdaki_dev_qp *".into(), "uint64_t".into(), "const uint8_t *".into()]
            }
        );
        assert_eq!(p.len(), 2);
        let cu = cpp_probes(&p);
        assert!(cu.contains(
            "extern \"C\" __global__ void probe_gdaki_put_thread_gpu(uint64_t *a) { *(uint32_t *)a = \
             gdaki_put_thread_gpu((gdaki_dev_qp *)a[0], (uint64_t)a[1], (const uint8_t *)a[2]); }"
        ));
        let ptx = "\tcall.uni (retval0), gdaki_put_warp_exclusive, (param0, param1);\n\
            \tcall.uni gdaki_x, (param0);\n\tcall.uni (retval0), gdaki_put_warp_exclusive, (param0);\n";
        assert_eq!(calls(ptx), ["gdaki_put_warp_exclusive", "gdaki_x"]);
        assert!(calls("\tret;\n").is_empty());
    }

    #[test]
    fn both_tools_reports_are_read() {
        let ptxas = "ptxas info    : Compiling entry function 'probe_gdaki_a' for 'sm_90'\n\
            ptxas info    : Function properties for probe_gdaki_a\n\
            \x20   16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
            ptxas info    : Used 119 registers, used 1 barriers, 16 bytes cumulative stack size\n";
        assert_eq!(
            parse_ptxas(ptxas)["gdaki_a"],
            Usage {
                registers: 119,
                spill_bytes: 4,
                stack_bytes: 16
            }
        );
        let nvlink = "nvlink info    : Function properties for 'probe_gdaki_b':\n\
            nvlink info    : used 245 registers, used 1 barriers, 40 stack, 0 bytes smem, 536 bytes cmem[0], \
            1036 bytes cmem[2], 8 bytes lmem\n";
        let lib = "ptxas info    : Function properties for gdaki_b\n\
            \x20   240 bytes stack frame, 236 bytes spill stores, 236 bytes spill loads\n";
        assert_eq!(parse_function_spills(lib)["gdaki_b"], 236);
        assert_eq!(
            parse_nvlink(nvlink)["gdaki_b"],
            Usage {
                registers: 245,
                spill_bytes: 8,
                stack_bytes: 40
            }
        );
    }
}
