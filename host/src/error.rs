//! The host library's errors: one enum, each variant saying what was wrong and with what value.
use gdaki_layout::Syndrome;

use gdaki_devx::QpState;

/// What a host-library call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The mlx5 provider was asked for but there is no mlx5 RDMA device.
    #[error("no mlx5 RDMA device on this machine (/sys/class/infiniband has none); use --provider soft")]
    NoRdmaDevice,
    /// A size that must be a power of two within limits is not.
    #[error("{what} must be a power of two between {min} and {max}, got {got}")]
    BadSize {
        /// Which size.
        what: &'static str,
        /// Value given.
        got: u64,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
    },
    /// A length or count out of range.
    #[error("{what} out of range: {got} (allowed {min}..={max})")]
    OutOfRange {
        /// Which value.
        what: &'static str,
        /// Value given.
        got: u64,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
    },
    /// Memory for a region or queue could not be allocated.
    #[error("cannot allocate {bytes} bytes for {what}")]
    Alloc {
        /// What the memory was for.
        what: &'static str,
        /// Size asked for.
        bytes: usize,
    },
    /// The completion queue already serves a queue pair (every device QP has its own CQ, so
    /// that tickets are CQE indices).
    #[error("completion queue {cqn:#x} already serves queue pair {qpn:#x}")]
    CqInUse {
        /// The CQ.
        cqn: u32,
        /// The QP it serves.
        qpn: u32,
    },
    /// Objects of two different contexts (or providers) were mixed where one is needed.
    #[error("{what} belongs to another context")]
    ForeignObject {
        /// Which object.
        what: &'static str,
    },
    /// The library cannot read or write a region it did not allocate (its owner has the
    /// pointer).
    #[error("memory region {key:#x} is caller-registered: access it through your own pointer")]
    CallerMemory {
        /// The region's key.
        key: u32,
    },
    /// A QP state transition that the state machine does not allow.
    #[error("queue pair {qpn:#x}: cannot go from {from} to {to}")]
    BadTransition {
        /// The QP.
        qpn: u32,
        /// Current state.
        from: QpState,
        /// State asked for.
        to: QpState,
    },
    /// The peer named in a connection is not reachable (in-process: its context is gone).
    #[error("peer {what} is not reachable: {why}")]
    PeerUnreachable {
        /// Which peer.
        what: String,
        /// Why (the connection's error).
        why: String,
    },
    /// A combination the library or its device cannot serve.
    #[error("{what} is not supported: {why}")]
    Unsupported {
        /// What was asked for.
        what: &'static str,
        /// Why not, and what to do instead.
        why: String,
    },
    /// The completion queue overran (the HCA had a CQE to write and no room).
    #[error("completion queue {cqn:#x} overran")]
    CqOverrun {
        /// The CQ.
        cqn: u32,
    },
    /// A queue pair is in the error state.
    #[error("queue pair {qpn:#x} is in error: {syndrome}")]
    QpError {
        /// The QP.
        qpn: u32,
        /// The first error's syndrome.
        syndrome: Syndrome,
    },
    /// A peer sent bytes that are not a valid frame (or not the one expected).
    #[error("peer {peer} sent a bad frame: {source}")]
    Protocol {
        /// The peer's address.
        peer: String,
        /// What was wrong.
        #[source]
        source: gdaki_devx::wire::WireError,
    },
    /// The peer refused the handshake and said why.
    #[error("peer {peer} refused: {reason}")]
    Rejected {
        /// The peer's address.
        peer: String,
        /// Its reason.
        reason: String,
    },
    /// A wait on a peer ran out of time.
    #[error("{what}: no answer within {after:?}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long.
        after: std::time::Duration,
    },
    /// The device (a NIC's firmware, or the soft HCA's model of it) refused a command or a
    /// call around one; run with `RUST_LOG=gdaki::devx=debug` to see every command sent.
    #[error("{what}: {source}")]
    Device {
        /// What was being done.
        what: &'static str,
        /// The device's answer: status and syndrome, or the call that failed.
        #[source]
        source: gdaki_devx::DeviceError,
    },
    /// A CUDA driver call failed, or there is no usable GPU.
    #[error(transparent)]
    Cuda(#[from] gdaki_cuda::CudaError),
    /// A socket call failed ([`crate::socket`]).
    #[error(transparent)]
    Socket(#[from] SocketFailure),
    /// The CPU proxy (the doorbell fallback) could not be started.
    #[error("the fallback CPU proxy: {0}")]
    Proxy(#[source] gdaki_proxy::ProxyError),
    /// An I/O error (engine thread start, sockets).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl From<gdaki_devx::AllocError> for Error {
    fn from(e: gdaki_devx::AllocError) -> Error {
        Error::Alloc {
            what: e.what,
            bytes: e.bytes,
        }
    }
}

impl Error {
    /// Maps a device call's failure to [`Error::Device`], saying what was being done.
    pub(crate) fn device(what: &'static str) -> impl Fn(gdaki_devx::DeviceError) -> Error {
        move |source| Error::Device { what, source }
    }
}

/// What a socket operation failed with ([`crate::socket`]; here, beside [`Error`], so the error
/// module depends on no other).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum SocketFailure {
    /// The peer's ring is full (`try_send`) or nothing arrived (`try_recv`).
    #[error("the call would block")]
    WouldBlock,
    /// The connection was reset (by the peer or by this side).
    #[error("the connection was reset")]
    Reset,
    /// A send after `shutdown`.
    #[error("this side shut down its sending side")]
    Closed,
    /// A wait ran past the timeout.
    #[error("no room or no bytes within the socket's timeout ({0:?})")]
    TimedOut(std::time::Duration),
    /// The connection is lost: its queue pair failed (the peer died, or refused an access).
    #[error("the connection is lost: {0}")]
    Lost(String),
    /// The socket's rings are in GPU memory (or it was exported): only kernels use it.
    #[error("this socket's rings are in GPU memory: export it (Socket::into_gpu) and use it from kernels")]
    OnGpu,
    /// A send from registered memory named bytes its region does not hold, or a region of
    /// another context (nothing was sent).
    #[error("bad source region: {0}")]
    BadSource(String),
    /// A call's argument is out of range (nothing was received or sent).
    #[error("bad argument: {0}")]
    BadArgument(String),
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Checks that `v` is a power of two in `min..=max`.
pub(crate) fn check_pow2(what: &'static str, v: u64, min: u64, max: u64) -> Result<u32> {
    if v.is_power_of_two() && (min..=max).contains(&v) {
        Ok(v.trailing_zeros())
    } else {
        Err(Error::BadSize { what, got: v, min, max })
    }
}
