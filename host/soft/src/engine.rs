//! The engine thread of a soft HCA: watches the doorbells of its queue pairs, fetches the WQEs
//! up to each rung index, and runs them through requester, responder and completer, in order.
//! When nothing happens it spins for [`Idle::spin`] (a latency run's next doorbell finds it
//! awake), then yields, then sleeps a little longer each round (bounded), so an idle engine
//! leaves the cores to posters and proxies.
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gdaki_layout::wqe::{WorkRequest, WqeView, MAX_WQEBBS};
use gdaki_layout::{ctrl, doorbell, ring, Syndrome, SEND_WQE_BB};
use tracing::{debug, trace, warn};

use std::collections::VecDeque;

use crate::completer::{self, Outcome};
use crate::copier::Copier;
use crate::net::{Meta, Rnr};
use crate::objects::SoftQp;
use crate::requester::{self, Executed, Peer, Scratch, Target};
use crate::responder;
use crate::Hca;
use gdaki_devx::util::lock;
use gdaki_devx::QpState;

/// A running engine: dropping it stops the HCA's engine and transport threads and joins the
/// engine.
pub(crate) struct Engine {
    hca: Arc<Hca>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Engine {
    /// Starts the engine of `hca`, idling as `idle` says.
    pub fn start(hca: Arc<Hca>, idle: Idle) -> std::io::Result<Engine> {
        let served = hca.clone();
        let thread = crate::spawn_hca_thread(format!("gdaki-soft-{}", hca.id), move || run(served, idle))?;
        Ok(Engine {
            hca,
            thread: Some(thread),
        })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.hca.stop.store(true, Ordering::Release);
        crate::net::stop(&self.hca);
        if let Some(t) = self.thread.take() {
            // An engine that panicked has already said so on stderr; nothing more to do here.
            let _ = t.join();
        }
    }
}

/// Rounds without work after which a QP counts as quiet.
const QUIET_AFTER: u32 = 64;
/// Quiet QPs whose doorbells a spinning round looks at (in turn): idle QPs cost a busy one at
/// most this many loads per round, however many there are.
const QUIET_PER_ROUND: usize = 64;
/// How the engine waits when a round finds no work: it spins for `spin` after its last work,
/// then yields the core for [`Idle::YIELD`], then sleeps between rounds, longer the longer it
/// has been idle, up to [`Idle::MAX_SLEEP`]. Time, not rounds, so the window does not shrink
/// on a fast machine or with few QPs. Work in any round (a doorbell, a completion a copy was
/// holding back) starts the spin again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Idle {
    /// How long an engine with nothing to do keeps spinning (see
    /// `ContextOptions::engine_idle_spin`).
    pub spin: Duration,
}

/// What an idle round does before the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Loop again at once (a spin-loop hint).
    Spin,
    /// Give the core to another thread, if one is ready.
    Yield,
    /// Sleep this long.
    Sleep(Duration),
}

impl Idle {
    /// The default spin: a ping-pong's next doorbell (microseconds away, tens through a GPU
    /// copier) finds the engine spinning, and a forgotten context stops burning its core
    /// within a fraction of a millisecond.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);
    /// How long the engine yields after spinning, before it sleeps.
    pub const YIELD: Duration = Duration::from_millis(2);
    /// The longest sleep between idle rounds: the worst added latency of a doorbell that finds
    /// the engine asleep.
    pub const MAX_SLEEP: Duration = Duration::from_micros(200);
    /// The shortest sleep.
    const MIN_SLEEP: Duration = Duration::from_micros(10);

    /// Machines with at most this many cores get no spin by default.
    pub const FEW_CORES: usize = 2;

    /// The spin when none is asked for, on a machine of `cores` cores: [`Idle::DEFAULT_SPIN`],
    /// none where there are [`Idle::FEW_CORES`] or fewer. There a spinning engine holds a core
    /// that the posters (a latency test's two, an application's) need, and every figure
    /// measures the wait for it; the engine yields at once instead, and still answers the next
    /// doorbell within a scheduler round.
    pub fn default_spin(cores: usize) -> Duration {
        if cores <= Idle::FEW_CORES {
            Duration::ZERO
        } else {
            Idle::DEFAULT_SPIN
        }
    }

