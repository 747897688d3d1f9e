//! Labels of one group: each answer's extracted final answer, the group's majority answer and vote margin,
//! and each answer's reward against the majority (OpenThoughts3 has no gold answer), all from
//! [`crate::reward`].

use serde::{Deserialize, Serialize};

use crate::reward::{majority_vote, rewards};

/// The labels of a group of answers to one question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Labels {
    /// The majority answer (None when no response has an answer).
    pub majority: Option<String>,
    /// Size of the winning cluster.
    pub majority_count: usize,
    /// Winner's count minus the runner-up's count.
    pub vote_margin: usize,
    /// Reward per response: 1 when its answer is equivalent to the majority, else 0.
    pub rewards: Vec<f32>,
}

/// How a group's rewards are distributed (the seed's figure 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// Every reward is 1: the teacher agrees with itself on every answer.
    AllPositive,
    /// Every reward is 0 (no response has an answer).
    AllNegative,
    Mixed,
}

impl Labels {
    pub fn kind(&self) -> GroupKind {
        if self.rewards.iter().all(|&r| r > 0.0) {
            GroupKind::AllPositive
        } else if self.rewards.iter().all(|&r| r <= 0.0) {
            GroupKind::AllNegative
        } else {
            GroupKind::Mixed
        }
    }
}

/// Label the `chosen` answers of a question by the majority vote over `voters` (all of the question's
/// answers, or the chosen ones themselves).
pub fn label_group(voters: &[Option<String>], chosen: &[Option<String>]) -> Labels {
    let vote = majority_vote(voters);
    let rewards = rewards(vote.answer.as_deref(), chosen);
    Labels { majority: vote.answer, majority_count: vote.count, vote_margin: vote.margin, rewards }
}

impl Labels {
    /// Two answers tie for the majority (a winner whose margin over the runner-up is 0).
    pub fn is_tie(&self) -> bool {
        self.majority_count > 0 && self.vote_margin == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Option<String> {
        Some(x.to_string())
    }

    fn label_answers(answers: &[Option<String>]) -> Labels {
        label_group(answers, answers)
    }

    #[test]
    fn labels_follow_the_majority() {
        let l = label_answers(&[s("4"), s("4"), s("5"), None]);
        assert_eq!(l.majority.as_deref(), Some("4"));
        assert_eq!((l.majority_count, l.vote_margin), (2, 1));
        assert_eq!(l.rewards, vec![1.0, 1.0, 0.0, 0.0]);
        assert_eq!(l.kind(), GroupKind::Mixed);
        assert_eq!(label_answers(&[s("1"), s("1")]).kind(), GroupKind::AllPositive);
        let none = label_answers(&[None, None]);
        assert_eq!((none.majority.clone(), none.kind()), (None, GroupKind::AllNegative));
        assert!(!none.is_tie() && !l.is_tie());
        assert!(label_answers(&[s("4"), s("5")]).is_tie());
    }

    #[test]
    fn the_vote_over_all_answers_can_differ_from_the_vote_over_the_chosen() {
        // 16 answers: 9 say 7, 7 say 8; the 8 chosen happen to hold 5 eights and 3 sevens.
        let all: Vec<Option<String>> = [vec![s("7"); 9], vec![s("8"); 7]].concat();
        let chosen: Vec<Option<String>> = [vec![s("8"); 5], vec![s("7"); 3]].concat();
        let over_all = label_group(&all, &chosen);
        assert_eq!(over_all.majority.as_deref(), Some("7"));
        assert_eq!((over_all.majority_count, over_all.vote_margin), (9, 2));
        assert_eq!(over_all.rewards, [vec![0.0; 5], vec![1.0; 3]].concat());
        let over_group = label_group(&chosen, &chosen);
        assert_eq!(over_group.majority.as_deref(), Some("8"));
        assert_eq!(over_group.rewards, [vec![1.0; 5], vec![0.0; 3]].concat());
    }
}
