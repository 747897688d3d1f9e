//! LoRA (low-rank adapters, PEFT's `LoraConfig`): each targeted projection `y = x W^T` becomes
//! `y = x W^T + (dropout(x) A^T) B^T * alpha / r` with `A` `[r, in]` and `B` `[out, r]` trainable and `W`
//! frozen; the merged weight `W + B A alpha / r` is never made in a step.
//!
//! As PEFT does by default (`autocast_adapter_dtype`), the adapters are f32 whatever the model's dtype:
//! the adapter product runs in f32 on the input cast to f32, is added to the base output in f32 and the
//! sum is rounded to the model's dtype. The optimiser's f32 master copy of the adapters is then their
//! exact copy.
//!
//! On disk: `adapter_model.safetensors` (tensors named as PEFT names them,
//! `base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight`) and `adapter_config.json`, which
//! PEFT's `PeftModel.from_pretrained` and vLLM's LoRA serving read.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::config::ModelConfig;
use super::ModelError;

/// The projections an adapter may target, as PEFT names them, with their module prefix in the layer.
pub const TARGETS: [(&str, &str); 7] = [
    ("q_proj", "self_attn"),
    ("k_proj", "self_attn"),
    ("v_proj", "self_attn"),
    ("o_proj", "self_attn"),
    ("gate_proj", "mlp"),
    ("up_proj", "mlp"),
    ("down_proj", "mlp"),
];

/// The adapter file, in PEFT's format.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// The adapter's configuration, in PEFT's format.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The prefix PEFT gives the base model's tensor names in an adapter file.
const PEFT_PREFIX: &str = "base_model.model.";

/// How the adapters start (PEFT's `init_lora_weights`); B is zero either way, so step 0 is the base model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LoraInit {
    /// A Kaiming-uniform (a = sqrt(5), as torch's `nn.Linear`): uniform in +-1/sqrt(in).
    #[default]
    Default,
    /// A normal with standard deviation 1/r.
    Gaussian,
}

fn default_targets() -> Vec<String> {
    TARGETS.iter().map(|(t, _)| t.to_string()).collect()
}

/// PEFT's name for every linear projection but the head: [`TARGETS`].
const ALL_LINEAR: &str = "all-linear";

/// `target_modules` as PEFT writes it: a list of module names, or one name as a string, where
/// `"all-linear"` (PEFT's shorthand) stands for every projection of [`TARGETS`].
fn target_modules<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    struct Modules;
    impl<'de> serde::de::Visitor<'de> for Modules {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of module names, or \"all-linear\"")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(vec![v.to_string()])
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(m) = seq.next_element::<String>()? {
                out.push(m);
            }
            Ok(out)
        }
    }
    let modules = d.deserialize_any(Modules)?;
    Ok(match modules.iter().any(|m| m == ALL_LINEAR) {
        true => default_targets(),
        false => modules,
    })
}

/// `[model.lora]`: train low-rank adapters of the targeted projections instead of every weight (PEFT's names).
/// The base weights stay frozen in the model's dtype; only the adapters have gradients and optimiser state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub struct LoraOptions {
    /// The adapters' rank r.
    #[arg(long = "lora-r", default_value_t = 8)]
    pub r: usize,
    /// The adapter product is scaled by alpha / r (PEFT's `lora_alpha`).
    #[arg(long = "lora-alpha", default_value_t = 8.0)]
    pub alpha: f64,
    /// Dropout on the adapters' input in training (PEFT's `lora_dropout`), in [0, 1): a mask drawn from the
    /// run's seed, the step and the micro-batch ([`crate::kernels::lora_linear`]), so that the layers'
    /// recomputation and a resumed run draw the same one. Off in evaluation, rollouts and the reference.
    #[arg(long = "lora-dropout", default_value_t = 0.0)]
    pub dropout: f64,
    /// The projections that get adapters: any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    /// down_proj, or "all-linear" (PEFT's name for all of them, the default), in every layer.
    #[arg(long = "lora-target-modules", value_delimiter = ',', default_values_t = default_targets())]
    #[serde(deserialize_with = "target_modules")]
    pub target_modules: Vec<String>,
    /// How A starts (B starts at zero).
    #[arg(long = "lora-init", value_enum, default_value_t = LoraInit::Default)]
    pub init: LoraInit,
}

