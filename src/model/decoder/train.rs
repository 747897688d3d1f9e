//! Training and scoring: per-token log-probs and entropies of given targets, and forward-backward with
//! gradients for every trainable parameter, the layers optionally recomputed one at a time in the backward
//! (activation checkpointing).

use candle_core::{DType, Tensor, Var};

use super::layer::{rms_norm, LayerState, Mode, Pass, Positions};
use super::params::{Grads, Param, Projection};
use super::{Decoder, Targets, TokenBatch};
use crate::kernels::{
    embedding_grad, embedding_grad_into, logprobs_entropy_with, AttentionRecord, HeadBackward, Replay,
};

impl Decoder {
    /// The embedding's gradient from `g`, the gradient of its output rows (`[B, T, hidden]`), added into
    /// `grads` (when the embedding is trainable): each token's rows summed in f32 and added into the f32
    /// accumulator in place ([`embedding_grad_into`]; [`embedding_grad`] and an add where it has none yet);
    /// with `fused_ops = false`, candle's `index_add` in the weight's dtype, as its own backward does.
    fn embed_backward(&self, ids: &Tensor, g: Option<&Tensor>, grads: &mut Grads) -> candle_core::Result<()> {
        let _phase = crate::profile::phase("embedding");
        let (Param::Trainable(w), Some(g)) = (self.param(self.embed), g) else { return Ok(()) };
        let g = g.reshape((ids.dim(0)?, self.cfg.hidden_size))?;
        let slot = self.slot(self.embed).unwrap_or_default();
        let dw = match (self.options.fused_ops, &grads.grads[slot]) {
            // Summed straight into the accumulator: no [V, hidden] gradient of its own.
            (true, Some(acc)) => return embedding_grad_into(acc, ids, &g),
            (true, None) => embedding_grad(ids, &g, self.cfg.vocab_size)?,
            (false, _) => w.zeros_like()?.index_add(ids, &g.to_dtype(w.dtype())?, 0)?,
        };
        grads.add(slot, &dw)
    }

    /// Hidden states of the target rows' predecessors, gathered as `[N, hidden]`, after the final norm.
    fn select_hidden(&self, x: &Tensor, targets: &Targets, graph: bool) -> candle_core::Result<Tensor> {
        let (_, t, h) = x.dims3()?;
        let idx: Vec<u32> = targets.row.iter().zip(&targets.pos).map(|(&r, &p)| r * t as u32 + p - 1).collect();
        let idx = crate::device::from_host(idx, targets.len(), &self.device)?;
        let sel = x.reshape(((), h))?.index_select(&idx, 0)?;
        rms_norm(&sel, &self.w(self.norm, graph), self.cfg.rms_norm_eps, self.options.fused_ops)
    }

    fn target_ids(&self, batch: &TokenBatch, targets: &Targets) -> candle_core::Result<Tensor> {
        let ids: Vec<u32> =
            targets.row.iter().zip(&targets.pos).map(|(&r, &p)| batch.tokens[r as usize][p as usize]).collect();
        crate::device::from_host(ids, targets.len(), &self.device)
    }

    fn check(&self, batch: &TokenBatch, targets: &Targets) -> candle_core::Result<()> {
        for (&r, &p) in targets.row.iter().zip(&targets.pos) {
            if r as usize >= batch.rows() || p == 0 || p as usize >= batch.width() {
                candle_core::bail!("target (row {r}, pos {p}) outside a batch of {}x{}", batch.rows(), batch.width());
            }
        }
        if let Some(&bad) = batch.tokens.iter().flatten().find(|&&t| t as usize >= self.cfg.vocab_size) {
            candle_core::bail!("token id {bad} is outside the vocabulary of {}", self.cfg.vocab_size);
        }
        Ok(())
    }

