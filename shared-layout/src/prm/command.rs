//! Whole command mailboxes: opcodes, op_mods, status codes, and typed builders that encode a
//! command's input from its parameters (each one field by field through [`layout`](super::layout)), plus the
//! readers for what the device answers. The soft device's firmware decodes the same fields.
use super::layout::{ads, atomic_caps, cmd_hca_cap, cmd_hca_cap_2, cmd_in, cmd_out, cqc, create_cq_in, create_qp_in};
use super::layout::{modify_qp_in, object_in, qpc, query_hca_cap_out, roce_cap};
use super::{get, set, set_bytes, Bits};

enum_with_unknown! {
    /// A command opcode (`MLX5_CMD_OP_*` in `mlx5_ifc.h`).
    pub enum Opcode(u16) {
        /// `QUERY_HCA_CAP`.
        QueryHcaCap = 0x100,
        /// `CREATE_CQ`.
        CreateCq = 0x400,
        /// `DESTROY_CQ`.
        DestroyCq = 0x401,
        /// `QUERY_CQ`.
        QueryCq = 0x402,
        /// `CREATE_QP`.
        CreateQp = 0x500,
        /// `DESTROY_QP`.
        DestroyQp = 0x501,
        /// `RST2INIT_QP`.
        Rst2InitQp = 0x502,
        /// `INIT2RTR_QP`.
        Init2RtrQp = 0x503,
        /// `RTR2RTS_QP`.
        Rtr2RtsQp = 0x504,
        /// `2ERR_QP`.
        Qp2Err = 0x507,
        /// `2RST_QP`.
        Qp2Rst = 0x50a,
        /// `QUERY_QP`.
        QueryQp = 0x50b,
        /// `ALLOC_PD`.
        AllocPd = 0x800,
    }
}

impl Opcode {
    /// The PRM name, for logs and errors.
    pub const fn name(self) -> &'static str {
        match self {
            Opcode::QueryHcaCap => "QUERY_HCA_CAP",
            Opcode::CreateCq => "CREATE_CQ",
            Opcode::DestroyCq => "DESTROY_CQ",
            Opcode::QueryCq => "QUERY_CQ",
            Opcode::CreateQp => "CREATE_QP",
            Opcode::DestroyQp => "DESTROY_QP",
            Opcode::Rst2InitQp => "RST2INIT_QP",
            Opcode::Init2RtrQp => "INIT2RTR_QP",
            Opcode::Rtr2RtsQp => "RTR2RTS_QP",
            Opcode::Qp2Err => "2ERR_QP",
            Opcode::Qp2Rst => "2RST_QP",
            Opcode::QueryQp => "QUERY_QP",
            Opcode::AllocPd => "ALLOC_PD",
            Opcode::Unknown(_) => "unknown command",
        }
    }
}

impl core::fmt::Display for Opcode {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Opcode::Unknown(v) => write!(f, "command {v:#x}"),
            known => f.write_str(known.name()),
        }
    }
}

enum_with_unknown! {
    /// A command's completion status (`MLX5_CMD_STAT_*` in the kernel's `mlx5/device.h`).
    pub enum CmdStatus(u8) {
        /// Done.
        Ok = 0x0,
        /// Internal error.
        IntErr = 0x1,
        /// Unknown opcode.
        BadOp = 0x2,
        /// A parameter is not valid (op_mod, a size, a reserved value).
        BadParam = 0x3,
        /// The system is not in a state to run the command.
        BadSysState = 0x4,
        /// A resource the command names does not exist or is not the caller's.
        BadRes = 0x5,
        /// The resource is busy.
        ResBusy = 0x6,
        /// A limit would be exceeded.
        ExceedLim = 0x8,
        /// The resource is in a state that does not allow the command.
        BadResState = 0x9,
        /// Bad index.
        BadIndex = 0xa,
        /// No resources left.
        NoResources = 0xf,
        /// The QP's state does not allow the transition.
        BadQpState = 0x10,
        /// Bad packet.
        BadPkt = 0x30,
        /// Bad size: too many outstanding CQEs.
        BadSizeOutsCqes = 0x40,
        /// The input mailbox has the wrong length.
        BadInputLen = 0x50,
        /// The output mailbox has the wrong length.
        BadOutputLen = 0x51,
    }
}

