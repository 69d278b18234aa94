//! Big-endian integers as byte arrays: `Pod`, alignment 1, so a struct of them has exactly the
//! PRM's packing and no padding, and reading one is a byte swap on the little-endian host and GPU.
use bytemuck::{Pod, Zeroable};

macro_rules! be_int {
    ($name:ident, $ty:ty, $n:literal) => {
        #[doc = concat!("A big-endian `", stringify!($ty), "` as it lies in memory.")]
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
        #[repr(transparent)]
        pub struct $name(pub [u8; $n]);

        impl $name {
            /// Encodes `value` big-endian.
            #[inline(always)]
            pub const fn new(value: $ty) -> Self {
                $name(value.to_be_bytes())
            }

            /// The value.
            #[inline(always)]
            pub const fn get(self) -> $ty {
                <$ty>::from_be_bytes(self.0)
            }
        }

        impl core::fmt::Debug for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                write!(f, "{:#x}", self.get())
            }
        }

        impl From<$ty> for $name {
            #[inline(always)]
            fn from(value: $ty) -> Self {
                $name::new(value)
            }
        }
    };
}

be_int!(Be16, u16, 2);
be_int!(Be32, u32, 4);
be_int!(Be64, u64, 8);
