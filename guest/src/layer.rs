//! A sandbox's changes to its env as an OCI layer: the overlay's upper directory walked
//! into a tar stream the way `docker commit` writes one, so the layer applies on top of
//! the sandbox's image with any OCI tool (image-spec `layer.md`, "Representing Changes").
//!
//! - An overlay whiteout (a character device 0:0 in the upper) is a deleted file or
//!   directory of the env: it becomes an empty `.wh.<name>` entry beside it.
//! - An opaque directory (`trusted.overlay.opaque` = `y`: the directory was removed and
//!   made again, hiding all of the env's entries in it) is followed by a
//!   `<dir>/.wh..wh..opq` entry.
//! - Regular files, directories, symlinks, FIFOs and device nodes keep their mode, owner
//!   and modification time; a file with several names in the upper is written once and
//!   linked from its later names (hard links); sockets cannot be in a tar and are left
//!   out, as Docker does. Extended attributes are not carried.
//! - Entries are in byte order of their names, so one upper gives one byte stream.
//! - Mount points the agent made for files it mounts over the image (/etc/resolv.conf,
//!   /etc/hosts of a sandbox with a network) are left out while they are still empty
//!   files: like docker's, those files are the sandbox's set-up, not its changes.
//!
//! The upper must not change while it is walked: the agent freezes the file system that
//! holds it (`SNAPSHOT` in lib.rs).

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{self, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The xattr overlayfs marks an opaque directory with.
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
/// The OCI name of a whiteout of `name`.
pub const WHITEOUT_PREFIX: &str = ".wh.";
/// The OCI name of an opaque directory's marker entry.
pub const OPAQUE_MARKER: &str = ".wh..wh..opq";

/// What a layer holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Tar entries written (whiteouts and markers included).
    pub entries: u64,
    /// Bytes of file data.
    pub file_bytes: u64,
    /// Files and directories of the env deleted (whiteouts), and opaque directories.
    pub whiteouts: u64,
}

/// Writes the changes held in `upper` (an overlay upper directory) to `w` as an
/// uncompressed OCI layer tar, leaving out `mount_points` (paths relative to the upper)
/// that are empty regular files.
pub fn write(upper: &Path, mount_points: &[PathBuf], w: impl Write) -> io::Result<LayerStats> {
    let mut walk = Walk {
        tar: tar::Builder::new(w),
        links: HashMap::new(),
        stats: LayerStats::default(),
        mount_points,
    };
    walk.dir(upper, Path::new(""))?;
    let Walk { tar, stats, .. } = walk;
    tar.into_inner()?.flush()?;
    Ok(stats)
}

struct Walk<'a, W: Write> {
    tar: tar::Builder<W>,
    mount_points: &'a [PathBuf],
    /// (device, inode) of files with several names -> the name written first.
    links: HashMap<(u64, u64), PathBuf>,
    stats: LayerStats,
}

