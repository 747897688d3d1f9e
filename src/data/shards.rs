//! The prepared-data format and its memory-mapped reader [`PreparedDataset`].
//!
//! A prepared version (a folder of the prepared folder, see [`super::versions`]) holds:
//! - `manifest.json`: format, inputs (size, modification time), tokenizer fingerprint, options, counts,
//!   token shard names and the checksum of every other file, checked when the version is opened;
//! - `stats.json`: the [`super::Stats`] of the data as prepared;
//! - `groups.jsonl`: one line per group, in group index order ([`GroupMeta`]);
//! - `prompts.bin`: per group 16 bytes (shard u32, length u32, offset u64 in tokens), little-endian;
//! - `responses.bin`: per response 32 bytes (shard u32, length u32, offset u64, log-prob offset u64,
//!   log-prob length u32, flags u32: bit 0 written, bit 1 truncated), responses of group g at
//!   `first_response .. first_response + n_responses`;
//! - `tokens-NNNNN.u32`: token ids (u32 little-endian), prompts and responses, rotated at a size limit;
//! - `logprobs.f32`: teacher log-probs (f32 little-endian) aligned with the response tokens.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use super::{io_err, DataError};

pub(crate) const FORMAT: &str = "grpo-prepared-v2";
const PROMPT_REC: usize = 16;
const RESP_REC: usize = 32;
const FLAG_WRITTEN: u32 = 1;
const FLAG_TRUNCATED: u32 = 2;

/// Metadata of one group (one line of `groups.jsonl`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupMeta {
    pub question_id: String,
    pub domain: Option<String>,
    pub source: Option<String>,
    pub first_response: u64,
    pub n_responses: u32,
    pub majority: Option<String>,
    pub majority_count: usize,
    pub vote_margin: usize,
    pub answers: Vec<Option<String>>,
    pub rewards: Vec<f32>,
}

/// One response of a prepared [`Group`].
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    /// Response tokens only (the answer text, then EOS unless truncated).
    pub tokens: Vec<u32>,
    pub reward: f32,
    pub answer: Option<String>,
    /// Cut at the response-token limit (no EOS at the end).
    pub truncated: bool,
    /// Teacher log-prob of each token of `tokens`, when the data had them.
    pub teacher_logprobs: Option<Vec<f32>>,
    /// A sampled answer's importance-sampling correction (`rollout.importance_sampling_correction`):
    /// the weight of each token's policy loss. Never stored in shards.
    pub is_weights: Option<Vec<f32>>,
}

/// One prepared group: the rendered prompt and the chosen answers with their labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub index: usize,
    /// Hash of the question text (16 hex digits).
    pub question_id: String,
    pub domain: Option<String>,
    pub source: Option<String>,
    /// Chat-template rendering of [system?, user] with the generation prompt, as tokens. The full
    /// sequence of response i is `prompt_tokens ++ responses[i].tokens`.
    pub prompt_tokens: Vec<u32>,
    pub responses: Vec<Response>,
    pub majority: Option<String>,
    pub majority_count: usize,
    pub vote_margin: usize,
}

fn shard_name(i: usize) -> String {
    format!("tokens-{i:05}.u32")
}

/// Writes token shards and the fixed-size prompt / response tables (positioned writes, any order).
pub(crate) struct ShardWriter {
    dir: PathBuf,
    prompts: File,
    responses: File,
    shard: BufWriter<File>,
    shard_index: usize,
    shard_len: u64,
    shard_limit: u64,
    logprobs: BufWriter<File>,
    logprobs_len: u64,
    prompts_written: u64,
    responses_written: u64,
    pub tokens_total: u64,
}

fn write_at(file: &File, path: &Path, pos: u64, bytes: &[u8]) -> Result<(), DataError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        file.write_all_at(bytes, pos).map_err(io_err(path))
    }
    #[cfg(not(unix))]
    {
        use std::io::{Seek, SeekFrom};
        let mut f = file;
        f.seek(SeekFrom::Start(pos)).map_err(io_err(path))?;
        f.write_all(bytes).map_err(io_err(path))
    }
}

