//! `grpo train`: off-policy GRPO (and the baselines) on teacher trajectories.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;

use super::Exit;
use crate::model::ModelConfig;
use crate::train::config::ConfigError;
use crate::train::{train, Resume, RunOptions, TrainConfig, TrainError};

/// The exit status of a run stopped on request (Ctrl-C, SIGTERM or SIGHUP) after writing its checkpoint:
/// EX_TEMPFAIL, "try again later", so a scheduler or script can tell it from a failure (1) and requeue with
/// `--resume auto`.
pub const STOPPED_EXIT_CODE: i32 = 75;

/// The exit status after a second Ctrl-C / SIGTERM, which exits at once without a checkpoint.
pub const ABORTED_EXIT_CODE: i32 = 130;

/// The exit status when the run's memory plan does not fit the device (`--plan`, or the check a run makes
/// before loading weights).
pub const DOES_NOT_FIT_EXIT_CODE: u8 = 3;

#[derive(Debug, clap::Args)]
#[command(after_help = "Objectives (objective.name; each one's loss, options and defaults: docs/reference.md):
  off_grpo    off-policy GRPO on teacher answers (seed 000): the clipped ratio to the
              teacher, the group-relative advantage with the all-positive bias b, KL to
              a frozen reference (the default)
  grpo        GRPO on the model's own answers with [rollout] (on-policy; with
              rollout.lag, seed 002's lagged GRPO)
  gspo        GRPO with the sequence-level ratio (GSPO)
  rec         REC: REINFORCE with a clip mask (one-side, two-side or ring), with or
              without importance weights
  opmd        online policy mirror descent: REINFORCE plus a squared log-ratio term
  asymre      asymmetric REINFORCE: the baseline lowered by a shift
  red_drop    REINFORCE on a group with its excess negative answers dropped
  red_weight  REINFORCE with answers weighted by exp(A / T)
  oapl        OAPL (seed 003): a squared regression of the log-ratio to the soft advantage
  sft         supervised fine-tuning on the correct answers (or on all)
  cispo       CISPO: the clipped ratio as a stopped weight of every token's gradient

Every config key, the run's folder, resuming and the memory plan: docs/reference.md.

Exit status: 0 when the run is done (or, with --resume, was already complete; with --plan or \
--check, when the plan fits or the config is valid); 75 when it was stopped on request (Ctrl-C, SIGTERM or \
SIGHUP: the current step is finished and a checkpoint written; continue with --resume auto); 130 when a second \
signal aborted it without a checkpoint; 3 when the memory plan does not fit the device (--plan, or before a run \
loads its weights); 2 when the command line is refused (an unknown option, a bad value, a --set that no config \
key takes); 1 on any other error (including another run holding the output folder).")]
pub struct Args {
    /// The training configuration (TOML), e.g. configs/smoke.toml or configs/openthinker3.toml.
    #[arg(long)]
    pub config: PathBuf,
    /// Override a config value: --set objective.beta=0.05 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Continue a run: `auto` (the latest checkpoint in the output folder, if any) or a checkpoint folder.
    /// The checkpoint's model and tokenizer must be the run's, and its training config the same except for
    /// the run's length, saving, device and speed settings (README, `grpo train`).
    #[arg(long)]
    pub resume: Option<String>,
    /// Start a new run in an output folder that holds another run's checkpoints, deleting that run's
    /// checkpoints, best model, validation outputs, metrics and configs (the prepared data is kept).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Resume even though the training config differs from the checkpoint's (the changed keys are logged).
    #[arg(long, requires = "resume")]
    pub allow_config_change: bool,
    /// Resume on data other than the checkpoint's (another prepared version: edited inputs, other
    /// preparation options or data.prepared_dir): the checkpoint's epoch restarts at its first batch of the
    /// new data and the remaining epochs are the new data's; the step count and optimiser state go on.
    #[arg(long, requires = "resume")]
    pub allow_data_change: bool,
    /// Device, overriding `model.device`: cpu or cuda:N (needs a build with `--features cuda`).
    #[arg(long)]
    pub device: Option<crate::device::DeviceName>,
    /// The hub revision of model.path (a branch, tag or commit), overriding `model.revision`.
    #[arg(long)]
    pub revision: Option<String>,
    /// Weight dtype, overriding `model.dtype`: f32, bf16 or f16 (log-probs, loss and optimiser state
    /// stay f32).
    #[arg(long)]
    pub dtype: Option<crate::device::DTypeName>,
    /// Check the configuration and exit without loading anything.
    #[arg(long)]
    pub check: bool,
    /// Print the memory plan (each component's expected peak, on the device or in host memory, and the
    /// total against the device's memory) and exit without loading any weight.
    #[arg(long)]
    pub plan: bool,
    /// The device's memory for the plan (and the check a run makes before loading weights), e.g. 80GiB,
    /// 80GB, 512MiB. Default: the device's total (the machine's RAM for cpu).
    #[arg(long, value_name = "SIZE", value_parser = crate::cost::memory::parse_bytes)]
    pub device_memory: Option<u64>,
    /// With --plan: the model shape from this config.json instead of model.path's (no weights needed),
    /// e.g. configs/models/qwen2.5-7b-instruct.config.json.
    #[arg(long, requires = "plan", value_name = "FILE")]
    pub model_config: Option<PathBuf>,
    /// With --plan: the memory per rank of this many data-parallel ranks sharing the optimizer state
    /// (ZeRO-1), and the predicted communication. Default: the launcher's (WORLD_SIZE, SLURM_NTASKS,
    /// OMPI_COMM_WORLD_SIZE), else 1.
    #[arg(long, requires = "plan", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub world_size: Option<u64>,
}

