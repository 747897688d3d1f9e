//! Equivalence of a gold answer and a predicted one, following Math-Verify's semantics (gold first).
//!
//! The order of checks mirrors Math-Verify's `sympy_expr_eq`:
//! 1. equal normalised strings;
//! 2. assignments (`x = 5`) are unwrapped following the gold's form: an equation in the prediction
//!    against a plain gold value compares the right-hand side, and so on;
//! 3. relations compare `lhs - rhs` (same operator, or the flipped one with the sides swapped;
//!    like Math-Verify, `2x = 4` is not `x = 2`);
//! 4. sets (order-free), tuples (ordered), intervals (open/closed ends must match) and unions;
//!    a plain value against a set is a one-element set; an open interval `(a, b)` equals the
//!    pair `a, b`;
//! 5. words (`\text{yes}`) and single letters compare by name, case-insensitively;
//! 6. numbers: when either side is a decimal, both are rounded to 6 decimal places (an exact
//!    integer only equals a decimal whose value is exactly that integer: 1 != 0.9999999, 27 = 27.0);
//!    percentages compare as the number (25\% = 25) or as the fraction (25\% = 0.25 = 1/4);
//!    otherwise exact rational equality, or for irrational values agreement to 12 significant digits;
//! 7. expressions with variables are compared at sample points (both signs), 12 points, agreeing to
//!    1e-9 relative where both are defined, with at least 3 defined points.

use super::eval::{approx, exact, exact_big, free_symbols, has_float, round6_exact, round6_f64};
use super::parse::{canonical, parse, Node, RelOp};
use num_rational::BigRational;

/// An answer parsed once, for repeated comparisons (majority voting, rewards of a group).
#[derive(Debug, Clone)]
pub struct ParsedAnswer {
    key: String,
    node: Option<Node>,
}

impl ParsedAnswer {
    /// Normalise and parse `s` (never fails: an unparsable answer is compared by its string).
    pub fn new(s: &str) -> Self {
        ParsedAnswer { key: canonical(s), node: parse(s).ok() }
    }

    /// The normalised string: answers with the same non-empty key are equivalent.
    pub(super) fn key(&self) -> &str {
        &self.key
    }

    /// For a plain number (no variable, word, relation or structure anywhere) whose value is known as
    /// a float: that value and, for a percentage, the value without the percent. Two such answers are
    /// only ever equivalent (other than by equal keys) when a value of one is within
    /// `max(1.5e-6, 2e-12 |x|)` of a value of the other, or both are the same infinity: the values
    /// let majority voting compare an answer with nearby answers only.
    pub(super) fn numeric_values(&self) -> Option<Vec<f64>> {
        let node = self.node.as_ref()?;
        let mut plain = true;
        super::eval::visit(node, &mut |n| {
            plain &= !matches!(
                n,
                Node::Sym(_)
                    | Node::Text(_)
                    | Node::Rel(..)
                    | Node::Tuple(_)
                    | Node::Set(_)
                    | Node::Interval { .. }
                    | Node::Union(_)
                    | Node::Matrix(_)
            )
        });
        if !plain {
            return None;
        }
        let info = Info::new(node);
        // A value too large or too small for exact evaluation may be decided exactly later
        // (`big_equal`) while its float is meaningless: such values are compared with everything.
        if info.approx.is_nan() || (info.exact.is_none() && (info.approx == 0.0 || info.approx.is_infinite())) {
            return None;
        }
        let mut values = vec![info.approx];
        if let Some(s) = &info.stripped {
            let s = num_traits::ToPrimitive::to_f64(s).filter(|v| !v.is_nan())?;
            if s != info.approx {
                values.push(s);
            }
        }
        Some(values)
    }
}

/// Whether `pred` is equivalent to `gold` (gold first: assignments and equations are unwrapped
/// following the gold's form, as in Math-Verify).
pub fn equivalent_parsed(gold: &ParsedAnswer, pred: &ParsedAnswer) -> bool {
    if gold.key.is_empty() || pred.key.is_empty() {
        return false;
    }
    if gold.key == pred.key {
        return true;
    }
    match (&gold.node, &pred.node) {
        (Some(g), Some(p)) => top_eq(g, p),
        _ => false,
    }
}

fn only_symbols(n: &Node) -> bool {
    match n {
        Node::Sym(_) => true,
        Node::Mul(fs) => fs.iter().all(|f| matches!(f, Node::Sym(_) | Node::E)),
        _ => false,
    }
}