impl ShardWriter {
    pub(crate) fn create(dir: &Path, groups: u64, responses: u64, shard_limit: u64) -> Result<Self, DataError> {
        let table = |name: &str, len: u64| -> Result<File, DataError> {
            let p = dir.join(name);
            let f = File::options().create(true).truncate(true).read(true).write(true).open(&p).map_err(io_err(&p))?;
            f.set_len(len).map_err(io_err(&p))?;
            Ok(f)
        };
        let prompts = table("prompts.bin", groups * PROMPT_REC as u64)?;
        let responses = table("responses.bin", responses * RESP_REC as u64)?;
        let first = dir.join(shard_name(0));
        let lp = dir.join("logprobs.f32");
        Ok(Self {
            dir: dir.to_path_buf(),
            prompts,
            responses,
            shard: BufWriter::with_capacity(1 << 20, File::create(&first).map_err(io_err(&first))?),
            shard_index: 0,
            shard_len: 0,
            shard_limit: shard_limit.max(1),
            logprobs: BufWriter::with_capacity(1 << 20, File::create(&lp).map_err(io_err(&lp))?),
            logprobs_len: 0,
            prompts_written: 0,
            responses_written: 0,
            tokens_total: 0,
        })
    }

    fn append(&mut self, tokens: &[u32]) -> Result<(u32, u64), DataError> {
        if self.shard_len > 0 && self.shard_len + tokens.len() as u64 > self.shard_limit {
            self.shard.flush().map_err(io_err(self.dir.join(shard_name(self.shard_index))))?;
            self.shard_index += 1;
            let p = self.dir.join(shard_name(self.shard_index));
            self.shard = BufWriter::with_capacity(1 << 20, File::create(&p).map_err(io_err(&p))?);
            self.shard_len = 0;
        }
        let at = (self.shard_index as u32, self.shard_len);
        let mut buf = Vec::with_capacity(tokens.len() * 4);
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        self.shard.write_all(&buf).map_err(io_err(self.dir.join(shard_name(self.shard_index))))?;
        self.shard_len += tokens.len() as u64;
        self.tokens_total += tokens.len() as u64;
        Ok(at)
    }

    pub(crate) fn write_prompt(&mut self, group: u64, tokens: &[u32]) -> Result<(), DataError> {
        let (shard, offset) = self.append(tokens)?;
        let mut rec = [0u8; PROMPT_REC];
        rec[0..4].copy_from_slice(&shard.to_le_bytes());
        rec[4..8].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
        rec[8..16].copy_from_slice(&offset.to_le_bytes());
        write_at(&self.prompts, &self.dir.join("prompts.bin"), group * PROMPT_REC as u64, &rec)?;
        self.prompts_written += 1;
        Ok(())
    }

    pub(crate) fn write_response(
        &mut self,
        index: u64,
        tokens: &[u32],
        truncated: bool,
        logprobs: Option<&[f32]>,
    ) -> Result<(), DataError> {
        let (shard, offset) = self.append(tokens)?;
        let (lp_off, lp_len) = match logprobs {
            Some(lp) => {
                let at = self.logprobs_len;
                let mut buf = Vec::with_capacity(lp.len() * 4);
                for x in lp {
                    buf.extend_from_slice(&x.to_le_bytes());
                }
                self.logprobs.write_all(&buf).map_err(io_err(self.dir.join("logprobs.f32")))?;
                self.logprobs_len += lp.len() as u64;
                (at, lp.len() as u32)
            }
            None => (0, u32::MAX),
        };
        let mut rec = [0u8; RESP_REC];
        rec[0..4].copy_from_slice(&shard.to_le_bytes());
        rec[4..8].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
        rec[8..16].copy_from_slice(&offset.to_le_bytes());
        rec[16..24].copy_from_slice(&lp_off.to_le_bytes());
        rec[24..28].copy_from_slice(&lp_len.to_le_bytes());
        let flags = FLAG_WRITTEN | if truncated { FLAG_TRUNCATED } else { 0 };
        rec[28..32].copy_from_slice(&flags.to_le_bytes());
        write_at(&self.responses, &self.dir.join("responses.bin"), index * RESP_REC as u64, &rec)?;
        self.responses_written += 1;
        Ok(())
    }

    /// Flush and sync everything; returns the shard file names and (prompts, responses) written.
    pub(crate) fn finish(mut self) -> Result<(Vec<String>, u64, u64), DataError> {
        let p = self.dir.join(shard_name(self.shard_index));
        self.shard.flush().map_err(io_err(&p))?;
        self.shard.get_ref().sync_all().map_err(io_err(&p))?;
        let lp = self.dir.join("logprobs.f32");
        self.logprobs.flush().map_err(io_err(&lp))?;
        self.prompts.sync_all().map_err(io_err(self.dir.join("prompts.bin")))?;
        self.responses.sync_all().map_err(io_err(self.dir.join("responses.bin")))?;
        Ok(((0..=self.shard_index).map(shard_name).collect(), self.prompts_written, self.responses_written))
    }
}

