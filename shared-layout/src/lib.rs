//! `gdaki-layout`: the bit-exact mlx5 formats (work-queue entries, completion-queue entries,
//! doorbell records, the UAR doorbell value) and the `#[repr(C)]` device handles that the host
//! library, the GPU data path and the software HCA share. It is the single source of truth for
//! every byte that crosses the host / GPU / HCA boundary: no other crate declares an offset.
//!
//! # The wire layers
//! Each format has its own module, in the style of smoltcp's `wire`: a `field` module of byte
//! ranges named after the PRM fields (`opmod_idx_opcode`, `qpn_ds`, `fm_ce_se`, `op_own`), a size
//! derived from the last field, bit fields as named constants, and a `Pod` struct whose offsets
//! are asserted against those ranges at compile time. Multi-byte fields are big-endian
//! ([`Be16`], [`Be32`], [`Be64`]), as the NIC reads them.
//!
//! - [`ctrl`], [`raddr`], [`data`], [`inline`], [`atomic`]: the 16-byte WQE segments.
//! - [`cqe`]: the 64-byte CQE and its error overlay; [`dbrec`]: doorbell records;
//!   [`doorbell`]: the 8-byte value written to the UAR.
//! - [`opcode`]: WQE and CQE opcodes and error syndromes (never fail to parse).
//! - [`ring`]: ring arithmetic (`const fn`), written once for device, proxy, soft HCA and tests.
//! - [`wqe`]: a length-checked view of untrusted WQE bytes and the decoded [`wqe::WorkRequest`].
//! - [`recv`]: receive WQEs (scatter lists) and the receive queue's ring.
//! - [`handle`]: [`DevQp`], [`DevRq`] and [`DevCq`], the handles exported to the GPU.
//! - [`perf`]: what the perftest kernels take ([`perf::PingPongSide`]).
//! - [`copy`]: the soft HCA's GPU copy service (descriptors, completions, kernel state).
//! - [`prm`]: the command mailboxes (CREATE_CQ, CREATE_QP, the QP transitions, capability
//!   queries) a host sends to create and drive queues, bit-exact.
//!
//! The crate is `no_std` and has no unsafe code; every accessor on a checked view is panic-free.
//!
//! Where to start: [`wqe`] for what a poster writes, [`cqe`] for what it polls, [`handle`] for
//! what the host hands a kernel. For example, the doorbell a poster writes to the NIC, and what
//! the soft HCA reads back from it:
//!
//! ```
//! use gdaki_layout::doorbell;
//! // QP 0x123456, producer index 0x1_abcd: only the low 16 bits of the index are sent.
//! let bytes = doorbell::value(0x12_3456, 0x1_abcd);
//! assert_eq!(bytes, [0x00, 0xab, 0xcd, 0x00, 0x12, 0x34, 0x56, 0x00]); // big-endian, as the NIC reads it
//! assert_eq!(doorbell::decode(bytes), (0x12_3456, 0xabcd));
//! ```
#![no_std]
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[macro_use]
mod macros;
mod endian;

pub mod atomic;
pub mod copy;
pub mod cqe;
pub mod ctrl;
pub mod data;
pub mod dbrec;
pub mod doorbell;
pub mod handle;
pub mod inline;
pub mod opcode;
pub mod perf;
pub mod prm;
pub mod raddr;
pub mod recv;
pub mod ring;
pub mod socket;
pub mod wait;
pub mod wqe;

pub use endian::{Be16, Be32, Be64};
pub use handle::{AtomicReplyOrder, DevCq, DevQp, DevRq, DoorbellKind};
pub use opcode::{CqeOpcode, Syndrome, WqeOpcode};

/// A byte range of a field inside a format.
pub type Field = core::ops::Range<usize>;

/// Size in bytes of one send work-queue building block (`MLX5_SEND_WQE_BB`).
pub const SEND_WQE_BB: usize = 64;
/// log2 of [`SEND_WQE_BB`] (`MLX5_SEND_WQE_SHIFT`).
pub const SEND_WQE_SHIFT: u32 = 6;
/// Size in bytes of the unit the `ds` field counts (one WQE segment).
pub const WQE_DS_UNIT: usize = 16;

/// A 16-byte WQE segment, as the two 8-byte words a device stores it with (each word holds the
/// segment's bytes in memory order). Every segment type converts to this.
pub trait Segment: bytemuck::Pod {
    /// The segment as two words for two 8-byte (or one 16-byte) stores.
    #[inline(always)]
    fn to_words(self) -> [u64; 2] {
        // Every implementor is 16 bytes (asserted where it is declared), so this cannot fail.
        bytemuck::cast(self)
    }
}
