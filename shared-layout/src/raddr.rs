//! The remote-address segment (`struct mlx5_wqe_raddr_seg`): where an RDMA WRITE / READ /
//! atomic lands at the responder.
use bytemuck::{Pod, Zeroable};

use crate::{Be32, Be64, Segment};

/// Byte ranges of the fields.
pub mod field {
    use crate::Field;
    /// Remote virtual address.
    pub const RADDR: Field = 0..8;
    /// Remote key.
    pub const RKEY: Field = 8..12;
    /// Reserved, 0.
    pub const RESERVED: Field = 12..16;
}

/// Size of the segment.
pub const SIZE: usize = field::RESERVED.end;

/// The remote-address segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RaddrSeg {
    /// Remote virtual address.
    pub raddr: Be64,
    /// Remote key.
    pub rkey: Be32,
    /// Reserved, 0.
    pub reserved: Be32,
}

assert_layout!(RaddrSeg, SIZE, { raddr => field::RADDR, rkey => field::RKEY, reserved => field::RESERVED });

impl Segment for RaddrSeg {}

impl RaddrSeg {
    /// A remote-address segment.
    #[inline(always)]
    pub const fn new(raddr: u64, rkey: u32) -> Self {
        RaddrSeg {
            raddr: Be64::new(raddr),
            rkey: Be32::new(rkey),
            reserved: Be32::new(0),
        }
    }
}
