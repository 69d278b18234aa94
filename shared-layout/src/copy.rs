//! The soft HCA's GPU copy service. The CPU cannot address device memory, and CUDA's copy calls
//! cost microseconds each, so the soft HCA hands data movement that touches GPU memory to a
//! persistent kernel (`gdaki_copier`): the host writes a [`CopyDesc`] into a host-pinned ring,
//! the kernel's blocks execute it together and publish a [`CopyDone`]. These are the layouts
//! both sides share.
use bytemuck::{Pod, Zeroable};

/// [`CopyDesc::op`]: copy `len` bytes from `src` to `dst` (ranges do not overlap); with a
/// [`CopyDesc::tail`], then `tail` bytes from `arg0` to `dst + len`, landed last (a gather of
/// two: a message's bytes from one buffer and its trailer from another, as one WRITE).
pub const OP_COPY: u32 = 1;
/// [`CopyDesc::op`]: 8-byte fetch-and-add of `arg0` at `dst`; the old value is the result.
pub const OP_FETCH_ADD: u32 = 2;
/// [`CopyDesc::op`]: 8-byte compare-and-swap at `dst` (compare `arg0`, swap `arg1`); the old
/// value is the result.
pub const OP_COMPARE_SWAP: u32 = 3;

/// [`CopyDesc::op`]: the `len` copies (at most [`LIST_MAX`]) listed as [`CopyItem`]s at `src`
/// (host-pinned, mapped into the GPU), executed together by one warp and answered once. Small
/// copies travel this way: one descriptor, one answer and one PCIe round trip for many.
pub const OP_COPY_LIST: u32 = 4;

/// [`CopyDesc::op`]: store the `len` bytes (1 to [`STORE_MAX`]) carried in the descriptor
/// itself, [`CopyDesc::src`] then [`CopyDesc::arg0`] in memory order, at `dst`. A small write
/// from host memory (an inline WRITE, a signal word) goes this way: the kernel reads nothing
/// but the descriptor, where a copy from the bounce buffer costs a second PCIe read. With
/// [`CopyDesc::arg1`] non-zero, the store lands only once every descriptor up to `arg1` is done
/// (a put's inline flag after the put's copies, without the host waiting for them).
pub const OP_STORE: u32 = 6;

/// Most bytes an [`OP_STORE`] carries.
pub const STORE_MAX: usize = 16;

/// [`CopyDesc::op`] in the kernel's mirror only, never posted by the host: the mirror warp has
/// already served this descriptor itself (a lone small one, see [`MIRROR_SERVES_MAX`], or one
/// of a message and its flag, see [`MIRROR_RUN_MAX`]), so no worker warp takes it.
pub const OP_SERVED: u32 = 5;

/// A descriptor that arrives alone (nothing else ready behind it) and is an atomic, or a copy
/// of at most this many bytes not ordered after an unfinished earlier copy, is served by the
/// warp that fetched it rather than handed to a worker warp: the hand-off through device memory
/// (mirror, fences, the worker's poll) costs more than such a copy. Larger copies still go to
/// the workers, so the fetching warp never stops watching the ring for long.
pub const MIRROR_SERVES_MAX: u64 = 256;

/// A run of at most this many descriptors that arrive together and end in an [`OP_STORE`]
/// ordered after the others (a message and its flag: a socket's chunk and its count, a put and
/// its signal) is served in order by the fetching warp too, as far as each would be served
/// alone (see [`MIRROR_SERVES_MAX`]): the store would wait for the copies anyway, and handing
/// them to worker warps costs a hand-off each and a wait between them.
pub const MIRROR_RUN_MAX: u64 = 4;

/// [`CopyDesc::span`] of an [`OP_COPY`] or [`OP_COPY_LIST`] whose next descriptor is an
/// [`OP_STORE`] that the host published before it (a message and its flag). The fetching warp's
/// lanes read their slots with loads that are not ordered with each other, so a look can find
/// the message without its flag; one that ends in a descriptor so marked looks once more at the
/// next slot alone, and serves the pair as one run (otherwise the flag waited a whole look).
pub const SPAN_FLAG_FOLLOWS: u16 = 1;

/// [`CopyDone::server`] of a descriptor that the mirror warp served (see [`OP_SERVED`]).
pub const SERVER_MIRROR: u64 = u64::MAX;

/// Most bytes of an [`OP_COPY`]'s [`CopyDesc::tail`]: a trailer and its padding, which one
/// lane moves after the copy's body.
pub const TAIL_MAX: usize = 256;

/// Most copies in one [`OP_COPY_LIST`] descriptor: one per lane of a warp.
pub const LIST_MAX: usize = 32;

/// One copy of an [`OP_COPY_LIST`] descriptor (ranges do not overlap each other or any other
/// copy of the list).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(32))]
pub struct CopyItem {
    /// Destination (GPU address).
    pub dst: u64,
    /// Source (GPU address).
    pub src: u64,
    /// Bytes.
    pub len: u64,
    /// Pads to 32 bytes.
    pub pad: u64,
}

