//! `config.json` of Qwen2 / Qwen2.5, Qwen3 and Llama-style models, in the layout transformers 4 writes
//! (top-level `rope_theta`, `rope_scaling`, `torch_dtype`) and the one transformers 5 writes
//! (`rope_parameters: {rope_type, rope_theta, ...}`, `dtype`).
//!
//! [`RawConfig`] is the file as serde reads it (every field optional); [`ModelConfig::from_json`]
//! validates it: a missing size is an error naming the key, and so is any key that changes the numerics
//! and that the decoder does not implement (an unknown rope type, sliding-window attention in use, a
//! partial rotary factor, an activation other than SiLU) — never a silent default.

use std::path::{Path, PathBuf};

use serde::Deserialize;
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
    Field { path: PathBuf, field: String, message: String },
}

/// Rotary embedding frequency scaling (`rope_scaling` in transformers 4, `rope_parameters` in 5).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { factor: f64 },
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

impl RopeScaling {
    /// The scaling as a rope dict (`rope_type` and its parameters, plus `rope_theta` when given).
    fn to_json(&self, theta: Option<f64>) -> Value {
        let mut v = match self {
            RopeScaling::None => serde_json::json!({"rope_type": "default"}),
            RopeScaling::Linear { factor } => serde_json::json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                // A length, which transformers validates as an integer.
                let original = match *original_max_position_embeddings {
                    n if n.fract() == 0.0 && (0.0..9e15).contains(&n) => Value::from(n as u64),
                    n => Value::from(n),
                };
                serde_json::json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor, "original_max_position_embeddings": original})
            }
        };
        if let Some(t) = theta {
            v["rope_theta"] = t.into();
        }
        v
    }
}

/// config.json as serde reads it: every field of the Qwen2 / Qwen3 / Llama / Mistral configs that the
/// decoder reads or must refuse, all optional (absent and `null` alike); [`ModelConfig::from_json`]
/// decides what is required. Keys that HF spells two ways and that may appear together in one file
/// (`rope_scaling` / `rope_parameters`, `type` / `rope_type`) are separate fields rather than serde
/// aliases, which would reject such files as duplicates; validation reconciles them. (The dtype, under
/// `torch_dtype` or `dtype`, is read from `raw` by [`ModelConfig::dtype_name`].)
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    hidden_act: Option<String>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    /// transformers 4: the rotary base at the top level, its scaling in `rope_scaling`.
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    /// transformers 5: base and scaling together.
    rope_parameters: Option<RawRope>,
    partial_rotary_factor: Option<f64>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    max_window_layers: Option<usize>,
    /// transformers 5 (Qwen2 / Qwen3): `full_attention` or `sliding_attention` per layer.
    layer_types: Option<Vec<String>>,
}

/// A `rope_scaling` / `rope_parameters` dict. Keys it does not name end up in `other` and are refused:
/// everything in this dict changes the rotary frequencies.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawRope {
    rope_type: Option<String>,
    /// transformers' older spelling of `rope_type`.
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    partial_rotary_factor: Option<f64>,
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// Builds [`ConfigError::Field`] for one file.
struct Fields<'a>(&'a Path);

impl Fields<'_> {
    fn err(&self, field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::Field { path: self.0.into(), field: field.into(), message: message.into() }
    }

    fn required(&self, value: Option<usize>, field: &str) -> Result<usize, ConfigError> {
        value.ok_or_else(|| self.err(field, "missing (a non-negative integer is required)"))
    }

    /// The serde error of `raw`, attributed to the first top-level key that fails on its own.
    fn parse_error(&self, raw: &Value, e: serde_json::Error) -> ConfigError {
        if let Value::Object(map) = raw {
            for (k, v) in map {
                let one = Value::Object(std::iter::once((k.clone(), v.clone())).collect());
                if let Err(e) = RawConfig::deserialize(&one) {
                    return self.err(k.as_str(), e.to_string());
                }
            }
            return self.err("<config>", e.to_string());
        }
        self.err("<config>", format!("expected a JSON object ({e})"))
    }
}

