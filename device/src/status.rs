//! What posting and waiting return. Every wait is bounded: the result is success, a decoded
//! error CQE, or a timeout, never a hang.
use gdaki_layout::handle::{error_word, ERROR_SYNDROME_SHIFT, ERROR_VENDOR_SHIFT, ERROR_WQE_OPCODE_SHIFT};
use gdaki_layout::{Syndrome, WqeOpcode};

/// The WQE index of a posted operation's last WQE; waiting on it waits for the whole operation.
pub type Ticket = u64;

/// An error CQE, decoded: the first error the QP's CQ reported.
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub struct CqeError {
    /// The syndrome.
    pub syndrome: Syndrome,
    /// The vendor syndrome.
    pub vendor_syndrome: u8,
    /// Opcode of the WQE that failed.
    pub wqe_opcode: WqeOpcode,
    /// Low 32 bits of the failed WQE's index.
    pub wqe_index: u32,
}

impl CqeError {
    /// Encodes it as the CQ's sticky error word ([`CqeError::from_word`] inverts it).
    #[inline(always)]
    pub const fn to_word(&self) -> u64 {
        error_word(
            self.wqe_index as u64,
            self.syndrome.raw(),
            self.vendor_syndrome,
            self.wqe_opcode.raw(),
        )
    }

    /// Decodes the CQ's sticky error word (`DevCq::error`).
    #[inline(always)]
    pub const fn from_word(word: u64) -> Self {
        CqeError {
            syndrome: Syndrome::from_raw((word >> ERROR_SYNDROME_SHIFT) as u8),
            vendor_syndrome: (word >> ERROR_VENDOR_SHIFT) as u8,
            wqe_opcode: WqeOpcode::from_raw((word >> ERROR_WQE_OPCODE_SHIFT) as u8),
            wqe_index: word as u32,
        }
    }
}

/// Why a wait did not succeed.
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub enum WaitError {
    /// The QP reported an error at or before the awaited WQE.
    Cqe(CqeError),
    /// The bound in the handle (`timeout_ns`) passed first.
    Timeout {
        /// The index waited for.
        index: u64,
    },
    /// A wait for a value in memory (a flag a peer's put writes) passed the handle's bound.
    Flag {
        /// The value waited for.
        expected: u64,
        /// The value last read.
        found: u64,
    },
    /// The CQE for `index` has a format other than the plain 64-byte one (a compressed or
    /// mini-CQE block): the CQ was created with options gdaki does not read. Not consumed.
    CqeFormat {
        /// The index waited for.
        index: u64,
        /// The format bits found (`op_own >> 2 & 3`).
        format: u8,
    },
}

/// Why a post did not happen (nothing was posted unless said otherwise).
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "nvptx64"), derive(Debug))]
pub enum PostError {
    /// Waiting for a free slot, for this poster's turn, or for the doorbell failed. Slots
    /// already reserved stay reserved: the QP is in error or stuck.
    Wait(WaitError),
    /// Inline data longer than a single-block WQE holds.
    InlineTooLong {
        /// Bytes asked for.
        len: usize,
        /// Most allowed.
        max: usize,
    },
    /// The handle's doorbell kind is not one this crate knows.
    BadHandle,
    /// A reservation of 0 WQEs, or of more than the ring holds; or a message that would take
    /// more WQEs than the ring holds (`count`, saturated at `u32::MAX`).
    BadCount {
        /// WQEs asked for.
        count: u32,
        /// Ring size in WQEs.
        ring: u64,
    },
    /// An atomic's target address is not 8-byte aligned (a NIC would fail it with an error
    /// CQE of a device-specific syndrome).
    Misaligned {
        /// The target address.
        addr: u64,
    },
    /// A message that must be one WQE (a SEND) is longer than the QP's `max_msg_size`, or a
    /// receive buffer longer than a data segment holds.
    TooLong {
        /// Bytes asked for.
        len: u64,
        /// Most allowed.
        max: u64,
    },
    /// A receive of more buffers than the receive queue's stride holds.
    TooManyBufs {
        /// Buffers given.
        count: usize,
        /// Most allowed.
        max: usize,
    },
}

