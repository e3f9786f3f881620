//! The node's storage as its sandboxes see it: one chunk cache for the whole process
//! (one fetch per chunk however many sandboxes read it, one size bound), and one lazy,
//! verified NBD export per env, shared by every sandbox booted from that env.
//!
//! Invariants kept here:
//! - an env has at most one live export in a process; it is served on
//!   `<node>/exports/<env>.sock` while any sandbox holds it and removed with the last;
//! - every export reads through the one cache, so the cache's bound is the process's;
//! - every env this node has opened is remembered in `<node>/envs/<env hex>.json` (its
//!   chunks and their sizes), so the node can say how much of it its cache holds.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use amber_api::node::CachedEnv;
use amber_converter::manifest::{BlockManifest, EnvDigest, ManifestEnvelope};
use amber_oci::env::ChunkId;
use amber_snapshotter::cache::{CacheError, ChunkCache};
use amber_snapshotter::device::LazyDevice;
use amber_snapshotter::source::{RegistryClient, RegistrySource, SourceError};

/// Chunks a prefetch fetches at once.
const PREFETCH_FETCHES: usize = 8;

/// The node cache's size bound.
pub const NODE_CACHE_BYTES: u64 = 20 << 30;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("env {env} is not in the registry at {registry}")]
    EnvNotFound { env: EnvDigest, registry: String },
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("prefetching {env}: {source}")]
    Prefetch {
        env: EnvDigest,
        #[source]
        source: Arc<CacheError>,
    },
    #[error("serving the export of {env} on {path}: {source}")]
    Socket {
        env: EnvDigest,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// One env's export: its device and the NBD server on its socket.
pub struct Export {
    pub env: EnvDigest,
    pub socket: PathBuf,
    pub device: Arc<LazyDevice>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Export {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The process's cache and exports for one registry.
pub struct Exports {
    dir: PathBuf,
    registry: String,
    source: Arc<RegistrySource>,
    cache: Arc<ChunkCache>,
    live: tokio::sync::Mutex<HashMap<EnvDigest, Weak<Export>>>,
    envs_dir: PathBuf,
    known: std::sync::Mutex<HashMap<EnvDigest, Arc<EnvChunks>>>,
}

/// An env's distinct chunks and their sizes.
type EnvChunks = Vec<(ChunkId, u64)>;

/// An env's distinct chunks and their sizes.
fn chunks_of(m: &BlockManifest) -> Vec<(ChunkId, u64)> {
    let mut seen = std::collections::HashSet::new();
    m.extents
        .iter()
        .filter(|e| seen.insert(e.chunk))
        .map(|e| (e.chunk, e.length))
        .collect()
}

impl Exports {
    /// Opens the node cache under `<node>/chunks` for chunks of `registry`.
    pub async fn open(node: &Path, registry: &RegistryClient) -> Result<Exports, ExportError> {
        let source = Arc::new(RegistrySource::new(registry));
        let (dir, src) = (node.join("chunks"), source.clone());
        let cache =
            tokio::task::spawn_blocking(move || ChunkCache::open(dir, NODE_CACHE_BYTES, src))
                .await
                .expect("cache open task")?;
        let envs_dir = node.join("envs");
        let mut known = HashMap::new();
        for e in std::fs::read_dir(&envs_dir).into_iter().flatten().flatten() {
            let parsed = std::fs::read(e.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<(EnvDigest, Vec<(ChunkId, u64)>)>(&b).ok());
            if let Some((env, chunks)) = parsed {
                known.insert(env, Arc::new(chunks));
            }
        }
        Ok(Exports {
            envs_dir,
            known: std::sync::Mutex::new(known),
            dir: node.join("exports"),
            registry: registry.base().to_string(),
            source,
            cache: Arc::new(cache),
            live: tokio::sync::Mutex::new(HashMap::new()),
        })
    }

    pub fn registry(&self) -> &str {
        &self.registry
    }

    pub fn cache(&self) -> &Arc<ChunkCache> {
        &self.cache
    }

    /// Remembers `m` as the manifest of `env` (in memory and under `envs/`).
    fn remember(&self, env: &EnvDigest, m: &BlockManifest) {
        if self.known.lock().unwrap().contains_key(env) {
            return;
        }
        let chunks = chunks_of(m);
        let _ = std::fs::create_dir_all(&self.envs_dir);
        let path = self.envs_dir.join(format!("{}.json", env.hex()));
        let tmp = path.with_extension("tmp");
        let body = serde_json::to_vec(&(env, &chunks)).expect("json");
        if std::fs::write(&tmp, body).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
        self.known.lock().unwrap().insert(*env, Arc::new(chunks));
    }

    /// `env`'s manifest from the registry; `EnvNotFound` when it has none.
    async fn manifest(&self, env: &EnvDigest) -> Result<ManifestEnvelope, ExportError> {
        match self.source.manifest(env).await {
            Err(SourceError::NotFound(_)) => Err(ExportError::EnvNotFound {
                env: *env,
                registry: self.registry.clone(),
            }),
            r => Ok(r?),
        }
    }

    /// Fetches `env`'s manifest to know its size, without serving it.
    pub async fn learn(&self, env: &EnvDigest) -> Result<(), ExportError> {
        let envelope = self.manifest(env).await?;
        self.remember(env, &envelope.manifest);
        Ok(())
    }

    /// The envs this node has served or learned.
    pub fn known_envs(&self) -> Vec<EnvDigest> {
        let mut v: Vec<EnvDigest> = self.known.lock().unwrap().keys().copied().collect();
        v.sort_by_key(|e| e.to_string());
        v
    }

    /// How much of `env` the cache holds; `None` for an env this node does not know.
    pub fn cached(&self, env: &EnvDigest) -> Option<CachedEnv> {
        let chunks = self.known.lock().unwrap().get(env)?.clone();
        let mut c = CachedEnv {
            env_digest: env.to_string(),
            chunks: chunks.len() as u64,
            cached_chunks: 0,
            bytes: 0,
            cached_bytes: 0,
        };
        for (id, len) in chunks.iter() {
            c.bytes += len;
            if self.cache.contains(id) {
                c.cached_chunks += 1;
                c.cached_bytes += len;
            }
        }
        Some(c)
    }

    /// Puts every chunk of `env` in the cache, fetching (and verifying) the ones it lacks,
    /// `PREFETCH_FETCHES` at a time. `progress` is called after each chunk with the chunk
    /// bytes fetched so far; the total is returned. The env's manifest is fetched first
    /// if this node does not know it.
    pub async fn prefetch(
        &self,
        env: &EnvDigest,
        mut progress: impl FnMut(u64),
    ) -> Result<u64, ExportError> {
        use futures_util::StreamExt;
        let known = self.known.lock().unwrap().get(env).cloned();
        let chunks = match known {
            Some(c) => c,
            None => {
                self.learn(env).await?;
                self.known.lock().unwrap()[env].clone()
            }
        };
        let cache = self.cache.clone();
        let mut done = futures_util::stream::iter(chunks.to_vec())
            .map(move |(id, len)| {
                let cache = cache.clone();
                async move {
                    cache
                        .prefetch(&id, len)
                        .await
                        .map(|f| if f { len } else { 0 })
                }
            })
            .buffer_unordered(PREFETCH_FETCHES);
        let mut fetched = 0;
        while let Some(r) = done.next().await {
            fetched += r.map_err(|source| ExportError::Prefetch { env: *env, source })?;
            progress(fetched);
        }
        Ok(fetched)
    }

    /// The export of `env`, started if no sandbox holds it yet.
    pub async fn export(&self, env: &EnvDigest) -> Result<Arc<Export>, ExportError> {
        let mut live = self.live.lock().await;
        if let Some(e) = live.get(env).and_then(Weak::upgrade) {
            return Ok(e);
        }
        live.retain(|_, w| w.strong_count() > 0);
        let envelope = self.manifest(env).await?;
        self.remember(env, &envelope.manifest);
        let device = Arc::new(LazyDevice::new(envelope.manifest, self.cache.clone()));
        let socket = self
            .dir
            .join(format!("{}-{}.sock", &env.hex()[..24], std::process::id()));
        let bind = || {
            std::fs::create_dir_all(&self.dir)?;
            let _ = std::fs::remove_file(&socket);
            tokio::net::UnixListener::bind(&socket)
        };
        let listener = bind().map_err(|source| ExportError::Socket {
            env: *env,
            path: socket.clone(),
            source,
        })?;
        let task = tokio::spawn(amber_snapshotter::nbd::serve(
            listener,
            "amber".into(),
            device.clone(),
        ));
        let export = Arc::new(Export {
            env: *env,
            socket,
            device,
            task,
        });
        live.insert(*env, Arc::downgrade(&export));
        Ok(export)
    }
}
