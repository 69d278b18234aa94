//! `gdaki-proxy`: the CPU-proxy doorbell service. Where a GPU cannot ring the NIC's doorbell
//! (the UAR page cannot be mapped into it), kernels publish their send-queue producer index to a
//! host-pinned word instead, and proxy threads watching many queue pairs write the doorbell
//! record and ring the doorbell on their behalf. The WQEs themselves are written by exactly the
//! same device code as in the GPU-doorbell path; only submission differs.
//!
//! ```no_run
//! # fn demo(target: gdaki_proxy::Target) -> Result<(), gdaki_proxy::ProxyError> {
//! use gdaki_proxy::{Proxy, ProxyConfig};
//! let proxy = Proxy::start(ProxyConfig::default())?; // one thread, spin then back off
//! let id = proxy.add(target);                         // from QueuePair::proxy_target()
//! // ... kernels post; the proxy rings ...
//! proxy.remove(id);                                   // rings what was published, then forgets
//! let counters = proxy.stop();                        // rings everything published, joins
//! # Ok(()) }
//! ```
//!
//! What a proxy thread does per queue pair and round: one acquire load of the published index;
//! if it moved, the doorbell record (release) and the doorbell, with the newest index only
//! (coalescing), under the target's own lock so two rings of one queue pair never go
//! backwards. Targets are spread over the threads; adding and removing them while the proxy
//! runs is cheap for the threads (a version check per round).
//!
//! CPU-assisted targets ([`Target::forwarding`], for rings in GPU memory, which a CPU cannot
//! write): posters write the record and their doorbell image themselves, into a host word
//! instead of the UAR, and the proxy forwards the newest image.
#![warn(missing_docs)]

use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use gdaki_layout::{dbrec, doorbell};
use thiserror::Error;

/// Errors of the proxy service.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// A configuration value out of range.
    #[error("proxy configuration: {0}")]
    Config(String),
    /// A proxy thread could not be started.
    #[error("starting proxy thread {index}: {source}")]
    Spawn {
        /// Which thread.
        index: usize,
        /// Why.
        source: std::io::Error,
    },
}

/// What an idle proxy thread does: spin, then yield, then sleep (doubling up to `max_sleep`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdlePolicy {
    /// Idle rounds spent spinning (lowest latency, one core busy).
    pub spin_rounds: u32,
    /// Further idle rounds spent yielding the core.
    pub yield_rounds: u32,
    /// The longest sleep between rounds once idle for longer (0: never sleep).
    pub max_sleep: Duration,
}

impl Default for IdlePolicy {
    fn default() -> Self {
        IdlePolicy {
            spin_rounds: 20_000,
            yield_rounds: 2_000,
            max_sleep: Duration::from_micros(100),
        }
    }
}

/// How the proxy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyConfig {
    /// Proxy threads (1 to 64); queue pairs are spread over them.
    pub threads: usize,
    /// What idle threads do.
    pub idle: IdlePolicy,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            threads: 1,
            idle: IdlePolicy::default(),
        }
    }
}

/// One queue pair as the proxy sees it: where its posters publish the producer index, and its
/// doorbell record and doorbell. Built by the host library (`QueuePair::proxy_target`).
pub struct Target {
    qpn: u32,
    index: *const u64,
    record: Record,
    doorbell: *mut u64,
    _keep: Arc<dyn Send + Sync>,
}

/// Who writes a target's doorbell record, and what its posters publish.
#[derive(Clone, Copy)]
enum Record {
    /// The proxy, at this address, from the producer index the posters publish.
    Proxy(*mut u32),
    /// Nobody: a reliable doorbell (the QP has no record); posters publish the producer index.
    None,
    /// The posters themselves, and they publish their doorbell image (CPU-assisted: the record
    /// is in GPU memory), which the proxy forwards.
    Posters,
}

