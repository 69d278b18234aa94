//! The generated headers: current with the Rust sources, valid C and C++ (the layout check and
//! the host API's gdaki.h), valid CUDA (clang in device-only mode), and declaring exactly the
//! functions the Rust PTX defines, with the same parameter lists. Needs gcc, g++ and clang-22 (tools/setup.sh installs them).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use gdaki_tools::headers::{self, HOST_HEADER, LAYOUT_CHECK_HEADER};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn include_dir() -> PathBuf {
    workspace().join("device/include")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gdaki-headers-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (run tools/setup.sh: it installs gcc, g++ and clang-22)"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// clang-22 compiling CUDA for the device only, with no CUDA installation.
fn clang_cuda() -> Command {
    let mut cmd = Command::new("clang-22");
    cmd.args([
        "-x",
        "cuda",
        "--cuda-device-only",
        "-nocudainc",
        "-nocudalib",
        "--cuda-gpu-arch=sm_90",
    ]);
    cmd
}

#[test]
fn checked_in_headers_are_what_generation_gives() {
    let stale = headers::generate(&workspace()).unwrap().stale(&workspace());
    assert!(
        stale.is_empty(),
        "{stale:?} not current: run `cargo run -p gdaki-tools --bin gen-headers` and commit the result"
    );
}

#[test]
fn layout_check_and_host_header_compile_as_c_and_cpp() {
    let dir = scratch("cc");
    let src = dir.join("check.c");
    std::fs::write(
        &src,
        format!("#include \"{LAYOUT_CHECK_HEADER}\"\n#include \"{HOST_HEADER}\"\nint main(void) {{ return 0; }}\n"),
    )
    .unwrap();
    let inc = workspace();
    run(Command::new("gcc")
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-fsyntax-only",
            "-I",
        ])
        .arg(&inc)
        .arg("-I")
        .arg(include_dir())
        .arg(&src));
    run(Command::new("g++")
        .args([
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-x",
            "c++",
            "-I",
        ])
        .arg(&inc)
        .arg("-I")
        .arg(include_dir())
        .arg(&src));
}

/// Every function's `.param` types (`b32`, `b64`) and return type, by name, from PTX text:
/// `.visible .func` definitions (rustc) or `.extern .func` declarations (clang).
fn signatures(ptx: &str, keyword: &str) -> BTreeMap<String, (String, Vec<String>)> {
    let mut out = BTreeMap::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(keyword) {
        rest = &rest[at + keyword.len()..];
        let header = rest.trim_start();
        let (ret, after) = match header.strip_prefix('(') {
            Some(r) => {
                let (inside, after) = r.split_once(')').unwrap();
                (inside.split_whitespace().nth(1).unwrap_or("").to_string(), after)
            }
            None => (String::new(), header),
        };
        let after = after.trim_start();
        let name: String = after.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let Some(open) = after.find('(') else { break };
        let close = after[open..].find(')').unwrap() + open;
        let params = after[open + 1..close]
            .split(',')
            .filter_map(|p| p.split_whitespace().nth(1).map(str::to_string))
            .collect();
        out.insert(name, (ret, params));
    }
    out
}