    /// Spinning for `spin`, or for [`Idle::default_spin`] of this machine's cores.
    pub fn spinning_for(spin: Option<Duration>) -> Idle {
        Idle {
            spin: spin
                .unwrap_or_else(|| Idle::default_spin(std::thread::available_parallelism().map_or(1, |n| n.get()))),
        }
    }

    /// What a round that finds no work does, `idle_for` after the last round that found some.
    fn wait(&self, idle_for: Duration) -> Wait {
        if idle_for < self.spin {
            return Wait::Spin;
        }
        let asleep = idle_for - self.spin;
        if asleep < Self::YIELD {
            return Wait::Yield;
        }
        // Sleeps grow with the idle time (a 64th of it), so a long-idle engine wakes rarely.
        Wait::Sleep(((asleep - Self::YIELD) / 64).clamp(Self::MIN_SLEEP, Self::MAX_SLEEP))
    }
}

impl Default for Idle {
    fn default() -> Idle {
        Idle::spinning_for(None)
    }
}

/// A QP as the engine watches it between rounds.
struct Watched {
    served: Arc<Served>,
    /// The doorbell word when the QP was last serviced, with what else makes it due: its
    /// receive counter and its state (receives posted to a QP in error are flushed), and the
    /// peer's "receiver not ready" answers (a retry is due).
    seen: (u64, u16, u8, u32),
    /// Rounds since it last had work.
    quiet: u32,
}

/// Runs until `hca.stop` is set.
///
/// A QP that had work in the last [`QUIET_AFTER`] rounds is serviced every round. A quiet one
/// is serviced only when its doorbell word changed, and while the engine spins only
/// [`QUIET_PER_ROUND`] quiet QPs are looked at per round, in turn: with 10,000 idle QPs a busy
/// QP's round trip no longer waits for 10,000 doorbell loads a round.
pub(crate) fn run(hca: Arc<Hca>, idle_policy: Idle) {
    let mut watched: Vec<Watched> = Vec::new();
    // Indices into `watched` of the QPs that are not quiet, serviced every round.
    let mut active: Vec<usize> = Vec::new();
    let mut version = u64::MAX;
    let mut scratch = Scratch::default();
    // One WQE's bytes, reused: a fresh buffer per doorbell would be a 1 KiB memset per batch.
    let mut wqe = [0u8; MAX_WQEBBS * SEND_WQE_BB];
    // When the rounds started finding no work; `None` while they find some.
    let mut idle_since: Option<Instant> = None;
    let mut spinning = true;
    let mut cursor = 0usize;
    while !hca.stop.load(Ordering::Acquire) {
        if let Some(list) = hca.qps_if_changed(&mut version) {
            // A new list starts every QP as active: each is serviced at least once.
            watched = list
                .into_iter()
                .map(|served| Watched {
                    served,
                    seen: (0, 0, 0, 0),
                    quiet: 0,
                })
                .collect();
            active = (0..watched.len()).collect();
            cursor = 0;
        }
        scratch.release_stale_regions();
        let mut busy = false;
        let mut look = |w: &mut Watched, busy: &mut bool| {
            let qp = &w.served.qp;
            let state = qp.state();
            // The receive record matters here only to a QP in error, which flushes what is
            // posted after it failed too. Read every round otherwise, its cache line (the
            // posters', written on every post) would come from their core each time.
            let posted = match (&qp.rq, state) {
                (Some(rq), QpState::Error) => rq.posted(),
                _ => 0,
            };
            let db = (
                qp.doorbell().load(Ordering::Acquire),
                posted,
                state as u8,
                qp.rnr_events.load(Ordering::Acquire),
            );
            if w.quiet > 0 && db == w.seen {
                // Nothing rung since a round that found no work.
                w.quiet = w.quiet.saturating_add(1);
                return;
            }
            w.seen = db;
            if service(&hca, &w.served, &mut wqe, &mut scratch) {
                *busy = true;
                w.quiet = 0;
            } else {
                w.quiet = w.quiet.saturating_add(1);
            }
        };
        active.retain(|&i| {
            look(&mut watched[i], &mut busy);
            watched[i].quiet < QUIET_AFTER
        });
        // Quiet QPs, a window of them in turn (all of them once the engine has slowed down).
        let n = watched.len();
        let window = if spinning { QUIET_PER_ROUND.min(n) } else { n };
        for k in 0..window {
            let i = (cursor + k) % n;
            let w = &mut watched[i];
            if w.quiet < QUIET_AFTER {
                continue; // active: looked at above
            }
            look(w, &mut busy);
            if w.quiet == 0 {
                active.push(i);
            }
        }
        cursor = (cursor + window) % n.max(1);
        if busy {
            idle_since = None;
            spinning = true;
            continue;
        }
        let now = Instant::now();
        let wait = idle_policy.wait(now - *idle_since.get_or_insert(now));
        spinning = wait == Wait::Spin;
        match wait {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::Sleep(d) => std::thread::sleep(d),
        }
    }
}

