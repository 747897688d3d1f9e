//! What every command does alike: a closed pipe, the exit status of a refused command line, the help.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;

fn fixture() -> std::path::PathBuf {
    common::root().join("data/trajectories/ot3_math_x8_dev.jsonl")
}

/// Run `grpo args` with its stdout a pipe whose reader is gone before it writes (`grpo ... | head -0`);
/// returns its exit status and stderr.
fn with_closed_stdout(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = common::command()
        .current_dir(common::root())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Ended quietly, as `cat` is by `head`: by SIGPIPE or with status 0, and nothing said about it.
fn assert_quiet_end(what: &str, status: std::process::ExitStatus, stderr: &str) {
    let by_sigpipe = status.signal() == Some(libc::SIGPIPE);
    assert!(by_sigpipe || status.success(), "{what}: {status}: {stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{what}: {stderr}");
}

#[test]
fn a_closed_pipe_ends_every_printing_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixture().display().to_string();
    let gens = dir.path().join("gens.jsonl");
    let lines: Vec<String> = (0..200)
        .map(|i| format!(r#"{{"id": "{i}", "answer": "7", "responses": ["\\boxed{{7}}", "\\boxed{{3}}"]}}"#))
        .collect();
    std::fs::write(&gens, lines.join("\n") + "\n").unwrap();
    let gens = gens.display().to_string();
    let commands: Vec<Vec<&str>> = vec![
        vec!["data", "stats", "--input", &data],
        vec!["score", "--input", &gens, "--output", "-"],
        vec!["eval", "--list"],
        vec!["train", "--config", "configs/smoke.toml", "--check"],
        vec!["--help"],
    ];
    for args in commands {
        let (status, stderr) = with_closed_stdout(&args);
        assert_quiet_end(&args.join(" "), status, &stderr);
    }
}

/// The README's promise on exit statuses, and the status of a command line clap refuses.
#[test]
fn a_refused_command_line_exits_2_as_the_readme_says() {
    let readme = std::fs::read_to_string(common::root().join("README.md")).unwrap();
    let readme = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(readme.contains("a command line that is refused (an unknown option, a bad value) exits 2"), "README");
    for args in [&["eval", "--limit", "-1"][..], &["score", "--k", "x"], &["data", "stats", "--no-such"]] {
        let out = common::grpo().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = common::grpo().args(["eval", "--limit", "-1", "--bench", "aime25", "--model", "m"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--limit") && err.contains("-1"), "{err}");
    // Bad values that clap checks (each exited 1 after the parse), and a `--set` no config key takes.
    let bad: [(&[&str], &str); 5] = [
        (&["eval", "--bench", "aime25", "--model", "m", "--dtype", "f64"], "f64"),
        (&["eval", "--bench", "aime25", "--model", "m", "--device", "gpu"], "gpu"),
        (&["eval", "--bench", "aime26", "--model", "m"], "aime26"),
        (&["train", "--config", "configs/smoke.toml", "--check", "--set", "train.no_such_key=1"], "no_such_key"),
        (&["train", "--config", "configs/smoke.toml", "--check", "--set", "nokey"], "nokey"),
    ];
    for (args, needle) in bad {
        let out = common::grpo().current_dir(common::root()).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        let usage = err.contains("Usage: grpo ") || err.contains("try '--help'");
        assert!(err.contains(needle) && usage, "{args:?}: {err}");
    }
}

fn help(args: &[&str]) -> String {
    let out = common::grpo().args(args).arg("--help").output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn verbosity_flags_go_anywhere_and_the_help_describes_every_option() {
    // -v / -q after a command's own options, and after a nested command's.
    common::grpo().args(["eval", "--list", "-q"]).assert().success();
    common::grpo().args(["eval", "--list", "-v"]).assert().success();
    let data = fixture();
    let out = common::grpo().args(["data", "stats", "--input"]).arg(&data).arg("-q").output().unwrap();
    assert!(out.status.success() && out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    let eval = help(&["eval"]);
    for flag in ["--device <DEVICE>", "--dtype <DTYPE>"] {
        let line = eval.lines().skip_while(|l| !l.contains(flag)).nth(1).unwrap_or_default();
        assert!(line.trim().len() > 10 && !line.trim().starts_with(['-', '[']), "{flag} has no description:\n{eval}");
    }
    // -v / -q come last, under their own heading, in every command's help.
    for cmd in [&["train"][..], &["eval"], &["score"], &["data", "prepare"], &["bench", "train-step"]] {
        let text = help(cmd);
        let logging = text.find("\nLogging:\n").unwrap_or_else(|| panic!("{cmd:?}: no Logging heading:\n{text}"));
        let last_option = text.rfind("\n  -").unwrap();
        assert!(logging < last_option && text[logging..].contains("--verbose"), "{cmd:?}:\n{text}");
        assert!(!text[..logging].contains("--verbose") && !text[..logging].contains("--quiet"), "{cmd:?}:\n{text}");
    }
    let step = help(&["bench", "train-step"]);
    let line = step.lines().skip_while(|l| !l.contains("--prompt-len")).nth(1).unwrap_or_default();
    assert!(line.contains("Prompt tokens"), "--prompt-len has no description:\n{step}");
    // The scores and the objectives are explained, and train's help points at the reference.
    for cmd in ["eval", "score"] {
        let text = help(&[cmd]);
        for m in ["avg@n ", "pass@k ", "maj@n "] {
            assert!(text.lines().any(|l| l.trim_start().starts_with(m)), "{cmd}: {m} not explained:\n{text}");
        }
    }
    let train = help(&["train"]);
    assert!(train.contains("docs/reference.md"), "{train}");
    for name in ["off_grpo", "grpo", "gspo", "rec", "opmd", "asymre", "red_drop", "red_weight", "oapl", "sft", "cispo"]
    {
        assert!(train.lines().any(|l| l.trim_start().starts_with(&format!("{name} "))), "{name} not explained");
    }
    // The objectives the README lists are named in the top-level help.
    let top = help(&[]);
    let readme = std::fs::read_to_string(common::root().join("README.md")).unwrap();
    let listed = readme.split("objectives (").nth(1).and_then(|s| s.split(')').next()).expect("README's list");
    for name in listed.split(", ") {
        assert!(top.contains(name), "{name} missing from the help:\n{top}");
    }
}

#[test]
fn a_truncated_weights_file_is_named_with_both_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    common::init_tiny("qwen3", "qwen3", &model);
    let file = model.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let out = common::grpo()
        .args(["eval", "--bench", "aime25", "--limit", "1", "--max-new-tokens", "1", "--model"])
        .arg(&model)
        .arg("--out")
        .arg(dir.path().join("eval"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("model.safetensors: the file is shorter than its header says"), "{err}");
    let sizes = format!("({} bytes, the header describes {})", bytes.len() / 2, bytes.len());
    assert!(err.contains(&sizes) && err.contains("truncated, or still being downloaded"), "{err}");
}
