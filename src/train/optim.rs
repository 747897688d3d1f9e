//! Optimisers with f32 state whatever the model dtype: AdamW (f32 master weights and moments, decoupled
//! weight decay) and plain SGD; global gradient-norm clipping; learning-rate schedules.
//!
//! Every model keeps an f32 master copy of its weights (also an f32 model: one update path, and a bf16
//! model's small updates are not lost to rounding): the update reads the f32 gradient, updates the master
//! copy and the moments, and writes the master copy back into the model in its dtype. Where the state lives
//! is `optim.offload`: on the model's device, or in host memory, where the update runs in parallel over the
//! parameters (rayon) and only the new weights, in the model's dtype, go back to the device. The update is
//! the same candle operations in both places, so on the CPU device the two are bitwise identical.

use std::path::Path;
use std::rc::Rc;

use candle_core::{DType, Device, Tensor, Var};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::offload;
use super::zero::{self, Layout, Saved, Shard};
use crate::dist::World;
use crate::kernels;
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
    /// Keep the f32 master weights and the AdamW moments in host memory and run the update there (in
    /// parallel over the parameters); the device then holds only the weights, gradients and activations.
    /// Host memory: 12 bytes per parameter with AdamW (master, m, v), 4 with SGD, plus the gradients of
    /// the parameters in flight (the staging of [`crate::device::staging::staging_bytes`]). The updates are the same as
    /// without it.
    pub offload: bool,
    /// With `offload`, the f32 gradients of one chunk of the update, MiB: the gradients go down and the
    /// weights come up a chunk at a time through two staging slots ([`offload`]), page-locked on a GPU
    /// (4 times this in all). Smaller chunks hide more of the copies behind the update and pin less host
    /// memory; each chunk costs a few copies and waits.
    pub offload_chunk_mb: usize,
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
            offload: false,
            offload_chunk_mb: crate::device::staging::DEFAULT_CHUNK_MB,
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
        if self.offload_chunk_mb == 0 {
            return Err("optim.offload_chunk_mb must be at least 1".into());
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

/// Each gradient tensor's sum of squares, reduced on its device ([`kernels::sum_squares`], f32) and
/// stacked into one vector (`None` without gradients): read to the host at once, whatever the number of
/// tensors, and added there in f64 ([`norm_of_square_sums`]), they give the global L2 norm.
pub fn grad_square_sums(grads: &Grads) -> candle_core::Result<Option<Tensor>> {
    let sums: Vec<Tensor> =
        grads.grads.iter().flatten().map(kernels::sum_squares).collect::<candle_core::Result<_>>()?;
    if sums.is_empty() {
        return Ok(None);
    }
    Tensor::stack(&sums, 0).map(Some)
}

/// The L2 norm from the tensors' sums of squares, added in f64.
pub fn norm_of_square_sums(sums: &[f64]) -> f64 {
    sums.iter().sum::<f64>().sqrt()
}

/// Global L2 norm of all gradients in one host read ([`grad_square_sums`]). The clip factor
/// ([`clip_scale`]) and the bad-step check (a NaN or infinite gradient anywhere gives a non-finite norm)
/// come from it.
#[cfg(test)]
fn grad_norm(grads: &Grads) -> candle_core::Result<f64> {
    match grad_square_sums(grads)? {
        Some(sums) => Ok(norm_of_square_sums(&crate::device::to_host::<f64>(&sums.to_dtype(DType::F64)?)?)),
        None => Ok(0.0),
    }
}

/// The gradient's norm as [`Optimizer::reduce`] leaves it: its sums of squares still on the device (one
/// process: the step reads them with its statistics, in one transfer), or the norm itself, computed on
/// the host over the ranks' reduced blocks.
pub enum GradNorm {
    Device(Option<Tensor>),
    Host(f64),
}

struct ParamState {
    index: usize,
    /// Where this state starts in the flattened parameter (0 unless the state is sharded, [`zero`]).
    offset: usize,
    var: Var,
    decay: bool,
    /// The shape of the master copy: the parameter's, or a flat part of it when the state is sharded.
    shape: Vec<usize>,
    /// f32 `[rows, n]` on the state's device: the master copy (the weights the update is applied to),
    /// then, with AdamW, the first and second moments (zero until the parameter's first update), updated
    /// in place by [`kernels::adamw`].
    state: Tensor,
    /// Whether the moments hold an update (a checkpoint holds them from then on).
    moments: bool,
}

/// The hyper-parameters of one update.
#[derive(Clone, Copy)]
struct Update {
    name: OptimName,
    lr: f64,
    scale: f64,
    betas: [f64; 2],
    eps: f64,
    weight_decay: f64,
    /// 1-based step number (AdamW's bias correction).
    t: i32,
}

impl ParamState {
    /// The state of a parameter (or part of one) whose master copy is `master` (f32, on the state's
    /// device), with the moments `moments` (zero when `None`).
    fn new(
        index: usize,
        offset: usize,
        var: &Var,
        master: Tensor,
        moments: Option<(Tensor, Tensor)>,
        adam: bool,
    ) -> candle_core::Result<Self> {
        let shape = master.dims().to_vec();
        let n = master.elem_count();
        let mut rows = vec![master.flatten_all()?];
        let started = moments.is_some();
        if adam {
            match moments {
                Some((m, v)) => rows.extend([m.flatten_all()?, v.flatten_all()?]),
                None => rows.extend([
                    Tensor::zeros(n, DType::F32, master.device())?,
                    Tensor::zeros(n, DType::F32, master.device())?,
                ]),
            }
        }
        // A state of its own (one row of the master copy alone would be a view of the parameter).
        let state = if rows.len() == 1 { rows[0].unsqueeze(0)?.copy()? } else { Tensor::stack(&rows, 0)? };
        Ok(Self { index, offset, var: var.clone(), decay: var.rank() >= 2, shape, state, moments: started })
    }

    /// The state of parameter `index` before its first update, in host memory: its values in f32 and
    /// zero moments in one allocation, written by all the host's threads ([`HostState`]).
    fn in_host_memory(index: usize, var: &Var, adam: bool) -> candle_core::Result<Self> {
        let t = var.as_tensor().detach();
        let shape = t.dims().to_vec();
        let rows = if adam { 3 } else { 1 };
        let state = t.to_device(&Device::Cpu)?.apply_op1_no_bwd(&HostState(rows))?;
        Ok(Self { index, offset: 0, var: var.clone(), decay: var.rank() >= 2, shape, state, moments: false })
    }

    /// Apply one update with gradient `g` (f32, on the state's device) to the master copy and the
    /// moments, in place.
    fn update(&mut self, g: &Tensor, u: &Update) -> candle_core::Result<()> {
        let op = self.op(u);
        kernels::adamw(&self.state, g, &op)?;
        self.moments |= op.adam;
        Ok(())
    }

    /// The fused update's op for this parameter.
    fn op(&self, u: &Update) -> kernels::AdamW {
        kernels::AdamW {
            adam: u.name == OptimName::Adamw,
            scale: u.scale,
            lr: u.lr,
            weight_decay: if self.decay && u.weight_decay > 0.0 { u.weight_decay } else { 0.0 },
            betas: u.betas,
            eps: u.eps,
            t: u.t,
        }
    }

    /// The update of elements `start..start + g.len()` (the offloaded update's range of a parameter, in
    /// host memory): the values [`ParamState::update`] gives them; their new weights, rounded to the
    /// model's dtype, into `out` (the offloaded update's staging).
    fn update_range<T: offload::Staged>(
        &self,
        start: usize,
        g: &[f32],
        u: &Update,
        out: &mut [T],
    ) -> candle_core::Result<()> {
        kernels::adamw_host(&self.state, start, g, &self.op(u), (out, T::from_master))
    }

    /// The f32 master copy (a view of the state).
    fn master(&self) -> candle_core::Result<Tensor> {
        self.state.get(0)?.reshape(self.shape.as_slice())
    }

    /// The first and second moments (views of the state), once the parameter has been updated.
    fn moments(&self) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        if !self.moments {
            return Ok(None);
        }
        Ok(Some((
            self.state.get(1)?.reshape(self.shape.as_slice())?,
            self.state.get(2)?.reshape(self.shape.as_slice())?,
        )))
    }

    /// The master copy in the model's dtype, on the state's device (in host memory, converted by all the
    /// host's threads: candle's conversion runs on one).
    fn weights(&self) -> candle_core::Result<Tensor> {
        let master = self.master()?;
        match (master.device(), self.var.dtype()) {
            (Device::Cpu, DType::BF16 | DType::F16) => master.apply_op1_no_bwd(&HostCast(self.var.dtype())),
            _ => master.to_dtype(self.var.dtype()),
        }
    }
}

