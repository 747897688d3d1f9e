//! Models, adapters and datasets by Hugging Face id, against a local hub (tests/common/hub_server.rs) that
//! `HF_ENDPOINT` points at: the first download and its cache layout (as huggingface_hub writes it), the
//! cache used with the hub stopped, offline mode, a dropped connection resumed, a partial download from
//! an earlier process resumed, a corrupted file refused, 401/403/404 and missing files, two processes
//! downloading at once, and a dataset URL for `grpo data stats|prepare`.

mod common;
#[path = "common/hub_server.rs"]
mod hub_server;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use hub_server::{commit, etag, sha256, Hub, Repo};

/// A tiny model (smollm2 tokenizer) made once per test in `dir/model`.
fn tiny_model(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    common::init_tiny("llama", "smollm2", &model);
    model
}

/// A rank-2 adapter on q_proj of the tiny model (2 layers, hidden 64), as PEFT writes it.
fn tiny_adapter(dir: &Path) -> PathBuf {
    use candle_core::{Device, Tensor};
    let out = dir.join("adapter");
    std::fs::create_dir_all(&out).unwrap();
    let config = serde_json::json!({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 4.0,
        "lora_dropout": 0.0, "target_modules": ["q_proj"], "base_model_name_or_path": "org/tiny"});
    std::fs::write(out.join("adapter_config.json"), config.to_string()).unwrap();
    // PEFT saves the tokenizer with the adapter when asked to; a run's checkpoints do.
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(common::root().join("data/tokenizers/smollm2").join(f), out.join(f)).unwrap();
    }
    let mut tensors = std::collections::HashMap::new();
    for l in 0..2 {
        let name = |x: &str| format!("base_model.model.model.layers.{l}.self_attn.q_proj.lora_{x}.weight");
        let a: Vec<f32> = (0..2 * 64).map(|i| ((i % 7) as f32 - 3.0) * 0.05).collect();
        let b: Vec<f32> = (0..64 * 2).map(|i| ((i % 5) as f32 - 2.0) * 0.05).collect();
        tensors.insert(name("A"), Tensor::from_vec(a, (2, 64), &Device::Cpu).unwrap());
        tensors.insert(name("B"), Tensor::from_vec(b, (64, 2), &Device::Cpu).unwrap());
    }
    candle_core::safetensors::save(&tensors, out.join("adapter_model.safetensors")).unwrap();
    out
}

/// A grpo command with the hub's environment: the hub at `hub`, the cache under `home`.
fn grpo(hub: &str, home: &Path) -> assert_cmd::Command {
    let mut c = common::grpo();
    c.env("HF_ENDPOINT", hub).env("HF_HOME", home);
    for v in ["HF_HUB_CACHE", "HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "XDG_CACHE_HOME"] {
        c.env_remove(v);
    }
    c
}

fn input(dir: &Path) -> PathBuf {
    let p = dir.join("in.jsonl");
    std::fs::write(&p, "{\"text\": \"The answer is 42, since 6 times 7 is 42.\"}\n").unwrap();
    p
}

