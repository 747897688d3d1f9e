//! `grpo train --plan` against measured peaks: real training steps on the CPU at the tiny shape of
//! configs/smoke.toml and at SmolLM2-135M's, the child's peak RSS (`ru_maxrss` of the waited child)
//! against the plan's device total, which must be within 20%. Two steps: the plan is the steady state,
//! where the AdamW moments (made by the first update) exist.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

const RESPONSE_TOKENS: usize = 32;
const ANSWERS: usize = 8;

/// A two-step config: one question per step, its 8 answers truncated to 32 tokens in one micro-batch, f32 on the
/// CPU, no reference model (beta 0: the plan counts the reference's log-probs as cached).
fn write_config(dir: &Path, model: &str) -> PathBuf {
    let root = common::root();
    let text = format!(
        "[model]\n{model}\ndtype = \"f32\"\ndevice = \"cpu\"\n\
         [data]\ninputs = [\"{data}\"]\ngroup_size = {ANSWERS}\nmin_group_size = {ANSWERS}\nmax_prompt_tokens = 512\n\
         max_response_tokens = {RESPONSE_TOKENS}\noverlong = \"truncate\"\nshuffle = false\n\
         [objective]\nname = \"off_grpo\"\nbeta = 0.0\n\
         [optim]\nlr = 1e-5\n\
         [train]\noutput_dir = \"{out}\"\nbatch_questions = 1\nmicro_batch_size = {ANSWERS}\nmax_steps = 2\n",
        data = root.join("data/trajectories/ot3_math_x8_dev.jsonl").display(),
        out = dir.join("out").display(),
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Run `cmd` to its end and return its peak resident memory in bytes.
#[allow(clippy::zombie_processes, reason = "wait4 reaps the child (std's wait would not give its rusage)")]
fn peak_rss(mut cmd: Command) -> u64 {
    let child = cmd.spawn().expect("spawn grpo");
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our child, not yet waited; the pointers are valid for the call.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "grpo train failed: status {status}");
    usage.ru_maxrss as u64 * 1024 // KiB on Linux
}

/// The plan's device peak in bytes for `config` with `sets` overrides.
fn planned(config: &Path, sets: &[String]) -> (u64, String) {
    let mut cmd = common::grpo();
    cmd.current_dir(common::root()).args(["train", "--plan", "--device-memory", "1TiB", "--config"]).arg(config);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.assert().success().get_output().stdout.clone();
    let text = String::from_utf8(out).unwrap();
    let line = text.lines().find(|l| l.starts_with("device peak:")).expect("a device peak line");
    let bytes = line.split('(').nth(1).and_then(|s| s.split(' ').next()).expect("(N bytes)");
    (bytes.parse().unwrap(), text)
}

/// Train one step with `config`, then compare its peak RSS with the plan of the micro-batch it ran.
fn check(dir: &Path, config: &Path, what: &str) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_grpo"));
    cmd.current_dir(common::root()).args(["-q", "train", "--config"]).arg(config);
    let measured = peak_rss(cmd);
    let metrics = common::read_jsonl(&dir.join("out/metrics.jsonl"));
    // A step is one question's 8 answers, each truncated to 32 tokens: its micro-batch is 8 x (prompt +
    // 32), which gives the longest prompt for the plan.
    let tokens: Vec<usize> = metrics.iter().map(|m| m["num_tokens"].as_u64().unwrap() as usize).collect();
    assert!(tokens.iter().all(|t| t % ANSWERS == 0), "{what}: {tokens:?} tokens are not 8 equal sequences");
    let tokens = *tokens.iter().max().unwrap();
    let prompt = tokens / ANSWERS - RESPONSE_TOKENS;
    let (plan, text) = planned(config, &[format!("data.max_prompt_tokens={prompt}")]);
    let ratio = plan as f64 / measured as f64;
    eprintln!("{what}: measured peak RSS {measured} B, planned {plan} B, plan / measured = {ratio:.3}\n{text}");
    assert!((0.8..=1.2).contains(&ratio), "{what}: plan {plan} B vs measured {measured} B ({ratio:.3})\n{text}");
}

#[test]
fn the_plan_is_within_20_percent_of_the_tiny_models_peak() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = common::root().join("data/tokenizers/smollm2");
    let model = format!(
        "path = \"{}\"\ninit_tiny = {{ arch = \"llama\", tokenizer = \"{}\", layers = 2, hidden = 64, heads = 4, \
         kv_heads = 2, intermediate = 128, seed = 0 }}",
        dir.path().join("model").display(),
        tokenizer.display()
    );
    let config = write_config(dir.path(), &model);
    check(dir.path(), &config, "tiny");
}

#[test]
#[ignore = "slow: two SmolLM2-135M steps take about 3 minutes on 2 cores"]
fn the_plan_is_within_20_percent_of_smollm2s_peak() {
    let Some(model) = common::smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &format!("path = \"{}\"", model.display()));
    check(dir.path(), &config, "SmolLM2-135M");
}

