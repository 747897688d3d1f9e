//! Progress in the project's style, for library code and commands alike, drawn on stderr: on a terminal an
//! indicatif bar; elsewhere (a log file, SLURM, nohup) the same bar written as a log line when it starts
//! to take a while and then at least every [`LOG_INTERVAL`], so that a long pass (data preparation, the
//! reference pass, validation, evaluation) shows where it is and its ETA in the log. Nothing is drawn
//! when the log shows no info lines (`-q`).

use std::io;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};

/// Without a terminal: the longest time between two progress lines of a running bar (and the time a bar
/// runs before its first line).
pub const LOG_INTERVAL: Duration = Duration::from_secs(30);

/// How often a bar without a terminal is redrawn when nothing moves, so that a slow step still gets its
/// line within [`LOG_INTERVAL`] plus this.
const LOG_TICK: Duration = Duration::from_secs(5);

/// Whether stderr is a terminal (progress as bars) rather than a file or pipe (progress as log lines).
pub fn on_terminal() -> bool {
    use std::io::IsTerminal;
    io::stderr().is_terminal()
}

/// Whether info lines are logged (not `-q`).
fn info_enabled() -> bool {
    tracing::level_filters::LevelFilter::current() >= tracing::level_filters::LevelFilter::INFO
}

/// A bar over `len` items, or a spinner counting items when the total is unknown, labelled `what`: drawn on
/// a terminal, logged as lines elsewhere (see the module documentation).
pub fn progress_bar(len: Option<u64>, what: &str) -> ProgressBar {
    if on_terminal() {
        terminal_bar(len, what)
    } else {
        log_bar(len, what)
    }
}

/// Like [`progress_bar`] but drawn only on a terminal, for a loop that logs its own lines elsewhere.
pub fn terminal_bar(len: Option<u64>, what: &str) -> ProgressBar {
    let template = match len {
        Some(_) => "{spinner} {prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} ({eta}) {msg}",
        None => "{spinner} {prefix} [{elapsed_precise}] {pos} {msg}",
    };
    let target = if on_terminal() && info_enabled() {
        ProgressDrawTarget::stderr_with_hz(4)
    } else {
        ProgressDrawTarget::hidden()
    };
    styled(len, what, template, target)
}

/// Like [`progress_bar`] but never drawn on a terminal: for a pass inside a loop whose own bar is on the
/// screen (validation during training), logged as lines elsewhere.
pub fn log_only_bar(len: Option<u64>, what: &str) -> ProgressBar {
    if on_terminal() {
        ProgressBar::hidden()
    } else {
        log_bar(len, what)
    }
}

/// A bar written as log lines (see [`LogLines`]).
fn log_bar(len: Option<u64>, what: &str) -> ProgressBar {
    let template = match len {
        Some(_) => "{prefix}: {pos}/{len} ({percent}%), elapsed {elapsed_precise}, ETA {eta_precise} {msg}",
        None => "{prefix}: {pos} so far, elapsed {elapsed_precise} {msg}",
    };
    if !info_enabled() {
        return styled(len, what, template, ProgressDrawTarget::hidden());
    }
    let bar = styled(len, what, template, ProgressDrawTarget::term_like_with_hz(Box::new(LogLines::new()), 1));
    bar.enable_steady_tick(LOG_TICK);
    bar
}

fn styled(len: Option<u64>, what: &str, template: &str, target: ProgressDrawTarget) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(len, target);
    bar.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_prefix(what.to_string());
    bar
}

/// Seconds as `1h02m03s`, `2m03s` or `3s` (for log lines).
pub fn duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, sec) => format!("{h}h{m:02}m{sec:02}s"),
    }
}

/// A "terminal" that turns indicatif's drawings into log lines: the text of a drawing is collected until
/// it is flushed, and logged when [`LOG_INTERVAL`] has passed since the bar began or since its last line.
struct LogLines {
    state: Mutex<LogState>,
    /// Where a due line goes (the log).
    emit: Box<dyn Fn(&str) + Send + Sync>,
}

impl std::fmt::Debug for LogLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogLines").field("state", &self.state).finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct LogState {
    text: String,
    last: Instant,
    interval: Duration,
}

impl LogLines {
    fn new() -> Self {
        Self::with(LOG_INTERVAL, Box::new(|line| tracing::info!("{line}")))
    }

    fn with(interval: Duration, emit: Box<dyn Fn(&str) + Send + Sync>) -> Self {
        Self { state: Mutex::new(LogState { text: String::new(), last: Instant::now(), interval }), emit }
    }

    /// The line to log for the drawing just flushed, if it is due.
    fn due_line(&self) -> Option<String> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let line = std::mem::take(&mut s.text).replace('\r', "").trim().to_string();
        if line.is_empty() || s.last.elapsed() < s.interval {
            return None;
        }
        s.last = Instant::now();
        Some(line)
    }
}

impl TermLike for LogLines {
    fn width(&self) -> u16 {
        // Wide enough that a line is never wrapped or cut.
        500
    }

    fn height(&self) -> u16 {
        50
    }

    fn move_cursor_up(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn move_cursor_down(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn move_cursor_right(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn move_cursor_left(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn write_line(&self, s: &str) -> io::Result<()> {
        self.write_str(s)?;
        self.write_str(" ")
    }

    fn write_str(&self, s: &str) -> io::Result<()> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).text.push_str(s);
        Ok(())
    }

    fn clear_line(&self) -> io::Result<()> {
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        if let Some(line) = self.due_line() {
            (self.emit)(&line);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(interval: Duration) -> (LogLines, std::sync::Arc<Mutex<Vec<String>>>) {
        let lines = std::sync::Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        (LogLines::with(interval, Box::new(move |l| sink.lock().unwrap().push(l.to_string()))), lines)
    }

    #[test]
    fn drawings_become_lines_once_per_interval() {
        let (t, _) = collect(Duration::from_millis(200));
        t.write_str("\rscore: 3/10 (30%)").unwrap();
        t.write_str("        ").unwrap();
        // Not yet due: the drawing is dropped, not kept for later.
        assert_eq!(t.due_line(), None);
        std::thread::sleep(Duration::from_millis(250));
        t.write_str("score: 5/10 (50%)   ").unwrap();
        assert_eq!(t.due_line().as_deref(), Some("score: 5/10 (50%)"));
        t.write_str("score: 6/10 (60%)").unwrap();
        assert_eq!(t.due_line(), None, "within the interval of the last line");
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(t.due_line(), None, "an empty drawing (a cleared bar) is no line");
    }

    #[test]
    fn a_bar_drawn_through_the_log_is_its_template_on_one_line() {
        let (t, lines) = collect(Duration::ZERO);
        let bar = styled(
            Some(4),
            "reference log-probs",
            "{prefix}: {pos}/{len} ({percent}%) {msg}",
            ProgressDrawTarget::term_like(Box::new(t)),
        );
        bar.set_message("12 tok/s");
        bar.set_position(1);
        bar.finish();
        let lines = lines.lock().unwrap().clone();
        assert!(lines.contains(&"reference log-probs: 1/4 (25%) 12 tok/s".to_string()), "{lines:?}");
        assert_eq!(lines.last().map(String::as_str), Some("reference log-probs: 4/4 (100%) 12 tok/s"));
    }

    #[test]
    fn durations_read_as_hours_minutes_seconds() {
        assert_eq!(duration(0.4), "0s");
        assert_eq!(duration(59.6), "1m00s");
        assert_eq!(duration(3725.0), "1h02m05s");
    }
}
