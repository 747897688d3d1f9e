use super::*;
use crate::train::TrainConfig;
use std::path::Path;

/// A Qwen2-like shape small enough to count by hand: h 8, 2 heads / 1 KV head of dim 4, i 16, V 32.
fn shape() -> ModelConfig {
    let raw = serde_json::json!({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
        "tie_word_embeddings": false});
    ModelConfig::from_json(raw, Path::new("test")).unwrap()
}

fn config(extra: &[&str]) -> TrainConfig {
    let base = "[model]\npath = \"m\"\ndtype = \"bf16\"\n[data]\ninputs = [\"x.jsonl\"]\nmax_prompt_tokens = 6\n\
                max_response_tokens = 10\n[objective]\nbeta = 0.1\n[train]\nmicro_batch_size = 2\n";
    let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    TrainConfig::parse(base, Path::new("c.toml"), &o).unwrap()
}

/// What a test changes of a config's plan input.
#[derive(Clone, Copy)]
struct Inputs {
    attention: Attention,
    reference_cached: bool,
    on_cpu: bool,
    device_memory: Option<u64>,
    world_size: u64,
}

fn inputs(attention: Attention) -> Inputs {
    Inputs { attention, reference_cached: false, on_cpu: false, device_memory: Some(4 << 30), world_size: 1 }
}

/// The plan of `cfg` on `m` with `inputs` in place of what the config says of them.
fn plan(cfg: &TrainConfig, m: &ModelConfig, inputs: Inputs) -> Plan {
    let Inputs { attention, reference_cached, on_cpu, device_memory, world_size } = inputs;
    let input = PlanInput {
        attention,
        cache_reference: reference_cached,
        reference_cacheable: reference_cached,
        on_cpu,
        ..cfg.plan_input(m, device_memory, world_size)
    };
    super::plan(&input)
}

/// The plan of `config(set)` on [`shape`] with `attention`, on a 4 GiB GPU.
fn planned(set: &[&str], attention: Attention) -> Plan {
    plan(&config(set), &shape(), inputs(attention))
}

fn component<'a>(p: &'a Plan, name: &str) -> &'a Component {
    p.components.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name}"))
}

fn bytes(p: &Plan, name: &str) -> u64 {
    component(p, name).bytes
}

fn has(p: &Plan, prefix: &str) -> bool {
    p.components.iter().any(|c| c.name.starts_with(prefix))
}

/// Kept logits are one more backward component, `n V d` (2 answers of 10 scored tokens), which the
/// advice drops first when the step does not fit.
#[test]
fn kept_logits_are_counted_and_advised_away() {
    let m = shape();
    let (base, keeping) = (["model.logprob_chunk_mb=1"], ["model.logprob_chunk_mb=1", "model.keep_logits=true"]);
    let (plain, kept) = (planned(&base, Attention::Flash), planned(&keeping, Attention::Flash));
    let name = "logits kept (model.keep_logits)";
    assert_eq!(bytes(&kept, name), 2 * 10 * m.vocab_size as u64 * 2);
    assert!(plain.components.iter().all(|c| c.name != name));
    assert!(kept.tensor_peak(Place::Device) > plain.tensor_peak(Place::Device));
    // A device with the plain step's peak: keeping the logits does not fit, and the advice drops them.
    let memory = (plain.peak(Place::Device) as f64 / (1.0 - GPU_HEADROOM)).ceil() as u64 + 64;
    let tight = Inputs { device_memory: Some(memory), ..inputs(Attention::Flash) };
    assert_eq!(plan(&config(&base), &m, tight).fits(), Some(true));
    let tight_plan = plan(&config(&keeping), &m, tight);
    assert_eq!(tight_plan.fits(), Some(false), "{tight_plan}");
    assert!(tight_plan.advice().contains("model.keep_logits = false"), "{}", tight_plan.advice());
}

