//! The paged engine: requests (a prompt and its number of samples) run to the end under the
//! continuous-batching [`Scheduler`], each step one forward of the decoder over the paged KV cache
//! ([`crate::model::PagedKv`]) and one pick of the next tokens, read from the device in one transfer.
//! Every sequence draws from its own stream ([`sequence_rng`]), one uniform per token, so its tokens do
//! not depend on the step it runs in, on its neighbours or on preemption.

use rand_chacha::ChaCha8Rng;

use super::blocks::BlockPool;
use super::options::GenerationOptions;
use super::sampling::{pick, sequence_rng, FinishReason, Generation, SamplingParams};
use super::scheduler::{Entry, Scheduler, SeqId, Step};
use crate::kernels::PagedLayout;
use crate::model::{Decoder, PagedBatch, PagedKv};

/// Errors of generation.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("{0}")]
    Options(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// A prompt and how many samples to draw from it; sample `j` draws from the stream `first_id + j`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub first_id: u64,
    pub samples: usize,
    /// Each sample's limit on new tokens, below the sampling parameters' `max_new_tokens` (as a server's
    /// per-request `max_tokens`); empty: that limit for every sample.
    pub max_new_tokens: Vec<usize>,
}

impl Request {
    /// `samples` samples of `prompt`, sample `j` from stream `first_id + j`, each up to the sampling
    /// parameters' `max_new_tokens`.
    pub fn new(prompt: Vec<u32>, first_id: u64, samples: usize) -> Self {
        Request { prompt, first_id, samples, max_new_tokens: Vec::new() }
    }

    /// Sample `j`'s limit on new tokens under `params`.
    fn limit(&self, j: usize, params: &SamplingParams) -> usize {
        self.max_new_tokens.get(j).map_or(params.max_new_tokens, |&m| m.min(params.max_new_tokens))
    }

    /// The longest sequence (prompt and answer) a sample may reach under `params`.
    fn longest(&self, params: &SamplingParams) -> usize {
        self.prompt.len() + (0..self.samples).map(|j| self.limit(j, params)).max().unwrap_or(0)
    }
}

/// What a run did, for logs and `grpo bench generate`.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    pub steps: usize,
    /// Tokens generated (stop tokens not counted).
    pub generated: usize,
    /// Mean sequences per step over the seats.
    pub occupancy: f64,
    pub pool_blocks: usize,
    pub block_size: usize,
    pub peak_blocks: usize,
    /// Positions of the blocks in use per position they cache, over all steps (1: no block partly empty).
    pub kv_held_per_cached: f64,
    #[serde(flatten)]
    pub counts: super::scheduler::Counts,
    /// Requests skipped because they can never fit.
    pub skipped: usize,
}

/// One sequence's place: its request, and what it has produced.
struct Slot {
    request: usize,
    sample: usize,
    /// New tokens this sample may produce.
    max_new: usize,
    rng: ChaCha8Rng,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    done: Option<FinishReason>,
}

/// The run's state: scheduler, pool storage and the sequences' places by id.
struct Run<'a> {
    model: &'a Decoder,
    params: &'a SamplingParams,
    stop: &'a [u32],
    sched: Scheduler,
    kv: PagedKv,
    slots: Vec<Slot>,
    /// Per request, its generations as they finish, and how many are left.
    results: Vec<(Vec<Option<Generation>>, usize)>,
    report: Report,
    seats: usize,
    /// Over the steps: positions of the blocks in use, and positions cached in them.
    held: usize,
    cached: usize,
}

