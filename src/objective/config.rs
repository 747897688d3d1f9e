//! The `[objective]` section: the objective with its own options ([`ObjectiveKind`]), the options every
//! objective takes ([`CommonOptions`]), the accessors with per-objective defaults, and the validation of
//! ranges.
//!
//! `name` selects the objective's struct; an option of another objective is refused when the section is
//! read, naming the objective and its options.

use serde::ser::{Error as _, SerializeMap};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use super::clipped::Clipped;
use super::mask::MaskZeroStd;
use super::oapl::Oapl;
use super::options::{
    fields, Anchor, ClipMode, CommonOptions, ObjectiveKind, ObjectiveKind as K, ObjectiveName, RatioLevel, RecOptions,
    ScaleRewards, SftAnswers,
};
use super::reinforce::{AsymRe, Opmd, RedDrop, RedWeight, Sft};
use super::{AdvantageConfig, GroupKey, KlEstimator, LossAgg, Objective};

/// The `[objective]` section of the training config: the objective, chosen by `name`, with its own
/// options, and the options every objective takes. `None` means the objective's default (see each
/// accessor).
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectiveConfig {
    pub kind: ObjectiveKind,
    pub common: CommonOptions,
}

impl Default for ObjectiveConfig {
    fn default() -> Self {
        Self::of(ObjectiveName::OffGrpo)
    }
}

impl From<ObjectiveKind> for ObjectiveConfig {
    fn from(kind: ObjectiveKind) -> Self {
        Self { kind, common: CommonOptions::default() }
    }
}

/// Options that objectives without them accept at 0 ("off"): the resolved config writes them for every
/// objective (as the config's single list of options did), and such configs are read back.
const ZERO_IS_UNSET: [&str; 2] = ["bias", "beta"];

impl ObjectiveConfig {
    /// The objective `name` with every option at its default.
    pub fn of(name: ObjectiveName) -> Self {
        ObjectiveKind::of(name).into()
    }

    /// The section from its TOML table: `name` (default off_grpo) selects the objective's struct, the
    /// [`CommonOptions`] are split off, and an option of another objective is refused by name.
    fn from_table(mut table: toml::Table) -> Result<Self, String> {
        let name = match table.remove("name") {
            Some(v) => ObjectiveName::deserialize(v).map_err(|e| e.message().to_string())?,
            None => ObjectiveName::OffGrpo,
        };
        let own = name.options();
        let shared = fields::<CommonOptions>();
        let (mut common, mut rest) = (toml::Table::new(), toml::Table::new());
        for (key, value) in table {
            let zero = matches!(value, toml::Value::Float(f) if f == 0.0) || matches!(value, toml::Value::Integer(0));
            if shared.contains(&key.as_str()) {
                common.insert(key, value);
            } else if own.contains(&key.as_str()) {
                rest.insert(key, value);
            } else if ZERO_IS_UNSET.contains(&key.as_str()) && zero {
                continue;
            } else if ObjectiveName::ALL.iter().any(|n| n.options().contains(&key.as_str())) {
                let options: Vec<&str> = own.iter().chain(shared).copied().collect();
                return Err(format!(
                    "objective.{key} does not apply to objective `{}` (its options: {})",
                    name.as_str(),
                    options.join(", ")
                ));
            } else {
                let expected: Vec<String> =
                    ["name"].iter().chain(own).chain(shared).map(|k| format!("`{k}`")).collect();
                return Err(format!("unknown field `{key}`, expected one of {}", expected.join(", ")));
            }
        }
        rest.insert("name".into(), toml::Value::String(name.as_str().into()));
        let kind = ObjectiveKind::deserialize(toml::Value::Table(rest)).map_err(|e| e.message().to_string())?;
        let common = CommonOptions::deserialize(toml::Value::Table(common)).map_err(|e| e.message().to_string())?;
        Ok(Self { kind, common })
    }

    pub fn name(&self) -> ObjectiveName {
        self.kind.name()
    }

