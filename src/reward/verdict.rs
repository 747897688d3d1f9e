//! The verdicts on the responses to one question, against the gold answer or, without one, against the
//! majority: the one decision behind `grpo eval`, validation during training and `grpo score`.

use super::equiv::{equivalent_parsed, ParsedAnswer};
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
            extracted: self.preds.iter().filter(|p| p.is_some()).count(),
            majority_correct: self.majority_correct,
        }
    }
}

/// Extract the answer of each response and judge it: against `gold` (gold first, Math-Verify semantics)
/// when given, else against the majority vote (correct = member of the winning cluster). Every answer is
/// parsed once.
pub fn judge<S: AsRef<str>>(gold: Option<&str>, responses: &[S], opts: &ExtractOptions) -> Verdicts {
    let preds: Vec<Option<String>> = responses.iter().map(|r| extract_answer(r.as_ref(), opts)).collect();
    let parsed: Vec<Option<ParsedAnswer>> = preds.iter().map(|p| p.as_deref().map(ParsedAnswer::new)).collect();
    let vote = majority_vote_parsed(&preds, &parsed);
    let gold = gold.map(ParsedAnswer::new);
    // The winner's representative: the first response whose answer is the vote's answer.
    let rep = vote.answer.as_ref().and_then(|a| preds.iter().position(|p| p.as_ref() == Some(a)));
    let winner = rep.and_then(|i| vote.cluster[i]);
    let correct: Vec<bool> = parsed
        .iter()
        .zip(&vote.cluster)
        .map(|(p, c)| match (&gold, p) {
            (Some(g), Some(p)) => equivalent_parsed(g, p),
            (None, Some(_)) => winner.is_some() && *c == winner,
            _ => false,
        })
        .collect();
    let majority_correct =
        gold.as_ref().map(|g| rep.and_then(|i| parsed[i].as_ref()).is_some_and(|p| equivalent_parsed(g, p)));
    Verdicts { preds, correct, majority: vote.answer, majority_correct }
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
}
