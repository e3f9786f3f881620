//! A block device described by a block manifest, read lazily through the node cache:
//! a read fetches only the chunks it touches; ranges no extent covers read as zeros.
//!
//! The device remembers the first chunk of its own that failed verification, so the
//! sandboxes booted on it can say why their guest saw an I/O error (other devices on
//! the same node cache are not blamed for it).

use std::sync::{Arc, Mutex};

use amber_converter::manifest::BlockManifest;
use bytes::{Bytes, BytesMut};

use crate::cache::{CacheError, ChunkCache};

pub struct LazyDevice {
    manifest: BlockManifest,
    cache: Arc<ChunkCache>,
    /// The first integrity failure of a chunk of this device (`CacheError::Integrity`).
    integrity: Mutex<Option<Arc<CacheError>>>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("read of {len} bytes at {offset} is past the end of the {size}-byte device")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error(transparent)]
    Cache(#[from] Arc<CacheError>),
}

impl LazyDevice {
    /// `manifest` must be valid (sorted, in range); `RegistrySource::manifest` checks it.
    pub fn new(manifest: BlockManifest, cache: Arc<ChunkCache>) -> LazyDevice {
        LazyDevice {
            manifest,
            cache,
            integrity: Mutex::new(None),
        }
    }

    /// The first chunk of this device that failed verification, if one did: the reader
    /// got an I/O error instead of its bytes.
    pub fn integrity_failure(&self) -> Option<Arc<CacheError>> {
        self.integrity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The node cache this device reads through.
    pub fn cache(&self) -> &Arc<ChunkCache> {
        &self.cache
    }

    pub fn size(&self) -> u64 {
        self.manifest.device_size
    }

    pub fn manifest(&self) -> &BlockManifest {
        &self.manifest
    }

    /// Reads `len` bytes at `offset`. Chunks the range touches are fetched concurrently.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, ReadError> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.size())
            .ok_or(ReadError::OutOfRange {
                offset,
                len,
                size: self.size(),
            })?;
        let ext = &self.manifest.extents;
        let first = ext.partition_point(|e| e.offset + e.length <= offset);
        let mut parts = Vec::new();
        for e in ext[first..].iter().take_while(|e| e.offset < end) {
            let s = e.offset.max(offset);
            let t = (e.offset + e.length).min(end);
            parts.push((
                s - offset,
                self.cache
                    .read(&e.chunk, e.length, s - e.offset, (t - s) as usize),
            ));
        }
        let mut out = BytesMut::zeroed(len as usize);
        let results = futures_util::future::join_all(
            parts
                .into_iter()
                .map(|(at, f)| async move { (at, f.await) }),
        )
        .await;
        for (at, r) in results {
            let data = r.inspect_err(|e| {
                if matches!(**e, CacheError::Integrity { .. }) {
                    self.integrity
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert_with(|| e.clone());
                }
            })?;
            out[at as usize..at as usize + data.len()].copy_from_slice(&data);
        }
        Ok(out.freeze())
    }
}
