//! `grpo data stats` / `grpo data prepare` on the real OT3-shaped fixture (50 questions x 8 answers), on a
//! shuffled copy with malformed lines mixed in, on a Parquet copy, and the prepared-shard reader.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use assert_cmd::Command;
use grpo::data::{self, PreparedDataset};
use grpo::reward::{extract_answer, majority_vote, rewards, ExtractOptions};
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/trajectories/ot3_math_x8_dev.jsonl")
}

fn tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tokenizers/qwen3")
}

fn grpo() -> Command {
    let mut c = Command::cargo_bin("grpo").unwrap();
    c.env("GRPO_CACHE_DIR", "off"); // no reference log-probs shared with other tests
    c
}

fn fixture_lines() -> Vec<String> {
    std::fs::read_to_string(fixture()).unwrap().lines().map(str::to_string).collect()
}

fn turns(line: &str) -> (String, String) {
    let v: Value = serde_json::from_str(line).unwrap();
    let c = &v["conversations"];
    (c[0]["value"].as_str().unwrap().to_string(), c[1]["value"].as_str().unwrap().to_string())
}

/// Run `data stats` with --json and return the JSON.
fn stats_json(input: &Path, extra: &[&str]) -> (Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("stats.json");
    let out =
        grpo().args(["data", "stats", "--input"]).arg(input).arg("--json").arg(&json).args(extra).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (v, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The fixture interleaved so that no two answers of a question are adjacent, with malformed lines mixed
/// in. Returns the file and the (line number, reason) of each bad line.
fn shuffled_with_bad_lines(dir: &Path) -> (PathBuf, Vec<(u64, &'static str)>) {
    let mut by_question: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut order = Vec::new();
    for line in fixture_lines() {
        let q = turns(&line).0;
        if !by_question.contains_key(&q) {
            order.push(q.clone());
        }
        by_question.entry(q).or_default().push(line);
    }
    let mut good = Vec::new();
    // Round robin over the questions: answer 1 of every question, then answer 2 of every question, ...
    let mut queues: Vec<_> = order.iter().map(|q| (q.clone(), by_question[q].clone().into_iter())).collect();
    loop {
        let before = good.len();
        for (q, answers) in queues.iter_mut() {
            if let Some(line) = answers.next() {
                good.push((q.clone(), line));
            }
        }
        if good.len() == before {
            break;
        }
    }
    assert_eq!(good.len(), 400);
    for w in good.windows(2) {
        assert_ne!(w[0].0, w[1].0, "two answers of one question are adjacent");
    }
    let big = format!(
        r#"{{"domain":"math","conversations":[{{"from":"human","value":"Big?"}},{{"from":"gpt","value":"{} \\boxed{{1}}"}}]}}"#,
        "x".repeat(3 << 20)
    );
    let bad: Vec<(usize, String, &'static str)> = vec![
        (10, r#"{"domain": "math", "conversations": [{"from": "human""#.into(), "bad_json"),
        (50, r#"{"domain":"math","source":"x","difficulty":null}"#.into(), "missing_conversations"),
        (100, r#"{"conversations":[{"from":"gpt","value":"\\boxed{1}"}]}"#.into(), "no_human_turn"),
        (
            200,
            r#"{"conversations":[{"from":"human","value":"What?"},{"from":"gpt","value":""}]}"#.into(),
            "empty_response",
        ),
        (300, big, "row_too_large"),
    ];
    let mut lines = Vec::new();
    let mut bad_at = Vec::new();
    for (i, (_, line)) in good.into_iter().enumerate() {
        for (at, text, reason) in &bad {
            if *at == i {
                lines.push(text.clone());
                bad_at.push((lines.len() as u64, *reason));
            }
        }
        lines.push(line);
    }
    let path = dir.join("shuffled.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    (path, bad_at)
}

/// Stats fields that describe the groups (not the rows).
const GROUP_FIELDS: [&str; 12] = [
    "questions",
    "groups",
    "groups_dropped_small",
    "responses",
    "responses_over_cap",
    "no_answer",
    "all_positive_groups",
    "all_negative_groups",
    "mixed_groups",
    "vote_margin_histogram",
    "group_size_histogram",
    "response_length",
];

#[test]
fn fixture_has_50_groups_of_8_and_all_positive_agrees_with_majority_vote() {
    let (s, _) = stats_json(&fixture(), &[]);
    assert_eq!(s["rows_read"], 400);
    assert_eq!(s["rows_skipped"], 0);
    assert_eq!(s["questions"], 50);
    assert_eq!(s["length_unit"], "characters");
    // The same labels computed here from the reward module on the raw answers.
    let mut groups: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
    for line in fixture_lines() {
        let (q, r) = turns(&line);
        let q = q.split_whitespace().collect::<Vec<_>>().join(" ");
        groups.entry(q).or_default().push(extract_answer(&r, &ExtractOptions::default()));
    }
    assert_eq!(groups.len(), 50);
    let (mut pos, mut neg, mut margins) = (0, 0, BTreeMap::<String, u64>::new());
    let (mut no_answer, mut ties) = (0, 0);
    for answers in groups.values() {
        let vote = majority_vote(answers);
        if vote.count > 0 && vote.margin == 0 {
            // A tied vote: the group is dropped (data.ties = "drop").
            ties += 1;
            continue;
        }
        let r = rewards(vote.answer.as_deref(), answers);
        pos += r.iter().all(|&x| x == 1.0) as u64;
        neg += r.iter().all(|&x| x == 0.0) as u64;
        *margins.entry(vote.margin.to_string()).or_default() += 1;
        no_answer += answers.iter().filter(|a| a.is_none()).count() as u64;
    }
    assert!(ties > 0, "the fixture has tied votes");
    assert_eq!((s["groups"].as_u64(), s["groups_dropped_tie"].as_u64()), (Some(50 - ties), Some(ties)));
    assert_eq!(s["responses"], 8 * (50 - ties));
    assert_eq!(s["group_size_histogram"], serde_json::json!({"8": 50 - ties}));
    assert_eq!(s["all_positive_groups"], pos);
    assert_eq!(s["all_negative_groups"], neg);
    assert_eq!(s["mixed_groups"], 50 - ties - pos - neg);
    assert_eq!(s["no_answer"], no_answer);
    assert_eq!(s["vote_margin_histogram"], serde_json::to_value(&margins).unwrap());
    assert!(pos > 25, "most fixture groups are all-positive ({pos})");
    let p = &s["response_length"];
    assert!(p["p10"].as_u64() <= p["p50"].as_u64() && p["p50"].as_u64() <= p["p99"].as_u64());
}

#[test]
fn shuffled_data_with_bad_lines_gives_identical_groups_and_reports_every_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let (path, bad) = shuffled_with_bad_lines(dir.path());
    let (clean, _) = stats_json(&fixture(), &[]);
    // Few partitions, so that the questions of a partition come from all over the file.
    let (s, stderr) = stats_json(&path, &["--partitions", "3"]);
    for f in GROUP_FIELDS {
        assert_eq!(s[f], clean[f], "{f}");
    }
    assert_eq!(s["rows_read"], 405);
    assert_eq!(s["rows_skipped"], 5);
    for (line, reason) in &bad {
        assert_eq!(s["skipped_by_reason"][reason], 1, "{reason}");
        let needle = format!("shuffled.jsonl: line {line}: {reason}");
        assert!(stderr.contains(&needle), "missing {needle:?} in\n{stderr}");
    }
    assert_eq!(stderr.matches("skipped ").count(), 5, "{stderr}");
}

#[test]
fn strict_stops_at_the_first_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let (path, bad) = shuffled_with_bad_lines(dir.path());
    let out = grpo().args(["data", "stats", "--strict", "--input"]).arg(&path).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let first = format!("shuffled.jsonl: line {}: {}", bad[0].0, bad[0].1);
    assert!(stderr.contains(&first), "{stderr}");
    assert!(!stderr.contains(&format!("line {}:", bad[1].0)), "{stderr}");
}

#[test]
fn filters_and_group_cap_are_counted() {
    let (s, _) = stats_json(&fixture(), &["--group-size", "5", "--min-group-size", "6", "--ties", "first"]);
    assert_eq!((s["groups"].as_u64(), s["groups_dropped_small"].as_u64()), (Some(50), Some(0)));
    assert_eq!((s["responses"].as_u64(), s["responses_over_cap"].as_u64()), (Some(250), Some(150)));
    let (s, _) = stats_json(&fixture(), &["--min-group-size", "9", "--ties", "first"]);
    assert_eq!((s["groups"].as_u64(), s["groups_dropped_small"].as_u64()), (Some(0), Some(50)));
    let (s, _) = stats_json(&fixture(), &["--domain", "code"]);
    assert_eq!((s["rows_filtered"].as_u64(), s["groups"].as_u64()), (Some(400), Some(0)));
    let (s, _) = stats_json(&fixture(), &["--domain", "math", "--source", "qwen2.5-math-eval/math", "--ties", "first"]);
    assert_eq!((s["rows_filtered"].as_u64(), s["groups"].as_u64()), (Some(0), Some(50)));
}

#[test]
fn stats_with_tokenizer_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("stats.png");
    let tok = tokenizer_dir();
    let (s, _) = stats_json(&fixture(), &["--tokenizer", tok.to_str().unwrap(), "--plot", png.to_str().unwrap()]);
    assert_eq!(s["length_unit"], "tokens");
    let (c, _) = stats_json(&fixture(), &[]);
    // Tokens are fewer than characters.
    assert!(s["response_length"]["p50"].as_u64() < c["response_length"]["p50"].as_u64());
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(bytes.len() > 10_000);
}

/// Write the fixture rows (and one bad row: an empty conversation) as Parquet in 3 row groups, with the
/// column layout of Hugging Face datasets (LIST of STRUCT{from, value}).
fn write_parquet(path: &Path) -> (usize, usize) {
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = Arc::new(
        parquet::schema::parser::parse_message_type(
            "message schema {
              OPTIONAL INT64 difficulty;
              OPTIONAL BYTE_ARRAY source (UTF8);
              OPTIONAL BYTE_ARRAY domain (UTF8);
              OPTIONAL group conversations (LIST) {
                REPEATED group list {
                  OPTIONAL group element {
                    OPTIONAL BYTE_ARRAY from (UTF8);
                    OPTIONAL BYTE_ARRAY value (UTF8);
                  }
                }
              }
            }",
        )
        .unwrap(),
    );
    let mut rows: Vec<Option<Vec<(String, String)>>> = fixture_lines()
        .iter()
        .map(|l| {
            let (q, r) = turns(l);
            Some(vec![("human".to_string(), q), ("gpt".to_string(), r)])
        })
        .collect();
    // The bad row: row 5 of row group 1 (0-based), an empty conversation list.
    let bad_index = 150 + 5;
    rows.insert(bad_index, Some(vec![]));
    let props = Arc::new(WriterProperties::builder().build());
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
    for chunk in rows.chunks(150) {
        let n = chunk.len();
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<Int64Type>().write_batch(&[], Some(&vec![0i16; n]), None).unwrap();
        col.close().unwrap();
        for value in ["qwen2.5-math-eval/math", "math"] {
            let mut col = rg.next_column().unwrap().unwrap();
            let vals = vec![ByteArray::from(value); n];
            col.typed::<ByteArrayType>().write_batch(&vals, Some(&vec![1i16; n]), None).unwrap();
            col.close().unwrap();
        }
        for field in 0..2 {
            let (mut vals, mut defs, mut reps) = (Vec::new(), Vec::new(), Vec::new());
            for row in chunk {
                match row {
                    None => {
                        defs.push(0);
                        reps.push(0);
                    }
                    Some(t) if t.is_empty() => {
                        defs.push(1);
                        reps.push(0);
                    }
                    Some(t) => {
                        for (i, turn) in t.iter().enumerate() {
                            let s = if field == 0 { &turn.0 } else { &turn.1 };
                            vals.push(ByteArray::from(s.as_str()));
                            defs.push(4);
                            reps.push(if i == 0 { 0 } else { 1 });
                        }
                    }
                }
            }
            let mut col = rg.next_column().unwrap().unwrap();
            col.typed::<ByteArrayType>().write_batch(&vals, Some(&defs), Some(&reps)).unwrap();
            col.close().unwrap();
        }
        rg.close().unwrap();
    }
    w.close().unwrap();
    (1, 5)
}

#[test]
fn parquet_gives_the_same_groups_as_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let pq = dir.path().join("ot3.parquet");
    let (rg, row) = write_parquet(&pq);
    let (clean, _) = stats_json(&fixture(), &[]);
    let (s, stderr) = stats_json(&pq, &[]);
    for f in GROUP_FIELDS {
        assert_eq!(s[f], clean[f], "{f}");
    }
    assert_eq!((s["rows_read"].as_u64(), s["rows_skipped"].as_u64()), (Some(401), Some(1)));
    assert_eq!(s["skipped_by_reason"]["no_human_turn"], 1);
    assert!(stderr.contains(&format!("ot3.parquet: row group {rg}, row {row}: no_human_turn")), "{stderr}");
    // Folder input picks the Parquet file up; the groups themselves are equal too.
    let rows_of = |p: &Path| {
        data::reader::read_all(&data::resolve_inputs(&[p.to_str().unwrap()]).unwrap(), &Default::default()).unwrap()
    };
    let (pq_rows, pq_bad) = rows_of(dir.path());
    let (js_rows, js_bad) = rows_of(&fixture());
    assert_eq!((pq_bad.len(), js_bad.len()), (1, 0));
    let opts = data::GroupOptions::default();
    assert_eq!(data::group_rows(pq_rows, &opts).0, data::group_rows(js_rows, &opts).0);
}

fn prepare(inputs: &[&Path], out: &Path, extra: &[&str]) -> String {
    let mut cmd = grpo();
    cmd.args(["data", "prepare", "--model"]).arg(tokenizer_dir()).arg("--out").arg(out).arg("--input");
    for i in inputs {
        cmd.arg(i);
    }
    let o = cmd.args(extra).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

#[test]
fn prepare_writes_shards_that_the_reader_maps_and_skips_when_up_to_date() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::copy(fixture(), &input).unwrap();
    let out = dir.path().join("prepared");
    prepare(&[&input], &out, &["--ties", "first"]);
    let ds = PreparedDataset::open(&out).unwrap();
    assert_eq!(ds.len(), 50);
    let tok = grpo::model::ChatTokenizer::load(&tokenizer_dir()).unwrap();
    let eos = tok.eos_ids()[0];
    // Texts by question, from the in-memory grouping of the same rows.
    let (rows, _) = data::reader::read_all(std::slice::from_ref(&input), &Default::default()).unwrap();
    let (groups, _) = data::group_rows(rows, &data::GroupOptions { ties: data::Ties::First, ..Default::default() });
    let by_id: BTreeMap<_, _> = groups.iter().map(|g| (g.question_id.clone(), g)).collect();
    let stats = ds.stats().unwrap();
    let mut all_positive = 0;
    for i in 0..ds.len() {
        let g = ds.group(i).unwrap();
        let mem = by_id[&g.question_id];
        assert_eq!(g.responses.len(), 8);
        let prompt = tok.decode(&g.prompt_tokens, false).unwrap();
        assert_eq!(prompt, tok.render_prompt(None, &mem.question).unwrap());
        assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt:?}");
        for (r, m) in g.responses.iter().zip(&mem.responses) {
            assert_eq!(r.tokens.last(), Some(&eos));
            assert!(!r.truncated);
            assert_eq!(tok.decode(&r.tokens[..r.tokens.len() - 1], false).unwrap(), m.text);
            assert_eq!((r.reward, &r.answer), (m.reward, &m.answer));
            assert_eq!(r.teacher_logprobs, None);
        }
        assert_eq!((&g.majority, g.vote_margin), (&mem.majority, mem.vote_margin));
        all_positive += g.responses.iter().all(|r| r.reward > 0.0) as u64;
    }
    assert_eq!(all_positive, stats.all_positive_groups);
    assert_eq!(stats.length_unit, "tokens");
    // Random access in any order gives the same groups.
    assert_eq!(ds.group(49).unwrap(), ds.group(49).unwrap());
    assert_eq!(ds.group(7).unwrap().index, 7);

    // Same inputs: skipped. Changed input: noticed and prepared again.
    assert!(prepare(&[&input], &out, &["--ties", "first"]).contains("up to date"));
    let mut lines = fixture_lines();
    lines.truncate(392);
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let again = prepare(&[&input], &out, &["--ties", "first"]);
    assert!(again.contains("changed"), "{again}");
    assert_eq!(PreparedDataset::open(&out).unwrap().len(), 49);
    // Changed options are noticed too.
    assert!(prepare(&[&input], &out, &["--ties", "first", "--min-group-size", "3"]).contains("options changed"));
}

#[test]
fn prepare_of_shuffled_and_malformed_input_gives_identical_groups() {
    let dir = tempfile::tempdir().unwrap();
    let (shuffled, _) = shuffled_with_bad_lines(dir.path());
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    prepare(&[&fixture()], &a, &["--group-size", "6", "--ties", "first"]);
    let log = prepare(&[&shuffled], &b, &["--group-size", "6", "--partitions", "5", "--ties", "first"]);
    assert_eq!(log.matches(" skipped ").count(), 5, "{log}");
    let (a, b) = (PreparedDataset::open(&a).unwrap(), PreparedDataset::open(&b).unwrap());
    assert_eq!(a.len(), 50);
    let by_id = |d: &PreparedDataset| {
        (0..d.len())
            .map(|i| {
                let mut g = d.group(i).unwrap();
                g.index = 0;
                (g.question_id.clone(), g)
            })
            .collect::<BTreeMap<_, _>>()
    };
    let (ga, gb) = (by_id(&a), by_id(&b));
    assert_eq!(ga.len(), 50);
    assert!(ga.values().all(|g| g.responses.len() == 6));
    assert_eq!(ga, gb);
}

#[test]
fn overlong_responses_are_truncated_or_dropped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = (dir.path().join("t"), dir.path().join("d"));
    prepare(&[&fixture()], &t, &["--max-response-tokens", "300", "--overlong", "truncate", "--ties", "first"]);
    let drop = ["--max-response-tokens", "300", "--overlong", "drop", "--group-size", "0", "--ties", "first"];
    prepare(&[&fixture()], &d, &drop);
    let t = PreparedDataset::open(&t).unwrap();
    let ts = t.stats().unwrap();
    let mut truncated = 0;
    for i in 0..t.len() {
        for r in t.group(i).unwrap().responses {
            assert!(r.tokens.len() <= 300);
            if r.truncated {
                truncated += 1;
                assert_eq!(r.tokens.len(), 300);
            }
        }
    }
    assert!(truncated > 50, "{truncated}");
    assert_eq!((ts.responses, ts.responses_truncated), (400, truncated));
    let d = PreparedDataset::open(&d).unwrap();
    let ds = d.stats().unwrap();
    assert_eq!(ds.responses_dropped_long, truncated);
    // Groups left with fewer than --min-group-size answers are dropped as well.
    assert!(ds.responses <= 400 - truncated && ds.responses + 8 * ds.groups_dropped_small >= 400 - truncated);
    assert_eq!(ds.groups + ds.groups_dropped_small, 50);
    for i in 0..d.len() {
        assert!(d.group(i).unwrap().responses.iter().all(|r| !r.truncated && r.tokens.len() <= 300));
    }
}

