//! Fault injection on the soft HCA's TCP transport: a few seconds of mixed traffic (WRITEs,
//! READs, atomics) between two HCAs, every connection through an in-process relay that delays,
//! drops, cuts mid-frame, duplicates and resets. Whatever the fault, every WQE completes
//! (success or error) within the retry timeout, no byte outside the registered range changes,
//! and nothing acknowledged is lost.
mod common;
use common::{pattern, qp, ReadVec};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use gdaki::{Access, Context, ContextOptions, Endpoint, Provider, QpConfig};
use gdaki_device::{Exclusive, WaitError};

/// How long a request waits for its answer.
const RETRY: Duration = Duration::from_millis(300);
/// What a completion may take beyond the retry timeout (delays, thread scheduling on 2 cores).
const SLACK: Duration = Duration::from_millis(1500);

/// What the relay does to one connection, in one direction (`to_responder`: requests; else
/// responses), from byte `at` of that direction's stream on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Forward everything, each chunk after a random delay of up to 2 ms.
    Delay,
    /// Forward nothing more, silently (a lost path: only the retry timeout notices).
    Drop { to_responder: bool, at: usize },
    /// Forward up to byte `at` (usually mid-frame), then close both sides.
    Cut { to_responder: bool, at: usize },
    /// Forward the chunk holding byte `at` twice.
    Duplicate { to_responder: bool, at: usize },
    /// Reset both sides (RST, not FIN) once byte `at` has passed.
    Reset { to_responder: bool, at: usize },
}

const KINDS: [&str; 5] = ["delay", "drop", "cut", "duplicate", "reset"];

impl Fault {
    fn kind(self) -> usize {
        match self {
            Fault::Delay => 0,
            Fault::Drop { .. } => 1,
            Fault::Cut { .. } => 2,
            Fault::Duplicate { .. } => 3,
            Fault::Reset { .. } => 4,
        }
    }

    /// Connection `n`'s fault: the kinds in turn, direction and byte from `rng`. Never inside
    /// the set-up (the connect and the empty shared-memory offer, 52 bytes; the accept and the
    /// offer's answer, 29): a fault there is a refused `connect`, which other tests cover, and
    /// would cost the set-up deadline here.
    fn nth(n: usize, rng: &mut Rng) -> Fault {
        let to_responder = rng.next() % 2 == 0;
        let skip = if to_responder {
            gdaki::wire::HEADER_LEN + gdaki::wire::CONNECT_LEN + gdaki::wire::HEADER_LEN
        } else {
            gdaki::wire::HEADER_LEN + 4 + gdaki::wire::HEADER_LEN + 1
        };
        // Within what a round sends that way: about 2 KiB of requests, 150 bytes of answers.
        let span = if to_responder { 2000 } else { 150 };
        let at = skip + (rng.next() % span) as usize;
        match n % KINDS.len() {
            0 => Fault::Delay,
            1 => Fault::Drop { to_responder, at },
            2 => Fault::Cut { to_responder, at },
            3 => Fault::Duplicate { to_responder, at },
            _ => Fault::Reset { to_responder, at },
        }
    }
}