impl Default for LoraOptions {
    fn default() -> Self {
        Self { r: 8, alpha: 8.0, dropout: 0.0, target_modules: default_targets(), init: LoraInit::Default }
    }
}

impl LoraOptions {
    /// The factor of the adapter product, alpha / r.
    pub fn scale(&self) -> f64 {
        self.alpha / self.r as f64
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.r == 0 {
            return Err("model.lora.r must be at least 1".into());
        }
        if !(self.alpha > 0.0 && self.alpha.is_finite()) {
            return Err(format!("model.lora.alpha = {} must be positive", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("model.lora.dropout = {} must be in [0, 1)", self.dropout));
        }
        if self.target_modules.is_empty() {
            return Err("model.lora.target_modules is empty".into());
        }
        for t in &self.target_modules {
            if t != ALL_LINEAR && !TARGETS.iter().any(|(name, _)| name == t) {
                let known: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
                return Err(format!("model.lora.target_modules: unknown module `{t}` (known: {})", known.join(", ")));
            }
        }
        Ok(())
    }

    /// Whether projection `module` (one of [`TARGETS`]) gets an adapter.
    pub fn targets(&self, module: &str) -> bool {
        self.target_modules.iter().any(|t| t == module || t == ALL_LINEAR)
    }
}

/// `(in, out)` features of projection `module` of a layer of `cfg`.
pub fn features(cfg: &ModelConfig, module: &str) -> (usize, usize) {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    match module {
        "q_proj" => (h, q),
        "k_proj" | "v_proj" => (h, kv),
        "o_proj" => (q, h),
        "gate_proj" | "up_proj" => (h, i),
        _ => (i, h),
    }
}

/// The adapters' names (without PEFT's prefix) and shapes, layer by layer, module by module in the order of
/// [`TARGETS`], A then B.
pub fn adapter_shapes(cfg: &ModelConfig, opts: &LoraOptions) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    for l in 0..cfg.num_layers {
        for (module, block) in TARGETS.iter().filter(|(m, _)| opts.targets(m)) {
            let (fan_in, fan_out) = features(cfg, module);
            let p = format!("model.layers.{l}.{block}.{module}");
            out.push((format!("{p}.lora_A.weight"), vec![opts.r, fan_in]));
            out.push((format!("{p}.lora_B.weight"), vec![fan_out, opts.r]));
        }
    }
    out
}

/// The number of adapter parameters of `cfg` under `opts`.
pub fn adapter_parameters(cfg: &ModelConfig, opts: &LoraOptions) -> u64 {
    adapter_shapes(cfg, opts).iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum()
}

/// Fresh adapters (f32, on `device`): A as `opts.init` says, drawn from `seed`, B zero.
pub fn init_adapters(
    cfg: &ModelConfig,
    opts: &LoraOptions,
    seed: u64,
    device: &Device,
) -> candle_core::Result<Vec<(String, Tensor)>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x4c6f_5241);
    let mut out = Vec::new();
    for (name, shape) in adapter_shapes(cfg, opts) {
        let n = shape.iter().product::<usize>();
        let values: Vec<f32> = if name.ends_with("lora_A.weight") {
            match opts.init {
                LoraInit::Default => {
                    let bound = 1.0 / (shape[1] as f32).sqrt();
                    (0..n).map(|_| rng.gen_range(-bound..bound)).collect()
                }
                LoraInit::Gaussian => {
                    // Box-Muller.
                    let std = 1.0 / opts.r as f64;
                    let mut normal = || {
                        let (u, v): (f64, f64) = (rng.gen_range(f64::EPSILON..1.0), rng.gen());
                        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos() * std) as f32
                    };
                    (0..n).map(|_| normal()).collect()
                }
            }
        } else {
            vec![0.0; n]
        };
        out.push((name, Tensor::from_vec(values, shape, device)?));
    }
    Ok(out)
}