/// The chunks of the offloaded update ([`Optimizer::step_on_host`]) through `staging`: chunk i's
/// gradients are downloaded while chunk i - 1 is updated on the host, then its weights uploaded while
/// chunk i + 1 is updated. `states[k]` and `grads[k]` (`sizes[k]` elements) are one parameter's, in
/// chunks of `chunk` elements. Returns whether the update wrote moments.
fn offload_chunks<T: offload::Staged>(
    staging: &mut offload::Staging,
    states: &[&ParamState],
    grads: &[&Tensor],
    (sizes, chunk): (&[usize], usize),
    u: &Update,
) -> candle_core::Result<bool> {
    let chunks = offload::chunks(sizes, chunk);
    let vars: Vec<&Var> = states.iter().map(|p| &p.var).collect();
    if let Some(first) = chunks.first() {
        let _phase = crate::profile::phase("gradients to host");
        staging.download(0, first, grads)?;
    }
    for (c, chunk) in chunks.iter().enumerate() {
        if let Some(next) = chunks.get(c + 1) {
            let _phase = crate::profile::phase("gradients to host");
            staging.download(c + 1, next, grads)?;
        }
        let phase = crate::profile::phase("update on the host");
        let (g, w) = staging.slot::<T>(c)?;
        let mut outs = Vec::with_capacity(chunk.len());
        let mut rest = &mut w[..];
        for p in chunk {
            let (out, tail) = std::mem::take(&mut rest).split_at_mut(p.len);
            outs.push(out);
            rest = tail;
        }
        (chunk.par_iter().zip(outs))
            .try_for_each(|(p, out)| states[p.param].update_range(p.start, &g[p.at..p.at + p.len], u, out))?;
        drop(phase);
        let _phase = crate::profile::phase("weights to device");
        staging.upload::<T>(c, chunk, &vars)?;
    }
    staging.finish()?;
    Ok(u.name == OptimName::Adamw && !chunks.is_empty())
}

