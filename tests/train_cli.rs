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
    assert!(out.join("curves.png").exists(), "the training curves are drawn at validation and at the end");
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
    // A huge advantage (bias) with f16 weights makes the weights overflow f16 after the first update (the
    // f32 master weights are finite, their f16 copy is not); later steps are non-finite, skipped, and the run
    // stops after max_bad_steps of them. (An absurd learning rate is refused by the config's bounds.)
    let a = train(
        dir.path(),
        &cfg,
        &[
            "--set",
            "model.dtype=\"f16\"",
            "--set",
            "objective.bias=1e6",
            "--set",
            "optim.lr=1",
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

/// `grpo train` of `config` in the background, on the folders of `train`, with stderr captured.
fn spawn(dir: &Path, config: &Path, extra: &[&str]) -> std::process::Child {
    std::process::Command::new(assert_cmd::cargo::cargo_bin("grpo"))
        .current_dir(common::root())
        .args(["-q", "train", "--config"])
        .arg(config)
        .arg("--set")
        .arg(format!("train.output_dir=\"{}\"", dir.join("out").display()))
        .arg("--set")
        .arg(format!("model.path=\"{}\"", dir.join("model").display()))
        .args(extra)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Wait until metrics.jsonl has at least `lines` lines.
fn wait_for_steps(metrics: &Path, lines: usize) {
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(metrics).map_or(true, |s| s.lines().count() < lines) {
        assert!(t0.elapsed().as_secs() < 300, "no step finished");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn signal(child: &std::process::Child, sig: &str) {
    std::process::Command::new("kill").args([sig, &child.id().to_string()]).status().unwrap();
}

/// A run of all 25 steps of the epoch, checkpointing only at its end (or when stopped).
const LONG: &[&str] = &["--set", "train.max_steps=0", "--set", "train.save_every=0"];

/// The documented exit status of a run stopped on request after its checkpoint.
const STOPPED: i32 = 75;

/// A run stopped by `sig` after its first step exits with STOPPED and a checkpoint of its last step.
fn stop_after_first_step(sig: &str) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let out = dir.path().join("out");
    let child = spawn(dir.path(), &cfg, LONG);
    let metrics = out.join("metrics.jsonl");
    wait_for_steps(&metrics, 1);
    signal(&child, sig);
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(STOPPED), "{sig}: {stderr}");
    assert!(stderr.contains("interrupted") && stderr.contains("--resume auto"), "{stderr}");
    let ck = grpo::train::latest_checkpoint(&out).expect("a checkpoint written on the stop request");
    let state: Value = serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap()).unwrap();
    let steps = common::read_jsonl(&metrics).len() as u64;
    assert_eq!(state["step"].as_u64().unwrap(), steps);
    assert!(steps < 25, "the run was not interrupted");
}

#[test]
fn ctrl_c_writes_a_checkpoint_and_exits_with_the_stop_status() {
    stop_after_first_step("-INT");
}

#[test]
fn sigterm_writes_a_checkpoint_and_exits_with_the_stop_status() {
    stop_after_first_step("-TERM");
}

fn stderr_of(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stderr).into_owned()
}

fn run_id(ck: &Path) -> String {
    let state: Value = serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap()).unwrap();
    state["run_id"].as_str().unwrap().to_string()
}

#[test]
fn a_new_run_refuses_a_folder_with_checkpoints_unless_told_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let out = dir.path().join("out");
    train(dir.path(), &cfg, &[]).success();
    let first = run_id(&grpo::train::latest_checkpoint(&out).unwrap());
    let before = std::fs::read(out.join("metrics.jsonl")).unwrap();
    // Without --resume or --overwrite the folder is left as it is.
    let err = stderr_of(&train(dir.path(), &cfg, &["--set", "train.keep_last=1"]).failure());
    assert!(err.contains("--resume auto") && err.contains("--overwrite") && err.contains("step-00000004"), "{err}");
    assert_eq!(std::fs::read(out.join("metrics.jsonl")).unwrap(), before);
    assert!(out.join("checkpoints/step-00000002").exists() && out.join("checkpoints/step-00000004").exists());
    // --overwrite deletes the previous run, says so, and the new run's checkpoints survive its own pruning.
    let err = stderr_of(&train(dir.path(), &cfg, &["--overwrite", "--set", "train.keep_last=1"]).success());
    assert!(err.contains("--overwrite: deleting"), "{err}");
    let ck = grpo::train::latest_checkpoint(&out).expect("the new run's latest checkpoint");
    assert!(ck.ends_with("step-00000004") && run_id(&ck) != first);
    let names: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert_eq!(common::read_jsonl(&out.join("metrics.jsonl")).len(), 4);
}