impl CmdStatus {
    /// The kernel's name, without the `MLX5_CMD_STAT_` prefix.
    pub const fn name(self) -> &'static str {
        match self {
            CmdStatus::Ok => "OK",
            CmdStatus::IntErr => "INT_ERR",
            CmdStatus::BadOp => "BAD_OP_ERR",
            CmdStatus::BadParam => "BAD_PARAM_ERR",
            CmdStatus::BadSysState => "BAD_SYS_STATE_ERR",
            CmdStatus::BadRes => "BAD_RES_ERR",
            CmdStatus::ResBusy => "RES_BUSY",
            CmdStatus::ExceedLim => "LIM_ERR",
            CmdStatus::BadResState => "BAD_RES_STATE_ERR",
            CmdStatus::BadIndex => "IX_ERR",
            CmdStatus::NoResources => "NO_RES_ERR",
            CmdStatus::BadQpState => "BAD_QP_STATE_ERR",
            CmdStatus::BadPkt => "BAD_PKT_ERR",
            CmdStatus::BadSizeOutsCqes => "BAD_SIZE_OUTS_CQES_ERR",
            CmdStatus::BadInputLen => "BAD_INP_LEN_ERR",
            CmdStatus::BadOutputLen => "BAD_OUTP_LEN_ERR",
            CmdStatus::Unknown(_) => "unknown status",
        }
    }
}

impl core::fmt::Display for CmdStatus {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{} ({:#x})", self.name(), self.raw())
    }
}

/// A command that failed: the status and the device's 32-bit syndrome (which firmware
/// documents per status; the soft device's are listed in its firmware module).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmdError {
    /// Which command.
    pub opcode: Opcode,
    /// Its status (never `Ok`).
    pub status: CmdStatus,
    /// The syndrome.
    pub syndrome: u32,
}

impl core::fmt::Display for CmdError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "{} failed: {}, syndrome {:#010x}",
            self.opcode, self.status, self.syndrome
        )
    }
}

/// The opcode of an input mailbox.
pub fn opcode(mailbox: &[u8]) -> Opcode {
    Opcode::from_raw(get(mailbox, cmd_in::OPCODE) as u16)
}

/// Reads an output mailbox's status: `Ok(())` or the failure with its syndrome.
pub fn check(opcode: Opcode, out: &[u8]) -> Result<(), CmdError> {
    match CmdStatus::from_raw(get(out, cmd_out::STATUS) as u8) {
        CmdStatus::Ok => Ok(()),
        status => Err(CmdError {
            opcode,
            status,
            syndrome: get(out, cmd_out::SYNDROME) as u32,
        }),
    }
}

/// Writes a failure into an output mailbox (what firmware does).
pub fn fail(out: &mut [u8], status: CmdStatus, syndrome: u32) {
    set(out, cmd_out::STATUS, status.raw() as u64);
    set(out, cmd_out::SYNDROME, syndrome as u64);
}

/// The object number a create or allocate command returned (`cqn`, `qpn`, `pd`).
pub fn object(out: &[u8]) -> u32 {
    get(out, cmd_out::OBJECT) as u32
}

/// Bytes in a command output header, and in the outputs that carry only it and an object.
pub const OUT_HEADER_BYTES: usize = cmd_out::BYTES;

fn header<const N: usize>(op: Opcode, op_mod: u16) -> [u8; N] {
    let mut b = [0u8; N];
    set(&mut b, cmd_in::OPCODE, op.raw() as u64);
    set(&mut b, cmd_in::OP_MOD, op_mod as u64);
    b
}

/// A command that names one object (`DESTROY_CQ`, `DESTROY_QP`, `2ERR_QP`, `2RST_QP`,
/// `QUERY_QP`): 16 bytes.
pub fn object_command(op: Opcode, object: u32) -> [u8; object_in::BYTES] {
    let mut b = header(op, 0);
    set(&mut b, object_in::OBJECT, object as u64);
    b
}

/// `ALLOC_PD`: 16 bytes.
pub fn alloc_pd() -> [u8; cmd_in::BYTES] {
    header(Opcode::AllocPd, 0)
}

/// The capability types gdaki queries (`MLX5_CAP_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum CapType {
    /// General device capabilities ([`cmd_hca_cap`]).
    General = 0,
    /// Atomic capabilities ([`atomic_caps`]).
    Atomic = 3,
    /// RoCE capabilities ([`roce_cap`]).
    Roce = 4,
    /// The second general capabilities ([`cmd_hca_cap_2`]; only where
    /// [`GeneralCaps::hca_cap_2`] says the device has them).
    General2 = 0x20,
}

