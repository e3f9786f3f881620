//! The registry's running totals (blobs, chunks, images, envs and their bytes), what the
//! index knows of each env (size, chunks, how many envs name each chunk), and the history
//! of stored bytes: what the catalog pages show without scanning anything.
//!
//! Invariants kept here:
//! - a counter moves only in the write batch that adds the key it counts, and the
//!   check that the key is new and that write happen under the key's stripe lock, so two
//!   writers of one key count it once;
//! - counters are merge operands (additions), never read-modify-write, so writers of
//!   different keys never wait for each other;
//! - an index opened without totals (made before they existed) counts what it holds
//!   once, at open, before anything else writes.

use std::collections::HashSet;

use rocksdb::{IteratorMode, MergeOperands, WriteBatch};
use serde::{Deserialize, Serialize};

use super::{Index, IndexError};

/// Counter keys in the `stats` family (each a u64, little endian).
pub(super) mod counter {
    pub const BLOBS: &[u8] = b"blobs";
    pub const BLOB_BYTES: &[u8] = b"blob_bytes";
    pub const CHUNKS: &[u8] = b"chunks";
    pub const CHUNK_BYTES: &[u8] = b"chunk_bytes";
    pub const IMAGES: &[u8] = b"images";
    pub const ENVS: &[u8] = b"envs";
    pub const ENV_BYTES: &[u8] = b"env_bytes";
    pub const ENV_CHUNK_BYTES: &[u8] = b"env_chunk_bytes";
    /// Chunks written at a conversion's fast level, not yet recompressed.
    pub const TO_RECOMPRESS: &[u8] = b"chunks_to_recompress";
    /// Present once the index's totals cover everything it holds.
    pub const COUNTED: &[u8] = b"counted";
}

/// The most additions a counter keeps unfolded in the memtable.
pub(super) const MAX_MERGE_CHAIN: usize = 32;

/// Stripe locks serialising the is-it-new check and the write of one key.
pub(super) const STRIPES: usize = 64;

/// The merge operator of the counter families: operands are u64 LE additions.
pub(super) fn add_u64(
    _key: &[u8],
    existing: Option<&[u8]>,
    operands: &MergeOperands,
) -> Option<Vec<u8>> {
    let mut n = existing.map_or(0, decode_u64);
    for op in operands {
        n = n.wrapping_add(decode_u64(op));
    }
    Some(n.to_le_bytes().to_vec())
}

fn decode_u64(v: &[u8]) -> u64 {
    <[u8; 8]>::try_from(v).map_or(0, u64::from_le_bytes)
}

/// The registry's totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    /// Blobs stored (layers, configs, manifests), and their bytes.
    pub blobs: u64,
    pub blob_bytes: u64,
    /// Chunks stored, and their stored (compressed) bytes.
    pub chunks: u64,
    pub chunk_bytes: u64,
    /// Images converted (each has an env).
    pub images: u64,
    /// Distinct envs, the bytes of their devices, and the stored bytes of the chunks each
    /// names, summed over envs (what the chunks would take without sharing).
    pub envs: u64,
    pub env_bytes: u64,
    pub env_chunk_bytes: u64,
    /// Chunks a conversion wrote at its fast level that wait to be recompressed at the
    /// store's level (`recompress`); their bytes are in `chunk_bytes` as they are now.
    pub chunks_to_recompress: u64,
}

impl Totals {
    /// Bytes in the store: blobs and chunks.
    pub fn stored_bytes(&self) -> u64 {
        self.blob_bytes + self.chunk_bytes
    }

    /// How many times over the envs' chunks would be stored without sharing (1.0 when
    /// no env shares a chunk with another); None before any env is known.
    pub fn dedup_ratio(&self) -> Option<f64> {
        (self.chunk_bytes > 0 && self.env_chunk_bytes > 0)
            .then(|| self.env_chunk_bytes as f64 / self.chunk_bytes as f64)
    }
}

/// What the index knows of an env (from its block manifest).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvInfo {
    pub device_size: u64,
    pub filesystem: String,
    pub extents: u64,
    /// Distinct chunks, and their stored (compressed) bytes.
    pub chunks: u64,
    pub chunk_bytes: u64,
}

