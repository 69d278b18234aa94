//! Golden tests: rdma-core's own definitions and helpers (`<infiniband/mlx5dv.h>`, compiled here
//! into a small C program) encode segments and decode CQEs for a table of random inputs; the
//! Rust encodings must match byte for byte. A missing header or compiler fails the test:
//! `tools/setup.sh` installs them (libibverbs-dev, gcc).
use std::path::PathBuf;

use gdaki_layout::atomic::AtomicSeg;
use gdaki_layout::cqe::{self, Cqe64, ErrCqe};
use gdaki_layout::ctrl::{self, CtrlSeg};
use gdaki_layout::data::DataSeg;
use gdaki_layout::raddr::RaddrSeg;
use gdaki_layout::{dbrec, inline, CqeOpcode, Segment, Syndrome, WqeOpcode, SEND_WQE_BB};

#[path = "support/c_golden.rs"]
mod c_golden;
use c_golden::{hex, Rng};

/// Builds the golden program once per test binary (the tests run in parallel).
fn compile() -> &'static PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        c_golden::build(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/mlx5dv_golden.c"),
            &PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mlx5dv_golden"),
        )
    })
}

/// Runs the golden program over `input`, returning its output lines.
fn golden(input: &str) -> Vec<String> {
    c_golden::run(compile(), input)
}

const CASES: usize = 2000;

#[test]
fn wqe_segments_match_rdma_core_encoders() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut input = String::new();
    let mut expect = Vec::new();
    for _ in 0..CASES {
        let r = [rng.next(), rng.next(), rng.next(), rng.next()];
        let (pi, opcode, opmod) = (r[0] as u16, (r[0] >> 16) as u8, (r[0] >> 24) as u8);
        let (qpn, fm_ce_se, ds, imm) = (
            (r[1] as u32) & ctrl::QPN_MAX,
            (r[1] >> 32) as u8,
            (r[1] >> 40) as u8 & 0x3f,
            r[2] as u32,
        );
        input += &format!("ctrl {pi} {opcode} {opmod} {qpn} {fm_ce_se} {ds} 0 {imm}\n");
        let seg = CtrlSeg::new(WqeOpcode::from_raw(opcode), opmod, pi, qpn, ds, fm_ce_se, imm);
        expect.push(hex(bytemuck::bytes_of(&seg)));

        let (len, lkey, addr) = (r[2] as u32 & 0x7fff_ffff, (r[2] >> 32) as u32, r[3]);
        input += &format!("data {len} {lkey} {addr}\n");
        expect.push(hex(bytemuck::bytes_of(&DataSeg::new(len, lkey, addr))));

        input += &format!("raddr {} {}\n", r[3], r[1] as u32);
        expect.push(hex(bytemuck::bytes_of(&RaddrSeg::new(r[3], r[1] as u32))));

        input += &format!("atomic {} {}\n", r[0], r[3]);
        let a = AtomicSeg {
            swap_add: r[0].into(),
            compare: r[3].into(),
        };
        expect.push(hex(bytemuck::bytes_of(&a)));
        if r[0] & 1 == 0 {
            assert_eq!(AtomicSeg::fetch_add(r[0]).swap_add, a.swap_add);
        } else {
            assert_eq!(AtomicSeg::compare_swap(r[3], r[0]), a);
        }
        // The words the device stores must hold the same bytes.
        let words = seg.to_words();
        assert_eq!(
            [words[0].to_ne_bytes(), words[1].to_ne_bytes()].concat(),
            bytemuck::bytes_of(&seg)
        );
    }
    let got = golden(&input);
    assert_eq!(got.len(), expect.len());
    for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
        assert_eq!(g, e, "case {i}: rdma-core (left) and gdaki-layout (right) differ");
    }
}