/// `adapter_config.json` as PEFT writes it (the keys PEFT and vLLM read; PEFT fills in the rest).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdapterConfig {
    pub peft_type: String,
    pub task_type: String,
    pub r: usize,
    pub lora_alpha: f64,
    pub lora_dropout: f64,
    #[serde(deserialize_with = "target_modules")]
    pub target_modules: Vec<String>,
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    #[serde(default = "none")]
    pub bias: String,
    #[serde(default)]
    pub fan_in_fan_out: bool,
    #[serde(default)]
    pub inference_mode: bool,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default)]
    pub init_lora_weights: serde_json::Value,
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
}

fn none() -> String {
    "none".into()
}

impl AdapterConfig {
    pub fn new(opts: &LoraOptions, base: Option<&str>) -> Self {
        Self {
            peft_type: "LORA".into(),
            task_type: "CAUSAL_LM".into(),
            r: opts.r,
            lora_alpha: opts.alpha,
            lora_dropout: opts.dropout,
            target_modules: opts.target_modules.clone(),
            base_model_name_or_path: base.map(String::from),
            bias: none(),
            fan_in_fan_out: false,
            inference_mode: true,
            use_rslora: false,
            init_lora_weights: match opts.init {
                LoraInit::Default => true.into(),
                LoraInit::Gaussian => "gaussian".into(),
            },
            modules_to_save: None,
        }
    }

    /// The options of this adapter; an error names what grpo cannot apply.
    pub fn options(&self, path: &Path) -> Result<LoraOptions, ModelError> {
        let bad = |message: String| ModelError::Files { path: path.to_path_buf(), message };
        if self.peft_type != "LORA" {
            return Err(bad(format!("peft_type `{}`: only LORA adapters are supported", self.peft_type)));
        }
        if self.bias != "none" || self.fan_in_fan_out || self.use_rslora || self.modules_to_save.is_some() {
            return Err(bad("bias, fan_in_fan_out, use_rslora and modules_to_save are not supported".into()));
        }
        let init = match self.init_lora_weights.as_str() {
            Some("gaussian") => LoraInit::Gaussian,
            _ => LoraInit::Default,
        };
        let opts = LoraOptions {
            r: self.r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            target_modules: self.target_modules.clone(),
            init,
        };
        opts.validate().map_err(bad)?;
        Ok(opts)
    }
}

/// Write `adapters` (named as in [`adapter_shapes`]) and their config into the folder `dir`.
pub fn write_adapter(
    dir: &Path,
    opts: &LoraOptions,
    base: Option<&str>,
    adapters: Vec<(String, Tensor)>,
) -> Result<(), ModelError> {
    let tensors: Vec<(String, Tensor)> = adapters
        .into_iter()
        .map(|(n, t)| Ok((format!("{PEFT_PREFIX}{n}"), t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)))
        .collect::<candle_core::Result<_>>()?;
    let path = dir.join(ADAPTER_FILE);
    let metadata = Some(std::collections::HashMap::from([("format".to_string(), "pt".to_string())]));
    safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), metadata, &path)
        .map_err(|e| ModelError::Files { path: path.clone(), message: e.to_string() })?;
    let c = dir.join(ADAPTER_CONFIG_FILE);
    let text = serde_json::to_string_pretty(&AdapterConfig::new(opts, base)).unwrap_or_default();
    std::fs::write(&c, text).map_err(|source| ModelError::Io { path: c, source })
}

