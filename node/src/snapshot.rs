//! Snapshots: a running sandbox's files committed as a new image in the registry, the
//! way `docker commit` makes one. The guest freezes its writable disk and writes the
//! overlay's upper directory as one OCI layer (`amber_guest::layer`); this module
//! writes it, uncompressed, into a file beside the sandbox, and pushes the sandbox's image
//! manifest with that layer added (config: one more diff id and history entry) as an
//! OCI image manifest. The registry converts it like any push, so a snapshot is pulled
//! with `docker pull`, pinned by digest, booted, forked and snapshotted again; the
//! chunks of unchanged files are the base's.
//!
//! Why uncompressed: the registry converts the layer into chunks and then keeps the
//! layer as a recipe over those chunks (`amber_registry::recipe`), which only an
//! uncompressed tar allows (a gzip stream's bytes depend on its compressor), so a
//! snapshot costs the registry about what the sandbox wrote, compressed once. It also
//! keeps the guest's disk frozen for less time: nothing is compressed while it waits.
//! Every Docker engine pulls uncompressed OCI layers.
//!
//! Lineage: the manifest's annotations name the base image (OCI's `base.name` and
//! `base.digest`) and the whole chain of bases with their env digests
//! (`image::PARENTS_ANNOTATION`), so a sandbox or a receipt made from a snapshot names
//! every image it came from without walking the registry.

use std::path::{Path, PathBuf};

use amber_api::node::Parent;
use amber_distribution::DistributionError;
use amber_guest::{DATA, ERROR, EXIT, SNAPSHOT};
use amber_oci::digest::{Algorithm, Digest, Hasher};
use amber_oci::media::{
    DOCKER_CONFIG, DOCKER_LAYER_GZIP, DOCKER_LAYER_TAR, OCI_CONFIG, OCI_LAYER_GZIP, OCI_LAYER_TAR,
    OCI_MANIFEST,
};
use amber_oci::reference::ImageRef;
use amber_snapshotter::source::RegistryClient;
use serde_json::{json, Value};

use crate::image::{self, ImageError, BASE_DIGEST_ANNOTATION, BASE_NAME_ANNOTATION};
use crate::mux::Mux;

/// Docker's foreign (non-distributable) layer type and its OCI name.
const DOCKER_FOREIGN_GZIP: &str = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip";
const OCI_NONDISTRIBUTABLE_GZIP: &str =
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip";

/// Why a snapshot was not taken.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{0}")]
    Refused(String),
    #[error("the guest could not snapshot the sandbox: {0}")]
    Guest(String),
    #[error("the sandbox's VM stopped during the snapshot")]
    VmGone,
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("pushing the snapshot: {source}{hint}")]
    Registry {
        #[source]
        source: DistributionError,
        hint: String,
    },
}

/// The sandbox's changes as an uncompressed tar layer file.
#[derive(Clone, Debug)]
pub struct Layer {
    pub path: PathBuf,
    /// sha256 of the file (the layer's digest in the manifest).
    pub digest: Digest,
    pub size: u64,
    /// The config's diff id: the same sha256, as the layer is not compressed.
    pub diff_id: Digest,
    pub diff_bytes: u64,
}

/// Counts and hashes what passes to the file.
struct HashingFile {
    file: std::io::BufWriter<std::fs::File>,
    hash: Hasher,
    bytes: u64,
}

