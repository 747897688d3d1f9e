//! The optimiser's update (AdamW or SGD) in one pass over a parameter's f32 state, in place: the master
//! weights and AdamW's two moments stacked as `state` `[rows, n]` (rows 1 for SGD, 3 for AdamW), the
//! gradient `g` `[n]` in f32. It replaces the ~15 composite candle ops per parameter of
//! [`adamw_reference`] (each a pass over the arrays, and on the host a fresh allocation) with one pass,
//! split over the host's threads in blocks, or one kernel launch (kernels/adamw.cu) on a GPU.
//!
//! Each product and sum is rounded on its own in the reference's order, so the fused update equals the
//! composite one bit for bit (tested), on the host and on the emulator, and the state of a run that moves
//! its optimiser between the device and the host (`optim.offload`) does not change.

use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

#[cfg(any(test, feature = "cuda"))]
use super::launch::{Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// The hyper-parameters of one update, as the composite ops round them (f64 settings cast to f32).
#[derive(Debug, Clone, Copy)]
pub struct AdamW {
    /// AdamW (moments in rows 1 and 2 of the state), or SGD (the master weights only).
    pub adam: bool,
    /// The gradient's scale (clipping); 1 leaves it as it is.
    pub scale: f64,
    pub lr: f64,
    /// Decoupled weight decay: the weights are multiplied by `1 - lr * weight_decay` first (0: this
    /// parameter does not decay).
    pub weight_decay: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    /// 1-based step number (bias correction).
    pub t: i32,
}

/// The update's constants in f32, computed from [`AdamW`] as candle's affine ops cast them.
#[derive(Debug, Clone, Copy)]
struct Consts {
    adam: bool,
    /// Whether the weights decay and the gradient is scaled (decided on the f64 settings, as the
    /// composite update decides whether to run those ops).
    decayed: bool,
    scaled: bool,
    scale: f32,
    lr: f32,
    decay: f32,
    b1: f32,
    c1: f32,
    b2: f32,
    c2: f32,
    ib1: f32,
    ib2: f32,
    eps: f32,
}

impl AdamW {
    fn consts(&self) -> Consts {
        let [b1, b2] = self.betas;
        Consts {
            adam: self.adam,
            decayed: self.weight_decay != 0.0,
            scaled: self.scale != 1.0,
            scale: self.scale as f32,
            lr: self.lr as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            b1: b1 as f32,
            c1: (1.0 - b1) as f32,
            b2: b2 as f32,
            c2: (1.0 - b2) as f32,
            ib1: (1.0 / (1.0 - b1.powi(self.t))) as f32,
            ib2: (1.0 / (1.0 - b2.powi(self.t))) as f32,
            eps: self.eps as f32,
        }
    }

    fn rows(&self) -> usize {
        if self.adam {
            3
        } else {
            1
        }
    }
}

impl Consts {
    /// kernels/adamw.cu's `flags`: 1 AdamW, 2 decayed, 4 scaled.
    #[cfg(any(test, feature = "cuda"))]
    fn flags(&self) -> u32 {
        self.adam as u32 | (self.decayed as u32) << 1 | (self.scaled as u32) << 2
    }
}

/// `x * mul + 0`, as candle's affine op computes a tensor times a scalar.
#[inline(always)]
fn affine(x: f32, mul: f32) -> f32 {
    x * mul + 0.0
}

/// Elements per block of the host's parallel update: large enough that a thread streams, small enough
/// that every thread gets work on a layer's smaller tensors.
const HOST_BLOCK: usize = 1 << 16;

/// The update of `p` (master weights), `m`, `v` (empty for SGD) with gradient `g`, elementwise.
fn update_block(c: &Consts, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    let grad = |gi: f32| if c.scaled { affine(gi, c.scale) } else { gi };
    if !c.adam {
        for (p, &g) in p.iter_mut().zip(g) {
            *p -= affine(grad(g), c.lr);
        }
        return;
    }
    for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        let g = grad(g);
        let w = if c.decayed { affine(*p, c.decay) } else { *p };
        *m = affine(*m, c.b1) + affine(g, c.c1);
        *v = affine(*v, c.b2) + affine(g * g, c.c2);
        let den = affine(*v, c.ib2).sqrt() + c.eps;
        *p = w - affine(affine(*m, c.ib1) / den, c.lr);
    }
}

