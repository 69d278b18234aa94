//! The WQE control segment (`struct mlx5_wqe_ctrl_seg`): the first 16 bytes of every WQE.
use bytemuck::{Pod, Zeroable};

use crate::{Be16, Be32, Segment, WqeOpcode};

/// Byte ranges of the fields.
pub mod field {
    use crate::Field;
    /// `opmod << 24 | wqe_index << 8 | opcode`.
    pub const OPMOD_IDX_OPCODE: Field = 0..4;
    /// `qpn << 8 | ds`.
    pub const QPN_DS: Field = 4..8;
    /// WQE signature (unused, 0).
    pub const SIGNATURE: Field = 8..9;
    /// DCI stream channel (DC transport only, 0 for RC).
    pub const DCI_STREAM_CHANNEL_ID: Field = 9..11;
    /// Fence mode, completion-event and solicited flags.
    pub const FM_CE_SE: Field = 11..12;
    /// Immediate data (or invalidation key).
    pub const IMM: Field = 12..16;
}

/// Size of the segment.
pub const SIZE: usize = field::IMM.end;

/// `opmod_idx_opcode`: the opcode's bits.
pub const OPCODE_MASK: u32 = 0xff;
/// `opmod_idx_opcode`: shift of the 16-bit WQE index.
pub const WQE_INDEX_SHIFT: u32 = 8;
/// `opmod_idx_opcode`: shift of the opcode modifier.
pub const OPMOD_SHIFT: u32 = 24;
/// `qpn_ds`: the `ds` bits (WQE size in 16-byte units).
pub const DS_MASK: u32 = 0x3f;
/// `qpn_ds`: shift of the 24-bit QP number.
pub const QPN_SHIFT: u32 = 8;
/// Largest QP number (24 bits).
pub const QPN_MAX: u32 = 0x00ff_ffff;

/// `fm_ce_se`: solicited event (`MLX5_WQE_CTRL_SOLICITED`).
pub const SE_SOLICITED: u8 = 1 << 1;
/// `fm_ce_se`: always generate a CQE (`MLX5_WQE_CTRL_CQ_UPDATE`).
pub const CE_CQ_UPDATE: u8 = 2 << 2;
/// `fm_ce_se`: shift of the 3-bit fence mode ([`FenceMode`]).
pub const FM_SHIFT: u32 = 5;
/// `fm_ce_se`: fence mode "initiator small fence" (`MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE`).
pub const FM_INITIATOR_SMALL_FENCE: u8 = FenceMode::InitiatorSmallFence.bits();
/// `fm_ce_se`: fence mode "fence", the kernel's and NVSHMEM's fence (`MLX5_FENCE_MODE_FENCE`).
pub const FM_FENCE: u8 = FenceMode::Fence.bits();
/// `fm_ce_se`: fence mode "strong ordering" (`MLX5_FENCE_MODE_STRONG_ORDERING`).
pub const FM_STRONG_ORDERING: u8 = FenceMode::StrongOrdering.bits();
/// `fm_ce_se`: fence mode "fence and initiator small fence", the value rdma-core calls
/// `MLX5_WQE_CTRL_FENCE` and sets for `IBV_SEND_FENCE`.
pub const FM_FENCE_AND_INITIATOR_SMALL_FENCE: u8 = FenceMode::FenceAndInitiatorSmallFence.bits();

/// The fence mode of a WQE: bits 7..5 of `fm_ce_se`, an enumeration (not independent flags),
/// named as the PRM and the kernel's `MLX5_FENCE_MODE_*` name them.
///
/// What each asks of the HCA before the WQE executes (the send queue executes in order, so a
/// WQE held back holds back every later one too):
/// - `None`: nothing.
/// - `InitiatorSmallFence`: earlier memory-key work of the QP (local invalidate, UMR) must have
///   completed. gdaki posts none, so it waits for nothing here.
/// - `Fence` (IB's fence indicator): every earlier RDMA READ and atomic of the QP must have
///   completed, its response data written locally. Earlier WRITEs are not waited for.
/// - `StrongOrdering`: every earlier WQE of the QP must have completed.
/// - `FenceAndInitiatorSmallFence`: both of the first two.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FenceMode {
    /// No fence (0).
    None,
    /// Initiator small fence (1).
    InitiatorSmallFence,
    /// Fence (2).
    Fence,
    /// Strong ordering (3).
    StrongOrdering,
    /// Fence and initiator small fence (4).
    FenceAndInitiatorSmallFence,
    /// A value the PRM reserves (5..7): a WQE carrying it is malformed.
    Reserved(u8),
}

