//! `grpo`: off-policy GRPO post-training of open LLMs for mathematical reasoning.
//!
//! The crate is organised by concept:
//! - [`model`]: the trainable decoder (Qwen2 / Qwen3 / Llama), loading, tokenizer and chat template,
//!   checkpoints in Hugging Face format.
//! - [`reward`]: answer extraction, math equivalence, majority vote, scoring metrics.
//! - [`data`]: teacher trajectories (OpenThoughts3), grouping, labelling, tokenised shards.
//! - [`jsonl`]: line-oriented input that reports bad lines with their number and keeps going.
//! - [`fsio`]: atomic output (a file or folder written aside, then renamed into place).
//! - [`checksum`]: checksums recorded when a re-used file is written, checked when it is read.
//! - [`objective`]: advantages and the losses (off_grpo, grpo, sft).
//! - [`kernels`]: fused ops with their own backward (log-prob + entropy), CPU reference and CUDA kernels.
//! - [`rollout`]: sampling, scoring and behaviour log-probs of the policy's own answers during training.
//! - [`train`]: the training loop, optimiser, checkpoints and resume.
//! - [`generate`]: text generation: sampling, the paged KV cache and the continuous-batching scheduler
//!   that `grpo eval`, validation and rollouts share.
//! - [`eval`]: benchmarks, the engines that draw samples and their scores.
//! - [`cost`]: what a training step costs on a device: its memory plan and its predicted time,
//!   calibrated on measured steps.
//! - [`device`]: the device's name and its peak memory.
//! - [`dist`]: data parallelism over several processes (ranks) and their collectives (MPI).
//! - [`bench`]: speed and memory measurements (`grpo bench`), one file per benchmark.
//! - [`profile`]: where a step's time goes, phase by phase, and the phase a thread is in.
//! - [`selftest`]: the fused kernels, a training step and a generation on a device against the CPU
//!   reference (`grpo selftest`).
//! - [`plot`]: figures (training curves of run folders).
//! - [`progress`]: progress bars.
//! - [`cli`]: the `grpo` command line.

pub mod bench;
pub mod checksum;
pub mod cli;
pub mod cost;
pub mod data;
pub mod device;
pub mod dist;
pub mod eval;
pub mod fsio;
pub mod generate;
pub mod hub;
pub mod jsonl;
pub mod kernels;
pub mod model;
pub mod objective;
pub mod plot;
pub mod profile;
pub mod progress;
pub mod reward;
pub mod rollout;
pub mod selftest;
pub mod train;
