//! `gdaki`: the host library of the gdaki kernel-initiated RDMA runtime.
//!
//! The host does the control phase once (open a provider, register memory, create and connect
//! queues, export them to the GPU); GPU kernels built from `gdaki-device` then drive the HCA
//! themselves. This crate also embeds the device crate's PTX ([`ptx`]), talks to the CUDA driver
//! through run-time loading ([`cuda`], no CUDA needed to build) and describes what the machine
//! offers ([`system`], [`provider`]), which is what `doctor` reports.
//!
//! Where to start: [`Context`] (open a provider, register memory, create queues), then
//! [`QueuePair::export_gpu`] for your own kernels (`docs/own-kernels.md`), or
//! [`QueuePair::cpu`] to post from a CPU thread with the same device code, as here. This runs
//! anywhere: the soft provider models a ConnectX in software, and CPU mode needs no GPU.
//!
//! ```
//! use gdaki::{Access, Context, Provider, QpConfig};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = Context::open(Provider::Soft)?;
//! let mr = ctx.alloc_region(8192, Access::ALL)?;
//! mr.write(0, b"hello, gdaki")?;
//! let cq = ctx.create_cq(1024)?; // at least the send queue's depth (1024 by default)
//! let qp = ctx.create_qp(&cq, QpConfig::default())?;
//! qp.connect(&qp.endpoint())?; // loopback: the QP writes into its own context's memory
//! // SAFETY: this thread is the QP's only poster (exclusive mode), and the QP outlives `dev`.
//! let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }?;
//! let ticket = dev.put(mr.remote(4096), mr.local(0), 12)?; // an RDMA WRITE of 12 bytes
//! dev.wait(ticket)?; // its completion, polled from the CQ
//! let mut landed = [0u8; 12];
//! mr.read(4096, &mut landed)?;
//! assert_eq!(&landed, b"hello, gdaki");
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod context;
pub mod cuda;
pub(crate) mod devx;
mod doorbell;
pub mod error;
pub mod handshake;
pub mod memory;
pub(crate) mod mlx5;
pub mod provider;
pub mod ptx;
pub mod queue;
mod shared_copy;
pub mod soft;
pub mod system;
pub mod wire;

pub use context::{Context, ContextOptions};
pub use devx::{DeviceReport, Requirement};
pub use error::{Error, Result};
pub use memory::{Access, MemoryRegion};
pub use mlx5::GID_INDEX_VAR;
pub use provider::{DoorbellHandler, ExecutionMode, Provider, Selection};
pub use queue::{CompletionQueue, Endpoint, GpuQp, QpConfig, QpCounters, QpState, QueuePair, Rings};

/// Locks a mutex, taking it over if a thread panicked while holding it (the data it guards
/// stays consistent at every unlock point).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A non-zero 64-bit secret from the OS generator, or `None` where it fails (a secret must not
/// fall back to something guessable as [`random_u32`] does).
pub(crate) fn random_secret() -> Option<u64> {
    loop {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).ok()?;
        match u64::from_ne_bytes(b) {
            0 => continue,
            s => return Some(s),
        }
    }
}

/// 32 random bits from the OS.
pub(crate) fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // The OS generator only fails on exotic platforms; fall back to a clock-derived value there
    // rather than refusing to register memory.
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0x9e37_79b9);
        b = t.rotate_left(13).wrapping_mul(0x9e37_79b9).to_ne_bytes();
    }
    u32::from_ne_bytes(b)
}
