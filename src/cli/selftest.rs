//! `grpo selftest`: every fused kernel, one training step and one generation of a tiny model on a
//! device against the CPU reference ([`crate::selftest`]); prints the table and fails when a check fails.

use anyhow::Context;

use crate::device::device_name;
use crate::model::open_device;
use crate::selftest::{self, CheckResult};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Device to test: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: crate::device::DeviceName,
}

fn row(r: &CheckResult) -> String {
    let verdict = if r.passed { "pass" } else { "FAIL" };
    let mut line = format!(
        "{:<28} {:<5} {:>10.2e} {:>10.1e}  {verdict}  {:>7.2}",
        r.check, r.dtype, r.max_error, r.tolerance, r.seconds
    );
    if let Some(e) = &r.error {
        line.push_str(&format!("  ({e})"));
    }
    line
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let device = open_device(args.device).with_context(|| format!("--device {}", args.device))?;
    println!("selftest on {} ({}), against the composite ops on the CPU in f32", args.device, device_name(&device));
    println!("{:<28} {:<5} {:>10} {:>10}  {:<4}  {:>7}", "check", "dtype", "max error", "tolerance", "", "time s");
    let t0 = std::time::Instant::now();
    let rows = selftest::run(&device, |r| println!("{}", row(r)));
    let failed = rows.iter().filter(|r| !r.passed).count();
    println!("{} checks, {failed} failed, {:.1} s", rows.len(), t0.elapsed().as_secs_f64());
    if failed > 0 {
        anyhow::bail!("{failed} of {} self-test checks failed on {}", rows.len(), args.device);
    }
    Ok(())
}
