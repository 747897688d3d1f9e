//! Bounded evaluation of parsed answers: exact rationals where the value is rational and small,
//! `f64` otherwise (with variables bound to sample points). Every operation has a size limit, so an
//! input such as `10^{10^{10}}` is "not exactly evaluable" instead of a hang.

use super::parse::{Func, Node};
use num_bigint::BigInt;
use num_rational::BigRational;
use num_traits::{One, Signed, ToPrimitive, Zero};

/// Size limits of exact evaluation.
struct Limits {
    /// Largest exponent applied exactly.
    exp: u64,
    /// Largest size (bits of numerator + denominator) of an exact intermediate value.
    bits: u64,
    /// Largest n for which n! is computed exactly.
    fact: u64,
}

/// The limits of [`exact`], used on every comparison.
const SMALL: Limits = Limits { exp: 4096, bits: 16_384, fact: 500 };
/// The limits of [`exact_big`], tried only when two values that [`exact`] cannot evaluate are compared:
/// a few milliseconds at most per value.
const BIG: Limits = Limits { exp: 1 << 17, bits: 1 << 17, fact: 1000 };

/// Why a value has no exact rational value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inexact {
    /// Computing it would exceed the size limits (it may well be rational: `2^{10^{9}}`).
    Budget,
    /// It is irrational, undefined, or built from something exact evaluation does not cover (`\sqrt{2}`,
    /// `\pi`, `1/0`).
    NotRational,
}

type Exact = Result<BigRational, Inexact>;

/// The worse of two failures: a size limit wins over irrationality (the value might have been decidable).
fn worse(a: Inexact, b: Inexact) -> Inexact {
    if a == Inexact::Budget || b == Inexact::Budget {
        Inexact::Budget
    } else {
        Inexact::NotRational
    }
}

/// Both values, or the worse of their failures.
fn both(a: Exact, b: Exact) -> Result<(BigRational, BigRational), Inexact> {
    match (a, b) {
        (Ok(a), Ok(b)) => Ok((a, b)),
        (Err(e), Ok(_)) | (Ok(_), Err(e)) => Err(e),
        (Err(e), Err(f)) => Err(worse(e, f)),
    }
}

fn checked(x: BigRational, lim: &Limits) -> Exact {
    if x.numer().bits() + x.denom().bits() > lim.bits {
        Err(Inexact::Budget)
    } else {
        Ok(x)
    }
}

/// Exact integer root of a non-negative integer, if it is one.
fn int_root(x: &BigInt, n: u32) -> Option<BigInt> {
    if x.is_negative() {
        return None;
    }
    let r = x.nth_root(n);
    if num_traits::pow(r.clone(), n as usize) == *x {
        Some(r)
    } else {
        None
    }
}

fn rational_root(x: &BigRational, n: u32) -> Option<BigRational> {
    if n == 0 {
        return None;
    }
    if x.is_negative() {
        if n % 2 == 1 {
            return rational_root(&-x.clone(), n).map(|r| -r);
        }
        return None;
    }
    Some(BigRational::new(int_root(x.numer(), n)?, int_root(x.denom(), n)?))
}

fn pow_exact(b: &BigRational, e: &BigRational, lim: &Limits) -> Exact {
    if e.is_integer() {
        let k = e.to_integer();
        let mag = k.abs().to_u64().ok_or(Inexact::Budget)?;
        if b.is_zero() && k.is_negative() {
            return Err(Inexact::NotRational);
        }
        // 0, 1 and -1 to any power are cheap.
        if b.is_zero() || (b.is_integer() && b.numer().magnitude().is_one()) {
            let odd = mag % 2 == 1;
            return Ok(if mag == 0 || (b.is_negative() && !odd) { BigRational::one() } else { b.clone() });
        }
        if mag > lim.exp {
            return Err(Inexact::Budget);
        }
        // At least (bits - 1) * mag bits each side: past the limit, do not compute it.
        if (b.numer().bits() + b.denom().bits()).saturating_sub(2).saturating_mul(mag) > lim.bits {
            return Err(Inexact::Budget);
        }
        // Numerator and denominator apart: they stay coprime, no gcd of huge numbers is needed.
        let p = BigRational::new_raw(
            num_traits::pow(b.numer().clone(), mag as usize),
            num_traits::pow(b.denom().clone(), mag as usize),
        );
        let p = if k.is_negative() { p.recip() } else { p };
        return checked(p, lim);
    }
    // Rational exponent p/q: exact when b is a perfect q-th power.
    let q = e.denom().to_u32().ok_or(Inexact::NotRational)?;
    if q > 64 {
        return Err(Inexact::NotRational);
    }
    let root = rational_root(b, q).ok_or(Inexact::NotRational)?;
    pow_exact(&root, &BigRational::from_integer(e.numer().clone()), lim)
}
/// The exact rational value of a variable-free node, when it has one that is cheap to compute.
pub fn exact(node: &Node) -> Option<BigRational> {
    exact_in(node, &SMALL).ok()
}