impl std::io::Write for HashingFile {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(b)?;
        self.hash.update(&b[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Writes the tar pieces received on `rx` into `path`; the layer once `rx` ends.
fn write_layer(
    path: &Path,
    mut rx: tokio::sync::mpsc::Receiver<Vec<u8>>,
) -> std::io::Result<Layer> {
    use std::io::Write;
    let file = std::fs::File::create(path)?;
    let mut out = HashingFile {
        file: std::io::BufWriter::with_capacity(1 << 20, file),
        hash: Algorithm::Sha256.hasher(),
        bytes: 0,
    };
    while let Some(piece) = rx.blocking_recv() {
        out.write_all(&piece)?;
    }
    out.flush()?;
    let file = out.file.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    let digest = out.hash.finish();
    Ok(Layer {
        path: path.to_path_buf(),
        diff_id: digest.clone(),
        digest,
        size: out.bytes,
        diff_bytes: out.bytes,
    })
}

/// Asks the guest for its changes (it freezes its disk meanwhile) and writes them to
/// `path` as an uncompressed layer. Nothing is left at `path` on an error.
pub async fn take_layer(mux: &Mux, path: &Path) -> Result<Layer, SnapshotError> {
    let io = |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut s = mux.open();
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    let p = path.to_path_buf();
    let writer = tokio::task::spawn_blocking(move || write_layer(&p, rx));
    let request = serde_json::to_vec(&amber_guest::Snapshot::default()).expect("json");
    let mut tx = Some(tx);
    let mut failure: Option<SnapshotError> = None;
    let mut message = String::new();
    match s.tx.send(SNAPSHOT, &request).await {
        Err(_) => failure = Some(SnapshotError::VmGone),
        Ok(()) => loop {
            let Some(f) = s.recv().await else {
                failure = Some(SnapshotError::VmGone);
                break;
            };
            match f.kind {
                DATA if f.payload.is_empty() => drop(tx.take()),
                DATA => {
                    // A writer that failed stops reading: its error is reported below.
                    if let Some(t) = &tx {
                        if t.send(f.payload).await.is_err() {
                            tx = None;
                        }
                    }
                }
                ERROR => message.push_str(&String::from_utf8_lossy(&f.payload)),
                EXIT => {
                    let code = amber_guest::parse_status(&f.payload);
                    if code != 0 {
                        failure = Some(SnapshotError::Guest(if message.is_empty() {
                            format!("the agent exited {code}")
                        } else {
                            message.clone()
                        }));
                    }
                    break;
                }
                _ => {}
            }
        },
    }
    drop(tx);
    let written = writer.await.expect("the layer writer does not panic");
    let result = match (failure, written) {
        (Some(f), _) => Err(f),
        (None, Err(e)) => Err(io(e)),
        (None, Ok(layer)) => Ok(layer),
    };
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Where a snapshot's image goes: a repository, and the tag to move (if any).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub repository: String,
    pub tag: Option<String>,
}

/// The target of a snapshot of an image in `base_repository`: `tag` (`name` or
/// `name:tag`, on this node's registry) or, without one, the base's repository by
/// digest only.
pub fn target(
    registry: &RegistryClient,
    base_repository: &str,
    tag: Option<&str>,
) -> Result<Target, SnapshotError> {
    let Some(tag) = tag else {
        return Ok(Target {
            repository: base_repository.to_string(),
            tag: None,
        });
    };
    let bad = |why: String| SnapshotError::Refused(format!("tag {tag:?}: {why}"));
    match ImageRef::parse(tag).map_err(|e| bad(e.to_string()))? {
        ImageRef::Env(_) => Err(bad("give name or name:tag, not an env digest".into())),
        ImageRef::Image(n) if n.digest.is_some() => Err(bad(
            "give name or name:tag: a snapshot's digest is made, not chosen".into(),
        )),
        ImageRef::Image(n) => {
            if let Some(host) = &n.registry {
                if host != registry.distribution().host() {
                    return Err(bad(format!(
                        "names registry {host}, but this node uses {}",
                        registry.base()
                    )));
                }
            }
            Ok(Target {
                repository: n.repository.to_string(),
                tag: Some(n.tag.map_or_else(|| "latest".into(), |t| t.to_string())),
            })
        }
    }
}

/// The OCI media type of a layer listed in a (possibly Docker) manifest.
fn oci_layer_type(media_type: &str) -> &str {
    match media_type {
        DOCKER_LAYER_GZIP => OCI_LAYER_GZIP,
        DOCKER_LAYER_TAR => OCI_LAYER_TAR,
        DOCKER_FOREIGN_GZIP => OCI_NONDISTRIBUTABLE_GZIP,
        other => other,
    }
}

/// The image a snapshot is made on.
pub struct Base<'a> {
    pub repository: &'a str,
    pub image_digest: &'a Digest,
    pub env_digest: &'a str,
    /// The base's own lineage.
    pub parents: &'a [Parent],
}

/// What `commit` pushed.
#[derive(Clone, Debug)]
pub struct Committed {
    pub image_digest: Digest,
    /// `repository@sha256:…`
    pub reference: String,
    pub tag: Option<String>,
    pub parents: Vec<Parent>,
}

/// The snapshot's config: the base's, with the layer's diff id and a history entry.
fn config(base: &[u8], layer: &Layer, created: &str, sandbox: &str) -> Result<Vec<u8>, String> {
    let mut c: Value = serde_json::from_slice(base).map_err(|e| e.to_string())?;
    let obj = c.as_object_mut().ok_or("the config is not a JSON object")?;
    obj.insert("created".into(), created.into());
    let rootfs = obj
        .entry("rootfs")
        .or_insert_with(|| json!({"type": "layers", "diff_ids": []}));
    rootfs["diff_ids"]
        .as_array_mut()
        .ok_or("the config's rootfs has no diff_ids list")?
        .push(layer.diff_id.to_string().into());
    let history = obj.entry("history").or_insert_with(|| json!([]));
    if let Some(h) = history.as_array_mut() {
        h.push(json!({
            "created": created,
            "created_by": format!("amber snapshot {sandbox}"),
            "comment": "the sandbox's file changes",
        }));
    }
    Ok(serde_json::to_vec(&c).expect("json"))
}

/// Pushes the snapshot image: `base`'s manifest with `layer` on top, to `target`.
pub async fn commit(
    registry: &RegistryClient,
    base: &Base<'_>,
    layer: &Layer,
    target: &Target,
    sandbox: &str,
) -> Result<Committed, SnapshotError> {
    let docs = image::fetch_image(registry, base.repository, base.image_digest).await?;
    let created = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .expect("a time formats");
    let config_bytes = config(&docs.config_bytes, layer, &created, sandbox).map_err(|why| {
        SnapshotError::Image(ImageError::Invalid {
            object: "image config".into(),
            digest: docs.manifest.config().expect("an image").digest.to_string(),
            why,
        })
    })?;
    let config_digest = Digest::of(Algorithm::Sha256, &config_bytes);
    let mut layers: Vec<Value> = docs.manifest.document["layers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for l in &mut layers {
        let t = oci_layer_type(l["mediaType"].as_str().unwrap_or_default()).to_string();
        l["mediaType"] = t.into();
    }
    layers.push(json!({
        "mediaType": OCI_LAYER_TAR,
        "digest": layer.digest.to_string(),
        "size": layer.size,
    }));
    let base_name = format!("{}@{}", base.repository, base.image_digest);
    let mut parents = vec![Parent {
        image: base_name.clone(),
        env_digest: base.env_digest.to_string(),
    }];
    parents.extend(base.parents.iter().cloned());
    let config_type = match docs.manifest.config().map(|c| c.media_type.as_str()) {
        Some(DOCKER_CONFIG) | None => OCI_CONFIG,
        Some(t) => t,
    };
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": config_type,
            "digest": config_digest.to_string(),
            "size": config_bytes.len(),
        },
        "layers": layers,
        "annotations": {
            BASE_NAME_ANNOTATION: base_name,
            BASE_DIGEST_ANNOTATION: base.image_digest.to_string(),
            image::PARENTS_ANNOTATION: serde_json::to_string(&parents).expect("json"),
            "org.opencontainers.image.created": created,
            "dev.amber.snapshot.sandbox": sandbox,
        },
    });
    let manifest_bytes = serde_json::to_vec(&manifest).expect("json");
    let image_digest = Digest::of(Algorithm::Sha256, &manifest_bytes);

    let registry_error = |source: DistributionError| SnapshotError::Registry {
        hint: registry.denied_hint(&source, "push to"),
        source,
    };
    let repo = registry
        .distribution()
        .pusher(&target.repository)
        .await
        .map_err(registry_error)?;
    if target.repository != base.repository {
        for l in docs.manifest.layers() {
            repo.ensure_blob_from(&l.digest, base.repository)
                .await
                .map_err(registry_error)?;
        }
    }
    if !repo.has_blob(&layer.digest).await.map_err(registry_error)? {
        let file =
            tokio::fs::File::open(&layer.path)
                .await
                .map_err(|source| SnapshotError::Io {
                    path: layer.path.clone(),
                    source,
                })?;
        repo.upload(&layer.digest, Some(layer.size), reqwest::Body::from(file))
            .await
            .map_err(registry_error)?;
    }
    repo.push_bytes(config_bytes.into())
        .await
        .map_err(registry_error)?;
    let reference = target
        .tag
        .clone()
        .unwrap_or_else(|| image_digest.to_string());
    repo.put_manifest(&reference, manifest_bytes, OCI_MANIFEST)
        .await
        .map_err(registry_error)?;
    Ok(Committed {
        reference: format!("{}@{image_digest}", target.repository),
        image_digest,
        tag: target
            .tag
            .as_ref()
            .map(|t| format!("{}:{t}", target.repository)),
        parents,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer() -> Layer {
        let d = Digest::of(Algorithm::Sha256, b"tar");
        Layer {
            path: PathBuf::new(),
            digest: d.clone(),
            size: 3,
            diff_id: d,
            diff_bytes: 3,
        }
    }

    #[test]
    fn the_config_gains_a_diff_id_and_a_history_entry_and_keeps_the_rest() {
        let base = br#"{"architecture":"amd64","os":"linux","config":{"Env":["A=1"],"Cmd":["sh"]},"rootfs":{"type":"layers","diff_ids":["sha256:aa"]},"history":[{"created_by":"x"}],"x-extra":7}"#;
        let out: Value =
            serde_json::from_slice(&config(base, &layer(), "2026-12-01T00:00:00Z", "abc").unwrap())
                .unwrap();
        assert_eq!(out["config"]["Env"][0], "A=1");
        assert_eq!(out["x-extra"], 7);
        assert_eq!(out["created"], "2026-12-01T00:00:00Z");
        let ids = out["rootfs"]["diff_ids"].as_array().unwrap();
        assert_eq!(ids.len(), 2);
        assert_eq!(ids[1], layer().diff_id.to_string());
        assert_eq!(out["history"][1]["created_by"], "amber snapshot abc");
        assert!(config(b"[]", &layer(), "t", "abc").is_err());
        assert!(config(br#"{"rootfs":{"diff_ids":3}}"#, &layer(), "t", "abc").is_err());
    }

    #[test]
    fn targets() {
        let r = RegistryClient::new(
            "http://127.0.0.1:5000",
            None,
            std::time::Duration::from_secs(1),
        );
        assert_eq!(
            target(&r, "team/task", None).unwrap(),
            Target {
                repository: "team/task".into(),
                tag: None
            }
        );
        assert_eq!(
            target(&r, "team/task", Some("team/saved")).unwrap(),
            Target {
                repository: "team/saved".into(),
                tag: Some("latest".into())
            }
        );
        assert_eq!(
            target(&r, "x", Some("127.0.0.1:5000/a/b:v2"))
                .unwrap()
                .tag
                .as_deref(),
            Some("v2")
        );
        for bad in [
            "other.example/a:b",
            "a@sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "A b",
            "blake3:00",
        ] {
            let e = target(&r, "x", Some(bad)).unwrap_err().to_string();
            assert!(e.starts_with(&format!("tag {bad:?}")), "{e}");
        }
        assert_eq!(oci_layer_type(DOCKER_LAYER_GZIP), OCI_LAYER_GZIP);
        assert_eq!(oci_layer_type(OCI_LAYER_GZIP), OCI_LAYER_GZIP);
    }
}
