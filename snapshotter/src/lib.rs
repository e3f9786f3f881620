//! amber's node side of storage: the chunk cache shared by all sandboxes on a node,
//! lazy block devices served over NBD.
//!
//! Modules: `source` (where chunks and block manifests come from: the registry's amber
//! API), `cache` (the verified, bounded, content-addressed node cache), `device` (a block
//! manifest read lazily through the cache), `nbd` (the NBD server QEMU attaches to).
//!
//! Invariant kept across the crate: every byte handed to a reader was verified against
//! its chunk id (blake3 of the uncompressed chunk) before it entered the cache; a chunk
//! that fails verification is an error, never data.
//!
//! Not built yet (runner issue #4): copy-on-write state, snapshot, fork.

pub mod cache;
pub mod device;
pub mod nbd;
pub mod source;
