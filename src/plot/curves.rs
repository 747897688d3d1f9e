//! Training curves: the metrics a run writes (`metrics.jsonl`, one line per step) and its validation
//! records (`validation/step-NNNNNNNN-BENCH.jsonl`, one scored problem per line) drawn against the step,
//! one panel per metric, one colour per run folder, so that the arms of an experiment can be compared
//! on one figure. [`CurveOptions`] chooses the panels and adds per-step metrics files written beside the
//! trainer's (a held-out measure computed from the run's checkpoints, say).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Errors of reading run folders and drawing their curves.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}: no metrics.jsonl and no validation records: not the output folder of a training run")]
    NotARun(PathBuf),
    #[error("{0}: no such run folder")]
    Missing(PathBuf),
    #[error("no run folder to plot")]
    NoRuns,
    #[error("drawing {path}: {message}")]
    Draw { path: PathBuf, message: String },
}

/// The panels drawn by default: (key in metrics.jsonl, title).
const METRIC_PANELS: [(&str, &str); 8] = [
    ("loss", "loss"),
    ("reward", "reward (mean over answers)"),
    ("kl", "KL to the reference"),
    ("clip_ratio", "clip ratio"),
    ("entropy", "entropy (per token)"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("tokens_per_sec", "tokens / s"),
    ("learning_rate", "learning rate"),
];

/// Panels drawn by default only where some run has their metric: the overlap of generation and training
/// (rollout.generation_ranks, or a server with rollout.max_staleness).
const OVERLAP_PANELS: [(&str, &str); 2] = [
    ("rollout/trainer_idle", "trainer idle, waiting for answers (s)"),
    ("rollout/staleness_mean", "answers' staleness (updates behind)"),
];

/// The key of the trainer's validation score in metrics.jsonl (used when there are no validation records).
const VALIDATION_KEY: &str = "validation/score";

/// Figure size: three panels a row, as many rows as the panels need, under a legend strip.
const PANEL: (u32, u32) = (500, 400);
const COLUMNS: u32 = 3;
const LEGEND_HEIGHT: u32 = 60;

/// The size of the figure [`draw_curves`] writes with `metric_panels` metric panels (and the validation's).
fn figure_size(metric_panels: usize) -> (u32, u32) {
    let rows = (metric_panels as u32 + 1).div_ceil(COLUMNS);
    (COLUMNS * PANEL.0, LEGEND_HEIGHT + rows * PANEL.1)
}

/// What `grpo plot` draws: the flags of `grpo plot`.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub struct CurveOptions {
    /// The metric panels, in order: keys of the per-step metrics files (default: loss, reward, kl,
    /// clip_ratio, entropy, grad_norm, tokens_per_sec, learning_rate). The validation panel comes last.
    #[arg(long, value_delimiter = ',')]
    pub panels: Vec<String>,
    /// More per-step metrics files in each run folder, read beside metrics.jsonl: JSONL with a `step`
    /// and numeric values (a run folder without one is drawn without them).
    #[arg(long = "metrics-file")]
    pub metrics_files: Vec<String>,
}

impl CurveOptions {
    /// The metric panels: (key, title).
    fn panels(&self) -> Vec<(String, String)> {
        if self.panels.is_empty() {
            let all = METRIC_PANELS.iter().chain(&OVERLAP_PANELS);
            return all.map(|(k, t)| (k.to_string(), t.to_string())).collect();
        }
        let known = |k: &str| METRIC_PANELS.iter().chain(&OVERLAP_PANELS).find(|p| p.0 == k).map(|p| p.1);
        self.panels.iter().map(|k| (k.clone(), known(k).unwrap_or(k).to_string())).collect()
    }

    /// The panels to draw of `runs`: those asked for, or the default ones less the overlap panels that no
    /// run has values for.
    fn panels_of(&self, runs: &[RunCurves]) -> Vec<(String, String)> {
        let optional = |k: &str| self.panels.is_empty() && OVERLAP_PANELS.iter().any(|p| p.0 == k);
        let shown = |k: &str| !optional(k) || runs.iter().any(|r| r.metrics.contains_key(k));
        self.panels().into_iter().filter(|(k, _)| shown(k)).collect()
    }
}

