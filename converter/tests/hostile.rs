//! Layer semantics and hostile layers: each case with its expected outcome (normalised
//! as docker does, or refused with an error naming the layer and the entry).

mod common;

use amber_converter::tree::{DataSource, Kind, Tree, TreeError};
use common::*;

fn p(path: &str) -> Vec<Vec<u8>> {
    path.split('/')
        .filter(|c| !c.is_empty())
        .map(|c| c.as_bytes().to_vec())
        .collect()
}

/// Applies uncompressed tar layers to a fresh tree; returns the tree and the scratch.
fn apply(layers: &[Vec<u8>]) -> Result<(Tree, Vec<u8>), TreeError> {
    let mut t = Tree::new();
    let mut scratch = Vec::new();
    let mut len = 0;
    for (i, l) in layers.iter().enumerate() {
        t.apply_layer(
            i as u32,
            &format!("layer{i}"),
            &l[..],
            &mut scratch,
            &mut len,
            None,
        )?;
    }
    Ok((t, scratch))
}

fn content(t: &Tree, scratch: &[u8], path: &str) -> Vec<u8> {
    let id = t
        .lookup(&p(path))
        .unwrap_or_else(|| panic!("{path} missing"));
    match &t.inodes[id].kind {
        Kind::File { data } => {
            let DataSource::Scratch { offset } = data.source else {
                panic!("{path}: data not in the scratch file")
            };
            scratch[offset as usize..(offset + data.len) as usize].to_vec()
        }
        other => panic!("{path} is {other:?}"),
    }
}

