//! Rollouts from an OpenAI-compatible server (`[rollout.server] engine = "openai"`): the prompts go to
//! the server's `/completions` endpoint through the eval engine, each returned text is re-tokenised with
//! the policy's tokenizer (the token ids trained on are those of the re-tokenised text, with the EOS
//! appended to a stopped answer as the native sampler does), and the behaviour log-probs are computed by
//! grpo's forward of the sampling weights, the copy the server was told to load, so the ratio is exact
//! with respect to those weights.
//!
//! At each refresh of the sampling policy the weights are saved as a Hugging Face folder
//! (OUTPUT/rollout-policy, written atomically) and the server is told to load it:
//! - `sglang`: `POST ROOT/update_weights_from_disk {"model_path": DIR}` (SGLang's own endpoint; DIR absolute);
//! - `vllm`: `POST ROOT/collective_rpc {"method": "reload_weights"}` (exposed only with
//!   `VLLM_SERVER_DEV_MODE=1`): each worker re-reads the weights from the path the server was started on,
//!   so the server must serve DIR itself (`vllm serve OUTPUT/rollout-policy`, a copy of the starting model
//!   placed there first);
//! - `none`: the server cannot reload (llama.cpp); it must serve the starting weights, which stay the
//!   sampling policy for the whole run.
//!
//! ROOT is `base_url` without its trailing `/v1`.

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::RolloutError;
use crate::data::Group;
use crate::eval::engine::{Completion, Engine, OpenAi, Progress, PromptJob};
use crate::eval::{EngineOptions, EvalError, FinishReason, SamplingParams};
use crate::model::ChatTokenizer;

/// How the server is told to load new weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Reload {
    /// It cannot: the sampling policy is the run's starting weights, which the server must serve.
    #[default]
    None,
    /// SGLang's `/update_weights_from_disk`.
    Sglang,
    /// vLLM's `/collective_rpc` with `reload_weights` (server started with VLLM_SERVER_DEV_MODE=1 on
    /// OUTPUT/rollout-policy, which it re-reads).
    Vllm,
}

/// One reload call: where it goes and its JSON body.
#[derive(Debug, Clone, PartialEq)]
pub struct ReloadRequest {
    pub url: String,
    pub body: String,
}

#[derive(Serialize)]
struct SglangBody<'a> {
    model_path: &'a str,
}

#[derive(Serialize)]
struct VllmBody<'a> {
    method: &'a str,
}

/// The call telling the server at `base_url` to load the weights of `dir` (none for [`Reload::None`]).
/// The folder is named by its absolute path (canonical when it exists): the server does not share the
/// run's working directory.
pub fn reload_request(reload: Reload, base_url: &str, dir: &Path) -> Option<ReloadRequest> {
    let root = base_url.trim_end_matches('/');
    let root = root.strip_suffix("/v1").unwrap_or(root);
    let dir = std::fs::canonicalize(dir).or_else(|_| std::path::absolute(dir)).unwrap_or_else(|_| dir.into());
    let path = dir.to_string_lossy();
    let (endpoint, body) = match reload {
        Reload::None => return None,
        Reload::Sglang => ("update_weights_from_disk", serde_json::to_string(&SglangBody { model_path: &path })),
        Reload::Vllm => ("collective_rpc", serde_json::to_string(&VllmBody { method: "reload_weights" })),
    };
    Some(ReloadRequest { url: format!("{root}/{endpoint}"), body: body.expect("plain structs serialise") })
}

