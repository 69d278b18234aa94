//! GPU memory between two processes of one machine: a WRITE from device memory to a peer
//! connected over shared memory (see [`shm`](super::shm)) sends a reference to the bytes, not
//! the bytes, and the peer's copier moves them inside the GPU (CUDA IPC); a READ into device
//! memory sends a reference to where its bytes go, and the peer's copier puts them there.
//!
//! - **Offer.** The first WRITE from an allocation goes as bytes, preceded by a
//!   [`GpuOffer`]: the allocation's IPC handle, numbered in order on the connection. The
//!   responder maps it when it can (a live copier on that GPU, the driver accepts the handle,
//!   CUDA IPC on at both ends) and says so in a [`GpuAnswer`], in order with its responses.
//!   From the answer on, WRITEs from that allocation are [`Op::WriteRef`]s and READs into it
//!   [`Op::ReadRef`]s; while it is outstanding, or after a refusal, they stay bytes (a READ
//!   into an allocation not yet offered offers it too). Nothing waits for an answer.
//! - **The same semantics.** A reference is executed as the bytes would be: checked against
//!   the target's rkey, bounds and rights, then copied by the responder's copier (inside the
//!   GPU, or into host memory that GPU maps; through the bounce buffer otherwise). A READ
//!   reference is checked against the source's rkey, bounds and read right, and answered by
//!   an acknowledgement once its bytes are in the requester's memory, so its completion means
//!   what a READ's does. Every response, and every request the CPU executes, waits for the
//!   copies before it, so acknowledged data has landed and a put's signal lands after the
//!   put; copies of one kind run together, and one of the other kind waits for them (a READ
//!   sees the WRITEs before it, a WRITE does not overtake the READs before it: `Way`).
//! - **Untrusted peer.** Offers are taken over shared memory only, which only a process of the
//!   same user reaches (see [`shm`](super::shm)): an IPC handle opens any allocation of any
//!   process that exported it, so it is no more trusted than that user. A reference names an
//!   allocation the responder mapped, within the mapping's own size (the driver's record, not
//!   the offer's); anything else is a protocol violation that ends the connection. The
//!   mappings are closed when the connection ends.
//! - **Across GPUs.** The responder maps an allocation with a copier on its GPU, else with one
//!   whose GPU reaches it over P2P ([`choose`]): that copier then moves the bytes GPU to GPU.
//! - **Limits.** Legacy IPC only: memory made with `cuMemCreate`, or on a GPU none of the
//!   responder's copiers reaches, is sent as bytes. A READ with more than one local buffer carries
//!   bytes. The responder writes a READ's bytes into the requester's memory, so a requester
//!   must not free a READ's buffer before it completes (as with any RDMA READ); one that
//!   completes with a transport error may still be written by a copy the responder had
//!   started, until the responder sees the connection end.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tracing::debug;

use crate::copier::{Copier, Pending};
use crate::dma::DeviceDma;
use crate::dma::DmaFault;
use gdaki_cuda::{GpuUuid, IpcExport, IpcImport, IPC_HANDLE_BYTES};
use gdaki_devx::util::lock;
#[cfg(doc)]
use gdaki_devx::wire::Op;
use gdaki_devx::wire::{GpuAnswer, GpuOffer};

/// Allocations one connection may offer: a peer cannot make a responder hold more mappings.
pub(crate) const MAX_OFFERS: u32 = 1024;

/// Whether this process said that an offered allocation's GPU cannot be reached.
static NO_PATH_SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How a copier reaches an offered allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// It is on the copier's own GPU: copies stay inside that GPU.
    SameGpu,
    /// It is on another GPU the copier's GPU reaches through a P2P mapping (NVLink or PCIe):
    /// the copier's kernel reads and writes it there, GPU to GPU, never through host memory.
    Peer,
}

