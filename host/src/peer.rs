//! Device memory of another process on this host, mapped into this process's GPU for kernels to
//! load from and store to directly (NVLink or PCIe P2P, or the same GPU): what NVSHMEM's P2P
//! transport and NCCL's LSA windows are built on, and what a library above queue pairs uses for
//! the peers it can reach without an HCA.
//!
//! The owner of a device-memory region makes a [`PeerExport`] (a fixed-size blob: send it
//! through any bootstrap); a process on the same host opens it on its GPU as a [`PeerMapping`],
//! which gives the device address where that GPU's kernels reach the region. Opening is
//! refused, with the reason, where it cannot work: another host, this very process (use the
//! region's own address), or a GPU that cannot reach the region's GPU over P2P.
//!
//! The mapping is CUDA IPC ([`gdaki_cuda::IpcImport`]): an export opens the whole allocation
//! behind the region to whoever holds the blob, so hand it only to processes trusted as much as
//! the owner (the same user). Close every mapping before the owner frees the region: the
//! contents of an allocation freed while mapped are undefined.
use gdaki_cuda::{Gpu, GpuUuid, IpcExport, IpcImport, IPC_HANDLE_BYTES};

use crate::error::{Error, Result};
use crate::memory::MemoryRegion;

/// Bytes of a [`PeerExport`] as [`PeerExport::to_bytes`] writes it.
pub const PEER_EXPORT_BYTES: usize = 128;

const MAGIC: [u8; 4] = *b"GPX1";
const VERSION: u32 = 1;

/// What a process on the same host needs to map a device-memory region: the allocation's IPC
/// handle, the GPU and host it lives on, and where the region lies in the allocation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PeerExport {
    handle: [u8; IPC_HANDLE_BYTES],
    gpu: GpuUuid,
    host: [u8; 16],
    pid: u32,
    /// The region's first byte, from the allocation's start.
    offset: u64,
    len: u64,
}

impl std::fmt::Debug for PeerExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerExport")
            .field("pid", &self.pid)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// This host's identity for the life of its kernel (`/proc/sys/kernel/random/boot_id`), shared
/// by every process on it; `None` where it cannot be read.
fn host_id() -> Option<[u8; 16]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let hex: String = text.trim().chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    (id != [0; 16]).then_some(id)
}

fn unsupported(why: String) -> Error {
    Error::Unsupported {
        what: "mapping a peer's device memory",
        why,
    }
}

