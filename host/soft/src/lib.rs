//! `gdaki-soft`: the soft device, a software model of an mlx5 HCA ("Soft-RoCE for GDAKI"). It
//! consumes the very queues, WQEs, doorbells and CQEs a ConnectX NIC would, so `gdaki-device`
//! cannot tell it from hardware. Everything here sits behind the DevX boundary
//! (`gdaki-devx`'s `Device`, which [`SoftDevice`] implements) and knows nothing of the `gdaki`
//! library that drives it; the library names this crate in one place, where a provider is
//! chosen. Beside the device, only the GPU copier is public, for benchmarks and reports of its
//! own.
//!
//! - `Hca`: one per soft device: its memory regions (key table), its queue pairs, the atomics
//!   lock (IB serialises atomics per HCA).
//! - `firmware`: the device boundary: decodes DevX mailboxes, registers regions, owns the
//!   engine.
//! - `engine`: the thread: watches doorbells, fetches WQEs up to the rung index.
//! - `requester`: parses a WQE as untrusted bytes, checks the local side, sends the request.
//! - `responder`: executes a request against the target HCA's memory (rkey, bounds, rights).
//! - `completer`: applies responses locally (READ data, fetched values) and writes CQEs.
//! - `dma`: the memory trait every data movement goes through (not public: its accesses are
//!   only sound on registered ranges).
//! - `net`: the transport to peers in other processes or hosts (TCP), `shm` its same-host
//!   carrier, `ipc` WRITEs from GPU memory to a same-host peer as CUDA IPC references.
//! - [`copier`]: the persistent GPU kernel that moves device-memory bytes.
//!
//! Peers in one process talk directly (the responder runs on the requester's engine thread,
//! against the peer HCA's tables).
//!
//! Nothing outside the library can reach the soft HCA's memory accessors:
//!
//! ```compile_fail
//! // Writing through an arbitrary address from safe code must not compile.
//! gdaki_soft::dma::HostDma::default();
//! ```
pub(crate) mod completer;
pub mod copier;
pub(crate) mod dma;
pub(crate) mod engine;
pub(crate) mod error;
pub(crate) mod firmware;
pub(crate) mod ipc;
pub(crate) mod net;
pub(crate) mod objects;
pub(crate) mod prefetch;
pub(crate) mod requester;
pub(crate) mod responder;
pub(crate) mod shm;

pub use engine::Idle;
pub use error::Error;
pub use firmware::SoftDevice;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

use tracing::debug;

use dma::Dma;
use gdaki_devx::util::{lock, random_u32};
use gdaki_devx::Access;

use crate::error::Result;
use engine::Served;
use objects::{SoftCq, SoftQp};