/// Generate `params.max_new_tokens` tokens at most for every sample of every request, `seats` sequences
/// at a time, calling `on_tokens(n)` after each step and `on_done(request, result)` as each request's
/// samples are all done (in the order they finish). A request that can never fit (longer than the pool) is reported to `on_done` as an error and skipped.
pub fn generate_paged<E: From<GenerateError>>(
    model: &Decoder,
    requests: &[Request],
    params: &SamplingParams,
    (stop, seats): (&[u32], usize),
    opts: &GenerationOptions,
    mut on_tokens: impl FnMut(usize),
    mut on_done: impl FnMut(usize, Result<Vec<Generation>, String>) -> Result<(), E>,
) -> Result<Report, E> {
    opts.validate("generation.").map_err(GenerateError::Options)?;
    if seats == 0 {
        return Err(GenerateError::Options("batch_size = 0: at least one sequence at a time".into()).into());
    }
    if params.max_new_tokens == 0 {
        for (r, req) in requests.iter().enumerate() {
            let empty = Generation { tokens: vec![], finish: FinishReason::Length, logprobs: vec![] };
            on_done(r, Ok(vec![empty; req.samples]))?;
        }
        return Ok(Report::default());
    }
    let mut run = Run::new(model, requests, params, stop, seats, opts)?;
    for (r, why) in run.add(requests) {
        run.report.skipped += 1;
        on_done(r, Err(why))?;
    }
    let mut occupied = 0usize;
    while !run.sched.is_idle() {
        let step = run.sched.schedule();
        if step.entries.is_empty() {
            if step.preempted.is_empty() {
                return Err(GenerateError::Options("the KV pool cannot hold any waiting sequence".into()).into());
            }
            continue;
        }
        occupied += run.sched.running();
        let (new, finished) = run.step(&step)?;
        on_tokens(new);
        for r in finished {
            let gens = std::mem::take(&mut run.results[r].0);
            on_done(r, Ok(gens.into_iter().map(|g| g.expect("every sample is done")).collect()))?;
        }
    }
    run.report.counts = run.sched.counts;
    run.report.kv_held_per_cached = run.held as f64 / run.cached.max(1) as f64;
    run.report.occupancy = occupied as f64 / (run.report.steps.max(1) * run.seats) as f64;
    Ok(run.report)
}

impl<'a> Run<'a> {
    fn new(
        model: &'a Decoder,
        requests: &[Request],
        params: &'a SamplingParams,
        stop: &'a [u32],
        seats: usize,
        opts: &GenerationOptions,
    ) -> Result<Self, GenerateError> {
        let context = model.config().max_position_embeddings;
        let longest = requests.iter().map(|r| r.longest(params)).max().unwrap_or(0).min(context);
        let samples = requests.iter().map(|r| r.samples).sum::<usize>();
        let blocks = opts.pool_blocks(seats.min(samples.max(1)), longest);
        let kv = PagedKv::new(model, blocks, opts.block_size)?;
        let mut sched = Scheduler::new(BlockPool::new(blocks, opts.block_size), seats, opts.max_batch_tokens);
        if !opts.prefix_cache {
            sched = sched.without_prefix_cache();
        }
        let report = Report { pool_blocks: blocks, block_size: opts.block_size, ..Report::default() };
        let results = requests.iter().map(|r| (vec![None; r.samples], r.samples)).collect();
        Ok(Run { model, params, stop, sched, kv, slots: Vec::new(), results, report, seats, held: 0, cached: 0 })
    }