/// "auto" (the default) keeps the logits on a GPU where the plan with them leaves room to spare, never
/// on the CPU or where the memory is unknown; `true` and `false` are kept as set.
#[test]
fn auto_keeps_logits_only_with_room_to_spare() {
    let m = shape();
    let gpu = |extra: &[&str]| config(&[&["model.logprob_chunk_mb=1", "model.device=cuda"], extra].concat());
    let auto = |c: &TrainConfig, memory: Option<u64>| c.memory_plan(&m, memory, 1);
    let (kept, plain) = (auto(&gpu(&["model.keep_logits=true"]), None), auto(&gpu(&["model.keep_logits=false"]), None));
    let (kept_peak, plain_peak) = (kept.peak(Place::Device) as f64, plain.peak(Place::Device) as f64);
    let usable = |share: f64| (share / (1.0 - GPU_HEADROOM)).ceil() as u64;
    // Room to spare: the peak with them at the share of what the plan may use.
    let roomy = usable(kept_peak / AUTO_KEEP_LOGITS_SHARE) + 64;
    // Room for them, not to spare: the peak with them fits, above the share.
    let snug = usable(kept_peak) + 64;
    assert!(plain_peak < kept_peak && (snug as f64) < roomy as f64 - 64.0);
    let (roomy_plan, snug_plan) = (auto(&gpu(&[]), Some(roomy)), auto(&gpu(&[]), Some(snug)));
    assert!(roomy_plan.keep_logits && has(&roomy_plan, "logits kept"));
    assert!(roomy_plan.to_string().contains("model.keep_logits = \"auto\": kept"), "{roomy_plan}");
    assert!(snug_plan.to_string().contains("model.keep_logits = \"auto\": recomputed"), "{snug_plan}");
    assert!(!snug_plan.keep_logits && !has(&snug_plan, "logits kept"));
    assert_eq!(
        (snug_plan.fits(), auto(&gpu(&["model.keep_logits=true"]), Some(snug)).fits()),
        (Some(true), Some(true))
    );
    assert!(!auto(&gpu(&[]), None).keep_logits);
    assert!(!auto(&config(&["model.logprob_chunk_mb=1"]), Some(1 << 40)).keep_logits, "the CPU");
    assert!(!auto(&gpu(&["model.keep_logits=false"]), Some(roomy)).keep_logits);
    assert!(auto(&gpu(&["model.keep_logits=true"]), Some(snug)).keep_logits);
    // The step's shape follows the plan's choice.
    assert!(roomy_plan.step_shape().keep_logits && !snug_plan.step_shape().keep_logits);
    // The key takes true, false and "auto", and names what it expected otherwise.
    assert_eq!(gpu(&["model.keep_logits=auto"]).model.keep_logits, None);
    let toml = "[model]\npath = \"m\"\nkeep_logits = \"auto\"\n[data]\ninputs = [\"x.jsonl\"]\n";
    assert_eq!(TrainConfig::parse(toml, Path::new("c.toml"), &[]).unwrap().model.keep_logits, None);
    let bad = TrainConfig::parse(toml.replace("auto", "often").as_str(), Path::new("c.toml"), &[]).unwrap_err();
    assert!(bad.to_string().contains("expected true, false or \"auto\""), "{bad}");
}

