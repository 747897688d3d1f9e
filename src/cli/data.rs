//! `grpo data stats` and `grpo data prepare`.

use std::path::PathBuf;

use anyhow::Context;

use crate::data::{self, GroupOptions, Overlong, PrepareOptions, ReadOptions, ScanOptions};
use crate::model::tokenizer::ChatTokenizer;

#[derive(Debug, clap::Subcommand)]
pub enum DataCommand {
    /// What is in the data: rows (and bad rows by reason), questions, groups, answers, the all-positive /
    /// all-negative / mixed groups, the vote-margin histogram and length percentiles.
    Stats(StatsArgs),
    /// Group, label and tokenise the data into shards for `grpo train` (skipped when up to date).
    Prepare(PrepareArgs),
}

/// Inputs and grouping options shared by `stats` and `prepare`.
#[derive(Debug, clap::Args)]
pub struct InputArgs {
    /// JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet files, folders or globs (repeatable).
    #[arg(long = "input", short = 'i', num_args = 1.., required = true)]
    pub inputs: Vec<String>,
    /// Answers kept per question (G; 0 keeps all), chosen reproducibly from --seed.
    #[arg(long, default_value_t = 8)]
    pub group_size: usize,
    /// Questions with fewer answers are dropped (and counted).
    #[arg(long, default_value_t = 2)]
    pub min_group_size: usize,
    /// Seed of the choice of answers when a question has more than --group-size.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep only these domains (e.g. math; comma-separated or repeated).
    #[arg(long = "domain", value_delimiter = ',')]
    pub domains: Vec<String>,
    /// Keep only these sources (comma-separated or repeated).
    #[arg(long = "source", value_delimiter = ',')]
    pub sources: Vec<String>,
    /// Stop at the first bad row (with its file and line) instead of skipping it.
    #[arg(long)]
    pub strict: bool,
    /// Rows longer than this many bytes are skipped as too large.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_row_bytes: usize,
    /// Spill partitions of the grouping pass (0: from the input size).
    #[arg(long, default_value_t = 0, hide = true)]
    pub partitions: usize,
}

impl InputArgs {
    fn group(&self) -> GroupOptions {
        GroupOptions {
            group_size: self.group_size,
            min_group_size: self.min_group_size,
            seed: self.seed,
            domains: self.domains.clone(),
            sources: self.sources.clone(),
            extract: Default::default(),
        }
    }
    fn read(&self) -> ReadOptions {
        ReadOptions { max_row_bytes: self.max_row_bytes }
    }
}

#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    #[command(flatten)]
    pub input: InputArgs,
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
    pub input: InputArgs,
    /// Model or tokenizer folder (tokenizer.json, tokenizer_config.json with the chat template).
    #[arg(long)]
    pub model: PathBuf,
    /// Output folder (shards, groups.jsonl, stats.json, manifest.json).
    #[arg(long)]
    pub out: PathBuf,
    /// Groups whose rendered prompt is longer are dropped (0: no limit).
    #[arg(long, default_value_t = 2048)]
    pub max_prompt_tokens: usize,
    /// Responses longer than this (EOS included) are truncated or dropped, see --overlong (0: no limit).
    #[arg(long, default_value_t = 16384)]
    pub max_response_tokens: usize,
    /// What to do with over-long responses.
    #[arg(long, value_enum, default_value_t = Overlong::Truncate)]
    pub overlong: Overlong,
    /// System prompt rendered before the question.
    #[arg(long)]
    pub system_prompt: Option<String>,
    /// Prepare again even when the output is up to date.
    #[arg(long)]
    pub force: bool,
    /// Tokens per shard file.
    #[arg(long, default_value_t = 1 << 28)]
    pub shard_tokens: u64,
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
    let opts = ScanOptions {
        read: a.input.read(),
        group: a.input.group(),
        strict: a.input.strict,
        partitions: a.input.partitions,
        spill_dir: None,
    };
    let started = std::time::Instant::now();
    let stats = data::scan(&files, &opts, tok.as_ref(), &mut report_bad).context("data stats")?;
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
        inputs: a.input.inputs.clone(),
        model: a.model,
        out: a.out,
        group: a.input.group(),
        read: a.input.read(),
        max_prompt_tokens: a.max_prompt_tokens,
        max_response_tokens: a.max_response_tokens,
        overlong: a.overlong,
        system_prompt: a.system_prompt,
        strict: a.input.strict,
        force: a.force,
        shard_tokens: a.shard_tokens,
        partitions: a.input.partitions,
    };
    let outcome = data::prepare::prepare_with(&opts, &mut report_bad).context("data prepare")?;
    if outcome.skipped {
        println!(
            "{} is up to date ({} groups, {} responses): nothing to do",
            outcome.out.display(),
            outcome.groups,
            outcome.responses
        );
        return Ok(());
    }
    print!("{}", outcome.stats.report());
    println!(
        "prepared {} groups, {} responses, {} tokens into {} ({})",
        outcome.groups,
        outcome.responses,
        outcome.tokens,
        outcome.out.display(),
        outcome.reasons.join("; ")
    );
    Ok(())
}
