//! The merged file system tree of an image: OCI layers applied in order as tar streams,
//! with whiteouts, opaque directories and hard links, kept in memory as metadata only.
//! Regular file contents are spilled to a caller-provided scratch file as they stream by,
//! or, for large files when the caller takes them (`LargeFiles`), stored as chunks right
//! away, so memory grows with the number of entries, never with the data size.
//!
//! Hostile input rules (each is either normalised as docker does or refused with an error
//! naming the layer and the entry):
//! - absolute paths lose their leading `/`; `.` components are dropped; `..` is resolved
//!   lexically and an entry that climbs above the root is refused;
//! - an entry whose parent is a symlink is refused (no writes through symlinks);
//! - a hard link must name an existing, earlier non-directory entry;
//! - duplicate entries: the later one wins, as when extracting;
//! - whiteouts of `.`, `..` or an empty name are refused; whiteouts and opaque markers
//!   only hide content of lower layers and are applied when their layer ends;
//! - an entry declaring more data than the stream holds is a truncated layer;
//! - names longer than 255 bytes or paths longer than 4096 bytes are refused.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Index of an inode in `Tree::inodes`.
pub type InodeId = usize;

pub const ROOT: InodeId = 0;
pub const MAX_NAME: usize = 255;
pub const MAX_PATH: usize = 4096;

/// Takes the bytes of large files (at least `chunk::LARGE_FILE`) as a layer streams by,
/// so they skip the scratch file: their chunks depend only on their own bytes
/// (`chunk` module), so they can be cut before the device is laid out.
pub trait LargeFiles {
    /// Reads exactly `len` bytes of one file from `data` and stores them; returns the
    /// `DataSource::Stored` entry that names where they went. An error from `data`
    /// is returned as it came.
    fn take(&mut self, len: u64, data: &mut dyn Read) -> io::Result<u32>;
}

/// Where a regular file's bytes are while a conversion runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataSource {
    /// At this offset of the conversion's scratch file (a layer read in this run).
    Scratch { offset: u64 },
    /// Already in the chunk store: entry `n` of the conversion's table of stored files
    /// (a reused `chain::ChainState`'s, for a layer whose work an earlier conversion
    /// did, then the large files `LargeFiles` took).
    Stored(u32),
}

/// A regular file's bytes: where they are, and what they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataRef {
    pub source: DataSource,
    pub len: u64,
    /// blake3 of the contents for files below `chunk::LARGE_FILE` (their pack cuts
    /// depend on it); zeros for large files, whose chunks are named when they are cut.
    pub hash: [u8; 32],
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Kind {
    Dir { children: BTreeMap<Vec<u8>, Entry> },
    File { data: DataRef },
    Symlink { target: Vec<u8> },
    CharDev { major: u32, minor: u32 },
    BlockDev { major: u32, minor: u32 },
    Fifo,
}

/// A directory entry: the inode it names and the layer that last wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub inode: InodeId,
    pub layer: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    /// Permission bits with setuid, setgid and sticky (the low 12 bits of st_mode).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: u64,
    pub mtime_nsec: u32,
    /// Full names (`user.x`, `security.capability`) to values.
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Inode {
    pub kind: Kind,
    pub meta: Meta,
    /// The layer that created it (a directory described again keeps its inode; a file
    /// written again gets a new one). The EROFS layout groups inodes by it.
    pub created: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("layer {layer}, entry {entry:?}: {reason}")]
    Entry {
        layer: String,
        entry: String,
        reason: String,
    },
    #[error("layer {layer}: reading the layer failed after entry {after:?}: {source}")]
    Layer {
        layer: String,
        after: String,
        #[source]
        source: io::Error,
    },
    #[error("writing the scratch file: {0}")]
    Scratch(#[source] io::Error),
    #[error("layer {layer}: storing the chunks of {entry:?}: {source}")]
    Store {
        layer: String,
        entry: String,
        #[source]
        source: io::Error,
    },
    #[error("layer {layer}: {limit}")]
    Limit { layer: String, limit: String },
}