#[test]
fn a_second_run_on_the_same_folder_fails_naming_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let out = dir.path().join("out");
    let first = spawn(dir.path(), &cfg, LONG);
    wait_for_steps(&out.join("metrics.jsonl"), 1);
    let second = train(dir.path(), &cfg, &["--resume", "auto"]).failure();
    let err = stderr_of(&second);
    assert!(err.contains("in use by another grpo run") && err.contains(&format!("pid {}", first.id())), "{err}");
    // The first run goes on undisturbed: its metrics are intact and it ends normally.
    signal(&first, "-TERM");
    let output = first.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(STOPPED), "{}", String::from_utf8_lossy(&output.stderr));
    let steps =
        common::read_jsonl(&out.join("metrics.jsonl")).iter().map(|m| m["step"].as_u64().unwrap()).collect::<Vec<_>>();
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
    // The lock went with the process.
    train(dir.path(), &cfg, &["--resume", "auto", "--set", "train.max_steps=2"]).success();
}

#[test]
fn resume_refuses_a_checkpoint_of_another_model() {
    let a = tempfile::tempdir().unwrap();
    let cfg_a = small_config(a.path());
    train(a.path(), &cfg_a, &[]).success();
    // The same recipe on a two-layer model, told to resume from the one-layer run's checkpoint.
    let b = tempfile::tempdir().unwrap();
    let cfg_b = small_config(b.path());
    let text = std::fs::read_to_string(&cfg_b).unwrap().replace("layers = 1", "layers = 2");
    std::fs::write(&cfg_b, text).unwrap();
    let ck = a.path().join("out/checkpoints/step-00000002");
    // --allow-config-change lets the config differ, never the model.
    let resume = ["--resume", ck.to_str().unwrap(), "--allow-config-change"];
    let err = stderr_of(&train(b.path(), &cfg_b, &resume).failure());
    assert!(err.contains("cannot resume") && err.contains("num_hidden_layers 1 (checkpoint) vs 2 (model)"), "{err}");
    assert!(!b.path().join("out/metrics.jsonl").exists());
}

#[test]
fn resume_with_a_changed_training_config_stops_unless_allowed_and_keeps_each_segments_config() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let out = dir.path().join("out");
    train(dir.path(), &cfg, &[]).success();
    let changed = ["--resume", "auto", "--set", "train.seed=8", "--set", "train.max_steps=6"];
    let err = stderr_of(&train(dir.path(), &cfg, &changed).failure());
    assert!(err.contains("train.seed: 7 -> 8") && err.contains("--allow-config-change"), "{err}");
    assert!(!err.contains("max_steps"), "an allowed key is listed: {err}");
    assert_eq!(common::read_jsonl(&out.join("metrics.jsonl")).len(), 4);
    train(dir.path(), &cfg, &[&changed[..], &["--allow-config-change"]].concat()).success();
    assert_eq!(common::read_jsonl(&out.join("metrics.jsonl")).len(), 6);
    let first = std::fs::read_to_string(out.join("config.toml")).unwrap();
    let second = std::fs::read_to_string(out.join("config-resume-step-00000004.toml")).unwrap();
    assert!(first.contains("seed = 7") && second.contains("seed = 8"), "{first}\n{second}");
    let ck = std::fs::read_to_string(out.join("checkpoints/step-00000006/train_config.toml")).unwrap();
    assert!(ck.contains("seed = 8") && ck.contains("max_steps = 6"), "{ck}");
}

