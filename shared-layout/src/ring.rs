//! Ring arithmetic, written once for the device, the proxy, the soft HCA and the tests.
//!
//! Producer and consumer positions are free-running 64-bit counters (never masked in software);
//! a slot is the counter modulo the ring size, and what the hardware sees is the counter cut to
//! its field width (16 bits for WQE indices, 24 for the CQ consumer index).
use crate::{atomic, cqe, ctrl, data, inline, raddr, wait, SEND_WQE_BB, WQE_DS_UNIT};

/// The slot of counter `index` in a ring of `1 << log_size` entries.
#[inline(always)]
pub const fn slot(index: u64, log_size: u32) -> u64 {
    index & ((1u64 << log_size) - 1)
}

/// The lap parity of counter `index` in a ring of `1 << log_size` entries: the owner bit a CQE
/// written for this index carries.
#[inline(always)]
pub const fn owner_parity(index: u64, log_size: u32) -> u8 {
    ((index >> log_size) & 1) as u8
}

/// Whether the CQE with `op_own` at the slot of consumer counter `index` has been written for
/// this lap (software-owned): valid opcode and owner bit equal to the lap parity (rdma-core
/// `get_sw_cqe`). In a collapsed CQ (`log_size` 0) the owner bit says
/// nothing: a valid opcode is all (see [`cqe_completes`]).
#[inline(always)]
pub const fn cqe_ready(op_own: u8, index: u64, log_size: u32) -> bool {
    !matches!(cqe::opcode(op_own), crate::CqeOpcode::Invalid)
        && (cqe::owner(op_own) == owner_parity(index, log_size) || log_size == 0)
}

/// Whether a written CQE carrying `wqe_counter` says that the WQE whose counter is `counter` has
/// completed. In a ring a CQE is its own WQE's or not yet; in a collapsed CQ (one entry,
/// `log_size` 0: every CQE lands in entry 0, the newest overwriting the rest, as mlx5's
/// `cqc.cc`) the newest CQE is there, and since completions come in order, a CQE of this WQE or
/// of a later one says this one has completed. Its owner bit flips per lap of the ring the HCA
/// was given, so only the counter tells (wrapped order: a send queue holds at most 2^15 WQEs).
#[inline(always)]
pub const fn cqe_completes(wqe_counter: u16, counter: u16, log_size: u32) -> bool {
    let ahead = wqe_counter.wrapping_sub(counter);
    ahead == 0 || (log_size == 0 && (ahead as i16) > 0)
}

/// Byte offset of WQE building block `index` in a send queue of `1 << log_size` blocks.
#[inline(always)]
pub const fn wqe_offset(index: u64, log_size: u32) -> u64 {
    slot(index, log_size) * SEND_WQE_BB as u64
}

/// Byte offset of CQE `index` in a CQ of `1 << log_size` entries.
#[inline(always)]
pub const fn cqe_offset(index: u64, log_size: u32) -> u64 {
    slot(index, log_size) * cqe::SIZE as u64
}

/// WQE building blocks a WQE of `ds` 16-byte units occupies.
#[inline(always)]
pub const fn wqebbs(ds: u32) -> u32 {
    (ds * WQE_DS_UNIT as u32).div_ceil(SEND_WQE_BB as u32)
}

/// `ds` of a NOP: the control segment alone.
pub const DS_NOP: u8 = (ctrl::SIZE / WQE_DS_UNIT) as u8;
/// `ds` of an RDMA WRITE or READ with one data segment.
pub const DS_RDMA: u8 = ((ctrl::SIZE + raddr::SIZE + data::SIZE) / WQE_DS_UNIT) as u8;
/// `ds` of an RDMA WRITE gathered from two data segments (one 64-byte WQE building block).
pub const DS_RDMA_GATHER2: u8 = ((ctrl::SIZE + raddr::SIZE + 2 * data::SIZE) / WQE_DS_UNIT) as u8;
/// `ds` of an 8-byte atomic: control, remote address, atomic and one data segment.
pub const DS_ATOMIC: u8 = ((ctrl::SIZE + raddr::SIZE + atomic::SIZE + data::SIZE) / WQE_DS_UNIT) as u8;

/// `ds` of a DUMP: control and one data segment (the local byte the HCA reads).
pub const DS_DUMP: u8 = ((ctrl::SIZE + data::SIZE) / WQE_DS_UNIT) as u8;

/// `ds` of a WAIT: control and wait segments.
pub const DS_WAIT: u8 = ((ctrl::SIZE + wait::SIZE) / WQE_DS_UNIT) as u8;

