//! `mlx5-sys`: raw declarations for the part of libibverbs and libmlx5 that gdaki's mlx5 device
//! drives: opening a device for DevX, the PD number, port and GID queries, address handles (for
//! a RoCE peer's MAC), and the DevX calls (`mlx5dv_devx_general_cmd`, `..._obj_create`,
//! `..._umem_reg`, `..._alloc_uar`, `..._query_eqn`) that create CQs and QPs from PRM mailboxes.
//!
//! Nothing here links: gdaki loads `libibverbs.so.1` and `libmlx5.so.1` at run time (so every
//! binary starts, and the soft device works, on machines without rdma-core) and resolves each
//! symbol named in [`symbols`] as the function type beside it. The structures are the
//! rdma-core 44 (Debian bookworm) layouts; the golden test in `tests/layout.rs` compares every
//! size and offset with the installed headers. No crate on crates.io declares the DevX calls,
//! hence this one.
#![no_std]
// The C names, so a reader can grep rdma-core for each.
#![allow(non_camel_case_types, missing_docs)]

use core::ffi::{c_char, c_int, c_void};

/// `struct ibv_device` (opaque).
#[repr(C)]
pub struct ibv_device {
    _opaque: [u8; 0],
}

/// `struct ibv_context` (opaque).
#[repr(C)]
pub struct ibv_context {
    _opaque: [u8; 0],
}

/// `struct ibv_pd` (opaque).
#[repr(C)]
pub struct ibv_pd {
    _opaque: [u8; 0],
}

/// `struct ibv_ah` (opaque).
#[repr(C)]
pub struct ibv_ah {
    _opaque: [u8; 0],
}

/// `struct mlx5dv_devx_obj` (opaque).
#[repr(C)]
pub struct mlx5dv_devx_obj {
    _opaque: [u8; 0],
}

/// `union ibv_gid`, as its raw bytes (the union is 8-byte aligned).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ibv_gid {
    /// The GID, network order.
    pub raw: [u8; 16],
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct mlx5dv_context_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct mlx5dv_context_attr {
    /// `MLX5DV_CONTEXT_FLAGS_*`.
    pub flags: u32,
    pub comp_mask: u64,
}

/// `struct mlx5dv_devx_uar`.
#[repr(C)]
pub struct mlx5dv_devx_uar {
    /// Where the host writes doorbells.
    pub reg_addr: *mut c_void,
    pub base_addr: *mut c_void,
    /// The page index (`uar_page` in CQ and QP contexts).
    pub page_id: u32,
    /// `off_t` (64 bits on the targets gdaki builds for).
    pub mmap_off: i64,
    pub comp_mask: u64,
}

/// `struct ibv_mr`.
#[repr(C)]
#[derive(Debug)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    /// The key WQE data segments name.
    pub lkey: u32,
    /// The key peers name.
    pub rkey: u32,
}

/// `struct mlx5dv_devx_umem_in`: a umem over host memory or a dma-buf.
#[repr(C)]
#[derive(Debug)]
pub struct mlx5dv_devx_umem_in {
    pub addr: *mut c_void,
    pub size: usize,
    pub access: u32,
    /// Page sizes the device may use (bit n: 2^n bytes).
    pub pgsz_bitmap: u64,
    /// `MLX5DV_UMEM_MASK_DMABUF` when `dmabuf_fd` is valid (then `addr` is the offset into it).
    pub comp_mask: u64,
    pub dmabuf_fd: c_int,
}

/// `struct mlx5dv_devx_umem`.
#[repr(C)]
#[derive(Debug)]
pub struct mlx5dv_devx_umem {
    /// The id CQ and QP contexts name.
    pub umem_id: u32,
}

/// `struct mlx5dv_pd`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct mlx5dv_pd {
    /// The PD number (`qpc.pd`).
    pub pdn: u32,
    pub comp_mask: u64,
}

/// `struct mlx5_wqe_av`: the address vector an address handle holds.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct mlx5_wqe_av {
    /// `key` (a union of the Q_Key pair and the DC key).
    pub key: u64,
    pub dqp_dct: u32,
    pub stat_rate_sl: u8,
    pub fl_mlid: u8,
    pub rlid: u16,
    pub reserved0: [u8; 4],
    /// RoCE: the next hop's MAC for the destination GID.
    pub rmac: [u8; 6],
    pub tclass: u8,
    pub hop_limit: u8,
    pub grh_gid_fl: u32,
    pub rgid: [u8; 16],
}

