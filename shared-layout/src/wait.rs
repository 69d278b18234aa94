//! The WAIT segment of a Core-Direct WAIT WQE (opcode 0x0f): the send queue it is posted on
//! stops at it until a completion queue has produced a given CQE, then goes on. What makes a
//! counter that advances when another QP's operation completes (DOCA GPUNetIO 2.0's
//! `*_counter` calls: a WAIT on the data QP's CQ, then an atomic, on a companion QP created with
//! `qpc.cd_master`). The layout is DOCA's `doca_gpu_dev_verbs_wqe_wait_seg`, after the control
//! segment, with `ds` 2.
use bytemuck::{Pod, Zeroable};

use crate::{Be32, Segment};

/// Byte ranges of the fields.
pub mod field {
    use crate::Field;
    /// Reserved, 0.
    pub const RESERVED: Field = 0..8;
    /// The index of the CQE waited for, 32 bits of it.
    pub const MAX_INDEX: Field = 8..12;
    /// The CQ number.
    pub const CQN: Field = 12..16;
}

/// Size of the segment.
pub const SIZE: usize = field::CQN.end;

/// The WAIT segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct WaitSeg {
    /// Reserved, 0.
    pub reserved: [Be32; 2],
    /// The CQE waited for: the queue goes on once the CQ has produced the CQE of this index
    /// (its low 32 bits; a CQ's CQE index counts the CQEs before it).
    pub max_index: Be32,
    /// The CQ whose CQEs are counted.
    pub cqn: Be32,
}

assert_layout!(WaitSeg, SIZE, { reserved => field::RESERVED, max_index => field::MAX_INDEX, cqn => field::CQN });

impl Segment for WaitSeg {}

impl WaitSeg {
    /// A WAIT for CQE `max_index` (its low 32 bits) of CQ `cqn`.
    #[inline(always)]
    pub const fn new(cqn: u32, max_index: u64) -> Self {
        WaitSeg {
            reserved: [Be32::new(0); 2],
            max_index: Be32::new(max_index as u32),
            cqn: Be32::new(cqn),
        }
    }

    /// Whether a CQ that has produced `produced` CQEs so far lets a WAIT for CQE `max_index`
    /// (32 bits of it) go on: that CQE is among them. Compared on the 32-bit circle, so it holds
    /// across the counter's wrap for waits less than 2^31 CQEs ahead or behind.
    #[inline(always)]
    pub const fn reached(produced: u64, max_index: u32) -> bool {
        (produced as u32).wrapping_sub(max_index).wrapping_sub(1) < 1 << 31
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_segment_is_big_endian_after_eight_reserved_bytes() {
        let s = WaitSeg::new(0x00ab_cdef, 0x1_2345_6789);
        assert_eq!(
            bytemuck::bytes_of(&s),
            &[0, 0, 0, 0, 0, 0, 0, 0, 0x23, 0x45, 0x67, 0x89, 0x00, 0xab, 0xcd, 0xef]
        );
    }

    #[test]
    fn a_wait_goes_on_once_its_cqe_is_produced_across_the_wrap() {
        assert!(!WaitSeg::reached(0, 0), "no CQE yet");
        assert!(WaitSeg::reached(1, 0), "CQE 0 produced");
        assert!(!WaitSeg::reached(5, 5));
        assert!(WaitSeg::reached(6, 5));
        assert!(WaitSeg::reached(100, 5), "long past");
        // Index 2^32 - 1 is produced when the 32-bit count wraps to 0.
        assert!(!WaitSeg::reached(u32::MAX as u64, u32::MAX));
        assert!(WaitSeg::reached(1 << 32, u32::MAX));
        assert!(WaitSeg::reached((1 << 32) + 3, 2));
        assert!(!WaitSeg::reached((1 << 32) + 3, 3));
    }
}
