//! `grpo data stats` and `grpo data prepare`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;

use crate::data::{self, InputOptions, PrepareOptions, SequenceOptions};
use crate::model::{self, tokenizer::ChatTokenizer};
use crate::train::refcache::{ComputeOptions, ReferenceCache};
use crate::train::TrainError;

#[derive(Debug, clap::Subcommand)]
pub enum DataCommand {
    /// What is in the data: rows (and bad rows by reason), questions, groups, answers, the all-positive /
    /// all-negative / mixed groups, the vote-margin histogram and length percentiles.
    Stats(StatsArgs),
    /// Group, label and tokenise the data into shards for `grpo train` (skipped when up to date).
    Prepare(PrepareArgs),
}

#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    #[command(flatten)]
    pub input: InputOptions,
    /// Also write the stats as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw the stats (group kinds as in the seed's figure 2, vote margins, lengths) to this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Tokenizer or model folder: lengths in tokens (prompt rendered with its chat template) instead of
    /// characters.
    #[arg(long, alias = "model")]
    pub tokenizer: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct PrepareArgs {
    #[command(flatten)]
    pub input: InputOptions,
    #[command(flatten)]
    pub sequence: SequenceOptions,
    /// Model or tokenizer folder (tokenizer.json, tokenizer_config.json with the chat template).
    #[arg(long)]
    pub model: PathBuf,
    /// Output folder (shards, groups.jsonl, stats.json, manifest.json).
    #[arg(long)]
    pub out: PathBuf,
    /// Prepare again even when the output is up to date.
    #[arg(long)]
    pub force: bool,
    /// Tokens per shard file.
    #[arg(long, default_value_t = 1 << 28)]
    pub shard_tokens: u64,
    #[command(flatten)]
    pub reference: ReferenceArgs,
}

/// The reference log-probs `grpo train` reads instead of loading its reference model
/// (`model.cache_reference`).
#[derive(Debug, clap::Args)]
pub struct ReferenceArgs {
    /// Also compute the log-prob of every prepared answer token under this frozen reference model (folder
    /// or hub id: the run's `model.reference`, else its initial weights) into the output folder.
    #[arg(long)]
    pub reference: Option<String>,
    /// Weights dtype of the reference: f32, bf16 or f16 (a run with another `model.dtype` recomputes them).
    #[arg(long, default_value = "f32")]
    pub dtype: crate::device::DTypeName,
    /// Device of the reference: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: crate::device::DeviceName,
    /// Sequences per reference forward.
    #[arg(long, default_value_t = 8)]
    pub micro_batch_size: usize,
}

pub fn run(cmd: DataCommand) -> anyhow::Result<()> {
    match cmd {
        DataCommand::Stats(a) => stats(a),
        DataCommand::Prepare(a) => prepare(a),
    }
}

fn report_bad(bad: &data::BadRow) {
    tracing::warn!("skipped {bad}");
}

fn stats(a: StatsArgs) -> anyhow::Result<()> {
    let files = data::resolve_inputs(&a.input.inputs)?;
    let tok = match &a.tokenizer {
        Some(dir) => Some(ChatTokenizer::load(dir).with_context(|| format!("loading tokenizer {}", dir.display()))?),
        None => None,
    };
    let started = std::time::Instant::now();
    let stats = data::scan(&files, &a.input, tok.as_ref(), &mut report_bad).context("data stats")?;
    let names: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
    if stats.rows_read == 0 {
        anyhow::bail!("no rows in {}: nothing to report", names.join(", "));
    }
    if stats.rows_skipped >= stats.rows_read {
        print!("{}", stats.report());
        let reasons: Vec<String> = stats.skipped_by_reason.iter().map(|(r, n)| format!("{n} {r}")).collect();
        anyhow::bail!(
            "no usable row in {}: all {} rows were skipped ({})",
            names.join(", "),
            stats.rows_read,
            reasons.join(", ")
        );
    }
    let secs = started.elapsed().as_secs_f64();
    let bytes: u64 = files.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    print!("{}", stats.report());
    if tok.is_none() {
        println!("(lengths in characters: pass --tokenizer DIR for token lengths)");
    }
    println!("read {:.1} MB in {:.2} s ({:.1} MB/s)", bytes as f64 / 1e6, secs, bytes as f64 / 1e6 / secs.max(1e-9));
    if let Some(p) = &a.json {
        let mut f = crate::jsonl::AtomicFile::create(Some(p)).with_context(|| format!("creating {}", p.display()))?;
        serde_json::to_writer_pretty(&mut f, &stats)?;
        f.commit().with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.plot {
        data::plot_stats(&stats, p).with_context(|| format!("drawing {}", p.display()))?;
    }
    Ok(())
}

fn prepare(a: PrepareArgs) -> anyhow::Result<()> {
    let opts = PrepareOptions {
        input: a.input,
        sequence: a.sequence,
        model: a.model,
        out: a.out,
        force: a.force,
        shard_tokens: a.shard_tokens,
    };
    // Ctrl-C or SIGTERM stops preparation (and the reference pass) within a row or batch, exit status 75;
    // the next run removes what the stopped one had written.
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    if let Err(e) = ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)) {
        tracing::warn!("no Ctrl-C / SIGTERM handler ({e})");
    }
    let outcome = match data::prepare::prepare_with(&opts, &mut report_bad, Some(&stop)) {
        Err(data::DataError::Interrupted(what)) => exit_stopped(&what),
        r => r.context("data prepare")?,
    };
    if outcome.skipped {
        println!(
            "{} is up to date ({} groups, {} responses): nothing to do",
            outcome.out.display(),
            outcome.groups,
            outcome.responses
        );
    } else {
        print!("{}", outcome.stats.report());
        println!(
            "prepared {} groups, {} responses, {} tokens into {} ({})",
            outcome.groups,
            outcome.responses,
            outcome.tokens,
            outcome.out.display(),
            outcome.reasons.join("; ")
        );
    }
    match &a.reference.reference {
        Some(r) => reference_logprobs(r, &a.reference, &opts.out, &stop),
        None => Ok(()),
    }
}

/// Exit with the status of a run stopped on request, saying what was stopped.
fn exit_stopped(what: &str) -> ! {
    eprintln!(
        "stopped on request {what}; run the command again to continue (exit status {})",
        super::train::STOPPED_EXIT_CODE
    );
    std::process::exit(super::train::STOPPED_EXIT_CODE)
}

/// Compute (or check) the reference log-probs of the prepared folder `out`.
fn reference_logprobs(reference: &str, a: &ReferenceArgs, out: &Path, stop: &AtomicBool) -> anyhow::Result<()> {
    let dir = model::resolve_model_dir(reference)?;
    let dataset = data::PreparedDataset::open(out)?;
    let opts = ComputeOptions {
        dtype: a.dtype.dtype(),
        device: model::open_device(a.device).context("--device")?,
        batch: a.micro_batch_size,
        decoder: Default::default(),
    };
    let (cache, computed) =
        match ReferenceCache::ensure(&dataset, &dir, &opts, Some(stop), &crate::dist::World::single()) {
            Err(TrainError::Interrupted(what)) => exit_stopped(&what),
            r => r.context("reference log-probs")?,
        };
    let what = if computed { "written to" } else { "up to date in" };
    println!("reference log-probs of {} {what} {}", dir.display(), cache.path().display());
    Ok(())
}
