//! Reference log-probs computed once.
//!
//! With teacher data, the frozen reference's log-prob of each answer token depends only on the prepared
//! data and the reference's weights, so it is computed in one pass (by `grpo data prepare --reference` or by
//! the trainer before its first step) and stored beside the prepared shards:
//! - `reference-logprobs.f32`: f32 little-endian, one value per answer token, groups in index order and the
//!   answers of a group in their order (the layout follows from the prepared response table);
//! - `reference-logprobs.json`: the [`Manifest`], written last, keyed by a SHA-256 of the reference's
//!   config and weights, of the prepared data (its manifest and tables) and by the dtype of the forward.
//!
//! A changed key recomputes the values; a truncated or damaged file (size or SHA-256 not the manifest's) is
//! reported with its path and recomputed. Training then memory-maps the values and loads no reference model:
//! a step looks up the answers of its groups by (group index, answer index), so shuffling, epochs, resume
//! and micro-batching read the same values, and an answer cut shorter reads the first of them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use super::{io, TrainConfig, TrainError};
use crate::checksum::{self, hash_bytes};
use crate::data::{Group, PreparedDataset};
use crate::dist::World;
use crate::model::{self, Decoder, DecoderOptions, Targets, TokenBatch};

/// The values file, in the prepared folder.
pub const VALUES_FILE: &str = "reference-logprobs.f32";
/// The manifest, in the prepared folder.
pub const MANIFEST_FILE: &str = "reference-logprobs.json";
const FORMAT: &str = "grpo-reference-logprobs-v2";

/// Whether the reference log-probs of a run with `cfg` can be cached: the run trains on fixed data (the
/// prepared teacher answers) against a reference that stays frozen for the whole run (`model.reference`
/// or the initial weights), and `model.cache_reference` is on. A reference that changes during training,
/// or answers generated during training, must be scored on the fly: their conditions belong here.
pub fn reference_is_cacheable(cfg: &TrainConfig) -> bool {
    cfg.model.cache_reference && run_can_cache_reference(cfg)
}

/// Whether a run with `cfg` could cache its reference's log-probs with `model.cache_reference` on.
pub fn run_can_cache_reference(cfg: &TrainConfig) -> bool {
    cfg.train.reference_swap_every.is_none() && cfg.rollout.is_none()
}

/// How the cache is computed.
#[derive(Debug, Clone)]
pub struct ComputeOptions {
    /// Weights dtype of the reference (part of the cache's key).
    pub dtype: DType,
    pub device: Device,
    /// Sequences per reference forward.
    pub batch: usize,
    /// How the reference computes (log-prob chunking, fused ops): not part of the key.
    pub decoder: DecoderOptions,
}

/// `reference-logprobs.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Manifest {
    format: String,
    /// The reference folder the values were computed from (for people: the key is its hash).
    reference: String,
    /// SHA-256 of the reference's config.json and safetensors files.
    reference_sha256: String,
    /// SHA-256 of the prepared version's manifest.json, which holds the checksum of each of its files
    /// (token shards, groups and their labels, tables): any change to the data changes it.
    data_sha256: String,
    /// Weights dtype of the reference forward.
    dtype: String,
    groups: u64,
    responses: u64,
    /// f32 values in the values file (answer tokens).
    values: u64,
    /// SHA-256 of the values file (chunked, see [`hash_bytes`]).
    values_sha256: String,
    created_by: String,
}

/// What the values depend on.
#[derive(Debug, Clone, PartialEq)]
struct Key {
    reference_sha256: String,
    data_sha256: String,
    dtype: String,
}

/// Where each answer's values are: per group the index of its first answer, per answer (offset, length).
#[derive(Debug, Clone)]
struct Layout {
    first: Vec<usize>,
    answers: Vec<(usize, usize)>,
    values: usize,
}

impl Layout {
    fn of(dataset: &PreparedDataset) -> Result<Self, TrainError> {
        let (mut first, mut answers, mut values) = (Vec::with_capacity(dataset.len() + 1), Vec::new(), 0);
        for g in 0..dataset.len() {
            first.push(answers.len());
            for len in dataset.response_lengths(g)? {
                answers.push((values, len));
                values += len;
            }
        }
        first.push(answers.len());
        Ok(Self { first, answers, values })
    }
}

/// Why an existing cache cannot be used.
enum Stale {
    Missing,
    Changed(String),
    Damaged(String),
}

/// A read-only memory map of `path` (`None` for an empty file).
fn map_file(path: &Path) -> Result<Option<Mmap>, TrainError> {
    checksum::map_file(path).map_err(io(path))
}

/// The hash of the contents of `files`, in order, each hashed in parallel chunks.
fn hash_files(files: &[PathBuf]) -> Result<String, TrainError> {
    let hashes = files.iter().map(|f| checksum::hash_file(f).map_err(io(f))).collect::<Result<Vec<_>, _>>()?;
    Ok(checksum::combine(&hashes))
}

