//! What the host hands the perftest kernels (`put_bw`, `write_lat`) besides scalars: one
//! [`PingPongSide`] per ping-pong participant, in GPU (or, in CPU mode, host) memory.
use bytemuck::{Pod, Zeroable};

/// One side of `write_lat`'s ping-pong: its QP, the buffer it sends from, the buffer its peer
/// writes into (or, with `--send`, its receives scatter into), and where its timestamps go.
/// Addresses are as the side's device sees them (which is also how the HCA sees them for the
/// soft provider's host-pinned memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct PingPongSide {
    /// Address of the side's exported [`DevQp`](crate::DevQp).
    pub qp: u64,
    /// The local buffer each message is sent from (`size` bytes; the last is the flag).
    pub post: u64,
    /// The local buffer the peer's messages land in (`size` bytes; the last is the flag).
    pub poll: u64,
    /// The peer's poll buffer, as the peer's HCA knows it.
    pub remote: u64,
    /// Local key of `post`.
    pub lkey: u32,
    /// Remote key of `remote`.
    pub rkey: u32,
    /// 1: this side sends first (the client); 0: it answers (the server).
    pub initiator: u32,
    /// Local key of `poll` (two-sided: the receives' buffer).
    pub poll_lkey: u32,
    /// Where the side writes one u64 timestamp (ns) per iteration as it sends, or 0 for none.
    pub times: u64,
    /// Where the side writes one u64 timestamp (ns) per iteration once its put has returned
    /// (WQE written, doorbell rung), or 0 for none: with `times`, what the post itself cost.
    pub posted: u64,
    /// Two-sided (`write_lat --send`, perftest's `ib_send_lat`): the address of the side's
    /// exported [`DevRq`](crate::DevRq); messages are SENDs that the receives posted into
    /// `poll` take. 0: RDMA WRITEs into the peer's `poll`, polled by their last byte.
    pub rq: u64,
    /// Bytes each receive offers (the poll buffer's length, at least every size sent).
    pub recv_len: u64,
    /// Messages of at most this many bytes travel inline in their WQE (perftest's `-I`): the
    /// post buffer's bytes are read once, before the first message, and only the flag byte
    /// changes. 0: none (every message is gathered from `post` by the HCA).
    pub inline_max: u32,
    /// `PING_PONG_*` flags ([`PING_PONG_BLUEFLAME`]).
    pub flags: u32,
}

/// `PingPongSide::flags`: each message is rung by a BlueFlame write of its WQE
/// (`gdaki_device::Qp::blueflame`; `write_lat --blueflame`).
pub const PING_PONG_BLUEFLAME: u32 = 1 << 0;

const _: () = {
    use core::mem::{offset_of, size_of};
    assert!(size_of::<PingPongSide>() == 88);
    assert!(offset_of!(PingPongSide, inline_max) == 80);
    assert!(offset_of!(PingPongSide, lkey) == 32 && offset_of!(PingPongSide, times) == 48);
    assert!(offset_of!(PingPongSide, posted) == 56 && offset_of!(PingPongSide, rq) == 64);
};

/// What `put_bw`'s stream posts: the kernels take it as a `u32` ([`code`](Self::code)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u32)]
pub enum StreamOp {
    /// RDMA WRITEs into the peer's buffer (`put_bw`, perftest's `ib_write_bw`).
    #[default]
    Write = 0,
    /// RDMA READs from the peer's buffer (`put_bw --read`, `ib_read_bw`).
    Read = 1,
    /// SENDs, each taken by a receive the peer posted (`put_bw --send`, `ib_send_bw`).
    Send = 2,
}

impl StreamOp {
    /// The code the kernels take.
    #[inline(always)]
    pub const fn code(self) -> u32 {
        self as u32
    }

    /// The operation of a kernel's `code`, if it is one.
    #[inline(always)]
    pub const fn from_code(code: u32) -> Option<StreamOp> {
        match code {
            0 => Some(StreamOp::Write),
            1 => Some(StreamOp::Read),
            2 => Some(StreamOp::Send),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StreamOp;

    #[test]
    fn stream_op_codes_round_trip_and_refuse_the_rest() {
        for op in [StreamOp::Write, StreamOp::Read, StreamOp::Send] {
            assert_eq!(StreamOp::from_code(op.code()), Some(op));
        }
        assert_eq!(StreamOp::from_code(3), None);
        assert_eq!(StreamOp::from_code(u32::MAX), None);
    }
}
