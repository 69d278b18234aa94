//! What the soft HCA's own calls fail with. At the device boundary the firmware turns each into
//! a `DeviceError` that names the cause, so users see one error type, the library's.
use gdaki_cuda::{AllocError, CudaError};

/// A soft-HCA call's failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A value out of range (a region past the end of the address space).
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
    /// The peer's transport cannot be reached, or refused the connection.
    #[error("peer {what} is not reachable: {why}")]
    PeerUnreachable {
        /// Which peer.
        what: String,
        /// Why.
        why: String,
    },
    /// Host memory for the HCA's own buffers could not be allocated.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A CUDA call of the GPU copier failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// An I/O error (threads, sockets).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The soft HCA's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A transfer that could not be made (a GPU copy failed or timed out; the cause is logged where
/// it happened). The WQE fails as a NIC's DMA error fails it: a local access error at the
/// requester, a remote operation error at the responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaFault;
