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
        c.args(["--allow-run-as-root", "--oversubscribe", "-x", "GRPO_CACHE_DIR", "-np", &np.to_string()]);
        c.arg(grpo_bin());
        c
    };
    c.env("OMPI_MCA_btl", "self,vader,tcp");
    c.env("GRPO_CACHE_DIR", "off"); // no reference log-probs shared between the tests' runs
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
        .fold(0.0, nan_wins_max)
}

/// `f32::max` that keeps a NaN (a difference with a NaN in it) instead of dropping it.
fn nan_wins_max(m: f32, d: f32) -> f32 {
    if d.is_nan() || m.is_nan() {
        f32::NAN
    } else {
        m.max(d)
    }
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

/// Packed micro-batches on 2 ranks (each packs its own groups' answers into rows of the budget) train as
/// padded ones in one process: off_grpo's token-mean (the global batch's token count) and gspo's
/// sequence-level ratio.
#[test]
fn packed_micro_batches_on_two_ranks_equal_padded_ones_in_one_process() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    for (name, objective) in &OBJECTIVES[..2] {
        let (one, two) = (d.path().join(format!("{name}-padded")), d.path().join(format!("{name}-packed")));
        let packed = ["--set", "train.micro_batch_tokens=300"];
        for (dir, np, extra) in [(&one, 1, &[][..]), (&two, 2, &packed[..])] {
            std::fs::create_dir_all(dir).unwrap();
            train(np, &config(dir, &model, objective, 3), extra);
        }
        let diff = max_diff(&weights(&step_dir(&one, 3)), &weights(&step_dir(&two, 3)));
        eprintln!("{name}: max |w1 - w2| after 3 AdamW steps, padded vs packed on 2 ranks = {diff:e}");
        assert!(diff <= 1e-5, "{name}: {diff}");
        let (m1, m2) =
            (common::read_jsonl(&one.join("out/metrics.jsonl")), common::read_jsonl(&two.join("out/metrics.jsonl")));
        assert_eq!((m1.len(), m2.len()), (3, 3));
        for (a, b) in m1.iter().zip(&m2) {
            assert_eq!(a["num_tokens"], b["num_tokens"], "{name}");
            for k in ["loss", "grad_norm"] {
                let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
                assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "{name} {k}: padded {x}, packed on 2 ranks {y}");
            }
        }
    }
}

/// LoRA (`[model.lora]`) on two ranks, the adapters' optimizer state sharded over them (ZeRO-1), trains the
/// adapters one process trains on the same global batch.
#[test]
fn lora_on_two_ranks_equals_one_process() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let (_, objective) = OBJECTIVES[0];
    let lora = ["--set", "model.lora = { r = 4, alpha = 8 }", "--set", "optim.lr = 1e-2"];
    let runs: Vec<PathBuf> = [1, 2]
        .into_iter()
        .map(|np| {
            let dir = d.path().join(format!("np{np}"));
            std::fs::create_dir_all(&dir).unwrap();
            train(np, &config(&dir, &model, objective, 3), &lora);
            step_dir(&dir, 3)
        })
        .collect();
    let adapters = |ck: &Path| -> Vec<(String, Vec<f32>)> {
        let mut t: Vec<(String, Tensor)> =
            candle_core::safetensors::load(ck.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap()
                .into_iter()
                .collect();
        t.sort_by(|a, b| a.0.cmp(&b.0));
        t.into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
    };
    let (one, two) = (adapters(&runs[0]), adapters(&runs[1]));
    assert!(one.iter().any(|(n, v)| n.contains("lora_B") && v.iter().any(|&x| x != 0.0)), "the adapters did not move");
    // The gradients are summed in another order on two ranks: differences of f32 rounding, against what the
    // adapters moved in steps 2 and 3 (a rank's missing or doubled gradient would differ by about that).
    let moved = max_diff(&adapters(&runs[0].with_file_name("step-00000001")), &one);
    let diff = max_diff(&one, &two);
    eprintln!("LoRA: max |a1 - a2| after 3 AdamW steps, one process vs two ranks = {diff:e} (moved {moved:e})");
    assert!(diff <= 1e-2 * moved, "{diff} against {moved}");
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
    let (mut job, _) = long_job(d.path(), &cfg);
    let victim = ranks(&job).into_iter().next().expect("a rank process");
    std::process::Command::new("kill").args(["-KILL", &victim]).status().unwrap();
    let killed = Instant::now();
    let status = end_within_a_minute(&mut job, "after a rank was killed");
    assert!(!status.success(), "the job ended successfully after a rank was killed");
    eprintln!("stopped {:?} after a rank was killed", killed.elapsed());
}

