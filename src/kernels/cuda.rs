//! The GPU executor of launch plans (launch.rs): the PTX modules built from kernels/*.cu, and [`run`],
//! which checks the inputs against the plan, allocates the outputs, and launches each kernel with the
//! plan's arguments pushed in the plan's order. Everything an op decides (kernel, grid, block, shared
//! memory, arguments) is in its plan, which the tests run on the host emulator (emu.rs).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice as S, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

use super::launch::{Arg, Buffer, Launch, Module, Plan};

/// The PTX of a kernels/*.cu file, compiled by build.rs, and the name it is loaded under per device.
/// The PTX of kernels/rows.cu (build.rs compiles every file for the same target).
pub(super) fn rows_ptx() -> &'static str {
    ptx(Module::Rows).1
}

/// The PTX of kernels/flash_attention.cu (its chunked attention launches its own steps).
pub(super) fn flash_ptx() -> &'static str {
    ptx(Module::FlashAttention).1
}

fn ptx(module: Module) -> (&'static str, &'static str) {
    match module {
        Module::Rows => ("grpo_rows", include_str!(concat!(env!("OUT_DIR"), "/rows.ptx"))),
        Module::Attention => ("grpo_attention", include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"))),
        Module::FlashAttention => {
            ("grpo_flash_attention", include_str!(concat!(env!("OUT_DIR"), "/flash_attention.ptx")))
        }
        Module::FlashMma => ("grpo_flash_mma", include_str!(concat!(env!("OUT_DIR"), "/flash_mma.ptx"))),
        // Compiled for sm_90a (build.rs): loads on compute capability 9.0 only.
        Module::FlashWgmma => ("grpo_flash_wgmma", include_str!(concat!(env!("OUT_DIR"), "/flash_wgmma.ptx"))),
        Module::Rope => ("grpo_rope", include_str!(concat!(env!("OUT_DIR"), "/rope.ptx"))),
        Module::Norm => ("grpo_norm", include_str!(concat!(env!("OUT_DIR"), "/norm.ptx"))),
        Module::Embedding => ("grpo_embedding", include_str!(concat!(env!("OUT_DIR"), "/embedding.ptx"))),
        Module::Swiglu => ("grpo_swiglu", include_str!(concat!(env!("OUT_DIR"), "/swiglu.ptx"))),
        Module::Adamw => ("grpo_adamw", include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx"))),
        Module::Lora => ("grpo_lora", include_str!(concat!(env!("OUT_DIR"), "/lora.ptx"))),
        Module::Accumulate => ("grpo_accumulate", include_str!(concat!(env!("OUT_DIR"), "/accumulate.ptx"))),
        Module::SumSquares => ("grpo_sum_squares", include_str!(concat!(env!("OUT_DIR"), "/sum_squares.ptx"))),
        Module::Bias => ("grpo_bias", include_str!(concat!(env!("OUT_DIR"), "/bias.ptx"))),
        Module::Heads => ("grpo_heads", include_str!(concat!(env!("OUT_DIR"), "/heads.ptx"))),
        Module::RowDot => ("grpo_row_dot", include_str!(concat!(env!("OUT_DIR"), "/row_dot.ptx"))),
        Module::PagedAttention => {
            ("grpo_paged_attention", include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx")))
        }
    }
}

/// The compute capability (major, minor) of `dev`.
pub(crate) fn compute_capability(dev: &CudaDevice) -> Result<(i32, i32)> {
    dev.cuda_stream().context().compute_capability().w()
}

/// An error when the card's compute capability is below the PTX target of this build's kernels
/// (the driver would refuse every launch with a less clear message).
pub(super) fn check_compute_capability(dev: &CudaDevice) -> Result<()> {
    use super::capability::{capability_mismatch, ptx_target};
    let (major, minor) = compute_capability(dev)?;
    let target = ptx_target(rows_ptx()).unwrap_or(0);
    let name = dev.cuda_stream().context().name().unwrap_or_else(|_| "the GPU".into());
    match capability_mismatch(&name, (10 * major + minor) as u32, target) {
        Some(msg) => candle_core::bail!("{msg}"),
        None => Ok(()),
    }
}

/// An output buffer of a plan, allocated on the device.
enum Out {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<bf16>),
    F16(CudaSlice<f16>),
    U32(CudaSlice<u32>),
}

impl Out {
    fn alloc(dev: &CudaDevice, b: &Buffer) -> Result<Self> {
        let n = b.alloc_len();
        // SAFETY: the plan's kernels write every element of their outputs before anything reads them.
        Ok(unsafe {
            match b.dtype {
                DType::F32 => Out::F32(dev.alloc::<f32>(n)?),
                DType::BF16 => Out::BF16(dev.alloc::<bf16>(n)?),
                DType::F16 => Out::F16(dev.alloc::<f16>(n)?),
                DType::U32 => Out::U32(dev.alloc::<u32>(n)?),
                d => candle_core::bail!("{}: no device buffer of {d:?}", b.name),
            }
        })
    }

    fn ptr<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        match self {
            Out::F32(s) => s.device_ptr_mut(stream),
            Out::BF16(s) => s.device_ptr_mut(stream),
            Out::F16(s) => s.device_ptr_mut(stream),
            Out::U32(s) => s.device_ptr_mut(stream),
        }
    }

    fn storage(self, dev: &CudaDevice) -> CudaStorage {
        let dev = dev.clone();
        match self {
            Out::F32(s) => CudaStorage::wrap_cuda_slice(s, dev),
            Out::BF16(s) => CudaStorage::wrap_cuda_slice(s, dev),
            Out::F16(s) => CudaStorage::wrap_cuda_slice(s, dev),
            Out::U32(s) => CudaStorage::wrap_cuda_slice(s, dev),
        }
    }
}

/// The device address of input `buf`, after checking its dtype, contiguity and length against the plan.
fn input_ptr<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    buf: &Buffer,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    fn at<'a, T>(x: &'a CudaSlice<T>, start: usize, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        let (p, guard) = x.device_ptr(stream);
        (p + (start * std::mem::size_of::<T>()) as u64, guard)
    }
    let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("{} must be contiguous", buf.name) };
    if s.dtype() != buf.dtype || b - a != buf.len {
        candle_core::bail!(
            "{}: {:?} x {}, the kernel expects {:?} x {}",
            buf.name,
            s.dtype(),
            b - a,
            buf.dtype,
            buf.len
        );
    }
    Ok(match &s.slice {
        S::F32(x) => at(x, a, stream),
        S::BF16(x) => at(x, a, stream),
        S::F16(x) => at(x, a, stream),
        S::U32(x) => at(x, a, stream),
        _ => candle_core::bail!("{}: no kernel takes {:?}", buf.name, s.dtype()),
    })
}

