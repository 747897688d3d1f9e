//! One optimisation step: groups -> advantages and aggregation weights over the whole batch -> micro-batches
//! of sequences -> forward/backward with the objective -> accumulated gradients -> clipped update.
//!
//! [`TrainStep`] is the step as `grpo train`, `grpo bench train-step` and the tests run it.

use candle_core::Tensor;

use super::optim::{clip_scale, grad_norm, OptimConfig, Optimizer};
use crate::data::Group;
use crate::model::{Decoder, Grads, Targets, TokenBatch};
use crate::objective::{LossAgg, Objective, ObjectiveConfig, TokenInputs};

/// One training step's objective, batching and optimiser; the optimiser state lives here between steps.
pub struct TrainStep {
    objective: Box<dyn Objective>,
    loss_agg: LossAgg,
    /// The length normaliser of `seq-mean-token-sum-norm` (the response-token limit).
    norm_len: usize,
    micro_batch: usize,
    pad: u32,
    grad_clip: f64,
    optimizer: Optimizer,
}

/// What one step did.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    /// The reward statistics of the step's groups.
    pub rewards: RewardSummary,
    /// Loss terms and token counts, summed over the micro-batches.
    pub stats: StepStats,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// False when the loss or the gradient was not finite: the update was skipped.
    pub applied: bool,
}

impl TrainStep {
    /// A step of `objective` for `policy`'s parameters: `micro_batch` sequences per forward/backward,
    /// `norm_len` the response-token limit, `pad` the padding token.
    pub fn new(
        objective: &ObjectiveConfig,
        optim: &OptimConfig,
        policy: &Decoder,
        micro_batch: usize,
        norm_len: usize,
        pad: u32,
    ) -> candle_core::Result<Self> {
        Ok(Self {
            objective: objective.build(),
            loss_agg: objective.loss_agg,
            norm_len,
            micro_batch: micro_batch.max(1),
            pad,
            grad_clip: optim.grad_clip,
            optimizer: Optimizer::new(optim.clone(), policy.names(), &policy.vars())?,
        })
    }

    /// The objective's name.
    pub fn objective_name(&self) -> &'static str {
        self.objective.name()
    }

    /// Whether the objective needs a frozen reference model (its KL term).
    pub fn needs_reference(&self) -> bool {
        self.objective.needs_reference()
    }

    /// The optimiser (its state is saved with each checkpoint).
    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.optimizer
    }

    /// Train `policy` on `groups` at learning rate `lr`. `reference` must be given exactly when
    /// [`TrainStep::needs_reference`] says so.
    pub fn run(
        &mut self,
        policy: &Decoder,
        reference: Option<&Decoder>,
        groups: &[Group],
        lr: f64,
    ) -> candle_core::Result<StepReport> {
        let reference = match (reference, self.needs_reference()) {
            (Some(r), true) => Some(r),
            (None, false) => None,
            (None, true) => candle_core::bail!("{} needs a reference model (beta > 0)", self.objective.name()),
            (Some(_), false) => candle_core::bail!("{} has no KL term: pass no reference model", self.objective.name()),
        };
        let batch = build_batch(groups, self.objective.as_ref(), self.loss_agg, self.norm_len);
        let (grads, stats) =
            compute_gradients(policy, reference, self.objective.as_ref(), &batch, self.micro_batch, self.pad)?;
        let norm = grad_norm(&grads)?;
        let applied = stats.loss.is_finite() && norm.is_finite();
        if applied {
            self.optimizer.step(&grads, lr, clip_scale(norm, self.grad_clip))?;
        }
        Ok(StepReport { rewards: batch.rewards, stats, grad_norm: norm, applied })
    }
}

/// One answer to train on.
#[derive(Debug, Clone)]
struct Sequence {
    prompt: std::sync::Arc<Vec<u32>>,
    response: Vec<u32>,
    teacher_logprobs: Option<Vec<f32>>,
    advantage: f32,
    /// Aggregation weight of each of its tokens.
    weight: f32,
}

/// Reward statistics of a step's groups.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RewardSummary {
    pub questions: usize,
    pub responses: usize,
    pub reward_mean: f32,
    /// Mean over groups of the within-group standard deviation of rewards.
    pub reward_std: f32,
    pub frac_reward_zero_std: f32,
    pub frac_bias_applied: f32,
    pub mean_response_length: f32,
}

/// The sequences of a step and the reward statistics of its groups.
#[derive(Debug, Clone, Default)]
struct StepBatch {
    seqs: Vec<Sequence>,
    rewards: RewardSummary,
}

