//! `grpo train` end to end: exact resume, and the metrics users read (the smoke config's run as the
//! README gives it: tests/readme_cli.rs).

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
    // The log's last line says that the run failed, and why.
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("error: training failed: "), "{err}");
    assert!(last.contains("non-finite") && last.contains("Last good checkpoint"), "{last}");
    let m = common::read_jsonl(&dir.path().join("out/metrics.jsonl"));
    assert!(m.iter().any(|l| l["skipped"] == true), "no skipped step recorded");
    assert!(grpo::train::latest_checkpoint(&dir.path().join("out")).is_some());
}

#[test]
fn running_out_of_memory_names_the_phase_the_plan_and_the_settings_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let mut cmd = common::grpo();
    cmd.current_dir(common::root()).env("GRPO_INJECT_OOM", "backward@2").args(["train", "--config"]).arg(&cfg);
    cmd.arg("--set").arg(format!("train.output_dir=\"{}\"", dir.path().join("out").display()));
    cmd.arg("--set").arg(format!("model.path=\"{}\"", dir.path().join("model").display()));
    cmd.args(["--set", "train.save_every=1"]);
    let a = cmd.assert().code(1);
    let err = stderr_of(&a);
    let last = err.lines().last().unwrap_or_default();
    assert!(last.contains("out of device memory in the backward"), "{err}");
    // The plan's figure for the phase, what was in use (not measured on the CPU) and what to change.
    assert!(last.contains("the memory plan expected ") && last.contains(" GiB of tensors there"), "{last}");
    assert!(last.contains("in use: not measured") && last.contains("train.micro_batch_size = 2 (peak "), "{last}");
    let out = dir.path().join("out");
    assert!(last.contains("step-00000001 (intact: --resume auto continues from it)"), "{last}");
    assert_eq!(std::fs::read_to_string(out.join("checkpoints/latest")).unwrap().trim(), "step-00000001");
    assert!(!out.join("checkpoints/step-00000002").exists());
    // The checkpoint loads, and the run resumes from it to its end.
    train(dir.path(), &cfg, &["--set", "train.save_every=1", "--resume", "auto"]).success();
    let m = common::read_jsonl(&out.join("metrics.jsonl"));
    assert_eq!(m.iter().map(|l| l["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4]);
}

/// `grpo train -q` of `config` on the folders of `train` (output and model under `dir`), not started.
fn train_command(dir: &Path, config: &Path, extra: &[&str]) -> std::process::Command {
    let mut c = common::command();
    c.current_dir(common::root())
        .args(["-q", "train", "--config"])
        .arg(config)
        .arg("--set")
        .arg(format!("train.output_dir=\"{}\"", dir.join("out").display()))
        .arg("--set")
        .arg(format!("model.path=\"{}\"", dir.join("model").display()))
        .args(extra);
    c
}

/// `grpo train` of `config` in the background, on the folders of `train`, with stderr captured.
fn spawn(dir: &Path, config: &Path, extra: &[&str]) -> std::process::Child {
    train_command(dir, config, extra).stderr(std::process::Stdio::piped()).spawn().unwrap()
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
    // The last line says the run stopped, why, where its checkpoint is and what to do next.
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("run stopped on request (Ctrl-C, SIGTERM or SIGHUP) at step "), "{stderr}");
    assert!(last.contains("last checkpoint ") && last.contains("continue with --resume auto"), "{last}");
    assert!(last.ends_with("(exit status 75)"), "{last}");
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
    // (The log's first line repeats the command line, --set train.max_steps=6 included.)
    let said: Vec<&str> = err.lines().filter(|l| !l.contains(" train --config ")).collect();
    assert!(!said.join("\n").contains("max_steps"), "an allowed key is listed: {err}");
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

/// `grpo train` of `config` with extra arguments, stdout and stderr written to files (as under a scheduler);
/// returns (exit status, stdout, stderr).
fn train_logged(dir: &Path, config: &Path, extra: &[&str]) -> (Option<i32>, String, String) {
    let (out_log, err_log) = (dir.join("stdout.log"), dir.join("stderr.log"));
    let status = common::command()
        .current_dir(common::root())
        .args(["train", "--config"])
        .arg(config)
        .arg("--set")
        .arg(format!("train.output_dir=\"{}\"", dir.join("out").display()))
        .arg("--set")
        .arg(format!("model.path=\"{}\"", dir.join("model").display()))
        .args(extra)
        .stdout(std::fs::File::create(&out_log).unwrap())
        .stderr(std::fs::File::create(&err_log).unwrap())
        .status()
        .unwrap();
    let read = |p: &Path| std::fs::read_to_string(p).unwrap();
    (status.code(), read(&out_log), read(&err_log))
}

#[test]
fn without_a_terminal_each_step_is_a_log_line_and_the_run_ends_with_its_summary() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let (code, stdout, stderr) = train_logged(dir.path(), &cfg, &[]);
    assert_eq!(code, Some(0), "{stderr}");
    // Why the questions became groups, then one line per step with the numbers a person follows.
    assert!(stderr.contains("50 questions") && stderr.contains("-> 48 training groups"), "{stderr}");
    let steps: Vec<&str> = stderr.lines().filter(|l| l.contains(" step ") && l.contains("/4 epoch")).collect();
    assert_eq!(steps.len(), 4, "{stderr}");
    for (i, l) in steps.iter().enumerate() {
        assert!(l.contains(&format!("step {}/4", i + 1)), "{l}");
        for word in ["loss ", "reward ", "kl ", "clip ", "tok/s", "elapsed ", "ETA "] {
            assert!(l.contains(word), "{word} missing: {l}");
        }
    }
    // The summary on stdout and in summary.json.
    let out = dir.path().join("out");
    assert!(stdout.contains("run complete: 4 of 4 steps"), "{stdout}");
    assert!(stdout.contains("final (step 4): loss") && stdout.contains("best: loss"), "{stdout}");
    for f in ["metrics.jsonl", "curves.png", "checkpoints/step-00000004", "summary.json"] {
        assert!(stdout.contains(&out.join(f).display().to_string()), "{f}: {stdout}");
    }
    // The log (stderr alone, as under a scheduler) ends saying so, with the same paths.
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.contains("run complete: 4 of 4 steps in "), "{stderr}");
    for f in ["metrics.jsonl", "curves.png", "checkpoints/step-00000004", "summary.json"] {
        assert!(last.contains(&out.join(f).display().to_string()), "{f}: {last}");
    }
    // The KL with the digits to see it move (metrics.jsonl has values of order 1e-5 and up).
    for (l, m) in steps.iter().zip(common::read_jsonl(&out.join("metrics.jsonl"))) {
        let kl = m["kl"].as_f64().unwrap();
        let shown: f64 = l.split(" kl ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert!((shown - kl).abs() <= kl.abs() * 0.01 + 1e-4 * f64::from(kl.abs() >= 1e-3), "{kl} shown as {l}");
    }
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "complete");
    assert_eq!((summary["steps"].as_u64(), summary["total_steps"].as_u64()), (Some(4), Some(4)));
    let metrics = common::read_jsonl(&out.join("metrics.jsonl"));
    let tokens: u64 = metrics.iter().map(|m| m["num_tokens"].as_u64().unwrap()).sum();
    assert_eq!(summary["tokens_trained"].as_u64(), Some(tokens));
    assert_eq!(summary["final_metrics"]["loss"], metrics[3]["loss"]);
    assert!(summary["wall_time_s"].as_f64().unwrap() > 0.0);
    assert_eq!(summary["files"]["last_checkpoint"], out.join("checkpoints/step-00000004").display().to_string());
    assert_eq!(summary["files"]["curves"], out.join("curves.png").display().to_string());

    // train.log_every = 2: steps 2 and 4 only.
    let again = tempfile::tempdir().unwrap();
    let (code, _, stderr) = train_logged(again.path(), &cfg, &["--set", "train.log_every=2"]);
    assert_eq!(code, Some(0), "{stderr}");
    let steps: Vec<&str> = stderr.lines().filter(|l| l.contains("/4 epoch")).collect();
    assert!(steps.len() == 2 && steps[0].contains("step 2/4") && steps[1].contains("step 4/4"), "{stderr}");
}

