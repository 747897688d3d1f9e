//! `grpo bench generate`: generation on random weights (which never stop early: every answer runs to its
//! length), on a job like a user's: P prompts x n samples with answer lengths from a long-tailed mix (as
//! `grpo bench pack` draws them), or `batch` prompts of one length each answered in full. The job runs under
//! the `--schedule` given and, with `--compare`, under the other one too, with the ratio of their tokens/s;
//! the performance model's decode step on each modelled GPU is printed beside.

use std::path::PathBuf;

use rand::SeedableRng;
use serde_json::{json, Value};

use super::harness::{
    dtype_name, load_shape, long_tailed, median, random_ids, random_model, shape_name, time_runs, BenchError, Result,
    Timing,
};
use crate::device::device_name;
use crate::generate::{
    generate_limited, generate_paged, GenerateError, GenerationOptions, Request, SamplingParams, Schedule,
};
use crate::model::Decoder;

/// Generation settings (`grpo bench generate`).
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateSpec {
    /// HF config.json of the model shape; weights are random.
    #[arg(long)]
    pub shape: PathBuf,
    /// Sequences at a time.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Prompt tokens: every prompt's, or with --problems the mix's median (log-normal, sigma 0.6).
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// New tokens of every answer, or with --problems the most an answer has.
    #[arg(long, default_value_t = 256)]
    pub new_tokens: usize,
    /// Problems of a long-tailed mix (0: `--batch` prompts, every answer --new-tokens long).
    #[arg(long, default_value_t = 0)]
    pub problems: usize,
    /// Samples per problem, sharing its prompt (with --problems).
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Median answer tokens of the mix (log-normal: a problem's median drawn around it with sigma 0.5,
    /// each answer around its problem's with sigma 0.55, cut at --new-tokens); 0: a quarter of --new-tokens.
    #[arg(long, default_value_t = 0.0)]
    pub answer_median: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also run the job under the other schedule, and print the ratio of their tokens/s.
    #[arg(long)]
    pub compare: bool,
    /// The fused RMSNorm/rope/softmax kernels; --composite-ops uses candle's composite ops instead.
    #[arg(long = "composite-ops", action = clap::ArgAction::SetFalse)]
    pub fused_ops: bool,
    #[command(flatten)]
    pub generation: GenerationOptions,
}

/// The job: each problem's prompt and its samples' answer lengths.
struct Job {
    problems: Vec<(Vec<u32>, Vec<usize>)>,
}

impl Job {
    fn sequences(&self) -> usize {
        self.problems.iter().map(|(_, l)| l.len()).sum()
    }

    fn tokens(&self) -> usize {
        self.problems.iter().flat_map(|(_, l)| l).sum()
    }

    /// Mean context a decode step attends to: over every generated token, its prompt and the answer so far.
    fn mean_context(&self) -> f64 {
        let total: f64 = self
            .problems
            .iter()
            .flat_map(|(p, ls)| ls.iter().map(|&l| l as f64 * (p.len() as f64 + l as f64 / 2.0)))
            .sum();
        total / self.tokens().max(1) as f64
    }

    fn check_tokens(&self, produced: usize) -> Result<()> {
        if produced != self.tokens() {
            return Err(BenchError::Invalid(format!(
                "generated {produced} tokens, the job's answers hold {}",
                self.tokens()
            )));
        }
        Ok(())
    }
}

/// `spec`'s job, deterministic in its seed.
fn job(spec: &GenerateSpec, vocab: usize) -> Job {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(spec.seed);
    if spec.problems == 0 {
        let problems =
            (0..spec.batch).map(|_| (random_ids(&mut rng, spec.prompt_len, vocab), vec![spec.new_tokens])).collect();
        return Job { problems };
    }
    let median = if spec.answer_median > 0.0 { spec.answer_median } else { spec.new_tokens as f64 / 4.0 };
    let problems = (0..spec.problems)
        .map(|_| {
            let (prompt, lengths) = long_tailed(&mut rng, spec.prompt_len as f64, (median, 0.5, 0.55), spec.samples);
            let lengths = lengths.into_iter().map(|l| l.min(spec.new_tokens)).collect();
            (random_ids(&mut rng, prompt, vocab), lengths)
        })
        .collect();
    Job { problems }
}

/// One schedule's run of the job: its median time and what the engine reports.
#[derive(Debug, serde::Serialize)]
struct RunRecord {
    schedule: Schedule,
    time_s: f64,
    tokens_per_s: f64,
    /// Forwards of the model (decode steps, and with the paged engine the chunks of prefill they carry).
    steps: usize,
    steps_per_s: f64,
    /// Mean sequences per step over the `batch` seats.
    occupancy: f64,
    /// The paged engine's KV pool: its blocks, the most in use, positions held per position cached.
    kv_pool_blocks: Option<usize>,
    kv_peak_blocks: Option<usize>,
    kv_held_per_cached: Option<f64>,
    prefill_computed: Option<usize>,
    prefill_saved: Option<usize>,
    preemptions: Option<usize>,
}

impl RunRecord {
    /// A run of `tokens` in `steps` steps, without the paged engine's counts.
    fn new(schedule: Schedule, time_s: f64, tokens: usize, steps: usize, occupancy: f64) -> Self {
        RunRecord {
            schedule,
            time_s,
            tokens_per_s: tokens as f64 / time_s,
            steps,
            steps_per_s: steps as f64 / time_s,
            occupancy,
            kv_pool_blocks: None,
            kv_peak_blocks: None,
            kv_held_per_cached: None,
            prefill_computed: None,
            prefill_saved: None,
            preemptions: None,
        }
    }
}

/// `job` under the paged engine, `batch` sequences at a time.
fn run_paged(model: &Decoder, job: &Job, spec: &GenerateSpec, t: &Timing) -> Result<RunRecord> {
    let params = SamplingParams { max_new_tokens: spec.new_tokens, ..Default::default() };
    let requests: Vec<Request> = (job.problems.iter())
        .scan(0u64, |first, (p, lengths)| {
            let r = Request { max_new_tokens: lengths.clone(), ..Request::new(p.clone(), *first, lengths.len()) };
            *first += lengths.len() as u64;
            Some(r)
        })
        .collect();
    let (times, reports) = time_runs(t, || {
        let mut skipped = None;
        let report = generate_paged::<GenerateError>(
            model,
            &requests,
            &params,
            (&[], spec.batch),
            &spec.generation,
            |_| {},
            |_, g| {
                if let Err(why) = g {
                    skipped.get_or_insert(why);
                }
                Ok(())
            },
        )
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
        match skipped {
            Some(why) => Err(BenchError::Invalid(format!("a request was skipped: {why}"))),
            None => Ok(report),
        }
    })?;
    let r = reports.into_iter().next().ok_or_else(|| BenchError::Invalid("no timed run".into()))?;
    job.check_tokens(r.generated)?;
    let run = RunRecord::new(Schedule::Continuous, median(&times), r.generated, r.steps, r.occupancy);
    Ok(RunRecord {
        kv_pool_blocks: Some(r.pool_blocks),
        kv_peak_blocks: Some(r.peak_blocks),
        kv_held_per_cached: Some(r.kv_held_per_cached),
        prefill_computed: Some(r.counts.prefill_computed),
        prefill_saved: Some(r.counts.prefill_saved),
        preemptions: Some(r.counts.preemptions),
        ..run
    })
}

/// A static batch: its prompts, their sequence ids and their answers' lengths.
type StaticBatch = (Vec<Vec<u32>>, Vec<u64>, Vec<usize>);

/// `job` in static batches of whole problems (as `grpo eval` groups them): `batch / samples` problems at
/// a time, each batch decoded until its longest answer ends.
fn run_static(model: &Decoder, job: &Job, spec: &GenerateSpec, t: &Timing) -> Result<RunRecord> {
    let params = SamplingParams { max_new_tokens: spec.new_tokens, ..Default::default() };
    let per_batch = (spec.batch / spec.samples.max(1)).max(1);
    let batches: Vec<StaticBatch> = (job.problems.chunks(per_batch))
        .scan(0u64, |first, chunk| {
            let (mut prompts, mut ids, mut limits) = (vec![], vec![], vec![]);
            for (p, &l) in chunk.iter().flat_map(|(p, lengths)| lengths.iter().map(move |l| (p, l))) {
                prompts.push(p.clone());
                ids.push(*first);
                limits.push(l);
                *first += 1;
            }
            Some((prompts, ids, limits))
        })
        .collect();
    let (times, outs) = time_runs(t, || {
        let mut produced = 0;
        for (prompts, ids, limits) in &batches {
            let g = generate_limited(model, prompts, (ids, limits), &params, &[], 0, |_| {})?;
            produced += g.iter().map(|g| g.tokens.len()).sum::<usize>();
        }
        Ok(produced)
    })?;
    job.check_tokens(outs.first().copied().unwrap_or(0))?;
    // Each batch runs as many steps as its longest answer, its seats busy with the answers not yet done.
    let steps: usize = batches.iter().map(|(_, _, l)| l.iter().copied().max().unwrap_or(0)).sum();
    let occupancy = job.tokens() as f64 / (steps.max(1) * spec.batch) as f64;
    Ok(RunRecord::new(Schedule::Static, median(&times), job.tokens(), steps, occupancy))
}

/// Generate `spec`'s job under its schedule (and with `--compare` the other one), beside the model's
/// decode step (at the run's mean sequences per step and context) on each modelled GPU.
pub fn generate(spec: &GenerateSpec, t: &Timing) -> Result<Value> {
    spec.generation.validate("--").map_err(BenchError::Invalid)?;
    if spec.batch == 0 || spec.new_tokens == 0 || spec.samples == 0 {
        return Err(BenchError::Invalid("--batch, --new-tokens and --samples must be at least 1".into()));
    }
    let cfg = load_shape(&spec.shape)?;
    let job = job(spec, cfg.vocab_size);
    let mut model = random_model(cfg.clone(), t, false)?;
    model.options.fused_ops = spec.fused_ops;
    let run = |s: Schedule| match s {
        Schedule::Continuous => run_paged(&model, &job, spec, t),
        Schedule::Static => run_static(&model, &job, spec, t),
    };
    let main = run(spec.generation.schedule)?;
    let other = match spec.generation.schedule {
        Schedule::Continuous => Schedule::Static,
        Schedule::Static => Schedule::Continuous,
    };
    let reference = spec.compare.then(|| run(other)).transpose()?;
    let shape = crate::cost::decode::DecodeShape {
        sequences: (main.occupancy * spec.batch as f64).max(1.0),
        context: job.mean_context(),
        dtype_bytes: t.dtype.size_in_bytes() as f64,
    };
    let gpus = crate::cost::calibration::gpus().iter();
    let mut record = json!({
        "bench": "generate",
        "impl": "grpo",
        "shape": shape_name(&spec.shape),
        "batch": spec.batch,
        "prompt_len": spec.prompt_len,
        "new_tokens": spec.new_tokens,
        "problems": spec.problems,
        "samples": spec.samples,
        "sequences": job.sequences(),
        "answer_tokens": job.tokens(),
        "mean_context": shape.context,
        "fused_ops": spec.fused_ops,
        "dtype": dtype_name(t.dtype),
        "device": device_name(&t.device),
    });
    // The main run's keys inline, then the other schedule's run and the ratio of their tokens/s.
    let tail = json!({
        "reference": reference,
        "tokens_per_s_over_reference": reference.as_ref().map(|r| main.tokens_per_s / r.tokens_per_s),
        "predicted_decode_step": gpus.map(|g| crate::cost::decode::predict_decode(&cfg, shape, g)).collect::<Vec<_>>(),
    });
    for part in [json!(main), tail] {
        if let (Value::Object(record), Value::Object(part)) = (&mut record, part) {
            record.extend(part);
        }
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::{cpu, parse, tiny_shape};

    /// A 3-prompt job of 5-token prompts and 4-token answers.
    fn spec(shape: &std::path::Path) -> GenerateSpec {
        let args = ["--shape", shape.to_str().unwrap(), "--batch", "3", "--prompt-len", "5", "--new-tokens", "4"];
        GenerateSpec { fused_ops: false, generation: GenerationOptions::default(), ..parse(&args) }
    }

    #[test]
    fn generation_produces_every_token() {
        let dir = tempfile::tempdir().unwrap();
        let r = generate(&spec(&tiny_shape(dir.path())), &cpu()).unwrap();
        assert_eq!((r["batch"].as_u64(), r["answer_tokens"].as_u64()), (Some(3), Some(12)));
        assert_eq!(r["schedule"], "continuous");
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert_eq!(r["predicted_decode_step"].as_array().unwrap().len(), crate::cost::calibration::gpus().len());
    }

    /// A long-tailed job under both schedules: the same answer tokens, the paged engine's samples sharing
    /// their problem's prompt (prefill saved), and static batches counted by their longest answers.
    #[test]
    fn both_schedules_run_the_same_long_tailed_job() {
        let dir = tempfile::tempdir().unwrap();
        let s = GenerateSpec {
            problems: 4,
            samples: 3,
            batch: 6,
            new_tokens: 12,
            compare: true,
            ..spec(&tiny_shape(dir.path()))
        };
        let j = job(&s, 97);
        let lengths: Vec<usize> = j.problems.iter().flat_map(|(_, l)| l.iter().copied()).collect();
        assert_eq!(lengths.len(), 12);
        assert!(lengths.iter().all(|&l| (1..=12).contains(&l)));
        assert!(lengths.iter().any(|&l| l != lengths[0]), "lengths vary: {lengths:?}");
        let r = generate(&s, &cpu()).unwrap();
        let prompts: u64 = j.problems.iter().map(|(p, _)| p.len() as u64).sum();
        assert_eq!(r["prefill_computed"].as_u64(), Some(prompts));
        assert_eq!(r["prefill_saved"].as_u64(), Some(2 * prompts));
        let reference = &r["reference"];
        assert_eq!(reference["schedule"], "static");
        let static_steps: usize =
            j.problems.chunks(2).map(|c| c.iter().flat_map(|(_, l)| l).copied().max().unwrap()).sum();
        assert_eq!(reference["steps"].as_u64(), Some(static_steps as u64));
        assert!(r["tokens_per_s_over_reference"].as_f64().unwrap() > 0.0);
    }
}
