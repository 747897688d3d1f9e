//! `grpo init-tiny`: a small random model with a real tokenizer, for smoke runs and CI.

use std::path::PathBuf;

use anyhow::Context;

use crate::model::tiny::{write_tiny_model, TinyShape};
use crate::model::Arch;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Architecture of the model.
    #[arg(long, value_enum)]
    pub arch: Arch,
    /// Folder with tokenizer.json and tokenizer_config.json (e.g. data/tokenizers/qwen3).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Output folder (created; replaced atomically if it exists).
    #[arg(long)]
    pub out: PathBuf,
    /// Number of decoder layers.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    /// MLP intermediate size.
    #[arg(long, default_value_t = 128)]
    pub intermediate: usize,
    /// Seed of the random initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let shape = TinyShape {
        layers: args.layers,
        hidden: args.hidden,
        heads: args.heads,
        kv_heads: args.kv_heads,
        intermediate: args.intermediate,
    };
    let cfg = write_tiny_model(args.arch, &args.tokenizer, &args.out, &shape, args.seed)
        .with_context(|| format!("writing a tiny {:?} model to {}", args.arch, args.out.display()))?;
    tracing::info!(
        "wrote a {:?} model with {} parameters (vocab {}) to {}",
        args.arch,
        cfg.num_parameters(),
        cfg.vocab_size,
        args.out.display()
    );
    Ok(())
}