/// `ds` of a SEND with one data segment.
pub const DS_SEND: u8 = ((ctrl::SIZE + data::SIZE) / WQE_DS_UNIT) as u8;

/// `ds` of a SEND with `len` bytes inline (none: the control segment alone).
#[inline(always)]
pub const fn ds_send_inline(len: usize) -> u8 {
    let inl = if len == 0 { 0 } else { inline::ds(len) };
    (ctrl::SIZE / WQE_DS_UNIT + inl) as u8
}

/// `ds` of an RDMA WRITE with `len` bytes inline. With no bytes there is no inline segment at
/// all (a zero-length WRITE of control and remote address), as rdma-core's `set_data_inl_seg`
/// emits it: a header of byte count 0 is a form no reference posts.
#[inline(always)]
pub const fn ds_write_inline(len: usize) -> u8 {
    let inl = if len == 0 { 0 } else { inline::ds(len) };
    ((ctrl::SIZE + raddr::SIZE) / WQE_DS_UNIT + inl) as u8
}

/// Whether a send queue with `reserved` blocks reserved so far and `completed` completed has
/// room for `count` more in a ring of `1 << log_size` blocks.
#[inline(always)]
pub const fn has_room(reserved: u64, completed: u64, count: u64, log_size: u32) -> bool {
    reserved + count - completed <= 1u64 << log_size
}

/// `a` is at or after `b` in 16-bit wrapped order (for values within 2^15 of each other).
#[inline(always)]
pub const fn wq_counter_at_or_after(a: u16, b: u16) -> bool {
    (a.wrapping_sub(b) as i16) >= 0
}

/// `a` is at or after `b` in 24-bit wrapped order (for values within 2^23 of each other).
#[inline(always)]
pub const fn cq_ci_at_or_after(a: u32, b: u32) -> bool {
    ((a.wrapping_sub(b) << 8) as i32) >= 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_per_request() {
        assert_eq!((DS_NOP, DS_RDMA, DS_ATOMIC, DS_DUMP, DS_WAIT), (1, 3, 4, 2, 2));
        assert_eq!((DS_RDMA_GATHER2, wqebbs(DS_RDMA_GATHER2 as u32)), (4, 1));
        assert_eq!(
            (
                ds_write_inline(0),
                ds_write_inline(12),
                ds_write_inline(13),
                ds_write_inline(28)
            ),
            (2, 3, 4, 4)
        );
        assert_eq!(ds_write_inline(29), 5);
        assert_eq!((wqebbs(1), wqebbs(4), wqebbs(5), wqebbs(8), wqebbs(9)), (1, 1, 2, 2, 3));
    }

    #[test]
    fn owner_parity_flips_each_lap() {
        let log = 3;
        for i in 0..64u64 {
            assert_eq!(owner_parity(i, log), ((i / 8) % 2) as u8);
            assert_eq!(slot(i, log), i % 8);
        }
        let fresh = cqe::OP_OWN_INIT;
        assert!(
            !cqe_ready(fresh, 0, log) && !cqe_ready(fresh, 8, log),
            "INVALID is never ready"
        );
        let written_lap0 = cqe::op_own(crate::CqeOpcode::Req, 0);
        assert!(cqe_ready(written_lap0, 0, log) && !cqe_ready(written_lap0, 8, log));
    }

    #[test]
    fn a_collapsed_cq_is_read_by_its_counter_alone() {
        let req = |owner| cqe::op_own(crate::CqeOpcode::Req, owner);
        // Either owner bit, any index: a collapsed entry is written once its opcode is valid.
        assert!(cqe_ready(req(0), 1, 0) && cqe_ready(req(1), 2, 0) && !cqe_ready(cqe::OP_OWN_INIT, 0, 0));
        assert!(cqe_completes(7, 7, 0));
        assert!(cqe_completes(9, 7, 0), "a later CQE completes this WQE too");
        assert!(!cqe_completes(6, 7, 0), "an earlier one does not");
        assert!(cqe_completes(2, 0xfffe, 0), "across the 16-bit wrap");
        assert!(!cqe_completes(0xfffe, 2, 0));
        // A ring reads its own entry only.
        assert!(cqe_completes(7, 7, 3) && !cqe_completes(9, 7, 3));
    }

    #[test]
    fn wrapped_comparisons() {
        assert!(wq_counter_at_or_after(2, 0xfffe) && !wq_counter_at_or_after(0xfffe, 2));
        assert!(cq_ci_at_or_after(1, 0xff_ffff) && !cq_ci_at_or_after(0xff_ffff, 1));
        assert!(has_room(8, 0, 0, 3) && !has_room(8, 0, 1, 3) && has_room(9, 1, 0, 3));
    }
}