fn context(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// Whether `dir` is marked opaque by overlayfs.
fn is_opaque(dir: &Path) -> bool {
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).expect("no NUL in a path");
    let name = std::ffi::CString::new(OPAQUE_XATTR).expect("no NUL");
    let mut value = [0u8; 2];
    // SAFETY: valid NUL-terminated strings and a buffer of the length passed.
    let n = unsafe {
        libc::lgetxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    n == 1 && value[0] == b'y'
}

impl<W: Write> Walk<'_, W> {
    fn empty(&mut self, h: &mut tar::Header, path: &Path) -> io::Result<()> {
        h.set_size(0);
        self.stats.entries += 1;
        self.tar.append_data(h, path, io::empty())
    }

    /// A whiteout-style marker (an empty regular file) at `path`, stamped like `like`.
    fn marker(&mut self, path: &Path, like: &std::fs::Metadata) -> io::Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(like.mtime().max(0) as u64);
        self.stats.whiteouts += 1;
        self.empty(&mut h, path)
    }

    fn dir(&mut self, abs: &Path, rel: &Path) -> io::Result<()> {
        let mut names: Vec<OsString> = std::fs::read_dir(abs)
            .map_err(|e| context(abs, e))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<_>>()
            .map_err(|e| context(abs, e))?;
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        for name in names {
            let (a, r) = (abs.join(&name), rel.join(&name));
            self.entry(&a, &r, &name).map_err(|e| context(&a, e))?;
        }
        Ok(())
    }

    fn entry(&mut self, abs: &Path, rel: &Path, name: &std::ffi::OsStr) -> io::Result<()> {
        let m = std::fs::symlink_metadata(abs)?;
        let ft = m.file_type();
        if ft.is_char_device() && m.rdev() == 0 {
            let mut wh = OsString::from(WHITEOUT_PREFIX).into_vec();
            wh.extend_from_slice(name.as_bytes());
            return self.marker(&rel.with_file_name(OsString::from_vec(wh)), &m);
        }
        if ft.is_socket()
            || (ft.is_file() && m.len() == 0 && self.mount_points.iter().any(|p| p == rel))
        {
            return Ok(());
        }
        let mut h = tar::Header::new_gnu();
        h.set_metadata_in_mode(&m, tar::HeaderMode::Complete);
        if ft.is_dir() {
            self.empty(&mut h, rel)?;
            if is_opaque(abs) {
                self.marker(&rel.join(OPAQUE_MARKER), &m)?;
            }
            return self.dir(abs, rel);
        }
        if ft.is_symlink() {
            let target = std::fs::read_link(abs)?;
            h.set_size(0);
            self.stats.entries += 1;
            return self.tar.append_link(&mut h, rel, target);
        }
        if ft.is_file() {
            if m.nlink() > 1 {
                if let Some(first) = self.links.get(&(m.dev(), m.ino())).cloned() {
                    h.set_entry_type(tar::EntryType::Link);
                    h.set_size(0);
                    self.stats.entries += 1;
                    return self.tar.append_link(&mut h, rel, first);
                }
                self.links.insert((m.dev(), m.ino()), rel.to_path_buf());
            }
            let f = std::fs::File::open(abs)?;
            self.stats.entries += 1;
            self.stats.file_bytes += m.len();
            return self.tar.append_data(&mut h, rel, f);
        }
        // A FIFO or a device node: the header says all.
        if ft.is_char_device() || ft.is_block_device() {
            let dev = m.rdev();
            h.set_device_major(libc::major(dev))?;
            h.set_device_minor(libc::minor(dev))?;
        }
        self.empty(&mut h, rel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn cstr(p: &Path) -> std::ffi::CString {
        std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap()
    }

    /// An upper directory as overlayfs leaves it: a new file, a changed mode, a deleted
    /// file (whiteout), a directory made again (opaque), a symlink and a hard link.
    /// Needs root (mknod of a whiteout, a trusted xattr), as the tests here run.
    #[test]
    fn an_upper_becomes_an_oci_layer() {
        let dir = tempfile::tempdir().unwrap();
        let up = dir.path();
        std::fs::create_dir_all(up.join("etc")).unwrap();
        std::fs::write(up.join("etc/new.conf"), b"new\n").unwrap();
        std::fs::write(up.join("etc/secret"), b"s").unwrap();
        // SAFETY: valid paths; plain chmod, chown, mknod and setxattr.
        unsafe {
            assert_eq!(libc::chmod(cstr(&up.join("etc/secret")).as_ptr(), 0o600), 0);
            assert_eq!(
                libc::chown(cstr(&up.join("etc/secret")).as_ptr(), 1234, 99),
                0
            );
            let wh = up.join("etc/deleted");
            assert_eq!(
                libc::mknod(cstr(&wh).as_ptr(), libc::S_IFCHR, 0),
                0,
                "mknod needs root"
            );
            std::fs::create_dir(up.join("var")).unwrap();
            let v = b"y";
            let n = std::ffi::CString::new(OPAQUE_XATTR).unwrap();
            assert_eq!(
                libc::setxattr(
                    cstr(&up.join("var")).as_ptr(),
                    n.as_ptr(),
                    v.as_ptr().cast(),
                    1,
                    0
                ),
                0,
                "setting a trusted xattr needs root: {}",
                io::Error::last_os_error()
            );
        }
        std::fs::write(up.join("var/only"), b"o").unwrap();
        std::os::unix::fs::symlink("new.conf", up.join("etc/link")).unwrap();
        std::fs::hard_link(up.join("etc/new.conf"), up.join("etc/z-hard")).unwrap();
        let sock = std::os::unix::net::UnixListener::bind(up.join("sock")).unwrap();
        // Mount points the agent made: left out while empty, kept once written to.
        std::fs::write(up.join("etc/resolv.conf"), b"").unwrap();
        std::fs::write(up.join("etc/hosts"), b"").unwrap();
        std::fs::write(up.join("etc/hostname"), b"written\n").unwrap();
        let mounts: Vec<PathBuf> = ["etc/resolv.conf", "etc/hosts", "etc/hostname"]
            .map(PathBuf::from)
            .into();
        std::fs::write(up.join("var/hosts"), b"").unwrap();

        let mut bytes = Vec::new();
        let stats = write(up, &mounts, &mut bytes).unwrap();
        drop(sock);
        let mut again = Vec::new();
        write(up, &mounts, &mut again).unwrap();
        assert_eq!(bytes, again, "the same upper gives the same bytes");

        let mut seen = Vec::new();
        let mut ar = tar::Archive::new(&bytes[..]);
        for e in ar.entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().display().to_string();
            let h = e.header().clone();
            let mut data = String::new();
            e.read_to_string(&mut data).unwrap();
            let link = e.link_name().unwrap().map(|l| l.display().to_string());
            seen.push((
                path,
                h.entry_type(),
                h.mode().unwrap() & 0o7777,
                h.uid().unwrap(),
                data,
                link,
            ));
        }
        let names: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "etc",
                "etc/.wh.deleted",
                "etc/hostname",
                "etc/link",
                "etc/new.conf",
                "etc/secret",
                "etc/z-hard",
                "var",
                "var/.wh..wh..opq",
                "var/hosts",
                "var/only"
            ]
        );
        let find = |n: &str| seen.iter().find(|s| s.0 == n).unwrap();
        assert_eq!(find("etc/secret").2, 0o600);
        assert_eq!(find("etc/secret").3, 1234);
        assert_eq!(find("etc/new.conf").4, "new\n");
        assert_eq!(find("etc/.wh.deleted").1, tar::EntryType::Regular);
        assert_eq!(find("etc/link").1, tar::EntryType::Symlink);
        assert_eq!(find("etc/link").5.as_deref(), Some("new.conf"));
        assert_eq!(find("etc/z-hard").1, tar::EntryType::Link);
        assert_eq!(find("etc/z-hard").5.as_deref(), Some("etc/new.conf"));
        assert_eq!(
            stats,
            LayerStats {
                entries: 11,
                file_bytes: 14,
                whiteouts: 2
            }
        );
    }
}
