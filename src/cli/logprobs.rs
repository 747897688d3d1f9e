//! `grpo logprobs`: per-token log-probs of texts or (prompt, response) pairs under a model.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::{Map, Value};

use crate::jsonl::{AtomicFile, Lines};
use crate::model::{self, ChatTokenizer, Decoder, Targets, TokenBatch};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model folder or hub id `org/name[@revision]` (downloaded into the Hugging Face cache where missing).
    #[arg(long)]
    pub model: String,
    /// The hub revision of --model (a branch, tag or commit; as `org/name@revision` writes it).
    #[arg(long)]
    pub revision: Option<String>,
    /// A LoRA adapter folder or hub id (PEFT's files, e.g. a LoRA run's checkpoint) applied to --model.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Apply --adapter even though its adapter_config.json names another base model
    /// (base_model_name_or_path) than --model.
    #[arg(long, requires = "adapter")]
    pub allow_base_mismatch: bool,
    /// JSONL: {"text": ...} (log-probs of every token after the first) or {"prompt", "response"}
    /// (prompt rendered with the chat template; log-probs of the response tokens).
    #[arg(long)]
    pub input: PathBuf,
    /// Output JSONL (default: stdout). Each line keeps the input's fields and adds tokens, logprobs, sum.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Weight and activation dtype (log-probs are always computed in f32).
    #[arg(long, default_value = "f32")]
    pub dtype: crate::device::DTypeName,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: crate::device::DeviceName,
    /// Lines scored together in one padded batch.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Stop at the first malformed line instead of reporting and skipping it.
    #[arg(long)]
    pub strict: bool,
    /// Lines longer than this many bytes are skipped as too large (without being held in memory).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_row_bytes: usize,
}

struct Item {
    fields: Map<String, Value>,
    tokens: Vec<u32>,
    /// Index of the first token whose log-prob is reported.
    first: usize,
}

fn prepare(tok: &ChatTokenizer, v: Value) -> Result<Item, String> {
    let Value::Object(fields) = v else { return Err("expected a JSON object".into()) };
    let (tokens, first) = if let Some(text) = fields.get("text") {
        let text = text.as_str().ok_or("`text` must be a string")?;
        let ids = tok.encode(text, true).map_err(|e| e.to_string())?;
        if ids.len() < 2 {
            return Err("`text` has fewer than two tokens: nothing to score".into());
        }
        (ids, 1)
    } else {
        let prompt =
            fields.get("prompt").and_then(Value::as_str).ok_or("needs `text`, or string `prompt` and `response`")?;
        let response = fields.get("response").and_then(Value::as_str).ok_or("`response` missing or not a string")?;
        let rendered = tok.render_prompt(None, prompt).map_err(|e| e.to_string())?;
        let mut ids = tok.encode(&rendered, false).map_err(|e| e.to_string())?;
        let first = ids.len();
        ids.extend(tok.encode(response, false).map_err(|e| e.to_string())?);
        if ids.len() == first {
            return Err("`response` is empty".into());
        }
        (ids, first)
    };
    Ok(Item { fields, tokens, first })
}

fn score(model: &Decoder, pad: u32, items: &[Item]) -> candle_core::Result<Vec<Vec<f32>>> {
    let batch = TokenBatch::padded(&items.iter().map(|i| i.tokens.clone()).collect::<Vec<_>>(), pad);
    let mut targets = Targets::default();
    for (r, it) in items.iter().enumerate() {
        for p in it.first.max(1)..it.tokens.len() {
            targets.push(r, p);
        }
    }
    let lp = model.token_logprobs(&batch, &targets, false)?.narrow(1, 0, 1)?.squeeze(1)?.to_vec1::<f32>()?;
    let mut out = Vec::with_capacity(items.len());
    let mut at = 0;
    for it in items {
        let n = it.tokens.len() - it.first.max(1);
        out.push(lp[at..at + n].to_vec());
        at += n;
    }
    Ok(out)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model_id = model::load::with_revision(&args.model, args.revision.as_deref(), "--revision")?;
    let dir = model::resolve_model_dir(&model_id)?;
    let device = model::open_device(args.device)?;
    let dtype = args.dtype.dtype();
    let tok = ChatTokenizer::load(&dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    if let Some(adapter) = args.adapter.as_deref().filter(|_| !args.allow_base_mismatch) {
        model::load::check_base(adapter, &model_id, &dir, "--allow-base-mismatch")?;
    }
    let decoder = model::load::load_frozen(&dir, args.adapter.as_deref(), dtype, &device)
        .with_context(|| format!("loading {}", dir.display()))?;
    let mut out = AtomicFile::create(args.output.as_deref())?;
    let lines = Lines::open(&args.input)?.max_line_bytes(args.max_row_bytes);
    let bar = crate::progress::progress_bar(None, "logprobs");
    let (mut done, mut bad) = (0usize, 0usize);
    let mut pending: Vec<Item> = Vec::new();
    let flush = |pending: &mut Vec<Item>, out: &mut AtomicFile| -> anyhow::Result<usize> {
        if pending.is_empty() {
            return Ok(0);
        }
        let scores = score(&decoder, tok.pad_id(), pending)?;
        for (it, lp) in pending.drain(..).zip(scores) {
            let mut fields = it.fields;
            fields.insert("tokens".into(), it.tokens[it.first.max(1)..].to_vec().into());
            fields.insert("sum".into(), lp.iter().map(|&x| x as f64).sum::<f64>().into());
            fields.insert("logprobs".into(), lp.into());
            out.write_json(&fields)?;
        }
        Ok(1)
    };
    for line in lines {
        let line = line?;
        match line.json::<Value>().map_err(|e| e.to_string()).and_then(|v| prepare(&tok, v)) {
            Ok(item) => pending.push(item),
            Err(reason) => {
                bad += 1;
                let msg = format!("{}:{}: {reason}", args.input.display(), line.number);
                if args.strict {
                    anyhow::bail!("{msg} (--strict)");
                }
                tracing::warn!("skipping {msg}");
            }
        }
        if pending.len() >= args.batch_size.max(1) {
            done += pending.len();
            flush(&mut pending, &mut out)?;
            bar.set_position(done as u64);
        }
    }
    done += pending.len();
    flush(&mut pending, &mut out)?;
    bar.finish_and_clear();
    if done == 0 {
        anyhow::bail!("{}: nothing was scored ({bad} lines skipped)", args.input.display());
    }
    out.commit()?;
    tracing::info!("scored {done} lines, skipped {bad} malformed");
    Ok(())
}
