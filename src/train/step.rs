//! One optimisation step's gradient: groups -> advantages and aggregation weights over the whole batch
//! -> micro-batches of sequences -> forward/backward with the objective -> accumulated gradients.

use candle_core::Tensor;

use crate::data::Group;
use crate::model::{Decoder, Grads, Targets, TokenBatch};
use crate::objective::{LossAgg, Objective, TokenInputs};

/// One answer to train on.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub prompt: std::sync::Arc<Vec<u32>>,
    pub response: Vec<u32>,
    pub teacher_logprobs: Option<Vec<f32>>,
    pub advantage: f32,
    /// Aggregation weight of each of its tokens.
    pub weight: f32,
    pub reward: f32,
}

/// The sequences of a step and the reward statistics of its groups.
#[derive(Debug, Clone, Default)]
pub struct StepBatch {
    pub seqs: Vec<Sequence>,
    pub questions: usize,
    pub responses: usize,
    pub reward_mean: f32,
    /// Mean over groups of the within-group standard deviation of rewards.
    pub reward_std: f32,
    pub frac_reward_zero_std: f32,
    pub frac_bias_applied: f32,
    pub mean_response_length: f32,
}

/// Turn groups into sequences with advantages and batch-wide aggregation weights.
pub fn build_batch(groups: &[Group], objective: &dyn Objective, agg: LossAgg, norm_len: usize) -> StepBatch {
    let mut seqs = Vec::new();
    let mut include = Vec::new();
    let (mut rewards_all, mut std_sum, mut zero_std, mut biased) = (Vec::new(), 0f64, 0usize, 0usize);
    for g in groups {
        let rewards: Vec<f32> = g.responses.iter().map(|r| r.reward).collect();
        let n = rewards.len();
        let mean = rewards.iter().sum::<f32>() / n.max(1) as f32;
        let var = if n > 1 { rewards.iter().map(|r| (r - mean).powi(2)).sum::<f32>() / (n - 1) as f32 } else { 0.0 };
        std_sum += var.sqrt() as f64;
        zero_std += usize::from(var == 0.0);
        let (adv, bias) = objective.advantages(&rewards);
        biased += usize::from(bias);
        let inc = objective.include(&rewards);
        let prompt = std::sync::Arc::new(g.prompt_tokens.clone());
        for ((r, a), i) in g.responses.iter().zip(adv).zip(inc) {
            seqs.push(Sequence {
                prompt: prompt.clone(),
                response: r.tokens.clone(),
                teacher_logprobs: r.teacher_logprobs.clone(),
                advantage: a,
                weight: 0.0,
                reward: r.reward,
            });
            include.push(i && !r.tokens.is_empty());
            rewards_all.push(r.reward);
        }
    }
    let lengths: Vec<usize> = seqs.iter().map(|s| s.response.len()).collect();
    let weights = agg.weights(&lengths, &include, norm_len);
    for (s, w) in seqs.iter_mut().zip(weights) {
        s.weight = w;
    }
    let q = groups.len().max(1) as f32;
    let responses = seqs.len();
    let out = StepBatch {
        questions: groups.len(),
        responses,
        reward_mean: rewards_all.iter().sum::<f32>() / responses.max(1) as f32,
        reward_std: (std_sum / q as f64) as f32,
        frac_reward_zero_std: zero_std as f32 / q,
        frac_bias_applied: biased as f32 / q,
        mean_response_length: lengths.iter().sum::<usize>() as f32 / responses.max(1) as f32,
        seqs: seqs.into_iter().zip(include).filter(|(_, i)| *i).map(|(s, _)| s).collect(),
    };
    out
}

/// Sums over a step's micro-batches.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStats {
    pub loss: f64,
    pub pg_loss: f64,
    pub kl: f64,
    pub clipped_tokens: usize,
    pub response_tokens: usize,
    pub entropy_sum: f64,
    /// Prompt + response tokens processed (policy forward).
    pub tokens: usize,
}

