//! LaTeX / plain-text answers to a small expression tree.
//!
//! The grammar covers what final answers look like: numbers (thousands separators, decimals,
//! percentages), `\frac`, `\sqrt`, powers, implicit products, named functions, constants, relations
//! (`x = 5`, `x \le 3`), tuples, intervals, unions, sets, `\pm`, matrices and `\text{...}` words.
//! Presentation-only LaTeX (`\left`, spacing, `$`, `\$`, degrees, `\displaystyle`, units in `\text`
//! after a value) is dropped. Parsing is linear in the input, with a nesting limit ([`MAX_DEPTH`])
//! and a length limit ([`MAX_LEN`]); anything beyond them is "not parsed" (the caller then compares
//! the normalised strings only).

use num_rational::BigRational;

mod lexer;
mod parser;

use lexer::{tokenize, DROPPED_CMDS, TEXT_CMDS};
use parser::Parser;

/// Longest answer (in bytes) that is parsed; longer ones are compared as strings.
pub const MAX_LEN: usize = 2_000;
/// Deepest recursion of the parser (each bracket level costs about four).
pub const MAX_DEPTH: usize = 128;

/// Relation operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl RelOp {
    /// The operator with its sides swapped (`a < b` is `b > a`).
    pub fn flipped(self) -> RelOp {
        match self {
            RelOp::Lt => RelOp::Gt,
            RelOp::Gt => RelOp::Lt,
            RelOp::Le => RelOp::Ge,
            RelOp::Ge => RelOp::Le,
            other => other,
        }
    }
}

/// Named one-argument functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Func {
    Sin,
    Cos,
    Tan,
    Cot,
    Sec,
    Csc,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    Exp,
    Ln,
    Abs,
}

/// A parsed answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// A number literal; `float` when written with a decimal point.
    Num {
        value: BigRational,
        float: bool,
    },
    /// A variable (single letters are lower-cased, as Math-Verify does).
    Sym(String),
    Pi,
    E,
    Inf,
    Add(Vec<Node>),
    Mul(Vec<Node>),
    Neg(Box<Node>),
    Div(Box<Node>, Box<Node>),
    /// `\frac{a}{b}` (kept apart from `/` to recognise mixed numbers such as `1\frac{1}{4}`).
    Frac(Box<Node>, Box<Node>),
    Pow(Box<Node>, Box<Node>),
    /// `\sqrt[index]{radicand}`.
    Root(Box<Node>, Option<Box<Node>>),
    /// `\log_base(arg)`; `\log` without base is base 10, `\ln` is [`Func::Ln`].
    Log(Option<Box<Node>>, Box<Node>),
    Func(Func, Box<Node>),
    Fact(Box<Node>),
    /// `x\%`: the value x / 100, remembered as a percentage.
    Pct(Box<Node>),
    /// A chain of relations `a op b op c ...`.
    Rel(Vec<Node>, Vec<RelOp>),
    Tuple(Vec<Node>),
    Set(Vec<Node>),
    Interval {
        lo: Box<Node>,
        hi: Box<Node>,
        lo_open: bool,
        hi_open: bool,
    },
    Union(Vec<Node>),
    Matrix(Vec<Vec<Node>>),
    /// A word from `\text{...}` (lower-cased).
    Text(String),
}

/// Why a string could not be parsed (the reason is only used in tests and debug logs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("answer longer than {MAX_LEN} bytes")]
    TooLong,
    #[error("nesting deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("unexpected {0}")]
    Unexpected(String),
    #[error("unexpected end of input")]
    End,
    #[error("empty answer")]
    Empty,
}

/// Parse one answer string.
pub fn parse(s: &str) -> Result<Node, ParseError> {
    if s.len() > MAX_LEN {
        return Err(ParseError::TooLong);
    }
    // Degrees: 90^\circ = 90 (the "^" would otherwise lose its argument).
    let s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("^{\\degree}", "");
    // "10,\!080": a thin negative space after a thousands comma.
    let s = s.replace(",\\! ", ",").replace(",\\!", ",");
    let toks = tokenize(&s)?;
    if toks.is_empty() {
        return Err(ParseError::Empty);
    }
    let mut p = Parser { toks, pos: 0, depth: 0 };
    // A leading word ("\text{yes}") or a lone set of words.
    p.parse_top()
}