fn is_equation(n: &Node) -> bool {
    matches!(n, Node::Rel(_, ops) if ops.iter().all(|o| *o == RelOp::Eq))
}

fn is_assignment(n: &Node) -> bool {
    matches!(n, Node::Rel(sides, _) if is_equation(n) && only_symbols(&sides[0]))
}

/// `a = b = c` as an assignment keeps `a = c`.
fn truncate_assignment(n: &Node) -> Node {
    match n {
        Node::Rel(sides, _) if sides.len() > 2 => {
            Node::Rel(vec![sides[0].clone(), sides[sides.len() - 1].clone()], vec![RelOp::Eq])
        }
        other => other.clone(),
    }
}

fn last_rhs(n: &Node) -> Node {
    match n {
        Node::Rel(sides, _) => sides[sides.len() - 1].clone(),
        other => other.clone(),
    }
}

fn top_eq(gold: &Node, pred: &Node) -> bool {
    let (g_assign, p_assign) = (is_assignment(gold), is_assignment(pred));
    let (g_eq, p_eq) = (is_equation(gold), is_equation(pred));
    let mut g = if g_assign { truncate_assignment(gold) } else { gold.clone() };
    let mut p = if p_assign { truncate_assignment(pred) } else { pred.clone() };
    if p_eq && !g_eq {
        p = last_rhs(&p);
    } else if g_assign && !p_eq {
        g = last_rhs(&g);
    }
    node_eq(&g, &p)
}

fn is_setlike(n: &Node) -> bool {
    matches!(n, Node::Set(_) | Node::Tuple(_) | Node::Interval { .. } | Node::Union(_))
}

fn node_eq(g: &Node, p: &Node) -> bool {
    if g == p {
        return true;
    }
    match (g, p) {
        (Node::Rel(gs, gops), Node::Rel(ps, pops)) => rel_eq(gs, gops, ps, pops),
        // An inequality in one variable against an interval: its solution set (gold side only, as in
        // Math-Verify: `x > 2` = `(2, \infty)` but not the other way round).
        (Node::Rel(sides, ops), _) if is_setlike(p) => relation_as_interval(sides, ops).is_some_and(|i| set_eq(&i, p)),
        (Node::Rel(..), _) | (_, Node::Rel(..)) => false,
        _ if is_setlike(g) || is_setlike(p) => set_eq(g, p),
        (Node::Matrix(a), Node::Matrix(b)) => {
            a.len() == b.len()
                && a.iter().zip(b).all(|(ra, rb)| ra.len() == rb.len() && ra.iter().zip(rb).all(|(x, y)| node_eq(x, y)))
        }
        (Node::Matrix(_), _) | (_, Node::Matrix(_)) => false,
        (Node::Text(_) | Node::Sym(_), _) | (_, Node::Text(_) | Node::Sym(_)) => word_eq(g, p),
        _ => scalar_eq(g, p),
    }
}

/// The name of a word-like answer: a `\text` word, a letter, or letters written side by side.
fn word(n: &Node) -> Option<String> {
    match n {
        Node::Text(w) => Some(w.replace(' ', "")),
        Node::Sym(s) => Some(s.clone()),
        Node::E => Some("e".into()),
        Node::Mul(fs) => fs.iter().map(word).collect(),
        _ => None,
    }
}

