//! `grpo init-tiny`: a small random model with a real tokenizer, for smoke runs and CI.

use std::path::PathBuf;

use anyhow::Context;

use crate::model::{self as grpo_model, save_checkpoint, Arch, ChatTokenizer, ModelConfig};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Architecture of the model.
    #[arg(long, value_enum)]
    pub arch: Arch,
    /// Folder with tokenizer.json and tokenizer_config.json (e.g. ../shared/data/tokenizers/qwen3).
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
    let tok = ChatTokenizer::load(&args.tokenizer)
        .with_context(|| format!("loading the tokenizer from {}", args.tokenizer.display()))?;
    let vocab = tok.vocab_size().div_ceil(64) * 64;
    let inner = tok.inner();
    let bos = ["<|begin_of_text|>", "<|endoftext|>"].iter().find_map(|t| inner.token_to_id(t));
    let eos = tok.eos_ids().first().copied();
    let cfg = ModelConfig::tiny(
        args.arch,
        vocab,
        args.layers,
        args.hidden,
        args.heads,
        args.kv_heads,
        args.intermediate,
        bos,
        eos,
    )
    .context("invalid tiny model shape")?;
    let n = cfg.num_parameters();
    let model = grpo_model::random_decoder(cfg, args.seed, candle_core::DType::F32, &candle_core::Device::Cpu, false)?;
    let opts =
        grpo_model::checkpoint::SaveOptions { tokenizer_dir: Some(args.tokenizer.clone()), ..Default::default() };
    save_checkpoint(&model, &args.out, &opts, |dir| {
        let gen = dir.join("generation_config.json");
        if !gen.exists() {
            let mut g = serde_json::json!({"_from_model_config": true});
            if let Some(b) = bos {
                g["bos_token_id"] = b.into();
            }
            g["eos_token_id"] = tok.eos_ids().to_vec().into();
            std::fs::write(&gen, serde_json::to_string_pretty(&g).unwrap_or_default())
                .map_err(|source| grpo_model::ModelError::Io { path: gen.clone(), source })?;
        }
        Ok(())
    })
    .with_context(|| format!("writing {}", args.out.display()))?;
    tracing::info!("wrote a {:?} model with {n} parameters (vocab {vocab}) to {}", args.arch, args.out.display());
    Ok(())
}
