//! Lazy and verified: `amber run -- true` on an image of more than 500 MiB fetches at most
//! 10% of the image's bytes; a second run on the node fetches no chunk; a chunk corrupted
//! in the registry's store fails the run with an integrity error naming it, and the node
//! cache never keeps it; a tampered image manifest or config is an integrity error naming
//! it, with nothing run. `amber prefetch` fills a cold node cache with every chunk of the
//! env, reporting progress, after which a run fetches nothing.

mod common;

use common::*;

#[test]
fn a_big_image_boots_lazily_and_a_corrupt_chunk_is_an_integrity_error() {
    let data = tempfile::tempdir().unwrap();
    // No manifests held in the registry's memory: the tampering below edits the store's
    // files, and a held manifest would be served unchanged (the registry's cache is what
    // a user gets; the node's verification is what this test is about).
    let reg = Registry::start_in(data.path(), &["--manifest-cache-bytes", "0"]);
    let node = Node::setup(&reg);
    debian_base();
    let image = format!("{}/lazy/big:v1", reg.addr);
    let digest = build_and_push(
        &image,
        "FROM amber-test/debian:bookworm\n\
         RUN mkdir /data && for i in $(seq 1 55); do head -c 10485760 /dev/urandom > /data/blob$i; done\n",
        &[],
    );
    let pinned = format!("lazy/big@{digest}");
    let manifest = reg.json(&format!("/v2/lazy/big/manifests/{digest}"));
    let image_bytes: u64 = manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["size"].as_u64().unwrap())
        .sum();
    assert!(image_bytes > 500 << 20, "the image has {image_bytes} bytes");

    let chunk_gets = || {
        reg.metric_sum(
            "amber_http_requests_total",
            "route=\"amber_chunk\",method=\"GET\"",
        )
    };
    let bytes_out = || reg.metric_sum("amber_http_body_bytes_out_total", "");
    // amber waits for the conversion; run once so the env exists, then measure cold.
    let o = node.amber(&reg, &["run", &pinned, "--", "true"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(node.chunks()).unwrap();
    let before = bytes_out();
    let o = node.amber(&reg, &["run", &pinned, "--", "true"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let fetched = bytes_out() - before;
    assert!(
        fetched <= 0.10 * image_bytes as f64,
        "a cold run fetched {fetched} of {image_bytes} bytes"
    );
    let gets = chunk_gets();
    let o = node.amber(&reg, &["run", &pinned, "--", "true"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(chunk_gets(), gets, "a warm run fetched chunks");

    // Corrupt the chunk holding the superblock: a valid zstd frame of other bytes.
    let env = reg.env_of("lazy/big", &digest);
    let envelope = reg.json(&format!("/amber/v1/envs/{env}"));
    let first = &envelope["manifest"]["extents"][0];
    assert_eq!(first["offset"], 0);
    let chunk = first["chunk"].as_str().unwrap().to_string();
    reg.wait_recompressed();
    let file = reg.chunk_file(&chunk);
    let good = std::fs::read(&file).unwrap();
    let len = first["length"].as_u64().unwrap() as usize;
    std::fs::write(&file, zstd::encode_all(&vec![0x5a; len][..], 3).unwrap()).unwrap();
    std::fs::remove_dir_all(node.chunks()).unwrap();
    let o = node.amber(&reg, &["run", &pinned, "--", "true"]);
    assert_eq!(o.status.code(), Some(125), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("integrity error: chunk {chunk}")),
        "{}",
        stderr(&o)
    );
    let cached = node
        .chunks()
        .join(&chunk["blake3:".len()..][..2])
        .join(&chunk["blake3:".len()..]);
    assert!(
        !cached.exists(),
        "the node cache kept a chunk that failed verification"
    );
    std::fs::write(&file, good).unwrap();

    // The image manifest and config are verified against their digests too: one byte
    // changed in the store (same length, so the registry serves it as it would the
    // original) is an integrity error naming the object, and the command never runs.
    let config = manifest["config"]["digest"].as_str().unwrap().to_string();
    for (object, digest) in [("image config", &config), ("image manifest", &digest)] {
        let file = reg.blob_file(digest);
        let good = std::fs::read(&file).unwrap();
        let mut bad = good.clone();
        let at = bad.iter().position(|&b| b == b'"').expect("a JSON string");
        bad[at + 1] ^= 0x01;
        std::fs::write(&file, &bad).unwrap();
        let o = node.amber(&reg, &["run", &pinned, "--", "echo", "ran"]);
        std::fs::write(&file, &good).unwrap();
        assert_ne!(o.status.code(), Some(0), "{}", stderr(&o));
        assert_eq!(stdout(&o), "", "the command ran on tampered {object}");
        let want = format!("integrity error: {object} of lazy/big {digest}");
        assert!(
            stderr(&o).contains(&want),
            "want {want:?} in {}",
            stderr(&o)
        );
    }

    // Repaired in the store, the same node runs again.
    let o = node.amber(&reg, &["run", &pinned, "--", "echo", "ran"]);
    assert_eq!(stdout(&o), "ran\n", "{}", stderr(&o));

    // Prefetch into a cold cache: every distinct chunk of the env once, with progress
    // lines (stderr is not a terminal) from nothing cached to all of it.
    let mut chunks: Vec<(String, u64)> = envelope["manifest"]["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["chunk"].as_str().unwrap().to_string(),
                e["length"].as_u64().unwrap(),
            )
        })
        .collect();
    chunks.sort();
    chunks.dedup();
    let env_bytes: u64 = chunks.iter().map(|(_, n)| n).sum();
    // The env's chunks leave the node's cache (the kernel modules' env stays).
    let cached = |chunk: &str| {
        let hex = &chunk["blake3:".len()..];
        node.chunks().join(&hex[..2]).join(hex)
    };
    for (chunk, _) in &chunks {
        let _ = std::fs::remove_file(cached(chunk));
    }
    let gets = chunk_gets();
    let o = node.amber(&reg, &["prefetch", &pinned]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("amber: prefetch "))
        .collect();
    assert!(lines.len() >= 2, "progress lines: {lines:?}");
    assert_eq!(
        *lines.last().unwrap(),
        format!("amber: prefetch {env}: {env_bytes} of {env_bytes} bytes cached, {env_bytes} fetched, done"),
        "{err}"
    );
    assert_eq!(
        chunk_gets() - gets,
        chunks.len() as f64,
        "a prefetch fetches each distinct chunk once"
    );
    assert!(chunks.iter().all(|(c, _)| cached(c).exists()));
    // Prefetched again: nothing to fetch. A run after it fetches no chunk either.
    let o = node.amber(&reg, &["prefetch", &pinned]);
    assert!(
        stderr(&o).ends_with(&format!(
            "amber: prefetch {env}: {env_bytes} of {env_bytes} bytes cached, 0 fetched, done\n"
        )),
        "{}",
        stderr(&o)
    );
    let o = node.amber(&reg, &["run", "--prefetch", &pinned, "--", "echo", "warm"]);
    assert_eq!(stdout(&o), "warm\n", "{}", stderr(&o));
    assert_eq!(
        chunk_gets() - gets,
        chunks.len() as f64,
        "a run after a prefetch fetched chunks"
    );
    // An image that does not exist: an error naming it, nothing fetched.
    let o = node.amber(&reg, &["prefetch", "lazy/big:missing"]);
    assert_eq!(o.status.code(), Some(125), "{}", stderr(&o));
    assert!(stderr(&o).contains("lazy/big:missing"), "{}", stderr(&o));
    assert_eq!(chunk_gets() - gets, chunks.len() as f64);
}