#[test]
fn teacher_logprobs_are_kept_when_they_match_the_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let tok = grpo::model::ChatTokenizer::load(&tokenizer_dir()).unwrap();
    let resp = ["So the answer is \\boxed{4}.", "It is \\boxed{4}", "Maybe \\boxed{5}"];
    let mut lines = Vec::new();
    for (i, r) in resp.iter().enumerate() {
        let n = tok.encode(r, false).unwrap().len();
        // The last row's log-probs have the wrong length.
        let lp: Vec<f32> = (0..n + if i == 2 { 3 } else { 0 }).map(|j| -(j as f32) / 10.0).collect();
        lines.push(serde_json::json!({"prompt": "What is 2+2?", "response": r, "teacher_logprobs": lp}).to_string());
    }
    let input = dir.path().join("lp.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.path().join("out");
    let outcome = data::prepare(&data::PrepareOptions {
        input: data::InputOptions { inputs: vec![input.to_string_lossy().into_owned()], ..Default::default() },
        model: tokenizer_dir(),
        out: out.clone(),
        ..Default::default()
    })
    .unwrap();
    assert!(!outcome.skipped);
    assert_eq!((outcome.stats.teacher_logprobs_kept, outcome.stats.teacher_logprobs_mismatched), (2, 1));
    let g = PreparedDataset::open(&out).unwrap().group(0).unwrap();
    assert_eq!(g.majority.as_deref(), Some("4"));
    assert_eq!(g.responses.iter().filter(|r| r.teacher_logprobs.is_some()).count(), 2);
    for r in &g.responses {
        if let Some(lp) = &r.teacher_logprobs {
            assert_eq!(lp.len(), r.tokens.len());
            assert_eq!(*lp.last().unwrap(), 0.0);
            assert_eq!(lp[1], -0.1);
        }
    }
    // Up to date: the library call is a no-op the second time.
    let again = data::prepare(&data::PrepareOptions {
        input: data::InputOptions { inputs: vec![input.to_string_lossy().into_owned()], ..Default::default() },
        model: tokenizer_dir(),
        out,
        ..Default::default()
    })
    .unwrap();
    assert!(again.skipped);
    assert_eq!(again.groups, 1);
}

