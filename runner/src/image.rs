//! Resolving a reference (`name:tag`, `name@sha256:…`, or an env digest `blake3:…`)
//! through the registry, and the image config that says how `docker run` runs it.

use std::time::Duration;

use amber_converter::manifest::EnvDigest;
use anyhow::{bail, Context};
use serde_json::Value;

/// How the image runs by default (the OCI image config's `config` object).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: String,
    pub user: String,
}

#[derive(Clone, Debug)]
pub struct Resolved {
    pub reference: String,
    pub image_digest: Option<String>,
    pub env: EnvDigest,
    pub config: RunConfig,
}

/// Splits `name:tag` / `name@digest` / `name` into (name, reference).
pub fn split_ref(r: &str) -> (String, String) {
    if let Some((n, d)) = r.split_once('@') {
        return (n.to_string(), d.to_string());
    }
    match r.rsplit_once(':') {
        Some((n, t)) if !t.contains('/') => (n.to_string(), t.to_string()),
        _ => (r.to_string(), "latest".to_string()),
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

async fn get_json(http: &reqwest::Client, url: &str, accept: &str) -> anyhow::Result<Value> {
    let r = http
        .get(url)
        .header("Accept", accept)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    if !r.status().is_success() {
        let status = r.status();
        let body = r.text().await.unwrap_or_default();
        bail!(
            "GET {url}: HTTP {status}: {body}{}",
            amber_snapshotter::source::access_hint(status)
        );
    }
    Ok(r.json().await?)
}

/// Resolves `reference`; waits for the registry to finish converting the image.
pub async fn resolve(registry: &str, reference: &str, wait: Duration) -> anyhow::Result<Resolved> {
    let http = amber_snapshotter::source::registry_client(Duration::from_secs(300));
    if reference.starts_with("blake3:") {
        let env: EnvDigest = reference.parse()?;
        return Ok(Resolved {
            reference: reference.into(),
            image_digest: None,
            env,
            config: RunConfig::default(),
        });
    }
    let (name, r) = split_ref(reference);
    let deadline = std::time::Instant::now() + wait;
    let v = loop {
        let v = get_json(
            &http,
            &format!("{registry}/amber/v1/resolve/{name}/{r}"),
            "application/json",
        )
        .await?;
        match v["state"].as_str() {
            Some("done") => break v,
            Some("failed") => bail!(
                "the registry could not convert {reference}: {}",
                v["error"].as_str().unwrap_or("")
            ),
            Some("none") => {
                bail!("{reference} is not an image the registry can run (no conversion)")
            }
            _ if std::time::Instant::now() > deadline => {
                bail!("{reference} is still being converted; try again")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let image = v["image_digest"]
        .as_str()
        .context("resolve gave no image digest")?
        .to_string();
    let env: EnvDigest = v["env_digest"]
        .as_str()
        .context("resolve gave no env digest")?
        .parse()?;
    let accept = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json";
    let m = get_json(
        &http,
        &format!("{registry}/v2/{name}/manifests/{image}"),
        accept,
    )
    .await?;
    let cd = m["config"]["digest"]
        .as_str()
        .context("image manifest without config")?;
    let cfg = get_json(&http, &format!("{registry}/v2/{name}/blobs/{cd}"), "*/*").await?;
    let c = &cfg["config"];
    Ok(Resolved {
        reference: reference.into(),
        image_digest: Some(image),
        env,
        config: RunConfig {
            entrypoint: strings(&c["Entrypoint"]),
            cmd: strings(&c["Cmd"]),
            env: strings(&c["Env"]),
            working_dir: c["WorkingDir"].as_str().unwrap_or("").to_string(),
            user: c["User"].as_str().unwrap_or("").to_string(),
        },
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn references() {
        assert_eq!(super::split_ref("a/b:v1"), ("a/b".into(), "v1".into()));
        assert_eq!(super::split_ref("a/b"), ("a/b".into(), "latest".into()));
        assert_eq!(
            super::split_ref("a/b@sha256:00"),
            ("a/b".into(), "sha256:00".into())
        );
    }
}
