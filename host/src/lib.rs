//! `gdaki`: the host library of the gdaki kernel-initiated RDMA runtime.
//!
//! The host does the control phase once (open a provider, register memory, create and connect
//! queues, export them to the GPU); GPU kernels built from `gdaki-device` then drive the HCA
//! themselves. This crate also embeds the device crate's PTX ([`ptx`]), talks to the CUDA driver
//! through run-time loading ([`cuda`], no CUDA needed to build) and describes what the machine
//! offers ([`system`], [`provider`]), which is what `doctor` reports.
//!
//! ```no_run
//! use gdaki::{Access, Context, Provider, QpConfig};
//! # fn main() -> gdaki::Result<()> {
//! let ctx = Context::open(Provider::Auto)?;
//! let mr = ctx.alloc_region(1 << 20, Access::ALL)?;
//! let cq = ctx.create_cq(1024)?;
//! let qp = ctx.create_qp(&cq, QpConfig::default())?;
//! qp.connect(&qp.endpoint())?; // loopback
//! // CPU mode: post from this thread with the device crate's API.
//! let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }?;
//! let t = dev.put(mr.remote(4096), mr.local(0), 4096).expect("put");
//! dev.wait(t).expect("completion");
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
