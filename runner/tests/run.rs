//! `amber run` end to end: an image built from a Dockerfile with the Docker engine and
//! pushed with `docker push` runs in a QEMU microVM; for a set of probe commands amber's
//! stdout, stderr and exit status equal `docker run`'s for the same image; the guest's
//! root device is bit-identical to the manifest's; a receipt reproduces on a fresh node
//! after the registry restarts.

mod common;

use common::*;

#[test]
fn amber_run_matches_docker_run_and_a_receipt_reproduces() {
    let data = tempfile::tempdir().unwrap();
    let reg = Registry::start_in(data.path(), &[]);
    let node = Node::setup(&reg);

    // The Python image of the fidelity set, built and pushed with the Docker engine.
    debian_base();
    let ca = std::env::var("SSL_CERT_FILE")
        .unwrap_or_else(|_| "/etc/ssl/certs/ca-certificates.crt".into());
    let dockerfile =
        std::fs::read_to_string(repo_root().join("fixtures/images/python-pip/Dockerfile")).unwrap();
    let image = format!("{}/run/python:v1", reg.addr);
    build_cached(
        &image,
        &dockerfile,
        &[("build-ca.crt", std::path::Path::new(&ca))],
        "",
    );
    let digest = push(&image);
    let pinned = format!("run/python@{digest}");

    let out = node.amber(&reg, &["run", &pinned, "--", "python3", "-c", "print(1)"]);
    assert_eq!(stdout(&out), "1\n", "{}", stderr(&out));
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
        // SIGPIPE is at its default for the command, as under docker.
        &["sh", "-c", "yes | head -c 3; echo"],
    ];
    let mut diffs = Vec::new();
    for p in probes {
        let mut a_args = vec!["run", "--hostname", "amber-probe", &pinned, "--"];
        a_args.extend_from_slice(p);
        let a = node.amber(&reg, &a_args);
        let d = docker()
            .args([
                "run",
                "--rm",
                "--network",
                "none",
                "--hostname",
                "amber-probe",
            ])
            .arg(&image)
            .args(*p)
            .output()
            .unwrap();
        if a.stdout != d.stdout || a.stderr != d.stderr || a.status.code() != d.status.code() {
            diffs.push(format!(
                "{p:?}:\n  amber  {:?} stdout {:?} stderr {:?}\n  docker {:?} stdout {:?} stderr {:?}",
                a.status.code(),
                stdout(&a),
                stderr(&a),
                d.status.code(),
                stdout(&d),
                stderr(&d)
            ));
        }
    }
    assert!(
        diffs.is_empty(),
        "{} probes differ:\n{}",
        diffs.len(),
        diffs.join("\n")
    );

    // stdin passes through with -i, and is /dev/null without it (as docker run).
    let input: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let a = node.amber_with_stdin(&reg, &["run", "-i", &pinned, "--", "sha256sum"], &input);
    assert_eq!(
        stdout(&a),
        format!("{}  -\n", &sha256(&input)["sha256:".len()..]),
        "{}",
        stderr(&a)
    );
    let a = node.amber_with_stdin(&reg, &["run", &pinned, "--", "wc", "-c"], b"ignored");
    assert_eq!(stdout(&a), "0\n");

    // The guest's root device is the manifest's device, bit for bit, cold and warm.
    let env = reg.env_of("run/python", &digest);
    let want = reg.device_sha256(&env);
    for cache in ["cold", "warm"] {
        if cache == "cold" {
            std::fs::remove_dir_all(node.chunks()).unwrap();
        }
        let a = node.amber(
            &reg,
            &[
                "run",
                "--root-device",
                &pinned,
                "--",
                "sha256sum",
                "/dev/vda",
            ],
        );
        assert_eq!(
            stdout(&a),
            format!("{want}  /dev/vda\n"),
            "{cache}: {}",
            stderr(&a)
        );
    }

    // A receipt, reproduced on a fresh node (no boot files, no chunks) after the
    // registry restarted: the node takes the pinned kernel and initramfs from the
    // registry by digest.
    let receipt = node.home.path().join("receipt.json");
    let cmd = "import requests, sys; print(requests.__version__); print('e', file=sys.stderr); sys.exit(4)";
    let a = node.amber(
        &reg,
        &[
            "run",
            "--receipt",
            receipt.to_str().unwrap(),
            &pinned,
            "--",
            "python3",
            "-c",
            cmd,
        ],
    );
    assert_eq!(a.status.code(), Some(4), "{}", stderr(&a));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&receipt).unwrap()).unwrap();
    assert_eq!(r["image_digest"], digest.as_str());
    assert_eq!(r["env_digest"], env.as_str());
    assert_eq!(r["exit_status"], 4);
    for k in ["kernel", "initramfs", "stdout", "stderr", "qemu"] {
        assert!(
            r[k].as_str().is_some_and(|s| !s.is_empty()),
            "receipt {k}: {r}"
        );
    }
    let reg = reg.restart();
    let fresh = Node::bare();
    let again = fresh.amber(&reg, &["reproduce", receipt.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(4), "{}", stderr(&again));
    assert_eq!(again.stdout, a.stdout);
    assert!(stderr(&again).contains("(identical)"), "{}", stderr(&again));

    // A receipt pinning a kernel nobody has fails, naming it.
    let mut bad = r.clone();
    bad["kernel"] = format!("sha256:{}", "0".repeat(64)).into();
    let bad_path = fresh.home.path().join("bad.json");
    std::fs::write(&bad_path, serde_json::to_vec(&bad).unwrap()).unwrap();
    let e = fresh.amber(&reg, &["reproduce", bad_path.to_str().unwrap()]);
    assert_eq!(e.status.code(), Some(125));
    assert!(
        stderr(&e).contains(&format!("the pinned kernel sha256:{}", "0".repeat(64))),
        "{}",
        stderr(&e)
    );
}

