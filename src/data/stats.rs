//! What is in a trajectory data set: row, group and label counts, the vote-margin histogram and length
//! percentiles ([`Stats`]), printed as text, written as JSON, and drawn like the seed's figure 2
//! ([`plot_stats`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::label::GroupKind;
use super::reader::BadRow;
use super::DataError;

/// How many bad rows are kept as examples in [`Stats::skipped_examples`].
const EXAMPLES: usize = 20;

/// Counts over a data set. Row counts are over the input rows; group, response and label counts are over
/// the kept groups (after filters, the group-size cap and the minimum group size).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub rows_read: u64,
    pub rows_skipped: u64,
    /// Skipped rows by reason (`bad_json`, `no_human_turn`, ...).
    pub skipped_by_reason: BTreeMap<String, u64>,
    /// The first few skipped rows, `file: line N: reason: detail`.
    pub skipped_examples: Vec<String>,
    /// Good rows left out by the domain / source filters.
    pub rows_filtered: u64,
    /// Distinct questions among the good, unfiltered rows.
    pub questions: u64,
    /// Groups kept.
    pub groups: u64,
    /// Groups with fewer answers than the minimum group size (dropped).
    pub groups_dropped_small: u64,
    /// Groups whose prompt is longer than the prompt limit (dropped; prepare only).
    pub groups_dropped_long_prompt: u64,
    /// Groups whose majority vote is a tie (dropped with `ties = "drop"`).
    #[serde(default)]
    pub groups_dropped_tie: u64,
    /// Groups whose vote margin is below `min_vote_margin` (dropped).
    #[serde(default)]
    pub groups_dropped_margin: u64,
    /// Eligible groups left out of the `max_questions` sample.
    #[serde(default)]
    pub groups_not_sampled: u64,
    /// Responses in the kept groups.
    pub responses: u64,
    /// Answers beyond the group-size cap (left out).
    pub responses_over_cap: u64,
    /// Responses longer than the response limit: dropped, or kept truncated (prepare only).
    pub responses_dropped_long: u64,
    pub responses_truncated: u64,
    /// Kept responses with no extractable final answer.
    pub no_answer: u64,
    pub all_positive_groups: u64,
    pub all_negative_groups: u64,
    pub mixed_groups: u64,
    /// Groups by vote margin (winner's count minus runner-up's count).
    pub vote_margin_histogram: BTreeMap<u64, u64>,
    /// Groups by number of kept responses.
    pub group_size_histogram: BTreeMap<u64, u64>,
    /// `tokens` (with a tokenizer) or `characters`.
    pub length_unit: String,
    /// Prompt length per kept group (the chat-template rendering with a tokenizer, the question otherwise).
    pub prompt_length: LengthSummary,
    /// Length of each kept response.
    pub response_length: LengthSummary,
    /// Tokens written (prepare only).
    #[serde(default)]
    pub tokens: u64,
    /// Responses whose teacher log-probs were kept / left out for a length that does not match the
    /// tokenisation (prepare only).
    #[serde(default)]
    pub teacher_logprobs_kept: u64,
    #[serde(default)]
    pub teacher_logprobs_mismatched: u64,
}

impl Stats {
    pub(crate) fn skip(&mut self, bad: &BadRow) {
        self.rows_skipped += 1;
        *self.skipped_by_reason.entry(bad.reason.as_str().to_string()).or_default() += 1;
        if self.skipped_examples.len() < EXAMPLES {
            self.skipped_examples.push(bad.to_string());
        }
    }

    pub(crate) fn add_group(&mut self, kind: GroupKind, margin: usize, size: usize, no_answer: usize) {
        self.groups += 1;
        self.responses += size as u64;
        self.no_answer += no_answer as u64;
        match kind {
            GroupKind::AllPositive => self.all_positive_groups += 1,
            GroupKind::AllNegative => self.all_negative_groups += 1,
            GroupKind::Mixed => self.mixed_groups += 1,
        }
        *self.vote_margin_histogram.entry(margin as u64).or_default() += 1;
        *self.group_size_histogram.entry(size as u64).or_default() += 1;
    }

