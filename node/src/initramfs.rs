//! A deterministic initramfs: an uncompressed cpio "newc" archive holding `/init` (the
//! guest agent) and `/lib/modules/NN-<name>.ko` in load order, with fixed owners, modes,
//! inode numbers and times, so the same inputs always give the same bytes.

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
    let mut c = Cpio {
        out,
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
    c.out.flush()
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
        assert!(x.starts_with(b"070701"));
        assert_eq!(x.len() % 4, 0);
        assert!(x.windows(10).any(|w| w == b"TRAILER!!!"));
    }
}
