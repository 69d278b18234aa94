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
    dbrec: *mut u32,
    doorbell: *mut u64,
    _keep: Arc<dyn Send + Sync>,
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
            dbrec,
            doorbell,
            _keep: keep,
        }
    }

    /// The queue pair's number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    fn published(&self) -> u64 {
        // SAFETY: valid and aligned while the target lives (constructor contract).
        unsafe { AtomicU64::from_ptr(self.index as *mut u64) }.load(Ordering::Acquire)
    }

    /// Rings for index `pi`: the doorbell record, then the doorbell (after it, as mlx5 needs).
    fn ring(&self, pi: u64) {
        // SAFETY: as above.
        unsafe {
            AtomicU32::from_ptr(self.dbrec).store(dbrec::wq_counter(pi).to_be(), Ordering::Release);
            fence(Ordering::Release);
            AtomicU64::from_ptr(self.doorbell).store(doorbell::word(self.qpn, pi), Ordering::Release);
        }
    }
}

/// A target being watched, with the index last rung (the lock keeps rings monotonic when a
/// removal or the final pass races a proxy thread).
struct Watched {
    target: Target,
    rung: Mutex<u64>,
}

impl Watched {
    /// Rings if the published index moved; returns whether it did.
    fn ring_if_needed(&self) -> bool {
        let pi = self.target.published();
        let mut rung = lock(&self.rung);
        if pi <= *rung {
            return false;
        }
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

struct Lane {
    targets: Mutex<Vec<(TargetId, Arc<Watched>)>>,
    version: AtomicU64,
    doorbells: AtomicU64,
    batches: AtomicU64,
    idle_rounds: AtomicU64,
}

struct Shared {
    lanes: Vec<Lane>,
    stop: AtomicBool,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The proxy service: threads ringing doorbells for the targets added to it. Stopped (with
/// everything published rung) by [`stop`](Self::stop) or on drop.
pub struct Proxy {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("threads", &self.threads.len())
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
        let shared = Arc::new(Shared {
            lanes: (0..cfg.threads)
                .map(|_| Lane {
                    targets: Mutex::new(Vec::new()),
                    version: AtomicU64::new(0),
                    doorbells: AtomicU64::new(0),
                    batches: AtomicU64::new(0),
                    idle_rounds: AtomicU64::new(0),
                })
                .collect(),
            stop: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
        });
        let mut proxy = Proxy {
            shared: shared.clone(),
            threads: Vec::new(),
        };
        for index in 0..cfg.threads {
            let shared = shared.clone();
            let idle = cfg.idle;
            let t = std::thread::Builder::new()
                .name(format!("gdaki-proxy-{index}"))
                .spawn(move || run(&shared, index, idle))
                .map_err(|source| ProxyError::Spawn { index, source })?;
            proxy.threads.push(t);
        }
        tracing::debug!(threads = cfg.threads, "CPU proxy started");
        Ok(proxy)
    }

    /// Watches `target` from now on (on the thread with the fewest targets).
    pub fn add(&self, target: Target) -> TargetId {
        let id = TargetId(self.shared.next_id.fetch_add(1, Ordering::Relaxed));
        let lane = self
            .shared
            .lanes
            .iter()
            .min_by_key(|l| lock(&l.targets).len())
            .unwrap_or(&self.shared.lanes[0]);
        // Whatever is already published gets rung in the first round (ringing an index that was
        // rung before is harmless: a doorbell names an absolute index).
        lock(&lane.targets).push((
            id,
            Arc::new(Watched {
                target,
                rung: Mutex::new(0),
            }),
        ));
        lane.version.fetch_add(1, Ordering::Release);
        id
    }

    /// Stops watching `id` after ringing whatever its posters published; `false` if it was not
    /// watched. Posts after this are no longer rung.
    pub fn remove(&self, id: TargetId) -> bool {
        for lane in &self.shared.lanes {
            let removed = {
                let mut targets = lock(&lane.targets);
                targets
                    .iter()
                    .position(|(i, _)| *i == id)
                    .map(|at| targets.swap_remove(at).1)
            };
            if let Some(w) = removed {
                lane.version.fetch_add(1, Ordering::Release);
                if w.ring_if_needed() {
                    lane.doorbells.fetch_add(1, Ordering::Relaxed);
                }
                return true;
            }
        }
        false
    }

    /// The counters so far.
    pub fn counters(&self) -> ProxyCounters {
        let mut c = ProxyCounters::default();
        for l in &self.shared.lanes {
            c.doorbells += l.doorbells.load(Ordering::Relaxed);
            c.batches += l.batches.load(Ordering::Relaxed);
            c.idle_rounds += l.idle_rounds.load(Ordering::Relaxed);
            c.targets += lock(&l.targets).len() as u64;
        }
        c
    }

    /// Stops the threads after a last pass that rings everything published, and returns the
    /// final counters.
    pub fn stop(mut self) -> ProxyCounters {
        self.halt();
        self.counters()
    }

    fn halt(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            // A panicked thread has said so on stderr; its targets are rung below.
            let _ = t.join();
        }
        // Whatever a thread could not ring (it panicked) is rung here.
        for lane in &self.shared.lanes {
            for (_, w) in lock(&lane.targets).iter() {
                if w.ring_if_needed() {
                    lane.doorbells.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.halt();
        }
    }
}

/// A proxy thread: rounds over its lane's targets until stopped, then one last round.
fn run(shared: &Shared, index: usize, idle: IdlePolicy) {
    let lane = &shared.lanes[index];
    let mut snapshot: Vec<Arc<Watched>> = Vec::new();
    let mut seen = u64::MAX;
    let mut idle_rounds = 0u32;
    let mut sleep = Duration::from_micros(1);
    loop {
        let stopping = shared.stop.load(Ordering::Acquire);
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