    /// A human-readable report.
    pub fn report(&self) -> String {
        let mut s = String::new();
        let pct = |a: u64, b: u64| if b == 0 { 0.0 } else { 100.0 * a as f64 / b as f64 };
        let _ = writeln!(s, "rows_read            {}", self.rows_read);
        let _ = writeln!(s, "rows_skipped         {}", self.rows_skipped);
        for (reason, n) in &self.skipped_by_reason {
            let _ = writeln!(s, "  {reason:<19}{n}");
        }
        let _ = writeln!(s, "rows_filtered        {}", self.rows_filtered);
        let _ = writeln!(s, "questions            {}", self.questions);
        let _ = writeln!(s, "groups               {}", self.groups);
        let _ = writeln!(s, "  dropped_small      {}", self.groups_dropped_small);
        for (name, n) in [
            ("dropped_long_prompt", self.groups_dropped_long_prompt),
            ("dropped_tie", self.groups_dropped_tie),
            ("dropped_margin", self.groups_dropped_margin),
            ("not_sampled", self.groups_not_sampled),
        ] {
            if n > 0 {
                let _ = writeln!(s, "  {name:<18} {n}");
            }
        }
        let _ = writeln!(s, "responses            {}", self.responses);
        let _ = writeln!(s, "  over_cap           {}", self.responses_over_cap);
        if self.responses_dropped_long + self.responses_truncated > 0 {
            let _ = writeln!(s, "  dropped_long       {}", self.responses_dropped_long);
            let _ = writeln!(s, "  truncated          {}", self.responses_truncated);
        }
        let _ = writeln!(
            s,
            "no_answer            {} ({:.1}% of responses)",
            self.no_answer,
            pct(self.no_answer, self.responses)
        );
        for (name, n) in [
            ("all_positive_groups", self.all_positive_groups),
            ("all_negative_groups", self.all_negative_groups),
            ("mixed_groups", self.mixed_groups),
        ] {
            let _ = writeln!(s, "{name:<21}{n} ({:.1}%)", pct(n, self.groups));
        }
        let _ = writeln!(s, "vote margin histogram (margin: groups)");
        for (m, n) in &self.vote_margin_histogram {
            let _ = writeln!(s, "  {m:>3}: {n}");
        }
        for (name, l) in [("prompt", &self.prompt_length), ("response", &self.response_length)] {
            let _ = writeln!(
                s,
                "{name} length ({}): n={} mean={:.1} min={} p10={} p25={} p50={} p75={} p90={} p95={} p99={} max={}",
                self.length_unit, l.count, l.mean, l.min, l.p10, l.p25, l.p50, l.p75, l.p90, l.p95, l.p99, l.max
            );
        }
        s
    }
}

/// Percentiles of a length distribution (from a histogram with less than 0.4% relative error above 2048).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LengthSummary {
    pub count: u64,
    pub mean: f64,
    pub min: u64,
    pub p10: u64,
    pub p25: u64,
    pub p50: u64,
    pub p75: u64,
    pub p90: u64,
    pub p95: u64,
    pub p99: u64,
    pub max: u64,
    /// (bucket lower bound, count) pairs of a coarse histogram for plotting (at most 64 buckets).
    pub histogram: Vec<(u64, u64)>,
}

/// A length histogram in constant memory: exact below 2048, 256 buckets per power of two above.
#[derive(Debug, Clone)]
pub(crate) struct LengthHistogram {
    counts: Vec<u64>,
    count: u64,
    sum: u128,
    min: u64,
    max: u64,
}

const EXACT: u64 = 2048;

fn bucket(v: u64) -> usize {
    if v < EXACT {
        return v as usize;
    }
    let e = 63 - v.leading_zeros() as u64; // >= 11
    let m = v >> (e - 8); // in [256, 512)
    (EXACT + (e - 11) * 256 + (m - 256)) as usize
}

