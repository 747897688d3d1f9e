//! Majority vote over a group of answers, clustered by equivalence, and 0/1 rewards.

use std::collections::HashMap;

use super::equiv::{equivalent_parsed, Equivalence, ParsedAnswer};
use super::fingerprint::Fingerprint;

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
/// gold) it is equivalent to, else starts a new cluster. A comparison whose outcome is
/// [`Equivalence::Unknown`] counts as "not equivalent": it never merges clusters (the answer goes on to
/// the next cluster, or starts its own). Tie rule: among clusters of the same size the one that
/// appeared first wins (and `margin` is 0). Missing answers never form a cluster.
pub fn majority_vote(answers: &[Option<String>]) -> Vote {
    let parsed: Vec<Option<ParsedAnswer>> = answers.iter().map(|a| a.as_deref().map(ParsedAnswer::new)).collect();
    majority_vote_parsed(answers, &parsed)
}

/// At most this many representatives are compared with one answer, in cluster order. Fingerprints
/// leave far fewer on any realistic group (one or two); past the bound (many representatives sharing
/// every fingerprint component, none equal) the answer starts a new cluster: an equivalence class may
/// then be split, two answers that are not equal are never merged.
const MAX_COMPARED: usize = 512;

/// [`majority_vote`] on answers already parsed (`parsed[i]` is `answers[i]` parsed).
///
/// Near-linear: an answer is only compared with the representatives that could be equivalent to it
/// (same text, same normalised key, or a matching [`Fingerprint`]), in cluster order, so that it still
/// joins the first equivalent one: the clusters are those of comparing every answer with every earlier
/// representative.
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
        let fp = a.node().map(Fingerprint::new);
        let found = index.of(text, a, fp.as_ref()).into_iter().take(MAX_COMPARED).find(|&k| {
            let r = reps[k].0;
            count_comparison();
            answers[r] == answers[i]
                || parsed[r].as_ref().is_some_and(|rp| equivalent_parsed(rp, a) == Equivalence::Equal)
        });
        let idx = match found {
            Some(k) => k,
            None => {
                reps.push((i, 0));
                index.add(reps.len() - 1, text, a, fp.as_ref());
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
/// normalised key, and those whose fingerprint entries match one of the answer's fingerprint views.
#[derive(Default)]
struct Candidates {
    by_text: HashMap<String, usize>,
    by_key: HashMap<String, usize>,
    /// Fingerprint entry -> representatives that have it.
    postings: HashMap<u64, Vec<usize>>,
    /// Per representative: its fingerprint entries, sorted (empty when it was not parsed).
    entries: Vec<Vec<u64>>,
}

impl Candidates {
    fn add(&mut self, k: usize, text: &str, a: &ParsedAnswer, fp: Option<&Fingerprint>) {
        self.by_text.entry(text.to_string()).or_insert(k);
        self.by_key.entry(a.key().to_string()).or_insert(k);
        let entries = fp.map(Fingerprint::entries).unwrap_or_default();
        for e in &entries {
            self.postings.entry(*e).or_default().push(k);
        }
        self.entries.push(entries);
    }

    /// Candidate clusters in increasing order. For each view of the answer, the representatives posted
    /// under its most selective component are kept when they match every component.
    fn of(&self, text: &str, a: &ParsedAnswer, fp: Option<&Fingerprint>) -> Vec<usize> {
        let mut out: Vec<usize> = Vec::new();
        out.extend(self.by_text.get(text));
        out.extend(self.by_key.get(a.key()));
        if let Some(fp) = fp {
            let posted = |e: u64| self.postings.get(&e).map_or(0, Vec::len);
            for view in 0..fp.n_views() {
                let mut seen: Vec<usize> = Vec::new();
                for e in fp.rarest_probes(view, posted) {
                    seen.extend(self.postings.get(&e).into_iter().flatten());
                }
                seen.sort_unstable();
                seen.dedup();
                out.extend(seen.into_iter().filter(|&r| fp.matches(view, &self.entries[r])));
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// Reward per response: 1.0 when its answer is equivalent to `reference` (taken as gold), else 0.0 (also
/// when equivalence is unknown).
pub fn rewards(reference: Option<&str>, answers: &[Option<String>]) -> Vec<f32> {
    let reference = reference.map(ParsedAnswer::new);
    answers
        .iter()
        .map(|a| match (&reference, a) {
            (Some(r), Some(a)) if equivalent_parsed(r, &ParsedAnswer::new(a)) == Equivalence::Equal => 1.0,
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

    /// Votes over `a` and returns the clusters and the number of comparisons made.
    fn counted_vote(a: &[Option<String>]) -> (Vote, usize) {
        COMPARISONS.with(|c| c.set(0));
        let v = majority_vote(a);
        (v, COMPARISONS.with(|c| c.get()))
    }

    #[test]
    fn many_distinct_answers_vote_in_linear_comparisons() {
        let mut a: Vec<Option<String>> = (0..4000).map(|i| Some(format!("{}", i * 7 + 3))).collect();
        a.extend([Some("\\frac{6}{2}".into()), Some("10.0".into()), Some("1700\\%".into()), Some("x".into())]);
        let (v, comparisons) = counted_vote(&a);
        assert!(comparisons < 4 * a.len(), "{comparisons} comparisons for {} answers", a.len());
        assert_eq!(v.answer.as_deref(), Some("3"));
        assert_eq!((v.count, v.margin), (2, 0));
        assert_eq!(&v.cluster[4000..], [Some(0), Some(1), Some(2), Some(4000)]);
    }

    fn distinct_expressions(n: usize) -> Vec<Option<String>> {
        (0..n)
            .map(|i| {
                Some(match i % 4 {
                    0 => format!("x^2 + {i}x + 1"),
                    1 => format!("\\frac{{x}}{{{i}}} - y"),
                    2 => format!("\\sqrt{{x + {i}}}"),
                    _ => format!("{i} \\sin(t) + {}", i % 7),
                })
            })
            .collect()
    }

    fn distinct_sets(n: usize) -> Vec<Option<String>> {
        (0..n)
            .map(|i| {
                Some(match i % 4 {
                    0 => format!("\\{{0, 1, {i}\\}}"),
                    1 => format!("({i}, {})", i + 2),
                    2 => format!("(0, 1, {i}, \\sqrt{{2}})"),
                    _ => format!("[{i}, \\infty) \\cup \\{{-1\\}}"),
                })
            })
            .collect()
    }

    #[test]
    fn distinct_expressions_vote_in_linear_comparisons() {
        let a = distinct_expressions(4000);
        let (v, comparisons) = counted_vote(&a);
        assert!(comparisons < a.len(), "{comparisons} comparisons for {} answers", a.len());
        assert_eq!(v.count, 1);
        // The same expressions written differently join their clusters.
        let mut b = a.clone();
        b.extend([Some("1 + x^2 + 16x".into()), Some("-y + \\frac{x}{5}".into()), Some("\\sqrt{6 + x}".into())]);
        let (v, comparisons) = counted_vote(&b);
        assert!(comparisons < b.len(), "{comparisons} comparisons for {} answers", b.len());
        assert_eq!(&v.cluster[4000..], [Some(16), Some(5), Some(6)]);
    }

    #[test]
    fn distinct_sets_vote_in_linear_comparisons() {
        let a = distinct_sets(4000);
        let (v, comparisons) = counted_vote(&a);
        assert!(comparisons < a.len(), "{comparisons} comparisons for {} answers", a.len());
        assert_eq!(v.count, 1);
        let mut b = a.clone();
        b.extend([
            Some("\\{8, 1, 0, 0\\}".into()),
            Some("\\{9, 11\\}".into()),
            Some("(0, 1, 10, 1.41421356237)".into()),
        ]);
        let (v, comparisons) = counted_vote(&b);
        assert!(comparisons < b.len(), "{comparisons} comparisons for {} answers", b.len());
        assert_eq!(&v.cluster[4000..], [Some(8), Some(9), Some(10)]);
    }

    #[test]
    fn a_mix_of_distinct_answers_votes_in_linear_comparisons() {
        let n = 4000;
        let mut a: Vec<Option<String>> = Vec::new();
        for i in 0..n / 8 {
            a.push(Some(format!("x = {i}")));
            a.push(Some(format!("x > {i}")));
            a.push(Some(format!("\\begin{{pmatrix}} 1 & {i} \\\\ 0 & 1 \\end{{pmatrix}}")));
            a.push(Some(format!("\\text{{word {}}}", i + 1)));
            a.push(Some(format!("2^{{10^{{9}} + {i}}}")));
            a.push(Some(format!("unparsable ({i}")));
            a.push(Some(format!("{i}.5\\%")));
            a.push(Some(format!("e^{{{i}}} + \\pi")));
        }
        let (v, comparisons) = counted_vote(&a);
        assert!(comparisons < a.len(), "{comparisons} comparisons for {} answers", a.len());
        assert_eq!(v.count, 1);
        let mut all = a.clone();
        all.extend(distinct_expressions(n));
        all.extend(distinct_sets(n));
        let (_, comparisons) = counted_vote(&all);
        assert!(comparisons < all.len(), "{comparisons} comparisons for {} answers", all.len());
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
                answers[r] == answers[i]
                    || parsed[r].as_ref().is_some_and(|rp| equivalent_parsed(rp, a) == Equivalence::Equal)
            });
            out.push(Some(k.unwrap_or_else(|| {
                reps.push(i);
                reps.len() - 1
            })));
        }
        out
    }

    /// One answer drawn from families of equivalent and nearly-equivalent forms (numbers, decimals at
    /// the rounding edge, percentages, irrational values, expressions, sets, tuples, intervals, unions,
    /// relations, assignments, words, matrices, infinities, huge values).
    fn random_answer(rng: &mut impl rand::Rng) -> String {
        let a: i64 = rng.gen_range(-3..6);
        let b: i64 = rng.gen_range(0..6);
        let c: i64 = rng.gen_range(1..4);
        let forms: Vec<String> = vec![
            format!("{a}"),
            format!("{a}.0"),
            format!("\\frac{{{}}}{{{c}}}", a * c),
            format!("\\frac{{{a}}}{{{c}}}"),
            format!("{:.6}", a as f64 / c as f64),
            format!("{:.7}", a as f64 / c as f64),
            format!("{:.3}", a as f64 / c as f64),
            format!("{}\\%", a * 25),
            format!("{}", a as f64 / 4.0),
            format!("\\sqrt{{{b}}}"),
            format!("{:.6}", (b as f64).sqrt()),
            format!("{:.12}", (b as f64).sqrt()),
            format!("\\sqrt{{{}}}", b * c * c),
            format!("{c}\\sqrt{{{b}}}"),
            format!("x + {a}"),
            format!("{a} + x"),
            format!("(x + {a})^2"),
            format!("x^2 + {}x + {}", 2 * a, a * a),
            format!("\\frac{{x^2 - {}}}{{x - {a}}}", a * a),
            format!("{c}(x + {a})"),
            format!("{c}x + {}", c * a),
            format!("\\{{{a}, {b}\\}}"),
            format!("\\{{{b}, {a}\\}}"),
            format!("\\{{{a}, {a}, {b}\\}}"),
            format!("{a}, {b}"),
            format!("({a}, {b})"),
            format!("({a}, {b}]"),
            format!("[{a}, {b}]"),
            format!("({a}, {b}, {c})"),
            format!("\\{{{c}, {b}, {a}\\}}"),
            format!("({a}, {b}) \\cup ({c}, \\infty)"),
            format!("({c}, \\infty) \\cup ({a}, {b})"),
            format!("x > {a}"),
            format!("{a} < x"),
            format!("x \\ge {a}"),
            format!("({a}, \\infty)"),
            format!("[{a}, \\infty)"),
            format!("x = {a}"),
            format!("y = {a}"),
            format!("x = {a}, {b}"),
            format!("{a} \\le x < {b}"),
            format!("\\text{{{}}}", ["yes", "no", "Yes"][b as usize % 3]),
            ["yes", "no", "x", "xy", "yx", "e", "\\eta", "eta"][b as usize % 8].to_string(),
            format!("\\begin{{pmatrix}} {a} & {b} \\end{{pmatrix}}"),
            format!("\\begin{{pmatrix}} {a}.0 & \\frac{{{}}}{{2}} \\end{{pmatrix}}", 2 * b),
            ["\\infty", "-\\infty", "\\infty", "\\frac{1}{0}"][b as usize % 4].to_string(),
            ["2^{100000}", "4^{50000}", "2^{10^{9}}", "4^{5 \\cdot 10^{8}}", "720!", "((3!)!)!"][b as usize]
                .to_string(),
            format!("\\pm {b}"),
            format!("{a}\\pi"),
            format!("\\frac{{{a}\\pi}}{{{c}}}"),
            format!("e^{{{a}}}"),
            format!("\\sin({a})"),
            format!("\\{{\\begin{{pmatrix}} {a} & {b} \\end{{pmatrix}}\\}}"),
            format!("\\{{({a}, {b}), ({c}, {a})\\}}"),
            format!("\\{{({c}, {a}), ({a}, {b}.0)\\}}"),
            format!("\\{{\\{{{a}, {b}\\}}, {c}\\}}"),
            format!("\\{{{c}, \\{{{b}, {a}\\}}\\}}"),
            format!("\\{{x + {a}, x - {b}\\}}"),
            format!("\\{{-{b} + x, {a} + x\\}}"),
            format!("x - {a} = {b}"),
            format!("{c}x = {}", a * c),
            format!("{a} = x"),
            format!("x \\le {a}"),
            format!("(-\\infty, {a}]"),
        ];
        forms[rng.gen_range(0..forms.len())].clone()
    }

    #[test]
    fn fingerprinted_vote_clusters_like_the_pairwise_one_on_a_random_mix() {
        use rand::{Rng, SeedableRng};
        for seed in 0..4 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let a: Vec<Option<String>> =
                (0..600).map(|_| if rng.gen_bool(0.02) { None } else { Some(random_answer(&mut rng)) }).collect();
            let v = majority_vote(&a);
            assert_eq!(v.cluster, quadratic_clusters(&a), "seed {seed}");
            let clusters = v.cluster.iter().flatten().max().map_or(0, |m| m + 1);
            assert!(clusters > 50 && clusters < 400, "a mix of equal and distinct answers: {clusters} clusters");
        }
    }

    #[test]
    fn fingerprinted_vote_clusters_like_the_pairwise_one_on_random_compositions() {
        use rand::{seq::SliceRandom, Rng, SeedableRng};
        const PIECES: &[&str] = &[
            "1",
            "2",
            "0",
            "3",
            "1.0",
            "0.5",
            ",",
            "x",
            "y",
            "e",
            "\\pi",
            "\\infty",
            "+",
            "-",
            "*",
            "/",
            "=",
            "<",
            "\\%",
            "!",
            "\\sqrt{2}",
            "\\{1, 2\\}",
            "(1, 2)",
            "[1, 2]",
            "(x, 1)",
            "2^{100000}",
            "4^{50000}",
            "2^{10^{9}}",
            "\\frac{1}{2}",
            "x^2",
            "(x+1)",
        ];
        for seed in 0..8 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let a: Vec<Option<String>> = (0..400)
                .map(|_| {
                    let n = rng.gen_range(1..9);
                    Some((0..n).map(|_| *PIECES.choose(&mut rng).unwrap()).collect::<String>())
                })
                .collect();
            assert_eq!(majority_vote(&a).cluster, quadratic_clusters(&a), "seed {seed}");
        }
    }

    #[test]
    fn unknown_comparisons_do_not_merge_clusters() {
        let a = s(&[Some("2^{10^{9}}"), Some("4^{5 \\cdot 10^{8}}"), Some("2^{100000}"), Some("4^{50000}")]);
        let v = majority_vote(&a);
        assert_eq!(v.cluster, vec![Some(0), Some(1), Some(2), Some(2)]);
        assert_eq!(rewards(Some("2^{10^{9}}"), &a), vec![1.0, 0.0, 0.0, 0.0]);
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
