//! Helpers of the CUDA implementations: the PTX modules built from kernels/*.cu and contiguous views of
//! candle's CUDA storage.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use candle_core::{Layout, Result};

/// kernels/logprob.cu, as PTX.
pub const LOGPROB_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/logprob.ptx"));
/// kernels/attention.cu, as PTX.
pub const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
/// kernels/rope.cu, as PTX.
pub const ROPE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rope.ptx"));
/// kernels/norm.cu, as PTX.
pub const NORM_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/norm.ptx"));

/// The elements of a contiguous layout; an error naming `what` otherwise.
pub fn view<'a, T: DeviceRepr>(s: &'a CudaSlice<T>, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.slice(a..b)),
        None => candle_core::bail!("{what} must be contiguous"),
    }
}

/// A contiguous u32 tensor (targets, ranges); an error naming `what` for any other dtype or layout.
pub fn u32_view<'a>(s: &'a candle_core::CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, u32>> {
    match &s.slice {
        candle_core::cuda_backend::CudaStorageSlice::U32(t) => view(t, l, what),
        _ => candle_core::bail!("{what} must be u32"),
    }
}

/// Allocate `$len` elements of `$ty`, launch kernel `$name` of `$module` (PTX `$ptx`) with arguments
/// `inputs..., output, scalars...` (the order every kernel of kernels/*.cu takes), and wrap the output as
/// candle storage. Every kernel of this crate writes every element of its output.
macro_rules! launch {
    ($dev:expr, $ptx:expr, $module:expr, $name:expr, $cfg:expr, $ty:ty, $len:expr,
     [$($input:expr),*], [$($scalar:expr),*]) => {{
        // SAFETY: the kernel writes every element before anything reads it.
        let out = unsafe { $dev.alloc::<$ty>($len)? };
        if $len > 0 {
            let f = $dev.get_or_load_custom_func($name, $module, $ptx)?;
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
