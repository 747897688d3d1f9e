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
                is_weights: None,
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

/// Gives answer j of every group teacher log-probs when j is odd (a mix of data with and without).
fn with_teacher(mut groups: Vec<Group>) -> Vec<Group> {
    for g in &mut groups {
        for (j, r) in g.responses.iter_mut().enumerate().filter(|(j, _)| j % 2 == 1) {
            r.teacher_logprobs = Some((0..r.tokens.len()).map(|t| -0.2 - 0.7 * ((t + j) % 5) as f32).collect());
        }
    }
    groups
}

fn oc(name: ObjectiveName) -> ObjectiveConfig {
    ObjectiveConfig::of(name)
}

/// The objective `name` with `options` (TOML lines), read as a config's `[objective]` section is.
fn with(name: ObjectiveName, options: &str) -> ObjectiveConfig {
    toml::from_str(&format!("name = \"{}\"\n{options}", name.as_str())).unwrap()
}

/// One configuration of every objective (and of the anchors and clipping modes), with a KL term where
/// the objective takes one.
fn every_objective() -> Vec<ObjectiveConfig> {
    use ObjectiveName as N;
    vec![
        with(N::OffGrpo, "bias = 0.5\nbeta = 0.1"),
        with(
            N::Grpo,
            "bias = 0.5\neps = 0.1\neps_high = 0.3\nanchor = \"reference\"\nloss_agg = \"token-mean\"\nbeta = 0.1",
        ),
        with(N::Gspo, "anchor = \"snapshot\"\neps = 0.05"),
        with(N::Rec, "clip_mode = \"ring\"\nimportance_weight = true\nanchor = \"reference\"\nbeta = 0.1"),
        with(N::Rec, "clip_mode = \"two-side\"\nanchor = \"snapshot\"\nratio_level = \"sequence\""),
        with(N::Rec, "eps = 0.6\neps_high = 2.0"),
        with(N::Opmd, "anchor = \"snapshot\"\ntau = 0.5\nbeta = 0.1"),
        with(N::Asymre, "beta = 0.1"),
        with(N::RedDrop, "loss_agg = \"seq-mean-token-sum\""),
        with(N::RedWeight, "std_normalize = true\nbeta = 0.1"),
        with(N::Oapl, "beta2 = 0.05"),
        with(N::Oapl, "anchor = \"teacher\""),
        with(N::Sft, "loss_agg = \"seq-mean-token-sum-norm\"\nbeta = 0.1"),
        with(N::Cispo, "anchor = \"reference\"\nbeta = 0.1"),
        with(N::Grpo, "anchor = \"snapshot\"\nclip_ratio_c = 1.5\nscale_rewards = \"batch\""),
    ]
}

/// A tiny trainable policy, and a reference and a snapshot that differ from it (so ratios, masks and
/// KL are not trivial).
fn tiny_models() -> [Decoder; 3] {
    let cfg = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
        .config(Arch::Qwen2, 64, None, None)
        .unwrap();
    [(5, true), (6, false), (7, false)]
        .map(|(seed, trainable)| random_decoder(cfg.clone(), seed, DType::F32, &Device::Cpu, trainable).unwrap())
}

