//! Running a benchmark: prompts through the chat template, samples from an engine, scoring through the reward
//! module only (so evaluation verdicts and training rewards never diverge), and the report.

use std::collections::HashMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::benchmarks::{Benchmark, Problem};
use super::engine::{Completion, Engine, Native, Progress, PromptJob};
use super::generate::{FinishReason, SamplingParams};
use super::options::EvalOptions;
use super::EvalError;
use crate::model::{ChatTokenizer, Decoder};
use crate::reward::{judge, summarize, ItemOutcome, Summary};

/// One sample of a problem.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub text: String,
    pub pred: Option<String>,
    pub correct: bool,
    /// The verdict is unknown: equivalence to the gold answer could not be decided (not correct).
    #[serde(default)]
    pub unknown: bool,
    pub tokens: usize,
    pub finish: FinishReason,
}

/// Everything about one problem (one line of generations.jsonl).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProblemResult {
    pub bench: String,
    pub id: String,
    pub prompt: String,
    pub answer: String,
    pub prompt_tokens: usize,
    pub samples: Vec<Sample>,
    pub majority: Option<String>,
    pub majority_correct: bool,
}

/// The per-benchmark report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchReport {
    pub bench: String,
    pub n_problems: usize,
    pub n: usize,
    pub avg_at_n: f64,
    pub pass_at_k: std::collections::BTreeMap<usize, f64>,
    pub maj_at_n: f64,
    pub extract_rate: f64,
    /// Samples whose verdict is unknown (counted as not correct): equivalence to the gold answer could
    /// not be decided within the limits of exact arithmetic.
    #[serde(default)]
    pub n_unknown: usize,
    pub mean_response_tokens: f64,
    pub truncated_fraction: f64,
    pub sampling: SamplingParams,
    pub duration_s: f64,
    pub generated_tokens: usize,
    pub tokens_per_sec: f64,
}

/// k = 1, 2, 4, ..., n (and n itself).
fn ks_for(n: usize) -> Vec<usize> {
    let mut ks: Vec<usize> = std::iter::successors(Some(1usize), |k| Some(k * 2)).take_while(|&k| k <= n).collect();
    if ks.last() != Some(&n) && n > 0 {
        ks.push(n);
    }
    ks
}

/// Summarise finished problems of one benchmark.
fn report(
    bench: &str,
    results: &[ProblemResult],
    options: &EvalOptions,
    duration_s: f64,
    generated: usize,
) -> BenchReport {
    let items: Vec<ItemOutcome> = results
        .iter()
        .map(|r| ItemOutcome {
            correct: r.samples.iter().map(|s| s.correct).collect(),
            unknown: r.samples.iter().filter(|s| s.unknown).count(),
            extracted: r.samples.iter().filter(|s| s.pred.is_some()).count(),
            majority_correct: Some(r.majority_correct),
        })
        .collect();
    let s: Summary = summarize(&items, &ks_for(options.n));
    let samples: Vec<&Sample> = results.iter().flat_map(|r| &r.samples).collect();
    let count = samples.len().max(1) as f64;
    BenchReport {
        bench: bench.to_string(),
        n_problems: results.len(),
        n: options.n,
        avg_at_n: s.avg_at_n,
        pass_at_k: s.pass_at_k,
        maj_at_n: s.maj_at_n.unwrap_or(0.0),
        extract_rate: s.extract_rate,
        n_unknown: s.n_unknown,
        mean_response_tokens: samples.iter().map(|s| s.tokens as f64).sum::<f64>() / count,
        truncated_fraction: samples.iter().filter(|s| s.finish == FinishReason::Length).count() as f64 / count,
        sampling: options.sampling(),
        duration_s,
        generated_tokens: generated,
        tokens_per_sec: if duration_s > 0.0 { generated as f64 / duration_s } else { 0.0 },
    }
}

