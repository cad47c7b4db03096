//! The providers, listed once: [`providers!`] is the one place to add one. Everything that
//! differs per provider at run time is generated from its entry: the [`ProviderKind`] enum
//! (names, aliases, wire tags, [`ProviderKind::visit`]), the provider-neutral handles
//! ([`any_provider!`], [`with_any!`]) and their construction from a monomorphised object.
//!
//! [`ProviderKind`]: crate::verbs::ProviderKind
//! [`ProviderKind::visit`]: crate::verbs::ProviderKind::visit
//!
//! An entry gives the variant, the type implementing [`Provider`](super::Provider), its
//! `RPC_PROVIDER` name and aliases, the tag it prints in logs, its wire tag (the byte that
//! names it in [`Endpoint`](super::Endpoint)s and handshakes: never reuse one) and the `cfg`
//! under which it is compiled, and what to do when a build lacks it. The type sets `const KIND: ProviderKind = ProviderKind::X`.

/// The list of providers. `providers!(@each <what> ...)` expands the arm `@gen <what>` with
/// every entry; the other arms are what is generated from it.
macro_rules! providers {
    (@each $what:ident $args:tt) => {
        $crate::verbs::registry::providers! {
            @gen $what $args
            /// The software RNIC ([`soft::Soft`](crate::verbs::soft::Soft)).
            Soft {
                ty: $crate::verbs::soft::Soft,
                name: "soft",
                aliases: [],
                log: "SOFT",
                wire: 1,
                cfg: all(),
                missing: "",
            }
            /// Real RNICs through rdma-sys (feature `ibverbs`).
            Ib {
                ty: $crate::verbs::ib::Ib,
                name: "ib",
                aliases: ["ibverbs", "verbs"],
                log: "IB",
                wire: 2,
                cfg: feature = "ibverbs",
                missing: "build with `--features ibverbs` (needs Debian's libibverbs-dev \
                          librdmacm-dev libclang1-14 libclang-common-14-dev)",
            }
        }
    };

    // The `ProviderKind` enum and its methods.
    (@gen kind {}
        $(
            $(#[$doc:meta])*
            $v:ident {
                ty: $ty:path,
                name: $name:literal,
                aliases: [$($alias:literal),*],
                log: $log:literal,
                wire: $wire:literal,
                cfg: $cfg:meta,
                missing: $missing:literal,
            }
        )*
    ) => {
        /// The providers that can be chosen at run time.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ProviderKind {
            $( $(#[$doc])* $v, )*
        }

        impl ProviderKind {
            /// Every provider, compiled in or not.
            pub const ALL: &'static [ProviderKind] = &[$(ProviderKind::$v),*];

            /// The lower-case name (the value of `RPC_PROVIDER`).
            pub const fn name(self) -> &'static str {
                match self {
                    $( ProviderKind::$v => $name, )*
                }
            }

            /// The upper-case tag used in logs (`SOFT`, `IB`), as NCCL prints `NET/IB`.
            pub const fn log_tag(self) -> &'static str {
                match self {
                    $( ProviderKind::$v => $log, )*
                }
            }

            /// The byte naming the provider on the wire (endpoints, handshakes).
            pub const fn wire_tag(self) -> u8 {
                match self {
                    $( ProviderKind::$v => $wire, )*
                }
            }

            /// The provider a wire tag names.
            pub const fn from_wire_tag(tag: u8) -> Option<ProviderKind> {
                match tag {
                    $( $wire => Some(ProviderKind::$v), )*
                    _ => None,
                }
            }

            /// Whether this build has the provider.
            pub const fn is_compiled(self) -> bool {
                match self {
                    $( ProviderKind::$v => cfg!($cfg), )*
                }
            }

            /// The providers compiled into this build, default first.
            pub fn compiled() -> &'static [ProviderKind] {
                &COMPILED
            }

            /// The provider named `s` (a name or an alias, lower case).
            fn lookup(s: &str) -> Option<ProviderKind> {
                match s {
                    $( $name $(| $alias)* => Some(ProviderKind::$v), )*
                    _ => None,
                }
            }

            /// Runs `v` with the provider type of `self`: the one place a provider is chosen
            /// at run time. Everything `v` does is monomorphised for that provider.
            ///
            /// # Errors
            /// [`ErrorKind::Unsupported`](crate::verbs::ErrorKind::Unsupported) for a provider this
            /// build does not have.
            pub fn visit<V: ProviderVisitor>(self, v: V) -> Result<V::Output> {
                match self {
                    $(
                        #[cfg($cfg)]
                        ProviderKind::$v => Ok(v.visit::<$ty>()),
                    )*
                    #[allow(unreachable_patterns)]
                    other => Err(other.not_compiled()),
                }
            }

            /// The error for a provider this build does not have.
            fn not_compiled(self) -> VerbsError {
                let how = match self {
                    $( ProviderKind::$v => $missing, )*
                };
                VerbsError::new(
                    Verb::OpenDevice,
                    ErrorKind::Unsupported,
                    format!("the {} provider is not compiled in: {how}", self.name()),
                )
            }
        }

        const COMPILED_LEN: usize = 0 $( + cfg!($cfg) as usize )*;

        /// The compiled providers, in the registry's order.
        const COMPILED: [ProviderKind; COMPILED_LEN] = {
            let mut out = [ProviderKind::ALL[0]; COMPILED_LEN];
            let (mut i, mut n) = (0, 0);
            while i < ProviderKind::ALL.len() {
                if ProviderKind::ALL[i].is_compiled() {
                    out[n] = ProviderKind::ALL[i];
                    n += 1;
                }
                i += 1;
            }
            out
        };
    };

    // An enum of `Arc<$t<P>>` per compiled provider (see `any_provider!`).
    (@gen any_enum { $(#[$m:meta])* $vis:vis enum $ename:ident wraps $t:ident }
        $(
            $(#[$doc:meta])*
            $v:ident {
                ty: $ty:path,
                name: $name:literal,
                aliases: [$($alias:literal),*],
                log: $log:literal,
                wire: $wire:literal,
                cfg: $cfg:meta,
                missing: $missing:literal,
            }
        )*
    ) => {
        $(#[$m])*
        $vis enum $ename {
            $(
                $(#[$doc])*
                #[cfg($cfg)]
                $v(std::sync::Arc<$t<$ty>>),
            )*
        }

        impl $ename {
            /// The handle of `x`, whose provider `P` is one of the compiled ones (checked
            /// through `Any`, so this needs no unsafe).
            fn from_arc<P: $crate::verbs::Provider>(x: std::sync::Arc<$t<P>>) -> $ename {
                let any: std::sync::Arc<dyn std::any::Any + Send + Sync> = x;
                $(
                    #[cfg($cfg)]
                    let any = match any.downcast::<$t<$ty>>() {
                        Ok(x) => return $ename::$v(x),
                        Err(any) => any,
                    };
                )*
                let _ = any;
                unreachable!("{} is not a compiled provider", P::NAME)
            }
        }
    };

    // A match over an `any_provider!` value (see `with_any!`).
    (@gen with_any { $ename:ident, $e:expr, $x:ident => $body:expr }
        $(
            $(#[$doc:meta])*
            $v:ident {
                ty: $ty:path,
                name: $name:literal,
                aliases: [$($alias:literal),*],
                log: $log:literal,
                wire: $wire:literal,
                cfg: $cfg:meta,
                missing: $missing:literal,
            }
        )*
    ) => {
        match $e {
            $(
                #[cfg($cfg)]
                $ename::$v($x) => $body,
            )*
        }
    };
}
pub(crate) use providers;

/// Declares an enum with one variant per compiled provider, each holding `Arc<$T<P>>`: how a
/// provider-neutral handle holds a monomorphised object, with `$name::from_arc` to build one
/// inside code generic over the provider. Use [`with_any!`] to reach the object.
macro_rules! any_provider {
    ($(#[$m:meta])* $vis:vis enum $name:ident wraps $t:ident) => {
        $crate::verbs::registry::providers!(@each any_enum { $(#[$m])* $vis enum $name wraps $t });
    };
}
pub(crate) use any_provider;

/// Runs `$body` with `$x` bound to the object inside an [`any_provider!`] enum value: one
/// branch per call at the API boundary; everything below it is monomorphised.
macro_rules! with_any {
    ($name:ident, $e:expr, $x:ident => $body:expr) => {
        $crate::verbs::registry::providers!(@each with_any { $name, $e, $x => $body })
    };
}
pub(crate) use with_any;

#[cfg(test)]
mod tests {
    use crate::verbs::{ErrorKind, Provider, ProviderKind};

    #[test]
    fn every_entry_round_trips_its_name_and_wire_tag() {
        let mut tags = std::collections::HashSet::new();
        for &k in ProviderKind::ALL {
            assert!(
                tags.insert(k.wire_tag()),
                "wire tag {} reused",
                k.wire_tag()
            );
            assert_eq!(ProviderKind::from_wire_tag(k.wire_tag()), Some(k));
            match k.name().parse::<ProviderKind>() {
                Ok(parsed) => assert_eq!(parsed, k),
                Err(e) => {
                    assert!(!k.is_compiled());
                    assert_eq!(e.kind(), ErrorKind::Unsupported);
                    assert!(e.to_string().contains("not compiled in"), "{e}");
                }
            }
            assert_eq!(k.is_compiled(), ProviderKind::compiled().contains(&k));
        }
        assert_eq!(ProviderKind::from_wire_tag(0), None);
        assert_eq!(ProviderKind::compiled()[0], ProviderKind::Soft);
        assert_eq!(<crate::verbs::soft::Soft as Provider>::NAME, "soft");
        assert_eq!(<crate::verbs::soft::Soft as Provider>::TAG, "SOFT");
    }

    #[test]
    fn names_parse_in_any_case_and_strangers_are_listed() {
        assert_eq!(
            " SOFT ".parse::<ProviderKind>().ok(),
            Some(ProviderKind::Soft)
        );
        assert_eq!("".parse::<ProviderKind>().ok(), Some(ProviderKind::Soft));
        if ProviderKind::Ib.is_compiled() {
            assert_eq!("Verbs".parse::<ProviderKind>().ok(), Some(ProviderKind::Ib));
        }
        let e = "mlx9".parse::<ProviderKind>().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("soft, ib"), "{e}");
    }
}
