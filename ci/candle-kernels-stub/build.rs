//! Build script of the stand-in for candle-kernels used by CI's CUDA type-check and link check
//! (scripts/gpu/cuda-typecheck.sh, scripts/gpu/link-check.sh): the crate is candle-kernels' own sources
//! with this build script in place of theirs, which compiles every kernel with nvcc (most of a cold CUDA
//! build: 43 min on 2 cores). Here
//! - each PTX constant is an empty string (a kernel loaded from it fails on a GPU);
//! - the statically compiled kernels (`moe_*`, `mmq_*`, `mmvq_gguf`: the functions src/ffi.rs declares)
//!   are C functions that say they are stubs and abort, in a static library `moe` as candle-kernels'
//!   own, and like the host code nvcc makes for those kernels they refer to the CUDA runtime, so that the
//!   binary links the same libraries as a real build (`cudart` and `stdc++`, as candle-kernels asks).
//!
//! Enough to type-check and to link the `cuda` build and to start it on the CPU; never ship or run on a
//! GPU what it builds (scripts/gpu/pack.sh builds with the real candle-kernels).

use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/ffi.rs");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    write_ptx_constants(&out);
    build_static_stubs(&out);
    println!("cargo:rustc-link-search={}", out.display());
    println!("cargo:rustc-link-lib=moe");
    println!("cargo:rustc-link-lib=dylib=cudart");
    println!("cargo:rustc-link-lib=stdc++");
}

/// The same constants as candle-kernels' build (cudaforge's `PtxOutput::write`): one per src/*.cu, bar
/// the statically compiled ones.
fn write_ptx_constants(out: &Path) {
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

/// The names of the functions src/ffi.rs declares (`pub fn NAME(` inside its `extern "C"` blocks).
fn ffi_functions() -> Vec<String> {
    let ffi = std::fs::read_to_string("src/ffi.rs").expect("src/ffi.rs");
    let mut names: Vec<String> = ffi
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("pub fn "))
        .filter_map(|rest| rest.split('(').next())
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    names.sort();
    names.dedup();
    assert!(!names.is_empty(), "no `pub fn` in src/ffi.rs: candle-kernels changed its interface");
    names
}

/// `libmoe.a` in `out`: one aborting C function per name of [`ffi_functions`], and a constructor that
/// takes the address of a CUDA runtime function (without calling it), as nvcc's host code registers its
/// kernels with the runtime when the program starts: the binary needs `libcudart` as a real build does.
fn build_static_stubs(out: &Path) {
    let mut c = String::from(
        "#include <stdio.h>\n#include <stdlib.h>\nextern int cudaGetLastError(void);\n\
         void *volatile candle_kernels_stub_runtime;\n\
         __attribute__((constructor)) static void candle_kernels_stub_init(void) {\n\
         \x20 candle_kernels_stub_runtime = (void *)&cudaGetLastError;\n}\n\
         static void stub(const char *name) {\n\
         \x20 fprintf(stderr, \"candle-kernels stub: %s called; this binary was built for CI's link check \
         (scripts/gpu/link-check.sh) and has no CUDA kernels\\n\", name);\n  abort();\n}\n",
    );
    for name in ffi_functions() {
        writeln!(c, "void {name}(void) {{ stub(\"{name}\"); }}").unwrap();
    }
    let src = out.join("candle_kernels_stub.c");
    let obj = out.join("candle_kernels_stub.o");
    let lib = out.join("libmoe.a");
    std::fs::write(&src, c).expect("write the stubs' C source");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    run(Command::new(cc).args(["-c", "-fPIC", "-O1", "-o"]).arg(&obj).arg(&src));
    let _ = std::fs::remove_file(&lib);
    let ar = std::env::var("AR").unwrap_or_else(|_| "ar".to_owned());
    run(Command::new(ar).arg("crs").arg(&lib).arg(&obj));
}

fn run(cmd: &mut Command) {
    let status = cmd.status().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(status.success(), "{cmd:?} failed: {status}");
}