/// Bounds on one conversion, so a hostile image cannot hold a converter forever.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most inodes the merged tree may hold.
    pub max_entries: u64,
    /// When the conversion must have finished.
    pub deadline: Option<std::time::Instant>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_entries: u64::MAX,
            deadline: None,
        }
    }
}

pub struct Tree {
    pub inodes: Vec<Inode>,
    pub limits: Limits,
}

fn root_meta() -> Meta {
    Meta {
        mode: 0o755,
        uid: 0,
        gid: 0,
        mtime: 0,
        mtime_nsec: 0,
        xattrs: BTreeMap::new(),
    }
}

/// Splits and normalises a tar path into components. `Ok(None)`: the path climbs above
/// the root.
fn components(path: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                out.pop()?;
            }
            c => out.push(c.to_vec()),
        }
    }
    Some(out)
}

/// A layer being applied: its deferred whiteouts and opaque markers.
struct LayerState {
    index: u32,
    name: String,
    whiteouts: Vec<(Vec<Vec<u8>>, Vec<u8>)>,
    opaque: Vec<Vec<Vec<u8>>>,
}

impl Default for Tree {
    fn default() -> Self {
        Self::new()
    }
}

impl Tree {
    pub fn new() -> Tree {
        Tree {
            inodes: vec![Inode {
                kind: Kind::Dir {
                    children: BTreeMap::new(),
                },
                meta: root_meta(),
                created: 0,
            }],
            limits: Limits::default(),
        }
    }

    fn children(&self, dir: InodeId) -> Option<&BTreeMap<Vec<u8>, Entry>> {
        match &self.inodes[dir].kind {
            Kind::Dir { children } => Some(children),
            _ => None,
        }
    }

    fn children_mut(&mut self, dir: InodeId) -> Option<&mut BTreeMap<Vec<u8>, Entry>> {
        match &mut self.inodes[dir].kind {
            Kind::Dir { children } => Some(children),
            _ => None,
        }
    }

    /// The inode at `path`, if it exists (symlinks are not followed).
    pub fn lookup(&self, path: &[Vec<u8>]) -> Option<InodeId> {
        let mut cur = ROOT;
        for c in path {
            cur = self.children(cur)?.get(c)?.inode;
        }
        Some(cur)
    }

    fn add_inode(&mut self, inode: Inode) -> InodeId {
        self.inodes.push(inode);
        self.inodes.len() - 1
    }

    /// Applies one layer's uncompressed tar stream. File data goes to `scratch`, whose
    /// current length is `*scratch_len` and grows as data is appended; large files'
    /// data goes to `large` instead when one is given (sparse ones always to `scratch`).
    pub fn apply_layer<R: Read>(
        &mut self,
        index: u32,
        name: &str,
        tar_stream: R,
        scratch: &mut dyn Write,
        scratch_len: &mut u64,
        large: Option<&mut dyn LargeFiles>,
    ) -> Result<(), TreeError> {
        let mut spill_to = Spill {
            scratch,
            scratch_len,
            large,
        };
        let mut st = LayerState {
            index,
            name: name.to_string(),
            whiteouts: Vec::new(),
            opaque: Vec::new(),
        };
        let mut archive = tar::Archive::new(tar_stream);
        let mut last = String::from("(start of layer)");
        let entries = archive.entries().map_err(|source| TreeError::Layer {
            layer: name.to_string(),
            after: last.clone(),
            source,
        })?;
        let mut buf = vec![0u8; 256 * 1024];
        for entry in entries {
            let mut entry = entry.map_err(|source| TreeError::Layer {
                layer: name.to_string(),
                after: last.clone(),
                source,
            })?;
            last = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            if self.inodes.len() as u64 > self.limits.max_entries {
                return Err(TreeError::Limit {
                    layer: name.to_string(),
                    limit: format!(
                        "the image has more than {} entries (max_image_entries)",
                        self.limits.max_entries
                    ),
                });
            }
            if self
                .limits
                .deadline
                .is_some_and(|d| std::time::Instant::now() > d)
            {
                return Err(TreeError::Limit {
                    layer: name.to_string(),
                    limit: "the conversion ran out of time (max_convert_secs)".into(),
                });
            }
            self.apply_entry(&mut st, &mut entry, &last, &mut spill_to, &mut buf)?;
        }
        self.finish_layer(&st);
        Ok(())
    }