/// The engine's progress on a send queue, and where it sends (set at RTR).
#[derive(Default)]
pub(crate) struct SqProgress {
    /// Next building block to fetch.
    pub ci: u64,
    /// The block the last doorbell rang up to: WQEs `ci..rung` wait to be executed (more than
    /// none only while a fenced WQE waits for earlier requests).
    pub rung: u64,
    /// The doorbell value last acted on.
    pub last_doorbell: u64,
    /// The connected peer.
    pub peer: Option<Peer>,
    /// Completions waiting, in WQE order, behind GPU copies still running (in-process target).
    pub deferred: VecDeque<Deferred>,
    /// The WQE at `ci` was answered "receiver not ready" by a peer in this process: it is
    /// tried again from then on (a remote peer's timer runs in its link).
    pub rnr_until: Option<Instant>,
    /// The WQE last answered "receiver not ready", and how often in a row (see [`rnr_nak`]).
    pub rnr: Option<(u64, u32)>,
}

/// Counts a "receiver not ready" answer to WQE `wqe` (another WQE starts again at one): whether
/// the QP's `rnr_retry` still allows trying it again.
fn rnr_nak(rnr: &mut Option<(u64, u32)>, wqe: u64, qp: &SoftQp) -> bool {
    let naks = match *rnr {
        Some((w, n)) if w == wqe => n + 1,
        _ => 1,
    };
    *rnr = Some((wqe, naks));
    qp.state() != QpState::Error && qp.rnr_retries().is_none_or(|max| naks <= max)
}

/// A queue pair the engine serves, with the engine's progress on its send queue (kept here, not
/// in the QP: the progress holds the transport link and the completions waiting behind GPU
/// copies, which the QP's own module sits below).
pub(crate) struct Served {
    /// The queue pair.
    pub qp: Arc<SoftQp>,
    /// How far the engine got, and where the QP sends.
    pub progress: Mutex<SqProgress>,
}

impl Served {
    /// `qp`, nothing fetched yet.
    pub fn new(qp: Arc<SoftQp>) -> Served {
        Served {
            qp,
            progress: Mutex::new(SqProgress::default()),
        }
    }
}

/// A completion of an in-process WQE waiting behind GPU copies: written, in WQE order, once its
/// own copy (if any) and every earlier one are done, so a poller that sees the CQE sees the data.
pub(crate) struct Deferred {
    meta: Meta,
    outcome: Outcome,
    copy: Option<(Arc<Copier>, u64)>,
}

impl Drop for Deferred {
    fn drop(&mut self) {
        // Dropped on the engine thread (or with its QP): the copier goes off this thread.
        if let Some((copier, _)) = self.copy.take() {
            crate::copier::release(copier);
        }
    }
}

/// Writes the deferred completions whose copies are done, oldest first.
fn drain(qp: &SoftQp, deferred: &mut VecDeque<Deferred>) {
    while let Some(front) = deferred.front() {
        let outcome = match &front.copy {
            None => front.outcome,
            Some((copier, seq)) => match copier.done(*seq) {
                Ok(true) => front.outcome,
                Ok(false) => return,
                Err(_) => {
                    qp.fail(Syndrome::RemoteOp);
                    Outcome::Error(Syndrome::RemoteOp)
                }
            },
        };
        let meta = front.meta;
        deferred.pop_front();
        completer::complete(qp, meta.index, meta.opcode, meta.signaled, outcome);
    }
}

