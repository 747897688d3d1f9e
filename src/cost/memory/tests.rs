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

fn run_plan(cfg: &TrainConfig, m: &ModelConfig, device_memory: Option<u64>, world_size: u64) -> Plan {
    cfg.memory_plan(m, device_memory, world_size)
}

fn bytes(p: &Plan, name: &str) -> u64 {
    p.components.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name}")).bytes
}

/// Kept logits are one more backward component, `n V d` (2 answers of 10 scored tokens), which the
/// advice drops first when the step does not fit.
#[test]
fn kept_logits_are_counted_and_advised_away() {
    let m = shape();
    let (base, keeping) =
        (config(&["model.logprob_chunk_mb=1"]), config(&["model.logprob_chunk_mb=1", "model.keep_logits=true"]));
    let (plain, kept) = (plan(&base, &m, inputs(Attention::Flash)), plan(&keeping, &m, inputs(Attention::Flash)));
    let name = "logits kept (model.keep_logits)";
    assert_eq!(bytes(&kept, name), 2 * 10 * m.vocab_size as u64 * 2);
    assert!(plain.components.iter().all(|c| c.name != name));
    assert!(kept.tensor_peak(Place::Device) > plain.tensor_peak(Place::Device));
    // A device with the plain step's peak: keeping the logits does not fit, and the advice drops them.
    let memory = (plain.peak(Place::Device) as f64 / (1.0 - GPU_HEADROOM)).ceil() as u64 + 64;
    let tight = Inputs { device_memory: Some(memory), ..inputs(Attention::Flash) };
    assert_eq!(plan(&base, &m, tight).fits(), Some(true));
    let tight_plan = plan(&keeping, &m, tight);
    assert_eq!(tight_plan.fits(), Some(false), "{tight_plan}");
    assert!(tight_plan.advice().contains("model.keep_logits = false"), "{}", tight_plan.advice());
}

/// "auto" (the default) keeps the logits on a GPU where the plan with them leaves room to spare, never
/// on the CPU or where the memory is unknown; `true` and `false` are kept as set.
#[test]
fn auto_keeps_logits_only_with_room_to_spare() {
    let m = shape();
    let gpu = |extra: &[&str]| config(&[&["model.logprob_chunk_mb=1", "model.device=cuda"], extra].concat());
    let kept = run_plan(&gpu(&["model.keep_logits=true"]), &m, None, 1);
    let plain = run_plan(&gpu(&["model.keep_logits=false"]), &m, None, 1);
    let (with, without) = (kept.peak(Place::Device) as f64, plain.peak(Place::Device) as f64);
    let usable = |share: f64| (share / (1.0 - GPU_HEADROOM)).ceil() as u64;
    // Room to spare: the peak with them at the share of what the plan may use.
    let roomy = usable(with / AUTO_KEEP_LOGITS_SHARE) + 64;
    // Room for them, not to spare: the peak with them fits, above the share.
    let snug = usable(with) + 64;
    assert!(without < with && (snug as f64) < roomy as f64 - 64.0);
    let auto = |c: &TrainConfig, memory: Option<u64>| run_plan(c, &m, memory, 1);
    let (roomy_plan, snug_plan) = (auto(&gpu(&[]), Some(roomy)), auto(&gpu(&[]), Some(snug)));
    assert!(roomy_plan.keep_logits && roomy_plan.components.iter().any(|c| c.name.starts_with("logits kept")));
    assert!(roomy_plan.to_string().contains("model.keep_logits = \"auto\": kept"), "{roomy_plan}");
    assert!(snug_plan.to_string().contains("model.keep_logits = \"auto\": recomputed"), "{snug_plan}");
    assert!(!snug_plan.keep_logits && snug_plan.components.iter().all(|c| !c.name.starts_with("logits kept")));
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
    let matrix = plan(&config(&[]), &m, inputs(Attention::Matrix));
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
    let flash = plan(&config(&[]), &m, inputs(Attention::Flash));
    let saved = bytes(&flash, "activations, checkpoint_layers = false");
    assert_eq!(saved, 3 * (32 * 192 * 2 + 4 * 2 * 2 * 16) + 32 * 8 * 2);
    // Kept attention outputs: per layer [N, q = 8] in bf16 and 4 B x 2 rows x 2 heads x 16 tokens; counted
    // in the backward only when the attention is not recomputed.
    let kept = "attention outputs kept (recompute_attention = false)";
    let recomputed = plan(&config(&["model.checkpoint_layers=true"]), &m, inputs(Attention::Flash));
    let keeping = &config(&["model.checkpoint_layers=true", "model.recompute_attention=false"]);
    let kept_plan = plan(keeping, &m, inputs(Attention::Flash));
    assert_eq!(bytes(&kept_plan, kept), 3 * (32 * 8 * 2 + 4 * 2 * 2 * 16));
    assert_eq!(bytes(&recomputed, kept), bytes(&kept_plan, kept));
    let extra = kept_plan.tensor_peak(Place::Device) - recomputed.tensor_peak(Place::Device);
    assert_eq!(extra, bytes(&kept_plan, kept), "{kept_plan}");
    assert!(kept_plan.advice().contains("model.recompute_attention = true"));
    assert!(!recomputed.advice().contains("recompute_attention"));
    // dq by atomics: an f32 accumulator of [N, q] in the attention workspace.
    let mma = plan(&config(&[]), &m, inputs(Attention::Mma));
    let atomic = plan(&config(&["model.deterministic_attention=false"]), &m, inputs(Attention::Mma));
    let workspace = |p: &Plan| bytes(p, "attention workspace");
    assert_eq!(workspace(&atomic) - workspace(&mma), 32 * 8 * 4);
}

