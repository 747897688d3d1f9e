//! `scripts/gpu/next-run.sh --dry-run`: the next GPU run's script, every step of it, on the CPU with tiny
//! shapes (what a session with a lent GPU runs first, checked here so that its one call does not fail on a
//! flag or a file name).

mod common;

use std::time::Duration;

use serde_json::Value;

#[test]
fn the_next_gpu_run_dry_runs_on_the_cpu() {
    let out = tempfile::tempdir().unwrap();
    let run = assert_cmd::Command::new("bash")
        .current_dir(common::root())
        .arg("scripts/gpu/run.sh")
        .arg("--dry-run")
        .env("BIN", assert_cmd::cargo::cargo_bin("grpo"))
        .env("OUTDIR", out.path())
        .env("DATE", "2000-01-02")
        .timeout(Duration::from_secs(300))
        .assert()
        .success();
    let stdout = String::from_utf8_lossy(&run.get_output().stdout).into_owned();
    let name = out.path().join("gpu-2000-01-02-cpu");
    let lines: Vec<Value> = std::fs::read_to_string(name.with_extension("jsonl"))
        .unwrap_or_else(|e| panic!("no jsonl ({e}); the run printed:\n{stdout}"))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let bench = |b: &'static str| lines.iter().filter(move |l| l["bench"] == b);

    assert_eq!(bench("error").count(), 0, "no step failed:\n{stdout}");
    let selftest = bench("correctness").next().expect("the selftest line");
    assert_eq!(selftest["passed"], true);
    assert_eq!(bench("attention").count(), 12, "4 kernels at 2 lengths, and 2 at head dim 64 at 2 lengths");
    assert_eq!(bench("attention").filter(|a| a["head_dim"] == 64).count(), 4, "{stdout}");
    // One layer's projection GEMMs at the two shapes: 7 projections x 3 products each, with a rate.
    let gemms: Vec<&Value> = bench("gemm").collect();
    assert_eq!(gemms.len(), 2, "{stdout}");
    for g in &gemms {
        assert_eq!(g["gemms"].as_array().unwrap().len(), 21, "{g}");
        assert!(g["tflops"].as_f64().unwrap() > 0.0, "{g}");
    }
    // 0.5B shape at two lengths (default and wgmma), the 7B shape's settings, the short length and LoRA.
    let steps: Vec<&Value> = bench("train_step").collect();
    assert_eq!(steps.len(), 7, "{stdout}");
    assert_eq!(steps.iter().filter(|s| s["lora_r"] == 16).count(), 1, "{stdout}");
    for s in &steps {
        let predicted = s["predicted"].as_array().expect("predicted");
        assert!(predicted.iter().any(|p| p["step_time_s"].as_f64().unwrap() > 0.0), "{s}");
        assert!(!s["profile"]["phases"].as_array().expect("profile phases").is_empty(), "{s}");
    }
    assert!(steps.iter().any(|s| s["offload"] == true && s["reference"] == false && s["micro_batch"] == 1));
    assert_eq!(bench("seed7b").next().expect("the seed7b line")["passed"], true);
    // The host update against the composite ops, then the offloaded update from the run's device.
    let optimizer: Vec<&Value> = bench("optimizer").collect();
    assert_eq!(optimizer.len(), 2, "{stdout}");
    assert!(optimizer.iter().all(|o| o["same_bits"] == true), "{optimizer:?}");
    // Generation: the paged engine at three batch sizes, static batches beside, the 7B shape's long prompts.
    let gens: Vec<&Value> = bench("generate").collect();
    assert_eq!(gens.len(), 5, "{stdout}");
    assert_eq!(gens.iter().filter(|g| g["schedule"] == "static").count(), 1, "{stdout}");
    assert!(gens.iter().all(|g| !g["predicted_decode_step"].as_array().unwrap().is_empty()), "{stdout}");
    let skipped: Vec<String> = bench("skipped").map(|l| l["what"].as_str().unwrap().to_string()).collect();
    assert!(skipped.iter().any(|w| w == "generate torch 0.5b batch 32"), "{skipped:?}");
    assert!(skipped.iter().any(|w| w.contains("torch_ref.py")), "{skipped:?}");
    assert!(skipped.iter().any(|w| w.contains("nvidia-smi")), "{skipped:?}");

    let report = std::fs::read_to_string(name.with_extension("txt")).unwrap();
    assert!(report.contains("predicted vs measured train step"), "{report}");
    assert!(report.contains("correctness grpo selftest --device cpu: PASSED"), "{report}");
    assert!(report.contains("gemm tiny f32 64 rows:"), "{report}");
    assert!(report.contains("optimizer cpu f32 100000 params:"), "{report}");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(name.with_extension("json")).unwrap()).unwrap();
    assert_eq!(json["predictions"].as_array().unwrap().len(), steps.len());
    assert!(name.with_extension("log").exists());
}