/// `train.micro_batch_tokens` packs the answers into rows of the budget: the run logs its first batch's
/// padding and trains as the padded run does (the same losses and token counts, within f32 rounding).
#[test]
fn packed_micro_batches_train_as_padded_ones_and_log_the_padding() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (code, _, padded_log) = train_logged(a.path(), &small_config(a.path()), &[]);
    assert_eq!(code, Some(0), "{padded_log}");
    let packed = ["--set", "train.micro_batch_tokens=400"];
    let (code, _, packed_log) = train_logged(b.path(), &small_config(b.path()), &packed);
    assert_eq!(code, Some(0), "{packed_log}");
    let first = |log: &str| log.lines().find(|l| l.contains("first batch: ")).unwrap_or_default().to_string();
    let (padded_line, packed_line) = (first(&padded_log), first(&packed_log));
    let padding = |line: &str, of: &str| -> f64 {
        let rest = line.split(&format!("({of}), ")).nth(1).unwrap_or_else(|| panic!("no {of}: {line}"));
        rest.split('%').next().unwrap().parse().unwrap()
    };
    assert!(padding(&padded_line, "micro_batch_size = 3") > 0.0, "{padded_line}");
    assert_eq!(padding(&packed_line, "micro_batch_tokens = 400"), 0.0, "{packed_line}");
    let metrics = |d: &Path| common::read_jsonl(&d.join("out/metrics.jsonl"));
    let (ma, mb) = (metrics(a.path()), metrics(b.path()));
    assert_eq!(ma.len(), 4);
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(x["num_tokens"], y["num_tokens"]);
        for k in ["loss", "kl", "grad_norm", "entropy"] {
            let (p, q) = (x[k].as_f64().unwrap(), y[k].as_f64().unwrap());
            assert!((p - q).abs() <= 1e-4 * p.abs().max(1e-3), "step {}: {k} {p} padded, {q} packed", x["step"]);
        }
    }
}

