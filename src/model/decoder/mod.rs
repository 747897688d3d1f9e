//! The decoder: Qwen2 / Qwen3 / Llama written from differentiable candle operations (candle's fused
//! softmax, rms_norm and rope drop gradients), with three ways to run it:
//! - training: per-token log-probs of given targets over a padded or packed batch, with gradients for
//!   every parameter, optionally recomputing each layer in the backward pass (activation checkpointing);
//! - detached: the same forward with no graph (the frozen reference, old-policy log-probs);
//! - generation: incremental forward with a KV cache over a batch of left-padded prompts.
//!
//! In parts, each importing only the ones before it: [`batch`] (the token batches and targets),
//! [`options`] (how the decoder computes), [`params`] (the parameters, their order and names, the
//! gradients), [`rope`] (the rope tables), [`cache`] and [`pool`] (the static and the paged KV cache's
//! storage); this file's [`Decoder`]; then the files that implement it: [`weights`] (the weights by name,
//! LoRA's wiring), [`layer`] (a layer's attention block and MLP, the projections), [`train`] (log-probs,
//! forward and backward with the layers' recomputation), [`generate`] (the decode path) and [`paged`] (a
//! continuous-batching step).

mod batch;
mod cache;
mod generate;
mod layer;
mod options;
mod paged;
mod params;
mod pool;
mod rope;
#[cfg(test)]
mod testing;
mod train;
mod weights;

pub use batch::{Targets, TokenBatch};
pub use cache::KvCache;
pub use options::{Attention, DecoderOptions};
pub use params::{parameter_shapes, Grads, Param};
pub use pool::{PagedBatch, PagedKv};

use candle_core::{DType, Device, Tensor, Var};

use super::config::ModelConfig;
use super::lora::LoraOptions;
use params::{slots_of, LayerParams, ParamId};
use rope::{inv_freq, RopeTables};

/// The decoder with its parameters.
pub struct Decoder {
    cfg: ModelConfig,
    device: Device,
    dtype: DType,
    names: Vec<String>,
    params: Vec<Param>,
    embed: ParamId,
    layers: Vec<LayerParams>,
    /// The final RMSNorm.
    norm: ParamId,
    /// The output projection: the embedding where the model ties them.
    lm_head: ParamId,
    inv_freq: Vec<f32>,
    rope_tables: RopeTables,
    pub options: DecoderOptions,
    /// Per parameter, its index among the trainable ones (the index of its gradient in [`Grads`]).
    slots: Vec<Option<usize>>,
    /// LoRA ([`lora`]): the adapters' options; their parameters follow the `base` ones, which are frozen.
    lora: Option<LoraOptions>,
    /// The number of the base model's parameters (those of [`parameter_shapes`]).
    base: usize,
}

impl Decoder {
    /// Build a decoder from named tensors; `trainable` makes every parameter a `Var`.
    /// Missing tensors are reported by name. Tensors are converted to `dtype` on `device`.
    pub fn from_tensors(
        cfg: ModelConfig,
        mut get: impl FnMut(&str, &[usize]) -> Result<Tensor, super::ModelError>,
        dtype: DType,
        device: &Device,
        trainable: bool,
    ) -> Result<Self, super::ModelError> {
        let shapes = parameter_shapes(&cfg);
        let mut names = Vec::with_capacity(shapes.len());
        let mut params = Vec::with_capacity(shapes.len());
        for (name, shape) in &shapes {
            let t = get(name, shape)?;
            if t.dims() != shape.as_slice() {
                return Err(super::ModelError::Shape {
                    name: name.clone(),
                    expected: shape.clone(),
                    found: t.dims().to_vec(),
                });
            }
            let t = t.to_dtype(dtype)?.to_device(device)?;
            params.push(if trainable { Param::Trainable(Var::from_tensor(&t)?) } else { Param::Frozen(t) });
            names.push(name.clone());
        }
        let layers = (0..cfg.num_layers).map(|l| LayerParams::find(l, &names)).collect::<Result<_, _>>()?;
        let embed = ParamId::require(&names, "model.embed_tokens.weight")?;
        let norm = ParamId::require(&names, "model.norm.weight")?;
        let lm_head = if cfg.tie_word_embeddings { embed } else { ParamId::require(&names, "lm_head.weight")? };
        let inv_freq = inv_freq(&cfg);
        Ok(Self {
            cfg,
            device: device.clone(),
            dtype,
            names,
            slots: slots_of(&params),
            base: params.len(),
            params,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            rope_tables: RopeTables::default(),
            options: DecoderOptions::default(),
            lora: None,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Parameter names (Hugging Face names; with LoRA, the adapters' names follow), in parameter order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The parameters, in the order of [`Decoder::names`].
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The trainable variables, in parameter order (empty for a frozen model; with LoRA, the adapters).
    pub fn vars(&self) -> Vec<&Var> {
        self.params.iter().filter_map(|p| if let Param::Trainable(v) = p { Some(v) } else { None }).collect()
    }

    /// The names of [`Decoder::vars`].
    pub fn trainable_names(&self) -> Vec<String> {
        self.names.iter().zip(&self.slots).filter(|(_, s)| s.is_some()).map(|(n, _)| n.clone()).collect()
    }

    /// No gradient yet for each trainable parameter.
    pub fn new_grads(&self) -> Grads {
        Grads::new(self.vars().len())
    }
}