fn malformed(why: &str) -> Error {
    Error::Unsupported {
        what: "this peer export",
        why: format!("{why}: not bytes PeerExport::to_bytes wrote"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl PeerExport {
    /// Exports `region`, device memory of `gpu` (the GPU it was allocated or registered on).
    /// Refused for host memory (pinned host memory included: map it with the host's own shared
    /// memory instead), for a `gpu` other than the region's, and for memory the driver cannot
    /// export (made with `cuMemCreate`).
    pub fn of(region: &MemoryRegion, gpu: &Gpu) -> Result<PeerExport> {
        if !region.is_device_memory() {
            return Err(unsupported(format!(
                "region {:#x} is host memory; only GPU device memory can be exported to a peer",
                region.rkey()
            )));
        }
        if region.gpu_ordinal() != Some(gpu.ordinal()) {
            return Err(unsupported(format!(
                "region {:#x} is memory of GPU {:?}, not of GPU {}",
                region.rkey(),
                region.gpu_ordinal(),
                gpu.ordinal()
            )));
        }
        let host = host_id().ok_or_else(|| {
            unsupported("this host's identity (/proc/sys/kernel/random/boot_id) cannot be read".into())
        })?;
        let ipc = IpcExport::of(gpu.context(), region.addr(), region.len())?;
        Ok(PeerExport {
            handle: ipc.handle,
            gpu: ipc.gpu,
            host,
            pid: std::process::id(),
            offset: region.addr() - ipc.base,
            len: region.len(),
        })
    }

    /// The region's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The UUID of the GPU whose memory it is.
    pub fn gpu(&self) -> GpuUuid {
        self.gpu
    }

    /// The blob to send to peers: the same layout on every host (little-endian).
    pub fn to_bytes(&self) -> [u8; PEER_EXPORT_BYTES] {
        let mut b = [0u8; PEER_EXPORT_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&VERSION.to_le_bytes());
        b[8..72].copy_from_slice(&self.handle);
        b[72..88].copy_from_slice(&self.gpu);
        b[88..104].copy_from_slice(&self.host);
        b[104..108].copy_from_slice(&self.pid.to_le_bytes());
        b[112..120].copy_from_slice(&self.offset.to_le_bytes());
        b[120..128].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Reads a blob [`to_bytes`](Self::to_bytes) wrote; anything else is refused.
    pub fn from_bytes(b: &[u8]) -> Result<PeerExport> {
        let b: &[u8; PEER_EXPORT_BYTES] = b
            .try_into()
            .map_err(|_| malformed(&format!("{} bytes, not {PEER_EXPORT_BYTES}", b.len())))?;
        let word = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let quad = |at: usize| {
            let mut q = [0u8; 8];
            q.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(q)
        };
        if b[0..4] != MAGIC {
            return Err(malformed("wrong magic"));
        }
        if word(4) != VERSION {
            return Err(malformed(&format!(
                "version {} (this library reads {VERSION})",
                word(4)
            )));
        }
        if word(108) != 0 {
            return Err(malformed("reserved bytes are not zero"));
        }
        let (offset, len) = (quad(112), quad(120));
        if offset.checked_add(len).is_none() {
            return Err(malformed("offset and length overflow"));
        }
        let mut e = PeerExport {
            handle: [0; IPC_HANDLE_BYTES],
            gpu: [0; 16],
            host: [0; 16],
            pid: word(104),
            offset,
            len,
        };
        e.handle.copy_from_slice(&b[8..72]);
        e.gpu.copy_from_slice(&b[72..88]);
        e.host.copy_from_slice(&b[88..104]);
        Ok(e)
    }

    /// Why this process's GPU `gpu` cannot map it (`reaches`: whether that GPU reaches the
    /// export's GPU over P2P), or `None` where it can.
    fn refusal(&self, host: Option<[u8; 16]>, pid: u32, gpu: usize, reaches: bool) -> Option<String> {
        if host != Some(self.host) {
            return Some(format!(
                "the memory is on another host (boot id {}), CUDA IPC works within one",
                hex(&self.host)
            ));
        }
        if pid == self.pid {
            return Some("the memory is this process's own: use the region's address".into());
        }
        if !reaches {
            return Some(format!(
                "GPU {gpu} does not reach the memory's GPU {} over P2P (cuDeviceCanAccessPeer), \
                 or that GPU is not visible to this process",
                hex(&self.gpu)
            ));
        }
        None
    }
}

/// A peer process's device memory mapped into this process's GPU: kernels on that GPU load and
/// store at [`addr`](Self::addr). Unmapped on drop; the peer's region must outlive it.
#[derive(Debug)]
pub struct PeerMapping {
    import: IpcImport,
    offset: u64,
    len: u64,
}

impl PeerMapping {
    /// Maps `export` into `gpu`: refused for memory of another host, of this process, or of a
    /// GPU `gpu` cannot reach over P2P, and for an export whose range the driver's record of
    /// the allocation does not hold.
    pub fn open(gpu: &Gpu, export: &PeerExport) -> Result<PeerMapping> {
        let reaches = gdaki_cuda::gpu_reaches(gpu.context(), &export.gpu);
        if let Some(why) = export.refusal(host_id(), std::process::id(), gpu.ordinal(), reaches) {
            return Err(unsupported(why));
        }
        // Kernels are to load and store it: peer access on now, not lazily at a later launch
        // (which would wait for the soft HCA's resident copier).
        gdaki_cuda::enable_peer_access(gpu.context(), &export.gpu)?;
        let import = IpcImport::open(gpu.context(), &export.handle)?;
        if export.offset.saturating_add(export.len) > import.size() {
            return Err(malformed(&format!(
                "{} bytes at offset {} run past the {}-byte allocation it names",
                export.len,
                export.offset,
                import.size()
            )));
        }
        Ok(PeerMapping {
            import,
            offset: export.offset,
            len: export.len,
        })
    }

    /// Where this GPU's kernels reach the peer's region.
    pub fn addr(&self) -> u64 {
        self.import.ptr() + self.offset
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PeerExport {
        PeerExport {
            handle: [7; IPC_HANDLE_BYTES],
            gpu: [1; 16],
            host: host_id().unwrap_or([9; 16]),
            pid: 4242,
            offset: 4096,
            len: 1 << 20,
        }
    }

    #[test]
    fn an_export_goes_through_its_bytes_unchanged() {
        let e = sample();
        assert_eq!(PeerExport::from_bytes(&e.to_bytes()).unwrap(), e);
    }

    #[test]
    fn bytes_that_are_no_export_are_refused_with_the_reason() {
        let good = sample().to_bytes();
        let cases: [(usize, u8, &str); 4] = [
            (0, b'X', "magic"),
            (4, 2, "version 2"),
            (108, 1, "reserved"),
            (127, 0xff, "overflow"),
        ];
        for (at, value, why) in cases {
            let mut b = good;
            b[at] = value;
            if at == 127 {
                b[112..120].copy_from_slice(&u64::MAX.to_le_bytes());
            }
            let e = PeerExport::from_bytes(&b).unwrap_err().to_string();
            assert!(e.contains(why), "byte {at}: {e}");
        }
        let e = PeerExport::from_bytes(&good[..100]).unwrap_err().to_string();
        assert!(e.contains("100 bytes, not 128"), "{e}");
    }

    #[test]
    fn another_host_this_process_and_an_unreachable_gpu_are_refused() {
        let e = sample();
        let here = Some(e.host);
        assert_eq!(e.refusal(here, 1, 0, true), None);
        let other = e.refusal(Some([3; 16]), 1, 0, true).unwrap();
        assert!(other.contains("another host"), "{other}");
        assert!(e.refusal(None, 1, 0, true).unwrap().contains("another host"));
        assert!(e.refusal(here, 4242, 0, true).unwrap().contains("this process's own"));
        assert!(e.refusal(here, 1, 0, false).unwrap().contains("over P2P"));
    }
}
