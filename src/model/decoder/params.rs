//! The decoder's parameters: trainable or frozen, their fixed order and Hugging Face names, the index
//! of each layer's, and LoRA's wiring (adapters added, removed, merged; frozen copies).

use candle_core::{DType, Tensor, Var};

use super::layer::RopeTables;
use super::Decoder;
use crate::model::lora::{self, LoraOptions};
use crate::model::{ModelConfig, ModelError};

/// A parameter: trainable (a candle `Var`) or frozen (a plain tensor).
#[derive(Clone)]
pub enum Param {
    Trainable(Var),
    Frozen(Tensor),
}

impl Param {
    /// The tensor with (`graph = true`) or without gradient tracking.
    pub(super) fn get(&self, graph: bool) -> Tensor {
        match self {
            Param::Trainable(v) if graph => v.as_tensor().clone(),
            Param::Trainable(v) => v.as_detached_tensor(),
            Param::Frozen(t) => t.clone(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct LayerIdx {
    pub(super) q: usize,
    pub(super) k: usize,
    pub(super) v: usize,
    pub(super) o: usize,
    pub(super) q_bias: Option<usize>,
    pub(super) k_bias: Option<usize>,
    pub(super) v_bias: Option<usize>,
    pub(super) o_bias: Option<usize>,
    pub(super) q_norm: Option<usize>,
    pub(super) k_norm: Option<usize>,
    pub(super) gate: usize,
    pub(super) up: usize,
    pub(super) down: usize,
    pub(super) gate_bias: Option<usize>,
    pub(super) up_bias: Option<usize>,
    pub(super) down_bias: Option<usize>,
    pub(super) ln_in: usize,
    pub(super) ln_post: usize,
    /// LoRA: the `(A, B)` parameters of each projection, in the order of [`lora::TARGETS`].
    pub(super) adapters: [Option<(usize, usize)>; 7],
}

impl LayerIdx {
    /// The weight and bias of projection `m` (the order of [`lora::TARGETS`]).
    pub(super) fn projection(&self, m: usize) -> (usize, Option<usize>) {
        match m {
            0 => (self.q, self.q_bias),
            1 => (self.k, self.k_bias),
            2 => (self.v, self.v_bias),
            3 => (self.o, self.o_bias),
            4 => (self.gate, self.gate_bias),
            5 => (self.up, self.up_bias),
            _ => (self.down, self.down_bias),
        }
    }
}

/// The projections, as indices into [`lora::TARGETS`].
pub(super) const Q: usize = 0;
pub(super) const K: usize = 1;
pub(super) const V: usize = 2;
pub(super) const O: usize = 3;
pub(super) const GATE: usize = 4;
pub(super) const UP: usize = 5;
pub(super) const DOWN: usize = 6;

/// Per parameter, its index among the trainable ones.
pub(super) fn slots_of(params: &[Param]) -> Vec<Option<usize>> {
    let mut n = 0;
    params
        .iter()
        .map(|p| {
            matches!(p, Param::Trainable(_)).then(|| {
                n += 1;
                n - 1
            })
        })
        .collect()
}

/// Names of the parameters of `cfg`, in a fixed order, with their shapes.
pub fn parameter_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h])];
    for l in 0..cfg.num_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        out.push((p("self_attn.q_proj.weight"), vec![q, h]));
        out.push((p("self_attn.k_proj.weight"), vec![kv, h]));
        out.push((p("self_attn.v_proj.weight"), vec![kv, h]));
        out.push((p("self_attn.o_proj.weight"), vec![h, q]));
        if cfg.qkv_bias {
            out.push((p("self_attn.q_proj.bias"), vec![q]));
            out.push((p("self_attn.k_proj.bias"), vec![kv]));
            out.push((p("self_attn.v_proj.bias"), vec![kv]));
        }
        if cfg.o_bias {
            out.push((p("self_attn.o_proj.bias"), vec![h]));
        }
        if cfg.qk_norm {
            out.push((p("self_attn.q_norm.weight"), vec![hd]));
            out.push((p("self_attn.k_norm.weight"), vec![hd]));
        }
        out.push((p("mlp.gate_proj.weight"), vec![i, h]));
        out.push((p("mlp.up_proj.weight"), vec![i, h]));
        out.push((p("mlp.down_proj.weight"), vec![h, i]));
        if cfg.mlp_bias {
            out.push((p("mlp.gate_proj.bias"), vec![i]));
            out.push((p("mlp.up_proj.bias"), vec![i]));
            out.push((p("mlp.down_proj.bias"), vec![h]));
        }
        out.push((p("input_layernorm.weight"), vec![h]));
        out.push((p("post_attention_layernorm.weight"), vec![h]));
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

impl Decoder {
    /// Detached copies of the base model's parameters by name, in its dtype (the Hugging Face weights; with
    /// LoRA, without the adapters: see [`Decoder::adapter_tensors`] and [`Decoder::merged`]).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.names.iter().cloned().zip(self.params.iter().map(|p| p.get(false))).take(self.base).collect()
    }

