//! Finding a model (a local folder, or a hub id through the Hugging Face cache) and loading its
//! safetensors weights, single-file or sharded.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};

use super::{config::ModelConfig, Decoder, ModelError};

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

/// `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device, ModelError> {
    match s {
        "cpu" => Ok(Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let ordinal = match s.strip_prefix("cuda:") {
                Some(n) => {
                    n.parse::<usize>().map_err(|_| ModelError::Invalid(format!("bad device `{s}`: expected cuda:N")))?
                }
                None => 0,
            };
            if !candle_core::utils::cuda_is_available() {
                return Err(ModelError::Invalid(format!(
                    "device `{s}` asked for, but this binary was built without CUDA (rebuild with `--features cuda`)"
                )));
            }
            let device = Device::new_cuda(ordinal)?;
            crate::kernels::check_capability(&device)?;
            crate::device::prepare(&device)?;
            Ok(device)
        }
        other => Err(ModelError::Invalid(format!("unknown device `{other}` (expected cpu, cuda or cuda:N)"))),
    }
}

/// `f32`, `bf16` or `f16`.
pub fn parse_dtype(s: &str) -> Result<DType, ModelError> {
    match s {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        other => Err(ModelError::Invalid(format!("unknown dtype `{other}` (expected f32, bf16 or f16)"))),
    }
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

/// Load the decoder of a model folder in `dtype` on `device`; `trainable` gives it `Var` parameters.
pub fn load_decoder(dir: &Path, dtype: DType, device: &Device, trainable: bool) -> Result<Decoder, ModelError> {
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    let files = weight_files(dir)?;
    // SAFETY: the files are memory-mapped read-only; modifying them while loading is undefined, as for
    // every safetensors loader.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }.map_err(|e| {
        match files.iter().find_map(|f| truncated(f).map(|m| (f, m))) {
            Some((f, message)) => ModelError::Files { path: f.clone(), message },
            None => ModelError::Files { path: dir.to_path_buf(), message: e.to_string() },
        }
    })?;
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

    #[test]
    fn devices_and_dtypes_parse() {
        assert!(matches!(parse_device("cpu"), Ok(Device::Cpu)));
        assert!(parse_device("tpu").is_err());
        assert_eq!(parse_dtype("bf16").unwrap(), DType::BF16);
        assert!(parse_dtype("f8").is_err());
    }
}