/// A 2-rank training job of `cfg` that would run for hours, once its first step is done: the job (mpirun)
/// and its metrics.jsonl.
fn long_job(dir: &Path, cfg: &Path) -> (std::process::Child, PathBuf) {
    let job = grpo(2)
        .args(["-q", "train", "--config"])
        .arg(cfg)
        .args(["--set", "train.max_steps=0", "--set", "train.epochs=100", "--set", "train.save_every=0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = dir.join("out/metrics.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |s| s.lines().count() < 1) {
        assert!(t0.elapsed() < Duration::from_secs(300), "no step finished");
        std::thread::sleep(Duration::from_millis(100));
    }
    (job, metrics)
}

/// The pids of the job's ranks: the grpo processes mpirun started.
fn ranks(job: &std::process::Child) -> Vec<String> {
    let out = std::process::Command::new("pgrep").args(["-P", &job.id().to_string()]).output().unwrap();
    String::from_utf8(out.stdout).unwrap().split_whitespace().map(String::from).collect()
}

/// The job's exit status, failing the test (and killing the job) when it still runs a minute on.
fn end_within_a_minute(job: &mut std::process::Child, what: &str) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = job.try_wait().unwrap() {
            return s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = job.kill();
            panic!("the job still runs 60 s {what}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
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

/// A tiny model on the 64-token digits tokenizer and 8 questions whose gold answer is 7.
fn rollout_setup(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("digits-model");
    let questions = common::digits_model_and_questions(dir, &model);
    (model, questions)
}

/// On-policy GRPO with rollouts: 4 questions x 8 sampled answers of at most 3 tokens per step, one
/// question per generation batch and per behaviour forward (so that one process and each rank pad alike),
/// `extra` more TOML lines of `[rollout]`.
fn rollout_config(dir: &Path, model: &Path, questions: &Path, steps: usize, extra: &str) -> PathBuf {
    let text = format!(
        "[model]\npath = \"{model}\"\n[data]\nmax_prompt_tokens = 64\n\
         [objective]\nname = \"grpo\"\nanchor = \"behaviour\"\n\
         [optim]\nname = \"adamw\"\nlr = 1e-4\ngrad_clip = 0.5\n\
         [train]\noutput_dir = \"{out}\"\nbatch_questions = 4\nmicro_batch_size = 8\nepochs = 0\nmax_steps = {steps}\n\
         seed = 3\nkeep_last = 0\n\
         [rollout]\nn = 8\nmax_new_tokens = 3\ntemperature = 1.0\nbatch_size = 8\nquestions = \"{questions}\"\n\
         prompt_template = \"{{problem}}\"\nfallbacks = true\n{extra}\n",
        model = model.display(),
        out = dir.join("out").display(),
        questions = questions.display(),
    );
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// Each rank samples only its share of a batch's questions (question i on rank i mod N), and the run equals
/// one process: the same answers (streams seeded by the question, not the rank), so the same weights, and
/// the whole batch's rollout metrics. Plain, and with dynamic sampling's refills.
#[test]
fn rollouts_are_split_across_ranks_and_equal_one_process() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let (model, questions) = rollout_setup(d.path());
    for (name, extra) in [("plain", ""), ("filter_groups", "filter_groups = true\nmax_num_gen_batches = 3")] {
        let (one, two) = (d.path().join(format!("{name}-1")), d.path().join(format!("{name}-2")));
        for (dir, np) in [(&one, 1), (&two, 2)] {
            std::fs::create_dir_all(dir).unwrap();
            let o = grpo(np)
                .args(["-v", "train", "--config"])
                .arg(rollout_config(dir, &model, &questions, 3, extra))
                .output()
                .unwrap();
            let log = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "{name} np {np}: {log}");
            for rank in 0..np {
                let line = format!("rollout: rank {rank} samples {} of the batch's 4 questions", 4 / np);
                assert!(log.contains(&line), "{name} np {np}: no `{line}` in\n{log}");
            }
        }
        let diff = max_diff(&weights(&step_dir(&one, 3)), &weights(&step_dir(&two, 3)));
        eprintln!("{name}: max |w1 - w2| after 3 on-policy steps = {diff:e}");
        assert!(diff <= 1e-5, "{name}: {diff}");
        let (m1, m2) =
            (common::read_jsonl(&one.join("out/metrics.jsonl")), common::read_jsonl(&two.join("out/metrics.jsonl")));
        assert_eq!((m1.len(), m2.len()), (3, 3));
        for (a, b) in m1.iter().zip(&m2) {
            for k in ["loss", "rollout/reward_mean", "rollout/reward_std", "rollout/mean_length", "rollout/gen_batches"]
            {
                let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
                assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "{name} {k}: 1 process {x}, 2 ranks {y}");
            }
            assert_eq!(a["rollout/answers"], b["rollout/answers"], "{name}");
            assert_eq!(a["rollout/groups_dropped"], b["rollout/groups_dropped"], "{name}");
        }
    }
}

/// `[rollout.server]` on 2 ranks with one server each (base_url lists two): each server receives only its
/// rank's share of every batch's questions, the shares together are each batch's questions once, and each
/// server is told to reload the sampling weights that rank 0 saved, once per refresh.
#[test]
fn each_rank_samples_its_questions_from_its_own_server() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let (model, questions) = rollout_setup(d.path());
    let (Some(a), Some(b)) = (common::Scripted::start(d.path(), "a"), common::Scripted::start(d.path(), "b")) else {
        return;
    };
    let server = format!(
        "reload = \"sglang\"\n[rollout.server]\nengine = \"openai\"\nserved_model = \"m\"\n\
         base_url = \"http://127.0.0.1:{}/v1,http://127.0.0.1:{}/v1\"",
        a.port, b.port
    );
    let run = d.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    train(2, &rollout_config(&run, &model, &questions, 2, &server), &[]);
    let policy = run.join("out/rollout-policy");
    for (name, s) in [("a", &a), ("b", &b)] {
        let lines = s.lines();
        let reloads: Vec<&String> = lines.iter().filter(|l| l.starts_with("reload ")).collect();
        assert_eq!(reloads.len(), 2, "server {name}: one reload per step: {lines:?}");
        assert!(reloads.iter().all(|l| Path::new(&l["reload ".len()..]) == policy), "server {name}: {reloads:?}");
        assert_eq!(lines.len(), 2 + 2 * 2, "server {name}: 2 reloads and 2 questions per step: {lines:?}");
    }
    let prompts = |s: &common::Scripted| -> std::collections::BTreeSet<String> {
        s.lines().into_iter().filter(|l| l.starts_with("prompt ")).collect()
    };
    let (pa, pb) = (prompts(&a), prompts(&b));
    assert!(pa.is_disjoint(&pb), "a question went to both servers: {pa:?} {pb:?}");
    assert_eq!(pa.len() + pb.len(), 8, "the 8 questions of 2 steps, each asked once: {pa:?} {pb:?}");
    let m = common::read_jsonl(&run.join("out/metrics.jsonl"));
    assert_eq!(m.len(), 2);
    for step in &m {
        assert_eq!(step["rollout/answers"].as_u64(), Some(32), "{step}");
    }
}