/// One rope dict as a scaling; `name` is its key in config.json (for messages).
fn rope_scaling(r: &RawRope, name: &str, f: &Fields) -> Result<RopeScaling, ConfigError> {
    if let Some(key) = r.other.keys().next() {
        return Err(f.err(format!("{name}.{key}"), "not understood (it would change the rotary embedding)"));
    }
    if let Some(p) = r.partial_rotary_factor.filter(|&p| p != 1.0) {
        return Err(f.err(format!("{name}.partial_rotary_factor"), format!("{p}: only 1.0 is supported")));
    }
    let kind = match (&r.rope_type, &r.legacy_type) {
        (Some(a), Some(b)) if a != b => {
            return Err(f.err(format!("{name}.rope_type"), format!("`{a}` but `type` says `{b}`")));
        }
        (Some(t), _) | (None, Some(t)) => t.as_str(),
        (None, None) if r.factor.is_some() => {
            return Err(f.err(format!("{name}.rope_type"), "missing (a `factor` is given)"));
        }
        (None, None) => "default",
    };
    let num = |v: Option<f64>, key: &str| v.ok_or_else(|| f.err(format!("{name}.{key}"), format!("missing ({kind})")));
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: num(r.factor, "factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: num(r.factor, "factor")?,
            low_freq_factor: num(r.low_freq_factor, "low_freq_factor")?,
            high_freq_factor: num(r.high_freq_factor, "high_freq_factor")?,
            original_max_position_embeddings: num(
                r.original_max_position_embeddings,
                "original_max_position_embeddings",
            )?,
        },
        other => {
            return Err(
                f.err(format!("{name}.rope_type"), format!("`{other}` is not supported (default, linear, llama3)"))
            )
        }
    })
}

/// The rotary base and scaling from either layout. Where both layouts are present they must agree
/// (transformers 4 reads only the top-level keys, transformers 5 prefers `rope_scaling`, then
/// `rope_parameters`); the base defaults to 10000 as in transformers when neither gives one.
fn rope(raw: &RawConfig, f: &Fields) -> Result<(f64, RopeScaling), ConfigError> {
    if let Some(p) = raw.partial_rotary_factor.filter(|&p| p != 1.0) {
        return Err(f.err("partial_rotary_factor", format!("{p}: only 1.0 is supported")));
    }
    let dicts = [("rope_scaling", &raw.rope_scaling), ("rope_parameters", &raw.rope_parameters)];
    let mut theta: Option<(f64, String)> = raw.rope_theta.map(|t| (t, "rope_theta".to_string()));
    let mut scaling: Option<(RopeScaling, &str)> = None;
    for (name, dict) in dicts {
        let Some(d) = dict else { continue };
        if let Some(t) = d.rope_theta {
            match &theta {
                Some((t0, at)) if *t0 != t => {
                    return Err(f.err(format!("{name}.rope_theta"), format!("{t}, but `{at}` is {t0}")));
                }
                _ => theta = Some((t, format!("{name}.rope_theta"))),
            }
        }
        let s = rope_scaling(d, name, f)?;
        match &scaling {
            Some((s0, at)) if *s0 != s => {
                return Err(f.err(name, format!("{s:?} disagrees with `{at}` ({s0:?})")));
            }
            _ => scaling = Some((s, name)),
        }
    }
    if let Some((t, at)) = &theta {
        if !(t.is_finite() && *t > 0.0) {
            return Err(f.err(at.as_str(), format!("{t}: must be a positive number")));
        }
    }
    Ok((theta.map_or(10_000.0, |(t, _)| t), scaling.map_or(RopeScaling::None, |(s, _)| s)))
}

/// Refuse sliding-window attention wherever transformers would apply it: Mistral on every layer when
/// `sliding_window` is set; Qwen2 / Qwen3 when `use_sliding_window` is true, on the layers `layer_types`
/// marks `sliding_attention` (transformers 5) or else on layers from `max_window_layers` (default 28) on.
fn check_full_attention(raw: &RawConfig, layers: usize, f: &Fields) -> Result<(), ConfigError> {
    if let Some(kinds) = &raw.layer_types {
        if let Some(k) = kinds.iter().find(|k| *k != "full_attention" && *k != "sliding_attention") {
            return Err(f.err("layer_types", format!("`{k}` is not supported (full_attention)")));
        }
    }
    let window = match raw.model_type.as_deref() {
        Some("mistral") => raw.sliding_window.map(|w| (w, "sliding_window")),
        Some("qwen2" | "qwen3") if raw.use_sliding_window == Some(true) => {
            raw.sliding_window.map(|w| (w, "use_sliding_window"))
        }
        _ => None,
    };
    let Some((w, key)) = window else { return Ok(()) };
    let sliding_layers = match (raw.model_type.as_deref(), &raw.layer_types) {
        (Some("mistral"), _) => layers,
        (_, Some(kinds)) => kinds.iter().filter(|k| *k == "sliding_attention").count(),
        (_, None) => layers.saturating_sub(raw.max_window_layers.unwrap_or(28)),
    };
    if sliding_layers > 0 {
        return Err(
            f.err(key, format!("sliding-window attention (window {w}) on {sliding_layers} layers is not supported"))
        );
    }
    Ok(())
}

