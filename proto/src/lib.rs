//! Rust types and tonic services for the OtterScale wire contract.
//!
//! # Layout
//! - `gen/` — code generated from the `.proto` files beside this crate by
//!   prost and tonic. It is checked in so a normal build needs no `protoc`;
//!   `tests/outputs/bootstrap.rs` regenerates it and fails on any difference
//!   (`make proto` rewrites it).
//! - [`json`] — `google.protobuf.Struct` ↔ JSON, for objects.
//! - [`FILE_DESCRIPTOR_SET`] — the encoded descriptors of every file, imports
//!   included, for reflection, the Connect JSON mapping and feature gating.
//!
//! Every singular field has explicit presence (`Option<_>` in Rust), the same
//! presence the upstream edition-2023 files give them.

pub mod json;

/// `otterscale.api`: the feature option.
pub mod api {
    include!("gen/otterscale.api.rs");
}

/// `otterscale.link.v1`: registration and the link list.
pub mod link {
    pub mod v1 {
        include!("gen/otterscale.link.v1.rs");
    }
}

/// `otterscale.resource.v1`: generic Kubernetes resource access.
pub mod resource {
    pub mod v1 {
        include!("gen/otterscale.resource.v1.rs");
    }
}

/// `otterscale.runtime.v1`: logs, exec, port-forward, scale, restart.
pub mod runtime {
    pub mod v1 {
        include!("gen/otterscale.runtime.v1.rs");
    }
}

/// `otterlink.*`: OtterScale Link's own packages, beside the upstream
/// contract. prost names another package's types by a path that mirrors
/// the package (`otterscale::resource::v1`), hence [`otterscale`].
pub mod otterlink {
    /// `otterlink.fleet.v1`: fan-out calls over many clusters.
    pub mod fleet {
        pub mod v1 {
            include!("gen/otterlink.fleet.v1.rs");
        }
    }
}

pub use otterlink::fleet;

/// The upstream packages by their package paths, for the generated code
/// of [`otterlink`].
#[doc(hidden)]
pub mod otterscale {
    pub use crate::{link, resource};
}

/// Encoded `google.protobuf.FileDescriptorSet` of our protos and their imports.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!("gen/descriptor.bin");

/// The `.proto` files of the contract, relative to this crate's folder, in
/// dependency order. Shared with the generator test and the wire check.
pub const PROTO_FILES: &[&str] = &[
    "feature.proto",
    "link/v1/link.proto",
    "resource/v1/resource.proto",
    "runtime/v1/runtime.proto",
    "otterlink/fleet/v1/fleet.proto",
];

/// Number of the `otterscale.api.feature` extension on `MethodOptions`.
pub const FEATURE_EXTENSION_NUMBER: u32 = 7_777_777;
