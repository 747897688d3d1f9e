//! Row readers: OpenThoughts3 rows (`conversations` = [{from: human|user, value}, {from: gpt|assistant,
//! value}], plus `difficulty`, `source`, `domain`) or plain `{"prompt", "response"}` rows, from JSONL
//! (plain, `.gz`, `.zst`) and Parquet files, with optional per-token `teacher_logprobs`.
//!
//! A row that cannot be used is a [`BadRow`] carrying its file, its line (or Parquet row group and row)
//! and a [`SkipReason`]; readers report it and go on.

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::{io_err, DataError};
use crate::jsonl::{LineError, Lines, RawLine};

/// One usable teacher row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The human turn (the question).
    pub question: String,
    /// The assistant turn (the teacher's answer).
    pub response: String,
    pub domain: Option<String>,
    pub source: Option<String>,
    pub difficulty: Option<i64>,
    /// Per-token log-probs of the response under the teacher, when the row carries them.
    pub teacher_logprobs: Option<Vec<f32>>,
}

/// Why a row was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    InvalidUtf8,
    BadJson,
    /// Valid JSON of the wrong shape (not an object, a field of the wrong type).
    BadSchema,
    MissingConversations,
    NoHumanTurn,
    NoAssistantTurn,
    EmptyQuestion,
    EmptyResponse,
    RowTooLarge,
    /// A teacher log-prob that is not a log-probability: infinite, NaN (`1e39` overflows f32) or above 0.
    BadLogprobs,
}

impl SkipReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            SkipReason::InvalidUtf8 => "invalid_utf8",
            SkipReason::BadJson => "bad_json",
            SkipReason::BadSchema => "bad_schema",
            SkipReason::MissingConversations => "missing_conversations",
            SkipReason::NoHumanTurn => "no_human_turn",
            SkipReason::NoAssistantTurn => "no_assistant_turn",
            SkipReason::EmptyQuestion => "empty_question",
            SkipReason::EmptyResponse => "empty_response",
            SkipReason::RowTooLarge => "row_too_large",
            SkipReason::BadLogprobs => "bad_logprobs",
        }
    }
}

/// Where a row is inside its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Location {
    /// 1-based line of a JSONL file.
    Line { line: u64 },
    /// Parquet row group and 0-based row inside it.
    Parquet { row_group: usize, row: u64 },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line { line } => write!(f, "line {line}"),
            Location::Parquet { row_group, row } => write!(f, "row group {row_group}, row {row}"),
        }
    }
}

/// A row that was skipped, with where it is and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BadRow {
    pub path: PathBuf,
    pub location: Location,
    pub reason: SkipReason,
    pub detail: String,
}

impl fmt::Display for BadRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.path.display(), self.location, self.reason.as_str())?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

/// Options of the readers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct ReadOptions {
    /// Rows (JSONL lines) longer than this many bytes are skipped as too large.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_row_bytes: usize,
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self { max_row_bytes: 1 << 20 }
    }
}

impl ReadOptions {
    /// Why a row of `bytes` bytes is skipped, naming the limit as the flag and as the config key.
    fn over_limit(&self, bytes: u64) -> String {
        format!(
            "{bytes} bytes > the row limit of {} bytes (--max-row-bytes, or data.max_row_bytes in a training config)",
            self.max_row_bytes
        )
    }
}

/// The position of a row for the pipeline: the input's index and an ordinal unique inside the file
/// (the line number for JSONL, the global row index for Parquet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct RowRef {
    pub file: u32,
    pub ordinal: u64,
}

/// Files a folder input contributes (`.json` is left out: folders hold metadata JSON files).
const EXTENSIONS: [&str; 7] = [".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd", ".ndjson", ".ndjson.gz", ".parquet"];

fn is_data_file(p: &Path) -> bool {
    let name = p.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    EXTENSIONS.iter().any(|e| name.ends_with(e))
}

