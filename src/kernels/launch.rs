//! Launch plans: what one op runs on the GPU, as plain data. A [`Plan`] names the op's buffers (inputs in
//! the order the caller passes them, then the outputs it allocates) and its kernel launches (kernel,
//! grid, block, dynamic shared bytes, and the ordered arguments: buffers at an element offset, or
//! scalars). Each op's plan is computed by one function beside the op (e.g. `rows::stats_plan`), and
//! executed either by cudarc on a GPU (cuda.rs, `cuda` feature) or by the host emulator (emu.rs, tests):
//! the emulator tests the grid arithmetic, argument order and shared-memory formulas the GPU runs.

use candle_core::{DType, Result};

/// The kernels/*.cu file a kernel is compiled from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Module {
    Rows,
    Attention,
    FlashAttention,
    FlashMma,
    FlashWgmma,
    Rope,
    Norm,
    Embedding,
    Adamw,
    Swiglu,
    Lora,
    Accumulate,
    SumSquares,
    Bias,
    Heads,
    RowDot,
    PagedAttention,
}

/// One buffer of an op.
#[derive(Debug, Clone)]
pub struct Buffer {
    pub name: &'static str,
    pub dtype: DType,
    /// Elements.
    pub len: usize,
    /// Allocated by the executor (uninitialised; the kernels write every element) rather than passed in.
    pub output: bool,
}

impl Buffer {
    /// Elements to allocate: at least one, as CUDA refuses zero-byte allocations (an empty output is a
    /// one-element allocation no kernel touches).
    pub fn alloc_len(&self) -> usize {
        self.len.max(1)
    }
}

/// One kernel argument.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A pointer to element `offset` of buffer `index` of the plan.
    Buffer {
        index: usize,
        offset: usize,
    },
    U32(u32),
    F32(f32),
}

/// One kernel launch.
#[derive(Debug, Clone)]
pub struct Launch {
    pub module: Module,
    /// The kernel instance, e.g. `rms_norm_fwd_bf16`.
    pub kernel: String,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
    pub args: Vec<Arg>,
}

/// The buffers and launches of one op.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub buffers: Vec<Buffer>,
    pub launches: Vec<Launch>,
}

/// Shared memory a block may use without opting in (compute capability 7.0 and up).
pub const MAX_SHARED_BYTES: usize = 48 << 10;
/// Shared memory a block may opt in to on compute capability 9.0 (227 KiB).
pub const MAX_SHARED_BYTES_OPT_IN_SM90: usize = 227 << 10;

impl Module {
    /// The dynamic shared memory a launch of this module's kernels may take: kernels/flash_wgmma.cu's opt
    /// in to compute capability 9.0's maximum (the executor sets each one's attribute), the rest take no
    /// more than any block may without opting in.
    pub fn max_shared_bytes(self) -> usize {
        match self {
            Module::FlashWgmma => MAX_SHARED_BYTES_OPT_IN_SM90,
            _ => MAX_SHARED_BYTES,
        }
    }
}

/// The instance of kernel `base` for float dtype `dtype`: kernels/*.cu define each kernel once per float
/// dtype as `{base}_f32`, `{base}_bf16` and `{base}_f16`.
pub fn kernel_name(base: &str, dtype: DType) -> Result<String> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(format!("{base}_{}", dtype.as_str())),
        _ => candle_core::bail!("{base}: no kernel for {dtype:?} (f32, bf16 or f16)"),
    }
}

/// The grid of an element-wise kernel over `n` elements of `dtype` (kernels/common.cuh's `packed_loop`):
/// 256 threads a block, one 16-byte pack (8 bf16/f16, 4 f32) a thread, at most 1,024 blocks (8 blocks of
/// 256 threads fill one of an H100's 132 multiprocessors; the threads stride over the rest).
pub fn packed_grid(n: usize, dtype: DType) -> u32 {
    n.div_ceil(256 * pack_len(dtype)).min(1024) as u32
}

/// Elements of `dtype` in a 16-byte pack (kernels/common.cuh's `Pack`): 8 bf16/f16, 4 f32.
pub fn pack_len(dtype: DType) -> usize {
    16 / dtype.size_in_bytes().max(1)
}

