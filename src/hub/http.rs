//! The hub's HTTP routes a download uses: the repo's info (`/api/{models,datasets}/ID/revision/REV`, its
//! commit and files with their sizes and sha256s), `HEAD resolve/COMMIT/FILE` (the ETag, the size, the
//! CDN location of an LFS file) and ranged `GET`s; error statuses as [`HubError`]s.

use std::io::Read;
use std::time::Duration;

use serde::Deserialize;

use super::{HubError, Kind, RepoRef, Settings};

/// The repo's info at a revision, as the hub gives it with `?blobs=true`.
#[derive(Debug, Clone, Deserialize)]
pub struct RepoInfo {
    /// The commit the revision names.
    pub sha: String,
    #[serde(default)]
    pub siblings: Vec<Sibling>,
}

/// One file of a repo.
#[derive(Debug, Clone, Deserialize)]
pub struct Sibling {
    pub rfilename: String,
    #[serde(default)]
    pub lfs: Option<Lfs>,
}

/// A file stored in Git LFS: its sha256 is its ETag, and the blob's name in the cache.
#[derive(Debug, Clone, Deserialize)]
pub struct Lfs {
    pub sha256: String,
}

impl RepoInfo {
    pub fn sibling(&self, name: &str) -> Option<&Sibling> {
        self.siblings.iter().find(|s| s.rfilename == name)
    }

    pub fn has(&self, name: &str) -> bool {
        self.sibling(name).is_some()
    }

    pub fn missing(&self, repo: &RepoRef, name: &str, endpoint: &str) -> HubError {
        HubError::MissingFile {
            repo: repo.name(),
            revision: repo.revision.clone(),
            file: name.into(),
            endpoint: endpoint.into(),
        }
    }
}

/// What `HEAD resolve/...` says of a file.
#[derive(Debug, Clone)]
pub struct FileMeta {
    /// The blob's name: `X-Linked-Etag` (an LFS file's sha256) or `ETag`, quotes and `W/` removed.
    pub etag: String,
    pub size: u64,
    /// Where to GET the bytes (the CDN for an LFS file on the real hub).
    pub url: String,
}

/// A connection to the hub of [`Settings`].
#[derive(Debug, Clone)]
pub struct Client {
    endpoint: String,
    token: Option<String>,
    /// Redirects are read, not followed, for `HEAD` (they carry the LFS headers).
    head_agent: ureq::Agent,
    agent: ureq::Agent,
}

const USER_AGENT: &str = concat!("grpo/", env!("CARGO_PKG_VERSION"), "; hf_hub-compatible");

