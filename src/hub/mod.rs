//! Models and datasets by Hugging Face id, downloaded into the Hugging Face cache as huggingface_hub
//! writes it (`models--org--name/{blobs,refs,snapshots}`), so transformers, vLLM and the datasets library
//! find the same files.
//!
//! - [`Settings`]: `HF_ENDPOINT`, `HF_TOKEN` (else the token file huggingface_hub stores), `HF_HUB_CACHE` /
//!   `HF_HOME`, `HF_HUB_OFFLINE` (no network at all).
//! - [`model_snapshot`]: the files a model needs (config, generation config, tokenizer, the safetensors and
//!   their index), or an adapter's two files; [`dataset_files`]: the shards an `hf://datasets/...` URL names.
//! - Each file: a `HEAD` of `resolve/COMMIT/FILE` for its ETag (the blob's name), a ranged `GET` into
//!   `blobs/<etag>.incomplete` that resumes where a previous try or process stopped, the sha256 of an LFS
//!   file checked against the hub's (a mismatch removes the file), then the rename into `blobs/` and the
//!   relative symlink from `snapshots/<commit>/`. A lock per blob (`.locks/<repo>/<etag>.lock`, as
//!   huggingface_hub keeps them) makes concurrent processes download once.
//!
//! The hub's routes are in docs/hub.md.

pub mod cache;
mod download;
mod http;
pub mod select;

use std::path::{Path, PathBuf};

pub use cache::cache_dir;
pub use select::DatasetUrl;

/// The hub most tools use when `HF_ENDPOINT` is unset.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Errors of finding and downloading a repo's files.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "{repo}: the hub {endpoint} answered {status} ({code}): set HF_TOKEN to a token with read access, and \
         accept the model's licence on its page {endpoint}/{page}"
    )]
    Denied { repo: String, endpoint: String, page: String, status: u16, code: String },
    #[error(
        "{repo}: repository not found on {endpoint} (revision `{revision}`): check the id; a private repo needs \
         HF_TOKEN"
    )]
    RepoNotFound { repo: String, revision: String, endpoint: String },
    #[error("{repo}: revision `{revision}` not found on {endpoint} (give a branch, a tag or a commit)")]
    RevisionNotFound { repo: String, revision: String, endpoint: String },
    #[error("{repo}@{revision}: the repo has no file `{file}` ({endpoint})")]
    MissingFile { repo: String, revision: String, file: String, endpoint: String },
    #[error(
        "{repo}: `{file}` downloaded with sha256 {found}, the hub gives {expected}: the file was removed, never \
         used; run again to download it again"
    )]
    Checksum { repo: String, file: String, expected: String, found: String },
    #[error(
        "{repo}@{revision}: `{file}` is not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE is set (no \
         network): unset it to download, or download on a machine with network"
    )]
    Offline { repo: String, revision: String, file: String, cache: PathBuf },
    #[error("{at}: the hub {endpoint} is unreachable ({message}), and {missing}")]
    Unreachable { at: String, endpoint: String, message: String, missing: String },
    #[error("{url}: HTTP {status}: {body}")]
    Http { url: String, status: u16, body: String },
    #[error("{url}: {message}")]
    Transport { url: String, message: String },
    #[error(
        "the disk is full writing {path}: free space, or set HF_HUB_CACHE to a larger disk (the partial download \
         is kept, and resumes)"
    )]
    DiskFull { path: PathBuf },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
}

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> HubError {
    let path = path.into();
    move |source| {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            HubError::DiskFull { path }
        } else {
            HubError::Io { path, source }
        }
    }
}

/// How to reach the hub and where its cache is, from the environment as huggingface_hub reads it.
#[derive(Debug, Clone)]
pub struct Settings {
    pub endpoint: String,
    pub cache: PathBuf,
    pub token: Option<String>,
    pub offline: bool,
}

impl Settings {
    /// `HF_ENDPOINT`, the cache ([`cache_dir`]), `HF_TOKEN` (else `$HF_TOKEN_PATH`, else `$HF_HOME/token`,
    /// the file `huggingface-cli login` writes) and `HF_HUB_OFFLINE` (1, true, yes or on).
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.into()).trim_end_matches('/').to_string();
        let token_file = var("HF_TOKEN_PATH").map(PathBuf::from).or_else(|| cache::hf_home().map(|h| h.join("token")));
        let token = var("HF_TOKEN").or_else(|| {
            let text = std::fs::read_to_string(token_file?).ok()?;
            Some(text.trim().to_string()).filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| is_true(&v));
        Settings { endpoint, cache: cache_dir(), token, offline }
    }
}

