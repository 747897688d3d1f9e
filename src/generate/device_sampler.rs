//! The next-token choice for a batch of logits rows on their own device (temperature, top-k, top-p and
//! the draw), with candle tensor ops only, so that a generation step copies one id per row to the host
//! instead of the whole `[rows, vocab]` logits. Generation uses it on a GPU; on the CPU device, where the
//! logits are already in host memory, the host sampler [`super::sample_token`] is faster
//! (benches/results/sample-device-cpu-2026-11-25.txt) and picks the same tokens.
//!
//! The choice is the one of [`super::sample_token_reference`]: candidates ordered by `logit / T`
//! (descending, ties by token id), top-k keeps the k first, top-p the shortest prefix whose mass reaches
//! p, and the draw walks the kept candidates in that order against `u * mass`. Nothing is sorted (candle's
//! CUDA sort holds a whole row in shared memory, too small for a vocabulary): each cut is found by
//! bisection on a threshold of the scaled logits (a fixed number of halvings, no host sync), then inside
//! the group of tokens tied at the threshold by a bisection on the token id, so ties fall in id order.
//! Weights are f32 here (f64 on the host): a draw can differ from the reference only when its uniform
//! falls within float rounding of a boundary. Logits more than [`FLOOR`] nats below a row's best count
//! as tied at that floor (weight under e^-80 of the best): they are ordered by id, not by value.

use candle_core::{DType, Result, Tensor, D};

use super::SamplingParams;

/// Scaled logits below `max - FLOOR` are treated as equal (at the floor).
const FLOOR: f64 = 80.0;
/// Halvings of a value bracket: from ~80 wide to below any f32 spacing of logits of normal size.
const VALUE_STEPS: usize = 48;

/// The token picked in each row of `logits` (`[rows, vocab]`, any float dtype) as a u32 `[rows]` tensor
/// on the logits' device: the argmax with temperature 0, else a draw with `uniforms[r]` (in [0, 1)) for
/// row r.
pub fn sample_rows(logits: &Tensor, params: &SamplingParams, uniforms: &[f32]) -> Result<Tensor> {
    if params.temperature <= 0.0 {
        return logits.argmax(D::Minus1);
    }
    let dev = logits.device();
    let (rows, vocab) = logits.dims2()?;
    if uniforms.len() != rows {
        candle_core::bail!("{} uniforms for {rows} rows", uniforms.len());
    }
    let z = logits.to_dtype(DType::F32)?.broadcast_div(&Tensor::new(&[params.temperature], dev)?)?;
    let max = z.max_keepdim(1)?;
    let floor = (&max - FLOOR)?;
    // Above every candidate, whatever the magnitude of the logits.
    let top = (&max + (max.abs()? * 1e-5)?.affine(1.0, 1.0)?)?;
    let rows_ = Rows { z: z.broadcast_maximum(&floor)?, floor, top, ids: ids(vocab, dev)? };
    let mut w = z.broadcast_sub(&max)?.exp()?;
    if params.top_k > 0 && params.top_k < vocab {
        w = (&w * rows_.top_k(params.top_k)?)?;
    }
    if params.top_p < 1.0 {
        let target = (w.sum_keepdim(1)? * params.top_p as f64)?;
        w = (&w * rows_.prefix(&w, &target, true)?.0)?;
    }
    let u = Tensor::from_iter(uniforms.iter().map(|u| u.clamp(0.0, 1.0 - f32::EPSILON)), dev)?.reshape((rows, 1))?;
    let target = w.sum_keepdim(1)?.broadcast_mul(&u)?;
    let (_, last) = rows_.prefix(&w, &target, false)?;
    last.squeeze(1)?.to_dtype(DType::U32)
}

/// Token ids 0..vocab as f32 `[1, vocab]` (exact below 2^24).
fn ids(vocab: usize, dev: &candle_core::Device) -> Result<Tensor> {
    Tensor::arange(0u32, vocab as u32, dev)?.to_dtype(DType::F32)?.unsqueeze(0)
}

/// One batch of scaled logits clamped at their floor, with the brackets of their value searches.
struct Rows {
    z: Tensor,
    floor: Tensor,
    top: Tensor,
    ids: Tensor,
}