/// `QUERY_HCA_CAP` of the current (not maximum) capabilities of `kind`: op_mod is
/// `kind << 1 | 1`.
pub fn query_hca_cap(kind: CapType) -> [u8; cmd_in::BYTES] {
    header(Opcode::QueryHcaCap, (kind as u16) << 1 | 1)
}

/// The capability type and whether the current values are asked, from `QUERY_HCA_CAP`'s op_mod.
pub fn cap_query(op_mod: u16) -> (u16, bool) {
    (op_mod >> 1, op_mod & 1 == 1)
}

/// Output size of `QUERY_HCA_CAP`.
pub const QUERY_HCA_CAP_OUT_BYTES: usize = query_hca_cap_out::BYTES;

/// The general capabilities gdaki checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GeneralCaps {
    /// The device answers for [`CapType::General2`].
    pub hca_cap_2: bool,
    /// log2 of the largest queue in WQEs.
    pub log_max_qp_sz: u8,
    /// log2 of the number of QPs.
    pub log_max_qp: u8,
    /// log2 of the largest CQ in CQEs.
    pub log_max_cq_sz: u8,
    /// log2 of the number of CQs.
    pub log_max_cq: u8,
    /// log2 of outstanding RDMA READs / atomics a requester may have.
    pub log_max_ra_req_qp: u8,
    /// log2 of outstanding RDMA READs / atomics a responder serves.
    pub log_max_ra_res_qp: u8,
    /// 0: InfiniBand, 1: Ethernet.
    pub port_type: u8,
    /// Number of ports.
    pub num_ports: u8,
    /// log2 of the largest message.
    pub log_max_msg: u8,
    /// CQE format version (gdaki needs 1).
    pub cqe_version: u8,
    /// RoCE supported.
    pub roce: bool,
    /// Atomics supported.
    pub atomic: bool,
    /// CQ overrun-ignore supported.
    pub cq_oi: bool,
    /// Core-Direct: QPs with `qpc.cd_master` and WAIT WQEs.
    pub cd: bool,
    /// log2 of the system page size the device uses.
    pub log_pg_sz: u8,
    /// log2 of the number of PDs.
    pub log_max_pd: u8,
    /// log2 of the number of umems.
    pub log_max_umem: u8,
    /// The send queue's timestamp formats (`TS_FORMAT_CAP_*`).
    pub sq_ts_format: u8,
}

/// Declares the field ↔ member mapping of a capability struct once, for both directions.
macro_rules! caps_fields {
    ($caps:ident, $module:ident, { $($member:ident: $field:ident as $ty:ty),+ $(,)? }) => {
        impl $caps {
            /// Reads the capabilities from a `QUERY_HCA_CAP` output mailbox.
            pub fn decode(out: &[u8]) -> $caps {
                let base = query_hca_cap_out::CAPABILITY;
                $caps { $($member: <$ty as CapValue>::from_field(get(out, $module::$field.within(base)))),+ }
            }

            /// Writes the capabilities into a `QUERY_HCA_CAP` output mailbox (what firmware does).
            pub fn encode(&self, out: &mut [u8]) {
                let base = query_hca_cap_out::CAPABILITY;
                $( set(out, $module::$field.within(base), self.$member as u64); )+
            }
        }
    };
}

/// A capability member's type, read from its field (fields are no wider than the type).
trait CapValue {
    fn from_field(v: u64) -> Self;
}
impl CapValue for bool {
    fn from_field(v: u64) -> bool {
        v != 0
    }
}
impl CapValue for u8 {
    fn from_field(v: u64) -> u8 {
        v as u8
    }
}
impl CapValue for u16 {
    fn from_field(v: u64) -> u16 {
        v as u16
    }
}

caps_fields!(GeneralCaps, cmd_hca_cap, {
    hca_cap_2: HCA_CAP_2 as bool,
    log_max_qp_sz: LOG_MAX_QP_SZ as u8,
    log_max_qp: LOG_MAX_QP as u8,
    log_max_cq_sz: LOG_MAX_CQ_SZ as u8,
    log_max_cq: LOG_MAX_CQ as u8,
    log_max_ra_req_qp: LOG_MAX_RA_REQ_QP as u8,
    log_max_ra_res_qp: LOG_MAX_RA_RES_QP as u8,
    port_type: PORT_TYPE as u8,
    num_ports: NUM_PORTS as u8,
    log_max_msg: LOG_MAX_MSG as u8,
    cqe_version: CQE_VERSION as u8,
    roce: ROCE as bool,
    atomic: ATOMIC as bool,
    cq_oi: CQ_OI as bool,
    cd: CD as bool,
    log_pg_sz: LOG_PG_SZ as u8,
    log_max_pd: LOG_MAX_PD as u8,
    log_max_umem: LOG_MAX_UMEM as u8,
    sq_ts_format: SQ_TS_FORMAT as u8,
});