    /// `(eps, eps_high)` as given (the clipped family's).
    fn clip_range(&self) -> (Option<f32>, Option<f32>) {
        match &self.kind {
            K::OffGrpo(o) | K::Grpo(o) | K::Gspo(o) => (o.eps, o.eps_high),
            K::Rec(o) => (o.eps, o.eps_high),
            K::Cispo(o) => (o.eps, o.eps_high),
            _ => (None, None),
        }
    }

    /// `(std_normalize, scale_rewards)` as given.
    fn scaling(&self) -> (Option<bool>, Option<ScaleRewards>) {
        match &self.kind {
            K::OffGrpo(o) | K::Grpo(o) | K::Gspo(o) => (o.std_normalize, o.scale_rewards),
            K::Rec(o) => (o.std_normalize, o.scale_rewards),
            K::Cispo(o) => (o.std_normalize, o.scale_rewards),
            K::Opmd(o) => (o.std_normalize, o.scale_rewards),
            K::RedDrop(o) => (o.std_normalize, o.scale_rewards),
            K::RedWeight(o) => (o.std_normalize, o.scale_rewards),
            K::Asymre(_) | K::Oapl(_) | K::Sft(_) => (None, None),
        }
    }

    /// `(beta, kl_estimator)` as given: every objective's but oapl's.
    fn kl(&self) -> (f32, Option<KlEstimator>) {
        match &self.kind {
            K::OffGrpo(o) | K::Grpo(o) | K::Gspo(o) => (o.beta, o.kl_estimator),
            K::Rec(o) => (o.beta, o.kl_estimator),
            K::Cispo(o) => (o.beta, o.kl_estimator),
            K::Opmd(o) => (o.beta, o.kl_estimator),
            K::Asymre(o) => (o.beta, o.kl_estimator),
            K::RedDrop(o) => (o.beta, o.kl_estimator),
            K::RedWeight(o) => (o.beta, o.kl_estimator),
            K::Sft(o) => (o.beta, o.kl_estimator),
            K::Oapl(_) => (0.0, None),
        }
    }

    /// `(anchor, anchor_every)` as given.
    fn anchor_given(&self) -> (Option<Anchor>, Option<usize>) {
        match &self.kind {
            K::OffGrpo(o) | K::Grpo(o) | K::Gspo(o) => (o.anchor, o.anchor_every),
            K::Rec(o) => (o.anchor, o.anchor_every),
            K::Cispo(o) => (o.anchor, o.anchor_every),
            K::Opmd(o) => (o.anchor, o.anchor_every),
            K::Oapl(o) => (o.anchor, o.anchor_every),
            K::Asymre(_) | K::RedDrop(_) | K::RedWeight(_) | K::Sft(_) => (None, None),
        }
    }

    /// `(dual_clip, clip_ratio_c)` as given (PPO's).
    fn dual_clip_given(&self) -> (Option<bool>, Option<f32>) {
        match &self.kind {
            K::OffGrpo(o) | K::Grpo(o) | K::Gspo(o) => (o.dual_clip, o.clip_ratio_c),
            _ => (None, None),
        }
    }

    fn rec(&self) -> Option<&RecOptions> {
        match &self.kind {
            K::Rec(o) => Some(o),
            _ => None,
        }
    }

    /// The all-positive bias b (0: off).
    pub fn bias(&self) -> f32 {
        match &self.kind {
            K::OffGrpo(o) | K::Grpo(o) | K::Gspo(o) => o.bias,
            K::Rec(o) => o.bias,
            K::Cispo(o) => o.bias,
            _ => 0.0,
        }
    }

    /// The KL weight to the frozen reference (0: no KL term).
    pub fn beta(&self) -> f32 {
        self.kl().0
    }

    /// Clip range below 1.
    pub fn eps_low(&self) -> f32 {
        self.clip_range().0.unwrap_or(if self.name() == ObjectiveName::Gspo { 6e-4 } else { 0.2 })
    }

