//! The `fs` backend: published objects as files under `<root>/`, staged objects under
//! `<root>/_staging/`, small puts written through `<root>/_tmp/`, records in an embedded
//! database at `<root>/_records.db` ([`fs_records`](super::fs_records)).
//!
//! Publishing is `link(2)` of a complete, fsynced file to its final name followed by an
//! fsync of the directory: the final name either does not exist or names complete bytes,
//! whatever the moment of a crash. `link` fails with EEXIST instead of replacing, which
//! makes concurrent publishes of the same content safe.

use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use std::io::{Read, Write};

use super::fs_records::RecordDb;
use super::{
    Appended, ByteStream, Level, ObjectKey, ObjectStore, Observer, RecordKey, Segment, StoreError,
    Version,
};

/// Size of the reads that stream a staged upload (published objects are mapped instead,
/// see [`stream_published`]). Above glibc's fixed mmap threshold (main.rs), so each
/// buffer is returned to the kernel when sent: measured, 64 KiB buffers from the heap
/// raised the registry's peak RSS during a 2 GiB read from 18 to 32 MiB.
const READ_CHUNK: usize = 256 * 1024;
/// Chunks in flight between a request and the thread writing them, or between the thread
/// reading (or mapping) a file and the response.
const WRITE_QUEUE: usize = 8;
const READ_QUEUE: usize = 2;

/// Bytes written between requests to start writeback, so the fsync that acknowledges
/// an upload finds little left to write (RocksDB's `bytes_per_sync` does the same).
const WRITEBACK_EVERY: u64 = 8 << 20;

