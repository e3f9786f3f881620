//! `amber snapshot`: a sandbox's files committed as an ordinary image. A snapshot taken
//! after installing files, deleting a file of the image, changing modes and owners and
//! making a directory again, forked on a second node (its own home, a cold cache), shows
//! exactly that state; `docker pull` of it gives the same tree; a snapshot of the fork is
//! a snapshot of a snapshot, with both ancestors in its lineage and in a receipt of a run
//! from it. The sandbox keeps running through its snapshot. Pause and resume keep a
//! running process where it was.

mod common;

use common::*;

/// Every entry's type, mode, owner, path and link target (not times, and no directory
/// sizes: those belong to the file system, not the tree), then the hash of every file
/// under the places the test changes and /etc.
const LISTING: &str = "cd / && find . -xdev \\( -path ./proc -o -path ./sys -o -path ./dev -o -path ./tmp \\) -prune -o -printf '%y %m %U:%G %p -> %l\\n' | LC_ALL=C sort && find ./opt ./data ./etc -xdev -type f -exec sha256sum {} + | LC_ALL=C sort";

/// The same for the changed places only (what `docker run` shows identically: Docker
/// adds its own files at the root and in /etc).
const CHANGED: &str = "cd / && find ./opt ./data -printf '%y %m %U:%G %p -> %l\\n' | LC_ALL=C sort && find ./opt ./data -type f -exec sha256sum {} + | LC_ALL=C sort";

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

