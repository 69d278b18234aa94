//! The receive queue: its WQEs and the arithmetic of its ring.
//!
//! An mlx5 receive WQE is nothing but data segments ([`crate::data::DataSeg`]), a scatter list:
//! `2^log_rq_stride` of them per WQE (the QP context's `log_rq_stride`; the WQE is 16 bytes
//! times that). A WQE with fewer buffers than its stride ends its list with a segment whose
//! lkey is [`INVALID_LKEY`] (`MLX5_INVALID_LKEY`), as rdma-core's `mlx5_post_recv` writes it.
//! The receive queue sits at offset 0 of the QP's work-queue buffer and the send queue right
//! after it (rdma-core's `mlx5_calc_wq_size`), and its producer counter is word 0 of the QP's
//! doorbell record ([`crate::dbrec::RCV_DBR`]). Receives are consumed in posting order, one per
//! SEND, SEND with immediate or RDMA WRITE with immediate, and each gets a responder CQE whose
//! `wqe_counter` is its index.
use crate::data::{self, DataSeg};
use crate::wqe::{Sge, SgeList, WqeError, MAX_SGES};
use crate::WQE_DS_UNIT;

/// The lkey that ends a receive WQE's scatter list early (`MLX5_INVALID_LKEY`).
pub const INVALID_LKEY: u32 = 0x100;

/// `rq_type` of a QP context: a receive queue of its own (`MLX5_NON_ZERO_RQ`).
pub const RQ_TYPE_REGULAR: u8 = 0x0;

/// The most buffers one receive of gdaki's scatters into: the stride is then at most 64 bytes
/// (`log_rq_stride` 2), one building block, as a send WQE.
pub const MAX_RECV_SGES: usize = MAX_SGES;

/// `log_rq_stride` for receives of up to `sges` buffers (at least one segment: 16 bytes is the
/// smallest stride).
#[inline(always)]
pub const fn log_stride(sges: u32) -> u32 {
    let s = if sges == 0 { 1 } else { sges };
    s.next_power_of_two().trailing_zeros()
}

/// Bytes of one receive WQE of stride `log_stride`.
#[inline(always)]
pub const fn wqe_size(log_stride: u32) -> usize {
    WQE_DS_UNIT << log_stride
}

/// Byte offset of receive WQE `index` in a receive queue of `1 << log_size` WQEs of stride
/// `log_stride`.
#[inline(always)]
pub const fn wqe_offset(index: u64, log_size: u32, log_stride: u32) -> u64 {
    crate::ring::slot(index, log_size) * wqe_size(log_stride) as u64
}

/// Bytes of a receive queue of `1 << log_size` WQEs of stride `log_stride`.
#[inline(always)]
pub const fn queue_bytes(log_size: u32, log_stride: u32) -> usize {
    wqe_size(log_stride) << log_size
}

/// `(log_rq_size, log_rq_stride)` of a receive queue for `1 << log_receives` receives of up to
/// `sges` buffers: the stride is the buffers' segments rounded up to a power of two, and a
/// queue smaller than one send building block (64 bytes) holds more receives until it fills
/// one, since the send queue follows it in the same buffer (as rdma-core sizes its queues).
#[inline(always)]
pub const fn queue_shape(log_receives: u32, sges: u32) -> (u32, u32) {
    let log_stride = log_stride(sges);
    let mut log_size = log_receives;
    while queue_bytes(log_size, log_stride) < crate::SEND_WQE_BB {
        log_size += 1;
    }
    (log_size, log_stride)
}

/// The segment that ends a scatter list shorter than the stride.
#[inline(always)]
pub const fn terminator() -> DataSeg {
    DataSeg::new(0, INVALID_LKEY, 0)
}