    fn apply_entry<R: Read>(
        &mut self,
        st: &mut LayerState,
        e: &mut tar::Entry<'_, R>,
        shown: &str,
        spill_to: &mut Spill<'_, '_>,
        buf: &mut [u8],
    ) -> Result<(), TreeError> {
        let err = |reason: String| TreeError::Entry {
            layer: st.name.clone(),
            entry: shown.to_string(),
            reason,
        };
        let etype = e.header().entry_type();
        if matches!(
            etype,
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader
        ) {
            return Ok(());
        }
        let raw_path = e.path_bytes().into_owned();
        if raw_path.len() > MAX_PATH {
            return Err(err(format!(
                "path is {} bytes long; the limit is {MAX_PATH}",
                raw_path.len()
            )));
        }
        let path = components(&raw_path)
            .ok_or_else(|| err("path climbs above the root with `..`".into()))?;
        if let Some(long) = path.iter().find(|c| c.len() > MAX_NAME) {
            return Err(err(format!(
                "a name is {} bytes long; the limit is {MAX_NAME}",
                long.len()
            )));
        }
        if path.iter().any(|c| c.contains(&0)) {
            return Err(err("name contains a NUL byte".into()));
        }
        let meta = self.entry_meta(e).map_err(err)?;
        let Some((base, parent_path)) = path.split_last() else {
            // The root itself: only a directory may describe it.
            if etype.is_dir() {
                let root = &mut self.inodes[ROOT];
                root.meta = meta;
            }
            return Ok(());
        };

        // Whiteouts and opaque markers: applied when the layer ends.
        if let Some(hidden) = base.strip_prefix(b".wh.") {
            if hidden == b".wh..opq" {
                st.opaque.push(parent_path.to_vec());
            } else if hidden.starts_with(b".wh.") {
                // Other AUFS metadata (.wh..wh.plnk, ...): not content.
            } else if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(err("whiteout of `.`, `..` or an empty name".into()));
            } else {
                st.whiteouts.push((parent_path.to_vec(), hidden.to_vec()));
            }
            return Ok(());
        }