#[test]
fn components_follow_the_formulas() {
    let m = shape();
    // P: embed + lm_head 2 x 32 x 8, per layer q 64 + k 32 + v 32 + o 64 + biases 16 + MLP 384 + norms 16.
    let p = 2 * 32 * 8 + 3 * (64 + 32 + 32 + 64 + 16 + 384 + 16) + 8;
    assert_eq!(m.num_parameters(), p as usize);
    let matrix = planned(&[], Attention::Matrix);
    assert_eq!(bytes(&matrix, "weights"), 2 * p);
    assert_eq!(bytes(&matrix, "gradients (f32 accumulator)"), 4 * p);
    assert_eq!(bytes(&matrix, "optimizer state"), 12 * p);
    assert_eq!(bytes(&matrix, "reference model"), 2 * p); // beta > 0: the reference is loaded
                                                          // N = 2 x 16 = 32 tokens; per layer: 8 [N,8] + 5 [N,8] (q, with bias) + 6 [N,4] (k, v) + 4 [N,16]
                                                          // = 64 + 40 + 24 + 64 = 192 values per token, in bf16; scores + probs 2 x 2 x 2 x 16^2 x 2 B.
    let layer = 32 * 192 * 2 + 2 * 2 * 2 * 256 * 2;
    assert_eq!(bytes(&matrix, "activations, checkpoint_layers = false"), 3 * layer + 32 * 8 * 2);
    assert_eq!(bytes(&matrix, "activations, checkpoint_layers = true"), 4 * 32 * 8 * 2 + layer);
    // n = 2 x 10 scored tokens.
    assert_eq!(bytes(&matrix, "log-prob head inputs"), 3 * 20 * 8 * 2 + 16 * 20);
    let saved = bytes(&planned(&[], Attention::Flash), "activations, checkpoint_layers = false");
    assert_eq!(saved, 3 * (32 * 192 * 2 + 4 * 2 * 2 * 16) + 32 * 8 * 2);
    // Kept attention outputs: per layer [N, q = 8] in bf16 and 4 B x 2 rows x 2 heads x 16 tokens; counted
    // in the backward only when the attention is not recomputed.
    let kept = "attention outputs kept (recompute_attention = false)";
    let recomputed = planned(&["model.checkpoint_layers=true"], Attention::Flash);
    let kept_plan = planned(&["model.checkpoint_layers=true", "model.recompute_attention=false"], Attention::Flash);
    assert_eq!(bytes(&kept_plan, kept), 3 * (32 * 8 * 2 + 4 * 2 * 2 * 16));
    assert_eq!(bytes(&recomputed, kept), bytes(&kept_plan, kept));
    let extra = kept_plan.tensor_peak(Place::Device) - recomputed.tensor_peak(Place::Device);
    assert_eq!(extra, bytes(&kept_plan, kept), "{kept_plan}");
    assert!(kept_plan.advice().contains("model.recompute_attention = true"));
    assert!(!recomputed.advice().contains("recompute_attention"));
    // dq by atomics: an f32 accumulator of [N, q] in the attention workspace.
    let workspace = |set: &[&str]| bytes(&planned(set, Attention::Mma), "attention workspace");
    assert_eq!(workspace(&["model.deterministic_attention=false"]) - workspace(&[]), 32 * 8 * 4);
}

/// On a GPU the device's peak is what nvidia-smi sees: the pool holding the plan's tensors with its
/// measured overheads, and the context outside it; on the CPU the tensors alone. A chunk left to the
/// device is sized from the memory the pool and the context leave free, as the run sizes it.
#[test]
fn the_gpu_peak_is_the_pool_with_its_overheads_beside_the_context() {
    let flash = |i: Inputs| plan(&config(&[]), &shape(), i);
    let gpu = planned(&[], Attention::Flash);
    let tensors = gpu.tensor_peak(Place::Device);
    let pooled = (tensors as f64 * (1.0 + POOL_OVERHEAD.unitemised) * (1.0 + POOL_OVERHEAD.reserve)) as u64;
    assert_eq!(gpu.peak(Place::Device), pooled + CUDA_CONTEXT_BYTES);
    assert!(gpu.to_string().contains("memory pool:"), "{gpu}");
    let cpu = flash(Inputs { on_cpu: true, ..inputs(Attention::Flash) });
    assert_eq!(cpu.peak(Place::Device), cpu.tensor_peak(Place::Device));
    assert!(!cpu.to_string().contains("memory pool:"), "{cpu}");
    // Sized as the run sizes it: an eighth of what the pool's other tensors and the context leave free.
    let device = CUDA_CONTEXT_BYTES + POOL_OVERHEAD.pooled(tensors) + (24u64 << 30);
    let sized = flash(Inputs { device_memory: Some(device), ..inputs(Attention::Flash) });
    let chunk = sized.components.iter().find(|c| c.name.starts_with("log-prob chunk")).unwrap().bytes;
    let others = sized.peak(Place::Device) - POOL_OVERHEAD.pooled(chunk);
    let expected = crate::kernels::gpu_chunk_bytes(device - others) as u64;
    let got = sized.logprob_chunk_bytes;
    assert!(got.abs_diff(expected) <= expected / 100, "{got} vs {expected}");
    assert!(got > 2 << 30, "{got}");
}

