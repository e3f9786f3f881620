//! Reading images from an OCI image layout directory or a `docker save` archive: the
//! layer blobs in order, and the image manifest digest when there is one.

use std::fs::File;
use std::path::{Path, PathBuf};

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
}

/// The digest of the linux/amd64 entry of an image index (or manifest list), the image
/// amber converts and runs for a multi-platform reference.
pub fn linux_amd64_digest(index: &Value) -> Option<&str> {
    index["manifests"]
        .as_array()?
        .iter()
        .find(|m| m["platform"]["os"] == "linux" && m["platform"]["architecture"] == "amd64")?
        ["digest"]
        .as_str()
}

/// An image found in a source: its layers as files, in order.
pub struct SourceImage {
    pub manifest_digest: Option<String>,
    pub layers: Vec<(String, PathBuf)>,
}

fn read_json(path: &Path) -> Result<Value, SourceError> {
    let bytes = std::fs::read(path).map_err(|source| SourceError::Io {
        path: path.into(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| SourceError::Format {
        path: path.into(),
        msg: e.to_string(),
    })
}

fn blob_path(layout: &Path, digest: &str) -> Result<PathBuf, SourceError> {
    let (alg, hex) = digest.split_once(':').ok_or_else(|| SourceError::Format {
        path: layout.into(),
        msg: format!("bad digest {digest:?}"),
    })?;
    if !matches!(alg, "sha256" | "sha512") || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(SourceError::Format {
            path: layout.into(),
            msg: format!("bad digest {digest:?}"),
        });
    }
    Ok(layout.join("blobs").join(alg).join(hex))
}

/// The image of an OCI layout: the first manifest of index.json, and for an index the
/// linux/amd64 entry (or its first entry).
pub fn oci_layout(dir: &Path) -> Result<SourceImage, SourceError> {
    let fmt = |msg: String| SourceError::Format {
        path: dir.join("index.json"),
        msg,
    };
    let mut desc = read_json(&dir.join("index.json"))?["manifests"]
        .get(0)
        .cloned()
        .ok_or_else(|| fmt("index.json lists no manifests".into()))?;
    loop {
        let digest = desc["digest"]
            .as_str()
            .ok_or_else(|| fmt("descriptor without digest".into()))?
            .to_string();
        let m = read_json(&blob_path(dir, &digest)?)?;
        if let Some(children) = m["manifests"].as_array() {
            let chosen = linux_amd64_digest(&m).or_else(|| children.first()?["digest"].as_str());
            let chosen = chosen.ok_or_else(|| fmt(format!("index {digest} is empty")))?;
            desc = serde_json::json!({ "digest": chosen });
            continue;
        }
        let layers = m["layers"]
            .as_array()
            .ok_or_else(|| fmt(format!("manifest {digest} has no layers")))?
            .iter()
            .map(|l| {
                let d = l["digest"].as_str().unwrap_or_default().to_string();
                blob_path(dir, &d).map(|p| (d, p))
            })
            .collect::<Result<_, _>>()?;
        return Ok(SourceImage {
            manifest_digest: Some(digest),
            layers,
        });
    }
}

/// The image of a `docker save` archive, unpacked (blobs only, never layer contents)
/// into `work`.
pub fn docker_archive(archive: &Path, work: &Path) -> Result<SourceImage, SourceError> {
    let f = File::open(archive).map_err(|source| SourceError::Io {
        path: archive.into(),
        source,
    })?;
    let mut a = tar::Archive::new(f);
    for e in a.entries().map_err(|source| SourceError::Io {
        path: archive.into(),
        source,
    })? {
        let mut e = e.map_err(|source| SourceError::Io {
            path: archive.into(),
            source,
        })?;
        // unpack_in refuses paths that leave `work`.
        e.unpack_in(work).map_err(|source| SourceError::Io {
            path: archive.into(),
            source,
        })?;
    }
    if work.join("index.json").exists() && work.join("oci-layout").exists() {
        return oci_layout(work);
    }
    let m = read_json(&work.join("manifest.json"))?;
    let layers = m[0]["Layers"]
        .as_array()
        .ok_or_else(|| SourceError::Format {
            path: archive.into(),
            msg: "manifest.json has no Layers".into(),
        })?
        .iter()
        .map(|l| {
            let rel = l.as_str().unwrap_or_default();
            (rel.to_string(), work.join(rel))
        })
        .collect();
    Ok(SourceImage {
        manifest_digest: None,
        layers,
    })
}
