//! Generation ranks (`rollout.generation_ranks`): in a job of several ranks the last ones generate the
//! rollouts with the native engine and the others train, data parallel among themselves.
//!
//! Trainer rank 0 drives the generation ranks with messages that both sides take in one order, so that a
//! blocking send never waits on a rank that is itself sending. With k = `rollout.max_staleness` and a run
//! that starts at step s0 (0, or the step of the checkpoint it resumed from):
//! - first the sampling weights of step s0, then the questions of steps s0..=s0 + k;
//! - after the update that makes policy version v (the end of step v - 1), the trainers take the answers
//!   of every step up to v + k - 1, then rank 0 sends the weights of version v (when the sampling policy
//!   refreshes at v: every step, or every `sync_every`) and the questions of step v + k.
//!
//! So step t's answers come from the sampling policy of step t - k (or later), and with k >= 1 the
//! generation ranks answer step t + k while the trainers train step t. At k = 0 this is generate, then
//! train, in turn. Each generation rank answers its share of a step's questions (question i on the
//! (i mod N)-th generation rank) and sends the scored answers, with the version of the weights it held and
//! their checksum, to every trainer. The behaviour log-probs are those of the weights that wrote the answer,
//! as one process records them, so the clipped ratio is the true off-policy ratio.
//!
//! Weights travel as f32 in buckets of [`BUCKET_BYTES`]: every parameter, or the adapters alone with LoRA.

use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::share::Answer;
use super::{sample_groups, RolloutError, RolloutMetrics, RolloutOptions};
use crate::data::{Group, Response};
use crate::dist::{Roles, World};
use crate::model::{ChatTokenizer, Decoder};

/// The most bytes of weights in one message.
const BUCKET_BYTES: usize = 64 << 20;

/// What trainer rank 0 sends a generation rank.
#[derive(Serialize, Deserialize)]
enum ToGenerator {
    /// The run's model: where its config, weights and tokenizer are.
    Start { model_dir: std::path::PathBuf },
    /// The sampling weights of policy version `version` follow in `buckets` messages: `names`' tensors in
    /// order, as f32, whose bytes hash to `checksum`.
    Weights { version: usize, names: Vec<String>, buckets: usize, checksum: String },
    /// Answer step `step`'s questions (this rank's share of them).
    Request { step: usize, questions: Vec<Question> },
    /// The run is over.
    Stop,
}

/// A question on the wire: a [`Group`] with only the teacher answers a group keeps.
#[derive(Serialize, Deserialize)]
struct Question {
    index: usize,
    question_id: String,
    domain: Option<String>,
    source: Option<String>,
    prompt_tokens: Vec<u32>,
    teacher: Vec<Answer>,
    majority: Option<String>,
    majority_count: usize,
    vote_margin: usize,
}

impl Question {
    fn new(g: &Group, teacher_answers: usize) -> Self {
        Self {
            index: g.index,
            question_id: g.question_id.clone(),
            domain: g.domain.clone(),
            source: g.source.clone(),
            prompt_tokens: g.prompt_tokens.clone(),
            teacher: g.responses.iter().take(teacher_answers).map(Answer::from).collect(),
            majority: g.majority.clone(),
            majority_count: g.majority_count,
            vote_margin: g.vote_margin,
        }
    }

    fn group(self) -> Group {
        Group {
            index: self.index,
            question_id: self.question_id,
            domain: self.domain,
            source: self.source,
            prompt_tokens: self.prompt_tokens,
            responses: self.teacher.into_iter().map(Response::from).collect(),
            majority: self.majority,
            majority_count: self.majority_count,
            vote_margin: self.vote_margin,
        }
    }
}

/// What a generation rank sends every trainer for each request.
#[derive(Serialize, Deserialize)]
struct Reply {
    step: usize,
    /// The policy version of the weights that wrote these answers, and their checksum.
    version: usize,
    checksum: String,
    /// The answers of each of this rank's questions, in order.
    answers: Vec<Vec<Answer>>,
    metrics: RolloutMetrics,
    /// Seconds this rank waited for the trainers since its last reply.
    idle: f64,
}

