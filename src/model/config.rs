//! `config.json` of Qwen2 / Qwen2.5, Qwen3 and Llama-style models.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The architectures the decoder implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Qwen2 / Qwen2.5: q/k/v biases.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k, no biases by default.
    Qwen3,
    /// Llama / SmolLM2 / Llama-3 (and Mistral-style configs).
    Llama,
}

impl Arch {
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Llama => "llama",
        }
    }

    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Llama => "LlamaForCausalLM",
        }
    }
}

/// Errors in a model's config.json.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: field `{field}`: {message}")]
    Field { path: PathBuf, field: &'static str, message: String },
}

/// Rotary embedding frequency scaling (Llama-3.1 style `rope_scaling`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { factor: f64 },
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

/// The model hyper-parameters the decoder needs, plus the original JSON to write back.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    /// lm_head shares the embedding matrix (decided by the config, never by which tensors exist).
    pub tie_word_embeddings: bool,
    /// q/k/v projections have biases (always for Qwen2, `attention_bias` otherwise).
    pub qkv_bias: bool,
    /// o_proj has a bias (Llama `attention_bias`).
    pub o_bias: bool,
    /// MLP projections have biases (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k (Qwen3).
    pub qk_norm: bool,
    /// The parsed config.json, written back (with updated dtype) into checkpoints.
    pub raw: Value,
}

