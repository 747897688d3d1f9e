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
    /// A LoRA model's base model, as its adapter config names it (`base_model_name_or_path`).
    pub base_model: Option<String>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self { dtype: None, max_shard_bytes: 5_000_000_000, tokenizer_dir: None, base_model: None }
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

/// Write `model` to `out` atomically (a LoRA model: its adapter in PEFT's format, [`super::lora`]). `extra` may add files (optimiser state, trainer state) to the
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

/// Whether `name` is one of the temporary folders that [`save_checkpoint`] (see [`fsio::leftover`]) and
/// [`remove_checkpoint`] (`.NAME.del-PID`, being deleted) make next to a checkpoint.
pub fn is_temp_name(name: &str) -> bool {
    fsio::leftover(name).is_some() || (name.starts_with('.') && name.contains(".del-"))
}

/// Delete the checkpoint folder `dir` so that a kill never leaves a half-deleted folder under its name: it is
/// renamed to `.NAME.del-PID` first, then removed.
pub fn remove_checkpoint(dir: &Path) -> Result<(), ModelError> {
    let name = dir.file_name().ok_or_else(|| ModelError::Invalid(format!("bad checkpoint path {}", dir.display())))?;
    let doomed = dir.with_file_name(format!(".{}.del-{}", name.to_string_lossy(), std::process::id()));
    std::fs::rename(dir, &doomed).map_err(io(dir))?;
    std::fs::remove_dir_all(&doomed).map_err(io(&doomed))
}

/// Clean the temporary files and folders that a killed [`save_checkpoint`], [`remove_checkpoint`] or atomic
/// write ([`fsio::leftover`]: `latest`'s, a staging folder's) left in `parent` (those whose name `which`
/// accepts), returning what was removed. A checkpoint whose swap was cut short (its name missing, its
/// previous version still moved aside) gets the previous version back. A leftover that cannot be removed
/// yet (NFS's `.nfsXXXX` files while a reader holds one open) is a warning, tried again at the next start
/// and after each save: it never stops a run. Call it only while no other process writes checkpoints into
/// `parent`.
pub fn remove_leftovers(parent: &Path, which: impl Fn(&str) -> bool) -> Result<Vec<PathBuf>, ModelError> {
    remove_leftovers_with(parent, which, |p, is_dir| match is_dir {
        true => std::fs::remove_dir_all(p),
        false => std::fs::remove_file(p),
    })
}

/// [`remove_leftovers`], removing each leftover with `remove(path, is_dir)`.
fn remove_leftovers_with(
    parent: &Path,
    which: impl Fn(&str) -> bool,
    remove: impl Fn(&Path, bool) -> std::io::Result<()>,
) -> Result<Vec<PathBuf>, ModelError> {
    let Ok(entries) = std::fs::read_dir(parent) else { return Ok(Vec::new()) };
    let mut removed = Vec::new();
    for entry in entries {
        let p = entry.map_err(io(parent))?.path();
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if !is_temp_name(&name) || !which(&name) {
            continue;
        }
        let is_dir = p.is_dir();
        if let (true, Some(fsio::Leftover::Aside { target })) = (is_dir, fsio::leftover(&name)) {
            let target = parent.join(target);
            if !target.exists() {
                std::fs::rename(&p, &target).map_err(io(&p))?;
                tracing::warn!("restored {} from an interrupted replacement", target.display());
                continue;
            }
        }
        match remove(&p, is_dir) {
            Ok(()) => removed.push(p),
            Err(e) => tracing::warn!(
                "cannot remove {} (left by an interrupted save or removal) yet: {e}; tried again at the next start",
                p.display()
            ),
        }
    }
    Ok(removed)
}

fn write_into(model: &Decoder, dir: &Path, opts: &SaveOptions) -> Result<(), ModelError> {
    let dtype = opts.dtype.unwrap_or(model.dtype());
    // Rotary settings in both layouts, so that transformers 4 and 5 load the same model.
    let config = model.config().hf_json(dtype_name(dtype));
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&config).unwrap_or_default()).map_err(io(&cfg_path))?;
    if let Some(lora) = model.lora() {
        // The adapter only (PEFT's files), beside the base model's config and tokenizer.
        super::lora::write_adapter(dir, lora, opts.base_model.as_deref(), model.adapter_tensors())?;
        return copy_tokenizer(dir, opts);
    }

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
    let mut weight_map = std::collections::BTreeMap::new();
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
            weight_map.insert(n.clone(), file.clone());
        }
    }
    if count > 1 {
        let index = SafetensorsIndex { metadata: IndexMetadata { total_size: total }, weight_map };
        let p = dir.join("model.safetensors.index.json");
        std::fs::write(&p, serde_json::to_string_pretty(&index).unwrap_or_default()).map_err(io(&p))?;
    }
    copy_tokenizer(dir, opts)
}

/// `model.safetensors.index.json` of a sharded checkpoint, as transformers writes it: the weights' total
/// bytes, and each tensor's shard (by name, sorted).
#[derive(serde::Serialize)]
struct SafetensorsIndex {
    metadata: IndexMetadata,
    weight_map: std::collections::BTreeMap<String, String>,
}

#[derive(serde::Serialize)]
struct IndexMetadata {
    total_size: usize,
}

