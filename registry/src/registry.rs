//! The registry's shared state: configuration, index, object store and the in-memory
//! hash state of open upload sessions; recovery of upload sessions after a restart and
//! expiry of abandoned ones.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use std::time::Duration;

use anyhow::Context;

use crate::config::{Config, StorageKind};
use crate::index::{Index, IndexError};
use crate::store::fs::FsStore;
use crate::store::{ObjectStore, StoreError};
use amber_oci::digest::{Algorithm, Hasher};

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
        }
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

    /// Brings upload sessions and staged data back into agreement after a restart:
    /// staged bytes past the acknowledged offset (an interrupted request) are cut off,
    /// sessions whose data is gone are dropped, staged data without a session is removed.
    /// Returns (sessions kept, sessions dropped, orphans removed).
    pub async fn recover_uploads(&self) -> Result<(usize, usize, usize), RegistryError> {
        let sessions = self.index.uploads()?;
        let (mut kept, mut dropped) = (0, 0);
        for (id, mut s) in sessions.iter().cloned() {
            match self.store.staged_len(&id).await? {
                None if s.offset == 0 => kept += 1,
                None => {
                    self.index.delete_upload(&id)?;
                    dropped += 1;
                }
                Some(len) if len > s.offset => {
                    self.store.truncate_staged(&id, s.offset).await?;
                    kept += 1;
                }
                Some(len) if len < s.offset => {
                    // Cannot happen when the disk honours fsync; keep what is really there.
                    s.offset = len;
                    self.index.put_upload(&id, &s)?;
                    kept += 1;
                }
                Some(_) => kept += 1,
            }
        }
        let known: std::collections::HashSet<&str> =
            sessions.iter().map(|(id, _)| id.as_str()).collect();
        let mut orphans = 0;
        for id in self.store.list_staged().await? {
            if !known.contains(id.as_str()) {
                self.store.remove_staged(&id).await?;
                orphans += 1;
            }
        }
        Ok((kept, dropped, orphans))
    }

    /// Removes sessions idle for `upload_ttl_secs` or more at time `now`, with their data.
    pub async fn expire_uploads(&self, now: u64) -> Result<usize, RegistryError> {
        let mut n = 0;
        for (id, s) in self.index.uploads()? {
            if s.updated_unix.saturating_add(self.config.upload_ttl_secs) > now {
                continue;
            }
            let lock = self.session_lock(&id);
            let Ok(_guard) = lock.try_lock() else {
                continue; // a request is using it right now: not abandoned
            };
            self.store.remove_staged(&id).await?;
            self.index.delete_upload(&id)?;
            self.forget_session(&id);
            n += 1;
        }
        if n > 0 {
            metrics::counter!(crate::metrics::UPLOAD_SESSIONS_EXPIRED).increment(n as u64);
            tracing::info!(expired = n, "removed abandoned upload sessions");
        }
        Ok(n)
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
    let mut reg = Registry::new(config, index, store);
    reg.auth = auth;
    Ok(Arc::new(reg))
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
    use crate::index::UploadSession;
    use crate::store::fs::FsStore;
    use futures_util::stream;

    fn registry(dir: &std::path::Path, ttl: u64) -> Registry {
        let config = Config {
            data: dir.to_path_buf(),
            upload_ttl_secs: ttl,
            ..Config::default()
        };
        let index = Index::open(&dir.join("index")).unwrap();
        let store = Arc::new(FsStore::open(dir.join("store")).unwrap());
        Registry::new(config, index, store)
    }

    async fn session(reg: &Registry, id: &str, updated: u64, data: &'static [u8], acked: u64) {
        let s = UploadSession {
            repo: "r".into(),
            offset: acked,
            created_unix: updated,
            updated_unix: updated,
        };
        reg.index.put_upload(id, &s).unwrap();
        let body = Box::pin(stream::iter([Ok(bytes::Bytes::from_static(data))]));
        reg.store
            .append_staged(id, 0, body, &mut |_| {})
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn abandoned_sessions_expire_with_their_data() {
        let dir = tempfile::tempdir().unwrap();
        let reg = registry(dir.path(), 3600);
        let (old, fresh) = (
            "00000000-0000-0000-0000-0000000000a1",
            "00000000-0000-0000-0000-0000000000a2",
        );
        session(&reg, old, 1_000, b"old", 3).await;
        session(&reg, fresh, 5_000, b"fresh", 5).await;
        assert_eq!(
            reg.expire_uploads(4_599).await.unwrap(),
            0,
            "nothing idle for an hour yet"
        );
        assert_eq!(reg.expire_uploads(4_600).await.unwrap(), 1);
        assert_eq!(reg.index.upload(old).unwrap(), None);
        assert_eq!(
            reg.store.staged_len(old).await.unwrap(),
            None,
            "its data is removed"
        );
        assert!(reg.index.upload(fresh).unwrap().is_some());
        assert_eq!(reg.store.staged_len(fresh).await.unwrap(), Some(5));
    }

    #[tokio::test]
    async fn recovery_cuts_unacknowledged_bytes_and_drops_orphans() {
        let dir = tempfile::tempdir().unwrap();
        let reg = registry(dir.path(), 3600);
        let (a, b) = (
            "00000000-0000-0000-0000-0000000000b1",
            "00000000-0000-0000-0000-0000000000b2",
        );
        session(&reg, a, 1, b"acked+unacked", 5).await;
        // Staged data without a session: a crash between staging and indexing.
        let body = Box::pin(stream::iter([Ok(bytes::Bytes::from_static(b"orphan"))]));
        reg.store
            .append_staged(b, 0, body, &mut |_| {})
            .await
            .unwrap();
        // A session whose data is gone (published just before a crash).
        let gone = UploadSession {
            repo: "r".into(),
            offset: 9,
            created_unix: 1,
            updated_unix: 1,
        };
        reg.index
            .put_upload("00000000-0000-0000-0000-0000000000b3", &gone)
            .unwrap();
        assert_eq!(reg.recover_uploads().await.unwrap(), (1, 1, 1));
        assert_eq!(reg.store.staged_len(a).await.unwrap(), Some(5));
        assert_eq!(reg.store.staged_len(b).await.unwrap(), None);
    }
}