/// One request to the copier, in a host-pinned ring slot. The host fills every field, then
/// stores `seq` (release); the kernel executes descriptor `n` once it reads `seq == n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
pub struct CopyDesc {
    /// Sequence number, from 1: written last.
    pub seq: u64,
    /// Destination (GPU address: device memory or host memory mapped into the GPU).
    pub dst: u64,
    /// Source (likewise; unused by atomics); for [`OP_STORE`], the first 8 bytes to store.
    pub src: u64,
    /// Bytes (copies).
    pub len: u64,
    /// First operand (atomics); for [`OP_STORE`], bytes 8 to 15 to store; for an [`OP_COPY`]
    /// with a [`tail`](Self::tail), where the tail's bytes come from.
    pub arg0: u64,
    /// Second operand (compare-and-swap); for [`OP_COPY`] and [`OP_COPY_LIST`], the
    /// descriptor that must be done before this one starts (0: none): a copy onto bytes an
    /// earlier copy still writes is ordered after it on the GPU, without the host waiting; for
    /// [`OP_STORE`], the last of the descriptors that must all be done before it (0: none).
    pub arg1: u64,
    /// `OP_*`.
    pub op: u32,
    /// For an [`OP_STORE`] ordered after `arg1`: how many descriptors up to `arg1` it waits
    /// for (`arg1 - span + 1 ..= arg1`, the ones the host has not seen answered; 0: every one
    /// still in the ring; at most [`RING_SLOTS`]). For a copy, [`SPAN_FLAG_FOLLOWS`] or 0.
    /// Else 0.
    pub span: u16,
    /// For an [`OP_COPY`]: bytes (at most [`TAIL_MAX`]) copied from `arg0` to `dst + len`
    /// after the `len` bytes, its final unit landing last; 0: none. Else 0.
    pub tail: u16,
    /// The host leaves it 0; in the kernel's mirror, when the descriptor was seen (GPU global
    /// timer, ns), for [`CopyDone::stamps`].
    pub seen: u64,
}

/// The kernel's answer to descriptor `seq`, in a host-pinned slot of its own: `result` first,
/// then `seq` (system-scope release), so a host that reads `seq` sees the data and the result.
/// Answers come in any order (each slot says which descriptor it answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
pub struct CopyDone {
    /// The descriptor executed.
    pub seq: u64,
    /// Atomics: the old value.
    pub result: u64,
    /// Where the time went, GPU global timer ns (coarse: the timer ticks in steps of up to a
    /// microsecond on some GPUs): when the kernel saw the descriptor in the host ring, when the
    /// serving warp started it, and when it finished (just before this answer). Diagnostics
    /// only; [`STAMP_SEEN`], [`STAMP_STARTED`], [`STAMP_FINISHED`] index it.
    pub stamps: [u64; 3],
    /// Which warp served it (diagnostics): [`SERVER_MIRROR`], or the index of the worker warp
    /// that answered.
    pub server: u64,
    /// Pads to a cache line.
    pub pad: [u64; 2],
}

/// [`CopyDone::stamps`]: the kernel saw the descriptor in the host ring.
pub const STAMP_SEEN: usize = 0;
/// [`CopyDone::stamps`]: the serving warp started it.
pub const STAMP_STARTED: usize = 1;
/// [`CopyDone::stamps`]: the serving warp finished it (its bytes are visible).
pub const STAMP_FINISHED: usize = 2;

/// The copier's working state in device memory (zeroed before each launch): block 0 mirrors
/// descriptors here from the host ring, and warps sharing a large copy count themselves done
/// per slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
pub struct CopierState {
    /// The newest descriptor mirrored (its `seq`).
    pub head: u64,
    /// Set by block 0 when the host asked the kernel to stop.
    pub stop: u64,
    /// Pads the hot line.
    pub pad: [u64; 6],
}

/// Descriptors in the ring (a power of two): how many may be outstanding. Enough to keep the
/// kernel's warps busy with small copies while answers cross PCIe.
pub const RING_SLOTS: usize = 256;

/// The copier's working area in device memory is one zeroed allocation of [`WORK_BYTES`]:
/// the [`CopierState`] at offset 0, then the mirrored descriptors ([`WORK_MIRROR`]), each
/// slot's count of warps done with a large copy ([`WORK_FINISHED`], u64s) and each slot's
/// newest descriptor done, for copies that wait for one ([`WORK_COMPLETED`], u64s).
pub const WORK_MIRROR: usize = 64;
/// See [`WORK_MIRROR`].
pub const WORK_FINISHED: usize = WORK_MIRROR + 64 * RING_SLOTS;
/// See [`WORK_MIRROR`].
pub const WORK_COMPLETED: usize = WORK_FINISHED + 8 * RING_SLOTS;
/// See [`WORK_MIRROR`].
pub const WORK_BYTES: usize = WORK_COMPLETED + 8 * RING_SLOTS;

const _: () = {
    use core::mem::size_of;
    assert!(size_of::<CopyDesc>() == 64 && size_of::<CopyDone>() == 64 && size_of::<CopierState>() == 64);
    assert!(size_of::<CopyItem>() == 32 && LIST_MAX <= 32);
    assert!(RING_SLOTS.is_power_of_two() && RING_SLOTS <= u16::MAX as usize && TAIL_MAX <= u16::MAX as usize);
};
