//! Reading WQEs from untrusted bytes (the soft HCA parses WQEs it did not write), in smoltcp's
//! pattern: [`WqeView`] checks lengths once, after which no accessor panics, and
//! [`WorkRequest::parse`] decodes the meaning into a value tests compare with `assert_eq!`.
//!
//! A WQE handed to the view starts with its control segment and holds at least `ds * 16` bytes
//! (the caller gathers building blocks across the ring's wrap first).
use crate::{atomic, ctrl, data, inline, raddr, Syndrome, WqeOpcode, SEND_WQE_BB, WQE_DS_UNIT};

/// Data segments a WQE may carry (gather or scatter list).
pub const MAX_SGES: usize = 4;
/// Largest WQE in bytes (`ds` is 6 bits: 63 units of 16 bytes, in 16 building blocks).
pub const MAX_WQE_SIZE: usize = 63 * WQE_DS_UNIT;
/// Building blocks of the largest WQE.
pub const MAX_WQEBBS: usize = MAX_WQE_SIZE.div_ceil(SEND_WQE_BB);

/// Why a WQE cannot be executed. Each maps to the syndrome a NIC would report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WqeError {
    /// Fewer bytes than the control segment or than `ds` claims.
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes given.
        available: usize,
    },
    /// `ds` does not fit the opcode (e.g. 0, or an atomic without its four segments).
    BadDs {
        /// The opcode.
        opcode: WqeOpcode,
        /// The `ds` found.
        ds: u8,
    },
    /// More data segments than [`MAX_SGES`].
    TooManySges {
        /// Segments found.
        count: usize,
    },
    /// An inline segment longer than the WQE holds, or inline data where it is not allowed.
    BadInline {
        /// Claimed length.
        len: u32,
        /// Bytes the WQE has room for.
        room: usize,
    },
    /// An atomic whose result buffer is not 8 bytes.
    BadAtomicLength {
        /// The result segment's length.
        len: u32,
    },
    /// An opcode the model does not execute.
    UnsupportedOpcode(WqeOpcode),
}

impl WqeError {
    /// The syndrome a NIC reports for this error.
    pub const fn syndrome(&self) -> Syndrome {
        match self {
            WqeError::TooManySges { .. } | WqeError::BadInline { .. } | WqeError::BadAtomicLength { .. } => {
                Syndrome::LocalLength
            }
            _ => Syndrome::LocalQpOp,
        }
    }
}

/// A length-checked view of the bytes of one WQE.
#[derive(Debug, Clone, Copy)]
pub struct WqeView<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> WqeView<T> {
    /// Wraps without checking; accessors may panic on short buffers. For emitters.
    pub const fn new_unchecked(buffer: T) -> Self {
        WqeView { buffer }
    }

    /// Wraps and checks that the control segment and the `ds` units it claims are present and
    /// that `ds` is not 0.
    pub fn new_checked(buffer: T) -> Result<Self, WqeError> {
        let view = WqeView { buffer };
        view.check_len()?;
        Ok(view)
    }

    /// The check [`new_checked`](Self::new_checked) makes.
    pub fn check_len(&self) -> Result<(), WqeError> {
        let available = self.buffer.as_ref().len();
        if available < ctrl::SIZE {
            return Err(WqeError::Truncated {
                needed: ctrl::SIZE,
                available,
            });
        }
        let ds = self.ctrl().ds();
        if ds == 0 {
            return Err(WqeError::BadDs {
                opcode: self.ctrl().opcode(),
                ds,
            });
        }
        let needed = ds as usize * WQE_DS_UNIT;
        if available < needed {
            return Err(WqeError::Truncated { needed, available });
        }
        Ok(())
    }

    /// The control segment.
    pub fn ctrl(&self) -> ctrl::CtrlSeg {
        bytemuck::pod_read_unaligned(&self.buffer.as_ref()[..ctrl::SIZE])
    }

    /// 16-byte segment `n` (0 is the control segment); `None` beyond `ds`.
    pub fn segment(&self, n: usize) -> Option<&[u8; WQE_DS_UNIT]> {
        if n >= self.ctrl().ds() as usize {
            return None;
        }
        self.buffer
            .as_ref()
            .get(n * WQE_DS_UNIT..(n + 1) * WQE_DS_UNIT)?
            .try_into()
            .ok()
    }

