//! The device handles: what the host exports into GPU (or, in CPU mode, host) memory for the
//! data path. `#[repr(C)]`, `Pod`, sizes and offsets asserted. Counters that posters and pollers
//! write sit in cache lines of their own; constants the host sets once sit apart, so reading
//! them never contends with the atomics.
use bytemuck::{Pod, Zeroable};

/// Who rings a QP's doorbell (`DevQp::doorbell_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DoorbellKind {
    /// The poster writes the doorbell record, then stores the 8-byte doorbell to the UAR (or
    /// the soft HCA's doorbell word) at `DevQp::doorbell`.
    Gpu = 0,
    /// The poster publishes its producer index (a u64, raised monotonically) at
    /// `DevQp::doorbell`; a CPU proxy thread writes the record and rings the doorbell.
    CpuProxy = 1,
    /// CPU-assisted, for rings in GPU memory (which a proxy cannot write): the poster does
    /// everything [`Gpu`](Self::Gpu) does, the doorbell record included, but `DevQp::doorbell`
    /// is a host word; a CPU proxy thread forwards the newest doorbell written there to the
    /// UAR.
    CpuAssisted = 2,
}

impl DevQp {
    /// Whether the rings are in GPU memory ([`QP_RINGS_IN_GPU_MEMORY`]).
    #[inline(always)]
    pub const fn rings_in_gpu_memory(&self) -> bool {
        self.flags & QP_RINGS_IN_GPU_MEMORY != 0
    }

    /// Whether the QP is rung without a doorbell record (a reliable doorbell: DOCA GPUNetIO's
    /// `GPU_SM_NO_DBR`, the QP created with `qpc.send_dbr_mode` `NO_DBR_EXT`): its handle names
    /// no record ([`sq_dbrec`](Self::sq_dbrec) 0), so posters and proxies ring once and the HCA
    /// takes every doorbell as it comes.
    #[inline(always)]
    pub const fn no_doorbell_record(&self) -> bool {
        self.sq_dbrec == 0
    }

    /// The byte order of fetched atomic values on this QP.
    #[inline(always)]
    pub const fn atomic_reply_order(&self) -> AtomicReplyOrder {
        AtomicReplyOrder::of_flags(self.flags)
    }
}

impl DoorbellKind {
    /// Decodes the handle's byte; unknown values are `None`.
    #[inline(always)]
    pub const fn from_raw(v: u8) -> Option<Self> {
        match v {
            0 => Some(DoorbellKind::Gpu),
            1 => Some(DoorbellKind::CpuProxy),
            2 => Some(DoorbellKind::CpuAssisted),
            _ => None,
        }
    }
}

/// In which byte order an 8-byte atomic's fetched value reaches the requester's buffer.
///
/// InfiniBand returns it big-endian, and mlx5 does so by default. A ConnectX that reports
/// `atomic_req_8B_endianness_mode_1` can be set (and is, by mlx5_core) to write it in the
/// requester's own byte order instead, which is what NVSHMEM's IBGDA reads. The mode is a
/// property of the device, so it travels in each QP's handle ([`QP_ATOMIC_REPLY_HOST_ORDER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AtomicReplyOrder {
    /// Big-endian (the IB default, mode 0).
    #[default]
    BigEndian,
    /// The requester's byte order: little-endian on every host and GPU gdaki runs on (mode 1).
    HostOrder,
}

impl AtomicReplyOrder {
    /// The order a handle's [`DevQp::flags`] name ([`QP_ATOMIC_REPLY_HOST_ORDER`]).
    #[inline(always)]
    pub const fn of_flags(flags: u8) -> AtomicReplyOrder {
        if flags & QP_ATOMIC_REPLY_HOST_ORDER != 0 {
            AtomicReplyOrder::HostOrder
        } else {
            AtomicReplyOrder::BigEndian
        }
    }

    /// The fetched value from the 8 bytes the HCA wrote, read as a native `u64`.
    #[inline(always)]
    pub const fn decode(self, raw_native: u64) -> u64 {
        match self {
            AtomicReplyOrder::BigEndian => u64::from_be(raw_native),
            AtomicReplyOrder::HostOrder => raw_native,
        }
    }

    /// The `DevQp::flags` bit that carries this mode.
    #[inline(always)]
    pub const fn qp_flags(self) -> u8 {
        match self {
            AtomicReplyOrder::BigEndian => 0,
            AtomicReplyOrder::HostOrder => QP_ATOMIC_REPLY_HOST_ORDER,
        }
    }

