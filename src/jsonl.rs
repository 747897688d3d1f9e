//! Line-oriented JSON input and output shared by every subcommand that reads or writes JSONL.
//!
//! Reading never stops at a bad line: each line comes back with its 1-based number and either its
//! parsed value or the reason it could not be read (invalid UTF-8, bad JSON), so that callers can
//! report `file:line: reason` and keep going, or stop in strict mode.
//! Files ending in `.gz` or `.zst` are decompressed on the fly; `-` is standard input.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// Why one line could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    #[error("line is not valid UTF-8 (at byte {0})")]
    Utf8(usize),
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Opening or reading a whole file failed.
#[derive(Debug, thiserror::Error)]
pub enum JsonlError {
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{path}: read error after line {line}: {source}")]
    Read { path: PathBuf, line: u64, source: io::Error },
}

/// Open a possibly compressed file (or `-` for stdin) as a buffered byte reader.
pub fn open_reader(path: &Path) -> Result<Box<dyn BufRead + Send>, JsonlError> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(BufReader::new(io::stdin())));
    }
    let file = File::open(path).map_err(|source| JsonlError::Open { path: path.to_path_buf(), source })?;
    let name = path.to_string_lossy();
    let inner: Box<dyn Read + Send> = if name.ends_with(".gz") {
        Box::new(flate2::read::MultiGzDecoder::new(file))
    } else if name.ends_with(".zst") || name.ends_with(".zstd") {
        let dec = zstd::stream::read::Decoder::new(file)
            .map_err(|source| JsonlError::Open { path: path.to_path_buf(), source })?;
        Box::new(dec)
    } else {
        Box::new(file)
    };
    Ok(Box::new(BufReader::with_capacity(1 << 20, inner)))
}

/// One raw line: its number and its bytes without the trailing newline.
pub struct RawLine {
    pub number: u64,
    pub bytes: Vec<u8>,
}

impl RawLine {
    /// The line as text, or where it stops being UTF-8.
    pub fn text(&self) -> Result<&str, LineError> {
        std::str::from_utf8(&self.bytes).map_err(|e| LineError::Utf8(e.valid_up_to()))
    }

    /// The line parsed as JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, LineError> {
        let text = self.text()?;
        Ok(serde_json::from_str(text)?)
    }

    /// True for a line with nothing but whitespace (skipped silently by readers).
    pub fn is_blank(&self) -> bool {
        self.bytes.iter().all(|b| b.is_ascii_whitespace())
    }
}

/// Iterator over the raw lines of a file; blank lines are skipped, numbering counts them.
pub struct Lines {
    path: PathBuf,
    reader: Box<dyn BufRead + Send>,
    number: u64,
    /// Total bytes consumed so far (of the decompressed stream).
    pub bytes_read: u64,
}

impl Lines {
    pub fn open(path: &Path) -> Result<Self, JsonlError> {
        Ok(Self { path: path.to_path_buf(), reader: open_reader(path)?, number: 0, bytes_read: 0 })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Iterator for Lines {
    type Item = Result<RawLine, JsonlError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let mut buf = Vec::new();
            match self.reader.read_until(b'\n', &mut buf) {
                Ok(0) => return None,
                Ok(n) => {
                    self.number += 1;
                    self.bytes_read += n as u64;
                    while matches!(buf.last(), Some(b'\n' | b'\r')) {
                        buf.pop();
                    }
                    let line = RawLine { number: self.number, bytes: buf };
                    if line.is_blank() {
                        continue;
                    }
                    return Some(Ok(line));
                }
                Err(source) => {
                    return Some(Err(JsonlError::Read { path: self.path.clone(), line: self.number, source }))
                }
            }
        }
    }
}

/// An output file written to a temporary file next to PATH and moved into place by
/// [`AtomicFile::commit`] (see [`crate::fsio`]), or stdout. Dropping it without commit leaves any
/// previous file at PATH untouched.
pub struct AtomicFile {
    out: Output,
}

enum Output {
    File { target: PathBuf, writer: BufWriter<tempfile::NamedTempFile> },
    Stdout(BufWriter<io::Stdout>),
}

impl AtomicFile {
    /// `None` or `-` writes to stdout.
    pub fn create(path: Option<&Path>) -> io::Result<Self> {
        let out = match path {
            Some(p) if p.as_os_str() != "-" => Output::File {
                target: p.to_path_buf(),
                writer: BufWriter::with_capacity(1 << 20, crate::fsio::temp_file(p)?),
            },
            _ => Output::Stdout(BufWriter::new(io::stdout())),
        };
        Ok(Self { out })
    }

    /// Write one JSON value as a line.
    pub fn write_json<T: serde::Serialize>(&mut self, value: &T) -> io::Result<()> {
        serde_json::to_writer(&mut *self, value)?;
        self.write_all(b"\n")
    }

    /// Flush, sync and move into place.
    pub fn commit(self) -> io::Result<()> {
        match self.out {
            Output::File { target, writer } => crate::fsio::persist(writer.into_inner()?, &target),
            Output::Stdout(mut w) => w.flush(),
        }
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.out {
            Output::File { writer, .. } => writer.write(buf),
            Output::Stdout(w) => w.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match &mut self.out {
            Output::File { writer, .. } => writer.flush(),
            Output::Stdout(w) => w.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_numbered_and_bad_ones_reported() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl");
        std::fs::write(&p, b"{\"a\":1}\n\n{bad\n\xff\xfe\n{\"a\":2}\r\n").unwrap();
        let lines: Vec<_> = Lines::open(&p).unwrap().map(|l| l.unwrap()).collect();
        assert_eq!(lines.iter().map(|l| l.number).collect::<Vec<_>>(), vec![1, 3, 4, 5]);
        assert!(lines[0].json::<serde_json::Value>().is_ok());
        assert!(matches!(lines[1].json::<serde_json::Value>(), Err(LineError::Json(_))));
        assert!(matches!(lines[2].json::<serde_json::Value>(), Err(LineError::Utf8(0))));
        assert_eq!(lines[3].json::<serde_json::Value>().unwrap()["a"], 2);
    }

    #[test]
    fn gzip_and_zstd_are_transparent() {
        let dir = tempfile::tempdir().unwrap();
        let gz = dir.path().join("x.jsonl.gz");
        let mut enc = flate2::write::GzEncoder::new(File::create(&gz).unwrap(), flate2::Compression::fast());
        enc.write_all(b"{\"a\":1}\n{\"a\":2}\n").unwrap();
        enc.finish().unwrap();
        assert_eq!(Lines::open(&gz).unwrap().count(), 2);
        let zs = dir.path().join("x.jsonl.zst");
        std::fs::write(&zs, zstd::encode_all(&b"{\"a\":1}\n"[..], 1).unwrap()).unwrap();
        assert_eq!(Lines::open(&zs).unwrap().count(), 1);
    }

    #[test]
    fn atomic_file_only_replaces_on_commit() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.jsonl");
        std::fs::write(&p, "old\n").unwrap();
        {
            let mut f = AtomicFile::create(Some(&p)).unwrap();
            f.write_json(&1).unwrap();
        }
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "old\n");
        // The dropped temporary file is gone.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let mut f = AtomicFile::create(Some(&p)).unwrap();
        f.write_json(&serde_json::json!({"x": 1})).unwrap();
        f.commit().unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"x\":1}\n");
    }
}