#[test]
fn quiet_prints_errors_only_and_still_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let (code, stdout, stderr) = train_logged(dir.path(), &cfg, &["-q", "--set", "train.max_steps=1"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stderr, "", "-q logs nothing but errors");
    assert!(stdout.contains("run complete: 1 of 1 steps"), "{stdout}");
}

#[test]
fn resume_auto_says_what_it_does_and_a_complete_run_is_left_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let out = dir.path().join("out");
    let (code, _, stderr) = train_logged(dir.path(), &cfg, &["--resume", "auto", "--set", "train.max_steps=2"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("--resume auto: no checkpoint") && stderr.contains("starting a new run"), "{stderr}");
    let (code, _, stderr) = train_logged(dir.path(), &cfg, &["--resume", "auto", "--set", "train.max_steps=3"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("resuming from") && stderr.contains("step-00000002 at step 2"), "{stderr}");
    // The run is complete at 3 steps: a resume says so, exits 0 and writes nothing.
    let listing = |d: &Path| -> Vec<(String, std::time::SystemTime)> {
        // The lock file is opened (and names its holder) by any start.
        let files = walk(d).into_iter().filter(|p| !p.ends_with(".lock"));
        let mut v: Vec<_> = files.map(|p| (p.display().to_string(), modified(&p))).collect();
        v.sort();
        v
    };
    let before = listing(&out);
    let (code, stdout, stderr) = train_logged(dir.path(), &cfg, &["--resume", "auto", "--set", "train.max_steps=3"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("already complete at step 3") && stdout.contains("nothing to do"), "{stdout}");
    assert_eq!(listing(&out), before, "a complete run's folder was written to");
}

fn modified(p: &Path) -> std::time::SystemTime {
    std::fs::metadata(p).unwrap().modified().unwrap()
}

/// Every file and folder under `dir`, recursively.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut all = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            all.extend(walk(&p));
        }
        all.push(p);
    }
    all
}