/// `struct mlx5dv_ah`.
#[repr(C)]
pub struct mlx5dv_ah {
    pub av: *mut mlx5_wqe_av,
    pub comp_mask: u64,
}

/// One member of `struct mlx5dv_obj`: the verbs object in, the mlx5 view out.
#[repr(C)]
pub struct mlx5dv_obj_pair<I, O> {
    pub r#in: *mut I,
    pub out: *mut O,
}

impl<I, O> mlx5dv_obj_pair<I, O> {
    /// Neither object: a member `mlx5dv_init_obj` is not asked about.
    pub const NULL: Self = mlx5dv_obj_pair {
        r#in: core::ptr::null_mut(),
        out: core::ptr::null_mut(),
    };
}

/// `struct mlx5dv_obj`, with the members gdaki does not use as untyped pairs.
#[repr(C)]
pub struct mlx5dv_obj {
    pub qp: mlx5dv_obj_pair<c_void, c_void>,
    pub cq: mlx5dv_obj_pair<c_void, c_void>,
    pub srq: mlx5dv_obj_pair<c_void, c_void>,
    pub rwq: mlx5dv_obj_pair<c_void, c_void>,
    pub dm: mlx5dv_obj_pair<c_void, c_void>,
    pub ah: mlx5dv_obj_pair<ibv_ah, mlx5dv_ah>,
    pub pd: mlx5dv_obj_pair<ibv_pd, mlx5dv_pd>,
}

/// `MLX5DV_UMEM_MASK_DMABUF`: `mlx5dv_devx_umem_in.dmabuf_fd` is valid.
pub const MLX5DV_UMEM_MASK_DMABUF: u64 = 1 << 0;
/// `IBV_ACCESS_REMOTE_WRITE`.
pub const IBV_ACCESS_REMOTE_WRITE: u32 = 1 << 1;
/// `IBV_ACCESS_REMOTE_READ`.
pub const IBV_ACCESS_REMOTE_READ: u32 = 1 << 2;
/// `IBV_ACCESS_REMOTE_ATOMIC`.
pub const IBV_ACCESS_REMOTE_ATOMIC: u32 = 1 << 3;
/// `MLX5DV_CONTEXT_FLAGS_DEVX`: open the device for DevX.
pub const MLX5DV_CONTEXT_FLAGS_DEVX: u32 = 1 << 0;
/// `MLX5DV_UAR_ALLOC_TYPE_BF`: a blue-flame UAR page.
pub const MLX5DV_UAR_ALLOC_TYPE_BF: u32 = 0x0;
/// `MLX5DV_UAR_ALLOC_TYPE_NC`: a non-cached UAR page (what GPU doorbells want).
pub const MLX5DV_UAR_ALLOC_TYPE_NC: u32 = 0x1;
/// `MLX5DV_OBJ_AH`.
pub const MLX5DV_OBJ_AH: u64 = 1 << 5;
/// `MLX5DV_OBJ_PD`.
pub const MLX5DV_OBJ_PD: u64 = 1 << 6;
/// `IBV_ACCESS_LOCAL_WRITE`.
pub const IBV_ACCESS_LOCAL_WRITE: u32 = 1;
/// `IBV_PORT_ACTIVE`.
pub const IBV_PORT_ACTIVE: u32 = 4;
/// `IBV_LINK_LAYER_INFINIBAND`.
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
/// `IBV_LINK_LAYER_ETHERNET`.
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

/// `ibv_get_device_list`.
pub type ibv_get_device_list = unsafe extern "C" fn(num_devices: *mut c_int) -> *mut *mut ibv_device;
/// `ibv_free_device_list`.
pub type ibv_free_device_list = unsafe extern "C" fn(list: *mut *mut ibv_device);
/// `ibv_get_device_name`.
pub type ibv_get_device_name = unsafe extern "C" fn(device: *mut ibv_device) -> *const c_char;
/// `ibv_close_device`.
pub type ibv_close_device = unsafe extern "C" fn(context: *mut ibv_context) -> c_int;
/// `ibv_alloc_pd`.
pub type ibv_alloc_pd = unsafe extern "C" fn(context: *mut ibv_context) -> *mut ibv_pd;
/// `ibv_dealloc_pd`.
pub type ibv_dealloc_pd = unsafe extern "C" fn(pd: *mut ibv_pd) -> c_int;
/// `ibv_query_port` (the exported symbol, which fills the `ibv_port_attr` prefix it knows).
pub type ibv_query_port =
    unsafe extern "C" fn(context: *mut ibv_context, port_num: u8, port_attr: *mut ibv_port_attr) -> c_int;
