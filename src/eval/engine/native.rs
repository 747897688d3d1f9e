//! The native engine: grpo's batched sampler ([`crate::eval::generate`]) on the model's weights.

use super::{Completion, Engine, Progress, PromptJob};
use crate::eval::generate::{generate, SamplingParams};
use crate::eval::EvalError;
use crate::model::{ChatTokenizer, Decoder};

/// grpo's sampler on a loaded model; `batch_size` sequences are generated together (whole problems are
/// kept in one batch).
pub struct Native<'a> {
    pub model: &'a Decoder,
    pub tok: &'a ChatTokenizer,
    pub batch_size: usize,
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
            for (j, mine) in gens.chunks(n).enumerate() {
                let samples = mine
                    .iter()
                    .map(|g| {
                        let text = self.tok.decode(&g.tokens, true)?;
                        Ok(Completion { text, tokens: g.tokens.len(), finish: g.finish, logprobs: None })
                    })
                    .collect::<Result<Vec<_>, EvalError>>()?;
                progress.done(c * per_batch + j, samples)?;
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        "native".into()
    }
}
