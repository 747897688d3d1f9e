//! `grpo train` end to end: the smoke config, exact resume, and the metrics users read.

mod common;

use std::path::Path;

use serde_json::Value;

fn train(dir: &Path, config: &Path, extra: &[&str]) -> assert_cmd::assert::Assert {
    let mut cmd = common::grpo();
    cmd.current_dir(common::root()).arg("train").arg("--config").arg(config);
    cmd.arg("--set").arg(format!("train.output_dir=\"{}\"", dir.join("out").display()));
    cmd.arg("--set").arg(format!("model.path=\"{}\"", dir.join("model").display()));
    for e in extra {
        cmd.arg(e);
    }
    cmd.assert()
}

const REQUIRED: &[&str] = &[
    "step",
    "epoch",
    "loss",
    "pg_loss",
    "kl",
    "grad_norm",
    "learning_rate",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "frac_bias_applied",
    "clip_ratio",
    "entropy",
    "num_tokens",
    "step_time",
    "tokens_per_sec",
];

#[test]
fn smoke_config_trains_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    train(dir.path(), &common::root().join("configs/smoke.toml"), &[]).success();
    let out = dir.path().join("out");
    let metrics = common::read_jsonl(&out.join("metrics.jsonl"));
    assert_eq!(metrics.len(), 4);
    for m in &metrics {
        for k in REQUIRED {
            assert!(m.get(*k).is_some_and(|v| !v.is_null()), "metrics line lacks {k}: {m}");
        }
        assert!(m["loss"].as_f64().unwrap().is_finite() && m["kl"].as_f64().unwrap().is_finite());
    }
    // The resolved config, the best (validation) model and a loadable final checkpoint are there.
    assert!(out.join("config.toml").exists() && out.join("best/model.safetensors").exists());
    let ck = grpo::train::latest_checkpoint(&out).expect("a checkpoint");
    for f in ["config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors", "trainer_state.json"] {
        assert!(ck.join(f).exists(), "{f} missing from {}", ck.display());
    }
    grpo::model::load_decoder(&ck, candle_core::DType::F32, &candle_core::Device::Cpu, false).unwrap();
    // A second run re-uses the prepared data.
    assert!(out.join("prepared").exists());
}

fn small_config(dir: &Path) -> std::path::PathBuf {
    let cfg = format!(
        r#"
[model]
path = "unused"
init_tiny = {{ arch = "qwen2", tokenizer = "{tok}", layers = 1, hidden = 32, heads = 4, kv_heads = 2, intermediate = 64, seed = 3 }}

[data]
inputs = ["{data}"]
group_size = 4
max_response_tokens = 24

[objective]
name = "off_grpo"
bias = 0.5
beta = 0.1

[optim]
lr = 1e-3
schedule = "cosine"
warmup_steps = 1

[train]
batch_questions = 2
micro_batch_size = 3
epochs = 1
max_steps = 4
seed = 7
save_every = 2
keep_last = 5
"#,
        tok = common::root().join("data/tokenizers/smollm2").display(),
        data = common::root().join("data/trajectories/ot3_math_x8_dev.jsonl").display(),
    );
    let p = dir.join("small.toml");
    std::fs::write(&p, cfg).unwrap();
    p
}

fn strip_timing(v: &Value) -> Value {
    let mut v = v.clone();
    for k in ["step_time", "tokens_per_sec"] {
        v.as_object_mut().unwrap().remove(k);
    }
    v
}