/// The second general capabilities gdaki reads (a device with [`GeneralCaps::hca_cap_2`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GeneralCaps2 {
    /// QPs may be rung without a doorbell record ([`QPC_SEND_DBR_MODE_NO_DBR_EXT`]).
    pub send_dbr_mode_no_dbr_ext: bool,
}

caps_fields!(GeneralCaps2, cmd_hca_cap_2, {
    send_dbr_mode_no_dbr_ext: SEND_DBR_MODE_NO_DBR_EXT as bool,
});

/// `qpc.send_dbr_mode`: the HCA reads the send doorbell record (every device).
pub const QPC_SEND_DBR_MODE_DBR_VALID: u8 = 0x0;
/// `qpc.send_dbr_mode`: the doorbell alone announces WQEs, the record is never read
/// ([`GeneralCaps2::send_dbr_mode_no_dbr_ext`]).
pub const QPC_SEND_DBR_MODE_NO_DBR_EXT: u8 = 0x1;

/// The RoCE capabilities gdaki reads (a device whose port is Ethernet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoceCaps {
    /// The QP timestamp formats (`TS_FORMAT_CAP_*`).
    pub qp_ts_format: u8,
}

caps_fields!(RoceCaps, roce_cap, {
    qp_ts_format: QP_TS_FORMAT as u8,
});

/// A timestamp-format capability: the free-running clock only.
pub const TS_FORMAT_CAP_FREE_RUNNING: u8 = 0x0;
/// A timestamp-format capability: the real-time clock only.
pub const TS_FORMAT_CAP_REAL_TIME: u8 = 0x1;
/// A timestamp-format capability: both clocks.
pub const TS_FORMAT_CAP_FREE_RUNNING_AND_REAL_TIME: u8 = 0x2;
/// `qpc.ts_format`: the free-running clock.
pub const QPC_TS_FORMAT_FREE_RUNNING: u8 = 0x0;
/// `qpc.ts_format`: the device's default clock.
pub const QPC_TS_FORMAT_DEFAULT: u8 = 0x1;

/// `qpc.ts_format` for a device whose QPs support the formats `cap` (the RoCE capability
/// where RoCE is on, else the send queue's), as the kernel chooses it
/// (`mlx5_get_qp_default_ts`): the default clock where the real-time one is supported, the
/// free-running one only where nothing else is. Always free-running was refused by a device
/// whose clock is real-time only.
pub fn qp_ts_format(cap: u8) -> u8 {
    if cap == TS_FORMAT_CAP_FREE_RUNNING {
        QPC_TS_FORMAT_FREE_RUNNING
    } else {
        QPC_TS_FORMAT_DEFAULT
    }
}

/// The atomic capabilities gdaki checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicCaps {
    /// 0: 8-byte atomic replies big-endian; 1: host order (see
    /// [`AtomicReplyOrder`](crate::AtomicReplyOrder)).
    pub reply_mode: u8,
    /// Whether mode 1 can be selected.
    pub host_order_supported: bool,
    /// Bit 0 compare-and-swap, bit 1 fetch-and-add.
    pub operations: u16,
    /// Bit n: 2^n-byte atomics on RC QPs.
    pub size_qp: u16,
}

caps_fields!(AtomicCaps, atomic_caps, {
    reply_mode: ATOMIC_REQ_8B_ENDIANNESS_MODE as u8,
    host_order_supported: SUPPORTED_ATOMIC_REQ_8B_ENDIANNESS_MODE_1 as bool,
    operations: ATOMIC_OPERATIONS as u16,
    size_qp: ATOMIC_SIZE_QP as u16,
});

impl AtomicCaps {
    /// `atomic_operations` bit for compare-and-swap.
    pub const CMP_SWAP: u16 = 1 << 0;
    /// `atomic_operations` bit for fetch-and-add.
    pub const FETCH_ADD: u16 = 1 << 1;
    /// `atomic_operations` bit for extended (masked) compare-and-swap (the kernel's
    /// `MLX5_ATOMIC_OPS_EXTENDED_CMP_SWAP`, include/linux/mlx5/driver.h).
    pub const EXTENDED_CMP_SWAP: u16 = 1 << 2;
    /// `atomic_operations` bit for extended (masked) fetch-and-add.
    pub const EXTENDED_FETCH_ADD: u16 = 1 << 3;
    /// `atomic_size_qp` bit for 8-byte atomics.
    pub const SIZE_8_BYTES: u16 = 1 << 3;