/// The copier that maps an allocation of GPU `offered`: one on that GPU, else the first whose
/// GPU reaches it (`reaches`); `None` leaves the bytes path. The rule is the same for WRITE
/// references (the copier pulls the requester's bytes) and READ references (it pushes them).
pub(crate) fn choose<'c, C>(
    offered: &GpuUuid,
    copiers: &'c [C],
    gpu: impl Fn(&C) -> GpuUuid,
    reaches: impl Fn(&C) -> bool,
) -> Option<(&'c C, Path)> {
    if let Some(c) = copiers.iter().find(|c| gpu(c) == *offered) {
        return Some((c, Path::SameGpu));
    }
    copiers.iter().find(|c| reaches(c)).map(|c| (c, Path::Peer))
}

/// The requester's side on one connection: what it offered. The peer's answers, by offer id
/// (`None` while outstanding), are [`Answers`], which the receiver thread fills.
#[derive(Default)]
pub(crate) struct Exports {
    /// Offered allocations, by IPC handle (a new allocation at a freed one's address has
    /// another handle).
    ids: HashMap<[u8; IPC_HANDLE_BYTES], u32>,
}

/// The peer's answers to a connection's offers, by offer id: `None` while outstanding.
pub(crate) type Answers = Mutex<Vec<Option<bool>>>;

/// Where a WRITE's data is (or a READ's goes) for the peer: `len` bytes in allocation `alloc`
/// (accepted) at `offset`, as the wire names it.
pub(crate) use gdaki_devx::wire::Reference;

/// What [`Exports::reference`] decided.
pub(crate) enum Choice {
    /// Send this reference.
    Reference(Reference),
    /// Send the bytes, after this offer frame.
    OfferThenBytes(Vec<u8>),
    /// Send the bytes.
    Bytes,
}

impl Exports {
    /// How `len` bytes at `addr` in memory of allocation `export` go to the peer, given its
    /// `answers` so far.
    pub fn reference(&mut self, answers: &Answers, export: &IpcExport, addr: u64, len: u32) -> Choice {
        let inside = addr >= export.base
            && addr
                .checked_add(len as u64)
                .is_some_and(|e| e <= export.base + export.size);
        if !inside {
            return Choice::Bytes;
        }
        if let Some(&id) = self.ids.get(&export.handle) {
            return match lock(answers).get(id as usize) {
                Some(Some(true)) => Choice::Reference(Reference {
                    alloc: id,
                    offset: addr - export.base,
                    len,
                }),
                _ => Choice::Bytes,
            };
        }
        let id = self.ids.len() as u32;
        if id >= MAX_OFFERS {
            return Choice::Bytes;
        }
        self.ids.insert(export.handle, id);
        lock(answers).push(None);
        Choice::OfferThenBytes(
            GpuOffer {
                id,
                size: export.size,
                gpu: export.gpu,
                handle: export.handle,
            }
            .encode(),
        )
    }
}

/// Records the peer's answer `a` (receiver thread): an answer to nothing offered, or a second
/// answer, is a protocol violation.
pub(crate) fn answered(answers: &Answers, a: GpuAnswer) -> Result<(), String> {
    let mut all = lock(answers);
    match all.get_mut(a.id as usize) {
        Some(slot @ None) => {
            *slot = Some(a.mapped);
            Ok(())
        }
        Some(Some(_)) => Err(format!("a second answer to GPU allocation offer {}", a.id)),
        None => Err(format!("an answer to GPU allocation offer {}, never made", a.id)),
    }
}

/// One allocation of the peer's, mapped here.
pub(crate) struct Import {
    /// Moves its bytes (declared first: dropped before the mapping closes).
    pub dma: DeviceDma,
    mem: IpcImport,
}

impl Import {
    /// Where `offset..offset + len` of the allocation is in this process, if inside it.
    pub fn at(&self, offset: u64, len: u64) -> Option<u64> {
        (offset.checked_add(len)? <= self.mem.size()).then(|| self.mem.ptr() + offset)
    }
}

/// The responder's side on one connection: the peer's allocations it mapped, and the copies
/// from them not yet known done. Dropping it waits for those copies and closes the mappings
/// (off the HCA's threads, see [`Keep`](super::Keep)).
#[derive(Default)]
pub(crate) struct Imports {
    maps: Vec<Option<Arc<Import>>>,
    pending: Pending,
}

