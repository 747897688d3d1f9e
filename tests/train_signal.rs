//! Learning signal: a few off_grpo steps on teacher groups raise the log-probs of positive answers and
//! lower those of negative ones, with a finite KL.

mod common;

use candle_core::{DType, Device};
use grpo::data::{self, Group, PreparedDataset};
use grpo::model::{self, Decoder, Targets, TokenBatch};
use grpo::objective::{ObjectiveConfig, ObjectiveKind, PpoOptions};
use grpo::train::optim::OptimConfig;
use grpo::train::step::TrainStep;

/// Mean per-token log-prob of the positive and of the negative answers.
fn mean_logprobs(m: &Decoder, groups: &[Group]) -> (f64, f64) {
    let (mut pos, mut neg, mut np, mut nn) = (0f64, 0f64, 0usize, 0usize);
    for g in groups {
        let seqs: Vec<Vec<u32>> =
            g.responses.iter().map(|r| [g.prompt_tokens.as_slice(), &r.tokens].concat()).collect();
        let b = TokenBatch::padded(&seqs, 0);
        let mut t = Targets::default();
        for (i, r) in g.responses.iter().enumerate() {
            (0..r.tokens.len()).for_each(|j| t.push(i, g.prompt_tokens.len() + j));
        }
        let lp = m
            .token_logprobs(&b, &t, false)
            .unwrap()
            .narrow(1, 0, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut at = 0;
        for r in &g.responses {
            let s: f64 = lp[at..at + r.tokens.len()].iter().map(|&x| x as f64).sum();
            at += r.tokens.len();
            if r.reward > 0.0 {
                pos += s;
                np += r.tokens.len();
            } else {
                neg += s;
                nn += r.tokens.len();
            }
        }
    }
    (pos / np as f64, neg / nn as f64)
}

/// Train `objective` for `steps` steps on the mixed groups of the bundled trajectories (answers cut to
/// `max_tokens`, at most `max_groups` groups of `group_size`) and check the direction of the change.
#[allow(clippy::too_many_arguments)]
fn check_signal(
    model_dir: &std::path::Path,
    oc: ObjectiveConfig,
    teacher_from_model: bool,
    lr: f64,
    steps: usize,
    max_tokens: usize,
    max_groups: usize,
    group_size: usize,
) {
    let dir = tempfile::tempdir().unwrap();
    let opts = data::PrepareOptions {
        input: data::InputOptions {
            inputs: vec![common::root().join("data/trajectories/ot3_math_x8_dev.jsonl").display().to_string()],
            group: data::GroupOptions { group_size, ..Default::default() },
            ..Default::default()
        },
        sequence: data::SequenceOptions { max_response_tokens: max_tokens, ..Default::default() },
        model: model_dir.to_path_buf(),
        out: dir.path().join("prepared"),
        ..Default::default()
    };
    data::prepare(&opts).unwrap();
    let ds = PreparedDataset::open(&dir.path().join("prepared")).unwrap();
    let mut mixed: Vec<Group> = (0..ds.len())
        .map(|i| ds.group(i).unwrap())
        .filter(|g| g.responses.iter().any(|r| r.reward > 0.0) && g.responses.iter().any(|r| r.reward == 0.0))
        .take(max_groups)
        .collect();
    assert!(mixed.len() >= 3, "only {} mixed groups", mixed.len());

    let policy = model::load_decoder(model_dir, DType::F32, &Device::Cpu, true).unwrap();
    let reference = policy.frozen_copy().unwrap();
    let mut step = TrainStep::new(&oc, &OptimConfig { lr, ..Default::default() }, &policy, 4, max_tokens, 0).unwrap();
    if teacher_from_model {
        // Behaviour log-probs carried by the data (LUFFY-style target probs): here the initial model's own.
        for g in &mut mixed {
            for r in &mut g.responses {
                let seq = [g.prompt_tokens.as_slice(), &r.tokens].concat();
                let mut t = Targets::default();
                (0..r.tokens.len()).for_each(|j| t.push(0, g.prompt_tokens.len() + j));
                let lp = policy.token_logprobs(&TokenBatch::padded(&[seq], 0), &t, false).unwrap();
                r.teacher_logprobs = Some(lp.narrow(1, 0, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
            }
        }
    }
    let (pos0, neg0) = mean_logprobs(&policy, &mixed);
    let mut kl = 0.0;
    for _ in 0..steps {
        let report = step.run(&policy, Some(&reference), &mixed, lr).unwrap();
        assert!(report.applied && report.grad_norm.is_finite() && report.grad_norm > 0.0);
        kl = report.stats.kl;
    }
    let (pos1, neg1) = mean_logprobs(&policy, &mixed);
    eprintln!("positive {pos0:.4} -> {pos1:.4}, negative {neg0:.4} -> {neg1:.4}, kl {kl:.5}");
    assert!(pos1 > pos0, "positive answers did not become more likely: {pos0} -> {pos1}");
    assert!(pos1 - pos0 > neg1 - neg0, "negative answers rose as much as positive ones");
    assert!(neg1 < neg0, "negative answers did not become less likely: {neg0} -> {neg1}");
    assert!(kl.is_finite() && kl > 0.0);
}

fn tiny_model(dir: &std::path::Path) -> std::path::PathBuf {
    let model_dir = dir.join("model");
    let spec = model::tiny::TinySpec {
        arch: model::Arch::Llama,
        tokenizer: common::root().join("data/tokenizers/smollm2"),
        shape: model::tiny::TinyShape { layers: 1, hidden: 32, heads: 4, kv_heads: 2, intermediate: 64 },
        seed: 1,
    };
    model::tiny::write_tiny_model(&spec, &model_dir).unwrap();
    model_dir
}

/// off_grpo with behaviour log-probs in the data. (With the probability-1 assumption and a random model,
/// every token has p << 1 - eps, so off_grpo leaves negative answers alone by design: the clip at 1 - eps
/// only pushes down tokens the model is already confident about.)
#[test]
fn off_grpo_raises_positive_and_lowers_negative_answers_on_a_tiny_model() {
    let dir = tempfile::tempdir().unwrap();
    let oc = ObjectiveKind::OffGrpo(PpoOptions { bias: 0.5, beta: 0.1, ..Default::default() }).into();
    check_signal(&tiny_model(dir.path()), oc, true, 1e-3, 3, 24, 4, 8);
}

/// The standard clipped ratio against the policy's own log-probs (grpo).
#[test]
fn grpo_raises_positive_and_lowers_negative_answers_on_a_tiny_model() {
    let dir = tempfile::tempdir().unwrap();
    let oc = ObjectiveKind::Grpo(PpoOptions { bias: 0.5, beta: 0.1, ..Default::default() }).into();
    check_signal(&tiny_model(dir.path()), oc, false, 3e-3, 4, 24, 4, 8);
}
