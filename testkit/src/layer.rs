//! Image layers built in memory with the tar crate (fixed owner and time, so the same
//! calls give the same bytes), and their gzip and zstd forms.

use std::io::{self, Write};

/// A layer under construction.
pub struct Layer(pub tar::Builder<Vec<u8>>);

impl Default for Layer {
    fn default() -> Self {
        Self::new()
    }
}

impl Layer {
    pub fn new() -> Layer {
        let mut b = tar::Builder::new(Vec::new());
        b.mode(tar::HeaderMode::Complete);
        Layer(b)
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_size(size);
        h
    }

    pub fn dir(mut self, path: &str, mode: u32) -> Layer {
        let mut h = Self::header(tar::EntryType::Directory, mode, 0);
        self.0.append_data(&mut h, path, io::empty()).unwrap();
        self
    }

    pub fn file(mut self, path: &str, mode: u32, data: &[u8]) -> Layer {
        let mut h = Self::header(tar::EntryType::Regular, mode, data.len() as u64);
        self.0.append_data(&mut h, path, data).unwrap();
        self
    }

    pub fn file_owned(mut self, path: &str, mode: u32, uid: u64, gid: u64, data: &[u8]) -> Layer {
        let mut h = Self::header(tar::EntryType::Regular, mode, data.len() as u64);
        h.set_uid(uid);
        h.set_gid(gid);
        self.0.append_data(&mut h, path, data).unwrap();
        self
    }

    pub fn symlink(mut self, path: &str, target: &str) -> Layer {
        let mut h = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.0.append_link(&mut h, path, target).unwrap();
        self
    }

    pub fn hardlink(mut self, path: &str, target: &str) -> Layer {
        let mut h = Self::header(tar::EntryType::Link, 0o644, 0);
        self.0.append_link(&mut h, path, target).unwrap();
        self
    }

    pub fn device(mut self, path: &str, kind: tar::EntryType, major: u32, minor: u32) -> Layer {
        let mut h = Self::header(kind, 0o600, 0);
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        self.0.append_data(&mut h, path, io::empty()).unwrap();
        self
    }

    /// A regular file with PAX records (xattrs as SCHILY.xattr.*).
    pub fn file_pax(mut self, path: &str, mode: u32, data: &[u8], pax: &[(&str, &[u8])]) -> Layer {
        self.0
            .append_pax_extensions(pax.iter().map(|(k, v)| (*k, *v)))
            .unwrap();
        self.file(path, mode, data)
    }

    /// Raw bytes appended as they are (for hand-made hostile headers).
    pub fn raw(mut self, bytes: &[u8]) -> Layer {
        self.0.get_mut().write_all(bytes).unwrap();
        self
    }

    pub fn tar(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

pub fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::bulk::compress(data, 3).unwrap()
}

/// A layer of regular files (mode 0644, root-owned), in the order given.
pub fn files_tar(files: &[(&str, &[u8])]) -> Vec<u8> {
    files
        .iter()
        .fold(Layer::new(), |l, (path, data)| l.file(path, 0o644, data))
        .tar()
}
