//! The chunked attention algorithm, once for every device: query blocks against key blocks, whose matrix
//! products are batched GEMMs and whose small steps (mask, row max, exp, online-softmax update, the
//! backward's `ds = p (dp - D)`) are fused element-wise kernels of a [`Backend`].
//!
//! Layout of a step. The `N = B x KV` key/value heads are the GEMMs' batch. For query block `i0..i0 + n`
//! the `G = H / KV` query heads of a group are stacked along M: rows `g n + r` (head `kv G + g`, query
//! `i0 + r`) of a `[N, M = G n, D]` block, gathered once per query block, so each key block of a KV head
//! is read once for all its query heads (GQA without copying K/V). Key block `j0..j0 + nk` is a view of
//! `k`, `v` `[N, S, D]` (no copy). Per block pair:
//! - forward: `S = Q K_j^T` (f32), `fwd_scores` (scale, mask, row max, `P = exp(S - m)` in the GEMM
//!   dtype, `l` and `acc` rescaled), `acc += P V_j` (f32); per query block `fwd_finish` writes
//!   `o = acc / l` and `L = m + ln l`;
//! - backward: `S = Q K_j^T`, `dP = dO V_j^T`, `bwd_scores` (`P = exp(scale S - L)`, `dS = P (dP - D)`),
//!   `dV_j += P^T dO`, `dK_j += scale dS^T Q`, `dQ += scale dS K_j` (f32 accumulators; dK, dV for the
//!   whole `[N, S, D]`, dQ per query block).
//!
//! Block pairs none of whose queries see any of whose keys (causal, packed segments) are skipped both
//! ways ([`Visits`]); partially seen blocks are masked. Only `o` and `L` are kept between the passes
//! (recomputation); scratch is `O(N (M nk + M D))` plus the dK, dV accumulators: linear in T.

use candle_core::Result;

use super::Dims;

/// A matrix operand of a batched GEMM: row-major, element `(r, c)` of batch `b` at
/// `offset + b batch_stride + r ld + c`; `trans`: the operand is the transpose of that matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Operand {
    pub offset: usize,
    pub ld: usize,
    pub batch_stride: usize,
    pub trans: bool,
}

impl Operand {
    fn new(offset: usize, ld: usize, batch_stride: usize) -> Self {
        Self { offset, ld, batch_stride, trans: false }
    }

    fn t(self) -> Self {
        Self { trans: true, ..self }
    }
}

/// `C = alpha op(A) op(B) + beta C` for each of `batch` matrices: `op(A)` `[m, k]`, `op(B)` `[k, n]`,
/// `C` `[m, n]` in f32; A and B in the backend's GEMM dtype, products accumulated in f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Gemm {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Operand,
    pub b: Operand,
    pub c: Operand,
    pub alpha: f32,
    pub beta: f32,
}

impl Gemm {
    /// Multiply-adds times two.
    pub fn flops(&self) -> f64 {
        2.0 * (self.batch * self.m * self.n * self.k) as f64
    }
}

/// Query rows `i0..i0 + n` of every head: the rows of one forward or backward step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueryBlock {
    pub dims: Dims,
    pub i0: usize,
    pub n: usize,
}

impl QueryBlock {
    /// Rows of the stacked block of one KV head: `G n`.
    pub fn m(&self) -> usize {
        self.dims.group() * self.n
    }

    /// Batch entries: `B x KV`.
    pub fn batch(&self) -> usize {
        self.dims.b * self.dims.kv
    }

    /// The query head, query index and `[B, H, T]` row of stacked row `row` of batch entry `e`.
    pub fn row(&self, e: usize, row: usize) -> (usize, usize, usize) {
        let Dims { h, kv, t, .. } = self.dims;
        let (b, kvh) = (e / kv, e % kv);
        let (g, r) = (row / self.n, row % self.n);
        let head = kvh * self.dims.group() + g;
        let i = self.i0 + r;
        (head, i, (b * h + head) * t + i)
    }

    /// The keys stacked row `row` of batch entry `e` sees (`ranges` `[B, T, 2]`), clipped; `None` if none.
    pub fn keys(&self, ranges: &[u32], e: usize, row: usize) -> Option<(usize, usize)> {
        let b = e / self.dims.kv;
        super::key_range(ranges, &self.dims, b, self.i0 + row % self.n)
    }
}