#[test]
fn leftovers_of_a_killed_run_are_removed_and_a_damaged_checkpoint_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let out = dir.path().join("out");
    train(dir.path(), &cfg, &[]).success();
    // What a kill leaves: a half-written checkpoint, a half-deleted one (pruning), a half-written best model.
    let ckdir = out.join("checkpoints");
    let leftovers = [
        ckdir.join(".step-00000006.x1Y2z3.tmp"),
        ckdir.join(".step-00000002.del-999999"),
        out.join(".best.Q9w8E7.tmp"),
    ];
    for l in &leftovers {
        std::fs::create_dir_all(l).unwrap();
        std::fs::write(l.join("model.safetensors"), vec![0u8; 1000]).unwrap();
    }
    std::fs::remove_file(ckdir.join("step-00000004/optimizer.safetensors")).unwrap();
    let err = stderr_of(&train(dir.path(), &cfg, &["--resume", "auto", "--set", "train.max_steps=6"]).failure());
    assert!(err.contains("step-00000004") && err.contains("missing optimizer.safetensors"), "{err}");
    for l in &leftovers {
        assert!(!l.exists(), "{} was left", l.display());
    }
    // The previous checkpoint still resumes.
    let ck = ckdir.join("step-00000002");
    train(dir.path(), &cfg, &["--resume", ck.to_str().unwrap(), "--set", "train.max_steps=6"]).success();
    assert_eq!(common::read_jsonl(&out.join("metrics.jsonl")).len(), 6);
}

/// The checkpoint folder's entries, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn killed_at_random_points_and_resumed_a_run_ends_exactly_as_an_uninterrupted_one() {
    use rand::{Rng, SeedableRng};
    let opts =
        ["--resume", "auto", "--set", "train.max_steps=6", "--set", "train.save_every=1", "--set", "train.keep_last=2"];
    let a = tempfile::tempdir().unwrap();
    let t0 = std::time::Instant::now();
    train(a.path(), &small_config(a.path()), &opts).success();
    let full_ms = t0.elapsed().as_millis() as u64;
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let c = tempfile::tempdir().unwrap();
    let cfg_c = small_config(c.path());
    let mut kills = Vec::new();
    for _ in 0..5 {
        let mut child = spawn(c.path(), &cfg_c, &opts);
        let ms = rng.gen_range(0..full_ms / 2);
        std::thread::sleep(std::time::Duration::from_millis(ms));
        if child.try_wait().unwrap().is_some() {
            break;
        }
        signal(&child, "-KILL");
        child.wait().unwrap();
        kills.push(ms);
    }
    let why = format!("seed {seed}, killed after {kills:?} ms (an uninterrupted run takes {full_ms} ms)");
    train(c.path(), &cfg_c, &opts).success();
    let (ca, cc) = (a.path().join("out/checkpoints"), c.path().join("out/checkpoints"));
    for f in ["step-00000006/model.safetensors", "step-00000006/optimizer.safetensors"] {
        assert!(std::fs::read(ca.join(f)).unwrap() == std::fs::read(cc.join(f)).unwrap(), "{f} differs; {why}");
    }
    let ma: Vec<Value> = common::read_jsonl(&a.path().join("out/metrics.jsonl")).iter().map(strip_timing).collect();
    let mc: Vec<Value> = common::read_jsonl(&c.path().join("out/metrics.jsonl")).iter().map(strip_timing).collect();
    assert_eq!(ma, mc, "{why}");
    assert_eq!(entries(&cc), ["latest", "step-00000005", "step-00000006"], "{why}");
}

#[test]
fn no_training_groups_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let a = train(dir.path(), &cfg, &["--set", "data.min_group_size=9", "--set", "data.group_size=0"]).failure();
    let err = stderr_of(&a);
    assert!(err.contains("no training groups"), "{err}");
    assert!(
        err.contains("400 rows read") && err.contains("50 with fewer than data.min_group_size = 9 answers"),
        "{err}"
    );
}

#[test]
fn groups_smaller_than_group_size_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let a = train(dir.path(), &cfg, &["--set", "data.group_size=10", "--set", "train.max_steps=1"]).success();
    let err = stderr_of(&a);
    assert!(err.contains("48 of 48 groups have fewer than data.group_size = 10 answers and are trained on"), "{err}");
}
