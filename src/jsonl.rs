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
    #[error("line too large: {bytes} bytes > limit of {limit} bytes (skipped unread)")]
    TooLarge { bytes: u64, limit: usize },
}

/// Opening or reading a whole file failed.
#[derive(Debug, thiserror::Error)]
pub enum JsonlError {
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{path}: read error after line {line}: {source}")]
    Read { path: PathBuf, line: u64, source: io::Error },
    #[error("{path}: named .{suffix} but not {format}-compressed: {found}")]
    NotCompressed { path: PathBuf, suffix: String, format: &'static str, found: String },
}

/// What a file whose first bytes are `head` looks like, from its magic bytes, and the name it would
/// read under.
fn looks_like(head: &[u8]) -> String {
    let kind = match head {
        [0x1f, 0x8b, ..] => Some(("a gzip file", "rename it to .gz")),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Some(("a zstd file", "rename it to .zst")),
        [b'B', b'Z', b'h', ..] => Some(("a bzip2 file", "decompress it first (bunzip2)")),
        [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => Some(("an xz file", "decompress it first (unxz)")),
        [b'P', b'A', b'R', b'1', ..] => Some(("a Parquet file", "rename it to .parquet")),
        [b'P', b'K', 3, 4, ..] => Some(("a zip archive", "extract it first")),
        _ => None,
    };
    if let Some((what, fix)) = kind {
        return format!("its first bytes are those of {what} ({fix})");
    }
    // A multi-byte character cut at the end of `head` is still text.
    let text = match std::str::from_utf8(head) {
        Ok(t) => t,
        Err(e) => std::str::from_utf8(&head[..e.valid_up_to()]).unwrap_or_default(),
    };
    let printable = text.chars().all(|c| !c.is_control() || c.is_whitespace());
    if !text.is_empty() && printable && text.len() + 4 >= head.len() {
        let what = if text.trim_start().starts_with('{') { "plain JSON text" } else { "plain text" };
        return format!("it is {what}, not compressed (drop the suffix)");
    }
    let hex: Vec<String> = head.iter().take(4).map(|b| format!("{b:02x}")).collect();
    format!("its first bytes, {}, are of no format known here", hex.join(" "))
}

/// Check that a file named as compressed in `format` starts with that format's magic bytes `magic`.
fn check_magic(
    reader: &mut BufReader<File>,
    path: &Path,
    format: &'static str,
    magic: &[u8],
) -> Result<(), JsonlError> {
    let head = reader.fill_buf().map_err(|source| JsonlError::Open { path: path.to_path_buf(), source })?;
    if head.is_empty() || head.starts_with(magic) {
        return Ok(());
    }
    let head = &head[..head.len().min(64)];
    let suffix = path.extension().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default();
    Err(JsonlError::NotCompressed { path: path.to_path_buf(), suffix, format, found: looks_like(head) })
}

/// Open a possibly compressed file (or `-` for stdin) as a buffered byte reader.
pub fn open_reader(path: &Path) -> Result<Box<dyn BufRead + Send>, JsonlError> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(BufReader::new(io::stdin())));
    }
    let file = File::open(path).map_err(|source| JsonlError::Open { path: path.to_path_buf(), source })?;
    let name = path.to_string_lossy();
    let inner: Box<dyn Read + Send> = if name.ends_with(".gz") {
        let mut file = BufReader::new(file);
        check_magic(&mut file, path, "gzip", &[0x1f, 0x8b])?;
        Box::new(flate2::read::MultiGzDecoder::new(file))
    } else if name.ends_with(".zst") || name.ends_with(".zstd") {
        let mut file = BufReader::new(file);
        check_magic(&mut file, path, "zstd", &[0x28, 0xb5, 0x2f, 0xfd])?;
        let dec = zstd::stream::read::Decoder::with_buffer(file)
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
    /// Set when the line was longer than the reader's limit: its length in bytes. Such a line was
    /// skipped while it was read and `bytes` is empty.
    pub too_large: Option<(u64, usize)>,
}

impl RawLine {
    /// A line read whole.
    pub fn new(number: u64, bytes: Vec<u8>) -> Self {
        Self { number, bytes, too_large: None }
    }

    /// The line as text, or where it stops being UTF-8 (or that it was too large to be read).
    pub fn text(&self) -> Result<&str, LineError> {
        if let Some((bytes, limit)) = self.too_large {
            return Err(LineError::TooLarge { bytes, limit });
        }
        std::str::from_utf8(&self.bytes).map_err(|e| LineError::Utf8(e.valid_up_to()))
    }

    /// The line parsed as JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, LineError> {
        let text = self.text()?;
        Ok(serde_json::from_str(text)?)
    }

    /// True for a line with nothing but whitespace (skipped silently by readers).
    pub fn is_blank(&self) -> bool {
        self.too_large.is_none() && self.bytes.iter().all(|b| b.is_ascii_whitespace())
    }
}

/// The line limit of [`Lines::open`]: generous, for files this program wrote itself (a generations file
/// holds every response to a problem on one line); user inputs set their own with
/// [`Lines::max_line_bytes`].
pub const DEFAULT_MAX_LINE_BYTES: usize = 1 << 30;