#[test]
fn plan_runs_without_weights_and_names_what_to_change() {
    let root = common::root();
    let seven_b = root.join("configs/models/qwen2.5-7b-instruct.config.json");
    let plan = |extra: &[&str]| {
        let mut cmd = common::grpo();
        cmd.current_dir(&root).args(["train", "--config", "configs/openthinker3.toml", "--plan", "--model-config"]);
        cmd.arg(&seven_b).args(extra);
        String::from_utf8(cmd.assert().success().get_output().stdout.clone()).unwrap()
    };
    // The seed's config fits an 80 GB card with 10% to spare.
    let fits = plan(&["--device-memory", "72GiB"]);
    assert!(fits.contains("7.62B parameters") && fits.contains("fits"), "{fits}");
    assert!(fits.contains("optimizer state") && fits.contains("host: optim.offload"), "{fits}");
    // Beside it, the performance model's predicted step on both GPUs it knows.
    for gpu in ["H100 SXM", "A100 80GB"] {
        let line = fits.lines().find(|l| l.starts_with(&format!("predicted on {gpu}: step "))).expect(gpu);
        assert!(line.contains("tokens/s") && line.contains("MFU") && line.contains("attention at"), "{line}");
    }
    // One that does not fit exits with the documented status 3, advising only what the config has not set.
    let a = common::grpo()
        .current_dir(&root)
        .args([
            "train",
            "--config",
            "configs/openthinker3.toml",
            "--plan",
            "--device-memory",
            "40GiB",
            "--model-config",
        ])
        .arg(&seven_b)
        .assert()
        .code(3);
    let too_small = String::from_utf8(a.get_output().stdout.clone()).unwrap();
    assert!(too_small.contains("does NOT fit"), "{too_small}");
    let advice = too_small.lines().find(|l| l.starts_with("To fit, ")).expect("advice");
    for set in ["checkpoint_layers", "offload", "attention", "cache_reference"] {
        assert!(!advice.contains(set), "{set} is already set: {advice}");
    }
    assert!(advice.contains("micro_batch_size under 2") && advice.contains("validation.batch_size"), "{advice}");
    let err = String::from_utf8(a.get_output().stderr.clone()).unwrap();
    assert!(err.contains("does not fit"), "{err}");
    // A normal run makes the same plan before loading weights and stops when it does not fit.
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = root.join("data/tokenizers/smollm2");
    let model = format!(
        "path = \"{}\"\ninit_tiny = {{ arch = \"llama\", tokenizer = \"{}\" }}",
        dir.path().join("model").display(),
        tokenizer.display()
    );
    let config = write_config(dir.path(), &model);
    let out = common::grpo()
        .current_dir(&root)
        .args(["train", "--device-memory", "1MiB", "--config"])
        .arg(&config)
        .assert()
        .code(3)
        .get_output()
        .stderr
        .clone();
    let err = String::from_utf8(out).unwrap();
    assert!(err.contains("does not fit") && err.contains("checkpoint_layers"), "{err}");
    assert!(!dir.path().join("out/metrics.jsonl").exists());
}

/// The shipped configs: each has a `# plan: ARGS` line giving its model's shape (a config.json of
/// configs/models, or the tiny model it makes) and the memory of the device it is written for. Its plan
/// with those arguments fits, or the line says `does not fit because REASON` and the plan agrees.
#[test]
fn every_shipped_config_fits_the_device_it_is_written_for() {
    let root = common::root();
    let mut configs = Vec::new();
    for dir in ["configs", "configs/seed000", "configs/seed004"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                configs.push(path);
            }
        }
    }
    configs.sort();
    assert!(configs.len() >= 10, "{configs:?}");
    for path in &configs {
        let text = std::fs::read_to_string(path).unwrap();
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("# plan:"))
            .unwrap_or_else(|| panic!("{}: no `# plan: ARGS` line", path.display()));
        let (args, why) = match line.split_once("does not fit because") {
            Some((args, why)) => (args, Some(why.trim())),
            None => (line, None),
        };
        let out = common::grpo()
            .current_dir(&root)
            .args(["train", "--plan", "--config"])
            .arg(path)
            .args(args.split_whitespace())
            .output()
            .unwrap();
        let plan = String::from_utf8(out.stdout).unwrap();
        let verdict = plan.lines().find(|l| l.starts_with("device memory:")).unwrap_or_else(|| {
            panic!("{}: no verdict\n{plan}\n{}", path.display(), String::from_utf8_lossy(&out.stderr))
        });
        match why {
            None => assert!(verdict.contains(": fits,"), "{}: {verdict}\n{plan}", path.display()),
            Some(why) => {
                assert!(why.len() > 10, "{}: say why it does not fit", path.display());
                assert!(verdict.contains("does NOT fit"), "{}: it fits now: {verdict}", path.display());
            }
        }
    }
}