        let parent = self.make_parents(parent_path, st.index).map_err(err)?;
        let kind = match etype {
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                let data = spill(e, spill_to, buf).map_err(|ex| match ex {
                    SpillError::Read(source) => TreeError::Layer {
                        layer: st.name.clone(),
                        after: shown.to_string(),
                        source,
                    },
                    SpillError::Short { declared, got } => err(format!(
                        "declares {declared} bytes of data but the layer ends after {got}"
                    )),
                    SpillError::Write(source) => TreeError::Scratch(source),
                    SpillError::Store(source) => TreeError::Store {
                        layer: st.name.clone(),
                        entry: shown.to_string(),
                        source,
                    },
                })?;
                Kind::File { data }
            }
            tar::EntryType::Directory => {
                let existing = self
                    .children(parent)
                    .expect("parent is a directory")
                    .get(base)
                    .map(|e| e.inode);
                if let Some(id) =
                    existing.filter(|&id| matches!(self.inodes[id].kind, Kind::Dir { .. }))
                {
                    // Same directory described again: new metadata, children kept.
                    self.inodes[id].meta = meta;
                    let children = self.children_mut(parent).expect("parent is a directory");
                    children.get_mut(base).expect("present").layer = st.index;
                    return Ok(());
                }
                Kind::Dir {
                    children: BTreeMap::new(),
                }
            }
            tar::EntryType::Symlink => {
                let target = e
                    .link_name_bytes()
                    .ok_or_else(|| err("symlink without a target".into()))?
                    .into_owned();
                if target.is_empty() || target.len() > MAX_PATH {
                    return Err(err(format!("symlink target of {} bytes", target.len())));
                }
                Kind::Symlink { target }
            }
            tar::EntryType::Link => {
                let target = e
                    .link_name_bytes()
                    .ok_or_else(|| err("hard link without a target".into()))?
                    .into_owned();
                let tpath = components(&target)
                    .ok_or_else(|| err("hard link target climbs above the root".into()))?;
                let tname = String::from_utf8_lossy(&target).into_owned();
                let id = self.lookup(&tpath).ok_or_else(|| {
                    err(format!("hard link to {tname:?}, which does not exist (a hard link must name an earlier entry)"))
                })?;
                if matches!(self.inodes[id].kind, Kind::Dir { .. }) {
                    return Err(err(format!("hard link to directory {tname:?}")));
                }
                if tpath.as_slice() == path.as_slice() {
                    return Ok(());
                }
                let children = self.children_mut(parent).expect("parent is a directory");
                children.insert(
                    base.clone(),
                    Entry {
                        inode: id,
                        layer: st.index,
                    },
                );
                return Ok(());
            }
            tar::EntryType::Char | tar::EntryType::Block => {
                let h = e.header();
                let major = h.device_major().ok().flatten().unwrap_or(0);
                let minor = h.device_minor().ok().flatten().unwrap_or(0);
                if etype == tar::EntryType::Char {
                    Kind::CharDev { major, minor }
                } else {
                    Kind::BlockDev { major, minor }
                }
            }
            tar::EntryType::Fifo => Kind::Fifo,
            other => {
                return Err(err(format!(
                    "unsupported tar entry type {:?}",
                    other.as_byte() as char
                )))
            }
        };
        let id = self.add_inode(Inode {
            kind,
            meta,
            created: st.index,
        });
        let children = self.children_mut(parent).expect("parent is a directory");
        children.insert(
            base.clone(),
            Entry {
                inode: id,
                layer: st.index,
            },
        );
        Ok(())
    }

    /// Walks to (creating as needed) the directory `path`, marking each as written by
    /// `layer`. Refuses to walk through symlinks or other non-directories.
    fn make_parents(&mut self, path: &[Vec<u8>], layer: u32) -> Result<InodeId, String> {
        let mut cur = ROOT;
        for (i, c) in path.iter().enumerate() {
            let next = self
                .children(cur)
                .expect("walk stays in directories")
                .get(c)
                .copied();
            cur = match next {
                Some(entry) => match &self.inodes[entry.inode].kind {
                    Kind::Dir { .. } => {
                        self.children_mut(cur)
                            .expect("dir")
                            .get_mut(c)
                            .expect("present")
                            .layer = layer;
                        entry.inode
                    }
                    Kind::Symlink { .. } => {
                        return Err(format!(
                            "parent {:?} is a symlink; writing through symlinks is refused",
                            String::from_utf8_lossy(&path[..=i].join(&b'/'))
                        ))
                    }
                    _ => {
                        return Err(format!(
                            "parent {:?} is not a directory",
                            String::from_utf8_lossy(&path[..=i].join(&b'/'))
                        ))
                    }
                },
                None => {
                    let id = self.add_inode(Inode {
                        kind: Kind::Dir {
                            children: BTreeMap::new(),
                        },
                        meta: root_meta(),
                        created: layer,
                    });
                    self.children_mut(cur)
                        .expect("dir")
                        .insert(c.clone(), Entry { inode: id, layer });
                    id
                }
            };
        }
        Ok(cur)
    }

    fn entry_meta<R: Read>(&self, e: &mut tar::Entry<'_, R>) -> Result<Meta, String> {
        let h = e.header();
        // Empty numeric fields read as 0, as Go's archive/tar (docker) and GNU tar do.
        let blank =
            |r: std::ops::Range<usize>| h.as_bytes()[r].iter().all(|&b| b == 0 || b == b' ');
        let mode = if blank(100..108) {
            0
        } else {
            h.mode().map_err(|x| format!("bad mode: {x}"))?
        } & 0o7777;
        let mut uid = if blank(108..116) {
            0
        } else {
            h.uid().map_err(|x| format!("bad uid: {x}"))?
        };
        let mut gid = if blank(116..124) {
            0
        } else {
            h.gid().map_err(|x| format!("bad gid: {x}"))?
        };
        let mut mtime = h.mtime().unwrap_or(0);
        let mut mtime_nsec = 0u32;
        let mut xattrs = BTreeMap::new();
        if let Ok(Some(pax)) = e.pax_extensions() {
            for ext in pax {
                let ext = ext.map_err(|x| format!("bad PAX record: {x}"))?;
                let key = ext.key_bytes();
                let value = ext.value_bytes();
                let num = || {
                    std::str::from_utf8(value)
                        .ok()
                        .and_then(|v| v.trim().parse::<u64>().ok())
                };
                match key {
                    b"uid" => uid = num().ok_or("bad PAX uid")?,
                    b"gid" => gid = num().ok_or("bad PAX gid")?,
                    b"mtime" => {
                        let v = std::str::from_utf8(value).map_err(|_| "bad PAX mtime")?;
                        let (s, frac) = v.split_once('.').unwrap_or((v, ""));
                        mtime = s
                            .parse::<i64>()
                            .map(|s| s.max(0) as u64)
                            .map_err(|_| "bad PAX mtime")?;
                        let digits: String = frac.chars().take(9).collect();
                        mtime_nsec = format!("{digits:0<9}").parse().unwrap_or(0);
                    }
                    k if k.starts_with(b"SCHILY.xattr.") => {
                        xattrs.insert(k[b"SCHILY.xattr.".len()..].to_vec(), value.to_vec());
                    }
                    _ => {}
                }
            }
        }
        let uid = u32::try_from(uid).map_err(|_| format!("uid {uid} does not fit in 32 bits"))?;
        let gid = u32::try_from(gid).map_err(|_| format!("gid {gid} does not fit in 32 bits"))?;
        Ok(Meta {
            mode,
            uid,
            gid,
            mtime,
            mtime_nsec,
            xattrs,
        })
    }

    /// Applies the layer's whiteouts and opaque markers to what lower layers left.
    fn finish_layer(&mut self, st: &LayerState) {
        for (dir, name) in &st.whiteouts {
            if let Some(d) = self.lookup(dir) {
                if let Some(children) = self.children_mut(d) {
                    if children.get(name).is_some_and(|e| e.layer < st.index) {
                        children.remove(name);
                    }
                }
            }
        }
        for dir in &st.opaque {
            let Some(d) = self.lookup(dir) else { continue };
            // Hide every lower-layer entry below the opaque directory.
            let mut stack = vec![d];
            while let Some(cur) = stack.pop() {
                let Some(children) = self.children_mut(cur) else {
                    continue;
                };
                children.retain(|_, e| e.layer >= st.index);
                let dirs: Vec<InodeId> = children.values().map(|e| e.inode).collect();
                stack.extend(
                    dirs.into_iter()
                        .filter(|&i| matches!(self.inodes[i].kind, Kind::Dir { .. })),
                );
            }
        }
    }

    /// Every reachable inode in depth-first pre-order (children by name bytes), each once,
    /// with its parent directory and its number of links.
    pub fn walk(&self) -> Walk {
        let mut order = Vec::new();
        let mut parent = vec![usize::MAX; self.inodes.len()];
        let mut links = vec![0u32; self.inodes.len()];
        let mut stack = vec![ROOT];
        parent[ROOT] = ROOT;
        links[ROOT] = 1;
        while let Some(cur) = stack.pop() {
            order.push(cur);
            if let Some(children) = self.children(cur) {
                // Push in reverse so the smallest name is visited first.
                for e in children.values().rev() {
                    links[e.inode] += 1;
                    if links[e.inode] == 1 {
                        parent[e.inode] = cur;
                        stack.push(e.inode);
                    }
                }
            }
        }
        Walk {
            order,
            parent,
            links,
        }
    }
}