#[test]
fn cqes_decode_as_rdma_core_reads_them() {
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    let mut input = String::new();
    let mut cqes = Vec::new();
    for i in 0..CASES {
        let r = [rng.next(), rng.next(), rng.next()];
        let owner = (r[0] & 1) as u8;
        let cqe = match i % 4 {
            0 => Cqe64::success(r[0] as u32, (r[0] >> 32) as u16, r[1] as u32, owner),
            3 => Cqe64::responder(
                r[0] as u32,
                (r[0] >> 32) as u16,
                r[1] as u32,
                [CqeOpcode::RespSend, CqeOpcode::RespSendImm, CqeOpcode::RespWrImm][(r[2] % 3) as usize],
                (r[1] >> 32) as u32,
                (r[2] >> 8) as u32,
                owner,
            ),
            2 if i % 8 == 2 => ErrCqe::responder(
                r[0] as u32,
                (r[0] >> 32) as u16,
                Syndrome::from_raw(r[1] as u8),
                (r[1] >> 16) as u8,
                owner,
            )
            .as_cqe(),
            1 => ErrCqe::new(
                r[0] as u32,
                (r[0] >> 32) as u16,
                (r[1] >> 8) as u8,
                Syndrome::from_raw(r[1] as u8),
                (r[1] >> 16) as u8,
                owner,
            )
            .as_cqe(),
            _ => {
                let mut raw = [0u8; 64];
                for (k, b) in raw.iter_mut().enumerate() {
                    *b = (r[k % 3] >> (8 * (k % 8))) as u8;
                }
                bytemuck::cast(raw)
            }
        };
        input += &format!("cqe {}\n", hex(bytemuck::bytes_of(&cqe)));
        cqes.push(cqe);
    }
    for (i, (line, cqe)) in golden(&input).iter().zip(&cqes).enumerate() {
        let f: Vec<u64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
        let err = cqe.as_error();
        let op_own = cqe.op_own;
        let ours = [
            cqe.opcode().raw() as u64,
            cqe.owner() as u64,
            ((op_own & cqe::SE_MASK) >> 1) as u64,
            ((op_own >> cqe::FORMAT_SHIFT) & 3) as u64,
            cqe.wqe_counter.get() as u64,
            cqe.byte_cnt.get() as u64,
            cqe.qpn() as u64,
            err.syndrome().raw() as u64,
            err.vendor_err_synd as u64,
            err.wqe_opcode() as u64,
            cqe.imm() as u64,
            cqe.src_qpn() as u64,
        ];
        assert_eq!(f, ours, "CQE {i} {}", hex(bytemuck::bytes_of(cqe)));
    }
}

#[test]
fn struct_layouts_and_constants_match_the_header() {
    let lines = golden("layout\n");
    let sizes: Vec<usize> = lines[0].split(' ').map(|x| x.parse().unwrap()).collect();
    let ours = [
        ctrl::SIZE,
        ctrl::field::QPN_DS.start,
        ctrl::field::FM_CE_SE.start,
        ctrl::field::IMM.start,
        gdaki_layout::raddr::SIZE,
        gdaki_layout::data::SIZE,
        gdaki_layout::atomic::SIZE,
        cqe::SIZE,
        cqe::field::BYTE_CNT.start,
        cqe::field::WQE_COUNTER.start,
        cqe::field::OP_OWN.start,
        cqe::field::SYNDROME.start,
        cqe::field::VENDOR_ERR_SYND.start,
        cqe::field::S_WQE_OPCODE_QPN.start,
        SEND_WQE_BB,
        inline::INLINE_SEG as usize,
    ];
    assert_eq!(sizes, ours);
    let consts: Vec<i64> = lines[1].split(' ').map(|x| x.parse().unwrap()).collect();
    let ours = [
        ctrl::CE_CQ_UPDATE as i64,
        ctrl::SE_SOLICITED as i64,
        ctrl::FM_FENCE_AND_INITIATOR_SMALL_FENCE as i64,
        ctrl::FM_INITIATOR_SMALL_FENCE as i64,
        dbrec::SND_DBR as i64,
        dbrec::RCV_DBR as i64,
        cqe::OWNER_MASK as i64,
        gdaki_layout::CqeOpcode::Invalid.raw() as i64,
        gdaki_layout::recv::INVALID_LKEY as i64,
        CqeOpcode::RespWrImm.raw() as i64,
        CqeOpcode::RespSend.raw() as i64,
        CqeOpcode::RespSendImm.raw() as i64,
        CqeOpcode::RespErr.raw() as i64,
        WqeOpcode::Send.raw() as i64,
        WqeOpcode::SendImm.raw() as i64,
        WqeOpcode::RdmaWriteImm.raw() as i64,
    ];
    assert_eq!(consts, ours);
    let offsets: Vec<usize> = lines[2].split(' ').map(|x| x.parse().unwrap()).collect();
    assert_eq!(
        offsets,
        [cqe::field::IMM_INVAL_PKEY.start, cqe::field::FLAGS_RQPN.start]
    );
}

