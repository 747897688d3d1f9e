//! How to split a job's GPUs between generation and training for rollouts (`rollout.generation_ranks`):
//! for each number G of generation ranks of W, the predicted time of one step's generation on G GPUs (the
//! paged engine's decode steps, [`super::decode`], in waves of `batch_size` at the mean context, every
//! answer as long as allowed, plus the prefill and behaviour forward as GEMMs), of its training on the
//! other W - G ([`super::time::predict`] with ZeRO-1's communication), of the weights' transfer over
//! NVLink, and the step at rollout.max_staleness = 0 (the sum) and at k >= 1 (the longer side).

use super::calibration::Gpu;
use super::decode::{predict_decode, DecodeShape};
use super::time::{gemm_flops_per_s, predict, zero1_comms, StepShape, COLLECTIVE_EFFICIENCY};
use crate::model::ModelConfig;

/// What each step generates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rollouts {
    /// Sampled answers per step (questions x sampled answers per question).
    pub answers: u64,
    pub prompt_tokens: u64,
    pub max_new_tokens: u64,
    /// Sequences a generation rank decodes together.
    pub batch_size: u64,
    pub dtype_bytes: f64,
}

/// One split of the job's GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    pub generators: u64,
    pub trainers: u64,
    pub generation_s: f64,
    pub training_s: f64,
    pub sync_s: f64,
}

impl Split {
    /// The step when each side waits for the other (max_staleness = 0).
    pub fn in_turn_s(&self) -> f64 {
        self.generation_s + self.training_s + self.sync_s
    }

    /// The step when generation overlaps training (max_staleness >= 1): the longer side.
    pub fn overlapped_s(&self) -> f64 {
        self.generation_s.max(self.training_s + self.sync_s)
    }
}

/// Seconds for `r`'s answers on `g` generation GPUs.
fn generation_s(m: &ModelConfig, r: &Rollouts, g: u64, gpu: &Gpu) -> f64 {
    let mine = r.answers.div_ceil(g.max(1));
    let batch = r.batch_size.clamp(1, mine.max(1));
    let waves = mine.div_ceil(batch) as f64;
    let context = r.prompt_tokens as f64 + r.max_new_tokens as f64 / 2.0;
    let shape = DecodeShape { sequences: batch as f64, context, dtype_bytes: r.dtype_bytes };
    let decode = waves * r.max_new_tokens as f64 * predict_decode(m, shape, gpu).step_s;
    // The prefill of each prompt and the behaviour forward of each answer, as GEMMs of 2 FLOPs a parameter.
    let tokens = mine as f64 * (2.0 * r.prompt_tokens as f64 + r.max_new_tokens as f64);
    let forward = 2.0 * m.num_parameters() as f64 * tokens / gemm_flops_per_s(4096.0, m.hidden_size as f64, gpu);
    decode + forward
}

/// Every split of `world` GPUs with at least one generation and one training rank: the trainers' step
/// shape on `t` trainers from `train_shape(t)`.
pub fn predict_splits(
    m: &ModelConfig,
    r: &Rollouts,
    world: u64,
    train_shape: impl Fn(u64) -> StepShape,
    gpu: &Gpu,
) -> Vec<Split> {
    let params = m.num_parameters() as u64;
    let weights = params as f64 * r.dtype_bytes;
    (1..world)
        .map(|g| {
            let t = world - g;
            let train = predict(m, &train_shape(t), gpu).step_s + zero1_comms(params, t, t, gpu).seconds();
            Split {
                generators: g,
                trainers: t,
                generation_s: generation_s(m, r, g, gpu),
                training_s: train,
                sync_s: g as f64 * weights / (gpu.nvlink_bandwidth * COLLECTIVE_EFFICIENCY),
            }
        })
        .collect()
}

/// The lines `--plan` prints for `splits` on `gpu`: a row per split, the fastest overlapped one marked.
pub fn report(splits: &[Split], gpu: &Gpu) -> String {
    let Some(best) = splits.iter().min_by(|a, b| a.overlapped_s().total_cmp(&b.overlapped_s())) else {
        return String::new();
    };
    let mut out = format!(
        "generation ranks on {} GPUs ({}; rollout.generation_ranks, every answer max_new_tokens long):\n",
        splits.len() + 1,
        gpu.name
    );
    out.push_str("  generate train  generation s  training s  weights s  step k=0 s  step k>=1 s\n");
    for s in splits {
        out.push_str(&format!(
            "  {:>8} {:>5}  {:>12.1}  {:>10.1}  {:>9.2}  {:>10.1}  {:>11.1}{}\n",
            s.generators,
            s.trainers,
            s.generation_s,
            s.training_s,
            s.sync_s,
            s.in_turn_s(),
            s.overlapped_s(),
            if s == best { "  <- fastest" } else { "" }
        ));
    }
    out.push_str(&format!(
        "  fastest: rollout.generation_ranks = {} with max_staleness >= 1, {:.1} s a step ({:.2}x the same split at \
         k = 0)\n",
        best.generators,
        best.overlapped_s(),
        best.in_turn_s() / best.overlapped_s()
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::calibration::h100;

    fn split(generation_s: f64, training_s: f64, sync_s: f64) -> Split {
        Split { generators: 1, trainers: 1, generation_s, training_s, sync_s }
    }

    #[test]
    fn a_step_in_turn_is_the_sum_and_overlapped_the_longer_side() {
        let s = split(10.0, 4.0, 1.0);
        assert_eq!((s.in_turn_s(), s.overlapped_s()), (15.0, 10.0));
        assert_eq!(split(2.0, 4.0, 1.0).overlapped_s(), 5.0);
    }

    /// More generation ranks take less time each: the share of answers shrinks, in whole waves.
    #[test]
    fn generation_shrinks_with_more_generation_ranks() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let m = ModelConfig::from_file(&root.join("scripts/gpu/shapes/qwen2.5-0.5b.json")).unwrap();
        let r = Rollouts { answers: 256, prompt_tokens: 512, max_new_tokens: 1024, batch_size: 32, dtype_bytes: 2.0 };
        let times: Vec<f64> = [1, 2, 4, 8].iter().map(|&g| generation_s(&m, &r, g, h100())).collect();
        assert!(times.windows(2).all(|w| w[1] < w[0]), "{times:?}");
        // 8 waves on one GPU, 1 on eight: the decode part scales by 8.
        let one = DecodeShape { sequences: 32.0, context: 1024.0, dtype_bytes: 2.0 };
        let decode = 1024.0 * predict_decode(&m, one, h100()).step_s;
        assert!(times[0] > 8.0 * decode && times[3] > decode && times[3] < 2.0 * decode, "{times:?} {decode}");
    }

    #[test]
    fn the_report_marks_the_fastest_split() {
        let splits = vec![
            Split { generators: 1, trainers: 3, generation_s: 30.0, training_s: 5.0, sync_s: 0.1 },
            Split { generators: 2, trainers: 2, generation_s: 15.0, training_s: 8.0, sync_s: 0.2 },
            Split { generators: 3, trainers: 1, generation_s: 10.0, training_s: 16.0, sync_s: 0.3 },
        ];
        let text = report(&splits, h100());
        let marked: Vec<&str> = text.lines().filter(|l| l.ends_with("<- fastest")).collect();
        assert_eq!(marked.len(), 1);
        assert!(marked[0].trim_start().starts_with("2     2"), "{text}");
        assert!(text.contains("rollout.generation_ranks = 2"), "{text}");
    }
}
