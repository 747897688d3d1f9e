//! `grpo score`: extract, verify and summarise generations.
//!
//! Streaming: lines are read in batches, each batch is scored in parallel (rayon) and written in
//! input order. A malformed line (bad JSON, invalid UTF-8, no answer or response field) is reported
//! as `FILE:LINE: reason` on stderr and skipped, or stops the run with `--strict`.
//!
//! Each output line is the input object (all fields kept) plus `preds` (the extracted answer or null
//! per response), `correct` (per response: equivalent to the gold, or with `--no-gold` a member of
//! the majority cluster), `unknown` (per response: equivalence to the reference could not be decided
//! within the limits of exact arithmetic; such a response is not correct) and `majority` (the majority
//! answer or null); fields of those names in the input are replaced. The summary (`--summary`, also
//! printed as a table) has n_items, n_responses, extract_rate, avg_at_n, n_unknown (responses with an
//! unknown verdict), pass_at_k (unbiased estimator, per k), maj_at_n (null with `--no-gold`), n_skipped
//! and reference ("gold" or "majority").
use crate::jsonl::{AtomicFile, Lines, RawLine};
use crate::reward::{judge, summarize, ExtractOptions, ItemOutcome};
use anyhow::Context;
use rayon::prelude::*;
use serde_json::{Map, Value};
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, clap::Args)]
#[command(after_help = super::METRICS_HELP)]
pub struct Args {
    /// JSONL with {"answer", "response"}, {"answer", "responses": [...]} or {"answer", "samples": [{"text"},
    /// ...]} per line (`grpo eval`'s generations.jsonl, a run's validation records), .gz/.zst, or -.
    #[arg(long)]
    pub input: PathBuf,
    /// Where to write the scored lines (default: stdout).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Where to write the summary JSON.
    #[arg(long)]
    pub summary: Option<PathBuf>,
    /// Values of k for pass@k.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize])]
    pub k: Vec<usize>,
    /// Ignore gold answers: the reference is each group's majority answer.
    #[arg(long)]
    pub no_gold: bool,
    /// Name of the gold-answer field (e.g. `gt` for Qwen2.5-Math evaluation files).
    #[arg(long, default_value = "answer")]
    pub answer_field: String,
    /// When a response has no \boxed{}, fall back to "the answer is X" and then the last number.
    #[arg(long)]
    pub fallbacks: bool,
    /// Stop at the first malformed line instead of skipping it.
    #[arg(long)]
    pub strict: bool,
    /// Lines longer than this many bytes are skipped as too large (without being held in memory).
    #[arg(long, default_value_t = 16 << 20)]
    pub max_row_bytes: usize,
}

/// Lines scored in parallel at a time (bounded by count and by bytes).
const BATCH: usize = 1024;
const BATCH_BYTES: usize = 32 << 20;

struct Scored {
    line: Value,
    outcome: ItemOutcome,
}

fn gold_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn score_line(raw: &RawLine, args: &Args, opts: &ExtractOptions) -> Result<Scored, String> {
    let value: Value = raw.json().map_err(|e| e.to_string())?;
    let Value::Object(mut obj) = value else {
        return Err("line is not a JSON object".into());
    };
    let gold = if args.no_gold {
        None
    } else {
        match obj.get(&args.answer_field) {
            Some(v) => {
                Some(gold_string(v).ok_or_else(|| format!("\"{}\" is not a string or number", args.answer_field))?)
            }
            None => return Err(format!("no \"{}\" field", args.answer_field)),
        }
    };
    let responses = responses(&obj)?;
    let v = judge(gold.as_deref(), &responses, opts);
    insert(&mut obj, "preds", serde_json::to_value(&v.preds).unwrap_or(Value::Null));
    insert(&mut obj, "correct", serde_json::to_value(&v.correct).unwrap_or(Value::Null));
    insert(&mut obj, "unknown", serde_json::to_value(&v.unknown).unwrap_or(Value::Null));
    insert(&mut obj, "majority", v.majority.clone().map(Value::String).unwrap_or(Value::Null));
    Ok(Scored { line: Value::Object(obj), outcome: v.outcome() })
}