    /// Clip range above 1.
    pub fn eps_high(&self) -> f32 {
        match (self.clip_range(), self.name()) {
            ((_, Some(e)), _) => e,
            ((None, None), ObjectiveName::Gspo) => 8e-4,
            _ => self.eps_low(),
        }
    }

    pub fn std_normalize(&self) -> bool {
        self.scale_rewards() != ScaleRewards::None
    }

    /// How advantages are scaled: `scale_rewards`, else `std_normalize` (true: by the group's std).
    pub fn scale_rewards(&self) -> ScaleRewards {
        let (std_normalize, scale_rewards) = self.scaling();
        let by_group = || {
            std_normalize
                .unwrap_or(matches!(self.name(), ObjectiveName::OffGrpo | ObjectiveName::Grpo | ObjectiveName::Cispo))
        };
        match scale_rewards {
            Some(s) => s,
            None if by_group() => ScaleRewards::Group,
            None => ScaleRewards::None,
        }
    }

    /// The dual-clip bound, when dual-clip is on.
    pub fn clip_ratio_c(&self) -> Option<f32> {
        match self.dual_clip_given() {
            (Some(false), _) | (None, None) => None,
            (_, c) => Some(c.unwrap_or(3.0)),
        }
    }

    /// The constant of seq-mean-token-sum-norm: `loss_scale_factor`, else `default` (the run's
    /// response-token limit).
    pub fn loss_scale_factor(&self, default: usize) -> usize {
        self.common.loss_scale_factor.unwrap_or(default)
    }

    /// Whether answers cut at the token limit are left out of the loss.
    pub fn mask_truncated(&self) -> bool {
        self.common.mask_truncated.unwrap_or(false)
    }

    pub fn kl_estimator(&self) -> KlEstimator {
        self.kl().1.unwrap_or(KlEstimator::K3)
    }

    pub fn loss_agg(&self) -> LossAgg {
        self.common.loss_agg.unwrap_or(match self.name() {
            ObjectiveName::OffGrpo | ObjectiveName::Grpo | ObjectiveName::Gspo | ObjectiveName::Sft => {
                LossAgg::SeqMeanTokenMean
            }
            ObjectiveName::Oapl => LossAgg::SeqMeanTokenSum,
            _ => LossAgg::TokenMean,
        })
    }

    pub fn ratio_level(&self) -> RatioLevel {
        let given = match &self.kind {
            K::OffGrpo(o) | K::Grpo(o) | K::Gspo(o) => o.ratio_level,
            K::Rec(o) => o.ratio_level,
            K::Cispo(o) => o.ratio_level,
            _ => None,
        };
        given.unwrap_or(if self.name() == ObjectiveName::Gspo { RatioLevel::Sequence } else { RatioLevel::Token })
    }

    pub fn clip_mode(&self) -> ClipMode {
        self.rec().and_then(|o| o.clip_mode).unwrap_or(ClipMode::OneSide)
    }

    pub fn importance_weight(&self) -> bool {
        self.rec().and_then(|o| o.importance_weight).unwrap_or(false)
    }

    pub fn eps_low_outer(&self) -> f32 {
        self.rec().and_then(|o| o.eps_low_outer).unwrap_or(0.6)
    }

    pub fn eps_high_outer(&self) -> f32 {
        self.rec().and_then(|o| o.eps_high_outer).unwrap_or(2.0)
    }

    pub fn tau(&self) -> f32 {
        match &self.kind {
            K::Opmd(o) => o.tau,
            _ => None,
        }
        .unwrap_or(0.1)
    }

    pub fn baseline_shift(&self) -> f32 {
        match &self.kind {
            K::Asymre(o) => o.baseline_shift,
            _ => None,
        }
        .unwrap_or(0.1)
    }

    pub fn temperature(&self) -> f32 {
        match &self.kind {
            K::RedWeight(o) => o.temperature,
            _ => None,
        }
        .unwrap_or(1.0)
    }