#[test]
fn micro_batch_split_never_changes_the_gradient() {
    let [policy, reference, snapshot] = tiny_models();
    let anchors = Anchors { reference: Reference::Model(&reference), snapshot: Some(&snapshot) };
    let groups = with_teacher(vec![
        group(0, &[1.0, 0.0, 1.0, 0.0]),
        group(1, &[1.0, 1.0, 1.0, 1.0]),
        group(2, &[0.0, 1.0, 0.0, 0.0]),
    ]);
    let ctx = StepContext { seed: 3, epoch: 1, step: 0 };
    for oc in every_objective() {
        oc.validate().unwrap();
        let obj = oc.build();
        let name = format!("{oc:?}");
        let batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&oc, 32), ctx);
        let (g1, s1) = compute_gradients(
            &policy,
            anchors,
            obj.as_ref(),
            EntropyTerms::NONE,
            &batch,
            (Batching::Answers(usize::MAX), 0),
        )
        .unwrap();
        assert!(s1.loss.is_finite() && s1.loss != 0.0, "{name}: loss {}", s1.loss);
        for micro in [1, 2, 4] {
            let (g, s) = compute_gradients(
                &policy,
                anchors,
                obj.as_ref(),
                EntropyTerms::NONE,
                &batch,
                (Batching::Answers(micro), 0),
            )
            .unwrap();
            assert!(
                (s.loss - s1.loss).abs() < 1e-5 * s1.loss.abs().max(1.0),
                "{name} micro {micro}: loss {} vs {}",
                s.loss,
                s1.loss
            );
            assert_eq!(s.clipped_tokens, s1.clipped_tokens, "{name} micro {micro}");
            for (a, b) in g.grads.iter().zip(&g1.grads) {
                let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
                let scale = b.iter().map(|x| x.abs()).fold(1e-3f32, f32::max);
                let d = crate::kernels::testing::abs_diff(&a, &b);
                assert!(d < 1e-5 * scale.max(1.0), "{name} micro {micro}: gradient differs by {d}");
            }
        }
    }
}

/// Gradients equal within `tol` relative to the largest of each tensor (at least 1).
fn assert_same_gradients(a: &Grads, b: &Grads, tol: f32, name: &str) {
    for (a, b) in a.grads.iter().zip(&b.grads) {
        let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
        let scale = b.iter().map(|x| x.abs()).fold(1e-3f32, f32::max).max(1.0);
        let d = crate::kernels::testing::abs_diff(&a, &b);
        assert!(d < tol * scale, "{name}: gradient differs by {d}");
    }
}

/// Packed micro-batches (answers one after the other in rows of a token budget, over several
/// micro-batches, an answer longer than the budget alone) give the loss, statistics and gradients of
/// padded ones: for every objective, with the reference model run or its log-probs cached, with layers
/// recomputed or not, and with the entropy bonus and mask.
#[test]
fn packed_micro_batches_give_the_padded_loss_and_gradients() {
    let [mut policy, reference, snapshot] = tiny_models();
    let groups = with_teacher(vec![
        group(0, &[1.0, 0.0, 1.0, 0.0]),
        group(1, &[1.0, 1.0, 1.0, 1.0]),
        group(2, &[0.0, 1.0, 0.0, 0.0, 1.0, 0.0]),
    ]);
    let cached = reference_alone(&reference, &groups);
    let ctx = StepContext { seed: 3, epoch: 1, step: 0 };
    let full = build_batch(&groups, oc(ObjectiveName::Grpo).build().as_ref(), plain(LossAgg::TokenMean), ctx);
    let lengths = answer_lengths(&full.seqs);
    assert_eq!((lengths.len(), *lengths.iter().max().unwrap()), (14, 19));
    let (small, large) = (Batching::Tokens(16), Batching::Tokens(40));
    let rows = small.micro_batches(&lengths);
    assert!(rows.iter().any(|mb| mb[0].len() > 1) && rows.iter().any(|mb| lengths[mb[0][0]] > 16), "{rows:?}");
    assert!(large.micro_batches(&lengths).len() > 2);
    let entropy = EntropyTerms { coeff: 0.05, top_quantile: 0.5 };
    let on_the_fly = Anchors { reference: Reference::Model(&reference), snapshot: Some(&snapshot) };
    let from_cache = Anchors { reference: Reference::Logprobs(&cached), snapshot: Some(&snapshot) };
    for (i, oc) in every_objective().into_iter().enumerate() {
        let obj = oc.build();
        let batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&oc, 32), ctx);
        let anchors = if i % 2 == 0 || !obj.needs_reference() { on_the_fly } else { from_cache };
        let terms = if i % 3 == 0 { entropy } else { EntropyTerms::NONE };
        policy.options.checkpoint_layers = i % 2 == 1;
        let run = |b: Batching| compute_gradients(&policy, anchors, obj.as_ref(), terms, &batch, (b, 0)).unwrap();
        let (g0, s0) = run(Batching::Answers(3));
        assert!(s0.loss.is_finite() && s0.loss != 0.0, "{oc:?}: loss {}", s0.loss);
        for packed in [small, large] {
            let name = format!("{oc:?} {packed:?}");
            let (g, s) = run(packed);
            assert!((s.loss - s0.loss).abs() < 1e-5 * s0.loss.abs().max(1.0), "{name}: {} vs {}", s.loss, s0.loss);
            assert!((s.kl - s0.kl).abs() < 1e-5 * s0.kl.abs().max(1.0), "{name}: kl {} vs {}", s.kl, s0.kl);
            assert!((s.entropy_sum - s0.entropy_sum).abs() < 1e-4 * s0.entropy_sum.abs(), "{name}");
            assert_eq!(
                (s.clipped_tokens, s.response_tokens, s.tokens, s.ratio.tokens),
                (s0.clipped_tokens, s0.response_tokens, s0.tokens, s0.ratio.tokens),
                "{name}"
            );
            assert_same_gradients(&g, &g0, 1e-5, &name);
        }
    }
}