/// A key block `j0..j0 + nk` of every KV head.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyBlock {
    pub j0: usize,
    pub nk: usize,
}

/// What a device provides: buffers, a batched GEMM, and the element-wise kernels. `In` buffers hold
/// the GEMM dtype (the inputs' dtype on a GPU; f32 on the CPU), `F32` buffers f32 and `U32` the ranges.
/// Every method is one kernel launch on a GPU.
pub(crate) trait Backend {
    type In;
    type F32;
    type U32;

    fn alloc_in(&self, len: usize) -> Result<Self::In>;
    /// `len` zeros.
    fn zeros_f32(&self, len: usize) -> Result<Self::F32>;
    fn gemm(&self, g: &Gemm, a: &Self::In, b: &Self::In, c: &mut Self::F32) -> Result<()>;
    /// Rows of `src` `[B, H, T, D]` into the stacked `dst` `[N, G n, D]` of `blk`.
    fn gather(&self, blk: &QueryBlock, src: &Self::In, dst: &mut Self::In) -> Result<()>;
    /// One key block of the forward's online softmax, for every stacked row: with `x = scale s` over the
    /// keys of `kb` the row sees (others masked), `m' = max(m, max x)`, `p = exp(x - m')` (0 where
    /// masked, written to `p` `[N, M, nk]`), `l = l e^(m - m') + sum p`, `acc *= e^(m - m')`, `m = m'`.
    /// `stats` is m (`[N, M]`) then l (`[N, M]`); `l = 0` means no key seen yet (m is then ignored), so
    /// the stats start as zeros.
    #[allow(clippy::too_many_arguments)]
    fn fwd_scores(
        &self,
        blk: &QueryBlock,
        kb: &KeyBlock,
        scale: f32,
        ranges: &Self::U32,
        s: &Self::F32,
        p: &mut Self::In,
        stats: &mut Self::F32,
        acc: &mut Self::F32,
    ) -> Result<()>;
    /// `o = acc / l` into `out` `[B, H, T, D]` and `L = m + ln l` into `lse` `[B, H, T]` (0 and -inf for a
    /// row that saw no key).
    fn fwd_finish(
        &self,
        blk: &QueryBlock,
        stats: &Self::F32,
        acc: &Self::F32,
        out: &mut Self::In,
        lse: &mut Self::F32,
    ) -> Result<()>;
    /// One key block of the backward, for every stacked row: `p = exp(scale s - L)` (0 where masked)
    /// and `ds = p (dp - D)`, both `[N, M, nk]` in the GEMM dtype.
    #[allow(clippy::too_many_arguments)]
    fn bwd_scores(
        &self,
        blk: &QueryBlock,
        kb: &KeyBlock,
        scale: f32,
        ranges: &Self::U32,
        lse_delta: &Self::F32,
        s: &Self::F32,
        dp: &Self::F32,
        p: &mut Self::In,
        ds: &mut Self::In,
    ) -> Result<()>;
    /// The stacked `acc` `[N, G n, D]` into rows of `dst` `[B, H, T, D]` at element `offset`.
    fn scatter(&self, blk: &QueryBlock, acc: &Self::F32, dst: &mut Self::In, offset: usize) -> Result<()>;
    /// `dst[offset..offset + src.len()] = src` in the GEMM dtype.
    fn cast(&self, src: &Self::F32, len: usize, dst: &mut Self::In, offset: usize) -> Result<()>;
}

/// Rows of queries per query block (per head: the GEMMs' M is `G bq`) and keys per key block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Blocks {
    pub bq: usize,
    pub bk: usize,
}

/// The devices [`block_sizes`] chooses for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Device {
    Cpu,
    Gpu,
}

