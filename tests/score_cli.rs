//! `grpo score` end to end on real files: the Qwen2.5-Math dev trajectories (recorded verdicts),
//! malformed lines, --no-gold, --strict and adversarial responses.

use assert_cmd::Command;
use grpo::reward::{is_equivalent, majority_vote, pass_at_k};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reward").join(name)
}

fn read_jsonl(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn grpo() -> Command {
    let mut c = Command::cargo_bin("grpo").unwrap();
    c.env("GRPO_CACHE_DIR", "off"); // no reference log-probs shared with other tests
    c
}

/// The dev file in the documented input shape {"answer", "responses", ...}.
fn dev_as_answer_responses(dir: &Path) -> (PathBuf, Vec<Value>) {
    let rows = read_jsonl(&fixture("math_x8_dev.jsonl"));
    let path = dir.join("dev.jsonl");
    let text: String = rows
        .iter()
        .map(|r| json!({"id": r["idx"], "answer": r["gt"], "responses": r["responses"]}).to_string() + "\n")
        .collect();
    std::fs::write(&path, text).unwrap();
    (path, rows)
}

#[test]
fn agrees_with_recorded_scores_on_dev_trajectories() {
    let dir = tempfile::tempdir().unwrap();
    let (input, rows) = dev_as_answer_responses(dir.path());
    let out = dir.path().join("scored.jsonl");
    let summary = dir.path().join("summary.json");
    grpo()
        .args(["score", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&out)
        .arg("--summary")
        .arg(&summary)
        .args(["--k", "1,4,8"])
        .assert()
        .success();
    let scored = read_jsonl(&out);
    assert_eq!(scored.len(), 50);
    let (mut agree, mut total) = (0, 0);
    let mut our_maj_ok = Vec::new();
    let mut recorded_maj_ok = Vec::new();
    for (row, s) in rows.iter().zip(&scored) {
        assert_eq!(s["id"], row["idx"], "extra fields are carried through in order");
        let recorded: Vec<bool> = serde_json::from_value(row["scores"].clone()).unwrap();
        let ours: Vec<bool> = serde_json::from_value(s["correct"].clone()).unwrap();
        assert_eq!(s["preds"].as_array().unwrap().len(), 8);
        // Extraction: the recorded preds, up to spacing.
        let squash = |v: &Value| v.as_str().map(|t| t.replace(' ', ""));
        for (ours, rec) in s["preds"].as_array().unwrap().iter().zip(row["preds"].as_array().unwrap()) {
            assert_eq!(squash(ours), squash(rec), "idx {}", row["idx"]);
        }
        for (a, b) in recorded.iter().zip(&ours) {
            total += 1;
            agree += usize::from(a == b);
        }
        let gt = row["gt"].as_str().unwrap();
        our_maj_ok.push(s["majority"].as_str().is_some_and(|m| is_equivalent(gt, m)));
        let recorded_preds: Vec<Option<String>> = serde_json::from_value(row["preds"].clone()).unwrap();
        let v = majority_vote(&recorded_preds);
        recorded_maj_ok.push(v.answer.as_deref().is_some_and(|m| is_equivalent(gt, m)));
    }
    eprintln!("agreement with recorded scores: {agree}/{total}");
    assert_eq!(total, 400);
    assert!(agree * 100 >= total * 99, "only {agree}/{total} agree");
    assert_eq!(our_maj_ok, recorded_maj_ok, "majority correct on the same questions");

    // Summary: pass@k equals the estimator over the per-item counts.
    let sum: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(sum["n_items"], 50);
    assert_eq!(sum["n_responses"], 400);
    for k in [1usize, 4, 8] {
        let expect: f64 = scored
            .iter()
            .map(|s| {
                let c = s["correct"].as_array().unwrap().iter().filter(|b| b.as_bool().unwrap()).count();
                pass_at_k(8, c, k)
            })
            .sum::<f64>()
            / 50.0;
        let got = sum["pass_at_k"][k.to_string()].as_f64().unwrap();
        assert!((got - expect).abs() < 1e-12, "pass@{k}: {got} vs {expect}");
    }
    let n_correct: usize =
        scored.iter().map(|s| s["correct"].as_array().unwrap().iter().filter(|b| b.as_bool().unwrap()).count()).sum();
    assert!((sum["avg_at_n"].as_f64().unwrap() - n_correct as f64 / 400.0).abs() < 1e-12);
    let maj = sum["maj_at_n"].as_f64().unwrap();
    assert!((maj - our_maj_ok.iter().filter(|b| **b).count() as f64 / 50.0).abs() < 1e-12);
}

#[test]
fn answer_field_reads_the_original_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.jsonl");
    grpo()
        .args(["score", "--answer-field", "gt", "--input"])
        .arg(fixture("math_x8_dev.jsonl"))
        .arg("--output")
        .arg(&out)
        .assert()
        .success()
        .stdout(predicates::str::contains("pass@1"));
    assert_eq!(read_jsonl(&out).len(), 50);
}

#[test]
fn malformed_lines_are_reported_and_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("bad.jsonl");
    let mut bytes = Vec::new();
    bytes.extend_from_slice(b"{\"answer\": 27.0, \"response\": \"so \\\\boxed{27}\"}\n");
    bytes.extend_from_slice(b"{not json\n");
    bytes.extend_from_slice(b"\xff\xfe{\"answer\": 1}\n");
    bytes.extend_from_slice(b"{\"response\": \"\\\\boxed{1}\"}\n");
    bytes.extend_from_slice(b"{\"answer\": \"1\"}\n");
    bytes.extend_from_slice(b"{\"id\": 7, \"answer\": \"\\\\frac12\", \"responses\": [\"\\\\boxed{0.5}\", \"no answer\", \"\\\\boxed{2}\"]}\n");
    std::fs::write(&input, bytes).unwrap();
    let out = dir.path().join("o.jsonl");
    let assert = grpo().args(["score", "--input"]).arg(&input).arg("--output").arg(&out).assert().success();
    let stderr = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
    for line in 2..=5 {
        assert!(stderr.contains(&format!("bad.jsonl:{line}:")), "line {line} not reported in {stderr}");
    }
    let rows = read_jsonl(&out);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["correct"], json!([true]));
    assert_eq!(rows[0]["preds"], json!(["27"]));
    assert_eq!(rows[1]["id"], 7);
    assert_eq!(rows[1]["preds"], json!(["0.5", null, "2"]));
    assert_eq!(rows[1]["correct"], json!([true, false, false]));
    assert_eq!(rows[1]["majority"], json!("0.5"));

    grpo()
        .args(["score", "--strict", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(dir.path().join("strict.jsonl"))
        .assert()
        .failure()
        .stderr(predicates::str::contains("bad.jsonl:2:"));
}

#[test]
fn no_gold_uses_the_majority() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("g.jsonl");
    let line = json!({"responses": ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{3}", "none", "\\boxed{1/2}"]});
    std::fs::write(&input, format!("{line}\n")).unwrap();
    let out = dir.path().join("o.jsonl");
    let summary = dir.path().join("s.json");
    grpo()
        .args(["score", "--no-gold", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&out)
        .arg("--summary")
        .arg(&summary)
        .assert()
        .success();
    let rows = read_jsonl(&out);
    assert_eq!(rows[0]["majority"], json!("\\frac{1}{2}"));
    assert_eq!(rows[0]["correct"], json!([true, true, false, false, true]));
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["maj_at_n"], Value::Null);
    assert!((s["extract_rate"].as_f64().unwrap() - 0.8).abs() < 1e-12);
}

#[test]
fn adversarial_responses_finish_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("adv.jsonl");
    let big = format!("{}\\boxed{{42}}", "a ".repeat(5_000_000));
    let nested = format!("\\boxed{{{}1{}}}", "{".repeat(10_000), "}".repeat(10_000));
    let unbalanced = format!("\\boxed{{{}", "{".repeat(10_000));
    let lines = [
        json!({"answer": "42", "response": big}),
        json!({"answer": "1", "response": nested}),
        json!({"answer": "1", "response": unbalanced}),
        json!({"answer": "10^{10^{10}}", "responses": ["\\boxed{10^{10^{10}}}", "\\boxed{10^{10^{11}}}", "\\boxed{(2^{4096})^{4096}}"]}),
        json!({"answer": "1", "response": "\\boxed{\\frac{1}{2".repeat(1000)}),
        json!({"answer": "x", "response": format!("\\boxed{{{}x{}}}", "(".repeat(5000), ")".repeat(5000))}),
    ];
    let text: String = lines.iter().map(|l| l.to_string() + "\n").collect();
    std::fs::write(&input, text).unwrap();
    let out = dir.path().join("o.jsonl");
    let t = std::time::Instant::now();
    grpo().args(["score", "--input"]).arg(&input).arg("--output").arg(&out).assert().success();
    assert!(t.elapsed().as_secs_f64() < 20.0, "took {:?}", t.elapsed());
    let rows = read_jsonl(&out);
    assert_eq!(rows.len(), 6);
    assert_eq!(rows[0]["correct"], json!([true]));
    assert_eq!(rows[2]["preds"], json!([null]));
    assert_eq!(rows[3]["correct"], json!([true, false, false]));
    assert_eq!(rows[3]["unknown"], json!([false, true, true]), "past the limits of exact arithmetic");
}

#[test]
fn over_long_lines_are_skipped_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("long.jsonl");
    let long = json!({"answer": "1", "response": "x".repeat(3 << 20)}).to_string();
    let text = format!(
        "{}\n{long}\n{}\n",
        json!({"answer": "2", "response": "\\boxed{2}"}),
        json!({"answer": "3", "response": "\\boxed{4}"})
    );
    std::fs::write(&input, text).unwrap();
    let out = dir.path().join("out.jsonl");
    let assert = grpo()
        .args(["score", "--max-row-bytes", "1048576", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&out)
        .assert()
        .success();
    let stderr = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
    assert!(stderr.contains("long.jsonl:2: line too large"), "{stderr}");
    assert_eq!(read_jsonl(&out).len(), 2);
    grpo().args(["score", "--strict", "--max-row-bytes", "1048576", "--input"]).arg(&input).assert().failure();
}

#[test]
fn nothing_scored_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("none.jsonl");
    std::fs::write(&input, "{\"response\": \"\\\\boxed{1}\"}\n\n").unwrap();
    let out = dir.path().join("out.jsonl");
    let assert = grpo().args(["score", "--input"]).arg(&input).arg("--output").arg(&out).assert().failure();
    let stderr = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
    assert!(stderr.contains("nothing was scored"), "{stderr}");
    assert!(!out.exists());
    std::fs::write(&input, "").unwrap();
    grpo().args(["score", "--input"]).arg(&input).assert().failure();
}

