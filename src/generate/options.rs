//! How generation schedules its sequences, one set of options for `grpo eval` (flags), `[validation]` and
//! `[rollout]` (a `generation` table in each). The number of sequences at a time is the owner's own
//! `batch_size`.

use serde::{Deserialize, Serialize};

/// The scheduling policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Continuous batching over the paged KV cache: sequences join as others finish, prompts are shared.
    #[default]
    Continuous,
    /// Static batches of whole problems on a contiguous KV cache, each run until its longest answer ends.
    Static,
}

/// The generation engine's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub struct GenerationOptions {
    /// How sequences are batched: `continuous` (paged KV cache) or `static` (whole batches).
    #[arg(long, value_enum, default_value_t = Schedule::Continuous)]
    pub schedule: Schedule,
    /// Tokens one forward runs at most (decode tokens first, then chunks of waiting prompts).
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Positions per block of the paged KV cache.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Blocks in the KV pool (0: enough for every sequence at its longest; fewer preempt and recompute).
    #[arg(long, default_value_t = 0)]
    pub kv_blocks: usize,
    /// Keep full blocks cached by their tokens for later prompts that start the same way.
    #[arg(long = "no-prefix-cache", action = clap::ArgAction::SetFalse)]
    pub prefix_cache: bool,
}

impl Default for GenerationOptions {
    fn default() -> Self {
        Self {
            schedule: Schedule::Continuous,
            max_batch_tokens: 2048,
            block_size: 16,
            kv_blocks: 0,
            prefix_cache: true,
        }
    }
}

impl GenerationOptions {
    /// Check ranges, naming each value as `{prefix}{name}` (`--` for a flag, `validation.generation.` for a
    /// key).
    pub fn validate(&self, prefix: &str) -> Result<(), String> {
        let name = |n: &str| if prefix == "--" { format!("--{}", n.replace('_', "-")) } else { format!("{prefix}{n}") };
        for (n, v) in [("max_batch_tokens", self.max_batch_tokens), ("block_size", self.block_size)] {
            if v == 0 {
                return Err(format!("{} = 0 must be >= 1", name(n)));
            }
        }
        Ok(())
    }

    /// The pool's blocks for `seats` sequences of at most `longest` positions: `kv_blocks` when set, else
    /// every seat's longest sequence (what the memory plan counts).
    pub fn pool_blocks(&self, seats: usize, longest: usize) -> usize {
        match self.kv_blocks {
            0 => seats * longest.div_ceil(self.block_size.max(1)),
            n => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: GenerationOptions,
    }

    #[test]
    fn flags_and_keys_share_their_defaults_and_checks() {
        let cli = Cli::parse_from(["x"]);
        assert_eq!(cli.options, GenerationOptions::default());
        let cli = Cli::parse_from(["x", "--schedule", "static", "--kv-blocks", "9", "--no-prefix-cache"]);
        assert_eq!(
            (cli.options.schedule, cli.options.kv_blocks, cli.options.prefix_cache),
            (Schedule::Static, 9, false)
        );
        let toml: GenerationOptions = toml::from_str("schedule = \"static\"\nblock_size = 32").unwrap();
        assert_eq!((toml.schedule, toml.block_size, toml.max_batch_tokens), (Schedule::Static, 32, 2048));
        assert!(toml::from_str::<GenerationOptions>("block = 3").is_err());
        let zero = GenerationOptions { block_size: 0, ..Default::default() };
        assert_eq!(zero.validate("--").unwrap_err(), "--block-size = 0 must be >= 1");
        assert_eq!(
            zero.validate("validation.generation.").unwrap_err(),
            "validation.generation.block_size = 0 must be >= 1"
        );
        assert_eq!(GenerationOptions::default().pool_blocks(4, 33), 12);
    }
}
