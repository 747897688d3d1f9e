//! `grpo train` with every objective on the bundled smoke data, the seeds' configs on the CPU with
//! `--set` overrides for a tiny model, and the exact resume of a policy-snapshot anchor.

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;

const TINY: &str = "{ arch = \"qwen2\", tokenizer = \"TOK\", layers = 1, hidden = 32, heads = 4, kv_heads = 2, intermediate = 64, seed = 3 }";

fn tiny_spec() -> String {
    TINY.replace("TOK", &common::root().join("data/tokenizers/smollm2").display().to_string())
}

fn data() -> String {
    common::root().join("data/trajectories/ot3_math_x8_dev.jsonl").display().to_string()
}

/// A small config: a tiny Qwen2 (created on first use in `dir`), 4 answers per question cut to 24 tokens,
/// 2 questions per step, 3 sequences per micro-batch, data prepared once in `dir`.
fn small_config(dir: &Path) -> PathBuf {
    let cfg = format!(
        r#"
[model]
path = "{model}"
init_tiny = {tiny}

[data]
inputs = ["{data}"]
group_size = 4
max_response_tokens = 24
prepared_dir = "{prepared}"

[optim]
lr = 1e-3

[train]
batch_questions = 2
micro_batch_size = 3
epochs = 1
max_steps = 2
seed = 7
keep_last = 10
"#,
        model = dir.join("model").display(),
        tiny = tiny_spec(),
        data = data(),
        prepared = dir.join("prepared").display(),
    );
    let p = dir.join("small.toml");
    std::fs::write(&p, cfg).unwrap();
    p
}

/// Run `grpo train --config config` with `sets` as `--set` overrides and the output in `out`.
fn train(config: &Path, out: &Path, sets: &[String], extra: &[&str]) -> assert_cmd::assert::Assert {
    let mut cmd = common::grpo();
    cmd.current_dir(common::root()).args(["-q", "train", "--config"]).arg(config);
    cmd.arg("--set").arg(format!("train.output_dir=\"{}\"", out.display()));
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    cmd.args(extra).assert()
}

fn metrics(out: &Path) -> Vec<Value> {
    common::read_jsonl(&out.join("metrics.jsonl"))
}

fn assert_trained(out: &Path, steps: usize, what: &str) {
    let m = metrics(out);
    assert_eq!(m.len(), steps, "{what}: metrics lines");
    for line in &m {
        let loss = line["loss"].as_f64().unwrap_or(f64::NAN);
        assert!(loss.is_finite() && line["grad_norm"].as_f64().is_some_and(f64::is_finite), "{what}: {line}");
        assert_eq!(line["skipped"], false, "{what}: a step was skipped: {line}");
    }
}

#[test]
fn every_objective_trains_on_the_smoke_data() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let runs: &[(&str, &[&str])] = &[
        ("off_grpo", &["objective.bias=0.5", "objective.beta=0.1"]),
        ("grpo", &["objective.beta=0.1", "objective.eps_high=0.28"]),
        ("gspo", &[]),
        (
            "rec",
            &["objective.clip_mode=\"ring\"", "objective.importance_weight=true", "objective.anchor=\"reference\""],
        ),
        ("rec", &["objective.eps=0.6", "objective.eps_high=2.0"]),
        ("opmd", &["objective.anchor=\"snapshot\"", "objective.anchor_every=1"]),
        ("asymre", &["objective.beta=0.05", "objective.kl_estimator=\"k2\""]),
        ("red_drop", &[]),
        ("red_weight", &[]),
        ("oapl", &[]),
        ("sft", &["objective.beta=0.1"]),
        ("cispo", &["objective.eps_high=0.28", "objective.scale_rewards=\"batch\"", "objective.mask_truncated=true"]),
        (
            "grpo",
            &[
                "objective.dual_clip=true",
                "objective.loss_agg=\"seq-mean-token-sum-norm\"",
                "objective.loss_scale_factor=64",
            ],
        ),
    ];
    for (i, (name, sets)) in runs.iter().enumerate() {
        let out = dir.path().join(format!("out-{i}-{name}"));
        let mut all = vec![format!("objective.name=\"{name}\"")];
        all.extend(sets.iter().map(|s| s.to_string()));
        train(&cfg, &out, &all, &[]).success();
        assert_trained(&out, 2, name);
        let resolved = std::fs::read_to_string(out.join("config.toml")).unwrap();
        assert!(resolved.contains(&format!("name = \"{name}\"")), "{resolved}");
    }
}

