//! The GPU's element-wise kernels on the host emulator: a [`Backend`] whose steps are the `fa_*` kernels of
//! kernels/flash_attention.cu launched by their plans (launches.rs) and whose GEMMs are the CPU's (in f32
//! over the buffers' values, as cuBLAS with f32 compute), running the same driver as the CPU backend.
//! Buffers are flat CPU tensors; `alloc_in` fills them with NaN, so a value no kernel wrote shows.

use candle_core::{DType, Device, Result, Tensor};
use rand::{Rng, SeedableRng};

use super::cpu::CpuBackend;
use super::driver::{self, Backend, Blocks, Gemm, KeyBlock, QueryBlock, Visits};
use super::launches::{self, Step};
use super::Dims;
use crate::kernels::emu;

/// One pointer argument of a step: read, or read and written back.
enum P<'a> {
    In(&'a Tensor),
    Out(&'a mut Tensor),
}

struct EmuBackend {
    dtype: DType,
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec1().unwrap()
}

impl EmuBackend {
    fn run(&self, step: Step, mut params: Vec<P>) -> Result<()> {
        let bufs: Vec<_> = params
            .iter()
            .map(|p| match p {
                P::In(t) => ("buffer", t.dtype(), t.elem_count()),
                P::Out(t) => ("buffer", t.dtype(), t.elem_count()),
            })
            .collect();
        let plan = step.plan(self.dtype, &bufs)?;
        let tensors: Vec<Tensor> = params
            .iter()
            .map(|p| match p {
                P::In(t) => (*t).clone(),
                P::Out(t) => (**t).clone(),
            })
            .collect();
        let after = emu::run_in_place(&plan, &tensors.iter().collect::<Vec<_>>())?;
        for (p, t) in params.iter_mut().zip(after) {
            if let P::Out(dst) = p {
                **dst = t;
            }
        }
        Ok(())
    }

    /// `t[offset..]` as its own tensor.
    fn tail(t: &Tensor, offset: usize) -> Tensor {
        t.narrow(0, offset, t.elem_count() - offset).unwrap()
    }
}

impl Backend for EmuBackend {
    type In = Tensor;
    type F32 = Tensor;
    type U32 = Tensor;

    fn alloc_in(&self, len: usize) -> Result<Tensor> {
        Tensor::full(f32::NAN, len, &Device::Cpu)?.to_dtype(self.dtype)
    }

    fn zeros_f32(&self, len: usize) -> Result<Tensor> {
        Tensor::zeros(len, DType::F32, &Device::Cpu)
    }

    fn gemm(&self, g: &Gemm, a: &Tensor, b: &Tensor, c: &mut Tensor) -> Result<()> {
        let mut cv = f32s(c);
        CpuBackend.gemm(g, &f32s(a), &f32s(b), &mut cv)?;
        *c = Tensor::from_vec(cv, c.elem_count(), &Device::Cpu)?;
        Ok(())
    }

    fn gather(&self, blk: &QueryBlock, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        self.run(launches::gather(blk), vec![P::In(src), P::Out(dst)])
    }

    fn fwd_scores(
        &self,
        blk: &QueryBlock,
        kb: &KeyBlock,
        scale: f32,
        ranges: &Tensor,
        s: &Tensor,
        p: &mut Tensor,
        stats: &mut Tensor,
        acc: &mut Tensor,
    ) -> Result<()> {
        let params = vec![P::In(s), P::Out(p), P::Out(stats), P::Out(acc), P::In(ranges)];
        self.run(launches::fwd_scores(blk, kb, scale), params)
    }

    fn fwd_finish(
        &self,
        blk: &QueryBlock,
        stats: &Tensor,
        acc: &Tensor,
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> Result<()> {
        self.run(launches::fwd_finish(blk), vec![P::In(stats), P::In(acc), P::Out(out), P::Out(lse)])
    }

    fn bwd_scores(
        &self,
        blk: &QueryBlock,
        kb: &KeyBlock,
        scale: f32,
        ranges: &Tensor,
        lse_delta: &Tensor,
        s: &Tensor,
        dp: &Tensor,
        p: &mut Tensor,
        ds: &mut Tensor,
    ) -> Result<()> {
        let params = vec![P::In(s), P::In(dp), P::In(lse_delta), P::In(ranges), P::Out(p), P::Out(ds)];
        self.run(launches::bwd_scores(blk, kb, scale), params)
    }

    fn scatter(&self, blk: &QueryBlock, acc: &Tensor, dst: &mut Tensor, offset: usize) -> Result<()> {
        let mut part = Self::tail(dst, offset);
        self.run(launches::scatter(blk), vec![P::In(acc), P::Out(&mut part)])?;
        *dst = Tensor::cat(&[dst.narrow(0, 0, offset)?, part], 0)?;
        Ok(())
    }

    fn cast(&self, src: &Tensor, len: usize, dst: &mut Tensor, offset: usize) -> Result<()> {
        let mut part = Self::tail(dst, offset);
        self.run(launches::cast(len), vec![P::In(src), P::Out(&mut part)])?;
        *dst = Tensor::cat(&[dst.narrow(0, 0, offset)?, part], 0)?;
        Ok(())
    }
}

/// How a backend's buffers come back to the host and `L|D` goes to it.
struct Host<I, F, L> {
    input: I,
    f32: F,
    lse_delta: L,
}

/// Forward output, L, and the backward's dq|dk|dv of the driver on `be`, all in f32.
fn drive<B: Backend>(
    be: &B,
    visits: &Visits,
    x: &driver::Inputs<B>,
    dout: &B::In,
    delta: &[f32],
    host: Host<impl Fn(&B::In) -> Vec<f32>, impl Fn(&B::F32) -> Vec<f32>, impl Fn(Vec<f32>) -> B::F32>,
) -> [Vec<f32>; 3] {
    let (o, lse) = driver::forward(be, visits, x).unwrap();
    let lse = (host.f32)(&lse);
    let ld = (host.lse_delta)(lse.iter().chain(delta).copied().collect());
    let grads = driver::backward(be, visits, x, &driver::Upstream { dout, lse_delta: &ld }).unwrap();
    [(host.input)(&o), lse, (host.input)(&grads)]
}

fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(1f32, |m, v| if v.is_finite() { m.max(v.abs()) } else { m });
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let ok = if b.is_finite() { (a - b).abs() <= tol * scale } else { a == b };
        assert!(ok, "{what}[{i}]: {a} vs {b}");
    }
}

