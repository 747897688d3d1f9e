//! Figures drawn with plotters: the font every figure uses, and the training curves of run folders
//! ([`curves`]).

pub mod curves;

pub use curves::{draw_curves, draw_run_curves, refresh_run_curves, CurveOptions, PlotError};

/// DejaVu Sans (data/fonts, free licence), bundled so that plots work on machines without fonts.
const BUNDLED_FONT: &[u8] = include_bytes!("../../data/fonts/DejaVuSans.ttf");

/// Register the plot font as "sans-serif": `GRPO_FONT` when set, else the bundled DejaVu Sans.
pub fn register_font() -> Result<(), String> {
    use std::sync::OnceLock;
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let bytes: &'static [u8] = match std::env::var("GRPO_FONT") {
            Ok(p) => {
                let b = std::fs::read(&p).map_err(|e| format!("GRPO_FONT={p}: {e}"))?;
                Box::leak(b.into_boxed_slice())
            }
            Err(_) => BUNDLED_FONT,
        };
        plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes)
            .map_err(|_| "the plot font could not be loaded".to_string())
    })
    .clone()
}
