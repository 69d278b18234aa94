//! The soft HCA's GPU copier alone, without the engine in front of it: one CPU thread submits
//! device-to-device copies as fast as the copier takes them (each to its own destination, so
//! none waits for an earlier one), then waits for the last; and, for the latency, one copy at a
//! time, and one copy with an 8-byte flag stored after it (a message and its flag, as a
//! socket's chunk and its count). Copies cycle through the slots of two buffers. Each size is
//! printed next to a plain device-to-device copy (`cuMemcpyDtoDAsync`, the same size and slots,
//! back to back) measured in the same run.
//!
//! Read against `put_bw --mem device`: what the copier can do bounds what a put can; the gap
//! between the two is the engine's share.
//!
//! `cargo bench -p gdaki --bench gpu_copier [-- --json] [--sizes 8,4096,...] [--copies N]`;
//! without a usable GPU it says so and exits 0.
use std::time::Instant;

use anyhow::Context as _;
use gdaki::cuda::quiesced;
use gdaki::cuda::{self, DeviceBuffer, Gpu};
use gdaki_soft::copier::Copier;
use serde::Serialize;

#[derive(Serialize)]
struct Row {
    bytes: u64,
    copies: u64,
    /// Copies per second, submitted back to back.
    copies_per_s: f64,
    /// The same in MiB/s.
    mib_s: f64,
    /// The plain device copy of the same size, back to back, MiB/s.
    reference_mib_s: f64,
    /// One copy at a time: submit to done, median.
    serial_us: f64,
    /// Of that, in the kernel: seen in the host ring to started by its warp, median.
    serial_handoff_us: f64,
    /// Of that, in the kernel: started to its bytes visible, median.
    serial_serve_us: f64,
    /// One copy and an 8-byte store ordered after it, posted together: submit to the store
    /// done, median.
    flagged_us: f64,
    /// Share of those pairs whose copy and store were both served by the warp that fetched
    /// them from the ring (not handed to worker warps).
    flagged_by_fetcher: f64,
    /// The same two for the stream's last copies (under load).
    stream_handoff_us: f64,
    /// See `stream_handoff_us`.
    stream_serve_us: f64,
    /// Share of the stream's posts that found the copier's ring full (the kernel was behind).
    ring_full: f64,
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Medians of (started - seen, finished - started) over the stamps of `seqs`, in us.
fn stages(copier: &Copier, seqs: impl Iterator<Item = u64>) -> (f64, f64) {
    let (mut handoff, mut serve): (Vec<f64>, Vec<f64>) = seqs
        .filter_map(|q| copier.stamps(q))
        .map(|[seen, started, finished]| {
            (
                started.saturating_sub(seen) as f64 / 1e3,
                finished.saturating_sub(started) as f64 / 1e3,
            )
        })
        .unzip();
    (median(&mut handoff), median(&mut serve))
}

/// Destination slots per size: more than can be in flight (ring slots times a copy list), so no
/// copy waits for one before it.
const SLOTS: u64 = 16384;
/// At most this much device memory for the destinations of one size.
const DST_BYTES: u64 = 512 << 20;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    let sizes: Vec<u64> = match value("--sizes") {
        Some(v) => v
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .context("--sizes")?,
        None => vec![8, 64, 4096, 65536, 1 << 20],
    };
    let copies_arg: Option<u64> = value("--copies").map(|v| v.parse()).transpose().context("--copies")?;
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu_copier: SKIPPED (no usable GPU): {e}");
            return Ok(());
        }
    };
    let info = cuda::probe()?;
    let copier = Copier::of(&gpu)?;
    let mut rows = Vec::new();
    for &len in &sizes {
        anyhow::ensure!(len > 0, "--sizes: a copy moves at least one byte");
        // Enough copies for ~0.2 s at a few GB/s, at least a few thousand for the rate.
        let copies = copies_arg.unwrap_or_else(|| ((1u64 << 30) / len).clamp(2_000, 200_000));
        let stride = len.next_multiple_of(256);
        let slots = (DST_BYTES / stride).clamp(1, SLOTS);
        eprintln!("gpu_copier: {len} B x {copies} ...");
        // Allocations and their frees wait for every kernel: with the copier stopped.
        let (src, dst, flag) = quiesced(|| -> anyhow::Result<_> {
            let bytes = (stride * slots) as usize;
            Ok((
                DeviceBuffer::zeroed(&gpu, bytes)?,
                DeviceBuffer::zeroed(&gpu, bytes)?,
                DeviceBuffer::zeroed(&gpu, 8)?,
            ))
        })?;
        let reference = quiesced(|| gpu.device_copy(len as usize, slots as usize, copies.min(20_000) as u32))?;
        let reference_mib_s = copies.min(20_000) as f64 * len as f64 / reference.as_secs_f64() / (1 << 20) as f64;
        let submit = |i: u64| -> anyhow::Result<u64> {
            let at = (i % slots) * stride;
            // SAFETY: both ranges lie in live device allocations of this GPU (a `stride`-sized
            // slot of each), distinct; nothing else touches them.
            unsafe { copier.submit_copy(dst.device_addr() + at, src.device_addr() + at, len) }
                .map_err(|_| anyhow::anyhow!("the copier failed (see the log)"))
        };
        // Warm-up, then the stream.
        for i in 0..SLOTS {
            submit(i)?;
        }
        let before = copier.stats();
        let started = Instant::now();
        let mut last = 0;
        for i in 0..copies {
            last = submit(i)?;
        }
        copier.settle(last).map_err(|_| anyhow::anyhow!("the copier failed"))?;
        let took = started.elapsed();
        let after = copier.stats();
        let (stream_handoff_us, stream_serve_us) = stages(&copier, last.saturating_sub(200)..=last);
        // One at a time.
        let mut serial_seqs = Vec::new();
        let mut serial: Vec<f64> = (0..200.min(copies))
            .map(|i| {
                let t = Instant::now();
                let seq = submit(i)?;
                copier.settle(seq).map_err(|_| anyhow::anyhow!("the copier failed"))?;
                let took = t.elapsed();
                serial_seqs.push(seq);
                Ok(took.as_secs_f64() * 1e6)
            })
            .collect::<anyhow::Result<_>>()?;
        // Only the last RING_SLOTS answers are still in their slots.
        let (serial_handoff_us, serial_serve_us) = stages(&copier, serial_seqs.into_iter());
        // A copy and its flag, one pair at a time.
        let mut by_fetcher = 0u32;
        let mut flagged: Vec<f64> = (0..200u64)
            .map(|i| {
                let t = Instant::now();
                let copy = submit(i)?;
                // SAFETY: `flag` is a live 8-byte device allocation of this GPU that nothing
                // else touches.
                let store = unsafe { copier.submit_store(flag.device_addr(), &(i + 1).to_le_bytes()) }
                    .map_err(|_| anyhow::anyhow!("the copier failed (see the log)"))?;
                copier.settle(store).map_err(|_| anyhow::anyhow!("the copier failed"))?;
                let took = t.elapsed();
                if copier.served_by_mirror(copy) == Some(true) && copier.served_by_mirror(store) == Some(true) {
                    by_fetcher += 1;
                }
                Ok(took.as_secs_f64() * 1e6)
            })
            .collect::<anyhow::Result<_>>()?;
        quiesced(|| drop((src, dst, flag)));
        rows.push(Row {
            bytes: len,
            copies,
            copies_per_s: copies as f64 / took.as_secs_f64(),
            mib_s: copies as f64 * len as f64 / took.as_secs_f64() / (1 << 20) as f64,
            reference_mib_s,
            serial_us: median(&mut serial),
            serial_handoff_us,
            serial_serve_us,
            flagged_us: median(&mut flagged),
            flagged_by_fetcher: by_fetcher as f64 / 200.0,
            stream_handoff_us,
            stream_serve_us,
            ring_full: (after.ring_full - before.ring_full) as f64 / (after.posted - before.posted).max(1) as f64,
        });
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "gpu": info.gpus[0].name, "rows": rows }))?
        );
    } else {
        println!("GPU copier alone, {} (one CPU thread submitting)", info.gpus[0].name);
        println!(
            " bytes      copies    copies/s     MiB/s        D2D MiB/s    vs D2D   ring full  | one copy [us] \
             (handoff, serve) | copy+flag [us] (by fetcher) | streamed (handoff, serve) [us]"
        );
        for r in &rows {
            println!(
                " {:<10} {:<9} {:>9.2} M {:>12.0} {:>12.0} {:>8.1}% {:>9.1}%  | {:>7.2} ({:.2}, {:.2}) | {:>7.2} ({:>3.0}%) \
                 | ({:.2}, {:.2})",
                r.bytes,
                r.copies,
                r.copies_per_s / 1e6,
                r.mib_s,
                r.reference_mib_s,
                100.0 * r.mib_s / r.reference_mib_s,
                100.0 * r.ring_full,
                r.serial_us,
                r.serial_handoff_us,
                r.serial_serve_us,
                r.flagged_us,
                100.0 * r.flagged_by_fetcher,
                r.stream_handoff_us,
                r.stream_serve_us,
            );
        }
        println!(
            " handoff: seen in the host ring -> started by its warp; serve: started -> bytes visible \
             (GPU global timer, coarse); copy+flag: a copy and an 8-byte store ordered after it, \
             by fetcher: both served by the warp that fetched them"
        );
    }
    Ok(())
}