/// `--plan`: the memory plan of `cfg`, on the model shape of `--model-config` or of the config's model.
fn print_plan(cfg: &TrainConfig, args: &Args) -> anyhow::Result<()> {
    let shape = match &args.model_config {
        Some(p) => ModelConfig::from_file(p).with_context(|| format!("reading {}", p.display()))?,
        None => crate::train::model_config(cfg).context("reading the model's config.json (or give --model-config)")?,
    };
    let memory = match args.device_memory {
        Some(m) => Some(m),
        None => match crate::model::open_device(cfg.model.device) {
            Ok(device) => crate::device::total_memory(&device)?,
            Err(e) => {
                tracing::warn!("device {}: {e}; give --device-memory", cfg.model.device);
                None
            }
        },
    };
    let world = match args.world_size {
        Some(n) => n,
        None => crate::dist::Launch::from_vars(|k| std::env::var(k).ok())
            .context("the launcher's environment (or give --world-size)")?
            .map_or(1, |l| l.size.max(1) as u64),
    };
    let p = cfg.memory_plan(&shape, memory, world);
    print!("{p}");
    let step = p.step_shape();
    let group = cfg.rollout.as_ref().map_or(cfg.data.input.group.group_size, |r| r.n);
    let answers = (cfg.train.batch_questions as u64).saturating_mul(group as u64);
    print!("{}", crate::cost::time::report(&shape, &step, answers, world));
    if let (Some(r), true) = (&cfg.rollout, world > 1) {
        print!("{}", split_report(cfg, r, &shape, &step, memory, world));
    }
    if p.fits() == Some(false) {
        println!("To fit, {}.", p.advice());
        let message = "the run does not fit its device's memory (the plan above)".to_string();
        return Err(Exit { code: DOES_NOT_FIT_EXIT_CODE, message }.into());
    }
    Ok(())
}

/// `--plan` of a run with rollouts on `world` GPUs: the predicted step for each number of generation ranks
/// (src/cost/split.rs), the trainers' share planned as a job of their own.
fn split_report(
    cfg: &TrainConfig,
    r: &crate::rollout::RolloutOptions,
    shape: &ModelConfig,
    step: &crate::cost::time::StepShape,
    memory: Option<u64>,
    world: u64,
) -> String {
    use crate::cost::split;
    let rollouts = split::Rollouts {
        answers: (cfg.train.batch_questions * r.sampled()) as u64,
        prompt_tokens: step.seq_tokens.saturating_sub(step.scored_tokens),
        max_new_tokens: r.max_new_tokens as u64,
        batch_size: r.batch_size as u64,
        dtype_bytes: step.dtype_bytes as f64,
    };
    let trainers = |t: u64| cfg.memory_plan(shape, memory, t).step_shape();
    crate::cost::calibration::gpus()
        .iter()
        .map(|gpu| split::report(&split::predict_splits(shape, &rollouts, world, trainers, gpu), gpu))
        .collect()
}

