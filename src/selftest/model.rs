//! A tiny random model (Qwen2 layout: 2 layers, hidden 64, 4 query heads over 2 key/value heads) on the
//! device with the fused ops, against the same weights on the CPU with candle's composite ops, in f32:
//! one off_grpo training step (loss, gradient norm), the gradients of every parameter through packed
//! sequences, and one greedy generation with the KV cache; and the optimiser's update offloaded to host
//! memory against the same update on the device.

use candle_core::{DType, Device, Result, Tensor};
use rand::{Rng, SeedableRng};

use super::{max_error, Part};
use crate::data::{Group, Response};
use crate::eval::{generate, SamplingParams};
use crate::model::tiny::TinyShape;
use crate::model::Grads;
use crate::model::{random_decoder, Arch, Decoder, ModelConfig, Targets, TokenBatch};
use crate::objective::{CommonOptions, KlEstimator, LossAgg, ObjectiveConfig, ObjectiveKind, PpoOptions};
use crate::train::optim::{OptimConfig, Optimizer};
use crate::train::step::TrainStep;

/// One model check: `run(device)` gives the error of each compared part.
pub struct ModelCheck {
    pub op: &'static str,
    pub run: fn(&Device) -> Result<Vec<Part>>,
    pub tolerance: f32,
    /// The parameters' dtype.
    pub dtype: DType,
}

/// The model checks, in the order of the table.
pub const CHECKS: &[ModelCheck] = &[
    ModelCheck { op: "train step", run: train_step_check, tolerance: 1e-4, dtype: DType::F32 },
    ModelCheck { op: "model", run: gradients_check, tolerance: 1e-4, dtype: DType::F32 },
    ModelCheck { op: "generation", run: generation_check, tolerance: 1e-4, dtype: DType::F32 },
    ModelCheck { op: "offloaded update", run: offloaded_update_check, tolerance: 1e-6, dtype: DType::BF16 },
];

const VOCAB: usize = 1000;
const SEED: u64 = 5;

fn config() -> Result<ModelConfig> {
    let shape = TinyShape { layers: 2, hidden: 64, heads: 4, kv_heads: 2, intermediate: 128 };
    shape.config(Arch::Qwen2, VOCAB, None, None).map_err(|e| candle_core::Error::Msg(e.to_string()))
}

/// The tiny model on `device` (f32, seeded weights, the same on every device): with the fused ops, or
/// with candle's composite ops (the reference).
fn tiny(device: &Device, fused: bool, trainable: bool) -> Result<Decoder> {
    let mut m = random_decoder(config()?, SEED, DType::F32, device, trainable)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    m.options.fused_ops = fused;
    Ok(m)
}

fn random_tokens(rng: &mut impl Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.gen_range(0..VOCAB as u32)).collect()
}

/// `|a - b| / max(|b|, 1)`: a scalar's error, relative where it is large and absolute near zero (the
/// loss of a group whose advantages sum to zero starts at zero).
fn scalar_error(a: f64, b: f64) -> f32 {
    if a.is_finite() && b.is_finite() {
        ((a - b).abs() / b.abs().max(1.0)) as f32
    } else {
        f32::NAN
    }
}

