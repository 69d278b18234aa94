//! The soft device's firmware: it implements the DevX [`Device`] boundary by decoding the PRM
//! mailboxes with the field definitions of [`gdaki_layout::prm`], validating them as ConnectX
//! firmware does, and answering with a PRM status and a syndrome. The CQs and QPs it creates
//! read their rings and doorbell records from the umems they were given and are served by the
//! soft HCA's engine like any other.
//!
//! Syndromes are firmware-specific 32-bit values; the soft device's are [`FwSyndrome`]. Where
//! the model is narrower than a NIC it says so with its own syndrome: one QP per UAR page (its
//! engine watches a doorbell word per QP), one QP per CQ (gdaki's tickets are CQE indices),
//! RC QPs with a zero-length receive queue, and 64-byte uncompressed CQEs. A QP connects its
//! transport at RTR2RTS, when its send PSN is known: an unreachable peer is refused there.
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gdaki_layout::prm::command::{
    self, AddressPath, AtomicCaps, GeneralCaps, CQC_STATUS_OK, CQC_STATUS_OVERFLOW, QPC_RQ_TYPE_ZERO_LEN, QPC_ST_RC,
};
use gdaki_layout::prm::layout::{ads, cmd_in, cqc, create_cq_in, create_qp_in, modify_qp_in, object_in, qpc};
use gdaki_layout::prm::layout::{query_cq_out, query_qp_out};
use gdaki_layout::prm::{get, get_bytes, set, Bits, CmdError, CmdStatus, Opcode};
use gdaki_layout::{recv, AtomicReplyOrder, Syndrome, SEND_WQE_BB};

use crate::copier::Copier;
use crate::dma::DeviceDma;
use crate::dma::{Dma, HostDma};
use crate::engine::{Engine, Idle};
use crate::objects::{RtrPeer, SoftCq, SoftQp, SoftRq, Window};
use crate::requester::Peer;
use crate::{Hca, SameHost};
use gdaki_devx::util::lock;
use gdaki_devx::Access;
use gdaki_devx::HostBuffer;
use gdaki_devx::{Device, DeviceError, LinkLayer, Memory, MemoryKind, Mr, Port, Uar};
use gdaki_devx::{Endpoint, QpState};

/// Why the soft firmware refused a command (the syndrome in its output mailbox).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum FwSyndrome {
    /// The input mailbox is shorter than the command's.
    ShortInput = 0x5f_0001,
    /// The op_mod is not one the command takes.
    BadOpMod = 0x5f_0002,
    /// The queue is not in a umem (`*_umem_valid` is 0): the soft device has no page lists.
    NotInUmem = 0x5f_0003,
    /// No umem with that id.
    UnknownUmem = 0x5f_0004,
    /// The umem ends before the ring or record does.
    UmemTooSmall = 0x5f_0005,
    /// A ring or doorbell record is not aligned (rings to 64 bytes, records to 8).
    Misaligned = 0x5f_0006,
    /// No UAR page with that index.
    UnknownUar = 0x5f_0007,
    /// The UAR page already rings another QP (the model watches one doorbell word per QP).
    UarInUse = 0x5f_0008,
    /// No CQ with that number on this device.
    UnknownCq = 0x5f_0009,
    /// The CQ serves a QP (one QP per CQ; and a CQ in use cannot be destroyed).
    CqInUse = 0x5f_000a,
    /// No PD with that number.
    UnknownPd = 0x5f_000b,
    /// A queue size above the device's capability.
    AboveCap = 0x5f_000c,
    /// A format the model does not implement (CQE size, compression, collapsing, service type,
    /// receive queue type).
    Unsupported = 0x5f_000d,
    /// No object with that handle or number.
    UnknownObject = 0x5f_000e,
    /// The QP is not in the state the transition starts from.
    BadState = 0x5f_000f,
    /// No such port.
    BadPort = 0x5f_0010,
    /// No such event queue.
    BadEqn = 0x5f_0011,
    /// The peer the path names cannot be reached.
    PeerUnreachable = 0x5f_0012,
    /// A capability type the device does not report.
    UnknownCap = 0x5f_0013,
    /// A path MTU code that is not 256..4096 bytes.
    BadMtu = 0x5f_0014,
    /// The output mailbox is shorter than the command's answer.
    ShortOutput = 0x5f_0015,
    /// An atomic mode above what the device's atomic capabilities report.
    BadAtomicMode = 0x5f_0016,
}

/// A refusal: the status, the syndrome and the reason in words.
struct Refusal(CmdStatus, FwSyndrome, String);

type Answer<T> = std::result::Result<T, Refusal>;

fn refuse<T>(status: CmdStatus, syndrome: FwSyndrome, why: impl Into<String>) -> Answer<T> {
    Err(Refusal(status, syndrome, why.into()))
}

/// A queue size (log2) the caps allow, or `LIM_ERR`.
fn within_cap(what: &str, log: u64, cap: u8) -> Answer<u32> {
    if log > cap as u64 {
        return refuse(
            CmdStatus::ExceedLim,
            FwSyndrome::AboveCap,
            format!("{what} {log} above {cap}"),
        );
    }
    Ok(log as u32)
}

/// Handles carry the object kind above the 24-bit number.
const CQ_HANDLE: u64 = 1 << 32;
const QP_HANDLE: u64 = 2 << 32;

/// The only port, and the only event queue.
const PORT: u8 = 1;
const EQN: u32 = 0;

/// What the soft device reports (and enforces).
fn general_caps() -> GeneralCaps {
    GeneralCaps {
        hca_cap_2: true,
        log_max_qp_sz: gdaki_devx::MAX_SQ_SIZE.trailing_zeros() as u8,
        log_max_qp: 24,
        log_max_cq_sz: gdaki_devx::MAX_CQ_SIZE.trailing_zeros() as u8,
        log_max_cq: 24,
        log_max_ra_req_qp: 16,
        log_max_ra_res_qp: 16,
        port_type: 1,
        num_ports: 1,
        log_max_msg: 31,
        cqe_version: 1,
        roce: true,
        atomic: true,
        cq_oi: true,
        cd: true,
        log_pg_sz: 12,
        log_max_pd: 24,
        log_max_umem: 24,
        // A real-time clock only, as some ConnectX configurations have: a QP asking for the
        // free-running one is refused (CREATE_QP below), as there.
        sq_ts_format: command::TS_FORMAT_CAP_REAL_TIME,
    }
}

/// What the soft device reports in its second general capabilities: QPs without a doorbell
/// record, as a ConnectX-8 (the engine never reads a send record: the doorbell carries the
/// producer index).
fn general_caps_2() -> command::GeneralCaps2 {
    command::GeneralCaps2 {
        send_dbr_mode_no_dbr_ext: true,
    }
}

/// What the soft device reports of RoCE (its port is Ethernet).
fn roce_caps() -> command::RoceCaps {
    command::RoceCaps {
        qp_ts_format: command::TS_FORMAT_CAP_REAL_TIME,
    }
}

struct UmemEntry {
    addr: u64,
    len: u64,
    /// Keeps the memory allocated while queues read it.
    keep: Arc<dyn Send + Sync>,
    users: u32,
}

struct CqEntry {
    cq: Arc<SoftCq>,
    umems: [u32; 2],
}

struct QpEntry {
    qp: Arc<SoftQp>,
    umems: [u32; 2],
    uar: u32,
    /// INIT2RTR's peer.
    remote: Option<Remote>,
}

/// The peer a QP was moved to RTR with.
#[derive(Clone, Copy)]
struct Remote {
    gid: [u8; 16],
    qpn: u32,
    /// Where its soft HCA listens, as resolved for its GID before INIT2RTR.
    addr: Option<SocketAddr>,
    /// Its transport secret, from the endpoint resolved before INIT2RTR (0: none known).
    secret: u64,
}

#[derive(Default)]
struct Tables {
    umems: HashMap<u32, UmemEntry>,
    uars: HashMap<u32, (Arc<HostBuffer>, Option<u32>)>,
    pds: HashSet<u32>,
    cqs: HashMap<u32, CqEntry>,
    qps: HashMap<u32, QpEntry>,
    neighbours: HashMap<[u8; 16], SocketAddr>,
    /// Transport secrets of resolved endpoints, by GID and QPN, until INIT2RTR takes them.
    secrets: HashMap<([u8; 16], u32), u64>,
    next_id: u32,
}

impl Tables {
    fn id(&mut self) -> u32 {
        self.next_id = self.next_id.wrapping_add(1).max(1);
        self.next_id
    }

    /// A window of `len` bytes at `offset` into umem `id`, aligned to `align`.
    fn window(&self, id: u32, offset: u64, len: usize, align: u64) -> Answer<Window> {
        let Some(u) = self.umems.get(&id) else {
            return refuse(CmdStatus::BadRes, FwSyndrome::UnknownUmem, format!("no umem {id:#x}"));
        };
        if offset.checked_add(len as u64).is_none_or(|end| end > u.len) {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::UmemTooSmall,
                format!("umem {id:#x} has {} bytes, {len} needed at offset {offset:#x}", u.len),
            );
        }
        let addr = u.addr + offset;
        if addr % align != 0 {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::Misaligned,
                format!("{addr:#x} is not {align}-byte aligned"),
            );
        }
        // SAFETY: the range lies inside the umem, whose memory `keep` keeps allocated.
        Ok(unsafe { Window::new(addr, u.keep.clone()) })
    }
}