/// One problem's result: its samples judged against its gold answer.
fn problem_result(
    bench: &str,
    problem: &Problem,
    prompt: String,
    prompt_tokens: usize,
    gens: Vec<Completion>,
    options: &EvalOptions,
) -> ProblemResult {
    let texts: Vec<&str> = gens.iter().map(|g| g.text.as_str()).collect();
    let v = judge(Some(&problem.answer), &texts, &options.extract());
    let samples = gens
        .into_iter()
        .zip(v.preds.into_iter().zip(v.correct).zip(v.unknown))
        .map(|(g, ((pred, correct), unknown))| Sample {
            text: g.text,
            pred,
            correct,
            unknown,
            tokens: g.tokens,
            finish: g.finish,
        })
        .collect();
    ProblemResult {
        bench: bench.to_string(),
        id: problem.id.clone(),
        prompt,
        answer: problem.answer.clone(),
        prompt_tokens,
        samples,
        majority: v.majority,
        majority_correct: v.majority_correct.unwrap_or(false),
    }
}

/// Where an evaluation is, against its budget: each problem may generate up to n x max_new_tokens tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvalProgress {
    /// Problems finished in this run (not counting those resumed from an earlier run).
    pub problems_done: usize,
    /// Problems this run generates.
    pub problems: usize,
    /// Tokens generated so far.
    pub tokens: usize,
    /// The most tokens the run can generate: problems x n x max_new_tokens.
    pub budget: u64,
    /// The part of the budget used up: the tokens generated, plus what finished problems left unused
    /// (answers that stopped before max_new_tokens). It reaches `budget` at the end, and
    /// `budget - spent` bounds the work left, so an ETA from it is an upper bound.
    pub spent: u64,
    /// This point follows newly generated tokens, not a finished problem: every problem whose generation
    /// has ended is counted in `problems_done` (an engine that generates a batch of problems at once
    /// reports them finished one after another, after the batch), and generation goes on.
    pub generating: bool,
}

impl EvalProgress {
    /// What the rest of the budget costs at the speed so far, `elapsed` seconds into the run: at most the
    /// unspent budget at the tokens/s seen (an upper bound: answers that stop early leave tokens unused).
    pub fn estimate(&self, elapsed: f64) -> String {
        let rate = self.tokens as f64 / elapsed.max(1e-9);
        let left = self.budget.saturating_sub(self.spent);
        format!(
            "{} of {} problems in {} ({:.1} tok/s): the {} tokens left of the budget take at most {} at this speed",
            self.problems_done,
            self.problems,
            crate::progress::duration(elapsed),
            rate,
            left,
            crate::progress::duration(left as f64 / rate.max(1e-9))
        )
    }

    /// Show this point on `bar`, a bar over the token budget, for a run that began at `started`.
    pub fn show(&self, bar: &indicatif::ProgressBar, started: Instant) {
        bar.set_length(self.budget);
        bar.set_position(self.spent);
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "tokens of the budget; {}/{} problems done, {} tokens generated, {:.1} tok/s",
            self.problems_done,
            self.problems,
            self.tokens,
            self.tokens as f64 / secs
        ));
    }
}

/// Evaluate `model` on `bench` with the native engine (see [`evaluate_with`]).
pub fn evaluate(
    model: &Decoder,
    tok: &ChatTokenizer,
    bench: &Benchmark,
    options: &EvalOptions,
    done: &HashMap<String, ProblemResult>,
    on_result: impl FnMut(&ProblemResult) -> Result<(), EvalError>,
    on_progress: impl FnMut(&EvalProgress),
) -> Result<(BenchReport, Vec<ProblemResult>), EvalError> {
    let engine = Native { model, tok, batch_size: options.batch_size, generation: &options.generation };
    evaluate_with(&engine, tok, bench, options, done, on_result, on_progress)
}

/// Scores the engine's samples as they come (the [`Progress`] given to the engine).
struct Scorer<'a, R, P> {
    bench: &'a Benchmark,
    options: &'a EvalOptions,
    /// (index into `results`, problem, prompt text, prompt tokens) of each job.
    jobs: Vec<(usize, &'a Problem, String, usize)>,
    results: Vec<Option<ProblemResult>>,
    progress: EvalProgress,
    /// The budget of one problem: n x max_new_tokens.
    per_problem: u64,
    /// Tokens of the finished problems.
    finished_tokens: u64,
    on_result: R,
    on_progress: P,
}

impl<R, P: FnMut(&EvalProgress)> Scorer<'_, R, P> {
    fn report_progress(&mut self) {
        let p = &mut self.progress;
        let in_flight = (p.tokens as u64).saturating_sub(self.finished_tokens);
        p.spent = (p.problems_done as u64 * self.per_problem + in_flight).min(p.budget);
        (self.on_progress)(&self.progress);
    }
}