    /// The 8 bytes an HCA in this mode writes for fetched value `v`.
    #[inline(always)]
    pub const fn encode(self, v: u64) -> [u8; 8] {
        match self {
            AtomicReplyOrder::BigEndian => v.to_be_bytes(),
            AtomicReplyOrder::HostOrder => v.to_le_bytes(),
        }
    }
}

/// `DevQp::flags`: fetched atomic values arrive in host order ([`AtomicReplyOrder::HostOrder`]);
/// clear: big-endian.
pub const QP_ATOMIC_REPLY_HOST_ORDER: u8 = 1 << 0;
/// `DevQp::flags`: what the HCA writes into this device's memory is not guaranteed visible to
/// the device's own reads once the device has seen the completion (CUDA's GPUDirect RDMA
/// writes ordering below `OWNER`). The data path then ends every READ and fetching atomic
/// with a fenced DUMP WQE and hands out that WQE's ticket, as NVSHMEM and DOCA do.
pub const QP_FLUSH_AFTER_FETCH: u8 = 1 << 1;
/// `DevQp::flags`: the send queue and its doorbell record are in the posting GPU's own memory
/// (a NIC reads them peer-to-peer), so the fences before the doorbell need only GPU scope, as
/// NVSHMEM's IBGDA and DOCA order them; clear: host memory, system scope. The scope covers what
/// the HCA reads from the rings; a kernel that puts data it wrote into host memory orders those
/// writes itself first (`gdaki_device::publish_host_writes`).
pub const QP_RINGS_IN_GPU_MEMORY: u8 = 1 << 2;

/// A layout's fingerprint: FNV-1a over the words of `parts` (each as 8 little-endian bytes),
/// folded to 16 bits. The handles' version words carry it over their fields' offsets and sizes.
pub const fn layout_fingerprint(parts: &[&[usize]]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    let mut p = 0;
    while p < parts.len() {
        let mut i = 0;
        while i < parts[p].len() {
            let mut w = parts[p][i] as u64;
            let mut b = 0;
            while b < 8 {
                h ^= (w & 0xff) as u32;
                h = h.wrapping_mul(0x0100_0193);
                w >>= 8;
                b += 1;
            }
            i += 1;
        }
        p += 1;
    }
    (h >> 16) ^ (h & 0xffff)
}

/// The fingerprints' own revision: raise it when the meaning of a field changes but nothing
/// moves.
const LAYOUT_REVISION: usize = 2;

/// [`DevCq`]'s size and its fields' offsets, in both handles' fingerprints (each handle's words
/// have the CQ's offset).
const DEV_CQ_LAYOUT: [usize; 7] = {
    use core::mem::{offset_of, size_of};
    [
        size_of::<DevCq>(),
        offset_of!(DevCq, consumed),
        offset_of!(DevCq, error),
        offset_of!(DevCq, cqe_base),
        offset_of!(DevCq, dbrec),
        offset_of!(DevCq, cqn),
        offset_of!(DevCq, log_size),
    ]
};

/// [`DevQp`]'s size and its fields' offsets.
const DEV_QP_LAYOUT: [usize; 16] = {
    use core::mem::{offset_of, size_of};
    [
        size_of::<DevQp>(),
        offset_of!(DevQp, sq_reserved),
        offset_of!(DevQp, sq_ready),
        offset_of!(DevQp, sq_rung),
        offset_of!(DevQp, db_lock),
        offset_of!(DevQp, sq_base),
        offset_of!(DevQp, sq_dbrec),
        offset_of!(DevQp, doorbell),
        offset_of!(DevQp, max_msg_size),
        offset_of!(DevQp, timeout_ns),
        offset_of!(DevQp, qpn),
        offset_of!(DevQp, sq_log_size),
        offset_of!(DevQp, doorbell_kind),
        offset_of!(DevQp, flags),
        offset_of!(DevQp, version),
        offset_of!(DevQp, cq),
    ]
};

/// A version word: the fingerprint of `layout`, the CQ's and the revision in the high 16 bits,
/// `size` in the low.
const fn version_word(layout: &[usize], size: usize) -> u32 {
    layout_fingerprint(&[layout, &DEV_CQ_LAYOUT, &[LAYOUT_REVISION]]) << 16 | size as u32
}

