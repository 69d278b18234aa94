//! Golden tests of the PRM command layouts against the kernel's `include/linux/mlx5/mlx5_ifc.h`
//! (Debian's `linux-headers-<ver>-common`, which `tools/setup.sh` installs): every field gdaki
//! declares, by bit offset and width; the opcodes; the status codes of `mlx5/device.h`; and
//! whole mailboxes encoded by C (rdma-core's `DEVX_SET` over the kernel's structures) and by
//! gdaki's builders from the same random values, byte for byte. Set `GDAKI_MLX5_IFC_H` to use
//! another copy of the header.
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use gdaki_layout::prm::command::{
    self, AddressPath, CapType, CreateCq, CreateQp, Init2Rtr, Opcode, QpcState, RqShape, Rst2Init, Rtr2Rts,
};
use gdaki_layout::prm::layout::STRUCTURES;
use gdaki_layout::prm::CmdStatus;

#[path = "support/c_golden.rs"]
mod c_golden;
use c_golden::{hex, Rng};

/// The kernel header: `GDAKI_MLX5_IFC_H`, else the newest linux-headers-*-common.
fn mlx5_ifc_h() -> PathBuf {
    if let Ok(p) = std::env::var("GDAKI_MLX5_IFC_H") {
        return PathBuf::from(p);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/src")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("include/linux/mlx5/mlx5_ifc.h"))
        .filter(|p| p.exists() && p.to_string_lossy().contains("-common"))
        .collect();
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!("no /usr/src/linux-headers-*-common/include/linux/mlx5/mlx5_ifc.h: run tools/setup.sh")
    })
}

fn build(src: &Path, name: &str) -> PathBuf {
    let header = mlx5_ifc_h();
    c_golden::build_with(
        src,
        &PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name),
        &[format!("-DKERNEL_MLX5_IFC=\"{}\"", header.display())],
    )
}

