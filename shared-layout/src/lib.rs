//! `gdaki-layout`: the bit-exact mlx5 formats (work-queue entries, completion-queue entries, doorbell
//! records) and the `#[repr(C)]` device handles that the host library, the GPU data path and the
//! software HCA share. It is the single source of truth for every byte that crosses the
//! host / GPU / HCA boundary: no other crate declares an offset of its own.
//!
//! The crate is `no_std`, has no unsafe code, and every type that crosses a boundary is
//! `bytemuck::Pod` with its size and field offsets asserted at compile time, so a layout
//! mistake fails the host build and the PTX build alike.
#![no_std]
#![deny(unsafe_code)]
#![warn(missing_docs)]

/// Size in bytes of one send work-queue building block (`MLX5_SEND_WQE_BB`).
pub const SEND_WQE_BB: usize = 64;
