//! The 64-byte CQE (`struct mlx5_cqe64`) and its error overlay (`struct mlx5_err_cqe`, with
//! the hardware syndrome bytes of the extended form). The last byte, `op_own`, carries the
//! opcode (bits 7..4), the format (3..2), the solicited-event bit (1) and the owner bit (0).
use bytemuck::{Pod, Zeroable};

use crate::{Be16, Be32, Be64, CqeOpcode, Syndrome};

/// Byte ranges of the fields (the success form; the error form shares 56..64).
pub mod field {
    use crate::Field;
    /// Receive WQE id (responder side).
    pub const WQE_ID: Field = 2..4;
    /// Source LID (IB).
    pub const SLID: Field = 22..24;
    /// Flags and remote QP number.
    pub const FLAGS_RQPN: Field = 24..28;
    /// SRQ number / user index.
    pub const SRQN_UIDX: Field = 32..36;
    /// Immediate data / invalidated key / pkey.
    pub const IMM_INVAL_PKEY: Field = 36..40;
    /// Bytes transferred (responder) or of the operation.
    pub const BYTE_CNT: Field = 44..48;
    /// Completion timestamp.
    pub const TIMESTAMP: Field = 48..56;
    /// Opcode of the completed WQE (bits 31..24, error CQEs) or drop info, and the QP number.
    pub const SOP_DROP_QPN: Field = 56..60;
    /// Index of the completed WQE (16 bits of the producer counter).
    pub const WQE_COUNTER: Field = 60..62;
    /// Signature.
    pub const SIGNATURE: Field = 62..63;
    /// Opcode, format, solicited event and owner bit.
    pub const OP_OWN: Field = 63..64;

    /// Error form: hardware error syndrome.
    pub const HW_ERR_SYND: Field = 52..53;
    /// Error form: hardware syndrome type.
    pub const HW_SYND_TYPE: Field = 53..54;
    /// Error form: vendor error syndrome.
    pub const VENDOR_ERR_SYND: Field = 54..55;
    /// Error form: syndrome (`MLX5_CQE_SYNDROME_*`).
    pub const SYNDROME: Field = 55..56;
    /// Error form: opcode of the failed WQE (bits 31..24) and the QP number (23..0).
    pub const S_WQE_OPCODE_QPN: Field = 56..60;
}

/// Size of a CQE.
pub const SIZE: usize = field::OP_OWN.end;

/// `op_own`: the owner bit (`MLX5_CQE_OWNER_MASK`).
pub const OWNER_MASK: u8 = 1;
/// `op_own`: the solicited-event bit.
pub const SE_MASK: u8 = 1 << 1;
/// `op_own`: shift of the 2-bit format.
pub const FORMAT_SHIFT: u32 = 2;
/// `op_own`: the format bits, after [`FORMAT_SHIFT`]. 0 is a plain 64-byte CQE; 1 and 2 are
/// inline-scatter forms of receive CQEs; 3 is a compressed (mini-CQE) block. gdaki's CQs are
/// created without compression and its send CQEs are always format 0.
pub const FORMAT_MASK: u8 = 0x3;
/// `op_own`: shift of the 4-bit opcode.
pub const OPCODE_SHIFT: u32 = 4;
/// `op_own` the host writes into every CQE of a fresh ring: opcode INVALID, owner 1 (not yet
/// written for lap 0, whose software-owned parity is 0).
pub const OP_OWN_INIT: u8 = (CqeOpcode::Invalid.raw() << OPCODE_SHIFT) | OWNER_MASK;
/// `sop_drop_qpn` / `s_wqe_opcode_qpn`: QP number bits.
pub const QPN_MASK: u32 = 0x00ff_ffff;
/// `s_wqe_opcode_qpn`: shift of the failed WQE's opcode.
pub const WQE_OPCODE_SHIFT: u32 = 24;

/// Byte offset of a CQE's [`Tail`] word.
pub const TAIL_OFFSET: usize = field::SOP_DROP_QPN.start;

/// The last 8 bytes of a CQE (`sop_drop_qpn`, `wqe_counter`, `signature`, `op_own`) as one
/// word loaded from memory: all a poller needs to recognise a successful completion of a given
/// WQE, so polling takes one 8-byte load (one round trip where the CQ sits in host memory).
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct Tail(pub u64);

impl Tail {
    /// `op_own` (the entry's last byte).
    #[inline(always)]
    pub const fn op_own(self) -> u8 {
        self.0.to_ne_bytes()[7]
    }

    /// The WQE counter (bytes 60..62, big-endian).
    #[inline(always)]
    pub const fn wqe_counter(self) -> u16 {
        let b = self.0.to_ne_bytes();
        u16::from_be_bytes([b[4], b[5]])
    }
}

/// Packs `op_own`.
#[inline(always)]
pub const fn op_own(opcode: CqeOpcode, owner: u8) -> u8 {
    (opcode.raw() << OPCODE_SHIFT) | (owner & OWNER_MASK)
}

/// The opcode in `op_own`.
#[inline(always)]
pub const fn opcode(op_own: u8) -> CqeOpcode {
    CqeOpcode::from_raw(op_own >> OPCODE_SHIFT)
}

