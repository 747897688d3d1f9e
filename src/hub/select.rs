//! Which files of a repo are fetched: a model's config, generation config, tokenizer files, weight index
//! and the shards it names (or `model.safetensors`); an adapter's two files; the shards of a dataset URL
//! `hf://datasets/ORG/NAME[@REVISION][/GLOB]` (the form the datasets library and fsspec use).

use std::path::{Path, PathBuf};

use super::http::{RepoInfo, Sibling};
use super::{HubError, Kind, RepoRef};

/// Fetched when the repo has them (for an adapter too: PEFT may save the tokenizer with it); a model
/// needs none of them to load, its tokenizer does.
const MODEL_EXTRAS: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];
const CONFIG: &str = "config.json";
const INDEX: &str = "model.safetensors.index.json";
const WEIGHTS: &str = "model.safetensors";
const ADAPTER: [&str; 2] = ["adapter_config.json", "adapter_model.safetensors"];

/// The shards a weight index names, in the order they first appear.
fn index_shards(index: &serde_json::Value) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let names = index.get("weight_map").and_then(|m| m.as_object()).into_iter().flat_map(|m| m.values());
    for f in names.filter_map(|f| f.as_str()) {
        if !out.iter().any(|o| o == f) {
            out.push(f.to_string());
        }
    }
    out
}

/// The files of a model repo to fetch (an adapter repo: its two files); `index` reads the weight index
/// (downloading it).
pub(super) fn model_files(
    info: &RepoInfo,
    (repo, endpoint): (&RepoRef, &str),
    index: impl FnOnce(&str) -> Result<serde_json::Value, HubError>,
) -> Result<Vec<Sibling>, HubError> {
    let adapter = !info.has(CONFIG) && info.has(ADAPTER[0]);
    let mut names: Vec<String> = Vec::new();
    if adapter {
        names.extend(ADAPTER.map(String::from));
        names.extend(MODEL_EXTRAS.iter().filter(|f| info.has(f)).map(|f| f.to_string()));
    } else {
        names.push(CONFIG.into());
        names.extend(MODEL_EXTRAS.iter().filter(|f| info.has(f)).map(|f| f.to_string()));
        if info.has(INDEX) {
            names.push(INDEX.into());
            names.extend(index_shards(&index(INDEX)?));
        } else {
            names.push(WEIGHTS.into());
        }
    }
    names.iter().map(|n| info.sibling(n).cloned().ok_or_else(|| info.missing(repo, n, endpoint))).collect()
}

/// The files a cached model snapshot `dir` must hold (its weight index read for the shards), else the
/// first one it lacks.
pub(super) fn model_files_in(dir: &Path) -> Result<Vec<String>, String> {
    let extras = MODEL_EXTRAS.iter().filter(|f| dir.join(f).is_file()).map(|f| f.to_string());
    if dir.join(ADAPTER[0]).is_file() && !dir.join(CONFIG).is_file() {
        return Ok(ADAPTER.map(String::from).into_iter().chain(extras).collect());
    }
    if !dir.join(CONFIG).is_file() {
        return Err(CONFIG.into());
    }
    let mut names = vec![CONFIG.to_string()];
    names.extend(extras);
    let index = dir.join(INDEX);
    if index.is_file() {
        let text = std::fs::read(&index).map_err(|_| INDEX.to_string())?;
        let value: serde_json::Value = serde_json::from_slice(&text).map_err(|_| INDEX.to_string())?;
        names.push(INDEX.into());
        names.extend(index_shards(&value));
    } else {
        names.push(WEIGHTS.into());
    }
    Ok(names)
}

/// `hf://datasets/ORG/NAME[@REVISION][/GLOB]`; a revision holding `/` is written `%2F` (as fsspec does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatasetUrl {
    pub id: String,
    pub revision: String,
    /// Matched against the repo's file paths (`**` crosses folders); `**` when the URL gives none.
    pub glob: String,
}

const PREFIX: &str = "hf://datasets/";

impl DatasetUrl {
    /// Whether `input` is meant as a hub dataset URL.
    pub fn is_hub(input: &str) -> bool {
        input.starts_with("hf://")
    }

    pub fn parse(input: &str) -> Result<DatasetUrl, HubError> {
        let bad = |why: &str| {
            HubError::Invalid(format!("`{input}`: {why} (expected hf://datasets/ORG/NAME[@REVISION][/GLOB])"))
        };
        let rest = input.strip_prefix(PREFIX).ok_or_else(|| bad("only dataset repos are read"))?;
        let mut parts = rest.splitn(3, '/');
        let (org, name_rev) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
        let glob = parts.next().filter(|g| !g.is_empty()).unwrap_or("**").to_string();
        let (name, revision) = name_rev.split_once('@').unwrap_or((name_rev, "main"));
        if org.is_empty() || name.is_empty() || revision.is_empty() {
            return Err(bad("no ORG/NAME"));
        }
        if glob::Pattern::new(&glob).is_err() {
            return Err(bad("the glob does not parse"));
        }
        let revision = revision.replace("%2F", "/").replace("%2f", "/");
        Ok(DatasetUrl { id: format!("{org}/{name}"), revision, glob })
    }

    pub fn repo(&self) -> RepoRef {
        RepoRef { kind: Kind::Dataset, id: self.id.clone(), revision: self.revision.clone() }
    }

    fn matches(&self, file: &str) -> bool {
        let opts = glob::MatchOptions { require_literal_separator: true, ..Default::default() };
        glob::Pattern::new(&self.glob).is_ok_and(|p| p.matches_with(file, opts))
    }

