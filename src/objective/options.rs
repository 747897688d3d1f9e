//! The `[objective]` section's types: the objective's name, one struct per objective holding exactly
//! the options it takes, and the options every objective takes.
//!
//! Options whose default depends on the objective are `Option`s: `None` means "the objective's default"
//! (see the accessors of [`super::ObjectiveConfig`]), so an option that was set can be told from one that
//! was not. `bias` and `beta` are plain numbers whose default 0 means "off". Adding an option to one
//! objective is adding a field to its struct (and an accessor with its default when it has one).

use serde::de::{self, DeserializeOwned, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use super::{KlEstimator, LossAgg};

/// The objectives, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectiveName {
    OffGrpo,
    Grpo,
    Gspo,
    Rec,
    Opmd,
    Asymre,
    RedDrop,
    RedWeight,
    Oapl,
    Sft,
    Cispo,
}

impl ObjectiveName {
    /// Every objective.
    pub const ALL: [ObjectiveName; 11] = [
        ObjectiveName::OffGrpo,
        ObjectiveName::Grpo,
        ObjectiveName::Gspo,
        ObjectiveName::Rec,
        ObjectiveName::Opmd,
        ObjectiveName::Asymre,
        ObjectiveName::RedDrop,
        ObjectiveName::RedWeight,
        ObjectiveName::Oapl,
        ObjectiveName::Sft,
        ObjectiveName::Cispo,
    ];

    /// The name as written in configs.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectiveName::OffGrpo => "off_grpo",
            ObjectiveName::Grpo => "grpo",
            ObjectiveName::Gspo => "gspo",
            ObjectiveName::Rec => "rec",
            ObjectiveName::Opmd => "opmd",
            ObjectiveName::Asymre => "asymre",
            ObjectiveName::RedDrop => "red_drop",
            ObjectiveName::RedWeight => "red_weight",
            ObjectiveName::Oapl => "oapl",
            ObjectiveName::Sft => "sft",
            ObjectiveName::Cispo => "cispo",
        }
    }

    /// The options of this objective's own struct (besides `name` and the [`CommonOptions`]).
    pub fn options(self) -> &'static [&'static str] {
        match self {
            ObjectiveName::OffGrpo | ObjectiveName::Grpo | ObjectiveName::Gspo => fields::<PpoOptions>(),
            ObjectiveName::Rec => fields::<RecOptions>(),
            ObjectiveName::Cispo => fields::<CispoOptions>(),
            ObjectiveName::Opmd => fields::<OpmdOptions>(),
            ObjectiveName::Asymre => fields::<AsymReOptions>(),
            ObjectiveName::RedDrop => fields::<RedDropOptions>(),
            ObjectiveName::RedWeight => fields::<RedWeightOptions>(),
            ObjectiveName::Oapl => fields::<OaplOptions>(),
            ObjectiveName::Sft => fields::<SftOptions>(),
        }
    }
}

/// The field names serde's derive gives the struct `T`: what it passes to `deserialize_struct`.
pub(super) fn fields<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Fields<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Fields<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("fields read"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
            unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }
    let mut out: &'static [&'static str] = &[];
    let _ = T::deserialize(Fields(&mut out));
    out
}

/// Where an objective's behaviour ("old policy", anchor) log-probs come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Anchor {
    /// The policy that wrote each answer (alias `behaviour`): for teacher answers the teacher's log-probs
    /// when the data has them, else probability 1 (log-prob 0), as the seed assumes; for answers sampled
    /// with `[rollout]`, the sampling policy's log-probs recorded at sampling.
    #[serde(alias = "behaviour")]
    Teacher,
    /// The policy itself at the start of the step (detached): the on-policy "pi_old".
    Step,
    /// The frozen reference model (`model.reference`, default the initial weights), loaded even with
    /// beta = 0.
    Reference,
    /// A snapshot of the policy refreshed every `anchor_every` steps: the policy at step
    /// floor(step / K) * K (OAPL's lagged inference policy, seed 004's sync_interval).
    Snapshot,
}

/// Token-level ratios pi / pi_old, or GSPO's sequence-level s_i = exp(mean_t log(pi / pi_old)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RatioLevel {
    Token,
    Sequence,
}

