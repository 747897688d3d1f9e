//! Always compiles kernels/*.cu for the host under the CUDA emulator (kernels/emu/build_emu.rs), which
//! the tests launch the kernels on. With the `cuda` feature, also compiles kernels/*.cu to PTX in OUT_DIR with nvcc; without it, does nothing
//! (the default build needs no CUDA toolkit).
//!
//! nvcc is taken from $CUDA_HOME/bin (or $CUDA_ROOT/bin, else PATH); the PTX targets compute capability
//! $CUDA_COMPUTE_CAP (default 80: PTX for 8.0 is JIT-compiled by the driver on 8.x and 9.x cards), but
//! kernels/flash_wgmma.cu's targets sm_90a (its wgmma exists there only; loaded on 9.0 cards only).

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "kernels/emu/build_emu.rs"]
mod emu;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_ROOT");
    commit();
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let kernels = PathBuf::from("kernels").canonicalize().expect("kernels/ folder");
    emu::build(&kernels, &out);
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    ptx(&kernels, &out);
}

/// `GRPO_COMMIT` for `grpo --version` and the run logs: the commit of a release build (`cargo build
/// --release`, the `profiling` profile), from git, with "+changes" when tracked files differ from it;
/// empty for a debug build (the tests') and where git or the repository is missing (a packaged source).
/// A release build is redone after each commit (the script watches git's refs); a debug build never is
/// for that, so that committing does not recompile the tests.
fn commit() {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    let commit = if release { git(&["rev-parse", "--short=12", "HEAD"]) } else { None };
    let Some(commit) = commit else {
        println!("cargo:rustc-env=GRPO_COMMIT=");
        return;
    };
    // HEAD, the branch it names and the packed refs: what a commit, checkout or pull rewrites; and the
    // sources, for "+changes" (the crate is rebuilt when they change anyway; kernels/ is watched above).
    for dir in [git(&["rev-parse", "--git-dir"]), git(&["rev-parse", "--git-common-dir"])].into_iter().flatten() {
        let dir = PathBuf::from(dir);
        let branch = git(&["symbolic-ref", "-q", "HEAD"]).map(|r| dir.join(r));
        for p in [Some(dir.join("HEAD")), Some(dir.join("packed-refs")), branch].into_iter().flatten() {
            if p.exists() {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
    for p in ["src", "Cargo.toml"] {
        println!("cargo:rerun-if-changed={p}");
    }
    let status = ["status", "--porcelain", "--untracked-files=no", "--", "src", "kernels", "build.rs", "Cargo.toml"];
    let changed = git(&status).is_some_and(|s| !s.is_empty());
    let date = git(&["log", "-1", "--format=%cs"]).unwrap_or_default();
    println!("cargo:rustc-env=GRPO_COMMIT={commit}{} {date}", if changed { "+changes" } else { "" });
}

/// Compile each kernels/*.cu to PTX in `out` with nvcc (see the top of this file); skipped when the
/// kernels and the target are those of the PTX already there.
fn ptx(kernels: &Path, out: &Path) {
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(|c| c.is_ascii_digit()).collect();
    // The kernels use bf16 arithmetic: compute capability 8.0 and up (docs/cuda.md).
    assert!(
        cap.parse::<u32>().is_ok_and(|c| c >= 80),
        "CUDA_COMPUTE_CAP={cap}: the kernels need compute capability 8.0 or newer (80, 86, 89, 90, ...)"
    );
    let nvcc = ["CUDA_HOME", "CUDA_ROOT"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|d| PathBuf::from(d).join("bin").join("nvcc"))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let stamp = out.join("ptx.stamp");
    let fingerprint = format!("{} {cap} {}", emu::fingerprint(kernels), nvcc.display());
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == fingerprint) {
        return;
    }
    let mut sources: Vec<PathBuf> = std::fs::read_dir(kernels)
        .expect("kernels/ folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    for src in sources {
        let stem = src.file_stem().unwrap().to_string_lossy().into_owned();
        let ptx = out.join(format!("{stem}.ptx"));
        // The warpgroup kernels' wgmma exists on sm_90a only: their PTX targets it whatever the rest's.
        let arch = if stem == "flash_wgmma" { "90a".to_string() } else { cap.clone() };
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=compute_{arch}"), "-o"])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {} ({e}): the `cuda` feature needs the CUDA toolkit; set CUDA_HOME or \
                     `source ../shared/scripts/cuda-toolchain.sh`",
                    nvcc.display()
                )
            });
        assert!(status.success(), "nvcc failed on {} ({status})", src.display());
    }
    std::fs::write(&stamp, fingerprint).expect("write OUT_DIR/ptx.stamp");
}
