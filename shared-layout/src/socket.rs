//! A byte-stream socket over one queue pair (docs/sockets.md): the control words of a receive
//! window, and the handle the socket functions take.
use bytemuck::{Pod, Zeroable};

/// The wire protocol's version, in the handshake's `gdaki-socket/N`.
pub const PROTOCOL_VERSION: u32 = 2;

/// Bytes of control words at the start of a receive window; the receive ring follows.
pub const CONTROL_BYTES: u64 = 256;
/// `arrived`: stream bytes the peer has put into the ring (its inline WRITE of its stream
/// length, after the bytes' WRITEs).
pub const ARRIVED: u64 = 0;
/// `reset`: non-zero once the peer reset the connection. Written twice, here beside `arrived`
/// and at [`RESET_BY_CREDIT`] beside `credit`, so a receiver's and a sender's look are one
/// 16-byte load each.
pub const RESET: u64 = 8;
/// `credit`: how much of this side's stream the peer has read (its inline WRITE).
pub const CREDIT: u64 = 16;
/// The second copy of `reset`.
pub const RESET_BY_CREDIT: u64 = 24;
/// `fin`: 0 while the peer sends; its stream's length + 1 once it shut down its sending side.
pub const FIN: u64 = 32;

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
    /// Bytes of this stream put to the peer.
    pub sent: u64,
    /// Bytes of the peer's stream taken out of the receive ring.
    pub consumed: u64,
    /// `consumed` as last written to the peer's `credit`.
    pub credited: u64,
    /// `SOCKET_*` bits.
    pub flags: u64,
    /// Pads the state line.
    pub state_pad: [u64; 4],
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_words_fit_their_block_and_the_version_carries_the_size() {
        for w in [ARRIVED, RESET, CREDIT, RESET_BY_CREDIT, FIN] {
            assert!(w % 8 == 0 && w + 8 <= CONTROL_BYTES);
        }
        assert_eq!(DEV_SOCKET_VERSION & 0xffff, 128);
        assert_ne!(DEV_SOCKET_VERSION >> 16, 0);
    }
}