/// A read-only memory map, empty for an empty file.
struct Map(Option<Mmap>);

impl Map {
    fn open(path: &Path) -> Result<Self, DataError> {
        let f = File::open(path).map_err(io_err(path))?;
        let len = f.metadata().map_err(io_err(path))?.len();
        if len == 0 {
            return Ok(Map(None));
        }
        // SAFETY: the prepared files are written once and not modified while a dataset is open.
        let m = unsafe { Mmap::map(&f) }.map_err(io_err(path))?;
        Ok(Map(Some(m)))
    }
    fn bytes(&self) -> &[u8] {
        self.0.as_deref().unwrap_or(&[])
    }
}

/// The manifest of a prepared folder (the parts the reader needs; the rest is kept as JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ManifestHead {
    pub format: String,
    pub groups: u64,
    pub responses: u64,
    pub token_shards: Vec<String>,
    #[serde(default)]
    pub checksums: std::collections::BTreeMap<String, String>,
}

/// The checksum of a version's `manifest.json` (which records the checksums of the other files).
pub(crate) const MANIFEST_SUM: &str = "manifest.sha256";

/// Write the checksum of the manifest of the version being written in `dir`.
pub(crate) fn write_manifest_sum(dir: &Path) -> Result<(), DataError> {
    let m = dir.join("manifest.json");
    let sum = crate::checksum::hash_file(&m).map_err(io_err(&m))?;
    let p = dir.join(MANIFEST_SUM);
    crate::fsio::write_atomic(&p, format!("{sum}\n").as_bytes()).map_err(io_err(&p))
}

/// The data's fingerprint from its manifest: its data files' checksums only (not the paths and versions the
/// manifest also records), so that two preparations of the same data anywhere have the same fingerprint.
fn data_fingerprint(head: &ManifestHead) -> String {
    let mut data = head.checksums.clone();
    data.remove("stats.json");
    crate::checksum::hash_bytes(&serde_json::to_vec(&data).unwrap_or_default())
}

/// The fingerprint ([`PreparedDataset::fingerprint`]) of the version `dir`, read from its manifest alone
/// (the data files are not read).
pub(crate) fn version_fingerprint(dir: &Path) -> Result<String, DataError> {
    Ok(data_fingerprint(&read_head(dir)?))
}

/// Hold the version of `dir` whose data has `fingerprint` (a checkpoint's: [`PreparedDataset::fingerprint`]),
/// so that no preparation removes it, or its reference log-prob cache, while the hold lasts; None when no
/// version has it.
pub(crate) fn hold_fingerprint(dir: &Path, fingerprint: &str) -> Option<super::versions::ReaderLock> {
    super::versions::versions(dir)
        .into_iter()
        .filter(|v| version_fingerprint(v).is_ok_and(|f| f == fingerprint))
        .find_map(|v| super::versions::hold_version(&v).ok())
}

/// Check the version in `dir`: its manifest against its checksum (versions written before it had one are
/// read as they are), then every file against the manifest's checksums. Its manifest.
pub(crate) fn verify_version(dir: &Path) -> Result<ManifestHead, DataError> {
    let head = read_head(dir)?;
    crate::checksum::verify(dir, &head.checksums, "manifest.json")
        .map_err(|e| DataError::Format { path: dir.to_path_buf(), message: e.to_string() })?;
    // A manifest rewritten together with its checksum: its counts must still size the tables.
    for (file, records, size) in [("prompts.bin", head.groups, PROMPT_REC), ("responses.bin", head.responses, RESP_REC)]
    {
        let p = dir.join(file);
        let len = std::fs::metadata(&p).map_err(io_err(&p))?.len();
        if Some(len) != records.checked_mul(size as u64) {
            return Err(DataError::Format {
                path: dir.to_path_buf(),
                message: format!(
                    "tables do not match the manifest ({} groups, {} responses; {file} holds {len} bytes)",
                    head.groups, head.responses
                ),
            });
        }
    }
    Ok(head)
}

