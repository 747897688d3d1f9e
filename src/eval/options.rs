//! The options of an evaluation, defined once: the flags of `grpo eval` (clap, flattened into its
//! arguments) and the `[validation]` section of a training config (serde), with the same defaults.

use serde::{Deserialize, Serialize};

use super::generate::{GenerationOptions, SamplingParams};
use crate::reward::ExtractOptions;

/// The benchmark `[validation]` evaluates on when the config names none.
const DEFAULT_VALIDATION_BENCHMARK: &str = "aime24";

/// How to evaluate. In a training config unknown keys are rejected; the defaults of `grpo eval`'s flags
/// are those of [`EvalOptions::default`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub struct EvalOptions {
    /// `[validation]` only: the registered benchmark to validate on (`grpo eval` takes `--bench`).
    #[arg(skip = String::from(DEFAULT_VALIDATION_BENCHMARK))]
    pub bench: String,
    /// `[validation]` only: validate every N steps (0: at the end of each epoch).
    #[arg(skip)]
    pub every_steps: usize,
    /// Samples per problem.
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.6)]
    pub temperature: f32,
    /// Nucleus sampling mass (1 disables).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Keep the k most likely tokens (0 disables).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Generated tokens per sample at most.
    #[arg(long, default_value_t = 32768)]
    pub max_new_tokens: usize,
    /// Sampling seed (default: 0 for `grpo eval`, train.seed for `[validation]`).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Only the first K problems of each benchmark (0: all).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub limit: usize,
    /// Sequences generated together (whole problems are kept in one batch).
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// A system prompt before each problem.
    #[arg(long)]
    pub system_prompt: Option<String>,
    /// Fall back to "the answer is X" and the last number when there is no \boxed{}.
    #[arg(long)]
    pub fallbacks: bool,
    /// How the native engine schedules its sequences (`[validation.generation]`).
    #[command(flatten)]
    pub generation: GenerationOptions,
}

impl Default for EvalOptions {
    fn default() -> Self {
        Self {
            bench: DEFAULT_VALIDATION_BENCHMARK.into(),
            every_steps: 0,
            n: 1,
            temperature: 0.6,
            top_p: 0.95,
            top_k: 0,
            max_new_tokens: 32768,
            seed: None,
            limit: 0,
            batch_size: 32,
            system_prompt: None,
            fallbacks: false,
            generation: GenerationOptions::default(),
        }
    }
}

impl EvalOptions {
    /// The sampling settings (seed 0 when none is set).
    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_new_tokens: self.max_new_tokens,
            seed: self.seed.unwrap_or(0),
        }
    }

    /// How answers are extracted from the generated texts.
    pub fn extract(&self) -> ExtractOptions {
        ExtractOptions { fallbacks: self.fallbacks }
    }

    /// Check ranges, naming each value as `{prefix}{name}` (`--` for `grpo eval`, `validation.` for a
    /// training config).
    pub fn validate(&self, prefix: &str) -> Result<(), String> {
        for (name, v) in [("n", self.n), ("batch_size", self.batch_size), ("max_new_tokens", self.max_new_tokens)] {
            if v == 0 {
                return Err(format!("{prefix}{} = 0 must be >= 1", flag(prefix, name)));
            }
        }
        self.sampling().validate(|name| format!("{prefix}{}", flag(prefix, name)))?;
        self.generation.validate(&if prefix == "--" { prefix.to_string() } else { format!("{prefix}generation.") })
    }

    /// How many of a benchmark's `available` problems are evaluated (the first ones).
    pub fn problem_count(&self, available: usize) -> usize {
        if self.limit == 0 {
            available
        } else {
            self.limit.min(available)
        }
    }
}

/// A field's name as written after `prefix`: a flag (`batch-size`) after `--`, else the key.
fn flag(prefix: &str, name: &str) -> String {
    if prefix == "--" {
        name.replace('_', "-")
    } else {
        name.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: EvalOptions,
    }

    #[test]
    fn command_line_and_config_defaults_agree() {
        assert_eq!(Cli::parse_from(["eval"]).options, EvalOptions::default());
        let empty: EvalOptions = toml::from_str("").unwrap();
        assert_eq!(empty, EvalOptions::default());
    }

    #[test]
    fn flags_and_keys_set_the_same_fields() {
        let cli = Cli::parse_from(["eval", "--n", "4", "--top-k", "20", "--limit", "3", "--seed", "5", "--fallbacks"]);
        let toml: EvalOptions = toml::from_str("n = 4\ntop_k = 20\nlimit = 3\nseed = 5\nfallbacks = true").unwrap();
        assert_eq!(cli.options, toml);
        assert_eq!((toml.sampling().top_k, toml.sampling().seed, toml.extract().fallbacks), (20, 5, true));
        assert_eq!(
            (toml.problem_count(30), toml.problem_count(2), EvalOptions::default().problem_count(30)),
            (3, 2, 30)
        );
        assert!(Cli::try_parse_from(["eval", "--bench", "aime24"]).is_err(), "bench is not a flag of the options");
    }

    #[test]
    fn out_of_range_values_are_named() {
        assert_eq!(EvalOptions::default().validate("--"), Ok(()));
        let e = |args: &[&str]| {
            let all: Vec<&str> = ["eval"].iter().chain(args).copied().collect();
            Cli::parse_from(all).options.validate("--").unwrap_err()
        };
        assert!(e(&["--n", "0"]).starts_with("--n = 0"));
        assert!(e(&["--batch-size", "0"]).starts_with("--batch-size = 0"));
        assert!(e(&["--temperature=-1"]).starts_with("--temperature = -1"));
        assert!(e(&["--temperature", "NaN"]).starts_with("--temperature = NaN"));
        assert!(e(&["--top-p", "0"]).starts_with("--top-p = 0"));
        assert!(e(&["--top-p", "1.01"]).starts_with("--top-p = 1.01"));
    }

    #[test]
    fn unknown_validation_keys_are_rejected_with_the_nearest_name() {
        let cfg = "[model]\npath = \"m\"\n[data]\ninputs = [\"x.jsonl\"]\n[validation]\ntemprature = 0.5\n";
        let e = crate::train::TrainConfig::parse(cfg, std::path::Path::new("c.toml"), &[]).unwrap_err().to_string();
        assert!(e.contains("temprature") && e.contains("did you mean `temperature`"), "{e}");
    }
}
