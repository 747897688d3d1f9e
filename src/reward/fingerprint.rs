//! Fingerprints of parsed answers that equivalence preserves, so that majority voting compares an answer
//! only with the cluster representatives that could be equal to it.
//!
//! The invariant (tested against the pairwise vote): whenever [`super::equiv::equivalent_parsed`] calls
//! two answers Equal, some view of the second has every one of its components matched by a key of the
//! first ([`Fingerprint::matches`]). Keys follow the comparison rule by rule:
//! - every node: its structural hash (identical sub-answers are equal);
//! - words and letters: the word;
//! - variable-free values: the exact value rounded to 6 places (exact equality, rounding against a
//!   decimal), the value without its percent sign (25\% = 25), the float value in tolerance buckets
//!   (12 significant digits for irrational values), a written infinity's sign; values past the limits
//!   of exact arithmetic (always Unknown against anything not identical) have the structural hash only;
//! - any scalar, with variables or not: its value at each of the 12 sample points where it is finite, in
//!   tolerance buckets (expressions are equal when they agree at 3 or more common points);
//! - relations: the operators up to flipping, with the keys of `lhs - rhs`, of `rhs - lhs` and of the
//!   right-hand side;
//! - sets, tuples, intervals and unions: their possible lengths (raw and without repeated elements) or
//!   interval ends, then one component per element (each element must match some element of the other);
//!   elements nested deeper contribute the union of their elements' keys.
//!
//! Float buckets are looked up with their neighbours: two values within the comparison's tolerance are
//! in the same or adjacent buckets.
//!
//! Every parsed answer has a fingerprint (its structural hash at least); an answer that does not parse
//! is only ever equal to another by its normalised key or its text, which the vote indexes apart.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use super::equiv::{
    at_point, dedup, diff, is_assignment, is_equation, is_setlike, last_rhs, relation_as_interval, truncate_assignment,
    word, Value, N_POINTS,
};
use super::eval::{free_symbols, round6_exact, round6_f64, Inexact};
use super::parse::{Node, RelOp};

/// A key: an exact tag, or a tag with the bucket of a float value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    tag: u64,
    bucket: Option<i64>,
}

fn hash_of(x: impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

impl Key {
    fn exact(x: impl Hash) -> Key {
        Key { tag: hash_of(x), bucket: None }
    }

    fn bucketed(tag: impl Hash, bucket: i64) -> Key {
        Key { tag: hash_of(tag), bucket: Some(bucket) }
    }

    /// The same key inside a context (a relation's operators).
    fn within(self, context: u64) -> Key {
        Key { tag: hash_of((context, self.tag)), ..self }
    }

    /// The index entry this key is stored under.
    fn entry(&self) -> u64 {
        match self.bucket {
            None => self.tag,
            Some(b) => hash_of((self.tag, b)),
        }
    }

    /// The entries to look up: the key itself, and for a float bucket its two neighbours.
    fn probes(&self) -> impl Iterator<Item = u64> + '_ {
        let range = match self.bucket {
            None => 0..1,
            Some(_) => 0..3,
        };
        range.map(move |d| match self.bucket {
            None => self.tag,
            Some(b) => hash_of((self.tag, b.saturating_add(d - 1))),
        })
    }
}

/// A bucket of a variable-free value: values within `max(1.5e-6, 2e-12 |x|)` of each other (more than
/// the 12 significant digits, or 1e-12 near zero, of the float comparison) are in the same or adjacent
/// buckets (asinh(x / 1e6) moves by less than 4e-12 over that distance).
fn value_bucket(x: f64) -> i64 {
    ((x / 1e6).asinh() / 1e-10).floor() as i64
}

/// A bucket of a value at a sample point: values within `1e-9 max(1, |a|, |b|)` of each other (the
/// tolerance of the comparison at sample points) are in the same or adjacent buckets (asinh moves by
/// at most about 1e-9 over that distance).
fn point_bucket(x: f64) -> i64 {
    (x.asinh() / 1e-8).floor() as i64
}

