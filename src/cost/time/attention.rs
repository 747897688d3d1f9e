//! The attention kernels' work in the step's ops: the flash, tensor-core (mma, wgmma) and matrix kinds.

use super::*;

/// The tensor-core backward's `delta = rowsum(dO O)` over `rows` rows and its concatenation with the
/// log-sum-exp: kernels::row_dot in packed builds, else candle's casts, product and sum.
pub(super) fn attention_delta(o: &mut Ops, rows: f64, hd: f64, d: f64) {
    let cat = rows * 16.0;
    if o.packed {
        o.elementwise("attention element-wise (backward)", rows * (hd * 2.0 * d + 4.0), 1.0, true);
        o.push("attention element-wise (backward)", OpKind::Elementwise, 0.0, cat, 1.0);
    } else {
        o.push("attention element-wise (backward)", OpKind::Elementwise, 0.0, rows * hd * (2.0 * d + 24.0), 6.0);
    }
}

/// The scores and block pairs the dk/dv kernel computes for one causal sequence and query head: each
/// block of `bk` keys against the blocks of `bq` queries from the one holding its first key on.
pub(super) fn computed_scores_by_keys(t: u64, bk: u64, bq: u64) -> (f64, f64) {
    let (mut scores, mut pairs) = (0f64, 0f64);
    let mut j0 = 0;
    while j0 < t {
        let keys = bk.min(t - j0);
        let first = j0 / bq * bq;
        scores += keys as f64 * (t - first) as f64;
        pairs += (t - first).div_ceil(bq) as f64;
        j0 += keys;
    }
    (scores, pairs)
}

/// One head's streamed operands the tensor-core kernels may re-read from L2 (under half an A100's or
/// H100's).
pub(super) const L2_RESIDENT_BYTES: f64 = 20e6;

/// The blocks of the tensor-core attention kernels and the kinds of their ops: queries per block and keys
/// per step of the forward and the dq kernel, keys per block and queries per step of the dk/dv kernel.
pub(super) struct Tiles {
    forward: OpKind,
    kind: OpKind,
    rows: u64,
    keys: u64,
    dkv_keys: u64,
    dkv_queries: u64,
}

/// kernels/flash_mma.cu's.
pub(super) const MMA_TILES: Tiles = Tiles {
    forward: OpKind::AttentionMmaForward,
    kind: OpKind::AttentionMma,
    rows: 64,
    keys: 32,
    dkv_keys: 64,
    dkv_queries: 16,
};
/// kernels/flash_wgmma.cu's: 128-row blocks (two warpgroups of 64), 64-row steps.
pub(super) const WGMMA_TILES: Tiles = Tiles {
    forward: OpKind::AttentionWgmmaForward,
    kind: OpKind::AttentionWgmma,
    rows: 128,
    keys: 64,
    dkv_keys: 128,
    dkv_queries: 64,
};

/// One layer's attention on the tensor-core kernels in `tiles` on `b` sequences of `t` tokens: forward
/// S = Q K^T and O += P V (4 hd FLOPs a score); backward the dq kernel (S, dP, dQ: 6 hd) and the dk/dv
/// kernel (S^T, dP^T, dV, dK: 8 hd). Each block's own rows move once, the streamed operand once per head
/// when it fits in [`L2_RESIDENT_BYTES`], else once per block pair.
pub(super) fn layer_attention_tiles(
    o: &mut Ops,
    m: &ModelConfig,
    (b, t, d): (f64, u64, f64),
    tiles: &Tiles,
    (backward, atomic_dq): (bool, bool),
) {
    let (heads, hd) = (m.num_heads as f64, m.head_dim as f64);
    let bh = b * heads;
    let tokens = t as f64;
    let row_stats = 4.0 + 8.0; // a query's log-sum-exp (or delta) and its key range
    let resident = 2.0 * tokens * hd * d <= L2_RESIDENT_BYTES;
    // The streamed pair of [rows, hd] operands: once per head, or `rows` per block pair.
    let streamed = |pairs: f64, rows: f64| if resident { 2.0 * tokens * hd * d } else { pairs * 2.0 * rows * hd * d };
    let blocks = AttentionBlocks { query: tiles.rows, key: tiles.keys };
    let step_keys = tiles.keys as f64;
    if !backward {
        let (scores, pairs) = computed_scores(t, blocks);
        let bytes = tokens * (2.0 * hd * d + row_stats) + streamed(pairs, step_keys);
        let work = (bh * 4.0 * hd * scores, bh * 4.0 * hd * causal_pairs(t));
        o.attention_kernel(
            "attention kernels (forward)",
            tiles.forward,
            work,
            (bh * bytes, 1.0),
            (t, m.head_dim as u64),
        );
        return;
    }
    attention_delta(o, bh * tokens, hd, d);
    if atomic_dq {
        return layer_attention_atomic(o, m, (b, t, d), tiles);
    }
    let (scores, pairs) = computed_scores(t, blocks);
    let dq_bytes = tokens * (3.0 * hd * d + 2.0 * row_stats) + streamed(pairs, step_keys);
    let (kv_scores, kv_pairs) = computed_scores_by_keys(t, tiles.dkv_keys, tiles.dkv_queries);
    let step_queries = tiles.dkv_queries as f64;
    let key_blocks = t.div_ceil(tiles.dkv_keys) as f64;
    let spans = tokens.div_euclid(16.0).max(1.0) * 8.0; // each 16 queries' key span, read per key block
    let ranges_scan = tokens * 8.0 + if resident { spans } else { key_blocks * spans };
    let kv_bytes = tokens * 4.0 * hd * d / heads * m.num_kv_heads as f64
        + streamed(kv_pairs, step_queries)
        + kv_pairs * step_queries * 2.0 * row_stats
        + ranges_scan;
    let work = (bh * (6.0 * hd * scores + 8.0 * hd * kv_scores), bh * 10.0 * hd * causal_pairs(t));
    // The dq kernel, the dk/dv kernel and the sum of its groups' parts.
    let io = (bh * (dq_bytes + kv_bytes), 3.0);
    o.attention_kernel("attention kernels (backward)", tiles.kind, work, io, (t, m.head_dim as u64));
}

