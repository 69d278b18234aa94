//! Small helpers the library and both devices share.

/// Locks a mutex, taking it over if a thread panicked while holding it (the data it guards
/// stays consistent at every unlock point).
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A non-zero 64-bit secret from the OS generator, or `None` where it fails (a secret must not
/// fall back to something guessable as [`random_u32`] does).
pub fn random_secret() -> Option<u64> {
    loop {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).ok()?;
        match u64::from_ne_bytes(b) {
            0 => continue,
            s => return Some(s),
        }
    }
}

/// 32 random bits from the OS.
pub fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // The OS generator only fails on exotic platforms; fall back to a clock-derived value there
    // rather than refusing to register memory.
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0x9e37_79b9);
        b = t.rotate_left(13).wrapping_mul(0x9e37_79b9).to_ne_bytes();
    }
    u32::from_ne_bytes(b)
}
