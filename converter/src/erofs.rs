//! The EROFS writer: lays a `Tree` out as an uncompressed EROFS image with 4 KiB blocks,
//! laid out for dedup (see docs/architecture.md).
//!
//! Device layout, all deterministic:
//! - block 0: the superblock at byte 1024;
//! - from block 1 (`meta_blkaddr`), one group per layer, in layer order. An inode belongs
//!   to the layer that created it (the root to the first); a directory's blocks to the
//!   latest layer that created one of its children. Each group is: its inodes
//!   (64-byte extended form, inline xattrs, short symlink targets inline), in
//!   depth-first order of the tree, never crossing a block boundary, starting on a block
//!   boundary; then its directories' blocks, in the same order; then its regular files'
//!   data, each starting on a block boundary (FLAT_PLAIN), in the same order (a
//!   hard-linked file's data appears once). The root is nid 0.
//!
//! Why groups: images built on the same lower layers then share the bytes of those
//! layers' groups, addresses included, so an upper layer's new files change only the
//! directories that list them and the groups above (with one region for all inodes, a new
//! file moved every later inode, directory block and file address, and the metadata of
//! every task image on a base was new: about 10 MB of 20 per image in the corpus).
//!
//! Metadata (superblock, inodes, directories) is returned as segments of bytes; file
//! data stays in the scratch file and is described by `FilePlacement`s, so the device can
//! be streamed without being materialised.
//!
//! On-disk structures follow Linux `fs/erofs/erofs_fs.h`; only features the 6.1 kernel
//! reads are used (extended inodes, FLAT_PLAIN and FLAT_INLINE layouts, inline xattrs).

use crate::tree::{DataRef, InodeId, Kind, Tree};

pub const BLOCK_SIZE: u64 = 4096;
const BLOCK_BITS: u8 = 12;
const SUPER_OFFSET: usize = 1024;
const MAGIC: u32 = 0xE0F5_E1E2;
const FEATURE_COMPAT_MTIME: u32 = 0x2;
const META_BLKADDR: u64 = 1;
const INODE_SIZE: usize = 64;
const DIRENT_SIZE: usize = 12;

const LAYOUT_FLAT_PLAIN: u16 = 0;
const LAYOUT_FLAT_INLINE: u16 = 2;

const S_IFIFO: u32 = 0o010000;
const S_IFCHR: u32 = 0o020000;
const S_IFDIR: u32 = 0o040000;
const S_IFBLK: u32 = 0o060000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

const FT_REG: u8 = 1;
const FT_DIR: u8 = 2;
const FT_CHR: u8 = 3;
const FT_BLK: u8 = 4;
const FT_FIFO: u8 = 5;
const FT_LNK: u8 = 7;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ErofsError {
    #[error("{path}: xattr {name:?} is in a namespace EROFS cannot store (user., trusted., security., system.posix_acl_*)")]
    XattrNamespace { path: String, name: String },
    #[error("{path}: xattrs take {size} bytes; at most {max} fit beside an inode")]
    XattrsTooLarge {
        path: String,
        size: usize,
        max: usize,
    },
    #[error("the image needs {0} blocks, more than EROFS block addresses can reach")]
    TooLarge(u64),
    #[error("the root directory's inode does not fit in the first 2 MiB of metadata")]
    RootNid,
}

/// Where one regular file's data sits on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilePlacement {
    pub inode: InodeId,
    pub block: u64,
    pub data: DataRef,
}

/// A stretch of metadata blocks (inodes, directory blocks; the superblock in the first).
pub struct MetaSegment {
    /// Its first block.
    pub block: u64,
    /// Its bytes, whole blocks.
    pub bytes: Vec<u8>,
}

/// A laid-out image.
pub struct Image {
    /// The metadata, in device order; the first starts at block 0.
    pub meta: Vec<MetaSegment>,
    /// File data in device order, between and after the metadata segments.
    pub files: Vec<FilePlacement>,
    pub device_size: u64,
    pub inodes: u64,
}

fn blocks(len: u64) -> u64 {
    len.div_ceil(BLOCK_SIZE)
}

/// (index, short name) for an xattr name.
fn xattr_prefix(name: &[u8]) -> Option<(u8, &[u8])> {
    const P: [(&[u8], u8); 5] = [
        (b"user.", 1),
        (b"system.posix_acl_access", 2),
        (b"system.posix_acl_default", 3),
        (b"trusted.", 4),
        (b"security.", 6),
    ];
    P.iter()
        .find_map(|(p, i)| name.strip_prefix(*p).map(|rest| (*i, rest)))
}

