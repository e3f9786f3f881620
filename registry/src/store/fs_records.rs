//! The records of the `fs` backend (`_records/…`: repositories, manifests, tags, blob
//! links, referrers, conversions, work items, upload sessions), kept in an embedded
//! RocksDB database at `<root>/_records.db` instead of a file each.
//!
//! A file per record made every image about ten files of a few dozen bytes each (12 files
//! and 12 KiB of metadata per image at 100,000 images, most of it file-system blocks and
//! inodes), and every record write two fsyncs (the file and its directory). Here a record
//! is a key and a value in a log-structured table: written with the write-ahead log
//! synced (concurrent writers share one fsync), compressed where it settles, and listed
//! by seeking in key order.
//!
//! The records read lately are held in memory (`RECORD_CACHE`): a tag read is then a
//! hash lookup instead of a search of every table of the database that may hold its key
//! (a quarter of the registry's CPU in manifest GETs by tag).
//!
//! Invariants kept here:
//! - keys are record names exactly as the other backends name them (`_records/…`), so
//!   byte order of keys is the order listings promise, and the levels of a listing are
//!   the `/`-separated parts of a name;
//! - a write returns once it is durable (WAL synced); readers see the old value or the
//!   new one;
//! - the records held in memory are the database's: every write goes through `put` or
//!   `delete`, which update the memory after the database (`crate::bytes_cache` says why a
//!   read racing a write cannot leave the old value behind); the import at open runs
//!   before anything is read;
//! - record files of a store from before this database (`<root>/_records/…`) are
//!   imported at open, synced, and only then removed: a crash in between imports them
//!   again (the same values) at the next open. Nothing is served before the import ends.
//!
//! Compare-and-swap is the caller's (`FsStore::put_record`, under its record locks: one
//! process owns an fs store, and RocksDB's lock file refuses a second).

use std::path::{Path, PathBuf};

use bytes::Bytes;
use rocksdb::{Options, WriteBatch, WriteOptions, DB};

use super::{Level, StoreError};
use crate::bytes_cache::BytesCache;
use crate::index::OpenDb;

/// The database's directory under the store's root.
pub const DIR: &str = "_records.db";
/// Where a store from before this database kept a file per record.
const LEGACY_DIR: &str = "_records";
/// Written by an older store once its catalog records were renamed; not a record.
const LEGACY_CATALOG_MARKED: &str = "_records/.catalog-marked";
/// Memtable memory (records are small: a push writes a few hundred bytes of them).
/// RocksDB preallocates each write-ahead log file at about this size, so that a record
/// write still lands when the disk fills: it is taken from the disk at open.
const WRITE_BUFFER: usize = 4 << 20;
/// Write-ahead log kept before the memtable is flushed to make it go.
const WAL_BUDGET: u64 = 32 << 20;
/// Block cache: the tables' data, index and bloom filter blocks that reads use.
const BLOCK_CACHE: usize = 32 << 20;
/// Records held in memory, in bytes (keys, values, and their bookkeeping): about 70,000
/// tags of task images.
const RECORD_CACHE: usize = 16 << 20;
/// Records imported from files per synced batch.
const IMPORT_BATCH: usize = 4096;

pub struct RecordDb {
    db: DB,
    /// The records read or written lately (see the module's invariants).
    held: BytesCache<String>,
    _open: OpenDb,
}

fn held(budget: usize) -> BytesCache<String> {
    BytesCache::new(budget, |k| std::mem::size_of::<String>() + k.len())
}

fn db_err(what: impl Into<String>, e: rocksdb::Error) -> StoreError {
    StoreError::io(what, std::io::Error::other(e.into_string()))
}

fn synced() -> WriteOptions {
    let mut w = WriteOptions::default();
    w.set_sync(true);
    w
}

/// The smallest key after every key that starts with `child` (a prefix ending in `/`):
/// its last byte raised by one (`/` + 1 = `0`).
fn past(child: &str) -> Vec<u8> {
    let mut k = child.as_bytes().to_vec();
    if let Some(last) = k.last_mut() {
        *last += 1;
    }
    k
}

impl RecordDb {
    /// Opens (creating if needed) the records of the store at `root`, importing the record
    /// files of an older store first. Blocking.
    pub fn open(root: &Path) -> Result<RecordDb, StoreError> {
        let path = root.join(DIR);
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.set_write_buffer_size(WRITE_BUFFER);
        opts.set_max_total_wal_size(WAL_BUDGET);
        crate::index::lookup_db(&mut opts, BLOCK_CACHE)
            .map_err(|e| db_err("records database block cache", e))?;
        let db = DB::open(&opts, &path)
            .map_err(|e| db_err(format!("records database {}", path.display()), e))?;
        let records = RecordDb {
            db,
            held: held(RECORD_CACHE),
            _open: OpenDb::counted(),
        };
        records.import_files(root)?;
        Ok(records)
    }

    /// Opens the records of the store at `root` to read them while the process that owns
    /// the store runs (inspection, tests): what was written up to now, no writes.
    pub fn read_only(root: &Path) -> Result<RecordDb, StoreError> {
        let path = root.join(DIR);
        let db = DB::open_for_read_only(&Options::default(), &path, false)
            .map_err(|e| db_err(format!("records database {}", path.display()), e))?;
        Ok(RecordDb {
            db,
            // Read by another process while it writes: what is held here would go stale.
            held: held(0),
            _open: OpenDb::counted(),
        })
    }