fn agent(redirects: u32) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(redirects)
        .max_redirects_will_error(false)
        .timeout_connect(Some(Duration::from_secs(10)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        .user_agent(USER_AGENT)
        .build()
        .into()
}

impl Client {
    pub fn new(settings: &Settings) -> Self {
        Client {
            endpoint: settings.endpoint.clone(),
            token: settings.token.clone(),
            head_agent: agent(0),
            agent: agent(10),
        }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn authorize<B>(&self, url: &str, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        // The token goes to the hub only, never to the CDN it redirects to.
        match &self.token {
            Some(t) if url.starts_with(&self.endpoint) => req.header("Authorization", format!("Bearer {t}")),
            _ => req,
        }
    }

    /// The repo's commit and files at its revision.
    pub fn info(&self, repo: &RepoRef) -> Result<RepoInfo, HubError> {
        let kind = match repo.kind {
            Kind::Model => "models",
            Kind::Dataset => "datasets",
        };
        let url = format!("{}/api/{kind}/{}/revision/{}?blobs=true", self.endpoint, repo.id, repo.url_revision());
        let resp = self.authorize(&url, self.agent.get(&url)).call().map_err(transport(&url))?;
        let mut resp = self.check(resp, &url, repo, None)?;
        let text = resp.body_mut().with_config().limit(64 << 20).read_to_string().map_err(transport(&url))?;
        serde_json::from_str(&text)
            .map_err(|e| HubError::Invalid(format!("{url}: the repo info is not as expected: {e}")))
    }

    /// The URL of `file` at `commit`.
    pub fn resolve_url(&self, repo: &RepoRef, commit: &str, file: &str) -> String {
        let prefix = match repo.kind {
            Kind::Model => "",
            Kind::Dataset => "datasets/",
        };
        format!("{}/{prefix}{}/resolve/{commit}/{file}", self.endpoint, repo.id)
    }

    /// `HEAD` of `file` at `commit`, following relative redirects (a renamed repo) and stopping at an
    /// absolute one (the CDN), as huggingface_hub does.
    pub fn head(&self, repo: &RepoRef, commit: &str, file: &str) -> Result<FileMeta, HubError> {
        let mut url = self.resolve_url(repo, commit, file);
        for _ in 0..10 {
            let req = self.authorize(&url, self.head_agent.head(&url)).header("Accept-Encoding", "identity");
            let resp = req.call().map_err(transport(&url))?;
            let location = header(&resp, "location");
            if resp.status().is_redirection() {
                match location {
                    Some(l) if l.starts_with('/') => {
                        url = format!("{}{l}", origin(&url));
                        continue;
                    }
                    Some(l) => return meta(&resp, &url, l),
                    None => {}
                }
            }
            let resp = self.check(resp, &url, repo, Some(file))?;
            return meta(&resp, &url, url.clone());
        }
        Err(HubError::Invalid(format!("{url}: too many redirects")))
    }

    /// `GET url` from byte `start` on (a `Range` request when `start` > 0).
    pub fn get(
        &self,
        url: &str,
        start: u64,
        repo: &RepoRef,
        file: &str,
    ) -> Result<ureq::http::Response<ureq::Body>, HubError> {
        let mut req = self.authorize(url, self.agent.get(url)).header("Accept-Encoding", "identity");
        if start > 0 {
            req = req.header("Range", format!("bytes={start}-"));
        }
        let resp = req.call().map_err(transport(url))?;
        if resp.status().as_u16() == 416 {
            return Ok(resp);
        }
        self.check(resp, url, repo, Some(file))
    }

    /// The response when it succeeded, else the error its status and `X-Error-Code` give.
    fn check(
        &self,
        resp: ureq::http::Response<ureq::Body>,
        url: &str,
        repo: &RepoRef,
        file: Option<&str>,
    ) -> Result<ureq::http::Response<ureq::Body>, HubError> {
        let status = resp.status().as_u16();
        if resp.status().is_success() {
            return Ok(resp);
        }
        let code = header(&resp, "x-error-code").unwrap_or_default();
        let (name, revision, endpoint) = (repo.name(), repo.revision.clone(), self.endpoint.clone());
        Err(match (status, code.as_str(), file) {
            (_, "RepositoryNotFound", _) => HubError::RepoNotFound { repo: name, revision, endpoint },
            (_, "RevisionNotFound", _) => HubError::RevisionNotFound { repo: name, revision, endpoint },
            (_, "EntryNotFound", Some(f)) | (404, "", Some(f)) => {
                HubError::MissingFile { repo: name, revision, file: f.into(), endpoint }
            }
            (401 | 403, _, _) | (_, "GatedRepo", _) => {
                let page = match repo.kind {
                    Kind::Model => repo.id.clone(),
                    Kind::Dataset => format!("datasets/{}", repo.id),
                };
                let code = if code.is_empty() { "no error code".into() } else { code };
                HubError::Denied { repo: name, endpoint, page, status, code }
            }
            (404, _, None) => HubError::RepoNotFound { repo: name, revision, endpoint },
            _ => {
                let mut head = Vec::new();
                let _ = resp.into_body().into_reader().take(500).read_to_end(&mut head);
                HubError::Http { url: url.into(), status, body: String::from_utf8_lossy(&head).trim().to_string() }
            }
        })
    }
}

fn transport(url: &str) -> impl FnOnce(ureq::Error) -> HubError + '_ {
    move |e| HubError::Transport { url: url.into(), message: e.to_string() }
}

fn header<B>(resp: &ureq::http::Response<B>, name: &str) -> Option<String> {
    resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string)
}

/// `scheme://host[:port]` of `url`.
fn origin(url: &str) -> &str {
    let after = url.find("://").map_or(0, |i| i + 3);
    url[after..].find('/').map_or(url, |i| &url[..after + i])
}

fn meta<B>(resp: &ureq::http::Response<B>, url: &str, get_url: String) -> Result<FileMeta, HubError> {
    let etag = header(resp, "x-linked-etag")
        .or_else(|| header(resp, "etag"))
        .map(|e| e.trim_start_matches("W/").replace('"', ""))
        .filter(|e| !e.is_empty() && !e.contains(['/', '\\']))
        .ok_or_else(|| {
            HubError::Invalid(format!("{url}: the hub sent no ETag (is HF_ENDPOINT a Hugging Face hub?)"))
        })?;
    let size = header(resp, "x-linked-size")
        .or_else(|| header(resp, "content-length"))
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| HubError::Invalid(format!("{url}: the hub sent no file size")))?;
    Ok(FileMeta { etag, size, url: get_url })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_and_infos_parse() {
        assert_eq!(origin("http://127.0.0.1:8080/org/m/resolve/x/f"), "http://127.0.0.1:8080");
        assert_eq!(origin("https://huggingface.co"), "https://huggingface.co");
        let info: RepoInfo = serde_json::from_str(
            r#"{"sha":"abc","siblings":[{"rfilename":"config.json","size":2},
                {"rfilename":"model.safetensors","size":9,"lfs":{"sha256":"ff","size":9}}]}"#,
        )
        .unwrap();
        assert_eq!(info.sha, "abc");
        assert!(info.has("config.json") && !info.has("x"));
        assert_eq!(info.sibling("model.safetensors").unwrap().lfs.as_ref().unwrap().sha256, "ff");
    }
}
