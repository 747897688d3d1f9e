//! `grpo plot`: draw the training curves of one or more run folders.

use std::path::PathBuf;

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Output folders of `grpo train` (their metrics.jsonl and validation/ records); several are drawn
    /// on one figure, one colour per run.
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// The PNG to write (default: RUN_DIR/curves.png for one run; required for several).
    #[arg(short, long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub curves: crate::plot::CurveOptions,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let out = match (&args.out, args.runs.as_slice()) {
        (Some(o), _) => o.clone(),
        (None, [one]) => one.join("curves.png"),
        (None, _) => anyhow::bail!("{} run folders: give the figure's file with -o FILE.png", args.runs.len()),
    };
    crate::plot::draw_curves(&args.runs, &out, &args.curves).with_context(|| format!("drawing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}
