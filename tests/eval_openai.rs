//! `grpo eval --engine openai` against a real OpenAI-compatible server: llama.cpp's, from the
//! llama-cpp-python package (`pip install 'llama-cpp-python[server]'`, installed by .ci/run), serving
//! SmolLM2-135M-Instruct (Q4_1 GGUF from ../shared) on the CPU on a loopback port. The prompts are
//! rendered with the chat template of the SmolLM2 folder the native tests use. Skips with a message when
//! the package, the GGUF or that folder is missing.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The name the server serves the model under.
const SERVED: &str = "smollm2-135m";

/// The served GGUF, from ../shared (beside the repository in CI).
fn gguf() -> Option<PathBuf> {
    let p = common::root().join("../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!("SKIPPED: {} is absent (../shared is needed)", p.display());
        None
    }
}

/// The Python that has llama-cpp-python's server: `GRPO_LLAMA_PYTHON`, else `python3`.
fn server_python() -> Option<String> {
    let py = std::env::var("GRPO_LLAMA_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import llama_cpp.server"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Some(py)
    } else {
        eprintln!(
            "SKIPPED: `{py} -c 'import llama_cpp.server'` failed: install llama.cpp's server with \
             `pip install 'llama-cpp-python[server]'` (.ci/run does), or set GRPO_LLAMA_PYTHON"
        );
        None
    }
}

