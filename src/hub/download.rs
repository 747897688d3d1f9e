//! One file into the cache: skipped when its snapshot link exists; else, under the blob's lock, a ranged
//! download into `blobs/<etag>.incomplete` (resumed from where it stopped, in this process after a
//! dropped connection or in the next one), its size and sha256 checked, renamed into `blobs/<etag>` and
//! linked from `snapshots/<commit>/<file>`.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::cache::RepoCache;
use super::http::{Client, FileMeta, Sibling};
use super::{io_err, HubError, RepoRef};

/// How many times a dropped connection is resumed before the download fails.
const RETRIES: u32 = 5;
const BUFFER: usize = 1 << 20;

/// What a download needs to know of its repo.
pub struct Ctx<'a> {
    pub hub: &'a Client,
    pub local: &'a RepoCache,
    pub repo: &'a RepoRef,
    pub commit: &'a str,
}

/// The snapshot path of `file`, downloaded first when missing.
pub fn ensure(ctx: &Ctx, file: &Sibling) -> Result<PathBuf, HubError> {
    let name = file.rfilename.as_str();
    let pointer = ctx.local.snapshot_dir(ctx.commit).join(name);
    if pointer.is_file() {
        return Ok(pointer);
    }
    let meta = ctx.hub.head(ctx.repo, ctx.commit, name)?;
    let blob = ctx.local.blob(&meta.etag);
    if !blob.is_file() {
        let _lock = ctx.local.lock(&meta.etag, name)?;
        // Another process may have finished it while this one waited.
        if !blob.is_file() {
            let sha256 = file
                .lfs
                .as_ref()
                .map(|l| l.sha256.clone())
                .or_else(|| is_sha256(&meta.etag).then(|| meta.etag.clone()));
            fetch(ctx, name, &meta, sha256.as_deref(), &blob)?;
        }
    }
    ctx.local.link(ctx.commit, name, &meta.etag)
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Download `meta.url` into `blob` through its `.incomplete` file, resuming it, and check it.
fn fetch(ctx: &Ctx, name: &str, meta: &FileMeta, sha256: Option<&str>, blob: &Path) -> Result<(), HubError> {
    let part = ctx.local.incomplete(&meta.etag);
    let dir = part.parent().unwrap_or(&part);
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let mut out =
        File::options().create(true).truncate(false).read(true).write(true).open(&part).map_err(io_err(&part))?;
    let mut have = out.metadata().map_err(io_err(&part))?.len();
    if have > meta.size {
        out.set_len(0).map_err(io_err(&part))?;
        have = 0;
    }
    let mut hasher = Sha256::new();
    if have > 0 {
        tracing::info!("resuming {name} at {have} of {} bytes", meta.size);
        hash_prefix(&mut out, have, &mut hasher).map_err(io_err(&part))?;
    }
    tracing::info!("downloading {name} ({} bytes) of {}", meta.size, ctx.repo.name());
    let bar = bytes_bar(meta.size, name);
    bar.set_position(have);
    let started = Instant::now();
    let mut tries = 0;
    let mut sink = Sink { writer: Writer::start(out, hasher, have), path: &part, have: &mut have };
    while *sink.have < meta.size {
        match receive(ctx, name, meta, &mut sink, &bar) {
            Ok(()) => {}
            Err(Dropped(message)) if tries < RETRIES => {
                tries += 1;
                tracing::warn!(
                    "{name}: {message} at {} of {} bytes; resuming (try {tries} of {RETRIES})",
                    sink.have,
                    meta.size
                );
                std::thread::sleep(Duration::from_millis(200 << tries.min(5)));
            }
            Err(Dropped(message)) => return Err(HubError::Transport { url: meta.url.clone(), message }),
            Err(Fatal(e)) => return Err(e),
        }
    }
    bar.finish_and_clear();
    let hasher = sink.writer.finish().map_err(io_err(&part))?;
    if let Some(expected) = sha256 {
        let found = format!("{:x}", hasher.finalize());
        if !found.eq_ignore_ascii_case(expected) {
            std::fs::remove_file(&part).map_err(io_err(&part))?;
            let repo = ctx.repo.name();
            return Err(HubError::Checksum { repo, file: name.into(), expected: expected.into(), found });
        }
    }
    std::fs::rename(&part, blob).map_err(io_err(blob))?;
    let secs = started.elapsed().as_secs_f64().max(1e-3);
    tracing::info!("downloaded {name}: {} bytes in {secs:.1} s ({:.1} MB/s)", meta.size, meta.size as f64 / secs / 1e6);
    Ok(())
}

/// Feed the first `len` bytes of `file` to `hasher`, leaving the file at its end for appending.
fn hash_prefix(file: &mut File, len: u64, hasher: &mut Sha256) -> std::io::Result<()> {
    file.rewind()?;
    let mut buf = vec![0u8; BUFFER];
    let mut left = len;
    while left > 0 {
        let n = file.read(&mut buf[..BUFFER.min(left as usize)])?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    file.seek(std::io::SeekFrom::Start(len))?;
    Ok(())
}

/// The partial file being written (by its [`Writer`]) and the bytes received so far.
struct Sink<'a> {
    writer: Writer,
    path: &'a Path,
    have: &'a mut u64,
}

/// What the network side hands the writer.
enum Piece {
    Bytes(Vec<u8>),
    /// The server ignored the range: the file starts again.
    Restart,
}

/// Bytes between the writes whose writeback is started (Linux: sync_file_range), so that the fsync at the
/// end waits for the last piece only.
const WRITEBACK: u64 = 32 << 20;

/// Writes and hashes a download's bytes on a thread of its own while the next ones arrive, starting the
/// disk's writeback as it goes; [`Writer::finish`] syncs the file and gives the hash.
struct Writer {
    tx: Option<std::sync::mpsc::SyncSender<Piece>>,
    worker: Option<std::thread::JoinHandle<std::io::Result<Sha256>>>,
}

impl Writer {
    /// A writer appending to `file`, which holds `at` bytes already hashed into `hasher`.
    fn start(mut file: File, mut hasher: Sha256, at: u64) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Piece>(16);
        let worker = std::thread::spawn(move || {
            let (mut at, mut started) = (at, at);
            for piece in rx {
                match piece {
                    Piece::Bytes(b) => {
                        file.write_all(&b)?;
                        hasher.update(&b);
                        at += b.len() as u64;
                        if at - started >= WRITEBACK {
                            start_writeback(&file, started, at - started);
                            started = at;
                        }
                    }
                    Piece::Restart => {
                        file.set_len(0)?;
                        file.rewind()?;
                        (hasher, at, started) = (Sha256::new(), 0, 0);
                    }
                }
            }
            file.sync_all()?;
            Ok(hasher)
        });
        Self { tx: Some(tx), worker: Some(worker) }
    }

    /// Hand `piece` over; a write that failed is this call's error.
    fn send(&mut self, piece: Piece) -> std::io::Result<()> {
        match self.tx.as_ref().map(|tx| tx.send(piece)) {
            Some(Ok(())) => Ok(()),
            _ => Err(self.join().err().unwrap_or_else(|| std::io::Error::other("the download's writer stopped"))),
        }
    }

    fn join(&mut self) -> std::io::Result<Sha256> {
        self.tx = None;
        match self.worker.take().map(|w| w.join()) {
            Some(Ok(r)) => r,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            None => Err(std::io::Error::other("the download's writer already stopped")),
        }
    }

    /// Every byte written and synced: the hash of the file.
    fn finish(mut self) -> std::io::Result<Sha256> {
        self.join()
    }
}

