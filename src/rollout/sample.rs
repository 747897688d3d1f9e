//! One batch of rollouts: the sampling policy answers each question with the KV-cache sampler, the
//! answers are scored by the reward module, and the behaviour log-probs of the sampled tokens are
//! recorded by a forward of the sampling weights.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::correction::{answer_correction, summarise, AnswerCorrection, RatioSummary};
use super::server::Sampled;
use super::{RolloutError, RolloutOptions};
use crate::data::{Group, Response};
use crate::eval::{generate, FinishReason, SamplingParams};
use crate::generate::{generate_paged, Generation, Request, Schedule};
use crate::model::{ChatTokenizer, Decoder, Targets, TokenBatch};
use crate::reward::judge;

/// What a batch of rollouts was like (the `rollout/*` fields of metrics.jsonl).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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
    /// Answers sampled (over every batch of the step).
    #[serde(rename = "rollout/answers")]
    pub answers: usize,
    /// Mean overlong penalty of the sampled answers (rollout.overlong_buffer_len; 0 when off).
    #[serde(rename = "rollout/overlong_penalty")]
    pub overlong_penalty: f64,
    /// Fraction of answers with an overlong penalty.
    #[serde(rename = "rollout/overlong_fraction")]
    pub overlong_fraction: f64,
    /// Batches of questions sampled this step (more than 1 with rollout.filter_groups).
    #[serde(rename = "rollout/gen_batches")]
    pub gen_batches: usize,
    /// Groups dropped by rollout.filter_groups for rewards that all agree.
    #[serde(rename = "rollout/groups_dropped")]
    pub groups_dropped: usize,
    /// Mean over sampled tokens of |log p_sampler - log p_grpo|: the sampler's log-prob of each token
    /// against grpo's forward of the same weights (the behaviour log-probs). ~0 for the native sampler
    /// (only the KV cache's rounding); absent when the sampler reports no log-probs.
    #[serde(rename = "rollout/sampling_logp_difference_mean", skip_serializing_if = "Option::is_none")]
    pub logp_diff_mean: Option<f64>,
    /// The largest such difference.
    #[serde(rename = "rollout/sampling_logp_difference_max", skip_serializing_if = "Option::is_none")]
    pub logp_diff_max: Option<f64>,
    /// Server answers whose log-probs did not match grpo's tokens (trained on without correction).
    #[serde(rename = "rollout/server_logprobs_unaligned")]
    pub server_unaligned: usize,
    /// rollout.importance_sampling_correction: the smallest ratio exp(log p_grpo - log p_sampler) (per
    /// token, or per answer at sequence level) before the cap.
    #[serde(rename = "rollout/importance_sampling_ratio_min", skip_serializing_if = "Option::is_none")]
    pub is_ratio_min: Option<f64>,
    /// Their mean.
    #[serde(rename = "rollout/importance_sampling_ratio_mean", skip_serializing_if = "Option::is_none")]
    pub is_ratio_mean: Option<f64>,
    /// Their largest.
    #[serde(rename = "rollout/importance_sampling_ratio_max", skip_serializing_if = "Option::is_none")]
    pub is_ratio_max: Option<f64>,
    /// The fraction of them above the cap: truncated to it (`*_truncate`) or masked (`*_mask`).
    #[serde(rename = "rollout/importance_sampling_capped_fraction", skip_serializing_if = "Option::is_none")]
    pub is_capped_fraction: Option<f64>,
    /// Generation overlapped with training (rollout.generation_ranks): the answers' staleness and each
    /// side's time.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub overlap: Option<super::remote::OverlapMetrics>,
}

/// Two batches' values of an optional metric: `f` of both, or the one present.
fn either(x: Option<f64>, y: Option<f64>, f: impl Fn(f64, f64) -> f64) -> Option<f64> {
    match (x, y) {
        (Some(x), Some(y)) => Some(f(x, y)),
        (x, y) => x.or(y),
    }
}

/// Mean and max of |log p_sampler - log p_grpo| over the tokens of the answers whose sampler reported
/// log-probs (`None` when none did).
fn logp_difference(samples: &[Sampled], behaviour: &[Vec<f32>]) -> Option<(f64, f64)> {
    let (mut sum, mut max, mut n) = (0f64, 0f64, 0usize);
    for (s, b) in samples.iter().zip(behaviour) {
        for (x, y) in s.sampler_logprobs.iter().flatten().zip(b) {
            let d = (*x as f64 - *y as f64).abs();
            sum += d;
            max = max.max(d);
            n += 1;
        }
    }
    (n > 0).then(|| (sum / n as f64, max))
}

