//! The OpenAI-compatible engine: each problem's prompt, rendered by grpo with the model's chat template,
//! is sent as text to the server's `/completions` endpoint (vLLM, SGLang and llama.cpp serve it) with
//! n, temperature, top_p, top_k, max_tokens and a seed. Requests run concurrently (at most
//! `concurrency` in flight), transient errors are retried with exponential backoff, and a problem whose
//! request fails for good is reported with its id while the others go on.
//!
//! Token counts: each sample's text is re-tokenised with the model's tokenizer (the one that rendered
//! the prompt), so counts are comparable with the native engine's whatever the server's `usage` counts
//! (servers differ on whether the stop token is included, and `usage` is a total over the choices).
//! A server that returns fewer choices than asked (llama.cpp's ignores `n`) is asked again for the rest,
//! with the seed of the first missing sample.
//!
//! What a server sends is bounded by what was asked: a response is read up to [`response_limit`] bytes
//! (n x max_tokens x 64 plus overhead) and refused past it; an answer longer than max_tokens is cut to
//! it, tokenising only a prefix ([`cut_to_tokens`]), and counted. A malformed 200 is retried like a
//! 5xx. `idle_timeout_s` bounds the parts of a request outside generation (see
//! [`EngineOptions::http_agent`]).

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Completion, Engine, EngineOptions, Progress, PromptJob, ServerToken};
use crate::eval::generate::{FinishReason, SamplingParams};
use crate::eval::EvalError;
use crate::model::tokenizer::TokenizerError;
use crate::model::ChatTokenizer;

/// Bytes of a response allowed per token asked for (`n x max_tokens`): a token's text is about 4 bytes of
/// English, up to 12 as JSON-escaped UTF-16 (`\ud83d\ude00`), rarely more than 16 for the longest
/// vocabulary entries; 64 leaves room for all of them. A longer response is refused unread.
const RESPONSE_BYTES_PER_TOKEN: u64 = 64;
/// Bytes of a response allowed per choice (index, finish reason, logprobs: null, ...) and per response
/// (id, usage, ...).
const CHOICE_OVERHEAD_BYTES: u64 = 4 << 10;
/// Bytes per token added by the log-probs of a token (`logprobs: 1`): its text or `token_id:N` twice
/// (tokens, top_logprobs), two numbers and an offset.
const LOGPROB_BYTES_PER_TOKEN: u64 = 256;
const RESPONSE_OVERHEAD_BYTES: u64 = 64 << 10;
/// The bytes of an error response (non-200) kept for the message.
const ERROR_BODY_BYTES: u64 = 64 << 10;
/// The first guess of an answer's bytes per token when cutting it to `max_tokens` (doubled until enough).
const CUT_BYTES_PER_TOKEN: usize = 8;
/// The first wait before a retry; it doubles with each retry, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A server's Retry-After is followed up to this long.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(120);

/// The body of a `/completions` request.
#[derive(Debug, Serialize, PartialEq)]
struct CompletionRequest<'a> {
    model: &'a str,
    prompt: &'a str,
    n: usize,
    max_tokens: usize,
    temperature: f32,
    top_p: f32,
    /// vLLM, SGLang and llama.cpp's extension. They disagree on the value that turns it off (-1 for
    /// SGLang, 0 for llama.cpp, whose default is 40), so "off" is sent as the vocabulary size: every
    /// token kept, on any of them.
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<usize>,
    /// Set to "off" (0 and 1): llama.cpp's server defaults to min_p 0.05 and repeat_penalty 1.1, which
    /// the native sampler does not apply.
    #[serde(skip_serializing_if = "Option::is_none")]
    min_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    repeat_penalty: Option<f32>,
    seed: u64,
    stream: bool,
    /// The log-prob of each sampled token (and of the most likely one): asked for by the rollouts'
    /// importance-sampling correction.
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<usize>,
    /// vLLM's extension: the tokens of `logprobs` as `token_id:N`, so they are compared by id.
    #[serde(skip_serializing_if = "Option::is_none")]
    return_tokens_as_token_ids: Option<bool>,
}

/// One choice of a response.
#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    index: usize,
    text: String,
    #[serde(default)]
    finish_reason: Option<String>,
    #[serde(default)]
    logprobs: Option<ChoiceLogprobs>,
}

