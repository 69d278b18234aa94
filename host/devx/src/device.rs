//! The device boundary: what every DevX device answers ([`Device`]), and the objects crossing it.
use std::net::SocketAddr;
use std::sync::Arc;

use gdaki_layout::prm::command::{AddressPath, AtomicCaps, GeneralCaps, GeneralCaps2, RoceCaps};
use gdaki_layout::prm::CmdError;

use crate::access::Access;
use crate::qp::Endpoint;

/// What kind of memory a registration covers: it decides how a device reaches it.
#[derive(Clone, Debug)]
pub enum MemoryKind {
    /// Host memory at CPU addresses; `gpu_mapped`: also mapped into the GPUs at the same
    /// addresses (page-locked).
    Host {
        /// Mapped into the GPUs.
        gpu_mapped: bool,
    },
    /// Device memory of a GPU: a NIC reaches it through a dma-buf export, the soft device
    /// through that GPU's copier.
    Gpu(gdaki_cuda::Gpu),
}

/// Memory registered with a device (a umem or a memory region), with what keeps it allocated:
/// the device may hold on to `keep` for as long as it may access the memory. Made only by
/// [`Memory::new`], whose caller vouches for the range: a device reads and writes it.
#[derive(Clone)]
pub struct Memory {
    addr: u64,
    len: u64,
    kind: MemoryKind,
    keep: Option<Arc<dyn Send + Sync>>,
}

impl Memory {
    /// `len` bytes at `addr`, of `kind`, kept allocated by `keep`.
    ///
    /// # Safety
    /// `addr..addr + len` is memory of `kind` that the caller owns and that stays allocated
    /// while a device may access it: for as long as `keep` lives, or (with `keep` `None`) until
    /// the registration made of it is undone.
    pub unsafe fn new(addr: u64, len: u64, kind: MemoryKind, keep: Option<Arc<dyn Send + Sync>>) -> Memory {
        Memory { addr, len, kind, keep }
    }

    /// First byte (a CPU address for host memory, a GPU address for device memory).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// It has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What it is.
    pub fn kind(&self) -> &MemoryKind {
        &self.kind
    }

    /// What keeps it allocated (none: the registration's owner guarantees it).
    pub fn keep(&self) -> Option<&Arc<dyn Send + Sync>> {
        self.keep.as_ref()
    }
}

/// A memory region as a device registered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mr {
    /// The device's handle for deregistration.
    pub handle: u64,
    /// Local key (WQE data segments).
    pub lkey: u32,
    /// Remote key (what peers name in RDMA requests).
    pub rkey: u32,
}

/// A UAR page: the doorbell page queues are rung through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uar {
    /// Its index, as `uar_page` in CQ and QP contexts.
    pub page: u32,
    /// The page's CPU mapping (page-aligned: what a GPU maps).
    pub base: u64,
    /// Where in the page doorbells are written (a ConnectX's register sits past the start).
    pub reg_offset: u64,
    /// Where in the page the doorbells of QPs without a doorbell record are written (a
    /// ConnectX's "DBR-less" register, [`gdaki_layout::doorbell::UAR_DBR_LESS_OFFSET`]).
    pub dbr_less_offset: u64,
    /// Size of the mapping in bytes.
    pub size: usize,
    /// The page is device registers (a NIC's BAR), which a GPU maps as IO memory; else
    /// ordinary host memory (the soft device's).
    pub io: bool,
}

impl Uar {
    /// The doorbell register's CPU address.
    pub fn reg_addr(&self) -> u64 {
        self.base + self.reg_offset
    }
}

/// A device object (CQ or QP) as the device tracks it: its handle for modify / query /
/// destroy, and its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Object {
    /// The device's handle.
    pub handle: u64,
    /// CQN or QPN.
    pub number: u32,
}

/// What a device call can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The device ran the command and refused it.
    #[error("{error}{}", .detail.as_ref().map(|d| format!(" ({d})")).unwrap_or_default())]
    Command {
        /// Status and syndrome.
        error: CmdError,
        /// What the device said beyond its syndrome (the soft device names the reason).
        detail: Option<String>,
    },
    /// A call around the commands failed (umem, UAR, PD, EQ).
    #[error("{what}: {why}")]
    Call {
        /// Which call.
        what: &'static str,
        /// Why.
        why: String,
    },
}