impl RolloutMetrics {
    /// The metrics of this batch of rollouts and of `o`, another batch of the same step.
    pub fn merge(&mut self, o: &RolloutMetrics) {
        let (a, b) = (self.answers as f64, o.answers as f64);
        let n = (a + b).max(1.0);
        let mean = |x: f64, y: f64| (x * a + y * b) / n;
        let second =
            mean(self.reward_std.powi(2) + self.reward_mean.powi(2), o.reward_std.powi(2) + o.reward_mean.powi(2));
        let reward_mean = mean(self.reward_mean, o.reward_mean);
        let time = self.generation_time + o.generation_time;
        *self = RolloutMetrics {
            reward_mean,
            reward_std: (second - reward_mean.powi(2)).max(0.0).sqrt(),
            mean_length: mean(self.mean_length, o.mean_length),
            truncated_fraction: mean(self.truncated_fraction, o.truncated_fraction),
            extract_rate: mean(self.extract_rate, o.extract_rate),
            generation_time: time,
            tokens_per_sec: (self.tokens_per_sec * self.generation_time + o.tokens_per_sec * o.generation_time)
                / time.max(1e-9),
            updates: self.updates.max(o.updates),
            answers: self.answers + o.answers,
            overlong_penalty: mean(self.overlong_penalty, o.overlong_penalty),
            overlong_fraction: mean(self.overlong_fraction, o.overlong_fraction),
            gen_batches: self.gen_batches + o.gen_batches,
            groups_dropped: self.groups_dropped + o.groups_dropped,
            server_cut: self.server_cut + o.server_cut,
            logp_diff_mean: either(self.logp_diff_mean, o.logp_diff_mean, mean),
            logp_diff_max: either(self.logp_diff_max, o.logp_diff_max, f64::max),
            server_unaligned: self.server_unaligned + o.server_unaligned,
            is_ratio_min: either(self.is_ratio_min, o.is_ratio_min, f64::min),
            is_ratio_mean: either(self.is_ratio_mean, o.is_ratio_mean, mean),
            is_ratio_max: either(self.is_ratio_max, o.is_ratio_max, f64::max),
            is_capped_fraction: either(self.is_capped_fraction, o.is_capped_fraction, mean),
            overlap: self.overlap.clone().or_else(|| o.overlap.clone()),
        };
    }

    /// The metrics of one batch whose questions were shared among ranks, from each rank's metrics of its
    /// share: as [`Self::merge`] of the shares, but the ranks sampled at the same time, so the batch took
    /// the slowest rank's time, the throughputs add up, and it is one batch.
    pub(super) fn over_ranks<'a>(ranks: impl Iterator<Item = &'a RolloutMetrics>) -> RolloutMetrics {
        let mut all: Option<RolloutMetrics> = None;
        let (mut time, mut rate, mut batches) = (0f64, 0f64, 0usize);
        for m in ranks {
            time = time.max(m.generation_time);
            rate += m.tokens_per_sec;
            batches = batches.max(m.gen_batches);
            match &mut all {
                Some(a) => a.merge(m),
                None => all = Some(m.clone()),
            }
        }
        let mut all = all.unwrap_or_default();
        all.generation_time = time;
        all.tokens_per_sec = rate;
        all.gen_batches = batches;
        all
    }
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
    sample_groups_ticking(sampler, tok, questions, opts, params, micro, &mut || {})
}

/// [`sample_groups`], calling `tick` after each decode step: how a rank keeps its place in the ranks'
/// waiting rounds ([`crate::dist::Apart`]) while it samples.
pub(super) fn sample_groups_ticking(
    sampler: &Decoder,
    tok: &ChatTokenizer,
    questions: &[Group],
    opts: &RolloutOptions,
    params: &SamplingParams,
    micro: usize,
    tick: &mut dyn FnMut(),
) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
    let start = Instant::now();
    let bar = crate::progress::progress_bar(None, "rollout");
    bar.set_message("tokens generated");
    let samples = native_samples(sampler, tok, questions, opts, params, |n| {
        bar.inc(n as u64);
        tick();
    })?;
    bar.finish_and_clear();
    score_groups_ticking(sampler, tok, questions, opts, samples, micro, start, tick)
}

/// `opts.sampled()` generations of `sampler` for each question, in question order: answer j of group g
/// from the stream `g.index * n + j`, by the schedule of `opts.generation`.
fn generate_answers(
    sampler: &Decoder,
    tok: &ChatTokenizer,
    questions: &[Group],
    opts: &RolloutOptions,
    params: &SamplingParams,
    on_tokens: &mut impl FnMut(usize),
) -> Result<Vec<Generation>, RolloutError> {
    let k = opts.sampled();
    let (stop, pad) = (tok.eos_ids(), tok.pad_id());
    if opts.generation.schedule == Schedule::Static {
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
            gens.extend(generate(sampler, p, i, params, stop, pad, &mut *on_tokens)?);
        }
        return Ok(gens);
    }
    let requests: Vec<Request> =
        questions.iter().map(|g| Request::new(g.prompt_tokens.clone(), (g.index * opts.n) as u64, k)).collect();
    let mut out: Vec<Option<Vec<Generation>>> = vec![None; requests.len()];
    let mut skipped = Vec::new();
    generate_paged::<RolloutError>(
        sampler,
        &requests,
        params,
        (stop, opts.batch_size),
        &opts.generation,
        on_tokens,
        |r, g| {
            match g {
                Ok(g) => out[r] = Some(g),
                Err(why) => skipped.push(format!("question {}: {why}", questions[r].index)),
            }
            Ok(())
        },
    )?;
    if !skipped.is_empty() {
        return Err(RolloutError::Generation(skipped.join("; ")));
    }
    Ok(out.into_iter().flatten().flatten().collect())
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
    let gens = generate_answers(sampler, tok, questions, opts, params, &mut on_tokens)?;
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
            let mut logprobs = g.logprobs;
            logprobs.truncate(tokens.len());
            Ok(Sampled { tokens, text, finish: g.finish, generated, sampler_logprobs: Some(logprobs) })
        })
        .collect()
}

