//! Host memory the library owns (rings, records, doorbell pages, regions): page-aligned and
//! zeroed, so a GPU can map it (page-locked, [`HostMapping`](crate::HostMapping)) without
//! sharing a page with another allocation.
use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Host memory could not be allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot allocate {bytes} bytes for {what}")]
pub struct AllocError {
    /// What the memory was for.
    pub what: &'static str,
    /// Size asked for.
    pub bytes: usize,
}

/// A zeroed, page-aligned host allocation the library owns. Its memory is shared with engine
/// threads and posters, which access it through raw pointers and atomics only.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    size: usize,
    /// Kept for its drop: the heap block or the mapping behind `ptr`.
    _backing: Backing,
}

/// Where a [`HostBuffer`]'s bytes come from (held for its drop, never read).
#[allow(dead_code)]
enum Backing {
    /// A small buffer: a heap block, zeroed when allocated.
    Heap(HeapBlock),
    /// A large one: an anonymous mapping, whose pages the kernel zeroes on first touch (a
    /// 10 GiB region costs nothing until it is used, and a size the kernel cannot commit is
    /// an error, not an abort).
    Mapped(memmap2::MmapMut),
}

/// A block of the global allocator, freed on drop.
struct HeapBlock(NonNull<u8>, Layout);

impl Drop for HeapBlock {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `HostBuffer::new`, freed only here.
        unsafe { alloc::dealloc(self.0.as_ptr(), self.1) }
    }
}

/// From this size on, buffers are mapped rather than allocated (rings and small regions stay
/// on the heap: a mapping each would use up the process's mapping count).
const MAP_FROM: usize = 1 << 20;

// SAFETY: the buffer is plain memory; every access goes through raw pointers whose users
// synchronise (atomics, doorbells), as with DMA memory.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes (at least one), aligned to 4096 and rounded up to whole
    /// pages, so a buffer can be mapped into a GPU (page-locked) without sharing a page with
    /// another allocation.
    pub fn new(what: &'static str, len: usize) -> Result<HostBuffer, AllocError> {
        let size = len
            .max(1)
            .checked_next_multiple_of(4096)
            .ok_or(AllocError { what, bytes: len })?;
        if size >= MAP_FROM {
            let mut map = memmap2::MmapOptions::new()
                .len(size)
                .map_anon()
                .map_err(|_| AllocError { what, bytes: len })?;
            let ptr = NonNull::new(map.as_mut_ptr()).ok_or(AllocError { what, bytes: len })?;
            return Ok(HostBuffer {
                ptr,
                size,
                _backing: Backing::Mapped(map),
            });
        }
        let layout = Layout::from_size_align(size, 4096).map_err(|_| AllocError { what, bytes: len })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) }).ok_or(AllocError { what, bytes: len })?;
        Ok(HostBuffer {
            ptr,
            size,
            _backing: Backing::Heap(HeapBlock(ptr, layout)),
        })
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Its address as the HCA and posters see it.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Its size in bytes (whole pages).
    pub fn size(&self) -> usize {
        self.size
    }
}
