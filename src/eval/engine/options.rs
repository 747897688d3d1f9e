//! The options of the engine, defined once: flags of `grpo eval` (clap) and keys of a config section
//! (serde), with the same defaults.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Which engine draws the samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// grpo's own sampler on the model's weights.
    #[default]
    Native,
    /// An OpenAI-compatible server's completions endpoint (vLLM, SGLang, llama.cpp).
    Openai,
}

/// How samples are drawn. The `openai` keys are only used (and only allowed) with `engine = openai`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub struct EngineOptions {
    /// Where samples come from: `native` (grpo's sampler on the model's weights) or `openai` (an
    /// OpenAI-compatible server; the model folder then only gives the tokenizer and chat template).
    #[arg(long, value_enum, default_value_t = EngineKind::Native)]
    pub engine: EngineKind,
    /// openai: the API root, e.g. http://127.0.0.1:8000/v1 (requests go to BASE_URL/completions). Several
    /// servers, comma-separated, for a run on several processes: rank r sends its share of the requests
    /// to the (r mod k)-th of the k servers (e.g. one server per node or per GPU).
    #[arg(long)]
    pub base_url: Option<String>,
    /// openai: the environment variable holding the API key, sent as a bearer token (default: no key).
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// openai: the name the server serves the model under (the requests' `model`).
    #[arg(long)]
    pub served_model: Option<String>,
    /// openai: requests in flight at most.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// openai: retries of a request after a transient error (connection, timeout, HTTP 408, 429, 5xx),
    /// waiting 0.5 s, 1 s, 2 s, ... (at most 30 s, or the server's Retry-After) between tries.
    #[arg(long, default_value_t = 5)]
    pub max_retries: usize,
    /// openai: seconds one request may take, response included (the wait while the server generates).
    #[arg(long, default_value_t = 1800)]
    pub request_timeout_s: u64,
    /// openai: seconds a request may wait on the server outside generation: connecting, sending the
    /// request, and receiving the response body once its headers have arrived. A server that stalls
    /// there fails the try in this time (then retried), not in request_timeout_s.
    #[arg(long, default_value_t = 120)]
    pub idle_timeout_s: u64,
    /// openai: send only the OpenAI API's own sampling fields, leaving out top_k, min_p = 0 and
    /// repeat_penalty = 1 (for servers that reject unknown fields; --top-k must then be 0).
    #[arg(long)]
    pub openai_fields_only: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            engine: EngineKind::Native,
            base_url: None,
            api_key_env: None,
            served_model: None,
            concurrency: 8,
            max_retries: 5,
            request_timeout_s: 1800,
            idle_timeout_s: 120,
            openai_fields_only: false,
        }
    }
}

impl EngineOptions {
    /// The servers of `base_url`: its comma-separated URLs, in order (none when unset).
    pub fn base_urls(&self) -> Vec<&str> {
        self.base_url
            .as_deref()
            .map(|u| u.split(',').map(str::trim).filter(|u| !u.is_empty()).collect())
            .unwrap_or_default()
    }

    /// These options as rank `rank` of a run on several processes uses them: `base_url` is the
    /// (rank mod k)-th of its k servers.
    pub fn for_rank(&self, rank: usize) -> EngineOptions {
        let urls = self.base_urls();
        let base_url = (!urls.is_empty()).then(|| urls[rank % urls.len()].to_string());
        EngineOptions { base_url, ..self.clone() }
    }

    /// Check the options, naming each as `{prefix}{name}` (`--` for flags, `section.` for config keys).
    pub fn validate(&self, prefix: &str) -> Result<(), String> {
        let name = |n: &str| if prefix == "--" { format!("--{}", n.replace('_', "-")) } else { format!("{prefix}{n}") };
        let engine =
            if prefix == "--" { "--engine openai".to_string() } else { format!("{prefix}engine = \"openai\"") };
        match self.engine {
            EngineKind::Openai => {
                if self.base_urls().is_empty() {
                    return Err(format!(
                        "{} is required with {engine} (e.g. http://127.0.0.1:8000/v1)",
                        name("base_url")
                    ));
                }
                if let Some(url) =
                    self.base_urls().into_iter().find(|u| !(u.starts_with("http://") || u.starts_with("https://")))
                {
                    return Err(format!("{} = {url:?} must start with http:// or https://", name("base_url")));
                }
                if self.served_model.as_deref().is_none_or(str::is_empty) {
                    return Err(format!(
                        "{} is required with {engine} (the server's model name)",
                        name("served_model")
                    ));
                }
                for (key, v) in [
                    ("concurrency", self.concurrency as u64),
                    ("request_timeout_s", self.request_timeout_s),
                    ("idle_timeout_s", self.idle_timeout_s),
                ] {
                    if v == 0 {
                        return Err(format!("{} = 0 must be >= 1", name(key)));
                    }
                }
            }
            EngineKind::Native => {
                let set = [
                    ("base_url", self.base_url.is_some()),
                    ("api_key_env", self.api_key_env.is_some()),
                    ("served_model", self.served_model.is_some()),
                    ("openai_fields_only", self.openai_fields_only),
                ];
                if let Some((key, _)) = set.iter().find(|(_, on)| *on) {
                    return Err(format!("{} is only used with {engine}", name(key)));
                }
            }
        }
        Ok(())
    }