/// One off_grpo step (eps 0.2, beta 0.1 with k3 to a frozen reference, AdamW) on four answers of one
/// random question, two per micro-batch: its loss and gradient norm.
fn train_step_check(device: &Device) -> Result<Vec<Part>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(SEED);
    let group = Group {
        index: 0,
        question_id: "selftest".into(),
        domain: None,
        source: None,
        prompt_tokens: random_tokens(&mut rng, 8),
        responses: (0..4)
            .map(|i| Response {
                tokens: random_tokens(&mut rng, 16 + 5 * i),
                reward: [1.0, 0.0, 0.0, 1.0][i],
                answer: None,
                truncated: false,
                teacher_logprobs: None,
                is_weights: None,
            })
            .collect(),
        majority: None,
        majority_count: 0,
        vote_margin: 0,
    };
    let objective = ObjectiveConfig {
        kind: ObjectiveKind::OffGrpo(PpoOptions {
            eps: Some(0.2),
            beta: 0.1,
            kl_estimator: Some(KlEstimator::K3),
            ..PpoOptions::default()
        }),
        common: CommonOptions { loss_agg: Some(LossAgg::SeqMeanTokenMean), ..CommonOptions::default() },
    };
    let optim = OptimConfig { lr: 1e-5, ..OptimConfig::default() };
    let step = |dev: &Device, fused: bool| -> Result<(f64, f64)> {
        let policy = tiny(dev, fused, true)?;
        let reference = policy.frozen_copy()?;
        let mut step = TrainStep::new(&objective, &optim, &policy, 2, 64, 0)?;
        let report = step.run(&policy, Some(&reference), std::slice::from_ref(&group), optim.lr)?;
        if !report.applied {
            candle_core::bail!("the step was skipped: loss {} gradient norm {}", report.stats.loss, report.grad_norm);
        }
        Ok((report.stats.loss, report.grad_norm))
    };
    let (loss, norm) = step(device, true)?;
    let (loss_ref, norm_ref) = step(&Device::Cpu, false)?;
    Ok(vec![
        Part { name: "loss", error: scalar_error(loss, loss_ref) },
        Part { name: "grad norm", error: scalar_error(norm, norm_ref) },
    ])
}

/// The gradient of every parameter under `sum(w_n log p_n)` over all tokens of packed rows (two
/// sequences in the first row, one and padding in the second): the worst parameter's error, with the
/// log-prob head's logits recomputed for the backward and kept from the forward (`model.keep_logits`,
/// which "auto" turns on for a GPU with room to spare).
fn gradients_check(device: &Device) -> Result<Vec<Part>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(SEED + 1);
    let rows = vec![vec![random_tokens(&mut rng, 20), random_tokens(&mut rng, 13)], vec![random_tokens(&mut rng, 25)]];
    let batch = TokenBatch::packed(&rows, 0);
    let mut targets = Targets::default();
    for (r, seqs) in rows.iter().enumerate() {
        let mut start = 0;
        for s in seqs {
            (start + 1..start + s.len()).for_each(|p| targets.push(r, p));
            start += s.len();
        }
    }
    let w: Vec<f32> = (0..targets.len()).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let grads = |dev: &Device, fused: bool, keep_logits: bool| -> Result<Vec<Option<Tensor>>> {
        let mut model = tiny(dev, fused, true)?;
        model.options.keep_logits = keep_logits;
        let w = Tensor::new(w.as_slice(), dev)?;
        let (_, g) =
            model.forward_backward(&batch, &targets, &mut |lp| (lp.narrow(1, 0, 1)?.squeeze(1)? * &w)?.sum_all())?;
        Ok(g.grads)
    };
    let g_ref = grads(&Device::Cpu, false, false)?;
    let worst = |g: &[Option<Tensor>]| -> Result<f32> {
        let mut error = 0f32;
        for (a, b) in g.iter().zip(&g_ref) {
            let e = match (a, b) {
                (Some(a), Some(b)) => max_error(a, b)?,
                (None, None) => 0.0,
                _ => f32::NAN,
            };
            error = if e.is_nan() || error.is_nan() { f32::NAN } else { error.max(e) };
        }
        Ok(error)
    };
    Ok(vec![
        Part { name: "grads", error: worst(&grads(device, true, false)?)? },
        Part { name: "grads, logits kept", error: worst(&grads(device, true, true)?)? },
    ])
}

