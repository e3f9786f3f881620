//! The node chunk cache: content-addressed, bounded with least-recently-used eviction,
//! shared by every device on the node, crash-safe, one fetch for concurrent misses.
//!
//! Layout: `<dir>/<2 hex>/<64 hex>` holds a chunk's verified, uncompressed bytes.
//! Invariants:
//! - a file appears under its final name only after its bytes were decompressed,
//!   checked against the chunk id (length and blake3), written and fsynced; a crash
//!   leaves at most a `*.tmp` file, removed when the cache is opened;
//! - chunks are immutable, so a cached chunk is valid forever; eviction only bounds size;
//! - concurrent misses of one chunk share one fetch (single flight).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use amber_converter::manifest::ChunkId;
use bytes::Bytes;

use crate::source::{ChunkSource, SourceError};

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("integrity error: chunk {chunk} from the registry {what}; refusing to use it")]
    Integrity { chunk: String, what: String },
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("node cache I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Counters for tests, benchmarks and metrics.
#[derive(Debug, Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub fetches: AtomicU64,
    /// Bytes received from the source (compressed).
    pub fetched_bytes: AtomicU64,
    /// Uncompressed bytes of the chunks fetched.
    pub fetched_chunk_bytes: AtomicU64,
    pub evictions: AtomicU64,
    pub integrity_failures: AtomicU64,
}

#[derive(Default)]
struct Lru {
    /// chunk -> (size, last use tick)
    entries: HashMap<ChunkId, (u64, u64)>,
    by_tick: BTreeMap<u64, ChunkId>,
    tick: u64,
    bytes: u64,
}

impl Lru {
    fn touch(&mut self, id: &ChunkId) -> bool {
        let Some((_, t)) = self.entries.get_mut(id) else {
            return false;
        };
        self.by_tick.remove(t);
        self.tick += 1;
        *t = self.tick;
        self.by_tick.insert(self.tick, *id);
        true
    }

    fn insert(&mut self, id: ChunkId, size: u64) {
        if self.touch(&id) {
            return;
        }
        self.tick += 1;
        self.entries.insert(id, (size, self.tick));
        self.by_tick.insert(self.tick, id);
        self.bytes += size;
    }

    /// Drops `id`, whose file is gone.
    fn forget(&mut self, id: &ChunkId) {
        if let Some((size, t)) = self.entries.remove(id) {
            self.by_tick.remove(&t);
            self.bytes -= size;
        }
    }

    /// Removes least recently used entries until `bytes <= capacity`, never `keep`.
    fn evict(&mut self, capacity: u64, keep: &ChunkId) -> Vec<ChunkId> {
        let mut out = Vec::new();
        while self.bytes > capacity {
            let Some((&t, &id)) = self.by_tick.iter().find(|(_, id)| *id != keep) else {
                break;
            };
            self.by_tick.remove(&t);
            if let Some((size, _)) = self.entries.remove(&id) {
                self.bytes -= size;
            }
            out.push(id);
        }
        out
    }
}

type Flight = Arc<tokio::sync::OnceCell<Result<(), Arc<CacheError>>>>;

pub struct ChunkCache {
    dir: PathBuf,
    capacity: u64,
    source: Arc<dyn ChunkSource>,
    lru: Mutex<Lru>,
    inflight: Mutex<HashMap<ChunkId, Flight>>,
    pub stats: CacheStats,
}

fn chunk_path(dir: &Path, id: &ChunkId) -> PathBuf {
    let hex = id.hex();
    dir.join(&hex[..2]).join(hex)
}