/// Asks the kernel to start writing `len` bytes at `offset` of `file` back to disk,
/// without waiting. Only a hint: durability still comes from the fsync at the end.
fn start_writeback(file: &std::fs::File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: sync_file_range reads no memory of ours; a failure only loses the hint.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// Size of the windows a published object is mapped in to feed a download. Mapped page
/// cache pages count in the registry's resident set while mapped, so this times the
/// windows in flight (the queue, plus the one the connection is writing) bounds a
/// download's memory.
const MAP_WINDOW: u64 = 512 << 10;

/// Streams bytes `range` of the published object `file`, mapped a window at a time by a
/// blocking thread and sent through a bounded channel. The response is written straight
/// from the page cache: no copy into a buffer of ours, no buffer to allocate and fault
/// in (measured on the 2 GiB pull of BENCHMARKS.md: the registry's CPU fell from 1.8 s
/// with `read(2)` into fresh buffers to 0.6 s).
///
/// Each window is populated (`MADV_POPULATE_READ`) before it is sent, so a disk error is
/// reported to this download as an I/O error here, rather than faulting the process later.
///
/// Invariant relied on: a published object is never truncated or written after it is
/// linked into place (`link_durably`), so a mapping of it never loses its pages (which
/// would raise SIGBUS). Staged uploads can be truncated, and are streamed by
/// [`stream_file`] instead.
fn stream_published(file: std::fs::File, range: Range<u64>) -> ByteStream {
    let windows = (range.start..range.end)
        .step_by(MAP_WINDOW as usize)
        .map(move |at| map_window(&file, at, (range.end - at).min(MAP_WINDOW) as usize));
    blocking_stream(windows)
}

/// Streams the items of `pieces`, produced by a blocking thread, through a bounded
/// channel (memory per download: a few pieces). Stops after the first error, which the
/// stream reports, or when the receiver is dropped (the client went away).
fn blocking_stream(pieces: impl Iterator<Item = io::Result<Bytes>> + Send + 'static) -> ByteStream {
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(READ_QUEUE);
    tokio::task::spawn_blocking(move || {
        for piece in pieces {
            let failed = piece.is_err();
            if tx.blocking_send(piece).is_err() || failed {
                return;
            }
        }
    });
    Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

/// `len` bytes of `file` at `offset`, mapped read-only and populated.
fn map_window(file: &std::fs::File, offset: u64, len: usize) -> io::Result<Bytes> {
    // SAFETY: the object is immutable once published (see `stream_published`), so the
    // mapped bytes never change and the mapping never loses its pages.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .offset(offset)
            .len(len)
            .map(file)?
    };
    match map.advise(memmap2::Advice::PopulateRead) {
        Ok(()) => {}
        // Kernels before 5.14 lack MADV_POPULATE_READ: pages then fault in as they are sent.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => return Err(e),
    }
    Ok(Bytes::from_owner(map))
}

/// Streams `len` bytes of `file` from its current position, read by a blocking thread
/// through a bounded channel (memory per download: a few chunks).
fn stream_file(mut file: std::fs::File, len: u64) -> ByteStream {
    let reads = (0..len).step_by(READ_CHUNK).map(move |at| {
        let mut buf = bytes::BytesMut::zeroed((len - at).min(READ_CHUNK as u64) as usize);
        file.read_exact(&mut buf).map(|()| buf.freeze())
    });
    blocking_stream(reads)
}

pub struct FsStore {
    root: PathBuf,
    records: std::sync::Arc<RecordDb>,
    /// Serialise the writes of one record (its compare-and-swap); see [`FsStore::record_lock`].
    record_locks: [tokio::sync::Mutex<()>; RECORD_LOCKS],
}

/// Stripes of record locks. Writes of different records run side by side, so their
/// syncs share the database's group commits: one lock for every record held each
/// write's fsyncs in turn, and under a loaded disk that capped the whole registry at
/// a few dozen record writes a second (pushes, upload sessions and conversions all write
/// records).
const RECORD_LOCKS: usize = 64;

/// A record's version: the sha256 of its bytes.
fn record_version(v: &[u8]) -> Version {
    use sha2::Digest as _;
    Version(hex::encode(sha2::Sha256::digest(v)))
}

/// Written once the catalog records of a store from before
/// [`RecordKey::CATALOG_MARK`] are renamed.
const CATALOG_MARKED: &str = "_records/.catalog-marked";

/// Renames catalog records written without [`RecordKey::CATALOG_MARK`] (a store from an
/// earlier version, where a repository named inside another's name could not be
/// created), once per store.
fn mark_catalog_records(root: &Path) -> io::Result<()> {
    const CATALOG_MARK: &str = RecordKey::CATALOG_MARK;
    let done = root.join(CATALOG_MARKED);
    let catalog = root.join(RecordKey::CATALOG);
    if done.exists() || !catalog.exists() {
        return Ok(());
    }
    let mut stack = vec![catalog];
    while let Some(dir) = stack.pop() {
        let mut renamed = false;
        for e in std::fs::read_dir(&dir)? {
            let e = e?;
            let name = e.file_name().to_string_lossy().into_owned();
            if e.file_type()?.is_dir() {
                stack.push(e.path());
            } else if !name.ends_with(CATALOG_MARK) {
                std::fs::rename(e.path(), dir.join(format!("{name}{CATALOG_MARK}")))?;
                renamed = true;
            }
        }
        if renamed {
            std::fs::File::open(&dir)?.sync_all()?;
        }
    }
    std::fs::File::create(&done)?.sync_all()?;
    std::fs::File::open(root.join("_records"))?.sync_all()
}

/// Every file under `root` whose path relative to `root` starts with `prefix`, sorted,
/// with its size when `sizes` (0 otherwise: no stat per file).
async fn walk(
    root: PathBuf,
    prefix: String,
    sizes: bool,
) -> Result<Vec<(String, u64)>, StoreError> {
    tokio::task::spawn_blocking(move || {
        let top = prefix.rfind('/').map_or("", |i| &prefix[..=i]);
        let mut out = Vec::new();
        let mut stack = vec![top.to_string()];
        while let Some(dir) = stack.pop() {
            let level = read_level(&root, &dir, sizes)?;
            stack.extend(
                (level.prefixes.into_iter())
                    .filter(|p| p.starts_with(&prefix) || prefix.starts_with(p.as_str())),
            );
            out.extend(
                level
                    .keys
                    .into_iter()
                    .filter(|(k, _)| k.starts_with(&prefix)),
            );
        }
        out.sort();
        Ok(out)
    })
    .await
    .map_err(not_finished)?
}

/// The files (with their sizes when `sizes`, 0 otherwise: no stat per file) and
/// directories directly in directory `dir` of `root` (`dir` empty, or ending in `/`),
/// named relative to `root`, in byte order; nothing when `dir` does not exist. Blocking.
fn read_level(root: &Path, dir: &str, sizes: bool) -> Result<Level, StoreError> {
    let path = root.join(dir);
    let what = || path.display().to_string();
    let mut level = Level::default();
    let rd = match std::fs::read_dir(&path) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(level),
        Err(e) => return Err(StoreError::io(what(), e)),
    };
    for e in rd {
        let e = e.map_err(|e| StoreError::io(what(), e))?;
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            level.prefixes.push(format!("{dir}{name}/"));
            continue;
        }
        let size = match e.metadata() {
            _ if !sizes => 0,
            Ok(m) => m.len(),
            // Gone since the directory was read (a temporary name).
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(StoreError::io(what(), e)),
        };
        level.keys.push((format!("{dir}{name}"), size));
    }
    level.keys.sort();
    level.prefixes.sort();
    Ok(level)
}