/// Hashes u32 keys as themselves: keys and QP numbers are random or sequential values this
/// HCA chose, so there is nothing to defend against, and lookups sit on the per-WQE path.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ *b as u64;
        }
    }
    fn write_u32(&mut self, v: u32) {
        // Spread the bits so hashbrown's top-7-bit tags differ too.
        self.0 = (v as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type KeyMap<V> = HashMap<u32, V, std::hash::BuildHasherDefault<IdentityHasher>>;

/// A registered range.
pub(crate) struct Region {
    /// The protection domain: only QPs of this PD may use its keys.
    pub pd: u32,
    pub addr: u64,
    pub len: u64,
    pub access: Access,
    pub dma: Arc<dyn Dma>,
    /// Library-owned memory stays allocated while the engine may still use a lookup of it
    /// (a WQE in flight when its region is dropped).
    pub _keep: Keep,
}

/// Owned memory behind a region, released off the HCA's threads.
///
/// Releasing GPU-mapped memory (`cuMemHostUnregister`, `cuMemFree`) waits for every kernel
/// running on the GPU. The last reference to a deregistered region is often an HCA thread's
/// (a cached key lookup, a WQE in flight): releasing it there would block the engine until the
/// kernels end, while those kernels wait for the engine's completions. So HCA threads hand
/// the memory to a reaper thread instead, and nothing on the data path waits for the GPU.
pub(crate) struct Keep(Option<Arc<dyn Send + Sync>>);

impl Keep {
    pub fn new(owned: Option<Arc<dyn Send + Sync>>) -> Keep {
        Keep(owned)
    }
}

thread_local! {
    /// Set on the threads of soft HCAs (engine, transport): see [`Keep`].
    static HCA_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Starts one of an HCA's threads (engine, transport): memory released on it goes to the
/// reaper (see [`Keep`]).
pub(crate) fn spawn_hca_thread<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<T>> {
    std::thread::Builder::new().name(name).spawn(move || {
        HCA_THREAD.with(|c| c.set(true));
        f()
    })
}

impl Drop for Keep {
    fn drop(&mut self) {
        let Some(owned) = self.0.take() else { return };
        if !HCA_THREAD.with(|c| c.get()) {
            return; // released here, on a user thread
        }
        static REAPER: OnceLock<Option<std::sync::mpsc::Sender<Arc<dyn Send + Sync>>>> = OnceLock::new();
        let reaper = REAPER.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<Arc<dyn Send + Sync>>();
            std::thread::Builder::new()
                .name("gdaki-reaper".into())
                .spawn(move || rx.into_iter().for_each(drop))
                .map_err(|e| tracing::warn!("no reaper thread ({e}): memory is released on HCA threads"))
                .ok()
                .map(|_| tx)
        });
        if let Some(tx) = reaper {
            // The reaper never exits while the sender lives (a static), so this cannot fail.
            let _ = tx.send(owned);
        }
    }
}

impl Region {
    /// Whether `addr..addr + len` lies inside.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }
}

struct CachedRegion {
    hca: u64,
    key: u32,
    version: u64,
    region: Arc<Region>,
}

/// An engine thread's last few key lookups (local and remote keys of the WQEs in flight).
#[derive(Default)]
pub(crate) struct RegionCache {
    entries: [Option<CachedRegion>; 4],
    next: usize,
    /// [`DEREGISTERED`] when the entries were last checked.
    epoch: u64,
}

/// Bumped on every deregistration in the process, so idle HCA threads can drop cached regions
/// promptly ([`RegionCache::release_if_stale`]) and the memory is released by the thread that
/// dropped the region, not later on the reaper, perhaps while a kernel runs.
static DEREGISTERED: AtomicU64 = AtomicU64::new(0);

impl RegionCache {
    /// Forgets every cached region if any region was deregistered since the last call (one
    /// atomic load otherwise). HCA threads call it between batches of work.
    pub fn release_if_stale(&mut self) {
        let now = DEREGISTERED.load(Ordering::Acquire);
        if now != self.epoch {
            self.entries = Default::default();
            self.epoch = now;
        }
    }
}

/// The state of one soft HCA, shared by its context's objects and its engine thread.
pub(crate) struct Hca {
    /// Random 64-bit identity (never 0), how in-process peers find each other; random so an
    /// endpoint from another process does not name an HCA of this one.
    pub id: u64,
    regions: RwLock<KeyMap<Arc<Region>>>,
    /// Bumped on every (de)registration: engines' [`RegionCache`]s compare it.
    regions_version: AtomicU64,
    /// Queue pairs the engine serves; `qps_version` tells the engine to reload the list.
    qps: Mutex<Vec<Arc<Served>>>,
    qps_version: AtomicU64,
    by_qpn: RwLock<KeyMap<Weak<SoftQp>>>,
    /// Completion queues by number: what a WAIT WQE names.
    by_cqn: RwLock<KeyMap<Weak<SoftCq>>>,
    next_qpn: AtomicU32,
    /// Serialises atomics at this HCA (as responder).
    pub atomics: Mutex<()>,
    /// Asks the engine (and the transport threads) to exit.
    pub stop: AtomicBool,
    /// The transport listener, once started.
    pub(crate) listening: Mutex<Option<net::Listening>>,
    /// Incoming transport connections not yet known to come from a QP's RTR peer (see
    /// [`net::MAX_UNVERIFIED`]).
    pub(crate) unverified: net::Waiting,
    /// How transport connections to a peer on this machine may travel.
    pub same_host: SameHost,
    /// How the threads of its shared-memory connections spin (see [`Hca::link_spin`]).
    link_spin: shm::LinkSpin,
}

/// How a soft HCA's transport connections to a peer process on this machine may travel; a
/// connection uses what both sides allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SameHost {
    /// Frames through a shared-memory segment (`ContextOptions::same_host_shared_memory`).
    pub shared_memory: bool,
    /// Over shared memory, WRITEs from GPU memory as CUDA IPC references
    /// (`ContextOptions::same_host_cuda_ipc`).
    pub cuda_ipc: bool,
}

