//! Scoring metrics shared by `grpo score` and the evaluator: avg@n, unbiased pass@k, maj@n.

use std::collections::BTreeMap;

/// Unbiased pass@k estimator (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), for n samples of which c
/// are correct. k larger than n is clamped to n; n = 0 gives 0.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    let c = c.min(n);
    let k = k.min(n);
    if n == 0 || k == 0 {
        return 0.0;
    }
    if n - c < k {
        return 1.0;
    }
    // C(n-c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i)
    let mut ratio = 1.0f64;
    for i in (n - c + 1)..=n {
        ratio *= 1.0 - k as f64 / i as f64;
    }
    1.0 - ratio
}

/// Outcome of one item (question): the correctness of each response and of the majority answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemOutcome {
    pub correct: Vec<bool>,
    /// How many responses (not correct) have an unknown verdict: equivalence not decidable.
    pub unknown: usize,
    /// How many responses had an extractable answer.
    pub extracted: usize,
    /// Whether the majority answer is correct (None when there is no gold to judge it).
    pub majority_correct: Option<bool>,
}

/// Summary over items.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    pub n_items: usize,
    pub n_responses: usize,
    /// Fraction of responses with an extracted answer.
    pub extract_rate: f64,
    /// Mean correctness over all responses.
    pub avg_at_n: f64,
    /// Responses whose verdict is unknown (counted as not correct): equivalence to the reference
    /// could not be decided within the limits of exact arithmetic.
    pub n_unknown: usize,
    /// Mean over items of the unbiased pass@k, keyed by k.
    pub pass_at_k: BTreeMap<usize, f64>,
    /// Fraction of items whose majority answer is correct (None without gold).
    pub maj_at_n: Option<f64>,
}

/// Aggregate item outcomes into a [`Summary`] with pass@k for each of `ks`.
pub fn summarize(items: &[ItemOutcome], ks: &[usize]) -> Summary {
    let n_items = items.len();
    let n_responses: usize = items.iter().map(|i| i.correct.len()).sum();
    let n_correct: usize = items.iter().map(|i| i.correct.iter().filter(|c| **c).count()).sum();
    let extracted: usize = items.iter().map(|i| i.extracted).sum();
    let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let mut pass = BTreeMap::new();
    for &k in ks {
        let total: f64 =
            items.iter().map(|i| pass_at_k(i.correct.len(), i.correct.iter().filter(|c| **c).count(), k)).sum();
        pass.insert(k, if n_items == 0 { 0.0 } else { total / n_items as f64 });
    }
    let judged: Vec<bool> = items.iter().filter_map(|i| i.majority_correct).collect();
    let maj_at_n = (!judged.is_empty()).then(|| ratio(judged.iter().filter(|b| **b).count(), judged.len()));
    Summary {
        n_items,
        n_responses,
        extract_rate: ratio(extracted, n_responses),
        avg_at_n: ratio(n_correct, n_responses),
        n_unknown: items.iter().map(|i| i.unknown).sum(),
        pass_at_k: pass,
        maj_at_n,
    }
}

impl Summary {
    /// A two-column text table of the summary.
    pub fn table(&self) -> String {
        let mut rows = vec![
            ("items".to_string(), self.n_items.to_string()),
            ("responses".to_string(), self.n_responses.to_string()),
            ("extract rate".to_string(), format!("{:.4}", self.extract_rate)),
            ("avg@n".to_string(), format!("{:.4}", self.avg_at_n)),
            ("unknown verdicts".to_string(), self.n_unknown.to_string()),
        ];
        for (k, v) in &self.pass_at_k {
            rows.push((format!("pass@{k}"), format!("{v:.4}")));
        }
        rows.push(("maj@n".to_string(), self.maj_at_n.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into())));
        let w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
        rows.iter().map(|(a, b)| format!("{a:<w$}  {b}\n")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_at_k_edges() {
        assert_eq!(pass_at_k(8, 0, 4), 0.0);
        assert_eq!(pass_at_k(8, 8, 1), 1.0);
        assert!((pass_at_k(8, 2, 1) - 0.25).abs() < 1e-12);
        assert_eq!(pass_at_k(8, 5, 4), 1.0);
        assert_eq!(pass_at_k(0, 0, 1), 0.0);
        assert_eq!(pass_at_k(2, 1, 4), 1.0);
    }

    #[test]
    fn summary_values() {
        let items = vec![
            ItemOutcome { correct: vec![true, false], unknown: 0, extracted: 2, majority_correct: Some(true) },
            ItemOutcome { correct: vec![false, false], unknown: 1, extracted: 1, majority_correct: Some(false) },
        ];
        let s = summarize(&items, &[1, 2]);
        assert_eq!(s.n_responses, 4);
        assert!((s.avg_at_n - 0.25).abs() < 1e-12);
        assert!((s.extract_rate - 0.75).abs() < 1e-12);
        assert!((s.pass_at_k[&1] - 0.25).abs() < 1e-12);
        assert!((s.pass_at_k[&2] - 0.5).abs() < 1e-12);
        assert_eq!(s.maj_at_n, Some(0.5));
        assert_eq!(s.n_unknown, 1);
        assert!(s.table().contains("unknown verdicts  1"));
        assert!(s.table().contains("pass@2"));
    }
}