/// One colour per run (the first ten of matplotlib's tab10, then plotters' palette).
const COLOURS: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

fn colour(i: usize) -> RGBColor {
    COLOURS.get(i).copied().unwrap_or_else(|| {
        let (r, g, b) = Palette99::pick(i).to_rgba().rgb();
        RGBColor(r, g, b)
    })
}

/// (step, value) points.
type Series = Vec<(f64, f64)>;

/// What one run folder holds.
#[derive(Debug, Default)]
struct RunCurves {
    name: String,
    /// By metrics key: the finite values, by step.
    metrics: BTreeMap<String, Series>,
    /// By benchmark: the validation avg@n, by step.
    validation: BTreeMap<String, Series>,
}

/// Read the values of `keys` from the per-step metrics file `dir/file` (lines that do not parse, such as
/// a torn last line, are skipped); false when there is no such file.
fn read_metrics(dir: &Path, file: &str, keys: &[&str], run: &mut RunCurves) -> Result<bool, PlotError> {
    let path = dir.join(file);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(source) => return Err(PlotError::Io { path, source }),
    };
    for (number, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            tracing::warn!("{}:{}: not a metrics line; skipped", path.display(), number + 1);
            continue;
        };
        let Some(step) = v.get("step").and_then(|s| s.as_f64()) else { continue };
        for &key in keys {
            if let Some(x) = v.get(key).and_then(|x| x.as_f64()).filter(|x| x.is_finite()) {
                run.metrics.entry(key.to_string()).or_default().push((step, x));
            }
        }
    }
    Ok(true)
}

/// The avg@n of one validation record file (mean over problems of the fraction of correct samples).
fn validation_score(path: &Path) -> Result<Option<f64>, PlotError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlotError::Io { path: path.into(), source })?;
    let per_problem: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|p| {
            let samples = p.get("samples")?.as_array()?;
            let correct = samples.iter().filter(|s| s.get("correct").and_then(|c| c.as_bool()) == Some(true)).count();
            (!samples.is_empty()).then(|| correct as f64 / samples.len() as f64)
        })
        .collect();
    Ok((!per_problem.is_empty()).then(|| per_problem.iter().sum::<f64>() / per_problem.len() as f64))
}

/// Read `dir/validation/step-NNNNNNNN-BENCH.jsonl` (the trainer's validation records).
fn read_validation(dir: &Path, run: &mut RunCurves) -> Result<(), PlotError> {
    let vdir = dir.join("validation");
    let entries = match std::fs::read_dir(&vdir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(PlotError::Io { path: vdir, source }),
    };
    for entry in entries {
        let path = entry.map_err(|source| PlotError::Io { path: vdir.clone(), source })?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        let Some((step, bench)) =
            name.strip_prefix("step-").and_then(|r| r.strip_suffix(".jsonl")).and_then(|r| r.split_once('-'))
        else {
            continue;
        };
        let Ok(step) = step.parse::<f64>() else { continue };
        if let Some(score) = validation_score(&path)? {
            run.validation.entry(bench.to_string()).or_default().push((step, score));
        }
    }
    Ok(())
}