fn align4(n: usize) -> usize {
    n.div_ceil(4) * 4
}

/// Encodes an inode's inline xattr body (header + entries), or nothing.
fn xattr_body(tree: &Tree, id: InodeId, path: &dyn Fn() -> String) -> Result<Vec<u8>, ErofsError> {
    let xattrs = &tree.inodes[id].meta.xattrs;
    if xattrs.is_empty() {
        return Ok(Vec::new());
    }
    let mut body = vec![0u8; 12];
    for (name, value) in xattrs {
        let (index, short) = xattr_prefix(name).ok_or_else(|| ErofsError::XattrNamespace {
            path: path(),
            name: String::from_utf8_lossy(name).into_owned(),
        })?;
        if short.len() > 255 || value.len() > u16::MAX as usize {
            return Err(ErofsError::XattrsTooLarge {
                path: path(),
                size: value.len(),
                max: u16::MAX as usize,
            });
        }
        body.push(short.len() as u8);
        body.push(index);
        body.extend_from_slice(&(value.len() as u16).to_le_bytes());
        body.extend_from_slice(short);
        body.extend_from_slice(value);
        body.resize(align4(body.len()), 0);
    }
    Ok(body)
}

fn new_encode_dev(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)
}

struct Slot {
    id: InodeId,
    nid: u64,
    xattrs: Vec<u8>,
    inline: Vec<u8>,
    layout: u16,
}

