//! A rollout server kept busy (`[rollout.server]` with `rollout.max_staleness = k >= 1`): the requests of
//! the next k steps stay in flight, each step's on a thread of its own, while the trainer trains.
//!
//! The order matches the generation ranks' ([`super::remote`]): the run (or a resumed segment) starting at
//! step s0 has the server load the sampling weights of s0 and asks for steps s0..=s0 + k; after the update
//! that makes version v the server reloads (when the sampling policy refreshes at v) and step v + k is
//! asked. Each step's answers are tagged with the version the server held when they were asked for, so
//! step t's come from version t - k or later. The behaviour log-probs are those of the step's own sampling
//! policy (grpo's forward when the answers are scored, as verl recomputes them), so the clipped ratio is
//! on-policy at the first update and the lag is what rollout.importance_sampling_correction corrects,
//! from the server's own log-probs. A resumed run asks again for what was in flight; with a server whose
//! answers depend only on the request it trains as the uninterrupted run.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::server::{self, ServerBatch};
use super::RolloutError;
use crate::data::Group;
use crate::eval::{EngineOptions, SamplingParams};
use crate::model::ChatTokenizer;

/// One step's requests in flight.
struct InFlight {
    step: usize,
    /// The version of the weights the server held when they were sent.
    version: usize,
    /// This rank's share of the step's questions (shared with the requests' thread), and the whole step's.
    mine: Arc<Vec<Group>>,
    questions: Vec<Group>,
    /// The answers and how long the server took to give them.
    answers: JoinHandle<Result<(ServerBatch, Duration), RolloutError>>,
}

/// A step's answers back from the server.
pub(super) struct Answered {
    pub version: usize,
    pub mine: Arc<Vec<Group>>,
    pub questions: Vec<Group>,
    pub batch: ServerBatch,
    /// An instant as long before now as the server took: where the generation's time starts.
    pub asked: Instant,
}

/// The requests in flight and the server's weights (see the module's documentation).
#[derive(Default)]
pub(super) struct Ahead {
    inflight: VecDeque<InFlight>,
    /// Steps below this were asked for.
    pub next: usize,
    /// The version the server holds.
    pub version: usize,
    pub started: bool,
    /// Since when no request has been in flight (the server idle), and the seconds of it since the last step.
    idle_since: Option<Instant>,
    pub server_idle: f64,
}

impl Ahead {
    /// Ask the server (`server`, this rank's) for step `step`'s answers to `mine` (this rank's share of
    /// `questions`) on a thread: `counts` = (sampled answers, n, log-probs wanted).
    #[allow(clippy::too_many_arguments)]
    pub fn ask(
        &mut self,
        server: EngineOptions,
        tok: Arc<ChatTokenizer>,
        step: usize,
        mine: Arc<Vec<Group>>,
        questions: Vec<Group>,
        counts: (usize, usize, bool),
        params: SamplingParams,
    ) {
        if let Some(since) = self.idle_since.take() {
            self.server_idle += since.elapsed().as_secs_f64();
        }
        let share = Arc::clone(&mine);
        let answers = std::thread::spawn(move || {
            let (bar, t) = (indicatif::ProgressBar::hidden(), Instant::now());
            server::server_samples(&server, &tok, &share, counts, &params, &bar).map(|b| (b, t.elapsed()))
        });
        let version = self.version;
        self.inflight.push_back(InFlight { step, version, mine, questions, answers });
        self.next = step + 1;
    }

    /// Whether step `step`'s answers are in (or failed).
    pub fn ready(&self, step: usize) -> bool {
        self.inflight.iter().find(|f| f.step == step).is_none_or(|f| f.answers.is_finished())
    }

    /// Step `step`'s answers (the oldest in flight), waiting for them.
    pub fn take(&mut self, step: usize) -> Result<Answered, RolloutError> {
        let f = match self.inflight.front() {
            Some(f) if f.step == step => self.inflight.pop_front().expect("a step in flight"),
            Some(f) => return Err(RolloutError::Invalid(format!("step {step} taken while step {} is due", f.step))),
            None => return Err(RolloutError::Invalid(format!("step {step} was never asked of the server"))),
        };
        let (batch, took) = f.answers.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        let now = Instant::now();
        if self.inflight.is_empty() {
            self.idle_since = Some(now);
        }
        let asked = now.checked_sub(took).unwrap_or(now);
        Ok(Answered { version: f.version, mine: f.mine, questions: f.questions, batch, asked })
    }
}
