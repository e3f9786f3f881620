//! Registry configuration: defaults, then a TOML file, then `AMBER_*` environment
//! variables, then command-line flags, each overriding the one before.
//!
//! The file may nest (`[s3] endpoint = …`); every key also exists as a flat `AMBER_*`
//! variable (`AMBER_S3_ENDPOINT`), as the README's configuration table lists.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

/// Default zstd level of the chunks conversions write (`chunk_zstd_level`). Only chunks
/// the store does not have yet are compressed, but a task image still brings megabytes
/// of new files, and compressing them is most of a conversion's CPU. Corpus benchmark
/// (200 task images, 2 cores, pushed in turn, conversions beside the pushes): level 9
/// stores 8% less than level 3, which keeps the store under half of distribution's; the
/// corpus was usable 105 s after the first push, against 79 s with level 3 (level 6, in
/// another run: 102 s against level 9's 108 s, for 1.6% more bytes).
pub const CHUNK_ZSTD_LEVEL: i32 = 9;
/// Default of `convert_zstd_level`: the level a conversion first writes new chunks at.
/// The corpus benchmark, level 1 against level 9 at conversion: usable after 57 s
/// against 91 s (distribution's push: 22 s), 89 s of the registry's CPU against 161 s,
/// for 8-12% more chunk bytes until they are recompressed.
pub const CONVERT_ZSTD_LEVEL: i32 = 1;
/// Default of `convert_line`. A lined-up image costs about 200 bytes (its digest, twice):
/// 4,096 of them under 1 MiB. Unbounded, the line held every image of a backlog: 660,000
/// images queued behind a push of 750,000 would have been about 130 MiB.
pub const CONVERT_LINE: usize = 4096;

/// Default bytes of manifests held in memory for GETs (`manifest_cache_bytes`): about
/// 50,000 task-image manifests of a kilobyte or so. With it full, the registry peaked at
/// 379-407 MiB at a million images (pushing, reading; BENCHMARKS.md, goal under 512 MiB).
pub const MANIFEST_CACHE_BYTES: usize = 64 << 20;

/// Which object store backend holds content.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum StorageKind {
    Fs,
    S3,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    pub endpoint: Option<String>,
    pub bucket: Option<String>,
    pub region: Option<String>,
    pub path_style: Option<bool>,
    pub prefix: Option<String>,
    /// Answer blob and chunk GETs with redirects to presigned URLs (clients then read
    /// straight from the bucket).
    pub redirect: Option<bool>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
}

/// The configuration file, every key optional.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<SocketAddr>,
    pub data: Option<PathBuf>,
    pub storage: Option<StorageKind>,
    pub s3: Option<S3Config>,
    pub auth: Option<String>,
    pub users: Option<PathBuf>,
    pub token_ttl_secs: Option<u64>,
    pub header_timeout_secs: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
    pub max_blob_bytes: Option<u64>,
    pub max_concurrent_uploads: Option<usize>,
    pub max_convert_secs: Option<u64>,
    pub max_image_entries: Option<u64>,
    pub upload_ttl_secs: Option<u64>,
    pub max_manifest_bytes: Option<usize>,
    pub manifest_cache_bytes: Option<usize>,
    pub immutable_tags: Option<Vec<String>>,
    pub convert_workers: Option<usize>,
    pub convert_line: Option<usize>,
    pub chunk_zstd_level: Option<i32>,
    pub convert_zstd_level: Option<i32>,
    pub conversion_lease_secs: Option<u64>,
    pub upstreams: Option<Vec<String>>,
    pub upstream_auth_file: Option<PathBuf>,
}

