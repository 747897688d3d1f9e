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

/// `grpo bench train-step --profile`: the table on stderr and the last step's phases in the record,
/// every phase the issue names present, their self times and "other" adding up to that step's time.
fn profiled_step(extra: &[&str]) -> (Value, String) {
    let mut args = vec![
        "-q",
        "bench",
        "train-step",
        "--shape",
        "scripts/gpu/shapes/tiny.json",
        "--answers",
        "4",
        "--micro-batch",
        "2",
        "--seq-len",
        "24",
        "--prompt-len",
        "8",
        "--repeats",
        "2",
        "--profile",
    ];
    args.extend_from_slice(extra);
    let out = common::grpo().current_dir(common::root()).args(&args).assert().success();
    let stdout = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    let stderr = String::from_utf8(out.get_output().stderr.clone()).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON line: {stdout}");
    (serde_json::from_str(lines[0]).unwrap(), stderr)
}

fn phase<'a>(profile: &'a Value, path: &str) -> &'a Value {
    let phases = profile["phases"].as_array().unwrap();
    phases.iter().find(|p| p["path"] == path).unwrap_or_else(|| panic!("no phase {path}: {profile}"))
}

fn check_profile(r: &Value, stderr: &str, paths: &[&str]) {
    let p = &r["profile"];
    assert_eq!(p["steps"], 1, "only the last timed step is profiled: {p}");
    for path in paths {
        let ph = phase(p, path);
        assert!(ph["calls"].as_f64().unwrap() >= 1.0 && ph["self_s"].as_f64().unwrap() >= 0.0, "{ph}");
        for counts in ["self_counts", "total_counts"] {
            for (k, v) in ph[counts].as_object().unwrap() {
                assert!(v.as_f64().unwrap() >= 0.0, "{path} {k}: {v}");
            }
        }
    }
    // The self times and "other" add up to the profiled step (the last timed run); the record's step time
    // is the other timed run's, without the profiler.
    let phases = p["phases"].as_array().unwrap();
    let sum: f64 = phases.iter().map(|ph| ph["self_s"].as_f64().unwrap()).sum::<f64>() + p["other_s"].as_f64().unwrap();
    let times: Vec<f64> = r["step_times"].as_array().unwrap().iter().map(|t| t.as_f64().unwrap()).collect();
    assert_eq!((r["profiled_step_s"].as_f64(), r["step_time_s"].as_f64()), (Some(times[1]), Some(times[0])), "{r}");
    assert_eq!(r["step_time_profiled"], false, "{r}");
    let measured = times[1];
    assert!((sum - measured).abs() <= 0.05 * measured, "phases add up to {sum} s, the step took {measured} s");
    // Every host sync of the step is in a phase or in "other".
    let syncs: f64 = phases.iter().map(|ph| ph["self_counts"]["host_syncs"].as_f64().unwrap()).sum::<f64>()
        + p["other"]["host_syncs"].as_f64().unwrap();
    assert_eq!(syncs, r["host_syncs_per_step"].as_f64().unwrap(), "{p}");
    // Two micro-batches of 24 tokens: the inputs' host-to-device copies and a layer's new buffers.
    assert!(phase(p, "inputs")["self_counts"]["h2d"].as_f64().unwrap() > 0.0, "{p}");
    assert!(phase(p, "forward/mlp")["self_counts"]["buffers"].as_f64().unwrap() > 0.0, "{p}");
    assert_eq!(phase(p, "forward/attention")["calls"], 4.0, "2 layers x 2 micro-batches: {p}");
    for row in ["forward", "  attention", "other (outside every phase)", "step (mean of 1)", "buffers: "] {
        assert!(stderr.lines().any(|l| l.starts_with(row)), "{row} missing from the table:\n{stderr}");
    }
}

