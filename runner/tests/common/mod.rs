//! What the runner's end-to-end tests share beyond amber-testkit (the registry process,
//! the Docker engine, images): a node directory per test, and `amber` itself.
//!
//! Needs (scripts/test provides them): AMBER_TEST_DOCKER_HOST (a Docker engine),
//! AMBER_TEST_DEBIAN_ROOTFS (the Debian base root fs), qemu-system-x86_64.

#![allow(dead_code, unused_imports)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

pub use amber_testkit::registry::*;
/// Runs a command that must succeed; returns stdout.
pub use amber_testkit::tools::run as ok;
pub use amber_testkit::tools::*;

/// One node: its own AMBER_HOME (boot files, chunk cache, sandboxes).
pub struct Node {
    pub home: tempfile::TempDir,
}

impl Node {
    /// A fresh node, set up against `reg` with `amber setup`.
    pub fn setup(reg: &Registry) -> Node {
        let n = Node::bare();
        let out = n.amber(reg, &["setup"]);
        assert!(out.status.success(), "amber setup: {out:?}");
        n
    }

    /// A node directory on which `amber setup` never ran.
    pub fn bare() -> Node {
        Node {
            home: tempfile::tempdir().unwrap(),
        }
    }

    pub fn command(&self, reg: &Registry) -> Command {
        let mut c = Command::new(target_dir().join("amber"));
        c.arg("--registry")
            .arg(reg.url(""))
            .env("AMBER_HOME", self.home.path());
        c
    }

    pub fn amber(&self, reg: &Registry, args: &[&str]) -> Output {
        self.command(reg).args(args).output().unwrap()
    }

    /// `amber` with `input` on its stdin.
    pub fn amber_with_stdin(&self, reg: &Registry, args: &[&str], input: &[u8]) -> Output {
        let mut child = self
            .command(reg)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let input = input.to_vec();
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let out = child.wait_with_output().unwrap();
        writer.join().unwrap().unwrap();
        out
    }

    pub fn chunks(&self) -> PathBuf {
        self.home.path().join("chunks")
    }
}

impl Drop for Node {
    /// A test that fails midway must not leave its node running: the daemon a CLI
    /// started exits only once idle, and a sandbox keeps it busy, VM and all. So the
    /// daemon still holding `amberd.lock` (which holds its PID) gets SIGTERM, which stops
    /// its sandboxes, and SIGKILL if it is still there a minute later, with any VM left.
    fn drop(&mut self) {
        let home = self.home.path();
        let Ok(lock) = std::fs::File::open(home.join("amberd.lock")) else {
            return;
        };
        if lock.try_lock().is_ok() {
            return; // no daemon
        }
        let Some(pid) = std::fs::read_to_string(home.join("amberd.lock"))
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
        else {
            return;
        };
        let signal = |sig: &str, pid: &str| {
            let _ = Command::new("kill").args([sig, pid]).status();
        };
        signal("-TERM", &pid.to_string());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while lock.try_lock().is_err() {
            if std::time::Instant::now() > deadline {
                signal("-KILL", &pid.to_string());
                let vms = std::fs::read_dir(home.join("sandboxes"))
                    .into_iter()
                    .flatten();
                for vm in vms.flatten() {
                    if let Ok(qemu) = std::fs::read_to_string(vm.path().join("vm/qemu.pid")) {
                        signal("-KILL", qemu.trim());
                    }
                }
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `amber-registry` of this build.
pub fn registry_bin() -> Command {
    Command::new(target_dir().join("amber-registry"))
}

/// Adds account `name` (password `password`, push rights on everything) to the users
/// file `users` with `amber-registry user add`.
pub fn add_operator(users: &std::path::Path, name: &str, password: &str) {
    let mut add = registry_bin()
        .args(["user", "add", name, "--push", "*", "--users"])
        .arg(users)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    add.stdin
        .take()
        .unwrap()
        .write_all(format!("{password}\n").as_bytes())
        .unwrap();
    assert!(add.wait().unwrap().success(), "user add {name}");
}