#[test]
fn clang_cuda_declarations_match_the_rust_definitions() {
    let rust_ptx = match gdaki::ptx::c_abi_ptx() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIPPED (no PTX in this build): {e}");
            return;
        }
    };
    assert!(
        gdaki_build::unresolved(rust_ptx).is_empty(),
        "the C ABI PTX is self-contained"
    );
    let rust: BTreeMap<_, _> = signatures(rust_ptx, ".visible .func")
        .into_iter()
        .filter(|(name, _)| name.starts_with("gdaki_"))
        .collect();
    let declared = headers::functions();
    let names: Vec<&String> = declared.iter().map(|f| &f.2).collect();
    assert_eq!(rust.keys().collect::<Vec<_>>(), {
        let mut n = names.clone();
        n.sort();
        n
    });

    // A kernel calling every declared function, so clang emits each declaration.
    let mut calls = String::new();
    let tables = [
        ("qp", gdaki_device::ffi::OPERATIONS),
        ("sock", gdaki_device::ffi::socket::OPERATIONS),
    ];
    for (handle, op) in tables.iter().flat_map(|(h, ops)| ops.iter().map(move |op| (*h, op))) {
        for scope in gdaki_device::ffi::SCOPES {
            for mode in gdaki_device::ffi::MODES {
                let extra = usize::from(scope == "block");
                let mut args = vec![handle];
                args.extend(vec!["0"; op.params.len() + extra]);
                calls.push_str(&format!(
                    "  r += gdaki_{}_{scope}_{mode}({});\n",
                    op.name,
                    args.join(", ")
                ));
            }
        }
    }
    for op in gdaki_device::ffi::RECV_OPERATIONS {
        for mode in gdaki_device::ffi::MODES {
            let mut args = vec!["rq"];
            args.extend(vec!["0"; op.params.len()]);
            calls.push_str(&format!("  r += gdaki_{}_{mode}({});\n", op.name, args.join(", ")));
        }
    }
    for op in gdaki_device::ffi::socket::SERVICE_OPERATIONS {
        for scope in gdaki_device::ffi::SCOPES {
            let mut args = vec!["svc"];
            args.extend(vec!["0"; op.params.len() + usize::from(scope == "block")]);
            calls.push_str(&format!("  r += gdaki_{}_{scope}({});\n", op.name, args.join(", ")));
        }
    }
    let dir = scratch("clang");
    let src = dir.join("all.cu");
    std::fs::write(
        &src,
        format!(
            "#define __device__ __attribute__((device))\n#define __global__ __attribute__((global))\n\
             #include \"gdaki_layout_check.h\"\n\
             __global__ void all(gdaki_dev_qp *qp, gdaki_dev_rq *rq, gdaki_dev_socket *sock, const gdaki_dev_socket_service *svc, uint32_t *out) {{\n  uint32_t r = 0;\n{calls}  *out = r;\n}}\n"
        ),
    )
    .unwrap();
    let ptx = dir.join("all.ptx");
    run(clang_cuda()
        .args([
            "-Xclang",
            "-target-feature",
            "-Xclang",
            "+ptx84",
            "-std=c++17",
            "-Wall",
            "-Werror",
            "-S",
            "-I",
        ])
        .arg(include_dir())
        .arg(&src)
        .arg("-o")
        .arg(&ptx));
    let clang = signatures(&std::fs::read_to_string(&ptx).unwrap(), ".extern .func");
    assert_eq!(clang.len(), rust.len(), "clang declared every function");
    for (name, sig) in &rust {
        assert_eq!(clang.get(name), Some(sig), "{name}: C declaration vs Rust definition");
    }

    // The test kernels of the GPU suite compile here too (gin.cu through gdaki_gin.cuh), with
    // declarations of the CUDA intrinsics they use in place of CUDA's headers.
    let shim = dir.join("shim.h");
    std::fs::write(
        &shim,
        "#define __device__ __attribute__((device))\n#define __global__ __attribute__((global))\n\
         #define __host__ __attribute__((host))\n#define __shared__ __attribute__((shared))\n\
         struct gdaki_dim { unsigned x, y, z; };\nextern const __device__ gdaki_dim threadIdx;\n\
         __device__ int __all_sync(unsigned, int);\n__device__ unsigned __shfl_sync(unsigned, unsigned, int);\n__device__ unsigned long long __shfl_sync(unsigned, unsigned long long, int);\n\
         __device__ void __syncthreads();\n__device__ void __syncwarp(unsigned = 0xffffffffu);\n__device__ int __syncthreads_and(int);\n\
         struct int4 { int x, y, z, w; };\n__device__ int4 __ldcv(const int4 *);\n__device__ char __ldcv(const char *);\n\
         __device__ void __threadfence_system();\nextern const __device__ gdaki_dim blockIdx, blockDim;\n\
         __device__ unsigned long long atomicAdd_system(unsigned long long *, unsigned long long);\n\
         __device__ unsigned long long atomicAdd(unsigned long long *, unsigned long long);\n\
         __device__ unsigned atomicCAS(unsigned *, unsigned, unsigned);\n",
    )
    .unwrap();
    for kernels in ["c_abi.cu", "gin.cu", "two_sided.cu", "socket.cu"] {
        let tests = workspace().join("host/tests/cuda");
        run(clang_cuda()
            .args(["-std=c++17", "-Wall", "-Werror", "-fsyntax-only", "-include"])
            .arg(&shim)
            .arg("-I")
            .arg(include_dir())
            .arg("-I")
            .arg(&tests)
            .arg(tests.join(kernels)));
    }
    // A kernel written for NCCL's GIN device API, over gdaki_nccl_gin.cuh (with its stand-ins
    // for libcu++'s names: no CUDA here).
    let programs = workspace().join("examples/shmem/programs");
    run(clang_cuda()
        .args(["-std=c++17", "-Wall", "-Werror", "-fsyntax-only", "-include"])
        .arg(&shim)
        .arg("-I")
        .arg(include_dir())
        .arg(programs.join("gin_nccl_kernel.cuh")));
}

