//! Layer streams: detects the compression (gzip, zstd, or none) from the bytes
//! themselves, decompresses, and computes the diff_id (sha256 of the uncompressed tar).

use std::io::{self, BufRead, BufReader, Read};

use sha2::Digest as _;

/// The compression of a layer stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// Looks at the first bytes of `r` without consuming them.
pub fn detect<R: BufRead>(r: &mut R) -> io::Result<Compression> {
    let head = r.fill_buf()?;
    Ok(if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else {
        Compression::None
    })
}

/// The uncompressed tar stream of a layer, hashed as it is read.
pub struct LayerReader<'a> {
    inner: Box<dyn Read + 'a>,
    hasher: sha2::Sha256,
    pub bytes: u64,
}

impl<'a> LayerReader<'a> {
    pub fn new(raw: impl Read + 'a) -> io::Result<LayerReader<'a>> {
        let mut buffered = BufReader::with_capacity(256 * 1024, raw);
        let inner: Box<dyn Read + 'a> = match detect(&mut buffered)? {
            Compression::None => Box::new(buffered),
            Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(buffered)),
            Compression::Zstd => Box::new(zstd::stream::read::Decoder::with_buffer(buffered)?),
        };
        Ok(LayerReader {
            inner,
            hasher: sha2::Sha256::new(),
            bytes: 0,
        })
    }

    /// Reads what is left (tar padding after the end marker) and returns the diff_id.
    pub fn finish(mut self) -> io::Result<(String, u64)> {
        io::copy(&mut self, &mut io::sink())?;
        Ok((
            format!("sha256:{}", hex::encode(self.hasher.finalize())),
            self.bytes,
        ))
    }
}

impl Read for LayerReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}
