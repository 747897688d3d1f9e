//! `mask_zero_std` (seed 002): a group whose rewards all agree has no relative signal; with the option it
//! takes no part in the loss at all (policy term and KL term), and it does not count in the aggregation's
//! normalisers.

use candle_core::{Result, Tensor};

use super::{Anchor, GroupAdvantages, GroupKey, LossTerms, Objective, TokenInputs};

/// An objective whose zero-variance groups are left out of the loss.
pub struct MaskZeroStd(pub Box<dyn Objective>);

impl Objective for MaskZeroStd {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn needs_kl(&self) -> bool {
        self.0.needs_kl()
    }
    fn anchor(&self) -> Option<Anchor> {
        self.0.anchor()
    }
    fn needs_reference(&self) -> bool {
        self.0.needs_reference()
    }
    fn advantages(&self, rewards: &[f32], key: &GroupKey) -> GroupAdvantages {
        let mut adv = self.0.advantages(rewards, key);
        if adv.rewards.std == 0.0 {
            adv.include.iter_mut().for_each(|i| *i = false);
        }
        adv
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        self.0.loss(logp, inputs)
    }
}
