//! Every structure `mlx5-sys` declares, compared with the installed rdma-core headers
//! (libibverbs-dev): size, alignment and each field's offset, and every constant's value.
#[path = "../../../shared-layout/tests/support/c_golden.rs"]
#[allow(dead_code)] // the mailbox helpers are for the PRM tests
mod c_golden;

use std::fmt::Write as _;
use std::mem::{align_of, offset_of, size_of};
use std::path::PathBuf;

use mlx5_sys::*;

/// `(C type, Rust size, Rust align, [(field, Rust offset)])`.
macro_rules! layout {
    ($c:literal, $ty:ty, [$($field:ident),*]) => {
        ($c, size_of::<$ty>(), align_of::<$ty>(), vec![$((stringify!($field), offset_of!($ty, $field))),*])
    };
}

#[test]
fn declarations_match_the_rdma_core_headers() {
    let structs = vec![
        layout!("union ibv_gid", ibv_gid, [raw]),
        layout!(
            "struct ibv_port_attr",
            ibv_port_attr,
            [
                state,
                max_mtu,
                active_mtu,
                gid_tbl_len,
                port_cap_flags,
                max_msg_sz,
                bad_pkey_cntr,
                qkey_viol_cntr,
                pkey_tbl_len,
                lid,
                sm_lid,
                lmc,
                max_vl_num,
                sm_sl,
                subnet_timeout,
                init_type_reply,
                active_width,
                active_speed,
                phys_state,
                link_layer,
                flags,
                port_cap_flags2
            ]
        ),
        layout!(
            "struct ibv_global_route",
            ibv_global_route,
            [dgid, flow_label, sgid_index, hop_limit, traffic_class]
        ),
        layout!(
            "struct ibv_ah_attr",
            ibv_ah_attr,
            [grh, dlid, sl, src_path_bits, static_rate, is_global, port_num]
        ),
        layout!("struct mlx5dv_context_attr", mlx5dv_context_attr, [flags, comp_mask]),
        layout!(
            "struct mlx5dv_devx_uar",
            mlx5dv_devx_uar,
            [reg_addr, base_addr, page_id, mmap_off, comp_mask]
        ),
        layout!("struct mlx5dv_devx_umem", mlx5dv_devx_umem, [umem_id]),
        layout!("struct ibv_mr", ibv_mr, [context, pd, addr, length, handle, lkey, rkey]),
        layout!(
            "struct mlx5dv_devx_umem_in",
            mlx5dv_devx_umem_in,
            [addr, size, access, pgsz_bitmap, comp_mask, dmabuf_fd]
        ),
        layout!("struct mlx5dv_pd", mlx5dv_pd, [pdn, comp_mask]),
        layout!(
            "struct mlx5_wqe_av",
            mlx5_wqe_av,
            [
                key,
                dqp_dct,
                stat_rate_sl,
                fl_mlid,
                rlid,
                reserved0,
                rmac,
                tclass,
                hop_limit,
                grh_gid_fl,
                rgid
            ]
        ),
        layout!("struct mlx5dv_ah", mlx5dv_ah, [av, comp_mask]),
        layout!("struct mlx5dv_obj", mlx5dv_obj, [qp, cq, srq, rwq, dm, ah, pd]),
    ];
    let consts = [
        ("MLX5DV_CONTEXT_FLAGS_DEVX", MLX5DV_CONTEXT_FLAGS_DEVX as u64),
        ("MLX5_IB_UAPI_UAR_ALLOC_TYPE_BF", MLX5DV_UAR_ALLOC_TYPE_BF as u64),
        ("MLX5_IB_UAPI_UAR_ALLOC_TYPE_NC", MLX5DV_UAR_ALLOC_TYPE_NC as u64),
        ("MLX5DV_OBJ_AH", MLX5DV_OBJ_AH),
        ("MLX5DV_OBJ_PD", MLX5DV_OBJ_PD),
        ("IBV_ACCESS_LOCAL_WRITE", IBV_ACCESS_LOCAL_WRITE as u64),
        ("IBV_ACCESS_REMOTE_WRITE", IBV_ACCESS_REMOTE_WRITE as u64),
        ("IBV_ACCESS_REMOTE_READ", IBV_ACCESS_REMOTE_READ as u64),
        ("IBV_ACCESS_REMOTE_ATOMIC", IBV_ACCESS_REMOTE_ATOMIC as u64),
        ("MLX5DV_UMEM_MASK_DMABUF", MLX5DV_UMEM_MASK_DMABUF),
        ("IBV_PORT_ACTIVE", IBV_PORT_ACTIVE as u64),
        ("IBV_LINK_LAYER_INFINIBAND", IBV_LINK_LAYER_INFINIBAND as u64),
        ("IBV_LINK_LAYER_ETHERNET", IBV_LINK_LAYER_ETHERNET as u64),
    ];
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <stdalign.h>\n#include <infiniband/mlx5dv.h>\n\
         int main(void) {\n",
    );
    let mut expect = Vec::new();
    for (ty, size, align, fields) in &structs {
        writeln!(c, "printf(\"{ty} %zu %zu\\n\", sizeof({ty}), alignof({ty}));").unwrap();
        expect.push(format!("{ty} {size} {align}"));
        for (field, offset) in fields {
            writeln!(c, "printf(\"{ty}.{field} %zu\\n\", offsetof({ty}, {field}));").unwrap();
            expect.push(format!("{ty}.{field} {offset}"));
        }
    }
    for (name, v) in consts {
        writeln!(c, "printf(\"{name} %llu\\n\", (unsigned long long){name});").unwrap();
        expect.push(format!("{name} {v}"));
    }
    c += "return 0; }\n";
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let src = dir.join("mlx5_sys_layout.c");
    std::fs::write(&src, c).unwrap();
    let got = c_golden::run(&c_golden::build(&src, &dir.join("mlx5_sys_layout")), "");
    assert_eq!(got.len(), expect.len());
    for (g, e) in got.iter().zip(&expect) {
        assert_eq!(g, e, "C (left) and Rust (right) differ");
    }
}