/// The sizes a config.json may give, with the largest value accepted for each: far above any released
/// model (vocabularies of 262k, hidden 16k, MLP 53k, 126 layers, 128 heads, 10M positions), low enough
/// that parameter counts and the memory plan's products of them cannot overflow. Zero is refused too.
const SIZE_BOUNDS: [(&str, usize); 8] = [
    ("vocab_size", 1 << 24),
    ("hidden_size", 1 << 20),
    ("intermediate_size", 1 << 20),
    ("num_hidden_layers", 1 << 12),
    ("num_attention_heads", 1 << 12),
    ("num_key_value_heads", 1 << 12),
    ("head_dim", 1 << 14),
    ("max_position_embeddings", 1 << 28),
];

/// Refuse a size of `raw` outside [1, its bound of [`SIZE_BOUNDS`]], naming its key.
fn check_sizes(raw: &RawConfig, f: &Fields) -> Result<(), ConfigError> {
    let values = [
        raw.vocab_size,
        raw.hidden_size,
        raw.intermediate_size,
        raw.num_hidden_layers,
        raw.num_attention_heads,
        raw.num_key_value_heads,
        raw.head_dim,
        raw.max_position_embeddings,
    ];
    for ((key, max), value) in SIZE_BOUNDS.iter().zip(values) {
        match value {
            Some(0) => return Err(f.err(*key, "0: must be at least 1")),
            Some(v) if v > *max => return Err(f.err(*key, format!("{v} is not a plausible size (at most {max})"))),
            _ => {}
        }
    }
    Ok(())
}

/// The top-level keys of config.json that grpo reads: [`RawConfig`]'s fields, the dtype's two names and
/// `eos_token_id` (read by the tokenizer).
const READ_KEYS: [&str; 25] = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
    "torch_dtype",
    "dtype",
    "eos_token_id",
];

/// Keys that transformers' configs (`PretrainedConfig` and the decoder configs) may hold and that grpo does
/// not read: ignored, as transformers ignores what a model does not use, even when one is spelled close to
/// a key grpo reads (`bos_token_id`, an edit from `eos_token_id`).
const KNOWN_KEYS: [&str; 34] = [
    "architectures",
    "_name_or_path",
    "_attn_implementation",
    "attention_dropout",
    "bos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "initializer_range",
    "use_cache",
    "transformers_version",
    "pretraining_tp",
    "quantization_config",
    "id2label",
    "label2id",
    "is_decoder",
    "is_encoder_decoder",
    "tie_encoder_decoder",
    "use_bfloat16",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "torchscript",
    "max_length",
    "min_length",
    "num_beams",
    "temperature",
    "top_k",
    "top_p",
    "task_specific_params",
    "problem_type",
    "tokenizer_class",
    "rope_type",
    "layer_norm_eps",
];