/// Everything plotted of one run folder, named `name`.
fn read_run(dir: &Path, name: String, options: &CurveOptions) -> Result<RunCurves, PlotError> {
    if !dir.is_dir() {
        return Err(PlotError::Missing(dir.to_path_buf()));
    }
    let mut run = RunCurves { name, ..Default::default() };
    let panels = options.panels();
    let keys: Vec<&str> = panels.iter().map(|p| p.0.as_str()).chain([VALIDATION_KEY]).collect();
    let mut has_metrics = read_metrics(dir, "metrics.jsonl", &keys, &mut run)?;
    for file in &options.metrics_files {
        has_metrics |= read_metrics(dir, file, &keys, &mut run)?;
    }
    read_validation(dir, &mut run)?;
    if !has_metrics && run.validation.is_empty() {
        return Err(PlotError::NotARun(dir.to_path_buf()));
    }
    if run.validation.is_empty() {
        if let Some(s) = run.metrics.remove(VALIDATION_KEY) {
            run.validation.insert("validation".into(), s);
        }
    }
    for s in run.metrics.values_mut().chain(run.validation.values_mut()) {
        s.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(run)
}

/// Names for the runs in the legend: the folder names, or the paths as given when two folder names agree.
fn run_names(dirs: &[PathBuf]) -> Vec<String> {
    let short: Vec<String> = dirs
        .iter()
        .map(|d| d.file_name().map_or_else(|| d.display().to_string(), |n| n.to_string_lossy().into_owned()))
        .collect();
    let mut unique = short.clone();
    unique.sort();
    unique.dedup();
    if unique.len() == short.len() {
        short
    } else {
        dirs.iter().map(|d| d.display().to_string()).collect()
    }
}

/// A tick label on an axis spanning `span`: enough digits to tell ticks a fifth of the span apart,
/// scientific for very small or large magnitudes (learning rates).
fn tick(v: f64, span: f64) -> String {
    let step = (span / 5.0).abs().max(f64::MIN_POSITIVE);
    let a = v.abs();
    // A tick computed as 0 plus rounding error (-1.7e-21 on a range around 0) is 0.
    if a <= step * 1e-6 {
        "0".into()
    } else if !(1e-2..1e5).contains(&a) {
        let digits = (a.log10() - step.log10()).ceil().clamp(1.0, 6.0) as usize;
        format!("{v:.digits$e}")
    } else {
        let decimals = (-step.log10()).ceil().clamp(0.0, 6.0) as usize;
        format!("{v:.decimals$}")
    }
}

/// The range of `values` with a margin. A flat series (all values within 1e-4 of their magnitude: noise in
/// the fifth digit, not a trend) gets a range of 10% of its value around it, and an all-zero one [-1, 1],
/// so that a constant reads as a constant instead of being zoomed into its last digits.
fn padded_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let magnitude = lo.abs().max(hi.abs());
    if hi - lo > 1e-4 * magnitude {
        let pad = 0.05 * (hi - lo);
        return (lo - pad, hi + pad);
    }
    let mid = 0.5 * (lo + hi);
    let pad = if mid != 0.0 { 0.1 * mid.abs() } else { 1.0 };
    (mid - pad, mid + pad)
}

/// The steps' range with a margin, so that a point at the first or last step (a single validation, the
/// last step's) is drawn inside the panel, not on its edge.
fn step_range(steps: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = steps.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = (0.03 * (hi - lo)).max(0.5);
    (lo - pad, hi + pad)
}

/// An x tick label: whole steps only (a tick between two steps gets none).
fn step_tick(v: f64) -> String {
    let r = v.round();
    if (v - r).abs() < 1e-6 {
        // + 0.0 turns -0 into 0.
        format!("{:.0}", r + 0.0)
    } else {
        String::new()
    }
}

/// One panel: the series of each run (`(run index, points)`), or a note when no run has any.
fn draw_panel(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    title: &str,
    missing: &str,
    series: &[(usize, &Series)],
    steps: (f64, f64),
    fixed: Option<(f64, f64)>,
) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    if series.iter().all(|(_, s)| s.is_empty()) {
        let area = area.titled(title, ("sans-serif", 18)).map_err(|x| e(&x))?;
        let (w, h) = area.dim_in_pixel();
        let style =
            ("sans-serif", 15).into_font().color(&RGBColor(0x70, 0x70, 0x70)).pos(Pos::new(HPos::Center, VPos::Center));
        area.draw(&Text::new(missing.to_string(), (w as i32 / 2, h as i32 / 2 - 20), style)).map_err(|x| e(&x))?;
        return Ok(());
    }
    let (y0, y1) = fixed.unwrap_or_else(|| padded_range(series.iter().flat_map(|(_, s)| s.iter().map(|p| p.1))));
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(65)
        .build_cartesian_2d(steps.0..steps.1, y0..y1)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_labels(6)
        .y_labels(6)
        .x_label_formatter(&|v| step_tick(*v))
        .y_label_formatter(&|v| tick(*v, y1 - y0))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|x| e(&x))?;
    for (run, points) in series {
        let c = colour(*run);
        chart.draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2))).map_err(|x| e(&x))?;
        // Markers where points are few, larger for a lone point or two (which have no line to show them).
        if points.len() <= 60 {
            let size = if points.len() <= 2 { 5 } else { 3 };
            chart.draw_series(points.iter().map(|&p| Circle::new(p, size, c.filled()))).map_err(|x| e(&x))?;
        }
    }
    Ok(())
}

