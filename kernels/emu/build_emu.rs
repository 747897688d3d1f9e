//! Part of build.rs: compiles every kernels/*.cu file for the host under the CUDA emulator
//! (kernels/emu/cuda_emu.h, runtime.cpp) into a static library the tests launch kernels from
//! (src/kernels/emu.rs). Needs only a C++17 compiler; no CUDA toolkit.
//!
//! For each kernels/X.cu it generates X.cpp in OUT_DIR: the file's text (with `#line` pointing at the
//! original), `extern __shared__ T name[];` spelled `T *name = (T *)emu::dynamic_shared();` (C++ has no
//! block-scope extern static), and a table of its kernels, found from the `__global__` declarations and
//! the macro instantiations that name them. GRPO_EMU_SANITIZE=thread or =address,undefined compiles it
//! all with that sanitizer and links the sanitizer's runtime into the test binaries
//! (scripts/emu-sanitize.sh); GRPO_EMU_KERNELS=DIR takes the .cu files from DIR instead of kernels/
//! (the script's mutants), still with this folder's emulator.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

pub fn build(kernels: &Path, out: &Path) {
    println!("cargo:rerun-if-env-changed=GRPO_EMU_SANITIZE");
    println!("cargo:rerun-if-env-changed=GRPO_EMU_KERNELS");
    let emu = kernels.join("emu");
    let kernels = match std::env::var_os("GRPO_EMU_KERNELS") {
        Some(dir) if !dir.is_empty() => {
            println!("cargo:rerun-if-changed={}", PathBuf::from(&dir).display());
            PathBuf::from(dir)
        }
        _ => kernels.to_path_buf(),
    };
    let kernels = kernels.as_path();
    let dir = out.join("emu");
    std::fs::create_dir_all(&dir).expect("OUT_DIR/emu");
    // The library of the same sources, flags and compiler is kept (build.rs also reruns for other reasons).
    let env = ["GRPO_EMU_SANITIZE", "CXX", "CXXFLAGS", "TARGET", "HOST"].map(|v| std::env::var(v).unwrap_or_default());
    let stamp = (dir.join("stamp"), format!("{} {} {env:?}", fingerprint(kernels), fingerprint(&emu)));
    let sanitized = !env[0].is_empty();
    if !sanitized && out.join("libgrpo_emu.a").exists() && std::fs::read_to_string(&stamp.0).is_ok_and(|s| s == stamp.1)
    {
        link(out);
        return;
    }
    let mut sources: Vec<PathBuf> = std::fs::read_dir(kernels)
        .expect("kernels/ folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let mut build = cc::Build::new();
    build
        .cargo_metadata(false)
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .warnings(false)
        .flag("-pthread")
        .flag("-include")
        .flag(emu.join("cuda_emu.h").to_str().expect("utf-8 path"))
        .include(kernels)
        .include(emu.join("include"))
        .file(emu.join("runtime.cpp"));
    let mut stems = Vec::new();
    for src in &sources {
        let stem = src.file_stem().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(src).expect("readable .cu file");
        let wrapper = dir.join(format!("{stem}.cpp"));
        std::fs::write(&wrapper, wrapper_source(src, &stem, &text)).expect("write the emulator wrapper");
        build.file(&wrapper);
        stems.push(stem);
    }
    let registry = dir.join("registry.cpp");
    std::fs::write(&registry, registry_source(&stems)).expect("write the emulator registry");
    build.file(&registry);
    if let Ok(s) = std::env::var("GRPO_EMU_SANITIZE") {
        if !s.is_empty() {
            build.flag(format!("-fsanitize={s}")).flag("-fno-omit-frame-pointer").flag("-g");
            if s.contains("undefined") {
                build.flag("-fno-sanitize-recover=undefined");
            }
            // The runtime as a shared library (scripts/emu-sanitize.sh also preloads it, so that it comes first).
            for part in s.split(',') {
                let lib = match part {
                    "thread" => "tsan",
                    "address" => "asan",
                    "undefined" => "ubsan",
                    _ => continue,
                };
                let out = std::process::Command::new("c++").arg(format!("-print-file-name=lib{lib}.so")).output();
                let path = PathBuf::from(String::from_utf8_lossy(&out.expect("c++ runs").stdout).trim());
                println!("cargo:rustc-link-search=native={}", path.parent().expect("a library folder").display());
                println!("cargo:rustc-link-lib=dylib={lib}");
            }
        }
    }
    build.compile("grpo_emu");
    link(out);
    std::fs::write(&stamp.0, stamp.1).expect("write the emulator's stamp");
}

/// The link lines of the emulator library in `out` (the ones `cc` prints for a C++ library).
fn link(out: &Path) {
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=grpo_emu");
    println!("cargo:rustc-link-lib=stdc++");
}

/// A fingerprint of the files under `dir` (their paths and contents), for the build's stamps.
pub fn fingerprint(dir: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut files = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("a readable kernels folder").filter_map(|e| e.ok()) {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in &files {
        f.hash(&mut h);
        std::fs::read(f).expect("a readable kernel source").hash(&mut h);
    }
    format!("{:016x}:{}", h.finish(), files.len())
}

fn wrapper_source(src: &Path, stem: &str, text: &str) -> String {
    let kernels = kernel_names(text);
    assert!(!kernels.is_empty(), "no __global__ kernel found in {}", src.display());
    let mut s = format!("#line 1 \"{}\"\n{}\n", src.display(), dynamic_shared(text));
    s.push_str("static const emu::Entry grpo_emu_entries[] = {\n");
    for k in &kernels {
        let _ = writeln!(s, "    EMU_KERNEL({k}),");
    }
    let _ = writeln!(
        s,
        "}};\nextern \"C\" const emu::Entry *grpo_emu_table_{stem}(size_t *n) {{\n    *n = {};\n    return \
         grpo_emu_entries;\n}}",
        kernels.len()
    );
    s
}

fn registry_source(stems: &[String]) -> String {
    let mut s = String::new();
    for stem in stems {
        let _ = writeln!(s, "extern \"C\" const emu::Entry *grpo_emu_table_{stem}(size_t *n);");
    }
    s.push_str("#include <mutex>\nnamespace emu {\n");
    let _ = writeln!(
        s,
        "std::mutex &module_mutex(size_t module) {{\n    static std::mutex m[{}];\n    return m[module];\n}}",
        stems.len()
    );
    s.push_str("const Entry *find_kernel(const char *name, size_t *module) {\n");
    s.push_str("    typedef const Entry *(*Table)(size_t *);\n    static const Table tables[] = {");
    for stem in stems {
        let _ = write!(s, "grpo_emu_table_{stem}, ");
    }
    s.push_str(
        "};\n    for (size_t m = 0; m < sizeof tables / sizeof tables[0]; ++m) {\n        size_t n = 0;\n        \
         const Entry *e = tables[m](&n);\n        for (size_t i = 0; i < n; ++i)\n            if (std::strcmp(e[i].name, \
         name) == 0) {\n                *module = m;\n                return &e[i];\n            }\n    }\n    \
         return nullptr;\n}\n}  // namespace emu\n",
    );
    s
}

/// `extern __shared__ T name[];` as `T *name = (T *)emu::dynamic_shared();`.
fn dynamic_shared(text: &str) -> String {
    const KEY: &str = "extern __shared__";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(KEY) {
        out.push_str(&rest[..at]);
        let end = rest[at..].find(';').expect("extern __shared__ declaration ends with ;") + at;
        let decl = rest[at + KEY.len()..end].trim();
        let decl = decl.strip_suffix("[]").unwrap_or_else(|| panic!("extern __shared__ {decl}: expected T name[]"));
        let split = decl.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).expect("a type and a name");
        let (ty, name) = (decl[..=split].trim(), &decl[split + 1..]);
        let _ = write!(out, "{ty} *{name} = ({ty} *)emu::dynamic_shared()");
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// The kernels a .cu file defines: each `__global__` function, and for one declared in a macro
/// (`name_##P(` in `#define M(P, ...)`), each instantiation `M(x, ...)` at the top level (`name_x`).
fn kernel_names(text: &str) -> Vec<String> {
    let joined = text.replace("\\\n", " ");
    let mut templates: Vec<(String, Vec<String>)> = Vec::new(); // macro -> kernel name patterns
    let mut names = Vec::new();
    for line in joined.lines() {
        let line = line.trim();
        let globals = global_names(line);
        if let Some(def) = line.strip_prefix("#define ") {
            if !globals.is_empty() {
                let macro_name = def[..def.find('(').unwrap_or(def.len())].trim().to_string();
                templates.push((macro_name, globals));
            }
            continue;
        }
        names.extend(globals.into_iter().filter(|g| !g.contains("##")));
        for (m, patterns) in &templates {
            if let Some(args) = line.strip_prefix(m.as_str()).and_then(|r| r.strip_prefix('(')) {
                let param = args.split(',').next().unwrap_or("").trim();
                for p in patterns {
                    let name = p.split("##").collect::<Vec<_>>();
                    names.push(format!("{}{param}", name[0]));
                }
            }
        }
    }
    names
}

/// Names of the functions declared `__global__` on one (joined) line.
fn global_names(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("__global__") {
        rest = rest[at + "__global__".len()..].trim_start();
        rest = rest.strip_prefix("void").unwrap_or(rest).trim_start();
        if let Some(r) = rest.strip_prefix("__launch_bounds__") {
            rest = &r[r.find(')').map_or(0, |i| i + 1)..];
            rest = rest.trim_start();
        }
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '#')).unwrap_or(rest.len());
        out.push(rest[..end].to_string());
        rest = &rest[end..];
    }
    out
}
