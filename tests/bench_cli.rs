//! `grpo bench` on the CPU: each measurement prints one JSON line with the keys that
//! scripts/gpu/report.py reads, and `train --device/--dtype` reach the config.

mod common;

use serde_json::Value;

fn bench(args: &[&str]) -> Value {
    let out = common::grpo().current_dir(common::root()).arg("-q").arg("bench").args(args).assert().success();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON line: {text}");
    serde_json::from_str(lines[0]).unwrap()
}

#[test]
fn train_step_logprob_and_generate_report_their_keys() {
    let r = bench(&[
        "train-step",
        "--shape",
        "scripts/gpu/shapes/tiny.json",
        "--answers",
        "2",
        "--seq-len",
        "24",
        "--prompt-len",
        "8",
        "--repeats",
        "1",
    ]);
    assert_eq!(
        (r["bench"].as_str(), r["impl"].as_str(), r["shape"].as_str()),
        (Some("train_step"), Some("grpo"), Some("tiny"))
    );
    for k in ["step_time_s", "tokens_per_s", "peak_mem_bytes", "device", "losses"] {
        assert!(r.get(k).is_some(), "{k} missing: {r}");
    }
    assert_eq!(r["tokens"], 48);

    let r = bench(&["logprob", "--tokens", "16", "--hidden", "8", "--vocab", "300", "--with-loss", "--repeats", "1"]);
    assert_eq!(r["impl"], "grpo_fused");
    assert!(r["fwd_time_s"].as_f64().unwrap() > 0.0 && r["fwd_bwd_time_s"].as_f64().unwrap() > 0.0);

    let r = bench(&[
        "generate",
        "--shape",
        "scripts/gpu/shapes/tiny.json",
        "--batch",
        "2",
        "--prompt-len",
        "4",
        "--new-tokens",
        "3",
        "--repeats",
        "1",
    ]);
    assert_eq!(r["bench"], "generate");
    assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_gpu_device_without_the_cuda_build_is_a_clear_error() {
    if cfg!(feature = "cuda") {
        return;
    }
    let out = common::grpo()
        .current_dir(common::root())
        .args(["bench", "logprob", "--tokens", "4", "--device", "cuda:0"])
        .assert()
        .failure();
    let err = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
    assert!(err.contains("--features cuda"), "{err}");
}

#[test]
fn train_device_and_dtype_flags_override_the_config() {
    let out = common::grpo()
        .current_dir(common::root())
        .args(["train", "--config", "configs/smoke.toml", "--device", "cuda:0", "--dtype", "bf16", "--check"])
        .assert()
        .success();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    assert!(text.contains("device = \"cuda:0\"") && text.contains("dtype = \"bf16\""), "{text}");
}