    /// The repo's files the URL names that `accept` keeps (sorted), or an error saying none does.
    pub(super) fn matching(
        &self,
        info: &RepoInfo,
        endpoint: &str,
        accept: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<Sibling>, HubError> {
        let mut files: Vec<Sibling> =
            info.siblings.iter().filter(|s| self.matches(&s.rfilename) && accept(&s.rfilename)).cloned().collect();
        files.sort_by(|a, b| a.rfilename.cmp(&b.rfilename));
        if files.is_empty() {
            return Err(HubError::MissingFile {
                repo: self.repo().name(),
                revision: self.revision.clone(),
                file: format!("{} (no .jsonl or .parquet file matches)", self.glob),
                endpoint: endpoint.into(),
            });
        }
        Ok(files)
    }

    /// The files of cached snapshot `dir` the URL names, else the glob as the missing "file".
    pub(super) fn matching_in(&self, dir: &Path, accept: &dyn Fn(&str) -> bool) -> Result<Vec<String>, String> {
        let mut found = Vec::new();
        walk(dir, dir, &mut found);
        let mut files: Vec<String> = found.into_iter().filter(|f| self.matches(f) && accept(f)).collect();
        files.sort();
        if files.is_empty() {
            return Err(self.glob.clone());
        }
        Ok(files)
    }
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for p in entries.filter_map(Result::ok).map(|e| e.path()) {
        if p.is_dir() {
            walk(root, &p, out);
        } else if let Ok(rel) = p.strip_prefix(root).map(PathBuf::from) {
            out.push(rel.to_string_lossy().into_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(files: &[&str]) -> RepoInfo {
        let siblings = files.iter().map(|f| Sibling { rfilename: f.to_string(), lfs: None }).collect();
        RepoInfo { sha: "c".into(), siblings }
    }

    fn names(files: Vec<Sibling>) -> Vec<String> {
        files.into_iter().map(|s| s.rfilename).collect()
    }

    #[test]
    fn a_model_takes_its_config_tokenizer_index_and_shards_only() {
        let r = RepoRef { kind: Kind::Model, id: "o/m".into(), revision: "main".into() };
        let i = info(&[
            "config.json",
            "tokenizer.json",
            "README.md",
            "model.safetensors.index.json",
            "a.safetensors",
            "b.safetensors",
            "consolidated.safetensors",
        ]);
        let index =
            serde_json::json!({"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "a.safetensors"}});
        let got = names(model_files(&i, (&r, "e"), |_| Ok(index)).unwrap());
        assert_eq!(
            got,
            ["config.json", "tokenizer.json", "model.safetensors.index.json", "a.safetensors", "b.safetensors"]
        );
        let single =
            names(model_files(&info(&["config.json", "model.safetensors"]), (&r, "e"), |_| unreachable!()).unwrap());
        assert_eq!(single, ["config.json", "model.safetensors"]);
        let adapter = names(model_files(&info(&ADAPTER), (&r, "e"), |_| unreachable!()).unwrap());
        assert_eq!(adapter, ADAPTER);
        let with_tokenizer = info(&["adapter_model.safetensors", "tokenizer.json", "adapter_config.json"]);
        let adapter = names(model_files(&with_tokenizer, (&r, "e"), |_| unreachable!()).unwrap());
        assert_eq!(adapter, ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json"]);
        let e = model_files(&info(&["config.json", "pytorch_model.bin"]), (&r, "e"), |_| unreachable!())
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.safetensors"), "{e}");
    }

    #[test]
    fn dataset_urls_parse_as_fsspec_writes_them() {
        let u = DatasetUrl::parse("hf://datasets/open-thoughts/OpenThoughts3-1.2M@v1/data/*.parquet").unwrap();
        assert_eq!(
            (u.id.as_str(), u.revision.as_str(), u.glob.as_str()),
            ("open-thoughts/OpenThoughts3-1.2M", "v1", "data/*.parquet")
        );
        let u = DatasetUrl::parse("hf://datasets/o/n@refs%2Fconvert%2Fparquet").unwrap();
        assert_eq!((u.revision.as_str(), u.glob.as_str()), ("refs/convert/parquet", "**"));
        assert_eq!(DatasetUrl::parse("hf://datasets/o/n").unwrap().revision, "main");
        for bad in ["hf://models/o/n", "hf://datasets/o", "hf://datasets//n/x"] {
            assert!(DatasetUrl::parse(bad).is_err(), "{bad}");
        }
        let i = info(&["data/a.parquet", "data/sub/b.parquet", "README.md", "c.jsonl"]);
        let any = |_: &str| true;
        let top = DatasetUrl::parse("hf://datasets/o/n/data/*.parquet").unwrap();
        assert_eq!(names(top.matching(&i, "e", &any).unwrap()), ["data/a.parquet"]);
        let all = DatasetUrl::parse("hf://datasets/o/n").unwrap();
        let data = |f: &str| f.ends_with(".parquet") || f.ends_with(".jsonl");
        assert_eq!(names(all.matching(&i, "e", &data).unwrap()), ["c.jsonl", "data/a.parquet", "data/sub/b.parquet"]);
        assert!(DatasetUrl::parse("hf://datasets/o/n/*.csv").unwrap().matching(&i, "e", &any).is_err());
        // configs/openthinker3.toml's form: the Parquet shards at any depth.
        let deep = DatasetUrl::parse("hf://datasets/o/n/**/*.parquet").unwrap();
        assert_eq!(names(deep.matching(&i, "e", &any).unwrap()), ["data/a.parquet", "data/sub/b.parquet"]);
    }
}
