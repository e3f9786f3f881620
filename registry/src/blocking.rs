//! Short blocking calls made from async code (an fsynced RocksDB write, waiting for the
//! index's tag lock, an argon2 check): on the multi-threaded runtime they run in
//! `block_in_place`, which hands this worker's other tasks to another worker first, so
//! one slow disk or one login does not stall unrelated requests. Elsewhere (a blocking
//! thread, a command-line tool, a current-thread test runtime) they simply run.
//!
//! Point lookups in RocksDB (the index, the fs store's records) do NOT come here: they
//! run on the worker. Each `block_in_place` hands the worker's core to another thread,
//! and tokio starts a new one when none is idle: at a million images, with most lookups
//! missing memory, GETs ran ~500 threads, and against lookups on the worker (both on the
//! same store, wrk with 64 connections) p99 by tag went from 186 to 725 ms, by digest
//! from 11 to 104 ms, resolve from 79 to 465 ms and peak RSS from 386 to 502 MiB. Those
//! lookups hit the page cache (the index and the records database are about 1.2 GB at a
//! million images); what made them wait for the disk before, the manifests' own files, is
//! gone from the read path (`manifest_cache.rs`).

/// Runs `f`, letting the runtime move other tasks off this worker while it blocks.
pub fn run<T>(f: impl FnOnce() -> T) -> T {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}
