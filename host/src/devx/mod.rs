//! The DevX provider: gdaki builds every queue the way a ConnectX wants it, with PRM command
//! mailboxes ([`gdaki_layout::prm`]) sent through one narrow boundary, [`Device`]. Two devices
//! sit behind it: a real mlx5 NIC (libmlx5's `mlx5dv_devx_*`, loaded at run time) and the soft
//! device, whose firmware model ([`crate::soft::firmware`]) decodes the same mailboxes.
//!
//! [`Devx`] runs commands on a device: it checks every answer's status, and logs each command
//! (name, key fields, status, syndrome) at debug level under the `gdaki::devx` target, so a
//! user with a NIC can send the exact sequence when something fails
//! (`RUST_LOG=gdaki::devx=debug`).
use std::net::SocketAddr;
use std::sync::Arc;

use gdaki_layout::prm::command::{self, AddressPath, AtomicCaps, CapType, GeneralCaps};
use gdaki_layout::prm::{CmdError, Opcode};

use crate::memory::{Access, HostBuffer};
use crate::queue::Endpoint;

/// What kind of memory a registration covers: it decides how a device reaches it.
#[derive(Clone, Debug)]
pub(crate) enum MemoryKind {
    /// Host memory at CPU addresses; `gpu_mapped`: also mapped into the GPUs at the same
    /// addresses (page-locked).
    Host {
        /// Mapped into the GPUs.
        gpu_mapped: bool,
    },
    /// Device memory of a GPU: a NIC reaches it through a dma-buf export, the soft device
    /// through that GPU's copier.
    Gpu(crate::cuda::Gpu),
}

/// Memory registered with a device (a umem or a memory region), with what keeps it allocated:
/// the device may hold on to `keep` for as long as it may access the memory.
#[derive(Clone)]
pub(crate) struct Memory {
    /// First byte (a CPU address for host memory, a GPU address for device memory).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// What it is.
    pub kind: MemoryKind,
    /// Keeps `addr..addr + len` allocated (none: the caller guarantees it).
    pub keep: Option<Arc<dyn Send + Sync>>,
}

/// A memory region as a device registered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mr {
    /// The device's handle for deregistration.
    pub handle: u64,
    /// Local key (WQE data segments).
    pub lkey: u32,
    /// Remote key (what peers name in RDMA requests).
    pub rkey: u32,
}

/// A UAR page: the doorbell page queues are rung through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Uar {
    /// Its index, as `uar_page` in CQ and QP contexts.
    pub page: u32,
    /// The page's CPU mapping (page-aligned: what a GPU maps).
    pub base: u64,
    /// Where in the page doorbells are written (a ConnectX's register sits past the start).
    pub reg_offset: u64,
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
pub(crate) struct Object {
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
pub(crate) trait Device: Send + Sync {
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
pub(crate) enum LinkLayer {
    /// InfiniBand: peers are addressed by LID (and GID across subnets).
    InfiniBand,
    /// Ethernet (RoCE): peers are addressed by GID, and every packet carries a GRH.
    Ethernet,
}

/// The port gdaki sends from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Port {
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
pub(crate) struct Caps {
    /// General capabilities.
    pub general: GeneralCaps,
    /// Atomic capabilities.
    pub atomic: AtomicCaps,
}

/// Runs DevX commands on a device, checking and logging each.
#[derive(Clone)]
pub(crate) struct Devx {
    device: Arc<dyn Device>,
}

impl Devx {
    /// Commands on `device`.
    pub fn new(device: Arc<dyn Device>) -> Devx {
        Devx { device }
    }

    /// The device.
    pub fn device(&self) -> &dyn Device {
        &*self.device
    }

    fn checked(op: Opcode, input: &[u8], out: &[u8], ran: Result<(), DeviceError>) -> Result<(), DeviceError> {
        let checked =
            ran.and_then(|()| command::check(op, out).map_err(|error| DeviceError::Command { error, detail: None }));
        match &checked {
            Ok(()) => tracing::debug!(
                target: "gdaki::devx",
                command = %op,
                input = %Fields(input),
                object = format_args!("{:#x}", command::object(out)),
                "ok"
            ),
            Err(e) => tracing::debug!(target: "gdaki::devx", command = %op, input = %Fields(input), "{e}"),
        }
        checked
    }

