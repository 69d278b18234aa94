//! Random WQE streams against the soft HCA: whatever bytes a poster writes into its send
//! queue, the engine neither crashes nor writes outside a registered region; every WQE it
//! takes completes (success or error) or the QP stops in error.
use std::time::{Duration, Instant};

use gdaki::{Access, Context, Provider, QpConfig, QpState};
use gdaki_device::Exclusive;
use gdaki_layout::{ctrl::CtrlSeg, ring, Segment, WqeOpcode};
use proptest::prelude::*;

/// One random WQE: a valid control segment around random segments, or entirely random bytes.
#[derive(Debug, Clone)]
struct RandomWqe {
    opcode: u8,
    ds: u8,
    /// Addresses and keys are picked among interesting values, the rest is raw.
    words: [u64; 6],
    raw: bool,
}

fn wqe() -> impl Strategy<Value = RandomWqe> {
    let opcodes = prop_oneof![
        Just(WqeOpcode::Nop.raw()),
        Just(WqeOpcode::RdmaWrite.raw()),
        Just(WqeOpcode::RdmaRead.raw()),
        Just(WqeOpcode::AtomicFa.raw()),
        Just(WqeOpcode::AtomicCs.raw()),
        any::<u8>(),
    ];
    (
        opcodes,
        0u8..8,
        prop::array::uniform6(any::<u64>()),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(opcode, ds, words, raw)| RandomWqe { opcode, ds, words, raw })
}

proptest! {
    // Few shrink steps: a stalled case costs its whole deadline each time.
    #![proptest_config(ProptestConfig { cases: 48, max_shrink_iters: 16, ..ProptestConfig::default() })]

    #[test]
    fn random_wqe_streams_never_escape_registered_memory(stream in prop::collection::vec(wqe(), 1..24), seed in any::<u64>()) {
        let ctx = Context::open(Provider::Soft).unwrap();
        // Room for 24 WQEs of up to 16 building blocks each.
        let cq = ctx.create_cq(512).unwrap();
        let qp = ctx.create_qp(&cq, QpConfig { sq_size: 512, max_msg_size: 1 << 16, ..Default::default() }).unwrap();
        qp.connect(&qp.endpoint()).unwrap();
        let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
        // Unregistered memory right next to the test's pointers: must stay untouched.
        let canary = vec![0xa5u8; 8192];
        let canary_addr = canary.as_ptr() as u64;
        let dev = unsafe { qp.cpu::<Exclusive>() }.unwrap();
        let pick = |w: u64| -> u64 {
            match w % 5 {
                0 => mr.addr() + (w >> 8) % 4200,   // in or just past the region
                1 => canary_addr + (w >> 8) % 8192, // unregistered
                2 => (w >> 8) % 64,                 // near null
                _ => w,
            }
        };
        let key = |w: u64| -> u32 { if w % 3 == 0 { mr.lkey() } else { (w >> 32) as u32 } };
        // Each WQE starts at the block after the previous one's last, as a poster places them;
        // the doorbell then covers whole WQEs.
        let mut index = 0u64;
        for w in &stream {
            let p = dev.wqe_ptr(index);
            let mut words = [0u64; 8];
            if w.raw {
                words[..6].copy_from_slice(&w.words);
                words[6] = w.words[0].rotate_left(17) ^ seed;
                words[7] = w.words[1].rotate_left(29);
                // Keep the CQE request (byte 11, fm_ce_se), so a success is visible too.
                words[1] |= 0x08 << 24;
            } else {
                let c = CtrlSeg::new(WqeOpcode::from_raw(w.opcode), 0, index as u16, qp.qpn(), w.ds, 8, 0).to_words();
                words[0] = c[0];
                words[1] = c[1];
                // Remote address segment: address, key; then data/atomic/inline segments.
                words[2] = pick(w.words[0]).to_be();
                words[3] = (key(w.words[1]) as u64).to_be();
                words[4] = w.words[2];
                words[5] = w.words[3];
                // A data segment: byte count (maybe inline), key, address.
                let len = (w.words[4] % 300) as u32 | if w.words[4] % 7 == 0 { 0x8000_0000 } else { 0 };
                words[6] = ((key(w.words[5]) as u64) << 32 | len as u64).to_be().rotate_left(32);
                words[7] = pick(w.words[5]).to_be();
            }
            for (k, v) in words.iter().enumerate() {
                unsafe { p.add(k).write_volatile(*v) };
            }
            let ds = u32::from_be_bytes((words[0] >> 32).to_le_bytes()[..4].try_into().unwrap()) & 0x3f;
            index += ring::wqebbs(ds).max(1) as u64;
        }
        let n = stream.len() as u64;
        dev.ring(index);
        // Every WQE completes, or the QP stops in error (and flushes the rest).
        let deadline = Instant::now() + Duration::from_secs(3);
        while (cq.written().unwrap() as u64) < n && qp.state() != QpState::Error && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        prop_assert!(Instant::now() < deadline, "engine stalled: {} CQEs of {n}", cq.written().unwrap());
        prop_assert!(canary.iter().all(|&b| b == 0xa5), "unregistered memory was written");
        cq.status().unwrap();
    }
}