/// The patterns a CQ ring may start with (0xf0 / 0xf1 from a byte-wise fill of INVALID with
/// either owner, 0xff as NVSHMEM and DOCA fill it) are never taken as written, on lap 0 or 1;
/// rdma-core reads them as INVALID too. A hand-built error CQE decodes to its syndrome, vendor
/// syndrome, opcode and counter; a CQE with format bits set reports them.
#[test]
fn initial_patterns_error_cqes_and_formats_decode_as_rdma_core_reads_them() {
    use gdaki_layout::ring;
    let mut input = String::new();
    for fill in [0xf0u8, 0xf1, 0xff] {
        for log in [0u32, 3, 6] {
            for lap in 0..2u64 {
                let index = (lap << log) + (1u64 << log) / 2;
                assert!(
                    !ring::cqe_ready(fill, index, log),
                    "{fill:#x} ready at {index} (log {log})"
                );
            }
        }
        input += &format!("cqe {}\n", hex(&[fill; 64]));
    }
    // An error CQE as a NIC writes it: remote access error (0x13), vendor syndrome 0x88, for
    // an RDMA READ (0x10) of QP 0xabcdef, WQE counter 0x1234, owner 1, opcode REQ_ERR (13).
    let mut err = [0u8; 64];
    err[54] = 0x88;
    err[55] = 0x13;
    err[56..60].copy_from_slice(&[0x10, 0xab, 0xcd, 0xef]);
    err[60..62].copy_from_slice(&[0x12, 0x34]);
    err[63] = 0xd1;
    input += &format!("cqe {}\n", hex(&err));
    // A compressed block's title CQE: format 3 in op_own, a requester opcode, owner 0.
    let mut zipped = [0u8; 64];
    zipped[63] = 0x0c;
    input += &format!("cqe {}\n", hex(&zipped));
    let lines = golden(&input);
    for line in &lines[..3] {
        assert!(line.starts_with("15 "), "rdma-core reads a fill as INVALID: {line}");
    }
    let e: ErrCqe = bytemuck::cast(err);
    assert_eq!(e.syndrome(), Syndrome::RemoteAccess);
    assert_eq!(
        (e.vendor_err_synd, e.wqe_opcode(), e.wqe_counter.get()),
        (0x88, 0x10, 0x1234)
    );
    let c: Cqe64 = bytemuck::cast(err);
    assert!(c.opcode().is_error() && c.owner() == 1 && c.qpn() == 0xab_cdef && c.format() == 0);
    // opcode owner se format counter byte_cnt qpn syndrome vendor wqe_opcode imm src_qp
    assert_eq!(lines[3], "13 1 0 0 4660 0 11259375 19 136 16 0 0");
    let z: Cqe64 = bytemuck::cast(zipped);
    assert_eq!((z.format(), z.opcode().raw()), (3, 0));
    assert!(lines[4].starts_with("0 0 0 3 "), "{}", lines[4]);
}
