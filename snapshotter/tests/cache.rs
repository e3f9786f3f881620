//! The node chunk cache: single flight, LRU bound, verification, persistence.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use amber_converter::manifest::ChunkId;
use amber_snapshotter::cache::{CacheError, ChunkCache};
use amber_snapshotter::source::{ChunkSource, SourceError};
use async_trait::async_trait;
use bytes::Bytes;

/// A source serving zstd chunks from memory, counting fetches; it can be told to lie.
#[derive(Default)]
struct MemSource {
    chunks: std::sync::Mutex<HashMap<ChunkId, Bytes>>,
    fetches: AtomicU64,
}

impl MemSource {
    fn add(&self, data: &[u8]) -> (ChunkId, u64) {
        let id = ChunkId::of(data);
        self.chunks
            .lock()
            .unwrap()
            .insert(id, Bytes::from(zstd::bulk::compress(data, 3).unwrap()));
        (id, data.len() as u64)
    }
    fn corrupt(&self, id: &ChunkId, other: &[u8]) {
        self.chunks
            .lock()
            .unwrap()
            .insert(*id, Bytes::from(zstd::bulk::compress(other, 3).unwrap()));
    }
}

#[async_trait]
impl ChunkSource for MemSource {
    async fn fetch(&self, id: &ChunkId) -> Result<Bytes, SourceError> {
        self.fetches.fetch_add(1, Relaxed);
        tokio::task::yield_now().await;
        self.chunks
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| SourceError::NotFound(id.to_string()))
    }
}

fn data(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_misses_of_one_chunk_fetch_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let src = Arc::new(MemSource::default());
    let (id, len) = src.add(&data(1, 1 << 20));
    let cache = Arc::new(ChunkCache::open(dir.path(), 64 << 20, src.clone()).unwrap());
    let reads = (0..64).map(|i| {
        let cache = cache.clone();
        tokio::spawn(async move { cache.read(&id, len, i * 100, 100).await.unwrap() })
    });
    for (i, r) in futures_util::future::join_all(reads)
        .await
        .into_iter()
        .enumerate()
    {
        assert_eq!(&r.unwrap()[..], &data(1, 1 << 20)[i * 100..i * 100 + 100]);
    }
    assert_eq!(src.fetches.load(Relaxed), 1);
    assert_eq!(cache.stats.fetches.load(Relaxed), 1);
}

#[tokio::test]
async fn the_cache_is_bounded_least_recently_used_first() {
    let dir = tempfile::tempdir().unwrap();
    let src = Arc::new(MemSource::default());
    let chunks: Vec<_> = (0..4).map(|i| src.add(&data(i, 100_000))).collect();
    let cache = ChunkCache::open(dir.path(), 250_000, src.clone()).unwrap();
    for (id, len) in &chunks[..2] {
        cache.read(id, *len, 0, 10).await.unwrap();
    }
    cache.read(&chunks[0].0, chunks[0].1, 0, 10).await.unwrap(); // 0 is now the most recent
    cache.read(&chunks[2].0, chunks[2].1, 0, 10).await.unwrap(); // evicts 1
    assert!(
        cache.contains(&chunks[0].0)
            && !cache.contains(&chunks[1].0)
            && cache.contains(&chunks[2].0)
    );
    assert!(cache.bytes() <= 250_000);
    assert_eq!(cache.stats.evictions.load(Relaxed), 1);
    let before = src.fetches.load(Relaxed);
    cache.read(&chunks[1].0, chunks[1].1, 0, 10).await.unwrap();
    assert_eq!(
        src.fetches.load(Relaxed),
        before + 1,
        "an evicted chunk is fetched again"
    );
}

#[tokio::test]
async fn a_chunk_that_fails_verification_is_an_error_and_never_cached() {
    let dir = tempfile::tempdir().unwrap();
    let src = Arc::new(MemSource::default());
    let (id, len) = src.add(&data(7, 5000));
    src.corrupt(&id, &data(8, 5000));
    let cache = ChunkCache::open(dir.path(), 1 << 20, src.clone()).unwrap();
    let err = cache.read(&id, len, 0, 10).await.unwrap_err();
    assert!(matches!(*err, CacheError::Integrity { .. }), "{err}");
    assert!(
        err.to_string().contains("integrity error") && err.to_string().contains(&id.to_string()),
        "{err}"
    );
    assert!(!cache.contains(&id));
    assert_eq!(cache.stats.integrity_failures.load(Relaxed), 1);
    // A wrong length is caught as well.
    let (id2, _) = src.add(&data(9, 5000));
    let err = cache.read(&id2, 4000, 0, 10).await.unwrap_err();
    assert!(matches!(*err, CacheError::Integrity { .. }), "{err}");
    let files = amber_testkit::files_under(dir.path());
    assert!(files.is_empty(), "nothing unverified on disk: {files:?}");
}

#[tokio::test]
async fn cached_chunks_survive_a_restart_and_partial_writes_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let src = Arc::new(MemSource::default());
    let (id, len) = src.add(&data(3, 70_000));
    {
        let cache = ChunkCache::open(dir.path(), 1 << 20, src.clone()).unwrap();
        cache.read(&id, len, 0, 10).await.unwrap();
    }
    // A crash mid-write leaves a temporary file behind.
    let hex = id.hex();
    std::fs::write(
        dir.path().join(&hex[..2]).join(format!("{hex}.999.tmp")),
        b"partial",
    )
    .unwrap();
    let cache = ChunkCache::open(dir.path(), 1 << 20, src.clone()).unwrap();
    assert!(cache.contains(&id));
    assert_eq!(
        &cache.read(&id, len, 5, 5).await.unwrap()[..],
        &data(3, 70_000)[5..10]
    );
    assert_eq!(
        src.fetches.load(Relaxed),
        1,
        "the second run fetched nothing"
    );
    assert_eq!(
        amber_testkit::files_under(dir.path()).len(),
        1,
        "the partial write was removed"
    );
}
