//! The `[rollout]` section of a training config: how the policy's own answers are sampled, scored and
//! reused during training.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::correction::IsMode;
use super::server::Reload;
use crate::eval::benchmarks::BOXED_FIRST_TEMPLATE;
use crate::eval::{EngineKind, EngineOptions, SamplingParams};
use crate::reward::ExtractOptions;

/// How each step samples answers from the policy. Present in a training config, it turns the step into
/// sample -> score -> train; absent, the trainer learns from the teacher's answers only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutOptions {
    /// Answers per question in a group (G), sampled ones and teacher ones together.
    #[arg(long = "rollout-n", default_value_t = 8)]
    pub n: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long = "rollout-temperature", default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (1 disables).
    #[arg(long = "rollout-top-p", default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep the k most likely tokens (0 disables).
    #[arg(long = "rollout-top-k", default_value_t = 0)]
    pub top_k: usize,
    /// Generated tokens per answer at most.
    #[arg(long = "rollout-max-new-tokens", default_value_t = 1024)]
    pub max_new_tokens: usize,
    /// Sequences generated together.
    #[arg(long = "rollout-batch-size", default_value_t = 64)]
    pub batch_size: usize,
    /// The questions: a JSONL file of {"problem", "answer"} lines (the format of data/benchmarks), scored
    /// against their answers. Absent: the questions of the teacher data (data.inputs), scored against
    /// their label (the teacher's majority answer), or by majority vote over the group without one.
    #[arg(long = "rollout-questions")]
    pub questions: Option<PathBuf>,
    /// The user message of a question from `questions`: `{problem}` is replaced by the problem text.
    #[arg(long = "rollout-prompt-template", default_value = BOXED_FIRST_TEMPLATE)]
    pub prompt_template: String,
    /// Accept "the answer is X" and the last number when an answer has no \boxed{}.
    #[arg(long = "rollout-fallbacks")]
    pub fallbacks: bool,
    /// The sampling policy is a copy of the trained policy refreshed every this many steps: the policy
    /// at step floor(step / v) * v (1: on-policy, the policy itself).
    #[arg(long = "rollout-sync-every", default_value_t = 1)]
    pub sync_every: usize,
    /// Optimiser updates per batch of rollouts: the same answers and behaviour log-probs serve this many
    /// updates, so from the second one on the ratio moves away from 1 and the clip acts.
    #[arg(long = "rollout-updates-per-batch", default_value_t = 1)]
    pub updates_per_batch: usize,
    /// Teacher answers per group (LUFFY): each group has n - k sampled answers and the first k teacher
    /// answers of its question, trained with the teacher's log-probs (probability 1 without them).
    #[arg(long = "rollout-teacher-answers", default_value_t = 0)]
    pub teacher_answers: usize,
    /// Where the answers come from (`[rollout.server]`): `engine = "native"` (grpo's sampler) or
    /// `engine = "openai"` with the server's base_url, served_model, api_key_env, concurrency, ... (the
    /// keys of `grpo eval --engine openai`). The server must serve the policy's starting weights.
    #[serde(default)]
    #[command(flatten)]
    pub server: EngineOptions,
    /// openai engine: how the server loads the sampling weights saved at each refresh (every
    /// sync_every steps) to OUTPUT/rollout-policy: `sglang` (/update_weights_from_disk), `vllm`
    /// (/collective_rpc reload_weights, VLLM_SERVER_DEV_MODE=1, serving OUTPUT/rollout-policy), with
    /// `[model.lora]` `vllm-lora` or `sglang-lora` (the adapter loaded by /v1/load_lora_adapter or
    /// /load_lora_adapter under the name served_model; a whole-weight reload gets the merged model), or
    /// `none` (it cannot, e.g. llama.cpp: the starting weights stay the sampling policy for the whole run).
    #[arg(long = "rollout-reload", value_enum, default_value_t = Reload::None)]
    pub reload: Reload,
    /// DAPO's dynamic sampling (verl's `algorithm.filter_groups`): groups whose rewards all agree are
    /// dropped, and batches of new questions are sampled until the step has `train.batch_questions`
    /// groups or `max_num_gen_batches` batches were sampled.
    #[arg(long = "rollout-filter-groups")]
    pub filter_groups: bool,
    /// filter_groups: batches sampled per step at most (verl's `max_num_gen_batches`, here >= 1); when
    /// they are spent the step trains on the groups kept so far.
    #[arg(long = "rollout-max-num-gen-batches", default_value_t = 10)]
    pub max_num_gen_batches: usize,
    /// DAPO's soft overlong punishment (verl's `overlong_buffer.len`): an answer of L generated tokens gets
    /// the reward penalty min(0, -(L - (max_new_tokens - len)) / len * overlong_penalty_factor), linear
    /// over the last `len` tokens before rollout.max_new_tokens. 0: off.
    #[arg(long = "rollout-overlong-buffer-len", default_value_t = 0)]
    pub overlong_buffer_len: usize,
    /// The penalty at rollout.max_new_tokens (verl's `overlong_buffer.penalty_factor`).
    #[arg(long = "rollout-overlong-penalty-factor", default_value_t = 1.0)]
    pub overlong_penalty_factor: f32,
    /// Correct the mismatch between the sampler's log-probs and grpo's forward of the same weights
    /// (TRL's `vllm_importance_sampling_correction`): each sampled token's policy loss is weighted by the
    /// ratio exp(log p_grpo - log p_sampler), truncated or masked at `importance_sampling_cap` (see
    /// [`super::correction`]). The server is asked for its token log-probs (OpenAI `logprobs`).
    #[serde(alias = "vllm_importance_sampling_correction")]
    #[arg(long = "rollout-importance-sampling-correction")]
    pub importance_sampling_correction: bool,
    /// TRL's `vllm_importance_sampling_mode`: token_truncate (TIS), token_mask (MIS), sequence_truncate,
    /// sequence_mask.
    #[serde(alias = "vllm_importance_sampling_mode")]
    #[arg(long = "rollout-importance-sampling-mode", value_enum, default_value_t = IsMode::TokenTruncate)]
    pub importance_sampling_mode: IsMode,
    /// The cap C (TRL's `vllm_importance_sampling_cap`, verl's `rollout_is_threshold`), >= 1.
    #[serde(alias = "vllm_importance_sampling_cap")]
    #[arg(long = "rollout-importance-sampling-cap", default_value_t = 3.0)]
    pub importance_sampling_cap: f32,
    /// Bounded staleness (TRL's `max_staleness`, verl's `staleness_threshold`): the answers a step t trains
    /// on may come from any sampling policy of steps t-k..t, so that generation overlaps training (on
    /// `generation_ranks` or a `[rollout.server]`). Each answer carries the policy version that wrote it;
    /// older ones are dropped and counted. Composes with sync_every: an answer may then be up to
    /// k + sync_every - 1 updates old. 0: generate, then train, in turn.
    #[arg(long = "rollout-max-staleness", default_value_t = 0)]
    pub max_staleness: usize,
    /// In a job of several ranks (mpirun, srun), the last this many ranks generate the rollouts with the
    /// native engine while the others train, data parallel among themselves; after each refresh the
    /// trainers send the new weights (the adapters alone with LoRA) and the answers travel back with their
    /// versions. 0: every rank samples its share, then trains.
    #[arg(long = "rollout-generation-ranks", default_value_t = 0)]
    pub generation_ranks: usize,
    /// How the native engine schedules the answers (`[rollout.generation]`; batch_size sequences at a time).
    #[arg(skip)]
    pub generation: crate::generate::GenerationOptions,
}