#[test]
fn a_missing_input_is_named_once() {
    let assert = grpo().args(["score", "--input", "no/such.jsonl"]).assert().failure();
    let stderr = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
    assert_eq!(stderr.matches("no/such.jsonl").count(), 1, "{stderr}");
}

#[test]
fn undecidable_equalities_are_reported_as_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("huge.jsonl");
    let lines = [
        // Decided exactly within the limits of exact arithmetic.
        json!({"answer": "2^{100000}", "responses": ["\\boxed{4^{50000}}", "\\boxed{2^{100001}}"]}),
        json!({"answer": "720!", "responses": ["\\boxed{((3!)!)!}"]}),
        // Past them: unknown, neither correct nor called wrong.
        json!({"answer": "2^{10^{9}}", "responses": ["\\boxed{4^{5 \\cdot 10^{8}}}", "\\boxed{2^{10^{9}}}", "no answer"]}),
    ];
    std::fs::write(&input, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    let out = dir.path().join("o.jsonl");
    let summary = dir.path().join("s.json");
    grpo()
        .args(["score", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&out)
        .arg("--summary")
        .arg(&summary)
        .assert()
        .success()
        .stdout(predicates::str::contains("unknown verdicts  1"));
    let rows = read_jsonl(&out);
    assert_eq!(rows[0]["correct"], json!([true, false]));
    assert_eq!(rows[0]["unknown"], json!([false, false]));
    assert_eq!(rows[1]["correct"], json!([true]));
    assert_eq!(rows[2]["correct"], json!([false, true, false]));
    assert_eq!(rows[2]["unknown"], json!([true, false, false]));
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["n_unknown"], 1);
    assert_eq!(s["n_responses"], 6);

    // Without gold: the unknown comparison does not join the majority, and is reported as unknown.
    let no_gold = dir.path().join("no_gold.jsonl");
    let line = json!({"responses": ["\\boxed{2^{10^{9}}}", "\\boxed{4^{5 \\cdot 10^{8}}}", "\\boxed{2^{10^{9}}}"]});
    std::fs::write(&no_gold, format!("{line}\n")).unwrap();
    grpo()
        .args(["score", "--no-gold", "--input"])
        .arg(&no_gold)
        .arg("--output")
        .arg(&out)
        .arg("--summary")
        .arg(&summary)
        .assert()
        .success();
    let rows = read_jsonl(&out);
    assert_eq!(rows[0]["correct"], json!([true, false, true]));
    assert_eq!(rows[0]["unknown"], json!([false, true, false]));
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["n_unknown"], 1);
}