impl FsStore {
    /// Opens (creating if needed) a store rooted at `root`.
    pub fn open(root: impl Into<PathBuf>) -> Result<FsStore, StoreError> {
        let root = root.into();
        for d in ["_staging", "_tmp", "blobs"] {
            let p = root.join(d);
            std::fs::create_dir_all(&p).map_err(|e| StoreError::io(p.display().to_string(), e))?;
        }
        mark_catalog_records(&root)
            .map_err(|e| StoreError::io("renaming catalog records (one-time upgrade)", e))?;
        let records = std::sync::Arc::new(RecordDb::open(&root)?);
        Ok(FsStore {
            root,
            records,
            record_locks: std::array::from_fn(|_| tokio::sync::Mutex::new(())),
        })
    }

    /// The lock serialising writes of record `key`: held across read-compare-rename, it
    /// makes a put a compare-and-swap (one process owns an fs store).
    async fn record_lock(&self, key: &RecordKey) -> tokio::sync::MutexGuard<'_, ()> {
        self.record_locks[crate::stripes::stripe_of(key.as_str().as_bytes(), RECORD_LOCKS)]
            .lock()
            .await
    }

    fn path(&self, key: &ObjectKey) -> PathBuf {
        self.root.join(key.as_str())
    }

    fn staged(&self, id: &str) -> Result<PathBuf, StoreError> {
        if !amber_oci::names::upload_id_ok(id) {
            return Err(StoreError::NotFound(format!("staged upload {id:?}")));
        }
        Ok(self.root.join("_staging").join(id))
    }

    /// Staged object `id`, opened, once it is checked to hold at least `len` bytes; with
    /// `cut`, anything past `len` is removed (durably) first.
    async fn staged_holding(
        &self,
        id: &str,
        len: u64,
        cut: bool,
    ) -> Result<std::fs::File, StoreError> {
        let path = self.staged(id)?;
        let what = format!("staged upload {id}");
        let id = id.to_string();
        tokio::task::spawn_blocking(move || {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(cut)
                .open(&path)
                .map_err(|e| not_found_or_io(what.clone(), e))?;
            let actual = f
                .metadata()
                .map_err(|e| StoreError::io(what.as_str(), e))?
                .len();
            if actual < len {
                return Err(StoreError::OffsetMismatch {
                    id,
                    expected: len,
                    actual,
                });
            }
            if cut && actual > len {
                f.set_len(len)
                    .map_err(|e| StoreError::io(what.as_str(), e))?;
                f.sync_all().map_err(|e| StoreError::io(what.as_str(), e))?;
            }
            Ok(f)
        })
        .await
        .map_err(not_finished)?
    }

    /// Links complete file `src` to `dst` (no replace), then makes the link durable.
    async fn link_durably(&self, src: &Path, dst: &Path) -> Result<(), StoreError> {
        let (src, dst) = (src.to_path_buf(), dst.to_path_buf());
        tokio::task::spawn_blocking(move || link_file(&src, &dst, Durability::Durable))
            .await
            .map_err(not_finished)?
    }
}

/// Whether a put makes the object durable before it returns (`Durable`), or leaves that
/// to a later `syncfs` (`Batched`: `ObjectStore::put_batched`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Durability {
    Durable,
    Batched,
}

/// Publishes `data` as the object at `dst` under store `root`, unless it exists: written
/// to a file of its own under `_tmp` (fsynced when `Durable`), then linked (`link_file`).
/// A reader never sees the object partial. Blocking.
fn put_file(
    root: &Path,
    dst: &Path,
    data: &[u8],
    name: &str,
    durability: Durability,
) -> Result<(), StoreError> {
    if dst.try_exists().unwrap_or(false) {
        return Ok(());
    }
    let tmp = write_tmp(root, data, name, durability)?;
    let res = link_file(&tmp, dst, durability);
    let _ = std::fs::remove_file(&tmp);
    res
}

