//! A byte-stream socket over one queue pair (docs/sockets.md): the control words of a receive
//! window, and the handle the socket functions take.
use bytemuck::{Pod, Zeroable};

/// The wire protocol's version, in the handshake's `gdaki-socket/N`.
pub const PROTOCOL_VERSION: u32 = 3;

/// Bytes of control words at the start of a receive window; the receive ring follows.
pub const CONTROL_BYTES: u64 = 256;
/// `reset`: non-zero once the peer reset the connection. Written twice, here (a receiver reads
/// it beside its look at the ring) and at [`RESET_BY_CREDIT`] beside `credit`, so a sender's
/// look is one 16-byte load. (Word 0, version 2's `arrived`, is unused: a frame's trailer says
/// what arrived.)
pub const RESET: u64 = 8;
/// `credit`: the ring position up to which the peer has read this side's frames (its inline
/// WRITE).
pub const CREDIT: u64 = 16;
/// The second copy of `reset`.
pub const RESET_BY_CREDIT: u64 = 24;
/// `fin`: 0 while the peer sends; the ring position after its last frame + 1 once it shut down
/// its sending side.
pub const FIN: u64 = 32;

/// Bytes of a frame's trailer: `[len, tag]` (little-endian u64s), the frame's last 16 bytes.
pub const TRAILER_BYTES: u64 = 16;

/// Frames are multiples of this many bytes, so every frame starts on a GPU cache line (128
/// bytes) as the ring does: a receiver's copy out of a frame reads whole lines, and the
/// copier's writes of it cover whole lines.
pub const FRAME_ALIGN: u64 = 128;

/// Ring bytes of a frame carrying `len` bytes of the stream: the bytes, padding, then the
/// trailer, [`FRAME_ALIGN`] bytes or a multiple. (`len` is at most a ring, so this does not
/// overflow.)
pub const fn frame_bytes(len: u64) -> u64 {
    (len + TRAILER_BYTES).next_multiple_of(FRAME_ALIGN)
}

