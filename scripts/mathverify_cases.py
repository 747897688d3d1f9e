#!/usr/bin/env python3
"""Ask Math-Verify for the verdict on every (gold, prediction) case of the reward test corpus.

Usage: /work/venv/bin/python scripts/mathverify_cases.py

Writes two files:
- tests/fixtures/reward/mathverify_cases.jsonl: the hand-written corpus below (the Rust test requires
  100% agreement except the cases listed in mathverify_exceptions.jsonl);
- tests/fixtures/reward/mathverify_math500_variants.jsonl: each MATH-500 gold answer against five
  variants of it (\\dfrac, no spaces, the next answer in the file, "x = " prefix, \\left( \\right)
  wrapper), 2,500 cases (the Rust test requires at least 99% agreement and reports the rate).

Both sides are given to Math-Verify as `\\boxed{...}` (what `extract_answer` returns is the inside of
the last box), gold first: verify(parse(gold), parse(pred)). Each output line is
{"category", "gold", "pred", "expected"}; tests/reward_mathverify.rs requires the Rust checker to agree.
"""
import json
import logging
import os

from math_verify import parse, verify

CASES = {
    "integer": [
        ("25", "25"), ("25", "025"), ("025", "25"), ("1000", "1,000"), ("1,000", "1000"), ("27", "27.0"),
        ("27.0", "27"), ("-3", "-3"), ("-3", "3"), ("3", "+3"), ("0", "-0"), ("0", "0.0"), ("12", "13"),
        ("1000000", "1,000,000"), ("50,625", "50625"), ("10{,}000", "10000"), ("10{,}000", "10{,}000"),
        ("3400", "3,400"), ("100", "1e2"), ("420", "420.00"), ("7", "7."), ("2", "2.0001"), ("5", "05.0"),
        ("-3969", "-3969"), ("-3969", "3969"), ("123456789", "123456789"), ("123456789", "123456788"),
        ("1", "1"), ("1", "01"), ("0", "0"), ("10", "10.5"), ("999", "1000"), ("2024", "2,024"),
        ("18", "18 "), ("18", " 18"), ("-5", "- 5"), ("-5", "−5"), ("4", "4.00"), ("6", "six"),
        ("100", "10^2"), ("64", "2^6"), ("64", "2^{6}"), ("8", "2^3"), ("9", "3^2"), ("1024", "2^{10}"),
    ],
    "decimal_fraction": [
        ("0.5", "\\frac12"), ("\\frac12", "0.5"), ("\\frac{1}{2}", "\\dfrac{1}{2}"), ("\\frac{1}{2}", "1/2"),
        ("1/2", "\\frac{1}{2}"), ("\\frac{1}{2}", "\\tfrac{1}{2}"), ("\\frac{1}{2}", "0.50"), ("\\frac{1}{3}", "0.333"),
        ("\\frac{1}{3}", "0.3333333333"), ("\\frac{1}{3}", "\\frac{2}{6}"), ("\\frac{2}{6}", "\\frac{1}{3}"),
        ("\\frac{3}{8}", "0.375"), ("\\frac{3}{8}", "\\frac{5}{16}"), ("\\frac{3}{8}", "3/8"), ("\\frac{11}{100}", "0.11"),
        ("\\frac{16}{81}", "\\frac{16}{81}"), ("\\frac{4}{11}", "\\frac{4}{11}"), ("\\frac{4}{11}", "0.36"),
        ("\\frac{2}{5}", "0.4"), ("0.4", "\\frac{2}{5}"), ("\\frac{2}{5}", "2/5"), ("\\frac{2}{5}", "\\frac25"),
        ("1\\frac{1}{4}", "\\frac{5}{4}"), ("1\\frac{1}{4}", "1.25"), ("12\\frac{3}{5}", "12.6"), ("12\\frac{3}{5}", "\\frac{63}{5}"),
        ("\\frac{-1}{2}", "-\\frac{1}{2}"), ("-\\frac{1}{2}", "-0.5"), ("-\\frac{1}{2}", "\\frac{1}{-2}"), ("\\frac{1}{2}", "-0.5"),
        ("\\frac{7}{2}", "3.5"), ("3.5", "\\frac{7}{2}"), ("\\frac{7}{2}", "7/2"), ("0.125", "\\frac18"), ("\\frac{1}{8}", "0.12"),
        ("\\frac{22}{7}", "3.14"), ("\\frac{10}{4}", "\\frac{5}{2}"), ("\\frac{9}{3}", "3"), ("3", "\\frac{9}{3}"),
        ("0.1", "\\frac{1}{10}"), ("1.5", "3/2"), ("2.5", "\\frac{5}{2}"), ("\\frac{1}{4}", "25\\%"), ("0.25", "\\frac{1}{4}"),
        ("\\frac{1}{6}", "0.1667"), ("\\frac{1}{6}", "0.16667"), ("\\frac{5}{3}", "1.67"), ("0.75", ".75"), ("\\frac{3}{4}", ".75"),
    ],
    "latex_noise": [
        ("5", "\\left(5\\right)"), ("5", "$5$"), ("5", "\\$5"), ("5", "5\\,"), ("5", "\\;5"), ("5", "\\text{5}"),
        ("5", "\\textbf{5}"), ("5", "\\mathbf{5}"), ("5", "{5}"), ("5", "{{5}}"), ("5", "5 \\text{ cm}"), ("5", "5\\text{ meters}"),
        ("5", "5 \\mbox{ units}"), ("10", "10\\text{ inches}"), ("10", "10 \\text{cm}^2"), ("12", "12\\text{ ways}"),
        ("90", "90^\\circ"), ("90", "90^{\\circ}"), ("90^\\circ", "90"), ("45", "45^\\circ"), ("45^\\circ", "45^{\\circ}"),
        ("30", "30 \\text{ degrees}"), ("60", "60\\degree"),
        ("25", "25\\%"), ("25\\%", "25"), ("25\\%", "0.25"), ("50", "50\\%"), ("12.5\\%", "12.5"), ("40\\%", "40"),
        ("5", "\\$5"), ("5.50", "\\$5.50"), ("\\$5.50", "5.5"), ("100", "\\$100"), ("2.25", "\\$2.25"), ("1000", "\\$1,000"),
        ("\\frac{1}{2}", "\\left(\\frac{1}{2}\\right)"), ("3", "\\displaystyle 3"), ("\\frac{1}{2}", "\\displaystyle\\frac{1}{2}"),
        ("7", "7\\ "), ("7", "\\quad 7"), ("7", "7."), ("7", "\\boxed{7}"),
    ],
    "equation": [
        ("5", "x = 5"), ("5", "x=5"), ("x=5", "5"), ("x = 5", "x=5"), ("5", "y = 5"), ("5", "a = 5"), ("x=5", "y=5"),
        ("3", "n = 3"), ("\\frac{1}{2}", "k = \\frac{1}{2}"), ("2", "x = 3"), ("12", "AB = 12"), ("-2", "x=-2"),
        ("y = 2x + 3", "y=2x+3"), ("y = 2x + 3", "y = 3 + 2x"), ("y=2x+3", "2x+3"), ("y = 2x + 3", "y = 2x + 4"),
        ("x^2+y^2=25", "x^2+y^2=25"), ("x^2+y^2=25", "y^2+x^2=25"),
    ],
    "radical_pi": [
        ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"), ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}2"), ("\\sqrt{2}", "\\sqrt2"),
        ("2\\sqrt{2}", "\\sqrt{8}"), ("\\sqrt{8}", "2\\sqrt{2}"), ("\\sqrt{12}", "2\\sqrt3"), ("3\\sqrt{2}", "\\sqrt{18}"),
        ("\\sqrt{2}", "1.414"), ("\\sqrt{2}", "1.41421356"), ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
        ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"), ("\\sqrt{3}", "\\sqrt{2}"), ("\\sqrt[3]{8}", "2"), ("\\sqrt[3]{2}", "2^{1/3}"),
        ("\\pi", "\\pi"), ("2\\pi", "2 \\pi"), ("2\\pi", "\\pi \\cdot 2"), ("\\pi", "3.14159"), ("\\pi", "3.14"),
        ("\\frac{\\pi}{2}", "\\frac{1}{2}\\pi"), ("\\frac{\\pi}{2}", "0.5\\pi"), ("\\frac{\\pi}{3}", "60^\\circ"), ("4\\pi", "4\\pi"),
        ("16\\pi", "16 \\pi"), ("16\\pi", "50.27"), ("\\frac{4}{3}\\pi", "\\frac{4\\pi}{3}"), ("\\pi r^2", "r^2\\pi"),
        ("2\\sqrt{5}", "\\sqrt{20}"), ("\\sqrt{34}+3\\sqrt{10}", "3\\sqrt{10}+\\sqrt{34}"), ("28", "\\sqrt{34}+3\\sqrt{10}"),
        ("5\\sqrt{2}", "5 \\sqrt 2"), ("\\sqrt{5}", "5^{1/2}"), ("\\sqrt{5}", "\\sqrt{5}"), ("1+\\sqrt{3}", "\\sqrt{3}+1"),
        ("\\frac{1+\\sqrt{5}}{2}", "\\frac{\\sqrt{5}+1}{2}"), ("\\frac{1+\\sqrt{5}}{2}", "\\frac{1-\\sqrt{5}}{2}"),
        ("e", "e"), ("e^2", "e^{2}"), ("\\ln 2", "\\log 2"), ("\\log_2 8", "3"), ("\\sin \\frac{\\pi}{6}", "\\frac12"),
        ("\\infty", "\\infty"), ("-\\infty", "\\infty"),
    ],
    "tuple": [
        ("(1,2)", "(1, 2)"), ("(1,2)", "(2,1)"), ("(1,2)", "\\left(1,2\\right)"), ("(1, 2, 3)", "(1,2,3)"), ("(1,2,3)", "(1,2)"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})"), ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)"),
        ("(0.5, 2)", "(\\frac12, 2)"), ("(-1, 4)", "(-1,4)"), ("(-1, 4)", "(1,-4)"), ("(2, -3)", "(2,-3)"),
        ("(3, 4)", "3, 4"), ("3, 4", "(3, 4)"), ("(1,2)", "[1,2]"), ("(\\sqrt{2}, 1)", "(\\sqrt2, 1)"), ("(6, 8)", "(6, 8.0)"),
        ("(1,2,3,4)", "(1,2,3,4)"), ("(a,b)", "(a,b)"), ("(1, 1)", "(1, 1)"), ("(10, 20)", "(20, 10)"),
    ],
    "interval": [
        ("(1, 2]", "(1,2]"), ("(1, 2]", "[1, 2]"), ("[1, 2]", "[1,2]"), ("[1, 2)", "[1, 2)"), ("[1, 2)", "(1, 2)"),
        ("(-\\infty, 3)", "(-\\infty,3)"), ("(-\\infty, 3)", "(-\\infty, 3]"), ("[2, \\infty)", "[2,\\infty)"),
        ("(-\\infty, 0) \\cup (1, \\infty)", "(-\\infty,0)\\cup(1,\\infty)"), ("(-\\infty, 0) \\cup (1, \\infty)", "(1,\\infty)\\cup(-\\infty,0)"),
        ("(-\\infty, 0) \\cup (1, \\infty)", "(-\\infty,0]\\cup(1,\\infty)"), ("[0, 1]", "[0, 1.0]"), ("[-1, 1]", "[-1,1]"),
        ("(0, \\frac{1}{2})", "(0, 0.5)"), ("\\left[ -2, 5 \\right)", "[-2,5)"), ("\\left[ -2, 5 \\right)", "[-2,5]"),
        ("[3, 7]", "[3,7]"), ("(-3, 3)", "(-3,3)"), ("(-3, 3)", "[-3,3]"), ("(-\\infty, \\infty)", "(-\\infty,\\infty)"),
    ],
    "set": [
        ("\\{1, 2\\}", "\\{2, 1\\}"), ("\\{1,2,3\\}", "\\{3,2,1\\}"), ("\\{1,2\\}", "\\{1,2,3\\}"), ("\\{1, 2\\}", "\\{1, 2\\}"),
        ("1, 2", "2, 1"), ("1, 2, 3", "3, 1, 2"), ("1,2", "1,3"), ("\\{-1, 1\\}", "\\{1,-1\\}"), ("-1, 1", "1, -1"),
        ("\\{\\frac{1}{2}, 2\\}", "\\{2, 0.5\\}"), ("2, 3", "3,2"), ("\\{0\\}", "\\{0\\}"), ("\\{0\\}", "0"),
        ("1, 5", "1,5"), ("3, -3", "-3, 3"), ("\\pm 3", "3, -3"), ("\\{1, 2\\}", "\\{1, 1, 2\\}"),
        ("5, 7", "5, 7, 9"), ("\\{a, b\\}", "\\{b, a\\}"), ("2, 4, 6", "6, 4, 2"),
    ],
    "expression": [
        ("x^2 + 2x + 1", "(x+1)^2"), ("(x+1)^2", "x^2+2x+1"), ("x^2 - 1", "(x-1)(x+1)"), ("2x", "x+x"), ("2x", "x \\cdot 2"),
        ("4a-2", "4a-2"), ("4a-2", "-2+4a"), ("4a-2", "2(2a-1)"), ("4a-2", "4a+2"), ("a+b", "b+a"), ("ab", "ba"),
        ("x^2", "x \\cdot x"), ("\\frac{x}{2}", "0.5x"), ("\\frac{x+1}{x}", "1+\\frac{1}{x}"), ("x^3", "x^2"),
        ("3x+2", "2+3x"), ("3x+2", "3x+3"), ("\\frac{1}{x}", "x^{-1}"), ("x^{2}y", "yx^2"), ("2^{x}", "2^x"),
        ("(a+b)^2", "a^2+2ab+b^2"), ("(a+b)^2", "a^2+b^2"), ("\\sqrt{x^2}", "x"), ("6x^2+5x-6", "(2x+3)(3x-2)"),
        ("x^2+5x+6", "(x+2)(x+3)"), ("x^2+5x+6", "(x+2)(x+4)"), ("\\frac{a}{b}", "a/b"), ("\\frac{a}{b}", "\\frac{b}{a}"),
        ("2n+1", "1+2n"), ("n(n+1)/2", "\\frac{n^2+n}{2}"), ("\\frac{n(n+1)}{2}", "\\frac{n(n-1)}{2}"), ("t^2-4t+4", "(t-2)^2"),
        ("-x", "-1 \\cdot x"), ("x-y", "-(y-x)"), ("x-y", "y-x"), ("\\frac{2}{x-1}", "\\frac{4}{2x-2}"),
        ("3^{n}", "3^n"), ("2^{n+1}", "2\\cdot 2^n"), ("x y", "xy"), ("10x", "10 x"),
    ],
    "lookalike": [
        ("12", "1.2"), ("12", "21"), ("\\frac{1}{2}", "\\frac{2}{1}"), ("0.5", "5"), ("\\sqrt{2}", "2"), ("2\\pi", "2"),
        ("(1,2)", "\\{1,2\\}"), ("[1,2]", "(1,2)"), ("x=5", "x=-5"), ("25\\%", "25"), ("1,000", "1"), ("1,000", "1.000"),
        ("3.14", "\\pi"), ("10^{2}", "102"), ("2^{10}", "210"), ("\\frac{1}{3}", "0.3"), ("\\frac{2}{3}", "0.67"),
        ("\\frac{2}{3}", "0.6667"), ("\\frac{2}{3}", "0.666666"), ("1.1", "1.10"), ("1.01", "1.1"), ("-1", "1"), ("100", "10"),
        ("\\sqrt{3}", "3"), ("e", "2.718"), ("3x", "3"), ("x", "y"), ("a", "A"), ("0.999", "1"), ("1", "0.9999999"),
        ("\\infty", "10^{100}"), ("2^{100}", "1267650600228229401496703205376"), ("2^{100}", "1267650600228229401496703205377"),
        ("10^{10}", "10000000000"), ("1e-5", "0.00001"), ("\\frac{1}{1000000}", "0.000001"), ("\\frac{1}{1000000}", "0.000002"),
    ],
    "text_answers": [
        ("\\text{(A)}", "A"), ("A", "\\text{A}"), ("\\text{(B)}", "(B)"), ("B", "C"), ("\\text{yes}", "yes"), ("\\text{No}", "no"),
        ("\\text{even}", "\\text{odd}"), ("\\textbf{(C)}", "C"), ("E", "\\textbf{(E)}"),
    ],
    "matrix": [
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}2\\\\1\\end{pmatrix}"),
        ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
        ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix}1&3\\\\2&4\\end{pmatrix}"),
        ("\\begin{pmatrix} \\frac{1}{2} \\\\ 0 \\end{pmatrix}", "\\begin{pmatrix}0.5\\\\0\\end{pmatrix}"),
    ],
    "inequality": [
        ("x > 2", "x>2"), ("x > 2", "2 < x"), ("x > 2", "x \\geq 2"), ("x \\le 3", "x \\leq 3"), ("x < 3", "x \\le 3"),
    ],
    "scientific_misc": [
        ("35000", "3.5 \\times 10^4"), ("35000", "3.5 \\times 10^{4}"), ("0.001", "10^{-3}"), ("\\frac{1}{1000}", "10^{-3}"),
        ("6", "3!"), ("120", "5!"), ("24", "4!"), ("\\binom{5}{2}", "10"), ("10", "\\dbinom{5}{2}"), ("2", "|-2|"),
        ("-\\frac{3}{4}", "-0.75"), ("-\\frac{3}{4}", "\\frac{-3}{4}"), ("-\\frac{3}{4}", "0.75"), ("\\frac{3}{4}", "\\frac{6}{8}"),
        ("2\\times 3", "6"), ("6", "2 \\cdot 3"), ("12", "3 \\times 4"), ("\\sqrt{16}", "4"), ("4", "\\sqrt{16}"),
        ("\\frac{\\sqrt{6}}{3}", "\\sqrt{\\frac{2}{3}}"), ("\\frac{2\\sqrt{3}}{3}", "\\frac{2}{\\sqrt{3}}"),
        ("3 + 4i", "4i + 3"), ("3 + 4i", "3 - 4i"), ("i", "i"), ("\\emptyset", "\\emptyset"),
        ("(-\\infty, -2] \\cup [3, \\infty)", "(-\\infty,-2]\\cup[3,\\infty)"), ("(-\\infty, -2] \\cup [3, \\infty)", "(-\\infty,-2)\\cup[3,\\infty)"),
        ("1{,}000{,}000", "10^6"), ("\\$1{,}000", "1000"), ("3.50", "3.5"), ("0.050", "0.05"), ("-0.5", "-\\frac{1}{2}"),
        ("\\frac{1}{2}", "\\frac{1}{2} \\text{ hours}"), ("50", "50 \\text{ km/h}"), ("8", "8 \\text{ square units}"),
        ("x^2", "x^{2}"), ("\\frac{x^2}{4}", "0.25x^2"), ("\\frac{x^2}{4}", "0.25x^3"), ("\\sqrt{2}x", "x\\sqrt{2}"),
        ("y = -\\frac{1}{2}x + 3", "y = 3 - 0.5x"), ("2x + 4 = 0", "x = -2"), ("x = 2", "2x = 4"),
    ],
    "relation_set_base": [
        ("x \\in [-2,7]", "[-2,7]"), ("[-2,7]", "x \\in [-2,7]"), ("x \\in [-2,7]", "x\\in[-2,7)"), ("x \\in [-2,7]", "x \\in [-2, 7]"),
        ("x > 2", "(2, \\infty)"), ("(2,\\infty)", "x>2"), ("x > 2", "[2, \\infty)"), ("x \\le 5", "(-\\infty, 5]"),
        ("x \\le 5", "(-\\infty, 5)"), ("1 < x < 3", "(1,3)"), ("-2 \\le x < 4", "[-2,4)"), ("x \\ge 0", "[0,\\infty)"),
        ("2 < x", "(2, \\infty)"),
        ("52_8", "52"), ("52_8", "52_8"), ("52_8", "42"), ("4210_{5}", "4210_5"), ("204_5", "204"), ("2516_8", "2516_{8}"),
    ],
}


def verdict(gold: str, pred: str) -> bool:
    try:
        return bool(verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}")))
    except Exception:  # Math-Verify itself failing counts as "not equal"
        return False


def main() -> None:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "reward")
    with open(os.path.join(root, "mathverify_cases.jsonl"), "w") as out:
        for category, cases in CASES.items():
            for gold, pred in cases:
                row = {"category": category, "gold": gold, "pred": pred, "expected": verdict(gold, pred)}
                out.write(json.dumps(row) + "\n")
    answers = [json.loads(line)["answer"] for line in open(os.path.join(root, "math500_answers.jsonl"))]
    with open(os.path.join(root, "mathverify_math500_variants.jsonl"), "w") as out:
        for i, a in enumerate(answers):
            variants = [
                ("dfrac", a.replace("\\frac", "\\dfrac")),
                ("no_spaces", a.replace(" ", "")),
                ("next_answer", answers[(i + 1) % len(answers)]),
                ("assignment", "x = " + a),
                ("left_right", "\\left(" + a + "\\right)"),
            ]
            for category, pred in variants:
                row = {"category": category, "gold": a, "pred": pred, "expected": verdict(a, pred)}
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    main()