fn is_parquet(p: &Path) -> bool {
    p.to_string_lossy().to_lowercase().ends_with(".parquet")
}

/// Expand inputs: a file is taken as is, a folder gives its data files (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`,
/// `.parquet`, recursively, sorted), `hf://datasets/ORG/NAME[@REVISION][/GLOB]` the data files of a hub
/// dataset (downloaded into the Hugging Face cache), anything else is a glob. Duplicates are removed, order is kept.
pub fn resolve_inputs(inputs: &[impl AsRef<str>]) -> Result<Vec<PathBuf>, DataError> {
    let mut out: Vec<PathBuf> = Vec::new();
    let push = |p: PathBuf, out: &mut Vec<PathBuf>| {
        if !out.contains(&p) {
            out.push(p);
        }
    };
    for input in inputs {
        let input = input.as_ref();
        let path = Path::new(input);
        if crate::hub::DatasetUrl::is_hub(input) {
            for p in hub_files(input)? {
                push(p, &mut out);
            }
        } else if path.is_file() {
            push(path.to_path_buf(), &mut out);
        } else if path.is_dir() {
            let mut found = Vec::new();
            walk(path, &mut found)?;
            found.sort();
            if found.is_empty() {
                return Err(DataError::NoInput(format!("folder {input} has no .jsonl/.parquet files")));
            }
            for p in found {
                push(p, &mut out);
            }
        } else {
            let paths = glob::glob(input).map_err(|e| DataError::NoInput(format!("{input}: {e}")))?;
            let mut found: Vec<PathBuf> = paths.filter_map(Result::ok).filter(|p| p.is_file()).collect();
            found.sort();
            if found.is_empty() {
                return Err(DataError::NoInput(format!("{input} matches no file")));
            }
            for p in found {
                push(p, &mut out);
            }
        }
    }
    if out.is_empty() {
        return Err(DataError::NoInput("no --input given".into()));
    }
    Ok(out)
}

/// The data files of an `hf://datasets/...` input, in the Hugging Face cache (downloaded where missing).
fn hub_files(input: &str) -> Result<Vec<PathBuf>, DataError> {
    let url = crate::hub::DatasetUrl::parse(input)?;
    let settings = crate::hub::Settings::from_env();
    Ok(crate::hub::dataset_files(&settings, &url, &|f| is_data_file(Path::new(f)))?.paths())
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), DataError> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let p = entry.map_err(io_err(dir))?.path();
        if p.is_dir() {
            walk(&p, out)?;
        } else if is_data_file(&p) {
            out.push(p);
        }
    }
    Ok(())
}

#[derive(Deserialize)]
struct JsonTurn {
    #[serde(default, alias = "role")]
    from: Option<String>,
    #[serde(default, alias = "content")]
    value: Option<String>,
}

#[derive(Deserialize)]
struct JsonRow {
    #[serde(default)]
    difficulty: Option<serde_json::Value>,
    #[serde(default)]
    source: Option<serde_json::Value>,
    #[serde(default)]
    domain: Option<serde_json::Value>,
    #[serde(default, alias = "messages")]
    conversations: Option<Vec<JsonTurn>>,
    #[serde(default, alias = "question", alias = "problem")]
    prompt: Option<String>,
    #[serde(default, alias = "completion")]
    response: Option<String>,
    #[serde(default, alias = "logprobs")]
    teacher_logprobs: Option<Vec<f32>>,
}

fn value_string(v: Option<serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Null => None,
        other => Some(other.to_string()),
    }
}