/// Refuse a top-level key of `raw` that grpo does not read, that is no known transformers key, and that is
/// within two edits of a key grpo reads: a misspelling (`rope_thetta`), whose intended key would otherwise
/// silently take its default. Other unknown keys are ignored, as transformers ignores them.
fn check_misspelled_keys(raw: &Value, f: &Fields) -> Result<(), ConfigError> {
    let Value::Object(map) = raw else { return Ok(()) };
    for key in map.keys() {
        if READ_KEYS.contains(&key.as_str()) || KNOWN_KEYS.contains(&key.as_str()) {
            continue;
        }
        let nearest = READ_KEYS.iter().min_by_key(|k| strsim::levenshtein(key, k));
        if let Some(near) = nearest.filter(|k| strsim::levenshtein(key, k) <= 2) {
            return Err(f.err(
                key.as_str(),
                format!("not a key grpo reads: did you mean `{near}`? (as it is, `{near}` would take its default)"),
            ));
        }
    }
    Ok(())
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
    /// o_proj has a bias (`attention_bias` of Llama and Qwen3).
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
        let f = Fields(path);
        let c = RawConfig::deserialize(&raw).map_err(|e| f.parse_error(&raw, e))?;
        check_misspelled_keys(&raw, &f)?;
        let arch = match c.model_type.as_deref() {
            Some("qwen2") => Arch::Qwen2,
            Some("qwen3") => Arch::Qwen3,
            Some("llama" | "mistral") => Arch::Llama,
            other => {
                return Err(f.err(
                    "model_type",
                    format!("`{}` is not supported (expected qwen2, qwen3, llama or mistral)", other.unwrap_or("")),
                ))
            }
        };
        check_sizes(&c, &f)?;
        let hidden_size = f.required(c.hidden_size, "hidden_size")?;
        let num_heads = f.required(c.num_attention_heads, "num_attention_heads")?;
        let num_layers = f.required(c.num_hidden_layers, "num_hidden_layers")?;
        let num_kv_heads = c.num_key_value_heads.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(
                f.err("num_key_value_heads", format!("{num_kv_heads} must divide num_attention_heads = {num_heads}"))
            );
        }
        let head_dim = match c.head_dim {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => return Err(f.err("hidden_size", format!("{hidden_size} is not a multiple of {num_heads} heads"))),
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(f.err("head_dim", format!("{head_dim} must be even and positive for rotary embeddings")));
        }
        let act = c.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" && act != "swish" {
            return Err(f.err("hidden_act", format!("`{act}` is not supported (silu)")));
        }
        let (rope_theta, rope_scaling) = rope(&c, &f)?;
        check_full_attention(&c, num_layers, &f)?;
        let attention_bias = c.attention_bias.unwrap_or(false);
        Ok(ModelConfig {
            arch,
            vocab_size: f.required(c.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: f.required(c.intermediate_size, "intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: c.max_position_embeddings.unwrap_or(32_768),
            // transformers' Qwen2/Qwen3/Llama configs default to untied.
            tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            // Qwen2's o_proj never has a bias; Llama's and Qwen3's follow `attention_bias`.
            o_bias: arch != Arch::Qwen2 && attention_bias,
            mlp_bias: arch == Arch::Llama && c.mlp_bias.unwrap_or(false),
            qk_norm: arch == Arch::Qwen3,
            raw,
        })
    }

    /// The config.json of a checkpoint with weights in `dtype` (`"bfloat16"`, ...): the original keys,
    /// the dtype under both names (`torch_dtype` in older transformers, `dtype` in recent ones), and the rotary settings in both layouts, so that
    /// transformers 4 (top-level `rope_theta` / `rope_scaling`; it keeps `rope_parameters` as an unused
    /// attribute) and transformers 5 (`rope_scaling` when set, else `rope_parameters`) build the same model.
    pub fn hf_json(&self, dtype: &str) -> Value {
        let mut v = self.raw.clone();
        v["torch_dtype"] = dtype.into();
        v["dtype"] = dtype.into();
        v["rope_theta"] = self.rope_theta.into();
        v["rope_scaling"] = match self.rope_scaling {
            RopeScaling::None => Value::Null,
            ref s => s.to_json(None),
        };
        v["rope_parameters"] = self.rope_scaling.to_json(Some(self.rope_theta));
        v
    }

    /// The `torch_dtype` / `dtype` recorded in the config, if any.
    pub fn dtype_name(&self) -> Option<&str> {
        self.raw.get("torch_dtype").or_else(|| self.raw.get("dtype")).and_then(Value::as_str)
    }

    /// Total number of parameters (in u128, clamped to usize::MAX: with the sizes validation accepts,
    /// no product comes near either bound).
    pub fn num_parameters(&self) -> usize {
        let w = |x: usize| x as u128;
        let (h, i, v) = (w(self.hidden_size), w(self.intermediate_size), w(self.vocab_size));
        let q = w(self.num_heads) * w(self.head_dim);
        let kv = w(self.num_kv_heads) * w(self.head_dim);
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
            layer += 2 * w(self.head_dim);
        }
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        let total = v * h + w(self.num_layers) * layer + h + head;
        total.min(usize::MAX as u128) as usize
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

    fn base(model_type: &str) -> Value {
        serde_json::json!({"model_type": model_type, "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2})
    }

    /// The error of `base(model_type)` with `patch` applied: it must name `field`.
    fn error_naming(model_type: &str, patch: Value, field: &str) -> String {
        let mut raw = base(model_type);
        for (k, v) in patch.as_object().unwrap() {
            raw[k] = v.clone();
        }
        let e = ModelConfig::from_json(raw, Path::new("c.json")).unwrap_err();
        match &e {
            ConfigError::Field { field: f, .. } if f == field => e.to_string(),
            _ => panic!("expected an error naming `{field}`, got: {e}"),
        }
    }

    #[test]
    fn rope_parameters_of_transformers_5_are_read() {
        let mut raw = base("llama");
        raw["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 100000.0});
        let c = ModelConfig::from_json(raw, Path::new("c.json")).unwrap();
        assert_eq!((c.rope_theta, c.rope_scaling), (1e5, RopeScaling::None));
        let mut raw = base("llama");
        raw["rope_parameters"] = serde_json::json!({"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0});
        let c = ModelConfig::from_json(raw, Path::new("c.json")).unwrap();
        assert_eq!((c.rope_theta, c.rope_scaling), (5e5, RopeScaling::Linear { factor: 2.0 }));
        // Neither layout: transformers' default base.
        assert_eq!(ModelConfig::from_json(base("qwen2"), Path::new("c.json")).unwrap().rope_theta, 1e4);
    }

    #[test]
    fn numerics_keys_that_are_not_understood_are_errors() {
        use serde_json::json;
        let e = error_naming(
            "llama",
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
            "rope_scaling.rope_type",
        );
        assert!(e.contains("yarn"), "{e}");
        error_naming(
            "llama",
            json!({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}),
            "rope_parameters.rope_type",
        );
        error_naming("llama", json!({"rope_scaling": {"type": "linear"}}), "rope_scaling.factor");
        error_naming(
            "llama",
            json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
            "rope_scaling.low_freq_factor",
        );
        error_naming("llama", json!({"rope_scaling": {"factor": 8.0}}), "rope_scaling.rope_type");
        // Per-layer-type rope dicts (Gemma-3 style) and unknown rope keys.
        error_naming(
            "qwen3",
            json!({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}}),
            "rope_parameters.full_attention",
        );
        error_naming("llama", json!({"partial_rotary_factor": 0.5}), "partial_rotary_factor");
        error_naming(
            "llama",
            json!({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}}),
            "rope_parameters.partial_rotary_factor",
        );
        let e = error_naming("llama", json!({"hidden_act": "gelu"}), "hidden_act");
        assert!(e.contains("gelu"), "{e}");
        // The two layouts disagree.
        error_naming(
            "llama",
            json!({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e5}}),
            "rope_parameters.rope_theta",
        );
        error_naming(
            "llama",
            json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}}),
            "rope_parameters",
        );
    }

    #[test]
    fn sliding_window_attention_in_use_is_an_error() {
        use serde_json::json;
        // In use: Qwen2 with the window on layers from max_window_layers on, transformers 5's layer_types,
        // Mistral with any window.
        error_naming(
            "qwen2",
            json!({"use_sliding_window": true, "sliding_window": 4096, "max_window_layers": 2}),
            "use_sliding_window",
        );
        error_naming(
            "qwen3",
            json!({"use_sliding_window": true, "sliding_window": 4096, "layer_types":
            ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]}),
            "use_sliding_window",
        );
        error_naming("mistral", json!({"sliding_window": 4096}), "sliding_window");
        error_naming("qwen2", json!({"layer_types": ["full_attention", "chunked_attention"]}), "layer_types");
        // Not in use: switched off, or on no layer (max_window_layers >= layers), or no window at all.
        for patch in [
            json!({"use_sliding_window": false, "sliding_window": 4096, "max_window_layers": 2}),
            json!({"use_sliding_window": true, "sliding_window": 4096, "max_window_layers": 4}),
            json!({"use_sliding_window": true, "sliding_window": null}),
            json!({"use_sliding_window": false, "sliding_window": null, "layer_types": ["full_attention", "full_attention", "full_attention", "full_attention"]}),
        ] {
            let mut raw = base("qwen2");
            for (k, v) in patch.as_object().unwrap() {
                raw[k] = v.clone();
            }
            ModelConfig::from_json(raw, Path::new("c.json")).unwrap_or_else(|e| panic!("{patch}: {e}"));
        }
    }

    #[test]
    fn wrong_types_and_missing_sizes_name_the_key() {
        use serde_json::json;
        let e = error_naming("llama", json!({"hidden_size": "576"}), "hidden_size");
        assert!(e.contains("576"), "{e}");
        error_naming("llama", json!({"rope_scaling": {"rope_type": "linear", "factor": "2"}}), "rope_scaling");
        error_naming("llama", json!({"vocab_size": null}), "vocab_size");
        error_naming("llama", json!({"rope_theta": -1.0}), "rope_theta");
    }

    #[test]
    fn absurd_sizes_are_refused_naming_the_key_and_file() {
        use serde_json::json;
        let cases = [
            ("vocab_size", json!(u64::MAX)),
            ("num_hidden_layers", json!(1_000_000_000u64)),
            ("hidden_size", json!(1u64 << 40)),
            ("intermediate_size", json!(0)),
            ("max_position_embeddings", json!(1u64 << 40)),
            ("head_dim", json!(1u64 << 20)),
        ];
        for (key, value) in cases {
            let e = error_naming("qwen2", json!({ key: value }), key);
            assert!(e.starts_with("c.json: field `") && e.contains(&value.to_string()), "{e}");
        }
        // The largest real shapes pass: a 262k vocabulary, 126 layers, hidden 16384.
        let big = json!({"vocab_size": 262_144, "num_hidden_layers": 126, "hidden_size": 16_384,
            "intermediate_size": 53_248, "num_attention_heads": 128, "num_key_value_heads": 8});
        let mut raw = base("llama");
        for (k, v) in big.as_object().unwrap() {
            raw[k] = v.clone();
        }
        assert_eq!(ModelConfig::from_json(raw, Path::new("c.json")).unwrap().num_layers, 126);
    }

    #[test]
    fn qwen3_attention_bias_covers_o_proj() {
        let mut raw = base("qwen3");
        raw["attention_bias"] = true.into();
        let c = ModelConfig::from_json(raw, Path::new("c.json")).unwrap();
        assert!(c.qkv_bias && c.o_bias && c.qk_norm);
        let mut raw = base("qwen2");
        raw["attention_bias"] = true.into();
        let c = ModelConfig::from_json(raw, Path::new("c.json")).unwrap();
        assert!(c.qkv_bias && !c.o_bias);
    }

    #[test]
    fn a_key_an_edit_or_two_from_one_grpo_reads_is_an_error_naming_it() {
        use serde_json::json;
        let e = error_naming("qwen2", json!({"num_key_value_head": 2}), "num_key_value_head");
        assert!(e.contains("did you mean `num_key_value_heads`"), "{e}");
        let e = error_naming("llama", json!({"rope_thetta": 5e5}), "rope_thetta");
        assert!(e.contains("`rope_theta`"), "{e}");
        error_naming("llama", json!({"tie_word_embedding": true}), "tie_word_embedding");
        // Keys nobody reads, far from grpo's or known to transformers, are ignored.
        let mut raw = base("llama");
        for (k, v) in [
            ("bos_token_id", json!(1)),
            ("pad_token_id", json!(0)),
            ("vision_config", json!({})),
            ("attention_dropout", json!(0.0)),
            ("rope_type", json!("default")),
            ("layer_norm_eps", json!(1e-5)),
        ] {
            raw[k] = v;
        }
        ModelConfig::from_json(raw, Path::new("c.json")).unwrap();
    }

    #[test]
    fn every_key_grpo_says_it_reads_is_read() {
        // A value of the wrong type fails the parse of each field of RawConfig; the other keys of READ_KEYS
        // are read from the JSON itself.
        for key in READ_KEYS.iter().filter(|k| !["torch_dtype", "dtype", "eos_token_id"].contains(k)) {
            let mut raw = base("llama");
            raw[*key] = serde_json::json!([[1]]);
            assert!(ModelConfig::from_json(raw, Path::new("c.json")).is_err(), "{key} is not read");
        }
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