/// A rank whose rollout server answers after longer than the collective timeout (`GRPO_DIST_TIMEOUT_S=5`,
/// answers after 7 s) keeps the other rank, done with its share, waiting in rounds rather than in a bounded
/// collective: the step completes.
#[test]
fn a_rollout_server_slower_than_the_collective_timeout_does_not_end_the_run() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let (model, questions) = rollout_setup(d.path());
    let (Some(a), Some(b)) = (common::Scripted::start(d.path(), "a"), common::Scripted::start_slow(d.path(), "b", 7.0))
    else {
        return;
    };
    let server = format!(
        "reload = \"sglang\"\n[rollout.server]\nengine = \"openai\"\nserved_model = \"m\"\n\
         base_url = \"http://127.0.0.1:{}/v1,http://127.0.0.1:{}/v1\"",
        a.port, b.port
    );
    let run = d.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let cfg = rollout_config(&run, &model, &questions, 1, &server);
    let started = Instant::now();
    let o = grpo(2).env("GRPO_DIST_TIMEOUT_S", "5").args(["-q", "train", "--config"]).arg(&cfg).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(started.elapsed().as_secs_f64() > 7.0, "the slow server was not waited for");
    let m = common::read_jsonl(&run.join("out/metrics.jsonl"));
    assert_eq!(m.len(), 1);
    assert_eq!(m[0]["rollout/answers"].as_u64(), Some(32), "{}", m[0]);
}