/// A generated C program printing `name offset width` for every declared field, the size of
/// each structure, and the opcodes.
#[test]
fn every_field_sits_where_the_kernel_header_puts_it() {
    let mut c = String::from(
        "#include <stdint.h>\n#include <stdio.h>\n#include <stddef.h>\ntypedef uint8_t u8;\n\
         #define BIT(n) (1UL << (n))\n#define BIT_ULL(n) (1ULL << (n))\n\
         #define __packed __attribute__((packed))\n#include KERNEL_MLX5_IFC\nint main(void) {\n",
    );
    let mut expect = Vec::new();
    for (st, size, fields) in STRUCTURES {
        if *size != 0 {
            writeln!(c, "printf(\"{st} %zu\\n\", sizeof(struct mlx5_ifc_{st}_bits));").unwrap();
            expect.push((st.to_string(), *size, *size, String::new()));
        }
        for (member, bits) in *fields {
            writeln!(
                c,
                "printf(\"{st}.{member} %zu %zu\\n\", offsetof(struct mlx5_ifc_{st}_bits, {member}), \
                 sizeof(((struct mlx5_ifc_{st}_bits *)0)->{member}));"
            )
            .unwrap();
            expect.push((format!("{st}.{member}"), bits.offset, bits.width, member.to_string()));
        }
    }
    let ops = [
        (Opcode::QueryHcaCap, "QUERY_HCA_CAP"),
        (Opcode::CreateCq, "CREATE_CQ"),
        (Opcode::DestroyCq, "DESTROY_CQ"),
        (Opcode::QueryCq, "QUERY_CQ"),
        (Opcode::CreateQp, "CREATE_QP"),
        (Opcode::DestroyQp, "DESTROY_QP"),
        (Opcode::Rst2InitQp, "RST2INIT_QP"),
        (Opcode::Init2RtrQp, "INIT2RTR_QP"),
        (Opcode::Rtr2RtsQp, "RTR2RTS_QP"),
        (Opcode::Qp2Err, "2ERR_QP"),
        (Opcode::Qp2Rst, "2RST_QP"),
        (Opcode::QueryQp, "QUERY_QP"),
        (Opcode::AllocPd, "ALLOC_PD"),
    ];
    for (op, name) in ops {
        assert_eq!(op.name(), name);
        writeln!(c, "printf(\"op {name} %d\\n\", (int)MLX5_CMD_OP_{name});").unwrap();
    }
    // Values of context fields, by their kernel enum names.
    let consts: &[(&str, u8)] = &[
        ("MLX5_QPC_ST_RC", command::QPC_ST_RC),
        ("MLX5_QPC_PM_STATE_MIGRATED", command::QPC_PM_STATE_MIGRATED),
        ("MLX5_QPC_ATOMIC_MODE_UP_TO_8B", command::QPC_ATOMIC_MODE_UP_TO_8B),
        ("MLX5_QPC_ATOMIC_MODE_IB_SPEC", command::QPC_ATOMIC_MODE_IB_SPEC),
        (
            "MLX5_TIMESTAMP_FORMAT_FREE_RUNNING",
            command::QPC_TS_FORMAT_FREE_RUNNING,
        ),
        ("MLX5_TIMESTAMP_FORMAT_DEFAULT", command::QPC_TS_FORMAT_DEFAULT),
        (
            "MLX5_TIMESTAMP_FORMAT_CAP_FREE_RUNNING",
            command::TS_FORMAT_CAP_FREE_RUNNING,
        ),
        ("MLX5_TIMESTAMP_FORMAT_CAP_REAL_TIME", command::TS_FORMAT_CAP_REAL_TIME),
        (
            "MLX5_TIMESTAMP_FORMAT_CAP_FREE_RUNNING_AND_REAL_TIME",
            command::TS_FORMAT_CAP_FREE_RUNNING_AND_REAL_TIME,
        ),
        ("MLX5_QPC_STATE_RST", QpcState::Reset as u8),
        ("MLX5_QPC_STATE_INIT", QpcState::Init as u8),
        ("MLX5_QPC_STATE_RTR", QpcState::Rtr as u8),
        ("MLX5_QPC_STATE_RTS", QpcState::Rts as u8),
        ("MLX5_QPC_STATE_SQER", QpcState::SqErr as u8),
        ("MLX5_QPC_STATE_SQD", QpcState::Sqd as u8),
        ("MLX5_QPC_STATE_ERR", QpcState::Err as u8),
        ("MLX5_CQC_STATUS_OK", command::CQC_STATUS_OK),
        ("MLX5_CQC_STATUS_CQ_OVERFLOW", command::CQC_STATUS_OVERFLOW),
        ("MLX5_CQC_STATUS_CQ_WRITE_FAIL", command::CQC_STATUS_WRITE_FAIL),
    ];
    for (name, _) in consts {
        writeln!(c, "printf(\"const {name} %d\\n\", (int){name});").unwrap();
    }
    c += "return 0; }\n";
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let src = dir.join("prm_fields.c");
    std::fs::write(&src, c).unwrap();
    let out = c_golden::run(&build(&src, "prm_fields"), "");

    let mut lines = out.iter();
    for (what, offset, width, member) in &expect {
        let line = lines.next().expect("golden output ends early");
        let mut parts = line.split(' ');
        assert_eq!(parts.next(), Some(what.as_str()));
        let nums: Vec<u32> = parts.map(|p| p.parse().unwrap()).collect();
        if member.is_empty() {
            assert_eq!(nums[0], *offset, "size of {what} in bits");
        } else if member.starts_with("reserved_at_") {
            // A DevX-only field: it must lie inside the reserved member at its place.
            let (start, len) = (nums[0], nums[1]);
            assert!(
                start <= *offset && offset + width <= start + len,
                "{what}: field at {offset:#x}+{width:#x} is not inside {start:#x}+{len:#x}"
            );
        } else {
            assert_eq!((nums[0], nums[1]), (*offset, *width), "{what}: (offset, width)");
        }
    }
    for (op, name) in ops {
        assert_eq!(lines.next().unwrap(), &format!("op {name} {}", op.raw()), "{name}");
    }
    for (name, v) in consts {
        assert_eq!(lines.next().unwrap(), &format!("const {name} {v}"), "{name}");
    }
    assert!(lines.next().is_none());
}

/// `MLX5_CMD_STAT_*` from the kernel's `mlx5/device.h` (not compilable outside the kernel, so
/// read as text).
#[test]
fn status_codes_are_the_kernels() {
    let device_h = mlx5_ifc_h().with_file_name("device.h");
    let text = std::fs::read_to_string(&device_h).expect("device.h beside mlx5_ifc.h");
    let mut seen = 0;
    for line in text.lines() {
        let Some(rest) = line.trim().strip_prefix("MLX5_CMD_STAT_") else {
            continue;
        };
        let Some((name, value)) = rest.split_once('=') else {
            continue;
        };
        let value = value.trim().trim_end_matches(',');
        let value = u8::from_str_radix(value.trim_start_matches("0x"), 16).unwrap();
        let status = CmdStatus::from_raw(value);
        assert_eq!(status.name(), name.trim(), "status {value:#x}");
        seen += 1;
    }
    assert_eq!(seen, 16, "every status the kernel names");
}

