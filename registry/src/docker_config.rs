//! Credentials for upstream registries from a file in Docker's `config.json` format
//! (what `docker login` writes): `{"auths": {"host": {"auth": base64("user:password")}}}`,
//! or `"username"`/`"password"`, or `"registrytoken"` (a bearer token). Keys may be
//! URLs (`https://index.docker.io/v1/` is Docker Hub, `docker.io`). Credential helpers
//! (`credsStore`, `credHelpers`) are not run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use amber_api::registry::UpstreamCredential;
use base64::Engine as _;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("reading the credentials file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the credentials file {path} is not a Docker config.json: {why}")]
    Invalid { path: PathBuf, why: String },
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize)]
struct AuthEntry {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
    registrytoken: Option<String>,
}

/// The registry host a config.json key names.
fn host_of(key: &str) -> String {
    let rest = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = rest.split('/').next().unwrap_or(rest);
    match host {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => {
            "docker.io".into()
        }
        h => h.to_string(),
    }
}

/// Every usable entry of the Docker config file at `path`, by registry host.
pub fn docker_config_credentials(
    path: &Path,
) -> Result<BTreeMap<String, UpstreamCredential>, CredentialsError> {
    let text = std::fs::read_to_string(path).map_err(|source| CredentialsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text).map_err(|why| CredentialsError::Invalid {
        path: path.to_path_buf(),
        why,
    })
}

fn parse(text: &str) -> Result<BTreeMap<String, UpstreamCredential>, String> {
    let config: DockerConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let mut out = BTreeMap::new();
    for (key, e) in config.auths {
        let cred = if let Some(token) = e.registrytoken {
            UpstreamCredential::Bearer { token }
        } else if let Some(auth) = e.auth.filter(|a| !a.is_empty()) {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(auth.trim())
                .map_err(|err| format!("auths.{key:?}.auth is not base64: {err}"))?;
            let decoded = String::from_utf8(decoded)
                .map_err(|_| format!("auths.{key:?}.auth is not UTF-8"))?;
            let (username, password) = decoded
                .split_once(':')
                .ok_or_else(|| format!("auths.{key:?}.auth is not user:password"))?;
            UpstreamCredential::Basic {
                username: username.into(),
                password: password.into(),
            }
        } else if let (Some(username), Some(password)) = (e.username, e.password) {
            UpstreamCredential::Basic { username, password }
        } else {
            continue; // kept by a credential helper: not ours to run
        };
        out.insert(host_of(&key), cred);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_logins_read_as_credentials() {
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret:x");
        let text = format!(
            r#"{{"auths": {{
                "https://index.docker.io/v1/": {{"auth": "{auth}"}},
                "127.0.0.1:5001": {{"username": "bob", "password": "pw"}},
                "http://ghcr.io/": {{"registrytoken": "tok"}},
                "helper.example": {{}}
            }}, "credsStore": "desktop"}}"#
        );
        let c = parse(&text).unwrap();
        assert_eq!(
            c["docker.io"],
            UpstreamCredential::Basic {
                username: "alice".into(),
                password: "s3cret:x".into()
            }
        );
        assert!(
            matches!(&c["127.0.0.1:5001"], UpstreamCredential::Basic { username, .. } if username == "bob")
        );
        assert_eq!(
            c["ghcr.io"],
            UpstreamCredential::Bearer {
                token: "tok".into()
            }
        );
        assert!(!c.contains_key("helper.example"));
        let bad = parse(r#"{"auths": {"h": {"auth": "!!"}}}"#).unwrap_err();
        assert!(bad.contains("not base64"), "{bad}");
        assert!(parse("\"not an object\"").is_err());
    }
}