/// `DevQp::version` of this layout: a fingerprint of every field's offset and the sizes in the
/// high 16 bits ([`layout_fingerprint`]), the size in the low (NVSHMEM's device structs carry
/// the size the same way), so code built against a handle whose fields moved, grew or were
/// reordered, even at the same size, sees a mismatch.
pub const DEV_QP_VERSION: u32 = version_word(&DEV_QP_LAYOUT, core::mem::size_of::<DevQp>());

/// `DevCq::error` when no error CQE has been seen.
pub const NO_ERROR: u64 = 0;
/// `DevCq::error`: set when the word holds an error.
pub const ERROR_VALID: u64 = 1 << 63;
/// `DevCq::error`: shift of the syndrome.
pub const ERROR_SYNDROME_SHIFT: u32 = 32;
/// `DevCq::error`: shift of the vendor syndrome.
pub const ERROR_VENDOR_SHIFT: u32 = 40;
/// `DevCq::error`: shift of the failed WQE's opcode.
pub const ERROR_WQE_OPCODE_SHIFT: u32 = 48;

/// Packs the first error seen on a CQ: low 32 bits of the failed WQE's counter, syndrome,
/// vendor syndrome, WQE opcode, valid bit. One word, so it is published with one atomic.
#[inline(always)]
pub const fn error_word(index: u64, syndrome: u8, vendor: u8, wqe_opcode: u8) -> u64 {
    ERROR_VALID
        | (wqe_opcode as u64) << ERROR_WQE_OPCODE_SHIFT
        | (vendor as u64) << ERROR_VENDOR_SHIFT
        | (syndrome as u64) << ERROR_SYNDROME_SHIFT
        | index as u32 as u64
}

/// A peer's registered region as device code names it: where it starts, how long it is, and its
/// rkey (C: `gdaki_remote_region`). The host API hands these out for applications to exchange; a
/// buffer every peer has (a symmetric heap) is an array of them, one per peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct DevRemote {
    /// First address.
    pub addr: u64,
    /// Length in bytes (at least 1 for a region).
    pub len: u64,
    /// Remote key (never 0 for a region).
    pub rkey: u32,
    /// Zero.
    pub reserved: u32,
}

/// A completion queue as the device sees it (embedded in [`DevQp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
pub struct DevCq {
    /// Hot: CQEs consumed so far (every WQE is signalled, so also WQEs completed). Raised
    /// monotonically by pollers.
    pub consumed: u64,
    /// Hot: the first error CQE seen ([`error_word`]), or [`NO_ERROR`]. Sticky, so a waiter whose
    /// CQE someone else consumed still learns of the error.
    pub error: u64,
    /// Pads the hot line.
    pub hot_pad: [u64; 6],
    /// Address of CQE 0 (64-byte entries, `1 << log_size` of them; one for a collapsed CQ).
    pub cqe_base: u64,
    /// Address of the CQ doorbell record (`set_ci`, then `arm_db`).
    pub dbrec: u64,
    /// CQ number.
    pub cqn: u32,
    /// log2 of the number of CQEs the device reads; 0 for a collapsed CQ (every CQE in entry
    /// 0, the newest overwriting: see [`ring::cqe_completes`](crate::ring::cqe_completes)), and so
    /// for a CQ of one entry, which is read the same way.
    pub log_size: u32,
    /// Pads the constant line.
    pub const_pad: [u64; 5],
}