impl ChunkCache {
    /// Opens (creating) a cache in `dir` holding at most `capacity` bytes, filled from
    /// `source`. Chunks left by an earlier run are kept; partial writes are removed.
    /// Blocking (it scans the directory): async callers run it on a blocking thread.
    pub fn open(
        dir: impl Into<PathBuf>,
        capacity: u64,
        source: Arc<dyn ChunkSource>,
    ) -> Result<ChunkCache, CacheError> {
        let dir = dir.into();
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CacheError::Io { path, source }
        };
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let mut found = Vec::new();
        for sub in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let sub = sub.map_err(io(&dir))?.path();
            if !sub.is_dir() {
                continue;
            }
            for f in std::fs::read_dir(&sub).map_err(io(&sub))? {
                let f = f.map_err(io(&sub))?;
                let p = f.path();
                let name = f.file_name().to_string_lossy().into_owned();
                match format!("blake3:{name}").parse::<ChunkId>() {
                    Ok(id) => {
                        let m = f.metadata().map_err(io(&p))?;
                        found.push((m.modified().ok(), id, m.len()));
                    }
                    Err(_) => std::fs::remove_file(&p).map_err(io(&p))?,
                }
            }
        }
        found.sort_by_key(|(t, _, _)| *t);
        let mut lru = Lru::default();
        for (_, id, size) in found {
            lru.insert(id, size);
        }
        let cache = ChunkCache {
            dir,
            capacity,
            source,
            lru: Mutex::new(lru),
            inflight: Mutex::new(HashMap::new()),
            stats: CacheStats::default(),
        };
        for p in cache.evict_over_capacity(None) {
            let _ = std::fs::remove_file(p);
        }
        Ok(cache)
    }

    /// Bytes of chunks held.
    pub fn bytes(&self) -> u64 {
        self.lru.lock().unwrap_or_else(|p| p.into_inner()).bytes
    }

    pub fn contains(&self, id: &ChunkId) -> bool {
        self.lru
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries
            .contains_key(id)
    }

    /// Drops least recently used chunks (never `keep`) from the accounting until the
    /// cache is within its bound; returns their files for the caller to remove (on a
    /// blocking thread when the caller is async). A reader racing the removal sees
    /// NotFound and fetches again.
    fn evict_over_capacity(&self, keep: Option<&ChunkId>) -> Vec<PathBuf> {
        let victims = {
            let mut lru = self.lru.lock().unwrap_or_else(|p| p.into_inner());
            let keep = keep.copied().unwrap_or(ChunkId([0; 32]));
            lru.evict(self.capacity, &keep)
        };
        self.stats
            .evictions
            .fetch_add(victims.len() as u64, Relaxed);
        victims.iter().map(|id| chunk_path(&self.dir, id)).collect()
    }

    /// Reads `len` bytes at `offset` of chunk `id` (whose uncompressed length is
    /// `chunk_len`), fetching and verifying it first if the node does not have it.
    pub async fn read(
        &self,
        id: &ChunkId,
        chunk_len: u64,
        offset: u64,
        len: usize,
    ) -> Result<Bytes, Arc<CacheError>> {
        for attempt in 0..2 {
            let hit = self.lru.lock().unwrap_or_else(|p| p.into_inner()).touch(id);
            if hit {
                self.stats.hits.fetch_add(1, Relaxed);
            } else {
                self.stats.misses.fetch_add(1, Relaxed);
                self.ensure(id, chunk_len).await?;
            }
            let path = chunk_path(&self.dir, id);
            let res = tokio::task::spawn_blocking(move || {
                let f = std::fs::File::open(&path)?;
                let mut buf = vec![0u8; len];
                std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, offset)?;
                Ok::<_, std::io::Error>(Bytes::from(buf))
            })
            .await
            .expect("read task");
            match res {
                Ok(b) => return Ok(b),
                // Evicted between the check and the read: fetch again, once.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && attempt == 0 => {
                    self.lru
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .forget(id);
                    continue;
                }
                Err(source) => {
                    return Err(Arc::new(CacheError::Io {
                        path: chunk_path(&self.dir, id),
                        source,
                    }));
                }
            }
        }
        unreachable!("the loop returns")
    }

    /// Makes sure chunk `id` (of uncompressed length `chunk_len`) is in the cache,
    /// fetched and verified if it is not; true when this call had to fetch it (or wait
    /// for another caller's fetch of it). What prefetching an env does for each chunk.
    pub async fn prefetch(&self, id: &ChunkId, chunk_len: u64) -> Result<bool, Arc<CacheError>> {
        let known = self.lru.lock().unwrap_or_else(|p| p.into_inner()).touch(id);
        let path = chunk_path(&self.dir, id);
        if known && tokio::fs::try_exists(&path).await.unwrap_or(false) {
            return Ok(false);
        }
        if known {
            // Removed behind the cache's back: forget it, so it is fetched again.
            self.lru
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .forget(id);
        }
        self.ensure(id, chunk_len).await?;
        Ok(true)
    }

    /// Makes sure chunk `id` is in the cache; concurrent callers share one fetch.
    async fn ensure(&self, id: &ChunkId, chunk_len: u64) -> Result<(), Arc<CacheError>> {
        let flight = {
            let mut m = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            m.entry(*id).or_default().clone()
        };
        let res = flight
            .get_or_init(|| self.fetch_and_store(*id, chunk_len))
            .await
            .clone();
        self.inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        res
    }

    async fn fetch_and_store(&self, id: ChunkId, chunk_len: u64) -> Result<(), Arc<CacheError>> {
        if self.contains(&id) {
            return Ok(());
        }
        self.stats.fetches.fetch_add(1, Relaxed);
        let z = self
            .source
            .fetch(&id)
            .await
            .map_err(|e| Arc::new(e.into()))?;
        self.stats.fetched_bytes.fetch_add(z.len() as u64, Relaxed);
        let dir = self.dir.clone();
        let stored = tokio::task::spawn_blocking(move || -> Result<u64, CacheError> {
            let integrity = |what: String| CacheError::Integrity {
                chunk: id.to_string(),
                what,
            };
            // Never decompress more than the manifest says the chunk holds.
            let data = zstd::bulk::decompress(&z, chunk_len as usize)
                .map_err(|e| integrity(format!("does not decompress to {chunk_len} bytes: {e}")))?;
            if data.len() as u64 != chunk_len {
                return Err(integrity(format!(
                    "is {} bytes, the manifest says {chunk_len}",
                    data.len()
                )));
            }
            let actual = ChunkId::of(&data);
            if actual != id {
                return Err(integrity(format!("hashes to {actual}")));
            }
            let path = chunk_path(&dir, &id);
            let io = |source| CacheError::Io {
                path: path.clone(),
                source,
            };
            std::fs::create_dir_all(path.parent().expect("parent")).map_err(io)?;
            let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
            let mut f = std::fs::File::create(&tmp).map_err(io)?;
            f.write_all(&data).map_err(io)?;
            f.sync_data().map_err(io)?;
            std::fs::rename(&tmp, &path).map_err(io)?;
            Ok(data.len() as u64)
        })
        .await
        .expect("store task")
        .map_err(|e| {
            if matches!(e, CacheError::Integrity { .. }) {
                self.stats.integrity_failures.fetch_add(1, Relaxed);
                tracing::error!(error = %e, "chunk failed verification");
            }
            Arc::new(e)
        })?;
        self.stats.fetched_chunk_bytes.fetch_add(stored, Relaxed);
        self.lru
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, stored);
        let victims = self.evict_over_capacity(Some(&id));
        if !victims.is_empty() {
            let _ = tokio::task::spawn_blocking(move || {
                for p in victims {
                    let _ = std::fs::remove_file(p);
                }
            })
            .await;
        }
        Ok(())
    }
}
