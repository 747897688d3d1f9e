//! A local Hugging Face hub for the tests, on 127.0.0.1: the routes a download uses, as the real hub
//! answers them. `GET /api/{models,datasets}/ID/revision/REV` (the commit and the files with their sizes
//! and, for LFS files, sha256s); `HEAD|GET [datasets/]ID/resolve/REV/FILE`: a small file's bytes with its
//! `ETag`, an LFS file (`*.safetensors`, `*.parquet`, `*.jsonl`) as a 302 to `/cdn/<sha256>` carrying
//! `X-Linked-Etag`, `X-Linked-Size` and `X-Repo-Commit`; `Range: bytes=N-` answered 206. Errors carry
//! `X-Error-Code` (RepositoryNotFound, RevisionNotFound, EntryNotFound, GatedRepo). Faults on demand:
//! a connection dropped mid-file, a corrupted body, a slow body.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};

/// One repo: its commit and files.
#[derive(Debug, Clone, Default)]
pub struct Repo {
    pub commit: String,
    pub files: BTreeMap<String, Vec<u8>>,
    /// Answer 401 without `Authorization: Bearer <token>`, 403 with another token.
    pub token: Option<String>,
}

impl Repo {
    /// The files of folder `dir` (not recursive), at a commit derived from `seed`.
    pub fn from_dir(dir: &Path, seed: &str) -> Repo {
        let mut files = BTreeMap::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                files.insert(p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap());
            }
        }
        Repo { commit: commit(seed), files, token: None }
    }
}

/// A 40-hex commit hash made from `seed`.
pub fn commit(seed: &str) -> String {
    sha256(seed.as_bytes())[..40].to_string()
}

pub fn sha256(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// Whether the hub stores `name` in LFS (its ETag is then its sha256).
pub fn is_lfs(name: &str) -> bool {
    [".safetensors", ".parquet", ".jsonl"].iter().any(|e| name.ends_with(e))
}

/// The ETag the hub gives `name`: an LFS file's sha256, else a 40-hex hash standing for the git blob's sha1.
pub fn etag(name: &str, bytes: &[u8]) -> String {
    if is_lfs(name) {
        sha256(bytes)
    } else {
        let mut blob = format!("blob {}\0", bytes.len()).into_bytes();
        blob.extend_from_slice(bytes);
        sha256(&blob)[..40].to_string()
    }
}

/// Faults applied to the next requests.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Close the connection after this many bytes of the next body of the file with this sha256.
    pub drop_once: Option<(String, usize)>,
    /// Serve this file's (sha256) bytes with one byte changed.
    pub corrupt: Option<String>,
    /// Sleep this long after each 64 KiB of a body.
    pub chunk_delay: Option<Duration>,
}

#[derive(Debug, Default)]
struct State {
    /// By `models/ORG/NAME` or `datasets/ORG/NAME`.
    repos: BTreeMap<String, Repo>,
    faults: Faults,
    /// `METHOD PATH RANGE` of every request.
    log: Vec<String>,
    /// Where the hub listens (the CDN's address in redirects).
    url: String,
}

/// A running hub; stopped (its port closed) when dropped.
pub struct Hub {
    pub url: String,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Hub {
    /// Serve `repos` (keys `models/ORG/NAME` or `datasets/ORG/NAME`) on a free port.
    pub fn start(repos: Vec<(&str, Repo)>) -> Hub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let repos = repos.into_iter().map(|(k, r)| (k.to_string(), r)).collect();
        let state = Arc::new(Mutex::new(State { repos, url: url.clone(), ..Default::default() }));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (state.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        Hub { url, state, stop, thread: Some(thread) }
    }

    pub fn faults(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.state.lock().unwrap().faults);
    }

    pub fn log(&self) -> Vec<String> {
        self.state.lock().unwrap().log.clone()
    }

    /// Stop serving: the port refuses connections from now on.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.url.trim_start_matches("http://"));
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Request {
    method: String,
    path: String,
    range: Option<u64>,
    auth: Option<String>,
}

fn read_request(conn: &TcpStream) -> Option<Request> {
    let mut r = BufReader::new(conn.try_clone().ok()?);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next()?.to_string(), parts.next()?.to_string());
    let (mut range, mut auth) = (None, None);
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 || h.trim().is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        match k.trim().to_ascii_lowercase().as_str() {
            "range" => range = v.trim().strip_prefix("bytes=")?.trim_end_matches('-').parse().ok(),
            "authorization" => auth = Some(v.trim().to_string()),
            _ => {}
        }
    }
    let path = target.split('?').next().unwrap_or_default().to_string();
    Some(Request { method, path, range, auth })
}

/// What to answer: a status, headers and a body (the body of a file: its sha256 too, for the faults).
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    sha: Option<String>,
}

fn answer(status: u16, headers: Vec<(&str, String)>, body: Vec<u8>) -> Answer {
    Answer { status, headers: headers.into_iter().map(|(k, v)| (k.to_string(), v)).collect(), body, sha: None }
}

fn error(status: u16, code: &str) -> Answer {
    answer(status, vec![("X-Error-Code", code.to_string())], format!("{{\"error\":\"{code}\"}}").into_bytes())
}

