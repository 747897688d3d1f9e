//! What several runs share, under concurrency and faults: a prepared folder is never rewritten under a
//! reader, two preparers of one folder both succeed, a changed file is named and never trained on, and a
//! stop request during the reference pass ends it within seconds.

mod common;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use grpo::data::PreparedDataset;

fn data() -> String {
    common::root().join("data/trajectories/ot3_math_x8_dev.jsonl").display().to_string()
}

fn prepare_cmd(model: &Path, out: &Path, max_tokens: usize) -> std::process::Command {
    let mut c = common::command();
    c.args(["data", "prepare", "-i", &data(), "--group-size", "4", "--max-questions", "8", "--ties", "first"])
        .args(["--max-response-tokens", &max_tokens.to_string(), "--model"])
        .arg(model)
        .arg("--out")
        .arg(out);
    c
}

fn prepare(model: &Path, out: &Path, max_tokens: usize) -> String {
    let o = prepare_cmd(model, out, max_tokens).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    text
}

/// Every token of every group of `ds`.
fn all_tokens(ds: &PreparedDataset) -> Vec<Vec<u32>> {
    (0..ds.len())
        .flat_map(|i| {
            let g = ds.group(i).unwrap();
            std::iter::once(g.prompt_tokens.clone()).chain(g.responses.into_iter().map(|r| r.tokens))
        })
        .collect()
}

fn versions(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir() && p.file_name().unwrap().to_string_lossy().starts_with("v-"))
        .collect();
    v.sort();
    v
}

fn tiny(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    common::init_tiny("llama", "smollm2", &model);
    model
}

#[test]
fn a_preparation_never_rewrites_the_version_a_reader_has_open() {
    let dir = tempfile::tempdir().unwrap();
    let (model, out) = (tiny(dir.path()), dir.path().join("prepared"));
    prepare(&model, &out, 24);
    let reader = PreparedDataset::open(&out).unwrap();
    let before = all_tokens(&reader);
    // Another run's options on the same folder: a new version, made current beside the one being read.
    let log = prepare(&model, &out, 12);
    assert!(log.contains("options changed"), "{log}");
    assert_eq!(all_tokens(&reader), before, "the reader's tokens changed under it");
    let now = PreparedDataset::open(&out).unwrap();
    assert_ne!(all_tokens(&now), before);
    let g = now.group(0).unwrap();
    assert!(g.responses.iter().all(|r| r.tokens.len() <= 12));
    assert_eq!(versions(&out).len(), 2, "the version being read was removed");
    // Once nobody reads it, the next preparation removes it.
    drop((reader, now));
    prepare(&model, &out, 16);
    assert_eq!(versions(&out).len(), 1);
}

#[test]
fn two_preparers_of_one_folder_both_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let (model, out) = (tiny(dir.path()), dir.path().join("prepared"));
    let children: Vec<_> = (0..2)
        .map(|_| {
            prepare_cmd(&model, &out, 24)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(versions(&out).len(), 1, "the second preparer did not re-use the first's result");
    assert!(!PreparedDataset::open(&out).unwrap().is_empty());
}

#[test]
fn a_run_refuses_prepared_data_that_changed_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (model, out) = (tiny(dir.path()), dir.path().join("prepared"));
    prepare(&model, &out, 24);
    let version = versions(&out).pop().unwrap();
    for name in ["groups.jsonl", "tokens-00000.u32", "responses.bin"] {
        let p = version.join(name);
        let mut b = std::fs::read(&p).unwrap();
        let at = b.len() / 2;
        b[at] ^= 0x01;
        std::fs::write(&p, &b).unwrap();
        let err = PreparedDataset::open(&out).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains("changed since it was written"), "{name}: {err}");
        // `grpo data prepare` of the same data does not take the damaged version for an up-to-date one
        // that a run could train on: opening it is refused the same way.
        b[at] ^= 0x01;
        std::fs::write(&p, &b).unwrap();
    }
    assert!(PreparedDataset::open(&out).is_ok());
}

/// A model large enough for the reference pass over the bundled answers to take minutes.
fn slow_model(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    common::grpo()
        .args(["init-tiny", "--arch", "llama", "--tokenizer"])
        .arg(common::root().join("data/tokenizers/smollm2"))
        .arg("--out")
        .arg(&model)
        .args(["--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--intermediate", "512"])
        .assert()
        .success();
    model
}

#[test]
fn a_stop_request_during_the_reference_pass_exits_75_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let model = slow_model(dir.path());
    let config = dir.path().join("c.toml");
    let text = format!(
        "[model]\npath = \"{}\"\n[data]\ninputs = [\"{}\"]\nmax_response_tokens = 2048\nprepared_dir = \"{}\"\n\
         [objective]\nbeta = 0.1\nbias = 0.5\n[train]\noutput_dir = \"{}\"\nmicro_batch_size = 1\nmax_steps = 1\n",
        model.display(),
        data(),
        dir.path().join("prepared").display(),
        dir.path().join("out").display()
    );
    std::fs::write(&config, text).unwrap();
    let mut child = common::command()
        .args(["train", "--config"])
        .arg(&config)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut log = String::new();
    let started = Instant::now();
    loop {
        let line = rx.recv_timeout(Duration::from_secs(300)).expect("no reference pass started");
        log += &line;
        log.push('\n');
        if line.contains("computing the reference log-probs") {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(300), "{log}");
    }
    std::thread::sleep(Duration::from_millis(500));
    std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let signalled = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(signalled.elapsed() < Duration::from_secs(60), "still running 60 s after SIGTERM:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let waited = signalled.elapsed();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(1)) {
        log += &line;
        log.push('\n');
    }
    assert_eq!(status.code(), Some(75), "{log}");
    assert!(log.contains("stopped on request") && log.contains("reference log-probs"), "{log}");
    assert!(waited < Duration::from_secs(20), "took {waited:?} to stop:\n{log}");
    // Nothing of the interrupted pass can be taken for a complete cache.
    let version = versions(&dir.path().join("prepared")).pop().unwrap();
    assert!(!version.join("reference-logprobs.json").exists());
    eprintln!("stopped {waited:?} after SIGTERM");
}