fn value_i64(v: Option<serde_json::Value>) -> Option<i64> {
    match v? {
        serde_json::Value::Number(n) => n.as_i64().or_else(|| n.as_f64().map(|f| f as i64)),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn is_user(role: &str) -> bool {
    matches!(role.to_ascii_lowercase().as_str(), "human" | "user")
}

fn is_assistant(role: &str) -> bool {
    matches!(role.to_ascii_lowercase().as_str(), "gpt" | "assistant" | "model")
}

/// Turn (role, text) pairs into (question, response): the first user turn, then the first assistant turn
/// after it.
fn pick_turns<'a>(turns: impl Iterator<Item = (&'a str, &'a str)>) -> Result<(String, String), (SkipReason, String)> {
    let mut question: Option<&str> = None;
    for (role, text) in turns {
        if question.is_none() {
            if is_user(role) {
                question = Some(text);
            }
        } else if is_assistant(role) {
            return finish_pair(question.unwrap_or_default(), text);
        }
    }
    match question {
        None => Err((SkipReason::NoHumanTurn, String::new())),
        Some(_) => Err((SkipReason::NoAssistantTurn, String::new())),
    }
}

fn finish_pair(question: &str, response: &str) -> Result<(String, String), (SkipReason, String)> {
    if question.trim().is_empty() {
        return Err((SkipReason::EmptyQuestion, String::new()));
    }
    if response.trim().is_empty() {
        return Err((SkipReason::EmptyResponse, String::new()));
    }
    Ok((question.to_string(), response.to_string()))
}

/// Parse one JSONL line into a row.
pub(crate) fn parse_json_row(line: &RawLine, opts: &ReadOptions) -> Result<Row, (SkipReason, String)> {
    let too_large = line.too_large.map(|(bytes, _)| bytes).or_else(|| {
        let bytes = line.bytes.len() as u64;
        (bytes > opts.max_row_bytes as u64).then_some(bytes)
    });
    if let Some(bytes) = too_large {
        return Err((SkipReason::RowTooLarge, opts.over_limit(bytes)));
    }
    if line.bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        // serde would read a JSON array as a struct by position: only objects are rows.
        return Err(match line.json::<serde_json::Value>() {
            Ok(_) => (SkipReason::BadSchema, "not a JSON object".into()),
            Err(LineError::Utf8(at)) => (SkipReason::InvalidUtf8, format!("at byte {at}")),
            Err(LineError::Json(e)) => (SkipReason::BadJson, e.to_string()),
            Err(e @ LineError::TooLarge { .. }) => (SkipReason::RowTooLarge, e.to_string()),
        });
    }
    let row: JsonRow = match line.json() {
        Ok(r) => r,
        Err(LineError::Utf8(at)) => return Err((SkipReason::InvalidUtf8, format!("at byte {at}"))),
        Err(LineError::Json(e)) => {
            let reason = if e.classify() == serde_json::error::Category::Data {
                SkipReason::BadSchema
            } else {
                SkipReason::BadJson
            };
            return Err((reason, e.to_string()));
        }
        Err(e @ LineError::TooLarge { .. }) => return Err((SkipReason::RowTooLarge, e.to_string())),
    };
    let (question, response) = match (&row.conversations, &row.prompt, &row.response) {
        (Some(turns), _, _) => {
            pick_turns(turns.iter().map(|t| (t.from.as_deref().unwrap_or(""), t.value.as_deref().unwrap_or(""))))?
        }
        (None, Some(p), Some(r)) => finish_pair(p, r)?,
        (None, None, Some(_)) => return Err((SkipReason::NoHumanTurn, "row has `response` but no `prompt`".into())),
        (None, Some(_), None) => {
            return Err((SkipReason::NoAssistantTurn, "row has `prompt` but no `response`".into()))
        }
        (None, None, None) => {
            return Err((SkipReason::MissingConversations, "no `conversations` nor `prompt`/`response`".into()))
        }
    };
    check_logprobs(row.teacher_logprobs.as_deref())?;
    Ok(Row {
        question,
        response,
        domain: value_string(row.domain),
        source: value_string(row.source),
        difficulty: value_i64(row.difficulty),
        teacher_logprobs: row.teacher_logprobs,
    })
}

