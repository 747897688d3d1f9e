use super::*;
use crate::data::Response;
use crate::model::tiny::TinyShape;
use crate::model::{random_decoder, Arch, Targets, TokenBatch};
use crate::objective::{
    group_advantages, AdvantageConfig, Anchor, CommonOptions, ObjectiveConfig, ObjectiveKind, PpoOptions,
};
use crate::train::optim::OptimConfig;
use crate::train::step::{Reference, StepContext, TrainStep};
use candle_core::{DType, Device};

fn tokenizer() -> ChatTokenizer {
    ChatTokenizer::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/digits"))
        .unwrap()
}

fn policy(seed: u64) -> Decoder {
    let shape = TinyShape { layers: 1, hidden: 16, heads: 4, kv_heads: 2, intermediate: 32 };
    let cfg = shape.config(Arch::Llama, 64, None, Some(0)).unwrap();
    random_decoder(cfg, seed, DType::F32, &Device::Cpu, true).unwrap()
}

fn questions(tok: &ChatTokenizer, n: usize) -> Vec<Group> {
    (0..n)
        .map(|i| Group {
            index: i,
            question_id: format!("q{i}"),
            domain: None,
            source: None,
            prompt_tokens: tok.encode(&format!("a b {} c", ["d", "e", "f", "g"][i % 4]), false).unwrap(),
            responses: (0..2)
                .map(|j| Response {
                    tokens: vec![20 + j as u32, 3, 0],
                    reward: j as f32,
                    answer: None,
                    truncated: false,
                    teacher_logprobs: None,
                    is_weights: None,
                })
                .collect(),
            majority: Some("7".into()),
            majority_count: 0,
            vote_margin: 0,
        })
        .collect()
}

fn options(n: usize, max_new_tokens: usize) -> RolloutOptions {
    RolloutOptions { n, max_new_tokens, fallbacks: true, batch_size: 5, ..Default::default() }
}

fn params(m: &Decoder) -> Vec<Vec<f32>> {
    m.named_tensors().iter().map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
}

