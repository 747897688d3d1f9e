//! The native engine: grpo's own generation ([`crate::generate`]) on the model's weights: continuous
//! batching over the paged KV cache by default, or static batches of whole problems (`--schedule static`).

use super::{Completion, Engine, Progress, PromptJob};
use crate::eval::EvalError;
use crate::generate::{
    generate, generate_paged, GenerateError, Generation, GenerationOptions, Request, SamplingParams, Schedule,
};
use crate::model::{ChatTokenizer, Decoder};

/// grpo's generation on a loaded model; `batch_size` sequences at a time (with the static schedule, whole
/// problems are kept in one batch).
pub struct Native<'a> {
    pub model: &'a Decoder,
    pub tok: &'a ChatTokenizer,
    pub batch_size: usize,
    pub generation: &'a GenerationOptions,
}

impl From<GenerateError> for EvalError {
    fn from(e: GenerateError) -> Self {
        match e {
            GenerateError::Candle(e) => EvalError::Candle(e),
            GenerateError::Options(m) => EvalError::Engine(m),
        }
    }
}

impl Native<'_> {
    fn completions(&self, gens: Vec<Generation>) -> Result<Vec<Completion>, EvalError> {
        gens.into_iter()
            .map(|g| {
                let text = self.tok.decode(&g.tokens, true)?;
                Ok(Completion { text, tokens: g.tokens.len(), finish: g.finish, logprobs: None })
            })
            .collect()
    }

    /// Static batches of whole problems, each run until its longest answer ends.
    fn complete_static(
        &self,
        jobs: &[PromptJob],
        n: usize,
        sampling: &SamplingParams,
        progress: &mut dyn Progress,
    ) -> Result<(), EvalError> {
        let per_batch = (self.batch_size / n).max(1);
        for (c, chunk) in jobs.chunks(per_batch).enumerate() {
            let mut prompts = Vec::with_capacity(chunk.len() * n);
            let mut seqs = Vec::with_capacity(chunk.len() * n);
            for job in chunk {
                for s in 0..n as u64 {
                    prompts.push(job.ids.clone());
                    seqs.push(job.first_sequence + s);
                }
            }
            let gens = generate(self.model, &prompts, &seqs, sampling, self.tok.eos_ids(), self.tok.pad_id(), |k| {
                progress.tokens(k)
            })?;
            let mut gens = gens.into_iter();
            for j in 0..chunk.len() {
                let samples = self.completions(gens.by_ref().take(n).collect())?;
                progress.done(c * per_batch + j, samples)?;
            }
        }
        Ok(())
    }

    /// Continuous batching over the paged KV cache; problems that can never fit are reported together.
    fn complete_paged(
        &self,
        jobs: &[PromptJob],
        n: usize,
        sampling: &SamplingParams,
        progress: &mut dyn Progress,
    ) -> Result<(), EvalError> {
        let requests: Vec<Request> = jobs.iter().map(|j| Request::new(j.ids.clone(), j.first_sequence, n)).collect();
        let mut skipped = Vec::new();
        let tokens = std::cell::RefCell::new(&mut *progress);
        let stop = (self.tok.eos_ids(), self.batch_size);
        let report = generate_paged(
            self.model,
            &requests,
            sampling,
            stop,
            self.generation,
            |k| tokens.borrow_mut().tokens(k),
            |r, result| match result {
                Ok(gens) => tokens.borrow_mut().done(r, self.completions(gens)?),
                Err(why) => {
                    skipped.push(format!("{}: {why}", jobs[r].id));
                    Ok(())
                }
            },
        )?;
        tracing::info!(
            "generation: {} steps, {:.0}% of {} seats busy, prefill {} tokens computed and {} shared, {} \
             preempted, KV pool {} of {} blocks at most ({:.2} positions held per cached)",
            report.steps,
            100.0 * report.occupancy,
            self.batch_size,
            report.counts.prefill_computed,
            report.counts.prefill_saved,
            report.counts.preemptions,
            report.peak_blocks,
            report.pool_blocks,
            report.kv_held_per_cached
        );
        if skipped.is_empty() {
            return Ok(());
        }
        Err(EvalError::Requests { failed: skipped.len(), unsent: 0, details: skipped.join("\n") })
    }
}

impl Engine for Native<'_> {
    fn complete(
        &self,
        jobs: &[PromptJob],
        n: usize,
        sampling: &SamplingParams,
        progress: &mut dyn Progress,
    ) -> Result<(), EvalError> {
        let n = n.max(1);
        match self.generation.schedule {
            Schedule::Static => self.complete_static(jobs, n, sampling, progress),
            Schedule::Continuous => self.complete_paged(jobs, n, sampling, progress),
        }
    }

    fn describe(&self) -> String {
        match self.generation.schedule {
            Schedule::Static => "native (static batches)".into(),
            Schedule::Continuous => "native".into(),
        }
    }
}
