//! `gdaki-devx`: the device boundary of gdaki. Everything the library and the devices behind it
//! share, and nothing of either's internals:
//!
//! - [`Device`] ([`device`]): the narrow trait every DevX call goes through, with the objects
//!   crossing it (registered [`Memory`], UAR pages, ports, capabilities, [`DeviceError`]).
//!   Two devices implement it, each in its own crate: `gdaki-mlx5` (a ConnectX through
//!   libmlx5's DevX calls) and `gdaki-soft` (the software HCA, whose firmware decodes the same
//!   PRM mailboxes).
//! - [`Devx`] ([`devx`]): runs PRM commands on a device, checks and logs each, and owns what it
//!   made (umems, PDs, UARs, objects), giving each back on drop.
//! - [`qp`]: a queue pair's state, its [`Endpoint`] and the queue-size limits;
//!   [`access`]: a region's rights.
//! - [`wire`]: the frames gdaki sends over TCP, for the handshake and the soft HCA's transport.
//!
//! The arrows run one way: `gdaki-layout` and `gdaki-cuda` below this crate, the devices above
//! it, `gdaki` above them.
#![warn(missing_docs)]

pub mod access;
pub mod device;
pub mod devx;
pub mod qp;
pub mod util;
pub mod wire;

pub use access::Access;
pub use device::{Caps, Device, DeviceError, LinkLayer, Memory, MemoryKind, Mr, Object, Port, Uar};
pub use devx::{DeviceReport, Devx, Opened, Owned, OwnedPd, OwnedUar, QueueMemory, Requirement, Umem};
pub use gdaki_cuda::{AllocError, HostBuffer};
pub use qp::{Endpoint, QpState, MAX_CQ_SIZE, MAX_SQ_SIZE};