#[test]
fn an_option_of_another_objective_is_rejected_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let sets = ["objective.name=\"oapl\"".to_string(), "objective.eps=0.2".to_string()];
    let a = train(&cfg, &dir.path().join("out"), &sets, &[]).failure();
    let err = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(err.contains("objective.eps") && err.contains("oapl"), "{err}");
    assert!(!dir.path().join("model").exists(), "the config must be rejected before anything is loaded");
}

#[test]
fn seed_configs_run_on_the_cpu_with_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let cpu = |dir: &Path| -> Vec<String> {
        vec![
            format!("model.path=\"{}\"", dir.join("model").display()),
            format!("model.init_tiny={}", tiny_spec()),
            "model.dtype=\"f32\"".into(),
            "model.device=\"cpu\"".into(),
            "model.checkpoint_layers=false".into(),
            format!("data.inputs=[\"{}\"]", data()),
            "data.group_size=8".into(),
            "data.min_group_size=8".into(),
            "data.max_response_tokens=24".into(),
            format!("data.prepared_dir=\"{}\"", dir.join("prepared").display()),
            "train.batch_questions=2".into(),
            "train.max_steps=2".into(),
        ]
    };
    for config in
        ["configs/seed003_oapl_math.toml", "configs/seed004/rec_oneside_nois.toml", "configs/seed004/red_weight.toml"]
    {
        let out = dir.path().join(config.replace('/', "_"));
        train(&common::root().join(config), &out, &cpu(dir.path()), &[]).success();
        assert_trained(&out, 2, config);
    }
}

fn strip_timing(v: &Value) -> Value {
    let mut v = v.clone();
    for k in ["step_time", "tokens_per_sec"] {
        v.as_object_mut().unwrap().remove(k);
    }
    v
}

/// oapl with its anchor snapshot refreshed every 2 steps: checkpoints at odd steps hold the snapshot
/// (anchor.safetensors), even ones are their own snapshot; resuming from either continues exactly.
#[test]
fn resume_restores_the_anchor_snapshot_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let sets: Vec<String> = [
        "objective.name=\"oapl\"",
        "objective.anchor_every=2",
        "objective.beta2=0.05",
        "train.max_steps=4",
        "train.save_every=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let a = dir.path().join("a");
    train(&cfg, &a, &sets, &[]).success();
    let ck = |out: &Path, s: usize| out.join(format!("checkpoints/step-{s:08}"));
    for s in 1..=4 {
        assert_eq!(ck(&a, s).join("anchor.safetensors").exists(), s % 2 == 1, "step {s}");
    }
    for from in [3usize, 2] {
        let c = dir.path().join(format!("c{from}"));
        train(&cfg, &c, &sets, &[]).success();
        for s in from + 1..=4 {
            std::fs::remove_dir_all(ck(&c, s)).unwrap();
        }
        std::fs::write(c.join("checkpoints/latest"), format!("step-{from:08}")).unwrap();
        let lines: Vec<String> =
            std::fs::read_to_string(c.join("metrics.jsonl")).unwrap().lines().map(String::from).collect();
        std::fs::write(c.join("metrics.jsonl"), lines[..from].join("\n") + "\n").unwrap();
        train(&cfg, &c, &sets, &["--resume", "auto"]).success();
        for f in ["model.safetensors", "optimizer.safetensors"] {
            let (x, y) = (std::fs::read(ck(&a, 4).join(f)).unwrap(), std::fs::read(ck(&c, 4).join(f)).unwrap());
            assert!(x == y, "resumed from step {from}: {f} differs from the uninterrupted run");
        }
        let ma: Vec<Value> = metrics(&a).iter().map(strip_timing).collect();
        let mc: Vec<Value> = metrics(&c).iter().map(strip_timing).collect();
        assert_eq!(ma, mc, "resumed from step {from}");
    }
    // Without its anchor file, a checkpoint between two refreshes cannot be resumed silently.
    std::fs::remove_file(ck(&a, 3).join("anchor.safetensors")).unwrap();
    std::fs::remove_dir_all(ck(&a, 4)).unwrap();
    std::fs::write(a.join("checkpoints/latest"), "step-00000003").unwrap();
    let r = train(&cfg, &a, &sets, &["--resume", "auto"]).failure();
    assert!(String::from_utf8_lossy(&r.get_output().stderr).contains("anchor.safetensors"));
}
