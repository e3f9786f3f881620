//! Resolving a reference (`name:tag`, `name@sha256:…`, `host/name:tag`, or an env digest
//! `blake3:…`) through the registry, and the image config that says how `docker run`
//! runs it.
//!
//! Invariant kept here: every byte the node acts on is checked against the digest it was
//! asked for before it is parsed. The image manifest must hash to the image digest that
//! resolve named, and the config blob to the digest (and size) the manifest names; a
//! mismatch is `ImageError::Integrity` naming the object, and nothing runs. Every answer
//! is read with a bound (resolve 64 KiB, manifest 4 MiB, config 32 MiB). Manifests and
//! blobs come through the registry's one verified client (`amber-distribution`); resolve
//! is amber's own API.

use std::time::Duration;

use amber_api::registry::{resolve_path, ConversionState, Resolve};
use amber_converter::manifest::EnvDigest;
use amber_distribution::DistributionError;
use amber_oci::config::ImageConfig;
use amber_oci::digest::Digest;
use amber_oci::manifest::{parse_manifest, ManifestKind};
use amber_oci::names::Reference;
use amber_oci::reference::{ImageRef, RefError};
use amber_snapshotter::source::RegistryClient;

pub use amber_api::node::Parent;
pub use amber_oci::config::RunConfig;

/// Why a reference could not be resolved to something bootable.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(transparent)]
    BadReference(#[from] RefError),
    #[error("{reference} names registry {named}, and its name has no valid mirror name in the registry {configured}")]
    OtherRegistry {
        reference: String,
        named: String,
        configured: String,
    },
    #[error("GET {url}: {source}")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("GET {url}: HTTP {status}: {body}{hint}")]
    Refused {
        url: String,
        status: u16,
        body: String,
        hint: String,
    },
    #[error("{source}{hint}")]
    Registry {
        #[source]
        source: DistributionError,
        hint: String,
    },
    #[error("GET {url}: the answer is larger than the {limit} bytes allowed")]
    TooLarge { url: String, limit: usize },
    #[error("the registry could not convert {reference}: {error}")]
    ConversionFailed { reference: String, error: String },
    #[error("{0} is not an image the registry can run (no conversion)")]
    NotAnImage(String),
    #[error("{0} is still being converted; try again")]
    StillConverting(String),
    #[error("integrity error: {object} {expected}: the registry sent bytes with digest {actual}")]
    Integrity {
        object: String,
        expected: String,
        actual: String,
    },
    #[error("the registry's resolve answer for {reference} is invalid: {why}")]
    BadResolve { reference: String, why: String },
    #[error("{object} {digest} is invalid: {why}")]
    Invalid {
        object: String,
        digest: String,
        why: String,
    },
}

#[derive(Clone, Debug)]
pub struct Resolved {
    pub reference: String,
    pub image_digest: Option<String>,
    pub env: EnvDigest,
    pub config: RunConfig,
    /// The snapshots' images this image was made from, nearest first (empty for an
    /// image that is not a snapshot): its manifest's lineage annotation.
    pub parents: Vec<Parent>,
}

/// The manifest annotation (OCI's) naming the image a snapshot was made on:
/// `repository@sha256:…`.
pub const BASE_NAME_ANNOTATION: &str = "org.opencontainers.image.base.name";
/// The manifest annotation (OCI's) with the base image's manifest digest.
pub const BASE_DIGEST_ANNOTATION: &str = "org.opencontainers.image.base.digest";
/// The manifest annotation with a snapshot's whole lineage: a JSON list of [`Parent`],
/// nearest first (the base image, then the image that one was made on, and so on).
pub const PARENTS_ANNOTATION: &str = "dev.amber.snapshot.parents";

/// The lineage an image manifest's annotations record (nothing when there is none or it
/// does not read as one: lineage is information, never a reason not to run).
pub fn parents_of(annotations: Option<&serde_json::Value>) -> Vec<Parent> {
    annotations
        .and_then(|a| a.get(PARENTS_ANNOTATION))
        .and_then(|v| v.as_str())
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default()
}

