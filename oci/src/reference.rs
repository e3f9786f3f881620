//! What a user types to name an environment: `name`, `name:tag`, `name@sha256:…`,
//! `host[:port]/name:tag`, or an env digest `blake3:…`.
//!
//! The first path component is a registry host when it contains `.` or `:` or is
//! `localhost`, as the Docker CLI decides. `ImageRef::docker_normalized` gives the
//! Docker CLI's full form of a short name (`python:3.11-slim` is
//! `docker.io/library/python:3.11-slim`); amber itself resolves hostless names against
//! the registry it is configured with.

use std::fmt;

use crate::digest::Digest;
use crate::env::{BadBlake3, EnvDigest};
use crate::names::{NameError, Reference, RepoName, Tag};

/// Why a reference was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum RefError {
    #[error("reference is empty")]
    Empty,
    #[error("reference {reference:?}: {source}")]
    Name {
        reference: String,
        #[source]
        source: NameError,
    },
    #[error(transparent)]
    Env(#[from] BadBlake3),
}

/// An image in a repository, optionally on a named registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageName {
    /// `host[:port]` when the reference names one.
    pub registry: Option<String>,
    pub repository: RepoName,
    /// The tag; `latest` when neither tag nor digest is given.
    pub tag: Option<Tag>,
    /// The digest, which wins over the tag when both are given.
    pub digest: Option<Digest>,
}

impl ImageName {
    /// The manifest reference to ask a registry for: the digest if given, else the tag.
    pub fn reference(&self) -> Reference {
        match (&self.digest, &self.tag) {
            (Some(d), _) => Reference::Digest(d.clone()),
            (None, Some(t)) => Reference::Tag(t.clone()),
            (None, None) => Reference::Tag(Tag::parse("latest").expect("latest is a tag")),
        }
    }
}

/// The first component of the repositories that hold images of upstream registry `host`
/// in amber (imported or pulled through): the host, lowercased, with `:` (not allowed in
/// a repository name) as `-`. `docker.io` stays `docker.io`, `127.0.0.1:5001` is
/// `127.0.0.1-5001`.
pub fn mirror_prefix(host: &str) -> String {
    host.to_ascii_lowercase().replace(':', "-")
}

impl ImageName {
    /// Where amber keeps this image when it names an upstream registry:
    /// `<mirror_prefix(host)>/<repository>`, the repository as the Docker CLI reads it
    /// (`library/` before a one-component name on Docker Hub). `None` without a host.
    pub fn mirror_repository(&self) -> Option<RepoName> {
        let host = self.registry.as_deref()?;
        let repo = if host == "docker.io" && !self.repository.as_str().contains('/') {
            format!("library/{}", self.repository)
        } else {
            self.repository.to_string()
        };
        RepoName::parse(&format!("{}/{repo}", mirror_prefix(host))).ok()
    }
}

/// A reference to something amber can boot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageRef {
    Image(ImageName),
    /// A converted environment by its digest (no image config: nothing to run by default).
    Env(EnvDigest),
}

fn looks_like_host(c: &str) -> bool {
    c.contains('.') || c.contains(':') || c == "localhost"
}

