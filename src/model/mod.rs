//! The model: configuration, the trainable decoder, weight loading (local folder or HF cache), the
//! tokenizer and chat template, and checkpoints in Hugging Face format.

pub mod checkpoint;
pub mod config;
pub mod decoder;
pub mod load;
pub mod lora;
pub mod tiny;
pub mod tokenizer;

pub use checkpoint::save_checkpoint;
pub use config::{Arch, ModelConfig};
pub use decoder::{
    Attention, Decoder, DecoderOptions, Grads, KvCache, PagedBatch, PagedKv, Param, Targets, TokenBatch,
};
pub use load::{load_decoder, open_device, random_decoder, resolve_model_dir};
pub use lora::LoraOptions;
pub use tokenizer::{ChatTokenizer, Message};

use std::path::PathBuf;

/// Errors of loading, building and saving models.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Tokenizer(#[from] tokenizer::TokenizerError),
    #[error("tensor `{0}` is missing from the checkpoint")]
    Missing(String),
    #[error("tensor `{name}` has shape {found:?}, the config implies {expected:?}")]
    Shape { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error(
        "model `{0}` not found: not a folder, and not a hub id `org/name[@revision]` (the Hugging Face cache is {1})"
    )]
    NotFound(String, PathBuf),
    #[error(transparent)]
    Hub(#[from] crate::hub::HubError),
    #[error("{path}: {message}")]
    Files { path: PathBuf, message: String },
    #[error("io error on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