    /// `QUERY_HCA_CAP` of the general and atomic capabilities.
    pub fn query_caps(&self) -> Result<Caps, DeviceError> {
        let mut caps = Vec::with_capacity(2);
        for kind in [CapType::General, CapType::Atomic] {
            let input = command::query_hca_cap(kind);
            let mut out = vec![0u8; command::QUERY_HCA_CAP_OUT_BYTES];
            let ran = self.device.general_cmd(&input, &mut out);
            Self::checked(Opcode::QueryHcaCap, &input, &out, ran)?;
            caps.push(out);
        }
        Ok(Caps {
            general: GeneralCaps::decode(&caps[0]),
            atomic: AtomicCaps::decode(&caps[1]),
        })
    }

    /// Creates an object from `input`.
    pub fn create(&self, input: &[u8]) -> Result<Object, DeviceError> {
        let op = command::opcode(input);
        let mut out = [0u8; command::OUT_HEADER_BYTES];
        let handle = self.device.obj_create(input, &mut out);
        let ran = handle.as_ref().map(|_| ()).map_err(Clone::clone);
        Self::checked(op, input, &out, ran)?;
        Ok(Object {
            handle: handle?,
            number: command::object(&out),
        })
    }

    /// Modifies `obj` with `input`.
    pub fn modify(&self, obj: &Object, input: &[u8]) -> Result<(), DeviceError> {
        let op = command::opcode(input);
        let mut out = [0u8; command::OUT_HEADER_BYTES];
        let ran = self.device.obj_modify(obj.handle, input, &mut out);
        Self::checked(op, input, &out, ran)
    }

    /// Queries `obj` with `input` into an output of `out_len` bytes.
    pub fn query(&self, obj: &Object, input: &[u8], out_len: usize) -> Result<Vec<u8>, DeviceError> {
        let op = command::opcode(input);
        let mut out = vec![0u8; out_len];
        let ran = self.device.obj_query(obj.handle, input, &mut out);
        Self::checked(op, input, &out, ran)?;
        Ok(out)
    }

    /// Destroys `obj`.
    pub fn destroy(&self, obj: &Object) -> Result<(), DeviceError> {
        let done = self.device.obj_destroy(obj.handle);
        tracing::debug!(target: "gdaki::devx", object = format_args!("{:#x}", obj.number), "destroy: {done:?}");
        done
    }
}

/// What a context opens on its device once: the capabilities, the event queue, the port, and
/// the UAR page its CQs name (gdaki never arms a CQ, so one page serves them all). Shared by
/// the contexts of every protection domain on it.
pub(crate) struct Opened {
    /// The command runner.
    pub devx: Devx,
    /// The capabilities read at open.
    pub caps: Caps,
    /// The event queue CQs report to.
    pub eqn: u32,
    /// The port.
    pub port: Port,
    /// The UAR page CQs name.
    pub cq_uar: OwnedUar,
}

/// One thing gdaki depends on in a device, and what the device has ([`Context::device_report`](crate::Context::device_report)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Requirement {
    /// What is needed.
    pub what: &'static str,
    /// What gdaki needs.
    pub needed: String,
    /// What the device reports.
    pub found: String,
    /// Whether the device meets it.
    pub met: bool,
    /// What does not work when it is not met (empty when gdaki cannot run at all).
    pub without: &'static str,
}

/// A device as gdaki uses it: what `doctor` lists, like `ibv_devinfo`, with a verdict per
/// requirement.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceReport {
    /// The device (`mlx5_0`, `soft`).
    pub name: String,
    /// The port gdaki sends from.
    pub port: u8,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: &'static str,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// InfiniBand LID (0 on Ethernet).
    pub lid: u16,
    /// The GID table index in use.
    pub gid_index: u8,
    /// That GID, as an IPv6 address.
    pub gid: String,
    /// Every requirement, with its verdict.
    pub requirements: Vec<Requirement>,
}

impl DeviceReport {
    /// Whether every requirement without which gdaki cannot run is met.
    pub fn usable(&self) -> bool {
        self.requirements.iter().all(|r| r.met || !r.without.is_empty())
    }
}

impl Opened {
    /// The device.
    pub fn device(&self) -> &dyn Device {
        self.devx.device()
    }

