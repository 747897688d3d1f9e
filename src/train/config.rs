//! The training configuration: TOML with unknown keys rejected (naming the key and the nearest valid
//! one), `--set section.key=value` overrides, and validation before any model is loaded.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::optim::OptimConfig;
use crate::data::Overlong;
use crate::model::Arch;
use crate::objective::ObjectiveConfig;

/// Errors of reading and checking a config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("--set {0}: expected section.key=value")]
    BadOverride(String),
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// A small random model the trainer creates itself when `model.path` does not exist (smoke runs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TinySpec {
    pub arch: Arch,
    pub tokenizer: PathBuf,
    #[serde(default = "d2")]
    pub layers: usize,
    #[serde(default = "d64")]
    pub hidden: usize,
    #[serde(default = "d4")]
    pub heads: usize,
    #[serde(default = "d2")]
    pub kv_heads: usize,
    #[serde(default = "d128")]
    pub intermediate: usize,
    #[serde(default)]
    pub seed: u64,
}

fn d2() -> usize {
    2
}
fn d4() -> usize {
    4
}
fn d64() -> usize {
    64
}
fn d128() -> usize {
    128
}

/// `[model]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// Folder or hub id of the policy's initial weights.
    pub path: String,
    /// Create a tiny random model at `path` when it does not exist.
    pub init_tiny: Option<TinySpec>,
    /// Weights and activations: f32, bf16 or f16 (log-probs, loss and optimiser state are f32).
    pub dtype: String,
    /// cpu, cuda or cuda:N.
    pub device: String,
    /// The frozen reference model (default: the policy's initial weights). Loaded only when beta > 0.
    pub reference: Option<String>,
    /// Recompute each layer in the backward pass (less memory, about 30% more compute).
    pub checkpoint_layers: bool,
    /// Memory budget (MiB) of one chunk of logits in the log-prob op.
    pub logprob_chunk_mb: usize,
    /// Use the fused RMSNorm, rope and attention-softmax kernels (false: candle's composite ops, slower;
    /// for checking the kernels).
    pub fused_ops: bool,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            path: String::new(),
            init_tiny: None,
            dtype: "f32".into(),
            device: "cpu".into(),
            reference: None,
            checkpoint_layers: false,
            logprob_chunk_mb: 64,
            fused_ops: true,
        }
    }
}

/// `[data]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Teacher trajectories: JSONL / Parquet files, folders or globs.
    pub inputs: Vec<String>,
    /// Where the tokenised shards go (default OUTPUT/prepared); re-used when up to date.
    pub prepared_dir: Option<PathBuf>,
    /// Answers per question (G).
    pub group_size: usize,
    pub min_group_size: usize,
    pub max_prompt_tokens: usize,
    pub max_response_tokens: usize,
    pub overlong: Overlong,
    pub system_prompt: Option<String>,
    pub domains: Vec<String>,
    pub sources: Vec<String>,
    /// Fail on the first bad row instead of skipping it.
    pub strict: bool,
    /// Shuffle the question order each epoch (from train.seed); false keeps file order.
    pub shuffle: bool,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            inputs: vec![],
            prepared_dir: None,
            group_size: 8,
            min_group_size: 2,
            max_prompt_tokens: 2048,
            max_response_tokens: 16384,
            overlong: Overlong::Truncate,
            system_prompt: None,
            domains: vec![],
            sources: vec![],
            strict: false,
            shuffle: true,
        }
    }
}

/// `[train]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    pub output_dir: PathBuf,
    /// Questions per optimiser step (each with its G answers).
    pub batch_questions: usize,
    /// Sequences per forward/backward (gradient accumulation over micro-batches).
    pub micro_batch_size: usize,
    pub epochs: usize,
    /// Stop after this many steps (0: run all epochs).
    pub max_steps: usize,
    pub seed: u64,
    /// Write a checkpoint every N steps (0: only at the end of each epoch and of the run).
    pub save_every: usize,
    /// Checkpoints kept (the newest); OUTPUT/best is kept apart.
    pub keep_last: usize,
    /// Stop after this many consecutive steps with a non-finite loss or gradient.
    pub max_bad_steps: usize,
    /// dtype of the saved HF weights (default: the model's).
    pub save_dtype: Option<String>,
}