// SAFETY: the addresses stay valid while `_keep` lives (constructor contract); every access is
// atomic.
unsafe impl Send for Target {}
// SAFETY: as above.
unsafe impl Sync for Target {}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Target(qpn {:#x})", self.qpn)
    }
}

impl Target {
    /// A queue pair to ring for.
    ///
    /// # Safety
    /// `index` (the u64 producer index posters raise), `dbrec` (the send word of the doorbell
    /// record) and `doorbell` (the 8-byte doorbell) are valid, aligned, CPU-addressable, and
    /// stay so while `keep` lives; nothing but atomics touches them.
    pub unsafe fn new(
        qpn: u32,
        index: *const u64,
        dbrec: *mut u32,
        doorbell: *mut u64,
        keep: Arc<dyn Send + Sync>,
    ) -> Target {
        Target {
            qpn,
            index,
            record: Record::Proxy(dbrec),
            doorbell,
            _keep: keep,
        }
    }

    /// A queue pair with a reliable doorbell (created without a doorbell record): the proxy
    /// rings for the producer index posters publish at `index`, and writes no record.
    ///
    /// # Safety
    /// As [`new`](Self::new), for `index` and `doorbell`.
    pub unsafe fn without_record(
        qpn: u32,
        index: *const u64,
        doorbell: *mut u64,
        keep: Arc<dyn Send + Sync>,
    ) -> Target {
        Target {
            qpn,
            index,
            record: Record::None,
            doorbell,
            _keep: keep,
        }
    }

    /// A queue pair whose posters ring as they would ring a NIC, the doorbell record included,
    /// but store the 8-byte doorbell to the host word `rung` (CPU-assisted, NVSHMEM's mode for
    /// rings in GPU memory, which the CPU cannot write): the proxy forwards the newest doorbell
    /// there to `doorbell` and never touches the record.
    ///
    /// # Safety
    /// As [`new`](Self::new), for `rung` (in place of `index`) and `doorbell`.
    pub unsafe fn forwarding(qpn: u32, rung: *const u64, doorbell: *mut u64, keep: Arc<dyn Send + Sync>) -> Target {
        Target {
            qpn,
            index: rung,
            record: Record::Posters,
            doorbell,
            _keep: keep,
        }
    }

    /// Whether the proxy writes the doorbell record ([`new`](Self::new)), or the posters
    /// write it ([`forwarding`](Self::forwarding)) or the QP has none
    /// ([`without_record`](Self::without_record)).
    pub fn writes_record(&self) -> bool {
        matches!(self.record, Record::Proxy(_))
    }

    /// The queue pair's number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The newest producer index published, given the last one rung: the word itself, or for
    /// a forwarding target the 16-bit index of the doorbell image there, extended past `rung`
    /// (posters are never a ring ahead of what was rung, and a ring holds at most 2^15 WQEs).
    /// `None` for an image that names another QP (nothing rung yet: the word is still 0).
    fn published(&self, rung: u64) -> Option<u64> {
        // SAFETY: valid and aligned while the target lives (constructor contract).
        let word = unsafe { AtomicU64::from_ptr(self.index as *mut u64) }.load(Ordering::Acquire);
        if !matches!(self.record, Record::Posters) {
            return Some(word);
        }
        let (qpn, pi) = doorbell::decode(word.to_ne_bytes());
        (qpn == self.qpn).then(|| rung + pi.wrapping_sub(rung as u16) as u64)
    }

    /// Rings for index `pi`: the doorbell record (unless the posters write it), then the
    /// doorbell (after it, as mlx5 needs).
    fn ring(&self, pi: u64) {
        // SAFETY: as above.
        unsafe {
            if let Record::Proxy(record) = self.record {
                AtomicU32::from_ptr(record).store(dbrec::wq_counter(pi).to_be(), Ordering::Release);
                fence(Ordering::Release);
            }
            AtomicU64::from_ptr(self.doorbell).store(doorbell::word(self.qpn, pi), Ordering::Release);
        }
    }
}

