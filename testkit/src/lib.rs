//! What amber's tests share, in one place: the real `amber-registry` process on a
//! loopback port (`registry`), tar layers (`layer`), and the tools scripts/test provides
//! (`tools`: the Docker engine, required binaries, environment), and headless Chromium
//! for the catalog pages (`browser`).
//!
//! Dev-only: no crate depends on it outside `[dev-dependencies]`. Tests that need a tool
//! fail loudly when it is missing; nothing here skips.

pub mod browser;
pub mod layer;
pub mod registry;
pub mod tools;

pub use registry::{Registry, Storage};
pub use tools::*;
