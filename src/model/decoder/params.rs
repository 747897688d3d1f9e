//! The decoder's parameters: trainable or frozen, their fixed order and Hugging Face names, each
//! layer's by projection ([`Projection`], [`LayerParams`]: places in the flat list, [`ParamId`]), and
//! LoRA's wiring (adapters added, removed, merged; frozen copies).

use candle_core::{DType, Tensor, Var};

use crate::model::lora;
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

/// A layer's projections, in the order of [`lora::TARGETS`]: `Q` is `q_proj`, ..., `Down` is `down_proj`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Projection {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Projection {
    /// Every projection, in the order of [`lora::TARGETS`].
    pub(super) const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// Its LoRA target (PEFT's module name: `q_proj`, ..., `down_proj`) and the block it is in
    /// (`self_attn` or `mlp`): its entry of [`lora::TARGETS`].
    fn target_and_block(self) -> (&'static str, &'static str) {
        lora::TARGETS[self as usize]
    }

    /// Its LoRA target name (PEFT's module name).
    pub(super) fn target(self) -> &'static str {
        self.target_and_block().0
    }

    /// The projection a LoRA target name names.
    pub(super) fn from_target(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.target() == name)
    }

    /// Its number, 0 to 6 (the order of [`lora::TARGETS`]): what LoRA's dropout seeds mix in.
    pub(super) fn number(self) -> u64 {
        self as u64
    }

    /// The Hugging Face name of its parameter `what` (`weight`, `bias`, `lora_A.weight`, ...) in layer `l`.
    pub(super) fn name(self, l: usize, what: &str) -> String {
        let (target, block) = self.target_and_block();
        format!("model.layers.{l}.{block}.{target}.{what}")
    }
}

/// The place of a parameter in [`Decoder::params`] (the order of [`parameter_shapes`], then LoRA's adapters,
/// [`lora::adapter_shapes`]): the optimizer's state, the checkpoints and the names follow that order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ParamId(pub(super) usize);

impl ParamId {
    /// The parameter named `name` among `names` (in parameter order).
    fn find(names: &[String], name: &str) -> Option<Self> {
        names.iter().position(|n| n == name).map(ParamId)
    }

    /// The same, an error naming it where it is missing.
    pub(super) fn require(names: &[String], name: &str) -> Result<Self, ModelError> {
        Self::find(names, name).ok_or_else(|| ModelError::Missing(name.to_string()))
    }

    pub(super) fn index(self) -> usize {
        self.0
    }
}

/// A LoRA adapter's parameters: `A` `[r, in]` and `B` `[out, r]` ([`lora`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Adapter {
    pub(super) a: ParamId,
    pub(super) b: ParamId,
}

/// A projection's parameters: `x W^T + b`, plus with an adapter `(x A^T) B^T alpha / r`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Linear {
    pub(super) weight: ParamId,
    pub(super) bias: Option<ParamId>,
    pub(super) adapter: Option<Adapter>,
}

/// The RMSNorm weights of each head's queries and keys (Qwen3).
#[derive(Debug, Clone, Copy)]
pub(super) struct QkNorm {
    pub(super) q: ParamId,
    pub(super) k: ParamId,
}

/// One decoder layer's parameters.
#[derive(Debug, Clone, Copy)]
pub(super) struct LayerParams {
    pub(super) q: Linear,
    pub(super) k: Linear,
    pub(super) v: Linear,
    pub(super) o: Linear,
    pub(super) qk_norm: Option<QkNorm>,
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
    /// The RMSNorm before the attention (`input_layernorm`).
    pub(super) input_norm: ParamId,
    /// The RMSNorm before the MLP (`post_attention_layernorm`).
    pub(super) post_attention_norm: ParamId,
}

impl LayerParams {
    /// Layer `l`'s parameters among `names` (Hugging Face names, in parameter order), without adapters.
    pub(super) fn find(l: usize, names: &[String]) -> Result<Self, ModelError> {
        let linear = |p: Projection| -> Result<Linear, ModelError> {
            let weight = ParamId::require(names, &p.name(l, "weight"))?;
            Ok(Linear { weight, bias: ParamId::find(names, &p.name(l, "bias")), adapter: None })
        };
        let norm = |what: &str| format!("model.layers.{l}.{what}.weight");
        let qk_norm =
            match (ParamId::find(names, &norm("self_attn.q_norm")), ParamId::find(names, &norm("self_attn.k_norm"))) {
                (Some(q), Some(k)) => Some(QkNorm { q, k }),
                _ => None,
            };
        Ok(LayerParams {
            q: linear(Projection::Q)?,
            k: linear(Projection::K)?,
            v: linear(Projection::V)?,
            o: linear(Projection::O)?,
            qk_norm,
            gate: linear(Projection::Gate)?,
            up: linear(Projection::Up)?,
            down: linear(Projection::Down)?,
            input_norm: ParamId::require(names, &norm("input_layernorm"))?,
            post_attention_norm: ParamId::require(names, &norm("post_attention_layernorm"))?,
        })
    }