/// Lays out `tree`. `uuid` goes into the superblock (derive it from the content).
pub fn build(tree: &Tree, uuid: [u8; 16]) -> Result<Image, ErofsError> {
    let walk = tree.walk();
    let bs = BLOCK_SIZE as usize;
    let n = tree.inodes.len();

    // The group of each inode: the layer that created it. A directory's blocks go with
    // the latest layer that created one of its children (where its entries changed).
    let group = |id: InodeId| tree.inodes[id].created;
    let mut dir_group = vec![0u32; n];
    let mut groups = 1u32;
    for &id in &walk.order {
        groups = groups.max(group(id) + 1);
        if let Kind::Dir { children } = &tree.inodes[id].kind {
            dir_group[id] = children
                .values()
                .map(|e| group(e.inode))
                .fold(group(id), u32::max);
            groups = groups.max(dir_group[id] + 1);
        }
    }
    let mut members: Vec<Vec<InodeId>> = vec![Vec::new(); groups as usize];
    let mut dirs_of: Vec<Vec<InodeId>> = vec![Vec::new(); groups as usize];
    for &id in &walk.order {
        members[group(id) as usize].push(id);
        if matches!(tree.inodes[id].kind, Kind::Dir { .. }) {
            dirs_of[dir_group[id] as usize].push(id);
        }
    }

    // 1. Addresses, group by group: inode slots, directory blocks (their size depends
    //    only on the names), file data.
    let mut slots: Vec<Slot> = Vec::with_capacity(walk.order.len());
    let mut nid_of = vec![u64::MAX; n];
    let mut dir_at = vec![0u64; n]; // first block of each directory's blocks
    let mut file_block = vec![0u64; n];
    let mut files = Vec::new();
    let mut segments: Vec<(u64, u64)> = Vec::new(); // metadata: (first block, end block)
    let mut next_block = META_BLKADDR;
    for g in 0..groups as usize {
        let seg_start = next_block;
        let mut pos = ((next_block - META_BLKADDR) * BLOCK_SIZE) as usize;
        for &id in &members[g] {
            let path = || format!("inode {id}");
            let xattrs = xattr_body(tree, id, &path)?;
            let (layout, inline) = match &tree.inodes[id].kind {
                Kind::Symlink { target } if INODE_SIZE + xattrs.len() + target.len() <= bs => {
                    (LAYOUT_FLAT_INLINE, target.clone())
                }
                _ => (LAYOUT_FLAT_PLAIN, Vec::new()),
            };
            let size = INODE_SIZE + xattrs.len() + inline.len();
            if size > bs {
                return Err(ErofsError::XattrsTooLarge {
                    path: path(),
                    size: xattrs.len(),
                    max: bs - INODE_SIZE,
                });
            }
            if pos % bs + size > bs {
                pos = pos.div_ceil(bs) * bs;
            }
            let nid = (pos / 32) as u64;
            nid_of[id] = nid;
            slots.push(Slot {
                id,
                nid,
                xattrs,
                inline,
                layout,
            });
            pos += size.div_ceil(32) * 32;
        }
        next_block = META_BLKADDR + (pos as u64).div_ceil(BLOCK_SIZE);
        for &id in &dirs_of[g] {
            dir_at[id] = next_block;
            next_block += dir_blocks(tree, id);
        }
        if next_block > seg_start {
            segments.push((seg_start, next_block));
        }
        for &id in &members[g] {
            if let Kind::File { data } = &tree.inodes[id].kind {
                if data.len > 0 {
                    file_block[id] = next_block;
                    files.push(FilePlacement {
                        inode: id,
                        block: next_block,
                        data: *data,
                    });
                    next_block += blocks(data.len);
                }
            }
        }
    }
    if nid_of[crate::tree::ROOT] > u16::MAX as u64 {
        return Err(ErofsError::RootNid);
    }
    if next_block > u32::MAX as u64 {
        return Err(ErofsError::TooLarge(next_block));
    }

    // 2. The metadata segments' bytes; the superblock's block joins the first one.
    if segments.first().is_none_or(|s| s.0 != META_BLKADDR) {
        segments.insert(0, (META_BLKADDR, META_BLKADDR));
    }
    segments[0].0 = 0;
    let mut meta: Vec<MetaSegment> = segments
        .iter()
        .map(|&(first, end)| MetaSegment {
            block: first,
            bytes: vec![0u8; ((end - first) * BLOCK_SIZE) as usize],
        })
        .collect();
    // The segment holding device byte `at`, and `at`'s offset in it.
    let locate = |meta: &[MetaSegment], at: u64| -> (usize, usize) {
        let i = meta.partition_point(|m| m.block * BLOCK_SIZE <= at) - 1;
        (i, (at - meta[i].block * BLOCK_SIZE) as usize)
    };

    // 3. Directory blocks.
    let mut subdirs = vec![0u32; n];
    let mut dir_size = vec![0u64; n];
    for &id in &walk.order {
        let Kind::Dir { children } = &tree.inodes[id].kind else {
            continue;
        };
        let mut entries: Vec<(&[u8], u64, u8)> = Vec::with_capacity(children.len() + 2);
        entries.push((b".", nid_of[id], FT_DIR));
        entries.push((b"..", nid_of[walk.parent[id]], FT_DIR));
        for (name, e) in children {
            let ft = match &tree.inodes[e.inode].kind {
                Kind::Dir { .. } => {
                    subdirs[id] += 1;
                    FT_DIR
                }
                Kind::File { .. } => FT_REG,
                Kind::Symlink { .. } => FT_LNK,
                Kind::CharDev { .. } => FT_CHR,
                Kind::BlockDev { .. } => FT_BLK,
                Kind::Fifo => FT_FIFO,
            };
            entries.push((name.as_slice(), nid_of[e.inode], ft));
        }
        entries.sort_by(|a, b| a.0.cmp(b.0));
        let (bytes, size) = dir_bytes(&entries);
        debug_assert_eq!(bytes.len() as u64, dir_blocks(tree, id) * BLOCK_SIZE);
        dir_size[id] = size;
        let (i, off) = locate(&meta, dir_at[id] * BLOCK_SIZE);
        meta[i].bytes[off..off + bytes.len()].copy_from_slice(&bytes);
    }

    // 4. Inodes.
    let meta_start = META_BLKADDR * BLOCK_SIZE;
    for (ino, slot) in slots.iter().enumerate() {
        let inode = &tree.inodes[slot.id];
        let m = &inode.meta;
        let (ftype, size, u) = match &inode.kind {
            Kind::Dir { .. } => (S_IFDIR, dir_size[slot.id], dir_at[slot.id] as u32),
            Kind::File { data } => (S_IFREG, data.len, file_block[slot.id] as u32),
            Kind::Symlink { target } => (S_IFLNK, target.len() as u64, 0),
            Kind::CharDev { major, minor } => (S_IFCHR, 0, new_encode_dev(*major, *minor)),
            Kind::BlockDev { major, minor } => (S_IFBLK, 0, new_encode_dev(*major, *minor)),
            Kind::Fifo => (S_IFIFO, 0, 0),
        };
        let nlink = match &inode.kind {
            Kind::Dir { .. } => 2 + subdirs[slot.id],
            _ => walk.links[slot.id],
        };
        let (i, off) = locate(&meta, meta_start + slot.nid * 32);
        let seg = &mut meta[i].bytes;
        let b = &mut seg[off..off + INODE_SIZE];
        let format: u16 = 1 | (slot.layout << 1);
        let icount: u16 = if slot.xattrs.is_empty() {
            0
        } else {
            ((slot.xattrs.len() - 12) / 4 + 1) as u16
        };
        b[0..2].copy_from_slice(&format.to_le_bytes());
        b[2..4].copy_from_slice(&icount.to_le_bytes());
        b[4..6].copy_from_slice(&((ftype | m.mode) as u16).to_le_bytes());
        b[8..16].copy_from_slice(&size.to_le_bytes());
        b[16..20].copy_from_slice(&u.to_le_bytes());
        b[20..24].copy_from_slice(&((ino + 1) as u32).to_le_bytes());
        b[24..28].copy_from_slice(&m.uid.to_le_bytes());
        b[28..32].copy_from_slice(&m.gid.to_le_bytes());
        b[32..40].copy_from_slice(&m.mtime.to_le_bytes());
        b[40..44].copy_from_slice(&m.mtime_nsec.to_le_bytes());
        b[44..48].copy_from_slice(&nlink.to_le_bytes());
        let x = off + INODE_SIZE;
        seg[x..x + slot.xattrs.len()].copy_from_slice(&slot.xattrs);
        let t = x + slot.xattrs.len();
        seg[t..t + slot.inline.len()].copy_from_slice(&slot.inline);
    }
    // Long symlink targets (FLAT_PLAIN) would need a data block; targets are at most
    // 4096 bytes and always fit inline after a 64-byte inode unless xattrs are large.
    for slot in &slots {
        if let Kind::Symlink { target } = &tree.inodes[slot.id].kind {
            if slot.layout == LAYOUT_FLAT_PLAIN {
                return Err(ErofsError::XattrsTooLarge {
                    path: format!("symlink inode {} ({} byte target)", slot.id, target.len()),
                    size: slot.xattrs.len(),
                    max: bs - INODE_SIZE - target.len(),
                });
            }
        }
    }

    // 5. Superblock.
    let sb = &mut meta[0].bytes[SUPER_OFFSET..SUPER_OFFSET + 128];
    sb[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    sb[8..12].copy_from_slice(&FEATURE_COMPAT_MTIME.to_le_bytes());
    sb[12] = BLOCK_BITS;
    sb[14..16].copy_from_slice(&(nid_of[crate::tree::ROOT] as u16).to_le_bytes());
    sb[16..24].copy_from_slice(&(slots.len() as u64).to_le_bytes());
    sb[36..40].copy_from_slice(&(next_block as u32).to_le_bytes());
    sb[40..44].copy_from_slice(&(META_BLKADDR as u32).to_le_bytes());
    sb[48..64].copy_from_slice(&uuid);

    Ok(Image {
        meta,
        files,
        device_size: next_block * BLOCK_SIZE,
        inodes: slots.len() as u64,
    })
}

/// Blocks directory `id` takes: `dir_bytes` fills blocks by entry names alone.
fn dir_blocks(tree: &Tree, id: InodeId) -> u64 {
    let Kind::Dir { children } = &tree.inodes[id].kind else {
        return 0;
    };
    let bs = BLOCK_SIZE as usize;
    let names = [&b"."[..], &b".."[..]]
        .into_iter()
        .chain(children.keys().map(Vec::as_slice));
    let mut lens: Vec<&[u8]> = names.collect();
    lens.sort();
    let (mut count, mut used) = (0u64, bs);
    for name in lens {
        if used + DIRENT_SIZE + name.len() > bs {
            count += 1;
            used = 0;
        }
        used += DIRENT_SIZE + name.len();
    }
    count
}

/// Directory blocks for sorted `entries`: dirents then names, per block. Returns the
/// bytes (whole blocks) and the directory's i_size.
fn dir_bytes(entries: &[(&[u8], u64, u8)]) -> (Vec<u8>, u64) {
    let bs = BLOCK_SIZE as usize;
    let mut out = Vec::new();
    let mut i = 0;
    let mut size = 0u64;
    while i < entries.len() {
        // Take as many entries as fit in one block.
        let mut used = 0;
        let mut j = i;
        while j < entries.len() && used + DIRENT_SIZE + entries[j].0.len() <= bs {
            used += DIRENT_SIZE + entries[j].0.len();
            j += 1;
        }
        let block_start = out.len();
        out.resize(block_start + bs, 0);
        let mut name_off = DIRENT_SIZE * (j - i);
        for (k, (name, nid, ft)) in entries[i..j].iter().enumerate() {
            let d = block_start + k * DIRENT_SIZE;
            out[d..d + 8].copy_from_slice(&nid.to_le_bytes());
            out[d + 8..d + 10].copy_from_slice(&(name_off as u16).to_le_bytes());
            out[d + 10] = *ft;
            out[block_start + name_off..block_start + name_off + name.len()].copy_from_slice(name);
            name_off += name.len();
        }
        size = (block_start + name_off) as u64;
        i = j;
    }
    (out, size)
}