#[test]
fn a_snapshot_is_an_image_that_forks_on_another_node() {
    let data = tempfile::tempdir().unwrap();
    let reg = Registry::start_in(data.path(), &[]);
    let a = Node::setup(&reg);
    debian_base();
    build_and_push(
        &format!("{}/snap/base:v1", reg.addr),
        "FROM amber-test/debian:bookworm\n\
         RUN mkdir -p /data/dir/sub && echo keep > /data/keep && echo gone > /data/gone \
             && echo old > /data/dir/sub/old && chmod 644 /data/keep\n",
        &[],
    );
    let created = a.amber(&reg, &["create", "--disk", "1024", "snap/base:v1"]);
    assert!(created.status.success(), "{}", stderr(&created));
    let id = stdout(&created).trim().to_string();
    let exec = |node: &Node, id: &str, script: &str| {
        let o = node.amber(&reg, &["exec", id, "--", "sh", "-c", script]);
        assert!(o.status.success(), "{script}: {}", stderr(&o));
        stdout(&o)
    };
    // Installed files (a big one, a symlink, a hard link), a deleted file of the image,
    // a changed mode and owner, and a directory of the image made again (opaque).
    exec(
        &a,
        &id,
        "mkdir -p /opt/app && echo hello > /opt/app/a && head -c 3000000 /dev/urandom > /opt/app/big \
         && ln -s a /opt/app/link && ln /opt/app/a /opt/app/hard && chmod 4750 /opt/app/big \
         && rm /data/gone && chmod 600 /data/keep && chown 1234:99 /data/keep \
         && rm -rf /data/dir && mkdir /data/dir && echo new > /data/dir/new",
    );
    let before = exec(&a, &id, LISTING);
    assert!(
        before.contains("f 600 1234:99 ./data/keep -> \n"),
        "{before}"
    );
    assert!(!before.contains("./data/gone"), "{before}");

    let recipes = reg.metric_sum("amber_layer_recipes_total", "");
    let snap = json(&a.amber(&reg, &["snapshot", &id, "--tag", "snap/saved:v1", "--json"]));
    let image = snap["image"].as_str().unwrap().to_string();
    assert!(image.starts_with("snap/saved@sha256:"), "{snap}");
    assert_eq!(snap["tag"], "snap/saved:v1");
    let env = snap["env_digest"].as_str().unwrap().to_string();
    assert!(env.starts_with("blake3:"), "{snap}");
    let base_digest = reg.json("/amber/v1/resolve/snap/base/v1")["image_digest"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        snap["parents"][0]["image"],
        format!("snap/base@{base_digest}")
    );
    assert_eq!(snap["parents"].as_array().unwrap().len(), 1);
    // About what the sandbox wrote: 3 MB of random bytes and a few small files.
    let layer = snap["layer_bytes"].as_u64().unwrap();
    assert!((3_000_000..3_300_000).contains(&layer), "{snap}");
    // The layer (an uncompressed tar) is kept as a recipe over the env's chunks: the
    // registry stores what the sandbox wrote once, and `docker pull` below gets the
    // layer rebuilt from it.
    assert_eq!(
        reg.metric_sum("amber_layer_recipes_total", ""),
        recipes + 1.0
    );
    // The sandbox keeps running, with its state, and writes again.
    assert_eq!(
        exec(
            &a,
            &id,
            "cat /opt/app/a && echo more > /opt/app/after && cat /opt/app/after"
        ),
        "hello\nmore\n"
    );

    // Forked on a second node (its own home, nothing cached): two sandboxes in one call,
    // each showing exactly the state at the snapshot.
    let b = Node::setup(&reg);
    assert!(!b.chunks().exists() || files_under(&b.chunks()).is_empty());
    let forked = b.amber(&reg, &["create", "--count", "2", &image]);
    assert!(forked.status.success(), "{}", stderr(&forked));
    let ids: Vec<String> = stdout(&forked).lines().map(str::to_string).collect();
    assert_eq!(ids.len(), 2, "{}", stdout(&forked));
    for f in &ids {
        assert_eq!(exec(&b, f, LISTING), before, "fork {f}");
    }
    let o = b.amber(&reg, &["exec", &ids[0], "--", "test", "-e", "/data/gone"]);
    assert_eq!(o.status.code(), Some(1), "the deleted file is absent");
    // The forks are independent sandboxes.
    exec(&b, &ids[1], "echo mine > /opt/app/a");
    assert_eq!(exec(&b, &ids[0], "cat /opt/app/a"), "hello\n");

    // `docker pull` of the snapshot gives the same tree.
    let pulled = format!("{}/snap/saved:v1", reg.addr);
    docker_ok(&["pull", "-q", &pulled]);
    let in_docker = docker_ok(&[
        "run",
        "--rm",
        "--network",
        "none",
        &pulled,
        "sh",
        "-c",
        CHANGED,
    ]);
    assert_eq!(exec(&b, &ids[0], CHANGED), in_docker);
    assert!(
        in_docker.contains("f 4750 0:0 ./opt/app/big -> \n"),
        "{in_docker}"
    );

    // A snapshot of the fork (untagged: its repository, by digest) is a snapshot of a
    // snapshot: both ancestors in its lineage, and in a receipt of a run from it.
    exec(&b, &ids[0], "rm /opt/app/big && echo v2 > /opt/app/a");
    let again = json(&b.amber(&reg, &["snapshot", &ids[0], "--json"]));
    let second = again["image"].as_str().unwrap().to_string();
    assert!(second.starts_with("snap/saved@sha256:"), "{again}");
    let parents: Vec<&str> = again["parents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["image"].as_str().unwrap())
        .collect();
    assert_eq!(
        parents,
        [image.as_str(), &format!("snap/base@{base_digest}")]
    );
    assert_eq!(again["parents"][0]["env_digest"], env.as_str());
    let receipt = data.path().join("receipt.json");
    let o = a.amber(
        &reg,
        &[
            "run",
            "--receipt",
            receipt.to_str().unwrap(),
            &second,
            "--",
            "sh",
            "-c",
            "cat /opt/app/a /data/keep; stat -c '%a %u' /data/keep; test -e /opt/app/big || echo no-big",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "v2\nkeep\n600 1234\nno-big\n");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&receipt).unwrap()).unwrap();
    assert_eq!(r["env_digest"], again["env_digest"]);
    assert_eq!(r["parents"].as_array().unwrap().len(), 2, "{r}");
    assert_eq!(r["parents"][1]["image"], format!("snap/base@{base_digest}"));

    // Pause and resume: the VM is saved to a file and no QEMU runs; a long-running
    // process continues where it was (same process, its counter counts on from the
    // value it had), and the disk holds what was written before.
    exec(
        &a,
        &id,
        "setsid -f sh -c 'echo $$ > /tmp/pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.05; done' </dev/null >/dev/null 2>&1",
    );
    let count = |node: &Node, id: &str| -> u64 {
        // Waits, in the guest, for the counter to move past the value it first reads.
        let o = exec(
            node,
            id,
            "until [ -s /tmp/counter ]; do sleep 0.01; done; n=$(cat /tmp/counter); until [ \"$(cat /tmp/counter)\" -gt \"$n\" ]; do sleep 0.01; done; cat /tmp/counter",
        );
        o.trim()
            .parse()
            .unwrap_or_else(|_| panic!("counter: {o:?}"))
    };
    let before = count(&a, &id);
    let pid = exec(&a, &id, "cat /tmp/pid");
    let o = a.amber(&reg, &["pause", &id]);
    assert!(o.status.success(), "{}", stderr(&o));
    let vm_dir = a.home.path().join("sandboxes").join(&id).join("vm");
    assert!(vm_dir.join("vm.state").metadata().unwrap().len() > 0);
    assert!(
        !vm_dir.join("qemu.pid").exists(),
        "no QEMU runs while paused"
    );
    let o = a.amber(&reg, &["exec", &id, "--", "true"]);
    assert_eq!(o.status.code(), Some(125));
    assert!(
        stderr(&o).contains("is paused: resume it"),
        "{}",
        stderr(&o)
    );
    let o = a.amber(&reg, &["pause", &id]);
    assert!(stderr(&o).contains("already paused"), "{}", stderr(&o));
    let o = a.amber(&reg, &["resume", &id]);
    assert!(o.status.success(), "{}", stderr(&o));
    let after = count(&a, &id);
    assert!(after > before, "the counter went from {before} to {after}");
    assert_eq!(
        exec(&a, &id, "kill -0 $(cat /tmp/pid) && cat /tmp/pid"),
        pid
    );
    assert_eq!(exec(&a, &id, "cat /opt/app/after"), "more\n");
    assert!(!vm_dir.join("vm.state").exists());
    let o = a.amber(&reg, &["resume", &id]);
    assert!(
        stderr(&o).contains("is running, not paused"),
        "{}",
        stderr(&o)
    );

    // What cannot be snapshotted says why, and changes nothing.
    let o = a.amber(&reg, &["snapshot", &id, "--tag", "snap/x@sha256:00"]);
    assert_eq!(o.status.code(), Some(125));
    assert!(
        stderr(&o).contains("tag \"snap/x@sha256:00\""),
        "{}",
        stderr(&o)
    );
    let mem = a.amber(&reg, &["create", "--disk", "0", "snap/base:v1"]);
    let mem = stdout(&mem).trim().to_string();
    let o = a.amber(&reg, &["snapshot", &mem]);
    assert_eq!(o.status.code(), Some(125));
    assert!(
        stderr(&o).contains("a snapshot needs its writable disk"),
        "{}",
        stderr(&o)
    );
    let o = a.amber(&reg, &["snapshot", "nosuchsandbox"]);
    assert_eq!(o.status.code(), Some(125));
    assert!(
        stderr(&o).contains("no sandbox nosuchsandbox"),
        "{}",
        stderr(&o)
    );
    assert_eq!(exec(&a, &id, "cat /opt/app/after"), "more\n");
    // A sandbox with its writes in memory pauses too, and removing it while paused
    // leaves nothing.
    let o = a.amber(&reg, &["pause", &mem]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = a.amber(&reg, &["rm", &mem]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!a.home.path().join("sandboxes").join(&mem).exists());
    let mem = String::new();

    for (node, ids) in [(&a, vec![id, mem]), (&b, ids)] {
        for i in ids.into_iter().filter(|i| !i.is_empty()) {
            let o = node.amber(&reg, &["rm", &i]);
            assert!(o.status.success(), "{}", stderr(&o));
        }
    }
}
