//! Grouping the answers of one question (the same human turn, whitespace-normalised) into a group,
//! wherever its rows are in the inputs.
//!
//! [`scan`] streams in bounded memory: a first pass writes one compact record per row (question hash,
//! row position, extracted answer, lengths; never the text) into one of K hash-partitioned spill files,
//! then each partition is grouped on its own. [`group_rows`] does the same in memory on rows already read
//! and keeps the text. Both pick at most G answers per group reproducibly from the seed (the choice does
//! not depend on row order, and the seed changes nothing where no question has more than G answers: a
//! group's answers are in the order of their text's hash), drop groups smaller than the minimum, and label groups with [`label_group`]: the majority vote over
//! every answer of the question (or only the chosen ones), ties dropped or not, a minimum vote margin, and
//! an optional seeded sample of at most `max_questions` questions.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::label::{label_group, Labels};
use super::reader::{scan_file, BadRow, ReadOptions, Row, RowRef};
use super::stats::{LengthHistogram, Stats};
use super::{io_err, question_hash, question_id, DataError, Fnv};
use crate::model::tokenizer::ChatTokenizer;
use crate::reward::{extract_answer, ExtractOptions};

/// How rows become groups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct GroupOptions {
    /// Answers kept per question (G; 0 keeps all), chosen reproducibly from the seed.
    #[arg(long, default_value_t = 8)]
    pub group_size: usize,
    /// Questions with fewer answers are dropped (and counted).
    #[arg(long, default_value_t = 2)]
    pub min_group_size: usize,
    /// Seed of the choice of answers when a question has more than the group size (training: train.seed).
    #[arg(long, default_value_t = 0)]
    #[serde(skip)]
    pub seed: u64,
    /// Keep only these domains (e.g. math; comma-separated or repeated; empty: all).
    #[arg(long = "domain", value_delimiter = ',')]
    pub domains: Vec<String>,
    /// Keep only these sources (comma-separated or repeated; empty: all).
    #[arg(long = "source", value_delimiter = ',')]
    pub sources: Vec<String>,
    /// Which answers vote for the majority answer: every answer of the question (all) or only the chosen
    /// group (group). Over-long answers vote with their full text.
    #[arg(long, value_enum, default_value_t = VoteOver::All)]
    pub vote_over: VoteOver,
    /// A vote where two answers tie for the majority: drop the group, or let the first answer in the group's
    /// order win (the order of the answers' text hashes, whatever the rows' order).
    #[arg(long, value_enum, default_value_t = Ties::Drop)]
    pub ties: Ties,
    /// Groups whose vote margin (winner's count minus the runner-up's) is below this are dropped.
    #[arg(long, default_value_t = 0)]
    pub min_vote_margin: usize,
    /// Keep a sample of at most this many questions (0: all), drawn from the seed among the groups that
    /// pass every other rule.
    #[arg(long, default_value_t = 0)]
    pub max_questions: usize,
    /// Answer extraction for the labels.
    #[arg(skip)]
    #[serde(skip)]
    pub extract: ExtractOptions,
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            group_size: 8,
            min_group_size: 2,
            seed: 0,
            domains: vec![],
            sources: vec![],
            vote_over: VoteOver::All,
            ties: Ties::Drop,
            min_vote_margin: 0,
            max_questions: 0,
            extract: ExtractOptions::default(),
        }
    }
}

/// Which answers of a question vote for its majority answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum VoteOver {
    /// Every answer of the question (OpenThoughts3 has 16), before the G are chosen.
    All,
    /// Only the G answers chosen for training.
    Group,
}

/// What a tied majority vote does to its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Ties {
    /// Leave the group out (counted as `dropped_tie`).
    Drop,
    /// The answer seen first among the tied ones wins.
    First,
}

impl GroupOptions {
    fn keeps(&self, row: &Row) -> bool {
        let ok = |list: &[String], v: &Option<String>| {
            list.is_empty() || v.as_ref().is_some_and(|v| list.iter().any(|x| x.eq_ignore_ascii_case(v)))
        };
        ok(&self.domains, &row.domain) && ok(&self.sources, &row.source)
    }
}