/// huggingface_hub's reading of a boolean variable.
fn is_true(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "on" | "yes" | "true")
}

/// A model or a dataset repo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Model,
    Dataset,
}

/// A repo at a revision (a branch, a tag or a commit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRef {
    pub kind: Kind,
    pub id: String,
    pub revision: String,
}

impl RepoRef {
    /// `org/name` (a model) or `datasets/org/name`, as errors and logs name it.
    pub fn name(&self) -> String {
        match self.kind {
            Kind::Model => self.id.clone(),
            Kind::Dataset => format!("datasets/{}", self.id),
        }
    }

    fn hf(&self) -> hf_hub::Repo {
        let kind = match self.kind {
            Kind::Model => hf_hub::RepoType::Model,
            Kind::Dataset => hf_hub::RepoType::Dataset,
        };
        hf_hub::Repo::with_revision(self.id.clone(), kind, self.revision.clone())
    }

    /// The revision as it goes into a URL (a branch may hold `/`).
    fn url_revision(&self) -> String {
        self.revision.replace('/', "%2F")
    }
}

/// Whether `s` is a commit hash (40 hex digits), which names one snapshot for ever.
pub fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A repo's files at one commit, all present in the cache.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// `snapshots/<commit>` of the repo's cache folder.
    pub dir: PathBuf,
    pub commit: String,
    /// The files (relative to `dir`) that were asked for.
    pub files: Vec<String>,
}

impl Snapshot {
    pub fn paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| self.dir.join(f)).collect()
    }
}

/// The snapshot of model repo `repo` holding what a model needs (or, for an adapter repo, the adapter's
/// two files), downloading what is missing unless offline. A commit whose files are all cached is used
/// without the network; a branch or tag is looked up on the hub (one request), and the cached snapshot
/// is used when the hub is unreachable.
pub fn model_snapshot(settings: &Settings, repo: &RepoRef) -> Result<Snapshot, HubError> {
    let needs = |dir: &Path| select::model_files_in(dir);
    fetch(settings, repo, &needs, &|hub: &http::Client, info: &http::RepoInfo| {
        select::model_files(info, (repo, &settings.endpoint), |name| hub_json(settings, hub, repo, info, name))
    })
}

/// The snapshot of `repo` holding just `names` (e.g. a model's config.json, for a plan that reads only its
/// shape), downloaded where missing unless offline.
pub fn repo_files(settings: &Settings, repo: &RepoRef, names: &[&str]) -> Result<Snapshot, HubError> {
    let wanted: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let needs = |_: &Path| Ok(wanted.clone());
    fetch(settings, repo, &needs, &|hub: &http::Client, info: &http::RepoInfo| {
        let found = names.iter().map(|n| info.sibling(n).cloned().ok_or_else(|| info.missing(repo, n, hub.endpoint())));
        found.collect()
    })
}

/// The local files of the shards `url` names (`hf://datasets/ORG/NAME[@REVISION][/GLOB]`), downloaded
/// where missing unless offline; `accept` keeps the data files among the glob's matches.
pub fn dataset_files(
    settings: &Settings,
    url: &DatasetUrl,
    accept: &dyn Fn(&str) -> bool,
) -> Result<Snapshot, HubError> {
    let repo = url.repo();
    let needs = |dir: &Path| url.matching_in(dir, accept);
    fetch(settings, &repo, &needs, &|hub: &http::Client, info: &http::RepoInfo| {
        url.matching(info, hub.endpoint(), accept)
    })
}

/// Picks the files to fetch from the repo's info (the client: to read one of them first).
type Choose<'a> = dyn Fn(&http::Client, &http::RepoInfo) -> Result<Vec<http::Sibling>, HubError> + 'a;

