//! Determinism: the env digest and the device bytes depend on the file system content
//! alone: not on layer compression, process, run or what the chunk store already holds.

mod common;

use common::*;

fn layers() -> Vec<Vec<u8>> {
    let big: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    vec![
        Layer::new()
            .dir("usr", 0o755)
            .dir("usr/bin", 0o755)
            .file("usr/bin/tool", 0o755, &big)
            .file("etc/passwd", 0o644, b"root:x:0:0::/root:/bin/sh\n")
            .symlink("bin", "usr/bin")
            .file("zeros", 0o644, &vec![0u8; 2 << 20])
            .tar(),
        Layer::new()
            .file("app/main.py", 0o644, b"print(1)\n")
            .hardlink("app/alias.py", "app/main.py")
            .file_pax(
                "app/cap",
                0o755,
                b"x",
                &[("SCHILY.xattr.security.capability", b"\x01\x00\x00\x02")],
            )
            .tar(),
    ]
}

#[test]
fn same_content_same_digest_whatever_the_compression() {
    let tars = layers();
    let plain = run(&tars).unwrap();
    let gz = run(&tars.iter().map(|t| gzip(t)).collect::<Vec<_>>()).unwrap();
    let zs = run(&tars.iter().map(|t| zstd(t)).collect::<Vec<_>>()).unwrap();
    let mixed = run(&[gzip(&tars[0]), zstd(&tars[1])]).unwrap();
    let d = plain.0.manifest.env_digest();
    for (name, other) in [("gzip", &gz), ("zstd", &zs), ("mixed", &mixed)] {
        assert_eq!(other.0.manifest.env_digest(), d, "{name}");
        assert!(other.1 == plain.1, "{name}: devices differ");
    }
    assert_eq!(
        plain.0.diff_ids, gz.0.diff_ids,
        "diff_ids are of the uncompressed tar"
    );
}

#[test]
fn the_device_assembled_from_chunks_is_the_raw_device() {
    let (out, raw, sink) = run(&layers()).unwrap();
    out.manifest.validate().unwrap();
    assert_eq!(assemble(&out, &sink), raw);
    // The 2 MiB file of zeros is a hole: zero ranges are never stored.
    assert!(out.manifest.stored_bytes() < out.manifest.device_size);
    for e in &out.manifest.extents {
        assert!(
            sink.chunks[&e.chunk].iter().any(|&b| b != 0),
            "an all-zero chunk was stored"
        );
        assert!(e.length <= 1 << 20, "chunks are at most 1 MiB");
    }
}

#[test]
fn converting_into_a_warm_store_gives_the_same_manifest() {
    let tars = layers();
    let (cold, _, mut sink) = run(&tars).unwrap();
    let puts_before = sink.puts;
    let mut scratch = tempfile::tempfile().unwrap();
    let inputs = tars.iter().map(|l| amber_converter::LayerInput {
        name: "l".into(),
        reader: Box::new(&l[..]),
    });
    let warm =
        amber_converter::convert(inputs, &mut scratch, &mut sink, None, &mut |_| {}).unwrap();
    assert_eq!(warm.manifest, cold.manifest);
    assert_eq!(
        sink.chunks.len() as u64,
        cold.chunks,
        "no new chunk on the warm run"
    );
    assert!(sink.puts > puts_before);
}