/// On a GPU the device's peak is what nvidia-smi sees: the pool holding the plan's tensors with its
/// measured overheads, and the context outside it; on the CPU the tensors alone. A chunk left to the
/// device is sized from the memory the pool and the context leave free, as the run sizes it.
#[test]
fn the_gpu_peak_is_the_pool_with_its_overheads_beside_the_context() {
    let m = shape();
    let gpu = plan(&config(&[]), &m, inputs(Attention::Flash));
    let tensors = gpu.tensor_peak(Place::Device);
    let pooled = (tensors as f64 * (1.0 + POOL_OVERHEAD.unitemised) * (1.0 + POOL_OVERHEAD.reserve)) as u64;
    assert_eq!(gpu.peak(Place::Device), pooled + CUDA_CONTEXT_BYTES);
    assert!(gpu.to_string().contains("memory pool:"), "{gpu}");
    let cpu = plan(&config(&[]), &m, Inputs { on_cpu: true, ..inputs(Attention::Flash) });
    assert_eq!(cpu.peak(Place::Device), cpu.tensor_peak(Place::Device));
    assert!(!cpu.to_string().contains("memory pool:"), "{cpu}");
    // Sized as the run sizes it: an eighth of what the pool's other tensors and the context leave free.
    let device = CUDA_CONTEXT_BYTES + POOL_OVERHEAD.pooled(tensors) + (24u64 << 30);
    let sized = plan(&config(&[]), &m, Inputs { device_memory: Some(device), ..inputs(Attention::Flash) });
    let chunk = sized.components.iter().find(|c| c.name.starts_with("log-prob chunk")).unwrap().bytes;
    let others = sized.peak(Place::Device) - POOL_OVERHEAD.pooled(chunk);
    let expected = crate::kernels::gpu_chunk_bytes(device - others) as u64;
    assert!(
        sized.logprob_chunk_bytes.abs_diff(expected) <= expected / 100,
        "{} vs {expected}",
        sized.logprob_chunk_bytes
    );
    assert!(sized.logprob_chunk_bytes > 2 << 30, "{}", sized.logprob_chunk_bytes);
}

#[test]
fn zero1_shards_only_the_optimizer_state() {
    let m = shape();
    let p = m.num_parameters() as u64;
    let one = plan(&config(&[]), &m, inputs(Attention::Flash));
    let four = plan(&config(&[]), &m, Inputs { world_size: 4, ..inputs(Attention::Flash) });
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
    let staging = four.components.iter().find(|c| c.name == "collective staging (f32 gradients / weights)");
    assert_eq!(staging.map(|c| (c.bytes, c.place)), Some((4 * p + 4 * p / 4, Place::Host)));
    assert!(one.components.iter().all(|c| !c.name.starts_with("collective")));
    assert!(four.summary.contains("per rank of 4"), "{}", four.summary);
    // Offloaded, the shard is in host memory.
    let off = plan(&config(&["optim.offload=true"]), &m, Inputs { world_size: 4, ..inputs(Attention::Flash) });
    assert_eq!(off.components.iter().find(|c| c.name == "optimizer state").unwrap().place, Place::Host);
    assert!(off.peak(Place::Host) >= (12 * p).div_ceil(4));
}

