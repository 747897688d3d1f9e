//! Always compiles kernels/*.cu for the host under the CUDA emulator (kernels/emu/build_emu.rs), which
//! the tests launch the kernels on. With the `cuda` feature, also compiles kernels/*.cu to PTX in OUT_DIR with nvcc; without it, does nothing
//! (the default build needs no CUDA toolkit).
//!
//! nvcc is taken from $CUDA_HOME/bin (or $CUDA_ROOT/bin, else PATH); the PTX targets compute capability
//! $CUDA_COMPUTE_CAP (default 80: PTX for 8.0 is JIT-compiled by the driver on 8.x and 9.x cards), but
//! kernels/flash_wgmma.cu's targets sm_90a (its wgmma exists there only; loaded on 9.0 cards only).

use std::path::PathBuf;
use std::process::Command;

#[path = "kernels/emu/build_emu.rs"]
mod emu;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_ROOT");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    emu::build(&PathBuf::from("kernels").canonicalize().expect("kernels/ folder"), &out);
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
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
    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
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
}
