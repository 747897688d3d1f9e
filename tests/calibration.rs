//! The performance model against what it was calibrated on (src/cost/calibration.rs): the device and build
//! files are what scripts/calibrate.py writes from the committed results; every committed H100 train step
//! (benches/results/gpu-*-h100.jsonl) predicted within 25% by `grpo bench train-step --predict-only` with
//! the same settings; and the tensors candle makes in a step, counted by `grpo bench train-step` on the CPU,
//! as the model counts them (so a change to the step's ops that the model does not know of fails here).

mod common;

use serde_json::Value;

/// The `grpo bench train-step` arguments of a measured line of `gpu-<tag>-h100.jsonl` (scripts/calibrate.py's
/// `bench_args`).
fn bench_args(r: &Value, tag: &str) -> Vec<String> {
    let root = common::root();
    let name = r["shape"].as_str().unwrap();
    let shape =
        [root.join(format!("scripts/gpu/shapes/{name}.json")), root.join(format!("configs/models/{name}.json"))]
            .into_iter()
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("no shape file for {name}"));
    let mut args: Vec<String> = vec!["--shape".into(), shape.display().to_string()];
    for (flag, key) in [
        ("--answers", "answers"),
        ("--seq-len", "seq_len"),
        ("--prompt-len", "prompt_len"),
        ("--micro-batch", "micro_batch"),
        ("--logprob-chunk-mb", "logprob_chunk_mb"),
    ] {
        args.extend([flag.to_string(), r[key].to_string()]);
    }
    args.extend(["--dtype".into(), r["dtype"].as_str().unwrap().into()]);
    args.extend(["--attention".into(), r["attention"].as_str().unwrap().into()]);
    for (flag, key) in [
        ("--checkpoint-layers", "checkpoint_layers"),
        ("--keep-attention", "keep_attention"),
        ("--atomic-dq", "atomic_dq"),
        ("--offload", "offload"),
    ] {
        if r[key].as_bool() == Some(true) {
            args.push(flag.into());
        }
    }
    if r["reference"].as_bool() == Some(false) {
        args.push("--no-reference".into());
    }
    if r["fused_ops"].as_bool() == Some(false) {
        args.push("--composite-ops".into());
    }
    // Each step is predicted as its build ran it (its tensor ops, attention kernels, offloaded update).
    args.extend(["--measured-build".into(), build_file(tag).display().to_string()]);
    args
}

/// The file of benches/results/builds/ whose `tags` hold `tag` (scripts/calibrate.py's `build_file`).
fn build_file(tag: &str) -> std::path::PathBuf {
    let dir = common::root().join("benches/results/builds");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files
        .into_iter()
        .find(|f| {
            let build: toml::Table = toml::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
            build["tags"].as_array().unwrap().iter().any(|t| t.as_str() == Some(tag))
        })
        .unwrap_or_else(|| panic!("no file of {} has the tag {tag:?}", dir.display()))
}

fn bench(args: &[String]) -> Value {
    let out = common::grpo().args(["bench", "train-step"]).args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn every_committed_h100_train_step_is_predicted_within_25_percent() {
    let dir = common::root().join("benches/results");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let Some(tag) = name.strip_prefix("gpu-").and_then(|n| n.strip_suffix("-h100.jsonl")) else { continue };
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let Ok(r) = serde_json::from_str::<Value>(line) else { continue };
            if r["bench"] != "train_step" || r["impl"] != "grpo" {
                continue;
            }
            let mut args = bench_args(&r, tag);
            args.push("--predict-only".into());
            let predicted = bench(&args);
            let h100 = predicted["predicted"].as_array().unwrap().iter().find(|p| p["gpu"] == "H100 SXM").unwrap();
            assert_eq!(h100["calibrated_on"], "NVIDIA H100 80GB HBM3, 2026-11-26 and 2026-11-27");
            let (p, m) = (h100["step_time_s"].as_f64().unwrap(), r["step_time_s"].as_f64().unwrap());
            assert!((p / m - 1.0).abs() <= 0.25, "{name}: predicted {p} s, measured {m} s: {args:?}");
            checked += 1;
        }
    }
    assert!(checked >= 4, "{checked} steps checked");
}

