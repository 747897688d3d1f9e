//! `prepare`: teacher rows -> labelled groups -> tokenised shards the trainer memory-maps
//! (format in [`super::shards`]), plus `stats.json` and a manifest that makes a re-run with the same
//! inputs, tokenizer and options a no-op and notices a changed input.
//!
//! Two passes over the inputs: the streaming [`super::group::scan_with`] (token lengths, answers, groups,
//! labels; bounded memory) and a second pass that tokenises only the chosen rows, in parallel.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use super::group::{prompt_tokens, scan_with, GroupOptions, InputOptions, Limits, Measure, ScannedGroup};
use super::reader::{resolve_inputs, scan_file, BadRow, ReadOptions};
use super::shards::{GroupMeta, ShardWriter, FORMAT};
use super::stats::{LengthHistogram, Stats};
use super::versions;
use super::{io_err, question_hash, question_id, DataError};
use crate::jsonl::AtomicFile;
use crate::model::tokenizer::ChatTokenizer;
use crate::reward::ExtractOptions;

/// What to do with a response longer than the response-token limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Overlong {
    /// Keep its first tokens (marked truncated, no EOS).
    Truncate,
    /// Leave the response out of its group.
    Drop,
}

/// How a group's question and answers become token sequences: the `[data]` keys of the train config and
/// flags of `grpo data prepare`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct SequenceOptions {
    /// Groups whose rendered prompt has more tokens are dropped (0: no limit).
    #[arg(long, default_value_t = 2048)]
    pub max_prompt_tokens: usize,
    /// Responses with more tokens (EOS included) are truncated or dropped, see --overlong (0: no limit).
    #[arg(long, default_value_t = 16384)]
    pub max_response_tokens: usize,
    /// What to do with over-long responses.
    #[arg(long, value_enum, default_value_t = Overlong::Truncate)]
    pub overlong: Overlong,
    /// System prompt rendered before the question.
    #[arg(long)]
    pub system_prompt: Option<String>,
}

impl Default for SequenceOptions {
    fn default() -> Self {
        Self { max_prompt_tokens: 2048, max_response_tokens: 16384, overlong: Overlong::Truncate, system_prompt: None }
    }
}

/// Options of [`prepare`].
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    pub input: InputOptions,
    pub sequence: SequenceOptions,
    /// Model or tokenizer folder (tokenizer.json + tokenizer_config.json with the chat template).
    pub model: PathBuf,
    pub out: PathBuf,
    /// Prepare again even when the manifest says it is up to date.
    pub force: bool,
    /// Tokens per token shard before a new one is started.
    pub shard_tokens: u64,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        Self {
            input: InputOptions::default(),
            sequence: SequenceOptions::default(),
            model: PathBuf::new(),
            out: PathBuf::new(),
            force: false,
            shard_tokens: 1 << 28,
        }
    }
}

/// What [`prepare`] did.
#[derive(Debug, Clone)]
pub struct PrepareOutcome {
    /// The folder of the prepared version (inside the output folder, see [`super::versions`]).
    pub out: PathBuf,
    /// True when the folder was already up to date and nothing was done.
    pub skipped: bool,
    /// Why it was (re)prepared: changed inputs, options or tokenizer ("new" for a fresh folder).
    pub reasons: Vec<String>,
    pub stats: Stats,
    pub groups: u64,
    pub responses: u64,
    pub tokens: u64,
}

/// One input as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct InputInfo {
    path: String,
    size: u64,
    modified_ns: u128,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Manifest {
    format: String,
    groups: u64,
    responses: u64,
    tokens: u64,
    token_shards: Vec<String>,
    inputs: Vec<InputInfo>,
    tokenizer: String,
    tokenizer_fingerprint: String,
    eos_id: u32,
    /// The options that change the output (inputs, output folder, `force` and the seed excluded).
    options: serde_json::Value,
    /// The seed, where it changed the output (a question had more answers than the group size, or a
    /// sample of questions was drawn); None where any seed gives the same version.
    #[serde(default)]
    seed: Option<u64>,
    created_by: String,
    /// The [`crate::checksum`] of each file of the version, checked when it is opened.
    #[serde(default)]
    checksums: BTreeMap<String, String>,
}