/// Decodes a receive WQE (its `wqe_size(log_stride)` bytes, untrusted): the buffers up to the
/// first [`INVALID_LKEY`] segment or the end of the stride. A WQE of more buffers than
/// [`MAX_RECV_SGES`], or a segment with the inline bit set, is malformed. Never panics.
pub fn parse(bytes: &[u8]) -> Result<SgeList, WqeError> {
    let mut list = SgeList::default();
    for seg in bytes.chunks_exact(data::SIZE) {
        let d: DataSeg = bytemuck::pod_read_unaligned(seg);
        if d.lkey.get() == INVALID_LKEY {
            break;
        }
        let length = d.byte_count.get();
        if length & crate::inline::INLINE_SEG != 0 {
            return Err(WqeError::BadInline {
                len: length & !crate::inline::INLINE_SEG,
                room: 0,
            });
        }
        // A list longer than MAX_RECV_SGES (the list's capacity) is refused by the push.
        list.push(Sge {
            addr: d.addr.get(),
            length,
            lkey: d.lkey.get(),
        })?;
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The queue shapes are those rdma-core's own DevX RC test computes for its receive queue
    /// (tests/mlx5_base.py, `create_queue_attrs` and `create_qp`): WQE size the segments rounded
    /// up to a power of two, at least 64 bytes of queue, `log_rq_stride` the WQE size's log
    /// minus 4, `log_rq_size` the log of the WQEs that fit, the send queue at the queue's end.
    #[test]
    fn queue_shapes_are_those_rdma_cores_devx_test_computes() {
        for sges in 1..=MAX_RECV_SGES as u32 {
            for log_receives in 0..=15u32 {
                let wqe_size = (16 * sges as usize).next_power_of_two();
                let wq_size = (wqe_size << log_receives).max(crate::SEND_WQE_BB);
                let wqe_num = wq_size.div_ceil(wqe_size);
                let (log_size, log_stride) = queue_shape(log_receives, sges);
                let case = (sges, log_receives);
                assert_eq!(log_stride, wqe_size.trailing_zeros() - 4, "{case:?}");
                assert_eq!(1usize << log_size, wqe_num.next_power_of_two(), "{case:?}");
                // The send queue's offset in the work-queue buffer.
                assert_eq!(queue_bytes(log_size, log_stride), wq_size, "{case:?}");
            }
        }
    }

    fn wqe(segs: &[DataSeg]) -> [u8; 64] {
        let mut b = [0u8; 64];
        for (i, s) in segs.iter().enumerate() {
            b[16 * i..16 * (i + 1)].copy_from_slice(bytemuck::bytes_of(s));
        }
        b
    }

    #[test]
    fn a_receive_is_its_buffers_up_to_the_terminator() {
        let a = DataSeg::new(100, 7, 0x1000);
        let b = DataSeg::new(28, 9, 0x2000);
        let list = parse(&wqe(&[a, b, terminator(), DataSeg::new(5, 5, 5)])).unwrap();
        assert_eq!(list.total_len(), 128);
        assert_eq!(
            list.as_slice()[1],
            Sge {
                addr: 0x2000,
                length: 28,
                lkey: 9
            }
        );
        // A full stride needs no terminator; a first terminator is an empty list.
        assert_eq!(parse(&wqe(&[a, a, a, a])).unwrap().as_slice().len(), 4);
        assert!(parse(&wqe(&[terminator()])).unwrap().as_slice().is_empty());
        assert_eq!(parse(&wqe(&[a])[..16]).unwrap().as_slice().len(), 1);
    }

    #[test]
    fn malformed_receives_are_refused() {
        let inl = DataSeg::new(crate::inline::INLINE_SEG | 4, 1, 0);
        assert!(matches!(parse(&wqe(&[inl])), Err(WqeError::BadInline { len: 4, .. })));
        let a = DataSeg::new(1, 1, 1);
        let mut big = [0u8; 80];
        for i in 0..5 {
            big[16 * i..16 * (i + 1)].copy_from_slice(bytemuck::bytes_of(&a));
        }
        assert!(matches!(parse(&big), Err(WqeError::TooManySges { .. })));
    }

    #[test]
    fn strides_are_powers_of_two_of_segments() {
        assert_eq!([0, 1, 2, 3, 4].map(log_stride), [0, 0, 1, 2, 2]);
        assert_eq!(wqe_size(2), 64);
        assert_eq!(wqe_offset(5, 2, 1), 32);
        assert_eq!(queue_bytes(8, 0), 4096);
    }
}
