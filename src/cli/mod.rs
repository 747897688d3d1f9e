//! The `grpo` command line: one subcommand per job, each in its own file.

use clap::{Parser, Subcommand};

mod bench;
mod data;
mod eval;
mod export;
mod init_tiny;
mod logprobs;
mod plot;
mod score;
mod selftest;
mod train;

/// Off-policy GRPO post-training of open LLMs for mathematical reasoning.
#[derive(Debug, Parser)]
#[command(name = "grpo", version = version(), about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// More log output (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true, help_heading = "Logging")]
    pub verbose: u8,
    /// Errors only: no progress, log lines or warnings (results on stdout, such as tables and the
    /// training summary, are still printed).
    #[arg(short, long, global = true, help_heading = "Logging")]
    pub quiet: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// What `grpo eval --help` and `grpo score --help` say of the scores.
const METRICS_HELP: &str = "The scores, over a benchmark's problems, each with n sampled answers:
  avg@n   the mean accuracy of the n answers (the share of correct answers)
  pass@k  the chance that at least one of k answers drawn from the n is correct: the
          unbiased estimate 1 - C(n-c, k) / C(n, k) for c correct answers (k <= n)
  maj@n   the accuracy of the most common final answer of the n (equivalent answers
          vote together, a tie goes to the one that came first, an answer without a
          final answer does not vote)
An answer is the last \\boxed{} of the text (after </think> when there is one),
compared with the gold answer as Math-Verify does: docs/reference.md.";

/// This build's version: the crate's, and for a release build its commit and the commit's date ("+changes"
/// when it was built from edited sources; build.rs).
pub(crate) fn version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| match env!("GRPO_COMMIT") {
        "" => env!("CARGO_PKG_VERSION").to_string(),
        commit => format!("{} (commit {commit})", env!("CARGO_PKG_VERSION")),
    })
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Post-train a model on teacher trajectories with off-policy GRPO (objective off_grpo) or another
    /// objective: grpo, gspo, rec, opmd, asymre, red_drop, red_weight, oapl, sft, cispo.
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
    /// Write a LoRA adapter merged into its base model as a Hugging Face model (--merge).
    Export(export::Args),
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
        (true, _) => "error",
        (false, 0) => "info",
        (false, 1) => "debug",
        (false, _) => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // Colours on a terminal only: a log file gets plain text.
    let ansi = crate::progress::on_terminal();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(crate::progress::log_writer)
        .with_target(false)
        .with_ansi(ansi)
        .try_init();
}

/// A closed pipe on stdout or stderr (`grpo data stats | head -1`) ends the process quietly, as it ends
/// `cat`: the default action of SIGPIPE, which Rust programs otherwise ignore (and then panic on the failed
/// write). A training run ignores it again while it runs ([`keep_running_on_closed_pipe`]).
pub fn end_quietly_on_closed_pipe() {
    // SAFETY: restoring a signal's default action; called before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Keep running when the reader of stdout or stderr goes away (a `| tee` ended by Ctrl-C): a training run
/// then still finishes its step and writes its checkpoint and summary.json. Its own prints ignore the closed
/// pipe ([`print_if_read`]), and the log drops lines nobody reads.
pub(crate) fn keep_running_on_closed_pipe() {
    // SAFETY: setting a signal's action to ignore it; no handler runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// Print `text` to stdout, or nothing when its reader has gone away (the text is also in a file).
pub(crate) fn print_if_read(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// An error that ends the process with its own exit status (each documented in its command's help); any
/// other error exits with 1.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Exit {
    pub code: u8,
    pub message: String,
}

/// The exit status of a refused command line, as clap gives it.
pub const USAGE_EXIT_CODE: u8 = 2;

/// A command line refused after clap's parse (a `--set` that no config key takes), said as clap says its
/// own refusals: the message, the subcommand's usage, exit status 2.
pub(crate) fn usage_error(subcommand: &str, message: impl std::fmt::Display) -> anyhow::Error {
    use clap::CommandFactory;
    let mut cmd = Cli::command();
    cmd.build();
    let usage = cmd.find_subcommand_mut(subcommand).map(|c| c.render_usage().to_string()).unwrap_or_default();
    let message = format!("{message}\n\n{usage}\n\nFor more information, try '--help'.");
    Exit { code: USAGE_EXIT_CODE, message }.into()
}

/// The exit status for `err`: an [`Exit`]'s code anywhere in its chain, else 1.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    err.chain().find_map(|e| e.downcast_ref::<Exit>()).map_or(1, |e| e.code)
}

/// The message of `err` and its causes, joined by `: `, each said once: a cause whose text is already in
/// the message (an error type that writes its source into its own message) is not repeated.
pub fn error_message(err: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
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
        Command::Export(args) => export::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Plot(args) => plot::run(args),
        Command::Selftest(args) => selftest::run(args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_said_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("cannot read {path}: {source}")]
        struct Read {
            path: String,
            source: std::io::Error,
        }
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let err = anyhow::Error::new(Read { path: "configs/nope.toml".into(), source: io });
        assert_eq!(err.chain().count(), 2, "the io error is the source and is in the message");
        assert_eq!(error_message(&err), "cannot read configs/nope.toml: No such file or directory (os error 2)");
        // A context that adds words keeps them, and a cause the message does not hold is still said.
        let err = err.context("training failed");
        assert_eq!(
            error_message(&err),
            "training failed: cannot read configs/nope.toml: No such file or directory (os error 2)"
        );
        let plain = anyhow::anyhow!("disk full").context("writing metrics.jsonl");
        assert_eq!(error_message(&plain), "writing metrics.jsonl: disk full");
    }

    #[test]
    fn exit_codes_come_from_the_chain() {
        let e = anyhow::Error::new(Exit { code: 3, message: "does not fit".into() }).context("planning");
        assert_eq!(exit_code(&e), 3);
        assert_eq!(exit_code(&anyhow::anyhow!("other")), 1);
    }
}
