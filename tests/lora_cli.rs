//! `grpo train` with `[model.lora]`: every objective on the bundled smoke data, checkpoints in PEFT's
//! format, the exact resume of a LoRA run (with its swapped reference and anchor snapshot), and the adapter
//! read back by `grpo logprobs --adapter` and merged by `grpo export --merge`.

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;

const TINY: &str = "{ arch = \"qwen2\", tokenizer = \"TOK\", layers = 2, hidden = 32, heads = 4, kv_heads = 2, intermediate = 64, seed = 3 }";

/// A small LoRA config: a tiny Qwen2 (created on first use in `dir`), adapters of rank 4 on every
/// projection, 4 answers per question cut to 24 tokens, 2 questions per step.
fn lora_config(dir: &Path) -> PathBuf {
    let tiny = TINY.replace("TOK", &common::root().join("data/tokenizers/smollm2").display().to_string());
    let data = common::root().join("data/trajectories/ot3_math_x8_dev.jsonl");
    let cfg = format!(
        r#"
[model]
path = "{model}"
init_tiny = {tiny}

[model.lora]
r = 4
alpha = 8

[data]
inputs = ["{data}"]
group_size = 4
max_response_tokens = 24
prepared_dir = "{prepared}"

[optim]
lr = 1e-2

[train]
batch_questions = 2
micro_batch_size = 3
epochs = 1
max_steps = 2
seed = 7
keep_last = 10
"#,
        model = dir.join("model").display(),
        data = data.display(),
        prepared = dir.join("prepared").display(),
    );
    let p = dir.join("lora.toml");
    std::fs::write(&p, cfg).unwrap();
    p
}

fn train(config: &Path, out: &Path, sets: &[&str], extra: &[&str]) -> assert_cmd::assert::Assert {
    let mut cmd = common::grpo();
    cmd.current_dir(common::root()).args(["-q", "train", "--config"]).arg(config);
    cmd.arg("--set").arg(format!("train.output_dir=\"{}\"", out.display()));
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    cmd.args(extra).assert()
}

fn metrics(out: &Path) -> Vec<Value> {
    common::read_jsonl(&out.join("metrics.jsonl"))
        .into_iter()
        .map(|mut v| {
            for k in ["step_time", "tokens_per_sec"] {
                v.as_object_mut().unwrap().remove(k);
            }
            v
        })
        .collect()
}

fn ck(out: &Path, step: usize) -> PathBuf {
    out.join(format!("checkpoints/step-{step:08}"))
}

