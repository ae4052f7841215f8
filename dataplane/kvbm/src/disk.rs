//! The disk tier's file: preallocated slots, each a 4 KiB header and the block's keys and
//! values (each padded to 4 KiB), so that every read and write is `O_DIRECT`-aligned.
//!
//! A header names the block (sequence, local and parent hashes), the layout it was computed
//! for (a fingerprint of the model, the kernels' arithmetic and the KV layout), a checksum of
//! the block's bytes and a stamp (a write counter, for the LRU order after a restart), and
//! ends with a checksum of its own. A header and its data are written in one transfer, so a
//! crash mid-write leaves either the old block, a header that fails its own check, or a
//! block whose data fails the block checksum when it is loaded — never a wrong block taken
//! as right. At start-up [`scan`] reads every header: blocks of another fingerprint
//! (another model or layout) and torn headers are dropped; the rest come back in LRU order.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use kvx_proto::{LocalBlockHash, SequenceHash};
use xxhash_rust::xxh3::xxh3_64;

use crate::pool::BlockMeta;

/// `O_DIRECT` alignment of every offset and length.
pub const ALIGN: u64 = 4096;

/// Bytes of a slot header on disk.
pub const HEADER_BYTES: u64 = ALIGN;

/// Bytes of a header that carry meaning.
pub const HEADER_LEN: usize = 80;

const MAGIC: &[u8; 8] = b"KVXKVB01";

/// `v` rounded up to the alignment.
pub fn align_up(v: u64) -> u64 {
    v.div_ceil(ALIGN) * ALIGN
}

/// One block's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Model, arithmetic and layout the block belongs to.
    pub fingerprint: u64,
    /// The block.
    pub seq_hash: SequenceHash,
    /// Its local hash.
    pub local_hash: LocalBlockHash,
    /// The block before it.
    pub parent: Option<SequenceHash>,
    /// Bytes of keys and values it holds (both).
    pub data_len: u64,
    /// Checksum of those bytes (keys then values).
    pub checksum: u64,
    /// Write counter: larger is more recent.
    pub stamp: u64,
}

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..8].copy_from_slice(MAGIC);
        let words = [
            self.fingerprint,
            self.seq_hash.0,
            self.local_hash.0,
            self.parent.map_or(0, |p| p.0),
            u64::from(self.parent.is_some()),
            self.data_len,
            self.checksum,
            self.stamp,
        ];
        for (i, w) in words.iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        let check = xxh3_64(&b[..72]);
        b[72..80].copy_from_slice(&check.to_le_bytes());
        b
    }

    /// Reads a header; `None` for an empty slot, a torn header or another format.
    pub fn decode(b: &[u8]) -> Option<Header> {
        if b.len() < HEADER_LEN || &b[..8] != MAGIC {
            return None;
        }
        let w = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[8 + 8 * i..16 + 8 * i]);
            u64::from_le_bytes(a)
        };
        if xxh3_64(&b[..72]) != w(8) {
            return None;
        }
        Some(Header {
            fingerprint: w(0),
            seq_hash: SequenceHash(w(1)),
            local_hash: LocalBlockHash(w(2)),
            parent: (w(4) == 1).then_some(SequenceHash(w(3))),
            data_len: w(5),
            checksum: w(6),
            stamp: w(7),
        })
    }

    /// What the tier's index keeps of it.
    pub fn meta(&self) -> BlockMeta {
        BlockMeta {
            seq_hash: self.seq_hash,
            local_hash: self.local_hash,
            parent: self.parent,
            checksum: self.checksum,
            hits: 0,
        }
    }
}

/// Where a tier's slots lie in its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLayout {
    /// Bytes of one block's keys (and of its values).
    pub block_bytes: u64,
    /// Slots in the file.
    pub slots: u64,
}

impl DiskLayout {
    /// Slots of `block_bytes`-byte blocks that fit in `bytes`.
    pub fn new(block_bytes: u64, bytes: u64) -> Self {
        let mut l = DiskLayout { block_bytes, slots: 0 };
        l.slots = bytes / l.stride().max(1);
        l
    }

    /// Bytes of one slot: header, keys, values.
    pub fn stride(&self) -> u64 {
        HEADER_BYTES + 2 * align_up(self.block_bytes)
    }

    /// Bytes of the file.
    pub fn file_bytes(&self) -> u64 {
        self.slots * self.stride()
    }

    /// Offset of slot `s`'s header.
    pub fn header_at(&self, s: u32) -> u64 {
        u64::from(s) * self.stride()
    }

    /// Offset of slot `s`'s keys (its values follow at [`align_up`]`(block_bytes)`).
    pub fn data_at(&self, s: u32) -> u64 {
        self.header_at(s) + HEADER_BYTES
    }
}

/// The file of a disk tier, locked for this process.
#[derive(Debug)]
pub struct DiskFile {
    /// Its path.
    pub path: PathBuf,
    /// Held for the lock (released when dropped).
    _lock: File,
}

/// Why the disk tier could not open.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// A filesystem call failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// On which file.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// Another process holds the file.
    #[error("{} is in use by another kvx process", .0.display())]
    Locked(PathBuf),
}