#[test]
fn a_stopped_run_writes_its_summary() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let out = dir.path().join("out");
    let child = spawn_with_stdout(dir.path(), &cfg, LONG);
    wait_for_steps(&out.join("metrics.jsonl"), 1);
    signal(&child, "-TERM");
    let output = child.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(STOPPED));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("run stopped: ") && stdout.contains("continue with --resume auto"), "{stdout}");
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "stopped");
    let ck = grpo::train::latest_checkpoint(&out).unwrap();
    assert_eq!(summary["files"]["last_checkpoint"], ck.display().to_string());
    assert_eq!(summary["steps"].as_u64().unwrap(), common::read_jsonl(&out.join("metrics.jsonl")).len() as u64);
}

/// Like `spawn`, with stdout captured too.
fn spawn_with_stdout(dir: &Path, config: &Path, extra: &[&str]) -> std::process::Child {
    let mut c = train_command(dir, config, extra);
    c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap()
}

#[test]
fn every_file_of_a_run_follows_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    for (umask, file_mode, dir_mode) in [("022", 0o644, 0o755), ("027", 0o640, 0o750)] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = small_config(dir.path());
        let script = format!("umask {umask} && exec \"$0\" \"$@\"");
        let status = std::process::Command::new("sh")
            .current_dir(common::root())
            .env("GRPO_CACHE_DIR", "off")
            .args(["-c", &script])
            .arg(assert_cmd::cargo::cargo_bin("grpo"))
            .args(["-q", "train", "--config"])
            .arg(&cfg)
            .arg("--set")
            .arg(format!("train.output_dir=\"{}\"", dir.path().join("out").display()))
            .arg("--set")
            .arg(format!("model.path=\"{}\"", dir.path().join("model").display()))
            .args(["--set", "train.max_steps=2", "--set", "validation.limit=1", "--set", "validation.max_new_tokens=2"])
            .args(["--set", "validation.bench=\"aime24\""])
            .status()
            .unwrap();
        assert!(status.success());
        let out = dir.path().join("out");
        for f in ["curves.png", "summary.json", "metrics.jsonl", "best/model.safetensors", "config.toml"] {
            assert!(out.join(f).exists(), "{f} was not written");
        }
        for p in walk(&out).into_iter().chain(walk(&dir.path().join("model"))) {
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            let want = if p.is_dir() { dir_mode } else { file_mode };
            assert_eq!(mode, want, "umask {umask}: {} is {mode:o}", p.display());
        }
    }
}

#[test]
fn messages_name_their_cause_once() {
    let a = common::grpo().current_dir(common::root()).args(["train", "--config", "configs/nope.toml"]).assert();
    let err = stderr_of(&a.failure());
    assert!(err.contains("cannot read configs/nope.toml"), "{err}");
    assert_eq!(err.matches("os error 2").count(), 1, "{err}");
    let a = common::grpo()
        .current_dir(common::root())
        .args(["train", "--check", "--config", "configs/smoke.toml", "--set", "train.batch_questions=-2"])
        .assert();
    let err = stderr_of(&a.failure());
    assert!(err.contains("--set train.batch_questions=-2: ") && !err.contains("smoke.toml"), "{err}");
}

/// The first `lines` lines of the fixture (its answers come grouped by question, 8 to a question), written to
/// `path`.
fn fixture_head(path: &Path, lines: usize) {
    let text = std::fs::read_to_string(common::root().join("data/trajectories/ot3_math_x8_dev.jsonl")).unwrap();
    let head: Vec<&str> = text.lines().take(lines).collect();
    std::fs::write(path, head.join("\n") + "\n").unwrap();
}