/// How advantages are scaled (TRL's `scale_rewards`): the centred rewards r_i - mean(group) are divided
/// by the group's standard deviation, by the standard deviation of every reward of the step's batch, or
/// not at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleRewards {
    Group,
    Batch,
    None,
}

/// REC's clipping masks (seed 004, eq. 8, 18, 19-21).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClipMode {
    /// A > 0 while r <= 1 + eps_high; A < 0 while r >= 1 - eps_low (PPO's gradient mask).
    OneSide,
    /// 1 - eps_low <= r <= 1 + eps_high, whatever the sign of A.
    TwoSide,
    /// two-side, plus A > 0 with r <= 1 - eps_low_outer and A < 0 with r >= 1 + eps_high_outer.
    Ring,
}

/// Which answers `sft` trains on. Seed 000 describes its SFT baseline both as "only positive samples" and
/// as "all training data are treated as positive".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SftAnswers {
    /// The answers that agree with the majority (reward > 0).
    Positive,
    /// Every teacher answer.
    All,
}

/// The options of `off_grpo`, `grpo` and `gspo` (PPO's clipped surrogate).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoOptions {
    /// Clip range below 1 (eps_low). Default 0.2; gspo 6e-4 (seed 004, B.7).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<f32>,
    /// Clip range above 1. Default eps; gspo 8e-4 when eps is not set either.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps_high: Option<f32>,
    /// The all-positive bias b (seed 000). 0: off.
    pub bias: f32,
    /// Divide advantages by the group's standard deviation. Default true for off_grpo and grpo, false for
    /// gspo (r_i - mean(r)). `scale_rewards` says the same and more.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub std_normalize: Option<bool>,
    /// TRL's `scale_rewards`: "group" (std_normalize = true), "batch" (the std of the step's rewards,
    /// the group mean still subtracted) or "none" (std_normalize = false). Not with `std_normalize`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_rewards: Option<ScaleRewards>,
    /// Dual-clip PPO (verl): for A < 0 the token loss is also bounded by -clip_ratio_c * A. Default off;
    /// `dual_clip = true` turns it on with clip_ratio_c = 3, setting `clip_ratio_c` turns it on too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dual_clip: Option<bool>,
    /// The dual-clip bound (verl's `clip_ratio_c`, > 1), default 3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_ratio_c: Option<f32>,
    /// KL weight to the frozen reference; 0: no KL term (and no reference unless the anchor is it).
    pub beta: f32,
    /// Default k3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_estimator: Option<KlEstimator>,
    /// Default token; gspo: sequence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_level: Option<RatioLevel>,
    /// Behaviour log-probs. Default teacher (off_grpo), step (grpo, gspo).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor: Option<Anchor>,
    /// Steps between snapshot refreshes (anchor = snapshot), default 50 (seed 003's L for math).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_every: Option<usize>,
}

/// The options of `rec` (seed 004's REINFORCE with clipping masks).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecOptions {
    /// Clip range below 1 (eps_low), default 0.2.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<f32>,
    /// Clip range above 1, default eps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps_high: Option<f32>,
    /// The all-positive bias b (seed 000). 0: off.
    pub bias: f32,
    /// Divide advantages by the group's standard deviation, default false (r_i - mean(r)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub std_normalize: Option<bool>,
    /// TRL's `scale_rewards` (see [`PpoOptions::scale_rewards`]). Not with `std_normalize`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_rewards: Option<ScaleRewards>,
    /// KL weight to the frozen reference; 0: no KL term.
    pub beta: f32,
    /// Default k3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_estimator: Option<KlEstimator>,
    /// Default token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_level: Option<RatioLevel>,
    /// Default one-side.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_mode: Option<ClipMode>,
    /// Multiply by the ratio (IS) or not (NOIS, default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub importance_weight: Option<bool>,
    /// Ring: outer bound below 1 (eps'_low >= eps), default 0.6.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps_low_outer: Option<f32>,
    /// Ring: outer bound above 1 (eps'_high >= eps_high), default 2.0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps_high_outer: Option<f32>,
    /// Behaviour log-probs, default teacher.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor: Option<Anchor>,
    /// Steps between snapshot refreshes (anchor = snapshot), default 50.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_every: Option<usize>,
}