    /// The parameters of projection `p`.
    pub(super) fn linear(&self, p: Projection) -> &Linear {
        match p {
            Projection::Q => &self.q,
            Projection::K => &self.k,
            Projection::V => &self.v,
            Projection::O => &self.o,
            Projection::Gate => &self.gate,
            Projection::Up => &self.up,
            Projection::Down => &self.down,
        }
    }

    pub(super) fn linear_mut(&mut self, p: Projection) -> &mut Linear {
        match p {
            Projection::Q => &mut self.q,
            Projection::K => &mut self.k,
            Projection::V => &mut self.v,
            Projection::O => &mut self.o,
            Projection::Gate => &mut self.gate,
            Projection::Up => &mut self.up,
            Projection::Down => &mut self.down,
        }
    }

    /// The same layer without its adapters.
    pub(super) fn without_adapters(&self) -> Self {
        let mut layer = *self;
        for p in Projection::ALL {
            layer.linear_mut(p).adapter = None;
        }
        layer
    }
}

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
    use Projection::{Down, Gate, Up, K, O, Q, V};
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h])];
    for l in 0..cfg.num_layers {
        let features = |p: Projection| lora::features(cfg, p.target());
        let weight = |p: Projection| (p.name(l, "weight"), vec![features(p).1, features(p).0]);
        let bias = |p: Projection| (p.name(l, "bias"), vec![features(p).1]);
        let norm = |what: &str, size: usize| (format!("model.layers.{l}.{what}.weight"), vec![size]);
        out.extend([Q, K, V, O].map(weight));
        if cfg.qkv_bias {
            out.extend([Q, K, V].map(bias));
        }
        if cfg.o_bias {
            out.push(bias(O));
        }
        if cfg.qk_norm {
            out.extend([norm("self_attn.q_norm", hd), norm("self_attn.k_norm", hd)]);
        }
        out.extend([Gate, Up, Down].map(weight));
        if cfg.mlp_bias {
            out.extend([Gate, Up, Down].map(bias));
        }
        out.extend([norm("input_layernorm", h), norm("post_attention_layernorm", h)]);
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// Gradients of the trainable parameters (f32), in the order of [`Decoder::vars`].
pub struct Grads {
    pub grads: Vec<Option<Tensor>>,
}

impl Grads {
    /// No gradient yet for `n` trainable parameters.
    pub fn new(n: usize) -> Self {
        Self { grads: vec![None; n] }
    }

    pub(super) fn add(&mut self, i: usize, g: &Tensor) -> candle_core::Result<()> {
        match &self.grads[i] {
            // The accumulator is a buffer of its own, contiguous (the cast, or a copy: candle may hand one
            // gradient tensor to several inputs); later micro-batches add into it in place.
            None => {
                let acc = if g.dtype() == DType::F32 { g.affine(1.0, 0.0)? } else { g.to_dtype(DType::F32)? };
                self.grads[i] = Some(acc.contiguous()?);
            }
            Some(acc) => crate::kernels::accumulate(acc, g)?,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{batch, largest_gradients_agree, tiny, tiny_lora, values, weighted_loss};
    use super::super::Decoder;
    use super::*;
    use crate::model::{Arch, LoraOptions};
    use candle_core::Device;

    #[test]
    fn projections_follow_the_lora_targets() {
        let targets: Vec<&str> = Projection::ALL.iter().map(|p| p.target()).collect();
        assert_eq!(targets, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]);
        assert_eq!(targets, lora::TARGETS.map(|(t, _)| t));
        for (k, p) in Projection::ALL.into_iter().enumerate() {
            assert_eq!(Projection::from_target(p.target()), Some(p));
            assert_eq!(p.number(), k as u64);
        }
        assert_eq!(Projection::from_target("lm_head"), None);
        assert_eq!(Projection::O.name(0, "weight"), "model.layers.0.self_attn.o_proj.weight");
        assert_eq!(Projection::Gate.name(3, "bias"), "model.layers.3.mlp.gate_proj.bias");
    }

    /// The flat order the optimizer's state and the checkpoints rely on, every optional parameter present.
    #[test]
    fn parameter_shapes_keep_the_hugging_face_order() {
        let mut cfg = tiny(Arch::Qwen3, false, false).config().clone();
        (cfg.num_layers, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) = (1, true, true, true);
        assert_eq!((cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size), (16, 4, 2, 24));
        let want: Vec<(&str, Vec<usize>)> = vec![
            ("model.embed_tokens.weight", vec![97, 16]),
            ("model.layers.0.self_attn.q_proj.weight", vec![16, 16]),
            ("model.layers.0.self_attn.k_proj.weight", vec![8, 16]),
            ("model.layers.0.self_attn.v_proj.weight", vec![8, 16]),
            ("model.layers.0.self_attn.o_proj.weight", vec![16, 16]),
            ("model.layers.0.self_attn.q_proj.bias", vec![16]),
            ("model.layers.0.self_attn.k_proj.bias", vec![8]),
            ("model.layers.0.self_attn.v_proj.bias", vec![8]),
            ("model.layers.0.self_attn.o_proj.bias", vec![16]),
            ("model.layers.0.self_attn.q_norm.weight", vec![4]),
            ("model.layers.0.self_attn.k_norm.weight", vec![4]),
            ("model.layers.0.mlp.gate_proj.weight", vec![24, 16]),
            ("model.layers.0.mlp.up_proj.weight", vec![24, 16]),
            ("model.layers.0.mlp.down_proj.weight", vec![16, 24]),
            ("model.layers.0.mlp.gate_proj.bias", vec![24]),
            ("model.layers.0.mlp.up_proj.bias", vec![24]),
            ("model.layers.0.mlp.down_proj.bias", vec![16]),
            ("model.layers.0.input_layernorm.weight", vec![16]),
            ("model.layers.0.post_attention_layernorm.weight", vec![16]),
            ("model.norm.weight", vec![16]),
            ("lm_head.weight", vec![97, 16]),
        ];
        let got = parameter_shapes(&cfg);
        assert_eq!(got.iter().map(|(n, s)| (n.as_str(), s.clone())).collect::<Vec<_>>(), want);
    }

    /// Each layer's typed parameters are those of their names: weights, biases, q/k norms, the adapters
    /// (where the options target the projection), and none of the adapters without them.
    #[test]
    fn layers_point_at_their_parameters_by_name() {
        let all = lora::TARGETS.map(|(t, _)| t);
        for (arch, targets) in [(Arch::Qwen2, &all[..]), (Arch::Qwen3, &["v_proj", "down_proj"][..])] {
            let m = tiny_lora(arch, targets);
            let name = |id: ParamId| m.names()[id.index()].as_str();
            for (l, layer) in m.layers.iter().enumerate() {
                for p in Projection::ALL {
                    let linear = layer.linear(p);
                    assert_eq!(name(linear.weight), p.name(l, "weight"));
                    let biased = arch == Arch::Qwen2 && matches!(p, Projection::Q | Projection::K | Projection::V);
                    assert_eq!(linear.bias.map(name), biased.then(|| p.name(l, "bias")).as_deref(), "{arch:?}");
                    let adapter = linear.adapter.map(|a| (name(a.a), name(a.b)));
                    let want =
                        targets.contains(&p.target()).then(|| (p.name(l, "lora_A.weight"), p.name(l, "lora_B.weight")));
                    assert_eq!(adapter, want.as_ref().map(|(a, b)| (a.as_str(), b.as_str())), "{arch:?}");
                }
                let norms = layer.qk_norm.map(|n| (name(n.q), name(n.k)));
                let want = (
                    format!("model.layers.{l}.self_attn.q_norm.weight"),
                    format!("model.layers.{l}.self_attn.k_norm.weight"),
                );
                assert_eq!(norms, (arch == Arch::Qwen3).then_some((want.0.as_str(), want.1.as_str())));
                assert_eq!(name(layer.input_norm), format!("model.layers.{l}.input_layernorm.weight"));
                assert_eq!(
                    name(layer.post_attention_norm),
                    format!("model.layers.{l}.post_attention_layernorm.weight")
                );
            }
            assert_eq!(
                (name(m.embed), name(m.norm), name(m.lm_head)),
                ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
            );
            let base = m.without_adapters();
            assert!(base.layers.iter().all(|l| Projection::ALL.iter().all(|&p| l.linear(p).adapter.is_none())));
        }
    }

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
