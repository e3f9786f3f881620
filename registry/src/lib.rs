//! amber's registry: an OCI Distribution v1.1 server over an immutable,
//! content-addressed object store, with a RocksDB metadata index.
//!
//! Modules: `digest` and `names` (validated identifiers), `store` (object store trait
//! and backends), `index` (RocksDB metadata), `registry` (shared state, upload recovery
//! and expiry), `records` (repository records: the store's truth that the index caches),
//! `api` (HTTP handlers), `config`, `metrics`, `error`, `fsck`, `reindex`, `server`.

pub mod api;
pub mod auth;
pub mod config;
pub mod convert;
pub mod digest;
pub mod error;
pub mod fsck;
pub mod index;
pub mod metrics;
pub mod names;
pub mod records;
pub mod registry;
pub mod reindex;
pub mod server;
pub mod store;
