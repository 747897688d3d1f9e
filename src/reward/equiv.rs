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
//!
//! The outcome is three-way ([`Equivalence`]): rational values are compared exactly, first within small
//! size limits and then within larger ones (`2^{100000}` = `4^{50000}`, `720!` = `((3!)!)!`, a few
//! milliseconds each); a value past those limits (`2^{10^{9}}`), a non-rational value whose float
//! overflows (`e^{1000}`), or expressions defined at fewer than 3 sample points because of an overflow
//! give [`Equivalence::Unknown`] rather than an answer either way. Structures combine their parts'
//! outcomes: all parts Equal is Equal, any part NotEqual is NotEqual, else Unknown (sets: a matching on
//! Equal pairs is Equal, one that needs Unknown pairs is Unknown).

use super::eval::{approx, exact, exact_big, free_symbols, has_float, round6_exact, round6_f64, Inexact};
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

    /// The parsed answer (None when it could not be parsed: compared by its key only).
    pub(super) fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }
}

/// The three-way outcome of comparing two answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Equivalence {
    Equal,
    NotEqual,
    /// Equality could not be decided within the size limits of exact arithmetic (`2^{10^{9}}` against
    /// `4^{5 \cdot 10^{8}}`), or the values' floating-point approximations overflow: not called equal,
    /// and not called different either.
    Unknown,
}

use Equivalence::{Equal, NotEqual, Unknown};

impl Equivalence {
    fn decided(equal: bool) -> Self {
        if equal {
            Equal
        } else {
            NotEqual
        }
    }

    /// Kleene conjunction, lazily: any NotEqual decides, else any Unknown.
    fn all(parts: impl IntoIterator<Item = Equivalence>) -> Self {
        let mut out = Equal;
        for p in parts {
            match p {
                NotEqual => return NotEqual,
                Unknown => out = Unknown,
                Equal => {}
            }
        }
        out
    }

    /// Kleene disjunction, lazily: any Equal decides, else any Unknown.
    fn any(parts: impl IntoIterator<Item = Equivalence>) -> Self {
        let mut out = NotEqual;
        for p in parts {
            match p {
                Equal => return Equal,
                Unknown => out = Unknown,
                NotEqual => {}
            }
        }
        out
    }
}

/// Whether `pred` is equivalent to `gold` (gold first: assignments and equations are unwrapped
/// following the gold's form, as in Math-Verify).
pub fn equivalent_parsed(gold: &ParsedAnswer, pred: &ParsedAnswer) -> Equivalence {
    if gold.key.is_empty() || pred.key.is_empty() {
        return NotEqual;
    }
    if gold.key == pred.key {
        return Equal;
    }
    match (&gold.node, &pred.node) {
        (Some(g), Some(p)) => top_eq(g, p),
        _ => NotEqual,
    }
}

fn only_symbols(n: &Node) -> bool {
    match n {
        Node::Sym(_) => true,
        Node::Mul(fs) => fs.iter().all(|f| matches!(f, Node::Sym(_) | Node::E)),
        _ => false,
    }
}

pub(super) fn is_equation(n: &Node) -> bool {
    matches!(n, Node::Rel(_, ops) if ops.iter().all(|o| *o == RelOp::Eq))
}

pub(super) fn is_assignment(n: &Node) -> bool {
    matches!(n, Node::Rel(sides, _) if is_equation(n) && only_symbols(&sides[0]))
}

/// `a = b = c` as an assignment keeps `a = c`.
pub(super) fn truncate_assignment(n: &Node) -> Node {
    match n {
        Node::Rel(sides, _) if sides.len() > 2 => {
            Node::Rel(vec![sides[0].clone(), sides[sides.len() - 1].clone()], vec![RelOp::Eq])
        }
        other => other.clone(),
    }
}

pub(super) fn last_rhs(n: &Node) -> Node {
    match n {
        Node::Rel(sides, _) => sides[sides.len() - 1].clone(),
        other => other.clone(),
    }
}

