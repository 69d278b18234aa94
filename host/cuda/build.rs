//! Builds `gdaki-device` to PTX with `gdaki-build` (the helper users build their own kernel
//! crates with) and hands the result to the library, which embeds it. Host builds never need
//! CUDA: when the PTX compiler pair is missing, the library still builds for CPU use and every
//! GPU entry point reports how to get the PTX. Knobs: see `gdaki-build` (`GDAKI_PTX=off`, ...).
use std::env;
use std::fs;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest
        .ancestors()
        .nth(2)
        .expect("host/cuda/ lives in the workspace")
        .to_path_buf();
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
    for var in gdaki_build::KNOBS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    // The PTX stays at target/ptx/gdaki_device.ptx too, where tools and the GPU bundle find it.
    let path = gdaki_build::nested_target_dir().join("gdaki_device.ptx");
    let build = gdaki_build::PtxBuild::new(&workspace).package("gdaki-device");
    let (ptx, missing) = match build.build(&path) {
        Ok(ptx) => (Some(ptx), String::new()),
        Err(e @ gdaki_build::BuildError::Missing(_)) => {
            println!("cargo:warning=gdaki: {e}; CPU mode only");
            (None, e.to_string())
        }
        Err(e) => panic!("gdaki-device: {e}"),
    };
    // The same kernels as machine code for the PTX's architecture, where a ptxas is at hand:
    // GPUs of that architecture load it as it is, without the driver's minute-long compile of
    // the PTX on each machine's first run. Without one the PTX alone serves (said once).
    let sass = match ptx.as_ref().map(gdaki_build::assemble) {
        Some(Ok(sass)) => Some(sass),
        Some(Err(gdaki_build::BuildError::Missing(why))) => {
            println!("cargo:warning=gdaki: kernels as PTX only ({why}): GPUs compile them on first use");
            None
        }
        // Another toolkit's ptxas may refuse what the driver's compiler takes: the PTX stays.
        Some(Err(e)) => {
            let first = e.to_string().lines().next().unwrap_or_default().to_string();
            println!("cargo:warning=gdaki: kernels as PTX only (assembling them failed: {first})");
            None
        }
        None => None,
    };
    fs::write(
        out_dir.join("gdaki_device.cubin"),
        sass.as_ref().map_or(&[][..], |s| &s.bytes[..]),
    )
    .expect("write OUT_DIR/gdaki_device.cubin");
    fs::write(
        out_dir.join("gdaki_device_sass_arch.txt"),
        sass.as_ref().map_or("", |s| s.arch.as_str()),
    )
    .expect("write OUT_DIR/gdaki_device_sass_arch.txt");
    let ptx = ptx.map(|p| p.text).unwrap_or_default();
    fs::write(out_dir.join("gdaki_device.ptx"), ptx).expect("write OUT_DIR/gdaki_device.ptx");
    // The data path as `extern "C"` functions, without gdaki's kernels: what CUDA C++ links
    // (tools/cuda/build-device-lib.sh makes libgdaki_device.a of it). Only when the first
    // build found the toolchain.
    let c_path = gdaki_build::nested_target_dir().join("gdaki_device_c.ptx");
    let bitcode = gdaki_build::nested_target_dir().join("gdaki_device_c.bc");
    let c_ptx = if missing.is_empty() {
        // Its LLVM bitcode beside it, for clang-CUDA builds that inline it (docs/cuda-cpp.md).
        let c_build = gdaki_build::PtxBuild::new(&workspace)
            .package("gdaki-device")
            .no_default_features()
            .feature("c-abi")
            .bitcode(&bitcode);
        c_build
            .build(&c_path)
            .unwrap_or_else(|e| panic!("gdaki-device (c-abi): {e}"))
            .text
    } else {
        String::new()
    };
    fs::write(out_dir.join("gdaki_device_c.ptx"), c_ptx).expect("write OUT_DIR/gdaki_device_c.ptx");
    println!(
        "cargo:rustc-env=GDAKI_C_BITCODE={}",
        if missing.is_empty() {
            bitcode.display().to_string()
        } else {
            String::new()
        }
    );
    fs::write(out_dir.join("ptx_missing.txt"), missing).expect("write OUT_DIR/ptx_missing.txt");
}