/// The legacy completions' `logprobs` of a choice: each sampled token (its text, or `token_id:N`) and
/// its log-prob.
#[derive(Debug, Deserialize)]
struct ChoiceLogprobs {
    #[serde(default)]
    tokens: Vec<String>,
    #[serde(default)]
    token_logprobs: Vec<Option<f32>>,
}

impl ChoiceLogprobs {
    fn into_tokens(self) -> Vec<ServerToken> {
        self.tokens
            .into_iter()
            .zip(self.token_logprobs.into_iter().chain(std::iter::repeat(None)))
            .map(|(text, logprob)| {
                let id = text.strip_prefix("token_id:").and_then(|n| n.parse().ok());
                ServerToken { text, id, logprob }
            })
            .collect()
    }
}

#[derive(Debug, Deserialize)]
struct CompletionResponse {
    choices: Vec<Choice>,
}

/// Why one request failed.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String, retry_after: Option<Duration> },
    #[error("{message}")]
    Transport { message: String, transient: bool },
    /// A 200 whose body is not a completion (cut short, an HTML page, no choices): retried like a 5xx.
    #[error("unreadable response: {0}")]
    Malformed(String),
    /// A response longer than what was asked allows: read no further, not retried (the same request
    /// would get the same answer).
    #[error(
        "response larger than {limit} bytes for {n} answers of at most {max_tokens} tokens: read no further \
         (does the server honour max_tokens?)"
    )]
    TooLarge { limit: u64, n: usize, max_tokens: usize },
    /// A failure on this side (the request's JSON, the tokenizer).
    #[error("{0}")]
    Local(String),
    #[error("{last} (after {retries} retries)")]
    GaveUp { retries: usize, last: Box<RequestError> },
}

impl RequestError {
    /// Worth trying again: connection problems, timeouts, malformed 200s, 408 / 425 / 429 and server
    /// errors but 501.
    fn is_transient(&self) -> bool {
        match self {
            Self::Status { status, .. } => transient_status(*status),
            Self::Transport { transient, .. } => *transient,
            Self::Malformed(_) => true,
            Self::TooLarge { .. } | Self::Local(_) => false,
            Self::GaveUp { last, .. } => last.is_transient(),
        }
    }
}

impl From<TokenizerError> for RequestError {
    fn from(e: TokenizerError) -> Self {
        Self::Local(e.to_string())
    }
}

fn transient_status(status: u16) -> bool {
    matches!(status, 408 | 425 | 429) || (500..600).contains(&status) && status != 501 && status != 505
}

/// A transport error (no HTTP status): the connection, a timeout, a response cut short are transient;
/// a bad URL, an unknown host, TLS or a too-large body are not.
fn transport_error(e: ureq::Error) -> RequestError {
    let transient = match &e {
        ureq::Error::StatusCode(s) => transient_status(*s),
        ureq::Error::Io(_) | ureq::Error::Timeout(_) | ureq::Error::ConnectionFailed | ureq::Error::Protocol(_) => true,
        _ => false,
    };
    RequestError::Transport { message: e.to_string(), transient }
}

/// The wait before retry number `retry` (0-based): the server's Retry-After when it sent one, else
/// exponential backoff with a little jitter (so that concurrent requests do not retry in step).
fn backoff(retry: usize, retry_after: Option<Duration>, jitter: f64) -> Duration {
    if let Some(d) = retry_after {
        return d.min(MAX_RETRY_AFTER);
    }
    let base = FIRST_BACKOFF.saturating_mul(1u32 << retry.min(16)).min(MAX_BACKOFF);
    base.mul_f64(1.0 + 0.25 * jitter.clamp(0.0, 1.0))
}

/// The seed of the request whose first sample is sequence `sequence`: a mix of the run's seed and the
/// sequence index (as the native engine seeds each sequence), kept below 2^31 for servers that take a
/// 32-bit seed.
fn request_seed(seed: u64, sequence: u64) -> u64 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ sequence;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) & 0x7FFF_FFFF
}