    /// The `qpc.atomic_mode` an RC QP asks for, as the kernel chooses it (mlx5_ib's
    /// `get_atomic_mode`): with extended atomics, the largest size the device does on a QP (up
    /// to 256 bytes; 8 bytes at least: [`QPC_ATOMIC_MODE_UP_TO_8B`]); without them but with
    /// IB-spec compare-and-swap and fetch-and-add, [`QPC_ATOMIC_MODE_IB_SPEC`]; `None` when the
    /// device has no atomics (a mode it does not support makes CREATE_QP or RST2INIT fail).
    pub fn qp_atomic_mode(&self) -> Option<u8> {
        let extended = self.operations & (Self::EXTENDED_CMP_SWAP | Self::EXTENDED_FETCH_ADD) != 0;
        let sizes = self.size_qp & 0x1ff;
        if extended && sizes != 0 {
            let log_max = 15 - sizes.leading_zeros() as u8;
            return Some(log_max.max(QPC_ATOMIC_MODE_UP_TO_8B));
        }
        let ib = Self::CMP_SWAP | Self::FETCH_ADD;
        (self.operations & ib == ib).then_some(QPC_ATOMIC_MODE_IB_SPEC)
    }
}

/// `CREATE_CQ` with its ring and doorbell record in umems (DevX), 64-byte CQEs, no compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CreateCq {
    /// log2 of the number of CQEs.
    pub log_size: u8,
    /// The UAR page for arming (gdaki never arms, but the context names one).
    pub uar_page: u32,
    /// The event queue.
    pub eqn: u32,
    /// The umem holding the ring, and the ring's offset in it.
    pub umem_id: u32,
    /// Offset of the ring in its umem.
    pub umem_offset: u64,
    /// The umem holding the doorbell record.
    pub dbr_umem_id: u32,
    /// Offset of the doorbell record in its umem.
    pub dbr_offset: u64,
    /// log2 of the ring's page size minus 12 (0: 4 KiB pages).
    pub log_page_size: u8,
    /// Overrun ignore: the device writes CQEs even when the CQ looks full.
    pub overrun_ignore: bool,
    /// Collapsed (`cc`): every CQE is written to entry 0, the newest overwriting the rest.
    pub collapsed: bool,
}

impl CreateCq {
    /// The input mailbox.
    pub fn encode(&self) -> [u8; create_cq_in::BYTES] {
        let mut b = header(Opcode::CreateCq, 0);
        let cq = |f: Bits| f.within(create_cq_in::CQ_CONTEXT);
        set(&mut b, create_cq_in::CQ_UMEM_VALID, 1);
        set(&mut b, create_cq_in::CQ_UMEM_ID, self.umem_id as u64);
        set(&mut b, create_cq_in::CQ_UMEM_OFFSET, self.umem_offset);
        set(&mut b, cq(cqc::DBR_UMEM_VALID), 1);
        set(&mut b, cq(cqc::DBR_UMEM_ID), self.dbr_umem_id as u64);
        set(&mut b, cq(cqc::DBR_ADDR), self.dbr_offset);
        set(&mut b, cq(cqc::CQE_SZ), 0);
        set(&mut b, cq(cqc::OI), self.overrun_ignore as u64);
        set(&mut b, cq(cqc::CC), self.collapsed as u64);
        set(&mut b, cq(cqc::LOG_CQ_SIZE), self.log_size as u64);
        set(&mut b, cq(cqc::UAR_PAGE), self.uar_page as u64);
        set(&mut b, cq(cqc::C_EQN), self.eqn as u64);
        set(&mut b, cq(cqc::LOG_PAGE_SIZE), self.log_page_size as u64);
        b
    }
}

/// Service type RC in `qpc.st`.
pub const QPC_ST_RC: u8 = 0x0;
/// `qpc.pm_state`: migrated (no alternate path).
pub const QPC_PM_STATE_MIGRATED: u8 = 0x3;
/// `qpc.rq_type`: a zero-length receive queue (gdaki's QPs only send).
pub const QPC_RQ_TYPE_ZERO_LEN: u8 = 0x3;
/// `qpc.atomic_mode`: extended atomics up to 8 bytes (the device reports extended atomics).
pub const QPC_ATOMIC_MODE_UP_TO_8B: u8 = 0x3;
/// `qpc.atomic_mode`: IB-spec atomics only (8-byte compare-and-swap and fetch-and-add), for a
/// device without extended atomics.
pub const QPC_ATOMIC_MODE_IB_SPEC: u8 = 0x1;

