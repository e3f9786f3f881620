//! Image manifests and indexes (OCI and Docker schema 2): bounded, validating parsing of
//! what a client pushes or a registry answers, into the fields amber acts on.
//!
//! Pure; no storage access. Invariant kept here: a `ParsedManifest` has a media type
//! this registry stores, matching both the document's `mediaType` and the request's
//! Content-Type when both are given, and every descriptor in it has a well-formed digest
//! and a size.

use serde_json::Value;

use crate::digest::{Digest, DigestError};
use crate::media::{DOCKER_LIST, DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST};

/// The kinds of manifest amber stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManifestKind {
    /// OCI image manifest or Docker schema 2 manifest: config + layers.
    Image,
    /// OCI image index or Docker manifest list: child manifests.
    Index,
}

impl ManifestKind {
    /// The kind of a manifest media type; `None` for anything amber does not store.
    pub fn of(media_type: &str) -> Option<ManifestKind> {
        match media_type {
            OCI_MANIFEST | DOCKER_MANIFEST => Some(ManifestKind::Image),
            OCI_INDEX | DOCKER_LIST => Some(ManifestKind::Index),
            _ => None,
        }
    }
}

/// Why manifest bytes were refused; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ManifestError(pub String);

/// A descriptor's fields that amber checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub media_type: String,
    pub digest: Digest,
    pub size: u64,
    pub has_urls: bool,
    /// The descriptor's `platform` object, when it has one (index entries).
    pub platform: Option<Platform>,
}

/// The platform of an index entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
    pub variant: Option<String>,
}

fn descriptor(v: &Value, what: &str) -> Result<Descriptor, ManifestError> {
    let bad = |m: &str| ManifestError(format!("{what}: {m}"));
    let o = v.as_object().ok_or_else(|| bad("not an object"))?;
    let media_type = o
        .get("mediaType")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("mediaType missing"))?
        .to_string();
    let digest = o
        .get("digest")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("digest missing"))?
        .parse()
        .map_err(|e: DigestError| bad(&e.to_string()))?;
    let size = o
        .get("size")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("size missing or not a non-negative integer"))?;
    let has_urls = o
        .get("urls")
        .is_some_and(|u| u.as_array().is_some_and(|a| !a.is_empty()));
    let platform = o.get("platform").and_then(Value::as_object).map(|p| {
        let s = |k: &str| p.get(k).and_then(Value::as_str).map(str::to_string);
        Platform {
            os: s("os").unwrap_or_default(),
            architecture: s("architecture").unwrap_or_default(),
            variant: s("variant"),
        }
    });
    Ok(Descriptor {
        media_type,
        digest,
        size,
        has_urls,
        platform,
    })
}

/// What a validated manifest says.
#[derive(Clone, Debug)]
pub struct ParsedManifest {
    pub media_type: String,
    pub kind: ManifestKind,
    pub subject: Option<Descriptor>,
    pub artifact_type: Option<String>,
    pub annotations: Option<Value>,
    /// Blobs (config first, then layers) this manifest needs in the repository.
    pub blobs: Vec<Descriptor>,
    /// Child manifests (of an index).
    pub children: Vec<Descriptor>,
    /// The whole document, for fields amber does not model.
    pub document: Value,
}

impl ParsedManifest {
    /// The config descriptor of an image manifest.
    pub fn config(&self) -> Option<&Descriptor> {
        match self.kind {
            ManifestKind::Image => self.blobs.first(),
            ManifestKind::Index => None,
        }
    }

    /// The layer descriptors of an image manifest, bottom first.
    pub fn layers(&self) -> &[Descriptor] {
        match self.kind {
            ManifestKind::Image => &self.blobs[1..],
            ManifestKind::Index => &[],
        }
    }

    /// The linux/amd64 entry of an index (the platform amber boots).
    pub fn linux_amd64(&self) -> Option<&Descriptor> {
        self.children.iter().find(|c| {
            c.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
        })
    }
}