#[test]
fn resume_continues_exactly() {
    // One run of 4 steps ...
    let a = tempfile::tempdir().unwrap();
    let cfg_a = small_config(a.path());
    train(a.path(), &cfg_a, &[]).success();
    // ... against the same run killed after its step-2 checkpoint and resumed with --resume auto.
    let c = tempfile::tempdir().unwrap();
    let cfg_c = small_config(c.path());
    train(c.path(), &cfg_c, &[]).success();
    let out_c = c.path().join("out");
    // Drop everything after step 2, as if the run had died there (with a metrics line written past it).
    std::fs::remove_dir_all(out_c.join("checkpoints/step-00000004")).unwrap();
    std::fs::write(out_c.join("checkpoints/latest"), "step-00000002").unwrap();
    let lines: Vec<String> =
        std::fs::read_to_string(out_c.join("metrics.jsonl")).unwrap().lines().map(String::from).collect();
    std::fs::write(out_c.join("metrics.jsonl"), lines[..3].join("\n") + "\n").unwrap();
    train(c.path(), &cfg_c, &["--resume", "auto"]).success();

    let wa = std::fs::read(a.path().join("out/checkpoints/step-00000004/model.safetensors")).unwrap();
    let wc = std::fs::read(out_c.join("checkpoints/step-00000004/model.safetensors")).unwrap();
    assert!(wa == wc, "resumed weights differ from the uninterrupted run");
    let oa = std::fs::read(a.path().join("out/checkpoints/step-00000004/optimizer.safetensors")).unwrap();
    let oc = std::fs::read(out_c.join("checkpoints/step-00000004/optimizer.safetensors")).unwrap();
    assert!(oa == oc, "resumed optimiser state differs");
    let ma: Vec<Value> = common::read_jsonl(&a.path().join("out/metrics.jsonl")).iter().map(strip_timing).collect();
    let mc: Vec<Value> = common::read_jsonl(&out_c.join("metrics.jsonl")).iter().map(strip_timing).collect();
    assert_eq!(ma, mc);
}

#[test]
fn bad_configs_fail_before_loading_anything() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.toml");
    std::fs::write(&p, "[model]\npath = \"x\"\n[data]\ninputs = [\"y\"]\n[objective]\nbetta = 1\n").unwrap();
    let a = common::grpo().args(["train", "--config"]).arg(&p).assert().failure();
    let err = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(err.contains("betta") && err.contains("did you mean `beta`"), "{err}");
    let a = common::grpo()
        .args(["train", "--config"])
        .arg(common::root().join("configs/smoke.toml"))
        .args(["--set", "objective.kl_estimator=\"k4\""])
        .assert()
        .failure();
    assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("k4"));
}

#[test]
fn non_finite_steps_are_skipped_then_stop_the_run_with_the_last_good_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    // An absurd learning rate makes the weights overflow after the first update; later steps are
    // non-finite, skipped, and the run stops after max_bad_steps of them.
    let a = train(
        dir.path(),
        &cfg,
        &[
            "--set",
            "optim.lr=1e38",
            "--set",
            "optim.grad_clip=0",
            "--set",
            "train.max_bad_steps=1",
            "--set",
            "train.save_every=1",
            "--set",
            "optim.name=\"sgd\"",
        ],
    )
    .failure();
    let err = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(err.contains("non-finite") && err.contains("Last good checkpoint"), "{err}");
    let m = common::read_jsonl(&dir.path().join("out/metrics.jsonl"));
    assert!(m.iter().any(|l| l["skipped"] == true), "no skipped step recorded");
    assert!(grpo::train::latest_checkpoint(&dir.path().join("out")).is_some());
}

#[test]
fn ctrl_c_writes_a_checkpoint_and_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let out = dir.path().join("out");
    let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("grpo"))
        .current_dir(common::root())
        .args(["-q", "train", "--config"])
        .arg(&cfg)
        .arg("--set")
        .arg(format!("train.output_dir=\"{}\"", out.display()))
        .arg("--set")
        .arg(format!("model.path=\"{}\"", dir.path().join("model").display()))
        .args(["--set", "train.max_steps=0", "--set", "train.save_every=0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first step, then interrupt.
    let metrics = out.join("metrics.jsonl");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |s| s.lines().count() == 0) {
        assert!(t0.elapsed().as_secs() < 300, "no step finished");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("interrupted"), "{stderr}");
    let ck = grpo::train::latest_checkpoint(&out).expect("a checkpoint written on Ctrl-C");
    let state: Value = serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap()).unwrap();
    let steps = common::read_jsonl(&metrics).len() as u64;
    assert_eq!(state["step"].as_u64().unwrap(), steps);
    assert!(steps < 25, "the run was not interrupted");
}
