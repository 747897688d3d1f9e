//! `grpo score`: extract, verify and summarise generations.
use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// JSONL with {"answer", "response"} or {"answer", "responses": [...]} per line.
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
}

pub fn run(args: Args) -> anyhow::Result<()> {
    anyhow::bail!("grpo score is not implemented yet (input {})", args.input.display())
}
