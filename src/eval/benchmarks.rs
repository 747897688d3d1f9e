//! The benchmark registry (`grpo eval --bench`, `[validation] bench`): AIME25 (and its parts I and II,
//! reported apart by the seed), AIME24, AMC23 and
//! MATH-500 (bundled in the binary from data/benchmarks/) with SkyThought's prompt templates, and any
//! other JSONL set with a template.

use std::path::Path;

use serde_json::Value;

use super::EvalError;

/// SkyThought's AIME25 template (after YAML unescaping and `.format()`).
pub const AIME25_TEMPLATE: &str = "{problem}\nReturn your final response within \\boxed{}";
/// SkyThought's template for AIME24, AMC23 and MATH-500.
pub const BOXED_FIRST_TEMPLATE: &str = "Return your final response within \\boxed{}. {problem}";

struct Entry {
    name: &'static str,
    template: &'static str,
    data: &'static str,
    /// Only the rows whose `url` contains this (a part of a combined set).
    part: Option<&'static str>,
    about: &'static str,
}

const AIME25: &str = include_str!("../../data/benchmarks/aime25.jsonl");

const REGISTRY: &[Entry] = &[
    Entry {
        name: "aime25",
        template: AIME25_TEMPLATE,
        data: AIME25,
        part: None,
        about: "AIME 2025 I and II, 30 problems, integer answers",
    },
    Entry {
        name: "aime25_1",
        template: AIME25_TEMPLATE,
        data: AIME25,
        part: Some("2025_AIME_I_Problems"),
        about: "AIME 2025 I, 15 problems (SkyThought's aime25_1)",
    },
    Entry {
        name: "aime25_2",
        template: AIME25_TEMPLATE,
        data: AIME25,
        part: Some("2025_AIME_II_Problems"),
        about: "AIME 2025 II, 15 problems (SkyThought's aime25_2)",
    },
    Entry {
        name: "aime24",
        template: BOXED_FIRST_TEMPLATE,
        data: include_str!("../../data/benchmarks/aime24.jsonl"),
        part: None,
        about: "AIME 2024, 30 problems, integer answers",
    },
    Entry {
        name: "amc23",
        template: BOXED_FIRST_TEMPLATE,
        data: include_str!("../../data/benchmarks/amc23.jsonl"),
        part: None,
        about: "AMC 2023, 40 problems",
    },
    Entry {
        name: "math500",
        template: BOXED_FIRST_TEMPLATE,
        data: include_str!("../../data/benchmarks/math500.jsonl"),
        part: None,
        about: "MATH-500, 500 problems, LaTeX answers",
    },
];

/// One problem.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Problem {
    pub id: String,
    pub problem: String,
    /// The gold answer as a string (numbers are written as in the file, e.g. "27.0").
    pub answer: String,
}

/// A benchmark: its problems and prompt template (`{problem}` is replaced by the problem text).
#[derive(Debug, Clone)]
pub struct Benchmark {
    pub name: String,
    pub template: String,
    pub problems: Vec<Problem>,
}

impl Benchmark {
    /// The user message for a problem.
    pub fn prompt(&self, p: &Problem) -> String {
        self.template.replace("{problem}", &p.problem)
    }
}

/// Names of the registered benchmarks.
pub fn names() -> Vec<&'static str> {
    REGISTRY.iter().map(|e| e.name).collect()
}

/// (name, problems, description) of each registered benchmark, for `grpo eval --list`.
pub fn list() -> Vec<(&'static str, usize, &'static str)> {
    REGISTRY.iter().map(|e| (e.name, load(e.name).map(|b| b.problems.len()).unwrap_or(0), e.about)).collect()
}

/// The lines of a registered set that belong to it (all, or those of its part).
fn entry_lines(e: &Entry) -> String {
    let keep = |l: &&str| match e.part {
        None => true,
        Some(part) => serde_json::from_str::<Value>(l)
            .ok()
            .and_then(|v| v.get("url").and_then(Value::as_str).map(|u| u.contains(part)))
            .unwrap_or(false),
    };
    e.data.lines().filter(|l| !l.trim().is_empty()).filter(keep).collect::<Vec<_>>().join("\n")
}

fn parse(name: &str, source: &str, text: &str, template: &str) -> Result<Benchmark, EvalError> {
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |m: &str| EvalError::Benchmark(format!("{source}:{}: {m}", i + 1));
        let v: Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        let problem = v
            .get("problem")
            .or_else(|| v.get("question"))
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no `problem` string"))?;
        let answer = match v.get("answer") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => return Err(bad("no `answer` (string or number)")),
        };
        let id = match v.get("id").or_else(|| v.get("unique_id")) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => (problems.len()).to_string(),
        };
        problems.push(Problem { id, problem: problem.to_string(), answer });
    }
    if problems.is_empty() {
        return Err(EvalError::Benchmark(format!("{source}: no problems")));
    }
    Ok(Benchmark { name: name.to_string(), template: template.to_string(), problems })
}

/// A registered benchmark by name.
pub fn load(name: &str) -> Result<Benchmark, EvalError> {
    let e = REGISTRY.iter().find(|e| e.name == name).ok_or_else(|| {
        EvalError::Benchmark(format!("unknown benchmark `{name}` (registered: {})", names().join(", ")))
    })?;
    let file = if e.part.is_some() { "aime25" } else { name };
    parse(e.name, &format!("data/benchmarks/{file}.jsonl"), &entry_lines(e), e.template)
}

/// Any JSONL file of {"problem" (or "question"), "answer", "id"?} with a prompt template containing
/// `{problem}`.
pub fn load_file(path: &Path, template: &str) -> Result<Benchmark, EvalError> {
    if !template.contains("{problem}") {
        return Err(EvalError::Benchmark(format!("prompt template `{template}` has no {{problem}} placeholder")));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| EvalError::Benchmark(format!("cannot read {}: {e}", path.display())))?;
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "custom".into());
    parse(&name, &path.display().to_string(), &text, template)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_has_the_four_benchmarks_with_skythought_prompts() {
        let counts: Vec<(&str, usize)> = list().iter().map(|(n, c, _)| (*n, *c)).collect();
        assert_eq!(
            counts,
            vec![("aime25", 30), ("aime25_1", 15), ("aime25_2", 15), ("aime24", 30), ("amc23", 40), ("math500", 500)]
        );
        let (one, two) = (load("aime25_1").unwrap(), load("aime25_2").unwrap());
        let both = load("aime25").unwrap();
        assert_eq!([one.problems.clone(), two.problems.clone()].concat(), both.problems, "I then II make the whole");
        assert_eq!((one.problems[0].answer.as_str(), two.problems[0].answer.as_str()), ("70", "468"));
        let b = load("aime25").unwrap();
        assert_eq!(b.problems.len(), 30);
        assert_eq!(b.problems[0].answer, "70");
        assert!(b.prompt(&b.problems[0]).ends_with("\nReturn your final response within \\boxed{}"));
        let a = load("amc23").unwrap();
        assert_eq!(a.problems[0].answer, "27.0");
        assert!(a.prompt(&a.problems[0]).starts_with("Return your final response within \\boxed{}. Cities"));
        assert!(load("gsm8k").unwrap_err().to_string().contains("aime25"));
    }
}
