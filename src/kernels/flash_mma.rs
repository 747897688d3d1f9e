//! Flash attention on the tensor cores: the launch plans of kernels/flash_mma.cu, whose block products
//! are warp-wide `mma.sync` instructions (m16n8k16, bf16/f16 in, f32 accumulators; kernels/mma.cuh) with
//! the scores, probabilities and their gradients kept in registers, never in device memory. The same
//! inputs, outputs and arithmetic as [`flash_attention`](super::flash_attention)'s op (whose CPU
//! implementation is their reference), for bf16 and f16 and a head dim in [`TENSOR_CORE_HEAD_DIMS`](super::TENSOR_CORE_HEAD_DIMS); the op takes
//! this path on a GPU with `attention = "mma"` where it applies, and the chunked GEMM path otherwise.

use candle_core::{DType, Result};

use super::flash_attention::dims::{dkv_split, Dims};
use super::launch::{kernel_name, Arg, Launch, Module, Plan};

/// Threads per block: four warps, each 16 rows (queries, or keys in the dk/dv kernel).
const THREADS: u32 = 128;
/// Queries per block of the forward and the dq kernel, keys per block of the dk/dv kernel.
const ROWS: usize = 64;
/// Keys per step of the forward and the dq kernel, queries per step of the dk/dv kernel.
const FWD_KEYS: usize = 32;
const DQ_KEYS: usize = 32;
const DKV_QUERIES: usize = 16;

/// Whether the tensor-core kernels take inputs of `dtype` with head dim `d` (each head dim its own
/// kernel: the fragments live in registers).
pub(crate) fn supports(dtype: DType, d: usize) -> bool {
    super::tensor_core_attention(dtype, d)
}

/// Shared memory of each kernel, as kernels/flash_mma.cu lays it out: tiles of 16-bit values with a row
/// stride of D + 8 (two stages of K and V in the forward and the dq kernel), then the rows' key ranges
/// and statistics.
fn shared_bytes(kernel: &str, dims: &Dims) -> usize {
    let ld = dims.d + 8;
    let dkv = 2 * (2 * ROWS * ld + 2 * DKV_QUERIES * ld) + 4 * 4 * DKV_QUERIES;
    match kernel {
        "fwd" => 2 * (4 * FWD_KEYS * ld) + 2 * 4 * ROWS,
        "bwd_dq" => 2 * (4 * DQ_KEYS * ld) + 2 * 4 * ROWS,
        "bwd_dkv" => dkv,
        // and the tile of dS, [16 queries][64 keys + 8]
        "bwd_dkvq" => dkv + 2 * DKV_QUERIES * (ROWS + 8),
        _ => 0, // bwd_prep (static shared memory), bwd_dq_out
    }
}

/// A file of tensor-core attention kernels, each `{prefix}_{kernel}_d{D}_{dtype}` (`fwd`, `bwd_dq`,
/// `bwd_dkv`): its module, threads per block, queries per block of the forward and the dq kernel, keys per
/// block of the dk/dv kernel, and shared memory per kernel and shape.
pub(crate) struct KernelFile {
    pub module: Module,
    pub prefix: &'static str,
    pub threads: u32,
    pub rows: usize,
    pub dkv_keys: usize,
    pub shared_bytes: fn(&str, &Dims) -> usize,
}

/// kernels/flash_mma.cu.
pub(crate) const MMA: KernelFile = KernelFile {
    module: Module::FlashMma,
    prefix: "flash_mma",
    threads: THREADS,
    rows: ROWS,
    dkv_keys: ROWS,
    shared_bytes,
};

impl KernelFile {
    /// The launch of `kernel` over a grid of `x` by `y` blocks.
    pub fn launch(
        &self,
        kernel: &str,
        dims: &Dims,
        dtype: DType,
        (x, y): (usize, usize),
        args: Vec<Arg>,
    ) -> Result<Launch> {
        if !supports(dtype, dims.d) {
            candle_core::bail!(
                "{}: {dtype:?} with head dim {} (tensor-core attention takes bf16 or f16, head dim 64 or 128)",
                self.prefix,
                dims.d
            );
        }
        Ok(Launch {
            module: self.module,
            kernel: kernel_name(&format!("{}_{kernel}_d{}", self.prefix, dims.d), dtype)?,
            grid: (x as u32, y as u32, 1),
            block: (self.threads, 1, 1),
            shared_bytes: (self.shared_bytes)(kernel, dims) as u32,
            args,
        })
    }
}