/// A kernel argument's value, pushed by reference.
enum Value {
    Ptr(u64),
    U32(u32),
    F32(f32),
}

/// Launch `l` of PTX `module` with its arguments, a buffer argument's device address given by `address`
/// (buffer index, element offset).
pub(crate) fn launch(
    dev: &CudaDevice,
    l: &Launch,
    module: &str,
    ptx: &'static str,
    address: impl Fn(usize, usize) -> u64,
) -> Result<()> {
    let f = dev.get_or_load_custom_func(&l.kernel, module, ptx)?;
    if l.shared_bytes as usize > super::launch::MAX_SHARED_BYTES {
        // The kernel opts in to more dynamic shared memory than a block gets by default (its module's
        // limit, checked by the plan).
        use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as A;
        f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, l.shared_bytes as i32).w()?;
        // All of L1 as shared memory (a hint): a carveout sized for one block would leave a kernel that
        // fits two a multiprocessor at one (the warpgroup forward at head dim 64: 128 registers, 84 KiB).
        f.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100).w()?;
    }
    let values: Vec<Value> = l
        .args
        .iter()
        .map(|a| match *a {
            Arg::Buffer { index, offset } => Value::Ptr(address(index, offset)),
            Arg::U32(x) => Value::U32(x),
            Arg::F32(x) => Value::F32(x),
        })
        .collect();
    let mut b = f.builder();
    for v in &values {
        match v {
            Value::Ptr(p) => b.arg(p),
            Value::U32(x) => b.arg(x),
            Value::F32(x) => b.arg(x),
        };
    }
    let cfg = LaunchConfig { grid_dim: l.grid, block_dim: l.block, shared_mem_bytes: l.shared_bytes };
    // SAFETY: the plan's arguments match the kernel's parameters in order and type (the emulator checks
    // each plan against the kernel's signature), and every address is inside a live buffer of the caller.
    unsafe { b.launch(cfg) }.w()?;
    super::counter::count_launch();
    Ok(())
}

