//! The kernels of the `own-kernel` example: what a crate of your own GPU kernels looks like.
//! It depends on `gdaki-device`, writes the work once as plain Rust ([`scatter`]), and wraps
//! it in an `extern "ptx-kernel"` entry point for the GPU. The host crate builds this crate to
//! PTX with `gdaki-build` and, in CPU mode, calls [`scatter`] from CPU threads instead.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, stdarch_nvptx))]

use gdaki_device::{Local, Qp, Remote, Sharing};

/// Poster `t` puts chunk `t` (`chunk` bytes at offset `t * chunk`) of `src` to `dst` on `qp`
/// and waits for it. Returns a `gdaki_device::status` code (0: done).
pub fn scatter<M: Sharing>(qp: Qp<M>, dst: Remote, src: Local, chunk: u64, t: u64) -> u32 {
    let at = t * chunk;
    match qp.put(dst.offset(at), src.offset(at), chunk) {
        Ok(ticket) => match qp.wait(ticket) {
            Ok(()) => gdaki_device::status::CODE_OK,
            Err(e) => e.code(),
        },
        Err(e) => e.code(),
    }
}

/// [`scatter`] by every thread of the grid on one QP shared across the grid; thread `t`
/// writes its status to `status[t]`.
///
/// # Safety
/// `qp` is a handle exported to this GPU and used by no one else during the launch; `src` and
/// `dst` hold `chunk` bytes per thread of the grid under the keys given; `status` holds one
/// u32 per thread.
#[cfg(target_arch = "nvptx64")]
#[no_mangle]
pub unsafe extern "ptx-kernel" fn own_scatter(
    qp: *mut gdaki_layout::DevQp,
    dst: u64,
    rkey: u32,
    src: u64,
    lkey: u32,
    chunk: u64,
    status: *mut u32,
) {
    use core::arch::nvptx::{_block_dim_x, _block_idx_x, _thread_idx_x};
    // SAFETY: special registers are always readable.
    let t = unsafe { _block_idx_x() as u64 * _block_dim_x() as u64 + _thread_idx_x() as u64 };
    // SAFETY: the handle is live and shared across the grid only (contract).
    let qp = unsafe { Qp::<gdaki_device::Gpu>::from_raw(qp) };
    let code = scatter(qp, Remote { addr: dst, rkey }, Local { addr: src, lkey }, chunk, t);
    // SAFETY: one status word per thread (contract).
    unsafe { status.add(t as usize).write_volatile(code) };
}