/// The request asking for `n` samples of `prompt`.
fn build_request<'a>(
    model: &'a str,
    prompt: &'a str,
    n: usize,
    sampling: &SamplingParams,
    sequence: u64,
    (vocab, fields_only, logprobs): (usize, bool, bool),
) -> CompletionRequest<'a> {
    let top_k = if sampling.top_k == 0 { vocab } else { sampling.top_k };
    CompletionRequest {
        model,
        prompt,
        n,
        max_tokens: sampling.max_new_tokens,
        temperature: sampling.temperature,
        top_p: sampling.top_p,
        top_k: (!fields_only).then_some(top_k),
        min_p: (!fields_only).then_some(0.0),
        repeat_penalty: (!fields_only).then_some(1.0),
        seed: request_seed(sampling.seed, sequence),
        stream: false,
        logprobs: logprobs.then_some(1),
        return_tokens_as_token_ids: (logprobs && !fields_only).then_some(true),
    }
}

/// The most bytes a response of `n` answers of at most `max_tokens` tokens (with their log-probs when
/// `logprobs`) may take.
fn response_limit(n: usize, max_tokens: usize, logprobs: bool) -> u64 {
    let per_token = RESPONSE_BYTES_PER_TOKEN + if logprobs { LOGPROB_BYTES_PER_TOKEN } else { 0 };
    let per_choice = (max_tokens as u64).saturating_mul(per_token).saturating_add(CHOICE_OVERHEAD_BYTES);
    (n as u64).saturating_mul(per_choice).saturating_add(RESPONSE_OVERHEAD_BYTES)
}

/// One choice as read: its text, why it stopped, and its tokens' log-probs when it has them.
type Answer = (String, FinishReason, Option<Vec<ServerToken>>);

/// The choices of a response body, in index order.
fn parse_response(body: &[u8]) -> Result<Vec<Answer>, RequestError> {
    let mut r: CompletionResponse = serde_json::from_slice(body).map_err(|e| {
        let head: String = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        RequestError::Malformed(format!("{e} in {head:?}"))
    })?;
    if r.choices.is_empty() {
        return Err(RequestError::Malformed("no choices".into()));
    }
    r.choices.sort_by_key(|c| c.index);
    Ok(r.choices
        .into_iter()
        .map(|c| {
            let finish =
                if c.finish_reason.as_deref() == Some("length") { FinishReason::Length } else { FinishReason::Stop };
            (c.text, finish, c.logprobs.map(ChoiceLogprobs::into_tokens))
        })
        .collect())
}

/// `text` cut to its first `max_tokens` tokens of `tok`: the kept text, its token count, and whether it
/// was cut. Only a prefix of the text is tokenised, at most about twice the bytes of `max_tokens + 1`
/// tokens, so an answer far longer than asked costs no more than one of the asked length.
fn cut_to_tokens(
    tok: &ChatTokenizer,
    text: String,
    max_tokens: usize,
) -> Result<(String, usize, bool), TokenizerError> {
    let mut window = max_tokens.saturating_add(1).saturating_mul(CUT_BYTES_PER_TOKEN);
    loop {
        let mut end = window.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let ids = tok.encode(&text[..end], false)?;
        if ids.len() > max_tokens {
            // The last token of a prefix may be part of a longer one: at least one is dropped.
            return Ok((tok.decode(&ids[..max_tokens], false)?, max_tokens, true));
        }
        if end == text.len() {
            return Ok((text, ids.len(), false));
        }
        window = window.saturating_mul(2);
    }
}

/// An OpenAI-compatible server.
pub struct OpenAi<'a> {
    agent: ureq::Agent,
    url: String,
    model: String,
    api_key: Option<String>,
    concurrency: usize,
    max_retries: usize,
    fields_only: bool,
    /// Ask for each sampled token's log-prob.
    logprobs: bool,
    tok: &'a ChatTokenizer,
    /// Answers longer than `max_tokens` (the server ignored it), cut to it.
    cut: AtomicUsize,
}

impl<'a> OpenAi<'a> {
    /// The engine the (validated) options describe; `tok` re-tokenises the samples to count them.
    pub fn new(options: &EngineOptions, tok: &'a ChatTokenizer) -> Result<Self, EvalError> {
        options.validate("--").map_err(EvalError::Engine)?;
        let base = options.base_url.as_deref().unwrap_or_default().trim_end_matches('/');
        Ok(Self {
            agent: options.http_agent(),
            url: format!("{base}/completions"),
            model: options.served_model.clone().unwrap_or_default(),
            api_key: options.api_key().map_err(EvalError::Engine)?,
            concurrency: options.concurrency.max(1),
            max_retries: options.max_retries,
            fields_only: options.openai_fields_only,
            logprobs: false,
            tok,
            cut: AtomicUsize::new(0),
        })
    }