#[test]
fn eval_generations_and_validation_records_are_read_by_their_samples() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("generations.jsonl");
    // The shape of `grpo eval`'s generations.jsonl (and of a run's validation records).
    let sample = |text: &str| json!({"text": text, "pred": null, "correct": false, "tokens": 3, "finish": "stop"});
    let lines = [
        json!({"bench": "aime25", "id": "1", "prompt": "p", "answer": "27", "prompt_tokens": 5,
               "samples": [sample("so \\boxed{27}"), sample("\\boxed{26}")], "majority": null, "majority_correct": false}),
        json!({"bench": "aime25", "id": "2", "answer": "5", "samples": [{"tokens": 1}]}),
    ];
    std::fs::write(&input, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    let out = dir.path().join("o.jsonl");
    let a = grpo().args(["score", "--input"]).arg(&input).arg("--output").arg(&out).assert().success();
    let stderr = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(stderr.contains("generations.jsonl:2: samples[0] has no string \"text\""), "{stderr}");
    let rows = read_jsonl(&out);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["preds"], json!(["27", "26"]));
    assert_eq!(rows[0]["correct"], json!([true, false]));
    assert_eq!(rows[0]["id"], "1");
}

#[test]
fn a_k_over_the_samples_per_problem_is_refused_with_a_warning_not_a_number() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("four.jsonl");
    let line = |i: usize| json!({"id": i, "answer": "7", "responses": ["\\boxed{7}", "\\boxed{3}", "\\boxed{3}", "\\boxed{3}"]});
    std::fs::write(&input, (0..3).map(|i| line(i).to_string() + "\n").collect::<String>()).unwrap();
    let summary = dir.path().join("summary.json");
    let a = grpo()
        .args(["score", "--k", "1,8", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(dir.path().join("scored.jsonl"))
        .arg("--summary")
        .arg(&summary)
        .assert()
        .success();
    let stderr = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    let stdout = String::from_utf8_lossy(&a.get_output().stdout).to_string();
    assert!(
        stderr.contains("pass@8 cannot be computed: 3 of 3 items have fewer than 8 samples (as few as 4)"),
        "{stderr}"
    );
    assert!(stdout.contains("pass@1") && !stdout.contains("pass@8"), "{stdout}");
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["pass_at_k"].as_object().unwrap().keys().collect::<Vec<_>>(), ["1"]);
}
