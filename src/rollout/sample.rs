//! One batch of rollouts: the sampling policy answers each question with the KV-cache sampler, the
//! answers are scored by the reward module, and the behaviour log-probs of the sampled tokens are
//! recorded by a forward of the sampling weights.

use std::time::Instant;

use serde::Serialize;

use super::server::Sampled;
use super::{RolloutError, RolloutOptions};
use crate::data::{Group, Response};
use crate::eval::{generate, FinishReason, SamplingParams};
use crate::model::{ChatTokenizer, Decoder, Targets, TokenBatch};
use crate::reward::judge;

/// What a batch of rollouts was like (the `rollout/*` fields of metrics.jsonl).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RolloutMetrics {
    /// Mean reward of the sampled answers.
    #[serde(rename = "rollout/reward_mean")]
    pub reward_mean: f64,
    /// Standard deviation of the sampled answers' rewards (over the whole batch).
    #[serde(rename = "rollout/reward_std")]
    pub reward_std: f64,
    /// Mean number of generated tokens per answer (EOS included).
    #[serde(rename = "rollout/mean_length")]
    pub mean_length: f64,
    /// Fraction of answers cut at rollout.max_new_tokens.
    #[serde(rename = "rollout/truncated_fraction")]
    pub truncated_fraction: f64,
    /// Fraction of answers with an extracted answer.
    #[serde(rename = "rollout/extract_rate")]
    pub extract_rate: f64,
    /// Seconds spent sampling (generation, scoring and the behaviour forward).
    #[serde(rename = "rollout/generation_time")]
    pub generation_time: f64,
    /// Generated tokens per second of generation.
    #[serde(rename = "rollout/tokens_per_sec")]
    pub tokens_per_sec: f64,
    /// Answers the server returned longer than rollout.max_new_tokens (it ignored max_tokens), cut to it
    /// (always 0 with grpo's sampler).
    #[serde(rename = "rollout/server_cut")]
    pub server_cut: usize,
    /// Optimiser updates made on these rollouts.
    #[serde(rename = "rollout/updates")]
    pub updates: usize,
}

/// The groups of `questions` with their answers replaced by `opts.sampled()` answers of `sampler` (plus
/// the first `opts.teacher_answers` teacher answers of each), scored against each question's label (the
/// majority vote over the group without one). Each sampled answer carries its behaviour log-probs in
/// `teacher_logprobs`: the log-prob of each of its tokens under the sampling weights. Answer j of group
/// `g` draws from the stream `g.index * n + j` of `params.seed`, so a batch is a pure function of the
/// sampling weights, the questions and the seed.
pub fn sample_groups(
    sampler: &Decoder,
    tok: &ChatTokenizer,
    questions: &[Group],
    opts: &RolloutOptions,
    params: &SamplingParams,
    micro: usize,
) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
    let start = Instant::now();
    let bar = crate::progress::progress_bar(None, "rollout");
    bar.set_message("tokens generated");
    let samples = native_samples(sampler, tok, questions, opts, params, |n| bar.inc(n as u64))?;
    bar.finish_and_clear();
    score_groups(sampler, tok, questions, opts, samples, micro, start)
}

/// `opts.sampled()` answers of `sampler` to each question, in question order.
fn native_samples(
    sampler: &Decoder,
    tok: &ChatTokenizer,
    questions: &[Group],
    opts: &RolloutOptions,
    params: &SamplingParams,
    mut on_tokens: impl FnMut(usize),
) -> Result<Vec<Sampled>, RolloutError> {
    let k = opts.sampled();
    let mut prompts = Vec::with_capacity(questions.len() * k);
    let mut ids = Vec::with_capacity(questions.len() * k);
    for g in questions {
        for j in 0..k {
            prompts.push(g.prompt_tokens.clone());
            ids.push((g.index * opts.n + j) as u64);
        }
    }
    let mut gens = Vec::with_capacity(prompts.len());
    let per_batch = opts.batch_size.max(1);
    for (p, i) in prompts.chunks(per_batch).zip(ids.chunks(per_batch)) {
        gens.extend(generate(sampler, p, i, params, tok.eos_ids(), tok.pad_id(), &mut on_tokens)?);
    }
    // A stopped answer ends with its EOS, as the teacher's answers do: the policy learns to stop.
    let eos = tok.eos_ids().first().copied();
    gens.into_iter()
        .map(|g| {
            let text = tok.decode(&g.tokens, true)?;
            let generated = g.tokens.len();
            let tokens = match (g.finish, eos) {
                (FinishReason::Stop, Some(e)) => [g.tokens.as_slice(), &[e]].concat(),
                _ => g.tokens,
            };
            Ok(Sampled { tokens, text, finish: g.finish, generated })
        })
        .collect()
}