/// Bytes that do not repeat within a chunk (so each large file's pieces are its own).
fn noise(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

#[test]
fn large_files_stored_as_their_layer_streams_give_the_device_laid_out_whole() {
    // Without a raw sink the converter stores large files' chunks while it reads their
    // layer; with one it reads every file back from the scratch file when laying out.
    // Both must give the same manifest and device, also where later layers hide,
    // replace or re-describe large files (whiteouts, opaque directories, hard links).
    let whiteouts = vec![
        Layer::new()
            .file("opt/a.bin", 0o644, &noise(1, 1_500_000))
            .file("opt/b.bin", 0o644, &noise(2, 300_000))
            .file("opt/small.txt", 0o644, b"small")
            .file("srv/data/c.bin", 0o644, &noise(3, 2 << 20))
            .file("srv/data/d.bin", 0o644, &noise(4, 700_000))
            .file("srv/keep.bin", 0o644, &noise(5, 400_000))
            .hardlink("srv/link.bin", "srv/keep.bin")
            .file("var/exact.bin", 0o644, &noise(6, 256 << 10))
            .file("var/under.bin", 0o644, &noise(7, (256 << 10) - 1))
            .tar(),
        Layer::new()
            .file("opt/.wh.a.bin", 0o644, b"")
            .file("opt/b.bin", 0o600, &noise(8, 900_000))
            .file("srv/data/.wh..wh..opq", 0o644, b"")
            .file("srv/data/e.bin", 0o644, &noise(9, 1 << 20))
            .file("var/zeros.bin", 0o644, &vec![0u8; 3 << 20])
            .tar(),
        Layer::new()
            .file("opt/a.bin", 0o644, &noise(1, 1_500_000))
            .file("srv/.wh.keep.bin", 0o644, b"")
            .tar(),
    ];
    for (name, tars) in [("fixture", layers()), ("whiteouts", whiteouts)] {
        let (laid_out, raw, _) = run(&tars).unwrap();
        let (streamed, sink) = run_streamed(&tars).unwrap();
        assert_eq!(streamed.manifest, laid_out.manifest, "{name}");
        assert_eq!(streamed.chunks, laid_out.chunks, "{name}");
        assert_eq!(assemble(&streamed, &sink), raw, "{name}: devices differ");
    }
}

#[test]
fn one_changed_file_changes_few_chunks() {
    // 200 small files; change one: only its pack (and metadata) may change.
    let build = |changed: bool| {
        let mut l = Layer::new();
        for i in 0..200 {
            let body = if changed && i == 100 {
                format!("changed {i}")
            } else {
                format!("file number {i}\n").repeat(50)
            };
            l = l.file(&format!("pkg/m{i:03}.py"), 0o644, body.as_bytes());
        }
        run(&[l.tar()]).unwrap().0.manifest
    };
    let (a, b) = (build(false), build(true));
    let ids = |m: &amber_converter::manifest::BlockManifest| {
        m.extents
            .iter()
            .map(|e| e.chunk)
            .collect::<std::collections::HashSet<_>>()
    };
    let (ia, ib) = (ids(&a), ids(&b));
    let new = ib.difference(&ia).count();
    assert!(a.extents.len() > 5, "{} chunks", a.extents.len());
    assert!(new <= 3, "{new} of {} chunks changed", b.extents.len());
}

#[test]
fn a_new_top_layer_leaves_the_lower_layers_bytes_as_they_were() {
    // A base with metadata of several chunks (30,000 files in 600 directories under
    // `usr`), then a task's own tree in `/testbed`, which sorts before `usr`: with the
    // lower layers' inodes, directories and data first, the two images share every chunk
    // but the first (the superblock and the root, which lists `testbed`) and their own.
    let mut base = Layer::new();
    for d in 0..600 {
        for f in 0..50 {
            base = base.file(
                &format!("usr/lib/d{d:03}/f{f:02}.py"),
                0o644,
                format!("{d} {f}\n").as_bytes(),
            );
        }
    }
    let base = base.tar();
    let task = |files: usize, tag: &str| {
        let mut l = Layer::new();
        for i in 0..files {
            l = l.file(
                &format!("testbed/src/m{i:03}.py"),
                0o644,
                format!("{tag} {i}\n").as_bytes(),
            );
        }
        l.tar()
    };
    let a = run(&[base.clone(), task(20, "a")]).unwrap().0.manifest;
    let b = run(&[base, task(25, "b")]).unwrap().0.manifest;
    let in_a: std::collections::HashSet<_> = a.extents.iter().map(|e| e.chunk).collect();
    let new: Vec<_> = b
        .extents
        .iter()
        .filter(|e| !in_a.contains(&e.chunk))
        .collect();
    let new_bytes: u64 = new.iter().map(|e| e.length).sum();
    let all: u64 = b.extents.iter().map(|e| e.length).sum();
    assert!(all > 4 << 20, "the base is {all} bytes: too small to tell");
    assert!(
        new_bytes <= (1 << 20) + (256 << 10),
        "{new_bytes} of {all} bytes new: {new:?}"
    );
    assert_eq!(
        new[0].offset, 0,
        "the first chunk changes (the root lists testbed)"
    );
}