    /// What gdaki needs of this device and what it has.
    pub fn report(&self) -> DeviceReport {
        let (g, a, p) = (&self.caps.general, &self.caps.atomic, &self.port);
        let ops = |o: u16| {
            [
                (AtomicCaps::CMP_SWAP, "compare-and-swap"),
                (AtomicCaps::FETCH_ADD, "fetch-and-add"),
            ]
            .iter()
            .filter(|(bit, _)| o & bit != 0)
            .map(|(_, n)| *n)
            .collect::<Vec<_>>()
            .join(", ")
        };
        let atomics_needed = AtomicCaps::CMP_SWAP | AtomicCaps::FETCH_ADD;
        // A size gdaki uses up to `ours` of, where the device offers 2^log.
        let size = |what, unit, ours: u64, log: u8| {
            let theirs = 1u64 << log.min(63);
            Requirement {
                what,
                needed: format!("up to {ours} {unit}"),
                found: format!("up to {theirs}"),
                met: theirs >= ours,
                without: "gdaki uses the device's smaller limit (larger puts split into more WQEs)",
            }
        };
        let requirements = vec![
            Requirement {
                what: "CQE format",
                needed: "version 1".into(),
                found: format!("version {}", g.cqe_version),
                met: g.cqe_version == 1,
                without: "",
            },
            Requirement {
                what: "atomics on RC QPs",
                needed: "8-byte compare-and-swap and fetch-and-add".into(),
                found: if g.atomic {
                    let sizes: Vec<_> = (0..16u32)
                        .filter(|n| a.size_qp & (1 << n) != 0)
                        .map(|n| (1u32 << n).to_string())
                        .collect();
                    let ops = if a.operations == 0 {
                        "none".into()
                    } else {
                        ops(a.operations)
                    };
                    let sizes = if sizes.is_empty() {
                        "no size".into()
                    } else {
                        sizes.join("/")
                    };
                    format!("{ops}; {sizes}-byte")
                } else {
                    "not supported".into()
                },
                met: g.atomic
                    && a.operations & atomics_needed == atomics_needed
                    && a.size_qp & AtomicCaps::SIZE_8_BYTES != 0,
                without: "atomics and signals complete with an error",
            },
            Requirement {
                what: "8-byte atomic reply order",
                needed: "big-endian or host order (the device code reads either)".into(),
                found: match a.reply_mode {
                    1 => "host order (mode 1)".into(),
                    m => format!("big-endian (mode {m})"),
                },
                met: a.reply_mode <= 1,
                without: "",
            },
            size(
                "send queue size",
                "WQEs",
                crate::queue::MAX_SQ_SIZE as u64,
                g.log_max_qp_sz,
            ),
            size(
                "completion queue size",
                "CQEs",
                crate::queue::MAX_CQ_SIZE as u64,
                g.log_max_cq_sz,
            ),
            size("message size", "bytes per WQE", 1 << 30, g.log_max_msg),
        ];
        DeviceReport {
            name: self.device().name(),
            port: p.number,
            link_layer: match p.link {
                LinkLayer::InfiniBand => "InfiniBand",
                LinkLayer::Ethernet => "Ethernet",
            },
            mtu: p.mtu,
            lid: p.lid,
            gid_index: p.gid_index,
            gid: std::net::Ipv6Addr::from(p.gid).to_string(),
            requirements,
        }
    }
}

impl Devx {
    /// Opens `device`: reads its capabilities and port, and allocates what every queue shares.
    /// Refuses a device whose CQE format gdaki cannot read.
    pub fn open(device: Arc<dyn Device>) -> Result<Opened, DeviceError> {
        let devx = Devx::new(device);
        let caps = devx.query_caps()?;
        if caps.general.cqe_version != 1 {
            return Err(DeviceError::Call {
                what: "opening the device",
                why: format!(
                    "it reports CQE version {}; gdaki reads version 1",
                    caps.general.cqe_version
                ),
            });
        }
        let eqn = devx.device.query_eqn()?;
        let port = devx.device.query_port()?;
        let cq_uar = devx.uar()?;
        Ok(Opened {
            devx,
            caps,
            eqn,
            port,
            cq_uar,
        })
    }

    /// Registers `mem` (whole) as a umem, deregistered when the returned value goes.
    pub fn umem(&self, mem: QueueMemory) -> Result<Umem, DeviceError> {
        let id = self.device.umem_reg(&mem.memory())?;
        Ok(Umem {
            devx: self.clone(),
            id,
            mem,
        })
    }