    /// Queue every request that can fit, a group of at most `seats` samples at a time; the others with
    /// why they cannot.
    fn add(&mut self, requests: &[Request]) -> Vec<(usize, String)> {
        let mut skipped = Vec::new();
        for (r, req) in requests.iter().enumerate() {
            let context = self.model.config().max_position_embeddings;
            let len = req.longest(self.params).min(context);
            let why = if req.prompt.is_empty() {
                Some("the prompt has no token".to_string())
            } else if !req.max_new_tokens.is_empty() && req.max_new_tokens.len() != req.samples {
                Some(format!("{} limits on new tokens for {} samples", req.max_new_tokens.len(), req.samples))
            } else if req.max_new_tokens.contains(&0) {
                Some("a sample's limit on new tokens is 0".to_string())
            } else if req.prompt.len() >= context {
                Some(format!(
                    "the prompt's {} tokens fill the model's context of {context} positions \
                     (max_position_embeddings in its config.json): no room for an answer",
                    req.prompt.len()
                ))
            } else if self.sched.blocks_for(len) > self.sched.pool().capacity() {
                Some(format!(
                    "{} prompt + {} new tokens need {} blocks of {} positions, the KV pool has {} \
                     (generation.kv_blocks; or lower max_new_tokens)",
                    req.prompt.len(),
                    len - req.prompt.len(),
                    self.sched.blocks_for(len),
                    self.sched.pool().block_size(),
                    self.sched.pool().capacity()
                ))
            } else {
                None
            };
            if let Some(why) = why {
                skipped.push((r, why));
                continue;
            }
            for start in (0..req.samples).step_by(self.seats) {
                let n = self.seats.min(req.samples - start);
                for (j, id) in self.sched.add(&req.prompt, n).into_iter().enumerate() {
                    debug_assert_eq!(id, self.slots.len());
                    let sample = start + j;
                    let rng = sequence_rng(self.params.seed, req.first_id + sample as u64);
                    let max_new = req.limit(sample, self.params);
                    let slot = Slot { request: r, sample, max_new, rng, tokens: vec![], logprobs: vec![], done: None };
                    self.slots.push(slot);
                }
            }
        }
        skipped
    }

    /// Run `step`: the forward, the pick of each sampling sequence's next token, and what follows from
    /// it. Returns the tokens generated and the requests now complete.
    fn step(&mut self, step: &Step) -> Result<(usize, Vec<usize>), GenerateError> {
        for c in &step.copies {
            self.kv.copy_block(c.from, c.to, c.len)?;
        }
        let (batch, rows) = self.batch(&step.entries);
        let logits = self.model.forward_paged(&batch, &self.kv)?;
        let forked = self.sched.computed(step);
        self.note_pool();
        // Each sampling sequence's row of the logits; a group's samples that forked now read the leader's.
        let mut seqs: Vec<SeqId> = rows.iter().map(|&(s, _)| s).collect();
        let mut pick_rows: Vec<u32> = (0..rows.len() as u32).collect();
        for (leader, samples) in forked {
            let row = rows.iter().position(|&(s, _)| s == leader).expect("a leader samples") as u32;
            seqs.extend(&samples);
            pick_rows.extend(std::iter::repeat_n(row, samples.len()));
        }
        let logits = if pick_rows.len() == rows.len() {
            logits
        } else {
            let idx = crate::device::from_host(pick_rows.clone(), pick_rows.len(), logits.device())?;
            logits.index_select(&idx, 0)?
        };
        self.report.steps += 1;
        if seqs.is_empty() {
            return Ok((0, Vec::new()));
        }
        let mut rngs: Vec<ChaCha8Rng> = seqs.iter().map(|&s| self.slots[s].rng.clone()).collect();
        let (tokens, logprobs) = {
            let mut refs: Vec<&mut ChaCha8Rng> = rngs.iter_mut().collect();
            pick(&logits, self.params, &mut refs, !self.model.device().is_cpu())?
        };
        let mut new = 0;
        let mut finished = Vec::new();
        for (i, &s) in seqs.iter().enumerate() {
            self.slots[s].rng = rngs[i].clone();
            new += usize::from(!self.stop.contains(&tokens[i]));
            if let Some(r) = self.take(s, tokens[i], logprobs[i]) {
                finished.push(r);
            }
        }
        self.report.generated += new;
        Ok((new, finished))
    }