    /// `[N, 2]` f32: log-prob of each target token and the entropy of its predictive distribution.
    /// With `graph = false` nothing is recorded (reference model, old-policy log-probs, scoring).
    pub fn token_logprobs(&self, batch: &TokenBatch, targets: &Targets, graph: bool) -> candle_core::Result<Tensor> {
        self.check(batch, targets)?;
        self.logprobs_checked(batch, targets, graph)
    }

    /// The last layer's output `[B, T, hidden]` (before the final norm), without a cache.
    pub(super) fn run_layers(&self, batch: &TokenBatch, graph: bool) -> candle_core::Result<Tensor> {
        self.layers_from(batch, self.embed(&batch.tokens, graph)?, Mode::plain(graph))
    }

    /// The layers over the embedded batch `x` (`[B, T, hidden]`).
    fn layers_from(&self, batch: &TokenBatch, mut x: Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let positions = self.positions(batch)?;
        let pass = Pass { positions: &positions, mode };
        for l in 0..self.cfg.num_layers {
            x = self.layer(l, &x, pass, LayerState::None)?;
        }
        Ok(x)
    }

    fn logprobs_checked(&self, batch: &TokenBatch, targets: &Targets, graph: bool) -> candle_core::Result<Tensor> {
        let x = self.run_layers(batch, graph)?;
        self.head(&x, batch, targets, Mode::plain(graph))
    }

