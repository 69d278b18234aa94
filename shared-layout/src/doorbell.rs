//! The 8-byte doorbell written to the UAR: the first 8 bytes of a control segment carrying the
//! new producer index (`opmod_idx_opcode` with opcode 0) and the QP number (`qpn_ds`, ds 0).
//! The NIC reads only the QP number and the index from it.
use crate::ctrl;

/// Offset of the doorbell register in a UAR page (`MLX5_BF_OFFSET`); rdma-core's
/// `mlx5dv_devx_uar::reg_addr` already points here.
pub const UAR_DOORBELL_OFFSET: usize = 0x800;
/// Offset in a UAR page of the doorbell register of QPs created without a doorbell record
/// (`qpc.send_dbr_mode` `NO_DBR_EXT`): DOCA's `DOCA_VERBS_UAR_DBR_LESS_DB_OFFSET`.
pub const UAR_DBR_LESS_OFFSET: usize = 0x600;
/// Size of the doorbell write.
pub const SIZE: usize = 8;

/// The doorbell as the 8 bytes to store, in memory order. The index is masked to 16 bits
/// before packing (DOCA leaks bits 16..23 of the producer index into `opmod`).
#[inline(always)]
pub const fn value(qpn: u32, pi: u64) -> [u8; SIZE] {
    let hi = ctrl::opmod_idx_opcode(0, pi as u16, 0).to_be_bytes();
    let lo = ctrl::qpn_ds(qpn, 0).to_be_bytes();
    [hi[0], hi[1], hi[2], hi[3], lo[0], lo[1], lo[2], lo[3]]
}

/// The doorbell as one native word for a single 8-byte store.
#[inline(always)]
pub const fn word(qpn: u32, pi: u64) -> u64 {
    u64::from_ne_bytes(value(qpn, pi))
}

/// Decodes a doorbell: (QP number, 16-bit producer index).
#[inline(always)]
pub const fn decode(value: [u8; SIZE]) -> (u32, u16) {
    let idx = u32::from_be_bytes([value[0], value[1], value[2], value[3]]);
    let qpn = u32::from_be_bytes([value[4], value[5], value[6], value[7]]);
    (qpn >> ctrl::QPN_SHIFT, (idx >> ctrl::WQE_INDEX_SHIFT) as u16)
}

/// What a store to the doorbell announces: (QP number, producer index). gdaki's doorbell (and
/// DOCA's) carries the producer index itself, with `ds` 0. rdma-core's carries the first 8
/// bytes of the last WQE's control segment, as does a BlueFlame write of that WQE into the
/// doorbell register: its own index and, in `ds`, its size, so the producer index is where that
/// WQE ends.
#[inline(always)]
pub const fn producer(value: [u8; SIZE]) -> (u32, u16) {
    let (qpn, idx) = decode(value);
    let ds = u32::from_be_bytes([value[4], value[5], value[6], value[7]]) & ctrl::DS_MASK;
    if ds == 0 {
        (qpn, idx)
    } else {
        (qpn, idx.wrapping_add(crate::ring::wqebbs(ds) as u16))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn index_is_masked_and_round_trips() {
        let v = super::value(0x0012_3456, 0x0000_01ab_cdef);
        assert_eq!(v, [0x00, 0xcd, 0xef, 0x00, 0x12, 0x34, 0x56, 0x00]);
        assert_eq!(super::decode(v), (0x0012_3456, 0xcdef));
    }

    /// A control segment's first 8 bytes (rdma-core's doorbell, a BlueFlame write) announce the
    /// end of that WQE; gdaki's doorbell announces its index as it is.
    #[test]
    fn a_control_segment_announces_where_its_wqe_ends() {
        use crate::ctrl;
        let ctrl_word = |idx: u16, ds: u8| {
            let hi = ctrl::opmod_idx_opcode(0, idx, 0x08).to_be_bytes();
            let lo = ctrl::qpn_ds(0x12, ds).to_be_bytes();
            [hi[0], hi[1], hi[2], hi[3], lo[0], lo[1], lo[2], lo[3]]
        };
        // One building block (3 segments), two (5), four (13); and across the 16-bit wrap.
        assert_eq!(super::producer(ctrl_word(7, 3)), (0x12, 8));
        assert_eq!(super::producer(ctrl_word(7, 5)), (0x12, 9));
        assert_eq!(super::producer(ctrl_word(7, 13)), (0x12, 11));
        assert_eq!(super::producer(ctrl_word(0xffff, 3)), (0x12, 0));
        assert_eq!(super::producer(super::value(0x12, 8)), (0x12, 8));
    }
}