/// The legend strip: one colour per run.
fn draw_legend(area: &DrawingArea<BitMapBackend<'_>, Shift>, runs: &[RunCurves]) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let style = ("sans-serif", 17).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
    let (mut x, y) = (20, LEGEND_HEIGHT as i32 / 2);
    for (i, run) in runs.iter().enumerate() {
        let c = colour(i);
        area.draw(&PathElement::new(vec![(x, y), (x + 30, y)], c.stroke_width(4))).map_err(|x| e(&x))?;
        area.draw(&Text::new(run.name.clone(), (x + 38, y), style.clone())).map_err(|x| e(&x))?;
        let (w, _) = area.estimate_text_size(&run.name, &style).map_err(|x| e(&x))?;
        x += 38 + w as i32 + 30;
    }
    Ok(())
}

/// Draw the runs' curves into `area`: the metric `panels` (key, title), then the validation.
fn draw_figure(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    runs: &[RunCurves],
    panels: &[(String, String)],
) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (legend, grid) = root.split_vertically(LEGEND_HEIGHT);
    draw_legend(&legend, runs)?;
    let areas = grid.split_evenly(((panels.len() + 1).div_ceil(COLUMNS as usize), COLUMNS as usize));
    let all_steps =
        runs.iter().flat_map(|r| r.metrics.values().chain(r.validation.values())).flat_map(|s| s.iter().map(|p| p.0));
    let steps = step_range(all_steps);
    for (area, (key, title)) in areas.iter().zip(panels) {
        let series: Vec<(usize, &Series)> =
            runs.iter().enumerate().filter_map(|(i, r)| r.metrics.get(key).map(|s| (i, s))).collect();
        draw_panel(area, title, &format!("no `{key}` in the metrics"), &series, steps, None)?;
    }
    let series: Vec<(usize, &Series)> =
        runs.iter().enumerate().flat_map(|(i, r)| r.validation.values().map(move |s| (i, s))).collect();
    let benches: Vec<&str> = {
        let mut b: Vec<&str> = runs.iter().flat_map(|r| r.validation.keys().map(String::as_str)).collect();
        b.sort();
        b.dedup();
        b
    };
    let title = if benches.is_empty() {
        "validation avg@n".to_string()
    } else {
        format!("validation avg@n ({})", benches.join(", "))
    };
    draw_panel(&areas[panels.len()], &title, "no validation records", &series, steps, Some((-0.05, 1.05)))?;
    root.present().map_err(|x| e(&x))
}

/// Draw the curves of the run folders `dirs` on one figure, written as a PNG to `out`, three panels a
/// row: by default loss, reward, KL, clip ratio, entropy, gradient norm, tokens/s, learning rate, then
/// validation avg@n, against the step. A panel whose metric no run has says so.
pub fn draw_curves(dirs: &[PathBuf], out: &Path, options: &CurveOptions) -> Result<(), PlotError> {
    if dirs.is_empty() {
        return Err(PlotError::NoRuns);
    }
    let runs: Vec<RunCurves> =
        dirs.iter().zip(run_names(dirs)).map(|(d, name)| read_run(d, name, options)).collect::<Result<_, _>>()?;
    let panels = options.panels_of(&runs);
    let draw = |message: String| PlotError::Draw { path: out.to_path_buf(), message };
    super::register_font().map_err(draw)?;
    // Drawn to a temporary file in the same folder, then renamed: a reader never sees half a PNG.
    let folder = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = tempfile::Builder::new()
        .prefix(".curves")
        .suffix(".png")
        .tempfile_in(folder)
        .map_err(|source| PlotError::Io { path: folder.to_path_buf(), source })?;
    {
        let root = BitMapBackend::new(tmp.path(), figure_size(panels.len())).into_drawing_area();
        draw_figure(&root, &runs, &panels).map_err(draw)?;
    }
    // persist gives it a new file's mode under the umask (a temporary file is owner-only).
    crate::fsio::persist(tmp, out).map_err(|source| PlotError::Io { path: out.to_path_buf(), source })?;
    Ok(())
}

