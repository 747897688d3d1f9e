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

use serde::{Deserialize, Serialize};

use super::group::{prompt_tokens, scan_with, Limits, Measure, ScanOptions};
use super::reader::{resolve_inputs, scan_file, BadRow, ReadOptions};
use super::shards::{GroupMeta, ShardWriter, FORMAT};
use super::stats::{LengthHistogram, Stats};
use super::{io_err, question_hash, question_id, DataError, GroupOptions};
use crate::jsonl::AtomicFile;
use crate::model::tokenizer::ChatTokenizer;

/// What to do with a response longer than the response-token limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Overlong {
    /// Keep its first tokens (marked truncated, no EOS).
    Truncate,
    /// Leave the response out of its group.
    Drop,
}

/// Options of [`prepare`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrepareOptions {
    /// Files, folders or globs.
    pub inputs: Vec<String>,
    /// Model or tokenizer folder (tokenizer.json + tokenizer_config.json with the chat template).
    pub model: PathBuf,
    pub out: PathBuf,
    pub group: GroupOptions,
    pub read: ReadOptions,
    /// Groups whose prompt has more tokens are dropped (0: no limit).
    pub max_prompt_tokens: usize,
    /// Responses with more tokens (EOS included) are truncated or dropped (0: no limit).
    pub max_response_tokens: usize,
    pub overlong: Overlong,
    pub system_prompt: Option<String>,
    /// Fail at the first bad row.
    pub strict: bool,
    /// Prepare again even when the manifest says it is up to date.
    pub force: bool,
    /// Tokens per token shard before a new one is started.
    pub shard_tokens: u64,
    /// Spill partitions of the grouping pass (0: from the input size).
    pub partitions: usize,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        Self {
            inputs: vec![],
            model: PathBuf::new(),
            out: PathBuf::new(),
            group: GroupOptions::default(),
            read: ReadOptions::default(),
            max_prompt_tokens: 2048,
            max_response_tokens: 16384,
            overlong: Overlong::Truncate,
            system_prompt: None,
            strict: false,
            force: false,
            shard_tokens: 1 << 28,
            partitions: 0,
        }
    }
}

/// What [`prepare`] did.
#[derive(Debug, Clone)]
pub struct PrepareOutcome {
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
    /// The options that change the output (inputs, output folder and `force` excluded).
    options: serde_json::Value,
    created_by: String,
}

fn input_info(p: &Path) -> Result<InputInfo, DataError> {
    let m = std::fs::metadata(p).map_err(io_err(p))?;
    let modified_ns =
        m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_nanos()).unwrap_or(0);
    let path = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()).to_string_lossy().into_owned();
    Ok(InputInfo { path, size: m.len(), modified_ns })
}