/// The reference log-probs cache of a 2-rank run is computed by both ranks together, each its share of
/// the groups written in place into one file, and holds the values one process computes.
#[test]
fn the_reference_cache_is_computed_by_every_rank_its_share() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let values = |dir: &Path| -> Vec<f32> {
        let found: Vec<PathBuf> = glob::glob(&format!("{}/prepared/**/reference-logprobs.f32", dir.display()))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(found.len(), 1, "{found:?}");
        std::fs::read(&found[0]).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    };
    let mut caches = Vec::new();
    for np in [1, 2] {
        let dir = d.path().join(format!("np{np}"));
        std::fs::create_dir_all(&dir).unwrap();
        let o =
            grpo(np).args(["-v", "train", "--config"]).arg(config(&dir, &model, OBJECTIVES[0].1, 1)).output().unwrap();
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "np {np}: {log}");
        if np == 2 {
            let count = |pattern: &str| -> usize {
                let re = regex::Regex::new(pattern).unwrap();
                re.captures(&log).unwrap_or_else(|| panic!("no `{pattern}` in\n{log}"))[1].parse().unwrap()
            };
            let answers = [0, 1].map(|r| count(&format!(r"rank {r}: reference log-probs of (\d+) answers written")));
            assert!(answers.iter().all(|&a| a > 0), "each rank scored a share: {answers:?}");
            let total = count(r"reference log-probs of (\d+) answers \(\d+ tokens\) written to");
            assert_eq!(answers[0] + answers[1], total, "the shares make the whole: {answers:?}\n{log}");
        }
        caches.push(values(&dir));
    }
    assert_eq!(caches[0].len(), caches[1].len());
    let diff = caches[0].iter().zip(&caches[1]).map(|(a, b)| (a - b).abs()).fold(0f32, nan_wins_max);
    eprintln!("reference cache, 2 ranks against 1: max |difference| = {diff:e}");
    assert!(diff <= 1e-5, "{diff}");
}

/// The README's smoke job on 2 ranks: `mpirun -np 2 grpo train --config configs/smoke.toml` (rank 0 makes
/// the tiny model, the others wait for it; validation shared) completes and ends with the weights of
/// one process.
#[test]
fn the_smoke_job_runs_on_two_ranks_as_on_one() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let mut last = Vec::new();
    for np in [1, 2] {
        let out = d.path().join(format!("smoke-np{np}"));
        let o = grpo(np)
            .current_dir(common::root())
            .args(["-q", "train", "--config", "configs/smoke.toml", "--set"])
            .arg(format!("train.output_dir=\"{}\"", out.display()))
            .arg("--set")
            .arg(format!("model.path=\"{}\"", out.join("tiny-llama").display()))
            .output()
            .unwrap();
        assert!(o.status.success(), "np {np}: {}", String::from_utf8_lossy(&o.stderr));
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
        assert_eq!(summary["status"], "complete", "np {np}: {summary}");
        last.push(weights(&out.join("checkpoints/step-00000004")));
    }
    let diff = max_diff(&last[0], &last[1]);
    eprintln!("smoke job: max |w1 - w2| after 4 steps = {diff:e}");
    assert!(diff <= 1e-5, "{diff}");
}

