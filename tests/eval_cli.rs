//! `grpo eval` end to end: reports consistent with generations.jsonl, resume, and SmolLM2's greedy
//! MATH-500 answers against transformers'.

mod common;

use serde_json::Value;

fn eval(args: &[&str], model: &std::path::Path, out: &std::path::Path) -> assert_cmd::assert::Assert {
    common::grpo().arg("eval").args(args).arg("--model").arg(model).arg("--out").arg(out).assert()
}

fn mean_verdicts(gens: &[Value]) -> f64 {
    let v: Vec<bool> = gens
        .iter()
        .flat_map(|g| g["samples"].as_array().unwrap().iter().map(|s| s["correct"].as_bool().unwrap()))
        .collect();
    v.iter().filter(|&&b| b).count() as f64 / v.len() as f64
}

#[test]
fn aime25_on_a_tiny_model_reports_consistent_numbers_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    common::init_tiny("qwen3", "qwen3", &model);
    let out = dir.path().join("eval");
    let args = ["--bench", "aime25", "--n", "2", "--max-new-tokens", "16", "--batch-size", "16"];
    let a = eval(&args, &model, &out).success();
    let stdout = String::from_utf8_lossy(&a.get_output().stdout).to_string();
    assert!(stdout.contains("aime25") && stdout.contains("pass@2"), "{stdout}");
    // The budget is stated before generating.
    let stderr = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(stderr.contains("aime25: 30 problems x 2 samples x 16 max new tokens = at most 960 tokens"), "{stderr}");
    let gens = common::read_jsonl(&out.join("generations.jsonl"));
    assert_eq!(gens.len(), 30);
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let r = &report["benchmarks"]["aime25"];
    assert_eq!(r["n_problems"], 30);
    assert!((r["avg_at_n"].as_f64().unwrap() - mean_verdicts(&gens)).abs() < 1e-12);
    for g in &gens {
        let samples = g["samples"].as_array().unwrap();
        assert_eq!(samples.len(), 2);
        for s in samples {
            assert!(s["tokens"].as_u64().unwrap() <= 16);
            assert!(["stop", "length"].contains(&s["finish"].as_str().unwrap()));
        }
    }
    let sample_tokens: u64 =
        gens.iter().flat_map(|g| g["samples"].as_array().unwrap().iter().map(|s| s["tokens"].as_u64().unwrap())).sum();
    assert_eq!(r["generated_tokens"].as_u64().unwrap(), sample_tokens, "tokens/s must count generated tokens only");
    let keys: Vec<&String> = r["pass_at_k"].as_object().unwrap().keys().collect();
    assert_eq!(keys, vec!["1", "2"]);

    // `grpo score` reads eval's own generations.jsonl and agrees with its report.
    let summary = dir.path().join("score.json");
    common::grpo()
        .args(["score", "--k", "1,2", "--input"])
        .arg(out.join("generations.jsonl"))
        .arg("--output")
        .arg(dir.path().join("scored.jsonl"))
        .arg("--summary")
        .arg(&summary)
        .assert()
        .success();
    let scored: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!((scored["n_items"].as_u64(), scored["n_responses"].as_u64()), (Some(30), Some(60)));
    assert!((scored["avg_at_n"].as_f64().unwrap() - r["avg_at_n"].as_f64().unwrap()).abs() < 1e-12, "{scored}");
    assert_eq!(scored["pass_at_k"], r["pass_at_k"]);

    // Interrupted after 10 problems (and a torn last line): --resume generates only the rest.
    let text = std::fs::read_to_string(out.join("generations.jsonl")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    std::fs::write(out.join("generations.jsonl"), lines[..10].join("\n") + "\n" + &lines[10][..20]).unwrap();
    eval(&[&args[..], &["--resume"]].concat(), &model, &out).success();
    let resumed = common::read_jsonl_lossy(&out.join("generations.jsonl"));
    assert_eq!(resumed.len(), 30);
    assert_eq!(&resumed[..10], &gens[..10]);
    // Greedy decoding: the regenerated problems are the same as the first time.
    let mut ids: Vec<&str> = resumed.iter().map(|g| g["id"].as_str().unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 30);
}