/// A running server, stopped (killed and reaped) when dropped.
struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Drop for Server {
    /// Stops the server; when the test failed, prints the end of the server's log (a server that died in a
    /// request shows here as "connection refused").
    fn drop(&mut self) {
        if std::thread::panicking() {
            let exited = self.child.try_wait().ok().flatten();
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            eprintln!("llama.cpp's server (exit: {exited:?}), the end of its log:\n{}", tail.join("\n"));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// Completion requests the server has answered so far (uvicorn's access log).
    fn completions_served(&self) -> usize {
        std::fs::read_to_string(&self.log).unwrap_or_default().matches("POST /v1/completions").count()
    }
}

/// `python -m llama_cpp.server` with llama.cpp's extra weight buffers (its AMX and repacked layouts) turned
/// off: on a CPU with AMX (Sapphire Rapids and later) a pip-built llama.cpp puts the Q4_1 weights in its AMX
/// buffer and segfaults in the first decode (llama-cpp-python 0.3.36; llama.cpp's AMX path is known wrong for
/// Q4_0/Q4_1, ggml-org/llama.cpp#16315). The server has no flag for it, so the launcher sets the model
/// parameter `use_extra_bufts` before the server starts; on a build without the field it changes nothing.
const SERVER_LAUNCHER: &str = "\
import runpy, sys
import llama_cpp.llama_cpp as C
_default = C.llama_model_default_params
def _params():
    p = _default()
    p.use_extra_bufts = False
    return p
C.llama_model_default_params = _params
sys.argv[0] = 'llama_cpp.server'
runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)
";

/// Start llama.cpp's server on a free loopback port and wait until it answers (None, with the reason
/// printed, when it does not start).
fn start_server(py: &str, gguf: &Path, dir: &Path, extra: &[&str]) -> Option<Server> {
    let port = TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
    let log = dir.join("server.log");
    let out = std::fs::File::create(&log).ok()?;
    let child = Command::new(py)
        .args(["-c", SERVER_LAUNCHER, "--model"])
        .arg(gguf)
        .args(["--model_alias", SERVED, "--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--n_ctx", "2048", "--n_threads", "2", "--verbose", "false"])
        .args(extra)
        .stdout(out.try_clone().ok()?)
        .stderr(out)
        .spawn();
    let mut server = match child {
        Ok(child) => Server { child, port, log },
        Err(e) => {
            eprintln!("SKIPPED: cannot start `{py} -m llama_cpp.server`: {e}");
            return None;
        }
    };
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(120) {
        if let Ok(Some(status)) = server.child.try_wait() {
            let log = std::fs::read_to_string(&server.log).unwrap_or_default();
            eprintln!("SKIPPED: llama.cpp's server exited ({status}) at start:\n{log}");
            return None;
        }
        if std::net::TcpStream::connect(("127.0.0.1", server.port)).is_ok() {
            return Some(server);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    eprintln!("SKIPPED: llama.cpp's server did not listen within 120 s; log: {}", server.log.display());
    None
}

fn eval_openai(model: &Path, base_url: &str, out: &Path, extra: &[&str]) -> assert_cmd::assert::Assert {
    common::grpo()
        .args(["eval", "--bench", "math500", "--limit", "3", "--n", "2", "--temperature", "0"])
        .args(["--max-new-tokens", "24", "--engine", "openai", "--base-url", base_url, "--served-model", SERVED])
        .args(["--concurrency", "2"])
        .args(extra)
        .arg("--model")
        .arg(model)
        .arg("--out")
        .arg(out)
        .assert()
}

fn all_samples(gens: &[Value]) -> Vec<&Value> {
    gens.iter().flat_map(|g| g["samples"].as_array().unwrap()).collect()
}

#[test]
fn math500_through_llama_cpp_server_is_scored_resumed_and_failures_are_named() {
    let (Some(model), Some(gguf), Some(py)) = (common::smollm2(), gguf(), server_python()) else { return };
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = start_server(&py, &gguf, dir.path(), &[]) else { return };
    let out = dir.path().join("eval");
    let a = eval_openai(&model, &server.base_url(), &out, &[]).success();
    let stdout = String::from_utf8_lossy(&a.get_output().stdout).to_string();
    assert!(stdout.contains("math500"), "{stdout}");

    let gens = common::read_jsonl(&out.join("generations.jsonl"));
    assert_eq!(gens.len(), 3);
    for g in &gens {
        let s = g["samples"].as_array().unwrap();
        assert_eq!(s.len(), 2, "n = 2 samples per problem, whether or not the server honours n");
        assert_eq!(s[0]["text"], s[1]["text"], "greedy (temperature 0) samples are the same");
        assert!(g["prompt"].as_str().unwrap().starts_with("<|im_start|>"), "rendered with SmolLM2's chat template");
        assert!(g["prompt_tokens"].as_u64().unwrap() > 10);
    }
    for s in all_samples(&gens) {
        let tokens = s["tokens"].as_u64().unwrap();
        assert!(tokens > 0 && tokens <= 26, "re-tokenised count {tokens} of at most 24 generated tokens");
        assert!(["stop", "length"].contains(&s["finish"].as_str().unwrap()));
        assert!(s["correct"].is_boolean());
    }
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert!(report["engine"].as_str().unwrap().starts_with(&format!("openai {SERVED} at http://127.0.0.1:")));
    let r = &report["benchmarks"]["math500"];
    assert_eq!((r["n_problems"].as_u64(), r["n"].as_u64()), (Some(3), Some(2)));
    let verdicts: Vec<bool> = all_samples(&gens).iter().map(|s| s["correct"].as_bool().unwrap()).collect();
    let mean = verdicts.iter().filter(|&&c| c).count() as f64 / verdicts.len() as f64;
    assert!((r["avg_at_n"].as_f64().unwrap() - mean).abs() < 1e-12);
    let tokens: u64 = all_samples(&gens).iter().map(|s| s["tokens"].as_u64().unwrap()).sum();
    assert_eq!(r["generated_tokens"].as_u64(), Some(tokens));

    // Interrupted after two problems: --resume sends only the third.
    let text = std::fs::read_to_string(out.join("generations.jsonl")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    std::fs::write(out.join("generations.jsonl"), lines[..2].join("\n") + "\n").unwrap();
    let before = server.completions_served();
    eval_openai(&model, &server.base_url(), &out, &["--resume"]).success();
    let resumed = common::read_jsonl(&out.join("generations.jsonl"));
    assert_eq!(resumed.len(), 3);
    assert_eq!(&resumed[..2], &gens[..2]);
    let third = resumed[2]["id"].as_str().unwrap().to_string();
    let sent = server.completions_served() - before;
    assert!((1..=2).contains(&sent), "one problem re-sent (1 request, or 2 when the server ignores n): {sent}");

    // The server gone: a finished run resumes without sending anything; an unfinished problem fails by id.
    let url = server.base_url();
    drop(server);
    eval_openai(&model, &url, &out, &["--resume"]).success();
    std::fs::write(out.join("generations.jsonl"), lines[..2].join("\n") + "\n").unwrap();
    let a = eval_openai(&model, &url, &out, &["--resume", "--max-retries", "1"]).failure();
    let stderr = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(stderr.contains("1 problem failed") && stderr.contains(&format!("problem {third}: ")), "{stderr}");
    assert_eq!(common::read_jsonl(&out.join("generations.jsonl")).len(), 2, "finished problems are kept");
}

#[test]
fn openai_without_base_url_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let a = common::grpo()
        .args(["eval", "--bench", "math500", "--engine", "openai", "--served-model", "m", "--model"])
        .arg(common::root().join("data/tokenizers/smollm2"))
        .arg("--out")
        .arg(dir.path())
        .assert()
        .failure();
    let stderr = String::from_utf8_lossy(&a.get_output().stderr).to_string();
    assert!(stderr.contains("--base-url is required with --engine openai"), "{stderr}");
}

/// A tiny model sharing SmolLM2's tokenizer (init-tiny), two questions, and a training config whose
/// rollouts come from the server at `url` (plus the `[rollout]` keys of `rollout_extra`); returns the
/// config's path and the run's output folder.
fn server_rollout_run(dir: &Path, gguf: &Path, url: &str, rollout_extra: &str) -> (PathBuf, PathBuf) {
    let model = dir.join("model");
    common::grpo()
        .args(["init-tiny", "--arch", "llama", "--tokenizer"])
        .arg(gguf.parent().unwrap())
        .arg("--out")
        .arg(&model)
        .args(["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64"])
        .assert()
        .success();
    let questions = dir.join("questions.jsonl");
    std::fs::write(
        &questions,
        "{\"problem\": \"What is 3 + 4?\", \"answer\": \"7\"}\n{\"problem\": \"What is 2 + 2?\", \"answer\": \"4\"}\n",
    )
    .unwrap();
    let out = dir.join("out");
    let cfg = format!(
        r#"[model]
path = "{model}"

[data]
max_prompt_tokens = 128

[objective]
name = "grpo"
anchor = "behaviour"

[optim]
lr = 0.001

[train]
output_dir = "{out}"
batch_questions = 2
micro_batch_size = 4
epochs = 0
max_steps = 2
seed = 3

[rollout]
n = 2
max_new_tokens = 8
questions = "{questions}"
fallbacks = true
{rollout_extra}

[rollout.server]
engine = "openai"
base_url = "{url}"
served_model = "{SERVED}"
concurrency = 2
"#,
        model = model.display(),
        out = out.display(),
        questions = questions.display(),
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, cfg).unwrap();
    (path, out)
}

/// `grpo train` with `[rollout.server] engine = "openai"` on llama.cpp's server (which cannot reload:
/// `reload = "none"`): two steps of a tiny model sharing SmolLM2's tokenizer, whose answers come from the
/// server, re-tokenised, scored and trained on, with rollout metrics written. (The served weights are not
/// the tiny model's, so only the plumbing is checked here, not the ratio.)
#[test]
fn training_rollouts_come_from_llama_cpp_server() {
    let (Some(gguf), Some(py)) = (gguf(), server_python()) else { return };
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = start_server(&py, &gguf, dir.path(), &[]) else { return };
    let (path, out) = server_rollout_run(dir.path(), &gguf, &server.base_url(), "");
    common::grpo().args(["-q", "train", "--config"]).arg(&path).assert().success();
    let m = common::read_jsonl(&out.join("metrics.jsonl"));
    assert_eq!(m.len(), 2, "{m:?}");
    for row in &m {
        let len = row["rollout/mean_length"].as_f64().unwrap();
        assert!(len > 0.0 && len <= 9.0, "at most 8 generated tokens and the EOS: {row}");
        assert!(row["rollout/reward_mean"].as_f64().is_some(), "{row}");
        assert_eq!(row["rollout/updates"].as_u64(), Some(1), "{row}");
    }
    assert!(server.completions_served() >= 2, "the answers came from the server");
    assert!(!out.join("rollout-policy").exists(), "reload = \"none\" saves nothing for the server");
}

/// `importance_sampling_correction` with llama.cpp's server (started with `--logits_all` so that it
/// reports log-probs; it names tokens by text): the server's tokens align with grpo's tokenisation of
/// its answers (SmolLM2's tokenizer on both sides), and metrics.jsonl logs the mismatch between the
/// served SmolLM2 and the tiny policy's forward, the ratios and the fraction truncated.
#[test]
fn llama_cpp_servers_log_probs_give_the_importance_sampling_correction() {
    let (Some(gguf), Some(py)) = (gguf(), server_python()) else { return };
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = start_server(&py, &gguf, dir.path(), &["--logits_all", "true"]) else { return };
    let extra = "importance_sampling_correction = true\nimportance_sampling_mode = \"token_truncate\"\n\
                 importance_sampling_cap = 2.0";
    let (path, out) = server_rollout_run(dir.path(), &gguf, &server.base_url(), extra);
    common::grpo().args(["-q", "train", "--config"]).arg(&path).assert().success();
    let m = common::read_jsonl(&out.join("metrics.jsonl"));
    assert_eq!(m.len(), 2, "{m:?}");
    for row in &m {
        let get = |k: &str| row[format!("rollout/{k}")].as_f64().unwrap_or_else(|| panic!("no rollout/{k}: {row}"));
        assert_eq!(get("server_logprobs_unaligned"), 0.0, "{row}");
        let (mean, max) = (get("sampling_logp_difference_mean"), get("sampling_logp_difference_max"));
        assert!(mean > 0.0 && mean <= max && max.is_finite(), "{row}");
        let (lo, avg, hi) = (
            get("importance_sampling_ratio_min"),
            get("importance_sampling_ratio_mean"),
            get("importance_sampling_ratio_max"),
        );
        assert!(0.0 < lo && lo <= avg && avg <= hi, "{row}");
        let capped = get("importance_sampling_capped_fraction");
        assert!((0.0..=1.0).contains(&capped) && (capped > 0.0) == (hi > 2.0), "{row}");
    }
}
