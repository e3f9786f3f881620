//! The registries this one mirrors (`upstreams`, `upstream_auth_file`): how each is
//! reached, which local repositories stand for it (`<mirror_prefix(host)>/<name>`), the
//! credentials file, and the locks that make concurrent pull-throughs of one image, or
//! fetches of one blob, happen once. Shared state, held by `Registry`; the importing
//! itself is `upstream`'s.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::docker_config::{docker_config_credentials, CredentialsError};
use amber_oci::names::RepoName;
use amber_oci::reference::mirror_prefix;

/// A registry this one may pull through to: `host` as references name it, and where to
/// reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamSpec {
    /// `host[:port]` as references name the registry (`docker.io`).
    pub host: String,
    /// `host[:port]` to connect to (the same unless the spec gave a URL).
    pub endpoint: String,
    /// Plain HTTP instead of HTTPS.
    pub plain_http: bool,
}

#[derive(Debug, thiserror::Error)]
#[error(
    "upstream {spec:?}: {why}; expected `host[:port]` or `host[:port]=http[s]://endpoint[:port]`"
)]
pub struct SpecError {
    spec: String,
    why: &'static str,
}

/// Whether `host[:port]` is a loopback address (reached over plain HTTP by default, as
/// the Docker engine treats 127.0.0.0/8 as an insecure registry).
pub fn is_loopback(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host),
    };
    name == "localhost"
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl UpstreamSpec {
    /// The spec of a registry named by a reference and not configured: HTTPS, or plain
    /// HTTP on loopback.
    pub fn implicit(host: &str) -> UpstreamSpec {
        UpstreamSpec {
            host: host.to_string(),
            endpoint: host.to_string(),
            plain_http: is_loopback(host),
        }
    }
}

impl std::str::FromStr for UpstreamSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<UpstreamSpec, SpecError> {
        let err = |why| SpecError {
            spec: s.to_string(),
            why,
        };
        let (host, url) = match s.trim().split_once('=') {
            Some((h, u)) => (h.trim(), Some(u.trim())),
            None => (s.trim(), None),
        };
        let valid_host = |h: &str| {
            !h.is_empty()
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c))
        };
        if !valid_host(host) {
            return Err(err("the host is not a host[:port]"));
        }
        let Some(url) = url else {
            return Ok(UpstreamSpec::implicit(host));
        };
        let (plain_http, rest) = if let Some(r) = url.strip_prefix("http://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("https://") {
            (false, r)
        } else {
            return Err(err("the endpoint must start with http:// or https://"));
        };
        let endpoint = rest.trim_end_matches('/');
        if !valid_host(endpoint) {
            return Err(err("the endpoint must be a URL with a host and no path"));
        }
        Ok(UpstreamSpec {
            host: host.to_string(),
            endpoint: endpoint.to_string(),
            plain_http,
        })
    }
}

/// The configured upstreams and what pull-through shares between requests.
pub struct Upstreams {
    specs: Vec<UpstreamSpec>,
    auth_file: Option<PathBuf>,
    /// One pull-through at a time per repository and reference; later requests wait
    /// and then find the image stored.
    in_flight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Upstreams {
    pub fn new(specs: Vec<UpstreamSpec>, auth_file: Option<PathBuf>) -> Upstreams {
        Upstreams {
            specs,
            auth_file,
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    /// The upstream whose mirror repositories `repo` is in, and the repository's name
    /// there: `docker.io/library/python` is `library/python` on `docker.io`.
    pub fn for_repo(&self, repo: &RepoName) -> Option<(&UpstreamSpec, String)> {
        let (first, rest) = repo.as_str().split_once('/')?;
        self.specs
            .iter()
            .find(|s| mirror_prefix(&s.host) == first)
            .map(|s| (s, rest.to_string()))
    }

    /// The configured spec of `host`, or the implicit one.
    pub fn spec(&self, host: &str) -> UpstreamSpec {
        self.specs
            .iter()
            .find(|s| s.host == host)
            .cloned()
            .unwrap_or_else(|| UpstreamSpec::implicit(host))
    }

    /// Whether Docker Hub is an upstream (short names then fall back to it).
    pub fn has_docker_hub(&self) -> bool {
        self.specs.iter().any(|s| s.host == "docker.io")
    }

    /// The credentials file's entries (read on each use, so a `docker login` that
    /// rewrote it takes effect); none without a file.
    pub fn credentials(
        &self,
    ) -> Result<
        std::collections::BTreeMap<String, amber_api::registry::UpstreamCredential>,
        CredentialsError,
    > {
        match &self.auth_file {
            Some(path) => docker_config_credentials(path),
            None => Ok(Default::default()),
        }
    }

    pub fn lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(key.to_string()).or_default().clone()
    }

    pub fn release(&self, key: &str) {
        let mut m = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if m.get(key).is_some_and(|l| Arc::strong_count(l) == 1) {
            m.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        let s: UpstreamSpec = "docker.io".parse().unwrap();
        assert_eq!((s.endpoint.as_str(), s.plain_http), ("docker.io", false));
        let s: UpstreamSpec = "127.0.0.1:5001".parse().unwrap();
        assert!(s.plain_http, "loopback is plain HTTP");
        let s: UpstreamSpec = "docker.io=https://mirror.example:443/".parse().unwrap();
        assert_eq!(
            (s.host.as_str(), s.endpoint.as_str(), s.plain_http),
            ("docker.io", "mirror.example:443", false)
        );
        for bad in ["", "docker.io=ftp://x", "a b", "x=http://h/path"] {
            let e = bad.parse::<UpstreamSpec>().unwrap_err().to_string();
            assert!(e.contains("expected `host[:port]`"), "{bad}: {e}");
        }
    }

    #[test]
    fn mirror_repositories_map_to_their_upstream() {
        let u = Upstreams::new(
            vec![
                "docker.io".parse().unwrap(),
                "127.0.0.1:5001".parse().unwrap(),
            ],
            None,
        );
        let r = |s: &str| RepoName::parse(s).unwrap();
        let (s, path) = u.for_repo(&r("docker.io/library/python")).unwrap();
        assert_eq!(
            (s.host.as_str(), path.as_str()),
            ("docker.io", "library/python")
        );
        let (s, path) = u.for_repo(&r("127.0.0.1-5001/a/b")).unwrap();
        assert_eq!((s.host.as_str(), path.as_str()), ("127.0.0.1:5001", "a/b"));
        assert!(u.for_repo(&r("python")).is_none());
        assert!(u.for_repo(&r("ghcr.io/x")).is_none(), "not configured");
        assert!(is_loopback("localhost:5000") && is_loopback("[::1]:80"));
        assert!(!is_loopback("docker.io"));
    }
}