impl Rows {
    /// The mask (f32 0/1) of the k first candidates of each row.
    fn top_k(&self, k: usize) -> Result<Tensor> {
        let ones = self.z.ones_like()?;
        let k = Tensor::full(k as f32, self.floor.dims(), self.z.device())?;
        let (lo, hi) = bisect(&self.z, &ones, &k, &self.floor, &self.top, VALUE_STEPS, true)?;
        let above = self.z.broadcast_ge(&hi)?.to_dtype(DType::F32)?;
        let tie = (self.z.broadcast_ge(&lo)?.to_dtype(DType::F32)? - &above)?;
        let need = (k - above.sum_keepdim(1)?)?;
        let last = nth_by_id(&tie, &(need - 1.0)?, &self.ids)?;
        above + (tie * self.ids.broadcast_le(&last)?.to_dtype(DType::F32)?)?
    }

    /// The shortest prefix (in candidate order) of the tokens of weight `w` whose mass reaches `target`
    /// (`reach`: >= target; else > target): its mask (f32 0/1) and the id of its last token (f32 `[rows,
    /// 1]`).
    fn prefix(&self, w: &Tensor, target: &Tensor, reach: bool) -> Result<(Tensor, Tensor)> {
        let (lo, hi) = bisect(&self.z, w, target, &self.floor, &self.top, VALUE_STEPS, reach)?;
        let kept = w.gt(0.0)?.to_dtype(DType::F32)?;
        let above = (self.z.broadcast_ge(&hi)?.to_dtype(DType::F32)? * &kept)?;
        let tie = ((self.z.broadcast_ge(&lo)?.to_dtype(DType::F32)? * &kept)? - &above)?;
        let ahead = (&above * w)?.sum_keepdim(1)?;
        let each = (&tie * w)?.max_keepdim(1)?.maximum(f32::MIN_POSITIVE)?;
        let count = tie.sum_keepdim(1)?;
        // How many tied tokens the prefix takes: the first n with ahead + n * each reaching the target.
        let n = (target - &ahead)?.div(&each)?;
        let n = if reach { n.ceil()? } else { (n.floor()? + 1.0)? };
        let n = n.maximum(1.0)?.minimum(&count)?;
        let last = nth_by_id(&tie, &(n - 1.0)?, &self.ids)?;
        let mask = (above + (tie * self.ids.broadcast_le(&last)?.to_dtype(DType::F32)?)?)?;
        Ok((mask, last))
    }
}

/// Per row, a bracket `(lo, hi)` (`[rows, 1]`) of the threshold where the mass `sum(w over z >= t)`
/// crosses `target`: over `z >= lo` it reaches it (`>=` with `reach`, else `>`), over `z >= hi` it does
/// not; `lo` and `hi` start as such a bracket and are halved `steps` times.
fn bisect(
    z: &Tensor,
    w: &Tensor,
    target: &Tensor,
    lo: &Tensor,
    hi: &Tensor,
    steps: usize,
    reach: bool,
) -> Result<(Tensor, Tensor)> {
    let (mut lo, mut hi) = (lo.clone(), hi.clone());
    for _ in 0..steps {
        let mid = ((&lo + &hi)? * 0.5)?;
        let mass = (z.broadcast_ge(&mid)?.to_dtype(DType::F32)?.broadcast_mul(w))?.sum_keepdim(1)?;
        let ok = if reach { mass.ge(target)? } else { mass.gt(target)? };
        lo = ok.where_cond(&mid, &lo)?;
        hi = ok.where_cond(&hi, &mid)?;
    }
    Ok((lo, hi))
}