#[test]
fn every_objective_trains_adapters_only_and_checkpoints_them_in_peft_format() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lora_config(dir.path());
    let runs: &[(&str, &[&str])] = &[
        ("grpo", &["objective.beta=0.1", "model.cache_reference=false"]),
        ("off_grpo", &["objective.bias=0.5", "objective.beta=0.1"]),
        ("gspo", &[]),
        (
            "rec",
            &["objective.clip_mode=\"ring\"", "objective.importance_weight=true", "objective.anchor=\"reference\""],
        ),
        ("opmd", &["objective.anchor=\"snapshot\"", "objective.anchor_every=1"]),
        ("asymre", &["objective.beta=0.05", "objective.kl_estimator=\"k2\"", "model.checkpoint_layers=true"]),
        ("red_drop", &[]),
        ("red_weight", &[]),
        ("oapl", &[]),
        ("sft", &["objective.beta=0.1"]),
        ("cispo", &["objective.eps_high=0.28"]),
    ];
    let mut trained = 0;
    for (i, (name, sets)) in runs.iter().enumerate() {
        let out = dir.path().join(format!("out-{i}-{name}"));
        let mut all = vec![format!("objective.name=\"{name}\"")];
        all.extend(sets.iter().map(|s| s.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        train(&cfg, &out, &all, &[]).success();
        let m = metrics(&out);
        assert_eq!(m.len(), 2, "{name}");
        let stepped = m.iter().any(|l| l["grad_norm"].as_f64().unwrap() > 0.0);
        trained += stepped as usize;
        for line in &m {
            let (loss, norm) = (line["loss"].as_f64().unwrap(), line["grad_norm"].as_f64().unwrap());
            assert!(loss.is_finite() && norm.is_finite(), "{name}: {line}");
            assert_eq!(line["skipped"], false, "{name}: {line}");
        }
        if sets.iter().any(|s| s.starts_with("objective.beta")) {
            // Step 1's policy is the base model (B = 0), and so is the reference: no KL yet.
            assert!(m[0]["kl"].as_f64().unwrap().abs() < 1e-6, "{name}: {}", m[0]);
            // Once the adapters moved, the policy leaves the reference.
            let moved = m[0]["grad_norm"].as_f64().unwrap() > 0.0;
            assert_eq!(m[1]["kl"].as_f64().unwrap() > 0.0, moved, "{name}: {}", m[1]);
        }
        let c = ck(&out, 2);
        assert!(c.join("adapter_model.safetensors").is_file() && !c.join("model.safetensors").exists(), "{name}");
        // B starts at zero: it moved exactly when a step had a gradient.
        let bytes = std::fs::read(c.join("adapter_model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let b = st.tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight").unwrap();
        assert_eq!(b.data().iter().any(|&x| x != 0), stepped, "{name}");
    }
    assert!(trained >= 3, "only {trained} runs had a gradient");
    // The adapter files as PEFT names them: A [r, in], B [out, r], and the optimiser state of the adapters only.
    let c = ck(&dir.path().join("out-0-grpo"), 2);
    let config: Value = serde_json::from_slice(&std::fs::read(c.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["task_type"], "CAUSAL_LM");
    assert_eq!((config["r"].as_u64(), config["lora_alpha"].as_f64()), (Some(4), Some(8.0)));
    assert_eq!(config["target_modules"].as_array().unwrap().len(), 7);
    let bytes = std::fs::read(c.join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let a = st.tensor("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight").unwrap();
    let b = st.tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").unwrap();
    assert_eq!((a.shape(), b.shape()), (&[4, 64][..], &[32, 4][..]));
    assert_eq!(st.names().len(), 2 * 7 * 2);
    let bytes = std::fs::read(c.join("optimizer.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert!(st.names().iter().all(|n| n.contains(".lora_")), "{:?}", st.names());
}

/// A LoRA run with its reference swapped every 2 steps and an anchor snapshot every 2 steps, killed after
/// step 3 and resumed: the same adapters, optimiser state and metrics as the run that went through.
#[test]
fn a_resumed_lora_run_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lora_config(dir.path());
    let sets = [
        "objective.name=\"oapl\"",
        "objective.anchor_every=2",
        "objective.beta2=0.05",
        "train.max_steps=4",
        "train.save_every=1",
    ];
    let swap = ["objective.name=\"grpo\"", "objective.beta=0.1", "train.reference_swap_every=2", "train.max_steps=4"];
    let swap = [&swap[..], &["train.save_every=1", "model.cache_reference=false"]].concat();
    for (what, sets) in [("snapshot", &sets[..]), ("reference swap", &swap[..])] {
        let a = dir.path().join(format!("a-{what}"));
        train(&cfg, &a, sets, &[]).success();
        let c = dir.path().join(format!("c-{what}"));
        train(&cfg, &c, sets, &[]).success();
        std::fs::remove_dir_all(ck(&c, 4)).unwrap();
        std::fs::write(c.join("checkpoints/latest"), "step-00000003").unwrap();
        let lines: Vec<String> =
            std::fs::read_to_string(c.join("metrics.jsonl")).unwrap().lines().map(String::from).collect();
        std::fs::write(c.join("metrics.jsonl"), lines[..3].join("\n") + "\n").unwrap();
        train(&cfg, &c, sets, &["--resume", "auto"]).success();
        for f in ["adapter_model.safetensors", "optimizer.safetensors"] {
            let (x, y) = (std::fs::read(ck(&a, 4).join(f)).unwrap(), std::fs::read(ck(&c, 4).join(f)).unwrap());
            assert!(x == y, "{what}: {f} differs from the uninterrupted run");
        }
        assert_eq!(metrics(&a), metrics(&c), "{what}");
    }
    // The swapped reference is kept as a frozen adapter: the checkpoint stores the adapters only.
    let r = ck(&dir.path().join("a-reference swap"), 3).join("reference.safetensors");
    let bytes = std::fs::read(r).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert!(st.names().iter().all(|n| n.contains(".lora_")), "{:?}", st.names());
}

/// A LoRA run (with adapter dropout) killed with SIGKILL wherever it happens to be once its second checkpoint
/// is written (mid-step, mid-save or between steps), then resumed with `--resume auto`: the same adapters, optimiser
/// state and metrics as the run that went through.
#[test]
fn a_lora_run_killed_with_sigkill_resumes_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lora_config(dir.path());
    // With dropout on the adapters' input: the resumed steps draw the same masks.
    let sets = [
        "objective.name=\"off_grpo\"",
        "objective.beta=0.05",
        "train.max_steps=6",
        "train.save_every=1",
        "model.lora.dropout=0.1",
    ];
    let a = dir.path().join("a");
    train(&cfg, &a, &sets, &[]).success();
    let c = dir.path().join("c");
    let mut cmd = common::command();
    cmd.current_dir(common::root()).args(["-q", "train", "--config"]).arg(&cfg);
    cmd.arg("--set").arg(format!("train.output_dir=\"{}\"", c.display()));
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    let mut child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !ck(&c, 2).exists() {
        assert!(std::time::Instant::now() < deadline, "no second checkpoint within 120 s");
        if child.try_wait().unwrap().is_some() {
            break; // finished before it could be killed: the resume below has nothing to do
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(!ck(&c, 6).exists(), "the run was not interrupted: no kill tested");
    train(&cfg, &c, &sets, &["--resume", "auto"]).success();
    for f in ["adapter_model.safetensors", "optimizer.safetensors"] {
        let (x, y) = (std::fs::read(ck(&a, 6).join(f)).unwrap(), std::fs::read(ck(&c, 6).join(f)).unwrap());
        assert!(x == y, "{f} differs from the uninterrupted run");
    }
    assert_eq!(metrics(&a), metrics(&c));
}

/// `grpo logprobs --model BASE --adapter CK`: a trained adapter changes the base model's log-probs;
/// `grpo export --merge` writes a whole model whose log-probs are the adapter model's; `grpo eval --adapter`
/// generates with it.
#[test]
fn the_merged_export_equals_the_adapter_model() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lora_config(dir.path());
    let out = dir.path().join("out");
    // sft: every step has a gradient.
    train(&cfg, &out, &["objective.name=\"sft\""], &[]).success();
    let (model, adapter) = (dir.path().join("model"), ck(&out, 2));
    let input = dir.path().join("in.jsonl");
    let lines = [r#"{"text": "The answer is 42, since 6 times 7 is 42."}"#, r#"{"prompt": "1+1?", "response": "2"}"#];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let logprobs = |model: &Path, adapter: Option<&Path>| -> Vec<f64> {
        let output = dir.path().join("lp.jsonl");
        let mut c = common::grpo();
        c.args(["-q", "logprobs", "--model"]).arg(model).arg("--input").arg(&input).arg("--output").arg(&output);
        if let Some(a) = adapter {
            c.arg("--adapter").arg(a);
        }
        c.assert().success();
        common::read_jsonl(&output)
            .iter()
            .flat_map(|l| l["logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect::<Vec<_>>())
            .collect()
    };
    let (base, adapted) = (logprobs(&model, None), logprobs(&model, Some(&adapter)));
    assert_ne!(base, adapted, "the trained adapter changes nothing");
    // The adapter folder alone: its config names the base model.
    assert_eq!(logprobs(&adapter, None), adapted);
    let merged = dir.path().join("merged");
    // The base model is the one the adapter config names.
    common::grpo()
        .args(["-q", "export", "--merge", "--dtype", "f32", "--adapter"])
        .arg(&adapter)
        .arg("--out")
        .arg(&merged)
        .assert()
        .success();
    assert!(merged.join("model.safetensors").is_file() && merged.join("tokenizer.json").is_file());
    let m = logprobs(&merged, None);
    let d = m.iter().zip(&adapted).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    assert!(d < 1e-4, "merged log-probs differ from the adapter model's by {d}");
    let e = common::grpo().args(["-q", "export", "--adapter"]).arg(&adapter).args(["--out", "x"]).assert().failure();
    assert!(String::from_utf8_lossy(&e.get_output().stderr).contains("--merge"));

    let eval_out = dir.path().join("eval");
    let args = ["-q", "eval", "--bench", "aime25", "--limit", "2", "--n", "1", "--max-new-tokens", "8"];
    common::grpo()
        .args(args)
        .arg("--model")
        .arg(&model)
        .arg("--adapter")
        .arg(&adapter)
        .arg("--out")
        .arg(&eval_out)
        .assert()
        .success();
    assert_eq!(common::read_jsonl(&eval_out.join("generations.jsonl")).len(), 2);
}

/// The seed's 7B recipe with LoRA fits a 48 GB card without offload: the base weights in bf16, the
/// gradients and optimiser state of the adapters only, no reference copy; full fine-tuning does not.
#[test]
fn the_lora_recipe_fits_a_48_gb_card_where_full_fine_tuning_does_not() {
    let plan = |config: &str, sets: &[&str]| -> String {
        let mut c = common::grpo();
        c.current_dir(common::root()).args(["train", "--plan", "--config", config]);
        c.args(["--model-config", "configs/models/qwen2.5-7b-instruct.config.json", "--device-memory", "48GiB"]);
        for s in sets {
            c.args(["--set", s]);
        }
        String::from_utf8(c.output().unwrap().stdout).unwrap()
    };
    let gib = |text: &str, component: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(component)).unwrap_or_else(|| panic!("{component}\n{text}"));
        line[component.len()..].split_whitespace().next().unwrap().parse().unwrap()
    };
    let lora = plan("configs/openthinker3-lora.toml", &[]);
    assert!(lora.contains("device memory: 48.00 GiB: fits"), "{lora}");
    assert!(lora.contains("host peak (optimizer state and update): 0.00 GiB"), "{lora}");
    assert!((14.0..14.5).contains(&gib(&lora, "weights")), "{lora}");
    for component in ["gradients (f32 accumulator)", "optimizer state", "LoRA adapters (f32)"] {
        assert!(gib(&lora, component) < 1.0, "{component}\n{lora}");
    }
    assert_eq!(gib(&lora, "reference model"), 0.0, "{lora}");
    // The same recipe without [model.lora] (the seed's config, validated with the LoRA run's batch).
    let full = plan("configs/openthinker3.toml", &["validation.batch_size=4"]);
    assert!(full.contains("device memory: 48.00 GiB: does NOT fit"), "{full}");
}

/// On-policy GRPO with LoRA on the digits questions (gold answer 7): the native sampler runs the adapter
/// model, and a lagged run (sampling copy every 2 steps, two updates per
/// batch, a reference swapped every 3 steps with a KL term) resumed from step 3 ends exactly as the run
/// that went through.
#[test]
fn lora_rollouts_sample_from_the_adapter_model_and_resume_exactly() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("model");
    let questions = common::digits_model_and_questions(d.path(), &model);
    let config = |out: &Path, steps: usize| -> PathBuf {
        let text = format!(
            r#"[model]
path = "{model}"
lora = {{ r = 4, alpha = 16 }}
[data]
max_prompt_tokens = 64
[objective]
name = "grpo"
anchor = "behaviour"
[optim]
lr = 0.03
grad_clip = 0.0
[train]
output_dir = "{out}"
batch_questions = 4
micro_batch_size = 16
epochs = 0
max_steps = {steps}
seed = 3
keep_last = 20
[rollout]
n = 8
max_new_tokens = 2
batch_size = 32
questions = "{questions}"
prompt_template = "{{problem}}"
fallbacks = true
"#,
            model = model.display(),
            out = out.display(),
            questions = questions.display(),
        );
        let p = out.with_extension("toml");
        std::fs::write(&p, text).unwrap();
        p
    };
    let run = |cfg: &Path, extra: &[&str]| {
        common::grpo().current_dir(common::root()).args(["-q", "train", "--config"]).arg(cfg).args(extra).assert()
    };
    // The sampler's log-probs of its answers are the policy's own at every step, the adapters moving: the
    // native sampler runs the adapter model. (The tiny model's frozen lm_head, std 0.02 behind the final
    // RMSNorm, keeps its logits within about 0.1 whatever the adapters do: its reward cannot rise much
    // without training the head, so learning is not asked of it here.)
    let on = d.path().join("on");
    run(&config(&on, 6), &[]).success();
    let m = metrics(&on);
    assert_eq!(m.len(), 6);
    for line in &m {
        for k in ["ratio_min", "ratio_max"] {
            assert!((line[k].as_f64().unwrap() - 1.0).abs() < 1e-4, "{k}: {line}");
        }
    }
    assert_ne!(m[0]["entropy"], m[5]["entropy"]);

    let lagged = [
        "--set",
        "rollout.sync_every=2",
        "--set",
        "rollout.updates_per_batch=2",
        "--set",
        "objective.beta=0.1",
        "--set",
        "train.reference_swap_every=3",
        "--set",
        "train.save_every=1",
    ];
    let (a, c) = (d.path().join("a"), d.path().join("c"));
    run(&config(&a, 5), &lagged).success();
    assert!(ck(&a, 3).join("sampler.safetensors").exists() && ck(&a, 3).join("reference.safetensors").exists());
    let cfg = config(&c, 5);
    run(&cfg, &lagged).success();
    for later in 4..=5 {
        std::fs::remove_dir_all(ck(&c, later)).unwrap();
    }
    std::fs::write(c.join("checkpoints/latest"), "step-00000003").unwrap();
    run(&cfg, &[&lagged[..], &["--resume", "auto"]].concat()).success();
    for f in ["adapter_model.safetensors", "optimizer.safetensors", "reference.safetensors"] {
        let (x, y) = (std::fs::read(ck(&a, 5).join(f)).unwrap(), std::fs::read(ck(&c, 5).join(f)).unwrap());
        assert!(x == y, "{f} differs from the uninterrupted run");
    }
    let strip = |out: &Path| -> Vec<Value> {
        metrics(out)
            .into_iter()
            .map(|mut v| {
                for k in ["rollout/generation_time", "rollout/tokens_per_sec"] {
                    v.as_object_mut().unwrap().remove(k);
                }
                v
            })
            .collect()
    };
    assert_eq!(strip(&a), strip(&c));
}

/// PEFT loads a grpo adapter (and transformers the merged export) with the log-probs grpo gives, where the
/// Python of GRPO_PEFT_PYTHON (else python3) has peft and transformers; skipped elsewhere.
#[test]
fn peft_loads_the_adapter_with_grpos_logprobs() {
    let python = std::env::var("GRPO_PEFT_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_peft = std::process::Command::new(&python).args(["-c", "import peft, transformers, torch"]).output();
    if !has_peft.is_ok_and(|o| o.status.success()) {
        eprintln!("SKIPPED: {python} has no peft/transformers/torch (set GRPO_PEFT_PYTHON)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = lora_config(dir.path());
    let out = dir.path().join("out");
    train(&cfg, &out, &["objective.name=\"sft\""], &[]).success();
    let merged = dir.path().join("merged");
    common::grpo()
        .args(["-q", "export", "--merge", "--dtype", "f32", "--adapter"])
        .arg(ck(&out, 2))
        .arg("--out")
        .arg(&merged)
        .assert()
        .success();
    let status = std::process::Command::new(&python)
        .arg(common::root().join("scripts/check_peft_load.py"))
        .arg(dir.path().join("model"))
        .arg(ck(&out, 2))
        .arg(env!("CARGO_BIN_EXE_grpo"))
        .arg(&merged)
        .status()
        .unwrap();
    assert!(status.success(), "scripts/check_peft_load.py failed");
}

/// A tiny model at `a`, another of the same shapes and other weights at `b`, and an adapter of `a` at
/// `adapter` (its config names `a` as its base model).
fn two_bases_and_an_adapter(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use grpo::model::{self, lora};
    let (a, b, adapter) = (dir.join("a"), dir.join("b"), dir.join("adapter"));
    common::init_tiny("qwen2", "smollm2", &a);
    let cfg = model::ModelConfig::from_file(&a.join("config.json")).unwrap();
    let other =
        model::random_decoder(cfg.clone(), 99, candle_core::DType::F32, &candle_core::Device::Cpu, false).unwrap();
    let save = model::checkpoint::SaveOptions { tokenizer_dir: Some(a.clone()), ..Default::default() };
    model::save_checkpoint(&other, &b, &save, |_| Ok(())).unwrap();
    let opts = model::LoraOptions { r: 2, ..Default::default() };
    let t = lora::init_adapters(&cfg, &opts, 1, &candle_core::Device::Cpu).unwrap();
    std::fs::create_dir_all(&adapter).unwrap();
    lora::write_adapter(&adapter, &opts, Some(a.to_str().unwrap()), t).unwrap();
    (a, b, adapter)
}

#[test]
fn an_adapter_applied_to_another_base_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, adapter) = two_bases_and_an_adapter(dir.path());
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, r#"{"text": "one two three"}"#).unwrap();
    let logprobs = |base: &Path, adapter: &Path, extra: &[&str]| {
        let mut c = common::grpo();
        c.args(["-q", "logprobs", "--model"]).arg(base).arg("--adapter").arg(adapter).arg("--input").arg(&input);
        c.args(["--output"]).arg(dir.path().join("lp.jsonl")).args(extra).assert()
    };
    logprobs(&a, &adapter, &[]).success();
    let e = logprobs(&b, &adapter, &[]).failure();
    let err = String::from_utf8_lossy(&e.get_output().stderr).to_string();
    assert!(err.contains("adapter_config.json") && err.contains("trained on the base model"), "{err}");
    assert!(err.contains("--allow-base-mismatch"), "{err}");
    logprobs(&b, &adapter, &["--allow-base-mismatch"]).success();
    // A full model given as the adapter.
    let e = logprobs(&a, &b, &[]).failure();
    let err = String::from_utf8_lossy(&e.get_output().stderr).to_string();
    assert!(err.contains("a full model") && err.contains("--model"), "{err}");
}

#[test]
fn export_refuses_to_replace_an_existing_folder_without_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _, adapter) = two_bases_and_an_adapter(dir.path());
    let out = dir.path().join("merged");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let export = |out: &Path, extra: &[&str]| {
        let mut c = common::grpo();
        c.args(["-q", "export", "--merge", "--dtype", "f32", "--model"]).arg(&a).arg("--adapter").arg(&adapter);
        c.arg("--out").arg(out).args(extra).assert()
    };
    let e = export(&out, &[]).failure();
    let err = String::from_utf8_lossy(&e.get_output().stderr).to_string();
    assert!(err.contains("already holds files") && err.contains("--overwrite"), "{err}");
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
    export(&out, &["--overwrite"]).success();
    assert!(out.join("model.safetensors").is_file() && !out.join("notes.txt").exists());
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let e = export(&file, &[]).failure();
    assert!(String::from_utf8_lossy(&e.get_output().stderr).contains("is not a folder"));
}

/// A LoRA run says so in its log (the rank, alpha, targets and the share of the parameters trained), and
/// every run logs its version, directory and command line first.
#[test]
fn a_lora_run_logs_its_adapters() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lora_config(dir.path());
    let out = dir.path().join("log");
    let mut cmd = common::grpo();
    cmd.current_dir(common::root()).args(["train", "--config"]).arg(&cfg);
    cmd.arg("--set").arg(format!("train.output_dir=\"{}\"", out.display())).args(["--set", "train.max_steps=1"]);
    let o = cmd.assert().success();
    let err = String::from_utf8_lossy(&o.get_output().stderr).into_owned();
    let lora = err.lines().find(|l| l.contains("LoRA: rank ")).unwrap_or_else(|| panic!("{err}"));
    assert!(lora.contains("trainable parameters") && lora.contains("% of the base's"), "{lora}");
    assert!(
        err.contains(&format!("grpo {} in ", env!("CARGO_PKG_VERSION"))) && err.contains("train --config"),
        "{err}"
    );
}

/// A LoRA checkpoint resumed as a full fine-tune, and a full one resumed with `[model.lora]`, are refused
/// naming the checkpoint and what it holds, before the model is loaded.
#[test]
fn a_checkpoint_resumed_as_the_other_kind_of_run_says_what_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let lora = lora_config(dir.path());
    let text = std::fs::read_to_string(&lora).unwrap().replace("[model.lora]\nr = 4\nalpha = 8\n", "");
    let full = dir.path().join("full.toml");
    std::fs::write(&full, text).unwrap();
    let resume = ["--resume", "auto", "--allow-config-change"];
    for (first, then, holds) in [(&lora, &full, "it holds LoRA adapters"), (&full, &lora, "it holds whole weights")] {
        let out = dir.path().join(if first == &lora { "from-lora" } else { "from-full" });
        train(first, &out, &["train.max_steps=1"], &[]).success();
        let o = train(then, &out, &["train.max_steps=2"], &resume).failure();
        let err = String::from_utf8_lossy(&o.get_output().stderr).into_owned();
        assert!(err.contains(&format!("cannot resume from {}", ck(&out, 1).display())), "{err}");
        assert!(err.contains(holds) && err.contains("start a new run (--overwrite)"), "{err}");
    }
}