/// [`exact`] with limits large enough for values such as `2^{100000}` or `720!` (up to 2^17 bits), for
/// deciding the equality of two values that [`exact`] cannot evaluate; the error says whether the value
/// is past these limits ([`Inexact::Budget`]: equality with it is unknown) or not rational.
pub fn exact_big(node: &Node) -> Exact {
    exact_in(node, &BIG)
}

fn size(x: &BigRational) -> u64 {
    x.numer().bits() + x.denom().bits()
}

/// Whether the general operations (which reduce by a gcd, quadratic in the size) are cheap on `a`, `b`.
fn small(a: &BigRational, b: &BigRational) -> bool {
    size(a) <= SMALL.bits && size(b) <= SMALL.bits
}

/// `a + b` without a gcd of large numbers (past the budget for two large fractions).
fn add(a: BigRational, b: BigRational) -> Exact {
    if small(&a, &b) {
        return Ok(a + b);
    }
    let (a, b) = if b.is_integer() { (a, b) } else { (b, a) };
    if !b.is_integer() {
        return Err(Inexact::Budget);
    }
    // n/d + m = (n + m d)/d, still in lowest terms.
    let numer = a.numer() + b.numer() * a.denom();
    Ok(BigRational::new_raw(numer, a.denom().clone()))
}

/// `a * b` without a gcd of large numbers (past the budget unless both are integers).
fn mul(a: BigRational, b: BigRational) -> Exact {
    if small(&a, &b) {
        return Ok(a * b);
    }
    if a.is_integer() && b.is_integer() {
        Ok(BigRational::from_integer(a.numer() * b.numer()))
    } else {
        Err(Inexact::Budget)
    }
}

/// `a / b` (b non-zero) without a gcd of large numbers (past the budget unless it divides exactly).
fn div(a: BigRational, b: BigRational) -> Exact {
    if small(&a, &b) {
        return Ok(a / b);
    }
    if !(a.is_integer() && b.is_integer()) {
        return Err(Inexact::Budget);
    }
    let (q, r) = (a.numer() / b.numer(), a.numer() % b.numer());
    if r.is_zero() {
        Ok(BigRational::from_integer(q))
    } else {
        Err(Inexact::Budget)
    }
}