/// SIGTERM to every rank (as SLURM's `scancel --signal=TERM` and srun send it; Open MPI's mpirun, signalled
/// itself, kills the ranks 1 s after passing it on, before a step can finish under load): the ranks agree
/// to stop after the same step, the checkpoint of that step is written whole (every rank's optimiser shard),
/// the summary says stopped, and mpirun ends within a minute with the ranks' stop status, 75.
#[test]
fn sigterm_stops_every_rank_after_the_same_step_with_a_whole_checkpoint() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let cfg = config(d.path(), &model, OBJECTIVES[0].1, 1000);
    let (mut job, metrics) = long_job(d.path(), &cfg);
    let ranks = ranks(&job);
    assert_eq!(ranks.len(), 2, "mpirun's children: {ranks:?}");
    std::process::Command::new("kill").arg("-TERM").args(&ranks).status().unwrap();
    let sent = Instant::now();
    let status = end_within_a_minute(&mut job, "after SIGTERM");
    eprintln!("stopped {:?} after SIGTERM, status {status:?}", sent.elapsed());
    assert_eq!(status.code(), Some(75), "mpirun passes on the ranks' stop status");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.path().join("out/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "stopped", "{summary}");
    let steps = common::read_jsonl(&metrics).len();
    let latest = std::fs::read_to_string(d.path().join("out/checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step-{steps:08}"), "the checkpoint of the last step every rank made");
    check_shards(&step_dir(d.path(), steps), 2);
}

/// A validation longer than the collective timeout (GRPO_DIST_TIMEOUT_S = 5 s, a validation of about 10 s
/// on one process): the ranks each generate a share of the problems and wait for each other in short
/// rounds, not in one bounded collective, so the run completes with the score of one process.
#[test]
fn a_validation_longer_than_the_collective_timeout_completes() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let mut scores = Vec::new();
    for np in [1, 2] {
        let out = d.path().join(format!("np{np}"));
        let started = Instant::now();
        let o = grpo(np)
            .current_dir(common::root())
            .env("GRPO_DIST_TIMEOUT_S", "5")
            .args(["train", "--config", "configs/smoke.toml", "--set"])
            .arg(format!("train.output_dir=\"{}\"", out.display()))
            .arg("--set")
            .arg(format!("model.path=\"{}\"", d.path().join("tiny-llama").display()))
            // No reference (beta 0): its cache's rounds take seconds each on a loaded machine's debug build.
            .args(["--set", "train.max_steps=1", "--set", "objective.beta=0.0", "--set", "validation.limit=10"])
            .args(["--set", &format!("validation.max_new_tokens={VALIDATION_TOKENS}")])
            .output()
            .unwrap();
        assert!(o.status.success(), "np {np}: {}", String::from_utf8_lossy(&o.stderr));
        let log = String::from_utf8_lossy(&o.stderr);
        let said = log.lines().filter(|l| l.contains("validation on")).collect::<Vec<_>>().join("\n");
        eprintln!("np {np}: the run took {:?}; {said}", started.elapsed());
        let secs: f64 = said.rsplit_once('(').and_then(|(_, s)| s.strip_suffix(" s)")).unwrap().parse().unwrap();
        if np == 1 {
            assert!(secs > 6.0, "the validation must take longer than the timeout, it took {secs} s: {said}");
        }
        let metrics = common::read_jsonl(&out.join("metrics.jsonl"));
        scores.push(metrics[0]["validation/score"].as_f64().expect("a validation score"));
        let records = std::fs::read_to_string(out.join("validation/step-00000001-aime24.jsonl")).unwrap();
        assert_eq!(records.lines().count(), 10, "rank 0 writes every problem's record");
    }
    assert!((scores[0] - scores[1]).abs() < 1e-9, "{scores:?}");
}

/// New tokens per validation problem in [`a_validation_longer_than_the_collective_timeout_completes`]:
/// enough for the tiny model's validation of 10 problems to take over 10 s on one process (a debug build).
const VALIDATION_TOKENS: usize = 1200;

/// `rollout.generation_ranks`: `extra` lines of `[rollout]` on `np` ranks whose last `generators` generate,
/// the run of `steps` steps in `dir`; its metrics.jsonl and its log (`-v`).
fn generation_run(
    dir: &Path,
    setup: &(PathBuf, PathBuf),
    np: usize,
    steps: usize,
    extra: &str,
) -> (Vec<serde_json::Value>, String) {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = rollout_config(dir, &setup.0, &setup.1, steps, extra);
    let o = grpo(np).args(["-v", "train", "--config"]).arg(cfg).output().unwrap();
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "np {np} {extra:?}: {log}");
    (common::read_jsonl(&dir.join("out/metrics.jsonl")), log)
}

