//! The bytes of the manifests this registry serves, held in memory for GETs by tag or by
//! digest, within `manifest_cache_bytes` (`crate::bytes_cache`). Behind it, in the order
//! a read tries them (`Registry::manifest_bytes`, records.rs): the index's copy
//! (`manifest_bytes`: one more lookup in a table of the index, by digest), then
//! the store's object (on local disk an open, two stats, a read and a close of a file in a
//! tree of millions; on S3 a GET), which then fills both. Pushes fill both too.
//! A GET by tag that finds the bytes here or in the index's copy answers with the media
//! type they declare and reads no manifest record (`Registry::held_manifest`).
//!
//! At a million images the files of the manifests were 5 GiB of 4 KiB blocks (a
//! manifest is about a kilobyte) beside their inodes and directories, which the page
//! cache did not keep: opening one was 28% of the registry's CPU in GETs by tag, and a
//! read that waited for the disk stalled the requests queued behind it.
//!
//! Invariant: an entry, in memory or in the index, holds exactly the bytes of the
//! manifest its digest names (a copy read from the store is checked against its digest
//! before either keeps it). Manifests are content-addressed and never rewritten or
//! removed (`ObjectStore::remove` is for layer blobs only), so an entry never goes stale
//! and nothing invalidates one.

use bytes::Bytes;

use crate::bytes_cache::{BytesCache, Ticket};
use amber_oci::digest::Digest;

/// Manifest reads answered from memory, from the index's copy, and from the store
/// (metrics).
pub const HITS: &str = "amber_manifest_cache_hits_total";
pub const INDEX_HITS: &str = "amber_manifest_cache_index_hits_total";
pub const MISSES: &str = "amber_manifest_cache_misses_total";

pub struct ManifestCache {
    held: BytesCache<Digest>,
    /// Keeps no copies (a budget of 0).
    off: bool,
}

/// What memory had of a manifest.
pub enum Held {
    Bytes(Bytes),
    /// Not held: fill it with the ticket once read.
    Missing(Ticket),
    /// The cache is off: keep no copy anywhere, read the store.
    Off,
}

impl ManifestCache {
    /// A cache holding at most `budget` bytes of manifests in memory. 0 turns it off:
    /// no copies at all, in memory or in the index, so every GET reads the store (what a
    /// test that tampers with the store's objects needs to reach the client).
    pub fn new(budget: usize) -> ManifestCache {
        ManifestCache {
            held: BytesCache::new(budget, |d| std::mem::size_of::<Digest>() + d.hex().len()),
            off: budget == 0,
        }
    }

    /// Keeps copies (in memory and in the index): false for a budget of 0.
    pub fn on(&self) -> bool {
        !self.off
    }

    /// What memory holds of manifest `digest` (with the ticket to fill it on a miss).
    pub fn get(&self, digest: &Digest) -> Held {
        if self.off {
            return Held::Off;
        }
        match self.held.get(digest) {
            Ok(bytes) => Held::Bytes(bytes),
            Err(ticket) => Held::Missing(ticket),
        }
    }

    /// Holds `bytes`, read after `ticket`'s miss (kept unless an eviction raced it).
    pub fn fill(&self, ticket: Ticket, digest: &Digest, bytes: Bytes) {
        self.held.fill(ticket, digest.clone(), bytes);
    }

    /// Holds `bytes`, just pushed and checked to be manifest `digest`'s (the caller
    /// keeps no copies when the cache is off: see `on`).
    pub fn set(&self, digest: &Digest, bytes: Bytes) {
        self.held.set(digest.clone(), bytes);
    }

    #[cfg(test)]
    pub fn held_count(&self) -> usize {
        self.held.held().1
    }
}
