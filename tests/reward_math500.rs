//! The gold answers of MATH-500 (tests/fixtures/reward/math500_answers.jsonl) are understood as
//! mathematics (not only compared as strings). Answers from hkust-nlp/simpleRL-reason math500 (MIT).

use grpo::reward::ParsedAnswer;

#[test]
fn math500_answers_parse() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/reward/math500_answers.jsonl");
    let text = std::fs::read_to_string(path).unwrap();
    let mut failed = Vec::new();
    let mut n = 0;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let a = v["answer"].as_str().unwrap();
        n += 1;
        if !ParsedAnswer::new(a).is_parsed() {
            failed.push(a.to_string());
        }
    }
    eprintln!("{} of {n} MATH-500 answers not parsed: {failed:#?}", failed.len());
    assert_eq!(n, 500);
    assert!(failed.is_empty(), "{} not parsed", failed.len());
}
