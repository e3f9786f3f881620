//! amber's registry: an OCI Distribution v1.1 server over an immutable,
//! content-addressed object store, with a RocksDB metadata index.
//!
//! Layers, each importing only those below it:
//! - `server` (startup, signals, connection limits) over `api` (HTTP only: routing,
//!   access checks, translating requests into repository calls and errors into the
//!   spec's responses); nothing else imports `api`;
//! - `repository` (push a manifest: validate, store, link, tag, queue conversion),
//!   `convert` (converting one image), `convert_queue` (the conversion queue shared by
//!   replicas: work items, leases), `fsck`, `reindex`: the domain, called by the
//!   handlers and the command-line tools alike;
//! - `ui` (the catalog pages under `/ui/`: HTML over the same domain calls, the same
//!   accounts and rights), reached only through `api`'s dispatcher;
//! - `envs` (env summaries, sharing, the stored-bytes history);
//! - `recipe` (uncompressed layer blobs kept as references to the chunks that hold
//!   their files, and reading any blob whichever way it is kept);
//! - `records` (repository records: the store's truth that the index caches),
//!   `uploads` (upload session records, recovery and expiry), `registry` (shared state,
//!   opening), `auth` (accounts, tokens);
//! - `store` (object store trait and backends), `index` (RocksDB metadata), `config`,
//!   `metrics`, `clock`, `blocking` (short blocking calls from async code).
//!
//! Digests, names, references, media types and manifest parsing are `amber_oci`'s.

pub mod api;
pub mod auth;
pub mod blocking;
pub mod bytes_cache;
pub mod chain_flight;
pub mod clock;
pub mod config;
pub mod convert;
pub mod convert_queue;
pub mod docker_config;
pub mod envs;
pub mod fsck;
pub mod index;
pub mod manifest_cache;
pub mod metrics;
pub mod mirrors;
pub mod recipe;
pub mod recompress;
pub mod records;
pub mod registry;
pub mod reindex;
pub mod repository;
pub mod server;
pub mod store;
pub mod stripes;
pub mod ui;
pub mod uploads;
pub mod upstream;