/// Flags of `amber-registry serve` (and fsck), each also an `AMBER_*` variable.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ConfigArgs {
    /// TOML configuration file.
    #[arg(long, env = "AMBER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, env = "AMBER_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Data directory: the object store (fs backend) and the RocksDB index.
    #[arg(long, env = "AMBER_DATA")]
    pub data: Option<PathBuf>,
    /// Object store backend.
    #[arg(long, env = "AMBER_STORAGE", value_enum)]
    pub storage: Option<StorageKind>,
    #[arg(long, env = "AMBER_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    #[arg(long, env = "AMBER_S3_BUCKET")]
    pub s3_bucket: Option<String>,
    #[arg(long, env = "AMBER_S3_REGION")]
    pub s3_region: Option<String>,
    #[arg(long, env = "AMBER_S3_PATH_STYLE")]
    pub s3_path_style: Option<bool>,
    /// Prefix of every key in the bucket (several registries can share one).
    #[arg(long, env = "AMBER_S3_PREFIX")]
    pub s3_prefix: Option<String>,
    /// Redirect blob and chunk downloads to presigned S3 URLs.
    #[arg(long, env = "AMBER_S3_REDIRECT")]
    pub s3_redirect: Option<bool>,
    /// Static credentials; without them the standard AWS provider chain is used.
    #[arg(long, env = "AMBER_S3_ACCESS_KEY_ID")]
    pub s3_access_key_id: Option<String>,
    #[arg(long, env = "AMBER_S3_SECRET_ACCESS_KEY", hide_env_values = true)]
    pub s3_secret_access_key: Option<String>,
    /// Authentication: `none` (loopback only) or `token` (accounts of the users file,
    /// with Basic auth and the Docker token flow at /token).
    #[arg(long, env = "AMBER_AUTH")]
    pub auth: Option<String>,
    /// The users file (TOML `[[user]]` tables; `amber-registry user add` writes it).
    #[arg(long, env = "AMBER_USERS")]
    pub users: Option<PathBuf>,
    /// Lifetime of the bearer tokens /token issues, in seconds.
    #[arg(long, env = "AMBER_TOKEN_TTL_SECS")]
    pub token_ttl_secs: Option<u64>,
    /// Seconds a client has to send a request's headers.
    #[arg(long, env = "AMBER_HEADER_TIMEOUT_SECS")]
    pub header_timeout_secs: Option<u64>,
    /// Longest pause, in seconds, in reading from or writing to a connection.
    #[arg(long, env = "AMBER_IDLE_TIMEOUT_SECS")]
    pub idle_timeout_secs: Option<u64>,
    /// Largest blob a client may upload, in bytes.
    #[arg(long, env = "AMBER_MAX_BLOB_BYTES")]
    pub max_blob_bytes: Option<u64>,
    /// Upload requests (PATCH, PUT and single-request POST) served at once; more get 429.
    #[arg(long, env = "AMBER_MAX_CONCURRENT_UPLOADS")]
    pub max_concurrent_uploads: Option<usize>,
    /// Longest conversion of one image, in seconds; longer ones fail.
    #[arg(long, env = "AMBER_MAX_CONVERT_SECS")]
    pub max_convert_secs: Option<u64>,
    /// Most file system entries in one converted image.
    #[arg(long, env = "AMBER_MAX_IMAGE_ENTRIES")]
    pub max_image_entries: Option<u64>,
    /// Seconds after its last request at which an abandoned upload session is removed.
    #[arg(long, env = "AMBER_UPLOAD_TTL_SECS")]
    pub upload_ttl_secs: Option<u64>,
    /// Largest manifest accepted, in bytes.
    #[arg(long, env = "AMBER_MAX_MANIFEST_BYTES")]
    pub max_manifest_bytes: Option<usize>,
    /// Bytes of manifests held in memory for GETs (0: no copies at all, in memory or in
    /// the index: every GET reads the store; see `manifest_cache`).
    #[arg(long, env = "AMBER_MANIFEST_CACHE_BYTES")]
    pub manifest_cache_bytes: Option<usize>,
    /// Repositories whose tags never move once set: exact names, or prefixes ending in
    /// `/*` or `*`. Comma separated.
    #[arg(long, env = "AMBER_IMMUTABLE_TAGS", value_delimiter = ',')]
    pub immutable_tags: Option<Vec<String>>,
    /// Images converted at once (0 queues conversions without running them).
    #[arg(long, env = "AMBER_CONVERT_WORKERS")]
    pub convert_workers: Option<usize>,
    /// Images one replica lines up in memory for its workers (at least 1); more wait
    /// in the shared queue in the store, taken as the line empties.
    #[arg(long, env = "AMBER_CONVERT_LINE")]
    pub convert_line: Option<usize>,
    /// zstd level (1-19) of the chunks conversions write: lower converts faster and
    /// stores more (BENCHMARKS.md, "Conversion that costs only what is new").
    #[arg(long, env = "AMBER_CHUNK_ZSTD_LEVEL")]
    pub chunk_zstd_level: Option<i32>,
    /// zstd level (1-19) a conversion first writes new chunks at: when it is below
    /// `chunk_zstd_level`, an image is usable sooner and the registry recompresses its
    /// new chunks at `chunk_zstd_level` while no conversion is waiting (equal: no
    /// recompression).
    #[arg(long, env = "AMBER_CONVERT_ZSTD_LEVEL")]
    pub convert_zstd_level: Option<i32>,
    /// Seconds a replica holds a conversion without renewing its lease; after that any
    /// replica over the same store may take the conversion over (a replica that died).
    #[arg(long, env = "AMBER_CONVERSION_LEASE_SECS")]
    pub conversion_lease_secs: Option<u64>,
    /// Registries this one pulls through: the first request for
    /// `<host>/<name>:<tag>` (in amber `<mirror prefix>/<name>`, e.g.
    /// `docker.io/library/python`) imports it. Each `host` or `host=URL` (the URL to
    /// reach it at; default `https://host`, `http://` for loopback hosts). Comma separated.
    #[arg(long, env = "AMBER_UPSTREAMS", value_delimiter = ',')]
    pub upstreams: Option<Vec<String>>,
    /// Credentials for the upstreams: a file in Docker's `config.json` format.
    #[arg(long, env = "AMBER_UPSTREAM_AUTH_FILE")]
    pub upstream_auth_file: Option<PathBuf>,
}

