//! Validation during training (`[validation]`): every rank generates its share of the benchmark's
//! problems with the policy; rank 0 writes the results.

use super::*;

impl Run<'_> {
    /// Validate the policy at `step`, every rank generating its share of the problems (problem i on rank
    /// i mod N, as `grpo eval` splits them): the ranks that finish first wait in short rounds
    /// ([`crate::dist::Apart`]), not in a bounded collective, however long the others take. Every rank gets
    /// the score, and its device's peak memory in the validation (None on the CPU); rank 0 writes the
    /// results.
    pub(super) fn validate(&self, step: usize, stop: &AtomicBool) -> Result<Option<(f64, Option<u64>)>, TrainError> {
        let Some(v) = &self.cfg.validation else { return Ok(None) };
        let device = self.policy.device();
        crate::device::reset_peak_memory(device)?;
        let phase = crate::profile::coarse("validation")?;
        let bench = crate::eval::benchmarks::load(&v.bench)?;
        let options = crate::eval::EvalOptions { seed: v.seed.or(Some(self.cfg.train.seed)), ..v.clone() };
        let out = self.cfg.train.output_dir.join("validation");
        let bar = crate::progress::log_only_bar(Some(0), &format!("validation on {}", v.bench));
        let started = Instant::now();
        let engine = crate::eval::engine::Native {
            model: &self.policy,
            tok: &self.tok,
            batch_size: options.batch_size,
            generation: &options.generation,
        };
        let share = crate::eval::Share { index: self.world.rank(), of: self.world.size() };
        let mut apart = crate::dist::Apart::begin(&self.world, Some(stop));
        let part = crate::eval::evaluate_share(
            &engine,
            &self.tok,
            &bench,
            &options,
            &Default::default(),
            share,
            |_| Ok(()),
            |p| {
                apart.tick();
                p.show(&bar, started)
            },
        )?;
        apart.finish();
        bar.finish_and_clear();
        phase.end();
        let peak = crate::device::memory_bytes(device)?.map(|(_, peak)| peak);
        // The KV cache's memory goes back to the device before the training step needs it.
        crate::device::release_pool(device)?;
        let parts = self.gather_validation(&part)?;
        let (report, results) = crate::eval::merge_shares(&bench, &options, parts, started.elapsed().as_secs_f64());
        if self.world.is_primary() {
            std::fs::create_dir_all(&out).map_err(io(&out))?;
            let lines: Vec<String> = results.iter().map(|r| serde_json::to_string(r).unwrap_or_default()).collect();
            let p = out.join(format!("step-{step:08}-{}.jsonl", v.bench));
            std::fs::write(&p, lines.join("\n") + "\n").map_err(io(&p))?;
            let secs = started.elapsed().as_secs_f64();
            tracing::info!(
                "validation on {} at step {step}: avg@{} = {:.4} ({secs:.1} s)",
                v.bench,
                v.n,
                report.avg_at_n
            );
        }
        Ok(Some((report.avg_at_n, peak)))
    }

    /// Every rank's share of a validation, in rank order.
    fn gather_validation(
        &self,
        part: &crate::eval::ShareResults,
    ) -> Result<Vec<crate::eval::ShareResults>, TrainError> {
        if self.world.size() == 1 {
            return Ok(vec![part.clone()]);
        }
        let bytes = serde_json::to_vec(part).map_err(|e| TrainError::Stopped(format!("validation results: {e}")))?;
        let parts = self.world.all_gather_bytes(&bytes);
        let read = |(rank, b): (usize, &Vec<u8>)| {
            serde_json::from_slice(b)
                .map_err(|e| TrainError::Stopped(format!("the validation results of rank {rank}: {e}")))
        };
        parts.iter().enumerate().map(read).collect()
    }
}