/// `cqc.status`: the CQ is fine.
pub const CQC_STATUS_OK: u8 = 0x0;
/// `cqc.status`: the device had a CQE to write and no room (`MLX5_CQC_STATUS_CQ_OVERFLOW`).
pub const CQC_STATUS_OVERFLOW: u8 = 0x9;
/// `cqc.status`: a CQE write failed (`MLX5_CQC_STATUS_CQ_WRITE_FAIL`).
pub const CQC_STATUS_WRITE_FAIL: u8 = 0xa;

/// The QP states `qpc.state` reports (`MLX5_QPC_STATE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum QpcState {
    /// RESET.
    Reset = 0x0,
    /// INIT.
    Init = 0x1,
    /// RTR.
    Rtr = 0x2,
    /// RTS.
    Rts = 0x3,
    /// SQ error.
    SqErr = 0x4,
    /// SQ drained.
    Sqd = 0x7,
    /// ERROR.
    Err = 0x6,
}

impl QpcState {
    /// Decodes `qpc.state`; unknown values are `None`.
    pub const fn from_raw(v: u8) -> Option<QpcState> {
        Some(match v {
            0x0 => QpcState::Reset,
            0x1 => QpcState::Init,
            0x2 => QpcState::Rtr,
            0x3 => QpcState::Rts,
            0x4 => QpcState::SqErr,
            0x7 => QpcState::Sqd,
            0x6 => QpcState::Err,
            _ => return None,
        })
    }
}

/// The path MTU codes of `qpc.mtu` (`MLX5_QPC_MTU_*`, as IB's `ibv_mtu`).
pub const fn mtu_code(bytes: u32) -> Option<u8> {
    Some(match bytes {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        4096 => 5,
        _ => return None,
    })
}

/// `CREATE_QP` for an RC QP that only sends: its send queue and doorbell record in umems, a
/// zero-length receive queue, the send and receive CQs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CreateQp {
    /// Protection domain.
    pub pd: u32,
    /// The UAR page whose doorbell the QP is rung through.
    pub uar_page: u32,
    /// Completion queue of the send side.
    pub cqn_snd: u32,
    /// Completion queue of the receive side.
    pub cqn_rcv: u32,
    /// log2 of the send queue size in 64-byte building blocks.
    pub log_sq_size: u8,
    /// A value the device copies into this QP's CQEs.
    pub user_index: u32,
    /// The umem holding the send queue.
    pub umem_id: u32,
    /// Offset of the send queue in its umem.
    pub umem_offset: u64,
    /// The umem holding the doorbell record.
    pub dbr_umem_id: u32,
    /// Offset of the doorbell record (`[receive, send]` counters) in its umem.
    pub dbr_offset: u64,
    /// log2 of the ring's page size minus 12.
    pub log_page_size: u8,
    /// `qpc.ts_format` ([`qp_ts_format`]).
    pub ts_format: u8,
    /// The receive queue: `None` for a send-only QP (a zero-length RQ, `rq_type` 3); else a
    /// regular RQ at offset 0 of the work-queue umem, the send queue after it
    /// ([`crate::recv`]).
    pub receive: Option<RqShape>,
    /// `qpc.cd_master`: the QP may post WAIT WQEs (needs the `cd` capability).
    pub cd_master: bool,
    /// `qpc.send_dbr_mode` ([`QPC_SEND_DBR_MODE_DBR_VALID`] or, with the capability,
    /// [`QPC_SEND_DBR_MODE_NO_DBR_EXT`]).
    pub send_dbr_mode: u8,
}

/// The shape of a QP's receive queue (`qpc.log_rq_size`, `qpc.log_rq_stride`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RqShape {
    /// log2 of the number of receive WQEs.
    pub log_size: u8,
    /// log2 of the data segments per receive WQE (the WQE is 16 bytes times that).
    pub log_stride: u8,
}