fn top_eq(gold: &Node, pred: &Node) -> Equivalence {
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

pub(super) fn is_setlike(n: &Node) -> bool {
    matches!(n, Node::Set(_) | Node::Tuple(_) | Node::Interval { .. } | Node::Union(_))
}

fn node_eq(g: &Node, p: &Node) -> Equivalence {
    if g == p {
        return Equal;
    }
    match (g, p) {
        (Node::Rel(gs, gops), Node::Rel(ps, pops)) => rel_eq(gs, gops, ps, pops),
        // An inequality in one variable against an interval: its solution set (gold side only, as in
        // Math-Verify: `x > 2` = `(2, \infty)` but not the other way round).
        (Node::Rel(sides, ops), _) if is_setlike(p) => {
            relation_as_interval(sides, ops).map_or(NotEqual, |i| set_eq(&i, p))
        }
        (Node::Rel(..), _) | (_, Node::Rel(..)) => NotEqual,
        _ if is_setlike(g) || is_setlike(p) => set_eq(g, p),
        (Node::Matrix(a), Node::Matrix(b)) => {
            if a.len() != b.len() || a.iter().zip(b).any(|(ra, rb)| ra.len() != rb.len()) {
                return NotEqual;
            }
            Equivalence::all(a.iter().zip(b).flat_map(|(ra, rb)| ra.iter().zip(rb)).map(|(x, y)| node_eq(x, y)))
        }
        (Node::Matrix(_), _) | (_, Node::Matrix(_)) => NotEqual,
        (Node::Text(_) | Node::Sym(_), _) | (_, Node::Text(_) | Node::Sym(_)) => Equivalence::decided(word_eq(g, p)),
        _ => scalar_eq(g, p),
    }
}

/// The name of a word-like answer: a `\text` word, a letter, or letters written side by side.
pub(super) fn word(n: &Node) -> Option<String> {
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

pub(super) fn dedup(v: &[Node]) -> Vec<&Node> {
    let mut out: Vec<&Node> = Vec::with_capacity(v.len());
    for x in v {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

fn ordered_eq(a: &[&Node], b: &[&Node]) -> Equivalence {
    if a.len() != b.len() {
        return NotEqual;
    }
    Equivalence::all(a.iter().zip(b).map(|(x, y)| node_eq(x, y)))
}

/// Each gold element matched to a distinct equivalent predicted element (greedily, in order). Equal
/// when the matching succeeds on Equal pairs; Unknown when it fails on those but succeeds when Unknown
/// pairs may match too; else NotEqual.
fn unordered_eq(a: &[&Node], b: &[&Node]) -> Equivalence {
    if a.len() != b.len() {
        return NotEqual;
    }
    let mut memo: Vec<Option<Equivalence>> = vec![None; a.len() * b.len()];
    let mut cmp = |i: usize, j: usize| *memo[i * b.len() + j].get_or_insert_with(|| node_eq(a[i], b[j]));
    let mut greedy = |accept: &dyn Fn(Equivalence) -> bool| {
        let mut used = vec![false; b.len()];
        (0..a.len()).all(|i| match (0..b.len()).find(|&j| !used[j] && accept(cmp(i, j))) {
            Some(j) => {
                used[j] = true;
                true
            }
            None => false,
        })
    };
    if greedy(&|e| e == Equal) {
        Equal
    } else if greedy(&|e| e != NotEqual) {
        Unknown
    } else {
        NotEqual
    }
}

fn set_eq(g: &Node, p: &Node) -> Equivalence {
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
        ) => {
            if ao != co || bo != do_ {
                return NotEqual;
            }
            Equivalence::all([(a, c), (b, d)].into_iter().map(|(x, y)| node_eq(x, y)))
        }
        (Node::Union(a), Node::Union(b)) => unordered_eq(&refs(a), &refs(b)),
        (Node::Union(_), _) | (_, Node::Union(_)) => NotEqual,
        (Node::Set(a), Node::Set(b)) => unordered_eq(&dedup(a), &dedup(b)),
        (Node::Tuple(a), Node::Tuple(b)) => ordered_eq(&refs(a), &refs(b)),
        (Node::Tuple(a), Node::Set(b)) => ordered_eq(&refs(a), &refs(b)),
        (Node::Set(a), Node::Tuple(b)) => unordered_eq(&dedup(a), &refs(b)),
        (Node::Interval { lo, hi, lo_open: true, hi_open: true }, Node::Set(b) | Node::Tuple(b)) if b.len() == 2 => {
            ordered_eq(&[lo.as_ref(), hi.as_ref()], &refs(b))
        }
        (Node::Set(a), Node::Interval { lo, hi, lo_open: true, hi_open: true }) if a.len() == 2 => {
            unordered_eq(&refs(a), &[lo.as_ref(), hi.as_ref()])
        }
        (Node::Tuple(a), Node::Interval { lo, hi, lo_open: true, hi_open: true }) if a.len() == 2 => {
            ordered_eq(&refs(a), &[lo.as_ref(), hi.as_ref()])
        }
        _ => NotEqual,
    }
}

fn refs(v: &[Node]) -> Vec<&Node> {
    v.iter().collect()
}

fn is_constant(n: &Node) -> bool {
    free_symbols(n).is_empty() && !is_setlike(n)
}

fn neg_inf() -> Node {
    Node::Neg(Box::new(Node::Inf))
}

/// `x > c`, `c < x`, `a < x \le b` as an interval (None for anything else).
pub(super) fn relation_as_interval(sides: &[Node], ops: &[RelOp]) -> Option<Node> {
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

/// `sides[i] - sides[i + 1]`.
pub(super) fn diff(sides: &[Node], i: usize) -> Node {
    Node::Add(vec![sides[i].clone(), Node::Neg(Box::new(sides[i + 1].clone()))])
}

fn rel_eq(gs: &[Node], gops: &[RelOp], ps: &[Node], pops: &[RelOp]) -> Equivalence {
    if gops.len() != pops.len() {
        return NotEqual;
    }
    Equivalence::all((0..gops.len()).map(|i| {
        let (go, po) = (gops[i], pops[i]);
        let same = go == po;
        let flipped = go.flipped() == po;
        let side_by_side = || {
            // Needed when a side is a set: `x \in [a, b]`.
            if !same {
                return NotEqual;
            }
            Equivalence::all([(&gs[i], &ps[i]), (&gs[i + 1], &ps[i + 1])].into_iter().map(|(x, y)| node_eq(x, y)))
        };
        let difference = || if same { scalar_eq(&diff(gs, i), &diff(ps, i)) } else { NotEqual };
        let negated = || {
            if flipped {
                scalar_eq(&diff(gs, i), &Node::Neg(Box::new(diff(ps, i))))
            } else {
                NotEqual
            }
        };
        let alternatives: [&dyn Fn() -> Equivalence; 3] = [&side_by_side, &difference, &negated];
        Equivalence::any(alternatives.iter().map(|f| f()))
    }))
}

pub(super) const N_POINTS: usize = 12;

/// Deterministic sample value of variable `name` at point `k`: points 0..6 positive, 6..12 negative.
pub(super) fn sample(name: &str, k: usize) -> f64 {
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

/// The value of `n` at sample point `k`.
pub(super) fn at_point(n: &Node, k: usize) -> f64 {
    approx(n, &|s: &str| sample(s, k))
}

/// Expressions with variables: equal when they agree at every sample point where both are finite, with
/// at least 3 such points. With fewer, unknown when a value overflowed at some point (it may have been
/// defined there; an infinity written as `\infty` is not an overflow), else not equal.
fn random_eq(g: &Node, p: &Node) -> Equivalence {
    let values: Vec<(f64, f64)> = (0..N_POINTS).map(|k| (at_point(g, k), at_point(p, k))).collect();
    let pts: Vec<&(f64, f64)> = values.iter().filter(|(a, b)| a.is_finite() && b.is_finite()).collect();
    if !pts.iter().all(|(a, b)| close(*a, *b, 1e-9)) {
        return NotEqual;
    }
    if pts.len() >= 3 {
        return Equal;
    }
    let (g_inf, p_inf) = (contains_inf(g), contains_inf(p));
    let overflow = values.iter().any(|(a, b)| (a.is_infinite() && !g_inf) || (b.is_infinite() && !p_inf));
    if overflow {
        Unknown
    } else {
        NotEqual
    }
}

/// What Math-Verify's numeric comparison needs to know about a variable-free value.
#[derive(Debug, Clone)]
pub(super) struct Info {
    /// The value (a percentage divided by 100), when rational.
    pub(super) exact: Option<BigRational>,
    /// The value without the percentage (25 for 25\%).
    pub(super) stripped: Option<BigRational>,
    float: bool,
    pub(super) approx: f64,
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

    /// The value with the larger limits of [`exact_big`] (`2^{100000}`, `720!`), or why there is none.
    fn big(n: &Node) -> Result<Info, Inexact> {
        let exact = exact_big(n)?;
        let stripped = match n {
            Node::Pct(inner) => exact_big(inner).ok(),
            _ => Some(exact.clone()),
        };
        let approx = num_traits::ToPrimitive::to_f64(&exact).unwrap_or(f64::NAN);
        Ok(Info { exact: Some(exact), stripped, float: has_float(n), approx })
    }

    /// A plain number once evaluated (sympy's atomic Number).
    fn atomic(&self) -> bool {
        self.exact.is_some()
    }

    fn is_float(&self) -> bool {
        self.atomic() && self.float
    }

    pub(super) fn int_like(&self) -> bool {
        !self.float && self.stripped.as_ref().is_some_and(|v| v.is_integer())
    }

    /// Rounded to 6 places: (is an exact integer, millionths).
    pub(super) fn rounded(&self) -> Option<(bool, num_bigint::BigInt)> {
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

/// A variable-free value as the comparison sees it: its value within the small limits of exact
/// arithmetic, within the larger ones (or why not), and whether an infinity is written in it.
pub(super) struct Value {
    pub(super) small: Info,
    pub(super) exact: Result<Info, Inexact>,
    pub(super) written_inf: bool,
}

impl Value {
    pub(super) fn new(n: &Node) -> Value {
        let small = Info::new(n);
        let exact = if small.atomic() { Ok(small.clone()) } else { Info::big(n) };
        Value { small, exact, written_inf: contains_inf(n) }
    }

    /// Whether the float value can be compared: an exact value, a finite float, or an infinity that is
    /// written as `\infty` (not an overflow).
    pub(super) fn float_reliable(&self) -> bool {
        self.exact.is_ok() || self.small.approx.is_finite() || (self.small.approx.is_infinite() && self.written_inf)
    }

    /// An infinity written as such (`\infty`, `-\infty`): its sign.
    pub(super) fn written_infinity(&self) -> Option<bool> {
        (self.written_inf && self.small.approx.is_infinite()).then_some(self.small.approx > 0.0)
    }
}

/// Whether `\\infty` is written in the node (an overflowing value is not infinity).
fn contains_inf(n: &Node) -> bool {
    let mut found = false;
    super::eval::visit(n, &mut |x| found |= matches!(x, Node::Inf));
    found
}

/// Two rational values (exact equality, rounding to 6 places when one is a decimal, percentages).
fn numbers_eq(a: &Info, b: &Info) -> bool {
    if a.is_float() || b.is_float() {
        if let (Some(x), Some(y)) = (a.rounded(), b.rounded()) {
            if x == y {
                return true;
            }
        }
    } else if a.int_like() && b.int_like() && a.stripped == b.stripped {
        return true;
    }
    a.same_value(b)
}

fn scalar_eq(g: &Node, p: &Node) -> Equivalence {
    if !free_symbols(g).is_empty() || !free_symbols(p).is_empty() {
        return random_eq(g, p);
    }
    values_eq(&Value::new(g), &Value::new(p))
}

/// Two variable-free values. Exact when both are rational within the small limits of exact arithmetic
/// or else within the larger ones (`2^{100000}` = `4^{50000}`, `720!` = `((3!)!)!`); past those limits,
/// unknown. Values that are not rational (`\sqrt{2}`, `\pi`) compare as floats, and are unknown when
/// their float overflows.
fn values_eq(g: &Value, p: &Value) -> Equivalence {
    let (gi, pi) = (&g.small, &p.small);
    if gi.atomic() && pi.atomic() {
        return Equivalence::decided(numbers_eq(gi, pi));
    }
    if let (Some(a), Some(b)) = (g.written_infinity(), p.written_infinity()) {
        if a == b {
            return Equal;
        }
    }
    match (&g.exact, &p.exact) {
        (Ok(a), Ok(b)) => Equivalence::decided(numbers_eq(a, b)),
        (Err(Inexact::Budget), _) | (_, Err(Inexact::Budget)) => Unknown,
        _ => irrational_eq(g, p),
    }
}

/// At least one side is not rational: the float comparison (rounding to 6 places against a decimal,
/// else 12 significant digits).
fn irrational_eq(g: &Value, p: &Value) -> Equivalence {
    if !g.float_reliable() || !p.float_reliable() {
        return Unknown;
    }
    let (gi, pi) = (&g.small, &p.small);
    if (gi.is_float() || pi.is_float()) && (gi.atomic() || pi.atomic()) {
        if let (Some(a), Some(b)) = (gi.rounded(), pi.rounded()) {
            if a == b {
                return Equal;
            }
        }
    }
    Equivalence::decided(gi.same_value(pi))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmp(g: &str, p: &str) -> Equivalence {
        equivalent_parsed(&ParsedAnswer::new(g), &ParsedAnswer::new(p))
    }

    fn eq(g: &str, p: &str) -> bool {
        cmp(g, p) == Equal
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
        assert_eq!(cmp("2^{100000}", "2^{100001}"), NotEqual);
        assert_eq!(cmp("720!", "((3!)!)! + 1"), NotEqual);
        // Tiny and nearly-equal rationals past the small limits are exact, not float, comparisons.
        assert_eq!(cmp("2^{-20000}", "0"), NotEqual);
        assert_eq!(cmp("1 + 2^{-20000}", "1"), NotEqual);
        assert!(eq("2^{-20000}", "0.0"), "rounded to 6 places against a decimal");
        assert!(eq("2^{20000} + 0.0", "2^{20000}"));
        assert!(eq("2^{20000} + 0.5", "2^{20000} + \\frac{1}{2}"));
        assert!(eq("1^{10^{10}}", "1"));
        assert!(t.elapsed().as_secs_f64() < 1.0, "took {:?}", t.elapsed());
    }

    #[test]
    fn past_the_limits_equality_is_unknown() {
        // Equal or not, these are past the exact limits: unknown, never "not equal".
        assert_eq!(cmp("2^{10^{9}}", "4^{5 \\cdot 10^{8}}"), Unknown);
        assert_eq!(cmp("2^{10^{9}}", "2^{10^{9}} + 1"), Unknown);
        assert_eq!(cmp("2000!", "2000 \\cdot 1999!"), Unknown);
        assert_eq!(cmp("10^{10^{10}}", "10^{10^{11}}"), Unknown);
        assert_eq!(cmp("10^{10^{10}} - 10^{10^{10}} + 5", "5"), Unknown);
        assert_eq!(cmp("2^{-10^{9}}", "0"), Unknown, "an underflow is not zero");
        // A float overflow of a value that is not rational.
        assert_eq!(cmp("e^{1000}", "e^{999} e"), Unknown);
        assert_eq!(cmp("2^{100000} x", "4^{50000} x"), Unknown);
        // Structures: a part unknown and none different.
        assert_eq!(cmp("(1, 2^{10^{9}})", "(1, 4^{5 \\cdot 10^{8}})"), Unknown);
        assert_eq!(cmp("(2, 2^{10^{9}})", "(1, 4^{5 \\cdot 10^{8}})"), NotEqual);
        assert_eq!(cmp("\\{1, 2^{10^{9}}\\}", "\\{4^{5 \\cdot 10^{8}}, 1\\}"), Unknown);
        assert_eq!(cmp("x = 2^{10^{9}}", "4^{5 \\cdot 10^{8}}"), Unknown);
        // Identical writing is still equal, and written infinities are not overflows.
        assert_eq!(cmp("2^{10^{9}}", "2^{10^{9}}"), Equal);
        assert_eq!(cmp("\\infty", "-\\infty"), NotEqual);
        assert_eq!(cmp("\\infty", "5"), NotEqual);
        assert_eq!(cmp("x + 1", "\\infty"), NotEqual);
        assert_eq!(cmp("\\frac{1}{0}", "5"), Unknown);
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
        assert_eq!(cmp("10^{10^{10}}", "10^{10^{11}}"), Unknown);
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