/// [`small_config`] on the input file `input` instead of the whole fixture.
fn small_config_on(dir: &Path, input: &Path) -> std::path::PathBuf {
    let p = small_config(dir);
    let fixture = common::root().join("data/trajectories/ot3_math_x8_dev.jsonl");
    let text =
        std::fs::read_to_string(&p).unwrap().replace(&fixture.display().to_string(), &input.display().to_string());
    std::fs::write(&p, text).unwrap();
    p
}

/// Run `cmd` to its end, failing the test when it takes longer than `limit` (killing it).
fn output_within(mut cmd: std::process::Command, limit: std::time::Duration) -> std::process::Output {
    let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let id = child.id();
    let (done, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output().unwrap()));
    match wait.recv_timeout(limit) {
        Ok(out) => out,
        Err(_) => {
            std::process::Command::new("kill").args(["-KILL", &id.to_string()]).status().unwrap();
            panic!("the run did not end within {limit:?}");
        }
    }
}

#[test]
fn a_resume_on_smaller_data_is_refused_within_seconds_or_restarts_the_epoch_when_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    fixture_head(&input, 80); // 10 questions: 5 steps per epoch
    let cfg = small_config_on(dir.path(), &input);
    train(dir.path(), &cfg, &["--set", "train.epochs=2"]).success();
    let out = dir.path().join("out");
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoints/step-00000004/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!((state["epoch"].as_u64(), state["batch_in_epoch"].as_u64()), (Some(0), Some(4)));
    assert!(state["data"].as_str().is_some_and(|d| !d.is_empty()), "no data fingerprint: {state}");
    // The inputs shrink to 6 questions (3 steps per epoch, fewer than the checkpoint's 4 batches).
    fixture_head(&input, 48);
    let more = ["--resume", "auto", "--set", "train.epochs=2", "--set", "train.max_steps=10"];
    let o = output_within(train_command(dir.path(), &cfg, &more), std::time::Duration::from_secs(60));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("other data") && err.contains("--allow-data-change") && err.contains("step-00000004"),
        "{err}"
    );
    // Allowed: epoch 0 restarts on the new data at step 4, and the run ends after its 2 epochs of 3 steps.
    let allowed: Vec<&str> = more.iter().copied().chain(["--allow-data-change"]).collect();
    let o = output_within(train_command(dir.path(), &cfg, &allowed), std::time::Duration::from_secs(120));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!((summary["steps"].as_u64(), summary["total_steps"].as_u64()), (Some(10), Some(10)));
    let ck = grpo::train::latest_checkpoint(&out).unwrap();
    assert!(ck.ends_with("step-00000010"), "{}", ck.display());
    // And it is complete: a later resume has nothing to do.
    let o = output_within(train_command(dir.path(), &cfg, &more), std::time::Duration::from_secs(60));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("already complete at step 10"), "{o:?}");
}

/// A checkpoint whose optimizer state comes from another checkpoint (its checksum record edited to match)
/// is refused at resume, naming the parameter, instead of replacing the model's weights with the state's.
#[test]
fn a_resume_refuses_master_weights_that_do_not_match_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    train(dir.path(), &cfg, &[]).success();
    let ck = dir.path().join("out/checkpoints");
    let (step2, step4) = (ck.join("step-00000002"), ck.join("step-00000004"));
    std::fs::copy(step2.join("optimizer.safetensors"), step4.join("optimizer.safetensors")).unwrap();
    let sums = |d: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("checksums.json")).unwrap()).unwrap()
    };
    let mut record = sums(&step4);
    record["files"]["optimizer.safetensors"] = sums(&step2)["files"]["optimizer.safetensors"].clone();
    std::fs::write(step4.join("checksums.json"), serde_json::to_vec(&record).unwrap()).unwrap();
    let err = stderr_of(&train(dir.path(), &cfg, &["--resume", "auto", "--set", "train.max_steps=6"]).failure());
    assert!(err.contains("come from different checkpoints") && err.contains("step-00000004"), "{err}");
}

