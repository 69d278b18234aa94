//! The data path's C ABI (`gdaki_device::ffi`, what `gdaki_device.h` declares) on the soft HCA
//! in CPU mode: thread scope, every sharing mode, called as C code would call it. Every
//! operation moves the data it should; every refusal names itself and posts nothing.
mod common;

use std::ptr::{null, null_mut};
use std::time::Duration;

use common::{loopback_qp, pattern};
use gdaki::{Access, Context, MemoryRegion, Provider, QpConfig, QueuePair};
use gdaki_device::ffi::{thread_cta, thread_exclusive as c, thread_gpu, POST_DEFER, POST_FENCE};
use gdaki_device::status::*;
use gdaki_device::Exclusive;
use gdaki_layout::{DevQp, Syndrome};

struct Setup {
    _ctx: Context,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn setup(timeout: Duration) -> Setup {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = loopback_qp(
        &ctx,
        64,
        QpConfig {
            timeout,
            ..QpConfig::default()
        },
    );
    let mr = ctx.alloc_region(1 << 16, Access::ALL).unwrap();
    Setup { _ctx: ctx, qp, mr }
}

impl Setup {
    /// The exported handle, as a C caller holds it.
    fn handle(&self) -> *mut DevQp {
        // SAFETY: used by this thread only, in one mode at a time.
        unsafe { self.qp.cpu::<Exclusive>() }.unwrap().as_ptr()
    }
    fn reserved(&self) -> u64 {
        // SAFETY: the live handle; no poster runs concurrently.
        unsafe { (*self.handle()).sq_reserved }
    }
    fn bytes(&self, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mr.read(at, &mut v).unwrap();
        v
    }
    fn word(&self, at: u64) -> u64 {
        u64::from_le_bytes(self.bytes(at, 8).try_into().unwrap())
    }
}

#[test]
fn every_operation_moves_its_data() {
    let s = setup(Duration::from_secs(5));
    let (qp, a, k) = (s.handle(), s.mr.addr(), s.mr.rkey());
    let lk = s.mr.lkey();
    let data = pattern(7, 3000);
    s.mr.write(0, &data).unwrap();
    let mut t = u64::MAX;
    unsafe {
        // put, then get it back through a fenced get.
        assert_eq!(c::put(qp, a + 4096, k, a, lk, 3000, 0, &mut t), CODE_OK);
        assert_ne!(t, u64::MAX, "the ticket is written");
        assert_eq!(c::wait(qp, t), CODE_OK);
        assert_eq!(c::get(qp, a + 8192, lk, a + 4096, k, 3000, POST_FENCE, &mut t), CODE_OK);
        assert_eq!(c::wait(qp, t), CODE_OK);
    }
    assert_eq!(s.bytes(4096, 3000), data, "put");
    assert_eq!(s.bytes(8192, 3000), data, "get");
    unsafe {
        // inline, deferred until the commit; a null ticket is allowed.
        let msg = b"inline through C";
        let len = msg.len() as u32;
        assert_eq!(
            c::put_inline(qp, a + 12000, k, msg.as_ptr(), len, POST_DEFER, null_mut()),
            CODE_OK
        );
        assert_eq!(c::commit(qp), CODE_OK);
        assert_eq!(c::quiet(qp), CODE_OK);
        assert_eq!(s.bytes(12000, msg.len()), msg);
        // put_signal and signal, observed by wait_signal.
        let sig = (a + 16000) as *const u64;
        assert_eq!(
            c::put_signal(qp, a + 13000, k, a, lk, 100, a + 16000, k, 2, a + 16008, lk, 0, &mut t),
            CODE_OK
        );
        assert_eq!(c::signal(qp, a + 16000, k, 3, a + 16008, lk, 0, null_mut()), CODE_OK);
        assert_eq!(thread_cta::wait_signal(qp, sig, 5), CODE_OK);
        assert_eq!(s.bytes(13000, 100), data[..100]);
        // atomics, in the other modes too.
        let mut old = 0;
        assert_eq!(
            thread_gpu::atomic_fetch_add(qp, a + 16000, k, 10, a + 16016, lk, 0, &mut old),
            CODE_OK
        );
        assert_eq!(old, 5);
        assert_eq!(
            c::atomic_compare_swap(qp, a + 16000, k, 15, 99, a + 16016, lk, 0, &mut old),
            CODE_OK
        );
        assert_eq!(old, 15);
        assert_eq!(c::quiet(qp), CODE_OK);
    }
    assert_eq!(s.word(16000), 99);
}

#[test]
fn refusals_name_themselves_and_post_nothing() {
    let s = setup(Duration::from_millis(300));
    let (qp, a, k, lk) = (s.handle(), s.mr.addr(), s.mr.rkey(), s.mr.lkey());
    let before = s.reserved();
    let mut t = 0;
    unsafe {
        assert_eq!(c::put(null_mut(), a, k, a, lk, 8, 0, &mut t), CODE_BAD_HANDLE);
        assert_eq!(c::quiet(null_mut()), CODE_BAD_HANDLE);
        // A handle of another layout version (or memory that is no handle).
        let mut stale: DevQp = *qp;
        stale.version ^= 1;
        assert_eq!(c::put(&mut stale, a, k, a, lk, 8, 0, &mut t), CODE_BAD_HANDLE);
        assert_eq!(
            c::put(qp, a, k, a, lk, 8, 1 << 7, &mut t),
            CODE_BAD_ARGUMENT,
            "unknown flag"
        );
        assert_eq!(
            c::put_inline(qp, a, k, null(), 4, 0, &mut t),
            CODE_BAD_ARGUMENT,
            "null data"
        );
        let long = [0u8; 64];
        assert_eq!(
            c::put_inline(qp, a, k, long.as_ptr(), 29, 0, &mut t),
            CODE_INLINE_TOO_LONG
        );
        assert_eq!(c::signal(qp, a + 3, k, 1, a + 64, lk, 0, &mut t), CODE_MISALIGNED);
        assert_eq!(c::wait_signal(qp, null(), 1), CODE_BAD_ARGUMENT);
        let odd = (a + 3) as *const u64;
        assert_eq!(c::wait_signal(qp, odd, 1), CODE_BAD_ARGUMENT, "misaligned signal");
    }
    assert_eq!(s.reserved(), before, "no refusal reserved a slot");
    unsafe {
        // CPU mode: a region's address is its host address.
        // A signal that never comes times out within the QP's bound.
        let sig = (a + 128) as *const u64;
        assert_eq!(c::wait_signal(qp, sig, 1), CODE_FLAG_TIMEOUT);
        // An empty inline put is a valid write of nothing.
        assert_eq!(c::put_inline(qp, a, k, null(), 0, 0, &mut t), CODE_OK);
        assert_eq!(c::wait(qp, t), CODE_OK);
        // A bad rkey reaches the HCA and comes back as its error CQE.
        assert_eq!(c::put(qp, a, k ^ 0x5a5a, a, lk, 8, 0, &mut t), CODE_OK);
        assert_eq!(c::wait(qp, t), CODE_CQE_ERROR | Syndrome::RemoteAccess.raw() as u32);
    }
}
