//! `grpo bench pack`: the padding of padded against packed micro-batches on a long-tailed length mix
//! (no model runs).

use rand::SeedableRng;
use serde_json::{json, Value};

use super::harness::{long_tailed, BenchError, Result};
use crate::train::pack::{Batching, Padding};

/// A long-tailed answer length mix and the groupings to compare on it (`grpo bench pack`).
#[derive(Debug, Clone, clap::Args)]
pub struct PackSpec {
    /// Questions in the step.
    #[arg(long, default_value_t = 32)]
    pub questions: usize,
    /// Answers per question (adjacent in the batch, as a step orders them).
    #[arg(long, default_value_t = 8)]
    pub group: usize,
    /// Median response tokens (log-normal).
    #[arg(long, default_value_t = 4096.0)]
    pub median: f64,
    /// Standard deviation of a question's log length around the median (hard questions get long answers).
    #[arg(long, default_value_t = 0.5)]
    pub question_sigma: f64,
    /// Standard deviation of an answer's log length around its question's.
    #[arg(long, default_value_t = 0.55)]
    pub answer_sigma: f64,
    /// Response tokens are cut here (`data.max_response_tokens`; the seed's 16,384).
    #[arg(long, default_value_t = 16_384)]
    pub max_response: usize,
    /// Median prompt tokens (log-normal, sigma 0.6, at most 2,048).
    #[arg(long, default_value_t = 150.0)]
    pub prompt_median: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Answers per padded micro-batch (`train.micro_batch_size`), each compared.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub micro_batch: Vec<usize>,
    /// Token budgets of packed micro-batches (`train.micro_batch_tokens`), each compared.
    #[arg(long, value_delimiter = ',', default_value = "16384,18432,32768,65536")]
    pub budgets: Vec<usize>,
}

/// One grouping of [`pack`]'s answers.
#[derive(Debug, serde::Serialize)]
struct PackRow {
    /// `micro_batch_size = n` or `micro_batch_tokens = n`.
    batching: String,
    #[serde(flatten)]
    padding: Padding,
    padding_fraction: f64,
    /// Packed only: the answers' tokens over the micro-batches' budget (how full its rows are).
    budget_fill: Option<f64>,
}

/// The answer lengths (prompt + response) of `spec`'s step, deterministic in `seed`, and how many
/// responses were cut at `max_response`.
fn pack_lengths(spec: &PackSpec) -> (Vec<usize>, usize) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(spec.seed);
    let (mut lengths, mut cut) = (Vec::new(), 0);
    for _ in 0..spec.questions {
        let sigmas = (spec.median, spec.question_sigma, spec.answer_sigma);
        let (prompt, responses) = long_tailed(&mut rng, spec.prompt_median, sigmas, spec.group);
        for response in responses {
            cut += usize::from(response >= spec.max_response);
            lengths.push(prompt.min(2048) + response.min(spec.max_response));
        }
    }
    (lengths, cut)
}

/// The padding of a step's micro-batches on a long-tailed length mix like OpenThoughts3's (a median of a
/// few thousand tokens, a tail cut at 16k): padded micro-batches of each size against packed ones of each
/// token budget (src/train/pack.rs), with the answers' length statistics.
pub fn pack(spec: &PackSpec) -> Result<Value> {
    if spec.questions == 0 || spec.group == 0 || spec.median < 1.0 || spec.max_response == 0 {
        return Err(BenchError::Invalid("questions, group, median and max-response must be positive".into()));
    }
    let (lengths, cut) = pack_lengths(spec);
    let mut sorted = lengths.clone();
    sorted.sort_unstable();
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    let row = |batching: Batching| {
        let padding = Padding::of(&batching.micro_batches(&lengths), &lengths);
        let fill = match batching {
            Batching::Answers(_) => None,
            Batching::Tokens(n) => Some(padding.tokens as f64 / (padding.micro_batches * n).max(1) as f64),
        };
        PackRow { batching: batching.to_string(), padding, padding_fraction: padding.fraction(), budget_fill: fill }
    };
    let padded = spec.micro_batch.iter().map(|&n| row(Batching::Answers(n.max(1))));
    let packed = spec.budgets.iter().filter(|&&n| n > 0).map(|&n| row(Batching::Tokens(n)));
    Ok(json!({
        "bench": "pack",
        "answers": lengths.len(),
        "seed": spec.seed,
        "length_median": at(0.5),
        "length_p90": at(0.9),
        "length_max": at(1.0),
        "length_mean": lengths.iter().sum::<usize>() as f64 / lengths.len() as f64,
        "cut": cut,
        "groupings": padded.chain(packed).collect::<Vec<_>>(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::parse;

    fn spec(seed: u64) -> PackSpec {
        let seed = seed.to_string();
        let args = ["--questions", "6", "--group", "4", "--median", "2000", "--max-response", "3000", "--seed", &seed];
        parse(&[&args[..], &["--micro-batch", "1,4", "--budgets", "8192,0"]].concat())
    }

    #[test]
    fn lengths_are_deterministic_in_the_seed_and_cut_at_the_maximum() {
        let (a, cut) = pack_lengths(&spec(3));
        assert_eq!(pack_lengths(&spec(3)), (a.clone(), cut));
        assert_ne!(pack_lengths(&spec(4)).0, a);
        assert_eq!(a.len(), 24);
        assert!(a.iter().all(|&l| l <= 2048 + 3000), "{a:?}");
        assert!(cut > 0 && cut < 24, "{cut} of 24 cut at 3000 tokens around a 2000 median");
    }

    #[test]
    fn each_grouping_is_a_row_and_bad_mixes_are_refused() {
        let r = pack(&spec(0)).unwrap();
        let rows = r["groupings"].as_array().unwrap();
        // The zero budget is skipped; a padded row has no budget fill.
        let names: Vec<&str> = rows.iter().map(|g| g["batching"].as_str().unwrap()).collect();
        assert_eq!(names.len(), 3, "{names:?}");
        assert!(rows[0]["budget_fill"].is_null() && rows[2]["budget_fill"].as_f64().unwrap() > 0.0, "{r}");
        let err = pack(&PackSpec { questions: 0, ..spec(0) }).unwrap_err().to_string();
        assert!(err.contains("must be positive"), "{err}");
    }
}