/// The groups of `questions` with their answers replaced by `samples` (`opts.sampled()` per question, in
/// question order; plus the first `opts.teacher_answers` teacher answers of each), scored, each sampled
/// answer carrying the log-probs of its tokens under `sampler` (the weights that wrote it).
pub(super) fn score_groups(
    sampler: &Decoder,
    tok: &ChatTokenizer,
    questions: &[Group],
    opts: &RolloutOptions,
    samples: Vec<Sampled>,
    micro: usize,
    start: Instant,
) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
    let k = opts.sampled();
    if samples.len() != questions.len() * k {
        return Err(RolloutError::Invalid(format!(
            "{} answers for {} questions of {k} answers",
            samples.len(),
            questions.len()
        )));
    }
    let gen_time = start.elapsed().as_secs_f64();
    let generated: usize = samples.iter().map(|s| s.generated).sum();
    let prompts: Vec<Vec<u32>> =
        questions.iter().flat_map(|g| std::iter::repeat_n(g.prompt_tokens.clone(), k)).collect();
    let responses: Vec<Vec<u32>> = samples.iter().map(|s| s.tokens.clone()).collect();
    let behaviour = behaviour_logprobs(sampler, &prompts, &responses, micro, tok.pad_id())?;
    let mut out = Vec::with_capacity(questions.len());
    let mut rewards = Vec::with_capacity(samples.len());
    let mut extracted = 0usize;
    let mut items = samples.iter().zip(behaviour);
    for q in questions {
        let mine: Vec<_> = items.by_ref().take(k).collect();
        let texts: Vec<String> = mine.iter().map(|(s, _)| s.text.clone()).collect();
        let v = judge(q.majority.as_deref(), &texts, &opts.extract());
        extracted += v.preds.iter().filter(|p| p.is_some()).count();
        let mut answers: Vec<Response> = mine
            .into_iter()
            .zip(v.preds.into_iter().zip(v.correct))
            .map(|((s, logp), (answer, correct))| Response {
                tokens: s.tokens.clone(),
                reward: if correct { 1.0 } else { 0.0 },
                answer,
                truncated: s.finish == FinishReason::Length,
                teacher_logprobs: Some(logp),
            })
            .collect();
        rewards.extend(answers.iter().map(|r| r.reward as f64));
        answers.extend(q.responses.iter().take(opts.teacher_answers).cloned());
        out.push(Group { responses: answers, ..q.clone() });
    }
    let n = samples.len().max(1) as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let metrics = RolloutMetrics {
        reward_mean: mean,
        reward_std: (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt(),
        mean_length: samples.iter().map(|s| s.tokens.len() as f64).sum::<f64>() / n,
        truncated_fraction: samples.iter().filter(|s| s.finish == FinishReason::Length).count() as f64 / n,
        extract_rate: extracted as f64 / n,
        generation_time: start.elapsed().as_secs_f64(),
        tokens_per_sec: generated as f64 / gen_time.max(1e-9),
        server_cut: 0,
        updates: 0,
    };
    Ok((out, metrics))
}

/// The f32 log-prob of each response token under `model` (no graph), `micro` sequences per forward.
pub fn behaviour_logprobs(
    model: &Decoder,
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    micro: usize,
    pad: u32,
) -> candle_core::Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(responses.len());
    let pairs: Vec<(&Vec<u32>, &Vec<u32>)> = prompts.iter().zip(responses).collect();
    for chunk in pairs.chunks(micro.max(1)) {
        let seqs: Vec<Vec<u32>> = chunk.iter().map(|(p, r)| [p.as_slice(), r.as_slice()].concat()).collect();
        let mut targets = Targets::default();
        for (row, (p, r)) in chunk.iter().enumerate() {
            (0..r.len()).for_each(|j| targets.push(row, p.len() + j));
        }
        let flat: Vec<f32> = if targets.is_empty() {
            Vec::new()
        } else {
            let lp = model.token_logprobs(&TokenBatch::padded(&seqs, pad), &targets, false)?;
            lp.narrow(1, 0, 1)?.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?
        };
        let mut at = 0;
        for (_, r) in chunk {
            out.push(flat[at..at + r.len()].to_vec());
            at += r.len();
        }
    }
    Ok(out)
}