fn input_info(p: &Path) -> Result<InputInfo, DataError> {
    let m = std::fs::metadata(p).map_err(io_err(p))?;
    let modified_ns =
        m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_nanos()).unwrap_or(0);
    // A hub dataset's file keeps its snapshot path, which names the commit: a new commit prepares again.
    let path = if crate::hub::cache::is_snapshot_file(p) {
        p.to_string_lossy().into_owned()
    } else {
        std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()).to_string_lossy().into_owned()
    };
    Ok(InputInfo { path, size: m.len(), modified_ns })
}

/// The options that change the output (inputs, output folder and `force` excluded), as the manifest
/// records them; the seed apart ([`Manifest::seed`]), as it changes the output only where it chooses.
#[derive(Debug, Serialize)]
struct OutputOptions<'a> {
    group: &'a GroupOptions,
    extract: &'a ExtractOptions,
    read: &'a ReadOptions,
    strict: bool,
    sequence: &'a SequenceOptions,
    shard_tokens: u64,
}

fn output_options(o: &PrepareOptions) -> serde_json::Value {
    let g = &o.input.group;
    let opts = OutputOptions {
        group: g,
        extract: &g.extract,
        read: &o.input.read,
        strict: o.input.strict,
        sequence: &o.sequence,
        shard_tokens: o.shard_tokens,
    };
    serde_json::to_value(&opts).unwrap_or_default()
}

/// Why an existing manifest does not match (empty: up to date).
fn differences(old: &Manifest, new: &Manifest) -> Vec<String> {
    let mut why = Vec::new();
    if old.format != new.format {
        why.push(format!("format {} -> {}", old.format, new.format));
    }
    let old_in: BTreeMap<&str, &InputInfo> = old.inputs.iter().map(|i| (i.path.as_str(), i)).collect();
    let new_in: BTreeMap<&str, &InputInfo> = new.inputs.iter().map(|i| (i.path.as_str(), i)).collect();
    for (p, i) in &new_in {
        match old_in.get(p) {
            None => why.push(format!("new input {p}")),
            Some(o) if o != i => why.push(format!("input {p} changed (size {} -> {}, modified)", o.size, i.size)),
            _ => {}
        }
    }
    for p in old_in.keys().filter(|p| !new_in.contains_key(*p)) {
        why.push(format!("input {p} removed"));
    }
    if old.tokenizer_fingerprint != new.tokenizer_fingerprint {
        why.push("tokenizer changed".into());
    }
    if old.options != new.options {
        why.push("options changed".into());
    }
    // A seed that chose answers or questions keys the version; one that chose nothing does not.
    if let (Some(old_seed), Some(new_seed)) = (old.seed, new.seed) {
        if old_seed != new_seed {
            why.push(format!("seed {old_seed} -> {new_seed} (it chose answers or questions)"));
        }
    }
    why
}

/// One chosen row: where it goes.
#[derive(Clone, Copy)]
struct Selection {
    ordinal: u64,
    qhash: u64,
    group: u64,
    response: u64,
    prompt: bool,
}

impl Selection {
    const SIZE: usize = 33;
    fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        let mut b = [0u8; Self::SIZE];
        b[0..8].copy_from_slice(&self.ordinal.to_le_bytes());
        b[8..16].copy_from_slice(&self.qhash.to_le_bytes());
        b[16..24].copy_from_slice(&self.group.to_le_bytes());
        b[24..32].copy_from_slice(&self.response.to_le_bytes());
        b[32] = self.prompt as u8;
        w.write_all(&b)
    }
    fn read_all(path: &Path) -> Result<Vec<Self>, DataError> {
        let mut bytes = Vec::new();
        BufReader::new(File::open(path).map_err(io_err(path))?).read_to_end(&mut bytes).map_err(io_err(path))?;
        let u = |c: &[u8], i: usize| u64::from_le_bytes(c[i..i + 8].try_into().unwrap_or([0; 8]));
        Ok(bytes
            .chunks_exact(Self::SIZE)
            .map(|c| Selection {
                ordinal: u(c, 0),
                qhash: u(c, 8),
                group: u(c, 16),
                response: u(c, 24),
                prompt: c[32] != 0,
            })
            .collect())
    }
}

