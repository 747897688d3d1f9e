//! Test helpers of the decoder's parts: tiny models (with and without LoRA), a batch, a loss, and the
//! finite-difference check of gradients.

use candle_core::{DType, Device, Tensor, Var};

use super::{Decoder, Grads, Param, Targets, TokenBatch};
use crate::model::lora::{self, LoraOptions};
use crate::model::tiny::TinyShape;
use crate::model::{random_decoder, Arch};

pub(super) fn tiny(arch: Arch, tied: bool, trainable: bool) -> Decoder {
    let mut cfg = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
        .config(arch, 97, None, None)
        .unwrap();
    cfg.tie_word_embeddings = tied;
    cfg.raw["tie_word_embeddings"] = tied.into();
    let mut m = random_decoder(cfg, 3, DType::F32, &Device::Cpu, trainable).unwrap();
    // Larger than the usual 0.02 init so that every path carries a visible gradient.
    // Seeded (not candle's unseeded randn) so that the tests are deterministic.
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    for p in &m.params {
        if let Param::Trainable(v) = p {
            let t = v.as_tensor();
            let noise: Vec<f32> = (0..t.elem_count()).map(|_| rng.gen_range(-0.5f32..0.5)).collect();
            let noise = Tensor::from_vec(noise, t.shape(), t.device()).unwrap();
            v.set(&(t + noise).unwrap()).unwrap();
        }
    }
    m.options.logprob_chunk_bytes = 97 * 4 * 5; // 5 rows per chunk: exercise chunking
    m
}

pub(super) fn batch() -> (TokenBatch, Targets) {
    let seqs = vec![vec![5u32, 17, 3, 88, 41, 9, 60], vec![11, 2, 90, 33]];
    let b = TokenBatch::padded(&seqs, 0);
    let mut t = Targets::default();
    for (r, s) in seqs.iter().enumerate() {
        for p in 1..s.len() {
            t.push(r, p);
        }
    }
    (b, t)
}

pub(super) fn weighted_loss(lp: &Tensor) -> candle_core::Result<Tensor> {
    let n = lp.dim(0)?;
    let w = Tensor::arange(0f32, n as f32, lp.device())?.affine(0.1, 0.5)?.sin()?;
    lp.narrow(1, 0, 1)?.squeeze(1)?.mul(&w)?.sum_all()
}

pub(super) fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// A tiny model (frozen base) with LoRA adapters of rank 3 on `targets`, B made non-zero (seeded) so
/// that every adapter carries a gradient.
pub(super) fn tiny_lora(arch: Arch, targets: &[&str]) -> Decoder {
    use rand::{Rng, SeedableRng};
    let base = tiny(arch, false, true);
    let opts = LoraOptions {
        r: 3,
        alpha: 6.0,
        target_modules: targets.iter().map(|t| t.to_string()).collect(),
        ..Default::default()
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let adapters = lora::init_adapters(base.config(), &opts, 7, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let noise: Vec<f32> = (0..t.elem_count()).map(|_| rng.gen_range(-0.3f32..0.3)).collect();
            (n, (&t + Tensor::from_vec(noise, t.shape(), &Device::Cpu).unwrap()).unwrap())
        })
        .collect();
    base.with_adapters(&opts, adapters, true).unwrap()
}

/// Central differences of `loss` at each trainable variable's largest gradient element agree with
/// `grads` within 2%.
pub(super) fn largest_gradients_agree(m: &Decoder, grads: &Grads, loss: impl Fn(&Decoder) -> f64, what: &str) {
    let names = m.trainable_names();
    for (k, var) in m.vars().into_iter().enumerate() {
        let g = grads.grads[k].as_ref().unwrap();
        largest_gradient_agrees(m, var, g, &loss, &format!("{what} {}", names[k]));
    }
}

/// The central difference of `loss` at `var`'s element of largest gradient `g` (a well-conditioned
/// check) agrees with it within 2%; `var` is put back as it was.
pub(super) fn largest_gradient_agrees(m: &Decoder, var: &Var, g: &Tensor, loss: &impl Fn(&Decoder) -> f64, what: &str) {
    let orig = var.as_tensor().copy().unwrap();
    let flat = values(&orig);
    let g = values(g);
    let (j, _) = g.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).unwrap();
    let eps = 1e-3f32;
    let shifted = |delta: f32| {
        let mut v = flat.clone();
        v[j] += delta;
        var.set(&Tensor::from_vec(v, orig.shape(), &Device::Cpu).unwrap()).unwrap();
        loss(m)
    };
    let fd = (shifted(eps) - shifted(-eps)) / (2.0 * eps as f64);
    var.set(&orig).unwrap();
    let rel = (fd - g[j] as f64).abs() / (g[j].abs() as f64).max(1e-3);
    assert!(rel < 2e-2, "{what}[{j}]: finite difference {fd} vs autograd {}", g[j]);
}