impl Default for SameHost {
    fn default() -> SameHost {
        SameHost {
            shared_memory: true,
            cuda_ipc: true,
        }
    }
}

/// Live HCAs of this process, by id (in-process connections look peers up here).
fn registry() -> &'static Mutex<HashMap<u64, Weak<Hca>>> {
    static REG: OnceLock<Mutex<HashMap<u64, Weak<Hca>>>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

impl Hca {
    /// A new HCA, registered in the process's table; `same_host`: see [`Hca::same_host`];
    /// `idle`: how its engine idles, which its shared-memory links follow ([`Hca::link_spin`]).
    pub fn new(same_host: SameHost, idle: Idle) -> Arc<Hca> {
        let mut reg = lock(registry());
        let id = loop {
            let id = (random_u32() as u64) << 32 | random_u32() as u64;
            if id != 0 && !reg.contains_key(&id) {
                break id;
            }
        };
        let hca = Arc::new(Hca {
            id,
            regions: RwLock::new(KeyMap::default()),
            regions_version: AtomicU64::new(0),
            qps: Mutex::new(Vec::new()),
            qps_version: AtomicU64::new(0),
            by_qpn: RwLock::new(KeyMap::default()),
            by_cqn: RwLock::new(KeyMap::default()),
            // QPNs are 24 bits; start somewhere random so two HCAs rarely share numbers.
            next_qpn: AtomicU32::new(0x100 + (random_u32() & 0xffff)),
            atomics: Mutex::new(()),
            stop: AtomicBool::new(false),
            listening: Mutex::new(None),
            unverified: Default::default(),
            same_host,
            link_spin: shm::LinkSpin::new(idle.spin, Hca::long_link_spinners()),
        });
        reg.insert(hca.id, Arc::downgrade(&hca));
        hca
    }

    /// How long a shared-memory connection's threads (the responder reading requests, the
    /// requester reading answers) spin with nothing to read before they sleep on a futex: as
    /// long as the engine spins (at least [`shm::MIN_SPIN`]), for as many of them at a time as
    /// [`Hca::long_link_spinners`] says, the others [`shm::MIN_SPIN`]. A ping-pong whose round
    /// trip outlasts the spin pays a futex wake (a system call on the sender's side and a
    /// wake-up on the sleeper's) on every message: with 20 us, a socket ping-pong across two
    /// GPUs (a 48 us round trip) did, write_lat's (24 us) mostly did not.
    pub(crate) fn link_spin(&self) -> shm::LinkSpin {
        self.link_spin.clone()
    }