/// The comparison key of the string form: whitespace and presentation commands removed,
/// `\text{...}` unwrapped, lower-cased (Math-Verify compares unparsed answers as strings).
pub fn canonical(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find('\\') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        let name_len = after.chars().take_while(|c| c.is_ascii_alphabetic()).count();
        let name = &after[..name_len];
        if name_len == 0 {
            // \, \; \! \  \$ are spacing or dollar signs; keep \{ \} \%.
            match after.chars().next() {
                Some(c @ ('{' | '}' | '%' | '\\')) => {
                    out.push('\\');
                    out.push(c);
                    rest = &after[1..];
                }
                Some(c) => rest = &after[c.len_utf8()..],
                None => rest = after,
            }
            continue;
        }
        rest = &after[name_len..];
        if DROPPED_CMDS.contains(&name) {
            continue;
        }
        if TEXT_CMDS.contains(&name) {
            // Keep the content, drop the command and its braces.
            if let Some(r) = rest.trim_start().strip_prefix('{') {
                let mut depth = 1usize;
                let mut end = None;
                for (i, c) in r.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = Some(i);
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                if let Some(e) = end {
                    out.push_str(&r[..e]);
                    rest = &r[e + 1..];
                }
            }
            continue;
        }
        let name = match name {
            "dfrac" | "tfrac" | "cfrac" => "frac",
            "leq" => "le",
            "geq" => "ge",
            n => n,
        };
        out.push('\\');
        out.push_str(name);
        // Keep command names separated from following letters.
        out.push(' ');
    }
    out.push_str(rest);
    let mut key: String =
        out.chars().filter(|c| !c.is_whitespace() && *c != '$').flat_map(|c| c.to_lowercase()).collect();
    while key.ends_with('.') {
        key.pop();
    }
    key
}

#[cfg(test)]
mod tests {
    use super::parser::int;
    use super::*;

    fn n(v: i64) -> Node {
        Node::Num { value: int(v), float: false }
    }

    #[test]
    fn numbers_and_separators() {
        assert_eq!(parse("1,000").unwrap(), n(1000));
        assert_eq!(parse("10{,}000").unwrap(), n(10000));
        assert_eq!(parse("025").unwrap(), n(25));
        assert_eq!(parse("1, 2").unwrap(), Node::Set(vec![n(1), n(2)]));
        assert!(matches!(parse("0.5").unwrap(), Node::Num { float: true, .. }));
        assert!(parse("7.").is_err());
    }

    #[test]
    fn structures() {
        assert!(matches!(parse("(1,2]").unwrap(), Node::Interval { lo_open: true, hi_open: false, .. }));
        assert!(matches!(parse("(1,2,3)").unwrap(), Node::Tuple(v) if v.len() == 3));
        assert!(matches!(parse("\\{1,2\\}").unwrap(), Node::Set(v) if v.len() == 2));
        assert!(matches!(parse("x = 5").unwrap(), Node::Rel(_, ops) if ops == vec![RelOp::Eq]));
        assert!(matches!(parse("1\\frac{1}{4}").unwrap(), Node::Add(_)));
        assert!(matches!(parse("\\begin{pmatrix}1\\\\2\\end{pmatrix}").unwrap(), Node::Matrix(r) if r.len() == 2));
        assert!(matches!(parse("\\pm 3").unwrap(), Node::Set(v) if v.len() == 2));
        assert_eq!(parse("5 \\text{ cm}^2").unwrap(), n(5));
        assert_eq!(parse("\\text{yes}").unwrap(), Node::Text("yes".into()));
        assert_eq!(parse("\\frac12").unwrap(), Node::Frac(Box::new(n(1)), Box::new(n(2))));
    }

    #[test]
    fn limits() {
        let deep = format!("{}1{}", "{".repeat(10_000), "}".repeat(10_000));
        assert!(parse(&deep).is_err());
        let nested = format!("{}1{}", "(".repeat(500), ")".repeat(500));
        assert_eq!(parse(&nested), Err(ParseError::TooDeep));
        assert!(parse("(1,2").is_err());
        assert!(parse("").is_err());
    }

    #[test]
    fn canonical_forms() {
        assert_eq!(canonical("\\text{Yes}"), "yes");
        assert_eq!(canonical("\\left( 1, 2 \\right)"), "(1,2)");
        assert_eq!(canonical("\\dfrac{1}{2}"), canonical("\\frac{1}{2}"));
    }
}
