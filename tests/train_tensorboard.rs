//! `[train] report_to = ["tensorboard"]`: the smoke run's metrics as TensorBoard event files, read back
//! with grpo's reader and, when the Python package is installed, with TensorBoard's EventAccumulator.

mod common;

use std::path::{Path, PathBuf};

use grpo::train::tensorboard::read_scalars;

fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."))
        .collect();
    files.sort();
    files
}

#[test]
fn the_smoke_run_reports_every_steps_metrics_to_tensorboard() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let mut cmd = common::grpo();
    cmd.current_dir(common::root()).args(["train", "--config", "configs/smoke.toml"]);
    for set in [
        format!("train.output_dir=\"{}\"", out.display()),
        format!("model.path=\"{}\"", dir.path().join("model").display()),
        "train.report_to=[\"tensorboard\"]".into(),
        "train.max_steps=3".into(),
        // The smoke data truncates answers at 128 tokens: some leave the loss.
        "objective.mask_truncated=true".into(),
        "objective.dual_clip=true".into(),
    ] {
        cmd.arg("--set").arg(set);
    }
    cmd.assert().success();
    let metrics = common::read_jsonl(&out.join("metrics.jsonl"));
    assert_eq!(metrics.len(), 3);
    let files = event_files(&out.join("tensorboard"));
    assert_eq!(files.len(), 1, "{files:?}");
    let scalars = read_scalars(&files[0]).unwrap();
    let get = |step: i64, tag: &str| scalars.iter().find(|s| s.step == step && s.tag == tag).map(|s| s.value);
    for m in &metrics {
        let step = m["step"].as_i64().unwrap();
        for key in
            ["loss", "pg_loss", "kl", "learning_rate", "reward", "reward_std", "clip_ratio", "entropy", "grad_norm"]
        {
            let want = m[key].as_f64().unwrap() as f32;
            assert_eq!(get(step, &format!("train/{key}")), Some(want), "step {step} {key}");
        }
    }
    // The run validates at its end: the score is logged at the last step.
    let last = metrics.last().unwrap();
    let score = last["validation/score"].as_f64().expect("validation at the end") as f32;
    assert_eq!(get(last["step"].as_i64().unwrap(), "validation/score"), Some(score));
    let ok = std::process::Command::new("python3").args(["-c", "import tensorboard"]).status();
    if !ok.is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: the tensorboard Python package is not installed (pip install tensorboard)");
        return;
    }
    let script = r#"
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1])
acc.Reload()
for e in acc.Scalars("train/loss"):
    print(e.step, repr(e.value))
"#;
    let py = std::process::Command::new("python3").args(["-c", script]).arg(out.join("tensorboard")).output().unwrap();
    assert!(py.status.success(), "{}", String::from_utf8_lossy(&py.stderr));
    let read: Vec<(i64, f32)> = String::from_utf8(py.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (s, v) = l.split_once(' ').unwrap();
            (s.parse().unwrap(), v.parse().unwrap())
        })
        .collect();
    let want: Vec<(i64, f32)> =
        metrics.iter().map(|m| (m["step"].as_i64().unwrap(), m["loss"].as_f64().unwrap() as f32)).collect();
    assert_eq!(read, want, "TensorBoard's EventAccumulator reads every step's loss");
}
