//! Checkpoints in Hugging Face format: config.json, model.safetensors (or shards with an index) and the
//! tokenizer files, written into a temporary folder and swapped into place ([`crate::fsio`]), so a crash
//! never leaves a half-written checkpoint under the final name.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::{Decoder, ModelError};
use crate::fsio;

/// Files copied from the tokenizer folder when present.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
];

/// How to write a checkpoint.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// Weight dtype on disk (default: the model's).
    pub dtype: Option<DType>,
    /// Shard above this many bytes (default 5 GB, as transformers).
    pub max_shard_bytes: usize,
    /// Copy tokenizer files from this folder.
    pub tokenizer_dir: Option<PathBuf>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self { dtype: None, max_shard_bytes: 5_000_000_000, tokenizer_dir: None }
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io { path: path.to_path_buf(), source }
}

/// Write `model` to `out` atomically. `extra` may add files (optimiser state, trainer state) to the
/// temporary folder before it is renamed; an error anywhere leaves a previous `out` untouched.
pub fn save_checkpoint(
    model: &Decoder,
    out: &Path,
    opts: &SaveOptions,
    extra: impl FnOnce(&Path) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    if out.file_name().is_none() {
        return Err(ModelError::Invalid(format!("bad checkpoint path {}", out.display())));
    }
    let tmp = fsio::temp_dir(out).map_err(io(out))?;
    // An error drops `tmp`, which removes it.
    write_into(model, tmp.path(), opts)?;
    extra(tmp.path())?;
    fsio::persist_dir(tmp, out).map_err(io(out))
}

fn write_into(model: &Decoder, dir: &Path, opts: &SaveOptions) -> Result<(), ModelError> {
    let dtype = opts.dtype.unwrap_or(model.dtype());
    let mut config = model.config().raw.clone();
    config["torch_dtype"] = dtype_name(dtype).into();
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&config).unwrap_or_default()).map_err(io(&cfg_path))?;

    let tensors: Vec<(String, Tensor)> = model
        .named_tensors()
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(dtype)?.to_device(&Device::Cpu)?)))
        .collect::<Result<_, candle_core::Error>>()?;
    // Greedy split into shards under the size limit, in parameter order.
    let mut shards: Vec<Vec<(String, Tensor)>> = vec![vec![]];
    let mut size = 0usize;
    let mut total = 0usize;
    for (n, t) in tensors {
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        if size > 0 && size + bytes > opts.max_shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        size += bytes;
        total += bytes;
        shards.last_mut().expect("at least one shard").push((n, t));
    }
    let metadata = Some(std::collections::HashMap::from([("format".to_string(), "pt".to_string())]));
    let count = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = if count == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, count)
        };
        let path = dir.join(&file);
        let views: Vec<(&str, &Tensor)> = shard.iter().map(|(n, t)| (n.as_str(), t)).collect();
        safetensors::serialize_to_file(views, metadata.clone(), &path)
            .map_err(|e| ModelError::Files { path: path.clone(), message: e.to_string() })?;
        for (n, _) in shard {
            weight_map.insert(n.clone(), file.clone().into());
        }
    }
    if count > 1 {
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let p = dir.join("model.safetensors.index.json");
        std::fs::write(&p, serde_json::to_string_pretty(&index).unwrap_or_default()).map_err(io(&p))?;
    }
    if let Some(src) = &opts.tokenizer_dir {
        for f in TOKENIZER_FILES {
            let from = src.join(f);
            if from.exists() {
                std::fs::copy(&from, dir.join(f)).map_err(io(&from))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{load_decoder, random_decoder, Arch, ModelConfig, Targets, TokenBatch};

    fn model(arch: Arch) -> Decoder {
        let cfg = ModelConfig::tiny(arch, 64, 2, 16, 4, 2, 24, None, None).unwrap();
        random_decoder(cfg, 1, DType::F32, &Device::Cpu, true).unwrap()
    }

    fn logprobs(m: &Decoder) -> Vec<f32> {
        let b = TokenBatch::padded(&[vec![1, 5, 9, 33, 2, 60]], 0);
        let mut t = Targets::default();
        (1..6).for_each(|p| t.push(0, p));
        m.token_logprobs(&b, &t, false).unwrap().narrow(1, 0, 1).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn saved_checkpoints_load_back_identically_single_and_sharded() {
        for (arch, shard) in [(Arch::Qwen3, usize::MAX), (Arch::Qwen2, 20_000), (Arch::Llama, 5_000)] {
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("ckpt");
            let m = model(arch);
            let opts = SaveOptions { max_shard_bytes: shard, ..Default::default() };
            save_checkpoint(&m, &out, &opts, |_| Ok(())).unwrap();
            let sharded = out.join("model.safetensors.index.json").exists();
            assert_eq!(sharded, shard != usize::MAX, "{arch:?}");
            let back = load_decoder(&out, DType::F32, &Device::Cpu, false).unwrap();
            assert_eq!(logprobs(&m), logprobs(&back), "{arch:?}");
            let cfg: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
            assert_eq!(cfg["torch_dtype"], "float32");
            // Readable by others, like a folder that transformers writes (not tempfile's private 0700).
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&out), 0o755, "{arch:?}");
            assert_eq!(mode(&out.join("config.json")) & 0o644, 0o644, "{arch:?}");
        }
    }

    #[test]
    fn a_failed_write_leaves_the_previous_checkpoint_intact() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ckpt");
        let m = model(Arch::Qwen3);
        save_checkpoint(&m, &out, &SaveOptions::default(), |d| {
            std::fs::write(d.join("marker"), "first").map_err(|source| ModelError::Io { path: d.into(), source })
        })
        .unwrap();
        let before = std::fs::read(out.join("model.safetensors")).unwrap();
        // Change the weights, then crash after the weights are written but before the folder is complete.
        for v in m.vars() {
            v.set(&(v.as_tensor() * 2.0).unwrap()).unwrap();
        }
        let err = save_checkpoint(&m, &out, &SaveOptions { max_shard_bytes: 10_000, ..Default::default() }, |_| {
            Err(ModelError::Invalid("simulated crash".into()))
        })
        .unwrap_err();
        assert!(err.to_string().contains("simulated crash"));
        assert_eq!(std::fs::read(out.join("model.safetensors")).unwrap(), before);
        assert_eq!(std::fs::read_to_string(out.join("marker")).unwrap(), "first");
        assert!(!out.join("model.safetensors.index.json").exists());
        // No temporary folder is left behind.
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["ckpt".to_string()]);
    }

    #[test]
    fn bf16_checkpoints_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ckpt");
        let m = model(Arch::Qwen2);
        save_checkpoint(&m, &out, &SaveOptions { dtype: Some(DType::BF16), ..Default::default() }, |_| Ok(())).unwrap();
        let back = load_decoder(&out, DType::BF16, &Device::Cpu, false).unwrap();
        let (a, b) = (logprobs(&m), logprobs(&back));
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 0.05, "bf16 round trip differs by {d}");
    }
}