/// f32 to bf16/f16 in host memory, in blocks over rayon's threads, rounded as candle's conversion rounds
/// (to nearest even).
struct HostCast(DType);

impl candle_core::CustomOp1 for HostCast {
    fn name(&self) -> &'static str {
        "host-cast"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::CpuStorage as S;
        let (S::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("host-cast takes contiguous f32")
        };
        fn cast<T: Send>(v: &[f32], f: fn(f32) -> T) -> Vec<T> {
            let mut out = Vec::with_capacity(v.len());
            out.par_extend(v.par_iter().with_min_len(1 << 16).map(|&x| f(x)));
            out
        }
        let out = match self.0 {
            DType::BF16 => S::BF16(cast(&v[a..b], half::bf16::from_f32)),
            DType::F16 => S::F16(cast(&v[a..b], half::f16::from_f32)),
            d => candle_core::bail!("host-cast to {d:?}"),
        };
        Ok((out, l.shape().clone()))
    }
}

/// A fresh optimiser state in host memory, `[rows, n]` f32: the parameter's `n` values (f32, bf16 or f16)
/// in row 0 and zeros below, every element written by all the host's threads (so that its pages are
/// mapped here, in parallel, rather than by the first update). The composite (a conversion, two zero
/// tensors and a stack, each on one thread) grew with the parameters on one thread: 22-28 s of setup
/// against 12-13 s for 0.7 B parameters on two cores (benches/results/host-state-cpu-2026-11-27.txt).
struct HostState(usize);

