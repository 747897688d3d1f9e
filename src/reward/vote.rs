//! Majority vote over a group of answers, clustered by equivalence, and 0/1 rewards.

use super::equiv::{equivalent_parsed, ParsedAnswer};

/// Result of a majority vote over a group of (possibly missing) answers.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Vote {
    /// The winning answer (the first-seen representative of the largest cluster), or None when no
    /// response has an answer.
    pub answer: Option<String>,
    /// Number of responses in the winning cluster.
    pub count: usize,
    /// Winner's count minus the runner-up's count (0 on a tie or when nothing won).
    pub margin: usize,
    /// For each response, the index of its cluster (clusters numbered in order of first appearance),
    /// None for responses without an answer.
    pub cluster: Vec<Option<usize>>,
}

/// Cluster answers by equivalence and pick the largest cluster.
///
/// Each answer joins the first earlier cluster whose representative (its first member, taken as
/// gold) it is equivalent to, else starts a new cluster. Tie rule: among clusters of the same size
/// the one that appeared first wins (and `margin` is 0). Missing answers never form a cluster.
pub fn majority_vote(answers: &[Option<String>]) -> Vote {
    let parsed: Vec<Option<ParsedAnswer>> = answers.iter().map(|a| a.as_deref().map(ParsedAnswer::new)).collect();
    majority_vote_parsed(answers, &parsed)
}

/// [`majority_vote`] on answers already parsed (`parsed[i]` is `answers[i]` parsed).
pub fn majority_vote_parsed(answers: &[Option<String>], parsed: &[Option<ParsedAnswer>]) -> Vote {
    // (index of the representative, count)
    let mut reps: Vec<(usize, usize)> = Vec::new();
    let mut cluster = Vec::with_capacity(answers.len());
    for (i, a) in parsed.iter().enumerate() {
        match a {
            None => cluster.push(None),
            Some(a) => {
                let found = reps.iter().position(|(r, _)| {
                    answers[*r] == answers[i] || parsed[*r].as_ref().is_some_and(|rp| equivalent_parsed(rp, a))
                });
                let idx = match found {
                    Some(k) => k,
                    None => {
                        reps.push((i, 0));
                        reps.len() - 1
                    }
                };
                reps[idx].1 += 1;
                cluster.push(Some(idx));
            }
        }
    }
    let mut best: Option<usize> = None;
    for (k, (_, c)) in reps.iter().enumerate() {
        if best.is_none_or(|b| *c > reps[b].1) {
            best = Some(k);
        }
    }
    let (answer, count) = best.map(|b| (answers[reps[b].0].clone(), reps[b].1)).unwrap_or((None, 0));
    let runner_up = reps.iter().enumerate().filter(|(k, _)| Some(*k) != best).map(|(_, r)| r.1).max().unwrap_or(0);
    Vote { answer, count, margin: count.saturating_sub(runner_up), cluster }
}

/// Reward per response: 1.0 when its answer is equivalent to `reference` (taken as gold), else 0.0.
pub fn rewards(reference: Option<&str>, answers: &[Option<String>]) -> Vec<f32> {
    let reference = reference.map(ParsedAnswer::new);
    answers
        .iter()
        .map(|a| match (&reference, a) {
            (Some(r), Some(a)) if equivalent_parsed(r, &ParsedAnswer::new(a)) => 1.0,
            _ => 0.0,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[Option<&str>]) -> Vec<Option<String>> {
        v.iter().map(|x| x.map(str::to_string)).collect()
    }

    #[test]
    fn clusters_by_equivalence() {
        let a = s(&[Some("0.5"), Some("3"), Some("\\frac12"), None, Some("1/2"), Some("3")]);
        let v = majority_vote(&a);
        assert_eq!(v.answer.as_deref(), Some("0.5"));
        assert_eq!(v.count, 3);
        assert_eq!(v.margin, 1);
        assert_eq!(v.cluster, vec![Some(0), Some(1), Some(0), None, Some(0), Some(1)]);
    }

    #[test]
    fn ties_and_missing() {
        let v = majority_vote(&s(&[None, Some("2"), Some("1"), Some("1"), Some("2")]));
        assert_eq!(v.answer.as_deref(), Some("2"));
        assert_eq!((v.count, v.margin), (2, 0));
        let v = majority_vote(&s(&[None, None]));
        assert_eq!(v, Vote { answer: None, count: 0, margin: 0, cluster: vec![None, None] });
    }

    #[test]
    fn rewards_against_reference() {
        let a = s(&[Some("x=5"), Some("5.0"), Some("6"), None]);
        assert_eq!(rewards(Some("5"), &a), vec![1.0, 1.0, 0.0, 0.0]);
        assert_eq!(rewards(None, &a), vec![0.0; 4]);
    }
}