/// The groups of `questions` with their answers replaced by `samples` (`opts.sampled()` per question, in
/// question order; plus the first `opts.teacher_answers` teacher answers of each), scored (1 correct, 0
/// not, plus the overlong penalty), each sampled answer carrying the log-probs of its tokens under
/// `sampler` (the weights that wrote it).
pub(super) fn score_groups(
    sampler: &Decoder,
    tok: &ChatTokenizer,
    questions: &[Group],
    opts: &RolloutOptions,
    samples: Vec<Sampled>,
    micro: usize,
    start: Instant,
) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
    score_groups_ticking(sampler, tok, questions, opts, samples, micro, start, &mut || {})
}

/// [`score_groups`], calling `tick` after each micro-batch of the behaviour forward.
#[allow(clippy::too_many_arguments)]
fn score_groups_ticking(
    sampler: &Decoder,
    tok: &ChatTokenizer,
    questions: &[Group],
    opts: &RolloutOptions,
    samples: Vec<Sampled>,
    micro: usize,
    start: Instant,
    tick: &mut dyn FnMut(),
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
    let behaviour = behaviour_logprobs_ticking(sampler, &prompts, &responses, micro, tok.pad_id(), tick)?;
    let logp_diff = logp_difference(&samples, &behaviour);
    let (mut is_weights, ratios) = corrections(opts, &samples, &behaviour);
    let mut out = Vec::with_capacity(questions.len());
    let mut rewards = Vec::with_capacity(samples.len());
    let mut extracted = 0usize;
    let penalties: Vec<f32> = samples.iter().map(|s| opts.overlong_penalty(s.generated)).collect();
    let mut penalty = penalties.iter();
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
                reward: if correct { 1.0 } else { 0.0 } + penalty.next().copied().unwrap_or(0.0),
                answer,
                truncated: s.finish == FinishReason::Length,
                teacher_logprobs: Some(logp),
                is_weights: is_weights.next().flatten(),
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
        answers: samples.len(),
        overlong_penalty: penalties.iter().map(|&p| p as f64).sum::<f64>() / n,
        overlong_fraction: penalties.iter().filter(|&&p| p < 0.0).count() as f64 / n,
        gen_batches: 1,
        groups_dropped: 0,
        logp_diff_mean: logp_diff.map(|d| d.0),
        logp_diff_max: logp_diff.map(|d| d.1),
        server_unaligned: 0,
        is_ratio_min: ratios.map(|r| r.min),
        is_ratio_mean: ratios.map(|r| r.mean),
        is_ratio_max: ratios.map(|r| r.max),
        is_capped_fraction: ratios.map(|r| r.capped_fraction),
        overlap: None,
    };
    Ok((out, metrics))
}

/// With `opts.importance_sampling_correction`, the weights of each sampled answer's tokens (`None` for
/// an answer whose sampler reported no log-probs: no correction) and the summary of their ratios.
fn corrections(
    opts: &RolloutOptions,
    samples: &[Sampled],
    behaviour: &[Vec<f32>],
) -> (std::vec::IntoIter<Option<Vec<f32>>>, Option<RatioSummary>) {
    if !opts.importance_sampling_correction {
        return (vec![None; samples.len()].into_iter(), None);
    }
    let (mode, cap) = (opts.importance_sampling_mode, opts.importance_sampling_cap);
    let each: Vec<Option<AnswerCorrection>> = samples
        .iter()
        .zip(behaviour)
        .map(|(s, b)| s.sampler_logprobs.as_ref().map(|lp| answer_correction(b, lp, mode, cap)))
        .collect();
    let summary = summarise(&each.iter().flatten().cloned().collect::<Vec<_>>());
    (each.into_iter().map(|c| c.map(|c| c.weights)).collect::<Vec<_>>().into_iter(), summary)
}

/// The f32 log-prob of each response token under `model` (no graph), `micro` sequences per forward.
pub fn behaviour_logprobs(
    model: &Decoder,
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    micro: usize,
    pad: u32,
) -> candle_core::Result<Vec<Vec<f32>>> {
    behaviour_logprobs_ticking(model, prompts, responses, micro, pad, &mut || {})
}

/// [`behaviour_logprobs`], calling `tick` after each micro-batch.
fn behaviour_logprobs_ticking(
    model: &Decoder,
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    micro: usize,
    pad: u32,
    tick: &mut dyn FnMut(),
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
        tick();
    }
    Ok(out)
}