fn output_options(o: &PrepareOptions) -> serde_json::Value {
    serde_json::json!({
        "group": o.group,
        "read": o.read,
        "max_prompt_tokens": o.max_prompt_tokens,
        "max_response_tokens": o.max_response_tokens,
        "overlong": o.overlong,
        "system_prompt": o.system_prompt,
        "strict": o.strict,
        "shard_tokens": o.shard_tokens,
    })
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

/// Prepare `opts.inputs` into `opts.out` (see the module doc). Skips the work when `out` holds a complete
/// preparation of the same inputs (size, modification time), tokenizer and options.
pub fn prepare(opts: &PrepareOptions) -> Result<PrepareOutcome, DataError> {
    prepare_with(opts, &mut |bad| tracing::warn!("skipped {bad}"))
}

/// [`prepare`] with a callback for each bad row.
pub fn prepare_with(opts: &PrepareOptions, on_bad: &mut dyn FnMut(&BadRow)) -> Result<PrepareOutcome, DataError> {
    let files = resolve_inputs(&opts.inputs)?;
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
        created_by: format!("grpo {}", env!("CARGO_PKG_VERSION")),
    };
    let mpath = out.join("manifest.json");
    let mut reasons = vec![];
    if let Ok(text) = std::fs::read_to_string(&mpath) {
        match serde_json::from_str::<Manifest>(&text) {
            Ok(old) => {
                reasons = differences(&old, &manifest);
                if reasons.is_empty() && !opts.force {
                    let spath = out.join("stats.json");
                    let stats: Stats = std::fs::read_to_string(&spath)
                        .ok()
                        .and_then(|t| serde_json::from_str(&t).ok())
                        .ok_or_else(|| DataError::Format { path: spath, message: "missing or unreadable".into() })?;
                    tracing::info!("{} is up to date with its inputs: nothing to do", out.display());
                    return Ok(PrepareOutcome {
                        out: out.clone(),
                        skipped: true,
                        reasons,
                        stats,
                        groups: old.groups,
                        responses: old.responses,
                        tokens: old.tokens,
                    });
                }
                if opts.force && reasons.is_empty() {
                    reasons.push("--force".into());
                }
            }
            Err(_) => reasons.push("unreadable manifest".into()),
        }
        for r in &reasons {
            tracing::info!("re-preparing {}: {r}", out.display());
        }
        std::fs::remove_file(&mpath).map_err(io_err(&mpath))?;
    } else {
        reasons.push("new".into());
    }
    // Stale token shards of an earlier preparation.
    if let Ok(entries) = std::fs::read_dir(out) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("tokens-") && name.ends_with(".u32") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    // Pass 1: groups and labels.
    let scan_opts = ScanOptions {
        read: opts.read.clone(),
        group: opts.group.clone(),
        strict: opts.strict,
        partitions: opts.partitions,
        spill_dir: Some(out.clone()),
    };
    let limit = |n: usize| if n == 0 { None } else { Some(n.min(u32::MAX as usize) as u32) };
    // Dropping over-long responses changes which answers are chosen, so it needs every response's token
    // length in pass 1. Truncating does not: then only the chosen responses are tokenised (in pass 2),
    // which is most of the work.
    let drop_long = opts.overlong == Overlong::Drop && opts.max_response_tokens > 0;
    let measure = Measure::tokens(&tok, opts.system_prompt.as_deref(), true, drop_long);
    let limits = Limits {
        max_prompt: limit(opts.max_prompt_tokens),
        max_response: if drop_long { limit(opts.max_response_tokens) } else { None },
        drop_long,
    };
    let sel_dir = out.join(".selection");
    let _ = std::fs::remove_dir_all(&sel_dir);
    std::fs::create_dir_all(&sel_dir).map_err(io_err(&sel_dir))?;
    let sel_path = |f: usize| sel_dir.join(format!("file-{f:05}.bin"));
    let mut sel_writers: Vec<Option<BufWriter<File>>> = (0..files.len()).map(|_| None).collect();
    let gpath = out.join("groups.jsonl");
    let mut groups_out = AtomicFile::create(Some(&gpath)).map_err(io_err(&gpath))?;
    let (mut n_groups, mut n_responses) = (0u64, 0u64);
    let mut stats = scan_with(&files, &scan_opts, &measure, &limits, on_bad, &mut |g| {
        let meta = GroupMeta {
            question_id: question_id(g.qhash),
            domain: g.records[0].domain.clone(),
            source: g.records[0].source.clone(),
            first_response: n_responses,
            n_responses: g.records.len() as u32,
            majority: g.labels.majority.clone(),
            majority_count: g.labels.majority_count,
            vote_margin: g.labels.vote_margin,
            answers: g.records.iter().map(|r| r.answer.clone()).collect(),
            rewards: g.labels.rewards.clone(),
        };
        groups_out.write_json(&meta).map_err(io_err(&gpath))?;
        for (j, r) in g.records.iter().enumerate() {
            let f = r.rref.file as usize;
            if sel_writers[f].is_none() {
                let p = sel_path(f);
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
                sel.write(w).map_err(io_err(sel_path(f)))?;
            }
        }
        n_groups += 1;
        n_responses += g.records.len() as u64;
        Ok(())
    })?;
    groups_out.commit().map_err(io_err(&gpath))?;
    for (f, w) in sel_writers.into_iter().enumerate() {
        if let Some(w) = w {
            w.into_inner().map_err(|e| DataError::Io { path: sel_path(f), source: e.into_error() })?;
        }
    }

    // Pass 2: tokenise the chosen rows, file by file.
    let mut writer = ShardWriter::create(out, n_groups, n_responses, opts.shard_tokens)?;
    let max_response = Some(opts.max_response_tokens).filter(|&m| m > 0);
    let (mut lp_kept, mut lp_mismatched, mut truncated) = (0u64, 0u64, 0u64);
    let mut response_hist = LengthHistogram::default();
    let bar = crate::cli::progress_bar(Some(n_responses), "tokenise");
    for (f, path) in files.iter().enumerate() {
        let p = sel_path(f);
        if !p.exists() {
            continue;
        }
        let mut sels = Selection::read_all(&p)?;
        sels.sort_by_key(|s| s.ordinal);
        let mut found = 0usize;
        scan_file(
            f as u32,
            path,
            &opts.read,
            |rref, row| -> Result<Option<Tokenised>, DataError> {
                let Ok(i) = sels.binary_search_by_key(&rref.ordinal, |s| s.ordinal) else {
                    return Ok(None);
                };
                let sel = sels[i];
                let changed = || DataError::Invalid(format!("{} changed while it was being prepared", path.display()));
                let row = row.map_err(|_| changed())?;
                if question_hash(&row.question) != sel.qhash {
                    return Err(changed());
                }
                let prompt = if sel.prompt {
                    Some(prompt_tokens(&tok, opts.system_prompt.as_deref(), &row.question)?)
                } else {
                    None
                };
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
                if let Some(max) = max_response {
                    if response.len() > max {
                        response.truncate(max);
                        truncated = true;
                        if let Some(lp) = logprobs.as_mut() {
                            lp.truncate(max);
                        }
                    }
                }
                Ok(Some(Tokenised { sel, prompt, response, truncated, logprobs, logprobs_mismatched }))
            },
            |t| {
                let Some(t) = t? else { return Ok(()) };
                found += 1;
                bar.inc(1);
                if let Some(p) = &t.prompt {
                    writer.write_prompt(t.sel.group, p)?;
                }
                lp_kept += t.logprobs.is_some() as u64;
                truncated += t.truncated as u64;
                response_hist.add(t.response.len() as u64);
                lp_mismatched += t.logprobs_mismatched as u64;
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
    let _ = std::fs::remove_dir_all(&sel_dir);
    let tokens = writer.tokens_total;
    let (shards, np, nr) = writer.finish()?;
    if np != n_groups || nr != n_responses {
        return Err(DataError::Invalid(format!(
            "prepared {np} of {n_groups} prompts and {nr} of {n_responses} responses: inputs changed during prepare?"
        )));
    }
    if lp_mismatched > 0 {
        tracing::warn!("{lp_mismatched} responses had teacher log-probs of the wrong length: left out");
    }
    stats.length_unit = "tokens".into();
    stats.response_length = response_hist.summary();
    stats.responses_truncated = truncated;
    stats.tokens = tokens;
    stats.teacher_logprobs_kept = lp_kept;
    stats.teacher_logprobs_mismatched = lp_mismatched;
    let spath = out.join("stats.json");
    let mut sf = AtomicFile::create(Some(&spath)).map_err(io_err(&spath))?;
    serde_json::to_writer_pretty(&mut sf, &stats).map_err(|e| io_err(&spath)(e.into()))?;
    sf.commit().map_err(io_err(&spath))?;
    manifest.groups = n_groups;
    manifest.responses = n_responses;
    manifest.tokens = tokens;
    manifest.token_shards = shards;
    let mut mf = AtomicFile::create(Some(&mpath)).map_err(io_err(&mpath))?;
    serde_json::to_writer_pretty(&mut mf, &manifest).map_err(|e| io_err(&mpath)(e.into()))?;
    mf.commit().map_err(io_err(&mpath))?;
    Ok(PrepareOutcome {
        out: out.clone(),
        skipped: false,
        reasons,
        stats,
        groups: n_groups,
        responses: n_responses,
        tokens,
    })
}
