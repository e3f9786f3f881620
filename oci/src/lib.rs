//! amber's OCI vocabulary, shared by the registry, the converter, the node and the fuzz
//! targets: what every part means by a digest, a repository name, a reference, a media
//! type, a manifest and an image config.
//!
//! Pure by design: no I/O, no async, no network. Every parser here is bounded by its
//! input and returns a typed error naming what was wrong.
//!
//! Modules: `digest` (OCI content digests and a streaming hasher), `env` (amber's blake3
//! ids: `EnvDigest`, `ChunkId`), `names` (repository names, tags, manifest references and
//! `/v2/` routes), `reference` (what a user types: `name:tag`, `host/name@sha256:…`,
//! `blake3:…`, Docker short names), `media` (media types), `manifest` (validated image
//! manifests and indexes), `config` (the image config's run settings).

pub mod config;
pub mod digest;
pub mod env;
pub mod manifest;
pub mod media;
pub mod names;
pub mod reference;