/// The update of the whole state `[rows, n]` on the host, blocks of [`HOST_BLOCK`] over rayon's threads.
fn update_host(c: &Consts, state: &mut [f32], g: &[f32]) {
    update_range::<f32, fn(f32) -> f32>(c, state, (g.len(), 0), g, None);
}

/// New weights written by the host's update as it goes: `out[k]` = `round(master[start + k])` (`round`
/// a function item or closure, inlined into the block's loop).
type WeightsOut<'a, T, R> = (&'a mut [T], R);

/// The update of elements `start..start + g.len()` of the state `[rows, n]` (`at` = (n, start)) on the
/// host, blocks of [`HOST_BLOCK`] over rayon's threads; each block's new master weights also rounded into
/// `out` while they are in cache.
fn update_range<T: Send, R: Fn(f32) -> T + Sync>(
    c: &Consts,
    state: &mut [f32],
    (n, start): (usize, usize),
    g: &[f32],
    out: Option<WeightsOut<'_, T, R>>,
) {
    let len = g.len();
    let (p, rest) = state[start..].split_at_mut(len);
    let (m, v) = match c.adam {
        true => {
            let (m, rest) = rest[n - len..].split_at_mut(len);
            (m, &mut rest[n - len..n])
        }
        false => (&mut [][..], &mut [][..]),
    };
    let count = len.div_ceil(HOST_BLOCK);
    // A slice's blocks, or as many empty ones (SGD's moments; no weights to write).
    fn blocks<T>(s: &mut [T], count: usize) -> Vec<&mut [T]> {
        match s.is_empty() {
            true => (0..count).map(|_| &mut [][..]).collect(),
            false => s.chunks_mut(HOST_BLOCK).collect(),
        }
    }
    let (out, round) = match out {
        Some((o, round)) => (o, Some(round)),
        None => (&mut [][..], None),
    };
    let (ps, ms, vs, outs) = (blocks(p, count), blocks(m, count), blocks(v, count), blocks(out, count));
    (ps.into_par_iter().zip(g.par_chunks(HOST_BLOCK)).zip(ms).zip(vs).zip(outs)).for_each(|((((p, g), m), v), o)| {
        update_block(c, p, m, v, g);
        if let Some(round) = &round {
            o.iter_mut().zip(p.iter()).for_each(|(o, &x)| *o = round(x));
        }
    });
}

/// Checks `state` `[rows, n]` and `g` `[n]` (both contiguous f32); returns n.
fn dims(op: &AdamW, state: &Layout, g: &Layout) -> Result<usize> {
    let n = g.shape().elem_count();
    if state.shape().dims() != [op.rows(), n] {
        candle_core::bail!(
            "optimizer state of shape {:?} for a gradient of {n} elements: expected [{}, {n}]",
            state.shape().dims(),
            op.rows()
        );
    }
    if !state.is_contiguous() || !g.is_contiguous() {
        candle_core::bail!("the optimizer state and the gradient must be contiguous");
    }
    Ok(n)
}

impl InplaceOp2 for AdamW {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let n = dims(self, dst_l, gl)?;
        let (CpuStorage::F32(state), CpuStorage::F32(g)) = (dst, g) else {
            candle_core::bail!("the optimizer state and the gradient must be f32")
        };
        let (a, ga) = (dst_l.start_offset(), gl.start_offset());
        update_host(&self.consts(), &mut state[a..a + self.rows() * n], &g[ga..ga + n]);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let n = dims(self, dst_l, gl)?;
        let plan = adamw_plan(self, n)?;
        // The state is the plan's first input, written in place by the kernel.
        super::cuda::run(&plan, &[(&*dst, dst_l), (g, gl)])?;
        Ok(())
    }
}

/// The update of a range of a host state by gradient values in host memory ([`adamw_host`]), and the
/// new weights it writes.
struct HostRange<'a, T, R> {
    op: &'a AdamW,
    start: usize,
    g: &'a [f32],
    out: std::cell::RefCell<Option<WeightsOut<'a, T, R>>>,
}

