//! The data (scatter/gather) segment (`struct mlx5_wqe_data_seg`): a local buffer by lkey.
use bytemuck::{Pod, Zeroable};

use crate::{Be32, Be64, Segment};

/// Byte ranges of the fields.
pub mod field {
    use crate::Field;
    /// Length in bytes (bit 31 clear; with it set the segment would be inline).
    pub const BYTE_COUNT: Field = 0..4;
    /// Local key.
    pub const LKEY: Field = 4..8;
    /// Local virtual address.
    pub const ADDR: Field = 8..16;
}

/// Size of the segment.
pub const SIZE: usize = field::ADDR.end;

/// Largest length one data segment carries (31 bits; bit 31 marks inline segments).
pub const MAX_BYTE_COUNT: u32 = 0x7fff_ffff;

/// The data segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct DataSeg {
    /// Length in bytes.
    pub byte_count: Be32,
    /// Local key.
    pub lkey: Be32,
    /// Local virtual address.
    pub addr: Be64,
}

assert_layout!(DataSeg, SIZE, { byte_count => field::BYTE_COUNT, lkey => field::LKEY, addr => field::ADDR });

impl Segment for DataSeg {}

impl DataSeg {
    /// A data segment, as `mlx5dv_set_data_seg` writes it.
    #[inline(always)]
    pub const fn new(length: u32, lkey: u32, addr: u64) -> Self {
        DataSeg {
            byte_count: Be32::new(length),
            lkey: Be32::new(lkey),
            addr: Be64::new(addr),
        }
    }
}