    /// Log-probs and entropies `[N, 2]` of the targets from the last layer's output `x` (the lm_head's
    /// gradient added into its accumulator where `mode` has one).
    fn head(&self, x: &Tensor, batch: &TokenBatch, targets: &Targets, mode: Mode) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::coarse("log-prob head")?;
        let graph = mode.graph;
        let h = self.select_hidden(x, targets, graph)?;
        let budget = match self.options.logprob_chunk_bytes {
            0 => crate::kernels::logprob_chunk_bytes(&self.device)?,
            b => b,
        };
        let (w, ids) = (self.w(self.lm_head, graph), self.target_ids(batch, targets)?);
        // Both apply only to a recorded op (logprobs_entropy_with): nothing is kept or added without a graph.
        let backward = HeadBackward {
            accumulator: mode.accumulator(self.slot(self.lm_head)),
            keep_logits: self.options.keep_logits,
            entropy_gradient: batch.entropy_gradient,
        };
        logprobs_entropy_with(&h, &w, &ids, budget, backward)
    }

    /// The f32 accumulators of `grads` by slot, each made (zeros) where it has none yet, for the forward
    /// to add the projections' and the lm_head's weight gradients into (with `fused_ops`; `None`
    /// otherwise: candle's matmul backward and [`Grads::add`]).
    fn accumulators(&self, grads: &mut Grads) -> candle_core::Result<Option<Vec<Option<Tensor>>>> {
        if !self.options.fused_ops {
            return Ok(None);
        }
        for (p, slot) in self.params.iter().zip(&self.slots) {
            if let (Param::Trainable(v), Some(slot)) = (p, *slot) {
                if grads.grads[slot].is_none() {
                    grads.grads[slot] = Some(Tensor::zeros(v.shape(), DType::F32, v.device())?);
                }
            }
        }
        Ok(Some(grads.grads.clone()))
    }

    fn collect(&self, store: &candle_core::backprop::GradStore, grads: &mut Grads) -> candle_core::Result<()> {
        let _phase = crate::profile::phase("gradient accumulation");
        for (p, slot) in self.params.iter().zip(&self.slots) {
            if let (Param::Trainable(v), Some(slot)) = (p, slot) {
                if let Some(g) = store.get(v.as_tensor()) {
                    grads.add(*slot, g)?;
                }
            }
        }
        Ok(())
    }

    /// Forward and backward: `loss_fn` turns the `[N, 2]` log-prob/entropy tensor into a scalar loss;
    /// returns the loss value and the gradients of every trainable parameter. With
    /// `options.checkpoint_layers`, layer activations are recomputed one layer at a time in the backward.
    pub fn forward_backward(
        &self,
        batch: &TokenBatch,
        targets: &Targets,
        loss_fn: &mut dyn FnMut(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<(f32, Grads)> {
        let mut grads = self.new_grads();
        let loss = self.forward_backward_into(batch, targets, loss_fn, &mut grads)?;
        Ok((crate::device::to_host_scalar::<f32>(&loss)?, grads))
    }

    /// [`Decoder::forward_backward`] adding the gradients into `grads` (gradient accumulation without a
    /// second full set of f32 gradients); returns the loss, detached, as an f32 scalar on the device (the
    /// caller reads it when it needs it: a training step reads its statistics once, at its end).
    pub fn forward_backward_into(
        &self,
        batch: &TokenBatch,
        targets: &Targets,
        loss_fn: &mut dyn FnMut(&Tensor) -> candle_core::Result<Tensor>,
        grads: &mut Grads,
    ) -> candle_core::Result<Tensor> {
        self.check(batch, targets)?;
        let trainable = self.vars().len();
        if grads.grads.len() != trainable {
            candle_core::bail!("{} gradients for {trainable} trainable parameters", grads.grads.len());
        }
        // The embedding's output is a leaf of the graph: its gradient is summed per token in f32 by
        // `embed_backward`, not by candle's index_add in the weight's dtype.
        let forward = crate::profile::coarse("forward")?;
        let accumulators = self.accumulators(grads)?;
        let training = |graph| match &accumulators {
            Some(a) if graph => Mode::training(batch, graph).accumulating(a),
            _ => Mode::training(batch, graph),
        };
        let embedding = crate::profile::phase("embedding");
        let ids = self.token_ids(&batch.tokens)?;
        let shape = (batch.rows(), batch.width(), self.cfg.hidden_size);
        let e = self.embed_ids(&ids, false)?.reshape(shape)?;
        drop(embedding);
        if !self.options.checkpoint_layers {
            let e = Var::from_tensor(&e)?;
            let x = self.layers_from(batch, e.as_tensor().clone(), training(true))?;
            let loss = self.loss(&self.head(&x, batch, targets, training(true))?, loss_fn)?;
            forward.end();
            let _backward = crate::profile::coarse("backward")?;
            let store = {
                // candle's backward runs the whole graph at once: the layers' attention and MLP and the
                // head are not told apart.
                let _phase = crate::profile::phase("layers and head (one autograd pass)");
                loss.backward()?
            };
            self.collect(&store, grads)?;
            self.embed_backward(&ids, store.get(e.as_tensor()), grads)?;
            return loss.detach().to_dtype(DType::F32);
        }
        let positions = self.positions(batch)?;
        let (inputs, mut records, x) = self.forward_kept(batch, e, &positions)?;
        // Head: gradient of the loss with respect to the last hidden state.
        let xv = Var::from_tensor(&x)?;
        let loss = self.loss(&self.head(xv.as_tensor(), batch, targets, training(true))?, loss_fn)?;
        forward.end();
        let _backward = crate::profile::coarse("backward")?;
        let head = crate::profile::coarse("log-prob head")?;
        let store = loss.backward()?;
        self.collect(&store, grads)?;
        let mut g = match store.get(xv.as_tensor()) {
            Some(g) => g.clone(),
            None => x.zeros_like()?,
        };
        head.end();
        // Layers in reverse: recompute with a graph, backprop the incoming gradient.
        let pass = Pass { positions: &positions, mode: training(true) };
        for l in (0..self.cfg.num_layers).rev() {
            // This layer's record is released with its backward.
            let record = records.pop().flatten();
            let state = record.as_ref().map_or(LayerState::None, |r| LayerState::Attention(Replay::From(r)));
            g = self.layer_backward(l, &inputs[l], pass, state, &g, grads)?;
        }
        // Embedding: its gradient is the gradient of its output rows.
        self.embed_backward(&ids, Some(&g), grads)?;
        loss.detach().to_dtype(DType::F32)
    }

    /// The layers' forward without a graph from the embeddings `x`, keeping only each layer's input (and,
    /// unless the attention is recomputed, its attention's output and log-sum-exp): the inputs, the
    /// records and the last layer's output.
    fn forward_kept(
        &self,
        batch: &TokenBatch,
        mut x: Tensor,
        positions: &Positions,
    ) -> candle_core::Result<(Vec<Tensor>, Vec<Option<AttentionRecord>>, Tensor)> {
        let keep = !self.options.recompute_attention;
        let pass = Pass { positions, mode: Mode::training(batch, false) };
        let mut inputs = Vec::with_capacity(self.cfg.num_layers + 1);
        let mut records: Vec<Option<AttentionRecord>> = Vec::with_capacity(self.cfg.num_layers);
        for l in 0..self.cfg.num_layers {
            let mut record = None;
            let state = if keep { LayerState::Attention(Replay::Record(&mut record)) } else { LayerState::None };
            let next = self.layer(l, &x, pass, state)?;
            inputs.push(x);
            records.push(record);
            x = next;
        }
        Ok((inputs, records, x))
    }

    /// The loss of the head's log-probs `lp` (a phase of the profile).
    fn loss(
        &self,
        lp: &Tensor,
        loss_fn: &mut dyn FnMut(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::phase("loss");
        loss_fn(lp)
    }

    /// The backward of layer `l` (input `input`, the gradient of its output `g`), recomputed with a graph:
    /// its MLP's backward, then its attention's, their parameters' gradients added into `grads`; returns
    /// the gradient of its input.
    fn layer_backward(
        &self,
        l: usize,
        input: &Tensor,
        pass: Pass,
        state: LayerState,
        g: &Tensor,
        grads: &mut Grads,
    ) -> candle_core::Result<Tensor> {
        let grad_of = |store: &candle_core::backprop::GradStore, v: &Var| match store.get(v.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => v.as_tensor().zeros_like(),
        };
        let recompute = crate::profile::phase("recompute");
        let xin = Var::from_tensor(input)?;
        let mode = pass.mode;
        let mid = self.attention_block(l, xin.as_tensor(), pass, state)?;
        let mid_in = Var::from_tensor(&mid.detach())?;
        // The layer's output `mid + down(act)` is not formed: its backward reads neither it nor the down
        // projection's output, so the residual's gradient is added below. The projection itself is run:
        // recorded instead as a node of zeros carrying the product's backward (a GEMM less a layer), it kept
        // about a layer's activations alive per recomputed layer through the rest of the backward (the 7B
        // step ran out of memory on 2026-11-27; reproduced on the CPU, benches/results/
        // recompute-memory-cpu-2026-11-27.txt), for a reason not found; that op is gone.
        let down = {
            let _mlp = crate::profile::phase("mlp");
            let act = self.mlp_activation(l, mid_in.as_tensor(), mode)?;
            self.project(l, Projection::Down, &act, mode)?
        };
        drop(recompute);
        let g_mid = {
            // The MLP's graph and gradients are released before the attention's backward.
            let _mlp = crate::profile::phase("mlp");
            let store = down.backward_from(&g.reshape(down.shape())?)?;
            self.collect(&store, grads)?;
            (grad_of(&store, &mid_in)? + g)?
        };
        let _attention = crate::profile::phase("attention");
        let store = mid.backward_from(&g_mid)?;
        self.collect(&store, grads)?;
        grad_of(&store, &xin)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{batch, largest_gradient_agrees, tiny, tiny_lora, values, weighted_loss};
    use super::super::Attention;
    use super::*;
    use crate::model::{random_decoder, Arch};
    use candle_core::Device;

    #[test]
    fn every_parameter_gets_a_finite_nonzero_gradient() {
        for (arch, tied) in [(Arch::Qwen2, false), (Arch::Qwen3, false), (Arch::Llama, true), (Arch::Llama, false)] {
            let m = tiny(arch, tied, true);
            let (b, t) = batch();
            let (_, grads) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            for (name, g) in m.names().iter().zip(&grads.grads) {
                let g = g.as_ref().unwrap_or_else(|| panic!("{arch:?}: no gradient for {name}"));
                let v = values(g);
                assert!(v.iter().all(|x| x.is_finite()), "{arch:?}: non-finite gradient for {name}");
                assert!(v.iter().any(|&x| x != 0.0), "{arch:?}: zero gradient for {name}");
            }
        }
    }

    /// Through the default attention (auto: flash on the CPU, with its own backward).
    #[test]
    fn finite_differences_agree_with_autograd() {
        for arch in [Arch::Qwen2, Arch::Qwen3, Arch::Llama] {
            let m = tiny(arch, arch == Arch::Llama, true);
            assert_eq!(m.options.attention, Attention::Auto);
            let (b, t) = batch();
            let (_, grads) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            let eval = |m: &Decoder| -> f64 {
                let lp = m.token_logprobs(&b, &t, false).unwrap();
                weighted_loss(&lp).unwrap().to_scalar::<f32>().unwrap() as f64
            };
            // A few parameters of different kinds: embedding, attention, norm, MLP, q/k norm or bias.
            let picks: Vec<usize> = m
                .names()
                .iter()
                .enumerate()
                .filter(|(_, n)| {
                    n.contains("embed")
                        || n.contains("layers.1.self_attn.k_proj")
                        || n.contains("layers.0.input_layernorm")
                        || n.contains("layers.1.mlp.down_proj")
                        || n.contains("q_norm")
                        || n.ends_with("q_proj.bias")
                })
                .map(|(i, _)| i)
                .collect();
            assert!(picks.len() >= 4, "{arch:?}: {picks:?}");
            for i in picks {
                let Param::Trainable(var) = &m.params[i] else { unreachable!() };
                let what = format!("{arch:?} {}", m.names()[i]);
                largest_gradient_agrees(&m, var, grads.grads[i].as_ref().unwrap(), &eval, &what);
            }
        }
    }

    /// The recomputed layers' backward (the layer's output not formed, the residual's gradient added by hand)
    /// gives the whole graph's gradients bit for bit: a Llama MLP with biases, Qwen3's, and LoRA with the
    /// down projection frozen (no adapter) and adapted.
    #[test]
    fn recomputed_layers_give_the_whole_graphs_gradients_bit_for_bit() {
        let mut llama = tiny(Arch::Llama, false, true);
        llama.cfg.mlp_bias = true;
        let mut biased = random_decoder(llama.cfg.clone(), 3, DType::F32, &Device::Cpu, true).unwrap();
        biased.options = llama.options.clone();
        assert!(biased.trainable_names().iter().any(|n| n.ends_with("mlp.down_proj.bias")));
        let models = [
            biased,
            tiny(Arch::Qwen3, false, true),
            tiny_lora(Arch::Qwen2, &["q_proj", "up_proj"]),
            tiny_lora(Arch::Qwen2, &["v_proj", "down_proj"]),
        ];
        let (b, t) = batch();
        for (k, mut m) in models.into_iter().enumerate() {
            m.options.checkpoint_layers = false;
            let (l1, g1) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            m.options.checkpoint_layers = true;
            let (l2, g2) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            assert_eq!(l1, l2, "model {k}");
            for (name, (a, c)) in m.trainable_names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
                let (a, c) = (values(a.as_ref().unwrap()), values(c.as_ref().unwrap()));
                assert!(a.iter().any(|&x| x != 0.0), "model {k} {name}: zero gradient");
                assert_eq!(a, c, "model {k} {name}");
            }
        }
    }

    #[test]
    fn layer_recomputation_gives_the_same_gradients() {
        let mut m = tiny(Arch::Qwen3, false, true);
        let (b, t) = batch();
        let (l1, g1) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
        m.options.checkpoint_layers = true;
        let (l2, g2) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
        assert!((l1 - l2).abs() < 1e-5);
        for (name, (a, b)) in m.names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
            let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
            let d = crate::kernels::testing::abs_diff(&a, &b);
            assert!(d < 1e-5, "{name}: recomputed gradient differs by {d}");
        }
        // The attention's forward kept rather than recomputed: the same arithmetic, the same gradients.
        m.options.recompute_attention = false;
        let (l3, g3) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
        assert_eq!(l2, l3);
        for (name, (a, b)) in m.names().iter().zip(g2.grads.iter().zip(&g3.grads)) {
            assert_eq!(values(a.as_ref().unwrap()), values(b.as_ref().unwrap()), "{name}");
        }
    }

    /// The fused kernels and their composite references give the same loss and gradients, padded and
    /// packed, with q/k norms (Qwen3) and without (Llama).
    #[test]
    fn fused_ops_match_their_composite_references() {
        for arch in [Arch::Qwen3, Arch::Llama] {
            let mut m = tiny(arch, false, true);
            let (b, t) = batch();
            let packed = TokenBatch::packed(&[vec![vec![5, 17, 3], vec![88, 41, 9, 60]]], 0);
            let mut pt = Targets::default();
            for p in [1, 2, 4, 5, 6] {
                pt.push(0, p);
            }
            for (batch, targets) in [(&b, &t), (&packed, &pt)] {
                m.options.fused_ops = true;
                let (l1, g1) = m.forward_backward(batch, targets, &mut weighted_loss).unwrap();
                m.options.fused_ops = false;
                let (l2, g2) = m.forward_backward(batch, targets, &mut weighted_loss).unwrap();
                assert!((l1 - l2).abs() < 1e-5, "{arch:?}: loss {l1} vs {l2}");
                for (name, (a, b)) in m.names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
                    let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
                    let d = crate::kernels::testing::abs_diff(&a, &b);
                    // f32 sums in different orders (the embedding gradient's per-token sums, the
                    // attention's GEMM blocking): a few units in the fifth decimal.
                    assert!(d < 5e-5, "{arch:?} {name}: fused gradient differs by {d}");
                }
            }
        }
    }

    /// Two micro-batches added into one set of gradients: with `fused_ops` the projections' and the
    /// lm_head's weight gradients go straight into the f32 accumulators (made before the first forward),
    /// and the sums equal the composite path's two gradients added, tied embeddings (the lm_head's and the
    /// embedding's gradients in one accumulator) and layer recomputation included.
    #[test]
    fn micro_batches_accumulate_into_the_same_gradients_as_the_composite() {
        let (b, t) = batch();
        let packed = TokenBatch::packed(&[vec![vec![5, 17, 3], vec![88, 41, 9, 60]]], 0);
        let mut pt = Targets::default();
        for p in [1, 2, 4, 5, 6] {
            pt.push(0, p);
        }
        for (arch, tied, checkpoint) in
            [(Arch::Qwen2, true, false), (Arch::Llama, false, true), (Arch::Qwen3, true, true)]
        {
            let mut m = tiny(arch, tied, true);
            m.options.checkpoint_layers = checkpoint;
            m.options.fused_ops = false;
            let (_, g1) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            let (_, g2) = m.forward_backward(&packed, &pt, &mut weighted_loss).unwrap();
            m.options.fused_ops = true;
            let mut fused = m.new_grads();
            m.forward_backward_into(&b, &t, &mut weighted_loss, &mut fused).unwrap();
            m.forward_backward_into(&packed, &pt, &mut weighted_loss, &mut fused).unwrap();
            for (i, name) in m.names().iter().enumerate() {
                let want = (g1.grads[i].as_ref().unwrap() + g2.grads[i].as_ref().unwrap()).unwrap();
                let got = fused.grads[i].as_ref().unwrap();
                let (a, w) = (values(got), values(&want));
                let d = crate::kernels::testing::abs_diff(&a, &w);
                assert!(d < 5e-5, "{arch:?} tied {tied} checkpoint {checkpoint} {name}: differs by {d}");
            }
        }
    }

    /// Keeping the head's logits for the backward changes no gradient: bit for bit the recomputed ones,
    /// over several log-prob chunks, with and without layer recomputation.
    #[test]
    fn kept_logits_give_the_same_gradients_bit_for_bit() {
        let (b, t) = batch();
        for checkpoint in [false, true] {
            let mut m = tiny(Arch::Qwen2, true, true);
            m.options.checkpoint_layers = checkpoint;
            m.options.logprob_chunk_bytes = 97 * 4 * 3; // 3 rows a chunk
            let (l1, g1) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            m.options.keep_logits = true;
            let (l2, g2) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            assert_eq!(l1, l2);
            for (name, (a, k)) in m.names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
                assert_eq!(values(a.as_ref().unwrap()), values(k.as_ref().unwrap()), "checkpoint {checkpoint} {name}");
            }
        }
    }

    /// Flash attention and the score-matrix path give the same loss and gradients, padded and packed,
    /// with and without layer recomputation.
    #[test]
    fn flash_and_matrix_attention_give_the_same_gradients() {
        for arch in [Arch::Qwen3, Arch::Llama] {
            let mut m = tiny(arch, false, true);
            let (b, t) = batch();
            let packed = TokenBatch::packed(&[vec![vec![5, 17, 3], vec![88, 41, 9, 60]], vec![vec![7, 8]]], 0);
            let mut pt = Targets::default();
            for (r, p) in [(0, 1), (0, 2), (0, 4), (0, 5), (0, 6), (1, 1)] {
                pt.push(r, p);
            }
            for (batch, targets) in [(&b, &t), (&packed, &pt)] {
                for (checkpoint, recompute_attention) in [(false, true), (true, true), (true, false)] {
                    m.options.checkpoint_layers = checkpoint;
                    m.options.recompute_attention = recompute_attention;
                    m.options.attention = Attention::Flash;
                    let (l1, g1) = m.forward_backward(batch, targets, &mut weighted_loss).unwrap();
                    m.options.attention = Attention::Matrix;
                    let (l2, g2) = m.forward_backward(batch, targets, &mut weighted_loss).unwrap();
                    assert!((l1 - l2).abs() < 1e-5, "{arch:?}: loss {l1} vs {l2}");
                    for (name, (a, b)) in m.names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
                        let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
                        let d = crate::kernels::testing::abs_diff(&a, &b);
                        let size = b.iter().map(|x| x.abs()).fold(1f32, f32::max);
                        assert!(d < 1e-5 * size, "{arch:?} {name}: flash gradient differs by {d} (of {size})");
                    }
                }
            }
        }
    }

    #[test]
    fn padding_and_packing_do_not_change_logprobs() {
        let m = tiny(Arch::Qwen2, false, false);
        let a = vec![5u32, 17, 3, 88, 41, 9, 60];
        let b = vec![11u32, 2, 90, 33];
        let single = |s: &Vec<u32>| {
            let batch = TokenBatch::padded(std::slice::from_ref(s), 0);
            let mut t = Targets::default();
            (1..s.len()).for_each(|p| t.push(0, p));
            values(&m.token_logprobs(&batch, &t, false).unwrap().narrow(1, 0, 1).unwrap())
        };
        let (la, lb) = (single(&a), single(&b));
        let (pb, pt) = batch();
        let padded = values(&m.token_logprobs(&pb, &pt, false).unwrap().narrow(1, 0, 1).unwrap());
        let packed_batch = TokenBatch::packed(&[vec![a.clone(), b.clone()]], 0);
        let mut t = Targets::default();
        (1..a.len()).for_each(|p| t.push(0, p));
        (a.len() + 1..a.len() + b.len()).for_each(|p| t.push(0, p));
        let packed = values(&m.token_logprobs(&packed_batch, &t, false).unwrap().narrow(1, 0, 1).unwrap());
        let want: Vec<f32> = la.iter().chain(&lb).copied().collect();
        for got in [padded, packed] {
            let d = crate::kernels::testing::abs_diff(&want, &got);
            assert!(d < 1e-5, "differs by {d}");
        }
    }
}
