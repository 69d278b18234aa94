//! The copies a copier has in flight, for the one ordering rule it keeps: a copy onto bytes an
//! earlier copy still writes waits for it. Checked for every copy, so the common answer (no
//! overlap) must be cheap: small copies are entered in a counting filter over 8-byte granules,
//! and only a hit (or a large copy in flight) costs a scan of the list.
use std::collections::VecDeque;

/// Copies of at most this many bytes go into the filter; larger ones are few at a time (each
/// moves many bytes), and a copy checked while one is in flight scans the list.
const FILTERED_MAX: u64 = 512;
/// Counters in the filter (a power of two): far more than small copies in flight, so that a
/// granule rarely shares its counter with another copy's.
const FILTER_SLOTS: usize = 1 << 15;

/// Copies submitted and not known done, oldest first.
pub(super) struct InFlight {
    /// `(seq, lo, hi)`: descriptor `seq` writes `lo..hi` (several may share a descriptor).
    copies: VecDeque<(u64, u64, u64)>,
    /// Per hashed 8-byte granule: small copies in flight that write it.
    filter: Box<[u16]>,
    /// Large copies in flight.
    wide: usize,
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

    /// Enters copy `seq` of `lo..hi` (not empty).
    pub(super) fn push(&mut self, seq: u64, lo: u64, hi: u64) {
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
        self.copies.push_back((seq, lo, hi));
    }

    /// Forgets the oldest copies while `done(seq)` says they are done.
    pub(super) fn retire(&mut self, mut done: impl FnMut(u64) -> bool) {
        while let Some(&(seq, lo, hi)) = self.copies.front() {
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

    /// The newest copy in flight that writes any of `lo..hi`, if any.
    pub(super) fn overlapping(&self, lo: u64, hi: u64) -> Option<u64> {
        if hi <= lo || self.copies.is_empty() {
            return None;
        }
        if hi - lo <= FILTERED_MAX && self.wide == 0 && granules(lo, hi).all(|g| self.filter[slot(g)] == 0) {
            return None;
        }
        self.copies
            .iter()
            .filter(|&&(_, l, h)| l < hi && lo < h)
            .map(|&(seq, ..)| seq)
            .max()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain answer: every copy in flight scanned.
    fn brute(copies: &[(u64, u64, u64)], lo: u64, hi: u64) -> Option<u64> {
        copies
            .iter()
            .filter(|&&(_, l, h)| l < hi && lo < h && hi > lo)
            .map(|&(s, ..)| s)
            .max()
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
            assert_eq!(f.overlapping(lo, hi), brute(&model, lo, hi), "copy {seq}: {lo}..{hi}");
            f.push(seq, lo, hi);
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
            assert_eq!(f.overlapping(i * 8, i * 8 + 8), None);
            f.push(i + 1, i * 8, i * 8 + 8);
        }
        assert_eq!(f.overlapping(80, 88), Some(11));
        assert_eq!(f.overlapping(4, 12), Some(2));
        let hits = (1000..2000u64)
            .filter(|i| granules(i * 8, i * 8 + 8).any(|g| f.filter[slot(g)] != 0))
            .count();
        assert!(hits < 100, "{hits} of 1000 fresh slots collide in the filter");
    }
}