/// The format in `op_own` (see [`FORMAT_MASK`]).
#[inline(always)]
pub const fn format(op_own: u8) -> u8 {
    (op_own >> FORMAT_SHIFT) & FORMAT_MASK
}

/// The owner bit in `op_own`.
#[inline(always)]
pub const fn owner(op_own: u8) -> u8 {
    op_own & OWNER_MASK
}

/// A CQE, success form (`struct mlx5_cqe64`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Cqe64 {
    /// Reserved.
    pub rsvd0: [u8; 2],
    /// Receive WQE id.
    pub wqe_id: Be16,
    /// Reserved.
    pub rsvd4: [u8; 13],
    /// Multi-path info.
    pub ml_path: u8,
    /// Reserved.
    pub rsvd20: [u8; 4],
    /// Source LID.
    pub slid: Be16,
    /// Flags and remote QP number.
    pub flags_rqpn: Be32,
    /// Header data split / IP extension.
    pub hds_ip_ext: u8,
    /// L4 header type and flags.
    pub l4_hdr_type_etc: u8,
    /// VLAN info.
    pub vlan_info: Be16,
    /// SRQ number / user index.
    pub srqn_uidx: Be32,
    /// Immediate / invalidated key / pkey.
    pub imm_inval_pkey: Be32,
    /// Application.
    pub app: u8,
    /// Application opcode.
    pub app_op: u8,
    /// Application info.
    pub app_info: Be16,
    /// Byte count.
    pub byte_cnt: Be32,
    /// Timestamp.
    pub timestamp: Be64,
    /// Opcode of the WQE (error form) / drop info, and the QP number.
    pub sop_drop_qpn: Be32,
    /// Index of the completed WQE.
    pub wqe_counter: Be16,
    /// Signature.
    pub signature: u8,
    /// Opcode, format, SE and owner.
    pub op_own: u8,
}

assert_layout!(Cqe64, SIZE, {
    wqe_id => field::WQE_ID,
    slid => field::SLID,
    flags_rqpn => field::FLAGS_RQPN,
    srqn_uidx => field::SRQN_UIDX,
    imm_inval_pkey => field::IMM_INVAL_PKEY,
    byte_cnt => field::BYTE_CNT,
    timestamp => field::TIMESTAMP,
    sop_drop_qpn => field::SOP_DROP_QPN,
    wqe_counter => field::WQE_COUNTER,
    signature => field::SIGNATURE,
    op_own => field::OP_OWN,
});

impl Default for Cqe64 {
    /// A CQE as the host initialises a ring: zero, with `op_own` = [`OP_OWN_INIT`].
    fn default() -> Self {
        let mut cqe: Cqe64 = Zeroable::zeroed();
        cqe.op_own = OP_OWN_INIT;
        cqe
    }
}

impl Cqe64 {
    /// A requester success CQE for WQE `wqe_counter` of QP `qpn`, written in lap parity `owner`.
    #[inline(always)]
    pub fn success(qpn: u32, wqe_counter: u16, byte_cnt: u32, owner: u8) -> Self {
        let mut cqe: Cqe64 = Zeroable::zeroed();
        cqe.byte_cnt = Be32::new(byte_cnt);
        cqe.sop_drop_qpn = Be32::new(qpn & QPN_MASK);
        cqe.wqe_counter = Be16::new(wqe_counter);
        cqe.op_own = op_own(CqeOpcode::Req, owner);
        cqe
    }

    /// A responder success CQE: receive `wqe_counter` of QP `qpn` took a message of
    /// `byte_cnt` bytes from QP `src_qpn`, as `opcode` ([`CqeOpcode::RespSend`],
    /// [`CqeOpcode::RespSendImm`] or [`CqeOpcode::RespWrImm`]) with immediate `imm` (0 without),
    /// written in lap parity `owner`.
    #[inline(always)]
    pub fn responder(
        qpn: u32,
        wqe_counter: u16,
        byte_cnt: u32,
        opcode: CqeOpcode,
        imm: u32,
        src_qpn: u32,
        owner: u8,
    ) -> Self {
        let mut cqe: Cqe64 = Zeroable::zeroed();
        cqe.byte_cnt = Be32::new(byte_cnt);
        cqe.imm_inval_pkey = Be32::new(imm);
        cqe.flags_rqpn = Be32::new(src_qpn & QPN_MASK);
        cqe.sop_drop_qpn = Be32::new(qpn & QPN_MASK);
        cqe.wqe_counter = Be16::new(wqe_counter);
        cqe.op_own = op_own(opcode, owner);
        cqe
    }

    /// Bytes of the operation (a responder's: bytes received).
    #[inline(always)]
    pub const fn byte_count(&self) -> u32 {
        self.byte_cnt.get()
    }

    /// The immediate data of a responder CQE with one.
    #[inline(always)]
    pub const fn imm(&self) -> u32 {
        self.imm_inval_pkey.get()
    }

    /// The QP number the message came from (responder CQEs).
    #[inline(always)]
    pub const fn src_qpn(&self) -> u32 {
        self.flags_rqpn.get() & QPN_MASK
    }