    /// The HTTP client of these options: `request_timeout_s` for a whole request, `idle_timeout_s` for
    /// connecting, each write of the request and the response body (after its headers: the server has
    /// generated by then, so the body comes at once). HTTP errors are responses, not errors.
    pub fn http_agent(&self) -> ureq::Agent {
        let idle = Some(Duration::from_secs(self.idle_timeout_s));
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(self.request_timeout_s)))
            .timeout_connect(idle)
            .timeout_per_write(idle)
            .timeout_recv_body(idle)
            .max_idle_connections_per_host(self.concurrency.max(1))
            .build()
            .into()
    }

    /// The API key: the value of `api_key_env` (an error naming the variable when it is unset), or none.
    pub fn api_key(&self) -> Result<Option<String>, String> {
        match &self.api_key_env {
            None => Ok(None),
            Some(var) => std::env::var(var)
                .map(Some)
                .map_err(|_| format!("the API key variable {var} (--api-key-env) is not set")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: EngineOptions,
    }

    fn parse(args: &[&str]) -> EngineOptions {
        Cli::parse_from(std::iter::once("eval").chain(args.iter().copied())).options
    }

    #[test]
    fn flags_and_keys_agree_and_default_to_native() {
        assert_eq!(parse(&[]), EngineOptions::default());
        assert_eq!(toml::from_str::<EngineOptions>("").unwrap(), EngineOptions::default());
        let cli =
            parse(&["--engine", "openai", "--base-url", "http://h:1/v1", "--served-model", "m", "--concurrency", "3"]);
        let toml: EngineOptions =
            toml::from_str("engine = \"openai\"\nbase_url = \"http://h:1/v1\"\nserved_model = \"m\"\nconcurrency = 3")
                .unwrap();
        assert_eq!(cli, toml);
        assert_eq!(cli.validate("--"), Ok(()));
        assert!(toml::from_str::<EngineOptions>("engine = \"vllm\"").is_err());
    }

    #[test]
    fn each_rank_takes_its_server_of_a_list() {
        let o = parse(&["--engine", "openai", "--base-url", "http://a:1/v1, http://b:2/v1,", "--served-model", "m"]);
        assert_eq!(o.validate("--"), Ok(()));
        assert_eq!(o.base_urls(), ["http://a:1/v1", "http://b:2/v1"]);
        let url = |r| o.for_rank(r).base_url.unwrap();
        assert_eq!(
            [url(0), url(1), url(2), url(3)],
            ["http://a:1/v1", "http://b:2/v1", "http://a:1/v1", "http://b:2/v1"]
        );
        assert_eq!(o.for_rank(1).served_model, o.served_model);
        let bad = parse(&["--engine", "openai", "--base-url", "http://a/v1,b:2/v1", "--served-model", "m"]);
        assert_eq!(bad.validate("--").unwrap_err(), "--base-url = \"b:2/v1\" must start with http:// or https://");
        let none = parse(&["--engine", "openai", "--base-url", " , ", "--served-model", "m"]);
        assert!(none.validate("--").unwrap_err().starts_with("--base-url is required"));
        assert_eq!(EngineOptions::default().for_rank(3), EngineOptions::default());
    }

    #[test]
    fn missing_and_misplaced_options_are_named() {
        let e = parse(&["--engine", "openai"]).validate("--").unwrap_err();
        assert!(e.starts_with("--base-url is required with --engine openai"), "{e}");
        let e = parse(&["--engine", "openai", "--base-url", "http://h/v1"]).validate("--").unwrap_err();
        assert!(e.starts_with("--served-model is required"), "{e}");
        let e =
            parse(&["--engine", "openai", "--base-url", "h:80/v1", "--served-model", "m"]).validate("--").unwrap_err();
        assert!(e.contains("must start with http://"), "{e}");
        let e =
            parse(&["--engine", "openai", "--base-url", "http://h/v1", "--served-model", "m", "--concurrency", "0"])
                .validate("--")
                .unwrap_err();
        assert!(e.starts_with("--concurrency = 0"), "{e}");
        let e =
            parse(&["--engine", "openai", "--base-url", "http://h/v1", "--served-model", "m", "--idle-timeout-s", "0"])
                .validate("--")
                .unwrap_err();
        assert!(e.starts_with("--idle-timeout-s = 0"), "{e}");
        let toml: EngineOptions = toml::from_str("idle_timeout_s = 5").unwrap();
        assert_eq!(toml, parse(&["--idle-timeout-s", "5"]));
        let e = parse(&["--base-url", "http://h/v1"]).validate("--").unwrap_err();
        assert_eq!(e, "--base-url is only used with --engine openai");
        let toml: EngineOptions = toml::from_str("served_model = \"m\"").unwrap();
        assert_eq!(
            toml.validate("rollout.").unwrap_err(),
            "rollout.served_model is only used with rollout.engine = \"openai\""
        );
    }

    #[test]
    fn the_api_key_comes_from_the_named_variable() {
        assert_eq!(EngineOptions::default().api_key(), Ok(None));
        let unset = EngineOptions { api_key_env: Some("GRPO_TEST_SURELY_UNSET_KEY".into()), ..Default::default() };
        assert!(unset.api_key().unwrap_err().contains("GRPO_TEST_SURELY_UNSET_KEY"));
        let path = EngineOptions { api_key_env: Some("PATH".into()), ..Default::default() };
        assert_eq!(path.api_key(), Ok(std::env::var("PATH").ok()));
    }
}
