//! The copies a copier has in flight, for the one ordering rule it keeps: a copy onto bytes an
//! earlier copy still writes lands after it. Checked for every copy, so the common answer (no
//! overlap) must be cheap: small copies are entered in a counting filter over 8-byte granules,
//! and only a hit (or a large copy in flight) costs a scan of the list.
//!
//! A copy that overlaps copies in flight is ordered after them on the GPU (it names one
//! descriptor to wait for) when one of them comes after all the others: each copy records the
//! copy it was ordered after, so a chain of rewrites of the same bytes names its newest link.
use std::collections::VecDeque;

/// Copies of at most this many bytes go into the filter; larger ones are few at a time (each
/// moves many bytes), and a copy checked while one is in flight scans the list.
const FILTERED_MAX: u64 = 512;
/// Counters in the filter (a power of two): far more than small copies in flight, so that a
/// granule rarely shares its counter with another copy's.
const FILTER_SLOTS: usize = 1 << 15;

/// Copies submitted and not known done, oldest first.
pub(super) struct InFlight {
    /// Descriptor `seq` writes `lo..hi` (several copies may share a descriptor).
    copies: VecDeque<InFlightCopy>,
    /// Per hashed 8-byte granule: small copies in flight that write it.
    filter: Box<[u16]>,
    /// Large copies in flight.
    wide: usize,
}

/// One copy in flight.
#[derive(Debug, Clone, Copy)]
struct InFlightCopy {
    seq: u64,
    lo: u64,
    hi: u64,
    /// The descriptor this copy's descriptor waits for on the GPU (0: none).
    after: u64,
}

/// How a new copy relates to the copies in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Overlap {
    /// It writes none of their bytes.
    None,
    /// It overlaps some, and all of them are done once descriptor `.0` is: it may start once
    /// that one is done.
    After(u64),
    /// It overlaps several that are not ordered among themselves; `.0` is the newest.
    Many(u64),
}

/// The granules `lo..hi` touches (`hi > lo`).
fn granules(lo: u64, hi: u64) -> std::ops::RangeInclusive<u64> {
    (lo >> 3)..=((hi - 1) >> 3)
}

fn slot(granule: u64) -> usize {
    // Fibonacci hashing: neighbouring granules land far apart.
    (granule.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - FILTER_SLOTS.trailing_zeros())) as usize
}

impl InFlight {
    pub(super) fn new() -> Self {
        InFlight {
            copies: VecDeque::new(),
            filter: vec![0; FILTER_SLOTS].into_boxed_slice(),
            wide: 0,
        }
    }

    /// Enters copy `seq` of `lo..hi`, whose descriptor waits for descriptor `after` (0: none).
    pub(super) fn push(&mut self, seq: u64, lo: u64, hi: u64, after: u64) {
        if hi <= lo {
            return; // writes nothing: nothing can overlap it
        }
        if hi - lo <= FILTERED_MAX {
            for g in granules(lo, hi) {
                // At most LIST_MAX * RING_SLOTS copies are in flight: no overflow.
                self.filter[slot(g)] += 1;
            }
        } else {
            self.wide += 1;
        }
        self.copies.push_back(InFlightCopy { seq, lo, hi, after });
    }

    /// Forgets the oldest copies while `done(seq)` says they are done.
    pub(super) fn retire(&mut self, mut done: impl FnMut(u64) -> bool) {
        while let Some(&InFlightCopy { seq, lo, hi, .. }) = self.copies.front() {
            if !done(seq) {
                break;
            }
            self.copies.pop_front();
            if hi - lo <= FILTERED_MAX {
                for g in granules(lo, hi) {
                    self.filter[slot(g)] -= 1;
                }
            } else {
                self.wide -= 1;
            }
        }
    }