/// A send queue with its CQ as the device sees it: the handle device functions take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
pub struct DevQp {
    /// Hot: WQE building blocks reserved so far (advanced by `reserve`).
    pub sq_reserved: u64,
    /// Hot: blocks whose WQEs are written, in order (advanced by `mark_ready`).
    pub sq_ready: u64,
    /// Hot: blocks announced to the HCA (doorbell record and doorbell written).
    pub sq_rung: u64,
    /// Hot: serialises doorbell writes of the GPU handler (0 free, 1 held).
    pub db_lock: u32,
    /// Pads `db_lock`.
    pub lock_pad: u32,
    /// Pads the hot line.
    pub hot_pad: [u64; 4],
    /// Address of WQE building block 0 (`1 << sq_log_size` blocks of 64 bytes).
    pub sq_base: u64,
    /// Address of the send word of the QP doorbell record (record + 4); 0 for a QP without a
    /// record ([`DevQp::no_doorbell_record`]).
    pub sq_dbrec: u64,
    /// GPU handler: address of the 8-byte doorbell register. CPU proxy: address of the u64
    /// producer index the proxy watches.
    pub doorbell: u64,
    /// Largest message one WQE carries; longer puts and gets are split.
    pub max_msg_size: u64,
    /// Bound of every wait, in nanoseconds of the device's global timer.
    pub timeout_ns: u64,
    /// QP number.
    pub qpn: u32,
    /// log2 of the send queue size in building blocks.
    pub sq_log_size: u32,
    /// [`DoorbellKind`] as a byte.
    pub doorbell_kind: u8,
    /// `QP_*` flags ([`QP_ATOMIC_REPLY_HOST_ORDER`], [`QP_FLUSH_AFTER_FETCH`],
    /// [`QP_RINGS_IN_GPU_MEMORY`]).
    pub flags: u8,
    /// Pads `version` to its alignment.
    pub version_pad: [u8; 2],
    /// [`DEV_QP_VERSION`]: the layout this handle was written in. Device functions called
    /// through the C ABI refuse a handle whose word differs (`CODE_BAD_HANDLE`), so code
    /// compiled against another layout, or a pointer that is not a handle, fails cleanly.
    pub version: u32,
    /// Pads the constant line.
    pub const_pad: [u8; 8],
    /// The send completion queue.
    pub cq: DevCq,
}

/// [`DevRq`]'s size and its fields' offsets.
const DEV_RQ_LAYOUT: [usize; 13] = {
    use core::mem::{offset_of, size_of};
    [
        size_of::<DevRq>(),
        offset_of!(DevRq, rq_reserved),
        offset_of!(DevRq, rq_ready),
        offset_of!(DevRq, index_base),
        offset_of!(DevRq, rq_base),
        offset_of!(DevRq, rq_dbrec),
        offset_of!(DevRq, timeout_ns),
        offset_of!(DevRq, qpn),
        offset_of!(DevRq, log_size),
        offset_of!(DevRq, log_stride),
        offset_of!(DevRq, flags),
        offset_of!(DevRq, version),
        offset_of!(DevRq, cq),
    ]
};

/// `DevRq::version` of this layout, made as [`DEV_QP_VERSION`] is.
pub const DEV_RQ_VERSION: u32 = version_word(&DEV_RQ_LAYOUT, core::mem::size_of::<DevRq>());

/// A QP's receive queue with its CQ as the device sees it: the handle receive functions take.
/// Receives are consumed in posting order, so, as on the send side, a receive's index is the
/// index of its CQE on this CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
pub struct DevRq {
    /// Hot: receive WQEs reserved so far.
    pub rq_reserved: u64,
    /// Hot: receives whose WQEs are written and announced in the doorbell record, in order.
    pub rq_ready: u64,
    /// Hot: the receive index the queue's WQE 0 and record count 0 stand for: 0, or where a
    /// QP reset started the hardware's receive counter again (the receive CQ keeps its place,
    /// and receive indices are its CQE indices). Changes only while nobody posts.
    pub index_base: u64,
    /// Pads the hot line.
    pub hot_pad: [u64; 5],
    /// Address of receive WQE 0 (`1 << log_size` WQEs of `16 << log_stride` bytes).
    pub rq_base: u64,
    /// Address of the receive word of the QP doorbell record (record + 0).
    pub rq_dbrec: u64,
    /// Bound of every wait, in nanoseconds of the device's global timer.
    pub timeout_ns: u64,
    /// QP number.
    pub qpn: u32,
    /// log2 of the number of receive WQEs.
    pub log_size: u32,
    /// log2 of the data segments per receive WQE.
    pub log_stride: u32,
    /// `QP_*` flags ([`QP_RINGS_IN_GPU_MEMORY`] for the receive queue and its record).
    pub flags: u8,
    /// Pads `version`.
    pub version_pad: [u8; 3],
    /// [`DEV_RQ_VERSION`].
    pub version: u32,
    /// Pads the constant line.
    pub const_pad: [u8; 20],
    /// The receive completion queue.
    pub cq: DevCq,
}

impl DevRq {
    /// Whether the receive queue is in GPU memory ([`QP_RINGS_IN_GPU_MEMORY`]).
    #[inline(always)]
    pub const fn rings_in_gpu_memory(&self) -> bool {
        self.flags & QP_RINGS_IN_GPU_MEMORY != 0
    }
}