/// An adapter read from a folder: its options and its tensors (f32, on the CPU, named as in
/// [`adapter_shapes`]).
pub struct Adapter {
    pub dir: PathBuf,
    pub options: LoraOptions,
    pub tensors: std::collections::HashMap<String, Tensor>,
}

/// Refuse a folder that is not an adapter, saying what it is: a full model (its config.json and weights)
/// is applied as the model, not as an adapter.
fn check_is_adapter(dir: &Path) -> Result<(), ModelError> {
    if is_adapter_dir(dir) {
        return Ok(());
    }
    let message = if dir.join("config.json").is_file() {
        format!(
            "a full model (config.json, no {ADAPTER_CONFIG_FILE}), not an adapter: pass it as the model (--model) \
             instead"
        )
    } else if dir.is_dir() {
        format!("no {ADAPTER_CONFIG_FILE}: not an adapter folder (PEFT's {ADAPTER_CONFIG_FILE} and {ADAPTER_FILE})")
    } else {
        "no such adapter folder".to_string()
    };
    Err(ModelError::Files { path: dir.to_path_buf(), message })
}

/// Read the adapter of folder `dir` (PEFT's files).
pub fn read_adapter(dir: &Path) -> Result<Adapter, ModelError> {
    check_is_adapter(dir)?;
    let c = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read(&c).map_err(|source| ModelError::Io { path: c.clone(), source })?;
    let config: AdapterConfig =
        serde_json::from_slice(&text).map_err(|e| ModelError::Files { path: c.clone(), message: e.to_string() })?;
    let options = config.options(&c)?;
    let p = dir.join(ADAPTER_FILE);
    let raw = candle_core::safetensors::load(&p, &Device::Cpu)
        .map_err(|e| ModelError::Files { path: p.clone(), message: e.to_string() })?;
    let tensors = raw
        .into_iter()
        .map(|(n, t)| {
            // PEFT writes `...q_proj.lora_A.weight`; some writers keep the adapter name (`lora_A.default.weight`).
            let n = n.strip_prefix(PEFT_PREFIX).unwrap_or(&n).replace(".default.weight", ".weight");
            Ok((n, t.to_dtype(DType::F32)?))
        })
        .collect::<candle_core::Result<_>>()?;
    Ok(Adapter { dir: dir.to_path_buf(), options, tensors })
}

/// The adapter config of folder `dir`.
pub(super) fn read_config(dir: &Path) -> Result<AdapterConfig, ModelError> {
    check_is_adapter(dir)?;
    let c = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read(&c).map_err(|source| ModelError::Io { path: c.clone(), source })?;
    serde_json::from_slice(&text).map_err(|e| ModelError::Files { path: c, message: e.to_string() })
}

/// The base model the adapter config of folder `dir` names (`base_model_name_or_path`).
pub fn base_model(dir: &Path) -> Result<String, ModelError> {
    read_config(dir)?.base_model_name_or_path.ok_or_else(|| ModelError::Files {
        path: dir.join(ADAPTER_CONFIG_FILE),
        message: "names no base model (base_model_name_or_path): give the base model and the adapter".into(),
    })
}

