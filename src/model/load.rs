//! Finding a model (a local folder, or a hub id through the Hugging Face cache) and loading its
//! safetensors weights, single-file or sharded; a model with its LoRA adapter, and the check that an
//! adapter is applied to the base it was trained on.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};

use super::lora::{
    adapter_shapes, base_model, is_adapter_dir, read_adapter, read_config, Adapter, LoraOptions, ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
};
use super::{config::ModelConfig, Decoder, ModelError};
use crate::device::DeviceName;

/// Resolve `model` to a folder holding config.json (or an adapter's files): a local path first, then
/// `org/name` (optionally `org/name@revision`, a branch, tag or commit hash) through the Hugging Face
/// cache, downloading the files a model needs when they are missing there ([`crate::hub`]; never with
/// `HF_HUB_OFFLINE=1`).
pub fn resolve_model_dir(model: &str) -> Result<PathBuf, ModelError> {
    let p = Path::new(model);
    if p.is_dir() {
        if !p.join("config.json").exists() {
            return Err(ModelError::Files { path: p.into(), message: "folder has no config.json".into() });
        }
        return Ok(p.to_path_buf());
    }
    if p.exists() {
        return Err(ModelError::Files { path: p.into(), message: "not a folder (give the model's folder)".into() });
    }
    if looks_local(model) {
        return Err(ModelError::Files {
            path: p.into(),
            message: "no such folder (a local path: the Hugging Face cache is not searched)".into(),
        });
    }
    match crate::hub::model_ref(model) {
        Some(repo) => Ok(crate::hub::model_snapshot(&crate::hub::Settings::from_env(), &repo)?.dir),
        None => Err(ModelError::NotFound(model.to_string(), crate::hub::cache_dir())),
    }
}

/// `model` pinned at `revision` (a branch, tag or commit): the hub id `model@revision`. Refused for a local
/// folder and for an id that already names another revision; `name` is the option that gave the revision.
pub fn with_revision(model: &str, revision: Option<&str>, name: &str) -> Result<String, ModelError> {
    let Some(rev) = revision else { return Ok(model.to_string()) };
    let bad = |message: String| Err(ModelError::Files { path: model.into(), message });
    if rev.is_empty() || rev.contains(char::is_whitespace) {
        return bad(format!("{name} = `{rev}` is not a branch, tag or commit"));
    }
    if Path::new(model).exists() || looks_local(model) || crate::hub::model_ref(model).is_none() {
        return bad(format!("{name} = `{rev}` pins a hub id's revision, but `{model}` is a local path"));
    }
    match model.split_once('@') {
        Some((_, given)) if given != rev => {
            bad(format!("{name} = `{rev}`, but the id already names revision `{given}`: give one of them"))
        }
        Some(_) => Ok(model.to_string()),
        None => Ok(format!("{model}@{rev}")),
    }
}

/// Resolve an adapter argument: an existing folder as it is, else a hub id as [`resolve_model_dir`] does.
pub fn resolve_adapter_dir(adapter: &Path) -> Result<PathBuf, ModelError> {
    match adapter.to_str() {
        Some(a) if !adapter.exists() && !looks_local(a) && crate::hub::model_ref(a).is_some() => resolve_model_dir(a),
        _ => Ok(adapter.to_path_buf()),
    }
}

/// Whether a model argument that is not an existing folder is meant as a local path rather than a hub
/// id: it starts with `.`, `/` or `~`, has more than one `/`, or its first component exists here.
pub fn looks_local(model: &str) -> bool {
    let id = model.split_once('@').map_or(model, |(id, _)| id);
    let first = id.split('/').next().unwrap_or_default();
    model.starts_with(['.', '/', '~'])
        || id.matches('/').count() > 1
        || (id.contains('/') && !first.is_empty() && Path::new(first).exists())
}