/// Block sizes for `dims` on `device`. The GEMMs of one block pair are `[G bq, D] x [D, bk]` and
/// `[G bq, bk] x [bk, D]` batched over B x KV; the scratch is `N G bq bk` f32 scores (+ the GEMM-dtype
/// probabilities, and in the backward their gradient).
/// - GPU: every block pair is ~5 (forward) or ~8 (backward) launches, so blocks are large: M = G bq of
///   about 1k rows (bq = 1024 / G, at least 64) and bk = 2048 keys, which makes each GEMM several
///   GFLOP at D = 128 (tensor cores saturate from ~1k x 1k x 128 tiles per batch); a 16k-token causal
///   layer with G = 4 is ~290 block pairs: ~1,000 launches forward and ~1,900 backward ([`cost`]). Scores cost N x 1k x 2k x 4 bytes
///   = 8 MiB per KV head and batch row: bounded whatever T.
/// - CPU: the `gemm` crate reaches its speed from ~128-row operands, while the scores block should
///   stay in the L2 cache between the GEMM that writes it and the element-wise pass and GEMM that read
///   it: M = G bq of about 256 rows (bq = 256 / G, at least 16) and bk = 256 keys, 256 KiB of f32.
///
/// Blocks never exceed the sequence: bq <= T and bk <= S.
pub(crate) fn block_sizes(dims: &Dims, device: Device) -> Blocks {
    let g = dims.group();
    let (bq, bk) = match device {
        Device::Cpu => ((256 / g).max(16), 256),
        Device::Gpu => ((1024 / g).max(64), 2048),
    };
    Blocks { bq: bq.min(dims.t), bk: bk.min(dims.s) }
}

/// The key blocks each query block visits: for query block `q` (rows `q bq..`), key blocks
/// `spans[q].0..spans[q].1` (absolute key block indices, empty when no query of the block sees a key).
#[derive(Debug, Clone)]
pub(crate) struct Visits {
    pub dims: Dims,
    pub blocks: Blocks,
    pub spans: Vec<(usize, usize)>,
}

impl Visits {
    /// The key blocks holding any key a query of the block sees, from `ranges` `[B, T, 2]` on the host.
    pub fn new(dims: Dims, blocks: Blocks, ranges: &[u32]) -> Self {
        Self::from_rows(dims, blocks, |b, i| super::key_range(ranges, &dims, b, i))
    }

    /// The same for causal attention over `S - T` cached keys and `T` new ones (performance model).
    pub fn causal(dims: Dims, blocks: Blocks) -> Self {
        let past = dims.s.saturating_sub(dims.t);
        Self::from_rows(dims, blocks, |_, i| Some((0, (past + i).min(dims.s - 1))))
    }

    fn from_rows(dims: Dims, blocks: Blocks, keys: impl Fn(usize, usize) -> Option<(usize, usize)>) -> Self {
        let spans = (0..dims.t.div_ceil(blocks.bq))
            .map(|qb| {
                let rows = qb * blocks.bq..((qb + 1) * blocks.bq).min(dims.t);
                let (mut lo, mut hi) = (usize::MAX, 0);
                for (b, i) in (0..dims.b).flat_map(|b| rows.clone().map(move |i| (b, i))) {
                    if let Some((a, z)) = keys(b, i) {
                        (lo, hi) = (lo.min(a), hi.max(z + 1));
                    }
                }
                if lo >= hi {
                    (0, 0)
                } else {
                    (lo / blocks.bk, hi.div_ceil(blocks.bk))
                }
            })
            .collect();
        Self { dims, blocks, spans }
    }

    /// Each query block with the key blocks it visits.
    pub fn pairs(&self) -> impl Iterator<Item = (QueryBlock, Vec<KeyBlock>)> + '_ {
        let Blocks { bq, bk } = self.blocks;
        self.spans.iter().enumerate().map(move |(qb, &(a, z))| {
            let i0 = qb * bq;
            let blk = QueryBlock { dims: self.dims, i0, n: bq.min(self.dims.t - i0) };
            let keys = (a..z).map(|kb| KeyBlock { j0: kb * bk, nk: bk.min(self.dims.s - kb * bk) }).collect();
            (blk, keys)
        })
    }
}

/// Inputs of the forward: q `[B, H, T, D]`, k and v `[B, KV, S, D]`, ranges `[B, T, 2]`.
pub(crate) struct Inputs<'a, B: Backend> {
    pub q: &'a B::In,
    pub k: &'a B::In,
    pub v: &'a B::In,
    pub ranges: &'a B::U32,
    pub scale: f32,
}