impl From<WaitError> for PostError {
    #[inline(always)]
    fn from(e: WaitError) -> Self {
        PostError::Wait(e)
    }
}

// Formatting is host-only: on the GPU it would drag in core::fmt, which the PTX cannot link.
#[cfg(not(target_arch = "nvptx64"))]
impl core::fmt::Display for WaitError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            WaitError::Cqe(e) => write!(
                f,
                "error CQE: {} (vendor {:#04x}) on WQE {} ({:?})",
                e.syndrome, e.vendor_syndrome, e.wqe_index, e.wqe_opcode
            ),
            WaitError::Timeout { index } => write!(f, "timed out waiting for WQE {index}"),
            WaitError::Flag { expected, found } => {
                write!(
                    f,
                    "timed out waiting for flag value {expected:#x} (last read {found:#x})"
                )
            }
            WaitError::CqeFormat { index, format } => write!(
                f,
                "the CQE for WQE {index} has format {format}, not a plain 64-byte CQE (a compressed CQ?)"
            ),
        }
    }
}

#[cfg(not(target_arch = "nvptx64"))]
impl core::fmt::Display for PostError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PostError::Wait(e) => e.fmt(f),
            PostError::InlineTooLong { len, max } => write!(f, "inline data of {len} bytes exceeds {max}"),
            PostError::BadHandle => f.write_str("unknown doorbell kind in the QP handle"),
            PostError::BadCount { count, ring } => write!(f, "cannot reserve {count} WQEs in a ring of {ring}"),
            PostError::Misaligned { addr } => write!(f, "atomic target {addr:#x} is not 8-byte aligned"),
            PostError::TooLong { len, max } => write!(f, "a message of {len} bytes exceeds the {max} one WQE takes"),
            PostError::TooManyBufs { count, max } => {
                write!(f, "a receive of {count} buffers exceeds the queue's {max}")
            }
        }
    }
}

// So host code can `?` them into `Box<dyn Error>`, anyhow or its own error types.
#[cfg(not(target_arch = "nvptx64"))]
impl core::error::Error for WaitError {}

#[cfg(not(target_arch = "nvptx64"))]
impl core::error::Error for PostError {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        match self {
            PostError::Wait(e) => Some(e),
            _ => None,
        }
    }
}

/// Outcomes as one u32, for kernels to report to the host: 0 success, [`CODE_TIMEOUT`],
/// [`CODE_FLAG_TIMEOUT`], [`CODE_INLINE_TOO_LONG`], [`CODE_BAD_HANDLE`], [`CODE_BAD_COUNT`],
/// [`CODE_MISALIGNED`], [`CODE_CQE_FORMAT`], [`CODE_BAD_ARGUMENT`], [`CODE_TOO_LONG`],
/// [`CODE_TOO_MANY_BUFS`], [`CODE_WOULD_BLOCK`], [`CODE_RESET`], [`CODE_CLOSED`], [`CODE_REFUSED`], or
/// [`CODE_CQE_ERROR`] |
/// syndrome.
pub const CODE_OK: u32 = 0;
/// A wait timed out.
pub const CODE_TIMEOUT: u32 = 1;
/// Inline data too long.
pub const CODE_INLINE_TOO_LONG: u32 = 2;
/// Unknown doorbell kind in the handle.
pub const CODE_BAD_HANDLE: u32 = 3;
/// A reservation of 0 WQEs or more than the ring.
pub const CODE_BAD_COUNT: u32 = 4;
/// A wait for a flag in memory timed out.
pub const CODE_FLAG_TIMEOUT: u32 = 6;
/// An atomic's target is not 8-byte aligned.
pub const CODE_MISALIGNED: u32 = 7;
/// A CQE of a format gdaki does not read (compressed or mini CQEs).
pub const CODE_CQE_FORMAT: u32 = 8;
/// An argument the C ABI checks is invalid: unknown `GDAKI_POST_*` flags, or a null block
/// scratch area; or a perftest kernel's unknown stream operation. Reported by
/// `gdaki_device::ffi` and the kernels, not by the Rust API (its types rule it out).
pub const CODE_BAD_ARGUMENT: u32 = 9;
/// A kernel was launched in a shape its scope cannot use (for example a warp-scope kernel
/// whose warp is partial). Reported by kernels, not by the API.
pub const CODE_BAD_SCOPE: u32 = 5;
/// An error CQE; the low byte is the syndrome.
pub const CODE_CQE_ERROR: u32 = 0x100;