    pub fn beta1(&self) -> f32 {
        match &self.kind {
            K::Oapl(o) => o.beta1,
            _ => None,
        }
        .unwrap_or(1.0)
    }

    pub fn beta2(&self) -> f32 {
        match &self.kind {
            K::Oapl(o) => o.beta2,
            _ => None,
        }
        .unwrap_or(1e-3)
    }

    /// The behaviour log-probs the objective reads (`None`: it reads none).
    pub fn anchor(&self) -> Option<Anchor> {
        let default = match self.name() {
            ObjectiveName::OffGrpo | ObjectiveName::Rec => Anchor::Teacher,
            ObjectiveName::Grpo | ObjectiveName::Gspo | ObjectiveName::Opmd | ObjectiveName::Cispo => Anchor::Step,
            ObjectiveName::Oapl => Anchor::Snapshot,
            _ => return None,
        };
        Some(self.anchor_given().0.unwrap_or(default))
    }

    /// Steps between refreshes of the anchor snapshot.
    pub fn anchor_every(&self) -> usize {
        self.anchor_given().1.unwrap_or(50)
    }

    /// Whether zero-variance groups are left out of the loss.
    pub fn mask_zero_std(&self) -> bool {
        self.common.mask_zero_std.unwrap_or(false)
    }

    pub fn sft_answers(&self) -> SftAnswers {
        match &self.kind {
            K::Sft(o) => o.sft_answers,
            _ => None,
        }
        .unwrap_or(SftAnswers::Positive)
    }

    /// The entropy bonus's coefficient (0: off).
    pub fn entropy_coeff(&self) -> f32 {
        self.common.entropy_coeff
    }

    /// The fraction of each answer's highest-entropy tokens kept in the policy loss (1: all).
    pub fn top_entropy_quantile(&self) -> f32 {
        self.common.top_entropy_quantile.unwrap_or(1.0)
    }

    /// Check the options' ranges and the options that depend on one another.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let in_unit = |v: f32| (0.0..1.0).contains(&v);
        let positive = |v: f32| v.is_finite() && v > 0.0;
        if !in_unit(self.eps_low()) {
            return Err(format!("objective.eps = {} must be in [0, 1)", self.eps_low()));
        }
        if !(self.eps_high() >= 0.0 && self.eps_high().is_finite()) {
            return Err(format!("objective.eps_high = {} must be >= 0", self.eps_high()));
        }
        if !(self.beta() >= 0.0 && self.beta().is_finite()) {
            return Err(format!("objective.beta = {} must be >= 0", self.beta()));
        }
        if !self.bias().is_finite() || !self.baseline_shift().is_finite() {
            return Err("objective.bias and objective.baseline_shift must be finite".into());
        }
        let outer_given = self.rec().is_some_and(|o| o.eps_low_outer.is_some() || o.eps_high_outer.is_some());
        if outer_given && self.clip_mode() != ClipMode::Ring {
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
        if self.anchor_given().1.is_some() && self.anchor() != Some(Anchor::Snapshot) {
            return Err("objective.anchor_every applies to anchor = \"snapshot\" only".into());
        }
        if self.mask_zero_std() && self.bias() != 0.0 {
            return Err(format!(
                "objective.mask_zero_std = true with objective.bias = {}: the bias only acts on groups whose rewards \
                 all agree, which mask_zero_std leaves out",
                self.bias()
            ));
        }
        if self.anchor_every() == 0 {
            return Err("objective.anchor_every must be >= 1".into());
        }
        self.validate_peer_options()
    }