impl Imports {
    /// Answers offer `o` (`allowed`: this side takes CUDA IPC references at all), mapping the
    /// allocation when it can. An offer out of order, or past [`MAX_OFFERS`], is a protocol
    /// violation.
    pub fn offer(&mut self, o: &GpuOffer, allowed: bool) -> Result<GpuAnswer, String> {
        if o.id as usize != self.maps.len() {
            return Err(format!(
                "GPU allocation offer {} where {} was due",
                o.id,
                self.maps.len()
            ));
        }
        if o.id >= MAX_OFFERS {
            // A requester offers at most this many: more would grow this table without end.
            return Err(format!("GPU allocation offer {}: at most {MAX_OFFERS} are made", o.id));
        }
        let map = if allowed { Self::open(o) } else { None };
        let mapped = map.is_some();
        self.maps.push(map.map(Arc::new));
        Ok(GpuAnswer { id: o.id, mapped })
    }

    fn open(o: &GpuOffer) -> Option<Import> {
        let live = Copier::live();
        let reaches = |c: &Arc<Copier>| gdaki_cuda::gpu_reaches(c.context(), &o.gpu);
        let Some((copier, path)) = choose(&o.gpu, &live, |c| *c.gpu(), reaches) else {
            if live.is_empty() {
                debug!(offer = o.id, "no GPU copier in this process: its WRITEs stay bytes");
            } else if !NO_PATH_SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                // Said once a process: every offer from that GPU would say it again.
                tracing::warn!(
                    offer = o.id,
                    "a peer's GPU memory is on a GPU this process's GPUs cannot reach (no P2P path, or \
                     it is not visible here): data to and from it travels as bytes through host memory"
                );
            }
            return None;
        };
        let copier = copier.clone();
        debug!(offer = o.id, ?path, "GPU allocation mapped for this process's copier");
        match IpcImport::open(copier.context(), &o.handle) {
            Ok(mem) => Some(Import {
                dma: DeviceDma::imported(copier),
                mem,
            }),
            Err(e) => {
                debug!(offer = o.id, "GPU allocation not mapped ({e}): its WRITEs stay bytes");
                None
            }
        }
    }

    /// The mapped allocation `alloc`: one that was never offered or not mapped is a protocol
    /// violation.
    pub fn get(&self, alloc: u32) -> Result<Arc<Import>, String> {
        match self.maps.get(alloc as usize) {
            Some(Some(m)) => Ok(m.clone()),
            Some(None) => Err(format!("a reference to GPU allocation {alloc}, which was not mapped")),
            None => Err(format!("a reference to GPU allocation {alloc}, never offered")),
        }
    }

    /// The copies from mapped allocations submitted and not yet waited for (a copy of a WRITE
    /// reference reads the peer's allocation, one of a READ reference writes it).
    pub fn pending(&mut self) -> &mut Pending {
        &mut self.pending
    }

    /// Waits until every copy submitted so far is done (before anything that must come after
    /// them: a response, a request the CPU executes).
    pub fn settle(&mut self) -> Result<(), DmaFault> {
        self.pending.settle()
    }
}