/// A whole step with packed micro-batches updates the policy as with padded ones (SGD: the update is
/// the gradient's, so the weights' difference is the gradients').
#[test]
fn a_packed_step_updates_the_weights_as_a_padded_one() {
    let cfg = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
        .config(Arch::Qwen2, 64, None, None)
        .unwrap();
    let make = || random_decoder(cfg.clone(), 5, DType::F32, &Device::Cpu, true).unwrap();
    let (a, mut b, before) = (make(), make(), params(&make()));
    b.options.checkpoint_layers = true;
    let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0, 1.0]), group(1, &[0.0, 1.0, 1.0])];
    let obj = with(ObjectiveName::Grpo, "loss_agg = \"seq-mean-token-mean\"\nbeta = 0.1");
    let optim =
        crate::train::optim::OptimConfig { name: crate::train::optim::OptimName::Sgd, lr: 0.5, ..Default::default() };
    let reference = random_decoder(cfg.clone(), 6, DType::F32, &Device::Cpu, false).unwrap();
    let mut padded = TrainStep::new(&obj, &optim, &a, 2, 32, 0).unwrap();
    let mut packed = TrainStep::new(&obj, &optim, &b, 2, 32, 0).unwrap();
    packed.set_batching(Batching::of(2, 24));
    let ra = padded.run(&a, Some(&reference), &groups, 0.5).unwrap();
    let rb = packed.run(&b, Some(&reference), &groups, 0.5).unwrap();
    assert!(ra.applied && rb.applied && (ra.stats.loss - rb.stats.loss).abs() < 1e-6, "{ra:?} vs {rb:?}");
    assert!((ra.grad_norm - rb.grad_norm).abs() < 1e-5 * ra.grad_norm, "{} vs {}", ra.grad_norm, rb.grad_norm);
    let mut moved = 0f32;
    for ((x, y), x0) in params(&a).iter().zip(params(&b)).zip(&before) {
        moved = x.iter().zip(x0).map(|(p, q)| (p - q).abs()).fold(moved, f32::max);
        let d = crate::kernels::testing::abs_diff(x, &y);
        assert!(d <= 1e-6, "the weights differ by {d}");
    }
    assert!(moved > 1e-3, "the step moved the weights by {moved} at most");
}

/// The reference's log-probs of every answer of `groups`, each answer scored alone.
fn reference_alone(reference: &Decoder, groups: &[Group]) -> Vec<Vec<Vec<f32>>> {
    let alone = |g: &Group, r: &Response| {
        let full = [g.prompt_tokens.as_slice(), &r.tokens].concat();
        let mut t = Targets::default();
        (0..r.tokens.len()).for_each(|j| t.push(0, g.prompt_tokens.len() + j));
        values(&reference.token_logprobs(&TokenBatch::padded(&[full], 0), &t, false).unwrap().narrow(1, 0, 1).unwrap())
    };
    groups.iter().map(|g| g.responses.iter().map(|r| alone(g, r)).collect()).collect()
}

