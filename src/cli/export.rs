//! `grpo export --merge`: a LoRA adapter merged into its base model's weights, written as a Hugging Face
//! model (config.json, safetensors, tokenizer) that transformers and vLLM load without PEFT.

use std::path::PathBuf;

use anyhow::Context;

use crate::model::{self, checkpoint::SaveOptions, lora};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The adapter folder (PEFT's adapter_model.safetensors and adapter_config.json, e.g. a LoRA run's
    /// checkpoint).
    #[arg(long)]
    pub adapter: PathBuf,
    /// The base model (folder or hub id); default: the adapter config's base_model_name_or_path.
    #[arg(long)]
    pub model: Option<String>,
    /// Merge the adapter into --model even though its adapter_config.json names another base model
    /// (base_model_name_or_path).
    #[arg(long, requires = "model")]
    pub allow_base_mismatch: bool,
    /// Merge the adapter into the base weights (W + B A alpha / r, in f32, rounded to --dtype): the only
    /// export there is.
    #[arg(long)]
    pub merge: bool,
    /// The new model's folder (written atomically).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out when it already holds files (without it such an --out is refused).
    #[arg(long)]
    pub overwrite: bool,
    /// Weight dtype of the merged model: f32, bf16 or f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: crate::device::DTypeName,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if !args.merge {
        anyhow::bail!("nothing to export: pass --merge to write the base model with the adapter merged in");
    }
    check_out(&args.out, args.overwrite)?;
    let base = match &args.model {
        Some(m) => m.clone(),
        None => lora::base_model(&args.adapter)?,
    };
    let dir = model::resolve_model_dir(&base)?;
    let dtype = args.dtype.dtype();
    if let Some(given) = args.model.as_deref().filter(|_| !args.allow_base_mismatch) {
        crate::model::load::check_base(&args.adapter, given, &dir, "--allow-base-mismatch")?;
    }
    // Merged in f32 from the base weights as stored, then rounded once to the output dtype.
    let adapted =
        crate::model::load::load_frozen(&dir, Some(&args.adapter), candle_core::DType::F32, &candle_core::Device::Cpu)
            .with_context(|| format!("loading {} with the adapter {}", dir.display(), args.adapter.display()))?;
    let merged = adapted.merged()?;
    let opts = SaveOptions { dtype: Some(dtype), tokenizer_dir: Some(dir.clone()), ..Default::default() };
    model::save_checkpoint(&merged, &args.out, &opts, |_| Ok(()))
        .with_context(|| format!("writing {}", args.out.display()))?;
    tracing::info!("wrote {} ({} merged into {})", args.out.display(), args.adapter.display(), dir.display());
    Ok(())
}

/// Refuse an --out that is a file, or a folder holding files, unless `overwrite` (the folder is replaced
/// whole, atomically, once the merged model is written).
fn check_out(out: &std::path::Path, overwrite: bool) -> anyhow::Result<()> {
    let Ok(meta) = std::fs::metadata(out) else { return Ok(()) };
    if !meta.is_dir() {
        anyhow::bail!("--out {} exists and is not a folder (the merged model is written as a folder)", out.display());
    }
    let holds_files = std::fs::read_dir(out).with_context(|| format!("reading {}", out.display()))?.next().is_some();
    if holds_files && !overwrite {
        anyhow::bail!(
            "--out {} already holds files: pass --overwrite to replace the folder, or choose another --out",
            out.display()
        );
    }
    if holds_files {
        tracing::warn!("--overwrite: replacing {}", out.display());
    }
    Ok(())
}
