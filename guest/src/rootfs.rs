//! The sandbox's root: loading the kernel modules the initramfs carries, finding the
//! env's device, mounting its EROFS read-only under an overlay whose upper layer is the
//! sandbox's writable disk (or a tmpfs when the host gave none), the hostname, and moving
//! the agent into the new root (`boot`).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use amber_guest::{Boot, PORT_NAME, WRITABLE_DISK_SERIAL};

use crate::sys::{cstr, errno, mount};

pub(crate) const NEWROOT: &str = "/newroot";

/// The sandbox's writable disk (mounted at /rw before the agent enters the root, where
/// /rw is out of reach): what `SNAPSHOT` freezes, and the way to its upper directory.
static WRITABLE: std::sync::OnceLock<File> = std::sync::OnceLock::new();

/// Files the agent made in the root only to mount its own over them (see `net`):
/// relative to the root, left out of snapshots while empty.
static MOUNT_POINTS: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();

pub(crate) fn mount_points() -> &'static [PathBuf] {
    MOUNT_POINTS.get().map_or(&[], Vec::as_slice)
}

/// The writable disk's root, when the sandbox has one.
pub(crate) fn writable_disk() -> Option<&'static File> {
    WRITABLE.get()
}

/// The overlay's upper directory as a path that works inside the root: through this
/// process's descriptor of the disk (`/proc/self/fd/N` leads out of a chroot).
pub(crate) fn upper_dir(disk: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}/upper", disk.as_raw_fd()))
}

/// Loads every module the initramfs carries, in order. Returns one line per module that
/// failed (its file and the kernel's reason), also written to the console: a damaged or
/// mismatched initramfs shows up here, not later as a mount that finds no filesystem.
pub(crate) fn load_modules() -> Vec<String> {
    let Ok(rd) = std::fs::read_dir("/lib/modules") else {
        return Vec::new();
    };
    let mut mods: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    mods.sort();
    let mut failed = Vec::new();
    for m in mods {
        let f = match File::open(&m) {
            Ok(f) => f,
            Err(e) => {
                failed.push(format!("{}: {e}", m.display()));
                continue;
            }
        };
        let params = cstr("");
        // SAFETY: finit_module reads the open module file and the empty parameter string.
        let r = unsafe { libc::syscall(libc::SYS_finit_module, f.as_raw_fd(), params.as_ptr(), 0) };
        if r != 0 {
            let e = errno();
            if e.raw_os_error() != Some(libc::EEXIST) {
                let size = f.metadata().map(|m| m.len()).unwrap_or(0);
                failed.push(format!("{} ({size} bytes): {e}", m.display()));
            }
        }
        // The initramfs is memory the guest keeps for its whole life: a loaded module's
        // file is not needed again.
        drop(f);
        let _ = std::fs::remove_file(&m);
    }
    for f in &failed {
        eprintln!("amber-guest: loading kernel module {f}");
    }
    failed
}