pub struct Walk {
    pub order: Vec<InodeId>,
    /// Parent directory of each directory (the directory that first names an inode).
    pub parent: Vec<InodeId>,
    pub links: Vec<u32>,
}

enum SpillError {
    Read(io::Error),
    Write(io::Error),
    Store(io::Error),
    Short { declared: u64, got: u64 },
}

/// Where `apply_layer` puts regular files' bytes.
struct Spill<'a, 'l> {
    scratch: &'a mut dyn Write,
    scratch_len: &'a mut u64,
    large: Option<&'a mut (dyn LargeFiles + 'l)>,
}

/// A reader that counts what it gave and remembers whether it failed or ended, so an
/// error out of `LargeFiles::take` can be told apart: the layer's, a short layer, or the
/// store's.
struct Counted<'r> {
    inner: &'r mut dyn Read,
    got: u64,
    failed: bool,
    ended: bool,
}

impl Read for Counted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.inner.read(buf) {
            Ok(n) => {
                self.got += n as u64;
                self.ended |= n == 0 && !buf.is_empty();
                Ok(n)
            }
            Err(e) => {
                self.failed |= e.kind() != io::ErrorKind::Interrupted;
                Err(e)
            }
        }
    }
}

/// Streams an entry's data to the scratch file, hashing it, or hands a large one to
/// `LargeFiles`.
fn spill<R: Read>(
    e: &mut tar::Entry<'_, R>,
    to: &mut Spill<'_, '_>,
    buf: &mut [u8],
) -> Result<DataRef, SpillError> {
    let declared = e.size();
    let sparse = e.header().entry_type() == tar::EntryType::GNUSparse;
    if let Some(large) = to.large.as_mut() {
        if declared >= crate::chunk::LARGE_FILE && !sparse {
            let mut r = Counted {
                inner: e,
                got: 0,
                failed: false,
                ended: false,
            };
            return match large.take(declared, &mut r) {
                Ok(n) => Ok(DataRef {
                    source: DataSource::Stored(n),
                    len: declared,
                    hash: [0; 32],
                }),
                Err(x) if r.failed => Err(SpillError::Read(x)),
                Err(_) if r.ended && r.got < declared => Err(SpillError::Short {
                    declared,
                    got: r.got,
                }),
                Err(x) => Err(SpillError::Store(x)),
            };
        }
    }
    let mut hasher = (declared < crate::chunk::LARGE_FILE).then(blake3::Hasher::new);
    let offset = *to.scratch_len;
    let mut got = 0u64;
    loop {
        let n = match e.read(buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(x) if x.kind() == io::ErrorKind::Interrupted => continue,
            Err(x) => return Err(SpillError::Read(x)),
        };
        if let Some(h) = hasher.as_mut() {
            h.update(&buf[..n]);
        }
        to.scratch.write_all(&buf[..n]).map_err(SpillError::Write)?;
        got += n as u64;
    }
    if !sparse && got != declared {
        return Err(SpillError::Short { declared, got });
    }
    *to.scratch_len += got;
    Ok(DataRef {
        source: DataSource::Scratch { offset },
        len: got,
        hash: hasher.map_or([0; 32], |h| *h.finalize().as_bytes()),
    })
}