fn wire(e: impl std::fmt::Display) -> RolloutError {
    RolloutError::Invalid(format!("generation ranks: {e}"))
}

fn send<T: Serialize>(world: &World, to: usize, msg: &T) -> Result<(), RolloutError> {
    let bytes = serde_json::to_vec(msg).map_err(wire)?;
    world.send_bytes(to, &bytes).map_err(wire)
}

fn recv<T: for<'de> Deserialize<'de>>(world: &World, from: usize) -> Result<T, RolloutError> {
    let bytes = world.recv_bytes(from).map_err(wire)?;
    serde_json::from_slice(&bytes).map_err(|e| wire(format!("a message from rank {from} does not decode: {e}")))
}

/// The f32 bytes of `tensors`, in buckets of about [`BUCKET_BYTES`], and their checksum.
fn buckets(tensors: &[Tensor]) -> Result<(Vec<Vec<u8>>, String), RolloutError> {
    let mut out = vec![Vec::new()];
    let mut hash = crate::checksum::ChunkedHash::default();
    for t in tensors {
        let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        hash.update(&bytes);
        let last = out.last_mut().expect("a bucket");
        if !last.is_empty() && last.len() + bytes.len() > BUCKET_BYTES {
            out.push(bytes);
        } else {
            last.extend_from_slice(&bytes);
        }
    }
    Ok((out, hash.finish()))
}

/// The checksum of `tensors` as [`buckets`] computes it.
fn checksum(tensors: &[Tensor]) -> Result<String, RolloutError> {
    Ok(buckets(tensors)?.1)
}

/// A step's answers as they arrived: scored groups, metrics, and each answer's policy version.
struct Arrived {
    groups: Vec<Group>,
    metrics: RolloutMetrics,
    /// Per group, per answer: the version of the weights that wrote it.
    versions: Vec<Vec<usize>>,
    generator_idle: f64,
}

/// The trainers' end of the generation ranks (see the module's documentation).
pub(super) struct Remote {
    /// The job's world (every rank, generators included).
    world: Rc<World>,
    roles: Roles,
    teacher_answers: usize,
    staleness: usize,
    /// Steps between refreshes of the sampling policy.
    every: usize,
    total_steps: usize,
    /// Steps below this were requested.
    requested: usize,
    /// Steps below this were received.
    received: usize,
    /// The questions of steps requested and not yet received.
    pending: BTreeMap<usize, Vec<Group>>,
    arrived: BTreeMap<usize, Arrived>,
    /// The checksum sent with each version of the weights still in flight.
    sent: BTreeMap<usize, String>,
    started: bool,
    /// Seconds the trainers waited for answers, and spent sending weights, since the last step.
    idle: f64,
    sync_time: f64,
}

/// The overlap of generation and training in one step (`rollout/*` of metrics.jsonl).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OverlapMetrics {
    /// The answers trained on by their lag: entry i counts those written by the sampling policy of i
    /// updates ago.
    #[serde(rename = "rollout/staleness")]
    pub staleness: Vec<usize>,
    /// Their mean lag.
    #[serde(rename = "rollout/staleness_mean")]
    pub staleness_mean: f64,
    /// Answers dropped for being older than rollout.max_staleness (+ sync_every - 1) allows.
    #[serde(rename = "rollout/dropped_stale")]
    pub dropped: usize,
    /// Seconds of the step's updates.
    #[serde(rename = "rollout/train_time")]
    pub train_time: f64,
    /// Seconds the trainer waited for answers.
    #[serde(rename = "rollout/trainer_idle")]
    pub trainer_idle: f64,
    /// Seconds the (slowest) generation rank waited for questions or weights before this step's batch.
    #[serde(rename = "rollout/generator_idle")]
    pub generator_idle: f64,
    /// Seconds spent sending the weights to the generation ranks.
    #[serde(rename = "rollout/weight_sync_time")]
    pub weight_sync_time: f64,
}

