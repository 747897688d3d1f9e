//! Small randomly initialised models with a real tokenizer (`grpo init-tiny`, smoke training runs).

use std::path::Path;

use candle_core::{DType, Device};

use super::checkpoint::{save_checkpoint, SaveOptions};
use super::{random_decoder, Arch, ChatTokenizer, ModelConfig, ModelError};

/// Shape of a tiny model.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyShape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
}

/// Write a random `arch` model with the tokenizer of `tokenizer_dir` to `out` (atomically); returns its
/// config. The vocabulary is the tokenizer's, rounded up to a multiple of 64.
pub fn write_tiny_model(
    arch: Arch,
    tokenizer_dir: &Path,
    out: &Path,
    shape: &TinyShape,
    seed: u64,
) -> Result<ModelConfig, ModelError> {
    let tok = ChatTokenizer::load(tokenizer_dir)?;
    let vocab = tok.vocab_size().div_ceil(64) * 64;
    let inner = tok.inner();
    let bos = ["<|begin_of_text|>", "<|endoftext|>"].iter().find_map(|t| inner.token_to_id(t));
    let eos = tok.eos_ids().first().copied();
    let cfg = ModelConfig::tiny(
        arch,
        vocab,
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.intermediate,
        bos,
        eos,
    )?;
    let model = random_decoder(cfg.clone(), seed, DType::F32, &Device::Cpu, false)?;
    let opts = SaveOptions { tokenizer_dir: Some(tokenizer_dir.to_path_buf()), ..Default::default() };
    save_checkpoint(&model, out, &opts, |dir| {
        let gen = dir.join("generation_config.json");
        if !gen.exists() {
            let mut g = serde_json::json!({"_from_model_config": true});
            if let Some(b) = bos {
                g["bos_token_id"] = b.into();
            }
            g["eos_token_id"] = tok.eos_ids().to_vec().into();
            std::fs::write(&gen, serde_json::to_string_pretty(&g).unwrap_or_default())
                .map_err(|source| ModelError::Io { path: gen.clone(), source })?;
        }
        Ok(())
    })?;
    Ok(cfg)
}
