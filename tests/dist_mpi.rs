//! Data parallelism over MPI: `mpirun -np 2 grpo train` (optimiser state sharded, ZeRO-1) equals one
//! process on the same global batch, a run resumes at another world size (re-sharding the optimiser state),
//! and a rank that dies stops the other. Built with `--features mpi`
//! (needs Open MPI); .ci/run runs `cargo test --features mpi --test dist_mpi`. Without mpirun on the PATH
//! each test says so and returns.
#![cfg(feature = "mpi")]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

fn mpirun() -> Option<PathBuf> {
    let found = std::process::Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("SKIPPED: mpirun is not on the PATH (Debian: apt-get install openmpi-bin libopenmpi-dev)");
    }
    found.then(|| PathBuf::from("mpirun"))
}

/// A run of `steps` steps of `objective` (TOML lines of `[objective]`) on 4 questions x 4 answers per
/// step, answers of uneven lengths (cut at 40 tokens), AdamW with clipping on the global norm. (AdamW
/// turns a parameter's near-zero gradient into a step of about lr whatever its rounding, so the learning
/// rate bounds how far two summation orders can drift: 1e-4 keeps them within 1e-5.)
fn config(dir: &Path, model: &Path, objective: &str, steps: usize) -> PathBuf {
    let text = format!(
        "[model]\npath = \"{model}\"\n\
         [data]\ninputs = [\"{data}\"]\ngroup_size = 4\nmax_questions = 12\nmax_response_tokens = 40\nties = \"first\"\n\
         prepared_dir = \"{prepared}\"\n\
         [objective]\n{objective}\n\
         [optim]\nname = \"adamw\"\nlr = 1e-4\ngrad_clip = 0.5\n\
         [train]\noutput_dir = \"{out}\"\nbatch_questions = 4\nmicro_batch_size = 3\nmax_steps = {steps}\nseed = 3\n\
         save_every = 1\nkeep_last = 0\nepochs = 100\n",
        model = model.display(),
        data = common::root().join("data/trajectories/ot3_math_x8_dev.jsonl").display(),
        prepared = dir.join("prepared").display(),
        out = dir.join("out").display(),
    );
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn grpo_bin() -> PathBuf {
    assert_cmd::cargo::cargo_bin("grpo")
}

/// `grpo` on `np` processes (1: without mpirun).
fn grpo(np: usize) -> std::process::Command {
    let mut c = if np == 1 {
        std::process::Command::new(grpo_bin())
    } else {
        let mut c = std::process::Command::new("mpirun");
        c.args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()]).arg(grpo_bin());
        c
    };
    c.env("OMPI_MCA_btl", "self,vader,tcp");
    c
}

/// `grpo train` on `np` processes (1: without mpirun).
fn train(np: usize, cfg: &Path, extra: &[&str]) -> std::process::Output {
    let mut c = grpo(np);
    c.args(["-q", "train", "--config"]).arg(cfg).args(extra);
    let o = c.output().unwrap();
    assert!(o.status.success(), "np {np}: {}", String::from_utf8_lossy(&o.stderr));
    o
}

fn weights(ck: &Path) -> Vec<(String, Vec<f32>)> {
    let mut t: Vec<(String, Tensor)> =
        candle_core::safetensors::load(ck.join("model.safetensors"), &Device::Cpu).unwrap().into_iter().collect();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t.into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|((na, x), (nb, y))| {
            assert_eq!(na, nb);
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

fn tiny(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    common::init_tiny("llama", "smollm2", &model);
    model
}

fn step_dir(out: &Path, step: usize) -> PathBuf {
    out.join(format!("out/checkpoints/step-{step:08}"))
}

/// The optimiser state of checkpoint `ck` is sharded over `ranks` (ZeRO-1): one file per rank, each rank's
/// block of the flat f32 master weights and moments, the blocks in order covering the model's parameters,
/// whose concatenation is the model's weights (an f32 model).
fn check_shards(ck: &Path, ranks: usize) {
    assert!(!ck.join("optimizer.safetensors").exists(), "{}: a whole optimizer state", ck.display());
    let flat: Vec<f32> = weights_in_order(ck);
    let mut master = Vec::new();
    for r in 0..ranks {
        let f = ck.join(format!("optimizer-{r:05}-of-{ranks:05}.safetensors"));
        let t = candle_core::safetensors::load(&f, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let range = t["flat_range"].to_vec1::<i64>().unwrap();
        assert_eq!(range, [master.len() as i64, (master.len() + t["master"].elem_count()) as i64, flat.len() as i64]);
        for part in ["exp_avg", "exp_avg_sq"] {
            assert_eq!(t[part].elem_count(), t["master"].elem_count(), "{part} of rank {r}");
        }
        assert!(t["master"].elem_count() <= flat.len().div_ceil(ranks));
        master.extend(t["master"].to_vec1::<f32>().unwrap());
    }
    assert_eq!(master, flat, "the shards' master weights are the model's weights");
}

/// The model's trainable weights flattened and concatenated in parameter order (the optimiser's flat order).
fn weights_in_order(ck: &Path) -> Vec<f32> {
    let model = grpo::model::load_decoder(ck, candle_core::DType::F32, &Device::Cpu, true).unwrap();
    model.vars().iter().flat_map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
}

const OBJECTIVES: &[(&str, &str)] = &[
    ("off_grpo", "name = \"off_grpo\"\nbias = 0.5\nbeta = 0.1\nloss_agg = \"token-mean\""),
    ("gspo", "name = \"gspo\"\nloss_agg = \"seq-mean-token-mean\""),
    ("sft", "name = \"sft\""),
];

#[test]
fn two_ranks_equal_one_process_on_the_same_global_batch() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    for (name, objective) in OBJECTIVES {
        let (one, two) = (d.path().join(format!("{name}-1")), d.path().join(format!("{name}-2")));
        for (dir, np) in [(&one, 1), (&two, 2)] {
            std::fs::create_dir_all(dir).unwrap();
            train(np, &config(dir, &model, objective, 3), &[]);
        }
        let diff = max_diff(&weights(&step_dir(&one, 3)), &weights(&step_dir(&two, 3)));
        eprintln!("{name}: max |w1 - w2| after 3 AdamW steps = {diff:e}");
        assert!(diff <= 1e-5, "{name}: {diff}");
        check_shards(&step_dir(&two, 3), 2);
        let (m1, m2) =
            (common::read_jsonl(&one.join("out/metrics.jsonl")), common::read_jsonl(&two.join("out/metrics.jsonl")));
        assert_eq!(m1.len(), 3);
        assert_eq!(m2.len(), 3, "rank 1 wrote metrics too");
        for (a, b) in m1.iter().zip(&m2) {
            for k in ["loss", "grad_norm", "reward", "num_tokens"] {
                let (x, y) = (a[k].as_f64().unwrap_or(0.0), b[k].as_f64().unwrap_or(0.0));
                assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "{name} {k}: 1 process {x}, 2 ranks {y}");
            }
        }
    }
}

#[test]
fn a_run_resumes_exactly_at_another_world_size() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let (_, objective) = OBJECTIVES[0];
    let whole = d.path().join("whole");
    std::fs::create_dir_all(&whole).unwrap();
    train(1, &config(&whole, &model, objective, 4), &[]);
    let reference = weights(&step_dir(&whole, 4));
    for (first, then) in [(2, 1), (1, 2)] {
        let dir = d.path().join(format!("{first}-then-{then}"));
        std::fs::create_dir_all(&dir).unwrap();
        train(first, &config(&dir, &model, objective, 2), &[]);
        if first == 2 {
            check_shards(&step_dir(&dir, 2), 2);
        }
        train(then, &config(&dir, &model, objective, 4), &["--resume", "auto"]);
        let diff = max_diff(&reference, &weights(&step_dir(&dir, 4)));
        eprintln!("{first} then {then} ranks: max |w - w_uninterrupted| = {diff:e}");
        assert!(diff <= 1e-5, "{first} -> {then}: {diff}");
    }
}