impl<T: Send, R: Fn(f32) -> T + Sync> InplaceOp1 for HostRange<'_, T, R> {
    fn name(&self) -> &'static str {
        "adamw-host"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, l: &Layout) -> Result<()> {
        let (rows, n) = l.shape().dims2()?;
        let (start, len) = (self.start, self.g.len());
        if rows != self.op.rows() || start + len > n || !l.is_contiguous() {
            candle_core::bail!(
                "optimizer state of shape {:?} (contiguous: {}) for elements {start}..{} of {} rows",
                l.dims(),
                l.is_contiguous(),
                start + len,
                self.op.rows()
            );
        }
        let CpuStorage::F32(state) = dst else { candle_core::bail!("the optimizer state must be f32") };
        let a = l.start_offset();
        update_range(&self.op.consts(), &mut state[a..a + rows * n], (n, start), self.g, self.out.borrow_mut().take());
        Ok(())
    }
}

/// One update of elements `start..start + g.len()` of `state` `[rows, n]` (f32, in host memory) with the
/// gradient values `g` (host memory), in place: the offloaded update of a range of a parameter, the same
/// values [`adamw`] gives those elements. The new master weights are also written into `weights`
/// (`g.len()` of them), rounded by `round`, block by block while they are in cache.
pub fn adamw_host<T: Send, R: Fn(f32) -> T + Sync>(
    state: &Tensor,
    start: usize,
    g: &[f32],
    op: &AdamW,
    (weights, round): (&mut [T], R),
) -> Result<()> {
    if weights.len() != g.len() {
        candle_core::bail!("{} weights written for a gradient of {}", weights.len(), g.len());
    }
    state.inplace_op1(&HostRange { op, start, g, out: std::cell::RefCell::new(Some((weights, round))) })
}

/// One update of `state` `[rows, n]` (f32: master weights, then AdamW's moments) with the gradient `g`
/// (f32, `n` elements, any shape), in place, on the state's device.
pub fn adamw(state: &Tensor, g: &Tensor, op: &AdamW) -> Result<()> {
    let g = g.flatten_all()?.contiguous()?;
    state.inplace_op2(&g, op)
}

/// The same from candle's composite ops over the separate tensors (what the optimiser ran before the
/// fused op; the reference it is tested against): returns the new master weights and moments.
pub fn adamw_reference(
    master: &Tensor,
    moments: Option<(&Tensor, &Tensor)>,
    g: &Tensor,
    op: &AdamW,
) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
    let g = if op.scale != 1.0 { (g * op.scale)? } else { g.clone() };
    let lr = op.lr;
    if !op.adam {
        return Ok(((master - (g * lr)?)?, None));
    }
    let [b1, b2] = op.betas;
    let master = if op.weight_decay != 0.0 { (master * (1.0 - lr * op.weight_decay))? } else { master.clone() };
    let (m, v) = match moments {
        Some((m, v)) => (((m * b1)? + (&g * (1.0 - b1))?)?, ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?),
        None => ((&g * (1.0 - b1))?, (g.sqr()? * (1.0 - b2))?),
    };
    let m_hat = (&m / (1.0 - b1.powi(op.t)))?;
    let v_hat = (&v / (1.0 - b2.powi(op.t)))?;
    let update = (m_hat / (v_hat.sqrt()? + op.eps)?)?;
    Ok(((master - (update * lr)?)?, Some((m, v))))
}