impl Key {
    fn of(prepared_dir: &Path, reference: &Path, dtype: DType) -> Result<Self, TrainError> {
        let mut weights = model::load::weight_files(reference)?;
        weights.sort();
        weights.insert(0, reference.join("config.json"));
        let data = vec![prepared_dir.join("manifest.json")];
        let started = std::time::Instant::now();
        let key = Self {
            reference_sha256: hash_files(&weights)?,
            data_sha256: hash_files(&data)?,
            dtype: format!("{dtype:?}"),
        };
        tracing::debug!(
            "hashed {} and its prepared data in {:.1} s",
            reference.display(),
            started.elapsed().as_secs_f64()
        );
        Ok(key)
    }

    /// The name of the shared entry of these values over data of `fingerprint` ([`super::refshare`]): the
    /// data by its contents, so that another prepared folder of the same data finds it.
    fn shared_id(&self, fingerprint: &str) -> String {
        let what = format!("{FORMAT}\n{}\n{fingerprint}\n{}", self.reference_sha256, self.dtype);
        hash_bytes(what.as_bytes()).chars().take(32).collect()
    }

    /// Why `m` was computed for another key (`None`: the same).
    fn differs(&self, m: &Manifest) -> Option<String> {
        let mut why = Vec::new();
        if m.reference_sha256 != self.reference_sha256 {
            why.push("the reference weights changed".to_string());
        }
        if m.data_sha256 != self.data_sha256 {
            why.push("the prepared data changed".into());
        }
        if m.dtype != self.dtype {
            why.push(format!("dtype {} -> {}", m.dtype, self.dtype));
        }
        (!why.is_empty()).then(|| why.join(", "))
    }
}

/// The memory-mapped reference log-probs of a prepared folder.
pub struct ReferenceCache {
    path: PathBuf,
    map: Option<Mmap>,
    layout: Layout,
}

impl std::fmt::Debug for ReferenceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReferenceCache").field("path", &self.path).field("values", &self.layout.values).finish()
    }
}

/// The values of the cache in `dir` when it holds those of `key` for `layout`, intact (mapped once: the
/// bytes checked are the bytes used).
fn check(dir: &Path, key: &Key, layout: &Layout) -> Result<Option<Mmap>, Stale> {
    let (mpath, vpath) = (dir.join(MANIFEST_FILE), dir.join(VALUES_FILE));
    let Ok(text) = std::fs::read_to_string(&mpath) else { return Err(Stale::Missing) };
    let m: Manifest = serde_json::from_str(&text)
        .map_err(|e| Stale::Damaged(format!("{}: unreadable manifest: {e}", mpath.display())))?;
    if m.format != FORMAT {
        return Err(Stale::Changed(format!("format {} -> {FORMAT}", m.format)));
    }
    if let Some(why) = key.differs(&m) {
        return Err(Stale::Changed(why));
    }
    let damaged = |what: String| Stale::Damaged(format!("{}: {what}", vpath.display()));
    if m.values != layout.values as u64 || m.responses != layout.answers.len() as u64 {
        return Err(damaged(format!(
            "the manifest counts {} values of {} answers, the prepared data has {} of {}",
            m.values,
            m.responses,
            layout.values,
            layout.answers.len()
        )));
    }
    let map = map_file(&vpath).map_err(|e| damaged(e.to_string()))?;
    let bytes = map.as_deref().unwrap_or(&[]);
    if bytes.len() != layout.values * 4 {
        return Err(damaged(format!(
            "{} bytes, expected {} ({} f32 values)",
            bytes.len(),
            layout.values * 4,
            layout.values
        )));
    }
    if hash_bytes(bytes) != m.values_sha256 {
        return Err(damaged("contents do not match the SHA-256 in the manifest".into()));
    }
    Ok(map)
}

/// Take the shared cache `entry` into `dir` for `key` when it holds values of the same reference and
/// dtype (its data is the same by the entry's name), and check them as a cache of `dir`'s own.
fn take_shared(entry: &Path, dir: &Path, key: &Key, layout: &Layout) -> bool {
    let Some(text) = super::refshare::take(entry, dir, VALUES_FILE, MANIFEST_FILE) else { return false };
    let Ok(mut m) = serde_json::from_str::<Manifest>(&text) else { return false };
    if (m.format.as_str(), &m.reference_sha256, &m.dtype) != (FORMAT, &key.reference_sha256, &key.dtype) {
        return false;
    }
    // The entry's data is this folder's (the entry is named by its contents), whatever its manifest's hash.
    m.data_sha256 = key.data_sha256.clone();
    let mpath = dir.join(MANIFEST_FILE);
    let text = serde_json::to_string_pretty(&m).unwrap_or_default();
    if let Err(e) = crate::fsio::write_atomic(&mpath, text.as_bytes()) {
        tracing::warn!("{}: {e}", mpath.display());
        return false;
    }
    match check(dir, key, layout) {
        Ok(_) => {
            tracing::info!("reference log-probs taken from {}, computed by an earlier run", entry.display());
            true
        }
        Err(_) => {
            tracing::warn!("the shared reference log-probs in {} are damaged: computing them", entry.display());
            let _ = std::fs::remove_file(&mpath);
            false
        }
    }
}