/// Opens (creating it and the directory when missing) and locks the tier file `name` in
/// `dir`, sized for `layout` (sparse: space is taken as blocks are written). A file it
/// creates is readable by its owner only (0600, it holds the KV of users' prompts), and so is
/// a directory it creates (0700).
pub fn open(dir: &Path, name: &str, layout: &DiskLayout) -> Result<DiskFile, DiskError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let path = dir.join(name);
    let io_err = |what, source| DiskError::Io { what, path: path.clone(), source };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| io_err("creating the directory of", e))?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|e| io_err("opening", e))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Err(DiskError::Locked(path)),
        Err(std::fs::TryLockError::Error(e)) => return Err(io_err("locking", e)),
    }
    let len = f.metadata().map_err(|e| io_err("reading the size of", e))?.len();
    if len != layout.file_bytes() {
        // Grown or shrunk to the configured size (slots past the end are gone).
        f.set_len(layout.file_bytes()).map_err(|e| io_err("sizing", e))?;
    }
    Ok(DiskFile { path, _lock: f })
}

/// What a scan found.
#[derive(Debug, Default)]
pub struct Scan {
    /// Usable blocks `(slot, header)`, least recently written first.
    pub blocks: Vec<(u32, Header)>,
    /// Headers of another model or layout.
    pub foreign: usize,
    /// Headers that fail their own check, or a block repeated in an older slot.
    pub torn: usize,
}

/// Reads every slot header of `file` and keeps the blocks of `fingerprint` whose data length
/// is the layout's.
pub fn scan(file: &DiskFile, layout: &DiskLayout, fingerprint: u64) -> Result<Scan, DiskError> {
    let f = File::open(&file.path).map_err(|source| DiskError::Io {
        what: "reading",
        path: file.path.clone(),
        source,
    })?;
    let mut out = Scan::default();
    let mut buf = [0u8; HEADER_LEN];
    for s in 0..layout.slots as u32 {
        if let Err(source) = f.read_exact_at(&mut buf, layout.header_at(s)) {
            return Err(DiskError::Io {
                what: "reading a header of",
                path: file.path.clone(),
                source,
            });
        }
        if buf.iter().all(|&b| b == 0) {
            continue;
        }
        let Some(h) = Header::decode(&buf) else {
            out.torn += 1;
            continue;
        };
        if h.fingerprint != fingerprint || h.data_len != 2 * layout.block_bytes {
            out.foreign += 1;
            continue;
        }
        out.blocks.push((s, h));
    }
    // The same block in two slots (rewritten after an eviction): the newest one wins.
    out.blocks.sort_by_key(|(_, h)| std::cmp::Reverse(h.stamp));
    let mut seen = std::collections::HashSet::new();
    let before = out.blocks.len();
    out.blocks.retain(|(_, h)| seen.insert(h.seq_hash));
    out.torn += before - out.blocks.len();
    out.blocks.reverse();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(h: u64, stamp: u64) -> Header {
        Header {
            fingerprint: 42,
            seq_hash: SequenceHash(h),
            local_hash: LocalBlockHash(h + 1),
            parent: (h > 1).then_some(SequenceHash(h - 1)),
            data_len: 2 * 5000,
            checksum: 99,
            stamp,
        }
    }

    #[test]
    fn headers_round_trip_and_a_flipped_byte_is_caught() {
        let h = header(5, 3);
        let b = h.encode();
        assert_eq!(Header::decode(&b), Some(h));
        for i in 0..HEADER_LEN {
            let mut c = b;
            c[i] ^= 0x10;
            assert_eq!(Header::decode(&c), None, "byte {i}");
        }
        assert_eq!(Header::decode(&[0u8; HEADER_LEN]), None);
    }

    #[test]
    fn a_scan_keeps_this_layouts_blocks_in_write_order() {
        let dir = std::env::temp_dir().join(format!("kvbm-scan-{}", std::process::id()));
        let layout = DiskLayout::new(5000, 10 * (4096 + 2 * 8192));
        assert_eq!((layout.slots, layout.stride()), (10, 4096 + 2 * 8192));
        let file = open(&dir, "t.blocks", &layout).unwrap();
        assert!(matches!(open(&dir, "t.blocks", &layout), Err(DiskError::Locked(_))));
        let f = std::fs::OpenOptions::new().write(true).open(&file.path).unwrap();
        let put = |s: u32, b: &[u8]| f.write_all_at(b, layout.header_at(s)).unwrap();
        put(0, &header(1, 7).encode());
        put(3, &header(2, 5).encode());
        put(4, &Header { fingerprint: 43, ..header(3, 1) }.encode());
        let mut torn = header(4, 2).encode();
        torn[20] ^= 1;
        put(5, &torn);
        put(6, &header(1, 9).encode()); // block 1 rewritten later in another slot
        put(7, &Header { data_len: 10, ..header(8, 1) }.encode());
        let s = scan(&file, &layout, 42).unwrap();
        let got: Vec<(u32, u64)> = s.blocks.iter().map(|(i, h)| (*i, h.seq_hash.0)).collect();
        assert_eq!(got, vec![(3, 2), (6, 1)]);
        assert_eq!((s.foreign, s.torn), (2, 2));
        drop(file);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
