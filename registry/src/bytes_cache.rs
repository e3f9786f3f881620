//! A map from keys to byte values held in memory within a budget of bytes, in front of a
//! slower source (a file read, a database lookup, an S3 GET): split into shards, each
//! behind its own lock, so readers on many cores seldom meet; in each shard the least
//! recently read value goes first.
//!
//! Invariants kept here:
//! - the bytes held (values, keys and a fixed cost per entry) stay within the budget; a
//!   value larger than an eighth of a shard's budget is not held, so one large value
//!   cannot push out thousands of small ones;
//! - a value read from the source before a write never lands in the cache after that
//!   write. A reader that missed holds the [`Ticket`] [`get`](BytesCache::get) gave it
//!   while it reads the source, and [`fill`](BytesCache::fill)s with it; the fill is
//!   dropped if a write ([`set`](BytesCache::set), [`remove`](BytesCache::remove))
//!   reached the key's shard in between. A writer writes the source first and the cache
//!   after, so once its write returns the cache holds the new value or none.

use std::borrow::Borrow;
use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::{Mutex, MutexGuard};

use bytes::Bytes;
use lru::LruCache;

/// Shards of a cache.
const SHARDS: usize = 16;
/// What an entry costs beside its key and value: the LRU list's node and the map's slot.
const ENTRY_COST: usize = 64;

struct Shard<K> {
    entries: LruCache<K, Bytes>,
    /// Bytes the entries cost (values, keys, `ENTRY_COST` each).
    held: usize,
    /// Writes to this shard so far: a fill from before one is dropped.
    writes: u64,
}

/// Lets the reader that missed fill the cache after reading the source, unless a write
/// came in between.
#[must_use]
pub struct Ticket {
    shard: usize,
    writes: u64,
}

pub struct BytesCache<K> {
    shards: Vec<Mutex<Shard<K>>>,
    shard_budget: usize,
    hasher: RandomState,
    /// Bytes a key costs (its heap and inline size).
    key_cost: fn(&K) -> usize,
}

