//! Reused conversion work (`chain`): an image converted from the kept state of its lower
//! layers gets exactly the env digest and the device bytes of a conversion of every
//! layer, with whiteouts, opaque directories, hard links and overwrites above the reused
//! layers, and reads back only the chunks it must.

mod common;

use std::cell::Cell;
use std::collections::HashMap;
use std::io;

use amber_converter::chain::ChainState;
use amber_converter::chunk::ChunkSource;
use amber_converter::manifest::ChunkId;
use amber_converter::{convert_reusing, tree, Converted, LayerInput, Reuse};
use common::*;

/// Bytes that differ per seed and do not compress to nothing.
fn noise(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| {
            (i.wrapping_add(seed.wrapping_mul(7919))
                .wrapping_mul(2654435761)
                >> 13) as u8
        })
        .collect()
}

/// A base with many small files (several packs), large files (one with a zero piece),
/// links and a directory a later layer makes opaque; layers above it overwrite, delete,
/// hide and hard-link what the base holds, and add files between the base's names.
fn layers() -> Vec<Vec<u8>> {
    let mut base = Layer::new()
        .dir("usr", 0o755)
        .dir("usr/lib", 0o755)
        .dir("opt", 0o755)
        .dir("opt/tool", 0o755);
    for i in 0..120u32 {
        let len = 100 + (i as usize * 997) % 9000;
        base = base.file(&format!("usr/lib/m{i:03}.py"), 0o644, &noise(i, len));
    }
    for i in 0..10u32 {
        base = base.file(&format!("opt/tool/t{i}"), 0o755, &noise(500 + i, 3000));
    }
    let mut big_with_hole = noise(900, 600 << 10);
    big_with_hole.extend(vec![0u8; 2 << 20]);
    big_with_hole.extend(noise(901, 100 << 10));
    let base = base
        .file("usr/lib/big.so", 0o755, &noise(902, 3 << 20))
        .file("usr/lib/holey.bin", 0o644, &big_with_hole)
        .file("usr/lib/zeros", 0o644, &[0u8; 5000])
        .file("usr/lib/empty", 0o644, b"")
        .hardlink("usr/lib/alias.py", "usr/lib/m007.py")
        .symlink("lib", "usr/lib")
        .tar();
    let mut env = Layer::new();
    for i in (0..120u32).step_by(9) {
        // New names between the base's (laid out in the env layer's own group).
        env = env.file(
            &format!("usr/lib/m{i:03}a.py"),
            0o644,
            &noise(2000 + i, 700),
        );
    }
    let env = env
        .file("usr/lib/m010.py", 0o600, b"overwritten by the env layer\n")
        .file("usr/lib/.wh.m011.py", 0o644, b"")
        .file("usr/lib/big.so", 0o755, &noise(903, (1 << 20) + 5))
        .file("srv/data", 0o644, &noise(904, 50_000))
        .tar();
    let task = Layer::new()
        .file("opt/tool/.wh..wh..opq", 0o644, b"")
        .file("opt/tool/only", 0o755, b"#!/bin/sh\necho only\n")
        .file("usr/lib/.wh.m012.py", 0o644, b"")
        .file("usr/lib/.wh.holey.bin", 0o644, b"")
        .hardlink("usr/lib/second-alias.py", "usr/lib/m020.py")
        .file("usr/lib/m030.py", 0o644, b"changed by the task\n")
        .file("srv/data", 0o600, &noise(905, 40_000))
        .tar();
    let last = Layer::new()
        .file("zzz/new", 0o644, b"appended last\n")
        .tar();
    vec![base, env, task, last]
}

/// Reads chunks from a MemSink, counting reads.
struct Source<'s> {
    chunks: &'s HashMap<ChunkId, Vec<u8>>,
    reads: &'s Cell<u64>,
}

impl ChunkSource for Source<'_> {
    fn chunk(&mut self, id: &ChunkId) -> io::Result<Vec<u8>> {
        self.reads.set(self.reads.get() + 1);
        self.chunks
            .get(id)
            .cloned()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no chunk {id}")))
    }
}

/// Converts `layers` (those above `start`) into `sink`, keeping the states `keep` asks
/// for; `chunks` is what the store held before.
fn convert_from(
    layers: &[Vec<u8>],
    start: Option<ChainState>,
    keep: Vec<u32>,
    store: &mut MemSink,
    reads: &Cell<u64>,
    raw: Option<&mut Vec<u8>>,
) -> Converted {
    let first = start.as_ref().map_or(0, |s| s.layers as usize);
    let before = store.chunks.clone();
    let mut source = Source {
        chunks: &before,
        reads,
    };
    let inputs = layers[first..].iter().enumerate().map(|(i, l)| LayerInput {
        name: format!("layer{}", first + i),
        reader: Box::new(&l[..]),
    });
    let mut scratch = tempfile::tempfile().unwrap();
    convert_reusing(
        inputs,
        &mut scratch,
        store,
        raw.map(|r| r as &mut dyn amber_converter::chunk::RawSink),
        &mut |_| {},
        tree::Limits::default(),
        Reuse {
            start,
            keep,
            source: Some(&mut source),
            keep_whole: None,
            keep_also: None,
        },
    )
    .unwrap()
}