/// Copy the tokenizer files of `opts.tokenizer_dir` into `dir`.
fn copy_tokenizer(dir: &Path, opts: &SaveOptions) -> Result<(), ModelError> {
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
    use crate::model::tiny::TinyShape;
    use crate::model::{load_decoder, random_decoder, Arch, ModelConfig, Targets, TokenBatch};

    fn model(arch: Arch) -> Decoder {
        let cfg = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(arch, 64, None, None)
            .unwrap();
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
            assert_eq!(mode(&out), 0o777 & !umask(), "{arch:?}");
            assert_eq!(mode(&out.join("config.json")), 0o666 & !umask(), "{arch:?}");
        }
    }

    /// The process umask (from /proc, without changing it).
    fn umask() -> u32 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Umask:")).unwrap();
        u32::from_str_radix(line.split_whitespace().nth(1).unwrap(), 8).unwrap()
    }

    #[test]
    fn checkpoints_have_the_usual_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ckpt");
        save_checkpoint(&model(Arch::Llama), &out, &SaveOptions::default(), |_| Ok(())).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&out), 0o777 & !umask(), "folder");
        for f in ["config.json", "model.safetensors"] {
            assert_eq!(mode(&out.join(f)), 0o666 & !umask(), "{f}");
        }
    }

    #[test]
    fn transformers_5_configs_are_written_for_transformers_4_too() {
        // A config in transformers 5's layout: no top-level rope_theta, the dtype under `dtype`.
        let mut raw = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Llama, 64, None, None)
            .unwrap()
            .raw;
        let obj = raw.as_object_mut().unwrap();
        obj.remove("rope_theta");
        obj.remove("torch_dtype");
        raw["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 12345.0});
        raw["dtype"] = "bfloat16".into();
        let cfg = ModelConfig::from_json(raw, Path::new("tf5.json")).unwrap();
        assert_eq!(cfg.rope_theta, 12345.0);
        let m = random_decoder(cfg, 1, DType::F32, &Device::Cpu, false).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ckpt");
        save_checkpoint(&m, &out, &SaveOptions::default(), |_| Ok(())).unwrap();
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(written["rope_theta"], 12345.0);
        assert_eq!(written["rope_scaling"], serde_json::Value::Null);
        assert_eq!(written["rope_parameters"], serde_json::json!({"rope_type": "default", "rope_theta": 12345.0}));
        assert_eq!((&written["torch_dtype"], &written["dtype"]), (&"float32".into(), &"float32".into()));
        let back = load_decoder(&out, DType::F32, &Device::Cpu, false).unwrap();
        assert_eq!(back.config().rope_theta, 12345.0);
        assert_eq!(logprobs(&m), logprobs(&back));
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
    fn leftovers_of_a_killed_save_or_delete_are_recognised_and_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("step-00000002");
        let m = model(Arch::Qwen3);
        // The folder save_checkpoint writes into is one that remove_leftovers recognises.
        let mut tmp_name = String::new();
        save_checkpoint(&m, &out, &SaveOptions::default(), |d| {
            tmp_name = d.file_name().unwrap().to_string_lossy().into_owned();
            Ok(())
        })
        .unwrap();
        assert!(is_temp_name(&tmp_name), "{tmp_name}");
        for keep in ["step-00000002", "best", "latest", ".hidden", "step-1.tmp", ".step-1.old-3"] {
            assert!(!is_temp_name(keep), "{keep}");
        }
        // A kill during a write, during a delete, and between the two renames of a replacement.
        std::fs::create_dir_all(dir.path().join(&tmp_name)).unwrap();
        std::fs::create_dir_all(dir.path().join(".step-00000001.del-77/sub")).unwrap();
        std::fs::rename(&out, dir.path().join(".step-00000002.Ab12Cd.tmp.old")).unwrap();
        let removed = remove_leftovers(dir.path(), |_| true).unwrap();
        assert_eq!(removed.len(), 2, "{removed:?}");
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["step-00000002".to_string()]);
        assert!(out.join("model.safetensors").exists());
        remove_checkpoint(&out).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    /// A leftover that cannot be removed (emulated: the remover fails on it) is left with a warning; the
    /// others go and the call succeeds, so the run starts.
    #[test]
    fn a_leftover_that_cannot_be_removed_does_not_stop_the_cleanup() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".step-00000001.del-7/sub")).unwrap();
        std::fs::create_dir_all(dir.path().join(".step-00000002.del-8")).unwrap();
        let stuck = dir.path().join(".step-00000001.del-7");
        let busy = std::io::Error::new(std::io::ErrorKind::DirectoryNotEmpty, "Directory not empty (os error 39)");
        let removed = remove_leftovers_with(
            dir.path(),
            |_| true,
            |p, _| {
                if p == stuck {
                    Err(std::io::Error::new(busy.kind(), busy.to_string()))
                } else {
                    std::fs::remove_dir_all(p)
                }
            },
        )
        .unwrap();
        assert_eq!(removed, vec![dir.path().join(".step-00000002.del-8")]);
        assert!(stuck.exists());
    }

    #[test]
    fn bf16_checkpoints_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ckpt");
        let m = model(Arch::Qwen2);
        save_checkpoint(&m, &out, &SaveOptions { dtype: Some(DType::BF16), ..Default::default() }, |_| Ok(())).unwrap();
        let back = load_decoder(&out, DType::BF16, &Device::Cpu, false).unwrap();
        let (a, b) = (logprobs(&m), logprobs(&back));
        let d = crate::kernels::testing::abs_diff(&a, &b);
        assert!(d < 0.05, "bf16 round trip differs by {d}");
    }
}