/// Executes whatever `qp`'s doorbell announces and writes the completions that are due.
/// Returns whether there was anything (new WQEs, or completions still waiting).
fn service(hca: &Hca, served: &Served, wqe: &mut [u8; MAX_WQEBBS * SEND_WQE_BB], scratch: &mut Scratch) -> bool {
    let qp = &*served.qp;
    let mut progress = lock(&served.progress);
    // Read under the lock: a 2RST resets the progress and clears the word under it, so the
    // word and the progress it is compared with are of one queue.
    let db = qp.doorbell().load(Ordering::Acquire);
    drain(qp, &mut progress.deferred);
    if qp.state() == QpState::Error {
        completer::flush_receives(qp);
    }
    if let Some(busy) = rewind_after_rnr(qp, &mut progress) {
        return busy;
    }
    if db != progress.last_doorbell {
        progress.last_doorbell = db;
        // gdaki's producer index, or a control segment's (rdma-core's doorbell, BlueFlame).
        let (qpn, pi) = doorbell::producer(db.to_ne_bytes());
        if qpn != qp.qpn {
            warn!(
                qpn = format_args!("{:#x}", qp.qpn),
                rung = format_args!("{qpn:#x}"),
                "doorbell names another QP; ignored"
            );
            return true;
        }
        let size = 1u64 << qp.sq_log;
        let rung = progress.ci + pi.wrapping_sub(progress.ci as u16) as u64;
        if rung - progress.ci > size {
            // More than a ring ahead: the poster cannot have written that much. A NIC would
            // fault the QP; so do we, without reading anything.
            qp.fail(Syndrome::LocalQpOp);
            return true;
        }
        progress.rung = rung;
    }
    if progress.ci >= progress.rung {
        return !progress.deferred.is_empty();
    }
    // A WQE the responder had no receive for waits out the RNR timer (a QP in error flushes
    // at once).
    if let Some(until) = progress.rnr_until {
        if Instant::now() < until && qp.state() != QpState::Error {
            return true;
        }
        progress.rnr_until = None;
    }
    let target_bb = progress.rung;
    let SqProgress {
        ci,
        peer,
        deferred,
        rnr_until,
        rnr,
        ..
    } = &mut *progress;
    let mut target = requester::resolve(peer.as_mut());
    // A peer QP in this process: its receive queue, held for the batch once a message takes a
    // receive (dropped before the QP it borrows).
    let local_peer = match &target {
        Target::Local(_, q) => Some(q.clone()),
        _ => None,
    };
    let mut held = requester::HeldReceives::new(local_peer.as_deref());
    while *ci < target_bb {
        let index = *ci;
        if index + WQEBBS_AHEAD < target_bb {
            // Rung, so written: the poster (often a GPU, over PCIe) wrote it last.
            crate::prefetch::for_read(qp.sq.addr() + ring::wqe_offset(index + WQEBBS_AHEAD, qp.sq_log));
        }
        let fetched = fetch(qp, index, target_bb - index, wqe);
        // An incomplete WQE consumes what was rung; only its first block was read.
        let (bbs, read) = match fetched {
            Ok(n) => (n, n),
            Err(rung) => (rung, 1),
        };
        let bytes = &wqe[..read * SEND_WQE_BB];
        let ctrl_seg = WqeView::new_unchecked(bytes).ctrl();
        let meta = Meta {
            index: index as u16,
            opcode: ctrl_seg.opcode().raw(),
            signaled: ctrl_seg.fm_ce_se & ctrl::CE_CQ_UPDATE != 0,
        };
        let halted = matches!(&target, Target::Remote(link) if link.halted);
        let mut fenced = false;
        let outcome = match qp.state() {
            QpState::Error => Some((Outcome::Error(Syndrome::WrFlush), None)),
            // An earlier WQE failed and is still queued behind requests in flight.
            _ if halted => Some((Outcome::Error(Syndrome::WrFlush), None)),
            // The WQE's `ds` runs past the rung index: the doorbell does not cover it, and the
            // blocks after the index may still be in the writing.
            QpState::Rts if fetched.is_err() => Some((Outcome::Error(Syndrome::LocalQpOp), None)),
            QpState::Rts => match WqeView::new_checked(bytes).and_then(|v| WorkRequest::parse(&v)) {
                Ok(wr) => match requester::execute(hca, qp, &mut target, &mut held, meta, &wr, bytes, scratch) {
                    Ok(Executed::Done(bytes)) => Some((Outcome::Success { bytes }, None)),
                    Ok(Executed::InFlight) => None, // the link completes it
                    Ok(Executed::Fenced) => {
                        fenced = true;
                        None
                    }
                    Ok(Executed::NotReady(delay)) => {
                        let retry = rnr_nak(rnr, index, qp);
                        if matches!(*rnr, Some((_, 1))) {
                            debug!(
                                qpn = format_args!("{:#x}", qp.qpn),
                                wqe = index,
                                ?delay,
                                "receiver not ready"
                            );
                        }
                        if !retry {
                            Some((Outcome::Error(Syndrome::RnrRetryExc), None))
                        } else {
                            *rnr_until = Some(Instant::now() + delay);
                            fenced = true;
                            None
                        }
                    }
                    Ok(Executed::Copying { bytes, copier, seq }) => {
                        Some((Outcome::Success { bytes }, Some((copier, seq))))
                    }
                    Err(s) => {
                        if let Target::Local(_, peer) = &target {
                            responder::violated(peer, s);
                        }
                        Some((Outcome::Error(s), None))
                    }
                },
                Err(e) => {
                    trace!(qpn = format_args!("{:#x}", qp.qpn), index, ?e, "malformed WQE");
                    Some((Outcome::Error(e.syndrome()), None))
                }
            },
            // Posting to a QP that is not ready to send.
            _ => Some((Outcome::Error(Syndrome::LocalQpOp), None)),
        };
        if fenced {
            // Held by its fence until earlier requests complete, or by the responder's RNR
            // timer: this WQE and every later one wait for a later round (a NIC's send queue
            // stalls the same way).
            break;
        }
        match (outcome, &mut target) {
            (None, _) => {}
            // Behind requests in flight, completions wait their turn.
            (Some((o, _)), Target::Remote(link)) => link.complete_local(meta, o),
            (Some((o, copy)), _) => {
                // The QP fails at once, so later WQEs flush, even if the CQE waits its turn.
                if let Outcome::Error(s) = o {
                    qp.fail(s);
                }
                if copy.is_none() && deferred.is_empty() {
                    completer::complete(qp, meta.index, meta.opcode, meta.signaled, o);
                } else {
                    deferred.push_back(Deferred { meta, outcome: o, copy });
                }
            }
        }
        *ci += bbs as u64;
    }
    scratch.flush_copies();
    if let Target::Remote(link) = &mut target {
        link.flush();
    }
    drain(qp, deferred);
    true
}

