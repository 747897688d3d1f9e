//! Teacher trajectories: readers for OpenThoughts3 rows (JSONL, Parquet), grouping answers by question,
//! labelling them with the reward module, and tokenised shards for the trainer.
//!
//! Public surface:
//! - [`reader`]: [`resolve_inputs`] (files, folders, globs) and [`Row`] / [`BadRow`] / [`ReadOptions`]:
//!   OT3 rows (`conversations`) or plain `{"prompt", "response"}` rows, optional `teacher_logprobs`.
//! - [`group`]: [`InputOptions`] (which rows, how grouped), [`group_rows`] (in memory, full text) and [`scan`] (streaming, spill
//!   files, bounded memory) which both produce labelled groups and [`Stats`].
//! - [`label`]: [`label_group`] -> [`Labels`] (majority answer, vote margin, rewards).
//! - [`stats`]: [`Stats`], its text report and [`plot_stats`] (the seed's figure 2).
//! - [`prepare`]: [`prepare()`] with [`PrepareOptions`] writes tokenised shards, `stats.json` and a manifest.
//! - [`shards`]: [`PreparedDataset`], the memory-mapped reader of a prepared folder ([`Group`], [`Response`]).

pub mod group;
pub mod label;
pub mod prepare;
pub mod reader;
pub mod shards;
pub mod stats;
pub mod versions;

use std::path::PathBuf;

pub use group::{group_rows, scan, GroupOptions, InputOptions, LabeledGroup, LabeledResponse, Ties, VoteOver};
pub use label::{label_group, GroupKind, Labels};
pub use prepare::{prepare, Overlong, PrepareOptions, PrepareOutcome, SequenceOptions};
pub use reader::{read_all, resolve_inputs, BadRow, Location, ReadOptions, Row, SkipReason};
pub use shards::{Group, PreparedDataset, Response};
pub use stats::{plot_stats, LengthSummary, Stats};

/// Errors of the data pipeline.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Jsonl(#[from] crate::jsonl::JsonlError),
    #[error("{path}: parquet: {message}")]
    Parquet { path: PathBuf, message: String },
    #[error("no input files: {0}")]
    NoInput(String),
    /// A bad row in strict mode.
    #[error("{0}")]
    BadRow(Box<BadRow>),
    #[error(transparent)]
    Tokenizer(#[from] crate::model::tokenizer::TokenizerError),
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("plot: {0}")]
    Plot(String),
    #[error("{0}")]
    Invalid(String),
    /// A stop request (Ctrl-C, SIGTERM) was honoured.
    #[error("stopped on request {0}")]
    Interrupted(String),
    #[error(transparent)]
    Checksum(#[from] crate::checksum::ChecksumError),
    #[error(transparent)]
    Hub(Box<crate::hub::HubError>),
}

impl From<crate::hub::HubError> for DataError {
    fn from(e: crate::hub::HubError) -> Self {
        Self::Hub(Box::new(e))
    }
}

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> DataError {
    let path = path.into();
    move |source| DataError::Io { path, source }
}

/// 64-bit FNV-1a: a hash that is stable across runs, platforms and Rust versions (question ids, manifests).
#[derive(Clone, Copy)]
pub(crate) struct Fnv(u64);

impl Fnv {
    pub(crate) fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub(crate) fn write_u64(&mut self, x: u64) {
        self.write(&x.to_le_bytes());
    }
    pub(crate) fn finish(&self) -> u64 {
        // A final avalanche (splitmix64) so that the low bits used for partitioning are well mixed.
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The grouping key of a question: a hash of its text with whitespace runs collapsed and ends trimmed.
pub fn question_hash(question: &str) -> u64 {
    let mut h = Fnv::new();
    for (i, word) in question.split_whitespace().enumerate() {
        if i > 0 {
            h.write(b" ");
        }
        h.write(word.as_bytes());
    }
    h.finish()
}

/// The printable id of a question hash (16 hex digits).
pub fn question_id(hash: u64) -> String {
    format!("{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn question_hash_ignores_whitespace_differences_only() {
        assert_eq!(question_hash("What is  1+1?\n"), question_hash(" What is 1+1?"));
        assert_ne!(question_hash("What is 1+1?"), question_hash("What is 1+2?"));
        assert_eq!(question_id(question_hash("x")).len(), 16);
        // Stable across builds: the published FNV-1a 64 value of "a".
        let mut h = Fnv::new();
        h.write(b"a");
        assert_eq!(h.0, 0xaf63_dc4c_8601_ec8c);
    }
}
