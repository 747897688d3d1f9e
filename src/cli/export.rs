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
    /// Merge the adapter into the base weights (W + B A alpha / r, in f32, rounded to --dtype): the only
    /// export there is.
    #[arg(long)]
    pub merge: bool,
    /// The new model's folder (written atomically).
    #[arg(long)]
    pub out: PathBuf,
    /// Weight dtype of the merged model: f32, bf16 or f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if !args.merge {
        anyhow::bail!("nothing to export: pass --merge to write the base model with the adapter merged in");
    }
    let base = match &args.model {
        Some(m) => m.clone(),
        None => lora::base_model(&args.adapter)?,
    };
    let dir = model::resolve_model_dir(&base)?;
    let dtype = model::parse_dtype(&args.dtype)?;
    // Merged in f32 from the base weights as stored, then rounded once to the output dtype.
    let adapted = lora::load_frozen(&dir, Some(&args.adapter), candle_core::DType::F32, &candle_core::Device::Cpu)
        .with_context(|| format!("loading {} with the adapter {}", dir.display(), args.adapter.display()))?;
    let merged = adapted.merged()?;
    let opts = SaveOptions { dtype: Some(dtype), tokenizer_dir: Some(dir.clone()), ..Default::default() };
    model::save_checkpoint(&merged, &args.out, &opts, |_| Ok(()))
        .with_context(|| format!("writing {}", args.out.display()))?;
    tracing::info!("wrote {} ({} merged into {})", args.out.display(), args.adapter.display(), dir.display());
    Ok(())
}
