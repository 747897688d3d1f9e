//! Where a run's questions come from: the prepared teacher data (questions, labels, teacher answers), or a
//! plain {"problem", "answer"} JSONL file turned into answer-less groups.

use std::path::Path;

use super::RolloutError;
use crate::data::{Group, PreparedDataset};
use crate::model::ChatTokenizer;

/// The groups a run draws its batches from, by index.
pub enum GroupSource {
    /// Prepared teacher data.
    Prepared(PreparedDataset),
    /// Questions without answers; each group's `majority` holds the question's gold answer.
    Questions(Vec<Group>),
}

impl GroupSource {
    pub fn len(&self) -> usize {
        match self {
            GroupSource::Prepared(d) => d.len(),
            GroupSource::Questions(q) => q.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Group `i` (0 <= i < len).
    pub fn group(&self, i: usize) -> Result<Group, crate::data::DataError> {
        match self {
            GroupSource::Prepared(d) => d.group(i),
            GroupSource::Questions(q) => Ok(q[i].clone()),
        }
    }
}

/// The questions of a {"problem", "answer"} JSONL file as groups with no answers: the prompt is
/// `template` with `{problem}` replaced, rendered as a user turn (after `system`) with the chat template;
/// the gold answer is kept as the group's label. Questions whose prompt has more than `max_prompt_tokens`
/// tokens (0: no limit) are left out with a warning.
pub fn load_questions(
    path: &Path,
    template: &str,
    tok: &ChatTokenizer,
    system: Option<&str>,
    max_prompt_tokens: usize,
) -> Result<Vec<Group>, RolloutError> {
    let bench = crate::eval::benchmarks::load_file(path, template)?;
    let mut groups = Vec::with_capacity(bench.problems.len());
    let mut too_long = 0usize;
    for p in &bench.problems {
        let text = tok.render_prompt(system, &bench.prompt(p))?;
        let prompt_tokens = tok.encode(&text, false)?;
        if max_prompt_tokens > 0 && prompt_tokens.len() > max_prompt_tokens {
            too_long += 1;
            continue;
        }
        groups.push(Group {
            index: groups.len(),
            question_id: crate::data::question_id(crate::data::question_hash(&p.problem)),
            domain: None,
            source: None,
            prompt_tokens,
            responses: Vec::new(),
            majority: Some(p.answer.clone()),
            majority_count: 0,
            vote_margin: 0,
        });
    }
    if too_long > 0 {
        tracing::warn!(
            "{}: {too_long} questions have a prompt over data.max_prompt_tokens = {max_prompt_tokens} and are left out",
            path.display()
        );
    }
    if groups.is_empty() {
        return Err(RolloutError::Invalid(format!("{}: no question to train on", path.display())));
    }
    Ok(groups)
}