    /// The value of record `key`.
    pub fn get(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.held.get_or_read(key, || {
            // Not held: a lookup, on this thread (see `crate::blocking`).
            Ok(self
                .db
                .get(key.as_bytes())
                .map_err(|e| db_err(format!("reading record {key}"), e))?
                .map(Bytes::from))
        })
    }

    /// Writes record `key`, durably. Blocking (an fsync).
    pub fn put(&self, key: &str, value: Bytes) -> Result<(), StoreError> {
        self.db
            .put_opt(key.as_bytes(), &value, &synced())
            .map_err(|e| db_err(format!("writing record {key}"), e))?;
        self.held.set(key.to_string(), value);
        Ok(())
    }

    /// Removes record `key`, durably; removing a missing one is not an error. Blocking.
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.db
            .delete_opt(key.as_bytes(), &synced())
            .map_err(|e| db_err(format!("removing record {key}"), e))?;
        self.held.remove(key);
        Ok(())
    }

    /// Records whose keys start with `prefix`, from the first key above `from` (or the
    /// prefix's first), in byte order, at most `limit`, with their values' lengths.
    pub fn range(
        &self,
        prefix: &str,
        from: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        let mut out = Vec::new();
        let mut it = self.db.raw_iterator();
        it.seek(from.unwrap_or(prefix));
        if from.is_some_and(|f| it.key() == Some(f.as_bytes())) {
            it.next();
        }
        while out.len() < limit {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            if !k.starts_with(prefix.as_bytes()) {
                break;
            }
            if let Ok(k) = std::str::from_utf8(k) {
                out.push((k.to_string(), v.len() as u64));
            }
            it.next();
        }
        it.status()
            .map_err(|e| db_err(format!("listing records {prefix}"), e))?;
        Ok(out)
    }

    /// One level of the record tree under `prefix` (ending in `/`): the records directly
    /// under it with their values' lengths, and the prefixes one level down. One seek per
    /// entry of the level, however many records lie below it.
    pub fn level(&self, prefix: &str) -> Result<Level, StoreError> {
        let mut level = Level::default();
        let mut it = self.db.raw_iterator();
        it.seek(prefix);
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            if !k.starts_with(prefix.as_bytes()) {
                break;
            }
            let Ok(key) = std::str::from_utf8(k) else {
                it.next();
                continue;
            };
            match key[prefix.len()..].find('/') {
                Some(slash) => {
                    let child = &key[..prefix.len() + slash + 1];
                    level.prefixes.push(child.to_string());
                    let after = past(child);
                    it.seek(&after);
                }
                None => {
                    level.keys.push((key.to_string(), v.len() as u64));
                    it.next();
                }
            }
        }
        it.status()
            .map_err(|e| db_err(format!("listing records {prefix}"), e))?;
        Ok(level)
    }

    /// Writes every record as a file under `into`, named by its key (`_records/…`, the
    /// keys an S3 store gives its record objects); returns how many. Blocking.
    pub fn export_files(&self, into: &Path) -> Result<usize, StoreError> {
        let mut n = 0;
        let mut it = self.db.raw_iterator();
        it.seek(super::RecordKey::ALL);
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            let Some(key) = std::str::from_utf8(k)
                .ok()
                .and_then(super::RecordKey::parse)
            else {
                break;
            };
            let path = into.join(key.as_str());
            let what = || path.display().to_string();
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| StoreError::io(what(), e))?;
            }
            std::fs::write(&path, v).map_err(|e| StoreError::io(what(), e))?;
            n += 1;
            it.next();
        }
        it.status()
            .map_err(|e| db_err("reading records to export", e))?;
        Ok(n)
    }

    /// Moves the record files of a store from before this database into it: every file
    /// under `<root>/_records/` becomes the record of its path, in synced batches; then
    /// the files go. Blocking; run at open, before anything is served.
    fn import_files(&self, root: &Path) -> Result<(), StoreError> {
        let legacy = root.join(LEGACY_DIR);
        if !legacy.exists() {
            return Ok(());
        }
        let what = |p: &Path| p.display().to_string();
        let mut files: Vec<(String, PathBuf)> = Vec::new();
        let mut stack = vec![legacy.clone()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).map_err(|e| StoreError::io(what(&dir), e))? {
                let e = e.map_err(|e| StoreError::io(what(&dir), e))?;
                let path = e.path();
                let is_dir = e
                    .file_type()
                    .map_err(|e| StoreError::io(what(&path), e))?
                    .is_dir();
                if is_dir {
                    stack.push(path);
                    continue;
                }
                let Some(key) = path
                    .strip_prefix(root)
                    .ok()
                    .and_then(|k| k.to_str())
                    .map(str::to_string)
                else {
                    continue;
                };
                if key != LEGACY_CATALOG_MARKED && super::RecordKey::parse(&key).is_some() {
                    files.push((key, path));
                }
            }
        }
        let n = files.len();
        for batch in files.chunks(IMPORT_BATCH) {
            let mut b = WriteBatch::default();
            for (key, path) in batch {
                let value = std::fs::read(path).map_err(|e| StoreError::io(what(path), e))?;
                b.put(key.as_bytes(), value);
            }
            self.db
                .write_opt(b, &synced())
                .map_err(|e| db_err("importing record files", e))?;
        }
        std::fs::remove_dir_all(&legacy).map_err(|e| StoreError::io(what(&legacy), e))?;
        tracing::info!(records = n, "record files imported into {DIR}");
        Ok(())
    }
}
