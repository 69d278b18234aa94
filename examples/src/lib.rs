//! `gdaki-examples`: the perftests people quote (`put_bw`, RDMA WRITE bandwidth and message
//! rate; `write_lat`, ping-pong latency), following perftest's `ib_write_bw` / `ib_write_lat`
//! conventions, and an example of embedding gdaki in an NVSHMEM-like CUDA C++ library. Shared
//! pieces of the perftests (flags, the header block, the result table, `--json`) live here.
#![warn(missing_docs)]
