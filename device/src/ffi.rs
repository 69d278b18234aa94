//! The data path through the C ABI: `extern "C"` functions for CUDA C++ kernels (and, on the
//! host, for C code in CPU mode), declared in the generated `gdaki_device.h`.
//!
//! Each operation exists once per execution scope and sharing mode, named
//! `gdaki_<operation>_<scope>_<mode>` (`gdaki_put_warp_cta`): scopes `thread`, `warp`, `block`
//! ([`crate::scope`]), modes `exclusive`, `cta`, `gpu` ([`crate::sharing`]). On the host only
//! thread scope exists.
//!
//! Only scalars and pointers cross the boundary (by-value structs would keep a clang-CUDA
//! caller from inlining): a remote buffer is an address and an rkey, a local one an address
//! and an lkey. Every function returns a status code ([`crate::status`]: `CODE_OK`, ...) and
//! writes what it produces (a ticket, a fetched value) through an out-pointer, which may be
//! null when the caller does not want it.
//!
//! Arguments are checked before anything is touched: a null handle, or one whose version word
//! is not [`DEV_QP_VERSION`] (code built against another layout, or a pointer that is no
//! handle) is `CODE_BAD_HANDLE`; unknown [`POST_FLAGS`] bits or a null block scratch area are
//! `CODE_BAD_ARGUMENT`; a warp that is not whole and converged is `CODE_BAD_SCOPE`. In warp
//! and block scope the calls are collectives ([`crate::scope`]): every member calls with the
//! same handle, flags and scratch (those are the group's, so a refusal reaches every member
//! alike) and its own buffers. A member's own bad argument (inline data too long, a misaligned
//! atomic target) reaches that member only, and it still takes part, posting nothing.
//!
//! Every entry point is `#[inline(always)]`: rustc 1.96 warns that it ignores `#[inline]` on an
//! exported function but still gives it LLVM's `alwaysinline`, so a clang-CUDA build that links
//! the crate's bitcode (`tools/cuda/clang-kernel.sh`) inlines every call into its kernels, and the
//! PTX still defines each function for callers that link. `tools/tests/registers.rs` fails if a
//! call is left in the inlined probes, which is what would show a rustc that dropped it.
//!
//! [`OPERATIONS`] describes every function's C parameters; `gen-headers` (gdaki-tools) writes the
//! header from it, so the functions and their declarations come from the one table below.
use core::ptr::addr_of;

use gdaki_layout::handle::{DEV_QP_VERSION, DEV_RQ_VERSION};
use gdaki_layout::{DevQp, DevRq};

use crate::qp::{Local, Qp, Remote, MAX_INLINE, MAX_SEND_INLINE};
use crate::rq::{RecvBuf, RecvKind, Rq};
#[cfg(target_arch = "nvptx64")]
use crate::scope::{Block, BlockScratch, Warp};
use crate::scope::{Scope, Thread};
use crate::sharing::{Cta, Exclusive, Gpu, Sharing};
use crate::status::{PostError, Ticket, CODE_BAD_ARGUMENT, CODE_BAD_HANDLE, CODE_OK};

/// Post flag: leave the doorbell to a later `gdaki_commit_*` (see [`Qp::deferred`]).
pub const POST_DEFER: u32 = 1 << 0;
/// Post flag: the post starts after every earlier get and atomic of the QP has completed
/// (see [`Qp::fenced`]).
pub const POST_FENCE: u32 = 1 << 1;
/// Every post flag; other bits are refused.
pub const POST_FLAGS: u32 = POST_DEFER | POST_FENCE;

/// The handle as `flags` ask, or `None` for unknown bits.
#[inline(always)]
fn flagged<M: Sharing, S: Scope>(qp: Qp<M, S>, flags: u32) -> Option<Qp<M, S>> {
    if flags & !POST_FLAGS != 0 {
        return None;
    }
    let qp = if flags & POST_DEFER != 0 { qp.deferred() } else { qp };
    Some(if flags & POST_FENCE != 0 { qp.fenced() } else { qp })
}

/// Writes `value` to `out` unless it is null.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
#[inline(always)]
unsafe fn give<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: not null, so valid per the contract.
        unsafe { out.write(value) };
    }
}

