//! The training configuration: TOML with unknown keys rejected (naming the key and the nearest valid
//! one), `--set section.key=value` overrides, and validation before any model is loaded.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::optim::OptimConfig;
use super::reference_swap::ReferenceSwap;
use crate::data::{InputOptions, SequenceOptions};
use crate::device::{DTypeName, DeviceName};
use crate::model::tiny::TinySpec;
use crate::model::{Attention, DecoderOptions, LoraOptions};
use crate::objective::ObjectiveConfig;
use crate::rollout::RolloutOptions;

/// Errors of reading and checking a config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("--set {0}: expected section.key=value")]
    BadOverride(String),
    #[error("--set {set}: {message}")]
    BadOverrideValue { set: String, message: String },
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// `[model]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// Folder or hub id of the policy's initial weights.
    pub path: String,
    /// The hub revision of `path` when it is a hub id: a branch, tag or commit (as `org/name@revision`
    /// writes it; absent: `main`).
    pub revision: Option<String>,
    /// Create a tiny random model at `path` when it does not exist.
    pub init_tiny: Option<TinySpec>,
    /// Weights and activations: f32, bf16 or f16 (log-probs, loss and optimiser state are f32).
    pub dtype: DTypeName,
    /// cpu, cuda or cuda:N.
    pub device: DeviceName,
    /// The frozen reference model (default: the policy's initial weights). Loaded when the objective reads it
    /// (beta > 0 or anchor = reference) and its log-probs are not cached (cache_reference).
    pub reference: Option<String>,
    /// Recompute each layer in the backward pass (less memory, about 30% more compute).
    pub checkpoint_layers: bool,
    /// With `checkpoint_layers` and flash or mma attention: `false` keeps each layer's attention output
    /// and log-sum-exp from the forward (L x ([N, heads x head_dim] + 4 B heads N) more memory) and the
    /// recomputation skips the attention's forward, the costliest part of a long sequence's layer; `true`
    /// (the default) recomputes it with the layer.
    pub recompute_attention: bool,
    /// Memory budget (MiB) of one chunk of logits in the log-prob op; 0 (the default) sizes it from the
    /// device: on a GPU an eighth of the memory the plan leaves free when the head runs, within 1-8 GiB,
    /// 64 MiB on the CPU (decided before the model loads and logged).
    pub logprob_chunk_mb: usize,
    /// Keep the log-prob head's logits from the forward for the backward (`scored tokens x vocab` in the
    /// model's dtype a micro-batch: 5 GB for 16k tokens of a 152k vocabulary in bf16) instead of
    /// recomputing them chunk by chunk: one lm_head GEMM less, as PyTorch's autograd keeps them. The
    /// memory plan (`--plan`) counts them. `true`, `false`, or "auto" (the default, written by leaving
    /// the key out): kept on a GPU whose memory the plan with them fills to at most
    /// [`crate::cost::memory::AUTO_KEEP_LOGITS_SHARE`] of what it may use, else not (the run logs which).
    #[serde(deserialize_with = "bool_or_auto", serialize_with = "auto_as_word")]
    pub keep_logits: Option<bool>,
    /// Use the fused RMSNorm, rope and attention-softmax kernels (false: candle's composite ops, slower;
    /// for checking the kernels).
    pub fused_ops: bool,
    /// Compute the frozen reference's log-probs of the prepared answers once, store them beside the
    /// prepared data (recomputed when the reference or the data changes) and load no reference model while
    /// training; false computes them on the fly each step.
    pub cache_reference: bool,
    /// How attention is computed with fused ops: "auto" (the default: on a GPU the fastest of wgmma and
    /// mma that passes a check against flash's chunked path on that device before the model loads, else
    /// flash; the choice is logged), "flash" (block by block, memory linear in the length), "mma" (flash on a GPU's tensor cores with the scores in registers, for bf16/f16 at
    /// head dim 64 or 128; elsewhere flash), "wgmma" (as mma, through Hopper's warpgroup wgmma kernels
    /// on an H100/H200, compute capability 9.0; elsewhere mma) or "matrix" (through each head's [T, T]
    /// score matrix: quadratic memory).
    pub attention: Attention,
    /// With `attention = "mma"` or "wgmma" on a GPU: true (the default) computes the backward's dq in a kernel of its
    /// own, the same bits every run; false sums it by f32 atomics in the dk/dv kernel, FlashAttention-2's
    /// backward: 10 instead of 14 head-dim FLOPs per score, its rounding varying from run to run.
    pub deterministic_attention: bool,
    /// `[model.lora]`: train low-rank adapters instead of every weight (absent: full fine-tuning); the
    /// reference of the KL term is then the base model (the adapters off).
    pub lora: Option<LoraOptions>,
}

/// A switch that is `true`, `false` or "auto" (`None`: left to the run).
fn bool_or_auto<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Switch {
        Set(bool),
        Word(String),
    }
    match Switch::deserialize(d)? {
        Switch::Set(b) => Ok(Some(b)),
        Switch::Word(w) if w == "auto" => Ok(None),
        Switch::Word(w) => Err(serde::de::Error::custom(format!("expected true, false or \"auto\", found {w:?}"))),
    }
}