/// The manifest of the version `dir`, checked against its checksum, its format and the files it must
/// record; the files themselves are not read.
fn read_head(dir: &Path) -> Result<ManifestHead, DataError> {
    let bad = |m: String| DataError::Format { path: dir.to_path_buf(), message: m };
    let mpath = dir.join("manifest.json");
    let text = std::fs::read_to_string(&mpath).map_err(io_err(&mpath))?;
    match std::fs::read_to_string(dir.join(MANIFEST_SUM)) {
        Ok(sum) if sum.trim() != crate::checksum::hash_bytes(text.as_bytes()) => {
            return Err(bad(format!("manifest.json changed since it was written (not its {MANIFEST_SUM})")))
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&dir.join(MANIFEST_SUM))(e)),
    }
    let head: ManifestHead = serde_json::from_str(&text).map_err(|e| bad(format!("manifest.json: {e}")))?;
    if head.format != FORMAT {
        return Err(bad(format!(
            "format {:?}, expected {FORMAT:?}: prepare it again (grpo data prepare, or a training run)",
            head.format
        )));
    }
    let mut expected: Vec<&str> = vec!["groups.jsonl", "prompts.bin", "responses.bin", "logprobs.f32"];
    expected.extend(head.token_shards.iter().map(String::as_str));
    if let Some(f) = expected.iter().find(|f| !head.checksums.contains_key(**f)) {
        return Err(bad(format!("manifest.json records no checksum of {f}")));
    }
    Ok(head)
}

/// A prepared folder, memory-mapped: random access to groups by index.
pub struct PreparedDataset {
    /// The version's folder.
    dir: PathBuf,
    /// Keeps the version from being removed by a later preparation while it is read.
    _hold: super::versions::ReaderLock,
    /// The data's fingerprint: the checksum of the checksums that the manifest records of its data files.
    fingerprint: String,
    groups: Vec<GroupMeta>,
    prompts: Map,
    responses: Map,
    shards: Vec<Map>,
    logprobs: Map,
}

impl std::fmt::Debug for PreparedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedDataset").field("dir", &self.dir).field("groups", &self.groups.len()).finish()
    }
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

impl PreparedDataset {
    /// Open the current version of a folder written by [`super::prepare()`] and keep it (a later
    /// preparation writes another version). Fails when the manifest is missing (an incomplete
    /// preparation), a file's checksum is not the manifest's, or the tables do not match it.
    pub fn open(folder: &Path) -> Result<Self, DataError> {
        let (version, hold) = super::versions::open_current(folder)?;
        Self::read(&version, hold)
    }

    /// Open the version folder `version` of a prepared folder (`PREPARED/v-...`, the [`super::PrepareOutcome`]'s
    /// `out`), whatever `CURRENT` names now: how every rank of a run reads the version rank 0 chose.
    pub fn open_version(version: &Path) -> Result<Self, DataError> {
        if version.join(super::versions::CURRENT).exists() || !version.join(super::versions::READERS_LOCK).exists() {
            return Self::open(version); // the prepared folder itself (its single-version layout)
        }
        let hold = super::versions::hold_version(version)?;
        Self::read(version, hold)
    }

    /// Read the version `dir`, held by `hold`.
    fn read(dir: &Path, hold: super::versions::ReaderLock) -> Result<Self, DataError> {
        Self::read_tables(dir, hold).map_err(|e| match e {
            DataError::Format { path, message } => DataError::Format {
                path,
                message: format!(
                    "{message}; the prepared version is damaged: `grpo data prepare --force` (or the next training \
                     run, which notices it) prepares it again"
                ),
            },
            e => e,
        })
    }