/// Through an encode/decode round trip, as a registry stores it.
fn stored(s: &ChainState) -> ChainState {
    ChainState::decode(&s.encode()).unwrap()
}

#[test]
fn every_split_point_gives_the_env_of_a_full_conversion() {
    let tars = layers();
    let (full, raw, _) = run(&tars).unwrap();
    let env = full.manifest.env_digest();
    let reads = Cell::new(0);
    let mut store = MemSink::default();
    let n = tars.len() as u32;
    let keep: Vec<u32> = (1..=n).collect();
    let kept = convert_from(&tars, None, keep, &mut store, &reads, None);
    assert_eq!(
        kept.manifest.env_digest(),
        env,
        "keeping states changes nothing"
    );
    assert_eq!(kept.chains.len(), tars.len());
    for state in &kept.chains {
        let k = state.layers;
        assert_eq!(state.diff_ids[..], full.diff_ids[..k as usize]);
        // Without a raw sink (the registry's way) and with one (every byte read back).
        let mut again = MemSink {
            chunks: store.chunks.clone(),
            puts: 0,
        };
        let out = convert_from(&tars, Some(stored(state)), vec![], &mut again, &reads, None);
        assert_eq!(
            out.manifest.env_digest(),
            env,
            "from the state of layers 1-{k}"
        );
        assert_eq!(out.diff_ids, full.diff_ids);
        assert_eq!(out.layer_bytes, full.layer_bytes);
        assert_eq!(out.chunks, full.chunks);
        assert_eq!(assemble(&out, &again), raw, "device from layers 1-{k}");
        let mut dev = Vec::new();
        let out = convert_from(
            &tars,
            Some(stored(state)),
            vec![],
            &mut again,
            &reads,
            Some(&mut dev),
        );
        dev.resize(out.manifest.device_size as usize, 0);
        assert_eq!(out.manifest.env_digest(), env);
        assert_eq!(dev, raw, "raw device from layers 1-{k}");
    }
}

#[test]
fn states_kept_from_a_reused_state_are_valid_too() {
    let tars = layers();
    let env = run(&tars).unwrap().0.manifest.env_digest();
    let reads = Cell::new(0);
    let mut store = MemSink::default();
    let s1 = convert_from(&tars, None, vec![1], &mut store, &reads, None).chains;
    let later = convert_from(
        &tars,
        Some(stored(&s1[0])),
        vec![2, 3],
        &mut store,
        &reads,
        None,
    );
    assert_eq!(later.manifest.env_digest(), env);
    for s in &later.chains {
        let out = convert_from(&tars, Some(stored(s)), vec![], &mut store, &reads, None);
        assert_eq!(out.manifest.env_digest(), env, "layers 1-{}", s.layers);
    }
}

#[test]
fn another_image_on_the_same_base_gets_its_own_full_conversion_digest() {
    let tars = layers();
    let reads = Cell::new(0);
    let mut store = MemSink::default();
    let states = convert_from(&tars, None, vec![2], &mut store, &reads, None).chains;
    let other_top = Layer::new()
        .file("usr/lib/.wh.m050.py", 0o644, b"")
        .file("usr/lib/m051.py", 0o644, b"another task\n")
        .file("usr/lib/.wh..wh..opq", 0o644, b"")
        .file("usr/lib/kept-after-opaque", 0o644, b"x")
        .tar();
    let other = vec![tars[0].clone(), tars[1].clone(), other_top];
    let full = run(&other).unwrap();
    let out = convert_from(
        &other,
        Some(stored(&states[0])),
        vec![],
        &mut store,
        &reads,
        None,
    );
    assert_eq!(out.manifest.env_digest(), full.0.manifest.env_digest());
    assert_eq!(assemble(&out, &store), full.1);
}

#[test]
fn unchanged_packs_and_large_files_are_not_read_back() {
    let tars = layers();
    let reads = Cell::new(0);
    let mut store = MemSink::default();
    let n = tars.len() as u32;
    let states = convert_from(&tars, None, vec![n - 1], &mut store, &reads, None).chains;
    assert_eq!(reads.get(), 0, "a full conversion reads nothing back");
    let puts_before = store.puts;
    let out = convert_from(
        &tars,
        Some(stored(&states[0])),
        vec![],
        &mut store,
        &reads,
        None,
    );
    // The last layer adds one file at the end of the name order: only the packs next to
    // it (and the metadata) change; every other pack and large file is named from the
    // state without reading it.
    let extents = out.manifest.extents.len() as u64;
    assert!(
        reads.get() <= 2,
        "{} chunks read back for {extents} extents",
        reads.get()
    );
    assert!(store.puts - puts_before < extents / 4);
}