impl FenceMode {
    /// Decodes the fence mode of an `fm_ce_se` byte.
    #[inline(always)]
    pub const fn from_fm_ce_se(fm_ce_se: u8) -> Self {
        match fm_ce_se >> FM_SHIFT {
            0 => FenceMode::None,
            1 => FenceMode::InitiatorSmallFence,
            2 => FenceMode::Fence,
            3 => FenceMode::StrongOrdering,
            4 => FenceMode::FenceAndInitiatorSmallFence,
            v => FenceMode::Reserved(v),
        }
    }

    /// The mode's bits in place in `fm_ce_se`.
    #[inline(always)]
    pub const fn bits(self) -> u8 {
        (match self {
            FenceMode::None => 0,
            FenceMode::InitiatorSmallFence => 1,
            FenceMode::Fence => 2,
            FenceMode::StrongOrdering => 3,
            FenceMode::FenceAndInitiatorSmallFence => 4,
            FenceMode::Reserved(v) => v & 0x7,
        }) << FM_SHIFT
    }

    /// Whether the WQE waits for earlier RDMA READs and atomics to complete.
    #[inline(always)]
    pub const fn waits_for_reads_and_atomics(self) -> bool {
        matches!(
            self,
            FenceMode::Fence | FenceMode::StrongOrdering | FenceMode::FenceAndInitiatorSmallFence
        )
    }

    /// Whether the WQE waits for every earlier WQE (WRITEs included) to complete.
    #[inline(always)]
    pub const fn waits_for_everything(self) -> bool {
        matches!(self, FenceMode::StrongOrdering)
    }
}

/// Packs `opmod_idx_opcode` as `mlx5dv_set_ctrl_seg` does.
#[inline(always)]
pub const fn opmod_idx_opcode(opmod: u8, wqe_index: u16, opcode: u8) -> u32 {
    (opmod as u32) << OPMOD_SHIFT | (wqe_index as u32) << WQE_INDEX_SHIFT | opcode as u32
}

/// Packs `qpn_ds`; the QP number is truncated to 24 bits and `ds` to 6.
#[inline(always)]
pub const fn qpn_ds(qpn: u32, ds: u8) -> u32 {
    (qpn & QPN_MAX) << QPN_SHIFT | (ds as u32 & DS_MASK)
}

/// The control segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct CtrlSeg {
    /// See [`opmod_idx_opcode`].
    pub opmod_idx_opcode: Be32,
    /// See [`qpn_ds`].
    pub qpn_ds: Be32,
    /// WQE signature (0).
    pub signature: u8,
    /// DCI stream channel id (0 for RC).
    pub dci_stream_channel_id: Be16,
    /// Fence mode / completion event / solicited event flags.
    pub fm_ce_se: u8,
    /// Immediate data, already in the byte order the opcode wants.
    pub imm: Be32,
}

assert_layout!(CtrlSeg, SIZE, {
    opmod_idx_opcode => field::OPMOD_IDX_OPCODE,
    qpn_ds => field::QPN_DS,
    signature => field::SIGNATURE,
    dci_stream_channel_id => field::DCI_STREAM_CHANNEL_ID,
    fm_ce_se => field::FM_CE_SE,
    imm => field::IMM,
});

impl Segment for CtrlSeg {}

impl CtrlSeg {
    /// A control segment (signature and stream channel 0).
    #[inline(always)]
    pub const fn new(opcode: WqeOpcode, opmod: u8, wqe_index: u16, qpn: u32, ds: u8, fm_ce_se: u8, imm: u32) -> Self {
        CtrlSeg {
            opmod_idx_opcode: Be32::new(opmod_idx_opcode(opmod, wqe_index, opcode.raw())),
            qpn_ds: Be32::new(qpn_ds(qpn, ds)),
            signature: 0,
            dci_stream_channel_id: Be16::new(0),
            fm_ce_se,
            imm: Be32::new(imm),
        }
    }