/// Run `plan` on the GPU of its inputs: `inputs` are the plan's input buffers in order (each checked
/// against the plan); returns its outputs in order.
pub fn run(plan: &Plan, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<CudaStorage>> {
    let Some(dev) = inputs.first().map(|(s, _)| s.device.clone()) else { candle_core::bail!("a plan without inputs") };
    if inputs.len() != plan.inputs().count() {
        candle_core::bail!("{} inputs for a plan of {}", inputs.len(), plan.inputs().count());
    }
    let stream = dev.cuda_stream();
    let mut outs: Vec<Out> = plan.outputs().map(|b| Out::alloc(&dev, b)).collect::<Result<_>>()?;
    let (mut ins, mut outs_left) = (inputs.iter(), outs.iter_mut());
    let (mut ptrs, mut guards) = (Vec::new(), Vec::new());
    for buf in &plan.buffers {
        let (p, guard) = match buf.output {
            true => outs_left.next().expect("one allocation per output").ptr(&stream),
            false => {
                let (s, l) = ins.next().expect("inputs counted");
                input_ptr(s, l, buf, &stream)?
            }
        };
        ptrs.push(p);
        guards.push(guard);
    }
    for l in &plan.launches {
        let (module, ptx) = ptx(l.module);
        launch(&dev, l, module, ptx, |index, offset| {
            ptrs[index] + (offset * plan.buffers[index].dtype.size_in_bytes()) as u64
        })?;
    }
    drop(guards);
    Ok(outs.into_iter().map(|o| o.storage(&dev)).collect())
}

/// cuBLAS's name for a GEMM operand of `dtype` (f32, bf16 or f16).
pub(crate) fn cublas_type(dtype: DType) -> Result<candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType_t> {
    use candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType_t as T;
    Ok(match dtype {
        DType::F32 => T::CUDA_R_32F,
        DType::BF16 => T::CUDA_R_16BF,
        DType::F16 => T::CUDA_R_16F,
        d => candle_core::bail!("no cuBLAS GEMM of {d:?}"),
    })
}

/// `C += A^T B` in place for row-major contiguous operands on one device: `acc` (f32, `[out, inp]`), `a`
/// (`[rows, out]`) and `b` (`[rows, inp]`) of one dtype (f32, bf16 or f16), by `cublasGemmEx` on the
/// handle candle's device holds (its stream), f32 compute. Row-major `C = A^T B` is column-major
/// `C^T = B^T A`: cuBLAS gets B untransposed first, then A transposed.
pub(crate) fn gemm_accumulate_f32(
    (acc, acc_l): (&mut CudaStorage, &Layout),
    [(a, a_l), (b, b_l)]: [(&CudaStorage, &Layout); 2],
    (out, inp, rows): (usize, usize, usize),
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys};
    let ty = cublas_type(a.dtype())?;
    let dev = acc.device.clone();
    let stream = dev.cuda_stream();
    let buffer = |name, dtype, len| Buffer { name, dtype, len, output: false };
    let (pc, _gc) = input_ptr(acc, acc_l, &buffer("wgrad accumulator", DType::F32, out * inp), &stream)?;
    let (pa, _ga) = input_ptr(a, a_l, &buffer("wgrad gradient", a.dtype(), rows * out), &stream)?;
    let (pb, _gb) = input_ptr(b, b_l, &buffer("wgrad input", a.dtype(), rows * inp), &stream)?;
    let (alpha, beta) = (1.0f32, 1.0f32);
    let blas = dev.cublas_handle();
    // SAFETY: the three buffers hold the elements the product reads and writes (checked above), on the
    // stream of candle's cuBLAS handle.
    unsafe {
        blas::gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_N,
            sys::cublasOperation_t::CUBLAS_OP_T,
            inp as i32,
            out as i32,
            rows as i32,
            (&alpha) as *const f32 as *const _,
            pb as *const _,
            ty,
            inp as i32,
            pa as *const _,
            ty,
            out as i32,
            (&beta) as *const f32 as *const _,
            pc as *mut _,
            sys::cudaDataType_t::CUDA_R_32F,
            inp as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| candle_core::Error::Msg(format!("wgrad GEMM: {e:?}")))?;
    super::counter::count_launch();
    Ok(())
}
