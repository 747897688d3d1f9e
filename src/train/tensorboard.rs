//! TensorBoard event files (`[train] report_to = ["tensorboard"]`, TRL's option): every line of
//! metrics.jsonl is also written as scalars to OUTPUT/tensorboard/events.out.tfevents.*, which
//! `tensorboard --logdir OUTPUT` shows.
//!
//! The format is TensorFlow's record file of `Event` protocol buffers: each record is
//! `u64 length (LE) | u32 masked crc32c(length) | data | u32 masked crc32c(data)`, the first event holds
//! the file version `brain.Event:2`, each later one a step's `Summary` of `simple_value` scalars.
//!
//! Why these crates: the messages are encoded with `prost` (the maintained protobuf crate; its derive
//! needs only the proc-macro crates already in the build, and the three messages written are declared
//! here with their TensorFlow field numbers, so there is no .proto compile step), the checksum by
//! `crc32c` (hardware CRC-32C). `tfrecord` brings TensorFlow's whole generated proto set (and async and
//! serde layers), `tensorboard-rs` the `protobuf` runtime and image codecs: much longer builds on a small
//! machine for the same three messages.
//!
//! A resumed run starts a new event file whose first event is a `SessionLog` START at the resumed step:
//! TensorBoard then drops the earlier file's events from that step on, as metrics.jsonl drops its lines.

use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};

use prost::Message;

/// `tensorflow.Event` (the fields written).
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a scalar (`simple_value`).
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// `tensorflow.SessionLog` (status START = 1).
#[derive(Clone, PartialEq, prost::Message)]
struct SessionLog {
    #[prost(int32, tag = "1")]
    status: i32,
}

const SESSION_START: i32 = 1;

/// TFRecord's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One record: length, its checksum, the data, its checksum.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// An open event file.
pub struct EventWriter {
    path: PathBuf,
    file: File,
}

impl EventWriter {
    /// A new event file in `dir` (created). `resumed_step`: the run continues after this step, and
    /// TensorBoard is told to drop what earlier files logged after it.
    pub fn create(dir: &Path, resumed_step: Option<usize>) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let wall = now();
        let name = format!("events.out.tfevents.{}.grpo.{}", wall as u64, std::process::id());
        let path = dir.join(name);
        let file = File::create(&path)?;
        let mut w = Self { path, file };
        w.write(&Event { wall_time: wall, step: 0, what: Some(What::FileVersion("brain.Event:2".into())) })?;
        if let Some(step) = resumed_step {
            let start = What::SessionLog(SessionLog { status: SESSION_START });
            w.write(&Event { wall_time: wall, step: step as i64 + 1, what: Some(start) })?;
        }
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, e: &Event) -> std::io::Result<()> {
        self.file.write_all(&record(&e.encode_to_vec()))?;
        self.file.flush()
    }

    /// One event of `step` holding the scalars `values` (tag, value).
    pub fn scalars(&mut self, step: usize, values: &[(String, f64)]) -> std::io::Result<()> {
        let value =
            values.iter().map(|(tag, v)| SummaryValue { tag: tag.clone(), simple_value: Some(*v as f32) }).collect();
        self.write(&Event { wall_time: now(), step: step as i64, what: Some(What::Summary(Summary { value })) })
    }
}

/// The scalars of one metrics record: every number (and boolean, as 0/1) of its JSON object but `step`,
/// tagged `train/KEY` (the Hugging Face Trainer's prefix), or `KEY` when it already names its section
/// (`rollout/...`, `validation/...`).
pub fn scalars_of(record: &serde_json::Value) -> Vec<(String, f64)> {
    let Some(obj) = record.as_object() else { return Vec::new() };
    obj.iter()
        .filter(|(k, _)| k.as_str() != "step")
        .filter_map(|(k, v)| {
            let x = v.as_f64().or_else(|| v.as_bool().map(|b| f64::from(u8::from(b))))?;
            let tag = if k.contains('/') { k.clone() } else { format!("train/{k}") };
            Some((tag, x))
        })
        .collect()
}

/// A scalar read back from an event file.
#[derive(Debug, Clone, PartialEq)]
pub struct Scalar {
    pub step: i64,
    pub tag: String,
    pub value: f32,
}

/// The scalars of an event file, checking each record's checksums (to inspect a run's TensorBoard logs
/// without TensorBoard).
pub fn read_scalars(path: &Path) -> std::io::Result<Vec<Scalar>> {
    let bad =
        |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {what}", path.display()));
    let mut r = BufReader::new(File::open(path)?);
    let mut out = Vec::new();
    let mut header = [0u8; 12];
    let mut index = 0usize;
    loop {
        match r.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e),
        }
        let (len, crc) = header.split_at(8);
        if masked_crc(len).to_le_bytes() != crc {
            return Err(bad(format!("record {index}: bad length checksum")));
        }
        let n = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
        let mut data = vec![0u8; n + 4];
        r.read_exact(&mut data)?;
        let (data, crc) = data.split_at(n);
        if masked_crc(data).to_le_bytes() != crc {
            return Err(bad(format!("record {index}: bad data checksum")));
        }
        let event = Event::decode(data).map_err(|e| bad(format!("record {index}: {e}")))?;
        if let Some(What::Summary(s)) = event.what {
            for v in s.value {
                if let Some(value) = v.simple_value {
                    out.push(Scalar { step: event.step, tag: v.tag, value });
                }
            }
        }
        index += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflow() {
        // TensorFlow's crc32c test vector ("123456789" -> 0xe3069283) and its masking.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xe3069283u32.rotate_right(15).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn scalars_round_trip_and_damage_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let record = serde_json::json!({
            "step": 3, "loss": 0.5, "learning_rate": 1e-5, "skipped": false, "validation/score": 0.25,
            "rollout/reward_mean": 0.75
        });
        let values = scalars_of(&record);
        assert!(values.contains(&("train/loss".into(), 0.5)));
        assert!(values.contains(&("train/skipped".into(), 0.0)));
        assert!(values.contains(&("validation/score".into(), 0.25)));
        assert!(!values.iter().any(|(t, _)| t.ends_with("step")));
        let mut w = EventWriter::create(dir.path(), None).unwrap();
        w.scalars(3, &values).unwrap();
        w.scalars(4, &[("train/loss".into(), 0.25)]).unwrap();
        let path = w.path().to_path_buf();
        let back = read_scalars(&path).unwrap();
        assert_eq!(back.len(), values.len() + 1);
        assert!(back.contains(&Scalar { step: 3, tag: "train/learning_rate".into(), value: 1e-5 }));
        assert!(back.contains(&Scalar { step: 4, tag: "train/loss".into(), value: 0.25 }));
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert!(read_scalars(&path).unwrap_err().to_string().contains("checksum"));
    }
}
