//! The DevX provider: gdaki builds every queue the way a ConnectX wants it, with PRM command
//! mailboxes ([`gdaki_layout::prm`]) sent through one narrow boundary, [`Device`]. Two devices
//! sit behind it: a real mlx5 NIC (libmlx5's `mlx5dv_devx_*`, loaded at run time) and the soft
//! device (`gdaki-soft`), whose firmware model decodes the same mailboxes.
//!
//! [`Devx`] runs commands on a device: it checks every answer's status, and logs each command
//! (name, key fields, status, syndrome) at debug level under the `gdaki::devx` target, so a
//! user with a NIC can send the exact sequence when something fails
//! (`RUST_LOG=gdaki::devx=debug`).
use std::sync::Arc;

use gdaki_layout::prm::command::{self, AtomicCaps, CapType, GeneralCaps, GeneralCaps2, RoceCaps};
use gdaki_layout::prm::Opcode;

use crate::device::{Caps, Device, DeviceError, LinkLayer, Memory, MemoryKind, Object, Port, Uar};
use crate::HostBuffer;

/// Runs DevX commands on a device, checking and logging each.
#[derive(Clone)]
pub struct Devx {
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

    /// `QUERY_HCA_CAP` of the general and atomic capabilities, the RoCE ones where the port is
    /// Ethernet, and the second general ones where the device has them.
    pub fn query_caps(&self) -> Result<Caps, DeviceError> {
        let query = |kind| -> Result<Vec<u8>, DeviceError> {
            let input = command::query_hca_cap(kind);
            let mut out = vec![0u8; command::QUERY_HCA_CAP_OUT_BYTES];
            let ran = self.device.general_cmd(&input, &mut out);
            Self::checked(Opcode::QueryHcaCap, &input, &out, ran)?;
            Ok(out)
        };
        let general = GeneralCaps::decode(&query(CapType::General)?);
        let atomic = AtomicCaps::decode(&query(CapType::Atomic)?);
        // port_type 1: Ethernet, where the RoCE capabilities apply.
        let roce = if general.port_type == 1 && general.roce {
            Some(RoceCaps::decode(&query(CapType::Roce)?))
        } else {
            None
        };
        // As the kernel: the second capabilities only where the first say they are there.
        let general2 = if general.hca_cap_2 {
            GeneralCaps2::decode(&query(CapType::General2)?)
        } else {
            GeneralCaps2::default()
        };
        Ok(Caps {
            general,
            general2,
            atomic,
            roce,
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
pub struct Opened {
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

/// One thing gdaki depends on in a device, and what the device has (`gdaki::Context::device_report`).
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
        // A size gdaki uses up to `ours` of, where the device offers 2^log; `without` says
        // what a smaller limit costs.
        let size = |what, unit, ours: u64, log: u8, without| {
            let theirs = 1u64 << log.min(63);
            Requirement {
                what,
                needed: format!("up to {ours} {unit}"),
                found: format!("up to {theirs}"),
                met: theirs >= ours,
                without,
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
            Requirement {
                what: "Core-Direct WAIT",
                needed: "cmd_hca_cap.cd, for counters the HCA advances".into(),
                found: if g.cd { "supported" } else { "not supported" }.into(),
                met: g.cd,
                without: "cross-channel queue pairs, and so counters (count_when_done), are refused",
            },
            Requirement {
                what: "reliable doorbell",
                needed: "cmd_hca_cap_2.send_dbr_mode_no_dbr_ext, for queue pairs without a doorbell record".into(),
                found: if self.caps.general2.send_dbr_mode_no_dbr_ext {
                    "supported"
                } else {
                    "not supported"
                }
                .into(),
                met: self.caps.general2.send_dbr_mode_no_dbr_ext,
                without: "QpConfig::reliable_doorbell is refused; posters write the doorbell record as always",
            },
            size(
                "send queue size",
                "WQEs",
                crate::qp::MAX_SQ_SIZE as u64,
                g.log_max_qp_sz,
                "larger send queues (-t, sq_size) are refused; the device's limit is the largest",
            ),
            size(
                "completion queue size",
                "CQEs",
                crate::qp::MAX_CQ_SIZE as u64,
                g.log_max_cq_sz,
                "larger completion queues are refused; the device's limit is the largest",
            ),
            size(
                "message size",
                "bytes per WQE",
                1 << 30,
                g.log_max_msg,
                "gdaki uses the device's smaller limit (larger puts split into more WQEs)",
            ),
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
pub enum QueueMemory {
    /// Host memory (a GPU export maps it page-locked).
    Host(Arc<HostBuffer>),
    /// Device memory of `gpu` (a NIC reaches it through a dma-buf export).
    Gpu {
        /// The allocation.
        buf: Arc<gdaki_cuda::DeviceBuffer>,
        /// Its GPU.
        gpu: gdaki_cuda::Gpu,
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
    pub fn gpu(&self) -> Option<&gdaki_cuda::Gpu> {
        match self {
            QueueMemory::Host(_) => None,
            QueueMemory::Gpu { gpu, .. } => Some(gpu),
        }
    }

    /// Copies `src` to `offset`: only before a device is given the memory, or where the
    /// device does not write the bytes concurrently.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        match self {
            QueueMemory::Host(b) => {
                if offset.checked_add(src.len()).is_none_or(|end| end > b.size()) {
                    return Err(DeviceError::Call {
                        what: "a write into queue memory",
                        why: format!(
                            "{} bytes at offset {offset} pass its end ({} bytes)",
                            src.len(),
                            b.size()
                        ),
                    });
                }
                // SAFETY: the destination lies inside the buffer (checked) and `src` is a
                // separate slice; the caller guarantees no concurrent writer.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), b.as_ptr().add(offset), src.len()) };
                Ok(())
            }
            QueueMemory::Gpu { buf, .. } => buf.write(offset, src).map_err(|e| DeviceError::Call {
                what: "a write into GPU queue memory",
                why: e.to_string(),
            }),
        }
    }

    /// The registration a device is given: the memory, what it is, and what keeps it.
    fn memory(&self) -> Memory {
        match self {
            // SAFETY: the whole buffer, which `keep` holds for as long as the device may use it.
            QueueMemory::Host(b) => unsafe {
                Memory::new(
                    b.addr(),
                    b.size() as u64,
                    MemoryKind::Host { gpu_mapped: false },
                    Some(b.clone()),
                )
            },
            // SAFETY: as above, in device memory of `gpu`.
            QueueMemory::Gpu { buf, gpu } => unsafe {
                Memory::new(
                    buf.device_addr(),
                    buf.len() as u64,
                    MemoryKind::Gpu(gpu.clone()),
                    Some(buf.clone()),
                )
            },
        }
    }
}

/// Queue memory registered as a umem; deregistered on drop (after the objects using it were
/// destroyed: declare it after them).
pub struct Umem {
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
pub struct OwnedPd {
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
pub struct OwnedUar {
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
pub struct Owned {
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