/// The narrow boundary every DevX provider call goes through. Commands take whole input
/// mailboxes and fill whole output mailboxes; a device reports a refused command through the
/// output's status and syndrome (and may say more in [`DeviceError::Command`]'s detail).
pub trait Device: Send + Sync {
    /// A general command (`QUERY_HCA_CAP`).
    fn general_cmd(&self, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError>;
    /// A new protection domain's number.
    fn alloc_pd(&self) -> Result<u32, DeviceError>;
    /// Gives a protection domain back (refused while a region or QP uses it).
    fn dealloc_pd(&self, pd: u32) -> Result<(), DeviceError>;
    /// A UAR page.
    fn alloc_uar(&self) -> Result<Uar, DeviceError>;
    /// Gives a UAR page back.
    fn free_uar(&self, uar: &Uar);
    /// The event queue CQs report to.
    fn query_eqn(&self) -> Result<u32, DeviceError>;
    /// Registers memory as a umem (rings and doorbell records); returns its id.
    fn umem_reg(&self, mem: &Memory) -> Result<u32, DeviceError>;
    /// Deregisters a umem (refused while an object uses it).
    fn umem_dereg(&self, id: u32) -> Result<(), DeviceError>;
    /// Runs a create command; returns the object's handle.
    fn obj_create(&self, input: &[u8], out: &mut [u8]) -> Result<u64, DeviceError>;
    /// Runs a modify command on an object.
    fn obj_modify(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError>;
    /// Runs a query command on an object.
    fn obj_query(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError>;
    /// Destroys an object (the device builds the destroy command from the create command).
    fn obj_destroy(&self, handle: u64) -> Result<(), DeviceError>;
    /// The port gdaki uses (port 1): its GID, LID, link layer and active MTU.
    fn query_port(&self) -> Result<Port, DeviceError>;
    /// Registers `mem` as a memory region of protection domain `pd` with `access`.
    fn reg_mr(&self, pd: u32, mem: &Memory, access: Access) -> Result<Mr, DeviceError>;
    /// Deregisters a memory region: once this returns, the device no longer touches it.
    fn dereg_mr(&self, mr: &Mr) -> Result<(), DeviceError>;
    /// The device's name (`mlx5_0`, `soft`).
    fn name(&self) -> String;
    /// Starts accepting connections from peers beyond this process on `bind` and returns the
    /// bound address, which endpoints then carry. Only the soft device needs this (its
    /// transport runs over TCP); a NIC's fabric carries requests itself (`None`).
    fn listen(&self, _bind: SocketAddr) -> Result<Option<SocketAddr>, DeviceError> {
        Ok(None)
    }
    /// The address [`listen`](Self::listen) bound, once it did.
    fn transport_addr(&self) -> Option<SocketAddr> {
        None
    }
    /// The transport secret a peer must present to connect to QP `qpn` (the soft device's
    /// transport; 0 where the fabric carries requests).
    fn transport_secret(&self, _qpn: u32) -> u64 {
        0
    }
    /// The address path to `peer` (RoCE: its MAC from the GID; the soft device also learns
    /// the transport address the endpoint carries).
    fn resolve(&self, peer: &Endpoint) -> Result<AddressPath, DeviceError>;
}

/// What a port is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// InfiniBand: peers are addressed by LID (and GID across subnets).
    InfiniBand,
    /// Ethernet (RoCE): peers are addressed by GID, and every packet carries a GRH.
    Ethernet,
}

/// The port gdaki sends from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Port {
    /// Port number (1-based).
    pub number: u8,
    /// The GID at index [`gid_index`](Self::gid_index).
    pub gid: [u8; 16],
    /// The GID table index gdaki uses.
    pub gid_index: u8,
    /// InfiniBand: the port's LID (0 on Ethernet).
    pub lid: u16,
    /// Link layer.
    pub link: LinkLayer,
    /// Active MTU in bytes (256..=4096).
    pub mtu: u32,
}

/// The capabilities gdaki reads at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// General capabilities.
    pub general: GeneralCaps,
    /// The second general capabilities (all off where the device has none).
    pub general2: GeneralCaps2,
    /// Atomic capabilities.
    pub atomic: AtomicCaps,
    /// RoCE capabilities, where the port is Ethernet.
    pub roce: Option<RoceCaps>,
}

impl Caps {
    /// `qpc.atomic_mode` for a new RC QP as the kernel chooses it: none where the device has no
    /// atomics at all (`cmd_hca_cap.atomic`), else from the atomic capabilities
    /// ([`AtomicCaps::qp_atomic_mode`]).
    pub fn qp_atomic_mode(&self) -> Option<u8> {
        self.general.atomic.then(|| self.atomic.qp_atomic_mode()).flatten()
    }

    /// `qpc.ts_format` for a new QP, as the kernel chooses it from the RoCE capability where
    /// the port is Ethernet, else the send queue's (`command::qp_ts_format`).
    pub fn qp_ts_format(&self) -> u8 {
        gdaki_layout::prm::command::qp_ts_format(self.roce.map_or(self.general.sq_ts_format, |r| r.qp_ts_format))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device without atomics (`cmd_hca_cap.atomic` 0) gets none, whatever its atomic
    /// capabilities say, as the kernel decides.
    #[test]
    fn no_atomics_without_the_general_atomic_bit() {
        let atomic = AtomicCaps {
            operations: AtomicCaps::CMP_SWAP | AtomicCaps::FETCH_ADD,
            size_qp: AtomicCaps::SIZE_8_BYTES,
            ..Default::default()
        };
        let with = |on: bool| Caps {
            general: GeneralCaps {
                atomic: on,
                ..Default::default()
            },
            general2: Default::default(),
            atomic,
            roce: None,
        };
        assert_eq!(with(true).qp_atomic_mode(), Some(1));
        assert_eq!(with(false).qp_atomic_mode(), None);
    }
}