/// Validates manifest bytes sent with `content_type` (the request's Content-Type, or
/// the media type a registry answered with).
pub fn parse_manifest(
    bytes: &[u8],
    content_type: Option<&str>,
) -> Result<ParsedManifest, ManifestError> {
    let invalid = |m: String| ManifestError(m);
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| invalid(format!("manifest is not valid JSON: {e}")))?;
    let o = v
        .as_object()
        .ok_or_else(|| invalid("manifest is not a JSON object".into()))?;
    if o.get("schemaVersion").and_then(Value::as_u64) != Some(2) {
        return Err(invalid(
            "schemaVersion must be 2 (Docker schema 1 manifests are not supported)".into(),
        ));
    }
    let field = o.get("mediaType").and_then(Value::as_str);
    let header = content_type
        .map(|c| c.split(';').next().unwrap_or("").trim())
        .filter(|c| ManifestKind::of(c).is_some());
    let media_type = match (header, field) {
        (Some(h), Some(f)) if h != f => {
            return Err(invalid(format!(
                "Content-Type {h} does not match the manifest's mediaType {f}"
            )))
        }
        (Some(h), _) => h.to_string(),
        (None, Some(f)) => f.to_string(),
        (None, None) => {
            return Err(invalid(format!(
                "unsupported manifest media type {:?}; this registry stores {OCI_MANIFEST}, {OCI_INDEX}, {DOCKER_MANIFEST} and {DOCKER_LIST}",
                content_type.unwrap_or("")
            )))
        }
    };
    let kind = ManifestKind::of(&media_type)
        .ok_or_else(|| invalid(format!("unsupported manifest media type {media_type:?}")))?;
    let subject = o
        .get("subject")
        .map(|s| descriptor(s, "subject"))
        .transpose()?;
    let mut blobs = Vec::new();
    let mut children = Vec::new();
    let mut artifact_type = o
        .get("artifactType")
        .and_then(Value::as_str)
        .map(str::to_string);
    match kind {
        ManifestKind::Image => {
            let config = descriptor(o.get("config").unwrap_or(&Value::Null), "config")?;
            if artifact_type.is_none() {
                artifact_type = Some(config.media_type.clone());
            }
            blobs.push(config);
            let layers = o
                .get("layers")
                .and_then(Value::as_array)
                .ok_or_else(|| invalid("layers missing or not an array".into()))?;
            for (i, l) in layers.iter().enumerate() {
                blobs.push(descriptor(l, &format!("layers[{i}]"))?);
            }
        }
        ManifestKind::Index => {
            let ms = o
                .get("manifests")
                .and_then(Value::as_array)
                .ok_or_else(|| invalid("manifests missing or not an array".into()))?;
            for (i, m) in ms.iter().enumerate() {
                children.push(descriptor(m, &format!("manifests[{i}]"))?);
            }
        }
    }
    Ok(ParsedManifest {
        media_type,
        kind,
        subject,
        artifact_type,
        annotations: o.get("annotations").cloned(),
        blobs,
        children,
        document: v,
    })
}

