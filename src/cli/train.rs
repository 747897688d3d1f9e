//! `grpo train`: off-policy GRPO (and the baselines) on teacher trajectories.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;

use crate::train::{train, Resume, TrainConfig};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The training configuration (TOML), e.g. configs/smoke.toml or configs/openthinker3.toml.
    #[arg(long)]
    pub config: PathBuf,
    /// Override a config value: --set objective.beta=0.05 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Continue a run: `auto` (the latest checkpoint in the output folder, if any) or a checkpoint folder.
    #[arg(long)]
    pub resume: Option<String>,
    /// Device, overriding `model.device`: cpu or cuda:N (needs a build with `--features cuda`).
    #[arg(long)]
    pub device: Option<String>,
    /// Weight dtype, overriding `model.dtype`: f32, bf16 or f16 (log-probs, loss and optimiser state
    /// stay f32).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Check the configuration and exit without loading anything.
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut overrides = args.overrides.clone();
    overrides.extend(args.device.iter().map(|d| format!("model.device={d}")));
    overrides.extend(args.dtype.iter().map(|d| format!("model.dtype={d}")));
    let cfg = TrainConfig::load(&args.config, &overrides)?;
    if args.check {
        print!("{}", cfg.to_toml());
        return Ok(());
    }
    let resume = match args.resume.as_deref() {
        None => Resume::No,
        Some("auto") => Resume::Auto,
        Some(p) => Resume::From(PathBuf::from(p)),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    // A first Ctrl-C asks for a checkpoint after the current step; a second one exits at once.
    let _ = ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            eprintln!("interrupted twice: exiting without a checkpoint");
            std::process::exit(130);
        }
        eprintln!("interrupt: finishing the current step, then writing a checkpoint (Ctrl-C again to abort)");
    });
    let out = train(&cfg, resume, &stop).context("training failed")?;
    match &out.checkpoint {
        Some(p) => tracing::info!("step {}: checkpoint {}", out.state.step, p.display()),
        None => tracing::info!("step {}: nothing to save", out.state.step),
    }
    if out.interrupted {
        anyhow::bail!("interrupted at step {}; resume with --resume auto", out.state.step);
    }
    Ok(())
}
