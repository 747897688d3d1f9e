//! The verdicts on the responses to one question, against the gold answer or, without one, against the
//! majority: the one decision behind `grpo eval`, validation during training and `grpo score`.

use super::equiv::{equivalent_parsed, Equivalence, ParsedAnswer};
use super::extract::{extract_answer, ExtractOptions};
use super::metrics::ItemOutcome;
use super::vote::majority_vote_parsed;

/// What [`judge`] decided about a group of responses.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdicts {
    /// The extracted answer of each response (None: no answer found).
    pub preds: Vec<Option<String>>,
    /// Per response: equivalent to the gold answer, or without gold a member of the majority cluster.
    pub correct: Vec<bool>,
    /// Per response: its equivalence to the gold answer (without gold: to the majority answer, for a
    /// response outside the majority cluster) could not be decided ([`Equivalence::Unknown`]). Such a
    /// response is not correct (it earns no reward) but it is not known to be wrong either.
    pub unknown: Vec<bool>,
    /// The majority answer (None when no response has an answer).
    pub majority: Option<String>,
    /// Whether the majority answer is equivalent to the gold answer (None without gold).
    pub majority_correct: Option<bool>,
}

impl Verdicts {
    /// The outcome that [`super::summarize`] aggregates.
    pub fn outcome(&self) -> ItemOutcome {
        ItemOutcome {
            correct: self.correct.clone(),
            unknown: self.unknown.iter().filter(|u| **u).count(),
            extracted: self.preds.iter().filter(|p| p.is_some()).count(),
            majority_correct: self.majority_correct,
        }
    }
}

/// Extract the answer of each response and judge it: against `gold` (gold first, Math-Verify semantics)
/// when given, else against the majority vote (correct = member of the winning cluster; a response
/// outside it whose comparison with the winner is unknown is reported as unknown). Every answer is
/// parsed once.
pub fn judge<S: AsRef<str>>(gold: Option<&str>, responses: &[S], opts: &ExtractOptions) -> Verdicts {
    let preds: Vec<Option<String>> = responses.iter().map(|r| extract_answer(r.as_ref(), opts)).collect();
    let parsed: Vec<Option<ParsedAnswer>> = preds.iter().map(|p| p.as_deref().map(ParsedAnswer::new)).collect();
    let vote = majority_vote_parsed(&preds, &parsed);
    let gold = gold.map(ParsedAnswer::new);
    // The winner's representative: the first response whose answer is the vote's answer.
    let rep = vote.answer.as_ref().and_then(|a| preds.iter().position(|p| p.as_ref() == Some(a)));
    let winner = rep.and_then(|i| vote.cluster[i]);
    let rep_parsed = rep.and_then(|i| parsed[i].as_ref());
    let verdicts: Vec<Equivalence> = parsed
        .iter()
        .zip(&vote.cluster)
        .map(|(p, c)| match (&gold, p) {
            (Some(g), Some(p)) => equivalent_parsed(g, p),
            (None, Some(_)) if winner.is_some() && *c == winner => Equivalence::Equal,
            (None, Some(p)) => rep_parsed.map_or(Equivalence::NotEqual, |r| {
                // Outside the winning cluster: never equal to its representative, maybe unknown.
                match equivalent_parsed(r, p) {
                    Equivalence::Unknown => Equivalence::Unknown,
                    _ => Equivalence::NotEqual,
                }
            }),
            _ => Equivalence::NotEqual,
        })
        .collect();
    let majority_correct =
        gold.as_ref().map(|g| rep_parsed.is_some_and(|p| equivalent_parsed(g, p) == Equivalence::Equal));
    Verdicts {
        preds,
        correct: verdicts.iter().map(|v| *v == Equivalence::Equal).collect(),
        unknown: verdicts.iter().map(|v| *v == Equivalence::Unknown).collect(),
        majority: vote.answer,
        majority_correct,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RESPONSES: [&str; 5] = ["so \\boxed{025}", "\\boxed{26}", "no answer", "\\boxed{25}", "\\boxed{26.0}"];

    #[test]
    fn against_gold() {
        let v = judge(Some("25"), &RESPONSES, &ExtractOptions::default());
        assert_eq!(v.preds[2], None);
        assert_eq!(v.correct, vec![true, false, false, true, false]);
        // 025 and 25 form the first cluster of two, 26 and 26.0 the second: the first wins the tie.
        assert_eq!((v.majority.as_deref(), v.majority_correct), (Some("025"), Some(true)));
        assert_eq!(judge(Some("26"), &RESPONSES, &ExtractOptions::default()).majority_correct, Some(false));
        let o = v.outcome();
        assert_eq!((o.extracted, o.majority_correct), (4, Some(true)));
    }

    #[test]
    fn against_the_majority_without_gold() {
        let v = judge(None, &["\\boxed{1/2}", "\\boxed{3}", "\\boxed{0.5}", "none"], &ExtractOptions::default());
        assert_eq!(v.correct, vec![true, false, true, false]);
        assert_eq!((v.majority.as_deref(), v.majority_correct), (Some("1/2"), None));
        let none = judge(None, &["none", "nothing"], &ExtractOptions::default());
        assert_eq!((none.correct, none.majority), (vec![false, false], None));
    }

    #[test]
    fn undecided_comparisons_are_unknown_not_wrong() {
        let responses = ["\\boxed{4^{5 \\cdot 10^{8}}}", "\\boxed{2^{100000}}", "\\boxed{3}", "none"];
        let v = judge(Some("2^{10^{9}}"), &responses, &ExtractOptions::default());
        assert_eq!(v.correct, vec![false, false, false, false]);
        // Past the limits of exact arithmetic, even 3 is not known to differ (the float value of such an
        // expression says nothing about its size).
        assert_eq!(v.unknown, vec![true, true, true, false]);
        assert_eq!(v.outcome().unknown, 3);
        let v = judge(Some("4^{50000}"), &responses, &ExtractOptions::default());
        assert_eq!((v.correct, v.unknown), (vec![false, true, false, false], vec![true, false, false, false]));
        // Without gold: the unknown comparison does not merge clusters; against the winner it is unknown.
        let v = judge(
            None,
            &["\\boxed{2^{10^{9}}}", "\\boxed{4^{5 \\cdot 10^{8}}}", "\\boxed{2^{10^{9}}}"],
            &ExtractOptions::default(),
        );
        assert_eq!(v.correct, vec![true, false, true]);
        assert_eq!(v.unknown, vec![false, true, false]);
    }
}
