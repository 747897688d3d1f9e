//! `grpo eval`: generate answers on math benchmarks and score them (avg@n, pass@k, maj@n).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;

use crate::dist::World;
use crate::eval::engine::{Engine, Native, OpenAi};
use crate::eval::{benchmarks, run, EngineKind, EngineOptions, EvalOptions, ProblemResult, Share, ShareResults};
use crate::jsonl::Lines;
use crate::model::{self, ChatTokenizer};

#[derive(Debug, clap::Args)]
#[command(after_help = super::METRICS_HELP)]
pub struct Args {
    /// Registered benchmarks, comma-separated (see --list).
    #[arg(long, value_delimiter = ',', required_unless_present_any = ["list", "bench_file"], value_parser = bench_arg)]
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
    /// The hub revision of --model (a branch, tag or commit; as `org/name@revision` writes it).
    #[arg(long, requires = "model")]
    pub revision: Option<String>,
    /// A LoRA adapter folder (PEFT's adapter_model.safetensors and adapter_config.json, e.g. a LoRA run's
    /// checkpoint) applied to --model, the base model (native engine).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Apply --adapter even though its adapter_config.json names another base model
    /// (base_model_name_or_path) than --model.
    #[arg(long, requires = "adapter")]
    pub allow_base_mismatch: bool,
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
    /// Replace the results of an earlier run in OUT (generations.jsonl, report.json); without it (or
    /// --resume) such an OUT is refused.
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Device of the native engine: cpu, cuda or cuda:N (needs a build with `--features cuda`; under a
    /// launcher each rank takes the GPU of its local rank).
    #[arg(long, default_value = "cpu")]
    pub device: crate::device::DeviceName,
    /// Weight dtype of the native engine: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: crate::device::DTypeName,
}

/// clap's check of a `--bench` name: a registered benchmark.
fn bench_arg(s: &str) -> Result<String, String> {
    let names = benchmarks::names();
    if names.contains(&s) {
        Ok(s.to_string())
    } else {
        Err(format!("unknown benchmark `{s}` (registered: {}; or give --bench-file)", names.join(", ")))
    }
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
/// The earlier results are also returned in file order.
fn open_generations(
    path: &std::path::Path,
    resume: bool,
) -> anyhow::Result<(Finished, std::fs::File, Vec<ProblemResult>)> {
    let previous = if resume { read_done(path)? } else { Vec::new() };
    let mut kept = crate::jsonl::AtomicFile::create(Some(path))?;
    for r in &previous {
        kept.write_json(r)?;
    }
    kept.commit()?;
    let done = previous.iter().map(|r| ((r.bench.clone(), r.id.clone()), r.clone())).collect();
    let file =
        std::fs::OpenOptions::new().append(true).open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok((done, file, previous))
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

/// The files of an earlier run's results in `out`.
const RESULT_FILES: [&str; 2] = ["generations.jsonl", "report.json"];

/// Refuse an OUT that holds the results of an earlier run, unless they are continued (`--resume`) or
/// replaced (`--overwrite`: the earlier report is removed at once, so that it never sits beside new
/// generations).
fn claim_out(args: &Args, world: &World) -> anyhow::Result<()> {
    let earlier: Vec<PathBuf> = RESULT_FILES
        .iter()
        .map(|f| args.out.join(f))
        .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.len() > 0))
        .collect();
    if earlier.is_empty() || args.resume {
        return Ok(());
    }
    if !args.overwrite {
        let names: Vec<&str> = RESULT_FILES.iter().copied().filter(|f| earlier.contains(&args.out.join(f))).collect();
        anyhow::bail!(
            "{} holds the results of an earlier run ({}): continue it with --resume, replace them with \
             --overwrite, or choose another --out",
            args.out.display(),
            names.join(", ")
        );
    }
    if world.is_primary() {
        tracing::warn!("--overwrite: replacing the earlier results in {}", args.out.display());
        let report = args.out.join("report.json");
        if report.exists() {
            std::fs::remove_file(&report).with_context(|| format!("removing {}", report.display()))?;
        }
    }
    Ok(())
}

/// Rank 0 takes OUT's lock (OUT/.lock, created with OUT), or fails naming the process that holds it.
fn lock_out(out: &std::path::Path, world: &World) -> anyhow::Result<Option<crate::fsio::FolderLock>> {
    if !world.is_primary() {
        return Ok(None);
    }
    match crate::fsio::lock_folder(out) {
        Ok(lock) => Ok(Some(lock)),
        Err(crate::fsio::LockError::Busy { dir, holder }) => anyhow::bail!(
            "{} is in use by another grpo process ({holder}); wait for it to end, or choose another --out",
            dir.display()
        ),
        Err(e) => Err(e).context("--out"),
    }
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
        "{}: {}{resumed} x {} x {} max new tokens = at most {} tokens to generate",
        b.name,
        crate::progress::count(todo as u64, "problem"),
        crate::progress::count(options.n as u64, "sample"),
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
    let gpu = args.engine.engine == EngineKind::Native && args.device.is_cuda();
    let world = World::from_env(gpu)?;
    let result = run_in(args, &world);
    if let Err(e) = &result {
        world.abort_on_error(&format!("{e:#}"));
    }
    result
}

/// The engine `args` select: the native sampler on `decoder`, or the OpenAI-compatible server.
fn engine<'a>(
    args: &'a Args,
    decoder: Option<&'a model::Decoder>,
    tok: &'a ChatTokenizer,
) -> anyhow::Result<Box<dyn Engine + 'a>> {
    Ok(match decoder {
        Some(model) => {
            Box::new(Native { model, tok, batch_size: args.options.batch_size, generation: &args.options.generation })
        }
        None => Box::new(OpenAi::new(&args.engine, tok)?),
    })
}

