//! The GPU [`Backend`] of the chunked attention: GEMMs by cuBLAS (`cublasGemmStridedBatchedEx` on the
//! handle candle's device holds, its stream: A and B in the inputs' dtype, f32 C and f32 compute, so bf16
//! and f16 run on tensor cores) and the element-wise steps by the `fa_*` kernels of
//! kernels/flash_attention.cu, launched by the plans of launches.rs (the ones the emulator runs in tests).

use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};

use super::driver::{Backend, Gemm, KeyBlock, Operand, QueryBlock};
use super::launches::{self, Step};
use crate::kernels::cuda::{cublas_type, flash_ptx, launch};

/// The GPU backend for GEMM dtype `T` (f32, bf16 or f16).
pub(crate) struct GpuBackend<T> {
    pub dev: CudaDevice,
    pub dtype: DType,
    _t: std::marker::PhantomData<T>,
}

/// A pointer argument: a device address and its element size.
#[derive(Clone, Copy)]
struct Ptr(u64, usize);

impl<T: CudaDType + DeviceRepr + ValidAsZeroBits> GpuBackend<T> {
    pub fn new(dev: CudaDevice, dtype: DType) -> Self {
        Self { dev, dtype, _t: std::marker::PhantomData }
    }

    fn stream(&self) -> std::sync::Arc<CudaStream> {
        self.dev.cuda_stream()
    }

    /// A contiguous input in the GEMM dtype as a slice of its own.
    pub fn input(&self, s: &CudaStorage, l: &Layout) -> Result<CudaSlice<T>> {
        input::<T>(&self.dev, s, l)
    }

    /// One step: its plan over the buffers (element counts from the slices), launched with their addresses.
    fn run(&self, step: Step, ptrs: &[(Ptr, DType, usize)]) -> Result<()> {
        let bufs: Vec<_> = ptrs.iter().map(|(_, dt, len)| ("buffer", *dt, *len)).collect();
        let plan = step.plan(self.dtype, &bufs)?;
        for l in &plan.launches {
            launch(&self.dev, l, "grpo_flash_attention", flash_ptx(), |index, offset| {
                let Ptr(p, size) = ptrs[index].0;
                p + (offset * size) as u64
            })?;
        }
        Ok(())
    }
}

/// A contiguous input as a slice of its own (a device copy: linear in T, next to the GEMMs).
pub(crate) fn input<U: CudaDType + DeviceRepr>(dev: &CudaDevice, s: &CudaStorage, l: &Layout) -> Result<CudaSlice<U>> {
    let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("flash attention: input not contiguous") };
    dev.cuda_stream().clone_dtod(&s.as_cuda_slice::<U>()?.slice(a..b)).w()
}

fn ptr_in<T: DeviceRepr>(s: &CudaSlice<T>, stream: &CudaStream, dtype: DType) -> (Ptr, DType, usize) {
    let (p, _guard) = s.device_ptr(stream);
    (Ptr(p, dtype.size_in_bytes()), dtype, s.len())
}

fn ptr_out<T: DeviceRepr>(s: &mut CudaSlice<T>, stream: &CudaStream, dtype: DType) -> (Ptr, DType, usize) {
    let len = s.len();
    let (p, _guard) = s.device_ptr_mut(stream);
    (Ptr(p, dtype.size_in_bytes()), dtype, len)
}

fn op(o: &Operand) -> sys::cublasOperation_t {
    match o.trans {
        false => sys::cublasOperation_t::CUBLAS_OP_N,
        true => sys::cublasOperation_t::CUBLAS_OP_T,
    }
}

impl<T: CudaDType + DeviceRepr + ValidAsZeroBits> Backend for GpuBackend<T> {
    type In = CudaSlice<T>;
    type F32 = CudaSlice<f32>;
    type U32 = CudaSlice<u32>;

    fn alloc_in(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: the driver writes every element it later reads (gathers, element-wise steps).
        unsafe { self.dev.alloc::<T>(len.max(1)) }
    }

    fn zeros_f32(&self, len: usize) -> Result<CudaSlice<f32>> {
        self.dev.alloc_zeros::<f32>(len.max(1))
    }