/// configs/devices/*.toml and benches/results/builds/*.toml are what `scripts/calibrate.py` writes from the
/// committed GPU results with this binary's predictions (`--check` writes nothing and fails on a
/// difference, or when the projection of this build's warpgroup rates fails its back-test).
#[test]
fn the_device_and_build_files_are_what_calibrate_writes() {
    let bin = assert_cmd::cargo::cargo_bin("grpo");
    let run = std::process::Command::new("python3")
        .arg(common::root().join("scripts/calibrate.py"))
        .args(["--check", "--grpo"])
        .arg(&bin)
        .output();
    let out = match run {
        Ok(out) => out,
        Err(e) if std::env::var_os("CI").is_none() => return eprintln!("SKIPPED: python3 for calibrate.py: {e}"),
        Err(e) => panic!("python3 for scripts/calibrate.py: {e}"),
    };
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "scripts/calibrate.py --check:\n{text}");
    assert!(text.contains("leave-one-out"), "{text}");
}

/// A small Qwen2-style shape with `layers` layers (the 0.5B's widths, a 4,096-token vocabulary).
fn small_shape(dir: &std::path::Path, layers: usize) -> String {
    let raw = std::fs::read_to_string(common::root().join("scripts/gpu/shapes/qwen2.5-0.5b.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&raw).unwrap();
    cfg["num_hidden_layers"] = layers.into();
    cfg["vocab_size"] = 4096.into();
    let path = dir.join(format!("small-{layers}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    path.display().to_string()
}

#[test]
fn the_tensor_ops_of_a_step_are_the_models() {
    let dir = tempfile::tempdir().unwrap();
    for (layers, answers, extra) in
        [(3, 3, vec![]), (2, 2, vec!["--checkpoint-layers"]), (2, 2, vec!["--no-reference"])]
    {
        let mut args: Vec<String> = ["--shape", &small_shape(dir.path(), layers), "--answers", &answers.to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(["--seq-len", "64", "--prompt-len", "16", "--warmup", "1", "--repeats", "1"].map(String::from));
        args.extend(extra.iter().map(|s| s.to_string()));
        let measured = bench(&args)["tensor_ops_per_step"].as_f64().unwrap();
        args.push("--predict-only".into());
        let predicted = bench(&args)["predicted"][0]["tensor_ops"].as_f64().unwrap();
        assert!((predicted / measured - 1.0).abs() < 0.05, "{args:?}: model {predicted}, counted {measured}");
    }
}

/// The buffers (new tensors but views) one layer makes in a profiled CPU step of `bench train-step`: its
/// forward without a graph (the reference's) and its share of the backward's autograd pass.
fn layer_buffers(dir: &std::path::Path) -> (f64, f64) {
    let step = |layers: usize| {
        let args: Vec<String> = ["--shape", &small_shape(dir, layers), "--answers", "1", "--seq-len", "64"]
            .into_iter()
            .chain(["--prompt-len", "16", "--warmup", "0", "--repeats", "1", "--profile"])
            .map(String::from)
            .collect();
        let r = bench(&args);
        let phases = r["profile"]["phases"].as_array().unwrap().clone();
        let buffers = |path: &str| {
            let p = phases.iter().find(|p| p["path"] == path).unwrap_or_else(|| panic!("no phase {path}"));
            p["total_counts"]["buffers"].as_f64().unwrap()
        };
        let forward = buffers("reference/attention") + buffers("reference/mlp");
        (forward, buffers("backward/layers and head (one autograd pass)"))
    };
    let ((f2, b2), (f4, b4)) = (step(2), step(4));
    ((f4 - f2) / 2.0, (b4 - b2) / 2.0)
}

/// The performance model counts a layer's element-wise bytes as its named ops' (norms, rope, bias adds,
/// head transposes, residual adds, SwiGLU: src/cost/time.rs's `layer_dense`), the rest of candle's tensor
/// ops being views. Counted on the CPU, a Qwen2 layer's forward makes 21 buffers: 7 GEMMs', the attention's
/// and 13 element-wise (the model names 15 launches); its backward 33: 14 GEMMs', the attention's three
/// gradients and 16 element-wise (the model names 30). More would be passes the model does not count.
#[test]
fn a_layer_makes_no_more_buffers_than_the_model_counts() {
    let dir = tempfile::tempdir().unwrap();
    let (forward, backward) = layer_buffers(dir.path());
    assert!(forward <= 21.0, "a layer's forward makes {forward} buffers: count the new ones in the model");
    assert!(backward <= 33.0, "a layer's backward makes {backward} buffers: count the new ones in the model");
    assert!(forward >= 7.0 + 1.0 && backward >= 14.0 + 3.0, "{forward} {backward}: the profile lost the GEMMs");
}
