//! The `[objective]` section: the objective's name, its options with per-objective defaults, and the
//! validation that rejects an option the chosen objective does not take.
//!
//! Options whose default depends on the objective are `Option`s: `None` means "the objective's default",
//! so an option that was set can be told from one that was not. `bias` and `beta` are plain numbers whose
//! default 0 means "off".

use serde::{Deserialize, Serialize};

use super::clipped::Clipped;
use super::mask::MaskZeroStd;
use super::oapl::Oapl;
use super::reinforce::{AsymRe, Opmd, RedDrop, RedWeight, Sft};
use super::{AdvantageConfig, GroupKey, KlEstimator, LossAgg, Objective};

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

    /// The options (besides `name`) this objective takes.
    fn options(self) -> &'static [&'static str] {
        const KL: [&str; 2] = ["beta", "kl_estimator"];
        match self {
            ObjectiveName::OffGrpo | ObjectiveName::Grpo | ObjectiveName::Gspo => &[
                "eps",
                "eps_high",
                "dual_clip",
                "clip_ratio_c",
                "bias",
                "std_normalize",
                "scale_rewards",
                "ratio_level",
                "anchor",
                "anchor_every",
                "loss_agg",
                KL[0],
                KL[1],
            ],
            ObjectiveName::Rec => &[
                "eps",
                "eps_high",
                "clip_mode",
                "importance_weight",
                "eps_low_outer",
                "eps_high_outer",
                "bias",
                "std_normalize",
                "scale_rewards",
                "ratio_level",
                "anchor",
                "anchor_every",
                "loss_agg",
                KL[0],
                KL[1],
            ],
            ObjectiveName::Cispo => &[
                "eps",
                "eps_high",
                "bias",
                "std_normalize",
                "scale_rewards",
                "ratio_level",
                "anchor",
                "anchor_every",
                "loss_agg",
                KL[0],
                KL[1],
            ],
            ObjectiveName::Opmd => {
                &["tau", "std_normalize", "scale_rewards", "anchor", "anchor_every", "loss_agg", KL[0], KL[1]]
            }
            ObjectiveName::Asymre => &["baseline_shift", "loss_agg", KL[0], KL[1]],
            ObjectiveName::RedDrop => &["std_normalize", "scale_rewards", "loss_agg", KL[0], KL[1]],
            ObjectiveName::RedWeight => &["temperature", "std_normalize", "scale_rewards", "loss_agg", KL[0], KL[1]],
            ObjectiveName::Oapl => &["beta1", "beta2", "anchor", "anchor_every", "loss_agg"],
            ObjectiveName::Sft => &["sft_answers", "loss_agg", KL[0], KL[1]],
        }
    }
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

