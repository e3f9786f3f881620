//! A data directory on a small tmpfs that fills up: uploads get a clear error, nothing
//! acknowledged is lost, reads keep working, and once space is freed the same upload
//! resumes and completes. Needs root (it mounts the tmpfs).

mod common;

use std::process::Command;

use common::*;

struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, size: &str) -> Tmpfs {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs (the test needs root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Bytes an unprivileged writer may still use on the file system holding `dir`.
fn available_bytes(dir: &std::path::Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: statvfs is plain old data; all zeroes is a valid value of it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` is a valid statvfs to fill in.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    assert_eq!(rc, 0, "statvfs {}", dir.display());
    st.f_bavail as u64 * st.f_frsize as u64
}

#[tokio::test]
async fn a_full_disk_gives_clean_errors_and_recovers_when_space_is_freed() {
    let tmp = tempfile::tempdir().unwrap();
    let _fs = Tmpfs::mount(tmp.path(), "96m");
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let s = Server::start_in(&data, &[]);
    // Something acknowledged before the disk fills.
    let kept = push_blob(&s, "full/a", b"acknowledged before the disk filled").await;
    // Ballast takes all but 12 MiB of what is left (the index preallocates its log, so
    // what is left depends on RocksDB's settings).
    let left = available_bytes(tmp.path());
    assert!(
        left > 16 << 20,
        "only {left} bytes free on a fresh 96 MiB tmpfs"
    );
    let ballast = tmp.path().join("ballast");
    std::fs::write(&ballast, vec![0xabu8; (left - (12 << 20)) as usize]).unwrap();
    let blob: Vec<u8> = (0..24u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let d = sha256(&blob);
    let r = client()
        .post(s.url("/v2/full/a/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let loc = r.headers()["location"].to_str().unwrap().to_string();
    let r = client()
        .patch(s.url(&loc))
        .body(blob.clone())
        .send()
        .await
        .unwrap();
    let status = r.status();
    let body = r.text().await.unwrap();
    assert_eq!(status, 507, "{body}");
    assert!(
        body.contains("INSUFFICIENT_STORAGE") && body.contains("No space left"),
        "{body}"
    );
    // Reads keep working; the session holds what was acknowledged (nothing).
    let r = client()
        .get(s.url(&format!("/v2/full/a/blobs/{kept}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client().get(s.url(&loc)).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(r.headers()["range"], "0-0");
    // Space freed: the same session takes the blob and completes it.
    std::fs::remove_file(&ballast).unwrap();
    let r = client()
        .put(s.url(&format!("{loc}?digest={d}")))
        .body(blob.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let r = client()
        .get(s.url(&format!("/v2/full/a/blobs/{d}")))
        .send()
        .await
        .unwrap();
    assert_eq!(sha256(&r.bytes().await.unwrap()), d);
    // And new pushes work again.
    push_blob(&s, "full/b", b"after the disk was freed").await;
}
