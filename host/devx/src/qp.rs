//! What a queue pair is to both devices and to peers: its state, its endpoint, its limits.
use std::fmt;
use std::net::SocketAddr;

use gdaki_layout::prm::command::QpcState;

/// Largest send queue in WQEs (the device tells CQE laps apart by 16-bit WQE counters).
pub const MAX_SQ_SIZE: u32 = 1 << 15;
/// Largest completion queue in CQEs.
pub const MAX_CQ_SIZE: u32 = 1 << 22;

/// The state of a queue pair (the verbs state machine, RC subset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum QpState {
    /// Created; nothing is executed.
    Reset = 0,
    /// Initialised; not yet connected.
    Init = 1,
    /// Ready to receive: connected to its peer, serving its requests.
    Rtr = 2,
    /// Ready to send: executes its own WQEs.
    Rts = 3,
    /// Failed: every WQE is flushed (completes in error).
    Error = 4,
}

impl QpState {
    /// The state stored as `v` (unknown values read as failed).
    pub fn from_raw(v: u8) -> QpState {
        match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            _ => QpState::Error,
        }
    }
}

impl QpState {
    /// The state a device reports in `qpc.state` (SQ error and SQ drained do not happen to
    /// gdaki's QPs; they and unknown values read as failed).
    pub fn from_qpc(raw: u8) -> QpState {
        match QpcState::from_raw(raw) {
            Some(QpcState::Reset) => QpState::Reset,
            Some(QpcState::Init) => QpState::Init,
            Some(QpcState::Rtr) => QpState::Rtr,
            Some(QpcState::Rts) => QpState::Rts,
            _ => QpState::Error,
        }
    }

    /// The `qpc.state` a device reports for this state.
    pub fn to_qpc(self) -> QpcState {
        match self {
            QpState::Reset => QpcState::Reset,
            QpState::Init => QpcState::Init,
            QpState::Rtr => QpcState::Rtr,
            QpState::Rts => QpcState::Rts,
            QpState::Error => QpcState::Err,
        }
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Error => "ERROR",
        })
    }
}

/// What a peer needs to connect to a queue pair: where its port is on the fabric, the QP,
/// and the transport address of a soft HCA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    /// The port's GID (InfiniBand: subnet prefix and port GUID; RoCE: from the interface's
    /// address). The soft HCA's is `fe80::` and its random 64-bit identity: a peer in the
    /// same process is found by it, any other through [`addr`](Self::addr).
    pub gid: [u8; 16],
    /// InfiniBand: the port's LID; 0 on Ethernet and on the soft HCA.
    pub lid: u16,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// The port's active MTU in bytes (256, 512, 1024, 2048 or 4096): the path uses the
    /// smaller of both sides'.
    pub mtu: u16,
    /// The soft HCA's transport secret for this QP, random at its creation: a peer opening
    /// the transport connection to this QP must present it, so only whoever was handed this
    /// endpoint can (treat an endpoint like a password). 0 on a NIC, where the fabric carries
    /// requests and nothing reads it.
    pub secret: u64,
    /// log2 of the RDMA READs and atomics this QP accepts outstanding as a responder (its
    /// INIT2RTR `log_rra_max`, at most [`wire::MAX_RD_ATOMIC`](crate::wire::MAX_RD_ATOMIC)): the
    /// peer keeps its own outstanding ones (`log_sra_max`) within it, as a NIC must.
    pub rd_atomic: u8,
    /// Where the HCA accepts transport connections from other processes or hosts (the soft
    /// HCA's listener, see `gdaki::Context::listen`); `None` when it does
    /// not listen.
    pub addr: Option<SocketAddr>,
}