/// Which teacher rows are read and how they become groups: the `[data]` keys of the train config and the
/// input flags of `grpo data stats` and `grpo data prepare`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct InputOptions {
    /// JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet files, folders or globs (repeatable).
    #[arg(long = "input", short = 'i', num_args = 1.., required = true)]
    pub inputs: Vec<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub group: GroupOptions,
    #[command(flatten)]
    #[serde(flatten)]
    pub read: ReadOptions,
    /// Stop at the first bad row (with its file and line) instead of skipping it.
    #[arg(long)]
    pub strict: bool,
    /// Spill partitions of the grouping pass (0: from the input size).
    #[arg(long, default_value_t = 0, hide = true)]
    #[serde(skip)]
    pub partitions: usize,
}

/// One response of a [`LabeledGroup`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LabeledResponse {
    pub text: String,
    pub answer: Option<String>,
    pub reward: f32,
    pub teacher_logprobs: Option<Vec<f32>>,
}

/// A question with its chosen answers and their labels (in memory, full text).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LabeledGroup {
    pub question_hash: u64,
    pub question_id: String,
    pub question: String,
    pub domain: Option<String>,
    pub source: Option<String>,
    pub responses: Vec<LabeledResponse>,
    pub majority: Option<String>,
    pub majority_count: usize,
    pub vote_margin: usize,
}

/// The compact per-row record of the first pass.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Record {
    pub qhash: u64,
    /// Hash of the response text (the reproducible choice of G answers depends on it, not on row order).
    pub rhash: u64,
    pub rref: RowRef,
    pub prompt_len: u32,
    pub response_len: u32,
    pub has_logprobs: bool,
    pub answer: Option<String>,
    pub domain: Option<String>,
    pub source: Option<String>,
}

fn put_str(w: &mut impl Write, s: &Option<String>) -> std::io::Result<()> {
    match s {
        None => w.write_all(&u32::MAX.to_le_bytes()),
        Some(s) => {
            w.write_all(&(s.len() as u32).to_le_bytes())?;
            w.write_all(s.as_bytes())
        }
    }
}

fn get_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn get_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn get_str(r: &mut impl Read) -> std::io::Result<Option<String>> {
    let n = get_u32(r)?;
    if n == u32::MAX {
        return Ok(None);
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b)?;
    String::from_utf8(b).map(Some).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

impl Record {
    fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(&self.qhash.to_le_bytes())?;
        w.write_all(&self.rhash.to_le_bytes())?;
        w.write_all(&self.rref.file.to_le_bytes())?;
        w.write_all(&self.rref.ordinal.to_le_bytes())?;
        w.write_all(&self.prompt_len.to_le_bytes())?;
        w.write_all(&self.response_len.to_le_bytes())?;
        w.write_all(&[self.has_logprobs as u8])?;
        put_str(w, &self.answer)?;
        put_str(w, &self.domain)?;
        put_str(w, &self.source)
    }

    /// Read one record; Ok(None) at a clean end of file.
    fn read(r: &mut impl Read) -> std::io::Result<Option<Self>> {
        let mut b = [0u8; 8];
        match r.read_exact(&mut b) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let qhash = u64::from_le_bytes(b);
        let rhash = get_u64(r)?;
        let file = get_u32(r)?;
        let ordinal = get_u64(r)?;
        let prompt_len = get_u32(r)?;
        let response_len = get_u32(r)?;
        let mut f = [0u8; 1];
        r.read_exact(&mut f)?;
        Ok(Some(Record {
            qhash,
            rhash,
            rref: RowRef { file, ordinal },
            prompt_len,
            response_len,
            has_logprobs: f[0] != 0,
            answer: get_str(r)?,
            domain: get_str(r)?,
            source: get_str(r)?,
        }))
    }
}

