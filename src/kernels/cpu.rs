//! Helpers of the CPU implementations: the element types the kernels read and write (accumulating in
//! f32) and contiguous views of candle's CPU storage.

use candle_core::{Layout, Result};
use half::{bf16, f16};

/// Element types the kernels read and write, accumulated in f32.
pub trait Elem: Copy + Send + Sync + 'static {
    fn f32(self) -> f32;
    fn of(x: f32) -> Self;
}

impl Elem for f32 {
    fn f32(self) -> f32 {
        self
    }
    fn of(x: f32) -> Self {
        x
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