#[test]
fn rollouts_add_their_kv_cache_and_a_lagged_policy_copy() {
    let m = shape();
    let p = m.num_parameters() as u64;
    let set = ["rollout.batch_size=4", "rollout.max_new_tokens=10"];
    let on_policy = plan(&config(&set), &m, inputs(Attention::Flash));
    assert!(on_policy.components.iter().all(|c| c.name != "rollout sampling policy copy"));
    // 3 layers x 2 (k, v) x kv width 4 x 2 B per token; 4 sequences of 6 + 10 tokens (the paged pool,
    // the default: one block of 16 positions each; static batches count them twice); two f32 rows of 32
    // logits per sequence.
    let logits = 2 * 4 * 32 * 4;
    assert_eq!(bytes(&on_policy, "rollout KV cache"), 4 * 16 * (2 * 3 * 4 * 2) + logits);
    let static_batches =
        plan(&config(&[set[0], set[1], "rollout.generation.schedule=static"]), &m, inputs(Attention::Flash));
    assert_eq!(bytes(&static_batches, "rollout KV cache"), 2 * 4 * 16 * (2 * 3 * 4 * 2) + logits);
    let lagged = plan(&config(&[set[0], set[1], "rollout.sync_every=2"]), &m, inputs(Attention::Flash));
    assert_eq!(bytes(&lagged, "rollout sampling policy copy"), 2 * p);
    assert_eq!(lagged.tensor_peak(Place::Device), on_policy.tensor_peak(Place::Device) + 2 * p);
    let generation = on_policy.sum(Phase::Rollout, Place::Device);
    let (resident, step) = (on_policy.sum(Phase::Resident, Place::Device), on_policy.step_peak(Place::Device));
    assert_eq!(on_policy.tensor_peak(Place::Device) + CUDA_CONTEXT_BYTES, resident + step.max(generation));
}

#[test]
fn with_rollouts_answers_are_sized_by_max_new_tokens() {
    let m = shape();
    // data.max_response_tokens = 10, but the sampled answers have at most 3 tokens + EOS.
    let p = plan(&config(&["rollout.max_new_tokens=3"]), &m, inputs(Attention::Flash));
    assert!(p.summary.ends_with("micro-batch 2 x 10 tokens (6 + 4)"), "{}", p.summary);
    assert_eq!(bytes(&p, "log-prob head inputs"), 3 * 8 * 8 * 2 + 16 * 8);
    // Teacher answers mixed in keep the data's limit.
    let mixed = plan(&config(&["rollout.max_new_tokens=3", "rollout.teacher_answers=1"]), &m, inputs(Attention::Flash));
    assert!(mixed.summary.ends_with("(6 + 10)"), "{}", mixed.summary);
}

/// With `train.micro_batch_tokens` a micro-batch is one packed row of the budget (of the longest
/// answer when that is longer), every token of which may be scored; the performance model sees as many
/// answers per micro-batch as the budget holds; the advice lowers the budget, not micro_batch_size.
#[test]
fn packed_micro_batches_plan_one_row_of_the_budget() {
    let m = shape();
    let [padded, packed] = [&[][..], &["train.micro_batch_tokens=32"]]
        .map(|set| [Attention::Flash, Attention::Matrix].map(|a| plan(&config(set), &m, inputs(a))));
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
    let short = plan(&config(&["train.micro_batch_tokens=5"]), &m, inputs(Attention::Flash));
    assert!(short.summary.contains("micro-batch 1 x 16 tokens"), "{}", short.summary);
    let shape_of = |set: &[&str]| {
        let cfg = config(set);
        plan(&cfg, &m, inputs(Attention::Flash)).step_shape().micro_batch
    };
    assert_eq!((shape_of(&["train.micro_batch_tokens=40"]), shape_of(&["train.micro_batch_tokens=5"])), (2, 1));
    let cfg = config(&["train.micro_batch_tokens=4096"]);
    let mut p = plan(&cfg, &m, Inputs { on_cpu: true, ..inputs(Attention::Matrix) });
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
    let long = config(&["data.max_prompt_tokens=16777216", "train.micro_batch_size=1048576"]);
    let p = plan(&long, &shape(), inputs(Attention::Matrix));
    assert_eq!((p.fits(), p.peak(Place::Device)), (Some(false), u64::MAX), "{p}");
}