/// The soft device: one per soft context, over its HCA, whose engine it runs.
pub struct SoftDevice {
    hca: Arc<Hca>,
    atomic_reply: AtomicReplyOrder,
    tables: Mutex<Tables>,
    /// The engine serving the HCA's queues; stopped when the device goes. None for a second
    /// firmware over an HCA that another device's engine serves (the firmware's own tests).
    _engine: Option<Engine>,
}

impl SoftDevice {
    /// A new soft HCA and its device, answering 8-byte atomics in `atomic_reply` order, its
    /// same-host connections travelling as `same_host` allows, with its engine started and
    /// idling as `idle` says.
    pub fn open(atomic_reply: AtomicReplyOrder, same_host: SameHost, idle: Idle) -> Result<SoftDevice, DeviceError> {
        let hca = Hca::new(same_host, idle);
        let engine = Engine::start(hca.clone(), idle).map_err(|e| DeviceError::Call {
            what: "starting the soft HCA's engine thread",
            why: e.to_string(),
        })?;
        Ok(SoftDevice {
            _engine: Some(engine),
            ..SoftDevice::over(hca, atomic_reply)
        })
    }

    /// A device over `hca`, which something else serves.
    #[cfg(test)]
    pub(crate) fn new(hca: Arc<Hca>, atomic_reply: AtomicReplyOrder) -> SoftDevice {
        SoftDevice::over(hca, atomic_reply)
    }

    fn over(hca: Arc<Hca>, atomic_reply: AtomicReplyOrder) -> SoftDevice {
        SoftDevice {
            hca,
            atomic_reply,
            tables: Mutex::new(Tables::default()),
            _engine: None,
        }
    }

    /// A new device served by its own engine, with the defaults (for tests).
    #[cfg(test)]
    pub(crate) fn served() -> Arc<SoftDevice> {
        Arc::new(
            SoftDevice::open(AtomicReplyOrder::BigEndian, SameHost::default(), Idle::default()).expect("a soft device"),
        )
    }

    /// What the soft device reports of its atomics (and enforces): IB-spec 8-byte
    /// compare-and-swap and fetch-and-add, no extended atomics.
    fn atomic_caps(&self) -> AtomicCaps {
        AtomicCaps {
            reply_mode: (self.atomic_reply == AtomicReplyOrder::HostOrder) as u8,
            host_order_supported: true,
            operations: AtomicCaps::CMP_SWAP | AtomicCaps::FETCH_ADD,
            size_qp: AtomicCaps::SIZE_8_BYTES,
        }
    }

    /// The HCA behind the device.
    #[cfg(test)]
    pub(crate) fn hca(&self) -> &Arc<Hca> {
        &self.hca
    }

    /// This device's GID: the link-local prefix and its HCA's 64-bit identity as the GUID.
    pub fn gid(&self) -> [u8; 16] {
        gid_of(self.hca.id)
    }

    /// Runs a command, writing the answer's status and syndrome into `out`.
    fn answer(
        &self,
        input: &[u8],
        out: &mut [u8],
        run: impl FnOnce(&Self, &[u8], &mut [u8]) -> Answer<u64>,
    ) -> Result<u64, DeviceError> {
        let op = command::opcode(input);
        let result = if out.len() < command::OUT_HEADER_BYTES {
            refuse(
                CmdStatus::BadOutputLen,
                FwSyndrome::ShortOutput,
                "output mailbox too short",
            )
        } else if input.len() < cmd_in::BYTES {
            refuse(
                CmdStatus::BadInputLen,
                FwSyndrome::ShortInput,
                "input mailbox too short",
            )
        } else {
            run(self, input, out)
        };
        match result {
            Ok(h) => {
                set(out, gdaki_layout::prm::layout::cmd_out::STATUS, 0);
                Ok(h)
            }
            Err(Refusal(status, syndrome, why)) => {
                command::fail(out, status, syndrome as u32);
                tracing::debug!(target: "gdaki::devx", command = %op, %status, ?syndrome, "soft firmware refuses: {why}");
                Err(DeviceError::Command {
                    error: CmdError {
                        opcode: op,
                        status,
                        syndrome: syndrome as u32,
                    },
                    detail: Some(why),
                })
            }
        }
    }

    fn need(input: &[u8], bytes: usize) -> Answer<()> {
        if input.len() < bytes {
            return refuse(
                CmdStatus::BadInputLen,
                FwSyndrome::ShortInput,
                format!("{} bytes, the command has {bytes}", input.len()),
            );
        }
        if get(input, cmd_in::OP_MOD) != 0 {
            return refuse(CmdStatus::BadParam, FwSyndrome::BadOpMod, "op_mod must be 0");
        }
        Ok(())
    }