/// Open the device `name` names: the CPU, or a GPU checked for the kernels' compute capability and
/// prepared for them.
pub fn open_device(name: DeviceName) -> Result<Device, ModelError> {
    let Some(ordinal) = name.ordinal() else {
        return Ok(Device::Cpu);
    };
    if !candle_core::utils::cuda_is_available() {
        return Err(ModelError::Invalid(format!(
            "device `{name}` asked for, but this binary was built without CUDA (rebuild with `--features cuda`)"
        )));
    }
    let device = Device::new_cuda(ordinal)?;
    crate::kernels::check_capability(&device)?;
    crate::device::prepare(&device)?;
    Ok(device)
}

/// The safetensors files of a model folder: the shards named by model.safetensors.index.json, or
/// model.safetensors.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io { path: index.clone(), source })?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Files { path: index.clone(), message: e.to_string() })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::Files { path: index.clone(), message: "no `weight_map` object".into() })?;
        let mut files: Vec<PathBuf> = Vec::new();
        for f in map.values().filter_map(|f| f.as_str()) {
            let p = dir.join(f);
            if !files.contains(&p) {
                files.push(p);
            }
        }
        for f in &files {
            if !f.exists() {
                return Err(ModelError::Files {
                    path: f.clone(),
                    message: "shard named in the index is missing".into(),
                });
            }
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(ModelError::Files {
        path: dir.to_path_buf(),
        message: "no model.safetensors or model.safetensors.index.json (only safetensors weights are supported)".into(),
    })
}

/// Why the safetensors file `path` is shorter than its header says, if it is: its header (an 8-byte
/// length, then JSON giving each tensor's byte range) describes more bytes than the file holds.
fn truncated(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).ok()?;
    let size = file.metadata().ok()?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).ok()?;
    let header_len = u64::from_le_bytes(len);
    let tensors_end = if size < 8 + header_len || header_len > 100 << 20 {
        0
    } else {
        let mut header = vec![0u8; header_len as usize];
        file.read_exact(&mut header).ok()?;
        let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header).ok()?;
        let ends = header.values().filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64());
        ends.max().unwrap_or(0)
    };
    let expected = 8 + header_len + tensors_end;
    (size < expected).then(|| {
        format!(
            "the file is shorter than its header says ({size} bytes, the header describes {expected}): it is \
             truncated, or still being downloaded"
        )
    })
}

/// The tensors a safetensors file's header describes: `(name, shape)`, in header order.
fn header_tensors(path: &Path) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
    use std::io::Read;
    let bad = |message: String| ModelError::Files { path: path.to_path_buf(), message };
    let mut file = std::fs::File::open(path).map_err(|source| ModelError::Io { path: path.to_path_buf(), source })?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| bad(format!("no safetensors header ({e})")))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > 100 << 20 {
        return Err(bad(format!("a safetensors header of {header_len} bytes: not a safetensors file")));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| bad(format!("the safetensors header is cut short ({e})")))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("the safetensors header is not JSON ({e})")))?;
    let mut out = Vec::with_capacity(header.len());
    for (name, info) in header.into_iter().filter(|(n, _)| n != "__metadata__") {
        let shape = info
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|dims| dims.iter().map(|d| d.as_u64().map(|d| d as usize)).collect::<Option<Vec<usize>>>());
        match shape.flatten() {
            Some(shape) => out.push((name, shape)),
            None => return Err(bad(format!("tensor `{name}` has no shape in the header"))),
        }
    }
    Ok(out)
}