/// A target being watched, with the index last rung (the lock keeps rings monotonic when a
/// removal or the final pass races a proxy thread). Aligned to its own cache lines (two, for
/// the adjacent-line prefetcher): targets are dealt round-robin to the threads, and neighbours
/// that shared a line made every ring's lock word bounce between proxy threads.
#[repr(align(128))]
struct Watched {
    target: Target,
    rung: Mutex<u64>,
}

impl Watched {
    /// Rings if the published index moved; returns whether it did.
    fn ring_if_needed(&self) -> bool {
        let mut rung = lock(&self.rung);
        let Some(pi) = self.target.published(*rung).filter(|&pi| pi > *rung) else {
            return false;
        };
        self.target.ring(pi);
        *rung = pi;
        true
    }
}

/// A handle to a target added to a proxy, for [`Proxy::remove`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TargetId(u64);

/// Counters of a proxy, over all its threads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyCounters {
    /// Doorbells rung.
    pub doorbells: u64,
    /// Rounds that rang at least one doorbell.
    pub batches: u64,
    /// Rounds that found nothing to ring.
    pub idle_rounds: u64,
    /// Targets watched now.
    pub targets: u64,
}

/// One proxy thread's share: its targets and counters (written every round, so on cache lines
/// of their own, away from other lanes).
#[repr(align(128))]
struct Lane {
    targets: Mutex<Vec<(TargetId, Arc<Watched>)>>,
    version: AtomicU64,
    /// Set to stop this thread (after one last round).
    stop: AtomicBool,
    doorbells: AtomicU64,
    batches: AtomicU64,
    idle_rounds: AtomicU64,
}

impl Lane {
    fn new() -> Arc<Lane> {
        Arc::new(Lane {
            targets: Mutex::new(Vec::new()),
            version: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            doorbells: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            idle_rounds: AtomicU64::new(0),
        })
    }

    fn push(&self, entries: impl IntoIterator<Item = (TargetId, Arc<Watched>)>) {
        lock(&self.targets).extend(entries);
        self.version.fetch_add(1, Ordering::Release);
    }
}

/// A running proxy thread.
struct Worker {
    lane: Arc<Lane>,
    thread: JoinHandle<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The proxy service: threads ringing doorbells for the targets added to it. Threads can be
/// added and removed while it runs. Stopped (with everything published rung) by
/// [`stop`](Self::stop) or on drop.
pub struct Proxy {
    workers: Mutex<Vec<Worker>>,
    /// Counters of threads that were removed.
    retired: Mutex<ProxyCounters>,
    idle: IdlePolicy,
    next_id: AtomicU64,
    next_thread: AtomicU64,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("threads", &self.threads())
            .field("counters", &self.counters())
            .finish()
    }
}

impl Proxy {
    /// Starts `cfg.threads` proxy threads (named `gdaki-proxy-N`).
    pub fn start(cfg: ProxyConfig) -> Result<Proxy, ProxyError> {
        if !(1..=64).contains(&cfg.threads) {
            return Err(ProxyError::Config(format!("{} threads (1 to 64)", cfg.threads)));
        }
        let proxy = Proxy {
            workers: Mutex::new(Vec::new()),
            retired: Mutex::new(ProxyCounters::default()),
            idle: cfg.idle,
            next_id: AtomicU64::new(1),
            next_thread: AtomicU64::new(0),
        };
        for _ in 0..cfg.threads {
            proxy.add_thread()?;
        }
        tracing::debug!(threads = cfg.threads, "CPU proxy started");
        Ok(proxy)
    }

    /// Proxy threads running now.
    pub fn threads(&self) -> usize {
        lock(&self.workers).len()
    }