/// The launch of kernels/adamw.cu over `n` elements: 256 threads a block, a thread per 16-byte pack, at
/// most 1,024 blocks (the kernel strides over the rest).
#[cfg(any(test, feature = "cuda"))]
pub(super) fn adamw_plan(op: &AdamW, n: usize) -> Result<Plan> {
    let Ok(n32) = u32::try_from(n) else { candle_core::bail!("adamw: {n} elements in one tensor, at most 2^32 - 1") };
    let c = op.consts();
    let mut p = Plan::default();
    let state = p.input("state", DType::F32, op.rows() * n);
    let g = p.input("g", DType::F32, n);
    let args = vec![
        state,
        g,
        Arg::U32(n32),
        Arg::U32(c.flags()),
        Arg::F32(c.scale),
        Arg::F32(c.lr),
        Arg::F32(c.decay),
        Arg::F32(c.b1),
        Arg::F32(c.c1),
        Arg::F32(c.b2),
        Arg::F32(c.c2),
        Arg::F32(c.ib1),
        Arg::F32(c.ib2),
        Arg::F32(c.eps),
    ];
    let blocks = super::launch::packed_grid(n, DType::F32).max(1);
    let (grid, block) = ((if n == 0 { 0 } else { blocks }, 1, 1), (256, 1, 1));
    p.launch(Launch { module: Module::Adamw, kernel: "adamw_f32".into(), grid, block, shared_bytes: 0, args })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    fn op(adam: bool, t: i32, scale: f64, weight_decay: f64) -> AdamW {
        AdamW { adam, scale, lr: 3e-3 * t as f64, weight_decay, betas: [0.9, 0.999], eps: 1e-8, t }
    }

    /// Three steps (one scaled, one with zero gradients where the moments carry the update) on a tensor
    /// longer than a host block, fused against composite: the same bits, with and without decay.
    #[test]
    fn equals_the_composite_update_bit_for_bit() {
        let n = HOST_BLOCK + 1234;
        for adam in [true, false] {
            for wd in [0.0, 0.1] {
                let rows = if adam { 3 } else { 1 };
                let master = Tensor::from_vec(values(n, 1, 2.0), n, &Device::Cpu).unwrap();
                let mut want = (master.clone(), None::<(Tensor, Tensor)>);
                let zeros = Tensor::zeros((rows - 1, n), candle_core::DType::F32, &Device::Cpu).unwrap();
                let state = Tensor::cat(&[&master.unsqueeze(0).unwrap(), &zeros], 0).unwrap();
                for t in 1..=3 {
                    let g = match t {
                        2 => Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu).unwrap(),
                        _ => Tensor::from_vec(values(n, 10 + t as u64, 1.0), n, &Device::Cpu).unwrap(),
                    };
                    let o = op(adam, t, if t == 3 { 0.25 } else { 1.0 }, wd);
                    adamw(&state, &g, &o).unwrap();
                    let moments = want.1.as_ref().map(|(m, v)| (m, v));
                    want = adamw_reference(&want.0, moments, &g, &o).unwrap();
                }
                assert_eq!(bits(&state.get(0).unwrap()), bits(&want.0), "master, adam {adam}, wd {wd}");
                if let Some((m, v)) = &want.1 {
                    assert_eq!(bits(&state.get(1).unwrap()), bits(m), "first moment, wd {wd}");
                    assert_eq!(bits(&state.get(2).unwrap()), bits(v), "second moment, wd {wd}");
                }
            }
        }
    }

    #[test]
    fn a_state_of_the_wrong_shape_is_an_error() {
        let state = Tensor::zeros((3, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
        let g = Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = adamw(&state, &g, &op(true, 1, 1.0, 0.0)).unwrap_err().to_string();
        assert!(e.contains("expected [3, 4]"), "{e}");
        assert!(adamw(&state, &g.to_dtype(candle_core::DType::BF16).unwrap(), &op(true, 1, 1.0, 0.0)).is_err());
    }

    /// kernels/adamw.cu on the emulator: the same bits as the host's update, for AdamW and SGD, scaled and
    /// not, in 16-byte packs (n a multiple of 4) and one at a time, each over more packs or elements than
    /// its grid's threads (the stride loop: 1,024 blocks of 256).
    #[test]
    fn the_kernel_equals_the_host_update() {
        let packed = [(true, 4 * 1024 * 256 + 76, 1.0), (false, 1000, 0.5)];
        for (adam, n, scale) in
            packed.into_iter().chain([(true, 1024 * 256 + 77, 0.5), (true, 5, 0.5), (false, 1003, 1.0)])
        {
            let rows = if adam { 3 } else { 1 };
            let init = Tensor::from_vec(values(rows * n, 3, 1.0), (rows, n), &Device::Cpu).unwrap();
            let init =
                Tensor::cat(&[&init.narrow(0, 0, 1).unwrap(), &init.narrow(0, 1, rows - 1).unwrap().abs().unwrap()], 0)
                    .unwrap();
            let g = Tensor::from_vec(values(n, 4, 1.0), n, &Device::Cpu).unwrap();
            let o = op(adam, 2, scale, 0.1);
            let host = init.copy().unwrap();
            adamw(&host, &g, &o).unwrap();
            let after =
                super::super::emu::run_in_place(&adamw_plan(&o, n).unwrap(), &[&init.flatten_all().unwrap(), &g])
                    .unwrap();
            assert_eq!(bits(&after[0]), bits(&host), "adam {adam}, n {n}");
        }
    }
}