/// The structural hash of a node: equal nodes have equal hashes.
fn structural(n: &Node) -> Key {
    struct Feed(DefaultHasher);
    impl std::fmt::Write for Feed {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0.write(s.as_bytes());
            Ok(())
        }
    }
    let mut f = Feed(DefaultHasher::new());
    "H".hash(&mut f.0);
    // Debug prints every field, numbers as their reduced numerator and denominator.
    let _ = std::fmt::Write::write_fmt(&mut f, format_args!("{n:?}"));
    Key { tag: f.0.finish(), bucket: None }
}

/// Keys of a node compared by `scalar_eq` (directly, or through `node_eq`).
fn scalar_keys(n: &Node, out: &mut Vec<Key>) {
    for k in 0..N_POINTS {
        let v = at_point(n, k);
        if v.is_finite() {
            out.push(Key::bucketed(("P", k), point_bucket(v)));
        }
    }
    if !free_symbols(n).is_empty() {
        return;
    }
    let v = Value::new(n);
    if let Some(sign) = v.written_infinity() {
        out.push(Key::exact(("Inf", sign)));
    }
    match &v.exact {
        Ok(info) => {
            if let Some(x) = &info.exact {
                out.push(Key::exact(("R", round6_exact(x))));
            }
            if info.int_like() {
                out.push(Key::exact(("S", &info.stripped)));
            }
        }
        Err(Inexact::NotRational) => {
            if let Some(r) = round6_f64(v.small.approx) {
                out.push(Key::exact(("R", r)));
            }
        }
        Err(Inexact::Budget) => {}
    }
    if v.small.approx.is_finite() {
        out.push(Key::bucketed("N", value_bucket(v.small.approx)));
    }
}

/// Operators up to flipping (`<` and `>` compare alike, the sides swapped).
fn op_class(o: &RelOp) -> u8 {
    match o {
        RelOp::Lt | RelOp::Gt => 1,
        RelOp::Le | RelOp::Ge => 2,
        RelOp::Eq => 3,
        RelOp::Ne => 4,
    }
}

/// Keys of a relation compared with another: position 0 is equal side by side (its right-hand sides
/// equal), or by `lhs - rhs`, or flipped by `rhs - lhs`.
fn relation_keys(sides: &[Node], ops: &[RelOp], out: &mut Vec<Key>) {
    let context = hash_of(("Rel", ops.iter().map(op_class).collect::<Vec<_>>()));
    let mut inner = Vec::new();
    let d = diff(sides, 0);
    scalar_keys(&d, &mut inner);
    scalar_keys(&Node::Neg(Box::new(d)), &mut inner);
    atom_keys(&sides[1], &mut inner);
    out.extend(inner.into_iter().map(|k| k.within(context)));
}

fn elements(n: &Node) -> Vec<&Node> {
    match n {
        Node::Set(v) | Node::Tuple(v) | Node::Union(v) => v.iter().collect(),
        Node::Interval { lo, hi, .. } => vec![lo, hi],
        Node::Matrix(rows) => rows.iter().flatten().collect(),
        _ => vec![],
    }
}

/// Keys of a node compared by `node_eq` inside a structure: two equal nodes share one of them.
fn atom_keys(n: &Node, out: &mut Vec<Key>) {
    out.push(structural(n));
    match n {
        Node::Rel(sides, ops) => {
            relation_keys(sides, ops, out);
            if let Some(interval) = relation_as_interval(sides, ops) {
                atom_keys(&interval, out);
            }
        }
        Node::Set(v) if v.is_empty() => out.push(Key::exact("Empty")),
        Node::Matrix(rows) => {
            out.push(Key::exact(("Mat", rows.len(), rows[0].len())));
            elements(n).into_iter().for_each(|e| atom_keys(e, out));
        }
        _ if is_setlike(n) => elements(n).into_iter().for_each(|e| atom_keys(e, out)),
        Node::Text(_) | Node::Sym(_) => out.extend(word(n).map(|w| Key::exact(("W", w)))),
        _ => {
            out.extend(word(n).map(|w| Key::exact(("W", w))));
            scalar_keys(n, out);
        }
    }
}