impl candle_core::CustomOp1 for HostState {
    fn name(&self) -> &'static str {
        "host-state"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::CpuStorage as S;
        let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("host-state takes contiguous values") };
        let rows = self.0.max(1);
        fn state<T: Copy + Sync>(src: &[T], rows: usize, f: fn(T) -> f32) -> Vec<f32> {
            let n = src.len();
            let mut out = Vec::with_capacity(rows * n);
            out.par_extend((0..rows * n).into_par_iter().with_min_len(1 << 16).map(|i| match src.get(i) {
                Some(&x) => f(x),
                None => 0.0,
            }));
            out
        }
        let out = match s {
            S::F32(v) => state(&v[a..b], rows, |x| x),
            S::BF16(v) => state(&v[a..b], rows, half::bf16::to_f32),
            S::F16(v) => state(&v[a..b], rows, half::f16::to_f32),
            _ => candle_core::bail!("host-state takes f32, bf16 or f16 values"),
        };
        Ok((S::F32(out), candle_core::Shape::from((rows, b - a))))
    }
}

/// The optimiser over a model's trainable parameters.
pub struct Optimizer {
    cfg: OptimConfig,
    /// The state of each parameter, or, when sharded, of each part of a parameter in this rank's block.
    params: Vec<ParamState>,
    names: Vec<String>,
    /// The ranks the state is sharded over (ZeRO-1), when there are several.
    shard: Option<Shard>,
    /// Number of updates applied.
    pub steps: u64,
    /// The offloaded update's staging slots, kept from step to step.
    staging: Option<offload::Staging>,
}

/// A step's gradients, reduced over the ranks: the whole gradient (one process), or the sum over the
/// ranks of this rank's block of the flat gradient (sharded state).
pub enum Reduced {
    Whole(Grads),
    Shard(Vec<f32>),
}

/// The saved master weights of parameter `name` (cast to the model's dtype) against the checkpoint's model
/// weights: they agree to the rounding of the save dtype (`train.save_dtype` may be coarser than the
/// training one), or the two files come from different checkpoints, which is refused.
fn check_agree(name: &str, master: &Tensor, model: &Tensor) -> candle_core::Result<Result<(), String>> {
    let (a, b) = (master.to_dtype(DType::F32)?, model.to_dtype(DType::F32)?);
    let scale = a.abs()?.max_all()?.to_scalar::<f32>()?;
    let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    if diff <= 5e-3 * scale + 1e-6 {
        return Ok(Ok(()));
    }
    Ok(Err(format!(
        "the master weights of {name} differ from the model's by up to {diff:e} (the largest is {scale:e}): the \
         optimizer state and the model weights come from different checkpoints"
    )))
}

impl Optimizer {
    /// `vars[i]` is parameter i (named `names[i]`), matching the order of [`Grads`]. The state is made on
    /// the parameters' device, or in host memory with `cfg.offload`.
    pub fn new(cfg: OptimConfig, names: &[String], vars: &[&Var]) -> candle_core::Result<Self> {
        let mut params = Vec::with_capacity(vars.len());
        for (i, v) in vars.iter().enumerate() {
            let t = v.as_tensor();
            let adam = cfg.name == OptimName::Adamw;
            params.push(match cfg.offload || t.device().is_cpu() {
                true => ParamState::in_host_memory(i, v, adam)?,
                false => ParamState::new(i, 0, v, t.detach().to_dtype(DType::F32)?, None, adam)?,
            });
        }
        Ok(Self { cfg, params, names: names.to_vec(), shard: None, steps: 0, staging: None })
    }

    /// Shard the state over the ranks of `world` (ZeRO-1, [`zero`]): this rank keeps the state of its block
    /// of the flat parameters only. Before the first update; nothing changes for a single process.
    pub fn shard_over(&mut self, world: Rc<World>) -> candle_core::Result<()> {
        if world.size() <= 1 || self.shard.is_some() {
            return Ok(());
        }
        if self.steps > 0 {
            candle_core::bail!("the optimizer state can only be sharded before the first update");
        }
        let vars: Vec<Var> = self.params.iter().map(|p| p.var.clone()).collect();
        let shard = Shard::new(world, &self.names, &vars);
        let mut params = Vec::new();
        for piece in shard.layout().pieces(shard.range()) {
            let var = &vars[piece.param];
            let flat = var.as_tensor().detach().flatten_all()?.narrow(0, piece.offset, piece.len)?;
            let master = flat.to_dtype(DType::F32)?.to_device(&self.state_device(var))?;
            params.push(ParamState::new(
                piece.param,
                piece.offset,
                var,
                master,
                None,
                self.cfg.name == OptimName::Adamw,
            )?);
        }
        self.params = params;
        self.shard = Some(shard);
        Ok(())
    }

