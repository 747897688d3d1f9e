//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn grpo() -> assert_cmd::Command {
    let mut c = assert_cmd::Command::cargo_bin("grpo").expect("the grpo binary");
    c.env("GRPO_CACHE_DIR", "off");
    c
}

/// The `grpo` binary as a plain process, with what [`grpo`] sets.
#[allow(dead_code)]
pub fn command() -> std::process::Command {
    let mut c = std::process::Command::new(assert_cmd::cargo::cargo_bin("grpo"));
    // Reference log-probs are not shared between tests (or with the user's runs): each test sees what a
    // run on its own sees. The test of sharing sets its own folder.
    c.env("GRPO_CACHE_DIR", "off");
    c
}

/// The SmolLM2-135M weights made by scripts/make-smollm2.sh, or None with a clear message.
pub fn smollm2() -> Option<PathBuf> {
    let dir = root().join("tests/fixtures/models/smollm2-135m");
    if dir.join("model.safetensors").exists() {
        Some(dir)
    } else {
        eprintln!(
            "SKIPPED: {} is absent; run scripts/make-smollm2.sh (needs ../shared and `pip install gguf numpy`)",
            dir.display()
        );
        None
    }
}

/// Make a tiny model with `grpo init-tiny` (same shape as the parity fixtures).
pub fn init_tiny(arch: &str, tokenizer: &str, out: &Path) {
    grpo()
        .args(["init-tiny", "--arch", arch, "--tokenizer"])
        .arg(root().join("data/tokenizers").join(tokenizer))
        .arg("--out")
        .arg(out)
        .args([
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--intermediate",
            "128",
            "--seed",
            "7",
        ])
        .assert()
        .success();
}

/// The rollout tests' fixture: a tiny model on the 64-token digits tokenizer at `model`, and in `dir` a
/// questions file (`questions.jsonl`) of 8 questions whose gold answer is always 7. Returns its path.
pub fn digits_model_and_questions(dir: &Path, model: &Path) -> PathBuf {
    grpo()
        .args(["init-tiny", "--arch", "llama", "--tokenizer"])
        .arg(root().join("tests/fixtures/tokenizers/digits"))
        .arg("--out")
        .arg(model)
        .args(["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64"])
        .args(["--seed", "1"])
        .assert()
        .success();
    let questions = dir.join("questions.jsonl");
    let words = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let lines: Vec<String> = (0..8)
        .map(|i| {
            format!(r#"{{"problem": "{} {} {}", "answer": "7"}}"#, words[i], words[(i + 3) % 8], words[(i + 5) % 8])
        })
        .collect();
    std::fs::write(&questions, lines.join("\n") + "\n").unwrap();
    questions
}

pub fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Like [`read_jsonl`], skipping lines that do not parse (a torn last line).
pub fn read_jsonl_lossy(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// An OpenAI-compatible server in Python's standard library: `/v1/completions` answers each of the `n`
/// choices with "7" or "3" (by the prompt's hash and the choice's index) and `/update_weights_from_disk`
/// (SGLang's reload) answers 200; every request's prompt or model_path goes to the log file (argv[1]),
/// one line each; the port is printed first.
pub const SCRIPTED_SERVER: &str = r#"
import http.server, json, random, sys, time, zlib
log = open(sys.argv[1], "a", buffering=1)
delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
jitter = len(sys.argv) > 3 and sys.argv[3] == "random"
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.endswith("/completions"):
            time.sleep(random.Random(zlib.crc32(body["prompt"].encode())).uniform(0, delay) if jitter else delay)
            log.write("prompt " + json.dumps(body["prompt"]) + "\n")
            h = zlib.crc32(body["prompt"].encode())
            choices = [{"index": i, "text": "7" if (h + i) % 3 else "3", "finish_reason": "stop"} for i in range(body["n"])]
            out = {"choices": choices}
        else:
            log.write("reload " + body.get("model_path", "") + "\n")
            out = {"success": True}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;

/// A running scripted server, killed when dropped.
pub struct Scripted {
    child: std::process::Child,
    pub port: u16,
    pub log: PathBuf,
}

impl Drop for Scripted {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Scripted {
    pub fn start(dir: &Path, name: &str) -> Option<Scripted> {
        Self::start_slow(dir, name, 0.0)
    }

    /// A server that answers each completion request after `delay` seconds.
    pub fn start_slow(dir: &Path, name: &str, delay: f64) -> Option<Scripted> {
        Self::launch(dir, name, delay, false)
    }

    /// A server that answers each completion request after a delay of 0 to `delay` seconds, drawn from the
    /// prompt's hash.
    pub fn start_random(dir: &Path, name: &str, delay: f64) -> Option<Scripted> {
        Self::launch(dir, name, delay, true)
    }

    fn launch(dir: &Path, name: &str, delay: f64, random: bool) -> Option<Scripted> {
        use std::io::BufRead;
        let script = dir.join(format!("{name}-server.py"));
        std::fs::write(&script, SCRIPTED_SERVER).unwrap();
        let log = dir.join(format!("{name}.log"));
        let child = std::process::Command::new("python3")
            .arg(&script)
            .arg(&log)
            .arg(delay.to_string())
            .arg(if random { "random" } else { "fixed" })
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| eprintln!("SKIPPED: python3 for the scripted server: {e}"))
            .ok()?;
        let mut server = Scripted { child, port: 0, log };
        let mut line = String::new();
        std::io::BufReader::new(server.child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        server.port = line.trim().parse().expect("the scripted server's port");
        Some(server)
    }

    pub fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log).unwrap_or_default().lines().map(String::from).collect()
    }
}