const CASES: usize = 500;

#[test]
fn mailboxes_match_devx_set_over_the_kernel_structures() {
    let bin = build(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/prm_golden.c"),
        "prm_golden",
    );
    let mut rng = Rng(0x51f1_5eed_0bad_cafe);
    let mut input = String::new();
    let mut expect = Vec::new();
    for i in 0..CASES {
        let mut r = || rng.next();
        let cq = CreateCq {
            log_size: (r() % 32) as u8,
            uar_page: r() as u32 & 0xff_ffff,
            eqn: r() as u32,
            umem_id: r() as u32,
            umem_offset: r(),
            dbr_umem_id: r() as u32,
            dbr_offset: r(),
            log_page_size: (r() % 32) as u8,
            overrun_ignore: r() % 2 == 1,
            collapsed: r() % 2 == 1,
        };
        writeln!(
            input,
            "create_cq {} {} {} {} {} {} {} {} {} {}",
            cq.log_size,
            cq.uar_page,
            cq.eqn,
            cq.umem_id,
            cq.umem_offset,
            cq.dbr_umem_id,
            cq.dbr_offset,
            cq.log_page_size,
            cq.overrun_ignore as u8,
            cq.collapsed as u8
        )
        .unwrap();
        expect.push(hex(&cq.encode()));

        let qp = CreateQp {
            pd: r() as u32 & 0xff_ffff,
            uar_page: r() as u32 & 0xff_ffff,
            cqn_snd: r() as u32 & 0xff_ffff,
            cqn_rcv: r() as u32 & 0xff_ffff,
            log_sq_size: (r() % 16) as u8,
            user_index: r() as u32 & 0xff_ffff,
            umem_id: r() as u32,
            umem_offset: r(),
            dbr_umem_id: r() as u32,
            dbr_offset: r(),
            log_page_size: (r() % 32) as u8,
            ts_format: command::qp_ts_format((r() % 3) as u8),
            // Half send-only, half with a receive queue of any shape the fields hold.
            receive: (i % 2 == 1).then(|| RqShape {
                log_size: (r() % 16) as u8,
                log_stride: (r() % 8) as u8,
            }),
            cd_master: r() % 2 == 1,
            send_dbr_mode: [
                command::QPC_SEND_DBR_MODE_DBR_VALID,
                command::QPC_SEND_DBR_MODE_NO_DBR_EXT,
            ][(r() % 2) as usize],
        };
        let rq = qp.receive.unwrap_or_default();
        writeln!(
            input,
            "create_qp {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {}",
            qp.pd,
            qp.uar_page,
            qp.cqn_snd,
            qp.cqn_rcv,
            qp.log_sq_size,
            qp.user_index,
            qp.umem_id,
            qp.umem_offset,
            qp.dbr_umem_id,
            qp.dbr_offset,
            qp.log_page_size,
            qp.ts_format,
            qp.receive.is_some() as u8,
            rq.log_size,
            rq.log_stride,
            qp.cd_master as u8,
            qp.send_dbr_mode
        )
        .unwrap();
        expect.push(hex(&qp.encode()));

        let v = r();
        let init = Rst2Init {
            qpn: v as u32 & 0xff_ffff,
            port: (v >> 24) as u8,
            pkey_index: (v >> 32) as u16,
            remote_read: v >> 48 & 1 == 1,
            remote_write: v >> 49 & 1 == 1,
            remote_atomic: v >> 50 & 1 == 1,
            atomic_mode: [command::QPC_ATOMIC_MODE_IB_SPEC, command::QPC_ATOMIC_MODE_UP_TO_8B][(v >> 51 & 1) as usize],
        };
        writeln!(
            input,
            "rst2init {} {} {} {} {} {} {}",
            init.qpn,
            init.port,
            init.pkey_index,
            init.remote_read as u8,
            init.remote_write as u8,
            init.remote_atomic as u8,
            init.atomic_mode
        )
        .unwrap();
        expect.push(hex(&init.encode()));

        let (a, b, c, d) = (r(), r(), r(), r());
        let rtr = Init2Rtr {
            qpn: a as u32 & 0xff_ffff,
            mtu: (a >> 24) as u8 & 7,
            log_msg_max: (a >> 27) as u8 & 0x1f,
            remote_qpn: (a >> 32) as u32 & 0xff_ffff,
            next_rcv_psn: b as u32 & 0xff_ffff,
            min_rnr_nak: (b >> 24) as u8 & 0x1f,
            log_rra_max: (b >> 29) as u8 & 7,
            path: AddressPath {
                port: (b >> 32) as u8,
                rlid: (b >> 40) as u16,
                sl: (b >> 56) as u8 & 0xf,
                grh: b >> 60 & 1 == 1,
                gid_index: c as u8,
                rgid: {
                    let mut g = [0u8; 16];
                    g[..8].copy_from_slice(&c.to_be_bytes());
                    g[8..].copy_from_slice(&d.to_be_bytes());
                    g
                },
                hop_limit: (d >> 8) as u8,
                tclass: (d >> 16) as u8,
                rmac: {
                    let m = r() & 0xffff_ffff_ffff;
                    let be = m.to_be_bytes();
                    [be[2], be[3], be[4], be[5], be[6], be[7]]
                },
                udp_sport: (d >> 24) as u16,
            },
        };
        let p = &rtr.path;
        let mac = p.rmac.iter().fold(0u64, |m, b| m << 8 | *b as u64);
        writeln!(
            input,
            "init2rtr {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {}",
            rtr.qpn,
            rtr.mtu,
            rtr.log_msg_max,
            rtr.remote_qpn,
            rtr.next_rcv_psn,
            rtr.min_rnr_nak,
            rtr.log_rra_max,
            p.port,
            p.rlid,
            p.sl,
            p.grh as u8,
            p.gid_index,
            c,
            d,
            p.hop_limit,
            p.tclass,
            mac,
            p.udp_sport
        )
        .unwrap();
        expect.push(hex(&rtr.encode()));

        let v = r();
        let rts = Rtr2Rts {
            qpn: v as u32 & 0xff_ffff,
            next_send_psn: (v >> 24) as u32 & 0xff_ffff,
            retry_count: (v >> 48) as u8 & 7,
            rnr_retry: (v >> 51) as u8 & 7,
            ack_timeout: (v >> 54) as u8 & 0x1f,
            log_sra_max: (v >> 59) as u8 & 7,
        };
        writeln!(
            input,
            "rtr2rts {} {} {} {} {} {}",
            rts.qpn, rts.next_send_psn, rts.retry_count, rts.rnr_retry, rts.ack_timeout, rts.log_sra_max
        )
        .unwrap();
        expect.push(hex(&rts.encode()));

        let ops = [
            Opcode::DestroyCq,
            Opcode::DestroyQp,
            Opcode::Qp2Err,
            Opcode::Qp2Rst,
            Opcode::QueryQp,
            Opcode::QueryCq,
        ];
        let (op, n) = (ops[(v % ops.len() as u64) as usize], r() as u32 & 0xff_ffff);
        writeln!(input, "object {} {n}", op.raw()).unwrap();
        expect.push(hex(&command::object_command(op, n)));
    }
    for kind in [CapType::General, CapType::Atomic, CapType::General2] {
        writeln!(input, "query_cap {}", kind as u16).unwrap();
        expect.push(hex(&command::query_hca_cap(kind)));
    }
    let got = c_golden::run(&bin, &input);
    assert_eq!(got.len(), expect.len());
    for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
        assert_eq!(g, e, "mailbox {i}: C (left) and Rust (right) differ");
    }
}