impl CreateQp {
    /// The input mailbox.
    pub fn encode(&self) -> [u8; create_qp_in::BYTES] {
        let mut b = header(Opcode::CreateQp, 0);
        let q = |f: Bits| f.within(create_qp_in::QPC);
        set(&mut b, create_qp_in::WQ_UMEM_VALID, 1);
        set(&mut b, create_qp_in::WQ_UMEM_ID, self.umem_id as u64);
        set(&mut b, create_qp_in::WQ_UMEM_OFFSET, self.umem_offset);
        set(&mut b, q(qpc::ST), QPC_ST_RC as u64);
        set(&mut b, q(qpc::PM_STATE), QPC_PM_STATE_MIGRATED as u64);
        set(&mut b, q(qpc::PD), self.pd as u64);
        set(&mut b, q(qpc::UAR_PAGE), self.uar_page as u64);
        set(&mut b, q(qpc::USER_INDEX), self.user_index as u64);
        set(&mut b, q(qpc::LOG_PAGE_SIZE), self.log_page_size as u64);
        set(&mut b, q(qpc::LOG_SQ_SIZE), self.log_sq_size as u64);
        set(&mut b, q(qpc::TS_FORMAT), self.ts_format as u64);
        set(&mut b, q(qpc::CD_MASTER), self.cd_master as u64);
        set(&mut b, q(qpc::SEND_DBR_MODE), self.send_dbr_mode as u64);
        match self.receive {
            None => {
                set(&mut b, q(qpc::RQ_TYPE), QPC_RQ_TYPE_ZERO_LEN as u64);
                set(&mut b, q(qpc::LOG_RQ_SIZE), 0);
            }
            Some(rq) => {
                set(&mut b, q(qpc::RQ_TYPE), crate::recv::RQ_TYPE_REGULAR as u64);
                set(&mut b, q(qpc::LOG_RQ_SIZE), rq.log_size as u64);
                set(&mut b, q(qpc::LOG_RQ_STRIDE), rq.log_stride as u64);
            }
        }
        set(&mut b, q(qpc::CQN_SND), self.cqn_snd as u64);
        set(&mut b, q(qpc::CQN_RCV), self.cqn_rcv as u64);
        set(&mut b, q(qpc::DBR_UMEM_VALID), 1);
        set(&mut b, q(qpc::DBR_UMEM_ID), self.dbr_umem_id as u64);
        set(&mut b, q(qpc::DBR_ADDR), self.dbr_offset);
        b
    }
}

/// `RST2INIT_QP`: the port, partition and what the peer may do to this side's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rst2Init {
    /// The QP.
    pub qpn: u32,
    /// Port number (1-based).
    pub port: u8,
    /// Partition key index.
    pub pkey_index: u16,
    /// Remote READ allowed.
    pub remote_read: bool,
    /// Remote WRITE allowed.
    pub remote_write: bool,
    /// Remote atomics allowed.
    pub remote_atomic: bool,
    /// `qpc.atomic_mode` ([`AtomicCaps::qp_atomic_mode`]; 0 without atomics).
    pub atomic_mode: u8,
}

impl Rst2Init {
    /// The input mailbox.
    pub fn encode(&self) -> [u8; modify_qp_in::BYTES] {
        let mut b = header(Opcode::Rst2InitQp, 0);
        let q = |f: Bits| f.within(modify_qp_in::QPC);
        let path = |f: Bits| q(f.within(qpc::PRIMARY_ADDRESS_PATH));
        set(&mut b, modify_qp_in::QPN, self.qpn as u64);
        set(&mut b, q(qpc::PM_STATE), QPC_PM_STATE_MIGRATED as u64);
        set(&mut b, q(qpc::RRE), self.remote_read as u64);
        set(&mut b, q(qpc::RWE), self.remote_write as u64);
        set(&mut b, q(qpc::RAE), self.remote_atomic as u64);
        set(&mut b, q(qpc::ATOMIC_MODE), self.atomic_mode as u64);
        set(&mut b, path(ads::VHCA_PORT_NUM), self.port as u64);
        set(&mut b, path(ads::PKEY_INDEX), self.pkey_index as u64);
        b
    }
}

/// Where a QP sends: the remote's address on the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AddressPath {
    /// Port number (1-based).
    pub port: u8,
    /// InfiniBand: the remote LID.
    pub rlid: u16,
    /// InfiniBand: service level.
    pub sl: u8,
    /// A global route header is sent (always on RoCE).
    pub grh: bool,
    /// The local GID index.
    pub gid_index: u8,
    /// The remote GID.
    pub rgid: [u8; 16],
    /// GRH hop limit.
    pub hop_limit: u8,
    /// GRH traffic class.
    pub tclass: u8,
    /// RoCE: the remote MAC.
    pub rmac: [u8; 6],
    /// RoCE v2: the UDP source port (spreads flows over paths).
    pub udp_sport: u16,
}