/// A tokenised chosen row (pass 2).
struct Tokenised {
    sel: Selection,
    prompt: Option<Vec<u32>>,
    response: Vec<u32>,
    truncated: bool,
    logprobs: Option<Vec<f32>>,
    logprobs_mismatched: bool,
}

/// Prepare `opts.input.inputs` into `opts.out` (see the module doc). Skips the work when `out` holds a
/// complete preparation of the same inputs (size, modification time), tokenizer and options.
pub fn prepare(opts: &PrepareOptions) -> Result<PrepareOutcome, DataError> {
    prepare_with(opts, &mut |bad| tracing::warn!("skipped {bad}"), None)
}

/// [`prepare`] with a callback for each bad row and a stop flag: set (by Ctrl-C or SIGTERM), preparation
/// stops within a row with [`DataError::Interrupted`], and the next one removes what it had written.
///
/// The output folder holds versions ([`super::versions`]): an up-to-date current version is re-used; else a
/// new version is written beside it under a temporary name, renamed into place and made current, so that a
/// reader of the previous version keeps reading it unchanged. One process prepares a folder at a time; a
/// second waits for it, then re-uses its result when its inputs and options are the same.
pub fn prepare_with(
    opts: &PrepareOptions,
    on_bad: &mut dyn FnMut(&BadRow),
    stop: Option<&AtomicBool>,
) -> Result<PrepareOutcome, DataError> {
    let files = resolve_inputs(&opts.input.inputs)?;
    let tok = ChatTokenizer::load(&opts.model)?;
    if !tok.has_template() {
        tracing::warn!("{} has no chat template: prompts are the bare question", opts.model.display());
    }
    let eos = *tok.eos_ids().first().ok_or_else(|| {
        DataError::Invalid(format!("{}: the tokenizer has no EOS token (eos_token)", opts.model.display()))
    })?;
    let out = &opts.out;
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    let mut manifest = Manifest {
        format: FORMAT.into(),
        groups: 0,
        responses: 0,
        tokens: 0,
        token_shards: vec![],
        inputs: files.iter().map(|p| input_info(p)).collect::<Result<_, _>>()?,
        tokenizer: opts.model.to_string_lossy().into_owned(),
        tokenizer_fingerprint: tok.fingerprint()?,
        eos_id: eos,
        options: output_options(opts),
        seed: Some(opts.input.group.seed),
        created_by: format!("grpo {}", env!("CARGO_PKG_VERSION")),
        checksums: BTreeMap::new(),
    };
    let _lock = versions::lock_preparation(out, stop)?;
    versions::remove_leftovers(out);
    let current = versions::current(out)?;
    let reasons = match check_manifest(current.as_deref().unwrap_or(out), &manifest, opts.force)? {
        Freshness::UpToDate(outcome) => {
            versions::remove_unused(out, current.as_deref().and_then(Path::file_name).and_then(|n| n.to_str()));
            return Ok(*outcome);
        }
        Freshness::Stale(reasons) => reasons,
    };
    if let Some(outcome) = reuse_earlier(out, current.as_deref(), &manifest, opts.force)? {
        return Ok(outcome);
    }
    let name = versions::new_version_name();
    let target = out.join(&name);
    let tmp = crate::fsio::temp_dir(&target).map_err(io_err(&target))?;
    let (stats, counts) = write_version(opts, &files, &tok, eos, tmp.path(), on_bad, stop)?;
    (manifest.groups, manifest.responses, manifest.tokens) = (counts.groups, counts.responses, counts.tokens);
    manifest.seed = manifest.seed.filter(|_| seed_chose(opts, &stats));
    manifest.token_shards = counts.shards.clone();
    let mut names: Vec<String> = ["stats.json", "groups.jsonl", "prompts.bin", "responses.bin", "logprobs.f32"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    names.extend(counts.shards);
    manifest.checksums = crate::checksum::hash_files(tmp.path(), &names)?;
    write_json(&tmp.path().join("manifest.json"), &manifest)?;
    super::shards::write_manifest_sum(tmp.path())?;
    versions::create_readers_lock(tmp.path())?;
    crate::fsio::persist_dir(tmp, &target).map_err(io_err(&target))?;
    versions::switch_to(out, &name)?;
    tracing::info!("prepared {} groups into {}", counts.groups, target.display());
    Ok(PrepareOutcome {
        out: target,
        skipped: false,
        reasons,
        stats,
        groups: counts.groups,
        responses: counts.responses,
        tokens: counts.tokens,
    })
}

/// Whether the seed chose anything in a preparation whose counts are `stats`: answers of a question that had
/// more than the group size, or a sample of questions.
fn seed_chose(opts: &PrepareOptions, stats: &Stats) -> bool {
    stats.responses_over_cap > 0 || opts.input.group.max_questions > 0
}

/// What a version holds.
struct Counts {
    groups: u64,
    responses: u64,
    tokens: u64,
    shards: Vec<String>,
}

/// Write a whole preparation into the (new, empty) folder `dir`: groups, token shards, stats.
fn write_version(
    opts: &PrepareOptions,
    files: &[PathBuf],
    tok: &ChatTokenizer,
    eos: u32,
    dir: &Path,
    on_bad: &mut dyn FnMut(&BadRow),
    stop: Option<&AtomicBool>,
) -> Result<(Stats, Counts), DataError> {
    let sel_dir = dir.join(".selection");
    std::fs::create_dir_all(&sel_dir).map_err(io_err(&sel_dir))?;
    let (mut stats, n_groups, n_responses) = choose_groups(opts, files, tok, (dir, &sel_dir), on_bad, stop)?;
    let writer = ShardWriter::create(dir, n_groups, n_responses, opts.shard_tokens)?;
    let pass = Pass2 { sel_dir: &sel_dir, n_responses, stop };
    let tokenised = tokenise_chosen(opts, files, tok, eos, writer, pass)?;
    let _ = std::fs::remove_dir_all(&sel_dir);
    if tokenised.prompts != n_groups || tokenised.responses != n_responses {
        return Err(DataError::Invalid(format!(
            "prepared {} of {n_groups} prompts and {} of {n_responses} responses: inputs changed during prepare?",
            tokenised.prompts, tokenised.responses
        )));
    }
    tokenised.add_to(&mut stats);
    write_json(&dir.join("stats.json"), &stats)?;
    let counts =
        Counts { groups: n_groups, responses: n_responses, tokens: tokenised.tokens, shards: tokenised.shards };
    Ok((stats, counts))
}

/// [`DataError::Interrupted`] when a stop was requested.
fn check_stop(stop: Option<&AtomicBool>, opts: &PrepareOptions) -> Result<(), DataError> {
    if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
        return Err(DataError::Interrupted(format!("while preparing {}", opts.out.display())));
    }
    Ok(())
}