/// How lengths are measured in the first pass.
pub(crate) enum Measure<'a> {
    Chars,
    /// Prompt = chat-template rendering of [system?, user] with the generation prompt (or the bare
    /// question when the tokenizer has no template); response = its tokens, plus one EOS when `eos`.
    /// With `responses` false, response lengths are not measured (0): prepare tokenises the chosen
    /// responses in its second pass anyway and measures them there.
    Tokens {
        tok: &'a ChatTokenizer,
        system: Option<&'a str>,
        eos: bool,
        responses: bool,
        prompts: PromptCache,
    },
}

/// Prompt lengths by question hash: the answers of a question share their prompt, and rendering the
/// chat template is the slow part. Cleared when full, so it stays small.
#[derive(Default)]
pub(crate) struct PromptCache(std::sync::Mutex<std::collections::HashMap<u64, u32>>);

impl PromptCache {
    const MAX: usize = 1 << 16;
    fn get_or(&self, q: u64, f: impl FnOnce() -> Result<u32, DataError>) -> Result<u32, DataError> {
        if let Some(&n) = self.0.lock().unwrap_or_else(|e| e.into_inner()).get(&q) {
            return Ok(n);
        }
        let n = f()?;
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= Self::MAX {
            map.clear();
        }
        map.insert(q, n);
        Ok(n)
    }
}

impl Measure<'_> {
    pub(crate) fn unit(&self) -> &'static str {
        match self {
            Measure::Chars => "characters",
            Measure::Tokens { .. } => "tokens",
        }
    }

    pub(crate) fn tokens<'a>(
        tok: &'a ChatTokenizer,
        system: Option<&'a str>,
        eos: bool,
        responses: bool,
    ) -> Measure<'a> {
        Measure::Tokens { tok, system, eos, responses, prompts: PromptCache::default() }
    }

    fn lengths(&self, qhash: u64, row: &Row) -> Result<(u32, u32), DataError> {
        match self {
            Measure::Chars => Ok((row.question.chars().count() as u32, row.response.chars().count() as u32)),
            Measure::Tokens { tok, system, eos, responses, prompts } => {
                let p = prompts.get_or(qhash, || Ok(prompt_tokens(tok, *system, &row.question)?.len() as u32))?;
                let r = if *responses { tok.encode(&row.response, false)?.len() + *eos as usize } else { 0 };
                Ok((p, r as u32))
            }
        }
    }
}

/// The prompt tokens of a question: the chat template's rendering of [system?, user] with the generation
/// prompt, encoded without special tokens (or the bare question with them, for tokenizers without a
/// template).
pub(crate) fn prompt_tokens(tok: &ChatTokenizer, system: Option<&str>, question: &str) -> Result<Vec<u32>, DataError> {
    if tok.has_template() {
        let text = tok.render_prompt(system, question)?;
        Ok(tok.encode(&text, false)?)
    } else {
        Ok(tok.encode(question, true)?)
    }
}

/// Length limits applied while grouping (prepare).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Limits<'a> {
    pub max_prompt: Option<u32>,
    pub max_response: Option<u32>,
    /// Drop over-long responses (true) or keep them truncated (false).
    pub drop_long: bool,
    /// Set by a stop request: the scan stops at the next row with [`DataError::Interrupted`].
    pub stop: Option<&'a std::sync::atomic::AtomicBool>,
}

/// A group as the streaming scan delivers it: records of the chosen answers, in group order.
pub(crate) struct ScannedGroup {
    pub qhash: u64,
    pub records: Vec<Record>,
    pub labels: Labels,
}

fn choice_key(seed: u64, r: &Record) -> u64 {
    let mut h = Fnv::new();
    h.write_u64(seed);
    h.write_u64(r.qhash);
    h.write_u64(r.rhash);
    h.finish()
}

/// The key that orders questions for the `max_questions` sample.
fn sample_key(seed: u64, qhash: u64) -> u64 {
    let mut h = Fnv::new();
    h.write(b"sample");
    h.write_u64(seed);
    h.write_u64(qhash);
    h.finish()
}

/// The `max_questions` sample: the questions with the smallest sample keys among the eligible ones.
#[derive(Default)]
struct Sample {
    /// While collecting: the `max` smallest (key, question hash) seen, largest on top.
    heap: std::collections::BinaryHeap<(u64, u64)>,
    max: usize,
}

