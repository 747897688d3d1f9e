//! Helpers of the CUDA implementations: the PTX modules built from kernels/*.cu, contiguous views of
//! candle's CUDA storage, and the float-dtype dispatch.
//!
//! Each op's launch is written once, generic over the element type, as an implementation of [`Map1`],
//! [`Map2`] or [`Map3`] (as candle's own cuda_backend/utils.rs does); `map` picks the dtype (f32, bf16
//! or f16, all inputs alike) and [`kernel_name`] the kernel instance of that dtype.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorageSlice as S};
use candle_core::{CudaStorage, Layout, Result, WithDType};

/// A PTX module compiled from one kernels/*.cu file by build.rs, loaded once per device under `name`.
pub struct Module {
    pub name: &'static str,
    pub ptx: &'static str,
}

/// kernels/rows.cu.
pub const ROWS: Module = Module { name: "grpo_rows", ptx: include_str!(concat!(env!("OUT_DIR"), "/rows.ptx")) };
/// kernels/attention.cu.
pub const ATTENTION: Module =
    Module { name: "grpo_attention", ptx: include_str!(concat!(env!("OUT_DIR"), "/attention.ptx")) };
/// kernels/flash_attention.cu.
pub const FLASH_ATTENTION: Module =
    Module { name: "grpo_flash_attention", ptx: include_str!(concat!(env!("OUT_DIR"), "/flash_attention.ptx")) };
/// kernels/rope.cu.
pub const ROPE: Module = Module { name: "grpo_rope", ptx: include_str!(concat!(env!("OUT_DIR"), "/rope.ptx")) };
/// kernels/norm.cu.
pub const NORM: Module = Module { name: "grpo_norm", ptx: include_str!(concat!(env!("OUT_DIR"), "/norm.ptx")) };

/// An element type the kernels read and write.
pub trait Float: WithDType + DeviceRepr + CudaDType {}
impl<T: WithDType + DeviceRepr + CudaDType> Float for T {}

/// The instance of kernel `base` for element type `T`: kernels/*.cu define each kernel once per float
/// dtype as `{base}_f32`, `{base}_bf16` and `{base}_f16`.
pub fn kernel_name<T: WithDType>(base: &str) -> String {
    format!("{base}_{}", T::DTYPE.as_str())
}

/// The elements of a contiguous layout; an error naming `what` otherwise.
pub fn view<'a, T: DeviceRepr>(s: &'a CudaSlice<T>, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.slice(a..b)),
        None => candle_core::bail!("{what} must be contiguous"),
    }
}

/// A contiguous u32 tensor (targets, ranges); an error naming `what` for any other dtype or layout.
pub fn u32_view<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, u32>> {
    match &s.slice {
        S::U32(t) => view(t, l, what),
        _ => candle_core::bail!("{what} must be u32"),
    }
}

/// A contiguous f32 tensor (coefficients); an error naming `what` for any other dtype or layout.
pub fn f32_view<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, f32>> {
    match &s.slice {
        S::F32(t) => view(t, l, what),
        _ => candle_core::bail!("{what} must be f32"),
    }
}

/// One input of an op: its storage, layout and name (for error messages).
pub type Arg<'a> = (&'a CudaStorage, &'a Layout, &'a str);

fn dtype_error(names: &[&str]) -> candle_core::Error {
    candle_core::Error::Msg(format!("{} must share one float dtype (f32, bf16 or f16)", names.join(", ")))
}

/// An op on one float tensor, launched by `f` for any element type.
pub trait Map1 {
    fn f<T: Float>(&self, x: &CudaView<'_, T>, dev: &CudaDevice) -> Result<CudaStorage>;

    fn map(&self, (s, l, what): Arg) -> Result<CudaStorage> {
        match &s.slice {
            S::F32(x) => self.f(&view(x, l, what)?, &s.device),
            S::BF16(x) => self.f(&view(x, l, what)?, &s.device),
            S::F16(x) => self.f(&view(x, l, what)?, &s.device),
            _ => Err(dtype_error(&[what])),
        }
    }
}

/// An op on two float tensors of one dtype, launched by `f` for any element type.
pub trait Map2 {
    fn f<T: Float>(&self, x: &CudaView<'_, T>, y: &CudaView<'_, T>, dev: &CudaDevice) -> Result<CudaStorage>;

    fn map(&self, (s1, l1, w1): Arg, (s2, l2, w2): Arg) -> Result<CudaStorage> {
        let d = &s1.device;
        match (&s1.slice, &s2.slice) {
            (S::F32(x), S::F32(y)) => self.f(&view(x, l1, w1)?, &view(y, l2, w2)?, d),
            (S::BF16(x), S::BF16(y)) => self.f(&view(x, l1, w1)?, &view(y, l2, w2)?, d),
            (S::F16(x), S::F16(y)) => self.f(&view(x, l1, w1)?, &view(y, l2, w2)?, d),
            _ => Err(dtype_error(&[w1, w2])),
        }
    }
}

/// An op on three float tensors of one dtype, launched by `f` for any element type.
pub trait Map3 {
    fn f<T: Float>(
        &self,
        x: &CudaView<'_, T>,
        y: &CudaView<'_, T>,
        z: &CudaView<'_, T>,
        dev: &CudaDevice,
    ) -> Result<CudaStorage>;

    fn map(&self, (s1, l1, w1): Arg, (s2, l2, w2): Arg, (s3, l3, w3): Arg) -> Result<CudaStorage> {
        let d = &s1.device;
        match (&s1.slice, &s2.slice, &s3.slice) {
            (S::F32(x), S::F32(y), S::F32(z)) => self.f(&view(x, l1, w1)?, &view(y, l2, w2)?, &view(z, l3, w3)?, d),
            (S::BF16(x), S::BF16(y), S::BF16(z)) => self.f(&view(x, l1, w1)?, &view(y, l2, w2)?, &view(z, l3, w3)?, d),
            (S::F16(x), S::F16(y), S::F16(z)) => self.f(&view(x, l1, w1)?, &view(y, l2, w2)?, &view(z, l3, w3)?, d),
            _ => Err(dtype_error(&[w1, w2, w3])),
        }
    }
}

/// Allocate `$len` elements of `$ty`, launch kernel `$name` of `$module` (a [`Module`]) with arguments
/// `inputs..., output, scalars...` (the order every kernel of kernels/*.cu takes), and wrap the output as
/// candle storage. Every kernel of this crate writes every element of its output.
macro_rules! launch {
    ($dev:expr, $module:expr, $name:expr, $cfg:expr, $ty:ty, $len:expr,
     [$($input:expr),*], [$($scalar:expr),*]) => {{
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        use candle_core::cuda_backend::WrapErr;
        // SAFETY: the kernel writes every element before anything reads it.
        let out = unsafe { $dev.alloc::<$ty>($len)? };
        if $len > 0 {
            let f = $dev.get_or_load_custom_func(&$name, $module.name, $module.ptx)?;
            let mut b = f.builder();
            $(b.arg($input);)*
            b.arg(&out);
            $(b.arg($scalar);)*
            // SAFETY: the argument types and order match the kernel's signature.
            unsafe { b.launch($cfg) }.w()?;
        }
        candle_core::CudaStorage::wrap_cuda_slice(out, $dev.clone())
    }};
}
pub(crate) use launch;
