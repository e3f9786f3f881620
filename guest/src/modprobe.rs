//! The agent as the kernel's `modprobe`: when the kernel needs a module (a bridge, a
//! netfilter table, a loop device) it runs `/sbin/modprobe -q -- NAME` in the
//! initramfs's root, which links to the agent. The module tree is the host's read-only
//! module disk mounted at `TREE` (`rootfs`), with depmod's `modules.dep`,
//! `modules.alias` and `modules.builtin`; `NAME` is a module or an alias of some, loaded
//! with its dependencies first.

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::sys::{cstr, errno};

/// Where the agent mounts the module disk, in the initramfs's root.
pub(crate) const TREE: &str = "/modules";

fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.trim_end_matches(".ko").replace('-', "_")
}

struct Index {
    /// (module name, path relative to the tree, dependency paths)
    deps: Vec<(String, String, Vec<String>)>,
    /// (pattern, module name)
    aliases: Vec<(String, String)>,
    builtin: HashSet<String>,
}

impl Index {
    fn read(tree: &Path) -> Result<Index, String> {
        let read = |n: &str| {
            std::fs::read_to_string(tree.join(n))
                .map_err(|e| format!("{}: {e}", tree.join(n).display()))
        };
        let deps = read("modules.dep")?
            .lines()
            .filter_map(|l| {
                let (m, d) = l.split_once(':')?;
                Some((
                    module_name(m),
                    m.to_string(),
                    d.split_whitespace().map(str::to_string).collect(),
                ))
            })
            .collect();
        let aliases = read("modules.alias")?
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                (w.next()? == "alias").then_some(())?;
                Some((w.next()?.to_string(), w.next()?.replace('-', "_")))
            })
            .collect();
        let builtin = read("modules.builtin")
            .unwrap_or_default()
            .lines()
            .map(module_name)
            .collect();
        Ok(Index {
            deps,
            aliases,
            builtin,
        })
    }

    /// The modules `name` stands for: itself, or every module with an alias matching it.
    fn resolve(&self, name: &str) -> Vec<String> {
        let n = name.replace('-', "_");
        if self.builtin.contains(&n) || self.deps.iter().any(|d| d.0 == n) {
            return vec![n];
        }
        let s = cstr(name);
        let mut out: Vec<String> = Vec::new();
        for (pattern, module) in &self.aliases {
            let p = cstr(pattern);
            // SAFETY: two valid NUL-terminated strings.
            if unsafe { libc::fnmatch(p.as_ptr(), s.as_ptr(), 0) } == 0 && !out.contains(module) {
                out.push(module.clone());
            }
        }
        out
    }

    fn entry(&self, name: &str) -> Option<&(String, String, Vec<String>)> {
        self.deps.iter().find(|d| d.0 == name)
    }

    /// Loads `name` after its dependencies (each after its own).
    fn load(&self, tree: &Path, name: &str, seen: &mut HashSet<String>) -> Result<(), String> {
        if !seen.insert(name.to_string()) || self.builtin.contains(name) {
            return Ok(());
        }
        let (_, path, deps) = self
            .entry(name)
            .ok_or_else(|| format!("module {name} not found in {}", tree.display()))?;
        for d in deps {
            self.load(tree, &module_name(d), seen)?;
        }
        let f = std::fs::File::open(tree.join(path))
            .map_err(|e| format!("{}: {e}", tree.join(path).display()))?;
        let params = cstr("");
        // SAFETY: finit_module reads the open module file and the empty parameters.
        let r = unsafe { libc::syscall(libc::SYS_finit_module, f.as_raw_fd(), params.as_ptr(), 0) };
        if r != 0 {
            let e = errno();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(format!("loading {path}: {e}"));
            }
        }
        Ok(())
    }
}

/// `modprobe [-q] [--] NAME...` as the kernel runs it; the exit status.
pub(crate) fn main(args: &[String]) -> i32 {
    let quiet = args.iter().any(|a| a == "-q" || a == "--quiet");
    let names: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let tree = Path::new(TREE);
    let index = match Index::read(tree) {
        Ok(i) => i,
        Err(e) => {
            if !quiet {
                eprintln!("modprobe: {e}");
            }
            return 1;
        }
    };
    let mut status = 0;
    let mut seen = HashSet::new();
    for name in names {
        let modules = index.resolve(name);
        if modules.is_empty() {
            if !quiet {
                eprintln!("modprobe: module {name} not found");
            }
            status = 1;
        }
        for m in modules {
            if let Err(e) = index.load(tree, &m, &mut seen) {
                // To the console: the kernel's modprobe has no other place to say it.
                eprintln!("amber-guest: modprobe {name}: {e}");
                status = 1;
            }
        }
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_through_modules_and_aliases() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("modules.dep"),
            "kernel/net/bridge/bridge.ko: kernel/net/802/stp.ko kernel/net/llc/llc.ko\nkernel/net/802/stp.ko: kernel/net/llc/llc.ko\nkernel/net/llc/llc.ko:\nkernel/net/netfilter/nft_chain_nat.ko:\nkernel/drivers/net/net-failover.ko:\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("modules.alias"),
            "# Aliases extracted from modules themselves.\nalias rtnl-link-bridge bridge\nalias nft-chain-2-nat nft_chain_nat\nalias pci:v00001AF4d*sv*sd*bc*sc*i* virtio_pci\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("modules.builtin"),
            "kernel/fs/ext4/ext4.ko\n",
        )
        .unwrap();
        let i = Index::read(dir.path()).unwrap();
        assert_eq!(i.resolve("rtnl-link-bridge"), ["bridge"]);
        assert_eq!(i.resolve("nft-chain-2-nat"), ["nft_chain_nat"]);
        assert_eq!(i.resolve("bridge"), ["bridge"]);
        assert_eq!(i.resolve("net-failover"), ["net_failover"]);
        assert_eq!(i.resolve("ext4"), ["ext4"]);
        assert_eq!(
            i.resolve("pci:v00001AF4d00001000sv00sd00bc02sc00i00"),
            ["virtio_pci"]
        );
        assert!(i.resolve("nothing-like-it").is_empty());
        assert_eq!(i.entry("bridge").unwrap().2.len(), 2);
    }
}
