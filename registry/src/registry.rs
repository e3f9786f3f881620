//! The registry's shared state: configuration, index, object store and the in-memory
//! hash state of open upload sessions (their records are `uploads`').

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use std::time::Duration;

use anyhow::Context;

use crate::config::{Config, StorageKind};
use crate::index::{Index, IndexError};
use crate::store::fs::FsStore;
use crate::store::{ObjectStore, StoreError};
use amber_oci::digest::{Algorithm, Digest, Hasher};

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The running hash of an upload session. Valid when `hashed` equals the session's
/// acknowledged offset; otherwise the digest is recomputed from the staged bytes.
pub struct HashState {
    pub hasher: Hasher,
    pub hashed: u64,
}

impl HashState {
    pub fn new() -> HashState {
        HashState {
            hasher: Algorithm::Sha256.hasher(),
            hashed: 0,
        }
    }
}

impl Default for HashState {
    fn default() -> Self {
        Self::new()
    }
}

pub type SessionLock = Arc<tokio::sync::Mutex<Option<HashState>>>;

pub struct Registry {
    pub config: Config,
    pub index: Index,
    pub store: Arc<dyn ObjectStore>,
    /// The bytes of manifests served lately (`manifest_cache_bytes`).
    pub manifests: crate::manifest_cache::ManifestCache,
    sessions: Mutex<HashMap<String, SessionLock>>,
    /// Accounts and tokens when authentication is on (`auth = "token"`).
    pub auth: Option<crate::auth::Auth>,
    /// Bounds the upload requests served at once (`max_concurrent_uploads`).
    pub upload_slots: Arc<tokio::sync::Semaphore>,
    /// The registries this one imports from and pulls through to.
    pub upstreams: crate::mirrors::Upstreams,
    /// This replica's id in conversion leases; stable across restarts (`<data>/replica-id`).
    pub replica_id: String,
    /// The conversions this process runs or has lined up (`convert_queue`).
    converting: Mutex<LocalConversions>,
    /// Notified when this process's line of conversions ran low after it refused images
    /// (`Taken::Full`): the sweeper then takes more from the shared queue at once.
    pub conversion_refill: tokio::sync::Notify,
    /// Notified when this process's last running conversion ends with none lined up
    /// (`recompress` waits for it).
    pub conversions_settled: tokio::sync::Notify,
    /// Cancelled when the server stops: background loops end, conversions stop at their
    /// next read or chunk write (their work items stay for a restart or another replica).
    pub stopping: tokio_util::sync::CancellationToken,
    /// The background tasks (conversion workers, sweeps) `stop_background` waits for, so
    /// none of them holds the index when the process ends.
    pub background: tokio_util::task::TaskTracker,
    /// Chunks this process's conversions wrote whole with `put_batched` and have not yet
    /// recorded in the index (their batch is not synced), with whether each waits for
    /// recompression: another conversion that finds one trusts it without reading it.
    pub(crate) unsynced_chunks: Mutex<HashMap<amber_converter::manifest::ChunkId, bool>>,
    /// Layer chains whose states this process's running conversions will keep.
    pub chains_in_flight: Arc<crate::chain_flight::ChainsInFlight>,
}

/// This process's share of the conversion queue: the images its workers are converting
/// (at most `convert_workers`) and the images lined up for the next free worker, oldest
/// first (at most `convert_line`). A lined-up image costs its digest, not a task waiting
/// on a semaphore; an image past the line costs nothing here: its work item in the store
/// is the queue.
#[derive(Default)]
struct LocalConversions {
    running: HashSet<Digest>,
    waiting: VecDeque<Digest>,
    lined_up: HashSet<Digest>,
    /// An image was refused because the line was full, and the sweeper has not been
    /// asked to refill since.
    refused: bool,
}

/// What `Registry::take_conversion` did with an image.
#[derive(Debug, PartialEq, Eq)]
pub enum Taken {
    /// A worker is free: the caller starts converting it now.
    Start,
    /// Lined up for the next free worker.
    LinedUp,
    /// This process was converting it or had it lined up already.
    Already,
    /// Not taken: the line is full (or this process converts nothing), so the image
    /// stays in the shared queue for a later sweep or another replica.
    Full,
}

impl Registry {
    pub fn new(config: Config, index: Index, store: Arc<dyn ObjectStore>) -> Registry {
        Registry {
            upload_slots: Arc::new(tokio::sync::Semaphore::new(config.max_concurrent_uploads)),
            upstreams: crate::mirrors::Upstreams::new(
                config.upstreams.clone(),
                config.upstream_auth_file.clone(),
            ),
            manifests: crate::manifest_cache::ManifestCache::new(config.manifest_cache_bytes),
            config,
            index,
            store,
            sessions: Mutex::new(HashMap::new()),
            auth: None,
            replica_id: uuid::Uuid::new_v4().to_string(),
            converting: Mutex::new(LocalConversions::default()),
            conversion_refill: tokio::sync::Notify::new(),
            conversions_settled: tokio::sync::Notify::new(),
            stopping: tokio_util::sync::CancellationToken::new(),
            background: tokio_util::task::TaskTracker::new(),
            unsynced_chunks: Mutex::new(HashMap::new()),
            chains_in_flight: Default::default(),
        }
    }

