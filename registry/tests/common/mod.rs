//! The registry's tests use amber-testkit's harness: the real `amber-registry` binary on
//! a loopback port with its own data directory, and HTTP helpers for the distribution
//! API. `Server` is the registry process.
#![allow(dead_code, unused_imports)]

pub use amber_testkit::layer::{files_tar, gzip, zstd, Layer};
pub use amber_testkit::registry::*;
pub use amber_testkit::tools::*;

pub type Server = amber_testkit::Registry;
