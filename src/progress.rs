//! Progress bars in the project's style, for library code and commands alike (drawn on stderr, hidden when
//! stderr is not a terminal).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar over `len` items, or a spinner counting items when the total is unknown, labelled `what`.
pub fn progress_bar(len: Option<u64>, what: &str) -> ProgressBar {
    let bar = match len {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new_spinner(),
    };
    let template = if len.is_some() {
        "{spinner} {prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} ({eta}) {msg}"
    } else {
        "{spinner} {prefix} [{elapsed_precise}] {pos} {msg}"
    };
    bar.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_prefix(what.to_string());
    bar.set_draw_target(ProgressDrawTarget::stderr_with_hz(4));
    bar
}