/// Tensors of a checkpoint that no model reads: the rotary frequencies older transformers saved as a
/// buffer (`...rotary_emb.inv_freq`, which transformers itself skips on load), recomputed from the config.
fn derived_buffer(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

/// A checkpoint's tensors: name, the file that holds it, and its shape.
type Found = Vec<(String, PathBuf, Vec<usize>)>;

/// The tensors of the weight files `files`, from their headers (no weight is read).
fn checkpoint_tensors(files: &[PathBuf]) -> Result<Found, ModelError> {
    let mut found = Vec::new();
    for f in files {
        found.extend(header_tensors(f)?.into_iter().map(|(n, s)| (n, f.clone(), s)));
    }
    Ok(found)
}

/// The names a model of `cfg` with another architecture, attention biases or tying would have, when
/// those are exactly `names`: what to write in config.json (`model_type = "qwen3"`, ...).
fn fitting_config(cfg: &ModelConfig, names: &std::collections::BTreeSet<&str>) -> Option<String> {
    use super::Arch;
    for arch in [Arch::Qwen2, Arch::Qwen3, Arch::Llama] {
        for attention_bias in [false, true] {
            for tie in [cfg.tie_word_embeddings, !cfg.tie_word_embeddings] {
                let mut c = cfg.clone();
                c.arch = arch;
                c.qkv_bias = arch == Arch::Qwen2 || attention_bias;
                c.o_bias = arch != Arch::Qwen2 && attention_bias;
                c.mlp_bias = arch == Arch::Llama && cfg.mlp_bias;
                c.qk_norm = arch == Arch::Qwen3;
                c.tie_word_embeddings = tie;
                let shapes = super::decoder::parameter_shapes(&c);
                if shapes.len() != names.len() || !shapes.iter().all(|(n, _)| names.contains(n.as_str())) {
                    continue;
                }
                let mut keys = Vec::new();
                if arch != cfg.arch {
                    keys.push(format!("model_type = \"{}\"", arch.model_type()));
                }
                if (c.qkv_bias, c.o_bias) != (cfg.qkv_bias, cfg.o_bias) {
                    keys.push(format!("attention_bias = {attention_bias}"));
                }
                if tie != cfg.tie_word_embeddings {
                    keys.push(format!("tie_word_embeddings = {tie}"));
                }
                return Some(keys.join(", "));
            }
        }
    }
    None
}

/// `names` for a message: the first few, and how many more.
fn some_names<'a>(names: impl ExactSizeIterator<Item = &'a str>) -> String {
    let n = names.len();
    let shown: Vec<String> = names.take(4).map(|s| format!("`{s}`")).collect();
    match n {
        0..=4 => shown.join(", "),
        _ => format!("{} and {} more", shown.join(", "), n - 4),
    }
}

/// Check that the weights of model folder `dir` (from their files' headers, without reading them) are the
/// tensors `cfg` describes: none missing, each of the shape it implies, and none left unused (an
/// architecture or bias setting in config.json that does not match the weights would otherwise load and
/// run without them). A tied model's `lm_head.weight`, which some writers save, is left to
/// [`load_decoder`], which checks that it equals the embedding. The error names the file, the tensors and,
/// when another config of the same shapes fits the weights, the keys that make it.
pub fn check_weights(dir: &Path, cfg: &ModelConfig) -> Result<(), ModelError> {
    let found = checkpoint_tensors(&weight_files(dir)?)?;
    let expected = super::decoder::parameter_shapes(cfg);
    let names: std::collections::BTreeSet<&str> =
        found.iter().map(|(n, _, _)| n.as_str()).filter(|n| !derived_buffer(n)).collect();
    let tied_head = |n: &str| cfg.tie_word_embeddings && n == "lm_head.weight";
    let fits = || {
        let without_tied: std::collections::BTreeSet<&str> = names.iter().copied().filter(|n| !tied_head(n)).collect();
        fitting_config(cfg, &names)
            .or_else(|| fitting_config(cfg, &without_tied))
            .filter(|keys| !keys.is_empty())
            .map_or(String::new(), |keys| {
                format!("; the weights fit {keys}: correct {}", dir.join("config.json").display())
            })
    };
    let described = format!("a {} model as {} describes it", cfg.arch.model_type(), dir.join("config.json").display());
    let missing: Vec<&str> = expected.iter().map(|(n, _)| n.as_str()).filter(|n| !names.contains(n)).collect();
    if !missing.is_empty() {
        return Err(ModelError::Files {
            path: dir.to_path_buf(),
            message: format!(
                "{} tensors of {described} are missing from the weights: {}{}",
                missing.len(),
                some_names(missing.into_iter()),
                fits()
            ),
        });
    }
    let wanted: std::collections::HashMap<&str, &Vec<usize>> = expected.iter().map(|(n, s)| (n.as_str(), s)).collect();
    let unused: Vec<&(String, PathBuf, Vec<usize>)> = found
        .iter()
        .filter(|(n, _, _)| !wanted.contains_key(n.as_str()) && !derived_buffer(n) && !tied_head(n))
        .collect();
    if let Some((_, file, _)) = unused.first() {
        return Err(ModelError::Files {
            path: file.clone(),
            message: format!(
                "{} tensors are not used by {described}: {}{}",
                unused.len(),
                some_names(unused.iter().map(|(n, _, _)| n.as_str())),
                fits()
            ),
        });
    }
    for (name, file, shape) in &found {
        if let Some(want) = wanted.get(name.as_str()).filter(|w| **w != shape) {
            return Err(ModelError::Files {
                path: file.clone(),
                message: format!("tensor `{name}` has shape {shape:?}, {described} implies {want:?}"),
            });
        }
    }
    Ok(())
}