/// One part of an answer that a representative must match: any of its keys.
type Component = Vec<Key>;

/// The keys an answer must match, in one of its forms.
type View = Vec<Component>;

/// The lengths a structure is compared with: a set by its elements with or without repeats, a tuple
/// by its elements, an open interval as a pair; a closed or half-open interval by its ends' kinds; a
/// plain value as a one-element set.
fn shape(n: &Node) -> Component {
    let len = |l: usize| Key::exact(("Len", l));
    match n {
        Node::Set(v) => vec![len(v.len()), len(dedup(v).len())],
        Node::Tuple(v) => vec![len(v.len())],
        Node::Interval { lo_open, hi_open, .. } => {
            let mut c = vec![Key::exact(("Interval", lo_open, hi_open))];
            if *lo_open && *hi_open {
                c.push(len(2));
            }
            c
        }
        Node::Union(v) => vec![Key::exact(("Union", v.len()))],
        _ => vec![len(1)],
    }
}

/// One component per leaf of a structure (its elements, and the elements of elements that are
/// structures themselves): when two structures are equal, each leaf of one is equal to a leaf of the
/// other, or (a structure against a plain value) to that value.
fn leaf_components(n: &Node, view: &mut View) {
    for e in elements(n) {
        if let Node::Matrix(rows) = e {
            // A matrix is only ever equal to a matrix of the same size.
            view.push(vec![Key::exact(("Mat", rows.len(), rows[0].len()))]);
            leaf_components(e, view);
        } else if is_setlike(e) && !matches!(e, Node::Set(v) if v.is_empty()) {
            leaf_components(e, view);
        } else {
            let mut c = Vec::new();
            atom_keys(e, &mut c);
            view.push(c);
        }
    }
}

/// The views of a node compared by `node_eq` at the top of an answer.
fn views_of(n: &Node, out: &mut Vec<View>) {
    match n {
        Node::Rel(sides, ops) => {
            let mut keys = vec![structural(n)];
            relation_keys(sides, ops, &mut keys);
            out.push(vec![keys]);
            if let Some(interval) = relation_as_interval(sides, ops) {
                views_of(&interval, out);
            }
        }
        Node::Set(v) if v.is_empty() => out.push(vec![vec![Key::exact("Empty")]]),
        _ if is_setlike(n) => {
            let mut view = vec![shape(n)];
            leaf_components(n, &mut view);
            out.push(view);
        }
        Node::Matrix(rows) => {
            let mut view = vec![shape(n), vec![Key::exact(("Mat", rows.len(), rows[0].len()))]];
            leaf_components(n, &mut view);
            out.push(view);
        }
        _ => {
            let mut c = Vec::new();
            atom_keys(n, &mut c);
            out.push(vec![shape(n), c]);
        }
    }
}

/// The fingerprint of a parsed answer: its views (an equation is compared as a relation with other
/// equations and as its right-hand side with anything else, as `top_eq` unwraps it).
#[derive(Debug, Clone)]
pub(super) struct Fingerprint {
    views: Vec<View>,
}

impl Fingerprint {
    pub(super) fn new(n: &Node) -> Fingerprint {
        let mut views = Vec::new();
        if is_equation(n) {
            let rel = if is_assignment(n) { truncate_assignment(n) } else { n.clone() };
            views_of(&rel, &mut views);
            views_of(&last_rhs(n), &mut views);
        } else {
            views_of(n, &mut views);
        }
        Fingerprint { views }
    }

    /// Every index entry of the answer (all keys of all views): what others are matched against.
    pub(super) fn entries(&self) -> Vec<u64> {
        let mut e: Vec<u64> = self.views.iter().flatten().flatten().map(Key::entry).collect();
        e.sort_unstable();
        e.dedup();
        e
    }

