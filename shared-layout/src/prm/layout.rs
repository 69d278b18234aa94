//! The PRM structures gdaki uses, field by field: each module is one `mlx5_ifc_<name>_bits`
//! structure of the kernel's `mlx5_ifc.h`, each constant one of its fields as a [`Bits`], named
//! after the PRM field. Fields of a nested structure are relative to it: place them with
//! [`Bits::within`] (`qpc::LOG_SQ_SIZE.within(create_qp_in::QPC)`).
//!
//! DevX-only fields (the umem ids and offsets) sit where the kernel header has a
//! `reserved_at_*` member; their [`FIELDS`](cqc::FIELDS) entry names that member, and the golden
//! test checks the field lies inside it.
use super::Bits;

/// Declares one PRM structure: its size in bits and its fields.
macro_rules! prm_struct {
    (
        $(#[$meta:meta])*
        $name:ident, $size:expr, {
            $( $(#[$fmeta:meta])* $field:ident = ($off:expr, $width:expr) $c:literal; )+
        }
    ) => {
        $(#[$meta])*
        pub mod $name {
            use super::Bits;
            /// Size of the structure in bits.
            pub const SIZE: u32 = $size;
            /// Size of the structure in bytes.
            pub const BYTES: usize = ($size / 8) as usize;
            $(
                #[doc = concat!("`", $c, "`.")]
                $(#[$fmeta])*
                pub const $field: Bits = Bits::new($off, $width);
            )+
            /// Every field declared here, with the member of the kernel's structure that holds it
            /// (checked by the golden test).
            pub const FIELDS: &[(&str, Bits)] = &[$(($c, $field)),+];
        }
    };
}

prm_struct! {
    /// The header every command input starts with.
    cmd_in, 0x80, {
        OPCODE = (0x0, 0x10) "opcode";
        UID = (0x10, 0x10) "uid";
        OP_MOD = (0x30, 0x10) "op_mod";
    }
}

prm_struct! {
    /// The header every command output starts with, and the object number that create and
    /// allocate commands return after it.
    cmd_out, 0x80, {
        STATUS = (0x0, 0x8) "status";
        SYNDROME = (0x20, 0x20) "syndrome";
        /// `cqn`, `qpn`, `pd`: the created object.
        OBJECT = (0x48, 0x18) "qpn";
    }
}

prm_struct! {
    /// Commands that name one object: `destroy_cq_in`, `destroy_qp_in`, `qp_2err_in`,
    /// `qp_2rst_in`, `query_qp_in`.
    object_in, 0x80, {
        /// `cqn` or `qpn`.
        OBJECT = (0x48, 0x18) "qpn";
    }
}

prm_struct! {
    /// `query_hca_cap_in`.
    query_hca_cap_in, 0x80, {
        OTHER_FUNCTION = (0x40, 0x1) "other_function";
        FUNCTION_ID = (0x50, 0x10) "function_id";
    }
}

prm_struct! {
    /// `query_hca_cap_out` (without the capability union's size: the union is 0x8000 bits).
    query_hca_cap_out, 0x8080, {
        CAPABILITY = (0x80, 0x8000) "capability";
    }
}

prm_struct! {
    /// `cmd_hca_cap`: the general device capabilities (capability type 0).
    cmd_hca_cap, 0x800, {
        /// The device answers `QUERY_HCA_CAP` for [`cmd_hca_cap_2`](super::cmd_hca_cap_2).
        HCA_CAP_2 = (0x20, 0x1) "hca_cap_2";
        LOG_MAX_QP_SZ = (0x88, 0x8) "log_max_qp_sz";
        LOG_MAX_QP = (0x9b, 0x5) "log_max_qp";
        LOG_MAX_CQ_SZ = (0xc8, 0x8) "log_max_cq_sz";
        LOG_MAX_CQ = (0xdb, 0x5) "log_max_cq";
        LOG_MAX_RA_REQ_QP = (0x14a, 0x6) "log_max_ra_req_qp";
        LOG_MAX_RA_RES_QP = (0x15a, 0x6) "log_max_ra_res_qp";
        /// 0: InfiniBand, 1: Ethernet (RoCE).
        PORT_TYPE = (0x1b6, 0x2) "port_type";
        NUM_PORTS = (0x1b8, 0x8) "num_ports";
        LOG_MAX_MSG = (0x1c3, 0x5) "log_max_msg";
        /// Must be 1 for the CQE format gdaki reads (`user_index` in the CQE).
        CQE_VERSION = (0x1fc, 0x4) "cqe_version";
        ROCE = (0x21d, 0x1) "roce";
        ATOMIC = (0x21e, 0x1) "atomic";
        CQ_OI = (0x220, 0x1) "cq_oi";
        /// Core-Direct: QPs may be created with `qpc.cd_master` and post WAIT WQEs.
        CD = (0x22c, 0x1) "cd";
        LOG_PG_SZ = (0x258, 0x8) "log_pg_sz";
        LOG_MAX_PD = (0x32b, 0x5) "log_max_pd";
        /// The send queue's timestamp formats (`MLX5_TIMESTAMP_FORMAT_CAP_*`).
        SQ_TS_FORMAT = (0x440, 0x2) "sq_ts_format";
        LOG_MAX_UMEM = (0x46b, 0x5) "log_max_umem";
    }
}

prm_struct! {
    /// `cmd_hca_cap_2`: the second general capabilities (capability type 0x20). Newer than
    /// Debian's kernel header, whose `reserved_at_260` holds the field; its place is rdma-core's
    /// (`tests/mlx5_prm_structs.py`, `CmdHcaCap2`).
    cmd_hca_cap_2, 0x800, {
        /// QPs may be created with `qpc.send_dbr_mode` 1: rung by the doorbell alone, with no
        /// doorbell record (DOCA's reliable doorbell; ConnectX-8).
        SEND_DBR_MODE_NO_DBR_EXT = (0x2e1, 0x1) "reserved_at_260";
    }
}

prm_struct! {
    /// `roce_cap` (capability type 4).
    roce_cap, 0x800, {
        /// The QP timestamp formats RoCE supports (`MLX5_TIMESTAMP_FORMAT_CAP_*`).
        QP_TS_FORMAT = (0x1e, 0x2) "qp_ts_format";
    }
}

prm_struct! {
    /// `atomic_caps` (capability type 3).
    atomic_caps, 0x800, {
        /// 0: 8-byte atomic replies are big-endian; 1: in the requester's host order.
        ATOMIC_REQ_8B_ENDIANNESS_MODE = (0x40, 0x2) "atomic_req_8B_endianness_mode";
        SUPPORTED_ATOMIC_REQ_8B_ENDIANNESS_MODE_1 = (0x46, 0x1) "supported_atomic_req_8B_endianness_mode_1";
        /// Bit 0: compare-and-swap, bit 1: fetch-and-add (`MLX5_ATOMIC_OPS_*`).
        ATOMIC_OPERATIONS = (0x90, 0x10) "atomic_operations";
        /// Bit n: 2^n-byte atomics on RC QPs.
        ATOMIC_SIZE_QP = (0xb0, 0x10) "atomic_size_qp";
    }
}

prm_struct! {
    /// `cqc`: the completion queue context.
    cqc, 0x200, {
        STATUS = (0x0, 0x4) "status";
        DBR_UMEM_VALID = (0x6, 0x1) "dbr_umem_valid";
        /// 0: 64-byte CQEs.
        CQE_SZ = (0x8, 0x3) "cqe_sz";
        /// Collapsed: every CQE in entry 0 (gdaki never sets it: tickets are CQE indices).
        CC = (0xb, 0x1) "cc";
        /// Overrun ignore.
        OI = (0xe, 0x1) "oi";
        CQE_COMP_EN = (0x11, 0x1) "cqe_comp_en";
        /// DevX: the umem holding the doorbell record.
        DBR_UMEM_ID = (0x20, 0x20) "reserved_at_20";
        PAGE_OFFSET = (0x54, 0x6) "page_offset";
        LOG_CQ_SIZE = (0x63, 0x5) "log_cq_size";
        UAR_PAGE = (0x68, 0x18) "uar_page";
        C_EQN = (0xa0, 0x20) "c_eqn_or_apu_element";
        LOG_PAGE_SIZE = (0xc3, 0x5) "log_page_size";
        /// CQEs consumed, as the device last read the doorbell record (24 bits, wrapping).
        CONSUMER_COUNTER = (0x148, 0x18) "consumer_counter";
        /// CQEs written (24 bits, wrapping).
        PRODUCER_COUNTER = (0x168, 0x18) "producer_counter";
        /// With `dbr_umem_valid`: the record's offset in its umem.
        DBR_ADDR = (0x1c0, 0x40) "dbr_addr";
    }
}

prm_struct! {
    /// `create_cq_in` (272 bytes without the page list gdaki never uses).
    create_cq_in, 0x880, {
        CQ_CONTEXT = (0x80, 0x200) "cq_context";
        /// DevX: the ring's offset in its umem.
        CQ_UMEM_OFFSET = (0x280, 0x40) "reserved_at_280";
        /// DevX: the umem holding the ring.
        CQ_UMEM_ID = (0x2c0, 0x20) "reserved_at_280";
        CQ_UMEM_VALID = (0x2e0, 0x1) "cq_umem_valid";
    }
}

prm_struct! {
    /// `ads`: an address path (where a QP sends, and how).
    ads, 0x160, {
        PKEY_INDEX = (0x10, 0x10) "pkey_index";
        GRH = (0x28, 0x1) "grh";
        MLID = (0x29, 0x7) "mlid";
        RLID = (0x30, 0x10) "rlid";
        ACK_TIMEOUT = (0x40, 0x5) "ack_timeout";
        /// The local GID index.
        SRC_ADDR_INDEX = (0x48, 0x8) "src_addr_index";
        STAT_RATE = (0x54, 0x4) "stat_rate";
        HOP_LIMIT = (0x58, 0x8) "hop_limit";
        TCLASS = (0x64, 0x8) "tclass";
        FLOW_LABEL = (0x6c, 0x14) "flow_label";
        /// The remote GID (16 bytes).
        RGID_RIP = (0x80, 0x80) "rgid_rip";
        DSCP = (0x10a, 0x6) "dscp";
        UDP_SPORT = (0x110, 0x10) "udp_sport";
        SL = (0x124, 0x4) "sl";
        VHCA_PORT_NUM = (0x128, 0x8) "vhca_port_num";
        RMAC_47_32 = (0x130, 0x10) "rmac_47_32";
        RMAC_31_0 = (0x140, 0x20) "rmac_31_0";
    }
}

prm_struct! {
    /// `qpc`: the queue pair context.
    qpc, 0x740, {
        STATE = (0x0, 0x4) "state";
        /// Service type (0: RC).
        ST = (0x8, 0x8) "st";
        PM_STATE = (0x13, 0x2) "pm_state";
        PD = (0x28, 0x18) "pd";
        MTU = (0x40, 0x3) "mtu";
        LOG_MSG_MAX = (0x43, 0x5) "log_msg_max";
        LOG_RQ_SIZE = (0x49, 0x4) "log_rq_size";
        LOG_RQ_STRIDE = (0x4d, 0x3) "log_rq_stride";
        NO_SQ = (0x50, 0x1) "no_sq";
        LOG_SQ_SIZE = (0x51, 0x4) "log_sq_size";
        /// `MLX5_TIMESTAMP_FORMAT_*`: the clock CQE timestamps come from.
        TS_FORMAT = (0x58, 0x2) "ts_format";
        UAR_PAGE = (0x68, 0x18) "uar_page";
        /// 0: the HCA reads the send doorbell record; 1 (`NO_DBR_EXT`): the doorbell alone
        /// announces WQEs and the record is never read. Newer than Debian's kernel header
        /// (rdma-core's `mlx5_ifc_qpc_bits`, DOCA's `doca_verbs_qp_send_dbr_mode`).
        SEND_DBR_MODE = (0x80, 0x2) "reserved_at_80";
        USER_INDEX = (0x88, 0x18) "user_index";
        LOG_PAGE_SIZE = (0xa3, 0x5) "log_page_size";
        REMOTE_QPN = (0xa8, 0x18) "remote_qpn";
        PRIMARY_ADDRESS_PATH = (0xc0, 0x160) "primary_address_path";
        LOG_ACK_REQ_FREQ = (0x380, 0x4) "log_ack_req_freq";
        LOG_SRA_MAX = (0x388, 0x3) "log_sra_max";
        RETRY_COUNT = (0x38d, 0x3) "retry_count";
        RNR_RETRY = (0x390, 0x3) "rnr_retry";
        NEXT_SEND_PSN = (0x3c8, 0x18) "next_send_psn";
        CQN_SND = (0x3e8, 0x18) "cqn_snd";
        LOG_RRA_MAX = (0x488, 0x3) "log_rra_max";
        ATOMIC_MODE = (0x48c, 0x4) "atomic_mode";
        RRE = (0x490, 0x1) "rre";
        RWE = (0x491, 0x1) "rwe";
        RAE = (0x492, 0x1) "rae";
        PAGE_OFFSET = (0x494, 0x6) "page_offset";
        /// Core-Direct master: the QP may post WAIT WQEs (on other queues' completions).
        CD_MASTER = (0x49f, 0x1) "cd_master";
        MIN_RNR_NAK = (0x4a3, 0x5) "min_rnr_nak";
        NEXT_RCV_PSN = (0x4a8, 0x18) "next_rcv_psn";
        CQN_RCV = (0x4e8, 0x18) "cqn_rcv";
        /// With `dbr_umem_valid`: the doorbell record's offset in its umem.
        DBR_ADDR = (0x500, 0x40) "dbr_addr";
        RQ_TYPE = (0x565, 0x3) "rq_type";
        HW_SQ_WQEBB_COUNTER = (0x5a0, 0x10) "hw_sq_wqebb_counter";
        SW_SQ_WQEBB_COUNTER = (0x5b0, 0x10) "sw_sq_wqebb_counter";
        DBR_UMEM_VALID = (0x683, 0x1) "dbr_umem_valid";
        /// DevX: the umem holding the doorbell record.
        DBR_UMEM_ID = (0x720, 0x20) "reserved_at_684";
    }
}

prm_struct! {
    /// `create_qp_in` (272 bytes without the page list).
    create_qp_in, 0x880, {
        INPUT_QPN = (0x48, 0x18) "input_qpn";
        OPT_PARAM_MASK = (0x80, 0x20) "opt_param_mask";
        QPC = (0xc0, 0x740) "qpc";
        /// DevX: the send queue's offset in its umem.
        WQ_UMEM_OFFSET = (0x800, 0x40) "reserved_at_800";
        /// DevX: the umem holding the send queue.
        WQ_UMEM_ID = (0x840, 0x20) "reserved_at_800";
        WQ_UMEM_VALID = (0x860, 0x1) "wq_umem_valid";
    }
}

prm_struct! {
    /// The three modify mailboxes gdaki sends (`rst2init_qp_in`, `init2rtr_qp_in`,
    /// `rtr2rts_qp_in`) share this layout.
    modify_qp_in, 0x880, {
        QPN = (0x48, 0x18) "qpn";
        OPT_PARAM_MASK = (0x80, 0x20) "opt_param_mask";
        QPC = (0xc0, 0x740) "qpc";
    }
}

prm_struct! {
    /// `query_qp_out` (272 bytes without the page list).
    query_qp_out, 0x880, {
        OPT_PARAM_MASK = (0x80, 0x20) "opt_param_mask";
        QPC = (0xc0, 0x740) "qpc";
    }
}

prm_struct! {
    /// `query_cq_out` (272 bytes without the page list).
    query_cq_out, 0x880, {
        CQ_CONTEXT = (0x80, 0x200) "cq_context";
    }
}

/// A kernel structure (`mlx5_ifc_<name>_bits`), its size in bits (0: not checked, for the
/// headers several structures share) and the fields gdaki declares in it.
pub type Checked = (&'static str, u32, &'static [(&'static str, Bits)]);

/// Every structure above, by the `mlx5_ifc.h` structures it describes: the golden test walks
/// this list, so a structure added above and not here goes unchecked.
pub const STRUCTURES: &[Checked] = &[
    ("alloc_pd_in", 0, cmd_in::FIELDS),
    ("destroy_cq_in", 0, cmd_in::FIELDS),
    ("create_cq_in", 0, cmd_in::FIELDS),
    ("create_qp_in", 0, cmd_in::FIELDS),
    ("rst2init_qp_in", 0, cmd_in::FIELDS),
    ("init2rtr_qp_in", 0, cmd_in::FIELDS),
    ("rtr2rts_qp_in", 0, cmd_in::FIELDS),
    ("qp_2err_in", 0, cmd_in::FIELDS),
    ("qp_2rst_in", 0, cmd_in::FIELDS),
    ("destroy_qp_in", 0, cmd_in::FIELDS),
    ("query_hca_cap_in", 0, &[CMD_IN_OPCODE, CMD_IN_OP_MOD]),
    ("query_qp_in", 0, &[CMD_IN_OPCODE, CMD_IN_OP_MOD]),
    ("query_cq_in", 0, &[CMD_IN_OPCODE, CMD_IN_OP_MOD]),
    (
        "create_cq_out",
        0,
        &[CMD_OUT_STATUS, CMD_OUT_SYNDROME, ("cqn", cmd_out::OBJECT)],
    ),
    (
        "create_qp_out",
        0,
        &[CMD_OUT_STATUS, CMD_OUT_SYNDROME, ("qpn", cmd_out::OBJECT)],
    ),
    (
        "alloc_pd_out",
        0,
        &[CMD_OUT_STATUS, CMD_OUT_SYNDROME, ("pd", cmd_out::OBJECT)],
    ),
    ("destroy_cq_out", 0x80, &[CMD_OUT_STATUS, CMD_OUT_SYNDROME]),
    ("rst2init_qp_out", 0, &[CMD_OUT_STATUS, CMD_OUT_SYNDROME]),
    ("destroy_cq_in", object_in::SIZE, &[("cqn", object_in::OBJECT)]),
    ("destroy_qp_in", object_in::SIZE, object_in::FIELDS),
    ("qp_2err_in", object_in::SIZE, object_in::FIELDS),
    ("qp_2rst_in", object_in::SIZE, object_in::FIELDS),
    ("query_qp_in", object_in::SIZE, object_in::FIELDS),
    ("query_cq_in", object_in::SIZE, &[("cqn", object_in::OBJECT)]),
    ("query_hca_cap_in", query_hca_cap_in::SIZE, query_hca_cap_in::FIELDS),
    ("query_hca_cap_out", query_hca_cap_out::SIZE, query_hca_cap_out::FIELDS),
    ("cmd_hca_cap", cmd_hca_cap::SIZE, cmd_hca_cap::FIELDS),
    ("cmd_hca_cap_2", cmd_hca_cap_2::SIZE, cmd_hca_cap_2::FIELDS),
    ("atomic_caps", atomic_caps::SIZE, atomic_caps::FIELDS),
    ("roce_cap", roce_cap::SIZE, roce_cap::FIELDS),
    ("cqc", cqc::SIZE, cqc::FIELDS),
    ("create_cq_in", create_cq_in::SIZE, create_cq_in::FIELDS),
    ("ads", ads::SIZE, ads::FIELDS),
    ("qpc", qpc::SIZE, qpc::FIELDS),
    ("create_qp_in", create_qp_in::SIZE, create_qp_in::FIELDS),
    ("rst2init_qp_in", modify_qp_in::SIZE, modify_qp_in::FIELDS),
    ("init2rtr_qp_in", modify_qp_in::SIZE, modify_qp_in::FIELDS),
    ("rtr2rts_qp_in", modify_qp_in::SIZE, modify_qp_in::FIELDS),
    ("query_qp_out", query_qp_out::SIZE, query_qp_out::FIELDS),
    ("query_cq_out", query_cq_out::SIZE, query_cq_out::FIELDS),
];

const CMD_IN_OPCODE: (&str, Bits) = ("opcode", cmd_in::OPCODE);
const CMD_IN_OP_MOD: (&str, Bits) = ("op_mod", cmd_in::OP_MOD);
const CMD_OUT_STATUS: (&str, Bits) = ("status", cmd_out::STATUS);
const CMD_OUT_SYNDROME: (&str, Bits) = ("syndrome", cmd_out::SYNDROME);
