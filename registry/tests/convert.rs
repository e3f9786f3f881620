//! Conversion on push, the amber API, and determinism across processes and compressions.

mod common;

use amber_converter::manifest::{ChunkId, ManifestEnvelope};
use common::*;
use serde_json::{json, Value};

fn layers() -> Vec<Vec<u8>> {
    let big: Vec<u8> = (0..2_500_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 11) as u8)
        .collect();
    vec![
        files_tar(&[
            ("usr/lib/big.so", &big[..]),
            ("etc/os-release", b"ID=test\n"),
        ]),
        files_tar(&[
            ("app/main.py", &b"print(1)\n"[..]),
            ("app/data.txt", &b"data ".repeat(3000)),
        ]),
    ]
}

/// A layer as pushed: its bytes and media type.
type LayerBlob = (Vec<u8>, &'static str);

/// `tars` as gzip layers.
fn gzipped(tars: &[Vec<u8>]) -> Vec<LayerBlob> {
    tars.iter().map(|t| (gzip(t), TGZ)).collect()
}

/// Pushes an image with `blobs` as its layers; returns the manifest digest.
async fn push_image(s: &Server, repo: &str, tag: &str, blobs: &[(Vec<u8>, &str)]) -> String {
    push_image_labelled(s, repo, tag, blobs, "").await
}

/// `push_image` with a config that differs by its label.
async fn push_image_labelled(
    s: &Server,
    repo: &str,
    tag: &str,
    blobs: &[(Vec<u8>, &str)],
    label: &str,
) -> String {
    let config = json!({"architecture": "amd64", "os": "linux", "config": {"Labels": {"l": label}}, "rootfs": {"type": "layers", "diff_ids": []}}).to_string();
    let cd = push_blob(s, repo, config.as_bytes()).await;
    let mut descs = Vec::new();
    for (blob, mt) in blobs {
        let d = push_blob(s, repo, blob).await;
        descs.push(json!({"mediaType": mt, "digest": d, "size": blob.len()}));
    }
    let m = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": config.len()},
        "layers": descs,
    })
    .to_string();
    let r = put_manifest(
        s,
        repo,
        tag,
        "application/vnd.oci.image.manifest.v1+json",
        &m,
    )
    .await;
    assert_eq!(r.status(), 201);
    sha256(m.as_bytes())
}