    /// The opcode.
    #[inline(always)]
    pub const fn opcode(&self) -> WqeOpcode {
        WqeOpcode::from_raw((self.opmod_idx_opcode.get() & OPCODE_MASK) as u8)
    }

    /// The opcode modifier.
    #[inline(always)]
    pub const fn opmod(&self) -> u8 {
        (self.opmod_idx_opcode.get() >> OPMOD_SHIFT) as u8
    }

    /// The 16-bit WQE index (producer counter modulo 2^16).
    #[inline(always)]
    pub const fn wqe_index(&self) -> u16 {
        (self.opmod_idx_opcode.get() >> WQE_INDEX_SHIFT) as u16
    }

    /// The QP number.
    #[inline(always)]
    pub const fn qpn(&self) -> u32 {
        self.qpn_ds.get() >> QPN_SHIFT
    }

    /// The WQE size in 16-byte units.
    #[inline(always)]
    pub const fn ds(&self) -> u8 {
        (self.qpn_ds.get() & DS_MASK) as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// rdma-core's `mlx5dv_set_ctrl_seg(seg, pi=0x1234, RDMA_WRITE, opmod=0, qpn=0xabcdef,
    /// fm_ce_se=CQ_UPDATE, ds=3, signature=0, imm=0)`.
    static GOLDEN: [u8; 16] = [
        0x00, 0x12, 0x34, 0x08, 0xab, 0xcd, 0xef, 0x03, 0, 0, 0, 0x08, 0, 0, 0, 0,
    ];

    #[test]
    fn fence_modes_are_an_enumeration() {
        // Every value of the three bits, with the other bits of `fm_ce_se` set around them.
        let expect = [
            (0x00, FenceMode::None, false, false),
            (0x20, FenceMode::InitiatorSmallFence, false, false),
            (0x40, FenceMode::Fence, true, false),
            (0x60, FenceMode::StrongOrdering, true, true),
            (0x80, FenceMode::FenceAndInitiatorSmallFence, true, false),
            (0xa0, FenceMode::Reserved(5), false, false),
            (0xc0, FenceMode::Reserved(6), false, false),
            (0xe0, FenceMode::Reserved(7), false, false),
        ];
        for (bits, mode, reads, all) in expect {
            for other in [0u8, CE_CQ_UPDATE | SE_SOLICITED, 0x1f] {
                let m = FenceMode::from_fm_ce_se(bits | other);
                assert_eq!(m, mode, "fm_ce_se {:#04x}", bits | other);
                assert_eq!(m.bits(), bits);
                assert_eq!(
                    (m.waits_for_reads_and_atomics(), m.waits_for_everything()),
                    (reads, all)
                );
            }
        }
        // 0x40 is a fence although bit 7 (the old single "fence" bit) is clear.
        assert_eq!(FenceMode::from_fm_ce_se(FM_FENCE), FenceMode::Fence);
        assert_eq!(FM_FENCE_AND_INITIATOR_SMALL_FENCE, 0x80);
    }

    #[test]
    fn construct_and_deconstruct() {
        let seg = CtrlSeg::new(WqeOpcode::RdmaWrite, 0, 0x1234, 0xabcdef, 3, CE_CQ_UPDATE, 0);
        assert_eq!(bytemuck::bytes_of(&seg), &GOLDEN);
        let back: CtrlSeg = bytemuck::pod_read_unaligned(&GOLDEN);
        assert_eq!(back.opcode(), WqeOpcode::RdmaWrite);
        assert_eq!(
            (back.wqe_index(), back.qpn(), back.ds(), back.opmod()),
            (0x1234, 0xabcdef, 3, 0)
        );
        let words = seg.to_words();
        assert_eq!(words[0].to_ne_bytes(), GOLDEN[..8]);
        assert_eq!(words[1].to_ne_bytes(), GOLDEN[8..]);
    }
}