/// Cached reference log-probs (each answer scored alone, plus values past its end as an answer cut
/// shorter than the cache would have) give the loss and gradients of the reference model run on each
/// micro-batch: bitwise with one sequence per micro-batch (the same forward), within 1e-5 (relative)
/// when a micro-batch pads several sequences together.
#[test]
fn cached_reference_logprobs_give_the_reference_models_loss_and_gradients() {
    let [policy, reference, snapshot] = tiny_models();
    let groups = with_teacher(vec![group(0, &[1.0, 0.0, 1.0, 0.0]), group(1, &[0.0, 1.0, 0.0, 0.0])]);
    let mut cached = reference_alone(&reference, &groups);
    cached.iter_mut().flatten().for_each(|a| a.extend([-1.5, -2.5]));
    let on_the_fly = Anchors { reference: Reference::Model(&reference), snapshot: Some(&snapshot) };
    let from_cache = Anchors { reference: Reference::Logprobs(&cached), snapshot: Some(&snapshot) };
    let ctx = StepContext { seed: 3, epoch: 0, step: 0 };
    let mut checked = 0;
    for oc in every_objective().into_iter().filter(|o| o.build().needs_reference()) {
        let obj = oc.build();
        let batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&oc, 32), ctx);
        for (micro, tol) in [(1, 0.0), (3, 1e-5)] {
            let (ga, sa) = compute_gradients(
                &policy,
                on_the_fly,
                obj.as_ref(),
                EntropyTerms::NONE,
                &batch,
                (Batching::Answers(micro), 0),
            )
            .unwrap();
            let (gb, sb) = compute_gradients(
                &policy,
                from_cache,
                obj.as_ref(),
                EntropyTerms::NONE,
                &batch,
                (Batching::Answers(micro), 0),
            )
            .unwrap();
            let name = format!("{oc:?} micro {micro}");
            let close = |a: f64, b: f64| (a - b).abs() <= tol * a.abs().max(1.0);
            assert!(close(sa.loss, sb.loss) && close(sa.kl, sb.kl), "{name}: {sa:?} vs {sb:?}");
            assert!(sa.loss != 0.0 && (oc.beta() == 0.0 || sa.kl != 0.0), "{name}: trivial loss {sa:?}");
            for (a, b) in ga.grads.iter().zip(&gb.grads) {
                let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
                let scale = a.iter().map(|x| x.abs()).fold(1e-3f32, f32::max).max(1.0);
                let d = crate::kernels::testing::abs_diff(&a, &b);
                assert!(d <= tol as f32 * scale, "{name}: gradients differ by {d}");
            }
        }
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} objectives read the reference");
    // Fewer cached values than answer tokens is an error, not a silent zero.
    let short: Vec<Vec<Vec<f32>>> = vec![vec![vec![-1.0]; 4]; 2];
    let anchors = Anchors { reference: Reference::Logprobs(&short), snapshot: None };
    let kl = with(ObjectiveName::OffGrpo, "beta = 0.1");
    let batch = build_batch(&groups, kl.build().as_ref(), Aggregation::of(&kl, 32), ctx);
    let e =
        compute_gradients(&policy, anchors, kl.build().as_ref(), EntropyTerms::NONE, &batch, (Batching::Answers(2), 0))
            .err()
            .map(|e| e.to_string());
    assert!(e.as_ref().is_some_and(|e| e.contains("1 values for")), "{e:?}");
}