impl OverlapMetrics {
    /// The metrics of a step's answers of lags `staleness` (a histogram), `dropped` answers, the trainer
    /// and the generator idle so many seconds.
    pub(super) fn new(staleness: Vec<usize>, dropped: usize, trainer_idle: f64, generator_idle: f64) -> Self {
        let lags: usize = staleness.iter().enumerate().map(|(lag, n)| lag * n).sum();
        let kept: usize = staleness.iter().sum();
        Self {
            staleness_mean: lags as f64 / kept.max(1) as f64,
            staleness,
            dropped,
            train_time: 0.0,
            trainer_idle,
            generator_idle,
            weight_sync_time: 0.0,
        }
    }
}

impl Remote {
    /// The trainers' end, in `world` split by `roles`, of a run of `total_steps` steps.
    pub(super) fn new(world: Rc<World>, roles: Roles, options: &RolloutOptions, total_steps: usize) -> Self {
        Self {
            world,
            roles,
            teacher_answers: options.teacher_answers,
            staleness: options.max_staleness,
            every: options.refresh_every(),
            total_steps,
            requested: 0,
            received: 0,
            pending: BTreeMap::new(),
            arrived: BTreeMap::new(),
            sent: BTreeMap::new(),
            started: false,
            idle: 0.0,
            sync_time: 0.0,
        }
    }

    fn primary(&self) -> bool {
        self.world.rank() == 0
    }

    /// Tell the generation ranks which model the run trains (rank 0; the others have nothing to say).
    pub(super) fn announce(&self, model_dir: &std::path::Path) -> Result<(), RolloutError> {
        if self.primary() {
            for &g in &self.roles.generators {
                send(&self.world, g, &ToGenerator::Start { model_dir: model_dir.to_path_buf() })?;
            }
        }
        Ok(())
    }

    /// Step `step`'s answers, the first call sending the weights `sampler` (its sampling policy) and the
    /// first requests (`questions_at(s)`: the questions of step s).
    pub(super) fn take(
        &mut self,
        step: usize,
        sampler: &Decoder,
        questions_at: &mut dyn FnMut(usize) -> Result<Vec<Group>, RolloutError>,
    ) -> Result<(Vec<Group>, RolloutMetrics, OverlapMetrics), RolloutError> {
        if !self.started {
            self.started = true;
            (self.requested, self.received) = (step, step);
            let version = if self.every > 1 { step - step % self.every } else { step };
            self.send_weights(version, sampler)?;
            for s in step..=(step + self.staleness).min(self.total_steps.saturating_sub(1)) {
                self.request(s, questions_at(s)?)?;
            }
        }
        self.receive_through(step)?;
        let a = self.arrived.remove(&step).ok_or_else(|| wire(format!("no answers for step {step}")))?;
        let (groups, staleness, dropped) =
            keep_fresh(step, a.groups, &a.versions, super::k_bound_of(self.staleness, self.every));
        let mut overlap = OverlapMetrics::new(staleness, dropped, std::mem::take(&mut self.idle), a.generator_idle);
        overlap.weight_sync_time = std::mem::take(&mut self.sync_time);
        Ok((groups, a.metrics, overlap))
    }

    /// After the update that made policy version `version`: the answers of every step up to
    /// `version + k - 1` taken in, then (rank 0) the weights `refreshed` when the sampling policy refreshed
    /// at `version`, and the questions of step `version + k`.
    pub(super) fn updated(
        &mut self,
        version: usize,
        refreshed: Option<&Decoder>,
        questions_at: &mut dyn FnMut(usize) -> Result<Vec<Group>, RolloutError>,
    ) -> Result<(), RolloutError> {
        if let Some(last) = (version + self.staleness).checked_sub(1) {
            self.receive_through(last.min(self.total_steps.saturating_sub(1)))?;
        }
        let next = version + self.staleness;
        if next < self.total_steps && next >= self.requested {
            if let Some(w) = refreshed {
                self.send_weights(version, w)?;
            }
            self.request(next, questions_at(next)?)?;
        }
        Ok(())
    }

