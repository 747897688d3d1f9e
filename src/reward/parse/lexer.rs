//! The tokens of an answer string.

use super::ParseError;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Tok {
    /// Integer digits and optional fractional digits (`None`: no decimal point).
    Num(String, Option<String>),
    Ident(String),
    Cmd(String),
    Op(char),
    LParen,
    RParen,
    LBrack,
    RBrack,
    LBrace,
    RBrace,
    SetOpen,
    SetClose,
    Percent,
    Amp,
    RowSep,
    Word(String),
}

/// Commands whose braced argument is just a group (or a word when it is made of letters).
pub(super) const TEXT_CMDS: &[&str] = &[
    "text",
    "textbf",
    "textit",
    "textrm",
    "textnormal",
    "mbox",
    "hbox",
    "mathrm",
    "mathbf",
    "mathit",
    "mathsf",
    "mathtt",
    "boldsymbol",
    "bm",
    "boxed",
    "fbox",
    "operatorname",
    "textsf",
    "emph",
];

/// Commands that only change presentation and are dropped.
pub(super) const DROPPED_CMDS: &[&str] = &[
    "left",
    "right",
    "displaystyle",
    "textstyle",
    "limits",
    "big",
    "Big",
    "bigg",
    "Bigg",
    "bigl",
    "bigr",
    "Bigl",
    "Bigr",
    "quad",
    "qquad",
    "circ",
    "degree",
    "dollar",
    "mathclap",
    "ensuremath",
    "biggl",
    "biggr",
    "middle",
];

/// Split an answer into tokens. LaTeX commands become [`Tok::Cmd`] (presentation commands are dropped,
/// text commands give a [`Tok::Word`] or a group), Unicode symbols their LaTeX equivalents.
pub(super) fn tokenize(s: &str) -> Result<Vec<Tok>, ParseError> {
    // "1,000" is a thousand only where a comma cannot separate items: not inside brackets or after
    // "=" (Math-Verify reads "(58,500)" as an interval and "x = 58,500" as two values).
    let plain_commas_group = !s.contains(['(', '[', '=']) && !s.contains("\\{") && !s.contains("\\in");
    let mut lx = Lexer { chars: s.chars().collect(), i: 0, toks: Vec::new(), plain_commas_group };
    while let Some(c) = lx.at(lx.i) {
        match c {
            '0'..='9' | '.' => lx.number()?,
            '\\' => lx.backslash()?,
            _ => {
                if let Some(t) = char_token(c)? {
                    lx.toks.push(t);
                }
                lx.i += 1;
            }
        }
    }
    Ok(lx.toks)
}

/// The token of a character outside numbers and commands (`None`: the character is skipped).
fn char_token(c: char) -> Result<Option<Tok>, ParseError> {
    let cmd = |name: &str| Some(Tok::Cmd(name.into()));
    Ok(match c {
        ' ' | '\t' | '\n' | '\r' | '~' | '$' | '°' | ':' => None,
        'a'..='z' | 'A'..='Z' => Some(Tok::Ident(c.to_ascii_lowercase().to_string())),
        '(' => Some(Tok::LParen),
        ')' => Some(Tok::RParen),
        '[' => Some(Tok::LBrack),
        ']' => Some(Tok::RBrack),
        '{' => Some(Tok::LBrace),
        '}' => Some(Tok::RBrace),
        '%' => Some(Tok::Percent),
        '&' => Some(Tok::Amp),
        '−' | '–' => Some(Tok::Op('-')),
        '×' | '·' => Some(Tok::Op('*')),
        '÷' => Some(Tok::Op('/')),
        '≤' => cmd("le"),
        '≥' => cmd("ge"),
        '≠' => cmd("ne"),
        'π' => cmd("pi"),
        '∞' => cmd("infty"),
        '√' => cmd("sqrt"),
        '+' | '-' | '*' | '/' | '^' | '_' | '=' | '<' | '>' | ',' | '!' | '|' | '\'' => Some(Tok::Op(c)),
        ';' => Some(Tok::Op(',')),
        _ if c.is_alphabetic() => Some(Tok::Ident(c.to_lowercase().collect())),
        _ => return Err(ParseError::Unexpected(c.to_string())),
    })
}

/// The token of a backslash followed by `c`, not a letter (`None`: spacing or a math delimiter).
fn escaped_token(c: char) -> Result<Option<Tok>, ParseError> {
    Ok(match c {
        '{' => Some(Tok::SetOpen),
        '}' => Some(Tok::SetClose),
        '%' => Some(Tok::Percent),
        '\\' => Some(Tok::RowSep),
        ',' | ';' | ':' | '!' | ' ' | '$' | '>' => None,
        '(' | ')' | '[' | ']' => None, // \( \) \[ \] math delimiters
        '|' => Some(Tok::Op('|')),
        _ => return Err(ParseError::Unexpected(format!("\\{c}"))),
    })
}