/// Whether an output folder is up to date with its manifest.
enum Freshness {
    UpToDate(Box<PrepareOutcome>),
    /// Why it must be prepared (again).
    Stale(Vec<String>),
}

/// An earlier version of `out` (not `current`) up to date with `manifest`, made current again: what a
/// checkpoint's data was before an edit that was then undone, kept while that checkpoint was resumed
/// ([`super::shards::hold_fingerprint`]), with its reference log-prob cache. Newest first; none with `force`.
fn reuse_earlier(
    out: &Path,
    current: Option<&Path>,
    manifest: &Manifest,
    force: bool,
) -> Result<Option<PrepareOutcome>, DataError> {
    if force {
        return Ok(None);
    }
    for v in versions::versions(out).into_iter().rev().filter(|v| Some(v.as_path()) != current) {
        let Ok(Freshness::UpToDate(outcome)) = check_manifest(&v, manifest, false) else { continue };
        let Some(name) = v.file_name().and_then(|n| n.to_str()) else { continue };
        versions::switch_to(out, name)?;
        tracing::info!("{} is up to date with the inputs again: made current", v.display());
        return Ok(Some(*outcome));
    }
    Ok(None)
}

/// Compare the manifest of the prepared version in `dir` with `manifest` (the one this preparation would
/// write).
fn check_manifest(dir: &Path, manifest: &Manifest, force: bool) -> Result<Freshness, DataError> {
    let mpath = dir.join("manifest.json");
    let Ok(text) = std::fs::read_to_string(&mpath) else { return Ok(Freshness::Stale(vec!["new".into()])) };
    let mut reasons = vec![];
    match serde_json::from_str::<Manifest>(&text) {
        Ok(old) => {
            reasons = differences(&old, manifest);
            if reasons.is_empty() {
                // The same preparation, but damaged since (a changed file, a damaged manifest): prepare it again.
                if let Err(e) = super::shards::verify_version(dir) {
                    tracing::warn!("{} is damaged ({e}): preparing it again", dir.display());
                    reasons.push(format!("damaged ({e})"));
                }
            }
            if reasons.is_empty() && !force {
                let spath = dir.join("stats.json");
                let stats: Stats = std::fs::read_to_string(&spath)
                    .ok()
                    .and_then(|t| serde_json::from_str(&t).ok())
                    .ok_or_else(|| DataError::Format { path: spath, message: "missing or unreadable".into() })?;
                tracing::info!("{} is up to date with its inputs: nothing to do", dir.display());
                return Ok(Freshness::UpToDate(Box::new(PrepareOutcome {
                    out: dir.to_path_buf(),
                    skipped: true,
                    reasons,
                    stats,
                    groups: old.groups,
                    responses: old.responses,
                    tokens: old.tokens,
                })));
            }
            if force && reasons.is_empty() {
                reasons.push("--force".into());
            }
        }
        Err(_) => reasons.push("unreadable manifest".into()),
    }
    for r in &reasons {
        tracing::info!("re-preparing {}: {r}", dir.display());
    }
    Ok(Freshness::Stale(reasons))
}