/// Waits (bounded) for the root disk and the control port to appear.
pub(crate) fn wait_for_devices() -> Result<PathBuf, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let port = std::fs::read_dir("/sys/class/virtio-ports")
            .ok()
            .and_then(|rd| {
                rd.filter_map(Result::ok).find_map(|e| {
                    let name = std::fs::read_to_string(e.path().join("name")).ok()?;
                    (name.trim() == PORT_NAME).then(|| Path::new("/dev").join(e.file_name()))
                })
            });
        if let Some(p) = port.filter(|p| p.exists() && Path::new("/dev/vda").exists()) {
            return Ok(p);
        }
        if Instant::now() > deadline {
            return Err("the root disk /dev/vda or the control port did not appear".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The block device (`/dev/vdX`) whose virtio serial is `serial`.
fn disk_with_serial(serial: &str) -> Option<PathBuf> {
    std::fs::read_dir("/sys/block").ok()?.find_map(|e| {
        let e = e.ok()?;
        let s = std::fs::read_to_string(e.path().join("serial")).ok()?;
        (s.trim() == serial).then(|| Path::new("/dev").join(e.file_name()))
    })
}

/// Mounts the host's module disk (when it gave one) at `modprobe::TREE` and makes the
/// agent the kernel's modprobe: `/sbin/modprobe` (the kernel's default helper, run in
/// the initramfs's root) links to it.
fn module_tree() -> Result<(), String> {
    let Some(dev) = disk_with_serial(amber_guest::MODULES_DISK_SERIAL) else {
        return Ok(());
    };
    mount(
        &dev.display().to_string(),
        crate::modprobe::TREE,
        "erofs",
        libc::MS_RDONLY,
        "",
    )?;
    std::fs::create_dir_all("/sbin").map_err(|e| format!("creating /sbin: {e}"))?;
    let _ = std::fs::remove_file("/sbin/modprobe");
    std::os::unix::fs::symlink("/init", "/sbin/modprobe")
        .map_err(|e| format!("linking /sbin/modprobe: {e}"))?;
    std::fs::write("/proc/sys/kernel/modprobe", "/sbin/modprobe\n")
        .map_err(|e| format!("setting the kernel's modprobe: {e}"))
}

/// Mounts the env read-only at /lower and the place for the sandbox's writes at /rw:
/// its own ext4 disk when the host gave one (`writable`), guest memory otherwise.
pub(crate) fn mount_root(writable: bool) -> Result<(), String> {
    mount("/dev/vda", "/lower", "erofs", libc::MS_RDONLY, "")?;
    module_tree()?;
    if writable {
        let dev = disk_with_serial(WRITABLE_DISK_SERIAL).ok_or_else(|| {
            format!("the host gave a writable disk, but no block device has the serial {WRITABLE_DISK_SERIAL}")
        })?;
        // discard: deleted files give their space back to the host's sparse file;
        // noinit_itable: the host's file reads as zeros where mkfs left the inode tables
        // unwritten, so the guest need not spend its CPU zeroing them.
        mount(
            &dev.display().to_string(),
            "/rw",
            "ext4",
            libc::MS_NOATIME,
            "discard,noinit_itable",
        )?;
        let disk = File::open("/rw").map_err(|e| format!("opening /rw: {e}"))?;
        let _ = WRITABLE.set(disk);
    } else {
        mount("tmpfs", "/rw", "tmpfs", 0, "mode=0755")?;
    }
    std::fs::create_dir_all("/rw/upper").map_err(|e| e.to_string())?;
    std::fs::create_dir_all("/rw/work").map_err(|e| e.to_string())?;
    // The merged root takes its owner and mode from the upper directory: copy the env's.
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata("/lower").map_err(|e| format!("stat of the env root: {e}"))?;
        let upper = cstr("/rw/upper");
        // SAFETY: valid path; plain chown/chmod.
        unsafe {
            libc::chown(upper.as_ptr(), m.uid(), m.gid());
            libc::chmod(upper.as_ptr(), m.mode() & 0o7777);
        }
    }
    // The upper must read as a plain OCI layer (`layer.rs`): a renamed directory of the
    // env is copied, not redirected; a changed mode copies the whole file, not only its
    // metadata; no index of hard links outside the upper.
    mount(
        "overlay",
        NEWROOT,
        "overlay",
        0,
        "lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work,redirect_dir=off,metacopy=off,index=off",
    )?;
    mount(
        "proc",
        &format!("{NEWROOT}/proc"),
        "proc",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    )?;
    mount(
        "sysfs",
        &format!("{NEWROOT}/sys"),
        "sysfs",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_RDONLY,
        "",
    )?;
    // cgroup v2, writable, as on a machine: a container engine inside makes its own
    // groups (the read-only sysfs above does not stop a mount on its directory).
    mount(
        "cgroup2",
        &format!("{NEWROOT}/sys/fs/cgroup"),
        "cgroup2",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "nsdelegate",
    )?;
    mount(
        "tmpfs",
        &format!("{NEWROOT}/dev"),
        "tmpfs",
        libc::MS_NOSUID,
        "mode=755,size=65536k",
    )?;
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ] {
        let p = cstr(format!("{NEWROOT}/dev/{name}"));
        // SAFETY: creating a device node at a valid path.
        unsafe {
            libc::mknod(
                p.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(major, minor),
            )
        };
    }
    // Loop devices, as on a machine (the kernel loads `loop` when one is opened).
    let loops = std::iter::once(("loop-control".to_string(), libc::S_IFCHR, 10, 237))
        .chain((0..8).map(|n| (format!("loop{n}"), libc::S_IFBLK, 7, n)));
    for (name, kind, major, minor) in loops {
        let p = cstr(format!("{NEWROOT}/dev/{name}"));
        // SAFETY: creating a device node at a valid path.
        unsafe { libc::mknod(p.as_ptr(), kind | 0o660, libc::makedev(major, minor)) };
    }
    mount(
        "devpts",
        &format!("{NEWROOT}/dev/pts"),
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    )?;
    mount(
        "shm",
        &format!("{NEWROOT}/dev/shm"),
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "mode=1777,size=65536k",
    )?;
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        let _ = std::os::unix::fs::symlink(target, format!("{NEWROOT}/dev/{link}"));
    }
    Ok(())
}

