//! `grpo eval`: generate answers on math benchmarks and score them (avg@n, pass@k, maj@n).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;

use crate::eval::{benchmarks, run, EvalSettings, ProblemResult, SamplingParams};
use crate::jsonl::Lines;
use crate::model::{self, ChatTokenizer};
use crate::reward::ExtractOptions;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Registered benchmarks, comma-separated (see --list).
    #[arg(long, value_delimiter = ',', required_unless_present_any = ["list", "bench_file"])]
    pub bench: Vec<String>,
    /// Any JSONL of {"problem", "answer", "id"?} instead of a registered benchmark.
    #[arg(long, requires = "prompt_template")]
    pub bench_file: Option<PathBuf>,
    /// Prompt template for --bench-file, with {problem} where the problem goes.
    #[arg(long)]
    pub prompt_template: Option<String>,
    /// List the registered benchmarks and exit.
    #[arg(long)]
    pub list: bool,
    /// Model folder or hub id (local Hugging Face cache).
    #[arg(long, required_unless_present = "list")]
    pub model: Option<String>,
    /// Samples per problem.
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.6)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 32768)]
    pub max_new_tokens: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Only the first K problems of each benchmark.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Sequences generated together.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// A system prompt before each problem.
    #[arg(long)]
    pub system_prompt: Option<String>,
    /// Fall back to "the answer is X" and the last number when there is no \boxed{}.
    #[arg(long)]
    pub fallbacks: bool,
    /// Output folder: generations.jsonl and report.json.
    #[arg(long, default_value = "runs/eval")]
    pub out: PathBuf,
    /// Continue an interrupted run: problems already in OUT/generations.jsonl are not generated again.
    #[arg(long)]
    pub resume: bool,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

/// The readable results of an earlier run, in file order.
fn read_done(path: &std::path::Path) -> anyhow::Result<Vec<ProblemResult>> {
    let mut done = Vec::new();
    if !path.exists() {
        return Ok(done);
    }
    for line in Lines::open(path)? {
        let line = line?;
        match line.json::<ProblemResult>() {
            Ok(r) => {
                done.push(r);
            }
            Err(e) => tracing::warn!(
                "{}:{}: ignoring unreadable line ({e}); it will be generated again",
                path.display(),
                line.number
            ),
        }
    }
    Ok(done)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.list {
        println!("{:<10} {:>8}  description", "name", "problems");
        for (name, count, about) in benchmarks::list() {
            println!("{name:<10} {count:>8}  {about}");
        }
        return Ok(());
    }
    let mut selected = Vec::new();
    for name in &args.bench {
        selected.push(benchmarks::load(name)?);
    }
    if let (Some(f), Some(t)) = (&args.bench_file, &args.prompt_template) {
        selected.push(benchmarks::load_file(f, t)?);
    }
    let model_name = args.model.clone().unwrap_or_default();
    let dir = model::resolve_model_dir(&model_name)?;
    let device = model::parse_device(&args.device)?;
    let dtype = model::parse_dtype(&args.dtype)?;
    let tok = ChatTokenizer::load(&dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let decoder =
        model::load_decoder(&dir, dtype, &device, false).with_context(|| format!("loading {}", dir.display()))?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let gen_path = args.out.join("generations.jsonl");
    let previous = if args.resume { read_done(&gen_path)? } else { Vec::new() };
    // Start from the readable results only (an interrupted run may have left a torn last line).
    let mut kept = crate::jsonl::AtomicFile::create(Some(&gen_path))?;
    for r in &previous {
        kept.write_json(r)?;
    }
    kept.commit()?;
    let done: HashMap<(String, String), ProblemResult> =
        previous.into_iter().map(|r| ((r.bench.clone(), r.id.clone()), r)).collect();
    let mut gen_file = std::fs::OpenOptions::new()
        .append(true)
        .open(&gen_path)
        .with_context(|| format!("opening {}", gen_path.display()))?;
    let settings = EvalSettings {
        n: args.n.max(1),
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            max_new_tokens: args.max_new_tokens,
            seed: args.seed,
        },
        batch_size: args.batch_size.max(1),
        system_prompt: args.system_prompt.clone(),
        limit: args.limit,
        extract: ExtractOptions { fallbacks: args.fallbacks },
    };
    let started = std::time::Instant::now();
    let mut reports = Vec::new();
    for b in &selected {
        let total = args.limit.unwrap_or(usize::MAX).min(b.problems.len());
        let bar = super::progress_bar(Some(total as u64), &b.name);
        let done_b: HashMap<String, ProblemResult> =
            done.iter().filter(|((bn, _), _)| bn == &b.name).map(|((_, id), r)| (id.clone(), r.clone())).collect();
        let t0 = std::time::Instant::now();
        let (report, _) = run::evaluate(
            &decoder,
            &tok,
            b,
            &settings,
            &done_b,
            |r| {
                serde_json::to_writer(&mut gen_file, r)
                    .map_err(std::io::Error::from)
                    .and_then(|()| gen_file.write_all(b"\n"))
                    .and_then(|()| gen_file.flush())
                    .map_err(|source| crate::eval::EvalError::Io { path: gen_path.clone(), source })
            },
            |problems, tokens| {
                bar.set_position(problems as u64);
                let secs = t0.elapsed().as_secs_f64().max(1e-9);
                bar.set_message(format!("{:.1} tok/s", tokens as f64 / secs));
            },
        )?;
        bar.finish_and_clear();
        reports.push(report);
    }
    let report = serde_json::json!({
        "model": model_name,
        "model_dir": dir,
        "sampling": settings.sampling,
        "n": settings.n,
        "limit": args.limit,
        "duration_s": started.elapsed().as_secs_f64(),
        "benchmarks": reports.iter().map(|r| (r.bench.clone(), serde_json::to_value(r).unwrap_or_default())).collect::<serde_json::Map<_, _>>(),
    });
    let mut out = crate::jsonl::AtomicFile::create(Some(&args.out.join("report.json")))?;
    out.write_all(serde_json::to_string_pretty(&report)?.as_bytes())?;
    out.commit()?;
    print!("{}", run::table(&reports));
    tracing::info!("wrote {} and {}", gen_path.display(), args.out.join("report.json").display());
    Ok(())
}