/// Write `value` as pretty JSON to `path`, atomically.
fn write_json(path: &Path, value: &impl Serialize) -> Result<(), DataError> {
    let mut f = AtomicFile::create(Some(path)).map_err(io_err(path))?;
    serde_json::to_writer_pretty(&mut f, value).map_err(|e| io_err(path)(e.into()))?;
    f.commit().map_err(io_err(path))
}

fn selection_file(sel_dir: &Path, file: usize) -> PathBuf {
    sel_dir.join(format!("file-{file:05}.bin"))
}

/// Pass 1: group and label the rows, write `groups.jsonl` and, per input file, the chosen rows
/// ([`Selection`]s) into `sel_dir`. Returns the stats, the number of groups and of responses.
fn choose_groups(
    opts: &PrepareOptions,
    files: &[PathBuf],
    tok: &ChatTokenizer,
    (dir, sel_dir): (&Path, &Path),
    on_bad: &mut dyn FnMut(&BadRow),
    stop: Option<&AtomicBool>,
) -> Result<(Stats, u64, u64), DataError> {
    let seq = &opts.sequence;
    let limit = |n: usize| if n == 0 { None } else { Some(n.min(u32::MAX as usize) as u32) };
    // Dropping over-long responses changes which answers are chosen, so it needs every response's token
    // length in pass 1. Truncating does not: then only the chosen responses are tokenised (in pass 2),
    // which is most of the work.
    let drop_long = seq.overlong == Overlong::Drop && seq.max_response_tokens > 0;
    let measure = Measure::tokens(tok, seq.system_prompt.as_deref(), true, drop_long);
    let limits = Limits {
        max_prompt: limit(seq.max_prompt_tokens),
        max_response: if drop_long { limit(seq.max_response_tokens) } else { None },
        drop_long,
        stop,
    };
    let mut sel_writers: Vec<Option<BufWriter<File>>> = (0..files.len()).map(|_| None).collect();
    let gpath = dir.join("groups.jsonl");
    let mut groups_out = AtomicFile::create(Some(&gpath)).map_err(io_err(&gpath))?;
    let (mut n_groups, mut n_responses) = (0u64, 0u64);
    let stats = scan_with(files, &opts.input, Some(dir), &measure, &limits, on_bad, &mut |g| {
        groups_out.write_json(&group_meta(&g, n_responses)).map_err(io_err(&gpath))?;
        for (j, r) in g.records.iter().enumerate() {
            let f = r.rref.file as usize;
            if sel_writers[f].is_none() {
                let p = selection_file(sel_dir, f);
                sel_writers[f] = Some(BufWriter::new(File::create(&p).map_err(io_err(&p))?));
            }
            let sel = Selection {
                ordinal: r.rref.ordinal,
                qhash: g.qhash,
                group: n_groups,
                response: n_responses + j as u64,
                prompt: j == 0,
            };
            if let Some(w) = sel_writers[f].as_mut() {
                sel.write(w).map_err(io_err(selection_file(sel_dir, f)))?;
            }
        }
        n_groups += 1;
        n_responses += g.records.len() as u64;
        Ok(())
    })?;
    groups_out.commit().map_err(io_err(&gpath))?;
    for (f, w) in sel_writers.into_iter().enumerate() {
        if let Some(w) = w {
            w.into_inner().map_err(|e| DataError::Io { path: selection_file(sel_dir, f), source: e.into_error() })?;
        }
    }
    Ok((stats, n_groups, n_responses))
}

