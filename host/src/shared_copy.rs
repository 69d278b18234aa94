//! Copies in and out of memory that other agents may access at the same time: registered
//! regions, which the HCA writes (a peer's WRITE, READ data landing), and which GPU kernels
//! or other application threads may touch while the application copies through
//! `MemoryRegion::read`/`write`.
//!
//! A plain `copy` there is a data race in Rust's memory model (undefined behaviour, whatever
//! the hardware does), so these copy word by word with relaxed atomic loads and stores, which
//! compile to the same plain moves on x86-64 and AArch64 but are defined when they race. What
//! they do not give is a consistent snapshot: bytes written concurrently may come from before
//! or after the write, per 8-byte word (aligned words are never torn), exactly as a NIC's DMA
//! into a buffer being read. Ordering against a flag is the caller's: a reader that first
//! loads a signal word with acquire ordering then sees the data written before it.
use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering::Relaxed};

/// Copies `dst.len()` bytes at `src` into `dst`, then fences (acquire).
///
/// # Safety
/// `src..src + dst.len()` is valid for reads for the whole call, and every other access to it
/// during the call is atomic (or by hardware outside the program).
pub(crate) unsafe fn load(src: *const u8, dst: &mut [u8]) {
    let len = dst.len();
    let head = src.align_offset(8).min(len);
    let words = (len - head) / 8;
    for (i, d) in dst[..head].iter_mut().enumerate() {
        // SAFETY: in the caller's range; a byte is always aligned.
        *d = unsafe { AtomicU8::from_ptr(src.add(i) as *mut u8) }.load(Relaxed);
    }
    for w in 0..words {
        let at = head + 8 * w;
        // SAFETY: in the caller's range and 8-byte aligned (`head` aligned it). `from_ptr`
        // needs a `*mut`; nothing is written through it.
        let v = unsafe { AtomicU64::from_ptr(src.add(at) as *mut u64) }.load(Relaxed);
        dst[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    }
    for (i, d) in dst.iter_mut().enumerate().skip(head + 8 * words) {
        // SAFETY: as for the head.
        *d = unsafe { AtomicU8::from_ptr(src.add(i) as *mut u8) }.load(Relaxed);
    }
    fence(std::sync::atomic::Ordering::Acquire);
}

/// Fences (release), then copies `src` to `dst`.
///
/// # Safety
/// `dst..dst + src.len()` is valid for writes for the whole call, does not overlap `src`, and
/// every other access to it during the call is atomic (or by hardware outside the program).
pub(crate) unsafe fn store(dst: *mut u8, src: &[u8]) {
    fence(std::sync::atomic::Ordering::Release);
    let len = src.len();
    let head = dst.align_offset(8).min(len);
    let words = (len - head) / 8;
    for (i, s) in src[..head].iter().enumerate() {
        // SAFETY: in the caller's range; a byte is always aligned.
        unsafe { AtomicU8::from_ptr(dst.add(i)) }.store(*s, Relaxed);
    }
    for w in 0..words {
        let at = head + 8 * w;
        let mut b = [0u8; 8];
        b.copy_from_slice(&src[at..at + 8]);
        // SAFETY: in the caller's range and 8-byte aligned.
        unsafe { AtomicU64::from_ptr(dst.add(at) as *mut u64) }.store(u64::from_ne_bytes(b), Relaxed);
    }
    for (i, s) in src.iter().enumerate().skip(head + 8 * words) {
        // SAFETY: as for the head.
        unsafe { AtomicU8::from_ptr(dst.add(i)) }.store(*s, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length and both alignments of each side: the bytes arrive unchanged, and nothing
    /// outside the range is touched.
    #[test]
    fn copies_every_length_at_every_alignment() {
        let src: Vec<u8> = (0..80u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        for off in 0..8 {
            for len in 0..40 {
                let mut out = vec![0xeeu8; len + 2];
                // SAFETY: `src[off..off + len]` is in bounds and nothing else touches it.
                unsafe { load(src.as_ptr().add(off), &mut out[1..=len]) };
                assert_eq!(&out[1..=len], &src[off..off + len], "load at {off}, {len} bytes");
                assert_eq!((out[0], out[len + 1]), (0xee, 0xee));
                let mut mem = vec![0xeeu8; 64];
                // SAFETY: `mem[off + 1..off + 1 + len]` is in bounds, apart from `src`.
                unsafe { store(mem.as_mut_ptr().add(off + 1), &src[..len]) };
                assert_eq!(&mem[off + 1..off + 1 + len], &src[..len], "store at {off}, {len} bytes");
                assert!(mem[..off + 1].iter().chain(&mem[off + 1 + len..]).all(|&b| b == 0xee));
            }
        }
    }

    /// A copy out racing a copy in on the same bytes (what `MemoryRegion::read` does while the
    /// HCA writes) is defined behaviour: Miri, which reports any data race, runs it
    /// (`tools/test.sh` runs this module under Miri). Natively it checks that aligned words are
    /// never torn.
    #[test]
    fn a_copy_racing_a_copy_on_the_same_bytes_is_defined() {
        const WORDS: usize = 8;
        let mem: std::sync::Arc<[AtomicU64]> = (0..WORDS).map(|_| AtomicU64::new(0)).collect();
        let rounds = if cfg!(miri) { 20 } else { 20_000 };
        let theirs = mem.clone();
        let writer = std::thread::spawn(move || {
            for r in 0..rounds {
                let fill = [if r % 2 == 0 { 0xffu8 } else { 0 }; WORDS * 8];
                // SAFETY: the words live while `theirs` does; the reader only loads atomically.
                unsafe { store(theirs.as_ptr() as *mut u8, &fill) };
            }
        });
        let mut seen = [0u8; WORDS * 8];
        for _ in 0..rounds {
            // SAFETY: as above; the writer only stores atomically.
            unsafe { load(mem.as_ptr() as *const u8, &mut seen) };
            for w in seen.chunks(8) {
                assert!(w.iter().all(|&b| b == w[0]), "a torn word: {w:?}");
            }
        }
        writer.join().unwrap();
    }
}
