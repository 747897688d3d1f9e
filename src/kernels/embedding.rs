//! The embedding lookup as one op whose backward sums each token's gradient rows in f32. candle's
//! `index_select` backward is `index_add` in the weight's dtype, one row after another: in bf16, a token
//! seen thousands of times in a batch is rounded to 8 significant bits after every row, and its gradient
//! ends up percents off (see the test). Here:
//!
//! - [`embedding`]: `y[n] = W[ids[n]]` (`W` `[V, H]`, `ids` `[N]` u32), whose backward is
//!   [`embedding_grad`] cast once to the weight's dtype;
//! - [`embedding_grad`]: `dW[v] = sum_{n: ids[n] = v} g[n]` as an f32 `[V, H]`, summed in f32: on the CPU
//!   rows are grouped by token (a counting sort) and each token's rows added in row order, so the result is
//!   deterministic; on the GPU (kernels/embedding.cu) each element is added with an f32 atomic.
//!
//! The decoder takes [`embedding_grad`] directly (f32 into the f32 gradient accumulators, no bf16 copy at
//! all); [`embedding_reference`] is candle's `index_select`, the composite the op is tested against.
//! An id outside the vocabulary is an error on the CPU; on the GPU it reads as a NaN row and adds nothing
//! (no device sync to check it; the decoder checks its tokens on the host beforehand).