fn err_text(layers: &[Vec<u8>]) -> String {
    match apply(layers) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn dot_dot_inside_the_tree_is_resolved_and_escaping_is_refused() {
    let (t, _) = apply(&[Layer::new().raw(&raw_header_data("a/../b", b"x")).tar()]).unwrap();
    assert!(t.lookup(&p("b")).is_some());
    assert!(
        t.lookup(&p("a")).is_none(),
        "the path is cleaned first, as docker's filepath.Clean does"
    );
    let e = err_text(&[Layer::new()
        .raw(&raw_header("../../etc/evil", b'0', 0))
        .tar()]);
    assert!(
        e.contains("layer0") && e.contains("../../etc/evil") && e.contains("climbs above the root"),
        "{e}"
    );
}

#[test]
fn absolute_paths_are_made_relative() {
    let (t, s) = apply(&[Layer::new().raw(&raw_header_data("/etc/abs", b"abs")).tar()]).unwrap();
    assert_eq!(content(&t, &s, "etc/abs"), b"abs");
}

#[test]
fn a_write_through_a_symlink_is_refused() {
    let e = err_text(&[Layer::new()
        .symlink("link", "/etc")
        .file("link/passwd", 0o644, b"pwned")
        .tar()]);
    assert!(
        e.contains("layer0") && e.contains("link/passwd") && e.contains("symlink"),
        "{e}"
    );
    // Also across layers.
    let e = err_text(&[
        Layer::new().symlink("link", "/etc").tar(),
        Layer::new().file("link/passwd", 0o644, b"pwned").tar(),
    ]);
    assert!(e.contains("layer1") && e.contains("symlink"), "{e}");
}

#[test]
fn hard_links_to_missing_or_later_entries_are_refused() {
    let e = err_text(&[Layer::new().hardlink("h", "missing").tar()]);
    assert!(
        e.contains("layer0") && e.contains("\"h\"") && e.contains("does not exist"),
        "{e}"
    );
    let e = err_text(&[Layer::new()
        .hardlink("h", "later")
        .file("later", 0o644, b"x")
        .tar()]);
    assert!(e.contains("does not exist"), "{e}");
    let e = err_text(&[Layer::new().dir("d", 0o755).hardlink("h", "d").tar()]);
    assert!(e.contains("hard link to directory"), "{e}");
}

#[test]
fn hard_links_share_an_inode_also_across_layers() {
    let (t, s) = apply(&[
        Layer::new()
            .file("a", 0o4755, b"same")
            .hardlink("b", "a")
            .tar(),
        Layer::new()
            .hardlink("c", "a")
            .file("a", 0o644, b"replaced")
            .tar(),
    ])
    .unwrap();
    let (b, c) = (t.lookup(&p("b")).unwrap(), t.lookup(&p("c")).unwrap());
    assert_eq!(b, c, "b and c are one inode");
    assert_eq!(
        content(&t, &s, "c"),
        b"same",
        "replacing a keeps the linked inode"
    );
    assert_eq!(content(&t, &s, "a"), b"replaced");
    assert_eq!(t.inodes[b].meta.mode, 0o4755);
    let w = t.walk();
    assert_eq!(w.links[b], 2);
}

#[test]
fn duplicate_entries_the_later_wins() {
    let (t, s) = apply(&[Layer::new()
        .file("f", 0o644, b"first")
        .file("f", 0o600, b"second")
        .tar()])
    .unwrap();
    assert_eq!(content(&t, &s, "f"), b"second");
    assert_eq!(t.inodes[t.lookup(&p("f")).unwrap()].meta.mode, 0o600);
}

#[test]
fn whiteouts_and_opaque_directories_hide_lower_layers_only() {
    let (t, _) = apply(&[
        Layer::new()
            .file("keep", 0o644, b"k")
            .file("gone", 0o644, b"g")
            .file("d/lower", 0o644, b"l")
            .file("d/sub/deep", 0o644, b"x")
            .tar(),
        Layer::new()
            .file(".wh.gone", 0o644, b"")
            .dir("d", 0o755)
            .file("d/upper", 0o644, b"u")
            .file("d/sub/new", 0o644, b"n")
            .file("d/.wh..wh..opq", 0o644, b"")
            .tar(),
    ])
    .unwrap();
    assert!(t.lookup(&p("keep")).is_some());
    assert!(t.lookup(&p("gone")).is_none());
    assert!(
        t.lookup(&p("d/lower")).is_none(),
        "opaque hides lower entries"
    );
    assert!(t.lookup(&p("d/upper")).is_some());
    assert!(t.lookup(&p("d/sub/new")).is_some());
    assert!(
        t.lookup(&p("d/sub/deep")).is_none(),
        "opaque hides lower entries below too"
    );
    assert!(
        t.lookup(&p(".wh.gone")).is_none(),
        "whiteout files are not content"
    );
}

#[test]
fn a_whiteout_of_dot_dot_is_refused() {
    let e = err_text(&[Layer::new().raw(&raw_header("a/.wh...", b'0', 0)).tar()]);
    assert!(
        e.contains("layer0") && e.contains("a/.wh...") && e.contains("whiteout"),
        "{e}"
    );
}

#[test]
fn a_tar_declaring_a_huge_size_is_a_truncated_layer() {
    // One header claiming 1 TiB, followed by only 4 KiB of data.
    let mut t = raw_header("huge", b'0', 1 << 40);
    t.extend_from_slice(&[7u8; 4096]);
    let e = err_text(&[t.clone()]);
    assert!(e.contains("layer0") && e.contains("huge"), "{e}");
    // The same through a conversion that stores large files as their layer streams.
    let e = run_streamed(&[t]).unwrap_err().to_string();
    assert!(
        e.contains("layer0") && e.contains("huge") && e.contains("layer ends after 4096"),
        "{e}"
    );
}

#[test]
fn a_chunk_store_failing_on_a_large_file_names_the_file() {
    struct Full;
    impl amber_converter::chunk::ChunkSink for Full {
        fn put(&mut self, _: amber_converter::manifest::ChunkId, _: &[u8]) -> std::io::Result<()> {
            Err(std::io::Error::other("disk full"))
        }
    }
    let layer = Layer::new().file("big.bin", 0o644, &[9u8; 300_000]).tar();
    let mut scratch = tempfile::tempfile().unwrap();
    let inputs = [amber_converter::LayerInput {
        name: "layer0".into(),
        reader: Box::new(&layer[..]),
    }];
    let e = amber_converter::convert(inputs, &mut scratch, &mut Full, None, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layer0") && e.contains("big.bin") && e.contains("disk full"),
        "{e}"
    );
}

#[test]
fn a_path_64_kib_deep_is_refused() {
    let deep = "a/".repeat(32 * 1024) + "f";
    let e = err_text(&[Layer::new().file(&deep, 0o644, b"x").tar()]);
    assert!(
        e.contains("layer0") && e.contains("the limit is 4096"),
        "{}",
        &e[e.len().saturating_sub(200)..]
    );
}

#[test]
fn truncated_and_corrupt_gzip_streams_are_errors_naming_the_layer() {
    let layer = gzip(&Layer::new().file("f", 0o644, &[1u8; 100_000]).tar());
    let truncated = layer[..layer.len() / 2].to_vec();
    let e = run(&[truncated]).unwrap_err().to_string();
    assert!(e.contains("layer0"), "{e}");
    let mut corrupt = layer.clone();
    for b in corrupt[20..60].iter_mut() {
        *b ^= 0x5a;
    }
    let e = run(&[corrupt]).unwrap_err().to_string();
    assert!(e.contains("layer0"), "{e}");
}

#[test]
fn special_files_names_and_owners_are_kept() {
    let long = "n".repeat(200) + "/" + &"m".repeat(250);
    let (t, _) = apply(&[Layer::new()
        .device("dev/null", tar::EntryType::Char, 1, 3)
        .device("dev/sda", tar::EntryType::Block, 8, 0)
        .file_owned("big-ids", 0o644, 100_000, 4_000_000_000, b"x")
        .file(&long, 0o644, b"long")
        .raw(&raw_header_bytes(b"caf\xe9-latin1", b"x"))
        .file_pax(
            "cap",
            0o755,
            b"bin",
            &[
                ("SCHILY.xattr.security.capability", b"\x01\x00\x00\x02"),
                ("SCHILY.xattr.user.k", b"v"),
            ],
        )
        .tar()])
    .unwrap();
    assert!(matches!(
        t.inodes[t.lookup(&p("dev/null")).unwrap()].kind,
        Kind::CharDev { major: 1, minor: 3 }
    ));
    assert!(matches!(
        t.inodes[t.lookup(&p("dev/sda")).unwrap()].kind,
        Kind::BlockDev { major: 8, minor: 0 }
    ));
    let m = &t.inodes[t.lookup(&p("big-ids")).unwrap()].meta;
    assert_eq!((m.uid, m.gid), (100_000, 4_000_000_000));
    assert!(t.lookup(&p(&long)).is_some());
    assert!(t.lookup(&[b"caf\xe9-latin1".to_vec()]).is_some());
    let x = &t.inodes[t.lookup(&p("cap")).unwrap()].meta.xattrs;
    assert_eq!(
        x.get(&b"security.capability"[..]).map(|v| &v[..]),
        Some(&b"\x01\x00\x00\x02"[..])
    );
    assert_eq!(x.get(&b"user.k"[..]).map(|v| &v[..]), Some(&b"v"[..]));
}

#[test]
fn a_directory_with_a_million_entries_converts() {
    // Streamed through a pipe: the tar itself is never held in memory.
    let (reader, mut writer) = std::io::pipe().unwrap();
    let producer = std::thread::spawn(move || {
        let mut b = tar::Builder::new(&mut writer);
        for i in 0..1_000_000u32 {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o644);
            h.set_size(0);
            h.set_mtime(0);
            h.set_uid(0);
            h.set_gid(0);
            b.append_data(&mut h, format!("big/f{i:07}"), std::io::empty())
                .unwrap();
        }
        b.finish().unwrap();
    });
    let mut sink = MemSink::default();
    let mut scratch = tempfile::tempfile().unwrap();
    let layers = vec![amber_converter::LayerInput {
        name: "million".into(),
        reader: Box::new(reader),
    }];
    let out = amber_converter::convert(layers, &mut scratch, &mut sink, None, &mut |_| {}).unwrap();
    producer.join().unwrap();
    assert_eq!(out.inodes, 1_000_002, "root, big/ and a million files");
}

/// A hand-made ustar header (for names and sizes the builder would refuse or fix).
fn raw_header(name: &str, kind: u8, size: u64) -> Vec<u8> {
    let mut h = tar::Header::new_old();
    {
        let b = h.as_mut_bytes();
        b[..name.len()].copy_from_slice(name.as_bytes());
    }
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::new(kind));
    h.set_size(size);
    h.set_cksum();
    h.as_bytes().to_vec()
}

fn raw_header_bytes(name: &[u8], data: &[u8]) -> Vec<u8> {
    let mut h = tar::Header::new_old();
    h.as_mut_bytes()[..name.len()].copy_from_slice(name);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(data.len() as u64);
    h.set_cksum();
    let mut out = h.as_bytes().to_vec();
    out.extend_from_slice(data);
    out.resize(512 + data.len().div_ceil(512) * 512, 0);
    out
}

fn raw_header_data(name: &str, data: &[u8]) -> Vec<u8> {
    raw_header_bytes(name.as_bytes(), data)
}
