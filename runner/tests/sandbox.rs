//! `amber create`, `exec`, `cp` and `rm`: a sandbox stays up across commands; exec runs
//! as `docker exec` does (the image's user, workdir and env; -u/-w/-e; stdin with -i;
//! signals forwarded; exit status back); cp copies trees both ways; sessions run at once;
//! sandboxes of one node live in one node daemon, and removing one leaves the others.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::*;

#[test]
fn a_sandbox_keeps_its_state_across_exec_and_copies() {
    let data = tempfile::tempdir().unwrap();
    let reg = Registry::start_in(data.path(), &[]);
    let node = Node::setup(&reg);
    debian_base();
    let image = format!("{}/sandbox/worker:v1", reg.addr);
    build_and_push(
        &image,
        "FROM amber-test/debian:bookworm\n\
         RUN useradd -m -u 1234 worker && mkdir /work && chown worker /work\n\
         ENV GREETING=hello\n\
         WORKDIR /work\n\
         USER worker\n",
        &[],
    );
    let created = node.amber(&reg, &["create", "--hostname", "box", "sandbox/worker:v1"]);
    assert!(created.status.success(), "{}", stderr(&created));
    let id = stdout(&created).trim().to_string();
    assert!(stdout(&node.amber(&reg, &["ps"])).starts_with(&format!("{id}\tsandbox/worker:v1\t")));

    let exec = |args: &[&str]| {
        let mut a = vec!["exec"];
        a.extend_from_slice(args);
        node.amber(&reg, &a)
    };
    let o = exec(&[
        &id,
        "--",
        "sh",
        "-c",
        "id -u; pwd; hostname; echo $GREETING; echo state > /work/f",
    ]);
    assert_eq!(stdout(&o), "1234\n/work\nbox\nhello\n", "{}", stderr(&o));
    assert_eq!(stdout(&exec(&[&id, "--", "cat", "/work/f"])), "state\n");
    let o = exec(&[
        "-u",
        "root",
        "-w",
        "/tmp",
        "-e",
        "GREETING=bye",
        &id,
        "--",
        "sh",
        "-c",
        "id -u; pwd; echo $GREETING",
    ]);
    assert_eq!(stdout(&o), "0\n/tmp\nbye\n");
    assert_eq!(
        exec(&[&id, "--", "sh", "-c", "exit 9"]).status.code(),
        Some(9)
    );
    let o = exec(&[&id, "--", "no-such-command"]);
    assert_eq!(o.status.code(), Some(127));
    // The exit codes and messages of docker exec (runc) for what does not run: a file
    // that is not executable, by path, is 126 "permission denied"; a path that does not
    // exist is 127; a name found in PATH that is not executable is 127 "not found".
    let o = exec(&[&id, "--", "/work/f"]);
    assert_eq!(o.status.code(), Some(126), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("\"/work/f\": permission denied"),
        "{}",
        stderr(&o)
    );
    let o = exec(&[&id, "--", "/no/such/file"]);
    assert_eq!(o.status.code(), Some(127), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("no such file or directory"),
        "{}",
        stderr(&o)
    );
    let o = exec(&[
        "-u",
        "root",
        &id,
        "--",
        "sh",
        "-c",
        "echo x > /bin/not-executable",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = exec(&[&id, "--", "not-executable"]);
    assert_eq!(o.status.code(), Some(127), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("executable file not found in $PATH"),
        "{}",
        stderr(&o)
    );
    // Writes go to the sandbox's own disk (8 GiB, sparse on the host), not to guest
    // memory: 1 GiB written in a 512 MiB VM, and it keeps working.
    let o = exec(&[
        &id,
        "--",
        "sh",
        "-c",
        "dd if=/dev/zero of=/work/big bs=1M count=1024 status=none && sync && stat -c %s /work/big && df -k / | tail -1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("1073741824\n"), "{out}");
    let size_kib: u64 = out
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        size_kib > 7 << 20,
        "the root has {size_kib} KiB: not the 8 GiB disk"
    );
    let o = exec(&[&id, "--", "sh", "-c", "rm /work/big && echo still here"]);
    assert_eq!(stdout(&o), "still here\n", "{}", stderr(&o));
    let input = vec![7u8; 2_500_000];
    let o = node.amber_with_stdin(&reg, &["exec", "-i", &id, "--", "wc", "-c"], &input);
    assert_eq!(stdout(&o), "2500000\n");

    // Copies in: a tree with a nested file, an executable and a symlink.
    let local = tempfile::tempdir().unwrap();
    let tree = local.path().join("tree");
    std::fs::create_dir_all(tree.join("sub")).unwrap();
    std::fs::write(tree.join("sub/data"), b"payload").unwrap();
    std::fs::write(tree.join("run.sh"), b"#!/bin/sh\necho ran\n").unwrap();
    std::fs::set_permissions(
        tree.join("run.sh"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::os::unix::fs::symlink("sub/data", tree.join("link")).unwrap();
    let o = node.amber(
        &reg,
        &["cp", tree.to_str().unwrap(), &format!("{id}:/tmp/")],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = exec(&[
        &id,
        "--",
        "sh",
        "-c",
        "cd /tmp/tree && find . -printf '%p %y %m\\n' | sort && cat link && ./run.sh",
    ]);
    assert_eq!(
        stdout(&o),
        ". d 755\n./link l 777\n./run.sh f 755\n./sub d 755\n./sub/data f 644\npayloadran\n",
        "{}",
        stderr(&o)
    );
    // ... and out, onto a new name and into a directory.
    let back = local.path().join("back");
    let o = node.amber(
        &reg,
        &["cp", &format!("{id}:/work/f"), back.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(&back).unwrap(), b"state\n");
    let into = local.path().join("into");
    std::fs::create_dir(&into).unwrap();
    let o = node.amber(
        &reg,
        &["cp", &format!("{id}:/tmp/tree"), into.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(into.join("tree/sub/data")).unwrap(),
        b"payload"
    );
    assert_eq!(
        std::fs::read_link(into.join("tree/link")).unwrap(),
        std::path::Path::new("sub/data")
    );
    // A path that is not there is a clear error, and nothing is written.
    let o = node.amber(
        &reg,
        &[
            "cp",
            &format!("{id}:/nope"),
            local.path().join("x").to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(125));
    assert!(stderr(&o).contains("/nope: No such file"), "{}", stderr(&o));
    assert!(!local.path().join("x").exists());

    // Two commands at once, each with its own output.
    let spawn = |n: &str| {
        node.command(&reg)
            .args([
                "exec",
                &id,
                "--",
                "sh",
                "-c",
                &format!("head -c {n} /dev/zero | wc -c"),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn("3000000"), spawn("5000000"));
    assert_eq!(
        String::from_utf8(a.wait_with_output().unwrap().stdout).unwrap(),
        "3000000\n"
    );
    assert_eq!(
        String::from_utf8(b.wait_with_output().unwrap().stdout).unwrap(),
        "5000000\n"
    );

    // A signal to `amber exec` reaches the command.
    let mut child = node
        .command(&reg)
        .args([
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.1; done",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "got-term\n");
    assert_eq!(child.wait().unwrap().code(), Some(7));

    // A second sandbox of the same env lives in the same node daemon (one process per
    // node), has its own state, and removing it leaves the first one running.
    let second = node.amber(&reg, &["create", "--disk", "64", "sandbox/worker:v1"]);
    assert!(second.status.success(), "{}", stderr(&second));
    let id2 = stdout(&second).trim().to_string();
    assert_ne!(id2, id);
    assert_eq!(
        node_daemons(node.home.path()).len(),
        1,
        "one node daemon owns both sandboxes"
    );
    let o = exec(&[&id2, "--", "sh", "-c", "cat /work/f || echo fresh"]);
    assert_eq!(stdout(&o), "fresh\n", "{}", stderr(&o));
    // Its 64 MiB disk fills up: ENOSPC inside the guest and nothing else. The sandbox
    // keeps working once space is freed, its file on the host stays within the disk's
    // size, and the first sandbox is untouched.
    let o = exec(&[
        &id2,
        "--",
        "sh",
        "-c",
        "dd if=/dev/zero of=/work/fill bs=1M count=128 2>&1; echo rc=$?",
    ]);
    let out = stdout(&o);
    assert!(out.contains("No space left on device"), "{out}");
    assert!(out.contains("rc=1"), "{out}");
    let o = exec(&[
        &id2,
        "--",
        "sh",
        "-c",
        "rm /work/fill && echo room > /work/g && cat /work/g",
    ]);
    assert_eq!(stdout(&o), "room\n", "{}", stderr(&o));
    let img = node
        .home
        .path()
        .join("sandboxes")
        .join(&id2)
        .join("vm/disk.img");
    let used = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&img).unwrap()) * 512;
    assert!(used <= 64 << 20, "{} holds {used} bytes", img.display());
    assert_eq!(stdout(&exec(&[&id, "--", "cat", "/work/f"])), "state\n");
    let o = node.amber(&reg, &["rm", &id2]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!node.home.path().join("sandboxes").join(&id2).exists());
    assert_eq!(stdout(&exec(&[&id, "--", "cat", "/work/f"])), "state\n");

    let o = node.amber(&reg, &["rm", &id]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&node.amber(&reg, &["ps"])), "");
    assert!(!node.home.path().join("sandboxes").join(&id).exists());
    let o = exec(&[&id, "--", "true"]);
    assert_eq!(o.status.code(), Some(125));
    // amberd still remembers it as deleted, or has exited (it was its last sandbox).
    let e = stderr(&o);
    assert!(
        e.contains(&format!("sandbox {id} is stopped: deleted")) || e.contains("does not answer"),
        "{e}"
    );
    // The daemon the CLI started exits on its own once idle: it removes its socket, then
    // releases the node's lock (waited for by taking it, bounded).
    let lock = std::fs::File::open(node.home.path().join("amberd.lock")).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(lock.lock().map(|()| lock));
    });
    let _held = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("amberd still holds the node's lock a minute after its last sandbox")
        .unwrap();
    assert!(!node.home.path().join("amberd.sock").exists());
}

/// The pids of `amber daemon` processes (amberd) serving the node at `home`.
fn node_daemons(home: &std::path::Path) -> Vec<u32> {
    let want = format!("AMBER_HOME={}", home.display());
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            cmdline.split(|&b| b == 0).any(|a| a == b"daemon")
                && environ.split(|&b| b == 0).any(|v| v == want.as_bytes())
        })
        .collect()
}