#[test]
fn switches_move_memory_where_they_say() {
    let m = shape();
    let base = plan(&config(&[]), &m, inputs(Attention::Matrix));
    let off = plan(&config(&["optim.offload=true"]), &m, inputs(Attention::Matrix));
    assert!(off.peak(Place::Device) < base.peak(Place::Device));
    assert_eq!(off.components.iter().find(|c| c.name == "optimizer state").unwrap().place, Place::Host);
    assert!(off.peak(Place::Host) >= 12 * m.num_parameters() as u64);
    let cached = Inputs { reference_cached: true, ..inputs(Attention::Matrix) };
    let with_cache = plan(&config(&[]), &m, cached);
    // The reference's weights (2 P) leave; its log-probs (4 B for each of the 20 scored tokens) come in.
    assert_eq!(
        base.tensor_peak(Place::Device) - with_cache.tensor_peak(Place::Device),
        2 * m.num_parameters() as u64 - 80
    );
    let no_ref = plan(&config(&["objective.beta=0"]), &m, inputs(Attention::Matrix));
    assert!(!no_ref.components.iter().any(|c| c.name.starts_with("reference")));
    // On the CPU the host is the device: offload changes nothing there.
    let cpu = |c: &TrainConfig| plan(c, &m, Inputs { on_cpu: true, ..inputs(Attention::Matrix) });
    let (a, b) = (cpu(&config(&[])), cpu(&config(&["optim.offload=true"])));
    assert_eq!(bytes(&a, "optimizer state"), bytes(&b, "optimizer state"));
    assert!(a.to_string().contains("process"));
}

#[test]
fn the_verdict_and_the_table() {
    let m = shape();
    let mut p = plan(&config(&[]), &m, inputs(Attention::Matrix));
    assert_eq!(p.fits(), Some(true));
    p.input.device_memory = Some(1000);
    assert_eq!(p.fits(), Some(false));
    let text = p.to_string();
    assert!(text.contains("does NOT fit") && text.contains("weights") && text.contains("device peak"), "{text}");
    p.input.device_memory = None;
    assert_eq!(p.fits(), None);
    // Nothing fits 1000 bytes: the advice names the part no setting changes, and suggests no value.
    let cfg = config(&[]);
    let none = p.advice();
    assert!(none.contains("no setting of this run can fit it") && none.contains("do not change"), "{none}");
    assert!(!none.contains(" = "), "{none}");
    // On a device between the floor and the plan, each setting that fits alone is named with its value
    // and the peak it plans, and only those.
    let floor = config(&["model.checkpoint_layers=true", "train.micro_batch_size=1", "optim.offload=true"]);
    let cpu = |a| Inputs { on_cpu: true, ..inputs(a) };
    let floor = plan(&floor, &m, Inputs { reference_cached: true, ..cpu(Attention::Flash) });
    let mut q = plan(&cfg, &m, cpu(Attention::Matrix));
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
    let set = config(&["model.checkpoint_layers=true", "train.micro_batch_size=1", "optim.offload=true"]);
    let mut r = plan(&set, &m, Inputs { reference_cached: true, ..cpu(Attention::Flash) });
    r.input.device_memory = Some(r.peak(Place::Device) - 1);
    let advice = r.advice();
    for key in ["checkpoint_layers", "micro_batch_size", "offload", "attention", "cache_reference"] {
        assert!(!advice.contains(&format!("{key} = ")), "{key}: {advice}");
    }
}

#[test]
fn sizes_parse_with_units() {
    assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
    assert_eq!(parse_bytes("80 GB"), Ok(80_000_000_000));
    assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
    assert_eq!(parse_bytes("1.5gib"), Ok(3 << 29));
    assert_eq!(parse_bytes("1024"), Ok(1024));
    for bad in ["", "GiB", "-1GiB", "nan", "80 parsecs", "0"] {
        assert!(parse_bytes(bad).is_err(), "{bad}");
    }
}