#[test]
fn registered_benchmarks_are_listed() {
    let a = common::grpo().args(["eval", "--list"]).assert().success();
    let s = String::from_utf8_lossy(&a.get_output().stdout).to_string();
    for b in ["aime25", "aime25_1", "aime25_2", "aime24", "amc23", "math500"] {
        assert!(s.contains(b));
    }
}

#[test]
fn aime25_parts_one_and_two_are_reported_apart() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    common::init_tiny("qwen3", "qwen3", &model);
    let out = dir.path().join("eval");
    let args = ["--bench", "aime25_1,aime25_2", "--n", "1", "--temperature", "0", "--max-new-tokens", "2"];
    let a = eval(&args, &model, &out).success();
    let stdout = String::from_utf8_lossy(&a.get_output().stdout).to_string();
    assert!(stdout.contains("aime25_1") && stdout.contains("aime25_2"), "{stdout}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    for part in ["aime25_1", "aime25_2"] {
        assert_eq!(report["benchmarks"][part]["n_problems"], 15, "{report}");
    }
    assert_eq!(common::read_jsonl(&out.join("generations.jsonl")).len(), 30);
}

#[test]
fn smollm2_greedy_math500_matches_transformers() {
    let Some(model) = common::smollm2() else { return };
    let fx: Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/parity/smollm2-math500.json")).unwrap(),
    )
    .unwrap();
    let problems = fx["problems"].as_array().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Both schedules: continuous batching (the default) and static batches.
    for schedule in ["continuous", "static"] {
        let out = dir.path().join(schedule);
        let max_new = fx["max_new_tokens"].to_string();
        let limit = problems.len().to_string();
        eval(
            &[
                "--bench",
                "math500",
                "--limit",
                &limit,
                "--temperature",
                "0",
                "--max-new-tokens",
                &max_new,
                "--fallbacks",
                "--batch-size",
                "4",
                "--schedule",
                schedule,
            ],
            &model,
            &out,
        )
        .success();
        let gens = common::read_jsonl(&out.join("generations.jsonl"));
        let opts = grpo::reward::ExtractOptions { fallbacks: true };
        for (g, want) in gens.iter().zip(problems) {
            // In problem order, whatever order they finished in.
            assert_eq!(g["id"], want["id"], "{schedule}");
            let s = &g["samples"][0];
            assert_eq!(s["text"], want["text"], "{schedule}: problem {}", want["id"]);
            // Same text, so the same answer and verdict as the reward module gives on transformers' output.
            let pred = grpo::reward::extract_answer(want["text"].as_str().unwrap(), &opts);
            assert_eq!(s["pred"].as_str(), pred.as_deref());
            let ok = pred.as_deref().is_some_and(|p| grpo::reward::is_equivalent(want["answer"].as_str().unwrap(), p));
            assert_eq!(s["correct"].as_bool().unwrap(), ok);
        }
    }
}

#[test]
fn out_of_range_options_are_rejected_before_loading_anything() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-model");
    for (flag, value, needle) in [
        ("--n", "0", "--n = 0"),
        ("--batch-size", "0", "--batch-size = 0"),
        ("--temperature", "-1", "--temperature = -1"),
        ("--top-p", "0", "--top-p = 0"),
        ("--top-p", "NaN", "--top-p = NaN"),
    ] {
        let a = eval(&["--bench", "aime24", &format!("{flag}={value}")], &missing, &dir.path().join("out")).failure();
        let stderr = String::from_utf8_lossy(&a.get_output().stderr).to_string();
        assert!(stderr.contains(needle), "{flag} {value}: {stderr}");
    }
    assert!(!dir.path().join("out").exists());
}