/// Load the decoder of a model folder in `dtype` on `device`; `trainable` gives it `Var` parameters.
/// Every tensor of the weights must be one the config describes ([`check_weights`]).
pub fn load_decoder(dir: &Path, dtype: DType, device: &Device, trainable: bool) -> Result<Decoder, ModelError> {
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    let files = weight_files(dir)?;
    if files.iter().all(|f| truncated(f).is_none()) {
        check_weights(dir, &cfg)?;
    }
    // SAFETY: the files are memory-mapped read-only; modifying them while loading is undefined, as for
    // every safetensors loader.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }.map_err(|e| {
        match files.iter().find_map(|f| truncated(f).map(|m| (f, m))) {
            Some((f, message)) => ModelError::Files { path: f.clone(), message },
            None => ModelError::Files { path: dir.to_path_buf(), message: e.to_string() },
        }
    })?;
    if cfg.tie_word_embeddings {
        check_tied_head(dir, &st)?;
    }
    Decoder::from_tensors(
        cfg,
        |name, _| match st.load(name, &Device::Cpu) {
            Ok(t) => Ok(t),
            Err(_) => Err(ModelError::Missing(name.to_string())),
        },
        dtype,
        device,
        trainable,
    )
}

/// A tied model's weights may hold `lm_head.weight` too (some writers save both): used as the embedding
/// is, it must equal it.
fn check_tied_head(dir: &Path, st: &candle_core::safetensors::MmapedSafetensors) -> Result<(), ModelError> {
    let Ok(head) = st.load("lm_head.weight", &Device::Cpu) else { return Ok(()) };
    let embed = st.load("model.embed_tokens.weight", &Device::Cpu)?;
    let same = head.dims() == embed.dims()
        && head.dtype() == embed.dtype()
        && head.ne(&embed)?.flatten_all()?.max(0)?.to_scalar::<u8>()? == 0;
    if same {
        return Ok(());
    }
    Err(ModelError::Files {
        path: dir.join("config.json"),
        message: "tie_word_embeddings is true, but the weights hold an lm_head.weight that differs from the \
                  embedding (model.embed_tokens.weight): set tie_word_embeddings to false, or remove lm_head.weight"
            .into(),
    })
}

/// The initial value of parameter `name` in a random model: ones for norm weights, zeros for biases,
/// and `normal()` (normal(0, 0.02)) for everything else.
pub fn random_parameter(
    name: &str,
    shape: &[usize],
    device: &Device,
    normal: impl FnOnce() -> Result<Tensor, ModelError>,
) -> Result<Tensor, ModelError> {
    if name.ends_with("norm.weight") {
        Ok(Tensor::ones(shape, DType::F32, device)?)
    } else if name.ends_with(".bias") {
        Ok(Tensor::zeros(shape, DType::F32, device)?)
    } else {
        normal()
    }
}

/// A randomly initialised decoder (normal(0, 0.02) matrices, unit norms, zero biases), reproducible
/// from `seed`.
pub fn random_decoder(
    cfg: ModelConfig,
    seed: u64,
    dtype: DType,
    device: &Device,
    trainable: bool,
) -> Result<Decoder, ModelError> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    Decoder::from_tensors(
        cfg,
        |name, shape| {
            random_parameter(name, shape, &Device::Cpu, || {
                let data: Vec<f32> = (0..shape.iter().product()).map(|_| 0.02 * sample_normal(&mut rng)).collect();
                Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
            })
        },
        dtype,
        device,
        trainable,
    )
}

