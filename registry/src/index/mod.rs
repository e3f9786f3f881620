//! The metadata index, in RocksDB: repositories, tags, manifests, blob sizes, the blobs
//! linked into each repository and referrers (upload sessions are store records).
//!
//! The index never holds content; content lives in the object store. Every write that
//! must be seen together (a manifest, its tag, its referrer link) is one atomic
//! `WriteBatch`, written with the WAL synced, so an acknowledged push survives a crash.
//! Tag moves are serialized by `tag_lock` so the immutable-tag check and the write cannot
//! interleave with another move.
//!
//! Key layout (one column family per kind; `\0` separates parts, which validated names,
//! tags and digests never contain):
//! - `repos`      name                      -> {}
//! - `tags`       name \0 tag               -> digest
//! - `manifests`  name \0 digest            -> ManifestRecord
//! - `blobs`      digest                    -> size (u64 little endian)
//! - `repo_blobs` name \0 digest            -> empty
//! - `referrers`  name \0 subject \0 digest -> descriptor (JSON)
//! - `uploads`    unused (upload sessions were kept here before they became store records)
//! - `conversions` image digest             -> Conversion (state of its conversion)
//! - `image_envs` image digest              -> env digest (written once, never changed)
//! - `chunks`     chunk id                  -> stored (compressed) size, u64 LE
//! - `stats`      counter name              -> u64 LE (merged additions; `totals`)
//! - `stats_history` hour (u64 BE)          -> stored bytes then, u64 LE
//! - `envs`       env digest                -> EnvInfo (noted once)
//! - `chunk_refs` chunk id                  -> envs naming it, u64 LE (merged additions)
//! - `manifest_bytes` manifest digest       -> the manifest's bytes, exactly as pushed (a
//!   copy of the store's object, written unsynced at push and on a read that missed it:
//!   a GET reads it with the manifest's record, with no file to open; a lost write is
//!   read from the store again)
//! - `recompress` chunk id                  -> empty: a chunk a conversion wrote at its
//!   fast level, waiting to be recompressed at the store's (`recompress`)
//!
//! A family this build does not know (one a later build added) is opened and left alone,
//! so an index written by a later build still opens here.

mod totals;

pub use totals::{EnvInfo, Sharing, Totals};

use std::path::Path;
use std::sync::Mutex;

use rocksdb::{
    ColumnFamilyDescriptor, Direction, IteratorMode, Options, WriteBatch, WriteOptions, DB,
};
use serde::{Deserialize, Serialize};

use amber_oci::digest::Digest;
use amber_oci::names::{RepoName, Tag};
use bytes::Bytes;

use crate::bytes_cache::BytesCache;

const CFS: [&str; 16] = [
    "repos",
    "tags",
    "manifests",
    "blobs",
    "repo_blobs",
    "referrers",
    "uploads",
    "conversions",
    "image_envs",
    "chunks",
    "stats",
    "stats_history",
    "envs",
    "chunk_refs",
    "manifest_bytes",
    "recompress",
];
/// The families whose values are counters (merge operands add).
const COUNTER_CFS: [&str; 2] = ["stats", "chunk_refs"];
/// Memory of the index's memtables, all column families together (RocksDB flushes the
/// largest when they reach it).
const INDEX_WRITE_BUFFERS: usize = 64 << 20;
/// Bytes of write-ahead log the index keeps before flushing the column families that
/// hold its oldest log file. A log file goes only when every family with writes in it
/// has flushed, and the small families flush rarely: without a bound the logs were 70%
/// of the index at 10,000 images (44 MiB of logs beside 18 MiB of tables).
const INDEX_WAL_BUDGET: u64 = 32 << 20;
/// The index's block cache, one for every column family: the data, index and bloom
/// filter blocks its reads use. Without it each column family made its own 32 MiB one,
/// up to 448 MiB as the index grew.
const INDEX_BLOCK_CACHE: usize = 64 << 20;
/// Compression of the tables of a database read by point lookups (the index, the fs
/// store's records), at every level. At a million images nearly every lookup misses the
/// block cache and decompresses a block: with zstd at the bottom level (where most data
/// settles) its decompression was 8% of the registry's CPU in GETs by tag; with LZ4
/// the registry served 15-17% more GETs by tag and by digest per second (interleaved
/// runs; BENCHMARKS.md, "Metadata at scale") from tables 1.4-1.7x larger (about 1.8 KiB
/// of index and records per image instead of 1.1).
const LOOKUP_COMPRESSION: rocksdb::DBCompressionType = rocksdb::DBCompressionType::Lz4;
/// Bloom filter bits per key: about 1% of lookups of an absent key read a block.
const BLOOM_BITS_PER_KEY: f64 = 10.0;
/// Bytes of values of the families every resolve and manifest GET reads ([`Held`])
/// held in memory: a RocksDB lookup probes each level-0 table's filter and the block
/// cache's shards, and three of them were 38% of the registry's CPU in resolves at 20,000
/// images. An entry is about 300 bytes, so about 100,000 of them.
const INDEX_HELD: usize = 32 << 20;
/// The families whose values are held in memory (`Index::held`). Their values are
/// written only by `put_manifest`, `put_conversion` and `finish_conversion`, each of
/// which updates the memory after the write.
#[derive(Clone, Copy)]
enum Held {
    Manifests,
    Conversions,
    ImageEnvs,
    /// Held per subject: the JSON list of its referrers (an empty one too, the common
    /// answer), which `put_manifest` forgets after it writes a referrer of that subject.
    Referrers,
}