/// The texts to score: `responses` (strings), `response` (one string), or the `text` of each of
/// `samples` (the lines of `grpo eval`'s generations.jsonl and of a run's validation records).
fn responses(obj: &Map<String, Value>) -> Result<Vec<&str>, String> {
    match (obj.get("responses"), obj.get("response"), obj.get("samples")) {
        (Some(Value::Array(a)), _, _) => {
            a.iter().map(|r| r.as_str().ok_or("\"responses\" holds a non-string".into())).collect()
        }
        (Some(_), _, _) => Err("\"responses\" is not an array".into()),
        (None, Some(Value::String(s)), _) => Ok(vec![s.as_str()]),
        (None, Some(_), _) => Err("\"response\" is not a string".into()),
        (None, None, Some(Value::Array(a))) => a
            .iter()
            .enumerate()
            .map(|(i, s)| s.get("text").and_then(Value::as_str).ok_or(format!("samples[{i}] has no string \"text\"")))
            .collect(),
        (None, None, Some(_)) => Err("\"samples\" is not an array".into()),
        (None, None, None) => Err("no \"response\", \"responses\" or \"samples\" field".into()),
    }
}

fn insert(obj: &mut Map<String, Value>, key: &str, v: Value) {
    obj.insert(key.to_string(), v);
}

/// The values of `ks` for which pass@k can be computed: k at most the samples of every item. Each other
/// one is left out with a warning (the unbiased estimator needs k <= n).
fn computable_ks(ks: &[usize], outcomes: &[ItemOutcome]) -> Vec<usize> {
    let fewest = outcomes.iter().map(|o| o.correct.len()).min().unwrap_or(0);
    let mut kept = Vec::new();
    for &k in ks {
        let short = outcomes.iter().filter(|o| o.correct.len() < k).count();
        if short == 0 {
            kept.push(k);
        } else {
            tracing::warn!(
                "pass@{k} cannot be computed: {short} of {} items have fewer than {k} samples (as few as {fewest}); \
                 it is left out (give --k values up to {fewest})",
                outcomes.len()
            );
        }
    }
    kept
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.k.contains(&0) {
        anyhow::bail!("--k values must be at least 1");
    }
    let opts = ExtractOptions { fallbacks: args.fallbacks };
    let mut lines = Lines::open(&args.input)?.max_line_bytes(args.max_row_bytes);
    let mut out = AtomicFile::create(args.output.as_deref())
        .with_context(|| format!("creating {}", args.output.as_deref().unwrap_or("-".as_ref()).display()))?;
    let bar = crate::progress::progress_bar(None, "score");
    let mut outcomes = Vec::new();
    let mut skipped = 0usize;
    let path = args.input.display().to_string();
    let started = std::time::Instant::now();
    loop {
        let (mut batch, mut bytes) = (Vec::with_capacity(BATCH), 0usize);
        while batch.len() < BATCH && bytes < BATCH_BYTES {
            let Some(l) = lines.next() else { break };
            let l = l?;
            bytes += l.bytes.len();
            batch.push(l);
        }
        if batch.is_empty() {
            break;
        }
        let scored: Vec<Result<Scored, String>> = batch.par_iter().map(|raw| score_line(raw, &args, &opts)).collect();
        for (raw, r) in batch.iter().zip(scored) {
            match r {
                Ok(s) => {
                    out.write_json(&s.line).context("writing output")?;
                    outcomes.push(s.outcome);
                }
                Err(e) => {
                    if args.strict {
                        anyhow::bail!("{path}:{}: {e}", raw.number);
                    }
                    tracing::warn!("{path}:{}: {e} (skipped)", raw.number);
                    skipped += 1;
                }
            }
        }
        bar.inc(batch.len() as u64);
    }
    bar.finish_and_clear();
    if outcomes.is_empty() {
        anyhow::bail!("{path}: nothing was scored ({skipped} lines skipped)");
    }
    out.commit().context("writing output")?;
    let summary = summarize(&outcomes, &computable_ks(&args.k, &outcomes));
    let elapsed = started.elapsed().as_secs_f64();
    tracing::info!(
        "scored {} responses of {} lines in {:.2}s ({:.0} responses/s), {} lines skipped",
        summary.n_responses,
        summary.n_items,
        elapsed,
        summary.n_responses as f64 / elapsed.max(1e-9),
        skipped
    );
    if let Some(p) = &args.summary {
        let mut v = serde_json::to_value(&summary)?;
        if let Value::Object(o) = &mut v {
            o.insert("n_skipped".into(), skipped.into());
            o.insert("reference".into(), if args.no_gold { "majority" } else { "gold" }.into());
        }
        let mut f = AtomicFile::create(Some(p)).with_context(|| format!("creating {}", p.display()))?;
        serde_json::to_writer_pretty(&mut f, &v)?;
        f.write_all(b"\n")?;
        f.commit().with_context(|| format!("writing {}", p.display()))?;
    }
    let table = summary.table();
    if args.output.is_some() {
        print!("{table}");
    } else {
        eprint!("{table}");
    }
    Ok(())
}
