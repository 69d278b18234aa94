//! What the perftests print: perftest's header block and tables (so people who read
//! `ib_write_bw` / `ib_write_lat` output read these at a glance), the reference measured in the
//! same run, the latency statistics, and the `--json` object.
use serde::{Deserialize, Serialize};

const RULE: &str = "---------------------------------------------------------------------------------------";

/// The header block: a title and `name : value` lines.
pub fn print_header(title: &str, lines: &[(&str, String)]) {
    crate::outln!("{RULE}");
    crate::outln!("{title:^87}");
    for (k, v) in lines {
        crate::outln!(" {k:<22}: {v}");
    }
    crate::outln!("{RULE}");
}

/// A horizontal rule, as perftest closes its tables.
pub fn print_rule() {
    crate::outln!("{RULE}");
}

/// Bytes per MiB, the unit perftest reports bandwidth in.
pub const MIB: f64 = (1u64 << 20) as f64;

/// One `put_bw` row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BwRow {
    /// Message size.
    pub bytes: u64,
    /// Messages per QP.
    pub iterations: u64,
    /// Best window's bandwidth, MiB/s (2^20 bytes).
    pub bw_peak_mib_s: f64,
    /// Whole run's bandwidth, MiB/s.
    pub bw_avg_mib_s: f64,
    /// Messages per second over all QPs, millions.
    pub msg_rate_mpps: f64,
    /// The reference's bandwidth for the same size and count, MiB/s.
    pub ref_bw_mib_s: f64,
    /// `bw_avg_mib_s / ref_bw_mib_s`.
    pub bw_vs_ref: f64,
}

impl BwRow {
    /// The column header (`gbits`: bandwidth in Gbit/s, perftest's `--report_gbits`).
    pub fn header(gbits: bool) -> String {
        let unit = if gbits { "Gb/sec" } else { "MiB/sec" };
        format!(
            " #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]    Ref[{unit}]   BW/Ref"
        )
    }

    /// The row, in the header's columns.
    pub fn line(&self, gbits: bool) -> String {
        let bw = |mib_s: f64| if gbits { mib_s * MIB * 8.0 / 1e9 } else { mib_s };
        format!(
            " {:<10} {:<14} {:<18.2} {:<21.2} {:<16.6} {:<15.2} {:.1}%",
            self.bytes,
            self.iterations,
            bw(self.bw_peak_mib_s),
            bw(self.bw_avg_mib_s),
            self.msg_rate_mpps,
            bw(self.ref_bw_mib_s),
            100.0 * self.bw_vs_ref
        )
    }
}

/// One `write_lat` row: one-way latencies in microseconds (half the measured round trip, as
/// perftest reports), after dropping the two largest samples as perftest does.
#[derive(Debug, Clone, Serialize)]
pub struct LatRow {
    /// Message size.
    pub bytes: u64,
    /// Round trips measured.
    pub iterations: u64,
    /// Smallest.
    pub t_min_us: f64,
    /// Largest.
    pub t_max_us: f64,
    /// Median.
    pub t_typical_us: f64,
    /// Mean.
    pub t_avg_us: f64,
    /// Standard deviation.
    pub t_stdev_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
}

/// Samples perftest leaves out at the top (the first rounds carry warm-up costs).
pub const LAT_MEASURE_TAIL: usize = 2;

impl LatRow {
    /// The statistics of `round_trips_ns` (each round trip halved into a one-way latency).
    pub fn from_round_trips(bytes: u64, round_trips_ns: &[u64]) -> LatRow {
        let mut us: Vec<f64> = round_trips_ns.iter().map(|&ns| ns as f64 / 2e3).collect();
        us.sort_by(f64::total_cmp);
        if us.len() > LAT_MEASURE_TAIL + 1 {
            us.truncate(us.len() - LAT_MEASURE_TAIL);
        }
        let n = us.len().max(1) as f64;
        let avg = us.iter().sum::<f64>() / n;
        let var = us.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n;
        let at = |q: f64| {
            if us.is_empty() {
                return 0.0;
            }
            us[((q * us.len() as f64).ceil() as usize).clamp(1, us.len()) - 1]
        };
        LatRow {
            bytes,
            iterations: round_trips_ns.len() as u64,
            t_min_us: us.first().copied().unwrap_or(0.0),
            t_max_us: us.last().copied().unwrap_or(0.0),
            t_typical_us: at(0.5),
            t_avg_us: avg,
            t_stdev_us: var.sqrt(),
            p99_us: at(0.99),
            p999_us: at(0.999),
        }
    }

    /// The column header.
    pub fn header() -> &'static str {
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
    }

    /// The row, in the header's columns.
    pub fn line(&self) -> String {
        format!(
            " {:<7} {:<10} {:>12.2} {:>14.2} {:>16.2} {:>14.2} {:>16.2} {:>22.2} {:>24.2}",
            self.bytes,
            self.iterations,
            self.t_min_us,
            self.t_max_us,
            self.t_typical_us,
            self.t_avg_us,
            self.t_stdev_us,
            self.p99_us,
            self.p999_us
        )
    }
}

/// The `--json` object: the run's parameters, the reference, and one result per size.
#[derive(Debug, Serialize)]
pub struct JsonReport<P: Serialize, R: Serialize, Row: Serialize> {
    /// `put_bw` or `write_lat`.
    pub test: &'static str,
    /// gdaki's version.
    pub version: &'static str,
    /// The run's parameters.
    pub params: P,
    /// The reference measured in the same run.
    pub reference: R,
    /// One entry per size.
    pub results: Vec<Row>,
    /// `"ok"` once every size's data was validated.
    pub validation: &'static str,
}

/// Prints progress of a sweep on stderr (results go to stdout).
pub fn progress(test: &str, i: usize, n: usize, bytes: u64) {
    if n > 1 {
        eprintln!("{test}: {bytes} B ({}/{n})", i + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_statistics_halve_round_trips_and_drop_the_tail() {
        // 100 round trips of 2..200 us (1..100 us one-way), plus two huge outliers.
        let mut rt: Vec<u64> = (1..=100).map(|i| i * 2000).collect();
        rt.extend([10_000_000, 20_000_000]);
        let r = LatRow::from_round_trips(8, &rt);
        assert_eq!(r.iterations, 102);
        assert_eq!((r.t_min_us, r.t_max_us), (1.0, 100.0));
        assert_eq!(r.t_typical_us, 50.0);
        assert!((r.t_avg_us - 50.5).abs() < 1e-9);
        assert_eq!((r.p99_us, r.p999_us), (99.0, 100.0));
        assert!((r.t_stdev_us - 28.866).abs() < 1e-3);
    }

    #[test]
    fn bandwidth_rows_convert_to_gbits() {
        let row = BwRow {
            bytes: 65536,
            iterations: 5000,
            bw_peak_mib_s: 1000.0,
            bw_avg_mib_s: 500.0,
            msg_rate_mpps: 0.008,
            ref_bw_mib_s: 1000.0,
            bw_vs_ref: 0.5,
        };
        let line = row.line(true);
        let cols: Vec<&str> = line.split_whitespace().collect();
        // 1000 MiB/s = 8.388608 Gb/s (perftest's factor 119.2 between the units).
        assert_eq!(cols[..4], ["65536", "5000", "8.39", "4.19"]);
        assert_eq!(cols.last(), Some(&"50.0%"));
        assert_eq!(BwRow::header(false).split_whitespace().count(), cols.len() + 2);
    }
}