/// The resolved configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub data: PathBuf,
    pub storage: StorageKind,
    pub s3: S3Config,
    pub auth: String,
    pub users: Option<PathBuf>,
    pub token_ttl_secs: u64,
    pub header_timeout_secs: u64,
    pub idle_timeout_secs: u64,
    pub max_blob_bytes: u64,
    pub max_concurrent_uploads: usize,
    pub max_convert_secs: u64,
    pub max_image_entries: u64,
    pub upload_ttl_secs: u64,
    pub max_manifest_bytes: usize,
    pub manifest_cache_bytes: usize,
    pub immutable_tags: Vec<String>,
    pub convert_workers: usize,
    /// The most images lined up in this process beyond its running conversions
    /// (`convert_queue`): memory for the line stays bounded however long the queue.
    pub convert_line: usize,
    pub chunk_zstd_level: i32,
    pub convert_zstd_level: i32,
    pub conversion_lease_secs: u64,
    pub upstreams: Vec<crate::mirrors::UpstreamSpec>,
    pub upstream_auth_file: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            listen: "127.0.0.1:5000".parse().expect("literal address"),
            data: PathBuf::from("./data"),
            storage: StorageKind::Fs,
            s3: S3Config::default(),
            auth: "none".into(),
            users: None,
            token_ttl_secs: 300,
            header_timeout_secs: 30,
            idle_timeout_secs: 120,
            max_blob_bytes: 64 << 30,
            max_concurrent_uploads: 256,
            max_convert_secs: 3600,
            max_image_entries: 10_000_000,
            upload_ttl_secs: 24 * 3600,
            max_manifest_bytes: 4 * 1024 * 1024,
            manifest_cache_bytes: MANIFEST_CACHE_BYTES,
            immutable_tags: Vec::new(),
            // As many as cores, and at least four: converting a task image over bases
            // converted before is mostly waiting for the fsyncs of its small outputs
            // (3,000 synthetic images on 2 cores, push to all converted: 65-88 s with one
            // worker, 69 s with two, 49 s with four, 45 s with eight).
            convert_workers: std::thread::available_parallelism()
                .map(|n| n.get().max(4))
                .unwrap_or(4),
            convert_line: CONVERT_LINE,
            chunk_zstd_level: CHUNK_ZSTD_LEVEL,
            convert_zstd_level: CONVERT_ZSTD_LEVEL,
            conversion_lease_secs: 60,
            upstreams: Vec::new(),
            upstream_auth_file: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

