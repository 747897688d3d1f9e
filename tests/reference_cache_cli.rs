//! The reference log-prob cache from the command line: `grpo data prepare --reference` writes it, `grpo train`
//! reads it without loading the reference model, and a damaged cache is reported with its path and
//! recomputed.

mod common;

use std::path::Path;

fn data() -> String {
    common::root().join("data/trajectories/ot3_math_x8_dev.jsonl").display().to_string()
}

/// `grpo data prepare` of 6 questions x 4 answers cut at 24 tokens, as the config below prepares them.
fn prepare(model: &Path, out: &Path, extra: &[&str]) -> assert_cmd::assert::Assert {
    common::grpo()
        .args(["data", "prepare", "-i", &data(), "--group-size", "4", "--max-questions", "6"])
        .args(["--max-response-tokens", "24", "--seed", "7", "--model"])
        .arg(model)
        .arg("--out")
        .arg(out)
        .args(extra)
        .assert()
}

fn config(dir: &Path) -> std::path::PathBuf {
    let cfg = format!(
        r#"
[model]
path = "{model}"
reference = "{reference}"

[data]
inputs = ["{data}"]
group_size = 4
max_questions = 6
max_response_tokens = 24
prepared_dir = "{prepared}"

[objective]
name = "off_grpo"
bias = 0.5
beta = 0.1

# Plain SGD: the cached and on-the-fly runs stay within rounding of each other (Adam's first step would
# amplify the sign of a near-zero gradient).
[optim]
name = "sgd"
lr = 0.5

[train]
output_dir = "{out}"
batch_questions = 2
micro_batch_size = 3
max_steps = 2
seed = 7
"#,
        model = dir.join("model").display(),
        reference = dir.join("reference").display(),
        data = data(),
        prepared = dir.join("prepared").display(),
        out = dir.join("out").display(),
    );
    let p = dir.join("train.toml");
    std::fs::write(&p, cfg).unwrap();
    p
}

/// The tiny model of `common::init_tiny` with other random weights (seed 8): the reference.
fn init_reference(out: &Path) {
    common::grpo()
        .args(["init-tiny", "--arch", "qwen2", "--tokenizer"])
        .arg(common::root().join("data/tokenizers/smollm2"))
        .arg("--out")
        .arg(out)
        .args(["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128"])
        .args(["--seed", "8"])
        .assert()
        .success();
}

/// The current version of a prepared folder (where its reference cache is).
fn version(prepared: &Path) -> std::path::PathBuf {
    prepared.join(std::fs::read_to_string(prepared.join("CURRENT")).unwrap().trim())
}

fn stderr(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stderr).into_owned()
}