/// The `[objective]` section of the training config. `name` picks the objective; options that do not
/// apply to it are rejected by [`ObjectiveConfig::validate`]. `None` means the objective's default (see
/// each accessor).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ObjectiveConfig {
    pub name: ObjectiveName,
    /// Clip range below 1 (eps_low). Default 0.2; gspo 6e-4 (seed 004, B.7).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<f32>,
    /// Clip range above 1. Default eps; gspo 8e-4 when eps is not set either.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps_high: Option<f32>,
    /// The all-positive bias b (seed 000; clipped family). 0: off.
    pub bias: f32,
    /// Divide advantages by the group's standard deviation. Default true for off_grpo, grpo and cispo,
    /// false for the seed-004 objectives (they use r_i - mean(r)). `scale_rewards` says the same and more.
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
    /// The constant length of `loss_agg = "seq-mean-token-sum-norm"` (Dr. GRPO; TRL's
    /// max_completion_length, verl's loss_scale_factor). Default the response-token limit of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale_factor: Option<usize>,
    /// Leave the answers cut at the token limit out of the loss (TRL's mask_truncated_completions): teacher
    /// answers truncated by data.overlong = "truncate", rollouts that hit rollout.max_new_tokens. They
    /// still count in their group's advantages. Default false.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_truncated: Option<bool>,
    /// KL weight to the frozen reference; 0: no KL term (and no reference unless the anchor is it).
    pub beta: f32,
    /// Default k3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_estimator: Option<KlEstimator>,
    /// Default seq-mean-token-mean (off_grpo, grpo, gspo, sft), token-mean (rec, opmd, asymre, red_*:
    /// seed 004 normalises by the number of response tokens), seq-mean-token-sum (oapl: a mean over
    /// sequences of the squared error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_agg: Option<LossAgg>,
    /// Default token; gspo: sequence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_level: Option<RatioLevel>,
    /// rec: default one-side.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_mode: Option<ClipMode>,
    /// rec: multiply by the ratio (IS) or not (NOIS, default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub importance_weight: Option<bool>,
    /// rec ring: outer bound below 1 (eps'_low >= eps), default 0.6.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps_low_outer: Option<f32>,
    /// rec ring: outer bound above 1 (eps'_high >= eps_high), default 2.0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps_high_outer: Option<f32>,
    /// opmd: weight of the squared sequence log-ratio, default 0.1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tau: Option<f32>,
    /// asymre: the baseline is mean(r) - baseline_shift, default 0.1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_shift: Option<f32>,
    /// red_weight: w_i = exp(A_i / T), default T = 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// oapl: V* = beta1 log mean exp(r / beta1), default 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta1: Option<f32>,
    /// oapl: the log-ratio scale of the regression, default 1e-3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta2: Option<f32>,
    /// Behaviour log-probs. Default teacher (off_grpo, rec), step (grpo, gspo, opmd), snapshot (oapl).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor: Option<Anchor>,
    /// Steps between snapshot refreshes (anchor = snapshot), default 50 (seed 003's L for math).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_every: Option<usize>,
    /// sft: the answers trained on, the positive ones (default) or all of them (seed 000 says both).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sft_answers: Option<SftAnswers>,
    /// Leave the groups whose rewards all agree (standard deviation 0) out of the loss, KL term included
    /// (seed 002). Default false; not with `bias`, which exists for exactly those groups.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_zero_std: Option<bool>,
    /// Entropy bonus (verl's `actor.entropy_coeff`): the loss is the objective's minus entropy_coeff
    /// times the policy's token entropy aggregated as the objective aggregates its tokens (loss_agg).
    /// Any objective; 0: off.
    pub entropy_coeff: f32,
    /// Only each answer's tokens whose entropy is at or above its (1 - q) quantile enter the policy
    /// loss (TRL's `top_entropy_quantile`, here per answer; the KL term keeps every token). In (0, 1];
    /// default 1: every token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_entropy_quantile: Option<f32>,
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

impl Default for ObjectiveConfig {
    fn default() -> Self {
        Self {
            name: ObjectiveName::OffGrpo,
            eps: None,
            eps_high: None,
            bias: 0.0,
            std_normalize: None,
            scale_rewards: None,
            dual_clip: None,
            clip_ratio_c: None,
            loss_scale_factor: None,
            mask_truncated: None,
            beta: 0.0,
            kl_estimator: None,
            loss_agg: None,
            ratio_level: None,
            clip_mode: None,
            importance_weight: None,
            eps_low_outer: None,
            eps_high_outer: None,
            tau: None,
            baseline_shift: None,
            temperature: None,
            beta1: None,
            beta2: None,
            anchor: None,
            anchor_every: None,
            sft_answers: None,
            mask_zero_std: None,
            entropy_coeff: 0.0,
            top_entropy_quantile: None,
        }
    }
}