/// A bundled config run from another directory: the missing relative path is named by its key, with
/// where relative paths are read from, before anything is written.
#[test]
fn a_config_run_from_elsewhere_names_the_missing_paths_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = common::grpo();
    cmd.current_dir(dir.path()).arg("train").arg("--config").arg(common::root().join("configs/smoke.toml"));
    let o = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("model.init_tiny.tokenizer = \"data/tokenizers/"), "{err}");
    assert!(err.contains("relative paths are read from the current directory"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written");
}

/// The prepared version a checkpoint names, with its reference log-prob cache, outlives a resume refused
/// because the data changed; undoing the change makes it current again, and the reference pass is not run.
#[test]
fn a_refused_resume_keeps_the_checkpoints_data_for_the_undone_edit() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    fixture_head(&input, 80);
    let modified = std::fs::metadata(&input).unwrap().modified().unwrap();
    let cfg = small_config_on(dir.path(), &input);
    train(dir.path(), &cfg, &["--set", "train.epochs=2"]).success();
    let prepared = dir.path().join("out/prepared");
    let versions = || -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(&prepared)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("v-"))
            .collect();
        v.sort();
        v
    };
    let first = versions();
    assert_eq!(first.len(), 1, "{first:?}");
    assert!(first[0].join("reference-logprobs.json").exists());
    fixture_head(&input, 48);
    let more = ["--resume", "auto", "--set", "train.epochs=2", "--set", "train.max_steps=10"];
    let o = output_within(train_command(dir.path(), &cfg, &more), std::time::Duration::from_secs(60));
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("other data"));
    assert!(versions().contains(&first[0]), "the checkpoint's version was removed: {:?}", versions());
    assert!(first[0].join("reference-logprobs.json").exists());
    // The edit undone (the same file, as it was): its version is current again, its cache read.
    fixture_head(&input, 80);
    std::fs::File::options().write(true).open(&input).unwrap().set_modified(modified).unwrap();
    let ok = train(dir.path(), &cfg, &more).success();
    let err = String::from_utf8_lossy(&ok.get_output().stderr).into_owned();
    assert!(err.contains("is up to date with the inputs again: made current"), "{err}");
    assert!(!err.contains("computing the reference log-probs"), "{err}");
    assert!(grpo::train::latest_checkpoint(&dir.path().join("out")).unwrap().ends_with("step-00000010"));
}

