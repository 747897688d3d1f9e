//! Rollouts from an OpenAI-compatible server (`[rollout.server] engine = "openai"`): the prompts go to
//! the server's `/completions` endpoint through the eval engine, each returned text is re-tokenised with
//! the policy's tokenizer (the token ids trained on are those of the re-tokenised text, or the server's
//! own tokens when it reports them, see below, with the EOS appended to a stopped answer as the native
//! sampler does), and the behaviour log-probs are computed by
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
//!
//! With `rollout.importance_sampling_correction` the server is asked for each sampled token's log-prob
//! (OpenAI `logprobs`; vLLM names the tokens by id with `return_tokens_as_token_ids`, llama.cpp and SGLang
//! by their text). The tokens trained on are then the ones the server sampled, when it names each one
//! (by id, or by a text that exactly one token of the policy's tokenizer decodes to) and they decode to
//! the answer's text: a sampler may pick a split that re-tokenisation would merge (" a" then "y", where
//! the tokenizer has " ay"), and the ratio is only exact on the sampled tokens. Otherwise the text is
//! re-tokenised and the log-probs are aligned with grpo's tokens one by one: a server token matches when
//! its id equals grpo's, or else when its text equals grpo's decoding of that one token. An answer
//! whose first tokens do not all match, or that has fewer server tokens than grpo's, is *unaligned*: it
//! is trained on without correction (weight 1), its log-probs are left out of the mismatch metrics, and
//! it is counted (`rollout/server_logprobs_unaligned`, with a warning). The stop token's log-prob, when
//! the server reports it after the text, goes to the EOS grpo appends; without
//! it the EOS has no sampler log-prob (ratio 1).

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::RolloutError;
use crate::data::Group;
use crate::eval::engine::{Completion, Engine, OpenAi, Progress, PromptJob, ServerToken};
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
    /// A LoRA run's adapter (OUTPUT/rollout-policy in PEFT's format) loaded by vLLM's
    /// `/v1/load_lora_adapter` under the name `served_model`, after `/v1/unload_lora_adapter` of the last
    /// one: the server serves the base model with `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True.
    #[serde(rename = "vllm-lora")]
    #[value(name = "vllm-lora")]
    VllmLora,
    /// As `vllm-lora`, through SGLang's `/load_lora_adapter` and `/unload_lora_adapter` (`--enable-lora`).
    #[serde(rename = "sglang-lora")]
    #[value(name = "sglang-lora")]
    SglangLora,
}

impl Reload {
    /// Whether the server is sent the adapter of a LoRA run rather than whole weights.
    pub fn adapter(self) -> bool {
        matches!(self, Reload::VllmLora | Reload::SglangLora)
    }
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
        Reload::None | Reload::VllmLora | Reload::SglangLora => return None,
        Reload::Sglang => ("update_weights_from_disk", serde_json::to_string(&SglangBody { model_path: &path })),
        Reload::Vllm => ("collective_rpc", serde_json::to_string(&VllmBody { method: "reload_weights" })),
    };
    Some(ReloadRequest { url: format!("{root}/{endpoint}"), body: body.expect("plain structs serialise") })
}

#[derive(Serialize)]
struct LoraBody<'a> {
    lora_name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    lora_path: Option<&'a str>,
}

/// The calls that make the server at `base_url` serve the adapter of `dir` under the name `name`: the
/// unload of the adapter of that name (which fails harmlessly when none is loaded yet), then the load;
/// none unless `reload` sends adapters ([`Reload::adapter`]).
pub fn lora_requests(reload: Reload, base_url: &str, dir: &Path, name: &str) -> Option<[ReloadRequest; 2]> {
    let root = base_url.trim_end_matches('/');
    let root = match reload {
        Reload::VllmLora => format!("{}/v1", root.strip_suffix("/v1").unwrap_or(root)),
        Reload::SglangLora => root.strip_suffix("/v1").unwrap_or(root).to_string(),
        _ => return None,
    };
    let dir = std::fs::canonicalize(dir).or_else(|_| std::path::absolute(dir)).unwrap_or_else(|_| dir.into());
    let path = dir.to_string_lossy();
    let body = |lora_path| serde_json::to_string(&LoraBody { lora_name: name, lora_path }).expect("plain struct");
    Some([
        ReloadRequest { url: format!("{root}/unload_lora_adapter"), body: body(None) },
        ReloadRequest { url: format!("{root}/load_lora_adapter"), body: body(Some(&path)) },
    ])
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

/// How a server's answer became a rollout sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Conversion {
    /// It was longer than `max_new_tokens` and was cut to it.
    pub cut: bool,
    /// It had log-probs that do not match grpo's tokens (they are dropped).
    pub unaligned: bool,
}