    /// Row-major `C = op(A) op(B)` is column-major `C^T = op(B)^T op(A)^T`: cuBLAS gets B first.
    fn gemm(&self, g: &Gemm, a: &CudaSlice<T>, b: &CudaSlice<T>, c: &mut CudaSlice<f32>) -> Result<()> {
        if g.batch == 0 || g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let stream = self.stream();
        let es = self.dtype.size_in_bytes() as u64;
        let (pa, _ga) = a.device_ptr(&stream);
        let (pb, _gb) = b.device_ptr(&stream);
        let (pc, _gc) = c.device_ptr_mut(&stream);
        let ty = cublas_type(self.dtype)?;
        let blas = self.dev.cublas_handle();
        // SAFETY: the driver's operands lie within their buffers (the CPU backend checks the same Gemm).
        unsafe {
            blas::gemm_strided_batched_ex(
                *blas.handle(),
                op(&g.b),
                op(&g.a),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                (&g.alpha) as *const f32 as *const _,
                (pb + g.b.offset as u64 * es) as *const _,
                ty,
                g.b.ld as i32,
                g.b.batch_stride as i64,
                (pa + g.a.offset as u64 * es) as *const _,
                ty,
                g.a.ld as i32,
                g.a.batch_stride as i64,
                (&g.beta) as *const f32 as *const _,
                (pc + g.c.offset as u64 * 4) as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                g.c.ld as i32,
                g.c.batch_stride as i64,
                g.batch as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| candle_core::Error::Msg(format!("flash attention GEMM: {e:?}")))
    }

    fn gather(&self, blk: &QueryBlock, src: &CudaSlice<T>, dst: &mut CudaSlice<T>) -> Result<()> {
        let s = self.stream();
        self.run(launches::gather(blk), &[ptr_in(src, &s, self.dtype), ptr_out(dst, &s, self.dtype)])
    }

    fn fwd_scores(
        &self,
        blk: &QueryBlock,
        kb: &KeyBlock,
        scale: f32,
        ranges: &CudaSlice<u32>,
        sc: &CudaSlice<f32>,
        p: &mut CudaSlice<T>,
        stats: &mut CudaSlice<f32>,
        acc: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let s = self.stream();
        let ptrs = [
            ptr_in(sc, &s, DType::F32),
            ptr_out(p, &s, self.dtype),
            ptr_out(stats, &s, DType::F32),
            ptr_out(acc, &s, DType::F32),
            ptr_in(ranges, &s, DType::U32),
        ];
        self.run(launches::fwd_scores(blk, kb, scale), &ptrs)
    }

    fn fwd_finish(
        &self,
        blk: &QueryBlock,
        stats: &CudaSlice<f32>,
        acc: &CudaSlice<f32>,
        out: &mut CudaSlice<T>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let s = self.stream();
        let ptrs = [
            ptr_in(stats, &s, DType::F32),
            ptr_in(acc, &s, DType::F32),
            ptr_out(out, &s, self.dtype),
            ptr_out(lse, &s, DType::F32),
        ];
        self.run(launches::fwd_finish(blk), &ptrs)
    }

    fn bwd_scores(
        &self,
        blk: &QueryBlock,
        kb: &KeyBlock,
        scale: f32,
        ranges: &CudaSlice<u32>,
        lse_delta: &CudaSlice<f32>,
        sc: &CudaSlice<f32>,
        dp: &CudaSlice<f32>,
        p: &mut CudaSlice<T>,
        ds: &mut CudaSlice<T>,
    ) -> Result<()> {
        let s = self.stream();
        let ptrs = [
            ptr_in(sc, &s, DType::F32),
            ptr_in(dp, &s, DType::F32),
            ptr_in(lse_delta, &s, DType::F32),
            ptr_in(ranges, &s, DType::U32),
            ptr_out(p, &s, self.dtype),
            ptr_out(ds, &s, self.dtype),
        ];
        self.run(launches::bwd_scores(blk, kb, scale), &ptrs)
    }

    fn scatter(&self, blk: &QueryBlock, acc: &CudaSlice<f32>, dst: &mut CudaSlice<T>, offset: usize) -> Result<()> {
        let s = self.stream();
        let (Ptr(p, size), dt, len) = ptr_out(dst, &s, self.dtype);
        let tail = (Ptr(p + (offset * size) as u64, size), dt, len - offset);
        self.run(launches::scatter(blk), &[ptr_in(acc, &s, DType::F32), tail])
    }

    fn cast(&self, src: &CudaSlice<f32>, len: usize, dst: &mut CudaSlice<T>, offset: usize) -> Result<()> {
        let s = self.stream();
        let (Ptr(p, size), dt, n) = ptr_out(dst, &s, self.dtype);
        let tail = (Ptr(p + (offset * size) as u64, size), dt, n - offset);
        self.run(launches::cast(len), &[ptr_in(src, &s, DType::F32), tail])
    }
}