    /// Ask the server for the log-prob of each sampled token (OpenAI `logprobs`, with vLLM's
    /// `return_tokens_as_token_ids` unless `openai_fields_only`): each [`Completion`] carries them.
    pub fn with_logprobs(mut self) -> Self {
        self.logprobs = true;
        self
    }

    /// How many answers so far were longer than the `max_tokens` asked for and were cut to it (their
    /// finish reason is then `length`).
    pub fn cut_answers(&self) -> usize {
        self.cut.load(Ordering::Relaxed)
    }

    /// One POST of `body`, without retries, asking for `n` answers of at most `max_tokens` tokens: a
    /// 200 response is read up to [`response_limit`] bytes, no further.
    fn send(&self, body: &str, (n, max_tokens): (usize, usize)) -> Result<Vec<Answer>, RequestError> {
        let mut req = self.agent.post(&self.url).header("Content-Type", "application/json");
        if let Some(key) = &self.api_key {
            req = req.header("Authorization", format!("Bearer {key}"));
        }
        let resp = req.send(body).map_err(transport_error)?;
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        if status != 200 {
            let mut head = Vec::new();
            let _ = resp.into_body().into_reader().take(ERROR_BODY_BYTES).read_to_end(&mut head);
            let body: String = String::from_utf8_lossy(&head).chars().take(500).collect();
            return Err(RequestError::Status { status, body, retry_after });
        }
        let limit = response_limit(n, max_tokens, self.logprobs);
        let bytes = match resp.into_body().with_config().limit(limit).read_to_vec() {
            Ok(b) => b,
            Err(ureq::Error::BodyExceedsLimit(_)) => return Err(RequestError::TooLarge { limit, n, max_tokens }),
            Err(e) => return Err(transport_error(e)),
        };
        parse_response(&bytes)
    }

    /// POST `body`, retrying transient errors up to `max_retries` times; `stop` cuts the retries short.
    fn send_with_retries(
        &self,
        body: &str,
        asked: (usize, usize),
        stop: &AtomicBool,
    ) -> Result<Vec<Answer>, RequestError> {
        let mut retry = 0;
        loop {
            match self.send(body, asked) {
                Ok(choices) => return Ok(choices),
                Err(e) if e.is_transient() && retry < self.max_retries && !stop.load(Ordering::Relaxed) => {
                    let retry_after = match &e {
                        RequestError::Status { retry_after, .. } => *retry_after,
                        _ => None,
                    };
                    let wait = backoff(retry, retry_after, rand::random::<f64>());
                    tracing::debug!("{e}; retry {} of {} in {:.1} s", retry + 1, self.max_retries, wait.as_secs_f64());
                    std::thread::sleep(wait);
                    retry += 1;
                }
                Err(e) if retry > 0 => return Err(RequestError::GaveUp { retries: retry, last: Box::new(e) }),
                Err(e) => return Err(e),
            }
        }
    }

    /// All `n` samples of one problem (more requests when the server returns fewer choices than asked).
    fn complete_job(
        &self,
        job: &PromptJob,
        n: usize,
        sampling: &SamplingParams,
        stop: &AtomicBool,
    ) -> Result<Vec<Completion>, RequestError> {
        let mut samples = Vec::with_capacity(n);
        while samples.len() < n {
            let sequence = job.first_sequence + samples.len() as u64;
            let fields = (self.tok.vocab_size(), self.fields_only, self.logprobs);
            let missing = n - samples.len();
            let req = build_request(&self.model, &job.text, missing, sampling, sequence, fields);
            let body = serde_json::to_string(&req).map_err(|e| RequestError::Local(e.to_string()))?;
            let asked = (missing, sampling.max_new_tokens);
            for (text, finish, logprobs) in self.send_with_retries(&body, asked, stop)?.into_iter().take(missing) {
                let (text, tokens, cut) = cut_to_tokens(self.tok, text, sampling.max_new_tokens)?;
                let finish = if cut {
                    self.cut.fetch_add(1, Ordering::Relaxed);
                    FinishReason::Length
                } else {
                    finish
                };
                samples.push(Completion { text, tokens, finish, logprobs });
            }
        }
        Ok(samples)
    }
}