/// A frame's tag: the ring position it starts at and its length, under the receiver's key
/// (from the handshake). A receiver takes a trailer whose tag is the one it expects at its
/// position: a lap-old trailer has another position, a zeroed ring fails the key, and a
/// trailer read half-written (its words from two frames) fails the length's part.
pub const fn frame_tag(pos: u64, len: u64, key: u64) -> u64 {
    pos ^ key ^ len.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Where the frame of `frame` ring bytes at ring position `pos` starts, as an offset into a
/// ring of `cap` bytes: frames are laid from the ring's end down, so a frame's trailer, the
/// last bytes its WRITE lands, sits just below the receiver's position, where it looks.
/// (`pos mod cap + frame <= cap`: a frame never wraps.)
pub const fn frame_offset(cap: u64, pos: u64, frame: u64) -> u64 {
    cap - (pos & (cap - 1)) - frame
}

/// The smallest ring, as log2 bytes (4 KiB).
pub const MIN_LOG_RING: u32 = 12;
/// The largest ring, as log2 bytes (1 GiB).
pub const MAX_LOG_RING: u32 = 30;

/// This side has sent `fin` (shut down its sending side).
pub const SOCKET_SHUT_WR: u64 = 1;
/// This side has sent `reset`.
pub const SOCKET_RESET: u64 = 2;

/// A socket as the device sees it: where its queue pair, windows and rings are, and the
/// stream state only its owner updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
pub struct DevSocket {
    /// Ring position after this side's last frame put to the peer.
    pub sent: u64,
    /// Ring position of the frame this side reads next.
    pub consumed: u64,
    /// `consumed` as last written to the peer's `credit`.
    pub credited: u64,
    /// `SOCKET_*` bits.
    pub flags: u64,
    /// The peer's `credit` as the sender last read it: room it may use without looking again
    /// (a credit only grows).
    pub credit_seen: u64,
    /// Bytes of the frame at `consumed` already read (a receive that took part of a frame).
    pub taken: u64,
    /// This side's frame key: the tag of every frame the peer writes here (see [`frame_tag`]).
    pub rx_key: u64,
    /// The peer's frame key, for the frames this side writes.
    pub tx_key: u64,
    /// The `DevQp` this socket posts through (an address the socket's users can read).
    pub qp: u64,
    /// This side's receive window: control words, then the ring.
    pub rx_window: u64,
    /// The send staging ring.
    pub tx_ring: u64,
    /// The peer's receive window.
    pub peer_window: u64,
    /// Key of `rx_window`'s region (the scratch word is a local operand).
    pub rx_lkey: u32,
    /// Key of `tx_ring`'s region.
    pub tx_lkey: u32,
    /// Remote key of the peer's window.
    pub peer_rkey: u32,
    /// log2 of this side's receive ring's bytes.
    pub log_rx: u32,
    /// log2 of the peer's receive ring's bytes (and of the staging ring's).
    pub log_tx: u32,
    /// [`DEV_SOCKET_VERSION`].
    pub version: u32,
    /// Pads the handle to its alignment.
    pub tail_pad: [u32; 2],
}

assert_layout!(DevSocket, 128, {
    sent => 0..8,
    consumed => 8..16,
    credited => 16..24,
    flags => 24..32,
    credit_seen => 32..40,
    taken => 40..48,
    rx_key => 48..56,
    tx_key => 56..64,
    qp => 64..72,
    rx_window => 72..80,
    tx_ring => 80..88,
    peer_window => 88..96,
    rx_lkey => 96..100,
    tx_lkey => 100..104,
    peer_rkey => 104..108,
    log_rx => 108..112,
    log_tx => 112..116,
    version => 116..120,
});

/// `DevSocket::version` of this layout: its fields' offsets and the protocol version
/// fingerprinted in the high 16 bits, the size in the low.
pub const DEV_SOCKET_VERSION: u32 = {
    use core::mem::{offset_of, size_of};
    let layout = [
        size_of::<DevSocket>(),
        offset_of!(DevSocket, sent),
        offset_of!(DevSocket, consumed),
        offset_of!(DevSocket, credited),
        offset_of!(DevSocket, flags),
        offset_of!(DevSocket, credit_seen),
        offset_of!(DevSocket, taken),
        offset_of!(DevSocket, rx_key),
        offset_of!(DevSocket, tx_key),
        offset_of!(DevSocket, qp),
        offset_of!(DevSocket, rx_window),
        offset_of!(DevSocket, tx_ring),
        offset_of!(DevSocket, peer_window),
        offset_of!(DevSocket, rx_lkey),
        offset_of!(DevSocket, tx_lkey),
        offset_of!(DevSocket, peer_rkey),
        offset_of!(DevSocket, log_rx),
        offset_of!(DevSocket, log_tx),
        offset_of!(DevSocket, version),
        PROTOCOL_VERSION as usize,
    ];
    crate::handle::layout_fingerprint(&[&layout]) << 16 | size_of::<DevSocket>() as u32
};

/// Slots of a socket service's mailbox by default ([`DevSocketService::slots`]): how many
/// connects, listens and accepts may be in flight at once.
pub const SERVICE_SLOTS: u32 = 64;
/// Bytes of a connect's address text ("host:port", NUL-padded), in [`SocketCall::text`].
pub const ADDR_TEXT_BYTES: usize = 64;

/// [`SocketCall::op`]: connect to the listener at [`SocketCall::text`] ("host:port").
pub const CALL_CONNECT: u32 = 1;
/// [`SocketCall::op`]: listen at [`SocketCall::port`] (0: any free port); answers the port.
pub const CALL_LISTEN: u32 = 2;
/// [`SocketCall::op`]: accept a connection at the listener of [`SocketCall::port`].
pub const CALL_ACCEPT: u32 = 3;
/// [`SocketCall::op`]: the caller is done with the socket [`SocketCall::arg`] (closed, or to
/// be dropped): the service frees it.
pub const CALL_RELEASE: u32 = 4;
/// [`SocketCall::op`]: stop listening at [`SocketCall::port`].
pub const CALL_UNLISTEN: u32 = 5;

/// One slot of a socket service's mailbox, in host memory the callers (a GPU's kernels, or CPU
/// threads) reach. Each word has one writer: the caller fills its half and posts call `n` by
/// raising `posted` to `n` last (release); the service answers in its half and raises
/// `answered` to `n` last. A caller that gives up waiting raises `cancelled` to `n`; the
/// service, seeing that before it answers, undoes the call (closes what it made) and answers
/// `CODE_TIMEOUT`. Callers take a slot by its lock in [`DevSocketService::locks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
pub struct SocketCall {
    /// The caller's newest call (from 1).
    pub posted: u64,
    /// The newest call the caller stopped waiting for.
    pub cancelled: u64,
    /// `CALL_*`.
    pub op: u32,
    /// The port of a listen, accept or unlisten.
    pub port: u32,
    /// The socket handle of a release.
    pub arg: u64,
    /// A connect's "host:port", NUL-padded.
    pub text: [u8; ADDR_TEXT_BYTES],
    /// Pads the caller's half to two cache lines.
    pub caller_pad: [u64; 4],
    /// The newest call answered: `status` and `value` are its answer.
    pub answered: u64,
    /// `CODE_OK`, or why the call failed (a `CODE_*` of the device crate).
    pub status: u32,
    /// Pads `status`.
    pub status_pad: u32,
    /// A connect's or accept's socket handle (a `DevSocket` address the caller reaches), a
    /// listen's port.
    pub value: u64,
    /// Pads the service's half to a cache line.
    pub service_pad: [u64; 5],
}

assert_layout!(SocketCall, 192, {
    posted => 0..8,
    cancelled => 8..16,
    op => 16..20,
    port => 20..24,
    arg => 24..32,
    text => 32..96,
    answered => 128..136,
    status => 136..140,
    value => 144..152,
});

/// A socket service as its callers see it: where the mailbox and the slots' locks are, and
/// how long a caller waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
pub struct DevSocketService {
    /// The [`SocketCall`] slots (host memory the callers reach).
    pub calls: u64,
    /// One u32 lock per slot, in memory every caller shares (GPU memory for a GPU's kernels).
    pub locks: u64,
    /// How long a caller waits for a free slot, and for an answer before it gives up (the
    /// service's own deadline for connects and accepts, and a margin).
    pub timeout_ns: u64,
    /// Slots in the mailbox.
    pub slots: u32,
    /// [`DEV_SOCKET_SERVICE_VERSION`].
    pub version: u32,
    /// Pads the handle to a cache line.
    pub pad: [u64; 4],
}

assert_layout!(DevSocketService, 64, {
    calls => 0..8,
    locks => 8..16,
    timeout_ns => 16..24,
    slots => 24..28,
    version => 28..32,
});

/// `DevSocketService::version` of this layout (and of [`SocketCall`]'s): the offsets
/// fingerprinted in the high 16 bits, the size in the low.
pub const DEV_SOCKET_SERVICE_VERSION: u32 = {
    use core::mem::{offset_of, size_of};
    let service = [
        size_of::<DevSocketService>(),
        offset_of!(DevSocketService, calls),
        offset_of!(DevSocketService, locks),
        offset_of!(DevSocketService, timeout_ns),
        offset_of!(DevSocketService, slots),
        offset_of!(DevSocketService, version),
    ];
    let call = [
        size_of::<SocketCall>(),
        offset_of!(SocketCall, posted),
        offset_of!(SocketCall, cancelled),
        offset_of!(SocketCall, op),
        offset_of!(SocketCall, port),
        offset_of!(SocketCall, arg),
        offset_of!(SocketCall, text),
        offset_of!(SocketCall, answered),
        offset_of!(SocketCall, status),
        offset_of!(SocketCall, value),
    ];
    crate::handle::layout_fingerprint(&[&service, &call]) << 16 | size_of::<DevSocketService>() as u32
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_words_fit_their_block_and_the_version_carries_the_size() {
        for w in [RESET, CREDIT, RESET_BY_CREDIT, FIN] {
            assert!(w % 8 == 0 && w + 8 <= CONTROL_BYTES);
        }
        assert_eq!(DEV_SOCKET_VERSION & 0xffff, 128);
        assert_ne!(DEV_SOCKET_VERSION >> 16, 0);
    }

    #[test]
    fn frames_are_padded_laid_from_the_end_down_and_tagged_by_position_and_length() {
        assert_eq!(
            [
                frame_bytes(0),
                frame_bytes(1),
                frame_bytes(112),
                frame_bytes(113),
                frame_bytes(65536)
            ],
            [128, 128, 128, 256, 65536 + 128]
        );
        // The first frame of a 4 KiB ring ends at its end; the next below it; a frame that
        // fills the lap starts at offset 0, and the next lap starts at the end again.
        assert_eq!(frame_offset(4096, 0, 80), 4016);
        assert_eq!(frame_offset(4096, 80, 32), 3984);
        assert_eq!(frame_offset(4096, 96, 4000), 0);
        assert_eq!(frame_offset(4096, 4096, 32), 4064);
        let key = 0x1234_5678_9abc_def1;
        let tag = frame_tag(4096, 64, key);
        assert_ne!(tag, frame_tag(0, 64, key), "a lap-old trailer");
        assert_ne!(tag, frame_tag(4096, 48, key), "another length");
        assert_ne!(tag, frame_tag(4096, 64, key ^ 2), "another connection");
        assert_ne!(frame_tag(0, 0, key), 0, "a zeroed ring");
    }
}