/// The options of `cispo` (MiniMax-M1's REINFORCE weighted by the clipped ratio).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CispoOptions {
    /// Clip range below 1 (eps_low), default 0.2.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<f32>,
    /// Clip range above 1, default eps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps_high: Option<f32>,
    /// The all-positive bias b (seed 000). 0: off.
    pub bias: f32,
    /// Divide advantages by the group's standard deviation, default true.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub std_normalize: Option<bool>,
    /// TRL's `scale_rewards` (see [`PpoOptions::scale_rewards`]). Not with `std_normalize`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_rewards: Option<ScaleRewards>,
    /// KL weight to the frozen reference; 0: no KL term.
    pub beta: f32,
    /// Default k3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_estimator: Option<KlEstimator>,
    /// Default token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_level: Option<RatioLevel>,
    /// Behaviour log-probs, default step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor: Option<Anchor>,
    /// Steps between snapshot refreshes (anchor = snapshot), default 50.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_every: Option<usize>,
}

/// The options of `opmd` (REINFORCE plus a squared sequence log-ratio).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OpmdOptions {
    /// Divide advantages by the group's standard deviation, default false (r_i - mean(r)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub std_normalize: Option<bool>,
    /// TRL's `scale_rewards` (see [`PpoOptions::scale_rewards`]). Not with `std_normalize`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_rewards: Option<ScaleRewards>,
    /// KL weight to the frozen reference; 0: no KL term.
    pub beta: f32,
    /// Default k3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_estimator: Option<KlEstimator>,
    /// Weight of the squared sequence log-ratio, default 0.1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tau: Option<f32>,
    /// Behaviour log-probs, default step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor: Option<Anchor>,
    /// Steps between snapshot refreshes (anchor = snapshot), default 50.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_every: Option<usize>,
}

/// The options of `asymre` (REINFORCE with a lowered baseline).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AsymReOptions {
    /// KL weight to the frozen reference; 0: no KL term.
    pub beta: f32,
    /// Default k3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_estimator: Option<KlEstimator>,
    /// The baseline is mean(r) - baseline_shift, default 0.1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_shift: Option<f32>,
}

/// The options of `red_drop` (REINFORCE with the excess negatives dropped).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedDropOptions {
    /// Divide advantages by the kept answers' standard deviation, default false.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub std_normalize: Option<bool>,
    /// TRL's `scale_rewards` (see [`PpoOptions::scale_rewards`]). Not with `std_normalize`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_rewards: Option<ScaleRewards>,
    /// KL weight to the frozen reference; 0: no KL term.
    pub beta: f32,
    /// Default k3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_estimator: Option<KlEstimator>,
}

/// The options of `red_weight` (REINFORCE weighted by exp(A / T)).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedWeightOptions {
    /// Divide advantages by the group's standard deviation, default false.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub std_normalize: Option<bool>,
    /// TRL's `scale_rewards` (see [`PpoOptions::scale_rewards`]). Not with `std_normalize`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_rewards: Option<ScaleRewards>,
    /// KL weight to the frozen reference; 0: no KL term.
    pub beta: f32,
    /// Default k3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_estimator: Option<KlEstimator>,
    /// w_i = exp(A_i / T), default T = 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
}

/// The options of `oapl` (squared regression onto the optimal advantage; no reference KL).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OaplOptions {
    /// V* = beta1 log mean exp(r / beta1), default 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta1: Option<f32>,
    /// The log-ratio scale of the regression, default 1e-3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta2: Option<f32>,
    /// Behaviour log-probs, default snapshot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor: Option<Anchor>,
    /// Steps between snapshot refreshes (anchor = snapshot), default 50 (seed 003's L for math).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_every: Option<usize>,
}

/// The options of `sft` (log-likelihood of the trained answers).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftOptions {
    /// KL weight to the frozen reference; 0: no KL term.
    pub beta: f32,
    /// Default k3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_estimator: Option<KlEstimator>,
    /// The answers trained on, the positive ones (default) or all of them (seed 000 says both).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sft_answers: Option<SftAnswers>,
}