/// Acts on a remote peer's "receiver not ready" answer: `Some(true)` while its timer runs
/// (nothing executes meanwhile); then the send queue goes back to the WQE that found no
/// receive, which executes again with everything after it (the responder dropped them), or,
/// once the QP's `rnr_retry` is spent, that WQE fails. `None`: nothing to do.
fn rewind_after_rnr(qp: &SoftQp, progress: &mut SqProgress) -> Option<bool> {
    let SqProgress { ci, peer, rnr, .. } = progress;
    let Some(Peer::Remote(link)) = peer else { return None };
    match link.rnr()? {
        Rnr::Wait if qp.state() != QpState::Error => Some(true),
        Rnr::Wait | Rnr::Lost => {
            link.give_up_rnr();
            None
        }
        Rnr::Retry { index, seq } => {
            // The full counter of that WQE: at most a ring behind the next one to fetch.
            let wqe = *ci - (*ci as u16).wrapping_sub(index) as u64;
            let retry = rnr_nak(rnr, wqe, qp);
            if matches!(*rnr, Some((_, 1))) {
                debug!(qpn = format_args!("{:#x}", qp.qpn), wqe, "receiver not ready");
            }
            if retry {
                trace!(qpn = format_args!("{:#x}", qp.qpn), wqe, "receiver not ready: again");
                link.rewind(seq);
                *ci = wqe;
            } else {
                link.give_up_rnr();
            }
            None
        }
    }
}

