//! `amber` against a registry that requires authentication (`--auth token`): a node
//! operator's account sets the node up (pushing the boot files), a pull-only robot's
//! token runs a pinned environment, and a node without credentials, or with a wrong
//! token, gets an error that says what to do.

mod common;

use std::io::Write;
use std::process::Stdio;

use common::*;

const CREDENTIALS: &str = "AMBER_REGISTRY_CREDENTIALS";

#[test]
fn a_pull_only_robot_runs_an_environment_from_an_authenticated_registry() {
    // Accounts: an operator who may push everything, and a robot for runners.
    let accounts = tempfile::tempdir().unwrap();
    let users = accounts.path().join("users.toml");
    let users_arg = users.to_str().unwrap();
    add_operator(&users, "operator", "operator-secret");
    let robot_token = ok(registry_bin().args([
        "user", "robot", "runner", "--pull", "*", "--users", users_arg,
    ]))
    .trim()
    .to_string();
    assert!(!robot_token.is_empty(), "user robot prints the token");

    let data = tempfile::tempdir().unwrap();
    let reg = Registry::start_at(
        data.path(),
        "127.0.0.1:0",
        &["--auth", "token", "--users", users_arg],
    );

    // The operator prepares the node: setup pushes the kernel and initramfs artifacts.
    let node = Node::bare();
    let out = node
        .command(&reg)
        .env(CREDENTIALS, "operator:operator-secret")
        .args(["setup"])
        .output()
        .unwrap();
    assert!(out.status.success(), "amber setup as operator: {out:?}");

    // An image pushed with `docker login` + `docker push` as the operator.
    debian_base();
    let ctx = tempfile::tempdir().unwrap();
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM amber-test/debian:bookworm\nRUN echo pulled-with-a-robot-token > /etc/amber-auth\n",
    )
    .unwrap();
    let image = format!("{}/auth/app:v1", reg.addr);
    ok(docker()
        .args(["build", "-q", "--network", "host", "-t", &image])
        .arg(ctx.path()));
    let config = tempfile::tempdir().unwrap();
    let mut login = docker()
        .arg("--config")
        .arg(config.path())
        .args(["login", &reg.addr, "-u", "operator", "--password-stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    login
        .stdin
        .take()
        .unwrap()
        .write_all(b"operator-secret\n")
        .unwrap();
    assert!(login.wait().unwrap().success(), "docker login as operator");
    let pushed = ok(docker()
        .arg("--config")
        .arg(config.path())
        .args(["push", &image]));
    let digest = pushed
        .split("digest: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("pushed digest")
        .to_string();
    let pinned = format!("auth/app@{digest}");

    // The robot runs it: resolve, manifest, chunks and boot files all with its token.
    let out = node
        .command(&reg)
        .env(CREDENTIALS, format!("runner:{robot_token}"))
        .args(["run", &pinned, "--", "cat", "/etc/amber-auth"])
        .output()
        .unwrap();
    assert_eq!(
        stdout(&out),
        "pulled-with-a-robot-token\n",
        "{}",
        stderr(&out)
    );
    assert_eq!(out.status.code(), Some(0));

    // Refused runs fail at the first request, with an error that says what to do.
    let refused = |credentials: Option<&str>| {
        let mut c = node.command(&reg);
        match credentials {
            Some(v) => c.env(CREDENTIALS, v),
            None => c.env_remove(CREDENTIALS),
        };
        let out = c.args(["run", &pinned, "--", "true"]).output().unwrap();
        assert!(!out.status.success(), "{out:?}");
        let err = stderr(&out);
        assert!(err.contains("401"), "{err}");
        err
    };
    let err = refused(None);
    assert!(
        err.contains("set AMBER_REGISTRY_CREDENTIALS=name:secret"),
        "{err}"
    );
    let err = refused(Some("runner:not-the-token"));
    assert!(
        err.contains("refused the credentials in AMBER_REGISTRY_CREDENTIALS"),
        "{err}"
    );
}