impl Sample {
    fn offer(&mut self, seed: u64, qhash: u64) {
        self.heap.push((sample_key(seed, qhash), qhash));
        if self.heap.len() > self.max {
            self.heap.pop();
        }
    }
    fn chosen(self) -> std::collections::HashSet<u64> {
        self.heap.into_iter().map(|(_, q)| q).collect()
    }
}

/// Group records (any order) into labelled groups, in order of question hash. With `sample`, only the
/// questions in it are delivered (the others are counted as not sampled).
fn form_groups(
    mut records: Vec<Record>,
    opts: &GroupOptions,
    limits: &Limits<'_>,
    sample: Option<&std::collections::HashSet<u64>>,
    stats: &mut Stats,
    hists: &mut (LengthHistogram, LengthHistogram),
    on_group: &mut dyn FnMut(ScannedGroup) -> Result<(), DataError>,
) -> Result<(), DataError> {
    // Each question's answers in an order that depends on neither the seed nor the rows' order: the seed
    // changes a group only where it chooses among more answers than the group size.
    records.sort_by_cached_key(|r| (r.qhash, r.rhash, r.rref));
    let mut start = 0;
    while start < records.len() {
        let q = records[start].qhash;
        let end = start + records[start..].iter().take_while(|r| r.qhash == q).count();
        let members: Vec<Record> = records[start..end].to_vec();
        start = end;
        stats.questions += 1;
        let Some((members, labels)) = choose_and_label(members, opts, limits, stats) else { continue };
        if sample.is_some_and(|s| !s.contains(&q)) {
            stats.groups_not_sampled += 1;
            continue;
        }
        let no_answer = members.iter().filter(|r| r.answer.is_none()).count();
        stats.add_group(labels.kind(), labels.vote_margin, members.len(), no_answer);
        hists.0.add(members[0].prompt_len as u64);
        for r in &members {
            let mut len = r.response_len;
            if let (Some(max), false) = (limits.max_response, limits.drop_long) {
                if len > max {
                    stats.responses_truncated += 1;
                    len = max;
                }
            }
            hists.1.add(len as u64);
        }
        on_group(ScannedGroup { qhash: q, records: members, labels })?;
    }
    Ok(())
}

/// Apply the prompt limit, the vote, the length limit, the group-size bounds, the tie rule and the vote
/// margin to one question's answers (in group order); the chosen answers and their labels, or None
/// when the group is dropped (counted in `stats`).
fn choose_and_label(
    mut members: Vec<Record>,
    opts: &GroupOptions,
    limits: &Limits<'_>,
    stats: &mut Stats,
) -> Option<(Vec<Record>, Labels)> {
    if limits.max_prompt.is_some_and(|max| members[0].prompt_len > max) {
        stats.groups_dropped_long_prompt += 1;
        return None;
    }
    // The vote over every answer needs them before the length limit and the cap remove some.
    let all_answers: Option<Vec<Option<String>>> =
        (opts.vote_over == VoteOver::All).then(|| members.iter().map(|r| r.answer.clone()).collect());
    if let (Some(max), true) = (limits.max_response, limits.drop_long) {
        let before = members.len();
        members.retain(|r| r.response_len <= max);
        stats.responses_dropped_long += (before - members.len()) as u64;
    }
    if members.len() < opts.min_group_size.max(1) {
        stats.groups_dropped_small += 1;
        return None;
    }
    if opts.group_size > 0 && members.len() > opts.group_size {
        stats.responses_over_cap += (members.len() - opts.group_size) as u64;
        members.sort_by_cached_key(|r| (choice_key(opts.seed, r), r.rref));
        members.truncate(opts.group_size);
        members.sort_by_key(|r| (r.rhash, r.rref));
    }
    let chosen: Vec<Option<String>> = members.iter().map(|r| r.answer.clone()).collect();
    let voters = all_answers.as_ref().unwrap_or(&chosen);
    let labels = label_group(voters, &chosen);
    if opts.ties == Ties::Drop && labels.is_tie() {
        stats.groups_dropped_tie += 1;
        return None;
    }
    if labels.vote_margin < opts.min_vote_margin {
        stats.groups_dropped_margin += 1;
        return None;
    }
    Some((members, labels))
}