/// The capability readers and the firmware's writers agree, and read what the PRM says.
#[test]
fn capabilities_round_trip_through_the_output_mailbox() {
    use gdaki_layout::prm::command::{AtomicCaps, GeneralCaps, GeneralCaps2};
    use gdaki_layout::prm::layout::{cmd_hca_cap, cmd_hca_cap_2, query_hca_cap_out};
    let caps = GeneralCaps {
        log_max_qp_sz: 15,
        log_max_cq_sz: 22,
        cqe_version: 1,
        atomic: true,
        cd: true,
        log_max_msg: 30,
        ..Default::default()
    };
    let mut out = vec![0u8; command::QUERY_HCA_CAP_OUT_BYTES];
    caps.encode(&mut out);
    assert_eq!(GeneralCaps::decode(&out), caps);
    let at = cmd_hca_cap::CD.within(query_hca_cap_out::CAPABILITY);
    assert_eq!(gdaki_layout::prm::get(&out, at), 1, "Core-Direct");
    let at = cmd_hca_cap::CQE_VERSION.within(query_hca_cap_out::CAPABILITY);
    assert_eq!(gdaki_layout::prm::get(&out, at), 1);
    assert!(!GeneralCaps::decode(&out).hca_cap_2);
    // The second capabilities: the reliable doorbell's bit, alone at its place.
    let two = GeneralCaps2 {
        send_dbr_mode_no_dbr_ext: true,
    };
    let mut out = vec![0u8; command::QUERY_HCA_CAP_OUT_BYTES];
    two.encode(&mut out);
    assert_eq!(GeneralCaps2::decode(&out), two);
    let at = cmd_hca_cap_2::SEND_DBR_MODE_NO_DBR_EXT.within(query_hca_cap_out::CAPABILITY);
    assert_eq!(gdaki_layout::prm::get(&out, at), 1);
    assert_eq!(out.iter().map(|b| b.count_ones()).sum::<u32>(), 1);
    // rdma-core's CmdHcaCap2: bit 1 of byte 0x5c of the capability (byte 0x10 of the output).
    assert_eq!(out[0x10 + 0x5c], 0x40);
    let atomic = AtomicCaps {
        reply_mode: 1,
        host_order_supported: true,
        operations: AtomicCaps::CMP_SWAP | AtomicCaps::FETCH_ADD,
        size_qp: AtomicCaps::SIZE_8_BYTES,
    };
    let mut out = vec![0u8; command::QUERY_HCA_CAP_OUT_BYTES];
    atomic.encode(&mut out);
    assert_eq!(AtomicCaps::decode(&out), atomic);
}