    /// The WQE's bytes (`ds * 16` of them).
    pub fn bytes(&self) -> &[u8] {
        let len = (self.ctrl().ds() as usize * WQE_DS_UNIT).min(self.buffer.as_ref().len());
        &self.buffer.as_ref()[..len]
    }
}

/// A remote buffer: address and key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Remote {
    /// Remote virtual address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
}

impl Remote {
    /// The buffer `by` bytes further on, same key.
    #[inline(always)]
    pub const fn offset(self, by: u64) -> Remote {
        Remote {
            addr: self.addr.wrapping_add(by),
            rkey: self.rkey,
        }
    }
}

/// A local buffer: address, length and key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Local virtual address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key.
    pub lkey: u32,
}

/// Up to [`MAX_SGES`] local buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SgeList {
    sges: [Sge; MAX_SGES],
    count: u8,
}

impl SgeList {
    /// A list of one buffer.
    pub const fn one(sge: Sge) -> Self {
        let mut sges = [Sge {
            addr: 0,
            length: 0,
            lkey: 0,
        }; MAX_SGES];
        sges[0] = sge;
        SgeList { sges, count: 1 }
    }

    /// The buffers.
    pub fn as_slice(&self) -> &[Sge] {
        &self.sges[..self.count as usize]
    }

    /// Total length in bytes.
    pub fn total_len(&self) -> u64 {
        self.as_slice().iter().map(|s| s.length as u64).sum()
    }

    pub(crate) fn push(&mut self, sge: Sge) -> Result<(), WqeError> {
        let slot = self
            .sges
            .get_mut(self.count as usize)
            .ok_or(WqeError::TooManySges { count: MAX_SGES + 1 })?;
        *slot = sge;
        self.count += 1;
        Ok(())
    }
}

/// Where an RDMA WRITE's or a SEND's payload comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// Gathered from local buffers.
    Gather(SgeList),
    /// Carried in the WQE: `len` bytes at byte `offset` of the WQE.
    Inline {
        /// Offset of the payload inside the WQE bytes.
        offset: u16,
        /// Length in bytes.
        len: u16,
    },
}

/// What a WQE asks the HCA to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// Nothing (completes like any WQE).
    Nop,
    /// RDMA WRITE (with immediate when the opcode says so).
    Write {
        /// Destination.
        remote: Remote,
        /// Source.
        payload: Payload,
    },
    /// SEND (with immediate when the opcode says so): the payload lands in the buffers of the
    /// responder's next receive.
    Send {
        /// Source.
        payload: Payload,
    },
    /// RDMA READ from `remote` into `local`.
    Read {
        /// Source.
        remote: Remote,
        /// Destination buffers.
        local: SgeList,
    },
    /// DUMP: the HCA reads the local buffer and completes; with a fence mode it is the
    /// consistency point after earlier READs and atomics (NVSHMEM's and DOCA's use).
    Dump {
        /// The local buffer read.
        local: Sge,
    },
    /// Core-Direct WAIT: the send queue stops here until CQ `cqn` has produced CQE
    /// `max_index` (see [`crate::wait::WaitSeg::reached`]); a QP may post it only if it was
    /// created with `qpc.cd_master`.
    Wait {
        /// The CQ whose CQEs are counted.
        cqn: u32,
        /// The CQE waited for (32 bits of its index).
        max_index: u32,
    },
    /// 8-byte fetch-and-add at `remote`; the old value lands in `result`.
    FetchAdd {
        /// Target.
        remote: Remote,
        /// Addend.
        add: u64,
        /// Where the fetched value goes (8 bytes).
        result: Sge,
    },
    /// 8-byte compare-and-swap at `remote`; the old value lands in `result`.
    CompareSwap {
        /// Target.
        remote: Remote,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
        /// Where the fetched value goes (8 bytes).
        result: Sge,
    },
}

/// A decoded work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkRequest {
    /// The opcode.
    pub opcode: WqeOpcode,
    /// Opcode modifier.
    pub opmod: u8,
    /// 16-bit WQE index.
    pub wqe_index: u16,
    /// QP number.
    pub qpn: u32,
    /// Size in 16-byte units.
    pub ds: u8,
    /// Fence / completion / solicited flags.
    pub fm_ce_se: u8,
    /// Immediate data as stored.
    pub imm: u32,
    /// The operation.
    pub op: Operation,
}