impl<R, P> Progress for Scorer<'_, R, P>
where
    R: FnMut(&ProblemResult) -> Result<(), EvalError>,
    P: FnMut(&EvalProgress),
{
    fn tokens(&mut self, count: usize) {
        self.progress.tokens += count;
        self.progress.generating = true;
        self.report_progress();
    }

    fn done(&mut self, job: usize, samples: Vec<Completion>) -> Result<(), EvalError> {
        let (i, problem, prompt, prompt_tokens) = &mut self.jobs[job];
        let r =
            problem_result(&self.bench.name, problem, std::mem::take(prompt), *prompt_tokens, samples, self.options);
        (self.on_result)(&r)?;
        self.finished_tokens += r.samples.iter().map(|s| s.tokens as u64).sum::<u64>();
        self.results[*i] = Some(r);
        self.progress.problems_done += 1;
        self.progress.generating = false;
        self.report_progress();
        Ok(())
    }
}

/// The problems of a benchmark one of several processes generates: problem i when i mod `of` is `index`.
/// Each sample's random stream is seeded from the problem's index in the benchmark, so a problem's answers
/// do not depend on which process drew them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub index: usize,
    pub of: usize,
}

impl Share {
    /// Every problem: one process.
    pub const WHOLE: Share = Share { index: 0, of: 1 };

    fn holds(&self, problem: usize) -> bool {
        problem % self.of == self.index
    }
}

/// What one share of a benchmark's problems gave: its problems' results in benchmark order (those resumed
/// from an earlier run included), and the tokens it generated.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShareResults {
    pub results: Vec<ProblemResult>,
    pub generated_tokens: usize,
}

/// Evaluate on `bench`, drawing the samples from `engine`; prompts are rendered with `tok`'s chat template
/// and scored by the reward module. Problems found in `done` (by id) are not generated again (resume);
/// `on_result` receives each newly finished problem (to append it to generations.jsonl);
/// `on_progress` receives where the run is against its token budget (for a progress bar).
pub fn evaluate_with(
    engine: &dyn Engine,
    tok: &ChatTokenizer,
    bench: &Benchmark,
    options: &EvalOptions,
    done: &HashMap<String, ProblemResult>,
    on_result: impl FnMut(&ProblemResult) -> Result<(), EvalError>,
    on_progress: impl FnMut(&EvalProgress),
) -> Result<(BenchReport, Vec<ProblemResult>), EvalError> {
    let start = Instant::now();
    let part = evaluate_share(engine, tok, bench, options, done, Share::WHOLE, on_result, on_progress)?;
    Ok(merge_shares(bench, options, vec![part], start.elapsed().as_secs_f64()))
}

/// As [`evaluate_with`], for the problems of `share` only: their results, to be merged with the other
/// shares' by [`merge_shares`].
#[allow(clippy::too_many_arguments)]
pub fn evaluate_share(
    engine: &dyn Engine,
    tok: &ChatTokenizer,
    bench: &Benchmark,
    options: &EvalOptions,
    done: &HashMap<String, ProblemResult>,
    share: Share,
    on_result: impl FnMut(&ProblemResult) -> Result<(), EvalError>,
    on_progress: impl FnMut(&EvalProgress),
) -> Result<ShareResults, EvalError> {
    let n = options.n.max(1);
    let problems: Vec<(usize, &Problem)> = bench
        .problems
        .iter()
        .take(options.problem_count(bench.problems.len()))
        .enumerate()
        .filter(|(i, _)| share.holds(*i))
        .collect();
    let results: Vec<Option<ProblemResult>> = problems.iter().map(|(_, p)| done.get(&p.id).cloned()).collect();
    let mut jobs = Vec::new();
    let mut prompts = Vec::new();
    for (slot, (i, p)) in problems.iter().enumerate().filter(|(slot, _)| results[*slot].is_none()) {
        let text = tok.render_prompt(options.system_prompt.as_deref(), &bench.prompt(p))?;
        let ids = tok.encode(&text, false)?;
        jobs.push((slot, *p, text.clone(), ids.len()));
        prompts.push(PromptJob { id: p.id.clone(), text, ids, first_sequence: (i * n) as u64 });
    }
    let per_problem = (n * options.max_new_tokens) as u64;
    let progress = EvalProgress { problems: jobs.len(), budget: jobs.len() as u64 * per_problem, ..Default::default() };
    let mut scorer =
        Scorer { bench, options, jobs, results, progress, per_problem, finished_tokens: 0, on_result, on_progress };
    scorer.report_progress();
    engine.complete(&prompts, n, &options.sampling(), &mut scorer)?;
    let results: Vec<ProblemResult> = scorer.results.into_iter().map(|r| r.expect("every problem evaluated")).collect();
    Ok(ShareResults { results, generated_tokens: scorer.progress.tokens })
}