    /// A new protection domain, given back when the returned value goes.
    pub fn pd(&self) -> Result<OwnedPd, DeviceError> {
        Ok(OwnedPd {
            number: self.device.alloc_pd()?,
            devx: self.clone(),
        })
    }

    /// A UAR page, given back when the returned value goes.
    pub fn uar(&self) -> Result<OwnedUar, DeviceError> {
        Ok(OwnedUar {
            uar: self.device.alloc_uar()?,
            devx: self.clone(),
        })
    }

    /// Creates an object from `input`, destroyed when the returned value goes.
    pub fn create_owned(&self, input: &[u8]) -> Result<Owned, DeviceError> {
        Ok(Owned {
            obj: self.create(input)?,
            devx: self.clone(),
        })
    }
}

/// The memory of a queue (its ring and doorbell record), page-aligned whole pages the library
/// owns: in host memory or in a GPU's.
#[derive(Clone)]
pub(crate) enum QueueMemory {
    /// Host memory (a GPU export maps it page-locked).
    Host(Arc<HostBuffer>),
    /// Device memory of `gpu` (a NIC reaches it through a dma-buf export).
    Gpu {
        /// The allocation.
        buf: Arc<crate::cuda::DeviceBuffer>,
        /// Its GPU.
        gpu: crate::cuda::Gpu,
    },
}

impl QueueMemory {
    /// Its first byte (a CPU address for host memory, a GPU address for device memory).
    pub fn addr(&self) -> u64 {
        match self {
            QueueMemory::Host(b) => b.addr(),
            QueueMemory::Gpu { buf, .. } => buf.device_addr(),
        }
    }

    /// The GPU it lives on (`None`: host memory).
    pub fn gpu(&self) -> Option<&crate::cuda::Gpu> {
        match self {
            QueueMemory::Host(_) => None,
            QueueMemory::Gpu { gpu, .. } => Some(gpu),
        }
    }

    /// Copies `src` to `offset`: only before a device is given the memory, or where the
    /// device does not write the bytes concurrently.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), crate::Error> {
        match self {
            QueueMemory::Host(b) => {
                if offset.checked_add(src.len()).is_none_or(|end| end > b.size()) {
                    return Err(crate::Error::OutOfRange {
                        what: "a write into queue memory",
                        got: (offset + src.len()) as u64,
                        min: 0,
                        max: b.size() as u64,
                    });
                }
                // SAFETY: the destination lies inside the buffer (checked) and `src` is a
                // separate slice; the caller guarantees no concurrent writer.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), b.as_ptr().add(offset), src.len()) };
                Ok(())
            }
            QueueMemory::Gpu { buf, .. } => Ok(buf.write(offset, src)?),
        }
    }

    /// The registration a device is given: the memory, what it is, and what keeps it.
    fn memory(&self) -> Memory {
        match self {
            QueueMemory::Host(b) => Memory {
                addr: b.addr(),
                len: b.size() as u64,
                kind: MemoryKind::Host { gpu_mapped: false },
                keep: Some(b.clone()),
            },
            QueueMemory::Gpu { buf, gpu } => Memory {
                addr: buf.device_addr(),
                len: buf.len() as u64,
                kind: MemoryKind::Gpu(gpu.clone()),
                keep: Some(buf.clone()),
            },
        }
    }
}

/// Queue memory registered as a umem; deregistered on drop (after the objects using it were
/// destroyed: declare it after them).
pub(crate) struct Umem {
    devx: Devx,
    /// The umem id.
    pub id: u32,
    /// The memory.
    pub mem: QueueMemory,
}

impl Drop for Umem {
    fn drop(&mut self) {
        if let Err(e) = self.devx.device.umem_dereg(self.id) {
            tracing::warn!(target: "gdaki::devx", umem = self.id, "umem not deregistered: {e}");
        }
    }
}

/// A protection domain; given back on drop (after everything in it, which holds it alive).
pub(crate) struct OwnedPd {
    devx: Devx,
    /// Its number.
    pub number: u32,
}

impl Drop for OwnedPd {
    fn drop(&mut self) {
        if let Err(e) = self.devx.device.dealloc_pd(self.number) {
            tracing::warn!(target: "gdaki::devx", pd = format_args!("{:#x}", self.number), "protection domain not given back: {e}");
        }
    }
}