impl WorkRequest {
    /// Whether the WQE asks for a CQE.
    pub const fn signaled(&self) -> bool {
        self.fm_ce_se & ctrl::CE_CQ_UPDATE != 0
    }

    /// Decodes a checked view. Never panics.
    pub fn parse<T: AsRef<[u8]>>(view: &WqeView<T>) -> Result<WorkRequest, WqeError> {
        view.check_len()?;
        let c = view.ctrl();
        let (opcode, ds) = (c.opcode(), c.ds());
        let bad_ds = WqeError::BadDs { opcode, ds };
        let seg = |n: usize| view.segment(n).ok_or(bad_ds);
        let remote = || -> Result<Remote, WqeError> {
            let r: raddr::RaddrSeg = bytemuck::pod_read_unaligned(seg(1)?);
            Ok(Remote {
                addr: r.raddr.get(),
                rkey: r.rkey.get(),
            })
        };
        let sge = |n: usize| -> Result<Sge, WqeError> {
            let d: data::DataSeg = bytemuck::pod_read_unaligned(seg(n)?);
            Ok(Sge {
                addr: d.addr.get(),
                length: d.byte_count.get(),
                lkey: d.lkey.get(),
            })
        };
        let gather = |first: usize| -> Result<SgeList, WqeError> {
            let count = ds as usize - first;
            if count > MAX_SGES {
                return Err(WqeError::TooManySges { count });
            }
            let mut list = SgeList::default();
            for n in first..ds as usize {
                let s = sge(n)?;
                if s.length & inline::INLINE_SEG != 0 {
                    return Err(WqeError::BadInline {
                        len: s.length & !inline::INLINE_SEG,
                        room: 0,
                    });
                }
                list.push(s)?;
            }
            Ok(list)
        };
        // A payload starting at segment `first`: inline (its header's length must fill exactly
        // the units after it) or a gather list.
        let payload_at = |first: usize| -> Result<Payload, WqeError> {
            match view.segment(first) {
                Some(s) if u32::from_be_bytes([s[0], s[1], s[2], s[3]]) & inline::INLINE_SEG != 0 => {
                    let len = u32::from_be_bytes([s[0], s[1], s[2], s[3]]) & !inline::INLINE_SEG;
                    let offset = first * WQE_DS_UNIT + inline::HEADER_SIZE;
                    let room = ds as usize * WQE_DS_UNIT - offset;
                    if len as usize > room || inline::ds(len as usize) != ds as usize - first {
                        return Err(WqeError::BadInline { len, room });
                    }
                    Ok(Payload::Inline {
                        offset: offset as u16,
                        len: len as u16,
                    })
                }
                _ => Ok(Payload::Gather(gather(first)?)),
            }
        };
        let op = match opcode {
            WqeOpcode::Nop => Operation::Nop,
            WqeOpcode::RdmaWrite | WqeOpcode::RdmaWriteImm | WqeOpcode::RdmaRead if ds < 2 => return Err(bad_ds),
            // Control and remote address, then the payload.
            WqeOpcode::RdmaWrite | WqeOpcode::RdmaWriteImm => Operation::Write {
                payload: payload_at(2)?,
                remote: remote()?,
            },
            // Control, then the payload.
            WqeOpcode::Send | WqeOpcode::SendImm => Operation::Send {
                payload: payload_at(1)?,
            },
            WqeOpcode::Dump if ds != crate::ring::DS_DUMP => return Err(bad_ds),
            WqeOpcode::Dump => {
                let local = sge(1)?;
                if local.length & inline::INLINE_SEG != 0 {
                    return Err(WqeError::BadInline {
                        len: local.length & !inline::INLINE_SEG,
                        room: 0,
                    });
                }
                Operation::Dump { local }
            }
            WqeOpcode::Wait if ds != crate::ring::DS_WAIT => return Err(bad_ds),
            WqeOpcode::Wait => {
                let w: crate::wait::WaitSeg = bytemuck::pod_read_unaligned(seg(1)?);
                Operation::Wait {
                    cqn: w.cqn.get(),
                    max_index: w.max_index.get(),
                }
            }
            WqeOpcode::RdmaRead => Operation::Read {
                remote: remote()?,
                local: gather(2)?,
            },
            WqeOpcode::AtomicFa | WqeOpcode::AtomicCs => {
                if ds != crate::ring::DS_ATOMIC {
                    return Err(bad_ds);
                }
                let a: atomic::AtomicSeg = bytemuck::pod_read_unaligned(seg(2)?);
                let result = sge(3)?;
                if result.length != atomic::OPERAND_SIZE as u32 {
                    return Err(WqeError::BadAtomicLength { len: result.length });
                }
                let remote = remote()?;
                if opcode == WqeOpcode::AtomicFa {
                    Operation::FetchAdd {
                        remote,
                        add: a.swap_add.get(),
                        result,
                    }
                } else {
                    Operation::CompareSwap {
                        remote,
                        compare: a.compare.get(),
                        swap: a.swap_add.get(),
                        result,
                    }
                }
            }
            other => return Err(WqeError::UnsupportedOpcode(other)),
        };
        Ok(WorkRequest {
            opcode,
            opmod: c.opmod(),
            wqe_index: c.wqe_index(),
            qpn: c.qpn(),
            ds,
            fm_ce_se: c.fm_ce_se,
            imm: c.imm.get(),
            op,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::atomic::AtomicSeg;
    use crate::ctrl::{CtrlSeg, CE_CQ_UPDATE};
    use crate::data::DataSeg;
    use crate::raddr::RaddrSeg;

    fn wqe(segs: &[&[u8]]) -> [u8; 128] {
        let mut buf = [0xa5u8; 128];
        let mut at = 0;
        for s in segs {
            buf[at..at + s.len()].copy_from_slice(s);
            at += s.len();
        }
        buf
    }

    #[test]
    fn parses_a_write() {
        let c = CtrlSeg::new(WqeOpcode::RdmaWrite, 0, 7, 0x99, 3, CE_CQ_UPDATE, 0);
        let r = RaddrSeg::new(0x1000, 0xabc);
        let d = DataSeg::new(4096, 0x55, 0x2000);
        let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&r), bytemuck::bytes_of(&d)]);
        let wr = WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()).unwrap();
        let sge = Sge {
            addr: 0x2000,
            length: 4096,
            lkey: 0x55,
        };
        assert_eq!(
            wr.op,
            Operation::Write {
                remote: Remote {
                    addr: 0x1000,
                    rkey: 0xabc
                },
                payload: Payload::Gather(SgeList::one(sge))
            }
        );
        assert_eq!((wr.wqe_index, wr.qpn, wr.ds), (7, 0x99, 3));
        assert!(wr.signaled());
    }

    #[test]
    fn parses_inline_and_atomics() {
        let c = CtrlSeg::new(WqeOpcode::RdmaWrite, 0, 1, 1, 4, 0, 0);
        let r = RaddrSeg::new(8, 9);
        let mut inl = [0u8; 32];
        inl[..4].copy_from_slice(&inline::byte_count(20).to_be_bytes());
        inl[4..24].copy_from_slice(&[7u8; 20]);
        let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&r), &inl]);
        let view = WqeView::new_checked(&buf[..]).unwrap();
        let wr = WorkRequest::parse(&view).unwrap();
        assert_eq!(
            wr.op,
            Operation::Write {
                remote: Remote { addr: 8, rkey: 9 },
                payload: Payload::Inline { offset: 36, len: 20 }
            }
        );
        assert!(!wr.signaled());
        assert_eq!(&view.bytes()[36..56], &[7u8; 20]);

        let c = CtrlSeg::new(WqeOpcode::AtomicCs, 0, 2, 1, 4, CE_CQ_UPDATE, 0);
        let a = AtomicSeg::compare_swap(5, 6);
        let d = DataSeg::new(8, 3, 0x40);
        let buf = wqe(&[
            bytemuck::bytes_of(&c),
            bytemuck::bytes_of(&r),
            bytemuck::bytes_of(&a),
            bytemuck::bytes_of(&d),
        ]);
        let wr = WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()).unwrap();
        let result = Sge {
            addr: 0x40,
            length: 8,
            lkey: 3,
        };
        assert_eq!(
            wr.op,
            Operation::CompareSwap {
                remote: Remote { addr: 8, rkey: 9 },
                compare: 5,
                swap: 6,
                result
            }
        );
    }

    #[test]
    fn parses_a_dump_and_a_zero_byte_write() {
        let c = CtrlSeg::new(WqeOpcode::Dump, 0, 3, 7, 2, CE_CQ_UPDATE | crate::ctrl::FM_FENCE, 0);
        let d = DataSeg::new(1, 0x44, 0x9000);
        let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&d)]);
        let wr = WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()).unwrap();
        let local = Sge {
            addr: 0x9000,
            length: 1,
            lkey: 0x44,
        };
        assert_eq!(wr.op, Operation::Dump { local });
        assert_eq!(
            crate::ctrl::FenceMode::from_fm_ce_se(wr.fm_ce_se),
            crate::ctrl::FenceMode::Fence
        );
        // A DUMP is exactly control and data segment.
        for ds in [1, 3] {
            let c = CtrlSeg::new(WqeOpcode::Dump, 0, 3, 7, ds, CE_CQ_UPDATE, 0);
            let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&d)]);
            assert!(matches!(
                WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()),
                Err(WqeError::BadDs { .. })
            ));
        }
        // The zero-byte inline WRITE: control and remote address only.
        let c = CtrlSeg::new(WqeOpcode::RdmaWrite, 0, 4, 7, crate::ring::ds_write_inline(0), 0, 0);
        let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&RaddrSeg::new(8, 9))]);
        let wr = WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()).unwrap();
        assert_eq!(
            wr.op,
            Operation::Write {
                remote: Remote { addr: 8, rkey: 9 },
                payload: Payload::Gather(SgeList::default())
            }
        );
    }

    #[test]
    fn parses_a_wait_of_exactly_two_units() {
        let c = CtrlSeg::new(WqeOpcode::Wait, 0, 9, 7, crate::ring::DS_WAIT, CE_CQ_UPDATE, 0);
        let w = crate::wait::WaitSeg::new(0x42, 0x1_0000_0007);
        let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&w)]);
        let wr = WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()).unwrap();
        assert_eq!(
            wr.op,
            Operation::Wait {
                cqn: 0x42,
                max_index: 7
            }
        );
        for ds in [1, 3] {
            let c = CtrlSeg::new(WqeOpcode::Wait, 0, 9, 7, ds, CE_CQ_UPDATE, 0);
            let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&w)]);
            assert!(matches!(
                WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()),
                Err(WqeError::BadDs { .. })
            ));
        }
    }

    #[test]
    fn parses_sends_gathered_and_inline_with_their_immediate() {
        let c = CtrlSeg::new(WqeOpcode::SendImm, 0, 5, 3, 2, CE_CQ_UPDATE, 0xdead_beef);
        let d = DataSeg::new(64, 0x55, 0x2000);
        let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&d)]);
        let wr = WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()).unwrap();
        let sge = Sge {
            addr: 0x2000,
            length: 64,
            lkey: 0x55,
        };
        assert_eq!(
            wr.op,
            Operation::Send {
                payload: Payload::Gather(SgeList::one(sge))
            }
        );
        assert_eq!((wr.opcode, wr.imm), (WqeOpcode::SendImm, 0xdead_beef));
        // 40 bytes inline: header and payload take 3 units after the control segment.
        let c = CtrlSeg::new(WqeOpcode::Send, 0, 6, 3, crate::ring::ds_send_inline(40), 0, 0);
        let mut inl = [0u8; 48];
        inl[..4].copy_from_slice(&inline::byte_count(40).to_be_bytes());
        inl[4..44].copy_from_slice(&[9u8; 40]);
        let buf = wqe(&[bytemuck::bytes_of(&c), &inl]);
        let view = WqeView::new_checked(&buf[..]).unwrap();
        let wr = WorkRequest::parse(&view).unwrap();
        assert_eq!(
            wr.op,
            Operation::Send {
                payload: Payload::Inline { offset: 20, len: 40 }
            }
        );
        assert_eq!(&view.bytes()[20..60], &[9u8; 40]);
        // A SEND of nothing: the control segment alone.
        let c = CtrlSeg::new(WqeOpcode::Send, 0, 7, 3, crate::ring::ds_send_inline(0), 0, 0);
        let buf = wqe(&[bytemuck::bytes_of(&c)]);
        let wr = WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()).unwrap();
        assert_eq!(
            wr.op,
            Operation::Send {
                payload: Payload::Gather(SgeList::default())
            }
        );
        // An inline length the units do not hold.
        let c = CtrlSeg::new(WqeOpcode::Send, 0, 6, 3, 2, 0, 0);
        let buf = wqe(&[bytemuck::bytes_of(&c), &inl]);
        assert!(matches!(
            WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()),
            Err(WqeError::BadInline { len: 40, .. })
        ));
    }

    /// Random WQEs of every opcode and `ds` (the fuzz target's invariants, on a fixed seed so
    /// CI runs them): parsing never panics, and an inline payload lies inside the WQE.
    #[test]
    fn random_wqes_parse_or_fail_and_inline_payloads_stay_inside() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut buf = [0u8; MAX_WQE_SIZE];
        for _ in 0..20_000 {
            for b in buf.iter_mut() {
                *b = next() as u8;
            }
            let r = next();
            let opcode = [0x00u8, 0x08, 0x09, 0x0a, 0x0b, 0x10, 0x11, 0x12, 0x23][(r % 9) as usize];
            let ds = ((r >> 8) % 8) as u8;
            let c = CtrlSeg::new(WqeOpcode::from_raw(opcode), 0, 0, 1, ds, 0, 0);
            buf[..16].copy_from_slice(bytemuck::bytes_of(&c));
            // Half the time an inline header after the control (and remote address) segments.
            if r >> 16 & 1 == 1 {
                let at = if opcode == 0x0a || opcode == 0x0b { 16 } else { 32 };
                let len = (r >> 20) as u32 % 64;
                buf[at..at + 4].copy_from_slice(&inline::byte_count(len).to_be_bytes());
            }
            let take = 16 + (r >> 32) as usize % (MAX_WQE_SIZE - 16);
            let Ok(view) = WqeView::new_checked(&buf[..take]) else {
                continue;
            };
            if let Ok(wr) = WorkRequest::parse(&view) {
                if let Operation::Write {
                    payload: Payload::Inline { offset, len },
                    ..
                }
                | Operation::Send {
                    payload: Payload::Inline { offset, len },
                } = wr.op
                {
                    assert!(offset as usize + len as usize <= view.bytes().len(), "{wr:?}");
                }
            }
            if let Ok(list) = crate::recv::parse(&buf[..take % 65]) {
                assert!(list.as_slice().len() <= crate::recv::MAX_RECV_SGES);
            }
        }
    }

    #[test]
    fn rejects_malformed_wqes_with_the_right_syndrome() {
        let short = [0u8; 8];
        assert_eq!(
            WqeView::new_checked(&short[..]).unwrap_err(),
            WqeError::Truncated {
                needed: 16,
                available: 8
            }
        );
        let c = CtrlSeg::new(WqeOpcode::RdmaWrite, 0, 0, 1, 9, 0, 0);
        let buf = wqe(&[bytemuck::bytes_of(&c)]);
        let err = WorkRequest::parse(&WqeView::new_unchecked(&buf[..])).unwrap_err();
        assert_eq!(
            err,
            WqeError::Truncated {
                needed: 144,
                available: 128
            }
        );
        let c = CtrlSeg::new(WqeOpcode::RdmaWrite, 0, 0, 1, 7, 0, 0);
        let zeros = [0u8; 80];
        let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&RaddrSeg::new(0, 0)), &zeros]);
        let err = WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()).unwrap_err();
        assert_eq!(err, WqeError::TooManySges { count: 5 });
        assert_eq!(err.syndrome(), Syndrome::LocalLength);
        let c = CtrlSeg::new(WqeOpcode::AtomicFa, 0, 0, 1, 3, 0, 0);
        let buf = wqe(&[bytemuck::bytes_of(&c)]);
        assert!(matches!(
            WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()),
            Err(WqeError::BadDs { .. })
        ));
        let c = CtrlSeg::new(WqeOpcode::Tso, 0, 0, 1, 1, 0, 0);
        let buf = wqe(&[bytemuck::bytes_of(&c)]);
        let err = WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()).unwrap_err();
        assert_eq!(
            (err, err.syndrome()),
            (WqeError::UnsupportedOpcode(WqeOpcode::Tso), Syndrome::LocalQpOp)
        );
        let c = CtrlSeg::new(WqeOpcode::RdmaWrite, 0, 0, 1, 3, 0, 0);
        let mut inl = [0u8; 16];
        inl[..4].copy_from_slice(&inline::byte_count(200).to_be_bytes());
        let buf = wqe(&[bytemuck::bytes_of(&c), bytemuck::bytes_of(&RaddrSeg::new(0, 0)), &inl]);
        assert!(matches!(
            WorkRequest::parse(&WqeView::new_checked(&buf[..]).unwrap()),
            Err(WqeError::BadInline { len: 200, .. })
        ));
    }
}
