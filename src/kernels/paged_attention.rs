//! Attention over a paged KV cache: the queries of one generation step (the decode tokens of many
//! sequences and the prefill chunks of others, flattened into one list) against keys and values that lie
//! in a pool of fixed-size blocks, found through each sequence's block table. Query token `t` of sequence
//! `s` sees the first `ctx[t]` positions of `s` (causal: its own position and those before it), position
//! `j` at slot `table[s][j / block] * block + j % block`. Grouped-query attention reads KV head
//! `h / (H / KV)` for query head `h`. Scores, softmax and the sum over values in f32. No backward
//! (generation only). CPU implementation here (the reference the CUDA kernels of kernels/paged_attention.cu
//! are tested against); [`paged_attention_reference`] is the composite of candle ops it is tested against.

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{u32s, with_float, Elem};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};

/// Where each query token's keys and values are: per sequence of the step its block table (padded to
/// `max_blocks`), per query token its sequence and the positions it sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedLayout {
    pub block_size: usize,
    pub max_blocks: usize,
    /// `[sequences, max_blocks]`, row-major.
    pub tables: Vec<u32>,
    /// Per query token, its sequence (a row of `tables`).
    pub token_seq: Vec<u32>,
    /// Per query token, the positions of its sequence it sees (`0..ctx`).
    pub token_ctx: Vec<u32>,
}

impl PagedLayout {
    pub fn sequences(&self) -> usize {
        self.tables.len().checked_div(self.max_blocks).unwrap_or(0)
    }

    /// The pool slot of position `j` of sequence `s`.
    fn slot(&self, s: usize, j: usize) -> usize {
        self.tables[s * self.max_blocks + j / self.block_size] as usize * self.block_size + j % self.block_size
    }

    /// Every index in range of a pool of `slots` positions; an error naming the first that is not.
    fn check(&self, tokens: usize, slots: usize) -> Result<()> {
        if self.token_seq.len() != tokens || self.token_ctx.len() != tokens {
            candle_core::bail!(
                "paged attention: {tokens} queries, {} sequences and {} contexts given",
                self.token_seq.len(),
                self.token_ctx.len()
            );
        }
        for (t, (&s, &c)) in self.token_seq.iter().zip(&self.token_ctx).enumerate() {
            let (s, c) = (s as usize, c as usize);
            if s >= self.sequences() || c == 0 || c > self.max_blocks * self.block_size {
                candle_core::bail!(
                    "paged attention: query {t} of sequence {s} sees {c} positions ({} sequences of \
                    at most {} positions)",
                    self.sequences(),
                    self.max_blocks * self.block_size
                );
            }
            let table = &self.tables[s * self.max_blocks..s * self.max_blocks + c.div_ceil(self.block_size)];
            if table.iter().any(|&b| (b as usize + 1) * self.block_size > slots) {
                candle_core::bail!("paged attention: sequence {s}'s block table points past the pool of {slots} slots");
            }
        }
        Ok(())
    }

    /// The table, sequences and contexts as one u32 tensor, the op's third input.
    fn packed(&self, device: &Device) -> Result<Tensor> {
        let v: Vec<u32> = self.tables.iter().chain(&self.token_seq).chain(&self.token_ctx).copied().collect();
        let n = v.len();
        crate::device::from_host(v, n, device)
    }
}

/// The shapes of one call: `q` `[H, T, D]`, `kv` `[2 KV, slots, D]` (keys in heads `0..KV`, values in
/// `KV..2 KV`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dims {
    heads: usize,
    kv_heads: usize,
    tokens: usize,
    slots: usize,
    head_dim: usize,
}

fn dims(q: &Layout, kv: &Layout) -> Result<Dims> {
    let (&[heads, tokens, head_dim], &[kv2, slots, d2]) = (q.shape().dims(), kv.shape().dims()) else {
        candle_core::bail!(
            "paged attention: q {:?} and kv {:?}, [H, T, D] and [2 KV, slots, D] expected",
            q.shape().dims(),
            kv.shape().dims()
        );
    };
    let kv_heads = kv2 / 2;
    if d2 != head_dim || kv2 % 2 != 0 || kv_heads == 0 || heads % kv_heads != 0 {
        candle_core::bail!(
            "paged attention: q {:?} against kv {:?}: one head dim and H a multiple of KV expected",
            q.shape().dims(),
            kv.shape().dims()
        );
    }
    Ok(Dims { heads, kv_heads, tokens, slots, head_dim })
}