#[test]
fn a_step_updates_the_policy_and_needs_a_reference_exactly_with_kl() {
    let cfg = TinyShape { layers: 1, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
        .config(Arch::Llama, 64, None, None)
        .unwrap();
    let policy = random_decoder(cfg, 3, DType::F32, &Device::Cpu, true).unwrap();
    let reference = policy.frozen_copy().unwrap();
    let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0])];
    let with_kl = with(ObjectiveName::OffGrpo, "beta = 0.1");
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
    // The reference as anchor, without a KL term: loaded, but no KL.
    let anchored = with(ObjectiveName::Oapl, "anchor = \"reference\"");
    let mut step = TrainStep::new(&anchored, &optim, &policy, 2, 32, 0).unwrap();
    assert!(step.needs_reference());
    let report = step.run(&policy, Some(&reference), &groups, 1e-2).unwrap();
    assert!(report.applied && report.stats.kl == 0.0 && report.stats.loss > 0.0);
}

/// The entropy bonus's gradient, -coeff d/dtheta sum_t w_t H_t, against central finite differences
/// of the aggregated entropy on a tiny model (through the fused log-prob op's entropy backward).
#[test]
fn the_entropy_bonus_gradient_agrees_with_finite_differences() {
    let [policy, _, _] = tiny_models();
    let groups = vec![group(0, &[1.0, 0.0, 1.0]), group(1, &[0.0, 1.0])];
    let cfg = with(ObjectiveName::Grpo, "entropy_coeff = 0.5");
    assert_eq!(cfg.validate(), Ok(()));
    let obj = cfg.build();
    let batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&cfg, 32), StepContext::default());
    let none = Anchors { reference: Reference::None, snapshot: None };
    let (g0, s0) =
        compute_gradients(&policy, none, obj.as_ref(), EntropyTerms::NONE, &batch, (Batching::Answers(2), 0)).unwrap();
    let (g1, s1) =
        compute_gradients(&policy, none, obj.as_ref(), EntropyTerms::of(&cfg), &batch, (Batching::Answers(2), 0))
            .unwrap();
    // The aggregated entropy sum_t w_t H_t of the batch.
    let aggregated = || -> f64 {
        let mut total = 0f64;
        for chunk in batch.seqs.chunks(2) {
            let (tb, targets, inputs, _) =
                micro_inputs(&chunk.iter().map(|s| vec![s]).collect::<Vec<_>>(), 0, &Device::Cpu).unwrap();
            let lp = policy.token_logprobs(&tb, &targets, false).unwrap();
            let h = lp.narrow(1, 1, 1).unwrap().squeeze(1).unwrap();
            total += (h * &inputs.weights).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
        }
        total
    };
    assert!((s1.loss - (s0.loss - 0.5 * aggregated())).abs() < 1e-5, "{} vs {}", s1.loss, s0.loss);
    let eps = 1e-2f32;
    let mut checked = 0;
    for (pi, param) in policy.params().iter().enumerate() {
        let crate::model::Param::Trainable(var) = param else { continue };
        let diff = values(&(g1.grads[pi].as_ref().unwrap() - g0.grads[pi].as_ref().unwrap()).unwrap());
        let x0 = values(var.as_tensor());
        let idx = (pi * 7) % x0.len();
        let at = |d: f32| {
            let mut x = x0.clone();
            x[idx] += d;
            var.set(&Tensor::from_vec(x, var.shape(), &Device::Cpu).unwrap()).unwrap();
            aggregated()
        };
        let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
        var.set(&Tensor::from_vec(x0, var.shape(), &Device::Cpu).unwrap()).unwrap();
        let want = -0.5 * fd;
        assert!(
            (diff[idx] as f64 - want).abs() < 2e-3 * want.abs().max(0.05),
            "parameter {pi}[{idx}]: backward {} vs finite differences {want}",
            diff[idx]
        );
        checked += usize::from(want.abs() > 1e-4);
    }
    assert!(checked >= 3, "only {checked} parameters had a measurable entropy gradient");
}