impl Default for TrainSection {
    fn default() -> Self {
        Self {
            output_dir: PathBuf::from("runs/grpo"),
            batch_questions: 32,
            micro_batch_size: 8,
            epochs: 1,
            max_steps: 0,
            seed: 0,
            save_every: 0,
            keep_last: 2,
            max_bad_steps: 3,
            save_dtype: None,
        }
    }
}

/// `[validation]`: evaluate on a benchmark during training and keep the best checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValidationSection {
    /// A registered benchmark (aime24, aime25, amc23, math500).
    pub bench: String,
    /// Every N steps (0: at the end of each epoch).
    pub every_steps: usize,
    /// Samples per problem.
    pub n: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub max_new_tokens: usize,
    /// Only the first K problems (0: all).
    pub limit: usize,
    /// Prompts generated together.
    pub batch_size: usize,
    pub system_prompt: Option<String>,
}

impl Default for ValidationSection {
    fn default() -> Self {
        Self {
            bench: "aime24".into(),
            every_steps: 0,
            n: 1,
            temperature: 0.0,
            top_p: 1.0,
            max_new_tokens: 4096,
            limit: 0,
            batch_size: 16,
            system_prompt: None,
        }
    }
}

/// The whole training configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub model: ModelSection,
    pub data: DataSection,
    #[serde(default)]
    pub objective: ObjectiveConfig,
    #[serde(default)]
    pub optim: OptimConfig,
    #[serde(default)]
    pub train: TrainSection,
    #[serde(default)]
    pub validation: Option<ValidationSection>,
}

/// Add "did you mean" to serde's "unknown field `x`, expected one of `a`, `b`" messages.
fn suggest(message: &str) -> String {
    let Some(start) = message.find("unknown field `") else { return message.to_string() };
    let rest = &message[start + "unknown field `".len()..];
    let Some(end) = rest.find('`') else { return message.to_string() };
    let unknown = &rest[..end];
    let candidates: Vec<&str> = rest[end..].split('`').skip(2).step_by(2).collect();
    match candidates.iter().min_by_key(|c| strsim::levenshtein(unknown, c)) {
        Some(best) if strsim::levenshtein(unknown, best) <= unknown.len().max(3) / 2 + 1 => {
            format!("{} (did you mean `{best}`?)", message.trim_end())
        }
        _ => message.to_string(),
    }
}

/// Parse `value` of a `--set` as a TOML value (number, bool, array, quoted string), else as a bare string.
fn parse_value(value: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {value}")) {
        Ok(mut t) => t.remove("v").unwrap_or(toml::Value::String(value.into())),
        Err(_) => toml::Value::String(value.into()),
    }
}