#[test]
fn a_resume_after_skipped_steps_continues_exactly() {
    // A huge all-positive bias makes every step whose question has only correct answers non-finite (skipped);
    // in the unshuffled order of the fixture, step 5 and step 13 are the first two applied updates. Adam's
    // bias correction counts applied updates: 1 at the step-6 checkpoint, 2 after step 13.
    let opts = [
        "--set",
        "objective.bias=3e38",
        "--set",
        "train.batch_questions=1",
        "--set",
        "data.shuffle=false",
        "--set",
        "train.max_steps=13",
        "--set",
        "train.save_every=6",
        "--set",
        "train.max_bad_steps=100",
    ];
    let a = tempfile::tempdir().unwrap();
    train(a.path(), &small_config(a.path()), &opts).success();
    let c = tempfile::tempdir().unwrap();
    let cfg_c = small_config(c.path());
    train(c.path(), &cfg_c, &opts).success();
    let out_c = c.path().join("out");
    let skipped: String = common::read_jsonl(&out_c.join("metrics.jsonl"))
        .iter()
        .map(|m| if m["skipped"] == true { 'S' } else { '.' })
        .collect();
    assert_eq!(skipped, "SSSS.SSSSSSS.", "the fixture's order changed: pick the steps again");
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(out_c.join("checkpoints/step-00000006/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!((state["optimizer_updates"].as_u64(), state["bad_in_row"].as_u64()), (Some(1), Some(1)), "{state}");
    // As if the run had died after its step-6 checkpoint.
    for s in ["step-00000012", "step-00000013"] {
        std::fs::remove_dir_all(out_c.join("checkpoints").join(s)).unwrap();
    }
    std::fs::write(out_c.join("checkpoints/latest"), "step-00000006").unwrap();
    let lines: Vec<String> =
        std::fs::read_to_string(out_c.join("metrics.jsonl")).unwrap().lines().map(String::from).collect();
    std::fs::write(out_c.join("metrics.jsonl"), lines[..6].join("\n") + "\n").unwrap();
    let resume: Vec<&str> = opts.iter().copied().chain(["--resume", "auto"]).collect();
    train(c.path(), &cfg_c, &resume).success();
    for f in ["model.safetensors", "optimizer.safetensors", "trainer_state.json"] {
        let fa = std::fs::read(a.path().join("out/checkpoints/step-00000013").join(f)).unwrap();
        let fc = std::fs::read(out_c.join("checkpoints/step-00000013").join(f)).unwrap();
        if f == "trainer_state.json" {
            let (mut sa, mut sc): (Value, Value) =
                (serde_json::from_slice(&fa).unwrap(), serde_json::from_slice(&fc).unwrap());
            sa["run_id"] = Value::Null;
            sc["run_id"] = Value::Null;
            assert_eq!(sa, sc);
        } else {
            assert!(fa == fc, "resumed {f} differs from the uninterrupted run's");
        }
    }
    let ma: Vec<Value> = common::read_jsonl(&a.path().join("out/metrics.jsonl")).iter().map(strip_timing).collect();
    let mc: Vec<Value> = common::read_jsonl(&out_c.join("metrics.jsonl")).iter().map(strip_timing).collect();
    assert_eq!(ma, mc);
}

/// `train.profile_steps`: exactly the listed steps are profiled, one line each in profile.jsonl.
#[test]
fn profile_steps_write_a_profile_of_exactly_those_steps() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    train(dir.path(), &cfg, &["--set", "train.profile_steps=[2, 3]", "--set", "train.save_every=0"]).success();
    let out = dir.path().join("out");
    let lines = common::read_jsonl(&out.join("profile.jsonl"));
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [2, 3]);
    for l in &lines {
        let paths: Vec<&str> = l["phases"].as_array().unwrap().iter().map(|p| p["path"].as_str().unwrap()).collect();
        for want in ["forward/attention", "backward", "reference", "optimizer/gradient norm and clip"] {
            assert!(paths.contains(&want), "{want} missing: {paths:?}");
        }
        let sum: f64 = l["phases"].as_array().unwrap().iter().map(|p| p["self_s"].as_f64().unwrap()).sum::<f64>()
            + l["other_s"].as_f64().unwrap();
        assert!((sum - l["step_s"].as_f64().unwrap()).abs() < 1e-6, "{l}");
    }
    let bad = train(dir.path(), &cfg, &["--set", "train.profile_steps=[0]", "--check"]).failure();
    let err = String::from_utf8_lossy(&bad.get_output().stderr).into_owned();
    assert!(err.contains("train.profile_steps"), "{err}");
}