/// Greedy generation of 12 tokens from two prompts of different lengths (left padding) on the device;
/// the CPU model then scores what was generated: each token must be the CPU's argmax up to rounding.
/// The error is the largest `max logit - logit of the generated token`, over the largest logit.
fn generation_check(device: &Device) -> Result<Vec<Part>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(SEED + 2);
    let prompts = vec![random_tokens(&mut rng, 5), random_tokens(&mut rng, 11)];
    let new_tokens = 12;
    let params = SamplingParams { max_new_tokens: new_tokens, ..SamplingParams::default() };
    let model = tiny(device, true, false)?;
    let generated = generate(&model, &prompts, &[0, 1], &params, &[], 0, |_| {})?;
    let reference = tiny(&Device::Cpu, false, false)?;
    let (mut gap, mut scale) = (0f32, 0f32);
    for (prompt, g) in prompts.iter().zip(&generated) {
        if g.tokens.len() != new_tokens {
            candle_core::bail!("generated {} tokens, expected {new_tokens}", g.tokens.len());
        }
        let seq: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
        let logits = reference.full_logits(&TokenBatch::padded(&[seq], 0))?.squeeze(0)?;
        // Positions prompt - 1 .. predict the generated tokens.
        let logits = logits.narrow(0, prompt.len() - 1, new_tokens)?.to_vec2::<f32>()?;
        for (row, &token) in logits.iter().zip(&g.tokens) {
            // A non-finite logit fails the check (f32::max would pass over a NaN).
            if row.iter().any(|x| !x.is_finite()) {
                return Ok(vec![Part { name: "logit gap", error: f32::NAN }]);
            }
            let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            gap = gap.max(best - row[token as usize]);
            scale = row.iter().fold(scale, |s, x| s.max(x.abs()));
        }
    }
    let error = if scale > 0.0 { gap / scale } else { f32::NAN };
    Ok(vec![Part { name: "logit gap", error }])
}

/// Two AdamW updates of bf16 parameters on `device` (three tensors of 1.2 M parameters in all) with the
/// state in host memory, in chunks of 1 MiB of gradients (five chunks, two tensors split over chunks, so
/// both staging slots are used in turn: page-locked, asynchronous copies on a GPU), against the same
/// updates with the state on the device: the new weights and the master weights.
fn offloaded_update_check(device: &Device) -> Result<Vec<Part>> {
    let sizes = [300_000, 700_000, 200_000];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(SEED + 3);
    let mut values = |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-scale..scale)).collect() };
    let init: Vec<Vec<f32>> = sizes.iter().map(|&n| values(n, 1.0)).collect();
    let steps: Vec<Grads> = (0..2)
        .map(|_| {
            let grads = sizes.iter().map(|&n| Tensor::from_vec(values(n, 0.1), (n / 100, 100), device).map(Some));
            Ok(Grads { grads: grads.collect::<Result<_>>()? })
        })
        .collect::<Result<_>>()?;
    let names: Vec<String> = (0..sizes.len()).map(|i| format!("w{i}")).collect();
    let run = |offload: bool| -> Result<(Tensor, Tensor)> {
        let vars = (init.iter().zip(&sizes))
            .map(|(v, &n)| {
                candle_core::Var::from_tensor(
                    &Tensor::new(v.as_slice(), device)?.reshape((n / 100, 100))?.to_dtype(DType::BF16)?,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let cfg = OptimConfig { lr: 1e-3, weight_decay: 0.01, offload, offload_chunk_mb: 1, ..OptimConfig::default() };
        let mut opt = Optimizer::new(cfg, &names, &vars.iter().collect::<Vec<_>>())?;
        for (i, g) in steps.iter().enumerate() {
            opt.step(g, 1e-3, [1.0, 0.5][i])?;
        }
        let flat = |ts: Vec<Tensor>| -> Result<Tensor> {
            let ts = ts
                .iter()
                .map(|t| t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all())
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&ts, 0)
        };
        let masters = opt.state_tensors()?.into_iter().filter(|(n, _)| n.starts_with("master.")).map(|(_, t)| t);
        Ok((flat(vars.iter().map(|v| v.as_tensor().clone()).collect())?, flat(masters.collect())?))
    };
    let (weights, masters) = run(true)?;
    let (weights_ref, masters_ref) = run(false)?;
    Ok(vec![Part::compare("weights", &weights, &weights_ref)?, Part::compare("master", &masters, &masters_ref)?])
}
