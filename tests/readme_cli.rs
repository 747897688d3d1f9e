//! The README's CPU commands, as written, on a fresh copy of the repository (its tracked files, as a clone
//! has them): the quick start (the smoke run, its evaluation, the re-scoring, the curves), the LoRA run with
//! its evaluation and merge, and the memory plan of "What next" on the bundled model shape. `grpo` and
//! `cargo run --release --` are the binary under test; `cargo install` and `cargo test` (what CI runs
//! anyway) and the GPU blocks are left out. A new kind of command in a README block fails here until this
//! test runs it or says why not.

mod common;

use serde_json::Value;
use std::path::Path;

/// The README's ```sh blocks, each as its lines.
fn sh_blocks(readme: &str) -> Vec<Vec<String>> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in readme.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```sh") => current = Some(Vec::new()),
            (Some(_), "```") => blocks.push(current.take().unwrap()),
            (Some(b), l) => b.push(l.to_string()),
            (None, _) => {}
        }
    }
    blocks
}

/// The commands this test runs of a block's lines: comments and blank lines dropped, `cargo run --release
/// --` as `grpo`; `None` for a block for a GPU machine. Panics on a command it does not know.
fn cpu_commands(block: &[String]) -> Option<Vec<String>> {
    if block.iter().any(|l| l.contains("cuda")) {
        return None;
    }
    let mut out = Vec::new();
    for line in block.iter().map(|l| l.trim()).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        if line.starts_with("cargo install ") || line == "cargo test" {
            continue;
        }
        let line = line.replace("cargo run --release -- ", "grpo ");
        assert!(line.starts_with("grpo "), "a README command this test does not run: {line}");
        out.push(line);
    }
    Some(out)
}

/// A fresh copy of the repository's tracked files (what a clone holds, with the working tree's contents).
fn fresh_copy(to: &Path) {
    let root = common::root();
    let listed = std::process::Command::new("git").current_dir(&root).args(["ls-files", "-z"]).output();
    let listed = listed.expect("git, to list the repository's files");
    assert!(listed.status.success(), "git ls-files: {}", String::from_utf8_lossy(&listed.stderr));
    for name in listed.stdout.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let name = std::str::from_utf8(name).unwrap();
        let (from, dest) = (root.join(name), to.join(name));
        if from.is_file() {
            std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
            std::fs::copy(&from, &dest).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}

/// Run `commands` in `dir` with bash, `grpo` the binary under test; returns its stdout.
fn run(dir: &Path, commands: &[String]) -> String {
    let bin = assert_cmd::cargo::cargo_bin("grpo");
    let script = format!("set -euo pipefail\ngrpo() {{ \"$GRPO_BIN\" \"$@\"; }}\n{}\n", commands.join("\n"));
    let out = std::process::Command::new("bash")
        .current_dir(dir)
        .env("GRPO_BIN", &bin)
        .env("GRPO_CACHE_DIR", "off")
        .args(["-c", &script])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}:\n{stderr}", commands.join("\n"));
    String::from_utf8(out.stdout).unwrap()
}

/// The keys of every line of metrics.jsonl.
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

/// What the quick start's smoke run leaves: four steps of metrics with their loss terms, a validation
/// score, the curves, the resolved config, the best model and a loadable last checkpoint.
fn check_smoke_run(out: &Path) {
    let metrics = common::read_jsonl(&out.join("metrics.jsonl"));
    assert_eq!(metrics.len(), 4);
    for m in &metrics {
        for k in REQUIRED {
            assert!(m.get(*k).is_some_and(|v| !v.is_null()), "metrics line lacks {k}: {m}");
        }
        assert!(m["loss"].as_f64().unwrap().is_finite() && m["kl"].as_f64().unwrap().is_finite());
        // The device's peak of the step (and of its validation when it validated): null on the CPU.
        assert!(m.get("device_peak_bytes").is_some_and(Value::is_null), "{m}");
        let validated = m.get("validation/score").is_some();
        assert_eq!(m.get("validation/device_peak_bytes").is_some_and(Value::is_null), validated, "{m}");
    }
    assert!(metrics.iter().any(|m| m.get("validation/score").is_some()));
    assert!(out.join("config.toml").exists() && out.join("best/model.safetensors").exists());
    assert!(out.join("curves.png").exists() && out.join("summary.json").exists());
    let ck = grpo::train::latest_checkpoint(out).expect("a checkpoint");
    for f in ["config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors", "trainer_state.json"] {
        assert!(ck.join(f).exists(), "{f} missing from {}", ck.display());
    }
    grpo::model::load_decoder(&ck, candle_core::DType::F32, &candle_core::Device::Cpu, false).unwrap();
    assert!(out.join("prepared").exists(), "the prepared data, for the next run");
}

#[test]
fn the_readme_cpu_commands_run_as_written_on_a_fresh_copy() {
    let readme = std::fs::read_to_string(common::root().join("README.md")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let clone = dir.path().join("grpo");
    fresh_copy(&clone);
    let blocks: Vec<Vec<String>> = sh_blocks(&readme).iter().filter_map(|b| cpu_commands(b)).collect();
    let all: Vec<&String> = blocks.iter().flatten().collect();
    for wanted in ["grpo train --config configs/smoke.toml", "grpo eval ", "grpo score ", "grpo plot ", "grpo export "]
    {
        assert!(all.iter().any(|c| c.starts_with(wanted)), "no `{wanted}` in the README's blocks: {all:?}");
    }
    for block in blocks.iter().filter(|b| !b.is_empty()) {
        run(&clone, block);
    }
    check_smoke_run(&clone.join("runs/smoke"));
    let paths = ["runs/smoke-eval/generations.jsonl", "runs/smoke-eval/scored.jsonl", "runs/smoke-lora/best"];
    for p in paths.iter().chain(&["runs/smoke-lora-eval/generations.jsonl", "runs/smoke-lora/merged"]) {
        assert!(clone.join(p).exists(), "{p} is not there after the README's commands");
    }
    // "What next": the seed's 7B recipe planned on the bundled model shape, nothing downloaded.
    let plan = "grpo train --config configs/openthinker3.toml --plan --device-memory 80GiB";
    let shape = "--model-config configs/models/qwen2.5-7b-instruct.config.json";
    let prose: String = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(prose.contains(plan) && prose.contains(shape), "the README's What next names `{plan}` and `{shape}`");
    let printed = run(&clone, &[format!("{plan} {shape}")]);
    assert!(printed.contains("memory plan:") && printed.contains("fits"), "{printed}");
}

/// The blocks this test reads are the README's: a change of the README's fences shows here.
#[test]
fn the_readme_blocks_are_found() {
    let readme = std::fs::read_to_string(common::root().join("README.md")).unwrap();
    let blocks = sh_blocks(&readme);
    assert!(blocks.len() >= 5, "{blocks:?}");
    let gpu = blocks.iter().filter(|b| cpu_commands(b).is_none()).count();
    assert!(gpu >= 1 && gpu < blocks.len(), "{blocks:?}");
}