/// The backward of [`layer_attention_tiles`] with dq summed by atomics in the dk/dv kernel (10 hd FLOPs
/// a score) into an f32 accumulator, whose atomics the L2 absorbs while it fits in [`L2_RESIDENT_BYTES`].
pub(super) fn layer_attention_atomic(o: &mut Ops, m: &ModelConfig, (b, t, d): (f64, u64, f64), tiles: &Tiles) {
    let (heads, hd) = (m.num_heads as f64, m.head_dim as f64);
    let (bh, tokens) = (b * heads, t as f64);
    let row_stats = 4.0 + 8.0;
    let step = tiles.dkv_queries as f64;
    let (kv_scores, kv_pairs) = computed_scores_by_keys(t, tiles.dkv_keys, tiles.dkv_queries);
    let resident = 2.0 * tokens * hd * d <= L2_RESIDENT_BYTES;
    let streamed = if resident { 2.0 * tokens * hd * d } else { kv_pairs * 2.0 * step * hd * d };
    let accumulator = tokens * hd * 4.0;
    let atomics = if accumulator <= L2_RESIDENT_BYTES { 0.0 } else { kv_pairs * step * hd * 8.0 };
    let spans = tokens.div_euclid(16.0).max(1.0) * 8.0;
    let kv_bytes = tokens * 4.0 * hd * d / heads * m.num_kv_heads as f64
        + streamed
        + kv_pairs * step * 2.0 * row_stats
        + tokens * 8.0
        + if resident { spans } else { t.div_ceil(tiles.dkv_keys) as f64 * spans };
    // Zeroed (prep), read and written as dq (dq_out).
    let accumulator_bytes = accumulator * 2.0 + tokens * hd * d + tokens * 8.0;
    let work = (bh * 10.0 * hd * kv_scores, bh * 10.0 * hd * causal_pairs(t));
    let bytes = bh * (kv_bytes + atomics + accumulator_bytes);
    let kind = if tiles.kind == OpKind::AttentionWgmma { OpKind::AttentionWgmmaAtomic } else { tiles.kind };
    // Four launches: bwd_prep, the dk/dv kernel, the sum of its groups' parts and bwd_dq_out.
    o.attention_kernel("attention kernels (backward)", kind, work, (bytes, 4.0), (t, m.head_dim as u64));
}

/// One layer's attention on `b` sequences of `t` tokens (`backward`: with its recomputation): chunked
/// GEMMs in `blocks`, or the tensor-core kernels with `tensor_cores`.
pub(super) fn layer_attention(
    o: &mut Ops,
    m: &ModelConfig,
    b: f64,
    t: u64,
    (blocks, tensor_cores): (AttentionBlocks, Option<TensorCoreKernels>),
    d: f64,
    backward: bool,
) {
    match tensor_cores {
        Some(TensorCoreKernels::Mma(atomic_dq)) => {
            return layer_attention_tiles(o, m, (b, t, d), &MMA_TILES, (backward, atomic_dq))
        }
        Some(TensorCoreKernels::Wgmma(atomic_dq)) => {
            return layer_attention_tiles(o, m, (b, t, d), &WGMMA_TILES, (backward, atomic_dq))
        }
        None => {}
    }
    let (heads, hd) = (m.num_heads as f64, m.head_dim as f64);
    let (scores, pairs) = computed_scores(t, blocks);
    let q_blocks = t.div_ceil(blocks.query.max(1)) as f64;
    let (bq, bk) = ((blocks.query.min(t)) as f64, (blocks.key.min(t)) as f64);
    let bh = b * heads;
    // Per score: the GEMM FLOPs and the f32 / d-byte block products through memory. Per pair: the Q
    // (and dO, dQ) rows and K, V (and dK, dV) columns each GEMM reads or accumulates (per head).
    let (gemms, flops_per_score, score_bytes, row_vectors, col_vectors, ew, ew_per_qblock) = if backward {
        (5.0, 10.0 * hd, 16.0 + 4.0 * d, 4.0 * d + 8.0, 2.0 * d + 8.0, 2.0, 1.0)
    } else {
        (2.0, 4.0 * hd, 8.0 + 2.0 * d, d + 8.0, 2.0 * d, 2.0, 1.0)
    };
    // The G query heads of a KV group are stacked in one GEMM's rows: K, V (dK, dV) move once per group.
    let group = (m.num_heads / m.num_kv_heads.max(1)).max(1) as f64;
    let vector_bytes = pairs * hd * (bq * row_vectors + bk * col_vectors / group);
    let gemm_bytes = scores * 4.0 + vector_bytes; // S (and dP) written in f32 by the GEMMs
    let name = if backward { "attention GEMMs (backward)" } else { "attention GEMMs (forward)" };
    o.push(name, OpKind::AttentionGemm, bh * flops_per_score * scores, bh * gemm_bytes, gemms * pairs);
    let ew_bytes = scores * (score_bytes - 4.0) + q_blocks * bq * hd * 2.0 * d;
    let name = if backward { "attention element-wise (backward)" } else { "attention element-wise (forward)" };
    o.push(name, OpKind::Elementwise, 0.0, bh * ew_bytes, ew * pairs + ew_per_qblock * q_blocks);
}