#[test]
fn a_run_whose_stdout_reader_is_gone_still_ends_with_its_checkpoint_and_summary() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    let mut child = train_command(dir.path(), &cfg, &["--set", "train.max_steps=1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let out = dir.path().join("out");
    assert!(out.join("summary.json").exists() && grpo::train::latest_checkpoint(&out).is_some());
}

/// The non-finite steps in a row carry over a resume: `train.max_bad_steps` stops the resumed run at the
/// step where the uninterrupted run stops, not max_bad_steps steps after the resume.
#[test]
fn a_resume_goes_on_counting_the_non_finite_steps_in_a_row() {
    // As in a_resume_after_skipped_steps_continues_exactly: steps 1-4 and 6-12 are skipped, 5 and 13 applied.
    let opts = [
        "--set",
        "objective.bias=3e38",
        "--set",
        "train.batch_questions=1",
        "--set",
        "data.shuffle=false",
        "--set",
        "train.max_steps=13",
        "--set",
        "train.max_bad_steps=4",
    ];
    let stopped = "5 steps in a row had a non-finite loss or gradient (train.max_bad_steps = 4)";
    let a = tempfile::tempdir().unwrap();
    let err = stderr_of(&train(a.path(), &small_config(a.path()), &opts).failure());
    assert!(err.contains(stopped), "{err}");
    // The same run, stopped after step 8 (3 skipped steps in a row) and resumed.
    let c = tempfile::tempdir().unwrap();
    let cfg = small_config(c.path());
    let first: Vec<&str> = opts.iter().copied().chain(["--set", "train.max_steps=8"]).collect();
    train(c.path(), &cfg, &first).success();
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(c.path().join("out/checkpoints/step-00000008/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["bad_in_row"].as_u64(), Some(3), "{state}");
    let resume: Vec<&str> = opts.iter().copied().chain(["--resume", "auto"]).collect();
    let err = stderr_of(&train(c.path(), &cfg, &resume).failure());
    assert!(err.contains(stopped) && err.contains("step-00000008"), "{err}");
    let steps: Vec<u64> =
        common::read_jsonl(&c.path().join("out/metrics.jsonl")).iter().map(|m| m["step"].as_u64().unwrap()).collect();
    let steps_a: Vec<u64> =
        common::read_jsonl(&a.path().join("out/metrics.jsonl")).iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, steps_a, "the resumed run stopped at another step");
}

/// Two runs that share a prepared folder and differ only in train.seed, which chooses nothing there (no
/// question has more answers than the group size): each start re-uses the one prepared version.
#[test]
fn runs_that_differ_only_in_a_seed_that_chooses_nothing_share_one_prepared_version() {
    let dir = tempfile::tempdir().unwrap();
    let prepared = dir.path().join("prepared");
    let shared = format!("data.prepared_dir=\"{}\"", prepared.display());
    let mut fingerprints = Vec::new();
    for (run, seed) in [("a", 7), ("b", 8), ("c", 7)] {
        let d = dir.path().join(run);
        std::fs::create_dir_all(&d).unwrap();
        let cfg = small_config(&d);
        let seed = format!("train.seed={seed}");
        let opts = ["--set", &shared, "--set", "data.group_size=8", "--set", &seed, "--set", "train.max_steps=2"];
        let err = stderr_of(&train(&d, &cfg, &opts).success());
        assert_eq!(err.contains("is up to date"), run != "a", "{run}: {err}");
        let state: Value = serde_json::from_str(
            &std::fs::read_to_string(d.join("out/checkpoints/step-00000002/trainer_state.json")).unwrap(),
        )
        .unwrap();
        fingerprints.push(state["data"].as_str().unwrap().to_string());
    }
    let versions: Vec<_> = std::fs::read_dir(&prepared)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("v-"))
        .collect();
    assert_eq!(versions.len(), 1, "prepared again");
    assert!(fingerprints.iter().all(|f| *f == fingerprints[0]), "{fingerprints:?}");
}

#[test]
fn a_config_json_that_does_not_match_the_weights_fails_before_the_data_is_prepared() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(dir.path());
    // Llama weights (tied, no q/k norms) under a config.json that says qwen3.
    let model = dir.path().join("model");
    common::init_tiny("llama", "smollm2", &model);
    let path = model.join("config.json");
    let mut raw: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    raw["model_type"] = "qwen3".into();
    std::fs::write(&path, raw.to_string()).unwrap();
    let err = stderr_of(&train(dir.path(), &cfg, &[]).failure());
    assert!(err.contains(&model.display().to_string()) && err.contains("missing from the weights"), "{err}");
    assert!(err.contains("q_norm") && err.contains("model_type = \"llama\""), "{err}");
    assert!(!dir.path().join("out/prepared").exists(), "the data was prepared before the check");
}