impl Default for RolloutOptions {
    fn default() -> Self {
        Self {
            n: 8,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 1024,
            batch_size: 64,
            questions: None,
            prompt_template: BOXED_FIRST_TEMPLATE.into(),
            fallbacks: false,
            sync_every: 1,
            updates_per_batch: 1,
            teacher_answers: 0,
            server: EngineOptions::default(),
            reload: Reload::None,
            filter_groups: false,
            max_num_gen_batches: 10,
            overlong_buffer_len: 0,
            overlong_penalty_factor: 1.0,
            importance_sampling_correction: false,
            importance_sampling_mode: IsMode::TokenTruncate,
            importance_sampling_cap: 3.0,
            max_staleness: 0,
            generation_ranks: 0,
            generation: crate::generate::GenerationOptions::default(),
        }
    }
}

impl RolloutOptions {
    /// What is allowed but almost certainly not meant, as messages for the run's log.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self.temperature == 0.0 && self.sampled() > 1 {
            w.push(format!(
                "rollout.temperature = 0 samples greedily: the {} sampled answers of a question are identical, so \
                 their rewards agree, their group-relative advantages are 0 and they give no gradient",
                self.sampled()
            ));
        }
        w
    }

    /// Answers sampled per question.
    pub fn sampled(&self) -> usize {
        self.n.saturating_sub(self.teacher_answers)
    }

    /// The sampling settings of step `step` of a run seeded `seed`: each step draws from its own streams.
    pub fn sampling(&self, seed: u64, step: usize) -> SamplingParams {
        let mut z = seed ^ (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_new_tokens: self.max_new_tokens,
            seed: z ^ (z >> 31),
        }
    }

    /// Whether the answers come from an OpenAI-compatible server.
    pub fn uses_server(&self) -> bool {
        self.server.engine == EngineKind::Openai
    }

    /// Steps between refreshes of the sampling policy: `sync_every`, or never after the start when the
    /// server cannot reload.
    pub fn refresh_every(&self) -> usize {
        if self.uses_server() && self.reload == Reload::None {
            usize::MAX
        } else {
            self.sync_every
        }
    }

    pub fn extract(&self) -> ExtractOptions {
        ExtractOptions { fallbacks: self.fallbacks }
    }

    /// DAPO's soft overlong penalty (<= 0) of an answer of `generated` tokens.
    pub fn overlong_penalty(&self, generated: usize) -> f32 {
        let buffer = self.overlong_buffer_len;
        if buffer == 0 {
            return 0.0;
        }
        let expected = self.max_new_tokens.saturating_sub(buffer) as f64;
        let exceed = generated as f64 - expected;
        (-exceed / buffer as f64 * self.overlong_penalty_factor as f64).min(0.0) as f32
    }

    /// Check ranges, naming each value as `rollout.KEY`.
    pub fn validate(&self) -> Result<(), String> {
        for (key, v) in [
            ("n", self.n),
            ("max_new_tokens", self.max_new_tokens),
            ("batch_size", self.batch_size),
            ("sync_every", self.sync_every),
            ("updates_per_batch", self.updates_per_batch),
            ("max_num_gen_batches", self.max_num_gen_batches),
        ] {
            if v == 0 {
                return Err(format!("rollout.{key} = 0 must be >= 1"));
            }
        }
        self.generation.validate("rollout.generation.")?;
        if self.n < 2 {
            return Err(format!("rollout.n = {} must be >= 2: a group needs two answers to compare", self.n));
        }
        self.sampling(0, 0).validate(|name| format!("rollout.{name}"))?;
        if self.overlong_buffer_len >= self.max_new_tokens {
            return Err(format!(
                "rollout.overlong_buffer_len = {} must be < rollout.max_new_tokens = {}",
                self.overlong_buffer_len, self.max_new_tokens
            ));
        }
        if !(self.overlong_penalty_factor.is_finite() && self.overlong_penalty_factor >= 0.0) {
            return Err(format!("rollout.overlong_penalty_factor = {} must be >= 0", self.overlong_penalty_factor));
        }
        if !(self.importance_sampling_cap.is_finite() && self.importance_sampling_cap >= 1.0) {
            return Err(format!(
                "rollout.importance_sampling_cap = {} must be >= 1 (a ratio of 1, no mismatch, keeps its weight)",
                self.importance_sampling_cap
            ));
        }
        if self.teacher_answers >= self.n {
            return Err(format!(
                "rollout.teacher_answers = {} must be < rollout.n = {}: a group needs at least one sampled answer",
                self.teacher_answers, self.n
            ));
        }
        if self.teacher_answers > 0 && self.questions.is_some() {
            return Err("rollout.teacher_answers needs teacher data: rollout.questions has no teacher answers".into());
        }
        if self.questions.is_some() && !self.prompt_template.contains("{problem}") {
            return Err(format!("rollout.prompt_template = `{}` has no {{problem}} placeholder", self.prompt_template));
        }
        self.validate_server()?;
        self.validate_overlap()
    }

    /// `max_staleness` and `generation_ranks`: the overlap needs something that generates while the trainer
    /// trains, and a generator that keeps up with the weights.
    fn validate_overlap(&self) -> Result<(), String> {
        if self.max_staleness > 0 && self.generation_ranks == 0 && !self.uses_server() {
            return Err(format!(
                "rollout.max_staleness = {} overlaps generation with training, which needs rollout.generation_ranks \
                 >= 1 (in a job of several ranks) or a [rollout.server]; one process with the native engine \
                 generates and trains in turn (leave max_staleness out)",
                self.max_staleness
            ));
        }
        if self.max_staleness > 0 && self.uses_server() && self.reload == Reload::None {
            return Err(format!(
                "rollout.max_staleness = {} with rollout.reload = \"none\": a server that cannot reload its \
                 weights keeps the starting policy, so its answers grow older than any staleness bound; set \
                 rollout.reload to the server's reload (sglang, vllm, vllm-lora, sglang-lora)",
                self.max_staleness
            ));
        }
        if self.generation_ranks > 0 && self.uses_server() {
            return Err(format!(
                "rollout.generation_ranks = {} with a [rollout.server]: the answers come either from generation \
                 ranks (the native engine) or from the server; leave one out",
                self.generation_ranks
            ));
        }
        if self.generation_ranks > 0 && self.filter_groups {
            return Err(format!(
                "rollout.generation_ranks = {} with rollout.filter_groups: dynamic sampling draws its refills \
                 from the groups just scored, which the generation ranks cannot look ahead to; leave one out",
                self.generation_ranks
            ));
        }
        Ok(())
    }

    /// `[rollout.server]` and `reload`: a reload needs a server, a server that cannot reload keeps the
    /// starting weights (so a sync_every would be a lie).
    fn validate_server(&self) -> Result<(), String> {
        self.server.validate("rollout.server.")?;
        if !self.uses_server() && self.reload != Reload::None {
            return Err("rollout.reload is only used with rollout.server.engine = \"openai\"".into());
        }
        if self.uses_server() && self.reload == Reload::None && self.sync_every != 1 {
            return Err(format!(
                "rollout.sync_every = {} with rollout.reload = \"none\": a server that cannot reload serves the \
                 starting weights for the whole run; set rollout.reload = \"sglang\" or \"vllm\", or leave \
                 sync_every out",
                self.sync_every
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: RolloutOptions,
    }

    #[test]
    fn flags_and_keys_have_the_same_defaults() {
        assert_eq!(Cli::parse_from(["x"]).options, RolloutOptions::default());
        let empty: RolloutOptions = toml::from_str("").unwrap();
        assert_eq!(empty, RolloutOptions::default());
        assert_eq!(RolloutOptions::default().validate(), Ok(()));
    }

    #[test]
    fn out_of_range_values_are_named() {
        let bad = |t: &str| toml::from_str::<RolloutOptions>(t).unwrap().validate().unwrap_err();
        assert!(bad("n = 1").starts_with("rollout.n = 1"));
        assert!(bad("sync_every = 0").starts_with("rollout.sync_every = 0"));
        assert!(bad("updates_per_batch = 0").starts_with("rollout.updates_per_batch"));
        assert!(bad("temperature = nan").starts_with("rollout.temperature"));
        assert!(bad("top_p = 0").starts_with("rollout.top_p"));
        assert!(bad("n = 4\nteacher_answers = 4").starts_with("rollout.teacher_answers = 4"));
        assert!(bad("teacher_answers = 1\nquestions = \"q.jsonl\"").contains("needs teacher data"));
        assert!(bad("questions = \"q.jsonl\"\nprompt_template = \"x\"").contains("placeholder"));
        assert!(bad("[server]\nengine = \"openai\"").starts_with("rollout.server.base_url is required"));
        assert!(bad("reload = \"sglang\"").starts_with("rollout.reload is only used"));
        let server = "[server]\nengine = \"openai\"\nbase_url = \"http://h/v1\"\nserved_model = \"m\"";
        assert!(bad(&format!("sync_every = 4\n{server}")).contains("cannot reload"));
        let ok = |t: &str| toml::from_str::<RolloutOptions>(t).unwrap();
        let none = ok(server);
        assert_eq!((none.validate(), none.refresh_every()), (Ok(()), usize::MAX));
        let sglang = ok(&format!("sync_every = 4\nreload = \"sglang\"\n{server}"));
        assert_eq!((sglang.validate(), sglang.refresh_every()), (Ok(()), 4));
    }

    #[test]
    fn greedy_rollouts_are_warned_about() {
        let ok = |t: &str| toml::from_str::<RolloutOptions>(t).unwrap();
        assert!(RolloutOptions::default().warnings().is_empty());
        let w = ok("temperature = 0").warnings();
        assert!(w.len() == 1 && w[0].starts_with("rollout.temperature = 0") && w[0].contains("no gradient"), "{w:?}");
        // One sampled answer beside teacher answers: greedy is a choice, not a mistake.
        assert!(ok("temperature = 0\nn = 4\nteacher_answers = 3").warnings().is_empty());
    }

    #[test]
    fn the_overlong_penalty_is_linear_over_the_buffer() {
        let o = RolloutOptions {
            max_new_tokens: 100,
            overlong_buffer_len: 20,
            overlong_penalty_factor: 0.5,
            ..Default::default()
        };
        assert_eq!(o.validate(), Ok(()));
        // No penalty up to 80 tokens, then -0.5 * (L - 80) / 20: -0.25 at 90, -0.5 at the maximum.
        for (len, want) in [(0, 0.0), (80, 0.0), (81, -0.025), (90, -0.25), (100, -0.5)] {
            assert!((o.overlong_penalty(len) - want).abs() < 1e-6, "{len}: {}", o.overlong_penalty(len));
        }
        assert_eq!(RolloutOptions::default().overlong_penalty(1024), 0.0, "off by default");
        let bad = |t: &str| toml::from_str::<RolloutOptions>(t).unwrap().validate().unwrap_err();
        assert!(bad("max_new_tokens = 10\noverlong_buffer_len = 10").starts_with("rollout.overlong_buffer_len"));
        assert!(bad("overlong_penalty_factor = -1").starts_with("rollout.overlong_penalty_factor"));
        assert!(bad("max_num_gen_batches = 0").starts_with("rollout.max_num_gen_batches"));
    }

    #[test]
    fn importance_sampling_options_take_trls_names_and_a_cap_of_at_least_one() {
        let trl: RolloutOptions = toml::from_str(
            "vllm_importance_sampling_correction = true\nvllm_importance_sampling_mode = \"sequence_mask\"\n\
             vllm_importance_sampling_cap = 2.5",
        )
        .unwrap();
        assert!(trl.importance_sampling_correction);
        assert_eq!((trl.importance_sampling_mode, trl.importance_sampling_cap), (IsMode::SequenceMask, 2.5));
        let cli = Cli::parse_from(["x", "--rollout-importance-sampling-mode", "token_mask"]).options;
        assert_eq!(cli.importance_sampling_mode, IsMode::TokenMask);
        let bad = toml::from_str::<RolloutOptions>("importance_sampling_cap = 0.5").unwrap().validate().unwrap_err();
        assert!(bad.starts_with("rollout.importance_sampling_cap = 0.5"), "{bad}");
    }

    #[test]
    fn each_step_samples_with_its_own_seed() {
        let o = RolloutOptions::default();
        assert_eq!(o.sampling(3, 5), o.sampling(3, 5));
        assert_ne!(o.sampling(3, 5).seed, o.sampling(3, 6).seed);
        assert_ne!(o.sampling(3, 5).seed, o.sampling(4, 5).seed);
    }
}