/// The code of a post, its ticket written to `ticket`.
///
/// # Safety
/// As [`give`].
#[inline(always)]
unsafe fn posted(r: Result<Ticket, PostError>, ticket: *mut u64) -> u32 {
    match r {
        Ok(t) => {
            // SAFETY: per the contract.
            unsafe { give(ticket, t) };
            CODE_OK
        }
        Err(e) => e.code(),
    }
}

/// Whether `qp` is a queue-pair handle of this layout (its version word matches).
///
/// # Safety
/// `qp` is null or points to readable memory of a `DevQp`'s size.
#[inline(always)]
unsafe fn is_qp_handle(qp: *const DevQp) -> bool {
    // SAFETY: readable per the contract; the constant line is written once, before any use.
    !qp.is_null() && unsafe { addr_of!((*qp).version).read() } == DEV_QP_VERSION
}

/// Checks the handle, then runs `f` with it in the caller's scope.
///
/// # Safety
/// `qp` is null or points to readable memory of a `DevQp`'s size; if its version word matches,
/// it is an exported handle as [`Qp::from_raw`] requires, used in mode `M` by scope `S`.
#[inline(always)]
unsafe fn enter<M: Sharing, S: Scope>(qp: *mut DevQp, scope: Result<S, u32>, f: impl FnOnce(Qp<M, S>) -> u32) -> u32 {
    // SAFETY: the contract.
    if !unsafe { is_qp_handle(qp) } {
        return CODE_BAD_HANDLE;
    }
    match scope {
        // SAFETY: a handle of this layout, per the contract.
        Ok(scope) => f(unsafe { Qp::<M>::from_raw(qp) }.with_scope(scope)),
        Err(code) => code,
    }
}

/// What inline data a member passes on, for an operation that carries at most `max` bytes
/// ([`MAX_INLINE`] or [`MAX_SEND_INLINE`]): its bytes, or, for a null pointer with a length,
/// more bytes than a WQE holds, so the member still takes part in the group's post and is
/// refused.
///
/// # Safety
/// `data` is null or valid for reads of `len` bytes.
#[inline(always)]
unsafe fn inline_bytes<'a>(data: *const u8, len: u32, max: usize) -> (&'a [u8], bool) {
    static TOO_LONG: [u8; MAX_SEND_INLINE + 1] = [0; MAX_SEND_INLINE + 1];
    match (data.is_null(), len) {
        (_, 0) => (&[], true),
        (true, _) => (&TOO_LONG[..max + 1], false),
        // More than `max + 1` bytes is refused all the same; never read past `len`.
        // SAFETY: valid for `len` bytes per the contract, and this is at most `len`.
        (false, n) => (
            unsafe { core::slice::from_raw_parts(data, (n as usize).min(max + 1)) },
            true,
        ),
    }
}

/// A function's C parameter type, for the header generator.
#[cfg(not(target_arch = "nvptx64"))]
pub trait CType {
    /// The C spelling.
    const C: &'static str;
}
#[cfg(not(target_arch = "nvptx64"))]
macro_rules! c_types {
    ($($t:ty => $c:literal),* $(,)?) => {
        $(impl CType for $t {
            const C: &'static str = $c;
        })*
    };
}
#[cfg(not(target_arch = "nvptx64"))]
c_types!(
    u32 => "uint32_t",
    u64 => "uint64_t",
    *mut u64 => "uint64_t *",
    *mut u32 => "uint32_t *",
    *const u64 => "const uint64_t *",
    *const u8 => "const void *",
    *mut u8 => "void *",
    *const core::ffi::c_char => "const char *",
    *const DevQp => "const gdaki_dev_qp *",
    *mut gdaki_layout::socket::DevSocket => "gdaki_dev_socket *",
    *mut *mut gdaki_layout::socket::DevSocket => "gdaki_dev_socket **",
);

/// One parameter of an operation.
#[cfg(not(target_arch = "nvptx64"))]
#[derive(Debug, Clone, Copy)]
pub struct Param {
    /// Its name.
    pub name: &'static str,
    /// Its C type.
    pub c_type: &'static str,
}

