//! The atomic segment (`struct mlx5_wqe_atomic_seg`) of 8-byte ATOMIC_FA and ATOMIC_CS.
use bytemuck::{Pod, Zeroable};

use crate::{Be64, Segment};

/// Byte ranges of the fields.
pub mod field {
    use crate::Field;
    /// Fetch-add: the addend. Compare-swap: the value to swap in.
    pub const SWAP_ADD: Field = 0..8;
    /// Compare-swap: the value to compare with (fetch-add: 0).
    pub const COMPARE: Field = 8..16;
}

/// Size of the segment.
pub const SIZE: usize = field::COMPARE.end;

/// Size of the remote operand and of the fetched value written back.
pub const OPERAND_SIZE: usize = 8;

/// The atomic segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct AtomicSeg {
    /// Addend or swap value.
    pub swap_add: Be64,
    /// Compare value.
    pub compare: Be64,
}

assert_layout!(AtomicSeg, SIZE, { swap_add => field::SWAP_ADD, compare => field::COMPARE });

impl Segment for AtomicSeg {}

impl AtomicSeg {
    /// Fetch-and-add of `add`.
    #[inline(always)]
    pub const fn fetch_add(add: u64) -> Self {
        AtomicSeg {
            swap_add: Be64::new(add),
            compare: Be64::new(0),
        }
    }

    /// Compare-and-swap: if the remote value equals `compare`, store `swap`.
    #[inline(always)]
    pub const fn compare_swap(compare: u64, swap: u64) -> Self {
        AtomicSeg {
            swap_add: Be64::new(swap),
            compare: Be64::new(compare),
        }
    }
}