/// Mounts the root, sets the hostname, and moves this process into the root, so commands
/// and copies see exactly the sandbox's file system.
pub(crate) fn boot(b: &Boot) -> Result<(), String> {
    if let Some(order) = b.page_reporting_order {
        // The initramfs's own /sys is writable (the sandbox's is not).
        let param = "/sys/module/page_reporting/parameters/page_reporting_order";
        std::fs::write(param, order.to_string())
            .map_err(|e| format!("setting {param} to {order}: {e}"))?;
    }
    mount_root(b.writable_disk)?;
    let h = cstr(&b.hostname);
    // SAFETY: valid buffer and length.
    if unsafe { libc::sethostname(h.as_ptr(), b.hostname.len()) } != 0 {
        return Err(format!("sethostname {:?}: {}", b.hostname, errno()));
    }
    crate::net::loopback()?;
    if let Some(n) = &b.network {
        crate::net::configure(n)?;
        let files = crate::net::files(n, &b.hostname);
        let made = crate::net::mount_files(&files, Path::new("/net"), Path::new(NEWROOT))?;
        let _ = MOUNT_POINTS.set(made.into_iter().map(PathBuf::from).collect());
    }
    if b.root_device {
        let dev = std::fs::read_to_string("/sys/block/vda/dev")
            .map_err(|e| format!("reading /sys/block/vda/dev: {e}"))?;
        let (major, minor) = dev
            .trim()
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .ok_or_else(|| format!("bad /sys/block/vda/dev {dev:?}"))?;
        let p = cstr(format!("{NEWROOT}/dev/vda"));
        // SAFETY: creating a block device node at a valid path.
        if unsafe {
            libc::mknod(
                p.as_ptr(),
                libc::S_IFBLK | 0o400,
                libc::makedev(major, minor),
            )
        } != 0
        {
            return Err(format!("mknod /dev/vda: {}", errno()));
        }
    }
    // PID 1 shares its root with the kernel's own threads (CLONE_FS): without its own
    // copy, the chroot below would move theirs too, and the helpers the kernel runs
    // (modprobe) would be looked up in the sandbox's files instead of the initramfs.
    // SAFETY: plain unshare of this process's file system attributes.
    if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
        return Err(format!("unshare(CLONE_FS): {}", errno()));
    }
    let root = cstr(NEWROOT);
    // As switch_root does: the new root moves over the initramfs's, so it is the mount
    // namespace's root and processes are not "chrooted" (the kernel refuses new user
    // namespaces to a chrooted process).
    // SAFETY: plain chdir/mount/chroot with valid paths.
    unsafe {
        if libc::chdir(root.as_ptr()) != 0 {
            return Err(format!("entering the root: {}", errno()));
        }
        if libc::mount(
            c".".as_ptr(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_MOVE,
            std::ptr::null(),
        ) != 0
        {
            return Err(format!("moving the root over the initramfs: {}", errno()));
        }
        if libc::chroot(c".".as_ptr()) != 0 {
            return Err(format!("entering the root: {}", errno()));
        }
        libc::chdir(c"/".as_ptr());
    }
    Ok(())
}
