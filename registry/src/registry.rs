//! The registry's shared state: configuration, index, object store and the in-memory
//! hash state of open upload sessions (their records are `uploads`').

use std::collections::{HashMap, HashSet};
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
    sessions: Mutex<HashMap<String, SessionLock>>,
    /// Bounds the conversions running at once.
    pub convert_slots: Arc<tokio::sync::Semaphore>,
    /// Accounts and tokens when authentication is on (`auth = "token"`).
    pub auth: Option<crate::auth::Auth>,
    /// Bounds the upload requests served at once (`max_concurrent_uploads`).
    pub upload_slots: Arc<tokio::sync::Semaphore>,
    /// The registries this one imports from and pulls through to.
    pub upstreams: crate::mirrors::Upstreams,
    /// This replica's id in conversion leases; stable across restarts (`<data>/replica-id`).
    pub replica_id: String,
    /// Images this process is converting (or waiting for a worker to convert).
    converting: Mutex<HashSet<Digest>>,
}

impl Registry {
    pub fn new(config: Config, index: Index, store: Arc<dyn ObjectStore>) -> Registry {
        Registry {
            convert_slots: Arc::new(tokio::sync::Semaphore::new(config.convert_workers.max(1))),
            upload_slots: Arc::new(tokio::sync::Semaphore::new(config.max_concurrent_uploads)),
            upstreams: crate::mirrors::Upstreams::new(
                config.upstreams.clone(),
                config.upstream_auth_file.clone(),
            ),
            config,
            index,
            store,
            sessions: Mutex::new(HashMap::new()),
            auth: None,
            replica_id: uuid::Uuid::new_v4().to_string(),
            converting: Mutex::new(HashSet::new()),
        }
    }

    /// Marks `image` as converting in this process; false if it was already.
    pub fn start_converting(&self, image: &Digest) -> bool {
        self.converting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(image.clone())
    }

    pub fn stop_converting(&self, image: &Digest) {
        self.converting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(image);
    }

    pub fn is_converting(&self, image: &Digest) -> bool {
        self.converting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(image)
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