fn bucket_low(b: usize) -> u64 {
    let b = b as u64;
    if b < EXACT {
        return b;
    }
    let e = (b - EXACT) / 256 + 11;
    let m = (b - EXACT) % 256 + 256;
    m << (e - 8)
}

impl Default for LengthHistogram {
    fn default() -> Self {
        Self { counts: Vec::new(), count: 0, sum: 0, min: u64::MAX, max: 0 }
    }
}

impl LengthHistogram {
    pub(crate) fn add(&mut self, v: u64) {
        let b = bucket(v);
        if self.counts.len() <= b {
            self.counts.resize(b + 1, 0);
        }
        self.counts[b] += 1;
        self.count += 1;
        self.sum += v as u128;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bucket_low(b).clamp(self.min, self.max);
            }
        }
        self.max
    }

    pub(crate) fn summary(&self) -> LengthSummary {
        if self.count == 0 {
            return LengthSummary::default();
        }
        // Coarse histogram: 48 equal-width buckets from 0 to p99 (longer lengths go in the last one).
        let hi = self.quantile(0.99).max(1);
        let nb = 48u64;
        let width = hi.div_ceil(nb).max(1);
        let mut coarse = vec![0u64; nb as usize];
        for (b, &c) in self.counts.iter().enumerate() {
            if c > 0 {
                let i = (bucket_low(b) / width).min(nb - 1) as usize;
                coarse[i] += c;
            }
        }
        LengthSummary {
            count: self.count,
            mean: self.sum as f64 / self.count as f64,
            min: self.min,
            p10: self.quantile(0.10),
            p25: self.quantile(0.25),
            p50: self.quantile(0.50),
            p75: self.quantile(0.75),
            p90: self.quantile(0.90),
            p95: self.quantile(0.95),
            p99: self.quantile(0.99),
            max: self.max,
            histogram: coarse.into_iter().enumerate().map(|(i, c)| (i as u64 * width, c)).collect(),
        }
    }
}

/// Register the plot font (see [`crate::plot::register_font`]).
fn load_font() -> Result<(), DataError> {
    crate::plot::register_font().map_err(DataError::Plot)
}

