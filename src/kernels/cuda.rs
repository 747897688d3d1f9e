//! Helpers of the CUDA implementations: the PTX modules built from kernels/*.cu and contiguous views of
//! candle's CUDA storage.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use candle_core::{Layout, Result};

/// kernels/logprob.cu, as PTX.
pub const LOGPROB_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/logprob.ptx"));
/// kernels/attention.cu, as PTX.
pub const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));

/// The elements of a contiguous layout; an error naming `what` otherwise.
pub fn view<'a, T: DeviceRepr>(s: &'a CudaSlice<T>, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.slice(a..b)),
        None => candle_core::bail!("{what} must be contiguous"),
    }
}