/// The device as a runner would assemble it: every chunk fetched, verified, placed.
async fn device_from_api(s: &Server, env: &str) -> (ManifestEnvelope, Vec<u8>) {
    let r = client()
        .get(s.url(&format!("/amber/v1/envs/{env}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["cache-control"]
        .to_str()
        .unwrap()
        .contains("immutable"));
    let envelope: ManifestEnvelope = r.json().await.unwrap();
    assert_eq!(
        envelope.manifest.env_digest().to_string(),
        env,
        "the manifest hashes to its env digest"
    );
    let mut dev = vec![0u8; envelope.manifest.device_size as usize];
    for e in &envelope.manifest.extents {
        let data = chunk(s, &e.chunk.to_string(), e.length).await;
        dev[e.offset as usize..(e.offset + e.length) as usize].copy_from_slice(&data);
    }
    (envelope, dev)
}

fn local_conversion(blobs: &[Vec<u8>]) -> (String, Vec<u8>) {
    struct Null;
    impl amber_converter::chunk::ChunkSink for Null {
        fn put(&mut self, _: ChunkId, _: &[u8]) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut raw = Vec::new();
    let mut scratch = tempfile::tempfile().unwrap();
    let inputs = blobs.iter().map(|b| amber_converter::LayerInput {
        name: "l".into(),
        reader: Box::new(&b[..]),
    });
    let out =
        amber_converter::convert(inputs, &mut scratch, &mut Null, Some(&mut raw), &mut |_| {})
            .unwrap();
    raw.resize(out.manifest.device_size as usize, 0);
    (out.manifest.env_digest().to_string(), raw)
}

const TAR: &str = "application/vnd.oci.image.layer.v1.tar";
const TGZ: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const TZST: &str = "application/vnd.oci.image.layer.v1.tar+zstd";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_images_convert_to_the_same_device_whatever_the_compression() {
    pushed_images_convert_to_the_same_device_whatever_the_compression_on(Storage::Fs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_images_convert_to_the_same_device_whatever_the_compression_on_s3() {
    pushed_images_convert_to_the_same_device_whatever_the_compression_on(Storage::S3).await;
}

async fn pushed_images_convert_to_the_same_device_whatever_the_compression_on(storage: Storage) {
    let s = Server::start_on(storage, &[]);
    let tars = layers();
    let variants: Vec<(&str, Vec<LayerBlob>)> = vec![
        ("gzip", tars.iter().map(|t| (gzip(t), TGZ)).collect()),
        (
            "zstd",
            tars.iter()
                .map(|t| (zstd::bulk::compress(t, 3).unwrap(), TZST))
                .collect(),
        ),
        ("plain", tars.iter().map(|t| (t.clone(), TAR)).collect()),
    ];
    let (local_env, local_dev) = local_conversion(&tars);
    for (tag, blobs) in &variants {
        push_image(&s, "conv/app", tag, blobs).await;
    }
    for (tag, _) in &variants {
        let v = settled(&s, "conv/app", tag).await;
        assert_eq!(v["state"], "done", "{v}");
        assert_eq!(
            v["env_digest"], local_env,
            "{tag}: same env digest as a conversion in another process"
        );
        let (_, dev) = device_from_api(&s, &local_env).await;
        assert!(dev == local_dev, "{tag}: device bytes differ");
    }
    // The second and third pushes found every chunk already stored.
    let metrics = metrics_text(&s).await;
    let written = metric(&metrics, "amber_chunks_written_total");
    let existing = metric(&metrics, "amber_chunks_existing_total");
    assert!(
        written > 0 && existing >= 2 * written,
        "written {written}, existing {existing}"
    );
}

/// Source-like text: zstd at a high level stores it in clearly fewer bytes than level 1.
fn source_text(functions: usize) -> Vec<u8> {
    (0..functions)
        .map(|i| {
            format!(
                "def handler_{i}(request, user):\n    if user.id % {} == 0:\n        return render(request, 'page_{}.html', {{'id': {i}}})\n    return None\n",
                i % 13 + 2,
                i % 97
            )
        })
        .collect::<String>()
        .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_chunks_are_recompressed_at_the_stored_level_once_conversions_settle() {
    new_chunks_are_recompressed_on(Storage::Fs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_chunks_are_recompressed_at_the_stored_level_once_conversions_settle_on_s3() {
    new_chunks_are_recompressed_on(Storage::S3).await;
}

/// A conversion writes its new chunks at `convert_zstd_level`; once no conversion runs
/// they are replaced by their encoding at `chunk_zstd_level`: fewer bytes, the same
/// device, the same env digest as a conversion in another process.
async fn new_chunks_are_recompressed_on(storage: Storage) {
    let s = Server::start_on(
        storage,
        &["--convert-zstd-level", "1", "--chunk-zstd-level", "12"],
    );
    let tars = vec![files_tar(&[
        ("app/views.py", &source_text(12_000)[..]),
        ("app/main.py", b"print(2)\n"),
    ])];
    push_image(&s, "recompress/app", "v1", &gzipped(&tars)).await;
    let v = settled(&s, "recompress/app", "v1").await;
    assert_eq!(v["state"], "done", "{v}");
    let (local_env, local_dev) = local_conversion(&tars);
    assert_eq!(v["env_digest"], local_env);
    let mut text = String::new();
    for _ in 0..6_000 {
        text = metrics_text(&s).await;
        if metric(&text, "amber_chunks_recompressed_total") > 0
            && metric(&text, "amber_chunks_to_recompress") == 0
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (written, recompressed) = (
        metric(&text, "amber_chunks_written_total"),
        metric(&text, "amber_chunks_recompressed_total"),
    );
    assert!(
        recompressed > 0 && recompressed <= written,
        "chunks written {written}, recompressed {recompressed}"
    );
    assert_eq!(metric(&text, "amber_chunks_to_recompress"), 0, "{text}");
    let saved = metric(&text, "amber_chunk_bytes_saved_by_recompression_total");
    let stored = metric(&text, "amber_chunk_bytes_written_total");
    assert!(
        saved > 0 && saved < stored,
        "saved {saved} of the {stored} bytes written"
    );
    // Every chunk (the replaced ones too) still decompresses to the bytes its id names.
    let (_, dev) = device_from_api(&s, &local_env).await;
    assert!(dev == local_dev, "device bytes differ after recompression");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncompressed_layer_is_kept_as_a_recipe_and_served_byte_for_byte() {
    an_uncompressed_layer_is_kept_as_a_recipe_on(Storage::Fs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncompressed_layer_is_kept_as_a_recipe_and_served_byte_for_byte_on_s3() {
    an_uncompressed_layer_is_kept_as_a_recipe_on(Storage::S3).await;
}

/// A plain tar layer whose files the env's chunks hold is kept as a recipe over them
/// (the blob object goes), and every reader gets the blob's exact bytes: a pull, a range,
/// and a later conversion that reads the layer again.
async fn an_uncompressed_layer_is_kept_as_a_recipe_on(storage: Storage) {
    let s = Server::start_on(storage, &[]);
    let tars = layers();
    let (big, small) = (&tars[0], &tars[1]);
    assert!(big.len() > 1 << 20 && small.len() < 1 << 20);
    let blobs: Vec<LayerBlob> = tars.iter().map(|t| (t.clone(), TAR)).collect();
    push_image(&s, "conv/recipe", "v1", &blobs).await;
    let v = settled(&s, "conv/recipe", "v1").await;
    assert_eq!(v["state"], "done", "{v}");
    let metrics = metrics_text(&s).await;
    assert_eq!(
        metric(&metrics, "amber_layer_recipes_total"),
        1,
        "only the 1 MiB+ layer"
    );
    assert_eq!(
        metric(&metrics, "amber_layer_recipe_blob_bytes_total"),
        big.len() as u64
    );
    let big_digest = sha256(big);
    let hex = big_digest.trim_start_matches("sha256:");
    if storage == Storage::Fs {
        let store = s.data.join("store");
        assert!(!store
            .join(format!("blobs/sha256/{}/{hex}", &hex[..2]))
            .exists());
        let recipe = store.join(format!("recipes/sha256/{}/{hex}", &hex[..2]));
        let kept = std::fs::metadata(&recipe).unwrap().len();
        assert!(
            kept < 16 * 1024,
            "the recipe of a 2.5 MB layer is {kept} bytes"
        );
        let small_hex = sha256(small);
        let small_hex = small_hex.trim_start_matches("sha256:");
        assert!(store
            .join(format!("blobs/sha256/{}/{small_hex}", &small_hex[..2]))
            .exists());
    }
    // A pull: whole, HEAD, and ranges inside and across the large file.
    let url = s.url(&format!("/v2/conv/recipe/blobs/{big_digest}"));
    let r = client().get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["docker-content-digest"], big_digest.as_str());
    let got = r.bytes().await.unwrap();
    assert!(got[..] == big[..], "the blob rebuilt from its recipe");
    let r = client().head(&url).send().await.unwrap();
    assert_eq!(
        r.headers()["content-length"],
        big.len().to_string().as_str()
    );
    let n = big.len();
    for (a, b) in [(0, 511), (700, 1_500_000), (n - 3000, n - 1)] {
        let r = client()
            .get(&url)
            .header("Range", format!("bytes={a}-{b}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 206);
        let got = r.bytes().await.unwrap();
        assert!(got[..] == big[a..=b], "range {a}-{b}");
    }
    // Another image over the same layer reads it through the recipe; its env is what a
    // conversion of the original bytes gives.
    let top = files_tar(&[("srv/other.txt", &b"other"[..])]);
    push_image(
        &s,
        "conv/recipe",
        "v2",
        &[(big.clone(), TAR), (top.clone(), TAR)],
    )
    .await;
    let v = settled(&s, "conv/recipe", "v2").await;
    assert_eq!(v["state"], "done", "{v}");
    let (local_env, _) = local_conversion(&[big.clone(), top]);
    assert_eq!(v["env_digest"], local_env);
    // Pushing the layer again (this client does not ask first) stored nothing again.
    let metrics = metrics_text(&s).await;
    assert_eq!(metric(&metrics, "amber_layer_recipes_total"), 1);
    if storage == Storage::Fs {
        let blob = format!("store/blobs/sha256/{}/{hex}", &hex[..2]);
        assert!(!s.data.join(blob).exists());
    }
}

/// An image whose conversion stored far more chunk bytes than its tree's state takes
/// (a big base) keeps the state of its whole chain, so an image built FROM it, such as a
/// sandbox's snapshot, reads only its own layer; a small task image keeps none (above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_built_from_a_big_image_reads_only_its_own_layer() {
    let s = Server::start_on(Storage::Fs, &[]);
    // A base whose chunks are big beside its tree's state: 2 MiB that do not compress
    // (`layers()`'s big file compresses to about 28 KiB, near the threshold).
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let noise: Vec<u8> = (0..2 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect();
    let mut base = layers();
    base[0] = files_tar(&[
        ("usr/lib/big.so", &noise[..]),
        ("etc/os-release", b"ID=test\n"),
    ]);
    let blobs = gzipped;
    push_image(&s, "conv/from", "base", &blobs(&base)).await;
    assert_eq!(settled(&s, "conv/from", "base").await["state"], "done");
    let mut child = base.clone();
    child.push(files_tar(&[(
        "home/user/notes.txt",
        &b"written in a sandbox"[..],
    )]));
    push_image(&s, "conv/from", "child", &blobs(&child)).await;
    let v = settled(&s, "conv/from", "child").await;
    assert_eq!(v["state"], "done", "{v}");
    let (local_env, _) = local_conversion(&child);
    assert_eq!(v["env_digest"], local_env);
    let metrics = metrics_text(&s).await;
    // base: 2 layers read; child: its own layer only, the base's 2 reused.
    assert_eq!(metric(&metrics, "amber_conversion_layers_read_total"), 3);
    assert_eq!(metric(&metrics, "amber_conversion_layers_reused_total"), 2);
}

/// A base, an environment layer and two task layers that overwrite, delete (whiteouts),
/// hide (an opaque directory) and hard-link what the layers below them hold.
fn shared_base_layers() -> (Vec<Vec<u8>>, Vec<u8>, Vec<u8>, Vec<u8>) {
    let noise = |seed: u32, len: usize| -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_add(seed * 7919).wrapping_mul(2654435761) >> 13) as u8)
            .collect()
    };
    let mut base = Layer::new().dir("usr/lib", 0o755).dir("etc/conf.d", 0o755);
    for i in 0..60u32 {
        base = base.file(
            &format!("usr/lib/m{i:02}.py"),
            0o644,
            &noise(i, 200 + i as usize * 131),
        );
    }
    for i in 0..5u32 {
        base = base.file(&format!("etc/conf.d/c{i}"), 0o644, &noise(100 + i, 300));
    }
    let base = base
        .file("usr/lib/big.so", 0o755, &noise(7, 1_500_000))
        .hardlink("usr/lib/alias.py", "usr/lib/m03.py")
        .tar();
    let env = Layer::new()
        .file("usr/lib/m10a.py", 0o644, b"between base files\n")
        .file("usr/lib/m20.py", 0o600, b"overwritten\n")
        .file("usr/lib/.wh.m21.py", 0o644, b"")
        .tar();
    let task = |n: u8| {
        Layer::new()
            .file("etc/conf.d/.wh..wh..opq", 0o644, b"")
            .file("etc/conf.d/only", 0o644, &[n; 10])
            .file(&format!("usr/lib/.wh.m3{n}.py"), 0o644, b"")
            .hardlink("usr/lib/alias2.py", "usr/lib/m40.py")
            .file("usr/lib/big.so", 0o755, &noise(8 + n as u32, 400_000))
            .file("task/id", 0o644, &[b'0' + n])
            .tar()
    };
    (vec![base, env], task(1), task(2), task(3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_on_a_converted_base_read_only_their_own_layers() {
    images_on_a_converted_base_read_only_their_own_layers_on(Storage::Fs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_on_a_converted_base_read_only_their_own_layers_on_s3() {
    images_on_a_converted_base_read_only_their_own_layers_on(Storage::S3).await;
}

async fn images_on_a_converted_base_read_only_their_own_layers_on(storage: Storage) {
    let s = Server::start_on(storage, &[]);
    let (lower, task1, task2, task3) = shared_base_layers();
    let image = |top: &Vec<u8>| {
        let mut l = lower.clone();
        l.push(top.clone());
        l
    };
    let blobs = gzipped;
    // One at a time: each conversion finds what the ones before kept.
    let pushes = [
        ("a", image(&task1), ""),
        ("b", image(&task2), ""),
        ("c", image(&task3), ""),
        ("a-relabelled", image(&task1), "another config"),
    ];
    for (tag, tars, label) in &pushes {
        push_image_labelled(&s, "conv/tasks", tag, &blobs(tars), label).await;
        let v = settled(&s, "conv/tasks", tag).await;
        assert_eq!(v["state"], "done", "{tag}: {v}");
        let (local_env, local_dev) = local_conversion(tars);
        assert_eq!(
            v["env_digest"], local_env,
            "{tag}: the env digest of a conversion of every layer"
        );
        let (_, dev) = device_from_api(&s, &local_env).await;
        assert!(dev == local_dev, "{tag}: device bytes differ");
    }
    let metrics = metrics_text(&s).await;
    // a: 3 layers read; the state of its base kept at once (1.6 MB of layer beside a
    // state of 70 inodes), the chain of base + env only marked as seen (its top layer
    // is small); b: 2 read (1 reused), the state of base + env kept; c: only its task
    // layer read (2 reused); a-relabelled: nothing read (all 3 reused).
    assert_eq!(metric(&metrics, "amber_conversion_layers_read_total"), 6);
    assert_eq!(metric(&metrics, "amber_conversion_layers_reused_total"), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_kept_chain_state_means_a_full_conversion_not_a_wrong_env() {
    let s = Server::start(&[]);
    let (lower, task1, task2, task3) = shared_base_layers();
    let push = |tag: &'static str, top: &Vec<u8>| {
        let mut tars = lower.clone();
        tars.push(top.clone());
        let s = &s;
        async move {
            let blobs: Vec<LayerBlob> = tars.iter().map(|t| (gzip(t), TGZ)).collect();
            push_image(s, "conv/damaged", tag, &blobs).await;
            let v = settled(s, "conv/damaged", tag).await;
            assert_eq!(v["state"], "done", "{tag}: {v}");
            assert_eq!(v["env_digest"], local_conversion(&tars).0, "{tag}");
        }
    };
    // a keeps the state of its base (a big layer beside it) and marks base + env as
    // seen; b starts from the base's state and keeps the state of base + env.
    push("a", &task1).await;
    push("b", &task2).await;
    // Flip a byte in every kept state.
    let chains = s.data.join("store/chains");
    let mut damaged = 0;
    for f in files_under(&chains) {
        if f.extension().is_none() {
            // A state (not a `.seen` marker or an `.env` memo).
            let mut b = std::fs::read(&f).unwrap();
            let mid = b.len() / 2;
            b[mid] ^= 0x40;
            std::fs::write(&f, b).unwrap();
            damaged += 1;
        }
    }
    assert_eq!(
        damaged, 2,
        "states of layers 1 and 1-2 kept under {chains:?}"
    );
    // c finds only damaged states: it reads every layer and still gets its own env.
    push("c", &task3).await;
    let metrics = metrics_text(&s).await;
    assert_eq!(
        metric(&metrics, "amber_conversion_layers_read_total"),
        3 + 2 + 3
    );
    assert_eq!(metric(&metrics, "amber_conversion_layers_reused_total"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_manifest_is_a_referrer_of_the_image() {
    let s = Server::start(&[]);
    let image = push_image(
        &s,
        "conv/ref",
        "v1",
        &layers()
            .into_iter()
            .map(|t| (gzip(&t), TGZ))
            .collect::<Vec<_>>(),
    )
    .await;
    let v = settled(&s, "conv/ref", "v1").await;
    let env = v["env_digest"].as_str().unwrap().to_string();
    let r: Value = get_json(&s, &format!("/v2/conv/ref/referrers/{image}?artifactType=application/vnd.amber.block-manifest.v1%2Bjson")).await;
    let ms = r["manifests"].as_array().unwrap();
    assert_eq!(ms.len(), 1, "{r}");
    assert_eq!(ms[0]["annotations"]["dev.amber.env-digest"], env);
    // Unfiltered, a client sees only the referrers clients pushed: none here.
    let all: Value = get_json(&s, &format!("/v2/conv/ref/referrers/{image}")).await;
    assert_eq!(all["manifests"], serde_json::json!([]), "{all}");
    // The artifact's layer is the envelope, pullable with any OCI client.
    let art: Value = client()
        .get(s.url(&format!(
            "/v2/conv/ref/manifests/{}",
            ms[0]["digest"].as_str().unwrap()
        )))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(art["subject"]["digest"], image);
    let blob = art["layers"][0]["digest"].as_str().unwrap();
    // ... as one zstd frame (its media type says so).
    assert_eq!(
        art["layers"][0]["mediaType"],
        "application/vnd.amber.block-manifest.v1+json+zstd"
    );
    let stored = get_bytes(&s, &format!("/v2/conv/ref/blobs/{blob}")).await;
    let envelope: ManifestEnvelope =
        serde_json::from_slice(&zstd::stream::decode_all(&stored[..]).unwrap()).unwrap();
    assert_eq!(envelope.env_digest.to_string(), env);
    assert_eq!(
        envelope.provenance.image.as_deref(),
        Some(image.as_str()),
        "each image's referrer carries its own provenance"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_conversions_resume_after_a_restart_and_done_ones_never_rerun() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Server::start_in(tmp.path(), &["--convert-workers", "0"]);
    push_image(
        &s,
        "conv/resume",
        "v1",
        &layers().into_iter().map(|t| (t, TAR)).collect::<Vec<_>>(),
    )
    .await;
    let v: Value = get_json(&s, "/amber/v1/resolve/conv/resume/v1").await;
    assert_eq!(v["state"], "queued");
    drop(s);
    let s = Server::start_in(tmp.path(), &["--convert-workers", "1"]);
    let v = settled(&s, "conv/resume", "v1").await;
    assert_eq!(v["state"], "done");
    let env = v["env_digest"].clone();
    drop(s);
    let s = Server::start_in(tmp.path(), &[]);
    let v: Value = get_json(&s, "/amber/v1/resolve/conv/resume/v1").await;
    assert_eq!(
        (v["state"].clone(), v["env_digest"].clone()),
        (json!("done"), env)
    );
    // Pushing the same manifest again does not convert again either.
    push_image(
        &s,
        "conv/resume",
        "v2",
        &layers().into_iter().map(|t| (t, TAR)).collect::<Vec<_>>(),
    )
    .await;
    let metrics = metrics_text(&s).await;
    assert_eq!(
        metric(&metrics, "amber_conversions_started_total"),
        0,
        "{metrics}"
    );
}

/// A backlog longer than a replica's line: four images queued by a process that converts
/// nothing, then a process with one worker and a line of one. Its first sweep takes two
/// (one running, one lined up); the other two wait in the store, and only the line's
/// request for more (the periodic sweep is 20 minutes away) brings them in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_longer_than_the_line_converts_from_the_shared_queue() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Server::start_in(tmp.path(), &["--convert-workers", "0"]);
    let tags = ["a", "b", "c", "d"];
    for tag in tags {
        let own = files_tar(&[("task/name", tag.as_bytes())]);
        push_image(&s, "conv/backlog", tag, &[(own, TAR)]).await;
    }
    drop(s);
    let s = Server::start_in(
        tmp.path(),
        &[
            "--convert-workers",
            "1",
            "--convert-line",
            "1",
            "--conversion-lease-secs",
            "3600",
        ],
    );
    for tag in tags {
        let v = settled(&s, "conv/backlog", tag).await;
        assert_eq!(v["state"], "done", "{tag}: {v}");
    }
    let metrics = metrics_text(&s).await;
    assert_eq!(
        metric(&metrics, "amber_conversions_started_total"),
        4,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_mid_conversion_exits_cleanly_and_the_restart_converts_everything() {
    let tmp = tempfile::tempdir().unwrap();
    let workers = ["--convert-workers", "1"];
    let mut s = Server::start_in(tmp.path(), &workers);
    // A small image, and one whose conversion takes a while (96 MiB of file data no
    // compressor shrinks, as an uncompressed layer) lined up behind it; the SIGTERM goes
    // as soon as the big one is seen running (it converts in a fraction of a second).
    let small: Vec<LayerBlob> = layers().into_iter().map(|t| (t, TAR)).collect();
    push_image(&s, "conv/stop", "small", &small).await;
    let big = Layer::new()
        .file("data/big.bin", 0o644, &incompressible(96 << 20, 21))
        .tar();
    push_image(&s, "conv/stop", "big", &[(big, TAR)]).await;
    let mut seen = Vec::new();
    loop {
        let v: Value = get_json(&s, "/amber/v1/resolve/conv/stop/big").await;
        if seen.last() != Some(&v["state"]) {
            seen.push(v["state"].clone());
        }
        if v["state"] == "running" {
            break;
        }
        assert_eq!(v["state"], "queued", "went {seen:?} before the SIGTERM");
        tokio::task::yield_now().await;
    }

    let status = s.terminate();
    let log = s.log();
    assert!(status.success(), "exit {status} at SIGTERM; log:\n{log}");
    assert!(!log.contains("panicked"), "a panic at SIGTERM; log:\n{log}");
    assert!(
        log.contains("conversion stopped by the shutdown"),
        "the running conversion was not stopped; log:\n{log}"
    );
    assert!(
        !log.contains("conversion failed"),
        "a stopped conversion is not a failure; log:\n{log}"
    );
    // The small one finished before the big one started (one worker); the restart
    // converts exactly what the first process did not finish.
    let finished_before = log.matches("conversion done").count() as u64;
    assert_eq!(
        finished_before, 1,
        "only the small one finished before the SIGTERM; log:\n{log}"
    );

    // The restart takes both back (the running one's item is this replica's own).
    let s = Server::start_in(tmp.path(), &workers);
    for tag in ["big", "small"] {
        let v = settled(&s, "conv/stop", tag).await;
        assert_eq!(v["state"], "done", "{tag}: {v}");
        let env = v["env_digest"].as_str().unwrap();
        let _: Value = get_json(&s, &format!("/amber/v1/envs/{env}")).await;
    }
    let metrics = metrics_text(&s).await;
    assert_eq!(metric(&metrics, "amber_conversions_failed_total"), 0);
    assert_eq!(
        metric(&metrics, "amber_conversions_started_total"),
        2 - finished_before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_layer_fails_its_conversion_with_a_clear_error() {
    let s = Server::start(&[]);
    let mut h = tar::Header::new_old();
    h.as_mut_bytes()[..14].copy_from_slice(b"../../etc/evil");
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_size(0);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    let mut evil = h.as_bytes().to_vec();
    evil.extend_from_slice(&[0u8; 1024]);
    let layer_digest = sha256(&evil);
    push_image(&s, "conv/evil", "v1", &[(evil, TAR)]).await;
    let v = settled(&s, "conv/evil", "v1").await;
    assert_eq!(v["state"], "failed");
    let err = v["error"].as_str().unwrap();
    assert!(
        err.contains(&layer_digest)
            && err.contains("../../etc/evil")
            && err.contains("climbs above the root"),
        "{err}"
    );
    assert!(v["env_digest"].is_null());
}

#[tokio::test]
async fn an_image_past_the_entry_limit_fails_its_conversion() {
    let s = Server::start(&["--max-image-entries", "5"]);
    let names: Vec<String> = (0..10).map(|i| format!("f{i}")).collect();
    let files: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b"x"[..])).collect();
    push_image(&s, "conv/many", "v1", &[(files_tar(&files), TAR)]).await;
    let v = settled(&s, "conv/many", "v1").await;
    assert_eq!(v["state"], "failed");
    let err = v["error"].as_str().unwrap();
    assert!(
        err.contains("more than 5 entries (max_image_entries)"),
        "{err}"
    );
    // An image within the limit converts on the same registry.
    push_image(&s, "conv/few", "v1", &[(files_tar(&files[..3]), TAR)]).await;
    assert_eq!(settled(&s, "conv/few", "v1").await["state"], "done");
}

#[tokio::test]
async fn amber_api_bad_requests_and_chunk_ranges() {
    let s = Server::start(&[]);
    let c = client();
    let cases: &[(&str, u16)] = &[
        ("/amber/v1/envs/blake3:nothex", 400),
        ("/amber/v1/envs/blake3:0000000000000000000000000000000000000000000000000000000000000000", 404),
        ("/amber/v1/chunks/sha256:abc", 400),
        ("/amber/v1/chunks/blake3:0000000000000000000000000000000000000000000000000000000000000000", 404),
        ("/amber/v1/resolve/nope/latest", 404),
        ("/amber/v1/resolve/BAD/latest", 400),
        ("/amber/v1/other", 404),
    ];
    for (path, status) in cases {
        let r = c.get(s.url(path)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), *status, "{path}");
    }
    let r = c.post(s.url("/amber/v1/envs/x")).send().await.unwrap();
    assert_eq!(r.status(), 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_are_served_with_ranges_and_immutable_headers() {
    let s = Server::start(&[]);
    push_image(
        &s,
        "conv/range",
        "v1",
        &layers().into_iter().map(|t| (t, TAR)).collect::<Vec<_>>(),
    )
    .await;
    let v = settled(&s, "conv/range", "v1").await;
    // Each answer below is compared with the whole chunk: from one encoding of it.
    recompressed(&s).await;
    let (envelope, _) = device_from_api(&s, v["env_digest"].as_str().unwrap()).await;
    let id = envelope.manifest.extents[0].chunk;
    let url = s.url(&format!("/amber/v1/chunks/{id}"));
    let whole = client().get(&url).send().await.unwrap();
    assert_eq!(
        whole.headers()["cache-control"],
        "public, max-age=31536000, immutable"
    );
    let whole = whole.bytes().await.unwrap();
    let r = client()
        .get(&url)
        .header("Range", "bytes=1-4")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(&r.bytes().await.unwrap()[..], &whole[1..5]);
    let r = client()
        .get(&url)
        .header("Range", format!("bytes={}-", whole.len()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 416);
}

/// With `--s3-redirect`, chunk and blob downloads are redirects to presigned URLs of the
/// bucket; a client that follows them (as the runner's does) gets the same bytes, with
/// ranges; HEAD is still answered by the registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downloads_redirect_to_presigned_s3_urls() {
    let s = Server::start_on(Storage::S3, &["--s3-redirect", "true"]);
    let blobs: Vec<LayerBlob> = layers().into_iter().map(|t| (t, TAR)).collect();
    push_image(&s, "conv/direct", "v1", &blobs).await;
    let v = settled(&s, "conv/direct", "v1").await;
    assert_eq!(v["state"], "done", "{v}");
    // The range below is compared with the whole chunk: from one encoding of it.
    recompressed(&s).await;
    let env = v["env_digest"].as_str().unwrap();
    let envelope: ManifestEnvelope = get_json(&s, &format!("/amber/v1/envs/{env}")).await;
    let e = &envelope.manifest.extents[0];
    let url = s.url(&format!("/amber/v1/chunks/{}", e.chunk));
    let r = client().get(&url).send().await.unwrap();
    assert_eq!(r.status(), 307);
    let location = r.headers()["location"].to_str().unwrap().to_string();
    assert!(location.starts_with(&s3_endpoint("moto")), "{location}");
    assert!(location.contains("X-Amz-Signature="), "{location}");
    let following = reqwest::Client::new();
    let z = following
        .get(&url)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let data = zstd::bulk::decompress(&z, e.length as usize).unwrap();
    assert_eq!(ChunkId::of(&data), e.chunk);
    let r = following
        .get(&url)
        .header("Range", "bytes=1-4")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(&r.bytes().await.unwrap()[..], &z[1..5]);
    let r = client().head(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let layer = sha256(&blobs[0].0);
    let got = following
        .get(s.url(&format!("/v2/conv/direct/blobs/{layer}")))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(got == blobs[0].0, "blob bytes through the redirect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_file_a_crash_cut_short_is_written_again_by_the_next_conversion() {
    // A conversion's chunk files become durable with one sync of the store's file system
    // when it ends, and enter the index only then: a crash before it can leave a chunk's
    // file empty, short or whole under its name, with no index entry. The next
    // conversion that needs such a chunk reads it and checks it against its id: a whole
    // one is kept, an empty or short one written again.
    #[derive(Default)]
    struct Chunks(Vec<(ChunkId, Vec<u8>)>);
    impl amber_converter::chunk::ChunkSink for Chunks {
        fn put(&mut self, id: ChunkId, data: &[u8]) -> std::io::Result<()> {
            self.0.push((id, data.to_vec()));
            Ok(())
        }
    }
    let tars = layers();
    let (local_env, local_dev) = local_conversion(&tars);
    let mut chunks = Chunks::default();
    let mut scratch = tempfile::tempfile().unwrap();
    let inputs = tars.iter().map(|b| amber_converter::LayerInput {
        name: "l".into(),
        reader: Box::new(&b[..]),
    });
    amber_converter::convert(inputs, &mut scratch, &mut chunks, None, &mut |_| {}).unwrap();
    assert!(chunks.0.len() >= 3, "{} chunks", chunks.0.len());
    let tmp = tempfile::tempdir().unwrap();
    let path = |id: &ChunkId| {
        let hex = id.hex();
        tmp.path()
            .join(format!("store/chunks/blake3/{}/{hex}", &hex[..2]))
    };
    let whole = |data: &[u8]| zstd::bulk::compress(data, 3).unwrap();
    let left = [
        Vec::new(),
        whole(&chunks.0[1].1)[..10].to_vec(),
        whole(&chunks.0[2].1),
    ];
    for ((id, _), bytes) in chunks.0.iter().zip(&left) {
        std::fs::create_dir_all(path(id).parent().unwrap()).unwrap();
        std::fs::write(path(id), bytes).unwrap();
    }
    let s = Server::start_in(tmp.path(), &[]);
    push_image(&s, "conv/crash", "v1", &gzipped(&tars)).await;
    let v = settled(&s, "conv/crash", "v1").await;
    assert_eq!(v["state"], "done", "{v}");
    assert_eq!(v["env_digest"], local_env);
    let (_, dev) = device_from_api(&s, &local_env).await;
    assert!(dev == local_dev, "device bytes differ");
    for (i, (id, data)) in chunks.0.iter().take(3).enumerate() {
        let stored = std::fs::read(path(id)).unwrap();
        let back = zstd::bulk::decompress(&stored, 1 << 21).unwrap();
        assert!(&back == data, "chunk {i} ({id}) is not whole in the store");
    }
    assert_eq!(
        std::fs::read(path(&chunks.0[2].0)).unwrap(),
        left[2],
        "the whole chunk was kept as it was"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsck_checks_chunks_and_block_manifests() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Server::start_in(tmp.path(), &[]);
    push_image(
        &s,
        "conv/fsck",
        "v1",
        &layers().into_iter().map(|t| (t, TAR)).collect::<Vec<_>>(),
    )
    .await;
    let v = settled(&s, "conv/fsck", "v1").await;
    let (envelope, _) = device_from_api(&s, v["env_digest"].as_str().unwrap()).await;
    drop(s);
    let fsck = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_amber-registry"))
            .args(["fsck", "--data"])
            .arg(tmp.path())
            .output()
            .unwrap()
    };
    let out = fsck();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let hex = envelope.manifest.extents[0].chunk.hex();
    let path = tmp
        .path()
        .join(format!("store/chunks/blake3/{}/{hex}", &hex[..2]));
    std::fs::write(&path, zstd::bulk::compress(b"not the chunk", 3).unwrap()).unwrap();
    let out = fsck();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains(&format!(
            "object chunks/blake3/{}/{hex} is corrupt",
            &hex[..2]
        )),
        "{stdout}"
    );
    assert!(stdout.contains(", 1 problems"), "{stdout}");
}