#[test]
fn compressed_inputs_and_globs_read_like_plain_jsonl() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read(fixture()).unwrap();
    let (half_a, half_b) = text.split_at(text.iter().enumerate().filter(|(_, &b)| b == b'\n').nth(199).unwrap().0 + 1);
    let gz = dir.path().join("part-a.jsonl.gz");
    let mut enc = flate2::write::GzEncoder::new(std::fs::File::create(&gz).unwrap(), flate2::Compression::fast());
    enc.write_all(half_a).unwrap();
    enc.finish().unwrap();
    std::fs::write(dir.path().join("part-b.jsonl.zst"), zstd::encode_all(half_b, 1).unwrap()).unwrap();
    let (clean, _) = stats_json(&fixture(), &[]);
    let (s, _) = stats_json(&dir.path().join("part-*"), &[]);
    for f in GROUP_FIELDS {
        assert_eq!(s[f], clean[f], "{f}");
    }
    assert_eq!(s["rows_read"], 400);
}

#[test]
fn max_questions_draws_the_same_sample_again_and_another_with_another_seed() {
    let dir = tempfile::tempdir().unwrap();
    let ids = |out: &Path, seed: &str| {
        let log = prepare(&[&fixture()], out, &["--max-questions", "10", "--seed", seed]);
        let ds = PreparedDataset::open(out).unwrap();
        let ids: std::collections::BTreeSet<String> = (0..ds.len()).map(|i| ds.group(i).unwrap().question_id).collect();
        let st = ds.stats().unwrap();
        assert_eq!((ids.len(), st.groups + st.groups_not_sampled + st.groups_dropped_tie), (10, 50));
        (ids, log)
    };
    let (a, _) = ids(&dir.path().join("a"), "0");
    assert_eq!(ids(&dir.path().join("b"), "0").0, a, "a rerun draws the same sample");
    let (again, log) = ids(&dir.path().join("a"), "0");
    assert!(log.contains("up to date") && again == a, "{log}");
    let (other, log) = ids(&dir.path().join("a"), "1");
    assert!(log.contains("seed 0 -> 1"), "{log}");
    assert_ne!(other, a, "another seed draws another sample");
}

