//! `gdaki-device`: the gdaki data path, written once and compiled twice: to PTX for GPU kernels
//! (`nvptx64-nvidia-cuda`) and to the host, where CPU threads run the very same code (CPU mode,
//! tests). GPU threads reserve send-queue slots, write mlx5 WQEs, ring the NIC doorbell (or
//! publish to a CPU proxy) and poll completions, with no CPU on the data path.
//!
//! Kernels live in [`kernels`] (compiled only for nvptx64); the PTX file built from this crate
//! is embedded into the host library `gdaki` at build time.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, stdarch_nvptx, asm_experimental_arch))]
#![warn(missing_docs)]

#[cfg(target_arch = "nvptx64")]
pub mod kernels;

/// The handler's panic on the GPU: trap the warp. Only the PTX build needs it (the host build
/// links `std`'s handler); the device code never panics on valid handles by construction.
#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // SAFETY: `trap` aborts the kernel; it has no operands and touches no memory.
    unsafe { core::arch::asm!("trap;", options(noreturn)) }
}
