//! Opcodes and error syndromes, as `mlx5dv.h` numbers them. All parse without failing.

enum_with_unknown! {
    /// The opcode in a WQE's control segment (`MLX5_OPCODE_*`).
    pub enum WqeOpcode(u8) {
        /// No operation; completes like any WQE (used for zero-length puts).
        Nop = 0x00,
        /// Send with invalidate.
        SendInval = 0x01,
        /// RDMA WRITE.
        RdmaWrite = 0x08,
        /// RDMA WRITE with immediate.
        RdmaWriteImm = 0x09,
        /// SEND.
        Send = 0x0a,
        /// SEND with immediate.
        SendImm = 0x0b,
        /// TCP segmentation offload.
        Tso = 0x0e,
        /// Core-Direct WAIT.
        Wait = 0x0f,
        /// RDMA READ.
        RdmaRead = 0x10,
        /// 8-byte atomic compare-and-swap.
        AtomicCs = 0x11,
        /// 8-byte atomic fetch-and-add.
        AtomicFa = 0x12,
        /// Masked compare-and-swap.
        AtomicMaskedCs = 0x14,
        /// Masked fetch-and-add.
        AtomicMaskedFa = 0x15,
        /// Fast memory registration.
        Fmr = 0x19,
        /// Local invalidate.
        LocalInval = 0x1b,
        /// Configuration command.
        ConfigCmd = 0x1f,
        /// Set PSV.
        SetPsv = 0x20,
        /// DUMP (memory consistency after READ).
        Dump = 0x23,
        /// User memory registration.
        Umr = 0x25,
        /// Tag matching.
        TagMatching = 0x28,
        /// Flow table access.
        FlowTblAccess = 0x2c,
        /// Memory-to-memory offload.
        Mmo = 0x2f,
    }
}

enum_with_unknown! {
    /// The opcode in a CQE (`op_own >> 4`).
    pub enum CqeOpcode(u8) {
        /// Requester completion (our send queue).
        Req = 0,
        /// Responder: RDMA WRITE with immediate.
        RespWrImm = 1,
        /// Responder: SEND.
        RespSend = 2,
        /// Responder: SEND with immediate.
        RespSendImm = 3,
        /// Responder: SEND with invalidate.
        RespSendInv = 4,
        /// CQ resize.
        ResizeCq = 5,
        /// No packet.
        NoPacket = 6,
        /// Signature error.
        SigErr = 12,
        /// Requester error: the CQE is an error CQE.
        ReqErr = 13,
        /// Responder error: the CQE is an error CQE.
        RespErr = 14,
        /// Not written by the HCA yet (the value the host initialises CQEs with).
        Invalid = 15,
    }
}

impl CqeOpcode {
    /// Whether the CQE reports an error (its syndrome is meaningful).
    #[inline(always)]
    pub const fn is_error(self) -> bool {
        matches!(self, CqeOpcode::ReqErr | CqeOpcode::RespErr)
    }
}

enum_with_unknown! {
    /// The syndrome of an error CQE (`MLX5_CQE_SYNDROME_*`).
    pub enum Syndrome(u8) {
        /// Local length error (e.g. a gather list longer than the message allows).
        LocalLength = 0x01,
        /// Local QP operation error (malformed WQE, QP not ready to send).
        LocalQpOp = 0x02,
        /// Local protection error (bad lkey, out of bounds, missing local access right).
        LocalProt = 0x04,
        /// Work request flushed: the QP was in error when it was processed.
        WrFlush = 0x05,
        /// Memory-window bind error.
        MwBind = 0x06,
        /// Bad response.
        BadResp = 0x10,
        /// Local access error.
        LocalAccess = 0x11,
        /// Remote invalid request (e.g. unsupported opcode, bad length at the responder).
        RemoteInvalReq = 0x12,
        /// Remote access error (bad rkey, out of bounds, missing remote access right).
        RemoteAccess = 0x13,
        /// Remote operation error.
        RemoteOp = 0x14,
        /// Transport retry counter exceeded (peer dead or unreachable).
        TransportRetryExc = 0x15,
        /// RNR retry counter exceeded.
        RnrRetryExc = 0x16,
        /// Remote aborted.
        RemoteAborted = 0x22,
    }
}

impl Syndrome {
    /// A short name as perftest and rdma-core print it.
    pub const fn name(self) -> &'static str {
        match self {
            Syndrome::LocalLength => "local length error",
            Syndrome::LocalQpOp => "local QP operation error",
            Syndrome::LocalProt => "local protection error",
            Syndrome::WrFlush => "work request flushed",
            Syndrome::MwBind => "memory window bind error",
            Syndrome::BadResp => "bad response",
            Syndrome::LocalAccess => "local access error",
            Syndrome::RemoteInvalReq => "remote invalid request",
            Syndrome::RemoteAccess => "remote access error",
            Syndrome::RemoteOp => "remote operation error",
            Syndrome::TransportRetryExc => "transport retry counter exceeded",
            Syndrome::RnrRetryExc => "RNR retry counter exceeded",
            Syndrome::RemoteAborted => "remote aborted",
            Syndrome::Unknown(_) => "unknown syndrome",
        }
    }
}

impl core::fmt::Display for Syndrome {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{} ({:#04x})", self.name(), self.raw())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_round_trips() {
        for v in 0..=u8::MAX {
            assert_eq!(WqeOpcode::from_raw(v).raw(), v);
            assert_eq!(CqeOpcode::from_raw(v).raw(), v);
            assert_eq!(Syndrome::from_raw(v).raw(), v);
        }
        assert_eq!(WqeOpcode::from_raw(0x08), WqeOpcode::RdmaWrite);
        assert_eq!(WqeOpcode::from_raw(0x7f), WqeOpcode::Unknown(0x7f));
        assert!(CqeOpcode::from_raw(13).is_error() && !CqeOpcode::Req.is_error());
    }
}