/// Start writing `len` bytes of `file` from `offset` back to the disk, without waiting (Linux).
fn start_writeback(file: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor is open for the call; the flags only start the writeback of the range.
        unsafe {
            libc::sync_file_range(file.as_raw_fd(), offset as i64, len as i64, libc::SYNC_FILE_RANGE_WRITE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}

/// Why one request ended before the file was whole.
enum Stop {
    /// The connection failed: resume.
    Dropped(String),
    Fatal(HubError),
}
use Stop::{Dropped, Fatal};

/// One ranged request from `sink.have` on, appended to the sink until the body ends or fails.
fn receive(ctx: &Ctx, name: &str, meta: &FileMeta, sink: &mut Sink, bar: &indicatif::ProgressBar) -> Result<(), Stop> {
    let resp = match ctx.hub.get(&meta.url, *sink.have, ctx.repo, name) {
        Ok(r) => r,
        Err(HubError::Transport { message, .. }) => return Err(Dropped(message)),
        Err(e) => return Err(Fatal(e)),
    };
    match resp.status().as_u16() {
        206 => {}
        // The server ignored the range (or this is the start): begin again.
        _ if *sink.have > 0 => {
            tracing::info!("{name}: the server does not resume; downloading from the start");
            restart(sink).map_err(|e| Fatal(io_err(sink.path)(e)))?;
            bar.set_position(0);
        }
        _ => {}
    }
    let mut body = resp.into_body().into_reader();
    let mut buf = vec![0u8; BUFFER];
    loop {
        let n = match body.read(&mut buf) {
            Ok(0) if *sink.have < meta.size => return Err(Dropped("the connection closed early".into())),
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) => return Err(Dropped(e.to_string())),
        };
        let n = n.min((meta.size - *sink.have) as usize);
        sink.writer.send(Piece::Bytes(buf[..n].to_vec())).map_err(|e| Fatal(io_err(sink.path)(e)))?;
        *sink.have += n as u64;
        bar.set_position(*sink.have);
        if *sink.have == meta.size {
            return Ok(());
        }
    }
}

fn restart(sink: &mut Sink) -> std::io::Result<()> {
    sink.writer.send(Piece::Restart)?;
    *sink.have = 0;
    Ok(())
}

/// A bar over the bytes of one file: drawn on a terminal, log lines elsewhere.
fn bytes_bar(size: u64, name: &str) -> indicatif::ProgressBar {
    let bar = crate::progress::progress_bar(Some(size), name);
    let template = if crate::progress::on_terminal() {
        "{spinner} {prefix} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ({eta})"
    } else {
        "{prefix}: {bytes}/{total_bytes} ({percent}%), {bytes_per_sec}, ETA {eta_precise}"
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}