    /// Starts one more proxy thread; it takes targets added from now on (existing ones stay
    /// where they are). Returns the number of threads. At most 64.
    pub fn add_thread(&self) -> Result<usize, ProxyError> {
        let mut workers = lock(&self.workers);
        if workers.len() >= 64 {
            return Err(ProxyError::Config("a 65th thread (at most 64)".into()));
        }
        let index = self.next_thread.fetch_add(1, Ordering::Relaxed) as usize;
        let lane = Lane::new();
        let (l, idle) = (lane.clone(), self.idle);
        let thread = std::thread::Builder::new()
            .name(format!("gdaki-proxy-{index}"))
            .spawn(move || run(&l, idle))
            .map_err(|source| ProxyError::Spawn { index, source })?;
        workers.push(Worker { lane, thread });
        Ok(workers.len())
    }

    /// Stops one proxy thread (after a last round that rings everything published) and hands
    /// its targets to the others. The last thread cannot be removed (use [`stop`](Self::stop)).
    /// Returns the number of threads left.
    pub fn remove_thread(&self) -> Result<usize, ProxyError> {
        let mut workers = lock(&self.workers);
        if workers.len() <= 1 {
            return Err(ProxyError::Config(
                "removing the last thread (stop the proxy instead)".into(),
            ));
        }
        let Some(w) = workers.pop() else {
            return Err(ProxyError::Config("no thread to remove".into()));
        };
        // Hand the targets over first: the others ring them from now on; the leaving thread's
        // last round may ring some too, which the per-target lock keeps in order.
        let moved = std::mem::take(&mut *lock(&w.lane.targets));
        w.lane.version.fetch_add(1, Ordering::Release);
        let n = workers.len();
        for (k, entry) in moved.into_iter().enumerate() {
            workers[k % n].lane.push([entry]);
        }
        retire(&self.retired, w);
        Ok(workers.len())
    }

    /// Watches `target` from now on (on the thread with the fewest targets).
    pub fn add(&self, target: Target) -> TargetId {
        let id = TargetId(self.next_id.fetch_add(1, Ordering::Relaxed));
        // Whatever is already published gets rung in the first round (ringing an index that was
        // rung before is harmless: a doorbell names an absolute index).
        let entry = (
            id,
            Arc::new(Watched {
                target,
                rung: Mutex::new(0),
            }),
        );
        let workers = lock(&self.workers);
        match workers.iter().min_by_key(|w| lock(&w.lane.targets).len()) {
            Some(w) => w.lane.push([entry]),
            // Stopped: ring once here so nothing published is lost.
            None => {
                entry.1.ring_if_needed();
            }
        }
        id
    }

    /// Stops watching `id` after ringing whatever its posters published; `false` if it was not
    /// watched. Posts after this are no longer rung.
    pub fn remove(&self, id: TargetId) -> bool {
        for w in lock(&self.workers).iter() {
            let removed = {
                let mut targets = lock(&w.lane.targets);
                targets
                    .iter()
                    .position(|(i, _)| *i == id)
                    .map(|at| targets.swap_remove(at).1)
            };
            if let Some(watched) = removed {
                w.lane.version.fetch_add(1, Ordering::Release);
                if watched.ring_if_needed() {
                    w.lane.doorbells.fetch_add(1, Ordering::Relaxed);
                }
                return true;
            }
        }
        false
    }

    /// The counters so far (removed threads included).
    pub fn counters(&self) -> ProxyCounters {
        let mut c = *lock(&self.retired);
        for w in lock(&self.workers).iter() {
            add_lane(&mut c, &w.lane);
        }
        c
    }

    /// Stops the threads after a last round that rings everything published, and returns the
    /// final counters.
    pub fn stop(self) -> ProxyCounters {
        self.halt();
        self.counters()
    }

    fn halt(&self) {
        let workers = std::mem::take(&mut *lock(&self.workers));
        for w in &workers {
            w.lane.stop.store(true, Ordering::Release);
        }
        for w in workers {
            retire(&self.retired, w);
        }
    }
}

fn add_lane(c: &mut ProxyCounters, lane: &Lane) {
    c.doorbells += lane.doorbells.load(Ordering::Relaxed);
    c.batches += lane.batches.load(Ordering::Relaxed);
    c.idle_rounds += lane.idle_rounds.load(Ordering::Relaxed);
    c.targets += lock(&lane.targets).len() as u64;
}