impl ConfigArgs {
    /// Merges defaults, the file named by `--config`, and these flags/variables.
    pub fn resolve(&self) -> Result<Config, ConfigError> {
        let file = match &self.config {
            None => FileConfig::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                toml::from_str(&text).map_err(|source| ConfigError::Parse {
                    path: path.clone(),
                    source,
                })?
            }
        };
        let d = Config::default();
        let fs3 = file.s3.clone().unwrap_or_default();
        let mut cfg = Config {
            listen: self.listen.or(file.listen).unwrap_or(d.listen),
            data: self.data.clone().or(file.data).unwrap_or(d.data),
            storage: self.storage.or(file.storage).unwrap_or(d.storage),
            s3: S3Config {
                endpoint: self.s3_endpoint.clone().or(fs3.endpoint),
                bucket: self.s3_bucket.clone().or(fs3.bucket),
                region: self.s3_region.clone().or(fs3.region),
                path_style: self.s3_path_style.or(fs3.path_style),
                prefix: self.s3_prefix.clone().or(fs3.prefix),
                redirect: self.s3_redirect.or(fs3.redirect),
                access_key_id: self.s3_access_key_id.clone().or(fs3.access_key_id),
                secret_access_key: self.s3_secret_access_key.clone().or(fs3.secret_access_key),
            },
            auth: self.auth.clone().or(file.auth).unwrap_or(d.auth),
            users: self.users.clone().or(file.users),
            token_ttl_secs: self
                .token_ttl_secs
                .or(file.token_ttl_secs)
                .unwrap_or(d.token_ttl_secs),
            header_timeout_secs: self
                .header_timeout_secs
                .or(file.header_timeout_secs)
                .unwrap_or(d.header_timeout_secs),
            idle_timeout_secs: self
                .idle_timeout_secs
                .or(file.idle_timeout_secs)
                .unwrap_or(d.idle_timeout_secs),
            max_blob_bytes: self
                .max_blob_bytes
                .or(file.max_blob_bytes)
                .unwrap_or(d.max_blob_bytes),
            max_concurrent_uploads: self
                .max_concurrent_uploads
                .or(file.max_concurrent_uploads)
                .unwrap_or(d.max_concurrent_uploads),
            max_convert_secs: self
                .max_convert_secs
                .or(file.max_convert_secs)
                .unwrap_or(d.max_convert_secs),
            max_image_entries: self
                .max_image_entries
                .or(file.max_image_entries)
                .unwrap_or(d.max_image_entries),
            upload_ttl_secs: self
                .upload_ttl_secs
                .or(file.upload_ttl_secs)
                .unwrap_or(d.upload_ttl_secs),
            max_manifest_bytes: self
                .max_manifest_bytes
                .or(file.max_manifest_bytes)
                .unwrap_or(d.max_manifest_bytes),
            manifest_cache_bytes: self
                .manifest_cache_bytes
                .or(file.manifest_cache_bytes)
                .unwrap_or(d.manifest_cache_bytes),
            immutable_tags: self
                .immutable_tags
                .clone()
                .or(file.immutable_tags)
                .unwrap_or_default(),
            convert_workers: self
                .convert_workers
                .or(file.convert_workers)
                .unwrap_or(d.convert_workers),
            convert_line: self
                .convert_line
                .or(file.convert_line)
                .unwrap_or(d.convert_line)
                .max(1),
            chunk_zstd_level: self
                .chunk_zstd_level
                .or(file.chunk_zstd_level)
                .unwrap_or(d.chunk_zstd_level),
            convert_zstd_level: self
                .convert_zstd_level
                .or(file.convert_zstd_level)
                .unwrap_or(d.convert_zstd_level),
            conversion_lease_secs: self
                .conversion_lease_secs
                .or(file.conversion_lease_secs)
                .unwrap_or(d.conversion_lease_secs)
                .max(1),
            upstreams: self
                .upstreams
                .clone()
                .or(file.upstreams)
                .unwrap_or_default()
                .iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| s.parse())
                .collect::<Result<_, _>>()
                .map_err(|e: crate::mirrors::SpecError| ConfigError::Invalid(e.to_string()))?,
            upstream_auth_file: self.upstream_auth_file.clone().or(file.upstream_auth_file),
        };
        match cfg.auth.as_str() {
            "none" => {}
            "token" if cfg.users.is_none() => {
                return Err(ConfigError::Invalid(
                    "auth `token` needs a users file (`users`, AMBER_USERS)".into(),
                ))
            }
            "token" => {}
            other => {
                return Err(ConfigError::Invalid(format!(
                    "auth {other:?} is not one of: none, token"
                )))
            }
        }
        if !(1..=19).contains(&cfg.chunk_zstd_level) {
            return Err(ConfigError::Invalid(format!(
                "chunk_zstd_level {} is not a zstd level from 1 to 19",
                cfg.chunk_zstd_level
            )));
        }
        if !(1..=19).contains(&cfg.convert_zstd_level) {
            return Err(ConfigError::Invalid(format!(
                "convert_zstd_level {} is not a zstd level from 1 to 19",
                cfg.convert_zstd_level
            )));
        }
        // A conversion never writes chunks smaller than they are to be stored.
        cfg.convert_zstd_level = cfg.convert_zstd_level.min(cfg.chunk_zstd_level);
        if cfg.auth == "none" && !cfg.listen.ip().is_loopback() {
            return Err(ConfigError::Invalid(format!(
                "refusing to listen on {} without authentication: use a loopback address",
                cfg.listen
            )));
        }
        if cfg.storage == StorageKind::S3 {
            if cfg.s3.bucket.as_deref().unwrap_or("").is_empty() {
                return Err(ConfigError::Invalid(
                    "storage `s3` needs a bucket (`s3_bucket`, AMBER_S3_BUCKET)".into(),
                ));
            }
            if cfg.s3.access_key_id.is_some() != cfg.s3.secret_access_key.is_some() {
                return Err(ConfigError::Invalid(
                    "give both s3_access_key_id and s3_secret_access_key, or neither (the standard AWS chain)".into(),
                ));
            }
        }
        Ok(cfg)
    }
}

