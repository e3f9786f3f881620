//! Recompression, at the store's level (`chunk_zstd_level`), of the chunks conversions
//! wrote at their fast level (`convert_zstd_level`), while this process converts nothing.
//!
//! A conversion compresses the chunks it is first to store cheaply, so its image is
//! usable sooner (the corpus benchmark: level 9 is half of a conversion's CPU), and notes
//! each in the index (`recompress` family, `Index::put_chunk`). This loop takes them a
//! batch at a time whenever no conversion runs or is lined up in this process: it reads
//! each chunk from the store, and a thread of its own, at the lowest CPU priority,
//! decompresses it, checks that the bytes hash to the chunk's id, and compresses them at
//! the store's level; the object is replaced when that is smaller
//! (`ObjectStore::put_replacing`). Readers never notice: a read gets one encoding whole,
//! both decompress to the same bytes, and every reader checks them against the id.
//!
//! The loop is a task on the runtime, so under load it waits behind the requests at
//! every await and slows down by itself (on a nice-19 thread of its own it went 3.4x
//! faster during reads and took a fifth to a quarter of their rate: BENCHMARKS.md,
//! "Metadata at scale"). What may wait on the disk (the chunk's read, the index's note)
//! runs on the blocking pool, not on a worker.
//!
//! Invariants kept here:
//! - an object is only ever replaced by another encoding of the bytes its id names,
//!   checked before the replace;
//! - the index (the chunk's size, the totals) follows the replace, after it: a crash in
//!   between leaves the chunk noted, and it is recompressed again (to the same bytes) and
//!   its size noted then;
//! - a chunk whose stored bytes are damaged is left as it is (its marker dropped, with a
//!   warning): recompression never hides damage, `fsck` reports it.
//!
//! The notes are this replica's: a chunk noted by a replica that is gone (or lost with
//! an index rebuilt by `reindex`) stays at the fast level, readable, a little larger.

use std::sync::Arc;
use std::time::Duration;

use amber_oci::env::ChunkId;
use bytes::Bytes;

use crate::metrics::CHUNKS_TO_RECOMPRESS;
use crate::registry::Registry;
use crate::store::{ObjectKey, StoreError};

/// Chunks recompressed and replaced in the store.
pub const CHUNKS_RECOMPRESSED: &str = "amber_chunks_recompressed_total";
/// Stored bytes recompression saved.
pub const RECOMPRESSION_SAVED_BYTES: &str = "amber_chunk_bytes_saved_by_recompression_total";

/// Chunks taken from the index at a time.
const BATCH: usize = 64;
/// How often the loop looks for work when nothing woke it (a conversion ending wakes it).
const IDLE_CHECK: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
enum RecompressError {
    #[error("reading it: {0}")]
    Store(#[from] StoreError),
    /// The stored bytes do not decompress to the chunk's bytes: left for fsck.
    #[error("its stored bytes are damaged: {0}")]
    Damaged(String),
    #[error("compressing it: {0}")]
    Compress(std::io::Error),
    #[error("noting it in the index: {0}")]
    Index(#[from] crate::index::IndexError),
    #[error("the recompression thread is gone")]
    ThreadGone,
    #[error("its read or its note did not finish: {0}")]
    Unfinished(tokio::task::JoinError),
}

/// One chunk for the compression thread; the answer is its new encoding when smaller.
struct Job {
    id: ChunkId,
    stored: Bytes,
    level: i32,
    done: tokio::sync::oneshot::Sender<Result<Option<Vec<u8>>, RecompressError>>,
}

/// Starts the loop (and its compression thread). Without notes it only looks at the
/// index when a conversion ends, or every `IDLE_CHECK`.
pub fn start(reg: &Arc<Registry>) -> std::io::Result<()> {
    let (jobs, mut queue) = tokio::sync::mpsc::channel::<Job>(1);
    // Ends when the loop drops `jobs` (the server stopped).
    std::thread::Builder::new()
        .name("amber-recompress".into())
        .spawn(move || {
            lowest_priority();
            while let Some(job) = queue.blocking_recv() {
                let _ = job.done.send(recompress(&job.id, &job.stored, job.level));
            }
        })?;
    let waiting = reg.index.totals().map_or(0, |t| t.chunks_to_recompress);
    metrics::gauge!(CHUNKS_TO_RECOMPRESS).set(waiting as f64);
    reg.spawn_background(move |reg| async move {
        let mut after: Option<String> = None;
        loop {
            let idle = !reg.converting_any();
            let batch = if idle {
                match reg.index.chunks_to_recompress(after.as_deref(), BATCH) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(error = %e, "listing chunks to recompress");
                        Vec::new()
                    }
                }
            } else {
                Vec::new()
            };
            if batch.is_empty() {
                // From the start again at the next pass (notes made meanwhile sort anywhere).
                let restart = after.take().is_some() && idle;
                if !restart {
                    tokio::select! {
                        _ = tokio::time::sleep(IDLE_CHECK) => {}
                        _ = reg.conversions_settled.notified() => {}
                    }
                }
                continue;
            }
            after = batch.last().cloned();
            for id in batch {
                if reg.converting_any() {
                    break;
                }
                if let Err(e) = one(&reg, &jobs, &id).await {
                    tracing::warn!(chunk = %id, error = %e, "recompressing a chunk");
                    if matches!(e, RecompressError::Damaged(_)) {
                        if let Ok(Some(size)) = reg.index.chunk(&id) {
                            if let Ok(true) = reg.index.recompressed(&id, size) {
                                metrics::gauge!(CHUNKS_TO_RECOMPRESS).decrement(1);
                            }
                        }
                    } else {
                        // The store or the thread failed: try again at a later pass.
                        tokio::time::sleep(IDLE_CHECK).await;
                        break;
                    }
                }
            }
        }
    });
    Ok(())
}