/// A standard normal sample by Box-Muller (keeps the dependency list short).
pub fn sample_normal(rng: &mut impl Rng) -> f32 {
    let u1: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    let u2: f64 = rng.gen();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

// LoRA: a model loaded with its adapter.

/// The model of `base_dir` (its weights frozen, in `dtype` on `device`) with the adapter of folder
/// `adapter`, trainable or frozen; `expected`: the options the adapter must have been trained with.
pub fn load_with_adapter(
    base_dir: &Path,
    adapter: &Path,
    expected: Option<&LoraOptions>,
    (dtype, device): (DType, &Device),
    trainable: bool,
) -> Result<Decoder, ModelError> {
    let a = read_adapter(adapter)?;
    if let Some(want) = expected.filter(|w| !same_adapter(w, &a.options)) {
        let (theirs, ours) = adapter_differences(&a.options, want);
        return Err(ModelError::Files {
            path: adapter.join(ADAPTER_CONFIG_FILE),
            message: format!(
                "the adapter was trained with {theirs}, the run's [model.lora] says {ours}: resume with the options \
                 that wrote it, or start a new run"
            ),
        });
    }
    let base = load_decoder(base_dir, dtype, device, false)?;
    check_adapter_tensors(&a, base.config(), base_dir)?;
    base.with_adapters(&a.options, a.tensors.into_iter().collect(), trainable)
}

/// Check that the tensors of adapter `a` are exactly those its options describe on the base model of
/// `base_dir` (config `cfg`), of the shapes that base implies: none unused, none missing. Errors name the
/// adapter's file and the base folder.
fn check_adapter_tensors(a: &Adapter, cfg: &ModelConfig, base_dir: &Path) -> Result<(), ModelError> {
    let file = a.dir.join(ADAPTER_FILE);
    let bad = |message: String| ModelError::Files { path: file.clone(), message };
    let expected = adapter_shapes(cfg, &a.options);
    let wanted: std::collections::HashMap<&str, &Vec<usize>> = expected.iter().map(|(n, s)| (n.as_str(), s)).collect();
    let mut unused: Vec<&str> = a.tensors.keys().map(String::as_str).filter(|n| !wanted.contains_key(n)).collect();
    unused.sort_unstable();
    let base = format!("the base model {} ({} layers)", base_dir.display(), cfg.num_layers);
    if !unused.is_empty() {
        return Err(bad(format!(
            "{} tensors are not adapters of the modules {ADAPTER_CONFIG_FILE} targets ({}) on {base}: {}",
            unused.len(),
            a.options.target_modules.join(", "),
            listed(&unused)
        )));
    }
    let missing: Vec<&str> = expected.iter().map(|(n, _)| n.as_str()).filter(|n| !a.tensors.contains_key(*n)).collect();
    if !missing.is_empty() {
        return Err(bad(format!(
            "{} adapters that {ADAPTER_CONFIG_FILE} describes on {base} are missing: {}",
            missing.len(),
            listed(&missing)
        )));
    }
    for (name, shape) in &expected {
        let found = a.tensors[name].dims();
        if found != shape.as_slice() {
            return Err(bad(format!(
                "adapter `{name}` has shape {found:?}, {base} implies {shape:?}: the adapter was trained on a \
                 base model of another shape"
            )));
        }
    }
    Ok(())
}

/// The first few of `names`, and how many more.
fn listed(names: &[&str]) -> String {
    let shown: Vec<String> = names.iter().take(4).map(|n| format!("`{n}`")).collect();
    match names.len() {
        0..=4 => shown.join(", "),
        n => format!("{} and {} more", shown.join(", "), n - 4),
    }
}

/// The frozen model of `dir`, with the adapter of folder `adapter` when one is given (`grpo eval`,
/// `grpo logprobs`, `grpo export`); `dir` itself may be an adapter folder, on the base model its config
/// names.
pub fn load_frozen(dir: &Path, adapter: Option<&Path>, dtype: DType, device: &Device) -> Result<Decoder, ModelError> {
    match adapter {
        Some(a) => load_with_adapter(dir, &resolve_adapter_dir(a)?, None, (dtype, device), false),
        // An adapter folder given as the model: its config names the base model.
        None if is_adapter_dir(dir) => {
            let base = base_model(dir)?;
            load_with_adapter(&resolve_model_dir(&base)?, dir, None, (dtype, device), false)
        }
        None => load_decoder(dir, dtype, device, false),
    }
}

/// Check that the base model `given` (as the command line names it; `base_dir` once resolved) is the one
/// the adapter of folder `adapter` was trained on, its config's `base_model_name_or_path`: the same name,
/// or a name that resolves here to the same folder or to a copy of the same weights, or (a name that does
/// not resolve here, such as another machine's path) the same model name. An adapter that names no base
/// is applied with a warning. The error says how to apply the adapter anyway (`allow_flag`).
pub fn check_base(adapter: &Path, given: &str, base_dir: &Path, allow_flag: &str) -> Result<(), ModelError> {
    // An adapter given by hub id is read from its snapshot (downloaded when needed).
    let adapter = &resolve_adapter_dir(adapter)?;
    let Some(named) = read_config(adapter)?.base_model_name_or_path else {
        tracing::warn!(
            "{} names no base model (base_model_name_or_path): the base {given} is not checked",
            adapter.join(ADAPTER_CONFIG_FILE).display()
        );
        return Ok(());
    };
    let same = named == given
        || match resolve_model_dir(&named) {
            Ok(dir) => same_folder(&dir, base_dir) || same_weights(&dir, base_dir),
            Err(_) => model_name(&named).is_some_and(|n| base_names(given, base_dir).contains(&n)),
        };
    if same {
        return Ok(());
    }
    Err(ModelError::Files {
        path: adapter.join(ADAPTER_CONFIG_FILE),
        message: format!(
            "the adapter was trained on the base model `{named}` (base_model_name_or_path), not on `{given}` ({}); \
             give that base model, or pass {allow_flag} to apply the adapter to this one anyway",
            base_dir.display()
        ),
    })
}

fn same_folder(a: &Path, b: &Path) -> bool {
    matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b)
}