fn serve(mut conn: TcpStream, state: &Mutex<State>) {
    let Some(req) = read_request(&conn) else { return };
    let (a, faults) = {
        let mut s = state.lock().unwrap();
        s.log.push(format!("{} {} {}", req.method, req.path, req.range.map_or("-".into(), |r| format!("bytes={r}-"))));
        (route(&s, &req), s.faults.clone())
    };
    let head = req.method == "HEAD";
    let (mut status, mut body) = (a.status, a.body);
    let mut headers = a.headers;
    if let Some(sha) = &a.sha {
        if faults.corrupt.as_deref() == Some(sha) && !body.is_empty() {
            let mid = body.len() / 2;
            body[mid] ^= 0xff;
        }
        if let (200, Some(start)) = (status, req.range) {
            let len = body.len() as u64;
            headers.push(("Content-Range".into(), format!("bytes {start}-{}/{len}", len.saturating_sub(1))));
            body = body.split_off((start as usize).min(body.len()));
            status = 206;
        }
    }
    let mut text = format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
    for (k, v) in &headers {
        text.push_str(&format!("{k}: {v}\r\n"));
    }
    text.push_str("\r\n");
    if conn.write_all(text.as_bytes()).is_err() || head {
        return;
    }
    let drop_at = match (&faults.drop_once, &a.sha) {
        (Some((sha, n)), Some(s)) if sha == s => {
            state.lock().unwrap().faults.drop_once = None;
            Some(*n)
        }
        _ => None,
    };
    for (i, chunk) in body.chunks(64 << 10).enumerate() {
        let sent = i * (64 << 10);
        if let Some(n) = drop_at.filter(|n| sent + chunk.len() > *n) {
            let _ = conn.write_all(&chunk[..n - sent]);
            let _ = conn.flush();
            let _ = conn.shutdown(Shutdown::Both);
            return;
        }
        if conn.write_all(chunk).is_err() {
            return;
        }
        if let Some(d) = faults.chunk_delay {
            std::thread::sleep(d);
        }
    }
}

fn route(s: &State, req: &Request) -> Answer {
    if let Some(sha) = req.path.strip_prefix("/cdn/") {
        return cdn(s, sha);
    }
    let (api, rest) = match req.path.strip_prefix("/api/") {
        Some(rest) => (true, rest.to_string()),
        None => {
            let rest = req.path.trim_start_matches('/');
            (false, if rest.starts_with("datasets/") { rest.to_string() } else { format!("models/{rest}") })
        }
    };
    let parts: Vec<&str> = rest.splitn(6, '/').collect();
    if parts.len() < 5 {
        return error(404, "RepositoryNotFound");
    }
    let key = parts[..3].join("/");
    let Some(repo) = s.repos.get(&key) else { return error(404, "RepositoryNotFound") };
    if let Some(token) = &repo.token {
        match &req.auth {
            None => return error(401, "GatedRepo"),
            Some(a) if *a != format!("Bearer {token}") => return error(403, "GatedRepo"),
            _ => {}
        }
    }
    let revision = parts[4].replace("%2F", "/");
    if revision != "main" && revision != repo.commit {
        return error(404, "RevisionNotFound");
    }
    match (api, parts[3], parts.get(5)) {
        (true, "revision", _) => info(repo),
        (false, "resolve", Some(file)) => resolve(repo, file, &s.url),
        _ => error(404, "EntryNotFound"),
    }
}

fn info(repo: &Repo) -> Answer {
    let siblings: Vec<serde_json::Value> = repo
        .files
        .iter()
        .map(|(name, bytes)| {
            let mut v = serde_json::json!({"rfilename": name, "size": bytes.len(), "blobId": etag(name, bytes)});
            if is_lfs(name) {
                v["lfs"] = serde_json::json!({"sha256": sha256(bytes), "size": bytes.len()});
            }
            v
        })
        .collect();
    let body = serde_json::json!({"sha": repo.commit, "siblings": siblings});
    answer(200, vec![("Content-Type", "application/json".into())], body.to_string().into_bytes())
}

fn resolve(repo: &Repo, file: &str, url: &str) -> Answer {
    let Some(bytes) = repo.files.get(file) else { return error(404, "EntryNotFound") };
    let tag = etag(file, bytes);
    let mut headers = vec![("X-Repo-Commit", repo.commit.clone()), ("ETag", format!("\"{tag}\""))];
    if is_lfs(file) {
        headers.push(("X-Linked-Etag", format!("\"{tag}\"")));
        headers.push(("X-Linked-Size", bytes.len().to_string()));
        headers.push(("Location", format!("{url}/cdn/{tag}")));
        return answer(302, headers, Vec::new());
    }
    let mut a = answer(200, headers, bytes.clone());
    a.sha = Some(sha256(bytes));
    a
}

fn cdn(s: &State, sha: &str) -> Answer {
    let found = s.repos.values().flat_map(|r| r.files.values()).find(|b| sha256(b) == sha);
    match found {
        Some(bytes) => {
            let mut a = answer(200, vec![("ETag", format!("\"{sha}\""))], bytes.clone());
            a.sha = Some(sha.to_string());
            a
        }
        None => error(404, "EntryNotFound"),
    }
}