/// A UAR page; given back on drop.
pub(crate) struct OwnedUar {
    devx: Devx,
    /// The page.
    pub uar: Uar,
}

impl Drop for OwnedUar {
    fn drop(&mut self) {
        self.devx.device.free_uar(&self.uar);
    }
}

/// A device object, destroyed on drop.
pub(crate) struct Owned {
    devx: Devx,
    /// The object.
    pub obj: Object,
}

impl Owned {
    /// Modifies the object with `input`.
    pub fn modify(&self, input: &[u8]) -> Result<(), DeviceError> {
        self.devx.modify(&self.obj, input)
    }

    /// Queries the object with `input` into an output of `out_len` bytes.
    pub fn query(&self, input: &[u8], out_len: usize) -> Result<Vec<u8>, DeviceError> {
        self.devx.query(&self.obj, input, out_len)
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        if let Err(e) = self.devx.destroy(&self.obj) {
            tracing::warn!(target: "gdaki::devx", object = format_args!("{:#x}", self.obj.number), "not destroyed: {e}");
        }
    }
}

/// A mailbox's non-zero 32-bit words, `offset:value`, for the command log.
struct Fields<'a>(&'a [u8]);

impl std::fmt::Display for Fields<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut first = true;
        for (i, w) in self.0.chunks(4).enumerate() {
            let v = w.iter().fold(0u32, |v, b| v << 8 | *b as u32);
            if v != 0 {
                write!(f, "{}{:#x}:{v:#010x}", if first { "" } else { " " }, i * 4)?;
                first = false;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::soft::firmware::SoftDevice;
    use crate::{lock, Access, Context, ContextOptions, Provider, QpConfig, QpState};

    /// A device that records every call and passes it on to the soft firmware: the sequence a
    /// ConnectX gets from the same generic code.
    pub(crate) struct Recording {
        inner: Arc<SoftDevice>,
        calls: Mutex<Vec<String>>,
        /// A command to refuse, as firmware would (`BAD_PARAM_ERR`).
        refuse: Mutex<Option<Opcode>>,
        /// Accept umems in GPU memory as a NIC does (through dma-buf): the soft firmware, which
        /// reads queues with the CPU, is given a host stand-in of the same size instead, so
        /// queues are created and moved through their states, but nothing is served from them.
        stand_in_for_gpu_umems: bool,
    }

    impl Recording {
        fn note(&self, call: impl Into<String>) {
            lock(&self.calls).push(call.into());
        }
        fn create(&self, input: &[u8], out: &mut [u8]) -> Result<u64, DeviceError> {
            let op = command::opcode(input);
            self.note(op.name());
            if *lock(&self.refuse) == Some(op) {
                let error = CmdError {
                    opcode: op,
                    status: gdaki_layout::prm::CmdStatus::BadParam,
                    syndrome: 0x1234,
                };
                command::fail(out, error.status, error.syndrome);
                return Err(DeviceError::Command {
                    error,
                    detail: Some("refused by the test".into()),
                });
            }
            self.inner.obj_create(input, out)
        }
        pub(crate) fn take(&self) -> Vec<String> {
            std::mem::take(&mut *lock(&self.calls))
        }
    }

    impl Device for Recording {
        fn general_cmd(&self, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
            self.note(command::opcode(input).name());
            self.inner.general_cmd(input, out)
        }
        fn alloc_pd(&self) -> Result<u32, DeviceError> {
            self.note("alloc_pd");
            self.inner.alloc_pd()
        }
        fn dealloc_pd(&self, pd: u32) -> Result<(), DeviceError> {
            self.note("dealloc_pd");
            self.inner.dealloc_pd(pd)
        }
        fn alloc_uar(&self) -> Result<Uar, DeviceError> {
            self.note("alloc_uar");
            self.inner.alloc_uar()
        }
        fn free_uar(&self, uar: &Uar) {
            self.note("free_uar");
            self.inner.free_uar(uar)
        }
        fn query_eqn(&self) -> Result<u32, DeviceError> {
            self.note("query_eqn");
            self.inner.query_eqn()
        }
        fn umem_reg(&self, mem: &Memory) -> Result<u32, DeviceError> {
            match mem.kind {
                MemoryKind::Gpu(_) if self.stand_in_for_gpu_umems => {
                    self.note(format!("umem_reg(gpu, {} bytes)", mem.len));
                    let stand_in = Arc::new(HostBuffer::new("a GPU umem's stand-in", mem.len as usize).unwrap());
                    self.inner.umem_reg(&Memory {
                        addr: stand_in.addr(),
                        len: stand_in.size() as u64,
                        kind: MemoryKind::Host { gpu_mapped: false },
                        keep: Some(stand_in),
                    })
                }
                _ => {
                    self.note("umem_reg");
                    self.inner.umem_reg(mem)
                }
            }
        }
        fn umem_dereg(&self, id: u32) -> Result<(), DeviceError> {
            self.note("umem_dereg");
            self.inner.umem_dereg(id)
        }
        fn obj_create(&self, input: &[u8], out: &mut [u8]) -> Result<u64, DeviceError> {
            self.create(input, out)
        }
        fn obj_modify(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
            self.note(command::opcode(input).name());
            self.inner.obj_modify(handle, input, out)
        }
        fn obj_query(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
            self.note(command::opcode(input).name());
            self.inner.obj_query(handle, input, out)
        }
        fn obj_destroy(&self, handle: u64) -> Result<(), DeviceError> {
            self.note("destroy");
            self.inner.obj_destroy(handle)
        }
        fn query_port(&self) -> Result<Port, DeviceError> {
            self.note("query_port");
            self.inner.query_port()
        }
        fn reg_mr(&self, pd: u32, mem: &Memory, access: Access) -> Result<Mr, DeviceError> {
            self.note("reg_mr");
            self.inner.reg_mr(pd, mem, access)
        }
        fn dereg_mr(&self, mr: &Mr) -> Result<(), DeviceError> {
            self.note("dereg_mr");
            self.inner.dereg_mr(mr)
        }
        fn name(&self) -> String {
            self.inner.name()
        }
        fn transport_addr(&self) -> Option<SocketAddr> {
            self.inner.transport_addr()
        }
        fn transport_secret(&self, qpn: u32) -> u64 {
            self.inner.transport_secret(qpn)
        }
        fn resolve(&self, peer: &Endpoint) -> Result<AddressPath, DeviceError> {
            self.note("resolve");
            self.inner.resolve(peer)
        }
    }

    fn recording_context() -> (Context, Arc<Recording>) {
        recording_context_with(false)
    }

    /// A context on a [`Recording`] device; `stand_in_for_gpu_umems`: see there.
    pub(crate) fn recording_context_with(stand_in_for_gpu_umems: bool) -> (Context, Arc<Recording>) {
        let rec = Arc::new(Recording {
            inner: Arc::new(SoftDevice::open(Default::default(), Default::default(), Default::default()).unwrap()),
            calls: Mutex::new(Vec::new()),
            refuse: Mutex::new(None),
            stand_in_for_gpu_umems,
        });
        let ctx = Context::open_on(rec.clone(), ContextOptions::default(), Provider::Soft).unwrap();
        (ctx, rec)
    }

    /// The generic objects send a ConnectX the sequence rdma-core's DevX RC test and NVSHMEM's
    /// IBGDA send (../shared/reference/mlx5-devx.md), and give everything back in reverse.
    #[test]
    fn queues_send_the_devx_sequence_a_connectx_expects() {
        let (ctx, rec) = recording_context();
        assert_eq!(
            rec.take(),
            [
                "QUERY_HCA_CAP",
                "QUERY_HCA_CAP",
                "query_eqn",
                "query_port",
                "alloc_uar",
                "alloc_pd"
            ]
        );
        let cq = ctx.create_cq(64).unwrap();
        assert_eq!(rec.take(), ["umem_reg", "CREATE_CQ"]);
        let qp = ctx
            .create_qp(
                &cq,
                QpConfig {
                    sq_size: 64,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(rec.take(), ["umem_reg", "alloc_uar", "CREATE_QP"]);
        qp.connect(&qp.endpoint()).unwrap();
        assert_eq!(rec.take(), ["RST2INIT_QP", "resolve", "INIT2RTR_QP", "RTR2RTS_QP"]);
        assert_eq!(qp.state(), QpState::Rts);
        assert_eq!(rec.take(), ["QUERY_QP"]);

        // A put through the queues the commands made, on a region the device registered.
        let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
        assert_eq!(rec.take(), ["reg_mr"]);
        // SAFETY: one poster; the QP outlives it.
        let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
        dev.wait(dev.put(mr.remote(2048), mr.local(0), 64).unwrap()).unwrap();
        assert_eq!(cq.written().unwrap(), 1);
        assert_eq!(rec.take(), ["QUERY_CQ"]);

        qp.to_error().unwrap();
        assert_eq!(qp.error(), Some(gdaki_layout::Syndrome::WrFlush));
        assert_eq!(rec.take(), ["2ERR_QP", "QUERY_QP"]);
        drop(cq); // the QP keeps its CQ until it goes
        assert_eq!(rec.take(), Vec::<String>::new());
        drop(qp);
        assert_eq!(
            rec.take(),
            ["destroy", "free_uar", "umem_dereg", "destroy", "umem_dereg"],
            "the QP, its UAR and umem, then its CQ and the CQ's umem"
        );
        drop(mr);
        assert_eq!(rec.take(), ["dereg_mr"]);
        // A second protection domain on the same device: its own PD, nothing else opened
        // again, given back when it and its regions are gone.
        let tenant = ctx.alloc_pd().unwrap();
        assert_eq!(rec.take(), ["alloc_pd"]);
        assert_ne!(tenant.pd(), ctx.pd());
        let theirs = tenant.alloc_region(4096, Access::ALL).unwrap();
        drop(tenant);
        assert_eq!(rec.take(), ["reg_mr"], "the region holds its PD");
        drop(theirs);
        assert_eq!(rec.take(), ["dereg_mr", "dealloc_pd"]);
        drop(ctx);
        assert_eq!(
            rec.take(),
            ["dealloc_pd", "free_uar"],
            "the PD, then the CQs' UAR page go with the context"
        );
    }

    /// The report names what gdaki needs and judges each requirement: the soft device meets
    /// them all; a device with smaller caps is limited, one without version-1 CQEs unusable.
    #[test]
    fn the_device_report_judges_each_requirement() {
        let (ctx, _rec) = recording_context();
        let rep = ctx.device_report();
        assert!(rep.usable() && rep.requirements.iter().all(|r| r.met), "{rep:#?}");
        assert_eq!((rep.name.as_str(), rep.port, rep.link_layer), ("soft", 1, "Ethernet"));
        assert!(rep.gid.starts_with("fe80::"), "{}", rep.gid);

        let mut opened = Devx::open(Arc::new(
            SoftDevice::open(Default::default(), Default::default(), Default::default()).unwrap(),
        ))
        .unwrap();
        opened.caps.general.log_max_qp_sz = 10;
        opened.caps.atomic.operations = AtomicCaps::FETCH_ADD;
        let rep = opened.report();
        let unmet: Vec<_> = rep.requirements.iter().filter(|r| !r.met).map(|r| r.what).collect();
        assert_eq!(unmet, ["atomics on RC QPs", "send queue size"]);
        assert!(rep.usable(), "limits, not blockers");
        opened.caps.general.cqe_version = 0;
        assert!(!opened.report().usable());
    }

    /// A device's refusal reaches the caller as `Error::Device` with the command, status and
    /// syndrome, and the half-made queue is given back: the CQ serves the next QP.
    #[test]
    fn a_refused_create_gives_back_what_it_took() {
        let (ctx, rec) = recording_context();
        let cq = ctx.create_cq(16).unwrap();
        let cfg = QpConfig {
            sq_size: 16,
            ..Default::default()
        };
        rec.take();
        *lock(&rec.refuse) = Some(Opcode::CreateQp);
        let err = ctx.create_qp(&cq, cfg.clone()).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, crate::Error::Device { .. }), "{text}");
        assert!(
            text.contains("CREATE_QP") && text.contains("BAD_PARAM") && text.contains("0x00001234"),
            "{text}"
        );
        assert_eq!(
            rec.take(),
            ["umem_reg", "alloc_uar", "CREATE_QP", "free_uar", "umem_dereg"]
        );
        *lock(&rec.refuse) = None;
        let qp = ctx.create_qp(&cq, cfg.clone()).unwrap();
        qp.connect(&qp.endpoint()).unwrap();
        // gdaki's own limits are checked before the device is asked.
        rec.take();
        assert!(matches!(ctx.create_cq(3), Err(crate::Error::BadSize { .. })));
        assert!(matches!(ctx.create_qp(&cq, cfg), Err(crate::Error::CqInUse { .. })));
        assert!(rec.take().is_empty());
    }
}
