//! The requester: turns one parsed WQE into a request. It checks the local side first (lkeys,
//! bounds, the local-write right for READ and atomic destinations, the message size), gathers
//! the payload, hands the request to the peer's responder and lets the completer apply the
//! answer. Every failure is a syndrome, as a NIC reports it; nothing is written outside a
//! registered region.
use std::sync::Arc;

use gdaki_device::Remote as DevRemote;
use gdaki_layout::wqe::{Operation, Payload, Sge, WorkRequest, MAX_SGES};
use gdaki_layout::Syndrome;

use crate::memory::Access;
use crate::queue::{Peer, SoftQp};
use crate::soft::responder::{self, AtomicOp};
use crate::soft::{Hca, Region, RegionCache};

/// Buffers the engine thread reuses between WQEs.
#[derive(Default)]
pub(crate) struct Scratch {
    data: Vec<u8>,
    regions: RegionCache,
}

fn remote(r: gdaki_layout::wqe::Remote) -> DevRemote {
    DevRemote {
        addr: r.addr,
        rkey: r.rkey,
    }
}

/// Checked local buffers (at most a WQE's worth, without allocating).
struct Locals {
    items: [Option<(Sge, Arc<Region>)>; MAX_SGES],
}

impl Locals {
    fn iter(&self) -> impl Iterator<Item = &(Sge, Arc<Region>)> {
        self.items.iter().map_while(Option::as_ref)
    }
}

/// The local regions of `sges`, with the rights `need`; a bad key, range or right is a local
/// protection error.
fn locals(hca: &Hca, cache: &mut RegionCache, sges: &[Sge], need: Access) -> Result<Locals, Syndrome> {
    let mut out = Locals {
        items: Default::default(),
    };
    for (slot, s) in out.items.iter_mut().zip(sges) {
        let r = hca
            .region(cache, s.lkey, s.addr, s.length as u64, need)
            .ok_or(Syndrome::LocalProt)?;
        *slot = Some((*s, r.clone()));
    }
    Ok(out)
}

/// Where requests go: the peer HCA, resolved once per doorbell batch (or why requests cannot
/// go anywhere).
pub(crate) type Target = Result<Arc<Hca>, Syndrome>;

/// Resolves a QP's peer: its HCA and QP must still exist and the QP must accept requests.
pub(crate) fn resolve(peer: Option<&Peer>) -> Target {
    let p = peer.ok_or(Syndrome::LocalQpOp)?;
    let hca = p.hca.upgrade().ok_or(Syndrome::TransportRetryExc)?;
    responder::accepts(p.qp.upgrade().as_deref())?;
    Ok(hca)
}

/// Executes `wr` (whose bytes are `wqe`) for `qp`: bytes moved, or the syndrome.
pub(crate) fn execute(
    hca: &Hca,
    qp: &SoftQp,
    target: &Target,
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
    let target = || -> Result<&Hca, Syndrome> { target.as_ref().map(|h| &**h).map_err(|s| *s) };
    match wr.op {
        Operation::Nop => Ok(0),
        Operation::Write { remote: r, payload } => match payload {
            Payload::Inline { offset, len } => {
                let bytes = check_len(len as u64)?;
                let data = wqe
                    .get(offset as usize..(offset + len) as usize)
                    .ok_or(Syndrome::LocalLength)?;
                let peer_hca = target()?;
                responder::write(peer_hca, &mut scratch.regions, remote(r), data)?;
                Ok(bytes)
            }
            Payload::Gather(list) => {
                let bytes = check_len(list.total_len())?;
                let src = locals(hca, &mut scratch.regions, list.as_slice(), Access::empty())?;
                let peer_hca = target()?;
                match &src.items {
                    // One host buffer: hand it to the responder without a copy.
                    [Some((s, region)), None, ..] if region.dma.host_addressable() => {
                        // SAFETY: the range was checked against a live, host-addressable region;
                        // like DMA, concurrent writes by the application may be torn.
                        let data = unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
                        responder::write(peer_hca, &mut scratch.regions, remote(r), data)?;
                    }
                    _ => {
                        scratch.data.clear();
                        for (s, region) in src.iter() {
                            let at = scratch.data.len();
                            scratch.data.resize(at + s.length as usize, 0);
                            region.dma.read(s.addr, &mut scratch.data[at..]);
                        }
                        responder::write(peer_hca, &mut scratch.regions, remote(r), &scratch.data)?;
                    }
                }
                Ok(bytes)
            }
        },
        Operation::Read { remote: r, local } => {
            let bytes = check_len(local.total_len())?;
            let dst = locals(hca, &mut scratch.regions, local.as_slice(), Access::LOCAL_WRITE)?;
            let peer_hca = target()?;
            scratch.data.clear();
            scratch.data.resize(bytes as usize, 0);
            responder::read(peer_hca, &mut scratch.regions, remote(r), &mut scratch.data)?;
            // Completer side: scatter the response.
            let mut at = 0;
            for (s, region) in dst.iter() {
                region.dma.write(s.addr, &scratch.data[at..at + s.length as usize]);
                at += s.length as usize;
            }
            Ok(bytes)
        }
        Operation::FetchAdd { remote: r, add, result } => atomic(
            hca,
            &mut scratch.regions,
            target,
            remote(r),
            AtomicOp::FetchAdd(add),
            result,
        ),
        Operation::CompareSwap {
            remote: r,
            compare,
            swap,
            result,
        } => atomic(
            hca,
            &mut scratch.regions,
            target,
            remote(r),
            AtomicOp::CompareSwap { compare, swap },
            result,
        ),
    }
}

/// An atomic: the result buffer is checked first, and the fetched value lands there
/// big-endian, as mlx5 returns it.
fn atomic<'a>(
    hca: &Hca,
    cache: &mut RegionCache,
    target: impl FnOnce() -> Result<&'a Hca, Syndrome>,
    r: DevRemote,
    op: AtomicOp,
    result: Sge,
) -> Result<u32, Syndrome> {
    let dst = locals(hca, cache, std::slice::from_ref(&result), Access::LOCAL_WRITE)?;
    let peer_hca = target()?;
    let old = responder::atomic(peer_hca, cache, r, op)?;
    if let Some((_, region)) = &dst.items[0] {
        region.dma.write(result.addr, &old.to_be_bytes());
    }
    Ok(8)
}