impl ObjectiveConfig {
    /// The options given (set to a non-default value for `bias` and `beta`), by name.
    fn given(&self) -> Vec<&'static str> {
        let set = [
            ("eps", self.eps.is_some()),
            ("eps_high", self.eps_high.is_some()),
            ("bias", self.bias != 0.0),
            ("std_normalize", self.std_normalize.is_some()),
            ("scale_rewards", self.scale_rewards.is_some()),
            ("dual_clip", self.dual_clip.is_some()),
            ("clip_ratio_c", self.clip_ratio_c.is_some()),
            ("beta", self.beta != 0.0),
            ("kl_estimator", self.kl_estimator.is_some()),
            ("loss_agg", self.loss_agg.is_some()),
            ("ratio_level", self.ratio_level.is_some()),
            ("clip_mode", self.clip_mode.is_some()),
            ("importance_weight", self.importance_weight.is_some()),
            ("eps_low_outer", self.eps_low_outer.is_some()),
            ("eps_high_outer", self.eps_high_outer.is_some()),
            ("tau", self.tau.is_some()),
            ("baseline_shift", self.baseline_shift.is_some()),
            ("temperature", self.temperature.is_some()),
            ("beta1", self.beta1.is_some()),
            ("beta2", self.beta2.is_some()),
            ("anchor", self.anchor.is_some()),
            ("anchor_every", self.anchor_every.is_some()),
            ("sft_answers", self.sft_answers.is_some()),
        ];
        set.iter().filter(|(_, s)| *s).map(|(k, _)| *k).collect()
    }

    /// Clip range below 1.
    pub fn eps_low(&self) -> f32 {
        self.eps.unwrap_or(if self.name == ObjectiveName::Gspo { 6e-4 } else { 0.2 })
    }

    /// Clip range above 1.
    pub fn eps_high(&self) -> f32 {
        match (self.eps_high, self.eps, self.name) {
            (Some(e), _, _) => e,
            (None, None, ObjectiveName::Gspo) => 8e-4,
            _ => self.eps_low(),
        }
    }

    pub fn std_normalize(&self) -> bool {
        self.scale_rewards() != ScaleRewards::None
    }

    /// How advantages are scaled: `scale_rewards`, else `std_normalize` (true: by the group's std).
    pub fn scale_rewards(&self) -> ScaleRewards {
        let by_group = || {
            self.std_normalize
                .unwrap_or(matches!(self.name, ObjectiveName::OffGrpo | ObjectiveName::Grpo | ObjectiveName::Cispo))
        };
        match self.scale_rewards {
            Some(s) => s,
            None if by_group() => ScaleRewards::Group,
            None => ScaleRewards::None,
        }
    }

    /// The dual-clip bound, when dual-clip is on.
    pub fn clip_ratio_c(&self) -> Option<f32> {
        match (self.dual_clip, self.clip_ratio_c) {
            (Some(false), _) | (None, None) => None,
            (_, c) => Some(c.unwrap_or(3.0)),
        }
    }

    /// The constant of seq-mean-token-sum-norm: `loss_scale_factor`, else `default` (the run's
    /// response-token limit).
    pub fn loss_scale_factor(&self, default: usize) -> usize {
        self.loss_scale_factor.unwrap_or(default)
    }

    /// Whether answers cut at the token limit are left out of the loss.
    pub fn mask_truncated(&self) -> bool {
        self.mask_truncated.unwrap_or(false)
    }

    pub fn kl_estimator(&self) -> KlEstimator {
        self.kl_estimator.unwrap_or(KlEstimator::K3)
    }

    pub fn loss_agg(&self) -> LossAgg {
        self.loss_agg.unwrap_or(match self.name {
            ObjectiveName::OffGrpo | ObjectiveName::Grpo | ObjectiveName::Gspo | ObjectiveName::Sft => {
                LossAgg::SeqMeanTokenMean
            }
            ObjectiveName::Oapl => LossAgg::SeqMeanTokenSum,
            _ => LossAgg::TokenMean,
        })
    }

    pub fn ratio_level(&self) -> RatioLevel {
        self.ratio_level.unwrap_or(if self.name == ObjectiveName::Gspo {
            RatioLevel::Sequence
        } else {
            RatioLevel::Token
        })
    }

    pub fn clip_mode(&self) -> ClipMode {
        self.clip_mode.unwrap_or(ClipMode::OneSide)
    }

    pub fn importance_weight(&self) -> bool {
        self.importance_weight.unwrap_or(false)
    }

    pub fn eps_low_outer(&self) -> f32 {
        self.eps_low_outer.unwrap_or(0.6)
    }

    pub fn eps_high_outer(&self) -> f32 {
        self.eps_high_outer.unwrap_or(2.0)
    }

    pub fn tau(&self) -> f32 {
        self.tau.unwrap_or(0.1)
    }

    pub fn baseline_shift(&self) -> f32 {
        self.baseline_shift.unwrap_or(0.1)
    }

    pub fn temperature(&self) -> f32 {
        self.temperature.unwrap_or(1.0)
    }

    pub fn beta1(&self) -> f32 {
        self.beta1.unwrap_or(1.0)
    }

    pub fn beta2(&self) -> f32 {
        self.beta2.unwrap_or(1e-3)
    }

    /// The behaviour log-probs the objective reads (`None`: it reads none).
    pub fn anchor(&self) -> Option<Anchor> {
        let default = match self.name {
            ObjectiveName::OffGrpo | ObjectiveName::Rec => Anchor::Teacher,
            ObjectiveName::Grpo | ObjectiveName::Gspo | ObjectiveName::Opmd | ObjectiveName::Cispo => Anchor::Step,
            ObjectiveName::Oapl => Anchor::Snapshot,
            _ => return None,
        };
        Some(self.anchor.unwrap_or(default))
    }

    /// Steps between refreshes of the anchor snapshot.
    pub fn anchor_every(&self) -> usize {
        self.anchor_every.unwrap_or(50)
    }

    /// Whether zero-variance groups are left out of the loss.
    pub fn mask_zero_std(&self) -> bool {
        self.mask_zero_std.unwrap_or(false)
    }

    pub fn sft_answers(&self) -> SftAnswers {
        self.sft_answers.unwrap_or(SftAnswers::Positive)
    }

    /// Check ranges and that every option set applies to the chosen objective.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let name = self.name.as_str();
        let allowed = self.name.options();
        if let Some(bad) = self.given().into_iter().find(|k| !allowed.contains(k)) {
            return Err(format!(
                "objective.{bad} does not apply to objective `{name}` (its options: {})",
                allowed.join(", ")
            ));
        }
        let in_unit = |v: f32| (0.0..1.0).contains(&v);
        let positive = |v: f32| v.is_finite() && v > 0.0;
        if !in_unit(self.eps_low()) {
            return Err(format!("objective.eps = {} must be in [0, 1)", self.eps_low()));
        }
        if !(self.eps_high() >= 0.0 && self.eps_high().is_finite()) {
            return Err(format!("objective.eps_high = {} must be >= 0", self.eps_high()));
        }
        if !(self.beta >= 0.0 && self.beta.is_finite()) {
            return Err(format!("objective.beta = {} must be >= 0", self.beta));
        }
        if !self.bias.is_finite() || !self.baseline_shift().is_finite() {
            return Err("objective.bias and objective.baseline_shift must be finite".into());
        }
        if (self.eps_low_outer.is_some() || self.eps_high_outer.is_some()) && self.clip_mode() != ClipMode::Ring {
            return Err("objective.eps_low_outer / eps_high_outer apply to clip_mode = \"ring\" only".into());
        }
        if self.clip_mode() == ClipMode::Ring {
            if !(in_unit(self.eps_low_outer()) && self.eps_low_outer() >= self.eps_low()) {
                return Err(format!("objective.eps_low_outer = {} must be in [eps, 1)", self.eps_low_outer()));
            }
            if !(self.eps_high_outer().is_finite() && self.eps_high_outer() >= self.eps_high()) {
                return Err(format!("objective.eps_high_outer = {} must be >= eps_high", self.eps_high_outer()));
            }
        }
        if !(self.tau() >= 0.0 && self.tau().is_finite()) {
            return Err(format!("objective.tau = {} must be >= 0", self.tau()));
        }
        for (key, v) in [("temperature", self.temperature()), ("beta1", self.beta1()), ("beta2", self.beta2())] {
            if !positive(v) {
                return Err(format!("objective.{key} = {v} must be > 0"));
            }
        }
        if self.anchor_every.is_some() && self.anchor() != Some(Anchor::Snapshot) {
            return Err("objective.anchor_every applies to anchor = \"snapshot\" only".into());
        }
        if self.mask_zero_std() && self.bias != 0.0 {
            return Err(format!(
                "objective.mask_zero_std = true with objective.bias = {}: the bias only acts on groups whose rewards \
                 all agree, which mask_zero_std leaves out",
                self.bias
            ));
        }
        if self.anchor_every() == 0 {
            return Err("objective.anchor_every must be >= 1".into());
        }
        self.validate_peer_options()
    }

    /// The entropy bonus's coefficient (0: off).
    pub fn entropy_coeff(&self) -> f32 {
        self.entropy_coeff
    }

    /// The fraction of each answer's highest-entropy tokens kept in the policy loss (1: all).
    pub fn top_entropy_quantile(&self) -> f32 {
        self.top_entropy_quantile.unwrap_or(1.0)
    }

    /// The options named after TRL's and verl's.
    fn validate_peer_options(&self) -> std::result::Result<(), String> {
        if !(self.entropy_coeff.is_finite() && self.entropy_coeff >= 0.0) {
            return Err(format!("objective.entropy_coeff = {} must be >= 0", self.entropy_coeff));
        }
        let q = self.top_entropy_quantile();
        if !(q > 0.0 && q <= 1.0) {
            return Err(format!("objective.top_entropy_quantile = {q} must be in (0, 1]"));
        }
        if self.std_normalize.is_some() && self.scale_rewards.is_some() {
            return Err("objective.std_normalize and objective.scale_rewards say the same thing: set one".into());
        }
        if self.dual_clip == Some(false) && self.clip_ratio_c.is_some() {
            return Err("objective.clip_ratio_c is the dual-clip bound: not with dual_clip = false".into());
        }
        if let Some(c) = self.clip_ratio_c() {
            if !(c.is_finite() && c > 1.0) {
                return Err(format!("objective.clip_ratio_c = {c} must be > 1"));
            }
        }
        if let Some(f) = self.loss_scale_factor {
            if self.loss_agg() != LossAgg::SeqMeanTokenSumNorm {
                return Err("objective.loss_scale_factor applies to loss_agg = \"seq-mean-token-sum-norm\" only".into());
            }
            if f == 0 {
                return Err("objective.loss_scale_factor must be >= 1".into());
            }
        }
        Ok(())
    }

    /// The advantage options of a group of `key`'s batch.
    pub(super) fn advantage(&self, key: &GroupKey) -> AdvantageConfig {
        let scale = self.scale_rewards();
        AdvantageConfig {
            std_normalize: scale != ScaleRewards::None,
            bias: self.bias,
            batch_std: (scale == ScaleRewards::Batch).then_some(key.batch_reward_std),
        }
    }

    /// Build the objective (leaving zero-variance groups out of its loss with `mask_zero_std`).
    pub fn build(&self) -> Box<dyn Objective> {
        let objective = self.build_unmasked();
        if self.mask_zero_std() {
            Box::new(MaskZeroStd(objective))
        } else {
            objective
        }
    }

    fn build_unmasked(&self) -> Box<dyn Objective> {
        match self.name {
            ObjectiveName::OffGrpo
            | ObjectiveName::Grpo
            | ObjectiveName::Gspo
            | ObjectiveName::Rec
            | ObjectiveName::Cispo => Box::new(Clipped::new(self)),
            ObjectiveName::Opmd => Box::new(Opmd(self.clone())),
            ObjectiveName::Asymre => Box::new(AsymRe(self.clone())),
            ObjectiveName::RedDrop => Box::new(RedDrop(self.clone())),
            ObjectiveName::RedWeight => Box::new(RedWeight(self.clone())),
            ObjectiveName::Oapl => Box::new(Oapl(self.clone())),
            ObjectiveName::Sft => Box::new(Sft(self.clone())),
        }
    }
}