fn word_eq(g: &Node, p: &Node) -> bool {
    match (word(g), word(p)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

fn dedup(v: &[Node]) -> Vec<&Node> {
    let mut out: Vec<&Node> = Vec::with_capacity(v.len());
    for x in v {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

fn ordered_eq(a: &[&Node], b: &[&Node]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| node_eq(x, y))
}

/// Each gold element matched to a distinct equivalent predicted element.
fn unordered_eq(a: &[&Node], b: &[&Node]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut used = vec![false; b.len()];
    'outer: for x in a {
        for (j, y) in b.iter().enumerate() {
            if !used[j] && node_eq(x, y) {
                used[j] = true;
                continue 'outer;
            }
        }
        return false;
    }
    true
}

fn set_eq(g: &Node, p: &Node) -> bool {
    let gw;
    let pw;
    let g = if is_setlike(g) {
        g
    } else {
        gw = Node::Set(vec![g.clone()]);
        &gw
    };
    let p = if is_setlike(p) {
        p
    } else {
        pw = Node::Set(vec![p.clone()]);
        &pw
    };
    match (g, p) {
        (
            Node::Interval { lo: a, hi: b, lo_open: ao, hi_open: bo },
            Node::Interval { lo: c, hi: d, lo_open: co, hi_open: do_ },
        ) => ao == co && bo == do_ && node_eq(a, c) && node_eq(b, d),
        (Node::Union(a), Node::Union(b)) => {
            let a: Vec<&Node> = a.iter().collect();
            let b: Vec<&Node> = b.iter().collect();
            unordered_eq(&a, &b)
        }
        (Node::Union(_), _) | (_, Node::Union(_)) => false,
        (Node::Set(a), Node::Set(b)) => unordered_eq(&dedup(a), &dedup(b)),
        (Node::Tuple(a), Node::Tuple(b)) => ordered_eq(&a.iter().collect::<Vec<_>>(), &b.iter().collect::<Vec<_>>()),
        (Node::Tuple(a), Node::Set(b)) => ordered_eq(&a.iter().collect::<Vec<_>>(), &b.iter().collect::<Vec<_>>()),
        (Node::Set(a), Node::Tuple(b)) => unordered_eq(&dedup(a), &b.iter().collect::<Vec<_>>()),
        (Node::Interval { lo, hi, lo_open: true, hi_open: true }, Node::Set(b) | Node::Tuple(b)) if b.len() == 2 => {
            ordered_eq(&[lo.as_ref(), hi.as_ref()], &b.iter().collect::<Vec<_>>())
        }
        (Node::Set(a), Node::Interval { lo, hi, lo_open: true, hi_open: true }) if a.len() == 2 => {
            unordered_eq(&a.iter().collect::<Vec<_>>(), &[lo.as_ref(), hi.as_ref()])
        }
        (Node::Tuple(a), Node::Interval { lo, hi, lo_open: true, hi_open: true }) if a.len() == 2 => {
            ordered_eq(&a.iter().collect::<Vec<_>>(), &[lo.as_ref(), hi.as_ref()])
        }
        _ => false,
    }
}

fn is_constant(n: &Node) -> bool {
    free_symbols(n).is_empty() && !is_setlike(n)
}

fn neg_inf() -> Node {
    Node::Neg(Box::new(Node::Inf))
}

/// `x > c`, `c < x`, `a < x \le b` as an interval (None for anything else).
fn relation_as_interval(sides: &[Node], ops: &[RelOp]) -> Option<Node> {
    let interval = |lo: Node, hi: Node, lo_open: bool, hi_open: bool| Node::Interval {
        lo: Box::new(lo),
        hi: Box::new(hi),
        lo_open,
        hi_open,
    };
    match (sides, ops) {
        ([a, b], [op]) => {
            // Put the variable on the left.
            let (c, op) = match (a, b) {
                (Node::Sym(_), c) if is_constant(c) => (c, *op),
                (c, Node::Sym(_)) if is_constant(c) => (c, op.flipped()),
                _ => return None,
            };
            match op {
                RelOp::Gt => Some(interval(c.clone(), Node::Inf, true, true)),
                RelOp::Ge => Some(interval(c.clone(), Node::Inf, false, true)),
                RelOp::Lt => Some(interval(neg_inf(), c.clone(), true, true)),
                RelOp::Le => Some(interval(neg_inf(), c.clone(), true, false)),
                _ => None,
            }
        }
        ([lo, Node::Sym(_), hi], [o1, o2]) if is_constant(lo) && is_constant(hi) => {
            let open = |o: &RelOp| match o {
                RelOp::Lt => Some(true),
                RelOp::Le => Some(false),
                _ => None,
            };
            Some(interval(lo.clone(), hi.clone(), open(o1)?, open(o2)?))
        }
        _ => None,
    }
}

fn diff(sides: &[Node], i: usize) -> Node {
    Node::Add(vec![sides[i].clone(), Node::Neg(Box::new(sides[i + 1].clone()))])
}

fn rel_eq(gs: &[Node], gops: &[RelOp], ps: &[Node], pops: &[RelOp]) -> bool {
    if gops.len() != pops.len() {
        return false;
    }
    (0..gops.len()).all(|i| {
        let (dg, dp) = (diff(gs, i), diff(ps, i));
        let (go, po) = (gops[i], pops[i]);
        // Side by side (needed when a side is a set: `x \in [a, b]`).
        if go == po && node_eq(&gs[i], &ps[i]) && node_eq(&gs[i + 1], &ps[i + 1]) {
            return true;
        }
        if go == po && scalar_eq(&dg, &dp) {
            return true;
        }
        if go.flipped() == po && scalar_eq(&dg, &Node::Neg(Box::new(dp.clone()))) {
            return true;
        }
        false
    })
}

const N_POINTS: usize = 12;

/// Deterministic sample value of variable `name` at point `k`: points 0..6 positive, 6..12 negative.
fn sample(name: &str, k: usize) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x1000_0000_01b3);
    }
    h ^= (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h = (h ^ (h >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 29;
    let u = (h >> 11) as f64 / (1u64 << 53) as f64;
    let v = 0.3 + 2.4 * u;
    if k < N_POINTS / 2 {
        v
    } else {
        -v
    }
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    if a.is_infinite() || b.is_infinite() {
        return a == b;
    }
    (a - b).abs() <= tol * 1f64.max(a.abs()).max(b.abs())
}

/// Values of both sides at the sample points where both are finite.
fn sampled(g: &Node, p: &Node) -> Vec<(f64, f64)> {
    (0..N_POINTS)
        .map(|k| {
            let env = |s: &str| sample(s, k);
            (approx(g, &env), approx(p, &env))
        })
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .collect()
}

fn random_eq(g: &Node, p: &Node) -> bool {
    let pts = sampled(g, p);
    pts.len() >= 3 && pts.iter().all(|(a, b)| close(*a, *b, 1e-9))
}

/// What Math-Verify's numeric comparison needs to know about a variable-free value.
struct Info {
    /// The value (a percentage divided by 100), when rational.
    exact: Option<BigRational>,
    /// The value without the percentage (25 for 25\%).
    stripped: Option<BigRational>,
    float: bool,
    approx: f64,
}

impl Info {
    fn new(n: &Node) -> Info {
        let exact = exact(n);
        let stripped = match n {
            Node::Pct(inner) => super::eval::exact(inner),
            _ => exact.clone(),
        };
        let approx = match &exact {
            Some(v) => num_traits::ToPrimitive::to_f64(v).unwrap_or(f64::NAN),
            None => approx(n, &|_| f64::NAN),
        };
        Info { exact, stripped, float: has_float(n), approx }
    }

    /// A plain number once evaluated (sympy's atomic Number).
    fn atomic(&self) -> bool {
        self.exact.is_some()
    }

    fn is_float(&self) -> bool {
        self.atomic() && self.float
    }

    fn int_like(&self) -> bool {
        !self.float && self.stripped.as_ref().is_some_and(|v| v.is_integer())
    }

    /// Rounded to 6 places: (is an exact integer, millionths).
    fn rounded(&self) -> Option<(bool, num_bigint::BigInt)> {
        match &self.exact {
            Some(v) if !self.float && v.is_integer() => Some((true, v.to_integer())),
            Some(v) => Some((false, round6_exact(v))),
            None => round6_f64(self.approx).map(|r| (false, r)),
        }
    }

    fn same_value(&self, o: &Info) -> bool {
        match (&self.exact, &o.exact) {
            (Some(a), Some(b)) => a == b,
            (Some(_), None) | (None, Some(_)) | (None, None) => {
                self.approx.is_finite() && o.approx.is_finite() && close(self.approx, o.approx, 1e-12)
            }
        }
    }
}

/// Whether `\\infty` is written in the node (an overflowing value is not infinity).
fn contains_inf(n: &Node) -> bool {
    let mut found = false;
    super::eval::visit(n, &mut |x| found |= matches!(x, Node::Inf));
    found
}

fn scalar_eq(g: &Node, p: &Node) -> bool {
    if !free_symbols(g).is_empty() || !free_symbols(p).is_empty() {
        return random_eq(g, p);
    }
    let (gi, pi) = (Info::new(g), Info::new(p));
    if gi.atomic() || pi.atomic() {
        if gi.is_float() || pi.is_float() {
            if let (Some(a), Some(b)) = (gi.rounded(), pi.rounded()) {
                if a == b {
                    return true;
                }
            }
        } else if gi.int_like() && pi.int_like() {
            if gi.stripped == pi.stripped {
                return true;
            }
        } else if gi.same_value(&pi) {
            return true;
        }
    } else if contains_inf(g) && contains_inf(p) && gi.approx.is_infinite() && gi.approx == pi.approx {
        return true;
    }
    let one_too_large = !gi.atomic() || !pi.atomic();
    if one_too_large && !gi.float && !pi.float && big_equal(g, p, &gi, &pi) {
        return true;
    }
    gi.same_value(&pi)
}

/// Exact equality of two integers or fractions when one is too large for [`exact`] (`2^{100000}` and
/// `4^{50000}`, `720!` and `((3!)!)!`), with the larger limits of [`exact_big`]. Past those limits
/// equality is unknown, and the answers are not called equivalent (the float comparison that follows
/// cannot tell such values apart either way).
fn big_equal(g: &Node, p: &Node, gi: &Info, pi: &Info) -> bool {
    let Some(a) = gi.exact.clone().or_else(|| exact_big(g)) else { return false };
    pi.exact.clone().or_else(|| exact_big(p)).is_some_and(|b| a == b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eq(g: &str, p: &str) -> bool {
        equivalent_parsed(&ParsedAnswer::new(g), &ParsedAnswer::new(p))
    }

    #[test]
    fn numbers() {
        assert!(eq("025", "25"));
        assert!(eq("1,000", "1000"));
        assert!(eq("27", "27.0"));
        assert!(!eq("1", "0.9999999"));
        assert!(eq("\\frac13", "0.3333333"));
        assert!(!eq("\\frac13", "0.333"));
        assert!(eq("25\\%", "25"));
        assert!(eq("25\\%", "0.25"));
        assert!(!eq("12.5\\%", "12.5"));
        assert!(eq("2^{100}", "1267650600228229401496703205376"));
        assert!(!eq("2^{100}", "1267650600228229401496703205377"));
    }

    #[test]
    fn huge_values_are_decided_exactly() {
        let t = std::time::Instant::now();
        assert!(eq("2^{100000}", "4^{50000}"));
        assert!(eq("4^{50000}", "2^{100000}"));
        assert!(eq("720!", "((3!)!)!"));
        assert!(eq("2^{5000}", &num_bigint::BigInt::from(2).pow(5000).to_string()));
        assert!(eq("\\frac{2^{100000}}{4^{49999}}", "4"));
        assert!(!eq("2^{100000}", "2^{100001}"));
        assert!(!eq("720!", "721!"));
        assert!(!eq("720!", "((3!)!)! + 1"));
        assert!(!eq("2^{10^{9}}", "4^{5 \\cdot 10^{8}}"), "past the limits: unknown, not called equal");
        assert!(t.elapsed().as_secs_f64() < 1.0, "took {:?}", t.elapsed());
    }

    #[test]
    fn structures() {
        assert!(eq("(1,2)", "\\{1,2\\}"));
        assert!(!eq("(1,2)", "(2,1)"));
        assert!(!eq("(1,2]", "[1,2]"));
        assert!(eq("\\{1,2\\}", "\\{2,1\\}"));
        assert!(eq("5", "x = 5"));
        assert!(!eq("x=5", "y=5"));
        assert!(eq("x > 2", "2 < x"));
        assert!(!eq("x > 2", "x \\ge 2"));
        assert!(eq("(x+1)^2", "x^2+2x+1"));
        assert!(!eq("\\sqrt{x^2}", "x"));
        assert!(eq("\\text{yes}", "yes"));
    }

    #[test]
    fn adversarial_inputs_are_quick() {
        let t = std::time::Instant::now();
        assert!(!eq("10^{10^{10}}", "10^{10^{11}}"));
        assert!(eq("10^{10^{10}}", "10^{10^{10}}"));
        let deep = format!("{}1{}", "{".repeat(10_000), "}".repeat(10_000));
        assert!(!eq(&deep, "1"));
        let unbalanced = "\\frac{1}{2".repeat(100);
        assert!(!eq(&unbalanced, "0.5"));
        assert!(t.elapsed().as_secs_f64() < 1.0);
    }

    /// The gold answers of MATH-500 (tests/fixtures/reward/math500_answers.jsonl, from
    /// hkust-nlp/simpleRL-reason math500, MIT) are understood as mathematics, not only compared as strings.
    #[test]
    fn math500_answers_parse() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/reward/math500_answers.jsonl");
        let text = std::fs::read_to_string(path).unwrap();
        let answers: Vec<String> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["answer"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(answers.len(), 500);
        let failed: Vec<&String> = answers.iter().filter(|a| ParsedAnswer::new(a).node.is_none()).collect();
        assert!(failed.is_empty(), "{} of 500 MATH-500 answers not parsed: {failed:#?}", failed.len());
    }
}
