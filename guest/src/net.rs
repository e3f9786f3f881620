//! The guest's network: the loopback interface (always up, as in `docker run
//! --network none`), and, when the host gave the sandbox a network, its virtio-net
//! interface with a static address, the default route through the host's gateway, and
//! the resolver and hosts files.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use amber_guest::Network;

use crate::sys::errno;

/// A socket for interface ioctls.
struct Ctl(libc::c_int);

impl Ctl {
    fn new() -> Result<Ctl, String> {
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(format!("socket for interface setup: {}", errno()));
        }
        Ok(Ctl(fd))
    }

    fn ifreq(name: &str) -> libc::ifreq {
        // SAFETY: ifreq is plain old data; all zeros is a valid value.
        let mut r: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in r
            .ifr_name
            .iter_mut()
            .zip(name.bytes().take(libc::IFNAMSIZ - 1))
        {
            *d = s as libc::c_char;
        }
        r
    }

    fn ioctl(&self, req: libc::Ioctl, r: *mut libc::c_void, what: &str) -> Result<(), String> {
        // SAFETY: `r` points at the structure `req` expects, valid for the call.
        if unsafe { libc::ioctl(self.0, req, r) } != 0 {
            return Err(format!("{what}: {}", errno()));
        }
        Ok(())
    }

    fn up(&self, name: &str) -> Result<(), String> {
        let mut r = Self::ifreq(name);
        self.ioctl(
            libc::SIOCGIFFLAGS,
            (&raw mut r).cast(),
            &format!("flags of {name}"),
        )?;
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        unsafe {
            r.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        }
        self.ioctl(
            libc::SIOCSIFFLAGS,
            (&raw mut r).cast(),
            &format!("bringing {name} up"),
        )
    }

    fn set_addr(
        &self,
        name: &str,
        req: libc::Ioctl,
        a: Ipv4Addr,
        what: &str,
    ) -> Result<(), String> {
        let mut r = Self::ifreq(name);
        r.ifr_ifru.ifru_addr = sockaddr(a);
        self.ioctl(req, (&raw mut r).cast(), &format!("{what} of {name}"))
    }

    fn default_route(&self, gateway: Ipv4Addr) -> Result<(), String> {
        // SAFETY: rtentry is plain old data; all zeros is a valid value.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
        rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
        rt.rt_gateway = sockaddr(gateway);
        rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
        self.ioctl(
            libc::SIOCADDRT,
            (&raw mut rt).cast(),
            "adding the default route",
        )
    }
}

impl Drop for Ctl {
    fn drop(&mut self) {
        // SAFETY: our own descriptor.
        unsafe { libc::close(self.0) };
    }
}

fn sockaddr(a: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(a).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size; the kernel reads it as the
    // family says.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// Brings the loopback interface up.
pub(crate) fn loopback() -> Result<(), String> {
    Ctl::new()?.up("lo")
}

/// The interface whose MAC is `mac`, waited for (bounded): virtio-net probes as its
/// module loads, but the name appears in sysfs a moment later.
fn interface_with_mac(mac: &str) -> Result<String, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(rd) = std::fs::read_dir("/sys/class/net") {
            for e in rd.filter_map(Result::ok) {
                let a = std::fs::read_to_string(e.path().join("address")).unwrap_or_default();
                if a.trim().eq_ignore_ascii_case(mac) {
                    return Ok(e.file_name().to_string_lossy().into_owned());
                }
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the host gave a network interface, but none has the MAC {mac} (is virtio_net loaded?)"
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sets up the interface `n` describes.
pub(crate) fn configure(n: &Network) -> Result<(), String> {
    let name = interface_with_mac(&n.mac)?;
    let ctl = Ctl::new()?;
    ctl.set_addr(&name, libc::SIOCSIFADDR, n.address, "the address")?;
    let mask = Ipv4Addr::from(
        u32::MAX
            .checked_shl(32 - u32::from(n.prefix_len))
            .unwrap_or(0),
    );
    ctl.set_addr(&name, libc::SIOCSIFNETMASK, mask, "the netmask")?;
    ctl.up(&name)?;
    ctl.default_route(n.gateway)
}

/// /etc/resolv.conf and /etc/hosts of a sandbox with a network, as `docker run` writes
/// them: `hostname` on the sandbox's address, the host's extra names.
pub(crate) fn files(n: &Network, hostname: &str) -> [(&'static str, String); 2] {
    let mut hosts = String::from(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\nff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n",
    );
    hosts.push_str(&format!("{}\t{hostname}\n", n.address));
    for (a, names) in &n.hosts {
        hosts.push_str(&format!("{a}\t{names}\n"));
    }
    [
        (
            "resolv.conf",
            format!("nameserver {}\noptions edns0 trust-ad\n", n.nameserver),
        ),
        ("hosts", hosts),
    ]
}

/// Writes `files` under `dir` (out of the sandbox's reach) and bind-mounts each over
/// `root`/etc/NAME, creating an empty file there first when the image has none. Returns
/// the paths (inside the root) it created, which are mount points, not the sandbox's
/// changes.
pub(crate) fn mount_files(
    files: &[(&'static str, String)],
    dir: &Path,
    root: &Path,
) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut created = Vec::new();
    for (name, text) in files {
        let src = dir.join(name);
        std::fs::write(&src, text).map_err(|e| format!("writing {}: {e}", src.display()))?;
        let etc = root.join("etc");
        let _ = std::fs::create_dir_all(&etc);
        let target = etc.join(name);
        match std::fs::symlink_metadata(&target) {
            Err(_) => {
                std::fs::write(&target, "").map_err(|e| format!("creating /etc/{name}: {e}"))?;
                created.push(format!("etc/{name}"));
            }
            // A link that leads nowhere (to a resolver daemon's file, say) has no file to
            // mount over: the image keeps it, as docker keeps it.
            Ok(m) if m.file_type().is_symlink() && std::fs::metadata(&target).is_err() => {
                eprintln!("amber-guest: /etc/{name} is a dangling link; left as the image has it");
                continue;
            }
            Ok(_) => {}
        }
        crate::sys::mount(
            &src.display().to_string(),
            &target.display().to_string(),
            "",
            libc::MS_BIND,
            "",
        )?;
    }
    Ok(created)
}