/// The product of the stacked block (`[N, M, D]`, batch stride `M D`) and key rows `kb` of
/// `[N, S, D]` transposed: scores `[N, M, nk]`.
fn scores_gemm(blk: &QueryBlock, kb: &KeyBlock) -> Gemm {
    let Dims { s, d, .. } = blk.dims;
    let m = blk.m();
    Gemm {
        batch: blk.batch(),
        m,
        n: kb.nk,
        k: d,
        a: Operand::new(0, d, m * d),
        b: Operand::new(kb.j0 * d, d, s * d).t(),
        c: Operand::new(0, kb.nk, m * kb.nk),
        alpha: 1.0,
        beta: 0.0,
    }
}

/// `[N, M, nk]` probabilities (or their gradient) times key rows `kb` of `[N, S, D]`: `[N, M, D]`,
/// accumulated.
fn probs_keys_gemm(blk: &QueryBlock, kb: &KeyBlock, alpha: f32) -> Gemm {
    let Dims { s, d, .. } = blk.dims;
    let m = blk.m();
    Gemm {
        batch: blk.batch(),
        m,
        n: d,
        k: kb.nk,
        a: Operand::new(0, kb.nk, m * kb.nk),
        b: Operand::new(kb.j0 * d, d, s * d),
        c: Operand::new(0, d, m * d),
        alpha,
        beta: 1.0,
    }
}

/// `[N, M, nk]` transposed times the stacked `[N, M, D]`, accumulated into key rows `kb` of `[N, S, D]`.
fn probs_t_rows_gemm(blk: &QueryBlock, kb: &KeyBlock, alpha: f32) -> Gemm {
    let Dims { s, d, .. } = blk.dims;
    let m = blk.m();
    Gemm {
        batch: blk.batch(),
        m: kb.nk,
        n: d,
        k: m,
        a: Operand::new(0, kb.nk, m * kb.nk).t(),
        b: Operand::new(0, d, m * d),
        c: Operand::new(kb.j0 * d, d, s * d),
        alpha,
        beta: 1.0,
    }
}

/// Scratch of one query block at the largest block sizes: the stacked queries, scores and probabilities.
struct Scratch<B: Backend> {
    q: B::In,
    s: B::F32,
    p: B::In,
}

impl<B: Backend> Scratch<B> {
    fn new(be: &B, v: &Visits) -> Result<Self> {
        Ok(Self {
            q: be.alloc_in(sc_len(v, v.dims.d))?,
            s: be.zeros_f32(sc_len(v, v.blocks.bk))?,
            p: be.alloc_in(sc_len(v, v.blocks.bk))?,
        })
    }
}

/// The forward: `o` `[B, H, T, D]` (GEMM dtype) and `L` `[B, H, T]` (f32).
pub(crate) fn forward<B: Backend>(be: &B, visits: &Visits, x: &Inputs<B>) -> Result<(B::In, B::F32)> {
    let dims = visits.dims;
    let mut sc = Scratch::new(be, visits)?;
    let mut out = be.alloc_in(dims.q_len())?;
    let mut lse = be.zeros_f32(dims.b * dims.h * dims.t)?;
    for (blk, keys) in visits.pairs() {
        let m = blk.batch() * blk.m();
        be.gather(&blk, x.q, &mut sc.q)?;
        // m, l = 0 (no key seen yet) and acc = 0 for every row: fresh buffers per query block.
        let mut stats = be.zeros_f32(2 * m)?;
        let mut acc = be.zeros_f32(m * dims.d)?;
        for kb in &keys {
            be.gemm(&scores_gemm(&blk, kb), &sc.q, x.k, &mut sc.s)?;
            be.fwd_scores(&blk, kb, x.scale, x.ranges, &sc.s, &mut sc.p, &mut stats, &mut acc)?;
            be.gemm(&probs_keys_gemm(&blk, kb, 1.0), &sc.p, x.v, &mut acc)?;
        }
        be.fwd_finish(&blk, &stats, &acc, &mut out, &mut lse)?;
    }
    Ok((out, lse))
}

/// What the backward takes besides the inputs: the output's gradient `[B, H, T, D]` (GEMM dtype) and
/// `L`, `D = rowsum(dO o)` as one `[2, B, H, T]` f32 buffer.
pub(crate) struct Upstream<'a, B: Backend> {
    pub dout: &'a B::In,
    pub lse_delta: &'a B::F32,
}