/// The log-probs of `response` after `prompt` under `m`, one sequence alone.
fn single_logprobs(m: &Decoder, prompt: &[u32], response: &[u32]) -> Vec<f32> {
    let mut t = Targets::default();
    (0..response.len()).for_each(|j| t.push(0, prompt.len() + j));
    let seq = [prompt, response].concat();
    let lp = m.token_logprobs(&TokenBatch::padded(&[seq], 0), &t, false).unwrap();
    lp.narrow(1, 0, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn rollouts_are_scored_and_carry_the_sampling_weights_log_probs() {
    let tok = tokenizer();
    let m = policy(1);
    let qs = questions(&tok, 3);
    let opts = RolloutOptions { teacher_answers: 1, ..options(5, 6) };
    let p = opts.sampling(9, 0);
    let (groups, metrics) = sample_groups(&m, &tok, &qs, &opts, &p, 3).unwrap();
    assert_eq!(groups.len(), 3);
    let mut rewards = Vec::new();
    for (g, q) in groups.iter().zip(&qs) {
        assert_eq!(g.responses.len(), 5);
        assert_eq!(g.responses[4], q.responses[0], "the first teacher answer closes the group");
        let texts: Vec<String> = g.responses[..4].iter().map(|r| tok.decode(&r.tokens, true).unwrap()).collect();
        let v = crate::reward::judge(Some("7"), &texts, &opts.extract());
        for (r, ok) in g.responses[..4].iter().zip(&v.correct) {
            assert_eq!(r.reward, if *ok { 1.0 } else { 0.0 });
            let behaviour = r.teacher_logprobs.as_ref().unwrap();
            let alone = single_logprobs(&m, &q.prompt_tokens, &r.tokens);
            assert_eq!(behaviour.len(), r.tokens.len());
            for (a, b) in behaviour.iter().zip(&alone) {
                assert!((a - b).abs() < 1e-5, "behaviour {a} vs forward {b}");
            }
            // A stopped answer ends with its EOS; a cut one has max_new_tokens tokens.
            assert!(r.truncated && r.tokens.len() == 6 || r.tokens.last() == Some(&0));
            rewards.push(r.reward as f64);
        }
    }
    assert_eq!(metrics.reward_mean, rewards.iter().sum::<f64>() / 12.0);
    // The sampler's own log-probs (KV-cached decoding) against the training forward of the same weights:
    // the same up to rounding.
    let (mean, max) = (metrics.logp_diff_mean.unwrap(), metrics.logp_diff_max.unwrap());
    assert!(mean < 1e-5 && max < 1e-4 && mean <= max, "sampler vs trainer log-probs: mean {mean}, max {max}");
    let line = serde_json::to_value(&metrics).unwrap();
    assert!(line["rollout/sampling_logp_difference_max"].is_number(), "{line}");
    // The same seed and step give the same rollouts; another step others.
    let (again, _) = sample_groups(&m, &tok, &qs, &opts, &p, 2).unwrap();
    assert_eq!(again, groups);
    let (other, _) = sample_groups(&m, &tok, &qs, &opts, &opts.sampling(9, 1), 3).unwrap();
    assert_ne!(other, groups);
}

fn grpo_on_rollouts(eps: f32) -> ObjectiveConfig {
    ObjectiveKind::Grpo(PpoOptions { anchor: Some(Anchor::Teacher), eps: Some(eps), ..Default::default() }).into()
}

/// With two updates per batch, the first update's ratio is 1 and the second's is pi_new / pi_behaviour,
/// clipped exactly where PPO's rule says on the hand-computed ratios.
#[test]
fn the_second_update_on_the_same_rollouts_has_a_real_ratio_and_clips() {
    let tok = tokenizer();
    let m = policy(2);
    let opts = RolloutOptions { updates_per_batch: 2, ..options(4, 5) };
    let mut groups = sample_groups(&m, &tok, &questions(&tok, 2), &opts, &opts.sampling(1, 0), 4).unwrap().0;
    // Rewards that vary within each group, whatever the random model wrote.
    for g in &mut groups {
        for (j, r) in g.responses.iter_mut().enumerate() {
            r.reward = (j % 2) as f32;
        }
    }
    let oc = grpo_on_rollouts(0.05);
    let mut train = TrainStep::new(&oc, &OptimConfig { lr: 0.05, ..Default::default() }, &m, 3, 5, 0).unwrap();
    let ctx = StepContext::default();
    let before = params(&m);
    let first = train.run_at(&m, None, &groups, 0.05, ctx).unwrap();
    assert!((first.stats.ratio.min - 1.0).abs() < 1e-4 && (first.stats.ratio.max - 1.0).abs() < 1e-4);
    assert_eq!(first.stats.clipped_tokens, 0);
    // Hand-computed: the ratios of the updated policy to the recorded behaviour, and PPO's clip rule.
    let (mut lo, mut hi, mut tokens) = (0usize, 0usize, 0usize);
    let adv_cfg = AdvantageConfig { std_normalize: true, bias: 0.0, batch_std: None };
    for g in &groups {
        let adv = group_advantages(&g.responses.iter().map(|r| r.reward).collect::<Vec<_>>(), &adv_cfg);
        for (r, a) in g.responses.iter().zip(&adv.advantages) {
            let now = single_logprobs(&m, &g.prompt_tokens, &r.tokens);
            for (x, b) in now.iter().zip(r.teacher_logprobs.as_ref().unwrap()) {
                let ratio = ((x - b) as f64).exp();
                let clipped = |ratio: f64| (*a > 0.0 && ratio > 1.05) || (*a < 0.0 && ratio < 0.95);
                // Ratios within 1e-5 of a bound may fall either side in another forward.
                lo += usize::from(clipped(ratio) && clipped(ratio * (1.0 - 1e-5)) && clipped(ratio * (1.0 + 1e-5)));
                hi += usize::from(clipped(ratio) || clipped(ratio * (1.0 - 1e-5)) || clipped(ratio * (1.0 + 1e-5)));
                tokens += 1;
            }
        }
    }
    let second = train.run_at(&m, None, &groups, 0.05, ctx).unwrap();
    assert_eq!(second.stats.ratio.tokens, tokens);
    assert!(second.stats.ratio.max - second.stats.ratio.min > 0.05, "the ratio stayed at 1: {:?}", second.stats.ratio);
    let c = second.stats.clipped_tokens;
    assert!(lo > 0 && lo <= c && c <= hi, "clipped {c}, hand-computed {lo}..={hi}");
    // The same two updates through the training loop's update loop, from the same start, give the same
    // result.
    let m2 = policy(2);
    assert_eq!(params(&m2), before);
    let mut train2 = TrainStep::new(&oc, &OptimConfig { lr: 0.05, ..Default::default() }, &m2, 3, 5, 0).unwrap();
    let all = train2.run_updates(&m2, Reference::None, &groups, 0.05, ctx, opts.updates_per_batch).unwrap();
    assert_eq!(params(&m2), params(&m));
    assert_eq!(all.stats.clipped_tokens, c);
    assert_eq!(all.stats.ratio.tokens, 2 * tokens);
}

/// With sync_every = 3 the answers of steps 0, 1 and 2 come from the policy of step 0, those of step 3
/// from the policy of step 3.
#[test]
fn sync_every_samples_from_the_policy_of_the_last_sync() {
    let tok = tokenizer();
    let m = policy(3);
    let qs = questions(&tok, 2);
    let opts = RolloutOptions { sync_every: 3, ..options(4, 4) };
    let oc = grpo_on_rollouts(0.2);
    let mut train = TrainStep::new(&oc, &OptimConfig { lr: 0.05, ..Default::default() }, &m, 4, 4, 0).unwrap();
    let mut r = Rollouts::new(opts.clone(), tokenizer(), 5, 4);
    let at0 = m.frozen_copy().unwrap();
    assert!(!r.stores_sampler(3) && r.stores_sampler(4));
    for step in 0..4 {
        let at_step = m.frozen_copy().unwrap();
        let (groups, _) = r.sample(&m, &qs, step).unwrap();
        let from = if step < 3 { &at0 } else { &at_step };
        let expected = sample_groups(from, &tok, &qs, &opts, &opts.sampling(5, step), 4).unwrap().0;
        assert_eq!(groups, expected, "step {step}");
        assert_eq!(params(r.sampler().unwrap()), params(from), "step {step}");
        if step > 0 && step < 3 {
            assert_ne!(params(&at_step), params(&at0), "the policy must have moved for the test to mean anything");
        }
        let mut g = groups;
        g.iter_mut().for_each(|g| g.responses.iter_mut().enumerate().for_each(|(j, x)| x.reward = (j % 2) as f32));
        train.run_at(&m, None, &g, 0.05, StepContext { step, ..Default::default() }).unwrap();
    }
    // A resumed run without its sampling copy at step 4 stops instead of sampling from another policy.
    let mut fresh = Rollouts::new(opts, tokenizer(), 5, 4);
    assert!(fresh.sample(&m, &qs, 4).unwrap_err().to_string().contains("sync_every"));
}

#[test]
fn the_train_config_checks_what_rollouts_need() {
    use crate::train::TrainConfig;
    let base = "[model]\npath = \"m\"\n[data]\ninputs = [\"x.jsonl\"]\n[rollout]\nn = 4\n";
    let parse = |extra: &[&str]| {
        let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        TrainConfig::parse(base, std::path::Path::new("c.toml"), &o).map_err(|e| e.to_string())
    };
    let e = parse(&["objective.name=grpo"]).unwrap_err();
    assert!(e.contains("objective.anchor = \"step\"") && e.contains("behaviour"), "{e}");
    let ok = parse(&["objective.name=grpo", "objective.anchor=behaviour"]).unwrap();
    assert_eq!(ok.objective.anchor(), Some(Anchor::Teacher));
    assert!(parse(&["objective.anchor=snapshot"]).unwrap_err().contains("sync_every"));
    let e = parse(&["objective.mask_zero_std=true", "objective.bias=0.5"]).unwrap_err();
    assert!(e.contains("objective.mask_zero_std") && e.contains("bias"), "{e}");
    assert!(parse(&["objective.mask_zero_std=true"]).is_ok());
    let e = parse(&["train.reference_swap_every=3"]).unwrap_err();
    assert!(e.contains("train.reference_swap_every") && e.contains("no reference"), "{e}");
    assert!(parse(&["train.reference_swap_every=\"epoch\"", "objective.beta=0.1"]).is_ok());
    assert!(parse(&["rollout.temperature=nan"]).unwrap_err().contains("rollout.temperature"));
    let e = parse(&["rollout.n_samples=3"]).unwrap_err();
    assert!(e.contains("n_samples") && e.contains("rollout"), "{e}");
    // Own questions need no teacher data.
    let own = "[model]\npath = \"m\"\n[data]\n[rollout]\nquestions = \"q.jsonl\"\n";
    assert!(TrainConfig::parse(own, std::path::Path::new("c.toml"), &[]).is_ok());
    let none = "[model]\npath = \"m\"\n[data]\n[rollout]\n";
    assert!(TrainConfig::parse(none, std::path::Path::new("c.toml"), &[])
        .unwrap_err()
        .to_string()
        .contains("data.inputs"));
}

#[test]
fn mask_zero_std_leaves_agreeing_groups_out_and_keeps_the_others() {
    let common = CommonOptions { mask_zero_std: Some(true), ..Default::default() };
    let oc = ObjectiveConfig { common, ..Default::default() };
    let obj = oc.build();
    let key = crate::objective::GroupKey::default();
    assert_eq!(obj.advantages(&[1.0, 1.0, 1.0], &key).include, vec![false; 3]);
    assert_eq!(obj.advantages(&[0.0, 0.0], &key).include, vec![false; 2]);
    let mixed = obj.advantages(&[1.0, 0.0], &key);
    assert_eq!(mixed, ObjectiveConfig::default().build().advantages(&[1.0, 0.0], &key));
}

/// LUFFY's mixed groups: sampled answers have ratio pi / pi_sampling (1 at the first update), teacher
/// answers without log-probs pi / 1.
#[test]
fn mixed_groups_use_the_recorded_log_probs_for_rollouts_and_probability_one_for_the_teacher() {
    let tok = tokenizer();
    let m = policy(4);
    let qs = questions(&tok, 2);
    let opts = RolloutOptions { teacher_answers: 2, ..options(5, 4) };
    let groups = sample_groups(&m, &tok, &qs, &opts, &opts.sampling(2, 0), 4).unwrap().0;
    let mut expected = 0f64;
    let mut tokens = 0usize;
    for g in &groups {
        assert_eq!(g.responses.len(), 5);
        for r in &g.responses[..3] {
            expected += r.tokens.len() as f64;
            tokens += r.tokens.len();
        }
        for r in &g.responses[3..] {
            assert!(r.teacher_logprobs.is_none());
            expected += single_logprobs(&m, &g.prompt_tokens, &r.tokens).iter().map(|&l| (l as f64).exp()).sum::<f64>();
            tokens += r.tokens.len();
        }
    }
    let oc = grpo_on_rollouts(0.2);
    let mut train = TrainStep::new(&oc, &OptimConfig { lr: 1e-3, ..Default::default() }, &m, 4, 4, 0).unwrap();
    let report = train.run_at(&m, None, &groups, 1e-3, StepContext::default()).unwrap();
    let ratio = report.stats.ratio;
    assert_eq!(ratio.tokens, tokens);
    assert!((ratio.sum - expected).abs() < 1e-3 * tokens as f64, "ratio sum {} vs {expected}", ratio.sum);
    assert!(ratio.min < 0.2 && (ratio.max - 1.0).abs() < 1e-4, "{ratio:?}");
}

/// A server's answers become rollout sequences: the re-tokenised text plus EOS when it stopped, scored on
/// the text, with behaviour log-probs from a forward of the sampling weights.
#[test]
fn server_answers_are_retokenised_and_carry_the_sampling_weights_log_probs() {
    use crate::eval::engine::Completion;
    use crate::eval::FinishReason;
    let tok = tokenizer();
    let m = policy(4);
    let qs = questions(&tok, 2);
    let opts = options(2, 8);
    let texts = ["7", "a b", "c 7 d", "e"];
    let finishes = [FinishReason::Stop, FinishReason::Length, FinishReason::Stop, FinishReason::Length];
    let eos = tok.eos_ids().first().copied();
    let samples: Vec<_> = texts
        .iter()
        .zip(finishes)
        .map(|(t, finish)| {
            let c = Completion { text: t.to_string(), tokens: 0, finish, logprobs: None };
            server::to_sampled(c, &tok, eos, 8).unwrap().0
        })
        .collect();
    let (groups, metrics) = sample::score_groups(&m, &tok, &qs, &opts, samples, 3, std::time::Instant::now()).unwrap();
    assert_eq!((metrics.logp_diff_mean, metrics.logp_diff_max), (None, None), "the server reported no log-probs");
    let answers: Vec<_> =
        groups.iter().flat_map(|g| g.responses.iter().zip(std::iter::repeat(&g.prompt_tokens))).collect();
    for ((r, prompt), (text, finish)) in answers.iter().zip(texts.iter().zip(finishes)) {
        let mut want = tok.encode(text, false).unwrap();
        if finish == FinishReason::Stop {
            want.push(eos.unwrap());
        }
        assert_eq!(r.tokens, want, "{text}");
        assert_eq!(r.truncated, finish == FinishReason::Length);
        let alone = single_logprobs(&m, prompt, &r.tokens);
        for (a, b) in r.teacher_logprobs.as_ref().unwrap().iter().zip(&alone) {
            assert!((a - b).abs() < 1e-5, "behaviour {a} vs forward {b}");
        }
    }
    // Scored on the text: "7" and "c 7 d" (last-number fallback) match the label 7.
    let rewards: Vec<f32> = answers.iter().map(|(r, _)| r.reward).collect();
    assert_eq!(rewards, [1.0, 0.0, 1.0, 0.0]);
    assert_eq!(metrics.truncated_fraction, 0.5);
    // One answer too few is refused.
    let short = vec![
        server::to_sampled(
            Completion { text: "7".into(), tokens: 0, finish: FinishReason::Stop, logprobs: None },
            &tok,
            eos,
            8,
        )
        .unwrap()
        .0,
    ];
    assert!(sample::score_groups(&m, &tok, &qs, &opts, short, 3, std::time::Instant::now()).is_err());
}

/// With a reloading server, the first step saves the sampling weights as a model folder and asks the
/// server to load them before any completion (here the server is absent: the error names the endpoint).
#[test]
fn a_reloading_server_gets_the_sampling_weights_first() {
    let dir = tempfile::tempdir().unwrap();
    let served = dir.path().join("rollout-policy");
    let mut opts = options(2, 4);
    opts.reload = Reload::Sglang;
    opts.server = crate::eval::EngineOptions {
        engine: crate::eval::EngineKind::Openai,
        base_url: Some("http://127.0.0.1:9/v1".into()),
        served_model: Some("m".into()),
        request_timeout_s: 5,
        ..Default::default()
    };
    opts.validate().unwrap();
    let m = policy(5);
    let mut rollouts = Rollouts::new(opts, tokenizer(), 1, 2);
    rollouts.serve_weights_from(served.clone(), crate::model::checkpoint::SaveOptions::default());
    let e = rollouts.sample(&m, &questions(&tokenizer(), 1), 0).unwrap_err().to_string();
    assert!(e.contains("http://127.0.0.1:9/update_weights_from_disk"), "{e}");
    let saved = crate::model::load_decoder(&served, DType::F32, &Device::Cpu, false).unwrap();
    assert_eq!(params(&saved), params(&m), "the server was pointed at the sampling weights");
}

/// A server ignoring max_tokens: its answers are cut to rollout.max_new_tokens, and counted.
#[test]
fn a_servers_answers_are_cut_to_max_new_tokens_and_counted() {
    use crate::eval::engine::fake_server::{serve, Reply};
    use crate::eval::{FinishReason, SamplingParams};
    let tok = tokenizer();
    let long = "1 2 3 4 5 6 7 8 9 ".repeat(500);
    let body = serde_json::json!({"choices": [
        {"index": 0, "text": "7", "finish_reason": "stop"},
        {"index": 1, "text": long, "finish_reason": "stop"}]});
    let (url, server) = serve(vec![Reply::Full(200, body.to_string())]);
    let options = crate::eval::EngineOptions {
        engine: crate::eval::EngineKind::Openai,
        base_url: Some(url),
        served_model: Some("m".into()),
        max_retries: 0,
        concurrency: 1,
        ..Default::default()
    };
    let params = SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: 8, seed: 0 };
    let bar = indicatif::ProgressBar::hidden();
    let batch = server::server_samples(&options, &tok, &questions(&tok, 1), (2, 2, false), &params, &bar).unwrap();
    server.join().unwrap();
    let samples = batch.samples;
    assert_eq!((batch.cut, batch.unaligned), (1, 0));
    let eos = tok.eos_ids().first().copied().unwrap();
    assert_eq!((samples[0].finish, samples[0].tokens.last()), (FinishReason::Stop, Some(&eos)));
    assert_eq!((samples[1].finish, samples[1].generated, samples[1].tokens.len()), (FinishReason::Length, 8, 8));
}

/// A scored batch of groups with these rewards (one group per list), as `draw` gives them.
fn scored(rewards: &[&[f32]], first: usize) -> (Vec<Group>, RolloutMetrics) {
    let mut qs = questions(&tokenizer(), rewards.len());
    for (i, (g, r)) in qs.iter_mut().zip(rewards).enumerate() {
        g.index = first + i;
        g.responses = r
            .iter()
            .map(|&reward| Response {
                tokens: vec![3],
                reward,
                answer: None,
                truncated: false,
                teacher_logprobs: None,
                is_weights: None,
            })
            .collect();
    }
    let answers = rewards.iter().map(|r| r.len()).sum();
    let mean = rewards.iter().flat_map(|r| r.iter()).map(|&x| x as f64).sum::<f64>() / answers as f64;
    (qs, RolloutMetrics { answers, reward_mean: mean, gen_batches: 1, ..Default::default() })
}

#[test]
fn dynamic_sampling_refills_the_batch_with_groups_whose_rewards_differ() {
    // Batch 0 keeps 1 of 3 groups, batch 1 keeps 1 more, batch 2 two: the first 3 kept are trained on.
    let batches: [&[&[f32]]; 4] = [
        &[&[1.0, 1.0], &[0.0, 1.0], &[0.0, 0.0]],
        &[&[0.0, 0.0], &[1.0, 0.0], &[1.0, 1.0]],
        &[&[0.5, 0.0], &[0.0, 1.0], &[1.0, 1.0]],
        &[&[0.0, 1.0], &[0.0, 1.0], &[0.0, 1.0]],
    ];
    let mut asked = Vec::new();
    let (groups, m) = fill_batch(3, 10, |k| {
        asked.push(k);
        Ok(scored(batches[k], 10 * k))
    })
    .unwrap();
    assert_eq!(asked, vec![0, 1, 2], "sampling stops once the batch is full");
    assert_eq!(groups.iter().map(|g| g.index).collect::<Vec<_>>(), vec![1, 11, 20]);
    assert!(groups.iter().all(varied));
    assert_eq!((m.gen_batches, m.groups_dropped, m.answers), (3, 5, 18));
    // The merged reward mean is over every answer sampled: 9 of 18 rewards are 1, one is 0.5.
    assert!((m.reward_mean - 9.5 / 18.0).abs() < 1e-12, "{}", m.reward_mean);
}

#[test]
fn dynamic_sampling_stops_at_max_num_gen_batches() {
    let mut calls = 0;
    // Every group agrees: after the bound the last batch is trained on as it is.
    let (groups, m) = fill_batch(2, 3, |k| {
        calls += 1;
        Ok(scored(&[&[1.0, 1.0], &[0.0, 0.0]], 10 * k))
    })
    .unwrap();
    assert_eq!((calls, m.gen_batches, m.groups_dropped), (3, 3, 6));
    assert_eq!(groups.iter().map(|g| g.index).collect::<Vec<_>>(), vec![20, 21]);
    // One group kept in 2 batches: trained on alone.
    let (groups, m) = fill_batch(2, 2, |k| Ok(scored(&[&[1.0, 1.0], &[k as f32, 0.0]], 10 * k))).unwrap();
    assert_eq!((groups.len(), groups[0].index, m.gen_batches, m.groups_dropped), (1, 11, 2, 3));
    // An error of a refill is the step's error.
    let e =
        fill_batch(
            2,
            5,
            |k| if k == 0 { Ok(scored(&[&[1.0, 1.0]], 0)) } else { Err(RolloutError::Invalid("x".into())) },
        );
    assert!(e.is_err());
}

#[test]
fn the_overlong_penalty_lowers_the_rewards_of_long_sampled_answers() {
    let (m, tok) = (policy(3), tokenizer());
    let qs = questions(&tok, 2);
    let opts = RolloutOptions { overlong_buffer_len: 4, overlong_penalty_factor: 0.5, ..options(3, 6) };
    let samples: Vec<_> = [1usize, 3, 6, 2, 5, 4]
        .iter()
        .map(|&n| server::Sampled {
            tokens: vec![5; n],
            text: "\\boxed{7}".into(),
            finish: if n == 6 { crate::eval::FinishReason::Length } else { crate::eval::FinishReason::Stop },
            generated: n,
            sampler_logprobs: None,
        })
        .collect();
    let (groups, metrics) = sample::score_groups(&m, &tok, &qs, &opts, samples, 3, std::time::Instant::now()).unwrap();
    let rewards: Vec<f32> = groups.iter().flat_map(|g| g.responses.iter().map(|r| r.reward)).collect();
    // Correct answers (1) minus 0.5 (L - 2) / 4 beyond 2 generated tokens.
    let want = [1.0, 0.875, 0.5, 1.0, 0.625, 0.75];
    assert!(rewards.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{rewards:?}");
    assert!((metrics.overlong_fraction - 4.0 / 6.0).abs() < 1e-12);
    assert!((metrics.overlong_penalty + 1.25 / 6.0).abs() < 1e-9, "{}", metrics.overlong_penalty);
}

/// A server that reports its tokens' log-probs (by id, as vLLM does): each sampled token's policy loss
/// gets the truncated ratio exp(b - s) of grpo's behaviour log-prob b and the server's s, and the
/// mismatch metrics are those of these log-probs.
#[test]
fn server_log_probs_give_the_importance_sampling_correction_and_its_metrics() {
    use crate::eval::engine::fake_server::{serve, Reply};
    use crate::eval::SamplingParams;
    let (tok, m) = (tokenizer(), policy(6));
    let qs = questions(&tok, 1);
    let texts = ["7", "1 2"];
    // The server's log-prob of token t of answer i: -3 - 0.9 t - i (the last answer also names its
    // stop token).
    let server_lp = |i: usize, t: usize| -3.0 - 0.9 * t as f32 - i as f32;
    let eos = tok.eos_ids()[0];
    let choice = |i: usize| {
        let mut ids = tok.encode(texts[i], false).unwrap();
        if i == 1 {
            ids.push(eos);
        }
        let names: Vec<String> = ids.iter().map(|id| format!("token_id:{id}")).collect();
        let lps: Vec<f32> = (0..ids.len()).map(|t| server_lp(i, t)).collect();
        serde_json::json!({"index": i, "text": texts[i], "finish_reason": "stop",
            "logprobs": {"tokens": names, "token_logprobs": lps}})
    };
    let body = serde_json::json!({"choices": [choice(0), choice(1)]});
    let (url, server) = serve(vec![Reply::Full(200, body.to_string())]);
    let mut opts = options(2, 8);
    opts.importance_sampling_correction = true;
    opts.importance_sampling_cap = 1.5;
    opts.server = crate::eval::EngineOptions {
        engine: crate::eval::EngineKind::Openai,
        base_url: Some(url),
        served_model: Some("m".into()),
        max_retries: 0,
        concurrency: 1,
        ..Default::default()
    };
    let params = SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: 8, seed: 0 };
    let bar = indicatif::ProgressBar::hidden();
    let batch = server::server_samples(&opts.server, &tok, &qs, (2, 2, true), &params, &bar).unwrap();
    let request: serde_json::Value = serde_json::from_str(&server.join().unwrap()[0].request).unwrap();
    assert_eq!((request["logprobs"].as_u64(), request["return_tokens_as_token_ids"].as_bool()), (Some(1), Some(true)));
    assert_eq!(batch.unaligned, 0);
    let (groups, metrics) =
        sample::score_groups(&m, &tok, &qs, &opts, batch.samples, 3, std::time::Instant::now()).unwrap();
    let (mut diffs, mut ratios, mut capped) = (Vec::new(), Vec::new(), 0);
    for (i, r) in groups[0].responses.iter().enumerate() {
        let b = single_logprobs(&m, &qs[0].prompt_tokens, &r.tokens);
        let w = r.is_weights.as_ref().unwrap();
        assert_eq!(w.len(), r.tokens.len());
        // Answer 0's EOS has no server log-prob (the server did not report its stop token): weight 1.
        let reported = if i == 0 { r.tokens.len() - 1 } else { r.tokens.len() };
        for t in 0..r.tokens.len() {
            let want = if t < reported {
                let rho = ((b[t] - server_lp(i, t)) as f64).exp();
                diffs.push((b[t] - server_lp(i, t)).abs() as f64);
                ratios.push(rho);
                capped += usize::from(rho > 1.5);
                rho.min(1.5)
            } else {
                1.0
            };
            assert!((w[t] as f64 - want).abs() < 1e-4 * want.max(1.0), "answer {i} token {t}: {} vs {want}", w[t]);
        }
    }
    assert!(capped > 0 && capped < ratios.len(), "both branches: {ratios:?}");
    let n = ratios.len() as f64;
    let close = |a: Option<f64>, b: f64| (a.unwrap() - b).abs() < 1e-4 * b.abs().max(1.0);
    assert!(close(metrics.logp_diff_mean, diffs.iter().sum::<f64>() / n), "{metrics:?}");
    assert!(close(metrics.logp_diff_max, diffs.iter().copied().fold(0.0, f64::max)));
    assert!(close(metrics.is_ratio_mean, ratios.iter().sum::<f64>() / n));
    assert!(close(metrics.is_ratio_min, ratios.iter().copied().fold(f64::INFINITY, f64::min)));
    assert!(close(metrics.is_ratio_max, ratios.iter().copied().fold(0.0, f64::max)));
    assert!(close(metrics.is_capped_fraction, capped as f64 / n));
    let row = serde_json::to_value(&metrics).unwrap();
    for key in ["importance_sampling_ratio_mean", "importance_sampling_capped_fraction", "server_logprobs_unaligned"] {
        assert!(row.get(format!("rollout/{key}")).is_some(), "{row}");
    }
}

/// A server that sends no log-probs when they were asked for is refused with a clear error.
#[test]
fn a_server_without_log_probs_is_refused_when_they_are_needed() {
    use crate::eval::engine::fake_server::{serve, Reply};
    use crate::eval::SamplingParams;
    let tok = tokenizer();
    let body = serde_json::json!({"choices": [{"index": 0, "text": "7", "finish_reason": "stop"}]});
    let (url, server) = serve(vec![Reply::Full(200, body.to_string())]);
    let options = crate::eval::EngineOptions {
        engine: crate::eval::EngineKind::Openai,
        base_url: Some(url),
        served_model: Some("m".into()),
        max_retries: 0,
        concurrency: 1,
        ..Default::default()
    };
    let params = SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: 8, seed: 0 };
    let bar = indicatif::ProgressBar::hidden();
    let e = server::server_samples(&options, &tok, &questions(&tok, 1), (1, 2, true), &params, &bar).unwrap_err();
    server.join().unwrap();
    assert!(e.to_string().contains("sent no `logprobs`"), "{e}");
}

