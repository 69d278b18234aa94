//! The PRM command interface: the mailboxes a host sends to an mlx5 device (through DevX on a
//! ConnectX, through the soft device's firmware model otherwise) to create and drive CQs and QPs.
//!
//! The PRM describes each structure as big-endian 32-bit words whose bits are numbered from the
//! most significant bit of the first word: a field is a bit offset and a width ([`Bits`]), the
//! way the kernel's `mlx5_ifc.h` declares it (one `u8` per bit) and `MLX5_SET` / `DEVX_SET`
//! write it. [`layout`] names every field gdaki writes or reads, per structure; [`command`]
//! builds whole mailboxes from typed parameters and reads the answers. The golden test
//! (`tests/prm_golden.rs`) checks both against the kernel header, field by field and byte by
//! byte.
pub mod command;
pub mod layout;

pub use command::{CmdError, CmdStatus, Opcode};

/// Where a field sits in a PRM structure: `offset` bits from the start (bit 0 is the most
/// significant bit of the first byte) and `width` bits wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bits {
    /// Bit offset from the start of the structure.
    pub offset: u32,
    /// Width in bits.
    pub width: u32,
}

impl Bits {
    /// A field of `width` bits at `offset`.
    pub const fn new(offset: u32, width: u32) -> Bits {
        Bits { offset, width }
    }

    /// This field of a structure that sits at `outer` inside a bigger one (e.g. a `qpc` field
    /// inside `create_qp_in`).
    pub const fn within(self, outer: Bits) -> Bits {
        Bits::new(outer.offset + self.offset, self.width)
    }

    /// The bytes the field occupies (rounded out to whole bytes).
    pub const fn bytes(self) -> core::ops::Range<usize> {
        (self.offset / 8) as usize..(self.offset + self.width).div_ceil(8) as usize
    }
}

/// Reads the field `f` (at most 64 bits) from `buf`. Bits beyond the end of `buf` read as zero,
/// so a short (untrusted) mailbox cannot make this panic; check its length first where that
/// matters.
pub fn get(buf: &[u8], f: Bits) -> u64 {
    let mut v = 0u64;
    for i in f.offset..f.offset + f.width.min(64) {
        let bit = buf.get((i / 8) as usize).map_or(0, |b| (b >> (7 - i % 8)) & 1);
        v = (v << 1) | bit as u64;
    }
    v
}

/// Writes the low `f.width` bits of `v` into the field `f` of `buf` (at most 64 bits), as
/// `MLX5_SET` does: higher bits of `v` are dropped, neighbouring fields are kept, and bits
/// beyond the end of `buf` are not written.
pub fn set(buf: &mut [u8], f: Bits, v: u64) {
    let width = f.width.min(64);
    for i in 0..width {
        let pos = f.offset + i;
        let bit = (v >> (width - 1 - i)) & 1;
        if let Some(b) = buf.get_mut((pos / 8) as usize) {
            let mask = 1u8 << (7 - pos % 8);
            *b = if bit == 1 { *b | mask } else { *b & !mask };
        }
    }
}

/// Copies `bytes` into a byte-aligned field (`rgid_rip`, MAC halves): as many bytes as both
/// hold. Fields that are not byte-aligned are left alone.
pub fn set_bytes(buf: &mut [u8], f: Bits, bytes: &[u8]) {
    if f.offset % 8 != 0 || f.width % 8 != 0 {
        return;
    }
    let r = f.bytes();
    if let Some(dst) = buf.get_mut(r) {
        let n = dst.len().min(bytes.len());
        dst[..n].copy_from_slice(&bytes[..n]);
    }
}

/// Reads a byte-aligned field of up to 16 bytes (`rgid_rip`) into an array, zero-padded.
pub fn get_bytes<const N: usize>(buf: &[u8], f: Bits) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(src) = buf.get(f.bytes()) {
        let n = N.min(src.len());
        out[..n].copy_from_slice(&src[..n]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_msb_first_in_big_endian_words() {
        let mut b = [0u8; 8];
        // `log_cq_size`-like: 5 bits at 0x3 → the low 5 bits of byte 0.
        set(&mut b, Bits::new(3, 5), 0x1f);
        assert_eq!(b[0], 0x1f);
        // 24 bits at 8: bytes 1..4, big-endian.
        set(&mut b, Bits::new(8, 24), 0x12_3456);
        assert_eq!(&b[..4], &[0x1f, 0x12, 0x34, 0x56]);
        assert_eq!(get(&b, Bits::new(8, 24)), 0x12_3456);
        // Too-wide values are masked, neighbours kept.
        set(&mut b, Bits::new(3, 5), 0xffff_fff0);
        assert_eq!(b[0], 0x10);
        // A 64-bit field is a big-endian u64.
        let mut c = [0u8; 16];
        set(&mut c, Bits::new(64, 64), 0x0102_0304_0506_0708);
        assert_eq!(&c[8..], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(get(&c, Bits::new(64, 64)), 0x0102_0304_0506_0708);
    }

    #[test]
    fn short_buffers_read_zero_and_ignore_writes() {
        let mut b = [0xffu8; 2];
        assert_eq!(get(&b, Bits::new(8, 16)), 0xff00);
        set(&mut b, Bits::new(8, 16), 0);
        assert_eq!(b, [0xff, 0]);
        assert_eq!(get_bytes::<4>(&b, Bits::new(0, 32)), [0; 4]);
    }
}