    /// `token` (with its log-prob) is `s`'s next: appended, or the end of `s`. Returns `s`'s request when
    /// this completes it.
    fn take(&mut self, s: SeqId, token: u32, logprob: f32) -> Option<usize> {
        let slot = &mut self.slots[s];
        let max_new = slot.max_new;
        slot.logprobs.push(logprob);
        if self.stop.contains(&token) {
            slot.done = Some(FinishReason::Stop);
        } else {
            slot.tokens.push(token);
            self.sched.append(s, token);
            // An answer ends at max_new_tokens, or where the sequence fills the model's context.
            let context = self.model.config().max_position_embeddings;
            if slot.tokens.len() >= max_new || self.sched.tokens(s).len() >= context {
                slot.done = Some(FinishReason::Length);
            }
        }
        let finish = slot.done?;
        self.sched.finish(s);
        let slot = &mut self.slots[s];
        let g = Generation {
            tokens: std::mem::take(&mut slot.tokens),
            finish,
            logprobs: std::mem::take(&mut slot.logprobs),
        };
        let (gens, left) = &mut self.results[slot.request];
        gens[slot.sample] = Some(g);
        *left -= 1;
        (*left == 0).then_some(slot.request)
    }

    /// The step's tokens as the decoder's batch: positions, pool slots, each token's sequence and context,
    /// and the rows whose logits are wanted. Also returns, per logits row, its sequence and entry.
    fn batch(&self, entries: &[Entry]) -> (PagedBatch, Vec<(SeqId, usize)>) {
        let max_blocks = entries.iter().map(|e| self.sched.blocks(e.seq).len()).max().unwrap_or(0);
        let n = entries.iter().map(|e| e.len).sum::<usize>();
        let mut b = PagedBatch {
            tokens: Vec::with_capacity(n),
            positions: Vec::with_capacity(n),
            slots: Vec::with_capacity(n),
            layout: PagedLayout {
                block_size: self.sched.pool().block_size(),
                max_blocks,
                tables: Vec::with_capacity(entries.len() * max_blocks),
                token_seq: Vec::with_capacity(n),
                token_ctx: Vec::with_capacity(n),
            },
            logit_rows: Vec::new(),
        };
        let mut rows = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let table = self.sched.blocks(e.seq);
            b.layout.tables.extend(table);
            b.layout.tables.extend(std::iter::repeat_n(0, max_blocks - table.len()));
            let tokens = self.sched.tokens(e.seq);
            for (p, &token) in tokens.iter().enumerate().skip(e.start).take(e.len) {
                b.tokens.push(token);
                b.positions.push(p as u32);
                b.slots.push(self.sched.slot(e.seq, p));
                b.layout.token_seq.push(i as u32);
                b.layout.token_ctx.push(p as u32 + 1);
            }
            if e.sample {
                b.logit_rows.push(b.tokens.len() as u32 - 1);
                rows.push((e.seq, i));
            }
        }
        (b, rows)
    }

    /// The pool's peak use, and the positions its blocks in use hold and cache.
    fn note_pool(&mut self) {
        let held = self.sched.pool().in_use();
        self.report.peak_blocks = self.report.peak_blocks.max(held);
        self.held += held * self.sched.pool().block_size();
        self.cached += self.sched.cached_positions();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{random_decoder, Arch};
    use candle_core::DType;

    fn model() -> Decoder {
        let shape = crate::model::tiny::TinyShape { layers: 2, hidden: 64, heads: 4, kv_heads: 2, intermediate: 128 };
        let cfg = shape.config(Arch::Qwen3, 128, None, None).unwrap();
        random_decoder(cfg, 7, DType::F32, &candle_core::Device::Cpu, false).unwrap()
    }

    fn requests() -> Vec<Request> {
        let prompts: Vec<Vec<u32>> = vec![
            vec![1, 5, 9, 33, 2],
            vec![2, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41],
            vec![3],
            (0..23).map(|i| (i * 7 % 120) as u32).collect(),
        ];
        prompts.into_iter().enumerate().map(|(i, p)| Request::new(p, 3 * i as u64, 3)).collect()
    }

    /// Every request's generations by the paged engine, in request order.
    fn paged(
        model: &Decoder,
        reqs: &[Request],
        params: &SamplingParams,
        stop: &[u32],
        seats: usize,
        opts: &GenerationOptions,
    ) -> (Vec<Vec<Generation>>, Report) {
        let mut out = vec![None; reqs.len()];
        let report = generate_paged::<GenerateError>(
            model,
            reqs,
            params,
            (stop, seats),
            opts,
            |_| {},
            |r, g| {
                out[r] = Some(g.unwrap());
                Ok(())
            },
        )
        .unwrap();
        (out.into_iter().map(Option::unwrap).collect(), report)
    }

    /// The same through the static engine, one batch of every sample.
    fn reference(model: &Decoder, reqs: &[Request], params: &SamplingParams, stop: &[u32]) -> Vec<Vec<Generation>> {
        let (mut prompts, mut ids) = (vec![], vec![]);
        for r in reqs {
            for j in 0..r.samples {
                prompts.push(r.prompt.clone());
                ids.push(r.first_id + j as u64);
            }
        }
        let gens = super::super::generate(model, &prompts, &ids, params, stop, 0, |_| {}).unwrap();
        let mut it = gens.into_iter();
        reqs.iter().map(|r| it.by_ref().take(r.samples).collect()).collect()
    }

    fn same(a: &[Vec<Generation>], b: &[Vec<Generation>], what: &str) {
        for (r, (x, y)) in a.iter().zip(b).enumerate() {
            for (j, (g, h)) in x.iter().zip(y).enumerate() {
                assert_eq!((&g.tokens, g.finish), (&h.tokens, h.finish), "{what}: request {r} sample {j}");
                let d = g.logprobs.iter().zip(&h.logprobs).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
                assert!(d <= 1e-5, "{what}: request {r} sample {j}: log-probs differ by {d}");
                assert_eq!(g.logprobs.len(), h.logprobs.len());
            }
        }
    }

    /// Greedy and sampled answers of the paged engine equal the static engine's, whatever the seats, the
    /// block size, the token budget (chunked prefill) and a pool small enough to preempt.
    #[test]
    fn the_paged_engine_gives_the_static_engines_tokens_under_any_schedule() {
        let m = model();
        let reqs = requests();
        let greedy = SamplingParams { max_new_tokens: 14, ..Default::default() };
        let sampled = SamplingParams { temperature: 1.0, top_p: 0.9, top_k: 40, max_new_tokens: 14, seed: 5 };
        let stop = [reference(&m, &reqs, &greedy, &[])[0][0].tokens[4]];
        for params in [&greedy, &sampled] {
            let want = reference(&m, &reqs, params, &stop);
            for (seats, block_size, budget, blocks) in [(1, 16, 2048, 0), (7, 4, 5, 0), (64, 4, 64, 0), (5, 4, 9, 12)] {
                let opts =
                    GenerationOptions { block_size, max_batch_tokens: budget, kv_blocks: blocks, ..Default::default() };
                let (got, report) = paged(&m, &reqs, params, &stop, seats, &opts);
                same(&got, &want, &format!("seats {seats}, blocks of {block_size}, budget {budget}, pool {blocks}"));
                if blocks > 0 && params.temperature > 0.0 {
                    assert!(report.counts.preemptions > 0, "the small pool preempts");
                }
            }
        }
    }

    /// The samples of a problem prefill its prompt once, and the blocks in use hold at most 1.1 positions
    /// per cached one (blocks of 4 for these short answers).
    #[test]
    fn a_problems_samples_prefill_its_prompt_once() {
        let m = model();
        let reqs = requests();
        let params = SamplingParams { temperature: 1.0, max_new_tokens: 40, seed: 1, ..Default::default() };
        let opts = GenerationOptions { block_size: 4, ..Default::default() };
        let (_, report) = paged(&m, &reqs, &params, &[], 12, &opts);
        let prompts: usize = reqs.iter().map(|r| r.prompt.len()).sum();
        assert_eq!(report.counts.prefill_computed, prompts);
        assert_eq!(report.counts.prefill_saved, 2 * prompts);
        assert_eq!(report.counts.preemptions, 0);
        assert!(report.kv_held_per_cached <= 1.1, "{}", report.kv_held_per_cached);
        assert!(report.occupancy > 0.5, "{}", report.occupancy);
        assert_eq!(report.generated, 12 * 40);
    }

    /// Per-sample limits on new tokens: each answer ends at its own, the same under both schedules.
    #[test]
    fn each_sample_stops_at_its_own_limit_under_both_schedules() {
        let m = model();
        let mut reqs = requests();
        for (i, r) in reqs.iter_mut().enumerate() {
            r.max_new_tokens = (0..r.samples).map(|j| 1 + (5 * i + 3 * j) % 13).collect();
        }
        let params = SamplingParams { temperature: 1.0, max_new_tokens: 12, seed: 2, ..Default::default() };
        let (got, _) = paged(&m, &reqs, &params, &[], 5, &GenerationOptions { block_size: 4, ..Default::default() });
        let (mut prompts, mut ids, mut limits) = (vec![], vec![], vec![]);
        for r in &reqs {
            for j in 0..r.samples {
                prompts.push(r.prompt.clone());
                ids.push(r.first_id + j as u64);
                limits.push(r.max_new_tokens[j]);
            }
        }
        let gens = super::super::generate_limited(&m, &prompts, (&ids, &limits), &params, &[], 0, |_| {}).unwrap();
        let mut it = gens.into_iter();
        let want: Vec<Vec<Generation>> = reqs.iter().map(|r| it.by_ref().take(r.samples).collect()).collect();
        same(&got, &want, "per-sample limits");
        for (r, g) in reqs.iter().zip(&got) {
            let lens: Vec<usize> = g.iter().map(|g| g.tokens.len()).collect();
            let limits: Vec<usize> = r.max_new_tokens.iter().map(|&l| l.min(12)).collect();
            assert_eq!(lens, limits);
        }
    }

    /// Answers end where a sequence fills the model's context (finish `length`), under both schedules;
    /// a prompt that fills it is reported and skipped by the paged engine, refused by the static one.
    #[test]
    fn answers_stop_at_the_models_context_and_longer_prompts_are_reported() {
        let shape = crate::model::tiny::TinyShape { layers: 2, hidden: 64, heads: 4, kv_heads: 2, intermediate: 128 };
        let mut cfg = shape.config(Arch::Qwen3, 128, None, None).unwrap();
        cfg.max_position_embeddings = 20;
        let m = random_decoder(cfg, 7, DType::F32, &candle_core::Device::Cpu, false).unwrap();
        let reqs = requests();
        let params = SamplingParams { max_new_tokens: 14, ..Default::default() };
        let mut results = vec![None; reqs.len()];
        let report = generate_paged::<GenerateError>(
            &m,
            &reqs,
            &params,
            (&[], 8),
            &GenerationOptions::default(),
            |_| {},
            |r, g| {
                results[r] = Some(g);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(report.skipped, 1);
        let why = results[3].clone().unwrap().unwrap_err();
        assert!(why.contains("prompt's 23 tokens fill the model's context of 20"), "{why}");
        let got: Vec<Vec<Generation>> = results[..3].iter().map(|g| g.clone().unwrap().unwrap()).collect();
        let lens: Vec<usize> = got.iter().map(|g| g[0].tokens.len()).collect();
        assert_eq!(lens, [14, 9, 14], "prompts of 5, 11 and 1 tokens in a context of 20");
        assert!(got.iter().flatten().all(|g| g.finish == FinishReason::Length));
        same(&got, &reference(&m, &reqs[..3], &params, &[]), "capped at the context");
        let e = super::super::generate(&m, &[reqs[3].prompt.clone()], &[0], &params, &[], 0, |_| {}).unwrap_err();
        assert!(e.to_string().contains("fills the model's context of 20 positions"), "{e}");
    }

    /// A request longer than the pool is reported and skipped, the others run; zero seats and a zero
    /// block size are errors naming the option.
    #[test]
    fn what_can_never_fit_is_skipped_and_bad_options_are_named() {
        let m = model();
        let reqs = requests();
        let params = SamplingParams { max_new_tokens: 6, ..Default::default() };
        let opts = GenerationOptions { block_size: 4, kv_blocks: 5, ..Default::default() };
        let mut results = vec![];
        let report = generate_paged::<GenerateError>(
            &m,
            &reqs,
            &params,
            (&[], 4),
            &opts,
            |_| {},
            |r, g| {
                results.push((r, g.map(|g| g.len())));
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(report.skipped, 1);
        let skipped: Vec<_> = results.iter().filter(|(_, g)| g.is_err()).collect();
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].0, 3);
        let why = skipped[0].1.as_ref().unwrap_err();
        assert!(
            why.contains("23 prompt + 6 new tokens need 8 blocks") && why.contains("generation.kv_blocks"),
            "{why}"
        );
        assert_eq!(results.iter().filter(|(_, g)| g.is_ok()).count(), 3);
        let run = |seats, opts: &GenerationOptions| {
            generate_paged::<GenerateError>(&m, &reqs, &params, (&[], seats), opts, |_| {}, |_, _| Ok(()))
                .unwrap_err()
                .to_string()
        };
        assert!(run(0, &GenerationOptions::default()).contains("batch_size = 0"));
        let zero = GenerationOptions { block_size: 0, ..Default::default() };
        assert!(run(2, &zero).contains("generation.block_size = 0"));
    }

    /// The paged forward's logits equal the contiguous cache's at the prefill and at each decode step
    /// (within 1e-5), for sequences of different lengths in one step.
    #[test]
    fn paged_logits_equal_the_contiguous_caches() {
        let m = model();
        let prompts = [vec![1u32, 5, 9, 33, 2, 8, 9], vec![4u32, 2, 7]];
        let kv = PagedKv::new(&m, 8, 4).unwrap();
        // Sequence 0 in blocks 3, 1, 2; sequence 1 in blocks 6, 0, 4.
        let tables = [[3u32, 1, 2], [6, 0, 4]];
        let slot = |s: usize, p: usize| tables[s][p / 4] * 4 + (p % 4) as u32;
        let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
        let mut computed = [0usize; 2];
        for step in 0..3 {
            let mut b = PagedBatch {
                tokens: vec![],
                positions: vec![],
                slots: vec![],
                layout: PagedLayout {
                    block_size: 4,
                    max_blocks: 3,
                    tables: tables.concat(),
                    token_seq: vec![],
                    token_ctx: vec![],
                },
                logit_rows: vec![],
            };
            for s in 0..2 {
                for (p, &token) in seqs[s].iter().enumerate().skip(computed[s]) {
                    b.tokens.push(token);
                    b.positions.push(p as u32);
                    b.slots.push(slot(s, p));
                    b.layout.token_seq.push(s as u32);
                    b.layout.token_ctx.push(p as u32 + 1);
                }
                b.logit_rows.push(b.tokens.len() as u32 - 1);
                computed[s] = seqs[s].len();
            }
            let got = m.forward_paged(&b, &kv).unwrap();
            for (s, seq) in seqs.iter_mut().enumerate() {
                let full = m.full_logits(&crate::model::TokenBatch::padded(std::slice::from_ref(seq), 0)).unwrap();
                let want = full.get(0).unwrap().get(seq.len() - 1).unwrap();
                let d = crate::kernels::testing::max_abs_diff(&got.get(s).unwrap(), &want);
                assert!(d <= 1e-5, "step {step} sequence {s}: {d}");
                seq.push(10 + step as u32);
            }
        }
    }
}