/// The overlap options are refused where nothing could overlap, naming the option, before any weight loads.
#[test]
fn overlap_options_are_refused_where_nothing_can_overlap() {
    use crate::train::config::TrainConfig;
    let base = "[model]\npath = \"m\"\n[data]\ninputs = [\"x.jsonl\"]\n[objective]\nname = \"grpo\"\nanchor = \"behaviour\"\n[rollout]\nn = 4\n";
    let parse = |extra: &[&str]| {
        let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        TrainConfig::parse(base, std::path::Path::new("c.toml"), &o).map_err(|e| e.to_string())
    };
    let server = [
        "rollout.server.engine=\"openai\"",
        "rollout.server.base_url=\"http://127.0.0.1:9/v1\"",
        "rollout.server.served_model=\"m\"",
    ];
    let e = parse(&["rollout.max_staleness=1"]).unwrap_err();
    assert!(e.contains("rollout.max_staleness = 1") && e.contains("generation_ranks"), "{e}");
    assert!(parse(&["rollout.max_staleness=1", "rollout.generation_ranks=1"]).is_ok());
    let e = parse(&[&server[..], &["rollout.max_staleness=2"]].concat()).unwrap_err();
    assert!(e.contains("rollout.reload = \"none\""), "{e}");
    assert!(parse(&[&server[..], &["rollout.max_staleness=2", "rollout.reload=\"sglang\""]].concat()).is_ok());
    let e = parse(&[&server[..], &["rollout.generation_ranks=1"]].concat()).unwrap_err();
    assert!(e.contains("rollout.generation_ranks = 1 with a [rollout.server]"), "{e}");
    let e = parse(&["rollout.generation_ranks=1", "rollout.filter_groups=true"]).unwrap_err();
    assert!(e.contains("rollout.filter_groups"), "{e}");
    let e = parse(&["rollout.max_staleness=-1"]).unwrap_err();
    assert!(e.contains("rollout.max_staleness"), "{e}");
    let plain = "[model]\npath = \"m\"\n[data]\ninputs = [\"x.jsonl\"]\n";
    let o = vec!["rollout.generation_ranks=1".to_string()];
    let e = TrainConfig::parse(plain, std::path::Path::new("c.toml"), &o).unwrap_err().to_string();
    assert!(e.contains("no [rollout] section"), "{e}");
}

/// The generation ranks take the last ranks of a job and leave at least one to train.
#[test]
fn generation_ranks_are_the_last_ranks() {
    let roles = crate::dist::Roles::new(4, 1).unwrap();
    assert_eq!((roles.trainers, roles.generators), (vec![0, 1, 2], vec![3]));
    let roles = crate::dist::Roles::new(3, 2).unwrap();
    assert_eq!(roles.generator_index(2), Some(1));
    assert_eq!(roles.generator_index(0), None);
    let e = crate::dist::Roles::new(2, 2).unwrap_err().to_string();
    assert!(e.contains("rollout.generation_ranks = 2 must be below the job's 2 ranks"), "{e}");
}