/// The objective, chosen by `name`, with its own options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case")]
pub enum ObjectiveKind {
    OffGrpo(PpoOptions),
    Grpo(PpoOptions),
    Gspo(PpoOptions),
    Rec(RecOptions),
    Opmd(OpmdOptions),
    Asymre(AsymReOptions),
    RedDrop(RedDropOptions),
    RedWeight(RedWeightOptions),
    Oapl(OaplOptions),
    Sft(SftOptions),
    Cispo(CispoOptions),
}

impl ObjectiveKind {
    /// The objective `name` with every option at its default.
    pub fn of(name: ObjectiveName) -> Self {
        match name {
            ObjectiveName::OffGrpo => ObjectiveKind::OffGrpo(PpoOptions::default()),
            ObjectiveName::Grpo => ObjectiveKind::Grpo(PpoOptions::default()),
            ObjectiveName::Gspo => ObjectiveKind::Gspo(PpoOptions::default()),
            ObjectiveName::Rec => ObjectiveKind::Rec(RecOptions::default()),
            ObjectiveName::Opmd => ObjectiveKind::Opmd(OpmdOptions::default()),
            ObjectiveName::Asymre => ObjectiveKind::Asymre(AsymReOptions::default()),
            ObjectiveName::RedDrop => ObjectiveKind::RedDrop(RedDropOptions::default()),
            ObjectiveName::RedWeight => ObjectiveKind::RedWeight(RedWeightOptions::default()),
            ObjectiveName::Oapl => ObjectiveKind::Oapl(OaplOptions::default()),
            ObjectiveName::Sft => ObjectiveKind::Sft(SftOptions::default()),
            ObjectiveName::Cispo => ObjectiveKind::Cispo(CispoOptions::default()),
        }
    }

    pub fn name(&self) -> ObjectiveName {
        match self {
            ObjectiveKind::OffGrpo(_) => ObjectiveName::OffGrpo,
            ObjectiveKind::Grpo(_) => ObjectiveName::Grpo,
            ObjectiveKind::Gspo(_) => ObjectiveName::Gspo,
            ObjectiveKind::Rec(_) => ObjectiveName::Rec,
            ObjectiveKind::Opmd(_) => ObjectiveName::Opmd,
            ObjectiveKind::Asymre(_) => ObjectiveName::Asymre,
            ObjectiveKind::RedDrop(_) => ObjectiveName::RedDrop,
            ObjectiveKind::RedWeight(_) => ObjectiveName::RedWeight,
            ObjectiveKind::Oapl(_) => ObjectiveName::Oapl,
            ObjectiveKind::Sft(_) => ObjectiveName::Sft,
            ObjectiveKind::Cispo(_) => ObjectiveName::Cispo,
        }
    }
}

/// The options every objective takes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CommonOptions {
    /// The constant length of `loss_agg = "seq-mean-token-sum-norm"` (Dr. GRPO; TRL's
    /// max_completion_length, verl's loss_scale_factor). Default the response-token limit of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale_factor: Option<usize>,
    /// Leave the answers cut at the token limit out of the loss (TRL's mask_truncated_completions): teacher
    /// answers truncated by data.overlong = "truncate", rollouts that hit rollout.max_new_tokens. They
    /// still count in their group's advantages. Default false.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_truncated: Option<bool>,
    /// Default seq-mean-token-mean (off_grpo, grpo, gspo, sft), token-mean (rec, opmd, asymre, red_*,
    /// cispo: seed 004 normalises by the number of response tokens), seq-mean-token-sum (oapl: a mean
    /// over sequences of the squared error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_agg: Option<LossAgg>,
    /// Leave the groups whose rewards all agree (standard deviation 0) out of the loss, KL term included
    /// (seed 002). Default false; not with `bias`, which exists for exactly those groups.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_zero_std: Option<bool>,
    /// Entropy bonus (verl's `actor.entropy_coeff`): the loss is the objective's minus entropy_coeff
    /// times the policy's token entropy aggregated as the objective aggregates its tokens (loss_agg).
    /// 0: off.
    pub entropy_coeff: f32,
    /// Only each answer's tokens whose entropy is at or above its (1 - q) quantile enter the policy
    /// loss (TRL's `top_entropy_quantile`, here per answer; the KL term keeps every token). In (0, 1];
    /// default 1: every token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_entropy_quantile: Option<f32>,
}