/// How much of an env's chunks other envs name too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sharing {
    pub chunks: u64,
    pub bytes: u64,
}

impl Index {
    pub(super) fn stripe(&self, key: &[u8]) -> std::sync::MutexGuard<'_, ()> {
        let lock = &self.stripes[crate::stripes::stripe_of(key, STRIPES)];
        crate::blocking::run(|| lock.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub(super) fn count(&self, b: &mut WriteBatch, counter: &[u8], n: u64) {
        b.merge_cf(self.cf("stats"), counter, n.to_le_bytes());
    }

    /// The registry's totals, as of now.
    pub fn totals(&self) -> Result<Totals, IndexError> {
        use counter::*;
        let cf = self.cf("stats");
        let keys = [
            BLOBS,
            BLOB_BYTES,
            CHUNKS,
            CHUNK_BYTES,
            IMAGES,
            ENVS,
            ENV_BYTES,
            ENV_CHUNK_BYTES,
            TO_RECOMPRESS,
        ];
        let mut v = [0u64; 9];
        for (slot, got) in v
            .iter_mut()
            .zip(self.db.multi_get_cf(keys.iter().map(|k| (cf, *k))))
        {
            *slot = got?.as_deref().map_or(0, decode_u64);
        }
        Ok(Totals {
            blobs: v[0],
            blob_bytes: v[1],
            chunks: v[2],
            chunk_bytes: v[3],
            images: v[4],
            envs: v[5],
            env_bytes: v[6],
            env_chunk_bytes: v[7],
            chunks_to_recompress: v[8],
        })
    }

    /// Counts what an index made before totals existed holds (blobs, chunks, converted
    /// images), once. Envs are counted as they are noted (`put_env`).
    pub(super) fn count_once(&self) -> Result<(), IndexError> {
        let stats = self.cf("stats");
        if self.db.get_pinned_cf(stats, counter::COUNTED)?.is_some() {
            return Ok(());
        }
        let sum = |cf: &str| -> Result<(u64, u64), IndexError> {
            let mut n = (0, 0);
            for item in self.db.iterator_cf(self.cf(cf), IteratorMode::Start) {
                let (_, v) = item?;
                n = (n.0 + 1, n.1 + decode_u64(&v));
            }
            Ok(n)
        };
        let (blobs, blob_bytes) = sum("blobs")?;
        let (chunks, chunk_bytes) = sum("chunks")?;
        let (images, _) = sum("image_envs")?;
        let mut b = WriteBatch::default();
        for (k, n) in [
            (counter::BLOBS, blobs),
            (counter::BLOB_BYTES, blob_bytes),
            (counter::CHUNKS, chunks),
            (counter::CHUNK_BYTES, chunk_bytes),
            (counter::IMAGES, images),
        ] {
            b.put_cf(stats, k, n.to_le_bytes());
        }
        b.put_cf(stats, counter::COUNTED, b"1");
        self.db.write(b)?;
        Ok(())
    }

    /// What the index knows of `env`, if it was noted.
    pub fn env(&self, env: &str) -> Result<Option<EnvInfo>, IndexError> {
        self.get_json("envs", env.as_bytes())
    }

    /// Notes `env` (its summary and the distinct chunks it names) unless it was: counts
    /// it in the totals and adds one to each chunk's count of envs naming it.
    pub fn put_env(&self, env: &str, info: &EnvInfo, chunks: &[String]) -> Result<(), IndexError> {
        let _stripe = self.stripe(env.as_bytes());
        if self.db.get_pinned_cf(self.cf("envs"), env)?.is_some() {
            return Ok(());
        }
        let mut b = WriteBatch::default();
        b.put_cf(
            self.cf("envs"),
            env,
            serde_json::to_vec(info).expect("env info serializes"),
        );
        self.count(&mut b, counter::ENVS, 1);
        self.count(&mut b, counter::ENV_BYTES, info.device_size);
        self.count(&mut b, counter::ENV_CHUNK_BYTES, info.chunk_bytes);
        let refs = self.cf("chunk_refs");
        let one = 1u64.to_le_bytes();
        for c in chunks.iter().collect::<HashSet<_>>() {
            b.merge_cf(refs, c, one);
        }
        // Derived data: not synced (lost with a crash, it is noted again on the next view).
        self.db.write(b)?;
        Ok(())
    }

    /// Env digests some image maps to that were never noted (`put_env`), from `after`
    /// on, at most `n`: what a background pass notes after an upgrade.
    pub fn envs_to_note(
        &self,
        after: Option<&str>,
        n: usize,
    ) -> Result<(Vec<String>, Option<String>), IndexError> {
        let start = after.unwrap_or("");
        let mut out = Vec::new();
        let envs = self.cf("envs");
        for item in self.db.iterator_cf(
            self.cf("image_envs"),
            IteratorMode::From(start.as_bytes(), rocksdb::Direction::Forward),
        ) {
            let (k, v) = item?;
            if after.is_some_and(|a| k.as_ref() == a.as_bytes()) {
                continue;
            }
            if self.db.get_pinned_cf(envs, &v)?.is_none() {
                out.push(String::from_utf8_lossy(&v).into_owned());
            }
            if out.len() == n {
                return Ok((out, Some(String::from_utf8_lossy(&k).into_owned())));
            }
        }
        Ok((out, None))
    }

    /// Of `chunks` (distinct ids), those that more than one env names, and their stored bytes.
    pub fn sharing(&self, chunks: &[String]) -> Result<Sharing, IndexError> {
        let refs = self.cf("chunk_refs");
        let sizes = self.cf("chunks");
        let mut shared = Vec::new();
        for (id, got) in chunks.iter().zip(
            self.db
                .multi_get_cf(chunks.iter().map(|c| (refs, c.as_bytes()))),
        ) {
            if got?.as_deref().map_or(0, decode_u64) > 1 {
                shared.push(id);
            }
        }
        let mut s = Sharing {
            chunks: shared.len() as u64,
            bytes: 0,
        };
        for got in self
            .db
            .multi_get_cf(shared.iter().map(|c| (sizes, c.as_bytes())))
        {
            s.bytes += got?.as_deref().map_or(0, decode_u64);
        }
        Ok(s)
    }

    /// Ends the wait of chunk `id` for recompression: it is now `stored` bytes (its
    /// size as the index knew it when not). The totals follow: the store's chunk bytes,
    /// and the envs' chunk bytes once per env naming it. Returns whether it was waiting.
    pub fn recompressed(&self, id: &str, stored: u64) -> Result<bool, IndexError> {
        let _stripe = self.stripe(id.as_bytes());
        let mut b = WriteBatch::default();
        if self.db.get_pinned_cf(self.cf("recompress"), id)?.is_none() {
            return Ok(false);
        }
        b.delete_cf(self.cf("recompress"), id);
        self.count(&mut b, counter::TO_RECOMPRESS, u64::MAX); // -1, wrapping
        if let Some(old) = self.chunk(id)? {
            // Counters add wrapping: the difference as a u64 subtracts when negative.
            let delta = stored.wrapping_sub(old);
            let refs = (self.db.get_pinned_cf(self.cf("chunk_refs"), id)?)
                .as_deref()
                .map_or(0, decode_u64);
            self.count(&mut b, counter::CHUNK_BYTES, delta);
            self.count(&mut b, counter::ENV_CHUNK_BYTES, delta.wrapping_mul(refs));
        }
        b.put_cf(self.cf("chunks"), id, stored.to_le_bytes());
        self.db.write(b)?;
        Ok(true)
    }

    /// Records the stored bytes at `hour` (hours since the epoch) in the history.
    pub fn record_stored_bytes(&self, hour: u64, bytes: u64) -> Result<(), IndexError> {
        self.db.put_cf(
            self.cf("stats_history"),
            hour.to_be_bytes(),
            bytes.to_le_bytes(),
        )?;
        Ok(())
    }

    /// The last `n` points of the stored-bytes history, oldest first: (hour, bytes).
    pub fn stored_bytes_history(&self, n: usize) -> Result<Vec<(u64, u64)>, IndexError> {
        let mut out = Vec::new();
        for item in self
            .db
            .iterator_cf(self.cf("stats_history"), IteratorMode::End)
            .take(n)
        {
            let (k, v) = item?;
            if let Ok(h) = <[u8; 8]>::try_from(&k[..]) {
                out.push((u64::from_be_bytes(h), decode_u64(&v)));
            }
        }
        out.reverse();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{ManifestRecord, ManifestWrite};
    use amber_oci::digest::{Algorithm, Digest};
    use amber_oci::names::RepoName;

    fn chunk(i: u8) -> String {
        format!("blake3:{}", hex::encode([i; 32]))
    }

    /// A chunk written at a conversion's fast level waits once; recompressed to fewer
    /// bytes, the store's bytes and (once per env naming it) the envs' bytes follow.
    #[test]
    fn a_recompressed_chunk_moves_the_totals_by_its_difference() {
        let dir = tempfile::tempdir().unwrap();
        let ix = Index::open(dir.path()).unwrap();
        let info = EnvInfo {
            device_size: 4096,
            filesystem: "erofs".into(),
            extents: 1,
            chunks: 1,
            chunk_bytes: 10,
        };
        assert!(ix.put_chunk(&chunk(3), 10, true).unwrap());
        assert!(!ix.put_chunk(&chunk(3), 10, true).unwrap());
        ix.put_env("blake3:e3", &info, &[chunk(3)]).unwrap();
        ix.put_env("blake3:e4", &info, &[chunk(3)]).unwrap();
        assert_eq!(ix.chunks_to_recompress(None, 10).unwrap(), [chunk(3)]);
        assert!(ix
            .chunks_to_recompress(Some(&chunk(3)), 10)
            .unwrap()
            .is_empty());
        let t = ix.totals().unwrap();
        assert_eq!(
            (t.chunks_to_recompress, t.chunk_bytes, t.env_chunk_bytes),
            (1, 10, 20)
        );
        assert!(ix.recompressed(&chunk(3), 4).unwrap());
        assert!(!ix.recompressed(&chunk(3), 4).unwrap());
        let t = ix.totals().unwrap();
        assert_eq!(
            (t.chunks_to_recompress, t.chunk_bytes, t.env_chunk_bytes),
            (0, 4, 8)
        );
        assert_eq!(ix.chunk(&chunk(3)).unwrap(), Some(4));
        assert!(ix.chunks_to_recompress(None, 10).unwrap().is_empty());
    }

    #[test]
    fn each_blob_chunk_image_and_env_counts_once_and_an_older_index_is_counted_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let ix = Index::open(dir.path()).unwrap();
        assert_eq!(ix.totals().unwrap(), Totals::default());
        let (a, b) = (RepoName::parse("a").unwrap(), RepoName::parse("b").unwrap());
        let layer = Digest::of(Algorithm::Sha256, b"layer");
        // The same blob linked into two repositories, twice: one blob.
        for r in [&a, &b, &a] {
            ix.put_blob(r, &layer, 100).unwrap();
        }
        let m = Digest::of(Algorithm::Sha256, b"manifest");
        for r in [&a, &b] {
            ix.put_manifest(ManifestWrite {
                repo: r,
                digest: &m,
                record: ManifestRecord {
                    media_type: "application/vnd.oci.image.manifest.v1+json".into(),
                    size: 10,
                    source: None,
                },
                tag: None,
                tag_immutable: false,
                referrer: None,
            })
            .unwrap();
        }
        for (id, n) in [(chunk(1), 7), (chunk(2), 5), (chunk(1), 7)] {
            ix.put_chunk(&id, n, false).unwrap();
        }
        let done = crate::index::Conversion {
            repo: "a".into(),
            state: crate::index::ConversionState::Done,
            error: None,
            env_digest: Some("blake3:e1".into()),
            updated_unix: 2,
            started_unix: Some(1),
        };
        ix.finish_conversion(&m, "blake3:e1", &done).unwrap();
        ix.finish_conversion(&m, "blake3:e1", &done).unwrap();
        let info = EnvInfo {
            device_size: 4096,
            filesystem: "erofs".into(),
            extents: 3,
            chunks: 2,
            chunk_bytes: 12,
        };
        ix.put_env("blake3:e1", &info, &[chunk(1), chunk(2)])
            .unwrap();
        ix.put_env("blake3:e1", &info, &[chunk(1), chunk(2)])
            .unwrap();
        let second = EnvInfo {
            chunks: 1,
            chunk_bytes: 7,
            ..info.clone()
        };
        ix.put_env("blake3:e2", &second, &[chunk(1)]).unwrap();
        let want = Totals {
            blobs: 2,
            blob_bytes: 110,
            chunks: 2,
            chunk_bytes: 12,
            images: 1,
            envs: 2,
            env_bytes: 8192,
            env_chunk_bytes: 19,
            chunks_to_recompress: 0,
        };
        assert_eq!(ix.totals().unwrap(), want);
        assert_eq!(want.stored_bytes(), 122);
        assert_eq!(want.dedup_ratio(), Some(19.0 / 12.0));
        assert_eq!(ix.env("blake3:e1").unwrap(), Some(info.clone()));
        // chunk 1 is named by both envs, chunk 2 by one.
        assert_eq!(
            ix.sharing(&[chunk(1), chunk(2)]).unwrap(),
            Sharing {
                chunks: 1,
                bytes: 7
            }
        );

        // An index from before totals: its counters are made from what it holds at open
        // (envs are noted again as they are looked at).
        let stats = ix.cf("stats");
        for k in [
            counter::BLOBS,
            counter::BLOB_BYTES,
            counter::CHUNKS,
            counter::CHUNK_BYTES,
            counter::IMAGES,
            counter::COUNTED,
        ] {
            ix.db.delete_cf(stats, k).unwrap();
        }
        drop(ix);
        let ix = Index::open(dir.path()).unwrap();
        assert_eq!(ix.totals().unwrap(), want);
    }

    #[test]
    fn history_keeps_the_latest_points_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let ix = Index::open(dir.path()).unwrap();
        for (h, b) in [(10, 1), (12, 3), (11, 2), (12, 4)] {
            ix.record_stored_bytes(h, b).unwrap();
        }
        assert_eq!(ix.stored_bytes_history(2).unwrap(), [(11, 2), (12, 4)]);
        assert_eq!(
            ix.stored_bytes_history(9).unwrap(),
            [(10, 1), (11, 2), (12, 4)]
        );
    }