    /// How `lo..hi` relates to the copies in flight.
    pub(super) fn overlapping(&self, lo: u64, hi: u64) -> Overlap {
        if hi <= lo || self.copies.is_empty() {
            return Overlap::None;
        }
        if hi - lo <= FILTERED_MAX && self.wide == 0 && granules(lo, hi).all(|g| self.filter[slot(g)] == 0) {
            return Overlap::None;
        }
        // The overlapping descriptors that no other overlapping one waits for: when that is a
        // single one, every other is done before it (each waits for an earlier one, down to
        // the ends of the chain). A few at most; more is answered with `Many`.
        let mut newest = 0;
        let mut tips = [0u64; 4];
        let mut waited = [0u64; 4];
        let (mut nt, mut nw, mut many) = (0, 0, false);
        for c in self.copies.iter().filter(|c| c.lo < hi && lo < c.hi) {
            newest = newest.max(c.seq);
            if !tips[..nt].contains(&c.seq) {
                many |= nt == tips.len();
                if let Some(t) = tips.get_mut(nt) {
                    *t = c.seq;
                    nt += 1;
                }
            }
            if c.after != 0 && !waited[..nw].contains(&c.after) {
                many |= nw == waited.len();
                if let Some(w) = waited.get_mut(nw) {
                    *w = c.after;
                    nw += 1;
                }
            }
        }
        if newest == 0 {
            return Overlap::None;
        }
        let mut free = tips[..nt].iter().filter(|t| !waited[..nw].contains(t));
        match (many, free.next(), free.next()) {
            (false, Some(&only), None) => Overlap::After(only),
            _ => Overlap::Many(newest),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain answer: the newest copy in flight that overlaps (every one scanned).
    fn brute(copies: &[(u64, u64, u64)], lo: u64, hi: u64) -> Option<u64> {
        copies
            .iter()
            .filter(|&&(_, l, h)| l < hi && lo < h && hi > lo)
            .map(|&(s, ..)| s)
            .max()
    }

    /// Whether everything in flight that overlaps `lo..hi` is done once `seq` is: each is
    /// `seq` or on the chain of descriptors `seq` waits for.
    fn covers(f: &InFlight, lo: u64, hi: u64, seq: u64) -> bool {
        let before = |s: u64| {
            let mut t = seq;
            loop {
                if t == s {
                    return true;
                }
                match f.copies.iter().find(|c| c.seq == t).map(|c| c.after) {
                    Some(a) if a != 0 => t = a,
                    _ => return false,
                }
            }
        };
        f.copies
            .iter()
            .filter(|c| c.lo < hi && lo < c.hi)
            .all(|c| before(c.seq))
    }

    #[test]
    fn the_filter_answers_as_a_full_scan_would() {
        let mut f = InFlight::new();
        let mut model: Vec<(u64, u64, u64)> = Vec::new();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for seq in 1..20_000u64 {
            let r = next();
            let len = match r % 10 {
                0 => 4096 + r % 70_000,
                1 => 0,
                _ => 1 + (r >> 8) % 600,
            };
            let lo = (r >> 20) % (1 << 20);
            let hi = lo + len;
            let after = match (f.overlapping(lo, hi), brute(&model, lo, hi)) {
                (Overlap::None, None) => 0,
                (Overlap::Many(n), Some(m)) => {
                    assert_eq!(n, m, "copy {seq}");
                    // Waited for (as the copier does): everything up to it is done.
                    f.retire(|s| s <= m);
                    model.retain(|&(s, ..)| s > m);
                    0
                }
                (Overlap::After(n), Some(_)) => {
                    assert!(covers(&f, lo, hi, n), "copy {seq}: {n} does not cover {lo}..{hi}");
                    n
                }
                (got, want) => panic!("copy {seq}: {got:?}, a scan says {want:?}"),
            };
            f.push(seq, lo, hi, after);
            if hi > lo {
                model.push((seq, lo, hi));
            }
            if r % 3 == 0 {
                let done_through = seq.saturating_sub(r % 300);
                f.retire(|s| s <= done_through);
                model.retain(|&(s, ..)| s > done_through);
            }
        }
        f.retire(|_| true);
        assert!(f.filter.iter().all(|&c| c == 0) && f.wide == 0);
    }

    #[test]
    fn neighbouring_small_copies_need_no_scan() {
        // 8-byte copies side by side (put_bw's slots): no false overlap, and a rewrite of a
        // slot in flight is found.
        let mut f = InFlight::new();
        for i in 0..1000u64 {
            assert_eq!(f.overlapping(i * 8, i * 8 + 8), Overlap::None);
            f.push(i + 1, i * 8, i * 8 + 8, 0);
        }
        assert_eq!(f.overlapping(80, 88), Overlap::After(11));
        assert_eq!(f.overlapping(4, 12), Overlap::Many(2));
        // A rewrite of slot 10 ordered after copy 11, then one more: it follows the newest.
        f.push(1001, 80, 88, 11);
        assert_eq!(f.overlapping(80, 88), Overlap::After(1001));
        let hits = (1000..2000u64)
            .filter(|i| granules(i * 8, i * 8 + 8).any(|g| f.filter[slot(g)] != 0))
            .count();
        assert!(hits < 100, "{hits} of 1000 fresh slots collide in the filter");
    }
}