    /// Whether each rank keeps only its block of the state.
    pub fn is_sharded(&self) -> bool {
        self.shard.is_some()
    }

    /// The gradients reduced over the ranks (a reduce-scatter when sharded; `grads` already hold the
    /// global batch's gradient otherwise) and their global norm.
    pub fn reduce(&self, grads: Grads) -> candle_core::Result<(Reduced, GradNorm)> {
        match &self.shard {
            None => {
                let sums = grad_square_sums(&grads)?;
                Ok((Reduced::Whole(grads), GradNorm::Device(sums)))
            }
            Some(shard) => {
                let (mine, norm) = shard.reduce(&grads)?;
                Ok((Reduced::Shard(mine), GradNorm::Host(norm)))
            }
        }
    }

    /// Apply one update with the reduced gradients (see [`Optimizer::step`]); when sharded, every rank's
    /// new weights are then gathered into every rank's model.
    pub fn update(&mut self, grads: &Reduced, lr: f64, scale: f64) -> candle_core::Result<()> {
        match grads {
            Reduced::Whole(g) => self.step(g, lr, scale),
            Reduced::Shard(g) => self.step_shard(g, lr, scale),
        }
    }

    /// The hyper-parameters of the next update.
    fn next_update(&mut self, lr: f64, scale: f64) -> Update {
        self.steps += 1;
        Update {
            name: self.cfg.name,
            lr,
            scale,
            betas: self.cfg.betas,
            eps: self.cfg.eps,
            weight_decay: self.cfg.weight_decay,
            t: self.steps as i32,
        }
    }

    /// The update of this rank's block with its gradient `g` (the reduced flat block), then the all-gather
    /// of the new weights.
    fn step_shard(&mut self, g: &[f32], lr: f64, scale: f64) -> candle_core::Result<()> {
        let u = self.next_update(lr, scale);
        let Some(shard) = &self.shard else { candle_core::bail!("the optimizer state is not sharded") };
        let (layout, first) = (shard.layout(), shard.range().start);
        let offload = self.cfg.offload;
        let work = |p: &mut ParamState| -> candle_core::Result<Vec<f32>> {
            let a = layout.start(p.index) + p.offset - first;
            let n = p.shape.iter().product::<usize>();
            let device = if offload { Device::Cpu } else { p.var.device().clone() };
            p.update(&Tensor::from_slice(&g[a..a + n], n, &device)?, &u)?;
            p.master()?.to_device(&Device::Cpu)?.to_vec1::<f32>()
        };
        let new: Vec<Vec<f32>> = if offload {
            self.params.par_iter_mut().map(work).collect::<candle_core::Result<_>>()?
        } else {
            self.params.iter_mut().map(work).collect::<candle_core::Result<_>>()?
        };
        shard.gather(&new.concat())
    }

    /// Where the state lives: host memory (`optim.offload`) or the model's device.
    fn state_device(&self, var: &Var) -> Device {
        if self.cfg.offload {
            Device::Cpu
        } else {
            var.device().clone()
        }
    }

    /// Apply one update with learning rate `lr`, scaling gradients by `scale` first (clipping).
    pub fn step(&mut self, grads: &Grads, lr: f64, scale: f64) -> candle_core::Result<()> {
        if self.shard.is_some() {
            candle_core::bail!("a sharded optimizer updates with its block of the reduced gradient");
        }
        let u = self.next_update(lr, scale);
        if self.cfg.offload {
            return self.step_on_host(grads, &u);
        }
        for p in &mut self.params {
            let Some(g) = grads.grads.get(p.index).and_then(|g| g.as_ref()) else { continue };
            p.update(g, &u)?;
            p.var.set(&p.weights()?)?;
        }
        Ok(())
    }