/// The dot product of `k` (as f32) and `q` over 8 independent sums, so that it vectorizes (a fold of
/// `mul_add` is one sequential chain, and a call to `fmaf` per element where FMA is not a target feature).
fn dot<T: Elem>(k: &[T], q: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ks, qs) = (k.chunks_exact(8), q.chunks_exact(8));
    let tail: f32 = ks.remainder().iter().zip(qs.remainder()).map(|(k, q)| k.f32() * q).sum();
    for (k8, q8) in ks.zip(qs) {
        for ((l, k), q) in lanes.iter_mut().zip(k8).zip(q8) {
            *l += k.f32() * q;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// The CPU attention of each (query head, token) row over its sequence's positions.
fn cpu_paged<T: Elem>(q: &[T], kv: &[T], layout: &PagedLayout, d: Dims, scale: f32) -> Vec<T> {
    let (hd, group) = (d.head_dim, d.heads / d.kv_heads);
    let mut out = vec![T::of(0.0); d.heads * d.tokens * hd];
    out.par_chunks_mut(hd.max(1)).enumerate().for_each(|(row, o)| {
        let (h, t) = (row / d.tokens, row % d.tokens);
        let (s, ctx) = (layout.token_seq[t] as usize, layout.token_ctx[t] as usize);
        let g = h / group;
        let qv: Vec<f32> = q[row * hd..(row + 1) * hd].iter().map(|x| x.f32()).collect();
        let key = |slot: usize| &kv[(g * d.slots + slot) * hd..(g * d.slots + slot + 1) * hd];
        let value =
            |slot: usize| &kv[((d.kv_heads + g) * d.slots + slot) * hd..((d.kv_heads + g) * d.slots + slot + 1) * hd];
        let scores: Vec<f32> = (0..ctx).map(|j| dot(key(layout.slot(s, j)), &qv) * scale).collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = scores.iter().map(|x| (x - max).exp()).collect();
        let sum: f32 = weights.iter().sum();
        let mut acc = vec![0f32; hd];
        for (j, w) in weights.iter().enumerate() {
            for (a, v) in acc.iter_mut().zip(value(layout.slot(s, j))) {
                *a += v.f32() * w;
            }
        }
        for (o, a) in o.iter_mut().zip(acc) {
            *o = T::of(a / sum);
        }
    });
    out
}

/// The op: its inputs are `q`, `kv` and the packed layout; the struct carries the sizes to unpack it.
struct PagedAttention {
    block_size: usize,
    max_blocks: usize,
    sequences: usize,
    /// The longest context of a query (the CUDA kernels' splits).
    #[cfg_attr(not(any(test, feature = "cuda")), allow(dead_code))]
    max_ctx: usize,
    scale: f32,
}

impl PagedAttention {
    fn layout(&self, packed: &[u32], tokens: usize) -> Result<PagedLayout> {
        let n = self.sequences * self.max_blocks;
        if packed.len() != n + 2 * tokens {
            candle_core::bail!("paged attention: a layout of {} values for {tokens} queries", packed.len());
        }
        Ok(PagedLayout {
            block_size: self.block_size,
            max_blocks: self.max_blocks,
            tables: packed[..n].to_vec(),
            token_seq: packed[n..n + tokens].to_vec(),
            token_ctx: packed[n + tokens..].to_vec(),
        })
    }
}

impl CustomOp3 for PagedAttention {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use super::cpu::IntoStorage;
        let d = dims(l1, l2)?;
        let layout = self.layout(u32s(s3, l3, "paged attention layout")?, d.tokens)?;
        layout.check(d.tokens, d.slots)?;
        let out = with_float!((s1, l1, "q"), (s2, l2, "kv") => |q, kv| IntoStorage::storage(cpu_paged(q, kv, &layout, d, self.scale)));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let d = dims(l1, l2)?;
        let plan = paged_plan(s1.dtype(), d, self, CHUNK)?;
        let out = super::cuda::run(&plan, &[(s1, l1), (s2, l2), (s3, l3)])?.remove(0);
        Ok((out, l1.shape().clone()))
    }
}

/// Positions of a context one block of the CUDA kernel takes (its scores in shared memory).
#[cfg(any(test, feature = "cuda"))]
const CHUNK: usize = 512;
/// Threads of a block (kernels/paged_attention.cu's PAGED_THREADS).
#[cfg(any(test, feature = "cuda"))]
const THREADS: u32 = 128;
/// Query heads per KV head at most (PAGED_MAX_GROUP).
#[cfg(any(test, feature = "cuda"))]
const MAX_GROUP: usize = 8;

/// The launches of one call: a block per (query token, KV head, split of `chunk` positions of the longest
/// context), then, with more than one split, a block per (head, token) row combining its splits.
#[cfg(any(test, feature = "cuda"))]
fn paged_plan(dtype: DType, d: Dims, op: &PagedAttention, chunk: usize) -> Result<Plan> {
    let group = d.heads / d.kv_heads;
    if group > MAX_GROUP {
        candle_core::bail!("paged attention on the GPU: {group} query heads per KV head, at most {MAX_GROUP}");
    }
    let splits = op.max_ctx.div_ceil(chunk).max(1);
    let rows = d.heads * d.tokens;
    let mut p = Plan::default();
    let q = p.input("q", dtype, rows * d.head_dim);
    let kv = p.input("kv", dtype, 2 * d.kv_heads * d.slots * d.head_dim);
    let meta = p.input("layout", DType::U32, op.sequences * op.max_blocks + 2 * d.tokens);
    let out = p.output("attention", dtype, rows * d.head_dim);
    let parts = if splits > 1 { rows * splits } else { 0 };
    let part_acc = p.output("partial sums", DType::F32, parts * d.head_dim);
    let part_ml = p.output("partial max and sum", DType::F32, parts * 2);
    let u = |x: usize| Arg::U32(x as u32);
    let args = vec![
        q,
        kv,
        meta,
        out,
        part_acc,
        part_ml,
        u(d.tokens),
        u(d.heads),
        u(d.kv_heads),
        u(d.slots),
        u(d.head_dim),
        u(op.block_size),
        u(op.max_blocks),
        u(op.sequences),
        u(chunk),
        u(splits),
        Arg::F32(op.scale),
    ];
    let shared = (group * d.head_dim + group * chunk + 32) * 4;
    p.launch(Launch {
        module: Module::PagedAttention,
        kernel: kernel_name("paged_attention", dtype)?,
        grid: (d.tokens as u32, d.kv_heads as u32, splits as u32),
        block: (THREADS, 1, 1),
        shared_bytes: shared as u32,
        args,
    })?;
    if splits > 1 {
        p.launch(Launch {
            module: Module::PagedAttention,
            kernel: kernel_name("paged_attention_reduce", dtype)?,
            grid: (rows as u32, 1, 1),
            block: (THREADS, 1, 1),
            shared_bytes: 0,
            args: vec![part_acc, part_ml, out, u(rows), u(splits), u(d.head_dim)],
        })?;
    }
    Ok(p)
}

/// Attention of `q` (`[H, T, D]`, the step's query tokens) over the pool `kv` (`[2 KV, slots, D]`, keys
/// then values) as `layout` places each token's positions, scaled by `scale`: `[H, T, D]` in q's dtype.
pub fn paged_attention(q: &Tensor, kv: &Tensor, layout: &PagedLayout, scale: f32) -> Result<Tensor> {
    let op = PagedAttention {
        block_size: layout.block_size,
        max_blocks: layout.max_blocks,
        sequences: layout.sequences(),
        max_ctx: layout.token_ctx.iter().copied().max().unwrap_or(0) as usize,
        scale,
    };
    q.contiguous()?.apply_op3_no_bwd(&kv.contiguous()?, &layout.packed(q.device())?, &op)
}

/// The same through candle ops, token by token: each token's positions gathered from the pool, the
/// scores, softmax and weighted values in f32. The reference the op is tested against (slow).
pub fn paged_attention_reference(q: &Tensor, kv: &Tensor, layout: &PagedLayout, scale: f32) -> Result<Tensor> {
    let d = dims(q.layout(), kv.layout())?;
    layout.check(d.tokens, d.slots)?;
    let group = d.heads / d.kv_heads;
    let (q32, kv32) = (q.to_dtype(DType::F32)?, kv.to_dtype(DType::F32)?);
    let mut rows = Vec::with_capacity(d.tokens);
    for t in 0..d.tokens {
        let (s, ctx) = (layout.token_seq[t] as usize, layout.token_ctx[t] as usize);
        let slots: Vec<u32> = (0..ctx).map(|j| layout.slot(s, j) as u32).collect();
        let idx = Tensor::new(slots.as_slice(), q.device())?;
        let seen = kv32.index_select(&idx, 1)?; // [2 KV, ctx, D]
        let (k, v) = (seen.narrow(0, 0, d.kv_heads)?, seen.narrow(0, d.kv_heads, d.kv_heads)?);
        let expand = |x: &Tensor| -> Result<Tensor> {
            x.unsqueeze(1)?.expand((d.kv_heads, group, ctx, d.head_dim))?.reshape((d.heads, ctx, d.head_dim))
        };
        let qt = q32.narrow(1, t, 1)?; // [H, 1, D]
        let scores = (qt.matmul(&expand(&k)?.t()?)? * scale as f64)?;
        let p = candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?;
        rows.push(p.matmul(&expand(&v)?)?);
    }
    Tensor::cat(&rows, 1)?.to_dtype(q.dtype())
}

#[cfg(test)]
mod tests {
    use super::super::testing::{max_diff_over_1, seeded};
    use super::*;

    /// Three sequences over a pool of blocks of 4 in scattered order: one decoding at 9 positions (a
    /// partly filled third block), one prefilling a chunk of 3 queries at positions 4..7, one at a single
    /// position; GQA with 4 query heads over 2 KV heads.
    pub(crate) fn ragged() -> (PagedLayout, usize) {
        let layout = PagedLayout {
            block_size: 4,
            max_blocks: 3,
            tables: vec![5, 0, 7, 2, 6, 0, 3, 0, 0],
            token_seq: vec![0, 1, 1, 1, 2],
            token_ctx: vec![9, 5, 6, 7, 1],
        };
        (layout, 8 * 4)
    }

    #[test]
    fn equals_the_composite_over_ragged_pages() {
        let (layout, slots) = ragged();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let q = seeded(&[4, 5, 16], 1.0, 1).to_dtype(dtype).unwrap();
            let kv = seeded(&[4, slots, 16], 1.0, 2).to_dtype(dtype).unwrap();
            let got = paged_attention(&q, &kv, &layout, 0.25).unwrap();
            let want = paged_attention_reference(&q, &kv, &layout, 0.25).unwrap();
            assert_eq!(got.dims(), &[4, 5, 16]);
            let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
            let d = max_diff_over_1(&got, &want);
            assert!(d <= tol, "{dtype:?}: {d}");
        }
    }

    /// Only the positions a query sees count: values past its context, in its own partly filled block or
    /// another sequence's, change nothing.
    #[test]
    fn reads_only_the_positions_each_query_sees() {
        let (layout, slots) = ragged();
        let q = seeded(&[4, 5, 16], 1.0, 3);
        let kv = seeded(&[4, slots, 16], 1.0, 4);
        let base = paged_attention(&q, &kv, &layout, 0.25).unwrap();
        // Sequence 0 sees 9 positions: slots of block 7 past its first position are unseen; block 1 and 4
        // belong to nobody.
        let mut v: Vec<f32> = kv.flatten_all().unwrap().to_vec1().unwrap();
        for h in 0..4 {
            for slot in (7 * 4 + 1..8 * 4).chain(4..8).chain(16..20) {
                for x in &mut v[(h * slots + slot) * 16..(h * slots + slot + 1) * 16] {
                    *x = 1e4;
                }
            }
        }
        let kv2 = Tensor::from_vec(v, kv.dims(), kv.device()).unwrap();
        let moved = paged_attention(&q, &kv2, &layout, 0.25).unwrap();
        assert_eq!(max_diff_over_1(&moved, &base), 0.0);
    }

    /// kernels/paged_attention.cu on the emulator against the CPU op over the ragged pages: one split, and
    /// splits of 4 positions (a context over three splits, an empty split for the short queries, the
    /// reduce kernel), every dtype; and a group of 8 query heads per KV head.
    #[test]
    fn the_kernels_equal_the_cpu_op_over_ragged_pages() {
        let (layout, slots) = ragged();
        for (heads, kv_heads) in [(4, 2), (8, 1)] {
            for chunk in [CHUNK, 4] {
                for dtype in [DType::F32, DType::BF16, DType::F16] {
                    let q = seeded(&[heads, 5, 16], 1.0, 7).to_dtype(dtype).unwrap();
                    let kv = seeded(&[2 * kv_heads, slots, 16], 1.0, 8).to_dtype(dtype).unwrap();
                    let want = paged_attention(&q, &kv, &layout, 0.25).unwrap();
                    let op = PagedAttention { block_size: 4, max_blocks: 3, sequences: 3, max_ctx: 9, scale: 0.25 };
                    let d = dims(q.layout(), kv.layout()).unwrap();
                    let plan = paged_plan(dtype, d, &op, chunk).unwrap();
                    assert_eq!(plan.launches.len(), if chunk == 4 { 2 } else { 1 });
                    let meta = layout.packed(&Device::Cpu).unwrap();
                    let got =
                        super::super::emu::run(&plan, &[&q.flatten_all().unwrap(), &kv.flatten_all().unwrap(), &meta])
                            .unwrap()
                            .remove(0)
                            .reshape(q.dims())
                            .unwrap();
                    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                    let e = max_diff_over_1(&got, &want);
                    assert!(e <= tol, "{heads}/{kv_heads} heads, chunk {chunk}, {dtype:?}: {e}");
                }
            }
        }
    }

    #[test]
    fn refuses_tables_past_the_pool_and_bad_shapes() {
        let (mut layout, slots) = ragged();
        let (q, kv) = (seeded(&[4, 5, 16], 1.0, 1), seeded(&[4, slots, 16], 1.0, 2));
        layout.tables[2] = 9;
        let e = paged_attention(&q, &kv, &layout, 0.25).unwrap_err().to_string();
        assert!(e.contains("past the pool"), "{e}");
        let (layout, _) = ragged();
        let e = paged_attention(&seeded(&[3, 5, 16], 1.0, 1), &kv, &layout, 0.25).unwrap_err().to_string();
        assert!(e.contains("multiple of KV"), "{e}");
    }
}
