//! `mlx5-sys`: raw FFI for the part of libmlx5 that gdaki's `mlx5` provider drives: the mlx5
//! direct-verbs objects and the DevX calls (`mlx5dv_devx_obj_create`, `mlx5dv_devx_umem_reg`,
//! `mlx5dv_devx_alloc_uar`, ...) that create CQs and QPs whose rings live in GPU memory. The
//! libibverbs types it refers to come from `rdma-sys`. No such crate exists on crates.io, hence
//! this one; it holds declarations only, and the safe wrappers live in `gdaki`'s mlx5 provider.
//!
//! The declarations arrive with the mlx5 provider; until then this crate is intentionally
//! empty, so that nothing in the workspace links libmlx5 yet.
#![no_std]