    fn create_cq(&self, input: &[u8], out: &mut [u8]) -> Answer<u64> {
        Self::need(input, create_cq_in::BYTES)?;
        let c = |f: Bits| get(input, f.within(create_cq_in::CQ_CONTEXT));
        if get(input, create_cq_in::CQ_UMEM_VALID) != 1 || c(cqc::DBR_UMEM_VALID) != 1 {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::NotInUmem,
                "ring and record must be in umems",
            );
        }
        if c(cqc::CQE_SZ) != 0 || c(cqc::CQE_COMP_EN) != 0 {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::Unsupported,
                "only 64-byte CQEs, not compressed",
            );
        }
        let log_size = within_cap("log_cq_size", c(cqc::LOG_CQ_SIZE), general_caps().log_max_cq_sz)?;
        if c(cqc::C_EQN) != EQN as u64 {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::BadEqn,
                format!("no EQ {}", c(cqc::C_EQN)),
            );
        }
        let mut t = lock(&self.tables);
        if !t.uars.contains_key(&(c(cqc::UAR_PAGE) as u32)) {
            return refuse(CmdStatus::BadRes, FwSyndrome::UnknownUar, "no such UAR page");
        }
        let ring_umem = get(input, create_cq_in::CQ_UMEM_ID) as u32;
        let ring = t.window(ring_umem, get(input, create_cq_in::CQ_UMEM_OFFSET), 64 << log_size, 64)?;
        let dbr_umem = c(cqc::DBR_UMEM_ID) as u32;
        let dbrec = t.window(dbr_umem, c(cqc::DBR_ADDR), 8, 8)?;
        let cqn = self.alloc_number(&t)?;
        let (cc, oi) = (c(cqc::CC) == 1, c(cqc::OI) == 1);
        let cq = Arc::new(SoftCq::new(cqn, log_size, ring, dbrec, cc, oi));
        self.hca.attach_cq(&cq);
        t.hold(&[ring_umem, dbr_umem]);
        t.cqs.insert(
            cqn,
            CqEntry {
                cq,
                umems: [ring_umem, dbr_umem],
            },
        );
        set(out, gdaki_layout::prm::layout::cmd_out::OBJECT, cqn as u64);
        Ok(CQ_HANDLE | cqn as u64)
    }

    fn create_qp(&self, input: &[u8], out: &mut [u8]) -> Answer<u64> {
        Self::need(input, create_qp_in::BYTES)?;
        let q = |f: Bits| get(input, f.within(create_qp_in::QPC));
        let rq_type = q(qpc::RQ_TYPE) as u8;
        if q(qpc::ST) != QPC_ST_RC as u64 || ![QPC_RQ_TYPE_ZERO_LEN, recv::RQ_TYPE_REGULAR].contains(&rq_type) {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::Unsupported,
                "only RC QPs, with a regular or a zero-length receive queue",
            );
        }
        if q(qpc::TS_FORMAT) == command::QPC_TS_FORMAT_FREE_RUNNING as u64
            && roce_caps().qp_ts_format == command::TS_FORMAT_CAP_REAL_TIME
        {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::Unsupported,
                "timestamp format free-running: the device's clock is real-time only",
            );
        }
        // NO_DBR_INT (2) is for a DPA's own queues, 3 is reserved.
        let dbr_mode = q(qpc::SEND_DBR_MODE) as u8;
        if dbr_mode != command::QPC_SEND_DBR_MODE_DBR_VALID
            && !(dbr_mode == command::QPC_SEND_DBR_MODE_NO_DBR_EXT && general_caps_2().send_dbr_mode_no_dbr_ext)
        {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::Unsupported,
                format!("send_dbr_mode {dbr_mode}: only 0 (record) and 1 (no record, rung by software)"),
            );
        }
        if get(input, create_qp_in::WQ_UMEM_VALID) != 1 || q(qpc::DBR_UMEM_VALID) != 1 {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::NotInUmem,
                "queue and record must be in umems",
            );
        }
        let sq_log = within_cap("log_sq_size", q(qpc::LOG_SQ_SIZE), general_caps().log_max_qp_sz)?;
        // The receive queue's shape: at offset 0 of the work-queue buffer, the send queue after
        // it, so it must end on a send WQE's boundary.
        let rq_shape = if rq_type == recv::RQ_TYPE_REGULAR {
            let log_size = within_cap("log_rq_size", q(qpc::LOG_RQ_SIZE), general_caps().log_max_qp_sz)?;
            let log_stride = q(qpc::LOG_RQ_STRIDE) as u32;
            if 1usize << log_stride > recv::MAX_RECV_SGES {
                return refuse(
                    CmdStatus::BadParam,
                    FwSyndrome::AboveCap,
                    format!(
                        "log_rq_stride {log_stride}: receive WQEs of at most {} segments",
                        recv::MAX_RECV_SGES
                    ),
                );
            }
            if recv::queue_bytes(log_size, log_stride) % SEND_WQE_BB != 0 {
                return refuse(
                    CmdStatus::BadParam,
                    FwSyndrome::Misaligned,
                    "a receive queue smaller than a send WQE building block",
                );
            }
            Some((log_size, log_stride))
        } else {
            None
        };
        let rq_bytes = rq_shape.map_or(0, |(l, s)| recv::queue_bytes(l, s)) as u64;
        let mut t = lock(&self.tables);
        if !t.pds.contains(&(q(qpc::PD) as u32)) {
            return refuse(
                CmdStatus::BadRes,
                FwSyndrome::UnknownPd,
                format!("no PD {:#x}", q(qpc::PD)),
            );
        }
        let uar = q(qpc::UAR_PAGE) as u32;
        let doorbell = match t.uars.get(&uar) {
            None => return refuse(CmdStatus::BadRes, FwSyndrome::UnknownUar, format!("no UAR page {uar}")),
            Some((_, Some(other))) => {
                return refuse(
                    CmdStatus::ResBusy,
                    FwSyndrome::UarInUse,
                    format!("UAR page {uar} rings QP {other:#x}"),
                )
            }
            Some((page, None)) => Window::of(page.clone()),
        };
        let (snd, rcv) = (q(qpc::CQN_SND) as u32, q(qpc::CQN_RCV) as u32);
        let Some(cq) = t.cqs.get(&snd).map(|e| e.cq.clone()) else {
            return refuse(CmdStatus::BadRes, FwSyndrome::UnknownCq, format!("no CQ {snd:#x} here"));
        };
        let Some(rcv_cq) = t.cqs.get(&rcv).map(|e| e.cq.clone()) else {
            return refuse(CmdStatus::BadRes, FwSyndrome::UnknownCq, format!("no CQ {rcv:#x} here"));
        };
        // A receive CQ of its own: its CQEs are written in receive order, under the RQ's lock.
        if rq_shape.is_some() {
            let busy = match *lock(&rcv_cq.qpn) {
                Some(other) => Some(format!("CQ {rcv:#x} serves QP {other:#x}")),
                None if rcv == snd => Some(format!("CQ {rcv:#x} is also the send CQ")),
                None => None,
            };
            if let Some(why) = busy {
                return refuse(CmdStatus::ResBusy, FwSyndrome::CqInUse, why);
            }
        }
        if let Some(other) = *lock(&cq.qpn) {
            return refuse(
                CmdStatus::ResBusy,
                FwSyndrome::CqInUse,
                format!("CQ {snd:#x} serves QP {other:#x}"),
            );
        }
        let sq_umem = get(input, create_qp_in::WQ_UMEM_ID) as u32;
        let wq_offset = get(input, create_qp_in::WQ_UMEM_OFFSET);
        let Some(sq_offset) = wq_offset.checked_add(rq_bytes) else {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::UmemTooSmall,
                "work-queue offset overflows",
            );
        };
        let sq = t.window(sq_umem, sq_offset, 64 << sq_log, 64)?;
        let dbr_umem = q(qpc::DBR_UMEM_ID) as u32;
        // The send word is not read (the doorbell carries the same counter); the receive word
        // is how posters announce receives.
        let dbrec = t.window(dbr_umem, q(qpc::DBR_ADDR), 8, 8)?;
        let rq = match rq_shape {
            None => None,
            Some((log_size, log_stride)) => Some(SoftRq {
                log_size,
                log_stride,
                ring: t.window(sq_umem, wq_offset, rq_bytes as usize, 16)?,
                dbrec,
                cq: rcv_cq.clone(),
                taken: std::sync::Mutex::new(Default::default()),
            }),
        };
        let qpn = self.alloc_number(&t)?;
        let Some(secret) = gdaki_devx::util::random_secret() else {
            return refuse(
                CmdStatus::IntErr,
                FwSyndrome::Unsupported,
                "the OS random generator failed: no transport secret for the QP",
            );
        };
        let caps = general_caps();
        let qp = Arc::new(
            SoftQp::new(
                qpn,
                secret,
                q(qpc::PD) as u32,
                0,
                sq_log,
                sq,
                doorbell,
                cq.clone(),
                1 << caps.log_max_msg,
                Duration::from_secs(4),
                self.atomic_reply,
                rq,
            )
            .with_cd_master(q(qpc::CD_MASTER) == 1),
        );
        *lock(&cq.qpn) = Some(qpn);
        if rq_shape.is_some() {
            *lock(&rcv_cq.qpn) = Some(qpn);
        }
        t.hold(&[sq_umem, dbr_umem]);
        if let Some(u) = t.uars.get_mut(&uar) {
            u.1 = Some(qpn);
        }
        self.hca.attach(&qp);
        t.qps.insert(
            qpn,
            QpEntry {
                qp,
                umems: [sq_umem, dbr_umem],
                uar,
                remote: None,
            },
        );
        set(out, gdaki_layout::prm::layout::cmd_out::OBJECT, qpn as u64);
        Ok(QP_HANDLE | qpn as u64)
    }

    /// The QP a modify or query names, checked against the handle it came with.
    fn qp_of(&self, handle: u64, input: &[u8], field: Bits) -> Answer<Arc<SoftQp>> {
        let qpn = get(input, field) as u32;
        if handle != QP_HANDLE | qpn as u64 {
            return refuse(
                CmdStatus::BadRes,
                FwSyndrome::UnknownObject,
                format!("QP {qpn:#x} is not the object modified"),
            );
        }
        match lock(&self.tables).qps.get(&qpn) {
            Some(e) => Ok(e.qp.clone()),
            None => refuse(CmdStatus::BadRes, FwSyndrome::UnknownObject, format!("no QP {qpn:#x}")),
        }
    }

    fn transition(qp: &SoftQp, from: QpState, to: QpState) -> Answer<()> {
        let now = qp.state();
        if now != from {
            return refuse(
                CmdStatus::BadQpState,
                FwSyndrome::BadState,
                format!("QP {:#x} is {now}, not {from} (to {to})", qp.qpn),
            );
        }
        Ok(())
    }

    fn modify(&self, handle: u64, input: &[u8]) -> Answer<u64> {
        let op = command::opcode(input);
        if matches!(op, Opcode::Qp2Err | Opcode::Qp2Rst) {
            Self::need(input, object_in::BYTES)?;
            let qp = self.qp_of(handle, input, object_in::OBJECT)?;
            if op == Opcode::Qp2Err {
                qp.fail(Syndrome::WrFlush);
                return Ok(handle);
            }
            // 2RST from any state: the send queue starts again at WQE 0, as a NIC's hardware
            // counter does; the CQs keep their places. WQEs still outstanding are dropped
            // without CQEs (the library drains the QP first). The engine's progress is reset
            // under its lock, so no WQE of the old queue executes after this.
            let served = self.hca.served(&qp);
            let mut progress = served.as_ref().map(|s| lock(&s.progress));
            let old = progress.as_deref_mut().map(std::mem::take);
            qp.reset();
            drop(progress);
            // The old link (a remote peer's connection) closes outside the engine's lock.
            drop(old);
            return Ok(handle);
        }
        Self::need(input, modify_qp_in::BYTES)?;
        let qp = self.qp_of(handle, input, modify_qp_in::QPN)?;
        let q = |f: Bits| get(input, f.within(modify_qp_in::QPC));
        let path = |f: Bits| q(f.within(qpc::PRIMARY_ADDRESS_PATH));
        match op {
            Opcode::Rst2InitQp => {
                Self::transition(&qp, QpState::Reset, QpState::Init)?;
                if path(ads::VHCA_PORT_NUM) != PORT as u64 {
                    return refuse(
                        CmdStatus::BadParam,
                        FwSyndrome::BadPort,
                        "the soft device has port 1 only",
                    );
                }
                // As a ConnectX without extended atomics refuses mode 3: only what the atomic
                // capabilities report (IB-spec atomics here).
                let mode = q(qpc::ATOMIC_MODE) as u8;
                let most = self.atomic_caps().qp_atomic_mode().unwrap_or(0);
                if q(qpc::RAE) == 1 && mode > most {
                    return refuse(
                        CmdStatus::BadParam,
                        FwSyndrome::BadAtomicMode,
                        format!("atomic mode {mode}: the device does IB-spec atomics (mode {most}) only"),
                    );
                }
                qp.set_state(QpState::Init);
            }
            Opcode::Init2RtrQp => {
                Self::transition(&qp, QpState::Init, QpState::Rtr)?;
                let mtu = q(qpc::MTU) as u8;
                if !(1..=5).contains(&mtu) {
                    return refuse(CmdStatus::BadParam, FwSyndrome::BadMtu, format!("MTU code {mtu}"));
                }
                let log_msg = q(qpc::LOG_MSG_MAX) as u32;
                if log_msg > general_caps().log_max_msg as u32 {
                    return refuse(
                        CmdStatus::BadParam,
                        FwSyndrome::AboveCap,
                        format!("log_msg_max {log_msg}"),
                    );
                }
                qp.set_max_msg_size(1 << log_msg);
                qp.set_min_rnr_nak(q(qpc::MIN_RNR_NAK) as u8);
                let gid = get_bytes::<16>(
                    input,
                    ads::RGID_RIP
                        .within(qpc::PRIMARY_ADDRESS_PATH)
                        .within(modify_qp_in::QPC),
                );
                let mut t = lock(&self.tables);
                let addr = t.neighbours.get(&gid).copied();
                let remote_qpn = q(qpc::REMOTE_QPN) as u32;
                let secret = t.secrets.remove(&(gid, remote_qpn)).unwrap_or(0);
                if let Some(e) = t.qps.get_mut(&qp.qpn) {
                    e.remote = Some(Remote {
                        gid,
                        qpn: remote_qpn,
                        addr,
                        secret,
                    });
                }
                // A new peer: its one transport connection may come.
                qp.transport_bound.store(false, std::sync::atomic::Ordering::Release);
                *lock(&qp.rtr_peer) = Some(RtrPeer {
                    qpn: remote_qpn,
                    psn: q(qpc::NEXT_RCV_PSN) as u32,
                    ip: addr.map(|a| a.ip()),
                });
                qp.set_state(QpState::Rtr);
            }
            Opcode::Rtr2RtsQp => {
                Self::transition(&qp, QpState::Rtr, QpState::Rts)?;
                // IB's local ACK timeout: 4.096 µs · 2^ack_timeout per try, retry_count + 1 tries.
                let per_try = Duration::from_nanos(4096u64 << path(ads::ACK_TIMEOUT).min(31));
                let retry = per_try * (q(qpc::RETRY_COUNT) as u32 + 1);
                let remote = lock(&self.tables).qps.get(&qp.qpn).and_then(|e| e.remote);
                let Some(remote) = remote else {
                    return refuse(CmdStatus::BadQpState, FwSyndrome::BadState, "no peer: INIT2RTR first");
                };
                let Some(served) = self.hca.served(&qp) else {
                    return refuse(
                        CmdStatus::BadQpState,
                        FwSyndrome::BadState,
                        "the engine does not serve this QP",
                    );
                };
                // The transport's hello carries the PSN; a refused connect restores the old one.
                let before = (qp.psn(), qp.retry_timeout());
                qp.set_send_params(q(qpc::NEXT_SEND_PSN) as u32, retry);
                qp.set_log_sra_max(q(qpc::LOG_SRA_MAX) as u8);
                qp.set_rnr_retry(q(qpc::RNR_RETRY) as u8);
                let peer = self
                    .connect(&qp, remote)
                    .inspect_err(|_| qp.set_send_params(before.0, before.1))?;
                lock(&served.progress).peer = Some(peer);
                qp.set_state(QpState::Rts);
            }
            other => {
                return refuse(
                    CmdStatus::BadOp,
                    FwSyndrome::Unsupported,
                    format!("{other} is not a modify"),
                )
            }
        }
        Ok(handle)
    }

    /// Connects `qp` to `remote`: in this process directly, elsewhere through the transport
    /// address [`Device::resolve`] learnt for its GID.
    fn connect(&self, qp: &Arc<SoftQp>, remote: Remote) -> Answer<Peer> {
        let Remote {
            gid,
            qpn: remote_qpn,
            addr,
            secret,
        } = remote;
        let guid = u64::from_be_bytes(gid[8..].try_into().unwrap_or_default());
        if let Some(hca) = Hca::find(guid) {
            return match hca.qp(remote_qpn) {
                Some(target) => Ok(Peer::Local {
                    hca: Arc::downgrade(&hca),
                    qp: Arc::downgrade(&target),
                }),
                None => refuse(
                    CmdStatus::BadParam,
                    FwSyndrome::PeerUnreachable,
                    format!("no QP {remote_qpn:#x} on HCA {guid:#x}"),
                ),
            };
        }
        let Some(addr) = addr else {
            return refuse(
                CmdStatus::BadParam,
                FwSyndrome::PeerUnreachable,
                format!("HCA {guid:#x} is not in this process and has no known address"),
            );
        };
        crate::net::Link::connect(&self.hca, qp, remote_qpn, secret, addr)
            .map(Peer::Remote)
            .or_else(|e| refuse(CmdStatus::BadParam, FwSyndrome::PeerUnreachable, e.to_string()))
    }

    /// A QP or CQ number no live QP or CQ of this device has.
    fn alloc_number(&self, t: &Tables) -> Answer<u32> {
        match self
            .hca
            .alloc_number(|n| t.qps.contains_key(&n) || t.cqs.contains_key(&n))
        {
            Some(n) => Ok(n),
            None => refuse(
                CmdStatus::ExceedLim,
                FwSyndrome::AboveCap,
                "every 24-bit QP and CQ number is in use",
            ),
        }
    }

    fn query(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Answer<u64> {
        Self::need(input, object_in::BYTES)?;
        match command::opcode(input) {
            Opcode::QueryQp => {}
            Opcode::QueryCq => return self.query_cq(handle, input, out),
            other => {
                return refuse(
                    CmdStatus::BadOp,
                    FwSyndrome::Unsupported,
                    format!("{other} is not a query"),
                )
            }
        }
        if out.len() < query_qp_out::BYTES {
            return refuse(
                CmdStatus::BadOutputLen,
                FwSyndrome::ShortOutput,
                "QUERY_QP answers 272 bytes",
            );
        }
        let qp = self.qp_of(handle, input, object_in::OBJECT)?;
        let o = |f: Bits| f.within(query_qp_out::QPC);
        set(out, o(qpc::STATE), qp.state().to_qpc() as u64);
        set(out, o(qpc::ST), QPC_ST_RC as u64);
        set(out, o(qpc::LOG_SQ_SIZE), qp.sq_log as u64);
        set(out, o(qpc::CQN_SND), qp.cq.cqn as u64);
        set(out, o(qpc::NEXT_SEND_PSN), qp.psn() as u64);
        let fetched = self.hca.served(&qp).map_or(0, |s| lock(&s.progress).ci);
        set(out, o(qpc::HW_SQ_WQEBB_COUNTER), fetched & 0xffff);
        if let Some(remote) = lock(&self.tables).qps.get(&qp.qpn).and_then(|e| e.remote) {
            set(out, o(qpc::REMOTE_QPN), remote.qpn as u64);
        }
        Ok(handle)
    }

    fn query_cq(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Answer<u64> {
        if out.len() < query_cq_out::BYTES {
            return refuse(
                CmdStatus::BadOutputLen,
                FwSyndrome::ShortOutput,
                "QUERY_CQ answers 272 bytes",
            );
        }
        let cqn = get(input, object_in::OBJECT) as u32;
        if handle != CQ_HANDLE | cqn as u64 {
            return refuse(
                CmdStatus::BadRes,
                FwSyndrome::UnknownObject,
                format!("CQ {cqn:#x} is not the object queried"),
            );
        }
        let Some(cq) = lock(&self.tables).cqs.get(&cqn).map(|e| e.cq.clone()) else {
            return refuse(CmdStatus::BadRes, FwSyndrome::UnknownObject, format!("no CQ {cqn:#x}"));
        };
        let o = |f: Bits| f.within(query_cq_out::CQ_CONTEXT);
        let status = if cq.overrun.load(Ordering::Acquire) {
            CQC_STATUS_OVERFLOW
        } else {
            CQC_STATUS_OK
        };
        set(out, o(cqc::STATUS), status as u64);
        set(out, o(cqc::LOG_CQ_SIZE), cq.log_size as u64);
        set(out, o(cqc::C_EQN), EQN as u64);
        set(out, o(cqc::PRODUCER_COUNTER), cq.pi.load(Ordering::Acquire) & 0xff_ffff);
        set(
            out,
            o(cqc::CONSUMER_COUNTER),
            cq.ci_seen.load(Ordering::Acquire) as u64 & 0xff_ffff,
        );
        Ok(handle)
    }

    fn destroy(&self, handle: u64) -> Answer<()> {
        let number = (handle & 0xff_ffff) as u32;
        let mut t = lock(&self.tables);
        match handle & !0xff_ffff {
            CQ_HANDLE => {
                let Some(e) = t.cqs.get(&number) else {
                    return refuse(
                        CmdStatus::BadRes,
                        FwSyndrome::UnknownObject,
                        format!("no CQ {number:#x}"),
                    );
                };
                if let Some(qpn) = *lock(&e.cq.qpn) {
                    return refuse(
                        CmdStatus::BadResState,
                        FwSyndrome::CqInUse,
                        format!("CQ {number:#x} serves QP {qpn:#x}"),
                    );
                }
                let e = t.cqs.remove(&number).expect("looked up above");
                self.hca.detach_cq(number);
                t.release(&e.umems);
            }
            QP_HANDLE => {
                let Some(e) = t.qps.remove(&number) else {
                    return refuse(
                        CmdStatus::BadRes,
                        FwSyndrome::UnknownObject,
                        format!("no QP {number:#x}"),
                    );
                };
                self.hca.detach(&e.qp);
                *lock(&e.qp.cq.qpn) = None;
                if let Some(rq) = &e.qp.rq {
                    *lock(&rq.cq.qpn) = None;
                }
                if let Some(u) = t.uars.get_mut(&e.uar) {
                    u.1 = None;
                }
                t.release(&e.umems);
            }
            _ => {
                return refuse(
                    CmdStatus::BadRes,
                    FwSyndrome::UnknownObject,
                    format!("no object {handle:#x}"),
                )
            }
        }
        Ok(())
    }
}

impl Tables {
    /// Counts an object's umems as used (a used umem cannot be deregistered).
    fn hold(&mut self, umems: &[u32]) {
        for u in umems {
            if let Some(e) = self.umems.get_mut(u) {
                e.users += 1;
            }
        }
    }

    /// Undoes [`hold`](Self::hold).
    fn release(&mut self, umems: &[u32]) {
        for u in umems {
            if let Some(e) = self.umems.get_mut(u) {
                e.users = e.users.saturating_sub(1);
            }
        }
    }
}

/// The GID of the soft HCA with identity `guid`: `fe80::` and the GUID, as IB forms a port's
/// default GID from its subnet prefix and GUID.
pub(crate) fn gid_of(guid: u64) -> [u8; 16] {
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[1] = 0x80;
    gid[8..].copy_from_slice(&guid.to_be_bytes());
    gid
}

impl Device for SoftDevice {
    fn general_cmd(&self, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
        self.answer(input, out, |_, input, out| {
            if command::opcode(input) != Opcode::QueryHcaCap {
                return refuse(
                    CmdStatus::BadOp,
                    FwSyndrome::Unsupported,
                    format!("{} is not a general command here", command::opcode(input)),
                );
            }
            if out.len() < command::QUERY_HCA_CAP_OUT_BYTES {
                return refuse(
                    CmdStatus::BadOutputLen,
                    FwSyndrome::ShortOutput,
                    "QUERY_HCA_CAP answers 4112 bytes",
                );
            }
            match command::cap_query(get(input, cmd_in::OP_MOD) as u16) {
                (0, _) => general_caps().encode(out),
                (3, _) => self.atomic_caps().encode(out),
                (4, _) => roce_caps().encode(out),
                (0x20, _) => general_caps_2().encode(out),
                (kind, _) => {
                    return refuse(
                        CmdStatus::BadParam,
                        FwSyndrome::UnknownCap,
                        format!("capability type {kind}"),
                    )
                }
            }
            Ok(0)
        })
        .map(drop)
    }

    fn alloc_pd(&self) -> Result<u32, DeviceError> {
        let mut t = lock(&self.tables);
        let pd = t.id() & 0xff_ffff;
        t.pds.insert(pd);
        Ok(pd)
    }

    fn dealloc_pd(&self, pd: u32) -> Result<(), DeviceError> {
        let what = "giving a protection domain back";
        let mut t = lock(&self.tables);
        if !t.pds.contains(&pd) {
            return Err(DeviceError::Call {
                what,
                why: format!("no protection domain {pd:#x}"),
            });
        }
        // As ibv_dealloc_pd: refused while something of it is alive.
        let qps = t.qps.values().filter(|e| e.qp.pd == pd).count();
        let regions = self.hca.regions_in(pd);
        if qps + regions > 0 {
            return Err(DeviceError::Call {
                what,
                why: format!("protection domain {pd:#x} still has {qps} queue pairs and {regions} regions"),
            });
        }
        t.pds.remove(&pd);
        Ok(())
    }

    fn alloc_uar(&self) -> Result<Uar, DeviceError> {
        let page = HostBuffer::new("a doorbell page", 64).map_err(|e| DeviceError::Call {
            what: "allocating a UAR page",
            why: e.to_string(),
        })?;
        let mut t = lock(&self.tables);
        let index = t.id();
        let uar = Uar {
            page: index,
            base: page.addr(),
            reg_offset: 0,
            // One word rings a QP here, with a record or without.
            dbr_less_offset: 0,
            size: page.size(),
            io: false,
        };
        t.uars.insert(index, (Arc::new(page), None));
        Ok(uar)
    }

    fn free_uar(&self, uar: &Uar) {
        lock(&self.tables).uars.remove(&uar.page);
    }

    fn query_eqn(&self) -> Result<u32, DeviceError> {
        Ok(EQN)
    }

    fn umem_reg(&self, mem: &Memory) -> Result<u32, DeviceError> {
        let what = "registering a umem";
        // The engine reads rings and records with the CPU, through memory the umem keeps alive.
        if let MemoryKind::Gpu(_) = mem.kind() {
            return Err(DeviceError::Call {
                what,
                why: "the soft device reads queues with the CPU: place rings in host memory (Rings::Host; perftests: --rings host)".into(),
            });
        }
        let Some(keep) = mem.keep().cloned() else {
            return Err(DeviceError::Call {
                what,
                why: "the soft device holds a umem's memory while queues use it; none was given".into(),
            });
        };
        let mut t = lock(&self.tables);
        let id = t.id();
        t.umems.insert(
            id,
            UmemEntry {
                addr: mem.addr(),
                len: mem.len(),
                keep,
                users: 0,
            },
        );
        Ok(id)
    }

    fn umem_dereg(&self, id: u32) -> Result<(), DeviceError> {
        let mut t = lock(&self.tables);
        match t.umems.get(&id) {
            None => Err(DeviceError::Call {
                what: "deregistering a umem",
                why: format!("no umem {id:#x}"),
            }),
            Some(e) if e.users > 0 => Err(DeviceError::Call {
                what: "deregistering a umem",
                why: format!("umem {id:#x} holds the queues of {} objects", e.users),
            }),
            Some(_) => {
                t.umems.remove(&id);
                Ok(())
            }
        }
    }

    fn obj_create(&self, input: &[u8], out: &mut [u8]) -> Result<u64, DeviceError> {
        self.answer(input, out, |d, input, out| match command::opcode(input) {
            Opcode::CreateCq => d.create_cq(input, out),
            Opcode::CreateQp => d.create_qp(input, out),
            other => refuse(
                CmdStatus::BadOp,
                FwSyndrome::Unsupported,
                format!("{other} creates nothing here"),
            ),
        })
    }

    fn obj_modify(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
        self.answer(input, out, |d, input, _| d.modify(handle, input)).map(drop)
    }

    fn obj_query(&self, handle: u64, input: &[u8], out: &mut [u8]) -> Result<(), DeviceError> {
        self.answer(input, out, |d, input, out| d.query(handle, input, out))
            .map(drop)
    }

    fn obj_destroy(&self, handle: u64) -> Result<(), DeviceError> {
        let op = if handle & !0xff_ffff == CQ_HANDLE {
            Opcode::DestroyCq
        } else {
            Opcode::DestroyQp
        };
        let input = command::object_command(op, (handle & 0xff_ffff) as u32);
        let mut out = [0u8; command::OUT_HEADER_BYTES];
        self.answer(&input, &mut out, |d, _, _| d.destroy(handle).map(|()| 0))
            .map(drop)
    }

    fn query_port(&self) -> Result<Port, DeviceError> {
        Ok(Port {
            number: PORT,
            gid: self.gid(),
            gid_index: 0,
            lid: 0,
            link: LinkLayer::Ethernet,
            mtu: 4096,
        })
    }

    fn reg_mr(&self, pd: u32, mem: &Memory, access: Access) -> Result<Mr, DeviceError> {
        let what = "registering a memory region";
        if !lock(&self.tables).pds.contains(&pd) {
            return Err(DeviceError::Call {
                what,
                why: format!("no protection domain {pd:#x}"),
            });
        }
        let (dma, keep): (Arc<dyn Dma>, _) = match mem.kind() {
            MemoryKind::Host { gpu_mapped } => (Arc::new(HostDma { mapped: *gpu_mapped }), mem.keep().cloned()),
            MemoryKind::Gpu(gpu) => {
                // The engine moves device memory with the GPU's copier kernel (started with the
                // first such region).
                let copier = Copier::of(gpu).map_err(|e| DeviceError::Call {
                    what: "starting the GPU copier",
                    why: e.to_string(),
                })?;
                let dma = Arc::new(DeviceDma::new(copier, mem.addr(), mem.len()));
                // The region holds the copier too, so its last reference is never dropped on
                // an HCA thread (stopping it waits for kernels): see `soft::Keep`.
                let keep: Arc<dyn Send + Sync> = Arc::new((mem.keep().cloned(), dma.clone()));
                (dma, Some(keep))
            }
        };
        let key = self
            .hca
            .register(pd, mem.addr(), mem.len(), access, dma, keep)
            .map_err(|e| DeviceError::Call {
                what,
                why: e.to_string(),
            })?;
        Ok(Mr {
            handle: key as u64,
            lkey: key,
            rkey: key,
        })
    }

    fn dereg_mr(&self, mr: &Mr) -> Result<(), DeviceError> {
        self.hca.release(mr.lkey);
        Ok(())
    }

    fn name(&self) -> String {
        "soft".into()
    }

    fn listen(&self, bind: SocketAddr) -> Result<Option<SocketAddr>, DeviceError> {
        crate::net::listen(&self.hca, bind).map(Some).map_err(|e| match e {
            crate::error::Error::Io { what, source } => DeviceError::Call {
                what,
                why: source.to_string(),
            },
            other => DeviceError::Call {
                what: "the soft HCA's transport",
                why: other.to_string(),
            },
        })
    }

    fn transport_addr(&self) -> Option<SocketAddr> {
        self.hca.listen_addr()
    }

    fn transport_secret(&self, qpn: u32) -> u64 {
        self.hca.qp(qpn).map_or(0, |qp| qp.secret)
    }

    fn resolve(&self, peer: &Endpoint) -> Result<AddressPath, DeviceError> {
        let mut t = lock(&self.tables);
        if let Some(addr) = peer.addr {
            t.neighbours.insert(peer.gid, addr);
        }
        if peer.secret != 0 {
            t.secrets.insert((peer.gid, peer.qpn), peer.secret);
        }
        drop(t);
        Ok(AddressPath {
            port: PORT,
            grh: true,
            rgid: peer.gid,
            hop_limit: 64,
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use gdaki_layout::prm::command::{CreateCq, CreateQp, Init2Rtr, QpcState, Rst2Init, Rtr2Rts};
    use gdaki_layout::{cqe, DevCq, DevQp};

    use super::*;
    use gdaki_devx::Access;
    use gdaki_devx::{Devx, Object};

    /// A served soft device and a second firmware over its HCA (served by the first's engine).
    fn rig() -> (Arc<SoftDevice>, Devx, Arc<SoftDevice>) {
        let served = SoftDevice::served();
        let dev = Arc::new(SoftDevice::new(served.hca().clone(), AtomicReplyOrder::BigEndian));
        (served, Devx::new(dev.clone()), dev)
    }

    /// An endpoint naming the device with `gid` (resolve reads the GID and the address).
    fn at(gid: [u8; 16]) -> Endpoint {
        Endpoint {
            gid,
            lid: 0,
            qpn: 0,
            psn: 0,
            mtu: 4096,
            secret: 0,
            rd_atomic: 0,
            addr: None,
        }
    }

    fn umem(dev: &Devx, bytes: usize) -> (Arc<HostBuffer>, u32) {
        let buf = Arc::new(HostBuffer::new("test umem", bytes).unwrap());
        // SAFETY: the whole buffer, which `keep` holds.
        let mem = unsafe {
            Memory::new(
                buf.addr(),
                bytes as u64,
                MemoryKind::Host { gpu_mapped: false },
                Some(buf.clone()),
            )
        };
        let id = dev.device().umem_reg(&mem).unwrap();
        (buf, id)
    }

    struct Queues {
        cq: Object,
        qp: Object,
        cq_ring: Arc<HostBuffer>,
        sq: Arc<HostBuffer>,
        uar: Uar,
        log: u8,
    }

    /// CQ and QP of `2^log` entries, the CQ ring with the records after it in one umem, as
    /// DOCA lays them out.
    fn queues(dev: &Devx, log: u8, pd: u32) -> Queues {
        let d = dev.device();
        let uar = d.alloc_uar().unwrap();
        let cq_bytes = 64usize << log;
        let (cq_ring, cq_umem) = umem(dev, cq_bytes + 64);
        for i in 0..1usize << log {
            // SAFETY: byte 63 of entry i lies inside the ring.
            unsafe { cq_ring.as_ptr().add(64 * i + 63).write(cqe::OP_OWN_INIT) };
        }
        let cq = dev
            .create(
                &CreateCq {
                    log_size: log,
                    uar_page: uar.page,
                    eqn: d.query_eqn().unwrap(),
                    umem_id: cq_umem,
                    dbr_umem_id: cq_umem,
                    dbr_offset: cq_bytes as u64,
                    ..Default::default()
                }
                .encode(),
            )
            .unwrap();
        let (sq, sq_umem) = umem(dev, (64 << log) + 64);
        let qp = dev
            .create(
                &CreateQp {
                    pd,
                    uar_page: uar.page,
                    cqn_snd: cq.number,
                    cqn_rcv: cq.number,
                    log_sq_size: log,
                    umem_id: sq_umem,
                    dbr_umem_id: sq_umem,
                    dbr_offset: 64 << log,
                    ts_format: command::QPC_TS_FORMAT_DEFAULT,
                    ..Default::default()
                }
                .encode(),
            )
            .unwrap();
        Queues {
            cq,
            qp,
            cq_ring,
            sq,
            uar,
            log,
        }
    }

    fn to_rts(dev: &Devx, soft: &SoftDevice, q: &Queues, psn: u32) -> Result<(), DeviceError> {
        let qpn = q.qp.number;
        dev.modify(
            &q.qp,
            &Rst2Init {
                qpn,
                port: 1,
                remote_read: true,
                remote_write: true,
                remote_atomic: true,
                ..Default::default()
            }
            .encode(),
        )?;
        let path = dev.device().resolve(&at(soft.gid()))?;
        dev.modify(
            &q.qp,
            &Init2Rtr {
                qpn,
                mtu: 5,
                log_msg_max: 30,
                remote_qpn: qpn,
                next_rcv_psn: psn,
                path,
                ..Default::default()
            }
            .encode(),
        )?;
        dev.modify(
            &q.qp,
            &Rtr2Rts {
                qpn,
                next_send_psn: psn,
                retry_count: 7,
                rnr_retry: 7,
                ack_timeout: 14,
                ..Default::default()
            }
            .encode(),
        )
    }

    fn state(dev: &Devx, q: &Queues) -> u64 {
        let out = dev
            .query(
                &q.qp,
                &command::object_command(Opcode::QueryQp, q.qp.number),
                query_qp_out::BYTES,
            )
            .unwrap();
        get(&out, qpc::STATE.within(query_qp_out::QPC))
    }

    /// A device-side poster for `q` (one thread), with the page holding its handle.
    fn poster(q: &Queues) -> (HostBuffer, gdaki_device::Qp<gdaki_device::Exclusive>) {
        let dev_qp = DevQp {
            sq_base: q.sq.addr(),
            sq_dbrec: q.sq.addr() + (64 << q.log) + 4,
            doorbell: q.uar.reg_addr(),
            max_msg_size: 1 << 30,
            timeout_ns: 5_000_000_000,
            qpn: q.qp.number,
            version: gdaki_layout::handle::DEV_QP_VERSION,
            sq_log_size: q.log as u32,
            cq: DevCq {
                cqe_base: q.cq_ring.addr(),
                dbrec: q.cq_ring.addr() + (64 << q.log),
                cqn: q.cq.number,
                log_size: q.log as u32,
                ..bytemuck::Zeroable::zeroed()
            },
            ..bytemuck::Zeroable::zeroed()
        };
        let handle = HostBuffer::new("handle", std::mem::size_of::<DevQp>()).unwrap();
        // SAFETY: the buffer is DevQp-sized and page-aligned.
        unsafe { (handle.as_ptr() as *mut DevQp).write(dev_qp) };
        // SAFETY: the tests keep the handle page and the queues it names until they are done
        // with the poster, and post from one thread.
        let post = unsafe { gdaki_device::Qp::from_raw(handle.as_ptr() as *mut DevQp) };
        (handle, post)
    }

    /// 4 KiB of host memory, and its description for the device (which keeps it alive).
    fn host_page() -> (Arc<HostBuffer>, Memory) {
        let buf = Arc::new(HostBuffer::new("test region", 4096).unwrap());
        // SAFETY: the whole buffer, which `keep` holds.
        let mem = unsafe {
            Memory::new(
                buf.addr(),
                4096,
                MemoryKind::Host { gpu_mapped: false },
                Some(buf.clone()),
            )
        };
        (buf, mem)
    }

    /// 4 KiB of host memory registered in `pd` with every right.
    fn region_in(d: &dyn Device, pd: u32) -> (Arc<HostBuffer>, Mr) {
        let (buf, mem) = host_page();
        let mr = d.reg_mr(pd, &mem, Access::ALL).unwrap();
        (buf, mr)
    }

    /// The whole DevX sequence on the soft device, then a put through the queues it made.
    #[test]
    fn queues_made_by_devx_commands_carry_a_put() {
        let (_ctx, dev, soft) = rig();
        let caps = dev.query_caps().unwrap();
        assert_eq!((caps.general.cqe_version, caps.general.atomic), (1, true));
        assert_eq!(caps.atomic.reply_mode, 0);
        let pd = dev.device().alloc_pd().unwrap();
        let q = queues(&dev, 6, pd);
        assert_eq!(state(&dev, &q), QpcState::Reset as u64);
        to_rts(&dev, &soft, &q, 0x1234).unwrap();
        assert_eq!(state(&dev, &q), QpcState::Rts as u64);

        let ((src, smr), (dst, dmr)) = (region_in(dev.device(), pd), region_in(dev.device(), pd));
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 5) as u8).collect();
        // SAFETY: 4096 bytes of a live buffer, not shared yet.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), src.as_ptr(), 4096) };
        let (_handle, post) = poster(&q);
        let (from, to) = (
            gdaki_device::Local {
                addr: src.addr(),
                lkey: smr.lkey,
            },
            gdaki_device::Remote {
                addr: dst.addr(),
                rkey: dmr.rkey,
            },
        );
        let t = post.put(to, from, 4096).unwrap();
        post.wait(t).unwrap();
        // SAFETY: the put completed: nothing writes the buffer any more.
        let got = unsafe { std::slice::from_raw_parts(dst.as_ptr(), 4096) };
        assert_eq!(got, data);

        // Destroy in order: the QP, then its CQ, then the umems are free.
        assert!(matches!(
            dev.destroy(&q.cq),
            Err(DeviceError::Command { error, .. }) if error.status == CmdStatus::BadResState
        ));
        dev.destroy(&q.qp).unwrap();
        dev.destroy(&q.cq).unwrap();
        assert!(soft.hca.qp(q.qp.number).is_none(), "the engine no longer serves it");
        assert!(lock(&soft.tables).umems.values().all(|u| u.users == 0));
    }

    /// An lkey or rkey works only on queue pairs of its protection domain, as on RC: a key of
    /// another PD is a local protection error at the requester and a remote access error at
    /// the responder, which then goes to error.
    #[test]
    fn keys_work_only_on_queue_pairs_of_their_protection_domain() {
        let (_ctx, dev, soft) = rig();
        let d = dev.device();
        let (pd, other) = (d.alloc_pd().unwrap(), d.alloc_pd().unwrap());
        assert_ne!(pd, other);
        let ((mine, mine_mr), (theirs, theirs_mr)) = (region_in(d, pd), region_in(d, other));
        let local = |b: &HostBuffer, mr: &Mr| gdaki_device::Local {
            addr: b.addr(),
            lkey: mr.lkey,
        };
        let remote = |b: &HostBuffer, mr: &Mr| gdaki_device::Remote {
            addr: b.addr(),
            rkey: mr.rkey,
        };
        let syndrome = |r: Result<(), gdaki_device::WaitError>| match r {
            Err(gdaki_device::WaitError::Cqe(e)) => e.syndrome,
            other => panic!("expected an error CQE, got {other:?}"),
        };
        // The QP is its own peer, in `pd`.
        let q = queues(&dev, 4, pd);
        to_rts(&dev, &soft, &q, 1).unwrap();
        let (_handle, post) = poster(&q);
        let t = post
            .put(remote(&mine, &mine_mr), local(&theirs, &theirs_mr), 8)
            .unwrap();
        assert_eq!(syndrome(post.wait(t)), Syndrome::LocalProt, "a local key of another PD");
        let q = queues(&dev, 4, pd);
        to_rts(&dev, &soft, &q, 1).unwrap();
        let (_handle, post) = poster(&q);
        // SAFETY: 8 bytes of a live buffer nothing else writes.
        unsafe { theirs.as_ptr().write_bytes(0x5a, 8) };
        let t = post
            .put(remote(&theirs, &theirs_mr), local(&mine, &mine_mr), 8)
            .unwrap();
        assert_eq!(
            syndrome(post.wait(t)),
            Syndrome::RemoteAccess,
            "a remote key of another PD"
        );
        // SAFETY: as above.
        assert_eq!(unsafe { std::slice::from_raw_parts(theirs.as_ptr(), 8) }, [0x5a; 8]);
        assert_eq!(state(&dev, &q), QpcState::Err as u64, "the responder went to error");
        // Within its own PD the same QP kind works.
        let q = queues(&dev, 4, pd);
        to_rts(&dev, &soft, &q, 1).unwrap();
        let (_handle, post) = poster(&q);
        let t = post.put(remote(&mine, &mine_mr), local(&mine, &mine_mr), 8).unwrap();
        post.wait(t).unwrap();
    }

    fn refused(r: Result<impl std::fmt::Debug, DeviceError>) -> (CmdStatus, u32) {
        match r {
            Err(DeviceError::Command { error, detail }) => {
                assert!(detail.is_some());
                (error.status, error.syndrome)
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// Regions are registered through the device like everything else: in a PD the device
    /// gave out, and a umem the engine cannot read with the CPU is refused.
    #[test]
    fn regions_and_umems_go_through_the_device_and_bad_ones_are_refused() {
        let (_ctx, dev, _soft) = rig();
        let d = dev.device();
        let pd = d.alloc_pd().unwrap();
        let (_buf, mem) = host_page();
        let mr = d.reg_mr(pd, &mem, Access::ALL).unwrap();
        assert_eq!(mr.lkey, mr.rkey);
        assert!(
            d.reg_mr(pd, &mem, Access::ALL).unwrap().lkey != mr.lkey,
            "keys are fresh"
        );
        let err = d.reg_mr(pd ^ 0x77, &mem, Access::ALL).unwrap_err();
        assert!(err.to_string().contains("no protection domain"), "{err}");
        d.dereg_mr(&mr).unwrap();
        // A umem with nothing keeping its memory alive.
        // SAFETY: `buf` outlives the attempt, which is refused anyway.
        let unkept = unsafe { Memory::new(mem.addr(), mem.len(), mem.kind().clone(), None) };
        let err = d.umem_reg(&unkept).unwrap_err();
        assert!(err.to_string().contains("none was given"), "{err}");
    }

    #[test]
    fn the_firmware_refuses_bad_commands_and_creates_nothing() {
        let (_ctx, dev, soft) = rig();
        let d = dev.device();
        let uar = d.alloc_uar().unwrap();
        let (_ring, ring_umem) = umem(&dev, 4096);
        let good = CreateCq {
            log_size: 6,
            uar_page: uar.page,
            umem_id: ring_umem,
            dbr_umem_id: ring_umem,
            dbr_offset: 64 << 6,
            ..Default::default()
        };
        let sy = |s: FwSyndrome| s as u32;
        // Unknown opcode.
        let mut bad = good.encode();
        set(&mut bad, cmd_in::OPCODE, 0x999);
        assert_eq!(
            refused(dev.create(&bad)),
            (CmdStatus::BadOp, sy(FwSyndrome::Unsupported))
        );
        // Bad op_mod.
        let mut bad = good.encode();
        set(&mut bad, cmd_in::OP_MOD, 1);
        assert_eq!(
            refused(dev.create(&bad)),
            (CmdStatus::BadParam, sy(FwSyndrome::BadOpMod))
        );
        // Short mailbox.
        assert_eq!(
            refused(dev.create(&good.encode()[..100])),
            (CmdStatus::BadInputLen, sy(FwSyndrome::ShortInput))
        );
        // A size above the caps.
        let big = CreateCq { log_size: 23, ..good };
        assert_eq!(
            refused(dev.create(&big.encode())),
            (CmdStatus::ExceedLim, sy(FwSyndrome::AboveCap))
        );
        // A umem too small for the ring, and a umem that does not exist.
        let small = CreateCq { log_size: 7, ..good };
        assert_eq!(
            refused(dev.create(&small.encode())),
            (CmdStatus::BadParam, sy(FwSyndrome::UmemTooSmall))
        );
        let nowhere = CreateCq {
            umem_id: 0xdead,
            ..good
        };
        assert_eq!(
            refused(dev.create(&nowhere.encode())),
            (CmdStatus::BadRes, sy(FwSyndrome::UnknownUmem))
        );
        // A compressed CQ.
        let mut bad = good.encode();
        set(&mut bad, cqc::CQE_COMP_EN.within(create_cq_in::CQ_CONTEXT), 1);
        assert_eq!(
            refused(dev.create(&bad)),
            (CmdStatus::BadParam, sy(FwSyndrome::Unsupported))
        );
        assert!(lock(&soft.tables).cqs.is_empty(), "nothing created");

        // A QP on another device's CQ.
        let (_ctx2, dev2, _) = rig();
        let other = queues(&dev2, 4, dev2.device().alloc_pd().unwrap());
        let pd = d.alloc_pd().unwrap();
        let (_sq, sq_umem) = umem(&dev, 4096);
        let qp = CreateQp {
            pd,
            uar_page: uar.page,
            cqn_snd: other.cq.number,
            cqn_rcv: other.cq.number,
            log_sq_size: 4,
            umem_id: sq_umem,
            dbr_umem_id: sq_umem,
            dbr_offset: 2048,
            ts_format: command::QPC_TS_FORMAT_DEFAULT,
            ..Default::default()
        };
        assert_eq!(
            refused(dev.create(&qp.encode())),
            (CmdStatus::BadRes, sy(FwSyndrome::UnknownCq))
        );
        // The free-running clock, which this device (real-time only, as it reports) lacks.
        let free_running = CreateQp {
            cqn_snd: other.cq.number,
            ts_format: command::QPC_TS_FORMAT_FREE_RUNNING,
            ..qp
        };
        assert_eq!(
            refused(dev.create(&free_running.encode())),
            (CmdStatus::BadParam, sy(FwSyndrome::Unsupported))
        );
        assert!(lock(&soft.tables).qps.is_empty(), "nothing created");
        assert!(lock(&soft.tables).umems.values().all(|u| u.users == 0), "nothing held");

        // Transitions out of order.
        let q = queues(&dev, 4, dev.device().alloc_pd().unwrap());
        let rtr = Init2Rtr {
            qpn: q.qp.number,
            mtu: 5,
            remote_qpn: q.qp.number,
            path: d.resolve(&at(soft.gid())).unwrap(),
            ..Default::default()
        };
        assert_eq!(
            refused(dev.modify(&q.qp, &rtr.encode())),
            (CmdStatus::BadQpState, sy(FwSyndrome::BadState))
        );
        assert_eq!(
            state(&dev, &q),
            QpcState::Reset as u64,
            "a refused transition changes nothing"
        );
        to_rts(&dev, &soft, &q, 7).unwrap();
        let rts = Rtr2Rts {
            qpn: q.qp.number,
            ..Default::default()
        };
        assert_eq!(
            refused(dev.modify(&q.qp, &rts.encode())),
            (CmdStatus::BadQpState, sy(FwSyndrome::BadState))
        );
        // A modify naming another QP than its handle's.
        let mut wrong = rts.encode();
        set(&mut wrong, modify_qp_in::QPN, (q.qp.number + 1) as u64);
        assert_eq!(
            refused(dev.modify(&q.qp, &wrong)),
            (CmdStatus::BadRes, sy(FwSyndrome::UnknownObject))
        );
        // A CQ still in use, and its umem too.
        assert_eq!(
            refused(dev.destroy(&q.cq)),
            (CmdStatus::BadResState, sy(FwSyndrome::CqInUse))
        );
        assert!(matches!(
            d.umem_dereg(ring_umem + 0x1000),
            Err(DeviceError::Call { .. })
        ));
        dev.destroy(&q.qp).unwrap();
        dev.destroy(&q.cq).unwrap();
        // A connection to a QP that does not exist is refused at RTR2RTS.
        let q = queues(&dev, 4, dev.device().alloc_pd().unwrap());
        let mut steps = to_rts(&dev, &soft, &q, 0);
        assert!(steps.is_ok());
        dev.destroy(&q.qp).unwrap();
        let q2 = queues(&dev, 4, dev.device().alloc_pd().unwrap());
        dev.modify(
            &q2.qp,
            &Rst2Init {
                qpn: q2.qp.number,
                port: 1,
                ..Default::default()
            }
            .encode(),
        )
        .unwrap();
        let rtr = Init2Rtr {
            qpn: q2.qp.number,
            mtu: 5,
            remote_qpn: q.qp.number,
            path: d.resolve(&at(gid_of(0x1))).unwrap(),
            ..Default::default()
        };
        dev.modify(&q2.qp, &rtr.encode()).unwrap();
        steps = dev.modify(
            &q2.qp,
            &Rtr2Rts {
                qpn: q2.qp.number,
                ..Default::default()
            }
            .encode(),
        );
        assert_eq!(refused(steps), (CmdStatus::BadParam, sy(FwSyndrome::PeerUnreachable)));
        assert_eq!(state(&dev, &q2), QpcState::Rtr as u64);
    }

    /// A queue pair of 16 WQEs in `pd`, connected to itself and ready to send.
    fn loopback(dev: &Devx, soft: &SoftDevice, pd: u32) -> Queues {
        let q = queues(dev, 4, pd);
        to_rts(dev, soft, &q, 0).unwrap();
        q
    }

    /// QPNs and CQNs come from one 24-bit counter. When it wraps, numbers still in use are
    /// skipped: a new QP once got a live QP's number, and dropping it detached both.
    #[test]
    fn numbers_in_use_are_skipped_when_the_counter_wraps() {
        let (_served, dev, soft) = rig();
        let pd = dev.device().alloc_pd().unwrap();
        let live = loopback(&dev, &soft, pd);
        let (buf, mr) = region_in(dev.device(), pd);
        // The next number would be the live QP's (and its CQ's right before it).
        soft.hca
            .next_qpn
            .store((live.qp.number - 1) | 1 << 24, Ordering::Relaxed);
        for _ in 0..3 {
            let q = loopback(&dev, &soft, pd);
            assert_ne!(q.qp.number, live.qp.number);
            dev.destroy(&q.qp).unwrap();
            dev.destroy(&q.cq).unwrap();
        }
        let (_handle, post) = poster(&live);
        let (to, from) = (
            gdaki_device::Remote {
                addr: buf.addr(),
                rkey: mr.rkey,
            },
            gdaki_device::Local {
                addr: buf.addr() + 8,
                lkey: mr.lkey,
            },
        );
        let t = post.put(to, from, 8).unwrap();
        post.wait(t).unwrap();
        assert_eq!(state(&dev, &live), QpcState::Rts as u64);
    }

    /// Memory whose every transfer fails, as a GPU copy that failed would.
    struct FailingDma;
    // SAFETY: touches no memory at all.
    unsafe impl crate::dma::Dma for FailingDma {
        fn read(&self, _: u64, _: &mut [u8]) -> Result<(), crate::dma::DmaFault> {
            Err(crate::dma::DmaFault)
        }
        fn write(&self, _: u64, _: &[u8]) -> Result<(), crate::dma::DmaFault> {
            Err(crate::dma::DmaFault)
        }
        fn fetch_add(&self, _: u64, _: u64) -> Result<u64, crate::dma::DmaFault> {
            Err(crate::dma::DmaFault)
        }
        fn compare_swap(&self, _: u64, _: u64, _: u64) -> Result<u64, crate::dma::DmaFault> {
            Err(crate::dma::DmaFault)
        }
    }

    #[test]
    fn a_failed_transfer_fails_the_wqe_like_a_dma_error() {
        use gdaki_layout::Syndrome;
        let (_served, dev, soft) = rig();
        let pd = dev.device().alloc_pd().unwrap();
        let (good, gmr) = region_in(dev.device(), pd);
        let good_local = |off: u64| gdaki_device::Local {
            addr: good.addr() + off,
            lkey: gmr.lkey,
        };
        let good_remote = gdaki_device::Remote {
            addr: good.addr(),
            rkey: gmr.rkey,
        };
        // A range nobody touches (the DMA fails before it would): any address works.
        let addr = 0x1000_0000;
        let key = soft
            .hca
            .register(pd, addr, 4096, Access::ALL, Arc::new(FailingDma), None)
            .unwrap();
        let bad_local = gdaki_device::Local { addr, lkey: key };
        let bad_remote = gdaki_device::Remote { addr, rkey: key };
        // (source, target, the error the requester's CQE carries)
        let cases = [
            (bad_local, good_remote, Syndrome::LocalAccess),
            (good_local(0), bad_remote, Syndrome::RemoteOp),
        ];
        for (src, dst, want) in cases {
            let q = loopback(&dev, &soft, pd);
            let (_handle, post) = poster(&q);
            // 3 chunks of 3000 bytes: the failing side is not host-addressable, so it bounces.
            let t = post.put(dst, src, 3000).unwrap();
            match post.wait(t) {
                Err(gdaki_device::WaitError::Cqe(e)) => assert_eq!(e.syndrome, want),
                other => panic!("expected {want:?}, got {other:?}"),
            }
            assert_eq!(state(&dev, &q), QpcState::Err as u64);
        }
        // A failed atomic at the target, and a failed result write at the requester.
        for (target, result, want) in [
            (bad_remote, good_local(8), Syndrome::RemoteOp),
            (
                good_remote,
                gdaki_device::Local {
                    addr: addr + 8,
                    lkey: key,
                },
                Syndrome::LocalAccess,
            ),
        ] {
            let q = loopback(&dev, &soft, pd);
            let (_handle, post) = poster(&q);
            match post.atomic_fetch_add(target, 1, result) {
                Err(gdaki_device::PostError::Wait(gdaki_device::WaitError::Cqe(e))) => assert_eq!(e.syndrome, want),
                other => panic!("expected {want:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_region_used_by_the_engine_is_released_by_the_thread_that_drops_it() {
        let (_served, dev, soft) = rig();
        let pd = dev.device().alloc_pd().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let buf = [7u8; 64];
        let key = soft
            .hca
            .register(
                pd,
                buf.as_ptr() as u64,
                64,
                Access::ALL,
                Arc::new(crate::dma::HostDma::default()),
                Some(Arc::new(crate::tests::Witness(tx))),
            )
            .unwrap();
        let (dst, dmr) = region_in(dev.device(), pd);
        let q = loopback(&dev, &soft, pd);
        let (_handle, post) = poster(&q);
        let src = gdaki_device::Local {
            addr: buf.as_ptr() as u64,
            lkey: key,
        };
        let to = gdaki_device::Remote {
            addr: dst.addr(),
            rkey: dmr.rkey,
        };
        let t = post.put(to, src, 64).unwrap();
        post.wait(t).unwrap(); // the engine has the region in its cache now
        soft.hca.release(key);
        let on = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(on, std::thread::current().name().map(str::to_owned));
        // SAFETY: the put completed: nothing writes the buffer any more.
        let got = unsafe { std::slice::from_raw_parts(dst.as_ptr(), 64) };
        assert_eq!(got, [7u8; 64]);
    }
}