use candle_core::{CpuStorage, CustomOp2, InplaceOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{u32s, with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// `(n, v, h)` of a lookup of `ids` `[N]` in a `[V, H]` table (`table` is the weight's layout, or the
/// gradient's `[N, H]` with `vocab` given).
fn dims(ids: &Layout, rows: &Layout, vocab: Option<usize>) -> Result<(usize, usize, usize)> {
    let (r, h) = rows.shape().dims2()?;
    let n = ids.shape().dims1()?;
    let v = match vocab {
        Some(v) if r == n => v,
        Some(_) => candle_core::bail!("embedding gradient of {r} rows for {n} ids"),
        None => r,
    };
    if n > u32::MAX as usize || v > u32::MAX as usize || h > u32::MAX as usize {
        candle_core::bail!("embedding of {n} ids in a [{v}, {h}] table: each at most 2^32-1");
    }
    Ok((n, v, h))
}

fn cpu_lookup<T: Copy + Send + Sync>(w: &[T], ids: &[u32], (_, v, h): (usize, usize, usize)) -> Result<Vec<T>> {
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= v) {
        candle_core::bail!("embedding: token id {bad} is outside the vocabulary of {v}");
    }
    let mut out = Vec::with_capacity(ids.len() * h);
    for &id in ids {
        out.extend_from_slice(&w[id as usize * h..(id as usize + 1) * h]);
    }
    Ok(out)
}

/// The rows of each token, `order[start[id]..start[id + 1]]` in row order (a counting sort); an id
/// outside the vocabulary is an error.
fn token_rows(ids: &[u32], v: usize) -> Result<(Vec<usize>, Vec<usize>)> {
    let mut start = vec![0usize; v + 1];
    for &id in ids {
        if id as usize >= v {
            candle_core::bail!("embedding: token id {id} is outside the vocabulary of {v}");
        }
        start[id as usize + 1] += 1;
    }
    for i in 0..v {
        start[i + 1] += start[i];
    }
    let mut next = start.clone();
    let mut order = vec![0usize; ids.len()];
    for (r, &id) in ids.iter().enumerate() {
        order[next[id as usize]] = r;
        next[id as usize] += 1;
    }
    Ok((start, order))
}

/// `acc[v] += sum_{n: ids[n] = v} g[n]` over f32 `[V, H]` rows: each token's rows summed in f32 in row
/// order from zero, then added (rayon over tokens): deterministic whatever the thread count, and for a zero
/// `acc` the gradient itself.
fn cpu_grad_into<T: Elem>(acc: &mut [f32], ids: &[u32], g: &[T], (_, v, h): (usize, usize, usize)) -> Result<()> {
    let (start, order) = token_rows(ids, v)?;
    if h == 0 {
        return Ok(());
    }
    // Each thread's row of sums, made once and cleared per token.
    acc.par_chunks_mut(h).enumerate().for_each_init(
        || vec![0f32; h],
        |sum, (id, o)| {
            let rows = &order[start[id]..start[id + 1]];
            if rows.is_empty() {
                return;
            }
            sum.fill(0.0);
            for &r in rows {
                for (s, x) in sum.iter_mut().zip(&g[r * h..(r + 1) * h]) {
                    *s += x.f32();
                }
            }
            for (o, s) in o.iter_mut().zip(sum.iter()) {
                *o += s;
            }
        },
    );
    Ok(())
}

/// `dW` (f32 `[V, H]`): [`cpu_grad_into`] a zero accumulator.
fn cpu_grad<T: Elem>(ids: &[u32], g: &[T], dims: (usize, usize, usize)) -> Result<Vec<f32>> {
    let mut out = vec![0f32; dims.1 * dims.2];
    cpu_grad_into(&mut out, ids, g, dims)?;
    Ok(out)
}

struct Lookup;

impl CustomOp2 for Lookup {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = dims(l2, l1, None)?;
        let ids = u32s(s2, l2, "ids")?;
        let out = with_float!((s1, l1, "embedding weight") => |w| IntoStorage::storage(cpu_lookup(w, ids, dims)?));
        Ok((out, Shape::from((dims.0, dims.2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let dims = dims(l2, l1, None)?;
        let plan = forward_plan(s1.dtype(), dims)?;
        let y = super::cuda::run(&plan, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((y, Shape::from((dims.0, dims.2))))
    }

    fn bwd(
        &self,
        weight: &Tensor,
        ids: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dw = embedding_grad(ids, &grad.to_dtype(weight.dtype())?, weight.dim(0)?)?;
        Ok((Some(dw.to_dtype(weight.dtype())?), None))
    }
}

struct Grad {
    vocab: usize,
}

impl CustomOp2 for Grad {
    fn name(&self) -> &'static str {
        "embedding-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = dims(l1, l2, Some(self.vocab))?;
        let ids = u32s(s1, l1, "ids")?;
        let out = with_float!((s2, l2, "embedding gradient") => |g| cpu_grad(ids, g, dims)?);
        Ok((f32::storage(out), Shape::from((dims.1, dims.2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let dims = dims(l1, l2, Some(self.vocab))?;
        let plan = backward_plan(s2.dtype(), dims)?;
        let dw = super::cuda::run(&plan, &[(s1, l1), (s2, l2)])?.remove(0);
        Ok((dw, Shape::from((dims.1, dims.2))))
    }
}

/// [`Grad`] added into an f32 accumulator in place (no `[V, H]` buffer of its own, no clearing pass).
struct GradInto;

impl InplaceOp3 for GradInto {
    fn name(&self) -> &'static str {
        "embedding-grad-into"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let CpuStorage::F32(acc) = dst else { candle_core::bail!("embedding gradient: the accumulator must be f32") };
        let (v, _) = dst_l.shape().dims2()?;
        let dims = dims(l1, l2, Some(v))?;
        let Some((a, b)) = dst_l.contiguous_offsets() else {
            candle_core::bail!("embedding gradient: accumulator not contiguous")
        };
        let ids = u32s(s1, l1, "ids")?;
        with_float!((s2, l2, "embedding gradient") => |g| cpu_grad_into(&mut acc[a..b], ids, g, dims))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        use candle_core::backend::BackendStorage;
        let (v, _) = dst_l.shape().dims2()?;
        let plan = backward_into_plan(s2.dtype(), dims(l1, l2, Some(v))?)?;
        super::cuda::run(&plan, &[(&*dst, dst_l), (s1, l1), (s2, l2)])?;
        Ok(())
    }
}

/// Rows `ids` (`[N]` u32) of `weight` (`[V, H]`): `[N, H]`, with a backward to `weight` summed in f32 and
/// cast once to its dtype.
pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    weight.contiguous()?.apply_op2(&ids.contiguous()?, Lookup)
}

/// The gradient of `embedding(W, ids)` for `W` of `vocab` rows given the gradient `grad` (`[N, H]`) of its
/// output: f32 `[vocab, H]`, each token's rows summed in f32.
pub fn embedding_grad(ids: &Tensor, grad: &Tensor, vocab: usize) -> Result<Tensor> {
    ids.contiguous()?.apply_op2_no_bwd(&grad.detach().contiguous()?, &Grad { vocab })
}

/// [`embedding_grad`] added into `acc` (f32 contiguous `[vocab, H]`) in place: the gradient's own
/// `[vocab, H]` buffer, its clearing and the pass adding it into the accumulator are never made.
pub fn embedding_grad_into(acc: &Tensor, ids: &Tensor, grad: &Tensor) -> Result<()> {
    if acc.dtype() != candle_core::DType::F32 || !acc.is_contiguous() || acc.rank() != 2 {
        candle_core::bail!(
            "embedding gradient: an f32 contiguous [vocab, hidden] accumulator, got {:?} {:?}",
            acc.dtype(),
            acc.dims()
        );
    }
    acc.inplace_op3(&ids.contiguous()?, &grad.detach().contiguous()?, &GradInto)
}

/// The same lookup through candle's `index_select`, whose backward is `index_add` in the weight's dtype:
/// the composite [`embedding`] is tested against, and the decoder's path with `fused_ops = false`.
pub fn embedding_reference(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    weight.index_select(ids, 0)
}

/// Grid-stride launches over `len` elements: 256 threads a block, at most 2^20 blocks.
#[cfg(any(test, feature = "cuda"))]
fn grid(len: usize) -> ((u32, u32, u32), (u32, u32, u32)) {
    ((len.div_ceil(256).min(1 << 20) as u32, 1, 1), (256, 1, 1))
}

/// The launch of `emb_fwd` over `n` ids in a `[v, h]` table of `dtype`.
#[cfg(any(test, feature = "cuda"))]
pub(super) fn forward_plan(dtype: DType, (n, v, h): (usize, usize, usize)) -> Result<Plan> {
    let mut p = Plan::default();
    let w = p.input("weight", dtype, v * h);
    let ids = p.input("ids", DType::U32, n);
    let y = p.output("rows", dtype, n * h);
    rows_launch(&mut p, kernel_name("emb_fwd", dtype)?, [w, ids, y], (n, v, h))?;
    Ok(p)
}

/// The launch of `emb_bwd` adding the `n` rows of the gradient (`dtype`) into an f32 `[v, h]` accumulator,
/// the plan's first input, in place.
#[cfg(any(test, feature = "cuda"))]
pub(super) fn backward_into_plan(dtype: DType, (n, v, h): (usize, usize, usize)) -> Result<Plan> {
    let mut p = Plan::default();
    let dw = p.input("accumulator", DType::F32, v * h);
    let ids = p.input("ids", DType::U32, n);
    let g = p.input("grad", dtype, n * h);
    rows_launch(&mut p, kernel_name("emb_bwd", dtype)?, [ids, g, dw], (n, v, h))?;
    Ok(p)
}

/// One grid-stride launch of `kernel` over the `n x h` elements of the looked-up rows, its three buffers
/// then `n`, `v` and `h` (`emb_fwd`: table, ids, rows; `emb_bwd`: ids, rows' gradient, table's).
#[cfg(any(test, feature = "cuda"))]
fn rows_launch(p: &mut Plan, kernel: String, bufs: [Arg; 3], (n, v, h): (usize, usize, usize)) -> Result<()> {
    let (grid, block) = grid(n * h);
    let mut args = bufs.to_vec();
    args.extend([Arg::U32(n as u32), Arg::U32(v as u32), Arg::U32(h as u32)]);
    p.launch(Launch { module: Module::Embedding, kernel, grid, block, shared_bytes: 0, args })
}

/// The launches of the backward: `emb_zero_f32` over the f32 `[v, h]` accumulator, then `emb_bwd` adding
/// the `n` rows of the gradient (`dtype`) into it.
#[cfg(any(test, feature = "cuda"))]
pub(super) fn backward_plan(dtype: DType, (n, v, h): (usize, usize, usize)) -> Result<Plan> {
    let mut p = Plan::default();
    let ids = p.input("ids", DType::U32, n);
    let g = p.input("grad", dtype, n * h);
    let dw = p.output("grad_weight", DType::F32, v * h);
    let len = v * h;
    let (zgrid, block) = grid(len);
    let (lo, hi) = (Arg::U32(len as u32), Arg::U32((len as u64 >> 32) as u32));
    let zero = vec![dw, lo, hi];
    p.launch(Launch {
        module: Module::Embedding,
        kernel: "emb_zero_f32".into(),
        grid: zgrid,
        block,
        shared_bytes: 0,
        args: zero,
    })?;
    rows_launch(&mut p, kernel_name("emb_bwd", dtype)?, [ids, g, dw], (n, v, h))?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use half::bf16;

    fn seeded(n: usize, scale: f32, seed: u64) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
    }

    #[test]
    fn matches_index_select_forward_and_backward() {
        let (v, h, n) = (11, 6, 40);
        let w = Var::from_vec(seeded(v * h, 1.0, 1), (v, h), &Device::Cpu).unwrap();
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % 9).collect();
        let ids = Tensor::from_vec(ids, n, &Device::Cpu).unwrap();
        let up = Tensor::from_vec(seeded(n * h, 1.0, 2), (n, h), &Device::Cpu).unwrap();
        let a = embedding(w.as_tensor(), &ids).unwrap();
        let b = embedding_reference(w.as_tensor(), &ids).unwrap();
        assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        let ga = (a * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (b * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let (ga, gb) = (ga.get(w.as_tensor()).unwrap(), gb.get(w.as_tensor()).unwrap());
        let diff = (ga - gb).unwrap().abs().unwrap().max_keepdim(0).unwrap().max(1).unwrap();
        assert!(diff.to_vec1::<f32>().unwrap()[0] < 1e-5);
        // Tokens 9 and 10 never occur: zero rows.
        assert!(ga.get(9).unwrap().to_vec1::<f32>().unwrap().iter().all(|&x| x == 0.0));
    }

    /// A token repeated 4,096 times in a bf16 batch: its gradient summed in f32 is within 1e-3 of the f64
    /// sum (measured: 2.0e-7; cast once to bf16, 2.8e-3, one rounding), where candle's bf16 `index_add`
    /// (the reference's backward) is off by 86%: past 256 the running sum's bf16 spacing exceeds twice
    /// each added row, which then rounds away.
    #[test]
    fn a_frequent_tokens_bf16_gradient_is_summed_in_f32() {
        let (v, h, n) = (5, 8, 4096);
        let w = Var::from_tensor(&Tensor::zeros((v, h), DType::BF16, &Device::Cpu).unwrap()).unwrap();
        let mut ids = vec![2u32; n];
        ids[17] = 4;
        let ids = Tensor::from_vec(ids, n, &Device::Cpu).unwrap();
        // Upstream gradients of one sign and mixed magnitudes, as bf16.
        let up: Vec<f32> = seeded(n * h, 1.0, 3).iter().map(|x| 0.01 + x.abs()).collect();
        let up = Tensor::from_vec(up, (n, h), &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let exact: Vec<f64> = (0..h)
            .map(|j| {
                (0..n)
                    .filter(|&r| r != 17)
                    .map(|r| up.get(r).unwrap().get(j).unwrap().to_scalar::<bf16>().unwrap().to_f64())
                    .sum()
            })
            .collect();
        let worst = |g: &Tensor| -> f64 {
            let row = g.get(2).unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            row.iter().zip(&exact).map(|(a, e)| ((a - e) / e).abs()).fold(0.0, f64::max)
        };
        let grad = |y: Tensor| -> Tensor {
            let store = (y.to_dtype(DType::F32).unwrap() * up.to_dtype(DType::F32).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            store.get(w.as_tensor()).unwrap().clone()
        };
        let f32_sum = embedding_grad(&ids, &up, v).unwrap();
        assert_eq!(f32_sum.dtype(), DType::F32);
        assert!(worst(&f32_sum) < 1e-3, "f32 sum off by {}", worst(&f32_sum));
        let cast_once = grad(embedding(w.as_tensor(), &ids).unwrap());
        assert!(worst(&cast_once) < 4e-3, "cast once: off by {}", worst(&cast_once));
        let bf16_sum = grad(embedding_reference(w.as_tensor(), &ids).unwrap());
        assert!(worst(&bf16_sum) > 0.5, "index_add in bf16: off by only {}", worst(&bf16_sum));
    }

    #[test]
    fn ids_outside_the_vocabulary_are_errors() {
        let w = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        let ids = Tensor::from_vec(vec![0u32, 3], 2, &Device::Cpu).unwrap();
        assert!(embedding(&w, &ids).unwrap_err().to_string().contains("token id 3"));
        let g = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(embedding_grad(&ids, &g, 3).unwrap_err().to_string().contains("token id 3"));
        let acc = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(embedding_grad_into(&acc, &ids, &g).unwrap_err().to_string().contains("token id 3"));
        assert!(embedding_grad_into(&acc.to_dtype(DType::BF16).unwrap(), &ids, &g).is_err());
    }

    /// Into an accumulator, in place: the accumulator plus [`embedding_grad`], bit for bit (each token's
    /// rows summed from zero, then added), in every dtype; the rows of unseen tokens untouched.
    #[test]
    fn into_an_accumulator_adds_the_gradient_in_place() {
        let (n, v, h) = (50, 9, 6);
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * i) % (v as u32 - 1)).collect();
        let ids = Tensor::from_vec(ids, n, &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let g = Tensor::from_vec(seeded(n * h, 1.0, 3), (n, h), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let start = Tensor::from_vec(seeded(v * h, 1.0, 4), (v, h), &Device::Cpu).unwrap();
            let acc = start.copy().unwrap();
            let want = (&start + embedding_grad(&ids, &g, v).unwrap()).unwrap();
            embedding_grad_into(&acc, &ids, &g).unwrap();
            assert_eq!(acc.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap(), "{dtype:?}");
            assert_eq!(
                acc.get(v - 1).unwrap().to_vec1::<f32>().unwrap(),
                start.get(v - 1).unwrap().to_vec1::<f32>().unwrap()
            );
        }
    }
}
