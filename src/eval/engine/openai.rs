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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Completion, Engine, EngineOptions, Progress, PromptJob};
use crate::eval::generate::{FinishReason, SamplingParams};
use crate::eval::EvalError;
use crate::model::ChatTokenizer;

/// Responses larger than this are refused (64 samples of 32k tokens are about 10 MB).
const MAX_RESPONSE_BYTES: u64 = 1 << 30;
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
}

/// One choice of a response.
#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    index: usize,
    text: String,
    #[serde(default)]
    finish_reason: Option<String>,
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
    #[error("unreadable response: {0}")]
    BadResponse(String),
    #[error("{last} (after {retries} retries)")]
    GaveUp { retries: usize, last: Box<RequestError> },
}

impl RequestError {
    /// Worth trying again: connection problems, timeouts, 408 / 425 / 429 and server errors but 501.
    fn is_transient(&self) -> bool {
        match self {
            Self::Status { status, .. } => transient_status(*status),
            Self::Transport { transient, .. } => *transient,
            Self::BadResponse(_) => false,
            Self::GaveUp { last, .. } => last.is_transient(),
        }
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
    (vocab, fields_only): (usize, bool),
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
    }
}

/// The choices of a response body, in index order, as (text, finish reason).
fn parse_response(body: &str) -> Result<Vec<(String, FinishReason)>, RequestError> {
    let mut r: CompletionResponse = serde_json::from_str(body).map_err(|e| {
        let head: String = body.chars().take(200).collect();
        RequestError::BadResponse(format!("{e} in {head:?}"))
    })?;
    if r.choices.is_empty() {
        return Err(RequestError::BadResponse("no choices".into()));
    }
    r.choices.sort_by_key(|c| c.index);
    Ok(r.choices
        .into_iter()
        .map(|c| {
            let finish =
                if c.finish_reason.as_deref() == Some("length") { FinishReason::Length } else { FinishReason::Stop };
            (c.text, finish)
        })
        .collect())
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
    tok: &'a ChatTokenizer,
}

impl<'a> OpenAi<'a> {
    /// The engine the (validated) options describe; `tok` re-tokenises the samples to count them.
    pub fn new(options: &EngineOptions, tok: &'a ChatTokenizer) -> Result<Self, EvalError> {
        options.validate("--").map_err(EvalError::Engine)?;
        let base = options.base_url.as_deref().unwrap_or_default().trim_end_matches('/');
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(options.request_timeout_s)))
            .max_idle_connections_per_host(options.concurrency.max(1))
            .build()
            .into();
        Ok(Self {
            agent,
            url: format!("{base}/completions"),
            model: options.served_model.clone().unwrap_or_default(),
            api_key: options.api_key().map_err(EvalError::Engine)?,
            concurrency: options.concurrency.max(1),
            max_retries: options.max_retries,
            fields_only: options.openai_fields_only,
            tok,
        })
    }

    /// One POST of `body`, without retries.
    fn send(&self, body: &str) -> Result<Vec<(String, FinishReason)>, RequestError> {
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
        let text =
            resp.into_body().with_config().limit(MAX_RESPONSE_BYTES).read_to_string().map_err(transport_error)?;
        if status != 200 {
            let body: String = text.chars().take(500).collect();
            return Err(RequestError::Status { status, body, retry_after });
        }
        parse_response(&text)
    }

    /// POST `body`, retrying transient errors up to `max_retries` times; `stop` cuts the retries short.
    fn send_with_retries(&self, body: &str, stop: &AtomicBool) -> Result<Vec<(String, FinishReason)>, RequestError> {
        let mut retry = 0;
        loop {
            match self.send(body) {
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
            let fields = (self.tok.vocab_size(), self.fields_only);
            let req = build_request(&self.model, &job.text, n - samples.len(), sampling, sequence, fields);
            let body = serde_json::to_string(&req).map_err(|e| RequestError::BadResponse(e.to_string()))?;
            for (text, finish) in self.send_with_retries(&body, stop)?.into_iter().take(n - samples.len()) {
                let tokens = self.tok.encode(&text, false).map_err(|e| RequestError::BadResponse(e.to_string()))?.len();
                samples.push(Completion { text, tokens, finish });
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
        })
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
        let r = build_request("smol", "<|im_start|>user\nhi", 4, &sampling(), 12, (49152, false));
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
        let k = build_request("smol", "p", 1, &SamplingParams { top_k: 20, ..sampling() }, 0, (49152, false));
        assert_eq!(k.top_k, Some(20));
        let plain = serde_json::to_value(build_request("smol", "p", 1, &sampling(), 0, (49152, true))).unwrap();
        let keys: Vec<&String> = plain.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["model", "prompt", "n", "max_tokens", "temperature", "top_p", "seed", "stream"]);
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
        let c = parse_response(body).unwrap();
        assert_eq!(c, vec![("a \\boxed{2}".to_string(), FinishReason::Stop), (" b".to_string(), FinishReason::Length)]);
        // llama.cpp and older servers: no index, a null finish reason.
        let c = parse_response(r#"{"choices":[{"text":"x","finish_reason":null}]}"#).unwrap();
        assert_eq!(c, vec![("x".to_string(), FinishReason::Stop)]);
    }

    #[test]
    fn bad_responses_are_errors_that_are_not_retried() {
        for body in ["", "<html>502</html>", r#"{"choices":[]}"#, r#"{"object":"error","message":"x"}"#] {
            let e = parse_response(body).unwrap_err();
            assert!(matches!(e, RequestError::BadResponse(_)), "{body}: {e}");
            assert!(!e.is_transient());
        }
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
}