/// Evaluate as rank `world.rank()` of `world.size()`: each rank generates its share of every benchmark's
/// problems (problem i on rank i mod N, a native engine on the GPU of its local rank); the shares are
/// gathered after each benchmark, and rank 0 writes generations.jsonl and report.json as one process would.
/// With several servers in --base-url, rank r sends its requests to the (r mod k)-th.
fn run_in(mut args: Args, world: &World) -> anyhow::Result<()> {
    args.engine = args.engine.for_rank(world.rank());
    let selected = checked_benchmarks(&args)?;
    // Held until the report is written: one evaluation at a time in OUT, as one training run in its folder.
    let _lock = lock_out(&args.out, world)?;
    claim_out(&args, world)?;
    let model_name =
        model::load::with_revision(args.model.as_deref().unwrap_or_default(), args.revision.as_deref(), "--revision")?;
    let dir = model::resolve_model_dir(&model_name)?;
    let tok = ChatTokenizer::load(&dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let decoder = native_decoder(&args, &dir, world)?;
    let engine = engine(&args, decoder.as_ref(), &tok)?;
    if world.is_primary() {
        tracing::info!("engine: {}", engine.describe());
    }
    let gen_path = args.out.join("generations.jsonl");
    let mut gens = Generations::open(&args.out, args.resume, world)?;
    let options = args.options.clone();
    let started = std::time::Instant::now();
    let share = Share { index: world.rank(), of: world.size() };
    let mut reports = Vec::new();
    for b in &selected {
        reports.push(evaluate_benchmark(b, (engine.as_ref(), &tok), &options, &mut gens, world, share)?);
    }
    if reports.iter().all(|r| r.n_problems == 0) {
        anyhow::bail!("nothing was evaluated: no problem in the selected benchmarks");
    }
    if !world.is_primary() {
        return Ok(());
    }
    let report = EvalReport {
        model: model_name,
        model_dir: dir,
        engine: engine.describe(),
        sampling: options.sampling(),
        n: options.n,
        limit: (options.limit > 0).then_some(options.limit),
        duration_s: started.elapsed().as_secs_f64(),
        benchmarks: reports.iter().map(|r| (r.bench.clone(), r.clone())).collect(),
    };
    write_report(&args.out.join("report.json"), &report)?;
    print!("{}", run::table(&reports));
    tracing::info!("wrote {} and {}", gen_path.display(), args.out.join("report.json").display());
    Ok(())
}

/// The native engine's model (with `--adapter` applied), on this rank's device; none for a server.
fn native_decoder(args: &Args, dir: &std::path::Path, world: &World) -> anyhow::Result<Option<model::Decoder>> {
    match args.engine.engine {
        EngineKind::Native => {
            let device = model::open_device(world.rank_device(args.device)?)?;
            let dtype = args.dtype.dtype();
            if let Some(adapter) = args.adapter.as_deref().filter(|_| !args.allow_base_mismatch) {
                let given = args.model.as_deref().unwrap_or_default();
                model::load::check_base(adapter, given, dir, "--allow-base-mismatch")?;
            }
            let decoder = model::load::load_frozen(dir, args.adapter.as_deref(), dtype, &device)
                .with_context(|| format!("loading {}", dir.display()))?;
            Ok(Some(decoder))
        }
        EngineKind::Openai if args.adapter.is_some() => {
            anyhow::bail!("--adapter is applied by the native engine; serve the adapter with the server instead")
        }
        EngineKind::Openai => Ok(None),
    }
}

/// Benchmark `b` on this rank's share of its problems (those not already in generations.jsonl), with a
/// progress bar on rank 0 and, once the first problems are done and generation goes on (or after 10 s of
/// generating), what the rest of the budget costs at that speed; the ranks' shares gathered into its report.
fn evaluate_benchmark(
    b: &benchmarks::Benchmark,
    (engine, tok): (&dyn Engine, &ChatTokenizer),
    options: &EvalOptions,
    gens: &mut Generations,
    world: &World,
    share: Share,
) -> anyhow::Result<run::BenchReport> {
    let done_b: HashMap<String, ProblemResult> =
        gens.done.iter().filter(|((bn, _), _)| bn == &b.name).map(|((_, id), r)| (id.clone(), r.clone())).collect();
    if world.is_primary() {
        state_budget(b, options, &done_b);
    }
    let bar = crate::progress::progress_bar(Some(0), &b.name);
    if !world.is_primary() {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let t0 = std::time::Instant::now();
    let mut estimated = !world.is_primary();
    let part = run::evaluate_share(
        engine,
        tok,
        b,
        options,
        &done_b,
        share,
        |r| gens.append(r),
        |p| {
            p.show(&bar, t0);
            // Once generation goes on after the first problems finished (or after 10 s of it): a batch of
            // problems generated at once has then been counted whole, and some budget is left to estimate.
            let due = p.problems_done > 0 || (p.tokens > 0 && t0.elapsed().as_secs() >= 10);
            if !estimated && p.generating && due {
                estimated = true;
                tracing::info!("{}: {}", b.name, p.estimate(t0.elapsed().as_secs_f64()));
            }
        },
    )?;
    bar.finish_and_clear();
    let parts = gather_shares(world, &part)?;
    let (report, results) = run::merge_shares(b, options, parts, t0.elapsed().as_secs_f64());
    // Problems were appended as they finished (in any order, on any rank): the file is rewritten with
    // the benchmark's results in problem order.
    gens.settle(&b.name, results)?;
    Ok(report)
}

/// report.json, written atomically.
fn write_report(path: &std::path::Path, report: &EvalReport) -> anyhow::Result<()> {
    let mut out = crate::jsonl::AtomicFile::create(Some(path))?;
    out.write_all(serde_json::to_string_pretty(report)?.as_bytes())?;
    out.commit()?;
    Ok(())
}

/// report.json.
#[derive(serde::Serialize)]
struct EvalReport {
    model: String,
    model_dir: PathBuf,
    engine: String,
    sampling: crate::eval::SamplingParams,
    n: usize,
    limit: Option<usize>,
    duration_s: f64,
    benchmarks: std::collections::BTreeMap<String, run::BenchReport>,
}

/// Every rank's share of a benchmark, in rank order, on every rank (serialised for the all-gather).
fn gather_shares(world: &World, part: &ShareResults) -> anyhow::Result<Vec<ShareResults>> {
    if world.size() == 1 {
        return Ok(vec![part.clone()]);
    }
    let bytes = serde_json::to_vec(part)?;
    world
        .all_gather_bytes(&bytes)
        .iter()
        .enumerate()
        .map(|(rank, b)| serde_json::from_slice(b).with_context(|| format!("reading the results of rank {rank}")))
        .collect()
}

/// OUT/generations.jsonl, which rank 0 alone writes: each of its problems appended as it finishes (so an
/// interrupted run keeps them), and with several ranks rewritten in benchmark order once a benchmark's
/// shares are gathered, so that the file is the one a single process writes.
struct Generations {
    path: PathBuf,
    /// The earlier run's results by (bench, id) (with `--resume`; every rank reads them).
    done: Finished,
    /// Rank 0's file, open for appending.
    file: Option<std::fs::File>,
    /// What the file holds once the finished benchmarks are settled, in order.
    settled: Vec<ProblemResult>,
}

impl Generations {
    fn open(out: &std::path::Path, resume: bool, world: &World) -> anyhow::Result<Self> {
        let path = out.join("generations.jsonl");
        if !world.is_primary() {
            let done = if resume { read_done(&path)? } else { Vec::new() };
            let done = done.into_iter().map(|r| ((r.bench.clone(), r.id.clone()), r)).collect();
            return Ok(Self { path, done, file: None, settled: Vec::new() });
        }
        crate::fsio::create_folder(out).with_context(|| format!("creating {}", out.display()))?;
        let (done, file, previous) = open_generations(&path, resume)?;
        Ok(Self { path, done, file: Some(file), settled: previous })
    }

    /// Append `r` (rank 0; the others write nothing).
    fn append(&mut self, r: &ProblemResult) -> Result<(), crate::eval::EvalError> {
        let Some(file) = &mut self.file else { return Ok(()) };
        serde_json::to_writer(&mut *file, r)
            .map_err(std::io::Error::from)
            .and_then(|()| {
                file.write_all(
                    b"
",
                )
            })
            .and_then(|()| file.flush())
            .map_err(|source| crate::eval::EvalError::Io { path: self.path.clone(), source })
    }

    /// Rewrite the file as the settled results (an earlier run's beyond this one's problems kept) and
    /// then `results`, all of benchmark `bench`'s this run covers (resumed ones included) in its order.
    fn settle(&mut self, bench: &str, results: Vec<ProblemResult>) -> anyhow::Result<()> {
        let ids: std::collections::HashSet<&str> = results.iter().map(|r| r.id.as_str()).collect();
        self.settled.retain(|r| r.bench != bench || !ids.contains(r.id.as_str()));
        self.settled.extend(results);
        if self.file.is_none() {
            return Ok(());
        }
        let mut out = crate::jsonl::AtomicFile::create(Some(&self.path))?;
        for r in &self.settled {
            out.write_json(r)?;
        }
        out.commit()?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        self.file = Some(file);
        Ok(())
    }
}
