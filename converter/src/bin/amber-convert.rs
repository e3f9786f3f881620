//! `amber-convert SOURCE --out DIR [--raw IMAGE] [--verify]`: converts an image from an
//! OCI layout directory or a docker archive into chunks (`DIR/chunks/`) and a block
//! manifest (`DIR/manifest.json`), printing the env digest.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use amber_converter::chunk::{DirChunkStore, ParallelSink};
use amber_converter::manifest::{BlockManifest, ManifestEnvelope, Provenance};
use amber_converter::{convert, oci, LayerInput};

#[derive(Parser)]
#[command(
    name = "amber-convert",
    version,
    about = "Convert an OCI image into an amber block image"
)]
struct Cli {
    /// An OCI image layout directory, or a docker-archive tar (`docker save`).
    source: PathBuf,
    /// Output directory: chunks/ and manifest.json.
    #[arg(long)]
    out: PathBuf,
    /// Also write the whole device as one (sparse) file.
    #[arg(long)]
    raw: Option<PathBuf>,
    /// Re-read every chunk written and check its hash.
    #[arg(long)]
    verify: bool,
    /// zstd level for stored chunks.
    #[arg(long, default_value_t = 3)]
    level: i32,
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("amber-convert: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let work = tempfile::tempdir().context("creating a work directory")?;
    let image = if cli.source.is_dir() {
        oci::oci_layout(&cli.source)?
    } else {
        oci::docker_archive(&cli.source, work.path())?
    };
    let mut layers = Vec::new();
    for (name, path) in &image.layers {
        let f = std::fs::File::open(path)
            .with_context(|| format!("opening layer {}", path.display()))?;
        layers.push(LayerInput {
            name: name.clone(),
            reader: Box::new(f),
        });
    }
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
    let chunk_dir = cli.out.join("chunks");
    let store = Arc::new(DirChunkStore::new(&chunk_dir, cli.level)?);
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let put_store = store.clone();
    let mut sink = ParallelSink::new(
        threads,
        Arc::new(move |id, data: &[u8]| put_store.put(id, data)),
    );
    let mut scratch = tempfile::tempfile_in(work.path()).context("creating the scratch file")?;
    let mut raw = match &cli.raw {
        Some(p) => {
            Some(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)
        }
        None => None,
    };
    // A bar over the conversion's steps (each layer, the layout, the chunking) on a
    // terminal; the same steps as plain lines otherwise.
    let steps = layers.len() as u64 + 2;
    let bar = if std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::new(steps).with_style(
            indicatif::ProgressStyle::with_template(
                "amber-convert {spinner} [{bar:30}] {pos}/{len} {elapsed} {wide_msg}",
            )
            .expect("a valid template"),
        );
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut step = 0u64;
    let mut progress = |msg: &str| {
        step += 1;
        if bar.is_hidden() {
            eprintln!("amber-convert: [{step}/{steps}] {msg}");
        } else {
            bar.set_position(step.min(steps));
            bar.set_message(msg.to_string());
        }
    };
    let out = convert(
        layers,
        &mut scratch,
        &mut sink,
        raw.as_mut()
            .map(|f| f as &mut dyn amber_converter::chunk::RawSink),
        &mut progress,
    )?;
    sink.finish().context("storing chunks")?;
    bar.finish_and_clear();
    if let (Some(f), Some(p)) = (&raw, &cli.raw) {
        f.set_len(out.manifest.device_size)
            .with_context(|| format!("sizing {}", p.display()))?;
    }
    let env = out.manifest.env_digest();
    let envelope = ManifestEnvelope {
        env_digest: env,
        manifest: out.manifest.clone(),
        provenance: Provenance {
            image: image.manifest_digest.clone(),
            diff_ids: out.diff_ids.clone(),
            converter: format!("amber-convert {}", env!("CARGO_PKG_VERSION")),
        },
    };
    std::fs::write(
        cli.out.join("manifest.json"),
        serde_json::to_vec_pretty(&envelope)?,
    )?;
    if cli.verify {
        verify(&out.manifest, &chunk_dir)?;
    }
    eprintln!(
        "amber-convert: {} inodes, {} MiB device, {} chunks ({} new, {} already stored), {} MiB of layers",
        out.inodes,
        out.manifest.device_size >> 20,
        out.chunks,
        store.written.load(Relaxed),
        store.existing.load(Relaxed),
        out.layer_bytes >> 20
    );
    println!("{env}");
    Ok(())
}

fn verify(m: &BlockManifest, dir: &std::path::Path) -> anyhow::Result<()> {
    for e in &m.extents {
        let path = DirChunkStore::path(dir, &e.chunk);
        let z = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let data = zstd::bulk::decompress(&z, e.length as usize)
            .with_context(|| format!("decompressing {}", path.display()))?;
        anyhow::ensure!(
            amber_converter::manifest::ChunkId::of(&data) == e.chunk
                && data.len() as u64 == e.length,
            "chunk {} is corrupt",
            e.chunk
        );
    }
    Ok(())
}