    /// The update with the state in host memory ([`offload`]): the gradients go down to the host in
    /// chunks through two staging slots, each chunk's parameters are updated in parallel while the next
    /// chunk's gradients come down, and the new weights go back into the parameters in the model's dtype.
    fn step_on_host(&mut self, grads: &Grads, u: &Update) -> candle_core::Result<()> {
        let todo: Vec<(usize, &Tensor)> = (self.params.iter().enumerate())
            .filter_map(|(i, p)| grads.grads.get(p.index).and_then(|g| g.as_ref()).map(|g| (i, g)))
            .collect();
        let Some(&(first, _)) = todo.first() else { return Ok(()) };
        let (device, dtype) = (self.params[first].var.device().clone(), self.params[first].var.dtype());
        if let Some(&(i, _)) = todo.iter().find(|&&(i, _)| self.params[i].var.dtype() != dtype) {
            candle_core::bail!(
                "the offloaded update takes parameters of one dtype: {:?} and {:?}",
                dtype,
                self.params[i].var.dtype()
            );
        }
        let sizes: Vec<usize> = todo.iter().map(|(_, g)| g.elem_count()).collect();
        let len = crate::device::staging::chunk_len(sizes.iter().sum(), self.cfg.offload_chunk_mb);
        if len == 0 {
            return Ok(());
        }
        let grads: Vec<Tensor> = todo
            .iter()
            .map(|(_, g)| g.flatten_all().and_then(|g| g.contiguous()))
            .collect::<candle_core::Result<_>>()?;
        let grads: Vec<&Tensor> = grads.iter().collect();
        let staging = match self.staging.take() {
            Some(s) if s.serves(&device, dtype, len) => s,
            _ => offload::Staging::new(&device, dtype, len)?,
        };
        let staging = self.staging.insert(staging);
        let states: Vec<&ParamState> = todo.iter().map(|&(i, _)| &self.params[i]).collect();
        let moments = match dtype {
            DType::BF16 => offload_chunks::<half::bf16>(staging, &states, &grads, (&sizes, len), u)?,
            DType::F16 => offload_chunks::<half::f16>(staging, &states, &grads, (&sizes, len), u)?,
            DType::F32 => offload_chunks::<f32>(staging, &states, &grads, (&sizes, len), u)?,
            d => candle_core::bail!("the offloaded update of {d:?} weights"),
        };
        for &(i, _) in &todo {
            self.params[i].moments |= moments;
        }
        Ok(())
    }

    /// The optimiser state as named f32 tensors (master weights and moments) for a checkpoint: a tensor
    /// per parameter and part (the same wherever the state lives, so a run may resume with `optim.offload`
    /// switched), or, when sharded, this rank's block ([`zero::shard_tensors`]).
    pub fn state_tensors(&self) -> candle_core::Result<Vec<(String, Tensor)>> {
        if let Some(shard) = &self.shard {
            let masters = self.params.iter().map(ParamState::master).collect::<candle_core::Result<Vec<_>>>()?;
            let mut parts = vec![(zero::MASTER, masters)];
            if self.steps > 0 {
                let moments = self.params.iter().map(ParamState::moments).collect::<candle_core::Result<Vec<_>>>()?;
                if let Some(moments) = moments.into_iter().collect::<Option<Vec<_>>>() {
                    let (m, v): (Vec<Tensor>, Vec<Tensor>) = moments.into_iter().unzip();
                    parts.extend([(zero::EXP_AVG, m), (zero::EXP_AVG_SQ, v)]);
                }
            }
            return zero::shard_tensors(parts, shard.range(), shard.layout().total());
        }
        let mut out = Vec::new();
        for p in &self.params {
            let name = &self.names[p.index];
            out.push((format!("{}.{name}", zero::MASTER), p.master()?));
            if let Some((m, v)) = p.moments()? {
                out.push((format!("{}.{name}", zero::EXP_AVG), m));
                out.push((format!("{}.{name}", zero::EXP_AVG_SQ), v));
            }
        }
        Ok(out)
    }