/// top_entropy_quantile: the step's gradient is that of the same batch whose answers carry, as their
/// policy-term weights, each answer's high-entropy mask from the policy's own entropies.
#[test]
fn the_high_entropy_mask_keeps_each_answers_top_tokens_in_the_policy_loss() {
    let [policy, reference, _] = tiny_models();
    let groups = vec![group(0, &[1.0, 0.0, 1.0]), group(1, &[0.0, 1.0])];
    let cfg = with(ObjectiveName::Grpo, "top_entropy_quantile = 0.3\nbeta = 0.1");
    let obj = cfg.build();
    let mut batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&cfg, 32), StepContext::default());
    let anchors = Anchors { reference: Reference::Model(&reference), snapshot: None };
    let (g, s) =
        compute_gradients(&policy, anchors, obj.as_ref(), EntropyTerms::of(&cfg), &batch, (Batching::Answers(2), 0))
            .unwrap();
    let mut kept = 0f32;
    for seq in batch.seqs.iter_mut() {
        let (tb, targets, _, _) = micro_inputs(&[vec![&*seq]], 0, &Device::Cpu).unwrap();
        let lp = policy.token_logprobs(&tb, &targets, false).unwrap();
        let h = values(&lp.narrow(1, 1, 1).unwrap().squeeze(1).unwrap());
        let mask = crate::objective::top_entropy_mask(&h, &[h.len()], 0.3);
        kept += mask.iter().sum::<f32>();
        seq.is_weights = Some(mask);
    }
    let total: usize = batch.seqs.iter().map(|s| s.response.len()).sum();
    assert!(kept > 0.0 && (kept as usize) < total / 2, "{kept} of {total} tokens kept");
    let (g_ref, s_ref) =
        compute_gradients(&policy, anchors, obj.as_ref(), EntropyTerms::NONE, &batch, (Batching::Answers(3), 0))
            .unwrap();
    assert!((s.loss - s_ref.loss).abs() < 1e-6 && (s.kl - s_ref.kl).abs() < 1e-7, "{s:?} vs {s_ref:?}");
    for (a, b) in g.grads.iter().zip(&g_ref.grads) {
        if let (Some(a), Some(b)) = (a, b) {
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-6, "gradient differs by {d}");
        }
    }
}

fn plain(agg: LossAgg) -> Aggregation {
    Aggregation { agg, norm_len: 0, mask_truncated: false }
}

fn params(m: &Decoder) -> Vec<Vec<f32>> {
    m.named_tensors().iter().map(|(_, t)| values(t)).collect()
}

#[test]
fn the_snapshot_anchor_is_the_policy_at_the_last_multiple_of_anchor_every() {
    let cfg = TinyShape { layers: 1, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
        .config(Arch::Llama, 64, None, None)
        .unwrap();
    let policy = random_decoder(cfg, 4, DType::F32, &Device::Cpu, true).unwrap();
    let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0])];
    let oapl = with(ObjectiveName::Oapl, "anchor_every = 2\nbeta2 = 0.1");
    let optim = crate::train::optim::OptimConfig { lr: 1e-2, ..Default::default() };
    let mut step = TrainStep::new(&oapl, &optim, &policy, 2, 32, 0).unwrap();
    assert_eq!(step.snapshot_every(), Some(2));
    let ctx = |step| StepContext { seed: 0, epoch: 0, step };
    // A run resumed at step 1 with no snapshot restored must not invent one.
    assert!(step.run_at(&policy, None, &groups, 1e-2, ctx(1)).unwrap_err().to_string().contains("snapshot"));
    let at0 = params(&policy);
    let r0 = step.run_at(&policy, None, &groups, 1e-2, ctx(0)).unwrap();
    // At the refresh the anchor is the policy itself: the log-ratio is 0, the loss sum_i w_i A_i^2.
    assert!(r0.applied && r0.stats.loss > 0.0);
    assert_eq!(params(step.snapshot().unwrap()), at0);
    let r1 = step.run_at(&policy, None, &groups, 1e-2, ctx(1)).unwrap();
    assert_eq!(params(step.snapshot().unwrap()), at0, "refreshed before anchor_every steps");
    assert_ne!(r1.stats.loss, r0.stats.loss);
    let at2 = params(&policy);
    assert_ne!(at2, at0);
    step.run_at(&policy, None, &groups, 1e-2, ctx(2)).unwrap();
    assert_eq!(params(step.snapshot().unwrap()), at2);
    assert!(TrainStep::new(&oc(ObjectiveName::Grpo), &optim, &policy, 2, 32, 0).unwrap().snapshot_every().is_none());
}