/// One operation of the C ABI: `gdaki_<name>_<scope>_<mode>(gdaki_dev_qp *qp, [block scope:
/// gdaki_block_scratch *block_scratch,] params...)`, returning a status code.
#[cfg(not(target_arch = "nvptx64"))]
#[derive(Debug, Clone, Copy)]
pub struct Operation {
    /// The operation's name.
    pub name: &'static str,
    /// What it does (the doc comment, one line per source line).
    pub doc: &'static str,
    /// Its parameters after the handle (and the scratch area).
    pub params: &'static [Param],
}

/// The scopes, in the names' spelling.
pub const SCOPES: [&str; 3] = ["thread", "warp", "block"];
/// The sharing modes, in the names' spelling.
pub const MODES: [&str; 3] = ["exclusive", "cta", "gpu"];

/// Defines the operations once: generic Rust bodies in `ops`, their descriptors in
/// [`OPERATIONS`], and the `extern "C"` entry points of every scope and mode. The header line
/// names the handle's C parameter and type, the function that checks it and hands the body its
/// Rust form (`Body<M, S>`), and that form: the queue pair's here, the socket's in [`socket`].
macro_rules! c_abi {
    (
        handle $h:ident: $hty:ty, $enter:ident, $Body:ident;
        $(
            $(#[doc = $doc:literal])*
            fn $op:ident($qp:ident $(, $arg:ident: $ty:ty)* $(,)?) $body:block
        )*
    ) => {
        /// The operations' bodies, generic over mode and scope; each returns a status code.
        mod ops {
            use super::*;
            $(
                $(#[doc = $doc])*
                ///
                /// # Safety
                /// As the entry points require: every pointer argument is null or valid for
                /// what the operation reads or writes through it.
                #[inline(always)]
                #[allow(clippy::too_many_arguments)]
                pub(super) unsafe fn $op<M: Sharing, S: Scope>($qp: $Body<M, S> $(, $arg: $ty)*) -> u32 $body
            )*
        }

        /// Every operation, as the header declares it.
        #[cfg(not(target_arch = "nvptx64"))]
        pub const OPERATIONS: &[Operation] = &[$(Operation {
            name: stringify!($op),
            doc: concat!($($doc, "\n"),*),
            params: &[$(Param { name: stringify!($arg), c_type: <$ty as CType>::C }),*],
        }),*];

        entry_points!(thread_exclusive, "thread_exclusive", Exclusive, Thread; $h: $hty, $enter; $($op($($arg: $ty),*))*);
        entry_points!(thread_cta, "thread_cta", Cta, Thread; $h: $hty, $enter; $($op($($arg: $ty),*))*);
        entry_points!(thread_gpu, "thread_gpu", Gpu, Thread; $h: $hty, $enter; $($op($($arg: $ty),*))*);
        #[cfg(target_arch = "nvptx64")]
        entry_points!(warp_exclusive, "warp_exclusive", Exclusive, Warp; $h: $hty, $enter; $($op($($arg: $ty),*))*);
        #[cfg(target_arch = "nvptx64")]
        entry_points!(warp_cta, "warp_cta", Cta, Warp; $h: $hty, $enter; $($op($($arg: $ty),*))*);
        #[cfg(target_arch = "nvptx64")]
        entry_points!(warp_gpu, "warp_gpu", Gpu, Warp; $h: $hty, $enter; $($op($($arg: $ty),*))*);
        #[cfg(target_arch = "nvptx64")]
        entry_points!(@block block_exclusive, "block_exclusive", Exclusive; $h: $hty, $enter; $($op($($arg: $ty),*))*);
        #[cfg(target_arch = "nvptx64")]
        entry_points!(@block block_cta, "block_cta", Cta; $h: $hty, $enter; $($op($($arg: $ty),*))*);
        #[cfg(target_arch = "nvptx64")]
        entry_points!(@block block_gpu, "block_gpu", Gpu; $h: $hty, $enter; $($op($($arg: $ty),*))*);
    };
}

/// The `extern "C"` functions of one scope and mode, in a module named after them.
macro_rules! entry_points {
    ($module:ident, $suffix:literal, $mode:ty, $scope:ty; $h:ident: $hty:ty, $enter:ident; $($op:ident($($arg:ident: $ty:ty),*))*) => {
        #[doc = concat!("The C ABI in ", $suffix, " (`gdaki_<operation>_", $suffix, "`).")]
        pub mod $module {
            use super::*;
            $(
                #[doc = concat!("`gdaki_", stringify!($op), "_", $suffix, "`, as `gdaki_device.h` documents it.")]
                ///
                /// # Safety
                /// The handle is null or an exported one used in this scope and mode;
                /// pointers are null where allowed or valid for what the header says.
                #[export_name = concat!("gdaki_", stringify!($op), "_", $suffix)]
                #[allow(clippy::too_many_arguments)]
                // Always inlined by clang builds that link the bitcode (module docs).
                #[allow(unused_attributes)]
                #[inline(always)]
                pub unsafe extern "C" fn $op($h: $hty $(, $arg: $ty)*) -> u32 {
                    // SAFETY: the caller's contract is the one the enter function and the body need.
                    unsafe { $enter::<$mode, $scope>($h, <$scope as Here>::here(), |h| ops::$op(h $(, $arg)*)) }
                }
            )*
        }
    };
    (@block $module:ident, $suffix:literal, $mode:ty; $h:ident: $hty:ty, $enter:ident; $($op:ident($($arg:ident: $ty:ty),*))*) => {
        #[doc = concat!("The C ABI in ", $suffix, " (`gdaki_<operation>_", $suffix, "`).")]
        pub mod $module {
            use super::*;
            $(
                #[doc = concat!("`gdaki_", stringify!($op), "_", $suffix, "`, as `gdaki_device.h` documents it.")]
                ///
                /// # Safety
                /// The handle is null or an exported one used in this scope and mode;
                /// `block_scratch` is null or a block scratch area every thread of the block
                /// passes and no one else uses meanwhile; other pointers are null where
                /// allowed or valid for what the header says.
                #[export_name = concat!("gdaki_", stringify!($op), "_", $suffix)]
                #[allow(clippy::too_many_arguments)]
                // Always inlined by clang builds that link the bitcode (module docs).
                #[allow(unused_attributes)]
                #[inline(always)]
                pub unsafe extern "C" fn $op($h: $hty, block_scratch: *mut BlockScratch $(, $arg: $ty)*) -> u32 {
                    let scope = if block_scratch.is_null() {
                        Err(CODE_BAD_ARGUMENT)
                    } else {
                        // SAFETY: per the contract.
                        Ok(unsafe { Block::new(block_scratch) })
                    };
                    // SAFETY: the caller's contract is the one the enter function and the body need.
                    unsafe { $enter::<$mode, Block>($h, scope, |h| ops::$op(h $(, $arg)*)) }
                }
            )*
        }
    };
}

/// The calling thread's member of a scope without arguments (thread, warp).
trait Here: Scope {
    fn here() -> Result<Self, u32>;
}
impl Here for Thread {
    #[inline(always)]
    fn here() -> Result<Self, u32> {
        Ok(Thread)
    }
}
#[cfg(target_arch = "nvptx64")]
impl Here for Warp {
    #[inline(always)]
    fn here() -> Result<Self, u32> {
        Warp::converged().ok_or(crate::status::CODE_BAD_SCOPE)
    }
}

c_abi! {
    handle qp: *mut DevQp, enter, Qp;

    /// RDMA WRITE of `len` bytes from local `src` (key `lkey`) to remote `dst` (key `rkey`),
    /// split into as many WQEs as the QP's largest message needs, at most one send queue of
    /// them (more: `GDAKI_CODE_BAD_COUNT`, nothing posted; 0 bytes posts a NOP).
    /// `flags`: `GDAKI_POST_*`. `*ticket` (unless null) gets the ticket to wait on.
    fn put(qp, dst: u64, rkey: u32, src: u64, lkey: u32, len: u64, flags: u32, ticket: *mut u64) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        // SAFETY (every body): out-pointers and data as the header documents them.
        unsafe { posted(qp.put(Remote { addr: dst, rkey }, Local { addr: src, lkey }, len), ticket) }
    }

    /// RDMA WRITE of the `len` bytes at `data`, carried in the WQE (at most
    /// `GDAKI_MAX_INLINE`; no local key needed, and `data` may be reused at once).
    fn put_inline(qp, dst: u64, rkey: u32, data: *const u8, len: u32, flags: u32, ticket: *mut u64) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        // SAFETY: `data` is null or holds `len` readable bytes (this function's contract).
        let (bytes, valid) = unsafe { inline_bytes(data, len, MAX_INLINE) };
        match unsafe { posted(qp.put_inline(Remote { addr: dst, rkey }, bytes), ticket) } {
            _ if !valid => CODE_BAD_ARGUMENT,
            code => code,
        }
    }

    /// `put`, then an atomic add of `add` at remote `signal` (8-byte aligned, key
    /// `signal_rkey`), posted together: the signal is visible only after the data. The fetched
    /// value lands in the 8 bytes at local `scratch` (key `scratch_lkey`), never read. `len` 0
    /// posts the signal alone.
    fn put_signal(
        qp, dst: u64, rkey: u32, src: u64, lkey: u32, len: u64, signal: u64, signal_rkey: u32,
        add: u64, scratch: u64, scratch_lkey: u32, flags: u32, ticket: *mut u64,
    ) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        let (dst, src) = (Remote { addr: dst, rkey }, Local { addr: src, lkey });
        let (signal, scratch) = (Remote { addr: signal, rkey: signal_rkey }, Local { addr: scratch, lkey: scratch_lkey });
        // SAFETY: `ticket` is null or writable (this function's contract).
        unsafe { posted(qp.put_signal(dst, src, len, signal, add, scratch), ticket) }
    }

    /// An atomic add of `add` at remote `signal` (8-byte aligned, key `signal_rkey`); the
    /// fetched value lands in local `scratch` (key `scratch_lkey`), never read.
    fn signal(qp, signal: u64, signal_rkey: u32, add: u64, scratch: u64, scratch_lkey: u32, flags: u32, ticket: *mut u64) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        let (signal, scratch) = (Remote { addr: signal, rkey: signal_rkey }, Local { addr: scratch, lkey: scratch_lkey });
        // SAFETY: `ticket` is null or writable (this function's contract).
        unsafe { posted(qp.signal(signal, add, scratch), ticket) }
    }

    /// A counter that advances when an operation of QP `data_qp` completes, the HCA alone doing
    /// it: posts on `qp`, which must be cross-channel (`gdaki_qp_config.cross_channel`), a WAIT
    /// for `data_qp`'s completion of `data_ticket`, then an atomic add of `add` at remote
    /// `counter` (8-byte aligned, key `counter_rkey`; `qp` connected to a QP of its own context
    /// makes it a local counter). The fetched value lands in local `scratch` (key
    /// `scratch_lkey`), never read. `*ticket` gets `qp`'s ticket (the add's). A failed
    /// operation of `data_qp` counts too (its error stays on `data_qp`).
    fn count_when_done(
        qp, data_qp: *const DevQp, data_ticket: u64, counter: u64, counter_rkey: u32, add: u64,
        scratch: u64, scratch_lkey: u32, flags: u32, ticket: *mut u64,
    ) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        // SAFETY: `data_qp` is null or readable as a handle (this function's contract).
        if !unsafe { is_qp_handle(data_qp) } {
            return CODE_BAD_HANDLE;
        }
        // SAFETY: a handle of this layout: its CQ number is a constant field.
        let cqn = unsafe { addr_of!((*data_qp).cq.cqn).read() };
        let (counter, scratch) = (Remote { addr: counter, rkey: counter_rkey }, Local { addr: scratch, lkey: scratch_lkey });
        // SAFETY: `ticket` is null or writable (this function's contract).
        unsafe { posted(qp.count_after_cqe(cqn, data_ticket, counter, add, scratch), ticket) }
    }

    /// RDMA READ of `len` bytes from remote `src` (key `rkey`) into local `dst` (key `lkey`);
    /// the data is there once the ticket has completed.
    fn get(qp, dst: u64, lkey: u32, src: u64, rkey: u32, len: u64, flags: u32, ticket: *mut u64) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        // SAFETY: `ticket` is null or writable (this function's contract).
        unsafe { posted(qp.get(Local { addr: dst, lkey }, Remote { addr: src, rkey }, len), ticket) }
    }

    /// Atomic fetch-and-add of `add` at remote `target` (8-byte aligned, key `rkey`), through
    /// the 8-byte local buffer `result` (key `lkey`); waits, and writes the value before the
    /// add to `*fetched` (unless null).
    fn atomic_fetch_add(qp, target: u64, rkey: u32, add: u64, result: u64, lkey: u32, flags: u32, fetched: *mut u64) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        match qp.atomic_fetch_add(Remote { addr: target, rkey }, add, Local { addr: result, lkey }) {
            Ok(v) => {
                // SAFETY: `fetched` is null or writable (this function's contract).
                unsafe { give(fetched, v) };
                CODE_OK
            }
            Err(e) => e.code(),
        }
    }

    /// Atomic compare-and-swap at remote `target` (8-byte aligned, key `rkey`): if it holds
    /// `compare`, it becomes `swap`. Through the 8-byte local buffer `result` (key `lkey`);
    /// waits, and writes the value found to `*fetched` (unless null; equal to `compare` when
    /// the swap happened).
    fn atomic_compare_swap(
        qp, target: u64, rkey: u32, compare: u64, swap: u64, result: u64, lkey: u32, flags: u32,
        fetched: *mut u64,
    ) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        match qp.atomic_compare_swap(Remote { addr: target, rkey }, compare, swap, Local { addr: result, lkey }) {
            Ok(v) => {
                // SAFETY: `fetched` is null or writable (this function's contract).
                unsafe { give(fetched, v) };
                CODE_OK
            }
            Err(e) => e.code(),
        }
    }

    /// SEND of `len` bytes from local `src` (key `lkey`): they land in the buffers of the
    /// peer's next receive. One WQE: longer than the QP's largest message is
    /// `GDAKI_CODE_TOO_LONG`, nothing posted.
    fn send(qp, src: u64, lkey: u32, len: u64, flags: u32, ticket: *mut u64) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        // SAFETY: `ticket` is null or writable (this function's contract).
        unsafe { posted(qp.send(Local { addr: src, lkey }, len), ticket) }
    }

    /// `send` with 32 bits of immediate data, which the peer's receive completion carries.
    fn send_imm(qp, src: u64, lkey: u32, len: u64, imm: u32, flags: u32, ticket: *mut u64) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        // SAFETY: `ticket` is null or writable (this function's contract).
        unsafe { posted(qp.send_imm(Local { addr: src, lkey }, len, imm), ticket) }
    }

    /// SEND of the `len` bytes at `data`, carried in the WQE (at most `GDAKI_MAX_SEND_INLINE`;
    /// no local key needed, and `data` may be reused at once).
    fn send_inline(qp, data: *const u8, len: u32, flags: u32, ticket: *mut u64) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        // SAFETY: `data` is null or holds `len` readable bytes (this function's contract).
        let (bytes, valid) = unsafe { inline_bytes(data, len, MAX_SEND_INLINE) };
        match unsafe { posted(qp.send_inline(bytes), ticket) } {
            _ if !valid => CODE_BAD_ARGUMENT,
            code => code,
        }
    }

    /// RDMA WRITE of `len` bytes from local `src` (key `lkey`) to remote `dst` (key `rkey`)
    /// whose last WQE carries immediate data `imm`: once every byte is in place, the peer's
    /// next receive completes with `imm`. Split as `put` is.
    fn write_imm(qp, dst: u64, rkey: u32, src: u64, lkey: u32, len: u64, imm: u32, flags: u32, ticket: *mut u64) {
        let Some(qp) = flagged(qp, flags) else { return CODE_BAD_ARGUMENT };
        let (dst, src) = (Remote { addr: dst, rkey }, Local { addr: src, lkey });
        // SAFETY: `ticket` is null or writable (this function's contract).
        unsafe { posted(qp.write_imm(dst, src, len, imm), ticket) }
    }

    /// Waits (bounded by the QP's timeout) until the operation that returned `ticket` has
    /// completed, ringing first for anything deferred.
    fn wait(qp, ticket: u64) {
        qp.wait(ticket).map_or_else(|e| e.code(), |()| CODE_OK)
    }

    /// Waits until every operation posted on the QP so far has completed.
    fn quiet(qp) {
        qp.quiet().map_or_else(|e| e.code(), |()| CODE_OK)
    }

    /// Rings the doorbell for every post made with `GDAKI_POST_DEFER` and not rung yet.
    fn commit(qp) {
        qp.commit().map_or_else(|e| e.code(), |()| CODE_OK)
    }

    /// Waits (bounded by the QP's timeout) until the u64 at `signal` (8-byte aligned, local
    /// memory peers signal) is at least `value`. Each calling thread waits on its own, in
    /// every scope.
    fn wait_signal(qp, signal: *const u64, value: u64) {
        if signal.is_null() || signal as usize % 8 != 0 {
            return CODE_BAD_ARGUMENT;
        }
        // SAFETY: `signal` is a readable, 8-byte aligned word (this function's contract).
        unsafe { qp.wait_signal(signal, value) }.map_or_else(|e| e.code(), |()| CODE_OK)
    }
}