    /// Restore the state that checkpoint `ck` holds, written by any number of ranks (re-sharded to this
    /// optimizer's block), placed on the device or in host memory as `optim.offload` now says; the model
    /// weights are set from the master copies, so that a bf16 model resumes from its exact f32 weights.
    pub(super) fn load_saved(&mut self, ck: &Path, steps: u64) -> Result<(), String> {
        let whole;
        let layout = match &self.shard {
            Some(s) => s.layout(),
            None => {
                whole = Layout::new(&self.names, self.params.iter().map(|p| p.var.dims().to_vec()).collect());
                &whole
            }
        };
        let saved = Saved::open(ck, layout)?;
        let text = |e: candle_core::Error| e.to_string();
        let mut masters = Vec::new();
        let adam = self.cfg.name == OptimName::Adamw;
        for p in &mut self.params {
            let (start, shape) = (layout.start(p.index) + p.offset, p.shape.clone());
            let device = if self.cfg.offload { Device::Cpu } else { p.var.device().clone() };
            let read = |part: &str| -> Result<Option<Tensor>, String> {
                let values = saved.read(layout, part, start..start + shape.iter().product::<usize>())?;
                values.map(|v| Tensor::from_vec(v, shape.as_slice(), &device).map_err(text)).transpose()
            };
            let master = read(zero::MASTER)?.ok_or_else(|| format!("no master weights for {}", self.names[p.index]))?;
            let moments = read(zero::EXP_AVG)?.zip(read(zero::EXP_AVG_SQ)?);
            *p = ParamState::new(p.index, p.offset, &p.var, master, moments, adam).map_err(text)?;
            match &self.shard {
                Some(_) => masters.extend(
                    p.master()
                        .and_then(|t| t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>())
                        .map_err(text)?,
                ),
                None => {
                    let weights = p.weights().and_then(|w| w.to_device(p.var.device())).map_err(text)?;
                    check_agree(&self.names[p.index], &weights, p.var.as_tensor()).map_err(text)??;
                    p.var.set(&weights).map_err(text)?
                }
            }
        }
        if let Some(shard) = &self.shard {
            shard.gather(&masters).map_err(text)?;
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
        let state = opt.state_tensors().unwrap();
        let master = state[0].1.to_vec1::<f32>().unwrap()[0];
        assert!((master - 0.99).abs() < 1e-5, "{master}");
        let w = var.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()[0];
        assert!((w - 0.99).abs() < 4e-3, "{w}");
    }

    /// Bit patterns of a tensor's values (as f32).
    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// A matrix and a vector parameter in `dtype`, and `steps` seeded gradients for them.
    fn problem(dtype: DType, steps: usize) -> (Vec<Var>, Vec<Grads>) {
        problem_of(dtype, steps, (3, 4))
    }

    /// A matrix `w` of `(rows, cols)` and a vector `b` of `cols`, with `steps` gradients.
    fn problem_of(dtype: DType, steps: usize, (rows, cols): (usize, usize)) -> (Vec<Var>, Vec<Grads>) {
        let vals =
            |n: usize, k: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7 + k * 13) % 17) as f32 / 8.0 - 1.0).collect() };
        let n = rows * cols;
        let w = Var::from_tensor(
            &Tensor::from_vec(vals(n, 0), (rows, cols), &Device::Cpu).unwrap().to_dtype(dtype).unwrap(),
        );
        let b =
            Var::from_tensor(&Tensor::from_vec(vals(cols, 1), cols, &Device::Cpu).unwrap().to_dtype(dtype).unwrap());
        let grads = (0..steps)
            .map(|s| Grads {
                grads: vec![
                    Some(Tensor::from_vec(vals(n, s + 2), (rows, cols), &Device::Cpu).unwrap()),
                    // The vector has no gradient on odd steps (a parameter the loss did not reach).
                    (s % 2 == 0).then(|| Tensor::from_vec(vals(cols, s + 3), cols, &Device::Cpu).unwrap()),
                ],
            })
            .collect();
        (vec![w.unwrap(), b.unwrap()], grads)
    }

    /// Offloaded, in one chunk or in chunks of 1 MiB of gradients that split the parameters (the 600k
    /// elements of `w` over three chunks, the last shared with `b`), the state and the weights are bit
    /// for bit the update's on the device.
    #[test]
    fn offloaded_updates_are_bitwise_the_same() {
        for name in [OptimName::Adamw, OptimName::Sgd] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let run = |offload: bool, offload_chunk_mb: usize| {
                    let cfg = OptimConfig {
                        name,
                        lr: 0.01,
                        weight_decay: 0.1,
                        offload,
                        offload_chunk_mb,
                        ..Default::default()
                    };
                    let (vars, grads) = problem_of(dtype, 3, (600, 1000));
                    let mut opt = Optimizer::new(cfg, &["w".into(), "b".into()], &[&vars[0], &vars[1]]).unwrap();
                    for (i, g) in grads.iter().enumerate() {
                        opt.step(g, 0.01 * (i + 1) as f64, if i == 2 { 0.5 } else { 1.0 }).unwrap();
                    }
                    let state: Vec<Vec<u32>> = opt.state_tensors().unwrap().iter().map(|(_, t)| bits(t)).collect();
                    (state, vars.iter().map(|v| bits(v.as_tensor())).collect::<Vec<_>>())
                };
                let off = run(false, 1);
                for chunk_mb in [256, 1] {
                    let on = run(true, chunk_mb);
                    assert!(on == off, "{name:?} {dtype:?} chunks of {chunk_mb} MiB");
                    assert_eq!(on.0.len(), if name == OptimName::Adamw { 6 } else { 2 });
                }
            }
        }
    }

    #[test]
    fn a_resume_may_switch_offload() {
        for dtype in [DType::F32, DType::BF16] {
            let (vars, grads) = problem(dtype, 4);
            let names = ["w".to_string(), "b".to_string()];
            let cfg = |offload| OptimConfig { lr: 0.01, offload, ..Default::default() };
            // Straight through without offload.
            let mut straight = Optimizer::new(cfg(false), &names, &[&vars[0], &vars[1]]).unwrap();
            for g in &grads {
                straight.step(g, 0.01, 1.0).unwrap();
            }
            // Two steps offloaded, then the state handed to a fresh optimiser that does not offload, and back.
            let (vars2, _) = problem(dtype, 0);
            let mut first = Optimizer::new(cfg(true), &names, &[&vars2[0], &vars2[1]]).unwrap();
            first.step(&grads[0], 0.01, 1.0).unwrap();
            first.step(&grads[1], 0.01, 1.0).unwrap();
            let dir = tempfile::tempdir().unwrap();
            let save = |o: &Optimizer| {
                let t = o.state_tensors().unwrap();
                let p = dir.path().join(zero::WHOLE_FILE);
                safetensors::serialize_to_file(t.iter().map(|(n, t)| (n.as_str(), t)), None, &p).unwrap();
            };
            save(&first);
            let mut second = Optimizer::new(cfg(false), &names, &[&vars2[0], &vars2[1]]).unwrap();
            second.load_saved(dir.path(), 2).unwrap();
            second.step(&grads[2], 0.01, 1.0).unwrap();
            save(&second);
            let mut third = Optimizer::new(cfg(true), &names, &[&vars2[0], &vars2[1]]).unwrap();
            third.load_saved(dir.path(), 3).unwrap();
            third.step(&grads[3], 0.01, 1.0).unwrap();
            let state = |o: &Optimizer| o.state_tensors().unwrap().iter().map(|(_, t)| bits(t)).collect::<Vec<_>>();
            assert_eq!(state(&straight), state(&third), "{dtype:?}");
            for (a, b) in vars.iter().zip(&vars2) {
                assert_eq!(bits(a.as_tensor()), bits(b.as_tensor()), "{dtype:?}");
            }
        }
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
        // Several tensors, one of them bf16: the f64 sum of their squares, read to the host once.
        let parts =
            [Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap(), Tensor::new(&[[3f32], [4.0]], &Device::Cpu).unwrap()];
        let g = Grads { grads: vec![Some(parts[0].clone()), None, Some(parts[1].to_dtype(DType::BF16).unwrap())] };
        let reads = crate::device::host_reads();
        assert!((grad_norm(&g).unwrap() - 30f64.sqrt()).abs() < 1e-12);
        assert_eq!(crate::device::host_reads() - reads, 1);
        assert_eq!(grad_norm(&Grads::new(3)).unwrap(), 0.0);
        let inf = Grads { grads: vec![Some(Tensor::new(&[f32::INFINITY], &Device::Cpu).unwrap())] };
        assert!(!grad_norm(&inf).unwrap().is_finite() && clip_scale(7.0, 1.0) < 1.0 / 7.0 + 1e-9);
    }
}
