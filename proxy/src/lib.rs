//! `gdaki-proxy`: the CPU-proxy doorbell service. Where a GPU cannot ring the NIC's doorbell
//! (the UAR page cannot be mapped into it), kernels publish their send-queue producer index to a
//! host-pinned word instead, and proxy threads watching many queue pairs write the doorbell
//! record and ring the doorbell on their behalf. The WQEs themselves are written by exactly the
//! same device code as in the GPU-doorbell path; only submission differs.
#![warn(missing_docs)]