/// Whether two model folders hold the same weights, by a cheap fingerprint: each weight file's size and the
/// SHA-256 of its first and last MiB.
fn same_weights(a: &Path, b: &Path) -> bool {
    fn fingerprint(dir: &Path) -> Option<Vec<(u64, Vec<u8>)>> {
        use sha2::Digest;
        use std::io::{Read, Seek, SeekFrom};
        let mut out = Vec::new();
        for f in weight_files(dir).ok()? {
            let mut file = std::fs::File::open(&f).ok()?;
            let size = file.metadata().ok()?.len();
            let mut hash = sha2::Sha256::new();
            let mut buf = vec![0u8; (1u64 << 20).min(size) as usize];
            file.read_exact(&mut buf).ok()?;
            hash.update(&buf);
            file.seek(SeekFrom::Start(size - buf.len() as u64)).ok()?;
            file.read_exact(&mut buf).ok()?;
            hash.update(&buf);
            out.push((size, hash.finalize().to_vec()));
        }
        Some(out)
    }
    matches!((fingerprint(a), fingerprint(b)), (Some(x), Some(y)) if x == y)
}

/// The model name in a base model's name: the last component of a path or hub id, without `@revision`,
/// in lower case.
fn model_name(name: &str) -> Option<String> {
    let id = name.split_once('@').map_or(name, |(id, _)| id);
    Path::new(id.trim_end_matches('/')).file_name().map(|n| n.to_string_lossy().to_lowercase())
}

/// The names the base model given as `given` (resolved to `dir`) goes by: its own, its folder's, and for a
/// Hugging Face cache snapshot (`models--ORG--NAME/snapshots/HASH`) the repository's.
fn base_names(given: &str, dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = model_name(given).into_iter().collect();
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    names.extend(dir.file_name().map(|n| n.to_string_lossy().to_lowercase()));
    for c in dir.components() {
        let c = c.as_os_str().to_string_lossy();
        if let Some(repo) = c.strip_prefix("models--") {
            names.extend(repo.rsplit("--").next().map(str::to_lowercase));
        }
    }
    names
}