/// The id (f32 `[rows, 1]`) of the `j`-th (0-based, f32 `[rows, 1]`) token of each row's `mask` (f32 0/1
/// `[rows, vocab]`) in id order; `j` must be below the row's count.
fn nth_by_id(mask: &Tensor, j: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let vocab = ids.dim(1)?;
    let shape = j.dims();
    let dev = mask.device();
    let lo = Tensor::full(-(vocab as f32), shape, dev)?;
    let hi = Tensor::full(0.5f32, shape, dev)?;
    let steps = (usize::BITS - vocab.leading_zeros()) as usize + 3;
    // Over -id, the largest threshold with more than j tokens at or above it: -(the j-th id).
    let (lo, _) = bisect(&ids.neg()?, mask, j, &lo, &hi, steps, false)?;
    let within = ids.broadcast_le(&lo.neg()?)?.to_dtype(DType::F32)?;
    // The largest such id, as (id + 1) - 1 so that an empty row gives -1.
    (within * mask)?.broadcast_mul(&(ids + 1.0)?)?.max_keepdim(1)? - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::sample_token_reference;
    use candle_core::Device;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// `rows` draws from one row of logits: the device picks and the reference's with the same uniforms.
    fn both(logits: &[f32], params: &SamplingParams, rows: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let u: Vec<f64> = (0..rows).map(|_| rng.gen()).collect();
        let batch = Tensor::from_slice(logits, (1, logits.len()), &Device::Cpu).unwrap();
        let batch = batch.broadcast_as((rows, logits.len())).unwrap().contiguous().unwrap();
        let u32s: Vec<f32> = u.iter().map(|&u| u as f32).collect();
        let ours = sample_rows(&batch, params, &u32s).unwrap().to_vec1::<u32>().unwrap();
        let reference = u.iter().map(|&u| sample_token_reference(logits, params, u)).collect();
        (ours, reference)
    }

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, ..Default::default() }
    }

    /// The same ids as the full-sort reference for the same uniforms, over logits with and without ties
    /// (bf16-like, in steps of 1/4: ties are walked in id order) and every cut.
    #[test]
    fn the_same_tokens_as_the_full_sort_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let smooth: Vec<f32> = (0..1000).map(|_| rng.gen_range(-6.0f32..6.0)).collect();
        let tied: Vec<f32> = smooth.iter().map(|l| (l * 4.0).round() / 4.0).collect();
        for logits in [&smooth, &tied] {
            for p in [
                params(0.6, 0, 0.95),
                params(1.0, 100, 0.5),
                params(0.8, 20, 1.0),
                params(1.0, 0, 1.0),
                params(1.3, 7, 0.9),
            ] {
                let (ours, reference) = both(logits, &p, 300, 3);
                assert_eq!(ours, reference, "{p:?}");
            }
        }
    }

    #[test]
    fn edge_cases_of_the_cuts() {
        let logits = vec![0.0f32, 3.0, 2.9, 1.0, f32::NEG_INFINITY, 3.0];
        let all = |p: &SamplingParams| both(&logits, p, 200, 7);
        // Greedy, k = 1 and a tiny p all take the best token (the first of the tie 1, 5).
        assert_eq!(
            sample_rows(&Tensor::new(&[[0.0f32, 3.0, 1.0]], &Device::Cpu).unwrap(), &params(0.0, 0, 1.0), &[])
                .unwrap()
                .to_vec1::<u32>()
                .unwrap(),
            vec![1]
        );
        for p in [params(1.0, 1, 1.0), params(1.0, 0, 1e-6)] {
            let (ours, reference) = all(&p);
            assert!(ours.iter().all(|&t| t == 1), "{p:?}: {ours:?}");
            assert_eq!(ours, reference);
        }
        // k = 2 keeps the tie 1, 5; k at or past the vocabulary and p = 1 keep every finite logit.
        let (k2, _) = all(&params(1.0, 2, 1.0));
        assert_eq!(k2.iter().copied().collect::<std::collections::BTreeSet<_>>(), [1, 5].into());
        for p in [params(1.0, 6, 1.0), params(1.0, 50, 1.0), params(1.0, 0, 1.0)] {
            let (ours, reference) = all(&p);
            assert_eq!(ours, reference, "{p:?}");
            let seen: std::collections::BTreeSet<u32> = ours.into_iter().collect();
            assert_eq!(seen, [0, 1, 2, 3, 5].into(), "{p:?}: -inf is never drawn, the rest are");
        }
    }

    /// The nucleus of a vocabulary-size row, found by bisection, is the one a full sort gives.
    #[test]
    fn top_p_over_a_large_vocabulary_keeps_exactly_the_nucleus() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let logits: Vec<f32> = (0..151_936).map(|_| rng.gen_range(-8.0f32..8.0)).collect();
        let (ours, reference) = both(&logits, &params(0.6, 0, 0.95), 8, 5);
        assert_eq!(ours, reference);
        assert!(ours.iter().collect::<std::collections::HashSet<_>>().len() > 4, "draws spread: {ours:?}");
    }
}