    /// How many link threads of one HCA may spin as long as the engine at a time: an eighth of
    /// the machine's cores (a ping-pong keeps two waiting a process), none below eight cores,
    /// where the engines and the posters of two processes already fill them (on two cores, the
    /// engines forced to spin 200 us, a two-process CPU write_lat took 622 us one way with its
    /// link threads spinning as long, 257 us with them spinning 20 us).
    fn long_link_spinners() -> u32 {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / 8) as u32
    }

    /// The transport listener's address, once listening.
    pub fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        lock(&self.listening).as_ref().map(|l| l.addr)
    }

    /// The live HCA with this id.
    pub fn find(id: u64) -> Option<Arc<Hca>> {
        lock(registry()).get(&id).and_then(Weak::upgrade)
    }

    /// Registers `addr..addr + len` in protection domain `pd` with a fresh random key.
    pub fn register(
        &self,
        pd: u32,
        addr: u64,
        len: u64,
        access: Access,
        dma: Arc<dyn Dma>,
        keep: Option<Arc<dyn Send + Sync>>,
    ) -> Result<u32> {
        // The firmware refuses what a NIC would, whatever the caller checked.
        let max = u64::MAX - addr;
        if len > max {
            return Err(Error::OutOfRange {
                what: "region end",
                got: len,
                min: 0,
                max,
            });
        }
        let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
        let key = loop {
            // Key 0 is never handed out, so a zeroed WQE field never matches a region.
            let k = random_u32();
            if k != 0 && !regions.contains_key(&k) {
                break k;
            }
        };
        self.regions_version.fetch_add(1, Ordering::Release);
        regions.insert(
            key,
            Arc::new(Region {
                pd,
                addr,
                len,
                access,
                dma,
                _keep: Keep::new(keep),
            }),
        );
        debug!(
            hca = self.id,
            key = format_args!("{key:#x}"),
            addr = format_args!("{addr:#x}"),
            len,
            ?access,
            "registered"
        );
        Ok(key)
    }

    /// How many regions protection domain `pd` has.
    pub fn regions_in(&self, pd: u32) -> usize {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        regions.values().filter(|r| r.pd == pd).count()
    }

    /// Removes a key (in-flight work that already looked it up finishes).
    /// Deregisters `key` and releases its memory on the calling thread: HCA threads drop their
    /// cached references when they next go idle, and this waits (briefly) for that, so the
    /// memory is not released later on the reaper, perhaps while a kernel that waits on the HCA
    /// runs (releasing GPU memory waits for every kernel).
    pub fn release(&self, key: u32) {
        let Some(region) = self.deregister(key) else {
            return;
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
        while Arc::strong_count(&region) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        drop(region);
    }

    pub fn deregister(&self, key: u32) -> Option<Arc<Region>> {
        let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
        let gone = regions.remove(&key);
        self.regions_version.fetch_add(1, Ordering::Release);
        DEREGISTERED.fetch_add(1, Ordering::Release);
        gone
    }

    /// The region of `key` if it is in protection domain `pd` (the QP's that uses the key)
    /// and covers `addr..addr + len` with `need` rights, through the engine's cache (one atomic
    /// load when the key was seen and nothing was (de)registered since).
    pub fn region<'c>(
        &self,
        cache: &'c mut RegionCache,
        pd: u32,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Option<&'c Arc<Region>> {
        let version = self.regions_version.load(Ordering::Acquire);
        let hit = cache
            .entries
            .iter()
            .position(|e| matches!(e, Some(c) if c.hca == self.id && c.key == key && c.version == version));
        let slot = match hit {
            Some(i) => i,
            None => {
                let r = self
                    .regions
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&key)?
                    .clone();
                let i = cache.next;
                cache.next = (cache.next + 1) % cache.entries.len();
                cache.entries[i] = Some(CachedRegion {
                    hca: self.id,
                    key,
                    version,
                    region: r,
                });
                i
            }
        };
        let r = &cache.entries[slot].as_ref()?.region;
        (r.pd == pd && r.contains(addr, len) && r.access.contains(need)).then_some(r)
    }

    /// A fresh 24-bit queue pair or completion queue number (they share one counter), never 0
    /// and never one `taken` says is still in use, even after the counter wraps; `None` when
    /// every number is in use.
    pub fn alloc_number(&self, taken: impl Fn(u32) -> bool) -> Option<u32> {
        (0..1u32 << 24)
            .map(|_| self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff)
            .find(|&n| n != 0 && !taken(n))
    }

    /// Adds a queue pair to the engine's list.
    pub fn attach(&self, qp: &Arc<SoftQp>) {
        self.by_qpn
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(qp.qpn, Arc::downgrade(qp));
        lock(&self.qps).push(Arc::new(Served::new(qp.clone())));
        self.qps_version.fetch_add(1, Ordering::Release);
    }

    /// Removes `qp` (that very QP, not another of its number) from the engine's list.
    pub fn detach(&self, qp: &Arc<SoftQp>) {
        {
            let mut by_qpn = self.by_qpn.write().unwrap_or_else(|e| e.into_inner());
            if by_qpn
                .get(&qp.qpn)
                .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(qp)))
            {
                by_qpn.remove(&qp.qpn);
            }
        }
        lock(&self.qps).retain(|s| !Arc::ptr_eq(&s.qp, qp));
        self.qps_version.fetch_add(1, Ordering::Release);
    }

    /// The queue pair `qpn` (as a responder's target).
    pub fn qp(&self, qpn: u32) -> Option<Arc<SoftQp>> {
        self.by_qpn
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qpn)
            .and_then(Weak::upgrade)
    }

    /// Makes `cq` findable by its number (for WAIT WQEs), until [`Hca::detach_cq`].
    pub fn attach_cq(&self, cq: &Arc<SoftCq>) {
        self.by_cqn
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(cq.cqn, Arc::downgrade(cq));
    }

    /// Forgets CQ `cqn`.
    pub fn detach_cq(&self, cqn: u32) {
        self.by_cqn.write().unwrap_or_else(|e| e.into_inner()).remove(&cqn);
    }

    /// The completion queue `cqn`, while it exists.
    pub fn cq(&self, cqn: u32) -> Option<Arc<SoftCq>> {
        self.by_cqn
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&cqn)
            .and_then(Weak::upgrade)
    }

    /// How the engine serves `qp` (its send progress), while it is attached.
    pub fn served(&self, qp: &Arc<SoftQp>) -> Option<Arc<Served>> {
        lock(&self.qps).iter().find(|s| Arc::ptr_eq(&s.qp, qp)).cloned()
    }

    /// The engine's list, if it changed since `version`.
    pub fn qps_if_changed(&self, version: &mut u64) -> Option<Vec<Arc<Served>>> {
        let now = self.qps_version.load(Ordering::Acquire);
        if now == *version {
            return None;
        }
        *version = now;
        Some(lock(&self.qps).clone())
    }
}

