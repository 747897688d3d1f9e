//! `grpo train` with `[rollout]`: on-policy training raises the reward of its own answers, and a run
//! killed mid-way resumes exactly (weights, optimiser, lagged sampling policy, swapped reference, metrics).

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;

/// A tiny model on the 64-token digits tokenizer and a questions file whose gold answer is always 7.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("model");
    let questions = common::digits_model_and_questions(dir, &model);
    (model, questions)
}

/// On-policy GRPO on the questions (a learning rate of 1e-9 stands for 0, which the config rejects): 4 questions x 8 answers of at most 2 tokens per step; the reward is
/// the real math reward with the final-number fallback (an answer whose last number is 7 is right).
fn config(dir: &Path, model: &Path, questions: &Path, lr: f64, steps: usize) -> PathBuf {
    let text = format!(
        r#"[model]
path = "{model}"

[data]
max_prompt_tokens = 64

[objective]
name = "grpo"
anchor = "behaviour"

[optim]
lr = {lr}
grad_clip = 0.0

[train]
output_dir = "{out}"
batch_questions = 4
micro_batch_size = 16
epochs = 0
max_steps = {steps}
seed = 3
keep_last = 20

[rollout]
n = 8
max_new_tokens = 2
temperature = 1.0
batch_size = 32
questions = "{questions}"
prompt_template = "{{problem}}"
fallbacks = true
"#,
        model = model.display(),
        out = dir.join("out").display(),
        questions = questions.display(),
    );
    let p = dir.join(format!("config-{lr}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn train(config: &Path, extra: &[&str]) -> assert_cmd::assert::Assert {
    common::grpo().current_dir(common::root()).args(["-q", "train", "--config"]).arg(config).args(extra).assert()
}

fn rewards(out: &Path) -> Vec<f64> {
    common::read_jsonl(&out.join("metrics.jsonl")).iter().map(|m| m["rollout/reward_mean"].as_f64().unwrap()).collect()
}

#[test]
fn on_policy_training_raises_the_reward_of_its_own_answers() {
    let d = tempfile::tempdir().unwrap();
    let (model, questions) = setup(d.path());
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let mut last = Vec::new();
    for lr in [1e-9, 0.03] {
        let run = d.path().join(format!("lr{lr}"));
        std::fs::create_dir_all(&run).unwrap();
        train(&config(&run, &model, &questions, lr, 16), &[]).success();
        let r = rewards(&run.join("out"));
        assert_eq!(r.len(), 16);
        let m = common::read_jsonl(&run.join("out/metrics.jsonl"));
        for k in ["rollout/reward_std", "rollout/mean_length", "rollout/generation_time", "rollout/tokens_per_sec"] {
            assert!(m[0][k].as_f64().is_some(), "{k} missing: {}", m[0]);
        }
        // One update per batch from the sampling weights themselves: the ratio is 1 and nothing is clipped.
        assert!((m[0]["ratio_min"].as_f64().unwrap() - 1.0).abs() < 1e-3, "{}", m[0]);
        assert!((m[0]["ratio_max"].as_f64().unwrap() - 1.0).abs() < 1e-3, "{}", m[0]);
        assert_eq!(m[0]["clip_ratio"].as_f64(), Some(0.0));
        eprintln!("lr {lr}: rollout rewards {r:?}");
        last.push(mean(&r[12..]));
    }
    let (frozen, trained) = (last[0], last[1]);
    assert!(trained > frozen + 0.25, "the reward did not rise: {frozen:.3} at lr 1e-9, {trained:.3} trained");
}

fn strip_timing(v: &Value) -> Value {
    let mut v = v.clone();
    for k in ["step_time", "tokens_per_sec", "rollout/generation_time", "rollout/tokens_per_sec"] {
        v.as_object_mut().unwrap().remove(k);
    }
    v
}

/// Lagged rollouts (sync_every = 2), two updates per batch, zero-variance masking and a reference swapped
/// every 3 steps with a KL term: every piece of state a resume must restore.
const LAGGED: &[&str] = &[
    "--set",
    "rollout.sync_every=2",
    "--set",
    "rollout.updates_per_batch=2",
    "--set",
    "objective.mask_zero_std=true",
    "--set",
    "objective.beta=0.1",
    "--set",
    "train.reference_swap_every=3",
    "--set",
    "train.save_every=1",
];

fn same_run(a: &Path, c: &Path, why: &str) {
    for f in ["model.safetensors", "optimizer.safetensors", "reference.safetensors"] {
        let (x, y) = (a.join("checkpoints/step-00000006").join(f), c.join("checkpoints/step-00000006").join(f));
        assert!(std::fs::read(x).unwrap() == std::fs::read(y).unwrap(), "{f} differs; {why}");
    }
    let ma: Vec<Value> = common::read_jsonl(&a.join("metrics.jsonl")).iter().map(strip_timing).collect();
    let mc: Vec<Value> = common::read_jsonl(&c.join("metrics.jsonl")).iter().map(strip_timing).collect();
    assert_eq!(ma, mc, "{why}");
}

#[test]
fn a_lagged_run_resumed_from_any_checkpoint_ends_exactly_as_an_uninterrupted_one() {
    let d = tempfile::tempdir().unwrap();
    let (model, questions) = setup(d.path());
    let a = d.path().join("a");
    std::fs::create_dir_all(&a).unwrap();
    train(&config(&a, &model, &questions, 0.03, 6), LAGGED).success();
    let ck = a.join("out/checkpoints");
    // Step 3: the sampling copy (taken at step 2) and the reference swapped at step 3 are in the checkpoint.
    assert!(ck.join("step-00000003/sampler.safetensors").exists());
    assert!(ck.join("step-00000003/reference.safetensors").exists());
    assert!(!ck.join("step-00000004/sampler.safetensors").exists(), "step 4 is its own sampling policy");
    assert!(!ck.join("step-00000002/reference.safetensors").exists(), "no swap before step 3");
    let m = common::read_jsonl(&a.join("out/metrics.jsonl"));
    let spread = m[0]["ratio_max"].as_f64().unwrap() - m[0]["ratio_min"].as_f64().unwrap();
    assert!(spread > 1e-3, "two updates per batch: the second update's ratio moves away from 1: {}", m[0]);
    for from in [3, 4, 5] {
        let c = d.path().join(format!("c{from}"));
        std::fs::create_dir_all(&c).unwrap();
        let cfg = config(&c, &model, &questions, 0.03, 6);
        train(&cfg, LAGGED).success();
        let out = c.join("out");
        for later in from + 1..=6 {
            std::fs::remove_dir_all(out.join(format!("checkpoints/step-{later:08}"))).unwrap();
        }
        std::fs::write(out.join("checkpoints/latest"), format!("step-{from:08}")).unwrap();
        train(&cfg, &[LAGGED, &["--resume", "auto"]].concat()).success();
        same_run(&a.join("out"), &out, &format!("resumed from step {from}"));
    }
    // A checkpoint after the swap without its swapped reference is refused, not resumed with the initial one
    // (its checksum record is edited too, as a copy that left the file out would have it).
    let step4 = ck.join("step-00000004");
    std::fs::remove_file(step4.join("reference.safetensors")).unwrap();
    let sums = step4.join("checksums.json");
    let mut record: Value = serde_json::from_str(&std::fs::read_to_string(&sums).unwrap()).unwrap();
    record["files"].as_object_mut().unwrap().remove("reference.safetensors").unwrap();
    std::fs::write(&sums, serde_json::to_vec(&record).unwrap()).unwrap();
    for later in 5..=6 {
        std::fs::remove_dir_all(ck.join(format!("step-{later:08}"))).unwrap();
    }
    std::fs::write(ck.join("latest"), "step-00000004").unwrap();
    let cfg = config(&a, &model, &questions, 0.03, 6);
    let failed = train(&cfg, &[LAGGED, &["--resume", "auto"]].concat()).failure();
    let err = String::from_utf8_lossy(&failed.get_output().stderr).into_owned();
    assert!(err.contains("missing reference.safetensors") && err.contains("step-00000004"), "{err}");
}

#[test]
fn a_lagged_run_killed_mid_way_resumes_exactly() {
    let d = tempfile::tempdir().unwrap();
    let (model, questions) = setup(d.path());
    let a = d.path().join("a");
    std::fs::create_dir_all(&a).unwrap();
    train(&config(&a, &model, &questions, 0.03, 6), LAGGED).success();
    let c = d.path().join("c");
    std::fs::create_dir_all(&c).unwrap();
    let cfg = config(&c, &model, &questions, 0.03, 6);
    let mut child = common::command()
        .current_dir(common::root())
        .args(["-q", "train", "--config"])
        .arg(&cfg)
        .args(LAGGED)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let metrics = c.join("out/metrics.jsonl");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |s| s.lines().count() < 3) {
        assert!(t0.elapsed().as_secs() < 120, "no step finished");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::process::Command::new("kill").args(["-KILL", &child.id().to_string()]).status().unwrap();
    child.wait().unwrap();
    train(&cfg, &[LAGGED, &["--resume", "auto"]].concat()).success();
    same_run(&a.join("out"), &c.join("out"), "killed after 3 steps");
}

#[test]
fn the_seed_configs_check_and_the_on_policy_arm_runs_on_the_cpu_as_the_readme_says() {
    for c in ["sft", "off_policy", "off_policy_bias", "on_policy"] {
        let cfg = common::root().join(format!("configs/seed000/{c}.toml"));
        common::grpo().args(["train", "--check", "--config"]).arg(&cfg).assert().success();
    }
    common::grpo()
        .args(["train", "--check", "--config"])
        .arg(common::root().join("configs/seed002.toml"))
        .assert()
        .success();
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny-llama");
    common::init_tiny("llama", "smollm2", &model);
    let out = d.path().join("out");
    let sets = [
        format!("model.path={}", model.display()),
        "model.dtype=f32".into(),
        "model.device=cpu".into(),
        "model.checkpoint_layers=false".into(),
        r#"data.inputs=["data/trajectories/ot3_math_x8_dev.jsonl"]"#.into(),
        "data.max_questions=0".into(),
        "data.max_response_tokens=128".into(),
        "data.overlong=truncate".into(),
        "rollout.max_new_tokens=32".into(),
        "rollout.batch_size=16".into(),
        "validation.limit=2".into(),
        "validation.n=1".into(),
        "validation.max_new_tokens=16".into(),
        "train.batch_questions=2".into(),
        "train.max_steps=2".into(),
        format!("train.output_dir={}", out.display()),
    ];
    let mut cmd = common::grpo();
    cmd.current_dir(common::root()).args(["-q", "train", "--config", "configs/seed000/on_policy.toml"]);
    for s in &sets {
        cmd.arg("--set").arg(s);
    }
    cmd.assert().success();
    let m = common::read_jsonl(&out.join("metrics.jsonl"));
    assert_eq!(m.len(), 2);
    assert!(m[1]["rollout/mean_length"].as_f64().unwrap() > 0.0, "{}", m[1]);
    assert!(m[1]["validation/score"].as_f64().is_some(), "the run's end validates: {}", m[1]);
}

/// The config of `config` with `[rollout]` lines `extra` and answers from `server` (SGLang's reload).
fn server_config(
    dir: &Path,
    model: &Path,
    questions: &Path,
    steps: usize,
    server: &common::Scripted,
    extra: &str,
) -> PathBuf {
    let p = config(dir, model, questions, 0.03, steps);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "fallbacks = true\n",
        &format!(
            "fallbacks = true\nreload = \"sglang\"\n{extra}\n[rollout.server]\nengine = \"openai\"\nserved_model = \"m\"\n\
             base_url = \"http://127.0.0.1:{}/v1\"\n",
            server.port
        ),
    );
    std::fs::write(&p, text).unwrap();
    p
}

/// The staleness histograms of a run's steps.
fn staleness(out: &Path) -> Vec<Vec<u64>> {
    common::read_jsonl(&out.join("metrics.jsonl"))
        .iter()
        .map(|m| m["rollout/staleness"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect())
        .collect()
}

/// With rollout.max_staleness = k and a server whose answers take random times, the requests of the next
/// k steps are in flight while a step trains: step t's answers come from the weights the server held k
/// steps earlier (the first steps' from the starting weights), never older, none dropped; the server is
/// told to reload after every update.
#[test]
fn a_server_kept_busy_answers_at_most_k_steps_behind() {
    let d = tempfile::tempdir().unwrap();
    let (model, questions) = setup(d.path());
    for k in [1usize, 2] {
        let dir = d.path().join(format!("k{k}"));
        std::fs::create_dir_all(&dir).unwrap();
        let Some(server) = common::Scripted::start_random(&dir, "s", 0.2) else { return };
        let cfg = server_config(&dir, &model, &questions, 5, &server, &format!("max_staleness = {k}"));
        train(&cfg, &[]).success();
        let out = dir.join("out");
        let lags = staleness(&out);
        assert_eq!(lags.len(), 5);
        for (t, h) in lags.iter().enumerate() {
            let lag = t.min(k);
            let mut want = vec![0u64; k + 1];
            want[lag] = 32;
            assert_eq!(h, &want, "k {k} step {t}: {lags:?}");
        }
        for m in common::read_jsonl(&out.join("metrics.jsonl")) {
            assert_eq!(m["rollout/dropped_stale"], 0, "{m}");
        }
        let reloads = server.lines().iter().filter(|l| l.starts_with("reload ")).count();
        // The start, then after each update whose version a later step's answers come from.
        assert_eq!(reloads, 1 + (5 - k - 1), "k {k}: {:?}", server.lines());
    }
}

/// A run at max_staleness = 1 killed mid-way (a step's requests in flight) resumes from its last
/// checkpoint by asking the server again for what was in flight: with a server whose answers depend only on
/// the request, it ends with the weights and the losses of the uninterrupted run.
#[test]
fn a_server_run_at_staleness_1_killed_mid_way_resumes_as_the_uninterrupted_run() {
    let d = tempfile::tempdir().unwrap();
    let (model, questions) = setup(d.path());
    let Some(server) = common::Scripted::start_random(d.path(), "s", 0.05) else { return };
    let every = ["--set", "train.save_every=1"];
    let config_in = |name: &str| {
        let dir = d.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        (server_config(&dir, &model, &questions, 6, &server, "max_staleness = 1"), dir.join("out"))
    };
    let (cfg_a, a) = config_in("a");
    train(&cfg_a, &every).success();
    let (cfg_c, c) = config_in("c");
    let mut child = common::command()
        .current_dir(common::root())
        .args(["-q", "train", "--config"])
        .arg(&cfg_c)
        .args(every)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(c.join("metrics.jsonl")).map_or(true, |s| s.lines().count() < 3) {
        assert!(t0.elapsed().as_secs() < 120, "no step finished");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::process::Command::new("kill").args(["-KILL", &child.id().to_string()]).status().unwrap();
    child.wait().unwrap();
    train(&cfg_c, &[&every[..], &["--resume", "auto"]].concat()).success();
    let w = |o: &Path| std::fs::read(o.join("checkpoints/step-00000006/model.safetensors")).unwrap();
    assert!(w(&a) == w(&c), "the resumed run's weights differ from the uninterrupted run's");
    let losses = |o: &Path| -> Vec<Value> {
        common::read_jsonl(&o.join("metrics.jsonl")).iter().map(|m| m["loss"].clone()).collect()
    };
    assert_eq!(losses(&a), losses(&c));
}