/// `None` as "auto" (what [`bool_or_auto`] reads back).
fn auto_as_word<S: serde::Serializer>(v: &Option<bool>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(b) => s.serialize_bool(*b),
        None => s.serialize_str("auto"),
    }
}

impl ModelSection {
    /// How the policy (and a reference scored with it) computes: the `[model]` keys that do not change
    /// what is computed.
    pub fn decoder_options(&self) -> DecoderOptions {
        DecoderOptions {
            checkpoint_layers: self.checkpoint_layers,
            recompute_attention: self.recompute_attention,
            logprob_chunk_bytes: self.logprob_chunk_mb << 20,
            keep_logits: self.keep_logits == Some(true),
            fused_ops: self.fused_ops,
            attention: self.attention,
            deterministic_attention: self.deterministic_attention,
        }
    }
}

impl ModelSection {
    /// Where the policy's initial weights come from: `path`, pinned at `revision` when given
    /// (`org/name@revision`).
    pub fn source(&self) -> Result<String, crate::model::ModelError> {
        crate::model::load::with_revision(&self.path, self.revision.as_deref(), "model.revision")
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            path: String::new(),
            revision: None,
            init_tiny: None,
            dtype: DTypeName::F32,
            device: DeviceName::Cpu,
            reference: None,
            checkpoint_layers: false,
            recompute_attention: true,
            logprob_chunk_mb: 0,
            keep_logits: None,
            fused_ops: true,
            cache_reference: true,
            attention: Attention::Auto,
            deterministic_attention: true,
            lora: None,
        }
    }
}

/// `[data]`: the data module's input and sequence options, and the trainer's own keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DataSection {
    #[serde(flatten)]
    pub input: InputOptions,
    #[serde(flatten)]
    pub sequence: SequenceOptions,
    /// Where the tokenised shards go (default OUTPUT/prepared); re-used when up to date.
    pub prepared_dir: Option<PathBuf>,
    /// Shuffle the question order each epoch (from train.seed); false keeps file order.
    pub shuffle: bool,
}

impl Default for DataSection {
    fn default() -> Self {
        Self { input: InputOptions::default(), sequence: SequenceOptions::default(), prepared_dir: None, shuffle: true }
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
    /// Token budget of a micro-batch (0, the default: `micro_batch_size` answers, each row padded to the
    /// longest). When set, answers (prompt + response) are packed into rows of at most this many tokens,
    /// one row per micro-batch, causal within each answer, with no padding; an answer longer than the
    /// budget runs alone. `micro_batch_size` then sets only the batch of the reference log-prob pass and of
    /// the rollouts' behaviour log-probs. See src/train/pack.rs.
    pub micro_batch_tokens: usize,
    pub epochs: usize,
    /// Stop after this many steps (0: run all epochs).
    pub max_steps: usize,
    pub seed: u64,
    /// Write a checkpoint every N steps (0: only at the end of each epoch and of the run).
    pub save_every: usize,
    /// Checkpoints kept (the newest; 0 keeps every one); OUTPUT/best is kept apart.
    pub keep_last: usize,
    /// Stop after this many consecutive steps with a non-finite loss or gradient.
    pub max_bad_steps: usize,
    /// dtype of the saved HF weights (default: the model's).
    pub save_dtype: Option<DTypeName>,
    /// Without a terminal (a log file), log a progress line every N steps (and at the last).
    pub log_every: usize,
    /// Make the frozen reference a copy of the policy every K steps, or at each epoch's end with
    /// "epoch" (seed 002). Default: never.
    pub reference_swap_every: Option<ReferenceSwap>,
    /// Where the step metrics go besides metrics.jsonl (TRL's `report_to`): `["tensorboard"]` writes
    /// them as TensorBoard event files under OUTPUT/tensorboard. Default: nowhere else.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub report_to: Vec<ReportTo>,
    /// Steps to profile phase by phase (numbered as in metrics.jsonl, from 1; e.g. `[3, 4]`, after the
    /// first steps' warm-up): each one's table goes to the log and its record to OUTPUT/profile.jsonl
    /// (src/profile/). Default: none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile_steps: Vec<usize>,
}

/// A logger the metrics are reported to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportTo {
    Tensorboard,
}

impl Default for TrainSection {
    fn default() -> Self {
        Self {
            output_dir: PathBuf::from("runs/grpo"),
            batch_questions: 32,
            micro_batch_size: 8,
            micro_batch_tokens: 0,
            epochs: 1,
            max_steps: 0,
            seed: 0,
            save_every: 0,
            keep_last: 2,
            max_bad_steps: 3,
            save_dtype: None,
            log_every: 1,
            reference_swap_every: None,
            report_to: Vec::new(),
            profile_steps: Vec::new(),
        }
    }
}