impl AddressPath {
    fn encode(&self, b: &mut [u8], at: Bits) {
        let f = |x: Bits| x.within(at);
        set(b, f(ads::VHCA_PORT_NUM), self.port as u64);
        set(b, f(ads::RLID), self.rlid as u64);
        set(b, f(ads::SL), self.sl as u64);
        set(b, f(ads::GRH), self.grh as u64);
        set(b, f(ads::SRC_ADDR_INDEX), self.gid_index as u64);
        set_bytes(b, f(ads::RGID_RIP), &self.rgid);
        set(b, f(ads::HOP_LIMIT), self.hop_limit as u64);
        set(b, f(ads::TCLASS), self.tclass as u64);
        set_bytes(b, f(ads::RMAC_47_32), &self.rmac[..2]);
        set_bytes(b, f(ads::RMAC_31_0), &self.rmac[2..]);
        set(b, f(ads::UDP_SPORT), self.udp_sport as u64);
    }
}

/// `INIT2RTR_QP`: the peer QP, its address, the path MTU and the receive PSN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Init2Rtr {
    /// The QP.
    pub qpn: u32,
    /// Path MTU code ([`mtu_code`]).
    pub mtu: u8,
    /// log2 of the largest message.
    pub log_msg_max: u8,
    /// The peer's QP number.
    pub remote_qpn: u32,
    /// The first PSN expected from the peer (the peer's initial send PSN).
    pub next_rcv_psn: u32,
    /// RNR NAK timer code.
    pub min_rnr_nak: u8,
    /// log2 of READs / atomics served at once for the peer.
    pub log_rra_max: u8,
    /// The path to the peer.
    pub path: AddressPath,
}

impl Init2Rtr {
    /// The input mailbox.
    pub fn encode(&self) -> [u8; modify_qp_in::BYTES] {
        let mut b = header(Opcode::Init2RtrQp, 0);
        let q = |f: Bits| f.within(modify_qp_in::QPC);
        set(&mut b, modify_qp_in::QPN, self.qpn as u64);
        set(&mut b, q(qpc::MTU), self.mtu as u64);
        set(&mut b, q(qpc::LOG_MSG_MAX), self.log_msg_max as u64);
        set(&mut b, q(qpc::REMOTE_QPN), self.remote_qpn as u64);
        set(&mut b, q(qpc::NEXT_RCV_PSN), self.next_rcv_psn as u64);
        set(&mut b, q(qpc::MIN_RNR_NAK), self.min_rnr_nak as u64);
        set(&mut b, q(qpc::LOG_RRA_MAX), self.log_rra_max as u64);
        self.path.encode(&mut b, q(qpc::PRIMARY_ADDRESS_PATH));
        b
    }
}

/// `RTR2RTS_QP`: the send PSN and the retry policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rtr2Rts {
    /// The QP.
    pub qpn: u32,
    /// The first PSN this side sends.
    pub next_send_psn: u32,
    /// Transport retries (0..=7).
    pub retry_count: u8,
    /// RNR retries (7: forever).
    pub rnr_retry: u8,
    /// Local ACK timeout: 4.096 µs · 2^`ack_timeout`.
    pub ack_timeout: u8,
    /// log2 of outstanding READs / atomics this side issues.
    pub log_sra_max: u8,
}

impl Rtr2Rts {
    /// The input mailbox.
    pub fn encode(&self) -> [u8; modify_qp_in::BYTES] {
        let mut b = header(Opcode::Rtr2RtsQp, 0);
        let q = |f: Bits| f.within(modify_qp_in::QPC);
        set(&mut b, modify_qp_in::QPN, self.qpn as u64);
        set(&mut b, q(qpc::NEXT_SEND_PSN), self.next_send_psn as u64);
        set(&mut b, q(qpc::RETRY_COUNT), self.retry_count as u64);
        set(&mut b, q(qpc::RNR_RETRY), self.rnr_retry as u64);
        set(&mut b, q(qpc::LOG_SRA_MAX), self.log_sra_max as u64);
        set(&mut b, q(qpc::LOG_ACK_REQ_FREQ), 0);
        set(
            &mut b,
            q(ads::ACK_TIMEOUT.within(qpc::PRIMARY_ADDRESS_PATH)),
            self.ack_timeout as u64,
        );
        b
    }
}