fn group_meta(g: &ScannedGroup, first_response: u64) -> GroupMeta {
    GroupMeta {
        question_id: question_id(g.qhash),
        domain: g.records[0].domain.clone(),
        source: g.records[0].source.clone(),
        first_response,
        n_responses: g.records.len() as u32,
        majority: g.labels.majority.clone(),
        majority_count: g.labels.majority_count,
        vote_margin: g.labels.vote_margin,
        answers: g.records.iter().map(|r| r.answer.clone()).collect(),
        rewards: g.labels.rewards.clone(),
    }
}

/// What pass 2 wrote.
struct TokenisePass {
    prompts: u64,
    responses: u64,
    tokens: u64,
    shards: Vec<String>,
    logprobs_kept: u64,
    logprobs_mismatched: u64,
    truncated: u64,
    response_lengths: LengthHistogram,
}

impl TokenisePass {
    /// The token-level figures of the stats.
    fn add_to(&self, stats: &mut Stats) {
        if self.logprobs_mismatched > 0 {
            tracing::warn!(
                "{} responses had teacher log-probs of the wrong length: left out",
                self.logprobs_mismatched
            );
        }
        stats.length_unit = "tokens".into();
        stats.response_length = self.response_lengths.summary();
        stats.responses_truncated = self.truncated;
        stats.tokens = self.tokens;
        stats.teacher_logprobs_kept = self.logprobs_kept;
        stats.teacher_logprobs_mismatched = self.logprobs_mismatched;
    }
}

/// Where pass 2 finds the chosen rows, how many, and the stop flag.
struct Pass2<'a> {
    sel_dir: &'a Path,
    n_responses: u64,
    stop: Option<&'a AtomicBool>,
}