/// Publishes `data` at `dst` (no replace), not synced: written to an unnamed file in
/// `dst`'s directory (`O_TMPFILE`), then linked under its name, so a reader never sees
/// it partial and no name is created and removed in `_tmp` (one directory that every
/// chunk write of every conversion locked twice). `Ok(false)`: this file system or
/// kernel cannot, nothing was published. Blocking.
fn put_unnamed(dst: &Path, data: &[u8]) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = dst.parent().expect("object keys have a parent");
    let open = || {
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .mode(0o644)
            .open(dir)
    };
    // The directory is made only when missing: most puts land in one that exists.
    let opened = match open() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir)?;
            open()
        }
        other => other,
    };
    let mut f = match opened {
        Ok(f) => f,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
            ) =>
        {
            return Ok(false)
        }
        Err(e) => return Err(e),
    };
    f.write_all(data)?;
    let from = std::ffi::CString::new(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .expect("no NUL in a number");
    let to = std::ffi::CString::new(dst.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in an object path"))?;
    // SAFETY: both paths are NUL-terminated strings that live across the call.
    let linked = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if linked == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        // Another writer published the same content first.
        io::ErrorKind::AlreadyExists => Ok(true),
        // No /proc to name the unnamed file by.
        io::ErrorKind::NotFound if !Path::new("/proc/self/fd").exists() => Ok(false),
        _ => Err(e),
    }
}

/// `data` in a new file under `root`/_tmp (fsynced when `Durable`); its path. Blocking.
fn write_tmp(
    root: &Path,
    data: &[u8],
    name: &str,
    durability: Durability,
) -> Result<PathBuf, StoreError> {
    let tmp = root.join("_tmp").join(uuid::Uuid::new_v4().to_string());
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        match durability {
            Durability::Durable => f.sync_all(),
            Durability::Batched => Ok(()),
        }
    })();
    written.map(|()| tmp.clone()).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        StoreError::io(format!("temporary object for {name}"), e)
    })
}

/// Links complete file `src` to `dst` (no replace: an existing `dst` has the same
/// bytes), then, when `Durable`, fsyncs `dst`'s directory so the link survives a crash.
/// Blocking.
fn link_file(src: &Path, dst: &Path, durability: Durability) -> Result<(), StoreError> {
    let dir = dst.parent().expect("object keys have a parent");
    std::fs::create_dir_all(dir).map_err(|e| StoreError::io(dir.display().to_string(), e))?;
    match std::fs::hard_link(src, dst) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(StoreError::io(dst.display().to_string(), e)),
    }
    match durability {
        Durability::Durable => sync_dir(dir),
        Durability::Batched => Ok(()),
    }
}

/// fsync of directory `dir` (makes the names linked or renamed in it durable).
fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io("fsync of object directory", e))
}

/// Files up to this size are read on the calling thread (see [`read_whole`]).
const INLINE_READ_MAX: u64 = 1 << 20;

/// Reads a whole file: a small one (a record, a manifest, a config) on the calling
/// thread, an async worker included; a larger one (a block-manifest envelope of a big
/// image) in the blocking pool. A round trip through the blocking pool (`tokio::fs`) or
/// `block_in_place` costs more than reading a small file in the page cache: manifest
/// GETs by tag (two such reads each) went from 26,500 to 44,000 a second with 64
/// connections, p99 4.8 -> 3.7 ms (`block_in_place`: 38,800 a second, p99 10.7 ms).
/// The price: a page-cache miss holds one worker for one small read of the local disk.
async fn read_whole(path: PathBuf) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut f = std::fs::File::open(&path)?;
    let len = f.metadata()?.len();
    let read = move |f: &mut std::fs::File| -> io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(len as usize);
        f.read_to_end(&mut out)?;
        Ok(out)
    };
    if len <= INLINE_READ_MAX {
        read(&mut f)
    } else {
        tokio::task::spawn_blocking(move || read(&mut f))
            .await
            .map_err(|e| io::Error::other(not_finished(e)))?
    }
}

fn not_found_or_io(what: String, e: io::Error) -> StoreError {
    if e.kind() == io::ErrorKind::NotFound {
        StoreError::NotFound(what)
    } else {
        StoreError::io(what, e)
    }
}

