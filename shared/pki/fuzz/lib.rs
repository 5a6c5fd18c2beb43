//! The fuzz harness of otter-pki, shared by the fuzz targets and by the
//! crate's `fuzz_regressions` test.

#[path = "harness.rs"]
pub mod harness;
