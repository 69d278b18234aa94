//! Whole-WQE goldens: every `wqe_prepare_*` and every high-level operation writes, into its
//! 64-byte slot, exactly the bytes rdma-core's mlx5 provider composes for the same request
//! (`tests/golden/wqe_golden.c`, built against `<infiniband/mlx5dv.h>`): the DS count, the
//! segment order and the padding, not only each segment on its own (gdaki-layout's goldens
//! check those). Random inputs, deterministic seed.
use std::path::PathBuf;

use gdaki_device::{AtomicOp, Exclusive, Local, Qp, Remote};
use gdaki_layout::ctrl::{self, FenceMode};
use gdaki_layout::handle::QP_FLUSH_AFTER_FETCH;
use gdaki_layout::{ring, DevCq, DevQp, DoorbellKind, SEND_WQE_BB};

#[path = "../../shared-layout/tests/support/c_golden.rs"]
mod c_golden;
use c_golden::{hex, Rng};

fn golden(input: &str) -> Vec<String> {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let bin = BUILT.get_or_init(|| {
        c_golden::build(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/wqe_golden.c"),
            &PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("wqe_golden"),
        )
    });
    c_golden::run(bin, input)
}

const SLOTS: u32 = 6; // log2: 64 slots

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Block([u8; SEND_WQE_BB]);

/// A QP handle over a ring in host memory, starting at WQE `start` with every earlier WQE
/// completed, so posts neither wait nor need a consumer; its doorbell is a plain word.
struct Ring {
    qp: Box<DevQp>,
    sq: Vec<Block>,
    _cq: Vec<Block>,
    _words: Box<[u64; 4]>,
}

impl Ring {
    fn new(qpn: u32, start: u64, flags: u8) -> Ring {
        // 0xa5 everywhere: a byte the device does not write shows up in the comparison.
        let sq = vec![Block([0xa5; SEND_WQE_BB]); 1 << SLOTS];
        let cq = vec![Block([0xff; SEND_WQE_BB]); 1 << SLOTS];
        let mut words = Box::new([0u64; 4]);
        let qp = Box::new(DevQp {
            sq_reserved: start,
            sq_ready: start,
            sq_rung: start,
            sq_base: sq.as_ptr() as u64,
            sq_dbrec: &mut words[0] as *mut u64 as u64 + 4,
            doorbell: &mut words[1] as *mut u64 as u64,
            max_msg_size: 1 << 31,
            timeout_ns: 1_000_000_000,
            qpn,
            sq_log_size: SLOTS,
            doorbell_kind: DoorbellKind::Gpu as u8,
            flags,
            cq: DevCq {
                consumed: start,
                cqe_base: cq.as_ptr() as u64,
                dbrec: &mut words[2] as *mut u64 as u64,
                log_size: SLOTS,
                ..bytemuck::Zeroable::zeroed()
            },
            ..bytemuck::Zeroable::zeroed()
        });
        Ring {
            qp,
            sq,
            _cq: cq,
            _words: words,
        }
    }

    fn qp(&self) -> Qp<Exclusive> {
        // SAFETY: the handle and everything it points to live as long as `self`; one thread.
        unsafe { Qp::from_raw(&*self.qp as *const DevQp as *mut DevQp) }
    }

    /// The `ds * 16` bytes of the WQE at `index`.
    fn wqe(&self, index: u64) -> (u8, String) {
        let b = &self.sq[ring::slot(index, SLOTS) as usize].0;
        let ds = b[7] & 0x3f;
        (ds, hex(&b[..ds as usize * 16]))
    }
}

/// One request for both sides: the C program's line, and what the device wrote.
struct Case {
    line: String,
    got: (u8, String),
}

