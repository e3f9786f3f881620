//! Helpers for converter tests: an in-memory chunk store and one-call conversion; layers
//! come from amber-testkit.
#![allow(dead_code, unused_imports)]

pub use amber_testkit::layer::{files_tar, gzip, zstd, Layer};

use std::collections::HashMap;
use std::io;

use amber_converter::chunk::ChunkSink;
use amber_converter::manifest::ChunkId;
use amber_converter::{convert, ConvertError, Converted, LayerInput};

#[derive(Default, Debug)]
pub struct MemSink {
    pub chunks: HashMap<ChunkId, Vec<u8>>,
    pub puts: u64,
}

impl ChunkSink for MemSink {
    fn put(&mut self, id: ChunkId, data: &[u8]) -> io::Result<()> {
        self.puts += 1;
        self.chunks.entry(id).or_insert_with(|| data.to_vec());
        Ok(())
    }
}

/// Converts layers (blobs as stored); returns the result and the raw device.
pub fn run(layers: &[Vec<u8>]) -> Result<(Converted, Vec<u8>, MemSink), ConvertError> {
    let mut sink = MemSink::default();
    let mut raw = Vec::new();
    let mut scratch = tempfile::tempfile().unwrap();
    let inputs = layers.iter().enumerate().map(|(i, l)| LayerInput {
        name: format!("layer{i}"),
        reader: Box::new(&l[..]),
    });
    let out = convert(inputs, &mut scratch, &mut sink, Some(&mut raw), &mut |_| {})?;
    raw.resize(out.manifest.device_size as usize, 0);
    Ok((out, raw, sink))
}

/// Converts layers without a raw sink, as the registry does: large files are stored as
/// chunks while their layer streams.
pub fn run_streamed(layers: &[Vec<u8>]) -> Result<(Converted, MemSink), ConvertError> {
    let mut sink = MemSink::default();
    let mut scratch = tempfile::tempfile().unwrap();
    let inputs = layers.iter().enumerate().map(|(i, l)| LayerInput {
        name: format!("layer{i}"),
        reader: Box::new(&l[..]),
    });
    let out = convert(inputs, &mut scratch, &mut sink, None, &mut |_| {})?;
    Ok((out, sink))
}

/// Builds the device from its manifest and chunks (what a runner would see).
pub fn assemble(out: &Converted, sink: &MemSink) -> Vec<u8> {
    let mut dev = vec![0u8; out.manifest.device_size as usize];
    for e in &out.manifest.extents {
        let data = &sink.chunks[&e.chunk];
        dev[e.offset as usize..(e.offset + e.length) as usize].copy_from_slice(data);
    }
    dev
}