/// An image manifest and its config, both verified against their digests.
pub struct ImageDocs {
    pub manifest: amber_oci::manifest::ParsedManifest,
    pub manifest_bytes: Vec<u8>,
    pub config_bytes: Vec<u8>,
}

/// `reference` pinned to `image_digest` (`[host/]name@sha256:…`), so whoever resolves it
/// later gets the image resolved now; an env digest stays as it is.
pub fn pinned(reference: &str, image_digest: &str) -> String {
    match ImageRef::parse(reference) {
        Ok(ImageRef::Image(n)) => {
            let host = n.registry.map(|h| format!("{h}/")).unwrap_or_default();
            format!("{host}{}@{image_digest}", n.repository)
        }
        _ => reference.to_string(),
    }
}

/// The most a resolve answer may take.
const MAX_RESOLVE_BYTES: usize = 64 << 10;
/// The most an image manifest may take (the registry's default `max_manifest_bytes`).
const MAX_MANIFEST_BYTES: usize = 4 << 20;
/// The most an image config may take.
const MAX_CONFIG_BYTES: usize = 32 << 20;
/// The most of an error answer's body quoted in the error.
const MAX_ERROR_BODY: usize = 4 << 10;

/// At most `limit` bytes of `r`'s body; `None` when it holds more.
async fn read_bounded(
    r: reqwest::Response,
    limit: usize,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    use futures_util::StreamExt;
    if r.content_length().is_some_and(|n| n > limit as u64) {
        return Ok(None);
    }
    let mut body = Vec::new();
    let mut stream = r.bytes_stream();
    while let Some(piece) = stream.next().await {
        let piece = piece?;
        if body.len() + piece.len() > limit {
            return Ok(None);
        }
        body.extend_from_slice(&piece);
    }
    Ok(Some(body))
}

pub(crate) async fn get(
    registry: &RegistryClient,
    url: &str,
    accept: &str,
    limit: usize,
) -> Result<Vec<u8>, ImageError> {
    let unreachable = |source| ImageError::Unreachable {
        url: url.to_string(),
        source,
    };
    let r = registry
        .http
        .get(url)
        .header("Accept", accept)
        .send()
        .await
        .map_err(unreachable)?;
    let status = r.status();
    if !status.is_success() {
        let body = match read_bounded(r, MAX_ERROR_BODY).await {
            Ok(Some(b)) => String::from_utf8_lossy(&b).into_owned(),
            _ => String::new(),
        };
        return Err(ImageError::Refused {
            url: url.to_string(),
            status: status.as_u16(),
            body,
            hint: registry.access_hint(status),
        });
    }
    read_bounded(r, limit)
        .await
        .map_err(unreachable)?
        .ok_or_else(|| ImageError::TooLarge {
            url: url.to_string(),
            limit,
        })
}