impl TrainConfig {
    /// Read a config file and apply `--set section.key=value` overrides.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: path.into(), source })?;
        Self::parse(&text, path, overrides)
    }

    /// Parse config text (`path` names it in messages).
    pub fn parse(text: &str, path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        let mut table: toml::Table = toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: path.into(), message: suggest(&e.to_string()) })?;
        for o in overrides {
            let (key, value) = o.split_once('=').ok_or_else(|| ConfigError::BadOverride(o.clone()))?;
            let parts: Vec<&str> = key.trim().split('.').collect();
            if parts.iter().any(|p| p.is_empty()) {
                return Err(ConfigError::BadOverride(o.clone()));
            }
            let mut cur = &mut table;
            for p in &parts[..parts.len() - 1] {
                let entry = cur.entry(p.to_string()).or_insert_with(|| toml::Value::Table(Default::default()));
                cur = entry
                    .as_table_mut()
                    .ok_or_else(|| ConfigError::BadOverride(format!("{o}: `{p}` is not a section")))?;
            }
            cur.insert(parts[parts.len() - 1].to_string(), parse_value(value.trim()));
        }
        let cfg: TrainConfig = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse { path: path.into(), message: suggest(&e.to_string()) })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Everything that can be checked without loading a model or reading data.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.model.path.is_empty() {
            return bad("model.path is required".into());
        }
        crate::model::parse_dtype(&self.model.dtype).map_err(|e| ConfigError::Invalid(format!("model.dtype: {e}")))?;
        if !(self.model.device == "cpu" || self.model.device == "cuda" || self.model.device.starts_with("cuda:")) {
            return bad(format!("model.device = `{}`: expected cpu, cuda or cuda:N", self.model.device));
        }
        if self.data.inputs.is_empty() {
            return bad("data.inputs is empty: give the teacher trajectories (files, folders or globs)".into());
        }
        if self.data.group_size == 1 {
            return bad("data.group_size = 1: a group needs at least 2 answers (0 keeps all)".into());
        }
        if self.train.batch_questions == 0 || self.train.micro_batch_size == 0 {
            return bad("train.batch_questions and train.micro_batch_size must be >= 1".into());
        }
        if self.train.epochs == 0 && self.train.max_steps == 0 {
            return bad("train.epochs and train.max_steps are both 0: nothing to do".into());
        }
        if let Some(d) = &self.train.save_dtype {
            crate::model::parse_dtype(d).map_err(|e| ConfigError::Invalid(format!("train.save_dtype: {e}")))?;
        }
        self.objective.validate().map_err(ConfigError::Invalid)?;
        self.optim.validate().map_err(ConfigError::Invalid)?;
        if let Some(v) = &self.validation {
            if v.n == 0 || v.max_new_tokens == 0 {
                return bad("validation.n and validation.max_new_tokens must be >= 1".into());
            }
            if !crate::eval::bench::names().contains(&v.bench.as_str()) {
                return bad(format!(
                    "validation.bench = `{}` is not a registered benchmark ({})",
                    v.bench,
                    crate::eval::bench::names().join(", ")
                ));
            }
        }
        Ok(())
    }

    /// The resolved configuration as TOML (written into the output folder).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = "[model]\npath = \"m\"\n[data]\ninputs = [\"x.jsonl\"]\n";

    #[test]
    fn unknown_keys_name_the_key_and_the_nearest_valid_one() {
        let e = TrainConfig::parse(&format!("{MIN}[objective]\nbetta = 0.1\n"), Path::new("c.toml"), &[]).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("betta") && m.contains("did you mean `beta`"), "{m}");
        let e =
            TrainConfig::parse(&format!("{MIN}[train]\nbatch_question = 4\n"), Path::new("c.toml"), &[]).unwrap_err();
        assert!(e.to_string().contains("did you mean `batch_questions`"), "{e}");
        let e = TrainConfig::parse(&format!("{MIN}[trian]\nx = 1\n"), Path::new("c.toml"), &[]).unwrap_err();
        assert!(e.to_string().contains("did you mean `train`"), "{e}");
    }

    #[test]
    fn overrides_apply_and_are_validated() {
        let c = TrainConfig::parse(
            MIN,
            Path::new("c.toml"),
            &["objective.beta=0.05".into(), "objective.name=sft".into(), "train.output_dir=runs/x".into()],
        )
        .unwrap();
        assert_eq!(c.objective.beta, 0.05);
        assert_eq!(c.objective.name, crate::objective::ObjectiveName::Sft);
        assert_eq!(c.train.output_dir, PathBuf::from("runs/x"));
        let e = TrainConfig::parse(MIN, Path::new("c.toml"), &["objective.eps=2".into()]).unwrap_err();
        assert!(e.to_string().contains("objective.eps"), "{e}");
        assert!(TrainConfig::parse(MIN, Path::new("c.toml"), &["novalue".into()]).is_err());
        let e = TrainConfig::parse(MIN, Path::new("c.toml"), &["model.device=tpu".into()]).unwrap_err();
        assert!(e.to_string().contains("model.device"), "{e}");
    }

    #[test]
    fn resolved_config_round_trips() {
        let c = TrainConfig::parse(MIN, Path::new("c.toml"), &[]).unwrap();
        let back = TrainConfig::parse(&c.to_toml(), Path::new("resolved.toml"), &[]).unwrap();
        assert_eq!(c, back);
    }
}