impl ModelConfig {
    /// Read and validate `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: path.into(), source })?;
        let raw: Value =
            serde_json::from_str(&text).map_err(|source| ConfigError::Json { path: path.into(), source })?;
        Self::from_json(raw, path)
    }

    /// Validate a config given as JSON (`path` is only used in messages).
    pub fn from_json(raw: Value, path: &Path) -> Result<Self, ConfigError> {
        let err = |field: &'static str, message: String| ConfigError::Field { path: path.into(), field, message };
        let usize_field = |field: &'static str| -> Result<usize, ConfigError> {
            raw.get(field)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| err(field, "missing or not a non-negative integer".into()))
        };
        let bool_field = |field: &'static str, default: bool| -> Result<bool, ConfigError> {
            match raw.get(field) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(err(field, format!("expected true or false, found {v}"))),
            }
        };
        let f64_field = |field: &'static str, default: f64| -> Result<f64, ConfigError> {
            match raw.get(field) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v.as_f64().ok_or_else(|| err(field, format!("expected a number, found {v}"))),
            }
        };
        let model_type = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
        let arch = match model_type {
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "llama" | "mistral" => Arch::Llama,
            other => {
                return Err(err(
                    "model_type",
                    format!("`{other}` is not supported (expected qwen2, qwen3, llama or mistral)"),
                ))
            }
        };
        let hidden_size = usize_field("hidden_size")?;
        let num_heads = usize_field("num_attention_heads")?;
        let num_kv_heads = match raw.get("num_key_value_heads") {
            None | Some(Value::Null) => num_heads,
            Some(_) => usize_field("num_key_value_heads")?,
        };
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(err(
                "num_key_value_heads",
                format!("{num_kv_heads} must divide num_attention_heads = {num_heads}"),
            ));
        }
        let head_dim = match raw.get("head_dim") {
            None | Some(Value::Null) => {
                if hidden_size % num_heads != 0 {
                    return Err(err("hidden_size", format!("{hidden_size} is not a multiple of {num_heads} heads")));
                }
                hidden_size / num_heads
            }
            Some(_) => usize_field("head_dim")?,
        };
        if head_dim % 2 != 0 {
            return Err(err("head_dim", format!("{head_dim} must be even for rotary embeddings")));
        }
        let attention_bias = bool_field("attention_bias", false)?;
        let rope_scaling = match raw.get("rope_scaling") {
            None | Some(Value::Null) => RopeScaling::None,
            Some(v) => {
                let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(Value::as_str).unwrap_or("");
                let num = |k: &str, d: f64| v.get(k).and_then(Value::as_f64).unwrap_or(d);
                match kind {
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear { factor: num("factor", 1.0) },
                    "llama3" => RopeScaling::Llama3 {
                        factor: num("factor", 8.0),
                        low_freq_factor: num("low_freq_factor", 1.0),
                        high_freq_factor: num("high_freq_factor", 4.0),
                        original_max_position_embeddings: num("original_max_position_embeddings", 8192.0),
                    },
                    other => {
                        return Err(err(
                            "rope_scaling",
                            format!("rope type `{other}` is not supported (default, linear, llama3)"),
                        ))
                    }
                }
            }
        };
        let act = raw.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            return Err(err("hidden_act", format!("`{act}` is not supported (silu)")));
        }
        let cfg = ModelConfig {
            arch,
            vocab_size: usize_field("vocab_size")?,
            hidden_size,
            intermediate_size: usize_field("intermediate_size")?,
            num_layers: usize_field("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: f64_field("rms_norm_eps", 1e-6)?,
            rope_theta: f64_field("rope_theta", 10_000.0)?,
            rope_scaling,
            max_position_embeddings: raw.get("max_position_embeddings").and_then(Value::as_u64).unwrap_or(32_768)
                as usize,
            // transformers' Qwen2/Qwen3/Llama configs default to untied.
            tie_word_embeddings: bool_field("tie_word_embeddings", false)?,
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: arch == Arch::Llama && attention_bias,
            mlp_bias: arch == Arch::Llama && bool_field("mlp_bias", false)?,
            qk_norm: arch == Arch::Qwen3,
            raw: Value::Null,
        };
        Ok(ModelConfig { raw, ..cfg })
    }

    /// The `torch_dtype` / `dtype` recorded in the config, if any.
    pub fn dtype_name(&self) -> Option<&str> {
        self.raw.get("torch_dtype").or_else(|| self.raw.get("dtype")).and_then(Value::as_str)
    }

    /// Total number of parameters.
    pub fn num_parameters(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let mut layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.o_bias {
            layer += h;
        }
        if self.mlp_bias {
            layer += 2 * i + h;
        }
        if self.qk_norm {
            layer += 2 * self.head_dim;
        }
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_layers * layer + h + head
    }

    /// The config of a small random model of `arch` (for `grpo init-tiny`).
    #[allow(clippy::too_many_arguments)]
    pub fn tiny(
        arch: Arch,
        vocab_size: usize,
        layers: usize,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        intermediate: usize,
        bos: Option<u32>,
        eos: Option<u32>,
    ) -> Result<Self, ConfigError> {
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
        Self::from_json(raw, Path::new("<tiny config>"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_config_is_llama_tied_gqa() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/models/smollm2-135m-instruct/config.json");
        if !p.exists() {
            eprintln!("skipped: {} not present", p.display());
            return;
        }
        let c = ModelConfig::from_file(&p).unwrap();
        assert_eq!(c.arch, Arch::Llama);
        assert!(c.tie_word_embeddings);
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (9, 3, 64));
        assert!(!c.qkv_bias);
        assert_eq!(c.rope_theta, 1e5);
        // 134.5M parameters as published.
        assert_eq!(c.num_parameters(), 134_515_008);
    }

    #[test]
    fn qwen2_has_qkv_bias_and_is_untied_by_default() {
        let raw = serde_json::json!({"model_type": "qwen2", "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2});
        let c = ModelConfig::from_json(raw, Path::new("c.json")).unwrap();
        assert!(c.qkv_bias && !c.tie_word_embeddings && !c.qk_norm);
        assert_eq!(c.head_dim, 8);
    }

    #[test]
    fn bad_fields_are_named() {
        let raw = serde_json::json!({"model_type": "gpt2"});
        let e = ModelConfig::from_json(raw, Path::new("c.json")).unwrap_err().to_string();
        assert!(e.contains("model_type") && e.contains("gpt2"), "{e}");
        let raw = serde_json::json!({"model_type": "llama", "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3});
        let e = ModelConfig::from_json(raw, Path::new("c.json")).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
    }
}