/// Resolves `reference`; waits up to `wait` for the registry to finish converting the
/// image. Verifies the image manifest and config against their digests.
pub async fn resolve(
    registry: &RegistryClient,
    reference: &str,
    wait: Duration,
) -> Result<Resolved, ImageError> {
    let name = match ImageRef::parse(reference)? {
        ImageRef::Env(env) => {
            return Ok(Resolved {
                reference: reference.into(),
                image_digest: None,
                env,
                config: RunConfig::default(),
                parents: Vec::new(),
            })
        }
        ImageRef::Image(n) => n,
    };
    // An image of another registry is asked for under its mirror name
    // (`docker.io/library/python`): imported there, or pulled through on this request.
    let repo = match &name.registry {
        Some(host) if host != registry.distribution().host() => name
            .mirror_repository()
            .ok_or_else(|| ImageError::OtherRegistry {
                reference: reference.into(),
                named: host.clone(),
                configured: registry.base().into(),
            })?,
        _ => name.repository.clone(),
    };
    let repo = &repo;
    let deadline = std::time::Instant::now() + wait;
    let url = registry.url(&resolve_path(repo, &name.reference()));
    let resolved: Resolve = loop {
        let bytes = get(registry, &url, "application/json", MAX_RESOLVE_BYTES).await?;
        let v: Resolve = serde_json::from_slice(&bytes).map_err(|e| ImageError::BadResolve {
            reference: reference.into(),
            why: e.to_string(),
        })?;
        match v.state {
            ConversionState::Done => break v,
            ConversionState::Failed => {
                return Err(ImageError::ConversionFailed {
                    reference: reference.into(),
                    error: v.error.unwrap_or_default(),
                })
            }
            ConversionState::None => return Err(ImageError::NotAnImage(reference.into())),
            _ if std::time::Instant::now() > deadline => {
                return Err(ImageError::StillConverting(reference.into()))
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let env = resolved.env_digest.ok_or_else(|| ImageError::BadResolve {
        reference: reference.into(),
        why: "state done without an env digest".into(),
    })?;
    let image = resolved.image_digest;
    if let Some(d) = &name.digest {
        // The digest asked for is the manifest resolve names, or the index holding it.
        if d != &resolved.manifest_digest {
            return Err(ImageError::Integrity {
                object: format!("manifest of {repo}"),
                expected: d.to_string(),
                actual: resolved.manifest_digest.to_string(),
            });
        }
    }
    // The registry may have answered for another name (a short name found on Docker Hub).
    let served =
        amber_oci::names::RepoName::parse(&resolved.name).map_err(|e| ImageError::BadResolve {
            reference: reference.into(),
            why: format!("name {:?}: {e}", resolved.name),
        })?;
    let docs = fetch_image(registry, served.as_str(), &image).await?;
    let config_digest = &docs.manifest.config().expect("an image").digest;
    let config = ImageConfig::parse(&docs.config_bytes).map_err(|e| ImageError::Invalid {
        object: "image config".into(),
        digest: config_digest.to_string(),
        why: e.to_string(),
    })?;
    Ok(Resolved {
        reference: reference.into(),
        image_digest: Some(image.to_string()),
        env,
        config: config.run,
        parents: parents_of(docs.manifest.annotations.as_ref()),
    })
}

/// The manifest media types an image manifest may have (either format).
const IMAGE_MANIFEST_TYPES: &[&str] = &[
    amber_oci::media::OCI_MANIFEST,
    amber_oci::media::DOCKER_MANIFEST,
];

/// `e` from reading `object` (`image manifest of <repo>`), as the node reports it: an
/// integrity error names the object and both digests.
fn registry_error(registry: &RegistryClient, object: String, e: DistributionError) -> ImageError {
    match e {
        DistributionError::Integrity {
            expected, actual, ..
        } => ImageError::Integrity {
            object,
            expected,
            actual,
        },
        e => ImageError::Registry {
            hint: registry.denied_hint(&e, "pull"),
            source: e,
        },
    }
}

/// The image manifest `image` of `repo` and its config, each checked against its digest
/// (by the registry's one verified client).
pub async fn fetch_image(
    registry: &RegistryClient,
    repo: &str,
    image: &Digest,
) -> Result<ImageDocs, ImageError> {
    let oci = registry.distribution();
    let object = format!("image manifest of {repo}");
    let (manifest, _) = oci
        .manifest(
            repo,
            &Reference::Digest(image.clone()),
            IMAGE_MANIFEST_TYPES,
            MAX_MANIFEST_BYTES,
        )
        .await
        .map_err(|e| registry_error(registry, object, e))?;
    let invalid = |object: &str, digest: &Digest, why: String| ImageError::Invalid {
        object: object.into(),
        digest: digest.to_string(),
        why,
    };
    let parsed = parse_manifest(&manifest, None)
        .map_err(|e| invalid("image manifest", image, e.to_string()))?;
    if parsed.kind != ManifestKind::Image {
        return Err(invalid(
            "image manifest",
            image,
            "resolve named an index, not an image".into(),
        ));
    }
    let config_desc = parsed.config().expect("an image manifest has a config");
    let config_bytes = oci
        .blob(repo, &config_desc.digest, MAX_CONFIG_BYTES)
        .await
        .map_err(|e| registry_error(registry, format!("image config of {repo}"), e))?;
    Ok(ImageDocs {
        manifest: parsed,
        manifest_bytes: manifest.to_vec(),
        config_bytes: config_bytes.to_vec(),
    })
}
