//! `grpo init-tiny`: a small random model with a real tokenizer, for smoke runs and CI.

use std::path::PathBuf;

use anyhow::Context;

use crate::model::tiny::{write_tiny_model, TinySpec};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub spec: TinySpec,
    /// Output folder (created; replaced atomically if it exists).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let arch = args.spec.arch;
    let cfg = write_tiny_model(&args.spec, &args.out)
        .with_context(|| format!("writing a tiny {arch:?} model to {}", args.out.display()))?;
    tracing::info!(
        "wrote a {arch:?} model with {} parameters (vocab {}) to {}",
        cfg.num_parameters(),
        cfg.vocab_size,
        args.out.display()
    );
    Ok(())
}