/// The questions of the `max_questions` sample among `partitions` of records (None: no sample).
fn draw_sample<I>(
    partitions: I,
    opts: &GroupOptions,
    limits: &Limits<'_>,
) -> Result<Option<std::collections::HashSet<u64>>, DataError>
where
    I: IntoIterator<Item = Result<Vec<Record>, DataError>>,
{
    if opts.max_questions == 0 {
        return Ok(None);
    }
    let mut sample = Sample { max: opts.max_questions, ..Default::default() };
    let (mut stats, mut hists) = (Stats::default(), Default::default());
    for records in partitions {
        form_groups(records?, opts, limits, None, &mut stats, &mut hists, &mut |g| {
            sample.offer(opts.seed, g.qhash);
            Ok(())
        })?;
    }
    Ok(Some(sample.chosen()))
}

fn record_of(rref: RowRef, qhash: u64, row: &Row, opts: &GroupOptions, lengths: (u32, u32)) -> Record {
    let mut rh = Fnv::new();
    rh.write(row.response.as_bytes());
    Record {
        qhash,
        rhash: rh.finish(),
        rref,
        prompt_len: lengths.0,
        response_len: lengths.1,
        has_logprobs: row.teacher_logprobs.is_some(),
        answer: extract_answer(&row.response, &opts.extract),
        domain: row.domain.clone(),
        source: row.source.clone(),
    }
}

/// Group rows already in memory (lengths in characters). Returns the labelled groups in a fixed order
/// (by question hash) and their stats; `rows_read` counts the given rows.
pub fn group_rows(rows: Vec<Row>, opts: &GroupOptions) -> (Vec<LabeledGroup>, Stats) {
    let mut stats = Stats { length_unit: "characters".into(), ..Stats::default() };
    stats.rows_read = rows.len() as u64;
    let mut records = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        if !opts.keeps(row) {
            stats.rows_filtered += 1;
            continue;
        }
        let q = question_hash(&row.question);
        let lengths = Measure::Chars.lengths(q, row).unwrap_or_default();
        records.push(record_of(RowRef { file: 0, ordinal: i as u64 }, q, row, opts, lengths));
    }
    let mut rows: Vec<Option<Row>> = rows.into_iter().map(Some).collect();
    let mut groups = Vec::new();
    let mut hists = Default::default();
    let limits = Limits::default();
    // In memory nothing can fail: the sample (records copied only when one is drawn) and the groups are
    // always formed.
    let sample = draw_sample(std::iter::once_with(|| Ok(records.clone())), opts, &limits).unwrap_or_default();
    let _ = form_groups(records, opts, &limits, sample.as_ref(), &mut stats, &mut hists, &mut |g| {
        let mut responses = Vec::with_capacity(g.records.len());
        let mut first: Option<Row> = None;
        for (rec, &reward) in g.records.iter().zip(&g.labels.rewards) {
            let row = rows[rec.rref.ordinal as usize].take().unwrap_or_else(|| unreachable!("row used twice"));
            responses.push(LabeledResponse {
                text: row.response.clone(),
                answer: rec.answer.clone(),
                reward,
                teacher_logprobs: row.teacher_logprobs.clone(),
            });
            first.get_or_insert(row);
        }
        let first = first.unwrap_or_else(|| unreachable!("groups are never empty"));
        groups.push(LabeledGroup {
            question_hash: g.qhash,
            question_id: question_id(g.qhash),
            question: first.question,
            domain: first.domain,
            source: first.source,
            responses,
            majority: g.labels.majority,
            majority_count: g.labels.majority_count,
            vote_margin: g.labels.vote_margin,
        });
        Ok(())
    });
    stats.prompt_length = hists.0.summary();
    stats.response_length = hists.1.summary();
    (groups, stats)
}

