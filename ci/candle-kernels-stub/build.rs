//! Build script of the stand-in for candle-kernels used by the CUDA type-check of CI
//! (scripts/gpu/cuda-typecheck.sh): the crate is candle-kernels' own sources with this build script in
//! place of theirs, which compiles every kernel to PTX with nvcc (most of a cold CUDA build). Here each
//! PTX constant is an empty string and no static library is built: enough for `cargo check`, which
//! neither links nor runs anything. Never use it for a build.

use std::fmt::Write;
use std::path::PathBuf;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    // The same constants as candle-kernels' build (cudaforge's `PtxOutput::write`): one per
    // src/*.cu, bar the statically compiled ones.
    let mut stems: Vec<String> = std::fs::read_dir("src")
        .expect("src/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .filter(|s| !(s.starts_with("moe_") || s.starts_with("mmq_") || s == "mmvq_gguf"))
        .collect();
    stems.sort();
    let mut rs = String::new();
    for s in &stems {
        writeln!(rs, "pub const {}: &str = \"\";", s.to_uppercase().replace(['.', '-'], "_")).unwrap();
    }
    std::fs::write(out.join("ptx.rs"), rs).expect("write ptx.rs");
}