/// A server's answer as a rollout sequence: the text re-tokenised with the policy's tokenizer, cut to
/// `max_new_tokens` tokens (then it did not stop), plus `eos` when it stopped, with the server's
/// log-probs aligned to those tokens when it sent them (see the module documentation).
pub fn to_sampled(
    c: Completion,
    tok: &ChatTokenizer,
    eos: Option<u32>,
    max_new_tokens: usize,
) -> Result<(Sampled, Conversion), RolloutError> {
    let sampled = match &c.logprobs {
        Some(server) => sampled_ids(server, &c.text, tok)?,
        None => None,
    };
    let mut ids = match sampled {
        Some(ids) => ids,
        None => tok.encode(&c.text, false)?,
    };
    let (text, finish, cut) = if ids.len() > max_new_tokens {
        ids.truncate(max_new_tokens);
        (tok.decode(&ids, false)?, FinishReason::Length, true)
    } else {
        (c.text, c.finish, false)
    };
    let generated = ids.len();
    let appended = match (finish, eos) {
        (FinishReason::Stop, Some(e)) => Some(e),
        _ => None,
    };
    let sampler_logprobs = match &c.logprobs {
        Some(server) => align(&ids, appended, server, tok)?,
        None => None,
    };
    let unaligned = c.logprobs.is_some() && sampler_logprobs.is_none();
    let tokens = match appended {
        Some(e) => [ids.as_slice(), &[e]].concat(),
        None => ids,
    };
    Ok((Sampled { tokens, text, finish, generated, sampler_logprobs }, Conversion { cut, unaligned }))
}

/// The ids of the tokens the server sampled for `text`, when it names them all (by id, or by a text only
/// one token decodes to) and they decode to `text`: either every reported token is the text's, or the
/// last one is the stop token after it. `None` otherwise (the text is then re-tokenised).
fn sampled_ids(server: &[ServerToken], text: &str, tok: &ChatTokenizer) -> Result<Option<Vec<u32>>, RolloutError> {
    for k in [server.len(), server.len().saturating_sub(1)] {
        let ids: Option<Vec<u32>> = server[..k].iter().map(|s| s.id.or_else(|| tok.piece_id(&s.text))).collect();
        if let Some(ids) = ids {
            if tok.decode(&ids, false)? == text {
                return Ok(Some(ids));
            }
        }
    }
    Ok(None)
}