#[test]
fn zero1_shards_only_the_optimizer_state() {
    let m = shape();
    let p = m.num_parameters() as u64;
    let four_ranks = Inputs { world_size: 4, ..inputs(Attention::Flash) };
    let (one, four) = (planned(&[], Attention::Flash), plan(&config(&[]), &m, four_ranks));
    assert_eq!(bytes(&four, "optimizer state"), (12 * p).div_ceil(4));
    for same in ["weights", "gradients (f32 accumulator)", "reference model"] {
        assert_eq!(bytes(&four, same), bytes(&one, same), "{same}");
    }
    // The peak drops by the state's three quarters, less the collectives' device buffers when the
    // update phase is the peak; the collectives' host staging is the flat gradients and a block.
    let (saved, buffers) = (12 * p - (12 * p).div_ceil(4), bytes(&four, "collective buffers (NCCL, per piece)"));
    let drop = one.tensor_peak(Place::Device) - four.tensor_peak(Place::Device);
    assert!(drop <= saved && drop + buffers >= saved, "{drop} {saved} {buffers}");
    assert_eq!(buffers, 4 * (p + p / 4));
    let staging = component(&four, "collective staging (f32 gradients / weights)");
    assert_eq!((staging.bytes, staging.place), (4 * p + 4 * p / 4, Place::Host));
    assert!(!has(&one, "collective"));
    assert!(four.summary.contains("per rank of 4"), "{}", four.summary);
    // Offloaded, the shard is in host memory.
    let off = plan(&config(&["optim.offload=true"]), &m, four_ranks);
    assert_eq!(component(&off, "optimizer state").place, Place::Host);
    assert!(off.peak(Place::Host) >= (12 * p).div_ceil(4));
}

#[test]
fn rollouts_add_their_kv_cache_and_a_lagged_policy_copy() {
    let p = shape().num_parameters() as u64;
    let rollouts = |extra: &[&str]| {
        planned(&[&["rollout.batch_size=4", "rollout.max_new_tokens=10"], extra].concat(), Attention::Flash)
    };
    let on_policy = rollouts(&[]);
    assert!(!has(&on_policy, "rollout sampling policy copy"));
    // 3 layers x 2 (k, v) x kv width 4 x 2 B per token; 4 sequences of 6 + 10 tokens (the paged pool,
    // the default: one block of 16 positions each; static batches count them twice); two f32 rows of 32
    // logits per sequence.
    let logits = 2 * 4 * 32 * 4;
    assert_eq!(bytes(&on_policy, "rollout KV cache"), 4 * 16 * (2 * 3 * 4 * 2) + logits);
    let static_batches = rollouts(&["rollout.generation.schedule=static"]);
    assert_eq!(bytes(&static_batches, "rollout KV cache"), 2 * 4 * 16 * (2 * 3 * 4 * 2) + logits);
    let lagged = rollouts(&["rollout.sync_every=2"]);
    assert_eq!(bytes(&lagged, "rollout sampling policy copy"), 2 * p);
    assert_eq!(lagged.tensor_peak(Place::Device), on_policy.tensor_peak(Place::Device) + 2 * p);
    let generation = on_policy.sum(Phase::Rollout, Place::Device);
    let (resident, step) = (on_policy.sum(Phase::Resident, Place::Device), on_policy.step_peak(Place::Device));
    assert_eq!(on_policy.tensor_peak(Place::Device) + CUDA_CONTEXT_BYTES, resident + step.max(generation));
}

#[test]
fn with_rollouts_answers_are_sized_by_max_new_tokens() {
    // data.max_response_tokens = 10, but the sampled answers have at most 3 tokens + EOS.
    let p = planned(&["rollout.max_new_tokens=3"], Attention::Flash);
    assert!(p.summary.ends_with("micro-batch 2 x 10 tokens (6 + 4)"), "{}", p.summary);
    assert_eq!(bytes(&p, "log-prob head inputs"), 3 * 8 * 8 * 2 + 16 * 8);
    // Teacher answers mixed in keep the data's limit.
    let mixed = planned(&["rollout.max_new_tokens=3", "rollout.teacher_answers=1"], Attention::Flash);
    assert!(mixed.summary.ends_with("(6 + 10)"), "{}", mixed.summary);
}