/// Refuse teacher log-probs that are not log-probabilities: each must be finite and at most 0. An
/// infinite one (a value past f32's range, such as `1e39`) or one above 0 would put every ratio at its clip
/// and the gradient at 0, and the run would learn nothing without a word.
fn check_logprobs(lp: Option<&[f32]>) -> Result<(), (SkipReason, String)> {
    let Some((i, v)) = lp.into_iter().flatten().enumerate().find(|(_, v)| !(v.is_finite() && **v <= 0.0)) else {
        return Ok(());
    };
    let what = if v.is_finite() { "above 0" } else { "not finite (or beyond f32's range)" };
    Err((SkipReason::BadLogprobs, format!("teacher_logprobs[{i}] = {v} is {what}: a log-prob must be finite and <= 0")))
}

fn field_str(f: &parquet::record::Field) -> Option<String> {
    use parquet::record::Field;
    match f {
        Field::Str(s) => Some(s.clone()),
        Field::Bytes(b) => std::str::from_utf8(b.data()).ok().map(str::to_string),
        Field::Null => None,
        other => Some(other.to_string()),
    }
}

fn field_i64(f: &parquet::record::Field) -> Option<i64> {
    use parquet::record::Field;
    match f {
        Field::Byte(x) => Some(*x as i64),
        Field::Short(x) => Some(*x as i64),
        Field::Int(x) => Some(*x as i64),
        Field::Long(x) => Some(*x),
        Field::UInt(x) => Some(*x as i64),
        Field::ULong(x) => Some(*x as i64),
        Field::Float(x) => Some(*x as i64),
        Field::Double(x) => Some(*x as i64),
        Field::Str(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn field_f32(f: &parquet::record::Field) -> Option<f32> {
    use parquet::record::Field;
    match f {
        Field::Float(x) => Some(*x),
        Field::Double(x) => Some(*x as f32),
        Field::Int(x) => Some(*x as f32),
        Field::Long(x) => Some(*x as f32),
        _ => None,
    }
}

/// Convert a Parquet record into a row.
pub(crate) fn parse_parquet_row(row: &parquet::record::Row) -> Result<Row, (SkipReason, String)> {
    use parquet::record::Field;
    let mut out = Row {
        question: String::new(),
        response: String::new(),
        domain: None,
        source: None,
        difficulty: None,
        teacher_logprobs: None,
    };
    let mut turns: Option<Vec<(String, String)>> = None;
    let (mut prompt, mut response) = (None, None);
    for (name, field) in row.get_column_iter() {
        match name.as_str() {
            "difficulty" => out.difficulty = field_i64(field),
            "source" => out.source = field_str(field),
            "domain" => out.domain = field_str(field),
            "prompt" | "question" | "problem" => prompt = field_str(field),
            "response" | "completion" => response = field_str(field),
            "conversations" | "messages" => match field {
                Field::ListInternal(list) => {
                    let mut v = Vec::with_capacity(list.len());
                    for el in list.elements() {
                        let Field::Group(turn) = el else {
                            return Err((SkipReason::BadSchema, format!("`{name}` element is not a struct")));
                        };
                        let (mut role, mut text) = (String::new(), String::new());
                        for (k, f) in turn.get_column_iter() {
                            match k.as_str() {
                                "from" | "role" => role = field_str(f).unwrap_or_default(),
                                "value" | "content" => text = field_str(f).unwrap_or_default(),
                                _ => {}
                            }
                        }
                        v.push((role, text));
                    }
                    turns = Some(v);
                }
                Field::Null => {}
                _ => return Err((SkipReason::BadSchema, format!("`{name}` is not a list"))),
            },
            "teacher_logprobs" | "logprobs" => match field {
                Field::ListInternal(list) => {
                    let lp: Option<Vec<f32>> = list.elements().iter().map(field_f32).collect();
                    out.teacher_logprobs =
                        Some(lp.ok_or((SkipReason::BadSchema, format!("`{name}` holds non-numbers")))?);
                }
                Field::Null => {}
                _ => return Err((SkipReason::BadSchema, format!("`{name}` is not a list"))),
            },
            _ => {}
        }
    }
    let (q, r) = match (turns, prompt, response) {
        (Some(t), _, _) => pick_turns(t.iter().map(|(a, b)| (a.as_str(), b.as_str())))?,
        (None, Some(p), Some(r)) => finish_pair(&p, &r)?,
        (None, None, Some(_)) => return Err((SkipReason::NoHumanTurn, String::new())),
        (None, Some(_), None) => return Err((SkipReason::NoAssistantTurn, String::new())),
        (None, None, None) => return Err((SkipReason::MissingConversations, String::new())),
    };
    out.question = q;
    out.response = r;
    check_logprobs(out.teacher_logprobs.as_deref())?;
    Ok(out)
}

/// A parsed row or why it is bad.
type Parsed = Result<Row, (SkipReason, String)>;

/// Rows handed to the parallel map at once (bounded by count and by bytes).
const BATCH_ROWS: usize = 4096;
const BATCH_BYTES: usize = 32 << 20;

/// Stream every row of one file: `map` runs in parallel on batches (parse work, hashing, tokenising),
/// `sink` receives the results sequentially in file order. Memory is bounded by one batch.
pub(crate) fn scan_file<T, M, S>(
    file: u32,
    path: &Path,
    opts: &ReadOptions,
    map: M,
    mut sink: S,
) -> Result<(), DataError>
where
    T: Send,
    M: Fn(RowRef, Result<Row, BadRow>) -> T + Sync,
    S: FnMut(T) -> Result<(), DataError>,
{
    if is_parquet(path) {
        return scan_parquet(file, path, map, sink);
    }
    // A reader thread keeps decompression and line splitting off the parsing threads.
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Vec<RawLine>, DataError>>(2);
    let lines = Lines::open(path)?.max_line_bytes(opts.max_row_bytes);
    std::thread::scope(|scope| -> Result<(), DataError> {
        scope.spawn(move || {
            let mut batch = Vec::with_capacity(BATCH_ROWS);
            let mut bytes = 0usize;
            for line in lines {
                match line {
                    Ok(l) => {
                        bytes += l.bytes.len();
                        batch.push(l);
                        if batch.len() >= BATCH_ROWS || bytes >= BATCH_BYTES {
                            bytes = 0;
                            if tx.send(Ok(std::mem::take(&mut batch))).is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.into()));
                        return;
                    }
                }
            }
            if !batch.is_empty() {
                let _ = tx.send(Ok(batch));
            }
        });
        for batch in rx {
            let batch = batch?;
            let results: Vec<T> = batch
                .into_par_iter()
                .map(|line| {
                    let rref = RowRef { file, ordinal: line.number };
                    let parsed = parse_json_row(&line, opts).map_err(|(reason, detail)| BadRow {
                        path: path.to_path_buf(),
                        location: Location::Line { line: line.number },
                        reason,
                        detail,
                    });
                    drop(line);
                    map(rref, parsed)
                })
                .collect();
            for r in results {
                // Dropping the receiver on error ends the reader thread at its next send.
                sink(r)?;
            }
        }
        Ok(())
    })
}

/// Refuse, once for the whole file, a Parquet schema that no row can be read from: it needs a
/// `conversations` (or `messages`) column, or a prompt column (`prompt`, `question`, `problem`) with a response
/// column (`response`, `completion`).
fn check_parquet_columns(path: &Path, schema: &parquet::schema::types::Type) -> Result<(), DataError> {
    let columns: Vec<&str> = schema.get_fields().iter().map(|f| f.name()).collect();
    let has = |names: &[&str]| columns.iter().any(|c| names.contains(c));
    let turns = has(&["conversations", "messages"]);
    if turns || (has(&["prompt", "question", "problem"]) && has(&["response", "completion"])) {
        return Ok(());
    }
    let listed: Vec<String> = columns.iter().map(|c| format!("`{c}`")).collect();
    Err(DataError::Format {
        path: path.to_path_buf(),
        message: format!(
            "no `conversations` column (nor `messages`, nor a `prompt`/`question`/`problem` column with a \
             `response`/`completion` column): no row can be read; its columns are {}",
            if listed.is_empty() { "none".to_string() } else { listed.join(", ") }
        ),
    })
}

fn scan_parquet<T, M, S>(file: u32, path: &Path, map: M, mut sink: S) -> Result<(), DataError>
where
    T: Send,
    M: Fn(RowRef, Result<Row, BadRow>) -> T + Sync,
    S: FnMut(T) -> Result<(), DataError>,
{
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let pq_err =
        |e: parquet::errors::ParquetError| DataError::Parquet { path: path.to_path_buf(), message: e.to_string() };
    let f = File::open(path).map_err(io_err(path))?;
    let reader = SerializedFileReader::new(f).map_err(pq_err)?;
    check_parquet_columns(path, reader.metadata().file_metadata().schema_descr().root_schema())?;
    let mut global = 0u64;
    for rg in 0..reader.metadata().num_row_groups() {
        let group = reader.get_row_group(rg).map_err(pq_err)?;
        let iter = group.get_row_iter(None).map_err(pq_err)?;
        let mut batch: Vec<(u64, u64, Parsed)> = Vec::with_capacity(1024);
        let mut flush = |batch: &mut Vec<(u64, u64, Parsed)>| -> Result<(), DataError> {
            let results: Vec<T> = std::mem::take(batch)
                .into_par_iter()
                .map(|(ordinal, row, parsed)| {
                    let parsed = parsed.map_err(|(reason, detail)| BadRow {
                        path: path.to_path_buf(),
                        location: Location::Parquet { row_group: rg, row },
                        reason,
                        detail,
                    });
                    map(RowRef { file, ordinal }, parsed)
                })
                .collect();
            results.into_iter().try_for_each(&mut sink)
        };
        for (i, rec) in iter.enumerate() {
            let parsed = match rec {
                Ok(r) => parse_parquet_row(&r),
                Err(e) => Err((SkipReason::BadSchema, e.to_string())),
            };
            batch.push((global, i as u64, parsed));
            global += 1;
            if batch.len() >= 1024 {
                flush(&mut batch)?;
            }
        }
        flush(&mut batch)?;
    }
    Ok(())
}

/// Read every row of the inputs into memory (small data sets, tests): good rows and bad rows, in order.
pub fn read_all(paths: &[PathBuf], opts: &ReadOptions) -> Result<(Vec<Row>, Vec<BadRow>), DataError> {
    let (mut rows, mut bad) = (Vec::new(), Vec::new());
    for (i, p) in paths.iter().enumerate() {
        scan_file(
            i as u32,
            p,
            opts,
            |_, r| r,
            |r| {
                match r {
                    Ok(row) => rows.push(row),
                    Err(b) => bad.push(b),
                }
                Ok(())
            },
        )?;
    }
    Ok((rows, bad))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_over_the_limit_names_the_flag_and_the_config_key() {
        let opts = ReadOptions { max_row_bytes: 8 };
        let line = RawLine::new(3, br#"{"conversations": []}"#.to_vec());
        let (reason, detail) = parse_json_row(&line, &opts).unwrap_err();
        assert_eq!(reason, SkipReason::RowTooLarge);
        assert_eq!(
            detail,
            "21 bytes > the row limit of 8 bytes (--max-row-bytes, or data.max_row_bytes in a training config)"
        );
    }

    fn parse(s: &str) -> Result<Row, SkipReason> {
        parse_json_row(&RawLine::new(1, s.as_bytes().to_vec()), &ReadOptions::default()).map_err(|e| e.0)
    }

    #[test]
    fn ot3_and_plain_rows() {
        let r = parse(r#"{"difficulty":null,"source":"s","domain":"math","conversations":[{"from":"human","value":"Q?"},{"from":"gpt","value":"A \\boxed{1}"}]}"#).unwrap();
        assert_eq!((r.question.as_str(), r.response.as_str()), ("Q?", "A \\boxed{1}"));
        assert_eq!((r.domain.as_deref(), r.source.as_deref(), r.difficulty), (Some("math"), Some("s"), None));
        let r = parse(r#"{"messages":[{"role":"system","content":"x"},{"role":"user","content":"Q"},{"role":"assistant","content":"A"}],"difficulty":7}"#).unwrap();
        assert_eq!((r.question.as_str(), r.response.as_str(), r.difficulty), ("Q", "A", Some(7)));
        let r = parse(r#"{"prompt":"Q","response":"A","teacher_logprobs":[-0.5,-1.0]}"#).unwrap();
        assert_eq!(r.teacher_logprobs, Some(vec![-0.5, -1.0]));
    }

    #[test]
    fn teacher_logprobs_that_are_not_log_probabilities_skip_the_row() {
        for lp in ["[-0.5,1e39]", "[-1e39]", "[0.25,-1.0]"] {
            let line =
                RawLine::new(4, format!(r#"{{"prompt":"Q","response":"A","teacher_logprobs":{lp}}}"#).into_bytes());
            let (reason, detail) = parse_json_row(&line, &ReadOptions::default()).unwrap_err();
            assert_eq!(reason, SkipReason::BadLogprobs, "{lp}");
            assert!(detail.contains("must be finite and <= 0"), "{detail}");
        }
        assert_eq!(parse(r#"{"prompt":"Q","response":"A","logprobs":[0.0,-0.0,-30.5]}"#).unwrap().response, "A");
    }

    #[test]
    fn inputs_from_files_folders_and_globs() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir_all(&sub).unwrap();
        for f in ["a.jsonl", "b.parquet", "meta.json", "sub/c.jsonl.gz", "notes.txt"] {
            std::fs::write(dir.path().join(f), "").unwrap();
        }
        let d = dir.path().to_str().unwrap();
        let names = |v: Vec<PathBuf>| {
            v.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect::<Vec<_>>()
        };
        assert_eq!(names(resolve_inputs(&[d]).unwrap()), ["a.jsonl", "b.parquet", "c.jsonl.gz"]);
        let glob = format!("{d}/*.jsonl");
        let file = format!("{d}/meta.json");
        assert_eq!(
            names(resolve_inputs(&[glob.as_str(), file.as_str(), glob.as_str()]).unwrap()),
            ["a.jsonl", "meta.json"]
        );
        assert!(matches!(resolve_inputs(&[format!("{d}/*.zzz")]), Err(DataError::NoInput(_))));
    }

    #[test]
    fn bad_rows_have_reasons() {
        assert_eq!(parse("{bad"), Err(SkipReason::BadJson));
        assert_eq!(parse("[1,2]"), Err(SkipReason::BadSchema));
        assert_eq!(parse("nonsense"), Err(SkipReason::BadJson));
        assert_eq!(parse(r#"{"conversations":"x"}"#), Err(SkipReason::BadSchema));
        assert_eq!(parse(r#"{"domain":"math"}"#), Err(SkipReason::MissingConversations));
        assert_eq!(parse(r#"{"conversations":[{"from":"gpt","value":"A"}]}"#), Err(SkipReason::NoHumanTurn));
        assert_eq!(parse(r#"{"conversations":[{"from":"human","value":"Q"}]}"#), Err(SkipReason::NoAssistantTurn));
        assert_eq!(
            parse(r#"{"conversations":[{"from":"human","value":"Q"},{"from":"gpt","value":"  "}]}"#),
            Err(SkipReason::EmptyResponse)
        );
        let big = format!(r#"{{"prompt":"Q","response":"{}"}}"#, "x".repeat(2 << 20));
        assert_eq!(parse(&big), Err(SkipReason::RowTooLarge));
    }
}
