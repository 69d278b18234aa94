//! The responder: executes a request against the target HCA's memory, checking everything a
//! NIC checks (the target QP's state, the rkey, bounds, access rights, atomic alignment) and
//! answering with a NAK syndrome instead of touching memory when a check fails.
use gdaki_device::Remote;
use gdaki_layout::Syndrome;
use tracing::warn;

use std::sync::Arc;

use crate::copier::{Copier, Way};
use crate::dma::shared_copier;
use crate::dma::Dma;
use crate::objects::SoftQp;
use crate::{Hca, RegionCache};
use gdaki_devx::Access;
use gdaki_devx::QpState;

/// An 8-byte atomic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Add.
    FetchAdd(u64),
    /// Compare and swap.
    CompareSwap {
        /// Expected.
        compare: u64,
        /// New.
        swap: u64,
    },
}

/// Whether target QP `qpn` accepts requests: it must exist and be in RTR or RTS. A target
/// that is gone or in error does not answer: the requester's transport retries run out.
/// Checked once per batch of requests.
pub(crate) fn accepts(target: Option<&SoftQp>) -> Result<(), Syndrome> {
    match target.map(|q| q.state()) {
        Some(QpState::Rtr | QpState::Rts) => Ok(()),
        _ => Err(Syndrome::TransportRetryExc),
    }
}

/// A request broke the responder's rules (an rkey, a right or a bound it does not have, a
/// misaligned atomic): as RC does (rxe's class A and C errors), the responder QP goes to error
/// too, so a peer cannot probe keys and addresses on a live QP. Said at warn, once per QP
/// (it is in error afterwards).
pub(crate) fn violated(qp: &SoftQp, s: Syndrome) {
    if !matches!(s, Syndrome::RemoteAccess | Syndrome::RemoteInvalReq) {
        return;
    }
    if qp.state() != QpState::Error {
        warn!(
            qpn = format_args!("{:#x}", qp.qpn),
            syndrome = ?s,
            "a request from the peer broke the access rules: the queue pair goes to error"
        );
    }
    qp.fail(s);
}

/// RDMA WRITE of `data` at `remote`.
pub(crate) fn write(hca: &Hca, cache: &mut RegionCache, pd: u32, remote: Remote, data: &[u8]) -> Result<(), Syndrome> {
    if data.is_empty() {
        return Ok(()); // a zero-length WRITE touches no memory, so its rkey is not checked
    }
    let r = hca
        .region(
            cache,
            pd,
            remote.rkey,
            remote.addr,
            data.len() as u64,
            Access::REMOTE_WRITE,
        )
        .ok_or(Syndrome::RemoteAccess)?;
    r.dma.write(remote.addr, data).map_err(|_| Syndrome::RemoteOp)
}

/// An RDMA WRITE into (`Way::Write`) or READ from (`Way::Read`) the region at `remote`, of
/// `len` bytes at `other` in memory that `other_dma` moves (a requester's region in this
/// process, or a peer process's allocation mapped here), handed to a GPU copier (one step) when
/// one side is device memory and the other is reachable by the same GPU: the copier and the
/// copy's sequence number, not waited for. `None`: not such a pair, or nothing to move (the
/// caller moves the bytes through host memory).
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_by_gpu(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    remote: Remote,
    way: Way,
    other_dma: &dyn Dma,
    other: u64,
    len: u64,
) -> Option<Result<(Arc<Copier>, u64), Syndrome>> {
    if len == 0 {
        return None;
    }
    let access = match way {
        Way::Write => Access::REMOTE_WRITE,
        Way::Read => Access::REMOTE_READ,
    };
    let region = match hca.region(cache, pd, remote.rkey, remote.addr, len, access) {
        Some(r) => r.clone(),
        None => return Some(Err(Syndrome::RemoteAccess)),
    };
    let copier = shared_copier(other_dma, &*region.dma)?.clone();
    let (dst, src) = match way {
        Way::Write => (remote.addr, other),
        Way::Read => (other, remote.addr),
    };
    // SAFETY: the region's side lies in a live registered region this copier's GPU reaches
    // (checked above, with the right the copy needs), the other side in memory the caller
    // keeps mapped until the copy is done (a live registered region, or a peer's allocation
    // whose mapping outlives its pending copies); overlap and concurrent access are the
    // application's, as with a NIC's DMA.
    Some(match unsafe { copier.submit_copy(dst, src, len) } {
        Ok(seq) => Ok((copier, seq)),
        Err(_) => Err(Syndrome::RemoteOp),
    })
}

/// RDMA READ of `out.len()` bytes at `remote` into `out`.
pub(crate) fn read(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    remote: Remote,
    out: &mut [u8],
) -> Result<(), Syndrome> {
    if out.is_empty() {
        return Ok(());
    }
    let r = hca
        .region(
            cache,
            pd,
            remote.rkey,
            remote.addr,
            out.len() as u64,
            Access::REMOTE_READ,
        )
        .ok_or(Syndrome::RemoteAccess)?;
    r.dma.read(remote.addr, out).map_err(|_| Syndrome::RemoteOp)
}

/// An 8-byte atomic at `remote` (native byte order in memory); returns the old value.
/// Serialised per HCA, which is IB's atomicity guarantee.
pub(crate) fn atomic(
    hca: &Hca,
    cache: &mut RegionCache,
    pd: u32,
    remote: Remote,
    op: AtomicOp,
) -> Result<u64, Syndrome> {
    if remote.addr % 8 != 0 {
        return Err(Syndrome::RemoteInvalReq);
    }
    let r = hca
        .region(cache, pd, remote.rkey, remote.addr, 8, Access::REMOTE_ATOMIC)
        .ok_or(Syndrome::RemoteAccess)?;
    let _serial = gdaki_devx::util::lock(&hca.atomics);
    match op {
        AtomicOp::FetchAdd(add) => r.dma.fetch_add(remote.addr, add),
        AtomicOp::CompareSwap { compare, swap } => r.dma.compare_swap(remote.addr, compare, swap),
    }
    .map_err(|_| Syndrome::RemoteOp)
}