/// Turn groups into sequences with advantages and batch-wide aggregation weights.
fn build_batch(groups: &[Group], objective: &dyn Objective, agg: LossAgg, norm_len: usize) -> StepBatch {
    let mut seqs = Vec::new();
    let mut include = Vec::new();
    let (mut reward_sum, mut std_sum, mut zero_std, mut biased) = (0f64, 0f64, 0usize, 0usize);
    for g in groups {
        let rewards: Vec<f32> = g.responses.iter().map(|r| r.reward).collect();
        let adv = objective.advantages(&rewards);
        std_sum += adv.rewards.std;
        zero_std += usize::from(adv.rewards.std == 0.0);
        biased += usize::from(adv.bias_applied);
        reward_sum += rewards.iter().map(|&r| r as f64).sum::<f64>();
        let inc = objective.include(&rewards);
        let prompt = std::sync::Arc::new(g.prompt_tokens.clone());
        for ((r, a), i) in g.responses.iter().zip(adv.advantages).zip(inc) {
            seqs.push(Sequence {
                prompt: prompt.clone(),
                response: r.tokens.clone(),
                teacher_logprobs: r.teacher_logprobs.clone(),
                advantage: a,
                weight: 0.0,
            });
            include.push(i && !r.tokens.is_empty());
        }
    }
    let lengths: Vec<usize> = seqs.iter().map(|s| s.response.len()).collect();
    let weights = agg.weights(&lengths, &include, norm_len);
    for (s, w) in seqs.iter_mut().zip(weights) {
        s.weight = w;
    }
    let q = groups.len().max(1) as f32;
    let responses = seqs.len();
    let rewards = RewardSummary {
        questions: groups.len(),
        responses,
        reward_mean: (reward_sum / responses.max(1) as f64) as f32,
        reward_std: (std_sum / q as f64) as f32,
        frac_reward_zero_std: zero_std as f32 / q,
        frac_bias_applied: biased as f32 / q,
        mean_response_length: lengths.iter().sum::<usize>() as f32 / responses.max(1) as f32,
    };
    StepBatch { seqs: seqs.into_iter().zip(include).filter(|(_, i)| *i).map(|(s, _)| s).collect(), rewards }
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

/// The gradient of the whole batch, computed `micro` sequences at a time; the reference's log-probs (and
/// with them the KL term) when a reference is given.
fn compute_gradients(
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
        let ref_logp = match reference {
            Some(r) => Some(r.token_logprobs(&tb, &targets, false)?.narrow(1, 0, 1)?.squeeze(1)?),
            None => None,
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
    use crate::model::tiny::TinyShape;
    use crate::model::{random_decoder, Arch};
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
        let cfg = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Qwen2, 64, None, None)
            .unwrap();
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
    fn a_step_updates_the_policy_and_needs_a_reference_exactly_with_kl() {
        let cfg = TinyShape { layers: 1, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Llama, 64, None, None)
            .unwrap();
        let policy = random_decoder(cfg, 3, DType::F32, &Device::Cpu, true).unwrap();
        let reference = policy.frozen_copy().unwrap();
        let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0])];
        let with_kl = ObjectiveConfig { beta: 0.1, ..Default::default() };
        let optim = crate::train::optim::OptimConfig { lr: 1e-2, ..Default::default() };
        let mut step = TrainStep::new(&with_kl, &optim, &policy, 2, 32, 0).unwrap();
        assert!(step.needs_reference());
        assert!(step.run(&policy, None, &groups, 1e-2).unwrap_err().to_string().contains("reference"));
        let before = values(policy.vars()[0].as_tensor());
        let report = step.run(&policy, Some(&reference), &groups, 1e-2).unwrap();
        assert!(report.applied && report.grad_norm > 0.0 && report.stats.kl.abs() < 1e-6);
        assert_eq!(report.rewards.questions, 1);
        assert_ne!(values(policy.vars()[0].as_tensor()), before, "the update changed nothing");
        let mut no_kl = TrainStep::new(&ObjectiveConfig::default(), &optim, &policy, 2, 32, 0).unwrap();
        assert!(!no_kl.needs_reference());
        assert!(no_kl.run(&policy, Some(&reference), &groups, 1e-2).is_err());
        assert_eq!(no_kl.run(&policy, None, &groups, 1e-2).unwrap().stats.kl, 0.0);
    }

    #[test]
    fn batch_statistics_and_weights() {
        let oc = ObjectiveConfig { bias: 0.5, ..Default::default() };
        let obj = oc.build();
        let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0]), group(1, &[1.0; 4])];
        let b = build_batch(&groups, obj.as_ref(), LossAgg::SeqMeanTokenMean, 0);
        assert_eq!(b.seqs.len(), 8);
        assert!((b.rewards.reward_mean - 0.75).abs() < 1e-6);
        assert_eq!(b.rewards.frac_bias_applied, 0.5);
        assert_eq!(b.rewards.frac_reward_zero_std, 0.5);
        // Each answer's weights sum to 1/8.
        for s in &b.seqs {
            assert!((s.weight * s.response.len() as f32 - 0.125).abs() < 1e-6);
        }
        assert!(b.seqs[4..].iter().all(|s| s.advantage == 0.5));
    }
}
