//! Rotary position embeddings: the inverse frequencies of a model's config (with its rope scaling) and
//! the cos and sin tables built from them on the model's device.

use candle_core::Tensor;

use crate::model::config::{ModelConfig, RopeScaling};

/// cos and sin tables, both halves of each row equal, in the model's dtype.
#[derive(Clone)]
pub(super) struct Rope {
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
}

/// cos and sin of positions `0..len` (`[len, D]`, both halves equal, in the model's dtype), built on the
/// model's device at the first forward that needs them (again only for a longer position) and gathered
/// by position id in every forward, instead of being computed on the host and copied each time. A clone
/// starts empty (it may move to another device or dtype).
#[derive(Default)]
pub(super) struct RopeTables(pub(super) std::sync::Mutex<Option<Rope>>);

impl Clone for RopeTables {
    fn clone(&self) -> Self {
        Self::default()
    }
}

pub(super) fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    let base: Vec<f64> = (0..d / 2).map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64)).collect();
    match &cfg.rope_scaling {
        RopeScaling::None => base.iter().map(|&f| f as f32).collect(),
        RopeScaling::Linear { factor } => base.iter().map(|&f| (f / factor) as f32).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let low_wavelen = original_max_position_embeddings / low_freq_factor;
            let high_wavelen = original_max_position_embeddings / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let scaled = if wavelen > low_wavelen {
                        f / factor
                    } else if wavelen < high_wavelen {
                        f
                    } else {
                        let smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    };
                    scaled as f32
                })
                .collect()
        }
    }
}