/// A folder for the spill files in `parent` (default: the system temporary folder), removed when dropped.
fn spill_folder(parent: Option<&Path>) -> Result<tempfile::TempDir, DataError> {
    let parent = parent.map(Path::to_path_buf).unwrap_or_else(std::env::temp_dir);
    tempfile::Builder::new().prefix("grpo-spill-").tempdir_in(&parent).map_err(io_err(&parent))
}

enum Item {
    Bad(Box<BadRow>),
    Filtered,
    Rec(Record),
    Fail(DataError),
}

/// Stream the inputs, group and label in bounded memory, and return the stats. Bad rows go to `on_bad`
/// (and end the run in strict mode). With a tokenizer, lengths are in tokens (prompt rendered with the
/// chat template), otherwise in characters.
pub fn scan(
    files: &[PathBuf],
    opts: &InputOptions,
    tokenizer: Option<&ChatTokenizer>,
    on_bad: &mut dyn FnMut(&BadRow),
) -> Result<Stats, DataError> {
    let measure = match tokenizer {
        Some(tok) => Measure::tokens(tok, None, false, true),
        None => Measure::Chars,
    };
    scan_with(files, opts, None, &measure, &Limits::default(), on_bad, &mut |_| Ok(()))
}

/// The streaming scan with a folder for the spill files (default: the system temporary folder), explicit
/// length measure, limits and a consumer of the groups.
pub(crate) fn scan_with(
    files: &[PathBuf],
    opts: &InputOptions,
    spill_dir: Option<&Path>,
    measure: &Measure<'_>,
    limits: &Limits<'_>,
    on_bad: &mut dyn FnMut(&BadRow),
    on_group: &mut dyn FnMut(ScannedGroup) -> Result<(), DataError>,
) -> Result<Stats, DataError> {
    let total_bytes: u64 = files.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    let k = if opts.partitions > 0 { opts.partitions } else { (total_bytes.div_ceil(16 << 20) as usize).clamp(8, 512) };
    let spill = spill_folder(spill_dir)?;
    let part_path = |i: usize| spill.path().join(format!("part-{i:04}.bin"));
    let parts: Vec<PathBuf> = (0..k).map(part_path).collect();
    let mut stats = partition_rows(files, opts, measure, limits, on_bad, &parts)?;
    let sample = draw_sample(parts.iter().map(|p| read_partition(p)), &opts.group, limits)?;
    let mut hists = Default::default();
    for p in &parts {
        let records = read_partition(p)?;
        let _ = std::fs::remove_file(p);
        form_groups(records, &opts.group, limits, sample.as_ref(), &mut stats, &mut hists, on_group)?;
    }
    stats.prompt_length = hists.0.summary();
    stats.response_length = hists.1.summary();
    Ok(stats)
}