/// The largest resident set of any waited-for child process so far, in bytes.
fn peak_child_rss() -> u64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes into the struct we pass.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) }, 0);
    usage.ru_maxrss as u64 * 1024
}

#[test]
fn an_over_long_line_is_skipped_while_read_with_bounded_memory() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long.jsonl.gz");
    let good = fixture_lines();
    let file = std::fs::File::create(&path).unwrap();
    let mut enc = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    writeln!(enc, "{}", good[0]).unwrap();
    enc.write_all(br#"{"prompt":"Q","response":""#).unwrap();
    let chunk = vec![b'x'; 1 << 20];
    for _ in 0..384 {
        enc.write_all(&chunk).unwrap();
    }
    enc.write_all(b"\"}\n").unwrap();
    writeln!(enc, "{}", good[1]).unwrap();
    enc.finish().unwrap();
    let (s, stderr) = stats_json(&path, &[]);
    let peak = peak_child_rss();
    assert_eq!(s["skipped_by_reason"]["row_too_large"], 1, "{s}");
    assert!(stderr.contains("long.jsonl.gz: line 2: row_too_large"), "{stderr}");
    assert!(peak < 256 << 20, "peak RSS of a child {} MiB for a 384 MiB line", peak >> 20);
}

#[test]
fn stats_of_a_file_without_rows_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let out = grpo().args(["data", "stats", "--input"]).arg(&empty).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no rows in") && err.contains("empty.jsonl"), "{err}");
}