/// Whether two options describe the same adapters (their shapes and scale; the init does not matter once
/// trained).
fn same_adapter(a: &LoraOptions, b: &LoraOptions) -> bool {
    (a.r, a.alpha, &a.target_modules) == (b.r, b.alpha, &b.target_modules)
}

/// The options in which adapters `a` and `b` differ, as `key = value` lists for `a` and for `b`.
fn adapter_differences(a: &LoraOptions, b: &LoraOptions) -> (String, String) {
    let mut sides = (Vec::new(), Vec::new());
    let mut add = |key: &str, x: String, y: String| {
        if x != y {
            sides.0.push(format!("{key} = {x}"));
            sides.1.push(format!("{key} = {y}"));
        }
    };
    add("r", a.r.to_string(), b.r.to_string());
    add("alpha", a.alpha.to_string(), b.alpha.to_string());
    add("target_modules", format!("[{}]", a.target_modules.join(", ")), format!("[{}]", b.target_modules.join(", ")));
    (sides.0.join(", "), sides.1.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_looking_paths_are_not_sent_to_the_hub_cache() {
        let dir = tempfile::tempdir().unwrap();
        let typo = format!("{}/no-such-model", dir.path().display());
        let e = resolve_model_dir(&typo).unwrap_err().to_string();
        assert!(e.contains("no such folder") && !e.contains("HF_HUB_OFFLINE"), "{e}");
        assert_eq!(e.matches("no-such-model").count(), 1, "{e}");
        for local in ["./m", "~/m", "runs/smoke/tiny-lama", "src/model"] {
            assert!(looks_local(local), "{local}");
        }
        for hub in ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B@main", "gpt2"] {
            assert!(!looks_local(hub), "{hub}");
        }
        let e = resolve_model_dir("not-an-id").unwrap_err().to_string();
        assert!(e.contains("not a hub id"), "{e}");
    }

    #[test]
    fn hub_ids_resolve_through_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("hub/models--org--tiny");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        // As huggingface_hub writes it: the commit hash, no newline.
        std::fs::write(repo.join("refs/main"), "abc123").unwrap();
        let snap = repo.join("snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        std::fs::write(snap.join("model.safetensors"), "").unwrap();
        // HF_HOME and HF_HUB_OFFLINE are process-global: this is the only test that sets them (offline: a
        // unit test never reaches the network).
        std::env::set_var("HF_HOME", dir.path());
        std::env::set_var("HF_HUB_OFFLINE", "1");
        std::env::remove_var("HF_HUB_CACHE");
        assert_eq!(resolve_model_dir("org/tiny").unwrap(), snap);
        assert_eq!(resolve_model_dir("org/tiny@abc123").unwrap(), snap);
        let err = resolve_model_dir("org/tiny@v2").unwrap_err().to_string();
        assert!(err.contains("org/tiny@v2") && err.contains("HF_HUB_OFFLINE"), "{err}");
        // $HF_HUB_CACHE comes before $HF_HOME/hub.
        let other = tempfile::tempdir().unwrap();
        std::env::set_var("HF_HUB_CACHE", other.path());
        let err = resolve_model_dir("org/tiny").unwrap_err().to_string();
        assert!(err.contains(&other.path().display().to_string()), "{err}");
        std::env::remove_var("HF_HUB_CACHE");
        let err = resolve_model_dir("org/absent").unwrap_err().to_string();
        assert!(err.contains("org/absent@main: `config.json` is not in the Hugging Face cache"), "{err}");
    }

    /// A random model of `arch` saved in `dir` (a tiny shape), with its config.json.
    fn tiny_model(arch: crate::model::Arch, dir: &Path) -> ModelConfig {
        let cfg = crate::model::tiny::TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(arch, 64, None, None)
            .unwrap();
        let model = random_decoder(cfg.clone(), 1, DType::F32, &Device::Cpu, false).unwrap();
        crate::model::save_checkpoint(&model, dir, &Default::default(), |_| Ok(())).unwrap();
        cfg
    }

    /// Replace the `model_type` (and `tie_word_embeddings`) of the config.json in `dir`.
    fn set_config(dir: &Path, model_type: &str, tie: bool) {
        let path = dir.join("config.json");
        let mut raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        raw["model_type"] = model_type.into();
        raw["tie_word_embeddings"] = tie.into();
        std::fs::write(&path, raw.to_string()).unwrap();
    }

    fn load_error(dir: &Path) -> String {
        load_decoder(dir, DType::F32, &Device::Cpu, false).err().expect("the load must fail").to_string()
    }

    #[test]
    fn weights_of_another_architecture_are_refused_naming_the_file_and_the_fitting_config() {
        let tmp = tempfile::tempdir().unwrap();
        // Qwen3 weights (q/k norms, untied) under a llama config: the norms would be ignored.
        let qwen3 = tmp.path().join("qwen3");
        tiny_model(crate::model::Arch::Qwen3, &qwen3);
        set_config(&qwen3, "llama", false);
        let e = load_error(&qwen3);
        assert!(e.contains("model.safetensors") && e.contains("4 tensors are not used by a llama model"), "{e}");
        assert!(e.contains("self_attn.q_norm.weight") && e.contains("model_type = \"qwen3\""), "{e}");
        // Llama weights (tied) under a qwen3 config: the norms and lm_head are missing.
        let llama = tmp.path().join("llama");
        tiny_model(crate::model::Arch::Llama, &llama);
        set_config(&llama, "qwen3", false);
        let e = check_weights(&llama, &ModelConfig::from_file(&llama.join("config.json")).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("5 tensors of a qwen3 model") && e.contains("missing"), "{e}");
        assert!(e.contains("model_type = \"llama\", tie_word_embeddings = true"), "{e}");
    }

    #[test]
    fn every_tensor_of_the_weights_is_used_or_the_load_fails() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        tiny_model(crate::model::Arch::Qwen2, &dir);
        let file = dir.join("model.safetensors");
        let mut tensors = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
        let original = tensors.clone();
        // The rotary buffer older transformers saved is recomputed, as transformers does.
        tensors.insert(
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            Tensor::ones(4, DType::F32, &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&tensors, &file).unwrap();
        load_decoder(&dir, DType::F32, &Device::Cpu, false).unwrap();
        tensors.insert("model.layers.0.extra.weight".into(), Tensor::ones(4, DType::F32, &Device::Cpu).unwrap());
        candle_core::safetensors::save(&tensors, &file).unwrap();
        let e = load_error(&dir);
        assert!(e.starts_with(&file.display().to_string()) && e.contains("`model.layers.0.extra.weight`"), "{e}");
        // A shape the config does not imply names the file too.
        let mut wrong = original.clone();
        wrong.insert("model.norm.weight".into(), Tensor::ones(3, DType::F32, &Device::Cpu).unwrap());
        candle_core::safetensors::save(&wrong, &file).unwrap();
        let e = load_error(&dir);
        assert!(e.contains("`model.norm.weight` has shape [3]") && e.contains("[16]"), "{e}");
        // A tied model's lm_head.weight: accepted when it is the embedding, refused when it differs.
        let mut tied = original.clone();
        let embed = tied["model.embed_tokens.weight"].clone();
        tied.insert("lm_head.weight".into(), embed.clone());
        candle_core::safetensors::save(&tied, &file).unwrap();
        set_config(&dir, "qwen2", true);
        load_decoder(&dir, DType::F32, &Device::Cpu, false).unwrap();
        tied.insert("lm_head.weight".into(), (embed + 1.0).unwrap());
        candle_core::safetensors::save(&tied, &file).unwrap();
        assert!(load_error(&dir).contains("differs from the embedding"));
    }

    #[test]
    fn the_cpu_opens_and_a_gpu_needs_a_cuda_build() {
        assert!(matches!(open_device(DeviceName::Cpu), Ok(Device::Cpu)));
        if !candle_core::utils::cuda_is_available() {
            let e = open_device(DeviceName::Cuda(Some(1))).unwrap_err().to_string();
            assert!(e.contains("`cuda:1`") && e.contains("--features cuda"), "{e}");
        }
    }
}
