//! Optimisers with f32 state whatever the model dtype: AdamW (f32 master weights and moments, decoupled
//! weight decay) and plain SGD; global gradient-norm clipping; learning-rate schedules.

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::model::Grads;

/// Which optimiser.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimName {
    Adamw,
    Sgd,
}

/// Learning-rate schedule after the linear warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    /// Linear decay to `min_lr_ratio * lr` at the last step.
    Linear,
    /// Cosine decay to `min_lr_ratio * lr` at the last step.
    Cosine,
}

/// The `[optim]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    pub name: OptimName,
    pub lr: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    /// Decoupled weight decay (not applied to biases and norm weights).
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value (0 disables).
    pub grad_clip: f64,
    pub schedule: Schedule,
    pub warmup_steps: usize,
    pub min_lr_ratio: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            name: OptimName::Adamw,
            lr: 1e-6,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: 1.0,
            schedule: Schedule::Constant,
            warmup_steps: 0,
            min_lr_ratio: 0.0,
        }
    }
}

impl OptimConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(format!("optim.lr = {} must be positive", self.lr));
        }
        if self.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
            return Err(format!("optim.betas = {:?} must be in [0, 1)", self.betas));
        }
        if self.grad_clip < 0.0 || self.weight_decay < 0.0 || self.eps <= 0.0 {
            return Err("optim.grad_clip and optim.weight_decay must be >= 0, optim.eps > 0".into());
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err("optim.min_lr_ratio must be in [0, 1]".into());
        }
        Ok(())
    }

    /// Learning rate at `step` (0-based) of `total` steps.
    pub fn lr_at(&self, step: usize, total: usize) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = total.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        let floor = self.min_lr_ratio;
        let factor = match self.schedule {
            Schedule::Constant => 1.0,
            Schedule::Linear => floor + (1.0 - floor) * (1.0 - progress),
            Schedule::Cosine => floor + (1.0 - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        };
        self.lr * factor
    }
}

/// The factor that clips a gradient of norm `norm` to `max` (1 when `max` is 0, clipping off).
pub fn clip_scale(norm: f64, max: f64) -> f64 {
    if max > 0.0 && norm > max {
        max / (norm + 1e-6)
    } else {
        1.0
    }
}

/// Global L2 norm of all gradients (f32 accumulated in f64).
pub fn grad_norm(grads: &Grads) -> candle_core::Result<f64> {
    let mut sq = 0f64;
    for g in grads.grads.iter().flatten() {
        sq += g.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    }
    Ok(sq.sqrt())
}

struct ParamState {
    index: usize,
    var: Var,
    decay: bool,
    /// f32 master copy (the weights the update is applied to).
    master: Tensor,
    m: Option<Tensor>,
    v: Option<Tensor>,
}

/// The optimiser over a model's trainable parameters.
pub struct Optimizer {
    cfg: OptimConfig,
    params: Vec<ParamState>,
    names: Vec<String>,
    /// Number of updates applied.
    pub steps: u64,
}

impl Optimizer {
    /// `vars[i]` is parameter i (named `names[i]`), matching the order of [`Grads`].
    pub fn new(cfg: OptimConfig, names: &[String], vars: &[&Var]) -> candle_core::Result<Self> {
        let mut params = Vec::with_capacity(vars.len());
        for (i, v) in vars.iter().enumerate() {
            let t = v.as_tensor();
            params.push(ParamState {
                index: i,
                var: (*v).clone(),
                decay: t.rank() >= 2,
                master: t.detach().to_dtype(DType::F32)?.copy()?,
                m: None,
                v: None,
            });
        }
        Ok(Self { cfg, params, names: names.to_vec(), steps: 0 })
    }

    /// Apply one update with learning rate `lr`, scaling gradients by `scale` first (clipping).
    pub fn step(&mut self, grads: &Grads, lr: f64, scale: f64) -> candle_core::Result<()> {
        self.steps += 1;
        let t = self.steps as i32;
        let [b1, b2] = self.cfg.betas;
        for p in &mut self.params {
            let Some(g) = grads.grads.get(p.index).and_then(|g| g.as_ref()) else { continue };
            let g = if scale != 1.0 { (g * scale)? } else { g.clone() };
            match self.cfg.name {
                OptimName::Sgd => {
                    p.master = (&p.master - (g * lr)?)?;
                }
                OptimName::Adamw => {
                    if p.decay && self.cfg.weight_decay > 0.0 {
                        p.master = (&p.master * (1.0 - lr * self.cfg.weight_decay))?;
                    }
                    let m = match &p.m {
                        Some(m) => ((m * b1)? + (&g * (1.0 - b1))?)?,
                        None => (&g * (1.0 - b1))?,
                    };
                    let v = match &p.v {
                        Some(v) => ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?,
                        None => (g.sqr()? * (1.0 - b2))?,
                    };
                    let m_hat = (&m / (1.0 - b1.powi(t)))?;
                    let v_hat = (&v / (1.0 - b2.powi(t)))?;
                    let update = (m_hat / (v_hat.sqrt()? + self.cfg.eps)?)?;
                    p.master = (&p.master - (update * lr)?)?;
                    p.m = Some(m);
                    p.v = Some(v);
                }
            }
            p.var.set(&p.master.to_dtype(p.var.dtype())?)?;
        }
        Ok(())
    }