/// How many send-queue blocks ahead of the one it executes the engine asks for (one line each).
const WQEBBS_AHEAD: u64 = 2;

/// Copies the WQE at building block `index` (all its blocks, across the ring's wrap) into
/// `out`; returns its size in blocks (at least one, whatever `ds` claims), or `Err(rung)` with
/// nothing past the first block read when it is larger than the `rung` blocks the doorbell
/// covers from `index`.
fn fetch(qp: &SoftQp, index: u64, rung: u64, out: &mut [u8; MAX_WQEBBS * SEND_WQE_BB]) -> Result<usize, usize> {
    let base = qp.sq.addr();
    let copy_bb = |i: u64, dst: &mut [u8]| {
        let src = base + ring::wqe_offset(index + i, qp.sq_log);
        // SAFETY: a 64-byte block of the live send queue, written before the doorbell this
        // engine acquired.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), SEND_WQE_BB) };
    };
    copy_bb(0, &mut out[..SEND_WQE_BB]);
    let ds = WqeView::new_unchecked(&out[..]).ctrl().ds();
    let bbs = (ring::wqebbs(ds as u32) as usize).max(1);
    if bbs as u64 > rung {
        return Err(rung as usize);
    }
    for i in 1..bbs {
        copy_bb(i as u64, &mut out[i * SEND_WQE_BB..(i + 1) * SEND_WQE_BB]);
    }
    Ok(bbs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On two cores a spinning engine takes the core a poster needs: write_lat's small messages
    /// measured its spin (t_avg 31 us, 99% 106 us here with 200 us; 6.7 and 8 us without).
    #[test]
    fn the_default_spin_gives_a_small_machine_its_cores_back() {
        assert_eq!(Idle::default_spin(1), Duration::ZERO);
        assert_eq!(Idle::default_spin(2), Duration::ZERO);
        assert_eq!(Idle::default_spin(3), Idle::DEFAULT_SPIN);
        assert_eq!(Idle::default_spin(64), Idle::DEFAULT_SPIN);
        assert_eq!(
            Idle::spinning_for(Some(Duration::from_micros(7))).spin,
            Duration::from_micros(7)
        );
    }

    #[test]
    fn an_idle_engine_spins_then_yields_then_sleeps_longer_up_to_the_bound() {
        let idle = Idle {
            spin: Duration::from_micros(100),
        };
        let us = Duration::from_micros;
        assert_eq!(idle.wait(us(0)), Wait::Spin);
        assert_eq!(idle.wait(us(99)), Wait::Spin);
        assert_eq!(idle.wait(us(100)), Wait::Yield);
        assert_eq!(idle.wait(us(100) + Idle::YIELD - us(1)), Wait::Yield);
        assert_eq!(idle.wait(us(100) + Idle::YIELD), Wait::Sleep(Idle::MIN_SLEEP));
        // A 64th of the time asleep, within the bounds.
        assert_eq!(idle.wait(us(100) + Idle::YIELD + us(6400)), Wait::Sleep(us(100)));
        assert_eq!(idle.wait(Duration::from_secs(3600)), Wait::Sleep(Idle::MAX_SLEEP));
    }

    #[test]
    fn no_spin_yields_at_once_and_a_long_spin_never_sleeps_in_a_run() {
        let none = Idle { spin: Duration::ZERO };
        assert_eq!(none.wait(Duration::ZERO), Wait::Yield);
        let long = Idle {
            spin: Duration::from_secs(600),
        };
        assert_eq!(long.wait(Duration::from_secs(599)), Wait::Spin);
        // The documented default: 200 us, none on a machine of 2 cores or fewer.
        assert_eq!(Idle::DEFAULT_SPIN, Duration::from_micros(200));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(
            Idle::default().spin,
            Idle::default_spin(cores),
            "the documented default"
        );
        assert_eq!(Idle::spinning_for(Some(Duration::ZERO)), none);
    }
}