    /// [`Self::read`]'s work: the manifest checked, then the tables read and checked against it.
    fn read_tables(dir: &Path, hold: super::versions::ReaderLock) -> Result<Self, DataError> {
        let head = verify_version(dir)?;
        let bad = |m: String| DataError::Format { path: dir.to_path_buf(), message: m };
        let gpath = dir.join("groups.jsonl");
        // Not sized from the manifest's counts before they are checked against the tables below.
        let mut groups = Vec::new();
        for line in crate::jsonl::Lines::open(&gpath)? {
            let line = line?;
            let g: GroupMeta = line.json().map_err(|e| bad(format!("groups.jsonl line {}: {e}", line.number)))?;
            groups.push(g);
        }
        let prompts = Map::open(&dir.join("prompts.bin"))?;
        let responses = Map::open(&dir.join("responses.bin"))?;
        if groups.len() as u64 != head.groups
            || Some(prompts.bytes().len() as u64) != head.groups.checked_mul(PROMPT_REC as u64)
            || Some(responses.bytes().len() as u64) != head.responses.checked_mul(RESP_REC as u64)
        {
            return Err(bad(format!(
                "tables do not match the manifest ({} groups, {} responses)",
                head.groups, head.responses
            )));
        }
        let total: u64 = groups.iter().map(|g| g.n_responses as u64).sum();
        if total != head.responses {
            return Err(bad("groups.jsonl response counts do not add up".into()));
        }
        let shards = head.token_shards.iter().map(|s| Map::open(&dir.join(s))).collect::<Result<Vec<_>, _>>()?;
        let logprobs = Map::open(&dir.join("logprobs.f32"))?;
        let fingerprint = data_fingerprint(&head);
        Ok(Self { dir: dir.to_path_buf(), _hold: hold, fingerprint, groups, prompts, responses, shards, logprobs })
    }

    /// The folder of the version read (its manifest, tables and the reference log-prob cache).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A fingerprint of the data read: the checksum of the checksums the version's manifest records of its
    /// data files (tables and token shards), equal for two versions only when they hold the same data.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The stats written by prepare (`stats.json`).
    pub fn stats(&self) -> Result<super::Stats, DataError> {
        let p = self.dir.join("stats.json");
        let text = std::fs::read_to_string(&p).map_err(io_err(&p))?;
        serde_json::from_str(&text).map_err(|e| DataError::Format { path: p, message: e.to_string() })
    }

