//! gdaki's C API: `gdaki.h` over `libgdaki.so` and `libgdaki.a`.
//!
//! The control phase of gdaki for C and C++ programs: open a context, register memory, create,
//! connect and export queue pairs, exchange endpoints (through gdaki's handshake or an
//! application's own bootstrap, as fixed-size blobs), and run a CPU doorbell proxy. The data
//! path is `gdaki_device.h`'s functions: in kernels (linked against the device library), and,
//! in thread scope, on the host too (CPU mode: this library exports them).
//!
//! Conventions, in every function:
//! - The result is a [`gdaki_status`]; on failure nothing changed, and `gdaki_last_error()`
//!   says what and with which values (per thread).
//! - Outputs go through out-pointers; every pointer is checked (NULL, alignment), every handle
//!   carries its type (a handle of another type or one destroyed is `GDAKI_STATUS_BAD_HANDLE`
//!   while its memory is still there), every enum value and flag is checked.
//! - A panic (a bug) is caught at the boundary and becomes `GDAKI_STATUS_PANIC`.
//! - Every handle has a `_destroy`, which takes NULL. Objects keep what they need alive, so
//!   handles may be destroyed in any order; a region must outlive the WQEs that name it.
//! - Handles may be used from several threads at once, except that nothing may be in flight
//!   on a handle being destroyed.
#![allow(non_camel_case_types)]
#![warn(missing_docs)]

mod context;
mod guard;
mod handshake;
mod peer;
mod queue;
mod region;
mod socket;
mod stream;

pub use context::*;
pub use guard::gdaki_status;
pub use handshake::*;
pub use peer::*;
pub use queue::*;
pub use region::*;
pub use socket::*;
pub use stream::*;
