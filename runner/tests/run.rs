//! `amber run` end to end: an image built from a Dockerfile with the Docker engine and
//! pushed with `docker push` runs in a QEMU microVM; for a set of probe commands amber's
//! stdout, stderr and exit status equal `docker run`'s for the same image.
//!
//! Needs (scripts/test provides them): AMBER_TEST_DOCKER_HOST (a Docker engine),
//! AMBER_TEST_DEBIAN_ROOTFS (the Debian base root fs), AMBER_GUEST (the static guest
//! agent), AMBER_TEST_HOME (a node directory kept between runs), qemu-system-x86_64.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: scripts/test sets it"))
}

fn target_dir() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn ok(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn docker() -> Command {
    let mut c = Command::new("docker");
    c.arg("-H").arg(env("AMBER_TEST_DOCKER_HOST"));
    c
}

struct Registry {
    child: Child,
    addr: String,
}

impl Registry {
    /// The registry on `data`, listening on `listen` (port 0: any free port).
    fn start(data: &Path, listen: &str) -> Registry {
        let bin = target_dir().join("amber-registry");
        assert!(
            bin.exists(),
            "{} is missing: build the workspace first",
            bin.display()
        );
        let mut child = Command::new(bin)
            .args(["serve", "--listen", listen, "--data"])
            .arg(data)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .expect("registry started")
            .to_string();
        Registry { child, addr }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn amber(reg: &Registry, args: &[&str]) -> Output {
    Command::new(target_dir().join("amber"))
        .arg("--registry")
        .arg(format!("http://{}", reg.addr))
        .args(args)
        .env("AMBER_HOME", env("AMBER_TEST_HOME"))
        .output()
        .unwrap()
}

#[test]
fn amber_run_matches_docker_run_and_a_receipt_reproduces() {
    let data = tempfile::tempdir().unwrap();
    let reg = Registry::start(data.path(), "127.0.0.1:0");
    let setup = Command::new(target_dir().join("amber"))
        .args(["setup", "--guest", &env("AMBER_GUEST")])
        .env("AMBER_HOME", env("AMBER_TEST_HOME"))
        .output()
        .unwrap();
    assert!(setup.status.success(), "amber setup: {setup:?}");

    // The Python image of the fidelity set, built and pushed with the Docker engine.
    ok(docker().args([
        "import",
        &env("AMBER_TEST_DEBIAN_ROOTFS"),
        "amber-test/debian:bookworm",
    ]));
    let ctx = tempfile::tempdir().unwrap();
    std::fs::copy(
        repo_root().join("fixtures/images/python-pip/Dockerfile"),
        ctx.path().join("Dockerfile"),
    )
    .unwrap();
    let ca = std::env::var("SSL_CERT_FILE")
        .unwrap_or_else(|_| "/etc/ssl/certs/ca-certificates.crt".into());
    std::fs::copy(&ca, ctx.path().join("build-ca.crt")).unwrap();
    let image = format!("{}/run/python:v1", reg.addr);
    ok(docker()
        .args(["build", "-q", "--network", "host", "-t", &image])
        .arg(ctx.path()));
    let push = ok(docker().args(["push", &image]));
    let digest = push
        .split("digest: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("pushed digest")
        .to_string();
    let pinned = format!("run/python@{digest}");

    let out = amber(&reg, &["run", &pinned, "--", "python3", "-c", "print(1)"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "1\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0));

    let probes: &[&[&str]] = &[
        &["id"],
        &["pwd"],
        &["sh", "-c", "env | sort"],
        &["cat", "/etc/os-release"],
        &["sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"],
        &[
            "sh",
            "-c",
            "ls -la / | awk 'NR>1 {print $1, $3, $4, $9}' | grep -v -e dockerenv -e '^total'",
        ],
        &[
            "python3",
            "-c",
            "import requests, os; print(requests.__version__, os.getuid())",
        ],
        &["ls", "/nonexistent"],
    ];
    let mut diffs = Vec::new();
    for p in probes {
        let mut a_args = vec!["run", "--hostname", "amber-probe", &pinned, "--"];
        a_args.extend_from_slice(p);
        let a = amber(&reg, &a_args);
        let d = docker()
            .args([
                "run",
                "--rm",
                "--network",
                "none",
                "--hostname",
                "amber-probe",
                &image,
            ])
            .args(*p)
            .output()
            .unwrap();
        let same =
            a.stdout == d.stdout && a.stderr == d.stderr && a.status.code() == d.status.code();
        if !same {
            diffs.push(format!(
                "{p:?}:\n  amber  {:?} stdout {:?} stderr {:?}\n  docker {:?} stdout {:?} stderr {:?}",
                a.status.code(),
                String::from_utf8_lossy(&a.stdout),
                String::from_utf8_lossy(&a.stderr),
                d.status.code(),
                String::from_utf8_lossy(&d.stdout),
                String::from_utf8_lossy(&d.stderr)
            ));
        }
    }
    assert!(
        diffs.is_empty(),
        "{} probes differ:\n{}",
        diffs.len(),
        diffs.join("\n")
    );
}