impl KernelFile {
    /// The backward over inputs `(q, k, v, grad, ranges, L, D)` with the dk/dv kernel's groups split
    /// `split` ways ([`dkv_split`] is the plans' choice). First output dq|dk|dv, then the kernels' own:
    /// the query blocks' key spans (`[B, ceil(T / 16), 2]` u32), with `atomic_dq` the f32 dq accumulator
    /// (`[B, H, T, D]`), and the dk/dv partial sums (`[split][2][B, KV, S, D]` f32).
    /// - two kernels (`atomic_dq` false): `bwd_dq` (query blocks of one head; writes the spans, which let
    ///   the dk/dv kernel skip the query blocks that see none of its keys), then `bwd_dkv`; deterministic,
    ///   every sum in a fixed order;
    /// - `atomic_dq`: kernels/flash_mma.cu's `bwd_prep` (zeroes the accumulator, writes the spans), this
    ///   file's `bwd_dkvq` (dk, dv, and dQ added into the accumulator by f32 atomics), kernels/flash_mma.cu's
    ///   `bwd_dq_out`.
    ///
    /// In both, `bwd_dkv_sum` then adds the partial sums in order into dk and dv.
    pub fn backward_plan_split(
        &self,
        dtype: DType,
        dims: Dims,
        scale: f32,
        atomic_dq: bool,
        split: usize,
    ) -> Result<Plan> {
        positive(scale)?;
        let (nq, nk) = (dims.q_len(), dims.kv_len());
        let mut p = Plan::default();
        let (inputs, grads) = backward_buffers(&mut p, dtype, &dims);
        let spans = p.output("query block key spans", DType::U32, dims.b * dims.t.div_ceil(16) * 2);
        let heads = dims.b * dims.h;
        let (h, t, s) = (Arg::U32(dims.h as u32), Arg::U32(dims.t as u32), Arg::U32(dims.s as u32));
        let dq_acc = if atomic_dq {
            let acc = p.output("dq accumulator", DType::F32, nq);
            let prep = vec![inputs[4], spans, acc, h, t, s];
            p.launch(MMA.launch("bwd_prep", &dims, dtype, (dims.t.div_ceil(ROWS), heads), prep)?)?;
            Some(acc)
        } else {
            let mut args = inputs.clone();
            args.extend([Arg::Buffer { index: grads, offset: 0 }, spans]);
            args.extend(sizes(&dims, scale));
            p.launch(self.launch("bwd_dq", &dims, dtype, (heads, dims.t.div_ceil(self.rows)), args)?)?;
            None
        };
        let parts = p.output("dk and dv partial sums", DType::F32, split * 2 * nk);
        let mut args = inputs.clone();
        args.extend([parts, spans]);
        args.extend(dq_acc);
        args.extend([h, Arg::U32(dims.kv as u32), t, s, Arg::U32(split as u32), Arg::F32(scale)]);
        let (kernel, key_blocks) = (if atomic_dq { "bwd_dkvq" } else { "bwd_dkv" }, dims.s.div_ceil(self.dkv_keys));
        p.launch(self.launch(kernel, &dims, dtype, (dims.b * dims.kv * split, key_blocks), args)?)?;
        let sum = vec![parts, Arg::Buffer { index: grads, offset: nq }, Arg::U32(nk as u32), Arg::U32(split as u32)];
        p.launch(dkv_sum(dtype, nk, sum, scale)?)?;
        if let Some(acc) = dq_acc {
            let out = vec![acc, Arg::Buffer { index: grads, offset: 0 }, t, Arg::F32(scale)];
            p.launch(MMA.launch("bwd_dq_out", &dims, dtype, (dims.t.div_ceil(ROWS), heads), out)?)?;
        }
        Ok(p)
    }

    /// The backward without the dq kernel ([`backward_plan_atomic`]), its groups split by [`dkv_split`].
    pub fn backward_plan_atomic(&self, dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
        self.backward_plan_split(dtype, dims, scale, true, self.dkv_split(&dims))
    }

    /// [`dkv_split`] over this file's dk/dv key blocks.
    fn dkv_split(&self, dims: &Dims) -> usize {
        dkv_split(dims, dims.s.div_ceil(self.dkv_keys))
    }

    /// The forward over inputs `(q, k, v, ranges)` of `dtype`; outputs `(L, o)`.
    pub fn forward_plan(&self, dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
        positive(scale)?;
        let mut p = Plan::default();
        let mut args = forward_buffers(&mut p, dtype, &dims);
        args.extend(sizes(&dims, scale));
        // Heads by query blocks, the last queries' blocks first (kernels/flash_rows.cuh's query_block).
        p.launch(self.launch("fwd", &dims, dtype, (dims.b * dims.h, dims.t.div_ceil(self.rows)), args)?)?;
        Ok(p)
    }

    /// The backward over inputs `(q, k, v, grad, ranges, L, D)`: dq (query blocks of one head), then dk
    /// and dv (key blocks of one KV head, over its group's query heads split by [`dkv_split`]), one output
    /// after the other ([`KernelFile::backward_plan_split`]).
    pub fn backward_plan(&self, dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
        self.backward_plan_split(dtype, dims, scale, false, self.dkv_split(&dims))
    }
}