/// At max_staleness = 0 a generation rank answers each step with the step's own policy, so one trainer and
/// one generation rank train what one process trains (the same answers, streams seeded by the question),
/// and so do two trainers (data parallel among themselves, the world split) and one generation rank. The
/// generation rank's weights are checked against the trainer's after every transfer (checksums).
#[test]
fn generation_ranks_at_staleness_0_equal_one_process() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let setup = rollout_setup(d.path());
    let (m1, _) = generation_run(&d.path().join("one"), &setup, 1, 3, "");
    for np in [2, 3] {
        let dir = d.path().join(format!("np{np}"));
        let (m, log) = generation_run(&dir, &setup, np, 3, "generation_ranks = 1");
        let diff = max_diff(&weights(&step_dir(&d.path().join("one"), 3)), &weights(&step_dir(&dir, 3)));
        eprintln!("np {np}: max |w1 - w| after 3 steps = {diff:e}");
        assert!(diff <= 1e-5, "np {np}: {diff}");
        assert_eq!(m.len(), 3);
        for (a, b) in m1.iter().zip(&m) {
            for k in ["loss", "rollout/reward_mean", "rollout/mean_length"] {
                let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
                assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "np {np} {k}: 1 process {x}, generation rank {y}");
            }
            assert_eq!(b["rollout/staleness"], serde_json::json!([32]), "np {np}: every answer of lag 0");
            assert_eq!(b["rollout/dropped_stale"], 0);
            assert!(a.get("rollout/staleness").is_none(), "one process writes no overlap metrics");
        }
        let verified = log.matches("(checksum as sent)").count();
        assert_eq!(verified, 3 * (np - 1), "np {np}: every trainer checks every reply's weights:\n{log}");
    }
}

/// At max_staleness = 1 step t trains on answers of the policy of step t - 1 (step 0's of the starting
/// policy), never older, and nothing is dropped; a run resumed from its step-2 checkpoint asks again for
/// what was in flight and keeps the bound.
#[test]
fn generation_ranks_at_staleness_1_lag_one_step_and_resume() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let setup = rollout_setup(d.path());
    let dir = d.path().join("k1");
    let extra = "generation_ranks = 1\nmax_staleness = 1";
    let (m, _) = generation_run(&dir, &setup, 2, 2, extra);
    let lags: Vec<_> = m.iter().map(|s| s["rollout/staleness"].clone()).collect();
    assert_eq!(lags, vec![serde_json::json!([32, 0]), serde_json::json!([0, 32])]);
    for s in &m {
        assert_eq!(s["rollout/dropped_stale"], 0, "{s}");
        for k in ["rollout/train_time", "rollout/trainer_idle", "rollout/generator_idle"] {
            assert!(s[k].as_f64().is_some_and(|x| x >= 0.0), "{k}: {s}");
        }
    }
    let cfg = rollout_config(&dir, &setup.0, &setup.1, 4, extra);
    let o = grpo(2).args(["-q", "train", "--config"]).arg(cfg).args(["--resume", "auto"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = common::read_jsonl(&dir.join("out/metrics.jsonl"));
    assert_eq!(m.len(), 4);
    // Resumed at step 2: its first step's answers come from the checkpoint's own policy.
    assert_eq!(m[2]["rollout/staleness"], serde_json::json!([32, 0]));
    assert_eq!(m[3]["rollout/staleness"], serde_json::json!([0, 32]));
}

/// A generation rank killed mid-run stops the trainer within a minute, the job failing.
#[test]
fn a_killed_generation_rank_stops_the_job_within_a_minute() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let setup = rollout_setup(d.path());
    let cfg = rollout_config(d.path(), &setup.0, &setup.1, 100_000, "generation_ranks = 1\nmax_staleness = 1");
    let mut job = grpo(2)
        .args(["-q", "train", "--config"])
        .arg(cfg)
        .args(["--set", "train.save_every=0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = d.path().join("out/metrics.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |s| s.lines().count() < 1) {
        assert!(t0.elapsed() < Duration::from_secs(300), "no step finished");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The generation rank is the last one mpirun started.
    let victim = ranks(&job).into_iter().last().expect("a rank process");
    std::process::Command::new("kill").args(["-KILL", &victim]).status().unwrap();
    let status = end_within_a_minute(&mut job, "after the generation rank was killed");
    assert!(!status.success(), "the job ended successfully after its generation rank was killed");
}

/// generation_ranks must leave a rank to train.
#[test]
fn generation_ranks_need_a_trainer() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let (model, questions) = rollout_setup(d.path());
    let cfg = rollout_config(d.path(), &model, &questions, 1, "generation_ranks = 2");
    let o = grpo(2).args(["-q", "train", "--config"]).arg(cfg).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("rollout.generation_ranks = 2 must be below the job's 2 ranks"), "{err}");
}