/// `qpc.ts_format` as the kernel's `mlx5_get_qp_default_ts` chooses it from the capability
/// (RoCE's `qp_ts_format`, else `sq_ts_format`): the default clock wherever a real-time one
/// exists, free-running only where nothing else does (gdaki asked for free-running always,
/// which a device with a real-time clock only refuses).
#[test]
fn the_timestamp_format_follows_the_capability() {
    for (cap, want) in [
        (command::TS_FORMAT_CAP_FREE_RUNNING, command::QPC_TS_FORMAT_FREE_RUNNING),
        (command::TS_FORMAT_CAP_REAL_TIME, command::QPC_TS_FORMAT_DEFAULT),
        (
            command::TS_FORMAT_CAP_FREE_RUNNING_AND_REAL_TIME,
            command::QPC_TS_FORMAT_DEFAULT,
        ),
    ] {
        assert_eq!(command::qp_ts_format(cap), want, "capability {cap}");
    }
}

/// `qpc.atomic_mode` as mlx5_ib's `get_atomic_mode` chooses it from the ATOMIC capabilities:
/// extended atomics give the largest QP size (8 bytes at least), IB-spec atomics alone mode 1,
/// no atomics none (a ConnectX without extended atomics refuses mode 3).
#[test]
fn the_atomic_mode_follows_the_atomic_capabilities() {
    use command::AtomicCaps;
    let caps = |operations, size_qp| AtomicCaps {
        operations,
        size_qp,
        ..Default::default()
    };
    let ib = AtomicCaps::CMP_SWAP | AtomicCaps::FETCH_ADD;
    let ext = AtomicCaps::EXTENDED_CMP_SWAP | AtomicCaps::EXTENDED_FETCH_ADD;
    let b8 = AtomicCaps::SIZE_8_BYTES;
    for (ops, sizes, want) in [
        (ib, b8, Some(command::QPC_ATOMIC_MODE_IB_SPEC)),
        (ib | ext, b8, Some(command::QPC_ATOMIC_MODE_UP_TO_8B)),
        (
            ib | AtomicCaps::EXTENDED_FETCH_ADD,
            b8 | 1 << 2,
            Some(command::QPC_ATOMIC_MODE_UP_TO_8B),
        ),
        (ib | ext, b8 | 1 << 4, Some(4)), // MLX5_QPC_ATOMIC_MODE_UP_TO_16B
        (ib | ext, 0, Some(command::QPC_ATOMIC_MODE_IB_SPEC)),
        (AtomicCaps::FETCH_ADD, b8, None),
        (0, b8, None),
    ] {
        assert_eq!(
            caps(ops, sizes).qp_atomic_mode(),
            want,
            "operations {ops:#x}, sizes {sizes:#x}"
        );
    }
}