/// Draw `dir/curves.png` from the run folder `dir` (what `grpo train` does at each validation and at
/// its end).
pub fn draw_run_curves(dir: &Path) -> Result<PathBuf, PlotError> {
    let out = dir.join("curves.png");
    draw_curves(&[dir.to_path_buf()], &out, &CurveOptions::default())?;
    Ok(out)
}

/// Redraw `dir/curves.png` for a running trainer: a failure is logged as a warning, never fatal to the run.
pub fn refresh_run_curves(dir: &Path) {
    match draw_run_curves(dir) {
        Ok(p) => tracing::debug!("drew {}", p.display()),
        Err(e) => tracing::warn!("could not draw the training curves: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Width and height of a PNG, after checking its signature and header chunk.
    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        (be(&bytes[16..20]), be(&bytes[20..24]))
    }

    fn metrics_line(step: usize, loss: f64) -> String {
        format!(
            r#"{{"step":{step},"epoch":0.5,"loss":{loss},"pg_loss":0.1,"kl":0.01,"grad_norm":1.5,"learning_rate":1e-6,"reward":0.5,"clip_ratio":0.02,"entropy":1.2,"tokens_per_sec":300.0,"skipped":false}}"#
        )
    }

    #[test]
    fn a_small_run_is_drawn_as_a_png_of_the_figure_size() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("arm-a");
        std::fs::create_dir_all(run.join("validation")).unwrap();
        let mut lines: Vec<String> = (1..=6).map(|s| metrics_line(s, 1.0 / s as f64)).collect();
        lines.push(r#"{"step":7,"loss":"#.into()); // a torn last line
        std::fs::write(run.join("metrics.jsonl"), lines.join("\n")).unwrap();
        let problem = |c: bool| format!(r#"{{"id":"1","samples":[{{"correct":{c}}},{{"correct":false}}]}}"#);
        std::fs::write(run.join("validation/step-00000003-aime24.jsonl"), problem(true) + "\n" + &problem(false))
            .unwrap();
        std::fs::write(run.join("validation/step-00000006-aime24.jsonl"), problem(true)).unwrap();
        let out = draw_run_curves(&run).unwrap();
        assert_eq!(out, run.join("curves.png"));
        assert_eq!(png_size(&std::fs::read(&out).unwrap()), figure_size(8));
        assert_eq!(figure_size(8), (1500, 1260));
        let read = read_run(&run, "a".into(), &CurveOptions::default()).unwrap();
        assert_eq!(read.metrics["loss"].len(), 6);
        assert_eq!(read.validation["aime24"], vec![(3.0, 0.25), (6.0, 0.5)]);
        assert!(!read.metrics.contains_key("max_memory_allocated_gb"));
    }

    /// The overlap panels join the default figure only when a run has their metrics.
    #[test]
    fn the_overlap_panels_are_drawn_for_runs_that_overlap() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("k1");
        std::fs::create_dir_all(&run).unwrap();
        let overlap = |s: usize| {
            metrics_line(s, 1.0).replace("}", r#","rollout/trainer_idle":0.25,"rollout/staleness_mean":1.0}"#)
        };
        let lines: Vec<String> = (1..=4).map(overlap).collect();
        std::fs::write(run.join("metrics.jsonl"), lines.join("\n")).unwrap();
        let out = draw_run_curves(&run).unwrap();
        assert_eq!(png_size(&std::fs::read(&out).unwrap()), figure_size(10));
        let read = read_run(&run, "k1".into(), &CurveOptions::default()).unwrap();
        let panels = CurveOptions::default().panels_of(std::slice::from_ref(&read));
        assert_eq!(panels.len(), 10);
        assert_eq!(panels[8].0, "rollout/trainer_idle");
        let plain = dir.path().join("plain");
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::write(plain.join("metrics.jsonl"), metrics_line(1, 1.0)).unwrap();
        let read = read_run(&plain, "plain".into(), &CurveOptions::default()).unwrap();
        assert_eq!(CurveOptions::default().panels_of(&[read]).len(), 8);
    }

    #[test]
    fn absent_metrics_and_validation_from_metrics_jsonl() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("r");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(
            run.join("metrics.jsonl"),
            "{\"step\":1,\"loss\":null}\n{\"step\":2,\"loss\":0.5,\"validation/score\":0.1}\n",
        )
        .unwrap();
        let read = read_run(&run, "r".into(), &CurveOptions::default()).unwrap();
        assert_eq!(read.metrics["loss"], vec![(2.0, 0.5)]);
        assert!(!read.metrics.contains_key("kl"));
        assert_eq!(read.validation["validation"], vec![(2.0, 0.1)]);
        let defaults = CurveOptions::default();
        draw_curves(std::slice::from_ref(&run), &dir.path().join("c.png"), &defaults).unwrap();
        let empty = dir.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let e = draw_curves(&[run.clone(), empty.clone()], &dir.path().join("d.png"), &defaults).unwrap_err();
        assert!(matches!(e, PlotError::NotARun(p) if p == empty));
        let missing = dir.path().join("missing");
        let e = draw_curves(&[run, missing.clone()], &dir.path().join("d.png"), &defaults).unwrap_err();
        assert!(matches!(&e, PlotError::Missing(p) if *p == missing), "{e}");
    }

    #[test]
    fn legend_names_are_folder_names_unless_they_clash() {
        let a = [PathBuf::from("runs/x/arm"), PathBuf::from("runs/y/other")];
        assert_eq!(run_names(&a), ["arm", "other"]);
        let b = [PathBuf::from("runs/x/arm"), PathBuf::from("runs/y/arm")];
        assert_eq!(run_names(&b), ["runs/x/arm", "runs/y/arm"]);
    }

    #[test]
    fn ticks_and_ranges() {
        let t = |v, span| tick(v, span);
        assert_eq!(
            (t(0.0, 1.0), t(1e-7, 1e-7), t(0.25, 0.1), t(12.345, 10.0), t(2500.0, 1000.0)),
            ("0".into(), "1.0e-7".into(), "0.25".into(), "12".into(), "2500".into())
        );
        // A narrow range gets the digits that tell its ticks apart.
        assert_eq!((t(10.7912, 0.001), t(1.05e-4, 2e-5)), ("10.7912".into(), "1.05e-4".into()));
        assert_eq!(padded_range([1.0, 3.0].into_iter()), (0.9, 3.1));
        assert_eq!(padded_range([0.0].into_iter()), (-1.0, 1.0));
        assert_eq!(padded_range(std::iter::empty()), (0.0, 1.0));
        // All zeros: a plain range, and its ticks read 0 rather than rounding noise.
        assert_eq!(padded_range([0.0, 0.0, 0.0].into_iter()), (-1.0, 1.0));
        let noise = -1.0 + 5.0 * 0.2 - 1.7e-21;
        assert_eq!(t(noise, 2.0), "0");
        // A flat entropy with noise in its sixth digit is shown as flat, not zoomed into the noise.
        let (lo, hi) = padded_range([10.7912, 10.791201, 10.7911995].into_iter());
        assert!(lo < 9.8 && hi > 11.8, "{lo} {hi}");
        // The smoke run's entropy: 10.789943 to 10.789957.
        let (lo, hi) = padded_range([10.789947, 10.789943, 10.789957].into_iter());
        assert!(lo < 9.8 && hi > 11.8, "{lo} {hi}");
        // A real trend, however small against the value, is still shown.
        let (lo, hi) = padded_range([10.70, 10.71].into_iter());
        assert!(lo > 10.69 && hi < 10.72, "{lo} {hi}");
        // Points at the first and last step are inside the panel.
        let (a, b) = step_range([1.0, 4.0].into_iter());
        assert!(a < 1.0 && b > 4.0);
        assert_eq!(step_range([3.0].into_iter()), (2.5, 3.5));
        assert_eq!((step_tick(2.0), step_tick(2.5), step_tick(-0.0)), ("2".into(), String::new(), "0".into()));
    }
}