/// The error of a failed run, with the exit status of a plan that does not fit.
fn failed(e: TrainError) -> anyhow::Error {
    if e.interrupted().is_some() {
        let message = format!(
            "{e} (before the first step: no checkpoint); run the same command again to continue (exit status \
             {STOPPED_EXIT_CODE})"
        );
        return Exit { code: STOPPED_EXIT_CODE as u8, message }.into();
    }
    match e {
        TrainError::DoesNotFit { .. } => Exit { code: DOES_NOT_FIT_EXIT_CODE, message: e.to_string() }.into(),
        e => anyhow::Error::new(e).context("training failed"),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut overrides = args.overrides.clone();
    overrides.extend(args.device.iter().map(|d| format!("model.device={d}")));
    overrides.extend(args.dtype.iter().map(|d| format!("model.dtype={d}")));
    overrides.extend(args.revision.iter().map(|r| format!("model.revision={}", toml::Value::from(r.as_str()))));
    let cfg = TrainConfig::load(&args.config, &overrides).map_err(|e| match e {
        // A `--set` no key takes is a refused command line.
        ConfigError::BadOverride(_) | ConfigError::BadOverrideValue { .. } => super::usage_error("train", e),
        e => e.into(),
    })?;
    if args.check {
        print!("{}", cfg.to_toml());
        return Ok(());
    }
    if args.plan {
        return print_plan(&cfg, &args);
    }
    let resume = match args.resume.as_deref() {
        None => Resume::No,
        Some("auto") => Resume::Auto,
        Some(p) => Resume::From(PathBuf::from(p)),
    };
    let opts = RunOptions {
        resume,
        overwrite: args.overwrite,
        allow_config_change: args.allow_config_change,
        allow_data_change: args.allow_data_change,
        device_memory: args.device_memory,
    };
    let argv: Vec<String> = std::env::args().collect();
    let cwd = std::env::current_dir().map_or_else(|_| "?".into(), |d| d.display().to_string());
    tracing::info!("grpo {} in {cwd}: {} (config {})", super::version(), argv.join(" "), args.config.display());
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    // A first Ctrl-C or SIGTERM (or SIGHUP) asks for a checkpoint after the current step; a second one exits
    // at once.
    // The messages go to stderr unless it is closed (a `| tee` ended by the same Ctrl-C).
    let say = |m: &str| {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "{m}");
    };
    let handler = ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            say("interrupted twice: exiting without a checkpoint");
            std::process::exit(ABORTED_EXIT_CODE);
        }
        say("stop requested (a signal: Ctrl-C, SIGTERM or SIGHUP): finishing the current step, then writing a \
             checkpoint (a second signal exits at once, without one)");
    });
    if let Err(e) = handler {
        tracing::warn!("no Ctrl-C / SIGTERM handler ({e}): a stop signal will end the run without a checkpoint");
    }
    super::keep_running_on_closed_pipe();
    let out = train(&cfg, &opts, &stop).map_err(failed)?;
    if out.already_complete {
        let ck = out.checkpoint.as_ref().map_or(String::new(), |p| format!(" (checkpoint {})", p.display()));
        super::print_if_read(&format!(
            "{} is already complete at step {}{ck}: nothing to do. To train longer, raise train.max_steps or \
             train.epochs and resume again.\n",
            cfg.train.output_dir.display(),
            out.state.step
        ));
        return Ok(());
    }
    if let Some(summary) = &out.summary {
        super::print_if_read(&summary.to_string());
        if !out.interrupted {
            tracing::info!("{}", summary.last_line());
        }
    }
    if out.interrupted {
        // Said also with -q, and the log's last line.
        let line = match &out.summary {
            Some(summary) => summary.last_line(),
            None => format!("run stopped on request at step {}; continue with --resume auto", out.state.step),
        };
        say(&format!("{line} (exit status {STOPPED_EXIT_CODE})"));
        // `train` has returned: the output folder's lock is released and every file is closed.
        std::process::exit(STOPPED_EXIT_CODE);
    }
    Ok(())
}