/// `[validation]`: evaluate on a benchmark during training and keep the best checkpoint. The keys are
/// `grpo eval`'s options with the same defaults, plus `bench` and `every_steps`; the sampling seed
/// defaults to train.seed.
pub type ValidationSection = crate::eval::EvalOptions;

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
    /// Sample the policy's own answers each step and train on them (absent: teacher answers only).
    #[serde(default)]
    pub rollout: Option<RolloutOptions>,
}

/// Add "did you mean" to serde's "unknown field `x`, expected one of `a`, `b`" messages.
fn suggest(message: &str) -> String {
    let Some(start) = message.find("unknown field `") else { return message.to_string() };
    let rest = &message[start + "unknown field `".len()..];
    let Some(end) = rest.find('`') else { return message.to_string() };
    let unknown = &rest[..end];
    let candidates = rest[end..].split('`').skip(2).step_by(2);
    match nearest(unknown, candidates) {
        Some(best) => format!("{} (did you mean `{best}`?)", message.trim_end()),
        None => message.to_string(),
    }
}

/// The candidate closest to a mistyped `name`, when it is close enough to be meant.
fn nearest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let best = candidates.into_iter().min_by_key(|c| strsim::levenshtein(name, c))?;
    (strsim::levenshtein(name, best) <= name.len().max(3) / 2 + 1).then_some(best)
}

/// `section.key` of every key of every section, as a minimal config has them.
fn all_keys() -> Vec<String> {
    let minimal = "[model]\npath = \"m\"\n[data]\ninputs = [\"x\"]\n";
    let parsed = toml::from_str::<TrainConfig>(minimal).ok().and_then(|c| serde_json::to_value(c).ok());
    let Some(serde_json::Value::Object(sections)) = parsed else { return Vec::new() };
    let mut keys = Vec::new();
    for (section, value) in &sections {
        if let serde_json::Value::Object(fields) = value {
            keys.extend(fields.keys().map(|k| format!("{section}.{k}")));
        }
    }
    keys
}

/// For an unknown `section.key` that no key of its section is near: the same key in another section
/// (`lr` under `[train]`: `optim.lr`), as a hint.
fn elsewhere(path: &str) -> Option<String> {
    let (section, key) = path.rsplit_once('.')?;
    let found = all_keys().into_iter().find(|k| k.rsplit_once('.').is_some_and(|(s, k)| k == key && s != section))?;
    Some(format!(" (did you mean `{found}`?)"))
}

/// The 1-based line of `text` (a TOML file) that sets the dotted key `path`, when it is written as
/// `key = ...` under its `[section]` header (or as a dotted key).
pub(crate) fn line_of(text: &str, path: &str) -> Option<usize> {
    let mut section = String::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if let Some(header) = line.strip_prefix('[').filter(|_| !line.starts_with("[[")) {
            section = header.split(']').next().unwrap_or_default().trim().to_string();
            continue;
        }
        let Some((key, _)) = line.split_once('=') else { continue };
        let key: String = key.split('.').map(|p| p.trim().trim_matches('"')).collect::<Vec<_>>().join(".");
        let full = if section.is_empty() { key } else { format!("{section}.{key}") };
        if full == path {
            return Some(i + 1);
        }
    }
    None
}

/// The first key of `given` (the TOML as written, under `prefix`) that the parsed configuration `parsed`
/// does not have, as a message with the nearest valid key. Sections composed with serde's `flatten` (the
/// options of several modules in one table) ignore unknown keys instead of rejecting them; this check
/// rejects them all the same.
fn unknown_key(given: &toml::Table, parsed: &serde_json::Value, prefix: &str) -> Option<(String, String)> {
    let valid = parsed.as_object()?;
    for (key, value) in given {
        let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match valid.get(key) {
            None => {
                let hint = match nearest(key, valid.keys().map(String::as_str)) {
                    Some(b) => format!(" (did you mean `{b}`?)"),
                    None => elsewhere(&path).unwrap_or_default(),
                };
                let expected = valid.keys().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ");
                let message = format!("unknown key `{path}`, expected one of {expected}{hint}");
                return Some((path, message));
            }
            Some(v) => {
                if let Some(table) = value.as_table() {
                    if let Some(m) = unknown_key(table, v, &path) {
                        return Some(m);
                    }
                }
            }
        }
    }
    None
}

/// The key (as `section.key`) and value whose removal lets `table` parse: the value that serde refused
/// with `message`, trying first the keys the message names. Sections composed with `flatten` report a
/// bad value with the section's name only; this finds the key.
fn offending_key(table: &toml::Table, message: &str) -> Option<(String, toml::Value)> {
    let parses = |t: &toml::Table| toml::Value::Table(t.clone()).try_into::<TrainConfig>().is_ok();
    let mut leaves = Vec::new();
    collect_leaves(table, &mut Vec::new(), &mut leaves);
    leaves.sort_by_key(|path| !message.contains(&path.join(".")));
    leaves.into_iter().find_map(|path| {
        let mut t = table.clone();
        let value = remove_leaf(&mut t, &path)?;
        parses(&t).then(|| (path.join("."), value))
    })
}