    /// The entries to look up for the component of `view` that is the most selective according to
    /// `posted` (how many representatives an entry has).
    pub(super) fn rarest_probes(&self, view: usize, posted: impl Fn(u64) -> usize) -> Vec<u64> {
        let probes = |c: &Component| c.iter().flat_map(|k| k.probes().collect::<Vec<_>>()).collect::<Vec<u64>>();
        self.views[view]
            .iter()
            .map(probes)
            .min_by_key(|p| p.iter().map(|e| posted(*e)).sum::<usize>())
            .unwrap_or_default()
    }

    pub(super) fn n_views(&self) -> usize {
        self.views.len()
    }

    /// Whether every component of `view` has a key among `entries` (a representative's [`Self::entries`],
    /// sorted): a necessary condition for the representative to be equal to this answer.
    pub(super) fn matches(&self, view: usize, entries: &[u64]) -> bool {
        self.views[view].iter().all(|c| c.iter().any(|k| k.probes().any(|e| entries.binary_search(&e).is_ok())))
    }
}

#[cfg(test)]
mod tests {
    use super::super::equiv::{equivalent_parsed, Equivalence, ParsedAnswer};
    use super::*;

    /// Whether the fingerprint of `pred` matches that of `gold` (the vote's candidate condition).
    fn candidate(gold: &str, pred: &str) -> bool {
        let entries = Fingerprint::new(&super::super::parse::parse(gold).unwrap()).entries();
        let fp = Fingerprint::new(&super::super::parse::parse(pred).unwrap());
        (0..fp.n_views()).any(|v| fp.matches(v, &entries))
    }

    #[test]
    fn equal_answers_have_matching_fingerprints() {
        let pairs = [
            ("\\begin{pmatrix}1 & 2\\end{pmatrix}", "\\{\\begin{pmatrix}1.0 & 2\\end{pmatrix}\\}"),
            ("\\{\\begin{pmatrix}1 & 2\\end{pmatrix}\\}", "\\begin{pmatrix}1 & \\frac{4}{2}\\end{pmatrix}"),
            ("\\{(1, 2), (3, 4)\\}", "\\{(3, 4), (1, 2.0)\\}"),
            ("\\{\\{1, 2\\}, 3\\}", "\\{3, \\{2, 1\\}\\}"),
            ("\\{5, 5\\}", "5"),
            ("5", "\\{5\\}"),
            ("x > 2", "(2, \\infty)"),
            ("x > 2", "x = (2, \\infty)"),
            ("1 < x \\le 3", "(1, 3]"),
            ("x = 5", "5.0"),
            ("5", "y = 5"),
            ("x = 5", "x = \\frac{10}{2}"),
            ("x < 3", "3 > x"),
            ("x - 1 = 2", "x - 1 = 2.0"),
            ("\\text{eta}", "\\eta"),
            ("\\emptyset", "\\{\\}"),
            ("(1, 2) \\cup (3, \\infty)", "(3, \\infty) \\cup (1, 2)"),
            ("\\sqrt{2}", "1.414214"),
            ("\\frac{1}{3}", "0.3333333"),
            ("25\\%", "25"),
            ("25\\%", "\\frac14"),
            ("x - x + 5", "5"),
            ("2^{100000}", "4^{50000}"),
            ("\\infty", "\\infty + 1"),
            ("(x+1)^2", "x^2 + 2x + 1"),
            ("\\frac{x^2-1}{x-1}", "x + 1"),
        ];
        for (g, p) in pairs {
            let e = equivalent_parsed(&ParsedAnswer::new(g), &ParsedAnswer::new(p));
            assert_eq!(e, Equivalence::Equal, "{g} vs {p}");
            assert!(candidate(g, p), "{g} vs {p}: equal, but not a candidate");
        }
        // Distinct answers are told apart.
        for (g, p) in [("x^2 + 1", "x^2 + 2"), ("\\{1, 2\\}", "\\{1, 3\\}"), ("(1, 2]", "(1, 2)"), ("x = 1", "x = 2")] {
            assert!(!candidate(g, p), "{g} vs {p}");
        }
    }
}
