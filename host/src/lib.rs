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
#[cfg(test)]
mod devx_tests;
mod doorbell;
pub mod error;
pub mod handshake;
pub mod memory;
mod options;
pub mod peer;
pub mod provider;
pub mod queue;
mod shared_copy;
pub mod socket;
pub mod stream;
pub mod system;

/// The CUDA driver, gdaki's kernels and the embedded PTX (`gdaki-cuda`, re-exported).
pub mod cuda {
    pub use gdaki_cuda::*;
}
pub use gdaki_cuda::ptx;
pub use gdaki_devx::wire;

pub use context::{Context, ContextOptions};
pub use error::{Error, Result};
pub use gdaki_devx::{Access, DeviceReport, Requirement};
pub use gdaki_mlx5::GID_INDEX_VAR;
pub use memory::MemoryRegion;
pub use peer::{PeerExport, PeerMapping, PEER_EXPORT_BYTES};
pub use provider::{DoorbellHandler, ExecutionMode, Provider, Selection};
pub use queue::{
    CompletionQueue, Endpoint, GpuQp, QpConfig, QpCounters, QpState, QueuePair, ReceiveConfig, Rings, MAX_SQ_SIZE,
};

pub(crate) use gdaki_devx::util::{lock, random_u32};
