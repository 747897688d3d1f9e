//! `train.profile_steps`: the listed steps profiled phase by phase ([`crate::profile`]), each one's
//! table in the log and its record a line of OUTPUT/profile.jsonl.

use std::io::Write;
use std::path::Path;

use candle_core::Device;

use super::config::TrainSection;
use super::TrainError;
use crate::profile::{Profile, ProfileReport, Profiler};

/// The file of a run's profiles, in its output folder.
pub const PROFILE_FILE: &str = "profile.jsonl";

/// A line of profile.jsonl: the step (as in metrics.jsonl) and its profile.
#[derive(Debug, serde::Serialize)]
struct ProfileLine<'a> {
    step: usize,
    #[serde(flatten)]
    profile: &'a ProfileReport,
}

/// A profiler for step `step` (numbered from 1) when `train.profile_steps` lists it and this rank writes
/// the run's files.
pub(super) fn start(train: &TrainSection, step: usize, device: &Device, primary: bool) -> Option<Profiler> {
    (primary && train.profile_steps.contains(&step)).then(|| Profiler::start(device).ok()).flatten()
}

/// Log step `step`'s profile as a table and append its line to profile.jsonl in `out`.
pub(super) fn record(out: &Path, step: usize, profile: &Profile) -> Result<(), TrainError> {
    let report = profile.report();
    tracing::info!("profile of step {step}:\n{}", report.table());
    let path = out.join(PROFILE_FILE);
    let line = serde_json::to_string(&ProfileLine { step, profile: &report })
        .map_err(std::io::Error::other)
        .map_err(super::io(&path))?;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(super::io(&path))?;
    writeln!(f, "{line}").map_err(super::io(&path))
}