    /// The opcode.
    #[inline(always)]
    pub const fn opcode(&self) -> CqeOpcode {
        opcode(self.op_own)
    }

    /// The owner bit.
    #[inline(always)]
    pub const fn owner(&self) -> u8 {
        owner(self.op_own)
    }

    /// The QP number.
    #[inline(always)]
    pub const fn qpn(&self) -> u32 {
        self.sop_drop_qpn.get() & QPN_MASK
    }

    /// The format (0 for every CQE a send queue of gdaki's gets).
    #[inline(always)]
    pub const fn format(&self) -> u8 {
        format(self.op_own)
    }

    /// The error view of this CQE (meaningful when [`CqeOpcode::is_error`]).
    #[inline(always)]
    pub fn as_error(&self) -> ErrCqe {
        bytemuck::cast(*self)
    }
}

/// A CQE, error form (`struct mlx5_err_cqe` with the hardware syndrome bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct ErrCqe {
    /// Reserved.
    pub rsvd0: [u8; 32],
    /// SRQ number.
    pub srqn: Be32,
    /// Reserved.
    pub rsvd1: [u8; 16],
    /// Hardware error syndrome.
    pub hw_err_synd: u8,
    /// Hardware syndrome type.
    pub hw_synd_type: u8,
    /// Vendor error syndrome.
    pub vendor_err_synd: u8,
    /// Syndrome (`MLX5_CQE_SYNDROME_*`).
    pub syndrome: u8,
    /// Opcode of the failed WQE and the QP number.
    pub s_wqe_opcode_qpn: Be32,
    /// Index of the failed WQE.
    pub wqe_counter: Be16,
    /// Signature.
    pub signature: u8,
    /// Opcode (REQ_ERR / RESP_ERR), format, SE and owner.
    pub op_own: u8,
}

assert_layout!(ErrCqe, SIZE, {
    srqn => field::SRQN_UIDX,
    hw_err_synd => field::HW_ERR_SYND,
    hw_synd_type => field::HW_SYND_TYPE,
    vendor_err_synd => field::VENDOR_ERR_SYND,
    syndrome => field::SYNDROME,
    s_wqe_opcode_qpn => field::S_WQE_OPCODE_QPN,
    wqe_counter => field::WQE_COUNTER,
    op_own => field::OP_OWN,
});

impl ErrCqe {
    /// A requester error CQE for WQE `wqe_counter` (opcode `wqe_opcode`) of QP `qpn`.
    #[inline(always)]
    pub fn new(qpn: u32, wqe_counter: u16, wqe_opcode: u8, syndrome: Syndrome, vendor: u8, owner: u8) -> Self {
        let mut cqe: ErrCqe = Zeroable::zeroed();
        cqe.vendor_err_synd = vendor;
        cqe.syndrome = syndrome.raw();
        cqe.s_wqe_opcode_qpn = Be32::new((wqe_opcode as u32) << WQE_OPCODE_SHIFT | (qpn & QPN_MASK));
        cqe.wqe_counter = Be16::new(wqe_counter);
        cqe.op_own = op_own(CqeOpcode::ReqErr, owner);
        cqe
    }

    /// A responder error CQE for receive `wqe_counter` of QP `qpn` (a flushed receive, or one
    /// whose message it could not take).
    #[inline(always)]
    pub fn responder(qpn: u32, wqe_counter: u16, syndrome: Syndrome, vendor: u8, owner: u8) -> Self {
        let mut cqe = ErrCqe::new(qpn, wqe_counter, 0, syndrome, vendor, owner);
        cqe.op_own = op_own(CqeOpcode::RespErr, owner);
        cqe
    }

    /// The syndrome.
    #[inline(always)]
    pub const fn syndrome(&self) -> Syndrome {
        Syndrome::from_raw(self.syndrome)
    }

    /// Opcode of the failed WQE.
    #[inline(always)]
    pub const fn wqe_opcode(&self) -> u8 {
        (self.s_wqe_opcode_qpn.get() >> WQE_OPCODE_SHIFT) as u8
    }

    /// The CQE as its success-form bytes.
    #[inline(always)]
    pub fn as_cqe(&self) -> Cqe64 {
        bytemuck::cast(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_word_decodes_counter_and_op_own_of_both_forms() {
        let ok = Cqe64::success(0x12345, 0xbeef, 8, 1);
        let bytes = bytemuck::bytes_of(&ok);
        let tail = Tail(u64::from_ne_bytes(bytes[TAIL_OFFSET..SIZE].try_into().unwrap()));
        assert_eq!(tail.wqe_counter(), 0xbeef);
        assert_eq!(tail.op_own(), ok.op_own);
        assert_eq!(owner(tail.op_own()), 1);
        let err = ErrCqe::new(7, 0x0102, 8, Syndrome::RemoteAccess, 0, 0);
        let bytes = bytemuck::bytes_of(&err);
        let tail = Tail(u64::from_ne_bytes(bytes[TAIL_OFFSET..SIZE].try_into().unwrap()));
        assert_eq!(tail.wqe_counter(), 0x0102);
        assert!(opcode(tail.op_own()).is_error());
    }
}
