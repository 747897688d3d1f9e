//! `train.reference_swap_every` (seed 002): every K steps, or at the end of every epoch, the frozen
//! reference becomes a copy of the policy. A checkpoint written after a swap holds the swapped reference
//! (`reference.safetensors`), so a resumed run continues with exactly that reference.

use serde::{Deserialize, Serialize};

/// When the frozen reference becomes a copy of the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawSwap", into = "RawSwap")]
pub enum ReferenceSwap {
    /// After every K-th step (K >= 1).
    Steps(usize),
    /// At the end of every epoch.
    Epoch,
}

/// The TOML forms: a number of steps or the word "epoch".
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum RawSwap {
    Steps(i64),
    Word(String),
}

impl TryFrom<RawSwap> for ReferenceSwap {
    type Error = String;
    fn try_from(raw: RawSwap) -> Result<Self, String> {
        match raw {
            RawSwap::Steps(k) if k >= 1 => Ok(ReferenceSwap::Steps(k as usize)),
            RawSwap::Word(w) if w == "epoch" => Ok(ReferenceSwap::Epoch),
            RawSwap::Steps(k) => {
                Err(format!("train.reference_swap_every = {k}: expected a number of steps >= 1 or \"epoch\""))
            }
            RawSwap::Word(w) => {
                Err(format!("train.reference_swap_every = \"{w}\": expected a number of steps >= 1 or \"epoch\""))
            }
        }
    }
}

impl From<ReferenceSwap> for RawSwap {
    fn from(s: ReferenceSwap) -> Self {
        match s {
            ReferenceSwap::Steps(k) => RawSwap::Steps(k as i64),
            ReferenceSwap::Epoch => RawSwap::Word("epoch".into()),
        }
    }
}

impl ReferenceSwap {
    /// Whether the reference is swapped after the step that brought the run to `steps_done` steps
    /// (`epoch_end`: that step ended an epoch).
    pub fn due(self, steps_done: usize, epoch_end: bool) -> bool {
        match self {
            ReferenceSwap::Steps(k) => steps_done.is_multiple_of(k.max(1)),
            ReferenceSwap::Epoch => epoch_end,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, Serialize)]
    struct T {
        every: ReferenceSwap,
    }

    #[test]
    fn steps_or_epoch_and_nothing_else() {
        let p = |s: &str| toml::from_str::<T>(&format!("every = {s}")).map(|t| t.every);
        assert_eq!(p("3").unwrap(), ReferenceSwap::Steps(3));
        assert_eq!(p("\"epoch\"").unwrap(), ReferenceSwap::Epoch);
        for bad in ["0", "-2", "\"epochs\""] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains("train.reference_swap_every"), "{bad}: {e}");
        }
        assert_eq!(toml::to_string(&T { every: ReferenceSwap::Epoch }).unwrap().trim(), "every = \"epoch\"");
        assert!(ReferenceSwap::Steps(2).due(4, false) && !ReferenceSwap::Steps(2).due(3, true));
        assert!(ReferenceSwap::Epoch.due(3, true) && !ReferenceSwap::Epoch.due(4, false));
    }
}
