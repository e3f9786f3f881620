//! A sandbox's writable disk: a sparse file on the host holding an empty ext4 file
//! system, attached as the guest's second virtio-blk device, where the overlay's upper
//! layer lives (so a sandbox's writes cost host disk, bounded by its size, not guest
//! memory). The env's export stays the read-only lower layer, shared by every sandbox.
//!
//! Invariant kept here: the file is sparse and mkfs writes only the metadata it must
//! (lazy inode tables and journal); everything unwritten reads as zeros, which is what
//! lets the guest mount it with `noinit_itable`.

use std::path::{Path, PathBuf};

/// The smallest disk: ext4's journal and metadata need room, and a sandbox less.
pub const MIN_MIB: u32 = 64;
/// The largest disk, 1 TiB: the file is sparse, but mkfs's metadata grows with the size.
pub const MAX_MIB: u32 = 1 << 20;
/// The disk a sandbox gets when its creator names none.
pub const DEFAULT_MIB: u32 = 8192;

/// Why a writable disk could not be made.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("creating the sandbox's disk {path}: {source}")]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("running mkfs.ext4 for the sandbox's disk (install e2fsprogs): {0}")]
    MkfsMissing(#[source] std::io::Error),
    #[error("mkfs.ext4 failed for {path} ({status}): {stderr}")]
    Mkfs {
        path: PathBuf,
        status: std::process::ExitStatus,
        stderr: String,
    },
}

/// Makes `path` a sparse file of `mib` MiB holding an empty ext4 file system.
pub fn create(path: &Path, mib: u32) -> Result<(), DiskError> {
    let create = |source| DiskError::Create {
        path: path.to_path_buf(),
        source,
    };
    let f = std::fs::File::create(path).map_err(create)?;
    f.set_len(u64::from(mib) << 20).map_err(create)?;
    drop(f);
    // -m 0: no blocks reserved for root (the sandbox's disk is its own; a full disk is
    // full for every user, as a container's is). lazy_*_init: write no inode tables or
    // journal blocks (holes read as zeros). nodiscard: the file is already all holes.
    let out = std::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-m",
            "0",
            "-L",
            "amber-rw",
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
        ])
        .arg(path)
        .output()
        .map_err(DiskError::MkfsMissing)?;
    if !out.status.success() {
        return Err(DiskError::Mkfs {
            path: path.to_path_buf(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disk_is_sparse_ext4_of_its_size() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("disk.img");
        create(&p, 256).unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 256 << 20);
        use std::os::unix::fs::MetadataExt;
        assert!(
            m.blocks() * 512 < 16 << 20,
            "mkfs wrote {} bytes of a 256 MiB disk",
            m.blocks() * 512
        );
        // The ext4 superblock's magic at 1024 + 0x38.
        let b = std::fs::read(&p).unwrap();
        assert_eq!(&b[1024 + 0x38..1024 + 0x3a], &[0x53, 0xef]);
    }

    #[test]
    fn a_disk_where_no_file_can_be_made_says_where() {
        let e = create(Path::new("/nonexistent-dir/disk.img"), 256).unwrap_err();
        assert!(e.to_string().contains("/nonexistent-dir/disk.img"), "{e}");
    }
}
