//! What to change when a memory plan does not fit: each setting that lowers the peak, planned on a
//! changed copy of the plan's input, with the value that fits where one does.

use super::memory::{
    gib, plan, sequence_tokens, GenerationLoad, Place, Plan, PlanInput, CUDA_CONTEXT_BYTES, POOL_OVERHEAD,
};
use crate::model::Attention;

/// Adds a candidate to the advice: the setting in words, and how it changes the plan's input.
type AddCandidate<'a> = dyn FnMut(String, &dyn Fn(&mut PlanInput)) + 'a;

/// Carry into `floor` the one setting `changed` has changed from `input` (the settings the advice lowers).
fn apply(floor: &mut PlanInput, changed: &PlanInput, input: &PlanInput) {
    let pick = |a: usize, b: usize, c: usize| if a != c { a } else { b };
    floor.decoder.checkpoint_layers |= changed.decoder.checkpoint_layers;
    floor.decoder.recompute_attention |= changed.decoder.recompute_attention;
    floor.cache_reference |= changed.cache_reference;
    if changed.keep_logits == Some(false) {
        floor.keep_logits = Some(false);
    }
    floor.offload |= changed.offload;
    let (c, i) = (&changed.decoder, &input.decoder);
    if c.attention != i.attention || c.fused_ops != i.fused_ops || changed.attention != input.attention {
        (floor.decoder.attention, floor.decoder.fused_ops) = (c.attention, c.fused_ops);
        floor.attention = changed.attention;
    }
    floor.micro_batch_size = pick(changed.micro_batch_size, floor.micro_batch_size, input.micro_batch_size);
    floor.micro_batch_tokens = pick(changed.micro_batch_tokens, floor.micro_batch_tokens, input.micro_batch_tokens);
    floor.max_response_tokens = pick(changed.max_response_tokens, floor.max_response_tokens, input.max_response_tokens);
    if let (Some(f), Some(c), Some(o)) = (floor.validation.as_mut(), &changed.validation, &input.validation) {
        f.batch_size = pick(c.batch_size, f.batch_size, o.batch_size);
    }
    if let (Some(f), Some(c), Some(o)) = (floor.rollout.as_mut(), &changed.rollout, &input.rollout) {
        let (f, c, o) = (&mut f.sampling, &c.sampling, &o.sampling);
        f.batch_size = pick(c.batch_size, f.batch_size, o.batch_size);
        f.max_new_tokens = pick(c.max_new_tokens, f.max_new_tokens, o.max_new_tokens);
    }
}

impl Plan {
    /// What to change when the plan does not fit: each setting it can still change, planned, with the value
    /// that fits where one does; when none fits alone, all of them together; when not even that fits, the
    /// part no such setting changes and what can.
    pub fn advice(&self) -> String {
        // The other settings are planned with the logits as this plan has them ("auto" resolved).
        let input = &PlanInput { keep_logits: Some(self.keep_logits), ..self.input.clone() };
        let mut fitting = Vec::new();
        let mut floor = input.clone();
        let candidates = self.candidates(input);
        for (what, changed) in &candidates {
            apply(&mut floor, changed, input);
            if let Some(peak) = self.fits_with(changed) {
                fitting.push(format!("{what} (peak {})", gib(peak)));
            }
        }
        if !fitting.is_empty() {
            return format!("reduce the peak with {}; or give a device with more memory", fitting.join(", or "));
        }
        if let Some(peak) = self.fits_with(&floor) {
            return format!(
                "no one setting is enough: together, {} (peak {}); or give a device with more memory",
                candidates.iter().map(|(w, _)| w.as_str()).collect::<Vec<_>>().join(", "),
                gib(peak)
            );
        }
        self.fixed_part_advice(&floor)
    }

    /// The plan of `input`, when it fits: its device peak.
    fn fits_with(&self, input: &PlanInput) -> Option<u64> {
        let p = plan(input);
        (p.fits() == Some(true)).then(|| p.peak(Place::Device))
    }

    /// The settings that bring the peak down, each with the config it makes: the largest value that fits
    /// where there is one, else the least.
    fn candidates(&self, input: &PlanInput) -> Vec<(String, PlanInput)> {
        let mut out = Vec::new();
        let mut with = |what: String, f: &dyn Fn(&mut PlanInput)| {
            let mut c = input.clone();
            f(&mut c);
            out.push((what, c));
        };
        if self.keep_logits {
            with("model.keep_logits = false".into(), &|c| c.keep_logits = Some(false));
        }
        if !input.decoder.checkpoint_layers {
            with("model.checkpoint_layers = true".into(), &|c| c.decoder.checkpoint_layers = true);
        } else if !input.decoder.recompute_attention && input.attention != Attention::Matrix {
            with("model.recompute_attention = true".into(), &|c| c.decoder.recompute_attention = true);
        }
        if !input.offload && !input.on_cpu {
            with("optim.offload = true (optimizer state in host memory)".into(), &|c| c.offload = true);
        }
        if input.attention == Attention::Matrix {
            let flash = "flash attention (model.fused_ops = true, model.attention = \"flash\")";
            with(flash.into(), &|c| {
                (c.decoder.fused_ops, c.decoder.attention, c.attention) = (true, Attention::Flash, Attention::Flash)
            });
        }
        if input.needs_reference && !input.reference_cached() {
            with("cached reference log-probs (model.cache_reference = true)".into(), &|c| c.cache_reference = true);
        }
        self.batch_candidates(input, &mut with);
        out
    }

