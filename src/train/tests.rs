use super::dataset::prepare_data;
use super::*;
use std::sync::Mutex;
use tracing_subscriber::layer::SubscriberExt;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn a_gradient_norm_of_zero_for_several_steps_in_a_row_is_said_once() {
    let mut z = ZeroGradients::default();
    let said: Vec<Option<String>> =
        [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0].iter().enumerate().map(|(i, g)| z.observe(i + 1, *g)).collect();
    let at: Vec<usize> = said.iter().enumerate().filter(|(_, w)| w.is_some()).map(|(i, _)| i + 1).collect();
    assert_eq!(at, vec![6]);
    let w = said[5].as_deref().unwrap();
    assert!(w.starts_with("steps 4-6: the gradient norm is 0 for 3 steps in a row"), "{w}");
}

/// A run's length: its epochs (or train.max_steps), counted from its state; after a resume on other data
/// restarted an epoch, the remaining epochs are the new data's.
#[test]
fn the_step_plan_counts_the_remaining_epochs_from_the_state() {
    let mut cfg = TrainConfig::parse(
        "[model]\npath = \"m\"\n[data]\ninputs = [\"x.jsonl\"]\n[train]\nbatch_questions = 2\nepochs = 2\n",
        Path::new("c.toml"),
        &[],
    )
    .unwrap();
    let at = |step, epoch, batch_in_epoch| TrainerState { step, epoch, batch_in_epoch, ..Default::default() };
    let plan = |cfg: &TrainConfig, n, s: &TrainerState| {
        let p = StepPlan::new(cfg, n, s);
        (p.steps_per_epoch, p.total_steps)
    };
    assert_eq!(plan(&cfg, 10, &at(0, 0, 0)), (5, 10));
    assert_eq!(plan(&cfg, 10, &at(7, 1, 2)), (5, 10), "a state on the same data changes nothing");
    // 4 steps into epoch 0, resumed on 6 groups with epoch 0 restarted: 4 + 2 epochs of 3 steps.
    assert_eq!(plan(&cfg, 6, &at(4, 0, 0)), (3, 10));
    assert_eq!(plan(&cfg, 6, &at(8, 1, 1)), (3, 10), "and so on its later resumes");
    cfg.train.max_steps = 8;
    assert_eq!(plan(&cfg, 6, &at(4, 0, 0)), (3, 8));
    cfg.train.epochs = 0;
    assert_eq!(plan(&cfg, 6, &at(4, 3, 0)), (3, 8));
}

/// A run's config on the bundled data, prepared into `prepared` with answers cut to `max_response` tokens.
fn config(prepared: &Path, max_response: usize) -> TrainConfig {
    let data = root().join("data/trajectories/ot3_math_x8_dev.jsonl");
    let text = format!(
        "[model]\npath = \"m\"\n[data]\ninputs = [\"{}\"]\nmax_response_tokens = {max_response}\nprepared_dir = \"{}\"\n",
        data.display(),
        prepared.display()
    );
    TrainConfig::parse(&text, Path::new("c.toml"), &[]).unwrap()
}

/// The version `CURRENT` names in `prepared`.
fn current(prepared: &Path) -> PathBuf {
    prepared.join(std::fs::read_to_string(prepared.join(data::versions::CURRENT)).unwrap().trim())
}

/// Wait until `prepared` has a current version that a reader holds; that version.
fn wait_for_reader(prepared: &Path) -> PathBuf {
    let t = Instant::now();
    loop {
        if prepared.join(data::versions::CURRENT).exists() {
            let v = current(prepared);
            let readers = std::fs::File::options().read(true).write(true).open(v.join(data::versions::READERS_LOCK));
            if readers.is_ok_and(|f| matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock))) {
                return v;
            }
        }
        assert!(t.elapsed().as_secs() < 300, "rank 0 never read a prepared version");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A tracing layer that calls `hook` at the first event whose message `when` accepts (on the threads
/// whose subscriber it is part of).
struct OnEvent<F> {
    when: fn(&str) -> bool,
    hook: Mutex<Option<F>>,
}

impl<S: tracing::Subscriber, F: FnOnce() + Send + 'static> tracing_subscriber::Layer<S> for OnEvent<F> {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "message" {
                    self.0 = format!("{v:?}");
                }
            }
        }
        let mut m = Message(String::new());
        event.record(&mut m);
        if (self.when)(&m.0) {
            if let Some(hook) = self.hook.lock().unwrap().take() {
                hook();
            }
        }
    }
}

/// Two ranks of a run on one prepared folder: rank 0 prepares it; rank 1 finds that version up to date,
/// and just then (before it opens the data) another run's preparation, with other options, makes its own
/// version current. Rank 1 still reads rank 0's version.
#[test]
fn every_rank_reads_the_version_rank_0_prepared_whatever_current_names_by_then() {
    let dir = tempfile::tempdir().unwrap();
    let prepared = dir.path().join("prepared");
    let model = root().join("data/tokenizers/smollm2");
    let mut ranks = crate::dist::threads::ranks(2).into_iter();
    let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
    let (cfg, m) = (config(&prepared, 16), model.clone());
    let zero = std::thread::spawn(move || prepare_data(&cfg, &m, &AtomicBool::new(false), &r0.world()).unwrap());
    // Rank 1 starts once rank 0's version is current and read.
    let chosen = wait_for_reader(&prepared);
    let (cfg, m) = (config(&prepared, 16), model.clone());
    let (other, m2) = (config(&prepared, 24), model);
    let one = std::thread::spawn(move || {
        let other_run = move || drop(prepare_data(&other, &m2, &AtomicBool::new(false), &World::single()).unwrap());
        let layer = OnEvent {
            when: |m: &str| m.starts_with("data in ") && m.ends_with(" is up to date"),
            hook: Mutex::new(Some(other_run)),
        };
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            prepare_data(&cfg, &m, &AtomicBool::new(false), &r1.world()).unwrap()
        })
    });
    let (d1, d0) = (one.join().unwrap(), zero.join().unwrap());
    assert_ne!(current(&prepared), chosen, "the other run's preparation did not make its version current");
    assert_eq!(d0.dir(), chosen);
    assert_eq!(d1.dir(), chosen, "rank 1 read another version than rank 0's");
    assert_eq!(d1.fingerprint(), d0.fingerprint());
}