/// Stops a worker's thread, rings what it could not (it panicked), and keeps its counters.
fn retire(retired: &Mutex<ProxyCounters>, w: Worker) {
    w.lane.stop.store(true, Ordering::Release);
    // A panicked thread has said so on stderr; its targets are rung below.
    let _ = w.thread.join();
    for (_, watched) in lock(&w.lane.targets).iter() {
        if watched.ring_if_needed() {
            w.lane.doorbells.fetch_add(1, Ordering::Relaxed);
        }
    }
    add_lane(&mut lock(retired), &w.lane);
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.halt();
    }
}

/// A proxy thread: rounds over its lane's targets until stopped, then one last round.
fn run(lane: &Lane, idle: IdlePolicy) {
    let mut snapshot: Vec<Arc<Watched>> = Vec::new();
    let mut seen = u64::MAX;
    let mut idle_rounds = 0u32;
    let mut sleep = Duration::from_micros(1);
    loop {
        let stopping = lane.stop.load(Ordering::Acquire);
        let version = lane.version.load(Ordering::Acquire);
        if version != seen {
            snapshot = lock(&lane.targets).iter().map(|(_, w)| w.clone()).collect();
            seen = version;
        }
        let rang = snapshot.iter().filter(|w| w.ring_if_needed()).count() as u64;
        if rang > 0 {
            lane.doorbells.fetch_add(rang, Ordering::Relaxed);
            lane.batches.fetch_add(1, Ordering::Relaxed);
            idle_rounds = 0;
            sleep = Duration::from_micros(1);
        } else {
            lane.idle_rounds.fetch_add(1, Ordering::Relaxed);
            idle_rounds = idle_rounds.saturating_add(1);
            if idle_rounds <= idle.spin_rounds {
                std::hint::spin_loop();
            } else if idle_rounds <= idle.spin_rounds.saturating_add(idle.yield_rounds) || idle.max_sleep.is_zero() {
                std::thread::yield_now();
            } else {
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(idle.max_sleep);
            }
        }
        if stopping {
            return; // the round above, begun after the stop, rang everything published
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake queue pair: the three words a proxy touches.
    #[repr(C, align(64))]
    #[derive(Default)]
    struct Words {
        index: AtomicU64,
        dbrec: AtomicU32,
        doorbell: AtomicU64,
    }

    fn target(words: &Arc<Words>, qpn: u32) -> Target {
        // SAFETY: the words live as long as the Arc the target keeps.
        unsafe {
            Target::new(
                qpn,
                words.index.as_ptr(),
                words.dbrec.as_ptr(),
                words.doorbell.as_ptr(),
                words.clone(),
            )
        }
    }

    fn rung(words: &Words) -> (u32, u16) {
        let (qpn, pi) = doorbell::decode(words.doorbell.load(Ordering::Acquire).to_ne_bytes());
        (qpn, pi)
    }

    #[test]
    fn published_indices_are_rung_newest_only_and_nothing_is_lost_at_stop() {
        let proxy = Proxy::start(ProxyConfig {
            threads: 3,
            ..Default::default()
        })
        .unwrap();
        let qps: Vec<Arc<Words>> = (0..10).map(|_| Arc::new(Words::default())).collect();
        let ids: Vec<TargetId> = qps
            .iter()
            .enumerate()
            .map(|(i, w)| proxy.add(target(w, 0x100 + i as u32)))
            .collect();
        for round in 1..=200u64 {
            for w in &qps {
                w.index.fetch_max(round * 3, Ordering::Release);
            }
        }
        // Removing one rings what it published; later publications are not rung.
        assert!(proxy.remove(ids[0]));
        assert!(!proxy.remove(ids[0]));
        qps[0].index.fetch_max(1000, Ordering::Release);
        let counters = proxy.stop();
        // Every QP rung with its newest index, 600, including the removed one (its 1000 came
        // after the removal).
        for (i, w) in qps.iter().enumerate() {
            assert_eq!(rung(w), (0x100 + i as u32, 600), "qp {i}");
            assert_eq!(u32::from_be(w.dbrec.load(Ordering::Acquire)), 600);
        }
        // Coalescing: far fewer doorbells than the 2000 publications.
        assert!(counters.doorbells >= 10 && counters.doorbells <= 2000, "{counters:?}");
        assert_eq!(counters.targets, 9);
    }

    #[test]
    fn threads_come_and_go_without_losing_a_target() {
        let proxy = Proxy::start(ProxyConfig::default()).unwrap();
        let qps: Vec<Arc<Words>> = (0..8).map(|_| Arc::new(Words::default())).collect();
        for (i, w) in qps.iter().enumerate() {
            proxy.add(target(w, i as u32));
        }
        assert_eq!(proxy.add_thread().unwrap(), 2);
        assert_eq!(proxy.add_thread().unwrap(), 3);
        let late = Arc::new(Words::default());
        proxy.add(target(&late, 99)); // goes to an empty new thread
        for k in 1..=50u64 {
            for w in qps.iter().chain([&late]) {
                w.index.fetch_max(k, Ordering::Release);
            }
            if k == 20 {
                assert_eq!(proxy.remove_thread().unwrap(), 2);
            }
            if k == 30 {
                assert_eq!(proxy.remove_thread().unwrap(), 1);
                assert!(proxy.remove_thread().is_err(), "the last thread stays");
            }
        }
        let c = proxy.stop();
        assert_eq!(c.targets, 9, "every target survived the moves: {c:?}");
        for w in qps.iter().chain([&late]) {
            assert_eq!(rung(w).1, 50);
        }
    }

    /// CPU-assisted targets: the posters' doorbell images are forwarded, newest only and
    /// never backwards across the 16-bit index's wraps, an image naming another QP is not,
    /// and the record (the posters', here a value no ring writes) is never touched.
    #[test]
    fn forwarding_targets_ring_the_newest_image_across_wraps_and_leave_the_record() {
        let proxy = Proxy::start(ProxyConfig::default()).unwrap();
        let w = Arc::new(Words::default());
        w.dbrec.store(0xdead_beef, Ordering::Release);
        // SAFETY: the words live as long as the Arc the target keeps.
        let t = unsafe { Target::forwarding(7, w.index.as_ptr(), w.doorbell.as_ptr(), w.clone()) };
        assert!(!t.writes_record() && target(&w, 7).writes_record());
        let id = proxy.add(t);
        let publish = |pi: u64| w.index.store(doorbell::word(7, pi), Ordering::Release);
        let wait_rung = |pi: u16| {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while rung(&w) != (7, pi) {
                assert!(std::time::Instant::now() < deadline, "{pi} not rung: {:?}", rung(&w));
                std::thread::yield_now();
            }
        };
        // Steps of up to a ring (2^15) carry the index across two 16-bit wraps.
        let mut pi = 0u64;
        for step in [41u64, 30_000, 32_768, 5, 32_768, 20_000, 32_768, 1] {
            pi += step;
            publish(pi);
            wait_rung(pi as u16);
        }
        assert!(pi > 2 * 65_536);
        // Another QP's image is not this QP's doorbell.
        w.index.store(doorbell::word(8, pi + 3), Ordering::Release);
        assert!(proxy.remove(id));
        assert_eq!(rung(&w), (7, pi as u16));
        assert_eq!(w.dbrec.load(Ordering::Acquire), 0xdead_beef);
        assert!(proxy.stop().doorbells >= 8);
    }

    #[test]
    fn bad_configurations_are_errors() {
        for threads in [0, 65] {
            let e = Proxy::start(ProxyConfig {
                threads,
                ..Default::default()
            })
            .unwrap_err();
            assert!(e.to_string().contains("1 to 64"), "{e}");
        }
    }
}