/// `ibv_query_gid`.
pub type ibv_query_gid =
    unsafe extern "C" fn(context: *mut ibv_context, port_num: u8, index: c_int, gid: *mut ibv_gid) -> c_int;
/// `ibv_create_ah`.
pub type ibv_create_ah = unsafe extern "C" fn(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah;
/// `ibv_destroy_ah`.
pub type ibv_destroy_ah = unsafe extern "C" fn(ah: *mut ibv_ah) -> c_int;

/// `mlx5dv_is_supported`.
pub type mlx5dv_is_supported = unsafe extern "C" fn(device: *mut ibv_device) -> bool;
/// `mlx5dv_open_device`.
pub type mlx5dv_open_device =
    unsafe extern "C" fn(device: *mut ibv_device, attr: *mut mlx5dv_context_attr) -> *mut ibv_context;
/// `mlx5dv_init_obj`.
pub type mlx5dv_init_obj = unsafe extern "C" fn(obj: *mut mlx5dv_obj, obj_type: u64) -> c_int;
/// `mlx5dv_devx_general_cmd`.
pub type mlx5dv_devx_general_cmd = unsafe extern "C" fn(
    context: *mut ibv_context,
    input: *const c_void,
    inlen: usize,
    out: *mut c_void,
    outlen: usize,
) -> c_int;
/// `mlx5dv_devx_obj_create`.
pub type mlx5dv_devx_obj_create = unsafe extern "C" fn(
    context: *mut ibv_context,
    input: *const c_void,
    inlen: usize,
    out: *mut c_void,
    outlen: usize,
) -> *mut mlx5dv_devx_obj;
/// `mlx5dv_devx_obj_modify` and `mlx5dv_devx_obj_query`.
pub type mlx5dv_devx_obj_cmd = unsafe extern "C" fn(
    obj: *mut mlx5dv_devx_obj,
    input: *const c_void,
    inlen: usize,
    out: *mut c_void,
    outlen: usize,
) -> c_int;
/// `mlx5dv_devx_obj_destroy`.
pub type mlx5dv_devx_obj_destroy = unsafe extern "C" fn(obj: *mut mlx5dv_devx_obj) -> c_int;
/// `mlx5dv_devx_umem_reg`.
pub type mlx5dv_devx_umem_reg = unsafe extern "C" fn(
    context: *mut ibv_context,
    addr: *mut c_void,
    size: usize,
    access: u32,
) -> *mut mlx5dv_devx_umem;
/// `mlx5dv_devx_umem_reg_ex` (rdma-core 35 and later: the dma-buf umems GPU rings need).
pub type mlx5dv_devx_umem_reg_ex =
    unsafe extern "C" fn(context: *mut ibv_context, umem_in: *mut mlx5dv_devx_umem_in) -> *mut mlx5dv_devx_umem;
/// `ibv_reg_mr` (the exported function; `verbs.h` wraps it in a macro).
pub type ibv_reg_mr =
    unsafe extern "C" fn(pd: *mut ibv_pd, addr: *mut c_void, length: usize, access: c_int) -> *mut ibv_mr;
/// `ibv_reg_dmabuf_mr` (rdma-core 34 and later).
pub type ibv_reg_dmabuf_mr = unsafe extern "C" fn(
    pd: *mut ibv_pd,
    offset: u64,
    length: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut ibv_mr;
/// `ibv_dereg_mr`.
pub type ibv_dereg_mr = unsafe extern "C" fn(mr: *mut ibv_mr) -> c_int;
/// `mlx5dv_devx_umem_dereg`.
pub type mlx5dv_devx_umem_dereg = unsafe extern "C" fn(umem: *mut mlx5dv_devx_umem) -> c_int;
/// `mlx5dv_devx_alloc_uar`.
pub type mlx5dv_devx_alloc_uar = unsafe extern "C" fn(context: *mut ibv_context, flags: u32) -> *mut mlx5dv_devx_uar;
/// `mlx5dv_devx_free_uar`.
pub type mlx5dv_devx_free_uar = unsafe extern "C" fn(uar: *mut mlx5dv_devx_uar);
/// `mlx5dv_devx_query_eqn`.
pub type mlx5dv_devx_query_eqn = unsafe extern "C" fn(context: *mut ibv_context, vector: u32, eqn: *mut u32) -> c_int;

/// The libraries and the symbol each function type above is loaded from.
pub mod symbols {
    /// The verbs library.
    pub const LIBIBVERBS: &str = "libibverbs.so.1";
    /// The mlx5 provider library (direct verbs and DevX).
    pub const LIBMLX5: &str = "libmlx5.so.1";
}