/// Checks a receive-queue handle, then runs `f` with it.
///
/// # Safety
/// `rq` is null or points to readable memory of a `DevRq`'s size; if its version word
/// matches, it is an exported handle as [`Rq::from_raw`] requires, used in mode `M`.
#[inline(always)]
unsafe fn enter_rq<M: Sharing>(rq: *mut DevRq, f: impl FnOnce(Rq<M>) -> u32) -> u32 {
    // SAFETY: readable per the contract; the constant line is written once, before any use.
    if rq.is_null() || unsafe { addr_of!((*rq).version).read() } != DEV_RQ_VERSION {
        return CODE_BAD_HANDLE;
    }
    // SAFETY: a handle of this layout, per the contract.
    f(unsafe { Rq::<M>::from_raw(rq) })
}

/// Defines the receive-queue operations once, as [`c_abi!`] does the queue pair's: generic Rust
/// bodies in `recv_ops`, their descriptors in [`RECV_OPERATIONS`], and the `extern "C"` entry
/// points of every sharing mode, `gdaki_<name>_<mode>(gdaki_dev_rq *rq, params...)`, per
/// thread in every scope, each returning a status code.
macro_rules! recv_abi {
    ($(
        $(#[doc = $doc:literal])*
        fn $op:ident($rq:ident $(, $arg:ident: $ty:ty)* $(,)?) $body:block
    )*) => {
        /// The receive operations' bodies, generic over the mode; each returns a status code.
        mod recv_ops {
            use super::*;
            $(
                $(#[doc = $doc])*
                ///
                /// # Safety
                /// As the entry points require: every pointer argument is null or valid for
                /// what the operation reads or writes through it.
                #[inline(always)]
                pub(super) unsafe fn $op<M: Sharing>($rq: Rq<M> $(, $arg: $ty)*) -> u32 $body
            )*
        }

        /// Every receive-queue operation, as the header declares it.
        #[cfg(not(target_arch = "nvptx64"))]
        pub const RECV_OPERATIONS: &[Operation] = &[$(Operation {
            name: stringify!($op),
            doc: concat!($($doc, "\n"),*),
            params: &[$(Param { name: stringify!($arg), c_type: <$ty as CType>::C }),*],
        }),*];

        recv_entry_points!(recv_exclusive, "exclusive", Exclusive; $($op($($arg: $ty),*))*);
        recv_entry_points!(recv_cta, "cta", Cta; $($op($($arg: $ty),*))*);
        recv_entry_points!(recv_gpu, "gpu", Gpu; $($op($($arg: $ty),*))*);
    };
}

/// The receive-queue functions of one sharing mode, in a module named after it.
macro_rules! recv_entry_points {
    ($module:ident, $suffix:literal, $mode:ty; $($op:ident($($arg:ident: $ty:ty),*))*) => {
        #[doc = concat!("The receive-queue C ABI in mode ", $suffix, " (`gdaki_<operation>_", $suffix, "`).")]
        pub mod $module {
            use super::*;
            $(
                #[doc = concat!("`gdaki_", stringify!($op), "_", $suffix, "`, as `gdaki_device.h` documents it.")]
                ///
                /// # Safety
                /// `rq` is null or an exported receive-queue handle used in this mode; pointers
                /// are null where allowed or valid for what the header says.
                #[export_name = concat!("gdaki_", stringify!($op), "_", $suffix)]
                // Always inlined by clang builds that link the bitcode (module docs).
                #[allow(unused_attributes)]
                #[inline(always)]
                pub unsafe extern "C" fn $op(rq: *mut DevRq $(, $arg: $ty)*) -> u32 {
                    // SAFETY: the caller's contract is the one `enter_rq` and the body need.
                    unsafe { enter_rq::<$mode>(rq, |rq| recv_ops::$op(rq $(, $arg)*)) }
                }
            )*
        }
    };
}

recv_abi! {
    /// Posts a receive of one buffer: local `addr` (key `lkey`, local write), `len` bytes.
    /// `*ticket` (unless null) gets the receive's ticket for `gdaki_poll_recv`.
    fn post_recv(rq, addr: u64, lkey: u32, len: u32, ticket: *mut u64) {
        // SAFETY: `ticket` is null or writable (this function's contract).
        unsafe { posted(rq.post_recv_one(Local { addr, lkey }, len), ticket) }
    }

    /// Posts `n` receives of one buffer each, `len` bytes at `addrs[i]` (key `lkey`), behind
    /// one fence and one doorbell-record update: all of them, or none on an error (more
    /// than the queue holds is `GDAKI_CODE_BAD_COUNT`; `addrs` null with `n` above 0,
    /// `GDAKI_CODE_BAD_ARGUMENT`). `*ticket` (unless null) gets the first one's ticket; the
    /// others follow it.
    fn post_recvs(rq, n: u32, addrs: *const u64, lkey: u32, len: u32, ticket: *mut u64) {
        if n > 0 && addrs.is_null() {
            return CODE_BAD_ARGUMENT;
        }
        let buf = |i: u32| RecvBuf {
            // SAFETY: `addrs` holds `n` entries (this function's contract), and `post_recvs`
            // asks only for `i < n`.
            local: Local { addr: unsafe { addrs.add(i as usize).read() }, lkey },
            len,
        };
        // SAFETY: `ticket` is null or writable (this function's contract).
        unsafe { posted(rq.post_recvs(n, buf), ticket) }
    }

    /// `*arrived` gets 1 if receive `ticket` has completed (its completion is written,
    /// successful or not), else 0, without consuming it: one load. Poll the receives in
    /// order with `gdaki_poll_recv` afterwards.
    fn recv_arrived(rq, ticket: u64, arrived: *mut u32) {
        // SAFETY: `arrived` is null or writable (this function's contract).
        unsafe { give(arrived, rq.arrived(ticket) as u32) };
        CODE_OK
    }

    /// Waits (bounded by the queue's timeout) until receive `ticket` has completed (its
    /// completion is written, successful or not), without consuming it, as `gdaki_recv_arrived`
    /// in a loop: a responder answers first and then retires the receive with
    /// `gdaki_poll_recv`, which reports its error if it has one.
    fn wait_recv_arrived(rq, ticket: u64) {
        rq.wait_arrived(ticket).map_or_else(|e| e.code(), |()| CODE_OK)
    }

    /// Waits (bounded by the queue's timeout) for receive `ticket`: `*bytes` gets the
    /// message's length, `*kind` a `GDAKI_RECV_*`, `*imm` its immediate data (0 without);
    /// each unless null. An error CQE (a flushed receive, one too small) is its code.
    fn poll_recv(rq, ticket: u64, bytes: *mut u32, kind: *mut u32, imm: *mut u32) {
        match rq.poll(ticket) {
            Ok(r) => {
                // SAFETY: each is null or writable (this function's contract).
                unsafe {
                    give(bytes, r.bytes);
                    give(kind, r.kind.code());
                    give(imm, r.imm().unwrap_or(0));
                }
                CODE_OK
            }
            Err(e) => e.code(),
        }
    }
}

/// `RecvKind` codes are what `poll_recv` writes to `*kind`.
const _: () = {
    assert!(RecvKind::Send.code() == 0);
    assert!(RecvKind::SendImm(0).code() == 1 && RecvKind::WriteImm(0).code() == 2);
};

pub mod socket;