/// A message longer than one WQE takes (a SEND over `max_msg_size`).
pub const CODE_TOO_LONG: u32 = 10;
/// A receive of more buffers than the receive queue's stride.
pub const CODE_TOO_MANY_BUFS: u32 = 11;
/// A socket call that would have to wait (`try_send` with a full ring, `try_recv` with
/// nothing arrived).
pub const CODE_WOULD_BLOCK: u32 = 12;
/// A socket whose connection was reset (by the peer or this side).
pub const CODE_RESET: u32 = 13;
/// A send on a socket after its sending side was shut down.
pub const CODE_CLOSED: u32 = 14;
/// A socket service could not do the call: the connection was refused or the address did not
/// resolve (connect), the port is taken (listen), or no listener has that port (accept).
pub const CODE_REFUSED: u32 = 15;

/// A status code as kernels report it ([`CODE_OK`], ...), for messages: `Code(c).to_string()`.
#[cfg(not(target_arch = "nvptx64"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Code(pub u32);

#[cfg(not(target_arch = "nvptx64"))]
impl core::fmt::Display for Code {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.0 {
            CODE_OK => f.write_str("ok"),
            CODE_TIMEOUT => f.write_str("a completion wait timed out"),
            CODE_FLAG_TIMEOUT => f.write_str("a flag wait timed out (the peer's message never came)"),
            CODE_INLINE_TOO_LONG => f.write_str("inline data too long"),
            CODE_BAD_HANDLE => f.write_str("bad QP handle"),
            CODE_BAD_COUNT => f.write_str("bad reservation count"),
            CODE_BAD_SCOPE => f.write_str("launch shape does not fit the kernel's scope"),
            CODE_MISALIGNED => f.write_str("atomic target not 8-byte aligned"),
            CODE_CQE_FORMAT => f.write_str("a CQE of a format gdaki does not read (compressed CQ?)"),
            CODE_BAD_ARGUMENT => {
                f.write_str("invalid argument (unknown post flags or operation, or a null scratch area)")
            }
            CODE_TOO_LONG => f.write_str("message longer than one WQE takes"),
            CODE_TOO_MANY_BUFS => f.write_str("more receive buffers than the receive queue's stride"),
            CODE_WOULD_BLOCK => f.write_str("the socket call would block"),
            CODE_RESET => f.write_str("the socket's connection was reset"),
            CODE_CLOSED => f.write_str("a send after the socket's sending side was shut down"),
            CODE_REFUSED => f.write_str("the socket service refused the call (no listener, address or port)"),
            u32::MAX => f.write_str("no status written (the thread did not finish)"),
            c if c & CODE_CQE_ERROR != 0 => write!(f, "error CQE: {}", Syndrome::from_raw(c as u8)),
            c => write!(f, "unknown status {c:#x}"),
        }
    }
}

impl WaitError {
    /// The outcome code.
    #[inline(always)]
    pub const fn code(&self) -> u32 {
        match self {
            WaitError::Cqe(e) => CODE_CQE_ERROR | e.syndrome.raw() as u32,
            WaitError::Timeout { .. } => CODE_TIMEOUT,
            WaitError::Flag { .. } => CODE_FLAG_TIMEOUT,
            WaitError::CqeFormat { .. } => CODE_CQE_FORMAT,
        }
    }
}

impl PostError {
    /// The outcome code.
    #[inline(always)]
    pub const fn code(&self) -> u32 {
        match self {
            PostError::Wait(w) => w.code(),
            PostError::InlineTooLong { .. } => CODE_INLINE_TOO_LONG,
            PostError::BadHandle => CODE_BAD_HANDLE,
            PostError::BadCount { .. } => CODE_BAD_COUNT,
            PostError::Misaligned { .. } => CODE_MISALIGNED,
            PostError::TooLong { .. } => CODE_TOO_LONG,
            PostError::TooManyBufs { .. } => CODE_TOO_MANY_BUFS,
        }
    }
}