const _: () = {
    use core::mem::{align_of, offset_of, size_of};
    assert!(size_of::<DevRq>() == 256 && align_of::<DevRq>() == 64);
    assert!(offset_of!(DevRq, rq_reserved) == 0 && offset_of!(DevRq, rq_ready) == 8);
    assert!(offset_of!(DevRq, index_base) == 16);
    assert!(offset_of!(DevRq, rq_base) == 64 && offset_of!(DevRq, rq_dbrec) == 72);
    assert!(offset_of!(DevRq, timeout_ns) == 80 && offset_of!(DevRq, qpn) == 88);
    assert!(offset_of!(DevRq, log_size) == 92 && offset_of!(DevRq, log_stride) == 96);
    assert!(offset_of!(DevRq, flags) == 100 && offset_of!(DevRq, version) == 104);
    assert!(offset_of!(DevRq, cq) == 128);
    assert!(size_of::<DevCq>() == 128 && align_of::<DevCq>() == 64);
    assert!(offset_of!(DevCq, consumed) == 0 && offset_of!(DevCq, error) == 8);
    assert!(offset_of!(DevCq, cqe_base) == 64 && offset_of!(DevCq, dbrec) == 72);
    assert!(offset_of!(DevCq, cqn) == 80 && offset_of!(DevCq, log_size) == 84);
    assert!(size_of::<DevQp>() == 256 && align_of::<DevQp>() == 64);
    assert!(offset_of!(DevQp, sq_reserved) == 0 && offset_of!(DevQp, sq_ready) == 8);
    assert!(offset_of!(DevQp, sq_rung) == 16 && offset_of!(DevQp, db_lock) == 24);
    assert!(offset_of!(DevQp, sq_base) == 64 && offset_of!(DevQp, sq_dbrec) == 72);
    assert!(offset_of!(DevQp, doorbell) == 80 && offset_of!(DevQp, max_msg_size) == 88);
    assert!(offset_of!(DevQp, timeout_ns) == 96 && offset_of!(DevQp, qpn) == 104);
    assert!(offset_of!(DevQp, sq_log_size) == 108 && offset_of!(DevQp, doorbell_kind) == 112);
    assert!(offset_of!(DevQp, flags) == 113 && offset_of!(DevQp, version) == 116);
    assert!(offset_of!(DevQp, cq) == 128);
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The version words carry the size in the low half and a fingerprint of the fields'
    /// offsets in the high half, which moves when a field moves, even at the same size.
    #[test]
    fn the_version_words_fingerprint_every_field() {
        assert_eq!(DEV_QP_VERSION & 0xffff, 256);
        assert_eq!(DEV_RQ_VERSION & 0xffff, 256);
        let fingerprint = |layout: &[usize]| layout_fingerprint(&[layout, &DEV_CQ_LAYOUT, &[LAYOUT_REVISION]]);
        assert_eq!(DEV_QP_VERSION >> 16, fingerprint(&DEV_QP_LAYOUT));
        assert_eq!(DEV_RQ_VERSION >> 16, fingerprint(&DEV_RQ_LAYOUT));
        assert_ne!(DEV_QP_VERSION, DEV_RQ_VERSION);
        // Two fields swapped, one moved, a word more, a CQ field moved, another revision: each
        // is another fingerprint.
        let mut swapped = DEV_QP_LAYOUT;
        swapped.swap(10, 11);
        let mut moved = DEV_QP_LAYOUT;
        moved[7] += 8;
        let mut cq_moved = DEV_CQ_LAYOUT;
        cq_moved[3] += 8;
        let base = fingerprint(&DEV_QP_LAYOUT);
        for other in [
            fingerprint(&swapped),
            fingerprint(&moved),
            layout_fingerprint(&[&DEV_QP_LAYOUT, &DEV_CQ_LAYOUT, &[LAYOUT_REVISION], &[0]]),
            layout_fingerprint(&[&DEV_QP_LAYOUT, &cq_moved, &[LAYOUT_REVISION]]),
            layout_fingerprint(&[&DEV_QP_LAYOUT, &DEV_CQ_LAYOUT, &[LAYOUT_REVISION + 1]]),
        ] {
            assert_ne!(other, base);
        }
    }
}
