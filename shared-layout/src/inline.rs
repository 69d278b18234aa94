//! The inline-data segment (`struct mlx5_wqe_inl_data_seg`): a 4-byte header whose
//! `byte_count` has `MLX5_INLINE_SEG` set, followed by the payload itself inside the WQE,
//! padded to a 16-byte boundary.
use crate::{ctrl, raddr, Field, SEND_WQE_BB, WQE_DS_UNIT};

/// Byte ranges of the header.
pub mod field {
    use crate::Field;
    /// `MLX5_INLINE_SEG | length`, big-endian.
    pub const BYTE_COUNT: Field = 0..4;
}

/// Size of the header; the payload starts here.
pub const HEADER_SIZE: usize = field::BYTE_COUNT.end;

/// The bit of `byte_count` that marks an inline segment (`MLX5_INLINE_SEG`).
pub const INLINE_SEG: u32 = 0x8000_0000;

/// The most payload an RDMA WRITE carries inline in a single WQE building block
/// (64 - control - remote address - header = 28 bytes).
pub const MAX_SINGLE_BB: usize = SEND_WQE_BB - ctrl::SIZE - raddr::SIZE - HEADER_SIZE;

/// The most payload a SEND carries inline in a single WQE building block
/// (64 - control - header = 44 bytes).
pub const MAX_SEND_SINGLE_BB: usize = SEND_WQE_BB - ctrl::SIZE - HEADER_SIZE;

/// The `byte_count` word of an inline segment of `len` bytes.
#[inline(always)]
pub const fn byte_count(len: u32) -> u32 {
    INLINE_SEG | len
}

/// The payload's byte range inside the inline segment.
#[inline(always)]
pub const fn payload(len: usize) -> Field {
    HEADER_SIZE..HEADER_SIZE + len
}

/// 16-byte units the inline segment of `len` bytes occupies (header included).
#[inline(always)]
pub const fn ds(len: usize) -> usize {
    (HEADER_SIZE + len).div_ceil(WQE_DS_UNIT)
}