impl<K: Hash + Eq> BytesCache<K> {
    /// A cache holding at most `budget` bytes (0: holds nothing); `key_cost` is what a key
    /// costs in memory.
    pub fn new(budget: usize, key_cost: fn(&K) -> usize) -> BytesCache<K> {
        BytesCache {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        entries: LruCache::unbounded(),
                        held: 0,
                        writes: 0,
                    })
                })
                .collect(),
            shard_budget: budget / SHARDS,
            hasher: RandomState::new(),
            key_cost,
        }
    }

    fn shard_of<Q: Hash + ?Sized>(&self, key: &Q) -> usize {
        self.hasher.hash_one(key) as usize % SHARDS
    }

    fn lock(&self, shard: usize) -> MutexGuard<'_, Shard<K>> {
        // A panic under the lock leaves at worst `held` off by one entry: keep serving.
        self.shards[shard]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The value of `key` if held; else the ticket to fill it with once read.
    pub fn get<Q>(&self, key: &Q) -> Result<Bytes, Ticket>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let shard = self.shard_of(key);
        let mut s = self.lock(shard);
        match s.entries.get(key) {
            Some(v) => Ok(v.clone()),
            None => Err(Ticket {
                shard,
                writes: s.writes,
            }),
        }
    }

    /// The value of `key`: held, else what `read` gets from the source (then held). For a
    /// source read synchronously; an async one uses [`get`](Self::get) and
    /// [`fill`](Self::fill) around its await.
    pub fn get_or_read<Q, E>(
        &self,
        key: &Q,
        read: impl FnOnce() -> Result<Option<Bytes>, E>,
    ) -> Result<Option<Bytes>, E>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let ticket = match self.get(key) {
            Ok(v) => return Ok(Some(v)),
            Err(ticket) => ticket,
        };
        let value = read()?;
        if let Some(v) = &value {
            self.fill(ticket, key.to_owned(), v.clone());
        }
        Ok(value)
    }

    /// Holds `value`, read from the source after `ticket` was given for `key`, unless a
    /// write reached the key's shard since.
    pub fn fill(&self, ticket: Ticket, key: K, value: Bytes) {
        let mut s = self.lock(ticket.shard);
        if s.writes == ticket.writes {
            self.put(&mut s, key, value);
        }
    }

    /// Holds `value` as `key`'s, just written to the source.
    pub fn set(&self, key: K, value: Bytes) {
        let mut s = self.lock(self.shard_of(&key));
        s.writes += 1;
        self.put(&mut s, key, value);
    }

    /// Forgets `key`, just removed from the source.
    pub fn remove<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let mut s = self.lock(self.shard_of(key));
        s.writes += 1;
        if let Some((k, v)) = s.entries.pop_entry(key) {
            s.held -= self.cost(&k, &v);
        }
    }

    fn cost(&self, key: &K, value: &Bytes) -> usize {
        value.len() + (self.key_cost)(key) + ENTRY_COST
    }

    fn put(&self, s: &mut Shard<K>, key: K, value: Bytes) {
        let cost = self.cost(&key, &value);
        if let Some((k, v)) = s.entries.pop_entry(&key) {
            s.held -= self.cost(&k, &v);
        }
        if cost > self.shard_budget / 8 {
            return;
        }
        s.held += cost;
        s.entries.put(key, value);
        while s.held > self.shard_budget {
            match s.entries.pop_lru() {
                Some((k, v)) => s.held -= self.cost(&k, &v),
                None => break,
            }
        }
    }

    /// Bytes the entries cost, and how many there are (tests, diagnostics).
    pub fn held(&self) -> (usize, usize) {
        (0..SHARDS).fold((0, 0), |(b, n), i| {
            let s = self.lock(i);
            (b + s.held, n + s.entries.len())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(budget: usize) -> BytesCache<String> {
        BytesCache::new(budget, String::len)
    }

    fn fill_from(c: &BytesCache<String>, key: &str, source: &str) {
        if let Err(t) = c.get(key) {
            c.fill(t, key.to_string(), Bytes::from(source.to_string()));
        }
    }

    #[test]
    fn holds_what_it_read_and_stays_within_its_budget() {
        let c = cache(SHARDS * 4096);
        for i in 0..2000 {
            fill_from(&c, &format!("k{i}"), &format!("value of k{i}"));
        }
        let (bytes, n) = c.held();
        assert!(
            bytes <= SHARDS * 4096,
            "{bytes} bytes held over a budget of {}",
            SHARDS * 4096
        );
        assert!(n > 0 && n < 2000, "{n} entries held");
        for i in 0..2000 {
            if let Ok(v) = c.get(format!("k{i}").as_str()) {
                assert_eq!(
                    v,
                    format!("value of k{i}"),
                    "k{i} holds another key's value"
                );
            }
        }
    }

    #[test]
    fn a_read_keeps_an_entry_over_one_not_read() {
        // Entries of one shard: 8 of them fill its budget.
        let c = cache(SHARDS * 8 * (ENTRY_COST + 20));
        let shard = c.shard_of("k0");
        let keys: Vec<String> = (0..10_000)
            .map(|i| format!("k{i}"))
            .filter(|k| c.shard_of(k.as_str()) == shard)
            .take(9)
            .collect();
        let value = |k: &str| Bytes::from(format!("{k:<20}").into_bytes()[..20 - k.len()].to_vec());
        for k in &keys[..8] {
            c.set(k.clone(), value(k));
        }
        assert!(c.get(keys[0].as_str()).is_ok(), "read: now the most recent");
        c.set(keys[8].clone(), value(&keys[8]));
        assert!(c.get(keys[0].as_str()).is_ok(), "read last, kept");
        assert!(
            c.get(keys[1].as_str()).is_err(),
            "least recently read, dropped"
        );
    }

    #[test]
    fn a_value_read_before_a_write_never_lands_after_it() {
        let c = cache(1 << 20);
        // A reader misses and reads the old value; a write lands; the reader fills.
        let ticket = c.get("tag").expect_err("empty cache");
        c.set("tag".to_string(), Bytes::from_static(b"new"));
        c.fill(ticket, "tag".to_string(), Bytes::from_static(b"old"));
        assert_eq!(c.get("tag").ok(), Some(Bytes::from_static(b"new")));
        // The same with a removal in between: the key stays unheld.
        let ticket = c.get("gone").expect_err("empty cache");
        c.remove("gone");
        c.fill(ticket, "gone".to_string(), Bytes::from_static(b"old"));
        assert!(c.get("gone").is_err());
        // No write in between: the fill is held.
        let ticket = c.get("quiet").expect_err("empty cache");
        c.fill(ticket, "quiet".to_string(), Bytes::from_static(b"v"));
        assert_eq!(c.get("quiet").ok(), Some(Bytes::from_static(b"v")));
    }

    #[test]
    fn a_write_replaces_and_a_removal_forgets() {
        let c = cache(1 << 20);
        c.set("k".to_string(), Bytes::from_static(b"one"));
        c.set("k".to_string(), Bytes::from_static(b"two"));
        assert_eq!(c.get("k").ok(), Some(Bytes::from_static(b"two")));
        assert_eq!(c.held(), (3 + 1 + ENTRY_COST, 1));
        c.remove("k");
        assert_eq!(c.held(), (0, 0));
    }

    #[test]
    fn a_value_too_large_for_its_share_is_not_held_and_nothing_with_no_budget() {
        let c = cache(SHARDS * 8 * 1000);
        c.set("big".to_string(), Bytes::from(vec![0; 1001]));
        assert_eq!(c.held(), (0, 0));
        c.set("fits".to_string(), Bytes::from(vec![0; 900]));
        assert_eq!(c.held().1, 1);
        let none = cache(0);
        none.set("k".to_string(), Bytes::from_static(b"v"));
        assert_eq!(none.held(), (0, 0));
    }
}