/// The common steps of [`model_snapshot`] and [`dataset_files`]: the cache alone when offline or for a
/// complete cached commit; else the hub's file list, `choose` picks the files, each is made present.
fn fetch(
    settings: &Settings,
    repo: &RepoRef,
    cached_needs: &dyn Fn(&Path) -> Result<Vec<String>, String>,
    choose: &Choose,
) -> Result<Snapshot, HubError> {
    let local = cache::RepoCache::new(&settings.cache, repo);
    let cached = || local.complete_snapshot(cached_needs);
    if settings.offline {
        return cached().map_err(|file| HubError::Offline {
            repo: repo.name(),
            revision: repo.revision.clone(),
            file,
            cache: settings.cache.clone(),
        });
    }
    if is_commit(&repo.revision) {
        if let Ok(snapshot) = cached() {
            return Ok(snapshot);
        }
    }
    let hub = http::Client::new(settings);
    let info = match hub.info(repo) {
        Ok(info) => info,
        Err(HubError::Transport { message, .. }) => {
            return match cached() {
                Ok(snapshot) => {
                    tracing::warn!(
                        "the hub {} is unreachable ({message}): using the cached {}",
                        settings.endpoint,
                        repo.name()
                    );
                    Ok(snapshot)
                }
                Err(file) => Err(HubError::Unreachable {
                    at: format!("{}@{}", repo.name(), repo.revision),
                    endpoint: settings.endpoint.clone(),
                    message,
                    missing: format!("`{file}` is not in the cache {}", settings.cache.display()),
                }),
            };
        }
        Err(e) => return Err(e),
    };
    let files = choose(&hub, &info)?;
    let ctx = download::Ctx { hub: &hub, local: &local, repo, commit: &info.sha };
    for file in &files {
        download::ensure(&ctx, file)?;
    }
    local.write_ref(&repo.revision, &info.sha)?;
    let names = files.into_iter().map(|f| f.rfilename).collect();
    Ok(Snapshot { dir: local.snapshot_dir(&info.sha), commit: info.sha, files: names })
}

/// The parsed JSON file `name` of the repo, downloaded first (the model's weight index).
fn hub_json(
    settings: &Settings,
    hub: &http::Client,
    repo: &RepoRef,
    info: &http::RepoInfo,
    name: &str,
) -> Result<serde_json::Value, HubError> {
    let local = cache::RepoCache::new(&settings.cache, repo);
    let sibling = info.sibling(name).ok_or_else(|| info.missing(repo, name, &settings.endpoint))?;
    let path = download::ensure(&download::Ctx { hub, local: &local, repo, commit: &info.sha }, sibling)?;
    let text = std::fs::read(&path).map_err(io_err(&path))?;
    serde_json::from_slice(&text).map_err(|e| HubError::Invalid(format!("{}: {e}", path.display())))
}

/// A model argument `org/name` or `org/name@revision` as a repo reference (revision `main` by default).
pub fn model_ref(model: &str) -> Option<RepoRef> {
    let (id, revision) = model.split_once('@').unwrap_or((model, "main"));
    let parts: Vec<&str> = id.split('/').collect();
    let ok = parts.len() == 2 && parts.iter().all(|p| !p.is_empty() && !p.starts_with('.')) && !revision.is_empty();
    ok.then(|| RepoRef { kind: Kind::Model, id: id.to_string(), revision: revision.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_arguments_parse_into_repo_references() {
        let r = model_ref("Qwen/Qwen3-0.6B@v1.0").unwrap();
        assert_eq!((r.id.as_str(), r.revision.as_str(), r.kind), ("Qwen/Qwen3-0.6B", "v1.0", Kind::Model));
        assert_eq!(model_ref("org/name").unwrap().revision, "main");
        for bad in ["gpt2", "a/b/c", "/abs", "org/", "org/name@", "./x"] {
            assert!(model_ref(bad).is_none(), "{bad}");
        }
        assert!(is_commit("0123456789abcdef0123456789abcdef01234567"));
        assert!(!is_commit("main"));
        let d = RepoRef { kind: Kind::Dataset, id: "o/n".into(), revision: "refs/convert/parquet".into() };
        assert_eq!((d.name(), d.url_revision()), ("datasets/o/n".to_string(), "refs%2Fconvert%2Fparquet".to_string()));
        assert_eq!(d.hf().folder_name(), "datasets--o--n");
    }

    #[test]
    fn offline_values_are_read_as_huggingface_hub_reads_them() {
        for v in ["1", "ON", "yes", "True"] {
            assert!(is_true(v), "{v}");
        }
        for v in ["0", "off", "no", ""] {
            assert!(!is_true(v), "{v}");
        }
    }
}