/// `grpo logprobs` of `model` (and the adapter's flags, `--adapter A`), its log-probs; the command's result
/// for errors.
fn logprobs(mut c: assert_cmd::Command, dir: &Path, model: &str, adapter: &[&str]) -> Result<Vec<f64>, String> {
    let out = dir.join("lp.jsonl");
    let _ = std::fs::remove_file(&out);
    c.args(["logprobs", "--model", model]).arg("--input").arg(input(dir)).arg("--output").arg(&out);
    c.args(adapter);
    let o = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    if !o.status.success() {
        return Err(stderr);
    }
    let lines = common::read_jsonl(&out);
    Ok(lines[0]["logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect())
}

/// The same on local folders. The adapter's config names its base by hub id (`org/tiny`), which the local
/// folder's name cannot show to be the same model: the check is waived for the reference values.
fn local_logprobs(dir: &Path, model: &Path, adapter: Option<&Path>) -> Vec<f64> {
    let (m, a) = (model.display().to_string(), adapter.map(|a| a.display().to_string()));
    let flags: Vec<&str> = a.iter().flat_map(|a| ["--adapter", a.as_str(), "--allow-base-mismatch"]).collect();
    logprobs(common::grpo(), dir, &m, &flags).unwrap()
}

/// The model repo `org/tiny`: the model's files, a README and a pytorch_model.bin (neither is fetched).
fn model_repo(model: &Path) -> Repo {
    let mut repo = Repo::from_dir(model, "tiny-1");
    repo.files.insert("README.md".into(), b"# tiny".to_vec());
    repo.files.insert("pytorch_model.bin".into(), vec![0; 1000]);
    repo
}

fn requests(hub: &Hub, what: &str) -> usize {
    hub.log().iter().filter(|l| l.contains(what)).count()
}

/// The first download of a model by id: the files a model needs, laid out as huggingface_hub lays them
/// out; then the same cache used with the hub stopped (by commit and by branch) and offline.
#[test]
fn a_model_by_id_is_downloaded_into_the_huggingface_layout_and_reused_without_the_hub() {
    let dir = tempfile::tempdir().unwrap();
    let (model, home) = (tiny_model(dir.path()), dir.path().join("hf"));
    let repo = model_repo(&model);
    let files = repo.files.clone();
    let mut hub = Hub::start(vec![("models/org/tiny", repo)]);
    let want = local_logprobs(dir.path(), &model, None);
    assert_eq!(logprobs(grpo(&hub.url, &home), dir.path(), "org/tiny", &[]).unwrap(), want);

    let c = commit("tiny-1");
    let root = home.join("hub/models--org--tiny");
    assert_eq!(std::fs::read_to_string(root.join("refs/main")).unwrap(), c);
    let snapshot = root.join("snapshots").join(&c);
    let mut linked: Vec<String> =
        std::fs::read_dir(&snapshot).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    linked.sort();
    let mut expected: Vec<String> =
        files.keys().filter(|f| !["README.md", "pytorch_model.bin"].contains(&f.as_str())).cloned().collect();
    expected.sort();
    assert_eq!(linked, expected);
    for f in &linked {
        let target = std::fs::read_link(snapshot.join(f)).unwrap();
        assert_eq!(target, Path::new("../../blobs").join(etag(f, &files[f])), "{f}");
        assert_eq!(std::fs::read(root.join("blobs").join(etag(f, &files[f]))).unwrap(), files[f]);
    }
    let weights = etag("model.safetensors", &files["model.safetensors"]);
    assert_eq!(weights, sha256(&files["model.safetensors"]));
    assert!(home.join("hub/.locks/models--org--tiny").join(format!("{weights}.lock")).is_file());
    let leftovers = std::fs::read_dir(root.join("blobs"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".incomplete"));
    assert_eq!(leftovers.count(), 0);
    // The LFS file came from the CDN the hub redirected to; the README was never asked for.
    assert_eq!(requests(&hub, &format!("GET /cdn/{weights}")), 1);
    assert_eq!(requests(&hub, "README.md"), 0);

    // A second run asks the hub for the branch's commit only.
    let before = hub.log().len();
    assert_eq!(logprobs(grpo(&hub.url, &home), dir.path(), "org/tiny", &[]).unwrap(), want);
    assert_eq!(hub.log()[before..].iter().filter(|l| !l.contains("/api/")).count(), 0, "{:?}", hub.log());

    // Offline: no request at all, from the cache; a model that is not there says which file is missing.
    let before = hub.log().len();
    let mut offline = grpo(&hub.url, &home);
    offline.env("HF_HUB_OFFLINE", "1");
    assert_eq!(logprobs(offline, dir.path(), "org/tiny", &[]).unwrap(), want);
    let mut offline = grpo(&hub.url, &dir.path().join("empty"));
    offline.env("HF_HUB_OFFLINE", "1");
    let e = logprobs(offline, dir.path(), "org/tiny", &[]).unwrap_err();
    assert!(
        e.contains("org/tiny@main: `config.json` is not in the Hugging Face cache") && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    assert_eq!(hub.log().len(), before, "offline mode sent requests");

    // The hub stopped: a commit is read from the cache without the network, a branch with a warning.
    hub.stop();
    assert_eq!(logprobs(grpo(&hub.url, &home), dir.path(), &format!("org/tiny@{c}"), &[]).unwrap(), want);
    // `--revision` pins the same commit; a local path or a second revision is refused.
    let pin = |rev: &str| ["--revision".to_string(), rev.to_string()];
    let pinned = pin(&c);
    let pinned: Vec<&str> = pinned.iter().map(String::as_str).collect();
    assert_eq!(logprobs(grpo(&hub.url, &home), dir.path(), "org/tiny", &pinned).unwrap(), want);
    let v2 = pin("v2");
    let v2: Vec<&str> = v2.iter().map(String::as_str).collect();
    let e = logprobs(grpo(&hub.url, &home), dir.path(), &format!("org/tiny@{c}"), &v2).unwrap_err();
    assert!(e.contains("--revision = `v2`, but the id already names revision"), "{e}");
    let local = dir.path().display().to_string();
    let e = logprobs(grpo(&hub.url, &home), dir.path(), &local, &["--revision", "main"]).unwrap_err();
    assert!(e.contains("is a local path"), "{e}");
    let mut c2 = grpo(&hub.url, &home);
    c2.arg("-v");
    assert_eq!(logprobs(c2, dir.path(), "org/tiny", &[]).unwrap(), want);
    let e = logprobs(grpo(&hub.url, &dir.path().join("empty")), dir.path(), "org/tiny", &[]).unwrap_err();
    assert!(e.contains("unreachable") && e.contains("`config.json` is not in the cache"), "{e}");
}

/// `--adapter org/name`: the adapter's two files, on the base model; an adapter repo given as the model
/// loads the base its config names.
#[test]
fn an_adapter_by_id_applies_to_its_base_model() {
    let dir = tempfile::tempdir().unwrap();
    let (model, home) = (tiny_model(dir.path()), dir.path().join("hf"));
    let adapter = tiny_adapter(dir.path());
    let hub = Hub::start(vec![
        ("models/org/tiny", model_repo(&model)),
        ("models/org/tiny-lora", Repo::from_dir(&adapter, "lora-1")),
    ]);
    let want = local_logprobs(dir.path(), &model, Some(&adapter));
    assert_ne!(want, local_logprobs(dir.path(), &model, None), "the adapter changes nothing");
    let got = logprobs(grpo(&hub.url, &home), dir.path(), "org/tiny", &["--adapter", "org/tiny-lora"]).unwrap();
    assert_eq!(got, want);
    assert_eq!(logprobs(grpo(&hub.url, &home), dir.path(), "org/tiny-lora", &[]).unwrap(), want);
    let snapshot = home.join("hub/models--org--tiny-lora/snapshots").join(commit("lora-1"));
    assert!(snapshot.join("adapter_model.safetensors").is_file() && snapshot.join("adapter_config.json").is_file());
}

/// The errors a user meets: a gated model without (or with a wrong) token, an unknown repo, revision or
/// file, a file whose bytes do not match the hub's sha256 (removed, never used).
#[test]
fn hub_errors_are_clear_and_a_corrupted_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (model, home) = (tiny_model(dir.path()), dir.path().join("hf"));
    let mut gated = model_repo(&model);
    gated.token = Some("good-token".into());
    let mut no_weights = model_repo(&model);
    no_weights.files.remove("model.safetensors");
    let repo = model_repo(&model);
    let weights = sha256(&repo.files["model.safetensors"]);
    let hub =
        Hub::start(vec![("models/org/tiny", repo), ("models/org/gated", gated), ("models/org/noweights", no_weights)]);
    let run = |model: &str, token: Option<&str>| {
        let mut c = grpo(&hub.url, &home);
        if let Some(t) = token {
            c.env("HF_TOKEN", t);
        }
        logprobs(c, dir.path(), model, &[])
    };
    let e = run("org/gated", None).unwrap_err();
    assert!(e.contains("401") && e.contains("set HF_TOKEN") && e.contains("accept the model's licence"), "{e}");
    assert!(e.contains(&format!("{}/org/gated", hub.url)), "{e}");
    assert!(run("org/gated", Some("bad")).unwrap_err().contains("403"));
    run("org/gated", Some("good-token")).unwrap();
    let e = run("org/absent", None).unwrap_err();
    assert!(e.contains("org/absent: repository not found on") && e.contains(&hub.url), "{e}");
    let e = run("org/tiny@v9", None).unwrap_err();
    assert!(e.contains("revision `v9` not found"), "{e}");
    let e = run("org/noweights", None).unwrap_err();
    assert!(e.contains("the repo has no file `model.safetensors`"), "{e}");

    hub.faults(|f| f.corrupt = Some(weights.clone()));
    let e = run("org/tiny", None).unwrap_err();
    assert!(
        e.contains("`model.safetensors` downloaded with sha256") && e.contains(&weights) && e.contains("removed"),
        "{e}"
    );
    let blobs = home.join("hub/models--org--tiny/blobs");
    assert!(!blobs.join(&weights).exists() && !blobs.join(format!("{weights}.incomplete")).exists());
    assert!(!home.join("hub/models--org--tiny/snapshots").join(commit("tiny-1")).join("model.safetensors").exists());
    hub.faults(|f| f.corrupt = None);
    run("org/tiny", None).unwrap();
}

/// A connection dropped mid-file resumes with a range request; so does a partial download an earlier
/// (killed) process left.
#[test]
fn a_dropped_connection_and_a_partial_download_resume() {
    let dir = tempfile::tempdir().unwrap();
    let (model, home) = (tiny_model(dir.path()), dir.path().join("hf"));
    let repo = model_repo(&model);
    let bytes = repo.files["model.safetensors"].clone();
    let weights = sha256(&bytes);
    let hub = Hub::start(vec![("models/org/tiny", repo)]);
    let want = local_logprobs(dir.path(), &model, None);
    let cut = bytes.len() / 3;
    hub.faults(|f| f.drop_once = Some((weights.clone(), cut)));
    assert_eq!(logprobs(grpo(&hub.url, &home), dir.path(), "org/tiny", &[]).unwrap(), want);
    let gets: Vec<String> = hub.log().into_iter().filter(|l| l.starts_with(&format!("GET /cdn/{weights}"))).collect();
    assert_eq!(gets, [format!("GET /cdn/{weights} -"), format!("GET /cdn/{weights} bytes={cut}-")]);

    let other = dir.path().join("hf2");
    let blobs = other.join("hub/models--org--tiny/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let half = bytes.len() / 2;
    std::fs::write(blobs.join(format!("{weights}.incomplete")), &bytes[..half]).unwrap();
    assert_eq!(logprobs(grpo(&hub.url, &other), dir.path(), "org/tiny", &[]).unwrap(), want);
    assert_eq!(requests(&hub, &format!("GET /cdn/{weights} bytes={half}-")), 1);
    assert_eq!(std::fs::read(blobs.join(&weights)).unwrap(), bytes);
}

/// Two processes asking for the same model at once: one downloads (the blob's lock), the other waits and
/// then uses the same files.
#[test]
fn two_processes_download_a_model_once() {
    let dir = tempfile::tempdir().unwrap();
    let (model, home) = (tiny_model(dir.path()), dir.path().join("hf"));
    let repo = model_repo(&model);
    let weights = sha256(&repo.files["model.safetensors"]);
    let hub = Hub::start(vec![("models/org/tiny", repo)]);
    // Slow enough (about 2 s for the weights) for the two to overlap.
    hub.faults(|f| f.chunk_delay = Some(Duration::from_millis(100)));
    let spawn = |i: usize| {
        let out = dir.path().join(format!("lp{i}.jsonl"));
        let mut c = common::command();
        c.env("HF_ENDPOINT", &hub.url).env("HF_HOME", &home).env_remove("HF_HUB_CACHE").env_remove("HF_HUB_OFFLINE");
        c.args(["logprobs", "--model", "org/tiny", "--input"]).arg(input(dir.path())).arg("--output").arg(&out);
        (c.stderr(std::process::Stdio::piped()).spawn().unwrap(), out)
    };
    let (a, b) = (spawn(0), spawn(1));
    let (oa, ob) = (a.0.wait_with_output().unwrap(), b.0.wait_with_output().unwrap());
    let logs = format!("{}\n{}", String::from_utf8_lossy(&oa.stderr), String::from_utf8_lossy(&ob.stderr));
    assert!(oa.status.success() && ob.status.success(), "{logs}");
    assert_eq!(common::read_jsonl(&a.1), common::read_jsonl(&b.1));
    assert_eq!(requests(&hub, &format!("GET /cdn/{weights}")), 1, "{:?}", hub.log());
    assert!(logs.contains("waiting for another process downloading model.safetensors"), "{logs}");
}

/// `hf://datasets/ORG/NAME@REV/GLOB` for `grpo data stats` and `prepare`: the matching shards only; the
/// prepared data records the commit, and a second prepare is a no-op.
#[test]
fn a_dataset_url_is_read_and_prepared_with_its_commit() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("hf");
    let rows = std::fs::read_to_string(common::root().join("data/trajectories/ot3_math_x8_dev.jsonl")).unwrap();
    let lines: Vec<&str> = rows.lines().collect();
    let half = lines.len() / 2;
    let mut repo = Repo { commit: commit("data-1"), ..Default::default() };
    repo.files.insert("data/train-00000.jsonl".into(), (lines[..half].join("\n") + "\n").into_bytes());
    repo.files.insert("data/train-00001.jsonl".into(), (lines[half..].join("\n") + "\n").into_bytes());
    repo.files.insert("other/extra.jsonl".into(), b"{}\n".to_vec());
    repo.files.insert("README.md".into(), b"# data".to_vec());
    let hub = Hub::start(vec![("datasets/org/data", repo)]);
    let url = "hf://datasets/org/data@main/data/*.jsonl";
    let out = grpo(&hub.url, &home).args(["data", "stats", "--input", url]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let snapshot = home.join("hub/datasets--org--data/snapshots").join(commit("data-1"));
    assert!(snapshot.join("data/train-00001.jsonl").is_file() && !snapshot.join("other").exists());
    assert_eq!(requests(&hub, "README.md") + requests(&hub, "extra.jsonl"), 0);

    let prepared = dir.path().join("prepared");
    let prepare = || {
        let mut c = grpo(&hub.url, &home);
        c.args(["data", "prepare", "--input", url, "--model"]).arg(common::root().join("data/tokenizers/smollm2"));
        c.arg("--out").arg(&prepared);
        c.output().unwrap()
    };
    let first = prepare();
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let version = std::fs::read_to_string(prepared.join("CURRENT")).unwrap();
    let manifest = std::fs::read_to_string(prepared.join(version.trim()).join("manifest.json")).unwrap();
    assert!(manifest.contains(&format!("snapshots/{}/data/train-00000.jsonl", commit("data-1"))), "{manifest}");
    let second = prepare();
    let log = String::from_utf8_lossy(&second.stderr).into_owned() + &String::from_utf8_lossy(&second.stdout);
    assert!(second.status.success() && log.contains("up to date"), "{log}");
}

/// The download benchmark (benches/hub_download.sh; not run by default): the same 512 MiB LFS file from
/// the local hub with `curl` and with grpo (which also checks its sha256), alternately, 3 times each.
/// grpo's time is the one its log line gives for the file (the bytes, written and hashed); curl's is
/// its own `time_total`.
#[test]
#[ignore]
fn download_speed_against_curl() {
    let dir = tempfile::tempdir().unwrap();
    let size = 512usize << 20;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let bytes: Vec<u8> = (0..size / 8)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()
        })
        .collect();
    let sha = sha256(&bytes);
    let mut repo = Repo { commit: commit("big"), ..Default::default() };
    repo.files.insert("config.json".into(), b"{}".to_vec());
    repo.files.insert("model.safetensors".into(), bytes);
    let hub = Hub::start(vec![("models/org/big", repo)]);
    let (mut curl_s, mut grpo_s) = (Vec::new(), Vec::new());
    for i in 0..3 {
        let out = dir.path().join("curl.bin");
        let o = Command::new("curl")
            .args(["-s", "-o"])
            .arg(&out)
            .args(["-w", "%{time_total}"])
            .arg(format!("{}/cdn/{sha}", hub.url))
            .output()
            .unwrap();
        assert!(o.status.success());
        curl_s.push(String::from_utf8_lossy(&o.stdout).trim().parse::<f64>().unwrap());
        std::fs::remove_file(&out).unwrap();
        let home = dir.path().join(format!("hf{i}"));
        // The model does not load (its weights are random bytes): the download is what is timed.
        let o = grpo(&hub.url, &home)
            .args(["logprobs", "--model", "org/big", "--input"])
            .arg(input(dir.path()))
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&o.stderr).into_owned();
        let line = log.lines().find(|l| l.contains("downloaded model.safetensors")).unwrap_or_else(|| panic!("{log}"));
        let secs: f64 = line.split(" in ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        grpo_s.push(secs);
        std::fs::remove_dir_all(&home).unwrap();
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (c, g) = (median(&mut curl_s), median(&mut grpo_s));
    let mb = size as f64 / 1e6;
    println!("file: {size} bytes (LFS, via the hub's CDN redirect), 3 runs each, medians");
    println!("curl: {c:.2} s ({:.0} MB/s)  runs {curl_s:?}", mb / c);
    println!("grpo: {g:.2} s ({:.0} MB/s, sha256 checked)  runs {grpo_s:?}", mb / g);
    println!("grpo / curl speed: {:.2}x", c / g);
}
