//! What a resume checks against the checkpoint it continues: the model (architecture and size), the
//! tokenizer, and the training configuration.

use std::collections::BTreeMap;
use std::path::Path;

use super::checkpoint::CONFIG_FILE;
use super::{TrainConfig, TrainError, TrainerState};
use crate::model::{ModelConfig, ModelError};
use crate::rollout::GroupSource;

/// Configuration keys that may differ from the checkpoint's without `--allow-config-change`: the run's length
/// (a longer or shorter run; the learning-rate schedule follows the new length), where and how often it
/// saves, how a step is computed without changing what it computes (device, micro-batch split, layer
/// recomputation, log-prob chunking and kept logits, fused ops, attention, cached reference log-probs, where the optimiser
/// state lives), and how often and how fast validation runs. Every other
/// key (model, dtype, data, objective, optimiser, batch size, seed, validation benchmark and sampling)
/// changes what is trained or what the best checkpoint means.
pub const RESUMABLE_KEYS: &[&str] = &[
    "model.device",
    "model.checkpoint_layers",
    "model.recompute_attention",
    "model.logprob_chunk_mb",
    "model.keep_logits",
    "model.fused_ops",
    "model.cache_reference",
    "optim.offload",
    "optim.offload_chunk_mb",
    "model.attention",
    "model.deterministic_attention",
    "data.prepared_dir",
    "train.output_dir",
    "train.epochs",
    "train.max_steps",
    "train.log_every",
    "train.micro_batch_size",
    "train.micro_batch_tokens",
    "train.save_every",
    "train.keep_last",
    "train.max_bad_steps",
    "train.save_dtype",
    "train.report_to",
    "validation.every_steps",
    "validation.batch_size",
];

/// Tokenizer files that decide the token ids (and the chat template) the checkpoint was trained on.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
];

/// `(key, value)` of every leaf of a TOML table, keys dotted.
fn flatten(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, toml::Value>) {
    for (k, v) in table {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(t) => flatten(&key, t, out),
            _ => {
                out.insert(key, v.clone());
            }
        }
    }
}

fn show(v: Option<&toml::Value>) -> String {
    let s = v.map_or_else(|| "(unset)".to_string(), |v| v.to_string());
    if s.chars().count() > 100 {
        format!("{}...", s.chars().take(97).collect::<String>())
    } else {
        s
    }
}

/// The keys whose values differ between the checkpoint's configuration `stored` and `cfg`, as
/// `key: old -> new`.
fn config_changes(stored: &toml::Table, cfg: &TrainConfig) -> Vec<(String, String)> {
    let current: toml::Table = toml::from_str(&cfg.to_toml()).unwrap_or_default();
    let (mut old, mut new) = (BTreeMap::new(), BTreeMap::new());
    flatten("", stored, &mut old);
    // A dtype stored in its long name (`bfloat16`) is the same value as its short name.
    for key in ["model.dtype", "train.save_dtype"] {
        if let Some(toml::Value::String(v)) = old.get_mut(key) {
            if let Ok(d) = v.parse::<crate::device::DTypeName>() {
                *v = d.to_string();
            }
        }
    }
    flatten("", &current, &mut new);
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    keys.into_iter()
        .filter(|k| old.get(*k) != new.get(*k))
        .map(|k| (k.clone(), format!("{k}: {} -> {}", show(old.get(k)), show(new.get(k)))))
        .collect()
}

/// Stop unless `cfg` equals the configuration the checkpoint `ck` was trained with, but for
/// [`RESUMABLE_KEYS`]; with `allow_change`, warn and go on instead.
pub(super) fn check_config(ck: &Path, cfg: &TrainConfig, allow_change: bool) -> Result<(), TrainError> {
    let path = ck.join(CONFIG_FILE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        tracing::warn!(
            "{} has no {CONFIG_FILE} (an older checkpoint): the training config is not checked",
            ck.display()
        );
        return Ok(());
    };
    let stored: toml::Table = toml::from_str(&text)
        .map_err(|e| TrainError::Damaged { ck: ck.to_path_buf(), message: format!("{CONFIG_FILE}: {e}") })?;
    let (free, fixed): (Vec<_>, Vec<_>) =
        config_changes(&stored, cfg).into_iter().partition(|(k, _)| RESUMABLE_KEYS.contains(&k.as_str()));
    let list = fixed.iter().map(|(_, line)| format!("  {line}")).collect::<Vec<_>>().join("\n");
    if !fixed.is_empty() && !allow_change {
        return Err(TrainError::ConfigChanged { ck: ck.to_path_buf(), changes: list });
    }
    if !fixed.is_empty() {
        tracing::warn!("--allow-config-change: resuming {} with a changed training config:\n{list}", ck.display());
    }
    for (_, line) in &free {
        tracing::info!("resuming with a new {line}");
    }
    Ok(())
}

