//! The reward checker against Math-Verify's verdicts on the committed corpus
//! (tests/fixtures/reward/mathverify_cases.jsonl, written by scripts/mathverify_cases.py).
//! Known, deliberate disagreements are listed in tests/fixtures/reward/mathverify_exceptions.jsonl
//! with a reason each.

use grpo::reward::is_equivalent;
use std::collections::HashMap;

#[derive(serde::Deserialize)]
struct Case {
    category: String,
    gold: String,
    pred: String,
    expected: bool,
}

#[derive(serde::Deserialize)]
struct Exception {
    gold: String,
    pred: String,
    reason: String,
}

fn load<T: serde::de::DeserializeOwned>(name: &str) -> Vec<T> {
    let path = format!("{}/tests/fixtures/reward/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{path}: {e}: {l}")))
        .collect()
}

#[test]
fn agrees_with_math_verify() {
    let cases: Vec<Case> = load("mathverify_cases.jsonl");
    let exceptions: Vec<Exception> = load("mathverify_exceptions.jsonl");
    assert!(cases.len() >= 300, "corpus has {} cases", cases.len());
    let excepted: HashMap<(String, String), String> =
        exceptions.into_iter().map(|e| ((e.gold, e.pred), e.reason)).collect();
    let mut per_cat: HashMap<String, (usize, usize)> = HashMap::new();
    let mut failures = Vec::new();
    let mut used_exceptions = std::collections::HashSet::new();
    for c in &cases {
        let got = is_equivalent(&c.gold, &c.pred);
        let e = per_cat.entry(c.category.clone()).or_default();
        e.0 += 1;
        if got == c.expected {
            e.1 += 1;
            assert!(
                !excepted.contains_key(&(c.gold.clone(), c.pred.clone())),
                "listed as an exception but agrees: {} vs {}",
                c.gold,
                c.pred
            );
        } else if excepted.contains_key(&(c.gold.clone(), c.pred.clone())) {
            used_exceptions.insert((c.gold.clone(), c.pred.clone()));
        } else {
            failures.push(format!(
                "[{}] gold {:?} pred {:?}: Math-Verify {} ours {}",
                c.category, c.gold, c.pred, c.expected, got
            ));
        }
    }
    let agree: usize = per_cat.values().map(|v| v.1).sum();
    eprintln!("agreement with Math-Verify: {agree}/{} ({} listed exceptions)", cases.len(), used_exceptions.len());
    let mut cats: Vec<_> = per_cat.iter().collect();
    cats.sort();
    for (k, (n, ok)) in cats {
        eprintln!("  {k:<18} {ok}/{n}");
    }
    assert_eq!(used_exceptions.len(), excepted.len(), "every listed exception must be used");
    assert!(failures.is_empty(), "{} disagreements:\n{}", failures.len(), failures.join("\n"));
}
