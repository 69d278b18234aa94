//! Who rings a queue pair's doorbell once a GPU posts on it: the doorbell page mapped into the
//! GPU, or, where that mapping fails (some platforms cannot map a NIC's UAR into a GPU:
//! `cuMemHostRegister` with the IO-memory flag fails), the library's own CPU proxy, chosen
//! automatically when the queue pair is exported and said once through tracing.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use gdaki_proxy::{Proxy, ProxyConfig, Target, TargetId};
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::lock;
use gdaki_cuda::{CudaError, Gpu, HostMapping};
use gdaki_devx::Uar;

/// Why a doorbell page is not mapped into a GPU.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unmappable {
    /// The context models a platform that cannot map it ([`ContextOptions::unmappable_doorbell`](crate::context::ContextOptions::unmappable_doorbell)).
    #[error("the context models a platform whose doorbell page cannot be mapped into a GPU")]
    Modelled,
    /// The driver refused the mapping.
    #[error("{source}{}", if *.nic { NIC_HINT } else { "" })]
    Driver {
        /// The driver's error.
        source: CudaError,
        /// The page was a NIC's registers (mapped as IO memory).
        nic: bool,
    },
}

/// What a refused mapping of a NIC's page says: the driver allows peer mappings only with this
/// option (or for root).
const NIC_HINT: &str =
    " (mapping a NIC's doorbell page into a GPU needs the NVIDIA driver option NVreg_RegistryDwords=\"PeerMappingOverride=1;\", or root)";

/// Maps a queue pair's doorbell page into `gpu` (as IO memory when it is a NIC's registers),
/// unless the context models a platform that cannot.
///
/// # Safety
/// As [`HostMapping::new`] (or [`HostMapping::io`] for a NIC's page): the page is mapped,
/// page-aligned whole pages, mapped by no other `HostMapping`, and stays mapped until the
/// mapping is dropped.
pub(crate) unsafe fn map_page(gpu: &Gpu, page: &Uar, unmappable: bool) -> Result<HostMapping, Unmappable> {
    if unmappable {
        return Err(Unmappable::Modelled);
    }
    let base = page.base as *mut u8;
    // SAFETY: the caller's contract is HostMapping's.
    unsafe {
        if page.io {
            HostMapping::io(gpu, base, page.size)
        } else {
            HostMapping::new(gpu, base, page.size)
        }
    }
    .map_err(|source| Unmappable::Driver { source, nic: page.io })
}

/// Says (once per process, at warn level; debug afterwards) that queue pair `qpn` rings through
/// the library's proxy because its doorbell page could not be mapped.
pub(crate) fn say_fallback(qpn: u32, why: &Unmappable) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        warn!(
            qpn = format_args!("{qpn:#x}"),
            %why,
            "the doorbell page cannot be mapped into the GPU: queue pairs exported with the GPU doorbell \
             handler fall back to the library's CPU proxy thread (said once; DoorbellHandler::CpuProxy \
             with your own proxy gives you control over its threads)"
        );
    } else {
        debug!(qpn = format_args!("{qpn:#x}"), %why, "doorbell fallback to the CPU proxy");
    }
}

/// The process-wide proxy that rings for queue pairs that fell back: started with the first of
/// them, stopped (after ringing everything published) when the last one goes.
static SHARED: Mutex<Weak<Proxy>> = Mutex::new(Weak::new());

/// Whether the shared fallback proxy runs (for tests).
#[cfg(test)]
pub(crate) fn shared_proxy_runs() -> bool {
    lock(&SHARED).strong_count() > 0
}

/// A queue pair's place in the shared fallback proxy; dropping it stops the ringing (after a
/// last ring of what was published).
pub(crate) struct AutoProxy {
    proxy: Arc<Proxy>,
    id: TargetId,
}

impl AutoProxy {
    /// Has the shared proxy ring for `target`, starting it if none runs.
    pub(crate) fn ring_for(target: Target) -> Result<AutoProxy> {
        let proxy = {
            let mut shared = lock(&SHARED);
            match shared.upgrade() {
                Some(p) => p,
                None => {
                    let p = Arc::new(Proxy::start(ProxyConfig::default()).map_err(Error::Proxy)?);
                    *shared = Arc::downgrade(&p);
                    debug!("fallback CPU proxy started");
                    p
                }
            }
        };
        let id = proxy.add(target);
        Ok(AutoProxy { proxy, id })
    }

    /// The shared proxy's counters (all queue pairs it rings for).
    pub(crate) fn counters(&self) -> gdaki_proxy::ProxyCounters {
        self.proxy.counters()
    }
}

impl Drop for AutoProxy {
    fn drop(&mut self) {
        self.proxy.remove(self.id);
    }
}