/// The report and the results, in benchmark order, of the shares of `bench` (share k of N in `parts[k]`)
/// that together took `duration_s`: what one process evaluating every problem gives.
pub fn merge_shares(
    bench: &Benchmark,
    options: &EvalOptions,
    parts: Vec<ShareResults>,
    duration_s: f64,
) -> (BenchReport, Vec<ProblemResult>) {
    let generated: usize = parts.iter().map(|p| p.generated_tokens).sum();
    let total: usize = parts.iter().map(|p| p.results.len()).sum();
    let mut shares: Vec<std::vec::IntoIter<ProblemResult>> = parts.into_iter().map(|p| p.results.into_iter()).collect();
    let of = shares.len();
    let results: Vec<ProblemResult> =
        (0..total).map(|i| shares[i % of].next().expect("share k holds problems k, k + N, ...")).collect();
    let rep = report(&bench.name, &results, options, duration_s, generated);
    (rep, results)
}

/// A fixed-width table of reports.
pub fn table(reports: &[BenchReport]) -> String {
    let ks: Vec<usize> = reports.first().map(|r| r.pass_at_k.keys().copied().collect()).unwrap_or_default();
    let mut out = format!("{:<10} {:>8} {:>9} {:>8}", "bench", "problems", "avg@n", "maj@n");
    for k in &ks {
        out += &format!(" {:>8}", format!("pass@{k}"));
    }
    out += &format!(" {:>9} {:>9} {:>8}\n", "mean len", "truncated", "tok/s");
    for r in reports {
        out += &format!("{:<10} {:>8} {:>9.4} {:>8.4}", r.bench, r.n_problems, r.avg_at_n, r.maj_at_n);
        for k in &ks {
            out += &format!(" {:>8.4}", r.pass_at_k.get(k).copied().unwrap_or(f64::NAN));
        }
        out += &format!(" {:>9.1} {:>9.3} {:>8.1}\n", r.mean_response_tokens, r.truncated_fraction, r.tokens_per_sec);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ks_are_powers_of_two_up_to_n() {
        assert_eq!(ks_for(8), vec![1, 2, 4, 8]);
        assert_eq!(ks_for(6), vec![1, 2, 4, 6]);
        assert_eq!(ks_for(1), vec![1]);
    }

    #[test]
    fn unknown_verdicts_are_counted_and_old_records_still_read() {
        let sample = |correct: bool, unknown: bool| Sample {
            text: String::new(),
            pred: Some("1".into()),
            correct,
            unknown,
            tokens: 3,
            finish: FinishReason::Stop,
        };
        let result = ProblemResult {
            bench: "b".into(),
            id: "1".into(),
            prompt: String::new(),
            answer: "1".into(),
            prompt_tokens: 1,
            samples: vec![sample(true, false), sample(false, true), sample(false, true)],
            majority: Some("1".into()),
            majority_correct: true,
        };
        let options = EvalOptions { n: 3, ..EvalOptions::default() };
        let r = report("b", std::slice::from_ref(&result), &options, 1.0, 9);
        assert_eq!(r.n_unknown, 2);
        assert!((r.avg_at_n - 1.0 / 3.0).abs() < 1e-12);
        // Records written before the field existed read as "not unknown" / no unknown verdicts.
        let mut old = serde_json::to_value(&result).unwrap();
        old["samples"].as_array_mut().unwrap().iter_mut().for_each(|s| {
            s.as_object_mut().unwrap().remove("unknown");
        });
        let back: ProblemResult = serde_json::from_value(old).unwrap();
        assert!(back.samples.iter().all(|s| !s.unknown));
        let mut old_report = serde_json::to_value(&r).unwrap();
        old_report.as_object_mut().unwrap().remove("n_unknown");
        assert_eq!(serde_json::from_value::<BenchReport>(old_report).unwrap().n_unknown, 0);
    }
}