/// Draw the stats as a PNG: the share of all-positive / mixed / all-negative groups (the seed's figure 2),
/// the vote-margin histogram and the response-length histogram.
pub fn plot_stats(stats: &Stats, path: &Path) -> Result<(), DataError> {
    use plotters::prelude::*;
    load_font()?;
    let root = BitMapBackend::new(path, (1500, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let panels = root.split_evenly((1, 3));
    draw_group_kinds(&panels[0], stats)?;
    draw_vote_margins(&panels[1], stats)?;
    draw_response_lengths(&panels[2], stats)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

/// A panel of [`plot_stats`]' figure.
type Panel<'a> = plotters::drawing::DrawingArea<plotters::prelude::BitMapBackend<'a>, plotters::coord::Shift>;

fn plot_err(e: impl std::fmt::Display) -> DataError {
    DataError::Plot(e.to_string())
}

/// The pie of the groups' kinds: all positive, mixed, all negative.
fn draw_group_kinds(panel: &Panel<'_>, stats: &Stats) -> Result<(), DataError> {
    use plotters::prelude::*;
    let pie_area = panel.margin(12, 0, 0, 0);
    let pie_area =
        pie_area.titled(&format!("Teacher groups (n = {})", stats.groups), ("sans-serif", 20)).map_err(plot_err)?;
    let kinds = [
        ("all positive", stats.all_positive_groups, RGBColor(0x4c, 0x9b, 0xe8)),
        ("mixed", stats.mixed_groups, RGBColor(0xf5, 0x9e, 0x42)),
        ("all negative", stats.all_negative_groups, RGBColor(0xd6, 0x4d, 0x4d)),
    ];
    let present: Vec<_> = kinds.iter().filter(|k| k.1 > 0).collect();
    if present.is_empty() {
        return pie_area.draw(&Text::new("no groups", (200, 240), ("sans-serif", 20).into_font())).map_err(plot_err);
    }
    let sizes: Vec<f64> = present.iter().map(|k| k.1 as f64).collect();
    let colors: Vec<RGBColor> = present.iter().map(|k| k.2).collect();
    let labels: Vec<String> = present.iter().map(|k| format!("{} ({})", k.0, k.1)).collect();
    let center = (250, 230);
    let radius = 140.0;
    let mut pie = Pie::new(&center, &radius, &sizes, &colors, &labels);
    pie.start_angle(-90.0);
    pie.label_style(("sans-serif", 16).into_font());
    pie.percentages(("sans-serif", 16).into_font().color(&WHITE));
    pie_area.draw(&pie).map_err(plot_err)
}

/// The histogram of the groups' vote margins (winner - runner-up).
fn draw_vote_margins(panel: &Panel<'_>, stats: &Stats) -> Result<(), DataError> {
    use plotters::prelude::*;
    let max_margin = stats.vote_margin_histogram.keys().copied().max().unwrap_or(1);
    let max_count = stats.vote_margin_histogram.values().copied().max().unwrap_or(1);
    let mut chart = ChartBuilder::on(panel)
        .caption("Vote margin (winner - runner-up)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((0u64..max_margin).into_segmented(), 0u64..(max_count + max_count / 10 + 1))
        .map_err(plot_err)?;
    chart.configure_mesh().disable_x_mesh().x_desc("margin").y_desc("groups").draw().map_err(plot_err)?;
    chart
        .draw_series(
            Histogram::vertical(&chart)
                .style(RGBColor(0x4c, 0x9b, 0xe8).filled())
                .margin(3)
                .data(stats.vote_margin_histogram.iter().map(|(&m, &c)| (m, c))),
        )
        .map_err(plot_err)?;
    Ok(())
}

/// The histogram of the responses' lengths, with their median and 99th percentile.
fn draw_response_lengths(panel: &Panel<'_>, stats: &Stats) -> Result<(), DataError> {
    use plotters::prelude::*;
    let h = &stats.response_length.histogram;
    let width = if h.len() > 1 { h[1].0 - h[0].0 } else { 1 };
    let x_max = h.last().map(|b| b.0 + width).unwrap_or(1).max(1);
    let y_max = h.iter().map(|b| b.1).max().unwrap_or(1).max(1);
    let mut chart = ChartBuilder::on(panel)
        .caption(format!("Response length ({})", stats.length_unit), ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0u64..x_max, 0u64..(y_max + y_max / 10 + 1))
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc(format!("{} (p50 {}, p99 {})", stats.length_unit, stats.response_length.p50, stats.response_length.p99))
        .y_desc("responses")
        .x_labels(6)
        .draw()
        .map_err(plot_err)?;
    chart
        .draw_series(
            h.iter().map(|&(lo, c)| Rectangle::new([(lo, 0), (lo + width, c)], RGBColor(0xf5, 0x9e, 0x42).filled())),
        )
        .map_err(plot_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_trip_with_small_error() {
        for v in [0u64, 1, 2047, 2048, 2049, 4095, 4096, 10_000, 123_456, 1 << 40] {
            let lo = bucket_low(bucket(v));
            assert!(lo <= v && (v - lo) as f64 <= v as f64 / 256.0 + 1.0, "{v} -> {lo}");
        }
        assert!(bucket(2047) < bucket(2048) && bucket(4095) < bucket(4096));
    }

    #[test]
    fn percentiles_of_a_uniform_range() {
        let mut h = LengthHistogram::default();
        for v in 1..=1000 {
            h.add(v);
        }
        let s = h.summary();
        assert_eq!((s.count, s.min, s.max, s.p50, s.p90, s.p99), (1000, 1, 1000, 500, 900, 990));
        assert!((s.mean - 500.5).abs() < 1e-9);
        assert_eq!(s.histogram.iter().map(|b| b.1).sum::<u64>(), 1000);
    }
}
