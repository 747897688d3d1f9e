//! The geometry of the offloaded optimiser update's host staging (`optim.offload`, implemented by
//! `train::offload`): how many parameters a chunk holds and what its two staging slots take. The memory
//! plan and the performance model size the staging with the same functions the update runs with.

/// The f32 gradients of a chunk by default (`optim.offload_chunk_mb`), MiB: 64 Mi parameters, so 1 GiB of
/// staging (page-locked on a GPU) with both slots' gradients and weights.
pub const DEFAULT_CHUNK_MB: usize = 256;

/// The parameters of a chunk of `mb` MiB of f32 gradients.
pub const fn chunk_elements(mb: usize) -> usize {
    (mb << 20) / 4
}

/// The parameters of a chunk when `total` are updated in chunks of at most `mb` MiB of gradients: at
/// least four chunks where each still holds 1 Mi parameters or more, so that a model smaller than a
/// few chunks still has copies to overlap with its update.
pub fn chunk_len(total: usize, mb: usize) -> usize {
    const SMALLEST: usize = 1 << 20;
    total.min(chunk_elements(mb)).min(total.div_ceil(4).max(SMALLEST))
}

/// The staging's host memory for chunks of `elements` parameters: two slots of f32 gradients and as many
/// four-byte words of weights.
pub const fn staging_bytes(elements: usize) -> usize {
    2 * elements * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_models_are_cut_into_four_chunks_of_at_least_a_mebi_parameters() {
        let mi = 1 << 20;
        assert_eq!(chunk_len(1000, 256), 1000);
        assert_eq!(chunk_len(3 * mi, 256), mi);
        assert_eq!(chunk_len(40 * mi, 256), 10 * mi);
        assert_eq!(chunk_len(7_600 * mi, 256), chunk_elements(256));
        assert_eq!(chunk_len(40 * mi, 4), mi);
        assert_eq!(chunk_len(0, 256), 0);
    }
}