/// The backward: dq, dk and dv one after the other in one `[nq + 2 nk]` buffer of the GEMM dtype.
pub(crate) fn backward<B: Backend>(be: &B, visits: &Visits, x: &Inputs<B>, up: &Upstream<B>) -> Result<B::In> {
    let dims = visits.dims;
    let (nq, nk) = (dims.q_len(), dims.kv_len());
    let mut sc = Scratch::new(be, visits)?;
    let mut g = be.alloc_in(sc_len(visits, dims.d))?;
    let mut dp = be.zeros_f32(sc_len(visits, visits.blocks.bk))?;
    let mut ds = be.alloc_in(sc_len(visits, visits.blocks.bk))?;
    let (mut dk, mut dv) = (be.zeros_f32(nk)?, be.zeros_f32(nk)?);
    let mut grads = be.alloc_in(nq + 2 * nk)?;
    for (blk, keys) in visits.pairs() {
        be.gather(&blk, x.q, &mut sc.q)?;
        be.gather(&blk, up.dout, &mut g)?;
        let mut acc = be.zeros_f32(blk.batch() * blk.m() * dims.d)?;
        for kb in &keys {
            be.gemm(&scores_gemm(&blk, kb), &sc.q, x.k, &mut sc.s)?;
            be.gemm(&scores_gemm(&blk, kb), &g, x.v, &mut dp)?;
            be.bwd_scores(&blk, kb, x.scale, x.ranges, up.lse_delta, &sc.s, &dp, &mut sc.p, &mut ds)?;
            be.gemm(&probs_t_rows_gemm(&blk, kb, 1.0), &sc.p, &g, &mut dv)?;
            be.gemm(&probs_t_rows_gemm(&blk, kb, x.scale), &ds, &sc.q, &mut dk)?;
            be.gemm(&probs_keys_gemm(&blk, kb, x.scale), &ds, x.k, &mut acc)?;
        }
        be.scatter(&blk, &acc, &mut grads, 0)?;
    }
    be.cast(&dk, nk, &mut grads, nq)?;
    be.cast(&dv, nk, &mut grads, nq + nk)?;
    Ok(grads)
}

/// Elements of a `[N, G bq, cols]` scratch buffer.
fn sc_len(v: &Visits, cols: usize) -> usize {
    v.dims.b * v.dims.kv * v.dims.group() * v.blocks.bq * cols
}

/// The work of one pass: GEMM FLOPs, bytes the element-wise kernels read and write, and launches
/// (one per backend call, buffer allocations aside).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub(crate) struct Work {
    pub gemm_flops: f64,
    pub elementwise_bytes: f64,
    pub launches: usize,
}

/// The work of the forward and the backward of `visits` with GEMM operands of `in_bytes` bytes an
/// element: what [`forward`] and [`backward`] launch, counted without running them.
pub(crate) fn cost(visits: &Visits, in_bytes: usize) -> (Work, Work) {
    let Dims { d, .. } = visits.dims;
    let (mut f, mut b) = (Work::default(), Work::default());
    let ib = in_bytes as f64;
    for (blk, keys) in visits.pairs() {
        let rows = (blk.batch() * blk.m()) as f64;
        let gather = rows * d as f64 * 2.0 * ib;
        f.launches += 2;
        f.elementwise_bytes += gather + rows * (d as f64 * (4.0 + ib) + 16.0);
        b.launches += 3;
        b.elementwise_bytes += 2.0 * gather + rows * d as f64 * (4.0 + ib);
        for kb in &keys {
            let s = scores_gemm(&blk, kb).flops();
            let pv = probs_keys_gemm(&blk, kb, 1.0).flops();
            let scores = rows * kb.nk as f64;
            f.gemm_flops += s + pv;
            f.launches += 3;
            f.elementwise_bytes += scores * (4.0 + ib) + rows * (2.0 * d as f64 * 4.0 + 16.0);
            b.gemm_flops += 2.0 * s + 3.0 * pv;
            b.launches += 6;
            b.elementwise_bytes += scores * (8.0 + 2.0 * ib) + rows * 8.0;
        }
    }
    let nk = visits.dims.kv_len() as f64;
    b.launches += 2;
    b.elementwise_bytes += 2.0 * nk * (4.0 + ib);
    (f, b)
}