#[test]
fn every_wqe_the_device_writes_matches_rdma_core() {
    let mut rng = Rng(0x5eed_0f9a_1100_7e57);
    let mut cases = Vec::new();
    for c in 0..300u64 {
        let r = [rng.next(), rng.next(), rng.next(), rng.next()];
        let qpn = (r[0] as u32) & ctrl::QPN_MAX;
        // Any start, so WQE indices cover the 16-bit range and its wrap.
        let start = (r[0] >> 32) & 0x1_ffff;
        let remote = Remote {
            addr: r[1],
            rkey: (r[2] >> 32) as u32,
        };
        let local = Local {
            addr: r[3],
            lkey: r[2] as u32,
        };
        let len = 1 + (r[2] >> 8) as u32 % (1 << 30);
        let fence = ctrl::FM_FENCE as u32;
        let ring = Ring::new(qpn, start, 0);
        let qp = ring.qp();
        let mut push = |line: String, index: u64| {
            cases.push(Case {
                line,
                got: ring.wqe(index),
            })
        };
        let (ra, rk, la, lk) = (remote.addr, remote.rkey, local.addr, local.lkey);

        // The low level, at the next free slot each.
        let mut at = start;
        qp.wqe_prepare_nop(at, 0);
        push(format!("nop {} {qpn} 0", at as u16), at);
        at += 1;
        qp.wqe_prepare_write(at, remote, local, len, 0);
        push(format!("write {} {qpn} 0 {ra} {rk} {la} {lk} {len}", at as u16), at);
        at += 1;
        qp.wqe_prepare_read(at, local, remote, len, ctrl::FM_FENCE);
        push(
            format!("read {} {qpn} {fence} {ra} {rk} {la} {lk} {len}", at as u16),
            at,
        );
        at += 1;
        qp.wqe_prepare_atomic(at, AtomicOp::FetchAdd(r[0]), remote, local, 0);
        push(format!("fa {} {qpn} 0 {ra} {rk} {la} {lk} {} 0", at as u16, r[0]), at);
        at += 1;
        let (cmp, swap) = (r[1] ^ r[3], r[2]);
        qp.wqe_prepare_atomic(at, AtomicOp::CompareSwap { compare: cmp, swap }, remote, local, 0);
        push(format!("cs {} {qpn} 0 {ra} {rk} {la} {lk} {swap} {cmp}", at as u16), at);
        at += 1;
        qp.wqe_prepare_dump(at, local, 1, ctrl::FM_FENCE);
        push(format!("dump {} {qpn} {fence} {la} {lk} 1", at as u16), at);
        at += 1;
        for (k, n) in [0usize, 12, 13, 28, (c % 29) as usize].into_iter().enumerate() {
            let data: Vec<u8> = (0..n).map(|i| (r[k % 4] >> (i % 8 * 8)) as u8 ^ i as u8).collect();
            qp.wqe_prepare_write_inline(at, remote, &data, 0).unwrap();
            let h = if n == 0 { "x".to_string() } else { hex(&data) };
            push(format!("inline {} {qpn} 0 {ra} {rk} {n} {h}", at as u16), at);
            at += 1;
        }
        // Keep the handle's counters where the low level left them: the high level starts
        // after these slots.
        qp.mark_ready(start, at).unwrap();
        qp.submit(at).unwrap();

        // The high level: tickets name the slots (all single-WQE here).
        let t = qp.put(remote, local, len as u64).unwrap();
        push(format!("write {} {qpn} 0 {ra} {rk} {la} {lk} {len}", t as u16), t);
        let t = qp.fenced().put(remote, local, len as u64).unwrap();
        push(format!("write {} {qpn} {fence} {ra} {rk} {la} {lk} {len}", t as u16), t);
        let t = qp.get(local, remote, len as u64).unwrap();
        push(format!("read {} {qpn} 0 {ra} {rk} {la} {lk} {len}", t as u16), t);
        let t = qp.put(remote, local, 0).unwrap();
        push(format!("nop {} {qpn} 0", t as u16), t);
        let data = &r[3].to_le_bytes()[..(c % 9) as usize];
        let t = qp.put_inline(remote, data).unwrap();
        let h = if data.is_empty() { "x".to_string() } else { hex(data) };
        push(format!("inline {} {qpn} 0 {ra} {rk} {} {h}", t as u16, data.len()), t);
        let aligned = Remote {
            addr: remote.addr & !7,
            ..remote
        };
        let aa = aligned.addr;
        let t = qp.atomic(AtomicOp::FetchAdd(r[2]), aligned, local).unwrap();
        push(format!("fa {} {qpn} 0 {aa} {rk} {la} {lk} {} 0", t as u16, r[2]), t);
        let t = qp
            .atomic(AtomicOp::CompareSwap { compare: cmp, swap }, aligned, local)
            .unwrap();
        push(format!("cs {} {qpn} 0 {aa} {rk} {la} {lk} {swap} {cmp}", t as u16), t);

        // The flush form: a READ and an atomic, each followed by a fenced DUMP of one byte.
        let flushing = Ring::new(qpn, start, QP_FLUSH_AFTER_FETCH);
        let qp = flushing.qp();
        let fetches = [
            (
                qp.get(local, remote, len as u64).unwrap(),
                format!("read {{}} {qpn} 0 {ra} {rk} {la} {lk} {len}"),
            ),
            (
                qp.atomic(AtomicOp::FetchAdd(1), aligned, local).unwrap(),
                format!("fa {{}} {qpn} 0 {aa} {rk} {la} {lk} 1 0"),
            ),
        ];
        for (t, fetch) in fetches {
            cases.push(Case {
                line: fetch.replace("{}", &((t - 1) as u16).to_string()),
                got: flushing.wqe(t - 1),
            });
            cases.push(Case {
                line: format!("dump {} {qpn} {fence} {la} {lk} 1", t as u16),
                got: flushing.wqe(t),
            });
        }
    }
    let input: String = cases.iter().map(|c| c.line.clone() + "\n").collect();
    let out = golden(&input);
    assert_eq!(out.len(), cases.len());
    for (c, line) in cases.iter().zip(&out) {
        let (ds, bytes) = line.split_once(' ').unwrap();
        assert_eq!(
            (ds.parse::<u8>().unwrap(), bytes),
            (c.got.0, c.got.1.as_str()),
            "request `{}`: rdma-core (left) and gdaki-device (right) differ",
            c.line
        );
    }
    // The fence the device uses is the PRM's FENCE mode, which the C side spells by value.
    assert_eq!(golden("fence\n"), [ctrl::FM_FENCE.to_string()]);
    assert_eq!(FenceMode::from_fm_ce_se(ctrl::FM_FENCE), FenceMode::Fence);
}