    #[test]
    fn a_search_scans_a_bounded_range_and_says_where_to_go_on() {
        let dir = tempfile::tempdir().unwrap();
        let ix = Index::open(dir.path()).unwrap();
        for i in 0..30 {
            ix.put_repo(&RepoName::parse(&format!("team/r{i:02}")).unwrap())
                .unwrap();
        }
        ix.put_repo(&RepoName::parse("zeta/node-app").unwrap())
            .unwrap();
        let all = |_: &str| true;
        // Case-insensitive, past every other name.
        assert_eq!(
            ix.search_repos("NODE", None, 10, 1000, &all).unwrap(),
            (vec!["zeta/node-app".to_string()], None)
        );
        // A budget of 10 names: nothing found yet, and where the next page starts.
        let (found, next) = ix.search_repos("node", None, 10, 10, &all).unwrap();
        assert!(found.is_empty());
        assert_eq!(next.as_deref(), Some("team/r09"));
        let (found, _) = ix
            .search_repos("node", next.as_deref(), 10, 1000, &all)
            .unwrap();
        assert_eq!(found, ["zeta/node-app"]);
        // Pages of a browse (empty needle) follow one another without a gap.
        let (p1, next) = ix.search_repos("", None, 20, 1000, &all).unwrap();
        let (p2, end) = ix
            .search_repos("", next.as_deref(), 20, 1000, &all)
            .unwrap();
        assert_eq!(p1.len() + p2.len(), 31);
        assert_eq!(p2.last().map(String::as_str), Some("zeta/node-app"));
        assert_eq!(end, None);
        // What `keep` refuses is never listed.
        let (found, _) = ix
            .search_repos("", None, 50, 1000, &|r: &str| r.ends_with('7'))
            .unwrap();
        assert_eq!(found, ["team/r07", "team/r17", "team/r27"]);
    }
}
