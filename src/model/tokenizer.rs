//! The tokenizer (`tokenizer.json`) and the chat template (`tokenizer_config.json`, rendered with
//! minijinja the way transformers' `apply_chat_template` renders it with jinja2).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Errors of tokenizer loading, chat rendering and encoding.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{0} has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja)")]
    NoTemplate(PathBuf),
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.to_string(), content: content.to_string() }
    }
}

/// A tokenizer with its chat template and special tokens.
pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_ids: Vec<u32>,
    pad_id: Option<u32>,
    dir: PathBuf,
    /// Each token's decoded text and its id, `None` where several tokens decode to the same text; built
    /// on first use by [`Self::piece_id`].
    pieces: std::sync::OnceLock<std::collections::HashMap<String, Option<u32>>>,
}

fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>, TokenizerError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.into(), source })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TokenizerError::Invalid { path: path.into(), message: e.to_string() })
}

fn ids_of(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => vec![],
    }
}

impl ChatTokenizer {
    /// Load `tokenizer.json`, `tokenizer_config.json` (chat template, special tokens) and the EOS ids of
    /// `generation_config.json` / `config.json` from a model or tokenizer folder.
    pub fn load(dir: &Path) -> Result<Self, TokenizerError> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| TokenizerError::Invalid { path: tok_path.clone(), message: e.to_string() })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = read_json(&cfg_path)?.unwrap_or(serde_json::Value::Null);
        let mut template = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        };
        let jinja = dir.join("chat_template.jinja");
        if template.is_none() && jinja.exists() {
            template = Some(
                std::fs::read_to_string(&jinja).map_err(|source| TokenizerError::Io { path: jinja.clone(), source })?,
            );
        }
        let bos_token = token_string(cfg.get("bos_token"));
        let eos_token = token_string(cfg.get("eos_token"));
        let mut eos_ids = Vec::new();
        if let Some(e) = &eos_token {
            eos_ids.extend(tokenizer.token_to_id(e));
        }
        for f in ["generation_config.json", "config.json"] {
            if let Some(v) = read_json(&dir.join(f))? {
                for id in ids_of(v.get("eos_token_id")) {
                    if !eos_ids.contains(&id) {
                        eos_ids.push(id);
                    }
                }
            }
        }
        let pad_id = token_string(cfg.get("pad_token")).and_then(|p| tokenizer.token_to_id(&p));
        Ok(Self {
            tokenizer,
            template,
            bos_token,
            eos_token,
            eos_ids,
            pad_id,
            dir: dir.to_path_buf(),
            pieces: Default::default(),
        })
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// Token ids that end generation (EOS of the tokenizer config and of the generation config).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The padding token id (falls back to the first EOS id, then 0).
    pub fn pad_id(&self) -> u32 {
        self.pad_id.or_else(|| self.eos_ids.first().copied()).unwrap_or(0)
    }

    /// Number of entries in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Whether a chat template is available.
    pub fn has_template(&self) -> bool {
        self.template.is_some()
    }

    /// Render messages with the chat template, as `apply_chat_template(tokenize=False)` does.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        let template = self.template.as_deref().ok_or_else(|| TokenizerError::NoTemplate(self.dir.clone()))?;
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String {
            // Templates use this for a "today's date" line; a fixed rendering keeps outputs reproducible.
            let _ = fmt;
            "26 Jul 2024".to_string()
        });
        env.add_template("chat", template).map_err(|e| TokenizerError::Template(format!("{e:#}")))?;
        let tmpl = env.get_template("chat").map_err(|e| TokenizerError::Template(format!("{e:#}")))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| TokenizerError::Template(format!("{e:#}")))
    }

    /// Render a single user turn (with an optional system prompt) followed by the generation prompt.
    pub fn render_prompt(&self, system: Option<&str>, user: &str) -> Result<String, TokenizerError> {
        let mut messages = Vec::with_capacity(2);
        if let Some(s) = system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", user));
        self.render(&messages, true)
    }

    /// Encode text. `add_special_tokens` applies the tokenizer's post-processor (a BOS for Llama-3);
    /// rendered chat text is encoded without it, as transformers does.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Decode ids to text, skipping special tokens when asked.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.tokenizer.decode(ids, skip_special_tokens).map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// The id of the one token whose decoded text is `piece` (how servers that name sampled tokens by
    /// their text, llama.cpp's and SGLang's, identify them), or `None` when no token or several decode to it.
    pub fn piece_id(&self, piece: &str) -> Option<u32> {
        let pieces = self.pieces.get_or_init(|| {
            let mut map = std::collections::HashMap::new();
            for id in 0..self.vocab_size() as u32 {
                if let Ok(text) = self.decode(&[id], false) {
                    map.entry(text).and_modify(|v| *v = None).or_insert(Some(id));
                }
            }
            map
        });
        pieces.get(piece).copied().flatten()
    }

    /// A short fingerprint of the tokenizer files (for manifests that must notice a changed tokenizer).
    pub fn fingerprint(&self) -> Result<String, TokenizerError> {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            let p = self.dir.join(f);
            if p.exists() {
                h.update(std::fs::read(&p).map_err(|source| TokenizerError::Io { path: p.clone(), source })?);
            }
        }
        Ok(h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(p: &str) -> Option<PathBuf> {
        let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("data").join(p);
        d.exists().then_some(d)
    }

    #[test]
    fn qwen3_chatml_and_special_tokens() {
        let Some(dir) = shared("tokenizers/qwen3") else {
            eprintln!("skipped: ../shared/data/tokenizers/qwen3 not present");
            return;
        };
        let t = ChatTokenizer::load(&dir).unwrap();
        assert_eq!(t.encode("<|im_start|>hello<|im_end|>", false).unwrap(), vec![151644, 14990, 151645]);
        let s = t.render_prompt(None, "What is 1+1?").unwrap();
        assert_eq!(s, "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n");
        assert!(t.eos_ids().contains(&151645));
    }
}
