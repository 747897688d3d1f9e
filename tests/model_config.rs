//! config.json in the layouts transformers 4 and transformers 5 write (fixtures made by
//! scripts/make_config_fixtures.py with transformers 4.57.6 and 5.23.0 from the published configs):
//! every layout gives the same model, and the config.json grpo writes into checkpoints carries the
//! rotary settings exactly as each version writes them itself. (Checked once with the real libraries:
//! `make_config_fixtures.py --check` on those written configs gives identical rotary settings, without
//! warnings, under transformers 4.57.6 and 5.23.0.)

mod common;

use grpo::model::config::RopeScaling;
use grpo::model::ModelConfig;
use serde_json::Value;

const MODELS: [&str; 4] = ["smollm2-135m", "llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b"];
const LAYOUTS: [&str; 3] = ["hub", "transformers4", "transformers5"];

fn path(name: &str, layout: &str) -> std::path::PathBuf {
    common::root().join("tests/fixtures/configs").join(format!("{name}.{layout}.json"))
}

fn load(name: &str, layout: &str) -> ModelConfig {
    ModelConfig::from_file(&path(name, layout)).unwrap_or_else(|e| panic!("{name}.{layout}: {e}"))
}

fn raw(name: &str, layout: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path(name, layout)).unwrap()).unwrap()
}

/// Everything the decoder reads, without the original JSON.
fn model_of(c: &ModelConfig) -> String {
    format!("{:?}", ModelConfig { raw: Value::Null, ..c.clone() })
}

/// JSON with every number as f64 (transformers writes 1000000 or 1000000.0 depending on the source).
fn numbers_as_f64(v: &Value) -> Value {
    match v {
        Value::Number(n) => n.as_f64().unwrap().into(),
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), numbers_as_f64(v))).collect()),
        Value::Array(a) => Value::Array(a.iter().map(numbers_as_f64).collect()),
        other => other.clone(),
    }
}

#[test]
fn every_layout_gives_the_same_model() {
    for name in MODELS {
        let want = model_of(&load(name, "hub"));
        for layout in LAYOUTS {
            assert_eq!(model_of(&load(name, layout)), want, "{name}.{layout}");
        }
    }
    // transformers 5 has no top-level rope_theta: the base must still come out of rope_parameters.
    assert!(raw("smollm2-135m", "transformers5").get("rope_theta").is_none());
    assert_eq!(load("smollm2-135m", "transformers5").rope_theta, 1e5);
    let llama = load("llama-3.2-1b", "transformers5");
    assert_eq!(llama.rope_theta, 5e5);
    assert_eq!(
        llama.rope_scaling,
        RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0
        }
    );
    assert_eq!(load("qwen2.5-0.5b", "transformers5").rope_theta, 1e6);
}

#[test]
fn checkpoint_configs_carry_both_layouts_as_transformers_writes_them() {
    for name in MODELS {
        let (v4, v5) = (raw(name, "transformers4"), raw(name, "transformers5"));
        for layout in LAYOUTS {
            let written = load(name, layout).hf_json("float32");
            // What transformers 4 reads: top-level rope_theta and rope_scaling, as it writes them.
            for key in ["rope_theta", "rope_scaling"] {
                assert_eq!(numbers_as_f64(&written[key]), numbers_as_f64(&v4[key]), "{name}.{layout}: {key}");
            }
            // What transformers 5 reads when rope_scaling is null: rope_parameters, as it writes them.
            assert_eq!(
                numbers_as_f64(&written["rope_parameters"]),
                numbers_as_f64(&v5["rope_parameters"]),
                "{name}.{layout}: rope_parameters"
            );
            assert_eq!((&written["torch_dtype"], &written["dtype"]), (&"float32".into(), &"float32".into()));
            let back = ModelConfig::from_json(written, std::path::Path::new("written")).unwrap();
            assert_eq!(model_of(&back), model_of(&load(name, "hub")), "{name}.{layout}: round trip");
        }
    }
}