#[test]
fn prepare_writes_the_cache_and_train_uses_it_without_the_reference_model() {
    let dir = tempfile::tempdir().unwrap();
    let (model, prepared) = (dir.path().join("model"), dir.path().join("prepared"));
    common::init_tiny("qwen2", "smollm2", &model);
    init_reference(&dir.path().join("reference"));
    let ref_arg = dir.path().join("reference").display().to_string();
    let out = prepare(&model, &prepared, &["--reference", &ref_arg]).success();
    let stdout = String::from_utf8_lossy(&out.get_output().stdout).into_owned();
    let values = version(&prepared).join("reference-logprobs.f32");
    assert!(stdout.contains(&format!("written to {}", values.display())), "{stdout}");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(version(&prepared).join("reference-logprobs.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["values"].as_u64().unwrap() * 4, std::fs::metadata(&values).unwrap().len());
    let written = std::fs::metadata(&values).unwrap().modified().unwrap();

    // A temporary file an interrupted computation left is removed beside the fresh cache.
    let stray = version(&prepared).join(".reference-logprobs.f32.Ab12Cd.tmp");
    std::fs::write(&stray, b"partial").unwrap();
    let cfg = config(dir.path());
    let run = common::grpo().current_dir(common::root()).arg("train").arg("--config").arg(&cfg).assert().success();
    let log = stderr(&run);
    assert!(!stray.exists(), "{log}");
    let fresh = format!("data in {} is up to date", prepared.display());
    assert!(log.contains(&fresh), "the prepared data was prepared again:\n{log}");
    assert!(log.contains(&format!("reference log-probs in {} are up to date", values.display())), "{log}");
    assert!(log.contains("no reference model loaded"), "{log}");
    assert_eq!(std::fs::metadata(&values).unwrap().modified().unwrap(), written, "the cache was rewritten");
    let metrics = common::read_jsonl(&dir.path().join("out/metrics.jsonl"));
    assert_eq!(metrics.len(), 2);
    // The reference is another model: the KL term is there.
    assert!(metrics.iter().all(|m| m["kl"].as_f64().unwrap() > 1e-3), "{metrics:?}");

    // The same run with the cache off loads the reference and trains alike.
    let run = common::grpo()
        .current_dir(common::root())
        .args(["train", "--overwrite", "--set", "model.cache_reference=false", "--config"])
        .arg(&cfg)
        .assert()
        .success();
    assert!(!stderr(&run).contains("no reference model loaded"));
    let again = common::read_jsonl(&dir.path().join("out/metrics.jsonl"));
    for (a, b) in metrics.iter().zip(&again) {
        for k in ["loss", "kl", "grad_norm"] {
            let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
            assert!((x - y).abs() <= 1e-4 * x.abs().max(1e-2), "{k}: cached {x} vs on the fly {y}");
        }
    }
}

#[test]
fn a_damaged_cache_is_reported_with_its_path_and_recomputed() {
    let dir = tempfile::tempdir().unwrap();
    let (model, prepared) = (dir.path().join("model"), dir.path().join("prepared"));
    common::init_tiny("qwen2", "smollm2", &model);
    init_reference(&dir.path().join("reference"));
    let ref_arg = dir.path().join("reference").display().to_string();
    prepare(&model, &prepared, &["--reference", &ref_arg]).success();
    let values = version(&prepared).join("reference-logprobs.f32");
    let bytes = std::fs::read(&values).unwrap();
    std::fs::write(&values, &bytes[..bytes.len() / 2]).unwrap();
    let again = prepare(&model, &prepared, &["--reference", &ref_arg]).success();
    let log = stderr(&again);
    assert!(log.contains(&values.display().to_string()) && log.contains("recomputing"), "{log}");
    assert_eq!(std::fs::read(&values).unwrap(), bytes);
    // The trainer does the same.
    std::fs::write(version(&prepared).join("reference-logprobs.json"), "{").unwrap();
    let run = common::grpo().current_dir(common::root()).arg("train").arg("--config").arg(config(dir.path())).assert();
    let log = stderr(&run.success());
    assert!(log.contains("reference-logprobs.json") && log.contains("recomputing"), "{log}");
}

/// A run in a new output folder (its own prepared folder) on the same data and reference takes the values an
/// earlier run computed from the shared cache (GRPO_CACHE_DIR) instead of running the reference pass again,
/// and trains exactly as the first; a damaged shared entry is computed again.
#[test]
fn a_new_run_on_the_same_data_takes_the_reference_log_probs_of_an_earlier_one() {
    let dir = tempfile::tempdir().unwrap();
    common::init_tiny("qwen2", "smollm2", &dir.path().join("model"));
    init_reference(&dir.path().join("reference"));
    let (cfg, shared) = (config(dir.path()), dir.path().join("shared"));
    let run = |name: &str| {
        let out = dir.path().join(name);
        let a = common::grpo()
            .env("GRPO_CACHE_DIR", &shared)
            .current_dir(common::root())
            .args(["train", "--config"])
            .arg(&cfg)
            .arg("--set")
            .arg(format!("train.output_dir=\"{}\"", out.display()))
            .arg("--set")
            .arg(format!("data.prepared_dir=\"{}\"", out.join("prepared").display()))
            .assert()
            .success();
        let metrics = common::read_jsonl(&out.join("metrics.jsonl"));
        let values: Vec<Vec<f64>> =
            metrics.iter().map(|m| ["loss", "kl", "grad_norm"].map(|k| m[k].as_f64().unwrap()).to_vec()).collect();
        (stderr(&a), values)
    };
    let (log, first) = run("a");
    assert!(log.contains("computing the reference log-probs") && log.contains("shared with later runs"), "{log}");
    let entries: Vec<_> = std::fs::read_dir(shared.join("reference-logprobs")).unwrap().collect();
    assert_eq!(entries.len(), 1);
    let (log, second) = run("b");
    assert!(log.contains("reference log-probs taken from") && !log.contains("computing the reference"), "{log}");
    assert_eq!(first, second, "the run on shared values trains as the one that computed them");
    // A damaged entry is not used: the values are computed again, and shared again.
    let entry = entries[0].as_ref().unwrap().path();
    let values = entry.join("reference-logprobs.f32");
    let mut bytes = std::fs::read(&values).unwrap();
    bytes[0] ^= 0x40;
    std::fs::remove_file(&values).unwrap(); // a new file: the runs' hard links keep their values
    std::fs::write(&values, &bytes).unwrap();
    let (log, third) = run("c");
    assert!(log.contains("are damaged: computing them") && log.contains("shared with later runs"), "{log}");
    assert_eq!(first, third);
}
