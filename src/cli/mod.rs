//! The `grpo` command line: one subcommand per job, each in its own file.

use clap::{Parser, Subcommand};

mod bench;
mod data;
mod eval;
mod init_tiny;
mod logprobs;
mod plot;
mod score;
mod selftest;
mod train;

/// Off-policy GRPO post-training of open LLMs for mathematical reasoning.
#[derive(Debug, Parser)]
#[command(name = "grpo", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// More log output (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Only warnings and errors.
    #[arg(short, long, global = true)]
    pub quiet: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Post-train a model on teacher trajectories with off-policy GRPO (or grpo / sft baselines).
    Train(train::Args),
    /// Create a small randomly initialised model with a real tokenizer (for smoke tests and CI).
    InitTiny(init_tiny::Args),
    /// Per-token log-probs of texts or of (prompt, response) pairs under a model.
    Logprobs(logprobs::Args),
    /// Extract answers from generations, check them against gold (or the group majority) and report
    /// avg@n, pass@k and maj@n.
    Score(score::Args),
    /// Generate answers on math benchmarks (AIME25, AIME24, AMC23, MATH-500) and score them.
    Eval(eval::Args),
    /// Inspect and prepare teacher trajectories (OpenThoughts3 JSONL / Parquet).
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Draw the training curves of run folders (loss, reward, KL, clip ratio, entropy, gradient norm,
    /// tokens/s, learning rate, validation) to a PNG; several runs on one figure.
    Plot(plot::Args),
    /// Measure speed and memory on random weights (training step, log-prob op, generation); one JSON
    /// line per measurement.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Check a device before using it: every fused kernel, one training step and one generation of a
    /// tiny model against the CPU reference; prints a table and fails when any check fails.
    Selftest(selftest::Args),
}

/// Set up `tracing` output on stderr.
pub fn init_logging(verbose: u8, quiet: bool) {
    use tracing_subscriber::EnvFilter;
    let default = match (quiet, verbose) {
        (true, _) => "warn",
        (false, 0) => "info",
        (false, 1) => "debug",
        (false, _) => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).try_init();
}

/// Run the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => train::run(args),
        Command::InitTiny(args) => init_tiny::run(args),
        Command::Logprobs(args) => logprobs::run(args),
        Command::Score(args) => score::run(args),
        Command::Data(cmd) => data::run(cmd),
        Command::Eval(args) => eval::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Plot(args) => plot::run(args),
        Command::Selftest(args) => selftest::run(args),
    }
}
