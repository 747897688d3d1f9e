//! The device and the dtype as a config or a command line names them: one parser and one message each,
//! read by serde (`model.device`, `model.dtype`, `train.save_dtype`) and by clap (`--device`, `--dtype`)
//! alike, and written back in one form (a dtype in its short name).

use std::fmt;
use std::str::FromStr;

use candle_core::DType;

/// A name that is not one of those a device or a dtype may have.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("unknown {what} `{given}` (expected {expected})")]
pub struct UnknownName {
    what: &'static str,
    given: String,
    expected: &'static str,
}

/// A compute device: `cpu`, `cuda` (the first GPU; on several ranks each rank's own) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceName {
    #[default]
    Cpu,
    /// A GPU: `cuda` (None) or `cuda:N`.
    Cuda(Option<usize>),
}

impl DeviceName {
    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }

    /// The GPU's ordinal (`cuda` is GPU 0); None on the CPU.
    pub fn ordinal(self) -> Option<usize> {
        match self {
            Self::Cpu => None,
            Self::Cuda(n) => Some(n.unwrap_or(0)),
        }
    }
}

impl FromStr for DeviceName {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, UnknownName> {
        let unknown = || UnknownName { what: "device", given: s.to_string(), expected: "cpu, cuda or cuda:N" };
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(None)),
            _ => s.strip_prefix("cuda:").and_then(|n| n.parse().ok()).map(|n| Self::Cuda(Some(n))).ok_or_else(unknown),
        }
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(None) => f.write_str("cuda"),
            Self::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

/// The dtype of weights and activations: `f32`, `bf16` or `f16` (also read as `float32`, `bfloat16`,
/// `float16`, transformers' `torch_dtype` names; written in the short form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DTypeName {
    #[default]
    F32,
    Bf16,
    F16,
}

impl DTypeName {
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }

    /// Bytes an element.
    pub fn size_in_bytes(self) -> usize {
        self.dtype().size_in_bytes()
    }
}

impl FromStr for DTypeName {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, UnknownName> {
        match s {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "f16" | "float16" => Ok(Self::F16),
            _ => Err(UnknownName { what: "dtype", given: s.to_string(), expected: "f32, bf16 or f16" }),
        }
    }
}

impl fmt::Display for DTypeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        })
    }
}

macro_rules! as_string {
    ($t:ty) => {
        impl TryFrom<String> for $t {
            type Error = UnknownName;

            fn try_from(s: String) -> Result<Self, UnknownName> {
                s.parse()
            }
        }

        impl From<$t> for String {
            fn from(v: $t) -> String {
                v.to_string()
            }
        }
    };
}

as_string!(DeviceName);
as_string!(DTypeName);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_read_and_write_as_named() {
        for (s, d) in
            [("cpu", DeviceName::Cpu), ("cuda", DeviceName::Cuda(None)), ("cuda:3", DeviceName::Cuda(Some(3)))]
        {
            assert_eq!(s.parse::<DeviceName>().unwrap(), d);
            assert_eq!(d.to_string(), s);
        }
        assert_eq!(DeviceName::Cuda(None).ordinal(), Some(0));
        assert_eq!(DeviceName::Cpu.ordinal(), None);
        for bad in ["gpu", "cuda:", "cuda:x", "CPU", "cuda:-1", ""] {
            let e = bad.parse::<DeviceName>().unwrap_err().to_string();
            assert_eq!(e, format!("unknown device `{bad}` (expected cpu, cuda or cuda:N)"));
        }
    }

    #[test]
    fn dtypes_read_both_names_and_write_the_short_one() {
        for (s, d) in [("f32", DTypeName::F32), ("bfloat16", DTypeName::Bf16), ("float16", DTypeName::F16)] {
            assert_eq!(s.parse::<DTypeName>().unwrap(), d);
        }
        assert_eq!(DTypeName::Bf16.to_string(), "bf16");
        assert_eq!(DTypeName::Bf16.size_in_bytes(), 2);
        let e = "f64".parse::<DTypeName>().unwrap_err().to_string();
        assert_eq!(e, "unknown dtype `f64` (expected f32, bf16 or f16)");
    }

    #[test]
    fn a_config_key_names_the_value_it_refuses() {
        #[derive(Debug, serde::Deserialize, serde::Serialize)]
        struct Section {
            device: DeviceName,
            dtype: DTypeName,
        }
        let s: Section = toml::from_str("device = \"cuda:1\"\ndtype = \"bfloat16\"").unwrap();
        assert_eq!((s.device, s.dtype), (DeviceName::Cuda(Some(1)), DTypeName::Bf16));
        assert_eq!(toml::to_string(&s).unwrap(), "device = \"cuda:1\"\ndtype = \"bf16\"\n");
        let e = toml::from_str::<Section>("device = \"gpu\"\ndtype = \"f32\"").unwrap_err().to_string();
        assert!(e.contains("unknown device `gpu` (expected cpu, cuda or cuda:N)") && e.contains("device"), "{e}");
    }
}