impl Held {
    fn cf(self) -> &'static str {
        match self {
            Held::Manifests => "manifests",
            Held::Conversions => "conversions",
            Held::ImageEnvs => "image_envs",
            Held::Referrers => "referrers",
        }
    }

    /// Where `key` of this family is held in memory.
    fn key(self, key: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(1 + key.len());
        k.push(self as u8);
        k.extend_from_slice(key);
        k
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("metadata index: {0}")]
    Db(#[from] rocksdb::Error),
    #[error("metadata index record {key:?} is corrupt: {source}")]
    Corrupt {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("tag {tag} of repository {repo} is immutable and already points to {current}")]
    TagImmutable {
        repo: String,
        tag: String,
        current: String,
    },
}

/// What the index knows of a manifest in a repository.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ManifestRecord {
    pub media_type: String,
    pub size: u64,
    /// Where it came from, when it was imported from another registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<amber_api::registry::ImageSource>,
}

/// Where an image's conversion to a block device stands.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Conversion {
    pub repo: String,
    pub state: ConversionState,
    pub error: Option<String>,
    pub env_digest: Option<String>,
    pub updated_unix: u64,
    /// When the conversion that ran (or runs) started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_unix: Option<u64>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ConversionState {
    Queued,
    Running,
    Done,
    Failed,
}

/// One manifest push, written atomically.
pub struct ManifestWrite<'a> {
    pub repo: &'a RepoName,
    pub digest: &'a Digest,
    pub record: ManifestRecord,
    pub tag: Option<&'a Tag>,
    pub tag_immutable: bool,
    /// (subject digest, descriptor of this manifest) when the manifest has a subject.
    pub referrer: Option<(&'a Digest, serde_json::Value)>,
}

/// RocksDB databases open in this process (see `Index::open_count`).
static OPEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One RocksDB database open in this process, counted from its open until this is
/// dropped: its owner keeps it in the field after the database's own, so the count
/// falls only once the database is closed.
pub(crate) struct OpenDb(());

impl OpenDb {
    pub(crate) fn counted() -> OpenDb {
        OPEN.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        OpenDb(())
    }
}