/// Log why the cache in `path` is computed.
fn say_why(path: &Path, stale: &Stale) {
    match stale {
        Stale::Missing => tracing::info!("computing the reference log-probs into {}", path.display()),
        Stale::Changed(why) => tracing::info!("recomputing the reference log-probs in {}: {why}", path.display()),
        Stale::Damaged(why) => tracing::warn!("damaged reference log-prob cache ({why}): recomputing it"),
    }
}

/// Remove the temporary files that killed computations left in `dir`, the values' and the manifest's alike
/// (every atomic write's temporary name, [`crate::fsio::leftover`]; the version's own files are written once,
/// before it is renamed into place, so under the cache's lock nothing else writes there).
fn remove_temp_values(dir: &Path) {
    for (p, outcome) in crate::fsio::remove_unfinished(dir, |_| true) {
        match outcome {
            Ok(()) => tracing::warn!("removed {} (left by an interrupted run)", p.display()),
            Err(err) => tracing::warn!("cannot remove {}: {err}", p.display()),
        }
    }
}

/// [`remove_temp_values`] beside a fresh cache, when no other process holds the cache's lock (one that
/// does may be writing its temporary files); otherwise they wait for a later run.
fn remove_temp_values_if_unlocked(dir: &Path, lock_path: &Path) {
    let Ok(file) = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(lock_path)
    else {
        return;
    };
    if file.try_lock().is_ok() {
        remove_temp_values(dir);
    }
    drop(file);
}

/// The reference's log-prob of each answer token of `seqs` (prompt, answer), in order.
fn score(model: &Decoder, seqs: &[(Arc<Vec<u32>>, Vec<u32>)]) -> Result<Vec<f32>, TrainError> {
    let full: Vec<Vec<u32>> = seqs.iter().map(|(p, r)| [p.as_slice(), r].concat()).collect();
    let mut targets = Targets::default();
    for (row, (p, r)) in seqs.iter().enumerate() {
        (0..r.len()).for_each(|j| targets.push(row, p.len() + j));
    }
    if targets.is_empty() {
        return Ok(Vec::new());
    }
    let lp = model.token_logprobs(&TokenBatch::padded(&full, 0), &targets, false)?;
    Ok(lp.narrow(1, 0, 1)?.squeeze(1)?.to_vec1::<f32>()?)
}

/// Groups each rank scores per round of the shared pass.
fn groups_per_round(batch: usize) -> usize {
    batch.max(1)
}