/// `tools/cuda/clang-kernel.sh` (docs/cuda-cpp.md, "Inlined, with clang"): the posting
/// benchmark's C++ kernels compile with gdaki's bitcode inlined, no call into a gdaki function
/// left; without the bitcode the script says where it should be and fails.
#[test]
fn clang_kernel_script_inlines_gdaki_into_the_kernels() {
    let test = "clang_kernel_script_inlines_gdaki_into_the_kernels";
    let Some(bitcode) = gdaki::cuda::ptx::c_abi_bitcode_path() else {
        eprintln!("SKIPPED (no PTX toolchain, so no bitcode: tools/setup.sh installs it): {test}");
        return;
    };
    let dir = scratch("inline");
    let ptx = dir.join("post_rate.ptx");
    let script = workspace().join("tools/cuda/clang-kernel.sh");
    // The command the doc shows, with the bitcode of this build's target directory.
    run(Command::new(&script)
        .arg(workspace().join("host/benches/cuda/post_rate.cu"))
        .arg(&ptx)
        .env("GDAKI_BITCODE", &bitcode));
    let text = std::fs::read_to_string(&ptx).unwrap();
    for kernel in ["warp_exclusive", "thread_cta", "block_exclusive"] {
        assert!(
            text.contains(&format!(".entry gdaki_post_rate_{kernel}(")),
            "no kernel {kernel} in the PTX"
        );
    }
    // Calls into gdaki's functions left in a PTX module.
    let gdaki_calls = |ptx: &str| -> Vec<String> {
        ptx.lines()
            .filter(|l| l.trim_start().starts_with("call") && l.contains("gdaki_"))
            .map(str::to_string)
            .collect()
    };
    let calls = gdaki_calls(&text);
    assert!(calls.is_empty(), "calls into gdaki left: {calls:?}");

    // Another target: clang compiles the sm_90 bitcode for it, inlined all the same.
    let ptx100 = dir.join("post_rate_sm100.ptx");
    run(Command::new(&script)
        .arg(workspace().join("host/benches/cuda/post_rate.cu"))
        .arg(&ptx100)
        .env("GDAKI_BITCODE", &bitcode)
        .env("GDAKI_CUDA_ARCH", "sm_100")
        .env("GDAKI_PTX_VERSION", "ptx86"));
    let text = std::fs::read_to_string(&ptx100).unwrap();
    assert!(text.lines().any(|l| l.trim() == ".target sm_100"), "not sm_100 PTX");
    let calls = gdaki_calls(&text);
    assert!(calls.is_empty(), "calls into gdaki left in the sm_100 PTX: {calls:?}");

    let out = Command::new(&script)
        .arg(workspace().join("host/benches/cuda/post_rate.cu"))
        .arg(dir.join("never.ptx"))
        .env("GDAKI_BITCODE", dir.join("no-such.bc"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("no-such.bc is missing or empty"), "{said}");
    assert!(!dir.join("never.ptx").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