/// Send `req` (with the API key and timeouts of `options`), failing on any status but 200.
pub fn send_reload(req: &ReloadRequest, options: &EngineOptions) -> Result<(), RolloutError> {
    let mut call = options.http_agent().post(&req.url).header("Content-Type", "application/json");
    if let Some(key) = options.api_key().map_err(RolloutError::Invalid)? {
        call = call.header("Authorization", format!("Bearer {key}"));
    }
    let fail = |e: String| RolloutError::Invalid(format!("reloading the server's weights ({}): {e}", req.url));
    let resp = call.send(&req.body).map_err(|e| fail(e.to_string()))?;
    let status = resp.status().as_u16();
    if status != 200 {
        let mut head = Vec::new();
        let _ = resp.into_body().into_reader().take(64 << 10).read_to_end(&mut head);
        let text: String = String::from_utf8_lossy(&head).chars().take(500).collect();
        return Err(fail(format!("HTTP {status}: {text}")));
    }
    Ok(())
}

/// One sampled answer, whichever engine wrote it: the token ids trained on, the text scored, why it
/// stopped and how many tokens were generated (EOS excluded).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub generated: usize,
    /// The sampler's log-prob of each of `tokens`, when it reports them (the native sampler does).
    pub sampler_logprobs: Option<Vec<f32>>,
}

/// A server's answer as a rollout sequence: the text re-tokenised with the policy's tokenizer, cut to
/// `max_new_tokens` tokens (then it did not stop), plus `eos` when it stopped. Also whether it was cut.
pub fn to_sampled(
    c: Completion,
    tok: &ChatTokenizer,
    eos: Option<u32>,
    max_new_tokens: usize,
) -> Result<(Sampled, bool), RolloutError> {
    let mut ids = tok.encode(&c.text, false)?;
    let (text, finish, cut) = if ids.len() > max_new_tokens {
        ids.truncate(max_new_tokens);
        (tok.decode(&ids, false)?, FinishReason::Length, true)
    } else {
        (c.text, c.finish, false)
    };
    let generated = ids.len();
    let tokens = match (finish, eos) {
        (FinishReason::Stop, Some(e)) => [ids.as_slice(), &[e]].concat(),
        _ => ids,
    };
    Ok((Sampled { tokens, text, finish, generated, sampler_logprobs: None }, cut))
}

/// Collects the engine's samples per job.
struct Sink<'a> {
    out: Vec<Option<Vec<Completion>>>,
    bar: &'a indicatif::ProgressBar,
}

impl Progress for Sink<'_> {
    fn tokens(&mut self, count: usize) {
        self.bar.inc(count as u64);
    }

    fn done(&mut self, job: usize, samples: Vec<Completion>) -> Result<(), EvalError> {
        self.bar.inc(samples.iter().map(|s| s.tokens as u64).sum());
        self.out[job] = Some(samples);
        Ok(())
    }
}

