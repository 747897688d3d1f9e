//! Helpers of the CPU implementations: the element types the kernels read and write (accumulating in
//! f32) and contiguous views of candle's CPU storage.

use candle_core::{Layout, Result};
use half::{bf16, f16};

/// Element types the kernels read and write, accumulated in f32.
pub trait Elem: Copy + Send + Sync + 'static {
    fn f32(self) -> f32;
    fn of(x: f32) -> Self;
    /// The elements as f32 where they are (f32 itself), `None` where they must be widened.
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl Elem for f32 {
    fn f32(self) -> f32 {
        self
    }
    fn of(x: f32) -> Self {
        x
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Elem for bf16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
    fn of(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Elem for f16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
    fn of(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// The elements of a contiguous layout; an error naming `what` otherwise.
pub fn contiguous<'a, T>(data: &'a [T], layout: &Layout, what: &str) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what} must be contiguous"),
    }
}

/// Wrap a result of element type `Self` as CPU storage.
pub trait IntoStorage: Sized {
    fn storage(v: Vec<Self>) -> candle_core::CpuStorage;
}

impl IntoStorage for f32 {
    fn storage(v: Vec<Self>) -> candle_core::CpuStorage {
        candle_core::CpuStorage::F32(v)
    }
}

impl IntoStorage for bf16 {
    fn storage(v: Vec<Self>) -> candle_core::CpuStorage {
        candle_core::CpuStorage::BF16(v)
    }
}

impl IntoStorage for f16 {
    fn storage(v: Vec<Self>) -> candle_core::CpuStorage {
        candle_core::CpuStorage::F16(v)
    }
}

/// Evaluate `$body` with each name bound to the contiguous elements of its float storage (f32, bf16 or
/// f16; all of one dtype), monomorphised per dtype; anything else is an error naming the inputs.
/// `with_float!((s1, l1, "x"), (s2, l2, "grad") => |x, g| cpu_bwd(x, g))`.
macro_rules! with_float {
    ($(($s:expr, $l:expr, $what:expr)),+ => |$($x:ident),+| $body:expr) => {{
        use candle_core::CpuStorage as S;
        use $crate::kernels::cpu::contiguous;
        match ($($s,)+) {
            ($(S::F32($x),)+) => { $(let $x = contiguous($x, $l, $what)?;)+ $body }
            ($(S::BF16($x),)+) => { $(let $x = contiguous($x, $l, $what)?;)+ $body }
            ($(S::F16($x),)+) => { $(let $x = contiguous($x, $l, $what)?;)+ $body }
            _ => candle_core::bail!("{} must share one float dtype (f32, bf16 or f16)", [$($what),+].join(", ")),
        }
    }};
}
pub(crate) use with_float;

/// The forward of an op recorded with its values (the patched candle's `Tensor::record_op1` /
/// `record_op3`: the values computed by other ops, the op contributing its backward), which candle never
/// runs.
pub fn recorded<T>(op: &str) -> Result<T> {
    candle_core::bail!("{op}: recorded with its values (record_op), its forward is never run")
}

/// The contiguous elements of a u32 storage (targets, ranges); an error naming `what` otherwise.
pub fn u32s<'a>(s: &'a candle_core::CpuStorage, l: &Layout, what: &str) -> Result<&'a [u32]> {
    use candle_core::backend::BackendStorage;
    match s {
        candle_core::CpuStorage::U32(v) => contiguous(v, l, what),
        _ => candle_core::bail!("{what} must be u32, got {:?}", s.dtype()),
    }
}

/// The row blocks of a sum over rows that must come out the same on every run (a weight's or a bias's
/// gradient): `(blocks, rows per block)`, at most 512 blocks, each a GPU block's f32 partial sums, added in
/// block order; the CPU sums over the same blocks, so both add in the same grouping.
pub fn row_blocks(rows: usize) -> (usize, usize) {
    let per = rows.div_ceil(512).max(1);
    (rows.div_ceil(per), per)
}