#[test]
fn bad_references_and_an_unprepared_node_get_clear_errors() {
    let data = tempfile::tempdir().unwrap();
    let reg = Registry::start_in(data.path(), &[]);
    let bare = Node::bare();
    let e = bare.amber(&reg, &["run", "x/y:v1", "--", "true"]);
    assert_eq!(e.status.code(), Some(125));
    assert!(stderr(&e).contains("run `amber setup`"), "{}", stderr(&e));

    let node = Node::setup(&reg);

    // A second node with nothing but the `amber` binary (copied alone into an empty
    // directory) and the registry sets up with plain `amber setup` and gets the same boot
    // files: the agent comes inside the binary, the kernel from the registry.
    let alone = tempfile::tempdir().unwrap();
    let exe = alone.path().join("amber");
    std::fs::copy(target_dir().join("amber"), &exe).unwrap();
    let second = Node::bare();
    let out = std::process::Command::new(&exe)
        .args(["--registry", &reg.url(""), "setup"])
        .env("AMBER_HOME", second.home.path())
        .env_remove("AMBER_GUEST")
        .current_dir(alone.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "setup on a second node: {}",
        stderr(&out)
    );
    let state = |n: &Node| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(n.home.path().join("node.json")).unwrap()).unwrap()
    };
    let (first, other) = (state(&node), state(&second));
    assert_eq!(first["kernel"], other["kernel"]);
    assert_eq!(
        first["initramfs"], other["initramfs"],
        "the initramfs is deterministic"
    );

    for (reference, says) in [
        ("no/such:tag", "HTTP 404"),
        ("blake3:zz", "blake3"),
        (
            &format!("blake3:{}", "1".repeat(64)) as &str,
            "is not in the registry",
        ),
    ] {
        let e = node.amber(&reg, &["run", reference, "--", "true"]);
        assert_eq!(e.status.code(), Some(125), "{reference}");
        assert!(stderr(&e).contains(says), "{reference}: {}", stderr(&e));
    }
    for args in [
        &["exec", "nosuch", "--", "true"][..],
        &["exec", "../etc", "--", "true"],
        &["rm", "nosuch"],
        &["cp", "a", "b"],
    ] {
        let e = node.amber(&reg, args);
        assert_eq!(e.status.code(), Some(125), "{args:?}");
        assert!(!stderr(&e).is_empty(), "{args:?}");
    }
}
