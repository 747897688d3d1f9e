//! The decoder's weights as a whole: by parameter and trainable slot, by Hugging Face name, and LoRA's
//! wiring (adapters added, removed, merged; frozen copies).

use candle_core::{DType, Tensor, Var};

use super::params::{slots_of, Adapter, LayerParams, Linear, Param, ParamId, Projection};
use super::rope::RopeTables;
use super::Decoder;
use crate::model::lora::{self, LoraOptions};
use crate::model::ModelError;

impl Decoder {
    /// Parameter `id`.
    pub(super) fn param(&self, id: ParamId) -> &Param {
        &self.params[id.index()]
    }

    /// The index of parameter `id` among the trainable ones (of its gradient in [`super::Grads`]).
    pub(super) fn slot(&self, id: ParamId) -> Option<usize> {
        self.slots[id.index()]
    }

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
        let mut a = None;
        for (name, shape) in lora::adapter_shapes(&self.cfg, opts) {
            let t = given.remove(&name).ok_or_else(|| ModelError::Missing(name.clone()))?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::Shape { name, expected: shape, found: t.dims().to_vec() });
            }
            let t = t.to_dtype(DType::F32)?.to_device(&self.device)?;
            let id = ParamId(self.params.len());
            self.params.push(if trainable { Param::Trainable(Var::from_tensor(&t)?) } else { Param::Frozen(t) });
            let (l, p) = Self::adapter_place(&name)?;
            // `adapter_shapes` lists each projection's A, then its B.
            match a.take() {
                None => a = Some(id),
                Some(a) => self.layers[l].linear_mut(p).adapter = Some(Adapter { a, b: id }),
            }
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
    fn adapter_place(name: &str) -> Result<(usize, Projection), ModelError> {
        let parts: Vec<&str> = name.split('.').collect();
        let layer = parts.get(2).and_then(|l| l.parse().ok());
        match (layer, parts.get(4).and_then(|t| Projection::from_target(t))) {
            (Some(l), Some(p)) => Ok((l, p)),
            _ => Err(ModelError::Invalid(format!(
                "adapter `{name}` is not named model.layers.L.BLOCK.MODULE.lora_X.weight"
            ))),
        }
    }

    /// The base model of a LoRA model: the same (shared, frozen) base weights without the adapters (the
    /// reference of the KL term). Without LoRA, a frozen copy sharing the weights.
    pub fn without_adapters(&self) -> Self {
        let params: Vec<Param> = self.params[..self.base].iter().map(|p| Param::Frozen(p.get(false))).collect();
        let layers = self.layers.iter().map(LayerParams::without_adapters).collect();
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
        for layer in &self.layers {
            for p in Projection::ALL {
                let &Linear { weight, adapter: Some(Adapter { a, b }), .. } = layer.linear(p) else { continue };
                let delta = self.w(b, false).matmul(&self.w(a, false))?.affine(opts.scale(), 0.0)?;
                let merged = (self.w(weight, false).to_dtype(DType::F32)? + delta)?.to_dtype(self.dtype)?;
                out.params[weight.index()] = Param::Frozen(merged);
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