#[test]
fn a_second_eval_into_the_same_folder_is_refused_unless_resumed_or_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    common::init_tiny("qwen3", "qwen3", &model);
    let args = ["--bench", "aime25", "--max-new-tokens", "4"];
    // The default --out, runs/eval, in the working folder.
    let run = |extra: &[&str]| {
        common::grpo().current_dir(dir.path()).arg("eval").args(args).arg("--model").arg(&model).args(extra).assert()
    };
    let first = run(&["--limit", "2", "--batch-size", "1"]).success();
    // The budget is stated, then what it costs at the speed of the first answers.
    let stderr = String::from_utf8_lossy(&first.get_output().stderr).to_string();
    assert!(stderr.contains("aime25: 1 of 2 problems in"), "{stderr}");
    assert!(stderr.contains("tokens left of the budget take at most"), "{stderr}");
    let gens = dir.path().join("runs/eval/generations.jsonl");
    let before = std::fs::read_to_string(&gens).unwrap();
    assert_eq!(before.lines().count(), 2);
    let second = run(&["--limit", "1"]).failure();
    let err = String::from_utf8_lossy(&second.get_output().stderr).to_string();
    assert!(err.contains("runs/eval holds the results of an earlier run (generations.jsonl, report.json)"), "{err}");
    assert!(err.contains("--resume") && err.contains("--overwrite"), "{err}");
    assert_eq!(std::fs::read_to_string(&gens).unwrap(), before, "the earlier results were touched");
    run(&["--limit", "1", "--overwrite"]).success();
    assert_eq!(std::fs::read_to_string(&gens).unwrap().lines().count(), 1);
    run(&["--limit", "2", "--resume"]).success();
    assert_eq!(std::fs::read_to_string(&gens).unwrap().lines().count(), 2);
}

#[test]
fn an_out_held_by_another_process_is_refused_and_out_must_be_a_folder() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    common::init_tiny("qwen3", "qwen3", &model);
    let out = dir.path().join("eval");
    std::fs::create_dir_all(&out).unwrap();
    // Another process's lock, as a running `grpo eval` (or `grpo train`) holds it.
    let held = std::fs::File::create(out.join(".lock")).unwrap();
    held.lock().unwrap();
    let args = ["--bench", "aime25", "--limit", "1", "--max-new-tokens", "2"];
    let a = eval(&args, &model, &out).failure();
    let err = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(err.contains("is in use by another grpo process") && err.contains("--out"), "{err}");
    assert!(!out.join("generations.jsonl").exists(), "the refused run wrote into OUT");
    drop(held);
    eval(&args, &model, &out).success();
    // --out naming a regular file: said so, not `File exists`.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let a = eval(&args, &model, &file).failure();
    let err = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(err.contains("is not a folder") && !err.contains("os error 17"), "{err}");
}

#[test]
fn the_cost_estimate_counts_every_problem_of_a_finished_batch() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    common::init_tiny("qwen3", "qwen3", &model);
    let stderr = |batch: &str| {
        let args = ["--bench", "aime25", "--limit", "8", "--n", "2", "--max-new-tokens", "4", "--batch-size", batch];
        let out = dir.path().join(format!("eval-{batch}"));
        let a = eval(&args, &model, &out).success();
        String::from_utf8_lossy(&a.get_output().stderr).to_string()
    };
    // Two problems (of 2 samples) per batch: the estimate comes as the second batch starts, with both of the
    // first batch's problems done.
    let e = stderr("4");
    assert!(e.contains("aime25: 2 of 8 problems in") && !e.contains("aime25: 1 of 8 problems in"), "{e}");
    // Every problem in one batch: nothing is left to estimate once the first is done, so nothing is said
    // (it said "1 of 8 problems ... the 0 tokens left of the budget take at most 0s").
    let e = stderr("16");
    assert!(!e.contains("of 8 problems in") && !e.contains("tokens left of the budget"), "{e}");
}