    fn tokens(&self, shard: u32, offset: u64, len: u32) -> Result<Vec<u32>, DataError> {
        let bytes = self.shards.get(shard as usize).map(Map::bytes).ok_or_else(|| self.corrupt("shard index"))?;
        let (start, end) = (offset as usize * 4, (offset as usize + len as usize) * 4);
        let slice = bytes.get(start..end).ok_or_else(|| self.corrupt("token range"))?;
        Ok(slice.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    fn corrupt(&self, what: &str) -> DataError {
        DataError::Format { path: self.dir.clone(), message: format!("corrupt prepared data: {what} out of range") }
    }

    /// The token count of each response of group `i` (read from the response table only).
    pub fn response_lengths(&self, i: usize) -> Result<Vec<usize>, DataError> {
        let meta = self.groups.get(i).ok_or_else(|| self.corrupt("group index"))?;
        (0..meta.n_responses as usize)
            .map(|j| {
                let k = meta.first_response as usize + j;
                let r = self.responses.bytes().get(k * RESP_REC..(k + 1) * RESP_REC);
                r.map(|r| le_u32(r, 4) as usize).ok_or_else(|| self.corrupt("response"))
            })
            .collect()
    }

    /// Group `i` with its prompt and response tokens (read from the memory maps).
    pub fn group(&self, i: usize) -> Result<Group, DataError> {
        let meta = self.groups.get(i).ok_or_else(|| self.corrupt("group index"))?;
        let p = &self.prompts.bytes()[i * PROMPT_REC..(i + 1) * PROMPT_REC];
        let prompt_tokens = self.tokens(le_u32(p, 0), le_u64(p, 8), le_u32(p, 4))?;
        let mut responses = Vec::with_capacity(meta.n_responses as usize);
        for j in 0..meta.n_responses as usize {
            let k = meta.first_response as usize + j;
            let r =
                self.responses.bytes().get(k * RESP_REC..(k + 1) * RESP_REC).ok_or_else(|| self.corrupt("response"))?;
            let flags = le_u32(r, 28);
            if flags & FLAG_WRITTEN == 0 {
                return Err(self.corrupt("unwritten response"));
            }
            let tokens = self.tokens(le_u32(r, 0), le_u64(r, 8), le_u32(r, 4))?;
            let lp_len = le_u32(r, 24);
            let teacher_logprobs = if lp_len == u32::MAX {
                None
            } else {
                let start = le_u64(r, 16) as usize * 4;
                let b = self
                    .logprobs
                    .bytes()
                    .get(start..start + lp_len as usize * 4)
                    .ok_or_else(|| self.corrupt("log-prob range"))?;
                Some(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            };
            responses.push(Response {
                tokens,
                reward: meta.rewards.get(j).copied().unwrap_or(0.0),
                answer: meta.answers.get(j).cloned().flatten(),
                truncated: flags & FLAG_TRUNCATED != 0,
                teacher_logprobs,
                is_weights: None,
            });
        }
        Ok(Group {
            index: i,
            question_id: meta.question_id.clone(),
            domain: meta.domain.clone(),
            source: meta.source.clone(),
            prompt_tokens,
            responses,
            majority: meta.majority.clone(),
            majority_count: meta.majority_count,
            vote_margin: meta.vote_margin,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_then_read_with_shard_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::create(dir.path(), 2, 3, 5).unwrap();
        // Out of order, as prepare writes them.
        w.write_response(2, &[7, 8, 9], false, Some(&[-0.1, -0.2, 0.0])).unwrap();
        w.write_prompt(1, &[5, 6]).unwrap();
        w.write_prompt(0, &[1, 2, 3]).unwrap();
        w.write_response(0, &[10, 11], true, None).unwrap();
        w.write_response(1, &[12], false, None).unwrap();
        let (shards, np, nr) = w.finish().unwrap();
        assert!(shards.len() >= 2, "{shards:?}");
        assert_eq!((np, nr), (2, 3));
        let meta = |first, n: u32| GroupMeta {
            question_id: format!("{first:016x}"),
            domain: None,
            source: None,
            first_response: first,
            n_responses: n,
            majority: Some("1".into()),
            majority_count: n as usize,
            vote_margin: n as usize,
            answers: vec![Some("1".into()); n as usize],
            rewards: vec![1.0; n as usize],
        };
        let mut f = std::fs::File::create(dir.path().join("groups.jsonl")).unwrap();
        for m in [meta(0, 2), meta(2, 1)] {
            writeln!(f, "{}", serde_json::to_string(&m).unwrap()).unwrap();
        }
        let mut names: Vec<String> =
            ["groups.jsonl", "prompts.bin", "responses.bin", "logprobs.f32"].map(String::from).into();
        names.extend(shards.iter().cloned());
        let checksums = crate::checksum::hash_files(dir.path(), &names).unwrap();
        let head = ManifestHead { format: FORMAT.into(), groups: 2, responses: 3, token_shards: shards, checksums };
        std::fs::write(dir.path().join("manifest.json"), serde_json::to_string(&head).unwrap()).unwrap();
        let ds = PreparedDataset::open(dir.path()).unwrap();
        assert_eq!(ds.len(), 2);
        let g0 = ds.group(0).unwrap();
        assert_eq!(g0.prompt_tokens, vec![1, 2, 3]);
        assert_eq!(g0.responses.iter().map(|r| r.tokens.clone()).collect::<Vec<_>>(), vec![vec![10, 11], vec![12]]);
        assert!(g0.responses[0].truncated && !g0.responses[1].truncated);
        assert_eq!((ds.response_lengths(0).unwrap(), ds.response_lengths(1).unwrap()), (vec![2, 1], vec![3]));
        let g1 = ds.group(1).unwrap();
        assert_eq!((g1.prompt_tokens.clone(), g1.responses[0].tokens.clone()), (vec![5, 6], vec![7, 8, 9]));
        assert_eq!(g1.responses[0].teacher_logprobs, Some(vec![-0.1, -0.2, 0.0]));
        assert!(ds.group(2).is_err());
        drop(ds);
        // A flipped byte in any file is an error naming that file.
        for name in &names {
            let p = dir.path().join(name);
            let mut b = std::fs::read(&p).unwrap();
            b[0] ^= 0x40;
            std::fs::write(&p, &b).unwrap();
            let err = PreparedDataset::open(dir.path()).unwrap_err().to_string();
            assert!(err.contains(name.as_str()) && err.contains("changed"), "{name}: {err}");
            b[0] ^= 0x40;
            std::fs::write(&p, &b).unwrap();
        }
        PreparedDataset::open(dir.path()).unwrap();
        // A manifest rewritten with its checksum to other counts: named as damaged, with the remedy.
        let tampered = ManifestHead { groups: 3, ..head };
        let text = serde_json::to_string(&tampered).unwrap();
        std::fs::write(dir.path().join("manifest.json"), &text).unwrap();
        std::fs::write(dir.path().join(MANIFEST_SUM), crate::checksum::hash_bytes(text.as_bytes())).unwrap();
        let err = verify_version(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tables do not match the manifest (3 groups") && err.contains("prompts.bin"), "{err}");
        let err = PreparedDataset::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tables do not match") && err.contains("grpo data prepare --force"), "{err}");
    }
}
