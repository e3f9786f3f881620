//! Repository names, tags and references as the OCI Distribution spec defines them, and
//! the parsing of `/v2/...` request paths into routes.
//!
//! Repository names may contain `/`, so the `/v2/<name>/<kind>/<ref>` paths cannot be
//! matched by a router's path patterns: `Route::parse` splits them by their last
//! well-known component instead. Invariant: every `RepoName`, `Tag` and `Digest` in a
//! `Route` has been validated, so none can escape a storage namespace.

use std::fmt;

use crate::digest::{Digest, DigestError};

/// Why a path, name or reference was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NameError {
    #[error("repository name {0:?} is invalid: lowercase path components of [a-z0-9] separated by '.', '_', '__' or '-', joined by '/', at most 255 characters")]
    BadName(String),
    #[error("tag {0:?} is invalid: [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}")]
    BadTag(String),
    #[error(transparent)]
    BadDigest(#[from] DigestError),
    #[error("no such endpoint")]
    NotFound,
}

/// A validated repository name, e.g. `swe/task-123`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RepoName(String);

impl RepoName {
    pub fn parse(s: &str) -> Result<RepoName, NameError> {
        if s.is_empty() || s.len() > 255 || !s.split('/').all(component_ok) {
            return Err(NameError::BadName(s.to_string()));
        }
        Ok(RepoName(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RepoName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`
fn component_ok(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        // a separator run: ".", "_", "__" or "-+"
        let start = i;
        match b[i] {
            b'.' => i += 1,
            b'_' => {
                i += 1;
                if i < b.len() && b[i] == b'_' {
                    i += 1;
                }
            }
            b'-' => {
                while i < b.len() && b[i] == b'-' {
                    i += 1;
                }
            }
            _ => return false,
        }
        if i == start || i >= b.len() || !alnum(b[i]) {
            return false;
        }
    }
    true
}

/// A validated tag.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(String);

impl Tag {
    pub fn parse(s: &str) -> Result<Tag, NameError> {
        let b = s.as_bytes();
        let ok = !b.is_empty()
            && b.len() <= 128
            && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
            && b[1..]
                .iter()
                .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'));
        if ok {
            Ok(Tag(s.to_string()))
        } else {
            Err(NameError::BadTag(s.to_string()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A manifest reference: a tag or a digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reference {
    Tag(Tag),
    Digest(Digest),
}

impl Reference {
    pub fn parse(s: &str) -> Result<Reference, NameError> {
        if s.contains(':') {
            Ok(Reference::Digest(s.parse()?))
        } else {
            Ok(Reference::Tag(Tag::parse(s)?))
        }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reference::Tag(t) => t.fmt(f),
            Reference::Digest(d) => d.fmt(f),
        }
    }
}

/// One endpoint of the distribution API, with its validated parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// `/v2/`
    Base,
    /// `/v2/_catalog`
    Catalog,
    /// `/v2/<name>/tags/list`
    Tags(RepoName),
    /// `/v2/<name>/manifests/<reference>`
    Manifest(RepoName, Reference),
    /// `/v2/<name>/blobs/<digest>`
    Blob(RepoName, Digest),
    /// `/v2/<name>/blobs/uploads/`
    UploadStart(RepoName),
    /// `/v2/<name>/blobs/uploads/<session id>`
    Upload(RepoName, String),
    /// `/v2/<name>/referrers/<digest>`
    Referrers(RepoName, Digest),
}

impl Route {
    /// Parses a request path (without query string).
    pub fn parse(path: &str) -> Result<Route, NameError> {
        let rest = match path.strip_prefix("/v2") {
            Some("") | Some("/") => return Ok(Route::Base),
            Some(r) => r.strip_prefix('/').ok_or(NameError::NotFound)?,
            None => return Err(NameError::NotFound),
        };
        if rest == "_catalog" {
            return Ok(Route::Catalog);
        }
        if let Some(name) = rest.strip_suffix("/tags/list") {
            return Ok(Route::Tags(RepoName::parse(name)?));
        }
        if let Some(name) = rest
            .strip_suffix("/blobs/uploads/")
            .or_else(|| rest.strip_suffix("/blobs/uploads"))
        {
            return Ok(Route::UploadStart(RepoName::parse(name)?));
        }
        if let Some((name, id)) = rest.rsplit_once("/blobs/uploads/") {
            if !upload_id_ok(id) {
                return Err(NameError::NotFound);
            }
            return Ok(Route::Upload(RepoName::parse(name)?, id.to_string()));
        }
        // The last path component is the reference; the one before it the kind.
        let (head, reference) = rest.rsplit_once('/').ok_or(NameError::NotFound)?;
        let (name, kind) = head.rsplit_once('/').ok_or(NameError::NotFound)?;
        match kind {
            "manifests" => Ok(Route::Manifest(
                RepoName::parse(name)?,
                Reference::parse(reference)?,
            )),
            "blobs" => Ok(Route::Blob(RepoName::parse(name)?, reference.parse()?)),
            "referrers" => Ok(Route::Referrers(RepoName::parse(name)?, reference.parse()?)),
            _ => Err(NameError::NotFound),
        }
    }

    /// A low-cardinality label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Route::Base => "base",
            Route::Catalog => "catalog",
            Route::Tags(_) => "tags",
            Route::Manifest(..) => "manifest",
            Route::Blob(..) => "blob",
            Route::UploadStart(_) => "upload_start",
            Route::Upload(..) => "upload",
            Route::Referrers(..) => "referrers",
        }
    }
}

/// Upload session ids are ours (UUIDs); anything else is refused before it reaches storage.
pub fn upload_id_ok(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// Parses `Content-Range` of an upload chunk: `start-end`, optionally with a `bytes=` or
/// `bytes ` prefix and a `/total` suffix. Returns the inclusive (start, end).
pub fn parse_content_range(v: &str) -> Option<(u64, u64)> {
    let v = v.trim();
    let v = v
        .strip_prefix("bytes=")
        .or_else(|| v.strip_prefix("bytes "))
        .unwrap_or(v);
    let v = v.split_once('/').map(|(r, _)| r).unwrap_or(v);
    let (a, b) = v.split_once('-')?;
    let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (b >= a).then_some((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

    #[test]
    fn names() {
        for ok in [
            "a",
            "library/ubuntu",
            "swe/task-123",
            "a.b_c__d---e/f0",
            "x/y/z",
        ] {
            assert!(RepoName::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "A", "a/", "/a", "a//b", "a..b", "a___b", "-a", "a-", "../x", "a/../b", "a b",
        ] {
            assert!(RepoName::parse(bad).is_err(), "{bad:?}");
        }
        assert!(RepoName::parse(&"a".repeat(256)).is_err());
    }

    #[test]
    fn tags() {
        assert!(Tag::parse("v1.0_rc-2").is_ok());
        assert!(Tag::parse("_x").is_ok());
        for bad in ["", ".x", "-x", "a/b", "a:b", &"t".repeat(129)] {
            assert!(Tag::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn routes() {
        assert_eq!(Route::parse("/v2/").unwrap(), Route::Base);
        assert_eq!(Route::parse("/v2").unwrap(), Route::Base);
        assert_eq!(Route::parse("/v2/_catalog").unwrap(), Route::Catalog);
        let n = RepoName::parse("swe/blobs/x").unwrap();
        assert_eq!(
            Route::parse("/v2/swe/blobs/x/tags/list").unwrap(),
            Route::Tags(n.clone())
        );
        assert_eq!(
            Route::parse(&format!("/v2/swe/blobs/x/blobs/{D}")).unwrap(),
            Route::Blob(n.clone(), D.parse().unwrap())
        );
        assert_eq!(
            Route::parse("/v2/swe/blobs/x/manifests/latest").unwrap(),
            Route::Manifest(n.clone(), Reference::parse("latest").unwrap())
        );
        assert_eq!(
            Route::parse("/v2/swe/blobs/x/blobs/uploads/").unwrap(),
            Route::UploadStart(n.clone())
        );
        assert_eq!(
            Route::parse("/v2/swe/blobs/x/blobs/uploads/0a-1b").unwrap(),
            Route::Upload(n.clone(), "0a-1b".into())
        );
        assert_eq!(
            Route::parse(&format!("/v2/swe/blobs/x/referrers/{D}")).unwrap(),
            Route::Referrers(n, D.parse().unwrap())
        );
        assert!(matches!(
            Route::parse("/v2/Bad/manifests/latest"),
            Err(NameError::BadName(_))
        ));
        assert!(matches!(
            Route::parse("/v2/a/blobs/sha256:zz"),
            Err(NameError::BadDigest(_))
        ));
        assert_eq!(
            Route::parse("/v2/a/blobs/uploads/../../x"),
            Err(NameError::NotFound)
        );
        assert_eq!(Route::parse("/v2/a/unknown/x"), Err(NameError::NotFound));
        assert_eq!(Route::parse("/other"), Err(NameError::NotFound));
    }

    #[test]
    fn content_ranges() {
        assert_eq!(parse_content_range("0-99999"), Some((0, 99999)));
        assert_eq!(parse_content_range("bytes=10-19"), Some((10, 19)));
        assert_eq!(parse_content_range("bytes 10-19/20"), Some((10, 19)));
        assert_eq!(parse_content_range("10-9"), None);
        assert_eq!(parse_content_range("x-y"), None);
        assert_eq!(parse_content_range("10"), None);
    }
}