/// The tokeniser's state.
struct Lexer {
    chars: Vec<char>,
    /// The next character to read.
    i: usize,
    toks: Vec<Tok>,
    /// Whether a plain comma may separate thousands (see [`tokenize`]).
    plain_commas_group: bool,
}

impl Lexer {
    fn at(&self, k: usize) -> Option<char> {
        self.chars.get(k).copied()
    }

    /// The ASCII digits from the current position on.
    fn digits(&mut self) -> String {
        let start = self.i;
        while self.at(self.i).is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        self.chars[start..self.i].iter().collect()
    }

    /// A number: integer digits (thousands separators removed) and optional fractional digits.
    fn number(&mut self) -> Result<(), ParseError> {
        let mut int = self.digits();
        if !int.is_empty() && int.len() <= 3 {
            self.thousands(&mut int);
        }
        let mut frac = None;
        if self.at(self.i) == Some('.') && self.at(self.i + 1).is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
            frac = Some(self.digits());
        } else if self.at(self.i) == Some('.') && !int.is_empty() {
            // "7." : a trailing period, not a decimal (Math-Verify leaves it unparsed).
            return Err(ParseError::Unexpected("trailing '.'".into()));
        }
        if int.is_empty() && frac.is_none() {
            return Err(ParseError::Unexpected(".".into()));
        }
        self.toks.push(Tok::Num(int, frac));
        Ok(())
    }

    /// Thousands separators after the first digits: 1,000 / 10{,}000 (groups of exactly three digits).
    fn thousands(&mut self, int: &mut String) {
        loop {
            let i = self.i;
            let skip = if self.plain_commas_group && self.at(i) == Some(',') {
                1
            } else if self.at(i) == Some('{') && self.at(i + 1) == Some(',') && self.at(i + 2) == Some('}') {
                3
            } else {
                return;
            };
            let (d, n) = (i + skip, self.chars.len());
            let three = d + 3 <= n && self.chars[d..d + 3].iter().all(|c| c.is_ascii_digit());
            let after_ok = d + 3 >= n || !self.chars[d + 3].is_ascii_digit();
            if !(three && after_ok) {
                return;
            }
            int.extend(&self.chars[d..d + 3]);
            self.i = d + 3;
        }
    }

    /// A backslash: a command (`\frac`, `\begin{pmatrix}`, `\text{...}`) or an escaped symbol.
    fn backslash(&mut self) -> Result<(), ParseError> {
        self.i += 1;
        let Some(c) = self.at(self.i) else { return Err(ParseError::End) };
        if !c.is_ascii_alphabetic() {
            self.i += 1;
            if let Some(t) = escaped_token(c)? {
                self.toks.push(t);
            }
            return Ok(());
        }
        let start = self.i;
        while self.at(self.i).is_some_and(|c| c.is_ascii_alphabetic()) {
            self.i += 1;
        }
        let name: String = self.chars[start..self.i].iter().collect();
        if DROPPED_CMDS.contains(&name.as_str()) {
            return Ok(());
        }
        if TEXT_CMDS.contains(&name.as_str()) {
            return self.text_argument();
        }
        if (name == "begin" || name == "end") && self.at(self.i) == Some('{') {
            // \begin{pmatrix} / \end{pmatrix}: the environment name is skipped.
            while self.at(self.i).is_some_and(|c| c != '}') {
                self.i += 1;
            }
            self.i += 1;
        }
        self.toks.push(Tok::Cmd(name));
        Ok(())
    }

    /// The braced argument of a text command: a [`Tok::Word`] when it is made of letters, else a group
    /// whose content is tokenised in place (its closing '}' becomes the RBrace).
    fn text_argument(&mut self) -> Result<(), ParseError> {
        while self.at(self.i) == Some(' ') {
            self.i += 1;
        }
        if self.at(self.i) != Some('{') {
            return Ok(());
        }
        let start = self.i + 1;
        let mut depth = 0usize;
        let mut j = self.i;
        while let Some(c) = self.at(j) {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        if j >= self.chars.len() {
            return Err(ParseError::End);
        }
        let inner: String = self.chars[start..j].iter().collect();
        let word = inner.trim();
        let wordy = word.chars().next().is_some_and(|c| c.is_alphabetic())
            && word.chars().count() >= 2
            && word.chars().all(|c| c.is_alphabetic() || matches!(c, ' ' | '/' | '.' | '-'));
        if wordy {
            self.toks.push(Tok::Word(word.to_lowercase()));
            self.i = j + 1;
        } else {
            self.toks.push(Tok::LBrace);
            self.i = start;
        }
        Ok(())
    }
}