/// The fingerprint of the data a run trains on ([`crate::data::PreparedDataset::fingerprint`]: from the
/// checksums its prepared version's manifest records); None for the questions of `rollout.questions`.
pub(super) fn data_fingerprint(source: &GroupSource) -> Option<String> {
    match source {
        GroupSource::Prepared(p) => Some(p.fingerprint().to_string()),
        GroupSource::Questions(_) => None,
    }
}

/// The trainer state to resume from checkpoint `ck` (whose state is `state`) on `source`, whose epochs have
/// `steps_per_epoch` steps. A checkpoint of other data (another prepared version, or a position past the end
/// of this data's epoch) is refused, or with `allow_change` restarts its epoch at the first batch of the new
/// data (the step count, learning-rate schedule and optimiser state go on).
pub(super) fn check_data(
    ck: &Path,
    mut state: TrainerState,
    source: &GroupSource,
    steps_per_epoch: usize,
    allow_change: bool,
) -> Result<TrainerState, TrainError> {
    let now = data_fingerprint(source);
    let mut changes = Vec::new();
    if let (Some(old), Some(new)) = (&state.data, &now) {
        if old != new {
            let dir = match source {
                GroupSource::Prepared(p) => p.dir().display().to_string(),
                GroupSource::Questions(_) => String::new(),
            };
            changes.push(format!(
                "it was trained on other data (prepared version {}, now {} in {dir}: the inputs, their preparation or \
                 data.prepared_dir changed)",
                short(old),
                short(new)
            ));
        }
    }
    if state.batch_in_epoch >= steps_per_epoch {
        changes.push(format!(
            "it stopped at batch {} of epoch {}, and the run's data has {steps_per_epoch} steps per epoch",
            state.batch_in_epoch, state.epoch
        ));
    }
    if !changes.is_empty() && !allow_change {
        let message = format!(
            "{}; resume on the checkpoint's data, or pass --allow-data-change to restart epoch {} at its first batch \
             of the new data",
            changes.join("; "),
            state.epoch
        );
        return Err(TrainError::Incompatible { ck: ck.to_path_buf(), message });
    }
    if !changes.is_empty() {
        tracing::warn!(
            "--allow-data-change: {}; epoch {} restarts at its first batch of the new data (at step {})",
            changes.join("; "),
            state.epoch,
            state.step
        );
        state.batch_in_epoch = 0;
    }
    state.data = now;
    Ok(state)
}

/// The first characters of a fingerprint, enough to tell two apart in a message.
fn short(fingerprint: &str) -> &str {
    fingerprint.get(..12).unwrap_or(fingerprint)
}

/// The hyper-parameters that make two models the same network, as `(HF name, value)`.
fn shape(c: &ModelConfig) -> Vec<(&'static str, String)> {
    vec![
        ("architecture", format!("{:?}", c.arch)),
        ("vocab_size", c.vocab_size.to_string()),
        ("hidden_size", c.hidden_size.to_string()),
        ("intermediate_size", c.intermediate_size.to_string()),
        ("num_hidden_layers", c.num_layers.to_string()),
        ("num_attention_heads", c.num_heads.to_string()),
        ("num_key_value_heads", c.num_kv_heads.to_string()),
        ("head_dim", c.head_dim.to_string()),
        ("rms_norm_eps", c.rms_norm_eps.to_string()),
        ("rope_theta", c.rope_theta.to_string()),
        ("rope_scaling", format!("{:?}", c.rope_scaling)),
        ("tie_word_embeddings", c.tie_word_embeddings.to_string()),
        ("attention/mlp biases", format!("{} {} {}", c.qkv_bias, c.o_bias, c.mlp_bias)),
        ("qk_norm", c.qk_norm.to_string()),
    ]
}

/// Whether two tokenizer files say the same (equal bytes, or equal JSON).
fn same_file(a: &[u8], b: &[u8]) -> bool {
    a == b
        || matches!(
            (serde_json::from_slice::<serde_json::Value>(a), serde_json::from_slice::<serde_json::Value>(b)),
            (Ok(x), Ok(y)) if x == y
        )
}

