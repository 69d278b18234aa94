//! Helpers shared by the host library's integration tests.
#![allow(dead_code)] // each test crate uses a different subset

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::thread::JoinHandle;

use gdaki::{Context, MemoryRegion, QpConfig, QueuePair};

/// A queue pair of `sq` WQEs with a CQ of its own (which the QP keeps alive).
pub fn qp(ctx: &Context, sq: u32, cfg: QpConfig) -> QueuePair {
    let cq = ctx.create_cq(sq).unwrap();
    ctx.create_qp(&cq, QpConfig { sq_size: sq, ..cfg }).unwrap()
}

/// [`qp`], connected to itself.
pub fn loopback_qp(ctx: &Context, sq: u32, cfg: QpConfig) -> QueuePair {
    let qp = qp(ctx, sq, cfg);
    qp.connect(&qp.endpoint()).unwrap();
    qp
}

/// `len` pseudo-random bytes from `seed` (xorshift), so every test's data is distinct.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Reads a library-owned region into a new vector.
pub trait ReadVec {
    /// `len` bytes at `offset`.
    fn read_vec(&self, offset: u64, len: usize) -> gdaki::Result<Vec<u8>>;
}

impl ReadVec for MemoryRegion {
    fn read_vec(&self, offset: u64, len: usize) -> gdaki::Result<Vec<u8>> {
        let mut v = vec![0; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }
}

/// A soft-HCA "responder" that accepts one transport connection and then never answers (a
/// host that vanished without closing anything). It swallows requests until the requester
/// closes; join the handle after dropping the QP.
pub fn silent_peer() -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let handle = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut connect = [0u8; gdaki::wire::HEADER_LEN + 20];
        s.read_exact(&mut connect).unwrap();
        let target = u32::from_be_bytes(connect[gdaki::wire::HEADER_LEN + 12..][..4].try_into().unwrap());
        s.write_all(&gdaki::wire::encode_accept(target)).unwrap();
        let mut sink = [0u8; 4096];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    (addr, handle)
}