/// The version folder `CURRENT` names in the prepared folder `out`.
fn current_version(out: &Path) -> PathBuf {
    out.join(std::fs::read_to_string(out.join("CURRENT")).unwrap().trim())
}

#[test]
fn a_damaged_version_is_named_and_prepared_again_never_up_to_date() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::copy(fixture(), &input).unwrap();
    let out = dir.path().join("prepared");
    prepare(&[&input], &out, &[]);
    let v = current_version(&out);
    // A flipped byte in a table: the error says how to prepare it again, and a preparation does.
    let g = v.join("groups.jsonl");
    let mut bytes = std::fs::read(&g).unwrap();
    bytes[10] ^= 1;
    std::fs::write(&g, &bytes).unwrap();
    let e = PreparedDataset::open(&out).unwrap_err().to_string();
    assert!(e.contains("groups.jsonl") && e.contains("--force"), "{e}");
    let again = prepare(&[&input], &out, &[]);
    assert!(!again.contains("up to date") && again.contains("damaged"), "{again}");
    assert!(!PreparedDataset::open(&out).unwrap().is_empty());
    // A damaged manifest is named by its checksum; without one (an older version), absurd counts are an
    // error, not a panic.
    let v = current_version(&out);
    let m = v.join("manifest.json");
    let text = std::fs::read_to_string(&m).unwrap();
    let mut manifest: Value = serde_json::from_str(&text).unwrap();
    manifest["groups"] = Value::from(u64::MAX / 2);
    std::fs::write(&m, serde_json::to_string(&manifest).unwrap()).unwrap();
    let e = PreparedDataset::open(&out).unwrap_err().to_string();
    assert!(e.contains("manifest.json changed"), "{e}");
    std::fs::remove_file(v.join("manifest.sha256")).unwrap();
    let e = PreparedDataset::open(&out).unwrap_err().to_string();
    assert!(e.contains("do not match the manifest"), "{e}");
}