/// Stop unless the checkpoint `ck` has the architecture, size and tokenizer of the run's model `model_dir`
/// (the run reads its tokenizer, data and reference model from there).
pub(super) fn check_model(ck: &Path, model_dir: &Path) -> Result<(), TrainError> {
    let incompatible = |message: String| Err(TrainError::Incompatible { ck: ck.to_path_buf(), message });
    let theirs = ModelConfig::from_file(&ck.join("config.json")).map_err(ModelError::from)?;
    let ours = ModelConfig::from_file(&model_dir.join("config.json")).map_err(ModelError::from)?;
    let diffs: Vec<String> = shape(&theirs)
        .into_iter()
        .zip(shape(&ours))
        .filter(|(a, b)| a.1 != b.1)
        .map(|((name, a), (_, b))| format!("{name} {a} (checkpoint) vs {b} (model)"))
        .collect();
    if !diffs.is_empty() {
        return incompatible(format!(
            "it is not the run's model {} (model.path): {}",
            model_dir.display(),
            diffs.join(", ")
        ));
    }
    for f in TOKENIZER_FILES {
        let (a, b) = (std::fs::read(ck.join(f)).ok(), std::fs::read(model_dir.join(f)).ok());
        let same = match (&a, &b) {
            (Some(a), Some(b)) => same_file(a, b),
            (None, None) => true,
            _ => false,
        };
        if !same {
            let what = if a.is_none() { "is missing from the checkpoint" } else { "differs" };
            return incompatible(format!(
                "its tokenizer is not the run's: {f} {what} ({}); it was trained on other token ids",
                model_dir.join(f).display()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    const MIN: &str = "[model]\npath = \"m\"\n[data]\ninputs = [\"x.jsonl\"]\n[train]\nseed = 7\n";

    fn cfg(overrides: &[&str]) -> TrainConfig {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        TrainConfig::parse(MIN, Path::new("c.toml"), &o).unwrap()
    }

    #[test]
    fn only_keys_outside_the_resumable_list_stop_a_resume() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CONFIG_FILE), cfg(&[]).to_toml()).unwrap();
        let longer = cfg(&["train.max_steps=100", "train.save_every=5", "model.device=cuda:1", "train.output_dir=x"]);
        check_config(dir.path(), &longer, false).unwrap();
        let changed = cfg(&["train.seed=8", "objective.beta=0.5", "train.max_steps=100"]);
        let e = check_config(dir.path(), &changed, false).unwrap_err().to_string();
        assert!(e.contains("train.seed: 7 -> 8") && e.contains("objective.beta"), "{e}");
        assert!(!e.contains("max_steps") && e.contains("--allow-config-change"), "{e}");
        check_config(dir.path(), &changed, true).unwrap();
        let validated = cfg(&["validation.bench=aime25"]);
        let e = check_config(dir.path(), &validated, false).unwrap_err().to_string();
        assert!(e.contains("validation.bench: (unset) -> \"aime25\""), "{e}");
        // A checkpoint's dtype in its long name is the run's in its short one; another dtype is a change.
        let bf16 = cfg(&["model.dtype=bf16"]);
        std::fs::write(dir.path().join(CONFIG_FILE), bf16.to_toml().replace("\"bf16\"", "\"bfloat16\"")).unwrap();
        check_config(dir.path(), &bf16, false).unwrap();
        let e = check_config(dir.path(), &cfg(&["model.dtype=f16"]), false).unwrap_err().to_string();
        assert!(e.contains("model.dtype: \"bf16\" -> \"f16\""), "{e}");
    }

    fn model_dir(dir: &Path, hidden: usize, template: &str) {
        let shape = crate::model::tiny::TinyShape { layers: 1, hidden, heads: 4, kv_heads: 2, intermediate: 64 };
        let c = shape.config(Arch::Qwen2, 128, None, None).unwrap();
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), c.raw.to_string()).unwrap();
        let tok = serde_json::json!({"chat_template": template, "eos_token": "<e>"});
        std::fs::write(dir.join("tokenizer_config.json"), tok.to_string()).unwrap();
    }

    #[test]
    fn another_size_or_tokenizer_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let (ck, same, wider, retok) =
            (d.path().join("ck"), d.path().join("a"), d.path().join("b"), d.path().join("c"));
        model_dir(&ck, 32, "{{ x }}");
        model_dir(&same, 32, "{{ x }}");
        model_dir(&wider, 64, "{{ x }}");
        model_dir(&retok, 32, "{{ y }}");
        // Re-serialised JSON with the same content is the same tokenizer.
        let pretty = serde_json::to_string_pretty(&serde_json::json!({"eos_token": "<e>", "chat_template": "{{ x }}"}));
        std::fs::write(same.join("tokenizer_config.json"), pretty.unwrap()).unwrap();
        check_model(&ck, &same).unwrap();
        let e = check_model(&ck, &wider).unwrap_err().to_string();
        assert!(e.contains("hidden_size 32 (checkpoint) vs 64 (model)"), "{e}");
        let e = check_model(&ck, &retok).unwrap_err().to_string();
        assert!(e.contains("tokenizer_config.json differs"), "{e}");
        std::fs::remove_file(ck.join("tokenizer_config.json")).unwrap();
        let e = check_model(&ck, &same).unwrap_err().to_string();
        assert!(e.contains("tokenizer_config.json is missing from the checkpoint"), "{e}");
    }
}