/// A sum or product of terms: every term is evaluated (so that a size limit met anywhere is reported
/// as such), then folded.
fn fold(terms: &[Node], lim: &Limits, init: BigRational, op: fn(BigRational, BigRational) -> Exact) -> Exact {
    let mut values = Vec::with_capacity(terms.len());
    let mut failure: Option<Inexact> = None;
    for t in terms {
        match exact_in(t, lim) {
            Ok(v) => values.push(v),
            Err(e) => failure = Some(failure.map_or(e, |f| worse(e, f))),
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    let mut acc = init;
    for v in values {
        acc = checked(op(acc, v)?, lim)?;
    }
    Ok(acc)
}

fn root_index(idx: &Option<Box<Node>>, lim: &Limits) -> Result<u32, Inexact> {
    let n = match idx {
        Some(i) => {
            let v = exact_in(i, lim)?;
            if !v.is_integer() {
                return Err(Inexact::NotRational);
            }
            v.to_integer().to_u32().ok_or(Inexact::NotRational)?
        }
        None => 2,
    };
    if n == 0 || n > 64 {
        return Err(Inexact::NotRational);
    }
    Ok(n)
}

fn factorial(v: BigRational, lim: &Limits) -> Exact {
    if !v.is_integer() || v.is_negative() {
        return Err(Inexact::NotRational);
    }
    let n = v.to_integer().to_u64().ok_or(Inexact::Budget)?;
    if n > lim.fact {
        return Err(Inexact::Budget);
    }
    let mut acc = BigInt::from(1);
    for i in 2..=n {
        acc *= i;
    }
    Ok(BigRational::from_integer(acc))
}

/// Exact only for integer results: log_b(b^k) = k.
fn log_exact(b: BigRational, a: BigRational, lim: &Limits) -> Exact {
    if b <= BigRational::one() || a <= BigRational::zero() {
        return Err(Inexact::NotRational);
    }
    let approx = a.to_f64().ok_or(Inexact::NotRational)?.ln() / b.to_f64().ok_or(Inexact::NotRational)?.ln();
    let k = approx.round();
    if !k.is_finite() || k.abs() > lim.exp as f64 {
        return Err(Inexact::Budget);
    }
    if (approx - k).abs() > 1e-9 {
        return Err(Inexact::NotRational);
    }
    let kr = BigRational::from_integer(BigInt::from(k as i64));
    if pow_exact(&b, &kr, lim)? == a {
        Ok(kr)
    } else {
        Err(Inexact::NotRational)
    }
}

fn exact_in(node: &Node, lim: &Limits) -> Exact {
    let exact = |n: &Node| exact_in(n, lim);
    match node {
        Node::Num { value, .. } => Ok(value.clone()),
        Node::Add(ts) => fold(ts, lim, BigRational::zero(), add),
        Node::Mul(fs) => fold(fs, lim, BigRational::one(), mul),
        Node::Neg(a) => Ok(-exact(a)?),
        Node::Div(a, b) | Node::Frac(a, b) => {
            let (n, d) = both(exact(a), exact(b))?;
            if d.is_zero() {
                return Err(Inexact::NotRational);
            }
            checked(div(n, d)?, lim)
        }
        Node::Pow(b, e) => {
            let (b, e) = both(exact(b), exact(e))?;
            pow_exact(&b, &e, lim)
        }
        Node::Root(r, idx) => {
            let (r, n) = match (exact(r), root_index(idx, lim)) {
                (Ok(r), Ok(n)) => (r, n),
                (Err(e), Ok(_)) | (Ok(_), Err(e)) => return Err(e),
                (Err(e), Err(f)) => return Err(worse(e, f)),
            };
            rational_root(&r, n).ok_or(Inexact::NotRational)
        }
        Node::Pct(a) => div(exact(a)?, BigRational::from_integer(100.into())),
        Node::Fact(a) => factorial(exact(a)?, lim),
        Node::Log(base, arg) => {
            let base = base.as_deref().ok_or(Inexact::NotRational)?;
            let (b, a) = both(exact(base), exact(arg))?;
            log_exact(b, a, lim)
        }
        Node::Func(Func::Abs, a) => Ok(exact(a)?.abs()),
        _ => Err(Inexact::NotRational),
    }
}

/// Whether a decimal literal appears anywhere in the node.
pub fn has_float(node: &Node) -> bool {
    let mut found = false;
    visit(node, &mut |n| {
        if matches!(n, Node::Num { float: true, .. }) {
            found = true;
        }
    });
    found
}

/// The names of the free variables of a node, sorted and deduplicated.
pub fn free_symbols(node: &Node) -> Vec<String> {
    let mut out = Vec::new();
    visit(node, &mut |n| {
        if let Node::Sym(s) = n {
            out.push(s.clone());
        }
    });
    out.sort();
    out.dedup();
    out
}

/// Pre-order walk with an explicit stack (no recursion).
pub fn visit(node: &Node, f: &mut dyn FnMut(&Node)) {
    let mut stack = vec![node];
    while let Some(n) = stack.pop() {
        f(n);
        match n {
            Node::Add(v) | Node::Mul(v) | Node::Tuple(v) | Node::Set(v) | Node::Union(v) | Node::Rel(v, _) => {
                stack.extend(v.iter())
            }
            Node::Neg(a) | Node::Func(_, a) | Node::Fact(a) | Node::Pct(a) => stack.push(a),
            Node::Div(a, b) | Node::Frac(a, b) | Node::Pow(a, b) => {
                stack.push(a);
                stack.push(b);
            }
            Node::Interval { lo, hi, .. } => {
                stack.push(lo);
                stack.push(hi);
            }
            Node::Root(a, i) | Node::Log(i, a) => {
                stack.push(a);
                if let Some(i) = i {
                    stack.push(i);
                }
            }
            Node::Matrix(rows) => rows.iter().for_each(|r| stack.extend(r.iter())),
            Node::Num { .. } | Node::Sym(_) | Node::Pi | Node::E | Node::Inf | Node::Text(_) => {}
        }
    }
}

/// Floating-point value with variables taken from `env` (NaN when undefined or not a scalar).
pub fn approx(node: &Node, env: &dyn Fn(&str) -> f64) -> f64 {
    match node {
        Node::Num { value, .. } => value.to_f64().unwrap_or(f64::NAN),
        Node::Sym(s) => env(s),
        Node::Pi => std::f64::consts::PI,
        Node::E => std::f64::consts::E,
        Node::Inf => f64::INFINITY,
        Node::Add(ts) => ts.iter().map(|t| approx(t, env)).sum(),
        Node::Mul(fs) => fs.iter().map(|t| approx(t, env)).product(),
        Node::Neg(a) => -approx(a, env),
        Node::Div(a, b) | Node::Frac(a, b) => approx(a, env) / approx(b, env),
        Node::Pow(b, e) => {
            let (b, e) = (approx(b, env), approx(e, env));
            if b < 0.0 && e.fract() != 0.0 {
                // Odd roots of negatives (x^{1/3}) are real; anything else is not.
                let q = (1.0 / e.fract()).round();
                if (q % 2.0).abs() == 1.0 && ((1.0 / e.fract()) - q).abs() < 1e-9 {
                    return -((-b).powf(e));
                }
                return f64::NAN;
            }
            b.powf(e)
        }
        Node::Root(r, idx) => {
            let n = idx.as_ref().map(|i| approx(i, env)).unwrap_or(2.0);
            let v = approx(r, env);
            if v < 0.0 && n.fract() == 0.0 && (n as i64) % 2 == 1 {
                -(-v).powf(1.0 / n)
            } else {
                v.powf(1.0 / n)
            }
        }
        Node::Log(base, arg) => {
            let b = base.as_ref().map(|b| approx(b, env)).unwrap_or(10.0);
            approx(arg, env).ln() / b.ln()
        }
        Node::Func(f, a) => {
            let x = approx(a, env);
            match f {
                Func::Sin => x.sin(),
                Func::Cos => x.cos(),
                Func::Tan => x.tan(),
                Func::Cot => 1.0 / x.tan(),
                Func::Sec => 1.0 / x.cos(),
                Func::Csc => 1.0 / x.sin(),
                Func::Asin => x.asin(),
                Func::Acos => x.acos(),
                Func::Atan => x.atan(),
                Func::Sinh => x.sinh(),
                Func::Cosh => x.cosh(),
                Func::Tanh => x.tanh(),
                Func::Exp => x.exp(),
                Func::Ln => x.ln(),
                Func::Abs => x.abs(),
            }
        }
        Node::Fact(a) => {
            let x = approx(a, env);
            if x < 0.0 || x.fract() != 0.0 {
                return f64::NAN;
            }
            if x > 170.0 {
                return f64::INFINITY;
            }
            (2..=(x as u64)).map(|i| i as f64).product()
        }
        Node::Pct(a) => approx(a, env) / 100.0,
        _ => f64::NAN,
    }
}

/// Round to 6 decimal places, as an integer count of millionths (half away from zero).
pub fn round6_exact(x: &BigRational) -> BigInt {
    let scaled = x * BigRational::from_integer(BigInt::from(1_000_000));
    // Half away from zero.
    scaled.round().to_integer()
}

/// [`round6_exact`] for floats (None when not finite).
pub fn round6_f64(x: f64) -> Option<BigInt> {
    let s = (x * 1e6).round();
    if !s.is_finite() {
        return None;
    }
    num_traits::FromPrimitive::from_f64(s)
}

#[cfg(test)]
mod tests {
    use super::super::parse::parse;
    use super::*;

    fn ex(s: &str) -> Option<BigRational> {
        exact(&parse(s).unwrap())
    }

    #[test]
    fn exact_values() {
        assert_eq!(ex("2^{10}"), Some(BigRational::from_integer(1024.into())));
        assert_eq!(ex("\\sqrt[3]{8}"), Some(BigRational::from_integer(2.into())));
        assert_eq!(ex("\\sqrt{2}"), None);
        assert_eq!(ex("\\log_2 8"), Some(BigRational::from_integer(3.into())));
        assert_eq!(ex("1\\frac{1}{4}"), Some(BigRational::new(5.into(), 4.into())));
        assert_eq!(ex("25\\%"), Some(BigRational::new(1.into(), 4.into())));
    }

    #[test]
    fn huge_values_are_bounded() {
        let t = std::time::Instant::now();
        assert_eq!(ex("10^{10^{10}}"), None);
        assert_eq!(ex("(2^{4095})^{4095}"), None);
        assert_eq!(ex("1000!"), None);
        assert!(t.elapsed().as_millis() < 500);
        assert!(approx(&parse("10^{10^{10}}").unwrap(), &|_| f64::NAN).is_infinite());
    }

    #[test]
    fn approximate_values() {
        let v = approx(&parse("\\frac{\\sqrt{3}}{2}").unwrap(), &|_| f64::NAN);
        assert!((v - 0.866_025_403_784_438_6).abs() < 1e-12);
        let v = approx(&parse("x^2+1").unwrap(), &|_| 2.0);
        assert_eq!(v, 5.0);
        assert_eq!(round6_f64(2.7182816), Some(BigInt::from(2_718_282)));
    }
}