#[test]
fn train_step_profile_covers_the_phases_and_adds_up_to_the_step() {
    let common = [
        "reference",
        "reference/embedding",
        "reference/log-prob head",
        "forward",
        "forward/embedding",
        "forward/rope",
        "forward/attention",
        "forward/attention/norm",
        "forward/attention/rope",
        "forward/mlp",
        "forward/mlp/norm",
        "forward/log-prob head",
        "forward/loss",
        "backward",
        "optimizer/gradient norm and clip",
        "optimizer/update",
    ];
    let (r, stderr) = profiled_step(&[]);
    let whole = [&common[..], &["backward/layers and head (one autograd pass)", "backward/embedding"]].concat();
    check_profile(&r, &stderr, &whole);
    // With layers recomputed, each layer's backward is its own: the MLP's, then the attention's.
    let (r, stderr) = profiled_step(&["--checkpoint-layers", "--offload"]);
    let layers = [
        "backward/log-prob head",
        "backward/recompute/attention",
        "backward/recompute/mlp",
        "backward/mlp",
        "backward/attention",
        "optimizer/update/gradients to host",
        "optimizer/update/update on the host",
        "optimizer/update/weights to device",
    ];
    check_profile(&r, &stderr, &[&common[..], &layers[..]].concat());
    let p = &r["profile"];
    let to_host = &phase(p, "optimizer/update/gradients to host")["self_counts"];
    let to_device = &phase(p, "optimizer/update/weights to device")["self_counts"];
    assert!(to_host["d2h_bytes"].as_f64().unwrap() > 0.0 && to_host["host_syncs"] == 0.0, "{p}");
    assert_eq!(to_device["h2d_bytes"], to_host["d2h_bytes"], "f32 weights back as gradients went: {p}");
    // Without --profile, no profile.
    let plain = bench(&[
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
    assert!(plain["profile"].is_null());
}

#[test]
fn pack_compares_padded_and_packed_micro_batches_on_the_same_answers() {
    let args = ["pack", "--questions", "6", "--group", "4", "--micro-batch", "1,4", "--budgets", "20000"];
    let r = bench(&args);
    assert_eq!((r["bench"].as_str(), r["answers"].as_u64()), (Some("pack"), Some(24)));
    assert_eq!(r, bench(&args), "the same seed draws the same lengths");
    let g = r["groupings"].as_array().unwrap();
    let names: Vec<&str> = g.iter().map(|g| g["batching"].as_str().unwrap()).collect();
    assert_eq!(names, ["micro_batch_size = 1", "micro_batch_size = 4", "micro_batch_tokens = 20000"]);
    let tokens = r["length_mean"].as_f64().unwrap() * 24.0;
    for x in g {
        assert!((x["tokens"].as_f64().unwrap() - tokens).abs() < 0.5, "{x}");
    }
    assert_eq!((g[0]["padding_fraction"].as_f64(), g[0]["micro_batches"].as_u64()), (Some(0.0), Some(24)));
    assert!(g[1]["padding_fraction"].as_f64().unwrap() > 0.05, "{}", g[1]);
    assert_eq!(g[2]["padding_fraction"].as_f64(), Some(0.0));
    let packed = g[2]["micro_batches"].as_u64().unwrap();
    assert!(packed < 24 && packed as f64 >= tokens / 20000.0, "{packed} micro-batches for {tokens} tokens");
    assert!(g[2]["max_slots"].as_u64().unwrap() <= 20000.max(r["length_max"].as_u64().unwrap()));
}

/// The kernels a GPU launches for one layer (the profile's new buffers, counted on the CPU: each a device
/// allocation and, copies aside, a launch) and the host-to-device copies of a step stay at or under what
/// this build makes, at the Qwen2.5-0.5B widths (one layer, f32, layers recomputed, two micro-batches): a
/// change that adds launches or copies to the hot path fails here. Per micro-batch: forward, the attention
/// block 15 (its RMSNorm one, rope two) and the MLP block 6, the same again in the recomputation; backward,
/// the MLP's 7 and the attention's 18 (10 and 23, and the first micro-batch's gradients cast into their f32
/// accumulators, 4 and 8, before each weight's gradient was added by its GEMM into an accumulator made
/// before the first micro-batch): the gradient accumulation makes no buffer at all; the inputs' and each
/// forward's copies.
#[test]
fn a_layer_launches_no_more_kernels_and_a_step_copies_no_more_than_counted() {
    let dir = tempfile::tempdir().unwrap();
    let raw = std::fs::read_to_string(common::root().join("scripts/gpu/shapes/qwen2.5-0.5b.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&raw).unwrap();
    cfg["num_hidden_layers"] = 1.into();
    cfg["vocab_size"] = 4096.into();
    let shape = dir.path().join("one-layer.json");
    std::fs::write(&shape, cfg.to_string()).unwrap();
    let shape = shape.display().to_string();
    let args = ["train-step", "--shape", &shape, "--answers", "2", "--seq-len", "64", "--prompt-len", "16"];
    let r = bench(&[&args[..], &["--warmup", "1", "--repeats", "1", "--profile", "--checkpoint-layers"]].concat());
    let p = &r["profile"];
    let count = |path: &str, what: &str| phase(p, path)["total_counts"][what].as_f64().unwrap();
    assert_eq!(phase(p, "backward/mlp")["calls"], 2.0, "two micro-batches: {p}");
    let at_most = [
        ("forward/attention", 2.0 * 15.0),
        ("forward/mlp", 2.0 * 6.0),
        ("backward/recompute/attention", 2.0 * 15.0),
        ("backward/recompute/mlp", 2.0 * 6.0),
        ("backward/mlp", 2.0 * 7.0),
        ("backward/attention", 2.0 * 18.0),
    ];
    for (path, most) in at_most {
        let n = count(path, "buffers");
        assert!(n > 0.0 && n <= most, "{path}: {n} new buffers, at most {most} counted");
    }
    for path in ["backward/mlp/gradient accumulation", "backward/attention/gradient accumulation"] {
        assert_eq!(phase(p, path)["calls"], 2.0, "{path}: {p}");
        assert_eq!(count(path, "buffers"), 0.0, "{path}: the gradients are added in place");
    }
    let copies: f64 = p["phases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|ph| ph["depth"] == 1)
        .map(|ph| ph["total_counts"]["h2d"].as_f64().unwrap())
        .sum();
    assert!((1.0..=28.0).contains(&copies), "{copies} host-to-device copies in the step, at most 2 x 14 counted");
}

/// `grpo bench gemm`: every projection's three products of one layer, each with its shape and a rate, and
/// their total rate beside the rates the performance model assumes.
#[test]
fn gemm_times_each_projection_product_of_a_layer() {
    let r = bench(&["gemm", "--shape", "scripts/gpu/shapes/tiny.json", "--tokens", "48", "--repeats", "1"]);
    let gemms = r["gemms"].as_array().unwrap();
    assert_eq!(gemms.len(), 21, "{r}");
    let down = gemms.iter().find(|g| g["name"] == "down weight gradient").expect("down weight gradient");
    // [out, N] x [N, in] for the down projection (in = intermediate, out = hidden).
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(common::root().join("scripts/gpu/shapes/tiny.json")).unwrap())
            .unwrap();
    assert_eq!((&down["m"], &down["k"], &down["n"]), (&cfg["hidden_size"], &48.into(), &cfg["intermediate_size"]));
    assert!(gemms.iter().all(|g| g["tflops"].as_f64().unwrap() > 0.0), "{r}");
    let flops: f64 =
        gemms.iter().map(|g| 2.0 * ["m", "k", "n"].iter().map(|k| g[*k].as_f64().unwrap()).product::<f64>()).sum();
    let total = r["tflops"].as_f64().unwrap() * r["seconds"].as_f64().unwrap() * 1e12;
    assert!((total / flops - 1.0).abs() < 1e-9, "{total} vs {flops}");
    assert_eq!(r["assumed"].as_array().unwrap().len(), 2);
}