/// Pass 2: tokenise the chosen rows file by file (in parallel inside a file) into the shards.
fn tokenise_chosen(
    opts: &PrepareOptions,
    files: &[PathBuf],
    tok: &ChatTokenizer,
    eos: u32,
    mut writer: ShardWriter,
    pass: Pass2<'_>,
) -> Result<TokenisePass, DataError> {
    let Pass2 { sel_dir, n_responses, stop } = pass;
    let (mut logprobs_kept, mut logprobs_mismatched, mut truncated) = (0u64, 0u64, 0u64);
    let mut response_lengths = LengthHistogram::default();
    let bar = crate::progress::progress_bar(Some(n_responses), "tokenise");
    for (f, path) in files.iter().enumerate() {
        let p = selection_file(sel_dir, f);
        if !p.exists() {
            continue;
        }
        let mut sels = Selection::read_all(&p)?;
        sels.sort_by_key(|s| s.ordinal);
        let mut found = 0usize;
        scan_file(
            f as u32,
            path,
            &opts.input.read,
            |rref, row| -> Result<Option<Tokenised>, DataError> {
                let Ok(i) = sels.binary_search_by_key(&rref.ordinal, |s| s.ordinal) else {
                    return Ok(None);
                };
                check_stop(stop, opts)?;
                let changed = || DataError::Invalid(format!("{} changed while it was being prepared", path.display()));
                let row = row.map_err(|_| changed())?;
                if question_hash(&row.question) != sels[i].qhash {
                    return Err(changed());
                }
                tokenise_row(sels[i], row, tok, eos, &opts.sequence).map(Some)
            },
            |t| {
                let Some(t) = t? else { return Ok(()) };
                found += 1;
                bar.inc(1);
                if let Some(p) = &t.prompt {
                    writer.write_prompt(t.sel.group, p)?;
                }
                logprobs_kept += t.logprobs.is_some() as u64;
                truncated += t.truncated as u64;
                response_lengths.add(t.response.len() as u64);
                logprobs_mismatched += t.logprobs_mismatched as u64;
                writer.write_response(t.sel.response, &t.response, t.truncated, t.logprobs.as_deref())
            },
        )?;
        if found != sels.len() {
            return Err(DataError::Invalid(format!(
                "{} changed while it was being prepared ({} of {} chosen rows found)",
                path.display(),
                found,
                sels.len()
            )));
        }
    }
    bar.finish_and_clear();
    let tokens = writer.tokens_total;
    let (shards, prompts, responses) = writer.finish()?;
    Ok(TokenisePass {
        prompts,
        responses,
        tokens,
        shards,
        logprobs_kept,
        logprobs_mismatched,
        truncated,
        response_lengths,
    })
}

/// Tokenise one chosen row: its prompt when it is the group's first, its response with EOS (truncated
/// past the limit) and its teacher log-probs when they match the tokens.
fn tokenise_row(
    sel: Selection,
    row: super::reader::Row,
    tok: &ChatTokenizer,
    eos: u32,
    seq: &SequenceOptions,
) -> Result<Tokenised, DataError> {
    let prompt = if sel.prompt { Some(prompt_tokens(tok, seq.system_prompt.as_deref(), &row.question)?) } else { None };
    let mut response = tok.encode(&row.response, false)?;
    let text_len = response.len();
    response.push(eos);
    let (mut logprobs, mut logprobs_mismatched) = (None, false);
    if let Some(mut lp) = row.teacher_logprobs {
        if lp.len() == text_len {
            // The teacher's EOS probability is unknown: 1, as for the whole response otherwise.
            lp.push(0.0);
        }
        if lp.len() == response.len() {
            logprobs = Some(lp);
        } else {
            logprobs_mismatched = true;
        }
    }
    let mut truncated = false;
    if let Some(max) = Some(seq.max_response_tokens).filter(|&m| m > 0) {
        if response.len() > max {
            response.truncate(max);
            truncated = true;
            if let Some(lp) = logprobs.as_mut() {
                lp.truncate(max);
            }
        }
    }
    Ok(Tokenised { sel, prompt, response, truncated, logprobs, logprobs_mismatched })
}