    /// The end of the run (or of this segment of it): the answers still in flight taken in and dropped (a
    /// resumed run asks for them again), and the generation ranks told to stop.
    pub(super) fn finish(&mut self) -> Result<(), RolloutError> {
        if self.requested > 0 {
            self.receive_through(self.requested - 1)?;
        }
        if self.primary() {
            for &g in &self.roles.generators {
                send(&self.world, g, &ToGenerator::Stop)?;
            }
        }
        Ok(())
    }

    fn send_weights(&mut self, version: usize, sampler: &Decoder) -> Result<(), RolloutError> {
        let t = Instant::now();
        let (names, tensors): (Vec<String>, Vec<Tensor>) = sampler.state_tensors().into_iter().unzip();
        let (buckets, checksum) = buckets(&tensors)?;
        if self.primary() {
            for &g in &self.roles.generators {
                let head = ToGenerator::Weights {
                    version,
                    names: names.clone(),
                    buckets: buckets.len(),
                    checksum: checksum.clone(),
                };
                send(&self.world, g, &head)?;
                for b in &buckets {
                    self.world.send_bytes(g, b).map_err(wire)?;
                }
            }
        }
        let bytes: usize = buckets.iter().map(Vec::len).sum();
        tracing::debug!(
            "generation ranks: sent the weights of version {version}: {} tensors, {bytes} bytes ({checksum})",
            names.len()
        );
        self.sent.insert(version, checksum);
        self.sync_time += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn request(&mut self, step: usize, questions: Vec<Group>) -> Result<(), RolloutError> {
        if self.primary() {
            let n = self.roles.generators.len();
            for (j, &g) in self.roles.generators.iter().enumerate() {
                let mine = questions.iter().enumerate().filter(|(i, _)| i % n == j);
                let questions = mine.map(|(_, q)| Question::new(q, self.teacher_answers)).collect();
                send(&self.world, g, &ToGenerator::Request { step, questions })?;
            }
        }
        self.pending.insert(step, questions);
        self.requested = step + 1;
        Ok(())
    }

    /// Receive every generation rank's answers of the steps up to `last`.
    fn receive_through(&mut self, last: usize) -> Result<(), RolloutError> {
        while self.received <= last && self.received < self.requested {
            let step = self.received;
            let t = Instant::now();
            let replies: Vec<Reply> =
                self.roles.generators.iter().map(|&g| recv(&self.world, g)).collect::<Result<_, _>>()?;
            self.idle += t.elapsed().as_secs_f64();
            let questions = self.pending.remove(&step).ok_or_else(|| wire(format!("step {step} was not asked")))?;
            let arrived = self.assemble(step, &questions, replies)?;
            self.arrived.insert(step, arrived);
            self.received += 1;
        }
        Ok(())
    }

    /// Step `step`'s groups from each generation rank's reply, checking each reply's step and weights.
    fn assemble(&mut self, step: usize, questions: &[Group], replies: Vec<Reply>) -> Result<Arrived, RolloutError> {
        let mut shares = Vec::with_capacity(replies.len());
        let (mut metrics, mut idle) = (Vec::new(), 0f64);
        let mut held = Vec::new();
        for (reply, &rank) in replies.into_iter().zip(&self.roles.generators) {
            if reply.step != step {
                return Err(wire(format!("rank {rank} answered step {} where step {step} was due", reply.step)));
            }
            match self.sent.get(&reply.version) {
                Some(c) if *c == reply.checksum => {}
                Some(c) => {
                    return Err(wire(format!(
                        "rank {rank} holds weights of version {} whose checksum {} differs from the {c} sent",
                        reply.version, reply.checksum
                    )))
                }
                None => {
                    return Err(wire(format!(
                        "rank {rank} answered with weights of version {} never sent",
                        reply.version
                    )))
                }
            }
            tracing::debug!(
                "generation rank {rank} answered step {step} with version {} (checksum as sent)",
                reply.version
            );
            held.push(reply.version);
            idle = idle.max(reply.idle);
            metrics.push(reply.metrics);
            shares.push(reply.answers);
        }
        // Versions older than every generator's current one are no longer needed.
        if let Some(&oldest) = held.iter().min() {
            self.sent.retain(|&v, _| v >= oldest);
        }
        let n = shares.len();
        let groups = super::share::assemble(questions, shares)?;
        let versions = groups.iter().enumerate().map(|(i, g)| vec![held[i % n]; g.responses.len()]).collect();
        let metrics = RolloutMetrics::over_ranks(metrics.iter());
        Ok(Arrived { groups, metrics, versions, generator_idle: idle })
    }
}

/// The answers of step `step`'s groups whose lag (step - version) is at most `bound`: the groups kept (a
/// group left with fewer than two answers is dropped whole), the lag histogram of the answers kept, and
/// how many answers were dropped. Teacher answers (beyond `versions`' entries) are never stale.
pub(super) fn keep_fresh(
    step: usize,
    groups: Vec<Group>,
    versions: &[Vec<usize>],
    bound: usize,
) -> (Vec<Group>, Vec<usize>, usize) {
    let mut hist = vec![0usize; bound + 1];
    let mut dropped = 0;
    let mut out = Vec::with_capacity(groups.len());
    for (mut g, v) in groups.into_iter().zip(versions) {
        let mut keep = Vec::with_capacity(g.responses.len());
        let mut lags = Vec::with_capacity(g.responses.len());
        for (j, r) in g.responses.into_iter().enumerate() {
            let lag = v.get(j).map_or(0, |&version| step.saturating_sub(version));
            if lag > bound {
                dropped += 1;
            } else {
                lags.push(lag);
                keep.push(r);
            }
        }
        if keep.len() < 2 {
            dropped += keep.len();
            continue;
        }
        lags.iter().for_each(|&lag| hist[lag] += 1);
        g.responses = keep;
        out.push(g);
    }
    (out, hist, dropped)
}

/// Tell the generation ranks of `roles` that the run ends before it began (one already complete): trainer
/// rank 0 of `world` only.
pub fn stop_generation(world: &World, roles: &Roles) -> Result<(), RolloutError> {
    if world.rank() == 0 {
        for &g in &roles.generators {
            send(world, g, &ToGenerator::Stop)?;
        }
    }
    Ok(())
}

/// A generation rank's work: load the run's model when trainer rank 0 names it, then answer each request
/// with the weights last received, until told to stop. `load(model_dir)` gives the sampling policy (the
/// run's starting policy, whose weights the first message replaces) and its tokenizer. Returns the
/// batches answered.
pub fn serve_generation(
    world: &World,
    roles: &Roles,
    options: &RolloutOptions,
    seed: u64,
    micro: usize,
    load: impl FnOnce(&std::path::Path) -> Result<(Decoder, ChatTokenizer), RolloutError>,
) -> Result<usize, RolloutError> {
    let me =
        roles.generator_index(world.rank()).ok_or_else(|| wire(format!("rank {} does not generate", world.rank())))?;
    let model_dir = match recv(world, 0)? {
        ToGenerator::Start { model_dir } => model_dir,
        ToGenerator::Stop => return Ok(0), // a run that was already complete
        _ => return Err(wire("trainer rank 0 did not start with the model")),
    };
    let (sampler, tok) = load(&model_dir)?;
    tracing::info!(
        "generation rank {} ({} of {}): serving {}",
        world.rank(),
        me + 1,
        roles.generators.len(),
        model_dir.display()
    );
    let (mut version, mut held) = (None, String::new());
    let (mut batches, mut idle, mut waiting) = (0usize, 0f64, Instant::now());
    loop {
        let msg: ToGenerator = recv(world, 0)?;
        idle += waiting.elapsed().as_secs_f64();
        match msg {
            ToGenerator::Start { .. } => return Err(wire("trainer rank 0 started twice")),
            ToGenerator::Stop => return Ok(batches),
            ToGenerator::Weights { version: v, names, buckets, checksum: sent } => {
                held = load_weights(world, &sampler, &names, buckets)?;
                if held != sent {
                    return Err(wire(format!(
                        "rank {}: the weights of version {v} hash to {held} here, {sent} on the trainer",
                        world.rank()
                    )));
                }
                version = Some(v);
            }
            ToGenerator::Request { step, questions } => {
                let v = version.ok_or_else(|| wire("a request came before any weights"))?;
                let questions: Vec<Group> = questions.into_iter().map(Question::group).collect();
                let params = options.sampling(seed, step);
                let (groups, metrics) = if questions.is_empty() {
                    (Vec::new(), RolloutMetrics::default())
                } else {
                    sample_groups(&sampler, &tok, &questions, options, &params, micro)?
                };
                crate::device::release_pool(sampler.device())?;
                let answers = groups.iter().map(|g| g.responses.iter().map(Answer::from).collect()).collect();
                let reply = Reply { step, version: v, checksum: held.clone(), answers, metrics, idle };
                for &t in &roles.trainers {
                    send(world, t, &reply)?;
                }
                (batches, idle) = (batches + 1, 0.0);
            }
        }
        waiting = Instant::now();
    }
}

/// Receive `buckets` messages of f32 weights into `sampler`'s parameters `names` (in that order); the
/// checksum of what it now holds.
fn load_weights(world: &World, sampler: &Decoder, names: &[String], buckets: usize) -> Result<String, RolloutError> {
    let vars: BTreeMap<String, &candle_core::Var> = sampler.trainable_names().into_iter().zip(sampler.vars()).collect();
    if vars.len() != names.len() || names.iter().any(|n| !vars.contains_key(n)) {
        return Err(wire(format!(
            "the trainer sends {} tensors ({}...), this rank's model trains {}",
            names.len(),
            names.first().map_or("", String::as_str),
            vars.len()
        )));
    }
    let mut bytes = Vec::new();
    for _ in 0..buckets {
        bytes.extend_from_slice(&world.recv_bytes(0).map_err(wire)?);
    }
    let mut at = 0usize;
    let mut held = Vec::with_capacity(names.len());
    for name in names {
        let var = vars[name];
        let n = var.elem_count();
        let piece = bytes.get(at * 4..(at + n) * 4).ok_or_else(|| wire(format!("the weights end before {name}")))?;
        let values: Vec<f32> = piece.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let t = Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?;
        var.set(&t)?;
        held.push(var.as_detached_tensor());
        at += n;
    }
    if at * 4 != bytes.len() {
        return Err(wire(format!("{} bytes of weights left over", bytes.len() - at * 4)));
    }
    checksum(&held)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(i: usize, answers: usize) -> Group {
        Group {
            index: i,
            question_id: format!("q{i}"),
            domain: None,
            source: None,
            prompt_tokens: vec![1, 2],
            responses: (0..answers)
                .map(|j| Response {
                    tokens: vec![j as u32],
                    reward: j as f32,
                    answer: None,
                    truncated: false,
                    teacher_logprobs: None,
                    is_weights: None,
                })
                .collect(),
            majority: None,
            majority_count: 0,
            vote_margin: 0,
        }
    }

    #[test]
    fn answers_older_than_the_bound_are_dropped_and_counted() {
        // Step 5, bound 1: versions 5 and 4 are kept (lags 0 and 1), 3 is dropped; the second group keeps
        // one answer only, so it goes whole.
        let groups = vec![group(0, 3), group(1, 2)];
        let versions = vec![vec![5, 4, 3], vec![4, 2]];
        let (kept, hist, dropped) = keep_fresh(5, groups, &versions, 1);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].responses.len(), 2);
        assert_eq!(hist, vec![1, 1]);
        assert_eq!(dropped, 3);
    }

    #[test]
    fn fresh_answers_are_all_kept() {
        let (kept, hist, dropped) = keep_fresh(3, vec![group(0, 4)], &[vec![3, 3, 2, 2]], 2);
        assert_eq!((kept.len(), hist, dropped), (1, vec![2, 2, 0], 0));
    }
}