/// The media type manifest `bytes` declare in their `mediaType` field, when they are a
/// JSON object with one string field of that name. A manifest stored by [`parse_manifest`]
/// has exactly this media type whenever its bytes declare one, so a reader holding the
/// bytes can answer with it without the manifest's record.
pub fn declared_media_type(bytes: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Declared<'a> {
        #[serde(rename = "mediaType", borrow)]
        media_type: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_slice::<Declared>(bytes)
        .ok()?
        .media_type
        .map(String::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

    fn image(extra: &str) -> String {
        format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{D}","size":5}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{D}","size":5}}]{extra}}}"#
        )
    }

    #[test]
    fn parses_image_manifest_with_subject() {
        let m = image(&format!(
            r#","subject":{{"mediaType":"{OCI_MANIFEST}","digest":"{D}","size":1}},"artifactType":"application/x-test""#
        ));
        let p = parse_manifest(m.as_bytes(), Some(OCI_MANIFEST)).unwrap();
        assert_eq!(p.kind, ManifestKind::Image);
        assert_eq!(p.blobs.len(), 2);
        assert_eq!(p.config().unwrap().size, 5);
        assert_eq!(p.layers().len(), 1);
        assert_eq!(p.subject.unwrap().digest.to_string(), D);
        assert_eq!(p.artifact_type.as_deref(), Some("application/x-test"));
    }

    #[test]
    fn media_type_from_field_when_header_is_generic() {
        let p = parse_manifest(image("").as_bytes(), Some("application/json")).unwrap();
        assert_eq!(p.media_type, OCI_MANIFEST);
        assert_eq!(
            p.artifact_type.as_deref(),
            Some("application/vnd.oci.image.config.v1+json")
        );
    }

    #[test]
    fn index_platforms() {
        let m = format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[
              {{"mediaType":"{OCI_MANIFEST}","digest":"{D}","size":1,"platform":{{"os":"linux","architecture":"arm64"}}}},
              {{"mediaType":"{OCI_MANIFEST}","digest":"{D}","size":2,"platform":{{"os":"linux","architecture":"amd64"}}}}]}}"#
        );
        let p = parse_manifest(m.as_bytes(), None).unwrap();
        assert_eq!(p.kind, ManifestKind::Index);
        assert_eq!(p.linux_amd64().unwrap().size, 2);
        assert!(p.config().is_none());
    }

    #[test]
    fn malformed_manifests_are_refused() {
        let cases: Vec<(String, Option<&str>, &str)> = vec![
            ("not json".into(), Some(OCI_MANIFEST), "not valid JSON"),
            ("[]".into(), Some(OCI_MANIFEST), "not a JSON object"),
            (
                r#"{"schemaVersion":1}"#.into(),
                Some(OCI_MANIFEST),
                "schemaVersion",
            ),
            (image(""), Some(DOCKER_MANIFEST), "does not match"),
            (
                r#"{"schemaVersion":2}"#.into(),
                Some("text/plain"),
                "unsupported manifest media type",
            ),
            (
                format!(r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","layers":[]}}"#),
                None,
                "config",
            ),
            (
                format!(
                    r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[{{"mediaType":"x","digest":"sha256:bad","size":1}}]}}"#
                ),
                None,
                "manifests[0]",
            ),
        ];
        for (body, ct, want) in cases {
            let err = parse_manifest(body.as_bytes(), ct)
                .err()
                .unwrap_or_else(|| panic!("{body} accepted"));
            assert!(err.0.contains(want), "{body}: {}", err.0);
        }
    }

    #[test]
    fn declared_media_type_is_the_stored_one_or_none() {
        // Declared: what parse_manifest stores, whatever Content-Type came with it.
        for header in [Some(OCI_MANIFEST), Some("application/json"), None] {
            let m = image("");
            let stored = parse_manifest(m.as_bytes(), header).unwrap().media_type;
            assert_eq!(
                declared_media_type(m.as_bytes()).as_deref(),
                Some(stored.as_str())
            );
        }
        // Not declared, or not one string: the reader must use the manifest's record.
        let without = image("").replace(&format!(r#""mediaType":"{OCI_MANIFEST}","#), "");
        assert!(without.starts_with(r#"{"schemaVersion":2,"config""#));
        assert_eq!(declared_media_type(without.as_bytes()), None);
        let twice = image(&format!(r#","mediaType":"{DOCKER_MANIFEST}""#));
        assert_eq!(declared_media_type(twice.as_bytes()), None);
        assert_eq!(declared_media_type(br#"{"mediaType":5}"#), None);
        assert_eq!(declared_media_type(b"not json"), None);
        assert_eq!(declared_media_type(br#"{"mediaType":"a"} x"#), None);
    }
}