#[async_trait]
impl ObjectStore for FsStore {
    async fn stat(&self, key: &ObjectKey) -> Result<Option<u64>, StoreError> {
        match tokio::fs::metadata(self.path(key)).await {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io(key.as_str(), e)),
        }
    }

    async fn read(&self, key: &ObjectKey, range: Range<u64>) -> Result<ByteStream, StoreError> {
        let path = self.path(key);
        let name = key.as_str().to_string();
        let wanted = range.clone();
        let file = tokio::task::spawn_blocking(move || -> Result<std::fs::File, StoreError> {
            let range = wanted;
            let f = std::fs::File::open(&path).map_err(|e| not_found_or_io(name.clone(), e))?;
            let size = f
                .metadata()
                .map_err(|e| StoreError::io(name.as_str(), e))?
                .len();
            if range.start > range.end || range.end > size {
                return Err(StoreError::BadRange {
                    key: name,
                    start: range.start,
                    end: range.end,
                    size,
                });
            }
            Ok(f)
        })
        .await
        .map_err(not_finished)??;
        Ok(stream_published(file, range))
    }

    async fn read_all(&self, key: &ObjectKey) -> Result<Bytes, StoreError> {
        read_whole(self.path(key))
            .await
            .map(Bytes::from)
            .map_err(|e| not_found_or_io(key.as_str().to_string(), e))
    }

    async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), StoreError> {
        let (root, dst, name) = (self.root.clone(), self.path(key), key.as_str().to_string());
        tokio::task::spawn_blocking(move || {
            put_file(&root, &dst, &data, &name, Durability::Durable)
        })
        .await
        .map_err(not_finished)?
    }

    async fn put_replacing(&self, key: &ObjectKey, data: Bytes) -> Result<(), StoreError> {
        let (root, dst, name) = (self.root.clone(), self.path(key), key.as_str().to_string());
        tokio::task::spawn_blocking(move || {
            let tmp = write_tmp(&root, &data, &name, Durability::Durable)?;
            let dir = dst.parent().expect("object keys have a parent");
            // rename(2) replaces atomically: an open (or mapped) old file keeps its bytes.
            let res = std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::rename(&tmp, &dst))
                .map_err(|e| StoreError::io(dst.display().to_string(), e))
                .and_then(|()| sync_dir(dir));
            if res.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            res
        })
        .await
        .map_err(not_finished)?
    }

    fn stat_blocking(
        &self,
        _: &tokio::runtime::Handle,
        key: &ObjectKey,
    ) -> Result<Option<u64>, StoreError> {
        match std::fs::metadata(self.path(key)) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io(key.as_str(), e)),
        }
    }

    fn put_blocking(
        &self,
        _: &tokio::runtime::Handle,
        key: &ObjectKey,
        data: Bytes,
    ) -> Result<(), StoreError> {
        put_file(
            &self.root,
            &self.path(key),
            &data,
            key.as_str(),
            Durability::Durable,
        )
    }

    fn put_batched(
        &self,
        _: &tokio::runtime::Handle,
        key: &ObjectKey,
        data: Bytes,
    ) -> Result<(), StoreError> {
        // No existence check first: the caller (a conversion) has just looked, and a
        // link over an existing name leaves it as it is.
        let dst = self.path(key);
        match put_unnamed(&dst, &data) {
            Ok(true) => Ok(()),
            // No O_TMPFILE here (an old kernel, a file system without it) or no /proc:
            // through a named file in `_tmp`.
            Ok(false) => put_file(&self.root, &dst, &data, key.as_str(), Durability::Batched),
            Err(e) => Err(StoreError::io(dst.display().to_string(), e)),
        }
    }

    /// One `syncfs(2)` of the store's file system: every file written and every name
    /// linked before it is durable when it returns (it also writes back whatever else is
    /// dirty on that file system, such as conversions' scratch files).
    fn sync_batch(&self, _: &tokio::runtime::Handle) -> Result<(), StoreError> {
        use std::os::fd::AsRawFd;
        let root = std::fs::File::open(&self.root)
            .map_err(|e| StoreError::io(self.root.display().to_string(), e))?;
        // SAFETY: syncfs only reads the descriptor, which `root` keeps open.
        if unsafe { libc::syncfs(root.as_raw_fd()) } != 0 {
            return Err(StoreError::io(
                "syncfs of the store's file system",
                io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    fn batched_may_be_short(&self) -> bool {
        true
    }

    async fn append_staged(
        &self,
        id: &str,
        offset: u64,
        body: ByteStream,
        len: Option<u64>,
        observe: Observer<'_>,
    ) -> Result<Appended, StoreError> {
        let mut body = match len {
            Some(n) => super::exactly(body, n),
            None => body,
        };
        let path = self.staged(id)?;
        let what = format!("staged upload {id}");
        // The file is written by one blocking thread fed through a small bounded channel:
        // memory per upload is a few request chunks, whatever the blob size.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(WRITE_QUEUE);
        let id_owned = id.to_string();
        let writer = tokio::task::spawn_blocking(move || -> Result<u64, StoreError> {
            let mut f = std::fs::OpenOptions::new()
                .create(offset == 0)
                .append(true)
                .open(&path)
                .map_err(|e| not_found_or_io(what.clone(), e))?;
            let actual = f
                .metadata()
                .map_err(|e| StoreError::io(what.as_str(), e))?
                .len();
            if actual < offset {
                return Err(StoreError::OffsetMismatch {
                    id: id_owned,
                    expected: offset,
                    actual,
                });
            }
            if actual > offset {
                // Bytes of a request that never finished: appends go after `offset`.
                f.set_len(offset)
                    .map_err(|e| StoreError::io(what.as_str(), e))?;
            }
            let mut len = offset;
            let mut synced = offset;
            while let Some(chunk) = rx.blocking_recv() {
                f.write_all(&chunk)
                    .map_err(|e| StoreError::io(what.as_str(), e))?;
                len += chunk.len() as u64;
                if len - synced >= WRITEBACK_EVERY {
                    start_writeback(&f, synced, len - synced);
                    synced = len;
                }
            }
            f.sync_data()
                .map_err(|e| StoreError::io(what.as_str(), e))?;
            Ok(len)
        });
        let mut body_error = None;
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(chunk) => {
                    observe(&chunk);
                    if tx.send(chunk).await.is_err() {
                        break; // the writer stopped; its error is reported below
                    }
                }
                Err(e) => {
                    body_error = Some(e);
                    break;
                }
            }
        }
        drop(tx);
        let len = writer.await.map_err(not_finished)??;
        match body_error {
            Some(e) => Err(StoreError::Body(e)),
            // One file per session, written by this process alone: a segment needs no name.
            None => Ok(Appended {
                len,
                segment: (len > offset).then(|| Segment {
                    start: offset,
                    name: String::new(),
                }),
            }),
        }
    }

    async fn discard_segment(&self, id: &str, segment: &Segment) -> Result<(), StoreError> {
        match self.truncate_staged(id, segment.start).await {
            Err(StoreError::NotFound(_)) => Ok(()),
            other => other,
        }
    }

    async fn staged_len(&self, id: &str) -> Result<Option<u64>, StoreError> {
        match tokio::fs::metadata(self.staged(id)?).await {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io(format!("staged upload {id}"), e)),
        }
    }

    async fn truncate_staged(&self, id: &str, len: u64) -> Result<(), StoreError> {
        let f = tokio::fs::OpenOptions::new()
            .write(true)
            .open(self.staged(id)?)
            .await
            .map_err(|e| not_found_or_io(format!("staged upload {id}"), e))?;
        f.set_len(len)
            .await
            .map_err(|e| StoreError::io(format!("staged upload {id}"), e))?;
        f.sync_all()
            .await
            .map_err(|e| StoreError::io(format!("staged upload {id}"), e))
    }

    async fn read_staged(
        &self,
        id: &str,
        _segments: &[Segment],
        len: u64,
    ) -> Result<ByteStream, StoreError> {
        let f = self.staged_holding(id, len, false).await?;
        Ok(stream_file(f, len))
    }

    async fn publish_staged(
        &self,
        id: &str,
        _segments: &[Segment],
        len: u64,
        key: &ObjectKey,
    ) -> Result<(), StoreError> {
        // Cut off what a request that never finished left past `len`; the data up to
        // `len` was fsynced by append_staged. Link it into place, then drop the staging name.
        self.staged_holding(id, len, true).await?;
        self.link_durably(&self.staged(id)?, &self.path(key))
            .await?;
        self.remove_staged(id, &[]).await
    }

    async fn remove(&self, key: &ObjectKey) -> Result<(), StoreError> {
        match tokio::fs::remove_file(self.path(key)).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(key.as_str(), e)),
        }
    }

    async fn remove_staged(&self, id: &str, _segments: &[Segment]) -> Result<(), StoreError> {
        match tokio::fs::remove_file(self.staged(id)?).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(format!("staged upload {id}"), e)),
        }
    }

    async fn list_staged(&self) -> Result<Vec<String>, StoreError> {
        let mut out = Vec::new();
        let dir = self.root.join("_staging");
        let mut rd = tokio::fs::read_dir(&dir)
            .await
            .map_err(|e| StoreError::io(dir.display().to_string(), e))?;
        while let Some(e) = rd
            .next_entry()
            .await
            .map_err(|e| StoreError::io("staging dir", e))?
        {
            if let Some(name) = e.file_name().to_str() {
                out.push(name.to_string());
            }
        }
        out.sort();
        Ok(out)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectKey>, StoreError> {
        Ok(self
            .list_sizes(prefix)
            .await?
            .into_iter()
            .map(|(k, _)| k)
            .collect())
    }

    async fn list_sizes(&self, prefix: &str) -> Result<Vec<(ObjectKey, u64)>, StoreError> {
        let top = prefix.split('/').next().unwrap_or("");
        if top.is_empty() || top.starts_with('_') || top.contains("..") {
            return Ok(Vec::new());
        }
        Ok(walk(self.root.clone(), prefix.to_string(), true)
            .await?
            .into_iter()
            .map(|(k, n)| (ObjectKey(k), n))
            .collect())
    }

    async fn list_level(&self, prefix: &str) -> Result<Level, StoreError> {
        if !super::level_prefix_ok(prefix) {
            return Ok(Level::default());
        }
        let (root, prefix) = (self.root.clone(), prefix.to_string());
        let records = self.records.clone();
        tokio::task::spawn_blocking(move || {
            if prefix.starts_with(RecordKey::ALL) {
                records.level(&prefix)
            } else {
                read_level(&root, &prefix, true)
            }
        })
        .await
        .map_err(not_finished)?
    }

    async fn get_record(&self, key: &RecordKey) -> Result<Option<(Bytes, Version)>, StoreError> {
        Ok(self.records.get(key.as_str())?.map(|v| {
            let version = record_version(&v);
            (v, version)
        }))
    }

    async fn put_record(
        &self,
        key: &RecordKey,
        value: Bytes,
        expected: Option<&Version>,
    ) -> Result<Option<Version>, StoreError> {
        let _guard = self.record_lock(key).await;
        let current = self.get_record(key).await?.map(|(_, v)| v);
        if current.as_ref() != expected {
            return Ok(None);
        }
        let version = record_version(&value);
        let (records, key) = (self.records.clone(), key.as_str().to_string());
        tokio::task::spawn_blocking(move || records.put(&key, value))
            .await
            .map_err(not_finished)??;
        Ok(Some(version))
    }

    async fn delete_record(&self, key: &RecordKey) -> Result<(), StoreError> {
        let _guard = self.record_lock(key).await;
        let (records, key) = (self.records.clone(), key.as_str().to_string());
        tokio::task::spawn_blocking(move || records.delete(&key))
            .await
            .map_err(not_finished)?
    }

    async fn list_records(&self, prefix: &str) -> Result<Vec<RecordKey>, StoreError> {
        self.list_records_page(prefix, None, usize::MAX).await
    }

    async fn list_records_page(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecordKey>, StoreError> {
        if !prefix.starts_with(RecordKey::ALL) || prefix.contains("..") {
            return Ok(Vec::new());
        }
        let from = after.map(|a| format!("{prefix}{a}{}", super::after_mark(prefix)));
        let (records, prefix) = (self.records.clone(), prefix.to_string());
        let listed =
            tokio::task::spawn_blocking(move || records.range(&prefix, from.as_deref(), limit))
                .await
                .map_err(not_finished)??;
        Ok(listed
            .iter()
            .filter_map(|(k, _)| RecordKey::parse(k))
            .collect())
    }
}

/// A blocking task that did not finish: a panic goes on unwinding; a task the runtime
/// cancelled (it is shutting down) fails the operation instead of panicking here.
fn not_finished(e: tokio::task::JoinError) -> StoreError {
    match e.try_into_panic() {
        Ok(panic) => std::panic::resume_unwind(panic),
        Err(e) => StoreError::io(
            "a blocking store task".to_string(),
            io::Error::new(
                io::ErrorKind::Interrupted,
                format!("not run: {e} (shutting down)"),
            ),
        ),
    }
}

/// Removes leftovers of interrupted small puts (never visible as objects).
pub fn clean_tmp(root: &Path) -> io::Result<usize> {
    let mut n = 0;
    for e in std::fs::read_dir(root.join("_tmp"))? {
        std::fs::remove_file(e?.path())?;
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    /// A store from before catalog records had their mark: its records are renamed once
    /// at open, and a repository under an old one's name can then be created.
    #[tokio::test]
    async fn catalog_records_of_an_older_store_are_renamed_once() {
        use super::super::{ObjectStore, RecordKey};
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("_records/catalog/team/app");
        std::fs::create_dir_all(old.parent().unwrap()).unwrap();
        std::fs::write(&old, b"").unwrap();
        let store = super::FsStore::open(dir.path()).unwrap();
        assert!(!old.exists());
        let repo = |n| RecordKey::repo(&amber_oci::names::RepoName::parse(n).unwrap());
        assert!(store.get_record(&repo("team/app")).await.unwrap().is_some());
        assert!(store
            .put_record(&repo("team/app/web"), bytes::Bytes::new(), None)
            .await
            .unwrap()
            .is_some());
        assert_eq!(
            store.list_records(RecordKey::CATALOG).await.unwrap(),
            vec![repo("team/app"), repo("team/app/web")]
        );
    }

    /// The record files of a store from before the records database are imported at
    /// open, values unchanged, and removed; what was imported before stays.
    #[tokio::test]
    async fn record_files_of_an_older_store_are_imported() {
        use super::super::{ObjectStore, RecordKey};
        let dir = tempfile::tempdir().unwrap();
        let files = [
            ("_records/repos/team/app/_tags/v1", "sha256:aa"),
            ("_records/repos/team/app/_manifests/sha256:aa", "{}"),
            (
                "_records/uploads/0000aaaa-0000-0000-0000-000000000001",
                "{\"offset\":0}",
            ),
            ("_records/.catalog-marked", ""),
        ];
        for (k, v) in files {
            let p = dir.path().join(k);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, v).unwrap();
        }
        let store = super::FsStore::open(dir.path()).unwrap();
        assert!(!dir.path().join("_records").exists());
        for (k, v) in &files[..3] {
            let (got, _) = store
                .get_record(&RecordKey::parse(k).unwrap())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(got, v.as_bytes(), "{k}");
        }
        assert_eq!(store.list_records(RecordKey::ALL).await.unwrap().len(), 3);
        // A store opened again (a file an older registry wrote meanwhile) keeps both.
        drop(store);
        let late = dir
            .path()
            .join("_records/uploads/0000aaaa-0000-0000-0000-000000000002");
        std::fs::create_dir_all(late.parent().unwrap()).unwrap();
        std::fs::write(&late, "{}").unwrap();
        let store = super::FsStore::open(dir.path()).unwrap();
        assert_eq!(
            store.list_records(RecordKey::UPLOADS).await.unwrap().len(),
            2
        );
        // One process owns an fs store: a second open is refused, with its path.
        let e = super::FsStore::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("_records.db"), "{e}");
    }

    /// The blocking put and stat (a conversion's) are the async ones, on the caller's
    /// thread: create-once, durable names, nothing left in `_tmp`.
    #[test]
    fn blocking_puts_and_stats_are_the_async_ones() {
        use super::super::{ObjectKey, ObjectStore};
        use bytes::Bytes;
        let dir = tempfile::tempdir().unwrap();
        let store = super::FsStore::open(dir.path()).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let key = ObjectKey::chunk(&amber_oci::env::ChunkId::of(b"blocking"));
        assert_eq!(store.stat_blocking(rt.handle(), &key).unwrap(), None);
        store
            .put_blocking(rt.handle(), &key, Bytes::from_static(b"bytes"))
            .unwrap();
        store
            .put_blocking(rt.handle(), &key, Bytes::from_static(b"other"))
            .unwrap();
        assert_eq!(store.stat_blocking(rt.handle(), &key).unwrap(), Some(5));
        assert_eq!(&rt.block_on(store.read_all(&key)).unwrap()[..], b"bytes");
        assert_eq!(
            std::fs::read_dir(dir.path().join("_tmp")).unwrap().count(),
            0
        );
    }

    /// A batched put is readable at once and create-once like any put, leaves nothing in
    /// `_tmp`, and a sync of the batch succeeds; the store says a crash could cut such
    /// an object short (so a conversion checks one it has no record of).
    #[test]
    fn batched_puts_are_readable_at_once_and_synced_together() {
        use super::super::{ObjectKey, ObjectStore};
        use bytes::Bytes;
        let dir = tempfile::tempdir().unwrap();
        let store = super::FsStore::open(dir.path()).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let keys: Vec<ObjectKey> = (0..3u8)
            .map(|i| ObjectKey::chunk(&amber_oci::env::ChunkId::of(&[i])))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            store
                .put_batched(rt.handle(), key, Bytes::from(vec![i as u8; 10 + i]))
                .unwrap();
            assert_eq!(
                store.stat_blocking(rt.handle(), key).unwrap(),
                Some(10 + i as u64)
            );
        }
        store
            .put_batched(rt.handle(), &keys[0], Bytes::from_static(b"other"))
            .unwrap();
        assert_eq!(
            &rt.block_on(store.read_all(&keys[0])).unwrap()[..],
            &[0u8; 10]
        );
        store.sync_batch(rt.handle()).unwrap();
        assert!(store.batched_may_be_short());
        assert_eq!(
            std::fs::read_dir(dir.path().join("_tmp")).unwrap().count(),
            0
        );
    }

    #[tokio::test]
    async fn fs_backend_passes_the_store_suite() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::FsStore::open(dir.path()).unwrap();
        super::super::suite::run(&store).await;
    }
}
