//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn grpo() -> assert_cmd::Command {
    assert_cmd::Command::cargo_bin("grpo").expect("the grpo binary")
}

/// The SmolLM2-135M weights made by scripts/make-smollm2.sh, or None with a clear message.
pub fn smollm2() -> Option<PathBuf> {
    let dir = root().join("tests/fixtures/models/smollm2-135m");
    if dir.join("model.safetensors").exists() {
        Some(dir)
    } else {
        eprintln!(
            "SKIPPED: {} is absent; run scripts/make-smollm2.sh (needs ../shared and `pip install gguf numpy`)",
            dir.display()
        );
        None
    }
}

/// Make a tiny model with `grpo init-tiny` (same shape as the parity fixtures).
pub fn init_tiny(arch: &str, tokenizer: &str, out: &Path) {
    grpo()
        .args(["init-tiny", "--arch", arch, "--tokenizer"])
        .arg(root().join("data/tokenizers").join(tokenizer))
        .arg("--out")
        .arg(out)
        .args([
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--intermediate",
            "128",
            "--seed",
            "7",
        ])
        .assert()
        .success();
}

/// The rollout tests' fixture: a tiny model on the 64-token digits tokenizer at `model`, and in `dir` a
/// questions file (`questions.jsonl`) of 8 questions whose gold answer is always 7. Returns its path.
pub fn digits_model_and_questions(dir: &Path, model: &Path) -> PathBuf {
    grpo()
        .args(["init-tiny", "--arch", "llama", "--tokenizer"])
        .arg(root().join("tests/fixtures/tokenizers/digits"))
        .arg("--out")
        .arg(model)
        .args(["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64"])
        .args(["--seed", "1"])
        .assert()
        .success();
    let questions = dir.join("questions.jsonl");
    let words = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let lines: Vec<String> = (0..8)
        .map(|i| {
            format!(r#"{{"problem": "{} {} {}", "answer": "7"}}"#, words[i], words[(i + 3) % 8], words[(i + 5) % 8])
        })
        .collect();
    std::fs::write(&questions, lines.join("\n") + "\n").unwrap();
    questions
}

pub fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Like [`read_jsonl`], skipping lines that do not parse (a torn last line).
pub fn read_jsonl_lossy(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}
