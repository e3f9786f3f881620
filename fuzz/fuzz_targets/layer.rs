//! The layer converter on arbitrary layer blobs: the input is split into two layers
//! (the first two bytes give the cut) applied in order, so whiteouts, opaque
//! directories and hard links across layers are reached. Any input is converted or
//! refused with an error, never a panic.
#![no_main]
use std::io;

use amber_converter::chunk::ChunkSink;
use amber_converter::manifest::ChunkId;
use amber_converter::LayerInput;
use libfuzzer_sys::fuzz_target;

struct Discard;

impl ChunkSink for Discard {
    fn put(&mut self, _: ChunkId, _: &[u8]) -> io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let cut = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
    let (a, b) = data[2..].split_at(cut);
    let layers = vec![
        LayerInput { name: "lower".into(), reader: Box::new(a) },
        LayerInput { name: "upper".into(), reader: Box::new(b) },
    ];
    let mut scratch = io::Cursor::new(Vec::new());
    let _ = amber_converter::convert(layers, &mut scratch, &mut Discard, None, &mut |_| {});
});