    /// What this model adds to its base model: every parameter, or with LoRA the adapters only (what a
    /// checkpoint stores of a frozen copy: the swapped reference, the anchor snapshot, the lagged sampler).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        match self.lora {
            Some(_) => self.adapter_tensors(),
            None => self.named_tensors(),
        }
    }

    /// A frozen model shaped like this one with the parameters `tensors` ([`Decoder::state_tensors`] of a
    /// model shaped like this one): with LoRA, this model's base weights (shared) and those adapters.
    pub fn frozen_with(
        &self,
        mut get: impl FnMut(&str, &[usize]) -> Result<Tensor, ModelError>,
    ) -> Result<Self, ModelError> {
        let mut model = match &self.lora {
            Some(opts) => {
                let mut adapters = Vec::new();
                for (name, shape) in lora::adapter_shapes(&self.cfg, opts) {
                    adapters.push((name.clone(), get(&name, &shape)?));
                }
                self.without_adapters().with_adapters(opts, adapters, false)?
            }
            None => Self::from_tensors(self.cfg.clone(), get, self.dtype, &self.device, false)?,
        };
        model.options = self.options.clone();
        Ok(model)
    }

    /// The LoRA options, when the model has adapters.
    pub fn lora(&self) -> Option<&LoraOptions> {
        self.lora.as_ref()
    }

    /// The adapters by name ([`lora::adapter_shapes`]), detached, f32 (empty without LoRA).
    pub fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        self.names.iter().cloned().zip(self.params.iter().map(|p| p.get(false))).skip(self.base).collect()
    }

    /// This model with LoRA adapters `adapters` (named and shaped as [`lora::adapter_shapes`] says) on the
    /// projections `opts` targets, trainable or frozen; the base weights become frozen (their storage
    /// shared, not copied). The adapters are kept in f32 ([`lora`]).
    pub fn with_adapters(
        mut self,
        opts: &LoraOptions,
        adapters: Vec<(String, Tensor)>,
        trainable: bool,
    ) -> Result<Self, ModelError> {
        if self.lora.is_some() {
            return Err(ModelError::Invalid("the model already has adapters".into()));
        }
        opts.validate().map_err(ModelError::Invalid)?;
        for p in &mut self.params {
            if let Param::Trainable(v) = p {
                *p = Param::Frozen(v.as_detached_tensor());
            }
        }
        let mut given: std::collections::HashMap<String, Tensor> = adapters.into_iter().collect();
        for (name, shape) in lora::adapter_shapes(&self.cfg, opts) {
            let t = given.remove(&name).ok_or_else(|| ModelError::Missing(name.clone()))?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::Shape { name, expected: shape, found: t.dims().to_vec() });
            }
            let t = t.to_dtype(DType::F32)?.to_device(&self.device)?;
            let i = self.params.len();
            self.params.push(if trainable { Param::Trainable(Var::from_tensor(&t)?) } else { Param::Frozen(t) });
            let (l, module) = Self::adapter_place(&name);
            let m = lora::TARGETS.iter().position(|(t, _)| *t == module).unwrap_or(0);
            let slot = &mut self.layers[l].adapters[m];
            *slot = match (name.ends_with("lora_A.weight"), *slot) {
                (true, _) => Some((i, usize::MAX)),
                (false, Some((a, _))) => Some((a, i)),
                (false, None) => Some((usize::MAX, i)),
            };
            self.names.push(name);
        }
        if let Some(extra) = given.keys().next() {
            return Err(ModelError::Invalid(format!(
                "adapter tensor `{extra}` is not one of the adapters the options describe"
            )));
        }
        self.slots = slots_of(&self.params);
        self.lora = Some(opts.clone());
        Ok(self)
    }

    /// The layer and projection of an adapter's name (`model.layers.L.BLOCK.MODULE.lora_X.weight`).
    fn adapter_place(name: &str) -> (usize, &str) {
        let parts: Vec<&str> = name.split('.').collect();
        (parts.get(2).and_then(|l| l.parse().ok()).unwrap_or(0), parts.get(4).copied().unwrap_or(""))
    }

    /// The base model of a LoRA model: the same (shared, frozen) base weights without the adapters (the
    /// reference of the KL term). Without LoRA, a frozen copy sharing the weights.
    pub fn without_adapters(&self) -> Self {
        let params: Vec<Param> = self.params[..self.base].iter().map(|p| Param::Frozen(p.get(false))).collect();
        let mut layers = self.layers.clone();
        for l in &mut layers {
            l.adapters = [None; 7];
        }
        Self {
            cfg: self.cfg.clone(),
            device: self.device.clone(),
            dtype: self.dtype,
            names: self.names[..self.base].to_vec(),
            slots: vec![None; self.base],
            base: self.base,
            params,
            embed: self.embed,
            layers,
            norm: self.norm,
            lm_head: self.lm_head,
            inv_freq: self.inv_freq.clone(),
            rope_tables: RopeTables::default(),
            options: self.options.clone(),
            lora: None,
        }
    }

    /// The base model with the adapters merged into its weights (`W + B A alpha / r`, in f32, rounded to
    /// the model's dtype): a frozen model without LoRA that computes what this one does (up to rounding).
    pub fn merged(&self) -> candle_core::Result<Self> {
        let mut out = self.without_adapters();
        let Some(opts) = &self.lora else { return Ok(out) };
        for li in &self.layers {
            for (m, adapter) in li.adapters.iter().enumerate() {
                let Some((a, b)) = *adapter else { continue };
                let (w, _) = li.projection(m);
                let delta = self.w(b, false).matmul(&self.w(a, false))?.affine(opts.scale(), 0.0)?;
                let merged = (self.w(w, false).to_dtype(DType::F32)? + delta)?.to_dtype(self.dtype)?;
                out.params[w] = Param::Frozen(merged);
            }
        }
        Ok(out)
    }

    /// A frozen (no-`Var`) copy of this model: the reference model, the anchor snapshot, the sampler. Its
    /// parameters are copies of this model's, but for LoRA's frozen base weights, which are shared.
    pub fn frozen_copy(&self) -> candle_core::Result<Self> {
        let lora = self.lora.is_some();
        let params = self
            .params
            .iter()
            .map(|p| match p {
                Param::Frozen(t) if lora => Ok(Param::Frozen(t.clone())),
                p => Ok(Param::Frozen(p.get(false).copy()?)),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            cfg: self.cfg.clone(),
            device: self.device.clone(),
            dtype: self.dtype,
            names: self.names.clone(),
            slots: vec![None; params.len()],
            base: self.base,
            params,
            embed: self.embed,
            layers: self.layers.clone(),
            norm: self.norm,
            lm_head: self.lm_head,
            inv_freq: self.inv_freq.clone(),
            rope_tables: RopeTables::default(),
            options: self.options.clone(),
            lora: self.lora.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{batch, largest_gradients_agree, tiny, tiny_lora, values, weighted_loss};
    use super::*;
    use crate::model::Arch;
    use candle_core::Device;

    /// Only the adapters are trainable and get gradients, which agree with finite differences, with and
    /// without layer recomputation (the same values either way).
    #[test]
    fn lora_gradients_agree_with_finite_differences() {
        let all = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
        for (arch, targets) in [(Arch::Qwen2, &all[..]), (Arch::Qwen3, &["v_proj", "down_proj"][..])] {
            let mut m = tiny_lora(arch, targets);
            let names = m.trainable_names();
            assert_eq!(names.len(), 2 * 2 * targets.len(), "{names:?}");
            assert!(names.iter().all(|n| n.contains(".lora_")), "{names:?}");
            let (b, t) = batch();
            let (l1, grads) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            m.options.checkpoint_layers = true;
            let (l2, g2) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            assert!((l1 - l2).abs() < 1e-5);
            for (name, (a, c)) in names.iter().zip(grads.grads.iter().zip(&g2.grads)) {
                let (a, c) = (values(a.as_ref().unwrap()), values(c.as_ref().unwrap()));
                let d = crate::kernels::testing::abs_diff(&a, &c);
                assert!(d < 1e-5, "{arch:?} {name}: recomputed gradient differs by {d}");
                assert!(a.iter().any(|&x| x != 0.0), "{arch:?} {name}: zero gradient");
            }
            let eval = |m: &Decoder| -> f64 {
                let lp = m.token_logprobs(&b, &t, false).unwrap();
                weighted_loss(&lp).unwrap().to_scalar::<f32>().unwrap() as f64
            };
            largest_gradients_agree(&m, &grads, eval, &format!("{arch:?}"));
        }
    }

    /// LoRA's dropout: a training batch's seed draws the mask, the same one in the layers' recomputation
    /// (equal losses and gradients with and without `checkpoint_layers`) and for the same seed, another for
    /// another seed; the gradients are those of the masked loss (finite differences); a batch without a
    /// seed (evaluation, the reference, rollouts) has no dropout.
    #[test]
    fn lora_dropout_is_drawn_from_the_batch_seed_and_recomputed_the_same() {
        let mut m = tiny_lora(Arch::Qwen2, &["q_proj", "v_proj", "up_proj", "down_proj"]);
        let (b, t) = batch();
        let (plain, _) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
        m.lora.as_mut().unwrap().dropout = 0.3;
        let seeded = b.clone().with_dropout_seed(42);
        assert_eq!(m.forward_backward(&b, &t, &mut weighted_loss).unwrap().0, plain);
        let inference = weighted_loss(&m.token_logprobs(&seeded, &t, false).unwrap()).unwrap();
        assert_eq!(inference.to_scalar::<f32>().unwrap(), plain);
        let (l1, g1) = m.forward_backward(&seeded, &t, &mut weighted_loss).unwrap();
        assert!((l1 - plain).abs() > 1e-4, "dropout left the loss at {l1}");
        assert_eq!(m.forward_backward(&seeded, &t, &mut weighted_loss).unwrap().0, l1);
        let other = m.forward_backward(&b.clone().with_dropout_seed(43), &t, &mut weighted_loss).unwrap().0;
        assert!((other - l1).abs() > 1e-6, "seeds 42 and 43 drew the same masks");
        m.options.checkpoint_layers = true;
        let (l2, g2) = m.forward_backward(&seeded, &t, &mut weighted_loss).unwrap();
        assert!((l1 - l2).abs() < 1e-5, "{l1} vs recomputed {l2}");
        for (a, c) in g1.grads.iter().zip(&g2.grads) {
            let (a, c) = (values(a.as_ref().unwrap()), values(c.as_ref().unwrap()));
            let d = crate::kernels::testing::abs_diff(&a, &c);
            assert!(d < 1e-5, "recomputed gradient differs by {d}");
        }
        let masked = |m: &Decoder| m.forward_backward(&seeded, &t, &mut weighted_loss).unwrap().0 as f64;
        largest_gradients_agree(&m, &g1, masked, "dropout");
    }

    /// Fresh adapters (B = 0) give the base model's log-probs exactly; the base model without the adapters
    /// shares the weights; merging the adapters into the weights gives the adapter model's log-probs.
    #[test]
    fn lora_starts_at_the_base_model_and_merges_into_it() {
        let base = tiny(Arch::Qwen2, false, false);
        let (b, t) = batch();
        let want = values(&base.token_logprobs(&b, &t, false).unwrap());
        let opts = LoraOptions { r: 2, ..Default::default() };
        let fresh = lora::init_adapters(base.config(), &opts, 1, &Device::Cpu).unwrap();
        let m = base.frozen_copy().unwrap().with_adapters(&opts, fresh, true).unwrap();
        assert_eq!(values(&m.token_logprobs(&b, &t, false).unwrap()), want);
        let m = tiny_lora(Arch::Qwen2, &["q_proj", "o_proj", "up_proj"]);
        let off = m.without_adapters();
        assert!(off.vars().is_empty() && off.names().len() == off.params().len());
        let w = |d: &Decoder| d.named_tensors()[1].1.clone();
        assert_eq!(values(&w(&off)), values(&w(&m)));
        let adapted = values(&m.token_logprobs(&b, &t, false).unwrap());
        assert_ne!(adapted, values(&off.token_logprobs(&b, &t, false).unwrap()));
        let merged = values(&m.merged().unwrap().token_logprobs(&b, &t, false).unwrap());
        let d = crate::kernels::testing::abs_diff(&adapted, &merged);
        assert!(d < 1e-5, "merged log-probs differ by {d}");
        // A frozen copy (the reference swap, the snapshot) computes the same, sharing the base weights.
        let copy = m.frozen_copy().unwrap();
        assert_eq!(values(&copy.token_logprobs(&b, &t, false).unwrap()), adapted);
        assert!(copy.vars().is_empty());
    }
}
