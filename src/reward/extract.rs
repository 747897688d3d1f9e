//! Final-answer extraction from a response: the last `\boxed{...}` / `\fbox{...}` (nested braces,
//! `\boxed 5` without braces), looking after `</think>` when the response has one; optional
//! fallbacks for evaluation. Linear time: one backwards search and one forward brace scan.

use std::sync::OnceLock;

/// Options of [`extract_answer`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExtractOptions {
    /// When no `\boxed{}` is found, try "the answer is X" and then the last number (evaluation only;
    /// off for training rewards).
    pub fallbacks: bool,
}

/// Longest answer returned (longer boxed contents are cut off as "no answer").
pub const MAX_ANSWER_BYTES: usize = 10_000;

/// The region of `text` the answer is taken from: after the last `</think>` when there is one.
fn answer_region(text: &str) -> &str {
    match text.rfind("</think>") {
        Some(p) => &text[p + "</think>".len()..],
        None => text,
    }
}

/// The content of the last `\boxed` / `\fbox` of `text`.
fn last_boxed(text: &str) -> Option<String> {
    let b = text.rfind("\\boxed").map(|p| (p, "\\boxed".len()));
    let f = text.rfind("\\fbox").map(|p| (p, "\\fbox".len()));
    let (pos, len) = match (b, f) {
        (Some(b), Some(f)) => {
            if b.0 > f.0 {
                b
            } else {
                f
            }
        }
        (Some(x), None) | (None, Some(x)) => x,
        (None, None) => return None,
    };
    let rest = &text[pos + len..];
    let trimmed = rest.trim_start_matches([' ', '\t']);
    if let Some(body) = trimmed.strip_prefix('{') {
        let mut depth = 1usize;
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        let ans = body[..i].trim();
                        return (!ans.is_empty() && ans.len() <= MAX_ANSWER_BYTES).then(|| ans.to_string());
                    }
                }
                _ => {}
            }
        }
        None
    } else if trimmed.len() < rest.len() {
        // `\boxed 5`: up to the next space, `$` or end of line.
        let end = trimmed.find(|c: char| c.is_whitespace() || c == '$').unwrap_or(trimmed.len());
        let ans = trimmed[..end].trim_end_matches(['.', ',']);
        (!ans.is_empty() && ans.len() <= MAX_ANSWER_BYTES).then(|| ans.to_string())
    } else {
        None
    }
}

fn answer_is_re() -> &'static regex::Regex {
    static RE: OnceLock<regex::Regex> = OnceLock::new();
    RE.get_or_init(|| {
        regex::Regex::new(r"(?i)(?:final answer|the answer)\s*(?:is|:|=)\s*:?\s*([^\n]{1,200})").expect("valid regex")
    })
}

fn number_re() -> &'static regex::Regex {
    static RE: OnceLock<regex::Regex> = OnceLock::new();
    RE.get_or_init(|| regex::Regex::new(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?").expect("valid regex"))
}

/// Clean "the answer is $\frac{1}{2}$." into "\frac{1}{2}".
fn clean_phrase(s: &str) -> Option<String> {
    let mut s = s.trim();
    // Stop at the end of the sentence: ". " or a final period.
    if let Some(p) = s.find(". ") {
        s = &s[..p];
    }
    let s = s.trim().trim_end_matches('.').trim();
    let s = s.trim_start_matches("\\(").trim_end_matches("\\)");
    let s = s.trim_start_matches("\\[").trim_end_matches("\\]");
    let s = s.trim_matches('$').trim().trim_matches('*').trim();
    (!s.is_empty()).then(|| s.to_string())
}

/// The final answer of `text`: the last `\boxed{...}` (after `</think>` when present), then, with
/// `opts.fallbacks`, the last "the answer is X" and the last number.
pub fn extract_answer(text: &str, opts: &ExtractOptions) -> Option<String> {
    let region = answer_region(text);
    if let Some(a) = last_boxed(region) {
        return Some(a);
    }
    if !opts.fallbacks {
        return None;
    }
    if let Some(a) = answer_is_re().captures_iter(region).last().and_then(|c| clean_phrase(&c[1])) {
        if let Some(b) = last_boxed(&a) {
            return Some(b);
        }
        return Some(a);
    }
    number_re().find_iter(region).last().map(|m| m.as_str().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(s: &str) -> Option<String> {
        extract_answer(s, &ExtractOptions::default())
    }

    fn exf(s: &str) -> Option<String> {
        extract_answer(s, &ExtractOptions { fallbacks: true })
    }

    #[test]
    fn boxed_forms() {
        assert_eq!(ex("so \\boxed{1} then \\boxed{\\frac{1}{2}}."), Some("\\frac{1}{2}".into()));
        assert_eq!(ex("\\boxed{\\{1, 2\\}}"), Some("\\{1, 2\\}".into()));
        assert_eq!(ex("answer: \\boxed 5."), Some("5".into()));
        assert_eq!(ex("\\fbox{7}"), Some("7".into()));
        assert_eq!(ex("\\boxed{}"), None);
        assert_eq!(ex("\\boxed{1"), None);
        assert_eq!(ex("no box, the answer is 5"), None);
    }

    #[test]
    fn think_blocks() {
        assert_eq!(ex("<think>\\boxed{1}</think> so \\boxed{2}"), Some("2".into()));
        assert_eq!(ex("<think>\\boxed{1}</think> no box"), None);
        assert_eq!(ex("<think>\\boxed{1} unfinished"), Some("1".into()));
    }

    #[test]
    fn fallbacks() {
        assert_eq!(exf("Thus the answer is $\\frac{3}{4}$. Done"), Some("\\frac{3}{4}".into()));
        assert_eq!(exf("Final answer: 42"), Some("42".into()));
        assert_eq!(exf("we get 3 apples and then 1,000 pears"), Some("1,000".into()));
        assert_eq!(exf("nothing"), None);
    }

    #[test]
    fn huge_and_nested_inputs() {
        let t = std::time::Instant::now();
        let big = format!("{}\\boxed{{{}}}", "x".repeat(10_000_000), "4");
        assert_eq!(ex(&big), Some("4".into()));
        let nested = format!("\\boxed{{{}1{}}}", "{".repeat(10_000), "}".repeat(10_000));
        // Too long to be an answer (MAX_ANSWER_BYTES): no answer, quickly.
        assert_eq!(ex(&nested), None);
        let nested = format!("\\boxed{{{}1{}}}", "{".repeat(1000), "}".repeat(1000));
        assert_eq!(ex(&nested).map(|a| a.len()), Some(2001));
        let unbalanced = format!("\\boxed{{{}", "{".repeat(100_000));
        assert_eq!(ex(&unbalanced), None);
        let many = "\\boxed{".repeat(200_000);
        assert_eq!(exf(&many), None);
        assert!(t.elapsed().as_secs_f64() < 2.0);
    }
}