/// `k` answers to each question from the server, answer j of group `g` seeded from sequence
/// `g.index * n + j` of `params.seed`, in question order, each at most `params.max_new_tokens` tokens;
/// also how many were longer (a server ignoring max_tokens) and were cut to it.
pub fn server_samples(
    options: &EngineOptions,
    tok: &ChatTokenizer,
    questions: &[Group],
    (k, n): (usize, usize),
    params: &SamplingParams,
    bar: &indicatif::ProgressBar,
) -> Result<(Vec<Sampled>, usize), RolloutError> {
    let engine = OpenAi::new(options, tok)?;
    let jobs: Vec<PromptJob> = questions
        .iter()
        .map(|g| {
            Ok(PromptJob {
                id: g.question_id.clone(),
                text: tok.decode(&g.prompt_tokens, false)?,
                ids: g.prompt_tokens.clone(),
                first_sequence: (g.index * n) as u64,
            })
        })
        .collect::<Result<_, RolloutError>>()?;
    let mut sink = Sink { out: vec![None; jobs.len()], bar };
    engine.complete(&jobs, k, params, &mut sink)?;
    let eos = tok.eos_ids().first().copied();
    let mut out = Vec::with_capacity(jobs.len() * k);
    let mut cut = engine.cut_answers();
    for samples in sink.out {
        let samples = samples.ok_or_else(|| RolloutError::Invalid("the server left a question unanswered".into()))?;
        for c in samples.into_iter().take(k) {
            let (sampled, was_cut) = to_sampled(c, tok, eos, params.max_new_tokens)?;
            out.push(sampled);
            cut += usize::from(was_cut);
        }
    }
    Ok((out, cut))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reload_requests_name_the_folder_at_the_servers_root() {
        let dir = Path::new("/runs/a/rollout-policy");
        let s = reload_request(Reload::Sglang, "http://h:30000/v1/", dir).unwrap();
        assert_eq!(s.url, "http://h:30000/update_weights_from_disk");
        assert_eq!(s.body, r#"{"model_path":"/runs/a/rollout-policy"}"#);
        let v = reload_request(Reload::Vllm, "http://h:8000/v1", dir).unwrap();
        assert_eq!(v.url, "http://h:8000/collective_rpc");
        assert_eq!(v.body, r#"{"method":"reload_weights"}"#);
        assert_eq!(
            reload_request(Reload::Sglang, "http://h:1", dir).unwrap().url,
            "http://h:1/update_weights_from_disk"
        );
        assert_eq!(reload_request(Reload::None, "http://h:1/v1", dir), None);
    }

    #[test]
    fn a_failed_reload_names_the_endpoint() {
        let req = reload_request(Reload::Sglang, "http://127.0.0.1:9/v1", Path::new("/x")).unwrap();
        let opts = EngineOptions { request_timeout_s: 5, ..Default::default() };
        let e = send_reload(&req, &opts).unwrap_err().to_string();
        assert!(e.contains("http://127.0.0.1:9/update_weights_from_disk"), "{e}");
    }

    #[test]
    fn the_sglang_reload_names_the_folder_by_its_absolute_path() {
        use crate::eval::engine::fake_server::{serve, Reply};
        // Relative to the run's working directory, which the server does not share.
        let existing = Path::new("src/rollout");
        let s = reload_request(Reload::Sglang, "http://h:1/v1", existing).unwrap();
        let want = std::fs::canonicalize(existing).unwrap();
        assert!(want.is_absolute());
        assert_eq!(s.body, serde_json::json!({ "model_path": want }).to_string());
        let not_yet = Path::new("runs/x/rollout-policy");
        let s = reload_request(Reload::Sglang, "http://h:1/v1", not_yet).unwrap();
        let want = std::env::current_dir().unwrap().join(not_yet);
        assert_eq!(s.body, serde_json::json!({ "model_path": want }).to_string());
        // What the server receives.
        let (url, server) = serve(vec![Reply::Full(200, r#"{"success":true}"#.into())]);
        let req = reload_request(Reload::Sglang, &url, existing).unwrap();
        send_reload(&req, &EngineOptions::default()).unwrap();
        let got: serde_json::Value = serde_json::from_str(&server.join().unwrap()[0].request).unwrap();
        let path = got["model_path"].as_str().unwrap();
        assert!(Path::new(path).is_absolute() && Path::new(path).ends_with("src/rollout"), "{got}");
    }

    #[test]
    fn answers_past_max_new_tokens_are_cut_to_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/digits");
        let tok = ChatTokenizer::load(&dir).unwrap();
        let eos = tok.eos_ids().first().copied();
        let long = Completion { text: "1 2 3 4 5 6 7 8 9 ".repeat(50), tokens: 0, finish: FinishReason::Stop };
        let (s, cut) = to_sampled(long.clone(), &tok, eos, 8).unwrap();
        assert!(cut);
        assert_eq!((s.tokens.len(), s.generated, s.finish), (8, 8, FinishReason::Length));
        assert_eq!(tok.encode(&s.text, false).unwrap(), s.tokens);
        assert!(long.text.starts_with(s.text.trim_end()), "{}", s.text);
        let short = Completion { text: "7".into(), tokens: 0, finish: FinishReason::Stop };
        let (s, cut) = to_sampled(short, &tok, eos, 8).unwrap();
        assert!(!cut && s.finish == FinishReason::Stop && s.generated == 1);
        assert_eq!(s.tokens.last().copied(), eos);
    }
}