/// What a worker sends back for one job.
type JobOutcome = (usize, Result<Vec<Completion>, RequestError>);

impl Engine for OpenAi<'_> {
    fn complete(
        &self,
        jobs: &[PromptJob],
        n: usize,
        sampling: &SamplingParams,
        progress: &mut dyn Progress,
    ) -> Result<(), EvalError> {
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let cut_before = self.cut_answers();
        let (tx, rx) = mpsc::channel::<JobOutcome>();
        std::thread::scope(|scope| {
            for _ in 0..self.concurrency.min(jobs.len()) {
                let tx = tx.clone();
                let (next, stop) = (&next, &stop);
                scope.spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(job) = jobs.get(i) else { break };
                        if tx.send((i, self.complete_job(job, n.max(1), sampling, stop))).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(tx);
            collect(jobs, rx, &stop, progress)
        })?;
        let cut = self.cut_answers() - cut_before;
        if cut > 0 {
            tracing::warn!(
                "{cut} answers of the server were longer than max_tokens = {} and were cut to it (does the server \
                 honour max_tokens?)",
                sampling.max_new_tokens
            );
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("openai {} at {}", self.model, self.url)
    }
}

/// Receive the workers' outcomes: samples go to `progress`; failures are gathered with their problem
/// ids. A failure that retrying cannot help (or an error of `progress`) stops new requests.
fn collect(
    jobs: &[PromptJob],
    rx: mpsc::Receiver<JobOutcome>,
    stop: &AtomicBool,
    progress: &mut dyn Progress,
) -> Result<(), EvalError> {
    let mut failures: Vec<String> = Vec::new();
    let mut sink_error = None;
    let mut received = 0;
    for (i, outcome) in rx {
        received += 1;
        match outcome {
            Ok(samples) if sink_error.is_none() => {
                progress.tokens(samples.iter().map(|s| s.tokens).sum());
                if let Err(e) = progress.done(i, samples) {
                    stop.store(true, Ordering::Relaxed);
                    sink_error = Some(e);
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!("problem {}: {e}", jobs[i].id);
                if !e.is_transient() {
                    stop.store(true, Ordering::Relaxed);
                }
                failures.push(format!("problem {}: {e}", jobs[i].id));
            }
        }
    }
    if let Some(e) = sink_error {
        return Err(e);
    }
    if failures.is_empty() {
        return Ok(());
    }
    Err(EvalError::Requests { failed: failures.len(), unsent: jobs.len() - received, details: failures.join("\n") })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling() -> SamplingParams {
        SamplingParams { temperature: 0.6, top_p: 0.95, top_k: 0, max_new_tokens: 64, seed: 3 }
    }

    #[test]
    fn requests_carry_the_sampling_settings() {
        let r = build_request("smol", "<|im_start|>user\nhi", 4, &sampling(), 12, (49152, false, false));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["model"], "smol");
        assert_eq!(v["prompt"], "<|im_start|>user\nhi");
        assert_eq!((v["n"].as_u64(), v["max_tokens"].as_u64()), (Some(4), Some(64)));
        assert!((v["temperature"].as_f64().unwrap() - 0.6).abs() < 1e-6);
        assert!((v["top_p"].as_f64().unwrap() - 0.95).abs() < 1e-6);
        assert_eq!(v["top_k"], 49152, "top_k 0 (off) is sent as the vocabulary size");
        assert_eq!((v["min_p"].as_f64(), v["repeat_penalty"].as_f64()), (Some(0.0), Some(1.0)));
        assert_eq!(v["stream"], false);
        assert_eq!(v["seed"].as_u64(), Some(request_seed(3, 12)));
        let k = build_request("smol", "p", 1, &SamplingParams { top_k: 20, ..sampling() }, 0, (49152, false, false));
        assert_eq!(k.top_k, Some(20));
        let plain = serde_json::to_value(build_request("smol", "p", 1, &sampling(), 0, (49152, true, false))).unwrap();
        let keys: Vec<&String> = plain.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["model", "prompt", "n", "max_tokens", "temperature", "top_p", "seed", "stream"]);
        // Log-probs asked for: by id from vLLM, plain `logprobs` alone with openai_fields_only.
        let lp = serde_json::to_value(build_request("smol", "p", 1, &sampling(), 0, (49152, false, true))).unwrap();
        assert_eq!((lp["logprobs"].as_u64(), lp["return_tokens_as_token_ids"].as_bool()), (Some(1), Some(true)));
        let lp = serde_json::to_value(build_request("smol", "p", 1, &sampling(), 0, (49152, true, true))).unwrap();
        assert_eq!((lp["logprobs"].as_u64(), lp.get("return_tokens_as_token_ids")), (Some(1), None));
        assert!(response_limit(2, 64, true) > response_limit(2, 64, false) + 2 * 64 * 200);
    }

    #[test]
    fn seeds_differ_by_sequence_and_run_and_fit_in_31_bits() {
        let seeds: std::collections::HashSet<u64> =
            (0..1000).flat_map(|s| [request_seed(0, s), request_seed(1, s)]).collect();
        assert_eq!(seeds.len(), 2000);
        assert!(seeds.iter().all(|&s| s < 1 << 31));
        assert_eq!(request_seed(7, 9), request_seed(7, 9));
    }

    #[test]
    fn responses_are_read_in_choice_order() {
        let body = r#"{"id":"x","object":"text_completion","choices":[
            {"index":1,"text":" b","finish_reason":"length","logprobs":null},
            {"index":0,"text":"a \\boxed{2}","finish_reason":"stop"}],
            "usage":{"prompt_tokens":5,"completion_tokens":9,"total_tokens":14}}"#;
        let c = parse_response(body.as_bytes()).unwrap();
        assert_eq!(
            c,
            vec![
                ("a \\boxed{2}".to_string(), FinishReason::Stop, None),
                (" b".to_string(), FinishReason::Length, None)
            ]
        );
        // llama.cpp and older servers: no index, a null finish reason.
        let c = parse_response(br#"{"choices":[{"text":"x","finish_reason":null}]}"#).unwrap();
        assert_eq!(c, vec![("x".to_string(), FinishReason::Stop, None)]);
    }

    #[test]
    fn token_log_probs_are_read_by_id_or_by_text() {
        let body = r#"{"choices":[{"index":0,"text":"a b","finish_reason":"stop","logprobs":{
            "tokens":["token_id:12","token_id:7","token_id:0"],"token_logprobs":[-0.5,-1.25,null],
            "top_logprobs":[{"token_id:12":-0.5}],"text_offset":[0,1,3]}},
            {"index":1,"text":"x","finish_reason":"stop","logprobs":{"tokens":["x"],"token_logprobs":[-2.0]}}]}"#;
        let c = parse_response(body.as_bytes()).unwrap();
        let t = |text: &str, id, logprob| ServerToken { text: text.into(), id, logprob };
        assert_eq!(
            c[0].2.as_deref().unwrap(),
            [
                t("token_id:12", Some(12), Some(-0.5)),
                t("token_id:7", Some(7), Some(-1.25)),
                t("token_id:0", Some(0), None)
            ]
        );
        assert_eq!(c[1].2.as_deref().unwrap(), [t("x", None, Some(-2.0))]);
    }

    #[test]
    fn malformed_responses_are_retried_and_oversized_ones_are_not() {
        for body in ["", "<html>502</html>", r#"{"choices":[]}"#, r#"{"object":"error","message":"x"}"#] {
            let e = parse_response(body.as_bytes()).unwrap_err();
            assert!(matches!(e, RequestError::Malformed(_)), "{body}: {e}");
            assert!(e.is_transient());
        }
        assert!(!RequestError::TooLarge { limit: 1, n: 1, max_tokens: 1 }.is_transient());
        assert!(!RequestError::Local("tokenizer".into()).is_transient());
    }

    #[test]
    fn transient_errors_are_told_apart_from_permanent_ones() {
        let status = |s| RequestError::Status { status: s, body: String::new(), retry_after: None };
        for s in [408, 425, 429, 500, 502, 503, 504] {
            assert!(status(s).is_transient(), "{s}");
        }
        for s in [400, 401, 403, 404, 422, 501, 505] {
            assert!(!status(s).is_transient(), "{s}");
        }
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(transport_error(ureq::Error::Io(io)).is_transient());
        assert!(transport_error(ureq::Error::ConnectionFailed).is_transient());
        assert!(!transport_error(ureq::Error::HostNotFound).is_transient());
        assert!(!transport_error(ureq::Error::BadUri("x".into())).is_transient());
        assert!(!transport_error(ureq::Error::BodyExceedsLimit(1)).is_transient());
    }

    #[test]
    fn backoff_doubles_up_to_a_cap_and_follows_retry_after() {
        let secs = |r, j| backoff(r, None, j).as_secs_f64();
        assert_eq!((secs(0, 0.0), secs(1, 0.0), secs(2, 0.0)), (0.5, 1.0, 2.0));
        assert_eq!(secs(10, 0.0), 30.0);
        assert_eq!(secs(40, 0.0), 30.0);
        assert!((secs(1, 1.0) - 1.25).abs() < 1e-9);
        assert_eq!(backoff(0, Some(Duration::from_secs(7)), 0.5), Duration::from_secs(7));
        assert_eq!(backoff(0, Some(Duration::from_secs(9999)), 0.5), MAX_RETRY_AFTER);
    }

    #[test]
    fn an_unreachable_server_fails_each_problem_by_id() {
        // A port nothing listens on (bound, then closed): connection refused, retried, then reported.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tokenizers/smollm2");
        let tok = ChatTokenizer::load(&dir).unwrap();
        let options = EngineOptions {
            engine: super::super::EngineKind::Openai,
            base_url: Some(format!("http://127.0.0.1:{port}/v1")),
            served_model: Some("m".into()),
            max_retries: 1,
            concurrency: 2,
            ..Default::default()
        };
        let engine = OpenAi::new(&options, &tok).unwrap();
        let jobs: Vec<PromptJob> = ["p-1", "p-2"]
            .iter()
            .enumerate()
            .map(|(i, id)| PromptJob { id: id.to_string(), text: "q".into(), ids: vec![], first_sequence: i as u64 })
            .collect();
        struct Nothing;
        impl Progress for Nothing {
            fn tokens(&mut self, _: usize) {}
            fn done(&mut self, job: usize, _: Vec<Completion>) -> Result<(), EvalError> {
                panic!("job {job} cannot succeed")
            }
        }
        let e = engine.complete(&jobs, 1, &sampling(), &mut Nothing).unwrap_err().to_string();
        assert!(e.starts_with("2 problems failed"), "{e}");
        assert!(e.contains("problem p-1: ") && e.contains("problem p-2: ") && e.contains("after 1 retries"), "{e}");
    }

    use super::super::fake_server::{serve, Reply};
    use std::time::Instant;

    fn tokenizer() -> ChatTokenizer {
        ChatTokenizer::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tokenizers/smollm2")).unwrap()
    }

    fn options(url: &str) -> EngineOptions {
        EngineOptions {
            engine: super::super::EngineKind::Openai,
            base_url: Some(url.into()),
            served_model: Some("m".into()),
            max_retries: 0,
            concurrency: 1,
            ..Default::default()
        }
    }

    fn one_job() -> Vec<PromptJob> {
        vec![PromptJob { id: "p-1".into(), text: "q".into(), ids: vec![], first_sequence: 0 }]
    }

    /// Keeps the samples of each job.
    #[derive(Default)]
    struct Keep(Vec<Vec<Completion>>);

    impl Progress for Keep {
        fn tokens(&mut self, _: usize) {}
        fn done(&mut self, _: usize, samples: Vec<Completion>) -> Result<(), EvalError> {
            self.0.push(samples);
            Ok(())
        }
    }

    fn completion(texts: &[&str]) -> String {
        let choices: Vec<_> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| serde_json::json!({"index": i, "text": t, "finish_reason": "stop"}))
            .collect();
        serde_json::json!({ "choices": choices }).to_string()
    }

    #[test]
    fn an_oversized_response_is_refused_after_its_limit_and_not_read_whole() {
        let (url, server) = serve(vec![Reply::Endless(100 << 20)]);
        let tok = tokenizer();
        let engine = OpenAi::new(&options(&url), &tok).unwrap();
        let start = Instant::now();
        let e = engine.complete(&one_job(), 1, &sampling(), &mut Keep::default()).unwrap_err().to_string();
        let elapsed = start.elapsed();
        let written = server.join().unwrap()[0].written;
        let limit = response_limit(1, 64, false);
        assert!(e.contains(&format!("response larger than {limit} bytes")), "{e}");
        // What the server got out before the client hung up: the limit plus the sockets' buffers, not
        // the 100 MB it announced.
        assert!(written < 32 << 20, "the server wrote {written} bytes");
        assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    }

    #[test]
    fn answers_longer_than_max_tokens_are_cut_and_counted() {
        let long = "word ".repeat(5000);
        let (url, server) = serve(vec![Reply::Full(200, completion(&["a \\boxed{2}", &long]))]);
        let tok = tokenizer();
        let engine = OpenAi::new(&options(&url), &tok).unwrap();
        let mut keep = Keep::default();
        engine.complete(&one_job(), 2, &sampling(), &mut keep).unwrap();
        server.join().unwrap();
        let [short, cut] = &keep.0[0][..] else { panic!("{:?}", keep.0) };
        assert_eq!((short.text.as_str(), short.finish), ("a \\boxed{2}", FinishReason::Stop));
        assert_eq!((cut.tokens, cut.finish), (64, FinishReason::Length));
        assert_eq!(tok.encode(&cut.text, false).unwrap().len(), 64);
        assert!(long.starts_with(&cut.text) && cut.text.len() < 400, "{}", cut.text.len());
        assert_eq!(engine.cut_answers(), 1);
    }

    #[test]
    fn cutting_tokenises_a_prefix_of_the_asked_size() {
        let tok = tokenizer();
        // 64 tokens of a 50 MB answer: cut without tokenising the 50 MB (which takes minutes).
        let huge = "word ".repeat(10 << 20);
        let start = Instant::now();
        let (text, tokens, cut) = cut_to_tokens(&tok, huge, 64).unwrap();
        assert!(cut && tokens == 64 && text.len() < 400);
        assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
        // Multi-byte characters: the prefix ends on a character boundary.
        let (text, tokens, cut) = cut_to_tokens(&tok, "é".repeat(1000), 5).unwrap();
        assert!(cut && tokens == 5 && "é".repeat(1000).starts_with(&text), "{text}");
        assert_eq!(cut_to_tokens(&tok, "a b".into(), 5).unwrap(), ("a b".into(), 2, false));
    }

    #[test]
    fn a_stalled_response_fails_within_the_idle_timeout() {
        let (url, _server) = serve(vec![Reply::Stall]);
        let tok = tokenizer();
        let engine = OpenAi::new(&EngineOptions { idle_timeout_s: 1, ..options(&url) }, &tok).unwrap();
        let start = Instant::now();
        let e = engine.complete(&one_job(), 1, &sampling(), &mut Keep::default()).unwrap_err().to_string();
        let elapsed = start.elapsed();
        // request_timeout_s is 1800 s: the body's idle timeout ended it.
        assert!(e.contains("problem p-1") && e.to_lowercase().contains("timeout"), "{e}");
        assert!(elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(4), "{elapsed:?}");
    }

    #[test]
    fn a_malformed_200_is_retried() {
        let replies = vec![
            Reply::Full(200, "<html>upstream busy</html>".into()),
            Reply::Full(200, r#"{"choices":[]}"#.into()),
            Reply::Full(200, completion(&["7"])),
        ];
        let (url, server) = serve(replies);
        let tok = tokenizer();
        let engine = OpenAi::new(&EngineOptions { max_retries: 2, ..options(&url) }, &tok).unwrap();
        let mut keep = Keep::default();
        engine.complete(&one_job(), 1, &sampling(), &mut keep).unwrap();
        assert_eq!(server.join().unwrap().len(), 3);
        assert_eq!(keep.0[0][0].text, "7");
        // Without retries left, the same server is a failure naming the problem.
        let (url, _server) = serve(vec![Reply::Full(200, "<html>upstream busy</html>".into())]);
        let engine = OpenAi::new(&options(&url), &tok).unwrap();
        let e = engine.complete(&one_job(), 1, &sampling(), &mut Keep::default()).unwrap_err().to_string();
        assert!(e.contains("problem p-1: unreadable response"), "{e}");
    }
}
