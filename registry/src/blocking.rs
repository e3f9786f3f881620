//! Short blocking calls made from async code (an fsynced RocksDB write, waiting for the
//! index's tag lock, an argon2 check): on the multi-threaded runtime they run in
//! `block_in_place`, which hands this worker's other tasks to another worker first, so
//! one slow disk or one login does not stall unrelated requests. Elsewhere (a blocking
//! thread, a command-line tool, a current-thread test runtime) they simply run.

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