/// Recompresses chunk `id` (a note of the index), replaces it when smaller, and ends
/// its note.
async fn one(
    reg: &Arc<Registry>,
    jobs: &tokio::sync::mpsc::Sender<Job>,
    id: &str,
) -> Result<(), RecompressError> {
    let Ok(chunk) = id.parse::<ChunkId>() else {
        return Err(RecompressError::Damaged(format!(
            "{id:?} is not a chunk id"
        )));
    };
    let key = ObjectKey::chunk(&chunk);
    // Read on a blocking thread, not a worker: a chunk written long ago is often out of
    // the page cache, and the fs store reads small objects where they are asked for.
    let (store, read_key) = (reg.store.clone(), key.clone());
    let handle = tokio::runtime::Handle::current();
    let read = tokio::task::spawn_blocking(move || handle.block_on(store.read_all(&read_key)));
    let stored = match read.await.map_err(RecompressError::Unfinished)? {
        Ok(b) => b,
        Err(StoreError::NotFound(_)) => {
            return Err(RecompressError::Damaged(
                "the store does not have it".into(),
            ))
        }
        Err(e) => return Err(e.into()),
    };
    let (done, answer) = tokio::sync::oneshot::channel();
    let job = Job {
        id: chunk,
        stored: stored.clone(),
        level: reg.config.chunk_zstd_level,
        done,
    };
    jobs.send(job)
        .await
        .map_err(|_| RecompressError::ThreadGone)?;
    let size = match answer.await.map_err(|_| RecompressError::ThreadGone)?? {
        Some(smaller) => {
            let size = smaller.len() as u64;
            reg.store.put_replacing(&key, Bytes::from(smaller)).await?;
            metrics::counter!(CHUNKS_RECOMPRESSED).increment(1);
            metrics::counter!(RECOMPRESSION_SAVED_BYTES).increment(stored.len() as u64 - size);
            size
        }
        None => stored.len() as u64,
    };
    // The note too: RocksDB slows writes down while it compacts after a large ingest.
    let (on_pool, noted) = (reg.clone(), id.to_string());
    let note = tokio::task::spawn_blocking(move || on_pool.index.recompressed(&noted, size));
    if note.await.map_err(RecompressError::Unfinished)?? {
        metrics::gauge!(CHUNKS_TO_RECOMPRESS).decrement(1);
    }
    Ok(())
}

/// The chunk's bytes (checked against `id`) compressed at `level`, when smaller than
/// `stored`.
fn recompress(id: &ChunkId, stored: &[u8], level: i32) -> Result<Option<Vec<u8>>, RecompressError> {
    let plain = crate::convert::decompress_chunk(stored)
        .map_err(|e| RecompressError::Damaged(e.to_string()))?;
    let got = ChunkId::of(&plain);
    if got != *id {
        return Err(RecompressError::Damaged(format!(
            "its {} bytes hash to {got}",
            plain.len()
        )));
    }
    let smaller =
        crate::convert::compress_chunk(&plain, level).map_err(RecompressError::Compress)?;
    Ok((smaller.len() < stored.len()).then_some(smaller))
}

/// Puts the calling thread at the lowest CPU priority (nice 19), so recompression only
/// takes CPU that pushes, reads and conversions leave. Best effort.
fn lowest_priority() {
    // SAFETY: gettid and setpriority touch no memory of ours; on Linux a thread id names
    // one thread for PRIO_PROCESS.
    unsafe {
        let tid = libc::gettid();
        if libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19) != 0 {
            tracing::debug!("could not lower the recompression thread's priority");
        }
    }
}