impl ImageRef {
    pub fn parse(s: &str) -> Result<ImageRef, RefError> {
        if s.is_empty() {
            return Err(RefError::Empty);
        }
        if s.starts_with("blake3:") {
            return Ok(ImageRef::Env(s.parse()?));
        }
        let bad = |source: NameError| RefError::Name {
            reference: s.to_string(),
            source,
        };
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (r, Some(d.parse::<Digest>().map_err(|e| bad(e.into()))?)),
            None => (s, None),
        };
        let (registry, path) = match rest.split_once('/') {
            Some((h, p)) if looks_like_host(h) => (Some(h.to_string()), p),
            _ => (None, rest),
        };
        let (name, tag) = match path.rsplit_once(':') {
            Some((n, t)) => (n, Some(Tag::parse(t).map_err(bad)?)),
            None => (path, None),
        };
        Ok(ImageRef::Image(ImageName {
            registry,
            repository: RepoName::parse(name).map_err(bad)?,
            tag,
            digest,
        }))
    }

    /// The Docker CLI's full form: `docker.io` when no registry is named, and
    /// `library/` before a one-component name on Docker Hub.
    pub fn docker_normalized(&self) -> ImageRef {
        match self {
            ImageRef::Env(_) => self.clone(),
            ImageRef::Image(n) => {
                let registry = n.registry.clone().unwrap_or_else(|| "docker.io".into());
                let repository = if registry == "docker.io" && !n.repository.as_str().contains('/')
                {
                    RepoName::parse(&format!("library/{}", n.repository))
                        .expect("library/ + a valid name is valid")
                } else {
                    n.repository.clone()
                };
                let tag = match (&n.tag, &n.digest) {
                    (None, None) => Some(Tag::parse("latest").expect("latest is a tag")),
                    (t, _) => t.clone(),
                };
                ImageRef::Image(ImageName {
                    registry: Some(registry),
                    repository,
                    tag,
                    digest: n.digest.clone(),
                })
            }
        }
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageRef::Env(e) => e.fmt(f),
            ImageRef::Image(n) => {
                if let Some(r) = &n.registry {
                    write!(f, "{r}/")?;
                }
                f.write_str(n.repository.as_str())?;
                if let Some(t) = &n.tag {
                    write!(f, ":{t}")?;
                }
                if let Some(d) = &n.digest {
                    write!(f, "@{d}")?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

    #[test]
    fn upstream_images_have_a_mirror_repository() {
        let m = |s: &str| image(s).mirror_repository().map(|r| r.to_string());
        assert_eq!(
            m("docker.io/python:3").as_deref(),
            Some("docker.io/library/python")
        );
        assert_eq!(
            m("127.0.0.1:5001/a/b:v1").as_deref(),
            Some("127.0.0.1-5001/a/b")
        );
        assert_eq!(m("localhost/x").as_deref(), Some("localhost/x"));
        assert_eq!(m("a/b"), None);
    }

    fn image(s: &str) -> ImageName {
        match ImageRef::parse(s).unwrap() {
            ImageRef::Image(n) => n,
            ImageRef::Env(_) => panic!("{s} parsed as an env"),
        }
    }

    #[test]
    fn forms() {
        let n = image("a/b:v1");
        assert_eq!((n.registry, n.repository.as_str()), (None, "a/b"));
        assert_eq!(n.tag.unwrap().as_str(), "v1");
        let n = image("a/b");
        assert_eq!(n.reference().to_string(), "latest");
        let n = image(&format!("a/b@{D}"));
        assert_eq!(n.reference().to_string(), D);
        let n = image(&format!("127.0.0.1:5000/a/b:v2@{D}"));
        assert_eq!(n.registry.as_deref(), Some("127.0.0.1:5000"));
        assert_eq!(n.repository.as_str(), "a/b");
        assert_eq!(n.reference().to_string(), D, "the digest wins");
        assert_eq!(image("localhost/x").registry.as_deref(), Some("localhost"));
        let env = format!("blake3:{}", "ab".repeat(32));
        assert!(matches!(ImageRef::parse(&env), Ok(ImageRef::Env(_))));
    }

    #[test]
    fn docker_short_names() {
        let full = |s: &str| ImageRef::parse(s).unwrap().docker_normalized().to_string();
        assert_eq!(
            full("python:3.11-slim"),
            "docker.io/library/python:3.11-slim"
        );
        assert_eq!(full("python"), "docker.io/library/python:latest");
        assert_eq!(full("user/app:v1"), "docker.io/user/app:v1");
        assert_eq!(full("ghcr.io/o/r:t"), "ghcr.io/o/r:t");
        assert_eq!(
            full(&format!("ubuntu@{D}")),
            format!("docker.io/library/ubuntu@{D}")
        );
    }

    #[test]
    fn bad_references() {
        for bad in [
            "",
            "A/b",
            "a/b:",
            "a/b:bad/tag",
            "a@sha256:00",
            "blake3:00",
            "a//b",
        ] {
            assert!(ImageRef::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
