//! Every shipped config resolves (`grpo train --check` prints the config as the run will use it) to the
//! text committed in tests/fixtures/configs/resolved: a change of how options are parsed or defaulted that
//! changes what a shipped config means shows up here. After a change meant to alter a config, write the
//! fixtures again with `scripts/resolved-configs.sh`.

mod common;

use std::path::{Path, PathBuf};

/// The shipped training configs (configs/, its model configs and device files aside), sorted.
fn shipped(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() && p.file_name().is_some_and(|n| n != "models" && n != "devices") {
            shipped(&p, out);
        } else if p.extension().is_some_and(|e| e == "toml") {
            out.push(p);
        }
    }
}

/// The fixture of `config`: its path under configs/ with `/` as `_`.
fn fixture(config: &Path) -> PathBuf {
    let rel = config.strip_prefix("configs").unwrap().to_string_lossy().replace('/', "_");
    Path::new("tests/fixtures/configs/resolved").join(rel)
}

#[test]
fn every_shipped_config_resolves_as_committed() {
    let mut configs = Vec::new();
    shipped(Path::new("configs"), &mut configs);
    assert!(configs.len() >= 10, "{configs:?}");
    for config in &configs {
        let out = common::grpo().args(["train", "--check", "--config"]).arg(config).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: {stderr}", config.display());
        let want = std::fs::read_to_string(fixture(config)).unwrap_or_else(|e| {
            panic!("{}: {e} (write it with scripts/resolved-configs.sh)", fixture(config).display())
        });
        let got = String::from_utf8(out.stdout).unwrap();
        assert!(got == want, "{} resolves otherwise than committed:\n{got}", config.display());
    }
    let fixtures = std::fs::read_dir("tests/fixtures/configs/resolved").unwrap().count();
    assert_eq!(fixtures, configs.len(), "a fixture without its config in configs/");
}
