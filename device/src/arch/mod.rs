//! The architecture layer: one module per target with the same functions, so the data path above
//! it is written once. Barriers are named by purpose (rdma-core's `udma_barrier.h` vocabulary);
//! call sites never write a bare fence.
//!
//! | function | meaning |
//! | --- | --- |
//! | [`to_device_barrier`] | earlier writes (WQEs, payloads) are visible to the HCA before later stores (doorbell record, doorbell) |
//! | [`to_device_barrier_gpu`] | the same when the HCA reads the GPU's own memory (rings in GPU memory): GPU scope |
//! | [`from_device_barrier`] | reads after it (CQE body, fetched values) see what the HCA wrote before the owner bit just read |
//! | [`load_u8_acquire`] / [`load_u64_acquire`] / [`load_u64x2_acquire`] | a poll's load that needs no barrier after it: later reads see what was written before the value read (`ld.acquire.sys`; a `fence.acq_rel.sys` after a poll also waits for this thread's own system-scope writes, microseconds) |
//! | [`store_seg`] | one 16-byte WQE segment store |
//! | [`mmio_store`] | the 8-byte doorbell store to the UAR |
//! | [`store_dbrec`] | the send doorbell-record word, relaxed, system or GPU scope (rings in host / GPU memory) |
//! | [`store_cq_dbrec`] | the CQ doorbell-record word: relaxed, system scope, after a tail-only poll; release, GPU scope, after reading a CQE's body |
//! | [`cas_dbrec`] | compare-and-swap a doorbell-record word, system scope |
//! | [`fetch_max_sys`] / [`store_sys`] | raise / store a host-visible u64 (the CPU proxy's producer index) |
//! | [`load_u64_block`] / [`store_u64_block`] | a word only the calling block touches while it runs (`ld`/`st.relaxed.cta`: an L1 hit after the block's own store) |
//! | [`load_u8_volatile`] / [`load_u32_volatile`] / [`load_u64_volatile`] / [`load_u64x2_volatile`] | reads of memory the HCA writes |
//! | [`global_timer_ns`] | monotonic nanoseconds (GPU `%globaltimer`) |
//! | [`backoff`] | what a waiter does between polls |
//! | [`lane_id`], [`active_mask`], [`ballot`], [`shfl_idx`], [`shfl_up`], [`warp_sync`] | warp primitives (on the host, a warp of one lane) |
//! | `block_sync`, `block_thread_rank`, `block_size` | block primitives (nvptx only; CPU groups live in [`crate::scope`]) |
//!
//! Scoped atomics on the QP's counters live in [`crate::sharing`]; the collectives that warp and
//! block scope are built from (scan, broadcast) in [`crate::scope`].
#[cfg(not(target_arch = "nvptx64"))]
mod host;
#[cfg(not(target_arch = "nvptx64"))]
pub use host::*;

#[cfg(target_arch = "nvptx64")]
mod nvptx;
#[cfg(target_arch = "nvptx64")]
pub use nvptx::*;