/// The emulated kernels under the driver agree with the CPU backend, forward (o, L) and backward
/// (dq, dk, dv), for causal, cached-key, packed and empty ranges, GQA, small blocks, f32 and bf16.
#[test]
fn emulated_kernels_match_the_cpu_backend() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    // (b, h, kv, t, s, d, blocks)
    let cases = [
        (1, 4, 2, 13, 13, 8, Blocks { bq: 4, bk: 5 }),
        (2, 2, 1, 5, 12, 4, Blocks { bq: 3, bk: 4 }),
        (1, 2, 2, 1, 1, 4, Blocks { bq: 1, bk: 1 }),
    ];
    for (ci, &(b, h, kv, t, s, d, blocks)) in cases.iter().enumerate() {
        let dims = Dims { b, h, kv, t, s, d };
        let past = s - t;
        let mut ranges = vec![];
        for row in 0..b {
            for i in 0..t {
                let (lo, hi) = match (row, i) {
                    (1, 1) => (3, 2),                         // sees nothing
                    (1, i) if i >= 3 => (past + 2, past + i), // a segment from key past + 2
                    _ => (0, past + i),
                };
                ranges.extend([lo as u32, hi as u32]);
            }
        }
        let visits = Visits::new(dims, blocks, &ranges);
        let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-2f32..2.0)).collect() };
        let (q, k, v, g) = (rand(dims.q_len()), rand(dims.kv_len()), rand(dims.kv_len()), rand(dims.q_len()));
        let delta = rand(b * h * t);
        for (dtype, tol) in [(DType::F32, 2e-5), (DType::BF16, 2e-2)] {
            let t_ = |x: &[f32]| Tensor::from_vec(x.to_vec(), x.len(), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            // The CPU backend on the same (rounded) inputs.
            let r = |x: &[f32]| f32s(&t_(x));
            let (qc, kc, vc, gc) = (r(&q), r(&k), r(&v), r(&g));
            let xc = driver::Inputs { q: &qc, k: &kc, v: &vc, ranges: &ranges, scale: 0.4 };
            let cpu_host = Host { input: |x: &Vec<f32>| x.clone(), f32: |x: &Vec<f32>| x.clone(), lse_delta: |x| x };
            let want = drive(&CpuBackend, &visits, &xc, &gc, &delta, cpu_host);
            let emu_be = EmuBackend { dtype };
            let rt = Tensor::from_vec(ranges.clone(), ranges.len(), &Device::Cpu).unwrap();
            let (qt, kt, vt, gt) = (t_(&q), t_(&k), t_(&v), t_(&g));
            let xe = driver::Inputs { q: &qt, k: &kt, v: &vt, ranges: &rt, scale: 0.4 };
            let lse_delta = |x: Vec<f32>| Tensor::from_vec(x.clone(), x.len(), &Device::Cpu).unwrap();
            let got = drive(&emu_be, &visits, &xe, &gt, &delta, Host { input: f32s, f32: f32s, lse_delta });
            for (what, (a, w)) in ["out", "lse", "dq|dk|dv"].iter().zip(got.iter().zip(&want)) {
                close(&format!("case {ci} {dtype:?} {what}"), a, w, tol);
            }
        }
    }
}