fn collect_leaves(table: &toml::Table, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    for (k, v) in table {
        prefix.push(k.clone());
        match v.as_table() {
            Some(t) => collect_leaves(t, prefix, out),
            None => out.push(prefix.clone()),
        }
        prefix.pop();
    }
}

fn remove_leaf(table: &mut toml::Table, path: &[String]) -> Option<toml::Value> {
    match path {
        [last] => table.remove(last),
        [first, rest @ ..] => remove_leaf(table.get_mut(first)?.as_table_mut()?, rest),
        [] => None,
    }
}

/// Parse `value` of a `--set` as a TOML value (number, bool, array, table, quoted string), else as a bare
/// string; a value that opens an array, a table or a quoted string must parse, and its error says where not.
fn parse_value(value: &str) -> Result<toml::Value, String> {
    const PREFIX: &str = "v = ";
    match toml::from_str::<toml::Table>(&format!("{PREFIX}{value}")) {
        Ok(mut t) => Ok(t.remove("v").unwrap_or(toml::Value::String(value.into()))),
        Err(e) if value.starts_with(['[', '{', '"', '\'']) => {
            let at = e.span().map_or(value.chars().count(), |s| {
                value[..s.start.saturating_sub(PREFIX.len()).min(value.len())].chars().count()
            });
            Err(format!(
                "the value `{value}` is not valid TOML: {} at character {} of the value",
                e.message().trim().replace('\n', ", "),
                at + 1
            ))
        }
        Err(_) => Ok(toml::Value::String(value.into())),
    }
}

/// `--set rollout.generation_ranks=...` or `rollout.max_staleness` on a config without `[rollout]`: the
/// override would add the section with every other rollout option at its default and turn the run into
/// an on-policy one; refused, naming the option.
fn refuse_overlap_without_rollout(set: &str, had_rollout: bool) -> Result<(), ConfigError> {
    let key = set.split('=').next().unwrap_or_default().trim();
    if had_rollout || !["rollout.generation_ranks", "rollout.max_staleness"].contains(&key) {
        return Ok(());
    }
    Err(ConfigError::BadOverrideValue {
        set: set.to_string(),
        message: format!(
            "{key} overlaps the generation of rollouts with training, but this config has no [rollout] section \
             (its run trains on the teacher's answers only); add [rollout] to the config for on-policy rollouts"
        ),
    })
}

/// Apply `--set section.key=value` (`o`) to `table`.
fn apply_override(table: &mut toml::Table, o: &str) -> Result<(), ConfigError> {
    let (key, value) = o.split_once('=').ok_or_else(|| ConfigError::BadOverride(o.into()))?;
    let parts: Vec<&str> = key.trim().split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(ConfigError::BadOverride(o.into()));
    }
    let mut cur = table;
    for p in &parts[..parts.len() - 1] {
        let entry = cur.entry(p.to_string()).or_insert_with(|| toml::Value::Table(Default::default()));
        cur = entry.as_table_mut().ok_or_else(|| ConfigError::BadOverride(format!("{o}: `{p}` is not a section")))?;
    }
    let value =
        parse_value(value.trim()).map_err(|message| ConfigError::BadOverrideValue { set: o.into(), message })?;
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

/// Why a config table holds no config: the message, and the key (`section.key`) it is about when known.
struct Refusal {
    key: Option<String>,
    message: String,
}