/// A model config.json with an absurd size is refused at once, naming the file and the key.
#[test]
fn an_absurd_model_shape_is_refused_by_name() {
    let root = common::root();
    let dir = tempfile::tempdir().unwrap();
    let seven_b = std::fs::read_to_string(root.join("configs/models/qwen2.5-7b-instruct.config.json")).unwrap();
    for (key, value) in [("num_hidden_layers", "1000000000"), ("vocab_size", "18446744073709551615")] {
        let mut shape: serde_json::Value = serde_json::from_str(&seven_b).unwrap();
        shape[key] = serde_json::from_str(value).unwrap();
        let file = dir.path().join(format!("{key}.json"));
        std::fs::write(&file, shape.to_string()).unwrap();
        let out = common::grpo()
            .current_dir(&root)
            .args(["train", "--config", "configs/openthinker3.toml", "--plan", "--device-memory", "80GiB"])
            .arg("--model-config")
            .arg(&file)
            .timeout(std::time::Duration::from_secs(20))
            .assert()
            .failure()
            .get_output()
            .stderr
            .clone();
        let err = String::from_utf8(out).unwrap();
        assert!(err.contains(&format!("{key}.json: field `{key}`: {value}")), "{err}");
    }
}

/// `--world-size N` (or the launcher's WORLD_SIZE, which the flag overrides): the memory per rank with
/// the optimizer state sharded over N ranks (ZeRO-1). Without offloading the optimizer state, the seed's
/// 7B recipe fits 8 x 80 GB: as written (2 answers per micro-batch) within an H100's 79.6 GiB
/// (nvidia-smi's 81,559 MiB) with under 4% to spare, and with 1 answer per micro-batch within 72 GiB
/// (10% to spare); the predicted communication is printed.
#[test]
fn the_seed_recipe_fits_eight_gpus_without_offload() {
    let root = common::root();
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        let mut cmd = common::grpo();
        cmd.current_dir(&root).args(["train", "--config", "configs/openthinker3.toml", "--plan", "--model-config"]);
        cmd.arg(root.join("configs/models/qwen2.5-7b-instruct.config.json"));
        cmd.args(["--set", "optim.offload=false"]).args(extra);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        (out.status.code(), String::from_utf8(out.stdout).unwrap())
    };
    let (h100, spare) = (["--device-memory", "81559MiB"], ["--device-memory", "72GiB"]);
    let (code, one) = run(&h100, &[]);
    assert_eq!(code, Some(3), "one GPU without offload does not fit:\n{one}");
    let (code, eight) = run(&[&h100[..], &["--world-size", "8"]].concat(), &[]);
    assert_eq!(code, Some(0), "{eight}");
    let (code, tight) = run(&[&spare[..], &["--world-size", "8"]].concat(), &[]);
    assert_eq!(code, Some(3), "{tight}");
    let one_answer = ["--world-size", "8", "--set", "train.micro_batch_size=1"];
    let (code, spared) = run(&[&spare[..], &one_answer].concat(), &[]);
    assert_eq!(code, Some(0), "{spared}");
    assert!(eight.contains("per rank of 8") && eight.contains(" / 8 ranks (ZeRO-1)"), "{eight}");
    assert!(eight.contains("8 ranks: ZeRO-1 reduce-scatter + all-gather") && eight.contains("over NVLink"), "{eight}");
    // The launcher's world size is taken when the flag is absent; the flag wins over it.
    let torchrun = [("RANK", "0"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "0")];
    let (code, launched) = run(&h100, &torchrun);
    assert_eq!((code, launched.contains("per rank of 8")), (Some(0), true), "{launched}");
    let (code, flag) = run(&[&h100[..], &["--world-size", "1"]].concat(), &torchrun);
    assert_eq!(code, Some(3), "{flag}");
}

/// Issue 28's goal for the seed's shape, in the performance model: with the tensor-core kernels and dq by
/// atomics (`model.attention = "wgmma"`, the `mma` kernels on the A100), attention at >= 40% of the
/// tensor-core peak and the step at >= 35% MFU on both GPUs the plan predicts for.
#[test]
fn the_seed_step_meets_the_attention_and_mfu_targets_in_the_model() {
    let root = common::root();
    let mut cmd = common::grpo();
    cmd.current_dir(&root).args(["train", "--config", "configs/openthinker3.toml", "--plan", "--model-config"]);
    cmd.arg(root.join("configs/models/qwen2.5-7b-instruct.config.json"));
    cmd.args(["--set", "model.attention=wgmma", "--set", "model.deterministic_attention=false"]);
    let out = String::from_utf8(cmd.assert().success().get_output().stdout.clone()).unwrap();
    // "predicted on H100 SXM: step 686.0 s, 6878 tokens/s; MFU 37.0%, attention at 42.5% of peak (...)"
    let percent = |line: &str, before: &str| -> f64 {
        let rest = &line[line.find(before).unwrap_or_else(|| panic!("{before} in {line}")) + before.len()..];
        rest[..rest.find('%').unwrap()].trim().parse().unwrap()
    };
    for gpu in ["H100 SXM", "A100 80GB"] {
        let line = out.lines().find(|l| l.starts_with(&format!("predicted on {gpu}: step "))).expect(gpu);
        let (mfu, attention) = (percent(line, "MFU "), percent(line, "attention at "));
        assert!(mfu >= 35.0 && attention >= 40.0, "{gpu}: MFU {mfu}%, attention {attention}%: {line}");
    }
}