impl Drop for OpenDb {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

pub struct Index {
    db: DB,
    /// Values of the [`Held`] families read or written lately, keyed by `Held::key`.
    held: BytesCache<Vec<u8>>,
    tag_lock: Mutex<()>,
    /// See `totals`: the is-it-new check and write of one key happen under its stripe.
    stripes: [Mutex<()>; totals::STRIPES],
    _open: OpenDb,
}

/// Table options for a database read by point lookups (the index, the fs store's records):
/// data, index and bloom filter blocks in `cache`, so memory stays bounded as the
/// database grows.
///
/// The index and filter of a table are partitioned (blocks of about 4 KiB under a small
/// top level, pinned): whole, a table of a few million keys has a filter of megabytes,
/// larger than a shard of the cache (1/64 of it), so the cache dropped it again at once
/// and every lookup read and checksummed it from the file: 40% of the registry's CPU in
/// the records database's lookups at 10,000 images of the scale benchmark (6% after).
///
/// Data blocks carry a hash index beside their binary-search one (a key found in one
/// probe instead of a search over the block's restart points).
fn lookup_tables(cache: &rocksdb::Cache) -> rocksdb::BlockBasedOptions {
    let mut table = rocksdb::BlockBasedOptions::default();
    table.set_data_block_index_type(rocksdb::DataBlockIndexType::BinaryAndHash);
    table.set_block_cache(cache);
    table.set_bloom_filter(BLOOM_BITS_PER_KEY, false);
    table.set_index_type(rocksdb::BlockBasedIndexType::TwoLevelIndexSearch);
    table.set_partition_filters(true);
    table.set_metadata_block_size(4096);
    table.set_cache_index_and_filter_blocks(true);
    table.set_pin_top_level_index_and_filter(true);
    table.set_pin_l0_filter_and_index_blocks_in_cache(true);
    table
}

/// Sets `o` (a database's or a column family's options) up for point lookups: `table`
/// (from [`lookup_tables`]) and [`LOOKUP_COMPRESSION`] at every level.
fn for_lookups(o: &mut Options, table: &rocksdb::BlockBasedOptions) {
    o.set_block_based_table_factory(table);
    o.set_compression_type(LOOKUP_COMPRESSION);
}

/// Sets up the options of a database read by point lookups (the fs store's records)
/// with its own block cache of `cache_bytes`.
pub(crate) fn lookup_db(o: &mut Options, cache_bytes: usize) -> Result<(), rocksdb::Error> {
    for_lookups(
        o,
        &lookup_tables(&rocksdb::Cache::new_lru_cache(cache_bytes)?),
    );
    Ok(())
}

fn key2(a: &str, b: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(a.len() + b.len() + 1);
    k.extend_from_slice(a.as_bytes());
    k.push(0);
    k.extend_from_slice(b.as_bytes());
    k
}

/// The start of every `referrers` key of `subject` in `repo`.
fn referrers_prefix(repo: &str, subject: &Digest) -> Vec<u8> {
    let mut k = key2(repo, &subject.to_string());
    k.push(0);
    k
}

/// A JSON record of the index, `None` when absent.
fn decode<T: for<'de> Deserialize<'de>>(
    key: &[u8],
    value: Option<&[u8]>,
) -> Result<Option<T>, IndexError> {
    value
        .map(|v| serde_json::from_slice(v))
        .transpose()
        .map_err(|source| IndexError::Corrupt {
            key: String::from_utf8_lossy(key).into_owned(),
            source,
        })
}

fn synced() -> WriteOptions {
    let mut w = WriteOptions::default();
    w.set_sync(true);
    w
}

impl Index {
    pub fn open(path: &Path) -> Result<Index, IndexError> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        // One memtable budget for every column family: each of the 14 had its own 64 MiB
        // (and a second while flushing), so the registry's memory grew with what it
        // indexed until the flushes (583 MiB peak at 100,000 pushed images).
        opts.set_db_write_buffer_size(INDEX_WRITE_BUFFERS);
        opts.set_max_total_wal_size(INDEX_WAL_BUDGET);
        // That budget flushes memtables sooner, so a point lookup (a manifest by digest,
        // a tag, a blob) meets more level-0 files: a bloom filter per file turns each
        // file that cannot hold the key into a probe in memory instead of a block read.
        let table = lookup_tables(&rocksdb::Cache::new_lru_cache(INDEX_BLOCK_CACHE)?);
        // Families of a later build are opened too (RocksDB refuses to open a database
        // without all of them), with default options: nothing here reads them.
        // (No database yet: it is created with this build's families.)
        let later: Vec<ColumnFamilyDescriptor> = DB::list_cf(&opts, path)
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n != rocksdb::DEFAULT_COLUMN_FAMILY_NAME && !CFS.contains(&n.as_str()))
            .map(|n| ColumnFamilyDescriptor::new(n, Options::default()))
            .collect();
        let cfs = CFS.iter().map(|n| {
            let mut o = Options::default();
            for_lookups(&mut o, &table);
            if COUNTER_CFS.contains(n) {
                o.set_merge_operator_associative("add_u64", totals::add_u64);
            }
            if *n == "stats" {
                // A read folds every addition still in the memtable: without a bound,
                // a counter touched by every blob and chunk held millions of them
                // between flushes (50 ms per totals read at 100,000 images). Past this
                // many, a write folds them into one value. Not for `chunk_refs`: each
                // of its keys gets an addition per env naming the chunk, rarely many
                // between flushes, and the bound costs every merge a memtable search
                // (3.6% of a conversion's CPU in the corpus benchmark).
                o.set_max_successive_merges(totals::MAX_MERGE_CHAIN);
            }
            ColumnFamilyDescriptor::new(*n, o)
        });
        let db = DB::open_cf_descriptors(&opts, path, cfs.chain(later))?;
        let index = Index {
            db,
            held: BytesCache::new(INDEX_HELD, |k: &Vec<u8>| k.capacity() + 24),
            tag_lock: Mutex::new(()),
            stripes: std::array::from_fn(|_| Mutex::new(())),
            _open: OpenDb::counted(),
        };
        index.count_once()?;
        Ok(index)
    }

    /// How many RocksDB databases (indexes, and the records of fs stores) this process
    /// has open. A process must not end with one open while other threads may still use
    /// it: `exit` runs RocksDB's static destructors under them (SIGSEGV, or
    /// `std::terminate` on a joinable thread).
    pub fn open_count() -> usize {
        OPEN.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(name)
            .expect("column families are created on open")
    }

    /// The value of `key` in family `f`, from memory when held there.
    fn get_held(&self, f: Held, key: &[u8]) -> Result<Option<Bytes>, IndexError> {
        self.held.get_or_read(f.key(key).as_slice(), || {
            // Not held: a lookup, on this thread (see `crate::blocking`).
            Ok(self
                .db
                .get_pinned_cf(self.cf(f.cf()), key)?
                .map(|v| Bytes::copy_from_slice(&v)))
        })
    }

    /// Holds `value`, just written as `key`'s in family `f`.
    fn set_held(&self, f: Held, key: &[u8], value: Vec<u8>) {
        self.held.set(f.key(key), Bytes::from(value));
    }

    /// The JSON value of `key` in `cf`.
    fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        cf: &str,
        key: &[u8],
    ) -> Result<Option<T>, IndexError> {
        let v = self.db.get_pinned_cf(self.cf(cf), key)?;
        decode(key, v.as_deref())
    }

    /// The JSON value of `key` in family `f`, from memory when held there.
    fn get_held_json<T: for<'de> Deserialize<'de>>(
        &self,
        f: Held,
        key: &[u8],
    ) -> Result<Option<T>, IndexError> {
        decode(key, self.get_held(f, key)?.as_deref())
    }

    /// Records a published blob and links it into `repo`.
    /// Writes `b` with the WAL synced, off the async worker (`crate::blocking`).
    fn write_synced(&self, b: WriteBatch) -> Result<(), rocksdb::Error> {
        crate::blocking::run(|| self.db.write_opt(b, &synced()))
    }

    pub fn put_blob(&self, repo: &RepoName, digest: &Digest, size: u64) -> Result<(), IndexError> {
        let digest = digest.to_string();
        let _stripe = self.stripe(digest.as_bytes());
        let mut b = WriteBatch::default();
        self.add_blob(&mut b, &digest, size)?;
        b.put_cf(self.cf("repo_blobs"), key2(repo.as_str(), &digest), b"");
        self.add_repo(&mut b, repo.as_str())?;
        self.write_synced(b)?;
        Ok(())
    }

    /// Records blob `digest` of `size` bytes in `b`, counted if it is new (the caller
    /// holds the digest's stripe).
    fn add_blob(&self, b: &mut WriteBatch, digest: &str, size: u64) -> Result<(), IndexError> {
        if self.db.get_pinned_cf(self.cf("blobs"), digest)?.is_none() {
            self.count(b, totals::counter::BLOBS, 1);
            self.count(b, totals::counter::BLOB_BYTES, size);
        }
        b.put_cf(self.cf("blobs"), digest, size.to_le_bytes());
        Ok(())
    }

    /// Adds `repo` to the catalog in `b` unless it is there: a catalog page iterates the
    /// `repos` family, and every rewrite of a key is one more version in the memtable that
    /// the iterator must step over (a push links several blobs and manifests: the pages
    /// took 10x longer while the memtable held a dozen versions of each repository).
    fn add_repo(&self, b: &mut WriteBatch, repo: &str) -> Result<(), IndexError> {
        if self.db.get_pinned_cf(self.cf("repos"), repo)?.is_none() {
            b.put_cf(self.cf("repos"), repo, b"{}");
        }
        Ok(())
    }

    /// Records that `repo` exists.
    pub fn put_repo(&self, repo: &RepoName) -> Result<(), IndexError> {
        crate::blocking::run(|| {
            self.db
                .put_cf_opt(self.cf("repos"), repo.as_str(), b"{}", &synced())
        })?;
        Ok(())
    }

    /// Points `tag` of `repo` at `digest` (a cache of the store's tag record).
    pub fn put_tag(&self, repo: &RepoName, tag: &Tag, digest: &Digest) -> Result<(), IndexError> {
        crate::blocking::run(|| {
            self.db.put_cf_opt(
                self.cf("tags"),
                key2(repo.as_str(), tag.as_str()),
                digest.to_string().as_bytes(),
                &synced(),
            )
        })?;
        Ok(())
    }

    /// The size of a published blob, if the registry has it in any repository.
    pub fn blob_size(&self, digest: &Digest) -> Result<Option<u64>, IndexError> {
        Ok(self
            .db
            .get_pinned_cf(self.cf("blobs"), digest.to_string())?
            .and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
            .map(u64::from_le_bytes))
    }

    /// Every blob the index knows, with its size.
    pub fn blobs(&self) -> Result<Vec<(Digest, u64)>, IndexError> {
        let mut out = Vec::new();
        for item in self.db.iterator_cf(self.cf("blobs"), IteratorMode::Start) {
            let (k, v) = item?;
            let digest = std::str::from_utf8(&k).ok().and_then(|s| s.parse().ok());
            let size = <[u8; 8]>::try_from(&v[..]).ok().map(u64::from_le_bytes);
            if let (Some(d), Some(n)) = (digest, size) {
                out.push((d, n));
            }
        }
        Ok(out)
    }

    /// The size of `digest` if it is linked into `repo`.
    pub fn repo_blob(&self, repo: &RepoName, digest: &Digest) -> Result<Option<u64>, IndexError> {
        if self
            .db
            .get_pinned_cf(
                self.cf("repo_blobs"),
                key2(repo.as_str(), &digest.to_string()),
            )?
            .is_none()
        {
            return Ok(None);
        }
        self.blob_size(digest)
    }

    pub fn put_manifest(&self, w: ManifestWrite<'_>) -> Result<(), IndexError> {
        let repo = w.repo.as_str();
        let digest = w.digest.to_string();
        let _stripe = self.stripe(digest.as_bytes());
        let mut b = WriteBatch::default();
        self.add_repo(&mut b, repo)?;
        let manifest_key = key2(repo, &digest);
        let record = serde_json::to_vec(&w.record).expect("record serializes");
        b.put_cf(self.cf("manifests"), &manifest_key, &record);
        self.add_blob(&mut b, &digest, w.record.size)?;
        b.put_cf(self.cf("repo_blobs"), key2(repo, &digest), b"");
        let referrers_of = w.referrer.as_ref().map(|(subject, desc)| {
            let prefix = referrers_prefix(repo, subject);
            let mut k = prefix.clone();
            k.extend_from_slice(digest.as_bytes());
            b.put_cf(
                self.cf("referrers"),
                k,
                serde_json::to_vec(desc).expect("json"),
            );
            prefix
        });
        let _guard =
            crate::blocking::run(|| self.tag_lock.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(tag) = w.tag {
            let tk = key2(repo, tag.as_str());
            if w.tag_immutable {
                if let Some(cur) = self.db.get_pinned_cf(self.cf("tags"), &tk)? {
                    if cur.as_ref() != digest.as_bytes() {
                        return Err(IndexError::TagImmutable {
                            repo: repo.to_string(),
                            tag: tag.to_string(),
                            current: String::from_utf8_lossy(&cur).into_owned(),
                        });
                    }
                }
            }
            b.put_cf(self.cf("tags"), tk, digest.as_bytes());
        }
        self.write_synced(b)?;
        self.set_held(Held::Manifests, &manifest_key, record);
        if let Some(prefix) = referrers_of {
            self.held.remove(Held::Referrers.key(&prefix).as_slice());
        }
        Ok(())
    }

    pub fn manifest(
        &self,
        repo: &RepoName,
        digest: &Digest,
    ) -> Result<Option<ManifestRecord>, IndexError> {
        self.get_held_json(Held::Manifests, &key2(repo.as_str(), &digest.to_string()))
    }

    pub fn tag(&self, repo: &RepoName, tag: &Tag) -> Result<Option<Digest>, IndexError> {
        Ok(self
            .db
            .get_pinned_cf(self.cf("tags"), key2(repo.as_str(), tag.as_str()))?
            .and_then(|v| std::str::from_utf8(&v).ok().and_then(|s| s.parse().ok())))
    }

    pub fn repo_exists(&self, repo: &RepoName) -> Result<bool, IndexError> {
        Ok(self
            .db
            .get_pinned_cf(self.cf("repos"), repo.as_str())?
            .is_some())
    }

    /// Up to `n` keys of column family `cf` starting with `prefix`, strictly after
    /// `prefix + last`, with the prefix removed. Returns the keys and whether more follow.
    fn page(
        &self,
        cf: &str,
        prefix: &[u8],
        last: Option<&str>,
        n: usize,
    ) -> Result<(Vec<String>, bool), IndexError> {
        let mut start = prefix.to_vec();
        if let Some(l) = last {
            start.extend_from_slice(l.as_bytes());
        }
        let iter = self
            .db
            .iterator_cf(self.cf(cf), IteratorMode::From(&start, Direction::Forward));
        let mut out = Vec::new();
        for item in iter {
            let (k, _) = item?;
            if !k.starts_with(prefix) {
                break;
            }
            let rest = &k[prefix.len()..];
            if last.is_some_and(|l| rest == l.as_bytes()) {
                continue;
            }
            if out.len() == n {
                return Ok((out, true));
            }
            out.push(String::from_utf8_lossy(rest).into_owned());
        }
        Ok((out, false))
    }

    /// Tags of `repo` in lexical order, paginated.
    pub fn tags(
        &self,
        repo: &RepoName,
        last: Option<&str>,
        n: usize,
    ) -> Result<(Vec<String>, bool), IndexError> {
        self.page("tags", &key2(repo.as_str(), ""), last, n)
    }

    /// Repository names in lexical order, paginated.
    pub fn catalog(&self, last: Option<&str>, n: usize) -> Result<(Vec<String>, bool), IndexError> {
        self.page("repos", b"", last, n)
    }

    /// Repository names after `after` that contain `needle` (ASCII case-insensitive) and
    /// that `keep` accepts, at most `n`, looking at no more than `budget` names: a search
    /// costs a bounded scan whatever the registry's size. Returns the names found and,
    /// when the scan stopped before the end, the name to go on after.
    pub fn search_repos(
        &self,
        needle: &str,
        after: Option<&str>,
        n: usize,
        budget: usize,
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<(Vec<String>, Option<String>), IndexError> {
        let needle = needle.to_ascii_lowercase();
        let start = after.unwrap_or("");
        let iter = self.db.iterator_cf(
            self.cf("repos"),
            IteratorMode::From(start.as_bytes(), Direction::Forward),
        );
        let mut out = Vec::new();
        let mut last: Option<String> = None;
        for (seen, item) in iter.enumerate() {
            let (k, _) = item?;
            let name = String::from_utf8_lossy(&k);
            if after == Some(name.as_ref()) {
                continue;
            }
            if seen >= budget || out.len() == n {
                return Ok((out, last));
            }
            if name.to_ascii_lowercase().contains(&needle) && keep(&name) {
                out.push(name.to_string());
            }
            last = Some(name.into_owned());
        }
        Ok((out, None))
    }

    /// Descriptors of the manifests in `repo` whose subject is `subject`.
    pub fn referrers(
        &self,
        repo: &RepoName,
        subject: &Digest,
    ) -> Result<Vec<serde_json::Value>, IndexError> {
        let prefix = referrers_prefix(repo.as_str(), subject);
        let list = self
            .held
            .get_or_read(Held::Referrers.key(&prefix).as_slice(), || {
                // The stored descriptors are JSON already: the list is their array.
                let mut out = b"[".to_vec();
                for item in self.db.iterator_cf(
                    self.cf("referrers"),
                    IteratorMode::From(&prefix, Direction::Forward),
                ) {
                    let (k, v) = item?;
                    if !k.starts_with(&prefix) {
                        break;
                    }
                    if out.len() > 1 {
                        out.push(b',');
                    }
                    out.extend_from_slice(&v);
                }
                out.push(b']');
                Ok::<_, IndexError>(Some(Bytes::from(out)))
            })?;
        Ok(decode(&prefix, list.as_deref())?.unwrap_or_default())
    }

    /// The bytes of manifest `digest`, when the index has a copy.
    pub fn manifest_bytes(&self, digest: &Digest) -> Result<Option<Bytes>, IndexError> {
        let key = digest.to_string();
        Ok(self
            .db
            .get_pinned_cf(self.cf("manifest_bytes"), key.as_bytes())?
            .map(|v| Bytes::copy_from_slice(&v)))
    }

    /// Keeps a copy of the bytes of manifest `digest`, which the caller has checked are
    /// the manifest's. Not synced: a copy lost in a crash is read from the store again.
    pub fn put_manifest_bytes(&self, digest: &Digest, bytes: &[u8]) -> Result<(), IndexError> {
        let key = digest.to_string();
        self.db
            .put_cf(self.cf("manifest_bytes"), key.as_bytes(), bytes)?;
        Ok(())
    }

    pub fn conversion(&self, image: &Digest) -> Result<Option<Conversion>, IndexError> {
        self.get_held_json(Held::Conversions, image.to_string().as_bytes())
    }

    pub fn put_conversion(&self, image: &Digest, c: &Conversion) -> Result<(), IndexError> {
        let key = image.to_string();
        let value = serde_json::to_vec(c).expect("conversion serializes");
        crate::blocking::run(|| {
            self.db
                .put_cf_opt(self.cf("conversions"), &key, &value, &synced())
        })?;
        self.set_held(Held::Conversions, key.as_bytes(), value);
        Ok(())
    }

    /// Up to `limit` conversion records in key order, starting after `after` (for
    /// resuming unfinished ones after a restart, a page at a time: a million records
    /// held at once were most of a starting registry's memory).
    pub fn conversions_page(
        &self,
        after: Option<&Digest>,
        limit: usize,
    ) -> Result<Vec<(Digest, Conversion)>, IndexError> {
        let start = after.map(|d| d.to_string()).unwrap_or_default();
        let mode = IteratorMode::From(start.as_bytes(), Direction::Forward);
        let mut out = Vec::with_capacity(limit.min(1024));
        crate::blocking::run(|| {
            for item in self.db.iterator_cf(self.cf("conversions"), mode) {
                let (k, v) = item?;
                if after.is_some() && *k == *start.as_bytes() {
                    continue;
                }
                let key = String::from_utf8_lossy(&k).into_owned();
                let Ok(d) = key.parse::<Digest>() else {
                    continue;
                };
                let c = serde_json::from_slice(&v)
                    .map_err(|source| IndexError::Corrupt { key, source })?;
                out.push((d, c));
                if out.len() == limit {
                    break;
                }
            }
            Ok::<_, IndexError>(())
        })?;
        Ok(out)
    }

    /// The env digest of an image, once it has one.
    pub fn image_env(&self, image: &Digest) -> Result<Option<String>, IndexError> {
        Ok(self
            .get_held(Held::ImageEnvs, image.to_string().as_bytes())?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// Records the image -> env mapping and marks the conversion done, atomically. The
    /// mapping is written once: if one exists already it is kept and returned.
    pub fn finish_conversion(
        &self,
        image: &Digest,
        env: &str,
        c: &Conversion,
    ) -> Result<String, IndexError> {
        let _guard =
            crate::blocking::run(|| self.tag_lock.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(existing) = self.image_env(image)? {
            return Ok(existing);
        }
        let key = image.to_string();
        let conversion = serde_json::to_vec(c).expect("json");
        let mut b = WriteBatch::default();
        b.put_cf(self.cf("image_envs"), &key, env.as_bytes());
        self.count(&mut b, totals::counter::IMAGES, 1);
        b.put_cf(self.cf("conversions"), &key, &conversion);
        self.write_synced(b)?;
        self.set_held(Held::ImageEnvs, key.as_bytes(), env.as_bytes().to_vec());
        self.set_held(Held::Conversions, key.as_bytes(), conversion);
        Ok(env.to_string())
    }

    /// The stored size of a chunk, if the store has it.
    pub fn chunk(&self, id: &str) -> Result<Option<u64>, IndexError> {
        Ok(self
            .db
            .get_pinned_cf(self.cf("chunks"), id)?
            .and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
            .map(u64::from_le_bytes))
    }

    /// Notes a stored chunk of `stored` bytes; `recompress`: it was written at a
    /// conversion's fast level, and waits for `recompressed`. Returns whether it now
    /// waits (not when the index knew the chunk already).
    pub fn put_chunk(&self, id: &str, stored: u64, recompress: bool) -> Result<bool, IndexError> {
        // Not synced on its own: a lost entry only means the chunk is stat-ed again (and,
        // for one waiting to be recompressed, that it stays at the fast level).
        let _stripe = self.stripe(id.as_bytes());
        let mut b = WriteBatch::default();
        let new = self.db.get_pinned_cf(self.cf("chunks"), id)?.is_none();
        if new {
            self.count(&mut b, totals::counter::CHUNKS, 1);
            self.count(&mut b, totals::counter::CHUNK_BYTES, stored);
            if recompress {
                b.put_cf(self.cf("recompress"), id, []);
                self.count(&mut b, totals::counter::TO_RECOMPRESS, 1);
            }
        }
        b.put_cf(self.cf("chunks"), id, stored.to_le_bytes());
        self.db.write(b)?;
        Ok(new && recompress)
    }

    /// Up to `n` chunks waiting to be recompressed, in id order, after `after` (a
    /// caller going through them passes its last: the notes it ended are tombstones
    /// until a compaction, and a scan from the start would step over every one).
    pub fn chunks_to_recompress(
        &self,
        after: Option<&str>,
        n: usize,
    ) -> Result<Vec<String>, IndexError> {
        let mode = match after {
            Some(a) => IteratorMode::From(a.as_bytes(), Direction::Forward),
            None => IteratorMode::Start,
        };
        let mut out = Vec::new();
        for item in self.db.iterator_cf(self.cf("recompress"), mode) {
            let (k, _) = item?;
            if after.is_some_and(|a| a.as_bytes() == &k[..]) {
                continue;
            }
            out.push(String::from_utf8_lossy(&k).into_owned());
            if out.len() == n {
                break;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amber_oci::digest::Algorithm;

    fn rec() -> ManifestRecord {
        ManifestRecord {
            source: None,
            media_type: "application/vnd.oci.image.manifest.v1+json".into(),
            size: 3,
        }
    }

    #[test]
    fn tags_paginate_in_lexical_order_and_immutable_tags_refuse_moves() {
        let dir = tempfile::tempdir().unwrap();
        let ix = Index::open(dir.path()).unwrap();
        let repo = RepoName::parse("a/b").unwrap();
        let other = RepoName::parse("a/bc").unwrap();
        let d1 = Digest::of(Algorithm::Sha256, b"1");
        let d2 = Digest::of(Algorithm::Sha256, b"2");
        for t in ["v3", "v1", "v2", "latest"] {
            let tag = Tag::parse(t).unwrap();
            ix.put_manifest(ManifestWrite {
                repo: &repo,
                digest: &d1,
                record: rec(),
                tag: Some(&tag),
                tag_immutable: false,
                referrer: None,
            })
            .unwrap();
        }
        let t = Tag::parse("zzz").unwrap();
        ix.put_manifest(ManifestWrite {
            repo: &other,
            digest: &d1,
            record: rec(),
            tag: Some(&t),
            tag_immutable: false,
            referrer: None,
        })
        .unwrap();
        assert_eq!(
            ix.tags(&repo, None, 10).unwrap(),
            (
                vec!["latest".into(), "v1".into(), "v2".into(), "v3".into()],
                false
            )
        );
        assert_eq!(
            ix.tags(&repo, None, 2).unwrap(),
            (vec!["latest".into(), "v1".into()], true)
        );
        assert_eq!(
            ix.tags(&repo, Some("v1"), 2).unwrap(),
            (vec!["v2".into(), "v3".into()], false)
        );
        assert_eq!(
            ix.catalog(None, 10).unwrap().0,
            vec!["a/b".to_string(), "a/bc".to_string()]
        );
        assert_eq!(
            ix.catalog(Some("a/b"), 10).unwrap().0,
            vec!["a/bc".to_string()]
        );

        let v1 = Tag::parse("v1").unwrap();
        let same = ix.put_manifest(ManifestWrite {
            repo: &repo,
            digest: &d1,
            record: rec(),
            tag: Some(&v1),
            tag_immutable: true,
            referrer: None,
        });
        assert!(
            same.is_ok(),
            "re-pushing identical content is always accepted"
        );
        let moved = ix.put_manifest(ManifestWrite {
            repo: &repo,
            digest: &d2,
            record: rec(),
            tag: Some(&v1),
            tag_immutable: true,
            referrer: None,
        });
        assert!(matches!(moved, Err(IndexError::TagImmutable { .. })));
        assert_eq!(ix.tag(&repo, &v1).unwrap(), Some(d1.clone()));
        assert_eq!(
            ix.manifest(&repo, &d2).unwrap(),
            None,
            "a refused push writes nothing"
        );
    }

    /// An index a later build wrote, with a family this build does not know, opens and
    /// keeps what it holds (RocksDB refuses to open a database without every family).
    #[test]
    fn an_index_with_a_family_of_a_later_build_opens() {
        let dir = tempfile::tempdir().unwrap();
        let repo = RepoName::parse("a/b").unwrap();
        let d = Digest::of(Algorithm::Sha256, b"m");
        {
            let ix = Index::open(dir.path()).unwrap();
            ix.put_manifest_bytes(&d, b"{}").unwrap();
            ix.put_manifest(ManifestWrite {
                repo: &repo,
                digest: &d,
                record: rec(),
                tag: None,
                tag_immutable: false,
                referrer: None,
            })
            .unwrap();
        }
        {
            let mut later = DB::open_cf(&Options::default(), dir.path(), CFS).unwrap();
            later
                .create_cf("from_a_later_build", &Options::default())
                .unwrap();
        }
        let ix = Index::open(dir.path()).unwrap();
        assert_eq!(ix.manifest(&repo, &d).unwrap(), Some(rec()));
        assert_eq!(ix.manifest_bytes(&d).unwrap().as_deref(), Some(&b"{}"[..]));
    }

    /// Conversion records page in key order, each once, however the pages fall.
    #[test]
    fn conversions_page_in_key_order_each_once() {
        let dir = tempfile::tempdir().unwrap();
        let ix = Index::open(dir.path()).unwrap();
        let mut images: Vec<Digest> = (0..7u8)
            .map(|i| Digest::of(Algorithm::Sha256, &[i]))
            .collect();
        for image in &images {
            let c = Conversion {
                repo: "a/b".into(),
                state: ConversionState::Queued,
                error: None,
                env_digest: None,
                updated_unix: 1,
                started_unix: None,
            };
            ix.put_conversion(image, &c).unwrap();
        }
        images.sort_by_key(|d| d.to_string());
        for limit in [1, 3, 7, 10] {
            let mut seen = Vec::new();
            let mut after: Option<Digest> = None;
            loop {
                let page = ix.conversions_page(after.as_ref(), limit).unwrap();
                assert!(page.len() <= limit);
                after = page.last().map(|(d, _)| d.clone());
                let full = page.len() == limit;
                seen.extend(page.into_iter().map(|(d, _)| d));
                if !full {
                    break;
                }
            }
            assert_eq!(seen, images, "pages of {limit}");
        }
    }

    /// The families held in memory answer every write at once, and the same from disk
    /// after a reopen (nothing is only in memory).
    #[test]
    fn held_values_follow_every_write() {
        let dir = tempfile::tempdir().unwrap();
        let repo = RepoName::parse("a/b").unwrap();
        let image = Digest::of(Algorithm::Sha256, b"image");
        let conversion = |state, env: Option<&str>| Conversion {
            repo: "a/b".into(),
            state,
            error: None,
            env_digest: env.map(str::to_string),
            updated_unix: 1,
            started_unix: None,
        };
        let queued = conversion(ConversionState::Queued, None);
        let running = conversion(ConversionState::Running, None);
        let done = conversion(ConversionState::Done, Some("sha256:e1"));
        let mut imported = rec();
        imported.size = 4;
        {
            let ix = Index::open(dir.path()).unwrap();
            assert_eq!(ix.conversion(&image).unwrap(), None);
            assert_eq!(ix.image_env(&image).unwrap(), None);
            ix.put_conversion(&image, &queued).unwrap();
            assert_eq!(ix.conversion(&image).unwrap(), Some(queued));
            ix.put_conversion(&image, &running).unwrap();
            assert_eq!(ix.conversion(&image).unwrap(), Some(running));
            ix.finish_conversion(&image, "sha256:e1", &done).unwrap();
            assert_eq!(ix.conversion(&image).unwrap(), Some(done.clone()));
            assert_eq!(ix.image_env(&image).unwrap().as_deref(), Some("sha256:e1"));
            // The mapping is written once: a second finish keeps the first env.
            let again = conversion(ConversionState::Done, Some("sha256:e2"));
            assert_eq!(
                ix.finish_conversion(&image, "sha256:e2", &again).unwrap(),
                "sha256:e1"
            );
            assert_eq!(ix.image_env(&image).unwrap().as_deref(), Some("sha256:e1"));
            for record in [rec(), imported.clone()] {
                ix.put_manifest(ManifestWrite {
                    repo: &repo,
                    digest: &image,
                    record: record.clone(),
                    tag: None,
                    tag_immutable: false,
                    referrer: None,
                })
                .unwrap();
                assert_eq!(ix.manifest(&repo, &image).unwrap(), Some(record));
            }
        }
        let ix = Index::open(dir.path()).unwrap();
        // A subject's referrer list, empty then held, lists a referrer once written.
        let subject = Digest::of(Algorithm::Sha256, b"subject");
        assert_eq!(
            ix.referrers(&repo, &subject).unwrap(),
            Vec::<serde_json::Value>::new()
        );
        let mut listed = Vec::new();
        for (i, name) in [b"sig1", b"sig2"].iter().enumerate() {
            let digest = Digest::of(Algorithm::Sha256, *name);
            let desc = serde_json::json!({"digest": digest.to_string(), "i": i});
            ix.put_manifest(ManifestWrite {
                repo: &repo,
                digest: &digest,
                record: rec(),
                tag: None,
                tag_immutable: false,
                referrer: Some((&subject, desc.clone())),
            })
            .unwrap();
            listed.push(desc);
            listed.sort_by_key(|d| d["digest"].as_str().unwrap().to_string());
            assert_eq!(ix.referrers(&repo, &subject).unwrap(), listed);
        }
        drop(ix);
        let ix = Index::open(dir.path()).unwrap();
        assert_eq!(ix.referrers(&repo, &subject).unwrap(), listed);
        assert_eq!(ix.conversion(&image).unwrap(), Some(done));
        assert_eq!(ix.image_env(&image).unwrap().as_deref(), Some("sha256:e1"));
        assert_eq!(ix.manifest(&repo, &image).unwrap(), Some(imported));
    }
}
