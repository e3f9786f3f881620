//! A deterministic initramfs: a gzip-compressed cpio "newc" archive holding `/init` (the
//! guest agent) and `/lib/modules/NN-<name>.ko` in load order, with fixed owners, modes,
//! inode numbers and times (and a gzip header with no name and no time), so the same
//! inputs always give the same bytes.
//!
//! Compressed because QEMU keeps its own copy of the initrd in host memory for the VM's
//! whole life (fw_cfg serves it to the loader), and the guest touches every page the
//! initrd is loaded into: both are per-sandbox host memory, about 2.5 MiB less compressed.
//! The kernel unpacks it once at boot, into the same tmpfs either way.

use std::io::{self, Write};

/// The directories the guest agent mounts on.
const DIRS: &[&str] = &[
    "dev",
    "proc",
    "sys",
    "lower",
    "rw",
    "newroot",
    "lib",
    "lib/modules",
];

struct Cpio<W: Write> {
    out: W,
    ino: u32,
    written: u64,
}

impl<W: Write> Cpio<W> {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.ino += 1;
        let nlink = if mode & 0o040000 != 0 { 2 } else { 1 };
        let header = format!(
            "070701{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}",
            self.ino,
            mode,
            0,
            0,
            nlink,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        self.write(header.as_bytes())?;
        self.write(name.as_bytes())?;
        self.write(&[0])?;
        self.pad()?;
        self.write(data)?;
        self.pad()
    }

    fn write(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let n = (4 - self.written % 4) % 4;
        self.write(&[0u8; 3][..n as usize])
    }
}

/// Writes the initramfs: `init` is the static guest agent, `modules` the kernel modules
/// (name, bytes) in the order they must load.
pub fn write(out: impl Write, init: &[u8], modules: &[(String, Vec<u8>)]) -> io::Result<()> {
    // GzBuilder writes mtime 0 and no file name: the header is the same on every host.
    let gz = flate2::GzBuilder::new().write(out, flate2::Compression::best());
    let mut c = Cpio {
        out: gz,
        ino: 0,
        written: 0,
    };
    for d in DIRS {
        c.entry(d, 0o040755, &[])?;
    }
    c.entry("init", 0o100755, init)?;
    for (i, (name, data)) in modules.iter().enumerate() {
        c.entry(&format!("lib/modules/{i:02}-{name}"), 0o100644, data)?;
    }
    c.entry("TRAILER!!!", 0, &[])?;
    c.out.finish()?.flush()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_same_inputs_give_the_same_bytes() {
        let m = vec![("a.ko".to_string(), vec![1u8, 2, 3])];
        let (mut x, mut y) = (Vec::new(), Vec::new());
        super::write(&mut x, b"init", &m).unwrap();
        super::write(&mut y, b"init", &m).unwrap();
        assert_eq!(x, y);
        assert!(x.starts_with(&[0x1f, 0x8b]), "a gzip stream");
        let mut cpio = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&x[..]), &mut cpio).unwrap();
        assert!(cpio.starts_with(b"070701"));
        assert_eq!(cpio.len() % 4, 0);
        assert!(cpio.windows(10).any(|w| w == b"TRAILER!!!"));
    }
}
