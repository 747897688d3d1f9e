//! The recursive-descent parser over the tokens.

use num_bigint::BigInt;
use num_rational::BigRational;
use num_traits::Zero;

use super::lexer::Tok;
use super::{Func, Node, ParseError, RelOp, MAX_DEPTH};

pub(super) struct Parser {
    pub(super) toks: Vec<Tok>,
    pub(super) pos: usize,
    pub(super) depth: usize,
}

pub(super) fn int(v: i64) -> BigRational {
    BigRational::from_integer(BigInt::from(v))
}

fn num_node(int_part: &str, frac: &Option<String>) -> Node {
    let ip: BigInt = if int_part.is_empty() { BigInt::zero() } else { int_part.parse().unwrap_or_default() };
    match frac {
        None => Node::Num { value: BigRational::from_integer(ip), float: false },
        Some(f) => {
            let fp: BigInt = f.parse().unwrap_or_default();
            let den = num_traits::pow(BigInt::from(10), f.len());
            let value = BigRational::from_integer(ip) + BigRational::new(fp, den);
            Node::Num { value, float: true }
        }
    }
}

fn is_integer_literal(n: &Node) -> bool {
    matches!(n, Node::Num { value, float: false } if value.is_integer())
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }

    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += 1;
        t
    }

    fn expect(&mut self, t: Tok) -> Result<(), ParseError> {
        match self.next() {
            Some(ref x) if *x == t => Ok(()),
            Some(x) => Err(ParseError::Unexpected(format!("{x:?}"))),
            None => Err(ParseError::End),
        }
    }

    fn enter(&mut self) -> Result<(), ParseError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            Err(ParseError::TooDeep)
        } else {
            Ok(())
        }
    }

    fn leave(&mut self) {
        self.depth -= 1;
    }

    /// Top level: a matrix, or comma-separated items (several items make a set, as in Math-Verify).
    pub(super) fn parse_top(&mut self) -> Result<Node, ParseError> {
        let mut items = vec![self.parse_union()?];
        while self.peek() == Some(&Tok::Op(',')) {
            self.pos += 1;
            if self.peek().is_none() {
                break;
            }
            items.push(self.parse_union()?);
        }
        if let Some(t) = self.peek() {
            return Err(ParseError::Unexpected(format!("{t:?}")));
        }
        if items.len() == 1 {
            return Ok(items.pop().unwrap_or(Node::Set(vec![])));
        }
        // `x = 1, -2` is `x = {1, -2}`.
        if let Node::Rel(sides, ops) = &items[0] {
            if ops.last() == Some(&RelOp::Eq) && items[1..].iter().all(|i| !matches!(i, Node::Rel(..))) {
                let (mut sides, ops) = (sides.clone(), ops.clone());
                let first = sides.pop().unwrap_or(Node::Set(vec![]));
                let mut set = vec![first];
                set.extend(items.drain(1..));
                sides.push(Node::Set(set));
                return Ok(Node::Rel(sides, ops));
            }
        }
        Ok(Node::Set(items))
    }

    fn parse_union(&mut self) -> Result<Node, ParseError> {
        let first = self.parse_rel()?;
        if self.peek() != Some(&Tok::Cmd("cup".into())) {
            return Ok(first);
        }
        // `x = A \cup B` is `x = (A \cup B)`.
        let (mut rel, first) = match first {
            Node::Rel(mut sides, ops) => {
                let last = sides.pop().unwrap_or(Node::Set(vec![]));
                (Some((sides, ops)), last)
            }
            other => (None, other),
        };
        let mut parts = vec![first];
        while self.peek() == Some(&Tok::Cmd("cup".into())) {
            self.pos += 1;
            parts.push(self.parse_rel()?);
        }
        Ok(match rel.take() {
            Some((mut sides, ops)) => {
                sides.push(Node::Union(parts));
                Node::Rel(sides, ops)
            }
            None => Node::Union(parts),
        })
    }

    fn rel_op(&self) -> Option<RelOp> {
        match self.peek()? {
            Tok::Op('=') => Some(RelOp::Eq),
            Tok::Op('<') => Some(RelOp::Lt),
            Tok::Op('>') => Some(RelOp::Gt),
            Tok::Cmd(c) => match c.as_str() {
                "le" | "leq" | "leqslant" => Some(RelOp::Le),
                "ge" | "geq" | "geqslant" => Some(RelOp::Ge),
                "ne" | "neq" => Some(RelOp::Ne),
                "lt" => Some(RelOp::Lt),
                "gt" => Some(RelOp::Gt),
                // `x \in [a, b]` is read as `x = [a, b]` (Math-Verify does the same).
                "approx" | "equiv" | "in" => Some(RelOp::Eq),
                _ => None,
            },
            _ => None,
        }
    }

    fn parse_rel(&mut self) -> Result<Node, ParseError> {
        let first = self.parse_add()?;
        let mut sides = vec![first];
        let mut ops = Vec::new();
        while let Some(op) = self.rel_op() {
            self.pos += 1;
            // "<=" / ">=" written with two characters.
            let op = match (op, self.peek()) {
                (RelOp::Lt, Some(Tok::Op('='))) => {
                    self.pos += 1;
                    RelOp::Le
                }
                (RelOp::Gt, Some(Tok::Op('='))) => {
                    self.pos += 1;
                    RelOp::Ge
                }
                _ => op,
            };
            ops.push(op);
            sides.push(self.parse_add()?);
        }
        Ok(if ops.is_empty() { sides.pop().unwrap_or(Node::Set(vec![])) } else { Node::Rel(sides, ops) })
    }

    fn parse_add(&mut self) -> Result<Node, ParseError> {
        self.enter()?;
        let mut terms = Vec::new();
        let mut pm: Option<Node> = None;
        // Leading sign.
        let first = match self.peek() {
            Some(Tok::Cmd(c)) if c == "pm" => {
                self.pos += 1;
                let t = self.parse_mul()?;
                pm = Some(t);
                None
            }
            _ => Some(self.parse_signed()?),
        };
        if let Some(f) = first {
            terms.push(f);
        }
        loop {
            match self.peek() {
                Some(Tok::Op('+')) => {
                    self.pos += 1;
                    terms.push(self.parse_signed()?);
                }
                Some(Tok::Op('-')) => {
                    self.pos += 1;
                    let t = self.parse_signed()?;
                    terms.push(Node::Neg(Box::new(t)));
                }
                Some(Tok::Cmd(c)) if (c == "pm" || c == "mp") && pm.is_none() => {
                    self.pos += 1;
                    pm = Some(self.parse_mul()?);
                }
                _ => break,
            }
        }
        self.leave();
        let base = match terms.len() {
            0 => None,
            1 => terms.pop(),
            _ => Some(Node::Add(terms)),
        };
        Ok(match (base, pm) {
            (Some(b), None) => b,
            (None, Some(d)) => Node::Set(vec![Node::Neg(Box::new(d.clone())), d]),
            (Some(b), Some(d)) => {
                Node::Set(vec![Node::Add(vec![b.clone(), Node::Neg(Box::new(d.clone()))]), Node::Add(vec![b, d])])
            }
            (None, None) => return Err(ParseError::Empty),
        })
    }

    fn parse_signed(&mut self) -> Result<Node, ParseError> {
        match self.peek() {
            Some(Tok::Op('-')) => {
                self.pos += 1;
                self.enter()?;
                let t = self.parse_signed()?;
                self.leave();
                Ok(Node::Neg(Box::new(t)))
            }
            Some(Tok::Op('+')) => {
                self.pos += 1;
                self.enter()?;
                let t = self.parse_signed();
                self.leave();
                t
            }
            _ => self.parse_mul(),
        }
    }

    fn starts_factor(&self) -> bool {
        match self.peek() {
            Some(Tok::Num(..) | Tok::Ident(_) | Tok::LParen | Tok::LBrace | Tok::SetOpen) => true,
            Some(Tok::Cmd(c)) => !matches!(
                c.as_str(),
                "cup"
                    | "pm"
                    | "mp"
                    | "le"
                    | "leq"
                    | "leqslant"
                    | "ge"
                    | "geq"
                    | "geqslant"
                    | "ne"
                    | "neq"
                    | "lt"
                    | "gt"
                    | "approx"
                    | "equiv"
                    | "cdot"
                    | "times"
                    | "div"
                    | "end"
                    | "in"
            ),
            _ => false,
        }
    }

    fn parse_mul(&mut self) -> Result<Node, ParseError> {
        self.enter()?;
        let mut factors = vec![self.parse_power()?];
        loop {
            match self.peek() {
                Some(Tok::Op('*')) => {
                    self.pos += 1;
                    factors.push(self.parse_power()?);
                }
                Some(Tok::Cmd(c)) if c == "cdot" || c == "times" || c == "ast" => {
                    self.pos += 1;
                    factors.push(self.parse_power()?);
                }
                Some(Tok::Op('/')) | Some(Tok::Cmd(_)) if self.is_div() => {
                    self.pos += 1;
                    let d = self.parse_power()?;
                    let last = factors.pop().ok_or(ParseError::Empty)?;
                    factors.push(Node::Div(Box::new(last), Box::new(d)));
                }
                Some(Tok::Word(_)) => {
                    // A unit after a value ("5 \text{ cm}^2"): dropped.
                    self.pos += 1;
                    self.skip_unit_power()?;
                }
                _ if self.starts_factor() => {
                    let f = self.parse_power()?;
                    // Mixed number: 1\frac{1}{4} = 1 + 1/4.
                    if factors.len() == 1 && is_integer_literal(&factors[0]) {
                        if let Node::Frac(a, b) = &f {
                            if is_integer_literal(a) && is_integer_literal(b) {
                                let whole = factors.pop().ok_or(ParseError::Empty)?;
                                factors.push(Node::Add(vec![whole, f]));
                                continue;
                            }
                        }
                    }
                    factors.push(f);
                }
                _ => break,
            }
        }
        self.leave();
        Ok(if factors.len() == 1 { factors.pop().unwrap_or(Node::Set(vec![])) } else { Node::Mul(factors) })
    }

    fn is_div(&self) -> bool {
        match self.peek() {
            Some(Tok::Op('/')) => true,
            Some(Tok::Cmd(c)) => c == "div",
            _ => false,
        }
    }

    fn skip_unit_power(&mut self) -> Result<(), ParseError> {
        if self.peek() == Some(&Tok::Op('^')) {
            self.pos += 1;
            let _ = self.parse_arg()?;
        }
        Ok(())
    }

    fn parse_power(&mut self) -> Result<Node, ParseError> {
        self.enter()?;
        let mut base = self.parse_postfix()?;
        if self.peek() == Some(&Tok::Op('^')) {
            self.pos += 1;
            let exp = match self.peek() {
                Some(Tok::Op('-')) => {
                    self.pos += 1;
                    Node::Neg(Box::new(self.parse_arg()?))
                }
                _ => self.parse_arg()?,
            };
            base = Node::Pow(Box::new(base), Box::new(exp));
            base = self.parse_postfix_ops(base)?;
        }
        self.leave();
        Ok(base)
    }

    fn parse_postfix(&mut self) -> Result<Node, ParseError> {
        let p = self.parse_primary()?;
        self.parse_postfix_ops(p)
    }

    fn parse_postfix_ops(&mut self, mut p: Node) -> Result<Node, ParseError> {
        loop {
            match self.peek() {
                Some(Tok::Percent) => {
                    self.pos += 1;
                    p = Node::Pct(Box::new(p));
                }
                Some(Tok::Op('!')) => {
                    self.pos += 1;
                    p = Node::Fact(Box::new(p));
                }
                Some(Tok::Op('\'')) => {
                    self.pos += 1;
                    if let Node::Sym(s) = p {
                        p = Node::Sym(format!("{s}'"));
                    } else {
                        return Err(ParseError::Unexpected("'".into()));
                    }
                }
                _ => return Ok(p),
            }
        }
    }

    /// A one-token or braced argument (`\frac12`, `\sqrt2`, `x^2`, `\frac{a}{b}`): a multi-digit
    /// number without braces gives only its first digit, as in TeX.
    fn parse_arg(&mut self) -> Result<Node, ParseError> {
        self.enter()?;
        let r = match self.peek().cloned() {
            Some(Tok::LBrace) => {
                self.pos += 1;
                let inner = self.parse_group_body(Tok::RBrace)?;
                Ok(inner)
            }
            Some(Tok::Num(int, None)) if int.len() > 1 => {
                let first = int[..1].to_string();
                self.toks[self.pos] = Tok::Num(int[1..].to_string(), None);
                Ok(num_node(&first, &None))
            }
            Some(Tok::Num(..)) | Some(Tok::Ident(_)) => self.parse_primary(),
            Some(Tok::Cmd(_)) => self.parse_primary(),
            Some(t) => Err(ParseError::Unexpected(format!("{t:?}"))),
            None => Err(ParseError::End),
        };
        self.leave();
        r
    }

    /// Content of a `{...}` group up to `close`: one expression (commas make a set).
    fn parse_group_body(&mut self, close: Tok) -> Result<Node, ParseError> {
        let mut items = vec![self.parse_union()?];
        while self.peek() == Some(&Tok::Op(',')) {
            self.pos += 1;
            items.push(self.parse_union()?);
        }
        self.expect(close)?;
        Ok(if items.len() == 1 { items.pop().unwrap_or(Node::Set(vec![])) } else { Node::Set(items) })
    }

    fn parse_primary(&mut self) -> Result<Node, ParseError> {
        self.enter()?;
        let tok = self.next().ok_or(ParseError::End)?;
        let r = match tok {
            Tok::Num(i, f) => self.parse_number(&i, &f),
            Tok::Ident(s) => self.parse_symbol(s),
            Tok::Word(w) => Ok(Node::Text(w)),
            Tok::LBrace => self.parse_group_body(Tok::RBrace),
            Tok::SetOpen => self.parse_set(),
            Tok::LParen | Tok::LBrack => self.parse_bracketed(tok == Tok::LParen),
            Tok::Op('|') => {
                let inner = self.parse_add()?;
                self.expect(Tok::Op('|'))?;
                Ok(Node::Func(Func::Abs, Box::new(inner)))
            }
            Tok::Cmd(c) => self.parse_command(&c),
            t => Err(ParseError::Unexpected(format!("{t:?}"))),
        };
        self.leave();
        r
    }

    /// A number (its token just read). A base subscript (52_8) is dropped, as Math-Verify does.
    fn parse_number(&mut self, int_part: &str, frac: &Option<String>) -> Result<Node, ParseError> {
        if self.peek() == Some(&Tok::Op('_')) {
            self.pos += 1;
            self.parse_arg()?;
        }
        Ok(num_node(int_part, frac))
    }

    /// A variable (its letter just read), with a subscript joined to its name (`x_1`, `a_{n1}`); `e` is
    /// Euler's number.
    fn parse_symbol(&mut self, name: String) -> Result<Node, ParseError> {
        if name == "e" {
            return Ok(Node::E);
        }
        if self.peek() != Some(&Tok::Op('_')) {
            return Ok(Node::Sym(name));
        }
        self.pos += 1;
        let sub = match self.next() {
            Some(Tok::Num(i, None)) => i,
            Some(Tok::Ident(s)) => s,
            Some(Tok::LBrace) => {
                let mut sub = String::new();
                loop {
                    match self.next() {
                        Some(Tok::RBrace) => break sub,
                        Some(Tok::Num(i, None)) => sub.push_str(&i),
                        Some(Tok::Ident(s)) => sub.push_str(&s),
                        Some(t) => return Err(ParseError::Unexpected(format!("{t:?}"))),
                        None => return Err(ParseError::End),
                    }
                }
            }
            Some(t) => return Err(ParseError::Unexpected(format!("{t:?}"))),
            None => return Err(ParseError::End),
        };
        Ok(Node::Sym(format!("{name}_{sub}")))
    }

    /// Comma-separated items (at least one).
    fn parse_items(&mut self) -> Result<Vec<Node>, ParseError> {
        let mut items = vec![self.parse_union()?];
        while self.peek() == Some(&Tok::Op(',')) {
            self.pos += 1;
            items.push(self.parse_union()?);
        }
        Ok(items)
    }

    /// A set (its `\{` just read).
    fn parse_set(&mut self) -> Result<Node, ParseError> {
        if self.peek() == Some(&Tok::SetClose) {
            self.pos += 1;
            return Ok(Node::Set(vec![]));
        }
        let items = self.parse_items()?;
        self.expect(Tok::SetClose)?;
        Ok(Node::Set(items))
    }

    /// What follows `(` or `[`: a parenthesised expression, an interval (open or closed at either end) or
    /// a tuple.
    fn parse_bracketed(&mut self, open_paren: bool) -> Result<Node, ParseError> {
        let mut items = self.parse_items()?;
        let close_paren = match self.next() {
            Some(Tok::RParen) => true,
            Some(Tok::RBrack) => false,
            Some(t) => return Err(ParseError::Unexpected(format!("{t:?}"))),
            None => return Err(ParseError::End),
        };
        match items.len() {
            1 if open_paren == close_paren => Ok(items.pop().unwrap_or(Node::Set(vec![]))),
            2 => {
                let hi = items.pop().unwrap_or(Node::Set(vec![]));
                let lo = items.pop().unwrap_or(Node::Set(vec![]));
                Ok(Node::Interval { lo: Box::new(lo), hi: Box::new(hi), lo_open: open_paren, hi_open: close_paren })
            }
            n if n > 2 && open_paren == close_paren => Ok(Node::Tuple(items)),
            _ => Err(ParseError::Unexpected("mismatched brackets".into())),
        }
    }

    fn parse_command(&mut self, c: &str) -> Result<Node, ParseError> {
        let func = |f: Func| -> Option<Func> { Some(f) };
        let f = match c {
            "frac" | "dfrac" | "tfrac" | "cfrac" => {
                let a = self.parse_arg()?;
                let b = self.parse_arg()?;
                return Ok(Node::Frac(Box::new(a), Box::new(b)));
            }
            "sqrt" => {
                let index = if self.peek() == Some(&Tok::LBrack) {
                    self.pos += 1;
                    let i = self.parse_add()?;
                    self.expect(Tok::RBrack)?;
                    Some(Box::new(i))
                } else {
                    None
                };
                let r = self.parse_arg()?;
                return Ok(Node::Root(Box::new(r), index));
            }
            "binom" | "dbinom" | "tbinom" => {
                // C(n, k) = n! / (k! (n-k)!)
                let n = self.parse_arg()?;
                let k = self.parse_arg()?;
                let nk = Node::Add(vec![n.clone(), Node::Neg(Box::new(k.clone()))]);
                return Ok(Node::Div(
                    Box::new(Node::Fact(Box::new(n))),
                    Box::new(Node::Mul(vec![Node::Fact(Box::new(k)), Node::Fact(Box::new(nk))])),
                ));
            }
            "pi" => return Ok(Node::Pi),
            "infty" | "inf" | "infinity" => return Ok(Node::Inf),
            "emptyset" | "varnothing" => return Ok(Node::Set(vec![])),
            "log" | "lg" => return self.parse_log(),
            "ln" => func(Func::Ln),
            "exp" => func(Func::Exp),
            "sin" => func(Func::Sin),
            "cos" => func(Func::Cos),
            "tan" => func(Func::Tan),
            "cot" => func(Func::Cot),
            "sec" => func(Func::Sec),
            "csc" => func(Func::Csc),
            "arcsin" => func(Func::Asin),
            "arccos" => func(Func::Acos),
            "arctan" => func(Func::Atan),
            "sinh" => func(Func::Sinh),
            "cosh" => func(Func::Cosh),
            "tanh" => func(Func::Tanh),
            "begin" => return self.parse_matrix(),
            "lbrace" => {
                self.pos -= 1;
                self.toks[self.pos] = Tok::SetOpen;
                return self.parse_primary();
            }
            "alpha" | "beta" | "gamma" | "delta" | "theta" | "lambda" | "mu" | "sigma" | "phi" | "omega" | "tau"
            | "rho" | "epsilon" | "varepsilon" | "varphi" | "psi" | "chi" | "eta" | "zeta" | "xi" | "nu" | "kappa" => {
                return Ok(Node::Sym(c.to_string()))
            }
            _ => None,
        };
        match f {
            Some(f) => self.parse_application(f),
            None => Err(ParseError::Unexpected(format!("\\{c}"))),
        }
    }

    /// `\log_b x` (base 10 when none is given; its command just read).
    fn parse_log(&mut self) -> Result<Node, ParseError> {
        let base = if self.peek() == Some(&Tok::Op('_')) {
            self.pos += 1;
            Some(Box::new(self.parse_arg()?))
        } else {
            None
        };
        let arg = self.parse_func_arg()?;
        let base = base.or_else(|| Some(Box::new(Node::Num { value: int(10), float: false })));
        Ok(Node::Log(base, Box::new(arg)))
    }

    /// A function applied to its argument, with an optional power after the name (`\sin^2 x`).
    fn parse_application(&mut self, f: Func) -> Result<Node, ParseError> {
        let power = if self.peek() == Some(&Tok::Op('^')) {
            self.pos += 1;
            Some(self.parse_arg()?)
        } else {
            None
        };
        let arg = self.parse_func_arg()?;
        let app = Node::Func(f, Box::new(arg));
        Ok(match power {
            Some(p) => Node::Pow(Box::new(app), Box::new(p)),
            None => app,
        })
    }

    fn parse_func_arg(&mut self) -> Result<Node, ParseError> {
        match self.peek() {
            Some(Tok::LParen) | Some(Tok::LBrace) => self.parse_power(),
            _ => self.parse_power(),
        }
    }

    fn parse_matrix(&mut self) -> Result<Node, ParseError> {
        let mut rows = Vec::new();
        let mut row = Vec::new();
        loop {
            match self.peek() {
                Some(Tok::Cmd(c)) if c == "end" => {
                    self.pos += 1;
                    if !row.is_empty() {
                        rows.push(row);
                    }
                    break;
                }
                Some(Tok::RowSep) => {
                    self.pos += 1;
                    if !row.is_empty() {
                        rows.push(std::mem::take(&mut row));
                    }
                }
                Some(Tok::Amp) => self.pos += 1,
                None => return Err(ParseError::End),
                _ => row.push(self.parse_add()?),
            }
        }
        if rows.is_empty() || rows.iter().any(|r| r.len() != rows[0].len()) {
            return Err(ParseError::Unexpected("ragged matrix".into()));
        }
        Ok(Node::Matrix(rows))
    }
}
