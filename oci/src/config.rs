//! The image config (OCI image spec `config.json`): the run settings `docker run` takes
//! from it (Entrypoint, Cmd, Env, WorkingDir, User) and the platform.
//!
//! Bounded and strict: a field of the wrong type is an error naming it, never silently
//! dropped, since a dropped field changes what a sandbox runs.

use serde::Deserialize;

/// How the image runs by default (the config's `config` object).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: String,
    pub user: String,
}

/// Why config bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("image config is invalid: {0}")]
pub struct ConfigError(pub String);

#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    architecture: Option<String>,
    #[serde(default)]
    os: Option<String>,
    #[serde(default)]
    config: Option<Settings>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Settings {
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
}

/// What amber reads from an image config.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageConfig {
    pub os: String,
    pub architecture: String,
    pub run: RunConfig,
}

impl ImageConfig {
    pub fn parse(bytes: &[u8]) -> Result<ImageConfig, ConfigError> {
        let v: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| ConfigError(e.to_string()))?;
        if !v.is_object() {
            return Err(ConfigError("not a JSON object".into()));
        }
        if v.get("config")
            .is_some_and(|c| !c.is_object() && !c.is_null())
        {
            return Err(ConfigError("`config` is not an object".into()));
        }
        let d: Document = serde_json::from_value(v).map_err(|e| ConfigError(e.to_string()))?;
        let s = d.config.unwrap_or(Settings {
            entrypoint: None,
            cmd: None,
            env: None,
            working_dir: None,
            user: None,
        });
        Ok(ImageConfig {
            os: d.os.unwrap_or_default(),
            architecture: d.architecture.unwrap_or_default(),
            run: RunConfig {
                entrypoint: s.entrypoint.unwrap_or_default(),
                cmd: s.cmd.unwrap_or_default(),
                env: s.env.unwrap_or_default(),
                working_dir: s.working_dir.unwrap_or_default(),
                user: s.user.unwrap_or_default(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_run_settings() {
        let c = ImageConfig::parse(
            br#"{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/bin/sh","-c"],"Cmd":null,"Env":["A=1"],"WorkingDir":"/w","User":"1000:1000"},"rootfs":{"type":"layers","diff_ids":[]}}"#,
        )
        .unwrap();
        assert_eq!(c.os, "linux");
        assert_eq!(c.run.entrypoint, ["/bin/sh", "-c"]);
        assert!(c.run.cmd.is_empty());
        assert_eq!(c.run.env, ["A=1"]);
        assert_eq!(c.run.working_dir, "/w");
        assert_eq!(c.run.user, "1000:1000");
        assert_eq!(ImageConfig::parse(b"{}").unwrap(), ImageConfig::default());
    }

    #[test]
    fn wrong_types_are_errors() {
        for bad in [
            &br#"{"config":{"Cmd":"echo hi"}}"#[..],
            br#"{"config":{"Env":[1]}}"#,
            br#"{"config":{"User":0}}"#,
            br#"{"config":[]}"#,
            b"[]",
            b"not json",
        ] {
            assert!(
                ImageConfig::parse(bad).is_err(),
                "{:?} accepted",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