    /// The optimiser state as named f32 tensors (master weights and moments) for a checkpoint.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for p in &self.params {
            let name = &self.names[p.index];
            out.push((format!("master.{name}"), p.master.clone()));
            if let Some(m) = &p.m {
                out.push((format!("exp_avg.{name}"), m.clone()));
            }
            if let Some(v) = &p.v {
                out.push((format!("exp_avg_sq.{name}"), v.clone()));
            }
        }
        out
    }

    /// Restore the state written by [`Optimizer::state_tensors`]; the model weights are set from the
    /// master copies so that a bf16 model resumes from its exact f32 weights.
    pub fn load_state(&mut self, mut get: impl FnMut(&str) -> Option<Tensor>, steps: u64) -> candle_core::Result<()> {
        for p in &mut self.params {
            let name = &self.names[p.index];
            let master = get(&format!("master.{name}"))
                .ok_or_else(|| candle_core::Error::Msg(format!("optimizer state has no master.{name}")))?;
            p.master = master.to_dtype(DType::F32)?.to_device(p.var.device())?;
            p.m = get(&format!("exp_avg.{name}")).map(|t| t.to_device(p.var.device())).transpose()?;
            p.v = get(&format!("exp_avg_sq.{name}")).map(|t| t.to_device(p.var.device())).transpose()?;
            p.var.set(&p.master.to_dtype(p.var.dtype())?)?;
        }
        self.steps = steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn grads(v: &[f32]) -> Grads {
        let mut g = Grads { grads: vec![None] };
        g.grads[0] = Some(Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap());
        g
    }

    #[test]
    fn adamw_matches_the_pytorch_update() {
        // torch.optim.AdamW(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), two steps on a
        // [2, 1] parameter [1, -2] with gradients [0.5, 0.25] then [-0.5, 1.0], computed by hand:
        let var = Var::from_slice(&[1.0f32, -2.0], (2, 1), &Device::Cpu).unwrap();
        let cfg = OptimConfig { lr: 0.1, weight_decay: 0.01, ..Default::default() };
        let mut opt = Optimizer::new(cfg, &["w".into()], &[&var]).unwrap();
        let g = |v: &[f32]| {
            let mut g = grads(v);
            g.grads[0] = Some(g.grads[0].take().unwrap().reshape((2, 1)).unwrap());
            g
        };
        opt.step(&g(&[0.5, 0.25]), 0.1, 1.0).unwrap();
        // step 1: w *= (1 - 0.001); m_hat = g, v_hat = g^2 -> update = sign(g) (up to eps)
        let w1: Vec<f32> = var.flatten_all().unwrap().to_vec1().unwrap();
        assert!((w1[0] - (1.0 * 0.999 - 0.1)).abs() < 1e-6 && (w1[1] - (-2.0 * 0.999 - 0.1)).abs() < 1e-6, "{w1:?}");
        opt.step(&g(&[-0.5, 1.0]), 0.1, 1.0).unwrap();
        let w2: Vec<f32> = var.flatten_all().unwrap().to_vec1().unwrap();
        let expect = |w: f64, g1: f64, g2: f64| {
            let w = w * 0.999;
            let m = 0.9 * 0.1 * g1 + 0.1 * g2;
            let v = 0.999 * 0.001 * g1 * g1 + 0.001 * g2 * g2;
            let (mh, vh) = (m / (1.0 - 0.81), v / (1.0 - 0.999f64.powi(2)));
            w - 0.1 * mh / (vh.sqrt() + 1e-8)
        };
        assert!((w2[0] as f64 - expect(w1[0] as f64, 0.5, -0.5)).abs() < 1e-5);
        assert!((w2[1] as f64 - expect(w1[1] as f64, 0.25, 1.0)).abs() < 1e-5);
    }

    #[test]
    fn bf16_models_keep_f32_master_weights() {
        let var = Var::from_slice(&[1.0f32], 1, &Device::Cpu).unwrap();
        let var = Var::from_tensor(&var.as_tensor().to_dtype(DType::BF16).unwrap()).unwrap();
        let mut opt =
            Optimizer::new(OptimConfig { name: OptimName::Sgd, ..Default::default() }, &["w".into()], &[&var]).unwrap();
        // 100 updates of 1e-4 each: lost entirely in bf16 (spacing 2^-7 near 1), kept in f32.
        for _ in 0..100 {
            opt.step(&grads(&[1.0]), 1e-4, 1.0).unwrap();
        }
        let state = opt.state_tensors();
        let master = state[0].1.to_vec1::<f32>().unwrap()[0];
        assert!((master - 0.99).abs() < 1e-5, "{master}");
        let w = var.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()[0];
        assert!((w - 0.99).abs() < 4e-3, "{w}");
    }

    #[test]
    fn schedules_and_norm() {
        let c = OptimConfig { lr: 1.0, warmup_steps: 2, schedule: Schedule::Cosine, ..Default::default() };
        assert_eq!(c.lr_at(0, 10), 0.5);
        assert_eq!(c.lr_at(1, 10), 1.0);
        assert!((c.lr_at(2, 10) - 1.0).abs() < 1e-12);
        assert!(c.lr_at(10, 10).abs() < 1e-12);
        let l = OptimConfig { lr: 1.0, schedule: Schedule::Linear, min_lr_ratio: 0.1, ..Default::default() };
        assert!((l.lr_at(5, 10) - 0.55).abs() < 1e-12);
        assert_eq!(OptimConfig { lr: 2.0, ..Default::default() }.lr_at(7, 10), 2.0);
        assert!((grad_norm(&grads(&[3.0, 4.0])).unwrap() - 5.0).abs() < 1e-9);
    }
}