impl Config {
    /// The S3 backend's settings (valid once `storage` is `s3`).
    pub fn s3_settings(&self) -> crate::store::s3::S3Settings {
        let s = &self.s3;
        crate::store::s3::S3Settings {
            endpoint: s.endpoint.clone(),
            bucket: s.bucket.clone().unwrap_or_default(),
            region: s.region.clone().unwrap_or_else(|| "us-east-1".into()),
            // Custom endpoints are S3-compatible servers: path style unless told otherwise.
            path_style: s.path_style.unwrap_or(s.endpoint.is_some()),
            prefix: s.prefix.clone().unwrap_or_default(),
            credentials: s.access_key_id.clone().zip(s.secret_access_key.clone()),
        }
    }

    /// Whether tags of `repo` are immutable under `immutable_tags`.
    pub fn tags_immutable(&self, repo: &str) -> bool {
        self.immutable_tags
            .iter()
            .any(|p| match p.strip_suffix('*') {
                Some(prefix) => repo.starts_with(prefix),
                None => repo == p,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_then_flags_override_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("amber.toml");
        std::fs::write(
            &path,
            "data = \"/srv/amber\"\nupload_ttl_secs = 60\nimmutable_tags = [\"prod/*\"]\n[s3]\nbucket = \"b\"\n",
        )
        .unwrap();
        let args = ConfigArgs {
            config: Some(path),
            upload_ttl_secs: Some(5),
            ..Default::default()
        };
        let c = args.resolve().unwrap();
        assert_eq!(c.data, PathBuf::from("/srv/amber"));
        assert_eq!(c.upload_ttl_secs, 5);
        assert_eq!(c.s3.bucket.as_deref(), Some("b"));
        assert_eq!(c.listen.to_string(), "127.0.0.1:5000");
        assert!(c.tags_immutable("prod/x"));
        assert!(!c.tags_immutable("dev/x"));
    }

    #[test]
    fn bad_config_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("amber.toml");
        std::fs::write(&path, "listne = \"x\"\n").unwrap();
        let err = ConfigArgs {
            config: Some(path),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("listne"), "{err}");
        let err = ConfigArgs {
            listen: Some("0.0.0.0:5000".parse().unwrap()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("without authentication"), "{err}");
        let err = ConfigArgs {
            storage: Some(StorageKind::S3),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("needs a bucket"), "{err}");
        let err = ConfigArgs {
            storage: Some(StorageKind::S3),
            s3_bucket: Some("b".into()),
            s3_access_key_id: Some("k".into()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("or neither"), "{err}");
        for level in [0, 20, -3] {
            let err = ConfigArgs {
                chunk_zstd_level: Some(level),
                ..Default::default()
            }
            .resolve()
            .unwrap_err();
            assert!(err.to_string().contains("from 1 to 19"), "{err}");
            let err = ConfigArgs {
                convert_zstd_level: Some(level),
                ..Default::default()
            }
            .resolve()
            .unwrap_err();
            assert!(
                err.to_string()
                    .contains(&format!("convert_zstd_level {level} is not a zstd level")),
                "{err}"
            );
        }
        // A conversion level above the stored one is the stored one: recompression
        // never makes a chunk larger.
        let cfg = ConfigArgs {
            chunk_zstd_level: Some(3),
            convert_zstd_level: Some(9),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!((cfg.chunk_zstd_level, cfg.convert_zstd_level), (3, 3));
    }

    #[test]
    fn s3_settings_default_to_path_style_for_custom_endpoints() {
        let c = ConfigArgs {
            storage: Some(StorageKind::S3),
            s3_bucket: Some("b".into()),
            s3_endpoint: Some("http://127.0.0.1:9000".into()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        let s = c.s3_settings();
        assert!(s.path_style);
        assert_eq!((s.region.as_str(), s.credentials), ("us-east-1", None));
    }
}
