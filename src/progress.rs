//! Progress in the project's style, for library code and commands alike, drawn on stderr: on a terminal an
//! indicatif bar; elsewhere (a log file, SLURM, nohup) the same bar written as a log line when it starts
//! to take a while and then at least every [`LOG_INTERVAL`], so that a long pass (data preparation, the
//! reference pass, validation, evaluation) shows where it is and its ETA in the log. Nothing is drawn
//! when the log shows no info lines (`-q`).

use std::io::{self, Write};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike, WeakProgressBar};

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
    if !(on_terminal() && info_enabled()) {
        return styled(len, what, template, ProgressDrawTarget::hidden());
    }
    let bar = styled(len, what, template, ProgressDrawTarget::stderr_with_hz(4));
    on_screen().add(&bar);
    bar
}

/// The bars drawn on a terminal, so that a log line is written above the one being drawn
/// ([`OnScreen::write_above`]) and not after it, which left a stale copy of the bar on the screen.
#[derive(Default)]
struct OnScreen(Mutex<Vec<WeakProgressBar>>);

impl OnScreen {
    fn add(&self, bar: &ProgressBar) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(bar.downgrade());
    }

    /// Run `write` with the newest bar still running cleared from the screen, and draw it again below what
    /// `write` wrote. A finished bar is left where it is: its last drawing is the line that stays.
    fn write_above(&self, write: impl FnOnce()) {
        let running = {
            let mut bars = self.0.lock().unwrap_or_else(|e| e.into_inner());
            bars.retain(|b| b.upgrade().is_some_and(|b| !b.is_finished()));
            bars.last().and_then(WeakProgressBar::upgrade)
        };
        match running {
            Some(bar) => bar.suspend(write),
            None => write(),
        }
    }
}

fn on_screen() -> &'static OnScreen {
    static BARS: OnceLock<OnScreen> = OnceLock::new();
    BARS.get_or_init(OnScreen::default)
}

/// The writer of the log's lines (`tracing_subscriber`'s `with_writer(progress::log_writer)`): each event
/// is collected and written to stderr in one piece when it ends, above a bar on a terminal. (Never log
/// from inside `ProgressBar::suspend`: the bar is held there.)
pub fn log_writer() -> LogWriter {
    LogWriter(Vec::new())
}

/// One log event on its way to stderr (see [`log_writer`]).
pub struct LogWriter(Vec<u8>);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let text = std::mem::take(&mut self.0);
        // A log line that cannot be written has nowhere else to go.
        let write = || drop(io::stderr().lock().write_all(&text));
        on_screen().write_above(write);
    }
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

/// `n` and a noun in its number: `1 problem`, `2 problems`, `1 micro-batch`, `3 micro-batches`.
pub fn count(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    match n {
        1 => format!("1 {noun}"),
        _ if ["s", "x", "ch", "sh"].iter().any(|e| noun.ends_with(e)) => format!("{n} {noun}es"),
        _ => format!("{n} {noun}s"),
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

    /// A terminal's screen: rows of text and a cursor, moved as indicatif moves it.
    #[derive(Debug, Default)]
    struct Screen {
        rows: Vec<String>,
        row: usize,
    }

    #[derive(Debug, Clone, Default)]
    struct VirtualTerm(std::sync::Arc<Mutex<Screen>>);

    impl VirtualTerm {
        fn edit(&self, f: impl FnOnce(&mut Screen)) {
            let mut s = self.0.lock().unwrap();
            let row = s.row;
            if s.rows.len() <= row {
                s.rows.resize(row + 1, String::new());
            }
            f(&mut s);
        }

        fn rows(&self) -> Vec<String> {
            let s = self.0.lock().unwrap();
            s.rows.iter().map(|r| r.trim_end().to_string()).filter(|r| !r.is_empty()).collect()
        }
    }

    impl TermLike for VirtualTerm {
        fn width(&self) -> u16 {
            80
        }
        fn height(&self) -> u16 {
            24
        }
        fn move_cursor_up(&self, n: usize) -> io::Result<()> {
            self.edit(|s| s.row = s.row.saturating_sub(n));
            Ok(())
        }
        fn move_cursor_down(&self, n: usize) -> io::Result<()> {
            self.edit(|s| s.row += n);
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn write_line(&self, line: &str) -> io::Result<()> {
            self.write_str(line)?;
            self.edit(|s| s.row += 1);
            Ok(())
        }
        fn write_str(&self, text: &str) -> io::Result<()> {
            // A character past the last column goes to the next row, as a terminal wraps it: indicatif
            // fills a bar's last line to the width so that what is written next starts a row of its own.
            for c in text.chars() {
                self.edit(|s| match c {
                    '\n' => s.row += 1,
                    '\r' => {}
                    _ => {
                        if s.rows[s.row].chars().count() >= 80 {
                            s.row += 1;
                            s.rows.resize(s.rows.len().max(s.row + 1), String::new());
                        }
                        let row = s.row;
                        s.rows[row].push(c);
                    }
                });
            }
            Ok(())
        }
        fn clear_line(&self) -> io::Result<()> {
            self.edit(|s| {
                let row = s.row;
                s.rows[row].clear()
            });
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn log_lines_go_above_the_bars_and_leave_no_stale_bar() {
        let term = VirtualTerm::default();
        let screen = OnScreen::default();
        let target = ProgressDrawTarget::term_like(Box::new(term.clone()));
        let bar = styled(Some(8), "train", "{prefix} {pos}/{len} {msg}", target);
        screen.add(&bar);
        bar.tick();
        assert_eq!(term.rows(), ["train 0/8"]);
        // What a LogWriter does with an event.
        screen.write_above(|| term.write_str("INFO checkpoint written\n").unwrap());
        assert_eq!(term.rows(), ["INFO checkpoint written", "train 0/8"]);
        bar.set_position(8);
        bar.finish();
        screen.write_above(|| term.write_str("INFO done\n").unwrap());
        drop(bar);
        screen.write_above(|| term.write_str("INFO summary\n").unwrap());
        assert_eq!(term.rows(), ["INFO checkpoint written", "train 8/8", "INFO done", "INFO summary"]);
    }

    #[test]
    fn a_count_names_its_noun_in_its_number() {
        assert_eq!(count(1u32, "micro-batch"), "1 micro-batch");
        assert_eq!(count(3u32, "micro-batch"), "3 micro-batches");
        assert_eq!(count(0u32, "problem"), "0 problems");
        assert_eq!(count(1u32, "problem"), "1 problem");
        assert_eq!(count(2u32, "sample"), "2 samples");
    }

    #[test]
    fn durations_read_as_hours_minutes_seconds() {
        assert_eq!(duration(0.4), "0s");
        assert_eq!(duration(59.6), "1m00s");
        assert_eq!(duration(3725.0), "1h02m05s");
    }
}