#[test]
fn red_drop_keeps_balanced_groups_chosen_by_seed_question_and_epoch() {
    let obj = oc(ObjectiveName::RedDrop).build();
    let groups = vec![group(0, &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]), group(1, &[1.0, 1.0, 0.0, 1.0])];
    let kept = |ctx: StepContext| {
        let b = build_batch(&groups, obj.as_ref(), plain(LossAgg::TokenMean), ctx);
        b.seqs.iter().map(|s| (s.response.clone(), s.advantage)).collect::<Vec<_>>()
    };
    let a = kept(StepContext { seed: 1, epoch: 0, step: 0 });
    // Group 0: one positive and one of the five negatives; group 1 (more positives) keeps all four.
    assert_eq!(a.len(), 2 + 4);
    assert_eq!(a[0].1, 0.5);
    assert_eq!(a[1].1, -0.5);
    assert_eq!(a, kept(StepContext { seed: 1, epoch: 0, step: 5 }), "the choice must not depend on the step");
    let choices: std::collections::BTreeSet<Vec<u32>> = (0..8)
        .flat_map(|e| (0..4).map(move |s| StepContext { seed: s, epoch: e, step: 0 }))
        .map(|c| kept(c)[1].0.clone())
        .collect();
    assert!(choices.len() > 2, "the dropped answers do not vary with seed and epoch: {choices:?}");
}

#[test]
fn mask_truncated_and_batch_scaling_act_on_the_whole_batch() {
    let mut groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0]), group(1, &[1.0, 1.0, 1.0, 0.0])];
    groups[0].responses[0].truncated = true;
    groups[1].responses[3].truncated = true;
    let cfg = with(ObjectiveName::Grpo, "mask_truncated = true\nscale_rewards = \"batch\"\nloss_agg = \"token-mean\"");
    let b = build_batch(&groups, cfg.build().as_ref(), Aggregation::of(&cfg, 32), StepContext::default());
    assert_eq!((b.seqs.len(), b.rewards.masked_truncated), (6, 2));
    assert!(b.seqs.iter().all(|s| s.origin != (0, 0) && s.origin != (1, 3)));
    // The cut answers still count in their group's advantages: group 1's mean is 0.75, and the std is
    // that of all 8 rewards (5 ones, 3 zeros).
    let batch_std = (5.0f64 * 0.375f64.powi(2) + 3.0 * 0.625f64.powi(2)) / 7.0;
    let a = b.seqs.iter().find(|s| s.origin == (1, 0)).unwrap().advantage as f64;
    assert!((a - 0.25 / (batch_std.sqrt() + 1e-6)).abs() < 1e-5, "{a}");
    // Token-mean over the kept answers' tokens only.
    let tokens: usize = b.seqs.iter().map(|s| s.response.len()).sum();
    assert!(b.seqs.iter().all(|s| (s.weight - 1.0 / tokens as f32).abs() < 1e-9));
    let off = with(ObjectiveName::Grpo, "loss_agg = \"token-mean\"");
    let b = build_batch(&groups, off.build().as_ref(), Aggregation::of(&off, 32), StepContext::default());
    assert_eq!((b.seqs.len(), b.rewards.masked_truncated), (8, 0));
}

#[test]
fn batch_statistics_and_weights() {
    let oc = with(ObjectiveName::OffGrpo, "bias = 0.5");
    let obj = oc.build();
    let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0]), group(1, &[1.0; 4])];
    let b = build_batch(&groups, obj.as_ref(), plain(LossAgg::SeqMeanTokenMean), StepContext::default());
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
