//! The host emulator's executor of launch plans (tests only; docs/cuda-emulator.md). build.rs compiles
//! every kernels/*.cu file for the host under kernels/emu/cuda_emu.h; [`run`] executes an op's
//! [`Plan`] on it the way cuda.rs does on a GPU: inputs copied to "device" buffers, outputs allocated
//! (refusing zero bytes, as cuMemAlloc does) and filled with NaN bytes so an element no kernel writes
//! shows, then each launch with its arguments in the plan's order, checked by the emulator against the
//! kernel's parameter types. Blocks run in a random order seeded by `GRPO_EMU_SEED` (default 1).

use std::ffi::{c_char, c_int, c_void, CString};

use candle_core::{DType, Device, Result, Tensor};
use half::{bf16, f16};

use super::launch::{Arg, Launch, Plan};

/// One kernel argument as the emulator takes it (kernels/emu/cuda_emu.h, `emu::Arg`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawArg {
    pub kind: u32,
    pub elem: u32,
    pub size: u64,
    pub value: *const c_void,
}

/// `emu::Kind`.
pub const KIND_PTR: u32 = 0;
pub const KIND_U32: u32 = 1;
pub const KIND_F32: u32 = 3;
pub const KIND_U64: u32 = 4;

extern "C" {
    fn grpo_emu_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        shared: u32,
        max_shared: u32,
        args: *const RawArg,
        n: usize,
        seed: u64,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
}

/// A buffer in the emulator's "device" memory: exactly its elements (so AddressSanitizer sees any
/// access past it).
enum Buf {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    U32(Vec<u32>),
}

/// `emu::Elem` of a dtype.
fn elem(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
        DType::U32 => 4,
        _ => 0,
    }
}

fn exact<T: Clone>(v: &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(v.len());
    out.extend_from_slice(v);
    out
}

impl Buf {
    /// `len` elements of NaN bytes; zero bytes is an error, as on a GPU.
    fn alloc(dtype: DType, len: usize) -> Result<Self> {
        if len == 0 {
            candle_core::bail!("cuMemAlloc of 0 bytes: CUDA_ERROR_INVALID_VALUE");
        }
        Ok(match dtype {
            DType::F32 => Buf::F32(vec![f32::from_bits(u32::MAX); len]),
            DType::BF16 => Buf::BF16(vec![bf16::from_bits(u16::MAX); len]),
            DType::F16 => Buf::F16(vec![f16::from_bits(u16::MAX); len]),
            DType::U32 => Buf::U32(vec![u32::MAX; len]),
            d => candle_core::bail!("no device buffer of {d:?}"),
        })
    }

    fn from_tensor(t: &Tensor) -> Result<Self> {
        let t = t.flatten_all()?;
        Ok(match t.dtype() {
            DType::F32 => Buf::F32(exact(&t.to_vec1::<f32>()?)),
            DType::BF16 => Buf::BF16(exact(&t.to_vec1::<bf16>()?)),
            DType::F16 => Buf::F16(exact(&t.to_vec1::<f16>()?)),
            DType::U32 => Buf::U32(exact(&t.to_vec1::<u32>()?)),
            d => candle_core::bail!("no kernel takes {d:?}"),
        })
    }

    fn ptr(&mut self) -> *mut u8 {
        match self {
            Buf::F32(v) => v.as_mut_ptr() as *mut u8,
            Buf::BF16(v) => v.as_mut_ptr() as *mut u8,
            Buf::F16(v) => v.as_mut_ptr() as *mut u8,
            Buf::U32(v) => v.as_mut_ptr() as *mut u8,
        }
    }

    fn tensor(self, len: usize) -> Result<Tensor> {
        fn t<T: candle_core::WithDType>(mut v: Vec<T>, len: usize) -> Result<Tensor> {
            v.truncate(len);
            Tensor::from_vec(v, len, &Device::Cpu)
        }
        match self {
            Buf::F32(v) => t(v, len),
            Buf::BF16(v) => t(v, len),
            Buf::F16(v) => t(v, len),
            Buf::U32(v) => t(v, len),
        }
    }
}