/// With `train.micro_batch_tokens` a micro-batch is one packed row of the budget (of the longest
/// answer when that is longer), every token of which may be scored; the performance model sees as many
/// answers per micro-batch as the budget holds; the advice lowers the budget, not micro_batch_size.
#[test]
fn packed_micro_batches_plan_one_row_of_the_budget() {
    let [padded, packed] = [&[][..], &["train.micro_batch_tokens=32"]]
        .map(|set| [Attention::Flash, Attention::Matrix].map(|a| planned(set, a)));
    assert!(padded[0].summary.ends_with("micro-batch 2 x 16 tokens (6 + 10)"), "{}", padded[0].summary);
    assert!(packed[0].summary.contains("micro-batch 1 x 32 tokens (packed"), "{}", packed[0].summary);
    // The same 32 tokens per micro-batch: the layers' saved activations match (flash attention).
    for c in ["activations, checkpoint_layers = true", "activations, checkpoint_layers = false"] {
        assert_eq!(bytes(&packed[0], c), bytes(&padded[0], c), "{c}");
    }
    // 32 scored tokens (2 x 10 padded), and the score matrix of one row of 32 (two of 16 padded).
    assert_eq!(bytes(&packed[0], "log-prob head inputs"), 3 * 32 * 8 * 2 + 16 * 32);
    assert_eq!(bytes(&padded[0], "log-prob head inputs"), 3 * 20 * 8 * 2 + 16 * 20);
    assert_eq!(bytes(&packed[1], "attention workspace"), 2 * bytes(&padded[1], "attention workspace"));
    // A budget under the longest answer: that answer alone.
    let short = planned(&["train.micro_batch_tokens=5"], Attention::Flash);
    assert!(short.summary.contains("micro-batch 1 x 16 tokens"), "{}", short.summary);
    let answers = |set: &[&str]| planned(set, Attention::Flash).step_shape().micro_batch;
    assert_eq!((answers(&["train.micro_batch_tokens=40"]), answers(&["train.micro_batch_tokens=5"])), (2, 1));
    let cfg = config(&["train.micro_batch_tokens=4096"]);
    let mut p = plan(&cfg, &shape(), Inputs { on_cpu: true, ..inputs(Attention::Matrix) });
    p.input.device_memory = Some(p.peak(Place::Device) - 1);
    let advice = p.advice();
    assert!(advice.contains("train.micro_batch_tokens = ") && !advice.contains("micro_batch_size"), "{advice}");
}

#[test]
fn absurd_shapes_do_not_hang_or_wrap_around_to_fit() {
    let start = std::time::Instant::now();
    let deep = ModelConfig { num_layers: 1_000_000_000, ..shape() };
    assert_eq!(plan(&config(&[]), &deep, inputs(Attention::Flash)).fits(), Some(false));
    assert!(start.elapsed() < std::time::Duration::from_secs(1), "{:?}", start.elapsed());
    for wide in [ModelConfig { vocab_size: usize::MAX, ..shape() }, ModelConfig { hidden_size: 1 << 40, ..shape() }] {
        let p = plan(&config(&[]), &wide, inputs(Attention::Matrix));
        assert_eq!(p.fits(), Some(false), "{p}");
    }
    // The largest values the config accepts: the matrix plan of their scores is past u64 and saturates.
    let p = planned(&["data.max_prompt_tokens=16777216", "train.micro_batch_size=1048576"], Attention::Matrix);
    assert_eq!((p.fits(), p.peak(Place::Device)), (Some(false), u64::MAX), "{p}");
}