    /// A registry over an index and an fs store in `config.data` (tests).
    #[cfg(test)]
    pub(crate) fn in_data_dir(config: Config) -> Registry {
        let index = Index::open(&config.data.join("index")).unwrap();
        let store = Arc::new(FsStore::open(config.data.join("store")).unwrap());
        Registry::new(config, index, store)
    }

    /// Runs `task(registry)` as background work that `stop_background` waits for; it ends
    /// by itself once `stopping` is cancelled (a conversion worker).
    pub fn spawn_tracked<F, Fut>(self: &Arc<Self>, task: F)
    where
        F: FnOnce(Arc<Registry>) -> Fut,
        Fut: std::future::Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        self.background.spawn(task(self.clone()));
    }

    /// Runs `task(registry)` in the background until it ends or the server stops (it is
    /// dropped at its next await then): for loops whose every step may be cut short.
    pub fn spawn_background<F, Fut>(self: &Arc<Self>, task: F)
    where
        F: FnOnce(Arc<Registry>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let stopping = self.stopping.clone();
        self.spawn_tracked(move |reg| stopping.run_until_cancelled_owned(task(reg)));
    }

    /// Stops the background work: cancels `stopping` and waits up to `grace` for the
    /// tracked tasks to end. Returns how many had not ended by then.
    pub async fn stop_background(&self, grace: Duration) -> usize {
        self.stopping.cancel();
        self.background.close();
        if tokio::time::timeout(grace, self.background.wait())
            .await
            .is_err()
        {
            return self.background.len();
        }
        0
    }

    /// Takes `image` into this process's conversions: to start now if fewer than
    /// `convert_workers` run, else lined up if fewer than `convert_line` are.
    pub fn take_conversion(&self, image: &Digest) -> Taken {
        let mut c = self.converting.lock().unwrap_or_else(|p| p.into_inner());
        if c.running.contains(image) || c.lined_up.contains(image) {
            Taken::Already
        } else if c.running.len() < self.config.convert_workers.max(1) {
            c.running.insert(image.clone());
            Taken::Start
        } else if c.waiting.len() >= self.config.convert_line {
            c.refused = true;
            Taken::Full
        } else {
            c.lined_up.insert(image.clone());
            c.waiting.push_back(image.clone());
            Taken::LinedUp
        }
    }

    /// Ends this process's conversion of `image`; returns the lined-up image the freed
    /// worker converts next, if any (it counts as running from here). Once the line is
    /// down to half after it refused images, asks the sweeper to refill it.
    pub fn next_conversion(&self, image: &Digest) -> Option<Digest> {
        let mut c = self.converting.lock().unwrap_or_else(|p| p.into_inner());
        c.running.remove(image);
        let next = c.waiting.pop_front();
        if let Some(next) = &next {
            c.lined_up.remove(next);
            c.running.insert(next.clone());
        }
        if c.refused && c.waiting.len() <= self.config.convert_line / 2 {
            c.refused = false;
            self.conversion_refill.notify_one();
        }
        if c.running.is_empty() {
            self.conversions_settled.notify_one();
        }
        next
    }

    /// Whether this process runs a conversion or has one lined up.
    pub fn converting_any(&self) -> bool {
        let c = self.converting.lock().unwrap_or_else(|p| p.into_inner());
        !c.running.is_empty() || !c.waiting.is_empty()
    }

    /// Whether this process is converting `image` or has it lined up.
    pub fn is_converting(&self, image: &Digest) -> bool {
        let c = self.converting.lock().unwrap_or_else(|p| p.into_inner());
        c.running.contains(image) || c.lined_up.contains(image)
    }

    /// The lock (and hash state) of session `id`; one request at a time per session.
    pub fn session_lock(&self, id: &str) -> SessionLock {
        let mut m = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(id.to_string()).or_default().clone()
    }

    pub fn forget_session(&self, id: &str) {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

/// Opens the index and the object store under the configured data directory.
pub async fn open(config: Config) -> anyhow::Result<Arc<Registry>> {
    std::fs::create_dir_all(&config.data)
        .with_context(|| format!("creating data directory {}", config.data.display()))?;
    let index_dir = config.data.join("index");
    let index = Index::open(&index_dir)
        .with_context(|| format!("opening index at {}", index_dir.display()))?;
    let store = open_store(&config).await?;
    let auth = match (config.auth.as_str(), &config.users) {
        ("token", Some(users)) => Some(
            crate::auth::Auth::open(
                users,
                &config.data.join("auth").join("token.key"),
                "amber".into(),
                Duration::from_secs(config.token_ttl_secs),
            )
            .context("loading accounts")?,
        ),
        _ => None,
    };
    let replica_id = replica_id(&config.data)?;
    let mut reg = Registry::new(config, index, store);
    reg.auth = auth;
    reg.replica_id = replica_id;
    Ok(Arc::new(reg))
}

/// This replica's id, made once and kept in `<data>/replica-id`.
fn replica_id(data: &std::path::Path) -> anyhow::Result<String> {
    let path = data.join("replica-id");
    match std::fs::read_to_string(&path) {
        Ok(id) if uuid::Uuid::try_parse(id.trim()).is_ok() => return Ok(id.trim().to_string()),
        Ok(_) => {
            tracing::warn!(path = %path.display(), "replica id is not a UUID; making a new one")
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let id = uuid::Uuid::new_v4().to_string();
    let tmp = data.join("replica-id.tmp");
    std::fs::write(&tmp, &id)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(id)
}

/// Opens the configured object store.
pub async fn open_store(config: &Config) -> anyhow::Result<Arc<dyn ObjectStore>> {
    Ok(match config.storage {
        StorageKind::Fs => {
            let root = config.data.join("store");
            Arc::new(
                FsStore::open(&root)
                    .with_context(|| format!("opening store at {}", root.display()))?,
            )
        }
        StorageKind::S3 => {
            let settings = config.s3_settings();
            Arc::new(
                crate::store::s3::S3Store::connect(&settings)
                    .await
                    .with_context(|| {
                        format!("opening the S3 store (bucket {})", settings.bucket)
                    })?,
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> Digest {
        format!("sha256:{}", hex::encode([n; 32])).parse().unwrap()
    }

    /// A registry in `dir` with `workers` conversion workers and a line of `line`.
    fn registry(dir: &std::path::Path, workers: usize, line: usize) -> Registry {
        let config = Config {
            data: dir.to_path_buf(),
            convert_workers: workers,
            convert_line: line,
            ..Config::default()
        };
        Registry::in_data_dir(config)
    }

    /// Two workers: the first two images start, the rest line up once each and go to
    /// the workers in arrival order as conversions end.
    #[test]
    fn conversions_beyond_the_workers_line_up_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let reg = registry(dir.path(), 2, crate::config::CONVERT_LINE);
        let [a, b, c, d] = [1, 2, 3, 4].map(digest);
        assert_eq!(reg.take_conversion(&a), Taken::Start);
        assert_eq!(reg.take_conversion(&b), Taken::Start);
        assert_eq!(reg.take_conversion(&c), Taken::LinedUp);
        assert_eq!(reg.take_conversion(&d), Taken::LinedUp);
        for x in [&a, &c, &d] {
            assert_eq!(reg.take_conversion(x), Taken::Already);
            assert!(reg.is_converting(x));
        }
        assert_eq!(reg.next_conversion(&b), Some(c.clone()));
        assert!(!reg.is_converting(&b));
        assert_eq!(reg.take_conversion(&c), Taken::Already);
        assert_eq!(reg.next_conversion(&a), Some(d.clone()));
        assert_eq!(reg.next_conversion(&c), None);
        assert_eq!(reg.take_conversion(&b), Taken::Start);
        assert_eq!(reg.take_conversion(&a), Taken::LinedUp);
    }

    /// One worker and a line of two: a fourth image is refused (it stays in the shared
    /// queue), and once the line is down to half the sweeper is asked for more, once.
    #[test]
    fn a_full_line_refuses_images_and_asks_for_more_when_half_empty() {
        let dir = tempfile::tempdir().unwrap();
        let reg = registry(dir.path(), 1, 2);
        let [a, b, c, d] = [1, 2, 3, 4].map(digest);
        assert_eq!(reg.take_conversion(&a), Taken::Start);
        assert_eq!(reg.take_conversion(&b), Taken::LinedUp);
        assert_eq!(reg.take_conversion(&c), Taken::LinedUp);
        assert_eq!(reg.take_conversion(&d), Taken::Full);
        assert!(
            !reg.is_converting(&d),
            "a refused image is not this process's"
        );
        // A request is a stored permit: a `notified()` polled once takes it.
        let refill_asked =
            || futures_util::FutureExt::now_or_never(reg.conversion_refill.notified()).is_some();
        assert!(!refill_asked(), "nothing asked before the line ran low");
        assert_eq!(reg.next_conversion(&a), Some(b.clone()));
        assert!(refill_asked(), "one of two left: the sweeper is asked");
        assert_eq!(reg.next_conversion(&b), Some(c.clone()));
        assert!(!refill_asked(), "asked once per refusal");
        assert_eq!(reg.take_conversion(&d), Taken::LinedUp);
        assert_eq!(reg.next_conversion(&c), Some(d.clone()));
        assert!(!refill_asked(), "nothing was refused since");
        assert_eq!(reg.next_conversion(&d), None);
    }
}