/// Score `world`'s rank's share of the answers of `dataset` with `model`, `batch` sequences per forward,
/// writing each group's values where `layout` puts them in `file` (the values file being written, at
/// `path`). The groups go in rounds: in round k rank r scores the [`groups_per_round`] groups from
/// (k N + r) G, and the ranks agree at the end of each round whether a stop was requested, so that they
/// stop together. Returns the answers this rank scored.
#[allow(clippy::too_many_arguments)]
fn score_share(
    model: &Decoder,
    dataset: &PreparedDataset,
    layout: &Layout,
    batch: usize,
    file: &std::fs::File,
    path: &Path,
    world: &World,
    stop: Option<&AtomicBool>,
) -> Result<usize, TrainError> {
    use std::os::unix::fs::FileExt;
    let (n, rank, per) = (world.size(), world.rank(), groups_per_round(batch));
    let mine = |round: usize| {
        let lo = (round * n + rank) * per;
        lo.min(dataset.len())..(lo + per).min(dataset.len())
    };
    let rounds = dataset.len().div_ceil(n * per);
    let total: usize = (0..rounds).map(&mine).map(|r| layout.first[r.end] - layout.first[r.start]).sum();
    let bar = crate::progress::progress_bar(Some(total as u64), "reference log-probs");
    if !world.is_primary() {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let stopped = || stop.is_some_and(|s| s.load(Ordering::SeqCst));
    for round in 0..rounds {
        if world.any(stopped()) {
            let what = format!("while computing the reference log-probs into {}", path.display());
            return Err(TrainError::Interrupted(what));
        }
        let groups = mine(round);
        if groups.is_empty() {
            continue;
        }
        let mut seqs: Vec<(Arc<Vec<u32>>, Vec<u32>)> = Vec::new();
        for g in groups.clone() {
            let group = dataset.group(g)?;
            let prompt = Arc::new(group.prompt_tokens);
            seqs.extend(group.responses.into_iter().map(|r| (prompt.clone(), r.tokens)));
        }
        let mut values = Vec::new();
        for chunk in seqs.chunks(batch.max(1)) {
            values.extend(score(model, chunk)?);
        }
        let (first, end) = (layout.first[groups.start], layout.first[groups.end]);
        let start = layout.answers.get(first).map_or(layout.values, |a| a.0);
        let expected = layout.answers[first..end].iter().map(|a| a.1).sum::<usize>();
        if values.len() != expected {
            let message =
                format!("groups {groups:?}: {} values computed, the prepared data has {expected}", values.len());
            return Err(TrainError::ReferenceCache { path: path.to_path_buf(), message });
        }
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        file.write_all_at(&bytes, start as u64 * 4).map_err(io(path))?;
        bar.inc((end - first) as u64);
    }
    bar.finish_and_clear();
    Ok(total)
}

impl ReferenceCache {
    /// The cache of `dataset` (in its prepared version's folder) under the reference model in folder
    /// `reference`: opened when its key matches and its values are intact, else computed (progress bar) and
    /// written atomically first, by one process at a time (a second waits, then uses the first's result).
    /// `stop` ends a computation within a batch ([`TrainError::Interrupted`]). Returns the cache and
    /// whether it was computed.
    pub fn ensure(
        dataset: &PreparedDataset,
        reference: &Path,
        opts: &ComputeOptions,
        stop: Option<&AtomicBool>,
        world: &World,
    ) -> Result<(Self, bool), TrainError> {
        let dir = dataset.dir();
        let key = Key::of(dir, reference, opts.dtype)?;
        let layout = Layout::of(dataset)?;
        let path = dir.join(VALUES_FILE);
        let fresh = check(dir, &key, &layout).ok();
        let lock_path = dir.join(crate::data::versions::REFERENCE_LOCK);
        if !world.any(fresh.is_none()) {
            tracing::info!("reference log-probs in {} are up to date", path.display());
            if world.is_primary() {
                remove_temp_values_if_unlocked(dir, &lock_path);
            }
            return Ok((Self { path, map: fresh.flatten(), layout }, false));
        }
        // Rank 0 holds the lock for the ranks (other runs, `grpo data prepare --reference`, wait on it) and
        // checks again under it; the other ranks wait in rounds, with no bound, and a stop request on any rank
        // ends the wait on every rank.
        let what = format!("computing the reference log-probs in {}", dir.display());
        let mut apart = crate::dist::Apart::begin(world, stop);
        let lock = world
            .is_primary()
            .then(|| crate::data::versions::lock_exclusive_polling(&lock_path, &what, || apart.tick()));
        if apart.finish() {
            return Err(TrainError::Interrupted(format!("while waiting for another process {what}")));
        }
        let _lock = lock.transpose()?;
        let shared = super::refshare::entry(&key.shared_id(dataset.fingerprint()));
        let done_elsewhere = world.is_primary() && {
            remove_temp_values(dir);
            match check(dir, &key, &layout) {
                Ok(_) => {
                    tracing::info!("reference log-probs in {} were computed by another process", path.display());
                    true
                }
                Err(_) if shared.as_deref().is_some_and(|e| take_shared(e, dir, &key, &layout)) => true,
                Err(stale) => {
                    say_why(&path, &stale);
                    false
                }
            }
        };
        let done_elsewhere = world.any(done_elsewhere);
        if !done_elsewhere {
            compute(dataset, reference, opts, &key, &layout, stop, world)?;
            if let Some(e) = shared.filter(|_| world.is_primary()) {
                super::refshare::keep(dir, &e, &[VALUES_FILE, MANIFEST_FILE]);
            }
        }
        let map = check(dir, &key, &layout).map_err(|_| TrainError::ReferenceCache {
            path: path.clone(),
            message: "changed while being written".into(),
        })?;
        Ok((Self { path, map, layout }, !done_elsewhere))
    }

    /// The values file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// For each group, for each of its answers, the reference's log-prob of each answer token as prepared.
    pub fn logprobs(&self, groups: &[Group]) -> Result<Vec<Vec<Vec<f32>>>, TrainError> {
        let bytes = self.map.as_deref().unwrap_or(&[]);
        let bad = |message: String| TrainError::ReferenceCache { path: self.path.clone(), message };
        groups
            .iter()
            .map(|g| {
                let (Some(&a), Some(&b)) = (self.layout.first.get(g.index), self.layout.first.get(g.index + 1)) else {
                    return Err(bad(format!("no group {} in the cache", g.index)));
                };
                if b - a != g.responses.len() {
                    return Err(bad(format!(
                        "group {}: {} answers cached, {} in the data",
                        g.index,
                        b - a,
                        g.responses.len()
                    )));
                }
                Ok(self.layout.answers[a..b]
                    .iter()
                    .map(|&(off, len)| {
                        bytes[off * 4..(off + len) * 4]
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect()
                    })
                    .collect())
            })
            .collect()
    }
}

/// Compute the values of `key` into the prepared folder, `world`'s ranks together (each its share of the
/// groups, [`score_share`]): rank 0 makes the temporary values file at its full size and names it to the
/// others, each rank writes its groups' values in place, and once every rank has written (and synced)
/// rank 0 hashes the file, moves it into place and writes the manifest last.
fn compute(
    dataset: &PreparedDataset,
    reference: &Path,
    opts: &ComputeOptions,
    key: &Key,
    layout: &Layout,
    stop: Option<&AtomicBool>,
    world: &World,
) -> Result<(), TrainError> {
    let dir = dataset.dir();
    let (vpath, mpath) = (dir.join(VALUES_FILE), dir.join(MANIFEST_FILE));
    let tmp = if world.is_primary() { Some(start_values(&vpath, &mpath, layout)?) } else { None };
    let name = tmp.as_ref().and_then(|t| t.path().file_name()).map(|n| n.to_string_lossy().into_owned());
    let name = String::from_utf8_lossy(&world.all_gather_bytes(name.unwrap_or_default().as_bytes())[0]).into_owned();
    let tpath = dir.join(&name);
    let file = match &tmp {
        Some(t) => t.as_file().try_clone().map_err(io(&tpath))?,
        None => std::fs::OpenOptions::new().write(true).open(&tpath).map_err(io(&tpath))?,
    };
    let mut model = model::load_decoder(reference, opts.dtype, &opts.device, false)?;
    model.options = DecoderOptions { checkpoint_layers: false, ..opts.decoder.clone() };
    let started = std::time::Instant::now();
    let answers = score_share(&model, dataset, layout, opts.batch, &file, &tpath, world, stop)?;
    file.sync_all().map_err(io(&tpath))?;
    if world.size() > 1 {
        tracing::info!("rank {}: reference log-probs of {answers} answers written", world.rank());
    }
    world.barrier();
    if let Some(tmp) = tmp {
        finish_values(tmp, &vpath, &mpath, reference, key, layout, dataset.len())?;
        tracing::info!(
            "reference log-probs of {} answers ({} tokens) written to {} in {:.1} s",
            layout.answers.len(),
            layout.values,
            vpath.display(),
            started.elapsed().as_secs_f64()
        );
    }
    world.barrier();
    Ok(())
}

/// Rank 0's start of a computation: the old manifest removed first (an interrupted computation never
/// leaves a manifest over other values), then a temporary values file of the full size.
fn start_values(vpath: &Path, mpath: &Path, layout: &Layout) -> Result<tempfile::NamedTempFile, TrainError> {
    if let Err(e) = std::fs::remove_file(mpath) {
        if e.kind() != std::io::ErrorKind::NotFound {
            return Err(io(mpath)(e));
        }
    }
    let tmp = crate::fsio::temp_file(vpath).map_err(io(vpath))?;
    tmp.as_file().set_len(layout.values as u64 * 4).map_err(io(tmp.path()))?;
    Ok(tmp)
}

/// Rank 0's end of a computation: the written values hashed, moved into place, and the manifest written.
fn finish_values(
    tmp: tempfile::NamedTempFile,
    vpath: &Path,
    mpath: &Path,
    reference: &Path,
    key: &Key,
    layout: &Layout,
    groups: usize,
) -> Result<(), TrainError> {
    let values_sha256 = checksum::hash_file(tmp.path()).map_err(io(vpath))?;
    crate::fsio::persist(tmp, vpath).map_err(io(vpath))?;
    let manifest = Manifest {
        format: FORMAT.into(),
        reference: reference.display().to_string(),
        reference_sha256: key.reference_sha256.clone(),
        data_sha256: key.data_sha256.clone(),
        dtype: key.dtype.clone(),
        groups: groups as u64,
        responses: layout.answers.len() as u64,
        values: layout.values as u64,
        values_sha256,
        created_by: format!("grpo {}", env!("CARGO_PKG_VERSION")),
    };
    let text = serde_json::to_string_pretty(&manifest).unwrap_or_default();
    crate::fsio::write_atomic(mpath, text.as_bytes()).map_err(io(mpath))
}

/// The frozen reference's folder: `model.reference`, else the policy's initial weights (`model_dir`).
pub fn reference_dir(cfg: &TrainConfig, model_dir: &Path) -> Result<PathBuf, TrainError> {
    match &cfg.model.reference {
        Some(p) => Ok(model::resolve_model_dir(p)?),
        None => Ok(model_dir.to_path_buf()),
    }
}

/// The reference cache of a run (computed when missing or stale, by `world`'s ranks together, with the
/// run's `decoder` options), or `None` when the run reads no reference or scores it on the fly
/// ([`reference_is_cacheable`]).
pub fn for_run(
    cfg: &TrainConfig,
    model_dir: &Path,
    dataset: &PreparedDataset,
    decoder: &DecoderOptions,
    stop: &AtomicBool,
    world: &World,
) -> Result<Option<ReferenceCache>, TrainError> {
    if !cfg.objective.build().needs_reference() || !reference_is_cacheable(cfg) {
        return Ok(None);
    }
    let opts = ComputeOptions {
        dtype: cfg.model.dtype.dtype(),
        device: model::open_device(cfg.model.device)?,
        batch: cfg.train.micro_batch_size,
        decoder: DecoderOptions { checkpoint_layers: false, ..decoder.clone() },
    };
    let (cache, _) = ReferenceCache::ensure(dataset, &reference_dir(cfg, model_dir)?, &opts, Some(stop), world)?;
    tracing::info!("reference log-probs from {}: no reference model loaded", cache.path().display());
    Ok(Some(cache))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{prepare, GroupOptions, InputOptions, PrepareOptions, SequenceOptions};
    use crate::model::tiny::{write_tiny_model, TinyShape, TinySpec};
    use crate::model::Arch;
    use crate::objective::{Anchor, OaplOptions, ObjectiveKind, PpoOptions};
    use crate::train::optim::OptimConfig;
    use crate::train::step::{Reference, StepContext, TrainStep};

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    fn tiny(dir: &Path, seed: u64) {
        let shape = TinyShape { layers: 1, hidden: 32, heads: 4, kv_heads: 2, intermediate: 64 };
        let tokenizer = root().join("data/tokenizers/smollm2");
        write_tiny_model(&TinySpec { arch: Arch::Qwen2, tokenizer, shape, seed }, dir).unwrap();
    }

    /// 4 questions of the bundled data, 4 answers each cut to `max_response` tokens, prepared in `out`.
    fn prepared(model: &Path, out: &Path, max_response: usize) -> PreparedDataset {
        let data = root().join("data/trajectories/ot3_math_x8_dev.jsonl").display().to_string();
        let group = GroupOptions { group_size: 4, max_questions: 4, ..Default::default() };
        let opts = PrepareOptions {
            input: InputOptions { inputs: vec![data], group, ..Default::default() },
            sequence: SequenceOptions { max_response_tokens: max_response, ..Default::default() },
            model: model.to_path_buf(),
            out: out.to_path_buf(),
            ..Default::default()
        };
        prepare(&opts).unwrap();
        PreparedDataset::open(out).unwrap()
    }

    fn opts(batch: usize) -> ComputeOptions {
        ComputeOptions { dtype: DType::F32, device: Device::Cpu, batch, decoder: DecoderOptions::default() }
    }

    fn all_groups(ds: &PreparedDataset) -> Vec<Group> {
        (0..ds.len()).map(|i| ds.group(i).unwrap()).collect()
    }

    /// A training step of `objective` with the cache (scored one answer per forward) and with the reference
    /// model run on each micro-batch of one sequence: the same forward, so the loss, KL, gradient norm and
    /// updated weights are bitwise equal, over two steps on groups taken out of order.
    #[test]
    fn a_step_from_the_cache_equals_a_step_with_the_reference_model() {
        let dir = tempfile::tempdir().unwrap();
        let (m, r, p) = (dir.path().join("policy"), dir.path().join("reference"), dir.path().join("prepared"));
        tiny(&m, 3);
        tiny(&r, 5);
        let ds = prepared(&m, &p, 24);
        let (cache, computed) = ReferenceCache::ensure(&ds, &r, &opts(1), None, &World::single()).unwrap();
        assert!(computed && ds.len() == 4);
        let reference = model::load_decoder(&r, DType::F32, &Device::Cpu, false).unwrap();
        let groups = all_groups(&ds);
        let steps = [vec![groups[2].clone(), groups[0].clone()], vec![groups[3].clone(), groups[1].clone()]];
        let objectives = [
            ObjectiveKind::OffGrpo(PpoOptions { beta: 0.1, bias: 0.5, ..Default::default() }).into(),
            ObjectiveKind::Oapl(OaplOptions { anchor: Some(Anchor::Reference), ..Default::default() }).into(),
        ];
        let optim = OptimConfig { lr: 1e-2, ..Default::default() };
        for oc in objectives {
            let a = model::load_decoder(&m, DType::F32, &Device::Cpu, true).unwrap();
            let b = model::load_decoder(&m, DType::F32, &Device::Cpu, true).unwrap();
            let mut sa = TrainStep::new(&oc, &optim, &a, 1, 24, 0).unwrap();
            let mut sb = TrainStep::new(&oc, &optim, &b, 1, 24, 0).unwrap();
            for (i, groups) in steps.iter().enumerate() {
                let ctx = StepContext { seed: 1, epoch: 0, step: i };
                let lp = cache.logprobs(groups).unwrap();
                let ra = sa.run_with(&a, Reference::Logprobs(&lp), groups, 1e-2, ctx).unwrap();
                let rb = sb.run_at(&b, Some(&reference), groups, 1e-2, ctx).unwrap();
                assert!(ra.applied && ra.stats.loss != 0.0, "{oc:?}: {ra:?}");
                assert_eq!((ra.stats.loss, ra.stats.kl, ra.grad_norm), (rb.stats.loss, rb.stats.kl, rb.grad_norm));
            }
            let (wa, wb) = (a.named_tensors(), b.named_tensors());
            for ((n, x), (_, y)) in wa.iter().zip(&wb) {
                let (x, y) = (
                    x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                assert_eq!(x, y, "{n} differs after two steps ({oc:?})");
            }
        }
    }

    #[test]
    fn a_changed_reference_data_or_dtype_recomputes_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let (m, r, p) = (dir.path().join("policy"), dir.path().join("reference"), dir.path().join("prepared"));
        tiny(&m, 3);
        tiny(&r, 5);
        let ds = prepared(&m, &p, 24);
        let first = |c: &ReferenceCache, ds: &PreparedDataset| c.logprobs(&all_groups(ds)).unwrap();
        let (c, computed) = ReferenceCache::ensure(&ds, &r, &opts(3), None, &World::single()).unwrap();
        assert!(computed);
        let before = first(&c, &ds);
        // Batched (3 per forward) or one at a time: the same values up to rounding.
        let manifest = std::fs::read_to_string(ds.dir().join(MANIFEST_FILE)).unwrap();
        let (c, computed) = ReferenceCache::ensure(&ds, &r, &opts(1), None, &World::single()).unwrap();
        assert!(!computed, "an up-to-date cache was recomputed");
        assert_eq!(std::fs::read_to_string(ds.dir().join(MANIFEST_FILE)).unwrap(), manifest);
        assert_eq!(first(&c, &ds), before);
        drop(c);
        // Other reference weights (same folder, same config).
        tiny(&r, 6);
        let (c, computed) = ReferenceCache::ensure(&ds, &r, &opts(3), None, &World::single()).unwrap();
        assert!(computed, "new reference weights did not recompute the cache");
        let other = first(&c, &ds);
        assert_ne!(other, before);
        for (a, b) in other.iter().flatten().zip(before.iter().flatten()) {
            assert_eq!(a.len(), b.len());
        }
        drop(c);
        // Other data: answers cut at 12 tokens instead of 24.
        let ds = prepared(&m, &p, 12);
        let (c, computed) = ReferenceCache::ensure(&ds, &r, &opts(3), None, &World::single()).unwrap();
        assert!(computed, "new data did not recompute the cache");
        let cut = first(&c, &ds);
        assert!(cut.iter().flatten().all(|a| a.len() <= 12) && cut.iter().flatten().any(|a| a.len() == 12));
        // The first tokens' log-probs do not depend on where the answer is cut.
        let (x, y) = (&cut[0][0], &other[0][0]);
        assert!(x.iter().zip(y).all(|(a, b)| (a - b).abs() < 1e-5), "{x:?} vs {y:?}");
        drop(c);
        // Another dtype.
        let bf16 = ComputeOptions { dtype: DType::BF16, ..opts(3) };
        assert!(ReferenceCache::ensure(&ds, &r, &bf16, None, &World::single()).unwrap().1);
        assert!(!ReferenceCache::ensure(&ds, &r, &bf16, None, &World::single()).unwrap().1);
    }

    #[test]
    fn a_damaged_cache_is_named_and_recomputed() {
        let dir = tempfile::tempdir().unwrap();
        let (m, p) = (dir.path().join("policy"), dir.path().join("prepared"));
        tiny(&m, 3);
        let ds = prepared(&m, &p, 16);
        let (c, _) = ReferenceCache::ensure(&ds, &m, &opts(4), None, &World::single()).unwrap();
        let good = c.logprobs(&all_groups(&ds)).unwrap();
        drop(c);
        let key = Key::of(ds.dir(), &m, DType::F32).unwrap();
        let layout = Layout::of(&ds).unwrap();
        let vpath = ds.dir().join(VALUES_FILE);
        let bytes = std::fs::read(&vpath).unwrap();
        let damaged = |expect: &str| match check(ds.dir(), &key, &layout) {
            Err(Stale::Damaged(m)) => assert!(m.contains(&ds.dir().display().to_string()) && m.contains(expect), "{m}"),
            _ => panic!("damage not detected ({expect})"),
        };
        // Truncated.
        std::fs::write(&vpath, &bytes[..bytes.len() - 4]).unwrap();
        damaged(&format!("{}: {} bytes", vpath.display(), bytes.len() - 4));
        // Same size, other contents.
        let mut flipped = bytes.clone();
        flipped[10] ^= 0x40;
        std::fs::write(&vpath, &flipped).unwrap();
        damaged("SHA-256");
        let (c, computed) = ReferenceCache::ensure(&ds, &m, &opts(4), None, &World::single()).unwrap();
        assert!(computed);
        assert_eq!(c.logprobs(&all_groups(&ds)).unwrap(), good);
        // An unreadable manifest.
        std::fs::write(ds.dir().join(MANIFEST_FILE), "{ not json").unwrap();
        damaged(MANIFEST_FILE);
        assert!(ReferenceCache::ensure(&ds, &m, &opts(4), None, &World::single()).unwrap().1);
        // A group the cache does not have is an error naming the file.
        let mut g = ds.group(0).unwrap();
        g.index = 99;
        let e = c.logprobs(&[g]).unwrap_err().to_string();
        assert!(e.contains(&vpath.display().to_string()) && e.contains("no group 99"), "{e}");
    }

    #[test]
    fn a_stop_request_ends_the_pass_and_a_later_run_recomputes_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let (m, p) = (dir.path().join("policy"), dir.path().join("prepared"));
        tiny(&m, 3);
        let ds = prepared(&m, &p, 16);
        // What a killed computation leaves.
        let leftover = ds.dir().join(format!(".{VALUES_FILE}.abc123.tmp"));
        std::fs::write(&leftover, [0u8; 64]).unwrap();
        let manifest_leftover = ds.dir().join(format!(".{MANIFEST_FILE}.def456.tmp"));
        std::fs::write(&manifest_leftover, b"{").unwrap();
        let stop = AtomicBool::new(true);
        let err = ReferenceCache::ensure(&ds, &m, &opts(4), Some(&stop), &World::single()).unwrap_err();
        assert!(matches!(err, TrainError::Interrupted(_)), "{err}");
        assert!(!ds.dir().join(MANIFEST_FILE).exists(), "an interrupted pass left a manifest");
        let (c, computed) = ReferenceCache::ensure(&ds, &m, &opts(4), None, &World::single()).unwrap();
        assert!(computed && c.logprobs(&all_groups(&ds)).is_ok());
        assert!(!leftover.exists(), "the leftover of a killed computation was not removed");
        assert!(!manifest_leftover.exists(), "the manifest's leftover of a killed computation was not removed");
        let tmp: Vec<_> = std::fs::read_dir(ds.dir())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(tmp.is_empty(), "{tmp:?}");
    }

    /// Two ranks while another process (here the test) holds the version's reference lock: rank 0 waits for
    /// it, rank 1 waits with it in rounds; a stop request on rank 1 ends the wait on both ranks, though the
    /// lock is never released.
    #[test]
    fn a_stop_request_on_any_rank_ends_every_ranks_wait_for_the_reference_lock() {
        // Rounds every 250 ms (a quarter of the timeout; only worlds of several ranks have rounds).
        std::env::set_var("GRPO_DIST_TIMEOUT_S", "1");
        let dir = tempfile::tempdir().unwrap();
        let (m, p) = (dir.path().join("policy"), dir.path().join("prepared"));
        tiny(&m, 3);
        let version = prepared(&m, &p, 16).dir().to_path_buf();
        let lock = version.join(crate::data::versions::REFERENCE_LOCK);
        let _held = crate::data::versions::lock_exclusive(&lock, "holding it", None).unwrap();
        let (done, results) = std::sync::mpsc::channel();
        for (rank, stop) in crate::dist::threads::ranks(2).into_iter().zip([false, true]) {
            let (done, m, p) = (done.clone(), m.clone(), p.clone());
            std::thread::spawn(move || {
                let ds = PreparedDataset::open(&p).unwrap();
                let stop = AtomicBool::new(stop);
                let outcome = ReferenceCache::ensure(&ds, &m, &opts(4), Some(&stop), &rank.world());
                let _ = done.send(outcome.map(|_| ()).map_err(|e| e.to_string()));
            });
        }
        for _ in 0..2 {
            let outcome = results.recv_timeout(std::time::Duration::from_secs(30)).expect("a rank still waits");
            let e = outcome.unwrap_err();
            assert!(e.contains("while waiting for another process computing the reference log-probs"), "{e}");
        }
    }

    #[test]
    fn the_key_covers_the_token_data_and_the_groups() {
        let dir = tempfile::tempdir().unwrap();
        let (m, p) = (dir.path().join("policy"), dir.path().join("prepared"));
        tiny(&m, 3);
        let ds = prepared(&m, &p, 16);
        let key = Key::of(ds.dir(), &m, DType::F32).unwrap();
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(ds.dir().join("manifest.json")).unwrap()).unwrap();
        let sums = manifest["checksums"].as_object().unwrap();
        assert!(sums.contains_key("groups.jsonl") && sums.contains_key("tokens-00000.u32"), "{sums:?}");
        // Another preparation of other answers: another manifest, another key.
        drop(ds);
        let ds = prepared(&m, &p, 12);
        assert_ne!(Key::of(ds.dir(), &m, DType::F32).unwrap().data_sha256, key.data_sha256);
    }
}
