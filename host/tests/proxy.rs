//! The CPU proxy with the soft HCA, in CPU mode: queue pairs created with the CPU-proxy handler
//! are posted to by several threads each (publishing their producer index, as GPU kernels
//! would), and proxy threads ring for them. Data is verified; targets move between proxies and
//! proxy threads are added and removed while posting goes on; stopping a proxy rings
//! everything published; a queue pair in error does not hold up the others.
mod common;
use common::{pattern, ReadVec};

use gdaki::{Access, Context, DoorbellHandler, Provider, QpConfig, QueuePair};
use gdaki_device::Gpu;
use gdaki_proxy::{Proxy, ProxyConfig};

const MSG: u64 = 64;

fn proxied_qp(ctx: &Context) -> QueuePair {
    let cfg = QpConfig {
        handler: DoorbellHandler::CpuProxy,
        ..Default::default()
    };
    common::loopback_qp(ctx, 256, cfg)
}

#[test]
fn many_posters_on_many_qps_through_proxies_that_come_and_go() {
    const QPS: usize = 6;
    const POSTERS: usize = 3; // per QP
    const ITERS: u64 = 300;
    let ctx = Context::open(Provider::Soft).unwrap();
    let qps: Vec<_> = (0..QPS).map(|_| proxied_qp(&ctx)).collect();
    assert!(qps.iter().all(|q| q.handler() == DoorbellHandler::CpuProxy));
    let len = (QPS * POSTERS) as u64 * MSG;
    let src = ctx.alloc_region(len as usize, Access::ALL).unwrap();
    let dst = ctx.alloc_region(len as usize, Access::ALL).unwrap();
    let data = pattern(3, len as usize);
    src.write(0, &data).unwrap();
    let first = Proxy::start(ProxyConfig {
        threads: 2,
        ..Default::default()
    })
    .unwrap();
    let ids: Vec<_> = qps.iter().map(|q| first.add(q.proxy_target().unwrap())).collect();
    let second = Proxy::start(ProxyConfig::default()).unwrap();
    std::thread::scope(|s| {
        for (qi, qp) in qps.iter().enumerate() {
            for p in 0..POSTERS {
                let (src, dst) = (&src, &dst);
                s.spawn(move || {
                    // SAFETY: every poster of this QP uses the GPU sharing mode; the QP outlives them.
                    let dev = unsafe { qp.cpu::<Gpu>() }.unwrap();
                    let off = ((qi * POSTERS + p) as u64) * MSG;
                    let mut last = None;
                    for _ in 0..ITERS {
                        last = Some(dev.put(dst.remote(off), src.local(off), MSG).unwrap());
                    }
                    dev.wait(last.unwrap()).unwrap();
                });
            }
        }
        // Meanwhile, half the QPs move to the second proxy, which gains a thread, and the
        // first proxy loses one of its two.
        std::thread::sleep(std::time::Duration::from_millis(5));
        for (i, id) in ids.iter().enumerate().take(QPS / 2) {
            assert!(first.remove(*id));
            second.add(qps[i].proxy_target().unwrap());
        }
        assert_eq!(second.add_thread().unwrap(), 2);
        assert_eq!(first.remove_thread().unwrap(), 1);
    });
    assert_eq!(dst.read_vec(0, len as usize).unwrap(), data);
    let (a, b) = (first.stop(), second.stop());
    assert!(a.doorbells + b.doorbells > 0);
    assert_eq!((a.targets, b.targets), ((QPS - QPS / 2) as u64, (QPS / 2) as u64));
    for q in &qps {
        assert_eq!(q.error(), None);
    }
}

#[test]
fn stopping_the_proxy_rings_everything_published() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = proxied_qp(&ctx);
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    // A proxy that sleeps as soon as it is idle: the posts below land while it may sleep.
    let proxy = Proxy::start(ProxyConfig {
        threads: 1,
        idle: gdaki_proxy::IdlePolicy {
            spin_rounds: 0,
            yield_rounds: 0,
            max_sleep: std::time::Duration::from_millis(50),
        },
    })
    .unwrap();
    proxy.add(qp.proxy_target().unwrap());
    std::thread::sleep(std::time::Duration::from_millis(20));
    // SAFETY: one poster; the QP outlives it.
    let dev = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
    let mut last = 0;
    for i in 0..100u64 {
        last = dev.put(mr.remote(i * 8), mr.local(2048 + i * 8), 8).unwrap();
    }
    let counters = proxy.stop();
    // Everything was rung before stop returned: the completions come without any proxy.
    dev.wait(last).unwrap();
    assert!(counters.doorbells >= 1, "{counters:?}");
}

#[test]
fn a_qp_in_error_does_not_hold_up_the_others() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let (bad, good) = (proxied_qp(&ctx), proxied_qp(&ctx));
    let mr = ctx.alloc_region(4096, Access::ALL).unwrap();
    let proxy = Proxy::start(ProxyConfig::default()).unwrap();
    proxy.add(bad.proxy_target().unwrap());
    proxy.add(good.proxy_target().unwrap());
    // SAFETY: one poster per QP; the QPs outlive them.
    let (b, g) = unsafe {
        (
            bad.cpu::<gdaki_device::Exclusive>().unwrap(),
            good.cpu::<gdaki_device::Exclusive>().unwrap(),
        )
    };
    // A bad rkey: the QP goes to error, its later WQEs flush.
    let wrong = gdaki_device::Remote { addr: 0, rkey: 0xdead };
    let t = b.put(wrong, mr.local(0), 8).unwrap();
    assert!(b.wait(t).is_err());
    let t = b.put(mr.remote(0), mr.local(8), 8).unwrap();
    assert!(b.wait(t).is_err(), "flushed");
    for i in 0..50u64 {
        let t = g.put(mr.remote(64 + i * 8), mr.local(1024), 8).unwrap();
        g.wait(t).unwrap();
    }
    assert!(bad.error().is_some());
    assert_eq!(good.error(), None);
    proxy.stop();
}

#[test]
fn only_proxy_qps_have_a_proxy_target() {
    let ctx = Context::open(Provider::Soft).unwrap();
    let qp = common::qp(&ctx, 16, QpConfig::default());
    assert_eq!(qp.handler(), DoorbellHandler::Gpu);
    assert!(qp.proxy_target().is_none());
}