/// The server's log-prob of each of grpo's tokens `ids` (then of the appended EOS `eos` when the server
/// reports its stop token after them), or `None` when the server's first tokens are not `ids`.
fn align(
    ids: &[u32],
    eos: Option<u32>,
    server: &[ServerToken],
    tok: &ChatTokenizer,
) -> Result<Option<Vec<f32>>, RolloutError> {
    if server.len() < ids.len() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(ids.len() + 1);
    for (&id, s) in ids.iter().zip(server) {
        let same = match s.id {
            Some(sid) => sid == id,
            None => s.text == tok.decode(&[id], false)?,
        };
        match (same, s.logprob) {
            (true, Some(lp)) => out.push(lp),
            _ => {
                tracing::debug!(
                    "server log-probs unaligned at token {}: the server's {:?} (log-prob {:?}), grpo's {:?} (id {id})",
                    out.len(),
                    s.text,
                    s.logprob,
                    tok.decode(&[id], false)?
                );
                return Ok(None);
            }
        }
    }
    if let (Some(e), Some(s)) = (eos, server.get(ids.len())) {
        let stop = match s.id {
            Some(sid) => sid == e,
            None => s.text.is_empty() || s.text == tok.decode(&[e], false)?,
        };
        if let (true, Some(lp)) = (stop, s.logprob) {
            out.push(lp);
        }
    }
    Ok(Some(out))
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

/// A batch of the server's answers.
#[derive(Debug)]
pub struct ServerBatch {
    /// In question order.
    pub samples: Vec<Sampled>,
    /// Answers longer than asked (a server ignoring max_tokens), cut to it.
    pub cut: usize,
    /// Answers whose log-probs did not match grpo's tokens.
    pub unaligned: usize,
}

/// `k` answers to each question from the server, answer j of group `g` seeded from sequence
/// `g.index * n + j` of `params.seed`, in question order, each at most `params.max_new_tokens` tokens,
/// with their tokens' log-probs when `logprobs`.
pub fn server_samples(
    options: &EngineOptions,
    tok: &ChatTokenizer,
    questions: &[Group],
    (k, n, logprobs): (usize, usize, bool),
    params: &SamplingParams,
    bar: &indicatif::ProgressBar,
) -> Result<ServerBatch, RolloutError> {
    let engine = OpenAi::new(options, tok)?;
    let engine = if logprobs { engine.with_logprobs() } else { engine };
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
    let (mut cut, mut unaligned) = (engine.cut_answers(), 0);
    for samples in sink.out {
        let samples = samples.ok_or_else(|| RolloutError::Invalid("the server left a question unanswered".into()))?;
        for c in samples.into_iter().take(k) {
            if logprobs && c.logprobs.is_none() {
                return Err(RolloutError::Invalid(format!(
                    "rollout.importance_sampling_correction: the server at {} sent no `logprobs` for an answer \
                     (does it support them on /completions?)",
                    options.base_url.as_deref().unwrap_or_default()
                )));
            }
            let (sampled, how) = to_sampled(c, tok, eos, params.max_new_tokens)?;
            out.push(sampled);
            cut += usize::from(how.cut);
            unaligned += usize::from(how.unaligned);
        }
    }
    if unaligned > 0 {
        tracing::warn!(
            "{unaligned} of {} server answers have tokens that differ from grpo's tokenisation of their text: \
             trained on without the importance-sampling correction",
            out.len()
        );
    }
    Ok(ServerBatch { samples: out, cut, unaligned })
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
    fn lora_reloads_unload_then_load_the_adapter_by_the_served_name() {
        let dir = Path::new("/runs/a/rollout-policy");
        let [unload, load] = lora_requests(Reload::VllmLora, "http://h:8000/v1/", dir, "policy").unwrap();
        assert_eq!(unload.url, "http://h:8000/v1/unload_lora_adapter");
        assert_eq!(unload.body, r#"{"lora_name":"policy"}"#);
        assert_eq!(load.url, "http://h:8000/v1/load_lora_adapter");
        assert_eq!(load.body, r#"{"lora_name":"policy","lora_path":"/runs/a/rollout-policy"}"#);
        let [_, load] = lora_requests(Reload::SglangLora, "http://h:30000/v1", dir, "p").unwrap();
        assert_eq!(load.url, "http://h:30000/load_lora_adapter");
        assert_eq!(lora_requests(Reload::Vllm, "http://h:1/v1", dir, "p"), None);
        assert_eq!(reload_request(Reload::VllmLora, "http://h:1/v1", dir), None);
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

    /// Server log-probs follow grpo's tokens: matched by id or by text, the stop token's given to the
    /// appended EOS, and refused (unaligned) when the tokens differ or are too few.
    #[test]
    fn server_log_probs_are_aligned_with_grpos_tokens() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/digits");
        let tok = ChatTokenizer::load(&dir).unwrap();
        let eos = tok.eos_ids().first().copied();
        let ids = tok.encode("1 2 3", false).unwrap();
        assert!(ids.len() >= 3, "{ids:?}");
        let lps: Vec<f32> = (0..=ids.len()).map(|i| -0.25 * (i + 1) as f32).collect();
        let by_id = |ids: &[u32]| -> Vec<ServerToken> {
            ids.iter()
                .zip(&lps)
                .map(|(&i, &lp)| ServerToken { text: format!("token_id:{i}"), id: Some(i), logprob: Some(lp) })
                .collect()
        };
        let by_text = |ids: &[u32]| -> Vec<ServerToken> {
            ids.iter()
                .zip(&lps)
                .map(|(&i, &lp)| ServerToken { text: tok.decode(&[i], false).unwrap(), id: None, logprob: Some(lp) })
                .collect()
        };
        let answer =
            |finish, logprobs| Completion { text: "1 2 3".into(), tokens: 0, finish, logprobs: Some(logprobs) };
        let n = ids.len();
        // The stop token after the text: its log-prob goes to the EOS.
        let with_stop = [ids.clone(), vec![eos.unwrap()]].concat();
        for server in [by_id(&with_stop), by_text(&with_stop)] {
            let (s, how) = to_sampled(answer(FinishReason::Stop, server), &tok, eos, 8).unwrap();
            assert_eq!((s.sampler_logprobs.as_deref(), how.unaligned), (Some(&lps[..n + 1]), false));
        }
        // No stop token reported: the EOS has none; a cut answer keeps the log-probs of its kept tokens.
        let (s, _) = to_sampled(answer(FinishReason::Stop, by_id(&ids)), &tok, eos, 8).unwrap();
        assert_eq!((s.tokens.len(), s.sampler_logprobs.as_deref()), (n + 1, Some(&lps[..n])));
        let (s, how) = to_sampled(answer(FinishReason::Stop, by_id(&with_stop)), &tok, eos, 2).unwrap();
        assert!(how.cut && !how.unaligned);
        assert_eq!(s.sampler_logprobs.as_deref(), Some(&lps[..2]));
        // Another token, a missing log-prob or too few tokens: unaligned, no log-probs.
        let mut other = ids.clone();
        other[1] += 1;
        let mut no_lp = by_text(&ids);
        no_lp[0].logprob = None;
        for server in [by_id(&other), by_text(&other), no_lp, by_id(&ids[..n - 1])] {
            let (s, how) = to_sampled(answer(FinishReason::Length, server), &tok, eos, 8).unwrap();
            assert_eq!((s.sampler_logprobs, how.unaligned), (None, true));
        }
    }

    /// A BPE tokenizer that merges "a" "y" into "ay", EOS 0.
    fn merging_tokenizer() -> (tempfile::TempDir, ChatTokenizer) {
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": 0, "content": "<eos>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Fuse"},
            "model": {"type": "BPE", "vocab": {"<eos>": 0, "a": 1, "y": 2, "ay": 3, "b": 4},
                      "merges": ["a y"]}
        });
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"eos_token": "<eos>"}"#).unwrap();
        let tok = ChatTokenizer::load(dir.path()).unwrap();
        (dir, tok)
    }

    /// A split the tokenizer would merge (" a" then "y" where it has " ay") is trained on as the server
    /// sampled it, named by id or by text, with its log-probs; when a text names no single token, the
    /// answer is re-tokenised and its log-probs are refused.
    #[test]
    fn the_servers_own_tokens_are_trained_on_when_it_names_them() {
        let (_dir, tok) = merging_tokenizer();
        assert_eq!(tok.encode("ay", false).unwrap(), vec![3]);
        assert_eq!((tok.piece_id("a"), tok.piece_id("ay"), tok.piece_id("zz")), (Some(1), Some(3), None));
        let lps = [-0.5f32, -1.5, -2.5];
        let server = |named: &[(&str, Option<u32>)]| -> Vec<ServerToken> {
            named
                .iter()
                .zip(lps)
                .map(|(&(text, id), lp)| ServerToken { text: text.into(), id, logprob: Some(lp) })
                .collect()
        };
        let answer = |text: &str, finish, logprobs| Completion {
            text: text.into(),
            tokens: 0,
            finish,
            logprobs: Some(logprobs),
        };
        for split in [server(&[("a", None), ("y", None)]), server(&[("token_id:1", Some(1)), ("token_id:2", Some(2))])]
        {
            let (s, how) = to_sampled(answer("ay", FinishReason::Length, split), &tok, Some(0), 8).unwrap();
            assert_eq!(
                (s.tokens.as_slice(), s.sampler_logprobs.as_deref(), how.unaligned),
                (&[1, 2][..], Some(&lps[..2]), false)
            );
            assert_eq!(s.generated, 2);
        }
        // The stop token after the text (named by its text, or empty): its log-prob goes to the EOS.
        for stop in ["<eos>", ""] {
            let split = server(&[("a", None), ("y", None), (stop, None)]);
            let (s, how) = to_sampled(answer("ay", FinishReason::Stop, split), &tok, Some(0), 8).unwrap();
            assert_eq!(
                (s.tokens.as_slice(), s.sampler_logprobs.as_deref(), how.unaligned),
                (&[1, 2, 0][..], Some(&lps[..]), false)
            );
        }
        // Cut to max_new_tokens on the server's tokens.
        let (s, how) =
            to_sampled(answer("ay", FinishReason::Length, server(&[("a", None), ("y", None)])), &tok, Some(0), 1)
                .unwrap();
        assert_eq!((s.tokens.as_slice(), s.text.as_str(), how.cut), (&[1][..], "a", true));
        // Pieces that do not spell the text, or a piece no single token decodes to: re-tokenised, refused.
        for split in [server(&[("a", None), ("b", None)]), server(&[("a", None), ("yy", None)])] {
            let (s, how) = to_sampled(answer("ay", FinishReason::Length, split), &tok, Some(0), 8).unwrap();
            assert_eq!((s.tokens.as_slice(), s.sampler_logprobs, how.unaligned), (&[3][..], None, true));
        }
    }

    #[test]
    fn answers_past_max_new_tokens_are_cut_to_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/digits");
        let tok = ChatTokenizer::load(&dir).unwrap();
        let eos = tok.eos_ids().first().copied();
        let long =
            Completion { text: "1 2 3 4 5 6 7 8 9 ".repeat(50), tokens: 0, finish: FinishReason::Stop, logprobs: None };
        let (s, how) = to_sampled(long.clone(), &tok, eos, 8).unwrap();
        assert!(how.cut && !how.unaligned);
        assert_eq!((s.tokens.len(), s.generated, s.finish), (8, 8, FinishReason::Length));
        assert_eq!(tok.encode(&s.text, false).unwrap(), s.tokens);
        assert!(long.text.starts_with(s.text.trim_end()), "{}", s.text);
        let short = Completion { text: "7".into(), tokens: 0, finish: FinishReason::Stop, logprobs: None };
        let (s, how) = to_sampled(short, &tok, eos, 8).unwrap();
        assert!(!how.cut && s.finish == FinishReason::Stop && s.generated == 1);
        assert_eq!(s.tokens.last().copied(), eos);
    }
}
