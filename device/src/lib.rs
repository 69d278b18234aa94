//! `gdaki-device`: the gdaki data path, written once and compiled twice: to PTX for GPU kernels
//! (`nvptx64-nvidia-cuda`) and to the host, where CPU threads run the very same code (CPU mode,
//! tests). Posters reserve send-queue slots, write mlx5 WQEs, ring the NIC doorbell (or publish
//! to a CPU proxy) and poll completions, with no CPU on the data path.
//!
//! - [`qp::Qp`]: a queue pair in a [`sharing`] mode ([`Exclusive`], [`Cta`], [`Gpu`]): the
//!   high-level operations (`put`, `put_inline`, `put_signal`, `signal`, `get`,
//!   `atomic_fetch_add`, `atomic_compare_swap`, `wait`, `quiet`; `fenced` and `deferred`
//!   handles) and the low-level protocol under them (`reserve`, `wqe_prepare_*`, `mark_ready`,
//!   `submit`, `ring`, `poll_one`, `poll_at`).
//! - [`rq::Rq`]: a queue pair's receive queue (`post_recv`, `poll`): the two-sided half, with
//!   `Qp::send`, `send_imm`, `send_inline` and `write_imm` on the sending side.
//! - [`socket::Socket`]: a reliable byte stream over a queue pair (`send`, `recv`, partial
//!   results, orderly close, reset; `docs/sockets.md`).
//! - [`scope`]: execution scopes ([`Thread`], [`Warp`], [`Block`]): who posts together.
//! - [`status`]: tickets and the bounded outcome of every wait.
//! - [`arch`]: one module per target, barriers named by purpose.
//! - [`copier`]: the soft HCA's persistent copy kernel body (GPU payloads).
//! - [`perf`]: the perftest loops (`put_bw`, `write_lat`), shared by kernels and CPU mode.
//! - `kernels`: the PTX entry points (nvptx64 only, feature `kernels`), in one place.
//! - [`ffi`]: the data path as `extern "C"` functions for CUDA C++ (feature `c-abi` on
//!   nvptx64; always on the host, thread scope).
//!
//! Where to start: a kernel gets a [`Qp`] from the handle the host exported
//! (`gdaki::QueuePair::export_gpu`) and posts; `docs/own-kernels.md` and `examples/own-kernel`
//! walk through a whole kernel, in Rust and in CUDA C++. What a thread of such a kernel does:
//!
//! ```no_run
//! use gdaki_device::{Cta, Local, Qp, Remote};
//!
//! /// Each thread writes its own `len`-byte slice to the peer and waits for it to land.
//! fn put_my_slice(qp: &Qp<Cta>, dst: Remote, src: Local, thread: u64, len: u64) -> Result<(), &'static str> {
//!     let at = thread * len;
//!     let dst = Remote { addr: dst.addr + at, ..dst };
//!     let src = Local { addr: src.addr + at, ..src };
//!     let ticket = qp.put(dst, src, len).map_err(|_| "the send queue is full or the QP failed")?;
//!     qp.wait(ticket).map_err(|_| "the put completed with an error or timed out")
//! }
//! ```
//! (`no_run`: a `Qp` comes from a host that created the queues; `gdaki`'s front page runs the
//! same calls in CPU mode.)
#![no_std]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, link_llvm_intrinsics)
)]
#![warn(missing_docs)]

pub mod arch;
pub mod copier;
pub(crate) mod cq;
#[cfg(any(not(target_arch = "nvptx64"), feature = "c-abi"))]
pub mod ffi;
#[cfg(all(target_arch = "nvptx64", feature = "kernels"))]
pub mod kernels;
pub mod perf;
pub mod qp;
pub mod rq;
pub mod scope;
pub mod sharing;
pub mod socket;
pub mod status;

pub use qp::{AtomicOp, DoorbellWrites, Local, Qp, Remote, MAX_INLINE, MAX_SEND_INLINE};
pub use rq::{Recv, RecvBuf, RecvKind, Rq};
pub use scope::{Block, Scope, Thread, Warp};
pub use sharing::{Cta, Exclusive, Gpu, Sharing};
pub use status::{CqeError, PostError, Ticket, WaitError};

/// Makes this thread's earlier writes to host memory visible to the HCA before what it posts
/// next (a system-scope fence). Needed only on a QP whose rings are in GPU memory
/// ([`gdaki_layout::handle::QP_RINGS_IN_GPU_MEMORY`]), where posting fences at GPU scope, and
/// only for data the kernel itself wrote into host memory and then puts or signals from.
#[inline(always)]
pub fn publish_host_writes() {
    arch::to_device_barrier();
}

/// The handler's panic on the GPU: trap the warp. Only the PTX build needs it (the host build
/// links `std`'s handler); the device code does not panic on valid handles by construction.
#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // SAFETY: `trap` aborts the kernel; it has no operands and touches no memory.
    unsafe { core::arch::asm!("trap;", options(noreturn)) }
}