/// With LoRA the generation rank receives the adapters alone (the base weights are the model both load),
/// and trains what one process trains.
#[test]
fn a_lora_run_sends_the_generation_rank_its_adapters_alone() {
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let setup = rollout_setup(d.path());
    let lora = "[model.lora]\nr = 4\nalpha = 8";
    let (m1, _) = generation_run(&d.path().join("one"), &setup, 1, 2, lora);
    let (m2, log) = generation_run(&d.path().join("two"), &setup, 2, 2, &format!("generation_ranks = 1\n{lora}"));
    // One layer, seven projections, an A and a B each.
    assert!(log.contains("sent the weights of version 0: 14 tensors,"), "{log}");
    for (a, b) in m1.iter().zip(&m2) {
        let (x, y) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "loss: 1 process {x}, generation rank {y}");
    }
}

/// A rank whose native sampling takes longer than the collective timeout beyond the other's keeps its place
/// in the waiting rounds at every decode step and behaviour micro-batch: the step completes. One question on
/// 2 ranks: rank 0 samples its 8 answers of 256 tokens one at a time while rank 1, with no question, waits in
/// the rounds all that time, and then, with no group to train on, waits in the gradient's all-reduce while
/// rank 0 trains. So the sampling must take well over the limit and the training well under it: a model of
/// one narrow layer over SmolLM2's 49k-token vocabulary, sampled with a nucleus (top_p < 1 sorts the
/// vocabulary at every token) and trained in one micro-batch, samples for about 33 s and trains for about
/// 4 s with this test build, around `GRPO_DIST_TIMEOUT_S=12`: a margin of about 3 on either side for a loaded
/// machine (CI runs these tests side by side on 2 cores).
#[test]
fn a_rank_sampling_longer_than_the_collective_timeout_does_not_end_the_run() {
    const TIMEOUT_S: u64 = 12;
    let Some(_) = mpirun() else { return };
    let d = tempfile::tempdir().unwrap();
    let (_, questions) = rollout_setup(d.path());
    let text = format!(
        "[model]\npath = \"{dir}/tiny\"\ninit_tiny = {{ arch = \"llama\", tokenizer = \"{root}/data/tokenizers/smollm2\", \
         layers = 1, hidden = 16, heads = 2, kv_heads = 1, intermediate = 32, seed = 0 }}\n\
         [data]\nmax_prompt_tokens = 64\n[objective]\nname = \"grpo\"\nanchor = \"behaviour\"\n[optim]\nlr = 1e-4\n\
         [train]\noutput_dir = \"{dir}/out\"\nbatch_questions = 1\nmicro_batch_size = 8\nepochs = 0\nmax_steps = 1\nseed = 3\n\
         [rollout]\nn = 8\nmax_new_tokens = 256\ntop_p = 0.999\nbatch_size = 1\nquestions = \"{questions}\"\nprompt_template = \"{{problem}}\"\n\
         fallbacks = true\n",
        dir = d.path().display(),
        root = common::root().display(),
        questions = questions.display(),
    );
    let cfg = d.path().join("train.toml");
    std::fs::write(&cfg, text).unwrap();
    let o = grpo(2)
        .env("GRPO_DIST_TIMEOUT_S", TIMEOUT_S.to_string())
        .env("RAYON_NUM_THREADS", "1")
        .args(["-q", "train", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = common::read_jsonl(&d.path().join("out/metrics.jsonl"));
    let sampled = m[0]["rollout/generation_time"].as_f64().unwrap();
    let trained = m[0]["step_time"].as_f64().unwrap() - sampled;
    eprintln!("rank 0 sampled for {sampled:.1} s and trained for {trained:.1} s");
    assert!(sampled > TIMEOUT_S as f64, "rank 0 sampled for {sampled} s: the imbalance must pass the limit");
}