/// The gradient of the whole batch, computed `micro` sequences at a time.
pub fn compute_gradients(
    policy: &Decoder,
    reference: Option<&Decoder>,
    objective: &dyn Objective,
    batch: &StepBatch,
    micro: usize,
    pad: u32,
) -> candle_core::Result<(Grads, StepStats)> {
    let device = policy.device().clone();
    let mut total: Option<Grads> = None;
    let mut stats = StepStats::default();
    for chunk in batch.seqs.chunks(micro.max(1)) {
        let full: Vec<Vec<u32>> = chunk.iter().map(|s| [s.prompt.as_slice(), &s.response].concat()).collect();
        let tb = TokenBatch::padded(&full, pad);
        let mut targets = Targets::default();
        let (mut adv, mut w, mut teacher) = (Vec::new(), Vec::new(), Vec::new());
        let any_teacher = chunk.iter().any(|s| s.teacher_logprobs.is_some());
        for (r, s) in chunk.iter().enumerate() {
            let p = s.prompt.len();
            for (j, _) in s.response.iter().enumerate() {
                targets.push(r, p + j);
                adv.push(s.advantage);
                w.push(s.weight);
                // Rows without teacher log-probs keep the probability-1 assumption (log-prob 0).
                teacher.push(s.teacher_logprobs.as_ref().and_then(|t| t.get(j).copied()).unwrap_or(0.0));
            }
        }
        let n = targets.len();
        stats.response_tokens += n;
        stats.tokens += tb.num_tokens();
        let ref_logp = match (reference, objective.beta() > 0.0) {
            (Some(r), true) => Some(r.token_logprobs(&tb, &targets, false)?.narrow(1, 0, 1)?.squeeze(1)?),
            (None, true) => candle_core::bail!("objective has beta > 0 but no reference model was loaded"),
            _ => None,
        };
        let advantages = Tensor::from_vec(adv, n, &device)?;
        let weights = Tensor::from_vec(w, n, &device)?;
        let teacher = if any_teacher { Some(Tensor::from_vec(teacher, n, &device)?) } else { None };
        let needs_old = objective.needs_old_logprobs();
        let (mut pg, mut kl, mut clipped, mut ent) = (0f64, 0f64, 0usize, 0f64);
        let mut loss_fn = |lp: &Tensor| -> candle_core::Result<Tensor> {
            let logp = lp.narrow(1, 0, 1)?.squeeze(1)?;
            ent += lp.narrow(1, 1, 1)?.sum_all()?.to_scalar::<f32>()? as f64;
            let behaviour = if needs_old { Some(logp.detach()) } else { teacher.clone() };
            let inputs = TokenInputs {
                advantages: advantages.clone(),
                weights: weights.clone(),
                ref_logp: ref_logp.clone(),
                behaviour_logp: behaviour,
            };
            let terms = objective.loss(&logp, &inputs)?;
            pg += terms.pg_loss as f64;
            kl += terms.kl as f64;
            clipped += terms.clipped_tokens;
            Ok(terms.loss)
        };
        let (loss, grads) = policy.forward_backward(&tb, &targets, &mut loss_fn)?;
        stats.loss += loss as f64;
        stats.pg_loss += pg;
        stats.kl += kl;
        stats.clipped_tokens += clipped;
        stats.entropy_sum += ent;
        match &mut total {
            None => total = Some(grads),
            Some(t) => t.accumulate(grads)?,
        }
    }
    let grads = match total {
        Some(g) => g,
        None => Grads { grads: vec![None; policy.params().len()] },
    };
    Ok((grads, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Response;
    use crate::model::{random_decoder, Arch, ModelConfig};
    use crate::objective::{ObjectiveConfig, ObjectiveName};
    use candle_core::{DType, Device};

    fn group(i: usize, rewards: &[f32]) -> Group {
        Group {
            index: i,
            question_id: format!("q{i}"),
            domain: None,
            source: None,
            prompt_tokens: vec![1, 5 + i as u32, 7, 9],
            responses: rewards
                .iter()
                .enumerate()
                .map(|(j, &r)| Response {
                    tokens: (0..(3 + 2 * j + i) as u32).map(|t| (t * 7 + j as u32 * 3 + i as u32) % 60 + 2).collect(),
                    reward: r,
                    answer: None,
                    truncated: false,
                    teacher_logprobs: None,
                })
                .collect(),
            majority: None,
            majority_count: 0,
            vote_margin: 0,
        }
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    #[test]
    fn micro_batch_split_never_changes_the_gradient() {
        let cfg = ModelConfig::tiny(Arch::Qwen2, 64, 2, 16, 4, 2, 24, None, None).unwrap();
        let policy = random_decoder(cfg, 5, DType::F32, &Device::Cpu, true).unwrap();
        let reference = policy.frozen_copy().unwrap();
        let groups =
            vec![group(0, &[1.0, 0.0, 1.0, 0.0]), group(1, &[1.0, 1.0, 1.0, 1.0]), group(2, &[0.0, 1.0, 1.0, 1.0])];
        for (name, agg) in [
            (ObjectiveName::OffGrpo, LossAgg::SeqMeanTokenMean),
            (ObjectiveName::Grpo, LossAgg::TokenMean),
            (ObjectiveName::Sft, LossAgg::SeqMeanTokenSumNorm),
        ] {
            let oc = ObjectiveConfig {
                name,
                bias: if name == ObjectiveName::Sft { 0.0 } else { 0.5 },
                beta: 0.1,
                loss_agg: agg,
                ..Default::default()
            };
            let obj = oc.build();
            let batch = build_batch(&groups, obj.as_ref(), agg, 32);
            let (g1, s1) = compute_gradients(&policy, Some(&reference), obj.as_ref(), &batch, usize::MAX, 0).unwrap();
            for micro in [1, 2, 4] {
                let (g, s) = compute_gradients(&policy, Some(&reference), obj.as_ref(), &batch, micro, 0).unwrap();
                assert!((s.loss - s1.loss).abs() < 1e-5, "{name:?} micro {micro}: loss {} vs {}", s.loss, s1.loss);
                for (a, b) in g.grads.iter().zip(&g1.grads) {
                    let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
                    let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                    assert!(d < 1e-5, "{name:?} micro {micro}: gradient differs by {d}");
                }
            }
        }
    }

    #[test]
    fn batch_statistics_and_weights() {
        let oc = ObjectiveConfig { bias: 0.5, ..Default::default() };
        let obj = oc.build();
        let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0]), group(1, &[1.0; 4])];
        let b = build_batch(&groups, obj.as_ref(), LossAgg::SeqMeanTokenMean, 0);
        assert_eq!(b.seqs.len(), 8);
        assert!((b.reward_mean - 0.75).abs() < 1e-6);
        assert_eq!(b.frac_bias_applied, 0.5);
        assert_eq!(b.frac_reward_zero_std, 0.5);
        // Each answer's weights sum to 1/8.
        for s in &b.seqs {
            assert!((s.weight * s.response.len() as f32 - 0.125).abs() < 1e-6);
        }
        assert!(b.seqs[4..].iter().all(|s| s.advantage == 0.5));
    }
}
