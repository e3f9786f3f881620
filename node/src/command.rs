//! How a command runs as `docker run` and `docker exec` run it: the argv from the image's
//! Entrypoint and Cmd and the user's command, the environment (a default PATH, HOSTNAME,
//! the user's `-e` overriding the image's), the working directory and the user.
//!
//! Pure: the guest agent gets the resulting `Request` and does only what it says.

use amber_guest::Request;
use amber_oci::config::RunConfig;

/// The argv of `docker run IMAGE [COMMAND…]`: Entrypoint followed by the user's command,
/// or by the image's Cmd when the user gave none. `None` when both are empty.
pub fn run_argv(c: &RunConfig, command: &[String]) -> Option<Vec<String>> {
    let tail = if command.is_empty() { &c.cmd } else { command };
    let argv: Vec<String> = c.entrypoint.iter().chain(tail.iter()).cloned().collect();
    (!argv.is_empty()).then_some(argv)
}

/// The request for `argv` under the image's config and the user's flags, as docker does.
pub fn request(
    c: &RunConfig,
    argv: Vec<String>,
    extra_env: &[String],
    workdir: Option<&str>,
    user: Option<&str>,
    hostname: &str,
    stdin: bool,
) -> Request {
    let mut env = c.env.clone();
    if !env.iter().any(|e| e.starts_with("PATH=")) {
        env.insert(
            0,
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        );
    }
    if !env.iter().any(|e| e.starts_with("HOSTNAME=")) {
        env.push(format!("HOSTNAME={hostname}"));
    }
    for e in extra_env {
        let key = e.split('=').next().unwrap_or("");
        env.retain(|x| x.split('=').next() != Some(key));
        env.push(e.clone());
    }
    Request {
        argv,
        env,
        cwd: workdir.map(str::to_string).unwrap_or_else(|| {
            if c.working_dir.is_empty() {
                "/".into()
            } else {
                c.working_dir.clone()
            }
        }),
        user: user.map(str::to_string).unwrap_or_else(|| c.user.clone()),
        stdin,
    }
}

/// How commands run in one sandbox unless a request says otherwise: the image's config
/// (and the create's `env`, `workdir`, `user`) and the sandbox's hostname.
#[derive(Clone, Debug)]
pub struct ExecDefaults {
    pub config: RunConfig,
    pub hostname: String,
}

impl ExecDefaults {
    /// The request for `o`, whose `env` is added to the defaults' and whose empty `cwd`
    /// and `user` mean the defaults (`docker exec` semantics).
    pub fn apply(&self, o: &Request) -> Request {
        request(
            &self.config,
            o.argv.clone(),
            &o.env,
            (!o.cwd.is_empty()).then_some(o.cwd.as_str()),
            (!o.user.is_empty()).then_some(o.user.as_str()),
            &self.hostname,
            o.stdin,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> RunConfig {
        RunConfig {
            entrypoint: vec!["/entry".into()],
            cmd: vec!["default".into()],
            env: vec!["A=image".into(), "B=image".into()],
            working_dir: "/app".into(),
            user: "1000".into(),
        }
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn argv_as_docker_run_builds_it() {
        let c = config();
        assert_eq!(run_argv(&c, &[]).unwrap(), strings(&["/entry", "default"]));
        assert_eq!(
            run_argv(&c, &strings(&["x"])).unwrap(),
            strings(&["/entry", "x"])
        );
        let bare = RunConfig::default();
        assert_eq!(run_argv(&bare, &[]), None);
        assert_eq!(
            run_argv(&bare, &strings(&["sh"])).unwrap(),
            strings(&["sh"])
        );
    }

    #[test]
    fn environment_cwd_and_user() {
        let r = request(
            &config(),
            strings(&["id"]),
            &strings(&["B=user", "C=user"]),
            None,
            None,
            "h",
            false,
        );
        assert_eq!(
            r.env,
            strings(&[
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "A=image",
                "HOSTNAME=h",
                "B=user",
                "C=user"
            ])
        );
        assert_eq!(
            (r.cwd.as_str(), r.user.as_str(), r.stdin),
            ("/app", "1000", false)
        );
        let r = request(
            &RunConfig::default(),
            strings(&["id"]),
            &[],
            Some("/w"),
            Some("root"),
            "h",
            true,
        );
        assert_eq!(
            (r.cwd.as_str(), r.user.as_str(), r.stdin),
            ("/w", "root", true)
        );
        let r = request(
            &RunConfig::default(),
            strings(&["id"]),
            &[],
            None,
            None,
            "h",
            false,
        );
        assert_eq!(r.cwd, "/", "an image without WorkingDir runs in /");
        let c = RunConfig {
            env: strings(&["PATH=/opt/bin", "HOSTNAME=fixed"]),
            ..RunConfig::default()
        };
        let r = request(&c, strings(&["id"]), &[], None, None, "h", false);
        assert_eq!(
            r.env,
            strings(&["PATH=/opt/bin", "HOSTNAME=fixed"]),
            "the image's own PATH and HOSTNAME win"
        );
    }
}
