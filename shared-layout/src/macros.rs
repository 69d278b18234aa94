/// Declares a numeric enum that never fails to parse: every value outside the list becomes
/// `Unknown(value)` (smoltcp's `enum_with_unknown!`). Generates `from_raw` / `raw` as `const fn`
/// and `From` in both directions.
macro_rules! enum_with_unknown {
    (
        $(#[$meta:meta])*
        pub enum $name:ident($ty:ty) {
            $( $(#[$vmeta:meta])* $variant:ident = $value:expr ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
            /// A value this crate does not name.
            Unknown($ty),
        }

        impl $name {
            /// Decodes a raw value; unknown values are kept, not rejected.
            #[inline(always)]
            pub const fn from_raw(value: $ty) -> Self {
                match value {
                    $( $value => $name::$variant, )+
                    other => $name::Unknown(other),
                }
            }

            /// The raw value.
            #[inline(always)]
            pub const fn raw(self) -> $ty {
                match self {
                    $( $name::$variant => $value, )+
                    $name::Unknown(other) => other,
                }
            }
        }

        impl From<$ty> for $name {
            #[inline(always)]
            fn from(value: $ty) -> Self {
                $name::from_raw(value)
            }
        }

        impl From<$name> for $ty {
            #[inline(always)]
            fn from(value: $name) -> Self {
                value.raw()
            }
        }
    };
}

/// Asserts at compile time that a `Pod` struct's fields sit at the byte ranges of its `field`
/// module and that its size is the size derived from the last field.
macro_rules! assert_layout {
    ($ty:ty, $size:expr, { $($member:ident => $range:expr),+ $(,)? }) => {
        const _: () = {
            assert!(core::mem::size_of::<$ty>() == $size);
            $( assert!(core::mem::offset_of!($ty, $member) == ($range).start); )+
        };
    };
}