/// xorshift64: reproducible faults from the seed the test prints.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The relay: accepts on its own address and forwards each connection to `upstream`,
/// applying the next fault.
struct Relay {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Faults applied so far, by kind (a fault whose byte never came is not counted).
    injected: Arc<[AtomicUsize; 5]>,
    accepted: Arc<AtomicUsize>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Relay {
    fn start(upstream: SocketAddr, seed: u64) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let injected: Arc<[AtomicUsize; 5]> = Arc::new(Default::default());
        let accepted = Arc::new(AtomicUsize::new(0));
        let (st, inj, acc) = (stop.clone(), injected.clone(), accepted.clone());
        let thread = thread::spawn(move || {
            let mut rng = Rng(seed | 1);
            for (n, conn) in listener.incoming().enumerate() {
                if st.load(Ordering::Acquire) {
                    return;
                }
                let Ok(down) = conn else { continue };
                let Ok(up) = TcpStream::connect(upstream) else { continue };
                acc.fetch_add(1, Ordering::Relaxed);
                let fault = Fault::nth(n, &mut rng);
                let delay_seed = rng.next();
                for to_responder in [true, false] {
                    let (from, to) = if to_responder {
                        (down.try_clone().unwrap(), up.try_clone().unwrap())
                    } else {
                        (up.try_clone().unwrap(), down.try_clone().unwrap())
                    };
                    let others = [down.try_clone().unwrap(), up.try_clone().unwrap()];
                    let inj = inj.clone();
                    thread::spawn(move || pump(from, to, others, to_responder, fault, delay_seed, &inj));
                }
            }
        });
        Relay {
            addr,
            stop,
            injected,
            accepted,
            thread: Some(thread),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Forwards one direction of a connection, applying `fault` where it applies to this
/// direction. `both`: the two sockets, to close or reset the whole connection.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    both: [TcpStream; 2],
    to_responder: bool,
    fault: Fault,
    seed: u64,
    injected: &[AtomicUsize; 5],
) {
    let mut rng = Rng(seed | 1);
    let mut buf = vec![0u8; 4096];
    let mut passed = 0usize;
    let mut dropping = false;
    let here = |dir: bool| dir == to_responder;
    loop {
        // Chunks of random size, so faults land mid-frame.
        let want = 1 + (rng.next() % buf.len() as u64) as usize;
        let n = match from.read(&mut buf[..want]) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let (start, end) = (passed, passed + n);
        passed = end;
        if dropping {
            continue;
        }
        thread::sleep(Duration::from_micros(rng.next() % 2000));
        let chunk = &buf[..n];
        let sent = match fault {
            Fault::Drop { to_responder: d, at } if here(d) && end > at => {
                injected[fault.kind()].fetch_add(1, Ordering::Relaxed);
                dropping = true;
                to.write_all(&chunk[..at.saturating_sub(start)])
            }
            Fault::Cut { to_responder: d, at } if here(d) && end > at => {
                injected[fault.kind()].fetch_add(1, Ordering::Relaxed);
                let _ = to.write_all(&chunk[..at.saturating_sub(start)]);
                both.iter().for_each(|s| drop(s.shutdown(Shutdown::Both)));
                break;
            }
            Fault::Duplicate { to_responder: d, at } if here(d) && start <= at && at < end => {
                injected[fault.kind()].fetch_add(1, Ordering::Relaxed);
                to.write_all(chunk).and_then(|()| to.write_all(chunk))
            }
            Fault::Reset { to_responder: d, at } if here(d) && end > at => {
                injected[fault.kind()].fetch_add(1, Ordering::Relaxed);
                let _ = to.write_all(&chunk[..at.saturating_sub(start)]);
                for s in &both {
                    // Linger 0: closing sends RST.
                    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
                    let _ = s.shutdown(Shutdown::Read);
                }
                drop(both);
                // The last handles close here (the other pump's fail on the reset).
                return;
            }
            _ => to.write_all(chunk),
        };
        if sent.is_err() {
            break;
        }
    }
    if !dropping {
        let _ = to.shutdown(Shutdown::Write);
    }
}

/// The endpoint as another process would see it, reached through the relay.
fn through(e: Endpoint, relay: SocketAddr) -> Endpoint {
    let mut gid = e.gid;
    gid[8..].iter_mut().for_each(|b| *b ^= 0xa5);
    Endpoint {
        gid,
        addr: Some(relay),
        ..e
    }
}

/// A listening context whose connections stay on TCP (shared memory would bypass the relay).
fn listening() -> Context {
    let options = ContextOptions::default().same_host_shared_memory(false);
    let ctx = Context::open_with(Provider::Soft, options).unwrap();
    ctx.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    ctx
}

/// Guard bytes around the responder's registered window.
const GUARD: usize = 4096;
/// The responder's registered window: per round, 8 WRITE slots of 256 bytes; then a READ area
/// and the atomic counter.
const SLOTS: usize = 8;
const SLOT: usize = 256;
const ROUNDS_MAX: usize = 200;
const READ_AREA: usize = ROUNDS_MAX * SLOTS * SLOT;
const WINDOW: usize = READ_AREA + 4096 + 8;

#[test]
fn every_wqe_completes_and_nothing_acknowledged_is_lost_through_a_faulty_relay() {
    common::log_from_env();
    let seed = std::env::var("GDAKI_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9e37_79b9_7f4a_7c15u64);
    let (a, b) = (listening(), listening());
    let relay = Relay::start(b.listen(([127, 0, 0, 1], 0).into()).unwrap().unwrap(), seed);
    // The responder's memory: the window registered between two guard bands this test owns.
    let mut memory = vec![0x47u8; GUARD + WINDOW + GUARD].into_boxed_slice();
    let read_area = pattern(seed, 4096);
    memory[GUARD + READ_AREA..GUARD + READ_AREA + 4096].copy_from_slice(&read_area);
    memory[GUARD + READ_AREA + 4096..GUARD + WINDOW].fill(0);
    memory[GUARD..GUARD + READ_AREA].fill(0);
    let before = memory.clone();
    let base = memory.as_mut_ptr();
    // SAFETY: `memory` outlives the region (dropped at the end of this test, after every QP
    // and the region), and nothing else writes it meanwhile.
    let window = unsafe { b.register_host(base.add(GUARD), WINDOW, Access::ALL) }.unwrap();
    let local = a.alloc_region(SLOTS * SLOT * 2 + 64, Access::ALL).unwrap();
    let cfg = QpConfig {
        retry_timeout: RETRY,
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let mut outcome = [0usize; 2]; // successes, errors
    let (mut adds_ok, mut adds_posted, mut slowest) = (0u64, 0u64, Duration::ZERO);
    let mut refused = 0;
    let a_addr = a.listen(([127, 0, 0, 1], 0).into()).unwrap().unwrap();
    let started = Instant::now();
    let mut rounds = 0;
    while rounds < ROUNDS_MAX && (rounds < 25 || started.elapsed() < Duration::from_secs(3)) {
        let (qa, qb) = (qp(&a, 64, cfg.clone()), qp(&b, 64, cfg.clone()));
        // The responder's own link goes straight to `a` (it posts nothing).
        qb.connect(&through(qa.endpoint(), a_addr))
            .unwrap_or_else(|e| panic!("round {rounds}: {e}"));
        // A reset right after the accept may take the accept with it (RST discards what the
        // receiver has not read): a refused connect, a clear error, is an outcome too.
        let at = Instant::now();
        if let Err(e) = qa.connect(&through(qb.endpoint(), relay.addr)) {
            assert!(
                at.elapsed() < Duration::from_secs(6),
                "seed {seed:#x}: a connect took {:?}",
                at.elapsed()
            );
            eprintln!("round {rounds}: connect refused: {e}");
            refused += 1;
            rounds += 1;
            continue;
        }
        let dev = unsafe { qa.cpu::<Exclusive>() }.unwrap();
        // The round's operations: a WRITE to each slot, a READ, a fetch-add, in turns.
        let mut posted = Vec::new();
        for op in 0..SLOTS {
            let slot = (rounds * SLOTS + op) * SLOT;
            let len = 64 + (op * 24) % (SLOT - 64);
            let data = pattern((rounds * SLOTS + op) as u64 ^ seed, len);
            local.write((op * SLOT) as u64, &data).unwrap();
            let t = dev.put(window.remote(slot as u64), local.local((op * SLOT) as u64), len as u64);
            posted.push((t.unwrap(), Instant::now(), Some((slot, data))));
            if op % 3 == 1 {
                let at = (SLOTS * SLOT) as u64 + (op * 8) as u64;
                let t = dev
                    .get(local.local(at), window.remote((READ_AREA + op * 8) as u64), 8)
                    .unwrap();
                posted.push((t, Instant::now(), None));
            }
        }
        let counter = window.remote((READ_AREA + 4096) as u64);
        let result = local.local((SLOTS * SLOT * 2) as u64);
        adds_posted += 1;
        let add = dev.atomic(gdaki_device::AtomicOp::FetchAdd(1), counter, result);
        let mut checks = Vec::new();
        for (t, at, write) in posted {
            let r = dev.wait(t);
            let took = at.elapsed();
            slowest = slowest.max(took);
            assert!(
                !matches!(r, Err(WaitError::Timeout { .. })),
                "seed {seed:#x}, round {rounds}: a WQE never completed (hang)"
            );
            assert!(
                took <= RETRY + SLACK,
                "seed {seed:#x}, round {rounds}: completed after {took:?}"
            );
            outcome[r.is_err() as usize] += 1;
            if let (Ok(()), Some(w)) = (r, write) {
                checks.push(w);
            }
        }
        if let Ok(t) = add {
            match dev.wait(t) {
                Ok(()) => adds_ok += 1,
                Err(WaitError::Timeout { .. }) => panic!("seed {seed:#x}, round {rounds}: the atomic hung"),
                Err(_) => {}
            }
        }
        // Nothing acknowledged is lost: each WRITE that completed successfully is there.
        for (slot, data) in checks {
            // SAFETY: inside `memory`; this round's slots are written by no one any more (the
            // WRITE completed, and a slot is used in one round only).
            let got = unsafe { std::slice::from_raw_parts(base.add(GUARD + slot), data.len()) };
            assert_eq!(
                got, data,
                "seed {seed:#x}, round {rounds}: an acknowledged WRITE to {slot:#x} is missing"
            );
        }
        // READs that succeeded brought the READ area's bytes.
        for op in (0..SLOTS).filter(|op| op % 3 == 1) {
            let got = local.read_vec((SLOTS * SLOT + op * 8) as u64, 8).unwrap();
            assert!(
                got == [0; 8] || got == read_area[op * 8..op * 8 + 8],
                "seed {seed:#x}, round {rounds}: a READ brought {got:?}"
            );
        }
        local.write((SLOTS * SLOT) as u64, &[0; SLOTS * 8]).unwrap();
        rounds += 1;
    }
    let accepted = relay.accepted.load(Ordering::Relaxed);
    let injected: Vec<usize> = relay.injected.iter().map(|n| n.load(Ordering::Relaxed)).collect();
    drop(relay);
    // Every QP is gone; the counter got each acknowledged add, and no more than were posted
    // (an add whose answer was lost may still have been applied).
    // SAFETY: an aligned word inside `memory` (the window starts page-aligned plus GUARD).
    let count = unsafe { std::sync::atomic::AtomicU64::from_ptr(base.add(GUARD + READ_AREA + 4096) as *mut u64) }
        .load(Ordering::Acquire);
    assert!(
        (adds_ok..=adds_posted).contains(&count),
        "seed {seed:#x}: counter {count}, {adds_ok} adds acknowledged of {adds_posted}"
    );
    drop(window);
    // No byte outside the registered window changed.
    let outside = (0..GUARD)
        .chain(GUARD + WINDOW..memory.len())
        .filter(|&i| memory[i] != before[i])
        .count();
    let [ok, failed] = outcome;
    let faults: Vec<String> = KINDS
        .iter()
        .zip(&injected)
        .skip(1)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    eprintln!(
        "fault injection (seed {seed:#x}): {rounds} rounds in {:.1} s, {accepted} relayed connections, faults \
         injected: {}; {refused} connects refused; {ok} WQEs succeeded, {failed} failed, slowest completion {slowest:?} (retry timeout \
         {RETRY:?}), {adds_ok} of {adds_posted} atomics acknowledged, counter {count}; bytes outside the \
         region changed: {outside}; hangs: 0",
        started.elapsed().as_secs_f64(),
        faults.join(", "),
    );
    assert_eq!(outside, 0, "seed {seed:#x}: bytes outside the registered range changed");
    assert!(
        ok > 0 && failed > 0,
        "seed {seed:#x}: the mix had no successes or no failures"
    );
    for (k, n) in KINDS.iter().zip(&injected).skip(1) {
        assert!(*n > 0, "seed {seed:#x}: no {k} fault was injected");
    }
}
