//! Builds the kernel crate to `OUT_DIR/own_kernels.ptx` (empty where the PTX toolchain is
//! missing: the example then runs in CPU mode only).
fn main() {
    let kernels = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    gdaki_build::PtxBuild::new(kernels).build_script("own_kernels");
}