/// The seed of the blocks' order: `GRPO_EMU_SEED`, or 1.
pub fn seed() -> u64 {
    std::env::var("GRPO_EMU_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1)
}

/// Run `plan` on the emulator: `inputs` are its input buffers in order (CPU tensors, checked against the
/// plan); returns its outputs in order, each flat.
pub fn run(plan: &Plan, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    run_with(plan, inputs, |_, args| args)
}

/// [`run`] with every buffer one element longer and every buffer argument one element in (its first
/// element unread and unwritten), so that no pointer is 16-byte aligned: the packed element-wise kernels'
/// one-element path. `inputs` as for [`run`]; the outputs without their first element.
pub fn run_shifted(plan: &Plan, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let mut plan = plan.clone();
    for b in &mut plan.buffers {
        b.len += 1;
    }
    for a in plan.launches.iter_mut().flat_map(|l| l.args.iter_mut()) {
        if let Arg::Buffer { offset, .. } = a {
            *offset += 1;
        }
    }
    let padded = inputs
        .iter()
        .map(|t| {
            let t = t.flatten_all()?;
            Tensor::cat(&[&t.narrow(0, 0, 1)?, &t], 0)
        })
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&Tensor> = padded.iter().collect();
    run(&plan, &refs)?.into_iter().map(|o| o.narrow(0, 1, o.elem_count() - 1)).collect()
}

/// [`run`] for kernels that also update their inputs in place: every buffer of the plan after the
/// launches (inputs and outputs, in the plan's order).
pub fn run_in_place(plan: &Plan, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let bufs = execute(plan, inputs, |_, args| args)?;
    plan.buffers.iter().zip(bufs).map(|(b, buf)| buf.tensor(b.len)).collect()
}

/// [`run`], with the arguments of launch `i` passed through `edit` first (to test the emulator's checks).
pub fn run_with(
    plan: &Plan,
    inputs: &[&Tensor],
    edit: impl Fn(usize, Vec<RawArg>) -> Vec<RawArg>,
) -> Result<Vec<Tensor>> {
    let bufs = execute(plan, inputs, edit)?;
    let outs = plan.buffers.iter().zip(bufs).filter(|(b, _)| b.output);
    outs.map(|(b, buf)| buf.tensor(b.len)).collect()
}

/// The buffers of `plan` after its launches on `inputs`.
fn execute(plan: &Plan, inputs: &[&Tensor], edit: impl Fn(usize, Vec<RawArg>) -> Vec<RawArg>) -> Result<Vec<Buf>> {
    if inputs.len() != plan.inputs().count() {
        candle_core::bail!("{} inputs for a plan of {}", inputs.len(), plan.inputs().count());
    }
    let mut ins = inputs.iter();
    let mut bufs = Vec::with_capacity(plan.buffers.len());
    for b in &plan.buffers {
        bufs.push(if b.output {
            Buf::alloc(b.dtype, b.alloc_len())?
        } else {
            let t = ins.next().expect("inputs counted");
            if t.dtype() != b.dtype || t.elem_count() != b.len {
                candle_core::bail!(
                    "{}: {:?} x {}, the kernel expects {:?} x {}",
                    b.name,
                    t.dtype(),
                    t.elem_count(),
                    b.dtype,
                    b.len
                );
            }
            Buf::from_tensor(t)?
        });
    }
    let bases: Vec<*mut u8> = bufs.iter_mut().map(Buf::ptr).collect();
    // The packed kernels take their 16-byte path only on aligned pointers: the tests' aligned cases must be
    // (malloc's alignment; `run_shifted` makes the unaligned ones). An empty buffer is never accessed.
    for (b, p) in plan.buffers.iter().zip(&bases).filter(|(b, _)| b.len > 0) {
        assert!(
            (*p as usize).is_multiple_of(16),
            "emulator buffer {} ({:?} x {}) at {p:p}: not 16-byte aligned",
            b.name,
            b.dtype,
            b.len
        );
    }
    for (i, l) in plan.launches.iter().enumerate() {
        // Values the arguments point at: buffer addresses and scalars, 8 bytes each.
        let values: Vec<u64> = l
            .args
            .iter()
            .map(|a| match *a {
                Arg::Buffer { index, offset } => {
                    bases[index].wrapping_add(offset * plan.buffers[index].dtype.size_in_bytes()) as u64
                }
                Arg::U32(x) => x as u64,
                Arg::F32(x) => x.to_bits() as u64,
            })
            .collect();
        let args = l
            .args
            .iter()
            .zip(&values)
            .map(|(a, v)| {
                let value = v as *const u64 as *const c_void;
                match *a {
                    Arg::Buffer { index, .. } => {
                        RawArg { kind: KIND_PTR, elem: elem(plan.buffers[index].dtype), size: 8, value }
                    }
                    Arg::U32(_) => RawArg { kind: KIND_U32, elem: 0, size: 4, value },
                    Arg::F32(_) => RawArg { kind: KIND_F32, elem: 0, size: 4, value },
                }
            })
            .collect();
        launch(l, &edit(i, args), seed() ^ i as u64)?;
    }
    Ok(bufs)
}

/// One launch on the emulator (values of 4 bytes are read from the start of their 8-byte slot:
/// little-endian).
fn launch(l: &Launch, args: &[RawArg], seed: u64) -> Result<()> {
    let name = CString::new(l.kernel.as_str()).expect("kernel names have no NUL");
    let (grid, block) = ([l.grid.0, l.grid.1, l.grid.2], [l.block.0, l.block.1, l.block.2]);
    let mut err = vec![0u8; 512];
    // SAFETY: every pointer argument addresses a live buffer of the plan and every value pointer a live
    // 8-byte slot; the emulator checks each argument against the kernel's parameter before the call.
    let rc = unsafe {
        grpo_emu_launch(
            name.as_ptr(),
            grid.as_ptr(),
            block.as_ptr(),
            l.shared_bytes,
            l.module.max_shared_bytes() as u32,
            args.as_ptr(),
            args.len(),
            seed,
            err.as_mut_ptr() as *mut c_char,
            err.len(),
        )
    };
    if rc != 0 {
        let end = err.iter().position(|&c| c == 0).unwrap_or(err.len());
        candle_core::bail!("emulated launch ({:?} kernels): {}", l.module, String::from_utf8_lossy(&err[..end]));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