    /// [`Plan::candidates`] of the sizes: the micro-batch, the answers' lengths, the generations' batches,
    /// each at the largest value in its range that fits (lengths in 256s, at least 1024).
    fn batch_candidates(&self, input: &PlanInput, with: &mut AddCandidate) {
        let mut size = |key: &str, range: (usize, usize), lengths: bool, set: fn(&mut PlanInput, usize)| {
            let n = self.largest(input, range, &set);
            let n = if lengths { (n / 256 * 256).max(1024) } else { n };
            with(format!("{key} = {n}"), &|c| set(c, n));
        };
        fn sampling(c: &mut PlanInput) -> &mut GenerationLoad {
            &mut c.rollout.as_mut().expect("set").sampling
        }
        let (mb, budget) = (input.micro_batch_size, input.micro_batch_tokens);
        let (prompt, response) = sequence_tokens(input);
        let seq = prompt.saturating_add(response) as usize;
        if budget > seq {
            // Below the longest answer the budget changes nothing: that answer runs alone.
            size("train.micro_batch_tokens", (seq, budget - 1), false, |c, n| c.micro_batch_tokens = n);
        }
        if mb > 1 && budget == 0 {
            size("train.micro_batch_size", (1, mb - 1), false, |c, n| c.micro_batch_size = n);
        }
        let response = input.max_response_tokens;
        if response == 0 || response > 1024 {
            let top = if response == 0 { input.model.max_position_embeddings } else { response - 1 };
            size("data.max_response_tokens", (1024, top), true, |c, n| c.max_response_tokens = n);
        }
        let sampled = input.rollout.as_ref().map(|r| &r.sampling);
        if let Some(r) = sampled.filter(|r| r.max_new_tokens > 1024) {
            size("rollout.max_new_tokens", (1024, r.max_new_tokens - 1), true, |c, n| sampling(c).max_new_tokens = n);
        }
        if let Some(v) = input.validation.as_ref().filter(|v| v.batch_size > 1) {
            let set = |c: &mut PlanInput, n: usize| c.validation.as_mut().expect("set").batch_size = n;
            size("validation.batch_size", (1, v.batch_size - 1), false, set);
        }
        if let Some(r) = sampled.filter(|r| r.batch_size > 1) {
            size("rollout.batch_size", (1, r.batch_size - 1), false, |c, n| sampling(c).batch_size = n);
        }
    }

    /// The largest value in `low..=high` that `set` makes fit (a bisection: the peak grows with each of
    /// these settings), or `low` when none does.
    fn largest(&self, input: &PlanInput, (low, high): (usize, usize), set: &dyn Fn(&mut PlanInput, usize)) -> usize {
        let fits = |n: usize| {
            let mut c = input.clone();
            set(&mut c, n);
            self.fits_with(&c).is_some()
        };
        if !fits(low) {
            return low;
        }
        let (mut lo, mut hi) = (low, high);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// When every setting at its least still does not fit: the part none of them changes, and what can.
    fn fixed_part_advice(&self, floor: &PlanInput) -> String {
        let fixed = plan(&PlanInput {
            attention: self.input.attention,
            cache_reference: self.input.cache_reference,
            ..floor.clone()
        });
        let names = ["weights", "gradients (f32 accumulator)", "optimizer state", "reference model", "anchor snapshot"];
        let part: u64 = fixed
            .components
            .iter()
            .filter(|c| c.place == Place::Device && names.contains(&c.name.as_str()))
            .map(|c| c.bytes)
            .sum();
        let part = if self.gpu_device(Place::Device) { POOL_OVERHEAD.pooled(part) + CUDA_CONTEXT_BYTES } else { part };
        let memory = self.input.device_memory.unwrap_or(0);
        let ranks = if floor.offload {
            "more ranks do not help: ZeRO-1 shards only the optimizer state, which optim.offload already keeps in \
             host memory, and every rank holds the whole weights and f32 gradients"
        } else {
            "more ranks shard the optimizer state (--world-size N: ZeRO-1) but not the weights or the f32 gradients"
        };
        format!(
            "no setting of this run can fit it: at the least of every one (the micro-batch, the lengths, the batch \
             sizes, recomputation, offload) the plan's peak is {}, of which {} is the part they do not change (the \
             weights, the f32 gradient accumulator, the optimizer state on the device, a reference copy, and on a \
             GPU the memory pool and the context) against the device's {}; {ranks}; a smaller model or a device \
             with more memory does",
            gib(fixed.peak(Place::Device)),
            gib(part),
            gib(memory)
        )
    }
}