#[test]
fn a_state_that_names_a_missing_chunk_fails_the_conversion_with_its_id() {
    let tars = layers();
    let reads = Cell::new(0);
    let mut store = MemSink::default();
    let state = convert_from(&tars, None, vec![1], &mut store, &reads, None)
        .chains
        .remove(0);
    // A store that lost everything, and a layer that deletes every other file of the
    // base: a pack of the base that loses some of its files is cut anew from the
    // stored bytes of the rest, which the store cannot give.
    let mut empty = MemSink::default();
    let before = HashMap::new();
    let mut source = Source {
        chunks: &before,
        reads: &reads,
    };
    let mut deletes = Layer::new();
    for i in (1..120u32).step_by(2) {
        deletes = deletes.file(&format!("usr/lib/.wh.m{i:03}.py"), 0o644, b"");
    }
    let deletes = deletes.tar();
    let inputs = [&deletes].into_iter().map(|l| LayerInput {
        name: "layer".into(),
        reader: Box::new(&l[..]),
    });
    let err = convert_reusing(
        inputs,
        &mut tempfile::tempfile().unwrap(),
        &mut empty,
        None,
        &mut |_| {},
        tree::Limits::default(),
        Reuse {
            start: Some(state),
            keep: vec![],
            source: Some(&mut source),
            keep_whole: None,
            keep_also: None,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("no chunk blake3:"), "{err}");
}

#[test]
fn a_pack_that_lost_its_tail_is_not_taken_for_the_stored_chunk() {
    // Files that do not end a pack (their hash's low bits are not zero), then one a later
    // layer deletes: the new pack is the stored chunk's head, not the chunk.
    let no_cut = |from: u32| {
        (from..)
            .map(|s| noise(s, 1000))
            .find(|d| {
                let h = blake3::hash(d);
                u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap()).trailing_zeros()
                    < amber_converter::chunk::PACK_BITS
            })
            .unwrap()
    };
    let base = Layer::new()
        .file("p/a", 0o644, &no_cut(1))
        .file("p/b", 0o644, &no_cut(1000))
        .file("p/c", 0o644, &no_cut(2000))
        .tar();
    let top = Layer::new().file("p/.wh.c", 0o644, b"").tar();
    let tars = vec![base, top];
    let (full, raw, _) = run(&tars).unwrap();
    let reads = Cell::new(0);
    let mut store = MemSink::default();
    // The state comes from the base image alone, where `c` was laid out in the pack.
    let state = convert_from(&tars[..1], None, vec![1], &mut store, &reads, None)
        .chains
        .remove(0);
    let out = convert_from(
        &tars,
        Some(stored(&state)),
        vec![],
        &mut store,
        &reads,
        None,
    );
    assert_eq!(out.manifest.env_digest(), full.manifest.env_digest());
    assert_eq!(assemble(&out, &store), raw);
}

#[test]
fn states_asked_for_at_a_boundary_or_refused_for_the_whole_image_are_as_kept_ones() {
    // `keep_also` is asked at each boundary below the whole image (chain length, the top
    // layer's uncompressed bytes, the tree's inodes); what it keeps is the state `keep`
    // would give. `keep_whole` saying no leaves the whole image's state out.
    let tars = layers();
    let n = tars.len() as u32;
    let reads = Cell::new(0);
    let mut store = MemSink::default();
    let listed = convert_from(&tars, None, (1..=n).collect(), &mut store, &reads, None);
    let mut asked = Vec::new();
    let mut scratch = tempfile::tempfile().unwrap();
    let inputs = tars.iter().enumerate().map(|(i, l)| LayerInput {
        name: format!("layer{i}"),
        reader: Box::new(&l[..]),
    });
    let mut again = MemSink::default();
    let out = convert_reusing(
        inputs,
        &mut scratch,
        &mut again,
        None,
        &mut |_| {},
        tree::Limits::default(),
        Reuse {
            start: None,
            keep: vec![n],
            source: None,
            keep_whole: Some(Box::new(|_| false)),
            keep_also: Some(Box::new(|len, bytes, inodes| {
                asked.push((len, bytes, inodes));
                len == 1
            })),
        },
    )
    .unwrap();
    assert_eq!(
        asked.len() as u32,
        n - 1,
        "asked below the whole image only"
    );
    assert_eq!(asked[0].1, tars[0].len() as u64, "the top layer's bytes");
    assert!(asked.windows(2).all(|w| w[0].2 <= w[1].2), "inodes grow");
    assert_eq!(
        out.chains.len(),
        1,
        "the one asked for; the whole one refused"
    );
    assert_eq!(out.chains[0].encode(), listed.chains[0].encode());
    assert_eq!(out.manifest, listed.manifest);
}