impl Drop for Hca {
    fn drop(&mut self) {
        lock(registry()).remove(&self.id);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Records the name of the thread that drops it.
    pub(crate) struct Witness(pub std::sync::mpsc::Sender<Option<String>>);
    impl Drop for Witness {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().name().map(str::to_owned));
        }
    }

    #[test]
    fn memory_released_on_an_hca_thread_goes_to_the_reaper() {
        let (tx, rx) = std::sync::mpsc::channel();
        let keep = Keep::new(Some(Arc::new(Witness(tx.clone()))));
        spawn_hca_thread("hca-like".into(), move || drop(keep))
            .unwrap()
            .join()
            .unwrap();
        let on = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(on.as_deref(), Some("gdaki-reaper"));
        // On any other thread it is released at once, right there.
        drop(Keep::new(Some(Arc::new(Witness(tx)))));
        let on = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(on, std::thread::current().name().map(str::to_owned));
    }

    /// A shared-memory connection spins as long as the engine does, never less than the
    /// ring's own minimum (an engine that does not spin, on a machine of few cores).
    #[test]
    fn a_shared_memory_link_spins_as_long_as_the_engine() {
        use std::time::Duration;
        let spin = |us| {
            Hca::new(
                SameHost::default(),
                Idle {
                    spin: Duration::from_micros(us),
                },
            )
            .link_spin()
            .long()
        };
        assert_eq!(spin(0), shm::MIN_SPIN);
        assert_eq!(spin(200), Duration::from_micros(200));
        assert_eq!(spin(5000), Duration::from_millis(5));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        assert_eq!(Hca::long_link_spinners(), cores / 8);
    }
}