/// Whether the folder `dir` holds an adapter (PEFT's files) rather than a whole model.
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG_FILE).is_file()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::load::{check_base, load_frozen, load_with_adapter};
    use crate::model::tiny::TinyShape;
    use crate::model::Arch;

    #[test]
    fn shapes_follow_peft_and_init_starts_at_the_base_model() {
        let cfg = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Qwen2, 64, None, None)
            .unwrap();
        let opts = LoraOptions { r: 4, ..Default::default() };
        let shapes = adapter_shapes(&cfg, &opts);
        assert_eq!(shapes.len(), 2 * 7 * 2);
        assert_eq!(shapes[0], ("model.layers.0.self_attn.q_proj.lora_A.weight".to_string(), vec![4, 16]));
        assert_eq!(shapes[3], ("model.layers.0.self_attn.k_proj.lora_B.weight".to_string(), vec![8, 4]));
        assert_eq!(shapes[13], ("model.layers.0.mlp.down_proj.lora_B.weight".to_string(), vec![16, 4]));
        let t = init_adapters(&cfg, &opts, 1, &Device::Cpu).unwrap();
        let a: Vec<f32> = t[0].1.flatten_all().unwrap().to_vec1().unwrap();
        assert!(a.iter().all(|v| v.abs() <= 0.25) && a.iter().any(|&v| v != 0.0));
        let b: Vec<f32> = t[1].1.flatten_all().unwrap().to_vec1().unwrap();
        assert!(b.iter().all(|&v| v == 0.0));
        let e = LoraOptions { target_modules: vec!["qkv".into()], ..Default::default() }.validate().unwrap_err();
        assert!(e.contains("unknown module `qkv`"), "{e}");
    }

    /// PEFT's `target_modules = "all-linear"` (and one module as a string) read as the list they stand for.
    #[test]
    fn all_linear_and_a_single_module_are_read_as_peft_reads_them() {
        let all: LoraOptions = toml::from_str("target_modules = \"all-linear\"").unwrap();
        assert_eq!(all.target_modules, default_targets());
        let one: LoraOptions = toml::from_str("target_modules = \"q_proj\"").unwrap();
        assert_eq!(one.target_modules, vec!["q_proj".to_string()]);
        let e = toml::from_str::<LoraOptions>("target_modules = 3").unwrap_err().to_string();
        assert!(e.contains("a list of module names, or \"all-linear\""), "{e}");
        let flag = LoraOptions { target_modules: vec![ALL_LINEAR.into()], ..Default::default() };
        assert!(flag.validate().is_ok() && TARGETS.iter().all(|(m, _)| flag.targets(m)));
    }

    #[test]
    fn adapter_files_round_trip_in_peft_names() {
        let cfg = TinyShape { layers: 1, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Llama, 64, None, None)
            .unwrap();
        let opts = LoraOptions {
            r: 2,
            alpha: 16.0,
            target_modules: vec!["q_proj".into(), "v_proj".into()],
            ..Default::default()
        };
        let t = init_adapters(&cfg, &opts, 3, &Device::Cpu).unwrap();
        let dir = tempfile::tempdir().unwrap();
        write_adapter(dir.path(), &opts, Some("base"), t.clone()).unwrap();
        let names: Vec<String> =
            safetensors::SafeTensors::deserialize(&std::fs::read(dir.path().join(ADAPTER_FILE)).unwrap())
                .unwrap()
                .names()
                .into_iter()
                .map(String::from)
                .collect();
        assert!(names.contains(&"base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight".to_string()));
        let c: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(ADAPTER_CONFIG_FILE)).unwrap()).unwrap();
        assert_eq!(
            (c["peft_type"].as_str(), c["r"].as_u64(), c["lora_alpha"].as_f64()),
            (Some("LORA"), Some(2), Some(16.0))
        );
        let back = read_adapter(dir.path()).unwrap();
        assert_eq!(back.options, opts);
        // Resumed with another rank: the options that differ are named, not the options' Debug dump.
        let other = LoraOptions { r: 4, ..opts.clone() };
        let e = load_with_adapter(dir.path(), dir.path(), Some(&other), (DType::F32, &Device::Cpu), true)
            .err()
            .expect("another rank is refused")
            .to_string();
        assert!(e.contains("trained with r = 2, the run's [model.lora] says r = 4"), "{e}");
        assert!(!e.contains("LoraOptions") && !e.contains("alpha"), "{e}");
        for (n, v) in &t {
            assert_eq!(
                back.tensors[n].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                v.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
        }
    }

    /// A random tiny `arch` model of `layers` layers saved in `dir`.
    fn tiny_model(dir: &Path, layers: usize, seed: u64) -> ModelConfig {
        let cfg = TinyShape { layers, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Qwen2, 64, None, None)
            .unwrap();
        let model = crate::model::random_decoder(cfg.clone(), seed, DType::F32, &Device::Cpu, false).unwrap();
        crate::model::save_checkpoint(&model, dir, &Default::default(), |_| Ok(())).unwrap();
        cfg
    }

    /// An adapter for `cfg` in `dir`, naming `base` as its base model.
    fn adapter(dir: &Path, cfg: &ModelConfig, base: &str) {
        let opts =
            LoraOptions { r: 2, target_modules: vec!["q_proj".into(), "down_proj".into()], ..Default::default() };
        let t = init_adapters(cfg, &opts, 3, &Device::Cpu).unwrap();
        std::fs::create_dir_all(dir).unwrap();
        write_adapter(dir, &opts, Some(base), t).unwrap();
    }

    fn load_error(base: &Path, adapter: &Path) -> String {
        let e = load_frozen(base, Some(adapter), DType::F32, &Device::Cpu).err().expect("the load must fail");
        e.to_string()
    }

    #[test]
    fn an_adapter_of_another_shape_or_with_unused_tensors_is_refused_naming_its_file() {
        let tmp = tempfile::tempdir().unwrap();
        let (small, big) = (tmp.path().join("small"), tmp.path().join("big"));
        tiny_model(&small, 1, 1);
        let big_cfg = tiny_model(&big, 2, 1);
        let a = tmp.path().join("adapter");
        adapter(&a, &big_cfg, &big.display().to_string());
        load_frozen(&big, Some(&a), DType::F32, &Device::Cpu).unwrap();
        // Trained on 2 layers, applied to 1: the layer-1 adapters would be dropped.
        let e = load_error(&small, &a);
        assert!(e.contains(&a.join(ADAPTER_FILE).display().to_string()), "{e}");
        assert!(e.contains("4 tensors are not adapters") && e.contains(&small.display().to_string()), "{e}");
        assert!(e.contains("model.layers.1.self_attn.q_proj.lora_A.weight"), "{e}");
        // Of another width: the shape is named with both folders.
        let wide_cfg = TinyShape { layers: 1, hidden: 32, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Qwen2, 64, None, None)
            .unwrap();
        let w = tmp.path().join("wide-adapter");
        adapter(&w, &wide_cfg, "wide");
        let e = load_error(&small, &w);
        assert!(e.contains(&w.join(ADAPTER_FILE).display().to_string()) && e.contains("another shape"), "{e}");
        // A full model given as the adapter is said to be one.
        let e = load_error(&small, &big);
        assert!(e.contains("a full model") && e.contains("--model"), "{e}");
    }

    #[test]
    fn the_adapters_base_model_is_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let (m, other) = (tmp.path().join("m"), tmp.path().join("other"));
        let cfg = tiny_model(&m, 1, 1);
        tiny_model(&other, 1, 2);
        let copy = tmp.path().join("copy-of-m");
        std::fs::create_dir_all(&copy).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(m.join(f), copy.join(f)).unwrap();
        }
        let a = tmp.path().join("adapter");
        adapter(&a, &cfg, &m.display().to_string());
        let check = |given: &Path| check_base(&a, &given.display().to_string(), given, "--allow-base-mismatch");
        check(&m).unwrap();
        // A copy of the same weights.
        check(&copy).unwrap();
        // Another model of the same shapes.
        let e = check(&other).unwrap_err().to_string();
        assert!(e.contains(&a.join(ADAPTER_CONFIG_FILE).display().to_string()), "{e}");
        assert!(e.contains(&format!("`{}`", m.display())) && e.contains("--allow-base-mismatch"), "{e}");
        // Trained on another machine: a path that does not exist here is compared by its model name.
        adapter(&a, &cfg, "/elsewhere/models/M");
        check(&m).unwrap();
        assert!(check(&other).is_err());
    }
}