#[test]
fn a_rank_killed_mid_run_stops_the_other_within_a_minute() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let cfg = config(d.path(), &model, OBJECTIVES[0].1, 1000);
    let mut job = std::process::Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(grpo_bin())
        .args(["-q", "train", "--config"])
        .arg(&cfg)
        .args(["--set", "train.max_steps=0", "--set", "train.epochs=100", "--set", "train.save_every=0"])
        .env("OMPI_MCA_btl", "self,vader,tcp")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = d.path().join("out/metrics.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |s| s.lines().count() < 1) {
        assert!(t0.elapsed() < Duration::from_secs(300), "no step finished");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The ranks are grpo processes below mpirun; kill one of them.
    let ranks = String::from_utf8(
        std::process::Command::new("pgrep").args(["-f", "-P", &job.id().to_string(), "grpo"]).output().unwrap().stdout,
    )
    .unwrap();
    let victim = ranks.split_whitespace().next().expect("a rank process");
    std::process::Command::new("kill").args(["-KILL", victim]).status().unwrap();
    let killed = Instant::now();
    let status = loop {
        if let Some(s) = job.try_wait().unwrap() {
            break s;
        }
        if killed.elapsed() > Duration::from_secs(60) {
            let _ = job.kill();
            panic!("the job still runs 60 s after a rank was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success(), "the job ended successfully after a rank was killed");
    eprintln!("stopped {:?} after a rank was killed", killed.elapsed());
}

/// `grpo eval` on 2 ranks (problem i on rank i mod 2, the results gathered by rank 0) writes the
/// generations.jsonl and the report of one process: sampled answers (seeded per problem), two benchmarks,
/// an odd number of problems each. One problem per batch (`--batch-size` = n) in both runs: batches of
/// other sizes pad the prompts differently, whose rounding can change a sampled token.
#[test]
fn eval_on_two_ranks_writes_what_one_process_writes() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let eval = |np: usize, out: &str| {
        let out = d.path().join(out);
        let mut c = grpo(np);
        c.args(["-q", "eval", "--bench", "aime25,aime24", "--limit", "5", "--n", "3", "--temperature", "1.0"])
            .args(["--max-new-tokens", "8", "--seed", "7", "--batch-size", "3", "--model"])
            .arg(&model)
            .arg("--out")
            .arg(&out);
        let o = c.output().unwrap();
        assert!(o.status.success(), "np {np}: {}", String::from_utf8_lossy(&o.stderr));
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
        let mut benches = report["benchmarks"].as_object().unwrap().clone();
        for r in benches.values_mut() {
            let r = r.as_object_mut().unwrap();
            for timing in ["duration_s", "tokens_per_sec"] {
                r.remove(timing).unwrap();
            }
        }
        (std::fs::read_to_string(out.join("generations.jsonl")).unwrap(), benches, String::from_utf8(o.stdout).unwrap())
    };
    let (gens_one, report_one, _) = eval(1, "one");
    let (gens_two, report_two, stdout_two) = eval(2, "two");
    assert_eq!(gens_one.lines().count(), 10);
    assert_eq!(gens_two, gens_one, "generations.jsonl");
    assert_eq!(report_two, report_one, "report.json");
    assert_eq!(stdout_two.matches("avg@n").count(), 1, "one table, from rank 0: {stdout_two}");
}