impl Drop for Imports {
    fn drop(&mut self) {
        // A mapping is closed only once nothing copies from it.
        let _ = self.pending.settle();
        for m in self.maps.drain(..).flatten() {
            drop(super::Keep::new(Some(m)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(handle: u8) -> IpcExport {
        IpcExport {
            handle: [handle; IPC_HANDLE_BYTES],
            base: 0x10_0000,
            size: 0x1000,
            gpu: [1; 16],
        }
    }

    /// An allocation is offered once; its WRITEs are references only once the peer said it
    /// mapped it, and only inside it.
    #[test]
    fn the_requester_offers_once_and_refers_only_after_a_yes() {
        let mut ex = Exports::default();
        let answers = Answers::default();
        let a = export(7);
        let Choice::OfferThenBytes(frame) = ex.reference(&answers, &a, 0x10_0010, 16) else {
            panic!("the first WRITE from an allocation offers it")
        };
        let h = gdaki_devx::wire::check_frame(&frame).unwrap();
        let offer = GpuOffer::decode(&frame[gdaki_devx::wire::HEADER_LEN..]).unwrap();
        assert_eq!(
            (h.kind, offer.id, offer.size, offer.handle),
            (gdaki_devx::wire::Kind::GpuOffer, 0, 0x1000, a.handle)
        );
        assert!(
            matches!(ex.reference(&answers, &a, 0x10_0010, 16), Choice::Bytes),
            "no answer yet"
        );
        answered(&answers, GpuAnswer { id: 0, mapped: true }).unwrap();
        assert!(matches!(
            ex.reference(&answers, &a, 0x10_0010, 16),
            Choice::Reference(Reference {
                alloc: 0,
                offset: 0x10,
                len: 16
            })
        ));
        assert!(
            matches!(ex.reference(&answers, &a, 0x10_0ff0, 17), Choice::Bytes),
            "past its end"
        );
        assert!(
            matches!(ex.reference(&answers, &a, 0xf_fff0, 16), Choice::Bytes),
            "before its start"
        );
        // Another allocation: its own offer, refused, so bytes for good.
        let b = export(9);
        assert!(matches!(
            ex.reference(&answers, &b, 0x10_0000, 8),
            Choice::OfferThenBytes(_)
        ));
        answered(&answers, GpuAnswer { id: 1, mapped: false }).unwrap();
        assert!(matches!(ex.reference(&answers, &b, 0x10_0000, 8), Choice::Bytes));
        // Answers to nothing, and second answers, break the protocol.
        assert!(answered(&answers, GpuAnswer { id: 2, mapped: true }).is_err());
        assert!(answered(&answers, GpuAnswer { id: 0, mapped: false }).is_err());
    }

    /// The responder numbers offers in order, refuses when it may not (or cannot) map, and a
    /// reference to anything it did not map is a protocol violation.
    #[test]
    fn the_responder_takes_offers_in_order_and_refuses_unmapped_references() {
        let mut im = Imports::default();
        let offer = |id| GpuOffer {
            id,
            size: 4096,
            gpu: [0xee; 16],
            handle: [3; IPC_HANDLE_BYTES],
        };
        assert!(im.offer(&offer(1), true).is_err(), "out of order");
        assert_eq!(im.offer(&offer(0), false).unwrap(), GpuAnswer { id: 0, mapped: false });
        // No copier on a GPU of that UUID (there is none here): refused, not an error.
        assert_eq!(im.offer(&offer(1), true).unwrap(), GpuAnswer { id: 1, mapped: false });
        assert!(im.get(0).is_err() && im.get(1).is_err() && im.get(2).is_err());
        // As many offers as a requester makes, refused here; one more breaks the protocol.
        for id in 2..MAX_OFFERS {
            assert!(!im.offer(&offer(id), false).unwrap().mapped);
        }
        assert!(im.offer(&offer(MAX_OFFERS), false).is_err());
        assert!(im.settle().is_ok());
    }

    /// An offered allocation goes to a copier on its own GPU first, then to one whose GPU
    /// reaches it over P2P, and to none (the bytes path) where no GPU here reaches it.
    #[test]
    fn an_offer_is_mapped_by_its_own_gpu_then_a_peer_gpu_then_none() {
        // (GPU, the GPUs it reaches)
        let copiers = [
            ([1u8; 16], vec![[2u8; 16]]),
            ([2u8; 16], vec![[1u8; 16]]),
            ([3u8; 16], vec![]),
        ];
        let pick = |offered: [u8; 16], among: &[([u8; 16], Vec<[u8; 16]>)]| {
            choose(&offered, among, |c| c.0, |c| c.1.contains(&offered)).map(|(c, p)| (c.0, p))
        };
        assert_eq!(pick([2; 16], &copiers), Some(([2; 16], Path::SameGpu)));
        assert_eq!(pick([2; 16], &copiers[..1]), Some(([1; 16], Path::Peer)));
        assert_eq!(pick([1; 16], &copiers[1..]), Some(([2; 16], Path::Peer)));
        assert_eq!(pick([4; 16], &copiers), None);
        assert_eq!(pick([1; 16], &copiers[2..]), None);
        assert_eq!(pick([1; 16], &[]), None);
    }
}