/// The config `table` holds, or why it holds none (a value of the wrong type, an unknown key).
fn from_table(table: &toml::Table) -> Result<TrainConfig, Refusal> {
    let cfg: TrainConfig = toml::Value::Table(table.clone()).try_into().map_err(|e: toml::de::Error| {
        match offending_key(table, e.message()) {
            Some((key, value)) => {
                let mut message = suggest(e.message());
                if e.message().contains("unknown field") && !message.contains("did you mean") {
                    message = message.trim_end().to_string() + &elsewhere(&key).unwrap_or_default();
                }
                Refusal { message: format!("{key} = {value}: {message}"), key: Some(key) }
            }
            None => Refusal { key: None, message: suggest(&e.to_string()) },
        }
    })?;
    let parsed = serde_json::to_value(&cfg).map_err(|e| Refusal { key: None, message: e.to_string() })?;
    match unknown_key(table, &parsed, "") {
        Some((key, message)) => Err(Refusal { key: Some(key), message }),
        None => Ok(cfg),
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
        // The first `--set` that turns a readable config into an unreadable one is named as the culprit.
        let mut readable = from_table(&table).is_ok();
        let mut culprit = None;
        let had_rollout = table.contains_key("rollout");
        for o in overrides {
            refuse_overlap_without_rollout(o, had_rollout)?;
            apply_override(&mut table, o)?;
            if readable && culprit.is_none() && from_table(&table).is_err() {
                culprit = Some(o.clone());
            }
            readable = readable || from_table(&table).is_ok();
        }
        let cfg = from_table(&table).map_err(|r| match culprit {
            Some(set) => ConfigError::BadOverrideValue { set, message: r.message },
            None => {
                let line = r.key.as_deref().and_then(|k| line_of(text, k));
                let message = line.map_or(r.message.clone(), |l| format!("line {l}: {}", r.message));
                ConfigError::Parse { path: path.into(), message }
            }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Everything that can be checked without loading a model or reading data.
    /// The local files and folders a run reads first exist (`model.init_tiny.tokenizer`, each `data.inputs`
    /// that is neither a glob nor a hub dataset): a missing one is an error naming its key, and saying that
    /// relative paths are read from the current directory, not from the config file's folder.
    pub fn check_paths(&self) -> Result<(), ConfigError> {
        let mut keys: Vec<(String, &std::path::Path)> = Vec::new();
        if let Some(t) = &self.model.init_tiny {
            keys.push(("model.init_tiny.tokenizer".into(), t.tokenizer.as_path()));
        }
        for (i, input) in self.data.input.inputs.iter().enumerate() {
            let glob = input.contains(['*', '?', '[']);
            if !glob && !crate::hub::DatasetUrl::is_hub(input) {
                keys.push((format!("data.inputs[{i}]"), std::path::Path::new(input)));
            }
        }
        let Some((key, path)) = keys.into_iter().find(|(_, p)| !p.exists()) else { return Ok(()) };
        let cwd = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_else(|_| "?".into());
        let whence = match path.is_relative() {
            true => format!(
                " (relative paths are read from the current directory, {cwd}, not from the config file's folder)"
            ),
            false => String::new(),
        };
        Err(ConfigError::Invalid(format!("{key} = \"{}\": no such file or folder{whence}", path.display())))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.model.path.is_empty() {
            return bad("model.path is required".into());
        }
        if self.model.revision.is_some() {
            self.model.source().map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        let path = &self.model.path;
        if self.model.init_tiny.is_some() && path.contains('/') && !crate::model::load::looks_local(path) {
            return bad(format!(
                "model.path = `{path}` looks like a hub id and is not a local folder: model.init_tiny would fill it \
                 with a random model (write a local path such as `./{path}` to create one there)"
            ));
        }
        if let Some(lora) = &self.model.lora {
            lora.validate().map_err(ConfigError::Invalid)?;
        }
        let own_questions = self.rollout.as_ref().is_some_and(|r| r.questions.is_some());
        if self.data.input.inputs.is_empty() && !own_questions {
            return bad("data.inputs is empty: give the teacher trajectories (files, folders or globs)".into());
        }
        if self.data.input.group.group_size == 1 {
            return bad("data.group_size = 1: a group needs at least 2 answers (0 keeps all)".into());
        }
        if self.train.batch_questions == 0 {
            return bad("train.batch_questions = 0: a step needs at least 1 question".into());
        }
        if self.train.micro_batch_size == 0 {
            let packed = if self.train.micro_batch_tokens > 0 {
                " (with train.micro_batch_tokens it still sets the batch of the reference log-prob pass and of \
                 the rollouts' behaviour log-probs)"
            } else {
                ""
            };
            return bad(format!("train.micro_batch_size = 0 must be >= 1{packed}"));
        }
        if self.train.epochs == 0 && self.train.max_steps == 0 {
            return bad("train.epochs and train.max_steps are both 0: nothing to do".into());
        }
        self.check_bounds()?;
        if self.train.profile_steps.contains(&0) {
            return bad("train.profile_steps: steps are numbered from 1 (as in metrics.jsonl)".into());
        }
        self.objective.validate().map_err(ConfigError::Invalid)?;
        self.optim.validate().map_err(ConfigError::Invalid)?;
        self.validate_rollout().map_err(ConfigError::Invalid)?;
        if let Some(v) = &self.validation {
            v.validate("validation.").map_err(ConfigError::Invalid)?;
            if !crate::eval::benchmarks::names().contains(&v.bench.as_str()) {
                return bad(format!(
                    "validation.bench = `{}` is not a registered benchmark ({})",
                    v.bench,
                    crate::eval::benchmarks::names().join(", ")
                ));
            }
        }
        Ok(())
    }

    /// This configuration as rank `world.rank()` of a data-parallel run runs it: a CUDA `model.device`
    /// becomes the rank's GPU ([`crate::dist::World::rank_device`]).
    pub fn for_rank(&self, world: &crate::dist::World) -> Result<TrainConfig, ConfigError> {
        let mut cfg = self.clone();
        cfg.model.device = world.rank_device(cfg.model.device).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(cfg)
    }

    /// Values that parse but no run could mean (a typo's extra zeros, an overflowed number): refused, naming
    /// the key and the accepted range.
    fn check_bounds(&self) -> Result<(), ConfigError> {
        let (t, d, o) = (&self.train, &self.data, &self.optim);
        let g = &d.input.group;
        let counts: [(&str, usize, usize); 9] = [
            ("train.batch_questions", t.batch_questions, 1 << 20),
            ("train.micro_batch_size", t.micro_batch_size, 1 << 20),
            ("train.micro_batch_tokens", t.micro_batch_tokens, 1 << 30),
            ("train.epochs", t.epochs, 100_000),
            ("train.max_steps", t.max_steps, 1 << 32),
            ("data.group_size", g.group_size, 1 << 16),
            ("data.min_group_size", g.min_group_size, 1 << 16),
            ("data.max_prompt_tokens", d.sequence.max_prompt_tokens, 1 << 24),
            ("data.max_response_tokens", d.sequence.max_response_tokens, 1 << 24),
        ];
        for (key, value, max) in counts {
            if value > max {
                return Err(ConfigError::Invalid(format!("{key} = {value} is out of range (at most {max})")));
            }
        }
        let reals = [
            ("optim.lr", o.lr, 1.0),
            ("optim.weight_decay", o.weight_decay, 100.0),
            ("optim.grad_clip", o.grad_clip, 1e9),
        ];
        for (key, value, max) in reals {
            if !value.is_finite() || value > max {
                return Err(ConfigError::Invalid(format!("{key} = {value} is out of range (at most {max})")));
            }
        }
        Ok(())
    }

    /// `[rollout]` and the options that only make sense with or without it.
    fn validate_rollout(&self) -> Result<(), String> {
        if self.train.reference_swap_every.is_some() && !self.objective.build().needs_reference() {
            return Err("train.reference_swap_every: the objective uses no reference (beta = 0 and anchor is not \
                        \"reference\"), there is nothing to swap"
                .into());
        }
        let Some(r) = &self.rollout else { return Ok(()) };
        r.validate()?;
        if r.reload.adapter() && self.model.lora.is_none() {
            return Err(format!(
                "rollout.reload = {:?} sends the server a LoRA adapter: it needs [model.lora]",
                r.reload
            ));
        }
        use crate::objective::Anchor;
        match self.objective.anchor() {
            Some(Anchor::Step) => Err(format!(
                "objective.anchor = \"step\" (the default of `{}`) with [rollout]: the ratio to the policy at the \
                 start of each update is always 1; set objective.anchor = \"behaviour\" (the sampling policy's \
                 log-probs recorded with the rollouts)",
                self.objective.name().as_str()
            )),
            Some(Anchor::Snapshot) => Err("objective.anchor = \"snapshot\" with [rollout]: the lagged policy is \
                                           rollout.sync_every; set objective.anchor = \"behaviour\""
                .into()),
            _ => Ok(()),
        }
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

    /// `model.revision` pins a hub id (as `@revision` does), and is refused for a local folder or beside
    /// another `@revision`.
    #[test]
    fn model_revision_pins_a_hub_id() {
        let with = |path: &str, rev: &str| {
            let text = format!("[model]\npath = \"{path}\"\nrevision = \"{rev}\"\n[data]\ninputs = [\"x.jsonl\"]\n");
            TrainConfig::parse(&text, Path::new("c.toml"), &[]).map_err(|e| e.to_string())
        };
        assert_eq!(with("org/name", "v1").unwrap().model.source().unwrap(), "org/name@v1");
        assert_eq!(with("org/name@v1", "v1").unwrap().model.source().unwrap(), "org/name@v1");
        let e = with("org/name@main", "v1").unwrap_err();
        assert!(e.contains("model.revision = `v1`, but the id already names revision `main`"), "{e}");
        let e = with("./models/x", "v1").unwrap_err();
        assert!(e.contains("is a local path"), "{e}");
        let plain = TrainConfig::parse(MIN, Path::new("c.toml"), &[]).unwrap();
        assert_eq!((plain.model.revision.as_deref(), plain.model.source().unwrap()), (None, "m".to_string()));
        assert!(!plain.to_toml().contains("revision"), "an absent revision is not written");
    }

    #[test]
    fn lora_options_are_checked_and_an_adapter_reload_needs_them() {
        let parse = |extra: &str| TrainConfig::parse(&format!("{MIN}{extra}"), Path::new("c.toml"), &[]);
        let lora = parse("[model.lora]\nr = 16\nalpha = 32\n").unwrap().model.lora.unwrap();
        assert_eq!((lora.r, lora.alpha, lora.target_modules.len()), (16, 32.0, 7));
        assert_eq!(parse("[model.lora]\ndropout = 0.1\n").unwrap().model.lora.unwrap().dropout, 0.1);
        let e = parse("[model.lora]\ndropout = 1.0\n").unwrap_err().to_string();
        assert!(e.contains("model.lora.dropout = 1 must be in [0, 1)"), "{e}");
        let e = parse("[model.lora]\nrank = 4\n").unwrap_err().to_string();
        assert!(e.contains("rank"), "{e}");
        let server = "[objective]\nname = \"grpo\"\nanchor = \"behaviour\"\n[rollout]\nreload = \"vllm-lora\"\n\
                      [rollout.server]\nengine = \"openai\"\nbase_url = \"http://h/v1\"\nserved_model = \"p\"\n";
        let e = parse(server).unwrap_err().to_string();
        assert!(e.contains("needs [model.lora]"), "{e}");
        parse(&format!("{server}[model.lora]\nr = 4\n")).unwrap();
    }

    /// `micro_batch_size = 0` is refused, with packing too, saying what it still sets.
    #[test]
    fn a_zero_micro_batch_size_says_what_it_still_sets_when_packing() {
        let parse = |train: &str| TrainConfig::parse(&format!("{MIN}[train]\n{train}"), Path::new("c.toml"), &[]);
        let e = parse("micro_batch_size = 0\n").unwrap_err().to_string();
        assert!(e.contains("train.micro_batch_size = 0 must be >= 1") && !e.contains("reference"), "{e}");
        let e = parse("micro_batch_size = 0\nmicro_batch_tokens = 512\n").unwrap_err().to_string();
        assert!(e.contains("it still sets the batch of the reference log-prob pass"), "{e}");
        let e = parse("batch_questions = 0\n").unwrap_err().to_string();
        assert!(e.contains("train.batch_questions = 0"), "{e}");
    }

    #[test]
    fn unknown_keys_name_the_key_and_the_nearest_valid_one() {
        let e = TrainConfig::parse(&format!("{MIN}[objective]\nbetta = 0.1\n"), Path::new("c.toml"), &[]).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("betta") && m.contains("did you mean `beta`"), "{m}");
        let e =
            TrainConfig::parse(&format!("{MIN}[train]\nbatch_question = 4\n"), Path::new("c.toml"), &[]).unwrap_err();
        assert!(e.to_string().contains("did you mean `batch_questions`"), "{e}");
        let e = TrainConfig::parse(&format!("{MIN}group_sise = 4\n"), Path::new("c.toml"), &[]).unwrap_err();
        assert!(
            e.to_string().contains("data.group_sise") && e.to_string().contains("did you mean `group_size`"),
            "{e}"
        );
        let e = TrainConfig::parse(&format!("{MIN}seed = 4\n"), Path::new("c.toml"), &[]).unwrap_err();
        assert!(e.to_string().contains("unknown key `data.seed`"), "{e}");
        let e = TrainConfig::parse(&format!("{MIN}[trian]\nx = 1\n"), Path::new("c.toml"), &[]).unwrap_err();
        assert!(e.to_string().contains("did you mean `train`"), "{e}");
    }

    #[test]
    fn a_key_in_the_wrong_section_is_named_with_its_line_and_its_section() {
        let text = format!("{MIN}[optim]\nlr = 1e-4\n\n[train]\nseed = 1\nlr = 1e-5\n");
        let e = TrainConfig::parse(&text, Path::new("c.toml"), &[]).unwrap_err().to_string();
        assert!(e.starts_with("c.toml: line 10: train.lr = "), "{e}");
        assert!(e.contains("unknown field `lr`") && e.ends_with("(did you mean `optim.lr`?)"), "{e}");
        // A key of a flattened section, and a dotted key at the top.
        let e = TrainConfig::parse(&format!("{MIN}lr = 1\n"), Path::new("c.toml"), &[]).unwrap_err().to_string();
        assert!(e.starts_with("c.toml: line 5: ") && e.contains("did you mean `optim.lr`"), "{e}");
        let e = TrainConfig::parse(&format!("train.lr = 1\n{MIN}"), Path::new("c.toml"), &[]).unwrap_err().to_string();
        assert!(e.starts_with("c.toml: line 1: ") && e.contains("did you mean `optim.lr`"), "{e}");
    }

    #[test]
    fn a_set_value_that_is_not_valid_toml_says_where() {
        let e = TrainConfig::parse(MIN, Path::new("c.toml"), &[r#"data.inputs=["a","#.into()]).unwrap_err().to_string();
        assert!(e.starts_with(r#"--set data.inputs=["a",: the value `["a",` is not valid TOML: "#), "{e}");
        assert!(e.ends_with("at character 6 of the value"), "{e}");
        assert!(!e.contains("expected a sequence"), "{e}");
        // A bare word is still a string.
        let c = TrainConfig::parse(MIN, Path::new("c.toml"), &["objective.name=sft".into()]).unwrap();
        assert_eq!(c.objective.name(), crate::objective::ObjectiveName::Sft);
    }

    #[test]
    fn overrides_apply_and_are_validated() {
        let c = TrainConfig::parse(
            MIN,
            Path::new("c.toml"),
            &["objective.beta=0.05".into(), "objective.name=sft".into(), "train.output_dir=runs/x".into()],
        )
        .unwrap();
        assert_eq!(c.objective.beta(), 0.05);
        assert_eq!(c.objective.name(), crate::objective::ObjectiveName::Sft);
        assert_eq!(c.train.output_dir, PathBuf::from("runs/x"));
        let e = TrainConfig::parse(MIN, Path::new("c.toml"), &["objective.eps=2".into()]).unwrap_err();
        assert!(e.to_string().contains("objective.eps"), "{e}");
        assert!(TrainConfig::parse(MIN, Path::new("c.toml"), &["novalue".into()]).is_err());
        let e = TrainConfig::parse(MIN, Path::new("c.toml"), &["model.device=tpu".into()]).unwrap_err();
        assert!(e.to_string().contains("model.device"), "{e}");
        assert_eq!(c.model.attention, Attention::Auto);
        let c = TrainConfig::parse(MIN, Path::new("c.toml"), &["model.attention=flash".into()]).unwrap();
        assert_eq!(c.model.attention, Attention::Flash);
        let c = TrainConfig::parse(MIN, Path::new("c.toml"), &["model.attention=matrix".into()]).unwrap();
        assert_eq!(c.model.attention, Attention::Matrix);
        let c = TrainConfig::parse(MIN, Path::new("c.toml"), &["model.attention=mma".into()]).unwrap();
        assert_eq!(c.model.attention, Attention::Mma);
        let c = TrainConfig::parse(MIN, Path::new("c.toml"), &["model.attention=wgmma".into()]).unwrap();
        assert_eq!(c.model.attention, Attention::Wgmma);
        let e = TrainConfig::parse(MIN, Path::new("c.toml"), &["model.attention=sparse".into()]).unwrap_err();
        assert!(e.to_string().contains("sparse") && e.to_string().contains("`flash`"), "{e}");
    }

    #[test]
    fn a_bad_value_given_with_set_is_named_as_the_set() {
        let o = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let e = TrainConfig::parse(MIN, Path::new("c.toml"), &o(&["train.seed=1", "train.batch_questions=-2"]))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--set train.batch_questions=-2: "), "{e}");
        assert!(!e.contains("c.toml"), "{e}");
        let e = TrainConfig::parse(MIN, Path::new("c.toml"), &o(&["train.batch_question=2"])).unwrap_err().to_string();
        assert!(e.starts_with("--set train.batch_question=2: ") && e.contains("did you mean `batch_questions`"), "{e}");
        // The file's own bad value is still the file's, and a --set that completes a config is no culprit.
        let bad = format!("{MIN}[train]\nseed = \"x\"\n");
        let e = TrainConfig::parse(&bad, Path::new("c.toml"), &o(&["train.epochs=2"])).unwrap_err().to_string();
        assert!(e.starts_with("c.toml: "), "{e}");
        let e = TrainConfig::parse("[data]\ninputs = [\"x\"]\n", Path::new("c.toml"), &o(&["model.path=m"]));
        assert!(e.is_ok(), "{e:?}");
    }

    #[test]
    fn nan_and_out_of_range_values_are_rejected() {
        let bad = [
            "objective.bias=nan",
            "objective.beta=nan",
            "objective.bias=inf",
            "validation.temperature=-0.5",
            "validation.temperature=nan",
            "validation.top_p=0",
            "validation.top_p=1.5",
            "validation.n=0",
            "validation.batch_size=0",
            "validation.max_new_tokens=0",
        ];
        for o in bad {
            let key = o.split('=').next().unwrap();
            let e = TrainConfig::parse(MIN, Path::new("c.toml"), &[o.into()]);
            assert!(e.as_ref().is_err_and(|e| e.to_string().contains(key)), "{o}: {e:?}");
        }
        let tiny = "model.init_tiny={arch=\"llama\",tokenizer=\"t\"}";
        let e = TrainConfig::parse(MIN, Path::new("c.toml"), &[tiny.into(), "model.path=\"Org/typo\"".into()]);
        assert!(e.is_err_and(|e| e.to_string().contains("looks like a hub id")));
        for o in ["validation.temperature=0", "validation.top_p=1", "objective.beta=0", "model.path=\"./Org/x\""] {
            TrainConfig::parse(MIN, Path::new("c.toml"), &[o.into()]).unwrap();
        }
    }

    #[test]
    fn a_bad_value_in_a_composed_section_names_its_key() {
        for (text, key) in [
            ("group_size = -1\n", "data.group_size = -1"),
            ("max_response_tokens = -5\n", "data.max_response_tokens = -5"),
            ("[train]\nbatch_questions = -2\n", "train.batch_questions = -2"),
            ("[objective]\nbeta = \"x\"\n", "objective.beta = \"x\""),
        ] {
            let e = TrainConfig::parse(&format!("{MIN}{text}"), Path::new("c.toml"), &[]).unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn absurd_finite_values_are_refused_naming_the_key() {
        for o in [
            "train.batch_questions=100000000",
            "train.epochs=1000000000",
            "data.group_size=100000000",
            "data.max_response_tokens=100000000000",
            "optim.lr=1e30",
            "optim.weight_decay=1e9",
        ] {
            let key = o.split('=').next().unwrap();
            let e = TrainConfig::parse(MIN, Path::new("c.toml"), &[o.into()]).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("out of range"), "{o}: {e}");
        }
        for o in ["train.epochs=100", "data.max_response_tokens=32768", "optim.lr=1e-7", "train.keep_last=0"] {
            TrainConfig::parse(MIN, Path::new("c.toml"), &[o.into()]).unwrap();
        }
    }

    #[test]
    fn resolved_config_round_trips() {
        let c = TrainConfig::parse(MIN, Path::new("c.toml"), &[]).unwrap();
        let back = TrainConfig::parse(&c.to_toml(), Path::new("resolved.toml"), &[]).unwrap();
        assert_eq!(c, back);
    }
}
