//! Doorbell records: 8-byte records in memory the HCA reads. A QP's holds the receive and send
//! producer counters; a CQ's holds the consumer index and the arm word. All big-endian.
use bytemuck::{Pod, Zeroable};

use crate::Be32;

/// Byte ranges of a QP doorbell record.
pub mod qp_field {
    use crate::Field;
    /// Receive counter (`MLX5_RCV_DBR` = word 0).
    pub const RCV: Field = 0..4;
    /// Send counter (`MLX5_SND_DBR` = word 1).
    pub const SND: Field = 4..8;
}

/// Byte ranges of a CQ doorbell record.
pub mod cq_field {
    use crate::Field;
    /// Consumer index (`MLX5_CQ_SET_CI` = word 0).
    pub const SET_CI: Field = 0..4;
    /// Arm word (`MLX5_CQ_ARM_DB` = word 1).
    pub const ARM_DB: Field = 4..8;
}

/// Size of a doorbell record.
pub const SIZE: usize = qp_field::SND.end;

/// Word index of the receive counter (`MLX5_RCV_DBR`).
pub const RCV_DBR: usize = 0;
/// Word index of the send counter (`MLX5_SND_DBR`).
pub const SND_DBR: usize = 1;
/// Word index of the CQ consumer index (`MLX5_CQ_SET_CI`).
pub const CQ_SET_CI: usize = 0;
/// Word index of the CQ arm word (`MLX5_CQ_ARM_DB`).
pub const CQ_ARM_DB: usize = 1;

/// Bits of the send / receive counter the record keeps.
pub const WQ_COUNTER_MASK: u32 = 0xffff;
/// Bits of the consumer index the record keeps.
pub const CQ_CI_MASK: u32 = 0x00ff_ffff;
/// Arm command: notify on the next completion (`MLX5_CQ_DB_REQ_NOT`).
pub const CQ_DB_REQ_NOT: u32 = 0;
/// Arm command: notify on the next solicited completion (`MLX5_CQ_DB_REQ_NOT_SOL`).
pub const CQ_DB_REQ_NOT_SOL: u32 = 1 << 24;
/// Arm word: shift of the 2-bit command sequence number.
pub const CQ_ARM_SN_SHIFT: u32 = 28;

/// The send (or receive) doorbell-record value for producer counter `pi`.
#[inline(always)]
pub const fn wq_counter(pi: u64) -> u32 {
    pi as u32 & WQ_COUNTER_MASK
}

/// The consumer-index value for `ci` consumed CQEs.
#[inline(always)]
pub const fn cq_ci(ci: u64) -> u32 {
    ci as u32 & CQ_CI_MASK
}

/// The arm word: sequence number `sn` (2 bits), command, consumer index.
#[inline(always)]
pub const fn cq_arm(sn: u32, cmd: u32, ci: u64) -> u32 {
    (sn & 3) << CQ_ARM_SN_SHIFT | cmd | cq_ci(ci)
}

/// A QP doorbell record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct QpDbrec {
    /// Receive counter.
    pub rcv: Be32,
    /// Send counter.
    pub snd: Be32,
}

assert_layout!(QpDbrec, SIZE, { rcv => qp_field::RCV, snd => qp_field::SND });

/// A CQ doorbell record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct CqDbrec {
    /// Consumer index.
    pub set_ci: Be32,
    /// Arm word.
    pub arm_db: Be32,
}

assert_layout!(CqDbrec, SIZE, { set_ci => cq_field::SET_CI, arm_db => cq_field::ARM_DB });