#[test]
fn a_parquet_file_without_conversations_is_one_error_naming_its_columns() {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chat.parquet");
    let schema = Arc::new(
        parquet::schema::parser::parse_message_type(
            "message schema { REQUIRED BYTE_ARRAY text (UTF8); REQUIRED BYTE_ARRAY source (UTF8); }",
        )
        .unwrap(),
    );
    let mut w =
        SerializedFileWriter::new(std::fs::File::create(&path).unwrap(), schema, Arc::new(WriterProperties::default()))
            .unwrap();
    let mut rg = w.next_row_group().unwrap();
    for _ in 0..2 {
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>().write_batch(&vec![ByteArray::from("x"); 500], None, None).unwrap();
        col.close().unwrap();
    }
    rg.close().unwrap();
    w.close().unwrap();
    let out = grpo().args(["data", "stats", "--input"]).arg(&path).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("chat.parquet: no `conversations` column") && err.contains("its columns are `text`, `source`")
    );
    assert_eq!(err.lines().count(), 1, "one error for the file, not one line per row:\n{err}");
}

#[test]
fn stats_of_a_file_without_a_usable_row_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"messages\": 1}\nnot json\n").unwrap();
    let out = grpo().args(["-q", "data", "stats", "--input"]).arg(&bad).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("no usable row in") && err.contains("all 2 rows were skipped (1 bad_json, 1 "), "{err}");
}

