//! Checksums of the files grpo re-uses (prepared data, the reference log-prob cache, checkpoints): a
//! SHA-256 over 64 MiB chunks, so that a large file is hashed in parallel, and recorded when the file is
//! written, checked when it is read. A mismatch means the file changed (a bad disk, a copy cut short, an edit)
//! and is reported with its path; nothing trains on such a file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

/// splitmix64: a well-mixed 64-bit hash of `x` (stable across runs and platforms), for the seeds drawn
/// from a run's seed and a position in it (RED-Drop's draws, LoRA's dropout masks).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Bytes hashed per task.
const CHUNK: usize = 64 << 20;

/// SHA-256 over `CHUNK`-byte chunks of a byte stream fed in any number of `update`s: the digest of the
/// length and of the chunks' digests, so that the same value comes from [`hash_bytes`] in parallel.
pub struct ChunkedHash {
    current: Sha256,
    in_chunk: usize,
    len: u64,
    digests: Vec<u8>,
}

impl Default for ChunkedHash {
    fn default() -> Self {
        Self { current: Sha256::new(), in_chunk: 0, len: 0, digests: Vec::new() }
    }
}

impl ChunkedHash {
    pub fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = bytes.len().min(CHUNK - self.in_chunk);
            self.current.update(&bytes[..n]);
            (self.in_chunk, self.len, bytes) = (self.in_chunk + n, self.len + n as u64, &bytes[n..]);
            if self.in_chunk == CHUNK {
                let done = std::mem::replace(&mut self.current, Sha256::new());
                self.digests.extend_from_slice(&done.finalize());
                self.in_chunk = 0;
            }
        }
    }

    pub fn finish(mut self) -> String {
        if self.in_chunk > 0 {
            self.digests.extend_from_slice(&self.current.finalize());
        }
        finish(self.len, &self.digests)
    }
}

fn finish(len: u64, digests: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(len.to_le_bytes());
    h.update(digests);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The [`ChunkedHash`] of `bytes`, its chunks hashed in parallel.
pub fn hash_bytes(bytes: &[u8]) -> String {
    let digests: Vec<u8> = bytes.par_chunks(CHUNK).flat_map_iter(|c| Sha256::digest(c).to_vec()).collect();
    finish(bytes.len() as u64, &digests)
}

/// A read-only memory map of `path` (`None` for an empty file).
pub fn map_file(path: &Path) -> std::io::Result<Option<Mmap>> {
    let f = std::fs::File::open(path)?;
    if f.metadata()?.len() == 0 {
        return Ok(None);
    }
    // SAFETY: a read-only map of a file grpo never modifies in place: its files are replaced by renaming a
    // new file over them, which leaves a mapped one untouched.
    unsafe { Mmap::map(&f) }.map(Some)
}

/// The checksum of the file at `path`.
pub fn hash_file(path: &Path) -> std::io::Result<String> {
    Ok(hash_bytes(map_file(path)?.as_deref().unwrap_or(&[])))
}

/// The checksum of one file combined from the checksums of several (in order).
pub fn combine(hashes: &[String]) -> String {
    let all: Vec<u8> = hashes.iter().flat_map(|h| h.as_bytes().to_vec()).collect();
    finish(hashes.len() as u64, &all)
}

/// A file whose contents are not those recorded.
#[derive(Debug, thiserror::Error)]
pub enum ChecksumError {
    #[error("{}: cannot read it to check its checksum: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: the file changed since it was written (its SHA-256 is not the one recorded in {record}); it is not used", path.display())]
    Mismatch { path: PathBuf, record: String },
}

/// The checksums of the files `names` of folder `dir`, by name (hashed in parallel).
pub fn hash_files(dir: &Path, names: &[String]) -> Result<BTreeMap<String, String>, ChecksumError> {
    names
        .par_iter()
        .map(|n| {
            let path = dir.join(n);
            hash_file(&path).map(|h| (n.clone(), h)).map_err(|source| ChecksumError::Io { path, source })
        })
        .collect()
}

/// Check the files of `dir` against `sums` (recorded in the file named `record`), in parallel.
pub fn verify(dir: &Path, sums: &BTreeMap<String, String>, record: &str) -> Result<(), ChecksumError> {
    sums.par_iter().try_for_each(|(name, want)| {
        let path = dir.join(name);
        let got = hash_file(&path).map_err(|source| ChecksumError::Io { path: path.clone(), source })?;
        if &got == want {
            Ok(())
        } else {
            Err(ChecksumError::Mismatch { path, record: record.to_string() })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_and_parallel_hashes_agree_across_chunks() {
        let bytes: Vec<u8> = (0..(CHUNK + 12345)).map(|i| (i * 7 % 251) as u8).collect();
        let mut h = ChunkedHash::default();
        for part in bytes.chunks(1 << 20) {
            h.update(part);
        }
        assert_eq!(h.finish(), hash_bytes(&bytes));
        assert_ne!(hash_bytes(&bytes), hash_bytes(&bytes[1..]));
    }

    #[test]
    fn a_flipped_byte_is_a_mismatch_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.bin"), [1u8, 2, 3]).unwrap();
        std::fs::write(dir.path().join("b.bin"), [4u8; 100]).unwrap();
        let names = vec!["a.bin".to_string(), "b.bin".to_string()];
        let sums = hash_files(dir.path(), &names).unwrap();
        verify(dir.path(), &sums, "manifest.json").unwrap();
        let mut b = std::fs::read(dir.path().join("b.bin")).unwrap();
        b[50] ^= 1;
        std::fs::write(dir.path().join("b.bin"), b).unwrap();
        let err = verify(dir.path(), &sums, "manifest.json").unwrap_err().to_string();
        assert!(err.contains("b.bin") && err.contains("manifest.json"), "{err}");
    }
}
