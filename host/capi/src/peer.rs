//! Peer mappings: another process's device memory on this host, mapped into this process's GPU
//! so that kernels load and store it directly (NVLink or PCIe P2P, or the same GPU), as
//! NVSHMEM's P2P transport and NCCL's LSA windows do. See `gdaki::peer`.
use gdaki::{PeerExport, PeerMapping, PEER_EXPORT_BYTES};

use crate::context::gdaki_gpu;
use crate::guard::{self, call, gdaki_status, handle, Failure};
use crate::region::gdaki_region;

/// Bytes of a `gdaki_peer_export`.
pub const GDAKI_PEER_EXPORT_BYTES: usize = 128;
const _: () = assert!(GDAKI_PEER_EXPORT_BYTES == PEER_EXPORT_BYTES);

/// A region of device memory as a fixed-size blob a process on the same host maps with
/// `gdaki_peer_map_open`: plain bytes, exchanged through any bootstrap. It opens the whole
/// allocation behind the region to whoever holds it (CUDA IPC): give it only to processes of
/// the same user.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gdaki_peer_export {
    /// The encoded export (magic, version, IPC handle, GPU, host, offset, length).
    pub bytes: [u8; GDAKI_PEER_EXPORT_BYTES],
}

/// A peer process's region mapped into this process's GPU. Destroy it before the peer destroys
/// the region.
pub struct gdaki_peer_map(guard::Tagged<PeerMapping>);
handle!(gdaki_peer_map(PeerMapping), b"gdakiPM\0", "peer map");

/// Exports `region` (device memory of `gpu`) for processes on this host into `*out`. Host
/// memory, pinned host memory included, and a `gpu` other than the region's are
/// `GDAKI_STATUS_UNSUPPORTED`.
///
/// # Safety
/// `region`, `gpu` are NULL or handles of their types; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_region_export_peer(
    region: *const gdaki_region,
    gpu: *const gdaki_gpu,
    out: *mut gdaki_peer_export,
) -> gdaki_status {
    call("gdaki_region_export_peer", || {
        // SAFETY: the caller's contract.
        let (r, g, out) = unsafe {
            (
                guard::borrow(region, "region")?,
                guard::borrow(gpu, "gpu")?,
                guard::out(out, "out")?,
            )
        };
        out.write(gdaki_peer_export {
            bytes: PeerExport::of(r, g)?.to_bytes(),
        });
        Ok(())
    })
}

/// Maps a peer process's `export` into `gpu` (into `*map`). Refused with
/// `GDAKI_STATUS_UNSUPPORTED` and the reason where kernels on `gpu` cannot reach it: memory of
/// another host, of this process (use the region's own address), of a GPU without a P2P path
/// from `gpu`. Bytes that are no export are `GDAKI_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `gpu` is NULL or a GPU handle; `export` is NULL or readable; `map` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_peer_map_open(
    gpu: *const gdaki_gpu,
    export: *const gdaki_peer_export,
    map: *mut *mut gdaki_peer_map,
) -> gdaki_status {
    call("gdaki_peer_map_open", || {
        // SAFETY: the caller's contract.
        let (g, e, out) = unsafe {
            (
                guard::borrow(gpu, "gpu")?,
                guard::input(export, "export")?,
                guard::out(map, "map")?,
            )
        };
        let export = PeerExport::from_bytes(&e.bytes).map_err(|e| Failure::invalid(e.to_string()))?;
        let mapping = PeerMapping::open(g, &export)?;
        out.write(guard::into_handle(mapping));
        Ok(())
    })
}

/// Where kernels on the map's GPU reach the peer's region (`*addr`, a device address) and its
/// length (`*len`); either may be NULL.
///
/// # Safety
/// `map` is NULL or a peer map handle; `addr` and `len` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_peer_map_addr(
    map: *const gdaki_peer_map,
    addr: *mut u64,
    len: *mut u64,
) -> gdaki_status {
    call("gdaki_peer_map_addr", || {
        // SAFETY: the caller's contract.
        let m = unsafe { guard::borrow(map, "map") }?;
        if !addr.is_null() {
            // SAFETY: the caller's contract.
            unsafe { guard::out(addr, "addr") }?.write(m.addr());
        }
        if !len.is_null() {
            // SAFETY: the caller's contract.
            unsafe { guard::out(len, "len") }?.write(m.len());
        }
        Ok(())
    })
}

/// Unmaps a peer's region (NULL: nothing). Kernels that use its address must have finished.
///
/// # Safety
/// `map` is NULL or a peer map handle with no call on it in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_peer_map_destroy(map: *mut gdaki_peer_map) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_peer_map_destroy", || unsafe { guard::destroy(map, "map") })
}