#[test]
fn switches_move_memory_where_they_say() {
    let m = shape();
    let p = m.num_parameters() as u64;
    let (base, off) = (planned(&[], Attention::Matrix), planned(&["optim.offload=true"], Attention::Matrix));
    assert!(off.peak(Place::Device) < base.peak(Place::Device));
    assert_eq!(component(&off, "optimizer state").place, Place::Host);
    assert!(off.peak(Place::Host) >= 12 * p);
    let with_cache = plan(&config(&[]), &m, Inputs { reference_cached: true, ..inputs(Attention::Matrix) });
    // The reference's weights (2 P) leave; its log-probs (4 B for each of the 20 scored tokens) come in.
    assert_eq!(base.tensor_peak(Place::Device) - with_cache.tensor_peak(Place::Device), 2 * p - 80);
    assert!(!has(&planned(&["objective.beta=0"], Attention::Matrix), "reference"));
    // On the CPU the host is the device: offload changes nothing there.
    let cpu = |set: &[&str]| plan(&config(set), &m, Inputs { on_cpu: true, ..inputs(Attention::Matrix) });
    let (a, b) = (cpu(&[]), cpu(&["optim.offload=true"]));
    assert_eq!(bytes(&a, "optimizer state"), bytes(&b, "optimizer state"));
    assert!(a.to_string().contains("process"));
}

#[test]
fn the_verdict_and_the_table() {
    let m = shape();
    let mut p = planned(&[], Attention::Matrix);
    assert_eq!(p.fits(), Some(true));
    p.input.device_memory = Some(1000);
    assert_eq!(p.fits(), Some(false));
    let text = p.to_string();
    assert!(text.contains("does NOT fit") && text.contains("weights") && text.contains("device peak"), "{text}");
    p.input.device_memory = None;
    assert_eq!(p.fits(), None);
    // Nothing fits 1000 bytes: the advice names the part no setting changes, and suggests no value.
    let none = p.advice();
    assert!(none.contains("no setting of this run can fit it") && none.contains("do not change"), "{none}");
    assert!(!none.contains(" = "), "{none}");
    // On a device between the floor and the plan, each setting that fits alone is named with its value
    // and the peak it plans, and only those.
    let least = ["model.checkpoint_layers=true", "train.micro_batch_size=1", "optim.offload=true"];
    let cpu = |a| Inputs { on_cpu: true, ..inputs(a) };
    let floor = plan(&config(&least), &m, Inputs { reference_cached: true, ..cpu(Attention::Flash) });
    let mut q = plan(&config(&[]), &m, cpu(Attention::Matrix));
    q.input.device_memory = Some(q.peak(Place::Device) - 1);
    let advice = q.advice();
    assert!(advice.starts_with("reduce the peak with") && advice.contains("(peak "), "{advice}");
    for way in advice.trim_start_matches("reduce the peak with ").split(", or ").filter(|w| w.contains("(peak")) {
        let peak = way.rsplit("(peak ").next().unwrap().split(" GiB").next().unwrap();
        let peak = peak.parse::<f64>().unwrap() - 0.005; // (shown to 0.01 GiB)
        assert!(peak * (1u64 << 30) as f64 <= q.input.device_memory.unwrap() as f64, "{way}");
    }
    assert!(floor.peak(Place::Device) < q.peak(Place::Device));
    // Settings the config already has are not advised.
    let mut r = floor;
    r.input.device_memory = Some(r.peak(Place::Device) - 1);
    let advice = r.advice();
    for key in ["checkpoint_layers", "micro_batch_size", "offload", "attention", "cache_reference"] {
        assert!(!advice.contains(&format!("{key} = ")), "{key}: {advice}");
    }
}

#[test]
fn sizes_parse_with_units() {
    let good: [(&str, u64); 5] =
        [("80GiB", 80 << 30), ("80 GB", 80_000_000_000), ("512MiB", 512 << 20), ("1.5gib", 3 << 29), ("1024", 1024)];
    for (s, n) in good {
        assert_eq!(parse_bytes(s), Ok(n), "{s}");
    }
    for bad in ["", "GiB", "-1GiB", "nan", "80 parsecs", "0"] {
        assert!(parse_bytes(bad).is_err(), "{bad}");
    }
}
