//! `grpo eval`: generate answers on math benchmarks and score them (avg@n, pass@k, maj@n).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;

use crate::eval::engine::{Engine, Native, OpenAi};
use crate::eval::{benchmarks, run, EngineKind, EngineOptions, EvalOptions, ProblemResult};
use crate::jsonl::Lines;
use crate::model::{self, ChatTokenizer};

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
    /// Model folder or hub id (local Hugging Face cache). With --engine openai only its tokenizer and chat
    /// template are used (to render the prompts and count tokens): give the served model's.
    #[arg(long, required_unless_present = "list")]
    pub model: Option<String>,
    #[command(flatten)]
    pub options: EvalOptions,
    #[command(flatten)]
    pub engine: EngineOptions,
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

/// Results of an earlier run by (benchmark, problem id).
type Finished = HashMap<(String, String), ProblemResult>;

/// Open generations.jsonl for appending: emptied, or with `resume` keeping the readable results of an
/// earlier run (an interrupted run may have left a torn last line), which are returned by (bench, id).
fn open_generations(path: &std::path::Path, resume: bool) -> anyhow::Result<(Finished, std::fs::File)> {
    let previous = if resume { read_done(path)? } else { Vec::new() };
    let mut kept = crate::jsonl::AtomicFile::create(Some(path))?;
    for r in &previous {
        kept.write_json(r)?;
    }
    kept.commit()?;
    let done = previous.into_iter().map(|r| ((r.bench.clone(), r.id.clone()), r)).collect();
    let file =
        std::fs::OpenOptions::new().append(true).open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok((done, file))
}

/// Check the options, then load the selected benchmarks.
fn checked_benchmarks(args: &Args) -> anyhow::Result<Vec<benchmarks::Benchmark>> {
    args.options.validate("--").map_err(anyhow::Error::msg)?;
    args.engine.validate("--").map_err(anyhow::Error::msg)?;
    if args.engine.engine == EngineKind::Openai && args.engine.openai_fields_only && args.options.top_k > 0 {
        anyhow::bail!("--top-k = {} cannot be sent with --openai-fields-only (set --top-k 0)", args.options.top_k);
    }
    let mut selected = Vec::new();
    for name in &args.bench {
        selected.push(benchmarks::load(name)?);
    }
    if let (Some(f), Some(t)) = (&args.bench_file, &args.prompt_template) {
        selected.push(benchmarks::load_file(f, t)?);
    }
    Ok(selected)
}

/// Say, before generating, how much `b` can generate at most: problems x n x max_new_tokens.
fn state_budget(b: &benchmarks::Benchmark, options: &EvalOptions, done: &HashMap<String, ProblemResult>) {
    let selected = &b.problems[..options.problem_count(b.problems.len())];
    let todo = selected.iter().filter(|p| !done.contains_key(&p.id)).count();
    let resumed = if todo < selected.len() {
        format!(" ({} done in an earlier run)", selected.len() - todo)
    } else {
        String::new()
    };
    tracing::info!(
        "{}: {todo} problems{resumed} x {} samples x {} max new tokens = at most {} tokens to generate",
        b.name,
        options.n,
        options.max_new_tokens,
        todo as u64 * (options.n * options.max_new_tokens) as u64
    );
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.list {
        println!("{:<10} {:>8}  description", "name", "problems");
        for (name, count, about) in benchmarks::list() {
            println!("{name:<10} {count:>8}  {about}");
        }
        return Ok(());
    }
    let selected = checked_benchmarks(&args)?;
    let model_name = args.model.clone().unwrap_or_default();
    let dir = model::resolve_model_dir(&model_name)?;
    let tok = ChatTokenizer::load(&dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let decoder = match args.engine.engine {
        EngineKind::Native => {
            let device = model::parse_device(&args.device)?;
            let dtype = model::parse_dtype(&args.dtype)?;
            Some(
                model::load_decoder(&dir, dtype, &device, false)
                    .with_context(|| format!("loading {}", dir.display()))?,
            )
        }
        EngineKind::Openai => None,
    };
    let engine: Box<dyn Engine> = match &decoder {
        Some(model) => Box::new(Native { model, tok: &tok, batch_size: args.options.batch_size }),
        None => Box::new(OpenAi::new(&args.engine, &tok)?),
    };
    tracing::info!("engine: {}", engine.describe());
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let gen_path = args.out.join("generations.jsonl");
    let (done, mut gen_file) = open_generations(&gen_path, args.resume)?;
    let options = args.options.clone();
    let started = std::time::Instant::now();
    let mut reports = Vec::new();
    for b in &selected {
        let done_b: HashMap<String, ProblemResult> =
            done.iter().filter(|((bn, _), _)| bn == &b.name).map(|((_, id), r)| (id.clone(), r.clone())).collect();
        state_budget(b, &options, &done_b);
        let bar = crate::progress::progress_bar(Some(0), &b.name);
        let t0 = std::time::Instant::now();
        let (report, _) = run::evaluate_with(
            engine.as_ref(),
            &tok,
            b,
            &options,
            &done_b,
            |r| {
                serde_json::to_writer(&mut gen_file, r)
                    .map_err(std::io::Error::from)
                    .and_then(|()| gen_file.write_all(b"\n"))
                    .and_then(|()| gen_file.flush())
                    .map_err(|source| crate::eval::EvalError::Io { path: gen_path.clone(), source })
            },
            |p| p.show(&bar, t0),
        )?;
        bar.finish_and_clear();
        reports.push(report);
    }
    if reports.iter().all(|r| r.n_problems == 0) {
        anyhow::bail!("nothing was evaluated: no problem in the selected benchmarks");
    }
    let report = serde_json::json!({
        "model": model_name,
        "model_dir": dir,
        "engine": engine.describe(),
        "sampling": options.sampling(),
        "n": options.n,
        "limit": (options.limit > 0).then_some(options.limit),
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