impl Plan {
    /// Add an input buffer; returns its argument.
    pub fn input(&mut self, name: &'static str, dtype: DType, len: usize) -> Arg {
        self.buffer(name, dtype, len, false)
    }

    /// Add an output buffer; returns its argument.
    pub fn output(&mut self, name: &'static str, dtype: DType, len: usize) -> Arg {
        self.buffer(name, dtype, len, true)
    }

    fn buffer(&mut self, name: &'static str, dtype: DType, len: usize, output: bool) -> Arg {
        self.buffers.push(Buffer { name, dtype, len, output });
        Arg::Buffer { index: self.buffers.len() - 1, offset: 0 }
    }

    /// Add a launch after checking it against CUDA's limits and the plan's buffers. A launch over an
    /// empty grid (no rows, no heads) is left out: there is nothing to do, and CUDA refuses it.
    pub fn launch(&mut self, l: Launch) -> Result<()> {
        let (g, b) = (l.grid, l.block);
        if g.0 == 0 || g.1 == 0 || g.2 == 0 {
            return Ok(());
        }
        let threads = b.0 as u64 * b.1 as u64 * b.2 as u64;
        if threads == 0 || threads > 1024 || b.2 > 64 || g.0 > i32::MAX as u32 || g.1 > 65535 || g.2 > 65535 {
            candle_core::bail!("{}: grid {g:?} x block {b:?} is outside CUDA's limits", l.kernel);
        }
        let max_shared = l.module.max_shared_bytes();
        if l.shared_bytes as usize > max_shared {
            candle_core::bail!("{}: {} bytes of shared memory, at most {max_shared}", l.kernel, l.shared_bytes);
        }
        for a in &l.args {
            if let Arg::Buffer { index, offset } = *a {
                match self.buffers.get(index) {
                    Some(buf) if offset <= buf.len => {}
                    _ => candle_core::bail!("{}: argument points past the plan's buffers", l.kernel),
                }
            }
        }
        self.launches.push(l);
        Ok(())
    }

    /// The input buffers, in the order the executor takes them.
    pub fn inputs(&self) -> impl Iterator<Item = &Buffer> {
        self.buffers.iter().filter(|b| !b.output)
    }

    /// The output buffers, in the order the executor returns them.
    pub fn outputs(&self) -> impl Iterator<Item = &Buffer> {
        self.buffers.iter().filter(|b| b.output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(grid: (u32, u32, u32), block: (u32, u32, u32), shared_bytes: u32, args: Vec<Arg>) -> Launch {
        Launch { module: Module::Norm, kernel: "k_f32".into(), grid, block, shared_bytes, args }
    }

    #[test]
    fn launches_outside_cuda_limits_are_errors_and_empty_grids_are_left_out() {
        let mut p = Plan::default();
        let x = p.input("x", DType::F32, 4);
        p.launch(launch((0, 1, 1), (32, 1, 1), 0, vec![x])).unwrap();
        assert!(p.launches.is_empty());
        assert!(p.launch(launch((1, 1, 1), (2048, 1, 1), 0, vec![x])).is_err());
        assert!(p.launch(launch((1, 70_000, 1), (32, 1, 1), 0, vec![x])).is_err());
        assert!(p.launch(launch((1, 1, 1), (32, 1, 1), 49_153, vec![x])).is_err());
        let past = Arg::Buffer { index: 0, offset: 5 };
        assert!(p.launch(launch((1, 1, 1), (32, 1, 1), 0, vec![past])).is_err());
        p.launch(launch((1, 1, 1), (32, 1, 1), 0, vec![x])).unwrap();
        assert_eq!(p.launches.len(), 1);
    }

    #[test]
    fn an_empty_output_allocates_one_element() {
        let b = Buffer { name: "y", dtype: DType::F32, len: 0, output: true };
        assert_eq!(b.alloc_len(), 1);
        assert!(kernel_name("k", DType::U32).is_err());
        assert_eq!(kernel_name("k", DType::BF16).unwrap(), "k_bf16");
    }
}
