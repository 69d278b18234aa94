//! The requester: turns one parsed WQE into a request. It checks the local side first (lkeys,
//! bounds, the local-write right for READ and atomic destinations, the message size), gathers
//! the payload, hands the request to the peer's responder and lets the completer apply the
//! answer. Every failure is a syndrome, as a NIC reports it; nothing is written outside a
//! registered region.
use std::sync::Arc;

use gdaki_device::Remote as DevRemote;
use gdaki_layout::wqe::{Operation, Payload, Sge, WorkRequest};
use gdaki_layout::Syndrome;

use crate::memory::Access;
use crate::queue::{Peer, SoftQp};
use crate::soft::completer::Outcome;
use crate::soft::responder::{self, AtomicOp};
use crate::soft::{Hca, Region};

/// Buffers the engine thread reuses between WQEs.
#[derive(Default)]
pub(crate) struct Scratch {
    data: Vec<u8>,
}

fn remote(r: gdaki_layout::wqe::Remote) -> DevRemote {
    DevRemote {
        addr: r.addr,
        rkey: r.rkey,
    }
}

/// The local regions of `sges`, with the rights `need`; a bad key, range or right is a local
/// protection error.
fn locals(hca: &Hca, sges: &[Sge], need: Access) -> Result<Vec<(Sge, Arc<Region>)>, Syndrome> {
    sges.iter()
        .map(|s| {
            hca.region(s.lkey, s.addr, s.length as u64, need)
                .map(|r| (*s, r))
                .ok_or(Syndrome::LocalProt)
        })
        .collect()
}

/// Executes `wr` (whose bytes are `wqe`) for `qp`.
pub(crate) fn execute(
    hca: &Hca,
    qp: &SoftQp,
    peer: Option<&Peer>,
    wr: &WorkRequest,
    wqe: &[u8],
    scratch: &mut Scratch,
) -> Outcome {
    match run(hca, qp, peer, wr, wqe, scratch) {
        Ok(bytes) => Outcome::Success { bytes },
        Err(s) => Outcome::Error(s),
    }
}

fn run(
    hca: &Hca,
    qp: &SoftQp,
    peer: Option<&Peer>,
    wr: &WorkRequest,
    wqe: &[u8],
    scratch: &mut Scratch,
) -> Result<u32, Syndrome> {
    let check_len = |len: u64| {
        if len > qp.max_msg_size {
            Err(Syndrome::LocalLength)
        } else {
            Ok(len as u32)
        }
    };
    // The peer HCA, if it is still there: a vanished peer never answers.
    let target = || -> Result<(Arc<Hca>, u32), Syndrome> {
        let p = peer.ok_or(Syndrome::LocalQpOp)?;
        Ok((p.hca.upgrade().ok_or(Syndrome::TransportRetryExc)?, p.qpn))
    };
    match wr.op {
        Operation::Nop => Ok(0),
        Operation::Write { remote: r, payload } => match payload {
            Payload::Inline { offset, len } => {
                let bytes = check_len(len as u64)?;
                let data = wqe
                    .get(offset as usize..(offset + len) as usize)
                    .ok_or(Syndrome::LocalLength)?;
                let (peer_hca, qpn) = target()?;
                responder::write(&peer_hca, qpn, remote(r), data)?;
                Ok(bytes)
            }
            Payload::Gather(list) => {
                let bytes = check_len(list.total_len())?;
                let src = locals(hca, list.as_slice(), Access::empty())?;
                let (peer_hca, qpn) = target()?;
                match &src[..] {
                    // One host buffer: hand it to the responder without a copy.
                    [(s, region)] if region.dma.host_addressable() => {
                        // SAFETY: the range was checked against a live, host-addressable region;
                        // like DMA, concurrent writes by the application may be torn.
                        let data = unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
                        responder::write(&peer_hca, qpn, remote(r), data)?;
                    }
                    _ => {
                        scratch.data.clear();
                        for (s, region) in &src {
                            let at = scratch.data.len();
                            scratch.data.resize(at + s.length as usize, 0);
                            region.dma.read(s.addr, &mut scratch.data[at..]);
                        }
                        responder::write(&peer_hca, qpn, remote(r), &scratch.data)?;
                    }
                }
                Ok(bytes)
            }
        },
        Operation::Read { remote: r, local } => {
            let bytes = check_len(local.total_len())?;
            let dst = locals(hca, local.as_slice(), Access::LOCAL_WRITE)?;
            let (peer_hca, qpn) = target()?;
            scratch.data.clear();
            scratch.data.resize(bytes as usize, 0);
            responder::read(&peer_hca, qpn, remote(r), &mut scratch.data)?;
            // Completer side: scatter the response.
            let mut at = 0;
            for (s, region) in &dst {
                region.dma.write(s.addr, &scratch.data[at..at + s.length as usize]);
                at += s.length as usize;
            }
            Ok(bytes)
        }
        Operation::FetchAdd { remote: r, add, result } => {
            atomic(hca, target, remote(r), AtomicOp::FetchAdd(add), result)
        }
        Operation::CompareSwap {
            remote: r,
            compare,
            swap,
            result,
        } => atomic(hca, target, remote(r), AtomicOp::CompareSwap { compare, swap }, result),
    }
}

/// An atomic: the result buffer is checked first, and the fetched value lands there
/// big-endian, as mlx5 returns it.
fn atomic(
    hca: &Hca,
    target: impl FnOnce() -> Result<(Arc<Hca>, u32), Syndrome>,
    r: DevRemote,
    op: AtomicOp,
    result: Sge,
) -> Result<u32, Syndrome> {
    let dst = locals(hca, std::slice::from_ref(&result), Access::LOCAL_WRITE)?;
    let (peer_hca, qpn) = target()?;
    let old = responder::atomic(&peer_hca, qpn, r, op)?;
    dst[0].1.dma.write(result.addr, &old.to_be_bytes());
    Ok(8)
}
