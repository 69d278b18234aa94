//! Helpers the example tests share.

/// A TCP port nothing listens on right now, below Linux's ephemeral range (32768 and up): a
/// port the kernel hands out for port 0 could be given, between this call and the program
/// that binds it, to a listener the tests make meanwhile (the soft HCA's transport binds port
/// 0), and a client would reach that one instead (seen in CI as a reset handshake). Ports are
/// tried from a place that differs per process and call, so concurrent tests rarely meet.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    let start = std::process::id().wrapping_mul(7919) ^ std::time::UNIX_EPOCH.elapsed().map_or(0, |d| d.subsec_nanos());
    for i in 0..SPAN {
        let port = (LOW + (start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)).wrapping_add(i)) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
        {
            return port;
        }
    }
    panic!("no free TCP port in {LOW}..{}", LOW + SPAN);
}
