//! Rollouts on several ranks: each rank samples the answers of its share of a batch's questions
//! (question i on rank i mod N, the rank that trains on group i), through its own sampler or its own
//! server, and the scored answers are all-gathered so that every rank holds the whole batch: the
//! advantages, the loss normalisers over the global batch and dynamic sampling's filter need every group.
//!
//! Sampling streams are a function of (seed, step, question index, answer index), not of the rank, so N
//! ranks sample the answers one process samples. What travels is each sampled group's answers (tokens,
//! reward, label, behaviour log-probs and importance weights, the f32 values as their bit patterns so
//! that every rank trains on the same numbers) and each rank's rollout metrics; the questions themselves
//! are already on every rank.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use super::{RolloutError, RolloutMetrics};
use crate::data::{Group, Response};
use crate::dist::World;

/// The questions of `questions` that `world`'s rank samples: position i when i mod N is its rank (all of
/// them, borrowed, for one process).
pub(super) fn mine<'a>(world: &World, questions: &'a [Group]) -> Cow<'a, [Group]> {
    if world.size() == 1 {
        return Cow::Borrowed(questions);
    }
    questions.iter().enumerate().filter(|(i, _)| world.owns_group(*i)).map(|(_, g)| g.clone()).collect()
}

/// Every rank's scored groups of its share ([`mine`]) and metrics, gathered into the whole batch's groups
/// in the order of `questions` and the batch's metrics (one process's, but for the sampling time: the
/// slowest rank's, with the ranks' throughputs added).
pub(super) fn gather(
    world: &World,
    questions: &[Group],
    groups: Vec<Group>,
    metrics: RolloutMetrics,
) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
    if world.size() == 1 {
        return Ok((groups, metrics));
    }
    let share =
        Share { answers: groups.iter().map(|g| g.responses.iter().map(Answer::from).collect()).collect(), metrics };
    let bytes = serde_json::to_vec(&share).map_err(|e| RolloutError::Invalid(format!("rollout share: {e}")))?;
    let shares = world
        .all_gather_bytes(&bytes)
        .iter()
        .enumerate()
        .map(|(rank, b)| {
            serde_json::from_slice::<Share>(b)
                .map_err(|e| RolloutError::Invalid(format!("the rollouts of rank {rank} do not decode: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metrics = RolloutMetrics::over_ranks(shares.iter().map(|s| &s.metrics));
    let out = assemble(questions, shares.into_iter().map(|s| s.answers).collect())?;
    Ok((out, metrics))
}

/// The groups of `questions` with the answers of `shares` (share r: the answers of questions r, r + N, ...
/// in order, N the number of shares): question i's from share i mod N.
pub(super) fn assemble(questions: &[Group], shares: Vec<Vec<Vec<Answer>>>) -> Result<Vec<Group>, RolloutError> {
    let mut answers: Vec<_> = shares.into_iter().map(|s| s.into_iter()).collect();
    let n = answers.len();
    let out = questions
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let mine = answers[i % n].next().ok_or_else(|| {
                RolloutError::Invalid(format!("rank {} sent no answers for question {i} of the batch", i % n))
            })?;
            Ok(Group { responses: mine.into_iter().map(Response::from).collect(), ..q.clone() })
        })
        .collect::<Result<Vec<_>, RolloutError>>()?;
    if let Some(rank) = answers.iter_mut().position(|a| a.next().is_some()) {
        return Err(RolloutError::Invalid(format!("rank {rank} sent answers for more questions than it was given")));
    }
    Ok(out)
}

/// What one rank sends: the answers of each of its questions, in order, and its metrics.
#[derive(Serialize, Deserialize)]
struct Share {
    answers: Vec<Vec<Answer>>,
    metrics: RolloutMetrics,
}

/// A [`Response`] on the wire, its f32 values as bit patterns (exact whatever the JSON number formatting).
#[derive(Clone, Serialize, Deserialize)]
pub(super) struct Answer {
    tokens: Vec<u32>,
    reward: u32,
    answer: Option<String>,
    truncated: bool,
    teacher_logprobs: Option<Vec<u32>>,
    is_weights: Option<Vec<u32>>,
}

fn bits(v: &Option<Vec<f32>>) -> Option<Vec<u32>> {
    v.as_ref().map(|v| v.iter().map(|x| x.to_bits()).collect())
}

fn floats(v: Option<Vec<u32>>) -> Option<Vec<f32>> {
    v.map(|v| v.into_iter().map(f32::from_bits).collect())
}

impl From<&Response> for Answer {
    fn from(r: &Response) -> Self {
        Self {
            tokens: r.tokens.clone(),
            reward: r.reward.to_bits(),
            answer: r.answer.clone(),
            truncated: r.truncated,
            teacher_logprobs: bits(&r.teacher_logprobs),
            is_weights: bits(&r.is_weights),
        }
    }
}

impl From<Answer> for Response {
    fn from(a: Answer) -> Self {
        Self {
            tokens: a.tokens,
            reward: f32::from_bits(a.reward),
            answer: a.answer,
            truncated: a.truncated,
            teacher_logprobs: floats(a.teacher_logprobs),
            is_weights: floats(a.is_weights),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(x: f32) -> Response {
        Response {
            tokens: vec![1, 2, 3],
            reward: x,
            answer: Some("4".into()),
            truncated: true,
            teacher_logprobs: Some(vec![x, -x / 3.0, f32::MIN_POSITIVE, -0.0]),
            is_weights: None,
        }
    }

    #[test]
    fn answers_cross_the_wire_bit_for_bit() {
        for x in [0.1f32, 1.0 / 3.0, -7.123_456_7e-12, f32::MAX] {
            let r = response(x);
            let json = serde_json::to_vec(&Answer::from(&r)).unwrap();
            let back = Response::from(serde_json::from_slice::<Answer>(&json).unwrap());
            assert_eq!(back, r);
            let lp = back.teacher_logprobs.unwrap();
            assert!(lp[3].is_sign_negative(), "-0 keeps its sign");
        }
    }

    #[test]
    fn one_rank_keeps_its_groups_and_samples_every_question() {
        let world = World::single();
        let g = Group {
            index: 7,
            question_id: "q".into(),
            domain: None,
            source: None,
            prompt_tokens: vec![5, 6],
            responses: vec![response(1.0)],
            majority: Some("4".into()),
            majority_count: 1,
            vote_margin: 1,
        };
        assert_eq!(mine(&world, std::slice::from_ref(&g)).len(), 1);
        let m = RolloutMetrics { answers: 1, ..RolloutMetrics::default() };
        let (groups, metrics) = gather(&world, std::slice::from_ref(&g), vec![g.clone()], m.clone()).unwrap();
        assert_eq!((groups, metrics), (vec![g], m));
    }
}