/// The first pass: every row of `files` read (a bad one reported, and in strict mode the end), filtered,
/// measured and written as a record into the partition of its question (`parts`, by the question's hash),
/// so that a question's answers end up in one partition; the rows' counts.
fn partition_rows(
    files: &[PathBuf],
    opts: &InputOptions,
    measure: &Measure<'_>,
    limits: &Limits<'_>,
    on_bad: &mut dyn FnMut(&BadRow),
    parts: &[PathBuf],
) -> Result<Stats, DataError> {
    let k = parts.len();
    let mut writers = Vec::with_capacity(k);
    for p in parts {
        writers.push(BufWriter::with_capacity(64 << 10, File::create(p).map_err(io_err(p))?));
    }
    let mut stats = Stats { length_unit: measure.unit().to_string(), ..Stats::default() };
    let bar = crate::progress::progress_bar(None, "rows");
    for (fi, path) in files.iter().enumerate() {
        tracing::debug!("reading {}", path.display());
        scan_file(
            fi as u32,
            path,
            &opts.read,
            |rref, parsed| match parsed {
                Err(bad) => Item::Bad(Box::new(bad)),
                Ok(row) if !opts.group.keeps(&row) => Item::Filtered,
                Ok(row) => {
                    let q = question_hash(&row.question);
                    match measure.lengths(q, &row) {
                        Ok(lengths) => Item::Rec(record_of(rref, q, &row, &opts.group, lengths)),
                        Err(e) => Item::Fail(e),
                    }
                }
            },
            |item| {
                if limits.stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst)) {
                    return Err(DataError::Interrupted(format!("while reading {}", path.display())));
                }
                stats.rows_read += 1;
                bar.inc(1);
                match item {
                    Item::Bad(bad) => {
                        stats.skip(&bad);
                        on_bad(&bad);
                        if opts.strict {
                            return Err(DataError::BadRow(bad));
                        }
                    }
                    Item::Filtered => stats.rows_filtered += 1,
                    Item::Rec(rec) => {
                        let i = ((rec.qhash >> 40) % k as u64) as usize;
                        rec.write(&mut writers[i]).map_err(io_err(&parts[i]))?;
                    }
                    Item::Fail(e) => return Err(e),
                }
                Ok(())
            },
        )?;
    }
    bar.finish_and_clear();
    for (w, p) in writers.into_iter().zip(parts) {
        w.into_inner().map_err(|e| DataError::Io { path: p.clone(), source: e.into_error() })?;
    }
    Ok(stats)
}

