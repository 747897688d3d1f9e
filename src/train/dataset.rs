//! The run's teacher data: prepared once (rank 0) into a versioned folder every rank opens.

use super::*;

/// Where the config's data is prepared.
pub(super) fn prepared_dir(cfg: &TrainConfig) -> PathBuf {
    cfg.data.prepared_dir.clone().unwrap_or_else(|| cfg.train.output_dir.join("prepared"))
}

/// Open, on every rank of `world`, the prepared version that rank 0 prepared or found up to date (`version`
/// on rank 0), whatever `CURRENT` names by the time a rank reads it: the ranks of a run never read different
/// versions.
pub(super) fn open_chosen(prepared_dir: &Path, version: &Path, world: &World) -> Result<PreparedDataset, TrainError> {
    let mine = if world.is_primary() { Some(PreparedDataset::open_version(version)?) } else { None };
    // Its name in the prepared folder ("" for the folder itself, in the single-version layout).
    let name = mine.as_ref().and_then(|d| d.dir().strip_prefix(prepared_dir).ok()).map(|p| p.to_path_buf());
    let name = name.unwrap_or_default().to_string_lossy().into_owned();
    let chosen = String::from_utf8_lossy(&world.all_gather_bytes(name.as_bytes())[0]).into_owned();
    match mine {
        Some(d) => Ok(d),
        None => Ok(PreparedDataset::open_version(&prepared_dir.join(chosen))?),
    }
}

/// Prepare the config's data (once: re-used while inputs, tokenizer and options are unchanged) and open it.
pub(super) fn prepare_data(
    cfg: &TrainConfig,
    model_dir: &Path,
    stop: &AtomicBool,
    world: &World,
) -> Result<PreparedDataset, TrainError> {
    let prepared_dir = prepared_dir(cfg);
    let mut input = cfg.data.input.clone();
    input.group.seed = cfg.train.seed;
    let popts = data::PrepareOptions {
        input,
        sequence: cfg.data.sequence.clone(),
        model: model_dir.to_path_buf(),
        out: prepared_dir.clone(),
        ..Default::default()
    };
    let outcome = data::prepare::prepare_with(&popts, &mut |bad| tracing::warn!("skipped {bad}"), Some(stop))?;
    if outcome.skipped {
        tracing::info!("data in {} is up to date", prepared_dir.display());
    }
    let dataset = open_chosen(&prepared_dir, &outcome.out, world)?;
    // An up-to-date folder's counts are in its stats.json (the message only: unreadable is no error).
    let stats = if outcome.skipped { dataset.stats().ok() } else { Some(outcome.stats) };
    let group = &cfg.data.input.group;
    if dataset.is_empty() {
        return Err(TrainError::Stopped(format!(
            "no training groups in {}: {}",
            prepared_dir.display(),
            stats.map_or("stats.json is unreadable".into(), |s| data_counts(&s, group))
        )));
    }
    let Some(stats) = stats else { return Ok(dataset) };
    tracing::info!("data: {} -> {} training groups", data_counts(&stats, group), stats.groups);
    let small: u64 = stats.group_size_histogram.range(..group.group_size as u64).map(|(_, n)| n).sum();
    if group.group_size > 0 && small > 0 {
        tracing::warn!(
            "{small} of {} groups have fewer than data.group_size = {} answers and are trained on as they are \
             (only groups under data.min_group_size = {} are dropped)",
            stats.groups,
            group.group_size,
            group.min_group_size
        );
    }
    Ok(dataset)
}

/// The groups the run's batches come from: the prepared teacher data, or the questions of
/// `rollout.questions`.
pub(super) fn open_groups(
    cfg: &TrainConfig,
    model_dir: &Path,
    stop: &AtomicBool,
    world: &World,
) -> Result<GroupSource, TrainError> {
    match cfg.rollout.as_ref().and_then(|r| r.questions.as_ref().map(|q| (r, q))) {
        Some((r, path)) => {
            let tok = ChatTokenizer::load(model_dir).map_err(ModelError::from)?;
            let seq = &cfg.data.sequence;
            let system = seq.system_prompt.as_deref();
            let questions =
                crate::rollout::load_questions(path, &r.prompt_template, &tok, system, seq.max_prompt_tokens)?;
            Ok(GroupSource::Questions(questions))
        }
        None => Ok(GroupSource::Prepared(prepare_data(cfg, model_dir, stop, world)?)),
    }
}

/// What preparation read and what each of its rules left out, from its counts (why N questions became M
/// groups, or none).
pub(super) fn data_counts(s: &data::Stats, group: &data::GroupOptions) -> String {
    if s.rows_read == 0 {
        return "the inputs have no rows".into();
    }
    let mut why = vec![format!("{} rows read", s.rows_read)];
    let add = |why: &mut Vec<String>, n: u64, what: String| {
        if n > 0 {
            why.push(format!("{n} {what}"));
        }
    };
    let reasons: Vec<String> = s.skipped_by_reason.iter().map(|(r, n)| format!("{r}: {n}")).collect();
    add(&mut why, s.rows_skipped, format!("skipped ({})", reasons.join(", ")));
    add(&mut why, s.rows_filtered, "left out by data.domains / data.sources".into());
    why.push(format!("{} questions", s.questions));
    let min = group.min_group_size.max(1);
    add(&mut why, s.groups_dropped_small, format!("with fewer than data.min_group_size = {min} answers"));
    add(&mut why, s.groups_dropped_long_prompt, "with a prompt over data.max_prompt_tokens".into());
    add(&mut why, s.groups_dropped_tie, "with a tied vote (data.ties = \"drop\")".into());
    let margin = format!("with a vote margin under data.min_vote_margin = {}", group.min_vote_margin);
    add(&mut why, s.groups_dropped_margin, margin);
    add(&mut why, s.groups_not_sampled, "left out of the data.max_questions sample".into());
    why.join(", ")
}