/// The seed keys a prepared version only where it chose something: with no question over the group size (the
/// fixture's 8 answers, group size 8), another seed finds the version up to date and reads the same data;
/// where it chooses among answers (group size 4), another seed prepares again.
#[test]
fn a_seed_keys_the_prepared_data_only_where_it_chooses() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("prepared");
    prepare(&[&fixture()], &out, &["--seed", "1"]);
    let v = current_version(&out);
    let groups = |out: &Path| {
        let ds = PreparedDataset::open(out).unwrap();
        (0..ds.len()).map(|i| ds.group(i).unwrap()).collect::<Vec<_>>()
    };
    let first = groups(&out);
    let log = prepare(&[&fixture()], &out, &["--seed", "2"]);
    assert!(log.contains("up to date"), "{log}");
    assert_eq!(current_version(&out), v, "another seed that chose nothing prepared again");
    // A fresh preparation with that seed writes the same groups.
    let other = dir.path().join("other");
    prepare(&[&fixture()], &other, &["--seed", "2"]);
    assert_eq!(groups(&other), first);
    // Choosing 4 of 8 answers, the seed keys the version.
    let four = dir.path().join("four");
    prepare(&[&fixture()], &four, &["--seed", "1", "--group-size", "4"]);
    assert!(prepare(&[&fixture()], &four, &["--seed", "1", "--group-size", "4"]).contains("up to date"));
    let log = prepare(&[&fixture()], &four, &["--seed", "2", "--group-size", "4"]);
    assert!(log.contains("seed 1 -> 2"), "{log}");
}
