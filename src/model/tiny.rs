//! Small randomly initialised models with a real tokenizer (`grpo init-tiny`, smoke training runs).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use candle_core::{DType, Device};

use super::checkpoint::{save_checkpoint, SaveOptions};
use super::config::ConfigError;
use super::{random_decoder, Arch, ChatTokenizer, ModelConfig, ModelError};

/// Shape of a tiny model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct TinyShape {
    /// Number of decoder layers.
    #[arg(long, default_value_t = default_layers())]
    #[serde(default = "default_layers")]
    pub layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = default_hidden())]
    #[serde(default = "default_hidden")]
    pub hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = default_heads())]
    #[serde(default = "default_heads")]
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    #[arg(long, default_value_t = default_kv_heads())]
    #[serde(default = "default_kv_heads")]
    pub kv_heads: usize,
    /// MLP intermediate size.
    #[arg(long, default_value_t = default_intermediate())]
    #[serde(default = "default_intermediate")]
    pub intermediate: usize,
}

impl TinyShape {
    /// The HF config of a random `arch` model of this shape.
    pub fn config(
        &self,
        arch: Arch,
        vocab_size: usize,
        bos: Option<u32>,
        eos: Option<u32>,
    ) -> Result<ModelConfig, ConfigError> {
        let TinyShape { layers, hidden, heads, kv_heads, intermediate } = *self;
        let mut raw = serde_json::json!({
            "architectures": [arch.hf_class()],
            "model_type": arch.model_type(),
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": hidden.checked_div(heads).unwrap_or(0),
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": arch == Arch::Llama,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": "float32",
        });
        if arch == Arch::Llama {
            raw["mlp_bias"] = false.into();
        }
        if arch == Arch::Qwen2 {
            raw["use_sliding_window"] = false.into();
        }
        if let Some(b) = bos {
            raw["bos_token_id"] = b.into();
        }
        if let Some(e) = eos {
            raw["eos_token_id"] = e.into();
        }
        ModelConfig::from_json(raw, Path::new("<tiny config>"))
    }
}

fn default_layers() -> usize {
    2
}
fn default_hidden() -> usize {
    64
}
fn default_heads() -> usize {
    4
}
fn default_kv_heads() -> usize {
    2
}
fn default_intermediate() -> usize {
    128
}

/// A small random model with a real tokenizer: `grpo init-tiny` and `[model.init_tiny]` of the train config
/// (created when the model path does not exist).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct TinySpec {
    /// Architecture of the model.
    #[arg(long, value_enum)]
    pub arch: Arch,
    /// Folder with tokenizer.json and tokenizer_config.json (e.g. data/tokenizers/qwen3).
    #[arg(long)]
    pub tokenizer: PathBuf,
    #[command(flatten)]
    #[serde(flatten)]
    pub shape: TinyShape,
    /// Seed of the random initialisation.
    #[arg(long, default_value_t = 0)]
    #[serde(default)]
    pub seed: u64,
}

impl TinySpec {
    /// The config of the model `spec` makes with tokenizer `tok`: the vocabulary is the tokenizer's,
    /// rounded up to a multiple of 64.
    pub fn config(&self, tok: &ChatTokenizer) -> Result<ModelConfig, ModelError> {
        let vocab = tok.vocab_size().div_ceil(64) * 64;
        Ok(self.shape.config(self.arch, vocab, bos_id(tok), tok.eos_ids().first().copied())?)
    }
}

fn bos_id(tok: &ChatTokenizer) -> Option<u32> {
    ["<|begin_of_text|>", "<|endoftext|>"].iter().find_map(|t| tok.inner().token_to_id(t))
}

/// Write the random model of `spec` with its tokenizer to `out` (atomically); returns its config
/// ([`TinySpec::config`]).
pub fn write_tiny_model(spec: &TinySpec, out: &Path) -> Result<ModelConfig, ModelError> {
    let tokenizer_dir = spec.tokenizer.as_path();
    let tok = ChatTokenizer::load(tokenizer_dir)?;
    let bos = bos_id(&tok);
    let cfg = spec.config(&tok)?;
    let model = random_decoder(cfg.clone(), spec.seed, DType::F32, &Device::Cpu, false)?;
    let opts = SaveOptions { tokenizer_dir: Some(tokenizer_dir.to_path_buf()), ..Default::default() };
    save_checkpoint(&model, out, &opts, |dir| {
        let gen = dir.join("generation_config.json");
        if !gen.exists() {
            let g =
                GenerationConfig { from_model_config: true, bos_token_id: bos, eos_token_id: tok.eos_ids().to_vec() };
            std::fs::write(&gen, serde_json::to_string_pretty(&g).unwrap_or_default())
                .map_err(|source| ModelError::Io { path: gen.clone(), source })?;
        }
        Ok(())
    })?;
    Ok(cfg)
}

/// The tiny model's `generation_config.json`: transformers' keys, as its `GenerationConfig` writes them.
#[derive(serde::Serialize)]
struct GenerationConfig {
    #[serde(rename = "_from_model_config")]
    from_model_config: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    bos_token_id: Option<u32>,
    eos_token_id: Vec<u32>,
}