/// kernels/flash_mma.cu's `bwd_dkv_sum` over `2 nk` elements (128 threads a block, each block four
/// elements a thread, the grid capped where its stride loop takes over).
fn dkv_sum(dtype: DType, nk: usize, mut args: Vec<Arg>, scale: f32) -> Result<Launch> {
    let blocks = (2 * nk).div_ceil(THREADS as usize * 4).clamp(1, 65_535);
    args.push(Arg::F32(scale));
    Ok(Launch {
        module: Module::FlashMma,
        kernel: kernel_name("flash_mma_bwd_dkv_sum", dtype)?,
        grid: (blocks as u32, 1, 1),
        block: (THREADS, 1, 1),
        shared_bytes: 0,
        args,
    })
}

/// The kernels' softmax keeps each row's maximum of the unscaled scores (kernels/flash_rows.cuh's
/// softmax_step): the maximum of the scaled ones only for a positive scale.
fn positive(scale: f32) -> Result<()> {
    if !(scale > 0.0 && scale.is_finite()) {
        candle_core::bail!("flash attention on the tensor cores takes a positive softmax scale, not {scale}");
    }
    Ok(())
}

/// The sizes every kernel takes after its pointers, and the scale: h, kv, t, s, scale.
fn sizes(d: &Dims, scale: f32) -> [Arg; 5] {
    [Arg::U32(d.h as u32), Arg::U32(d.kv as u32), Arg::U32(d.t as u32), Arg::U32(d.s as u32), Arg::F32(scale)]
}

/// The buffers of an attention forward's plan, as both kernels' (this file's and the scalar one of
/// flash_attention.cu) take them: inputs `(q, k, v, ranges)`, outputs `(L, o)`, as arguments in that order.
pub(crate) fn forward_buffers(p: &mut Plan, dtype: DType, dims: &Dims) -> Vec<Arg> {
    let (q, k, v) =
        (p.input("q", dtype, dims.q_len()), p.input("k", dtype, dims.kv_len()), p.input("v", dtype, dims.kv_len()));
    let ranges = p.input("attention ranges", DType::U32, dims.b * dims.t * 2);
    let lse = p.output("log-sum-exp", DType::F32, dims.b * dims.h * dims.t);
    let out = p.output("attention", dtype, dims.q_len());
    vec![q, k, v, ranges, lse, out]
}

/// The forward over inputs `(q, k, v, ranges)` of `dtype`; outputs `(L, o)`.
pub(crate) fn forward_plan(dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
    MMA.forward_plan(dtype, dims, scale)
}

/// The buffers of an attention backward's plan, as both kernels' (this file's and the scalar ones of
/// flash_attention.cu) take them: the inputs `(q, k, v, grad, ranges, L, D)` as arguments, and the index
/// of the output dq|dk|dv.
pub(crate) fn backward_buffers(p: &mut Plan, dtype: DType, dims: &Dims) -> (Vec<Arg>, usize) {
    let (nq, nk) = (dims.q_len(), dims.kv_len());
    let mut inputs = vec![p.input("q", dtype, nq), p.input("k", dtype, nk), p.input("v", dtype, nk)];
    inputs.push(p.input("grad", dtype, nq));
    inputs.push(p.input("attention ranges", DType::U32, dims.b * dims.t * 2));
    inputs.push(p.input("log-sum-exp", DType::F32, dims.b * dims.h * dims.t));
    inputs.push(p.input("delta", DType::F32, dims.b * dims.h * dims.t));
    let Arg::Buffer { index: grads, .. } = p.output("gradients", dtype, nq + 2 * nk) else { unreachable!() };
    (inputs, grads)
}

/// The backward over inputs `(q, k, v, grad, ranges, L, D)`, two kernels ([`KernelFile::backward_plan`]).
pub(crate) fn backward_plan(dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
    MMA.backward_plan(dtype, dims, scale)
}

/// The backward over the same inputs and output as [`backward_plan`] without the dq kernel
/// (FlashAttention-2's): one kernel zeroes an f32 accumulator of dq and writes the query blocks' key spans;
/// the dk/dv kernel also adds each block pair's dQ = dS K into the accumulator by f32 atomics (S and dP
/// computed once per score: 10 hd FLOPs against 14, but the sums' order, and so their rounding, varies from
/// run to run); the last kernel writes dq = scale x accumulator. The other outputs are the kernels' own
/// (the spans, the accumulator and dk/dv's partial sums: [`KernelFile::backward_plan_split`]).
pub(crate) fn backward_plan_atomic(dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
    MMA.backward_plan_atomic(dtype, dims, scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels keep the unscaled scores' maximum: a scale that is not positive is refused, by the
    /// forward's and both backwards' plans.
    #[test]
    fn the_plans_take_only_a_positive_scale() {
        let dims = Dims { b: 1, h: 2, kv: 1, t: 64, s: 64, d: 64 };
        for scale in [0.125, 0.0, -0.125, f32::NAN, f32::INFINITY] {
            let ok = scale > 0.0 && scale.is_finite();
            for plan in [forward_plan(DType::BF16, dims, scale), backward_plan(DType::BF16, dims, scale)] {
                assert_eq!(plan.is_ok(), ok, "scale {scale}");
            }
            assert_eq!(backward_plan_atomic(DType::BF16, dims, scale).is_ok(), ok, "scale {scale}");
        }
    }
}