/// Iterator over the raw lines of a file; blank lines are skipped, numbering counts them.
///
/// Memory is bounded by the line limit: a longer line is consumed without being kept and comes back
/// with [`RawLine::too_large`] set.
pub struct Lines {
    path: PathBuf,
    reader: Box<dyn BufRead + Send>,
    number: u64,
    max_line_bytes: usize,
    /// Total bytes consumed so far (of the decompressed stream).
    pub bytes_read: u64,
}

impl Lines {
    pub fn open(path: &Path) -> Result<Self, JsonlError> {
        Ok(Self {
            path: path.to_path_buf(),
            reader: open_reader(path)?,
            number: 0,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            bytes_read: 0,
        })
    }

    /// Lines longer than `max` bytes (without the newline) are skipped while they are read.
    pub fn max_line_bytes(mut self, max: usize) -> Self {
        self.max_line_bytes = max;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Read one line into `buf`, keeping at most `max_line_bytes + 2` bytes (the line and `\r\n`).
    /// Returns the number of bytes consumed (0 at the end) and whether the line ended with a newline.
    fn read_bounded(&mut self, buf: &mut Vec<u8>) -> io::Result<(u64, bool)> {
        let keep = self.max_line_bytes.saturating_add(2);
        let mut consumed = 0u64;
        loop {
            let chunk = match self.reader.fill_buf() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if chunk.is_empty() {
                return Ok((consumed, false));
            }
            let (take, end) = match chunk.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (chunk.len(), false),
            };
            let room = keep.saturating_sub(buf.len()).min(take);
            buf.extend_from_slice(&chunk[..room]);
            self.reader.consume(take);
            consumed += take as u64;
            if end {
                return Ok((consumed, true));
            }
        }
    }
}

impl Iterator for Lines {
    type Item = Result<RawLine, JsonlError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let mut buf = Vec::new();
            match self.read_bounded(&mut buf) {
                Ok((0, _)) => return None,
                Ok((n, newline)) => {
                    self.number += 1;
                    self.bytes_read += n;
                    let truncated = n > buf.len() as u64;
                    while matches!(buf.last(), Some(b'\n' | b'\r')) {
                        buf.pop();
                    }
                    let line = if truncated || buf.len() > self.max_line_bytes {
                        let len = if truncated { n - u64::from(newline) } else { buf.len() as u64 };
                        RawLine { number: self.number, bytes: Vec::new(), too_large: Some((len, self.max_line_bytes)) }
                    } else {
                        RawLine::new(self.number, buf)
                    };
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
    fn long_lines_are_skipped_while_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl.gz");
        let mut enc = flate2::write::GzEncoder::new(File::create(&p).unwrap(), flate2::Compression::fast());
        enc.write_all(b"{\"a\":1}\n\"").unwrap();
        for _ in 0..64 {
            enc.write_all(&[b'x'; 1 << 16]).unwrap();
        }
        enc.write_all(b"\"\r\n{\"a\":22}\r\n{\"a\":3}").unwrap();
        enc.finish().unwrap();
        let lines: Vec<_> = Lines::open(&p).unwrap().max_line_bytes(9).map(|l| l.unwrap()).collect();
        assert_eq!(lines.iter().map(|l| l.number).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        assert_eq!(lines[1].too_large, Some(((1 << 22) + 3, 9)));
        assert!(lines[1].bytes.capacity() <= 64, "the long line was kept: {}", lines[1].bytes.capacity());
        assert!(matches!(lines[1].json::<serde_json::Value>(), Err(LineError::TooLarge { .. })));
        assert_eq!(lines[2].json::<serde_json::Value>().unwrap()["a"], 22);
        let lines: Vec<_> = Lines::open(&p).unwrap().max_line_bytes(7).map(|l| l.unwrap()).collect();
        assert_eq!(lines.iter().map(|l| l.too_large.is_some()).collect::<Vec<_>>(), [false, true, true, false]);
    }

    #[test]
    fn a_file_named_as_compressed_in_another_format_says_what_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let gz = dir.path().join("x.jsonl.zst");
        let mut enc = flate2::write::GzEncoder::new(File::create(&gz).unwrap(), flate2::Compression::fast());
        enc.write_all(b"{\"a\":1}\n").unwrap();
        enc.finish().unwrap();
        let e = Lines::open(&gz).err().unwrap().to_string();
        assert!(e.ends_with("x.jsonl.zst: named .zst but not zstd-compressed: its first bytes are those of a gzip file (rename it to .gz)"), "{e}");
        let plain = dir.path().join("y.jsonl.gz");
        std::fs::write(&plain, "{\"a\": \"é\"}\n").unwrap();
        let e = Lines::open(&plain).err().unwrap().to_string();
        assert!(
            e.ends_with("named .gz but not gzip-compressed: it is plain JSON text, not compressed (drop the suffix)"),
            "{e}"
        );
        std::fs::write(&plain, [0u8, 1, 2, 3, 4, 5]).unwrap();
        let e = Lines::open(&plain).err().unwrap().to_string();
        assert!(e.ends_with("its first bytes, 00 01 02 03, are of no format known here"), "{e}");
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
        // The usual permissions (0644 under umask 022), not a temporary file's owner-only 0600.
        use std::os::unix::fs::PermissionsExt;
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let umask = status.lines().find_map(|l| l.strip_prefix("Umask:")).unwrap().trim();
        let expected = 0o666 & !u32::from_str_radix(umask, 8).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, expected);
    }
}
