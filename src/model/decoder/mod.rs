//! The decoder: Qwen2 / Qwen3 / Llama written from differentiable candle operations (candle's fused
//! softmax, rms_norm and rope drop gradients), with three ways to run it:
//! - training: per-token log-probs of given targets over a padded or packed batch, with gradients for
//!   every parameter, optionally recomputing each layer in the backward pass (activation checkpointing);
//! - detached: the same forward with no graph (the frozen reference, old-policy log-probs);
//! - generation: incremental forward with a KV cache over a batch of left-padded prompts.
//!
//! In parts: [`params`] (the parameters, their order and names, LoRA's wiring), [`layer`] (a layer's
//! attention block and MLP, the projections, the rope tables), [`train`] (log-probs, forward and backward
//! with the layers' recomputation), [`generate`] (the KV cache and the decode path), [`batch`] (the token
//! batches and targets) and [`options`] (how the decoder computes).

mod batch;
mod generate;
mod layer;
mod options;
mod params;
#[cfg(test)]
mod testing;
mod train;

pub use batch::{Targets, TokenBatch};
pub use generate::KvCache;
pub use options::{Attention, DecoderOptions};
pub use params::{parameter_shapes, Param};
pub use train::Grads;

use candle_core::{DType, Device, Tensor, Var};

use super::config::ModelConfig;
use super::lora::LoraOptions;
use layer::{inv_freq, RopeTables};
use params::{slots_of, LayerIdx};

/// The decoder with its parameters.
pub struct Decoder {
    cfg: ModelConfig,
    device: Device,
    dtype: DType,
    names: Vec<String>,
    params: Vec<Param>,
    embed: usize,
    layers: Vec<LayerIdx>,
    norm: usize,
    lm_head: usize,
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
        let find = |n: &str| names.iter().position(|x| x == n);
        let req = |n: String| find(&n).ok_or_else(|| super::ModelError::Missing(n));
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            layers.push(LayerIdx {
                q: req(p("self_attn.q_proj.weight"))?,
                k: req(p("self_attn.k_proj.weight"))?,
                v: req(p("self_attn.v_proj.weight"))?,
                o: req(p("self_attn.o_proj.weight"))?,
                q_bias: find(&p("self_attn.q_proj.bias")),
                k_bias: find(&p("self_attn.k_proj.bias")),
                v_bias: find(&p("self_attn.v_proj.bias")),
                o_bias: find(&p("self_attn.o_proj.bias")),
                q_norm: find(&p("self_attn.q_norm.weight")),
                k_norm: find(&p("self_attn.k_norm.weight")),
                gate: req(p("mlp.gate_proj.weight"))?,
                up: req(p("mlp.up_proj.weight"))?,
                down: req(p("mlp.down_proj.weight"))?,
                gate_bias: find(&p("mlp.gate_proj.bias")),
                up_bias: find(&p("mlp.up_proj.bias")),
                down_bias: find(&p("mlp.down_proj.bias")),
                ln_in: req(p("input_layernorm.weight"))?,
                ln_post: req(p("post_attention_layernorm.weight"))?,
                adapters: [None; 7],
            });
        }
        let embed = req("model.embed_tokens.weight".into())?;
        let norm = req("model.norm.weight".into())?;
        let lm_head = if cfg.tie_word_embeddings { embed } else { req("lm_head.weight".into())? };
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