    /// The options named after TRL's and verl's.
    fn validate_peer_options(&self) -> std::result::Result<(), String> {
        if !(self.entropy_coeff().is_finite() && self.entropy_coeff() >= 0.0) {
            return Err(format!("objective.entropy_coeff = {} must be >= 0", self.entropy_coeff()));
        }
        let q = self.top_entropy_quantile();
        if !(q > 0.0 && q <= 1.0) {
            return Err(format!("objective.top_entropy_quantile = {q} must be in (0, 1]"));
        }
        if let (Some(_), Some(_)) = self.scaling() {
            return Err("objective.std_normalize and objective.scale_rewards say the same thing: set one".into());
        }
        if let (Some(false), Some(_)) = self.dual_clip_given() {
            return Err("objective.clip_ratio_c is the dual-clip bound: not with dual_clip = false".into());
        }
        if let Some(c) = self.clip_ratio_c() {
            if !(c.is_finite() && c > 1.0) {
                return Err(format!("objective.clip_ratio_c = {c} must be > 1"));
            }
        }
        if let Some(f) = self.common.loss_scale_factor {
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
            bias: self.bias(),
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
        match &self.kind {
            K::OffGrpo(_) | K::Grpo(_) | K::Gspo(_) | K::Rec(_) | K::Cispo(_) => Box::new(Clipped::new(self)),
            K::Opmd(_) => Box::new(Opmd(self.clone())),
            K::Asymre(_) => Box::new(AsymRe(self.clone())),
            K::RedDrop(_) => Box::new(RedDrop(self.clone())),
            K::RedWeight(_) => Box::new(RedWeight(self.clone())),
            K::Oapl(_) => Box::new(Oapl(self.clone())),
            K::Sft(_) => Box::new(Sft(self.clone())),
        }
    }
}

impl<'de> Deserialize<'de> for ObjectiveConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::from_table(toml::Table::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// The section as one table in the layout of the config's former single list of options: `name`; `bias`
/// (0 for the objectives without it); the objective's options, with `loss_scale_factor` and
/// `mask_truncated` before `beta` (0 for oapl) and `loss_agg` after the KL options; then `mask_zero_std`,
/// `entropy_coeff` and `top_entropy_quantile`. Resolved configs, and the `train_config.toml` that resume
/// compares with, read as they did when the section was one struct.
impl Serialize for ObjectiveConfig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let own = json_table(&self.kind).map_err(S::Error::custom)?;
        let mut common = json_table(&self.common).map_err(S::Error::custom)?;
        let zero = Value::from(0.0f32);
        let mut out = s.serialize_map(None)?;
        let mut entries = own.iter().peekable();
        if let Some((k, v)) = entries.next() {
            out.serialize_entry(k, v)?;
        }
        if !own.contains_key("bias") {
            out.serialize_entry("bias", &zero)?;
        }
        if !own.contains_key("beta") {
            move_entries(&mut out, &mut common, &["loss_scale_factor", "mask_truncated"])?;
            out.serialize_entry("beta", &zero)?;
            move_entries(&mut out, &mut common, &["loss_agg"])?;
        }
        while let Some((k, v)) = entries.next() {
            if k == "beta" {
                move_entries(&mut out, &mut common, &["loss_scale_factor", "mask_truncated"])?;
            }
            out.serialize_entry(k, v)?;
            let next_is_kl = entries.peek().is_some_and(|(n, _)| *n == "kl_estimator");
            if k == "kl_estimator" || (k == "beta" && !next_is_kl) {
                move_entries(&mut out, &mut common, &["loss_agg"])?;
            }
        }
        move_entries(&mut out, &mut common, fields::<CommonOptions>())?;
        out.end()
    }
}

/// `v` (a struct or an internally tagged enum of structs) as its fields in order.
fn json_table<T: Serialize>(v: &T) -> Result<Map<String, Value>, String> {
    match serde_json::to_value(v) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(format!("expected a table, got {other}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Write the entries of `keys` that `from` holds, in that order, taking them out of `from`.
fn move_entries<M: SerializeMap>(out: &mut M, from: &mut Map<String, Value>, keys: &[&str]) -> Result<(), M::Error> {
    for k in keys {
        if let Some(v) = from.shift_remove(*k) {
            out.serialize_entry(k, &v)?;
        }
    }
    Ok(())
}