/// The records of one partition file.
fn read_partition(p: &Path) -> Result<Vec<Record>, DataError> {
    let mut r = BufReader::with_capacity(1 << 20, File::open(p).map_err(io_err(p))?);
    let mut records = Vec::new();
    while let Some(rec) = Record::read(&mut r).map_err(io_err(p))? {
        records.push(rec);
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(q: &str, r: &str) -> Row {
        Row {
            question: q.into(),
            response: r.into(),
            domain: Some("math".into()),
            source: None,
            difficulty: None,
            teacher_logprobs: None,
        }
    }

    /// `n` answers `\boxed{a}` to question `q`, each with its own text.
    fn answers(q: &str, a: &str, n: usize) -> Vec<Row> {
        (0..n).map(|i| row(q, &format!("attempt {i}: \\boxed{{{a}}}"))).collect()
    }

    #[test]
    fn the_vote_is_over_every_answer_of_the_question_unless_asked_otherwise() {
        // 16 answers, 9 say 7 and 7 say 8; 8 of them are chosen.
        let rows = [answers("Q", "7", 9), answers("Q", "8", 7)].concat();
        let (g, _) = group_rows(rows.clone(), &GroupOptions::default());
        assert_eq!(g[0].responses.len(), 8);
        assert_eq!((g[0].majority.as_deref(), g[0].vote_margin), (Some("7"), 2));
        for r in &g[0].responses {
            assert_eq!(r.reward, if r.answer.as_deref() == Some("7") { 1.0 } else { 0.0 });
        }
        // Over the chosen 8 only, the count is that of the chosen answers.
        let group = GroupOptions { vote_over: VoteOver::Group, ties: Ties::First, ..Default::default() };
        let (g, _) = group_rows(rows, &group);
        let sevens = g[0].responses.iter().filter(|r| r.answer.as_deref() == Some("7")).count();
        assert!(g[0].majority_count == sevens.max(8 - sevens), "{sevens} sevens of 8");
    }

    #[test]
    fn labels_take_the_answer_after_the_thinking_not_the_boxes_inside_it() {
        // Every trace boxes an intermediate result while thinking; the final answers are 5, 5, 6.
        let rows: Vec<Row> = [("5", "5"), ("6", "5"), ("7", "6")]
            .iter()
            .map(|(inner, last)| {
                row("Q", &format!("<think>so far \\boxed{{{inner}}}</think> The answer is \\boxed{{{last}}}."))
            })
            .collect();
        let (g, _) = group_rows(rows, &GroupOptions::default());
        let mut got: Vec<Option<&str>> = g[0].responses.iter().map(|r| r.answer.as_deref()).collect();
        got.sort();
        assert_eq!(got, vec![Some("5"), Some("5"), Some("6")]);
        assert_eq!((g[0].majority.as_deref(), g[0].vote_margin), (Some("5"), 1));
    }

    #[test]
    fn ties_margins_and_the_question_sample() {
        // q0: a 4-4 tie; q1: 5 against 3 (margin 2); q2..q9: unanimous.
        let mut rows =
            [answers("q0", "1", 4), answers("q0", "2", 4), answers("q1", "3", 5), answers("q1", "4", 3)].concat();
        for i in 2..10 {
            rows.extend(answers(&format!("q{i}"), "5", 8));
        }
        let (g, st) = group_rows(rows.clone(), &GroupOptions::default());
        assert_eq!((g.len(), st.groups_dropped_tie), (9, 1));
        let (g, st) = group_rows(rows.clone(), &GroupOptions { ties: Ties::First, ..Default::default() });
        assert_eq!((g.len(), st.groups_dropped_tie), (10, 0));
        // The tie goes to the first answer in the group's order (by the text's hash, not the rows' order).
        let tie = g.iter().find(|g| g.vote_margin == 0).unwrap();
        assert_eq!(tie.majority, tie.responses[0].answer);
        let margin = GroupOptions { min_vote_margin: 3, ..Default::default() };
        let (g, st) = group_rows(rows.clone(), &margin);
        assert_eq!((g.len(), st.groups_dropped_tie, st.groups_dropped_margin), (8, 1, 1));
        let ids = |seed: u64| {
            let opts = GroupOptions { max_questions: 4, seed, ..Default::default() };
            let (g, st) = group_rows(rows.clone(), &opts);
            assert_eq!((g.len(), st.groups, st.groups_not_sampled, st.groups_dropped_tie), (4, 4, 5, 1));
            g.iter().map(|g| g.question.clone()).collect::<Vec<_>>()
        };
        assert_eq!(ids(0), ids(0), "the same seed draws the same sample");
        assert!((1..4).any(|seed| ids(seed) != ids(0)), "other seeds draw other samples");
        assert!(!ids(0).contains(&"q0".to_string()), "tied groups are never sampled");
    }

    #[test]
    fn record_round_trip() {
        let rec =
            record_of(RowRef { file: 3, ordinal: 99 }, 5, &row("Q", "\\boxed{7}"), &GroupOptions::default(), (4, 5));
        let mut buf = Vec::new();
        rec.write(&mut buf).unwrap();
        rec.write(&mut buf).unwrap();
        let mut r = &buf[..];
        assert_eq!(Record::read(&mut r).unwrap(), Some(rec.clone()));
        assert_eq!(Record::read(&mut r).unwrap(), Some(rec));
        assert_eq!(Record::read(&mut r).unwrap(), None);
    }

    #[test]
    fn cap_min_size_and_filters() {
        let mut rows = Vec::new();
        for i in 0..5 {
            rows.push(row("Q1", &format!("answer {i} \\boxed{{{}}}", if i < 4 { 1 } else { 2 })));
        }
        rows.push(row("Q2", "\\boxed{3}"));
        let mut other = row("Q3", "\\boxed{3}");
        other.domain = Some("code".into());
        rows.push(other);
        let opts =
            GroupOptions { group_size: 3, min_group_size: 2, domains: vec!["math".into()], ..Default::default() };
        let (groups, stats) = group_rows(rows.clone(), &opts);
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].responses.len(), 3);
        assert_eq!((stats.questions, stats.groups_dropped_small, stats.rows_filtered), (2, 1, 1));
        assert_eq!(stats.responses_over_cap, 2);
        // The choice does not depend on row order, and another seed may choose differently.
        let mut reversed = rows.clone();
        reversed.reverse();
        let (again, _) = group_rows(reversed, &opts);
        assert_eq!(again, groups);
        let chosen = |seed| {
            let (g, _) = group_rows(rows.clone(), &GroupOptions { seed, ..opts.clone() });
            g[0].responses.iter().map(|r| r.text.clone()).collect::<Vec<_>>()
        };
        assert!((1..20).any(|s| chosen(s) != chosen(0)));
    }
}
