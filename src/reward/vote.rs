//! Majority vote over a group of answers, clustered by equivalence, and 0/1 rewards.

use std::collections::HashMap;

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
///
/// Near-linear: an answer is only compared with the representatives that could be equivalent to it
/// ([`Candidates`]), in cluster order, so that it still joins the first equivalent one.
pub fn majority_vote_parsed(answers: &[Option<String>], parsed: &[Option<ParsedAnswer>]) -> Vote {
    // (index of the representative, count)
    let mut reps: Vec<(usize, usize)> = Vec::new();
    let mut index = Candidates::default();
    let mut cluster = Vec::with_capacity(answers.len());
    for (i, a) in parsed.iter().enumerate() {
        let (Some(a), Some(text)) = (a, answers[i].as_deref()) else {
            cluster.push(None);
            continue;
        };
        let values = a.numeric_values();
        let found = index.of(text, a, values.as_deref(), reps.len()).into_iter().find(|&k| {
            let r = reps[k].0;
            count_comparison();
            answers[r] == answers[i] || parsed[r].as_ref().is_some_and(|rp| equivalent_parsed(rp, a))
        });
        let idx = match found {
            Some(k) => k,
            None => {
                reps.push((i, 0));
                index.add(reps.len() - 1, text, a, values.as_deref());
                reps.len() - 1
            }
        };
        reps[idx].1 += 1;
        cluster.push(Some(idx));
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

#[cfg(test)]
thread_local! {
    static COMPARISONS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn count_comparison() {
    #[cfg(test)]
    COMPARISONS.with(|c| c.set(c.get() + 1));
}

/// The cluster representatives an answer could be equivalent to: those with the same text or the same
/// normalised key, every representative that is not a plain number, and for a plain number the plain
/// numbers with a nearby value (see [`ParsedAnswer::numeric_values`]).
#[derive(Default)]
struct Candidates {
    by_text: HashMap<String, usize>,
    by_key: HashMap<String, usize>,
    by_value: HashMap<i64, Vec<usize>>,
    /// Representatives that are not plain numbers.
    other: Vec<usize>,
}

/// A bucket of values: values within `max(1.5e-6, 2e-12 |x|)` of each other are in the same or
/// adjacent buckets (asinh(x / 1e6) moves by less than 4e-12 over that distance).
fn bucket(x: f64) -> i64 {
    if x.is_infinite() {
        return if x > 0.0 { i64::MAX } else { i64::MIN };
    }
    ((x / 1e6).asinh() / 1e-10).floor() as i64
}

impl Candidates {
    fn add(&mut self, k: usize, text: &str, a: &ParsedAnswer, values: Option<&[f64]>) {
        self.by_text.entry(text.to_string()).or_insert(k);
        self.by_key.entry(a.key().to_string()).or_insert(k);
        match values {
            Some(vs) => vs.iter().for_each(|v| self.by_value.entry(bucket(*v)).or_default().push(k)),
            None => self.other.push(k),
        }
    }

    /// Candidate clusters in increasing order (all of them for an answer that is not a plain number).
    fn of(&self, text: &str, a: &ParsedAnswer, values: Option<&[f64]>, n_reps: usize) -> Vec<usize> {
        let Some(vs) = values else { return (0..n_reps).collect() };
        let mut out: Vec<usize> = self.other.clone();
        out.extend(self.by_text.get(text));
        out.extend(self.by_key.get(a.key()));
        for v in vs {
            let b = bucket(*v);
            for nb in [b.saturating_sub(1), b, b.saturating_add(1)] {
                out.extend(self.by_value.get(&nb).into_iter().flatten());
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
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
    fn many_distinct_answers_vote_in_linear_comparisons() {
        let mut a: Vec<Option<String>> = (0..4000).map(|i| Some(format!("{}", i * 7 + 3))).collect();
        a.extend([Some("\\frac{6}{2}".into()), Some("10.0".into()), Some("1700\\%".into()), Some("x".into())]);
        COMPARISONS.with(|c| c.set(0));
        let t = std::time::Instant::now();
        let v = majority_vote(&a);
        let comparisons = COMPARISONS.with(|c| c.get());
        assert!(comparisons < 4 * a.len(), "{comparisons} comparisons for {} answers", a.len());
        assert!(t.elapsed().as_secs_f64() < 2.0, "took {:?}", t.elapsed());
        assert_eq!(v.answer.as_deref(), Some("3"));
        assert_eq!((v.count, v.margin), (2, 0));
        assert_eq!(&v.cluster[4000..], [Some(0), Some(1), Some(2), Some(4000)]);
    }

    /// The clustering of every answer against every earlier representative, as it was before indexing.
    fn quadratic_clusters(answers: &[Option<String>]) -> Vec<Option<usize>> {
        let parsed: Vec<Option<ParsedAnswer>> = answers.iter().map(|a| a.as_deref().map(ParsedAnswer::new)).collect();
        let mut reps: Vec<usize> = Vec::new();
        let mut out = Vec::new();
        for (i, a) in parsed.iter().enumerate() {
            let Some(a) = a else {
                out.push(None);
                continue;
            };
            let k = reps.iter().position(|&r| {
                answers[r] == answers[i] || parsed[r].as_ref().is_some_and(|rp| equivalent_parsed(rp, a))
            });
            out.push(Some(k.unwrap_or_else(|| {
                reps.push(i);
                reps.len() - 1
            })));
        }
        out
    }

    #[test]
    fn indexed_vote_clusters_like_the_quadratic_one() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/reward/math500_answers.jsonl");
        let text = std::fs::read_to_string(path).unwrap();
        let mut a: Vec<Option<String>> = Vec::new();
        for (i, l) in text.lines().enumerate() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ans = v["answer"].as_str().unwrap().to_string();
            a.push(Some(ans.clone()));
            if i % 3 == 0 {
                a.push(Some(format!("x = {ans}")));
                a.push(Some(format!("{ans}\\%")));
            }
        }
        let extra = [
            "0.5",
            "1/2",
            "50\\%",
            "0.4999999",
            "0.500000001",
            "1e-7",
            "0",
            "-0",
            "\\infty",
            "-\\infty",
            "2^{100000}",
            "4^{50000}",
            "720!",
            "((3!)!)!",
            "2^{-5000}",
            "4^{-2500}",
        ];
        a.extend(extra.iter().map(|s| Some(s.to_string())));
        a.extend((0..200).map(|i| Some(format!("{}", i as f64 / 8.0))));
        a.extend((0..50).map(|i| Some(format!("\\frac{{{i}}}{{8}}"))));
        a.push(None);
        a.extend(a.clone().into_iter().rev().step_by(7).collect::<Vec<_>>());
        assert_eq!(majority_vote(&a).cluster, quadratic_clusters(&a));
    }

    #[test]
    fn rewards_against_reference() {
        let a = s(&[Some("x=5"), Some("5.0"), Some("6"), None]);
        assert_eq!(rewards(Some("5"), &a), vec![1.0, 1.0, 0.0, 0.0]);
        assert_eq!(rewards(None, &a), vec![0.0; 4]);
    }
}