/// A post's or wait's outcome as two words, so a group leader can hand it to its members through
/// [`Scope::broadcast`](crate::scope::Scope::broadcast): `[code, payload]`.
#[inline(always)]
pub(crate) fn encode(r: Result<u64, PostError>) -> [u64; 2] {
    let payload = match r {
        Ok(v) => return [CODE_OK as u64, v],
        Err(PostError::Wait(WaitError::Cqe(e))) => e.to_word(),
        Err(PostError::Wait(WaitError::Timeout { index })) => index,
        Err(PostError::Wait(WaitError::Flag { expected, found })) => expected << 32 | (found & 0xffff_ffff),
        Err(PostError::InlineTooLong { len, max }) => (len as u64) << 32 | max as u64,
        Err(PostError::BadHandle) => 0,
        Err(PostError::BadCount { count, ring }) => (count as u64) << 32 | ring,
        Err(PostError::Wait(WaitError::CqeFormat { index, format })) => index << 2 | (format & 3) as u64,
        Err(PostError::Misaligned { addr }) => addr,
        // Lengths above 2^32 are refused before they get here (saturated if ever).
        Err(PostError::TooLong { len, max }) => len.min(u32::MAX as u64) << 32 | max.min(u32::MAX as u64),
        Err(PostError::TooManyBufs { count, max }) => (count as u64) << 32 | max as u64,
    };
    [r.err().map_or(CODE_OK, |e| e.code()) as u64, payload]
}

/// Inverts [`encode`].
#[inline(always)]
pub(crate) fn decode(w: [u64; 2]) -> Result<u64, PostError> {
    let [code, payload] = w;
    Err(match code as u32 {
        CODE_OK => return Ok(payload),
        CODE_TIMEOUT => WaitError::Timeout { index: payload }.into(),
        CODE_FLAG_TIMEOUT => WaitError::Flag {
            expected: payload >> 32,
            found: payload & 0xffff_ffff,
        }
        .into(),
        CODE_INLINE_TOO_LONG => PostError::InlineTooLong {
            len: (payload >> 32) as usize,
            max: payload as u32 as usize,
        },
        CODE_BAD_COUNT => PostError::BadCount {
            count: (payload >> 32) as u32,
            ring: payload as u32 as u64,
        },
        CODE_CQE_FORMAT => WaitError::CqeFormat {
            index: payload >> 2,
            format: (payload & 3) as u8,
        }
        .into(),
        CODE_MISALIGNED => PostError::Misaligned { addr: payload },
        CODE_TOO_LONG => PostError::TooLong {
            len: payload >> 32,
            max: payload & 0xffff_ffff,
        },
        CODE_TOO_MANY_BUFS => PostError::TooManyBufs {
            count: (payload >> 32) as usize,
            max: payload as u32 as usize,
        },
        c if c & CODE_CQE_ERROR != 0 => WaitError::Cqe(CqeError::from_word(payload)).into(),
        _ => PostError::BadHandle,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_survive_encoding() {
        let cases = [
            Ok(0),
            Ok(u64::MAX),
            Err(WaitError::Timeout { index: 1 << 40 }.into()),
            Err(WaitError::Flag {
                expected: 0xab,
                found: 0x7f,
            }
            .into()),
            Err(WaitError::Cqe(CqeError {
                syndrome: Syndrome::RemoteAccess,
                vendor_syndrome: 0x88,
                wqe_opcode: WqeOpcode::RdmaRead,
                wqe_index: 0xdead_beef,
            })
            .into()),
            Err(PostError::InlineTooLong { len: 29, max: 28 }),
            Err(PostError::BadHandle),
            Err(PostError::BadCount {
                count: 0,
                ring: 1 << 15,
            }),
            Err(WaitError::CqeFormat {
                index: 1 << 40,
                format: 3,
            }
            .into()),
            Err(PostError::Misaligned { addr: 0x1003 }),
            Err(PostError::TooLong {
                len: 1 << 31,
                max: 1 << 30,
            }),
            Err(PostError::TooManyBufs { count: 5, max: 4 }),
        ];
        for c in cases {
            assert_eq!(decode(encode(c)), c);
        }
    }
}
